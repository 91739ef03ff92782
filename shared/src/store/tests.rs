//! The task store against the embedded engine: lifecycle, results, the poll index, pacing.

use super::*;
use crate::codes::ErrorCode;
use crate::domain::Solution;
use crate::domain::{CaptchaId, CaptchaKind, IncomingResult, Outcome, Task, TaskRef, TaskState, Via};
use crate::testkit::LocalDynamo;
use crate::time::Timestamp;

fn t(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn id(v: &str) -> CaptchaId {
    CaptchaId::parse(v).expect("id")
}

fn delivery(captcha: &str, outcome: Outcome, at: u64) -> IncomingResult {
    IncomingResult {
        captcha_id: id(captcha),
        outcome,
        received_at: t(at),
        via: Via::Callback,
        token_clock_start: t(at),
    }
}

fn solved(token: &str) -> Outcome {
    Outcome::Solved(Solution::parse(token).expect("token"))
}

/// A running engine and a store on a new table. Keep the engine alive for the test.
async fn engine() -> anyhow::Result<(LocalDynamo, TaskStore)> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    Ok((db, store))
}

/// A task just recorded (submitting), created at t=1 s with its deadline at t=600 s.
async fn submitting(store: &TaskStore, kind: CaptchaKind) -> Task {
    let task = Task::new(TaskRef::generate(), kind, t(1_000));
    assert_eq!(store.tasks().create(&task, t(600_000), None).await.expect("create"), Created::New);
    task
}

async fn pending(store: &TaskStore, kind: CaptchaKind) -> Task {
    let task = submitting(store, kind).await;
    match store.tasks().mark_submitted(&task.task_ref, &id("42"), t(2_000), t(122_000)).await.expect("submit") {
        SubmitRecorded::Pending(task) => task,
        other => panic!("expected pending, got {other:?}"),
    }
}

async fn raw(store: &TaskStore, r: &TaskRef) -> Item {
    store
        .client
        .get_item()
        .table_name(store.table())
        .key(attr::PK, s(r.as_ref()))
        .send()
        .await
        .expect("get")
        .item
        .expect("exists")
}

async fn due_refs(store: &TaskStore, now: u64) -> Vec<String> {
    let mut refs = Vec::new();
    for shard in 0..store.shards().read() {
        let out = store
            .client
            .query()
            .table_name(store.table())
            .index_name(DUE_INDEX)
            .key_condition_expression("poll_shard = :s AND poll_due_at <= :now")
            .expression_attribute_values(":s", n(u64::from(shard)))
            .expression_attribute_values(":now", n(now))
            .send()
            .await
            .expect("query");
        refs.extend(out.items().iter().filter_map(|i| get_s(i, attr::PK).ok().flatten().map(str::to_owned)));
    }
    refs
}

#[tokio::test(flavor = "multi_thread")]
async fn lowering_the_shard_count_loses_no_due_task_while_the_previous_count_is_read() -> anyhow::Result<()> {
    let (_db, base) = engine().await?;
    let wide = base.clone().with_shards(Shards { write: 16, previous: 0 });
    let mut made = Vec::new();
    for _ in 0..48 {
        made.push(pending(&wide, CaptchaKind::Image).await.task_ref.to_string());
    }
    made.sort();
    let high = made.iter().filter(|r| TaskRef::parse(r).expect("ref").shard(16) >= 4).count();
    assert!(high > 0, "some tasks sit above shard 3");
    // Lowered to 4 with the old count still read: every due task is seen.
    let lowering = base.clone().with_shards(Shards { write: 4, previous: 16 });
    let mut seen = due_refs(&lowering, 200_000).await;
    seen.sort();
    assert_eq!(seen, made);
    // Without it, the tasks above the new count would stall: what `previous` is for.
    let forgot = base.clone().with_shards(Shards { write: 4, previous: 0 });
    assert_eq!(due_refs(&forgot, 200_000).await.len(), made.len() - high);
    // The operator's view: entries at or above the new count, until they end.
    let entries = lowering.poll().shard_entries(16).await?;
    let above: u64 = entries.iter().filter(|(s, ..)| *s >= 4).map(|(_, p, _)| p).sum();
    assert_eq!(above, high as u64);
    // A new task goes to the new count's shards.
    let new = pending(&lowering, CaptchaKind::Image).await;
    assert!(lowering.poll().shard_entries(16).await?.iter().any(|(s, p, _)| *s == new.task_ref.shard(4) && *p > 0));
    assert!(new.task_ref.shard(4) < 4);
    Ok(())
}

#[test]
fn generated_references_fill_every_shard_evenly() {
    for shards in [4u8, 8, 16, 64] {
        let mut counts = vec![0u32; usize::from(shards)];
        for _ in 0..6_400 {
            counts[usize::from(TaskRef::generate().shard(shards))] += 1;
        }
        let expected = 6_400 / u32::from(shards);
        assert!(counts.iter().all(|c| *c > expected / 2 && *c < expected * 2), "{shards} shards: {counts:?}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_is_created_submitted_and_read_back() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = submitting(&store, CaptchaKind::Turnstile).await;
    assert_eq!(store.tasks().get(&task.task_ref).await?, Some(task.clone()));
    assert_eq!(
        store.tasks().create(&task, t(1), Some("fp")).await?,
        Created::Existing { task: task.clone(), fingerprint: None },
        "a reference is never created twice: the existing task comes back, nothing is written"
    );
    // With an idempotency fingerprint, it comes back with the task.
    let keyed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(5));
    assert_eq!(store.tasks().create(&keyed, t(9), Some("fp-1")).await?, Created::New);
    assert_eq!(
        store.tasks().create(&Task::new(keyed.task_ref.clone(), CaptchaKind::Image, t(7)), t(9), Some("fp-2")).await?,
        Created::Existing { task: keyed.clone(), fingerprint: Some("fp-1".into()) }
    );
    // An unknown submit outcome is kept on the task until the id or a result arrives.
    assert!(store.tasks().mark_submit_unknown(&keyed.task_ref, "in.php answered HTTP 502").await?);
    assert_eq!(
        store.tasks().get(&keyed.task_ref).await?.map(|t| t.state),
        Some(TaskState::Submitting { unknown: Some("in.php answered HTTP 502".into()) })
    );
    store.tasks().mark_submitted(&keyed.task_ref, &id("43"), t(8), t(30)).await?;
    assert_eq!(
        store.tasks().get(&keyed.task_ref).await?.map(|t| t.state),
        Some(TaskState::Pending { submitted_at: t(8) })
    );
    let SubmitRecorded::Pending(p) =
        store.tasks().mark_submitted(&task.task_ref, &id("42"), t(2_000), t(122_000)).await?
    else {
        panic!("pending expected")
    };
    assert_eq!(p.state, TaskState::Pending { submitted_at: t(2_000) });
    assert_eq!(store.tasks().get(&task.task_ref).await?, Some(p));
    let item = raw(&store, &task.task_ref).await;
    assert_eq!(item.get(attr::POLL_DUE_AT), Some(&n(122_000)));
    assert_eq!(item.get(attr::EXPIRES_TTL), Some(&n(1 + 7 * 86_400)), "TTL = created + 7 days, in seconds");
    assert_eq!(store.tasks().get(&TaskRef::generate()).await?, None);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn first_result_is_written_and_repeats_are_classified_without_writing() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = pending(&store, CaptchaKind::RecaptchaV2).await;
    let r = &task.task_ref;

    let RecordOutcome::Recorded(done) =
        store.results().record_result(r, &delivery("42", solved("tok-1"), 5_000)).await?
    else {
        panic!("first result must be recorded")
    };
    assert!(
        matches!(&done.state, TaskState::Solved { solution, via: Via::Callback, .. } if solution.expose() == "tok-1")
    );
    let before = raw(&store, r).await;
    assert!(
        !before.contains_key(attr::POLL_DUE_AT) && !before.contains_key(attr::POLL_SHARD),
        "resolved tasks leave the index"
    );

    assert!(matches!(
        store.results().record_result(r, &delivery("42", solved("tok-1"), 6_000)).await?,
        RecordOutcome::Duplicate(_)
    ));
    assert!(matches!(
        store.results().record_result(r, &delivery("42", solved("tok-2"), 6_000)).await?,
        RecordOutcome::Conflict(_)
    ));
    let failed = Outcome::Failed(ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE")?);
    assert!(matches!(
        store.results().record_result(r, &delivery("42", failed, 6_000)).await?,
        RecordOutcome::Conflict(_)
    ));
    assert_eq!(raw(&store, r).await, before, "nothing was written by the repeats");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn an_earlier_received_result_replaces_a_later_one_until_it_is_handed_out() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = pending(&store, CaptchaKind::Turnstile).await;
    let r = &task.task_ref;
    // The real pingback A (received at 5 s) failed to store and went to the dead-letter
    // queue; a conflicting B, received at 6 s, was stored first.
    assert!(matches!(
        store.results().record_result(r, &delivery("42", solved("B"), 6_000)).await?,
        RecordOutcome::Recorded(_)
    ));
    // A's redrive: received earlier, so it replaces B — no token of B is left.
    let redriven = IncomingResult { via: Via::Redrive, ..delivery("42", solved("A"), 5_000) };
    let RecordOutcome::Replaced(now) = store.results().record_result(r, &redriven).await? else { panic!("replaced") };
    assert_eq!(store.tasks().get(r).await?.as_ref(), Some(&now));
    assert!(matches!(&now.state, TaskState::Solved { solution, resolved_at, via: Via::Redrive, .. }
        if solution.expose() == "A" && *resolved_at == t(5_000)));
    // B again (a retry of its own letter) is a conflict now; A again a duplicate.
    assert!(matches!(
        store.results().record_result(r, &delivery("42", solved("B"), 6_000)).await?,
        RecordOutcome::Conflict(_)
    ));
    assert!(matches!(store.results().record_result(r, &redriven).await?, RecordOutcome::Duplicate(_)));
    // A verdict received earlier still wins, and leaves no token on the item.
    let verdict = delivery("42", Outcome::Failed(ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE")?), 4_000);
    assert!(matches!(store.results().record_result(r, &verdict).await?, RecordOutcome::Replaced(_)));
    let item = raw(&store, r).await;
    assert!(!item.contains_key(attr::SOLUTION) && !item.contains_key(attr::TOKEN_CLOCK_START), "{item:?}");
    // The owner is shown the verdict: pinned. Nothing replaces it after that.
    let shown = store.tasks().get(r).await?.expect("task");
    assert!(shown.needs_pin(t(7_000)));
    assert_eq!(store.results().mark_handed_out(&shown, t(7_000)).await?, None);
    let pinned = store.tasks().get(r).await?.expect("task");
    assert_eq!(pinned.handed_out_at, Some(t(7_000)));
    assert!(!pinned.needs_pin(t(7_001)));
    let before = raw(&store, r).await;
    assert!(matches!(
        store.results().record_result(r, &delivery("42", solved("C"), 3_000)).await?,
        RecordOutcome::Conflict(_)
    ));
    assert!(matches!(store.results().record_result(r, &verdict).await?, RecordOutcome::Duplicate(_)));
    assert_eq!(raw(&store, r).await, before, "nothing written after the hand-out");
    // A second pin from the same (now outdated) read is refused and shows what is stored.
    assert_eq!(store.results().mark_handed_out(&shown, t(8_000)).await?, Some(pinned));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_poll_read_of_a_dead_lettered_result_does_not_let_a_later_conflict_win() -> anyhow::Result<()> {
    // A (received at 5 s) and a conflicting B (at 6 s) both fail to store and are
    // dead-lettered; the poller then reads A from res.php at 9 s and records it. Whichever
    // letter is redriven first, A must be what the task ends with.
    for a_first in [true, false] {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Turnstile).await;
        let r = &task.task_ref;
        let polled = IncomingResult { via: Via::Poll, ..delivery("42", solved("A"), 9_000) };
        assert!(matches!(store.results().record_result(r, &polled).await?, RecordOutcome::Recorded(_)));
        let a = IncomingResult { via: Via::Redrive, ..delivery("42", solved("A"), 5_000) };
        let b = IncomingResult { via: Via::Redrive, ..delivery("42", solved("B"), 6_000) };
        let letters = if a_first { [a, b] } else { [b, a] };
        for d in &letters {
            store.results().record_result(r, d).await?;
        }
        let end = store.tasks().get(r).await?.expect("task");
        assert!(
            matches!(&end.state, TaskState::Solved { solution, resolved_at, .. }
                if solution.expose() == "A" && *resolved_at == t(5_000)),
            "a_first={a_first}: {:?}",
            end.state
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn wrong_id_and_unknown_reference_write_nothing() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = pending(&store, CaptchaKind::Image).await;
    let before = raw(&store, &task.task_ref).await;
    let got = store.results().record_result(&task.task_ref, &delivery("99", solved("x"), 5_000)).await?;
    assert_eq!(got, RecordOutcome::IdMismatch { expected: id("42") });
    assert_eq!(raw(&store, &task.task_ref).await, before);
    let nowhere = TaskRef::generate();
    assert_eq!(
        store.results().record_result(&nowhere, &delivery("42", solved("x"), 5_000)).await?,
        RecordOutcome::NotFound
    );
    assert_eq!(store.tasks().get(&nowhere).await?, None, "a result for an unknown task creates nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn callback_that_outruns_the_submit_wins_and_the_submit_leaves_it() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = submitting(&store, CaptchaKind::Hcaptcha).await;
    let RecordOutcome::Recorded(_) =
        store.results().record_result(&task.task_ref, &delivery("42", solved("early"), 1_500)).await?
    else {
        panic!("recorded")
    };
    let SubmitRecorded::AlreadyResolved(t2) =
        store.tasks().mark_submitted(&task.task_ref, &id("42"), t(2_000), t(9)).await?
    else {
        panic!("already resolved")
    };
    assert_eq!(t2.state.name(), "solved");
    assert_eq!(t2.captcha_id, Some(id("42")));
    assert!(!raw(&store, &task.task_ref).await.contains_key(attr::POLL_DUE_AT));
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_submit_is_stored_as_failed_with_the_reason() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = submitting(&store, CaptchaKind::Image).await;
    let failed = store
        .tasks()
        .mark_submit_failed(&task.task_ref, "ERROR_ZERO_CAPTCHA_FILESIZE", "in.php refused", t(1_100))
        .await?;
    assert!(
        matches!(&failed.state, TaskState::Failed { code, via: Via::Submit, .. } if code.as_ref() == "ERROR_ZERO_CAPTCHA_FILESIZE")
    );
    assert!(due_refs(&store, u64::MAX / 2).await.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn due_index_lists_only_open_tasks() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let open = pending(&store, CaptchaKind::Image).await;
    let done = pending(&store, CaptchaKind::Image).await;
    store.results().record_result(&done.task_ref, &delivery("42", solved("x"), 3_000)).await?;
    assert_eq!(due_refs(&store, 122_000).await, vec![open.task_ref.to_string()]);
    assert!(due_refs(&store, 121_999).await.is_empty(), "not due before its time");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn claims_are_exclusive_count_the_read_and_only_the_holder_reschedules() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = pending(&store, CaptchaKind::Turnstile).await;
    let page = store.poll().due_page(store.shards().of(&task.task_ref), t(122_000), 10, None).await?;
    let due = page.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("listed when due");
    assert_eq!((due.due_at, due.reads), (t(122_000), 0));
    assert!(store.poll().claim(&due, "a", t(212_000), true).await?, "first claim wins");
    assert!(!store.poll().claim(&due, "b", t(212_000), true).await?, "the same listing cannot be claimed twice");
    assert!(due_refs(&store, 211_999).await.is_empty(), "a claimed task leaves the due list until its lease ends");
    assert_eq!(store.poll().next_due_after(t(122_000)).await?, Some(t(212_000)), "the lease's end is the next work");
    assert!(!store.poll().reschedule(&task.task_ref, "b", Reschedule::at(t(130_000))).await?, "only the holder");
    let r = Reschedule { unknown_code: true, not_ready_at: Some(t(125_000)), ..Reschedule::at(t(130_000)) };
    assert!(store.poll().reschedule(&task.task_ref, "a", r).await?);
    let again = store.poll().due_page(store.shards().of(&task.task_ref), t(130_000), 10, None).await?;
    let d = again.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("due again");
    assert_eq!(
        (d.reads, d.unknown_codes, d.last_not_ready_at),
        (1, 1, Some(t(125_000))),
        "the read counted at the claim"
    );
    // A claim given back unread takes its read back.
    assert!(store.poll().claim(&d, "a", t(220_000), true).await?);
    assert!(
        store.poll().reschedule(&task.task_ref, "a", Reschedule { unread: true, ..Reschedule::at(t(131_000)) }).await?
    );
    let d = store.poll().due_page(store.shards().of(&task.task_ref), t(131_000), 10, None).await?.tasks.remove(0);
    assert_eq!(d.reads, 1);
    assert!(store.poll().expire(&task.task_ref, "deadline", t(600_000), "a").await?);
    assert!(!store.poll().expire(&task.task_ref, "deadline", t(600_001), "a").await?, "expiring twice writes nothing");
    assert!(matches!(store.tasks().get(&task.task_ref).await?.map(|t| t.state), Some(TaskState::Expired { .. })));
    assert!(due_refs(&store, u64::MAX / 2).await.is_empty());
    assert_eq!(store.poll().next_due_after(t(0)).await?, None, "nothing open");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn no_expiry_under_another_pollers_live_lease() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = pending(&store, CaptchaKind::Image).await;
    let due = store.poll().due_page(store.shards().of(&task.task_ref), t(600_000), 10, None).await?.tasks.remove(0);
    assert!(store.poll().claim(&due, "a", t(690_000), true).await?, "a holds it for a last read");
    assert!(
        !store.poll().expire(&task.task_ref, "deadline", t(600_500), "b").await?,
        "b may not expire it under a's lease"
    );
    assert_eq!(store.tasks().get(&task.task_ref).await?.map(|t| t.state.name()), Some("pending"));
    assert!(store.poll().expire(&task.task_ref, "deadline", t(600_500), "a").await?, "the holder may");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn results_around_the_expiry_are_recorded_or_kept_never_dropped() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    // Received before the expiry, stored after it (a dead letter redriven later): the result.
    let a = pending(&store, CaptchaKind::Image).await;
    store.poll().expire(&a.task_ref, "deadline", t(600_000), "p").await?;
    let RecordOutcome::Recorded(got) =
        store.results().record_result(&a.task_ref, &delivery("42", solved("w68hp"), 599_000)).await?
    else {
        panic!("recorded")
    };
    assert!(matches!(&got.state, TaskState::Solved { solution, .. } if solution.expose() == "w68hp"));
    assert!(!raw(&store, &a.task_ref).await.contains_key(attr::ERROR_DETAIL), "no expiry reason left behind");
    // Received after the expiry: kept as the late result, once; the task stays expired.
    let b = pending(&store, CaptchaKind::Turnstile).await;
    store.poll().expire(&b.task_ref, "deadline", t(600_000), "p").await?;
    let RecordOutcome::Late(late) =
        store.results().record_result(&b.task_ref, &delivery("42", solved("tok"), 610_000)).await?
    else {
        panic!("late")
    };
    assert!(matches!(&late.state, TaskState::Expired { late: Some(_), .. }));
    let stored = store.tasks().get(&b.task_ref).await?.expect("stored");
    assert_eq!(stored, late, "what was written reads back");
    assert!(matches!(
        store.results().record_result(&b.task_ref, &delivery("42", solved("tok"), 611_000)).await?,
        RecordOutcome::Duplicate(_)
    ));
    assert!(matches!(
        store.results().record_result(&b.task_ref, &delivery("42", solved("other"), 612_000)).await?,
        RecordOutcome::Conflict(_)
    ));
    assert_eq!(store.tasks().get(&b.task_ref).await?, Some(late), "the first late result stays");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_result_for_a_task_whose_submit_was_reported_failed_is_recorded() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let task = submitting(&store, CaptchaKind::Image).await;
    store.tasks().mark_submit_failed(&task.task_ref, "ERROR_NO_SLOT_AVAILABLE", "in.php refused", t(1_100)).await?;
    let RecordOutcome::Recorded(got) =
        store.results().record_result(&task.task_ref, &delivery("42", solved("w68hp"), 20_000)).await?
    else {
        panic!("a paid result is recorded")
    };
    assert!(matches!(got.state, TaskState::Solved { .. }));
    assert!(!raw(&store, &task.task_ref).await.contains_key(attr::ERROR_CODE), "the submit's code is gone");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_slots_are_counted_per_second_across_callers() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    let mut handles = Vec::new();
    for _ in 0..30 {
        let store = store.clone();
        handles.push(tokio::spawn(async move { store.account().take_submit_slot(t(5_000), 14).await }));
    }
    let mut taken = 0;
    for h in handles {
        taken += usize::from(h.await??);
    }
    assert_eq!(taken, 14, "30 concurrent callers in one second: 14 slots");
    assert!(store.account().take_submit_slot(t(6_000), 14).await?, "the next second has its own");
    assert!(due_refs(&store, u64::MAX / 2).await.is_empty(), "never a due task");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_breaker_opens_extends_never_shortens_and_closes() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    assert_eq!(store.account().breaker().await?, Breaker::default());
    let ban = Stop::Ban { needs_operator: false };
    assert!(store.account().open_breaker(t(300_000), "IP_BANNED", ban, t(0)).await?);
    assert!(!store.account().open_breaker(t(10_000), "MAX_USER_TURN", ban, t(1)).await?, "never shortened");
    assert!(
        !store.account().open_breaker(t(400_000), "5 answers missing", Stop::NoAnswers, t(1)).await?,
        "missing answers never replace a ban in force"
    );
    assert_eq!(store.account().breaker().await?.open_for_submits_at(t(2)), Some(t(300_000)), "a ban stops submits too");
    let b = store.account().breaker().await?;
    assert_eq!((b.open_at(t(299_999)), b.reason.as_deref()), (Some(t(300_000)), Some("IP_BANNED")));
    assert_eq!(b.open_at(t(300_000)), None, "closed when it ends");
    assert!(
        store
            .account()
            .open_breaker(t(3_600_000), "ERROR_KEY_DOES_NOT_EXIST", Stop::Ban { needs_operator: true }, t(2))
            .await?,
        "extended"
    );
    assert!(store.account().breaker().await?.needs_operator);
    store.account().close_breaker().await?;
    assert_eq!(store.account().breaker().await?.open_at(t(3)), None);
    // res.php going silent pauses reads, not submits.
    assert!(store.account().open_breaker(t(60_000), "5 answers missing", Stop::NoAnswers, t(3)).await?);
    let b = store.account().breaker().await?;
    assert_eq!((b.open_at(t(4)), b.open_for_submits_at(t(4))), (Some(t(60_000)), None));
    assert!(store.account().open_breaker(t(50_000), "IP_BANNED", ban, t(4)).await?, "a ban replaces it");
    assert_eq!(store.account().breaker().await?.open_for_submits_at(t(5)), Some(t(50_000)));
    assert!(due_refs(&store, u64::MAX / 2).await.is_empty(), "the breaker is never a due task");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn fifty_concurrent_deliveries_write_exactly_once() -> anyhow::Result<()> {
    let (_db, store) = engine().await?;
    // 50 copies of one delivery: one write, 49 duplicates. Then one result received first
    // racing 49 copies of a conflicting one received later: whoever writes first, the task
    // ends on the first received, and it is written at most twice (recorded, or recorded
    // after a conflict and then replacing it once).
    for tokens in [vec!["same"; 50], std::iter::once("first").chain(std::iter::repeat_n("second", 49)).collect()] {
        let task = pending(&store, CaptchaKind::Turnstile).await;
        let mut handles = Vec::new();
        for (i, token) in tokens.iter().enumerate() {
            let (store, r) = (store.clone(), task.task_ref.clone());
            let d = delivery("42", solved(token), if i == 0 { 5_000 } else { 6_000 });
            handles.push(tokio::spawn(async move { store.results().record_result(&r, &d).await }));
        }
        let (mut recorded, mut replaced, mut others) = (0, 0, 0);
        for h in handles {
            match h.await?? {
                RecordOutcome::Recorded(_) => recorded += 1,
                RecordOutcome::Replaced(_) => replaced += 1,
                RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_) => others += 1,
                other => panic!("unexpected {other:?}"),
            }
        }
        assert_eq!(recorded, 1, "exactly one first write ({:?})", tokens[..2].to_vec());
        assert!(replaced <= 1, "replaced at most once: {replaced}");
        assert_eq!(recorded + replaced + others, 50);
        if tokens[1] == "same" {
            assert_eq!(replaced, 0);
        }
        let end = store.tasks().get(&task.task_ref).await?.expect("task");
        assert!(
            matches!(&end.state, TaskState::Solved { solution, resolved_at, .. }
                if solution.expose() == tokens[0] && *resolved_at == t(5_000)),
            "{:?}",
            end.state
        );
    }
    Ok(())
}

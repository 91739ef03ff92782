//! The submit queue against the embedded engine.

use std::time::Duration;

use super::*;
use crate::domain::{CaptchaId, CaptchaKind, IncomingResult, Outcome, Solution, Via};
use crate::store::TaskStore;
use crate::store::{Created, RecordOutcome, Stop};
use crate::testkit::LocalDynamo;

fn t(secs: u64) -> Timestamp {
    Timestamp::from_millis(1_796_210_146_000 + secs * 1000)
}

const LANE: &str = "0123456789abcdef.t";

fn turnstile() -> SubmitRequest {
    SubmitRequest::Turnstile {
        sitekey: "0x4AAA".into(),
        pageurl: "https://shop.example/".into(),
        action: Some("login".into()),
        data: None,
    }
}

async fn queue_one(store: &TaskStore, at: u64) -> anyhow::Result<Task> {
    let task = Task::queued(TaskRef::generate(), CaptchaKind::Turnstile, t(at), LANE.into());
    assert!(matches!(store.queue().reserve_queue(LANE, 0, 100, 100, false).await?, Reserved::Yes(_)));
    assert_eq!(
        store
            .queue()
            .create_queued(&task, &turnstile(), "https://relay/callback/x/y", Duration::from_secs(110), None)
            .await?,
        Created::New
    );
    Ok(task)
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_counts_in_work_from_its_send_to_its_result_or_its_longest_solve() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, t(0));
    store.tasks().create(&task, t(600), None).await?;
    assert_eq!(store.queue().in_work(t(1)).await?, vec![task.task_ref.clone()], "counted before in.php answers");
    let id = CaptchaId::parse("7001")?;
    store.tasks().mark_submitted(&task.task_ref, &id, t(1), t(21)).await?;
    assert_eq!(store.queue().in_work(t(2)).await?.len(), 1);
    assert!(
        store.queue().in_work(t(15)).await?.is_empty(),
        "past Turnstile's typical 15 s: likely done, its pingback lost"
    );
    let d = IncomingResult {
        captcha_id: id,
        outcome: Outcome::Solved(Solution::parse("tok")?),
        received_at: t(5),
        via: Via::Callback,
        token_clock_start: t(5),
    };
    assert!(matches!(store.results().record_result(&task.task_ref, &d).await?, RecordOutcome::Recorded(_)));
    assert!(store.queue().in_work(t(6)).await?.is_empty(), "the result write ends it");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn several_lanes_move_in_one_write_and_nothing_moved_writes_nothing() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    for _ in 0..3 {
        assert!(matches!(
            store.queue().reserve_queue("aaaaaaaaaaaaaaaa.t", 0, 100, 100, false).await?,
            Reserved::Yes(_)
        ));
    }
    assert!(matches!(store.queue().reserve_queue("bbbbbbbbbbbbbbbb.i", 0, 100, 100, false).await?, Reserved::Yes(_)));
    store
        .queue()
        .count_queued_many(&[
            ((0, "aaaaaaaaaaaaaaaa.t".into()), -2),
            ((0, "bbbbbbbbbbbbbbbb.i".into()), 0),
            ((0, "cccccccccccccccc.t".into()), 1),
        ])
        .await?;
    let st = store.queue().submit_state().await?;
    assert_eq!(st.queued, 3, "4 - 2 + 1");
    assert_eq!(
        (
            st.lanes.get("aaaaaaaaaaaaaaaa.t").copied(),
            st.lanes.get("bbbbbbbbbbbbbbbb.i").copied(),
            st.lanes.get("cccccccccccccccc.t").copied()
        ),
        (Some(1), Some(1), Some(1))
    );
    store.queue().count_queued_many(&[((0, "aaaaaaaaaaaaaaaa.t".into()), 0)]).await?;
    store.queue().count_queued_many(&[]).await?;
    assert_eq!(store.queue().submit_state().await?, st, "zero deltas write nothing");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn queued_tasks_are_listed_oldest_first_released_once_and_put_back_at_their_place() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let a = queue_one(&store, 1).await?;
    let b = queue_one(&store, 2).await?;
    let c = queue_one(&store, 3).await?;
    let heads: Vec<TaskRef> = store.queue().queue_heads(LANE, 10).await?.into_iter().map(|h| h.task_ref).collect();
    assert_eq!(heads, vec![a.task_ref.clone(), b.task_ref.clone(), c.task_ref.clone()]);
    assert_eq!(store.queue().queue_ahead(LANE, t(3), 100).await?, 2, "c has two ahead");
    let st = store.queue().submit_state().await?;
    assert_eq!((st.queued, st.lanes.get(LANE).copied()), (3, Some(3)));
    assert!(store.queue().in_work(t(4)).await?.is_empty(), "queued is not in work");

    // Released: submitting, in work, with what in.php needs; only once.
    let r = store.queue().release(&a.task_ref, t(10)).await?.expect("queued");
    assert_eq!((r.request, r.lane.as_str(), r.queued_at), (turnstile(), LANE, t(1)));
    assert_eq!(r.pingback, "https://relay/callback/x/y");
    assert!(matches!(r.task.state, TaskState::Submitting { unknown: None }));
    assert_eq!(r.task.released_at, Some(t(10)));
    assert_eq!(r.task.submitted_or_created_at(), t(10), "its deadlines count from the release");
    assert!(store.queue().release(&a.task_ref, t(10)).await?.is_none(), "never twice");
    store.queue().count_queued(LANE, 0, -1).await?;
    assert_eq!(store.queue().in_work(t(11)).await?, vec![a.task_ref.clone()]);
    assert!(store.queue().in_work(t(24)).await?.contains(&a.task_ref), "busy for Turnstile's 15 s from its release");
    assert!(store.queue().in_work(t(25)).await?.is_empty());
    let shard = store.shards().of(&a.task_ref);
    assert!(store.poll().due_page(shard, t(119), 10, None).await?.tasks.is_empty());
    let due = store.poll().due_page(shard, t(120), 10, None).await?;
    assert!(due.tasks.iter().any(|d| d.task.task_ref == a.task_ref), "the poller sees it 110 s after its release");

    // No free thread: back at its place, ahead of b.
    store.queue().count_queued(LANE, 0, 1).await?;
    assert!(store.queue().requeue(&a.task_ref, LANE, r.queued_at).await?);
    let heads: Vec<TaskRef> = store.queue().queue_heads(LANE, 10).await?.into_iter().map(|h| h.task_ref).collect();
    assert_eq!(heads.first(), Some(&a.task_ref));
    assert!(store.queue().in_work(t(12)).await?.is_empty());
    let back = store.tasks().get(&a.task_ref).await?.expect("stored");
    assert_eq!((back.state.name(), back.released_at), ("queued", None));

    // A release whose answer was lost is never put back (it may have been taken).
    let r = store.queue().release(&a.task_ref, t(20)).await?.expect("queued again");
    store.tasks().mark_submit_unknown(&a.task_ref, "cut").await?;
    assert!(!store.queue().requeue(&a.task_ref, LANE, r.queued_at).await?, "an unknown outcome stays unknown");
    // A task in.php took is never put back either.
    let rb = store.queue().release(&b.task_ref, t(21)).await?.expect("queued");
    store.tasks().mark_submitted(&b.task_ref, &CaptchaId::parse("7002")?, t(21), t(41)).await?;
    assert!(!store.queue().requeue(&b.task_ref, LANE, rb.queued_at).await?);
    let b_now = store.tasks().get(&b.task_ref).await?.expect("stored");
    assert_eq!(b_now.state.name(), "pending");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_task_that_waited_too_long_fails_unsent_and_its_push_falls_due() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let task = Task {
        owner_callback: Some("https://owner.example/hook".into()),
        webhook_owner: Some("default".into()),
        ..Task::queued(TaskRef::generate(), CaptchaKind::Image, t(0), LANE.into())
    };
    store.queue().reserve_queue(LANE, 0, 10, 10, false).await?;
    store.queue().create_queued(&task, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
    let failed = store
        .queue()
        .fail_unsent(&task.task_ref, true, crate::submit::QUEUE_TIMEOUT, "waited too long", t(600))
        .await?
        .expect("it was queued");
    assert!(
        matches!(&failed.state, TaskState::Failed { code, via: Via::Submit, .. } if code.as_ref() == crate::submit::QUEUE_TIMEOUT)
    );
    assert_eq!(failed.delivery.map(|d| d.status), Some(crate::domain::DeliveryStatus::Pending), "its owner hears");
    assert!(store.queue().queue_heads(LANE, 10).await?.is_empty(), "out of the queue");
    assert!(store.queue().fail_unsent(&task.task_ref, true, "X", "again", t(601)).await?.is_none());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn permits_are_taken_only_while_nobody_waits_and_the_breaker_lets_submits_through() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    // Before any submitter published: the window's starting size.
    assert_eq!(store.queue().take_permit(t(0), 2).await?, Permit::Taken);
    assert_eq!(store.queue().take_permit(t(0), 2).await?, Permit::Taken);
    let Permit::Refused(st) = store.queue().take_permit(t(0), 2).await? else { panic!("none left") };
    assert_eq!(st.permits, Some(0));
    store.queue().give_back_permit().await?;
    assert_eq!(store.queue().take_permit(t(0), 2).await?, Permit::Taken);
    // Published permits, but a task waits: it goes first.
    store.queue().releaser_lease("me", t(1), t(11), Some(&Publish { permits: 5, ..Publish::default() })).await?;
    queue_one(&store, 1).await?;
    assert!(matches!(store.queue().take_permit(t(2), 2).await?, Permit::Refused(_)));
    store.queue().count_queued(LANE, 0, -1).await?;
    assert_eq!(store.queue().take_permit(t(2), 2).await?, Permit::Taken);
    // A ban stops inline submits; a pause for res.php answers does not.
    store.account().open_breaker(t(100), "MAX_USER_TURN", Stop::Ban { needs_operator: false }, t(3)).await?;
    let Permit::Refused(st) = store.queue().take_permit(t(4), 2).await? else { panic!("banned") };
    assert_eq!(st.breaker.open_for_submits_at(t(4)), Some(t(100)));
    assert_eq!(store.queue().take_permit(t(100), 2).await?, Permit::Taken, "the ban is over");
    store.account().open_breaker(t(200), "timeouts", Stop::NoAnswers, t(101)).await?;
    assert_eq!(store.queue().take_permit(t(102), 2).await?, Permit::Taken);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_queue_is_bounded_per_lane_and_in_all_and_a_no_slot_stops_permits() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let other = "fedcba9876543210.i";
    assert!(matches!(store.queue().reserve_queue(LANE, 0, 2, 3, false).await?, Reserved::Yes(_)));
    assert!(matches!(store.queue().reserve_queue(LANE, 0, 2, 3, false).await?, Reserved::Yes(_)));
    assert_eq!(
        store.queue().reserve_queue(LANE, 0, 2, 3, false).await?,
        Reserved::Full { owner: true, depth: 2, bound: 2 }
    );
    let Reserved::Yes(st) = store.queue().reserve_queue(other, 0, 2, 3, true).await? else { panic!("room in all") };
    assert_eq!((st.queued, st.api_no_slots, st.permits), (3, 1, Some(0)), "no more inline submits");
    assert_eq!(
        store.queue().reserve_queue(other, 0, 2, 3, false).await?,
        Reserved::Full { owner: false, depth: 3, bound: 3 }
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn one_submitter_holds_the_lease_until_it_leaves_or_lets_it_lapse() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let publish = Publish { permits: 3, window: "{}".into(), released_per_minute: 42, api_no_slots_seen: 0 };
    assert!(store.queue().releaser_lease("a", t(0), t(10), Some(&publish)).await?.is_some());
    assert!(store.queue().releaser_lease("b", t(5), t(15), None).await?.is_none(), "held");
    let st = store.queue().releaser_lease("a", t(5), t(15), None).await?.expect("renewed");
    assert!(st.releaser_live(t(14)) && !st.releaser_live(t(15)));
    assert_eq!((st.permits, st.released_per_minute, st.window.as_deref()), (Some(3), 42, Some("{}")));
    assert!(store.queue().releaser_lease("b", t(15), t(25), None).await?.is_some(), "lapsed: taken over");
    store.queue().releaser_leave("a", &publish).await?;
    assert!(store.queue().submit_state().await?.releaser_live(t(16)), "a left nothing: b holds it");
    store.queue().releaser_leave("b", &publish).await?;
    assert!(!store.queue().submit_state().await?.releaser_live(t(16)));
    assert!(store.queue().releaser_lease("c", t(16), t(26), None).await?.is_some());
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_count_a_crash_left_wrong_is_set_right_against_the_index() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    queue_one(&store, 1).await?;
    // A crash between a reservation and its put: counted, never queued.
    store.queue().reserve_queue("0000000000000000.t", 0, 10, 10, false).await?;
    // And a task whose count was lost.
    let lost = Task::queued(TaskRef::generate(), CaptchaKind::Image, t(2), "1111111111111111.i".into());
    store.queue().create_queued(&lost, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
    let listed = store.queue().queued_lanes().await?;
    assert_eq!(listed.get(&(LANE.to_owned(), 0)), Some(&1));
    assert_eq!(listed.get(&("1111111111111111.i".to_owned(), 0)), Some(&1));
    assert_eq!(listed.len(), 2, "{listed:?}");
    let seen = store.queue().submit_state().await?;
    assert!(store.queue().reconcile_lane("0000000000000000.t", &seen, 0).await?);
    assert!(store.queue().reconcile_lane("1111111111111111.i", &seen, 1).await?);
    let stale = SubmitState { lanes_here: [(LANE.to_owned(), 5)].into(), ..SubmitState::default() };
    assert!(!store.queue().reconcile_lane(LANE, &stale, 0).await?, "a count that changed meanwhile is left alone");
    let st = store.queue().submit_state().await?;
    assert_eq!(st.queued, 2);
    assert_eq!(st.lanes.keys().cloned().collect::<Vec<_>>(), vec![LANE.to_owned(), "1111111111111111.i".into()]);
    Ok(())
}

#[test]
fn queued_index_keys_name_their_lane_and_shard() {
    assert_eq!(queued_key(LANE, 0), format!("q#{LANE}"));
    assert_eq!(queued_key(LANE, 3), format!("q#{LANE}#3"));
    for k in [0u8, 3, 31] {
        assert_eq!(lane_of_key(&queued_key(LANE, k)), Some((LANE, k)));
    }
    assert_eq!(lane_of_key("w#3"), None);
    assert_eq!(lane_of_key("q#odd#lane"), Some(("odd#lane", 0)), "a suffix that is no shard stays in the lane");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_lane_spread_over_index_keys_is_read_oldest_first_and_a_lowered_count_moves_its_tasks() -> anyhow::Result<()>
{
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?.with_queue_shards(4);
    let mut made = Vec::new();
    for at in 1..=12u64 {
        let task = Task::queued(TaskRef::generate(), CaptchaKind::Turnstile, t(at), LANE.into());
        store.queue().create_queued(&task, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
        made.push(task.task_ref);
    }
    let listed = store.queue().queued_lanes().await?;
    assert!(listed.len() > 1, "12 tasks over 4 index keys: {listed:?}");
    assert_eq!(listed.values().sum::<u64>(), 12);
    let heads: Vec<TaskRef> = store.queue().queue_heads(LANE, 5).await?.into_iter().map(|h| h.task_ref).collect();
    assert_eq!(heads, made[..5], "oldest first across the keys");
    assert_eq!(store.queue().queue_ahead(LANE, t(8), 100).await?, 7);
    assert_eq!(store.queue().queue_ahead(LANE, t(8), 3).await?, 3, "capped");
    // Lowered to 1: the index keys beyond it are moved back, in their places.
    let one = store.clone().with_queue_shards(1);
    let stray: Vec<u8> = listed.keys().map(|(_, k)| *k).filter(|k| *k > 0).collect();
    let mut moved = 0;
    for k in stray {
        moved += one.queue().rehome_queued(LANE, k).await?;
    }
    assert_eq!(moved, 12 - listed.get(&(LANE.to_owned(), 0)).copied().unwrap_or(0));
    let heads: Vec<TaskRef> = one.queue().queue_heads(LANE, 20).await?.into_iter().map(|h| h.task_ref).collect();
    assert_eq!(heads, made, "every task on the one key left, oldest first");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn counts_spread_over_items_hold_their_bounds_in_sum_and_read_as_one() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?.with_queue_shards(4);
    // Bounds 8 in the lane and 12 in all: shares of 2 and 3 on each of the 4 items.
    for shard in 0..4u8 {
        for _ in 0..2 {
            assert!(matches!(store.queue().reserve_queue(LANE, shard, 8, 12, false).await?, Reserved::Yes(_)));
        }
        assert_eq!(
            store.queue().reserve_queue(LANE, shard, 8, 12, false).await?,
            Reserved::Full { owner: true, depth: 8, bound: 8 },
            "item {shard}'s share of the lane is taken: about 8 in all"
        );
    }
    let other = "1111111111111111.i";
    assert!(matches!(store.queue().reserve_queue(other, 3, 8, 12, true).await?, Reserved::Yes(_)));
    assert_eq!(
        store.queue().reserve_queue(other, 3, 8, 12, false).await?,
        Reserved::Full { owner: false, depth: 12, bound: 12 },
        "item 3 holds its share of the total"
    );
    let st = store.queue().submit_state().await?;
    assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other).copied()), (9, Some(8), Some(1)));
    assert_eq!((st.api_no_slots, st.permits), (1, Some(0)), "a no-slot answer reaches the state item");
    assert_eq!(st.lanes_here.get(LANE), Some(&2));
    assert_eq!(st.lanes_elsewhere.get(LANE), Some(&6));
    // The submitter's lease renewal answers with the same sums (its view between reads).
    let leased = store.queue().releaser_lease("s", t(1), t(11), None).await?.expect("the lease is free");
    assert_eq!((leased.queued, leased.lanes.clone()), (st.queued, st.lanes.clone()));
    // The submitter's moves of a tick: one write per item touched.
    store.queue().count_queued_many(&[((1, LANE.into()), -2), ((2, LANE.into()), -1), ((3, other.into()), -1)]).await?;
    let st = store.queue().submit_state().await?;
    assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other)), (5, Some(5), None));
    // A count wrong in all is set right on the state item's share: 5 counted, 1 listed.
    assert!(store.queue().reconcile_lane(LANE, &st, 1).await?);
    let st = store.queue().submit_state().await?;
    assert_eq!((st.queued, st.lanes.get(LANE).copied()), (1, Some(1)));
    assert_eq!(st.lanes_here.get(LANE), Some(&-2), "the state item's share absorbs the others'");
    // The count lowered to 1: what the other items hold is folded onto the state item once
    // (the submitter's start), and moves on their shards land on the one left.
    assert!(matches!(store.queue().reserve_queue(other, 2, 8, 12, false).await?, Reserved::Yes(_)));
    let one = store.clone().with_queue_shards(1);
    assert_eq!(one.queue().submit_state().await?.queued, 0, "-1 here, +1 on item 2 not read yet");
    assert_eq!(one.queue().fold_queue_shards().await?, 2, "items 2 and 3 held counts (item 1 sums to 0)");
    assert_eq!(one.queue().fold_queue_shards().await?, 0, "folded once");
    let st = one.queue().submit_state().await?;
    assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other).copied()), (2, Some(1), Some(1)));
    one.queue().count_queued(other, 3, -1).await?;
    assert_eq!(one.queue().submit_state().await?.queued, 1);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn the_wake_item_is_written_at_most_once_a_second() -> anyhow::Result<()> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    assert!(store.queue().wake_submitter(t(0)).await?);
    assert!(!store.queue().wake_submitter(t(0).plus(Duration::from_millis(500))).await?);
    assert!(store.queue().wake_submitter(t(1).plus(Duration::from_millis(1))).await?);
    Ok(())
}

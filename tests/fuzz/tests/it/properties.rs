//! Properties of the task's life, for any interleaving of submit outcomes, callbacks, poll
//! reads, redrives, expiry, lease claims and the owner's reads:
//! - it ends holding the first-*received* valid result (CaptchaAI's first answer, even when a
//!   retry stored it second), unless the owner was shown one: a result once shown never changes;
//! - applying the same delivery twice equals applying it once;
//! - the DynamoDB store (the embedded engine) agrees with the pure state machine at every step.
//!
//! `FUZZ_CASES=100000 cargo test -p relay-fuzz --test it properties::` runs more.

use proptest::prelude::*;
use relay_shared::codes::ErrorCode;
use relay_shared::domain::{
    Applied, CaptchaId, CaptchaKind, IncomingResult, Outcome, Solution, Task, TaskRef, TaskState, Via,
};
use relay_shared::store::{Created, RecordOutcome, SubmitRecorded};
use relay_shared::time::Timestamp;

#[derive(Debug, Clone)]
enum Ev {
    /// In.php's answer stored (id 1 to 3: not always the one results name).
    Submitted { id: u8 },
    /// In.php refused (explicitly).
    SubmitFailed,
    /// In.php's outcome unknown.
    Unknown,
    /// A result: token `tok-n` or a code, received at `at` (may be long ago: a redrive).
    Deliver { id: u8, token: u8, error: bool, via: u8, received_back: u16 },
    /// The poller expires it, as `owner`.
    Expire { owner: u8 },
    /// A poller claims it for a read, as `owner`.
    Claim { owner: u8 },
    /// Time passes.
    Wait { secs: u16 },
    /// The owner reads the task (`GET /tasks/{ref}`): a result shown is pinned.
    HandOut,
}

fn ev() -> impl Strategy<Value = Ev> {
    prop_oneof![
        (1..=3u8).prop_map(|id| Ev::Submitted { id }),
        Just(Ev::SubmitFailed),
        Just(Ev::Unknown),
        (1..=3u8, 0..3u8, any::<bool>(), 0..3u8, 0..700u16)
            .prop_map(|(id, token, error, via, received_back)| Ev::Deliver { id, token, error, via, received_back }),
        (0..2u8).prop_map(|owner| Ev::Expire { owner }),
        (0..2u8).prop_map(|owner| Ev::Claim { owner }),
        (1..400u16).prop_map(|secs| Ev::Wait { secs }),
        Just(Ev::HandOut),
    ]
}

fn t(ms: u64) -> Timestamp {
    Timestamp::from_millis(ms)
}

fn cid(n: u8) -> CaptchaId {
    CaptchaId::parse(&format!("7100000{n}")).unwrap_or_else(|_| unreachable!("valid id"))
}

fn delivery(id: u8, token: u8, error: bool, via: u8, received_at: Timestamp) -> IncomingResult {
    let outcome = if error {
        Outcome::Failed(ErrorCode::parse(&format!("ERROR_CODE_{token}")).unwrap_or_else(|_| unreachable!()))
    } else {
        Outcome::Solved(Solution::parse(&format!("tok-{token}")).unwrap_or_else(|_| unreachable!()))
    };
    let via = [Via::Callback, Via::Poll, Via::Redrive][usize::from(via % 3)];
    // A pingback knows nothing of the issue time; a poll knows the last "not ready".
    let token_clock_start = if via == Via::Callback { t(0) } else { received_at };
    IncomingResult { captcha_id: cid(id), outcome, received_at, via, token_clock_start }
}

fn held(s: &TaskState) -> Option<(Outcome, Timestamp)> {
    match s {
        TaskState::Solved { solution, resolved_at, .. } => Some((Outcome::Solved(solution.clone()), *resolved_at)),
        TaskState::Failed { code, resolved_at, via, .. } if *via != Via::Submit => {
            Some((Outcome::Failed(code.clone()), *resolved_at))
        }
        _ => None,
    }
}

proptest! {
    #![proptest_config(relay_fuzz::config("state_machine", 20_000))]

    #[test]
    fn any_interleaving_ends_in_the_first_valid_result(events in proptest::collection::vec(ev(), 0..24)) {
        let mut now = 1_000u64;
        let mut task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, t(now));
        let mut recorded = false;
        // The valid deliveries taken as the task's result (not late ones), in the order applied.
        let mut taken: Vec<(Outcome, Timestamp)> = Vec::new();
        let mut pinned: Option<Task> = None;
        for e in events {
            now += 1_000;
            match e {
                Ev::Submitted { id } => {
                    if let Ok(next) = task.clone().submitted(cid(id), t(now)) { task = next }
                }
                Ev::SubmitFailed => {
                    let code = ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").unwrap_or_else(|_| unreachable!());
                    if let Ok(next) = task.clone().submit_failed(code, None, t(now)) { task = next }
                }
                Ev::Unknown => {
                    if matches!(task.state, TaskState::Submitting { .. }) {
                        task.state = TaskState::Submitting { unknown: Some("lost".into()) };
                    }
                }
                Ev::Deliver { id, token, error, via, received_back } => {
                    let d = delivery(id, token, error, via, t(now.saturating_sub(u64::from(received_back) * 1000)));
                    match task.clone().apply(d.clone()) {
                        Ok(Applied::Recorded(next)) => {
                            prop_assert!(!recorded, "recorded twice: {:?} then {:?}", taken, d.outcome);
                            recorded = true;
                            taken.push((d.outcome.clone(), d.received_at));
                            task = next;
                            // The same delivery again changes nothing.
                            prop_assert_eq!(task.clone().apply(d), Ok(Applied::Duplicate));
                        }
                        Ok(Applied::Replaced(next) | Applied::Earlier(next)) => {
                            prop_assert!(pinned.is_none(), "a shown result changed");
                            taken.push((d.outcome.clone(), d.received_at));
                            task = next;
                            prop_assert_eq!(task.clone().apply(d), Ok(Applied::Duplicate));
                        }
                        Ok(Applied::Late(next)) => {
                            task = next;
                            prop_assert_eq!(task.clone().apply(d), Ok(Applied::Duplicate));
                        }
                        Ok(Applied::Duplicate | Applied::Conflict) => {
                            if pinned.is_none() && held(&task.state).is_some() {
                                taken.push((d.outcome.clone(), d.received_at));
                            }
                        }
                        Err(_) => {}
                    }
                }
                Ev::Expire { .. } => {
                    if let Ok(next) = task.clone().expire("deadline".into(), t(now)) { task = next }
                }
                Ev::HandOut => {
                    if task.needs_pin(t(now)) {
                        task.handed_out_at = Some(t(now));
                        pinned = Some(task.clone());
                    }
                }
                Ev::Claim { .. } | Ev::Wait { .. } => {}
            }
            if let Some(p) = &pinned {
                prop_assert_eq!(&task, p, "a result once shown never changes");
            }
        }
        match (held(&task.state), &pinned) {
            // No result held: nothing taken, or only late results (kept on the expired task).
            (None, _) => prop_assert!(!recorded, "recorded a result, then lost it: {:?}", task.state),
            (Some(_), Some(_)) => {} // checked at every step: unchanged since shown
            (Some((outcome, at)), None) => {
                // The earliest received of the results it took; of equal receipt times, the one
                // stored first.
                let first_at = taken.iter().map(|(_, at)| *at).min();
                prop_assert_eq!(Some(at), first_at, "holds the earliest receipt: {:?}", taken);
                let first = taken.iter().find(|(_, a)| Some(*a) == first_at).map(|(o, _)| o.clone());
                prop_assert_eq!(Some(outcome), first, "holds the first-received result: {:?}", taken);
            }
        }
    }
}

/// The store's item, as the model of it: the pure task, plus the poller's bookkeeping.
#[derive(Debug, Clone)]
struct Model {
    task: Task,
    due_at: Option<u64>,
    lease_owner: Option<String>,
}

fn open(s: &TaskState) -> bool {
    matches!(s, TaskState::Submitting { .. } | TaskState::Pending { .. })
}

fn engine() -> &'static relay_shared::testkit::LocalDynamo {
    static DB: std::sync::OnceLock<relay_shared::testkit::LocalDynamo> = std::sync::OnceLock::new();
    DB.get_or_init(|| {
        relay_fuzz::rt().block_on(relay_shared::testkit::LocalDynamo::start()).unwrap_or_else(|e| panic!("engine: {e}"))
    })
}

async fn store_agrees_with_the_model(events: Vec<Ev>) -> Result<(), TestCaseError> {
    let fail = |e: anyhow::Error| TestCaseError::fail(format!("{e:#}"));
    let store = engine().fresh_store().await.map_err(fail)?;
    let mut now = 1_000_000u64;
    let task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, t(now));
    let r = task.task_ref.clone();
    let deadline = now + 600_000;
    prop_assert_eq!(store.tasks().create(&task, t(deadline), None).await.map_err(|e| fail(e.into()))?, Created::New);
    let mut m = Model { task, due_at: Some(deadline), lease_owner: None };
    for e in events {
        now += 1_000;
        match e {
            Ev::Submitted { id } => {
                let got = store
                    .tasks()
                    .mark_submitted(&r, &cid(id), t(now), t(now + 25_000))
                    .await
                    .map_err(|e| fail(e.into()))?;
                match m.task.clone().submitted(cid(id), t(now)) {
                    Ok(next) => {
                        prop_assert!(matches!(got, SubmitRecorded::Pending(_)), "{:?}", got);
                        m.task = next;
                        m.due_at = Some(now + 25_000);
                    }
                    Err(_) => prop_assert!(matches!(got, SubmitRecorded::AlreadyResolved(_)), "{:?}", got),
                }
            }
            Ev::SubmitFailed => {
                let code = ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").unwrap_or_else(|_| unreachable!());
                store
                    .tasks()
                    .mark_submit_failed(&r, code.as_ref(), "refused", t(now))
                    .await
                    .map_err(|e| fail(e.into()))?;
                if let Ok(next) = m.task.clone().submit_failed(code, Some("refused".into()), t(now)) {
                    m.task = next;
                    m.due_at = None;
                }
            }
            Ev::Unknown => {
                let held = store.tasks().mark_submit_unknown(&r, "lost").await.map_err(|e| fail(e.into()))?;
                let submitting = matches!(m.task.state, TaskState::Submitting { .. });
                prop_assert_eq!(held, submitting);
                if submitting {
                    m.task.state = TaskState::Submitting { unknown: Some("lost".into()) };
                }
            }
            Ev::Deliver { id, token, error, via, received_back } => {
                let d = delivery(id, token, error, via, t(now.saturating_sub(u64::from(received_back) * 1000)));
                let got = store.results().record_result(&r, &d).await.map_err(|e| fail(e.into()))?;
                match (m.task.clone().apply(d.clone()), &got) {
                    (Ok(Applied::Recorded(next)), RecordOutcome::Recorded(stored)) => {
                        prop_assert_eq!(stored, &next);
                        m.task = next;
                        m.due_at = None;
                        m.lease_owner = None;
                        // The same delivery again: a duplicate, nothing written.
                        let again = store.results().record_result(&r, &d).await.map_err(|e| fail(e.into()))?;
                        prop_assert!(matches!(again, RecordOutcome::Duplicate(_)), "{:?}", again);
                    }
                    (Ok(Applied::Replaced(next)), RecordOutcome::Replaced(stored))
                    | (Ok(Applied::Earlier(next)), RecordOutcome::Duplicate(stored)) => {
                        prop_assert_eq!(stored, &next);
                        m.task = next;
                        let again = store.results().record_result(&r, &d).await.map_err(|e| fail(e.into()))?;
                        prop_assert!(matches!(again, RecordOutcome::Duplicate(_)), "{:?}", again);
                    }
                    (Ok(Applied::Late(next)), RecordOutcome::Late(_)) => m.task = next,
                    (Ok(Applied::Duplicate), RecordOutcome::Duplicate(_))
                    | (Ok(Applied::Conflict), RecordOutcome::Conflict(_))
                    | (
                        Err(relay_shared::domain::TransitionError::IdMismatch { .. }),
                        RecordOutcome::IdMismatch { .. },
                    ) => {}
                    (want, got) => prop_assert!(false, "model {:?}, store {:?}", want, got),
                }
            }
            Ev::Expire { owner } => {
                let owner = format!("poller-{owner}");
                let done = store.poll().expire(&r, "deadline", t(now), &owner).await.map_err(|e| fail(e.into()))?;
                let allowed = open(&m.task.state)
                    && (m.due_at.is_some_and(|d| d <= now) || m.lease_owner.as_deref() == Some(owner.as_str()));
                prop_assert_eq!(done, allowed, "expiry by {} at {} with {:?}", owner, now, m);
                if allowed {
                    m.task = m.task.clone().expire("deadline".into(), t(now)).map_err(|e| fail(e.into()))?;
                    m.due_at = None;
                    m.lease_owner = None;
                }
            }
            Ev::Claim { owner } => {
                let owner = format!("poller-{owner}");
                let page = store
                    .poll()
                    .due_page(store.shards().of(&r), t(now), 100, None)
                    .await
                    .map_err(|e| fail(e.into()))?;
                let listed = page.tasks.into_iter().find(|d| d.task.task_ref == r);
                let due = open(&m.task.state) && m.due_at.is_some_and(|d| d <= now);
                prop_assert_eq!(listed.is_some(), due, "listed when due: {:?}", m);
                if let Some(d) = listed {
                    prop_assert!(
                        store.poll().claim(&d, &owner, t(now + 90_000), true).await.map_err(|e| fail(e.into()))?
                    );
                    m.due_at = Some(now + 90_000);
                    m.lease_owner = Some(owner);
                }
            }
            Ev::Wait { secs } => now += u64::from(secs) * 1000,
            Ev::HandOut => {
                // What the API does on a read: pin a result it is about to show.
                let seen = store.tasks().get(&r).await.map_err(|e| fail(e.into()))?;
                if let Some(seen) = seen.filter(|s| s.needs_pin(t(now))) {
                    let got = store.results().mark_handed_out(&seen, t(now)).await.map_err(|e| fail(e.into()))?;
                    prop_assert!(got.is_none(), "nothing raced this pin: {:?}", got);
                    m.task.handed_out_at = Some(t(now));
                    // A pin made from an outdated read is refused and returns the item as it is.
                    let again = store.results().mark_handed_out(&seen, t(now + 1)).await.map_err(|e| fail(e.into()))?;
                    prop_assert_eq!(again.and_then(|a| a.handed_out_at), Some(t(now)));
                }
                prop_assert!(!m.task.needs_pin(t(now)), "shown, so pinned: {:?}", m.task);
            }
        }
        let stored = store.tasks().get(&r).await.map_err(|e| fail(e.into()))?;
        prop_assert_eq!(stored.as_ref(), Some(&m.task), "the store agrees with the state machine");
    }
    Ok(())
}

proptest! {
    #![proptest_config(relay_fuzz::config("store", 300))]

    #[test]
    fn the_store_on_the_embedded_engine_agrees_with_the_state_machine(events in proptest::collection::vec(ev(), 0..16)) {
        let _ = engine(); // started outside the runtime's block_on
        relay_fuzz::rt().block_on(store_agrees_with_the_model(events))?;
    }
}

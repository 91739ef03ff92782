//! Into the submit queue: a new task counted in within the queue's bounds, or an inline submit
//! in.php refused for now; the submitter woken when none runs.

use relay_shared::captchaai::{CaptchaAiError, SubmitRequest};
use relay_shared::domain::{Task, TaskState};
use relay_shared::store::{Created, Reserved, SubmitState};
use relay_shared::time::Timestamp;

use super::bookkeeping::{deadline_after, refused};
use super::outcome::{Submitted, key_rejected, replayed};
use crate::deps::Deps;

/// A new task into the submit queue: counted in (within the bounds), then put, then the
/// submitter woken if none is running. `known`: the state item as a refused permit just showed
/// it, when the reservation lands on another count item (`QUEUE_SHARDS`) and so cannot.
pub(super) async fn enqueue(
    deps: &Deps,
    task: Task,
    submit: &SubmitRequest,
    pingback: &str,
    fp: Option<&str>,
    fingerprint: &str,
    known: Option<SubmitState>,
) -> Submitted {
    let TaskState::Queued { lane, .. } = &task.state else { return Submitted::Misconfigured };
    let lane = lane.clone();
    let now = deps.clock.now();
    let shard = deps.store.queue.queue_shard(&task.task_ref);
    let state =
        match deps.store.queue.reserve_queue(&lane, shard, deps.queue.max_per_owner, deps.queue.max_total, false).await
        {
            Ok(Reserved::Yes(counted)) => {
                let state = state_item(deps, shard, *counted, known, now);
                if let Some(open) = state.as_ref().and_then(|st| key_rejected(st, now)) {
                    // Seen only now when the permit was skipped on the hint.
                    uncount(deps, &lane, shard).await;
                    return open;
                }
                state
            }
            Ok(Reserved::Full { owner, depth, bound }) => {
                metrics::counter!("submits", "outcome" => "queue_full").increment(1);
                tracing::warn!(event = "queue_full", owner, depth, bound, "submit queue at its bound; refused");
                return Submitted::QueueFull { owner, depth, bound };
            }
            Err(e) => return Submitted::Store(e),
        };
    match deps.store.queue.create_queued(&task, submit, pingback, deadline_after(deps, task.kind), fp).await {
        Ok(Created::New) => {
            metrics::counter!("submits", "outcome" => "queued").increment(1);
            tracing::info!(event = "task_queued", lane = %lane, "queued for a free CaptchaAI thread");
            if !state.is_some_and(|st| st.releaser_live(deps.clock.now())) {
                deps.waker.wake(deps.clock.now()).await;
            }
            Submitted::Queued(task)
        }
        Ok(Created::Existing { task, fingerprint: stored }) => {
            uncount(deps, &lane, shard).await;
            replayed(deps, task, stored, fingerprint.to_owned()).await
        }
        Err(e) => {
            uncount(deps, &lane, shard).await;
            Submitted::Store(e)
        }
    }
}

/// The state item after a reservation: the reservation's own answer when the task counts on it
/// (shard 0), otherwise what this instance last saw of it (`None`: nothing, so the submitter is
/// woken in case).
fn state_item(
    deps: &Deps,
    shard: u8,
    counted: SubmitState,
    known: Option<SubmitState>,
    now: Timestamp,
) -> Option<SubmitState> {
    if shard == 0 { Some(counted) } else { known.or_else(|| deps.admission.known(now)) }
}

/// Takes back a reservation that was not used (a count left too high is reconciled by the
/// submitter: never a task unseen).
async fn uncount(deps: &Deps, lane: &str, shard: u8) {
    if let Err(e) = deps.store.queue.count_queued(lane, shard, -1).await {
        tracing::warn!(event = "store_failed", error = %e, "could not take back a queue reservation");
    }
}

/// An inline submit in.php refused for now (no free thread, a ban, a server error code):
/// nothing was accepted, so it goes to the queue (the owner hears 202) — unless the queue is at
/// its bound, when the owner hears that instead, nothing accepted.
pub(super) async fn queue_unsent(
    deps: &Deps,
    task: Task,
    submit: &SubmitRequest,
    pingback: &str,
    lane: String,
    no_slot: bool,
    keyed: bool,
) -> Submitted {
    let now = deps.clock.now();
    let shard = deps.store.queue.queue_shard(&task.task_ref);
    let state = match deps
        .store
        .queue
        .reserve_queue(&lane, shard, deps.queue.max_per_owner, deps.queue.max_total, no_slot)
        .await
    {
        Ok(Reserved::Yes(counted)) => state_item(deps, shard, *counted, None, now),
        Ok(Reserved::Full { owner, depth, bound }) => {
            let err = CaptchaAiError::Code(
                relay_shared::codes::ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").expect("a valid code"),
            );
            refused(deps, &task.task_ref, &err, keyed).await;
            metrics::counter!("submits", "outcome" => "queue_full").increment(1);
            return Submitted::QueueFull { owner, depth, bound };
        }
        Err(e) => {
            // Still `submitting` without an outcome: the poller expires it at its deadline, and
            // nothing was paid. Say the store failed (a retry with the key is safe).
            return Submitted::Store(e);
        }
    };
    match deps.store.queue.queue_unsent(&task, &lane, now, submit, pingback, deadline_after(deps, task.kind)).await {
        Ok(true) => {
            metrics::counter!("submits", "outcome" => "queued").increment(1);
            if !state.is_some_and(|st| st.releaser_live(now)) {
                deps.waker.wake(now).await;
            }
            Submitted::Queued(Task { state: TaskState::Queued { queued_at: now, lane }, ..task })
        }
        Ok(false) => {
            // It left `submitting` meanwhile (its pingback cannot have come: in.php took
            // nothing). Show what it is.
            uncount(deps, &lane, shard).await;
            match deps.store.tasks.get(&task.task_ref).await {
                Ok(Some(t)) => Submitted::Accepted(t),
                Ok(None) => Submitted::Store(relay_shared::store::StoreError::Rejected("the task vanished".into())),
                Err(e) => Submitted::Store(e),
            }
        }
        Err(e) => {
            uncount(deps, &lane, shard).await;
            Submitted::Store(e)
        }
    }
}

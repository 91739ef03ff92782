//! Sending a stranded task (no CaptchaAI id, its result overdue) to in.php again, once.

use std::sync::Arc;
use std::time::Duration;

use relay_shared::store::{DueTask, Reschedule};
use relay_shared::time::{Clock, Timestamp};

use crate::Deps;
use crate::schedule::NO_ID_GRACE;

/// What a resend came to.
pub(crate) enum Resent {
    /// In.php took it (or may have): its pingback or a read resolves it.
    Sent,
    /// Not this poller's to send (claimed elsewhere, resolved meanwhile).
    Lost,
    /// Not now (no in.php slot, an explicit refusal for now): looked at again at `at`.
    Later,
    /// In.php refused it for good: failed.
    Refused,
    Error,
}

/// Sends a stranded task to in.php again: claimed, marked resent (before in.php hears of it,
/// so never twice), in the account's in.php pace; the answer recorded as a submit's is.
pub(crate) async fn resend(deps: &Deps, clock: &Arc<dyn Clock>, due: &DueTask) -> Resent {
    use relay_shared::submit::{InPhp, Recorder};
    let s = &deps.settings;
    let r = &due.task.task_ref;
    let now = clock.now();
    match deps.store.poll.claim(due, &deps.owner, now.plus(s.lease), false).await {
        Ok(true) => {}
        Ok(false) => return Resent::Lost,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return Resent::Error;
        }
    }
    // Back on the due list at `at`, the lease ended.
    let later = |at: Timestamp| async move {
        match deps.store.poll.reschedule(r, &deps.owner, Reschedule::at(at)).await {
            Ok(_) => Resent::Later,
            Err(_) => Resent::Error,
        }
    };
    let sendable = match deps.store.queue.unsent_request(r).await {
        Ok(x) => x,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return later(now.plus(Duration::from_secs(5))).await;
        }
    };
    match deps.store.account.take_submit_slot(now, s.submits_per_second).await {
        Ok(true) => {}
        Ok(false) => return later(now.plus(Duration::from_secs(1))).await,
        Err(_) => return later(now.plus(Duration::from_secs(5))).await,
    }
    match deps.store.queue.mark_resent(r, now).await {
        Ok(true) => {}
        Ok(false) => return Resent::Lost,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return later(now.plus(Duration::from_secs(5))).await;
        }
    }
    let Some((request, pingback)) = sendable else {
        // Kept from before requests were kept: it cannot be sent again; it waits out its kind's
        // deadline instead.
        tracing::warn!(event = "resend_impossible", task_ref = %r, "no request kept for a stranded task");
        return later(now.plus(due.task.kind.max_solve_time() + NO_ID_GRACE)).await;
    };
    let answer = {
        let _io = clock.io();
        deps.captchaai.submit(&request, &pingback).await
    };
    let recorder =
        Recorder { tasks: &deps.store.tasks, dead_letters: deps.dead_letters.as_ref(), clock: clock.as_ref() };
    let task = &due.task;
    metrics::counter!("submits_resent").increment(1);
    match InPhp::of(answer) {
        InPhp::Accepted(id) => {
            tracing::info!(event = "task_resent", task_ref = %r, captcha_id = %id, "a stranded task was sent again");
            recorder.accepted(task, &id, s.grace.for_kind(task.kind)).await;
            Resent::Sent
        }
        InPhp::Unknown(err) => {
            recorder.unknown(task, &err).await;
            let at = clock.now().plus(task.kind.max_solve_time() + NO_ID_GRACE);
            later(at).await;
            Resent::Sent
        }
        InPhp::NoSlot(_) | InPhp::Transient(_) | InPhp::Banned(..) => {
            // Nothing was taken: it may be sent again later.
            let _ = deps.store.queue.clear_resent(r).await;
            later(clock.now().plus(Duration::from_secs(10))).await
        }
        InPhp::Refused(err) => {
            let detail = format!("in.php refused the task when it was sent again: {err}");
            match deps.store.tasks.mark_submit_failed(r, &err.code(), &detail, clock.now()).await {
                Ok(_) => Resent::Refused,
                Err(_) => Resent::Error,
            }
        }
    }
}

//! What a submit writes besides the task: an unused permit given back, a refusal recorded (or
//! its idempotency key freed), and when the poller first looks at a task sent.

use std::time::Duration;

use relay_shared::captchaai::CaptchaAiError;
use relay_shared::codes::{CodeClass, ban};
use relay_shared::domain::TaskRef;

use crate::deps::Deps;

pub(super) async fn give_back_permit(deps: &Deps) {
    if let Err(e) = deps.store.queue.give_back_permit().await {
        // The submitter publishes the permits afresh within a second of running.
        tracing::warn!(event = "store_failed", error = %e, "could not give back an unused permit");
    }
}

/// When, after it is sent, the poller looks at a task whose in.php answer was never stored: its
/// callback's grace and CaptchaAI's longest solve.
/// When the poller first looks at a task whose in.php id was never stored: when it is sent
/// again if its result is overdue by then (CaptchaAI: [`CaptchaKind::resend_after`]), or when
/// it expires (an upstream that bills per solution is never sent a task twice).
///
/// [`CaptchaKind::resend_after`]: relay_shared::domain::CaptchaKind::resend_after
pub(super) fn deadline_after(deps: &Deps, kind: relay_shared::domain::CaptchaKind) -> Duration {
    if deps.queue.upstream.resend_default() {
        kind.resend_after()
    } else {
        deps.callback_grace.for_kind(kind) + kind.max_solve_time()
    }
}

/// Stores an explicit refusal on the task (it failed at submit, nothing was accepted). A refusal
/// that a later try may overcome (a rejected key an operator fixes, a full queue) under an
/// idempotency key frees the key instead — the task is forgotten, nothing having been accepted —
/// so the same request with the same key can be sent again, as its answer says.
pub(super) async fn refused(deps: &Deps, task_ref: &TaskRef, err: &CaptchaAiError, keyed: bool) {
    let final_refusal = matches!(err.class(), CodeClass::Permanent | CodeClass::TerminalForTask)
        && !matches!(err, CaptchaAiError::Code(c) if ban(c.as_ref()).is_some());
    if keyed && !final_refusal {
        match deps.store.tasks.forget_unsent(task_ref).await {
            Ok(_) => return,
            Err(e) => tracing::error!(event = "store_failed", error = %e, "could not free the idempotency key"),
        }
    }
    let detail = format!("in.php refused the task: {err}");
    if let Err(e) = deps.store.tasks.mark_submit_failed(task_ref, &err.code(), &detail, deps.clock.now()).await {
        // It stays `submitting` and expires at its deadline: still true, never wrong.
        tracing::error!(event = "store_failed", error = %e, "could not mark the refused submit");
    }
}

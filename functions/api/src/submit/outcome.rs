//! How a submit ends, for either front to answer in its own form: its input, its outcomes, and
//! the two read from stored state (a rejected key, a replayed idempotency key).

use std::time::Duration;

use relay_shared::captchaai::SubmitRequest;
use relay_shared::codes::CodeClass;
use relay_shared::domain::{Task, TaskRef};
use relay_shared::store::SubmitState;
use relay_shared::time::Timestamp;

use crate::deps::Deps;
use crate::pin::{Pin, pin};

/// A submit, however it came (`POST /tasks` or the 2captcha-compatible `in.php`).
pub(crate) struct SubmitInput {
    pub submit: SubmitRequest,
    /// Of the request, for idempotency checks.
    pub fingerprint: String,
    /// Whether `task_ref` was derived from an idempotency key.
    pub keyed: bool,
    pub task_ref: TaskRef,
    pub owner_callback: Option<String>,
    /// Whose webhook secret signs the pushes to `owner_callback`.
    pub webhook_owner: Option<String>,
    /// How a compat task's result goes to its `pingback` (its relay key's setting).
    pub pingback_form: relay_shared::domain::PingbackForm,
    /// Who submits (the IAM caller, the relay key's name): whose queue lane it waits in.
    pub owner: String,
}

/// How a submit ended, for either front to answer in its own form.
pub(crate) enum Submitted {
    /// CaptchaAI has it (or may have it: an unknown outcome); the task as it now stands.
    Accepted(Task),
    /// In the submit queue: released to CaptchaAI as a thread frees.
    Queued(Task),
    /// The idempotency key was used before: that task, and the fingerprint it came with.
    Replayed { task: Task, stored: Option<String>, fingerprint: String },
    /// The breaker is open for a key or account problem an operator must fix: nothing recorded.
    BreakerOpen { until: Timestamp, reason: String },
    /// The submit queue is at its bound (`owner`: its owner's lane): nothing recorded.
    QueueFull { owner: bool, depth: u64, bound: u64 },
    /// The store failed before anything was sent.
    Store(relay_shared::store::StoreError),
    /// The relay does not know its callback URL.
    Misconfigured,
    /// A replayed task's result is being replaced by one received earlier: read again.
    ResultChanging,
    /// In.php rejected the account's key: the breaker is open, nothing was accepted.
    Banned { code: String, until: Timestamp, duration: Duration },
    /// An explicit, final refusal: the task is failed with the code.
    Refused { code: String, class: CodeClass, message: String, task_ref: TaskRef },
}

/// A rejected key (the breaker open for an operator): queueing would only hold the work until
/// it times out, so the submit is refused with the reason.
pub(super) fn key_rejected(state: &SubmitState, now: Timestamp) -> Option<Submitted> {
    let until = state.breaker.open_for_submits_at(now).filter(|_| state.breaker.needs_operator)?;
    metrics::counter!("submits", "outcome" => "breaker_open").increment(1);
    Some(Submitted::BreakerOpen { until, reason: state.breaker.reason.clone().unwrap_or_default() })
}

/// A submit whose key was used before: that task (its result pinned if it shows one).
pub(super) async fn replayed(deps: &Deps, task: Task, stored: Option<String>, fingerprint: String) -> Submitted {
    metrics::counter!("submits", "outcome" => "replayed").increment(1);
    tracing::info!(event = "submit_replayed", state = task.state.name(), "idempotency key seen before");
    let task = if stored.as_deref() == Some(fingerprint.as_str()) {
        match pin(task, deps).await {
            Ok(t) => t,
            Err(Pin::Store(e)) => return Submitted::Store(e),
            Err(Pin::Changing) => return Submitted::ResultChanging,
        }
    } else {
        task
    };
    Submitted::Replayed { task, stored, fingerprint }
}

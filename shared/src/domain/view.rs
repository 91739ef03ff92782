//! What a task's owner sees from `GET /tasks/{ref}`: the views and how a task is turned
//! into one at a given moment.

use serde::Serialize;

use super::{CaptchaId, CaptchaKind, DeliveryStatus, LateResult, Outcome, Task, TaskRef, TaskState, Via};
use crate::time::Timestamp;

impl Task {
    /// What the task looks like to its owner at `now`. A solution past its lifetime is
    /// reported as expired and is not handed out.
    pub fn view(&self, now: Timestamp) -> TaskView {
        let mut v = TaskView {
            task_ref: self.task_ref.clone(),
            kind: self.kind,
            status: self.state.name(),
            created_at: self.created_at.to_rfc3339(),
            captcha_id: self.captcha_id.clone(),
            submitted_at: None,
            solution: None,
            user_agent: None,
            error_code: None,
            error_detail: None,
            resolved_at: None,
            resolved_via: None,
            expires_at: None,
            late_result: None,
            submit_outcome: None,
            resent_at: self.resent_at.map(Timestamp::to_rfc3339),
            queue: None,
            callback_url: self.owner_callback.clone(),
            delivery: self.delivery.as_ref().map(|d| DeliveryView {
                status: d.status,
                attempts: d.attempts,
                webhook_id: d.delivered_id.clone(),
                next_attempt_at: d.next_attempt_at.map(Timestamp::to_rfc3339),
                schedule: d.next_attempt_at.map(|at| super::schedule::Phase::at(self.token_dies_at(), at).as_str()),
                last_attempt_at: d.last_attempt_at.map(Timestamp::to_rfc3339),
                last_outcome: d.last_outcome.clone(),
                delivered_at: d.delivered_at.map(Timestamp::to_rfc3339),
                parked_at: d.parked_at.map(Timestamp::to_rfc3339),
            }),
        };
        match &self.state {
            TaskState::Queued { queued_at, .. } => {
                v.queue =
                    Some(QueueView { queued_at: queued_at.to_rfc3339(), position: None, estimated_release_at: None });
            }
            TaskState::Submitting { unknown: None } => {}
            TaskState::Submitting { unknown: Some(why) } => {
                v.submit_outcome = Some("unknown");
                v.error_detail = Some(why.clone());
            }
            TaskState::Pending { submitted_at } => v.submitted_at = Some(submitted_at.to_rfc3339()),
            TaskState::Solved { solution, resolved_at, via, .. } => {
                v.resolved_at = Some(resolved_at.to_rfc3339());
                v.resolved_via = Some(*via);
                let expires_at = self.solution_expires_at();
                v.expires_at = expires_at.map(Timestamp::to_rfc3339);
                if expires_at.is_some_and(|e| now >= e) {
                    v.status = "expired";
                    v.error_code = Some("TOKEN_LIFETIME_ELAPSED".into());
                    v.error_detail =
                        Some("the solution is older than its token lifetime and was not handed out".into());
                } else {
                    v.solution = Some(solution.expose().to_owned());
                    v.user_agent = solution.user_agent().map(str::to_owned);
                }
            }
            TaskState::Failed { code, detail, resolved_at, via } => {
                v.resolved_at = Some(resolved_at.to_rfc3339());
                v.resolved_via = Some(*via);
                v.error_code = Some(code.as_ref().to_owned());
                v.error_detail.clone_from(detail);
            }
            TaskState::Expired { reason, resolved_at, late } => {
                v.resolved_at = Some(resolved_at.to_rfc3339());
                v.resolved_via = Some(Via::Deadline);
                v.error_code = Some("DEADLINE_EXCEEDED".into());
                v.error_detail = Some(reason.clone());
                v.late_result = late.as_ref().map(|l| self.late_view(l, now));
            }
        }
        v
    }

    /// A late result as its owner sees it: its token only while still fresh, like any result.
    fn late_view(&self, l: &LateResult, now: Timestamp) -> LateView {
        let expires_at = match l.outcome {
            Outcome::Solved(_) => self.kind.token_lifetime().map(|life| l.token_clock_start.plus(life)),
            Outcome::Failed(_) => None,
        };
        let fresh = expires_at.is_none_or(|e| now < e);
        let (status, solution, error_code) = match &l.outcome {
            Outcome::Solved(s) if fresh => ("solved", Some(s.expose().to_owned()), None),
            Outcome::Solved(_) => ("stale", None, Some("TOKEN_LIFETIME_ELAPSED".to_owned())),
            Outcome::Failed(c) => ("failed", None, Some(c.as_ref().to_owned())),
        };
        LateView {
            status,
            solution,
            error_code,
            received_at: l.received_at.to_rfc3339(),
            received_via: l.via,
            age_secs: now.since(l.token_clock_start).as_secs(),
            expires_at: expires_at.map(Timestamp::to_rfc3339),
        }
    }
}

/// A result that came after the task was expired, in `GET /tasks/{ref}`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LateView {
    /// `solved` (token handed out while fresh), `stale` (too old to hand out) or `failed`.
    pub status: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub solution: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    pub received_at: String,
    pub received_via: Via,
    /// Seconds since the token was issued at the latest (for an answer, since it arrived).
    pub age_secs: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
}

/// The JSON a task's owner sees from `GET /tasks/{ref}`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct TaskView {
    pub task_ref: TaskRef,
    pub kind: CaptchaKind,
    pub status: &'static str,
    pub created_at: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub captcha_id: Option<CaptchaId>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submitted_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub solution: Option<String>,
    /// The user agent to use `solution` with, where CaptchaAI named one (reCAPTCHA Enterprise,
    /// a Cloudflare challenge).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_code: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error_detail: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resolved_via: Option<Via>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expires_at: Option<String>,
    /// A result that arrived after the task was expired (kept, never dropped).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub late_result: Option<LateView>,
    /// `unknown` while in.php's answer to the submit is not known (see `error_detail`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub submit_outcome: Option<&'static str>,
    /// When the task was sent to in.php a second time, its first submit's outcome lost and its
    /// result overdue (once at most; either submission's result is its result).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resent_at: Option<String>,
    /// Where a queued task waits (status `queued`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub queue: Option<QueueView>,
    /// The owner's own callback URL, if the task was given one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub callback_url: Option<String>,
    /// Where the push to `callback_url` stands.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivery: Option<DeliveryView>,
}

/// A queued task's place, in `GET /tasks/{ref}`: nothing was sent to CaptchaAI yet.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct QueueView {
    pub queued_at: String,
    /// 1 for the next of its owner's tasks of its class to be released (the tasks of other
    /// owners share the threads fairly with it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    /// When it should be released at the rate the queue is being released now.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimated_release_at: Option<String>,
}

/// The push of a result to the owner's callback, in `GET /tasks/{ref}`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeliveryView {
    pub status: DeliveryStatus,
    pub attempts: u32,
    /// The `webhook-id` of the last push delivered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webhook_id: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub next_attempt_at: Option<String>,
    /// The schedule the next attempt is on: `token` (it carries a live token: fast retries
    /// until just before it dies) or `standard` (see `crate::domain::schedule`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub schedule: Option<&'static str>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_attempt_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_outcome: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub delivered_at: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parked_at: Option<String>,
}

//! The task and its life as a state machine: its states, the transitions between them
//! ([`Task::apply`] for a result from any path) and the times its state implies.

use super::{CaptchaId, CaptchaKind, DeliveryState, IncomingResult, Outcome, PingbackForm, Solution, TaskRef, Via};
use crate::codes::ErrorCode;
use crate::time::Timestamp;

/// Where a task is in its life.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskState {
    /// Accepted by the relay and waiting in its submit queue for a free CaptchaAI thread: nothing
    /// was sent to CaptchaAI, nothing is paid. `lane` is the queue it waits in (its owner's, for
    /// its class of captcha), oldest first.
    Queued {
        queued_at: Timestamp,
        lane: String,
    },
    /// Recorded, in.php not (yet) confirmed. `unknown`: in.php was called but its answer does
    /// not say whether it took the task (a timeout, a cut connection, a 5xx or HTML page): it
    /// may be solved — its pingback, which carries our reference, will say — and is never
    /// called failed, nor submitted again by the relay.
    Submitting {
        unknown: Option<String>,
    },
    /// In.php accepted it; waiting for the callback or the poller.
    Pending {
        submitted_at: Timestamp,
    },
    Solved {
        solution: Solution,
        resolved_at: Timestamp,
        via: Via,
        token_clock_start: Timestamp,
    },
    Failed {
        code: ErrorCode,
        detail: Option<String>,
        resolved_at: Timestamp,
        via: Via,
    },
    /// No result came in time.
    Expired {
        reason: String,
        resolved_at: Timestamp,
        /// A result that arrived after the task was expired: paid for, so kept and shown, never
        /// silently dropped.
        late: Option<LateResult>,
    },
}

/// A result that arrived after its task had been expired.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LateResult {
    pub outcome: Outcome,
    pub received_at: Timestamp,
    pub via: Via,
    pub token_clock_start: Timestamp,
}

impl TaskState {
    pub fn name(&self) -> &'static str {
        match self {
            Self::Queued { .. } => "queued",
            Self::Submitting { .. } => "submitting",
            Self::Pending { .. } => "pending",
            Self::Solved { .. } => "solved",
            Self::Failed { .. } => "failed",
            Self::Expired { .. } => "expired",
        }
    }

    pub fn is_final(&self) -> bool {
        matches!(self, Self::Solved { .. } | Self::Failed { .. } | Self::Expired { .. })
    }
}

/// A task as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Task {
    pub task_ref: TaskRef,
    pub kind: CaptchaKind,
    pub created_at: Timestamp,
    /// Known once in.php answered, or once a callback carried it (whichever came first).
    pub captcha_id: Option<CaptchaId>,
    pub state: TaskState,
    /// When the owner was first shown the task's result (a solution or CaptchaAI's verdict).
    /// From then on the result never changes; before, a different result *received* earlier
    /// than the recorded one replaces it (first received wins, not first stored).
    pub handed_out_at: Option<Timestamp>,
    /// The owner's own callback URL (`callback_url` of `POST /tasks`, `pingback` of the
    /// 2captcha-compatible `in.php`): the task's result is pushed there (see
    /// [`crate::delivery`]).
    pub owner_callback: Option<String>,
    /// Whose webhook secret signs the pushes: the relay key's name for compat tasks, `default`
    /// for `POST /tasks`.
    pub webhook_owner: Option<String>,
    /// Where the push of its result stands (only a task with an owner callback has one).
    pub delivery: Option<DeliveryState>,
    /// When the submit queue released it to in.php (a task that waited in the queue); its
    /// deadlines count from then, not from its creation.
    pub released_at: Option<Timestamp>,
    /// How a compat task's result is pushed to its `pingback` (its relay key's setting).
    pub pingback_form: PingbackForm,
    /// When the task was sent to in.php a second time, its first submit's outcome unknown (or
    /// lost in a crash) and its result overdue ([`CaptchaKind::resend_after`]). Either
    /// submission's result is then its result: the first to arrive wins.
    pub resent_at: Option<Timestamp>,
    /// Who submitted it: the caller of `POST /tasks` (its IAM identity or `api-key`), or
    /// `key:<name>` for a relay key — what an erasure request names (`relay-ops erase`).
    pub owner: Option<String>,
}

/// A transition that the current state does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("task is {from}, cannot {action}")]
    NotAllowed { from: &'static str, action: &'static str },
    #[error("result is for CaptchaAI id {got}, but the task has id {expected}")]
    IdMismatch { expected: CaptchaId, got: CaptchaId },
}

/// What applying a delivery to a task amounts to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Applied {
    /// The task had no result; this one is now its result.
    Recorded(Task),
    /// The task already has this very result: nothing to write.
    Duplicate,
    /// The task already has a different result, received no later than this one or already
    /// shown to the owner: it stays.
    Conflict,
    /// The task had a different result, received *after* this one and not yet shown to the owner:
    /// this one replaces it. CaptchaAI's first answer wins even when a retry (the dead-letter
    /// queue) stored it second.
    Replaced(Task),
    /// The task already has this result, but this delivery received it earlier: the receipt time
    /// moves back to it, so a later-received different result can never displace it.
    Earlier(Task),
    /// The task had been expired before this result arrived: the result is kept on it as a late
    /// result (the task stays expired).
    Late(Task),
}

impl Task {
    pub fn new(task_ref: TaskRef, kind: CaptchaKind, now: Timestamp) -> Self {
        Self {
            task_ref,
            kind,
            created_at: now,
            captcha_id: None,
            state: TaskState::Submitting { unknown: None },
            handed_out_at: None,
            owner_callback: None,
            webhook_owner: None,
            delivery: None,
            released_at: None,
            pingback_form: PingbackForm::Get,
            resent_at: None,
            owner: None,
        }
    }

    /// A new task that waits in the submit queue (lane `lane`) for a free thread.
    pub fn queued(task_ref: TaskRef, kind: CaptchaKind, now: Timestamp, lane: String) -> Self {
        Self { state: TaskState::Queued { queued_at: now, lane }, ..Self::new(task_ref, kind, now) }
    }

    /// The queue released it to in.php: queued → submitting.
    pub fn released(self, now: Timestamp) -> Result<Self, TransitionError> {
        match self.state {
            TaskState::Queued { .. } => {
                Ok(Self { state: TaskState::Submitting { unknown: None }, released_at: Some(now), ..self })
            }
            ref other => Err(TransitionError::NotAllowed { from: other.name(), action: "release" }),
        }
    }

    /// In.php refused it explicitly for now (no free thread, a ban): back to its place in the
    /// queue. Only a task in.php never took (no id, no unknown outcome) goes back.
    pub fn requeued(self, queued_at: Timestamp, lane: String) -> Result<Self, TransitionError> {
        match self.state {
            TaskState::Submitting { unknown: None } if self.captcha_id.is_none() => {
                Ok(Self { state: TaskState::Queued { queued_at, lane }, released_at: None, ..self })
            }
            ref other => Err(TransitionError::NotAllowed { from: other.name(), action: "requeue" }),
        }
    }

    /// In.php accepted the task under `id`.
    pub fn submitted(self, id: CaptchaId, now: Timestamp) -> Result<Self, TransitionError> {
        match self.state {
            TaskState::Submitting { .. } => {
                Ok(Self { captcha_id: Some(id), state: TaskState::Pending { submitted_at: now }, ..self })
            }
            ref other => Err(TransitionError::NotAllowed { from: other.name(), action: "mark submitted" }),
        }
    }

    /// In.php refused the task for good (or transient errors outlasted the retries).
    pub fn submit_failed(
        self,
        code: ErrorCode,
        detail: Option<String>,
        now: Timestamp,
    ) -> Result<Self, TransitionError> {
        match self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } => {
                Ok(Self { state: TaskState::Failed { code, detail, resolved_at: now, via: Via::Submit }, ..self })
            }
            ref other => Err(TransitionError::NotAllowed { from: other.name(), action: "fail the submit" }),
        }
    }

    /// A result arrived (callback, poll or redrive).
    pub fn apply(self, d: IncomingResult) -> Result<Applied, TransitionError> {
        // A task sent twice has two CaptchaAI ids, the first never learnt: a result of either is
        // its result.
        if let Some(expected) = &self.captcha_id
            && *expected != d.captcha_id
            && self.resent_at.is_none()
        {
            return Err(TransitionError::IdMismatch { expected: expected.clone(), got: d.captcha_id });
        }
        let takes_result = match &self.state {
            // (A queued task was never sent, so no result should come; one that does proves
            // CaptchaAI has it after all: paid for, so it counts.)
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => true,
            // A result proves in.php accepted the task after all: it was paid for, so it counts.
            TaskState::Failed { via: Via::Submit, .. } => true,
            // Received before the task was expired, stored after: still the task's result.
            TaskState::Expired { resolved_at, .. } => d.received_at <= *resolved_at,
            TaskState::Solved { .. } | TaskState::Failed { .. } => false,
        };
        if takes_result {
            return Ok(Applied::Recorded(self.with_result(d)));
        }
        if let TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } = &self.state
            && self.handed_out_at.is_none()
            && d.received_at < *resolved_at
        {
            let same = match (&self.state, &d.outcome) {
                (TaskState::Solved { solution, .. }, Outcome::Solved(s)) => s == solution,
                (TaskState::Failed { code, .. }, Outcome::Failed(c)) => c == code,
                _ => false,
            };
            let next = self.with_result(d);
            return Ok(if same { Applied::Earlier(next) } else { Applied::Replaced(next) });
        }
        match &self.state {
            TaskState::Solved { solution, .. } => Ok(match d.outcome {
                Outcome::Solved(s) if s == *solution => Applied::Duplicate,
                _ => Applied::Conflict,
            }),
            TaskState::Failed { code, .. } => Ok(match d.outcome {
                Outcome::Failed(c) if c == *code => Applied::Duplicate,
                _ => Applied::Conflict,
            }),
            TaskState::Expired { late: Some(l), .. } => {
                Ok(if l.outcome == d.outcome { Applied::Duplicate } else { Applied::Conflict })
            }
            TaskState::Expired { reason, resolved_at, late: None } => {
                let late = LateResult {
                    outcome: d.outcome,
                    received_at: d.received_at,
                    via: d.via,
                    token_clock_start: d.token_clock_start.max(self.created_at),
                };
                let state = TaskState::Expired { reason: reason.clone(), resolved_at: *resolved_at, late: Some(late) };
                Ok(Applied::Late(Self { captcha_id: Some(d.captcha_id), state, ..self }))
            }
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => {
                Err(TransitionError::NotAllowed { from: self.state.name(), action: "classify a result" })
            }
        }
    }

    /// The task with `d` as its result (the caller checked that it takes one).
    fn with_result(self, d: IncomingResult) -> Self {
        let state = match d.outcome {
            Outcome::Solved(solution) => TaskState::Solved {
                solution,
                resolved_at: d.received_at,
                via: d.via,
                token_clock_start: d.token_clock_start.max(self.created_at),
            },
            Outcome::Failed(code) => TaskState::Failed { code, detail: None, resolved_at: d.received_at, via: d.via },
        };
        Self { captcha_id: Some(d.captcha_id), state, ..self }
    }

    /// No answer came before the deadline.
    pub fn expire(self, reason: String, now: Timestamp) -> Result<Self, TransitionError> {
        match self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => {
                Ok(Self { state: TaskState::Expired { reason, resolved_at: now, late: None }, ..self })
            }
            ref other => Err(TransitionError::NotAllowed { from: other.name(), action: "expire" }),
        }
    }

    /// Whether showing the task to its owner at `now` hands out a result that must then never
    /// change: a fresh solution or CaptchaAI's verdict, not yet pinned. A submit failure is never
    /// pinned (a later result still overrides it), nor a stale solution (not handed out).
    pub fn needs_pin(&self, now: Timestamp) -> bool {
        self.handed_out_at.is_none()
            && match &self.state {
                TaskState::Solved { .. } => self.solution_expires_at().is_none_or(|e| now < e),
                TaskState::Failed { via, .. } => *via != Via::Submit,
                _ => false,
            }
    }

    /// When in.php accepted the task, or else when the submit queue released it to in.php, or
    /// else when it was created: when its time at CaptchaAI can have started at the earliest.
    pub fn submitted_or_created_at(&self) -> Timestamp {
        match self.state {
            TaskState::Pending { submitted_at } => submitted_at,
            _ => self.released_at.unwrap_or(self.created_at),
        }
    }

    /// When the solution stops being usable, if it is a solution that can expire.
    pub fn solution_expires_at(&self) -> Option<Timestamp> {
        match &self.state {
            TaskState::Solved { token_clock_start, .. } => {
                self.kind.token_lifetime().map(|life| token_clock_start.plus(life))
            }
            _ => None,
        }
    }

    /// When the token a push of this result carries dies: the solution's lifetime end, or a
    /// late solution's. `None` for a result without one (an image's text, an error, an expiry).
    pub fn token_dies_at(&self) -> Option<Timestamp> {
        match &self.state {
            TaskState::Solved { .. } => self.solution_expires_at(),
            TaskState::Expired { late: Some(l), .. } => match l.outcome {
                Outcome::Solved(_) => self.kind.token_lifetime().map(|life| l.token_clock_start.plus(life)),
                Outcome::Failed(_) => None,
            },
            _ => None,
        }
    }
}

//! Dead letters: a result that arrived but could not be stored, kept whole on a queue until
//! the redrive function applies it through the same idempotent write.
//!
//! The message body is JSON, schema version 1:
//!
//! ```json
//! {"schema_version":1,"task_ref":"tsk_…","captcha_id":"7100…","code":"<answer or ERROR_…>",
//!  "received_at_ms":1796210146000,"received_at":"2026-12-02T11:15:46.000Z",
//!  "token_clock_start_ms":1796210146000,"via":"callback","error":"task store unavailable: …",
//!  "attempts":1}
//! ```
//!
//! `code` carries the solution itself (the queue is encrypted at rest); never log a body.
//!
//! A second kind (`"kind":"submitted"`, same schema version: the field is absent, and means
//! `result`, in earlier letters) keeps in.php's id for a task when storing it failed, so the id
//! is never lost: `captcha_id`, `received_at_ms` (when in.php accepted it) and `poll_due_at_ms`;
//! `code` is empty. The redrive function stores it (submitting → pending), and the poller can
//! then read the task.

use std::fmt;

use serde::{Deserialize, Serialize};

use crate::codes::{ErrorCode, is_error_code};
use crate::domain::{CaptchaId, IncomingResult, Outcome, ParseError, Solution, TaskRef, Via};
use crate::time::Timestamp;

/// The SQS adapter, at its old path.
pub use crate::sqs::{QueueError, Received, SqsQueue};

pub const SCHEMA_VERSION: u32 = 1;

/// One undelivered result, everything needed to apply it later.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeadLetter {
    pub schema_version: u32,
    pub task_ref: String,
    pub captcha_id: String,
    /// The pingback's `code` or res.php's answer: a solution or an error code.
    pub code: String,
    pub received_at_ms: u64,
    pub received_at: String,
    pub token_clock_start_ms: u64,
    /// The path that brought it (`callback` or `poll`).
    pub via: String,
    /// Why it could not be stored.
    pub error: String,
    /// Store attempts so far (the SDK's own retries count as one).
    pub attempts: u32,
    /// `result` (a result to apply) or `submitted` (in.php's id for a task, to store).
    #[serde(default = "result_kind")]
    pub kind: String,
    /// For `submitted`: when the poller should first read the task.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub poll_due_at_ms: Option<u64>,
    /// The user agent a solution was earned with, where CaptchaAI named one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_agent: Option<String>,
}

fn result_kind() -> String {
    "result".into()
}

/// What a dead letter asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Letter {
    /// Apply this result to the task.
    Result { task_ref: TaskRef, delivery: IncomingResult },
    /// In.php accepted the task under `captcha_id` at `accepted_at`: store it.
    Submitted { task_ref: TaskRef, captcha_id: CaptchaId, accepted_at: Timestamp, poll_due_at: Timestamp },
}

impl fmt::Debug for DeadLetter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeadLetter")
            .field("task_ref", &self.task_ref)
            .field("captcha_id", &self.captcha_id)
            .field(
                "code",
                &if is_error_code(&self.code) { self.code.clone() } else { crate::telemetry::redact(&self.code) },
            )
            .field("received_at", &self.received_at)
            .field("via", &self.via)
            .field("error", &self.error)
            .field("attempts", &self.attempts)
            .finish()
    }
}

impl DeadLetter {
    pub fn new(task_ref: &TaskRef, d: &IncomingResult, error: &str, attempts: u32) -> Self {
        let code = match &d.outcome {
            Outcome::Solved(s) => s.expose().to_owned(),
            Outcome::Failed(c) => c.as_ref().to_owned(),
        };
        Self {
            schema_version: SCHEMA_VERSION,
            task_ref: task_ref.to_string(),
            captcha_id: d.captcha_id.to_string(),
            code,
            received_at_ms: d.received_at.as_millis(),
            received_at: d.received_at.to_rfc3339(),
            token_clock_start_ms: d.token_clock_start.as_millis(),
            via: d.via.as_str().to_owned(),
            error: error.to_owned(),
            attempts,
            kind: result_kind(),
            poll_due_at_ms: None,
            user_agent: match &d.outcome {
                Outcome::Solved(s) => s.user_agent().map(str::to_owned),
                Outcome::Failed(_) => None,
            },
        }
    }

    /// In.php accepted `task_ref` under `id` at `at`, and storing that failed.
    pub fn submitted(task_ref: &TaskRef, id: &CaptchaId, at: Timestamp, poll_due_at: Timestamp, error: &str) -> Self {
        Self {
            schema_version: SCHEMA_VERSION,
            task_ref: task_ref.to_string(),
            captcha_id: id.to_string(),
            code: String::new(),
            received_at_ms: at.as_millis(),
            received_at: at.to_rfc3339(),
            token_clock_start_ms: at.as_millis(),
            via: Via::Submit.as_str().to_owned(),
            error: error.to_owned(),
            attempts: 1,
            kind: "submitted".into(),
            poll_due_at_ms: Some(poll_due_at.as_millis()),
            user_agent: None,
        }
    }

    /// What the letter asks for; a result is re-applied by `via` (the redrive).
    pub fn letter(&self, via: Via) -> Result<Letter, ParseError> {
        match self.kind.as_str() {
            "result" => self.delivery_via(via).map(|(task_ref, delivery)| Letter::Result { task_ref, delivery }),
            "submitted" => Ok(Letter::Submitted {
                task_ref: TaskRef::parse(&self.task_ref)?,
                captcha_id: CaptchaId::parse(&self.captcha_id)?,
                accepted_at: Timestamp::from_millis(self.received_at_ms),
                poll_due_at: Timestamp::from_millis(
                    self.poll_due_at_ms
                        .ok_or_else(|| ParseError("a `submitted` letter needs `poll_due_at_ms`".into()))?,
                ),
            }),
            other => Err(ParseError(format!("unknown dead-letter kind `{other}`"))),
        }
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// Parses a message body. Anything that does not parse is a permanent failure.
    pub fn parse(body: &str) -> Result<Self, ParseError> {
        let dl: Self = serde_json::from_str(body).map_err(|e| ParseError(format!("not a dead letter: {e}")))?;
        if dl.schema_version != SCHEMA_VERSION {
            return Err(ParseError(format!("unsupported dead-letter schema version {}", dl.schema_version)));
        }
        dl.letter(Via::Redrive)?;
        Ok(dl)
    }

    /// The task and the delivery to apply, re-applied by `via` (the redrive).
    pub fn delivery_via(&self, via: Via) -> Result<(TaskRef, IncomingResult), ParseError> {
        let (task_ref, mut d) = self.delivery()?;
        d.via = via;
        Ok((task_ref, d))
    }

    fn delivery(&self) -> Result<(TaskRef, IncomingResult), ParseError> {
        let task_ref = TaskRef::parse(&self.task_ref)?;
        let outcome = if is_error_code(&self.code) {
            Outcome::Failed(ErrorCode::parse(&self.code)?)
        } else {
            Outcome::Solved(Solution::parse(&self.code)?.with_user_agent(self.user_agent.as_deref()))
        };
        Ok((
            task_ref,
            IncomingResult {
                captcha_id: CaptchaId::parse(&self.captcha_id)?,
                outcome,
                received_at: Timestamp::from_millis(self.received_at_ms),
                via: Via::parse(&self.via)?,
                token_clock_start: Timestamp::from_millis(self.token_clock_start_ms),
            },
        ))
    }
}

/// Where dead letters go. SQS on AWS; a file-backed queue in local mode.
#[async_trait::async_trait]
pub trait DeadLetterSink: Send + Sync + fmt::Debug {
    async fn send(&self, letter: &DeadLetter) -> Result<(), QueueError>;
}

/// The shortest token life of a kind the relay handles (reCAPTCHA's 120 s). A dead letter does
/// not name its task's kind, so its retries are paced as if its token lived this long.
pub const SHORTEST_TOKEN_LIFE: std::time::Duration = std::time::Duration::from_secs(120);

/// The longest wait between the fast retries of [`retry_delay`].
pub const FAST_RETRY_CAP: std::time::Duration = std::time::Duration::from_secs(30);

/// When a dead letter that could not be applied yet is tried again, counted from `now`.
/// `receives` is how often it was received, this time included; `slow` is the queue's own pace
/// (its visibility timeout).
///
/// While the token it carries could still be alive, the retries are fast — 2, 4, 8, 16, 30,
/// 30 … s — because a store that failed for a throttled second or a deploy is usually back by
/// then, and a result stored after its token died reaches its owner dead. The queue's generic
/// visibility (185 s deployed) is longer than a reCAPTCHA token's whole life. At most half of
/// the receives allowed (`max_receives`, after which the queue poisons the letter) go this way,
/// so a long outage still has the slow ones: the letter is never poisoned sooner for it.
pub fn retry_delay(
    token_clock_start: Option<Timestamp>,
    receives: u32,
    max_receives: u32,
    now: Timestamp,
    slow: std::time::Duration,
) -> std::time::Duration {
    let fast = std::time::Duration::from_secs(1u64 << receives.clamp(1, 5)).min(FAST_RETRY_CAP);
    match token_clock_start.map(|t| t.plus(SHORTEST_TOKEN_LIFE)) {
        Some(dies) if now < dies && receives <= max_receives / 2 => fast.min(slow),
        _ => slow,
    }
}

impl DeadLetter {
    /// [`retry_delay`] for a letter's body; a body that does not parse gets `slow`.
    pub fn retry_delay_of(
        body: &str,
        receives: u32,
        max_receives: u32,
        now: Timestamp,
        slow: std::time::Duration,
    ) -> std::time::Duration {
        let start = Self::parse(body).ok().map(|l| Timestamp::from_millis(l.token_clock_start_ms));
        retry_delay(start, receives, max_receives, now, slow)
    }
}

#[async_trait::async_trait]
impl DeadLetterSink for SqsQueue {
    async fn send(&self, letter: &DeadLetter) -> Result<(), QueueError> {
        self.send_body(&letter.to_json()).await.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_letter_whose_token_may_live_is_retried_fast_then_at_the_queues_pace() {
        let start = Timestamp::from_millis(1_796_210_146_000);
        let slow = std::time::Duration::from_secs(185);
        let at = |s: u64| start.plus(std::time::Duration::from_secs(s));
        let secs = |receives, now| retry_delay(Some(start), receives, 12, now, slow).as_secs();
        // 2, 4, 8, 16, 30, 30: six tries within the token's first ~90 s.
        let fast: Vec<u64> = (1..=6).map(|r| secs(r, at(10))).collect();
        assert_eq!(fast, vec![2, 4, 8, 16, 30, 30]);
        // The seventh receive of twelve: the rest are kept for a long outage.
        assert_eq!(secs(7, at(10)), 185);
        // Once the shortest-lived token would be dead, the queue's own pace.
        assert_eq!(secs(1, at(120)), 185);
        // With few receives allowed, at most half go fast.
        assert_eq!(retry_delay(Some(start), 3, 5, at(5), slow).as_secs(), 185);
        assert_eq!(retry_delay(Some(start), 2, 5, at(5), slow).as_secs(), 4);
        // A letter that does not parse: the queue's pace.
        assert_eq!(DeadLetter::retry_delay_of("not json", 1, 12, at(1), slow), slow);
        // Never longer than the queue's pace (a short visibility, as local mode's).
        assert_eq!(retry_delay(Some(start), 5, 12, at(1), std::time::Duration::from_secs(20)).as_secs(), 20);
    }

    fn delivery(code: &str) -> IncomingResult {
        let outcome = if is_error_code(code) {
            Outcome::Failed(ErrorCode::parse(code).expect("code"))
        } else {
            Outcome::Solved(Solution::parse(code).expect("token"))
        };
        IncomingResult {
            captcha_id: CaptchaId::parse("71000001").expect("id"),
            outcome,
            received_at: Timestamp::from_millis(1_796_210_146_000),
            via: Via::Callback,
            token_clock_start: Timestamp::from_millis(1_796_210_146_000),
        }
    }

    #[test]
    fn a_dead_letter_round_trips_to_the_same_delivery() {
        let r = TaskRef::generate();
        for code in ["tok-secret", "ERROR_CAPTCHA_UNSOLVABLE"] {
            let d = delivery(code);
            let dl = DeadLetter::new(&r, &d, "task store unavailable", 1);
            let back = DeadLetter::parse(&dl.to_json()).expect("parses");
            assert_eq!(back, dl);
            assert_eq!(
                back.delivery_via(Via::Redrive).expect("valid"),
                (r.clone(), IncomingResult { via: Via::Redrive, ..d })
            );
        }
    }

    #[test]
    fn the_body_has_every_field_and_debug_hides_the_token() {
        let dl = DeadLetter::new(&TaskRef::generate(), &delivery("tok-secret"), "boom", 2);
        let v: serde_json::Value = serde_json::from_str(&dl.to_json()).expect("json");
        for field in ["schema_version", "task_ref", "captcha_id", "code", "received_at", "error", "attempts", "via"] {
            assert!(v.get(field).is_some(), "missing {field}");
        }
        assert!(!format!("{dl:?}").contains("tok-secret"));
    }

    #[test]
    fn a_submitted_letter_keeps_the_id_and_older_letters_are_results() {
        let r = TaskRef::generate();
        let id = CaptchaId::parse("71000009").expect("id");
        let (at, due) = (Timestamp::from_millis(1_000), Timestamp::from_millis(26_000));
        let dl = DeadLetter::submitted(&r, &id, at, due, "store down");
        let back = DeadLetter::parse(&dl.to_json()).expect("parses");
        assert_eq!(
            back.letter(Via::Redrive).expect("valid"),
            Letter::Submitted { task_ref: r.clone(), captcha_id: id, accepted_at: at, poll_due_at: due }
        );
        // A letter written before `kind` existed is a result.
        let mut old: serde_json::Value =
            serde_json::from_str(&DeadLetter::new(&r, &delivery("tok"), "e", 1).to_json()).expect("json");
        old.as_object_mut().map(|o| o.remove("kind"));
        let parsed = DeadLetter::parse(&old.to_string()).expect("old letters still parse");
        assert!(matches!(parsed.letter(Via::Redrive), Ok(Letter::Result { .. })));
        old["kind"] = "mystery".into();
        assert!(DeadLetter::parse(&old.to_string()).is_err());
    }

    #[test]
    fn garbage_and_unknown_versions_do_not_parse() {
        assert!(DeadLetter::parse("hello").is_err());
        let mut v: serde_json::Value =
            serde_json::from_str(&DeadLetter::new(&TaskRef::generate(), &delivery("t"), "e", 1).to_json())
                .expect("json");
        v["schema_version"] = 9.into();
        assert!(DeadLetter::parse(&v.to_string()).is_err());
        v["schema_version"] = 1.into();
        v["task_ref"] = "nope".into();
        assert!(DeadLetter::parse(&v.to_string()).is_err());
    }
}

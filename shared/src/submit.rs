//! The submit path's shared parts: what an in.php answer means, what to record when it is
//! known, the submit queue's settings and how a releaser is woken.
//!
//! A submit is sent at once (inline, by the API) while the queue is empty and CaptchaAI has a
//! free thread for it (a *permit*, published by the releaser); otherwise — a burst above the
//! plan, a "no slot" answer, a ban, a full second of the in.php pace — it is queued, answered
//! 202, and released by the submitter as threads free (see `relay-submitter`). A task goes
//! back to the queue only after an explicit refusal; any answer that does not prove one leaves
//! it "outcome unknown": its pingback resolves it, or — on CaptchaAI, which bills threads and not
//! solutions — the poller sends it once more when its result is overdue (at most one extra
//! in.php per task; never on an upstream that bills per solution).

pub mod lanes;
pub mod window;

use std::sync::Arc;
use std::time::Duration;

use crate::captchaai::CaptchaAiError;
use crate::codes::{Ban, CodeClass, ban};
use crate::config::{ConfigError, Settings};
use crate::deadletter::{DeadLetter, DeadLetterSink};
use crate::domain::{CaptchaId, Task, TaskState};
use crate::retry::backoff_delay;
use crate::store::{SubmitRecorded, Tasks};
use crate::time::{Clock, Timestamp};

/// What an in.php answer means for the task it was about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InPhp {
    /// CaptchaAI has it under this id (and will be paid).
    Accepted(CaptchaId),
    /// The answer does not say whether CaptchaAI took it: never called failed (its pingback
    /// will say), not sent again here (the poller may, once, when its result is overdue).
    Unknown(CaptchaAiError),
    /// No free thread (`ERROR_NO_SLOT_AVAILABLE`, or `ERROR_ZERO_BALANCE` as CaptchaAI uses it):
    /// nothing was taken; back to the queue.
    NoSlot(String),
    /// A ban or a rejected key: nothing was taken; traffic stops for `ban.duration`.
    Banned(String, Ban),
    /// Refused for now for another reason (a server error code, a connection that never
    /// opened): nothing was taken; back to the queue, tried again later.
    Transient(CaptchaAiError),
    /// Refused for good (a bad parameter, an image CaptchaAI will not take): the task fails.
    Refused(CaptchaAiError),
}

/// "Refused for now" answers (server error codes, connections that never opened) a task gets
/// before it is failed with the last one: a method CaptchaAI answers `ERROR_SERVER_ERROR` every
/// time (one it does not solve) is not retried for ever.
pub const MAX_REFUSALS_FOR_NOW: u32 = 5;

/// The codes CaptchaAI answers when every thread of the plan is busy.
pub fn is_no_slot(code: &str) -> bool {
    matches!(code.trim(), "ERROR_NO_SLOT_AVAILABLE" | "ERROR_ZERO_BALANCE")
}

impl InPhp {
    pub fn of(answer: Result<CaptchaId, CaptchaAiError>) -> Self {
        let err = match answer {
            Ok(id) => return Self::Accepted(id),
            Err(e) => e,
        };
        if err.outcome_unknown() {
            return Self::Unknown(err);
        }
        if let CaptchaAiError::Code(code) = &err {
            if let Some(b) = ban(code.as_ref()) {
                return Self::Banned(code.as_ref().to_owned(), b);
            }
            if is_no_slot(code.as_ref()) {
                return Self::NoSlot(code.as_ref().to_owned());
            }
        }
        match err.class() {
            CodeClass::Permanent | CodeClass::TerminalForTask => Self::Refused(err),
            _ => Self::Transient(err),
        }
    }
}

/// The submit queue's settings (the API's admission and the submitter's release). Defaults are
/// what the template deploys.
#[derive(Debug, Clone, PartialEq)]
pub struct QueueSettings {
    /// Most tasks one owner may have queued (`QUEUE_MAX_PER_OWNER`).
    pub max_per_owner: u64,
    /// Most tasks queued in all (`QUEUE_MAX_TOTAL`).
    pub max_total: u64,
    /// A task still queued after this long fails with [`QUEUE_TIMEOUT`], never sent
    /// (`QUEUE_MAX_WAIT_SECS`).
    pub max_wait: Duration,
    /// In.php submits per second, account-wide (`SUBMITS_PER_SECOND`; CaptchaAI bans more than
    /// 60 in 3 s).
    pub submits_per_second: u32,
    /// The thread window (`CAPTCHAAI_THREADS`, `SUBMIT_NO_SLOT_PER_MINUTE`).
    pub window: window::WindowSettings,
    /// What the upstream is (`CAPTCHAAI_FLAVOR`): which kinds it solves.
    pub upstream: Upstream,
}

/// The service behind `CAPTCHAAI_BASE_URL` (`CAPTCHAAI_FLAVOR`): CaptchaAI (the default), or
/// another 2captcha-compatible service. It decides which kinds are accepted (CaptchaAI does not
/// solve hCaptcha: it answers `ERROR_SERVER_ERROR`) and whether a task whose in.php outcome is
/// unknown is sent again (CaptchaAI bills threads by the month, so a second in.php costs thread
/// time, not money; a service that bills per solution could charge twice: the relay then waits).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Upstream {
    #[default]
    CaptchaAi,
    TwoCaptcha,
}

impl Upstream {
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        match env.optional("CAPTCHAAI_FLAVOR").map(|v| v.trim().to_ascii_lowercase()).as_deref() {
            None | Some("" | "captchaai") => Ok(Self::CaptchaAi),
            Some("2captcha") => Ok(Self::TwoCaptcha),
            Some(_) => Err(ConfigError::Invalid {
                name: "CAPTCHAAI_FLAVOR".into(),
                reason: "must be `captchaai` or `2captcha` (another 2captcha-compatible service)".into(),
            }),
        }
    }

    /// Whether a task of `kind` may be submitted to it.
    pub fn solves(self, kind: crate::domain::CaptchaKind) -> bool {
        self == Self::TwoCaptcha || kind.captchaai_solves()
    }

    /// Why `kind` is refused at submit, for the caller.
    pub fn refusal(self, kind: crate::domain::CaptchaKind) -> String {
        format!(
            "CaptchaAI does not solve {kind} (it answers ERROR_SERVER_ERROR); it solves images, BLS, reCAPTCHA \
             v2/v3/Enterprise, Turnstile, Cloudflare challenges and GeeTest v3. A relay in front of another \
             2captcha-compatible service that solves it sets CAPTCHAAI_FLAVOR=2captcha"
        )
    }

    /// Whether a task whose in.php outcome is unknown is sent again once its kind's results are
    /// overdue (`RESEND_UNKNOWN_SUBMITS`, default: yes on CaptchaAI, no elsewhere).
    pub fn resend_default(self) -> bool {
        self == Self::CaptchaAi
    }
}

/// The code a task fails with when it waited in the queue longer than `QUEUE_MAX_WAIT_SECS`.
pub const QUEUE_TIMEOUT: &str = "ERROR_QUEUE_TIMEOUT";

/// The default of [`QueueSettings::submits_per_second`]: 4 × 14 = 56 in any 3 s, under the 60
/// that earn `MAX_USER_TURN`.
pub const SUBMITS_PER_SECOND: u32 = 14;
/// The most [`QueueSettings::submits_per_second`] may be: the pacer's per-second item takes
/// that many writes a second (a quarter of DynamoDB's 1,000 per partition key) and the in-work
/// index keys 2 × that over `POLL_SHARDS` (docs/capacity.md). Far above what 2captcha's rules
/// allow one key (60 in 3 s); for the largest CaptchaAI plans.
pub const MAX_SUBMITS_PER_SECOND: u32 = 250;

impl Default for QueueSettings {
    fn default() -> Self {
        Self {
            max_per_owner: 10_000,
            max_total: 10_000,
            max_wait: Duration::from_secs(600),
            submits_per_second: SUBMITS_PER_SECOND,
            window: window::WindowSettings::default(),
            upstream: Upstream::CaptchaAi,
        }
    }
}

impl QueueSettings {
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let invalid = |name: &str, reason: &str| ConfigError::Invalid { name: name.into(), reason: reason.into() };
        let threads: u32 = env.parse_or("CAPTCHAAI_THREADS", 0)?;
        let s = Self {
            max_per_owner: env.parse_or("QUEUE_MAX_PER_OWNER", d.max_per_owner)?,
            max_total: env.parse_or("QUEUE_MAX_TOTAL", d.max_total)?,
            max_wait: Duration::from_secs(env.parse_or("QUEUE_MAX_WAIT_SECS", d.max_wait.as_secs())?),
            submits_per_second: env.parse_or("SUBMITS_PER_SECOND", d.submits_per_second)?,
            window: window::WindowSettings {
                threads: (threads > 0).then_some(threads),
                no_slot_per_minute: env.parse_or("SUBMIT_NO_SLOT_PER_MINUTE", d.window.no_slot_per_minute)?,
                ..d.window
            },
            upstream: Upstream::from_settings(env)?,
        };
        if s.max_per_owner == 0 || s.max_total == 0 {
            return Err(invalid("QUEUE_MAX_TOTAL", "queue bounds must be at least 1"));
        }
        if !(10..=86_400).contains(&s.max_wait.as_secs()) {
            return Err(invalid("QUEUE_MAX_WAIT_SECS", "must be 10 to 86400 seconds"));
        }
        if !(1..=MAX_SUBMITS_PER_SECOND).contains(&s.submits_per_second) {
            // On 2captcha's rules 4 × 15 = 60 in any 3 s is the most before MAX_USER_TURN; a
            // CaptchaAI plan may allow more, and the relay backs off if it does not.
            return Err(invalid(
                "SUBMITS_PER_SECOND",
                "must be 1 to 250 (above 15 only if your CaptchaAI plan allows more than 60 submits in 3 s)",
            ));
        }
        if !(1..=60).contains(&s.window.no_slot_per_minute) {
            return Err(invalid(
                "SUBMIT_NO_SLOT_PER_MINUTE",
                "must be 1 to 60 (120 in a minute ban the account; 30 and 3 × the captchas sent, too)",
            ));
        }
        Ok(s)
    }
}

/// Tells the submitter that tasks wait in the queue. On AWS a write to the table's wake item,
/// which its stream turns into an invocation; in one process, a notification.
#[async_trait::async_trait]
pub trait Waker: Send + Sync + std::fmt::Debug {
    async fn wake(&self, now: Timestamp);
}

/// Wakes the submitter function through the table's stream.
#[derive(Debug, Clone)]
pub struct StoreWaker(pub crate::store::SubmitQueue);

#[async_trait::async_trait]
impl Waker for StoreWaker {
    async fn wake(&self, now: Timestamp) {
        if let Err(e) = self.0.wake_submitter(now).await {
            // The schedule starts one within a minute all the same.
            tracing::warn!(event = "wake_failed", error = %e, "could not wake the submitter");
        }
    }
}

/// Wakes a submitter in the same process.
#[derive(Debug, Clone, Default)]
pub struct NotifyWaker(pub Arc<tokio::sync::Notify>);

#[async_trait::async_trait]
impl Waker for NotifyWaker {
    async fn wake(&self, _now: Timestamp) {
        self.0.notify_one();
    }
}

/// What one API instance last saw of the submit queue. While other tasks wait in it, a permit
/// is refused anyway (inline submits only go while the queue is empty), so for [`Self::FOR`]
/// after a permit was refused for them the instance queues new tasks without first asking: one
/// write on the account's state item per queued task instead of two (and at most one refused
/// permit a second per instance). Only a refusal starts it, never the task's own reservation, so
/// a drained queue is noticed within a second and inline submits resume — the state item is the stack's hottest
/// partition key (docs/capacity.md). The hint only ever sends a task to the queue, which the
/// submitter releases as threads free: it cannot send one past the plan or the pace.
///
/// The refused permit's state is kept as long: with the queue's counts on several items
/// (`QUEUE_SHARDS`), a reservation on another item does not return the state item, so the
/// breaker (a rejected key) and the submitter's lease (whether to wake it) are read from here.
#[derive(Debug, Default, Clone)]
pub struct AdmissionHint {
    /// Shared by the clones of one instance's dependencies.
    seen: Arc<std::sync::Mutex<Option<(Timestamp, crate::store::SubmitState)>>>,
}

impl AdmissionHint {
    /// How long a sight of waiting tasks is trusted: the queue is released at the in.php pace,
    /// so a queue drains in well under a second only when it was nearly empty.
    pub const FOR: Duration = Duration::from_secs(1);

    /// Whether other tasks were seen waiting within [`Self::FOR`] of `now`.
    pub fn queue_waiting(&self, now: Timestamp) -> bool {
        self.known(now).is_some_and(|st| st.queued > 0)
    }

    /// The state a refused permit returned within [`Self::FOR`] of `now`.
    pub fn known(&self, now: Timestamp) -> Option<crate::store::SubmitState> {
        let seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        seen.as_ref().filter(|(at, _)| now >= *at && now.since(*at) < Self::FOR).map(|(_, st)| st.clone())
    }

    /// Takes in the state a refused permit returned.
    pub fn saw(&self, state: &crate::store::SubmitState, now: Timestamp) {
        let mut seen = self.seen.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *seen = Some((now, state.clone()));
    }
}

/// What recording an in.php answer needs.
#[derive(Clone, Copy)]
pub struct Recorder<'a> {
    /// The task whose in.php answer this records (UpdateItem).
    pub tasks: &'a Tasks,
    pub dead_letters: &'a dyn DeadLetterSink,
    pub clock: &'a dyn Clock,
}

impl Recorder<'_> {
    /// In.php accepted the task under `id`: store the id (retrying), or keep it on the
    /// dead-letter queue. Either way CaptchaAI has the task and its pingback finds it.
    pub async fn accepted(&self, task: &Task, id: &CaptchaId, grace: Duration) -> Task {
        let at = self.clock.now();
        let due = at.plus(grace);
        metrics::counter!("submits", "outcome" => "accepted").increment(1);
        let mut last_err = None;
        for attempt in 1..=3u32 {
            match self.tasks.mark_submitted(&task.task_ref, id, at, due).await {
                Ok(SubmitRecorded::Pending(t) | SubmitRecorded::AlreadyResolved(t)) => {
                    tracing::info!(event = "task_submitted", task_ref = %task.task_ref, captcha_id = %id, "in.php accepted the task");
                    return t;
                }
                Err(e) => {
                    tracing::warn!(event = "store_failed", error = %e, attempt, "storing in.php's id failed");
                    last_err = Some(e);
                    if attempt < 3 {
                        tokio::time::sleep(backoff_delay(attempt, Duration::from_millis(100), Duration::from_secs(1)))
                            .await;
                    }
                }
            }
        }
        let err = last_err.map(|e| e.to_string()).unwrap_or_default();
        let letter = DeadLetter::submitted(&task.task_ref, id, at, due, &err);
        match self.dead_letters.send(&letter).await {
            Ok(()) => {
                tracing::warn!(event = "submitted_dead_lettered", captcha_id = %id, "in.php's id kept as a dead letter");
                metrics::counter!("dead_lettered", "kind" => "submitted").increment(1);
            }
            Err(q) => {
                // The last resort: the id is in this log line, the task's pingback still finds it
                // by reference, and it expires at its deadline if none comes.
                tracing::error!(event = "submitted_not_stored", captcha_id = %id, store_error = %err, queue_error = %q, "in.php's id could not be stored or queued");
            }
        }
        task.clone()
    }

    /// In.php's answer does not say whether it took the task: keep it `submitting`, marked so.
    pub async fn unknown(&self, task: &Task, err: &CaptchaAiError) -> Task {
        let detail = format!(
            "in.php's answer was lost ({err}): CaptchaAI may have the task. Its pingback will record it; if none comes \
             by the time its kind's results normally have, the relay sends it once more on CaptchaAI (which bills threads, \
             not solutions), else it expires at its deadline. A client retry with the same Idempotency-Key is safe"
        );
        tracing::warn!(event = "submit_unknown", task_ref = %task.task_ref, error = %err, "in.php outcome unknown; not retried, not failed");
        metrics::counter!("submits", "outcome" => "unknown").increment(1);
        if let Err(e) = self.tasks.mark_submit_unknown(&task.task_ref, &detail).await {
            tracing::error!(event = "store_failed", error = %e, "could not mark the submit unknown");
        }
        Task { state: TaskState::Submitting { unknown: Some(detail) }, ..task.clone() }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codes::ErrorCode;

    fn code(c: &str) -> Result<CaptchaId, CaptchaAiError> {
        Err(CaptchaAiError::Code(ErrorCode::parse(c).expect("code")))
    }

    #[test]
    fn the_admission_hint_skips_permits_only_while_others_wait_and_only_for_a_second() {
        let hint = AdmissionHint::default();
        let t = Timestamp::from_millis;
        let q = |queued| crate::store::SubmitState { queued, ..Default::default() };
        assert!(!hint.queue_waiting(t(0)), "nothing seen: ask for a permit");
        hint.saw(&q(0), t(1_000));
        assert!(!hint.queue_waiting(t(1_001)), "refused with nothing queued (no permit left): ask again");
        assert_eq!(hint.known(t(1_001)), Some(q(0)), "the state is known all the same");
        hint.saw(&q(3), t(2_000));
        assert!(hint.queue_waiting(t(2_000)) && hint.queue_waiting(t(2_999)), "others wait: queue at once");
        assert!(!hint.queue_waiting(t(3_000)), "a second later it asks again");
        assert_eq!(hint.known(t(3_000)), None, "and knows nothing any more");
        hint.saw(&q(5), t(4_000));
        hint.saw(&q(0), t(4_100));
        assert!(!hint.queue_waiting(t(4_200)), "an empty queue seen ends the hint at once");
        hint.saw(&q(5), t(9_000));
        assert!(!hint.queue_waiting(t(8_000)), "a clock behind the sighting trusts nothing");
    }

    #[test]
    fn in_php_answers_are_told_apart_and_only_explicit_refusals_go_back_to_the_queue() {
        assert!(matches!(InPhp::of(code("ERROR_NO_SLOT_AVAILABLE")), InPhp::NoSlot(_)));
        assert!(matches!(InPhp::of(code("ERROR_ZERO_BALANCE")), InPhp::NoSlot(_)), "CaptchaAI: no free thread");
        assert!(matches!(InPhp::of(code("MAX_USER_TURN")), InPhp::Banned(_, b) if !b.needs_operator));
        assert!(matches!(InPhp::of(code("ERROR: 1001")), InPhp::Banned(_, _)));
        assert!(matches!(InPhp::of(code("ERROR_WRONG_USER_KEY")), InPhp::Banned(_, b) if b.needs_operator));
        assert!(matches!(InPhp::of(code("ERROR_SERVER_ERROR")), InPhp::Transient(_)));
        assert!(matches!(InPhp::of(Err(CaptchaAiError::Connect("refused".into()))), InPhp::Transient(_)));
        assert!(matches!(InPhp::of(code("ERROR_PAGEURL")), InPhp::Refused(_)));
        for lost in [
            CaptchaAiError::Timeout,
            CaptchaAiError::Http(502),
            CaptchaAiError::NotAnAnswer("an HTML page".into()),
            CaptchaAiError::Transport("reset".into()),
        ] {
            assert!(matches!(InPhp::of(Err(lost.clone())), InPhp::Unknown(_)), "{lost:?}: never sent again");
        }
        let id = CaptchaId::parse("123").expect("id");
        assert_eq!(InPhp::of(Ok(id.clone())), InPhp::Accepted(id));
    }

    #[test]
    fn queue_settings_default_to_the_template_and_refuse_what_would_earn_bans() {
        let d = QueueSettings::from_settings(&Settings::default()).expect("defaults");
        assert_eq!(d, QueueSettings::default());
        let s = QueueSettings::from_settings(&Settings::from_pairs([("CAPTCHAAI_THREADS", "20")])).expect("valid");
        assert_eq!(s.window.threads, Some(20));
        let big =
            QueueSettings::from_settings(&Settings::from_pairs([("SUBMITS_PER_SECOND", "250")])).expect("a big plan");
        assert_eq!(big.submits_per_second, MAX_SUBMITS_PER_SECOND);
        for (name, v) in [
            ("SUBMITS_PER_SECOND", "251"),
            ("SUBMITS_PER_SECOND", "0"),
            ("SUBMIT_NO_SLOT_PER_MINUTE", "120"),
            ("QUEUE_MAX_WAIT_SECS", "1"),
            ("QUEUE_MAX_TOTAL", "0"),
        ] {
            let err = QueueSettings::from_settings(&Settings::from_pairs([(name, v)])).expect_err(name);
            assert!(err.to_string().contains(name), "{err}");
        }
    }
}

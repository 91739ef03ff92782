//! The task: parsed identifiers, the captcha kinds, and the task's life as a state machine.
//!
//! Every transition is a pure function of the current task and an input. The DynamoDB store
//! encodes the same rules as conditional writes; when such a write is refused, the store runs
//! the old item through these functions to say *why* (duplicate, conflict, wrong id).

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Deserializer, Serialize};

use crate::codes::ErrorCode;
use crate::time::Timestamp;

/// Why a value from outside could not be parsed. The message is safe to show a caller.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// Our reference for a task: `tsk_` and 32 lowercase hex digits. Generated before in.php is
/// called, so a callback that outruns the submit still finds its record.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskRef(String);

impl TaskRef {
    const PREFIX: &'static str = "tsk_";

    pub fn generate() -> Self {
        Self(format!("{}{}", Self::PREFIX, uuid::Uuid::new_v4().simple()))
    }

    /// From 32 lowercase hex digits (a digest's, say).
    pub(crate) fn from_hex(hex32: &str) -> Self {
        Self(format!("{}{hex32}", Self::PREFIX))
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let hex =
            s.strip_prefix(Self::PREFIX).ok_or_else(|| ParseError("task reference must start with `tsk_`".into()))?;
        if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(ParseError("task reference must be `tsk_` followed by 32 lowercase hex digits".into()));
        }
        Ok(Self(s.to_owned()))
    }

    /// A new reference for a task submitted through the 2captcha-compatible `in.php`, with its
    /// compat id: see [`TaskRef::from_compat_number`].
    pub fn generate_compat() -> (Self, u64) {
        Self::compat_from(uuid::Uuid::new_v4().as_u128() as u64)
    }

    /// The compat reference for a digest (an idempotency key's): its first 8 bytes, folded into
    /// the compat id range.
    pub fn compat_from_digest(digest: &[u8]) -> (Self, u64) {
        let mut b = [0u8; 8];
        b.iter_mut().zip(digest).for_each(|(to, from)| *to = *from);
        Self::compat_from(u64::from_le_bytes(b))
    }

    /// `r` folded into the compat id range, and the id's reference.
    fn compat_from(r: u64) -> (Self, u64) {
        let id = Self::COMPAT_MIN + r % (i64::MAX as u64 - Self::COMPAT_MIN);
        (Self::from_compat_number(id), id)
    }

    /// Smallest compat id: every compat id has 18 or 19 digits and fits a signed 64-bit integer
    /// (the id column of much existing 2captcha client code), and is a string of digits, which
    /// every official SDK takes as it comes.
    const COMPAT_MIN: u64 = 100_000_000_000_000_000;

    /// The reference of compat id `id`: `tsk_` + 16 zeros + the id in 16 hex digits (one to one,
    /// and never a generated reference, whose version nibble is not zero).
    pub fn from_compat_number(id: u64) -> Self {
        Self(format!("{}{:032x}", Self::PREFIX, u128::from(id)))
    }

    /// Parses a compat id as a client sends it (`id=` of `res.php`).
    pub fn from_compat_id(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        let bad = || ParseError("a task id is 18 or 19 digits".into());
        if !(18..=19).contains(&s.len()) || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let id: u64 = s.parse().map_err(|_| bad())?;
        if !(Self::COMPAT_MIN..=i64::MAX as u64).contains(&id) {
            return Err(bad());
        }
        Ok(Self::from_compat_number(id))
    }

    /// The compat id of a task submitted through `in.php` (`None` for any other task).
    pub fn compat_id(&self) -> Option<u64> {
        let hex = self.0.strip_prefix(Self::PREFIX)?;
        let (high, low) = hex.split_at(16);
        if high.bytes().any(|b| b != b'0') {
            return None;
        }
        u64::from_str_radix(low, 16).ok().filter(|id| (Self::COMPAT_MIN..=i64::MAX as u64).contains(id))
    }

    /// A small stable number derived from the reference, used to spread the sparse indexes
    /// over several partitions: the reference's last four hex digits (random in a generated
    /// reference and in a compat id) modulo `shards`, so up to 256 shards are filled evenly.
    pub fn shard(&self, shards: u8) -> u8 {
        let tail = self.0.get(self.0.len().saturating_sub(4)..).unwrap_or_default();
        let value = u16::from_str_radix(tail, 16)
            .unwrap_or_else(|_| self.0.bytes().fold(0u16, |h, b| h.wrapping_mul(31).wrapping_add(u16::from(b))));
        u8::try_from(value % u16::from(shards.max(1))).unwrap_or(0)
    }
}

impl AsRef<str> for TaskRef {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for TaskRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// The id CaptchaAI gave the task. Arrives as a JSON number or a string; kept as text.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CaptchaId(String);

impl CaptchaId {
    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        if s.is_empty() || s.len() > 64 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(ParseError("CaptchaAI task id must be 1 to 64 letters or digits".into()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl AsRef<str> for CaptchaId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CaptchaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for CaptchaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for CaptchaId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for CaptchaId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum NumOrStr {
            Num(u64),
            Str(String),
        }
        let text = match NumOrStr::deserialize(d)? {
            NumOrStr::Num(n) => n.to_string(),
            NumOrStr::Str(s) => s,
        };
        CaptchaId::parse(&text).map_err(serde::de::Error::custom)
    }
}

/// A solved captcha's answer (a token, or an image's text), with the user agent it was earned
/// with where CaptchaAI names one (reCAPTCHA Enterprise, a Cloudflare challenge: the token works
/// only with it). Never printed: `Debug` redacts it. Two solutions are the same result when
/// their answers are: a user agent one delivery names and another does not changes nothing.
#[derive(Clone)]
pub struct Solution {
    text: String,
    user_agent: Option<String>,
}

impl PartialEq for Solution {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Solution {}

impl Solution {
    /// Largest answer accepted; real tokens are a few KiB.
    pub const MAX_LEN: usize = 12 * 1024;
    /// Largest user agent kept.
    pub const MAX_USER_AGENT: usize = 1024;

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        if s.is_empty() {
            return Err(ParseError("solution is empty".into()));
        }
        if s.len() > Self::MAX_LEN {
            return Err(ParseError(format!("solution is longer than {} bytes", Self::MAX_LEN)));
        }
        // No token or image answer holds a control character; one that does is not a result.
        if s.chars().any(char::is_control) {
            return Err(ParseError("solution holds a control character".into()));
        }
        Ok(Self { text: s.to_owned(), user_agent: None })
    }

    /// The solution with the user agent it was earned with. One that is empty, too long or
    /// holds a control character is not a user agent and is left out.
    pub fn with_user_agent(mut self, ua: Option<&str>) -> Self {
        self.user_agent = ua
            .map(str::trim)
            .filter(|u| !u.is_empty() && u.len() <= Self::MAX_USER_AGENT && !u.chars().any(char::is_control))
            .map(str::to_owned);
        self
    }

    /// The token itself. Call only where it leaves to its owner (an API response, the store).
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// The user agent to use the token with, when CaptchaAI named one.
    pub fn user_agent(&self) -> Option<&str> {
        self.user_agent.as_deref()
    }
}

impl fmt::Debug for Solution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Solution(<redacted, {} bytes>)", self.text.len())
    }
}

/// What kind of captcha a task is; decides token lifetime and solve-time limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptchaKind {
    RecaptchaV2,
    RecaptchaV3,
    RecaptchaEnterprise,
    Hcaptcha,
    Turnstile,
    Image,
    /// GeeTest v3: the answer is a JSON object (`challenge`, `validate`, `seccode`).
    Geetest,
    /// Cloudflare's challenge page: the answer is a clearance, used with the user agent it was
    /// earned with.
    CloudflareChallenge,
    /// BLS's grid of nine images: the answer is a JSON list of the cells to click.
    Bls,
}

impl CaptchaKind {
    pub const ALL: [CaptchaKind; 9] = [
        Self::RecaptchaV2,
        Self::RecaptchaV3,
        Self::RecaptchaEnterprise,
        Self::Hcaptcha,
        Self::Turnstile,
        Self::Image,
        Self::Geetest,
        Self::CloudflareChallenge,
        Self::Bls,
    ];

    /// The kinds CaptchaAI solves (all but hCaptcha).
    pub const CAPTCHAAI: [CaptchaKind; 8] = [
        Self::RecaptchaV2,
        Self::RecaptchaV3,
        Self::RecaptchaEnterprise,
        Self::Turnstile,
        Self::Image,
        Self::Geetest,
        Self::CloudflareChallenge,
        Self::Bls,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::RecaptchaV2 => "recaptcha_v2",
            Self::RecaptchaV3 => "recaptcha_v3",
            Self::RecaptchaEnterprise => "recaptcha_enterprise",
            Self::Hcaptcha => "hcaptcha",
            Self::Turnstile => "turnstile",
            Self::Image => "image",
            Self::Geetest => "geetest",
            Self::CloudflareChallenge => "cloudflare_challenge",
            Self::Bls => "bls",
        }
    }

    /// Whether CaptchaAI solves it. hCaptcha is 2captcha's: CaptchaAI answers it
    /// `ERROR_SERVER_ERROR` (docs/compat.md), so the relay refuses it unless its upstream is
    /// a 2captcha-compatible service that solves it (`CAPTCHAAI_FLAVOR=2captcha`).
    pub fn captchaai_solves(self) -> bool {
        self != Self::Hcaptcha
    }

    /// Whether the answer is JSON (a GeeTest object, BLS's list of cells), handed out as JSON
    /// in `res.php`'s JSON answers as 2captcha does.
    pub fn structured_answer(self) -> bool {
        matches!(self, Self::Geetest | Self::Bls)
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| ParseError(format!("unknown captcha kind `{s}`")))
    }

    /// How long a solution stays usable after it was issued. `None`: it does not expire
    /// (an image's text, BLS's cells). Where no lifetime is published (GeeTest's validate, a
    /// Cloudflare clearance, whose site may set its passage as short as 5 minutes), the long one
    /// of those known, 300 s, is taken.
    pub fn token_lifetime(self) -> Option<Duration> {
        match self {
            Self::RecaptchaV2 | Self::RecaptchaV3 | Self::RecaptchaEnterprise | Self::Hcaptcha => {
                Some(Duration::from_secs(120))
            }
            Self::Turnstile | Self::Geetest | Self::CloudflareChallenge => Some(Duration::from_secs(300)),
            Self::Image | Self::Bls => None,
        }
    }

    /// The typical solve time (the protocol's figures: image 5–20 s, Turnstile 10–15 s,
    /// reCAPTCHA 15–60 s; hCaptcha is not given and is taken as reCAPTCHA's; BLS as an image;
    /// GeeTest and a Cloudflare challenge, not published either, as reCAPTCHA's).
    pub fn typical_solve_time(self) -> (Duration, Duration) {
        let secs = |a, b| (Duration::from_secs(a), Duration::from_secs(b));
        match self {
            Self::Image | Self::Bls => secs(5, 20),
            Self::Turnstile => secs(10, 15),
            Self::RecaptchaV2
            | Self::RecaptchaV3
            | Self::RecaptchaEnterprise
            | Self::Hcaptcha
            | Self::Geetest
            | Self::CloudflareChallenge => secs(15, 60),
        }
    }

    /// When the fallback poller first reads a task that got no callback: 5 s after a typical
    /// solve is done. While callbacks work they have arrived by then (so reads stay rare), and a
    /// token recovered then is young: at most this long old, well inside its lifetime.
    pub fn first_read_after(self) -> Duration {
        self.typical_solve_time().1 + Duration::from_secs(5)
    }

    /// How long a task of this kind is counted as holding a CaptchaAI thread after it is sent,
    /// unless its result comes first: the upper end of its typical solve time. A task whose
    /// pingback was lost is not counted busy until the poller reads it (its grace), nor a slow
    /// one until CaptchaAI gives up; the submit queue's window learns the difference from
    /// CaptchaAI's "no slot" answers (see `crate::submit::window`).
    pub fn busy_for(self) -> Duration {
        self.typical_solve_time().1
    }

    /// After this long without an answer CaptchaAI gives up (`ERROR_CAPTCHA_UNSOLVABLE`): 300 s
    /// for reCAPTCHA, 90 s for the rest (a Cloudflare challenge, solved through the owner's
    /// proxy, is given reCAPTCHA's).
    pub fn max_solve_time(self) -> Duration {
        match self {
            Self::RecaptchaV2 | Self::RecaptchaV3 | Self::RecaptchaEnterprise | Self::CloudflareChallenge => {
                Duration::from_secs(300)
            }
            Self::Hcaptcha | Self::Turnstile | Self::Image | Self::Geetest | Self::Bls => Duration::from_secs(90),
        }
    }

    /// When a task whose in.php outcome is unknown (or whose answer a crash lost) and whose
    /// result has not come is sent again: by then its kind's results normally have come — the
    /// upper end of its typical solve time, doubled for the slow tail, plus the pingback's and
    /// the poller's grace (30 s).
    pub fn resend_after(self) -> Duration {
        self.typical_solve_time().1 * 2 + Duration::from_secs(30)
    }
}

impl fmt::Display for CaptchaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How a task's final state was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// The pingback from CaptchaAI.
    Callback,
    /// The fallback poller reading res.php.
    Poll,
    /// A dead letter re-applied by the redrive function.
    Redrive,
    /// The submit itself (in.php refused the task).
    Submit,
    /// The poller's deadline (no answer in time).
    Deadline,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Callback => "callback",
            Self::Poll => "poll",
            Self::Redrive => "redrive",
            Self::Submit => "submit",
            Self::Deadline => "deadline",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        [Self::Callback, Self::Poll, Self::Redrive, Self::Submit, Self::Deadline]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| ParseError(format!("unknown resolution path `{s}`")))
    }
}

/// The result CaptchaAI reported for a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Solved(Solution),
    Failed(ErrorCode),
}

/// One delivery of a result, from whichever path brought it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub captcha_id: CaptchaId,
    pub outcome: Outcome,
    pub received_at: Timestamp,
    pub via: Via,
    /// The earliest moment the token can have been issued, as far as this path knows: the
    /// freshness clock starts there, so a token is never handed out older than its lifetime. A
    /// poll knows the last moment res.php still said "not ready" (or the submit); a pingback
    /// knows nothing — it may have been delayed — so it says 0 and the task's creation bounds it.
    pub token_clock_start: Timestamp,
}

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

/// How a task submitted through `in.php` with a `pingback` gets its result pushed there: as
/// CaptchaAI sends a pingback, `GET <url>?id=…&code=…` (the default: code written for
/// CaptchaAI has a GET route), or as 2captcha does, a `POST` form `id=…&code=…` — a setting of
/// the relay key, for code written against 2captcha.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PingbackForm {
    #[default]
    Get,
    Post,
}

impl PingbackForm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Post => "post",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "get" | "captchaai" => Ok(Self::Get),
            "post" | "2captcha" => Ok(Self::Post),
            other => Err(ParseError(format!(
                "pingback form `{other}` is neither `get` (CaptchaAI's) nor `post` (2captcha's)"
            ))),
        }
    }
}

/// Where the push of a task's result to its owner's callback stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeliveryState {
    pub status: DeliveryStatus,
    /// Attempts made for the current result (a claim counts one before it is sent).
    pub attempts: u32,
    /// When the next attempt is due (while pending or retrying).
    pub next_attempt_at: Option<Timestamp>,
    pub last_attempt_at: Option<Timestamp>,
    /// What the last attempt got: `HTTP 500`, `timeout`, … (never a response body).
    pub last_outcome: Option<String>,
    pub delivered_at: Option<Timestamp>,
    /// The `webhook-id` last delivered: the same result is never pushed under another id.
    pub delivered_id: Option<String>,
    pub parked_at: Option<Timestamp>,
    /// Failed attempts recorded for the current result, per schedule: what the next wait
    /// follows (a lost attempt is not one).
    pub failures: crate::delivery::schedule::Failures,
}

/// The push's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Nothing to push yet: the task is still open.
    #[default]
    Waiting,
    /// Due now (the first attempt, or a replay).
    Pending,
    /// An attempt failed; the next is scheduled.
    Retrying,
    /// The owner's endpoint answered 2xx.
    Delivered,
    /// Every attempt failed, or the URL was refused at send time: kept for an operator to list
    /// and replay.
    Parked,
    /// The owner's endpoint answered 410: no more attempts.
    Gone,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Pending => "pending",
            Self::Retrying => "retrying",
            Self::Delivered => "delivered",
            Self::Parked => "parked",
            Self::Gone => "gone",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        [Self::Waiting, Self::Pending, Self::Retrying, Self::Delivered, Self::Parked, Self::Gone]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| ParseError(format!("unknown delivery status `{s}`")))
    }
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
    pub fn apply(self, d: Delivery) -> Result<Applied, TransitionError> {
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
    fn with_result(self, d: Delivery) -> Self {
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

    /// The 2captcha answer for this task at `now`, as `res.php?action=get` gives it and a
    /// 2captcha pingback carries it as `code`: `(true, token)` while the token is fresh,
    /// otherwise `(false, code)` — `CAPCHA_NOT_READY`, `ERROR_TOKEN_EXPIRED` (a token past its
    /// lifetime is never handed out), CaptchaAI's error code, or `ERROR_CAPTCHA_UNSOLVABLE` for a
    /// task that expired without a result.
    pub fn compat_answer(&self, now: Timestamp) -> (bool, String) {
        let fresh_or_expired = |solution: &Solution, clock: Timestamp| {
            if self.kind.token_lifetime().is_some_and(|life| now >= clock.plus(life)) {
                (false, "ERROR_TOKEN_EXPIRED".to_owned())
            } else {
                (true, solution.expose().to_owned())
            }
        };
        match &self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => {
                (false, "CAPCHA_NOT_READY".into())
            }
            TaskState::Solved { solution, token_clock_start, .. } => fresh_or_expired(solution, *token_clock_start),
            TaskState::Failed { code, .. } => (false, code.as_ref().to_owned()),
            TaskState::Expired { late, .. } => match late {
                Some(l) => match &l.outcome {
                    Outcome::Solved(s) => fresh_or_expired(s, l.token_clock_start),
                    Outcome::Failed(c) => (false, c.as_ref().to_owned()),
                },
                None => (false, "ERROR_CAPTCHA_UNSOLVABLE".into()),
            },
        }
    }

    /// The user agent to use the answer [`Self::compat_answer`] hands out with, if CaptchaAI
    /// named one (only while that answer is a fresh solution).
    pub fn compat_user_agent(&self, now: Timestamp) -> Option<&str> {
        let solution = match &self.state {
            TaskState::Solved { solution, .. } => solution,
            TaskState::Expired { late: Some(LateResult { outcome: Outcome::Solved(s), .. }), .. } => s,
            _ => return None,
        };
        if self.compat_answer(now).0 { solution.user_agent() } else { None }
    }

    /// The `webhook-id` of a push of this task's result: the same for the same result, however
    /// often it is sent (owners de-duplicate on it), different when the result changes (a
    /// replacement, a late result). `None` while the task is open.
    pub fn webhook_id(&self) -> Option<String> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.task_ref.as_ref().as_bytes());
        let mut part = |b: &str| {
            h.update([0]);
            h.update(b.as_bytes());
        };
        match &self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => return None,
            TaskState::Solved { solution, .. } => {
                part("solved");
                part(solution.expose());
            }
            TaskState::Failed { code, .. } => {
                part("failed");
                part(code.as_ref());
            }
            TaskState::Expired { late, .. } => {
                part("expired");
                match late.as_ref().map(|l| &l.outcome) {
                    Some(Outcome::Solved(s)) => part(s.expose()),
                    Some(Outcome::Failed(c)) => part(c.as_ref()),
                    None => {}
                }
            }
        }
        Some(format!("msg_{}", &hex::encode(h.finalize())[..32]))
    }

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
                schedule: d
                    .next_attempt_at
                    .map(|at| crate::delivery::schedule::Phase::at(self.token_dies_at(), at).as_str()),
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
    /// until just before it dies) or `standard` (see `crate::delivery::schedule`).
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compat_ids_are_digits_that_map_one_to_one_onto_references() {
        for _ in 0..1000 {
            let (r, id) = TaskRef::generate_compat();
            let text = id.to_string();
            assert!((18..=19).contains(&text.len()) && i64::try_from(id).is_ok(), "{text}");
            assert_eq!(TaskRef::parse(r.as_ref()), Ok(r.clone()), "a valid reference");
            assert_eq!(r.compat_id(), Some(id));
            assert_eq!(TaskRef::from_compat_id(&text), Ok(r));
        }
        assert_eq!(TaskRef::generate().compat_id(), None, "an API task has no compat id");
        for bad in ["", "12", "99999999999999999", "9223372036854775808", "12345678901234567a", " 1e18"] {
            assert!(TaskRef::from_compat_id(bad).is_err(), "{bad:?}");
        }
        let (a, _) = TaskRef::compat_from_digest(&[7; 32]);
        assert_eq!(TaskRef::compat_from_digest(&[7; 32]).0, a, "stable");
        assert!(a.compat_id().is_some());
    }

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn id(s: &str) -> CaptchaId {
        CaptchaId::parse(s).expect("valid id")
    }

    fn solved(s: &str, via: Via, at: u64) -> Delivery {
        Delivery {
            captcha_id: id("42"),
            outcome: Outcome::Solved(Solution::parse(s).expect("valid")),
            received_at: t(at),
            via,
            token_clock_start: t(at),
        }
    }

    fn pending_task(kind: CaptchaKind) -> Task {
        Task::new(TaskRef::generate(), kind, t(0)).submitted(id("42"), t(100)).expect("submitting -> pending")
    }

    #[test]
    fn task_ref_round_trips_and_rejects_garbage() {
        let r = TaskRef::generate();
        assert_eq!(TaskRef::parse(r.as_ref()).expect("own format parses"), r);
        for bad in
            ["", "tsk_", "tsk_XYZ", "abc_0123456789abcdef0123456789abcdef", "tsk_0123456789ABCDEF0123456789abcdef"]
        {
            assert!(TaskRef::parse(bad).is_err(), "{bad} should be rejected");
        }
        assert!(r.shard(8) < 8);
    }

    #[test]
    fn captcha_id_accepts_json_number_and_string() {
        let a: CaptchaId = serde_json::from_str("2122988149").expect("number");
        let b: CaptchaId = serde_json::from_str("\"2122988149\"").expect("string");
        assert_eq!(a, b);
        assert!(serde_json::from_str::<CaptchaId>("\"\"").is_err());
        assert!(serde_json::from_str::<CaptchaId>("\"12 34\"").is_err());
        assert!(serde_json::from_str::<CaptchaId>("-1").is_err());
    }

    #[test]
    fn solution_debug_never_shows_the_token() {
        let s = Solution::parse("03AGdBq2-secret-token").expect("valid");
        let shown = format!("{s:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(Solution::parse("").is_err());
        assert!(Solution::parse(&"x".repeat(Solution::MAX_LEN + 1)).is_err());
    }

    #[test]
    fn kinds_round_trip_and_carry_lifetimes() {
        for k in CaptchaKind::ALL {
            assert_eq!(CaptchaKind::parse(k.as_str()), Ok(k));
        }
        assert_eq!(CaptchaKind::Turnstile.token_lifetime(), Some(Duration::from_secs(300)));
        assert_eq!(CaptchaKind::RecaptchaV2.token_lifetime(), Some(Duration::from_secs(120)));
        assert_eq!(CaptchaKind::Image.token_lifetime(), None);
    }

    #[test]
    fn submit_moves_submitting_to_pending_once() {
        let task = pending_task(CaptchaKind::Turnstile);
        assert_eq!(task.state, TaskState::Pending { submitted_at: t(100) });
        assert_eq!(task.captcha_id, Some(id("42")));
        assert!(matches!(task.submitted(id("43"), t(200)), Err(TransitionError::NotAllowed { from: "pending", .. })));
    }

    #[test]
    fn start_time_is_the_submit_once_known() {
        let fresh = Task::new(TaskRef::generate(), CaptchaKind::Image, t(7));
        assert_eq!(fresh.submitted_or_created_at(), t(7));
        assert_eq!(pending_task(CaptchaKind::Image).submitted_or_created_at(), t(100));
    }

    #[test]
    fn submit_failure_is_only_possible_while_submitting() {
        let failed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
            .submit_failed(ErrorCode::parse("ERROR_ZERO_CAPTCHA_FILESIZE").expect("code"), None, t(5))
            .expect("submitting -> failed");
        assert!(matches!(failed.state, TaskState::Failed { via: Via::Submit, .. }));
        assert!(
            pending_task(CaptchaKind::Image)
                .submit_failed(ErrorCode::parse("ERROR_X").expect("code"), None, t(5))
                .is_err()
        );
    }

    #[test]
    fn first_result_is_recorded_then_duplicates_and_conflicts_change_nothing() {
        let Applied::Recorded(task) =
            pending_task(CaptchaKind::Turnstile).apply(solved("tok", Via::Callback, 500)).expect("ok")
        else {
            panic!("first result must be recorded");
        };
        assert!(matches!(task.state, TaskState::Solved { via: Via::Callback, .. }));
        assert_eq!(task.clone().apply(solved("tok", Via::Poll, 900)), Ok(Applied::Duplicate));
        assert_eq!(task.apply(solved("other", Via::Callback, 900)), Ok(Applied::Conflict));
    }

    #[test]
    fn the_first_received_result_wins_until_the_owner_was_shown_one() {
        // B (received at 900) was stored first; A, received at 500, reaches the store later
        // (through the dead-letter queue): A replaces B.
        let Ok(Applied::Recorded(b)) = pending_task(CaptchaKind::Turnstile).apply(solved("b", Via::Callback, 900))
        else {
            panic!("recorded")
        };
        let Ok(Applied::Replaced(a)) = b.clone().apply(solved("a", Via::Redrive, 500)) else { panic!("replaced") };
        assert!(matches!(&a.state, TaskState::Solved { solution, resolved_at, via: Via::Redrive, .. }
            if solution.expose() == "a" && *resolved_at == t(500)));
        // B again, or anything received later than A, changes nothing now.
        assert_eq!(a.clone().apply(solved("b", Via::Redrive, 900)), Ok(Applied::Conflict));
        assert_eq!(a.clone().apply(solved("a", Via::Poll, 700)), Ok(Applied::Duplicate));
        // An earlier receipt of the held result moves the receipt time back.
        let Ok(Applied::Earlier(a2)) = a.clone().apply(solved("a", Via::Callback, 300)) else { panic!("earlier") };
        assert!(matches!(&a2.state, TaskState::Solved { resolved_at, .. } if *resolved_at == t(300)));
        // Ties keep what is stored; a verdict received earlier replaces a solution too.
        assert_eq!(a2.clone().apply(solved("c", Via::Poll, 300)), Ok(Applied::Conflict));
        let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
        let verdict = Delivery { outcome: Outcome::Failed(code), ..solved("x", Via::Redrive, 200) };
        assert!(matches!(
            a2.clone().apply(verdict.clone()),
            Ok(Applied::Replaced(Task { state: TaskState::Failed { .. }, .. }))
        ));
        // Once shown, nothing replaces it.
        assert!(a2.needs_pin(t(301)));
        let shown = Task { handed_out_at: Some(t(301)), ..a2 };
        assert!(!shown.needs_pin(t(302)));
        assert_eq!(shown.clone().apply(verdict), Ok(Applied::Conflict));
        assert_eq!(shown.clone().apply(solved("a", Via::Callback, 100)), Ok(Applied::Duplicate));
        // A stale solution is not handed out, so not pinned; a submit failure never is.
        assert!(!Task { handed_out_at: None, ..shown }.needs_pin(t(1_000_000)));
        let refused = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
            .submit_failed(ErrorCode::parse("ERROR_ZERO_CAPTCHA_FILESIZE").expect("code"), None, t(5))
            .expect("failed");
        assert!(!refused.needs_pin(t(6)));
    }

    #[test]
    fn error_code_result_fails_the_task_and_repeats_are_duplicates() {
        let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
        let d = Delivery { outcome: Outcome::Failed(code.clone()), ..solved("x", Via::Callback, 10) };
        let Ok(Applied::Recorded(task)) = pending_task(CaptchaKind::Hcaptcha).apply(d.clone()) else {
            panic!("recorded")
        };
        assert!(matches!(&task.state, TaskState::Failed { code: c, .. } if *c == code));
        assert_eq!(task.clone().apply(d), Ok(Applied::Duplicate));
        assert_eq!(task.apply(solved("tok", Via::Poll, 20)), Ok(Applied::Conflict));
    }

    #[test]
    fn result_with_another_captcha_id_is_refused() {
        let d = Delivery { captcha_id: id("99"), ..solved("tok", Via::Callback, 10) };
        assert!(matches!(pending_task(CaptchaKind::Image).apply(d), Err(TransitionError::IdMismatch { .. })));
    }

    #[test]
    fn callback_that_outruns_the_submit_is_recorded_with_its_id() {
        let task = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0));
        let Ok(Applied::Recorded(task)) = task.apply(solved("abc", Via::Callback, 10)) else { panic!("recorded") };
        assert_eq!(task.captcha_id, Some(id("42")));
        // The submit that finishes later cannot move it back to pending.
        assert!(task.submitted(id("42"), t(20)).is_err());
    }

    #[test]
    fn expiry_applies_to_open_tasks_only() {
        let expired =
            pending_task(CaptchaKind::Image).expire("no answer in 10 min".into(), t(600_000)).expect("expire");
        assert_eq!(expired.state.name(), "expired");
        assert!(expired.expire("again".into(), t(1)).is_err());
    }

    #[test]
    fn a_result_received_before_the_expiry_but_applied_after_it_is_the_result() {
        let expired = pending_task(CaptchaKind::Image).expire("deadline".into(), t(600_000)).expect("expire");
        let Ok(Applied::Recorded(task)) = expired.apply(solved("w68hp", Via::Redrive, 599_000)) else {
            panic!("a result received before the expiry is recorded")
        };
        assert!(matches!(task.state, TaskState::Solved { via: Via::Redrive, .. }));
    }

    #[test]
    fn a_result_after_the_expiry_is_kept_as_a_late_result_and_shown_while_fresh() {
        let expired = pending_task(CaptchaKind::Turnstile).expire("deadline".into(), t(600_000)).expect("expire");
        let Ok(Applied::Late(task)) = expired.apply(solved("tok", Via::Callback, 700_000)) else {
            panic!("kept as a late result")
        };
        assert_eq!(task.state.name(), "expired", "the task stays expired");
        assert_eq!(task.clone().apply(solved("tok", Via::Poll, 710_000)), Ok(Applied::Duplicate));
        assert_eq!(task.clone().apply(solved("other", Via::Poll, 710_000)), Ok(Applied::Conflict));
        let v = task.view(t(760_000));
        let late = v.late_result.expect("late result shown");
        assert_eq!((late.status, late.solution.as_deref(), late.age_secs), ("solved", Some("tok"), 60));
        let stale = task.view(t(1_000_000)).late_result.expect("still shown");
        assert_eq!((stale.status, stale.solution), ("stale", None), "a stale late token is not handed out");
    }

    #[test]
    fn a_result_for_a_task_whose_submit_failed_proves_it_was_accepted() {
        let failed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(0))
            .submit_failed(ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").expect("code"), None, t(5))
            .expect("failed");
        let Ok(Applied::Recorded(task)) = failed.apply(solved("w68hp", Via::Callback, 30_000)) else {
            panic!("recorded")
        };
        assert!(matches!(task.state, TaskState::Solved { .. }));
        // A task that failed with CaptchaAI's own verdict keeps it.
        let code = ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE").expect("code");
        let d = Delivery { outcome: Outcome::Failed(code), ..solved("x", Via::Callback, 10) };
        let Ok(Applied::Recorded(unsolvable)) = pending_task(CaptchaKind::Image).apply(d) else { panic!() };
        assert_eq!(unsolvable.apply(solved("w68hp", Via::Poll, 20)), Ok(Applied::Conflict));
    }

    #[test]
    fn stale_solution_is_reported_expired_and_not_handed_out() {
        let Ok(Applied::Recorded(task)) =
            pending_task(CaptchaKind::RecaptchaV2).apply(solved("tok", Via::Callback, 1_000))
        else {
            panic!("recorded")
        };
        let fresh = task.view(t(1_000 + 119_999));
        assert_eq!(fresh.status, "solved");
        assert_eq!(fresh.solution.as_deref(), Some("tok"));
        assert_eq!(fresh.expires_at.as_deref(), Some(t(121_000).to_rfc3339().as_str()));
        let stale = task.view(t(121_000));
        assert_eq!(stale.status, "expired");
        assert_eq!(stale.solution, None);
        assert_eq!(stale.error_code.as_deref(), Some("TOKEN_LIFETIME_ELAPSED"));
    }

    #[test]
    fn image_answers_never_go_stale() {
        let Ok(Applied::Recorded(task)) = pending_task(CaptchaKind::Image).apply(solved("w68hp", Via::Poll, 1_000))
        else {
            panic!("recorded")
        };
        let v = task.view(t(10_000_000_000));
        assert_eq!((v.status, v.solution.as_deref(), v.expires_at), ("solved", Some("w68hp"), None));
    }
}

//! The DynamoDB task store.
//!
//! One table keyed by our task reference (`pk`). Open tasks (submitting, pending) carry
//! `poll_shard` + `poll_due_at`, which makes them appear in the sparse `due-for-poll` index;
//! every final write removes both, so the index only ever lists work. `expires_ttl` (epoch
//! seconds) lets DynamoDB's TTL delete a task after the retention period.
//!
//! Recording a result is one conditional `UpdateItem`. Its condition is the state machine's
//! rule (`Task::apply`) written as a DynamoDB expression; when it is refused, DynamoDB hands
//! back the old item (`ReturnValuesOnConditionCheckFailure=ALL_OLD`) and the same pure
//! function tells duplicate from conflict from wrong id, with no extra read.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::{ProvideErrorMetadata, SdkError};
use aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder;
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};

use crate::codes::ErrorCode;
use crate::domain::{
    Applied, CaptchaId, CaptchaKind, Delivery, Outcome, Task, TaskRef, TaskState, TransitionError, Via,
};
use crate::time::Timestamp;

/// Name of the sparse index of open tasks by the time they are due for a fallback poll.
pub const DUE_INDEX: &str = "due-for-poll";
/// The due-for-poll and due-for-delivery indexes are spread over this many partitions by
/// default (`poll_shard` / `dlv_shard` 0..N), so no index key runs hot: each task writes an
/// index key about three times, so 8 keys take ~2,600 new tasks/s before one reaches
/// DynamoDB's 1,000 writes/s per partition key (docs/capacity.md). `POLL_SHARDS` sets it.
pub const DEFAULT_POLL_SHARDS: u8 = 8;
/// The most shards a deployment may use (the readers query every one of them).
pub const MAX_POLL_SHARDS: u8 = 64;

/// How the sparse indexes are spread. Writers put a task in shard `ref mod write`; readers
/// cover `0..max(write, previous)`. Lowering the count is therefore safe in two steps: deploy
/// the new count with `previous` = the old one (new tasks go to the new shards; entries
/// written under the old count stay where they are, still read, until their task ends — a
/// parked push until it is replayed or expires), then, once no entry is left at or above the
/// new count (`relay-ops shards`), set `previous` back to 0. Raising the count needs no second
/// step: the readers cover every shard the writers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub write: u8,
    pub previous: u8,
}

impl Default for Shards {
    fn default() -> Self {
        Self { write: DEFAULT_POLL_SHARDS, previous: 0 }
    }
}

impl Shards {
    /// The shard `task_ref` is written to.
    pub fn of(&self, task_ref: &TaskRef) -> u8 {
        task_ref.shard(self.write)
    }

    /// How many shards a reader covers (`0..read()`).
    pub fn read(&self) -> u8 {
        self.write.max(self.previous).max(1)
    }
}

pub mod deliveries;
pub mod hosts;
pub mod queue;
pub mod relay_keys;
pub mod retention;
pub use deliveries::{DELIVERY_INDEX, DeliveryFinish, DueDelivery};
pub use hosts::{HostRecord, SlotWrite};
pub use queue::{Permit, Publish, QUEUE_INDEX, QueuedRef, Released, Reserved, SubmitState};
pub use relay_keys::{KeyCheck, KeyGrant, KeyInfo, RelayKeys};

mod attr {
    pub const PK: &str = "pk";
    pub const KIND: &str = "kind";
    pub const STATE: &str = "state";
    pub const CREATED_AT: &str = "created_at";
    pub const CAPTCHA_ID: &str = "captcha_id";
    pub const SUBMITTED_AT: &str = "submitted_at";
    pub const SOLUTION: &str = "solution";
    /// The user agent the solution was earned with: the one CaptchaAI named, else the one
    /// the task was submitted with (`userAgent`).
    pub const USER_AGENT: &str = "user_agent";
    pub const ERROR_CODE: &str = "error_code";
    pub const ERROR_DETAIL: &str = "error_detail";
    pub const RESOLVED_AT: &str = "resolved_at";
    pub const RESOLVED_VIA: &str = "resolved_via";
    pub const TOKEN_CLOCK_START: &str = "token_clock_start";
    pub const POLL_SHARD: &str = "poll_shard";
    pub const POLL_DUE_AT: &str = "poll_due_at";
    pub const EXPIRES_TTL: &str = "expires_ttl";
    pub const POLL_READS: &str = "poll_reads";
    pub const POLL_UNKNOWN: &str = "poll_unknown";
    pub const LAST_NOT_READY_AT: &str = "last_not_ready_at";
    pub const LATE_CODE: &str = "late_code";
    pub const SUBMIT_UNKNOWN: &str = "submit_unknown";
    pub const IDEM_FINGERPRINT: &str = "idem_fingerprint";
    pub const LATE_AT: &str = "late_at";
    pub const LATE_VIA: &str = "late_via";
    pub const LATE_CLOCK: &str = "late_clock";
    pub const HANDED_OUT_AT: &str = "handed_out_at";
    pub const OWNER_CALLBACK: &str = "owner_callback";
    pub const WEBHOOK_OWNER: &str = "webhook_owner";
    /// `post` on a compat task whose relay key pushes 2captcha's form (absent: CaptchaAI's GET).
    pub const PINGBACK_FORM: &str = "pingback_form";
    /// When the task was sent to in.php a second time (see `Task::resent_at`).
    pub const RESENT_AT: &str = "resent_at";
    /// Who submitted the task (see `Task::owner`): what an erasure names.
    pub const OWNER: &str = "owner";
    // The submit queue (see `queue`).
    pub const QUEUED_AT: &str = "queued_at";
    pub const Q_LANE: &str = "q_lane";
    pub const RELEASED_AT: &str = "released_at";
    pub const SQ_KEY: &str = "sq_key";
    pub const SQ_AT: &str = "sq_at";
    // The push of the result to the owner's callback (see `deliveries`).
    pub const DLV_SHARD: &str = "dlv_shard";
    pub const DLV_DUE: &str = "dlv_due";
    pub const DLV_STATUS: &str = "dlv_status";
    pub const DLV_ATTEMPTS: &str = "dlv_attempts";
    pub const DLV_LAST: &str = "dlv_last";
    pub const DLV_LAST_AT: &str = "dlv_last_at";
    pub const DLV_DONE_ID: &str = "dlv_done_id";
    pub const DLV_DONE_AT: &str = "dlv_done_at";
    pub const DLV_PARKED_AT: &str = "dlv_parked_at";
    /// Failed attempts recorded, per schedule (see `crate::delivery::schedule`).
    pub const DLV_TOKEN_FAILS: &str = "dlv_tfails";
    pub const DLV_STANDARD_FAILS: &str = "dlv_sfails";
}

/// What every terminal write adds: the push of the result becomes due, in the same write (the
/// transactional outbox). Only items with `dlv_shard` (those with an owner callback) appear in
/// the due-for-delivery index; on the rest these attributes are inert.
const DELIVERY_DUE: &str =
    "dlv_due = :dnow, dlv_status = :dpending, dlv_attempts = :dzero, dlv_tfails = :dzero, dlv_sfails = :dzero";
/// ... and what it clears: a parked push of an earlier result, a lease on it.
const DELIVERY_CLEAR: &str = "dlv_parked_at, dlv_lease";
/// What every write that ends a task's open life removes: its place in the due-for-poll index,
/// in the submit queue's index (queued or in work), and what only in.php needed.
const UNSENT_CLEAR: &str = "poll_due_at, poll_shard, lease_owner, sq_key, sq_at, sq_req, sq_pingback, submit_unknown";

/// The values [`DELIVERY_DUE`] refers to.
fn delivery_due(req: UpdateItemFluentBuilder, now: Timestamp) -> UpdateItemFluentBuilder {
    req.expression_attribute_values(":dnow", n(now.as_millis()))
        .expression_attribute_values(":dpending", s(crate::domain::DeliveryStatus::Pending.as_str()))
        .expression_attribute_values(":dzero", n(0))
}

/// An open task as the due-for-poll index lists it, with the poller's bookkeeping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueTask {
    pub task: Task,
    /// The `poll_due_at` it was listed under; a claim is conditional on it being unchanged.
    pub due_at: Timestamp,
    /// res.php reads spent on it so far.
    pub reads: u32,
    /// Unknown codes seen so far.
    pub unknown_codes: u32,
    /// The last time res.php said "not ready": the token cannot be older than that.
    pub last_not_ready_at: Option<Timestamp>,
}

/// Where the next page of a query starts.
pub type PageKey = HashMap<String, AttributeValue>;

/// One page of the due-for-poll index.
#[derive(Debug, Default)]
pub struct DuePage {
    pub tasks: Vec<DueTask>,
    /// Where the next page starts; `None` when the shard is done.
    pub next: Option<PageKey>,
}

fn get_u32(item: &Item, name: &str) -> Result<u32, StoreError> {
    Ok(get_ts(item, name)?.map_or(0, |t| u32::try_from(t.as_millis()).unwrap_or(u32::MAX)))
}

impl TryFrom<&Item> for DueTask {
    type Error = StoreError;

    fn try_from(item: &Item) -> Result<Self, StoreError> {
        Ok(Self {
            task: Task::try_from(item)?,
            due_at: req_ts(item, attr::POLL_DUE_AT)?,
            reads: get_u32(item, attr::POLL_READS)?,
            unknown_codes: get_u32(item, attr::POLL_UNKNOWN)?,
            last_not_ready_at: get_ts(item, attr::LAST_NOT_READY_AT)?,
        })
    }
}

/// A store failure. Every variant says whether trying again may help.
#[derive(Debug, Clone, thiserror::Error)]
pub enum StoreError {
    /// Throttling, a network fault, a 5xx: the SDK's own retries ran out.
    #[error("task store unavailable: {0}")]
    Unavailable(String),
    /// The request itself was refused (validation, missing table): retrying will not help.
    #[error("task store refused the request: {0}")]
    Rejected(String),
    /// An item that does not decode into a task.
    #[error("stored task is malformed: {0}")]
    Corrupt(String),
}

impl StoreError {
    pub fn is_retryable(&self) -> bool {
        matches!(self, Self::Unavailable(_))
    }
}

fn sdk_error<E, R>(err: SdkError<E, R>) -> StoreError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    let text = aws_sdk_dynamodb::error::DisplayErrorContext(&err).to_string();
    match &err {
        SdkError::ServiceError(se) => match se.err().code() {
            Some(
                "ValidationException"
                | "ResourceNotFoundException"
                | "AccessDeniedException"
                | "UnrecognizedClientException"
                | "SerializationException",
            ) => StoreError::Rejected(text),
            _ => StoreError::Unavailable(text),
        },
        _ => StoreError::Unavailable(text),
    }
}

/// How [`TaskStore::reschedule`] puts a claimed task back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reschedule {
    pub next_due: Timestamp,
    /// The claim counted a read that was not made.
    pub unread: bool,
    /// The read answered a code not in the protocol's table.
    pub unknown_code: bool,
    /// The read answered "not ready" at this time.
    pub not_ready_at: Option<Timestamp>,
}

impl Reschedule {
    pub fn at(next_due: Timestamp) -> Self {
        Self { next_due, unread: false, unknown_code: false, not_ready_at: None }
    }
}

/// The account-wide circuit breaker for CaptchaAI traffic (and what was learnt of the service),
/// one item in the task table. While it is open no function sends CaptchaAI anything: a ban or a rejected key answered once stops
/// every poller and every submit, for the ban's documented duration.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Breaker {
    pub open_until: Option<Timestamp>,
    /// The code (or failure) that opened it.
    pub reason: Option<String>,
    pub opened_at: Option<Timestamp>,
    /// A key or account problem: an operator must fix it (`relay-ops breaker close`).
    pub needs_operator: bool,
    /// Opened because res.php stopped answering (timeouts, 5xx, HTML), not by a ban: it holds
    /// reads back, not submits.
    pub res_php_only: bool,
    /// res.php answered a batch read in a way that says it does not take `ids=`.
    pub batch_unsupported: bool,
    /// Opened because the plan has run out (`ERROR_ZERO_BALANCE` with threads free): it holds
    /// submits back, not reads — results of tasks already taken still come.
    pub submits_only: bool,
}

/// Why the breaker opens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// A ban or a rejected key: every request to CaptchaAI stops.
    Ban { needs_operator: bool },
    /// res.php answers are missing (timeouts, 5xx, HTML): reads pause.
    NoAnswers,
    /// CaptchaAI's plan has expired or is out of balance: submits stop (an operator renews it),
    /// reads go on.
    PlanOut,
}

impl Breaker {
    /// Its key: not a task reference (those start `tsk_`), never in the due-for-poll index.
    /// The item also holds the submit queue's state (see [`queue::SubmitState`]).
    pub const KEY: &'static str = "breaker#captchaai";

    fn from_item(item: &Item) -> Result<Self, StoreError> {
        Ok(Breaker {
            open_until: get_ts(item, "open_until")?,
            reason: get_s(item, "reason")?.map(str::to_owned),
            opened_at: get_ts(item, "opened_at")?,
            needs_operator: matches!(item.get("needs_operator"), Some(AttributeValue::Bool(true))),
            res_php_only: matches!(item.get("res_php_only"), Some(AttributeValue::Bool(true))),
            batch_unsupported: get_ts(item, "batch_unsupported_at")?.is_some(),
            submits_only: matches!(item.get("submits_only"), Some(AttributeValue::Bool(true))),
        })
    }

    /// Until when res.php reads are stopped, if they are at `now`.
    pub fn open_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.open_until.filter(|u| *u > now && !self.submits_only)
    }

    /// Until when submits (in.php) are stopped, if they are at `now`: by a ban or a plan run out.
    pub fn open_for_submits_at(&self, now: Timestamp) -> Option<Timestamp> {
        self.open_until.filter(|u| *u > now && !self.res_php_only)
    }

    /// Whether it is open because the plan has run out.
    pub fn plan_out(&self) -> bool {
        self.submits_only
    }
}

/// What happened to a delivered result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// This delivery is the task's result; the task as now stored.
    Recorded(Task),
    /// The task already had exactly this result. Nothing was written, unless this delivery
    /// received it earlier than the recorded one: then the receipt time moved back (the task as
    /// now stored).
    Duplicate(Task),
    /// The task already had a different result, which stays (received no later than this one, or
    /// already shown to the owner). Nothing was written.
    Conflict(Task),
    /// The task had a different result, received after this one and not yet shown to the owner:
    /// this delivery replaced it (first received wins). The task as now stored.
    Replaced(Task),
    /// The result names another CaptchaAI id than the task's. Nothing was written.
    IdMismatch { expected: CaptchaId },
    /// No task under that reference. Nothing was written.
    NotFound,
    /// The task had been expired before this result arrived; the result is kept on it as its
    /// late result (shown, never dropped; the task stays expired).
    Late(Task),
}

/// What [`TaskStore::create`] found. (Returned once per submit: its size does not matter.)
#[derive(Debug, Clone, PartialEq, Eq)]
#[allow(clippy::large_enum_variant)]
pub enum Created {
    /// The task is new.
    New,
    /// A task with that reference exists (the same idempotency key was used before); nothing
    /// was written. Its request's fingerprint, if it was created with one.
    Existing { task: Task, fingerprint: Option<String> },
}

/// What marking a task submitted amounted to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SubmitRecorded {
    /// Now pending.
    Pending(Task),
    /// Its result had already arrived (the callback outran in.php's answer); left as it is.
    AlreadyResolved(Task),
}

type Item = HashMap<String, AttributeValue>;

fn s(v: &str) -> AttributeValue {
    AttributeValue::S(v.to_owned())
}

fn n(v: u64) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn get_s<'a>(item: &'a Item, name: &str) -> Result<Option<&'a str>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::S(v)) => Ok(Some(v)),
        Some(_) => Err(StoreError::Corrupt(format!("`{name}` is not a string"))),
    }
}

fn req_s<'a>(item: &'a Item, name: &str) -> Result<&'a str, StoreError> {
    get_s(item, name)?.ok_or_else(|| StoreError::Corrupt(format!("`{name}` missing")))
}

fn get_ts(item: &Item, name: &str) -> Result<Option<Timestamp>, StoreError> {
    match item.get(name) {
        None => Ok(None),
        Some(AttributeValue::N(v)) => v
            .parse()
            .map(|ms| Some(Timestamp::from_millis(ms)))
            .map_err(|_| StoreError::Corrupt(format!("`{name}` is not a whole number"))),
        Some(_) => Err(StoreError::Corrupt(format!("`{name}` is not a number"))),
    }
}

fn req_ts(item: &Item, name: &str) -> Result<Timestamp, StoreError> {
    get_ts(item, name)?.ok_or_else(|| StoreError::Corrupt(format!("`{name}` missing")))
}

fn corrupt<E: std::fmt::Display>(name: &'static str) -> impl Fn(E) -> StoreError {
    move |e| StoreError::Corrupt(format!("`{name}`: {e}"))
}

impl TryFrom<&Item> for Task {
    type Error = StoreError;

    fn try_from(item: &Item) -> Result<Self, StoreError> {
        use attr::*;
        let task_ref = TaskRef::parse(req_s(item, PK)?).map_err(corrupt(PK))?;
        let created_at = req_ts(item, CREATED_AT)?;
        // When a token can have been issued at the earliest: not before the task existed, nor
        // before res.php last said "not ready" — whatever the delivering path claimed.
        let issued_after = |claimed: Option<Timestamp>| -> Result<Timestamp, StoreError> {
            let not_ready = get_ts(item, LAST_NOT_READY_AT)?.unwrap_or(created_at);
            Ok(claimed.unwrap_or(created_at).max(created_at).max(not_ready))
        };
        let kind = CaptchaKind::parse(req_s(item, KIND)?).map_err(corrupt(KIND))?;
        let captcha_id = get_s(item, CAPTCHA_ID)?.map(CaptchaId::parse).transpose().map_err(corrupt(CAPTCHA_ID))?;
        let via =
            || -> Result<Via, StoreError> { Via::parse(req_s(item, RESOLVED_VIA)?).map_err(corrupt(RESOLVED_VIA)) };
        let state = match req_s(item, STATE)? {
            "queued" => TaskState::Queued {
                queued_at: get_ts(item, QUEUED_AT)?.unwrap_or(created_at),
                lane: get_s(item, Q_LANE)?.unwrap_or_default().to_owned(),
            },
            "submitting" => TaskState::Submitting { unknown: get_s(item, SUBMIT_UNKNOWN)?.map(str::to_owned) },
            "pending" => TaskState::Pending { submitted_at: req_ts(item, SUBMITTED_AT)? },
            "solved" => {
                let resolved_at = req_ts(item, RESOLVED_AT)?;
                TaskState::Solved {
                    solution: crate::domain::Solution::parse(req_s(item, SOLUTION)?)
                        .map_err(corrupt(SOLUTION))?
                        .with_user_agent(get_s(item, USER_AGENT)?),
                    resolved_at,
                    via: via()?,
                    token_clock_start: issued_after(get_ts(item, TOKEN_CLOCK_START)?)?,
                }
            }
            "failed" => TaskState::Failed {
                code: ErrorCode::parse(req_s(item, ERROR_CODE)?).map_err(corrupt(ERROR_CODE))?,
                detail: get_s(item, ERROR_DETAIL)?.map(str::to_owned),
                resolved_at: req_ts(item, RESOLVED_AT)?,
                via: via()?,
            },
            "expired" => TaskState::Expired {
                reason: get_s(item, ERROR_DETAIL)?.unwrap_or("deadline passed").to_owned(),
                resolved_at: req_ts(item, RESOLVED_AT)?,
                late: late_result(item)?
                    .map(|l| -> Result<_, StoreError> {
                        Ok(crate::domain::LateResult {
                            token_clock_start: issued_after(Some(l.token_clock_start))?,
                            ..l
                        })
                    })
                    .transpose()?,
            },
            other => return Err(StoreError::Corrupt(format!("unknown state `{other}`"))),
        };
        let handed_out_at = get_ts(item, HANDED_OUT_AT)?;
        let owner_callback = get_s(item, OWNER_CALLBACK)?.map(str::to_owned);
        let webhook_owner = get_s(item, WEBHOOK_OWNER)?.map(str::to_owned);
        let delivery = match owner_callback {
            Some(_) => Some(deliveries::state(item)?),
            None => None,
        };
        Ok(Task {
            task_ref,
            kind,
            created_at,
            captcha_id,
            state,
            handed_out_at,
            owner_callback,
            webhook_owner,
            delivery,
            released_at: get_ts(item, RELEASED_AT)?,
            resent_at: get_ts(item, RESENT_AT)?,
            owner: get_s(item, OWNER)?.map(str::to_owned),
            pingback_form: get_s(item, PINGBACK_FORM)?
                .map(crate::domain::PingbackForm::parse)
                .transpose()
                .map_err(corrupt(PINGBACK_FORM))?
                .unwrap_or_default(),
        })
    }
}

fn outcome_of(code: &str) -> Result<Outcome, crate::domain::ParseError> {
    if crate::codes::is_error_code(code) {
        ErrorCode::parse(code).map(Outcome::Failed)
    } else {
        crate::domain::Solution::parse(code).map(Outcome::Solved)
    }
}

fn late_result(item: &Item) -> Result<Option<crate::domain::LateResult>, StoreError> {
    use attr::*;
    let Some(code) = get_s(item, LATE_CODE)? else { return Ok(None) };
    let received_at = req_ts(item, LATE_AT)?;
    Ok(Some(crate::domain::LateResult {
        outcome: outcome_of(code).map_err(corrupt(LATE_CODE))?,
        received_at,
        via: Via::parse(req_s(item, LATE_VIA)?).map_err(corrupt(LATE_VIA))?,
        token_clock_start: get_ts(item, LATE_CLOCK)?.unwrap_or(received_at),
    }))
}

/// Told of every push a write of this store made due, right after the write: how a delivery
/// worker in the same process (local mode) hears of a result at once, as the table's stream
/// tells the delivery function on AWS.
#[derive(Clone)]
pub struct PushNotifier(std::sync::Arc<dyn Fn(DueDelivery) + Send + Sync>);

impl PushNotifier {
    pub fn new(f: impl Fn(DueDelivery) + Send + Sync + 'static) -> Self {
        Self(std::sync::Arc::new(f))
    }
}

impl std::fmt::Debug for PushNotifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PushNotifier")
    }
}

/// The DynamoDB task store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TaskStore {
    client: Client,
    table: String,
    retention: Duration,
    pushes: Option<PushNotifier>,
    /// Told of every result this store records (a CaptchaAI thread freed).
    results: Option<std::sync::Arc<tokio::sync::Notify>>,
    shards: Shards,
    /// How many items the submit queue's counts spread over (`QUEUE_SHARDS`, [`queue`]).
    queue_shards: u8,
}

impl TaskStore {
    pub fn new(client: Client, table: impl Into<String>, retention: Duration) -> Self {
        Self {
            client,
            table: table.into(),
            retention,
            pushes: None,
            results: None,
            shards: Shards::default(),
            queue_shards: 1,
        }
    }

    /// The same store, counting its submit queue over `n` items (1 to
    /// [`queue::MAX_QUEUE_SHARDS`]).
    #[must_use]
    pub fn with_queue_shards(mut self, n: u8) -> Self {
        self.queue_shards = n.clamp(1, queue::MAX_QUEUE_SHARDS);
        self
    }

    /// The same store, spreading its indexes as `shards` says.
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.shards = shards;
        self
    }

    /// How this store spreads its sparse indexes.
    pub fn shards(&self) -> Shards {
        self.shards
    }

    /// How many items the submit queue's counts spread over.
    pub fn queue_shards(&self) -> u8 {
        self.queue_shards
    }

    /// The same store, notifying `n` of every result it records: how a submitter in the same
    /// process (local mode) hears at once that a thread is free, instead of at its next look.
    #[must_use]
    pub fn with_result_notifier(mut self, n: std::sync::Arc<tokio::sync::Notify>) -> Self {
        self.results = Some(n);
        self
    }

    /// The same store, telling `n` of every push its writes make due.
    #[must_use]
    pub fn with_push_notifier(mut self, n: PushNotifier) -> Self {
        self.pushes = Some(n);
        self
    }

    /// Tells the notifier, if any, that `task`'s push fell due at `at` (only for a task with
    /// an owner callback: the others have no push).
    fn push_due(&self, task: &Task, at: Timestamp) {
        if let Some(n) = &self.pushes
            && task.owner_callback.is_some()
        {
            (n.0)(DueDelivery { task_ref: task.task_ref.clone(), due_at: at });
        }
    }

    /// A store built from the cold-start AWS configuration. Every call is bounded in time
    /// (2 s an attempt, 6 s in all with the SDK's retries), so a caller with a deadline — the
    /// poller, a Lambda timeout — can plan for the worst case.
    pub fn from_config(aws: &aws_config::SdkConfig, cfg: &crate::config::StoreConfig) -> Self {
        let timeouts = aws_sdk_dynamodb::config::timeout::TimeoutConfig::builder()
            .operation_attempt_timeout(Duration::from_secs(2))
            .operation_timeout(Self::CALL_TIMEOUT)
            .build();
        let conf = aws_sdk_dynamodb::config::Builder::from(aws).timeout_config(timeouts).build();
        Self::new(Client::from_conf(conf), cfg.table.clone(), cfg.retention)
            .with_shards(cfg.shards)
            .with_queue_shards(cfg.queue_shards)
    }

    /// The longest one store call takes before it fails (see [`Self::from_config`]).
    pub const CALL_TIMEOUT: Duration = Duration::from_secs(6);

    pub fn table(&self) -> &str {
        &self.table
    }

    fn ttl(&self, from: Timestamp) -> AttributeValue {
        n(from.plus(self.retention).as_secs())
    }

    /// Records a new task (state submitting) before in.php is called. `deadline` is when the
    /// poller should look at it if in.php's answer never gets stored. With an idempotency key's
    /// `fingerprint` (of the request it came with), the reference was derived from the key: if a
    /// task already has it, nothing is written and that task and its fingerprint come back —
    /// one conditional put, no read first.
    /// The task is counted in work (see [`queue`]) from this moment (in.php may take it) for
    /// its kind's [`CaptchaKind::busy_for`], unless its result comes first.
    pub async fn create(
        &self,
        task: &Task,
        deadline: Timestamp,
        fingerprint: Option<&str>,
    ) -> Result<Created, StoreError> {
        self.create_sendable(task, deadline, fingerprint, None).await
    }

    /// [`Self::create`], keeping what in.php needs (the request and its pingback) until in.php's
    /// id is stored: a task whose submit's outcome is lost can then be sent again
    /// ([`Self::mark_resent`]).
    pub async fn create_sendable(
        &self,
        task: &Task,
        deadline: Timestamp,
        fingerprint: Option<&str>,
        sendable: Option<(&crate::captchaai::SubmitRequest, &str)>,
    ) -> Result<Created, StoreError> {
        let mut extra: Item = [
            (attr::SQ_KEY, s(&queue::in_work_key(&task.task_ref, self.shards))),
            (attr::SQ_AT, n(task.created_at.plus(task.kind.busy_for()).as_millis())),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some((request, pingback)) = sendable {
            let json = serde_json::to_string(request).map_err(|e| StoreError::Rejected(e.to_string()))?;
            extra.insert("sq_req".to_owned(), s(&json));
            extra.insert("sq_pingback".to_owned(), s(pingback));
            // The user agent the owner asked CaptchaAI to solve with: its solution's, unless the
            // answer names another.
            if let Some(ua) = request.user_agent() {
                extra.insert(attr::USER_AGENT.to_owned(), s(ua));
            }
        }
        self.put_new(task, Some(deadline), fingerprint, extra).await
    }

    /// The one conditional put of a new task (submitting with a `deadline` for the poller, or
    /// queued without one), with `extra` attributes.
    async fn put_new(
        &self,
        task: &Task,
        deadline: Option<Timestamp>,
        fingerprint: Option<&str>,
        extra: Item,
    ) -> Result<Created, StoreError> {
        use attr::*;
        let mut item: Item = [
            (PK, s(task.task_ref.as_ref())),
            (KIND, s(task.kind.as_str())),
            (STATE, s(task.state.name())),
            (CREATED_AT, n(task.created_at.as_millis())),
            (EXPIRES_TTL, self.ttl(task.created_at)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        if let Some(deadline) = deadline {
            item.insert(POLL_SHARD.to_owned(), n(u64::from(self.shards.of(&task.task_ref))));
            item.insert(POLL_DUE_AT.to_owned(), n(deadline.as_millis()));
        }
        item.extend(extra);
        if let Some(owner) = &task.owner {
            item.insert(OWNER.to_owned(), s(owner));
        }
        if let Some(fp) = fingerprint {
            item.insert(IDEM_FINGERPRINT.to_owned(), s(fp));
        }
        if let Some(url) = &task.owner_callback {
            item.insert(OWNER_CALLBACK.to_owned(), s(url));
            item.insert(DLV_SHARD.to_owned(), n(u64::from(self.shards.of(&task.task_ref))));
            item.insert(
                WEBHOOK_OWNER.to_owned(),
                s(task.webhook_owner.as_deref().unwrap_or(deliveries::DEFAULT_OWNER)),
            );
            if task.pingback_form != crate::domain::PingbackForm::Get {
                item.insert(PINGBACK_FORM.to_owned(), s(task.pingback_form.as_str()));
            }
        }
        let res = self
            .client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        use aws_sdk_dynamodb::operation::put_item::PutItemError;
        let e = match res {
            Ok(_) => return Ok(Created::New),
            Err(e) => e,
        };
        let refused = match &e {
            SdkError::ServiceError(se) => match se.err() {
                PutItemError::ConditionalCheckFailedException(c) => Some(c.item.clone().unwrap_or_default()),
                _ => None,
            },
            _ => None,
        };
        let Some(old) = refused else { return Err(sdk_error(e)) };
        if old.is_empty() {
            return Err(StoreError::Corrupt(format!("task {} exists but was not returned", task.task_ref)));
        }
        Ok(Created::Existing {
            task: Task::try_from(&old)?,
            fingerprint: get_s(&old, IDEM_FINGERPRINT)?.map(str::to_owned),
        })
    }

    /// Deletes a task that in.php never accepted (still submitting, no id, no unknown outcome),
    /// freeing its idempotency key. `false` if it is no longer such a task.
    pub async fn forget_unsent(&self, task_ref: &TaskRef) -> Result<bool, StoreError> {
        let res = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;
        match res {
            Ok(_) => Ok(true),
            Err(SdkError::ServiceError(se))
                if matches!(se.err(), DeleteItemError::ConditionalCheckFailedException(_)) =>
            {
                Ok(false)
            }
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// In.php was called but its answer does not say whether it took the task: the task stays
    /// submitting, marked unknown with the reason (never failed; sent again at most once, by the poller, when its result is overdue).
    pub async fn mark_submit_unknown(&self, task_ref: &TaskRef, detail: &str) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("SET submit_unknown = :d")
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":d", s(detail))
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        condition_held(res)
    }

    /// In.php accepted the task: submitting → pending, due for a poll at `poll_due_at`.
    pub async fn mark_submitted(
        &self,
        task_ref: &TaskRef,
        id: &CaptchaId,
        now: Timestamp,
        poll_due_at: Timestamp,
    ) -> Result<SubmitRecorded, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :pending, captcha_id = :id, submitted_at = :now, poll_due_at = :due \
                 REMOVE submit_unknown, sq_req, sq_pingback",
            )
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":id", s(id.as_ref()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":due", n(poll_due_at.as_millis()))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => Ok(SubmitRecorded::Pending(decode(out.attributes.as_ref())?)),
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => Ok(SubmitRecorded::AlreadyResolved(Task::try_from(old)?)),
                Some(None) => Err(StoreError::Rejected(format!("task {task_ref} does not exist"))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// In.php refused the task: submitting → failed. Returns the task as stored; if it had
    /// already left submitting (a callback came first), that state is kept and returned.
    pub async fn mark_submit_failed(
        &self,
        task_ref: &TaskRef,
        code: &str,
        detail: &str,
        now: Timestamp,
    ) -> Result<Task, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :failed, error_code = :code, error_detail = :detail, resolved_at = :now, \
                 resolved_via = :via, expires_ttl = :ttl REMOVE poll_due_at, poll_shard, sq_key, sq_at, sq_req, sq_pingback",
            )
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":code", s(code))
            .expression_attribute_values(":detail", s(detail))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":via", s(Via::Submit.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => decode(out.attributes.as_ref()),
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => Task::try_from(old),
                Some(None) => Err(StoreError::Rejected(format!("task {task_ref} does not exist"))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Records a delivered result with ONE conditional write. Applied exactly once however
    /// many times, and by however many paths, it is delivered. A task takes a result while it is
    /// open, when its submit was reported failed (the result proves in.php accepted it), and when
    /// it was expired after the result was received. The first *received* result wins, not the
    /// first stored: until the owner has been shown a result, one received earlier replaces it
    /// (a pingback that failed to store and came back through the dead-letter queue after a
    /// conflicting one), and an earlier receipt of the same result moves its receipt time back.
    /// A result that arrives after the expiry is kept on the task as its late result (a second
    /// conditional write, only in that case). The rare transitions (a replacement, an earlier
    /// receipt, a result after a failed submit or for an expired task) also take a second write:
    /// the first, with a short condition, is for an open task, which nearly every result finds.
    pub async fn record_result(&self, task_ref: &TaskRef, d: &Delivery) -> Result<RecordOutcome, StoreError> {
        // The common case first: the task is open. Its condition is short, so the engine has
        // little to parse and evaluate. A refusal returns the item, and every other transition
        // the state machine allows (a replacement, an earlier receipt, a result after a failed
        // submit or for an expired task received before the expiry) is written again under the
        // full condition. Both are single conditional writes: exactly-once holds for each.
        let open = self
            .result_write(task_ref, d)
            .condition_expression(
                "#state IN (:submitting, :pending, :queued) AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at))",
            )
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":queued", s("queued"));
        match open.send().await {
            Ok(out) => self.written(task_ref, out, d),
            Err(e) => match refused_item(&e) {
                Some(None) => Ok(RecordOutcome::NotFound),
                Some(Some(old)) => {
                    let old = Task::try_from(old)?;
                    match old.clone().apply(d.clone()) {
                        Ok(Applied::Recorded(_) | Applied::Replaced(_) | Applied::Earlier(_)) => {
                            self.record_result_full(task_ref, d).await
                        }
                        _ => self.classify_refused(task_ref, old, d).await,
                    }
                }
                None => Err(sdk_error(e)),
            },
        }
    }

    /// The result write under the full condition: every transition the state machine allows.
    async fn record_result_full(&self, task_ref: &TaskRef, d: &Delivery) -> Result<RecordOutcome, StoreError> {
        let req = self
            .result_write(task_ref, d)
            .condition_expression(
                "attribute_exists(pk) AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at)) AND ( \
                 #state IN (:submitting, :pending, :queued) \
                 OR (#state = :failed AND resolved_via = :submit) \
                 OR (#state = :expired AND resolved_at >= :at) \
                 OR (#state IN (:solved, :failed) AND resolved_at > :at AND attribute_not_exists(handed_out_at)))",
            )
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":solved", s("solved"))
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":submit", s(Via::Submit.as_str()));
        match req.send().await {
            Ok(out) => self.written(task_ref, out, d),
            Err(e) => match refused_item(&e) {
                Some(None) => Ok(RecordOutcome::NotFound),
                Some(Some(old)) => self.classify_refused(task_ref, Task::try_from(old)?, d).await,
                None => Err(sdk_error(e)),
            },
        }
    }

    /// What a result write that went through amounted to, from the item it replaced.
    fn written(
        &self,
        task_ref: &TaskRef,
        out: aws_sdk_dynamodb::operation::update_item::UpdateItemOutput,
        d: &Delivery,
    ) -> Result<RecordOutcome, StoreError> {
        let applied = decode(out.attributes.as_ref())?.apply(d.clone());
        if let Ok(Applied::Recorded(task) | Applied::Replaced(task) | Applied::Earlier(task)) = &applied {
            self.push_due(task, d.received_at);
        }
        if let (Some(n), Ok(Applied::Recorded(_))) = (&self.results, &applied) {
            n.notify_one();
        }
        match applied {
            Ok(Applied::Recorded(task)) => Ok(RecordOutcome::Recorded(task)),
            Ok(Applied::Replaced(task)) => Ok(RecordOutcome::Replaced(task)),
            Ok(Applied::Earlier(task)) => Ok(RecordOutcome::Duplicate(task)),
            other => {
                Err(StoreError::Corrupt(format!("task {task_ref} took a result the state machine refuses ({other:?})")))
            }
        }
    }

    /// A result write without its condition: the update, its values (`:id` and `:at` included,
    /// which both conditions use), and the old item returned either way.
    fn result_write(&self, task_ref: &TaskRef, d: &Delivery) -> UpdateItemFluentBuilder {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":id", s(d.captcha_id.as_ref()))
            .expression_attribute_values(":at", n(d.received_at.as_millis()))
            .expression_attribute_values(":via", s(d.via.as_str()))
            .expression_attribute_values(":ttl", self.ttl(d.received_at))
            .return_values(ReturnValue::AllOld)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        req = delivery_due(req, d.received_at);
        const COMMON: &str = "captcha_id = :id, resolved_at = :at, resolved_via = :via, expires_ttl = :ttl";
        const CLEAR: &str = "REMOVE poll_due_at, poll_shard, lease_owner, error_detail, submit_unknown, sq_key, sq_at, \
                             sq_req, sq_pingback";
        match &d.outcome {
            Outcome::Solved(solution) => {
                // The user agent the answer names; without one, the one the task was submitted
                // with (kept on the item since) is the one the token was earned with.
                let ua_set = match solution.user_agent() {
                    Some(ua) => {
                        req = req.expression_attribute_values(":ua", s(ua));
                        ", user_agent = :ua"
                    }
                    None => "",
                };
                req.update_expression(format!(
                    "SET #state = :solvedstate, solution = :solution, token_clock_start = :clock{ua_set}, {COMMON}, \
                     {DELIVERY_DUE} {CLEAR}, {DELIVERY_CLEAR}, error_code"
                ))
                .expression_attribute_values(":solvedstate", s("solved"))
                .expression_attribute_values(":solution", s(solution.expose()))
                .expression_attribute_values(":clock", n(d.token_clock_start.as_millis()))
            }
            Outcome::Failed(code) => req
                // A verdict received earlier can replace a solution: no token stays on a failed task.
                .update_expression(format!(
                    "SET #state = :failedstate, error_code = :code, {COMMON}, {DELIVERY_DUE} \
                     {CLEAR}, {DELIVERY_CLEAR}, solution, token_clock_start"
                ))
                .expression_attribute_values(":failedstate", s("failed"))
                .expression_attribute_values(":code", s(code.as_ref())),
        }
    }

    /// Says why a result write was refused, from the old item; keeps a late result.
    async fn classify_refused(&self, task_ref: &TaskRef, old: Task, d: &Delivery) -> Result<RecordOutcome, StoreError> {
        match old.clone().apply(d.clone()) {
            Ok(Applied::Duplicate) => Ok(RecordOutcome::Duplicate(old)),
            Ok(Applied::Conflict) => Ok(RecordOutcome::Conflict(old)),
            Ok(Applied::Late(task)) => self.keep_late(task_ref, task, d).await,
            Err(TransitionError::IdMismatch { expected, .. }) => Ok(RecordOutcome::IdMismatch { expected }),
            // The condition and the state machine disagree: the item is not what this code
            // writes. Say so rather than guess.
            Ok(Applied::Recorded(_) | Applied::Replaced(_) | Applied::Earlier(_))
            | Err(TransitionError::NotAllowed { .. }) => Err(StoreError::Corrupt(format!(
                "task {task_ref} refused a result the state machine allows (state {})",
                old.state.name()
            ))),
        }
    }

    /// Keeps a result that came after the task was expired, once.
    async fn keep_late(&self, task_ref: &TaskRef, task: Task, d: &Delivery) -> Result<RecordOutcome, StoreError> {
        let code = match &d.outcome {
            Outcome::Solved(sol) => sol.expose().to_owned(),
            Outcome::Failed(c) => c.as_ref().to_owned(),
        };
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!(
                "SET late_code = :code, late_at = :at, late_via = :via, late_clock = :clock, \
                 captcha_id = :id, {DELIVERY_DUE} REMOVE {DELIVERY_CLEAR}"
            ))
            // The id, as the state machine keeps it: a task that expired before in.php's answer
            // came learns its id from the result (one it had is the same: a mismatch is refused
            // before this).
            .condition_expression(
                "#state = :expired AND attribute_not_exists(late_code) AND resolved_at < :at \
                 AND (attribute_not_exists(captcha_id) OR captcha_id = :id OR attribute_exists(resent_at))",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":code", s(&code))
            .expression_attribute_values(":at", n(d.received_at.as_millis()))
            .expression_attribute_values(":via", s(d.via.as_str()))
            .expression_attribute_values(":clock", n(d.token_clock_start.as_millis()))
            .expression_attribute_values(":id", s(d.captcha_id.as_ref()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        let res = delivery_due(res, d.received_at).send().await;
        match res {
            Ok(_) => {
                self.push_due(&task, d.received_at);
                Ok(RecordOutcome::Late(task))
            }
            // Another late result won the race: classify against it.
            Err(e) => match refused_item(&e) {
                Some(Some(old)) => {
                    let old = Task::try_from(old)?;
                    match old.clone().apply(d.clone()) {
                        Ok(Applied::Duplicate) => Ok(RecordOutcome::Duplicate(old)),
                        _ => Ok(RecordOutcome::Conflict(old)),
                    }
                }
                Some(None) => Ok(RecordOutcome::NotFound),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Pins the result `shown` is about to show its owner: from then on it never changes. One
    /// conditional write, made once per task (by the first read that shows a result). `Ok(None)`:
    /// pinned as shown. `Ok(Some(task))`: the item changed since it was read (a replacement, an
    /// earlier receipt, or another read pinned it first); show that instead, pinning it if it
    /// still [`Task::needs_pin`].
    pub async fn mark_handed_out(&self, shown: &Task, now: Timestamp) -> Result<Option<Task>, StoreError> {
        let resolved_at = match &shown.state {
            TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } => *resolved_at,
            other => return Err(StoreError::Rejected(format!("a {} task has no result to pin", other.name()))),
        };
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(shown.task_ref.as_ref()))
            .update_expression("SET handed_out_at = :now")
            .condition_expression("#state = :state AND resolved_at = :at AND attribute_not_exists(handed_out_at)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":state", s(shown.state.name()))
            .expression_attribute_values(":at", n(resolved_at.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(_) => Ok(None),
            Err(e) => match refused_item(&e) {
                Some(Some(current)) => Ok(Some(Task::try_from(current)?)),
                Some(None) => Err(StoreError::Rejected(format!("task {} does not exist", shown.task_ref))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// One page of tasks due for a poll at `now` in one index shard (a Query, never a Scan).
    pub async fn due_page(
        &self,
        shard: u8,
        now: Timestamp,
        limit: i32,
        start: Option<HashMap<String, AttributeValue>>,
    ) -> Result<DuePage, StoreError> {
        let out = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(DUE_INDEX)
            .key_condition_expression("poll_shard = :shard AND poll_due_at <= :now")
            .expression_attribute_values(":shard", n(u64::from(shard)))
            .expression_attribute_values(":now", n(now.as_millis()))
            .limit(limit)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(sdk_error)?;
        let tasks = out.items().iter().map(DueTask::try_from).collect::<Result<Vec<_>, _>>()?;
        Ok(DuePage { tasks, next: out.last_evaluated_key.filter(|k| !k.is_empty()) })
    }

    /// Claims a due task for one poller until `lease_until`: its `poll_due_at` moves to the
    /// lease's end, so it leaves the due list, and comes back by itself if the poller dies.
    /// Conditional on the listing being current, so two pollers never both win. With `read`, the
    /// claim also counts the res.php read it is for — before the read is made, so a read by a
    /// poller that is killed mid-way still counts against the task's budget.
    pub async fn claim(
        &self,
        due: &DueTask,
        owner: &str,
        lease_until: Timestamp,
        read: bool,
    ) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(due.task.task_ref.as_ref()))
            .update_expression(
                "SET poll_due_at = :lease, lease_owner = :owner, poll_reads = if_not_exists(poll_reads, :zero) + :r",
            )
            .condition_expression("poll_due_at = :seen AND #state IN (:submitting, :pending)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":lease", n(lease_until.as_millis()))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":seen", n(due.due_at.as_millis()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":r", n(u64::from(read)))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .send()
            .await;
        condition_held(res)
    }

    /// Puts a claimed, still open task back on the due list at `next_due` and ends the lease.
    /// `unread`: the claim counted a read that was never made (the poller stopped first), so it
    /// is taken back. Conditional on still holding the lease; `false` if another path resolved
    /// the task meanwhile.
    pub async fn reschedule(&self, task_ref: &TaskRef, owner: &str, r: Reschedule) -> Result<bool, StoreError> {
        let mut set = vec![
            "poll_due_at = :next",
            "poll_unknown = if_not_exists(poll_unknown, :zero) + :u",
            "poll_reads = if_not_exists(poll_reads, :zero) - :unread",
        ];
        if r.not_ready_at.is_some() {
            set.push("last_not_ready_at = :nr");
        }
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!("SET {} REMOVE lease_owner", set.join(", ")))
            .condition_expression("lease_owner = :owner AND #state IN (:submitting, :pending)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":next", n(r.next_due.as_millis()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":u", n(u64::from(r.unknown_code)))
            .expression_attribute_values(":unread", n(u64::from(r.unread)))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"));
        if let Some(t) = r.not_ready_at {
            req = req.expression_attribute_values(":nr", n(t.as_millis()));
        }
        condition_held(req.send().await)
    }

    /// Ends an open task that got no result in time: → expired. Never under another poller's
    /// live lease: only if the task is not leased (its `poll_due_at` has come) or `owner` holds
    /// the lease. `false` if it was resolved, or is leased by someone else.
    pub async fn expire(
        &self,
        task_ref: &TaskRef,
        reason: &str,
        now: Timestamp,
        owner: &str,
    ) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!(
                "SET #state = :expired, error_detail = :reason, resolved_at = :now, resolved_via = :via, \
                 expires_ttl = :ttl, {DELIVERY_DUE} REMOVE {UNSENT_CLEAR}, {DELIVERY_CLEAR}"
            ))
            .condition_expression("#state IN (:submitting, :pending) AND (poll_due_at <= :now OR lease_owner = :owner)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":reason", s(reason))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":via", s(Via::Deadline.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .return_values(ReturnValue::AllOld);
        match delivery_due(res, now).send().await {
            Ok(out) => {
                if self.pushes.is_some()
                    && let Some(old) = out.attributes.as_ref()
                    && old.contains_key(attr::OWNER_CALLBACK)
                    && let Ok(task) = Task::try_from(old)
                {
                    self.push_due(&task, now);
                }
                Ok(true)
            }
            Err(e) if refused_item(&e).is_some() => Ok(false),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// How many entries each shard of the due-for-poll and the due-for-delivery index holds,
    /// for shards `0..upto` (`(shard, poll entries, delivery entries)`): what an operator lowering
    /// `POLL_SHARDS` waits on before clearing `POLL_SHARDS_PREVIOUS` (`relay-ops shards`).
    pub async fn shard_entries(&self, upto: u8) -> Result<Vec<(u8, u64, u64)>, StoreError> {
        let count = |index: &'static str, key: &'static str, shard: u8| async move {
            let mut total = 0u64;
            let mut start: Option<PageKey> = None;
            loop {
                let out = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(index)
                    .key_condition_expression("#k = :shard")
                    .expression_attribute_names("#k", key)
                    .expression_attribute_values(":shard", n(u64::from(shard)))
                    .select(aws_sdk_dynamodb::types::Select::Count)
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .map_err(sdk_error)?;
                total += u64::try_from(out.count).unwrap_or(0);
                match out.last_evaluated_key.filter(|k| !k.is_empty()) {
                    Some(k) => start = Some(k),
                    None => return Ok::<_, StoreError>(total),
                }
            }
        };
        let mut out = Vec::new();
        for shard in 0..upto {
            let (p, d) =
                tokio::join!(count(DUE_INDEX, attr::POLL_SHARD, shard), count(DELIVERY_INDEX, attr::DLV_SHARD, shard));
            out.push((shard, p?, d?));
        }
        Ok(out)
    }

    /// The earliest `poll_due_at` after `now` across the index's shards: when the poller will
    /// next have work (leases included: a lapsing lease is work). One small Query per shard.
    pub async fn next_due_after(&self, now: Timestamp) -> Result<Option<Timestamp>, StoreError> {
        // The shards at once: an idle tick's time is these round trips.
        let queries = (0..self.shards.read()).map(|shard| {
            self.client
                .query()
                .table_name(&self.table)
                .index_name(DUE_INDEX)
                .key_condition_expression("poll_shard = :shard AND poll_due_at > :now")
                .expression_attribute_values(":shard", n(u64::from(shard)))
                .expression_attribute_values(":now", n(now.as_millis()))
                .projection_expression("poll_due_at")
                .limit(1)
                .send()
        });
        let mut next: Option<Timestamp> = None;
        for out in futures_util::future::join_all(queries).await {
            let out = out.map_err(sdk_error)?;
            if let Some(t) = out.items().first().map(|i| req_ts(i, attr::POLL_DUE_AT)).transpose()? {
                next = Some(next.map_or(t, |n| n.min(t)));
            }
        }
        Ok(next)
    }

    /// Takes one of the in.php submits allowed in the current second, account-wide: CaptchaAI
    /// bans more than 60 submits in 3 s (`MAX_USER_TURN`), and with at most `per_second` in each
    /// whole second, any 3 s (which touches at most 4 of them) holds at most 4 × `per_second`.
    /// One conditional counter per second (deleted by TTL a minute later). `false`: none left.
    pub async fn take_submit_slot(&self, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        self.take_slot("pacer", now, per_second).await
    }

    /// Takes one of the res.php reads allowed in the current second, account-wide: the poller's
    /// rate holds across every invocation (overlapping schedules, a manual run, Lambda's retry
    /// of one), as [`Self::take_submit_slot`] does for in.php.
    pub async fn take_read_slot(&self, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        self.take_slot("respacer", now, per_second).await
    }

    async fn take_slot(&self, prefix: &str, now: Timestamp, per_second: u32) -> Result<bool, StoreError> {
        let second = now.as_secs();
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(&format!("{prefix}#{second}")))
            .update_expression("ADD submits :one SET expires_ttl = :ttl")
            .condition_expression("attribute_not_exists(submits) OR submits < :limit")
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":limit", n(u64::from(per_second)))
            .expression_attribute_values(":ttl", n(second + 60))
            .send()
            .await;
        condition_held(res)
    }

    /// The account-wide CaptchaAI breaker, as every function sees it (strongly consistent).
    pub async fn breaker(&self) -> Result<Breaker, StoreError> {
        Ok(self.submit_state().await?.breaker)
    }

    /// Remembers that res.php does not take batch reads (`ids=`), for every poller from now on.
    pub async fn mark_batch_unsupported(&self, now: Timestamp) -> Result<(), StoreError> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("SET batch_unsupported_at = if_not_exists(batch_unsupported_at, :now)")
            .expression_attribute_values(":now", n(now.as_millis()))
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }

    /// Opens (or extends, never shortens) the breaker until `until`. `true` if this call opened
    /// or extended it, `false` if it was already open at least that long. A [`Stop::NoAnswers`]
    /// opening (res.php not answering) never replaces a ban in force.
    pub async fn open_breaker(
        &self,
        until: Timestamp,
        reason: &str,
        stop: Stop,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let (needs_operator, res_php_only, submits_only, condition) = match stop {
            Stop::Ban { needs_operator } => {
                // A ban replaces a pause for missing answers whatever its length: it also stops submits.
                (
                    needs_operator,
                    false,
                    false,
                    "attribute_not_exists(open_until) OR open_until < :until OR res_php_only = :t OR submits_only = :t",
                )
            }
            Stop::NoAnswers => (
                false,
                true,
                false,
                "attribute_not_exists(open_until) OR open_until <= :now OR (res_php_only = :t AND open_until < :until)",
            ),
            // Never over a ban (which stops reads too).
            Stop::PlanOut => (
                true,
                false,
                true,
                "attribute_not_exists(open_until) OR open_until <= :now OR res_php_only = :t \
                 OR (submits_only = :t AND open_until < :until)",
            ),
        };
        let req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression(
                "SET open_until = :until, reason = :reason, opened_at = :now, needs_operator = :op, \
                 res_php_only = :scope, submits_only = :so, opened_count = if_not_exists(opened_count, :zero) + :one",
            )
            .condition_expression(condition)
            .expression_attribute_values(":until", n(until.as_millis()))
            .expression_attribute_values(":reason", s(reason))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":op", AttributeValue::Bool(needs_operator))
            .expression_attribute_values(":scope", AttributeValue::Bool(res_php_only))
            .expression_attribute_values(":so", AttributeValue::Bool(submits_only))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":t", AttributeValue::Bool(true));
        condition_held(req.send().await)
    }

    /// Closes the breaker now (an operator fixed the key, or a ban is known to be over).
    pub async fn close_breaker(&self) -> Result<(), StoreError> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("REMOVE open_until, needs_operator")
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }

    /// Reads a task (strongly consistent).
    pub async fn get(&self, task_ref: &TaskRef) -> Result<Option<Task>, StoreError> {
        self.get_item(task_ref).await?.as_ref().map(Task::try_from).transpose()
    }

    /// A task's item as stored (strongly consistent).
    async fn get_item(&self, task_ref: &TaskRef) -> Result<Option<Item>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(out.item)
    }

    /// Opens the connection to DynamoDB at cold start, so the first request finds it pooled
    /// ([`crate::warm`]): one DescribeEndpoints call, which reads no table (no capacity) and
    /// which DynamoDB's public endpoints answer without an IAM check, so every function's role
    /// may make it (the callback's and the redrive's allow only UpdateItem). Never fails.
    pub async fn warm_up(&self, limit: Duration) -> crate::warm::Warmed {
        crate::warm::run("dynamodb", limit, self.client.describe_endpoints().send()).await
    }
}

/// `true` if a conditional update was applied, `false` if its condition did not hold.
fn condition_held<O, R: std::fmt::Debug>(
    res: Result<O, SdkError<aws_sdk_dynamodb::operation::update_item::UpdateItemError, R>>,
) -> Result<bool, StoreError> {
    match res {
        Ok(_) => Ok(true),
        Err(e) if refused_item(&e).is_some() => Ok(false),
        Err(e) => Err(sdk_error(e)),
    }
}

fn decode(item: Option<&Item>) -> Result<Task, StoreError> {
    Task::try_from(item.ok_or_else(|| StoreError::Corrupt("write returned no attributes".into()))?)
}

/// For a refused conditional write: `Some(old item or None if there was none)`. `None` if the
/// error is anything else.
fn refused_item<R>(
    err: &SdkError<aws_sdk_dynamodb::operation::update_item::UpdateItemError, R>,
) -> Option<Option<&Item>> {
    use aws_sdk_dynamodb::operation::update_item::UpdateItemError;
    match err {
        SdkError::ServiceError(se) => match se.err() {
            UpdateItemError::ConditionalCheckFailedException(c) => Some(c.item.as_ref().filter(|i| !i.is_empty())),
            _ => None,
        },
        _ => None,
    }
}

/// The table's shape, as `template.yaml` declares it, for tests and local mode.
pub mod schema {
    use aws_sdk_dynamodb::types::{
        AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection, ProjectionType,
        ScalarAttributeType, TimeToLiveSpecification,
    };

    use super::{Client, DELIVERY_INDEX, DUE_INDEX, QUEUE_INDEX, StoreError, attr, sdk_error};

    /// The table's sparse indexes: name, hash key and its type, range key (a number),
    /// projection.
    fn indexes() -> [(&'static str, (&'static str, ScalarAttributeType), &'static str, ProjectionType); 3] {
        use ScalarAttributeType::{N, S};
        [
            (DUE_INDEX, (attr::POLL_SHARD, N), attr::POLL_DUE_AT, ProjectionType::All),
            (DELIVERY_INDEX, (attr::DLV_SHARD, N), attr::DLV_DUE, ProjectionType::KeysOnly),
            (QUEUE_INDEX, (attr::SQ_KEY, S), attr::SQ_AT, ProjectionType::KeysOnly),
        ]
    }

    fn gsi(
        name: &str,
        hash: &str,
        range: &str,
        projection: ProjectionType,
    ) -> Result<GlobalSecondaryIndex, StoreError> {
        GlobalSecondaryIndex::builder()
            .index_name(name)
            .key_schema(key(hash, KeyType::Hash)?)
            .key_schema(key(range, KeyType::Range)?)
            .projection(Projection::builder().projection_type(projection).build())
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))
    }

    /// Adds the indexes a table made by an earlier version lacks (local mode's data directory
    /// outlives upgrades). One UpdateTable per missing index.
    pub async fn migrate(client: &Client, table: &str) -> Result<Vec<&'static str>, StoreError> {
        let out = client.describe_table().table_name(table).send().await.map_err(sdk_error)?;
        let have: Vec<String> = out
            .table
            .and_then(|t| t.global_secondary_indexes)
            .unwrap_or_default()
            .into_iter()
            .filter_map(|i| i.index_name)
            .collect();
        let mut added = Vec::new();
        for (index, (hash, hash_type), range, projection) in indexes() {
            if have.iter().any(|h| h == index) {
                continue;
            }
            let create = aws_sdk_dynamodb::types::CreateGlobalSecondaryIndexAction::builder()
                .index_name(index)
                .key_schema(key(hash, KeyType::Hash)?)
                .key_schema(key(range, KeyType::Range)?)
                .projection(Projection::builder().projection_type(projection).build())
                .build()
                .map_err(|e| StoreError::Rejected(e.to_string()))?;
            client
                .update_table()
                .table_name(table)
                .attribute_definitions(def(hash, hash_type)?)
                .attribute_definitions(def(range, ScalarAttributeType::N)?)
                .global_secondary_index_updates(
                    aws_sdk_dynamodb::types::GlobalSecondaryIndexUpdate::builder().create(create).build(),
                )
                .send()
                .await
                .map_err(sdk_error)?;
            added.push(index);
        }
        Ok(added)
    }

    fn key(name: &str, t: KeyType) -> Result<KeySchemaElement, StoreError> {
        KeySchemaElement::builder()
            .attribute_name(name)
            .key_type(t)
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))
    }

    fn def(name: &str, t: ScalarAttributeType) -> Result<AttributeDefinition, StoreError> {
        AttributeDefinition::builder()
            .attribute_name(name)
            .attribute_type(t)
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))
    }

    /// Creates the task table with its indexes and TTL.
    pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
        let mut req = client
            .create_table()
            .table_name(table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(def(attr::PK, ScalarAttributeType::S)?)
            .key_schema(key(attr::PK, KeyType::Hash)?);
        for (index, (hash, hash_type), range, projection) in indexes() {
            req = req
                .attribute_definitions(def(hash, hash_type)?)
                .attribute_definitions(def(range, ScalarAttributeType::N)?)
                .global_secondary_indexes(gsi(index, hash, range, projection)?);
        }
        req.send().await.map_err(sdk_error)?;
        client
            .update_time_to_live()
            .table_name(table)
            .time_to_live_specification(
                TimeToLiveSpecification::builder()
                    .enabled(true)
                    .attribute_name(attr::EXPIRES_TTL)
                    .build()
                    .map_err(|e| StoreError::Rejected(e.to_string()))?,
            )
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::Solution;
    use crate::testkit::LocalDynamo;

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn id(v: &str) -> CaptchaId {
        CaptchaId::parse(v).expect("id")
    }

    fn delivery(captcha: &str, outcome: Outcome, at: u64) -> Delivery {
        Delivery { captcha_id: id(captcha), outcome, received_at: t(at), via: Via::Callback, token_clock_start: t(at) }
    }

    fn solved(token: &str) -> Outcome {
        Outcome::Solved(Solution::parse(token).expect("token"))
    }

    /// A running engine and a store on a new table. Keep the engine alive for the test.
    async fn engine() -> anyhow::Result<(LocalDynamo, TaskStore)> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        Ok((db, store))
    }

    /// A task just recorded (submitting), created at t=1 s with its deadline at t=600 s.
    async fn submitting(store: &TaskStore, kind: CaptchaKind) -> Task {
        let task = Task::new(TaskRef::generate(), kind, t(1_000));
        assert_eq!(store.create(&task, t(600_000), None).await.expect("create"), Created::New);
        task
    }

    async fn pending(store: &TaskStore, kind: CaptchaKind) -> Task {
        let task = submitting(store, kind).await;
        match store.mark_submitted(&task.task_ref, &id("42"), t(2_000), t(122_000)).await.expect("submit") {
            SubmitRecorded::Pending(task) => task,
            other => panic!("expected pending, got {other:?}"),
        }
    }

    async fn raw(store: &TaskStore, r: &TaskRef) -> Item {
        store
            .client
            .get_item()
            .table_name(store.table())
            .key(attr::PK, s(r.as_ref()))
            .send()
            .await
            .expect("get")
            .item
            .expect("exists")
    }

    async fn due_refs(store: &TaskStore, now: u64) -> Vec<String> {
        let mut refs = Vec::new();
        for shard in 0..store.shards().read() {
            let out = store
                .client
                .query()
                .table_name(store.table())
                .index_name(DUE_INDEX)
                .key_condition_expression("poll_shard = :s AND poll_due_at <= :now")
                .expression_attribute_values(":s", n(u64::from(shard)))
                .expression_attribute_values(":now", n(now))
                .send()
                .await
                .expect("query");
            refs.extend(out.items().iter().filter_map(|i| get_s(i, attr::PK).ok().flatten().map(str::to_owned)));
        }
        refs
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn lowering_the_shard_count_loses_no_due_task_while_the_previous_count_is_read() -> anyhow::Result<()> {
        let (_db, base) = engine().await?;
        let wide = base.clone().with_shards(Shards { write: 16, previous: 0 });
        let mut made = Vec::new();
        for _ in 0..48 {
            made.push(pending(&wide, CaptchaKind::Image).await.task_ref.to_string());
        }
        made.sort();
        let high = made.iter().filter(|r| TaskRef::parse(r).expect("ref").shard(16) >= 4).count();
        assert!(high > 0, "some tasks sit above shard 3");
        // Lowered to 4 with the old count still read: every due task is seen.
        let lowering = base.clone().with_shards(Shards { write: 4, previous: 16 });
        let mut seen = due_refs(&lowering, 200_000).await;
        seen.sort();
        assert_eq!(seen, made);
        // Without it, the tasks above the new count would stall: what `previous` is for.
        let forgot = base.clone().with_shards(Shards { write: 4, previous: 0 });
        assert_eq!(due_refs(&forgot, 200_000).await.len(), made.len() - high);
        // The operator's view: entries at or above the new count, until they end.
        let entries = lowering.shard_entries(16).await?;
        let above: u64 = entries.iter().filter(|(s, ..)| *s >= 4).map(|(_, p, _)| p).sum();
        assert_eq!(above, high as u64);
        // A new task goes to the new count's shards.
        let new = pending(&lowering, CaptchaKind::Image).await;
        assert!(lowering.shard_entries(16).await?.iter().any(|(s, p, _)| *s == new.task_ref.shard(4) && *p > 0));
        assert!(new.task_ref.shard(4) < 4);
        Ok(())
    }

    #[test]
    fn generated_references_fill_every_shard_evenly() {
        for shards in [4u8, 8, 16, 64] {
            let mut counts = vec![0u32; usize::from(shards)];
            for _ in 0..6_400 {
                counts[usize::from(TaskRef::generate().shard(shards))] += 1;
            }
            let expected = 6_400 / u32::from(shards);
            assert!(counts.iter().all(|c| *c > expected / 2 && *c < expected * 2), "{shards} shards: {counts:?}");
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_task_is_created_submitted_and_read_back() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = submitting(&store, CaptchaKind::Turnstile).await;
        assert_eq!(store.get(&task.task_ref).await?, Some(task.clone()));
        assert_eq!(
            store.create(&task, t(1), Some("fp")).await?,
            Created::Existing { task: task.clone(), fingerprint: None },
            "a reference is never created twice: the existing task comes back, nothing is written"
        );
        // With an idempotency fingerprint, it comes back with the task.
        let keyed = Task::new(TaskRef::generate(), CaptchaKind::Image, t(5));
        assert_eq!(store.create(&keyed, t(9), Some("fp-1")).await?, Created::New);
        assert_eq!(
            store.create(&Task::new(keyed.task_ref.clone(), CaptchaKind::Image, t(7)), t(9), Some("fp-2")).await?,
            Created::Existing { task: keyed.clone(), fingerprint: Some("fp-1".into()) }
        );
        // An unknown submit outcome is kept on the task until the id or a result arrives.
        assert!(store.mark_submit_unknown(&keyed.task_ref, "in.php answered HTTP 502").await?);
        assert_eq!(
            store.get(&keyed.task_ref).await?.map(|t| t.state),
            Some(TaskState::Submitting { unknown: Some("in.php answered HTTP 502".into()) })
        );
        store.mark_submitted(&keyed.task_ref, &id("43"), t(8), t(30)).await?;
        assert_eq!(store.get(&keyed.task_ref).await?.map(|t| t.state), Some(TaskState::Pending { submitted_at: t(8) }));
        let SubmitRecorded::Pending(p) = store.mark_submitted(&task.task_ref, &id("42"), t(2_000), t(122_000)).await?
        else {
            panic!("pending expected")
        };
        assert_eq!(p.state, TaskState::Pending { submitted_at: t(2_000) });
        assert_eq!(store.get(&task.task_ref).await?, Some(p));
        let item = raw(&store, &task.task_ref).await;
        assert_eq!(item.get(attr::POLL_DUE_AT), Some(&n(122_000)));
        assert_eq!(item.get(attr::EXPIRES_TTL), Some(&n(1 + 7 * 86_400)), "TTL = created + 7 days, in seconds");
        assert_eq!(store.get(&TaskRef::generate()).await?, None);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn first_result_is_written_and_repeats_are_classified_without_writing() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::RecaptchaV2).await;
        let r = &task.task_ref;

        let RecordOutcome::Recorded(done) = store.record_result(r, &delivery("42", solved("tok-1"), 5_000)).await?
        else {
            panic!("first result must be recorded")
        };
        assert!(
            matches!(&done.state, TaskState::Solved { solution, via: Via::Callback, .. } if solution.expose() == "tok-1")
        );
        let before = raw(&store, r).await;
        assert!(
            !before.contains_key(attr::POLL_DUE_AT) && !before.contains_key(attr::POLL_SHARD),
            "resolved tasks leave the index"
        );

        assert!(matches!(
            store.record_result(r, &delivery("42", solved("tok-1"), 6_000)).await?,
            RecordOutcome::Duplicate(_)
        ));
        assert!(matches!(
            store.record_result(r, &delivery("42", solved("tok-2"), 6_000)).await?,
            RecordOutcome::Conflict(_)
        ));
        let failed = Outcome::Failed(ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE")?);
        assert!(matches!(store.record_result(r, &delivery("42", failed, 6_000)).await?, RecordOutcome::Conflict(_)));
        assert_eq!(raw(&store, r).await, before, "nothing was written by the repeats");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn an_earlier_received_result_replaces_a_later_one_until_it_is_handed_out() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Turnstile).await;
        let r = &task.task_ref;
        // The real pingback A (received at 5 s) failed to store and went to the dead-letter
        // queue; a conflicting B, received at 6 s, was stored first.
        assert!(matches!(
            store.record_result(r, &delivery("42", solved("B"), 6_000)).await?,
            RecordOutcome::Recorded(_)
        ));
        // A's redrive: received earlier, so it replaces B — no token of B is left.
        let redriven = Delivery { via: Via::Redrive, ..delivery("42", solved("A"), 5_000) };
        let RecordOutcome::Replaced(now) = store.record_result(r, &redriven).await? else { panic!("replaced") };
        assert_eq!(store.get(r).await?.as_ref(), Some(&now));
        assert!(matches!(&now.state, TaskState::Solved { solution, resolved_at, via: Via::Redrive, .. }
            if solution.expose() == "A" && *resolved_at == t(5_000)));
        // B again (a retry of its own letter) is a conflict now; A again a duplicate.
        assert!(matches!(
            store.record_result(r, &delivery("42", solved("B"), 6_000)).await?,
            RecordOutcome::Conflict(_)
        ));
        assert!(matches!(store.record_result(r, &redriven).await?, RecordOutcome::Duplicate(_)));
        // A verdict received earlier still wins, and leaves no token on the item.
        let verdict = delivery("42", Outcome::Failed(ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE")?), 4_000);
        assert!(matches!(store.record_result(r, &verdict).await?, RecordOutcome::Replaced(_)));
        let item = raw(&store, r).await;
        assert!(!item.contains_key(attr::SOLUTION) && !item.contains_key(attr::TOKEN_CLOCK_START), "{item:?}");
        // The owner is shown the verdict: pinned. Nothing replaces it after that.
        let shown = store.get(r).await?.expect("task");
        assert!(shown.needs_pin(t(7_000)));
        assert_eq!(store.mark_handed_out(&shown, t(7_000)).await?, None);
        let pinned = store.get(r).await?.expect("task");
        assert_eq!(pinned.handed_out_at, Some(t(7_000)));
        assert!(!pinned.needs_pin(t(7_001)));
        let before = raw(&store, r).await;
        assert!(matches!(
            store.record_result(r, &delivery("42", solved("C"), 3_000)).await?,
            RecordOutcome::Conflict(_)
        ));
        assert!(matches!(store.record_result(r, &verdict).await?, RecordOutcome::Duplicate(_)));
        assert_eq!(raw(&store, r).await, before, "nothing written after the hand-out");
        // A second pin from the same (now outdated) read is refused and shows what is stored.
        assert_eq!(store.mark_handed_out(&shown, t(8_000)).await?, Some(pinned));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_poll_read_of_a_dead_lettered_result_does_not_let_a_later_conflict_win() -> anyhow::Result<()> {
        // A (received at 5 s) and a conflicting B (at 6 s) both fail to store and are
        // dead-lettered; the poller then reads A from res.php at 9 s and records it. Whichever
        // letter is redriven first, A must be what the task ends with.
        for a_first in [true, false] {
            let (_db, store) = engine().await?;
            let task = pending(&store, CaptchaKind::Turnstile).await;
            let r = &task.task_ref;
            let polled = Delivery { via: Via::Poll, ..delivery("42", solved("A"), 9_000) };
            assert!(matches!(store.record_result(r, &polled).await?, RecordOutcome::Recorded(_)));
            let a = Delivery { via: Via::Redrive, ..delivery("42", solved("A"), 5_000) };
            let b = Delivery { via: Via::Redrive, ..delivery("42", solved("B"), 6_000) };
            let letters = if a_first { [a, b] } else { [b, a] };
            for d in &letters {
                store.record_result(r, d).await?;
            }
            let end = store.get(r).await?.expect("task");
            assert!(
                matches!(&end.state, TaskState::Solved { solution, resolved_at, .. }
                    if solution.expose() == "A" && *resolved_at == t(5_000)),
                "a_first={a_first}: {:?}",
                end.state
            );
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn wrong_id_and_unknown_reference_write_nothing() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Image).await;
        let before = raw(&store, &task.task_ref).await;
        let got = store.record_result(&task.task_ref, &delivery("99", solved("x"), 5_000)).await?;
        assert_eq!(got, RecordOutcome::IdMismatch { expected: id("42") });
        assert_eq!(raw(&store, &task.task_ref).await, before);
        let nowhere = TaskRef::generate();
        assert_eq!(store.record_result(&nowhere, &delivery("42", solved("x"), 5_000)).await?, RecordOutcome::NotFound);
        assert_eq!(store.get(&nowhere).await?, None, "a result for an unknown task creates nothing");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn callback_that_outruns_the_submit_wins_and_the_submit_leaves_it() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = submitting(&store, CaptchaKind::Hcaptcha).await;
        let RecordOutcome::Recorded(_) =
            store.record_result(&task.task_ref, &delivery("42", solved("early"), 1_500)).await?
        else {
            panic!("recorded")
        };
        let SubmitRecorded::AlreadyResolved(t2) =
            store.mark_submitted(&task.task_ref, &id("42"), t(2_000), t(9)).await?
        else {
            panic!("already resolved")
        };
        assert_eq!(t2.state.name(), "solved");
        assert_eq!(t2.captcha_id, Some(id("42")));
        assert!(!raw(&store, &task.task_ref).await.contains_key(attr::POLL_DUE_AT));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_refused_submit_is_stored_as_failed_with_the_reason() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = submitting(&store, CaptchaKind::Image).await;
        let failed =
            store.mark_submit_failed(&task.task_ref, "ERROR_ZERO_CAPTCHA_FILESIZE", "in.php refused", t(1_100)).await?;
        assert!(
            matches!(&failed.state, TaskState::Failed { code, via: Via::Submit, .. } if code.as_ref() == "ERROR_ZERO_CAPTCHA_FILESIZE")
        );
        assert!(due_refs(&store, u64::MAX / 2).await.is_empty());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn due_index_lists_only_open_tasks() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let open = pending(&store, CaptchaKind::Image).await;
        let done = pending(&store, CaptchaKind::Image).await;
        store.record_result(&done.task_ref, &delivery("42", solved("x"), 3_000)).await?;
        assert_eq!(due_refs(&store, 122_000).await, vec![open.task_ref.to_string()]);
        assert!(due_refs(&store, 121_999).await.is_empty(), "not due before its time");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn claims_are_exclusive_count_the_read_and_only_the_holder_reschedules() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Turnstile).await;
        let page = store.due_page(store.shards().of(&task.task_ref), t(122_000), 10, None).await?;
        let due = page.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("listed when due");
        assert_eq!((due.due_at, due.reads), (t(122_000), 0));
        assert!(store.claim(&due, "a", t(212_000), true).await?, "first claim wins");
        assert!(!store.claim(&due, "b", t(212_000), true).await?, "the same listing cannot be claimed twice");
        assert!(due_refs(&store, 211_999).await.is_empty(), "a claimed task leaves the due list until its lease ends");
        assert_eq!(store.next_due_after(t(122_000)).await?, Some(t(212_000)), "the lease's end is the next work");
        assert!(!store.reschedule(&task.task_ref, "b", Reschedule::at(t(130_000))).await?, "only the holder");
        let r = Reschedule { unknown_code: true, not_ready_at: Some(t(125_000)), ..Reschedule::at(t(130_000)) };
        assert!(store.reschedule(&task.task_ref, "a", r).await?);
        let again = store.due_page(store.shards().of(&task.task_ref), t(130_000), 10, None).await?;
        let d = again.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("due again");
        assert_eq!(
            (d.reads, d.unknown_codes, d.last_not_ready_at),
            (1, 1, Some(t(125_000))),
            "the read counted at the claim"
        );
        // A claim given back unread takes its read back.
        assert!(store.claim(&d, "a", t(220_000), true).await?);
        assert!(
            store.reschedule(&task.task_ref, "a", Reschedule { unread: true, ..Reschedule::at(t(131_000)) }).await?
        );
        let d = store.due_page(store.shards().of(&task.task_ref), t(131_000), 10, None).await?.tasks.remove(0);
        assert_eq!(d.reads, 1);
        assert!(store.expire(&task.task_ref, "deadline", t(600_000), "a").await?);
        assert!(!store.expire(&task.task_ref, "deadline", t(600_001), "a").await?, "expiring twice writes nothing");
        assert!(matches!(store.get(&task.task_ref).await?.map(|t| t.state), Some(TaskState::Expired { .. })));
        assert!(due_refs(&store, u64::MAX / 2).await.is_empty());
        assert_eq!(store.next_due_after(t(0)).await?, None, "nothing open");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn no_expiry_under_another_pollers_live_lease() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Image).await;
        let due = store.due_page(store.shards().of(&task.task_ref), t(600_000), 10, None).await?.tasks.remove(0);
        assert!(store.claim(&due, "a", t(690_000), true).await?, "a holds it for a last read");
        assert!(
            !store.expire(&task.task_ref, "deadline", t(600_500), "b").await?,
            "b may not expire it under a's lease"
        );
        assert_eq!(store.get(&task.task_ref).await?.map(|t| t.state.name()), Some("pending"));
        assert!(store.expire(&task.task_ref, "deadline", t(600_500), "a").await?, "the holder may");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn results_around_the_expiry_are_recorded_or_kept_never_dropped() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        // Received before the expiry, stored after it (a dead letter redriven later): the result.
        let a = pending(&store, CaptchaKind::Image).await;
        store.expire(&a.task_ref, "deadline", t(600_000), "p").await?;
        let RecordOutcome::Recorded(got) =
            store.record_result(&a.task_ref, &delivery("42", solved("w68hp"), 599_000)).await?
        else {
            panic!("recorded")
        };
        assert!(matches!(&got.state, TaskState::Solved { solution, .. } if solution.expose() == "w68hp"));
        assert!(!raw(&store, &a.task_ref).await.contains_key(attr::ERROR_DETAIL), "no expiry reason left behind");
        // Received after the expiry: kept as the late result, once; the task stays expired.
        let b = pending(&store, CaptchaKind::Turnstile).await;
        store.expire(&b.task_ref, "deadline", t(600_000), "p").await?;
        let RecordOutcome::Late(late) =
            store.record_result(&b.task_ref, &delivery("42", solved("tok"), 610_000)).await?
        else {
            panic!("late")
        };
        assert!(matches!(&late.state, TaskState::Expired { late: Some(_), .. }));
        let stored = store.get(&b.task_ref).await?.expect("stored");
        assert_eq!(stored, late, "what was written reads back");
        assert!(matches!(
            store.record_result(&b.task_ref, &delivery("42", solved("tok"), 611_000)).await?,
            RecordOutcome::Duplicate(_)
        ));
        assert!(matches!(
            store.record_result(&b.task_ref, &delivery("42", solved("other"), 612_000)).await?,
            RecordOutcome::Conflict(_)
        ));
        assert_eq!(store.get(&b.task_ref).await?, Some(late), "the first late result stays");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_result_for_a_task_whose_submit_was_reported_failed_is_recorded() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = submitting(&store, CaptchaKind::Image).await;
        store.mark_submit_failed(&task.task_ref, "ERROR_NO_SLOT_AVAILABLE", "in.php refused", t(1_100)).await?;
        let RecordOutcome::Recorded(got) =
            store.record_result(&task.task_ref, &delivery("42", solved("w68hp"), 20_000)).await?
        else {
            panic!("a paid result is recorded")
        };
        assert!(matches!(got.state, TaskState::Solved { .. }));
        assert!(!raw(&store, &task.task_ref).await.contains_key(attr::ERROR_CODE), "the submit's code is gone");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn submit_slots_are_counted_per_second_across_callers() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let mut handles = Vec::new();
        for _ in 0..30 {
            let store = store.clone();
            handles.push(tokio::spawn(async move { store.take_submit_slot(t(5_000), 14).await }));
        }
        let mut taken = 0;
        for h in handles {
            taken += usize::from(h.await??);
        }
        assert_eq!(taken, 14, "30 concurrent callers in one second: 14 slots");
        assert!(store.take_submit_slot(t(6_000), 14).await?, "the next second has its own");
        assert!(due_refs(&store, u64::MAX / 2).await.is_empty(), "never a due task");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_breaker_opens_extends_never_shortens_and_closes() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        assert_eq!(store.breaker().await?, Breaker::default());
        let ban = Stop::Ban { needs_operator: false };
        assert!(store.open_breaker(t(300_000), "IP_BANNED", ban, t(0)).await?);
        assert!(!store.open_breaker(t(10_000), "MAX_USER_TURN", ban, t(1)).await?, "never shortened");
        assert!(
            !store.open_breaker(t(400_000), "5 answers missing", Stop::NoAnswers, t(1)).await?,
            "missing answers never replace a ban in force"
        );
        assert_eq!(store.breaker().await?.open_for_submits_at(t(2)), Some(t(300_000)), "a ban stops submits too");
        let b = store.breaker().await?;
        assert_eq!((b.open_at(t(299_999)), b.reason.as_deref()), (Some(t(300_000)), Some("IP_BANNED")));
        assert_eq!(b.open_at(t(300_000)), None, "closed when it ends");
        assert!(
            store
                .open_breaker(t(3_600_000), "ERROR_KEY_DOES_NOT_EXIST", Stop::Ban { needs_operator: true }, t(2))
                .await?,
            "extended"
        );
        assert!(store.breaker().await?.needs_operator);
        store.close_breaker().await?;
        assert_eq!(store.breaker().await?.open_at(t(3)), None);
        // res.php going silent pauses reads, not submits.
        assert!(store.open_breaker(t(60_000), "5 answers missing", Stop::NoAnswers, t(3)).await?);
        let b = store.breaker().await?;
        assert_eq!((b.open_at(t(4)), b.open_for_submits_at(t(4))), (Some(t(60_000)), None));
        assert!(store.open_breaker(t(50_000), "IP_BANNED", ban, t(4)).await?, "a ban replaces it");
        assert_eq!(store.breaker().await?.open_for_submits_at(t(5)), Some(t(50_000)));
        assert!(due_refs(&store, u64::MAX / 2).await.is_empty(), "the breaker is never a due task");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn fifty_concurrent_deliveries_write_exactly_once() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        // 50 copies of one delivery: one write, 49 duplicates. Then one result received first
        // racing 49 copies of a conflicting one received later: whoever writes first, the task
        // ends on the first received, and it is written at most twice (recorded, or recorded
        // after a conflict and then replacing it once).
        for tokens in [vec!["same"; 50], std::iter::once("first").chain(std::iter::repeat_n("second", 49)).collect()] {
            let task = pending(&store, CaptchaKind::Turnstile).await;
            let mut handles = Vec::new();
            for (i, token) in tokens.iter().enumerate() {
                let (store, r) = (store.clone(), task.task_ref.clone());
                let d = delivery("42", solved(token), if i == 0 { 5_000 } else { 6_000 });
                handles.push(tokio::spawn(async move { store.record_result(&r, &d).await }));
            }
            let (mut recorded, mut replaced, mut others) = (0, 0, 0);
            for h in handles {
                match h.await?? {
                    RecordOutcome::Recorded(_) => recorded += 1,
                    RecordOutcome::Replaced(_) => replaced += 1,
                    RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_) => others += 1,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(recorded, 1, "exactly one first write ({:?})", tokens[..2].to_vec());
            assert!(replaced <= 1, "replaced at most once: {replaced}");
            assert_eq!(recorded + replaced + others, 50);
            if tokens[1] == "same" {
                assert_eq!(replaced, 0);
            }
            let end = store.get(&task.task_ref).await?.expect("task");
            assert!(
                matches!(&end.state, TaskState::Solved { solution, resolved_at, .. }
                    if solution.expose() == tokens[0] && *resolved_at == t(5_000)),
                "{:?}",
                end.state
            );
        }
        Ok(())
    }
}

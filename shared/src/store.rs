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
use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};

use crate::codes::ErrorCode;
use crate::domain::{
    Applied, CaptchaId, CaptchaKind, Delivery, Outcome, Task, TaskRef, TaskState, TransitionError, Via,
};
use crate::time::Timestamp;

/// Name of the sparse index of open tasks by the time they are due for a fallback poll.
pub const DUE_INDEX: &str = "due-for-poll";
/// The index is spread over this many partitions (`poll_shard` 0..N) so no key runs hot.
pub const POLL_SHARDS: u8 = 4;

mod attr {
    pub const PK: &str = "pk";
    pub const KIND: &str = "kind";
    pub const STATE: &str = "state";
    pub const CREATED_AT: &str = "created_at";
    pub const CAPTCHA_ID: &str = "captcha_id";
    pub const SUBMITTED_AT: &str = "submitted_at";
    pub const SOLUTION: &str = "solution";
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

/// One page of the due-for-poll index.
#[derive(Debug, Default)]
pub struct DuePage {
    pub tasks: Vec<DueTask>,
    /// Where the next page starts; `None` when the shard is done.
    pub next: Option<HashMap<String, AttributeValue>>,
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

/// What happened to a delivered result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordOutcome {
    /// This delivery is the task's result; the task as now stored.
    Recorded(Task),
    /// The task already had exactly this result. Nothing was written.
    Duplicate(Task),
    /// The task already had a different result, which stays. Nothing was written.
    Conflict(Task),
    /// The result names another CaptchaAI id than the task's. Nothing was written.
    IdMismatch { expected: CaptchaId },
    /// No task under that reference. Nothing was written.
    NotFound,
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
        let kind = CaptchaKind::parse(req_s(item, KIND)?).map_err(corrupt(KIND))?;
        let captcha_id = get_s(item, CAPTCHA_ID)?.map(CaptchaId::parse).transpose().map_err(corrupt(CAPTCHA_ID))?;
        let via =
            || -> Result<Via, StoreError> { Via::parse(req_s(item, RESOLVED_VIA)?).map_err(corrupt(RESOLVED_VIA)) };
        let state = match req_s(item, STATE)? {
            "submitting" => TaskState::Submitting,
            "pending" => TaskState::Pending { submitted_at: req_ts(item, SUBMITTED_AT)? },
            "solved" => {
                let resolved_at = req_ts(item, RESOLVED_AT)?;
                TaskState::Solved {
                    solution: crate::domain::Solution::parse(req_s(item, SOLUTION)?).map_err(corrupt(SOLUTION))?,
                    resolved_at,
                    via: via()?,
                    token_clock_start: get_ts(item, TOKEN_CLOCK_START)?.unwrap_or(resolved_at),
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
            },
            other => return Err(StoreError::Corrupt(format!("unknown state `{other}`"))),
        };
        Ok(Task { task_ref, kind, created_at: req_ts(item, CREATED_AT)?, captcha_id, state })
    }
}

/// The DynamoDB task store. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TaskStore {
    client: Client,
    table: String,
    retention: Duration,
}

impl TaskStore {
    pub fn new(client: Client, table: impl Into<String>, retention: Duration) -> Self {
        Self { client, table: table.into(), retention }
    }

    /// A store built from the cold-start AWS configuration.
    pub fn from_config(aws: &aws_config::SdkConfig, cfg: &crate::config::StoreConfig) -> Self {
        Self::new(Client::new(aws), cfg.table.clone(), cfg.retention)
    }

    pub fn table(&self) -> &str {
        &self.table
    }

    fn ttl(&self, from: Timestamp) -> AttributeValue {
        n(from.plus(self.retention).as_secs())
    }

    /// Records a new task (state submitting) before in.php is called. `deadline` is when the
    /// poller should look at it if in.php's answer never gets stored.
    pub async fn create(&self, task: &Task, deadline: Timestamp) -> Result<(), StoreError> {
        use attr::*;
        let item: Item = [
            (PK, s(task.task_ref.as_ref())),
            (KIND, s(task.kind.as_str())),
            (STATE, s("submitting")),
            (CREATED_AT, n(task.created_at.as_millis())),
            (POLL_SHARD, n(u64::from(task.task_ref.shard(POLL_SHARDS)))),
            (POLL_DUE_AT, n(deadline.as_millis())),
            (EXPIRES_TTL, self.ttl(task.created_at)),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .collect();
        self.client
            .put_item()
            .table_name(&self.table)
            .set_item(Some(item))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
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
            .update_expression("SET #state = :pending, captcha_id = :id, submitted_at = :now, poll_due_at = :due")
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
                 resolved_via = :via, expires_ttl = :ttl REMOVE poll_due_at, poll_shard",
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
    /// many times, and by however many paths, it is delivered.
    pub async fn record_result(&self, task_ref: &TaskRef, d: &Delivery) -> Result<RecordOutcome, StoreError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .condition_expression(
                "attribute_exists(pk) AND #state IN (:submitting, :pending) \
                 AND (attribute_not_exists(captcha_id) OR captcha_id = :id)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":id", s(d.captcha_id.as_ref()))
            .expression_attribute_values(":at", n(d.received_at.as_millis()))
            .expression_attribute_values(":via", s(d.via.as_str()))
            .expression_attribute_values(":ttl", self.ttl(d.received_at))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld);
        const COMMON: &str = "captcha_id = :id, resolved_at = :at, resolved_via = :via, expires_ttl = :ttl";
        const CLEAR: &str = "REMOVE poll_due_at, poll_shard, lease_owner";
        req = match &d.outcome {
            Outcome::Solved(solution) => req
                .update_expression(format!(
                    "SET #state = :solved, solution = :solution, token_clock_start = :clock, {COMMON} {CLEAR}"
                ))
                .expression_attribute_values(":solved", s("solved"))
                .expression_attribute_values(":solution", s(solution.expose()))
                .expression_attribute_values(":clock", n(d.token_clock_start.as_millis())),
            Outcome::Failed(code) => req
                .update_expression(format!("SET #state = :failed, error_code = :code, {COMMON} {CLEAR}"))
                .expression_attribute_values(":failed", s("failed"))
                .expression_attribute_values(":code", s(code.as_ref())),
        };
        match req.send().await {
            Ok(out) => Ok(RecordOutcome::Recorded(decode(out.attributes.as_ref())?)),
            Err(e) => match refused_item(&e) {
                Some(None) => Ok(RecordOutcome::NotFound),
                Some(Some(old)) => {
                    let old = Task::try_from(old)?;
                    match old.clone().apply(d.clone()) {
                        Ok(Applied::Duplicate) => Ok(RecordOutcome::Duplicate(old)),
                        Ok(Applied::Conflict) => Ok(RecordOutcome::Conflict(old)),
                        Err(TransitionError::IdMismatch { expected, .. }) => Ok(RecordOutcome::IdMismatch { expected }),
                        // The condition and the state machine disagree: the item is not what
                        // this code writes. Say so rather than guess.
                        Ok(Applied::Recorded(_)) | Err(TransitionError::NotAllowed { .. }) => {
                            Err(StoreError::Corrupt(format!(
                                "task {task_ref} refused a result the state machine allows (state {})",
                                old.state.name()
                            )))
                        }
                    }
                }
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
    /// Conditional on the listing being current, so two pollers never both win.
    pub async fn claim(&self, due: &DueTask, owner: &str, lease_until: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(due.task.task_ref.as_ref()))
            .update_expression("SET poll_due_at = :lease, lease_owner = :owner")
            .condition_expression("poll_due_at = :seen AND #state IN (:submitting, :pending)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":lease", n(lease_until.as_millis()))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":seen", n(due.due_at.as_millis()))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .send()
            .await;
        condition_held(res)
    }

    /// Puts a claimed, still open task back on the due list at `next_due`, counting the read.
    /// Conditional on still holding the lease; `false` if another path resolved it meanwhile.
    pub async fn reschedule(
        &self,
        task_ref: &TaskRef,
        owner: &str,
        next_due: Timestamp,
        read: bool,
        unknown_code: bool,
        not_ready_at: Option<Timestamp>,
    ) -> Result<bool, StoreError> {
        let mut set = vec![
            "poll_due_at = :next",
            "poll_reads = if_not_exists(poll_reads, :zero) + :r",
            "poll_unknown = if_not_exists(poll_unknown, :zero) + :u",
        ];
        if not_ready_at.is_some() {
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
            .expression_attribute_values(":next", n(next_due.as_millis()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":r", n(u64::from(read)))
            .expression_attribute_values(":u", n(u64::from(unknown_code)))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"));
        if let Some(t) = not_ready_at {
            req = req.expression_attribute_values(":nr", n(t.as_millis()));
        }
        condition_held(req.send().await)
    }

    /// Ends an open task that got no result in time: → expired. `false` if it had already
    /// been resolved.
    pub async fn expire(&self, task_ref: &TaskRef, reason: &str, now: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :expired, error_detail = :reason, resolved_at = :now, resolved_via = :via, \
                 expires_ttl = :ttl REMOVE poll_due_at, poll_shard, lease_owner",
            )
            .condition_expression("#state IN (:submitting, :pending)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":expired", s("expired"))
            .expression_attribute_values(":reason", s(reason))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":via", s(Via::Deadline.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":pending", s("pending"))
            .send()
            .await;
        condition_held(res)
    }

    /// Reads a task (strongly consistent).
    pub async fn get(&self, task_ref: &TaskRef) -> Result<Option<Task>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        out.item.as_ref().map(Task::try_from).transpose()
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

    use super::{Client, DUE_INDEX, StoreError, attr, sdk_error};

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

    /// Creates the task table with its due-for-poll index and TTL.
    pub async fn create_table(client: &Client, table: &str) -> Result<(), StoreError> {
        let index = GlobalSecondaryIndex::builder()
            .index_name(DUE_INDEX)
            .key_schema(key(attr::POLL_SHARD, KeyType::Hash)?)
            .key_schema(key(attr::POLL_DUE_AT, KeyType::Range)?)
            .projection(Projection::builder().projection_type(ProjectionType::All).build())
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))?;
        client
            .create_table()
            .table_name(table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(def(attr::PK, ScalarAttributeType::S)?)
            .attribute_definitions(def(attr::POLL_SHARD, ScalarAttributeType::N)?)
            .attribute_definitions(def(attr::POLL_DUE_AT, ScalarAttributeType::N)?)
            .key_schema(key(attr::PK, KeyType::Hash)?)
            .global_secondary_indexes(index)
            .send()
            .await
            .map_err(sdk_error)?;
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
        store.create(&task, t(600_000)).await.expect("create");
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
        for shard in 0..POLL_SHARDS {
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
    async fn a_task_is_created_submitted_and_read_back() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = submitting(&store, CaptchaKind::Turnstile).await;
        assert_eq!(store.get(&task.task_ref).await?, Some(task.clone()));
        assert!(store.create(&task, t(1)).await.is_err(), "a reference is never created twice");
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
    async fn claims_are_exclusive_and_only_the_holder_reschedules() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        let task = pending(&store, CaptchaKind::Turnstile).await;
        let page = store.due_page(task.task_ref.shard(POLL_SHARDS), t(122_000), 10, None).await?;
        let due = page.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("listed when due");
        assert_eq!((due.due_at, due.reads), (t(122_000), 0));
        assert!(store.claim(&due, "a", t(212_000)).await?, "first claim wins");
        assert!(!store.claim(&due, "b", t(212_000)).await?, "the same listing cannot be claimed twice");
        assert!(due_refs(&store, 211_999).await.is_empty(), "a claimed task leaves the due list until its lease ends");
        assert!(!store.reschedule(&task.task_ref, "b", t(130_000), true, false, None).await?, "only the holder");
        assert!(store.reschedule(&task.task_ref, "a", t(130_000), true, true, Some(t(125_000))).await?);
        let again = store.due_page(task.task_ref.shard(POLL_SHARDS), t(130_000), 10, None).await?;
        let d = again.tasks.into_iter().find(|d| d.task.task_ref == task.task_ref).expect("due again");
        assert_eq!((d.reads, d.unknown_codes, d.last_not_ready_at), (1, 1, Some(t(125_000))));
        assert!(store.expire(&task.task_ref, "deadline", t(600_000)).await?);
        assert!(!store.expire(&task.task_ref, "deadline", t(600_001)).await?, "expiring twice writes nothing");
        assert!(matches!(store.get(&task.task_ref).await?.map(|t| t.state), Some(TaskState::Expired { .. })));
        assert!(due_refs(&store, u64::MAX / 2).await.is_empty());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn fifty_concurrent_deliveries_write_exactly_once() -> anyhow::Result<()> {
        let (_db, store) = engine().await?;
        for tokens in [vec!["same"], vec!["first", "second"]] {
            let task = pending(&store, CaptchaKind::Turnstile).await;
            let mut handles = Vec::new();
            for i in 0..50usize {
                let (store, r) = (store.clone(), task.task_ref.clone());
                let d = delivery("42", solved(tokens[i % tokens.len()]), 5_000 + i as u64);
                handles.push(tokio::spawn(async move { store.record_result(&r, &d).await }));
            }
            let mut recorded = Vec::new();
            let mut others = 0;
            for h in handles {
                match h.await?? {
                    RecordOutcome::Recorded(t) => recorded.push(t),
                    RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_) => others += 1,
                    other => panic!("unexpected {other:?}"),
                }
            }
            assert_eq!(recorded.len(), 1, "exactly one write wins ({tokens:?})");
            assert_eq!(others, 49);
            assert_eq!(store.get(&task.task_ref).await?, Some(recorded.remove(0)), "the stored result is the winner's");
        }
        Ok(())
    }
}

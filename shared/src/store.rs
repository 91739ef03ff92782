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

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::types::AttributeValue;

use crate::domain::{Task, TaskRef};
use crate::time::Timestamp;

/// Name of the sparse index of open tasks by the time they are due for a fallback poll.
pub const DUE_INDEX: &str = "due-for-poll";
pub use crate::config::{DEFAULT_POLL_SHARDS, MAX_POLL_SHARDS, Shards};

pub mod deliveries;
pub mod hosts;
pub mod queue;
pub mod relay_keys;
pub mod retention;
pub use deliveries::{DELIVERY_INDEX, DeliveryFinish, DueDelivery};
pub use hosts::{HostRecord, SlotWrite};
pub use queue::{Permit, Publish, QUEUE_INDEX, QueuedRef, Released, Reserved, SubmitState};
pub use relay_keys::{KeyCheck, KeyGrant, KeyInfo, RelayKeys};

mod account;
mod error;
mod item;
mod poll;
mod results;
pub mod schema;
mod tasks;
#[cfg(test)]
mod tests;
pub use account::{Breaker, Stop};
pub use error::StoreError;
pub use poll::{DuePage, DueTask, PageKey, Reschedule};
pub use results::RecordOutcome;
pub use tasks::{Created, SubmitRecorded};

use error::sdk_error;
use item::{
    DELIVERY_CLEAR, DELIVERY_DUE, Item, UNSENT_CLEAR, attr, corrupt, delivery_due, get_s, get_ts, get_u32, n, req_s,
    req_ts, s,
};

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

/// The table, as this process reaches it: what every handle holds (cheap to clone). Its public
/// face is only what any function may ask whatever its grants: the table's name, how its
/// indexes are spread, the connection's warm-up.
#[derive(Debug, Clone)]
pub struct Table {
    client: Client,
    table: std::sync::Arc<str>,
    retention: Duration,
    pushes: Option<PushNotifier>,
    /// Told of every result this store records (a CaptchaAI thread freed).
    results: Option<std::sync::Arc<tokio::sync::Notify>>,
    shards: Shards,
    /// How many items the submit queue's counts spread over (`QUEUE_SHARDS`, [`queue`]).
    queue_shards: u8,
}

/// The DynamoDB task store: one table, built once at cold start, handing out a handle per
/// concern — [`Tasks`], [`Results`], [`PollIndex`], [`Account`], [`SubmitQueue`], [`Pushes`],
/// [`KeyAdmin`], [`Retention`]. A function's `Deps` holds the handles it uses, which match the
/// IAM actions its role is granted in `template.yaml`. Cheap to clone.
#[derive(Debug, Clone)]
pub struct TaskStore(Table);

impl std::ops::Deref for TaskStore {
    type Target = Table;

    fn deref(&self) -> &Table {
        &self.0
    }
}

/// Handles by concern: each a [`Table`] with its concern's calls (in the module of that name).
macro_rules! handles {
    ($($(#[$doc:meta])* $name:ident => $ctor:ident;)*) => {
        $(
            $(#[$doc])*
            #[derive(Debug, Clone)]
            pub struct $name(Table);

            impl std::ops::Deref for $name {
                type Target = Table;

                fn deref(&self) -> &Table {
                    &self.0
                }
            }
        )*

        impl TaskStore {
            $(
                #[doc = concat!("This table's [`", stringify!($name), "`].")]
                pub fn $ctor(&self) -> $name {
                    $name(self.0.clone())
                }
            )*
        }
    };
}

handles! {
    /// A task before its result, and reading one: created (sent now or queued), submitted,
    /// refused, forgotten ([`tasks`]). PutItem, UpdateItem, GetItem, DeleteItem.
    Tasks => tasks;
    /// Recording a result with one conditional write, and pinning the one shown ([`results`]).
    /// UpdateItem.
    Results => results;
    /// The due-for-poll index: pages, claims, rescheduling, expiry ([`poll`]). Query on
    /// `due-for-poll`, UpdateItem.
    PollIndex => poll;
    /// The account's per-second slots and its breaker ([`account`]). UpdateItem, GetItem.
    Account => account;
    /// The submit queue ([`queue`]). UpdateItem, GetItem, BatchGetItem, PutItem; Query and Scan
    /// on `submit-queue`.
    SubmitQueue => queue;
    /// Pushes: the due-for-delivery index, claims and outcomes, host slots, webhook secrets
    /// ([`deliveries`], [`hosts`]). GetItem, UpdateItem, PutItem; Query on `due-for-delivery`.
    Pushes => pushes;
    /// Relay keys, as operators manage them ([`relay_keys`]). PutItem, UpdateItem, Scan.
    KeyAdmin => key_admin;
    /// Retention: reads that refuse an item past it, the sweep, erasure ([`retention`]). GetItem,
    /// Scan, DeleteItem.
    Retention => retention;
}

impl TaskStore {
    pub fn new(client: Client, table: impl Into<String>, retention: Duration) -> Self {
        Self(Table {
            client,
            table: table.into().into(),
            retention,
            pushes: None,
            results: None,
            shards: Shards::default(),
            queue_shards: 1,
        })
    }

    /// The same store, counting its submit queue over `n` items (1 to
    /// [`queue::MAX_QUEUE_SHARDS`]).
    #[must_use]
    pub fn with_queue_shards(mut self, n: u8) -> Self {
        self.0.queue_shards = n.clamp(1, queue::MAX_QUEUE_SHARDS);
        self
    }

    /// The same store, spreading its indexes as `shards` says.
    #[must_use]
    pub fn with_shards(mut self, shards: Shards) -> Self {
        self.0.shards = shards;
        self
    }

    /// The same store, notifying `n` of every result it records: how a submitter in the same
    /// process (local mode) hears at once that a thread is free, instead of at its next look.
    #[must_use]
    pub fn with_result_notifier(mut self, n: std::sync::Arc<tokio::sync::Notify>) -> Self {
        self.0.results = Some(n);
        self
    }

    /// The same store, telling `n` of every push its writes make due.
    #[must_use]
    pub fn with_push_notifier(mut self, n: PushNotifier) -> Self {
        self.0.pushes = Some(n);
        self
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
}

impl Table {
    /// How this store spreads its sparse indexes.
    pub fn shards(&self) -> Shards {
        self.shards
    }

    /// How many items the submit queue's counts spread over.
    pub fn queue_shards(&self) -> u8 {
        self.queue_shards
    }

    pub fn table(&self) -> &str {
        &self.table
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

    fn ttl(&self, from: Timestamp) -> AttributeValue {
        n(from.plus(self.retention).as_secs())
    }

    /// A task's item as stored (strongly consistent).
    async fn get_item(&self, task_ref: &TaskRef) -> Result<Option<Item>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
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

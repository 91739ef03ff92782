//! The submit queue, kept in the task table.
//!
//! A queued task is a task item in state `queued` that carries what in.php needs (the request,
//! as JSON, and its signed pingback URL) and `sq_key = q#<lane>`, `sq_at = <queued at>`: it is
//! listed, oldest first, in the sparse keys-only `submit-queue` index under its lane. The same
//! index lists the tasks CaptchaAI is likely working on — `sq_key = w#<shard>`, `sq_at` = when
//! it was sent plus its kind's typical solve time ([`crate::domain::CaptchaKind::busy_for`]) —
//! from the moment the relay starts sending it to the write that records its result. Counting those is how the
//! submitter knows how many threads are in use; one index, so an existing stack adds it in one
//! deploy.
//!
//! The account's state item (the breaker's, `breaker#captchaai`) also holds the permits the
//! submitter publishes for inline submits, its lease, and its learnt window, and the queue's
//! counters (`q_total`, `ql#<lane>` per lane: bounds and the lanes that wait) — all of them, or
//! with `QUEUE_SHARDS` > 1 its share: a task is counted on the count item of its shard
//! ([`count_key`]: shard 0 is the state item, the others `breaker#captchaai#q<n>`), each with
//! its share of the bounds, so admissions spread their one write over that many partition keys
//! (DynamoDB takes 1,000 a second on each). Readers sum the items in use; after the count is
//! lowered, the submitter folds what the items beyond it still hold into the state item when it
//! starts ([`TaskStore::fold_queue_shards`]), so changing the count loses nothing. Counters go up before a task
//! enters the queue and down after it leaves, so a crash between the two leaves a count too
//! high, never a task unseen; the submitter reconciles such counts against the index.

use std::collections::BTreeMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::AttributeValue;

use super::{
    Breaker, Created, DELIVERY_CLEAR, DELIVERY_DUE, Item, StoreError, SubmitQueue, UNSENT_CLEAR, attr, condition_held,
    corrupt, decode, delivery_due, get_s, get_ts, n, refused_item, req_s, req_ts, s, sdk_error,
};
use crate::captchaai::SubmitRequest;
use crate::domain::{Task, TaskRef, TaskState};
use crate::time::Timestamp;

/// The sparse keys-only index of queued tasks (per lane) and tasks in work (per shard).
pub const QUEUE_INDEX: &str = "submit-queue";
/// The item whose every write wakes the submitter (through the table's stream).
pub const WAKE_KEY: &str = "submitq#wake";

fn ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// The index key of a task waiting in `lane`, on its queue shard (`QUEUE_SHARDS`): `q#<lane>`
/// on shard 0, `q#<lane>#<shard>` on the others — a lane's admissions spread over that many
/// index keys as its counts do over the count items.
pub fn queued_key(lane: &str, shard: u8) -> String {
    if shard == 0 { format!("q#{lane}") } else { format!("q#{lane}#{shard}") }
}

/// The lane and shard of a queued index key (`None`: not a queued key).
pub fn lane_of_key(key: &str) -> Option<(&str, u8)> {
    let rest = key.strip_prefix("q#")?;
    Some(match rest.rsplit_once('#') {
        Some((lane, shard)) => match shard.parse() {
            Ok(k) => (lane, k),
            Err(_) => (rest, 0),
        },
        None => (rest, 0),
    })
}

/// The index key of a task in work: spread like the other sparse indexes, over the store's
/// shards (`POLL_SHARDS`; readers cover the previous count during a change).
pub fn in_work_key(task_ref: &TaskRef, shards: super::Shards) -> String {
    format!("w#{}", shards.of(task_ref))
}

pub use crate::config::{DEFAULT_QUEUE_SHARDS, MAX_QUEUE_SHARDS};

/// The item holding shard `shard`'s queue counts: the state item itself for shard 0.
pub fn count_key(shard: u8) -> String {
    if shard == 0 { Breaker::KEY.to_owned() } else { format!("{}#q{shard}", Breaker::KEY) }
}

/// A bound's share on one of `shards` count items (rounded up: the bounds hold in sum, give or
/// take a share's rounding).
fn share(bound: u64, shards: u8) -> u64 {
    bound.div_ceil(u64::from(shards.max(1)))
}

/// An item's raw counts: `q_total` and each lane's, as stored (a reconciled share can be
/// below zero).
fn raw_counts(item: &Item) -> (i64, BTreeMap<String, i64>) {
    let total = match item.get("q_total") {
        Some(AttributeValue::N(v)) => v.parse().unwrap_or(0),
        _ => 0,
    };
    let lanes = item
        .iter()
        .filter_map(|(k, v)| match (k.strip_prefix("ql#"), v) {
            (Some(lane), AttributeValue::N(c)) => Some((lane.to_owned(), c.parse().unwrap_or(0))),
            _ => None,
        })
        .collect();
    (total, lanes)
}

fn lane_attr(lane: &str) -> String {
    format!("ql#{lane}")
}

/// The queue's part of the account's state item.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SubmitState {
    pub breaker: Breaker,
    /// Tasks queued in all (a count, see the module docs).
    pub queued: u64,
    /// Tasks queued per lane (lanes counted above zero).
    pub lanes: BTreeMap<String, u64>,
    /// Inline submits the submitter allows now (`None`: none published yet).
    pub permits: Option<i64>,
    /// The submitter holding the lease, and until when.
    pub releaser: Option<String>,
    pub releaser_until: Option<Timestamp>,
    /// The learnt window (JSON of `crate::submit::window::WindowState`).
    pub window: Option<String>,
    /// "No slot" answers inline submits met (a running count).
    pub api_no_slots: u64,
    /// How many of those a submitter has taken into the window.
    pub api_no_slots_seen: u64,
    /// Tasks released in the last minute, as the submitter last published it.
    pub released_per_minute: u64,
    /// Each lane's count on the state item itself (shard 0), as stored.
    pub lanes_here: BTreeMap<String, i64>,
    /// Each lane's count on the other count items, summed.
    pub lanes_elsewhere: BTreeMap<String, i64>,
}

impl SubmitState {
    /// Whether a submitter holds a live lease at `now`.
    pub fn releaser_live(&self, now: Timestamp) -> bool {
        self.releaser_until.is_some_and(|u| u > now)
    }

    pub(super) fn from_item(item: &Item) -> Result<Self, StoreError> {
        let num = |name: &str| -> Result<i64, StoreError> {
            match item.get(name) {
                None => Ok(0),
                Some(AttributeValue::N(v)) => {
                    v.parse().map_err(|_| StoreError::Corrupt(format!("`{name}` is not a whole number")))
                }
                Some(_) => Err(StoreError::Corrupt(format!("`{name}` is not a number"))),
            }
        };
        let (_, here) = raw_counts(item);
        let lanes = here.iter().filter(|(_, c)| **c > 0).map(|(l, c)| (l.clone(), *c as u64)).collect();
        Ok(Self {
            breaker: Breaker::from_item(item)?,
            queued: num("q_total")?.max(0) as u64,
            lanes,
            permits: item.contains_key("permits").then(|| num("permits")).transpose()?,
            releaser: get_s(item, "rel_owner")?.map(str::to_owned),
            releaser_until: get_ts(item, "rel_until")?,
            window: get_s(item, "win")?.map(str::to_owned),
            api_no_slots: num("ns_api")?.max(0) as u64,
            api_no_slots_seen: num("ns_seen")?.max(0) as u64,
            released_per_minute: num("rel_rate")?.max(0) as u64,
            lanes_here: here,
            lanes_elsewhere: BTreeMap::new(),
        })
    }

    /// The state item (empty: none yet) with the counts of the other count items (shards 1
    /// and up) added to its own.
    fn summed(state_item: &Item, others: &[Item]) -> Result<Self, StoreError> {
        let mut st = Self::from_item(state_item)?;
        st.add_elsewhere(raw_counts(state_item).0, others);
        Ok(st)
    }

    fn add_elsewhere(&mut self, here_total: i64, items: &[Item]) {
        let mut total = here_total;
        for item in items {
            let (t, lanes) = raw_counts(item);
            total += t;
            for (lane, c) in lanes {
                *self.lanes_elsewhere.entry(lane).or_insert(0) += c;
            }
        }
        self.queued = total.max(0) as u64;
        let mut lanes = self.lanes_here.clone();
        for (lane, c) in &self.lanes_elsewhere {
            *lanes.entry(lane.clone()).or_insert(0) += c;
        }
        self.lanes = lanes.into_iter().filter(|(_, c)| *c > 0).map(|(l, c)| (l, c as u64)).collect();
    }
}

/// What an inline submit's permit write found.
#[derive(Debug, Clone, PartialEq)]
pub enum Permit {
    /// Taken: send it now.
    Taken,
    /// Not taken (the queue is not empty, no permit is left, or the breaker is open); the
    /// state as it stands.
    Refused(Box<SubmitState>),
}

/// What a queue reservation found.
#[derive(Debug, Clone, PartialEq)]
pub enum Reserved {
    /// Counted in: put the task in the queue. The state after the reservation.
    Yes(Box<SubmitState>),
    /// The queue is full: `owner` (its owner's lane is at its bound) or in all.
    Full { owner: bool, depth: u64, bound: u64 },
}

/// A queued task as its lane lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QueuedRef {
    pub task_ref: TaskRef,
    pub queued_at: Timestamp,
}

/// A task the submitter took from the queue: what it needs to send it.
#[derive(Debug, Clone)]
pub struct Released {
    pub task: Task,
    pub request: SubmitRequest,
    pub pingback: String,
    pub lane: String,
    pub queued_at: Timestamp,
}

/// What the submitter publishes with each renewal of its lease.
#[derive(Debug, Clone, Default)]
pub struct Publish {
    pub permits: u32,
    pub window: String,
    pub released_per_minute: u64,
    /// Inline "no slot" answers taken into the window so far.
    pub api_no_slots_seen: u64,
}

/// The condition that the breaker lets submits through at `:now` (a ban stops them; a pause
/// for res.php answers does not).
const BREAKER_LETS_SUBMITS: &str = "(attribute_not_exists(open_until) OR open_until <= :now OR res_php_only = :t)";

mod counts;
mod lanes;
mod releaser;
#[cfg(test)]
mod tests;
mod unsent;

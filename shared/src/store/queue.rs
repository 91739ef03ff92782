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

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure, Select};

use super::{
    Breaker, Created, Item, StoreError, TaskStore, attr, condition_held, decode, get_s, get_ts, n, refused_item, s,
    sdk_error,
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

/// The most count items the queue's counts spread over (`QUEUE_SHARDS`).
pub const MAX_QUEUE_SHARDS: u8 = 32;
/// `QUEUE_SHARDS` unset: 4 count items, ~4,000 admissions a second (docs/capacity.md).
pub const DEFAULT_QUEUE_SHARDS: u8 = 4;

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

impl TaskStore {
    /// The account's state item: the breaker and the queue, its counts summed over the count
    /// items in use (strongly consistent; one `BatchGetItem`).
    pub async fn submit_state(&self) -> Result<SubmitState, StoreError> {
        let items = self.count_items(0..self.queue_shards.max(1)).await?;
        let (state_item, others): (Vec<Item>, Vec<Item>) =
            items.into_iter().partition(|i| get_s(i, attr::PK).ok().flatten() == Some(Breaker::KEY));
        SubmitState::summed(&state_item.into_iter().next().unwrap_or_default(), &others)
    }

    /// Moves what count items beyond `QUEUE_SHARDS` still hold (the count was lowered) onto the
    /// state item: two writes per such item, the sum right after both. The submitter does it
    /// when it starts. How many items were folded.
    pub async fn fold_queue_shards(&self) -> Result<usize, StoreError> {
        let from = self.queue_shards.max(1);
        if from >= MAX_QUEUE_SHARDS {
            return Ok(0);
        }
        let mut folded = 0;
        for item in self.count_items(from..MAX_QUEUE_SHARDS).await? {
            let Some(shard) = get_s(&item, attr::PK)?
                .and_then(|k| k.strip_prefix(&format!("{}#q", Breaker::KEY)).and_then(|n| n.parse::<u8>().ok()))
            else {
                continue;
            };
            let (_, lanes) = raw_counts(&item);
            let moves: Vec<((u8, String), i64)> =
                lanes.into_iter().filter(|(_, c)| *c != 0).map(|(l, c)| ((0, l), c)).collect();
            if moves.is_empty() {
                continue;
            }
            // Onto the state item first: a crash between leaves the sum too high, never too low.
            self.move_counts(0, &moves).await?;
            let back: Vec<((u8, String), i64)> = moves.into_iter().map(|((_, l), c)| ((shard, l), -c)).collect();
            self.move_counts(shard, &back).await?;
            folded += 1;
        }
        Ok(folded)
    }

    /// The count items of `shards` that exist (strongly consistent; one `BatchGetItem`, asked
    /// again for keys DynamoDB leaves unprocessed).
    async fn count_items(&self, shards: std::ops::Range<u8>) -> Result<Vec<Item>, StoreError> {
        let keys: Vec<Item> = shards.map(|k| [(attr::PK.to_owned(), s(&count_key(k)))].into()).collect();
        let mut want = aws_sdk_dynamodb::types::KeysAndAttributes::builder()
            .set_keys(Some(keys))
            .consistent_read(true)
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))?;
        let mut items: Vec<Item> = Vec::new();
        // Keys DynamoDB leaves unprocessed (throttled) are asked again, a few times.
        for round in 0..5u32 {
            let out = self.client.batch_get_item().request_items(&self.table, want).send().await.map_err(sdk_error)?;
            if let Some(got) = out.responses.and_then(|mut r| r.remove(&self.table)) {
                items.extend(got);
            }
            match out.unprocessed_keys.and_then(|mut u| u.remove(&self.table)).filter(|k| !k.keys.is_empty()) {
                Some(left) if round < 4 => {
                    want = left;
                    tokio::time::sleep(Duration::from_millis(50 << round)).await;
                }
                Some(_) => return Err(StoreError::Unavailable("the queue's counts stayed unprocessed".into())),
                None => break,
            }
        }
        Ok(items)
    }

    /// An inline submit's one write: takes a permit if the breaker lets submits through, the
    /// queue is empty and a permit is left. Otherwise the state comes back (no second read).
    /// Before any submitter has published permits, there are `initial` (the window's starting
    /// size: a burst on a fresh deployment sends that many at once, and queues the rest).
    pub async fn take_permit(&self, now: Timestamp, initial: u32) -> Result<Permit, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("SET permits = if_not_exists(permits, :initial) - :one")
            .condition_expression(format!(
                "{BREAKER_LETS_SUBMITS} AND (attribute_not_exists(permits) OR permits > :zero) \
                 AND (attribute_not_exists(q_total) OR q_total <= :zero)"
            ))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":t", AttributeValue::Bool(true))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":initial", n(u64::from(initial.max(1))))
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(_) => Ok(Permit::Taken),
            Err(e) => match refused_item(&e) {
                Some(old) => Ok(Permit::Refused(Box::new(
                    old.map_or_else(|| Ok(SubmitState::default()), SubmitState::from_item)?,
                ))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Gives back a permit that was not used (the in.php pace had no slot left).
    pub async fn give_back_permit(&self) -> Result<(), StoreError> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("ADD permits :one")
            .expression_attribute_values(":one", n(1))
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }

    /// The count item shard a task is counted on (`QUEUE_SHARDS`).
    pub fn queue_shard(&self, task_ref: &TaskRef) -> u8 {
        task_ref.shard(self.queue_shards)
    }

    /// Counts a task into `lane` on its shard's count item (`shard`, [`TaskStore::queue_shard`])
    /// before it is put in the queue, within that item's share of the bounds (`max_lane` for the
    /// lane, `max_total` in all). `no_slot`: an inline submit met "no free thread" (no more
    /// permits until the submitter publishes them again, and the submitter learns of it: on the
    /// state item, a second write when the task counts elsewhere).
    pub async fn reserve_queue(
        &self,
        lane: &str,
        shard: u8,
        max_lane: u64,
        max_total: u64,
        no_slot: bool,
    ) -> Result<Reserved, StoreError> {
        let shards = self.queue_shards.max(1);
        let shard = shard % shards;
        let (lane_share, total_share) = (share(max_lane, shards), share(max_total, shards));
        // A no-slot answer stops the permits on the state item first (a rare path: a second
        // write there), so a reservation on it shows both.
        if no_slot {
            self.client
                .update_item()
                .table_name(&self.table)
                .key(attr::PK, s(Breaker::KEY))
                .update_expression("ADD ns_api :one SET permits = :zero")
                .expression_attribute_values(":one", n(1))
                .expression_attribute_values(":zero", n(0))
                .send()
                .await
                .map_err(sdk_error)?;
        }
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(&count_key(shard)))
            .update_expression("ADD q_total :one, #lane :one")
            .condition_expression(
                "(attribute_not_exists(q_total) OR q_total < :maxt) AND (attribute_not_exists(#lane) OR #lane < :maxl)",
            )
            .expression_attribute_names("#lane", lane_attr(lane))
            .expression_attribute_values(":one", n(1))
            .expression_attribute_values(":maxt", n(total_share))
            .expression_attribute_values(":maxl", n(lane_share))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => Ok(Reserved::Yes(Box::new(
                out.attributes.as_ref().map_or_else(|| Ok(SubmitState::default()), SubmitState::from_item)?,
            ))),
            Err(e) => match refused_item(&e) {
                Some(old) => {
                    let st = old.map_or_else(|| Ok(SubmitState::default()), SubmitState::from_item)?;
                    // One item's share seen: the depth in all is about the shards' count times it.
                    let times = u64::from(shards);
                    let in_lane = st.lanes.get(lane).copied().unwrap_or(0);
                    Ok(if in_lane >= lane_share {
                        Reserved::Full { owner: true, depth: in_lane * times, bound: max_lane }
                    } else {
                        Reserved::Full { owner: false, depth: st.queued * times, bound: max_total }
                    })
                }
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Counts a task into `lane` on count item `shard` without a bound (a released task going
    /// back), or out of it (`delta` negative: a task left the queue, or a reservation was not
    /// used).
    pub async fn count_queued(&self, lane: &str, shard: u8, delta: i64) -> Result<(), StoreError> {
        self.count_queued_many(&[((shard, lane.to_owned()), delta)]).await
    }

    /// Moves several lanes' counts, one write per count item touched (the submitter's releases
    /// and requeues of a tick, summed by item and lane). Zero deltas are left out; nothing to
    /// move, no write. Shards beyond `QUEUE_SHARDS` (a count since lowered) fold into theirs.
    pub async fn count_queued_many(&self, deltas: &[((u8, String), i64)]) -> Result<(), StoreError> {
        let shards = self.queue_shards.max(1);
        let mut by_item: BTreeMap<u8, BTreeMap<&str, i64>> = BTreeMap::new();
        for ((shard, lane), d) in deltas {
            *by_item.entry(shard % shards).or_default().entry(lane.as_str()).or_insert(0) += d;
        }
        for (shard, lanes) in by_item {
            let moves: Vec<((u8, String), i64)> =
                lanes.into_iter().filter(|(_, d)| *d != 0).map(|(l, d)| ((shard, l.to_owned()), d)).collect();
            self.move_counts(shard, &moves).await?;
        }
        Ok(())
    }

    /// One write moving lanes' counts (and the total by their sum) on count item `shard`.
    async fn move_counts(&self, shard: u8, moves: &[((u8, String), i64)]) -> Result<(), StoreError> {
        if moves.is_empty() {
            return Ok(());
        }
        let total: i64 = moves.iter().map(|(_, d)| d).sum();
        let mut update = "ADD q_total :total".to_owned();
        let mut req = self.client.update_item().table_name(&self.table).key(attr::PK, s(&count_key(shard)));
        for (i, ((_, lane), d)) in moves.iter().enumerate() {
            update.push_str(&format!(", #l{i} :d{i}"));
            req = req
                .expression_attribute_names(format!("#l{i}"), lane_attr(lane))
                .expression_attribute_values(format!(":d{i}"), AttributeValue::N(d.to_string()));
        }
        req.update_expression(update)
            .expression_attribute_values(":total", AttributeValue::N(total.to_string()))
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }

    /// Puts a new task in the queue (its reservation made): state queued, with the request and
    /// its pingback URL, listed under its lane, and how long after its release the poller should
    /// look at it if in.php's answer is never stored (`deadline_after`). Idempotent like
    /// [`TaskStore::create`]: with an idempotency key's `fingerprint`, an existing task comes back
    /// instead.
    pub async fn create_queued(
        &self,
        task: &Task,
        request: &SubmitRequest,
        pingback: &str,
        deadline_after: Duration,
        fingerprint: Option<&str>,
    ) -> Result<Created, StoreError> {
        let TaskState::Queued { queued_at, lane } = &task.state else {
            return Err(StoreError::Rejected(format!("task {} is not a queued task", task.task_ref)));
        };
        let json = serde_json::to_string(request).map_err(|e| StoreError::Rejected(e.to_string()))?;
        let extra: Item = [
            ("queued_at", n(queued_at.as_millis())),
            ("q_lane", s(lane)),
            ("sq_key", s(&queued_key(lane, self.queue_shard(&task.task_ref)))),
            ("sq_at", n(queued_at.as_millis())),
            ("sq_req", s(&json)),
            ("sq_pingback", s(pingback)),
            ("sq_busy", n(ms(task.kind.busy_for()))),
            ("sq_deadline", n(ms(deadline_after))),
        ]
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v))
        .chain(request.user_agent().map(|ua| (attr::USER_AGENT.to_owned(), s(ua))))
        .collect();
        self.put_new(task, None, fingerprint, extra).await
    }

    /// The oldest tasks waiting in `lane` (up to `limit`), over its index keys (one Query each,
    /// at once, merged oldest first).
    pub async fn queue_heads(&self, lane: &str, limit: i32) -> Result<Vec<QueuedRef>, StoreError> {
        let queries = (0..self.queue_shards.max(1)).map(|k| self.queue_heads_on(queued_key(lane, k), limit));
        let mut all = Vec::new();
        for part in futures_util::future::join_all(queries).await {
            all.extend(part?);
        }
        all.sort_by(|a, b| a.queued_at.cmp(&b.queued_at).then_with(|| a.task_ref.as_ref().cmp(b.task_ref.as_ref())));
        all.truncate(usize::try_from(limit).unwrap_or(0));
        Ok(all)
    }

    async fn queue_heads_on(&self, key: String, limit: i32) -> Result<Vec<QueuedRef>, StoreError> {
        let out = self
            .client
            .query()
            .table_name(&self.table)
            .index_name(QUEUE_INDEX)
            .key_condition_expression("sq_key = :k")
            .expression_attribute_values(":k", s(&key))
            .limit(limit)
            .send()
            .await
            .map_err(sdk_error)?;
        out.items()
            .iter()
            .map(|i| {
                Ok(QueuedRef {
                    task_ref: TaskRef::parse(super::req_s(i, attr::PK)?).map_err(super::corrupt(attr::PK))?,
                    queued_at: super::req_ts(i, "sq_at")?,
                })
            })
            .collect()
    }

    /// How many tasks wait in `lane` ahead of one queued at `queued_at` (at most `cap` are
    /// counted).
    pub async fn queue_ahead(&self, lane: &str, queued_at: Timestamp, cap: i32) -> Result<u64, StoreError> {
        let mut ahead = 0u64;
        for k in 0..self.queue_shards.max(1) {
            let out = self
                .client
                .query()
                .table_name(&self.table)
                .index_name(QUEUE_INDEX)
                .key_condition_expression("sq_key = :k AND sq_at < :at")
                .expression_attribute_values(":k", s(&queued_key(lane, k)))
                .expression_attribute_values(":at", n(queued_at.as_millis()))
                .select(Select::Count)
                .limit(cap)
                .send()
                .await
                .map_err(sdk_error)?;
            ahead += u64::try_from(out.count).unwrap_or(0);
        }
        Ok(ahead.min(u64::try_from(cap).unwrap_or(0)))
    }

    /// Every lane the index lists a queued task in, by lane and index shard (a Scan of the
    /// keys-only index: the safety net for a lane whose count was lost, and for tasks on shards
    /// a lowered `QUEUE_SHARDS` no longer reads).
    pub async fn queued_lanes(&self) -> Result<BTreeMap<(String, u8), u64>, StoreError> {
        let mut lanes = BTreeMap::new();
        let mut start = None;
        loop {
            let out = self
                .client
                .scan()
                .table_name(&self.table)
                .index_name(QUEUE_INDEX)
                .filter_expression("begins_with(sq_key, :q)")
                .expression_attribute_values(":q", s("q#"))
                .set_exclusive_start_key(start)
                .send()
                .await
                .map_err(sdk_error)?;
            for item in out.items() {
                if let Some((lane, shard)) = get_s(item, "sq_key")?.and_then(lane_of_key) {
                    *lanes.entry((lane.to_owned(), shard)).or_insert(0) += 1;
                }
            }
            match out.last_evaluated_key.filter(|k| !k.is_empty()) {
                Some(k) => start = Some(k),
                None => return Ok(lanes),
            }
        }
    }

    /// Moves the tasks queued under `lane`'s index key of `shard` — one a lowered
    /// `QUEUE_SHARDS` no longer reads — to their shards now, keeping their place (`sq_at`). How
    /// many moved.
    pub async fn rehome_queued(&self, lane: &str, shard: u8) -> Result<u64, StoreError> {
        let old = queued_key(lane, shard);
        let mut moved = 0;
        // Bounded: an index that lags its table could list a moved task again for a moment.
        for _ in 0..1_000 {
            let heads = self.queue_heads_on(old.clone(), 100).await?;
            if heads.is_empty() {
                return Ok(moved);
            }
            for h in heads {
                let res = self
                    .client
                    .update_item()
                    .table_name(&self.table)
                    .key(attr::PK, s(h.task_ref.as_ref()))
                    .update_expression("SET sq_key = :new")
                    .condition_expression("sq_key = :old")
                    .expression_attribute_values(":new", s(&queued_key(lane, self.queue_shard(&h.task_ref))))
                    .expression_attribute_values(":old", s(&old))
                    .send()
                    .await;
                if condition_held(res)? {
                    moved += 1;
                }
            }
        }
        Ok(moved)
    }

    /// Sets `lane`'s count in all to `actual` (a count left too high by a crash, or lost), as
    /// `state` saw it: the state item's share becomes `actual` less the other items' and the
    /// total moves by the difference, if that share is still what `state` saw. `false` if it
    /// changed meanwhile.
    pub async fn reconcile_lane(&self, lane: &str, state: &SubmitState, actual: u64) -> Result<bool, StoreError> {
        let seen = state.lanes_here.get(lane).copied().unwrap_or(0);
        let elsewhere = state.lanes_elsewhere.get(lane).copied().unwrap_or(0);
        let new = actual as i64 - elsewhere;
        let delta = new - seen;
        let cond = if seen == 0 { "attribute_not_exists(#lane) OR #lane = :seen" } else { "#lane = :seen" };
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression("SET #lane = :actual ADD q_total :d")
            .condition_expression(cond)
            .expression_attribute_names("#lane", lane_attr(lane))
            .expression_attribute_values(":actual", AttributeValue::N(new.to_string()))
            .expression_attribute_values(":seen", AttributeValue::N(seen.to_string()))
            .expression_attribute_values(":d", AttributeValue::N(delta.to_string()))
            .send()
            .await;
        condition_held(res)
    }

    /// Takes a queued task out of the queue to send it: queued → submitting, counted in work
    /// for its kind's time from `now`, due for the poller at its deadline (if in.php's answer is
    /// never stored) — both durations kept on the item since it was queued. `None` if it is no
    /// longer queued.
    pub async fn release(&self, task_ref: &TaskRef, now: Timestamp) -> Result<Option<Released>, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :submitting, released_at = :now, sq_key = :w, sq_at = :now + sq_busy, \
                 poll_shard = :shard, poll_due_at = :now + sq_deadline",
            )
            .condition_expression("#state = :queued")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":w", s(&in_work_key(task_ref, self.shards)))
            .expression_attribute_values(":shard", n(u64::from(self.shards.of(task_ref))))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        let item = match res {
            Ok(out) => out.attributes.unwrap_or_default(),
            Err(e) if refused_item(&e).is_some() => return Ok(None),
            Err(e) => return Err(sdk_error(e)),
        };
        let task = decode(Some(&item))?;
        let request: SubmitRequest = serde_json::from_str(super::req_s(&item, "sq_req")?)
            .map_err(|e| StoreError::Corrupt(format!("`sq_req`: {e}")))?;
        Ok(Some(Released {
            task,
            request,
            pingback: super::req_s(&item, "sq_pingback")?.to_owned(),
            lane: super::req_s(&item, "q_lane")?.to_owned(),
            queued_at: super::req_ts(&item, "queued_at")?,
        }))
    }

    /// Puts a task in.php refused explicitly (no free thread, a ban, a server error code) back
    /// at its place in the queue (its count made first). Only one in.php never took: still
    /// submitting, no id, no unknown outcome. `false` otherwise.
    pub async fn requeue(&self, task_ref: &TaskRef, lane: &str, queued_at: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :queued, queued_at = :at, q_lane = :lane, sq_key = :q, sq_at = :at \
                 REMOVE released_at, poll_shard, poll_due_at, lease_owner",
            )
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":at", n(queued_at.as_millis()))
            .expression_attribute_values(":lane", s(lane))
            .expression_attribute_values(":q", s(&queued_key(lane, self.queue_shard(task_ref))))
            .send()
            .await;
        condition_held(res)
    }

    /// What in.php needs to send a task that is still submitting without a CaptchaAI id: its
    /// request and pingback, kept since it was created or queued. `None`: not such a task, or
    /// one created before they were kept.
    pub async fn unsent_request(&self, task_ref: &TaskRef) -> Result<Option<(SubmitRequest, String)>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .projection_expression("sq_req, sq_pingback, captcha_id")
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        let Some(item) = out.item else { return Ok(None) };
        if item.contains_key("captcha_id") {
            return Ok(None);
        }
        let (Some(req), Some(pingback)) = (super::get_s(&item, "sq_req")?, super::get_s(&item, "sq_pingback")?) else {
            return Ok(None);
        };
        let request =
            serde_json::from_str(req).map_err(|e| StoreError::Corrupt(format!("task {task_ref}: sq_req: {e}")))?;
        Ok(Some((request, pingback.to_owned())))
    }

    /// Marks a task about to be sent to in.php a second time: still submitting, no CaptchaAI id
    /// known, never resent before. The mark comes first, so a task is resent at most once
    /// whatever crashes; `false`: not such a task (its result came, or another poller resent it).
    pub async fn mark_resent(&self, task_ref: &TaskRef, now: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("SET resent_at = :now REMOVE submit_unknown")
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(resent_at)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":now", n(now.as_millis()))
            .send()
            .await;
        condition_held(res)
    }

    /// Takes the mark back: in.php refused the resend explicitly (nothing was taken), so it may
    /// be sent again later. `false`: the task is no longer such a task.
    pub async fn clear_resent(&self, task_ref: &TaskRef) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("REMOVE resent_at")
            .condition_expression("#state = :submitting AND attribute_not_exists(captcha_id)")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .send()
            .await;
        condition_held(res)
    }

    /// Counts one more "refused for now" answer (a server error code, a connection that never
    /// opened) for a released task still submitting; returns how many it has had. A method
    /// CaptchaAI answers `ERROR_SERVER_ERROR` again and again (one it does not solve) is failed
    /// by the caller after [`crate::submit::MAX_REFUSALS_FOR_NOW`] of them, not retried for ever.
    /// `None`: the task is no longer submitting.
    pub async fn count_refusal_for_now(&self, task_ref: &TaskRef) -> Result<Option<u32>, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression("ADD sq_refused :one")
            .condition_expression("#state = :submitting")
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":one", n(1))
            .return_values(ReturnValue::UpdatedNew)
            .send()
            .await;
        match res {
            Ok(out) => Ok(Some(
                out.attributes
                    .as_ref()
                    .and_then(|a| a.get("sq_refused"))
                    .and_then(|v| v.as_n().ok())
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(1),
            )),
            Err(e) if refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// Turns an inline submit that was refused for now into a queued task (its reservation
    /// made): submitting → queued, with what in.php needs. Same conditions as
    /// [`TaskStore::requeue`].
    pub async fn queue_unsent(
        &self,
        task: &Task,
        lane: &str,
        queued_at: Timestamp,
        request: &SubmitRequest,
        pingback: &str,
        deadline_after: Duration,
    ) -> Result<bool, StoreError> {
        let task_ref = &task.task_ref;
        let json = serde_json::to_string(request).map_err(|e| StoreError::Rejected(e.to_string()))?;
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET #state = :queued, queued_at = :at, q_lane = :lane, sq_key = :q, sq_at = :at, sq_req = :req, \
                 sq_pingback = :pb, sq_busy = :busy, sq_deadline = :deadline REMOVE poll_shard, poll_due_at",
            )
            .condition_expression(
                "#state = :submitting AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)",
            )
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":queued", s("queued"))
            .expression_attribute_values(":submitting", s("submitting"))
            .expression_attribute_values(":at", n(queued_at.as_millis()))
            .expression_attribute_values(":lane", s(lane))
            .expression_attribute_values(":q", s(&queued_key(lane, self.queue_shard(task_ref))))
            .expression_attribute_values(":req", s(&json))
            .expression_attribute_values(":pb", s(pingback))
            .expression_attribute_values(":busy", n(ms(task.kind.busy_for())))
            .expression_attribute_values(":deadline", n(ms(deadline_after)))
            .send()
            .await;
        condition_held(res)
    }

    /// Fails a task that was never sent — it waited in the queue too long (`from_queue`), or
    /// in.php refused it for good when the queue released it — with `code`; its push (if any)
    /// becomes due: its owner heard nothing else. The task as stored, or `None` if it is no
    /// longer such a task.
    pub async fn fail_unsent(
        &self,
        task_ref: &TaskRef,
        from_queue: bool,
        code: &str,
        detail: &str,
        now: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let condition = if from_queue {
            "#state = :from"
        } else {
            "#state = :from AND attribute_not_exists(captcha_id) AND attribute_not_exists(submit_unknown)"
        };
        let req = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(format!(
                "SET #state = :failed, error_code = :code, error_detail = :detail, resolved_at = :now, \
                 resolved_via = :via, expires_ttl = :ttl, {} REMOVE {}, {}",
                super::DELIVERY_DUE,
                super::UNSENT_CLEAR,
                super::DELIVERY_CLEAR
            ))
            .condition_expression(condition)
            .expression_attribute_names("#state", attr::STATE)
            .expression_attribute_values(":failed", s("failed"))
            .expression_attribute_values(":from", s(if from_queue { "queued" } else { "submitting" }))
            .expression_attribute_values(":code", s(code))
            .expression_attribute_values(":detail", s(detail))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":via", s(crate::domain::Via::Submit.as_str()))
            .expression_attribute_values(":ttl", self.ttl(now))
            .return_values(ReturnValue::AllNew);
        match super::delivery_due(req, now).send().await {
            Ok(out) => {
                let task = decode(out.attributes.as_ref())?;
                self.push_due(&task, now);
                Ok(Some(task))
            }
            Err(e) if refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// The tasks CaptchaAI may be working on at `now`: every one listed in work whose thread is
    /// not surely free yet (keys only; one small Query per shard, at once).
    pub async fn in_work(&self, now: Timestamp) -> Result<Vec<TaskRef>, StoreError> {
        let queries = (0..self.shards.read()).map(|shard| async move {
            let mut refs = Vec::new();
            let mut start = None;
            loop {
                let out = self
                    .client
                    .query()
                    .table_name(&self.table)
                    .index_name(QUEUE_INDEX)
                    .key_condition_expression("sq_key = :k AND sq_at > :now")
                    .expression_attribute_values(":k", s(&format!("w#{shard}")))
                    .expression_attribute_values(":now", n(now.as_millis()))
                    .set_exclusive_start_key(start)
                    .send()
                    .await
                    .map_err(sdk_error)?;
                for i in out.items() {
                    refs.push(TaskRef::parse(super::req_s(i, attr::PK)?).map_err(super::corrupt(attr::PK))?);
                }
                match out.last_evaluated_key.filter(|k| !k.is_empty()) {
                    Some(k) => start = Some(k),
                    None => return Ok::<_, StoreError>(refs),
                }
            }
        });
        let mut all = Vec::new();
        for part in futures_util::future::join_all(queries).await {
            all.extend(part?);
        }
        Ok(all)
    }

    /// Takes or renews the submitter's lease until `until` (free, lapsed or already `me`'s),
    /// publishing what it knows; the state after it, its counts summed over every count item
    /// in use. `None`: another submitter holds it.
    pub async fn releaser_lease(
        &self,
        me: &str,
        now: Timestamp,
        until: Timestamp,
        publish: Option<&Publish>,
    ) -> Result<Option<SubmitState>, StoreError> {
        let mut update = "SET rel_owner = :me, rel_until = :until".to_owned();
        let mut req = self.client.update_item().table_name(&self.table).key(attr::PK, s(Breaker::KEY));
        if let Some(p) = publish {
            update.push_str(", permits = :permits, win = :win, rel_rate = :rate, ns_seen = :seen");
            req = req
                .expression_attribute_values(":seen", n(p.api_no_slots_seen))
                .expression_attribute_values(":permits", n(u64::from(p.permits)))
                .expression_attribute_values(":win", s(&p.window))
                .expression_attribute_values(":rate", n(p.released_per_minute));
        }
        let res = req
            .update_expression(update)
            .condition_expression("attribute_not_exists(rel_until) OR rel_until <= :now OR rel_owner = :me")
            .expression_attribute_values(":me", s(me))
            .expression_attribute_values(":until", n(until.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match res {
            Ok(out) => {
                // The renewal returns the state item; the other count items are read to add
                // theirs (one more read a tick, only with `QUEUE_SHARDS` > 1).
                let others =
                    if self.queue_shards > 1 { self.count_items(1..self.queue_shards).await? } else { Vec::new() };
                Ok(Some(SubmitState::summed(&out.attributes.unwrap_or_default(), &others)?))
            }
            Err(e) if refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// Ends `me`'s lease (publishing a last time).
    pub async fn releaser_leave(&self, me: &str, publish: &Publish) -> Result<(), StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(Breaker::KEY))
            .update_expression(
                "SET rel_until = :zero, permits = :permits, win = :win, rel_rate = :rate, ns_seen = :seen",
            )
            .expression_attribute_values(":seen", n(publish.api_no_slots_seen))
            .condition_expression("rel_owner = :me")
            .expression_attribute_values(":me", s(me))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":permits", n(u64::from(publish.permits)))
            .expression_attribute_values(":win", s(&publish.window))
            .expression_attribute_values(":rate", n(publish.released_per_minute))
            .send()
            .await;
        condition_held(res).map(|_| ())
    }

    /// Wakes the submitter: a write to [`WAKE_KEY`], at most one a second (the table's stream
    /// starts an invocation on it). `false`: one was written less than a second ago.
    pub async fn wake_submitter(&self, now: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, s(WAKE_KEY))
            .update_expression("SET wake_at = :now, expires_ttl = :ttl")
            .condition_expression("attribute_not_exists(wake_at) OR wake_at < :second_ago")
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":second_ago", n(now.as_millis().saturating_sub(1_000)))
            .expression_attribute_values(":ttl", n(now.as_secs() + 86_400))
            .send()
            .await;
        condition_held(res)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::{CaptchaId, CaptchaKind, Delivery, Outcome, Solution, Via};
    use crate::store::{Created, RecordOutcome, Stop};
    use crate::testkit::LocalDynamo;

    fn t(secs: u64) -> Timestamp {
        Timestamp::from_millis(1_796_210_146_000 + secs * 1000)
    }

    const LANE: &str = "0123456789abcdef.t";

    fn turnstile() -> SubmitRequest {
        SubmitRequest::Turnstile {
            sitekey: "0x4AAA".into(),
            pageurl: "https://shop.example/".into(),
            action: Some("login".into()),
            data: None,
        }
    }

    async fn queue_one(store: &TaskStore, at: u64) -> anyhow::Result<Task> {
        let task = Task::queued(TaskRef::generate(), CaptchaKind::Turnstile, t(at), LANE.into());
        assert!(matches!(store.reserve_queue(LANE, 0, 100, 100, false).await?, Reserved::Yes(_)));
        assert_eq!(
            store
                .create_queued(&task, &turnstile(), "https://relay/callback/x/y", Duration::from_secs(110), None)
                .await?,
            Created::New
        );
        Ok(task)
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_task_counts_in_work_from_its_send_to_its_result_or_its_longest_solve() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, t(0));
        store.create(&task, t(600), None).await?;
        assert_eq!(store.in_work(t(1)).await?, vec![task.task_ref.clone()], "counted before in.php answers");
        let id = CaptchaId::parse("7001")?;
        store.mark_submitted(&task.task_ref, &id, t(1), t(21)).await?;
        assert_eq!(store.in_work(t(2)).await?.len(), 1);
        assert!(
            store.in_work(t(15)).await?.is_empty(),
            "past Turnstile's typical 15 s: likely done, its pingback lost"
        );
        let d = Delivery {
            captcha_id: id,
            outcome: Outcome::Solved(Solution::parse("tok")?),
            received_at: t(5),
            via: Via::Callback,
            token_clock_start: t(5),
        };
        assert!(matches!(store.record_result(&task.task_ref, &d).await?, RecordOutcome::Recorded(_)));
        assert!(store.in_work(t(6)).await?.is_empty(), "the result write ends it");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn several_lanes_move_in_one_write_and_nothing_moved_writes_nothing() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        for _ in 0..3 {
            assert!(matches!(store.reserve_queue("aaaaaaaaaaaaaaaa.t", 0, 100, 100, false).await?, Reserved::Yes(_)));
        }
        assert!(matches!(store.reserve_queue("bbbbbbbbbbbbbbbb.i", 0, 100, 100, false).await?, Reserved::Yes(_)));
        store
            .count_queued_many(&[
                ((0, "aaaaaaaaaaaaaaaa.t".into()), -2),
                ((0, "bbbbbbbbbbbbbbbb.i".into()), 0),
                ((0, "cccccccccccccccc.t".into()), 1),
            ])
            .await?;
        let st = store.submit_state().await?;
        assert_eq!(st.queued, 3, "4 - 2 + 1");
        assert_eq!(
            (
                st.lanes.get("aaaaaaaaaaaaaaaa.t").copied(),
                st.lanes.get("bbbbbbbbbbbbbbbb.i").copied(),
                st.lanes.get("cccccccccccccccc.t").copied()
            ),
            (Some(1), Some(1), Some(1))
        );
        store.count_queued_many(&[((0, "aaaaaaaaaaaaaaaa.t".into()), 0)]).await?;
        store.count_queued_many(&[]).await?;
        assert_eq!(store.submit_state().await?, st, "zero deltas write nothing");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn queued_tasks_are_listed_oldest_first_released_once_and_put_back_at_their_place() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let a = queue_one(&store, 1).await?;
        let b = queue_one(&store, 2).await?;
        let c = queue_one(&store, 3).await?;
        let heads: Vec<TaskRef> = store.queue_heads(LANE, 10).await?.into_iter().map(|h| h.task_ref).collect();
        assert_eq!(heads, vec![a.task_ref.clone(), b.task_ref.clone(), c.task_ref.clone()]);
        assert_eq!(store.queue_ahead(LANE, t(3), 100).await?, 2, "c has two ahead");
        let st = store.submit_state().await?;
        assert_eq!((st.queued, st.lanes.get(LANE).copied()), (3, Some(3)));
        assert!(store.in_work(t(4)).await?.is_empty(), "queued is not in work");

        // Released: submitting, in work, with what in.php needs; only once.
        let r = store.release(&a.task_ref, t(10)).await?.expect("queued");
        assert_eq!((r.request, r.lane.as_str(), r.queued_at), (turnstile(), LANE, t(1)));
        assert_eq!(r.pingback, "https://relay/callback/x/y");
        assert!(matches!(r.task.state, TaskState::Submitting { unknown: None }));
        assert_eq!(r.task.released_at, Some(t(10)));
        assert_eq!(r.task.submitted_or_created_at(), t(10), "its deadlines count from the release");
        assert!(store.release(&a.task_ref, t(10)).await?.is_none(), "never twice");
        store.count_queued(LANE, 0, -1).await?;
        assert_eq!(store.in_work(t(11)).await?, vec![a.task_ref.clone()]);
        assert!(store.in_work(t(24)).await?.contains(&a.task_ref), "busy for Turnstile's 15 s from its release");
        assert!(store.in_work(t(25)).await?.is_empty());
        let shard = store.shards().of(&a.task_ref);
        assert!(store.due_page(shard, t(119), 10, None).await?.tasks.is_empty());
        let due = store.due_page(shard, t(120), 10, None).await?;
        assert!(due.tasks.iter().any(|d| d.task.task_ref == a.task_ref), "the poller sees it 110 s after its release");

        // No free thread: back at its place, ahead of b.
        store.count_queued(LANE, 0, 1).await?;
        assert!(store.requeue(&a.task_ref, LANE, r.queued_at).await?);
        let heads: Vec<TaskRef> = store.queue_heads(LANE, 10).await?.into_iter().map(|h| h.task_ref).collect();
        assert_eq!(heads.first(), Some(&a.task_ref));
        assert!(store.in_work(t(12)).await?.is_empty());
        let back = store.get(&a.task_ref).await?.expect("stored");
        assert_eq!((back.state.name(), back.released_at), ("queued", None));

        // A release whose answer was lost is never put back (it may have been taken).
        let r = store.release(&a.task_ref, t(20)).await?.expect("queued again");
        store.mark_submit_unknown(&a.task_ref, "cut").await?;
        assert!(!store.requeue(&a.task_ref, LANE, r.queued_at).await?, "an unknown outcome stays unknown");
        // A task in.php took is never put back either.
        let rb = store.release(&b.task_ref, t(21)).await?.expect("queued");
        store.mark_submitted(&b.task_ref, &CaptchaId::parse("7002")?, t(21), t(41)).await?;
        assert!(!store.requeue(&b.task_ref, LANE, rb.queued_at).await?);
        let b_now = store.get(&b.task_ref).await?.expect("stored");
        assert_eq!(b_now.state.name(), "pending");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_task_that_waited_too_long_fails_unsent_and_its_push_falls_due() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let task = Task {
            owner_callback: Some("https://owner.example/hook".into()),
            webhook_owner: Some("default".into()),
            ..Task::queued(TaskRef::generate(), CaptchaKind::Image, t(0), LANE.into())
        };
        store.reserve_queue(LANE, 0, 10, 10, false).await?;
        store.create_queued(&task, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
        let failed = store
            .fail_unsent(&task.task_ref, true, crate::submit::QUEUE_TIMEOUT, "waited too long", t(600))
            .await?
            .expect("it was queued");
        assert!(
            matches!(&failed.state, TaskState::Failed { code, via: Via::Submit, .. } if code.as_ref() == crate::submit::QUEUE_TIMEOUT)
        );
        assert_eq!(failed.delivery.map(|d| d.status), Some(crate::domain::DeliveryStatus::Pending), "its owner hears");
        assert!(store.queue_heads(LANE, 10).await?.is_empty(), "out of the queue");
        assert!(store.fail_unsent(&task.task_ref, true, "X", "again", t(601)).await?.is_none());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn permits_are_taken_only_while_nobody_waits_and_the_breaker_lets_submits_through() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        // Before any submitter published: the window's starting size.
        assert_eq!(store.take_permit(t(0), 2).await?, Permit::Taken);
        assert_eq!(store.take_permit(t(0), 2).await?, Permit::Taken);
        let Permit::Refused(st) = store.take_permit(t(0), 2).await? else { panic!("none left") };
        assert_eq!(st.permits, Some(0));
        store.give_back_permit().await?;
        assert_eq!(store.take_permit(t(0), 2).await?, Permit::Taken);
        // Published permits, but a task waits: it goes first.
        store.releaser_lease("me", t(1), t(11), Some(&Publish { permits: 5, ..Publish::default() })).await?;
        queue_one(&store, 1).await?;
        assert!(matches!(store.take_permit(t(2), 2).await?, Permit::Refused(_)));
        store.count_queued(LANE, 0, -1).await?;
        assert_eq!(store.take_permit(t(2), 2).await?, Permit::Taken);
        // A ban stops inline submits; a pause for res.php answers does not.
        store.open_breaker(t(100), "MAX_USER_TURN", Stop::Ban { needs_operator: false }, t(3)).await?;
        let Permit::Refused(st) = store.take_permit(t(4), 2).await? else { panic!("banned") };
        assert_eq!(st.breaker.open_for_submits_at(t(4)), Some(t(100)));
        assert_eq!(store.take_permit(t(100), 2).await?, Permit::Taken, "the ban is over");
        store.open_breaker(t(200), "timeouts", Stop::NoAnswers, t(101)).await?;
        assert_eq!(store.take_permit(t(102), 2).await?, Permit::Taken);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_queue_is_bounded_per_lane_and_in_all_and_a_no_slot_stops_permits() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let other = "fedcba9876543210.i";
        assert!(matches!(store.reserve_queue(LANE, 0, 2, 3, false).await?, Reserved::Yes(_)));
        assert!(matches!(store.reserve_queue(LANE, 0, 2, 3, false).await?, Reserved::Yes(_)));
        assert_eq!(
            store.reserve_queue(LANE, 0, 2, 3, false).await?,
            Reserved::Full { owner: true, depth: 2, bound: 2 }
        );
        let Reserved::Yes(st) = store.reserve_queue(other, 0, 2, 3, true).await? else { panic!("room in all") };
        assert_eq!((st.queued, st.api_no_slots, st.permits), (3, 1, Some(0)), "no more inline submits");
        assert_eq!(
            store.reserve_queue(other, 0, 2, 3, false).await?,
            Reserved::Full { owner: false, depth: 3, bound: 3 }
        );
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn one_submitter_holds_the_lease_until_it_leaves_or_lets_it_lapse() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let publish = Publish { permits: 3, window: "{}".into(), released_per_minute: 42, api_no_slots_seen: 0 };
        assert!(store.releaser_lease("a", t(0), t(10), Some(&publish)).await?.is_some());
        assert!(store.releaser_lease("b", t(5), t(15), None).await?.is_none(), "held");
        let st = store.releaser_lease("a", t(5), t(15), None).await?.expect("renewed");
        assert!(st.releaser_live(t(14)) && !st.releaser_live(t(15)));
        assert_eq!((st.permits, st.released_per_minute, st.window.as_deref()), (Some(3), 42, Some("{}")));
        assert!(store.releaser_lease("b", t(15), t(25), None).await?.is_some(), "lapsed: taken over");
        store.releaser_leave("a", &publish).await?;
        assert!(store.submit_state().await?.releaser_live(t(16)), "a left nothing: b holds it");
        store.releaser_leave("b", &publish).await?;
        assert!(!store.submit_state().await?.releaser_live(t(16)));
        assert!(store.releaser_lease("c", t(16), t(26), None).await?.is_some());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_count_a_crash_left_wrong_is_set_right_against_the_index() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        queue_one(&store, 1).await?;
        // A crash between a reservation and its put: counted, never queued.
        store.reserve_queue("0000000000000000.t", 0, 10, 10, false).await?;
        // And a task whose count was lost.
        let lost = Task::queued(TaskRef::generate(), CaptchaKind::Image, t(2), "1111111111111111.i".into());
        store.create_queued(&lost, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
        let listed = store.queued_lanes().await?;
        assert_eq!(listed.get(&(LANE.to_owned(), 0)), Some(&1));
        assert_eq!(listed.get(&("1111111111111111.i".to_owned(), 0)), Some(&1));
        assert_eq!(listed.len(), 2, "{listed:?}");
        let seen = store.submit_state().await?;
        assert!(store.reconcile_lane("0000000000000000.t", &seen, 0).await?);
        assert!(store.reconcile_lane("1111111111111111.i", &seen, 1).await?);
        let stale = SubmitState { lanes_here: [(LANE.to_owned(), 5)].into(), ..SubmitState::default() };
        assert!(!store.reconcile_lane(LANE, &stale, 0).await?, "a count that changed meanwhile is left alone");
        let st = store.submit_state().await?;
        assert_eq!(st.queued, 2);
        assert_eq!(st.lanes.keys().cloned().collect::<Vec<_>>(), vec![LANE.to_owned(), "1111111111111111.i".into()]);
        Ok(())
    }

    #[test]
    fn queued_index_keys_name_their_lane_and_shard() {
        assert_eq!(queued_key(LANE, 0), format!("q#{LANE}"));
        assert_eq!(queued_key(LANE, 3), format!("q#{LANE}#3"));
        for k in [0u8, 3, 31] {
            assert_eq!(lane_of_key(&queued_key(LANE, k)), Some((LANE, k)));
        }
        assert_eq!(lane_of_key("w#3"), None);
        assert_eq!(lane_of_key("q#odd#lane"), Some(("odd#lane", 0)), "a suffix that is no shard stays in the lane");
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_lane_spread_over_index_keys_is_read_oldest_first_and_a_lowered_count_moves_its_tasks()
    -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?.with_queue_shards(4);
        let mut made = Vec::new();
        for at in 1..=12u64 {
            let task = Task::queued(TaskRef::generate(), CaptchaKind::Turnstile, t(at), LANE.into());
            store.create_queued(&task, &turnstile(), "https://relay/cb", Duration::from_secs(110), None).await?;
            made.push(task.task_ref);
        }
        let listed = store.queued_lanes().await?;
        assert!(listed.len() > 1, "12 tasks over 4 index keys: {listed:?}");
        assert_eq!(listed.values().sum::<u64>(), 12);
        let heads: Vec<TaskRef> = store.queue_heads(LANE, 5).await?.into_iter().map(|h| h.task_ref).collect();
        assert_eq!(heads, made[..5], "oldest first across the keys");
        assert_eq!(store.queue_ahead(LANE, t(8), 100).await?, 7);
        assert_eq!(store.queue_ahead(LANE, t(8), 3).await?, 3, "capped");
        // Lowered to 1: the index keys beyond it are moved back, in their places.
        let one = store.clone().with_queue_shards(1);
        let stray: Vec<u8> = listed.keys().map(|(_, k)| *k).filter(|k| *k > 0).collect();
        let mut moved = 0;
        for k in stray {
            moved += one.rehome_queued(LANE, k).await?;
        }
        assert_eq!(moved, 12 - listed.get(&(LANE.to_owned(), 0)).copied().unwrap_or(0));
        let heads: Vec<TaskRef> = one.queue_heads(LANE, 20).await?.into_iter().map(|h| h.task_ref).collect();
        assert_eq!(heads, made, "every task on the one key left, oldest first");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn counts_spread_over_items_hold_their_bounds_in_sum_and_read_as_one() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?.with_queue_shards(4);
        // Bounds 8 in the lane and 12 in all: shares of 2 and 3 on each of the 4 items.
        for shard in 0..4u8 {
            for _ in 0..2 {
                assert!(matches!(store.reserve_queue(LANE, shard, 8, 12, false).await?, Reserved::Yes(_)));
            }
            assert_eq!(
                store.reserve_queue(LANE, shard, 8, 12, false).await?,
                Reserved::Full { owner: true, depth: 8, bound: 8 },
                "item {shard}'s share of the lane is taken: about 8 in all"
            );
        }
        let other = "1111111111111111.i";
        assert!(matches!(store.reserve_queue(other, 3, 8, 12, true).await?, Reserved::Yes(_)));
        assert_eq!(
            store.reserve_queue(other, 3, 8, 12, false).await?,
            Reserved::Full { owner: false, depth: 12, bound: 12 },
            "item 3 holds its share of the total"
        );
        let st = store.submit_state().await?;
        assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other).copied()), (9, Some(8), Some(1)));
        assert_eq!((st.api_no_slots, st.permits), (1, Some(0)), "a no-slot answer reaches the state item");
        assert_eq!(st.lanes_here.get(LANE), Some(&2));
        assert_eq!(st.lanes_elsewhere.get(LANE), Some(&6));
        // The submitter's lease renewal answers with the same sums (its view between reads).
        let leased = store.releaser_lease("s", t(1), t(11), None).await?.expect("the lease is free");
        assert_eq!((leased.queued, leased.lanes.clone()), (st.queued, st.lanes.clone()));
        // The submitter's moves of a tick: one write per item touched.
        store.count_queued_many(&[((1, LANE.into()), -2), ((2, LANE.into()), -1), ((3, other.into()), -1)]).await?;
        let st = store.submit_state().await?;
        assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other)), (5, Some(5), None));
        // A count wrong in all is set right on the state item's share: 5 counted, 1 listed.
        assert!(store.reconcile_lane(LANE, &st, 1).await?);
        let st = store.submit_state().await?;
        assert_eq!((st.queued, st.lanes.get(LANE).copied()), (1, Some(1)));
        assert_eq!(st.lanes_here.get(LANE), Some(&-2), "the state item's share absorbs the others'");
        // The count lowered to 1: what the other items hold is folded onto the state item once
        // (the submitter's start), and moves on their shards land on the one left.
        assert!(matches!(store.reserve_queue(other, 2, 8, 12, false).await?, Reserved::Yes(_)));
        let one = store.clone().with_queue_shards(1);
        assert_eq!(one.submit_state().await?.queued, 0, "-1 here, +1 on item 2 not read yet");
        assert_eq!(one.fold_queue_shards().await?, 2, "items 2 and 3 held counts (item 1 sums to 0)");
        assert_eq!(one.fold_queue_shards().await?, 0, "folded once");
        let st = one.submit_state().await?;
        assert_eq!((st.queued, st.lanes.get(LANE).copied(), st.lanes.get(other).copied()), (2, Some(1), Some(1)));
        one.count_queued(other, 3, -1).await?;
        assert_eq!(one.submit_state().await?.queued, 1);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_wake_item_is_written_at_most_once_a_second() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        assert!(store.wake_submitter(t(0)).await?);
        assert!(!store.wake_submitter(t(0).plus(Duration::from_millis(500))).await?);
        assert!(store.wake_submitter(t(1).plus(Duration::from_millis(1))).await?);
        Ok(())
    }
}

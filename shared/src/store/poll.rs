//! The due-for-poll index: pages of open tasks due for a res.php read, claims on them,
//! rescheduling and expiry, and what an operator reads of the shards.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};

use super::{
    DELIVERY_CLEAR, DELIVERY_DUE, DELIVERY_INDEX, DUE_INDEX, Item, PollIndex, StoreError, UNSENT_CLEAR, attr,
    condition_held, delivery_due, get_ts, get_u32, n, refused_item, req_ts, s, sdk_error,
};
use crate::domain::{Task, TaskRef, Via};
use crate::time::Timestamp;

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

impl PollIndex {
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
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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
            let mut pages = self
                .client
                .query()
                .table_name(&*self.table)
                .index_name(index)
                .key_condition_expression("#k = :shard")
                .expression_attribute_names("#k", key)
                .expression_attribute_values(":shard", n(u64::from(shard)))
                .select(aws_sdk_dynamodb::types::Select::Count)
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                total += u64::try_from(page.map_err(sdk_error)?.count).unwrap_or(0);
            }
            Ok::<_, StoreError>(total)
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
                .table_name(&*self.table)
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
}

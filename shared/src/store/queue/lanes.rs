//! Queued tasks in their lanes: put in, listed oldest first, taken out to be sent, put back.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::{ReturnValue, Select};

use super::*;

impl SubmitQueue {
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
            .table_name(&*self.table)
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
                .table_name(&*self.table)
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
        let mut pages = self
            .client
            .scan()
            .table_name(&*self.table)
            .index_name(QUEUE_INDEX)
            .filter_expression("begins_with(sq_key, :q)")
            .expression_attribute_values(":q", s("q#"))
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            for item in page.map_err(sdk_error)?.items() {
                if let Some((lane, shard)) = get_s(item, "sq_key")?.and_then(lane_of_key) {
                    *lanes.entry((lane.to_owned(), shard)).or_insert(0) += 1;
                }
            }
        }
        Ok(lanes)
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
                    .table_name(&*self.table)
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

    /// Takes a queued task out of the queue to send it: queued → submitting, counted in work
    /// for its kind's time from `now`, due for the poller at its deadline (if in.php's answer is
    /// never stored) — both durations kept on the item since it was queued. `None` if it is no
    /// longer queued.
    pub async fn release(&self, task_ref: &TaskRef, now: Timestamp) -> Result<Option<Released>, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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
}

//! The push of results to owners' callbacks: a transactional outbox in the task item itself.
//!
//! A task with an owner callback carries `dlv_shard` from its creation. The write that makes it
//! terminal (a result recorded, an expiry, a late result) sets `dlv_due` in the same
//! conditional write, so the item enters the sparse `due-for-delivery` index at the moment the
//! result is recorded: there is no instant at which the result is stored but its push is not
//! owed. The delivery worker claims a due item with a lease (its `dlv_due` moves to the lease's
//! end, so a crashed worker's claim comes back by itself), sends, and records the outcome under
//! the same lease: delivered (out of the index), a retry (`dlv_due` moved to the next attempt),
//! gone (410) or parked: `dlv_due` moves above [`PARKED_BASE`] (the base plus when it was
//! parked), out of reach of every due query, where an operator lists parked pushes by time and
//! replays them. One index for both, so an existing stack adds it in one deploy.

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue};

use super::{Item, PageKey, Pushes, StoreError, attr, condition_held, get_s, get_ts, get_u32, n, s, sdk_error};
use crate::domain::schedule::Failures;
use crate::domain::{DeliveryState, DeliveryStatus, Task, TaskRef};
use crate::time::Timestamp;

/// The sparse index of pushes due (hash `dlv_shard`, range `dlv_due`, keys only).
pub const DELIVERY_INDEX: &str = "due-for-delivery";
/// A parked push's `dlv_due` is this plus when it was parked (epoch ms): the year 33658, never
/// due, and still ordered by parking time.
pub const PARKED_BASE: u64 = 1_000_000_000_000_000;
/// The owner whose secret signs pushes of tasks submitted through `POST /tasks`.
pub const DEFAULT_OWNER: &str = "default";
/// Webhook secrets of one owner are kept under `whsec#<owner>`.
const SECRET_PREFIX: &str = "whsec#";

/// A push the index lists as due.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DueDelivery {
    pub task_ref: TaskRef,
    /// The `dlv_due` it was listed under: a claim is conditional on it being unchanged.
    pub due_at: Timestamp,
}

/// How an attempt (or a claim that needed none) ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryFinish {
    /// The owner's endpoint took it (`id` is the `webhook-id` sent).
    Delivered { id: String, outcome: String },
    /// This very result was delivered before (same `webhook-id`): done, and the claim's attempt
    /// is given back.
    AlreadyDelivered { id: String },
    /// Try again at `at`, with the failure counts the schedule keeps.
    Retry { at: Timestamp, outcome: String, failures: Failures },
    /// No more attempts: kept for an operator.
    Parked { outcome: String },
    /// The endpoint answered 410.
    Gone { outcome: String },
    /// Not sent (its host's turn came too late for the claim): due again at `at`, the claim's
    /// attempt given back.
    Deferred { at: Timestamp },
}

/// The delivery state of a task item (only read for tasks with an owner callback).
pub(super) fn state(item: &Item) -> Result<DeliveryState, StoreError> {
    use attr::*;
    let status = match get_s(item, DLV_STATUS)? {
        Some(v) => DeliveryStatus::parse(v).map_err(|e| StoreError::Corrupt(format!("`{DLV_STATUS}`: {e}")))?,
        None => DeliveryStatus::Waiting,
    };
    let due = get_ts(item, DLV_DUE)?.filter(|d| d.as_millis() < PARKED_BASE);
    Ok(DeliveryState {
        status,
        attempts: get_u32(item, DLV_ATTEMPTS)?,
        next_attempt_at: due.filter(|_| matches!(status, DeliveryStatus::Pending | DeliveryStatus::Retrying)),
        last_attempt_at: get_ts(item, DLV_LAST_AT)?,
        last_outcome: get_s(item, DLV_LAST)?.map(str::to_owned),
        delivered_at: get_ts(item, DLV_DONE_AT)?,
        delivered_id: get_s(item, DLV_DONE_ID)?.map(str::to_owned),
        parked_at: get_ts(item, DLV_PARKED_AT)?,
        failures: Failures { token: get_u32(item, DLV_TOKEN_FAILS)?, standard: get_u32(item, DLV_STANDARD_FAILS)? },
    })
}

fn due_of(item: &Item) -> Result<DueDelivery, StoreError> {
    let range = attr::DLV_DUE;
    let pk = item
        .get(attr::PK)
        .and_then(|v| v.as_s().ok())
        .ok_or_else(|| StoreError::Corrupt("index entry without `pk`".into()))?;
    Ok(DueDelivery {
        task_ref: TaskRef::parse(pk).map_err(|e| StoreError::Corrupt(format!("`pk`: {e}")))?,
        due_at: get_ts(item, range)?.ok_or_else(|| StoreError::Corrupt(format!("`{range}` missing")))?,
    })
}

impl Pushes {
    /// One page of pushes due at `now` in one shard of the due-for-delivery index, oldest first
    /// (a Query on a sparse index: its cost follows the pushes owed, not the table's size).
    pub async fn due_deliveries(
        &self,
        shard: u8,
        now: Timestamp,
        limit: i32,
        start: Option<PageKey>,
    ) -> Result<(Vec<DueDelivery>, Option<PageKey>), StoreError> {
        let out = self
            .client
            .query()
            .table_name(&*self.table)
            .index_name(DELIVERY_INDEX)
            .key_condition_expression("dlv_shard = :shard AND dlv_due <= :now")
            .expression_attribute_values(":shard", n(u64::from(shard)))
            .expression_attribute_values(":now", n(now.as_millis()))
            .limit(limit)
            .set_exclusive_start_key(start)
            .send()
            .await
            .map_err(sdk_error)?;
        let due = out.items().iter().map(due_of).collect::<Result<Vec<_>, _>>()?;
        Ok((due, out.last_evaluated_key.filter(|k| !k.is_empty())))
    }

    /// The earliest `dlv_due` across the shards (a lease's end counts: a lapsing lease is work),
    /// for the age of the oldest push owed. One Query of one item per shard.
    pub async fn oldest_delivery_due(&self) -> Result<Option<Timestamp>, StoreError> {
        let queries = (0..self.shards.read()).map(|shard| {
            self.client
                .query()
                .table_name(&*self.table)
                .index_name(DELIVERY_INDEX)
                .key_condition_expression("dlv_shard = :shard AND dlv_due < :parked")
                .expression_attribute_values(":shard", n(u64::from(shard)))
                .expression_attribute_values(":parked", n(PARKED_BASE))
                .limit(1)
                .send()
        });
        let mut oldest: Option<Timestamp> = None;
        for out in futures_util::future::join_all(queries).await {
            let out = out.map_err(sdk_error)?;
            for item in out.items() {
                let d = due_of(item)?;
                oldest = Some(oldest.map_or(d.due_at, |o| o.min(d.due_at)));
            }
        }
        Ok(oldest)
    }

    /// Claims a due push until `lease_until` and counts its attempt, before anything is sent
    /// (a worker killed mid-send still used it). Conditional on the listing being current, so
    /// two workers never both win. Returns the task as it now stands, to build the push from;
    /// `None` if another worker or a newer result got there first.
    pub async fn claim_delivery(
        &self,
        due: &DueDelivery,
        owner: &str,
        lease_until: Timestamp,
    ) -> Result<Option<Task>, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(due.task_ref.as_ref()))
            .update_expression(
                "SET dlv_due = :lease, dlv_lease = :owner, dlv_attempts = if_not_exists(dlv_attempts, :zero) + :one",
            )
            .condition_expression("dlv_due = :seen AND attribute_exists(dlv_shard)")
            .expression_attribute_values(":lease", n(lease_until.as_millis()))
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":seen", n(due.due_at.as_millis()))
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":one", n(1))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match res {
            Ok(out) => Ok(Some(super::decode(out.attributes.as_ref())?)),
            Err(e) if super::refused_item(&e).is_some() => Ok(None),
            Err(e) => Err(sdk_error(e)),
        }
    }

    /// Records how a claimed push ended, under the claim's lease. `false` if the lease was lost
    /// (it lapsed and another worker claimed it, or a newer result made a new push due): the
    /// newer state stands.
    pub async fn finish_delivery(
        &self,
        task_ref: &TaskRef,
        owner: &str,
        lease_until: Timestamp,
        finish: &DeliveryFinish,
        now: Timestamp,
    ) -> Result<bool, StoreError> {
        let mut req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .condition_expression("dlv_lease = :owner AND dlv_due = :lease")
            .expression_attribute_values(":owner", s(owner))
            .expression_attribute_values(":lease", n(lease_until.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()));
        let (status, outcome) = match finish {
            DeliveryFinish::Delivered { id, outcome } => {
                req = req
                    .update_expression(
                        "SET dlv_status = :status, dlv_done_id = :id, dlv_done_at = :now, dlv_last = :outcome, \
                         dlv_last_at = :now REMOVE dlv_due, dlv_lease",
                    )
                    .expression_attribute_values(":id", s(id));
                (DeliveryStatus::Delivered, outcome.as_str())
            }
            DeliveryFinish::AlreadyDelivered { .. } => {
                req = req.update_expression(
                    "SET dlv_status = :status, dlv_attempts = dlv_attempts - :one, \
                     dlv_done_at = if_not_exists(dlv_done_at, :now) REMOVE dlv_due, dlv_lease",
                );
                req = req.expression_attribute_values(":one", n(1));
                (DeliveryStatus::Delivered, "")
            }
            DeliveryFinish::Retry { at, outcome, failures } => {
                req = req
                    .update_expression(
                        "SET dlv_status = :status, dlv_due = :next, dlv_last = :outcome, dlv_last_at = :now, \
                         dlv_tfails = :tfails, dlv_sfails = :sfails REMOVE dlv_lease",
                    )
                    .expression_attribute_values(":next", n(at.as_millis()))
                    .expression_attribute_values(":tfails", n(u64::from(failures.token)))
                    .expression_attribute_values(":sfails", n(u64::from(failures.standard)));
                (DeliveryStatus::Retrying, outcome.as_str())
            }
            DeliveryFinish::Parked { outcome } => {
                req = req
                    .update_expression(
                        "SET dlv_status = :status, dlv_due = :parked, dlv_parked_at = :now, dlv_last = :outcome, \
                         dlv_last_at = :now REMOVE dlv_lease",
                    )
                    .expression_attribute_values(":parked", n(PARKED_BASE + now.as_millis()));
                (DeliveryStatus::Parked, outcome.as_str())
            }
            DeliveryFinish::Deferred { at } => {
                // Its own request: DynamoDB refuses values an expression does not use.
                let res = self
                    .client
                    .update_item()
                    .table_name(&*self.table)
                    .key(attr::PK, s(task_ref.as_ref()))
                    .condition_expression("dlv_lease = :owner AND dlv_due = :lease")
                    .update_expression("SET dlv_due = :next, dlv_attempts = dlv_attempts - :one REMOVE dlv_lease")
                    .expression_attribute_values(":owner", s(owner))
                    .expression_attribute_values(":lease", n(lease_until.as_millis()))
                    .expression_attribute_values(":next", n(at.as_millis()))
                    .expression_attribute_values(":one", n(1))
                    .send()
                    .await;
                return condition_held(res);
            }
            DeliveryFinish::Gone { outcome } => {
                req = req.update_expression(
                    "SET dlv_status = :status, dlv_last = :outcome, dlv_last_at = :now REMOVE dlv_due, dlv_lease",
                );
                (DeliveryStatus::Gone, outcome.as_str())
            }
        };
        if !matches!(finish, DeliveryFinish::AlreadyDelivered { .. }) {
            req = req.expression_attribute_values(":outcome", s(outcome));
        }
        condition_held(req.expression_attribute_values(":status", s(status.as_str())).send().await)
    }

    /// Parked pushes, parked between `from` and `to` (inclusive), oldest first, at most `limit`
    /// (one Query per shard of the due-for-delivery index, above [`PARKED_BASE`]). Each comes
    /// with when it was parked.
    pub async fn parked_deliveries(
        &self,
        from: Timestamp,
        to: Timestamp,
        limit: usize,
    ) -> Result<Vec<DueDelivery>, StoreError> {
        let mut found = Vec::new();
        for shard in 0..self.shards.read() {
            let mut pages = self
                .client
                .query()
                .table_name(&*self.table)
                .index_name(DELIVERY_INDEX)
                .key_condition_expression("dlv_shard = :shard AND dlv_due BETWEEN :from AND :to")
                .expression_attribute_values(":shard", n(u64::from(shard)))
                .expression_attribute_values(":from", n(PARKED_BASE + from.as_millis()))
                .expression_attribute_values(":to", n(PARKED_BASE + to.as_millis()))
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                for item in page.map_err(sdk_error)?.items() {
                    let d = due_of(item)?;
                    found.push(DueDelivery { due_at: Timestamp::from_millis(d.due_at.as_millis() - PARKED_BASE), ..d });
                }
                if found.len() >= limit.saturating_mul(4) {
                    break;
                }
            }
        }
        found.sort_by_key(|d| d.due_at);
        found.truncate(limit);
        Ok(found)
    }

    /// Makes a task's push due again now with a fresh set of attempts: a parked or gone push,
    /// or a delivered one the owner asks for again (same `webhook-id` if the result is the
    /// same). `false` if the task has no owner callback, is still open, or its push is already
    /// due.
    pub async fn replay_delivery(&self, task_ref: &TaskRef, now: Timestamp) -> Result<bool, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, s(task_ref.as_ref()))
            .update_expression(
                "SET dlv_due = :now, dlv_status = :pending, dlv_attempts = :zero, dlv_tfails = :zero, \
                 dlv_sfails = :zero REMOVE dlv_parked_at, dlv_lease, dlv_done_id",
            )
            .condition_expression(
                "attribute_exists(dlv_shard) AND attribute_exists(dlv_status) \
                 AND (attribute_not_exists(dlv_due) OR dlv_due >= :parked)",
            )
            .expression_attribute_values(":parked", n(PARKED_BASE))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":pending", s(DeliveryStatus::Pending.as_str()))
            .expression_attribute_values(":zero", n(0))
            .send()
            .await;
        let replayed = condition_held(res)?;
        if replayed && let Some(notify) = &self.pushes {
            (notify.0)(DueDelivery { task_ref: task_ref.clone(), due_at: now });
        }
        Ok(replayed)
    }

    /// The webhook secrets kept for `owner` (`whsec_current[,whsec_previous]`), if any.
    pub async fn webhook_secrets(&self, owner: &str) -> Result<Option<String>, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&*self.table)
            .key(attr::PK, s(&format!("{SECRET_PREFIX}{owner}")))
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(out.item.as_ref().and_then(|i| i.get("secrets")).and_then(|v| v.as_s().ok()).cloned())
    }

    /// Keeps `secrets` (`whsec_current[,whsec_previous]`) as `owner`'s webhook secrets.
    pub async fn put_webhook_secrets(&self, owner: &str, secrets: &str) -> Result<(), StoreError> {
        self.client
            .put_item()
            .table_name(&*self.table)
            .item(attr::PK, s(&format!("{SECRET_PREFIX}{owner}")))
            .item("secrets", AttributeValue::S(secrets.to_owned()))
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {

    use super::*;
    use crate::domain::{CaptchaId, CaptchaKind, IncomingResult, Outcome, Solution, Via};
    use crate::store::TaskStore;
    use crate::store::{Created, RecordOutcome, SubmitRecorded};
    use crate::testkit::{LocalDynamo, LocalSqs};

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    const URL: &str = "https://owner.example/hook";

    async fn pending(store: &TaskStore, callback: bool, captcha: &str) -> Task {
        let task = Task {
            owner_callback: callback.then(|| URL.to_owned()),
            webhook_owner: callback.then(|| "scraper".to_owned()),
            ..Task::new(TaskRef::generate(), CaptchaKind::Image, t(1_000))
        };
        assert_eq!(store.tasks().create(&task, t(600_000), None).await.expect("create"), Created::New);
        let id = CaptchaId::parse(captcha).expect("id");
        match store.tasks().mark_submitted(&task.task_ref, &id, t(2_000), t(30_000)).await.expect("submit") {
            SubmitRecorded::Pending(task) => task,
            other => panic!("expected pending, got {other:?}"),
        }
    }

    fn solved(captcha: &str, at: u64) -> IncomingResult {
        IncomingResult {
            captcha_id: CaptchaId::parse(captcha).expect("id"),
            outcome: Outcome::Solved(Solution::parse("TOKEN").expect("token")),
            received_at: t(at),
            via: Via::Callback,
            token_clock_start: t(at),
        }
    }

    async fn due_at(store: &TaskStore, now: u64) -> Vec<DueDelivery> {
        let mut all = Vec::new();
        for shard in 0..store.shards().read() {
            all.extend(store.pushes().due_deliveries(shard, t(now), 100, None).await.expect("query").0);
        }
        all
    }

    /// The whole life of a push, on one engine: the terminal write makes it due (and only for a
    /// task with a callback), a claim is exclusive and counts the attempt, a retry moves it, a
    /// delivery ends it, a duplicate result does not bring it back, a park takes it out of the
    /// due range and into the parked listing, a replay brings it back with fresh attempts, a
    /// deferral gives the attempt back.
    async fn the_life_of_a_push(store: TaskStore) {
        let plain = pending(&store, false, "100").await;
        let task = pending(&store, true, "101").await;
        assert!(due_at(&store, 50_000).await.is_empty(), "nothing is due while tasks are open");
        assert!(matches!(
            store.results().record_result(&plain.task_ref, &solved("100", 10_000)).await.expect("r"),
            RecordOutcome::Recorded(_)
        ));
        assert!(matches!(
            store.results().record_result(&task.task_ref, &solved("101", 10_000)).await.expect("r"),
            RecordOutcome::Recorded(_)
        ));
        let due = due_at(&store, 10_000).await;
        assert_eq!(
            due,
            vec![DueDelivery { task_ref: task.task_ref.clone(), due_at: t(10_000) }],
            "only the callback task"
        );
        let shown = store.tasks().get(&task.task_ref).await.expect("get").expect("task");
        let d = shown.delivery.clone().expect("a delivery state");
        assert_eq!((d.status, d.attempts, d.next_attempt_at), (DeliveryStatus::Pending, 0, Some(t(10_000))));
        assert_eq!(shown.webhook_owner.as_deref(), Some("scraper"));
        assert!(store.tasks().get(&plain.task_ref).await.expect("get").expect("task").delivery.is_none());

        // An exclusive claim that counts the attempt.
        let claimed = store.pushes().claim_delivery(&due[0], "w1", t(35_000)).await.expect("claim").expect("won");
        assert_eq!(claimed.delivery.as_ref().map(|d| d.attempts), Some(1));
        assert!(
            store.pushes().claim_delivery(&due[0], "w2", t(35_000)).await.expect("claim").is_none(),
            "claimed once"
        );
        assert!(due_at(&store, 30_000).await.is_empty(), "leased");
        assert_eq!(due_at(&store, 35_000).await.len(), 1, "a lapsed lease is due again");

        // A retry, then a delivery.
        let failures = Failures { token: 0, standard: 1 };
        let retry = DeliveryFinish::Retry { at: t(40_000), outcome: "HTTP 500".into(), failures };
        assert!(
            !store.pushes().finish_delivery(&task.task_ref, "w2", t(35_000), &retry, t(12_000)).await.expect("f"),
            "not w2's lease"
        );
        assert!(store.pushes().finish_delivery(&task.task_ref, "w1", t(35_000), &retry, t(12_000)).await.expect("f"));
        let d = store.tasks().get(&task.task_ref).await.expect("get").expect("task").delivery.expect("state");
        assert_eq!(
            (d.status, d.next_attempt_at, d.last_outcome.as_deref(), d.failures),
            (DeliveryStatus::Retrying, Some(t(40_000)), Some("HTTP 500"), failures)
        );
        let due = due_at(&store, 40_000).await;
        let id = shown.webhook_id().expect("an id");
        store.pushes().claim_delivery(&due[0], "w1", t(65_000)).await.expect("claim").expect("won");
        let done = DeliveryFinish::Delivered { id: id.clone(), outcome: "HTTP 200".into() };
        assert!(store.pushes().finish_delivery(&task.task_ref, "w1", t(65_000), &done, t(41_000)).await.expect("f"));
        let d = store.tasks().get(&task.task_ref).await.expect("get").expect("task").delivery.expect("state");
        assert_eq!(
            (d.status, d.attempts, d.delivered_id.as_deref()),
            (DeliveryStatus::Delivered, 2, Some(id.as_str()))
        );
        assert!(due_at(&store, 10_000_000).await.is_empty(), "delivered: out of the index");
        // The same result again (a duplicate pingback) writes nothing: no new push.
        assert!(matches!(
            store.results().record_result(&task.task_ref, &solved("101", 50_000)).await.expect("r"),
            RecordOutcome::Duplicate(_)
        ));
        assert!(due_at(&store, 10_000_000).await.is_empty());

        // Replay (the owner asks again): due now, fresh attempts; the same result is then
        // recognised as delivered under the same id only if the id was kept — a replay clears it,
        // so it is sent again.
        assert!(store.pushes().replay_delivery(&task.task_ref, t(60_000)).await.expect("replay"));
        assert!(!store.pushes().replay_delivery(&task.task_ref, t(60_000)).await.expect("replay"), "already due");
        let due = due_at(&store, 60_000).await;
        store.pushes().claim_delivery(&due[0], "w1", t(85_000)).await.expect("claim").expect("won");
        // Deferred: the attempt is given back and it is due at the time given.
        let defer = DeliveryFinish::Deferred { at: t(61_000) };
        assert!(store.pushes().finish_delivery(&task.task_ref, "w1", t(85_000), &defer, t(60_500)).await.expect("f"));
        let d = store.tasks().get(&task.task_ref).await.expect("get").expect("task").delivery.expect("state");
        assert_eq!((d.attempts, d.next_attempt_at), (0, Some(t(61_000))));
        // Parked: out of the due range, listed by when it was parked, replayable.
        let due = due_at(&store, 61_000).await;
        store.pushes().claim_delivery(&due[0], "w1", t(86_000)).await.expect("claim").expect("won");
        let park = DeliveryFinish::Parked { outcome: "7 attempts failed".into() };
        assert!(store.pushes().finish_delivery(&task.task_ref, "w1", t(86_000), &park, t(62_000)).await.expect("f"));
        assert!(due_at(&store, PARKED_BASE - 1).await.is_empty(), "a parked push is never due");
        assert_eq!(store.pushes().oldest_delivery_due().await.expect("oldest"), None);
        let parked = store.pushes().parked_deliveries(t(60_000), t(70_000), 10).await.expect("parked");
        assert_eq!(parked, vec![DueDelivery { task_ref: task.task_ref.clone(), due_at: t(62_000) }]);
        assert!(store.pushes().parked_deliveries(t(63_000), t(70_000), 10).await.expect("parked").is_empty());
        let d = store.tasks().get(&task.task_ref).await.expect("get").expect("task").delivery.expect("state");
        assert_eq!((d.status, d.parked_at, d.next_attempt_at), (DeliveryStatus::Parked, Some(t(62_000)), None));
        assert!(store.pushes().replay_delivery(&task.task_ref, t(70_000)).await.expect("replay"));
        assert!(store.pushes().parked_deliveries(t(0), t(100_000), 10).await.expect("parked").is_empty());
        // A push for the same result that was delivered before: finished without a send.
        let due = due_at(&store, 70_000).await;
        store.pushes().claim_delivery(&due[0], "w1", t(95_000)).await.expect("claim").expect("won");
        let again = DeliveryFinish::AlreadyDelivered { id };
        assert!(store.pushes().finish_delivery(&task.task_ref, "w1", t(95_000), &again, t(70_100)).await.expect("f"));
        let d = store.tasks().get(&task.task_ref).await.expect("get").expect("task").delivery.expect("state");
        assert_eq!((d.status, d.attempts, d.failures), (DeliveryStatus::Delivered, 0, Failures::default()));

        // An expiry is a terminal write too.
        let late = pending(&store, true, "102").await;
        assert!(store.poll().expire(&late.task_ref, "deadline", t(600_000), "poller").await.expect("expire"));
        assert_eq!(due_at(&store, 600_000).await.len(), 1);
        // Webhook secrets per owner.
        assert_eq!(store.pushes().webhook_secrets("scraper").await.expect("get"), None);
        store.pushes().put_webhook_secrets("scraper", "whsec_a,whsec_b").await.expect("put");
        assert_eq!(store.pushes().webhook_secrets("scraper").await.expect("get").as_deref(), Some("whsec_a,whsec_b"));
    }

    #[tokio::test]
    async fn the_life_of_a_push_on_the_embedded_engine() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        the_life_of_a_push(db.fresh_store().await?).await;
        Ok(())
    }

    /// moto refuses what the embedded engine may let pass (an expression value no expression
    /// uses, for one): every write above, again on moto.
    #[tokio::test]
    async fn the_life_of_a_push_on_moto() -> anyhow::Result<()> {
        the_life_of_a_push(LocalSqs::from_env()?.fresh_store("dlv").await?).await;
        Ok(())
    }
}

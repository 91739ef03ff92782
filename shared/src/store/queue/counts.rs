//! The queue's counts over its count items: the bounds a reservation checks, the permits
//! an inline submit takes, folds and reconciliations.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::{AttributeValue, ReturnValue, ReturnValuesOnConditionCheckFailure};

use super::*;

impl SubmitQueue {
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
    pub(super) async fn count_items(&self, shards: std::ops::Range<u8>) -> Result<Vec<Item>, StoreError> {
        let keys: Vec<Item> = shards.map(|k| [(attr::PK.to_owned(), s(&count_key(k)))].into()).collect();
        let mut want = aws_sdk_dynamodb::types::KeysAndAttributes::builder()
            .set_keys(Some(keys))
            .consistent_read(true)
            .build()
            .map_err(|e| StoreError::Rejected(e.to_string()))?;
        let mut items: Vec<Item> = Vec::new();
        // Keys DynamoDB leaves unprocessed (throttled) are asked again, a few times.
        for round in 0..5u32 {
            let out = self.client.batch_get_item().request_items(&*self.table, want).send().await.map_err(sdk_error)?;
            if let Some(got) = out.responses.and_then(|mut r| r.remove(&*self.table)) {
                items.extend(got);
            }
            match out.unprocessed_keys.and_then(|mut u| u.remove(&*self.table)).filter(|k| !k.keys.is_empty()) {
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
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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
                .table_name(&*self.table)
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
            .table_name(&*self.table)
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
        let mut req = self.client.update_item().table_name(&*self.table).key(attr::PK, s(&count_key(shard)));
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
            .table_name(&*self.table)
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
}

//! The submitter's side: the tasks in work, its lease and what it publishes, its wake item.

use aws_sdk_dynamodb::types::ReturnValue;

use super::*;

impl SubmitQueue {
    /// The tasks CaptchaAI may be working on at `now`: every one listed in work whose thread is
    /// not surely free yet (keys only; one small Query per shard, at once).
    pub async fn in_work(&self, now: Timestamp) -> Result<Vec<TaskRef>, StoreError> {
        let queries = (0..self.shards.read()).map(|shard| async move {
            let mut refs = Vec::new();
            let mut pages = self
                .client
                .query()
                .table_name(&*self.table)
                .index_name(QUEUE_INDEX)
                .key_condition_expression("sq_key = :k AND sq_at > :now")
                .expression_attribute_values(":k", s(&format!("w#{shard}")))
                .expression_attribute_values(":now", n(now.as_millis()))
                .into_paginator()
                .send();
            while let Some(page) = pages.next().await {
                for i in page.map_err(sdk_error)?.items() {
                    refs.push(TaskRef::parse(super::req_s(i, attr::PK)?).map_err(super::corrupt(attr::PK))?);
                }
            }
            Ok::<_, StoreError>(refs)
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
        let mut req = self.client.update_item().table_name(&*self.table).key(attr::PK, s(Breaker::KEY));
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
            .table_name(&*self.table)
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
            .table_name(&*self.table)
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

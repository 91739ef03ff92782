//! Retention and erasure: what the table keeps, and for how long. Every task item carries
//! `expires_ttl`, `RETENTION_DAYS` after it was created (after its result, once it has one).
//! From that moment no read hands it out ([`TaskStore::get_retained`]: answered as an unknown
//! task), whether or not the item is gone yet — DynamoDB's TTL deletes it in the background,
//! typically within days, and local mode's sweep ([`TaskStore::sweep_expired`]) within a minute.
//! An erasure request deletes one owner's tasks now ([`TaskStore::erase_owner`]).

use aws_sdk_dynamodb::error::SdkError;
use aws_sdk_dynamodb::operation::delete_item::DeleteItemError;

use super::{Retention, StoreError, attr, get_s, n, s, sdk_error};
use crate::domain::{Task, TaskRef};
use crate::time::Timestamp;

/// What a sweep or an erasure removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// Items deleted.
    pub deleted: usize,
    /// Items read (a sweep reads past those it keeps).
    pub scanned: usize,
    /// Whether items that match are left for the next pass (the pass reached its bound).
    pub more: bool,
}

/// Whether an item's retention (`expires_ttl`, epoch seconds) has ended at `now`.
fn retention_ended(item: &super::Item, now: Timestamp) -> Result<bool, StoreError> {
    let Some(v) = item.get(attr::EXPIRES_TTL) else { return Ok(false) };
    let secs: u64 = v
        .as_n()
        .ok()
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| StoreError::Corrupt(format!("`{}` is not epoch seconds", attr::EXPIRES_TTL)))?;
    Ok(now.as_secs() >= secs)
}

/// The owner an erasure command names: a relay key's tasks (`--key <name>`, stored as
/// `key:<name>`) or a `POST /tasks` caller's (`--owner <owner>`); exactly one of them.
pub fn erasure_owner(key: Option<&str>, owner: Option<&str>) -> Result<String, String> {
    match (key.map(str::trim), owner.map(str::trim)) {
        (Some(k), None) if !k.is_empty() => Ok(format!("key:{k}")),
        (None, Some(o)) if !o.is_empty() => Ok(o.to_owned()),
        _ => Err("name whose tasks to erase: --key <relay key name> or --owner <owner>".into()),
    }
}

impl Retention {
    /// Reads a task as its owner (or an operator) may see it at `now`: `None` once its retention
    /// has ended (`expires_ttl`: `RETENTION_DAYS` after it was created, or after its result),
    /// even while the table still holds it.
    pub async fn get_retained(&self, task_ref: &TaskRef, now: Timestamp) -> Result<Option<Task>, StoreError> {
        let Some(item) = self.get_item(task_ref).await? else { return Ok(None) };
        if retention_ended(&item, now)? {
            return Ok(None);
        }
        Task::try_from(&item).map(Some)
    }

    /// Deletes up to `max` items whose retention ended before `now` (`expires_ttl` in the
    /// past): tasks, and the small bookkeeping items that carry a TTL too. Each delete is
    /// conditional on the item still being expired (a task written again meanwhile stays). One
    /// bounded pass; call it again while [`Removed::more`].
    pub async fn sweep_expired(&self, now: Timestamp, max: usize) -> Result<Removed, StoreError> {
        self.delete_matching(attr::EXPIRES_TTL, "<", n(now.as_secs()), max).await
    }

    /// Deletes every task of `owner` (see [`Task::owner`]: `key:<relay key name>`, or the
    /// caller of `POST /tasks`) now, whatever its state: an erasure request. Returns how many.
    /// A scan of the table: an operator's command, not a request path.
    pub async fn erase_owner(&self, owner: &str) -> Result<Removed, StoreError> {
        let mut all = Removed::default();
        loop {
            let r = self.delete_matching(attr::OWNER, "=", s(owner), 1_000).await?;
            all.deleted += r.deleted;
            all.scanned += r.scanned;
            if !r.more {
                return Ok(all);
            }
        }
    }

    /// Scans for items whose `name` compares (`op`) to `value` and deletes each under the same
    /// condition, until `max` are deleted or the table is read through.
    async fn delete_matching(
        &self,
        name: &str,
        op: &str,
        value: aws_sdk_dynamodb::types::AttributeValue,
        max: usize,
    ) -> Result<Removed, StoreError> {
        // `owner` is one of DynamoDB's reserved words: every name goes through a placeholder.
        let filter = format!("#a {op} :v");
        let mut removed = Removed::default();
        let mut pages = self
            .client
            .scan()
            .table_name(&*self.table)
            .filter_expression(&filter)
            .projection_expression("#pk")
            .expression_attribute_names("#pk", attr::PK)
            .expression_attribute_names("#a", name)
            .expression_attribute_values(":v", value.clone())
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            let page = page.map_err(sdk_error)?;
            removed.scanned += usize::try_from(page.scanned_count()).unwrap_or(0);
            for item in page.items() {
                if removed.deleted >= max {
                    removed.more = true;
                    return Ok(removed);
                }
                let Some(pk) = get_s(item, attr::PK)? else { continue };
                let res = self
                    .client
                    .delete_item()
                    .table_name(&*self.table)
                    .key(attr::PK, s(pk))
                    .condition_expression(&filter)
                    .expression_attribute_names("#a", name)
                    .expression_attribute_values(":v", value.clone())
                    .send()
                    .await;
                match res {
                    Ok(_) => removed.deleted += 1,
                    Err(SdkError::ServiceError(se))
                        if matches!(se.err(), DeleteItemError::ConditionalCheckFailedException(_)) => {}
                    Err(e) => return Err(sdk_error(e)),
                }
            }
        }
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::domain::{CaptchaKind, IncomingResult, Outcome, Solution, Via};
    use crate::store::TaskStore;
    use crate::testkit::LocalDynamo;

    fn t(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1_000)
    }

    async fn solved(store: &TaskStore, owner: &str, at: Timestamp) -> anyhow::Result<TaskRef> {
        let task = Task { owner: Some(owner.into()), ..Task::new(TaskRef::generate(), CaptchaKind::Turnstile, at) };
        store.tasks().create(&task, at.plus(Duration::from_secs(60)), None).await?;
        let d = IncomingResult {
            captcha_id: crate::domain::CaptchaId::parse("77")?,
            outcome: Outcome::Solved(Solution::parse("tok-retained")?),
            received_at: at.plus(Duration::from_secs(10)),
            via: Via::Callback,
            token_clock_start: at,
        };
        store.results().record_result(&task.task_ref, &d).await?;
        Ok(task.task_ref)
    }

    /// Runs on the embedded engine, and on moto's DynamoDB in the test command's second pass
    /// (moto keeps an expired item, as DynamoDB does until its TTL sweep gets to it).
    #[tokio::test]
    async fn store_retention_ends_reads_and_the_sweep_deletes_only_what_has_expired() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let week = Duration::from_secs(7 * 86_400);
        let old = solved(&store, "key:scraper", t(1_000_000)).await?;
        let young = solved(&store, "key:scraper", t(1_000_000 + 3 * 86_400)).await?;
        let at_8_days = t(1_000_000 + 8 * 86_400);
        // Within its retention: handed out. Past it: refused, though the item is still there.
        assert!(store.retention().get_retained(&old, t(1_000_100)).await?.is_some());
        assert!(store.retention().get_retained(&old, at_8_days).await?.is_none(), "past retention");
        assert!(store.tasks().get(&old).await?.is_some(), "the table still holds it until a sweep");
        // 7 days from its result, to the second: still handed out just before, not at it.
        let ends = t(1_000_010).plus(week);
        assert!(store.retention().get_retained(&old, ends.minus(Duration::from_secs(1))).await?.is_some());
        assert!(store.retention().get_retained(&old, ends).await?.is_none(), "7 days from its result");
        // The sweep: the expired one goes, the young one stays; bounded per pass.
        let r = store.retention().sweep_expired(at_8_days, 100).await?;
        assert_eq!((r.deleted, r.more), (1, false), "{r:?}");
        assert!(store.tasks().get(&old).await?.is_none());
        assert!(store.retention().get_retained(&young, at_8_days).await?.is_some());
        Ok(())
    }

    #[tokio::test]
    async fn store_erasure_deletes_one_owners_tasks_and_no_one_elses() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let mut theirs = Vec::new();
        for i in 0..5 {
            theirs.push(solved(&store, "key:leaver", t(2_000_000 + i)).await?);
        }
        let mine = solved(&store, "key:stayer", t(2_000_000)).await?;
        let r = store.retention().erase_owner("key:leaver").await?;
        assert_eq!(r.deleted, 5, "{r:?}");
        for r in &theirs {
            assert!(store.tasks().get(r).await?.is_none(), "{r} erased");
        }
        assert!(store.tasks().get(&mine).await?.is_some(), "another owner's task stays");
        assert_eq!(store.retention().erase_owner("key:leaver").await?.deleted, 0, "nothing left to erase");
        Ok(())
    }
}

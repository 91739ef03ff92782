//! Per-host push limits shared by every delivery worker: one item per owner host,
//! `host#<host>`, holding slots. A push holds one slot while its request runs; a slot is a
//! lease (`s<i>` = until when, `b<i>` = when its request began), taken with one conditional
//! write (free, or lapsed) and given back — or passed straight to the next push waiting for the
//! host — with another. A worker that dies holding a slot loses it when the lease lapses. The
//! slot count is the hard ceiling on requests in flight to one host across every worker
//! (`DELIVERY_PER_HOST_CONCURRENCY`); the item also keeps the host's adaptive limit (`lim`,
//! moved AIMD-style by the workers, see [`crate::delivery`]), and a slot given back stays held
//! until its request began plus `limit ÷ DELIVERY_PER_HOST_PER_SECOND`, which bounds the
//! starts a second across every worker. Items expire (TTL) a week after their last use.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};

use super::{Item, StoreError, TaskStore, attr, n, refused_item, s, sdk_error};
use crate::time::Timestamp;

/// Host records are kept under `host#<host>`.
pub const HOST_PREFIX: &str = "host#";
/// The most slots a host record has (`DELIVERY_PER_HOST_CONCURRENCY` is at most this).
pub const MAX_SLOTS: u32 = 256;
/// A host record outlives its last use by this long (then DynamoDB's TTL deletes it): as long
/// as the tasks it served are kept (`RETENTION_DAYS`' default).
const RECORD_TTL_SECS: u64 = 7 * 86_400;

/// One slot of a host record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    /// Held until then (a request's lease, or a given-back slot's spacing).
    pub until: Timestamp,
    /// When the request holding it began; `None` for a slot given back (held only for spacing).
    pub began: Option<Timestamp>,
}

/// A host's shared record as last read or written.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostRecord {
    /// The adaptive concurrency limit; `None` before any worker set it.
    pub limit: Option<u32>,
    /// When `limit` was last lowered.
    pub limit_at: Option<Timestamp>,
    pub slots: BTreeMap<u32, Slot>,
}

impl HostRecord {
    fn from_item(item: Option<&Item>) -> Self {
        let Some(item) = item else { return Self::default() };
        let num = |name: &str| item.get(name).and_then(|v| v.as_n().ok()).and_then(|v| v.parse::<u64>().ok());
        let mut slots = BTreeMap::new();
        for (name, v) in item {
            let Some(i) = name.strip_prefix('s').and_then(|i| i.parse::<u32>().ok()) else { continue };
            let Some(until) = v.as_n().ok().and_then(|v| v.parse::<u64>().ok()) else { continue };
            let began = num(&format!("b{i}")).map(Timestamp::from_millis);
            slots.insert(i, Slot { until: Timestamp::from_millis(until), began });
        }
        Self {
            limit: num("lim").and_then(|l| u32::try_from(l).ok()),
            limit_at: num("lim_at").map(Timestamp::from_millis),
            slots,
        }
    }

    /// Slots held at `now` (by any worker).
    pub fn held(&self, now: Timestamp) -> impl Iterator<Item = (u32, &Slot)> {
        self.slots.iter().filter(move |(_, s)| s.until > now).map(|(i, s)| (*i, s))
    }
}

/// How a slot write went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SlotWrite {
    /// Done; the record after it.
    Done(HostRecord),
    /// Refused (the slot is held by someone else, or — for a hand-over — no longer ours); the
    /// record as it stands.
    Refused(HostRecord),
}

fn key(host: &str) -> aws_sdk_dynamodb::types::AttributeValue {
    s(&format!("{HOST_PREFIX}{host}"))
}

impl TaskStore {
    /// Takes slot `slot` of `host` for a request beginning at `now`, held until `until`, if it
    /// is free at `now`. The record's limit is set to `initial_limit` if it has none.
    pub async fn take_host_slot(
        &self,
        host: &str,
        slot: u32,
        now: Timestamp,
        until: Timestamp,
        initial_limit: u32,
    ) -> Result<SlotWrite, StoreError> {
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key(attr::PK, key(host))
            .update_expression("SET #s = :until, #b = :now, lim = if_not_exists(lim, :init), expires_ttl = :ttl")
            .condition_expression("attribute_not_exists(#s) OR #s <= :now")
            .expression_attribute_names("#s", format!("s{slot}"))
            .expression_attribute_names("#b", format!("b{slot}"))
            .expression_attribute_values(":until", n(until.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":init", n(u64::from(initial_limit)))
            .expression_attribute_values(":ttl", n(now.as_secs() + RECORD_TTL_SECS))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        match res {
            Ok(out) => Ok(SlotWrite::Done(HostRecord::from_item(out.attributes.as_ref()))),
            Err(e) => match refused_item(&e) {
                Some(old) => Ok(SlotWrite::Refused(HostRecord::from_item(old))),
                None => Err(sdk_error(e)),
            },
        }
    }

    /// Moves a slot this worker holds until `held_until`: to `next_until`, either given back
    /// (held only for spacing, `began` None) or handed to the next request (`began` its
    /// start). With `limit` = `(seen, new)` the host's limit moves from `seen` to `new` in the
    /// same write; if another worker moved it meanwhile, the slot is moved without it.
    #[allow(clippy::too_many_arguments)]
    pub async fn move_host_slot(
        &self,
        host: &str,
        slot: u32,
        held_until: Timestamp,
        next_until: Timestamp,
        began: Option<Timestamp>,
        limit: Option<(Option<u32>, u32)>,
        now: Timestamp,
    ) -> Result<SlotWrite, StoreError> {
        let mut change = limit;
        loop {
            let mut set = vec!["#s = :next", "expires_ttl = :ttl"];
            let mut cond = String::from("#s = :held");
            let mut req = self
                .client
                .update_item()
                .table_name(&self.table)
                .key(attr::PK, key(host))
                .expression_attribute_names("#s", format!("s{slot}"))
                .expression_attribute_names("#b", format!("b{slot}"))
                .expression_attribute_values(":next", n(next_until.as_millis()))
                .expression_attribute_values(":held", n(held_until.as_millis()))
                .expression_attribute_values(":ttl", n(now.as_secs() + RECORD_TTL_SECS));
            if let Some(b) = began {
                set.push("#b = :began");
                req = req.expression_attribute_values(":began", n(b.as_millis()));
            }
            if let Some((seen, new)) = change {
                set.push("lim = :lim");
                req = req.expression_attribute_values(":lim", n(u64::from(new)));
                if seen.is_some_and(|seen| new < seen) {
                    // Decreases are paced by when the last one was.
                    set.push("lim_at = :now");
                    req = req.expression_attribute_values(":now", n(now.as_millis()));
                }
                match seen {
                    Some(seen) => {
                        cond.push_str(" AND lim = :seen");
                        req = req.expression_attribute_values(":seen", n(u64::from(seen)));
                    }
                    None => cond.push_str(" AND attribute_not_exists(lim)"),
                }
            }
            let mut expr = format!("SET {}", set.join(", "));
            if began.is_none() {
                expr.push_str(" REMOVE #b");
            }
            let res = req
                .update_expression(expr)
                .condition_expression(cond)
                .return_values(ReturnValue::AllNew)
                .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
                .send()
                .await;
            match res {
                Ok(out) => return Ok(SlotWrite::Done(HostRecord::from_item(out.attributes.as_ref()))),
                Err(e) => match refused_item(&e) {
                    Some(old) => {
                        let record = HostRecord::from_item(old);
                        let still_ours = record.slots.get(&slot).is_some_and(|s| s.until == held_until);
                        if still_ours && change.is_some() {
                            // Only the limit moved under us: move the slot alone.
                            change = None;
                            continue;
                        }
                        return Ok(SlotWrite::Refused(record));
                    }
                    None => return Err(sdk_error(e)),
                },
            }
        }
    }

    /// The host's record (for the operator and the tests).
    pub async fn host_record(&self, host: &str) -> Result<HostRecord, StoreError> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key(attr::PK, key(host))
            .consistent_read(true)
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(HostRecord::from_item(out.item.as_ref()))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::store::schema;
    use crate::testkit::{LocalDynamo, LocalSqs, client_for};

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// Slots are exclusive until they lapse or are moved; a move is only the holder's; a limit
    /// change rides on a move and gives way to another worker's.
    async fn slots_are_leases(store: TaskStore) {
        let h = "owner.example:443";
        assert_eq!(store.host_record(h).await.expect("read"), HostRecord::default());
        let SlotWrite::Done(r) = store.take_host_slot(h, 3, t(1_000), t(16_000), 8).await.expect("take") else {
            panic!("a free slot is taken")
        };
        assert_eq!(r.limit, Some(8));
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(16_000), began: Some(t(1_000)) }));
        // Held: another worker is refused and sees the record.
        let SlotWrite::Refused(seen) = store.take_host_slot(h, 3, t(2_000), t(17_000), 8).await.expect("take") else {
            panic!("a held slot is refused")
        };
        assert_eq!(seen.held(t(2_000)).count(), 1);
        // Another slot is free.
        assert!(matches!(store.take_host_slot(h, 4, t(2_000), t(17_000), 8).await.expect("take"), SlotWrite::Done(_)));
        // A move by someone who does not hold it is refused.
        let wrong = store.move_host_slot(h, 3, t(99_000), t(1_200), None, None, t(1_100)).await.expect("move");
        assert!(matches!(wrong, SlotWrite::Refused(_)));
        // Given back, with the limit moved: held for spacing only.
        let SlotWrite::Done(r) =
            store.move_host_slot(h, 3, t(16_000), t(1_160), None, Some((Some(8), 9)), t(1_100)).await.expect("move")
        else {
            panic!("the holder moves it")
        };
        assert_eq!((r.limit, r.limit_at), (Some(9), None), "a raise is not stamped");
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(1_160), began: None }));
        // Free again after the spacing.
        assert!(matches!(
            store.take_host_slot(h, 3, t(1_150), t(16_000), 8).await.expect("take"),
            SlotWrite::Refused(_)
        ));
        let SlotWrite::Done(_) = store.take_host_slot(h, 3, t(1_160), t(16_160), 8).await.expect("take") else {
            panic!("free after the spacing")
        };
        // A limit change on a stale `seen` is dropped; the move itself happens.
        let SlotWrite::Done(r) = store
            .move_host_slot(h, 3, t(16_160), t(31_000), Some(t(16_000)), Some((Some(8), 4)), t(1_200))
            .await
            .expect("move")
        else {
            panic!("moved without the limit change")
        };
        assert_eq!(r.limit, Some(9), "another worker's change stands");
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(31_000), began: Some(t(16_000)) }));
        // A decrease is stamped.
        let SlotWrite::Done(r) =
            store.move_host_slot(h, 3, t(31_000), t(1_300), None, Some((Some(9), 4)), t(1_250)).await.expect("move")
        else {
            panic!("moved")
        };
        assert_eq!((r.limit, r.limit_at), (Some(4), Some(t(1_250))));
        // A crashed holder's lease lapses.
        assert!(matches!(store.take_host_slot(h, 4, t(17_000), t(32_000), 8).await.expect("take"), SlotWrite::Done(_)));
    }

    #[tokio::test]
    async fn slots_are_leases_on_the_embedded_engine() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        slots_are_leases(db.fresh_store().await?).await;
        Ok(())
    }

    #[tokio::test]
    async fn slots_are_leases_on_moto() -> anyhow::Result<()> {
        let moto = LocalSqs::from_env()?.endpoint;
        let table = format!("hosts-{}", uuid::Uuid::new_v4().simple());
        let client = client_for(&moto);
        schema::create_table(&client, &table).await?;
        slots_are_leases(TaskStore::new(client, table, Duration::from_secs(86_400))).await;
        Ok(())
    }
}

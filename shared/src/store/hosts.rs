//! Per-host push limits shared by every delivery worker. A push holds one slot while its
//! request runs; a slot is a lease (`s<i>` = until when, `b<i>` = when its request began), taken
//! with one conditional write (free, or lapsed) and given back — or passed straight to the next
//! push waiting for the host — with another. A worker that dies holding a slot loses it when the
//! lease lapses. The slot count is the hard ceiling on requests in flight to one host across
//! every worker (`DELIVERY_PER_HOST_CONCURRENCY`); a slot given back stays held until its request
//! began plus `limit ÷ DELIVERY_PER_HOST_PER_SECOND`, which bounds the starts a second across
//! every worker. The host's adaptive limit (`lim`, moved AIMD-style by the workers, see
//! [`crate::delivery`]) is kept beside the first slots.
//!
//! **Spread over items.** A write to an item costs one WCU per KB of the whole item, and one
//! partition key takes at most 1,000 WCU a second. The slots are therefore spread over items of
//! [`SLOTS_PER_ITEM`] each — `host#<host>` (slots 0–31, and the limit), `host#<host>#1` (32–63),
//! … — each under 1 KB, so a slot write costs 1 WCU and a host's writes spread over its items
//! as its pushes pick free slots at random. One item of 113 slots cost ~3 WCU a write and went
//! over 1,000 WCU/s at 150 pushes/s (tests/sim/LOAD.md); spread, a host takes about
//! `items × 1,000` slot writes a second (docs/capacity.md). Items expire (TTL) a week after their
//! last use.

use std::collections::BTreeMap;

use aws_sdk_dynamodb::types::{ReturnValue, ReturnValuesOnConditionCheckFailure};

use super::{Item, Pushes, StoreError, attr, n, refused_item, s, sdk_error};
use crate::time::Timestamp;

/// Host records are kept under `host#<host>`.
pub const HOST_PREFIX: &str = "host#";
/// The most slots a host record has (`DELIVERY_PER_HOST_CONCURRENCY` is at most this).
pub const MAX_SLOTS: u32 = 256;
/// Slots kept in one item: 32 slots of two numbers each, with the key and the limit, stay under
/// 1 KB for any host name up to 200 characters (test `slots_spread_over_items_of_one_wcu`).
pub const SLOTS_PER_ITEM: u32 = 32;
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

/// The item holding slot `slot`.
pub fn item_of(slot: u32) -> u32 {
    slot / SLOTS_PER_ITEM
}

/// Item `item`'s key: `host#<host>` for the first (it also holds the limit), `host#<host>#<item>`
/// for the others (a host name holds no `#`).
fn key(host: &str, item: u32) -> aws_sdk_dynamodb::types::AttributeValue {
    if item == 0 { s(&format!("{HOST_PREFIX}{host}")) } else { s(&format!("{HOST_PREFIX}{host}#{item}")) }
}

/// Adds a move of the limit from `seen` to `new` to an update of the first item: `lim` set, a
/// decrease stamped in `lim_at` (decreases are paced by when the last one was), on condition
/// that the limit is still `seen`.
fn limit_change(
    req: aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder,
    set: &mut Vec<&'static str>,
    cond: &mut String,
    seen: Option<u32>,
    new: u32,
    now: Timestamp,
) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
    set.push("lim = :lim");
    let mut req = req.expression_attribute_values(":lim", n(u64::from(new)));
    if seen.is_some_and(|seen| new < seen) {
        set.push("lim_at = :now");
        req = req.expression_attribute_values(":now", n(now.as_millis()));
    }
    match seen {
        Some(seen) => {
            cond.push_str(" AND lim = :seen");
            req.expression_attribute_values(":seen", n(u64::from(seen)))
        }
        None => {
            cond.push_str(" AND attribute_not_exists(lim)");
            req
        }
    }
}

impl Pushes {
    /// Takes slot `slot` of `host` for a request beginning at `now`, held until `until`, if it
    /// is free at `now`. The record's limit is set to `initial_limit` if it has none (in the
    /// first item). The answer holds the slots of `slot`'s item only, and the limit if that item
    /// is the first.
    pub async fn take_host_slot(
        &self,
        host: &str,
        slot: u32,
        now: Timestamp,
        until: Timestamp,
        initial_limit: u32,
    ) -> Result<SlotWrite, StoreError> {
        let first = item_of(slot) == 0;
        let mut req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, key(host, item_of(slot)))
            .update_expression(if first {
                "SET #s = :until, #b = :now, lim = if_not_exists(lim, :init), expires_ttl = :ttl"
            } else {
                "SET #s = :until, #b = :now, expires_ttl = :ttl"
            })
            .condition_expression("attribute_not_exists(#s) OR #s <= :now")
            .expression_attribute_names("#s", format!("s{slot}"))
            .expression_attribute_names("#b", format!("b{slot}"))
            .expression_attribute_values(":until", n(until.as_millis()))
            .expression_attribute_values(":now", n(now.as_millis()))
            .expression_attribute_values(":ttl", n(now.as_secs() + RECORD_TTL_SECS));
        if first {
            req = req.expression_attribute_values(":init", n(u64::from(initial_limit)));
        }
        let res = req
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
    /// start). With `limit` = `(seen, new)` the host's limit moves from `seen` to `new` — in the
    /// same write for a slot of the first item, in a second write to the first item after the
    /// move otherwise; if another worker moved it meanwhile, the slot is moved without it. The
    /// answer holds the slots of `slot`'s item, and the limit if either write read it.
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
        let first = item_of(slot) == 0;
        let mut change = if first { limit } else { None };
        loop {
            let mut set = vec!["#s = :next", "expires_ttl = :ttl"];
            let mut cond = String::from("#s = :held");
            let mut req = self
                .client
                .update_item()
                .table_name(&*self.table)
                .key(attr::PK, key(host, item_of(slot)))
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
                req = limit_change(req, &mut set, &mut cond, seen, new, now);
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
                Ok(out) => {
                    let mut record = HostRecord::from_item(out.attributes.as_ref());
                    if let (false, Some((seen, new))) = (first, limit) {
                        let (lim, lim_at) = self.set_host_limit(host, seen, new, now).await;
                        (record.limit, record.limit_at) = (lim, lim_at);
                    }
                    return Ok(SlotWrite::Done(record));
                }
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

    /// Moves the host's limit from `seen` to `new` in the first item, for a slot kept in
    /// another. Answers the limit and when it was last lowered as the first item holds them
    /// after the write, or before it if another worker moved the limit meanwhile; `(None, None)`
    /// if the store could not be written (logged: the limit is approximate across workers).
    async fn set_host_limit(
        &self,
        host: &str,
        seen: Option<u32>,
        new: u32,
        now: Timestamp,
    ) -> (Option<u32>, Option<Timestamp>) {
        let mut set = vec!["expires_ttl = :ttl"];
        let mut cond = String::new();
        let req = self
            .client
            .update_item()
            .table_name(&*self.table)
            .key(attr::PK, key(host, 0))
            .expression_attribute_values(":ttl", n(now.as_secs() + RECORD_TTL_SECS));
        let req = limit_change(req, &mut set, &mut cond, seen, new, now);
        let res = req
            .update_expression(format!("SET {}", set.join(", ")))
            .condition_expression(cond.trim_start_matches(" AND "))
            .return_values(ReturnValue::AllNew)
            .return_values_on_condition_check_failure(ReturnValuesOnConditionCheckFailure::AllOld)
            .send()
            .await;
        let record = match res {
            Ok(out) => HostRecord::from_item(out.attributes.as_ref()),
            Err(e) => match refused_item(&e) {
                Some(old) => HostRecord::from_item(old),
                None => {
                    tracing::warn!(event = "host_limit_unwritten", host = %host, error = %sdk_error(e));
                    HostRecord::default()
                }
            },
        };
        (record.limit, record.limit_at)
    }

    /// The host's record, every item of it (for the operator and the tests).
    pub async fn host_record(&self, host: &str) -> Result<HostRecord, StoreError> {
        let mut record = HostRecord::default();
        for item in 0..MAX_SLOTS.div_ceil(SLOTS_PER_ITEM) {
            let out = self
                .client
                .get_item()
                .table_name(&*self.table)
                .key(attr::PK, key(host, item))
                .consistent_read(true)
                .send()
                .await
                .map_err(sdk_error)?;
            let part = HostRecord::from_item(out.item.as_ref());
            if item == 0 {
                (record.limit, record.limit_at) = (part.limit, part.limit_at);
            }
            record.slots.extend(part.slots);
        }
        Ok(record)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::TaskStore;
    use crate::testkit::{LocalDynamo, LocalSqs};

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    /// Slots are exclusive until they lapse or are moved; a move is only the holder's; a limit
    /// change rides on a move and gives way to another worker's.
    async fn slots_are_leases(store: TaskStore) {
        let h = "owner.example:443";
        assert_eq!(store.pushes().host_record(h).await.expect("read"), HostRecord::default());
        let SlotWrite::Done(r) = store.pushes().take_host_slot(h, 3, t(1_000), t(16_000), 8).await.expect("take")
        else {
            panic!("a free slot is taken")
        };
        assert_eq!(r.limit, Some(8));
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(16_000), began: Some(t(1_000)) }));
        // Held: another worker is refused and sees the record.
        let SlotWrite::Refused(seen) = store.pushes().take_host_slot(h, 3, t(2_000), t(17_000), 8).await.expect("take")
        else {
            panic!("a held slot is refused")
        };
        assert_eq!(seen.held(t(2_000)).count(), 1);
        // Another slot is free.
        assert!(matches!(
            store.pushes().take_host_slot(h, 4, t(2_000), t(17_000), 8).await.expect("take"),
            SlotWrite::Done(_)
        ));
        // A move by someone who does not hold it is refused.
        let wrong = store.pushes().move_host_slot(h, 3, t(99_000), t(1_200), None, None, t(1_100)).await.expect("move");
        assert!(matches!(wrong, SlotWrite::Refused(_)));
        // Given back, with the limit moved: held for spacing only.
        let SlotWrite::Done(r) = store
            .pushes()
            .move_host_slot(h, 3, t(16_000), t(1_160), None, Some((Some(8), 9)), t(1_100))
            .await
            .expect("move")
        else {
            panic!("the holder moves it")
        };
        assert_eq!((r.limit, r.limit_at), (Some(9), None), "a raise is not stamped");
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(1_160), began: None }));
        // Free again after the spacing.
        assert!(matches!(
            store.pushes().take_host_slot(h, 3, t(1_150), t(16_000), 8).await.expect("take"),
            SlotWrite::Refused(_)
        ));
        let SlotWrite::Done(_) = store.pushes().take_host_slot(h, 3, t(1_160), t(16_160), 8).await.expect("take")
        else {
            panic!("free after the spacing")
        };
        // A limit change on a stale `seen` is dropped; the move itself happens.
        let SlotWrite::Done(r) = store
            .pushes()
            .move_host_slot(h, 3, t(16_160), t(31_000), Some(t(16_000)), Some((Some(8), 4)), t(1_200))
            .await
            .expect("move")
        else {
            panic!("moved without the limit change")
        };
        assert_eq!(r.limit, Some(9), "another worker's change stands");
        assert_eq!(r.slots.get(&3), Some(&Slot { until: t(31_000), began: Some(t(16_000)) }));
        // A decrease is stamped.
        let SlotWrite::Done(r) = store
            .pushes()
            .move_host_slot(h, 3, t(31_000), t(1_300), None, Some((Some(9), 4)), t(1_250))
            .await
            .expect("move")
        else {
            panic!("moved")
        };
        assert_eq!((r.limit, r.limit_at), (Some(4), Some(t(1_250))));
        // A crashed holder's lease lapses.
        assert!(matches!(
            store.pushes().take_host_slot(h, 4, t(17_000), t(32_000), 8).await.expect("take"),
            SlotWrite::Done(_)
        ));
    }

    /// DynamoDB's size of an item (its documented rules: names plus values; a number is about
    /// one byte per two significant digits plus one).
    fn item_size(item: &Item) -> usize {
        item.iter()
            .map(|(name, v)| {
                name.len()
                    + match v {
                        aws_sdk_dynamodb::types::AttributeValue::S(s) => s.len(),
                        aws_sdk_dynamodb::types::AttributeValue::N(n) => n.trim_end_matches('0').len().div_ceil(2) + 1,
                        other => panic!("a host item holds strings and numbers only: {other:?}"),
                    }
            })
            .sum()
    }

    /// Every slot a host can have, held by requests at today's clock, on a host name of 200
    /// characters: each item holds its 32 slots and stays under 1 KB (one WCU a write); a limit
    /// change made with a slot of another item reaches the first item, and a stale one is told
    /// the limit that stands.
    async fn slots_spread_over_items_of_one_wcu(store: TaskStore) {
        let h = format!("{}.example:65535", "h".repeat(186));
        assert_eq!(h.len(), 200);
        let now = t(1_796_000_000_123);
        let until = t(1_796_000_015_123);
        for slot in 0..MAX_SLOTS {
            let SlotWrite::Done(r) = store.pushes().take_host_slot(&h, slot, now, until, 8).await.expect("take") else {
                panic!("slot {slot} is free")
            };
            let item = item_of(slot);
            assert!(
                r.slots.keys().all(|i| item_of(*i) == item),
                "slot {slot}'s answer holds its own item's slots only: {:?}",
                r.slots.keys().collect::<Vec<_>>()
            );
            assert_eq!(r.limit.is_some(), item == 0, "the limit is kept in the first item only");
        }
        for item in 0..MAX_SLOTS / SLOTS_PER_ITEM {
            let out = store
                .client
                .get_item()
                .table_name(&*store.table)
                .key(attr::PK, key(&h, item))
                .consistent_read(true)
                .send()
                .await
                .expect("read");
            let raw = out.item.expect("every item was written");
            let size = item_size(&raw);
            assert!(size < 1024, "item {item} is {size} bytes: over one WCU a write");
            let record = HostRecord::from_item(Some(&raw));
            let want: Vec<u32> = (item * SLOTS_PER_ITEM..(item + 1) * SLOTS_PER_ITEM).collect();
            assert_eq!(record.slots.keys().copied().collect::<Vec<_>>(), want);
        }
        let all = store.pushes().host_record(&h).await.expect("read");
        assert_eq!((all.slots.len(), all.limit), (MAX_SLOTS as usize, Some(8)));
        // A raise made with slot 40 (second item) lands in the first item.
        let SlotWrite::Done(r) = store
            .pushes()
            .move_host_slot(&h, 40, until, t(1_796_000_000_200), None, Some((Some(8), 9)), now)
            .await
            .expect("move")
        else {
            panic!("the holder moves it")
        };
        assert_eq!(r.limit, Some(9));
        assert_eq!(r.slots.get(&40), Some(&Slot { until: t(1_796_000_000_200), began: None }));
        assert_eq!(store.pushes().host_record(&h).await.expect("read").limit, Some(9));
        // A decrease on a stale view moves the slot and is told the limit that stands.
        let SlotWrite::Done(r) = store
            .pushes()
            .move_host_slot(&h, 99, until, t(1_796_000_000_300), None, Some((Some(8), 4)), now)
            .await
            .expect("move")
        else {
            panic!("the holder moves it")
        };
        assert_eq!((r.limit, r.slots.get(&99).map(|s| s.until)), (Some(9), Some(t(1_796_000_000_300))));
        // A decrease on the current view is stamped.
        let later = t(1_796_000_001_000);
        let SlotWrite::Done(r) =
            store.pushes().move_host_slot(&h, 200, until, later, None, Some((Some(9), 4)), later).await.expect("move")
        else {
            panic!("the holder moves it")
        };
        assert_eq!((r.limit, r.limit_at), (Some(4), Some(later)));
        let all = store.pushes().host_record(&h).await.expect("read");
        assert_eq!((all.limit, all.limit_at), (Some(4), Some(later)));
    }

    #[tokio::test]
    async fn slots_spread_over_items_of_one_wcu_on_the_embedded_engine() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        slots_spread_over_items_of_one_wcu(db.fresh_store().await?).await;
        Ok(())
    }

    #[tokio::test]
    async fn slots_spread_over_items_of_one_wcu_on_moto() -> anyhow::Result<()> {
        slots_spread_over_items_of_one_wcu(LocalSqs::from_env()?.fresh_store("hosts").await?).await;
        Ok(())
    }

    #[tokio::test]
    async fn slots_are_leases_on_the_embedded_engine() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        slots_are_leases(db.fresh_store().await?).await;
        Ok(())
    }

    #[tokio::test]
    async fn slots_are_leases_on_moto() -> anyhow::Result<()> {
        slots_are_leases(LocalSqs::from_env()?.fresh_store("hosts").await?).await;
        Ok(())
    }
}

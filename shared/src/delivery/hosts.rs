//! The per-host gate every push passes before its request: earliest deadline first within the
//! process, a slot of the host's shared record across processes (see
//! [`crate::store::hosts`]), and a concurrency limit that adapts to what the host answers.
//!
//! - **Order.** Pushes waiting for a host wait in one queue per process, ordered by when what
//!   they carry dies (a token's death; results without one rank by due time plus
//!   [`NO_DEADLINE_SLACK`]), so the push that dies soonest goes first and a retry never waits
//!   behind fresh pushes with more life left. A finished request hands its slot straight to
//!   the head of the queue (one write instead of a give-back and a take).
//! - **Ceilings.** At most `DELIVERY_PER_HOST_CONCURRENCY` requests in flight to one host
//!   across every worker (one slot each in the shared record), and starts spaced so the host
//!   sees at most `DELIVERY_PER_HOST_PER_SECOND` a second (a given-back slot stays held until
//!   its request began plus `limit ÷ rate`).
//! - **Adaptive limit (AIMD).** Within the ceiling, the requests in flight are held to the
//!   host's limit, kept in the shared record: +1 after a success that had to wait for a slot
//!   (the host keeps up, demand is there), halved — at most once a second — when the host says
//!   it is overloaded (429, 503, a refused connection). Timeouts and errors that are not
//!   overload do not move it. A request in flight for longer than [`SLOW_AFTER`] no longer
//!   counts against the limit (it still holds its slot under the ceiling): one slow or hanging
//!   answer never holds up the pushes behind it.
//!
//! The record is only as fresh as the last write's answer: across workers the limit is
//! approximate, the ceiling exact. If the store cannot be written the push goes on under this
//! process's view alone (logged): a token is worth more than exact accounting during an outage.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;

use super::settings::DeliverySettings;
pub use super::signal::Signal;
use crate::store::Pushes;
use crate::store::hosts::{HostRecord, Slot, SlotWrite, item_of};
use crate::time::{Busy, Clock, Timestamp};

/// The limit a host starts with (or the ceiling, if lower).
pub const INITIAL_LIMIT: u32 = 8;
/// A request in flight this long stops counting against the adaptive limit.
pub const SLOW_AFTER: Duration = Duration::from_secs(2);
/// A result without a deadline ranks as if it died this long after it fell due.
pub const NO_DEADLINE_SLACK: Duration = Duration::from_secs(600);
/// The limit is halved at most this often.
const DECREASE_EVERY: Duration = Duration::from_secs(1);

/// Every host's gate in this process.
#[derive(Default)]
pub struct HostGates {
    hosts: Mutex<HashMap<String, Arc<Gate>>>,
}

impl HostGates {
    pub(crate) fn gate(&self, host: &str) -> Arc<Gate> {
        let mut hosts = self.hosts.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        hosts
            .entry(host.to_owned())
            .or_insert_with(|| Arc::new(Gate { host: host.to_owned(), st: Mutex::default() }))
            .clone()
    }

    /// Each host's state, for the `delivery_host_state` log lines and the limit metric.
    pub fn states(&self, now: Timestamp, s: &DeliverySettings) -> Vec<HostState> {
        let hosts: Vec<Arc<Gate>> =
            self.hosts.lock().unwrap_or_else(std::sync::PoisonError::into_inner).values().cloned().collect();
        hosts
            .iter()
            .map(|g| {
                let st = g.lock();
                HostState {
                    host: g.host.clone(),
                    limit: st.limit(s),
                    ceiling: s.per_host_concurrency,
                    in_flight: st.record.held(now).filter(|(_, sl)| sl.began.is_some()).count() as u32,
                    waiting: st.waiting.len() as u32,
                }
            })
            .collect()
    }
}

/// One host's state as this process last saw it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HostState {
    pub host: String,
    pub limit: u32,
    pub ceiling: u32,
    pub in_flight: u32,
    pub waiting: u32,
}

pub(crate) struct Gate {
    host: String,
    st: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    /// The shared record as the last write answered it (plus this process's own slots).
    record: HostRecord,
    /// Slots this process holds or is taking.
    mine: BTreeSet<u32>,
    /// Pushes waiting, by (deadline, arrival).
    waiting: BTreeMap<(u64, u64), mpsc::UnboundedSender<Wake>>,
    seq: u64,
}

/// What a waiting push is woken with. Each carries a [`Busy`] guard: on a simulated clock the
/// hand-off is work until the woken push runs.
enum Wake {
    /// A slot handed over by a finished request.
    Permit(Permit, Busy),
    /// Something changed: look again. (The guard is only held, never read.)
    Retry(#[allow(dead_code)] Busy),
}

/// A held slot. Give it back with [`Gate::release`]; dropped unreleased (its push was
/// cancelled), the slot lapses with its lease.
pub(crate) struct Permit {
    gate: Arc<Gate>,
    slot: u32,
    /// Its lease in the shared record.
    held_until: Timestamp,
    /// The request may start then (the host's spacing).
    pub not_before: Timestamp,
    /// It had to wait for the host (demand above the limit).
    waited: bool,
    /// The record could not be written: held in this process's view only.
    local_only: bool,
    released: bool,
}

impl Drop for Permit {
    fn drop(&mut self) {
        if !self.released {
            self.gate.lock().mine.remove(&self.slot);
        }
    }
}

impl GateState {
    fn limit(&self, s: &DeliverySettings) -> u32 {
        self.record.limit.unwrap_or(INITIAL_LIMIT).clamp(1, s.per_host_concurrency)
    }

    /// Requests in flight that count against the limit, and the limit with the slow ones
    /// added (never above the ceiling).
    fn usage(&self, now: Timestamp, s: &DeliverySettings) -> (u32, u32) {
        let mut counted = 0;
        let mut slow = 0;
        for (_, sl) in self.record.held(now) {
            match sl.began {
                Some(b) if now.since(b) >= SLOW_AFTER => slow += 1,
                _ => counted += 1,
            }
        }
        // Slots this process is taking that the record does not show yet.
        counted +=
            self.mine.iter().filter(|i| self.record.slots.get(i).is_none_or(|sl| sl.until <= now)).count() as u32;
        (counted, (self.limit(s) + slow).min(s.per_host_concurrency))
    }

    /// A free slot to take now, if the limit allows one.
    fn pick(&self, now: Timestamp, s: &DeliverySettings) -> Option<u32> {
        let (counted, limit) = self.usage(now, s);
        let held = (0..s.per_host_concurrency)
            .filter(|i| self.mine.contains(i) || self.record.slots.get(i).is_some_and(|sl| sl.until > now))
            .count() as u32;
        if counted >= limit || held >= s.per_host_concurrency {
            return None;
        }
        let free: Vec<u32> = (0..s.per_host_concurrency)
            .filter(|i| !self.mine.contains(i) && self.record.slots.get(i).is_none_or(|sl| sl.until <= now))
            .collect();
        if free.is_empty() {
            return None;
        }
        // A random free slot: two workers with the same view rarely pick the same one.
        let r = uuid::Uuid::new_v4().as_u128();
        Some(free[(r % free.len() as u128) as usize])
    }

    /// When the view next changes by itself: a slot's lease or spacing ends, or a request
    /// turns slow.
    fn next_change(&self, now: Timestamp) -> Option<Timestamp> {
        self.record
            .held(now)
            .flat_map(|(_, sl)| [Some(sl.until), sl.began.map(|b| b.plus(SLOW_AFTER)).filter(|t| *t > now)])
            .flatten()
            .min()
    }

    /// Takes in a write's answer: the slots of the written slot's item (the record is spread
    /// over items, see [`crate::store::hosts`]), and the limit when the answer read it.
    fn merge(&mut self, record: HostRecord, slot: u32) {
        let item = item_of(slot);
        self.record.slots.retain(|i, _| item_of(*i) != item);
        self.record.slots.extend(record.slots);
        if record.limit.is_some() {
            (self.record.limit, self.record.limit_at) = (record.limit, record.limit_at);
        }
    }

    fn wake_head(&mut self, clock: &dyn Clock) {
        if let Some((_, tx)) = self.waiting.iter().next() {
            let _ = tx.send(Wake::Retry(clock.busy()));
        }
    }
}

/// Removes a waiting push's place in the queue however its wait ends.
struct Place<'a> {
    gate: &'a Gate,
    key: (u64, u64),
}

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.gate.lock().waiting.remove(&self.key);
    }
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.st.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// How long a slot is leased for one request (it may start up to a spacing late).
    fn lease(s: &DeliverySettings) -> Duration {
        s.timeout + Duration::from_secs(5)
    }

    /// Waits for a slot, in deadline order, until `latest_start`. `None`: no turn came in
    /// time (the push is given back).
    pub(crate) async fn acquire(
        self: &Arc<Self>,
        store: &Pushes,
        deadline: Timestamp,
        latest_start: Timestamp,
        clock: &dyn Clock,
        s: &DeliverySettings,
    ) -> Option<Permit> {
        let (mut tx, mut rx) = mpsc::unbounded_channel();
        let key = {
            let mut st = self.lock();
            st.seq += 1;
            (deadline.as_millis(), st.seq)
        };
        let mut place: Option<Place<'_>> = None;
        let mut waited = false;
        loop {
            let now = clock.now();
            if now > latest_start {
                return None;
            }
            let pick = {
                let mut st = self.lock();
                let first = st.waiting.keys().next().copied();
                let my_turn = first.is_none_or(|k| k >= key);
                match st.pick(now, s) {
                    Some(slot) if my_turn => {
                        st.waiting.remove(&key);
                        st.mine.insert(slot);
                        Ok(slot)
                    }
                    free => {
                        if free.is_some() {
                            // A slot is free but an earlier deadline waits: it goes first.
                            st.wake_head(clock);
                        }
                        if place.is_none() {
                            st.waiting.insert(key, tx.clone());
                        }
                        Err(st.next_change(now).unwrap_or(latest_start).min(latest_start))
                    }
                }
            };
            match pick {
                Ok(slot) => {
                    drop(place.take());
                    // No longer waiting: close the channel before the store call, so a wake sent
                    // meanwhile goes to the next in line (a permit is given back by its sender)
                    // instead of sitting here unread — on a simulated clock its guard would stop
                    // time while this call sleeps in the SDK's back-off.
                    rx.close();
                    let mut handed = None;
                    while let Ok(w) = rx.try_recv() {
                        if let Wake::Permit(p, _busy) = w
                            && let Some(extra) = handed.replace(p)
                        {
                            self.release(extra, store, Signal::Neutral, clock, s).await;
                        }
                    }
                    if let Some(mut p) = handed {
                        // A slot was handed over before this one was taken: use it.
                        self.lock().mine.remove(&slot);
                        if p.not_before > latest_start {
                            self.release(p, store, Signal::Neutral, clock, s).await;
                            return None;
                        }
                        p.waited = true;
                        return Some(p);
                    }
                    (tx, rx) = mpsc::unbounded_channel();
                    let until = now.plus(Self::lease(s));
                    let initial = INITIAL_LIMIT.min(s.per_host_concurrency);
                    match store.take_host_slot(&self.host, slot, now, until, initial).await {
                        Ok(SlotWrite::Done(record)) => {
                            self.lock().merge(record, slot);
                            return Some(self.permit(slot, until, now, waited, false));
                        }
                        Ok(SlotWrite::Refused(record)) => {
                            let mut st = self.lock();
                            st.mine.remove(&slot);
                            st.merge(record, slot);
                            if st.record.slots.get(&slot).is_none_or(|sl| sl.until <= now) {
                                // Refused, yet the answer shows it free (the item changed under
                                // us): keep off it a moment rather than ask again at once.
                                st.record
                                    .slots
                                    .insert(slot, Slot { until: now.plus(Duration::from_millis(100)), began: None });
                            }
                        }
                        Err(e) => {
                            tracing::warn!(event = "host_gate_unavailable", host = %self.host, error = %e);
                            let mut st = self.lock();
                            st.record.slots.insert(slot, Slot { until, began: Some(now) });
                            return Some(self.permit(slot, until, now, waited, true));
                        }
                    }
                }
                Err(wake_at) => {
                    waited = true;
                    if place.is_none() {
                        place = Some(Place { gate: self, key });
                    }
                    tokio::select! {
                        w = rx.recv() => match w {
                            Some(Wake::Permit(mut p, _busy)) => {
                                drop(place.take());
                                rx.close();
                                if p.not_before > latest_start {
                                    // Its turn came too late: pass the slot on.
                                    self.release(p, store, Signal::Neutral, clock, s).await;
                                    return None;
                                }
                                p.waited = true;
                                return Some(p);
                            }
                            Some(Wake::Retry(_)) | None => {}
                        },
                        () = clock.sleep_until(wake_at) => {
                            if clock.now() >= latest_start {
                                drop(place.take());
                                // A slot handed over just now must not be lost with the channel.
                                rx.close();
                                while let Ok(w) = rx.try_recv() {
                                    if let Wake::Permit(p, _busy) = w {
                                        self.release(p, store, Signal::Neutral, clock, s).await;
                                    }
                                }
                                return None;
                            }
                        }
                    }
                }
            }
        }
    }

    fn permit(
        self: &Arc<Self>,
        slot: u32,
        held_until: Timestamp,
        not_before: Timestamp,
        waited: bool,
        local_only: bool,
    ) -> Permit {
        Permit { gate: self.clone(), slot, held_until, not_before, waited, local_only, released: false }
    }

    /// Gives a slot back after its request (or hands it to the push waiting with the earliest
    /// deadline), moving the host's limit by what the answer said.
    pub(crate) async fn release(
        self: &Arc<Self>,
        mut permit: Permit,
        store: &Pushes,
        signal: Signal,
        clock: &dyn Clock,
        s: &DeliverySettings,
    ) {
        permit.released = true;
        let now = clock.now();
        let slot = permit.slot;
        let (change, spacing, mut held_until) = {
            let st = self.lock();
            let limit = st.limit(s);
            let seen = st.record.limit;
            let change = match signal {
                Signal::Ok if (permit.waited || !st.waiting.is_empty()) && limit < s.per_host_concurrency => {
                    Some((seen, limit + 1))
                }
                Signal::Overloaded
                    if limit > 1 && st.record.limit_at.is_none_or(|at| now.since(at) >= DECREASE_EVERY) =>
                {
                    Some((seen, (limit / 2).max(1)))
                }
                _ => None,
            };
            let spacing = Duration::from_millis(
                u64::from(change.map_or(limit, |c| c.1)) * 1000 / u64::from(s.per_host_per_second),
            );
            (change, spacing, permit.held_until)
        };
        let began = permit.not_before;
        let free_at = began.plus(spacing).max(now);
        let mut change = change;
        loop {
            let next = {
                let mut st = self.lock();
                st.waiting.pop_first()
            };
            let Some((key, tx)) = next else { break };
            // Hand it over: the next request may start once the spacing allows.
            let until = free_at.plus(Self::lease(s));
            let moved = if permit.local_only {
                Ok(SlotWrite::Done(self.lock().record.clone()))
            } else {
                store.move_host_slot(&self.host, slot, held_until, until, Some(free_at), change.take(), now).await
            };
            match moved {
                Ok(SlotWrite::Done(record)) => {
                    let next = {
                        let mut st = self.lock();
                        if !permit.local_only {
                            st.merge(record, slot);
                        } else {
                            st.record.slots.insert(slot, Slot { until, began: Some(free_at) });
                        }
                        self.permit(slot, until, free_at, true, permit.local_only)
                    };
                    match tx.send(Wake::Permit(next, clock.busy())) {
                        Ok(()) => return,
                        Err(mpsc::error::SendError(Wake::Permit(mut back, _))) => {
                            // It stopped waiting meanwhile: the next in line, or give it back.
                            back.released = true;
                            held_until = back.held_until;
                            let _ = key;
                            continue;
                        }
                        Err(_) => return,
                    }
                }
                Ok(SlotWrite::Refused(record)) => {
                    // Not ours any more (the lease lapsed): the waiter looks again.
                    let mut st = self.lock();
                    st.mine.remove(&slot);
                    st.merge(record, slot);
                    let _ = tx.send(Wake::Retry(clock.busy()));
                    st.waiting.insert(key, tx);
                    return;
                }
                Err(e) => {
                    tracing::warn!(event = "host_gate_unavailable", host = %self.host, error = %e);
                    let mut st = self.lock();
                    st.mine.remove(&slot);
                    let _ = tx.send(Wake::Retry(clock.busy()));
                    st.waiting.insert(key, tx);
                    return;
                }
            }
        }
        // Nobody waits here: give it back, held for the spacing only.
        let record = if permit.local_only {
            None
        } else {
            match store.move_host_slot(&self.host, slot, held_until, free_at, None, change, now).await {
                Ok(SlotWrite::Done(r) | SlotWrite::Refused(r)) => Some(r),
                Err(e) => {
                    tracing::warn!(event = "host_gate_unavailable", host = %self.host, error = %e);
                    None
                }
            }
        };
        let mut st = self.lock();
        st.mine.remove(&slot);
        match record {
            Some(r) => st.merge(r, slot),
            None => {
                st.record.slots.insert(slot, Slot { until: free_at, began: None });
            }
        }
        // A raised limit or a freed slot may let a push that arrived meanwhile in.
        st.wake_head(clock);
    }
}

#[cfg(test)]
mod tests;

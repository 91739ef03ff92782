//! Wall-clock time as milliseconds since the Unix epoch, behind a clock that tests can drive.
//!
//! Everything in the relay that waits — the poller between reads, between passes, until a ban
//! lifts — waits on a [`Clock`], never on `tokio::time` directly. In production that is the
//! [`SystemClock`]. In tests it is a [`ManualClock`], which is also a discrete-event simulator:
//! [`ManualClock::run_until`] moves time straight to the next moment something sleeps until, as
//! soon as nothing is working, so an hour of poller, fake CaptchaAI and owner takes seconds —
//! with the deployed settings (rates, timeouts, grace), not shrunken ones.
//!
//! The simulator's one rule: a task that sleeps on the clock, or does work the simulation must
//! wait for, holds a [`Busy`] guard ([`Clock::busy`]). Time moves only when every guard-holder
//! is asleep on the clock. Real I/O (HTTP to a fake, the embedded DynamoDB engine) takes no
//! simulated time; real timeouts (an HTTP client's) still run on real time.

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll, Waker};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A point in time, milliseconds since the Unix epoch.
#[derive(Copy, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct Timestamp(u64);

impl Timestamp {
    pub const fn from_millis(ms: u64) -> Self {
        Self(ms)
    }

    pub const fn as_millis(self) -> u64 {
        self.0
    }

    pub const fn as_secs(self) -> u64 {
        self.0 / 1000
    }

    #[must_use]
    pub fn plus(self, d: Duration) -> Self {
        Self(self.0.saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    #[must_use]
    pub fn minus(self, d: Duration) -> Self {
        Self(self.0.saturating_sub(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
    }

    /// Time elapsed from `earlier` to `self`, zero if `earlier` is later.
    pub fn since(self, earlier: Timestamp) -> Duration {
        Duration::from_millis(self.0.saturating_sub(earlier.0))
    }

    /// RFC 3339 in UTC with millisecond precision, e.g. `2026-12-02T11:15:46.123Z`.
    /// Parses what [`Self::to_rfc3339`] writes (any RFC 3339 time in UTC); `None` if it is not one.
    pub fn parse_rfc3339(text: &str) -> Option<Self> {
        let t = humantime::parse_rfc3339(text).ok()?;
        let ms = t.duration_since(UNIX_EPOCH).ok()?.as_millis();
        u64::try_from(ms).ok().map(Self)
    }

    pub fn to_rfc3339(self) -> String {
        humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(self.0)).to_string()
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.to_rfc3339())
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_rfc3339())
    }
}

/// A future that resolves when the clock reaches a time.
pub type Sleep = Pin<Box<dyn Future<Output = ()> + Send + 'static>>;

/// Where "now" comes from, and how to wait for a later "now". Handlers and workers read and
/// wait for time only through this, so tests can move it.
pub trait Clock: Send + Sync + fmt::Debug {
    fn now(&self) -> Timestamp;

    /// Resolves once the clock reads `t` or later.
    fn sleep_until(&self, t: Timestamp) -> Sleep;

    /// Marks work in progress that a simulated clock waits for before it moves. A no-op on the
    /// system clock.
    fn busy(&self) -> Busy {
        Busy(None, 0, 0)
    }

    /// Whether time is simulated (moves only when told).
    fn is_simulated(&self) -> bool {
        false
    }

    /// Marks a request in flight on real I/O whose other end may be an actor on this clock that
    /// has not started on it yet (an HTTP request to a receiver that then waits on the clock).
    /// While one is alive, a simulated clock looks twice, a moment apart, before it decides
    /// that nothing is working. A no-op on the system clock.
    fn io(&self) -> Io {
        Io(None)
    }

    /// A parent's wait for children that work on the clock: see [`Waiter`]. A no-op on the
    /// system clock.
    fn waiter(&self) -> Waiter {
        Waiter(None, 0)
    }
}

/// A parent that waits for its children (a `JoinSet` of reads, of sends) while they work on
/// the clock. The parent holds its own [`Busy`] guard; each child holds one from
/// [`Waiter::busy`]. While the parent is in [`Waiter::wait`] it counts as asleep, so the clock
/// moves for the children's sleeps; and a child's guard, when it is dropped as the child ends,
/// wakes the waiting parent in the same step, so the clock cannot move between the child's end
/// and the parent's turn to act on it. A parent asleep on the clock for its own reasons (a rate
/// limit) while a child ends is simply asleep: the clock moves for it as for any sleep.
#[derive(Clone)]
pub struct Waiter(Option<Arc<Sim>>, u64);

impl fmt::Debug for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Waiter(sim)" } else { "Waiter(noop)" })
    }
}

impl Waiter {
    /// A child's guard: like [`Clock::busy`], and dropping it wakes this waiter if it waits.
    pub fn busy(&self) -> Busy {
        match &self.0 {
            None => Busy(None, 0, 0),
            Some(sim) => Busy(Some(sim.clone()), Sim::take_guard(sim), self.1),
        }
    }

    /// Waits for `work` (the children's ends) counting as asleep meanwhile.
    pub async fn wait<F: Future>(&self, work: F) -> F::Output {
        let Some(sim) = &self.0 else {
            return work.await;
        };
        tokio::pin!(work);
        loop {
            let parked =
                Parked { sim: sim.clone(), waiter: self.1, key: None, fired: Arc::new(AtomicBool::new(false)) };
            tokio::select! {
                biased;
                out = &mut work => return out,
                () = parked => {}
            }
        }
    }
}

/// The waiting parent's entry among the sleeps, until a child's end fires it.
struct Parked {
    sim: Arc<Sim>,
    waiter: u64,
    key: Option<(u64, u64)>,
    fired: Arc<AtomicBool>,
}

impl Future for Parked {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.fired.load(Ordering::SeqCst) {
            self.key = None;
            return Poll::Ready(());
        }
        let sim = self.sim.clone();
        let mut st = sim.lock();
        // Looked at again under the lock: a child's end fires this entry (and removes it) under
        // the lock, and may have done so between the look above and this one. Registered again
        // after that, the entry would stay among the sleeps for good — one sleep too many, and
        // the clock would move while an actor is still at work.
        if self.fired.load(Ordering::SeqCst) {
            drop(st);
            self.key = None;
            return Poll::Ready(());
        }
        let key = match self.key {
            Some(k) => k,
            None => {
                st.seq += 1;
                (u64::MAX, st.seq)
            }
        };
        st.waiters.insert(key, Waiter_ { waker: cx.waker().clone(), fired: self.fired.clone() });
        st.parked.insert(self.waiter, key);
        let new = self.key.is_none();
        drop(st);
        self.key = Some(key);
        if new {
            sim.changed.notify_waiters();
        }
        Poll::Pending
    }
}

impl Drop for Parked {
    fn drop(&mut self) {
        if let Some(k) = self.key.take() {
            let mut st = self.sim.lock();
            if st.parked.get(&self.waiter) == Some(&k) {
                st.parked.remove(&self.waiter);
            }
            // Gone already if it fired; its key is its own, so removing it again is harmless.
            st.waiters.remove(&k);
            drop(st);
            self.sim.changed.notify_waiters();
        }
    }
}

/// A request in flight on real I/O (see [`Clock::io`]). Dropping it ends it.
#[must_use = "the guard marks a request only while it is alive"]
pub struct Io(Option<Arc<Sim>>);

impl fmt::Debug for Io {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Io(sim)" } else { "Io(noop)" })
    }
}

impl Drop for Io {
    fn drop(&mut self) {
        if let Some(sim) = self.0.take() {
            sim.lock().io -= 1;
        }
    }
}

/// Time from the operating system; waits are `tokio::time` sleeps.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now(&self) -> Timestamp {
        let ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            .unwrap_or(0);
        Timestamp(ms)
    }

    fn sleep_until(&self, t: Timestamp) -> Sleep {
        let wait = t.since(self.now());
        Box::pin(tokio::time::sleep(wait))
    }
}

/// Work in progress on a simulated clock (see the module docs). Dropping it ends the work.
#[must_use = "the guard marks work only while it is alive"]
/// (The simulation, the guard's id, the [`Waiter`] it wakes as it ends, 0 for none.)
pub struct Busy(Option<Arc<Sim>>, u64, u64);

impl fmt::Debug for Busy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Busy(sim)" } else { "Busy(noop)" })
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        if let Some(sim) = self.0.take() {
            let mut st = sim.lock();
            st.busy -= 1;
            if let Some(l) = st.live.as_mut() {
                l.remove(&self.1);
            }
            // A parent waiting for this child is at work from this step on.
            if self.2 != 0
                && let Some(key) = st.parked.remove(&self.2)
                && let Some(w) = st.waiters.remove(&key)
            {
                w.fired.store(true, Ordering::SeqCst);
                w.waker.wake();
            }
            drop(st);
            sim.changed.notify_waiters();
        }
    }
}

struct Waiter_ {
    waker: Waker,
    fired: Arc<AtomicBool>,
}

#[derive(Default)]
struct SimState {
    now: u64,
    /// Registered sleeps by (wake time, sequence).
    waiters: BTreeMap<(u64, u64), Waiter_>,
    /// The parked entry among `waiters` of each [`Waiter`] that waits, by its id.
    parked: std::collections::HashMap<u64, (u64, u64)>,
    seq: u64,
    /// Live [`Busy`] guards.
    busy: usize,
    /// Live [`Io`] guards.
    io: usize,
    /// Whether the creation sites of guards and sleeps are kept, for the report of a simulation
    /// that stopped moving (`SIM_TRACE_BUSY` set when the clock was made).
    trace: bool,
    /// Where each live [`Busy`] guard and each sleep was made (only with `trace`).
    live: Option<std::collections::HashMap<u64, std::backtrace::Backtrace>>,
    sites: std::collections::HashMap<(u64, u64), std::backtrace::Backtrace>,
    live_seq: u64,
    /// Times the clock was moved on past a stall ([`ManualClock::nudges`]).
    nudges: u64,
    /// How long it may stand still first ([`STUCK_AFTER`] unless set).
    stuck_after: Option<Duration>,
}

struct Sim {
    state: Mutex<SimState>,
    changed: tokio::sync::Notify,
}

impl Sim {
    /// Counts a new guard at work; its id.
    fn take_guard(&self) -> u64 {
        let mut st = self.lock();
        st.busy += 1;
        st.live_seq += 1;
        let id = st.live_seq;
        if st.trace {
            st.live.get_or_insert_with(Default::default).insert(id, std::backtrace::Backtrace::force_capture());
        }
        id
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        // A poisoned lock only means a test thread panicked; the data is still usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// How long a simulation may stand still in real time before [`ManualClock::stuck_report`] is
/// printed and, if anything sleeps, the clock is moved on all the same (a nudge).
const STUCK_AFTER: Duration = Duration::from_secs(30);

/// A clock that only moves when told: [`set`](Self::set) and [`advance`](Self::advance) by
/// hand, or [`run_until`](Self::run_until) as a discrete-event simulation. Shared by clones.
#[derive(Clone)]
pub struct ManualClock(Arc<Sim>);

impl fmt::Debug for ManualClock {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ManualClock({})", self.now())
    }
}

impl ManualClock {
    pub fn at(t: Timestamp) -> Self {
        Self(Arc::new(Sim {
            state: Mutex::new(SimState {
                now: t.as_millis(),
                trace: std::env::var_os("SIM_TRACE_BUSY").is_some(),
                ..SimState::default()
            }),
            changed: tokio::sync::Notify::new(),
        }))
    }

    pub fn advance(&self, d: Duration) {
        let now = self.now();
        self.set(now.plus(d));
    }

    /// Sets the time and wakes every sleep that is due by it.
    pub fn set(&self, t: Timestamp) {
        let mut st = self.0.lock();
        st.now = t.as_millis();
        let first_later = (st.now.saturating_add(1), 0);
        let later = st.waiters.split_off(&first_later);
        let due = std::mem::replace(&mut st.waiters, later);
        drop(st);
        for (_, w) in due {
            w.fired.store(true, Ordering::SeqCst);
            w.waker.wake();
        }
        self.0.changed.notify_waiters();
    }

    /// How long the clock may stand still before it is moved on past a stall (tests of the
    /// nudge; [`STUCK_AFTER`] otherwise).
    pub fn set_stuck_after(&self, d: Duration) {
        self.0.lock().stuck_after = Some(d);
    }

    /// How many times the clock was moved on past a stall (see [`Self::quiesce`]).
    pub fn nudges(&self) -> u64 {
        self.0.lock().nudges
    }

    /// The earliest time something sleeps until, if anything sleeps.
    pub fn next_wake(&self) -> Option<Timestamp> {
        self.0.lock().waiters.keys().next().map(|(t, _)| Timestamp(*t))
    }

    /// Whether every [`Busy`] holder is asleep on this clock (nothing is working).
    pub fn is_quiet(&self) -> bool {
        let st = self.0.lock();
        st.busy <= st.waiters.len()
    }

    /// Waits (in real time) until nothing is working — or, after [`STUCK_AFTER`] without that
    /// while something sleeps, returns all the same (counted in [`Self::nudges`]): a guard whose
    /// holder waits on children asleep on the clock (a known gap in the harnesses' accounting,
    /// tests/sim/LOAD.md) would otherwise stop the simulation for good. What the nudged work
    /// does late still shows in the run's outcomes, which are checked.
    pub async fn quiesce(&self) -> bool {
        let started = std::time::Instant::now();
        let stuck_after = self.0.lock().stuck_after.unwrap_or(STUCK_AFTER);
        let mut told = false;
        loop {
            if !told && started.elapsed() > stuck_after {
                told = true;
                eprintln!("{}", self.stuck_report());
                let mut st = self.0.lock();
                if !st.waiters.is_empty() {
                    st.nudges += 1;
                    eprintln!("moving the clock on to the next sleep's time all the same (nudge {})", st.nudges);
                    return true;
                }
            }
            let changed = self.0.changed.notified();
            if self.is_quiet() {
                return false;
            }
            // The timeout only guards against a wake-up lost to a race; correctness does not
            // depend on it.
            let _ = tokio::time::timeout(Duration::from_millis(20), changed).await;
        }
    }

    /// Who holds time still: the guards at work and the sleeps, by where they were made (with
    /// `SIM_TRACE_BUSY` set when the clock was made; else the counts only). Printed once when a
    /// simulation has not moved for [`STUCK_AFTER`] of real time: a guard held while its holder
    /// waits on something that is not the clock (an unread message, children it joins) stops
    /// a simulated clock for good.
    pub fn stuck_report(&self) -> String {
        let st = self.0.lock();
        let mut out = format!(
            "the simulated clock has not moved for {} s of real time: {} guards at work, {} sleeps, {} on real I/O",
            STUCK_AFTER.as_secs(),
            st.busy,
            st.waiters.len(),
            st.io
        );
        if !st.trace {
            out.push_str(" (set SIM_TRACE_BUSY=1 to see where they were made)");
            return out;
        }
        let ours = |bt: &std::backtrace::Backtrace| {
            let text = bt.to_string();
            text.lines()
                .filter(|l| l.contains(" at ./") && !l.contains("shared/time/src") && !l.contains("/sysdeps/"))
                .take(5)
                .map(|l| l.trim().trim_start_matches("at ./").to_owned())
                .collect::<Vec<_>>()
                .join(" < ")
        };
        let mut at_work: BTreeMap<String, usize> = BTreeMap::new();
        for bt in st.live.iter().flat_map(|l| l.values()) {
            *at_work.entry(ours(bt)).or_default() += 1;
        }
        let mut asleep: BTreeMap<String, usize> = BTreeMap::new();
        for key in st.waiters.keys() {
            *asleep.entry(st.sites.get(key).map(ours).unwrap_or_default()).or_default() += 1;
        }
        for (title, groups) in [("guards", at_work), ("sleeps", asleep)] {
            out.push_str(&format!("\n{title}:"));
            for (site, n) in groups {
                out.push_str(&format!("\n  {n:>4} {site}"));
            }
        }
        out
    }

    /// Waits (in real time) until nothing is working, looking twice a moment apart while
    /// requests are in flight on real I/O ([`Clock::io`]): a request can be between its sender,
    /// asleep on its timeout, and a receiver that has not started on it yet.
    pub async fn settle(&self) {
        loop {
            if self.quiesce().await || self.0.lock().io == 0 {
                return;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
            if self.is_quiet() {
                return;
            }
        }
    }

    /// The simulation: whenever nothing is working, moves time to the next moment something
    /// sleeps until, until `end`. Returns at `end` (time set to it), once nothing is working.
    pub async fn run_until(&self, end: Timestamp) {
        loop {
            self.settle().await;
            match self.next_wake() {
                Some(t) if t <= end => self.set(t),
                _ => {
                    self.set(end.max(self.now()));
                    self.settle().await;
                    return;
                }
            }
        }
    }
}

struct ManualSleep {
    sim: Arc<Sim>,
    at: u64,
    key: Option<(u64, u64)>,
    fired: Arc<AtomicBool>,
}

impl Future for ManualSleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if self.fired.load(Ordering::SeqCst) {
            self.key = None;
            return Poll::Ready(());
        }
        let sim = self.sim.clone();
        let mut st = sim.lock();
        if st.now >= self.at {
            if let Some(k) = self.key.take() {
                st.waiters.remove(&k);
            }
            drop(st);
            sim.changed.notify_waiters();
            return Poll::Ready(());
        }
        let key = match self.key {
            Some(k) => k,
            None => {
                st.seq += 1;
                (self.at, st.seq)
            }
        };
        if st.trace && self.key.is_none() {
            if st.sites.len() > 2 * st.waiters.len() + 1_000 {
                let SimState { sites, waiters, .. } = &mut *st;
                sites.retain(|k, _| waiters.contains_key(k));
            }
            st.sites.insert(key, std::backtrace::Backtrace::force_capture());
        }
        st.waiters.insert(key, Waiter_ { waker: cx.waker().clone(), fired: self.fired.clone() });
        let new = self.key.is_none();
        drop(st);
        self.key = Some(key);
        if new {
            sim.changed.notify_waiters();
        }
        Poll::Pending
    }
}

impl Drop for ManualSleep {
    fn drop(&mut self) {
        if let Some(k) = self.key.take()
            && !self.fired.load(Ordering::SeqCst)
        {
            self.sim.lock().waiters.remove(&k);
            self.sim.changed.notify_waiters();
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.lock().now)
    }

    fn sleep_until(&self, t: Timestamp) -> Sleep {
        Box::pin(ManualSleep {
            sim: self.0.clone(),
            at: t.as_millis(),
            key: None,
            fired: Arc::new(AtomicBool::new(false)),
        })
    }

    fn busy(&self) -> Busy {
        Busy(Some(self.0.clone()), Sim::take_guard(&self.0), 0)
    }

    fn waiter(&self) -> Waiter {
        let mut st = self.0.lock();
        st.live_seq += 1;
        Waiter(Some(self.0.clone()), st.live_seq)
    }

    fn is_simulated(&self) -> bool {
        true
    }

    fn io(&self) -> Io {
        self.0.lock().io += 1;
        Io(Some(self.0.clone()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_parent_waiting_on_a_sleeping_child_is_nudged_past_not_stuck_forever() {
        let clock = ManualClock::at(Timestamp::from_millis(0));
        clock.set_stuck_after(Duration::from_millis(200));
        // The parent holds a guard while it waits for its child (not on the clock); the child
        // holds its own and sleeps 5 s: busy 2, asleep 1 — the gap that stalls a simulation.
        let parent_busy = clock.busy();
        let (c, child_busy) = (clock.clone(), clock.busy());
        let parent = tokio::spawn(async move {
            let _busy = parent_busy;
            tokio::spawn(async move {
                let _busy = child_busy;
                c.sleep_until(Timestamp::from_millis(5_000)).await;
            })
            .await
            .ok();
        });
        tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(10_000)))
            .await
            .expect("the simulation ends instead of standing still");
        assert!(parent.await.is_ok());
        assert_eq!(clock.nudges(), 1, "moved on once, past the stall");
        assert_eq!(clock.now(), Timestamp::from_millis(10_000));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_waiter_lets_the_clock_move_for_its_children_and_acts_on_each_end_before_it_moves_on() {
        let clock = ManualClock::at(Timestamp::from_millis(0));
        clock.set_stuck_after(Duration::from_secs(5));
        // Another actor sleeps until 60 s: the clock must not jump there between a child's end
        // and the parent's turn.
        let (c, other) = (clock.clone(), clock.busy());
        tokio::spawn(async move {
            let _busy = other;
            c.sleep_until(Timestamp::from_millis(60_000)).await;
        });
        let (c, parent_busy) = (clock.clone(), clock.busy());
        let parent = tokio::spawn(async move {
            let _busy = parent_busy;
            let waiter = c.waiter();
            let mut children = tokio::task::JoinSet::new();
            for s in [5u64, 10, 15] {
                let (c, busy) = (c.clone(), waiter.busy());
                children.spawn(async move {
                    let _busy = busy;
                    c.sleep_until(Timestamp::from_millis(s * 1_000)).await;
                });
            }
            let mut seen = Vec::new();
            while waiter.wait(children.join_next()).await.is_some() {
                seen.push(c.now().as_millis());
                // The parent's own work after each end: the clock waits for it.
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            seen
        });
        tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(90_000)))
            .await
            .expect("the simulation runs to its end");
        assert_eq!(parent.await.ok(), Some(vec![5_000, 10_000, 15_000]), "each end seen at its own time");
        assert_eq!(clock.nudges(), 0, "no stall to move past");
    }

    #[test]
    fn formats_rfc3339_in_utc_with_millis() {
        assert_eq!(Timestamp::from_millis(1_796_210_146_123).to_rfc3339(), "2026-12-02T11:15:46.123Z");
        assert_eq!(
            Timestamp::parse_rfc3339("2026-12-02T11:15:46.123Z"),
            Some(Timestamp::from_millis(1_796_210_146_123))
        );
        assert_eq!(Timestamp::parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn arithmetic_saturates_instead_of_panicking() {
        let t = Timestamp::from_millis(1_000);
        assert_eq!(t.since(Timestamp::from_millis(5_000)), Duration::ZERO);
        assert_eq!(Timestamp::from_millis(u64::MAX).plus(Duration::from_secs(1)).as_millis(), u64::MAX);
        assert_eq!(t.minus(Duration::from_secs(5)).as_millis(), 0);
    }

    #[test]
    fn manual_clock_moves_only_when_told() {
        let clock = ManualClock::at(Timestamp::from_millis(10));
        clock.advance(Duration::from_millis(5));
        assert_eq!(clock.now(), Timestamp::from_millis(15));
    }

    #[tokio::test]
    async fn a_sleep_ends_when_the_clock_reaches_it_not_before() {
        let clock = ManualClock::at(Timestamp::from_millis(0));
        let (c, done) = (clock.clone(), Arc::new(AtomicBool::new(false)));
        let d = done.clone();
        let h = tokio::spawn(async move {
            c.sleep_until(Timestamp::from_millis(1_000)).await;
            d.store(true, Ordering::SeqCst);
        });
        tokio::task::yield_now().await;
        while clock.next_wake().is_none() {
            tokio::task::yield_now().await;
        }
        clock.set(Timestamp::from_millis(999));
        tokio::task::yield_now().await;
        assert!(!done.load(Ordering::SeqCst), "not yet");
        clock.set(Timestamp::from_millis(1_000));
        h.await.expect("sleeper");
        assert!(done.load(Ordering::SeqCst));
        assert_eq!(clock.next_wake(), None, "a finished sleep is deregistered");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_simulation_jumps_between_wakes_and_waits_for_work() {
        // Two actors tick every 10 s and 15 s of simulated time for a simulated hour; each tick
        // does a little real work. The run takes far less than a second of real time.
        let clock = ManualClock::at(Timestamp::from_millis(0));
        let ticks = Arc::new(Mutex::new(Vec::new()));
        for every in [10_000u64, 15_000] {
            let (c, ticks) = (clock.clone(), ticks.clone());
            let busy = c.busy();
            tokio::spawn(async move {
                let _busy = busy;
                let mut next = every;
                while next <= 3_600_000 {
                    c.sleep_until(Timestamp::from_millis(next)).await;
                    tokio::time::sleep(Duration::from_micros(50)).await; // real work, no sim time
                    ticks.lock().expect("lock").push((every, c.now().as_millis()));
                    next += every;
                }
            });
        }
        let started = std::time::Instant::now();
        clock.run_until(Timestamp::from_millis(3_600_000)).await;
        let got = ticks.lock().expect("lock").clone();
        assert_eq!(got.len(), 360 + 240, "every tick ran");
        assert!(got.iter().all(|(every, at)| at % every == 0), "each ran exactly at its time");
        assert!(started.elapsed() < Duration::from_secs(20), "an hour simulated in {:?}", started.elapsed());
        assert_eq!(clock.now(), Timestamp::from_millis(3_600_000));
    }
}

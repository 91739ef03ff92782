//! [`ManualClock`]: a clock that moves only when told, and the discrete-event simulation that
//! moves it to the next sleep whenever nothing is working; its sleeps ([`ManualSleep`]).

use std::collections::BTreeMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use crate::clock::{Clock, Sleep};
use crate::guards::{Busy, Io};
use crate::sim::{Sim, SimState, Waiter_};
use crate::timestamp::Timestamp;
use crate::waiter::Waiter;

/// How long a simulation may stand still in real time before [`ManualClock::stuck_report`] is
/// printed and, if anything sleeps, the clock is moved on all the same (a nudge).
pub(crate) const STUCK_AFTER: Duration = Duration::from_secs(30);

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

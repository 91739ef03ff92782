//! The state a simulated clock and its guards, sleeps and waiters share: the time, the
//! registered sleeps, the count of guards at work, and what is kept to report a stall.

use std::collections::BTreeMap;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::Waker;
use std::time::Duration;

pub(crate) struct Waiter_ {
    pub(crate) waker: Waker,
    pub(crate) fired: Arc<AtomicBool>,
}

#[derive(Default)]
pub(crate) struct SimState {
    pub(crate) now: u64,
    /// Registered sleeps by (wake time, sequence).
    pub(crate) waiters: BTreeMap<(u64, u64), Waiter_>,
    /// The parked entry among `waiters` of each [`Waiter`](crate::Waiter) that waits, by its id.
    pub(crate) parked: std::collections::HashMap<u64, (u64, u64)>,
    pub(crate) seq: u64,
    /// Live [`Busy`](crate::Busy) guards.
    pub(crate) busy: usize,
    /// Live [`Io`](crate::Io) guards.
    pub(crate) io: usize,
    /// Whether the creation sites of guards and sleeps are kept, for the report of a simulation
    /// that stopped moving (`SIM_TRACE_BUSY` set when the clock was made).
    pub(crate) trace: bool,
    /// Where each live [`Busy`](crate::Busy) guard and each sleep was made (only with `trace`).
    pub(crate) live: Option<std::collections::HashMap<u64, std::backtrace::Backtrace>>,
    pub(crate) sites: std::collections::HashMap<(u64, u64), std::backtrace::Backtrace>,
    pub(crate) live_seq: u64,
    /// Times the clock was moved on past a stall ([`ManualClock::nudges`](crate::ManualClock::nudges)).
    pub(crate) nudges: u64,
    /// How long it may stand still first ([`STUCK_AFTER`](crate::manual::STUCK_AFTER) unless set).
    pub(crate) stuck_after: Option<Duration>,
}

pub(crate) struct Sim {
    pub(crate) state: Mutex<SimState>,
    pub(crate) changed: tokio::sync::Notify,
}

impl Sim {
    /// Counts a new guard at work; its id.
    pub(crate) fn take_guard(&self) -> u64 {
        let mut st = self.lock();
        st.busy += 1;
        st.live_seq += 1;
        let id = st.live_seq;
        if st.trace {
            st.live.get_or_insert_with(Default::default).insert(id, std::backtrace::Backtrace::force_capture());
        }
        id
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, SimState> {
        // A poisoned lock only means a test thread panicked; the data is still usable.
        self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

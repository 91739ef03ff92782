//! The guards a simulated clock counts: [`Busy`] (work it waits for before it moves) and
//! [`Io`] (a request in flight on real I/O). On the system clock both are no-ops.

use std::fmt;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use crate::sim::Sim;

/// A request in flight on real I/O (see [`Clock::io`](crate::Clock::io)). Dropping it ends it.
#[must_use = "the guard marks a request only while it is alive"]
pub struct Io(pub(crate) Option<Arc<Sim>>);

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

/// Work in progress on a simulated clock (see the [crate docs](crate)). Dropping it ends the work.
#[must_use = "the guard marks work only while it is alive"]
/// (The simulation, the guard's id, the [`Waiter`](crate::Waiter) it wakes as it ends, 0 for none.)
pub struct Busy(pub(crate) Option<Arc<Sim>>, pub(crate) u64, pub(crate) u64);

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

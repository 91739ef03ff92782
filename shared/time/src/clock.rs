//! The [`Clock`] trait every waiting part of the relay reads time through, and the
//! [`SystemClock`] production runs on.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::time::{SystemTime, UNIX_EPOCH};

use crate::guards::{Busy, Io};
use crate::timestamp::Timestamp;
use crate::waiter::Waiter;

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

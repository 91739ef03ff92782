//! The parked-waiter machinery: a [`Waiter`] lets a parent wait for children working on a
//! simulated clock while counting as asleep, its [`Parked`] entry sitting among the sleeps until
//! a child's [`Busy`] guard, dropped as the child ends, fires it.

use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use crate::guards::Busy;
use crate::sim::{Sim, Waiter_};

/// A parent that waits for its children (a `JoinSet` of reads, of sends) while they work on
/// the clock. The parent holds its own [`Busy`] guard; each child holds one from
/// [`Waiter::busy`]. While the parent is in [`Waiter::wait`] it counts as asleep, so the clock
/// moves for the children's sleeps; and a child's guard, when it is dropped as the child ends,
/// wakes the waiting parent in the same step, so the clock cannot move between the child's end
/// and the parent's turn to act on it. A parent asleep on the clock for its own reasons (a rate
/// limit) while a child ends is simply asleep: the clock moves for it as for any sleep.
#[derive(Clone)]
pub struct Waiter(pub(crate) Option<Arc<Sim>>, pub(crate) u64);

impl fmt::Debug for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.0.is_some() { "Waiter(sim)" } else { "Waiter(noop)" })
    }
}

impl Waiter {
    /// A child's guard: like [`Clock::busy`](crate::Clock::busy), and dropping it wakes this waiter if it waits.
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

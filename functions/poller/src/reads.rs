//! The reads in flight of one pass, waited for no longer than the invocation's hard end.

use std::sync::Arc;

use relay_shared::time::{Clock, Timestamp, Waiter};

use crate::report::{PollOutcome, TickReport};

/// Reads in flight, each holding a busy guard of its own; the invocation counts as asleep
/// while it waits for them (see [`Waiter`]). Waiting ends at `hard_end`: reads still running
/// then are abandoned (their claims lapse), so the invocation ends before its deadline.
pub(crate) struct Reads {
    set: tokio::task::JoinSet<Vec<PollOutcome>>,
    waiter: Waiter,
    /// Turns true at the hard end. Told by a timer that is one more child of the waiter (its
    /// guard wakes the waiting invocation as it ends), not by a sleep inside the wait: a second
    /// sleep of the waiting invocation would count it asleep twice on a simulated clock.
    ended: tokio::sync::watch::Receiver<bool>,
    timer: tokio::task::JoinHandle<()>,
}

impl Drop for Reads {
    fn drop(&mut self) {
        self.timer.abort();
    }
}

impl Reads {
    pub(crate) fn new(clock: Arc<dyn Clock>, hard_end: Timestamp) -> Self {
        let waiter = clock.waiter();
        let (tell, ended) = tokio::sync::watch::channel(false);
        let busy = waiter.busy();
        let timer = tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(hard_end).await;
            let _ = tell.send(true);
        });
        Self { set: tokio::task::JoinSet::new(), waiter, ended, timer }
    }

    pub(crate) fn spawn(&mut self, read: impl Future<Output = Vec<PollOutcome>> + Send + 'static) {
        let busy = self.waiter.busy();
        self.set.spawn(async move {
            let _busy = busy;
            read.await
        });
    }

    /// Waits until fewer than `concurrency` reads are in flight.
    pub(crate) async fn make_room(&mut self, concurrency: usize, report: &mut TickReport) {
        while self.set.len() >= concurrency.max(1) {
            self.take_one(report).await;
        }
    }

    /// Takes one read's result, waiting for it until the hard end. `false` if none is in
    /// flight (any left at the hard end are abandoned).
    pub(crate) async fn take_one(&mut self, report: &mut TickReport) -> bool {
        let Self { set, waiter, ended, .. } = self;
        let done = waiter
            .wait(async {
                tokio::select! {
                    biased;
                    _ = ended.wait_for(|e| *e) => None,
                    done = set.join_next() => Some(done),
                }
            })
            .await;
        let done = match done {
            Some(Some(done)) => done,
            Some(None) => return false,
            None => {
                let left = set.len() as u64;
                if left > 0 {
                    tracing::warn!(
                        event = "poll_reads_abandoned",
                        reads = left,
                        "reads still running at the invocation's end: their claims lapse and the tasks are read again"
                    );
                    report.reads_abandoned += left;
                    // Aborted, they end without the clock: wait for them holding it still.
                    set.shutdown().await;
                }
                return false;
            }
        };
        match done {
            Ok(applied) => applied.into_iter().for_each(|a| report.add(a)),
            Err(e) => {
                // A panicking read: its claim lapses with the lease and the task is read again.
                tracing::error!(event = "poll_read_panicked", error = %e);
                report.errors += 1;
            }
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// Reads still running at the invocation's hard end are abandoned there, on the clock the
    /// invocation runs on: the wait ends at the hard end, not when the slow read would.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_still_running_at_the_hard_end_are_abandoned() {
        let clock = relay_shared::time::ManualClock::at(Timestamp::from_millis(0));
        let hard_end = Timestamp::from_millis(74_000);
        let (c, parent_busy): (Arc<dyn Clock>, _) = (Arc::new(clock.clone()), clock.busy());
        let parent = tokio::spawn(async move {
            let _busy = parent_busy;
            let mut reads = Reads::new(c.clone(), hard_end);
            // One read done at 10 s, one whose writes back off until 200 s.
            for at in [10_000u64, 200_000] {
                let c = c.clone();
                reads.spawn(async move {
                    c.sleep_until(Timestamp::from_millis(at)).await;
                    vec![PollOutcome::Recovered]
                });
            }
            let mut report = TickReport::default();
            let mut ends = Vec::new();
            while reads.take_one(&mut report).await {
                ends.push(c.now().as_millis());
            }
            ends.push(c.now().as_millis());
            (ends, report)
        });
        tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(300_000)))
            .await
            .expect("the clock runs");
        let (ends, report) = parent.await.expect("the invocation ends");
        assert_eq!(ends, vec![10_000, 74_000], "one read taken at 10 s, the wait given up at the hard end");
        assert_eq!((report.recovered, report.reads_abandoned), (1, 1), "{report:?}");
    }
}

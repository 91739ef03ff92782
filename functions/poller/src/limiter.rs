//! The res.php rate limit: this invocation's spacing and the account-wide per-second budget.

use std::time::Duration;

use relay_shared::store::Account;
use relay_shared::time::{Clock, Timestamp};

/// Spaces res.php requests at least `1/rps` apart, on the clock ([`Self::acquire`]), and takes
/// each read's place in the account-wide budget of its second ([`Self::budget`]: a counter in
/// the table shared by every invocation), so two invocations that overlap still read at `rps`
/// in all, not twice that. Used by the invocation's one main loop only.
pub(crate) struct RateLimiter {
    rps: u32,
    interval: Duration,
    next: Timestamp,
    account: Account,
}

impl RateLimiter {
    pub(crate) fn new(rps: u32, account: Account) -> Self {
        Self {
            rps: rps.max(1),
            interval: Duration::from_secs(1) / rps.max(1),
            next: Timestamp::from_millis(0),
            account,
        }
    }

    /// The next free slot, if it comes before `latest`; waits for it. `None`: no slot in time.
    pub(crate) async fn acquire(&mut self, clock: &dyn Clock, latest: Timestamp) -> Option<Timestamp> {
        let slot = self.next.max(clock.now());
        if slot > latest {
            return None;
        }
        self.next = slot.plus(self.interval);
        if slot > clock.now() {
            clock.sleep_until(slot).await;
        }
        Some(slot)
    }

    /// A place for one read in the account's budget of the current second, waiting for the
    /// next second while this one is spent. Taken only for a task this invocation has claimed
    /// (a claim lost to another invocation spends nothing). A counter that cannot be written
    /// counts as spent: no read without its place. `false`: no place before `latest`.
    pub(crate) async fn budget(&mut self, clock: &dyn Clock, latest: Timestamp) -> bool {
        loop {
            let now = clock.now();
            match self.account.take_read_slot(now, self.rps).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "res.php budget not taken; trying in the next second"),
            }
            let next_second = Timestamp::from_millis((now.as_secs() + 1) * 1_000);
            if next_second > latest {
                return false;
            }
            self.next = self.next.max(next_second);
            clock.sleep_until(next_second).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    /// Two invocations reading at once, each pacing itself at the rate template.yaml deploys:
    /// the shared budget keeps every second of the pair at that rate, and both make progress.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_read_budget_holds_across_overlapping_invocations() -> anyhow::Result<()> {
        let db = relay_shared::testkit::LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let clock = relay_shared::time::ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let start = clock.now();
        let end = start.plus(Duration::from_secs(5));
        let rps = relay_sim::Deployed::from_template()?.poller.requests_per_second;
        let reads = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut runs = Vec::new();
        for _ in 0..2 {
            let (store, reads) = (store.clone(), reads.clone());
            let c: Arc<dyn Clock> = Arc::new(clock.clone());
            let busy = c.busy();
            runs.push(tokio::spawn(async move {
                let _busy = busy;
                let mut limiter = RateLimiter::new(rps, store.account());
                while limiter.acquire(c.as_ref(), end).await.is_some() {
                    if limiter.budget(c.as_ref(), end).await {
                        reads.lock().expect("reads").push(c.now().as_secs());
                    }
                }
            }));
        }
        clock.run_until(end.plus(Duration::from_secs(1))).await;
        for r in runs {
            r.await?;
        }
        let reads = reads.lock().expect("reads").clone();
        let mut per_second = std::collections::BTreeMap::new();
        for s in &reads {
            *per_second.entry(*s).or_insert(0u32) += 1;
        }
        assert!(per_second.values().all(|n| *n <= rps), "at most {rps} a second in all: {per_second:?}");
        assert!(reads.len() as u32 >= 4 * rps, "the pair still reads at the rate (5 s x {rps}): {per_second:?}");
        Ok(())
    }
}

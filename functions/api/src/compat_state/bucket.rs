//! A token bucket per relay key: how many `res.php` calls one key may make a second on one
//! instance.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Reads allowed per key and second on one instance (a burst of [`READ_BURST`]): only to keep
/// one runaway client from starving the relay; the SDKs poll every 5–10 s.
pub const READS_PER_SECOND: f64 = 20.0;
pub const READ_BURST: f64 = 60.0;

/// The read buckets of every key seen lately: the tokens left, and when they were counted.
#[derive(Debug, Clone, Default)]
pub(super) struct ReadBuckets(Arc<Mutex<HashMap<String, (f64, Instant)>>>);

impl ReadBuckets {
    /// Takes one read from `key`'s bucket; `false` when it is empty.
    pub(super) fn take(&self, key: &str) -> bool {
        let Ok(mut b) = self.0.lock() else { return true };
        if b.len() > 10_000 {
            b.retain(|_, (_, at)| at.elapsed() < Duration::from_secs(10));
        }
        let now = Instant::now();
        let (tokens, at) = b.entry(key.to_owned()).or_insert((READ_BURST, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * READS_PER_SECOND).min(READ_BURST);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_gets_its_burst_then_waits_for_the_refill_and_keys_do_not_share() {
        let buckets = ReadBuckets::default();
        let burst = READ_BURST as usize;
        // The burst, less the few the refill may add while this loop runs.
        let taken = (0..burst + 10).take_while(|_| buckets.take("a")).count();
        assert!((burst..burst + 3).contains(&taken), "the burst, then empty: {taken}");
        assert!(buckets.take("b"), "another key has its own bucket");
        std::thread::sleep(Duration::from_secs_f64(1.5 / READS_PER_SECOND));
        assert!(buckets.take("a"), "refilled at {READS_PER_SECOND} a second");
    }
}

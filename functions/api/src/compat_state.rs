//! Per-instance state of the compat front (held by `Deps`): the balance cache and the per-key read buckets.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

pub(crate) mod bucket;

use bucket::ReadBuckets;

/// How long a balance read from CaptchaAI is reused.
pub const BALANCE_FOR: Duration = Duration::from_secs(5);

/// Per-instance state of the compat front: the balance cache and the per-key read buckets.
#[derive(Debug, Clone, Default)]
pub struct CompatState {
    balance: Arc<Mutex<Option<(String, Instant)>>>,
    buckets: ReadBuckets,
}

impl CompatState {
    /// Takes one read from `key`'s bucket; `false` when it is empty.
    pub(super) fn take_read(&self, key: &str) -> bool {
        self.buckets.take(key)
    }

    /// The balance last read from CaptchaAI, while it is younger than [`BALANCE_FOR`].
    pub(super) fn cached_balance(&self) -> Option<String> {
        let cached = self.balance.lock().ok().and_then(|b| b.clone());
        cached.filter(|(_, at)| at.elapsed() < BALANCE_FOR).map(|(b, _)| b)
    }

    /// Keeps a balance just read from CaptchaAI.
    pub(super) fn keep_balance(&self, balance: &str) {
        if let Ok(mut c) = self.balance.lock() {
            *c = Some((balance.to_owned(), Instant::now()));
        }
    }
}

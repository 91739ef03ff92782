//! The functions' telemetry as the Lambdas install it, on writers the bench can measure: the
//! JSON log subscriber on a writer that counts bytes and discards them, and the EMF recorder,
//! flushed by the bench (after each invocation, on Lambda).

use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

static LOG_BYTES: AtomicU64 = AtomicU64::new(0);
static LAST_METRICS: AtomicUsize = AtomicUsize::new(0);
static COLLECTOR: OnceLock<Option<&'static metrics_cloudwatch_embedded::Collector>> = OnceLock::new();

/// Counts what the log subscriber writes, keeps nothing.
struct CountingSink;

impl std::io::Write for CountingSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOG_BYTES.fetch_add(buf.len() as u64, Ordering::Relaxed);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Installs both, once per process.
pub fn install() {
    relay_shared::telemetry::init_with_writer(|| CountingSink);
    metrics();
}

/// The EMF recorder (installed on first use).
pub fn metrics() -> Option<&'static metrics_cloudwatch_embedded::Collector> {
    *COLLECTOR.get_or_init(|| relay_shared::telemetry::metrics_init("bench").ok())
}

/// Bytes logged so far.
pub fn log_bytes() -> u64 {
    LOG_BYTES.load(Ordering::Relaxed)
}

/// Flushes the EMF recorder as the runtime does after an invocation: the bytes of the documents
/// written. [`metric_count`] then tells how many metrics they define.
pub fn flush_metrics() -> u64 {
    let Some(c) = metrics() else { return 0 };
    let mut out = Vec::new();
    if c.flush(&mut out).is_err() {
        return 0;
    }
    let text = String::from_utf8_lossy(&out);
    let defined: usize = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .map(|doc| {
            doc["_aws"]["CloudWatchMetrics"]
                .as_array()
                .map(|d| d.iter().map(|m| m["Metrics"].as_array().map_or(0, Vec::len)).sum())
                .unwrap_or(0)
        })
        .sum();
    LAST_METRICS.store(defined, Ordering::Relaxed);
    out.len() as u64
}

/// Metrics defined by the documents of the last [`flush_metrics`].
pub fn metric_count() -> usize {
    LAST_METRICS.load(Ordering::Relaxed)
}

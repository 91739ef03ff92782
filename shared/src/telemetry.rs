//! Logging: structured JSON lines on stdout (CloudWatch reads them), one per event. Lambda's
//! request id comes from the runtime's span. Secrets and solutions are never logged: their
//! types redact themselves, and nothing here formats a request body.

/// Installs the JSON subscriber once. `RUST_LOG` (default `info`) picks the level.
pub fn init() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_current_span(true)
        .with_span_list(false)
        .flatten_event(true)
        .with_target(false)
        .without_time()
        .with_ansi(false)
        .try_init();
}

/// Logs a failed cold start (with its cause chain) before the runtime reports it.
pub fn cold_start<T>(deps: anyhow::Result<T>) -> anyhow::Result<T> {
    deps.inspect_err(|e| tracing::error!(event = "cold_start_failed", error = format!("{e:#}"), "cold start failed"))
}

/// A short, non-reversible stand-in for a token in logs: its length and first characters
/// would already say too much, so only the length is kept.
pub fn redact(token: &str) -> String {
    format!("<redacted {} bytes>", token.len())
}

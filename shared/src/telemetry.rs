//! Logging: structured JSON lines on stdout (CloudWatch reads them), one per event. Lambda's
//! request id comes from the runtime's span. Secrets and solutions are never logged: their
//! types redact themselves, and nothing here formats a request body.

/// Installs the JSON subscriber once, on stdout. `RUST_LOG` (default `info`) picks the level.
pub fn init() {
    init_with_writer(std::io::stdout);
}

/// The same subscriber on another writer (tests capture every line the relay would log).
pub fn init_with_writer<W>(writer: W)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    install_json(writer, "info", true);
}

/// The same JSON lines as [`init`], for a process that is not a Lambda (`relay-local` with
/// `RELAY_LOG_FORMAT=json`): on `writer`, with `default_filter` when `RUST_LOG` is not set, and
/// each line's time in a `timestamp` field (no CloudWatch stamps them here) and its `target`
/// (one process runs every component: the target says which one wrote the line).
pub fn init_json<W>(writer: W, default_filter: &str)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    install_json(writer, default_filter, false);
}

/// One JSON subscriber for both: on Lambda without the time (CloudWatch stamps each line) and
/// the target (one function per log group).
fn install_json<W>(writer: W, default_filter: &str, lambda: bool)
where
    W: for<'w> tracing_subscriber::fmt::MakeWriter<'w> + Send + Sync + 'static,
{
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter));
    let builder = tracing_subscriber::fmt()
        .json()
        .with_env_filter(filter)
        .with_current_span(true)
        .with_span_list(false)
        .flatten_event(true)
        .with_ansi(false)
        .with_writer(writer);
    let _ = if lambda { builder.with_target(false).without_time().try_init() } else { builder.try_init() };
}

/// An error and every cause under it, `outer: inner: root` (what anyhow's `{:#}` prints), for
/// a log line: a cause left out is what the reader of the log needed.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        // Some errors already print their source in their own message.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

/// CloudWatch namespace of every metric the relay emits.
pub const METRICS_NAMESPACE: &str = "CaptchaRelay";

/// Installs the CloudWatch Embedded Metric Format recorder (once, at cold start): every
/// `metrics::counter!` lands in an EMF document flushed to stdout after each invocation, with
/// a `service` dimension, the Lambda request id as a property and a `ColdStart` metric.
pub fn metrics_init(service: &'static str) -> anyhow::Result<&'static metrics_cloudwatch_embedded::Collector> {
    metrics_cloudwatch_embedded::Builder::new()
        .cloudwatch_namespace(METRICS_NAMESPACE)
        .with_dimension("service", service)
        .lambda_cold_start_metric("ColdStart")
        .with_lambda_request_id("RequestId")
        .init()
        .map_err(|e| anyhow::anyhow!("metrics recorder: {e}"))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_chain_names_every_cause_once() {
        #[derive(Debug, thiserror::Error)]
        #[error("opening the task store")]
        struct Outer(#[source] std::io::Error);
        let e = Outer(std::io::Error::new(std::io::ErrorKind::PermissionDenied, "data dir not writable"));
        assert_eq!(error_chain(&e), "opening the task store: data dir not writable");
        let plain = std::io::Error::other("just this");
        assert_eq!(error_chain(&plain), "just this");
    }

    #[test]
    fn metrics_are_written_as_embedded_metric_format_documents() {
        let collector = metrics_init("test").expect("recorder installs once");
        metrics::counter!("callbacks", "outcome" => "duplicate").increment(2);
        let mut out = Vec::new();
        collector.flush(&mut out).expect("flush");
        let line = String::from_utf8(out).expect("utf8");
        let doc: serde_json::Value = serde_json::from_str(line.lines().next().expect("a document")).expect("json");
        assert_eq!(doc["_aws"]["CloudWatchMetrics"][0]["Namespace"], METRICS_NAMESPACE);
        assert_eq!(doc["service"], "test");
        assert_eq!(doc["outcome"], "duplicate");
        assert_eq!(doc["callbacks"], 2);
    }
}

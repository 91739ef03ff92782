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
        .with_writer(writer)
        .try_init();
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

//! The cold start every Lambda shares, once per execution environment: JSON logs, the
//! CloudWatch metrics recorder, the function's dependencies built from its environment (a
//! failure logged with its cause chain before the runtime reports it), and the DynamoDB
//! connection opened in init rather than by the first request. Each `main.rs` is this and the
//! runtime loop with its handler.

use std::future::Future;

use crate::store::Table;

/// What a function's `main` gets from its cold start.
pub struct ColdStart<D> {
    pub metrics: &'static metrics_cloudwatch_embedded::Collector,
    pub deps: D,
}

/// Starts `service`: logs, metrics, `deps` (awaited), then a bounded warm-up of the store
/// table `store` picks out of them (any handle of it) (a failure only means the first request connects itself).
pub async fn cold_start<D>(
    service: &'static str,
    deps: impl Future<Output = anyhow::Result<D>>,
    store: impl FnOnce(&D) -> &Table,
) -> Result<ColdStart<D>, lambda_http::Error> {
    crate::telemetry::init();
    let metrics = crate::telemetry::cold_start(crate::telemetry::metrics_init(service))?;
    let deps = crate::telemetry::cold_start(deps.await)?;
    store(&deps).warm_up(crate::warm::WARM_UP_LIMIT).await;
    Ok(ColdStart { metrics, deps })
}

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let metrics = relay_shared::telemetry::cold_start(relay_shared::telemetry::metrics_init("callback"))?;
    let deps = relay_shared::telemetry::cold_start(relay_callback::Deps::from_env().await)?;
    metrics_cloudwatch_embedded::lambda::handler::run_http(metrics, |req| relay_callback::handle(req, &deps)).await
}

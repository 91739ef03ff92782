use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use relay_shared::time::{Clock, SystemClock};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let metrics = relay_shared::telemetry::cold_start(relay_shared::telemetry::metrics_init("submitter"))?;
    let deps = relay_shared::telemetry::cold_start(relay_submitter::Deps::from_env().await)?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    metrics_cloudwatch_embedded::lambda::handler::run(metrics, |event: LambdaEvent<serde_json::Value>| {
        relay_submitter::handle(event, &deps, clock.clone())
    })
    .await
}

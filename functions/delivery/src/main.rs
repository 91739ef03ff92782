use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use relay_shared::time::{Clock, SystemClock};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let metrics = relay_shared::telemetry::cold_start(relay_shared::telemetry::metrics_init("delivery"))?;
    let deliverer = Arc::new(relay_shared::telemetry::cold_start(relay_delivery::from_env().await)?);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    metrics_cloudwatch_embedded::lambda::handler::run(metrics, |event: LambdaEvent<serde_json::Value>| {
        relay_delivery::handle(event, deliverer.clone(), clock.clone())
    })
    .await
}

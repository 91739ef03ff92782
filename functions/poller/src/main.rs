use lambda_runtime::{LambdaEvent, run, service_fn};
use relay_shared::time::SystemClock;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let deps = relay_shared::telemetry::cold_start(relay_poller::Deps::from_env().await)?;
    run(service_fn(|event: LambdaEvent<serde_json::Value>| relay_poller::handle(event, &deps, &SystemClock))).await
}

use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use lambda_runtime::{LambdaEvent, run, service_fn};
use relay_shared::time::{Clock, SystemClock};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let deps = relay_shared::telemetry::cold_start(relay_poller::Deps::from_env().await)?;
    run(service_fn(|event: LambdaEvent<serde_json::Value>| {
        let deps = &deps;
        async move {
            // Turn the invocation's wall-clock deadline into a monotonic one.
            let deadline_ms = event.context.deadline;
            let now_ms = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0);
            let stop_at = Instant::now() + Duration::from_millis(deadline_ms.saturating_sub(now_ms));
            let report = relay_poller::poll_once(deps, SystemClock.now(), stop_at).await;
            Ok::<_, lambda_runtime::Error>(serde_json::to_value(report)?)
        }
    }))
    .await
}

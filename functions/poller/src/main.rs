use std::sync::Arc;

use lambda_runtime::LambdaEvent;
use relay_shared::lambda::{ColdStart, cold_start};
use relay_shared::time::{Clock, SystemClock};

/// mimalloc, not glibc's malloc (as local mode): the SDK, hyper and rustls allocate per request
/// on every thread, and glibc's allocator was a quarter of local mode's CPU under load.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    let ColdStart { metrics, deps } = cold_start("poller", relay_poller::Deps::from_env(), |d| &*d.store.poll).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    metrics_cloudwatch_embedded::lambda::handler::run(metrics, |event: LambdaEvent<serde_json::Value>| {
        relay_poller::handle(event, &deps, clock.clone())
    })
    .await
}

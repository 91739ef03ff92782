use relay_shared::lambda::{ColdStart, cold_start};

/// mimalloc, not glibc's malloc (as local mode): the SDK, hyper and rustls allocate per request
/// on every thread, and glibc's allocator was a quarter of local mode's CPU under load.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    let ColdStart { metrics, deps } = cold_start("callback", relay_callback::Deps::from_env(), |d| &*d.results).await?;
    metrics_cloudwatch_embedded::lambda::handler::run_http(metrics, |req| relay_callback::handle(req, &deps)).await
}

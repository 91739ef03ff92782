use lambda_http::{run, service_fn};

#[tokio::main]
async fn main() -> Result<(), lambda_http::Error> {
    relay_shared::telemetry::init();
    let deps = relay_shared::telemetry::cold_start(relay_callback::Deps::from_env().await)?;
    run(service_fn(|req| relay_callback::handle(req, &deps))).await
}

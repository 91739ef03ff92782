use aws_lambda_events::sqs::SqsEvent;
use lambda_runtime::{LambdaEvent, run, service_fn};

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let deps = relay_shared::telemetry::cold_start(relay_redrive::Deps::from_env().await)?;
    run(service_fn(|event: LambdaEvent<SqsEvent>| relay_redrive::handle(event, &deps))).await
}

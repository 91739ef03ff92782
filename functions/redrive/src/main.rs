use aws_lambda_events::sqs::SqsEvent;
use lambda_runtime::LambdaEvent;

#[tokio::main]
async fn main() -> Result<(), lambda_runtime::Error> {
    relay_shared::telemetry::init();
    let metrics = relay_shared::telemetry::cold_start(relay_shared::telemetry::metrics_init("redrive"))?;
    let deps = relay_shared::telemetry::cold_start(relay_redrive::Deps::from_env().await)?;
    metrics_cloudwatch_embedded::lambda::handler::run(metrics, |event: LambdaEvent<SqsEvent>| {
        relay_redrive::handle(event, &deps)
    })
    .await
}

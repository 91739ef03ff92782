//! The cold-start floor of a function that does the callback's work with nothing around it: a
//! `lambda_runtime` function that reads one secret from SSM at init and answers each event with
//! one conditional UpdateItem (the callback's one write, reduced to its bare form), through the
//! same AWS SDK and HTTP client as the relay's functions (`relay_shared::aws_config`). No
//! logging, no metrics, no parsing: what remains of a cold start once the AWS calls are made.
//!
//! The event is `{"pk": "<key>"}`; it writes `solved` to that item if it is `pending`.

use aws_sdk_dynamodb::types::AttributeValue;
use lambda_runtime::{Error, LambdaEvent, service_fn};

#[tokio::main]
async fn main() -> Result<(), Error> {
    let aws = relay_shared::aws_config().await;
    let param = std::env::var("CALLBACK_SIGNING_SECRET_PARAM")?;
    let secret = aws_sdk_ssm::Client::new(&aws)
        .get_parameter()
        .name(param)
        .with_decryption(true)
        .send()
        .await?
        .parameter
        .and_then(|p| p.value)
        .ok_or("the parameter has no value")?;
    let table = std::env::var("TABLE_NAME")?;
    let db = aws_sdk_dynamodb::Client::new(&aws);
    let (db, table, secret) = (&db, &table, &secret);
    lambda_runtime::run(service_fn(move |e: LambdaEvent<serde_json::Value>| async move {
        let pk = e.payload["pk"].as_str().ok_or("no pk")?.to_owned();
        db.update_item()
            .table_name(table)
            .key("pk", AttributeValue::S(pk))
            .update_expression("SET #state = :solved, solution = :solution")
            .condition_expression("#state = :pending")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":solved", AttributeValue::S("solved".into()))
            .expression_attribute_values(":pending", AttributeValue::S("pending".into()))
            .expression_attribute_values(":solution", AttributeValue::S("x".repeat(600)))
            .send()
            .await?;
        Ok::<_, Error>(serde_json::json!({ "ok": true, "secret_len": secret.len() }))
    }))
    .await
}

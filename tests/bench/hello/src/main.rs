//! The yardstick for cold starts: a `lambda_runtime` function that answers every event with
//! `{"ok":true}` and does nothing else, built with the same profile as the relay's functions.

use lambda_runtime::{Error, LambdaEvent, service_fn};

#[tokio::main]
async fn main() -> Result<(), Error> {
    lambda_runtime::run(service_fn(|_e: LambdaEvent<serde_json::Value>| async {
        Ok::<_, Error>(serde_json::json!({ "ok": true }))
    }))
    .await
}

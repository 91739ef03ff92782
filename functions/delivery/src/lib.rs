//! The delivery function: pushes each result to its owner's callback (see
//! [`relay_shared::delivery`]).
//!
//! Two triggers, one worker:
//! - **the table's stream**: a record whose new image has a due push (`dlv_shard` and `dlv_due`,
//!   the template's filter) is delivered at once — the terminal write itself is what triggers
//!   it. A batch fails only when the store does; Lambda retries it, then sends it to the
//!   failures queue. Nothing is lost either way: the push stays in the `due-for-delivery` index
//!   until an attempt is recorded.
//! - **a schedule, every minute**: sweeps the index for retries that fell due, pushes whose
//!   stream record failed, and claims whose worker died.

use std::sync::Arc;
use std::time::Duration;

use lambda_runtime::LambdaEvent;
use relay_shared::delivery::{Deliverer, DeliverySettings, KeySource, SweepReport};
use relay_shared::domain::TaskRef;
use relay_shared::store::{DueDelivery, TaskStore};
use relay_shared::time::{Clock, Timestamp};
use secrecy::ExposeSecret;

/// Reads the configuration and the webhook secrets (once, at cold start).
pub async fn from_env() -> anyhow::Result<Deliverer> {
    use anyhow::Context;
    use relay_shared::config::{Settings, StoreConfig};
    let env = Settings::from_env();
    let store_cfg = StoreConfig::from_settings(&env)?;
    let settings = DeliverySettings::from_settings(&env)?;
    let source = env.secret("WEBHOOK_SECRETS")?;
    let aws = relay_shared::aws_config().await;
    let secrets =
        relay_shared::secrets::SecretLoader::new(&aws).load(&source).await.context("loading the webhook secrets")?;
    let keys = relay_shared::webhook::SigningKeys::parse_list(secrets.expose_secret())
        .context("WEBHOOK_SECRETS: expected whsec_… or whsec_new,whsec_old")?;
    let store = TaskStore::from_config(&aws, &store_cfg);
    Deliverer::new(store.clone(), KeySource::new(keys, Some(store)), settings)
}

/// The pushes a stream batch makes due: each record's task and the `dlv_due` it carries.
/// Records without them (filtered out by the template, but not by every emulator) are skipped.
pub fn due_in_stream(event: &serde_json::Value) -> Vec<DueDelivery> {
    let Some(records) = event.get("Records").and_then(|r| r.as_array()) else { return Vec::new() };
    records
        .iter()
        .filter_map(|r| {
            let image = r.pointer("/dynamodb/NewImage")?;
            let pk = image.pointer("/pk/S")?.as_str()?;
            image.pointer("/dlv_shard/N")?;
            let due: u64 = image.pointer("/dlv_due/N")?.as_str()?.parse().ok()?;
            Some(DueDelivery { task_ref: TaskRef::parse(pk).ok()?, due_at: Timestamp::from_millis(due) })
        })
        .collect()
}

/// One invocation: a stream batch, or (any other event) the scheduled sweep.
pub async fn handle(
    event: LambdaEvent<serde_json::Value>,
    deliverer: Arc<Deliverer>,
    clock: Arc<dyn Clock>,
) -> Result<SweepReport, lambda_runtime::Error> {
    let now = clock.now();
    let remaining = relay_shared::time_left(event.context.deadline, now);
    let deadline = now.plus(remaining.saturating_sub(Duration::from_secs(2)));
    let report = if event.payload.get("Records").is_some() {
        // A record whose push is not due yet (a retry's own write, a parked push) wakes nothing:
        // the sweep takes it when it falls due.
        let now = clock.now();
        let due = due_in_stream(&event.payload).into_iter().filter(|d| d.due_at <= now).collect();
        deliver_batch(&deliverer, due, clock).await?
    } else {
        deliverer.sweep(clock, deadline).await
    };
    report.emit();
    tracing::info!(event = "delivery_invocation", ?report);
    Ok(report)
}

/// Delivers a stream batch's pushes concurrently. A store failure fails the batch (Lambda
/// retries it); an owner's endpoint failing does not (its retry is scheduled in the item).
pub async fn deliver_batch(
    deliverer: &Arc<Deliverer>,
    due: Vec<DueDelivery>,
    clock: Arc<dyn Clock>,
) -> Result<SweepReport, lambda_runtime::Error> {
    let mut report = SweepReport::default();
    let failed = deliverer.deliver_all(due, &clock, &mut report).await;
    match failed {
        Some(e) => {
            report.emit();
            Err(format!("{} push(es) could not be recorded: {e}", report.errors).into())
        }
        None => Ok(report),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stream_batch_yields_the_due_pushes_and_skips_the_rest() {
        let event = serde_json::json!({ "Records": [
            { "eventSource": "aws:dynamodb", "eventName": "MODIFY", "dynamodb": { "NewImage": {
                "pk": { "S": "tsk_00000000000000000000000000000001" }, "dlv_shard": { "N": "1" }, "dlv_due": { "N": "1700000000000" } } } },
            { "eventSource": "aws:dynamodb", "eventName": "MODIFY", "dynamodb": { "NewImage": {
                "pk": { "S": "tsk_00000000000000000000000000000002" }, "dlv_due": { "N": "1700000000000" } } } },
            { "eventSource": "aws:dynamodb", "eventName": "REMOVE", "dynamodb": {} },
            { "eventSource": "aws:dynamodb", "eventName": "MODIFY", "dynamodb": { "NewImage": {
                "pk": { "S": "not a ref" }, "dlv_shard": { "N": "1" }, "dlv_due": { "N": "1" } } } }
        ]});
        let due = due_in_stream(&event);
        assert_eq!(due.len(), 1, "{due:?}");
        assert_eq!(due[0].task_ref.as_ref(), "tsk_00000000000000000000000000000001");
        assert_eq!(due[0].due_at, Timestamp::from_millis(1_700_000_000_000));
        assert!(due_in_stream(&serde_json::json!({ "source": "aws.scheduler" })).is_empty());
    }
}

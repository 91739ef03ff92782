//! The delivery function: pushes each result to its owner's callback (see
//! [`relay_shared::delivery`]).
//!
//! Three triggers, one worker:
//! - **the table's stream**: a record whose new image has a due push (`dlv_shard` and `dlv_due`,
//!   the template's filter) is delivered at once — the terminal write itself is what triggers
//!   it. A batch fails only when the store does; Lambda retries it, then sends it to the
//!   failures queue. Nothing is lost either way: the push stays in the `due-for-delivery` index
//!   until an attempt is recorded.
//! - **the retry queue** (`DELIVERY_RETRY_QUEUE_URL`): a push the worker put off — a retry on
//!   a token's fast schedule (1 s, 2 s, 4 s …), a push whose host had no turn for it — comes
//!   back as a message delayed until it falls due (up to SQS's 15 minutes), so a retry while a
//!   token lives is on time instead of waiting for the next sweep.
//! - **a schedule, every minute**: sweeps the index for retries further out, pushes whose
//!   stream record or retry message failed, and claims whose worker died; it works through its
//!   minute while pushes fall due in it.

use std::sync::Arc;
use std::time::Duration;

use aws_lambda_events::dynamodb::Event as StreamEvent;
use aws_lambda_events::sqs::SqsEvent;
use lambda_runtime::LambdaEvent;
use relay_shared::deadletter::SqsQueue;
use relay_shared::delivery::{Deliverer, DeliverySettings, KeySource, SweepReport, Wakeups};
use relay_shared::domain::TaskRef;
use relay_shared::store::{DueDelivery, TaskStore};
use relay_shared::time::{Clock, Timestamp};
use secrecy::ExposeSecret;
use serde_dynamo::AttributeValue;

/// SQS delays a message by at most this long; a push due later is left to the sweep.
pub const MAX_DELAY: Duration = Duration::from_secs(900);

/// The retry queue: a push due later is a message delayed until then.
pub struct RetryQueue(pub SqsQueue);

#[async_trait::async_trait]
impl Wakeups for RetryQueue {
    async fn due_at(&self, due: DueDelivery, now: Timestamp) {
        let wait = due.due_at.since(now);
        if wait > MAX_DELAY {
            return;
        }
        // Whole seconds, rounded up: the message never arrives before the push is due.
        let secs = u32::try_from(wait.as_millis().div_ceil(1000)).unwrap_or(900);
        let body = retry_body(&due);
        if let Err(e) = self.0.send_delayed(&body, secs).await {
            // The sweep takes it when it falls due.
            tracing::warn!(event = "retry_message_failed", task_ref = %due.task_ref, error = %e);
        }
    }
}

/// The body of a retry message.
pub fn retry_body(due: &DueDelivery) -> String {
    serde_json::json!({ "task_ref": due.task_ref.as_ref(), "due_at_ms": due.due_at.as_millis() }).to_string()
}

/// Reads the configuration and the webhook secrets (once, at cold start).
pub async fn from_env() -> anyhow::Result<Deliverer> {
    use anyhow::Context;
    use relay_shared::config::{Settings, StoreConfig};
    let env = Settings::from_env();
    let store_cfg = StoreConfig::from_settings(&env)?;
    let settings = DeliverySettings::from_settings(&env)?;
    let source = env.secret("WEBHOOK_SECRETS")?;
    let retry_queue = env.optional("DELIVERY_RETRY_QUEUE_URL").filter(|u| !u.trim().is_empty());
    let aws = relay_shared::aws_config().await;
    let secrets =
        relay_shared::secrets::SecretLoader::new(&aws).load(&source).await.context("loading the webhook secrets")?;
    let keys = relay_shared::webhook::SigningKeys::parse_list(secrets.expose_secret())
        .context("WEBHOOK_SECRETS: expected whsec_… or whsec_new,whsec_old")?;
    let store = TaskStore::from_config(&aws, &store_cfg);
    let mut deliverer = Deliverer::new(store.clone(), KeySource::new(keys, Some(store)), settings)?;
    if let Some(url) = retry_queue {
        deliverer = deliverer.with_wakeups(Arc::new(RetryQueue(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), url))));
    }
    Ok(deliverer)
}

/// What woke the function, read as its typed event.
#[derive(Debug)]
pub enum Trigger {
    /// A batch of the table's stream.
    Stream(StreamEvent),
    /// A batch of the retry queue.
    Retries(SqsEvent),
    /// Any other event: the schedule's (a sweep).
    Sweep,
}

impl Trigger {
    /// Records from `aws:sqs` are the retry queue's, other records the stream's; anything else
    /// is the schedule. An error: records that are not the event they claim to be.
    pub fn of(payload: serde_json::Value) -> Result<Self, serde_json::Error> {
        if is_sqs(&payload) {
            serde_json::from_value(payload).map(Self::Retries)
        } else if payload.get("Records").is_some() {
            serde_json::from_value(payload).map(Self::Stream)
        } else {
            Ok(Self::Sweep)
        }
    }
}

/// The pushes a stream batch makes due: each record's task and the `dlv_due` it carries.
/// Records without them (filtered out by the template, but not by every emulator) are skipped.
pub fn due_in_stream(batch: &StreamEvent) -> Vec<DueDelivery> {
    batch
        .records
        .iter()
        .filter_map(|r| {
            let image = &r.change.new_image;
            let AttributeValue::S(pk) = image.get("pk")? else { return None };
            let AttributeValue::N(_) = image.get("dlv_shard")? else { return None };
            let AttributeValue::N(due) = image.get("dlv_due")? else { return None };
            let due: u64 = due.parse().ok()?;
            Some(DueDelivery { task_ref: TaskRef::parse(pk).ok()?, due_at: Timestamp::from_millis(due) })
        })
        .collect()
}

/// The pushes a retry-queue batch brings back. Unreadable bodies are skipped (the sweep is the
/// net).
pub fn due_in_retry_messages(batch: &SqsEvent) -> Vec<DueDelivery> {
    batch
        .records
        .iter()
        .filter_map(|m| {
            let body: serde_json::Value = serde_json::from_str(m.body.as_deref()?).ok()?;
            let task_ref = TaskRef::parse(body.get("task_ref")?.as_str()?).ok()?;
            Some(DueDelivery { task_ref, due_at: Timestamp::from_millis(body.get("due_at_ms")?.as_u64()?) })
        })
        .collect()
}

fn is_sqs(event: &serde_json::Value) -> bool {
    event.pointer("/Records/0/eventSource").and_then(|s| s.as_str()) == Some("aws:sqs")
}

/// One invocation: a stream batch, a retry-queue batch, or (any other event) the sweep.
pub async fn handle(
    event: LambdaEvent<serde_json::Value>,
    deliverer: Arc<Deliverer>,
    clock: Arc<dyn Clock>,
) -> Result<SweepReport, lambda_runtime::Error> {
    let now = clock.now();
    let remaining = relay_shared::time_left(event.context.deadline, now);
    let deadline = now.plus(remaining.saturating_sub(relay_shared::delivery::SWEEP_END_MARGIN));
    let report = match Trigger::of(event.payload) {
        Ok(Trigger::Retries(batch)) => {
            // A retry message: its push was due when it became visible. A store failure leaves
            // the push due in the index, where the sweep finds it; the message is not retried.
            let due = due_in_retry_messages(&batch);
            let mut report = SweepReport::default();
            let (failed, _) = deliverer.deliver_all(due, &clock, &mut report, clock.busy()).await;
            if let Some(e) = failed {
                tracing::warn!(event = "retry_batch_store_failure", error = %e);
            }
            report
        }
        Ok(Trigger::Stream(batch)) => {
            // A record whose push is not due yet (a retry's own write, a parked push) wakes
            // nothing: its retry message or the sweep takes it when it falls due.
            let now = clock.now();
            let due = due_in_stream(&batch).into_iter().filter(|d| d.due_at <= now).collect();
            deliver_batch(&deliverer, due, clock).await?
        }
        Ok(Trigger::Sweep) => deliverer.sweep(clock, deadline).await,
        Err(e) => {
            // Its pushes, if any, stay due in the index: the sweep takes them.
            tracing::error!(event = "delivery_event_unreadable", error = %e);
            SweepReport::default()
        }
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
    let (failed, _) = deliverer.deliver_all(due, &clock, &mut report, clock.busy()).await;
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

    /// Real events, as Lambda hands them over: a stream batch (the template's view, `NEW_IMAGE`),
    /// a retry-queue batch, and the schedule's event.
    const STREAM_BATCH: &str = include_str!("../tests/fixtures/stream-batch.json");
    const RETRY_BATCH: &str = include_str!("../tests/fixtures/retry-batch.json");
    const SCHEDULE: &str = include_str!("../tests/fixtures/scheduler-event.json");

    fn fixture(text: &str) -> serde_json::Value {
        serde_json::from_str(text).expect("a fixture is JSON")
    }

    #[test]
    fn a_stream_batch_yields_the_due_pushes_and_skips_the_rest() {
        let event = fixture(STREAM_BATCH);
        let Ok(Trigger::Stream(batch)) = Trigger::of(event.clone()) else { panic!("not read as a stream batch") };
        let due = due_in_stream(&batch);
        assert_eq!(due.len(), 1, "{due:?}");
        assert_eq!(due[0].task_ref.as_ref(), "tsk_00000000000000000000000000000001");
        assert_eq!(due[0].due_at, Timestamp::from_millis(1_700_000_000_000));
        assert!(matches!(Trigger::of(fixture(SCHEDULE)), Ok(Trigger::Sweep)), "the schedule's event is a sweep");
        assert!(!is_sqs(&event));
    }

    #[test]
    fn a_retry_message_round_trips_and_bad_bodies_are_skipped() {
        let due = DueDelivery {
            task_ref: TaskRef::parse("tsk_00000000000000000000000000000007").expect("ref"),
            due_at: Timestamp::from_millis(1_700_000_001_234),
        };
        let event = fixture(RETRY_BATCH);
        assert!(is_sqs(&event));
        let Ok(Trigger::Retries(mut batch)) = Trigger::of(event) else { panic!("not read as a retry batch") };
        assert_eq!(due_in_retry_messages(&batch), vec![due.clone()]);
        batch.records[0].body = Some(retry_body(&due));
        assert_eq!(due_in_retry_messages(&batch), vec![due]);
    }
}

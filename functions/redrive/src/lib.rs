//! The redrive function: drains the dead-letter queue, re-applying each kept result through
//! the same idempotent conditional write. A batch never fails as a whole: only the messages
//! that may succeed later are reported back (`ReportBatchItemFailures`); SQS moves a message
//! that keeps failing to the poison queue after `maxReceiveCount` receives. A message that can
//! never succeed (unparseable, unknown task) goes to the poison queue at once.

use std::sync::Arc;

use aws_lambda_events::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent};
use lambda_runtime::LambdaEvent;
use relay_shared::deadletter::{DeadLetter, Letter, SqsQueue};
use relay_shared::domain::Via;
use relay_shared::store::{RecordOutcome, SubmitRecorded, TaskStore};
use tokio::sync::Semaphore;
use tracing::Instrument;

/// What the handler needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: TaskStore,
    /// Where permanently failing messages go.
    pub poison: SqsQueue,
    /// Messages worked on at once.
    pub concurrency: usize,
}

impl Deps {
    pub async fn from_env() -> anyhow::Result<Self> {
        use relay_shared::config::{Settings, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        Ok(Self {
            store: TaskStore::from_config(&aws, &store_cfg),
            poison: SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("POISON_QUEUE_URL")?),
            concurrency: env.parse_or("REDRIVE_CONCURRENCY", 8)?,
        })
    }
}

/// What became of one dead letter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Redriven {
    /// Written now.
    Applied,
    /// The task already had this (or another) result: nothing to do, not an error.
    AlreadyRecorded,
    /// Can never succeed; belongs on the poison queue.
    Permanent(String),
    /// May succeed later (the store is still failing).
    Retry(String),
}

/// Applies one dead letter's body. Shared by the Lambda and local mode.
pub async fn redrive_one(store: &TaskStore, body: &str) -> Redriven {
    let letter = match DeadLetter::parse(body) {
        Ok(l) => l,
        Err(e) => return Redriven::Permanent(e.0),
    };
    let (task_ref, delivery) = match letter.letter(Via::Redrive) {
        Ok(Letter::Result { task_ref, delivery }) => (task_ref, delivery),
        Ok(Letter::Submitted { task_ref, captcha_id, accepted_at, poll_due_at }) => {
            // In.php's id for a task, kept because storing it failed: store it now.
            return match store.mark_submitted(&task_ref, &captcha_id, accepted_at, poll_due_at).await {
                Ok(SubmitRecorded::Pending(_)) => Redriven::Applied,
                Ok(SubmitRecorded::AlreadyResolved(_)) => Redriven::AlreadyRecorded,
                Err(e) if e.is_retryable() => Redriven::Retry(e.to_string()),
                Err(e) => Redriven::Permanent(e.to_string()),
            };
        }
        Err(e) => return Redriven::Permanent(e.0),
    };
    match store.record_result(&task_ref, &delivery).await {
        Ok(RecordOutcome::Recorded(_)) => Redriven::Applied,
        Ok(RecordOutcome::Replaced(_)) => {
            // The common case of a replacement: the pingback failed to store, a conflicting
            // result was stored after it, and this letter brings the first-received one back.
            tracing::warn!(event = "result_replaced", task_ref = %task_ref, via = "redrive");
            metrics::counter!("results_replaced", "via" => "redrive").increment(1);
            Redriven::Applied
        }
        Ok(RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_)) => Redriven::AlreadyRecorded,
        Ok(RecordOutcome::Late(_)) => {
            metrics::counter!("late_results_kept", "via" => "redrive").increment(1);
            Redriven::Applied
        }
        Ok(RecordOutcome::NotFound) => Redriven::Permanent(format!("task {task_ref} does not exist (any more)")),
        Ok(RecordOutcome::IdMismatch { expected }) => {
            Redriven::Permanent(format!("letter is for CaptchaAI id {}, the task has {expected}", letter.captcha_id))
        }
        Err(e) => Redriven::Retry(e.to_string()),
    }
}

/// Counts of one batch, logged as one line.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct BatchReport {
    pub applied: u64,
    pub already_recorded: u64,
    pub poisoned: u64,
    pub retried: u64,
}

/// The Lambda entry point for an SQS batch.
pub async fn handle(event: LambdaEvent<SqsEvent>, deps: &Deps) -> Result<SqsBatchResponse, lambda_runtime::Error> {
    let (resp, _) = process(event.payload, deps).await;
    Ok(resp)
}

/// Processes a batch with bounded concurrency; returns the failures to report and the counts.
pub async fn process(event: SqsEvent, deps: &Deps) -> (SqsBatchResponse, BatchReport) {
    let sem = Arc::new(Semaphore::new(deps.concurrency.max(1)));
    let mut set = tokio::task::JoinSet::new();
    let mut ids = std::collections::HashMap::new();
    for msg in event.records {
        let (deps, sem) = (deps.clone(), sem.clone());
        let id = msg.message_id.clone().unwrap_or_default();
        let message_id = id.clone();
        let span = tracing::info_span!("dead_letter", message_id = %id);
        let handle = set.spawn(
            async move {
                let _permit = sem.acquire_owned().await;
                let body = msg.body.unwrap_or_default();
                let outcome = redrive_one(&deps.store, &body).await;
                let outcome = match outcome {
                    Redriven::Permanent(reason) => match deps.poison.send_body(&body).await {
                        Ok(_) => {
                            tracing::error!(
                                event = "dead_letter_poisoned",
                                reason,
                                "permanent failure; moved to the poison queue"
                            );
                            Redriven::Permanent(reason)
                        }
                        Err(e) => Redriven::Retry(format!("{reason}; and the poison queue failed: {e}")),
                    },
                    other => other,
                };
                match &outcome {
                    Redriven::Applied => tracing::info!(event = "dead_letter_applied"),
                    Redriven::AlreadyRecorded => tracing::info!(event = "dead_letter_already_recorded"),
                    Redriven::Retry(e) => tracing::warn!(event = "dead_letter_retry", error = %e),
                    Redriven::Permanent(_) => {}
                }
                (id, outcome)
            }
            .instrument(span),
        );
        ids.insert(handle.id(), message_id);
    }
    let mut report = BatchReport::default();
    let mut resp = SqsBatchResponse::default();
    while let Some(done) = set.join_next_with_id().await {
        let (id, outcome) = match done {
            Ok((_, pair)) => pair,
            // Never let a message be deleted that was not handled: report it for a retry.
            Err(e) => {
                tracing::error!(event = "dead_letter_panicked", error = %e);
                (ids.remove(&e.id()).unwrap_or_default(), Redriven::Retry("handler panicked".into()))
            }
        };
        match outcome {
            Redriven::Applied => report.applied += 1,
            Redriven::AlreadyRecorded => report.already_recorded += 1,
            Redriven::Permanent(_) => report.poisoned += 1,
            Redriven::Retry(_) => {
                report.retried += 1;
                let mut f = BatchItemFailure::default();
                f.item_identifier = id;
                resp.batch_item_failures.push(f);
            }
        }
    }
    for (outcome, n) in [
        ("applied", report.applied),
        ("already_recorded", report.already_recorded),
        ("poisoned", report.poisoned),
        ("retried", report.retried),
    ] {
        metrics::counter!("redriven", "outcome" => outcome).increment(n);
    }
    tracing::info!(
        event = "redrive_batch",
        applied = report.applied,
        already_recorded = report.already_recorded,
        poisoned = report.poisoned,
        retried = report.retried,
        "redrive batch done"
    );
    (resp, report)
}

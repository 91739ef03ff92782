//! The redrive function: drains the dead-letter queue, re-applying each kept result through
//! the same idempotent conditional write. A batch never fails as a whole: only the messages
//! that may succeed later are reported back (`ReportBatchItemFailures`); SQS moves a message
//! that keeps failing to the poison queue after `maxReceiveCount` receives. A message that can
//! never succeed (unparseable, unknown task) goes to the poison queue at once.
//!
//! A message reported back is not left to the queue's visibility timeout (185 s deployed,
//! longer than a reCAPTCHA token lives): while its token may be alive it is shown again after
//! 2, 4, 8, 16, 30 … s ([`relay_shared::deadletter::retry_delay`]), with `ChangeMessageVisibility`.

use std::sync::Arc;

use aws_lambda_events::sqs::{BatchItemFailure, SqsBatchResponse, SqsEvent};
use lambda_runtime::LambdaEvent;
use relay_shared::deadletter::{DeadLetter, Letter, SqsQueue};
use relay_shared::domain::Via;
use relay_shared::store::{RecordOutcome, Results, SubmitRecorded, TaskStore, Tasks};
use tokio::sync::Semaphore;
use tracing::Instrument;

/// What the handler needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    /// In.php's id a letter brings back (UpdateItem).
    pub tasks: Tasks,
    /// The result a letter brings back (UpdateItem).
    pub results: Results,
    /// Where permanently failing messages go.
    pub poison: SqsQueue,
    /// Messages worked on at once.
    pub concurrency: usize,
    /// How a message that may succeed later is paced; `None`: at the queue's own visibility.
    pub pacing: Option<RetryPacing>,
}

/// Token-paced retries of the dead-letter queue (see the module docs).
#[derive(Debug, Clone)]
pub struct RetryPacing {
    /// The dead-letter queue itself (`DEAD_LETTER_QUEUE_URL`).
    pub queue: SqsQueue,
    /// Its redrive policy's `maxReceiveCount` (`MAX_RECEIVE_COUNT`).
    pub max_receives: u32,
    /// Its visibility timeout (`DEAD_LETTER_VISIBILITY_SECONDS`): the pace after the fast retries.
    pub slow: std::time::Duration,
}

impl Deps {
    pub async fn from_env() -> anyhow::Result<Self> {
        use relay_shared::config::{Settings, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let store = TaskStore::from_config(&aws, &store_cfg);
        Ok(Self {
            tasks: store.tasks(),
            results: store.results(),
            poison: SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("POISON_QUEUE_URL")?),
            concurrency: env.parse_or("REDRIVE_CONCURRENCY", 8)?,
            pacing: match env.optional("DEAD_LETTER_QUEUE_URL") {
                Some(url) if !url.is_empty() => Some(RetryPacing {
                    queue: SqsQueue::new(aws_sdk_sqs::Client::new(&aws), url),
                    max_receives: env.parse_or("MAX_RECEIVE_COUNT", 12)?,
                    slow: std::time::Duration::from_secs(env.parse_or("DEAD_LETTER_VISIBILITY_SECONDS", 185)?),
                }),
                _ => None,
            },
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
pub async fn redrive_one(tasks: &Tasks, results: &Results, body: &str) -> Redriven {
    let letter = match DeadLetter::parse(body) {
        Ok(l) => l,
        Err(e) => return Redriven::Permanent(e.0),
    };
    let (task_ref, delivery) = match letter.letter(Via::Redrive) {
        Ok(Letter::Result { task_ref, delivery }) => (task_ref, delivery),
        Ok(Letter::Submitted { task_ref, captcha_id, accepted_at, poll_due_at }) => {
            // In.php's id for a task, kept because storing it failed: store it now.
            return match tasks.mark_submitted(&task_ref, &captcha_id, accepted_at, poll_due_at).await {
                Ok(SubmitRecorded::Pending(_)) => Redriven::Applied,
                Ok(SubmitRecorded::AlreadyResolved(_)) => Redriven::AlreadyRecorded,
                Err(e) if e.is_retryable() => Redriven::Retry(e.to_string()),
                Err(e) => Redriven::Permanent(e.to_string()),
            };
        }
        Err(e) => return Redriven::Permanent(e.0),
    };
    match results.record_result(&task_ref, &delivery).await {
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

/// Shows a message reported back for a retry again when [`retry_delay`] says (only when that
/// is sooner than the queue's own visibility). Returns the delay; a failed change leaves the
/// queue's.
///
/// [`retry_delay`]: relay_shared::deadletter::retry_delay
async fn pace_retry(deps: &Deps, body: &str, receipt: &str, receives: u32) -> std::time::Duration {
    let Some(p) = &deps.pacing else { return std::time::Duration::ZERO };
    let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
    let delay = DeadLetter::retry_delay_of(body, receives, p.max_receives, now, p.slow);
    if delay >= p.slow || receipt.is_empty() {
        return p.slow;
    }
    match p.queue.change_visibility(receipt, u32::try_from(delay.as_secs()).unwrap_or(u32::MAX)).await {
        Ok(()) => delay,
        Err(e) => {
            tracing::warn!(event = "dead_letter_pacing_failed", error = %e);
            p.slow
        }
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
                let receives = msg.attributes.get("ApproximateReceiveCount").and_then(|v| v.parse().ok()).unwrap_or(1);
                let receipt = msg.receipt_handle.unwrap_or_default();
                let body = msg.body.unwrap_or_default();
                let outcome = redrive_one(&deps.tasks, &deps.results, &body).await;
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
                    Redriven::Retry(e) => {
                        let again = pace_retry(&deps, &body, &receipt, receives).await;
                        tracing::warn!(event = "dead_letter_retry", error = %e, receives, again_in_secs = again.as_secs());
                    }
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

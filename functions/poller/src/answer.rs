//! One read (a single id or a batch) and what its answer does to each task: recorded,
//! rescheduled, expired, or given back unread.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use relay_shared::captchaai::{CaptchaAiError, ResAnswer};
use relay_shared::codes::{CodeClass, ban, retry_after_secs};
use relay_shared::deadletter::DeadLetter;
use relay_shared::domain::{CaptchaId, IncomingResult, Outcome, Via};
use relay_shared::store::{DueTask, RecordOutcome, Reschedule, Stop};
use relay_shared::time::{Clock, Timestamp};

use crate::Deps;
use crate::breaker::{Shared, note_answer, open_breaker};
use crate::report::PollOutcome;
use crate::schedule::next_read_at;

/// Gives back a claim whose read was not made: the read it counted is taken back, and the task
/// is due again at once (or when the breaker closes).
pub(crate) async fn release(deps: &Deps, due: &DueTask, now: Timestamp) -> PollOutcome {
    let r = Reschedule { unread: true, ..Reschedule::at(now) };
    match deps.store.poll.reschedule(&due.task.task_ref, &deps.owner, r).await {
        Ok(_) => PollOutcome::Released,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
            PollOutcome::Error
        }
    }
}

pub(crate) async fn read_one(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    due: DueTask,
    id: CaptchaId,
    last: bool,
) -> PollOutcome {
    // The breaker may have opened while this read waited for a permit: then it is not made.
    if shared.open_at(clock.now()).is_some() {
        let r = Reschedule { unread: true, ..Reschedule::at(clock.now()) };
        return match deps.store.poll.reschedule(&due.task.task_ref, &deps.owner, r).await {
            Ok(_) => PollOutcome::Released,
            Err(_) => PollOutcome::Error,
        };
    }
    let answer = deps.captchaai.get_result(&id).await;
    note_answer(deps, clock, shared, answer.as_ref().err()).await;
    apply_answer(deps, clock, shared, due, answer, last).await
}

pub(crate) async fn read_batch(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    chunk: Vec<(DueTask, CaptchaId, bool)>,
) -> Vec<PollOutcome> {
    let ids: Vec<CaptchaId> = chunk.iter().map(|(_, id, _)| id.clone()).collect();
    let mut out = Vec::with_capacity(chunk.len());
    let answers = deps.captchaai.get_results(&ids).await;
    note_answer(deps, clock, shared, answers.as_ref().err().filter(|e| !e.batch_unsupported())).await;
    match answers {
        Ok(answers) => {
            for ((due, _, last), answer) in chunk.into_iter().zip(answers) {
                out.push(apply_answer(deps, clock, shared, due, Ok(answer), last).await);
            }
        }
        Err(e) if e.batch_unsupported() => {
            // The server does not take `ids=`: read these one by one from the next pass on.
            tracing::warn!(event = "batch_unsupported", error = %e, "res.php does not take batch reads; reading singly");
            shared.batch_unsupported.store(true, Ordering::SeqCst);
            // Remembered for every invocation from now on, not learnt again at a batch's cost.
            if let Err(e) = deps.store.account.mark_batch_unsupported(clock.now()).await {
                tracing::error!(event = "poll_store_failed", error = %e);
            }
            for (due, _, _) in &chunk {
                out.push(release(deps, due, clock.now()).await);
            }
        }
        Err(e) => {
            // A ban, a timeout, a 5xx: the same for every task of the batch, applied to each (the
            // first opens the breaker, the rest are rescheduled after it).
            for (due, _, last) in chunk {
                out.push(apply_answer(deps, clock, shared, due, Err(e.clone()), last).await);
            }
        }
    }
    out
}

/// Records or reschedules a task after its read. The read was counted at the claim.
async fn apply_answer(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    due: DueTask,
    answer: Result<ResAnswer, CaptchaAiError>,
    last: bool,
) -> PollOutcome {
    let s = &deps.settings;
    let now = clock.now();
    let reads = due.reads + 1;
    let deadline = due.task.submitted_or_created_at().plus(s.task_deadline);
    let next_read = Reschedule::at(next_read_at(reads, now, deadline, s));
    let r = &due.task.task_ref;
    match answer {
        Ok(ResAnswer::Ready(solution)) => record(deps, now, &due, Outcome::Solved(solution)).await,
        Ok(ResAnswer::NotReady) if last => {
            let reason = format!("no result within {} s of submit (last read: not ready)", s.task_deadline.as_secs());
            match deps.store.poll.expire(r, &reason, now, &deps.owner).await {
                Ok(true) => {
                    tracing::info!(event = "task_expired", task_ref = %r, reason, last_read = true);
                    PollOutcome::Expired
                }
                Ok(false) => PollOutcome::AlreadyResolved,
                Err(e) => {
                    tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
                    PollOutcome::Error
                }
            }
        }
        Ok(ResAnswer::NotReady) => {
            let next = Reschedule { not_ready_at: Some(now), ..next_read };
            reschedule(deps, &due, next, PollOutcome::NotReady).await
        }
        Ok(ResAnswer::Code(code)) => {
            if let Some(b) = ban(code.as_ref()) {
                // The breaker holds every read back until it closes (or an operator closes it
                // early); the task keeps its own schedule.
                let stop = Stop::Ban { needs_operator: b.needs_operator };
                open_breaker(deps, shared, now.plus(b.duration), code.as_ref(), stop, now).await;
                return reschedule(deps, &due, next_read, PollOutcome::Transient).await;
            }
            match code.class() {
                CodeClass::TerminalForTask => record(deps, now, &due, Outcome::Failed(code)).await,
                CodeClass::Unknown | CodeClass::Permanent if due.unknown_codes + 1 >= s.max_unknown_codes => {
                    tracing::warn!(event = "unknown_code_terminal", task_ref = %r, %code);
                    record(deps, now, &due, Outcome::Failed(code)).await
                }
                CodeClass::Unknown | CodeClass::Permanent => {
                    tracing::warn!(event = "unknown_code", task_ref = %r, %code);
                    let next = Reschedule { unknown_code: true, ..next_read };
                    reschedule(deps, &due, next, PollOutcome::Transient).await
                }
                CodeClass::Transient | CodeClass::NotReady => {
                    let wait = Duration::from_secs(retry_after_secs(code.as_ref()));
                    let next = Reschedule::at(next_read.next_due.max(now.plus(wait)));
                    reschedule(deps, &due, next, PollOutcome::Transient).await
                }
            }
        }
        Err(e) => {
            // No answer (counted by the caller, per request): read again on schedule.
            tracing::warn!(event = "res_php_failed", task_ref = %r, error = %e);
            reschedule(deps, &due, next_read, PollOutcome::Transient).await
        }
    }
}

async fn reschedule(deps: &Deps, due: &DueTask, r: Reschedule, applied: PollOutcome) -> PollOutcome {
    match deps.store.poll.reschedule(&due.task.task_ref, &deps.owner, r).await {
        Ok(_) => applied,
        Err(e) => {
            // The lease lapses and the next pass reads it again: nothing is lost.
            tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
            PollOutcome::Error
        }
    }
}

async fn record(deps: &Deps, now: Timestamp, due: &DueTask, outcome: Outcome) -> PollOutcome {
    let Some(captcha_id) = due.task.captcha_id.clone() else { return PollOutcome::Error };
    let solved = matches!(outcome, Outcome::Solved(_));
    // res.php cannot say when the solve happened; the token is no older than the last
    // "not ready" (or the submit), so its clock starts there.
    let d = IncomingResult {
        captcha_id,
        outcome,
        received_at: now,
        via: Via::Poll,
        token_clock_start: due.last_not_ready_at.unwrap_or_else(|| due.task.submitted_or_created_at()),
    };
    let r = &due.task.task_ref;
    match deps.store.results.record_result(r, &d).await {
        Ok(RecordOutcome::Recorded(_)) => {
            tracing::info!(event = "poll_recovered", task_ref = %r, solved);
            if solved { PollOutcome::Recovered } else { PollOutcome::Failed }
        }
        Ok(RecordOutcome::Replaced(_)) => {
            tracing::warn!(event = "result_replaced", task_ref = %r, via = "poll");
            metrics::counter!("results_replaced", "via" => "poll").increment(1);
            if solved { PollOutcome::Recovered } else { PollOutcome::Failed }
        }
        Ok(RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_)) => PollOutcome::AlreadyResolved,
        Ok(RecordOutcome::Late(_)) => {
            tracing::warn!(event = "late_result_kept", task_ref = %r, via = "poll");
            PollOutcome::LateKept
        }
        Ok(other) => {
            tracing::error!(event = "poll_record_refused", task_ref = %r, outcome = ?other);
            PollOutcome::Error
        }
        Err(e) => {
            // Same path as the callback: keep the result as a dead letter. Should that fail too,
            // the lease lapses and a later pass reads it again: nothing is lost either way.
            match deps.dead_letters.send(&DeadLetter::new(r, &d, &e.to_string(), 1)).await {
                Ok(()) => {
                    tracing::warn!(event = "poll_dead_lettered", task_ref = %r, error = %e);
                    PollOutcome::DeadLettered
                }
                Err(q) => {
                    tracing::error!(event = "poll_not_stored", task_ref = %r, store_error = %e, queue_error = %q);
                    PollOutcome::Error
                }
            }
        }
    }
}

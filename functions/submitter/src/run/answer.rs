//! What in.php answered to one release, recorded: accepted, unknown (never sent again), back to
//! the queue (no slot, a ban, refused for now), or failed (refused for good, or for now too
//! often).

use relay_shared::captchaai::CaptchaAiError;
use relay_shared::codes::Ban;
use relay_shared::store::{Released, Stop};
use relay_shared::submit::{InPhp, MAX_REFUSALS_FOR_NOW, Recorder, Upstream};
use relay_shared::time::Timestamp;

use super::state::{Run, Sent};
use crate::report::RunReport;

/// Whether a "no slot" answer's `code` calls for a look at the plan: CaptchaAI's
/// `ERROR_ZERO_BALANCE` also means a plan run out (another service's means what it says).
pub(super) fn asks_about_the_plan(code: &str, upstream: Upstream) -> bool {
    code == "ERROR_ZERO_BALANCE" && upstream == Upstream::CaptchaAi
}

/// What becomes of a task in.php refused for now, `refusals` times in all.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ForNow {
    /// Back to the queue, tried again later.
    Requeue,
    /// Refused too often: failed with the last refusal (a method CaptchaAI never takes).
    Fail,
}

/// See [`ForNow`].
pub(super) fn for_now(refusals: u32) -> ForNow {
    if refusals < MAX_REFUSALS_FOR_NOW { ForNow::Requeue } else { ForNow::Fail }
}

/// The `reason` a ban's breaker is counted under.
pub(super) fn breaker_reason(ban: &Ban) -> &'static str {
    if ban.needs_operator { "key_rejected" } else { "ban" }
}

impl Run<'_> {
    /// Records what in.php answered to one release.
    pub(super) async fn answered(&mut self, done: Result<Sent, tokio::task::JoinError>, report: &mut RunReport) {
        let Sent { released, in_flight, answer } = match done {
            Ok(sent) => sent,
            Err(e) => {
                // A panicking call: its task stays submitting without an outcome; the poller
                // expires it at its deadline (it may have been sent: never sent again).
                report.errors += 1;
                tracing::error!(event = "submit_call_panicked", error = %e);
                return;
            }
        };
        let now = self.clock.now();
        let task = &released.task;
        let recorder = Recorder {
            tasks: &self.deps.store.tasks,
            dead_letters: self.deps.dead_letters.as_ref(),
            clock: self.clock.as_ref(),
        };
        match InPhp::of(answer) {
            InPhp::Accepted(id) => {
                report.accepted += 1;
                self.plan_out_seen = 0;
                self.window.accepted(in_flight, now);
                recorder.accepted(task, &id, self.deps.grace.for_kind(task.kind)).await;
            }
            InPhp::Unknown(err) => {
                report.unknown += 1;
                recorder.unknown(task, &err).await;
            }
            InPhp::NoSlot(code) => self.no_slot(released, &code, in_flight, now, report).await,
            InPhp::Banned(code, ban) => self.banned(released, &code, &ban, now, report).await,
            InPhp::Transient(err) => self.refused_for_now(released, &err, now, report).await,
            InPhp::Refused(err) => {
                let detail = format!("in.php refused the task: {err}");
                if self.fail_refused(&released, &err, &detail, now, report).await {
                    tracing::warn!(event = "submit_refused", task_ref = %released.task.task_ref, error = %err, "in.php refused a queued task for good");
                }
            }
        }
    }

    /// No free thread: the window learns it, and the task goes back to the queue.
    async fn no_slot(
        &mut self,
        released: Released,
        code: &str,
        in_flight: u32,
        now: Timestamp,
        report: &mut RunReport,
    ) {
        report.no_slot += 1;
        metrics::counter!("submit_no_slot", "path" => "release").increment(1);
        tracing::info!(event = "submit_no_slot", code = %code, in_flight, "no free CaptchaAI thread: back to the queue");
        self.window.no_slot(in_flight, now);
        if asks_about_the_plan(code, self.deps.settings.queue.upstream) {
            self.zero_balance(now, report).await;
        }
        self.requeue(released, report).await;
    }

    /// A ban or a rejected key: the breaker opens for the ban's duration, and the task goes back
    /// to the queue.
    async fn banned(&mut self, released: Released, code: &str, ban: &Ban, now: Timestamp, report: &mut RunReport) {
        report.bans += 1;
        let until = now.plus(ban.duration);
        let stop = Stop::Ban { needs_operator: ban.needs_operator };
        if let Err(e) = self.deps.store.account.open_breaker(until, code, stop, now).await {
            report.errors += 1;
            tracing::error!(event = "breaker_store_failed", error = %e);
        }
        metrics::counter!("breaker_opened", "reason" => breaker_reason(ban)).increment(1);
        tracing::warn!(event = "breaker_opened", code = %code, until = %until, "in.php answered a ban; the queue waits");
        self.requeue(released, report).await;
    }

    /// Refused for now: sends pause a moment, and the task goes back to the queue — unless it
    /// was refused so too often, then it fails.
    async fn refused_for_now(
        &mut self,
        released: Released,
        err: &CaptchaAiError,
        now: Timestamp,
        report: &mut RunReport,
    ) {
        self.pause_until = now.plus(self.deps.settings.transient_pause);
        let refusals = match self.deps.store.queue.count_refusal_for_now(&released.task.task_ref).await {
            Ok(n) => n.unwrap_or(0),
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e);
                0
            }
        };
        match for_now(refusals) {
            ForNow::Requeue => {
                tracing::warn!(event = "submit_transient", error = %err, refusals, "in.php refused for now: back to the queue");
                self.requeue(released, report).await;
            }
            ForNow::Fail => {
                let detail = format!("in.php refused the task {refusals} times: {err}");
                if self.fail_refused(&released, err, &detail, now, report).await {
                    tracing::warn!(event = "submit_refused", task_ref = %released.task.task_ref, error = %err, refusals, "in.php refused a task again and again: failed");
                }
            }
        }
    }

    /// Fails a released task in.php refused (never sent again). Whether it was recorded; if not,
    /// it stays submitting and expires at its deadline: still true.
    async fn fail_refused(
        &mut self,
        released: &Released,
        err: &CaptchaAiError,
        detail: &str,
        now: Timestamp,
        report: &mut RunReport,
    ) -> bool {
        let task_ref = &released.task.task_ref;
        report.failed += 1;
        self.mine.remove(task_ref);
        match self.deps.store.queue.fail_unsent(task_ref, false, &err.code(), detail, now).await {
            Ok(_) => {
                metrics::counter!("submits", "outcome" => "refused").increment(1);
                true
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e);
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn only_captchaais_zero_balance_asks_about_the_plan() {
        // Arrange / Act
        let zero_balance = asks_about_the_plan("ERROR_ZERO_BALANCE", Upstream::CaptchaAi);
        let no_slot = asks_about_the_plan("ERROR_NO_SLOT_AVAILABLE", Upstream::CaptchaAi);
        let other_service = asks_about_the_plan("ERROR_ZERO_BALANCE", Upstream::TwoCaptcha);

        // Assert
        assert!(zero_balance);
        assert!(!no_slot);
        assert!(!other_service);
    }

    #[test]
    fn a_task_refused_for_now_goes_back_until_its_refusals_reach_the_maximum() {
        // Arrange
        let last_retry = MAX_REFUSALS_FOR_NOW - 1;

        // Act
        let fates = [for_now(0), for_now(last_retry), for_now(MAX_REFUSALS_FOR_NOW), for_now(MAX_REFUSALS_FOR_NOW + 3)];

        // Assert
        assert_eq!(fates, [ForNow::Requeue, ForNow::Requeue, ForNow::Fail, ForNow::Fail]);
    }

    #[test]
    fn a_rejected_key_is_counted_apart_from_a_ban() {
        // Arrange
        let ban = Ban { duration: Duration::from_secs(60), needs_operator: false };
        let key = Ban { duration: Duration::from_secs(3_600), needs_operator: true };

        // Act
        let reasons = [breaker_reason(&ban), breaker_reason(&key)];

        // Assert
        assert_eq!(reasons, ["ban", "key_rejected"]);
    }
}

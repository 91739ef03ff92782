//! One run of the submitter: takes the queue's lease, then looks, releases and renews a tick at
//! a time until its period ends, and hands over. The decisions of that loop are the pure
//! functions here; the work each step does is in the submodules.

mod answer;
mod count;
mod lease;
mod plan;
mod queue;
mod reconcile;
mod release;
mod state;

use std::sync::Arc;
use std::time::Duration;

use relay_shared::store::{SubmitState, TaskStore};
use relay_shared::submit::Upstream;
use relay_shared::time::{Clock, Timestamp};
use tokio::sync::Notify;
use tokio::task::JoinSet;

use crate::deps::Deps;
use crate::report::{RunReport, emit_metrics};
use crate::settings::SubmitterSettings;
use lease::{Renewal, take_lease};
pub use plan::PLAN_OUT_PAUSE;
use state::{Run, Sent};

/// While the breaker stops submits, the queue is looked at again at least this often (its tasks
/// may time out).
const BREAKER_LOOK_EVERY: Duration = Duration::from_secs(5);

/// Sends start until this time: the end of the period from `start`, or earlier so that the last
/// answer and its writes finish before the invocation's `deadline`.
fn send_until(s: &SubmitterSettings, start: Timestamp, deadline: Timestamp) -> Timestamp {
    start.plus(s.period).min(deadline.minus(s.safety_margin + s.submit_timeout + 2 * TaskStore::CALL_TIMEOUT))
}

/// Nothing queued, no inline "no slot" answer to learn from (`taken` of them are in the window
/// already): the run republishes the permits and ends (the scheduled run of an idle minute).
fn is_idle(state: &SubmitState, taken: u64) -> bool {
    state.queued == 0 && state.api_no_slots <= taken
}

/// Whether a run with work to release reads the plan before it starts: when it is due, from
/// CaptchaAI only, and never while submits are stopped.
fn reads_plan_first(upstream: Upstream, plan_due: bool, submits_stopped: bool) -> bool {
    upstream == Upstream::CaptchaAi && plan_due && !submits_stopped
}

/// When the next look is due after one at `now`: a tick on, or while the breaker stops submits
/// (`breaker`: until when), when it closes — at most [`BREAKER_LOOK_EVERY`] on.
fn next_look(breaker: Option<Timestamp>, now: Timestamp, tick: Duration) -> Timestamp {
    match breaker {
        Some(until) => until.min(now.plus(BREAKER_LOOK_EVERY)),
        None => now.plus(tick),
    }
}

/// Whether the lease is renewed at `now`: a tick after the last renewal (answers come faster
/// than ticks at a high rate), and always once sends have ended.
fn renewal_due(now: Timestamp, renewed_at: Timestamp, tick: Duration, send_until: Timestamp) -> bool {
    now.since(renewed_at) >= tick || now >= send_until
}

/// What the loop does after a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Then {
    /// Another tick; the queue has been empty since this time, if it is.
    Go { idle_since: Option<Timestamp> },
    /// The run ends.
    End,
}

/// See [`Then`]: at `now`, with tasks `waiting` (queued, or answers owed) or not, the queue empty
/// since `idle_since`, `released` tasks sent by this run.
fn after_renewal(
    now: Timestamp,
    send_until: Timestamp,
    waiting: bool,
    idle_since: Option<Timestamp>,
    released: u64,
    linger: Duration,
) -> Then {
    if now >= send_until {
        return Then::End;
    }
    if waiting {
        return Then::Go { idle_since: None };
    }
    let since = idle_since.unwrap_or(now);
    // Nothing released: nothing to linger for. Otherwise keep publishing permits a little
    // longer, for the tasks that follow a burst.
    if released == 0 || now.since(since) >= linger { Then::End } else { Then::Go { idle_since: Some(since) } }
}

/// Resolves when `wake` is notified (local mode: a task was queued); never without one.
async fn woken(wake: Option<&Notify>) {
    match wake {
        Some(w) => w.notified().await,
        None => std::future::pending().await,
    }
}

/// One run: holds the queue's lease and releases queued tasks as threads free, until its
/// period ends (or, once the queue is empty, `linger` later; at once if it released nothing).
/// `deadline` is the invocation's hard end: sends start only while their answer and its writes
/// can finish before it. The caller holds the clock's busy guard for it (a simulated clock needs
/// one).
pub async fn run(deps: &Deps, clock: Arc<dyn Clock>, deadline: Timestamp, wake: Option<Arc<Notify>>) -> RunReport {
    let s = &deps.settings;
    let mut report = RunReport::default();
    let start = clock.now();
    let send_until = send_until(s, start, deadline);
    let Some(state) = take_lease(deps, &clock, send_until, &mut report).await else { return report };
    let mut r = Run::new(deps, clock, &state, start);
    r.fold_queue_shards(&mut report).await;
    r.reconcile_lost_lanes(&state, &mut report).await;
    let mut calls: JoinSet<Sent> = JoinSet::new();
    let mut in_flight = 0;
    if !is_idle(&state, r.api_no_slots) {
        // The plan, read rather than learnt from refusals, when there is work to release: at
        // the start and every few minutes — never while CaptchaAI traffic is stopped.
        let stopped = state.breaker.open_for_submits_at(start).is_some();
        if reads_plan_first(s.queue.upstream, r.window.plan_due(start), stopped) {
            r.read_plan(&mut report).await;
        }
        in_flight = r.ticks(state, &mut calls, send_until, wake.as_deref(), &mut report).await;
    }
    r.finish(calls, in_flight, &mut report).await;
    report
}

impl Run<'_> {
    /// Looks, releases and renews the lease a tick at a time, from `state`, until sends end, the
    /// queue stays empty (see [`after_renewal`]) or the lease is lost. The tasks in work at the
    /// last look.
    async fn ticks(
        &mut self,
        mut state: SubmitState,
        calls: &mut JoinSet<Sent>,
        send_until: Timestamp,
        wake: Option<&Notify>,
        report: &mut RunReport,
    ) -> u32 {
        let s = &self.deps.settings;
        let mut in_flight = 0;
        let mut idle_since: Option<Timestamp> = None;
        loop {
            let now = self.clock.now();
            report.max_queued = report.max_queued.max(state.queued);
            in_flight = self.look(&state, in_flight, now, report).await;
            let breaker = state.breaker.open_for_submits_at(now);
            tracing::debug!(
                event = "submitter_tick",
                in_flight,
                limit = self.window.limit(now),
                gate = ?self.window.gate(in_flight, now),
                queued = state.queued,
                "a look at the queue"
            );
            if breaker.is_none() && now < send_until {
                self.release(&state, &mut in_flight, calls, wake.is_some(), report).await;
            } else {
                self.expire_heads(&state, now, report).await;
            }
            self.wait(next_look(breaker, now, s.tick), calls, wake, report).await;
            let now = self.clock.now();
            if !renewal_due(now, self.renewed_at, s.tick, send_until) {
                continue;
            }
            match self.renew(in_flight, now, report).await {
                Renewal::Renewed(st) => state = *st,
                Renewal::Lost => break,
                Renewal::Failed => {}
            }
            let waiting = state.queued > 0 || !calls.is_empty();
            match after_renewal(now, send_until, waiting, idle_since, report.released, s.linger) {
                Then::Go { idle_since: since } => idle_since = since,
                Then::End => break,
            }
        }
        in_flight
    }

    /// Waits for the next look (`until`), an answer, or (locally) a new task; records the
    /// answers in by then.
    async fn wait(
        &mut self,
        until: Timestamp,
        calls: &mut JoinSet<Sent>,
        wake: Option<&Notify>,
        report: &mut RunReport,
    ) {
        let clock = self.clock.clone();
        let answered = tokio::select! {
            _ = clock.sleep_until(until) => None,
            Some(done) = calls.join_next(), if !calls.is_empty() => Some(done),
            _ = woken(wake) => None,
        };
        if let Some(done) = answered {
            self.answered(done, report).await;
        }
        while let Some(done) = calls.try_join_next() {
            self.answered(done, report).await;
        }
    }

    /// Ends the run: the answers still owed (each call ends within the in.php timeout), the
    /// last counts and permits written as the lease is left (unless it was lost), the next run
    /// woken if tasks wait, and the report logged (with metrics if the queue was used).
    async fn finish(&mut self, mut calls: JoinSet<Sent>, in_flight: u32, report: &mut RunReport) {
        while let Some(done) = calls.join_next().await {
            self.answered(done, report).await;
        }
        let now = self.clock.now();
        self.flush_counts(report).await;
        let in_flight = self.in_flight(now, report).await.unwrap_or(in_flight);
        let publish = self.publish(in_flight, now);
        report.window = self.window.limit(now);
        if !report.lease_lost {
            self.leave(&publish, now, report).await;
        }
        // An idle run publishes nothing: the queue's metrics exist while it is used (custom
        // metrics are billed by the hour they are published in).
        if report.saw_the_queue_used() {
            report.metrics_published = true;
            emit_metrics(report);
        }
        tracing::info!(event = "submitter_run", report = %serde_json::to_string(&report).unwrap_or_default());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    #[test]
    fn sends_end_with_the_period_when_the_invocation_lasts_longer() {
        // Arrange: a 60 s period in a 15-minute invocation.
        let s = SubmitterSettings::default();

        // Act
        let until = send_until(&s, at(1_000), at(1_900));

        // Assert
        assert_eq!(until, at(1_060));
    }

    #[test]
    fn sends_end_early_enough_for_the_last_answer_and_its_writes_before_the_deadline() {
        // Arrange: a 30 s invocation, shorter than the period.
        let s = SubmitterSettings::default();
        let deadline = at(1_030);

        // Act
        let until = send_until(&s, at(1_000), deadline);

        // Assert: 2 s of margin, 15 s for the in.php answer, 2 x 6 s for its writes.
        assert_eq!(until, at(1_001));
    }

    #[test]
    fn a_run_is_idle_only_with_nothing_queued_and_no_inline_no_slot_to_learn() {
        // Arrange
        let empty = SubmitState { api_no_slots: 4, ..SubmitState::default() };
        let queued = SubmitState { queued: 1, api_no_slots: 4, ..SubmitState::default() };

        // Act
        let verdicts = [is_idle(&empty, 4), is_idle(&empty, 3), is_idle(&queued, 4)];

        // Assert
        assert_eq!(verdicts, [true, false, false]);
    }

    #[test]
    fn the_plan_is_read_first_only_from_captchaai_when_due_and_submits_flow() {
        // Arrange / Act
        let due = reads_plan_first(Upstream::CaptchaAi, true, false);
        let not_due = reads_plan_first(Upstream::CaptchaAi, false, false);
        let stopped = reads_plan_first(Upstream::CaptchaAi, true, true);
        let other_service = reads_plan_first(Upstream::TwoCaptcha, true, false);

        // Assert
        assert!(due);
        assert!(!not_due && !stopped && !other_service);
    }

    #[test]
    fn the_next_look_is_a_tick_on_while_submits_flow() {
        // Arrange
        let tick = Duration::from_millis(200);

        // Act
        let next = next_look(None, at(100), tick);

        // Assert
        assert_eq!(next, at(100).plus(tick));
    }

    #[test]
    fn under_a_breaker_the_next_look_is_when_it_closes_but_at_most_five_seconds_on() {
        // Arrange
        let tick = Duration::from_millis(200);

        // Act
        let closing_soon = next_look(Some(at(102)), at(100), tick);
        let closing_late = next_look(Some(at(700)), at(100), tick);

        // Assert
        assert_eq!(closing_soon, at(102));
        assert_eq!(closing_late, at(105));
    }

    #[test]
    fn the_lease_is_renewed_once_a_tick_and_always_once_sends_end() {
        // Arrange
        let tick = Duration::from_millis(200);
        let renewed = Timestamp::from_millis(10_000);
        let send_until = Timestamp::from_millis(60_000);

        // Act
        let too_soon = renewal_due(Timestamp::from_millis(10_150), renewed, tick, send_until);
        let a_tick_on = renewal_due(Timestamp::from_millis(10_200), renewed, tick, send_until);
        let at_the_end = renewal_due(send_until, send_until.minus(Duration::from_millis(1)), tick, send_until);

        // Assert
        assert!(!too_soon);
        assert!(a_tick_on);
        assert!(at_the_end);
    }

    #[test]
    fn the_run_ends_when_sends_end_even_with_tasks_waiting() {
        // Arrange
        let linger = Duration::from_secs(10);

        // Act
        let then = after_renewal(at(60), at(60), true, None, 5, linger);

        // Assert
        assert_eq!(then, Then::End);
    }

    #[test]
    fn tasks_waiting_keep_the_run_going_and_reset_the_idle_clock() {
        // Arrange
        let linger = Duration::from_secs(10);

        // Act
        let then = after_renewal(at(30), at(60), true, Some(at(20)), 5, linger);

        // Assert
        assert_eq!(then, Then::Go { idle_since: None });
    }

    #[test]
    fn an_empty_queue_ends_a_run_that_released_nothing_at_once() {
        // Arrange
        let linger = Duration::from_secs(10);

        // Act
        let then = after_renewal(at(30), at(60), false, None, 0, linger);

        // Assert
        assert_eq!(then, Then::End);
    }

    #[test]
    fn a_run_that_released_lingers_on_an_empty_queue_then_ends() {
        // Arrange
        let linger = Duration::from_secs(10);

        // Act
        let first_empty = after_renewal(at(30), at(60), false, None, 3, linger);
        let still_lingering = after_renewal(at(39), at(60), false, Some(at(30)), 3, linger);
        let lingered_enough = after_renewal(at(40), at(60), false, Some(at(30)), 3, linger);

        // Assert
        assert_eq!(first_empty, Then::Go { idle_since: Some(at(30)) });
        assert_eq!(still_lingering, Then::Go { idle_since: Some(at(30)) });
        assert_eq!(lingered_enough, Then::End);
    }
}

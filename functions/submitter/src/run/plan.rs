//! CaptchaAI's plan as `threadsinfo` states it: the window's ceiling, a correction of the count
//! of tasks in work, and the test of a plan run out behind `ERROR_ZERO_BALANCE`.

use std::time::Duration;

use relay_shared::captchaai::ThreadsInfo;
use relay_shared::store::Stop;
use relay_shared::submit::Upstream;
use relay_shared::submit::window::Gate;
use relay_shared::time::Timestamp;

use super::state::Run;
use crate::report::RunReport;

/// Longest wait for `threadsinfo`.
const PLAN_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// `threadsinfo` asked after an `ERROR_ZERO_BALANCE` at most this often.
const PLAN_CHECK_EVERY: Duration = Duration::from_secs(10);
/// `threadsinfo` asked at most this often to correct the count of tasks in work.
const WORKING_READ_EVERY: Duration = Duration::from_secs(5);
/// How long submits stop once the plan is found run out; the next submit after it asks again.
pub const PLAN_OUT_PAUSE: Duration = Duration::from_secs(300);
/// `ERROR_ZERO_BALANCE` answers in a row with threads free that stop submits.
const PLAN_OUT_AFTER: u32 = 2;

/// Whether the table's count of tasks in work is checked against CaptchaAI's: only CaptchaAI
/// answers `threadsinfo`, and only a known plan with a full window makes the check worth it.
pub(super) fn wants_correction(upstream: Upstream, plan: Option<u32>, gate: Gate) -> bool {
    upstream == Upstream::CaptchaAi && plan.is_some() && matches!(gate, Gate::Full)
}

/// Whether `threadsinfo` is asked again for `working_threads` at `now` (read at most every
/// [`WORKING_READ_EVERY`]).
pub(super) fn working_read_due(working: Option<(Timestamp, u32)>, now: Timestamp) -> bool {
    working.is_none_or(|(at, _)| now.since(at) >= WORKING_READ_EVERY)
}

/// The table's count `counted`, at most CaptchaAI's `working` count plus the sends made since it
/// was read (an unread count, `u32::MAX`, leaves the table's).
pub(super) fn corrected_count(counted: u32, working: Option<(Timestamp, u32)>, sent_since: u32) -> u32 {
    let working = working.map_or(u32::MAX, |(_, w)| w);
    counted.min(working.saturating_add(sent_since))
}

/// Whether `threadsinfo` is asked at `now` after an `ERROR_ZERO_BALANCE` (at most every
/// [`PLAN_CHECK_EVERY`]).
pub(super) fn plan_check_due(checked_at: Option<Timestamp>, now: Timestamp) -> bool {
    checked_at.is_none_or(|at| now.since(at) >= PLAN_CHECK_EVERY)
}

/// After an `ERROR_ZERO_BALANCE` that `threadsinfo` showed with `free` threads, `seen` such
/// answers with threads free before it: how many there are in a row now, and whether the plan
/// is taken as run out (twice in a row). No thread free: the plan is only full.
pub(super) fn zero_balance_verdict(seen: u32, free: u32) -> (u32, bool) {
    if free == 0 {
        return (0, false);
    }
    let seen = seen + 1;
    (seen, seen >= PLAN_OUT_AFTER)
}

impl Run<'_> {
    /// Reads the plan (`threadsinfo`): the window's ceiling. A failure keeps what was known.
    pub(super) async fn read_plan(&mut self, report: &mut RunReport) -> Option<ThreadsInfo> {
        let asked = {
            let _io = self.clock.io();
            tokio::time::timeout(PLAN_READ_TIMEOUT, self.deps.captchaai.threads_info()).await
        };
        let now = self.clock.now();
        match asked {
            Ok(Ok(info)) => {
                self.window.set_plan(info.threads, now);
                report.plan = Some(info.threads);
                tracing::info!(event = "plan_read", threads = info.threads, working_threads = info.working_threads);
                Some(info)
            }
            Ok(Err(e)) => {
                tracing::warn!(event = "plan_read_failed", error = %e, "threadsinfo not read; the window learns the plan");
                None
            }
            Err(_) => {
                tracing::warn!(event = "plan_read_failed", error = "timed out");
                None
            }
        }
    }

    /// The tasks in work, `counted` from the table, corrected by CaptchaAI's own count when the
    /// plan is known and the window is full: a task whose pingback was lost looks busy in the
    /// table until the poller reads it (a minute for reCAPTCHA), while CaptchaAI's thread is
    /// long free. `threadsinfo` is asked at most every [`WORKING_READ_EVERY`]; the sends made
    /// since count on top of what it said.
    pub(super) async fn corrected(&mut self, counted: u32, now: Timestamp, report: &mut RunReport) -> u32 {
        let gate = self.window.gate(counted, now);
        if !wants_correction(self.deps.settings.queue.upstream, self.window.plan(), gate) {
            return counted;
        }
        if working_read_due(self.working, now) {
            if let Some(info) = self.read_plan(report).await {
                self.working = Some((self.clock.now(), info.working_threads));
                self.sent_since_plan_read = 0;
            } else {
                // Not readable now: the table's count stands, and it is not asked again at once.
                self.working = Some((now, u32::MAX));
            }
        }
        corrected_count(counted, self.working, self.sent_since_plan_read)
    }

    /// CaptchaAI answered `ERROR_ZERO_BALANCE`: "no free thread" — or, with threads free, a plan
    /// that has expired or run out of balance (how CaptchaAI's own SDK tells them apart). Twice
    /// in a row with threads free: submits stop (the breaker, for [`PLAN_OUT_PAUSE`]; the alarm
    /// fires on `plan_out`) and clients are told why, instead of queueing in silence.
    pub(super) async fn zero_balance(&mut self, now: Timestamp, report: &mut RunReport) {
        if !plan_check_due(self.plan_checked_at, now) {
            return;
        }
        self.plan_checked_at = Some(now);
        let Some(info) = self.read_plan(report).await else { return };
        let (seen, plan_out) = zero_balance_verdict(self.plan_out_seen, info.free());
        self.plan_out_seen = seen;
        if !plan_out {
            return;
        }
        let now = self.clock.now();
        let reason = format!(
            "ERROR_ZERO_BALANCE with {} of {} threads free: CaptchaAI's plan has expired or is out of balance",
            info.free(),
            info.threads
        );
        match self.deps.store.account.open_breaker(now.plus(PLAN_OUT_PAUSE), &reason, Stop::PlanOut, now).await {
            Ok(_) => {
                report.plan_out = true;
                metrics::counter!("plan_out").increment(1);
                tracing::error!(
                    event = "plan_out",
                    threads = info.threads,
                    working_threads = info.working_threads,
                    "{reason}; submits stop until it is renewed"
                );
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "breaker_store_failed", error = %e);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    #[test]
    fn the_count_is_corrected_only_from_captchaai_with_a_known_plan_and_a_full_window() {
        // Arrange / Act
        let wanted = wants_correction(Upstream::CaptchaAi, Some(10), Gate::Full);
        let plan_unknown = wants_correction(Upstream::CaptchaAi, None, Gate::Full);
        let window_open = wants_correction(Upstream::CaptchaAi, Some(10), Gate::Open(2));
        let window_held = wants_correction(Upstream::CaptchaAi, Some(10), Gate::Hold(at(5)));
        let other_service = wants_correction(Upstream::TwoCaptcha, Some(10), Gate::Full);

        // Assert
        assert!(wanted);
        assert!(!plan_unknown && !window_open && !window_held && !other_service);
    }

    #[test]
    fn working_threads_are_read_first_then_every_five_seconds() {
        // Arrange
        let read = Some((at(100), 4));

        // Act
        let never_read = working_read_due(None, at(100));
        let too_soon = working_read_due(read, at(104));
        let five_on = working_read_due(read, at(105));

        // Assert
        assert!(never_read);
        assert!(!too_soon);
        assert!(five_on);
    }

    #[test]
    fn captchaais_count_plus_sends_since_caps_the_tables_count() {
        // Arrange: the table counts 10 in work; CaptchaAI said 4, and 2 were sent since.
        let working = Some((at(100), 4));

        // Act
        let corrected = corrected_count(10, working, 2);

        // Assert
        assert_eq!(corrected, 6);
    }

    #[test]
    fn the_correction_never_raises_the_tables_count() {
        // Arrange / Act
        let corrected = corrected_count(3, Some((at(100), 8)), 1);

        // Assert
        assert_eq!(corrected, 3);
    }

    #[test]
    fn an_unread_count_leaves_the_tables() {
        // Arrange: `u32::MAX` marks a read that failed; sends since must not overflow it.
        let failed = Some((at(100), u32::MAX));

        // Act
        let (none, unreadable) = (corrected_count(10, None, 3), corrected_count(10, failed, 3));

        // Assert
        assert_eq!((none, unreadable), (10, 10));
    }

    #[test]
    fn the_plan_is_checked_after_a_zero_balance_at_most_every_ten_seconds() {
        // Arrange
        let checked = Some(at(100));

        // Act
        let never = plan_check_due(None, at(100));
        let too_soon = plan_check_due(checked, at(109));
        let ten_on = plan_check_due(checked, at(110));

        // Assert
        assert!(never);
        assert!(!too_soon);
        assert!(ten_on);
    }

    #[test]
    fn zero_balance_with_no_thread_free_is_a_full_plan_and_resets_the_count() {
        // Arrange / Act
        let verdict = zero_balance_verdict(1, 0);

        // Assert
        assert_eq!(verdict, (0, false));
    }

    #[test]
    fn zero_balance_with_threads_free_stops_submits_the_second_time_in_a_row() {
        // Arrange / Act
        let first = zero_balance_verdict(0, 3);
        let second = zero_balance_verdict(first.0, 3);

        // Assert
        assert_eq!(first, (1, false));
        assert_eq!(second, (2, true));
    }
}

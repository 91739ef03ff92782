//! The poller's settings ([`PollerSettings`]): the template's environment, its defaults and checks.

use std::time::Duration;

use relay_shared::config::{ConfigError, Settings};
use relay_shared::store::TaskStore;

/// The poller's knobs. Defaults are what the template deploys.
#[derive(Debug, Clone)]
pub struct PollerSettings {
    /// res.php reads a task may cost at most (`POLL_READ_BUDGET`).
    pub read_budget: u32,
    /// From submit to giving up, after a last read (`TASK_DEADLINE_SECS`).
    pub task_deadline: Duration,
    /// Unknown codes tolerated before the task is failed with the code.
    pub max_unknown_codes: u32,
    /// Global res.php requests per second (`POLL_REQUESTS_PER_SECOND`).
    pub requests_per_second: u32,
    /// Reads in flight at once (`POLL_CONCURRENCY`).
    pub concurrency: usize,
    /// How long a claim holds a task before another poller may take it.
    pub lease: Duration,
    /// Read up to 100 ids per res.php request (`POLL_BATCH`).
    pub batch: bool,
    /// Index page size.
    pub page_size: i32,
    /// The schedule's period (`POLL_SCHEDULE_MINUTES`): an invocation starts reads only within
    /// its period, so the next one takes over as this one winds down.
    pub window: Duration,
    /// Most res.php requests one invocation makes (`POLL_MAX_READS_PER_INVOCATION`).
    pub max_reads_per_invocation: u64,
    /// Kept back from the invocation's deadline.
    pub safety_margin: Duration,
    /// Longest wait for one res.php answer (`POLL_READ_TIMEOUT_MS`).
    pub read_timeout: Duration,
    /// Longest wait for one store write (the store's own bound).
    pub write_timeout: Duration,
    /// Longest sleep between passes: new tasks may fall due meanwhile.
    pub idle_wait: Duration,
    /// Failures without an answer (timeouts, 5xx, HTML) in a row that open the breaker.
    pub failures_to_open: u32,
    /// How long such a run of failures stops traffic.
    pub failure_pause: Duration,
    /// Whether a task whose in.php outcome is unknown (or lost in a crash) is sent again, once,
    /// when its result is overdue: yes on CaptchaAI, which bills threads and not solutions
    /// (`CAPTCHAAI_FLAVOR`).
    pub resend: bool,
    /// The account's in.php pace, which a resend takes its place in (`SUBMITS_PER_SECOND`).
    pub submits_per_second: u32,
    /// When a resent task's first poll falls due (`CALLBACK_GRACE_SECS…`).
    pub grace: relay_shared::config::CallbackGrace,
}

impl Default for PollerSettings {
    fn default() -> Self {
        Self {
            read_budget: 20,
            task_deadline: Duration::from_secs(600),
            max_unknown_codes: 3,
            requests_per_second: 10,
            concurrency: 8,
            lease: Duration::from_secs(90),
            batch: false,
            page_size: 100,
            window: Duration::from_secs(60),
            max_reads_per_invocation: 2_000,
            safety_margin: Duration::from_secs(2),
            read_timeout: Duration::from_secs(5),
            write_timeout: TaskStore::CALL_TIMEOUT,
            idle_wait: Duration::from_secs(10),
            failures_to_open: 5,
            failure_pause: Duration::from_secs(60),
            resend: true,
            submits_per_second: relay_shared::submit::SUBMITS_PER_SECOND,
            grace: relay_shared::config::CallbackGrace::default(),
        }
    }
}

impl PollerSettings {
    /// Reads the settings the template sets (and the defaults for the rest).
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let s = Self {
            read_budget: env.parse_or("POLL_READ_BUDGET", d.read_budget)?,
            task_deadline: Duration::from_secs(env.parse_or("TASK_DEADLINE_SECS", d.task_deadline.as_secs())?),
            requests_per_second: env.parse_or("POLL_REQUESTS_PER_SECOND", d.requests_per_second)?,
            concurrency: env.parse_or("POLL_CONCURRENCY", d.concurrency)?,
            batch: env.parse_or("POLL_BATCH", d.batch)?,
            window: Duration::from_secs(60 * env.parse_or("POLL_SCHEDULE_MINUTES", 1u64)?.max(1)),
            max_reads_per_invocation: env.parse_or("POLL_MAX_READS_PER_INVOCATION", d.max_reads_per_invocation)?,
            read_timeout: Duration::from_millis(
                env.parse_or("POLL_READ_TIMEOUT_MS", u64::try_from(d.read_timeout.as_millis()).unwrap_or(5_000))?,
            ),
            resend: relay_shared::submit::Upstream::from_settings(env)?.resend_default(),
            submits_per_second: env.parse_or("SUBMITS_PER_SECOND", d.submits_per_second)?,
            grace: relay_shared::config::CallbackGrace::from_settings(env)?,
            ..d
        };
        let invalid = |name: &str, reason: &str| ConfigError::Invalid { name: name.into(), reason: reason.into() };
        if !(1..=20).contains(&s.read_budget) {
            // The ban rule allows about 20 reads per task; more would risk ERROR: 1005.
            return Err(invalid("POLL_READ_BUDGET", "must be 1 to 20 (CaptchaAI bans above ~20 reads per task)"));
        }
        if s.requests_per_second == 0 || s.concurrency == 0 || s.max_reads_per_invocation == 0 {
            return Err(invalid("POLL_REQUESTS_PER_SECOND", "rates, concurrency and limits must be at least 1"));
        }
        Ok(s)
    }

    /// Time a read needs to be started: its answer, then the write that records it.
    pub fn read_allowance(&self) -> Duration {
        self.read_timeout + self.write_timeout
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_read_from_the_environment_and_checked() {
        let s = PollerSettings::from_settings(&Settings::from_pairs([
            ("POLL_REQUESTS_PER_SECOND", "4"),
            ("POLL_CONCURRENCY", "2"),
            ("POLL_MAX_READS_PER_INVOCATION", "300"),
            ("POLL_BATCH", "true"),
        ]))
        .expect("valid");
        assert_eq!((s.requests_per_second, s.concurrency, s.max_reads_per_invocation, s.batch), (4, 2, 300, true));
        let d = PollerSettings::from_settings(&Settings::default()).expect("defaults");
        assert_eq!((d.requests_per_second, d.batch, d.read_budget), (10, false, 20), "the template's defaults");
        for (k, v) in [("POLL_READ_BUDGET", "50"), ("POLL_CONCURRENCY", "0"), ("POLL_BATCH", "sometimes")] {
            assert!(PollerSettings::from_settings(&Settings::from_pairs([(k, v)])).is_err(), "{k}={v}");
        }
    }
}

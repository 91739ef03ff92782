//! The submitter's knobs: their defaults and how they are read from the environment.

use std::time::Duration;

use relay_shared::config::{ConfigError, Settings};
use relay_shared::submit::QueueSettings;

/// The most in.php calls the submitter has in flight at once (`SUBMIT_CONCURRENCY`).
pub const MAX_SUBMIT_CONCURRENCY: usize = 256;

/// The submitter's knobs. Defaults are what the template deploys.
#[derive(Debug, Clone)]
pub struct SubmitterSettings {
    pub queue: QueueSettings,
    /// How often it looks at the threads in use while tasks wait.
    pub tick: Duration,
    /// How long its lease lasts unrenewed (a run that dies frees the queue this long after).
    pub lease: Duration,
    /// How long a run that released tasks goes on once the queue is empty (new tasks then go
    /// inline with the permits it keeps publishing).
    pub linger: Duration,
    /// In.php calls in flight at once.
    pub concurrency: usize,
    /// A run releases within this period from its start (the schedule's).
    pub period: Duration,
    /// Kept back from the invocation's deadline.
    pub safety_margin: Duration,
    /// Longest wait for one in.php answer (the client's timeout).
    pub submit_timeout: Duration,
    /// A released task counts in work for at least this long after its release (DynamoDB may
    /// not list it in the index yet: a global secondary index is eventually consistent, typically
    /// within a second).
    pub index_lag: Duration,
    /// Nothing is sent for this long after in.php refused for now (a server error code, a
    /// connection that never opened).
    pub transient_pause: Duration,
}

impl Default for SubmitterSettings {
    fn default() -> Self {
        Self {
            queue: QueueSettings::default(),
            tick: Duration::from_millis(200),
            lease: Duration::from_secs(10),
            linger: Duration::from_secs(10),
            concurrency: 8,
            period: Duration::from_secs(60),
            safety_margin: Duration::from_secs(2),
            submit_timeout: Duration::from_secs(15),
            index_lag: Duration::from_secs(1),
            transient_pause: Duration::from_secs(2),
        }
    }
}

impl SubmitterSettings {
    /// The defaults for `queue`'s pace: a second of in.php calls at the pace in flight
    /// (CaptchaAI answers in.php in a few hundred ms; 8 calls at once would hold a pace of
    /// 100/s to 8 / latency), at least 8.
    pub fn for_queue(queue: QueueSettings) -> Self {
        let concurrency = Self::default().concurrency.max(queue.submits_per_second as usize);
        Self { queue, concurrency: concurrency.min(MAX_SUBMIT_CONCURRENCY), ..Self::default() }
    }

    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::for_queue(QueueSettings::from_settings(env)?);
        Ok(Self {
            concurrency: env.parse_or("SUBMIT_CONCURRENCY", d.concurrency)?.clamp(1, MAX_SUBMIT_CONCURRENCY),
            period: Duration::from_secs(60 * env.parse_or("SUBMIT_SCHEDULE_MINUTES", 1u64)?.max(1)),
            ..d
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queue_at(submits_per_second: u32) -> QueueSettings {
        QueueSettings { submits_per_second, ..QueueSettings::default() }
    }

    #[test]
    fn a_slow_pace_keeps_the_default_eight_calls_in_flight() {
        // Arrange
        let queue = queue_at(2);

        // Act
        let s = SubmitterSettings::for_queue(queue);

        // Assert
        assert_eq!(s.concurrency, 8);
        assert_eq!(s.queue.submits_per_second, 2);
    }

    #[test]
    fn a_fast_pace_gets_a_second_of_calls_in_flight() {
        // Arrange
        let queue = queue_at(50);

        // Act
        let s = SubmitterSettings::for_queue(queue);

        // Assert
        assert_eq!(s.concurrency, 50);
    }

    #[test]
    fn calls_in_flight_never_pass_the_maximum_whatever_the_pace() {
        // Arrange
        let queue = queue_at(10_000);

        // Act
        let s = SubmitterSettings::for_queue(queue);

        // Assert
        assert_eq!(s.concurrency, MAX_SUBMIT_CONCURRENCY);
    }

    #[test]
    fn submit_concurrency_is_clamped_to_one_and_the_maximum() {
        // Arrange
        let zero = Settings::from_pairs([("SUBMIT_CONCURRENCY", "0")]);
        let huge = Settings::from_pairs([("SUBMIT_CONCURRENCY", "100000")]);
        let some = Settings::from_pairs([("SUBMIT_CONCURRENCY", "17")]);

        // Act
        let (zero, huge, some) = (
            SubmitterSettings::from_settings(&zero).expect("zero"),
            SubmitterSettings::from_settings(&huge).expect("huge"),
            SubmitterSettings::from_settings(&some).expect("some"),
        );

        // Assert
        assert_eq!(zero.concurrency, 1);
        assert_eq!(huge.concurrency, MAX_SUBMIT_CONCURRENCY);
        assert_eq!(some.concurrency, 17);
    }

    #[test]
    fn the_period_follows_the_schedule_in_whole_minutes_at_least_one() {
        // Arrange
        let unset = Settings::from_pairs([]);
        let zero = Settings::from_pairs([("SUBMIT_SCHEDULE_MINUTES", "0")]);
        let five = Settings::from_pairs([("SUBMIT_SCHEDULE_MINUTES", "5")]);

        // Act
        let periods = [&unset, &zero, &five].map(|e| SubmitterSettings::from_settings(e).expect("settings").period);

        // Assert
        assert_eq!(periods, [Duration::from_secs(60), Duration::from_secs(60), Duration::from_secs(300)]);
    }

    #[test]
    fn a_malformed_knob_is_an_error_not_a_default() {
        // Arrange
        let env = Settings::from_pairs([("SUBMIT_CONCURRENCY", "many")]);

        // Act
        let read = SubmitterSettings::from_settings(&env);

        // Assert
        assert!(read.is_err());
    }
}

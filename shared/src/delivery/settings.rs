//! The push's limits, schedule and URL policy, read from the environment (`DELIVERY_*`), and
//! the check of an owner's callback URL at submit time.

use std::time::Duration;

use super::schedule;
use crate::config::{ConfigError, Settings};
use crate::time::Timestamp;
use crate::webhook::UrlPolicy;

/// The push's limits and schedule.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    /// One request's time limit (`DELIVERY_TIMEOUT_SECS`, default 10).
    pub timeout: Duration,
    /// Attempts on the standard schedule before a push is parked (`DELIVERY_MAX_ATTEMPTS`,
    /// default 7: at once, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h). A token's fast retries while it
    /// lives come before these (see [`schedule`]).
    pub max_attempts: u32,
    /// The ceiling on requests in flight to one host, across every worker
    /// (`DELIVERY_PER_HOST_CONCURRENCY`, default 64); the adaptive limit moves below it.
    pub per_host_concurrency: u32,
    /// Requests a second to one host, across every worker (`DELIVERY_PER_HOST_PER_SECOND`,
    /// default 50: above the most results the relay makes a second at its default submit pace).
    pub per_host_per_second: u32,
    /// Which owner URLs may be used (`DELIVERY_URL_POLICY`: `public_https`, the default and
    /// the only one on AWS, or `allow_loopback`, local mode's explicit setting).
    pub policy: UrlPolicy,
}

impl Default for DeliverySettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_attempts: schedule::MAX_ATTEMPTS,
            per_host_concurrency: 64,
            per_host_per_second: 50,
            policy: UrlPolicy::PublicHttps,
        }
    }
}

/// Reads `DELIVERY_URL_POLICY`.
pub fn url_policy(env: &Settings) -> Result<UrlPolicy, ConfigError> {
    match env.optional("DELIVERY_URL_POLICY").as_deref().map(str::trim) {
        None | Some("public_https") => Ok(UrlPolicy::PublicHttps),
        Some("allow_loopback") => Ok(UrlPolicy::AllowLoopback),
        Some(other) => Err(ConfigError::Invalid {
            name: "DELIVERY_URL_POLICY".into(),
            reason: format!("`{other}`: use public_https or allow_loopback"),
        }),
    }
}

impl DeliverySettings {
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let s = Self {
            timeout: Duration::from_secs(env.parse_or("DELIVERY_TIMEOUT_SECS", d.timeout.as_secs())?),
            max_attempts: env.parse_or("DELIVERY_MAX_ATTEMPTS", d.max_attempts)?,
            per_host_concurrency: env.parse_or("DELIVERY_PER_HOST_CONCURRENCY", d.per_host_concurrency)?,
            per_host_per_second: env.parse_or("DELIVERY_PER_HOST_PER_SECOND", d.per_host_per_second)?,
            policy: url_policy(env)?,
        };
        let bad = |name: &str, reason: &str| Err(ConfigError::Invalid { name: name.into(), reason: reason.into() });
        if s.timeout.is_zero() || s.timeout > Duration::from_secs(30) {
            return bad("DELIVERY_TIMEOUT_SECS", "must be 1 to 30");
        }
        if s.max_attempts == 0 || s.max_attempts > 12 {
            return bad("DELIVERY_MAX_ATTEMPTS", "must be 1 to 12");
        }
        if s.per_host_concurrency == 0 || s.per_host_concurrency > crate::store::hosts::MAX_SLOTS {
            return bad("DELIVERY_PER_HOST_CONCURRENCY", "must be 1 to 256");
        }
        if s.per_host_per_second == 0 || s.per_host_per_second > 10_000 {
            return bad("DELIVERY_PER_HOST_PER_SECOND", "must be 1 to 10000");
        }
        Ok(s)
    }

    /// How long a claim holds: the wait for the host's turn (up to 10 s), the request's limit
    /// and the store writes around it.
    pub fn lease(&self) -> Duration {
        self.timeout + Duration::from_secs(15)
    }

    /// The latest a claimed push may start its request: its lease must outlast the request and
    /// the write of its outcome, or another worker would send it too.
    pub(super) fn latest_start(&self, lease_until: Timestamp) -> Timestamp {
        lease_until.minus(self.timeout + Duration::from_secs(5))
    }
}

/// Checks an owner's callback URL when a task is submitted, with a message for the caller.
pub fn check_owner_url(url: &str, policy: UrlPolicy) -> Result<String, String> {
    crate::webhook::check_url(url, policy).map(|u| u.to_string()).map_err(|e| e.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn settings_are_checked_with_clear_messages() {
        let env =
            |pairs: &[(&str, &str)]| DeliverySettings::from_settings(&Settings::from_pairs(pairs.iter().copied()));
        assert_eq!(env(&[]).expect("defaults").max_attempts, 7);
        assert_eq!(env(&[]).expect("defaults").policy, UrlPolicy::PublicHttps);
        assert_eq!(env(&[("DELIVERY_URL_POLICY", "allow_loopback")]).expect("ok").policy, UrlPolicy::AllowLoopback);
        for (k, v) in [
            ("DELIVERY_URL_POLICY", "anything"),
            ("DELIVERY_TIMEOUT_SECS", "0"),
            ("DELIVERY_TIMEOUT_SECS", "31"),
            ("DELIVERY_MAX_ATTEMPTS", "0"),
            ("DELIVERY_PER_HOST_CONCURRENCY", "0"),
            ("DELIVERY_PER_HOST_PER_SECOND", "x"),
        ] {
            let e = env(&[(k, v)]).expect_err(k).to_string();
            assert!(e.contains(k), "{e}");
        }
    }
}

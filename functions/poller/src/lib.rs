//! The fallback poller: finds open tasks whose callback never came (the sparse `due-for-poll`
//! index), reads them from res.php within CaptchaAI's limits, and records what it finds through
//! the same conditional write the callback uses.
//!
//! One scheduled invocation is [`run_invocation`]: EventBridge Scheduler starts one a minute
//! (its finest rate), and the invocation keeps working through its minute for as long as tasks
//! fall due inside it — sleeping until the next one is due — and ends at once when none will.
//! That is what lets a task be read seconds after it falls due rather than up to a minute
//! later, so a recovered reCAPTCHA token is still young (see docs/poller.md).
//!
//! Within an invocation, each *pass* walks the due tasks oldest first across all index shards
//! and, for each one, waits for a slot of the global rate limit, claims the task (a conditional
//! write that also counts the read against the task's budget, before it is made), reads it and
//! records the answer as it arrives. A read is started only if it and its write can finish
//! before the invocation's deadline, so nothing is left half done; a task whose claim cannot be
//! used is released. A batch's result writes slowed by throttling can still outlast that
//! allowance: at its hard end (the deadline less half the safety margin) the invocation stops
//! waiting for them (`reads_abandoned`; their claims lapse and the tasks are read again), so it
//! never runs into Lambda's timeout. An account-wide breaker, kept in the table, stops every read — in this and
//! every other invocation, and in the API's submits — for a ban's documented duration.
//!
//! Every wait goes through a [`Clock`], so tests run hours of this, with the template's
//! settings, on a simulated clock.

mod answer;
mod breaker;
mod due;
mod invocation;
mod limiter;
mod reads;
mod report;
mod resend;
mod schedule;
mod settings;

use std::sync::Arc;

use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::config::Settings;
use relay_shared::deadletter::{DeadLetterSink, SqsQueue};
use relay_shared::store::{Account, PollIndex, Results, SubmitQueue, TaskStore, Tasks};
use relay_shared::time::Clock;

pub use invocation::run_invocation;
pub use relay_shared::time_left;
pub use report::TickReport;
pub use schedule::{Decision, NO_ID_GRACE, decide, next_poll_delay, next_read_at};
pub use settings::PollerSettings;

/// The task table as the poller uses it: a handle per concern it touches, as its role is
/// granted (Query on `due-for-poll`; UpdateItem and GetItem on the table).
#[derive(Debug, Clone)]
pub struct Store {
    /// The due-for-poll index: pages, claims, expiry.
    pub poll: PollIndex,
    /// Results read from res.php.
    pub results: Results,
    /// The read slots and the breaker.
    pub account: Account,
    /// A stranded task's request, to send it again once.
    pub queue: SubmitQueue,
    /// A resend in.php refused.
    pub tasks: Tasks,
}

impl Store {
    pub fn new(store: &TaskStore) -> Self {
        Self {
            poll: store.poll(),
            results: store.results(),
            account: store.account(),
            queue: store.queue(),
            tasks: store.tasks(),
        }
    }
}

/// What the poller needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: Store,
    pub captchaai: CaptchaAiClient,
    pub settings: PollerSettings,
    /// This poller instance's name on its claims.
    pub owner: String,
    /// Where a result goes that was read but could not be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{CaptchaAiConfig, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let cai = CaptchaAiConfig::from_settings(&env)?;
        let settings = PollerSettings::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let key = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cai.api_key)
            .await
            .context("loading the CaptchaAI key")?;
        Ok(Self {
            store: Store::new(&TaskStore::from_config(&aws, &store_cfg)),
            captchaai: CaptchaAiClient::new(&cai.base_url, key, cai.timeout.min(settings.read_timeout), None)?,
            settings,
            owner: format!("poller-{}", uuid::Uuid::new_v4().simple()),
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
        })
    }
}

/// The Lambda entry point: one scheduled invocation, working until shortly before its
/// deadline. The schedule's payload carries nothing the poller needs.
pub async fn handle(
    event: lambda_runtime::LambdaEvent<serde_json::Value>,
    deps: &Deps,
    clock: Arc<dyn Clock>,
) -> Result<TickReport, lambda_runtime::Error> {
    let now = clock.now();
    let left = time_left(event.context.deadline, now);
    tracing::info!(
        event = "poll_invoked",
        deadline_ms = event.context.deadline,
        time_left_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
    );
    Ok(run_invocation(deps, clock, now.plus(left)).await)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use relay_shared::time::Timestamp;

    use super::*;

    #[test]
    fn deadline_is_read_as_epoch_or_as_a_plain_timeout() {
        let now = Timestamp::from_millis(1_796_210_146_000);
        assert_eq!(time_left(1_796_210_146_000 + 55_000, now), Duration::from_secs(55));
        assert_eq!(time_left(1_796_210_146_000 - 1, now), Duration::ZERO, "a past deadline leaves nothing");
        assert_eq!(time_left(600_000, now), Duration::from_secs(600), "the emulator's timeout-only form");
    }
}

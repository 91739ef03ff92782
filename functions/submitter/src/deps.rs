//! What the submitter needs to run — store, CaptchaAI client, dead letters, settings — built once
//! at cold start.

use std::sync::Arc;

use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::config::{CallbackGrace, Settings};
use relay_shared::deadletter::{DeadLetterSink, SqsQueue};
use relay_shared::store::{Account, SubmitQueue, TaskStore, Tasks};
use relay_shared::submit::Waker;

use crate::settings::SubmitterSettings;

/// The task table as the submitter uses it: a handle per concern it touches, as its role is
/// granted (GetItem, UpdateItem on the table; Query and Scan on `submit-queue`).
#[derive(Debug, Clone)]
pub struct Store {
    /// The queue: its lease, counts, lanes, releases.
    pub queue: SubmitQueue,
    /// The in.php pace and the breaker.
    pub account: Account,
    /// In.php's answers recorded on the tasks it sent.
    pub tasks: Tasks,
}

impl Store {
    pub fn new(store: &TaskStore) -> Self {
        Self { queue: store.queue(), account: store.account(), tasks: store.tasks() }
    }
}

/// What the submitter needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: Store,
    pub captchaai: CaptchaAiClient,
    pub dead_letters: Arc<dyn DeadLetterSink>,
    pub grace: CallbackGrace,
    pub settings: SubmitterSettings,
    /// This instance's name on the lease.
    pub owner: String,
    /// Wakes the next run when this one ends with tasks left.
    pub waker: Arc<dyn Waker>,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{CaptchaAiConfig, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let cai = CaptchaAiConfig::from_settings(&env)?;
        let settings = SubmitterSettings::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let key = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cai.api_key)
            .await
            .context("loading the CaptchaAI key")?;
        let store = TaskStore::from_config(&aws, &store_cfg);
        Ok(Self {
            waker: Arc::new(relay_shared::submit::StoreWaker(store.queue())),
            store: Store::new(&store),
            captchaai: CaptchaAiClient::new(&cai.base_url, key, cai.timeout, cai.soft_id)?,
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
            grace: CallbackGrace::from_settings(&env)?,
            settings: SubmitterSettings { submit_timeout: cai.timeout, ..settings },
            owner: format!("submitter-{}", uuid::Uuid::new_v4().simple()),
        })
    }
}

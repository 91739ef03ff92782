//! What the handler needs, built once at cold start: the store, the CaptchaAI client, the keys.

use std::sync::Arc;

use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::deadletter::{DeadLetterSink, SqsQueue};
use relay_shared::http::Authorizer;
use relay_shared::idempotency::IdempotencyKeys;
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{Account, Results, Retention, SubmitQueue, TaskStore, Tasks};
use relay_shared::submit::{QueueSettings, Waker};
use relay_shared::time::Clock;
use relay_shared::webhook::UrlPolicy;

use crate::compat_state::CompatState;

/// The task table as the API uses it: a handle per concern it touches, as its role is granted
/// (PutItem, UpdateItem, GetItem, DeleteItem on the table; Query on `submit-queue`).
#[derive(Debug, Clone)]
pub struct Store {
    /// Submits: the task created, in.php's answer, a task in.php never took forgotten; reads.
    pub tasks: Tasks,
    /// The result shown, pinned.
    pub results: Results,
    /// Permits, the queue, a queued task's place.
    pub queue: SubmitQueue,
    /// The in.php pace and the breaker.
    pub account: Account,
    /// Reads that refuse what is past its retention.
    pub retention: Retention,
}

impl Store {
    pub fn new(store: &TaskStore) -> Self {
        Self {
            tasks: store.tasks(),
            results: store.results(),
            queue: store.queue(),
            account: store.account(),
            retention: store.retention(),
        }
    }
}

/// What the handler needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: Store,
    pub captchaai: CaptchaAiClient,
    pub signer: CallbackSigner,
    /// The task an `Idempotency-Key` names.
    pub idempotency: IdempotencyKeys,
    pub auth: Authorizer,
    pub clock: Arc<dyn Clock>,
    /// Public base URL of the callback route. `None`: the API's own URL, read from the
    /// request (the callback route lives on the same HTTP API).
    pub callback_base_url: Option<String>,
    /// How long a callback gets before the poller asks res.php, per kind.
    pub callback_grace: relay_shared::config::CallbackGrace,
    /// Where in.php's id goes when it cannot be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
    /// The submit queue's bounds and the in.php pace.
    pub queue: QueueSettings,
    /// Tells the submitter that tasks wait in the queue.
    pub waker: Arc<dyn Waker>,
    /// The keys the 2captcha-compatible routes (`/in.php`, `/res.php`) take.
    pub relay_keys: relay_shared::store::RelayKeys,
    /// Per-instance state of those routes (balance cache, per-key read limits).
    pub compat: CompatState,
    /// What this instance last saw of the submit queue (skips permits it would be refused).
    pub admission: relay_shared::submit::AdmissionHint,
    /// Which owner callback URLs (`callback_url`, `pingback`) a task may carry
    /// (`DELIVERY_URL_POLICY`; on AWS public https only).
    pub delivery_policy: UrlPolicy,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{ApiConfig, AuthMode, Settings};
        let env = Settings::from_env();
        let cfg = ApiConfig::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let mut secrets = relay_shared::secrets::SecretLoader::new(&aws);
        let key = secrets.load(&cfg.captchaai.api_key).await.context("loading the CaptchaAI key")?;
        let signing = secrets.load(&cfg.signing_secret).await.context("loading the callback signing secret")?;
        let auth = match &cfg.auth {
            AuthMode::Iam => Authorizer::Iam,
            AuthMode::ApiKey(src) => {
                Authorizer::api_key(&secrets.load(src).await.context("loading the relay API key")?)
            }
        };
        let store = TaskStore::from_config(&aws, &cfg.store);
        Ok(Self {
            relay_keys: relay_shared::store::RelayKeys::new(Some(store.clone())),
            waker: Arc::new(relay_shared::submit::StoreWaker(store.queue())),
            compat: CompatState::default(),
            admission: Default::default(),
            delivery_policy: relay_shared::delivery::url_policy(&env)?,
            store: Store::new(&store),
            captchaai: CaptchaAiClient::new(
                &cfg.captchaai.base_url,
                key,
                cfg.captchaai.timeout,
                cfg.captchaai.soft_id,
            )?,
            idempotency: IdempotencyKeys::new(signing.clone()),
            signer: CallbackSigner::new(signing),
            auth,
            clock: Arc::new(relay_shared::time::SystemClock),
            callback_base_url: cfg.callback_base_url,
            callback_grace: cfg.callback_grace,
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
            queue: QueueSettings::from_settings(&env)?,
        })
    }
}

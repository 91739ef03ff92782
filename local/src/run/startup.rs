//! Starting a local relay: the store, the dead-letter queue, CaptchaAI (real or the built-in
//! fake), the HTTP(S) servers and the workers (poller, submitter, deliveries, retention sweep,
//! redrive loop); and stopping it.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::local::{FlakyDynamo, LocalDynamo, client_for};
use relay_shared::store::{TaskStore, schema};
use relay_shared::time::{Clock, SystemClock};
use secrecy::SecretString;

use super::config::LocalConfig;
use super::dead_letters::drain_dead_letters;
use crate::data_dir::{DEAD_LETTER_MAX_RECEIVES, ENDPOINT_FILE};
use crate::queue::DiskQueue;
use crate::{LocalParts, Relay};

/// How often local mode's delivery worker looks over the due-for-delivery index for pushes it
/// was not told of (written by another process, or owed from before a restart).
pub const DELIVERY_CATCH_UP: Duration = Duration::from_secs(5);

/// Local mode's push settings: the template's defaults, with loopback allowed only when asked.
pub fn delivery_settings(cfg: &LocalConfig) -> relay_shared::delivery::DeliverySettings {
    use relay_shared::webhook::UrlPolicy;
    relay_shared::delivery::DeliverySettings {
        policy: if cfg.webhook_allow_loopback { UrlPolicy::AllowLoopback } else { UrlPolicy::PublicHttps },
        ..Default::default()
    }
}

/// Extra switches for tests and the demo.
#[derive(Default)]
pub struct Options {
    /// Run the built-in fake with these knobs (default: the fake's defaults).
    pub fake: Option<FakeConfig>,
    /// Put a fault injector in front of the store.
    pub flaky_store: bool,
    /// Redrive loop interval (default 500 ms).
    pub redrive_every: Option<Duration>,
    /// How long a client gets for its TLS handshake (default [`crate::tls::HANDSHAKE_TIMEOUT`]).
    pub tls_handshake_timeout: Option<Duration>,
    /// Push settings instead of [`delivery_settings`] (the demo's: a short timeout, few
    /// attempts, so a failing owner's pushes are retried and parked while it runs).
    pub delivery: Option<relay_shared::delivery::DeliverySettings>,
    /// The relay's clock (default: the system's) — a test's, to be days ahead.
    pub clock: Option<Arc<dyn Clock>>,
}

/// A running local relay. [`Running::shutdown`] stops it gracefully.
pub struct Running {
    pub base_url: String,
    /// The HTTPS URL (`https://127.0.0.1:8443`) when `tls_bind` is set.
    pub tls_url: Option<String>,
    /// The CA certificate that signed the HTTPS port's certificate: what clients are given.
    pub ca_path: Option<PathBuf>,
    pub store: TaskStore,
    pub queue: DiskQueue,
    pub fake: Option<FakeCaptchaAi>,
    pub flaky: Option<FlakyDynamo>,
    pub api_key: String,
    stop: tokio::sync::watch::Sender<bool>,
    workers: tokio::task::JoinSet<()>,
    _db: LocalDynamo,
    /// Held while the relay runs: one process at a time on the data directory.
    _lock: crate::ops::DataLock,
}

async fn ensure_table(endpoint: &str) -> anyhow::Result<String> {
    const TABLE: &str = "tasks";
    let client = client_for(endpoint);
    if client.describe_table().table_name(TABLE).send().await.is_err() {
        schema::create_table(&client, TABLE).await.context("creating the task table")?;
    } else {
        let added = schema::migrate(&client, TABLE).await.context("adding the task table's new indexes")?;
        if !added.is_empty() {
            tracing::info!(event = "table_migrated", indexes = ?added, "added indexes an earlier version lacked");
        }
    }
    Ok(TABLE.into())
}

/// Starts everything; returns once the HTTP server is listening.
pub async fn start(cfg: &LocalConfig, opts: Options) -> anyhow::Result<Running> {
    std::fs::create_dir_all(&cfg.data_dir)
        .with_context(|| format!("cannot create data dir {}", cfg.data_dir.display()))?;
    // Before anything is opened: an operator command working on a stopped relay's files holds
    // the directory for a moment; a second relay on it would write the same store file.
    let lock = crate::ops::DataLock::take(&cfg.data_dir, crate::ops::LOCK_WAIT).await?;
    let listener = tokio::net::TcpListener::bind(&cfg.bind)
        .await
        .with_context(|| format!("cannot listen on {} (is another relay or program using that port?)", cfg.bind))?;
    let addr = listener.local_addr()?;
    let base_url = format!("http://{addr}");
    let tls_listener = match &cfg.tls_bind {
        Some(tls_bind) => {
            let tls = crate::tls::load_or_create(&cfg.data_dir, &cfg.tls_hosts)?;
            let tcp = tokio::net::TcpListener::bind(tls_bind).await.with_context(|| {
                format!("cannot listen on {tls_bind} for HTTPS (is another relay or program using that port?)")
            })?;
            let timeout = opts.tls_handshake_timeout.unwrap_or(crate::tls::HANDSHAKE_TIMEOUT);
            let listener = crate::tls::TlsListener::new(tcp, tls.config, timeout)?;
            let url = format!("https://{}", axum::serve::Listener::local_addr(&listener)?);
            Some((listener, url, tls.files.ca))
        }
        None => None,
    };

    let db = LocalDynamo::start_at(&cfg.data_dir.join("tasks.sqlite")).await.context("opening the task store")?;
    let table = ensure_table(&db.endpoint).await?;
    // Where the operator commands (`relay-local deliveries …`) find this relay's store while it
    // runs.
    std::fs::write(cfg.data_dir.join(ENDPOINT_FILE), &db.endpoint)
        .with_context(|| format!("cannot write {}", cfg.data_dir.join(ENDPOINT_FILE).display()))?;
    let flaky = if opts.flaky_store { Some(FlakyDynamo::start(&db.endpoint).await?) } else { None };
    let endpoint = flaky.as_ref().map_or(db.endpoint.clone(), |f| f.endpoint.clone());
    let retention = cfg.retention();
    let clock: Arc<dyn Clock> = opts.clock.clone().unwrap_or_else(|| Arc::new(SystemClock));
    // The delivery worker hears of each result as the store writes it (on AWS, the table's
    // stream), and of its own retries as they fall due.
    let (inbox, inbox_rx) = relay_shared::delivery::Inbox::new(clock.clone());
    let store = TaskStore::new(client_for(&endpoint), table.clone(), retention).with_push_notifier(inbox.notifier());

    let queue = DiskQueue::open(
        &cfg.data_dir.join("dead-letters.sqlite"),
        clock.clone(),
        Duration::from_secs(30),
        DEAD_LETTER_MAX_RECEIVES,
    )?;

    let (fake, cai_url, cai_key, callback_base) = match &cfg.captchaai_api_key {
        Some(key) => (None, cfg.captchaai_base_url.clone(), key.clone(), cfg.public_url.clone().unwrap_or_default()),
        None => {
            let fake = FakeCaptchaAi::start(opts.fake.unwrap_or_default()).await?;
            let (url, key) = (fake.base_url(), fake.api_key());
            (Some(fake), url, key, cfg.public_url.clone().unwrap_or_else(|| base_url.clone()))
        }
    };
    let client = CaptchaAiClient::new(&cai_url, SecretString::from(cai_key.clone()), Duration::from_secs(15), None)?;
    let (secrets, _) = cfg.secrets()?;
    let mut relay = Relay::new(LocalParts {
        store: store.clone(),
        captchaai: client.clone(),
        api_key: SecretString::from(secrets.api_key.clone()),
        signing_secret: SecretString::from(secrets.signing_secret.clone()),
        callback_base_url: callback_base,
        clock: clock.clone(),
        dead_letters: Arc::new(queue.clone()),
        delivery_policy: delivery_settings(cfg).policy,
    });
    relay.callback.recent = relay_callback::RecentResults::new(cfg.recent_results);
    relay.api.relay_keys = relay_shared::store::RelayKeys::new(Some(relay.store.clone())).with_fixed(
        relay_shared::store::KeyGrant { name: "local".into(), pingback: cfg.pingback_form },
        &SecretString::from(secrets.api_key.clone()),
    );
    if let Some(g) = cfg.callback_grace_secs {
        relay.api.callback_grace = relay_shared::config::CallbackGrace::uniform(Duration::from_secs(g));
    }

    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = tokio::task::JoinSet::new();
    let relay = Arc::new(relay);
    let relay_store = relay.store.clone();
    let (submitter, submit_wake) = (relay.submitter("local-submitter"), relay.submit_wake.clone());
    let mut rx = stop_rx.clone();
    let plain_relay = relay.clone();
    workers.spawn(async move {
        let shutdown = async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        if let Err(e) = crate::serve(listener, plain_relay, shutdown).await {
            tracing::error!(event = "server_failed", error = relay_shared::telemetry::error_chain(&e));
        }
    });
    let (tls_url, ca_path) = match tls_listener {
        Some((listener, url, ca)) => {
            let mut rx = stop_rx.clone();
            workers.spawn(async move {
                let shutdown = async move {
                    let _ = rx.wait_for(|s| *s).await;
                };
                if let Err(e) = crate::tls::serve(listener, relay, shutdown).await {
                    tracing::error!(event = "tls_server_failed", error = relay_shared::telemetry::error_chain(&e));
                }
            });
            (Some(url), Some(ca))
        }
        None => (None, None),
    };
    let settings = relay_poller::PollerSettings::default();
    let poller = relay_poller::Deps {
        // The relay's store: its results wake the submitter too.
        store: relay_poller::Store::new(&relay_store),
        // The poller plans its time around its own read timeout.
        captchaai: CaptchaAiClient::new(&cai_url, SecretString::from(cai_key.clone()), settings.read_timeout, None)?,
        settings,
        owner: "local".into(),
        dead_letters: Arc::new(queue.clone()),
    };
    let every = Duration::from_secs(cfg.poll_interval_secs);
    let (mut rx, clock2) = (stop_rx.clone(), clock.clone());
    workers.spawn(async move {
        loop {
            // One invocation as the schedule would start it: it works through its minute while
            // tasks fall due, and ends at once when none will. On shutdown it is dropped where
            // it stands: its claims lapse with their leases and every read was counted.
            let deadline = clock2.now().plus(Duration::from_secs(55));
            tokio::select! {
                report = relay_poller::run_invocation(&poller, clock2.clone(), deadline) => {
                    tracing::debug!(?report, "local poller invocation");
                }
                _ = rx.wait_for(|s| *s) => break,
            }
            tokio::select! {
                _ = tokio::time::sleep(every) => {}
                _ = rx.wait_for(|s| *s) => break,
            }
        }
    });
    let (keys, _) = cfg.webhook_keys()?;
    let deliverer = Arc::new(
        relay_shared::delivery::Deliverer::new(
            store.clone(),
            relay_shared::delivery::KeySource::new(keys, Some(store.clone())),
            opts.delivery.unwrap_or_else(|| delivery_settings(cfg)),
        )?
        .with_wakeups(Arc::new(inbox)),
    );
    let (rx, clock3) = (stop_rx.clone(), clock.clone());
    workers.spawn(async move {
        // The pushes owed: each as its result is written, retries as they fall due, and a
        // catch-up pass over the index every 5 s (and when a dead worker's claim lapses: killed
        // mid-way, its claims come back and the pushes go out again, under the same webhook-id).
        let report = deliverer.run(clock3, inbox_rx, DELIVERY_CATCH_UP, rx).await;
        tracing::debug!(?report, "local delivery worker stopped");
    });
    // The submitter: woken when the API queues a task (a burst above the plan, a "no slot"
    // answer, a ban), and once a minute, as on AWS.
    let (wake, rx, clock4) = (submit_wake, stop_rx.clone(), clock.clone());
    workers.spawn(async move {
        relay_submitter::serve_local(&submitter, clock4, wake, rx).await;
    });
    // Nothing kept past its retention: tasks, dead letters, and the bytes they held.
    let sweep = crate::retention::Sweep {
        store: store.clone(),
        queue: queue.clone(),
        tasks_file: cfg.data_dir.join("tasks.sqlite"),
        retention,
        clock: clock.clone(),
    };
    workers.spawn(sweep.run(stop_rx.clone()));
    let (mut rx, q, st) = (stop_rx, queue.clone(), store.clone());
    let redrive_every = opts.redrive_every.unwrap_or(Duration::from_millis(500));
    workers.spawn(async move {
        loop {
            drain_dead_letters(&q, &st).await;
            tokio::select! {
                _ = tokio::time::sleep(redrive_every) => {}
                _ = rx.wait_for(|s| *s) => break,
            }
        }
    });
    Ok(Running {
        base_url,
        tls_url,
        ca_path,
        store,
        queue,
        fake,
        flaky,
        api_key: secrets.api_key,
        stop,
        workers,
        _db: db,
        _lock: lock,
    })
}

impl Running {
    /// Stops accepting, lets in-flight requests and the current tick finish, then returns.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.workers.join_next().await.is_some() {}
    }
}

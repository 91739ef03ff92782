//! The relay on one machine: the API and callback handlers on one HTTP server, the poller on
//! a timer and the redrive loop draining a durable on-disk dead-letter queue — the same
//! handler code the Lambdas run — over an embedded DynamoDB engine persisted to a file.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::local::{FlakyDynamo, LocalDynamo, client_for};
use relay_shared::store::{TaskStore, schema};
use relay_shared::time::{Clock, SystemClock};
use secrecy::SecretString;
use serde::Deserialize;

use crate::queue::DiskQueue;
use crate::{LocalParts, Relay};

/// The file in the data directory that names the running relay's store endpoint.
pub const ENDPOINT_FILE: &str = "dynamodb-endpoint";

/// How long a finished task is kept by default (`RETENTION_DAYS`, as on AWS).
pub const RETENTION: Duration = Duration::from_secs(7 * 86_400);

/// The task store of the relay running on `data_dir`, through the endpoint it wrote there (for
/// the operator commands and tests; [`crate::ops::open_store`] also opens a stopped relay's).
pub async fn running_store(data_dir: &std::path::Path) -> anyhow::Result<TaskStore> {
    let path = data_dir.join(ENDPOINT_FILE);
    let endpoint = std::fs::read_to_string(&path)
        .with_context(|| format!("no relay has run on {} (start `relay-local serve` first)", data_dir.display()))?;
    let client = client_for(endpoint.trim());
    if let Err(e) = client.describe_table().table_name("tasks").send().await {
        bail!(
            "the relay on {} does not answer at {} ({}): is it still starting? Try again in a moment",
            data_dir.display(),
            endpoint.trim(),
            relay_shared::telemetry::error_chain(&e)
        );
    }
    Ok(TaskStore::new(client, "tasks", RETENTION))
}

/// How the relay's own log lines are written (`RELAY_LOG_FORMAT`, or `log_format` in the
/// config file): plain text for people (coloured only on a terminal), or JSON lines for
/// machines, as the Lambdas write them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

impl LogFormat {
    /// Reads `RELAY_LOG_FORMAT` (unset: text).
    pub fn from_env(value: Option<&str>) -> anyhow::Result<Self> {
        match value.map(str::trim) {
            None | Some("") | Some("text") => Ok(Self::Text),
            Some("json") => Ok(Self::Json),
            Some(other) => bail!("RELAY_LOG_FORMAT must be text or json, got `{other}`"),
        }
    }
}

/// Values the README and earlier versions used as examples: never accepted with a real key.
pub const PUBLISHED_DEFAULTS: [&str; 2] = ["local-dev-key", "local-dev-signing-secret"];

/// The relay's own secrets, given or made.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct LocalSecrets {
    pub api_key: String,
    pub signing_secret: String,
}

impl LocalConfig {
    /// How long tasks and results are kept (`RETENTION_DAYS`).
    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.retention_days.max(1) * 86_400)
    }

    /// Where the webhook signing secret is kept when `WEBHOOK_SECRETS` is not given.
    pub fn webhook_secrets_path(&self) -> PathBuf {
        self.data_dir.join("webhook-secrets")
    }

    /// The secrets pushes are signed with: given, or made once and kept (owner-only).
    pub fn webhook_keys(&self) -> anyhow::Result<(relay_shared::webhook::SigningKeys, String)> {
        use relay_shared::webhook::{SigningKeys, WebhookSecret};
        let text = match &self.webhook_secrets {
            Some(t) => t.clone(),
            None => {
                let path = self.webhook_secrets_path();
                match std::fs::read_to_string(&path) {
                    Ok(t) => t.trim().to_owned(),
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        let (_, text) = WebhookSecret::generate();
                        write_private(&path, &text)?;
                        text
                    }
                    Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
                }
            }
        };
        let keys = SigningKeys::parse_list(&text).context("the webhook secrets")?;
        Ok((keys, text))
    }

    /// Where secrets that were not given are kept.
    pub fn secrets_path(&self) -> PathBuf {
        self.data_dir.join("secrets.json")
    }

    /// The configured secrets; any not given come from `<data_dir>/secrets.json`, which is
    /// created (owner-only) with random values the first time. Returns them and whether the file
    /// was used.
    pub fn secrets(&self) -> anyhow::Result<(LocalSecrets, bool)> {
        if let (Some(api_key), Some(signing_secret)) = (&self.api_key, &self.signing_secret) {
            return Ok((LocalSecrets { api_key: api_key.clone(), signing_secret: signing_secret.clone() }, false));
        }
        let path = self.secrets_path();
        let stored: LocalSecrets = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text).with_context(|| format!("{} is not valid", path.display()))?,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                let random = || format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple());
                let made = LocalSecrets { api_key: random(), signing_secret: random() };
                write_private(&path, &serde_json::to_string_pretty(&made)?)?;
                made
            }
            Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
        };
        Ok((
            LocalSecrets {
                api_key: self.api_key.clone().unwrap_or(stored.api_key),
                signing_secret: self.signing_secret.clone().unwrap_or(stored.signing_secret),
            },
            true,
        ))
    }
}

/// Writes a file only its owner can read.
pub(crate) fn write_private(path: &std::path::Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create_new(true);
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(&mut opts, 0o600);
    let mut f = opts.open(path).with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes()).and_then(|()| f.sync_all()).with_context(|| format!("cannot write {}", path.display()))
}

/// Settings of the local relay: from a JSON file, then the environment on top.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct LocalConfig {
    /// Where the HTTP server listens (`RELAY_BIND`).
    pub bind: String,
    /// Where the same routes are served over HTTPS (`RELAY_TLS_BIND`, e.g. 127.0.0.1:8443);
    /// unset: no HTTPS. The certificate comes from a CA local mode makes and keeps in
    /// `<data_dir>/tls/` (see [`crate::tls`]).
    pub tls_bind: Option<String>,
    /// Names the certificate covers besides localhost, 127.0.0.1 and ::1 (`RELAY_TLS_HOSTS`,
    /// comma-separated).
    pub tls_hosts: Vec<String>,
    /// Where the task table and the dead-letter queue are kept (`RELAY_DATA_DIR`).
    pub data_dir: PathBuf,
    /// Bearer key for `/tasks` (`RELAY_API_KEY`). Unset: a random one, kept in
    /// `<data_dir>/secrets.json`.
    pub api_key: Option<String>,
    /// HMAC secret for callback paths (`CALLBACK_SIGNING_SECRET`). Unset: a random one, kept in
    /// `<data_dir>/secrets.json`.
    pub signing_secret: Option<String>,
    /// A real CaptchaAI key (`CAPTCHAAI_API_KEY`); without it the built-in fake is used.
    pub captchaai_api_key: Option<String>,
    /// (`CAPTCHAAI_BASE_URL`)
    pub captchaai_base_url: String,
    /// Public base URL CaptchaAI can reach for pingbacks (`RELAY_PUBLIC_URL`); required with a
    /// real key.
    pub public_url: Option<String>,
    /// Seconds between poller ticks (`POLL_INTERVAL_SECS`).
    pub poll_interval_secs: u64,
    /// Seconds a callback gets before the poller reads res.php (`CALLBACK_GRACE_SECS`).
    pub callback_grace_secs: Option<u64>,
    /// Results remembered so repeated pingbacks are answered without the store
    /// (`CALLBACK_RECENT_RESULTS`; 0 turns it off).
    pub recent_results: usize,
    /// Lets owner callback URLs (`callback_url`, `pingback`) point at loopback and use plain
    /// http (`RELAY_WEBHOOK_ALLOW_LOOPBACK=1`), for a receiver on this machine. Off: https to
    /// public addresses only, as on AWS. Private, link-local and metadata addresses are refused
    /// either way.
    pub webhook_allow_loopback: bool,
    /// The secrets pushes are signed with (`WEBHOOK_SECRETS`: `whsec_…`, or
    /// `whsec_new,whsec_old` while rotating). Unset: a random one, kept in
    /// `<data_dir>/webhook-secrets`.
    pub webhook_secrets: Option<String>,
    /// `text` (default) or `json` (`RELAY_LOG_FORMAT`): see [`LogFormat`].
    pub log_format: LogFormat,
    /// Days a task and its result are kept (`RETENTION_DAYS`, default 7, as on AWS): past them
    /// no read hands it out, and the sweep deletes it and the bytes it held (see
    /// [`crate::retention`]).
    pub retention_days: u64,
    /// How results of tasks submitted through `/in.php` with the API key are pushed to their
    /// `pingback` (`RELAY_PINGBACK_FORM`): `get`, CaptchaAI's `GET ?id=…&code=…` (default), or
    /// `post`, 2captcha's form. Keys made with `relay-local keys create` carry their own.
    pub pingback_form: relay_shared::domain::PingbackForm,
}

impl Default for LocalConfig {
    fn default() -> Self {
        Self {
            bind: "127.0.0.1:8080".into(),
            tls_bind: None,
            tls_hosts: Vec::new(),
            data_dir: PathBuf::from("relay-data"),
            api_key: None,
            signing_secret: None,
            captchaai_api_key: None,
            captchaai_base_url: "https://ocr.captchaai.com".into(),
            public_url: None,
            poll_interval_secs: 10,
            callback_grace_secs: None,
            recent_results: relay_callback::RECENT_RESULTS,
            webhook_allow_loopback: false,
            webhook_secrets: None,
            log_format: LogFormat::Text,
            pingback_form: relay_shared::domain::PingbackForm::Get,
            retention_days: 7,
        }
    }
}

impl LocalConfig {
    /// Reads the file (if any), applies the environment, and checks every value.
    pub fn load(file: Option<&std::path::Path>, env: &dyn Fn(&str) -> Option<String>) -> anyhow::Result<Self> {
        let mut c = match file {
            Some(p) => {
                let text =
                    std::fs::read_to_string(p).with_context(|| format!("cannot read config file {}", p.display()))?;
                serde_json::from_str(&text).with_context(|| format!("config file {} is not valid", p.display()))?
            }
            None => Self::default(),
        };
        let num = |name: &str, v: String| -> anyhow::Result<u64> {
            v.trim().parse().with_context(|| format!("{name} must be a whole number of seconds, got `{v}`"))
        };
        if let Some(v) = env("RELAY_BIND") {
            c.bind = v;
        }
        if let Some(v) = env("RELAY_TLS_BIND") {
            // Set but empty: HTTPS off.
            c.tls_bind = Some(v.trim().to_owned()).filter(|b| !b.is_empty());
        }
        if let Some(v) = env("RELAY_TLS_HOSTS") {
            c.tls_hosts = v.split(',').map(str::trim).filter(|h| !h.is_empty()).map(str::to_owned).collect();
        }
        if let Some(v) = env("RELAY_DATA_DIR") {
            c.data_dir = v.into();
        }
        if let Some(v) = env("RELAY_API_KEY") {
            c.api_key = Some(v);
        }
        if let Some(v) = env("CALLBACK_SIGNING_SECRET") {
            c.signing_secret = Some(v);
        }
        if let Some(v) = env("CAPTCHAAI_API_KEY") {
            c.captchaai_api_key = Some(v);
        }
        if let Some(v) = env("CAPTCHAAI_BASE_URL") {
            c.captchaai_base_url = v;
        }
        if let Some(v) = env("RELAY_PUBLIC_URL") {
            c.public_url = Some(v);
        }
        if let Some(v) = env("POLL_INTERVAL_SECS") {
            c.poll_interval_secs = num("POLL_INTERVAL_SECS", v)?;
        }
        if let Some(v) = env("CALLBACK_GRACE_SECS") {
            c.callback_grace_secs = Some(num("CALLBACK_GRACE_SECS", v)?);
        }
        if let Some(v) = env("RELAY_WEBHOOK_ALLOW_LOOPBACK") {
            c.webhook_allow_loopback = match v.trim() {
                "1" | "true" | "yes" => true,
                "0" | "false" | "no" | "" => false,
                other => bail!("RELAY_WEBHOOK_ALLOW_LOOPBACK must be 1 or 0, got `{other}`"),
            };
        }
        if let Some(v) = env("WEBHOOK_SECRETS") {
            c.webhook_secrets = Some(v);
        }
        if let Some(v) = env("RELAY_LOG_FORMAT") {
            c.log_format = LogFormat::from_env(Some(&v))?;
        }
        if let Some(v) = env("RETENTION_DAYS") {
            c.retention_days = v
                .trim()
                .parse()
                .ok()
                .filter(|d| *d >= 1)
                .with_context(|| format!("RETENTION_DAYS must be a whole number of days, at least 1, got `{v}`"))?;
        }
        if let Some(v) = env("RELAY_PINGBACK_FORM") {
            c.pingback_form = relay_shared::domain::PingbackForm::parse(&v)
                .map_err(|e| anyhow::anyhow!("RELAY_PINGBACK_FORM: {}", e.0))?;
        }
        if let Some(v) = env("CALLBACK_RECENT_RESULTS") {
            c.recent_results = v
                .trim()
                .parse()
                .with_context(|| format!("CALLBACK_RECENT_RESULTS must be a whole number (0: off), got `{v}`"))?;
        }
        c.check()?;
        Ok(c)
    }

    fn check(&self) -> anyhow::Result<()> {
        let bind = self
            .bind
            .parse::<SocketAddr>()
            .with_context(|| format!("bind `{}` is not an address like 127.0.0.1:8080", self.bind))?;
        if let Some(tls_bind) = &self.tls_bind {
            let addr = tls_bind.parse::<SocketAddr>().with_context(|| {
                format!("tls_bind (RELAY_TLS_BIND) `{tls_bind}` is not an address like 127.0.0.1:8443")
            })?;
            if addr == bind && addr.port() != 0 {
                bail!(
                    "tls_bind (RELAY_TLS_BIND) `{tls_bind}` is also bind (RELAY_BIND): HTTPS needs a port of its own"
                );
            }
        } else if !self.tls_hosts.is_empty() {
            bail!("tls_hosts (RELAY_TLS_HOSTS) is set but tls_bind (RELAY_TLS_BIND) is not: set it to serve HTTPS");
        }
        for host in &self.tls_hosts {
            crate::tls::check_host(host).context("tls_hosts (RELAY_TLS_HOSTS)")?;
        }
        if self.captchaai_api_key.is_some() {
            // Anyone who has read the README knows these: with a real (paid) account behind the
            // relay they would let strangers submit tasks or forge pingbacks.
            for (name, value) in [
                ("api_key (RELAY_API_KEY)", &self.api_key),
                ("signing_secret (CALLBACK_SIGNING_SECRET)", &self.signing_secret),
            ] {
                if value.as_deref().is_some_and(|v| PUBLISHED_DEFAULTS.contains(&v.trim())) {
                    bail!(
                        "{name} is a published example value; with a real CaptchaAI key it would let anyone submit paid \
                         tasks or forge results. Unset it (a random one is made and kept in the data dir) or choose your own"
                    );
                }
            }
        }
        if self.api_key.as_ref().is_some_and(|k| k.trim().len() < 16) {
            bail!("api_key (RELAY_API_KEY) must be at least 16 characters (or unset: a random one is made)");
        }
        if self.signing_secret.as_ref().is_some_and(|s| s.len() < 16) {
            bail!(
                "signing_secret (CALLBACK_SIGNING_SECRET) must be at least 16 characters (or unset: a random one is made)"
            );
        }
        if let Some(w) = &self.webhook_secrets {
            relay_shared::webhook::SigningKeys::parse_list(w).context("webhook_secrets (WEBHOOK_SECRETS)")?;
        }
        if self.poll_interval_secs == 0 {
            bail!("poll_interval_secs (POLL_INTERVAL_SECS) must be at least 1");
        }
        if self.callback_grace_secs.is_some_and(|g| g < 5) {
            bail!("callback_grace_secs (CALLBACK_GRACE_SECS) must be at least 5 (the protocol's first-poll minimum)");
        }
        for (name, url) in
            [("captchaai_base_url", Some(&self.captchaai_base_url)), ("public_url", self.public_url.as_ref())]
        {
            if let Some(u) = url
                && !(u.starts_with("http://") || u.starts_with("https://"))
            {
                bail!("{name} `{u}` is not an http(s) URL");
            }
        }
        if self.captchaai_api_key.is_some() && self.public_url.is_none() {
            bail!("with a real CaptchaAI key, set public_url (RELAY_PUBLIC_URL): CaptchaAI must reach /callback on it");
        }
        Ok(())
    }
}

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
    relay.api.relay_keys = relay_shared::store::RelayKeys::new(Some(relay.api.store.clone())).with_fixed(
        relay_shared::store::KeyGrant { name: "local".into(), pingback: cfg.pingback_form },
        &SecretString::from(secrets.api_key.clone()),
    );
    if let Some(g) = cfg.callback_grace_secs {
        relay.api.callback_grace = relay_shared::config::CallbackGrace::uniform(Duration::from_secs(g));
    }

    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    let mut workers = tokio::task::JoinSet::new();
    let relay = Arc::new(relay);
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
        store: submitter.store.clone(),
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

/// The poisoned dead letters of a local relay, one line each: the queue id and what the letter
/// holds, its solution redacted unless `reveal` (what `relay-local dead-letters list` prints,
/// after the id).
pub fn list_poisoned(queue: &DiskQueue, reveal: bool) -> anyhow::Result<Vec<(i64, String)>> {
    Ok(queue.poisoned_letters()?.iter().map(|p| (p.id, crate::ops::describe_letter(p, reveal))).collect())
}

/// Receives of a local dead letter before it is poisoned: the template's `MaxReceiveCount`
/// default (half of them fast, while its token may live).
pub const DEAD_LETTER_MAX_RECEIVES: u32 = 12;

/// Batches one pass of the redrive loop takes at most (10 letters each): a pass drains a
/// backlog — thousands of letters after a store outage — instead of 10 letters every 5 s, which
/// left results recorded long after their tokens died. A letter that fails again is hidden by
/// its pacing, so a pass does not see it twice.
pub const DRAIN_BATCHES_PER_PASS: usize = 500;

/// One pass of the redrive loop over the on-disk dead-letter queue: until nothing is visible
/// (or [`DRAIN_BATCHES_PER_PASS`]). Letters are applied one at a time.
pub async fn drain_dead_letters(queue: &DiskQueue, store: &TaskStore) {
    for _ in 0..DRAIN_BATCHES_PER_PASS {
        if drain_batch(queue, store).await < 10 {
            return;
        }
    }
}

/// One batch of up to 10 letters; how many it received.
async fn drain_batch(queue: &DiskQueue, store: &TaskStore) -> usize {
    use relay_shared::telemetry::error_chain;
    let q = queue.clone();
    let batch = match tokio::task::spawn_blocking(move || q.receive(10)).await {
        Ok(Ok(batch)) => batch,
        Ok(Err(e)) => {
            tracing::error!(event = "dead_letter_receive_failed", error = error_chain(&e));
            return 0;
        }
        Err(e) => {
            tracing::error!(event = "dead_letter_receive_failed", error = error_chain(&e));
            return 0;
        }
    };
    let received = batch.len();
    for m in batch {
        let outcome = relay_redrive::redrive_one(store, &m.body).await;
        let q = queue.clone();
        let id = m.id;
        let done = tokio::task::spawn_blocking(move || match outcome {
            relay_redrive::Redriven::Applied | relay_redrive::Redriven::AlreadyRecorded => q.delete(&m).map(|_| ()),
            relay_redrive::Redriven::Permanent(_) => q.poison(&m).map(|_| ()),
            // Left leased: it comes back within seconds while its token may live, else when
            // its visibility lapses.
            relay_redrive::Redriven::Retry(_) => q.retry_paced(&m).map(|_| ()),
        })
        .await;
        // Either way the letter stays in the queue and comes back when its lease lapses.
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(event = "dead_letter_settle_failed", id, error = error_chain(&e)),
            Err(e) => tracing::error!(event = "dead_letter_settle_failed", id, error = error_chain(&e)),
        }
    }
    received
}

impl Running {
    /// Stops accepting, lets in-flight requests and the current tick finish, then returns.
    pub async fn shutdown(mut self) {
        let _ = self.stop.send(true);
        while self.workers.join_next().await.is_some() {}
    }
}

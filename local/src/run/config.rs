//! The local relay's settings: a JSON file, then the environment on top, every value checked.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, bail};
use serde::Deserialize;

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
    /// How long tasks and results are kept (`RETENTION_DAYS`).
    pub fn retention(&self) -> Duration {
        Duration::from_secs(self.retention_days.max(1) * 86_400)
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

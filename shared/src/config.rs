//! Configuration, read once at cold start into typed structs. A missing or malformed setting
//! fails fast with a message naming it. Nothing else in the code reads the environment.

use std::collections::HashMap;
use std::str::FromStr;
use std::time::Duration;

use secrecy::SecretString;

use crate::domain::{CaptchaKind, TaskRef};
use crate::secrets::SecretSource;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    #[error("missing setting {0}")]
    Missing(String),
    #[error("setting {name} is invalid: {reason}")]
    Invalid { name: String, reason: String },
    #[error(
        "missing secret: set {0} (plain value, local use) or {0}_PARAM (an SSM parameter name; `/aws/reference/secretsmanager/<id>` reads Secrets Manager)"
    )]
    MissingSecret(String),
}

/// Raw settings, by name. Built from the process environment or, in tests, from pairs.
#[derive(Debug, Clone, Default)]
pub struct Settings(HashMap<String, String>);

impl Settings {
    pub fn from_env() -> Self {
        Self(std::env::vars().collect())
    }

    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        Self(pairs.into_iter().map(|(k, v)| (k.to_owned(), v.to_owned())).collect())
    }

    pub fn with(mut self, name: &str, value: &str) -> Self {
        self.0.insert(name.to_owned(), value.to_owned());
        self
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.0.get(name).map(String::as_str).filter(|v| !v.trim().is_empty())
    }

    pub fn required(&self, name: &str) -> Result<String, ConfigError> {
        self.get(name).map(str::to_owned).ok_or_else(|| ConfigError::Missing(name.to_owned()))
    }

    pub fn optional(&self, name: &str) -> Option<String> {
        self.get(name).map(str::to_owned)
    }

    pub fn parse_or<T: FromStr>(&self, name: &str, default: T) -> Result<T, ConfigError>
    where
        T::Err: std::fmt::Display,
    {
        match self.get(name) {
            None => Ok(default),
            Some(v) => v
                .trim()
                .parse()
                .map_err(|e: T::Err| ConfigError::Invalid { name: name.to_owned(), reason: format!("`{v}`: {e}") }),
        }
    }

    pub fn url(&self, name: &str) -> Result<String, ConfigError> {
        let v = self.required(name)?;
        check_url(name, &v)?;
        Ok(v.trim_end_matches('/').to_owned())
    }

    pub fn url_or(&self, name: &str, default: &str) -> Result<String, ConfigError> {
        match self.get(name) {
            None => Ok(default.to_owned()),
            Some(_) => self.url(name),
        }
    }

    /// A secret given inline (`NAME`) or by reference (`NAME_PARAM`).
    pub fn secret(&self, name: &str) -> Result<SecretSource, ConfigError> {
        if let Some(v) = self.get(name) {
            return Ok(SecretSource::Inline(SecretString::from(v.to_owned())));
        }
        let param = format!("{name}_PARAM");
        match self.get(&param) {
            Some(p) => Ok(SecretSource::SsmParameter(p.to_owned())),
            None => Err(ConfigError::MissingSecret(name.to_owned())),
        }
    }
}

fn check_url(name: &str, v: &str) -> Result<(), ConfigError> {
    if v.starts_with("https://") || v.starts_with("http://") {
        Ok(())
    } else {
        Err(ConfigError::Invalid { name: name.to_owned(), reason: format!("`{v}` is not an http(s) URL") })
    }
}

/// The due-for-poll and due-for-delivery indexes are spread over this many partitions by
/// default (`poll_shard` / `dlv_shard` 0..N), so no index key runs hot: each task writes an
/// index key about three times, so 8 keys take ~2,600 new tasks/s before one reaches
/// DynamoDB's 1,000 writes/s per partition key (docs/capacity.md). `POLL_SHARDS` sets it.
pub const DEFAULT_POLL_SHARDS: u8 = 8;
/// The most shards a deployment may use (the readers query every one of them).
pub const MAX_POLL_SHARDS: u8 = 64;

/// How the sparse indexes are spread. Writers put a task in shard `ref mod write`; readers
/// cover `0..max(write, previous)`. Lowering the count is therefore safe in two steps: deploy
/// the new count with `previous` = the old one (new tasks go to the new shards; entries
/// written under the old count stay where they are, still read, until their task ends — a
/// parked push until it is replayed or expires), then, once no entry is left at or above the
/// new count (`relay-ops shards`), set `previous` back to 0. Raising the count needs no second
/// step: the readers cover every shard the writers use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shards {
    pub write: u8,
    pub previous: u8,
}

impl Default for Shards {
    fn default() -> Self {
        Self { write: DEFAULT_POLL_SHARDS, previous: 0 }
    }
}

impl Shards {
    /// The shard `task_ref` is written to.
    pub fn of(&self, task_ref: &TaskRef) -> u8 {
        task_ref.shard(self.write)
    }

    /// How many shards a reader covers (`0..read()`).
    pub fn read(&self) -> u8 {
        self.write.max(self.previous).max(1)
    }
}

/// The most count items the queue's counts spread over (`QUEUE_SHARDS`).
pub const MAX_QUEUE_SHARDS: u8 = 32;
/// `QUEUE_SHARDS` unset: 4 count items, ~4,000 admissions a second (docs/capacity.md).
pub const DEFAULT_QUEUE_SHARDS: u8 = 4;

/// Where tasks are stored and for how long.
#[derive(Debug, Clone)]
pub struct StoreConfig {
    pub table: String,
    pub retention: Duration,
    /// How the sparse indexes are spread (`POLL_SHARDS`, `POLL_SHARDS_PREVIOUS`).
    pub shards: Shards,
    /// How many items the submit queue's counts spread over (`QUEUE_SHARDS`).
    pub queue_shards: u8,
}

impl StoreConfig {
    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        let days: u64 = s.parse_or("RETENTION_DAYS", 7)?;
        if days == 0 {
            return Err(ConfigError::Invalid { name: "RETENTION_DAYS".into(), reason: "must be at least 1".into() });
        }
        let max = MAX_POLL_SHARDS;
        let write: u8 = s.parse_or("POLL_SHARDS", DEFAULT_POLL_SHARDS)?;
        if !(1..=max).contains(&write) {
            return Err(ConfigError::Invalid { name: "POLL_SHARDS".into(), reason: format!("must be 1 to {max}") });
        }
        let previous: u8 = s.parse_or("POLL_SHARDS_PREVIOUS", 0)?;
        if previous > max {
            return Err(ConfigError::Invalid {
                name: "POLL_SHARDS_PREVIOUS".into(),
                reason: format!("must be 0 (no change under way) to {max}"),
            });
        }
        let qmax = MAX_QUEUE_SHARDS;
        let queue_shards: u8 = s.parse_or("QUEUE_SHARDS", DEFAULT_QUEUE_SHARDS)?;
        if !(1..=qmax).contains(&queue_shards) {
            return Err(ConfigError::Invalid { name: "QUEUE_SHARDS".into(), reason: format!("must be 1 to {qmax}") });
        }
        Ok(Self {
            table: s.required("TABLE_NAME")?,
            retention: Duration::from_secs(days * 86_400),
            shards: Shards { write, previous },
            queue_shards,
        })
    }
}

/// How the CaptchaAI API is reached.
#[derive(Debug, Clone)]
pub struct CaptchaAiConfig {
    pub base_url: String,
    pub api_key: SecretSource,
    pub timeout: Duration,
    pub soft_id: Option<u32>,
}

impl CaptchaAiConfig {
    pub const DEFAULT_BASE_URL: &'static str = "https://ocr.captchaai.com";

    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        Ok(Self {
            base_url: s.url_or("CAPTCHAAI_BASE_URL", Self::DEFAULT_BASE_URL)?,
            api_key: s.secret("CAPTCHAAI_API_KEY")?,
            timeout: Duration::from_millis(s.parse_or("CAPTCHAAI_TIMEOUT_MS", 15_000)?),
            soft_id: s.optional("CAPTCHAAI_SOFT_ID").map(|_| s.parse_or("CAPTCHAAI_SOFT_ID", 0)).transpose()?,
        })
    }
}

/// How long a callback gets before the poller reads res.php. By default per kind, derived from
/// its solve time ([`CaptchaKind::first_read_after`]: image 25 s, Turnstile 20 s, reCAPTCHA and
/// hCaptcha 65 s); `CALLBACK_GRACE_SECS` sets one value for every kind, and
/// `CALLBACK_GRACE_SECS_<KIND>` one kind's. Never under the protocol's 5 s.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CallbackGrace {
    /// `None`: each kind's own default.
    default: Option<Duration>,
    per_kind: Vec<(CaptchaKind, Duration)>,
}

impl CallbackGrace {
    pub const MIN: Duration = Duration::from_secs(5);

    pub fn uniform(d: Duration) -> Self {
        Self { default: Some(d.max(Self::MIN)), per_kind: Vec::new() }
    }

    #[must_use]
    pub fn with(mut self, kind: CaptchaKind, d: Duration) -> Self {
        self.per_kind.retain(|(k, _)| *k != kind);
        self.per_kind.push((kind, d.max(Self::MIN)));
        self
    }

    pub fn for_kind(&self, kind: CaptchaKind) -> Duration {
        self.per_kind
            .iter()
            .find(|(k, _)| *k == kind)
            .map(|(_, d)| *d)
            .or(self.default)
            .unwrap_or_else(|| kind.first_read_after())
    }

    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        let secs = |name: &str, default: u64| -> Result<Duration, ConfigError> {
            let v: u64 = s.parse_or(name, default)?;
            if Duration::from_secs(v) < Self::MIN {
                return Err(ConfigError::Invalid {
                    name: name.to_owned(),
                    reason: "must be at least 5 seconds".into(),
                });
            }
            Ok(Duration::from_secs(v))
        };
        let mut grace = match s.optional("CALLBACK_GRACE_SECS") {
            Some(_) => Self::uniform(secs("CALLBACK_GRACE_SECS", 0)?),
            None => Self::default(),
        };
        for kind in CaptchaKind::ALL {
            let name = format!("CALLBACK_GRACE_SECS_{}", kind.as_str().to_ascii_uppercase());
            if s.optional(&name).is_some() {
                grace = grace.with(kind, secs(&name, 0)?);
            }
        }
        Ok(grace)
    }
}

/// Who may call `/tasks`.
#[derive(Debug, Clone)]
pub enum AuthMode {
    /// API Gateway checked SigV4 (IAM authorisation on the route); the handler checks that
    /// it did.
    Iam,
    /// `Authorization: Bearer <key>`, compared in constant time.
    ApiKey(SecretSource),
}

impl AuthMode {
    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        match s.optional("AUTH_MODE").as_deref().unwrap_or("api_key") {
            "iam" => Ok(Self::Iam),
            "api_key" => Ok(Self::ApiKey(s.secret("RELAY_API_KEY")?)),
            other => Err(ConfigError::Invalid {
                name: "AUTH_MODE".into(),
                reason: format!("`{other}`: expected `iam` or `api_key`"),
            }),
        }
    }
}

/// The API function's settings.
#[derive(Debug, Clone)]
pub struct ApiConfig {
    pub store: StoreConfig,
    pub captchaai: CaptchaAiConfig,
    pub auth: AuthMode,
    pub signing_secret: SecretSource,
    /// Public base URL under which `/callback/{ref}/{sig}` is reachable. Unset: the API's
    /// own URL, taken from each request (the callback route is on the same API).
    pub callback_base_url: Option<String>,
    /// How long a callback gets before the poller asks res.php.
    pub callback_grace: CallbackGrace,
}

impl ApiConfig {
    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        Ok(Self {
            store: StoreConfig::from_settings(s)?,
            captchaai: CaptchaAiConfig::from_settings(s)?,
            auth: AuthMode::from_settings(s)?,
            signing_secret: s.secret("CALLBACK_SIGNING_SECRET")?,
            callback_base_url: s.optional("CALLBACK_BASE_URL").map(|_| s.url("CALLBACK_BASE_URL")).transpose()?,
            callback_grace: CallbackGrace::from_settings(s)?,
        })
    }
}

/// The callback function's settings.
#[derive(Debug, Clone)]
pub struct CallbackConfig {
    pub store: StoreConfig,
    pub signing_secret: SecretSource,
    /// SQS queue for results that could not be stored.
    pub dead_letter_queue_url: String,
}

impl CallbackConfig {
    pub fn from_settings(s: &Settings) -> Result<Self, ConfigError> {
        Ok(Self {
            store: StoreConfig::from_settings(s)?,
            signing_secret: s.secret("CALLBACK_SIGNING_SECRET")?,
            dead_letter_queue_url: s.url("DEAD_LETTER_QUEUE_URL")?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> Settings {
        Settings::from_pairs([
            ("TABLE_NAME", "tasks"),
            ("CAPTCHAAI_API_KEY", "k"),
            ("RELAY_API_KEY", "a"),
            ("CALLBACK_SIGNING_SECRET", "s"),
            ("CALLBACK_BASE_URL", "https://cb.example/"),
        ])
    }

    #[test]
    fn defaults_fill_everything_optional() {
        let c = ApiConfig::from_settings(&full()).expect("valid");
        assert_eq!(c.store.retention, Duration::from_secs(7 * 86_400));
        assert_eq!(c.captchaai.base_url, "https://ocr.captchaai.com");
        assert_eq!(c.callback_base_url.as_deref(), Some("https://cb.example"));
        assert_eq!(c.callback_grace.for_kind(CaptchaKind::Turnstile), Duration::from_secs(20), "from its solve time");
        assert_eq!(c.callback_grace.for_kind(CaptchaKind::RecaptchaV2), Duration::from_secs(65));
        assert_eq!(c.callback_grace.for_kind(CaptchaKind::Image), Duration::from_secs(25));
        assert!(matches!(c.auth, AuthMode::ApiKey(SecretSource::Inline(_))));
    }

    #[test]
    fn missing_setting_is_named() {
        let s = Settings::from_pairs([("CAPTCHAAI_API_KEY", "k")]);
        let err = ApiConfig::from_settings(&s).expect_err("no table");
        assert_eq!(err, ConfigError::Missing("TABLE_NAME".into()));
        assert!(err.to_string().contains("TABLE_NAME"));
    }

    #[test]
    fn missing_secret_names_both_ways_to_give_it() {
        let s = Settings::from_pairs([("TABLE_NAME", "t")]);
        let err = CallbackConfig::from_settings(&s).expect_err("no secret").to_string();
        assert!(err.contains("CALLBACK_SIGNING_SECRET") && err.contains("_PARAM"), "{err}");
    }

    #[test]
    fn secret_by_reference_and_iam_mode() {
        let s =
            full().with("AUTH_MODE", "iam").with("CAPTCHAAI_API_KEY", "").with("CAPTCHAAI_API_KEY_PARAM", "/relay/key");
        let c = ApiConfig::from_settings(&s).expect("valid");
        assert!(matches!(c.auth, AuthMode::Iam));
        assert!(matches!(&c.captchaai.api_key, SecretSource::SsmParameter(p) if p == "/relay/key"));
    }

    #[test]
    fn callback_grace_is_overridable_per_kind() {
        let c = ApiConfig::from_settings(
            &full().with("CALLBACK_GRACE_SECS", "90").with("CALLBACK_GRACE_SECS_TURNSTILE", "30"),
        )
        .expect("valid");
        assert_eq!(c.callback_grace.for_kind(CaptchaKind::Turnstile), Duration::from_secs(30));
        assert_eq!(c.callback_grace.for_kind(CaptchaKind::RecaptchaV2), Duration::from_secs(90));
        let err = ApiConfig::from_settings(&full().with("CALLBACK_GRACE_SECS_IMAGE", "2")).expect_err("too short");
        assert!(err.to_string().contains("CALLBACK_GRACE_SECS_IMAGE"), "{err}");
    }

    #[test]
    fn malformed_values_are_named_with_the_reason() {
        for (name, value) in [
            ("RETENTION_DAYS", "soon"),
            ("RETENTION_DAYS", "0"),
            ("AUTH_MODE", "open"),
            ("CALLBACK_BASE_URL", "ftp://x"),
        ] {
            let err = ApiConfig::from_settings(&full().with(name, value)).expect_err(name);
            assert!(matches!(&err, ConfigError::Invalid { name: n, .. } if n == name), "{name}: {err}");
        }
    }
}

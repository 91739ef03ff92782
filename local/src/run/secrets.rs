//! The relay's own secrets and the webhook signing secrets: given in the config, or made once
//! and kept owner-only in the data directory.

use std::path::PathBuf;

use anyhow::Context;
use serde::Deserialize;

use super::config::LocalConfig;
use crate::data_dir::write_private;

/// The relay's own secrets, given or made.
#[derive(Debug, Clone, serde::Serialize, Deserialize)]
pub struct LocalSecrets {
    pub api_key: String,
    pub signing_secret: String,
}

impl LocalConfig {
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

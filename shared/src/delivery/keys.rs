//! The secrets pushes are signed with, per owner, cached for a minute.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::store::{StoreError, TaskStore};
use crate::webhook::SigningKeys;

/// The secrets pushes are signed with: per owner (kept in the table by `relay-ops webhooks
/// rotate`), else the deployment's own (`WEBHOOK_SECRETS`). Looked up once a minute per owner.
pub struct KeySource {
    default: SigningKeys,
    store: Option<TaskStore>,
    cache: Mutex<HashMap<String, (Instant, SigningKeys)>>,
}

impl std::fmt::Debug for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySource(<secrets>)")
    }
}

impl KeySource {
    const FRESH: Duration = Duration::from_secs(60);

    pub fn new(default: SigningKeys, store: Option<TaskStore>) -> Self {
        Self { default, store, cache: Mutex::new(HashMap::new()) }
    }

    pub async fn keys(&self, owner: &str) -> Result<SigningKeys, StoreError> {
        let Some(store) = &self.store else { return Ok(self.default.clone()) };
        if let Some((at, keys)) = self.cache.lock().map_err(|_| poisoned())?.get(owner)
            && at.elapsed() < Self::FRESH
        {
            return Ok(keys.clone());
        }
        let keys = match store.pushes().webhook_secrets(owner).await? {
            // A malformed stored value is an operator's mistake: sign with the deployment's
            // secrets (the owner's verification then fails visibly) rather than not at all.
            Some(text) => SigningKeys::parse_list(&text).unwrap_or_else(|e| {
                tracing::error!(event = "webhook_secret_invalid", owner, error = %e);
                self.default.clone()
            }),
            None => self.default.clone(),
        };
        self.cache.lock().map_err(|_| poisoned())?.insert(owner.to_owned(), (Instant::now(), keys.clone()));
        Ok(keys)
    }
}

fn poisoned() -> StoreError {
    StoreError::Rejected("webhook key cache lock poisoned".into())
}

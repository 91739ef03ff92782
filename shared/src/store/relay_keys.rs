//! Relay keys: the `key` a 2captcha-style client sends to the compat routes (`/in.php`,
//! `/res.php`). SDKs cannot sign SigV4, so these routes take a key, as 2captcha does: one or
//! more named keys of the one owner of this deployment, kept in the task table as their SHA-256
//! digests (`pk = relaykey#<hex digest>`), never as the key itself.
//!
//! A check is one GetItem by the digest of the key presented. No stored key's bytes are ever
//! compared with the candidate's, so timing says nothing about a stored key (the one comparison
//! left, against a fixed key of local mode, is constant time). Rotation without downtime: create
//! a second key, move the clients, revoke the first; both work in between.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::types::AttributeValue;
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use super::{KeyAdmin, StoreError, TaskStore, get_s, get_ts, n, s, sdk_error};
use crate::domain::PingbackForm;
use crate::time::Timestamp;

const PREFIX: &str = "relaykey#";

/// What a live key grants: its name (whose webhook secret signs its pushes) and how its
/// tasks' results are pushed to their `pingback`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeyGrant {
    pub name: String,
    pub pingback: PingbackForm,
}

impl From<&str> for KeyGrant {
    /// A key of this name with CaptchaAI's pingback form.
    fn from(name: &str) -> Self {
        Self { name: name.to_owned(), pingback: PingbackForm::default() }
    }
}

/// What a presented key is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyCheck {
    /// A live key.
    Valid(KeyGrant),
    /// Not shaped like a key at all (2captcha answers `ERROR_WRONG_USER_KEY`).
    Malformed,
    /// Shaped like one, but no live key has it (`ERROR_KEY_DOES_NOT_EXIST`).
    Unknown,
}

/// A stored key as the operator sees it (never the key).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct KeyInfo {
    pub name: String,
    /// The key's SHA-256 in hex (what the table holds; safe to show, useless to replay).
    pub digest: String,
    pub created_at: Option<Timestamp>,
    pub revoked_at: Option<Timestamp>,
    /// How its tasks' results are pushed to their `pingback`.
    pub pingback: PingbackForm,
}

/// Whether `key` is shaped like a relay key: 16 to 128 characters of `[A-Za-z0-9_-]`.
pub fn well_formed(key: &str) -> bool {
    (16..=128).contains(&key.len()) && key.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'-'))
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// Checks relay keys for the compat routes: fixed keys (local mode's API key) and the keys in
/// the table, with answers kept for a while so a client polling every few seconds does not cost
/// a read each time. A revoked key stops working within [`RelayKeys::CACHE_FOR`].
/// Check answers by key digest, with when they were read.
type KeyCache = Arc<Mutex<HashMap<[u8; 32], (KeyCheck, Instant)>>>;

#[derive(Clone)]
pub struct RelayKeys {
    store: Option<TaskStore>,
    fixed: Vec<(KeyGrant, [u8; 32])>,
    cache: KeyCache,
}

impl std::fmt::Debug for RelayKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RelayKeys").field("fixed", &self.fixed.len()).finish_non_exhaustive()
    }
}

impl RelayKeys {
    /// How long a live key's check is reused (so a revoked key stops working within it).
    pub const CACHE_FOR: Duration = Duration::from_secs(60);
    /// How long an unknown key's check is reused (so a new key works within it).
    pub const UNKNOWN_FOR: Duration = Duration::from_secs(5);
    /// Most answers kept (a flood of random keys must not grow memory without bound).
    const CACHE_MAX: usize = 10_000;

    /// Keys in `store`'s table (none: only fixed keys).
    pub fn new(store: Option<TaskStore>) -> Self {
        Self { store, fixed: Vec::new(), cache: Arc::default() }
    }

    /// Also accepts `key` with `grant` (local mode's API key).
    pub fn with_fixed(mut self, grant: KeyGrant, key: &SecretString) -> Self {
        self.fixed.push((grant, digest(key.expose_secret())));
        self
    }

    /// What `key` is. A store failure is an error (the caller answers "try again"), never
    /// "unknown".
    pub async fn check(&self, key: &str) -> Result<KeyCheck, StoreError> {
        let key = key.trim();
        if !well_formed(key) {
            return Ok(KeyCheck::Malformed);
        }
        let d = digest(key);
        for (grant, want) in &self.fixed {
            if bool::from(d.ct_eq(want)) {
                return Ok(KeyCheck::Valid(grant.clone()));
            }
        }
        if let Some((hit, at)) = self.cache.lock().ok().and_then(|c| c.get(&d).cloned())
            && at.elapsed() < if matches!(hit, KeyCheck::Valid(_)) { Self::CACHE_FOR } else { Self::UNKNOWN_FOR }
        {
            return Ok(hit);
        }
        let Some(store) = &self.store else { return Ok(KeyCheck::Unknown) };
        let out = store
            .client
            .get_item()
            .table_name(&*store.table)
            .key(super::attr::PK, s(&format!("{PREFIX}{}", hex::encode(d))))
            .send()
            .await
            .map_err(sdk_error)?;
        let found = match out.item {
            Some(item) if !item.contains_key("revoked_at") => KeyCheck::Valid(KeyGrant {
                name: get_s(&item, "key_name")?.unwrap_or("unnamed").to_owned(),
                pingback: pingback_of(&item)?,
            }),
            _ => KeyCheck::Unknown,
        };
        if let Ok(mut c) = self.cache.lock() {
            if c.len() >= Self::CACHE_MAX {
                c.retain(|_, (_, at)| at.elapsed() < Self::CACHE_FOR);
                if c.len() >= Self::CACHE_MAX {
                    c.clear();
                }
            }
            c.insert(d, (found.clone(), Instant::now()));
        }
        Ok(found)
    }
}

fn pingback_of(item: &HashMap<String, AttributeValue>) -> Result<PingbackForm, StoreError> {
    get_s(item, "pingback_form")?
        .map(PingbackForm::parse)
        .transpose()
        .map_err(|e| StoreError::Corrupt(format!("relay key: {}", e.0)))
        .map(Option::unwrap_or_default)
}

impl KeyAdmin {
    /// Makes a new relay key named `name` with CaptchaAI's pingback form (see
    /// [`Self::create_relay_key_with`]).
    pub async fn create_relay_key(&self, name: &str, now: Timestamp) -> Result<SecretString, StoreError> {
        self.create_relay_key_with(name, PingbackForm::default(), now).await
    }

    /// Makes a new relay key named `name` (1–64 of `[A-Za-z0-9_.-]`), whose tasks' results go
    /// to their `pingback` in `pingback` form, and stores its digest. Returns the key: shown
    /// once, never stored. Names may repeat (rotation keeps one name).
    pub async fn create_relay_key_with(
        &self,
        name: &str,
        pingback: PingbackForm,
        now: Timestamp,
    ) -> Result<SecretString, StoreError> {
        if name.is_empty()
            || name.len() > 64
            || !name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
        {
            return Err(StoreError::Rejected(format!(
                "key name `{name}` must be 1 to 64 characters of letters, digits, `_`, `.` and `-`"
            )));
        }
        // 32 lowercase hex digits, the shape of a 2captcha key (128 random bits).
        let key = uuid::Uuid::new_v4().simple().to_string();
        self.client
            .put_item()
            .table_name(&*self.table)
            .item(super::attr::PK, s(&format!("{PREFIX}{}", hex::encode(digest(&key)))))
            .item("key_name", s(name))
            .item("created_at", n(now.as_millis()))
            .item("pingback_form", s(pingback.as_str()))
            .condition_expression("attribute_not_exists(pk)")
            .send()
            .await
            .map_err(sdk_error)?;
        Ok(SecretString::from(key))
    }

    /// Every relay key (live and revoked), oldest first. A scan: an operator command, not a
    /// request path.
    pub async fn list_relay_keys(&self) -> Result<Vec<KeyInfo>, StoreError> {
        let mut out = Vec::new();
        let mut pages = self
            .client
            .scan()
            .table_name(&*self.table)
            .filter_expression("begins_with(pk, :p)")
            .expression_attribute_values(":p", s(PREFIX))
            .consistent_read(true)
            .into_paginator()
            .send();
        while let Some(page) = pages.next().await {
            for item in page.map_err(sdk_error)?.items() {
                let pk = get_s(item, super::attr::PK)?.unwrap_or_default();
                out.push(KeyInfo {
                    name: get_s(item, "key_name")?.unwrap_or("unnamed").to_owned(),
                    digest: pk.trim_start_matches(PREFIX).to_owned(),
                    created_at: get_ts(item, "created_at")?,
                    revoked_at: get_ts(item, "revoked_at")?,
                    pingback: pingback_of(item)?,
                });
            }
        }
        out.sort_by_key(|k| k.created_at);
        Ok(out)
    }

    /// Sets how the live keys named `name` push their tasks' results to a `pingback`. Returns
    /// how many keys changed. Tasks submitted before keep the form they were submitted with;
    /// running relays see the change within [`RelayKeys::CACHE_FOR`].
    pub async fn set_relay_key_pingback(&self, name: &str, pingback: PingbackForm) -> Result<usize, StoreError> {
        let mut changed = 0;
        for k in self.list_relay_keys().await? {
            if k.name != name || k.revoked_at.is_some() {
                continue;
            }
            self.client
                .update_item()
                .table_name(&*self.table)
                .key(super::attr::PK, AttributeValue::S(format!("{PREFIX}{}", k.digest)))
                .update_expression("SET pingback_form = :f")
                .condition_expression("attribute_exists(pk) AND attribute_not_exists(revoked_at)")
                .expression_attribute_values(":f", s(pingback.as_str()))
                .send()
                .await
                .map_err(sdk_error)?;
            changed += 1;
        }
        Ok(changed)
    }

    /// Revokes the live keys named `name` (or only the one whose digest starts with
    /// `digest_prefix`). Returns how many were revoked. Running clients' cached checks lapse
    /// within [`RelayKeys::CACHE_FOR`].
    pub async fn revoke_relay_keys(
        &self,
        name: &str,
        digest_prefix: Option<&str>,
        now: Timestamp,
    ) -> Result<usize, StoreError> {
        let mut revoked = 0;
        for k in self.list_relay_keys().await? {
            if k.name != name || k.revoked_at.is_some() || digest_prefix.is_some_and(|p| !k.digest.starts_with(p)) {
                continue;
            }
            self.client
                .update_item()
                .table_name(&*self.table)
                .key(super::attr::PK, AttributeValue::S(format!("{PREFIX}{}", k.digest)))
                .update_expression("SET revoked_at = :now")
                .condition_expression("attribute_exists(pk) AND attribute_not_exists(revoked_at)")
                .expression_attribute_values(":now", n(now.as_millis()))
                .send()
                .await
                .map_err(sdk_error)?;
            revoked += 1;
        }
        Ok(revoked)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testkit::LocalDynamo;

    #[tokio::test]
    async fn keys_are_created_checked_rotated_and_revoked() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let t = Timestamp::from_millis(1_796_210_146_000);
        let old = store.key_admin().create_relay_key("scraper", t).await?;
        let new = store.key_admin().create_relay_key("scraper", t.plus(Duration::from_secs(1))).await?;
        assert_eq!(old.expose_secret().len(), 32);
        assert_ne!(old.expose_secret(), new.expose_secret());
        // Fresh checkers (no cache) see what the table holds.
        let check = |k: &str| {
            let keys = RelayKeys::new(Some(store.clone()));
            let k = k.to_owned();
            async move { keys.check(&k).await }
        };
        assert_eq!(check(old.expose_secret()).await?, KeyCheck::Valid("scraper".into()));
        assert_eq!(check(new.expose_secret()).await?, KeyCheck::Valid("scraper".into()));
        assert_eq!(check("0123456789abcdef0123456789abcdef").await?, KeyCheck::Unknown);
        assert_eq!(check("short").await?, KeyCheck::Malformed);
        assert_eq!(check("has spaces in it, 32 characters!").await?, KeyCheck::Malformed);
        // The table holds digests, never a key.
        let items = store.client.scan().table_name(store.table()).send().await?;
        let dump = format!("{:?}", items.items());
        assert!(!dump.contains(old.expose_secret()) && !dump.contains(new.expose_secret()));
        // Rotation: revoke only the old one (by its digest prefix); the new one keeps working.
        let listed = store.key_admin().list_relay_keys().await?;
        assert_eq!(listed.len(), 2);
        let old_prefix = hex::encode(digest(old.expose_secret()))[..8].to_owned();
        assert_eq!(store.key_admin().revoke_relay_keys("scraper", Some(&old_prefix), t).await?, 1);
        assert_eq!(check(old.expose_secret()).await?, KeyCheck::Unknown);
        assert_eq!(check(new.expose_secret()).await?, KeyCheck::Valid("scraper".into()));
        assert_eq!(store.key_admin().revoke_relay_keys("scraper", None, t).await?, 1, "the remaining live one");
        assert_eq!(check(new.expose_secret()).await?, KeyCheck::Unknown);
        assert!(store.key_admin().create_relay_key("bad name", t).await.is_err());
        // A key for code written against 2captcha: its tasks are pushed the POST way; the form
        // can be changed later, for every live key of the name.
        let post = store.key_admin().create_relay_key_with("legacy", PingbackForm::Post, t).await?;
        let posts = KeyCheck::Valid(KeyGrant { name: "legacy".into(), pingback: PingbackForm::Post });
        assert_eq!(check(post.expose_secret()).await?, posts);
        assert_eq!(store.key_admin().set_relay_key_pingback("legacy", PingbackForm::Get).await?, 1);
        assert_eq!(check(post.expose_secret()).await?, KeyCheck::Valid("legacy".into()));
        assert_eq!(store.key_admin().set_relay_key_pingback("nobody", PingbackForm::Post).await?, 0);
        Ok(())
    }

    #[tokio::test]
    async fn a_fixed_key_works_without_a_table_and_answers_are_cached() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let fixed = SecretString::from("local-api-key-0123456789".to_owned());
        let keys = RelayKeys::new(Some(store.clone())).with_fixed("local".into(), &fixed);
        assert_eq!(keys.check("local-api-key-0123456789").await?, KeyCheck::Valid("local".into()));
        let k = store.key_admin().create_relay_key("ci", Timestamp::from_millis(1)).await?;
        assert_eq!(keys.check(k.expose_secret()).await?, KeyCheck::Valid("ci".into()));
        store.key_admin().revoke_relay_keys("ci", None, Timestamp::from_millis(2)).await?;
        // Within CACHE_FOR the checker still has its answer: one read per key a minute.
        assert_eq!(keys.check(k.expose_secret()).await?, KeyCheck::Valid("ci".into()));
        assert_eq!(RelayKeys::new(None).check(k.expose_secret()).await?, KeyCheck::Unknown);
        Ok(())
    }
}

//! Relay keys: the `key` that 2captcha-style clients send to the compat routes (`/in.php`,
//! `/res.php`). The table holds only each key's SHA-256 digest; a key is shown once, when made.

use std::fmt;

use relay_shared::domain::PingbackForm;
use relay_shared::store::{KeyInfo, RelayKeys, StoreError, TaskStore};
use relay_shared::time::Timestamp;
use secrecy::{ExposeSecret, SecretString};
use sha2::{Digest, Sha256};

/// Hex digits of a key's digest shown by `keys list` (enough to tell keys apart, and to
/// pass to `keys revoke --digest`).
pub const SHOWN_DIGITS: usize = 12;
/// Fewest hex digits `keys revoke --digest` takes.
pub const MIN_PREFIX: usize = 6;

/// Why a key command did nothing.
#[derive(Debug)]
pub enum KeysError {
    /// The task table failed or refused.
    Store(StoreError),
    /// A key name that the table would refuse.
    BadName(String),
    /// A `--digest` that is not 6 to 64 hex digits.
    BadPrefix(String),
    /// Nothing to revoke: the text says what was looked for and what exists.
    NoneMatched(String),
    /// A `--digest` prefix shared by several live keys of the name.
    Ambiguous { name: String, prefix: String, digests: Vec<String> },
}

impl fmt::Display for KeysError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Store(e) => write!(f, "{e}"),
            Self::BadName(n) => {
                write!(f, "key name `{n}` must be 1 to 64 characters of letters, digits, `_`, `.` and `-`")
            }
            Self::BadPrefix(p) => write!(
                f,
                "--digest `{p}` must be {MIN_PREFIX} to 64 hex digits of the key's digest (as `relay-ops keys list` shows it)"
            ),
            Self::NoneMatched(why) => write!(f, "nothing revoked: {why}"),
            Self::Ambiguous { name, prefix, digests } => write!(
                f,
                "nothing revoked: {} live keys named `{name}` have digests starting with `{prefix}` ({}); give more digits",
                digests.len(),
                digests.join(", ")
            ),
        }
    }
}

impl std::error::Error for KeysError {}

impl From<StoreError> for KeysError {
    fn from(e: StoreError) -> Self {
        Self::Store(e)
    }
}

/// The same rule the store applies, checked first for a plain message.
pub fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
}

/// A `--digest` argument as the table spells digests (lower-case hex), or why it is refused.
pub fn digest_prefix(raw: &str) -> Result<String, KeysError> {
    let p = raw.trim().to_ascii_lowercase();
    if (MIN_PREFIX..=64).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_hexdigit()) {
        Ok(p)
    } else {
        Err(KeysError::BadPrefix(raw.to_owned()))
    }
}

/// A key's SHA-256 in lower-case hex: what the table holds for it.
pub fn digest_of(key: &SecretString) -> String {
    format!("{:x}", Sha256::digest(key.expose_secret().as_bytes()))
}

/// A new key: the key itself (to print once) and its digest (to name it later).
pub struct Created {
    pub key: SecretString,
    pub digest: String,
}

impl fmt::Debug for Created {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Created").field("digest", &self.digest).finish_non_exhaustive()
    }
}

impl Created {
    /// What to tell the operator besides the key (on stderr, so stdout is the key alone).
    pub fn hint(&self, name: &str) -> String {
        let short = &self.digest[..SHOWN_DIGITS.min(self.digest.len())];
        format!(
            "relay key `{name}` created (digest {short}). It is shown only this once: the table keeps \
             its SHA-256 digest, never the key. Clients send it as `key` to /in.php and /res.php. \
             Revoke it with `relay-ops keys revoke {name} --digest {short}`."
        )
    }
}

/// Makes a key named `name` whose tasks' results go to their `pingback` in `pingback` form.
pub async fn create(
    store: &TaskStore,
    name: &str,
    pingback: PingbackForm,
    now: Timestamp,
) -> Result<Created, KeysError> {
    if !valid_name(name) {
        return Err(KeysError::BadName(name.to_owned()));
    }
    let key = store.key_admin().create_relay_key_with(name, pingback, now).await?;
    let digest = digest_of(&key);
    Ok(Created { key, digest })
}

/// Sets the pingback form of every live key named `name`; an error if none is live.
pub async fn set_pingback(store: &TaskStore, name: &str, pingback: PingbackForm) -> Result<usize, KeysError> {
    match store.key_admin().set_relay_key_pingback(name, pingback).await? {
        0 => Err(KeysError::NoneMatched(format!("no live relay key is named `{name}`"))),
        n => Ok(n),
    }
}

/// A stored key as `keys list` shows it: never the key, only the start of its digest.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub name: String,
    pub digest_prefix: String,
    pub created_at: Option<Timestamp>,
    pub revoked_at: Option<Timestamp>,
    pub pingback: PingbackForm,
}

impl From<&KeyInfo> for Row {
    fn from(k: &KeyInfo) -> Self {
        Self {
            name: k.name.clone(),
            digest_prefix: k.digest.chars().take(SHOWN_DIGITS).collect(),
            created_at: k.created_at,
            revoked_at: k.revoked_at,
            pingback: k.pingback,
        }
    }
}

/// Every key, live and revoked, oldest first.
pub async fn list(store: &TaskStore) -> Result<Vec<Row>, KeysError> {
    Ok(store.key_admin().list_relay_keys().await?.iter().map(Row::from).collect())
}

fn when(t: Option<Timestamp>) -> String {
    t.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339())
}

/// The rows as an aligned table with a header.
pub fn render_table(rows: &[Row]) -> String {
    let header = ["NAME", "DIGEST", "PINGBACK", "CREATED", "REVOKED"];
    let cells: Vec<[String; 5]> = rows
        .iter()
        .map(|r| {
            [
                r.name.clone(),
                r.digest_prefix.clone(),
                r.pingback.as_str().to_owned(),
                when(r.created_at),
                when(r.revoked_at),
            ]
        })
        .collect();
    let mut width = header.map(str::len);
    for c in &cells {
        for (w, v) in width.iter_mut().zip(c) {
            *w = (*w).max(v.len());
        }
    }
    let line = |c: [&str; 5]| {
        let [a, b, p, d, e] = c;
        format!(
            "{a:<w0$}  {b:<w1$}  {p:<w2$}  {d:<w3$}  {e}",
            w0 = width[0],
            w1 = width[1],
            w2 = width[2],
            w3 = width[3]
        )
        .trim_end()
        .to_owned()
    };
    let mut out = line(header);
    out.push('\n');
    for c in &cells {
        out.push_str(&line([&c[0], &c[1], &c[2], &c[3], &c[4]]));
        out.push('\n');
    }
    out
}

/// The rows as a JSON array (times in RFC 3339, `null` when absent).
pub fn render_json(rows: &[Row]) -> serde_json::Value {
    serde_json::Value::Array(
        rows.iter()
            .map(|r| {
                serde_json::json!({
                    "name": r.name,
                    "digest_prefix": r.digest_prefix,
                    "created_at": r.created_at.map(Timestamp::to_rfc3339),
                    "revoked_at": r.revoked_at.map(Timestamp::to_rfc3339),
                    "live": r.revoked_at.is_none(),
                    "pingback": r.pingback.as_str(),
                })
            })
            .collect(),
    )
}

/// Revokes the live keys named `name`, or only the one whose digest starts with `prefix`
/// (at least [`MIN_PREFIX`] hex digits; a prefix shared by several live keys is refused).
/// Returns how many were revoked; revoking nothing is an error saying why.
pub async fn revoke(store: &TaskStore, name: &str, prefix: Option<&str>, now: Timestamp) -> Result<usize, KeysError> {
    let prefix = prefix.map(digest_prefix).transpose()?;
    let all = store.key_admin().list_relay_keys().await?;
    let named: Vec<&KeyInfo> = all.iter().filter(|k| k.name == name).collect();
    let live: Vec<&KeyInfo> = named
        .iter()
        .copied()
        .filter(|k| k.revoked_at.is_none() && prefix.as_deref().is_none_or(|p| k.digest.starts_with(p)))
        .collect();
    if live.is_empty() {
        let why = if named.is_empty() {
            format!("no relay key is named `{name}` (see `relay-ops keys list`)")
        } else if let Some(p) = &prefix {
            format!("no live key named `{name}` has a digest starting with `{p}` (see `relay-ops keys list`)")
        } else {
            format!("every key named `{name}` is already revoked")
        };
        return Err(KeysError::NoneMatched(why));
    }
    if let Some(p) = &prefix
        && live.len() > 1
    {
        return Err(KeysError::Ambiguous {
            name: name.to_owned(),
            prefix: p.clone(),
            digests: live.iter().map(|k| k.digest.chars().take(SHOWN_DIGITS + 4).collect()).collect(),
        });
    }
    let n = store.key_admin().revoke_relay_keys(name, prefix.as_deref(), now).await?;
    if n == 0 {
        // Revoked by someone else between the listing and the write.
        return Err(KeysError::NoneMatched(format!("the matching key named `{name}` was revoked meanwhile")));
    }
    Ok(n)
}

/// What to tell the operator after a revoke.
pub fn revoked_message(n: usize, name: &str) -> String {
    format!(
        "revoked {n} key(s) named `{name}`; running API functions stop accepting it within {} s (their cache)",
        RelayKeys::CACHE_FOR.as_secs()
    )
}

#[cfg(test)]
mod tests;

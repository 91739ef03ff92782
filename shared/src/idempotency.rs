//! Idempotency keys: the task reference a caller's `Idempotency-Key` stands for, derived (not
//! stored), so a repeated submit names the task the first one made.

use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

use crate::domain::TaskRef;

type HmacSha256 = Hmac<Sha256>;

/// Domain separation: a reference made for an idempotency key means nothing anywhere else.
const CONTEXT: &[u8] = b"captcha-relay/idempotency/v1:";

/// The task reference an idempotency key stands for: HMAC of the caller and the key (under a
/// context of its own), so the same key from the same caller always names the same task, and
/// nobody can guess another caller's references from their keys.
pub fn task_ref_for_key(secret: &SecretString, owner: &str, key: &str) -> TaskRef {
    let mut mac = HmacSha256::new_from_slice(secret.expose_secret().as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
    mac.update(CONTEXT);
    mac.update(&(owner.len() as u64).to_be_bytes());
    mac.update(owner.as_bytes());
    mac.update(key.as_bytes());
    let digest = mac.finalize().into_bytes();
    TaskRef::from_hex(&hex::encode(&digest[..16]))
}

/// Turns a caller's idempotency keys into task references ([`task_ref_for_key`]) under the
/// relay's secret (the callback signing secret: one secret to keep and rotate).
#[derive(Clone)]
pub struct IdempotencyKeys(SecretString);

impl IdempotencyKeys {
    pub fn new(secret: SecretString) -> Self {
        Self(secret)
    }

    /// The task `key`, sent by `owner`, stands for.
    pub fn task_ref(&self, owner: &str, key: &str) -> TaskRef {
        task_ref_for_key(&self.0, owner, key)
    }
}

impl std::fmt::Debug for IdempotencyKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("IdempotencyKeys(<secret>)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn secret(s: &str) -> SecretString {
        SecretString::from(s.to_owned())
    }

    #[test]
    fn an_idempotency_key_names_one_task_per_caller() {
        let s = secret("k1");
        let a = task_ref_for_key(&s, "owner-a", "key-1");
        assert_eq!(a, task_ref_for_key(&s, "owner-a", "key-1"), "stable");
        assert_ne!(a, task_ref_for_key(&s, "owner-b", "key-1"), "scoped to the caller");
        assert_ne!(a, task_ref_for_key(&s, "owner-a", "key-2"));
        assert_ne!(
            task_ref_for_key(&s, "owner-a1", "key"),
            task_ref_for_key(&s, "owner-a", "1key"),
            "no ambiguous joins"
        );
        assert_ne!(a, task_ref_for_key(&secret("k2"), "owner-a", "key-1"), "unguessable without the secret");
        assert_eq!(TaskRef::parse(a.as_ref()), Ok(a));
    }
}

//! Signed callback paths: `/callback/{ref}/{hmac}` so a pingback cannot be forged for a task.
//!
//! The signature lives in the path because a GET submit keeps only the first query
//! parameter of the pingback URL.

use hmac::{Hmac, Mac};
use secrecy::{ExposeSecret, SecretString};
use sha2::Sha256;

use crate::domain::TaskRef;

type HmacSha256 = Hmac<Sha256>;

/// Domain separation: a signature made for callbacks means nothing anywhere else.
const CONTEXT: &[u8] = b"captcha-relay/callback/v1:";

#[derive(Clone)]
pub struct CallbackSigner {
    secret: SecretString,
}

impl std::fmt::Debug for CallbackSigner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CallbackSigner(<secret>)")
    }
}

impl CallbackSigner {
    pub fn new(secret: SecretString) -> Self {
        Self { secret }
    }

    fn mac(&self, task_ref: &TaskRef) -> HmacSha256 {
        // HMAC takes keys of any length; this cannot fail.
        let mut mac = HmacSha256::new_from_slice(self.secret.expose_secret().as_bytes())
            .unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        mac.update(CONTEXT);
        mac.update(task_ref.as_ref().as_bytes());
        mac
    }

    /// Lowercase hex HMAC-SHA256 of the reference.
    pub fn sign(&self, task_ref: &TaskRef) -> String {
        hex::encode(self.mac(task_ref).finalize().into_bytes())
    }

    /// Checks a signature in constant time. Only the canonical form this signer writes (64
    /// lowercase hex digits) is accepted: uppercase, short, long or otherwise malformed text is
    /// simply "not valid".
    pub fn verify(&self, task_ref: &TaskRef, signature: &str) -> bool {
        let canonical = signature.len() == 64 && signature.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        let Ok(bytes) = hex::decode(signature) else { return false };
        // The MAC is checked even for a non-canonical form, so the time taken does not say which.
        self.mac(task_ref).verify_slice(&bytes).is_ok() & canonical
    }

    /// The pingback URL for a task under `base` (e.g. `https://abc.execute-api…/`).
    pub fn callback_url(&self, base: &str, task_ref: &TaskRef) -> String {
        format!("{}/callback/{}/{}", base.trim_end_matches('/'), task_ref, self.sign(task_ref))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn signer(s: &str) -> CallbackSigner {
        CallbackSigner::new(SecretString::from(s.to_owned()))
    }

    #[test]
    fn signature_verifies_for_its_reference_only() {
        let s = signer("k1");
        let a = TaskRef::generate();
        let b = TaskRef::generate();
        let sig = s.sign(&a);
        assert_eq!(sig.len(), 64);
        assert!(s.verify(&a, &sig));
        assert!(!s.verify(&b, &sig));
        assert!(!signer("k2").verify(&a, &sig), "another secret must not verify");
    }

    #[test]
    fn malformed_truncated_and_uppercase_signatures_are_rejected() {
        // Fixed inputs: the signature below is known to contain hex letters, so its uppercase
        // form differs from it (a random one has none about 1.6 % of the time).
        let s = signer("k1");
        let r = TaskRef::parse("tsk_0123456789abcdef0123456789abcdef").expect("ref");
        let sig = s.sign(&r);
        assert!(sig.bytes().any(|b| b.is_ascii_lowercase()), "fixture signature has letters: {sig}");
        assert!(s.verify(&r, &sig));
        assert!(!s.verify(&r, ""));
        assert!(!s.verify(&r, "zz"));
        assert!(!s.verify(&r, &sig[..62]));
        assert!(!s.verify(&r, &format!("{sig}00")), "trailing bytes");
        assert!(!s.verify(&r, &sig.to_uppercase()), "same bytes, non-canonical form");
        let mut flipped = sig.clone().into_bytes();
        flipped[63] = if flipped[63] == b'0' { b'1' } else { b'0' };
        assert!(!s.verify(&r, &String::from_utf8(flipped).expect("hex")), "last digit changed");
    }

    #[test]
    fn callback_url_puts_everything_in_the_path() {
        let s = signer("k1");
        let r = TaskRef::generate();
        let url = s.callback_url("https://x.example/", &r);
        assert_eq!(url, format!("https://x.example/callback/{r}/{}", s.sign(&r)));
        assert!(!url.contains('?'));
    }

    #[test]
    fn debug_hides_the_secret() {
        assert!(!format!("{:?}", signer("hunter2")).contains("hunter2"));
    }
}

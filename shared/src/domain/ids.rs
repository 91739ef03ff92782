//! The identifiers of a task: our reference ([`TaskRef`], with its 2captcha-compatible numeric
//! form) and the id CaptchaAI gave it ([`CaptchaId`]), each parsed from outside.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize};

use crate::codes::ParseError;

/// Our reference for a task: `tsk_` and 32 lowercase hex digits. Generated before in.php is
/// called, so a callback that outruns the submit still finds its record.
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct TaskRef(String);

impl TaskRef {
    const PREFIX: &'static str = "tsk_";

    pub fn generate() -> Self {
        Self(format!("{}{}", Self::PREFIX, uuid::Uuid::new_v4().simple()))
    }

    /// From 32 lowercase hex digits (a digest's, say).
    pub(crate) fn from_hex(hex32: &str) -> Self {
        Self(format!("{}{hex32}", Self::PREFIX))
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let hex =
            s.strip_prefix(Self::PREFIX).ok_or_else(|| ParseError("task reference must start with `tsk_`".into()))?;
        if hex.len() != 32 || !hex.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)) {
            return Err(ParseError("task reference must be `tsk_` followed by 32 lowercase hex digits".into()));
        }
        Ok(Self(s.to_owned()))
    }

    /// A new reference for a task submitted through the 2captcha-compatible `in.php`, with its
    /// compat id: see [`TaskRef::from_compat_number`].
    pub fn generate_compat() -> (Self, u64) {
        Self::compat_from(uuid::Uuid::new_v4().as_u128() as u64)
    }

    /// The compat reference for a digest (an idempotency key's): its first 8 bytes, folded into
    /// the compat id range.
    pub fn compat_from_digest(digest: &[u8]) -> (Self, u64) {
        let mut b = [0u8; 8];
        b.iter_mut().zip(digest).for_each(|(to, from)| *to = *from);
        Self::compat_from(u64::from_le_bytes(b))
    }

    /// `r` folded into the compat id range, and the id's reference.
    fn compat_from(r: u64) -> (Self, u64) {
        let id = Self::COMPAT_MIN + r % (i64::MAX as u64 - Self::COMPAT_MIN);
        (Self::from_compat_number(id), id)
    }

    /// Smallest compat id: every compat id has 18 or 19 digits and fits a signed 64-bit integer
    /// (the id column of much existing 2captcha client code), and is a string of digits, which
    /// every official SDK takes as it comes.
    const COMPAT_MIN: u64 = 100_000_000_000_000_000;

    /// The reference of compat id `id`: `tsk_` + 16 zeros + the id in 16 hex digits (one to one,
    /// and never a generated reference, whose version nibble is not zero).
    pub fn from_compat_number(id: u64) -> Self {
        Self(format!("{}{:032x}", Self::PREFIX, u128::from(id)))
    }

    /// Parses a compat id as a client sends it (`id=` of `res.php`).
    pub fn from_compat_id(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        let bad = || ParseError("a task id is 18 or 19 digits".into());
        if !(18..=19).contains(&s.len()) || !s.bytes().all(|b| b.is_ascii_digit()) {
            return Err(bad());
        }
        let id: u64 = s.parse().map_err(|_| bad())?;
        if !(Self::COMPAT_MIN..=i64::MAX as u64).contains(&id) {
            return Err(bad());
        }
        Ok(Self::from_compat_number(id))
    }

    /// The compat id of a task submitted through `in.php` (`None` for any other task).
    pub fn compat_id(&self) -> Option<u64> {
        let hex = self.0.strip_prefix(Self::PREFIX)?;
        let (high, low) = hex.split_at(16);
        if high.bytes().any(|b| b != b'0') {
            return None;
        }
        u64::from_str_radix(low, 16).ok().filter(|id| (Self::COMPAT_MIN..=i64::MAX as u64).contains(id))
    }

    /// A small stable number derived from the reference, used to spread the sparse indexes
    /// over several partitions: the reference's last four hex digits (random in a generated
    /// reference and in a compat id) modulo `shards`, so up to 256 shards are filled evenly.
    pub fn shard(&self, shards: u8) -> u8 {
        let tail = self.0.get(self.0.len().saturating_sub(4)..).unwrap_or_default();
        let value = u16::from_str_radix(tail, 16)
            .unwrap_or_else(|_| self.0.bytes().fold(0u16, |h, b| h.wrapping_mul(31).wrapping_add(u16::from(b))));
        u8::try_from(value % u16::from(shards.max(1))).unwrap_or(0)
    }
}

impl AsRef<str> for TaskRef {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for TaskRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for TaskRef {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

/// The id CaptchaAI gave the task. Arrives as a JSON number or a string; kept as text.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct CaptchaId(String);

impl CaptchaId {
    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        if s.is_empty() || s.len() > 64 || !s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_') {
            return Err(ParseError("CaptchaAI task id must be 1 to 64 letters or digits".into()));
        }
        Ok(Self(s.to_owned()))
    }
}

impl AsRef<str> for CaptchaId {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for CaptchaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for CaptchaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl Serialize for CaptchaId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.0)
    }
}

impl<'de> Deserialize<'de> for CaptchaId {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum NumOrStr {
            Num(u64),
            Str(String),
        }
        let text = match NumOrStr::deserialize(d)? {
            NumOrStr::Num(n) => n.to_string(),
            NumOrStr::Str(s) => s,
        };
        CaptchaId::parse(&text).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compat_ids_are_digits_that_map_one_to_one_onto_references() {
        for _ in 0..1000 {
            let (r, id) = TaskRef::generate_compat();
            let text = id.to_string();
            assert!((18..=19).contains(&text.len()) && i64::try_from(id).is_ok(), "{text}");
            assert_eq!(TaskRef::parse(r.as_ref()), Ok(r.clone()), "a valid reference");
            assert_eq!(r.compat_id(), Some(id));
            assert_eq!(TaskRef::from_compat_id(&text), Ok(r));
        }
        assert_eq!(TaskRef::generate().compat_id(), None, "an API task has no compat id");
        for bad in ["", "12", "99999999999999999", "9223372036854775808", "12345678901234567a", " 1e18"] {
            assert!(TaskRef::from_compat_id(bad).is_err(), "{bad:?}");
        }
        let (a, _) = TaskRef::compat_from_digest(&[7; 32]);
        assert_eq!(TaskRef::compat_from_digest(&[7; 32]).0, a, "stable");
        assert!(a.compat_id().is_some());
    }

    #[test]
    fn task_ref_round_trips_and_rejects_garbage() {
        let r = TaskRef::generate();
        assert_eq!(TaskRef::parse(r.as_ref()).expect("own format parses"), r);
        for bad in
            ["", "tsk_", "tsk_XYZ", "abc_0123456789abcdef0123456789abcdef", "tsk_0123456789ABCDEF0123456789abcdef"]
        {
            assert!(TaskRef::parse(bad).is_err(), "{bad} should be rejected");
        }
        assert!(r.shard(8) < 8);
    }

    #[test]
    fn captcha_id_accepts_json_number_and_string() {
        let a: CaptchaId = serde_json::from_str("2122988149").expect("number");
        let b: CaptchaId = serde_json::from_str("\"2122988149\"").expect("string");
        assert_eq!(a, b);
        assert!(serde_json::from_str::<CaptchaId>("\"\"").is_err());
        assert!(serde_json::from_str::<CaptchaId>("\"12 34\"").is_err());
        assert!(serde_json::from_str::<CaptchaId>("-1").is_err());
    }
}

//! Standard Webhooks signatures: `whsec_` secrets, the current and previous key of a rotation,
//! the `webhook-signature` header, and verification as a receiver does it.

use base64::Engine;
use base64::engine::general_purpose::{GeneralPurpose, GeneralPurposeConfig, STANDARD};
use base64::engine::{DecodePaddingMode, general_purpose};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};

type HmacSha256 = Hmac<Sha256>;

/// The prefix of a secret's text form.
pub const SECRET_PREFIX: &str = "whsec_";
/// The fewest and most key bytes a secret may have (the spec's bounds).
pub const SECRET_MIN_BYTES: usize = 24;
pub const SECRET_MAX_BYTES: usize = 64;
/// How far a receiver lets `webhook-timestamp` be from its clock, either way.
pub const TIMESTAMP_TOLERANCE_SECS: u64 = 5 * 60;

/// Secrets accept standard base64 with or without its `=` padding (some tools strip it).
const LENIENT_BASE64: GeneralPurpose = GeneralPurpose::new(
    &base64::alphabet::STANDARD,
    GeneralPurposeConfig::new().with_decode_padding_mode(DecodePaddingMode::Indifferent),
);

/// Why a secret, a header or a signature was not accepted. Messages never carry a secret's value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WebhookError {
    #[error("invalid webhook secret: {0}")]
    InvalidSecret(String),
    #[error("no webhook secret given")]
    NoSecrets,
    #[error("at most two webhook secrets (the current one, then the previous one) may be given, got {0}")]
    TooManySecrets(usize),
    #[error("the {0} header is missing or empty")]
    MissingHeader(&'static str),
    #[error("the webhook-timestamp header is not a unix time in whole seconds")]
    InvalidTimestamp,
    #[error("the message timestamp is more than 5 minutes in the past")]
    TimestampTooOld,
    #[error("the message timestamp is more than 5 minutes in the future")]
    TimestampTooNew,
    #[error("no v1 signature in the webhook-signature header matches")]
    NoMatchingSignature,
}

/// One signing secret: `whsec_<base64 of 24..=64 random bytes>` (Standard Webhooks form). Holds
/// only the keyed HMAC state, not the text. Debug redacts.
#[derive(Clone)]
pub struct WebhookSecret {
    mac: HmacSha256,
}

impl std::fmt::Debug for WebhookSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("WebhookSecret(<secret>)")
    }
}

impl WebhookSecret {
    fn from_bytes(key: &[u8]) -> Self {
        // HMAC takes keys of any length; this cannot fail.
        let mac = HmacSha256::new_from_slice(key).unwrap_or_else(|_| unreachable!("HMAC accepts any key length"));
        Self { mac }
    }

    /// Reads `whsec_<base64>` (standard alphabet, padding optional) of 24 to 64 key bytes. The
    /// error says what is wrong, never what was given.
    pub fn parse(s: &str) -> Result<Self, WebhookError> {
        let s = s.trim();
        let Some(b64) = s.strip_prefix(SECRET_PREFIX) else {
            return Err(WebhookError::InvalidSecret(format!("it must start with `{SECRET_PREFIX}`")));
        };
        let key = LENIENT_BASE64.decode(b64).map_err(|_| {
            WebhookError::InvalidSecret(format!("the part after `{SECRET_PREFIX}` is not standard base64"))
        })?;
        if !(SECRET_MIN_BYTES..=SECRET_MAX_BYTES).contains(&key.len()) {
            return Err(WebhookError::InvalidSecret(format!(
                "it must decode to {SECRET_MIN_BYTES} to {SECRET_MAX_BYTES} bytes, not {}",
                key.len()
            )));
        }
        Ok(Self::from_bytes(&key))
    }

    /// A new random 32-byte secret and its `whsec_` text. The bytes are SHA-256 of three v4 UUIDs
    /// (366 bits from the operating system's random source), so no random-number crate is needed.
    pub fn generate() -> (Self, String) {
        let mut h = Sha256::new();
        h.update(b"captcha-relay/whsec/v1:");
        for _ in 0..3 {
            h.update(uuid::Uuid::new_v4().as_bytes());
        }
        let key: [u8; 32] = h.finalize().into();
        (Self::from_bytes(&key), format!("{SECRET_PREFIX}{}", STANDARD.encode(key)))
    }

    fn mac(&self, msg_id: &str, timestamp: u64, body: &[u8]) -> HmacSha256 {
        let mut mac = self.mac.clone();
        mac.update(msg_id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        mac
    }

    /// `v1,<base64(HMAC-SHA256(key, "{msg_id}.{timestamp}.{body}"))>`.
    pub fn sign(&self, msg_id: &str, timestamp: u64, body: &[u8]) -> String {
        format!("v1,{}", STANDARD.encode(self.mac(msg_id, timestamp, body).finalize().into_bytes()))
    }
}

/// The secrets an owner's deliveries are signed with: the current one first, at most one previous
/// (rotation: both valid at once, each gives a signature, so receivers can switch at their own
/// pace). Debug redacts.
#[derive(Clone)]
pub struct SigningKeys {
    current: WebhookSecret,
    previous: Option<WebhookSecret>,
}

impl std::fmt::Debug for SigningKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let previous = if self.previous.is_some() { "Some(<secret>)" } else { "None" };
        write!(f, "SigningKeys {{ current: <secret>, previous: {previous} }}")
    }
}

impl SigningKeys {
    pub fn new(current: WebhookSecret, previous: Option<WebhookSecret>) -> Self {
        Self { current, previous }
    }

    /// `whsec_a` or `whsec_a,whsec_b` (commas and/or whitespace between): the current one first.
    /// Empty, more than two, or a bad one is an error naming which, not its value.
    pub fn parse_list(s: &str) -> Result<Self, WebhookError> {
        let items: Vec<&str> = s.split(|c: char| c == ',' || c.is_whitespace()).filter(|p| !p.is_empty()).collect();
        let parse_nth = |i: usize, item: &str| {
            WebhookSecret::parse(item).map_err(|e| match e {
                WebhookError::InvalidSecret(why) => {
                    WebhookError::InvalidSecret(format!("secret {} of {}: {why}", i + 1, items.len()))
                }
                other => other,
            })
        };
        match items.as_slice() {
            [] => Err(WebhookError::NoSecrets),
            [current] => Ok(Self::new(parse_nth(0, current)?, None)),
            [current, previous] => Ok(Self::new(parse_nth(0, current)?, Some(parse_nth(1, previous)?))),
            more => Err(WebhookError::TooManySecrets(more.len())),
        }
    }

    pub fn current(&self) -> &WebhookSecret {
        &self.current
    }

    pub fn previous(&self) -> Option<&WebhookSecret> {
        self.previous.as_ref()
    }

    /// The `webhook-signature` header value: signatures space-separated, current first.
    pub fn signature_header(&self, msg_id: &str, timestamp: u64, body: &[u8]) -> String {
        let mut header = self.current.sign(msg_id, timestamp, body);
        if let Some(previous) = &self.previous {
            header.push(' ');
            header.push_str(&previous.sign(msg_id, timestamp, body));
        }
        header
    }
}

/// Verifies a delivery as a receiver would (for tests and the ops tool): the timestamp within
/// 5 minutes of `now_secs` either way, then any `v1,` signature of the space-separated list
/// matching, compared in constant time. Other versions and malformed entries are skipped.
pub fn verify(
    secret: &WebhookSecret,
    msg_id: &str,
    timestamp_header: &str,
    signature_header: &str,
    body: &[u8],
    now_secs: u64,
) -> Result<(), WebhookError> {
    if msg_id.is_empty() {
        return Err(WebhookError::MissingHeader("webhook-id"));
    }
    let ts = timestamp_header.trim();
    if ts.is_empty() {
        return Err(WebhookError::MissingHeader("webhook-timestamp"));
    }
    if signature_header.trim().is_empty() {
        return Err(WebhookError::MissingHeader("webhook-signature"));
    }
    if !ts.bytes().all(|b| b.is_ascii_digit()) {
        return Err(WebhookError::InvalidTimestamp);
    }
    let timestamp: u64 = ts.parse().map_err(|_| WebhookError::InvalidTimestamp)?;
    if now_secs.saturating_sub(timestamp) > TIMESTAMP_TOLERANCE_SECS {
        return Err(WebhookError::TimestampTooOld);
    }
    if timestamp.saturating_sub(now_secs) > TIMESTAMP_TOLERANCE_SECS {
        return Err(WebhookError::TimestampTooNew);
    }
    let mac = secret.mac(msg_id, timestamp, body);
    let mut matched = false;
    for entry in signature_header.split(' ').filter(|e| !e.is_empty()) {
        let Some(b64) = entry.strip_prefix("v1,") else { continue };
        let Ok(sig) = general_purpose::STANDARD.decode(b64) else { continue };
        // Every entry is checked, so the time taken does not say which one matched.
        matched |= mac.clone().verify_slice(&sig).is_ok();
    }
    if matched { Ok(()) } else { Err(WebhookError::NoMatchingSignature) }
}

#[cfg(test)]
mod tests;

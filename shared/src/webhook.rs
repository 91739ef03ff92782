//! Outgoing webhooks the Standard Webhooks way (<https://www.standardwebhooks.com/>): signed
//! `webhook-id` / `webhook-timestamp` / `webhook-signature` headers, `whsec_` secrets with
//! rotation, the SSRF guard for owner URLs, the HTTP sender and the retry schedule.
//!
//! An owner's URL is untrusted input that our servers connect to, so it is checked twice: by
//! [`check_url`] when it is submitted and again on every send, and by the sender's resolver at
//! connect time, which drops every address [`addr_allowed`] refuses. A name that resolves to a
//! public address when it is submitted and to 127.0.0.1 or 169.254.169.254 when it is sent (DNS
//! rebinding) is therefore still refused.

mod resolver;
mod sender;
mod signing;
mod url_policy;

pub use sender::{
    AttemptResult, MAX_BODY, MAX_RETRY_AFTER, Outgoing, PushMethod, RESPONSE_READ_LIMIT, Sender, USER_AGENT,
    parse_retry_after,
};
pub use signing::{
    SECRET_MAX_BYTES, SECRET_MIN_BYTES, SECRET_PREFIX, SigningKeys, TIMESTAMP_TOLERANCE_SECS, WebhookError,
    WebhookSecret, verify,
};
pub use url_policy::{MAX_URL_LEN, UrlPolicy, UrlRefused, addr_allowed, check_url};

//! The HTTP sender: one signed attempt of a push to an owner's URL, and what came of it.

use std::error::Error as StdError;
use std::time::{Duration, SystemTime};

use super::resolver::{AllAddressesRefused, DnsFailed, GuardedResolver, Lookup};
use super::signing::SigningKeys;
use super::url_policy::{UrlPolicy, check_url};

/// The largest body the sender sends. Results are small; anything bigger is a bug, not a payload.
pub const MAX_BODY: usize = 64 * 1024;
/// How much of a response body is read (then dropped) before the connection is let go.
pub const RESPONSE_READ_LIMIT: usize = 16 * 1024;
pub use crate::domain::schedule::MAX_RETRY_AFTER;
/// The `user-agent` of every delivery.
pub const USER_AGENT: &str = "captcha-relay-webhooks/1";

/// One request to send: a `POST` of `body` as `content_type`, or a `GET` of `url` (its query
/// carries the message; `body` is empty and signed as such).
pub struct Outgoing<'a> {
    pub url: &'a str,
    pub method: PushMethod,
    /// `webhook-id`: the same for every attempt of a message, so receivers can drop repeats.
    pub msg_id: &'a str,
    /// `webhook-timestamp`, unix seconds.
    pub timestamp: u64,
    pub content_type: &'static str,
    /// Over [`MAX_BODY`] is refused without sending.
    pub body: Vec<u8>,
    pub keys: &'a SigningKeys,
}

/// The HTTP method of a push: `POST` with a body (JSON, or 2captcha's pingback form), or `GET`
/// with the result in the URL's query (CaptchaAI's pingback).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PushMethod {
    Post,
    Get,
}

/// What one attempt came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AttemptResult {
    /// 2xx.
    Delivered { status: u16 },
    /// Anything else worth trying again: non-2xx other than 410 (3xx too: redirects are never
    /// followed), timeouts, connection errors, DNS failures. `error` is a short description (the
    /// status's reason or the error's kind) without the response body or the URL; `retry_after`
    /// is read from `Retry-After` (delta-seconds or HTTP-date) on any status, capped at 24 h.
    Retry { status: Option<u16>, error: String, retry_after: Option<Duration> },
    /// 410 Gone: the owner said stop.
    Gone,
    /// Never sent and never will be: the URL fails [`check_url`], or every address it resolves to
    /// is refused (SSRF guard), or the body is over the cap.
    Refused { reason: String },
}

/// Reads a `Retry-After` value: delta-seconds or an HTTP-date (a date in the past is zero),
/// capped at [`MAX_RETRY_AFTER`]. Anything else is None.
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim();
    let wait = if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) {
        // Too many digits for a u64 is still "a very long time".
        Duration::from_secs(value.parse::<u64>().unwrap_or(u64::MAX))
    } else {
        let at = httpdate::parse_http_date(value).ok()?;
        at.duration_since(now).unwrap_or(Duration::ZERO)
    };
    Some(wait.min(MAX_RETRY_AFTER))
}

/// The HTTP sender: one reqwest client (share it by cloning), redirects off, no proxy from the
/// environment, a per-request timeout covering connect and the whole exchange, response bodies
/// read at most 16 KiB and dropped, names resolved by [`GuardedResolver`]. IP-literal URLs
/// bypass the resolver in reqwest, so every send runs [`check_url`] first.
#[derive(Clone)]
pub struct Sender {
    http: reqwest::Client,
    policy: UrlPolicy,
}

impl std::fmt::Debug for Sender {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sender").field("policy", &self.policy).finish_non_exhaustive()
    }
}

impl Sender {
    pub fn new(policy: UrlPolicy, timeout: Duration) -> anyhow::Result<Self> {
        Self::with_lookup(policy, timeout, Lookup::System)
    }

    fn with_lookup(policy: UrlPolicy, timeout: Duration, lookup: Lookup) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            // One attempt is one request: the schedule, not the client, decides about retries.
            .retry(reqwest::retry::never())
            .dns_resolver(GuardedResolver { policy, lookup })
            .connect_timeout(timeout)
            .timeout(timeout)
            .pool_idle_timeout(Duration::from_secs(50))
            .user_agent(USER_AGENT)
            .build()?;
        Ok(Self { http, policy })
    }

    pub fn policy(&self) -> UrlPolicy {
        self.policy
    }

    /// Sends one attempt: the request ([`PushMethod`]) with the three `webhook-*` headers.
    pub async fn send(&self, req: &Outgoing<'_>) -> AttemptResult {
        if req.body.len() > MAX_BODY {
            return AttemptResult::Refused {
                reason: format!("the body is {} bytes, over the {MAX_BODY}-byte limit", req.body.len()),
            };
        }
        let url = match check_url(req.url, self.policy) {
            Ok(u) => u,
            Err(e) => return AttemptResult::Refused { reason: e.0 },
        };
        let Ok(msg_id) = http::HeaderValue::from_str(req.msg_id) else {
            return AttemptResult::Refused { reason: "the message id is not a valid header value".into() };
        };
        let Ok(content_type) = http::HeaderValue::from_str(req.content_type) else {
            return AttemptResult::Refused { reason: "the content type is not a valid header value".into() };
        };
        let signature = req.keys.signature_header(req.msg_id, req.timestamp, &req.body);
        let builder = match req.method {
            PushMethod::Post => {
                self.http.post(url).header(http::header::CONTENT_TYPE, content_type).body(req.body.clone())
            }
            PushMethod::Get => self.http.get(url),
        };
        let sent = builder
            .header("webhook-id", msg_id)
            .header("webhook-timestamp", req.timestamp)
            .header("webhook-signature", signature)
            .send()
            .await;
        let mut resp = match sent {
            Ok(r) => r,
            Err(e) => return failed(&e),
        };
        let status = resp.status();
        let retry_after = resp
            .headers()
            .get(http::header::RETRY_AFTER)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| parse_retry_after(v, SystemTime::now()));
        // Read a little of the body so a small answer leaves the connection reusable; never keep it.
        let mut read = 0;
        while read < RESPONSE_READ_LIMIT {
            match resp.chunk().await {
                Ok(Some(chunk)) => read += chunk.len(),
                _ => break,
            }
        }
        drop(resp);
        match status.as_u16() {
            200..=299 => AttemptResult::Delivered { status: status.as_u16() },
            410 => AttemptResult::Gone,
            code => AttemptResult::Retry {
                status: Some(code),
                error: format!("HTTP {code} {}", status.canonical_reason().unwrap_or("(unknown status)")),
                retry_after,
            },
        }
    }
}

/// A request that got no response: refused when the resolver refused every address, else a
/// retry with a short description. reqwest's own message names the URL (with its query), so
/// it is never used; the innermost cause (an OS or TLS error) is.
fn failed(err: &reqwest::Error) -> AttemptResult {
    let mut cause: Option<&(dyn StdError + 'static)> = err.source();
    let mut root: Option<&(dyn StdError + 'static)> = None;
    let mut dns = false;
    while let Some(e) = cause {
        if let Some(r) = e.downcast_ref::<AllAddressesRefused>() {
            return AttemptResult::Refused { reason: r.to_string() };
        }
        dns |= e.is::<DnsFailed>();
        if !e.is::<reqwest::Error>() {
            root = Some(e);
        }
        cause = e.source();
    }
    let kind = if err.is_timeout() {
        "timed out"
    } else if dns {
        "DNS lookup failed"
    } else if err.is_connect() {
        "connection failed"
    } else {
        "request failed"
    };
    let mut error = match root {
        Some(r) if !(dns && r.is::<DnsFailed>()) => format!("{kind}: {r}"),
        Some(r) => r.to_string(),
        None => kind.to_owned(),
    };
    if error.len() > 200 {
        let mut cut = 200;
        while !error.is_char_boundary(cut) {
            cut -= 1;
        }
        error.truncate(cut);
    }
    AttemptResult::Retry { status: None, error, retry_after: None }
}

#[cfg(test)]
mod tests;

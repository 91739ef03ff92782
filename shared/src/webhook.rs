//! Outgoing webhooks the Standard Webhooks way (<https://www.standardwebhooks.com/>): signed
//! `webhook-id` / `webhook-timestamp` / `webhook-signature` headers, `whsec_` secrets with
//! rotation, the SSRF guard for owner URLs, the HTTP sender and the retry schedule.
//!
//! An owner's URL is untrusted input that our servers connect to, so it is checked twice: by
//! [`check_url`] when it is submitted and again on every send, and by the sender's resolver at
//! connect time, which drops every address [`addr_allowed`] refuses. A name that resolves to a
//! public address when it is submitted and to 127.0.0.1 or 169.254.169.254 when it is sent (DNS
//! rebinding) is therefore still refused.

use std::error::Error as StdError;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, SystemTime};

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
/// The largest body the sender sends. Results are small; anything bigger is a bug, not a payload.
pub const MAX_BODY: usize = 64 * 1024;
/// The longest owner URL accepted, in bytes.
pub const MAX_URL_LEN: usize = 2048;
/// How much of a response body is read (then dropped) before the connection is let go.
pub const RESPONSE_READ_LIMIT: usize = 16 * 1024;
/// The longest wait a `Retry-After` can ask for; longer asks are cut to this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);
/// The `user-agent` of every delivery.
pub const USER_AGENT: &str = "captcha-relay-webhooks/1";

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

/// Where deliveries may go.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UrlPolicy {
    /// AWS: https only; the host must resolve only to public unicast addresses.
    PublicHttps,
    /// Local mode with an explicit setting: http or https, loopback addresses allowed too (other
    /// private ranges and metadata addresses still refused).
    AllowLoopback,
}

/// Why an owner URL is refused: a short, clear, loggable sentence (never contains credentials of
/// the URL, nor its path or query).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct UrlRefused(pub String);

fn refused(why: impl Into<String>) -> UrlRefused {
    UrlRefused(why.into())
}

/// Static checks at submit time and again at send time: an absolute http(s) URL (https only
/// under `PublicHttps`), at most 2,048 bytes, with a host, no userinfo (`user:pass@`) and no
/// fragment. An IP-literal host (in any form the URL standard reads as one: `0x7f000001`,
/// `2130706433`, `127.1` all become 127.0.0.1) must pass [`addr_allowed`]; the names
/// `localhost`, `*.localhost`, `*.internal`, `*.local` and `metadata.google.internal` are refused,
/// except `localhost` and `*.localhost` under `AllowLoopback`. Names are not resolved here: the
/// sender's resolver checks every address at connect time. Returns the parsed URL.
pub fn check_url(url: &str, policy: UrlPolicy) -> Result<url::Url, UrlRefused> {
    if url.len() > MAX_URL_LEN {
        return Err(refused(format!("the URL is {} bytes long, over the {MAX_URL_LEN}-byte limit", url.len())));
    }
    // The parser's messages are fixed texts ("invalid port number"), never the input.
    let parsed = url::Url::parse(url).map_err(|e| refused(format!("not a valid absolute URL ({e})")))?;
    match (parsed.scheme(), policy) {
        ("https", _) | ("http", UrlPolicy::AllowLoopback) => {}
        ("http", UrlPolicy::PublicHttps) => return Err(refused("the URL must use https")),
        _ => return Err(refused("the URL must be http or https")),
    }
    if !parsed.username().is_empty() || parsed.password().is_some() {
        return Err(refused("the URL must not carry a user name or password (user:pass@)"));
    }
    if parsed.fragment().is_some() {
        return Err(refused("the URL must not have a #fragment"));
    }
    match parsed.host() {
        None => return Err(refused("the URL has no host")),
        Some(url::Host::Ipv4(ip)) => check_ip_host(IpAddr::V4(ip), policy)?,
        Some(url::Host::Ipv6(ip)) => check_ip_host(IpAddr::V6(ip), policy)?,
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            if name.is_empty() {
                return Err(refused("the URL has no host"));
            }
            let under = |suffix: &str| name == suffix || name.ends_with(&format!(".{suffix}"));
            if under("localhost") {
                if policy != UrlPolicy::AllowLoopback {
                    return Err(refused(format!("the host {name} is a loopback name")));
                }
            } else if name == "metadata.google.internal" {
                return Err(refused("the host is a cloud metadata service"));
            } else if under("internal") || under("local") {
                return Err(refused(format!("the host {name} is a private (.internal / .local) name")));
            }
        }
    }
    Ok(parsed)
}

fn check_ip_host(ip: IpAddr, policy: UrlPolicy) -> Result<(), UrlRefused> {
    if addr_allowed(ip, policy) {
        Ok(())
    } else {
        Err(refused(format!("the address {ip} is not a public unicast address")))
    }
}

/// Is this address one deliveries may connect to. Refuses 0.0.0.0/8 (incl. unspecified),
/// loopback 127/8 (unless `AllowLoopback`), private 10/8 172.16/12 192.168/16, CGNAT 100.64/10,
/// link-local 169.254/16 (incl. 169.254.169.254, the metadata service), 192.0.0/24, the 6to4
/// relay 192.88.99/24, benchmarking 198.18/15, the documentation ranges, multicast 224/4, reserved
/// 240/4 and broadcast. IPv6: only global unicast 2000::/3 is allowed, less documentation
/// (2001:db8::/32, 3fff::/20), Teredo 2001::/32, benchmarking 2001:2::/48 and ORCHID
/// 2001:10::/28, 2001:20::/28 — so ::, fc00::/7 (incl. fd00:ec2::254), fe80::/10, ff00::/8 and
/// 64:ff9b:1::/48 are refused, ::1 too unless `AllowLoopback`. v4-mapped, v4-translated,
/// v4-compatible, NAT64 64:ff9b::/96 and 6to4 2002::/16 addresses are judged as their IPv4.
pub fn addr_allowed(ip: IpAddr, policy: UrlPolicy) -> bool {
    match ip {
        IpAddr::V4(v4) => v4_allowed(v4, policy),
        IpAddr::V6(v6) => v6_allowed(v6, policy),
    }
}

fn v4_allowed(ip: Ipv4Addr, policy: UrlPolicy) -> bool {
    let [a, b, c, _] = ip.octets();
    if a == 127 {
        return policy == UrlPolicy::AllowLoopback;
    }
    let refused = a == 0
        || a == 10
        || (a == 100 && (64..128).contains(&b))
        || (a == 169 && b == 254)
        || (a == 172 && (16..32).contains(&b))
        || (a == 192 && b == 0 && (c == 0 || c == 2))
        || (a == 192 && b == 88 && c == 99)
        || (a == 192 && b == 168)
        || (a == 198 && (b == 18 || b == 19))
        || (a == 198 && b == 51 && c == 100)
        || (a == 203 && b == 0 && c == 113)
        // Multicast 224/4, reserved 240/4 and the broadcast address.
        || a >= 224;
    !refused
}

fn v6_allowed(ip: Ipv6Addr, policy: UrlPolicy) -> bool {
    if ip.is_unspecified() {
        return false;
    }
    if ip.is_loopback() {
        return policy == UrlPolicy::AllowLoopback;
    }
    if let Some(v4) = embedded_v4(ip) {
        return v4_allowed(v4, policy);
    }
    let s = ip.segments();
    let global_unicast = (s[0] & 0xe000) == 0x2000;
    let special = (s[0] == 0x2001 && s[1] == 0x0db8)
        || (s[0] == 0x3fff && s[1] < 0x1000)
        || (s[0] == 0x2001 && s[1] == 0)
        || (s[0] == 0x2001 && s[1] == 2 && s[2] == 0)
        || (s[0] == 0x2001 && (s[1] & 0xfff0) == 0x0010)
        || (s[0] == 0x2001 && (s[1] & 0xfff0) == 0x0020);
    global_unicast && !special
}

/// The IPv4 address an IPv6 address stands for, where it stands for one.
fn embedded_v4(ip: Ipv6Addr) -> Option<Ipv4Addr> {
    let s = ip.segments();
    let low = Ipv4Addr::new((s[6] >> 8) as u8, s[6] as u8, (s[7] >> 8) as u8, s[7] as u8);
    match s {
        // v4-mapped ::ffff:a.b.c.d and v4-compatible ::a.b.c.d (:: and ::1 are handled before).
        [0, 0, 0, 0, 0, 0xffff | 0, _, _] => Some(low),
        // v4-translated ::ffff:0:a.b.c.d (SIIT).
        [0, 0, 0, 0, 0xffff, 0, _, _] => Some(low),
        // NAT64, the well-known prefix 64:ff9b::/96.
        [0x64, 0xff9b, 0, 0, 0, 0, _, _] => Some(low),
        // 6to4 2002:AABB:CCDD::/48.
        [0x2002, hi, lo, ..] => Some(Ipv4Addr::new((hi >> 8) as u8, hi as u8, (lo >> 8) as u8, lo as u8)),
        _ => None,
    }
}

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

/// Every address a name resolved to was refused by [`addr_allowed`]: the delivery is refused,
/// not retried.
#[derive(Debug)]
struct AllAddressesRefused {
    refused: Vec<IpAddr>,
}

impl std::fmt::Display for AllAddressesRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let shown: Vec<String> = self.refused.iter().take(3).map(IpAddr::to_string).collect();
        let more = if self.refused.len() > 3 { format!(" and {} more", self.refused.len() - 3) } else { String::new() };
        write!(f, "the host resolves only to refused addresses ({}{more})", shown.join(", "))
    }
}

impl StdError for AllAddressesRefused {}

/// A name that could not be resolved (or resolved to nothing): worth retrying.
#[derive(Debug)]
struct DnsFailed(String);

impl std::fmt::Display for DnsFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "DNS lookup failed: {}", self.0)
    }
}

impl StdError for DnsFailed {}

/// Boxes an error as itself (`Box::new(e).into()` would box the box, and the error chain could
/// no longer be searched for it by type).
fn boxed(e: impl StdError + Send + Sync + 'static) -> Box<dyn StdError + Send + Sync> {
    Box::new(e)
}

/// Where names are looked up: the system's resolver through tokio, or (in tests) a fixed table.
#[derive(Clone)]
enum Lookup {
    System,
    #[cfg(test)]
    Table(std::sync::Arc<std::collections::HashMap<String, Vec<IpAddr>>>),
}

/// The sender's DNS resolver: resolves, then keeps only the addresses [`addr_allowed`] accepts.
/// Runs at connect time, so the addresses connected to are the ones checked.
struct GuardedResolver {
    policy: UrlPolicy,
    lookup: Lookup,
}

impl reqwest::dns::Resolve for GuardedResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let (policy, lookup, host) = (self.policy, self.lookup.clone(), name.as_str().to_owned());
        Box::pin(async move {
            let addrs: Vec<SocketAddr> = match lookup {
                Lookup::System => tokio::net::lookup_host((host.as_str(), 0))
                    .await
                    .map_err(|e| boxed(DnsFailed(e.kind().to_string())))?
                    .collect(),
                #[cfg(test)]
                Lookup::Table(table) => table
                    .get(&host)
                    .ok_or_else(|| boxed(DnsFailed("not in the test table".into())))?
                    .iter()
                    .map(|ip| SocketAddr::new(*ip, 0))
                    .collect(),
            };
            if addrs.is_empty() {
                return Err(boxed(DnsFailed("no addresses".into())));
            }
            let (allowed, refused): (Vec<SocketAddr>, Vec<SocketAddr>) =
                addrs.into_iter().partition(|a| addr_allowed(a.ip(), policy));
            if allowed.is_empty() {
                let refused = refused.iter().map(SocketAddr::ip).collect();
                return Err(boxed(AllAddressesRefused { refused }));
            }
            Ok(Box::new(allowed.into_iter()) as reqwest::dns::Addrs)
        })
    }
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
mod tests {
    use super::*;
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};
    use std::time::{Instant, UNIX_EPOCH};
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    const SPEC_SECRET: &str = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw";

    fn now_secs() -> u64 {
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
    }

    fn secret(s: &str) -> WebhookSecret {
        WebhookSecret::parse(s).expect("a valid secret")
    }

    #[test]
    fn the_standard_webhooks_spec_vector_signs_as_published() {
        let s = secret(SPEC_SECRET);
        let body = br#"{"test": 2432232314}"#;
        let sig = s.sign("msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body);
        assert_eq!(sig, "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE=");
        assert_eq!(verify(&s, "msg_p5jXN8AQM9LWM0D4loKWxJek", "1614265330", &sig, body, 1614265330 + 60), Ok(()));
    }

    #[test]
    fn secrets_parse_strictly_and_never_echo_the_value() {
        // Unpadded and padded forms of the same key sign the same.
        let padded = WebhookSecret::generate().1;
        let unpadded = padded.trim_end_matches('=');
        assert_ne!(padded, unpadded, "32 bytes encode with one `=`");
        assert_eq!(secret(&padded).sign("m", 1, b"x"), secret(unpadded).sign("m", 1, b"x"));
        for bad in [
            "MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw",               // no prefix
            "whsec_",                                         // empty
            "whsec_!!notbase64!!notbase64!!notbase64!!",      // not base64
            "whsec_c2hvcnQ=",                                 // 5 bytes
            &format!("whsec_{}", STANDARD.encode([7u8; 65])), // 65 bytes
        ] {
            let e = WebhookSecret::parse(bad).expect_err(bad);
            assert!(matches!(e, WebhookError::InvalidSecret(_)), "{bad}: {e:?}");
            let msg = e.to_string();
            let value = bad.trim_start_matches("whsec_");
            assert!(value.is_empty() || !msg.contains(value), "{msg} echoes the value");
        }
        assert!(WebhookSecret::parse(&format!("whsec_{}", STANDARD.encode([7u8; 24]))).is_ok());
        assert!(WebhookSecret::parse(&format!("whsec_{}", STANDARD.encode([7u8; 64]))).is_ok());
        let (_, a) = WebhookSecret::generate();
        let (_, b) = WebhookSecret::generate();
        assert_ne!(a, b);
        assert_eq!(STANDARD.decode(a.trim_start_matches("whsec_")).expect("base64").len(), 32);
        assert_eq!(format!("{:?}", secret(&a)), "WebhookSecret(<secret>)");
    }

    #[test]
    fn signing_key_lists_take_one_or_two_current_first() {
        let (_, a) = WebhookSecret::generate();
        let (_, b) = WebhookSecret::generate();
        let (_, c) = WebhookSecret::generate();
        let one = SigningKeys::parse_list(&a).expect("one");
        assert!(one.previous().is_none());
        assert_eq!(one.signature_header("m", 5, b"x"), secret(&a).sign("m", 5, b"x"));
        for list in [format!("{a},{b}"), format!("{a} {b}"), format!(" {a} , {b}\n")] {
            let two = SigningKeys::parse_list(&list).expect("two");
            let want = format!("{} {}", secret(&a).sign("m", 5, b"x"), secret(&b).sign("m", 5, b"x"));
            assert_eq!(two.signature_header("m", 5, b"x"), want, "{list:?}");
        }
        assert_eq!(SigningKeys::parse_list("").expect_err("empty"), WebhookError::NoSecrets);
        assert_eq!(SigningKeys::parse_list(" , ").expect_err("empty"), WebhookError::NoSecrets);
        assert_eq!(
            SigningKeys::parse_list(&format!("{a},{b},{c}")).expect_err("three"),
            WebhookError::TooManySecrets(3)
        );
        let e = SigningKeys::parse_list(&format!("{a},whsec_c2hvcnQ=")).expect_err("bad second");
        assert!(e.to_string().contains("secret 2 of 2"), "{e}");
        assert!(!e.to_string().contains("c2hvcnQ"), "{e}");
        let dbg = format!("{:?}", SigningKeys::parse_list(&format!("{a},{b}")).expect("two"));
        assert!(!dbg.contains(a.trim_start_matches("whsec_")) && dbg.contains("<secret>"), "{dbg}");
    }

    #[test]
    fn rotation_both_secrets_verify_a_third_and_tampering_do_not() {
        let (cur, _) = WebhookSecret::generate();
        let (prev, _) = WebhookSecret::generate();
        let (other, _) = WebhookSecret::generate();
        let keys = SigningKeys::new(cur.clone(), Some(prev.clone()));
        let now = 1_700_000_000;
        let body = br#"{"id":"t1","code":"03AGdBq2"}"#;
        let header = keys.signature_header("msg_1", now, body);
        assert_eq!(header.split(' ').count(), 2);
        assert!(header.split(' ').all(|s| s.starts_with("v1,")));
        let ts = now.to_string();
        assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now), Ok(()));
        assert_eq!(verify(&prev, "msg_1", &ts, &header, body, now), Ok(()));
        assert_eq!(verify(&other, "msg_1", &ts, &header, body, now), Err(WebhookError::NoMatchingSignature));
        // Tampered body, id, timestamp.
        let mut tampered = body.to_vec();
        tampered[5] ^= 1;
        assert_eq!(verify(&cur, "msg_1", &ts, &header, &tampered, now), Err(WebhookError::NoMatchingSignature));
        assert_eq!(verify(&cur, "msg_2", &ts, &header, body, now), Err(WebhookError::NoMatchingSignature));
        let ts1 = (now + 1).to_string();
        assert_eq!(verify(&cur, "msg_1", &ts1, &header, body, now), Err(WebhookError::NoMatchingSignature));
        // A truncated or re-versioned signature does not pass.
        let only_cur = cur.sign("msg_1", now, body);
        assert!(verify(&cur, "msg_1", &ts, &only_cur[..only_cur.len() - 2], body, now).is_err());
        assert!(verify(&cur, "msg_1", &ts, &only_cur.replacen("v1,", "v2,", 1), body, now).is_err());
        // Timestamps: 5 minutes each way pass, more fails, junk fails.
        assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now + 300), Ok(()));
        assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now + 301), Err(WebhookError::TimestampTooOld));
        assert_eq!(verify(&cur, "msg_1", &ts, &header, body, now - 301), Err(WebhookError::TimestampTooNew));
        assert_eq!(verify(&cur, "msg_1", "17e8", &header, body, now), Err(WebhookError::InvalidTimestamp));
        assert_eq!(verify(&cur, "", &ts, &header, body, now), Err(WebhookError::MissingHeader("webhook-id")));
        assert_eq!(verify(&cur, "msg_1", &ts, "", body, now), Err(WebhookError::MissingHeader("webhook-signature")));
    }

    #[test]
    fn addresses_public_unicast_only() {
        use UrlPolicy::*;
        let cases: &[(&str, bool, bool)] = &[
            // (address, allowed under PublicHttps, allowed under AllowLoopback)
            ("93.184.215.14", true, true),
            ("8.8.8.8", true, true),
            ("1.1.1.1", true, true),
            ("127.0.0.1", false, true),
            ("127.255.0.9", false, true),
            ("0.0.0.0", false, false),
            ("0.1.2.3", false, false),
            ("10.0.0.1", false, false),
            ("172.16.0.1", false, false),
            ("172.31.255.255", false, false),
            ("172.32.0.1", true, true),
            ("192.168.1.1", false, false),
            ("100.64.0.1", false, false),
            ("100.127.255.254", false, false),
            ("100.128.0.1", true, true),
            ("169.254.169.254", false, false),
            ("169.254.0.1", false, false),
            ("192.0.0.170", false, false),
            ("192.0.2.1", false, false),
            ("198.18.0.1", false, false),
            ("198.19.255.1", false, false),
            ("198.51.100.7", false, false),
            ("203.0.113.9", false, false),
            ("224.0.0.1", false, false),
            ("239.255.255.250", false, false),
            ("240.0.0.1", false, false),
            ("255.255.255.255", false, false),
            ("2606:4700:4700::1111", true, true),
            ("2a00:1450:4001:81c::200e", true, true),
            ("::1", false, true),
            ("::", false, false),
            ("fc00::1", false, false),
            ("fd00:ec2::254", false, false),
            ("fe80::1", false, false),
            ("ff02::1", false, false),
            ("2001:db8::1", false, false),
            ("3fff::1", false, false),
            ("100::1", false, false),
            ("::ffff:127.0.0.1", false, true),
            ("::ffff:169.254.169.254", false, false),
            ("::ffff:10.1.2.3", false, false),
            ("::ffff:8.8.8.8", true, true),
            ("::127.0.0.1", false, true),
            ("::10.0.0.1", false, false),
            ("::ffff:0:a9fe:a9fe", false, false),
            ("64:ff9b::a9fe:a9fe", false, false),
            ("64:ff9b::7f00:1", false, true),
            ("64:ff9b::808:808", true, true),
            ("64:ff9b:1::1", false, false),
            ("2002:a9fe:a9fe::1", false, false),
            ("2002:0808:0808::1", true, true),
            ("2001::1", false, false),
        ];
        for (ip, public, lo) in cases {
            let addr: IpAddr = ip.parse().expect(ip);
            assert_eq!(addr_allowed(addr, PublicHttps), *public, "{ip} under PublicHttps");
            assert_eq!(addr_allowed(addr, AllowLoopback), *lo, "{ip} under AllowLoopback");
        }
    }

    #[test]
    fn urls_checked_statically() {
        use UrlPolicy::*;
        let ok = |u: &str, p| check_url(u, p).map(|_| ()).map_err(|e| e.0);
        let cases: &[(&str, bool, bool)] = &[
            // (URL, accepted under PublicHttps, accepted under AllowLoopback)
            ("https://example.com/hook?token=abc", true, true),
            ("https://hooks.example.com:8443/a/b", true, true),
            ("https://93.184.215.14/hook", true, true),
            ("http://example.com/", false, true),
            ("ftp://example.com/", false, false),
            ("file:///etc/passwd", false, false),
            ("/relative/path", false, false),
            ("https://", false, false),
            ("https://user:pw@example.com/", false, false),
            ("https://user@example.com/", false, false),
            ("https://example.com/#frag", false, false),
            ("http://169.254.169.254/latest/meta-data", false, false),
            ("https://169.254.169.254/latest/meta-data", false, false),
            ("https://[::ffff:127.0.0.1]/", false, true),
            ("https://[::ffff:169.254.169.254]/", false, false),
            ("https://[fd00:ec2::254]/", false, false),
            ("https://[::1]:8080/", false, true),
            ("https://10.0.0.1/", false, false),
            ("https://192.168.0.10/", false, false),
            ("https://0x7f000001/", false, true),
            ("https://2130706433/", false, true),
            ("https://127.1/", false, true),
            ("https://0177.0.0.1/", false, true),
            ("https://0.0.0.0/", false, false),
            ("https://0/", false, false),
            ("https://localhost/", false, true),
            ("http://localhost:8080/hook", false, true),
            ("https://LOCALHOST./", false, true),
            ("https://app.localhost/", false, true),
            ("https://metadata.google.internal/computeMetadata/v1/", false, false),
            ("https://service.internal/", false, false),
            ("https://printer.local/", false, false),
            ("https://printer.local./", false, false),
        ];
        for (url, public, lo) in cases {
            assert_eq!(ok(url, PublicHttps).is_ok(), *public, "{url} under PublicHttps: {:?}", ok(url, PublicHttps));
            assert_eq!(ok(url, AllowLoopback).is_ok(), *lo, "{url} under AllowLoopback: {:?}", ok(url, AllowLoopback));
        }
        let long = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN));
        assert!(check_url(&long, PublicHttps).is_err());
        let just = format!("https://example.com/{}", "a".repeat(MAX_URL_LEN - "https://example.com/".len()));
        assert!(check_url(&just, PublicHttps).is_ok());
        // The reason never carries credentials, the path or the query.
        for url in [
            "https://alice:hunter2@example.com/x",
            "http://example.com/p?token=s3cr3t",
            "https://10.0.0.1/p?token=s3cr3t",
        ] {
            let why = check_url(url, PublicHttps).expect_err(url).0;
            for secret in ["alice", "hunter2", "s3cr3t", "/p"] {
                assert!(!why.contains(secret), "{why}");
            }
        }
        assert_eq!(check_url("https://0x7f000001/", AllowLoopback).expect("ok").host_str(), Some("127.0.0.1"));
    }

    #[test]
    fn retry_after_reads_seconds_and_dates_capped_at_a_day() {
        let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
        assert_eq!(parse_retry_after("120", now), Some(Duration::from_secs(120)));
        assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after("999999", now), Some(MAX_RETRY_AFTER));
        assert_eq!(parse_retry_after("99999999999999999999999", now), Some(MAX_RETRY_AFTER));
        let later = httpdate::fmt_http_date(now + Duration::from_secs(3600));
        assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(3600)));
        let past = httpdate::fmt_http_date(now - Duration::from_secs(3600));
        assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
        for bad in ["", "-5", "1.5", "soon", "Thu, 99 Foo 2023"] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    // ---- The sender against real loopback HTTP servers (hand-written, so every connection is
    // ---- counted and the server can misbehave exactly).

    #[derive(Clone)]
    enum Reply {
        /// A whole response, written as is.
        Raw(String),
        /// Read the request, then say nothing for a minute.
        Hang,
        /// 200 announcing a 50 MB body: its first megabyte, then silence.
        Huge,
    }

    #[derive(Debug)]
    struct Seen {
        request_line: String,
        headers: HashMap<String, String>,
        body: Vec<u8>,
    }

    struct Server {
        port: u16,
        connections: Arc<AtomicUsize>,
        seen: Arc<Mutex<Vec<Seen>>>,
        task: tokio::task::JoinHandle<()>,
    }

    impl Drop for Server {
        fn drop(&mut self) {
            self.task.abort();
        }
    }

    impl Server {
        fn connections(&self) -> usize {
            self.connections.load(Ordering::SeqCst)
        }
        fn url(&self, host: &str, path: &str) -> String {
            format!("http://{host}:{}{path}", self.port)
        }
    }

    async fn serve(reply: Reply) -> Server {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = listener.local_addr().expect("addr").port();
        let connections = Arc::new(AtomicUsize::new(0));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let (c, s) = (connections.clone(), seen.clone());
        let task = tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                c.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(answer(stream, reply.clone(), s.clone()));
            }
        });
        Server { port, connections, seen, task }
    }

    async fn read_request(stream: &mut TcpStream) -> Option<Seen> {
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let head_end = loop {
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                break i;
            }
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 || buf.len() > 1 << 20 {
                return None;
            }
            buf.extend_from_slice(&chunk[..n]);
        };
        let head = String::from_utf8(buf[..head_end].to_vec()).ok()?;
        let mut lines = head.split("\r\n");
        let request_line = lines.next()?.to_owned();
        let headers: HashMap<String, String> = lines
            .filter_map(|l| l.split_once(':'))
            .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
            .collect();
        let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
        let mut body = buf[head_end + 4..].to_vec();
        while body.len() < len {
            let n = stream.read(&mut chunk).await.ok()?;
            if n == 0 {
                return None;
            }
            body.extend_from_slice(&chunk[..n]);
        }
        Some(Seen { request_line, headers, body })
    }

    async fn answer(mut stream: TcpStream, reply: Reply, seen: Arc<Mutex<Vec<Seen>>>) {
        let Some(req) = read_request(&mut stream).await else { return };
        seen.lock().expect("lock").push(req);
        match reply {
            Reply::Raw(text) => {
                let _ = stream.write_all(text.as_bytes()).await;
            }
            Reply::Hang => tokio::time::sleep(Duration::from_secs(60)).await,
            Reply::Huge => {
                let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 50000000\r\n\r\n";
                if stream.write_all(head.as_bytes()).await.is_err() {
                    return;
                }
                // The first megabyte, then nothing: a client that reads the whole body waits
                // for its timeout instead of returning at once.
                let block = vec![b'x'; 64 * 1024];
                for _ in 0..16 {
                    if stream.write_all(&block).await.is_err() {
                        return;
                    }
                }
                tokio::time::sleep(Duration::from_secs(60)).await;
            }
        }
    }

    fn raw(status_line: &str, extra_headers: &str) -> Reply {
        Reply::Raw(format!("HTTP/1.1 {status_line}\r\n{extra_headers}content-length: 2\r\nconnection: close\r\n\r\nno"))
    }

    fn keys() -> (SigningKeys, WebhookSecret, WebhookSecret) {
        let (cur, _) = WebhookSecret::generate();
        let (prev, _) = WebhookSecret::generate();
        (SigningKeys::new(cur.clone(), Some(prev.clone())), cur, prev)
    }

    fn outgoing<'a>(url: &'a str, keys: &'a SigningKeys, body: &[u8]) -> Outgoing<'a> {
        Outgoing {
            url,
            method: PushMethod::Post,
            msg_id: "msg_2Vv8Qm3TfLxZ",
            timestamp: now_secs(),
            content_type: "application/json",
            body: body.to_vec(),
            keys,
        }
    }

    fn loopback_sender() -> Sender {
        Sender::new(UrlPolicy::AllowLoopback, Duration::from_secs(5)).expect("sender")
    }

    async fn send_to(reply: Reply) -> (AttemptResult, Server) {
        let server = serve(reply).await;
        let (k, _, _) = keys();
        let url = server.url("127.0.0.1", "/hook");
        let got = loopback_sender().send(&outgoing(&url, &k, b"{}")).await;
        (got, server)
    }

    #[tokio::test]
    async fn sender_200_is_delivered_with_signed_headers_and_the_body_unchanged() {
        let server = serve(raw("200 OK", "")).await;
        let (k, cur, prev) = keys();
        let body = "{\"id\":\"t-1\",\"code\":\"résultat ✓\",\"n\":[1,2,3]}".as_bytes();
        let url = server.url("127.0.0.1", "/hooks/in?tenant=7");
        let req = outgoing(&url, &k, body);
        assert_eq!(loopback_sender().send(&req).await, AttemptResult::Delivered { status: 200 });
        let seen = server.seen.lock().expect("lock");
        assert_eq!(seen.len(), 1);
        let r = &seen[0];
        assert_eq!(r.request_line, "POST /hooks/in?tenant=7 HTTP/1.1");
        assert_eq!(r.body, body);
        assert_eq!(r.headers["webhook-id"], "msg_2Vv8Qm3TfLxZ");
        assert_eq!(r.headers["webhook-timestamp"], req.timestamp.to_string());
        assert_eq!(r.headers["content-type"], "application/json");
        assert_eq!(r.headers["user-agent"], USER_AGENT);
        let sig = &r.headers["webhook-signature"];
        assert_eq!(sig.split(' ').count(), 2, "{sig}");
        for s in [&cur, &prev] {
            assert_eq!(
                verify(s, &r.headers["webhook-id"], &r.headers["webhook-timestamp"], sig, &r.body, now_secs()),
                Ok(())
            );
        }
    }

    #[tokio::test]
    async fn sender_500_is_retried() {
        let (got, _s) = send_to(raw("500 Internal Server Error", "")).await;
        assert_eq!(
            got,
            AttemptResult::Retry {
                status: Some(500),
                error: "HTTP 500 Internal Server Error".into(),
                retry_after: None
            }
        );
    }

    #[tokio::test]
    async fn sender_429_with_retry_after_seconds() {
        let (got, _s) = send_to(raw("429 Too Many Requests", "Retry-After: 120\r\n")).await;
        let AttemptResult::Retry { status: Some(429), retry_after, .. } = got else { panic!("{got:?}") };
        assert_eq!(retry_after, Some(Duration::from_secs(120)));
    }

    #[tokio::test]
    async fn sender_503_with_an_http_date_retry_after() {
        let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
        let (got, _s) = send_to(raw("503 Service Unavailable", &format!("Retry-After: {at}\r\n"))).await;
        let AttemptResult::Retry { status: Some(503), retry_after: Some(after), .. } = got else { panic!("{got:?}") };
        assert!(after > Duration::from_secs(3590) && after <= Duration::from_secs(3600), "{after:?}");
    }

    #[tokio::test]
    async fn sender_410_is_gone() {
        let (got, _s) = send_to(raw("410 Gone", "")).await;
        assert_eq!(got, AttemptResult::Gone);
    }

    #[tokio::test]
    async fn sender_302_is_retried_and_not_followed() {
        let target = serve(raw("200 OK", "")).await;
        let location = format!("Location: {}\r\n", target.url("127.0.0.1", "/elsewhere"));
        let (got, _s) = send_to(raw("302 Found", &location)).await;
        assert!(matches!(got, AttemptResult::Retry { status: Some(302), .. }), "{got:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(target.connections(), 0, "the redirect was followed");
    }

    #[tokio::test]
    async fn sender_gives_up_on_a_silent_server_within_the_timeout() {
        // A 1 s timeout, so the test is quick: the server reads the request and never answers.
        let server = serve(Reply::Hang).await;
        let sender = Sender::new(UrlPolicy::AllowLoopback, Duration::from_secs(1)).expect("sender");
        let (k, _, _) = keys();
        let url = server.url("127.0.0.1", "/hook");
        let started = Instant::now();
        let got = sender.send(&outgoing(&url, &k, b"{}")).await;
        let took = started.elapsed();
        let AttemptResult::Retry { status: None, error, retry_after: None } = got else { panic!("{got:?}") };
        assert!(error.starts_with("timed out"), "{error}");
        assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "{took:?}");
        assert_eq!(server.connections(), 1);
    }

    #[tokio::test]
    async fn sender_reads_little_of_a_huge_response() {
        // The sender's timeout is 5 s: reading past the 16 KiB it needs would wait that long.
        let started = Instant::now();
        let (got, _s) = send_to(Reply::Huge).await;
        assert_eq!(got, AttemptResult::Delivered { status: 200 });
        assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
    }

    #[tokio::test]
    async fn sender_connection_errors_are_retried_without_the_url() {
        let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let port = closed.local_addr().expect("addr").port();
        drop(closed);
        let (k, _, _) = keys();
        let url = format!("http://127.0.0.1:{port}/hook?token=s3cr3t");
        let got = loopback_sender().send(&outgoing(&url, &k, b"{}")).await;
        let AttemptResult::Retry { status: None, error, .. } = got else { panic!("{got:?}") };
        assert!(error.starts_with("connection failed"), "{error}");
        assert!(!error.contains("s3cr3t") && !error.contains("/hook"), "{error}");
    }

    #[tokio::test]
    async fn sender_refuses_loopback_under_public_https_without_connecting() {
        let server = serve(raw("200 OK", "")).await;
        let sender = Sender::new(UrlPolicy::PublicHttps, Duration::from_secs(5)).expect("sender");
        assert_eq!(sender.policy(), UrlPolicy::PublicHttps);
        let (k, _, _) = keys();
        for url in [
            format!("https://127.0.0.1:{}/", server.port),
            format!("https://[::ffff:127.0.0.1]:{}/", server.port),
            format!("https://2130706433:{}/", server.port),
            format!("https://localhost:{}/", server.port),
            format!("http://127.0.0.1:{}/", server.port),
        ] {
            let got = sender.send(&outgoing(&url, &k, b"{}")).await;
            assert!(matches!(got, AttemptResult::Refused { .. }), "{url}: {got:?}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(server.connections(), 0);
    }

    #[tokio::test]
    async fn sender_refuses_an_oversized_body_without_connecting() {
        let server = serve(raw("200 OK", "")).await;
        let (k, _, _) = keys();
        let url = server.url("127.0.0.1", "/hook");
        let sender = loopback_sender();
        let got = sender.send(&outgoing(&url, &k, &vec![b'a'; MAX_BODY + 1])).await;
        assert!(matches!(got, AttemptResult::Refused { .. }), "{got:?}");
        assert_eq!(
            sender.send(&outgoing(&url, &k, &vec![b'a'; MAX_BODY])).await,
            AttemptResult::Delivered { status: 200 }
        );
        assert_eq!(server.connections(), 1);
    }

    #[tokio::test]
    async fn sender_under_allow_loopback_reaches_localhost_by_name() {
        let server = serve(raw("204 No Content", "")).await;
        let (k, _, _) = keys();
        let url = server.url("localhost", "/hook");
        assert_eq!(loopback_sender().send(&outgoing(&url, &k, b"{}")).await, AttemptResult::Delivered { status: 204 });
        assert_eq!(server.seen.lock().expect("lock").len(), 1);
    }

    fn table_sender(policy: UrlPolicy, entries: &[(&str, &[&str])]) -> Sender {
        let table = entries
            .iter()
            .map(|(name, ips)| (name.to_string(), ips.iter().map(|i| i.parse().expect("ip")).collect()))
            .collect();
        Sender::with_lookup(policy, Duration::from_secs(5), Lookup::Table(Arc::new(table))).expect("sender")
    }

    #[tokio::test]
    async fn resolver_refuses_metadata_and_rebound_names_at_connect_time() {
        let server = serve(raw("200 OK", "")).await;
        let (k, _, _) = keys();
        // Metadata, even where loopback is allowed: names pass check_url, their addresses do not.
        let lo = table_sender(
            UrlPolicy::AllowLoopback,
            &[
                ("meta.example", &["169.254.169.254"]),
                ("meta6.example", &["fd00:ec2::254", "::ffff:169.254.169.254"]),
                ("mixed.example", &["169.254.169.254", "10.0.0.5", "127.0.0.1"]),
            ],
        );
        for name in ["meta.example", "meta6.example"] {
            let url = server.url(name, "/latest/meta-data?x=1");
            let got = lo.send(&outgoing(&url, &k, b"{}")).await;
            let AttemptResult::Refused { reason } = &got else { panic!("{name}: {got:?}") };
            assert!(reason.contains("refused addresses"), "{reason}");
            assert!(!reason.contains("x=1"), "{reason}");
        }
        // Only the allowed address of a mixed answer is used.
        let url = server.url("mixed.example", "/hook");
        assert_eq!(lo.send(&outgoing(&url, &k, b"{}")).await, AttemptResult::Delivered { status: 200 });
        assert_eq!(server.connections(), 1);
        // DNS rebinding under PublicHttps: a public-looking name that now resolves to loopback.
        let public = table_sender(UrlPolicy::PublicHttps, &[("hooks.example", &["127.0.0.1"])]);
        let url = format!("https://hooks.example:{}/hook", server.port);
        let got = public.send(&outgoing(&url, &k, b"{}")).await;
        assert!(matches!(got, AttemptResult::Refused { .. }), "{got:?}");
        // A name that does not resolve is worth retrying, not refused.
        let got = public.send(&outgoing(&format!("https://nowhere.example:{}/", server.port), &k, b"{}")).await;
        let AttemptResult::Retry { status: None, error, .. } = &got else { panic!("{got:?}") };
        assert!(error.starts_with("DNS lookup failed"), "{error}");
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(server.connections(), 1, "a refused address was connected to");
    }

    // ---- An independent verifier: the Standard Webhooks Python library.

    #[test]
    fn the_standard_webhooks_python_library_verifies_our_signatures() {
        use std::io::Write;
        let python = crate::testkit::receiver::python_with_standardwebhooks().expect("the reference library");
        let (cur, cur_text) = WebhookSecret::generate();
        let (prev, prev_text) = WebhookSecret::generate();
        let (_, other_text) = WebhookSecret::generate();
        let rotating = SigningKeys::new(cur.clone(), Some(prev));
        let single = SigningKeys::parse_list(&cur_text).expect("one key");
        let now = now_secs();
        let bodies = [
            r#"{"id":"t1","status":"ready","code":"03AGdBq24PBCbwiDRaS_MJ7Z"}"#.to_owned(),
            r#"{"id":"t2","status":"failed","error":"ERROR_CAPTCHA_UNSOLVABLE"}"#.to_owned(),
            "{\"text\":\"résultat ✓ 文字\"}".to_owned(),
            String::new(),
            "line one\nline two\r\n\ttabbed".to_owned(),
            format!("{{\"big\":\"{}\"}}", "x".repeat(20_000)),
        ];
        let msg = |secret: &str, id: &str, ts: String, sig: String, body: &str| {
            serde_json::json!({
                "secret": secret,
                "headers": {"webhook-id": id, "webhook-timestamp": ts, "webhook-signature": sig},
                "body": body,
            })
        };
        // (input, expected ok)
        let mut cases: Vec<(serde_json::Value, bool)> = Vec::new();
        for (i, body) in bodies.iter().enumerate() {
            let id = format!("msg_{i}_{}", uuid::Uuid::new_v4().simple());
            let header = rotating.signature_header(&id, now, body.as_bytes());
            cases.push((msg(&cur_text, &id, now.to_string(), header.clone(), body), true));
            cases.push((msg(&prev_text, &id, now.to_string(), header.clone(), body), true));
            if i % 2 == 0 {
                cases.push((msg(&other_text, &id, now.to_string(), header, body), false));
            }
        }
        let body = &bodies[0];
        let sig = single.signature_header("msg_single", now, body.as_bytes());
        cases.push((msg(&cur_text, "msg_single", now.to_string(), sig.clone(), body), true));
        cases.push((msg(&prev_text, "msg_single", now.to_string(), sig.clone(), body), false));
        let tampered = body.replace("ready", "READY");
        cases.push((msg(&cur_text, "msg_single", now.to_string(), sig.clone(), &tampered), false));
        cases.push((msg(&cur_text, "msg_other", now.to_string(), sig.clone(), body), false));
        cases.push((msg(&cur_text, "msg_single", (now + 1).to_string(), sig, body), false));
        let old = now - 600;
        let old_sig = single.signature_header("msg_old", old, body.as_bytes());
        cases.push((msg(&cur_text, "msg_old", old.to_string(), old_sig, body), false));

        // Our own verify agrees with what the library must say.
        for (input, want) in &cases {
            let h = &input["headers"];
            let s = secret(input["secret"].as_str().expect("secret"));
            let got = verify(
                &s,
                h["webhook-id"].as_str().expect("id"),
                h["webhook-timestamp"].as_str().expect("ts"),
                h["webhook-signature"].as_str().expect("sig"),
                input["body"].as_str().expect("body").as_bytes(),
                now,
            );
            assert_eq!(got.is_ok(), *want, "our verify on {input}: {got:?}");
        }

        let mut child = std::process::Command::new(&python)
            .arg(crate::testkit::receiver::webhook_verify_script())
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("starting tests/compat/webhook_verify.py");
        {
            let mut stdin = child.stdin.take().expect("stdin");
            for (input, _) in &cases {
                writeln!(stdin, "{input}").expect("writing to the verifier");
            }
        }
        let out = child.wait_with_output().expect("the verifier's output");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "the verifier failed: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
        let lines: Vec<&str> = stdout.lines().collect();
        assert_eq!(lines.len(), cases.len(), "{stdout}");
        assert!(cases.len() >= 20, "{} cases", cases.len());
        for ((input, want), line) in cases.iter().zip(&lines) {
            if *want {
                assert_eq!(*line, "ok", "the library refused {input}");
            } else {
                assert!(line.starts_with("fail: "), "the library accepted {input}: {line}");
            }
        }
    }
}

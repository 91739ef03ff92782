//! The CaptchaAI (2captcha v1 protocol) client: in.php to submit, res.php to read.

use std::time::Duration;

use secrecy::{ExposeSecret, SecretString};
use serde::{Deserialize, Serialize};

use crate::codes::{CodeClass, ErrorCode, classify};
use crate::domain::{CaptchaId, CaptchaKind, ParseError, Solution};

/// A captcha to solve, as the owner describes it in `POST /tasks`. Serialised as the same JSON
/// when it waits in the submit queue.
#[derive(Debug, Clone, Deserialize, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum SubmitRequest {
    RecaptchaV2 {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        invisible: bool,
        #[serde(default)]
        data_s: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    RecaptchaV3 {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        min_score: Option<f32>,
        #[serde(default)]
        browser: Browser,
    },
    RecaptchaEnterprise {
        sitekey: String,
        pageurl: String,
        /// `v3` for an Enterprise v3 key; v2 otherwise.
        #[serde(default)]
        version: Option<String>,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        min_score: Option<f32>,
        #[serde(default)]
        data_s: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    Hcaptcha {
        sitekey: String,
        pageurl: String,
    },
    Turnstile {
        sitekey: String,
        pageurl: String,
        #[serde(default)]
        action: Option<String>,
        #[serde(default)]
        data: Option<String>,
    },
    /// A base64-encoded image, with optional hints for the solver (`numeric`, `min_len`, …:
    /// [`IMAGE_HINTS`]), forwarded as they are.
    Image {
        body: String,
        #[serde(default)]
        hints: std::collections::BTreeMap<String, String>,
    },
    /// GeeTest v3 (`method=geetest`): the page's `gt` and a fresh `challenge`.
    Geetest {
        gt: String,
        challenge: String,
        pageurl: String,
        #[serde(default)]
        api_server: Option<String>,
        #[serde(default)]
        browser: Browser,
    },
    /// Cloudflare's challenge page (`method=cloudflare_challenge`): solved through the owner's
    /// proxy (`browser.proxy` and `browser.proxytype` are required); the clearance comes with
    /// the user agent it was earned with.
    CloudflareChallenge {
        pageurl: String,
        #[serde(default)]
        browser: Browser,
    },
    /// BLS (`method=bls`): the instruction's code and the grid's nine images (base64, or
    /// `data:image/…;base64,` URIs), in reading order.
    Bls {
        instructions: String,
        images: Vec<String>,
    },
}

/// Optional browser context for reCAPTCHA (`"browser": {...}` in the request).
#[derive(Debug, Clone, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Browser {
    #[serde(default)]
    pub user_agent: Option<String>,
    #[serde(default)]
    pub cookies: Option<String>,
    #[serde(default)]
    pub proxy: Option<String>,
    #[serde(default)]
    pub proxytype: Option<String>,
}

/// The in.php hints an image task may carry.
pub const IMAGE_HINTS: [&str; 10] =
    ["phrase", "regsense", "numeric", "calc", "min_len", "max_len", "language", "lang", "textinstructions", "case"];

/// Largest base64 image accepted (CaptchaAI refuses images over 100 KiB; base64 adds a third).
pub const MAX_IMAGE_BASE64: usize = 140 * 1024;
/// A BLS grid's cells: nine images.
pub const BLS_CELLS: usize = 9;
/// The in.php fields of a BLS grid's cells, in reading order.
pub const BLS_FIELDS: [&str; BLS_CELLS] = [
    "image_base64_1",
    "image_base64_2",
    "image_base64_3",
    "image_base64_4",
    "image_base64_5",
    "image_base64_6",
    "image_base64_7",
    "image_base64_8",
    "image_base64_9",
];
/// Largest BLS cell accepted (its tiles are a few KiB; nine must fit a task item's 400 KB).
pub const MAX_BLS_CELL: usize = 32 * 1024;

fn check_base64(field: &str, v: &str, max: usize) -> Result<(), ParseError> {
    check_text(field, v, max)?;
    // A data URI's prefix (`data:image/png;base64,`) is kept: CaptchaAI's BLS takes it.
    let data = v.split_once(";base64,").map_or(v, |(_, d)| d);
    if !data.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'/' | b'=' | b'\n' | b'\r')) {
        return Err(ParseError(format!("`{field}` must be base64")));
    }
    Ok(())
}

fn check_text(field: &str, v: &str, max: usize) -> Result<(), ParseError> {
    if v.trim().is_empty() {
        return Err(ParseError(format!("`{field}` must not be empty")));
    }
    if v.len() > max {
        return Err(ParseError(format!("`{field}` is longer than {max} bytes")));
    }
    if v.chars().any(char::is_control) {
        return Err(ParseError(format!("`{field}` contains control characters")));
    }
    Ok(())
}

fn check_pageurl(v: &str) -> Result<(), ParseError> {
    check_text("pageurl", v, 2048)?;
    if !(v.starts_with("https://") || v.starts_with("http://")) {
        return Err(ParseError("`pageurl` must be an http(s) URL".into()));
    }
    Ok(())
}

fn check_score(v: Option<f32>) -> Result<(), ParseError> {
    match v {
        Some(s) if !(0.1..=0.9).contains(&s) => Err(ParseError("`min_score` must be between 0.1 and 0.9".into())),
        _ => Ok(()),
    }
}

impl SubmitRequest {
    pub fn kind(&self) -> CaptchaKind {
        match self {
            Self::RecaptchaV2 { .. } => CaptchaKind::RecaptchaV2,
            Self::RecaptchaV3 { .. } => CaptchaKind::RecaptchaV3,
            Self::RecaptchaEnterprise { .. } => CaptchaKind::RecaptchaEnterprise,
            Self::Hcaptcha { .. } => CaptchaKind::Hcaptcha,
            Self::Turnstile { .. } => CaptchaKind::Turnstile,
            Self::Image { .. } => CaptchaKind::Image,
            Self::Geetest { .. } => CaptchaKind::Geetest,
            Self::CloudflareChallenge { .. } => CaptchaKind::CloudflareChallenge,
            Self::Bls { .. } => CaptchaKind::Bls,
        }
    }

    /// The user agent the owner asked CaptchaAI to solve with, if any: the one a solution that
    /// names none was earned with.
    pub fn user_agent(&self) -> Option<&str> {
        match self {
            Self::RecaptchaV2 { browser, .. }
            | Self::RecaptchaV3 { browser, .. }
            | Self::RecaptchaEnterprise { browser, .. }
            | Self::Geetest { browser, .. }
            | Self::CloudflareChallenge { browser, .. } => browser.user_agent.as_deref(),
            _ => None,
        }
    }

    /// Checks what CaptchaAI would refuse anyway, so the caller hears it at once.
    pub fn validate(&self) -> Result<(), ParseError> {
        match self {
            Self::RecaptchaV2 { sitekey, pageurl, .. } | Self::Hcaptcha { sitekey, pageurl } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)
            }
            Self::RecaptchaV3 { sitekey, pageurl, min_score, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)?;
                check_score(*min_score)
            }
            Self::RecaptchaEnterprise { sitekey, pageurl, version, min_score, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)?;
                check_score(*min_score)?;
                match version.as_deref() {
                    None | Some("v2" | "v3") => Ok(()),
                    Some(_) => Err(ParseError("`version` must be `v2` or `v3`".into())),
                }
            }
            Self::Turnstile { sitekey, pageurl, .. } => {
                check_text("sitekey", sitekey, 256)?;
                check_pageurl(pageurl)
            }
            Self::Image { body, hints } => {
                for (k, v) in hints {
                    if !IMAGE_HINTS.contains(&k.as_str()) {
                        return Err(ParseError(format!("image hint `{k}` is not one of {}", IMAGE_HINTS.join(", "))));
                    }
                    check_text(k, v, 256)?;
                }
                check_base64("body", body, MAX_IMAGE_BASE64)
            }
            Self::Geetest { gt, challenge, pageurl, api_server, .. } => {
                check_text("gt", gt, 256)?;
                check_text("challenge", challenge, 256)?;
                if let Some(a) = api_server {
                    check_text("api_server", a, 256)?;
                }
                check_pageurl(pageurl)
            }
            Self::CloudflareChallenge { pageurl, browser } => {
                check_pageurl(pageurl)?;
                match (&browser.proxy, &browser.proxytype) {
                    (Some(p), Some(t)) => {
                        check_text("proxy", p, 512)?;
                        check_text("proxytype", t, 16)
                    }
                    _ => Err(ParseError(
                        "`proxy` and `proxytype` are required: CaptchaAI solves a Cloudflare challenge through your proxy"
                            .into(),
                    )),
                }
            }
            Self::Bls { instructions, images } => {
                check_text("instructions", instructions, 256)?;
                if images.len() != BLS_CELLS {
                    return Err(ParseError(format!(
                        "`images` must be the grid's {BLS_CELLS} cells, got {}",
                        images.len()
                    )));
                }
                images.iter().try_for_each(|i| check_base64("images", i, MAX_BLS_CELL))
            }
        }
    }

    /// The in.php form fields for this captcha (without key, json and pingback).
    pub fn form_fields(&self) -> Vec<(&'static str, String)> {
        let mut f: Vec<(&'static str, String)> = Vec::new();
        let push_opt = |f: &mut Vec<(&'static str, String)>, k: &'static str, v: &Option<String>| {
            if let Some(v) = v {
                f.push((k, v.clone()));
            }
        };
        let browser = |f: &mut Vec<(&'static str, String)>, b: &Browser| {
            for (k, v) in [
                ("userAgent", &b.user_agent),
                ("cookies", &b.cookies),
                ("proxy", &b.proxy),
                ("proxytype", &b.proxytype),
            ] {
                if let Some(v) = v {
                    f.push((k, v.clone()));
                }
            }
        };
        match self {
            Self::RecaptchaV2 { sitekey, pageurl, invisible, data_s, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                if *invisible {
                    f.push(("invisible", "1".into()));
                }
                push_opt(&mut f, "data-s", data_s);
                browser(&mut f, b);
            }
            Self::RecaptchaV3 { sitekey, pageurl, action, min_score, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("version", "v3".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "min_score", &min_score.map(|s| s.to_string()));
                browser(&mut f, b);
            }
            Self::RecaptchaEnterprise { sitekey, pageurl, version, action, min_score, data_s, browser: b } => {
                f.extend([
                    ("method", "userrecaptcha".into()),
                    ("enterprise", "1".into()),
                    ("googlekey", sitekey.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "version", version);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "min_score", &min_score.map(|s| s.to_string()));
                push_opt(&mut f, "data-s", data_s);
                browser(&mut f, b);
            }
            Self::Hcaptcha { sitekey, pageurl } => {
                f.extend([("method", "hcaptcha".into()), ("sitekey", sitekey.clone()), ("pageurl", pageurl.clone())]);
            }
            Self::Turnstile { sitekey, pageurl, action, data } => {
                f.extend([("method", "turnstile".into()), ("sitekey", sitekey.clone()), ("pageurl", pageurl.clone())]);
                push_opt(&mut f, "action", action);
                push_opt(&mut f, "data", data);
            }
            Self::Image { body, hints } => {
                f.extend([("method", "base64".into()), ("body", body.clone())]);
                for (k, v) in hints {
                    if let Some(name) = IMAGE_HINTS.iter().find(|h| **h == k.as_str()) {
                        f.push((name, v.clone()));
                    }
                }
            }
            Self::Geetest { gt, challenge, pageurl, api_server, browser: b } => {
                f.extend([
                    ("method", "geetest".into()),
                    ("gt", gt.clone()),
                    ("challenge", challenge.clone()),
                    ("pageurl", pageurl.clone()),
                ]);
                push_opt(&mut f, "api_server", api_server);
                browser(&mut f, b);
            }
            Self::CloudflareChallenge { pageurl, browser: b } => {
                f.extend([("method", "cloudflare_challenge".into()), ("pageurl", pageurl.clone())]);
                browser(&mut f, b);
            }
            Self::Bls { instructions, images } => {
                f.extend([("method", "bls".into()), ("instructions", instructions.clone())]);
                for (name, image) in BLS_FIELDS.iter().zip(images) {
                    f.push((name, image.clone()));
                }
            }
        }
        f
    }
}

/// What went wrong talking to CaptchaAI. Never carries the account key or a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptchaAiError {
    #[error("CaptchaAI answered {0}")]
    Code(ErrorCode),
    #[error("CaptchaAI answered HTTP {0}")]
    Http(u16),
    #[error("CaptchaAI answered something that is not a protocol answer: {0}")]
    NotAnAnswer(String),
    /// A batch read (`ids=`) answered with a different number of parts than ids.
    #[error("CaptchaAI's batch answer does not match the request: {0}")]
    BatchShape(String),
    #[error("CaptchaAI did not answer in time")]
    Timeout,
    #[error("could not connect to CaptchaAI: {0}")]
    Connect(String),
    #[error("request to CaptchaAI failed: {0}")]
    Transport(String),
}

impl CaptchaAiError {
    /// The protocol class: codes by the table, anything else from the transport is transient.
    pub fn class(&self) -> CodeClass {
        match self {
            Self::Code(c) => c.class(),
            Self::Http(s) if *s < 500 && *s != 429 => CodeClass::Unknown,
            _ => CodeClass::Transient,
        }
    }

    /// Whether this answer to a batch read (`ids=`) says the server does not take the batch form:
    /// a wrong part count, or a request-level code a server gives when it ignores `ids=` (it sees
    /// no `id`). Transient trouble (timeouts, 5xx, bans) never means that.
    pub fn batch_unsupported(&self) -> bool {
        match self {
            Self::BatchShape(_) => true,
            Self::Code(c) => matches!(
                c.as_ref(),
                "ERROR_WRONG_CAPTCHA_ID" | "ERROR_WRONG_ID_FORMAT" | "ERROR_EMPTY_ACTION" | "ERROR_BAD_PARAMETERS"
            ),
            _ => false,
        }
    }

    /// Whether CaptchaAI may have accepted the request even though we saw an error: anything but
    /// an explicit protocol answer, or a connection that never opened. A timeout, a connection
    /// cut after the request went out, an HTTP error or an HTML page (a CDN answers 502 after the
    /// origin took the task) prove nothing. A submit with this outcome must not be called failed,
    /// and sending it again could pay twice.
    pub fn outcome_unknown(&self) -> bool {
        !matches!(self, Self::Code(_) | Self::Connect(_))
    }

    /// The code to show and store: the CaptchaAI code, or a relay code for transport trouble.
    pub fn code(&self) -> String {
        match self {
            Self::Code(c) => c.as_ref().to_owned(),
            Self::Http(s) => format!("HTTP_{s}"),
            Self::NotAnAnswer(_) => "NOT_AN_ANSWER".into(),
            Self::BatchShape(_) => "BATCH_SHAPE".into(),
            Self::Timeout => "TIMEOUT".into(),
            Self::Connect(_) => "CONNECT_FAILED".into(),
            Self::Transport(_) => "TRANSPORT_FAILED".into(),
        }
    }

    fn from_reqwest(e: reqwest::Error) -> Self {
        // The URL of a res.php read carries the account key: never keep it.
        let e = e.without_url();
        if e.is_timeout() {
            Self::Timeout
        } else if e.is_connect() {
            Self::Connect(e.to_string())
        } else {
            Self::Transport(e.to_string())
        }
    }
}

/// A protocol answer before it is read as a submit or a result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawAnswer {
    /// `status: 1` / `OK|…`.
    Ok(String),
    /// `status: 0` / a bare code.
    Code(String),
}

#[derive(Deserialize)]
struct JsonAnswer {
    status: serde_json::Value,
    #[serde(default)]
    request: Option<serde_json::Value>,
    /// Where CaptchaAI's own SDK reads the token of a reCAPTCHA Enterprise or Cloudflare
    /// answer; `request` elsewhere.
    #[serde(default)]
    result: Option<serde_json::Value>,
    #[serde(default)]
    user_agent: Option<serde_json::Value>,
    #[serde(default)]
    useragent: Option<serde_json::Value>,
}

/// A JSON answer's text: a string as it is, a number as digits, an object or list (a GeeTest
/// answer, BLS's cells) as its JSON.
fn json_text(v: &serde_json::Value) -> Option<String> {
    match v {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Number(n) => Some(n.to_string()),
        serde_json::Value::Object(_) | serde_json::Value::Array(_) => Some(v.to_string()),
        _ => None,
    }
}

/// The user agent a JSON answer names beside its token (`user_agent`, CaptchaAI's; or
/// `useragent`, 2captcha's), if any.
pub fn answer_user_agent(body: &str) -> Option<String> {
    let j = serde_json::from_str::<JsonAnswer>(body.trim()).ok()?;
    j.user_agent.or(j.useragent).as_ref().and_then(json_text).filter(|u| !u.trim().is_empty())
}

/// Reads any answer shape in the protocol: JSON (`request` — or `result` — as string, number or
/// JSON value, `status` as number or string), plain `OK|…`, a bare code; HTTP errors and HTML
/// are errors.
pub fn parse_answer(http_status: u16, body: &str) -> Result<RawAnswer, CaptchaAiError> {
    let text = body.trim();
    if let Ok(j) = serde_json::from_str::<JsonAnswer>(text) {
        let ok = match &j.status {
            serde_json::Value::Number(n) => n.as_i64() == Some(1),
            serde_json::Value::String(s) => s == "1",
            serde_json::Value::Bool(b) => *b,
            _ => false,
        };
        let request = j
            .result
            .as_ref()
            .filter(|_| ok)
            .or(j.request.as_ref())
            .and_then(json_text)
            .ok_or_else(|| CaptchaAiError::NotAnAnswer("JSON answer without a `request` text".into()))?;
        if !ok && request.trim().is_empty() {
            // A refusal must name its code; without one it proves nothing (found by fuzzing).
            return Err(CaptchaAiError::NotAnAnswer("JSON refusal without a code".into()));
        }
        return Ok(if ok { RawAnswer::Ok(request) } else { RawAnswer::Code(request) });
    }
    if http_status >= 400 {
        return Err(CaptchaAiError::Http(http_status));
    }
    if let Some(rest) = text.strip_prefix("OK|") {
        return Ok(RawAnswer::Ok(rest.to_owned()));
    }
    let looks_like_code = !text.is_empty()
        && text.len() <= 64
        && text.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || matches!(b, b'_' | b':' | b' '));
    if looks_like_code && (classify(text) != CodeClass::Unknown || text.starts_with("ERROR")) {
        return Ok(RawAnswer::Code(text.to_owned()));
    }
    let kind = if text.starts_with('<') { "an HTML page" } else { "unrecognised text" };
    Err(CaptchaAiError::NotAnAnswer(format!("{kind} ({} bytes)", text.len())))
}

/// What res.php said about one task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResAnswer {
    Ready(Solution),
    NotReady,
    /// An error code about this task (or the request).
    Code(ErrorCode),
}

fn code(s: &str) -> Result<ErrorCode, CaptchaAiError> {
    ErrorCode::parse(s).map_err(|e| CaptchaAiError::NotAnAnswer(e.0))
}

fn res_answer(raw: RawAnswer) -> Result<ResAnswer, CaptchaAiError> {
    match raw {
        RawAnswer::Ok(s) => Solution::parse(&s).map(ResAnswer::Ready).map_err(|e| CaptchaAiError::NotAnAnswer(e.0)),
        RawAnswer::Code(c) if classify(&c) == CodeClass::NotReady => Ok(ResAnswer::NotReady),
        RawAnswer::Code(c) => Ok(ResAnswer::Code(code(&c)?)),
    }
}

/// Client for one CaptchaAI account.
#[derive(Clone)]
pub struct CaptchaAiClient {
    http: reqwest::Client,
    base_url: String,
    key: SecretString,
    soft_id: Option<u32>,
}

impl std::fmt::Debug for CaptchaAiClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptchaAiClient").field("base_url", &self.base_url).finish_non_exhaustive()
    }
}

impl CaptchaAiClient {
    pub fn new(
        base_url: &str,
        key: SecretString,
        timeout: Duration,
        soft_id: Option<u32>,
    ) -> Result<Self, CaptchaAiError> {
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(3).min(timeout))
            .timeout(timeout)
            .pool_idle_timeout(Duration::from_secs(50))
            .user_agent(concat!("captcha-relay/", env!("CARGO_PKG_VERSION")))
            .build()
            .map_err(CaptchaAiError::from_reqwest)?;
        Ok(Self { http, base_url: base_url.trim_end_matches('/').to_owned(), key, soft_id })
    }

    async fn read(&self, resp: reqwest::Response) -> Result<RawAnswer, CaptchaAiError> {
        Ok(self.read_with_agent(resp).await?.0)
    }

    /// The answer, and the user agent it names beside a token.
    async fn read_with_agent(&self, resp: reqwest::Response) -> Result<(RawAnswer, Option<String>), CaptchaAiError> {
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        Ok((parse_answer(status, &body)?, answer_user_agent(&body)))
    }

    /// Submits a captcha with a pingback URL (POST form, `json=1`). Returns CaptchaAI's id.
    pub async fn submit(&self, req: &SubmitRequest, pingback: &str) -> Result<CaptchaId, CaptchaAiError> {
        let mut form = req.form_fields();
        form.push(("key", self.key.expose_secret().to_owned()));
        form.push(("json", "1".into()));
        form.push(("pingback", pingback.to_owned()));
        if let Some(id) = self.soft_id {
            form.push(("soft_id", id.to_string()));
        }
        let resp = self
            .http
            .post(format!("{}/in.php", self.base_url))
            .form(&form)
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        match self.read(resp).await? {
            RawAnswer::Ok(id) => CaptchaId::parse(&id).map_err(|e| CaptchaAiError::NotAnAnswer(e.0)),
            RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        }
    }

    /// Reads several results in one request (`action=get&ids=…`, at most 100 ids).
    pub async fn get_results(&self, ids: &[CaptchaId]) -> Result<Vec<ResAnswer>, CaptchaAiError> {
        let joined = ids.iter().map(AsRef::as_ref).collect::<Vec<&str>>().join(",");
        split_batch(self.res_php_get("ids", &joined).await?, ids.len())
    }

    /// Reads one task's result (`action=get`), with the user agent its answer names.
    pub async fn get_result(&self, id: &CaptchaId) -> Result<ResAnswer, CaptchaAiError> {
        let (raw, ua) = self.res_php_answer(&[("action", "get"), ("id", id.as_ref())]).await?;
        Ok(match res_answer(raw)? {
            ResAnswer::Ready(s) => ResAnswer::Ready(s.with_user_agent(ua.as_deref())),
            other => other,
        })
    }

    /// `res.php?action=get&<name>=<value>&json=1`.
    async fn res_php_get(&self, name: &str, value: &str) -> Result<RawAnswer, CaptchaAiError> {
        self.res_php(&[("action", "get"), (name, value)]).await
    }

    /// `res.php?key=…&<params>&json=1`.
    async fn res_php(&self, params: &[(&str, &str)]) -> Result<RawAnswer, CaptchaAiError> {
        Ok(self.res_php_answer(params).await?.0)
    }

    /// `res.php?key=…&<params>&json=1`: the answer and the user agent it names.
    async fn res_php_answer(&self, params: &[(&str, &str)]) -> Result<(RawAnswer, Option<String>), CaptchaAiError> {
        let mut query: Vec<(&str, &str)> = vec![("key", self.key.expose_secret())];
        query.extend_from_slice(params);
        query.push(("json", "1"));
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&query)
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        self.read_with_agent(resp).await
    }

    /// The account balance (`action=getbalance`), as CaptchaAI states it: a decimal number.
    pub async fn balance(&self) -> Result<String, CaptchaAiError> {
        match self.res_php(&[("action", "getbalance")]).await? {
            RawAnswer::Ok(b) if b.trim().parse::<f64>().is_ok_and(f64::is_finite) => Ok(b.trim().to_owned()),
            RawAnswer::Ok(other) => {
                Err(CaptchaAiError::NotAnAnswer(format!("a balance that is not a number ({} bytes)", other.len())))
            }
            RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        }
    }

    /// Reports a solution good or bad (`action=reportgood` / `reportbad`). Returns the answer
    /// as 2captcha words it: `OK_REPORT_RECORDED`, or a code such as `ERROR_DUPLICATE_REPORT`.
    /// CaptchaAI answers a report with HTTP 200 and an empty body: that is a recorded report.
    pub async fn report(&self, id: &CaptchaId, good: bool) -> Result<String, CaptchaAiError> {
        let action = if good { "reportgood" } else { "reportbad" };
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&[("key", self.key.expose_secret()), ("action", action), ("id", id.as_ref()), ("json", "1")])
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        report_answer(status, &body)
    }

    /// The plan's threads (`action=threadsinfo`, CaptchaAI's): how many the plan has and how
    /// many are solving now.
    pub async fn threads_info(&self) -> Result<ThreadsInfo, CaptchaAiError> {
        let resp = self
            .http
            .get(format!("{}/res.php", self.base_url))
            .query(&[("key", self.key.expose_secret()), ("action", "threadsinfo"), ("json", "1")])
            .send()
            .await
            .map_err(CaptchaAiError::from_reqwest)?;
        let status = resp.status().as_u16();
        let body = resp.text().await.map_err(CaptchaAiError::from_reqwest)?;
        parse_threads_info(status, &body)
    }
}

/// A report's answer: an empty 200 (CaptchaAI) is `OK_REPORT_RECORDED`, as 2captcha says it.
pub fn report_answer(http_status: u16, body: &str) -> Result<String, CaptchaAiError> {
    if http_status == 200 && body.trim().is_empty() {
        return Ok("OK_REPORT_RECORDED".into());
    }
    match parse_answer(http_status, body)? {
        RawAnswer::Ok(t) | RawAnswer::Code(t) => Ok(t),
    }
}

/// The plan's size as `threadsinfo` states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadsInfo {
    /// Threads the plan has.
    pub threads: u32,
    /// Threads solving a task now (this relay's and any other client's on the account).
    pub working_threads: u32,
}

impl ThreadsInfo {
    pub fn free(&self) -> u32 {
        self.threads.saturating_sub(self.working_threads)
    }
}

/// Reads `threadsinfo`'s answer: top-level `threads` and `working_threads` (numbers or numeric
/// strings, as CaptchaAI's SDK reads them); a refusal is its code.
pub fn parse_threads_info(http_status: u16, body: &str) -> Result<ThreadsInfo, CaptchaAiError> {
    let count = |v: &serde_json::Value| match v {
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body.trim())
        && let (Some(threads), Some(working_threads)) = (count(&v["threads"]), count(&v["working_threads"]))
    {
        return Ok(ThreadsInfo { threads, working_threads });
    }
    match parse_answer(http_status, body)? {
        RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        RawAnswer::Ok(_) => Err(CaptchaAiError::NotAnAnswer("threadsinfo without `threads`".into())),
    }
}

/// Splits a batch answer (`a|b|c`, one part per id, in order) into per-task answers.
pub fn split_batch(raw: RawAnswer, count: usize) -> Result<Vec<ResAnswer>, CaptchaAiError> {
    let text = match raw {
        RawAnswer::Ok(t) => t,
        RawAnswer::Code(c) => return Err(CaptchaAiError::Code(code(&c)?)),
    };
    let parts: Vec<&str> = text.split('|').collect();
    if parts.len() != count {
        return Err(CaptchaAiError::BatchShape(format!("{} parts for {count} ids", parts.len())));
    }
    parts
        .into_iter()
        .map(|p| {
            let raw = if p == "CAPCHA_NOT_READY" || classify(p) != CodeClass::Unknown || p.starts_with("ERROR") {
                RawAnswer::Code(p.to_owned())
            } else {
                RawAnswer::Ok(p.to_owned())
            };
            res_answer(raw)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_answers_split_in_order() {
        let got =
            split_batch(RawAnswer::Ok("tok1|CAPCHA_NOT_READY|ERROR_CAPTCHA_UNSOLVABLE".into()), 3).expect("split");
        assert!(matches!(&got[0], ResAnswer::Ready(s) if s.expose() == "tok1"));
        assert_eq!(got[1], ResAnswer::NotReady);
        assert!(matches!(&got[2], ResAnswer::Code(c) if c.as_ref() == "ERROR_CAPTCHA_UNSOLVABLE"));
        assert!(split_batch(RawAnswer::Ok("a|b".into()), 3).is_err(), "a short answer is not trusted");
        assert!(split_batch(RawAnswer::Code("ERROR_WRONG_ID_FORMAT".into()), 1).is_err());
    }

    #[test]
    fn every_submit_answer_shape_is_read() {
        assert_eq!(parse_answer(200, r#"{"status":1,"request":"2122988149"}"#), Ok(RawAnswer::Ok("2122988149".into())));
        assert_eq!(parse_answer(200, r#"{"status":1,"request":2122988149}"#), Ok(RawAnswer::Ok("2122988149".into())));
        assert_eq!(parse_answer(200, r#"{"status":"1","request":"7"}"#), Ok(RawAnswer::Ok("7".into())));
        assert_eq!(parse_answer(200, "OK|2122988149"), Ok(RawAnswer::Ok("2122988149".into())));
        assert_eq!(
            parse_answer(200, r#"{"status":0,"request":"ERROR_WRONG_USER_KEY"}"#),
            Ok(RawAnswer::Code("ERROR_WRONG_USER_KEY".into()))
        );
        assert_eq!(parse_answer(200, "ERROR_NO_SLOT_AVAILABLE"), Ok(RawAnswer::Code("ERROR_NO_SLOT_AVAILABLE".into())));
        assert_eq!(parse_answer(200, "CAPCHA_NOT_READY"), Ok(RawAnswer::Code("CAPCHA_NOT_READY".into())));
        assert_eq!(parse_answer(200, "ERROR: 1005"), Ok(RawAnswer::Code("ERROR: 1005".into())));
        // A refusal without a code proves nothing: outcome unknown, not a code "" (fuzzing).
        for empty in [r#"{"status":0,"request":""}"#, r#"{"status":0,"request":"  "}"#] {
            let e = parse_answer(200, empty).expect_err(empty);
            assert!(e.outcome_unknown(), "{empty}: {e}");
        }
    }

    #[test]
    fn http_errors_and_html_are_transient_errors() {
        assert_eq!(parse_answer(502, "<html>Bad gateway</html>"), Err(CaptchaAiError::Http(502)));
        let html = parse_answer(200, "<!DOCTYPE html><p>maintenance</p>").expect_err("html");
        assert!(matches!(html, CaptchaAiError::NotAnAnswer(_)));
        assert_eq!(html.class(), CodeClass::Transient);
        assert_eq!(CaptchaAiError::Http(503).class(), CodeClass::Transient);
        assert_eq!(CaptchaAiError::Timeout.class(), CodeClass::Transient);
        for unknown in [
            CaptchaAiError::Timeout,
            CaptchaAiError::Transport("connection closed before message completed".into()),
            CaptchaAiError::Http(502),
            CaptchaAiError::Http(520),
            CaptchaAiError::NotAnAnswer("an HTML page (120 bytes)".into()),
        ] {
            assert!(unknown.outcome_unknown(), "{unknown}: proves nothing about the submit");
        }
        assert!(!CaptchaAiError::Connect("refused".into()).outcome_unknown(), "never sent");
        let refused = CaptchaAiError::Code(ErrorCode::parse("ERROR_PAGEURL").expect("code"));
        assert!(!refused.outcome_unknown(), "an explicit answer");
    }

    #[test]
    fn structured_answers_and_user_agents_are_read_in_every_shape_seen() {
        // 2captcha's GeeTest answer: an object in `request`.
        let obj = r#"{"status":1,"request":{"geetest_challenge":"c","geetest_validate":"v","geetest_seccode":"s"}}"#;
        let RawAnswer::Ok(text) = parse_answer(200, obj).expect("read") else { panic!("not ok") };
        let v: serde_json::Value = serde_json::from_str(&text).expect("json text");
        assert_eq!(v["geetest_validate"], "v");
        // CaptchaAI's SDK: the JSON as a string; BLS's cells as a list.
        let string = r#"{"status":1,"request":"{\"challenge\":\"c\",\"validate\":\"v\",\"seccode\":\"s\"}"}"#;
        assert!(matches!(parse_answer(200, string), Ok(RawAnswer::Ok(t)) if t.contains("validate")));
        assert_eq!(parse_answer(200, r#"{"status":1,"request":[1,4,7]}"#), Ok(RawAnswer::Ok("[1,4,7]".into())));
        // Enterprise / Cloudflare in CaptchaAI's SDK: the token in `result`, the user agent beside it.
        let ent = r#"{"status":1,"result":"ent-token","user_agent":"UA/1.0"}"#;
        assert_eq!(parse_answer(200, ent), Ok(RawAnswer::Ok("ent-token".into())));
        assert_eq!(answer_user_agent(ent).as_deref(), Some("UA/1.0"));
        assert_eq!(answer_user_agent(r#"{"status":1,"request":"t","useragent":"UA/2"}"#).as_deref(), Some("UA/2"));
        assert_eq!(answer_user_agent(r#"{"status":1,"request":"t"}"#), None);
        assert_eq!(answer_user_agent("OK|t"), None);
    }

    #[test]
    fn an_empty_report_answer_is_a_recorded_report_and_threadsinfo_is_read() {
        assert_eq!(report_answer(200, ""), Ok("OK_REPORT_RECORDED".into()), "CaptchaAI's empty 200");
        assert_eq!(
            report_answer(200, r#"{"status":1,"request":"OK_REPORT_RECORDED"}"#),
            Ok("OK_REPORT_RECORDED".into())
        );
        assert_eq!(report_answer(200, "ERROR_DUPLICATE_REPORT"), Ok("ERROR_DUPLICATE_REPORT".into()));
        assert!(report_answer(502, "").is_err(), "an empty 502 is trouble, not a report");
        let info = parse_threads_info(200, r#"{"threads":10,"working_threads":"3"}"#).expect("read");
        assert_eq!((info.threads, info.working_threads, info.free()), (10, 3, 7));
        assert_eq!(
            parse_threads_info(200, r#"{"status":0,"request":"ERROR_KEY_DOES_NOT_EXIST"}"#),
            Err(CaptchaAiError::Code(ErrorCode::parse("ERROR_KEY_DOES_NOT_EXIST").expect("code")))
        );
        assert!(parse_threads_info(200, r#"{"status":1,"request":"10"}"#).is_err());
    }

    #[test]
    fn res_php_answers_become_ready_not_ready_or_code() {
        let ready = res_answer(parse_answer(200, r#"{"status":1,"request":"03AGdBq2"}"#).expect("ok")).expect("ready");
        assert!(matches!(ready, ResAnswer::Ready(s) if s.expose() == "03AGdBq2"));
        assert_eq!(res_answer(RawAnswer::Code("CAPCHA_NOT_READY".into())), Ok(ResAnswer::NotReady));
        assert!(
            matches!(res_answer(RawAnswer::Code("ERROR_CAPTCHA_UNSOLVABLE".into())), Ok(ResAnswer::Code(c)) if c.class() == CodeClass::TerminalForTask)
        );
        // A plain-mode solution containing `|` keeps everything after the first one.
        assert_eq!(parse_answer(200, "OK|a|b"), Ok(RawAnswer::Ok("a|b".into())));
    }

    #[test]
    fn submit_requests_parse_validate_and_map_to_in_php_fields() {
        let r: SubmitRequest = serde_json::from_str(
            r#"{"kind":"recaptcha_v3","sitekey":"6Le","pageurl":"https://shop.example/login","action":"login","min_score":0.3}"#,
        )
        .expect("parses");
        assert_eq!(r.kind(), CaptchaKind::RecaptchaV3);
        r.validate().expect("valid");
        let f = r.form_fields();
        for want in [
            ("method", "userrecaptcha"),
            ("version", "v3"),
            ("googlekey", "6Le"),
            ("action", "login"),
            ("min_score", "0.3"),
        ] {
            assert!(f.iter().any(|(k, v)| *k == want.0 && v == want.1), "missing {want:?} in {f:?}");
        }
        let e: SubmitRequest =
            serde_json::from_str(r#"{"kind":"recaptcha_enterprise","sitekey":"k","pageurl":"https://a.example"}"#)
                .expect("parses");
        assert!(e.form_fields().contains(&("enterprise", "1".into())));
        let t: SubmitRequest =
            serde_json::from_str(r#"{"kind":"turnstile","sitekey":"0x4","pageurl":"https://a.example","data":"d"}"#)
                .expect("parses");
        assert!(t.form_fields().contains(&("method", "turnstile".into())));
        let h: SubmitRequest =
            serde_json::from_str(r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"https://a.example"}"#).expect("parses");
        assert!(h.form_fields().contains(&("method", "hcaptcha".into())));
        let i: SubmitRequest = serde_json::from_str(r#"{"kind":"image","body":"iVBORw0KGgo="}"#).expect("parses");
        i.validate().expect("valid");
        assert!(i.form_fields().contains(&("method", "base64".into())));
    }

    #[test]
    fn bad_submit_requests_are_refused_with_the_field_named() {
        assert!(serde_json::from_str::<SubmitRequest>(r#"{"kind":"funcaptcha","sitekey":"s"}"#).is_err());
        assert!(serde_json::from_str::<SubmitRequest>(r#"{"kind":"hcaptcha","sitekey":"s"}"#).is_err());
        let cases = [
            (r#"{"kind":"hcaptcha","sitekey":"","pageurl":"https://a.example"}"#, "sitekey"),
            (r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"javascript:x"}"#, "pageurl"),
            (r#"{"kind":"recaptcha_v3","sitekey":"s","pageurl":"https://a.example","min_score":3}"#, "min_score"),
            (r#"{"kind":"image","body":"not base64!"}"#, "body"),
        ];
        for (json, field) in cases {
            let r: SubmitRequest = serde_json::from_str(json).expect("shape parses");
            let err = r.validate().expect_err(json);
            assert!(err.0.contains(field), "{json}: {err}");
        }
    }
}

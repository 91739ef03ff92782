//! The 2captcha-compatible front: `/in.php` and `/res.php` as 2captcha and CaptchaAI answer
//! them, so existing code — the official SDKs with `server` pointed at the relay, or hand-written
//! v1 calls — works unchanged, and gains the relay's certain delivery.
//!
//! - `key` is a relay key (named, stored as a digest; see `relay_shared::store::RelayKeys`),
//!   never the CaptchaAI key, which stays in the relay.
//! - `in.php` goes through the very submit path `POST /tasks` uses (breaker, pacing, one
//!   conditional put, never retried after an ambiguous answer, the id never lost); an
//!   `Idempotency-Key` header makes it idempotent too. The id it answers is 18–19 digits.
//! - `res.php?action=get` is answered from the task table: the client's polling never reaches
//!   CaptchaAI (and so can never earn `ERROR: 1005`), and a token past its lifetime is answered
//!   `ERROR_TOKEN_EXPIRED`, never handed out. `getbalance` (cached a few seconds) and
//!   `reportgood`/`reportbad` are passed through to CaptchaAI.
//! - Answers are 2captcha's: HTTP 200 with `OK|…` / a code, or `{"status":…,"request":…}` with
//!   `json=1` (plus `error_text` saying what to do). The relay's own passing trouble (its store
//!   unavailable, CaptchaAI unreachable) is an HTTP 503 with `Retry-After`, which the SDKs treat
//!   as a network error — the Python SDK's polling simply asks again.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine;
use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::{Browser, CaptchaAiError, MAX_IMAGE_BASE64, SubmitRequest};
use relay_shared::domain::{Task, TaskRef, TaskState};
use relay_shared::http::{parse_form, query_string};
use relay_shared::store::{KeyCheck, KeyGrant};
use sha2::{Digest, Sha256};

use crate::{Deps, Pin, SubmitInput, Submitted, pin, submit_task};

/// Largest image CaptchaAI takes (bytes, before base64).
pub const MAX_IMAGE_BYTES: usize = 100 * 1024;
/// Most ids in one `action=get&ids=` read.
pub const MAX_IDS: usize = 100;
/// Reads allowed per key and second on one instance (a burst of [`READ_BURST`]): only to keep
/// one runaway client from starving the relay; the SDKs poll every 5–10 s.
pub const READS_PER_SECOND: f64 = 20.0;
pub const READ_BURST: f64 = 60.0;
/// How long a balance read from CaptchaAI is reused.
pub const BALANCE_FOR: Duration = Duration::from_secs(5);

/// Per-instance state of the compat front: the balance cache and the per-key read buckets.
#[derive(Debug, Clone, Default)]
pub struct CompatState {
    balance: Arc<Mutex<Option<(String, Instant)>>>,
    buckets: Arc<Mutex<HashMap<String, (f64, Instant)>>>,
}

impl CompatState {
    /// Takes one read from `key`'s bucket; `false` when it is empty.
    fn take_read(&self, key: &str) -> bool {
        let Ok(mut b) = self.buckets.lock() else { return true };
        if b.len() > 10_000 {
            b.retain(|_, (_, at)| at.elapsed() < Duration::from_secs(10));
        }
        let now = Instant::now();
        let (tokens, at) = b.entry(key.to_owned()).or_insert((READ_BURST, now));
        *tokens = (*tokens + now.duration_since(*at).as_secs_f64() * READS_PER_SECOND).min(READ_BURST);
        *at = now;
        if *tokens >= 1.0 {
            *tokens -= 1.0;
            true
        } else {
            false
        }
    }
}

/// A request's parameters: the query string, then the body (form, multipart or JSON).
struct Params {
    values: HashMap<String, String>,
    /// A `file` part of a multipart body.
    file: Option<Vec<u8>>,
    json: bool,
    acao: bool,
}

impl Params {
    fn get(&self, name: &str) -> Option<&str> {
        self.values.get(name).map(String::as_str).filter(|v| !v.is_empty())
    }
}

/// An answer in the client's chosen form.
fn answer(p: &Params, ok: bool, request: &str, error_text: Option<&str>) -> Response<Body> {
    answer_with(p.json, p.acao, 200, ok, request, error_text)
}

fn answer_with(
    json: bool,
    acao: bool,
    status: u16,
    ok: bool,
    request: &str,
    error_text: Option<&str>,
) -> Response<Body> {
    let (ctype, body) = if json {
        let mut v = serde_json::json!({ "status": u8::from(ok), "request": request });
        if let Some(t) = error_text {
            v["error_text"] = serde_json::Value::String(t.to_owned());
        }
        ("application/json", v.to_string())
    } else if ok {
        ("text/plain; charset=utf-8", format!("OK|{request}"))
    } else {
        ("text/plain; charset=utf-8", request.to_owned())
    };
    let mut b = Response::builder().status(status).header("content-type", ctype).header("cache-control", "no-store");
    if acao {
        b = b.header("access-control-allow-origin", "*");
    }
    b.body(Body::from(body)).unwrap_or_else(|_| Response::new(Body::Empty))
}

/// An answer 2captcha gives bare in plain form, without `OK|` (a balance, a batch read, a
/// report); in JSON its status is `ok`.
fn bare(p: &Params, ok: bool, text: &str) -> Response<Body> {
    answer(p, ok && p.json, text, None)
}

/// The relay's own passing trouble: 503 + `Retry-After` (the SDKs see a network error).
fn unavailable(p: &Params, code: &str, text: &str, retry_after: Duration) -> Response<Body> {
    let mut r = answer_with(p.json, p.acao, 503, false, code, Some(text));
    if let Ok(v) = http::HeaderValue::from_str(&retry_after.as_secs().max(1).to_string()) {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

fn store_trouble(p: &Params, e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, "task store call failed (compat)");
    unavailable(
        p,
        "ERROR_INTERNAL_SERVER_ERROR",
        "the relay's task store is unavailable; trying again is safe",
        Duration::from_secs(5),
    )
}

/// Reads the parameters; `Err` is the answer for a body that cannot be read.
fn params(req: &Request) -> Result<Params, Response<Body>> {
    let mut values: HashMap<String, String> = HashMap::new();
    let mut file = None;
    let bad = |json: bool, text: &str| answer_with(json, false, 400, false, "ERROR_BAD_PARAMETERS", Some(text));
    let wants_json = |v: &HashMap<String, String>| v.get("json").is_some_and(|j| j == "1");
    for (k, v) in parse_form(query_string(req).as_bytes()).map_err(|e| bad(false, &format!("query string: {e}")))? {
        values.entry(k).or_insert(v);
    }
    let body: &[u8] = req.body().as_ref();
    if body.len() > crate::MAX_BODY {
        return Err(answer_with(
            wants_json(&values),
            false,
            413,
            false,
            "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
            Some("the request body is too large"),
        ));
    }
    let ctype = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_ascii_lowercase();
    if !body.is_empty() {
        if ctype.starts_with("multipart/form-data") {
            // The boundary's case matters: read it from the header as sent.
            let boundary = req
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .split(';')
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("boundary"))
                .map(|(_, v)| v.trim().trim_matches('"').to_owned())
                .ok_or_else(|| bad(wants_json(&values), "a multipart body without a boundary"))?;
            for part in multipart(body, &boundary).map_err(|e| bad(wants_json(&values), &e))? {
                if part.name == "file" || part.filename.is_some() {
                    file = Some(part.data);
                } else {
                    let v = String::from_utf8(part.data)
                        .map_err(|_| bad(wants_json(&values), &format!("part `{}` is not UTF-8", part.name)))?;
                    values.insert(part.name, v);
                }
            }
        } else if ctype.starts_with("application/json") {
            // The JavaScript SDK posts images as a JSON object.
            let v: serde_json::Value =
                serde_json::from_slice(body).map_err(|e| bad(wants_json(&values), &format!("JSON body: {e}")))?;
            let Some(obj) = v.as_object() else {
                return Err(bad(wants_json(&values), "the JSON body must be an object"));
            };
            for (k, v) in obj {
                let text = match v {
                    serde_json::Value::String(s) => s.clone(),
                    serde_json::Value::Number(n) => n.to_string(),
                    serde_json::Value::Bool(b) => u8::from(*b).to_string(),
                    serde_json::Value::Null => continue,
                    _ => return Err(bad(wants_json(&values), &format!("`{k}` must be a string or a number"))),
                };
                values.insert(k.clone(), text);
            }
        } else {
            // A form body (the Python SDK, curl -d); parameters in the body win over the query.
            for (k, v) in parse_form(body).map_err(|e| bad(wants_json(&values), &format!("form body: {e}")))? {
                values.insert(k, v);
            }
        }
    }
    let json = wants_json(&values);
    let acao = values.get("header_acao").is_some_and(|v| v == "1");
    Ok(Params { values, file, json, acao })
}

struct Part {
    name: String,
    filename: Option<String>,
    data: Vec<u8>,
}

/// Splits a `multipart/form-data` body (RFC 7578) into its parts.
fn multipart(body: &[u8], boundary: &str) -> Result<Vec<Part>, String> {
    if boundary.is_empty() || boundary.len() > 70 {
        return Err("a multipart boundary must be 1 to 70 characters".into());
    }
    let delim = format!("--{boundary}").into_bytes();
    let find = |hay: &[u8], needle: &[u8], from: usize| -> Option<usize> {
        hay.get(from..)?.windows(needle.len()).position(|w| w == needle).map(|i| i + from)
    };
    let mut pos = find(body, &delim, 0).ok_or("the multipart body does not start with its boundary")?;
    let mut parts = Vec::new();
    loop {
        pos += delim.len();
        if body.get(pos..pos + 2) == Some(b"--") {
            return Ok(parts);
        }
        // Past the CRLF after the boundary line.
        pos = find(body, b"\r\n", pos).ok_or("a boundary line without CRLF")? + 2;
        let head_end = find(body, b"\r\n\r\n", pos).ok_or("a part without a header block")?;
        let head = std::str::from_utf8(&body[pos..head_end]).map_err(|_| "a part's headers are not UTF-8")?;
        let mut next_delim = b"\r\n".to_vec();
        next_delim.extend_from_slice(&delim);
        let end = find(body, &next_delim, head_end + 4).ok_or("a part without a closing boundary")?;
        let (mut name, mut filename) = (None, None);
        for line in head.split("\r\n") {
            let Some((k, v)) = line.split_once(':') else { continue };
            if !k.trim().eq_ignore_ascii_case("content-disposition") {
                continue;
            }
            for attr in v.split(';').map(str::trim) {
                if let Some(n) = attr.strip_prefix("name=") {
                    name = Some(n.trim_matches('"').to_owned());
                } else if let Some(f) = attr.strip_prefix("filename=") {
                    filename = Some(f.trim_matches('"').to_owned());
                }
            }
        }
        let name = name.ok_or("a part without a name")?;
        parts.push(Part { name, filename, data: body[head_end + 4..end].to_vec() });
        if parts.len() > 100 {
            return Err("more than 100 parts".into());
        }
        pos = end + 2;
    }
}

/// Checks the `key` parameter; `Err` is the answer to give.
async fn authorise(p: &Params, deps: &Deps) -> Result<KeyGrant, Response<Body>> {
    let given = p.get("key").unwrap_or("");
    match deps.relay_keys.check(given).await {
        Ok(KeyCheck::Valid(grant)) => Ok(grant),
        Ok(KeyCheck::Malformed) => {
            metrics::counter!("compat_requests", "outcome" => "bad_key").increment(1);
            Err(answer(
                p,
                false,
                "ERROR_WRONG_USER_KEY",
                Some(
                    "`key` is not a relay key (create one with `relay-ops keys create`; it is not your CaptchaAI key)",
                ),
            ))
        }
        Ok(KeyCheck::Unknown) => {
            metrics::counter!("compat_requests", "outcome" => "bad_key").increment(1);
            Err(answer(
                p,
                false,
                "ERROR_KEY_DOES_NOT_EXIST",
                Some("no live relay key has this value (revoked, or never created)"),
            ))
        }
        Err(e) => Err(store_trouble(p, &e)),
    }
}

fn flag(p: &Params, name: &str) -> bool {
    p.get(name).is_some_and(|v| v == "1" || v.eq_ignore_ascii_case("true"))
}

fn owned(p: &Params, name: &str) -> Option<String> {
    p.get(name).map(str::to_owned)
}

/// The captcha a v1 request describes; `Err((code, text))` otherwise.
fn captcha(p: &Params) -> Result<SubmitRequest, (&'static str, String)> {
    let need = |name: &str, code: &'static str| -> Result<String, (&'static str, String)> {
        owned(p, name).ok_or((code, format!("`{name}` is required for method={}", p.get("method").unwrap_or(""))))
    };
    let browser = || Browser {
        user_agent: owned(p, "userAgent").or_else(|| owned(p, "useragent")),
        cookies: owned(p, "cookies"),
        proxy: owned(p, "proxy"),
        proxytype: owned(p, "proxytype"),
    };
    let score = |p: &Params| -> Result<Option<f32>, (&'static str, String)> {
        match p.get("min_score") {
            None => Ok(None),
            Some(v) => v
                .parse::<f32>()
                .map(Some)
                .map_err(|_| ("ERROR_BAD_PARAMETERS", "`min_score` must be a number such as 0.3".to_owned())),
        }
    };
    let method = p.get("method").ok_or(("ERROR_BAD_PARAMETERS", "`method` is required".to_owned()))?;
    let req = match method {
        "userrecaptcha" => {
            let sitekey = need("googlekey", "ERROR_GOOGLEKEY")?;
            let pageurl = need("pageurl", "ERROR_PAGEURL")?;
            let v3 = p.get("version").is_some_and(|v| v.eq_ignore_ascii_case("v3"));
            if flag(p, "enterprise") {
                SubmitRequest::RecaptchaEnterprise {
                    sitekey,
                    pageurl,
                    version: v3.then(|| "v3".to_owned()),
                    action: owned(p, "action"),
                    min_score: score(p)?,
                    data_s: owned(p, "data-s"),
                    browser: browser(),
                }
            } else if v3 {
                SubmitRequest::RecaptchaV3 {
                    sitekey,
                    pageurl,
                    action: owned(p, "action"),
                    min_score: score(p)?,
                    browser: browser(),
                }
            } else {
                SubmitRequest::RecaptchaV2 {
                    sitekey,
                    pageurl,
                    invisible: flag(p, "invisible"),
                    data_s: owned(p, "data-s"),
                    browser: browser(),
                }
            }
        }
        "hcaptcha" => SubmitRequest::Hcaptcha {
            sitekey: need("sitekey", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
        },
        "turnstile" => SubmitRequest::Turnstile {
            sitekey: need("sitekey", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
            action: owned(p, "action"),
            data: owned(p, "data"),
        },
        "base64" | "post" => {
            let body = if method == "post" {
                let bytes = p.file.as_deref().unwrap_or_default();
                if bytes.is_empty() {
                    return Err(("ERROR_ZERO_CAPTCHA_FILESIZE", "the `file` part is missing or empty".into()));
                }
                if bytes.len() > MAX_IMAGE_BYTES {
                    return Err((
                        "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
                        format!("the image is over {MAX_IMAGE_BYTES} bytes"),
                    ));
                }
                base64::engine::general_purpose::STANDARD.encode(bytes)
            } else {
                // A `+` sent unescaped in a form arrives as a space.
                let b = p.get("body").unwrap_or("").replace(' ', "+");
                if b.is_empty() {
                    return Err((
                        "ERROR_ZERO_CAPTCHA_FILESIZE",
                        "`body` (the base64 image) is missing or empty".into(),
                    ));
                }
                if b.len() > MAX_IMAGE_BASE64 {
                    return Err((
                        "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
                        format!("the image is over {MAX_IMAGE_BYTES} bytes"),
                    ));
                }
                b
            };
            let hints = relay_shared::captchaai::IMAGE_HINTS
                .iter()
                .filter_map(|k| p.get(k).map(|v| ((*k).to_owned(), v.to_owned())))
                .collect();
            SubmitRequest::Image { body, hints }
        }
        "geetest" => SubmitRequest::Geetest {
            gt: need("gt", "ERROR_BAD_PARAMETERS")?,
            challenge: need("challenge", "ERROR_BAD_PARAMETERS")?,
            pageurl: need("pageurl", "ERROR_PAGEURL")?,
            api_server: owned(p, "api_server").or_else(|| owned(p, "apiServer")),
            browser: browser(),
        },
        "cloudflare_challenge" => {
            SubmitRequest::CloudflareChallenge { pageurl: need("pageurl", "ERROR_PAGEURL")?, browser: browser() }
        }
        "bls" => SubmitRequest::Bls {
            instructions: need("instructions", "ERROR_BAD_PARAMETERS")?,
            images: relay_shared::captchaai::BLS_FIELDS
                .iter()
                .map(|f| need(f, "ERROR_BAD_PARAMETERS").map(|v| v.replace(' ', "+")))
                .collect::<Result<_, _>>()?,
        },
        other => {
            return Err((
                "ERROR_BAD_PARAMETERS",
                format!(
                    "method `{other}` is not supported by the relay (userrecaptcha, turnstile, geetest, \
                     cloudflare_challenge, bls, base64, post; hcaptcha where the upstream solves it)"
                ),
            ));
        }
    };
    req.validate().map_err(|e| {
        let code = if e.0.contains("pageurl") { "ERROR_PAGEURL" } else { "ERROR_BAD_PARAMETERS" };
        (code, e.0)
    })?;
    Ok(req)
}

/// The owner's own callback URL (`pingback`): results are pushed there as CaptchaAI sends a
/// pingback (or 2captcha, per relay key). Checked as any owner URL is (https, public addresses only
/// on AWS).
fn owner_pingback(p: &Params, deps: &Deps) -> Result<Option<String>, String> {
    let Some(url) = p.get("pingback") else { return Ok(None) };
    if url.chars().any(char::is_control) {
        return Err("`pingback` must be a URL of at most 2048 characters".into());
    }
    relay_shared::delivery::check_owner_url(url, deps.delivery_policy)
        .map(Some)
        .map_err(|why| format!("`pingback` refused: {why}"))
}

/// A code CaptchaAI or 2captcha could have answered (what an SDK expects to see).
fn protocol_code(code: &str) -> bool {
    code.starts_with("ERROR") || matches!(code, "MAX_USER_TURN" | "IP_BANNED" | "CAPCHA_NOT_READY")
}

/// `/in.php`.
pub async fn in_php(req: &Request, deps: &Deps) -> Response<Body> {
    let p = match params(req) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let grant = match authorise(&p, deps).await {
        Ok(g) => g,
        Err(r) => return r,
    };
    let submit = match captcha(&p) {
        Ok(s) => s,
        Err((code, text)) => {
            metrics::counter!("compat_requests", "outcome" => "bad_request").increment(1);
            return answer(&p, false, code, Some(&text));
        }
    };
    if !deps.queue.upstream.solves(submit.kind()) {
        metrics::counter!("compat_requests", "outcome" => "bad_request").increment(1);
        return answer(&p, false, "ERROR_BAD_PARAMETERS", Some(&deps.queue.upstream.refusal(submit.kind())));
    }
    let owner_callback = match owner_pingback(&p, deps) {
        Ok(u) => u,
        Err(text) => return answer(&p, false, "ERROR_BAD_PARAMETERS", Some(&text)),
    };
    // The fingerprint of what would be sent: every parameter but the credentials and the
    // answer's form, in order, and the file.
    let mut fp = Sha256::new();
    let mut pairs: Vec<(&String, &String)> =
        p.values.iter().filter(|(k, _)| !matches!(k.as_str(), "key" | "json" | "header_acao" | "soft_id")).collect();
    pairs.sort();
    for (k, v) in pairs {
        fp.update(k.as_bytes());
        fp.update([0]);
        fp.update(v.as_bytes());
        fp.update([0]);
    }
    if let Some(f) = &p.file {
        fp.update(f);
    }
    let fingerprint = hex::encode(fp.finalize());
    let idem = match crate::idempotency_key(req) {
        Ok(k) => k,
        Err(_) => {
            return answer(
                &p,
                false,
                "ERROR_BAD_PARAMETERS",
                Some("`Idempotency-Key` must be 1 to 255 printable ASCII characters"),
            );
        }
    };
    let (task_ref, _) = match &idem {
        // Keys are scoped to the compat front (one owner per deployment).
        Some(k) => TaskRef::compat_from_digest(&Sha256::digest(format!("compat\0{k}").as_bytes())),
        None => TaskRef::generate_compat(),
    };
    let webhook_owner = owner_callback.as_ref().map(|_| grant.name.clone());
    let input = SubmitInput {
        submit,
        fingerprint,
        keyed: idem.is_some(),
        task_ref,
        owner_callback,
        webhook_owner,
        pingback_form: grant.pingback,
        owner: format!("key:{}", grant.name),
    };
    let outcome = submit_task(req, deps, input).await;
    metrics::counter!("compat_requests", "outcome" => "submit").increment(1);
    let id_of = |t: &Task| t.task_ref.compat_id().map(|i| i.to_string()).unwrap_or_default();
    match outcome {
        // Queued or sent: either way the task is the relay's now, under its id.
        Submitted::Accepted(task) | Submitted::Queued(task) => answer(&p, true, &id_of(&task), None),
        Submitted::Replayed { task, stored, fingerprint } => {
            if stored.as_deref() != Some(fingerprint.as_str()) {
                return answer(
                    &p,
                    false,
                    "ERROR_BAD_PARAMETERS",
                    Some("this Idempotency-Key was used with a different request; use a new key"),
                );
            }
            match &task.state {
                TaskState::Failed { code, via: relay_shared::domain::Via::Submit, .. } => {
                    answer(&p, false, code.as_ref(), Some("in.php refused this task"))
                }
                _ => answer(&p, true, &id_of(&task), None),
            }
        }
        Submitted::BreakerOpen { until, reason } => answer(
            &p,
            false,
            // The plan run out is CaptchaAI's own code, as the client would have had it.
            if reason.starts_with("ERROR_ZERO_BALANCE") { "ERROR_ZERO_BALANCE" } else { "ERROR_NO_SLOT_AVAILABLE" },
            Some(&format!(
                "the relay stopped CaptchaAI traffic until {until} ({reason}); nothing was sent, try again then"
            )),
        ),
        Submitted::QueueFull { owner, depth, bound } => answer(
            &p,
            false,
            "ERROR_NO_SLOT_AVAILABLE",
            Some(&format!(
                "{} submit queue holds {depth} tasks waiting for a CaptchaAI thread, its bound ({bound}); nothing was sent, try again when it has drained",
                if owner { "this key's" } else { "the relay's" }
            )),
        ),
        Submitted::Store(e) => store_trouble(&p, &e),
        Submitted::Misconfigured => answer_with(
            p.json,
            p.acao,
            500,
            false,
            "ERROR_INTERNAL_SERVER_ERROR",
            Some("the relay does not know its callback URL"),
        ),
        Submitted::ResultChanging => unavailable(
            &p,
            "ERROR_INTERNAL_SERVER_ERROR",
            "the task is being updated; ask again",
            Duration::from_secs(1),
        ),
        Submitted::Banned { code, until, .. } => answer(
            &p,
            false,
            &code,
            Some(&format!(
                "CaptchaAI answered {code}; the relay stopped traffic until {until}. Nothing was accepted: trying again then is safe"
            )),
        ),
        Submitted::Refused { code, message, .. } if protocol_code(&code) => answer(&p, false, &code, Some(&message)),
        Submitted::Refused { message, .. } => answer(&p, false, "ERROR_BAD_PARAMETERS", Some(&message)),
    }
}

/// One task's answer to `action=get`.
struct Read {
    ok: bool,
    text: String,
    /// The user agent to use the token with, where CaptchaAI named one.
    user_agent: Option<String>,
    /// The answer is JSON (GeeTest, BLS): handed out as JSON in a JSON answer, as 2captcha does.
    structured: bool,
}

impl Read {
    fn code(code: &str) -> Self {
        Self { ok: false, text: code.to_owned(), user_agent: None, structured: false }
    }
}

async fn read_one(raw_id: &str, deps: &Deps) -> Result<Read, relay_shared::store::StoreError> {
    let Ok(task_ref) = TaskRef::from_compat_id(raw_id) else { return Ok(Read::code("ERROR_WRONG_CAPTCHA_ID")) };
    // Past its retention a task is unknown, whether or not the table still holds it.
    let Some(task) = deps.store.get_retained(&task_ref, deps.clock.now()).await? else {
        return Ok(Read::code("ERROR_WRONG_CAPTCHA_ID"));
    };
    let task = match pin(task, deps).await {
        Ok(t) => t,
        Err(Pin::Store(e)) => return Err(e),
        // Still changing after several rounds: not ready to be shown yet.
        Err(Pin::Changing) => return Ok(Read::code("CAPCHA_NOT_READY")),
    };
    let now = deps.clock.now();
    let (ok, text) = task.compat_answer(now);
    Ok(Read {
        ok,
        structured: ok && task.kind.structured_answer(),
        user_agent: task.compat_user_agent(now).map(str::to_owned),
        text,
    })
}

/// A read's answer: 2captcha's (`OK|…` or the code; `{"status","request"}` in JSON), with a
/// structured answer as a JSON value and the user agent as an extra JSON key.
fn read_answer(p: &Params, r: &Read) -> Response<Body> {
    if !p.json || (r.user_agent.is_none() && !r.structured) {
        return answer(p, r.ok, &r.text, None);
    }
    let request = if r.structured {
        serde_json::from_str::<serde_json::Value>(&r.text).unwrap_or_else(|_| r.text.clone().into())
    } else {
        r.text.clone().into()
    };
    let mut v = serde_json::json!({ "status": u8::from(r.ok), "request": request });
    if let Some(ua) = &r.user_agent {
        v["user_agent"] = ua.clone().into();
    }
    let mut b =
        Response::builder().status(200).header("content-type", "application/json").header("cache-control", "no-store");
    if p.acao {
        b = b.header("access-control-allow-origin", "*");
    }
    b.body(Body::from(v.to_string())).unwrap_or_else(|_| Response::new(Body::Empty))
}

fn over_budget() -> String {
    format!(
        "more than {READS_PER_SECOND} reads a second with this key; reads are answered by the relay, poll every 5 s"
    )
}

/// A read the relay cannot answer now (its store unavailable): "not ready yet", HTTP 200 —
/// the SDKs ask again; a 503 would end their polling with an exception.
fn read_later(p: &Params, e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, "task store call failed (res.php read)");
    answer(p, false, "CAPCHA_NOT_READY", Some("the relay's task store is unavailable; ask again"))
}

/// `/res.php`.
pub async fn res_php(req: &Request, deps: &Deps) -> Response<Body> {
    let p = match params(req) {
        Ok(p) => p,
        Err(r) => return r,
    };
    let owner = match authorise(&p, deps).await {
        Ok(grant) => grant.name,
        Err(r) => return r,
    };
    if !deps.compat.take_read(&owner) {
        metrics::counter!("compat_requests", "outcome" => "rate_limited").increment(1);
        // The SDKs' polling ends on anything but HTTP 200 (the Python SDK raises on a 429 or a
        // 503; the JavaScript SDK on any code but CAPCHA_NOT_READY): a read over the budget is
        // "not ready yet", which both ask again after their interval.
        if p.get("action") == Some("get") {
            return answer(&p, false, "CAPCHA_NOT_READY", Some(&over_budget()));
        }
        let mut r = answer_with(p.json, p.acao, 429, false, "ERROR_TOO_MUCH_REQUESTS", Some(&over_budget()));
        r.headers_mut().insert("retry-after", http::HeaderValue::from_static("1"));
        return r;
    }
    match p.get("action") {
        Some("get") => {
            metrics::counter!("compat_requests", "outcome" => "read").increment(1);
            if let Some(ids) = p.get("ids") {
                let ids: Vec<&str> = ids.split(',').map(str::trim).filter(|s| !s.is_empty()).collect();
                if ids.len() > MAX_IDS {
                    return answer(
                        &p,
                        false,
                        "ERROR_BAD_PARAMETERS",
                        Some(&format!("at most {MAX_IDS} ids in one read")),
                    );
                }
                let mut parts = Vec::with_capacity(ids.len());
                for id in ids {
                    match read_one(id, deps).await {
                        Ok(r) => parts.push(r.text),
                        Err(e) => {
                            tracing::error!(event = "store_failed", error = %e, "task store call failed (res.php read)");
                            parts.push("CAPCHA_NOT_READY".into());
                        }
                    }
                }
                return bare(&p, true, &parts.join("|"));
            }
            let Some(id) = p.get("id") else {
                return answer(&p, false, "ERROR_WRONG_CAPTCHA_ID", Some("`id` is required"));
            };
            match read_one(id, deps).await {
                Ok(r) => read_answer(&p, &r),
                Err(e) => read_later(&p, &e),
            }
        }
        Some("getbalance") => balance(&p, deps).await,
        Some(action @ ("reportgood" | "reportbad")) => report(&p, deps, action == "reportgood").await,
        Some(other) => answer(
            &p,
            false,
            "ERROR_EMPTY_ACTION",
            Some(&format!("action `{other}` is not supported by the relay (get, getbalance, reportgood, reportbad)")),
        ),
        None => answer(&p, false, "ERROR_EMPTY_ACTION", Some("`action` is required")),
    }
}

/// Whether CaptchaAI traffic is stopped; `Some` is the answer to give.
async fn stopped(p: &Params, deps: &Deps) -> Option<Response<Body>> {
    match deps.store.breaker().await {
        Ok(b) => b.open_at(deps.clock.now()).map(|until| {
            unavailable(
                p,
                "ERROR_NO_SLOT_AVAILABLE",
                &format!("the relay stopped CaptchaAI traffic until {until}"),
                until.since(deps.clock.now()),
            )
        }),
        Err(e) => Some(store_trouble(p, &e)),
    }
}

fn captchaai_trouble(p: &Params, e: &CaptchaAiError) -> Response<Body> {
    match e {
        CaptchaAiError::Code(c) => answer(p, false, c.as_ref(), Some("CaptchaAI's answer")),
        other => {
            tracing::warn!(event = "captchaai_failed", error = %other, "compat pass-through failed");
            unavailable(
                p,
                "ERROR_INTERNAL_SERVER_ERROR",
                "CaptchaAI did not answer; trying again is safe",
                Duration::from_secs(5),
            )
        }
    }
}

async fn balance(p: &Params, deps: &Deps) -> Response<Body> {
    let cached = deps.compat.balance.lock().ok().and_then(|b| b.clone()).filter(|(_, at)| at.elapsed() < BALANCE_FOR);
    if let Some((b, _)) = cached {
        return bare(p, true, &b);
    }
    if let Some(r) = stopped(p, deps).await {
        return r;
    }
    match deps.captchaai.balance().await {
        Ok(b) => {
            if let Ok(mut c) = deps.compat.balance.lock() {
                *c = Some((b.clone(), Instant::now()));
            }
            bare(p, true, &b)
        }
        Err(e) => captchaai_trouble(p, &e),
    }
}

async fn report(p: &Params, deps: &Deps, good: bool) -> Response<Body> {
    let task = match p.get("id").map(TaskRef::from_compat_id) {
        Some(Ok(r)) => match deps.store.get_retained(&r, deps.clock.now()).await {
            Ok(t) => t,
            Err(e) => return store_trouble(p, &e),
        },
        _ => None,
    };
    let Some(id) = task.and_then(|t| t.captcha_id) else {
        return answer(p, false, "ERROR_WRONG_CAPTCHA_ID", Some("no task with this id has a CaptchaAI id"));
    };
    if let Some(r) = stopped(p, deps).await {
        return r;
    }
    match deps.captchaai.report(&id, good).await {
        Ok(text) => bare(p, text.starts_with("OK"), &text),
        Err(e) => captchaai_trouble(p, &e),
    }
}

//! `/res.php`: reads answered from the task table (never from CaptchaAI), limited per key;
//! `getbalance` and `reportgood`/`reportbad` passed through to CaptchaAI.

use std::time::Duration;

use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::CaptchaAiError;
use relay_shared::domain::TaskRef;

use super::answer::{answer, answer_with, bare, store_trouble, unavailable};
use super::auth::authorise;
use super::form::params;
use super::params::Params;
use crate::compat_state::bucket::READS_PER_SECOND;
use crate::deps::Deps;
use crate::pin::{Pin, pin};

/// Most ids in one `action=get&ids=` read.
pub const MAX_IDS: usize = 100;

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
    let Some(task) = deps.store.retention.get_retained(&task_ref, deps.clock.now()).await? else {
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
    let p = match params(req).await {
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
    match deps.store.account.breaker().await {
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
    if let Some(b) = deps.compat.cached_balance() {
        return bare(p, true, &b);
    }
    if let Some(r) = stopped(p, deps).await {
        return r;
    }
    match deps.captchaai.balance().await {
        Ok(b) => {
            deps.compat.keep_balance(&b);
            bare(p, true, &b)
        }
        Err(e) => captchaai_trouble(p, &e),
    }
}

async fn report(p: &Params, deps: &Deps, good: bool) -> Response<Body> {
    let task = match p.get("id").map(TaskRef::from_compat_id) {
        Some(Ok(r)) => match deps.store.retention.get_retained(&r, deps.clock.now()).await {
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

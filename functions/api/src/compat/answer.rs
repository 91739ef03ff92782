//! The compat front's answers, as 2captcha gives them: `OK|…` or a code in plain text, or
//! `{"status","request"}` with `json=1`; the relay's own passing trouble as a 503.

use std::time::Duration;

use lambda_http::{Body, Response};

use super::params::Params;

/// An answer in the client's chosen form.
pub(super) fn answer(p: &Params, ok: bool, request: &str, error_text: Option<&str>) -> Response<Body> {
    answer_with(p.json, p.acao, 200, ok, request, error_text)
}

pub(super) fn answer_with(
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
pub(super) fn bare(p: &Params, ok: bool, text: &str) -> Response<Body> {
    answer(p, ok && p.json, text, None)
}

/// The relay's own passing trouble: 503 + `Retry-After` (the SDKs see a network error).
pub(super) fn unavailable(p: &Params, code: &str, text: &str, retry_after: Duration) -> Response<Body> {
    let mut r = answer_with(p.json, p.acao, 503, false, code, Some(text));
    if let Ok(v) = http::HeaderValue::from_str(&retry_after.as_secs().max(1).to_string()) {
        r.headers_mut().insert("retry-after", v);
    }
    r
}

pub(super) fn store_trouble(p: &Params, e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, "task store call failed (compat)");
    unavailable(
        p,
        "ERROR_INTERNAL_SERVER_ERROR",
        "the relay's task store is unavailable; trying again is safe",
        Duration::from_secs(5),
    )
}

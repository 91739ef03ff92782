//! Reading CaptchaAI's answers: every shape of the protocol (JSON, `OK|…`, a bare code) into a
//! [`RawAnswer`], then res.php's into ready, not ready or a code ([`ResAnswer`]), one task's or
//! a batch's; and a report's answer.

use serde::Deserialize;

use super::error::CaptchaAiError;
use crate::codes::{CodeClass, ErrorCode, classify};
use crate::domain::Solution;

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

pub(super) fn code(s: &str) -> Result<ErrorCode, CaptchaAiError> {
    ErrorCode::parse(s).map_err(|e| CaptchaAiError::NotAnAnswer(e.0))
}

pub(super) fn res_answer(raw: RawAnswer) -> Result<ResAnswer, CaptchaAiError> {
    match raw {
        RawAnswer::Ok(s) => Solution::parse(&s).map(ResAnswer::Ready).map_err(|e| CaptchaAiError::NotAnAnswer(e.0)),
        RawAnswer::Code(c) if classify(&c) == CodeClass::NotReady => Ok(ResAnswer::NotReady),
        RawAnswer::Code(c) => Ok(ResAnswer::Code(code(&c)?)),
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

/// A report's answer: an empty 200 (CaptchaAI) is `OK_REPORT_RECORDED`, as 2captcha says it.
pub fn report_answer(http_status: u16, body: &str) -> Result<String, CaptchaAiError> {
    if http_status == 200 && body.trim().is_empty() {
        return Ok("OK_REPORT_RECORDED".into());
    }
    match parse_answer(http_status, body)? {
        RawAnswer::Ok(t) | RawAnswer::Code(t) => Ok(t),
    }
}

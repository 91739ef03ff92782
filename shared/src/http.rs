//! HTTP helpers for the Lambda handlers: JSON answers, problem bodies, path reading, and the
//! caller check for the owner's routes.

use lambda_http::{Body, Request, RequestExt, Response, request::RequestContext};
use secrecy::{ExposeSecret, SecretString};
use serde::Serialize;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

/// A JSON response.
pub fn json<T: Serialize>(status: u16, value: &T) -> Response<Body> {
    let body = serde_json::to_string(value).unwrap_or_else(|_| "{}".into());
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body))
        .unwrap_or_else(|_| Response::new(Body::Empty))
}

/// An error body `{"error":{"code":…,"message":…}}`. The message is for the caller: it never
/// carries an internal cause (that goes to the log).
pub fn problem(status: u16, code: &str, message: impl Into<String>) -> Response<Body> {
    #[derive(Serialize)]
    struct Inner<'a> {
        code: &'a str,
        message: String,
    }
    #[derive(Serialize)]
    struct Problem<'a> {
        error: Inner<'a>,
    }
    json(status, &Problem { error: Inner { code, message: message.into() } })
}

/// Adds a header to a response.
pub fn with_header(mut resp: Response<Body>, name: &'static str, value: &str) -> Response<Body> {
    if let Ok(v) = http::HeaderValue::from_str(value) {
        resp.headers_mut().insert(name, v);
    }
    resp
}

/// The path's segments after the API Gateway stage, if any (`/prod/tasks/x` → `[tasks, x]`).
/// Works the same for Lambda events and for the local server.
pub fn path_segments(req: &Request) -> Vec<String> {
    let path = req.uri().path();
    let mut segs: Vec<String> = path.split('/').filter(|s| !s.is_empty()).map(str::to_owned).collect();
    if let Some(RequestContext::ApiGatewayV2(ctx)) = req.request_context_ref()
        && let Some(stage) = ctx.stage.as_deref()
        && stage != "$default"
        && segs.first().map(String::as_str) == Some(stage)
    {
        segs.remove(0);
    }
    segs
}

/// Parses `a=1&b=2` (a query string or a form body) strictly: `+` is a space, every `%`
/// escape must be two hex digits, and the result must be UTF-8 — a lossy decode could turn a
/// malformed delivery into a wrong token.
pub fn parse_form(raw: &[u8]) -> Result<Vec<(String, String)>, String> {
    fn decode(s: &[u8]) -> Result<String, String> {
        let mut out = Vec::with_capacity(s.len());
        let mut i = 0;
        while i < s.len() {
            match s[i] {
                b'+' => out.push(b' '),
                b'%' => {
                    let hex = s.get(i + 1..i + 3).and_then(|h| std::str::from_utf8(h).ok());
                    let byte =
                        hex.and_then(|h| u8::from_str_radix(h, 16).ok()).ok_or("a `%` escape is not two hex digits")?;
                    out.push(byte);
                    i += 2;
                }
                b => out.push(b),
            }
            i += 1;
        }
        String::from_utf8(out).map_err(|_| "an escaped value is not UTF-8".to_owned())
    }
    raw.split(|b| *b == b'&')
        .filter(|pair| !pair.is_empty())
        .map(|pair| {
            let mut kv = pair.splitn(2, |b| *b == b'=');
            Ok((decode(kv.next().unwrap_or_default())?, decode(kv.next().unwrap_or_default())?))
        })
        .collect()
}

/// The raw query string (`a=1&b=2`), from the URI.
pub fn query_string(req: &Request) -> &str {
    req.uri().query().unwrap_or("")
}

/// Who may call the owner's routes, resolved at cold start.
#[derive(Clone)]
pub enum Authorizer {
    /// API Gateway checked SigV4; we only confirm an IAM identity is present.
    Iam,
    /// A bearer key, stored as its SHA-256 so the comparison is constant time and length-blind.
    ApiKey([u8; 32]),
}

impl std::fmt::Debug for Authorizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Iam => "Authorizer::Iam",
            Self::ApiKey(_) => "Authorizer::ApiKey(<secret>)",
        })
    }
}

impl Authorizer {
    pub fn api_key(key: &SecretString) -> Self {
        Self::ApiKey(Sha256::digest(key.expose_secret().as_bytes()).into())
    }

    /// Who the (authorised) caller is, for scoping what they name — their idempotency keys:
    /// the IAM principal (an assumed role without its session name, so keys hold across
    /// sessions), or the API key.
    pub fn owner(&self, req: &Request) -> String {
        match self {
            Self::ApiKey(_) => "api-key".into(),
            Self::Iam => {
                let iam = match req.request_context_ref() {
                    Some(RequestContext::ApiGatewayV2(ctx)) => ctx.authorizer.as_ref().and_then(|a| a.iam.clone()),
                    _ => None,
                };
                let arn = iam.as_ref().and_then(|i| i.user_arn.clone()).unwrap_or_default();
                match arn.split_once(":assumed-role/") {
                    Some((head, rest)) => format!("{head}:assumed-role/{}", rest.split('/').next().unwrap_or("")),
                    None => arn,
                }
            }
        }
    }

    /// `Ok(())` for an authorised caller, else the 401/403 to answer.
    pub fn check(&self, req: &Request) -> Result<(), Box<Response<Body>>> {
        match self {
            Self::Iam => {
                let has_iam = matches!(
                    req.request_context_ref(),
                    Some(RequestContext::ApiGatewayV2(ctx)) if ctx.authorizer.as_ref().is_some_and(|a| a.iam.is_some())
                );
                if has_iam {
                    Ok(())
                } else {
                    Err(Box::new(problem(403, "forbidden", "this route requires IAM (SigV4) authorisation")))
                }
            }
            Self::ApiKey(want) => {
                let Some(header) = req.headers().get("authorization").and_then(|v| v.to_str().ok()) else {
                    return Err(Box::new(with_header(
                        problem(401, "unauthorized", "missing `Authorization: Bearer <api key>` header"),
                        "www-authenticate",
                        "Bearer",
                    )));
                };
                let Some(given) = header.strip_prefix("Bearer ").or_else(|| header.strip_prefix("bearer ")) else {
                    return Err(Box::new(with_header(
                        problem(401, "unauthorized", "the Authorization header must use the Bearer scheme"),
                        "www-authenticate",
                        "Bearer",
                    )));
                };
                let got: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
                if bool::from(got.ct_eq(want)) {
                    Ok(())
                } else {
                    Err(Box::new(problem(403, "forbidden", "the API key is not valid")))
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(auth: Option<&str>) -> Request {
        let mut b = http::Request::builder().uri("https://x.example/tasks");
        if let Some(a) = auth {
            b = b.header("authorization", a);
        }
        b.body(Body::Empty).expect("request")
    }

    #[test]
    fn api_key_missing_wrong_and_right() {
        let a = Authorizer::api_key(&SecretString::from("sekret".to_owned()));
        assert_eq!(a.check(&req(None)).expect_err("missing").status(), 401);
        assert_eq!(a.check(&req(Some("Basic abc"))).expect_err("scheme").status(), 401);
        assert_eq!(a.check(&req(Some("Bearer nope"))).expect_err("wrong").status(), 403);
        assert_eq!(a.check(&req(Some("Bearer sekre"))).expect_err("prefix").status(), 403);
        assert!(a.check(&req(Some("Bearer sekret"))).is_ok());
    }

    #[test]
    fn iam_mode_refuses_requests_without_an_iam_identity() {
        assert_eq!(Authorizer::Iam.check(&req(None)).expect_err("no context").status(), 403);
    }

    #[test]
    fn forms_decode_strictly() {
        assert_eq!(
            parse_form(b"id=71&code=a+b%2Bc%E2%9C%93"),
            Ok(vec![("id".into(), "71".into()), ("code".into(), "a b+c\u{2713}".into())])
        );
        assert_eq!(parse_form(b"&&a&b="), Ok(vec![("a".into(), String::new()), ("b".into(), String::new())]));
        assert!(parse_form(b"code=%FF").is_err(), "not UTF-8");
        assert!(parse_form(b"code=%G1").is_err(), "not hex");
        assert!(parse_form(b"code=%4").is_err(), "cut short");
    }

    #[test]
    fn paths_are_split_into_segments() {
        let r = http::Request::builder().uri("https://x.example/tasks/tsk_1/").body(Body::Empty).expect("request");
        assert_eq!(path_segments(&r), ["tasks", "tsk_1"]);
    }
}

//! Reading a compat request's parameters: the query string, then the body — a form (the Python
//! SDK, curl -d), `multipart/form-data` (a file, as the SDKs post one; parsed by multer) or a
//! JSON object (the JavaScript SDK's images).

use std::collections::HashMap;

use lambda_http::{Body, Request, Response};
use relay_shared::http::{parse_form, query_string};

use super::answer::answer_with;
use super::params::Params;
use crate::request::MAX_BODY;

/// Most parts one multipart body may hold.
const MAX_PARTS: usize = 100;

/// Longest multipart boundary (RFC 2046 allows 1 to 70 characters).
const MAX_BOUNDARY: usize = 70;

/// Reads the parameters; `Err` is the answer for a body that cannot be read.
pub(super) async fn params(req: &Request) -> Result<Params, Response<Body>> {
    let mut values: HashMap<String, String> = HashMap::new();
    let mut file = None;
    let bad = |json: bool, text: &str| answer_with(json, false, 400, false, "ERROR_BAD_PARAMETERS", Some(text));
    let wants_json = |v: &HashMap<String, String>| v.get("json").is_some_and(|j| j == "1");
    for (k, v) in parse_form(query_string(req).as_bytes()).map_err(|e| bad(false, &format!("query string: {e}")))? {
        values.entry(k).or_insert(v);
    }
    let body: &[u8] = req.body().as_ref();
    if body.len() > MAX_BODY {
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
            let sent = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
            let boundary = multer::parse_boundary(sent).map_err(|e| match e {
                multer::Error::NoBoundary => bad(wants_json(&values), "a multipart body without a boundary"),
                other => {
                    bad(wants_json(&values), &format!("the multipart Content-Type has no readable boundary ({other})"))
                }
            })?;
            for part in multipart(body, boundary).await.map_err(|e| bad(wants_json(&values), &e))? {
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

/// One part of a multipart body.
struct Part {
    name: String,
    filename: Option<String>,
    data: Vec<u8>,
}

/// Splits a `multipart/form-data` body (RFC 7578) into its parts. The body is already whole in
/// memory (and within [`MAX_BODY`]), so multer reads it as a stream of one chunk; any error of
/// its is the caller's malformed body.
async fn multipart(body: &[u8], boundary: String) -> Result<Vec<Part>, String> {
    if boundary.is_empty() || boundary.len() > MAX_BOUNDARY {
        return Err(format!("a multipart boundary must be 1 to {MAX_BOUNDARY} characters"));
    }
    let chunk = body.to_vec();
    let stream = futures_util::stream::once(async move { Ok::<_, std::io::Error>(chunk) });
    let limits = multer::Constraints::new().size_limit(multer::SizeLimit::new().whole_stream(MAX_BODY as u64));
    let mut form = multer::Multipart::with_constraints(stream, boundary, limits);
    let mut parts = Vec::new();
    while let Some(field) = form.next_field().await.map_err(|e| format!("multipart body: {e}"))? {
        let name = field.name().ok_or("a part without a name")?.to_owned();
        let filename = field.file_name().map(str::to_owned);
        let data = field.bytes().await.map_err(|e| format!("multipart body: {e}"))?.to_vec();
        parts.push(Part { name, filename, data });
        if parts.len() > MAX_PARTS {
            return Err(format!("more than {MAX_PARTS} parts"));
        }
    }
    Ok(parts)
}

#[cfg(test)]
mod tests;

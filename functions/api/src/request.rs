//! What both fronts read from a request alike: the body's size bound and the
//! `Idempotency-Key` header.

use lambda_http::{Body, Request, Response};
use relay_shared::http::problem;

/// Largest `POST /tasks` body (an image task carries up to ~140 KiB of base64).
pub const MAX_BODY: usize = 256 * 1024;

/// Longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// The `Idempotency-Key` header, if any: 1 to 255 printable ASCII characters.
pub(crate) fn idempotency_key(req: &Request) -> Result<Option<String>, Response<Body>> {
    let mut values = req.headers().get_all("idempotency-key").iter();
    let Some(v) = values.next() else { return Ok(None) };
    let bad = || {
        problem(
            400,
            "invalid_idempotency_key",
            format!("`Idempotency-Key` must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters, given once"),
        )
    };
    if values.next().is_some() {
        return Err(bad());
    }
    let k = v.to_str().map_err(|_| bad())?.trim();
    if k.is_empty() || k.len() > MAX_IDEMPOTENCY_KEY || !k.bytes().all(|b| (0x20..0x7f).contains(&b)) {
        return Err(bad());
    }
    Ok(Some(k.to_owned()))
}

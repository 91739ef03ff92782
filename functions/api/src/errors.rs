//! The owner's API's answers for the relay's own passing trouble: 503s that say whether
//! sending the same request again is safe, and when.

use std::time::Duration;

use lambda_http::{Body, Response};
use relay_shared::http::{json, with_header};

/// A 503 that says whether sending the same request again is safe, and when.
pub(crate) fn unavailable(
    code: &str,
    message: impl Into<String>,
    retry_after: Duration,
    retry_safe: bool,
) -> Response<Body> {
    let body = serde_json::json!({ "error": { "code": code, "message": message.into(), "retry_safe": retry_safe } });
    with_header(json(503, &body), "retry-after", &retry_after.as_secs().max(1).to_string())
}

/// The store failed (throttled, most likely, when it fails for many at once): "try again", in 5
/// to 15 s. Spread, so the clients refused during a throttled minute do not all return in the
/// same second after it and throttle it again (docs/capacity.md).
pub(crate) fn store_unavailable(e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, retryable = e.is_retryable(), "task store call failed");
    unavailable(
        "store_unavailable",
        "the task store is unavailable; nothing was sent to CaptchaAI, so trying again is safe",
        relay_shared::retry::spread(STORE_RETRY_AFTER, STORE_RETRY_SPREAD, relay_shared::retry::unit_random()),
        true,
    )
}

/// The least a client told "store unavailable" waits, and the window over which they spread.
const STORE_RETRY_AFTER: Duration = Duration::from_secs(5);
const STORE_RETRY_SPREAD: Duration = Duration::from_secs(10);

pub(crate) fn result_changing() -> Response<Body> {
    unavailable(
        "result_changing",
        "the task's result is being replaced by one received earlier; reading again is safe",
        Duration::from_secs(1),
        true,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn clients_told_the_store_is_unavailable_come_back_spread_over_5_to_15_s() {
        let e = relay_shared::store::StoreError::Unavailable("throttled".into());
        let waits: std::collections::BTreeSet<u64> = (0..200)
            .map(|_| {
                let r = store_unavailable(&e);
                assert_eq!(r.status(), 503);
                r.headers()["retry-after"].to_str().ok().and_then(|v| v.parse().ok()).unwrap_or(0)
            })
            .collect();
        assert!(waits.iter().all(|w| (5..=15).contains(w)), "{waits:?}");
        assert!(waits.len() >= 5, "spread, not one second for all: {waits:?}");
    }
}

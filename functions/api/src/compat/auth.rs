//! The compat front's credentials: the `key` parameter, a relay key (never the CaptchaAI key).

use lambda_http::{Body, Response};
use relay_shared::store::{KeyCheck, KeyGrant};

use super::answer::{answer, store_trouble};
use super::params::Params;
use crate::deps::Deps;

/// Checks the `key` parameter; `Err` is the answer to give.
pub(super) async fn authorise(p: &Params, deps: &Deps) -> Result<KeyGrant, Response<Body>> {
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

//! `/in.php`: a v1 submit, through the very submit path `POST /tasks` uses, answered as
//! 2captcha answers it.

use std::time::Duration;

use lambda_http::{Body, Request, Response};
use relay_shared::domain::{Task, TaskRef, TaskState};
use sha2::{Digest, Sha256};

use super::answer::{answer, answer_with, store_trouble, unavailable};
use super::auth::authorise;
use super::captcha::captcha;
use super::form::params;
use super::params::Params;
use crate::deps::Deps;
use crate::request::idempotency_key;
use crate::submit::{SubmitInput, Submitted, submit_task};

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
    let p = match params(req).await {
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
    let idem = match idempotency_key(req) {
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

//! The owner's own routes: `POST /tasks` (its body read and checked, the submit's outcome
//! answered as JSON) and `GET /tasks/{ref}` (the task's view, its place in the queue).

use std::time::Duration;

use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::SubmitRequest;
use relay_shared::codes::CodeClass;
use relay_shared::domain::{Task, TaskRef, TaskState, Via};
use relay_shared::http::{json, problem, with_header};
use relay_shared::time::Timestamp;
use relay_shared::webhook::UrlPolicy;
use sha2::{Digest, Sha256};

use crate::deps::Deps;
use crate::errors::{result_changing, store_unavailable, unavailable};
use crate::pin::{Pin, pin};
use crate::request::{MAX_BODY, idempotency_key};
use crate::submit::{SubmitInput, Submitted, submit_task};

/// A parsed submit: the request, and the fingerprint of its body (canonical JSON, so key order
/// and whitespace do not matter) for idempotency checks.
/// A parsed `POST /tasks` body: the captcha, the fingerprint of the whole body, and the owner's
/// callback URL (`callback_url`), checked.
type ParsedSubmit = (SubmitRequest, String, Option<String>);

fn parse_submit(req: &Request, policy: UrlPolicy) -> Result<ParsedSubmit, Response<Body>> {
    let body: &[u8] = req.body().as_ref();
    if body.len() > MAX_BODY {
        return Err(problem(413, "body_too_large", format!("the body is over {MAX_BODY} bytes")));
    }
    let ctype = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ctype.to_ascii_lowercase().starts_with("application/json") {
        return Err(problem(415, "unsupported_media_type", "the body must be application/json"));
    }
    let value: serde_json::Value =
        serde_json::from_slice(body).map_err(|e| problem(400, "invalid_request", e.to_string()))?;
    // serde_json's maps are ordered by key: the text is canonical.
    let fingerprint = hex::encode(Sha256::digest(value.to_string().as_bytes()));
    let mut captcha = value;
    let callback_url = match captcha.as_object_mut().and_then(|o| o.remove("callback_url")) {
        None | Some(serde_json::Value::Null) => None,
        Some(serde_json::Value::String(url)) => Some(
            relay_shared::delivery::check_owner_url(&url, policy)
                .map_err(|why| problem(400, "invalid_callback_url", format!("`callback_url` refused: {why}")))?,
        ),
        Some(_) => return Err(problem(400, "invalid_callback_url", "`callback_url` must be a string (a URL)")),
    };
    let submit: SubmitRequest =
        serde_json::from_value(captcha).map_err(|e| problem(400, "invalid_request", e.to_string()))?;
    submit.validate().map_err(|e| problem(400, "invalid_request", e.0))?;
    Ok((submit, fingerprint, callback_url))
}

/// Answers a submit whose key was used before: the task as it is now, or 422 for another body.
fn replay(task: &Task, stored: Option<&str>, fingerprint: &str, now: Timestamp) -> Response<Body> {
    if stored != Some(fingerprint) {
        return problem(
            422,
            "idempotency_key_reused",
            "this Idempotency-Key was used with a different request; use a new key for a new task",
        );
    }
    let view = task.view(now);
    let resp = match &task.state {
        TaskState::Failed { code, via: Via::Submit, .. } => {
            let class = code.class();
            let status = if matches!(class, CodeClass::Permanent | CodeClass::TerminalForTask) { 422 } else { 503 };
            json(
                status,
                &serde_json::json!({ "error": { "code": code.as_ref(), "message": "in.php refused this task", "retry_safe": status == 503 }, "task": view }),
            )
        }
        _ => json(202, &view),
    };
    with_header(resp, "idempotent-replayed", "true")
}

pub(crate) async fn submit(req: &Request, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let (submit, fingerprint, owner_callback) = parse_submit(req, deps.delivery_policy)?;
    if !deps.queue.upstream.solves(submit.kind()) {
        return Err(problem(422, "unsupported_kind", deps.queue.upstream.refusal(submit.kind())));
    }
    let idem = idempotency_key(req)?;
    let owner = deps.auth.owner(req);
    let task_ref = match &idem {
        Some(key) => deps.idempotency.task_ref(&owner, key),
        None => TaskRef::generate(),
    };
    let webhook_owner = owner_callback.as_ref().map(|_| relay_shared::store::deliveries::DEFAULT_OWNER.to_owned());
    let input = SubmitInput {
        submit,
        fingerprint,
        keyed: idem.is_some(),
        task_ref,
        owner_callback,
        webhook_owner,
        pingback_form: relay_shared::domain::PingbackForm::default(),
        owner,
    };
    Ok(match submit_task(req, deps, input).await {
        Submitted::Accepted(task) | Submitted::Queued(task) => json(202, &task.view(deps.clock.now())),
        Submitted::Replayed { task, stored, fingerprint } => {
            replay(&task, stored.as_deref(), &fingerprint, deps.clock.now())
        }
        Submitted::BreakerOpen { until, reason } => unavailable(
            "captchaai_unavailable",
            format!(
                "CaptchaAI traffic is stopped until {until} ({reason}: an operator must act); nothing was recorded or sent, trying again then is safe"
            ),
            until.since(deps.clock.now()),
            true,
        ),
        Submitted::QueueFull { owner, depth, bound } => {
            let (which, setting) =
                if owner { ("your", "QUEUE_MAX_PER_OWNER") } else { ("the relay's", "QUEUE_MAX_TOTAL") };
            let body = serde_json::json!({ "error": { "code": "queue_full", "retry_safe": true,
                "reason": if owner { "owner_queue_full" } else { "queue_full" },
                "message": format!("{which} submit queue holds {depth} tasks waiting for a CaptchaAI thread, its bound ({setting} = {bound}); nothing was recorded or sent, try again when it has drained") } });
            with_header(json(429, &body), "retry-after", "10")
        }
        Submitted::Store(e) => store_unavailable(&e),
        Submitted::Misconfigured => problem(500, "misconfigured", "the relay does not know its callback URL"),
        Submitted::ResultChanging => result_changing(),
        Submitted::Banned { code, until, duration } => unavailable(
            &code,
            format!(
                "CaptchaAI answered {code}; traffic is stopped until {until}. Nothing was accepted: trying again then is safe"
            ),
            duration,
            true,
        ),
        Submitted::Refused { code, class, message, task_ref } => json(
            422,
            &serde_json::json!({ "error": { "code": code, "message": message, "class": class.as_str(), "retry_safe": false }, "task_ref": task_ref }),
        ),
    })
}

pub(crate) async fn get_task(raw: &str, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let task_ref = TaskRef::parse(raw).map_err(|e| problem(404, "unknown_task", format!("no such task: {e}")))?;
    // Past its retention a task is unknown, whether or not the table still holds it.
    match deps.store.retention.get_retained(&task_ref, deps.clock.now()).await {
        Ok(Some(task)) => {
            let now = deps.clock.now();
            let task = pinned(task, deps).await?;
            let mut view = task.view(now);
            if let (TaskState::Queued { queued_at, lane }, Some(q)) = (&task.state, view.queue.as_mut()) {
                place_in_queue(deps, lane, *queued_at, now, q).await;
            }
            Ok(json(200, &view))
        }
        Ok(None) => Err(problem(404, "unknown_task", "no such task")),
        Err(e) => Err(store_unavailable(&e)),
    }
}

/// Most tasks counted ahead of a queued one (a Query of the keys-only index; beyond this the
/// position says "at least").
const POSITION_CAP: i32 = 10_000;

/// A queued task's position in its lane and when it should be released at the rate the queue
/// is released now (its owner's lanes share the threads with every other owner waiting).
async fn place_in_queue(
    deps: &Deps,
    lane: &str,
    queued_at: Timestamp,
    now: Timestamp,
    q: &mut relay_shared::domain::QueueView,
) {
    let ahead = match deps.store.queue.queue_ahead(lane, queued_at, POSITION_CAP).await {
        Ok(n) => n,
        Err(e) => {
            // The task itself was read: show it without a position rather than fail the read.
            tracing::warn!(event = "store_failed", error = %e, "could not count the queue");
            return;
        }
    };
    q.position = Some(ahead + 1);
    if let Ok(state) = deps.store.queue.submit_state().await
        && state.released_per_minute > 0
    {
        let owners = state
            .lanes
            .keys()
            .filter_map(|l| relay_shared::submit::lanes::parse_lane(l).map(|(o, _)| o))
            .collect::<std::collections::BTreeSet<_>>()
            .len()
            .max(1) as u64;
        let secs = (ahead + 1) * owners * 60 / state.released_per_minute;
        q.estimated_release_at = Some(now.plus(Duration::from_secs(secs)).to_rfc3339());
    }
}

async fn pinned(task: Task, deps: &Deps) -> Result<Task, Response<Body>> {
    pin(task, deps).await.map_err(|e| match e {
        Pin::Store(e) => store_unavailable(&e),
        Pin::Changing => result_changing(),
    })
}

//! The owner's API: `POST /tasks` submits a captcha, `GET /tasks/{ref}` reads it back.
//!
//! Every in.php call CaptchaAI accepts is money spent, so a submit:
//! - is idempotent with an `Idempotency-Key` header: the key (with the caller) names the task's
//!   reference, and creating the task is one conditional put — the same key and body return the
//!   same task without a second in.php call, a different body is a 422;
//! - records the task before in.php hears of it (so a pingback that outruns the answer finds it);
//! - checks the account-wide breaker first, and opens it on a ban answer (never retried);
//! - calls in.php again only after an explicit refusal that invites it (`ERROR_NO_SLOT_…`) or a
//!   connection that never opened; any answer that does not prove a refusal — a timeout, a cut
//!   connection, a 5xx, an HTML page — leaves the task `submitting` with "outcome unknown",
//!   never retried by the relay and never called failed (its pingback will say);
//! - never loses CaptchaAI's id: storing it is retried, and if that keeps failing it goes to
//!   the dead-letter queue for the redrive function to store.

pub mod compat;

use std::sync::Arc;

use std::time::Duration;
use tracing::Instrument;

use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError, SubmitRequest};
use relay_shared::codes::{CodeClass, ban};
use relay_shared::deadletter::{DeadLetter, DeadLetterSink, SqsQueue};
use relay_shared::domain::{CaptchaId, Task, TaskRef, TaskState, Via};
use relay_shared::http::{Authorizer, json, path_segments, problem, with_header};
use relay_shared::retry::backoff_delay;
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{Created, SubmitRecorded, TaskStore};
use relay_shared::time::{Clock, Timestamp};
use relay_shared::webhook::UrlPolicy;
use sha2::{Digest, Sha256};

/// Largest `POST /tasks` body (an image task carries up to ~140 KiB of base64).
pub const MAX_BODY: usize = 256 * 1024;

/// Longest `Idempotency-Key` accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = 255;

/// What the handler needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: TaskStore,
    pub captchaai: CaptchaAiClient,
    pub signer: CallbackSigner,
    pub auth: Authorizer,
    pub clock: Arc<dyn Clock>,
    /// Public base URL of the callback route. `None`: the API's own URL, read from the
    /// request (the callback route lives on the same HTTP API).
    pub callback_base_url: Option<String>,
    /// How long a callback gets before the poller asks res.php, per kind.
    pub callback_grace: relay_shared::config::CallbackGrace,
    /// Tries of in.php after explicit refusals that invite another try.
    pub submit_attempts: u32,
    /// First backoff between tries (doubles, capped at 4 s).
    pub submit_backoff: Duration,
    /// Where in.php's id goes when it cannot be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
    /// In.php submits allowed per second, account-wide (CaptchaAI bans more than 60 in 3 s).
    pub submits_per_second: u32,
    /// The keys the 2captcha-compatible routes (`/in.php`, `/res.php`) take.
    pub relay_keys: relay_shared::store::RelayKeys,
    /// Per-instance state of those routes (balance cache, per-key read limits).
    pub compat: compat::CompatState,
    /// Which owner callback URLs (`callback_url`, `pingback`) a task may carry
    /// (`DELIVERY_URL_POLICY`; on AWS public https only).
    pub delivery_policy: UrlPolicy,
}

/// How many seconds a submit over the account-wide pace waits for a slot before it is refused.
pub const PACE_WAIT_SECONDS: u32 = 3;

/// The default of [`Deps::submits_per_second`]: 4 × 14 = 56 in any 3 s, under the 60 that earn
/// `MAX_USER_TURN`.
pub const SUBMITS_PER_SECOND: u32 = 14;

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{ApiConfig, AuthMode, Settings};
        let env = Settings::from_env();
        let cfg = ApiConfig::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let mut secrets = relay_shared::secrets::SecretLoader::new(&aws);
        let key = secrets.load(&cfg.captchaai.api_key).await.context("loading the CaptchaAI key")?;
        let signing = secrets.load(&cfg.signing_secret).await.context("loading the callback signing secret")?;
        let auth = match &cfg.auth {
            AuthMode::Iam => Authorizer::Iam,
            AuthMode::ApiKey(src) => {
                Authorizer::api_key(&secrets.load(src).await.context("loading the relay API key")?)
            }
        };
        let store = TaskStore::from_config(&aws, &cfg.store);
        Ok(Self {
            relay_keys: relay_shared::store::RelayKeys::new(Some(store.clone())),
            compat: compat::CompatState::default(),
            delivery_policy: relay_shared::delivery::url_policy(&env)?,
            store,
            captchaai: CaptchaAiClient::new(
                &cfg.captchaai.base_url,
                key,
                cfg.captchaai.timeout,
                cfg.captchaai.soft_id,
            )?,
            signer: CallbackSigner::new(signing),
            auth,
            clock: Arc::new(relay_shared::time::SystemClock),
            callback_base_url: cfg.callback_base_url,
            callback_grace: cfg.callback_grace,
            submit_attempts: cfg.submit_attempts,
            submit_backoff: Duration::from_millis(500),
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
            submits_per_second: env.parse_or("SUBMITS_PER_SECOND", SUBMITS_PER_SECOND)?.clamp(1, 15),
        })
    }
}

/// The Lambda entry point. Never fails: every outcome is an HTTP answer.
pub async fn handle(req: Request, deps: &Deps) -> Result<Response<Body>, lambda_http::Error> {
    Ok(respond(req, deps).await)
}

/// Routes and answers one request.
pub async fn respond(req: Request, deps: &Deps) -> Response<Body> {
    let segs = path_segments(&req);
    // The 2captcha-compatible front checks its own keys (SDKs cannot sign SigV4).
    match segs.as_slice() {
        [p] if p == "in.php" => return compat::in_php(&req, deps).await,
        [p] if p == "res.php" => return compat::res_php(&req, deps).await,
        _ => {}
    }
    let route = match segs.as_slice() {
        [t] if t == "tasks" => Route::Tasks,
        [t, r] if t == "tasks" => Route::Task(r.clone()),
        _ => return problem(404, "no_route", "no such route"),
    };
    if let Err(denied) = deps.auth.check(&req) {
        return *denied;
    }
    match (route, req.method().as_str()) {
        (Route::Tasks, "POST") => submit(&req, deps).await.unwrap_or_else(|r| r),
        (Route::Task(r), "GET") => get_task(&r, deps).await.unwrap_or_else(|r| r),
        (Route::Tasks, _) => with_header(problem(405, "method_not_allowed", "use POST"), "allow", "POST"),
        (Route::Task(_), _) => with_header(problem(405, "method_not_allowed", "use GET"), "allow", "GET"),
    }
}

enum Route {
    Tasks,
    Task(String),
}

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

/// A 503 that says whether sending the same request again is safe, and when.
fn unavailable(code: &str, message: impl Into<String>, retry_after: Duration, retry_safe: bool) -> Response<Body> {
    let body = serde_json::json!({ "error": { "code": code, "message": message.into(), "retry_safe": retry_safe } });
    with_header(json(503, &body), "retry-after", &retry_after.as_secs().max(1).to_string())
}

fn store_unavailable(e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, retryable = e.is_retryable(), "task store call failed");
    unavailable(
        "store_unavailable",
        "the task store is unavailable; nothing was sent to CaptchaAI, so trying again is safe",
        Duration::from_secs(5),
        true,
    )
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

async fn submit(req: &Request, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let (submit, fingerprint, owner_callback) = parse_submit(req, deps.delivery_policy)?;
    let idem = idempotency_key(req)?;
    let task_ref = match &idem {
        Some(key) => deps.signer.idempotent_ref(&deps.auth.owner(req), key),
        None => TaskRef::generate(),
    };
    let webhook_owner = owner_callback.as_ref().map(|_| relay_shared::store::deliveries::DEFAULT_OWNER.to_owned());
    let input = SubmitInput { submit, fingerprint, keyed: idem.is_some(), task_ref, owner_callback, webhook_owner };
    Ok(match submit_task(req, deps, input).await {
        Submitted::Accepted(task) => json(202, &task.view(deps.clock.now())),
        Submitted::Replayed { task, stored, fingerprint } => {
            replay(&task, stored.as_deref(), &fingerprint, deps.clock.now())
        }
        Submitted::BreakerOpen { until, reason } => unavailable(
            "captchaai_unavailable",
            format!(
                "CaptchaAI traffic is stopped until {until} ({reason}); nothing was recorded or sent, trying again then is safe"
            ),
            until.since(deps.clock.now()),
            true,
        ),
        Submitted::RateLimited => {
            let body = serde_json::json!({ "error": { "code": "rate_limited", "retry_safe": true,
                "message": "too many submits for the account-wide pace (CaptchaAI bans more than 60 in 3 s), even after waiting 3 s; nothing was sent, try again in a second" } });
            with_header(json(429, &body), "retry-after", "1")
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
        Submitted::Transient { code, message, task_ref } => {
            let mut resp =
                unavailable(&code, message, Duration::from_secs(relay_shared::codes::retry_after_secs(&code)), true);
            if let Ok(v) = http::HeaderValue::from_str(task_ref.as_ref()) {
                resp.headers_mut().insert("x-task-ref", v);
            }
            resp
        }
    })
}

/// A submit, however it came (`POST /tasks` or the 2captcha-compatible `in.php`).
pub(crate) struct SubmitInput {
    pub submit: SubmitRequest,
    /// Of the request, for idempotency checks.
    pub fingerprint: String,
    /// Whether `task_ref` was derived from an idempotency key.
    pub keyed: bool,
    pub task_ref: TaskRef,
    pub owner_callback: Option<String>,
    /// Whose webhook secret signs the pushes to `owner_callback`.
    pub webhook_owner: Option<String>,
}

/// How a submit ended, for either front to answer in its own form.
pub(crate) enum Submitted {
    /// CaptchaAI has it (or may have it: an unknown outcome); the task as it now stands.
    Accepted(Task),
    /// The idempotency key was used before: that task, and the fingerprint it came with.
    Replayed { task: Task, stored: Option<String>, fingerprint: String },
    /// The account-wide breaker is open: nothing recorded or sent.
    BreakerOpen { until: Timestamp, reason: String },
    /// No in.php slot left this second: nothing recorded or sent.
    RateLimited,
    /// The store failed before anything was sent.
    Store(relay_shared::store::StoreError),
    /// The relay does not know its callback URL.
    Misconfigured,
    /// A replayed task's result is being replaced by one received earlier: read again.
    ResultChanging,
    /// In.php answered a ban: the breaker is open, nothing was accepted.
    Banned { code: String, until: Timestamp, duration: Duration },
    /// An explicit, final refusal: the task is failed with the code.
    Refused { code: String, class: CodeClass, message: String, task_ref: TaskRef },
    /// Refused for now (after the tries allowed): nothing was accepted, trying again is safe.
    Transient { code: String, message: String, task_ref: TaskRef },
}

/// The submit itself: breaker, pacing, one conditional put, in.php (retried only after explicit
/// refusals that invite it), then the id stored or dead-lettered.
pub(crate) async fn submit_task(req: &Request, deps: &Deps, input: SubmitInput) -> Submitted {
    let SubmitInput { submit, fingerprint, keyed, task_ref, owner_callback, webhook_owner } = input;
    let kind = submit.kind();
    let now = deps.clock.now();
    let task = Task { owner_callback, webhook_owner, ..Task::new(task_ref.clone(), kind, now) };
    let span = tracing::info_span!("submit", task_ref = %task_ref, kind = %kind, idempotent = keyed);
    async move {
        // The account-wide breaker: while CaptchaAI bans us, sending more only extends the ban.
        match deps.store.breaker().await {
            Ok(b) => {
                if let Some(until) = b.open_for_submits_at(now) {
                    metrics::counter!("submits", "outcome" => "breaker_open").increment(1);
                    return Submitted::BreakerOpen { until, reason: b.reason.unwrap_or_default() };
                }
            }
            Err(e) => return Submitted::Store(e),
        }
        // Paced account-wide, so a burst of submits never earns MAX_USER_TURN. A burst over the
        // pace waits for the next seconds' slots (a client — an SDK above all — would only be
        // told to come back), and is refused only after PACE_WAIT of waiting.
        let mut waited = 0;
        loop {
            match deps.store.take_submit_slot(deps.clock.now(), deps.submits_per_second).await {
                Ok(true) => break,
                // (On a simulated clock the caller's own retry is the wait: real sleeps would
                // not move it.)
                Ok(false) if waited < PACE_WAIT_SECONDS && !deps.clock.is_simulated() => {
                    waited += 1;
                    let into_second = deps.clock.now().as_millis() % 1000;
                    // To just past the next second, spread a little so waiters do not all arrive
                    // at once.
                    let spread = u64::from(task_ref.shard(16)) * 3;
                    tokio::time::sleep(Duration::from_millis(1000 - into_second + spread)).await;
                }
                Ok(false) => {
                    metrics::counter!("submits", "outcome" => "rate_limited").increment(1);
                    return Submitted::RateLimited;
                }
                Err(e) => return Submitted::Store(e),
            }
        }
        // Recorded before in.php hears of it. If in.php's answer is never stored, the poller
        // expires the task at this deadline.
        let grace = deps.callback_grace.for_kind(kind);
        let deadline = now.plus(grace + kind.max_solve_time());
        match deps.store.create(&task, deadline, keyed.then_some(fingerprint.as_str())).await {
            Ok(Created::New) => {}
            Ok(Created::Existing { task, fingerprint: stored }) => {
                metrics::counter!("submits", "outcome" => "replayed").increment(1);
                tracing::info!(event = "submit_replayed", state = task.state.name(), "idempotency key seen before");
                let task = if stored.as_deref() == Some(fingerprint.as_str()) {
                    match pin(task, deps).await {
                        Ok(t) => t,
                        Err(Pin::Store(e)) => return Submitted::Store(e),
                        Err(Pin::Changing) => return Submitted::ResultChanging,
                    }
                } else {
                    task
                };
                return Submitted::Replayed { task, stored, fingerprint };
            }
            Err(e) => return Submitted::Store(e),
        }
        let Some(base) = callback_base(req, deps) else {
            tracing::error!(event = "config_error", "no CALLBACK_BASE_URL and no API domain in the request");
            return Submitted::Misconfigured;
        };
        let pingback = deps.signer.callback_url(&base, &task_ref);
        let mut attempt = 1;
        loop {
            let err = match deps.captchaai.submit(&submit, &pingback).await {
                Ok(id) => return Submitted::Accepted(accepted(deps, &task, &id, grace, attempt).await),
                Err(e) => e,
            };
            if err.outcome_unknown() {
                return Submitted::Accepted(outcome_unknown(deps, &task, &err).await);
            }
            if let CaptchaAiError::Code(code) = &err
                && let Some(b) = ban(code.as_ref())
            {
                // A ban is never retried in the request: that would extend it.
                let at = deps.clock.now();
                let until = at.plus(b.duration);
                let stop = relay_shared::store::Stop::Ban { needs_operator: b.needs_operator };
                if let Err(e) = deps.store.open_breaker(until, code.as_ref(), stop, at).await {
                    tracing::error!(event = "breaker_store_failed", error = %e);
                }
                metrics::counter!("breaker_opened", "reason" => if b.needs_operator { "key_rejected" } else { "ban" })
                    .increment(1);
                tracing::warn!(event = "breaker_opened", code = %code, until = %until, "in.php answered a ban; CaptchaAI traffic stopped");
                refused(deps, &task_ref, &err, keyed).await;
                return Submitted::Banned { code: code.as_ref().to_owned(), until, duration: b.duration };
            }
            let retry = matches!(err, CaptchaAiError::Connect(_))
                || matches!(err.class(), CodeClass::Transient | CodeClass::Unknown | CodeClass::NotReady);
            if retry && attempt < deps.submit_attempts {
                let delay = backoff_delay(attempt, deps.submit_backoff, Duration::from_secs(4));
                tracing::warn!(event = "submit_retry", error = %err, attempt, delay_ms = delay.as_millis() as u64, "in.php refused for now");
                tokio::time::sleep(delay).await;
                attempt += 1;
                continue;
            }
            // An explicit refusal (or a connection that never opened): nothing was accepted.
            refused(deps, &task_ref, &err, keyed).await;
            let code = err.code();
            return if matches!(err.class(), CodeClass::Permanent | CodeClass::TerminalForTask) {
                metrics::counter!("submits", "outcome" => "refused").increment(1);
                Submitted::Refused { code, class: err.class(), message: format!("in.php refused the task: {err}"), task_ref }
            } else {
                metrics::counter!("submits", "outcome" => "transient").increment(1);
                Submitted::Transient {
                    code,
                    message: format!("in.php refused the task {attempt} times ({err}); nothing was accepted, trying again is safe"),
                    task_ref,
                }
            };
        }
    }
    .instrument(span)
    .await
}

/// Stores an explicit refusal on the task (it failed at submit, nothing was accepted). A refusal
/// that a later try may overcome (a ban, no free slot) under an idempotency key frees the key
/// instead — the task is forgotten, nothing having been accepted — so the same request with the
/// same key can be sent again, as its 503 says.
async fn refused(deps: &Deps, task_ref: &TaskRef, err: &CaptchaAiError, keyed: bool) {
    let final_refusal = matches!(err.class(), CodeClass::Permanent | CodeClass::TerminalForTask)
        && !matches!(err, CaptchaAiError::Code(c) if ban(c.as_ref()).is_some());
    if keyed && !final_refusal {
        match deps.store.forget_unsent(task_ref).await {
            Ok(_) => return,
            Err(e) => tracing::error!(event = "store_failed", error = %e, "could not free the idempotency key"),
        }
    }
    let detail = format!("in.php refused the task: {err}");
    if let Err(e) = deps.store.mark_submit_failed(task_ref, &err.code(), &detail, deps.clock.now()).await {
        // It stays `submitting` and expires at its deadline: still true, never wrong.
        tracing::error!(event = "store_failed", error = %e, "could not mark the refused submit");
    }
}

/// In.php accepted the task under `id`: store the id (retrying), or keep it on the dead-letter
/// queue. Either way the owner hears 202: CaptchaAI has the task and its pingback finds it.
async fn accepted(deps: &Deps, task: &Task, id: &CaptchaId, grace: Duration, attempts: u32) -> Task {
    let at = deps.clock.now();
    let due = at.plus(grace);
    metrics::counter!("submits", "outcome" => "accepted").increment(1);
    let mut last_err = None;
    for attempt in 1..=3u32 {
        match deps.store.mark_submitted(&task.task_ref, id, at, due).await {
            Ok(SubmitRecorded::Pending(t) | SubmitRecorded::AlreadyResolved(t)) => {
                tracing::info!(event = "task_submitted", captcha_id = %id, attempts, "in.php accepted the task");
                return t;
            }
            Err(e) => {
                tracing::warn!(event = "store_failed", error = %e, attempt, "storing in.php's id failed");
                last_err = Some(e);
                if attempt < 3 {
                    tokio::time::sleep(backoff_delay(attempt, Duration::from_millis(100), Duration::from_secs(1)))
                        .await;
                }
            }
        }
    }
    let err = last_err.map(|e| e.to_string()).unwrap_or_default();
    let letter = DeadLetter::submitted(&task.task_ref, id, at, due, &err);
    match deps.dead_letters.send(&letter).await {
        Ok(()) => {
            tracing::warn!(event = "submitted_dead_lettered", captcha_id = %id, "in.php's id kept as a dead letter");
            metrics::counter!("dead_lettered", "kind" => "submitted").increment(1);
        }
        Err(q) => {
            // The last resort: the id is in this log line, the task's pingback still finds it
            // by reference, and it expires at its deadline if none comes.
            tracing::error!(event = "submitted_not_stored", captcha_id = %id, store_error = %err, queue_error = %q, "in.php's id could not be stored or queued");
        }
    }
    task.clone()
}

/// In.php's answer does not say whether it took the task: keep it `submitting`, marked so.
async fn outcome_unknown(deps: &Deps, task: &Task, err: &CaptchaAiError) -> Task {
    let detail = format!(
        "in.php's answer was lost ({err}): CaptchaAI may have the task. Its pingback will record it; if none comes it \
         expires at its deadline. The relay does not submit it again; a client retry with the same Idempotency-Key is \
         safe, a retry without one may pay twice"
    );
    tracing::warn!(event = "submit_unknown", error = %err, "in.php outcome unknown; not retried, not failed");
    metrics::counter!("submits", "outcome" => "unknown").increment(1);
    if let Err(e) = deps.store.mark_submit_unknown(&task.task_ref, &detail).await {
        tracing::error!(event = "store_failed", error = %e, "could not mark the submit unknown");
    }
    Task { state: TaskState::Submitting { unknown: Some(detail) }, ..task.clone() }
}

/// The configured callback base, or this API's own URL as API Gateway reports it.
fn callback_base(req: &Request, deps: &Deps) -> Option<String> {
    use lambda_http::RequestExt;
    use lambda_http::request::RequestContext;
    if let Some(b) = &deps.callback_base_url {
        return Some(b.clone());
    }
    match req.request_context_ref() {
        Some(RequestContext::ApiGatewayV2(ctx)) => {
            let domain = ctx.domain_name.as_deref()?;
            match ctx.stage.as_deref() {
                None | Some("$default") => Some(format!("https://{domain}")),
                Some(stage) => Some(format!("https://{domain}/{stage}")),
            }
        }
        _ => None,
    }
}

async fn get_task(raw: &str, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let task_ref = TaskRef::parse(raw).map_err(|e| problem(404, "unknown_task", format!("no such task: {e}")))?;
    match deps.store.get(&task_ref).await {
        Ok(Some(task)) => Ok(json(200, &pinned(task, deps).await?.view(deps.clock.now()))),
        Ok(None) => Err(problem(404, "unknown_task", "no such task")),
        Err(e) => Err(store_unavailable(&e)),
    }
}

/// Why a result could not be pinned.
pub(crate) enum Pin {
    Store(relay_shared::store::StoreError),
    /// It kept changing (a result received earlier replacing it): the task as last read.
    Changing,
}

/// The task to show its owner, its result pinned first if showing it hands one out: a result,
/// once shown, never changes (before, one received earlier may still replace it). If the item
/// changed since it was read, what it holds now is shown (and pinned) instead.
pub(crate) async fn pin(mut task: Task, deps: &Deps) -> Result<Task, Pin> {
    // Each refusal means the item changed: a strictly earlier-received result, an earlier
    // receipt, or another read's pin. A few rounds settle it in practice.
    for _ in 0..5 {
        let now = deps.clock.now();
        if !task.needs_pin(now) {
            return Ok(task);
        }
        match deps.store.mark_handed_out(&task, now).await {
            Ok(None) => return Ok(Task { handed_out_at: Some(now), ..task }),
            Ok(Some(current)) => task = current,
            Err(e) => return Err(Pin::Store(e)),
        }
    }
    Err(Pin::Changing)
}

async fn pinned(task: Task, deps: &Deps) -> Result<Task, Response<Body>> {
    pin(task, deps).await.map_err(|e| match e {
        Pin::Store(e) => store_unavailable(&e),
        Pin::Changing => result_changing(),
    })
}

fn result_changing() -> Response<Body> {
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
    use fake_captchaai::{FakeCaptchaAi, FakeConfig};
    use relay_shared::domain::TaskState;
    use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo};
    use relay_shared::time::{ManualClock, Timestamp};
    use secrecy::SecretString;

    mod compat_front;

    const KEY: &str = "owner-api-key";
    const COMPAT_KEY: &str = "0123456789abcdef0123456789abcdef";

    struct World {
        _db: LocalDynamo,
        fake: FakeCaptchaAi,
        clock: ManualClock,
        deps: Deps,
    }

    async fn world(cfg: FakeConfig) -> anyhow::Result<World> {
        let db = LocalDynamo::start().await?;
        // Pingbacks go to a closed port here: these tests look at the API alone.
        let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 60_000, ..cfg }).await?;
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let deps = Deps {
            store: db.fresh_store().await?,
            captchaai: CaptchaAiClient::new(
                &fake.base_url(),
                SecretString::from(fake.api_key()),
                Duration::from_millis(500),
                None,
            )?,
            signer: CallbackSigner::new(SecretString::from("sign".to_owned())),
            auth: Authorizer::api_key(&SecretString::from(KEY.to_owned())),
            clock: Arc::new(clock.clone()),
            callback_base_url: Some("http://127.0.0.1:9".into()),
            callback_grace: relay_shared::config::CallbackGrace::uniform(Duration::from_secs(120))
                .with(relay_shared::domain::CaptchaKind::Image, Duration::from_secs(30)),
            submit_attempts: 3,
            submit_backoff: Duration::from_millis(5),
            dead_letters: Arc::new(relay_shared::testkit::MemorySink::default()),
            submits_per_second: SUBMITS_PER_SECOND,
            relay_keys: relay_shared::store::RelayKeys::new(None)
                .with_fixed("test", &SecretString::from(COMPAT_KEY.to_owned())),
            compat: compat::CompatState::default(),
            delivery_policy: UrlPolicy::AllowLoopback,
        };
        Ok(World { _db: db, fake, clock, deps })
    }

    const TURNSTILE: &str = r#"{"kind":"turnstile","sitekey":"0x4AAA","pageurl":"https://shop.example/login"}"#;

    fn post(body: &str) -> ApiGatewayEvent {
        ApiGatewayEvent::new("POST", "/tasks")
            .header("authorization", &format!("Bearer {KEY}"))
            .header("content-type", "application/json")
            .body(body)
    }

    fn body(r: &Response<Body>) -> serde_json::Value {
        serde_json::from_slice(r.body().as_ref()).unwrap_or_default()
    }

    impl World {
        async fn call(&self, ev: ApiGatewayEvent) -> Response<Body> {
            respond(ev.build(), &self.deps).await
        }

        async fn state_of(&self, resp: &Response<Body>) -> TaskState {
            let r = TaskRef::parse(body(resp)["task_ref"].as_str().unwrap_or_default()).expect("task_ref in answer");
            self.deps.store.get(&r).await.expect("get").expect("stored").state
        }
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_submit_is_recorded_sent_with_a_signed_pingback_and_answered_202() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 202, "{}", body(&resp));
        let b = body(&resp);
        assert_eq!(b["status"], "pending");
        let task_ref = TaskRef::parse(b["task_ref"].as_str().unwrap_or_default())?;
        let id = b["captcha_id"].as_str().unwrap_or_default().to_owned();
        assert!(matches!(w.state_of(&resp).await, TaskState::Pending { .. }));
        let sent = w.fake.task(&id).expect("the fake got the task");
        assert_eq!(sent.method, "turnstile");
        assert_eq!(sent.pingback, Some(w.deps.signer.callback_url("http://127.0.0.1:9", &task_ref)));

        let got = w
            .call(
                ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}"))
                    .header("authorization", &format!("Bearer {KEY}")),
            )
            .await;
        assert_eq!(got.status(), 200);
        assert_eq!(body(&got)["status"], "pending");
        assert!(body(&got).get("solution").is_none());
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn without_a_configured_base_the_pingback_uses_the_apis_own_domain() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let deps = Deps { callback_base_url: None, ..w.deps.clone() };
        let resp = respond(post(TURNSTILE).build(), &deps).await;
        assert_eq!(resp.status(), 202);
        let b = body(&resp);
        let task_ref = TaskRef::parse(b["task_ref"].as_str().unwrap_or_default())?;
        let sent = w.fake.task(b["captcha_id"].as_str().unwrap_or_default()).expect("sent");
        let want = deps.signer.callback_url("https://abc123.execute-api.eu-west-1.amazonaws.com", &task_ref);
        assert_eq!(sent.pingback, Some(want));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn the_first_poll_waits_the_grace_of_the_tasks_kind() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let image = body(&w.call(post(r#"{"kind":"image","body":"iVBORw0KGgo="}"#)).await)["task_ref"].clone();
        let turnstile = body(&w.call(post(TURNSTILE)).await)["task_ref"].clone();
        let due_at = |secs: u64| {
            let (store, at) = (w.deps.store.clone(), w.clock.now().plus(Duration::from_secs(secs)));
            async move {
                let mut refs = Vec::new();
                for shard in 0..relay_shared::store::POLL_SHARDS {
                    let page = store.due_page(shard, at, 100, None).await.expect("query");
                    refs.extend(page.tasks.into_iter().map(|d| serde_json::json!(d.task.task_ref.to_string())));
                }
                refs
            }
        };
        assert!(due_at(29).await.is_empty());
        assert_eq!(due_at(30).await, vec![image.clone()], "image grace is 30 s here");
        let both = due_at(120).await;
        assert!(both.contains(&image) && both.contains(&turnstile), "{both:?}");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn every_kind_is_submitted_with_its_method() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let cases = [
            (
                r#"{"kind":"recaptcha_v2","sitekey":"6Le","pageurl":"https://a.example","invisible":true}"#,
                "userrecaptcha",
            ),
            (
                r#"{"kind":"recaptcha_v3","sitekey":"6Le","pageurl":"https://a.example","action":"login","min_score":0.7}"#,
                "userrecaptcha",
            ),
            (r#"{"kind":"recaptcha_enterprise","sitekey":"6Le","pageurl":"https://a.example"}"#, "userrecaptcha"),
            (r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"https://a.example"}"#, "hcaptcha"),
            (TURNSTILE, "turnstile"),
            (
                r#"{"kind":"image","body":"iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="}"#,
                "base64",
            ),
        ];
        for (json, method) in cases {
            let resp = w.call(post(json)).await;
            assert_eq!(resp.status(), 202, "{json}: {}", body(&resp));
            let id = body(&resp)["captcha_id"].as_str().unwrap_or_default().to_owned();
            assert_eq!(w.fake.task(&id).map(|t| t.method), Some(method.to_owned()), "{json}");
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn callers_without_valid_credentials_are_refused() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let bare = ApiGatewayEvent::new("POST", "/tasks").header("content-type", "application/json").body(TURNSTILE);
        assert_eq!(w.call(bare).await.status(), 401);
        let wrong = ApiGatewayEvent::new("POST", "/tasks")
            .header("authorization", "Bearer guess")
            .header("content-type", "application/json")
            .body(TURNSTILE);
        assert_eq!(w.call(wrong).await.status(), 403);
        let get = ApiGatewayEvent::new("GET", &format!("/tasks/{}", TaskRef::generate()));
        assert_eq!(w.call(get).await.status(), 401);
        assert_eq!(w.fake.counts().in_php, 0, "nothing reached CaptchaAI");

        let iam = Deps { auth: Authorizer::Iam, ..w.deps.clone() };
        let unsigned =
            ApiGatewayEvent::new("POST", "/tasks").header("content-type", "application/json").body(TURNSTILE);
        assert_eq!(respond(unsigned.build(), &iam).await.status(), 403);
        let signed = ApiGatewayEvent::new("POST", "/tasks")
            .header("content-type", "application/json")
            .body(TURNSTILE)
            .iam_caller();
        assert_eq!(respond(signed.build(), &iam).await.status(), 202);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_permanent_in_php_error_is_a_422_naming_the_code_and_the_task_is_failed() -> anyhow::Result<()> {
        let w = world(FakeConfig { submit_errors: vec!["ERROR_PAGEURL".into()], ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 422);
        assert_eq!(body(&resp)["error"]["code"], "ERROR_PAGEURL");
        assert!(matches!(w.state_of(&resp).await, TaskState::Failed { code, .. } if code.as_ref() == "ERROR_PAGEURL"));
        assert_eq!(w.fake.counts().in_php, 1, "permanent errors are not retried");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn transient_errors_are_retried_then_answered_503_with_retry_after() -> anyhow::Result<()> {
        let w = world(FakeConfig { submit_errors: vec!["ERROR_NO_SLOT_AVAILABLE".into()], ..FakeConfig::default() })
            .await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 202, "one transient error, then success");
        assert_eq!(w.fake.counts().in_php, 2);

        w.fake.configure(|c| c.submit_errors = vec!["ERROR_NO_SLOT_AVAILABLE".into(); 3]);
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(body(&resp)["error"]["retry_safe"], true, "nothing was accepted: {}", body(&resp));
        assert_eq!(w.fake.counts().in_php, 5, "three tries of an explicit 'no slot'");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_ban_is_not_retried_it_opens_the_breaker_for_its_duration() -> anyhow::Result<()> {
        let w = world(FakeConfig { submit_errors: vec!["MAX_USER_TURN".into()], ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("10"), "the ban's length");
        assert_eq!(
            (body(&resp)["error"]["code"].as_str(), body(&resp)["error"]["retry_safe"].as_bool()),
            (Some("MAX_USER_TURN"), Some(true))
        );
        assert_eq!(w.fake.counts().in_php, 1, "a ban is never retried in the request");
        let b = w.deps.store.breaker().await?;
        assert_eq!(b.open_at(w.clock.now()), Some(w.clock.now().plus(Duration::from_secs(10))));
        // While it is open, nothing reaches CaptchaAI.
        let blocked = w.call(post(TURNSTILE)).await;
        assert_eq!(blocked.status(), 503);
        assert_eq!(body(&blocked)["error"]["code"], "captchaai_unavailable");
        assert_eq!(w.fake.counts().in_php, 1);
        w.clock.advance(Duration::from_secs(10));
        assert_eq!(w.call(post(TURNSTILE)).await.status(), 202, "after the ban");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_submit_that_times_out_stays_submitting_unknown_and_is_not_retried() -> anyhow::Result<()> {
        let w = world(FakeConfig { in_php_delay_ms: 2_000, ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 202, "accepted for processing: it may be solved");
        let b = body(&resp);
        assert_eq!((b["status"].as_str(), b["submit_outcome"].as_str()), (Some("submitting"), Some("unknown")), "{b}");
        assert!(b["error_detail"].as_str().unwrap_or_default().contains("Idempotency-Key"), "{b}");
        assert!(
            matches!(w.state_of(&resp).await, TaskState::Submitting { unknown: Some(_) }),
            "we do not know it failed, so we do not say so"
        );
        assert_eq!(w.fake.counts().in_php, 1);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn bad_requests_get_clear_4xx_and_reach_nobody() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let auth = format!("Bearer {KEY}");
        let cases = [
            (post("{not json"), 400, "invalid_request"),
            (post(r#"{"kind":"funcaptcha","sitekey":"s"}"#), 400, "invalid_request"),
            (post(r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"ftp://x"}"#), 400, "pageurl"),
            (post(&format!(r#"{{"kind":"image","body":"{}"}}"#, "A".repeat(MAX_BODY))), 413, "body_too_large"),
            (
                ApiGatewayEvent::new("POST", "/tasks")
                    .header("authorization", &auth)
                    .header("content-type", "text/plain")
                    .body(TURNSTILE),
                415,
                "unsupported",
            ),
            (ApiGatewayEvent::new("DELETE", "/tasks").header("authorization", &auth), 405, "method_not_allowed"),
            (ApiGatewayEvent::new("GET", "/tasks/tsk_nope").header("authorization", &auth), 404, "unknown_task"),
            (
                ApiGatewayEvent::new("GET", &format!("/tasks/{}", TaskRef::generate())).header("authorization", &auth),
                404,
                "unknown_task",
            ),
            (ApiGatewayEvent::new("GET", "/nowhere"), 404, "no_route"),
        ];
        for (ev, status, needle) in cases {
            let resp = w.call(ev).await;
            assert_eq!(resp.status().as_u16(), status, "{needle}: {}", body(&resp));
            assert!(body(&resp).to_string().contains(needle), "{needle}: {}", body(&resp));
        }
        assert_eq!(w.fake.counts().in_php, 0);
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_solution_is_handed_out_while_fresh_and_reported_expired_after() -> anyhow::Result<()> {
        let w = world(FakeConfig::default()).await?;
        let resp = w.call(post(TURNSTILE)).await;
        let b = body(&resp);
        let task_ref = TaskRef::parse(b["task_ref"].as_str().unwrap_or_default())?;
        let id = relay_shared::domain::CaptchaId::parse(b["captcha_id"].as_str().unwrap_or_default())?;
        let now = w.clock.now();
        let d = relay_shared::domain::Delivery {
            captcha_id: id,
            outcome: relay_shared::domain::Outcome::Solved(relay_shared::domain::Solution::parse("tok-fresh")?),
            received_at: now,
            via: relay_shared::domain::Via::Callback,
            token_clock_start: now,
        };
        w.deps.store.record_result(&task_ref, &d).await?;
        let get = || {
            ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}")).header("authorization", &format!("Bearer {KEY}"))
        };
        let fresh = body(&w.call(get()).await);
        assert_eq!((fresh["status"].as_str(), fresh["solution"].as_str()), (Some("solved"), Some("tok-fresh")));
        assert_eq!(fresh["resolved_via"], "callback");
        assert_eq!(fresh["expires_at"], now.plus(Duration::from_secs(300)).to_rfc3339());
        w.clock.advance(Duration::from_secs(300));
        let stale = body(&w.call(get()).await);
        assert_eq!(stale["status"], "expired");
        assert!(stale.get("solution").is_none(), "a stale token is never handed out: {stale}");
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_result_once_shown_is_pinned_and_an_earlier_received_one_replaces_it_only_before() -> anyhow::Result<()> {
        use relay_shared::domain::{CaptchaId, Delivery, Outcome, Solution, Via};
        use relay_shared::store::RecordOutcome;
        let w = world(FakeConfig::default()).await?;
        let b = body(&w.call(post(TURNSTILE)).await);
        let task_ref = TaskRef::parse(b["task_ref"].as_str().unwrap_or_default())?;
        let id = CaptchaId::parse(b["captcha_id"].as_str().unwrap_or_default())?;
        let now = w.clock.now();
        let deliver = |token: &str, back_ms: u64| -> anyhow::Result<Delivery> {
            let at = Timestamp::from_millis(now.as_millis() - back_ms);
            Ok(Delivery {
                captcha_id: id.clone(),
                outcome: Outcome::Solved(Solution::parse(token)?),
                received_at: at,
                via: Via::Redrive,
                token_clock_start: at,
            })
        };
        let get = || {
            ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}")).header("authorization", &format!("Bearer {KEY}"))
        };
        // Stored first: B, received now. Not shown yet, so A, received 2 s earlier, replaces it.
        w.deps.store.record_result(&task_ref, &deliver("tok-b", 0)?).await?;
        let replaced = w.deps.store.record_result(&task_ref, &deliver("tok-a", 2_000)?).await?;
        assert!(matches!(replaced, RecordOutcome::Replaced(_)), "{replaced:?}");
        let shown = body(&w.call(get()).await);
        assert_eq!(shown["solution"], "tok-a");
        // Shown, hence pinned: a result received even earlier no longer replaces it.
        let late = w.deps.store.record_result(&task_ref, &deliver("tok-c", 4_000)?).await?;
        assert!(matches!(late, RecordOutcome::Conflict(_)), "{late:?}");
        w.clock.advance(Duration::from_secs(1));
        assert_eq!(body(&w.call(get()).await)["solution"], "tok-a", "the owner always sees the same token");
        assert_eq!(
            w.deps.store.get(&task_ref).await?.and_then(|t| t.handed_out_at),
            Some(now),
            "pinned once, by the first read that showed it"
        );
        Ok(())
    }
}

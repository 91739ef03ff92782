//! The owner's API: `POST /tasks` submits a captcha, `GET /tasks/{ref}` reads it back.
//!
//! Every valid task is accepted (202): sent to in.php at once while CaptchaAI has a free thread
//! for it, queued otherwise and released by the submitter as threads free (see
//! [`relay_shared::submit`]). Every in.php call CaptchaAI accepts is money spent, so a submit:
//! - is idempotent with an `Idempotency-Key` header: the key (with the caller) names the task's
//!   reference, and creating the task is one conditional put — the same key and body return the
//!   same task without a second in.php call, a different body is a 422;
//! - goes inline only with a *permit* (one conditional write on the account's state item: the
//!   breaker lets submits through, nobody is queued, and the submitter's window has room) and a
//!   slot of the account-wide in.php pace; otherwise it is queued, within the queue's bounds;
//! - records the task before in.php hears of it (so a pingback that outruns the answer finds it);
//! - sends it once: an explicit refusal for now (no free thread, a ban, a server error code)
//!   puts it in the queue instead of a retry here; any answer that does not prove a refusal — a
//!   timeout, a cut connection, a 5xx, an HTML page — leaves the task `submitting` with
//!   "outcome unknown", never called failed (its pingback will say) and sent again at most once,
//!   by the poller, when its result is overdue (on CaptchaAI only, which bills threads);
//! - never loses CaptchaAI's id: storing it is retried, and if that keeps failing it goes to
//!   the dead-letter queue for the redrive function to store.

pub mod compat;

use std::sync::Arc;

use std::time::Duration;
use tracing::Instrument;

use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError, SubmitRequest};
use relay_shared::codes::{CodeClass, ban};
use relay_shared::deadletter::{DeadLetterSink, SqsQueue};
use relay_shared::domain::{Task, TaskRef, TaskState, Via};
use relay_shared::http::{Authorizer, json, path_segments, problem, with_header};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{Created, Permit, Reserved, SubmitState, TaskStore};
use relay_shared::submit::{InPhp, QueueSettings, Recorder, Waker, lanes::lane_id};
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
    /// Where in.php's id goes when it cannot be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
    /// The submit queue's bounds and the in.php pace.
    pub queue: QueueSettings,
    /// Tells the submitter that tasks wait in the queue.
    pub waker: Arc<dyn Waker>,
    /// The keys the 2captcha-compatible routes (`/in.php`, `/res.php`) take.
    pub relay_keys: relay_shared::store::RelayKeys,
    /// Per-instance state of those routes (balance cache, per-key read limits).
    pub compat: compat::CompatState,
    /// What this instance last saw of the submit queue (skips permits it would be refused).
    pub admission: relay_shared::submit::AdmissionHint,
    /// Which owner callback URLs (`callback_url`, `pingback`) a task may carry
    /// (`DELIVERY_URL_POLICY`; on AWS public https only).
    pub delivery_policy: UrlPolicy,
}

pub use relay_shared::submit::SUBMITS_PER_SECOND;

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
            waker: Arc::new(relay_shared::submit::StoreWaker(store.clone())),
            compat: compat::CompatState::default(),
            admission: Default::default(),
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
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
            queue: QueueSettings::from_settings(&env)?,
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

/// The store failed (throttled, most likely, when it fails for many at once): "try again", in 5
/// to 15 s. Spread, so the clients refused during a throttled minute do not all return in the
/// same second after it and throttle it again (docs/capacity.md).
fn store_unavailable(e: &relay_shared::store::StoreError) -> Response<Body> {
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
    if !deps.queue.upstream.solves(submit.kind()) {
        return Err(problem(422, "unsupported_kind", deps.queue.upstream.refusal(submit.kind())));
    }
    let idem = idempotency_key(req)?;
    let owner = deps.auth.owner(req);
    let task_ref = match &idem {
        Some(key) => deps.signer.idempotent_ref(&owner, key),
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
    /// How a compat task's result goes to its `pingback` (its relay key's setting).
    pub pingback_form: relay_shared::domain::PingbackForm,
    /// Who submits (the IAM caller, the relay key's name): whose queue lane it waits in.
    pub owner: String,
}

/// How a submit ended, for either front to answer in its own form.
pub(crate) enum Submitted {
    /// CaptchaAI has it (or may have it: an unknown outcome); the task as it now stands.
    Accepted(Task),
    /// In the submit queue: released to CaptchaAI as a thread frees.
    Queued(Task),
    /// The idempotency key was used before: that task, and the fingerprint it came with.
    Replayed { task: Task, stored: Option<String>, fingerprint: String },
    /// The breaker is open for a key or account problem an operator must fix: nothing recorded.
    BreakerOpen { until: Timestamp, reason: String },
    /// The submit queue is at its bound (`owner`: its owner's lane): nothing recorded.
    QueueFull { owner: bool, depth: u64, bound: u64 },
    /// The store failed before anything was sent.
    Store(relay_shared::store::StoreError),
    /// The relay does not know its callback URL.
    Misconfigured,
    /// A replayed task's result is being replaced by one received earlier: read again.
    ResultChanging,
    /// In.php rejected the account's key: the breaker is open, nothing was accepted.
    Banned { code: String, until: Timestamp, duration: Duration },
    /// An explicit, final refusal: the task is failed with the code.
    Refused { code: String, class: CodeClass, message: String, task_ref: TaskRef },
}

/// The submit itself: a permit (or the queue), the pace, one conditional put, in.php once, then
/// the id stored or dead-lettered, or the task queued after an explicit refusal for now.
pub(crate) async fn submit_task(req: &Request, deps: &Deps, input: SubmitInput) -> Submitted {
    let SubmitInput { submit, fingerprint, keyed, task_ref, owner_callback, webhook_owner, pingback_form, owner } =
        input;
    let kind = submit.kind();
    let now = deps.clock.now();
    let lane = lane_id(&owner, kind);
    let span = tracing::info_span!("submit", task_ref = %task_ref, kind = %kind, idempotent = keyed);
    async move {
        let Some(base) = callback_base(req, deps) else {
            tracing::error!(event = "config_error", "no CALLBACK_BASE_URL and no API domain in the request");
            return Submitted::Misconfigured;
        };
        let pingback = deps.signer.callback_url(&base, &task_ref);
        let fp = keyed.then_some(fingerprint.as_str());
        let initial = deps.queue.window.threads.unwrap_or(deps.queue.window.initial);
        // One write: a permit to send it now, or the state that says why not — unless others
        // were just seen waiting, when the permit would be refused (queued at once).
        let no_permit = if deps.admission.queue_waiting(now) {
            Some(None)
        } else {
            match deps.store.take_permit(now, initial).await {
                Ok(Permit::Taken) => None,
                Ok(Permit::Refused(state)) => {
                    deps.admission.saw(&state, now);
                    Some(Some(*state))
                }
                Err(e) => return Submitted::Store(e),
            }
        };
        if let Some(state) = no_permit {
            if let Some(open) = state.as_ref().and_then(|st| key_rejected(st, now)) {
                return open;
            }
            let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::queued(task_ref, kind, now, lane) };
            return enqueue(deps, task, &submit, &pingback, fp, &fingerprint, state).await;
        }
        // Paced account-wide, so a burst of submits never earns MAX_USER_TURN; over the pace,
        // the task waits in the queue instead.
        match deps.store.take_submit_slot(now, deps.queue.submits_per_second).await {
            Ok(true) => {}
            Ok(false) => {
                give_back_permit(deps).await;
                let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::queued(task_ref, kind, now, lane) };
                return enqueue(deps, task, &submit, &pingback, fp, &fingerprint, None).await;
            }
            Err(e) => {
                give_back_permit(deps).await;
                return Submitted::Store(e);
            }
        }
        let task = Task { owner_callback, webhook_owner, pingback_form, owner: Some(owner.clone()), ..Task::new(task_ref.clone(), kind, now) };
        // Recorded before in.php hears of it, with what a second in.php needs: if in.php's
        // answer is never stored, the poller looks at the task at this deadline (and sends it
        // again, once, or expires it).
        let grace = deps.callback_grace.for_kind(kind);
        let deadline = now.plus(deadline_after(deps, kind));
        match deps.store.create_sendable(&task, deadline, fp, Some((&submit, &pingback))).await {
            Ok(Created::New) => {}
            Ok(Created::Existing { task, fingerprint: stored }) => {
                give_back_permit(deps).await;
                return replayed(deps, task, stored, fingerprint).await;
            }
            Err(e) => {
                give_back_permit(deps).await;
                return Submitted::Store(e);
            }
        }
        let recorder = Recorder { store: &deps.store, dead_letters: deps.dead_letters.as_ref(), clock: deps.clock.as_ref() };
        match InPhp::of(deps.captchaai.submit(&submit, &pingback).await) {
            InPhp::Accepted(id) => Submitted::Accepted(recorder.accepted(&task, &id, grace).await),
            InPhp::Unknown(err) => Submitted::Accepted(recorder.unknown(&task, &err).await),
            InPhp::NoSlot(code) => {
                tracing::info!(event = "submit_no_slot", code = %code, "no free CaptchaAI thread: queued");
                metrics::counter!("submit_no_slot", "path" => "inline").increment(1);
                queue_unsent(deps, task, &submit, &pingback, lane, true, keyed).await
            }
            InPhp::Banned(code, b) => {
                // A ban is never retried here: that would extend it.
                let at = deps.clock.now();
                let until = at.plus(b.duration);
                let stop = relay_shared::store::Stop::Ban { needs_operator: b.needs_operator };
                if let Err(e) = deps.store.open_breaker(until, &code, stop, at).await {
                    tracing::error!(event = "breaker_store_failed", error = %e);
                }
                metrics::counter!("breaker_opened", "reason" => if b.needs_operator { "key_rejected" } else { "ban" })
                    .increment(1);
                tracing::warn!(event = "breaker_opened", code = %code, until = %until, "in.php answered a ban; CaptchaAI traffic stopped");
                if b.needs_operator {
                    let err = CaptchaAiError::Code(relay_shared::codes::ErrorCode::parse(&code).unwrap_or_else(|_| {
                        relay_shared::codes::ErrorCode::parse("ERROR_WRONG_USER_KEY").expect("a valid code")
                    }));
                    refused(deps, &task_ref, &err, keyed).await;
                    return Submitted::Banned { code, until, duration: b.duration };
                }
                // A ban ends by itself: the task waits in the queue for it.
                queue_unsent(deps, task, &submit, &pingback, lane, false, keyed).await
            }
            InPhp::Transient(err) => {
                tracing::warn!(event = "submit_transient", error = %err, "in.php refused for now: queued");
                queue_unsent(deps, task, &submit, &pingback, lane, false, keyed).await
            }
            InPhp::Refused(err) => {
                refused(deps, &task_ref, &err, keyed).await;
                metrics::counter!("submits", "outcome" => "refused").increment(1);
                Submitted::Refused {
                    code: err.code(),
                    class: err.class(),
                    message: format!("in.php refused the task: {err}"),
                    task_ref,
                }
            }
        }
    }
    .instrument(span)
    .await
}

/// A rejected key (the breaker open for an operator): queueing would only hold the work until
/// it times out, so the submit is refused with the reason.
fn key_rejected(state: &SubmitState, now: Timestamp) -> Option<Submitted> {
    let until = state.breaker.open_for_submits_at(now).filter(|_| state.breaker.needs_operator)?;
    metrics::counter!("submits", "outcome" => "breaker_open").increment(1);
    Some(Submitted::BreakerOpen { until, reason: state.breaker.reason.clone().unwrap_or_default() })
}

async fn give_back_permit(deps: &Deps) {
    if let Err(e) = deps.store.give_back_permit().await {
        // The submitter publishes the permits afresh within a second of running.
        tracing::warn!(event = "store_failed", error = %e, "could not give back an unused permit");
    }
}

/// A submit whose key was used before: that task (its result pinned if it shows one).
async fn replayed(deps: &Deps, task: Task, stored: Option<String>, fingerprint: String) -> Submitted {
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
    Submitted::Replayed { task, stored, fingerprint }
}

/// A new task into the submit queue: counted in (within the bounds), then put, then the
/// submitter woken if none is running. `known`: the state item as a refused permit just showed
/// it, when the reservation lands on another count item (`QUEUE_SHARDS`) and so cannot.
async fn enqueue(
    deps: &Deps,
    task: Task,
    submit: &SubmitRequest,
    pingback: &str,
    fp: Option<&str>,
    fingerprint: &str,
    known: Option<SubmitState>,
) -> Submitted {
    let TaskState::Queued { lane, .. } = &task.state else { return Submitted::Misconfigured };
    let lane = lane.clone();
    let now = deps.clock.now();
    let shard = deps.store.queue_shard(&task.task_ref);
    let state =
        match deps.store.reserve_queue(&lane, shard, deps.queue.max_per_owner, deps.queue.max_total, false).await {
            Ok(Reserved::Yes(counted)) => {
                let state = state_item(deps, shard, *counted, known, now);
                if let Some(open) = state.as_ref().and_then(|st| key_rejected(st, now)) {
                    // Seen only now when the permit was skipped on the hint.
                    uncount(deps, &lane, shard).await;
                    return open;
                }
                state
            }
            Ok(Reserved::Full { owner, depth, bound }) => {
                metrics::counter!("submits", "outcome" => "queue_full").increment(1);
                tracing::warn!(event = "queue_full", owner, depth, bound, "submit queue at its bound; refused");
                return Submitted::QueueFull { owner, depth, bound };
            }
            Err(e) => return Submitted::Store(e),
        };
    match deps.store.create_queued(&task, submit, pingback, deadline_after(deps, task.kind), fp).await {
        Ok(Created::New) => {
            metrics::counter!("submits", "outcome" => "queued").increment(1);
            tracing::info!(event = "task_queued", lane = %lane, "queued for a free CaptchaAI thread");
            if !state.is_some_and(|st| st.releaser_live(deps.clock.now())) {
                deps.waker.wake(deps.clock.now()).await;
            }
            Submitted::Queued(task)
        }
        Ok(Created::Existing { task, fingerprint: stored }) => {
            uncount(deps, &lane, shard).await;
            replayed(deps, task, stored, fingerprint.to_owned()).await
        }
        Err(e) => {
            uncount(deps, &lane, shard).await;
            Submitted::Store(e)
        }
    }
}

/// The state item after a reservation: the reservation's own answer when the task counts on it
/// (shard 0), otherwise what this instance last saw of it (`None`: nothing, so the submitter is
/// woken in case).
fn state_item(
    deps: &Deps,
    shard: u8,
    counted: SubmitState,
    known: Option<SubmitState>,
    now: Timestamp,
) -> Option<SubmitState> {
    if shard == 0 { Some(counted) } else { known.or_else(|| deps.admission.known(now)) }
}

/// When, after it is sent, the poller looks at a task whose in.php answer was never stored: its
/// callback's grace and CaptchaAI's longest solve.
/// When the poller first looks at a task whose in.php id was never stored: when it is sent
/// again if its result is overdue by then (CaptchaAI: [`CaptchaKind::resend_after`]), or when
/// it expires (an upstream that bills per solution is never sent a task twice).
///
/// [`CaptchaKind::resend_after`]: relay_shared::domain::CaptchaKind::resend_after
fn deadline_after(deps: &Deps, kind: relay_shared::domain::CaptchaKind) -> Duration {
    if deps.queue.upstream.resend_default() {
        kind.resend_after()
    } else {
        deps.callback_grace.for_kind(kind) + kind.max_solve_time()
    }
}

/// Takes back a reservation that was not used (a count left too high is reconciled by the
/// submitter: never a task unseen).
async fn uncount(deps: &Deps, lane: &str, shard: u8) {
    if let Err(e) = deps.store.count_queued(lane, shard, -1).await {
        tracing::warn!(event = "store_failed", error = %e, "could not take back a queue reservation");
    }
}

/// An inline submit in.php refused for now (no free thread, a ban, a server error code):
/// nothing was accepted, so it goes to the queue (the owner hears 202) — unless the queue is at
/// its bound, when the owner hears that instead, nothing accepted.
async fn queue_unsent(
    deps: &Deps,
    task: Task,
    submit: &SubmitRequest,
    pingback: &str,
    lane: String,
    no_slot: bool,
    keyed: bool,
) -> Submitted {
    let now = deps.clock.now();
    let shard = deps.store.queue_shard(&task.task_ref);
    let state =
        match deps.store.reserve_queue(&lane, shard, deps.queue.max_per_owner, deps.queue.max_total, no_slot).await {
            Ok(Reserved::Yes(counted)) => state_item(deps, shard, *counted, None, now),
            Ok(Reserved::Full { owner, depth, bound }) => {
                let err = CaptchaAiError::Code(
                    relay_shared::codes::ErrorCode::parse("ERROR_NO_SLOT_AVAILABLE").expect("a valid code"),
                );
                refused(deps, &task.task_ref, &err, keyed).await;
                metrics::counter!("submits", "outcome" => "queue_full").increment(1);
                return Submitted::QueueFull { owner, depth, bound };
            }
            Err(e) => {
                // Still `submitting` without an outcome: the poller expires it at its deadline, and
                // nothing was paid. Say the store failed (a retry with the key is safe).
                return Submitted::Store(e);
            }
        };
    match deps.store.queue_unsent(&task, &lane, now, submit, pingback, deadline_after(deps, task.kind)).await {
        Ok(true) => {
            metrics::counter!("submits", "outcome" => "queued").increment(1);
            if !state.is_some_and(|st| st.releaser_live(now)) {
                deps.waker.wake(now).await;
            }
            Submitted::Queued(Task { state: TaskState::Queued { queued_at: now, lane }, ..task })
        }
        Ok(false) => {
            // It left `submitting` meanwhile (its pingback cannot have come: in.php took
            // nothing). Show what it is.
            uncount(deps, &lane, shard).await;
            match deps.store.get(&task.task_ref).await {
                Ok(Some(t)) => Submitted::Accepted(t),
                Ok(None) => Submitted::Store(relay_shared::store::StoreError::Rejected("the task vanished".into())),
                Err(e) => Submitted::Store(e),
            }
        }
        Err(e) => {
            uncount(deps, &lane, shard).await;
            Submitted::Store(e)
        }
    }
}

/// Stores an explicit refusal on the task (it failed at submit, nothing was accepted). A refusal
/// that a later try may overcome (a rejected key an operator fixes, a full queue) under an
/// idempotency key frees the key instead — the task is forgotten, nothing having been accepted —
/// so the same request with the same key can be sent again, as its answer says.
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
    // Past its retention a task is unknown, whether or not the table still holds it.
    match deps.store.get_retained(&task_ref, deps.clock.now()).await {
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
    let ahead = match deps.store.queue_ahead(lane, queued_at, POSITION_CAP).await {
        Ok(n) => n,
        Err(e) => {
            // The task itself was read: show it without a position rather than fail the read.
            tracing::warn!(event = "store_failed", error = %e, "could not count the queue");
            return;
        }
    };
    q.position = Some(ahead + 1);
    if let Ok(state) = deps.store.submit_state().await
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
            dead_letters: Arc::new(relay_shared::testkit::MemorySink::default()),
            // A plan the fake's unlimited threads never fill: submits go inline (the queue's
            // own tests set a small one).
            queue: QueueSettings {
                window: relay_shared::submit::window::WindowSettings { threads: Some(10_000), ..Default::default() },
                ..QueueSettings::default()
            },
            waker: Arc::new(relay_shared::submit::NotifyWaker::default()),
            relay_keys: relay_shared::store::RelayKeys::new(None)
                .with_fixed("test".into(), &SecretString::from(COMPAT_KEY.to_owned())),
            compat: compat::CompatState::default(),
            admission: Default::default(),
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
                for shard in 0..store.shards().read() {
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
            (TURNSTILE, "turnstile"),
            (
                r#"{"kind":"image","body":"iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="}"#,
                "base64",
            ),
        ];
        use relay_shared::domain::CaptchaKind;
        let more = [CaptchaKind::Geetest, CaptchaKind::CloudflareChallenge, CaptchaKind::Bls]
            .map(|k| (relay_shared::testkit::body_for(k), k.as_str()));
        for (json, method) in cases.into_iter().chain(more) {
            let resp = w.call(post(json)).await;
            assert_eq!(resp.status(), 202, "{json}: {}", body(&resp));
            let id = body(&resp)["captcha_id"].as_str().unwrap_or_default().to_owned();
            assert_eq!(w.fake.task(&id).map(|t| t.method), Some(method.to_owned()), "{json}");
        }
        // hCaptcha is 2captcha's: refused before anything is recorded or sent, with why.
        let before = w.fake.counts().in_php;
        let resp = w.call(post(r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"https://a.example"}"#)).await;
        assert_eq!(resp.status(), 422);
        assert_eq!(body(&resp)["error"]["code"], "unsupported_kind");
        assert_eq!(w.fake.counts().in_php, before);
        // Unless the upstream is a 2captcha-compatible service that solves it.
        let mut two = world(FakeConfig { flavor: fake_captchaai::Flavor::Twocaptcha, ..FakeConfig::default() }).await?;
        two.deps.queue.upstream = relay_shared::submit::Upstream::TwoCaptcha;
        let resp = two.call(post(r#"{"kind":"hcaptcha","sitekey":"s","pageurl":"https://a.example"}"#)).await;
        assert_eq!(resp.status(), 202, "{}", body(&resp));
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

    fn get(task_ref: &str) -> ApiGatewayEvent {
        ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}")).header("authorization", &format!("Bearer {KEY}"))
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn an_explicit_no_slot_queues_the_task_and_the_submits_after_it_wait_behind_it() -> anyhow::Result<()> {
        for code in ["ERROR_NO_SLOT_AVAILABLE", "ERROR_ZERO_BALANCE", "ERROR_SERVER_ERROR"] {
            let w = world(FakeConfig { submit_errors: vec![code.into()], ..FakeConfig::default() }).await?;
            let resp = w.call(post(TURNSTILE)).await;
            let first = body(&resp);
            assert_eq!((resp.status().as_u16(), first["status"].as_str()), (202, Some("queued")), "{code}: {first}");
            assert!(first.get("captcha_id").is_none() && first.get("error").is_none(), "{first}");
            assert_eq!(w.fake.counts().in_php, 1, "{code}: one call, not a retry loop");
            assert!(matches!(w.state_of(&resp).await, TaskState::Queued { .. }));
            let st = w.deps.store.submit_state().await?;
            let no_slot = u64::from(code != "ERROR_SERVER_ERROR");
            assert_eq!((st.queued, st.api_no_slots), (1, no_slot), "{code}");
            if no_slot == 1 {
                assert_eq!(st.permits, Some(0), "no more inline submits until the submitter says so");
            }
            // The next submit waits behind it: queued, nothing sent.
            w.clock.advance(Duration::from_secs(1));
            let second = w.call(post(TURNSTILE)).await;
            assert_eq!((second.status().as_u16(), body(&second)["status"].as_str()), (202, Some("queued")));
            assert_eq!(w.fake.counts().in_php, 1, "{code}: the queue is not jumped");
            let shown = body(&w.call(get(body(&second)["task_ref"].as_str().unwrap_or_default())).await);
            assert_eq!(shown["status"], "queued");
            assert_eq!(shown["queue"]["position"], 2, "second in its lane: {shown}");
            assert_eq!(shown["queue"]["queued_at"], w.clock.now().to_rfc3339());
        }
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_ban_is_not_retried_it_opens_the_breaker_and_the_task_waits_in_the_queue() -> anyhow::Result<()> {
        let w = world(FakeConfig { submit_errors: vec!["MAX_USER_TURN".into()], ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!((resp.status().as_u16(), body(&resp)["status"].as_str()), (202, Some("queued")), "{}", body(&resp));
        assert_eq!(w.fake.counts().in_php, 1, "a ban is never retried in the request");
        let b = w.deps.store.breaker().await?;
        assert_eq!(b.open_at(w.clock.now()), Some(w.clock.now().plus(Duration::from_secs(10))));
        // While it is open, nothing reaches CaptchaAI: submits wait in the queue.
        let blocked = w.call(post(TURNSTILE)).await;
        assert_eq!((blocked.status().as_u16(), body(&blocked)["status"].as_str()), (202, Some("queued")));
        assert_eq!(w.fake.counts().in_php, 1);
        assert_eq!(w.deps.store.submit_state().await?.queued, 2);

        // A rejected key is an operator's problem: answered at once, nothing queued.
        let w =
            world(FakeConfig { submit_errors: vec!["ERROR_WRONG_USER_KEY".into()], ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(
            (resp.status().as_u16(), body(&resp)["error"]["code"].as_str()),
            (503, Some("ERROR_WRONG_USER_KEY"))
        );
        let blocked = w.call(post(TURNSTILE)).await;
        assert_eq!(
            (blocked.status().as_u16(), body(&blocked)["error"]["code"].as_str()),
            (503, Some("captchaai_unavailable"))
        );
        assert!(body(&blocked)["error"]["message"].as_str().unwrap_or_default().contains("operator"));
        assert_eq!((w.fake.counts().in_php, w.deps.store.submit_state().await?.queued), (1, 0));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_burst_above_the_plan_is_accepted_and_the_queue_is_bounded_per_owner_and_in_all() -> anyhow::Result<()> {
        let mut w = world(FakeConfig::default()).await?;
        w.deps.queue = QueueSettings {
            max_per_owner: 3,
            max_total: 4,
            window: relay_shared::submit::window::WindowSettings { threads: Some(1), ..Default::default() },
            ..QueueSettings::default()
        };
        // A plan of one thread: the first goes at once, the next wait (nothing sent).
        let sent = w.call(post(TURNSTILE)).await;
        assert_eq!(body(&sent)["status"], "pending");
        for _ in 0..3 {
            let r = w.call(post(TURNSTILE)).await;
            assert_eq!((r.status().as_u16(), body(&r)["status"].as_str()), (202, Some("queued")));
        }
        assert_eq!(w.fake.counts().in_php, 1);
        // This owner's lane is at its bound: a clear, retry-safe refusal, nothing recorded.
        let full = w.call(post(TURNSTILE)).await;
        let b = body(&full);
        assert_eq!((full.status().as_u16(), b["error"]["code"].as_str()), (429, Some("queue_full")), "{b}");
        assert_eq!(
            (b["error"]["reason"].as_str(), b["error"]["retry_safe"].as_bool()),
            (Some("owner_queue_full"), Some(true))
        );
        assert!(b["error"]["message"].as_str().unwrap_or_default().contains("QUEUE_MAX_PER_OWNER"), "{b}");
        assert!(full.headers().contains_key("retry-after"));
        // Another owner (a relay key) still has room, until the queue is full in all.
        let compat = |q: &str| {
            ApiGatewayEvent::new("POST", "/in.php")
                .header("content-type", "application/x-www-form-urlencoded")
                .body(&format!("key={COMPAT_KEY}&method=turnstile&sitekey=s&pageurl=https://a.example/{q}"))
        };
        let ok = w.call(compat("a")).await;
        assert!(String::from_utf8_lossy(ok.body().as_ref()).starts_with("OK|"));
        let refused = w.call(compat("b")).await;
        let text = String::from_utf8_lossy(refused.body().as_ref()).into_owned();
        assert_eq!(
            (refused.status().as_u16(), text.as_str()),
            (200, "ERROR_NO_SLOT_AVAILABLE"),
            "2captcha's 'try later'"
        );
        let st = w.deps.store.submit_state().await?;
        assert_eq!((st.queued, st.lanes.len(), w.fake.counts().in_php), (4, 2, 1));
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

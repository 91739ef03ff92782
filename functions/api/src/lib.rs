//! The owner's API: `POST /tasks` submits a captcha, `GET /tasks/{ref}` reads it back.
//!
//! A submit records the task first (so a callback that outruns in.php's answer finds it),
//! calls in.php with the task's signed pingback URL, then stores CaptchaAI's id. The stored
//! record never claims more than is known: a refused submit is `failed` with the code, a submit
//! whose outcome is unknown (timeout) stays `submitting` until a callback or the deadline.

use std::sync::Arc;
use std::time::Duration;

use lambda_http::{Body, Request, Response};
use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError, SubmitRequest};
use relay_shared::codes::{CodeClass, retry_after_secs};
use relay_shared::domain::{Task, TaskRef};
use relay_shared::http::{Authorizer, json, path_segments, problem, with_header};
use relay_shared::retry::backoff_delay;
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{SubmitRecorded, TaskStore};
use relay_shared::time::Clock;

/// Largest `POST /tasks` body (an image task carries up to ~140 KiB of base64).
pub const MAX_BODY: usize = 256 * 1024;

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
    /// Tries of in.php on transient errors.
    pub submit_attempts: u32,
    /// First backoff between tries (doubles, capped at 4 s).
    pub submit_backoff: Duration,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{ApiConfig, AuthMode, Settings};
        let cfg = ApiConfig::from_settings(&Settings::from_env())?;
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
        Ok(Self {
            store: TaskStore::from_config(&aws, &cfg.store),
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

fn parse_submit(req: &Request) -> Result<SubmitRequest, Response<Body>> {
    let body: &[u8] = req.body().as_ref();
    if body.len() > MAX_BODY {
        return Err(problem(413, "body_too_large", format!("the body is over {MAX_BODY} bytes")));
    }
    let ctype = req.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
    if !ctype.to_ascii_lowercase().starts_with("application/json") {
        return Err(problem(415, "unsupported_media_type", "the body must be application/json"));
    }
    let submit: SubmitRequest =
        serde_json::from_slice(body).map_err(|e| problem(400, "invalid_request", e.to_string()))?;
    submit.validate().map_err(|e| problem(400, "invalid_request", e.0))?;
    Ok(submit)
}

fn store_unavailable(e: &relay_shared::store::StoreError) -> Response<Body> {
    tracing::error!(event = "store_failed", error = %e, retryable = e.is_retryable(), "task store call failed");
    with_header(problem(503, "store_unavailable", "the task store is unavailable; try again"), "retry-after", "5")
}

async fn submit(req: &Request, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let submit = parse_submit(req)?;
    let kind = submit.kind();
    let now = deps.clock.now();
    let task = Task::new(TaskRef::generate(), kind, now);
    let task_ref = task.task_ref.clone();
    let span = tracing::info_span!("submit", task_ref = %task_ref, kind = %kind);
    let _enter = span.enter();

    // Recorded before in.php hears of it. If in.php's answer is never stored, the poller
    // expires the task at this deadline.
    let grace = deps.callback_grace.for_kind(kind);
    let deadline = now.plus(grace + kind.max_solve_time());
    deps.store.create(&task, deadline).await.map_err(|e| store_unavailable(&e))?;

    let Some(base) = callback_base(req, deps) else {
        tracing::error!(event = "config_error", "no CALLBACK_BASE_URL and no API domain in the request");
        return Err(problem(500, "misconfigured", "the relay does not know its callback URL"));
    };
    let pingback = deps.signer.callback_url(&base, &task_ref);
    let mut attempt = 1;
    let err = loop {
        match deps.captchaai.submit(&submit, &pingback).await {
            Ok(id) => {
                let at = deps.clock.now();
                return match deps.store.mark_submitted(&task_ref, &id, at, at.plus(grace)).await {
                    Ok(SubmitRecorded::Pending(t) | SubmitRecorded::AlreadyResolved(t)) => {
                        tracing::info!(event = "task_submitted", captcha_id = %id, attempts = attempt, "in.php accepted the task");
                        metrics::counter!("submits", "outcome" => "accepted").increment(1);
                        Ok(json(202, &t.view(deps.clock.now())))
                    }
                    Err(e) => {
                        // CaptchaAI has the task and its pingback finds our record by reference;
                        // only the id is missing. The record (`submitting`) stays true.
                        tracing::error!(event = "store_failed", error = %e, captcha_id = %id, "in.php accepted the task but its id could not be stored");
                        Ok(json(202, &task.view(deps.clock.now())))
                    }
                };
            }
            Err(e) if e.outcome_unknown() => {
                tracing::warn!(event = "submit_unknown", error = %e, "in.php outcome unknown; not retried to avoid paying twice");
                metrics::counter!("submits", "outcome" => "unknown").increment(1);
                return Err(with_header(
                    json(
                        503,
                        &serde_json::json!({ "error": { "code": e.code(), "message": format!("{e}; the task may still be solved: read GET /tasks/{task_ref}") }, "task_ref": task_ref }),
                    ),
                    "retry-after",
                    "5",
                ));
            }
            Err(e)
                if matches!(e.class(), CodeClass::Transient | CodeClass::Unknown | CodeClass::NotReady)
                    && attempt < deps.submit_attempts =>
            {
                let delay = backoff_delay(attempt, deps.submit_backoff, Duration::from_secs(4));
                tracing::warn!(event = "submit_retry", error = %e, attempt, delay_ms = delay.as_millis() as u64, "in.php answered a transient error");
                tokio::time::sleep(delay).await;
                attempt += 1;
            }
            Err(e) => break e,
        }
    };
    let code = err.code();
    let (status, detail) = match err.class() {
        CodeClass::Permanent | CodeClass::TerminalForTask => (422, format!("in.php refused the task: {err}")),
        _ => (503, format!("in.php kept answering transient errors ({attempt} tries): {err}")),
    };
    tracing::warn!(event = "submit_failed", code, status, "submit failed");
    metrics::counter!("submits", "outcome" => if status == 503 { "transient" } else { "refused" }).increment(1);
    let stored = deps.store.mark_submit_failed(&task_ref, &code, &detail, deps.clock.now()).await;
    if let Err(e) = &stored {
        tracing::error!(event = "store_failed", error = %e, "could not mark the failed submit");
    }
    let body = serde_json::json!({ "error": { "code": code, "message": detail, "class": err.class().as_str() }, "task_ref": task_ref });
    let resp = json(status, &body);
    Err(if status == 503 { with_header(resp, "retry-after", &retry_after_for(&err).to_string()) } else { resp })
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

fn retry_after_for(err: &CaptchaAiError) -> u64 {
    match err {
        CaptchaAiError::Code(c) => retry_after_secs(c.as_ref()),
        _ => 5,
    }
}

async fn get_task(raw: &str, deps: &Deps) -> Result<Response<Body>, Response<Body>> {
    let task_ref = TaskRef::parse(raw).map_err(|e| problem(404, "unknown_task", format!("no such task: {e}")))?;
    match deps.store.get(&task_ref).await {
        Ok(Some(task)) => Ok(json(200, &task.view(deps.clock.now()))),
        Ok(None) => Err(problem(404, "unknown_task", "no such task")),
        Err(e) => Err(store_unavailable(&e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fake_captchaai::{FakeCaptchaAi, FakeConfig};
    use relay_shared::domain::TaskState;
    use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo};
    use relay_shared::time::{ManualClock, Timestamp};
    use secrecy::SecretString;

    const KEY: &str = "owner-api-key";

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

        w.fake.configure(|c| c.submit_errors = vec!["MAX_USER_TURN".into(); 3]);
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(resp.headers().get("retry-after").and_then(|v| v.to_str().ok()), Some("10"));
        assert_eq!(body(&resp)["error"]["code"], "MAX_USER_TURN");
        assert_eq!(w.fake.counts().in_php, 5, "three tries");
        assert!(matches!(w.state_of(&resp).await, TaskState::Failed { code, .. } if code.as_ref() == "MAX_USER_TURN"));
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread")]
    async fn a_submit_that_times_out_stays_submitting_and_is_not_retried() -> anyhow::Result<()> {
        let w = world(FakeConfig { in_php_delay_ms: 2_000, ..FakeConfig::default() }).await?;
        let resp = w.call(post(TURNSTILE)).await;
        assert_eq!(resp.status(), 503);
        assert_eq!(body(&resp)["error"]["code"], "TIMEOUT");
        assert_eq!(w.state_of(&resp).await, TaskState::Submitting, "we do not know it failed, so we do not say so");
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
}

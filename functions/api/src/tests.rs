//! `respond` end to end: the owner's routes against a store and the fake CaptchaAI (the
//! compat front's in `tests/compat_front.rs`).

use std::sync::Arc;
use std::time::Duration;

use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::domain::{TaskRef, TaskState};
use relay_shared::http::Authorizer;
use relay_shared::signing::CallbackSigner;
use relay_shared::store::TaskStore;
use relay_shared::submit::QueueSettings;
use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo};
use relay_shared::time::{Clock, ManualClock, Timestamp};
use relay_shared::webhook::UrlPolicy;
use secrecy::SecretString;

use super::*;

mod compat_front;

const KEY: &str = "owner-api-key";
const COMPAT_KEY: &str = "0123456789abcdef0123456789abcdef";

struct World {
    _db: LocalDynamo,
    fake: FakeCaptchaAi,
    clock: ManualClock,
    deps: Deps,
    /// The table the deps' handles reach, for what the API itself never does.
    store: TaskStore,
}

async fn world(cfg: FakeConfig) -> anyhow::Result<World> {
    let db = LocalDynamo::start().await?;
    // Pingbacks go to a closed port here: these tests look at the API alone.
    let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 60_000, ..cfg }).await?;
    let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
    let store = db.fresh_store().await?;
    let deps = Deps {
        store: crate::Store::new(&store),
        captchaai: CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            Duration::from_millis(500),
            None,
        )?,
        signer: CallbackSigner::new(SecretString::from("sign".to_owned())),
        idempotency: relay_shared::idempotency::IdempotencyKeys::new(SecretString::from("sign".to_owned())),
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
    Ok(World { _db: db, fake, clock, deps, store })
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
        self.deps.store.tasks.get(&r).await.expect("get").expect("stored").state
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
        let (store, at) = (w.store.clone(), w.clock.now().plus(Duration::from_secs(secs)));
        async move {
            let mut refs = Vec::new();
            for shard in 0..store.shards().read() {
                let page = store.poll().due_page(shard, at, 100, None).await.expect("query");
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
        (r#"{"kind":"recaptcha_v2","sitekey":"6Le","pageurl":"https://a.example","invisible":true}"#, "userrecaptcha"),
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
    let unsigned = ApiGatewayEvent::new("POST", "/tasks").header("content-type", "application/json").body(TURNSTILE);
    assert_eq!(respond(unsigned.build(), &iam).await.status(), 403);
    let signed =
        ApiGatewayEvent::new("POST", "/tasks").header("content-type", "application/json").body(TURNSTILE).iam_caller();
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
        let st = w.deps.store.queue.submit_state().await?;
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
    let b = w.deps.store.account.breaker().await?;
    assert_eq!(b.open_at(w.clock.now()), Some(w.clock.now().plus(Duration::from_secs(10))));
    // While it is open, nothing reaches CaptchaAI: submits wait in the queue.
    let blocked = w.call(post(TURNSTILE)).await;
    assert_eq!((blocked.status().as_u16(), body(&blocked)["status"].as_str()), (202, Some("queued")));
    assert_eq!(w.fake.counts().in_php, 1);
    assert_eq!(w.deps.store.queue.submit_state().await?.queued, 2);

    // A rejected key is an operator's problem: answered at once, nothing queued.
    let w = world(FakeConfig { submit_errors: vec!["ERROR_WRONG_USER_KEY".into()], ..FakeConfig::default() }).await?;
    let resp = w.call(post(TURNSTILE)).await;
    assert_eq!((resp.status().as_u16(), body(&resp)["error"]["code"].as_str()), (503, Some("ERROR_WRONG_USER_KEY")));
    let blocked = w.call(post(TURNSTILE)).await;
    assert_eq!(
        (blocked.status().as_u16(), body(&blocked)["error"]["code"].as_str()),
        (503, Some("captchaai_unavailable"))
    );
    assert!(body(&blocked)["error"]["message"].as_str().unwrap_or_default().contains("operator"));
    assert_eq!((w.fake.counts().in_php, w.deps.store.queue.submit_state().await?.queued), (1, 0));
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
    assert_eq!((refused.status().as_u16(), text.as_str()), (200, "ERROR_NO_SLOT_AVAILABLE"), "2captcha's 'try later'");
    let st = w.deps.store.queue.submit_state().await?;
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
    let d = relay_shared::domain::IncomingResult {
        captcha_id: id,
        outcome: relay_shared::domain::Outcome::Solved(relay_shared::domain::Solution::parse("tok-fresh")?),
        received_at: now,
        via: relay_shared::domain::Via::Callback,
        token_clock_start: now,
    };
    w.deps.store.results.record_result(&task_ref, &d).await?;
    let get =
        || ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}")).header("authorization", &format!("Bearer {KEY}"));
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
    use relay_shared::domain::{CaptchaId, IncomingResult, Outcome, Solution, Via};
    use relay_shared::store::RecordOutcome;
    let w = world(FakeConfig::default()).await?;
    let b = body(&w.call(post(TURNSTILE)).await);
    let task_ref = TaskRef::parse(b["task_ref"].as_str().unwrap_or_default())?;
    let id = CaptchaId::parse(b["captcha_id"].as_str().unwrap_or_default())?;
    let now = w.clock.now();
    let deliver = |token: &str, back_ms: u64| -> anyhow::Result<IncomingResult> {
        let at = Timestamp::from_millis(now.as_millis() - back_ms);
        Ok(IncomingResult {
            captcha_id: id.clone(),
            outcome: Outcome::Solved(Solution::parse(token)?),
            received_at: at,
            via: Via::Redrive,
            token_clock_start: at,
        })
    };
    let get =
        || ApiGatewayEvent::new("GET", &format!("/tasks/{task_ref}")).header("authorization", &format!("Bearer {KEY}"));
    // Stored first: B, received now. Not shown yet, so A, received 2 s earlier, replaces it.
    w.deps.store.results.record_result(&task_ref, &deliver("tok-b", 0)?).await?;
    let replaced = w.deps.store.results.record_result(&task_ref, &deliver("tok-a", 2_000)?).await?;
    assert!(matches!(replaced, RecordOutcome::Replaced(_)), "{replaced:?}");
    let shown = body(&w.call(get()).await);
    assert_eq!(shown["solution"], "tok-a");
    // Shown, hence pinned: a result received even earlier no longer replaces it.
    let late = w.deps.store.results.record_result(&task_ref, &deliver("tok-c", 4_000)?).await?;
    assert!(matches!(late, RecordOutcome::Conflict(_)), "{late:?}");
    w.clock.advance(Duration::from_secs(1));
    assert_eq!(body(&w.call(get()).await)["solution"], "tok-a", "the owner always sees the same token");
    assert_eq!(
        w.deps.store.tasks.get(&task_ref).await?.and_then(|t| t.handed_out_at),
        Some(now),
        "pinned once, by the first read that showed it"
    );
    Ok(())
}

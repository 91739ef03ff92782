//! Attack tests against the HTTP surface: the callback and API handlers on API Gateway events,
//! and the same attacks on local mode over raw HTTP (so odd paths reach the server verbatim).
//!
//! Each attack must get the stated 4xx, and must leave the victim task as it was; after all of
//! them a genuine pingback still records its result, so the harness can tell "refused" from
//! "broken". Plus a statistical timing test: comparing a signature does not take longer the
//! more of its prefix is right.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_shared::domain::{CaptchaId, CaptchaKind, Task, TaskRef, TaskState};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::TaskStore;
use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo, MemorySink};
use relay_shared::time::{ManualClock, Timestamp};
use secrecy::SecretString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

const SIGNING_SECRET: &str = "attack-test-signing-secret";
const API_KEY: &str = "attack-test-api-key-0123456789";

/// One hostile request.
#[derive(Debug, Clone)]
struct Attack {
    name: String,
    method: &'static str,
    path: String,
    query: String,
    headers: Vec<(String, String)>,
    body: String,
    /// Acceptable answers (all 4xx).
    want: Vec<u16>,
}

impl Attack {
    fn new(name: impl Into<String>, method: &'static str, path: impl Into<String>, query: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            method,
            path: path.into(),
            query: query.into(),
            headers: Vec::new(),
            body: String::new(),
            want: Vec::new(),
        }
    }
    fn want(mut self, s: &[u16]) -> Self {
        self.want = s.to_vec();
        self
    }
    fn header(mut self, k: &str, v: impl Into<String>) -> Self {
        self.headers.push((k.to_owned(), v.into()));
        self
    }
    fn with_body(mut self, body: impl Into<String>) -> Self {
        self.body = body.into();
        self
    }
    fn with_query(mut self, query: impl Into<String>) -> Self {
        self.query = query.into();
        self
    }
    fn form(self, body: impl Into<String>) -> Self {
        self.with_body(body).header("content-type", "application/x-www-form-urlencoded")
    }

    fn event(&self) -> lambda_http::Request {
        let mut ev = ApiGatewayEvent::new(self.method, &self.path).query(&self.query);
        for (k, v) in &self.headers {
            ev = ev.header(k, v);
        }
        if !self.body.is_empty() {
            ev = ev.body(&self.body);
        }
        ev.build()
    }

    /// The request as bytes on the wire, path and query verbatim.
    fn raw(&self) -> Vec<u8> {
        let target = if self.query.is_empty() { self.path.clone() } else { format!("{}?{}", self.path, self.query) };
        let mut head = format!("{} {target} HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n", self.method);
        for (k, v) in &self.headers {
            head.push_str(&format!("{k}: {v}\r\n"));
        }
        head.push_str(&format!("content-length: {}\r\n\r\n", self.body.len()));
        let mut bytes = head.into_bytes();
        bytes.extend_from_slice(self.body.as_bytes());
        bytes
    }
}

/// The victim task, another task of the same relay, and their signed paths.
struct Victims {
    a: TaskRef,
    a_id: String,
    a_sig: String,
    b: TaskRef,
    b_id: String,
    b_sig: String,
}

/// Every attack on the callback route. None may write.
fn callback_attacks(v: &Victims) -> Vec<Attack> {
    let (a, a_sig, a_id, b_id) = (&v.a, v.a_sig.as_str(), v.a_id.as_str(), v.b_id.as_str());
    let (b, b_sig) = (&v.b, v.b_sig.as_str());
    let ok_query = format!("id={a_id}&code=FORGED-TOKEN");
    let path = |sig: &str| format!("/callback/{a}/{sig}");
    let first = a_sig.chars().next().unwrap_or('0');
    let flipped_first = if first == '0' { '1' } else { '0' };
    let last_flipped = {
        let mut s = a_sig[..63].to_owned();
        s.push(if a_sig.ends_with('0') { '1' } else { '0' });
        s
    };
    let mut out = Vec::new();
    // Signatures.
    for (name, sig) in [
        ("forged signature", "5".repeat(64)),
        ("another task's signature", v.b_sig.clone()),
        ("truncated to 63", a_sig[..63].to_owned()),
        ("truncated to 32", a_sig[..32].to_owned()),
        ("truncated to 1", a_sig[..1].to_owned()),
        ("uppercase", a_sig.to_uppercase()),
        ("one more character", format!("{a_sig}0")),
        ("right but the last character", last_flipped),
        ("right but the first character", format!("{flipped_first}{}", &a_sig[1..])),
        ("first character percent-encoded", format!("%{:02x}{}", first as u32, &a_sig[1..])),
        ("trailing encoded space", format!("{a_sig}%20")),
        ("trailing encoded slash", format!("{a_sig}%2F")),
        ("path parameter", format!("{a_sig};x=1")),
        ("the task reference as signature", a.to_string()),
    ] {
        out.push(Attack::new(name, "GET", path(&sig), ok_query.clone()).want(&[403]));
        out.push(Attack::new(format!("{name} (POST)"), "POST", path(&sig), "").form(ok_query.clone()).want(&[403]));
    }
    out.push(Attack::new("empty signature", "GET", format!("/callback/{a}/"), ok_query.clone()).want(&[403]));
    out.push(Attack::new("no signature segment", "GET", format!("/callback/{a}"), ok_query.clone()).want(&[403]));
    out.push(
        Attack::new("reference and signature in one encoded segment", "GET", format!("/callback/{a}%2F{a_sig}"), "")
            .want(&[403]),
    );
    // The right path with another task's CaptchaAI id.
    out.push(Attack::new("another task's CaptchaAI id", "GET", path(a_sig), format!("id={b_id}&code=T")).want(&[409]));
    out.push(
        Attack::new("another task's CaptchaAI id (POST)", "POST", path(a_sig), "")
            .form(format!("id={b_id}&code=T"))
            .want(&[409]),
    );
    // Methods that must not write (HEAD and OPTIONS included).
    for m in ["HEAD", "OPTIONS", "PUT", "DELETE", "PATCH"] {
        out.push(Attack::new(format!("method {m}"), m, path(a_sig), ok_query.clone()).want(&[405]));
    }
    // Oversize body.
    out.push(
        Attack::new("oversize body", "POST", path(a_sig), "")
            .form(format!("id={a_id}&code={}", "x".repeat(relay_callback::MAX_BODY)))
            .want(&[413]),
    );
    // Percent-encoding and UTF-8 edges.
    for (name, q) in [
        ("invalid UTF-8 (%FF)", format!("id={a_id}&code=%FF")),
        ("overlong UTF-8 (%C0%AF)", format!("id={a_id}&code=%C0%AF")),
        ("truncated UTF-8 (%E2%82)", format!("id={a_id}&code=%E2%82")),
        ("lone surrogate (%ED%A0%80)", format!("id={a_id}&code=%ED%A0%80")),
        ("bare percent", format!("id={a_id}&code=%")),
        ("half an escape", format!("id={a_id}&code=%4")),
        ("non-hex escape", format!("id={a_id}&code=%zz")),
        ("NUL in the token", format!("id={a_id}&code=tok%00en")),
        ("newline in the token", format!("id={a_id}&code=tok%0Aen")),
        ("encoded id", format!("id=%37{}&code=T", &a_id[1..])),
        ("encoded separator in the id", format!("id={a_id}%26code%3DT")),
        ("not-ready is not a result", format!("id={a_id}&code=CAPCHA_NOT_READY")),
        ("empty code", format!("id={a_id}&code=")),
        ("no id", "code=T".to_owned()),
        ("no code", format!("id={a_id}")),
        ("empty query", String::new()),
    ] {
        let want: &[u16] = match name {
            "not-ready is not a result" => &[422],
            // Decodes to the same id (as would one with spaces around it, which is trimmed): a
            // genuine pingback, allowed — not sent here, as it would write; the harness' final
            // genuine pingback uses it.
            "encoded id" => &[200],
            _ => &[400],
        };
        if want == [200] {
            continue;
        }
        out.push(Attack::new(name, "GET", path(a_sig), q.clone()).want(want));
        out.push(Attack::new(format!("{name} (POST)"), "POST", path(a_sig), "").form(q).want(want));
    }
    // Repeated parameters, and a query that disagrees with the body.
    for (name, q) in [
        ("id twice", format!("id={a_id}&id={a_id}&code=T")),
        ("code twice, different", format!("id={a_id}&code=A&code=B")),
        ("code twice, same", format!("id={a_id}&code=A&code=A")),
    ] {
        out.push(Attack::new(name, "GET", path(a_sig), q.clone()).want(&[400]));
        out.push(Attack::new(format!("{name} (POST)"), "POST", path(a_sig), "").form(q).want(&[400]));
    }
    out.push(
        Attack::new("query and body disagree on code", "POST", path(a_sig), "code=A")
            .form(format!("id={a_id}&code=B"))
            .want(&[400]),
    );
    out.push(
        Attack::new("query and body disagree on id", "POST", path(a_sig), format!("id={b_id}"))
            .form(format!("id={a_id}&code=B"))
            .want(&[400]),
    );
    out.push(
        Attack::new("JSON body", "POST", path(a_sig), "")
            .header("content-type", "application/json")
            .want(&[415])
            .with_body(format!(r#"{{"id":"{a_id}","code":"T"}}"#)),
    );
    // Path tricks. (A URI library may resolve dot segments first — lambda_http does — and
    // then the path lacks its signature: 403 rather than 404. Either way: refused, no write. A
    // path that resolves to the genuine one is a genuine delivery, so none is tried here.)
    for (name, p, want) in [
        ("dot-dot after the signature", format!("/callback/{a}/{a_sig}/.."), vec![403, 404]),
        ("dot-dot to another task", format!("/callback/{b}/../{a}/{b_sig}"), vec![403, 404]),
        ("dot segment before another's signature", format!("/callback/{a}/./{b_sig}"), vec![403, 404]),
        ("encoded dot-dot", format!("/callback/{a}/{a_sig}/%2E%2E"), vec![403, 404]),
        ("trailing segment", format!("/callback/{a}/{a_sig}/extra"), vec![403, 404]),
        (
            "encoded slash in the reference",
            format!("/callback/{}%2F{}/{a_sig}", &a.to_string()[..8], &a.to_string()[8..]),
            vec![403],
        ),
        ("upper-case route", format!("/CALLBACK/{a}/{a_sig}"), vec![401, 404]),
        ("upper-case reference", format!("/callback/{}/{a_sig}", a.to_string().to_uppercase()), vec![403]),
    ] {
        out.push(Attack::new(name, "GET", p, ok_query.clone()).want(&want));
    }
    out
}

/// Every attack on the owner's routes: none may reach in.php, create, or reveal a task.
fn api_attacks(v: &Victims) -> Vec<Attack> {
    let submit = r#"{"kind":"image","body":"aGVsbG8="}"#;
    let mut out = Vec::new();
    for (method, path, body) in [("POST", "/tasks".to_owned(), submit), ("GET", format!("/tasks/{}", v.a), "")] {
        let base = |name: &str| {
            let mut a = Attack::new(format!("{method} {name}"), method, path.clone(), "").with_body(body.to_owned());
            if !body.is_empty() {
                a = a.header("content-type", "application/json");
            }
            a
        };
        out.push(base("no credentials").want(&[401]));
        out.push(base("key in the query").want(&[401]).with_query(format!("api_key={API_KEY}")));
        out.push(base("key in ?key=").want(&[401]).with_query(format!("key={API_KEY}")));
        out.push(base("key in x-api-key").header("x-api-key", API_KEY).want(&[401]));
        out.push(base("key as Basic").header("authorization", format!("Basic {API_KEY}")).want(&[401]));
        out.push(base("scheme without key").header("authorization", "Bearer").want(&[401]));
        // (A server trims the trailing space: then it is the bare scheme.)
        out.push(base("empty key").header("authorization", "Bearer ").want(&[401, 403]));
        out.push(base("wrong key").header("authorization", "Bearer not-the-key-0123456789").want(&[403]));
        out.push(
            base("key truncated")
                .header("authorization", format!("Bearer {}", &API_KEY[..API_KEY.len() - 1]))
                .want(&[403]),
        );
        out.push(base("key extended").header("authorization", format!("Bearer {API_KEY}x")).want(&[403]));
        out.push(
            base("key upper-cased").header("authorization", format!("Bearer {}", API_KEY.to_uppercase())).want(&[403]),
        );
        out.push(
            base("signing secret as key").header("authorization", format!("Bearer {SIGNING_SECRET}")).want(&[403]),
        );
    }
    out
}

fn assert_refused(attack: &Attack, status: u16, body: &str) {
    assert!(
        attack.want.contains(&status),
        "{}: {} {}?{} answered {status}, wanted {:?}: {body}",
        attack.name,
        attack.method,
        attack.path,
        attack.query,
        attack.want
    );
    assert!(!body.contains("FORGED-TOKEN"), "{}: the answer echoes the forged token: {body}", attack.name);
}

async fn still_waiting(store: &TaskStore, r: &TaskRef, what: &str) {
    let t = store.tasks().get(r).await.ok().flatten().unwrap_or_else(|| panic!("{what}: the task is gone"));
    assert!(matches!(t.state, TaskState::Pending { .. }), "{what}: the task changed: {:?}", t.state);
}

async fn solved_with(store: &TaskStore, r: &TaskRef, token: &str) {
    let t = store.tasks().get(r).await.ok().flatten().unwrap_or_else(|| panic!("the task is gone"));
    match t.state {
        TaskState::Solved { solution, .. } => assert_eq!(solution.expose(), token),
        other => panic!("a genuine pingback was not recorded: {other:?}"),
    }
}

// ---------------------------------------------------------------- on API Gateway events

struct Handlers {
    _db: LocalDynamo,
    fake: fake_captchaai::FakeCaptchaAi,
    store: TaskStore,
    api: relay_api::Deps,
    callback: relay_callback::Deps,
    victims: Victims,
}

async fn handlers(auth: relay_shared::http::Authorizer) -> anyhow::Result<Handlers> {
    let db = LocalDynamo::start().await?;
    let store = db.fresh_store().await?;
    let fake = fake_captchaai::FakeCaptchaAi::start(fake_captchaai::FakeConfig {
        solve_delay_ms: 3_600_000,
        ..Default::default()
    })
    .await?;
    let now = Timestamp::from_millis(1_796_210_146_000);
    let clock = Arc::new(ManualClock::at(now));
    let signer = CallbackSigner::new(SecretString::from(SIGNING_SECRET.to_owned()));
    let mut made = Vec::new();
    for id in ["71000001", "71000002"] {
        let task = Task::new(TaskRef::generate(), CaptchaKind::Image, now);
        store.tasks().create(&task, now, None).await?;
        store.tasks().mark_submitted(&task.task_ref, &CaptchaId::parse(id)?, now, now).await?;
        made.push((task.task_ref, id.to_owned()));
    }
    let [(a, a_id), (b, b_id)] = <[_; 2]>::try_from(made).map_err(|_| anyhow::anyhow!("two tasks"))?;
    let victims = Victims { a_sig: signer.sign(&a), b_sig: signer.sign(&b), a, a_id, b, b_id };
    let dead_letters = Arc::new(MemorySink::default());
    let api = relay_api::Deps {
        store: relay_api::Store::new(&store),
        captchaai: relay_shared::captchaai::CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            Duration::from_secs(5),
            None,
        )?,
        signer: signer.clone(),
        idempotency: relay_shared::idempotency::IdempotencyKeys::new(SecretString::from(SIGNING_SECRET.to_owned())),
        auth,
        clock: clock.clone(),
        callback_base_url: Some("http://127.0.0.1:9".into()),
        callback_grace: Default::default(),
        dead_letters: dead_letters.clone(),
        queue: relay_shared::submit::QueueSettings::default(),
        waker: Arc::new(relay_shared::submit::NotifyWaker::default()),
        relay_keys: relay_shared::store::RelayKeys::new(None),
        compat: relay_api::compat::CompatState::default(),
        admission: Default::default(),
        delivery_policy: relay_shared::webhook::UrlPolicy::PublicHttps,
    };
    let callback =
        relay_callback::Deps { results: store.results(), signer, clock, dead_letters, recent: Default::default() };
    Ok(Handlers { _db: db, fake, store, api, callback, victims })
}

fn body_text(resp: &lambda_http::Response<lambda_http::Body>) -> String {
    String::from_utf8_lossy(resp.body().as_ref()).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn callback_attacks_on_api_gateway_events_are_refused_and_write_nothing() -> anyhow::Result<()> {
    let h = handlers(relay_shared::http::Authorizer::api_key(&SecretString::from(API_KEY.to_owned()))).await?;
    let v = &h.victims;
    let attacks = callback_attacks(v);
    assert!(attacks.len() > 80, "{}", attacks.len());
    for attack in &attacks {
        let resp = relay_callback::respond(attack.event(), &h.callback).await;
        assert_refused(attack, resp.status().as_u16(), &body_text(&resp));
        still_waiting(&h.store, &v.a, &attack.name).await;
        still_waiting(&h.store, &v.b, &attack.name).await;
    }
    // Headers API Gateway would pass on (it caps them at 10 KB each): many and large, with a
    // forged signature — refused, and the handler does not fall over.
    let mut big =
        Attack::new("many large headers", "GET", format!("/callback/{}/{}", v.a, "7".repeat(64)), "").want(&[403]);
    for i in 0..100 {
        big = big.header(&format!("x-junk-{i}"), "j".repeat(8_000));
    }
    let resp = relay_callback::respond(big.event(), &h.callback).await;
    assert_refused(&big, resp.status().as_u16(), &body_text(&resp));
    // The harness can tell refused from broken: a genuine pingback (percent-encoded id and all)
    // is recorded.
    let genuine = format!("id=%37{}&code=GENUINE-TOKEN", &v.a_id[1..]);
    let resp = relay_callback::respond(
        Attack::new("genuine", "GET", format!("/callback/{}/{}", v.a, v.a_sig), genuine).event(),
        &h.callback,
    )
    .await;
    assert_eq!(resp.status(), 200, "{}", body_text(&resp));
    solved_with(&h.store, &v.a, "GENUINE-TOKEN").await;
    still_waiting(&h.store, &v.b, "after the genuine pingback").await;
    // And once solved, the attacks still change nothing.
    for attack in attacks.iter().filter(|a| a.want != [409]) {
        let resp = relay_callback::respond(attack.event(), &h.callback).await;
        assert!(resp.status().is_client_error(), "{}: {}", attack.name, resp.status());
        solved_with(&h.store, &v.a, "GENUINE-TOKEN").await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_attacks_on_api_gateway_events_never_reach_captchaai_or_reveal_a_task() -> anyhow::Result<()> {
    let h = handlers(relay_shared::http::Authorizer::api_key(&SecretString::from(API_KEY.to_owned()))).await?;
    for attack in api_attacks(&h.victims) {
        let resp = relay_api::respond(attack.event(), &h.api).await;
        let body = body_text(&resp);
        assert_refused(&attack, resp.status().as_u16(), &body);
        assert!(!body.contains(&h.victims.a_id), "{}: reveals the task: {body}", attack.name);
        if resp.status() == 401 {
            assert_eq!(
                resp.headers().get("www-authenticate").and_then(|v| v.to_str().ok()),
                Some("Bearer"),
                "{}",
                attack.name
            );
        }
    }
    assert_eq!(h.fake.counts().in_php, 0, "no attack reached in.php");
    // The key itself works (the attacks were refused for what they were).
    let ok = ApiGatewayEvent::new("GET", &format!("/tasks/{}", h.victims.a))
        .header("authorization", &format!("Bearer {API_KEY}"))
        .build();
    assert_eq!(relay_api::respond(ok, &h.api).await.status(), 200);

    // IAM authorisation: a request without an IAM identity is refused, even with the key.
    let iam = handlers(relay_shared::http::Authorizer::Iam).await?;
    for with_key in [false, true] {
        let mut ev = ApiGatewayEvent::new("POST", "/tasks")
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"aGVsbG8="}"#);
        if with_key {
            ev = ev.header("authorization", &format!("Bearer {API_KEY}"));
        }
        let resp = relay_api::respond(ev.build(), &iam.api).await;
        assert_eq!(resp.status(), 403, "IAM without an identity: {}", body_text(&resp));
    }
    assert_eq!(iam.fake.counts().in_php, 0);
    let signed = ApiGatewayEvent::new("GET", &format!("/tasks/{}", iam.victims.a)).iam_caller().build();
    assert_eq!(relay_api::respond(signed, &iam.api).await.status(), 200, "an IAM caller is let in");
    Ok(())
}

// ---------------------------------------------------------------- local mode over HTTP

/// Sends raw bytes and returns the status (None if the server closed without answering).
async fn raw_request(addr: &str, bytes: &[u8]) -> anyhow::Result<(Option<u16>, String)> {
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    // The server may answer (and close) before reading a body it refuses: a failed write is
    // not an answer, so read whatever came back.
    let _ = s.write_all(bytes).await;
    let mut buf = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut buf)).await;
    let text = String::from_utf8_lossy(&buf).into_owned();
    let status = text.strip_prefix("HTTP/1.1 ").and_then(|r| r.get(..3)).and_then(|c| c.parse().ok());
    Ok((status, text))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn attacks_on_local_mode_over_http_are_refused_and_write_nothing() -> anyhow::Result<()> {
    let dir = std::env::temp_dir().join(format!("relay-attacks-{}", uuid::Uuid::new_v4().simple()));
    let cfg = relay_local::run::LocalConfig {
        bind: "127.0.0.1:0".into(),
        data_dir: dir.clone(),
        api_key: Some(API_KEY.into()),
        signing_secret: Some(SIGNING_SECRET.into()),
        poll_interval_secs: 3_600,
        ..Default::default()
    };
    // Pingbacks never come and solving takes an hour: the tasks wait, and only an attack could
    // change them.
    let fake = fake_captchaai::FakeConfig { solve_delay_ms: 3_600_000, drop_callbacks: 1.0, ..Default::default() };
    let relay =
        relay_local::run::start(&cfg, relay_local::run::Options { fake: Some(fake), ..Default::default() }).await?;
    let addr = relay.base_url.trim_start_matches("http://").to_owned();
    let http = reqwest::Client::new();
    let mut made = Vec::new();
    for n in 0..2 {
        let v: serde_json::Value = http
            .post(format!("{}/tasks", relay.base_url))
            .bearer_auth(API_KEY)
            .header("idempotency-key", format!("attack-victim-{n}"))
            .json(&serde_json::json!({ "kind": "image", "body": "aGVsbG8=" }))
            .send()
            .await?
            .json()
            .await?;
        let r = TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())?;
        let id = v["captcha_id"].as_str().unwrap_or_default().to_owned();
        assert!(!id.is_empty(), "submitted: {v}");
        made.push((r, id));
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let signer = CallbackSigner::new(SecretString::from(SIGNING_SECRET.to_owned()));
    let [(a, a_id), (b, b_id)] = <[_; 2]>::try_from(made).map_err(|_| anyhow::anyhow!("two tasks"))?;
    let v = Victims { a_sig: signer.sign(&a), b_sig: signer.sign(&b), a, a_id, b, b_id };
    let in_php = relay.fake.as_ref().map(|f| f.counts().in_php);

    let mut attacks = callback_attacks(&v);
    attacks.extend(api_attacks(&v));
    // What only a real server sees: headers and bodies past its limits, on the genuine path.
    let genuine_path = format!("/callback/{}/{}", v.a, v.a_sig);
    let genuine_query = format!("id={}&code=FORGED-TOKEN", v.a_id);
    attacks.push(
        Attack::new("one header of 1 MB", "GET", genuine_path.clone(), genuine_query.clone())
            .header("x-big", "h".repeat(1024 * 1024))
            .want(&[400, 413, 431]),
    );
    let mut many = Attack::new("200 headers", "GET", genuine_path.clone(), genuine_query.clone()).want(&[400, 431]);
    for i in 0..200 {
        many = many.header(&format!("x-h{i}"), "v");
    }
    attacks.push(many);
    attacks.push(
        Attack::new("a 2 MB body", "POST", genuine_path.clone(), "")
            .form(format!("id={}&code={}", v.a_id, "x".repeat(2 * 1024 * 1024)))
            .want(&[413]),
    );
    for attack in &attacks {
        let (status, text) = raw_request(&addr, &attack.raw()).await?;
        match status {
            Some(s) => assert_refused(attack, s, &text),
            // A server may drop a request past its header limits without an answer; never for
            // anything else.
            None => assert!(
                attack.name.contains("header"),
                "{}: the server closed without answering: {text:?}",
                attack.name
            ),
        }
        still_waiting(&relay.store, &v.a, &attack.name).await;
        still_waiting(&relay.store, &v.b, &attack.name).await;
    }
    // Bytes that are not UTF-8 at all, in the path and in a form body.
    let mut in_path = format!("GET /callback/{}/{}", v.a, v.a_sig).into_bytes();
    in_path.extend_from_slice(b"\xFF\xFE HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n");
    let mut form = format!("id={}&code=", v.a_id).into_bytes();
    form.extend_from_slice(&[0xFF; 4]);
    let mut in_body = format!(
        "POST {genuine_path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-type: application/x-www-form-urlencoded\r\ncontent-length: {}\r\n\r\n",
        form.len()
    )
    .into_bytes();
    in_body.extend_from_slice(&form);
    for (name, bytes) in [("raw 0xFF in the path", in_path), ("raw 0xFF in the body", in_body)] {
        let (status, text) = raw_request(&addr, &bytes).await?;
        assert!(status.is_none_or(|s| (400..500).contains(&s)), "{name}: {status:?} {text}");
        still_waiting(&relay.store, &v.a, name).await;
    }
    assert_eq!(relay.fake.as_ref().map(|f| f.counts().in_php), in_php, "no attack reached in.php");
    // A genuine pingback over the same server is recorded.
    let (status, text) = raw_request(
        &addr,
        &Attack::new("genuine", "POST", genuine_path, "").form(format!("id={}&code=GENUINE-TOKEN", v.a_id)).raw(),
    )
    .await?;
    assert_eq!(status, Some(200), "{text}");
    solved_with(&relay.store, &v.a, "GENUINE-TOKEN").await;
    still_waiting(&relay.store, &v.b, "after the genuine pingback").await;
    relay.shutdown().await;
    let _ = std::fs::remove_dir_all(dir);
    Ok(())
}

// ---------------------------------------------------------------- timing

/// Median nanoseconds per call of `f` for each input, measured interleaved (round after round,
/// each input in turn) so drift in the machine's load falls on all of them alike.
fn interleaved_medians(inputs: &[String], rounds: usize, per_round: usize, f: impl Fn(&str) -> bool) -> Vec<f64> {
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(rounds); inputs.len()];
    for round in 0..rounds {
        // Rotate the order too, so no input always follows another.
        for k in 0..inputs.len() {
            let i = (k + round) % inputs.len();
            let input = inputs[i].as_str();
            let t = Instant::now();
            for _ in 0..per_round {
                std::hint::black_box(f(std::hint::black_box(input)));
            }
            samples[i].push(t.elapsed().as_nanos() as f64 / per_round as f64);
        }
    }
    samples
        .into_iter()
        .map(|mut s| {
            s.sort_by(f64::total_cmp);
            s[s.len() / 2]
        })
        .collect()
}

#[test]
fn signature_checks_take_the_same_time_however_much_of_the_prefix_is_right() {
    let signer = CallbackSigner::new(SecretString::from(SIGNING_SECRET.to_owned()));
    let r = TaskRef::generate();
    let good = signer.sign(&r);
    let flip = |c: char| if c == '0' { '1' } else { '0' };
    let with_prefix = |n: usize| {
        let mut s: String = good[..n].to_owned();
        s.push(flip(good.as_bytes()[n] as char));
        s.push_str(&"0".repeat(63 - n));
        s
    };
    // Wrong at the first character, half-way, at the last; the right one; upper-case.
    let inputs = vec![with_prefix(0), with_prefix(32), with_prefix(63), good.clone(), good.to_uppercase()];
    let verify = |s: &str| signer.verify(&r, s);
    let medians = interleaved_medians(&inputs, 301, 200, verify);
    println!("verify, median ns per call (wrong at 0 / wrong at 32 / wrong at 63 / right / upper-case): {medians:.0?}");
    // Against the median of the five: none may stand out (a leak by prefix would make "wrong
    // at 63" and "right" the slowest by far; see the power check below).
    let mut sorted = medians.clone();
    sorted.sort_by(f64::total_cmp);
    let mid = sorted[2];
    let names = ["wrong at 0", "wrong at 32", "wrong at 63", "right", "upper-case"];
    for (input, m) in names.iter().zip(&medians) {
        let ratio = m / mid;
        assert!((0.85..=1.15).contains(&ratio), "{input}: {m:.0} ns vs {mid:.0} ns (ratio {ratio:.3}): {medians:?}");
    }

    // The method has the power to see a leak: a comparison that stops at the first wrong byte
    // (each byte made to cost what a cache miss would) is caught by the same statistic.
    let leaky = |s: &str| {
        let (a, b) = (s.as_bytes(), good.as_bytes());
        for i in 0..a.len().min(b.len()) {
            for _ in 0..20 {
                std::hint::black_box(i);
            }
            if a[i] != b[i] {
                return false;
            }
        }
        a.len() == b.len()
    };
    let medians = interleaved_medians(&inputs[..3], 101, 200, leaky);
    assert!(medians[2] / medians[0] > 1.5, "the statistic misses a prefix leak: {medians:?}");
}

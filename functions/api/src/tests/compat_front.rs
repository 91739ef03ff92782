//! The 2captcha-compatible front (`/in.php`, `/res.php`) through `respond`, against the fake.

use super::*;
use base64::Engine;
use relay_shared::domain::{IncomingResult, Outcome, Solution};

const MULTIPART_BOUNDARY: &str = "----relayBoundaryX7MA4YWxk";

fn form(path: &str, body: &str) -> ApiGatewayEvent {
    ApiGatewayEvent::new("POST", path).header("content-type", "application/x-www-form-urlencoded").body(body)
}

fn text(r: &Response<Body>) -> String {
    String::from_utf8_lossy(r.body().as_ref()).into_owned()
}

/// `OK|<id>` → the id, checked to be what every SDK takes: 18–19 digits.
fn ok_id(r: &Response<Body>) -> String {
    let t = text(r);
    let id = t.strip_prefix("OK|").unwrap_or_else(|| panic!("not OK|id: {t}")).to_owned();
    assert!((18..=19).contains(&id.len()) && id.bytes().all(|b| b.is_ascii_digit()), "{id}");
    id
}

/// A multipart `POST /in.php` with these fields and a binary `file` part, as API Gateway passes
/// it (base64-encoded).
fn multipart_post(fields: &[(&str, &str)], file: &[u8]) -> ApiGatewayEvent {
    let mut b = Vec::new();
    for (k, v) in fields {
        b.extend_from_slice(
            format!("--{MULTIPART_BOUNDARY}\r\nContent-Disposition: form-data; name=\"{k}\"\r\n\r\n{v}\r\n").as_bytes(),
        );
    }
    b.extend_from_slice(
        format!(
            "--{MULTIPART_BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"captcha.png\"\r\nContent-Type: image/png\r\n\r\n"
        )
        .as_bytes(),
    );
    b.extend_from_slice(file);
    b.extend_from_slice(format!("\r\n--{MULTIPART_BOUNDARY}--\r\n").as_bytes());
    ApiGatewayEvent::new("POST", "/in.php")
        .header("content-type", &format!("multipart/form-data; boundary={MULTIPART_BOUNDARY}"))
        .body_base64(&base64::engine::general_purpose::STANDARD.encode(&b), b.len())
}

impl World {
    /// The fake's record of the task behind a compat id.
    async fn sent(&self, compat_id: &str) -> fake_captchaai::FakeTask {
        let r = TaskRef::from_compat_id(compat_id).expect("a compat id");
        let task = self.deps.store.tasks.get(&r).await.expect("get").expect("stored");
        let id = task.captcha_id.expect("in.php's id stored");
        self.fake.task(id.as_ref()).expect("the fake has it")
    }

    async fn solve(&self, compat_id: &str, token: &str) {
        let r = TaskRef::from_compat_id(compat_id).expect("a compat id");
        let task = self.deps.store.tasks.get(&r).await.expect("get").expect("stored");
        let now = self.clock.now();
        let d = IncomingResult {
            captcha_id: task.captcha_id.expect("id"),
            outcome: Outcome::Solved(Solution::parse(token).expect("token")),
            received_at: now,
            via: relay_shared::domain::Via::Callback,
            token_clock_start: now,
        };
        self.deps.store.results.record_result(&r, &d).await.expect("recorded");
    }

    async fn res(&self, q: &str) -> Response<Body> {
        self.call(ApiGatewayEvent::new("GET", "/res.php").query(&format!("key={COMPAT_KEY}&{q}"))).await
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn in_php_takes_every_supported_kind_in_every_body_form_and_answers_as_2captcha() -> anyhow::Result<()> {
    let w = world(FakeConfig::default()).await?;
    let k = COMPAT_KEY;

    // reCAPTCHA v2 as the Python SDK sends it: a POST form, plain answers.
    let r = w
        .call(form(
            "/in.php",
            &format!("key={k}&method=userrecaptcha&googlekey=6Le-SITE&pageurl=https%3A%2F%2Fshop.example%2Flogin&invisible=1&data-s=abc&userAgent=UA%2F1&soft_id=4580&pingback=https%3A%2F%2Fowner.example%2Fcb"),
        ))
        .await;
    assert_eq!(r.status(), 200);
    assert!(r.headers()["content-type"].to_str()?.starts_with("text/plain"));
    let v2 = ok_id(&r);
    let sent = w.sent(&v2).await;
    assert_eq!(sent.method, "userrecaptcha");
    for (p, v) in [("googlekey", "6Le-SITE"), ("invisible", "1"), ("data-s", "abc"), ("userAgent", "UA/1")] {
        assert_eq!(sent.params.get(p).map(String::as_str), Some(v), "{p}");
    }
    // CaptchaAI gets the relay's own signed callback; the owner's URL is kept on the task.
    let task_ref = TaskRef::from_compat_id(&v2)?;
    assert_eq!(sent.pingback, Some(w.deps.signer.callback_url("http://127.0.0.1:9", &task_ref)));
    let task = w.deps.store.tasks.get(&task_ref).await?.expect("stored");
    assert_eq!(task.owner_callback.as_deref(), Some("https://owner.example/cb"));
    assert_eq!(task.kind, relay_shared::domain::CaptchaKind::RecaptchaV2);

    // reCAPTCHA v3 as the JavaScript SDK sends it: a GET query, JSON answers; the id is a string.
    let r = w
        .call(ApiGatewayEvent::new("GET", "/in.php").query(&format!(
            "key={k}&json=1&header_acao=1&soft_id=4587&method=userrecaptcha&version=v3&action=login&min_score=0.7&googlekey=6Lc-V3&pageurl=https%3A%2F%2Fshop.example%2F"
        )))
        .await;
    assert_eq!(r.headers()["access-control-allow-origin"], "*");
    let b = body(&r);
    assert_eq!(b["status"], 1, "{b}");
    let v3 = b["request"].as_str().expect("the id as a JSON string").to_owned();
    let sent = w.sent(&v3).await;
    for (p, v) in [("version", "v3"), ("action", "login"), ("min_score", "0.7")] {
        assert_eq!(sent.params.get(p).map(String::as_str), Some(v), "{p}");
    }

    // Enterprise, Turnstile; hCaptcha, which CaptchaAI does not solve, refused before in.php.
    let ent = ok_id(
        &w.call(form(
            "/in.php",
            &format!("key={k}&method=userrecaptcha&enterprise=1&googlekey=6Le-ENT&pageurl=https://shop.example/"),
        ))
        .await,
    );
    assert_eq!(w.sent(&ent).await.params.get("enterprise").map(String::as_str), Some("1"));
    let hc = body(
        &w.call(form(
            "/in.php",
            &format!("key={k}&json=1&method=hcaptcha&sitekey=hc-site&pageurl=https://shop.example/"),
        ))
        .await,
    );
    assert_eq!(hc["request"], "ERROR_BAD_PARAMETERS", "{hc}");
    assert!(hc["error_text"].as_str().is_some_and(|t| t.contains("does not solve hcaptcha")), "{hc}");
    let ts = ok_id(
        &w.call(form(
            "/in.php",
            &format!("key={k}&method=turnstile&sitekey=0x4AAA&pageurl=https://shop.example/&action=login&data=cdata"),
        ))
        .await,
    );
    let sent = w.sent(&ts).await;
    assert_eq!((sent.method.as_str(), sent.params.get("data").map(String::as_str)), ("turnstile", Some("cdata")));

    // A base64 image as the JavaScript SDK posts it: a JSON body.
    let img = base64::engine::general_purpose::STANDARD.encode(b"\x89PNG\r\n\x1a\n-image-");
    let r = w
        .call(ApiGatewayEvent::new("POST", "/in.php").header("content-type", "application/json").body(
            &serde_json::json!({ "key": k, "json": 1, "method": "base64", "body": img, "numeric": 1 }).to_string(),
        ))
        .await;
    let b64 = body(&r)["request"].as_str().expect("id").to_owned();
    let sent = w.sent(&b64).await;
    assert_eq!((sent.method.as_str(), sent.params.get("body")), ("base64", Some(&img)));
    assert_eq!(sent.params.get("numeric").map(String::as_str), Some("1"), "image hints are forwarded");

    // A file as the Python SDK's `normal(<file>)` posts it: multipart, binary bytes.
    let file = b"\x89PNG\r\n\x1a\n\x00\xff binary \r\n--not-a-boundary";
    let r = w.call(multipart_post(&[("key", k), ("method", "post"), ("min_len", "4")], file)).await;
    let post = ok_id(&r);
    let sent = w.sent(&post).await;
    assert_eq!(sent.method, "base64", "the file goes to CaptchaAI as base64");
    assert_eq!(sent.params.get("body"), Some(&base64::engine::general_purpose::STANDARD.encode(file)));
    assert_eq!(sent.params.get("min_len").map(String::as_str), Some("4"));

    // GeeTest v3, a Cloudflare challenge (through the owner's proxy), BLS's nine cells.
    let gt = ok_id(
        &w.call(form(
            "/in.php",
            &format!("key={k}&method=geetest&gt=81388ea1&challenge=2e2f0f65&api_server=api.geetest.com&pageurl=https://shop.example/"),
        ))
        .await,
    );
    let sent = w.sent(&gt).await;
    for (p, v) in [("gt", "81388ea1"), ("challenge", "2e2f0f65"), ("api_server", "api.geetest.com")] {
        assert_eq!(sent.params.get(p).map(String::as_str), Some(v), "{p}");
    }
    let cf = ok_id(
        &w.call(form(
            "/in.php",
            &format!(
                "key={k}&method=cloudflare_challenge&pageurl=https://shop.example/&proxy=u:p@203.0.113.7:3128&proxytype=HTTP&userAgent=UA/9"
            ),
        ))
        .await,
    );
    let sent = w.sent(&cf).await;
    assert_eq!(
        (sent.method.as_str(), sent.params.get("userAgent").map(String::as_str)),
        ("cloudflare_challenge", Some("UA/9"))
    );
    let no_proxy = text(
        &w.call(form("/in.php", &format!("key={k}&method=cloudflare_challenge&pageurl=https://shop.example/"))).await,
    );
    assert_eq!(no_proxy, "ERROR_BAD_PARAMETERS", "a Cloudflare challenge needs the owner's proxy");
    let cells: String = (1..=9).map(|i| format!("&image_base64_{i}=data:image/png;base64,iVBORw0KGgo%3D")).collect();
    let bls = ok_id(&w.call(form("/in.php", &format!("key={k}&method=bls&instructions=664{cells}"))).await);
    let sent = w.sent(&bls).await;
    assert_eq!(sent.params.get("image_base64_9").map(String::as_str), Some("data:image/png;base64,iVBORw0KGgo="));
    let eight: String = (1..=8).map(|i| format!("&image_base64_{i}=iVBORw0KGgo%3D")).collect();
    assert_eq!(
        text(&w.call(form("/in.php", &format!("key={k}&method=bls&instructions=664{eight}"))).await),
        "ERROR_BAD_PARAMETERS"
    );

    // Every submit accepted made exactly one in.php call; the refused ones none.
    assert_eq!(w.fake.counts().in_php, 9);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn bad_keys_and_bad_requests_get_2captchas_codes_and_reach_nobody() -> anyhow::Result<()> {
    let w = world(FakeConfig::default()).await?;
    let k = COMPAT_KEY;
    let cases: Vec<(String, &str)> = vec![
        ("method=turnstile&sitekey=s&pageurl=https://a.example/".into(), "ERROR_WRONG_USER_KEY"),
        ("key=short&method=turnstile&sitekey=s&pageurl=https://a.example/".into(), "ERROR_WRONG_USER_KEY"),
        (
            "key=ffffffffffffffffffffffffffffffff&method=turnstile&sitekey=s&pageurl=https://a.example/".into(),
            "ERROR_KEY_DOES_NOT_EXIST",
        ),
        (format!("key={k}&method=userrecaptcha&pageurl=https://a.example/"), "ERROR_GOOGLEKEY"),
        (format!("key={k}&method=userrecaptcha&googlekey=g"), "ERROR_PAGEURL"),
        (format!("key={k}&method=userrecaptcha&googlekey=g&pageurl=ftp://a.example/"), "ERROR_PAGEURL"),
        (format!("key={k}&method=funcaptcha&publickey=p&pageurl=https://a.example/"), "ERROR_BAD_PARAMETERS"),
        (format!("key={k}&sitekey=s&pageurl=https://a.example/"), "ERROR_BAD_PARAMETERS"),
        (format!("key={k}&method=post"), "ERROR_ZERO_CAPTCHA_FILESIZE"),
        (format!("key={k}&method=base64&body="), "ERROR_ZERO_CAPTCHA_FILESIZE"),
        (format!("key={k}&method=base64&body=%21%21%21"), "ERROR_BAD_PARAMETERS"),
        (
            format!("key={k}&method=userrecaptcha&version=v3&min_score=high&googlekey=g&pageurl=https://a.example/"),
            "ERROR_BAD_PARAMETERS",
        ),
        (
            format!("key={k}&method=turnstile&sitekey=s&pageurl=https://a.example/&pingback=javascript:alert(1)"),
            "ERROR_BAD_PARAMETERS",
        ),
    ];
    for (q, code) in &cases {
        let r = w.call(form("/in.php", q)).await;
        assert_eq!((r.status().as_u16(), text(&r).as_str()), (200, *code), "{q}");
        let r = w.call(form("/in.php", &format!("{q}&json=1"))).await;
        let b = body(&r);
        assert_eq!((b["status"].as_i64(), b["request"].as_str()), (Some(0), Some(*code)), "{q}");
        assert!(b["error_text"].as_str().is_some_and(|t| !t.is_empty()), "a clear reason: {b}");
    }
    // Too big an image, as a file.
    let r = w.call(multipart_post(&[("key", k), ("method", "post")], &vec![7u8; 100 * 1024 + 1])).await;
    assert_eq!(text(&r), "ERROR_TOO_BIG_CAPTCHA_FILESIZE");
    // A malformed multipart body is the caller's mistake: 400, never a 500.
    let r = w
        .call(
            ApiGatewayEvent::new("POST", "/in.php")
                .header("content-type", &format!("multipart/form-data; boundary={MULTIPART_BOUNDARY}"))
                .body("--nothing here"),
        )
        .await;
    assert_eq!((r.status().as_u16(), text(&r).as_str()), (400, "ERROR_BAD_PARAMETERS"));
    // res.php with bad keys, too.
    let r = w.call(ApiGatewayEvent::new("GET", "/res.php").query("key=nope&action=get&id=1")).await;
    assert_eq!(text(&r), "ERROR_WRONG_USER_KEY");
    assert_eq!(w.fake.counts().in_php + w.fake.counts().res_php, 0, "nothing reached CaptchaAI");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn res_php_answers_from_the_table_never_from_captchaai_and_never_hands_out_a_stale_token() -> anyhow::Result<()> {
    let w = world(FakeConfig::default()).await?;
    let k = COMPAT_KEY;
    let id = ok_id(
        &w.call(form("/in.php", &format!("key={k}&method=turnstile&sitekey=s&pageurl=https://a.example/"))).await,
    );
    let other = ok_id(
        &w.call(form("/in.php", &format!("key={k}&method=turnstile&sitekey=t&pageurl=https://a.example/"))).await,
    );
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "CAPCHA_NOT_READY");
    let b = body(&w.res(&format!("action=get&id={id}&json=1")).await);
    assert_eq!((b["status"].as_i64(), b["request"].as_str()), (Some(0), Some("CAPCHA_NOT_READY")));

    w.solve(&id, "tok-turnstile").await;
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "OK|tok-turnstile");
    let b = body(&w.res(&format!("action=get&id={id}&json=1")).await);
    assert_eq!((b["status"].as_i64(), b["request"].as_str()), (Some(1), Some("tok-turnstile")));
    // Batch reads, in order, an unknown id answered in its place.
    let r = w.res(&format!("action=get&ids={id},{other},123456789012345678")).await;
    assert_eq!(text(&r), "tok-turnstile|CAPCHA_NOT_READY|ERROR_WRONG_CAPTCHA_ID");
    // Ids that are not compat ids, and API references, are wrong ids.
    for bad in ["1", "abc", "tsk_0123", "99999999999999999999"] {
        assert_eq!(text(&w.res(&format!("action=get&id={bad}")).await), "ERROR_WRONG_CAPTCHA_ID", "{bad}");
    }
    // The GET /tasks view shows the same task under its reference.
    let view = body(
        &w.call(
            ApiGatewayEvent::new("GET", &format!("/tasks/{}", TaskRef::from_compat_id(&id)?))
                .header("authorization", &format!("Bearer {KEY}")),
        )
        .await,
    );
    assert_eq!(view["solution"], "tok-turnstile");

    // Past Turnstile's 300 s lifetime the token is never handed out.
    w.clock.advance(Duration::from_secs(300));
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "ERROR_TOKEN_EXPIRED");

    // A refused result is its code.
    let r = TaskRef::from_compat_id(&other)?;
    let task = w.deps.store.tasks.get(&r).await?.expect("stored");
    let now = w.clock.now();
    let d = IncomingResult {
        captcha_id: task.captcha_id.expect("id"),
        outcome: Outcome::Failed(relay_shared::codes::ErrorCode::parse("ERROR_CAPTCHA_UNSOLVABLE")?),
        received_at: now,
        via: relay_shared::domain::Via::Poll,
        token_clock_start: now,
    };
    w.deps.store.results.record_result(&r, &d).await?;
    assert_eq!(text(&w.res(&format!("action=get&id={other}")).await), "ERROR_CAPTCHA_UNSOLVABLE");

    // Unsupported and missing actions.
    assert_eq!(text(&w.res("action=get2&id=1").await), "ERROR_EMPTY_ACTION");
    assert_eq!(text(&w.res("id=1").await), "ERROR_EMPTY_ACTION");
    assert_eq!(w.fake.counts().res_php, 0, "no read reached CaptchaAI");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn balance_is_passed_through_and_cached_and_reports_reach_captchaai_for_the_tasks_id() -> anyhow::Result<()> {
    let w = world(FakeConfig { balance: "12.345".into(), ..FakeConfig::default() }).await?;
    assert_eq!(text(&w.res("action=getbalance").await), "12.345");
    let b = body(&w.res("action=getbalance&json=1").await);
    assert_eq!((b["status"].as_i64(), b["request"].as_str()), (Some(1), Some("12.345")));
    assert_eq!(w.fake.counts().balance_reads, 1, "the second read came from the cache");

    let id = ok_id(
        &w.call(form("/in.php", &format!("key={COMPAT_KEY}&method=turnstile&sitekey=s&pageurl=https://a.example/")))
            .await,
    );
    assert_eq!(text(&w.res(&format!("action=reportbad&id={id}")).await), "OK_REPORT_RECORDED");
    let b = body(&w.res(&format!("action=reportgood&id={id}&json=1")).await);
    assert_eq!(b["request"], "OK_REPORT_RECORDED");
    let c = w.fake.counts();
    assert_eq!((c.reports_bad, c.reports_good), (1, 1));
    assert_eq!(text(&w.res("action=reportbad&id=123456789012345678").await), "ERROR_WRONG_CAPTCHA_ID");
    assert_eq!(w.fake.counts().reports_bad, 1, "an unknown id never reaches CaptchaAI");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runaway_reader_is_slowed_with_a_clear_answer() -> anyhow::Result<()> {
    let w = world(FakeConfig::default()).await?;
    let mut limited = None;
    for n in 0..200 {
        let r = w.res("action=get&id=123456789012345678&json=1").await;
        // Within the budget: the table's answer (an unknown id); over it: "not ready yet".
        if body(&r)["request"] == "CAPCHA_NOT_READY" {
            limited = Some((n, r));
            break;
        }
    }
    let (n, r) = limited.expect("a burst of 200 reads is limited");
    assert!(n >= 59, "the burst allowance is honoured ({n})");
    // HTTP 200 and a code both SDKs poll again on: a 429 or 503 ends their polling with an
    // exception (2captcha-python raises on any status but 200).
    assert_eq!(r.status(), 200);
    let b = body(&r);
    assert_eq!(b["status"], 0);
    assert!(b["error_text"].as_str().is_some_and(|t| t.contains("reads a second")), "{b}");
    // Other actions over the budget are told plainly.
    let r = w.res("action=getbalance").await;
    assert_eq!((r.status().as_u16(), text(&r).as_str()), (429, "ERROR_TOO_MUCH_REQUESTS"));
    assert_eq!(r.headers()["retry-after"], "1");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn in_php_never_pays_twice_an_unknown_outcome_answers_the_id_and_a_ban_is_passed_on_once() -> anyhow::Result<()> {
    use fake_captchaai::AfterAccept;
    let w = world(FakeConfig { after_accept: vec![AfterAccept::Http502], ..FakeConfig::default() }).await?;
    let q = format!("key={COMPAT_KEY}&method=turnstile&sitekey=s&pageurl=https://a.example/");
    // in.php answered 502 after taking the task: the client still gets an id, and its result
    // comes by pingback (or the poller); the relay does not submit it again.
    let id = ok_id(&w.call(form("/in.php", &q)).await);
    assert_eq!(w.fake.counts().in_php, 1);
    let task = w.deps.store.tasks.get(&TaskRef::from_compat_id(&id)?).await?.expect("stored");
    assert!(matches!(task.state, TaskState::Submitting { unknown: Some(_) }), "{:?}", task.state);
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "CAPCHA_NOT_READY");

    // With an Idempotency-Key, the same request is one task and one in.php call.
    let keyed = |body: &str| form("/in.php", body).header("idempotency-key", "order-77");
    let a = ok_id(&w.call(keyed(&q)).await);
    let b = ok_id(&w.call(keyed(&q)).await);
    assert_eq!(a, b);
    assert_eq!(w.fake.counts().in_php, 2);
    let r = w.call(keyed(&format!("{q}&action=other"))).await;
    assert_eq!(text(&r), "ERROR_BAD_PARAMETERS", "the same key with another request");

    // A ban stops traffic and is never retried in the request; the task waits in the queue (the
    // client has its id and polls as usual), and so does the next one: nothing reaches CaptchaAI.
    w.fake.configure(|c| c.submit_errors = vec!["IP_BANNED".into()]);
    let banned = ok_id(&w.call(form("/in.php", &q)).await);
    assert_eq!(w.fake.counts().in_php, 3, "not retried in the request");
    let next = ok_id(&w.call(form("/in.php", &q)).await);
    assert_eq!(w.fake.counts().in_php, 3, "the breaker holds it back");
    for id in [&banned, &next] {
        assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "CAPCHA_NOT_READY");
        let t = w.deps.store.tasks.get(&TaskRef::from_compat_id(id)?).await?.expect("stored");
        assert!(matches!(t.state, TaskState::Queued { .. }), "{:?}", t.state);
    }
    Ok(())
}

/// Runs on the embedded engine, and against moto's DynamoDB in the test command's second-engine
/// pass: moto keeps an item past its TTL, as DynamoDB does until its background deletion — the
/// read must refuse it all the same.
#[tokio::test(flavor = "multi_thread")]
async fn retention_a_task_past_it_is_unknown_to_get_res_php_and_reports_though_the_table_holds_it() -> anyhow::Result<()>
{
    let w = world(FakeConfig::default()).await?;
    let k = COMPAT_KEY;
    let id = ok_id(
        &w.call(form("/in.php", &format!("key={k}&method=turnstile&sitekey=s&pageurl=https://a.example/"))).await,
    );
    w.solve(&id, "tok-kept-7-days").await;
    let r = TaskRef::from_compat_id(&id)?;
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "OK|tok-kept-7-days");
    // 8 days on (RETENTION_DAYS is 7): the item is still in the table, no read hands it out.
    w.clock.advance(Duration::from_secs(8 * 86_400));
    assert!(w.deps.store.tasks.get(&r).await?.is_some(), "the table still holds it");
    assert_eq!(text(&w.res(&format!("action=get&id={id}")).await), "ERROR_WRONG_CAPTCHA_ID");
    assert_eq!(text(&w.res(&format!("action=get&ids={id}")).await), "ERROR_WRONG_CAPTCHA_ID");
    assert_eq!(text(&w.res(&format!("action=reportbad&id={id}")).await), "ERROR_WRONG_CAPTCHA_ID");
    let get = w
        .call(ApiGatewayEvent::new("GET", &format!("/tasks/{r}")).header("authorization", &format!("Bearer {KEY}")))
        .await;
    assert_eq!(get.status(), 404, "{}", text(&get));
    Ok(())
}

//! End to end over real HTTP: submit through the API handler → the fake CaptchaAI solves and
//! calls the callback handler → `GET /tasks/{ref}` returns the solution. The store is the
//! embedded DynamoDB engine; everything listens on loopback.

use std::sync::Arc;
use std::time::Duration;

use fake_captchaai::{CallbackMode, FakeCaptchaAi, FakeConfig};
use relay_local::{LocalParts, Relay};
use relay_shared::captchaai::CaptchaAiClient;
use relay_shared::testkit::LocalDynamo;
use relay_shared::time::SystemClock;
use secrecy::SecretString;

const KEY: &str = "e2e-api-key";

struct Running {
    _db: LocalDynamo,
    fake: FakeCaptchaAi,
    base: String,
    http: reqwest::Client,
    _stop: tokio::sync::oneshot::Sender<()>,
}

async fn start(cfg: FakeConfig) -> anyhow::Result<Running> {
    let db = LocalDynamo::start().await?;
    let fake = FakeCaptchaAi::start(cfg).await?;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let base = format!("http://{}", listener.local_addr()?);
    let relay = Arc::new(Relay::new(LocalParts {
        store: db.fresh_store().await?,
        captchaai: CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            Duration::from_secs(5),
            None,
        )?,
        api_key: SecretString::from(KEY.to_owned()),
        signing_secret: SecretString::from("e2e-signing".to_owned()),
        callback_base_url: base.clone(),
        clock: Arc::new(SystemClock),
        dead_letters: Arc::new(relay_shared::testkit::MemorySink::default()),
        delivery_policy: relay_shared::webhook::UrlPolicy::PublicHttps,
    }));
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(relay_local::serve(listener, relay, async move {
        let _ = rx.await;
    }));
    Ok(Running { _db: db, fake, base, http: reqwest::Client::new(), _stop: tx })
}

impl Running {
    async fn submit(&self, body: &str) -> anyhow::Result<serde_json::Value> {
        let resp = self
            .http
            .post(format!("{}/tasks", self.base))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await?;
        anyhow::ensure!(resp.status() == 202, "submit answered {}", resp.status());
        Ok(resp.json().await?)
    }

    async fn get(&self, task_ref: &str) -> anyhow::Result<serde_json::Value> {
        Ok(self.http.get(format!("{}/tasks/{task_ref}", self.base)).bearer_auth(KEY).send().await?.json().await?)
    }

    /// The pingback statuses the fake saw for a task, once its planned pingbacks are all sent.
    async fn fake_statuses_settled(&self, captcha_id: &str) -> Vec<u16> {
        for _ in 0..200 {
            if let Some(t) = self.fake.task(captcha_id)
                && t.settled()
            {
                return t.callback_statuses;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        self.fake.task(captcha_id).map(|t| t.callback_statuses).unwrap_or_default()
    }

    async fn wait_final(&self, task_ref: &str) -> anyhow::Result<serde_json::Value> {
        for _ in 0..200 {
            let v = self.get(task_ref).await?;
            if v["status"] != "pending" && v["status"] != "submitting" {
                return Ok(v);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        anyhow::bail!("task {task_ref} never finished")
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn submit_then_pingback_then_read_the_solution_get_and_post() -> anyhow::Result<()> {
    for mode in [CallbackMode::Get, CallbackMode::Post] {
        let r = start(FakeConfig { solve_delay_ms: 30, callback_mode: mode, ..FakeConfig::default() }).await?;
        let mut refs = Vec::new();
        for body in [
            r#"{"kind":"turnstile","sitekey":"0x4AAA","pageurl":"https://shop.example/login"}"#,
            r#"{"kind":"recaptcha_v2","sitekey":"6Le","pageurl":"https://shop.example/login"}"#,
            r#"{"kind":"image","body":"iVBORw0KGgo="}"#,
        ] {
            let accepted = r.submit(body).await?;
            // Sent at once, or queued for a thread: either way the task is the relay's.
            assert!(matches!(accepted["status"].as_str(), Some("pending" | "queued")), "{accepted}");
            refs.push(accepted["task_ref"].as_str().unwrap_or_default().to_owned());
        }
        for task_ref in refs {
            let done = r.wait_final(&task_ref).await?;
            let captcha_id = done["captcha_id"].as_str().unwrap_or_default().to_owned();
            let fake_answer = r.fake.task(&captcha_id).and_then(|t| t.answer).expect("the fake solved it");
            assert_eq!(done["status"], "solved", "{mode:?}: {done}");
            assert_eq!(done["solution"].as_str(), Some(fake_answer.as_str()), "the solution the fake produced");
            assert_eq!(done["resolved_via"], "callback");
            // The fake notes the status once it has read the answer, a moment after the write.
            let statuses = r.fake_statuses_settled(&captcha_id).await;
            assert_eq!(statuses, vec![200], "the pingback was answered 200");
        }
        assert_eq!(r.fake.counts().res_php, 0, "the callback path needs no res.php reads");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn duplicated_pingbacks_over_http_are_absorbed() -> anyhow::Result<()> {
    let r = start(FakeConfig { solve_delay_ms: 20, duplicate_callbacks: 1.0, ..FakeConfig::default() }).await?;
    let accepted = r.submit(r#"{"kind":"turnstile","sitekey":"s","pageurl":"https://a.example"}"#).await?;
    let id = accepted["captcha_id"].as_str().unwrap_or_default().to_owned();
    let done = r.wait_final(accepted["task_ref"].as_str().unwrap_or_default()).await?;
    assert_eq!(done["status"], "solved");
    for _ in 0..100 {
        if r.fake.counts().callbacks_sent == 2 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(r.fake.task(&id).map(|t| t.callback_statuses), Some(vec![200, 200]), "both deliveries got 200");
    // A forged delivery with a different answer is a conflict: 200, first result stays.
    assert_eq!(r.fake.deliver(&id, "forged-token").await?, 200);
    let after = r.get(accepted["task_ref"].as_str().unwrap_or_default()).await?;
    assert_eq!(after["solution"], done["solution"]);
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn health_answers() -> anyhow::Result<()> {
    let r = start(FakeConfig::default()).await?;
    assert_eq!(r.http.get(format!("{}/health", r.base)).send().await?.text().await?, "ok");
    Ok(())
}

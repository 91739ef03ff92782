//! Helpers for the tests: request and event builders, operation counters, dead-letter sinks,
//! an SQS peer, and — re-exported from [`crate::local`], which local mode runs on — the
//! embedded DynamoDB engine, its fault injector and the owner receiver.
//!
//! Set `RELAY_TEST_DYNAMODB_ENDPOINT` (e.g. a moto server) to run the same tests against
//! another engine instead.

use std::time::Duration;

use aws_sdk_dynamodb::Client;

use crate::local::config_for;
pub use crate::local::{FlakyDynamo, LocalDynamo, client_for, http_client as test_http_client, receiver};

/// What CaptchaAI was sent, per task of ours: the in.php calls it took, counted by the task
/// reference their pingback path names (`…/callback/<ref>/<signature>`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sends {
    /// Tasks sent a second time because they were stranded (their first submit's outcome lost)
    /// and overdue: the relay's one allowed extra in.php (`Task::resent_at` set).
    pub resent: usize,
    /// Tasks sent more than once without that cause, or more than twice: must be none.
    pub without_cause: usize,
}

/// Counts [`Sends`] from the pingback URLs of every task CaptchaAI took.
pub async fn sends<'a>(
    store: &crate::store::TaskStore,
    pingbacks: impl Iterator<Item = &'a str>,
) -> Result<Sends, crate::store::StoreError> {
    let mut per_ref: std::collections::HashMap<&str, usize> = std::collections::HashMap::new();
    for p in pingbacks {
        *per_ref.entry(p.split('/').rev().nth(1).unwrap_or_default()).or_default() += 1;
    }
    let mut s = Sends::default();
    for (r, n) in per_ref.into_iter().filter(|(_, n)| *n > 1) {
        let resent = match crate::domain::TaskRef::parse(r) {
            Ok(r) => store.tasks().get(&r).await?.is_some_and(|t| t.resent_at.is_some()),
            Err(_) => false,
        };
        if n == 2 && resent {
            s.resent += 1;
        } else {
            s.without_cause += 1;
        }
    }
    Ok(s)
}

/// A valid `POST /tasks` body for each kind, as the simulations and the end-to-end run send it.
pub fn body_for(kind: crate::domain::CaptchaKind) -> &'static str {
    match kind {
        crate::domain::CaptchaKind::RecaptchaV2 => {
            r#"{"kind":"recaptcha_v2","sitekey":"6Le-sim","pageurl":"https://shop.example/login"}"#
        }
        crate::domain::CaptchaKind::RecaptchaV3 => {
            r#"{"kind":"recaptcha_v3","sitekey":"6Le-sim","pageurl":"https://shop.example/login","action":"login"}"#
        }
        crate::domain::CaptchaKind::RecaptchaEnterprise => {
            r#"{"kind":"recaptcha_enterprise","sitekey":"6Le-sim","pageurl":"https://shop.example/login"}"#
        }
        crate::domain::CaptchaKind::Hcaptcha => {
            r#"{"kind":"hcaptcha","sitekey":"10000000-ffff","pageurl":"https://shop.example/login"}"#
        }
        crate::domain::CaptchaKind::Turnstile => {
            r#"{"kind":"turnstile","sitekey":"0x4AAA","pageurl":"https://shop.example/login"}"#
        }
        crate::domain::CaptchaKind::Image => {
            r#"{"kind":"image","body":"iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg=="}"#
        }
        crate::domain::CaptchaKind::Geetest => {
            r#"{"kind":"geetest","gt":"81388ea1fc187e0c335c0a8907ff2625","challenge":"2e2f0f65240058b683cb6ea21c303eea","pageurl":"https://shop.example/login"}"#
        }
        crate::domain::CaptchaKind::CloudflareChallenge => {
            r#"{"kind":"cloudflare_challenge","pageurl":"https://shop.example/login","browser":{"proxy":"user:pass@203.0.113.7:3128","proxytype":"HTTP"}}"#
        }
        crate::domain::CaptchaKind::Bls => {
            r#"{"kind":"bls","instructions":"664","images":["iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo=","iVBORw0KGgo="]}"#
        }
    }
}

/// Counts the DynamoDB operations a client sends, by name (`Query`, `Scan`, `UpdateItem`…),
/// so tests can assert what the code under test asked of the table.
#[derive(Debug, Clone, Default)]
pub struct OperationCounter(std::sync::Arc<std::sync::Mutex<std::collections::HashMap<String, u64>>>);

impl OperationCounter {
    /// How many times `operation` was sent.
    pub fn count(&self, operation: &str) -> u64 {
        self.0.lock().map(|m| m.get(operation).copied().unwrap_or(0)).unwrap_or(0)
    }

    /// Every operation's count so far.
    pub fn snapshot(&self) -> std::collections::HashMap<String, u64> {
        self.0.lock().map(|m| m.clone()).unwrap_or_default()
    }
}

impl aws_sdk_dynamodb::config::Intercept for OperationCounter {
    fn name(&self) -> &'static str {
        "OperationCounter"
    }

    fn read_before_transmit(
        &self,
        ctx: &aws_sdk_dynamodb::config::interceptors::BeforeTransmitInterceptorContextRef<'_>,
        _rc: &aws_sdk_dynamodb::config::RuntimeComponents,
        _cfg: &mut aws_sdk_dynamodb::config::ConfigBag,
    ) -> Result<(), aws_sdk_dynamodb::error::BoxError> {
        // DynamoDB names the operation in `X-Amz-Target: DynamoDB_20120810.<Operation>`.
        let target = ctx.request().headers().get("x-amz-target").unwrap_or_default();
        if let Some((_, op)) = target.split_once('.')
            && let Ok(mut m) = self.0.lock()
        {
            *m.entry(op.to_owned()).or_default() += 1;
        }
        Ok(())
    }
}

impl LocalDynamo {
    /// A client that counts the operations it sends.
    pub fn counting_client(&self) -> (Client, OperationCounter) {
        counting_client_for(&self.endpoint)
    }
}

/// A client for `endpoint` (the engine, or a proxy in front of it) that counts the operations it
/// sends.
pub fn counting_client_for(endpoint: &str) -> (Client, OperationCounter) {
    let counter = OperationCounter::default();
    (Client::from_conf(config_for(endpoint).interceptor(counter.clone()).build()), counter)
}

/// Builds a Lambda HTTP request from a real API Gateway v2 (HTTP API) event, as the runtime
/// would hand it to a handler.
pub struct ApiGatewayEvent {
    event: serde_json::Value,
}

impl ApiGatewayEvent {
    const FIXTURE: &'static str = include_str!("../fixtures/apigw-v2-request.json");

    pub fn new(method: &str, path: &str) -> Self {
        let mut event: serde_json::Value = serde_json::from_str(Self::FIXTURE).unwrap_or_default();
        event["rawPath"] = path.into();
        event["requestContext"]["http"]["method"] = method.into();
        event["requestContext"]["http"]["path"] = path.into();
        Self { event }
    }

    pub fn query(mut self, q: &str) -> Self {
        self.event["rawQueryString"] = q.into();
        self
    }

    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.event["headers"][name] = value.into();
        self
    }

    pub fn body(mut self, body: &str) -> Self {
        self.event["body"] = body.into();
        self.event["headers"]["content-length"] = body.len().to_string().into();
        self
    }

    /// A binary body, given base64-encoded, as API Gateway passes one (`isBase64Encoded`).
    pub fn body_base64(mut self, b64: &str, decoded_len: usize) -> Self {
        self.event["body"] = b64.into();
        self.event["isBase64Encoded"] = true.into();
        self.event["headers"]["content-length"] = decoded_len.to_string().into();
        self
    }

    /// Marks the request as signed with SigV4 and checked by API Gateway (IAM authorisation).
    pub fn iam_caller(mut self) -> Self {
        self.event["requestContext"]["authorizer"] = serde_json::json!({
            "iam": { "accessKey": "AKIAEXAMPLE", "accountId": "123456789012", "callerId": "AIDAEXAMPLE",
                     "principalOrgId": null, "userArn": "arn:aws:iam::123456789012:user/ops", "userId": "AIDAEXAMPLE" }
        });
        self
    }

    /// The event as API Gateway sends it to the Lambda Runtime API.
    pub fn to_json(&self) -> String {
        self.event.to_string()
    }

    pub fn build(self) -> lambda_http::Request {
        lambda_http::request::from_str(&self.event.to_string()).unwrap_or_default()
    }
}

/// A dead-letter sink that fails while told to (a queue outage), in front of a real one.
#[derive(Debug, Clone)]
pub struct FailingSink {
    pub inner: std::sync::Arc<dyn crate::deadletter::DeadLetterSink>,
    pub fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl FailingSink {
    pub fn new(inner: std::sync::Arc<dyn crate::deadletter::DeadLetterSink>) -> Self {
        Self { inner, fail: std::sync::Arc::default() }
    }
}

#[async_trait::async_trait]
impl crate::deadletter::DeadLetterSink for FailingSink {
    async fn send(&self, letter: &crate::deadletter::DeadLetter) -> Result<(), crate::deadletter::QueueError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(crate::deadletter::QueueError("injected queue outage".into()));
        }
        self.inner.send(letter).await
    }
}

/// SQS from a moto server on loopback: the one `RELAY_TEST_SQS_ENDPOINT` names (`infra/test.sh`
/// starts one and exports it), or else one this test process starts for itself, once, from the
/// repo's pinned `.venv` (installed by `infra/tools.sh moto` on first use). So plain
/// `cargo test` needs nothing started by hand.
pub struct LocalSqs {
    pub endpoint: String,
}

/// The moto server this process started, shared by all its tests.
static MOTO: std::sync::OnceLock<Result<String, String>> = std::sync::OnceLock::new();

impl LocalSqs {
    pub fn from_env() -> anyhow::Result<Self> {
        if let Ok(endpoint) = std::env::var("RELAY_TEST_SQS_ENDPOINT") {
            return Ok(Self { endpoint });
        }
        let endpoint = MOTO.get_or_init(|| start_moto().map_err(|e| format!("{e:#}"))).clone();
        endpoint.map(|endpoint| Self { endpoint }).map_err(|e| anyhow::anyhow!("could not start moto: {e}"))
    }
    pub fn client(&self) -> aws_sdk_sqs::Client {
        sqs_client_for(&self.endpoint)
    }

    /// A store over a new table on moto's DynamoDB (the same server): the store's tests on the
    /// second engine, which refuses what the embedded one may let pass.
    pub async fn fresh_store(&self, prefix: &str) -> anyhow::Result<crate::store::TaskStore> {
        let table = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
        let client = client_for(&self.endpoint);
        crate::store::schema::create_table(&client, &table).await?;
        Ok(crate::store::TaskStore::new(client, table, std::time::Duration::from_secs(86_400)))
    }

    /// A fresh dead-letter queue and its poison queue, wired with a redrive policy.
    pub async fn queue_pair(
        &self,
        max_receive_count: u32,
        visibility_secs: u32,
    ) -> anyhow::Result<(crate::deadletter::SqsQueue, crate::deadletter::SqsQueue)> {
        use aws_sdk_sqs::types::QueueAttributeName as A;
        let client = self.client();
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let poison = client.create_queue().queue_name(format!("poison-{suffix}")).send().await?;
        let poison_url = poison.queue_url.ok_or_else(|| anyhow::anyhow!("no poison queue url"))?;
        let poison_arn = client
            .get_queue_attributes()
            .queue_url(&poison_url)
            .attribute_names(A::QueueArn)
            .send()
            .await?
            .attributes
            .and_then(|a| a.get(&A::QueueArn).cloned())
            .ok_or_else(|| anyhow::anyhow!("no poison queue arn"))?;
        let dlq = client
            .create_queue()
            .queue_name(format!("dead-letters-{suffix}"))
            .attributes(A::VisibilityTimeout, visibility_secs.to_string())
            .attributes(
                A::RedrivePolicy,
                serde_json::json!({ "deadLetterTargetArn": poison_arn, "maxReceiveCount": max_receive_count })
                    .to_string(),
            )
            .send()
            .await?;
        let dlq_url = dlq.queue_url.ok_or_else(|| anyhow::anyhow!("no queue url"))?;
        Ok((
            crate::deadletter::SqsQueue::new(client.clone(), dlq_url),
            crate::deadletter::SqsQueue::new(client, poison_url),
        ))
    }
}

/// Installs moto into the repo's `.venv` if needed (pinned, `infra/tools.sh moto`), starts it on a
/// free loopback port under a watchdog that stops it when this process ends, and waits until it
/// answers. Blocking: called once per process.
fn start_moto() -> anyhow::Result<String> {
    use anyhow::Context;
    use std::process::{Command, Stdio};
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let tools = root.join("infra/tools.sh");
    let status =
        Command::new("bash").arg(&tools).arg("moto").stdout(Stdio::null()).status().context("infra/tools.sh")?;
    anyhow::ensure!(status.success(), "infra/tools.sh moto failed ({status})");
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let moto = root.join(".venv/bin/moto_server");
    // The watchdog shell outlives nothing: it stops moto once this process is gone.
    let script = format!(
        "{moto} -H 127.0.0.1 -p {port} >/dev/null 2>&1 & m=$!; \
         while kill -0 {parent} 2>/dev/null && kill -0 $m 2>/dev/null; do sleep 1; done; kill $m 2>/dev/null",
        moto = moto.display(),
        parent = std::process::id()
    );
    Command::new("sh")
        .arg("-c")
        .arg(script)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .context("starting moto_server")?;
    let endpoint = format!("http://127.0.0.1:{port}");
    let until = std::time::Instant::now() + Duration::from_secs(60);
    while std::time::Instant::now() < until {
        if moto_answers(port) {
            return Ok(endpoint);
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    anyhow::bail!("moto_server did not listen on {endpoint} within 60 s")
}

/// Whether moto answers an HTTP request yet (it listens a moment before it serves).
fn moto_answers(port: u16) -> bool {
    use std::io::{Read, Write};
    let Ok(mut conn) = std::net::TcpStream::connect(("127.0.0.1", port)) else { return false };
    let _ = conn.set_read_timeout(Some(Duration::from_secs(2)));
    let mut head = [0u8; 12];
    conn.write_all(b"GET /moto-api/ HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n").is_ok()
        && conn.read_exact(&mut head).is_ok()
        && head.starts_with(b"HTTP/1.")
}

/// An SQS client for a local endpoint with dummy credentials.
pub fn sqs_client_for(endpoint: &str) -> aws_sdk_sqs::Client {
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_sqs::config::Credentials::new("test", "test", None, None, "relay-testkit"))
        .endpoint_url(endpoint)
        .http_client(test_http_client())
        .build();
    aws_sdk_sqs::Client::from_conf(conf)
}

/// A dead-letter sink that keeps letters in memory, for tests that are not about the queue.
/// `fail` makes every send fail, as an unreachable queue would.
#[derive(Debug, Default, Clone)]
pub struct MemorySink {
    pub letters: std::sync::Arc<std::sync::Mutex<Vec<crate::deadletter::DeadLetter>>>,
    pub fail: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl MemorySink {
    pub fn taken(&self) -> Vec<crate::deadletter::DeadLetter> {
        self.letters.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

#[async_trait::async_trait]
impl crate::deadletter::DeadLetterSink for MemorySink {
    async fn send(&self, letter: &crate::deadletter::DeadLetter) -> Result<(), crate::deadletter::QueueError> {
        if self.fail.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(crate::deadletter::QueueError("injected queue failure".into()));
        }
        self.letters.lock().map_err(|_| crate::deadletter::QueueError("poisoned".into()))?.push(letter.clone());
        Ok(())
    }
}

/// The event Lambda's SQS event source would hand the redrive function for these messages.
pub fn sqs_event(queue_arn: &str, messages: &[crate::deadletter::Received]) -> serde_json::Value {
    let records: Vec<serde_json::Value> = messages
        .iter()
        .map(|m| {
            serde_json::json!({
                "messageId": m.message_id,
                "receiptHandle": m.receipt_handle,
                "body": m.body,
                "attributes": {
                    "ApproximateReceiveCount": m.receive_count.to_string(),
                    "SentTimestamp": "1796210146000",
                    "SenderId": "AIDAEXAMPLE",
                    "ApproximateFirstReceiveTimestamp": "1796210146001"
                },
                "messageAttributes": {},
                "md5OfBody": "",
                "eventSource": "aws:sqs",
                "eventSourceARN": queue_arn,
                "awsRegion": "us-east-1"
            })
        })
        .collect();
    serde_json::json!({ "Records": records })
}

//! A real DynamoDB peer on loopback for tests and local mode: the embedded `dynoxide` engine
//! served over HTTP, reached through the ordinary AWS SDK client, so the store code under test
//! is byte for byte the code that talks to AWS.
//!
//! Set `RELAY_TEST_DYNAMODB_ENDPOINT` (e.g. a moto server) to run the same tests against
//! another engine instead.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};

use crate::store::{TaskStore, schema};

/// A running engine. Dropping it stops the embedded server.
pub struct LocalDynamo {
    pub endpoint: String,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for LocalDynamo {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

impl LocalDynamo {
    /// Starts an in-memory engine on 127.0.0.1 (a free port), or uses
    /// `RELAY_TEST_DYNAMODB_ENDPOINT` when it is set.
    pub async fn start() -> anyhow::Result<Self> {
        if let Ok(endpoint) = std::env::var("RELAY_TEST_DYNAMODB_ENDPOINT") {
            return Ok(Self { endpoint, shutdown: None });
        }
        Self::serve(dynoxide::Database::memory()?).await
    }

    /// Starts an engine persisted to a SQLite file.
    pub async fn start_at(path: &std::path::Path) -> anyhow::Result<Self> {
        let path = path.to_str().ok_or_else(|| anyhow::anyhow!("data path is not UTF-8"))?;
        Self::serve(dynoxide::Database::new(path)?).await
    }

    async fn serve(db: dynoxide::Database) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = dynoxide::server::serve_with_shutdown(listener, db, async move {
                let _ = rx.await;
            })
            .await;
        });
        Ok(Self { endpoint, shutdown: Some(tx) })
    }

    pub fn client(&self) -> Client {
        client_for(&self.endpoint)
    }

    /// A store over a new, uniquely named table.
    pub async fn fresh_store(&self) -> anyhow::Result<TaskStore> {
        let table = format!("tasks-{}", uuid::Uuid::new_v4().simple());
        let client = self.client();
        schema::create_table(&client, &table).await?;
        Ok(TaskStore::new(client, table, Duration::from_secs(7 * 86_400)))
    }
}

/// An SDK client for a local endpoint with dummy credentials.
pub fn client_for(endpoint: &str) -> Client {
    Client::from_conf(config_for(endpoint).build())
}

fn config_for(endpoint: &str) -> aws_sdk_dynamodb::config::Builder {
    aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "relay-testkit"))
        .endpoint_url(endpoint)
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
        let counter = OperationCounter::default();
        (Client::from_conf(config_for(&self.endpoint).interceptor(counter.clone()).build()), counter)
    }
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

    /// Marks the request as signed with SigV4 and checked by API Gateway (IAM authorisation).
    pub fn iam_caller(mut self) -> Self {
        self.event["requestContext"]["authorizer"] = serde_json::json!({
            "iam": { "accessKey": "AKIAEXAMPLE", "accountId": "123456789012", "callerId": "AIDAEXAMPLE",
                     "principalOrgId": null, "userArn": "arn:aws:iam::123456789012:user/ops", "userId": "AIDAEXAMPLE" }
        });
        self
    }

    pub fn build(self) -> lambda_http::Request {
        lambda_http::request::from_str(&self.event.to_string()).unwrap_or_default()
    }
}

/// A DynamoDB endpoint in front of a real engine that fails on demand: while `fail` is on,
/// every call answers HTTP 500 `InternalServerError` (so the SDK retries, then gives up),
/// exactly as a struggling DynamoDB would. The failure reaches the real handler code.
pub struct FlakyDynamo {
    pub endpoint: String,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    matching: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    calls_failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for FlakyDynamo {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

#[derive(Clone)]
struct FlakyState {
    target: String,
    http: reqwest::Client,
    failing: std::sync::Arc<std::sync::atomic::AtomicBool>,
    matching: std::sync::Arc<std::sync::Mutex<Option<String>>>,
    calls_failed: std::sync::Arc<std::sync::atomic::AtomicU64>,
}

async fn flaky_forward(
    axum::extract::State(st): axum::extract::State<FlakyState>,
    req: http::Request<axum::body::Body>,
) -> http::Response<axum::body::Body> {
    use std::sync::atomic::Ordering;
    let fail = || {
        http::Response::builder()
            .status(500)
            .header("content-type", "application/x-amz-json-1.0")
            .body(axum::body::Body::from(
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"injected fault"}"#,
            ))
            .unwrap_or_default()
    };
    if st.failing.load(Ordering::SeqCst) {
        st.calls_failed.fetch_add(1, Ordering::SeqCst);
        return fail();
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 16 * 1024 * 1024).await else { return fail() };
    let matched = st
        .matching
        .lock()
        .ok()
        .and_then(|m| m.clone())
        .is_some_and(|needle| String::from_utf8_lossy(&bytes).contains(&needle));
    if matched {
        st.calls_failed.fetch_add(1, Ordering::SeqCst);
        return fail();
    }
    let mut fwd = st.http.request(parts.method, format!("{}{}", st.target, parts.uri.path()));
    for (k, v) in &parts.headers {
        if k != http::header::HOST && k != http::header::CONTENT_LENGTH {
            fwd = fwd.header(k, v);
        }
    }
    let Ok(resp) = fwd.body(bytes).send().await else { return fail() };
    let mut out = http::Response::builder().status(resp.status().as_u16());
    for (k, v) in resp.headers() {
        if k != http::header::CONTENT_LENGTH && k != http::header::TRANSFER_ENCODING {
            out = out.header(k, v);
        }
    }
    let body = resp.bytes().await.unwrap_or_default();
    out.body(axum::body::Body::from(body)).unwrap_or_default()
}

impl FlakyDynamo {
    /// Fronts `target` (e.g. a [`LocalDynamo`] endpoint), healthy at first.
    pub async fn start(target: &str) -> anyhow::Result<Self> {
        let failing = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let calls_failed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
        let matching = std::sync::Arc::new(std::sync::Mutex::new(None));
        let st = FlakyState {
            matching: matching.clone(),
            target: target.trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
            failing: failing.clone(),
            calls_failed: calls_failed.clone(),
        };
        let app = axum::Router::new().fallback(flaky_forward).with_state(st);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let endpoint = format!("http://{}", listener.local_addr()?);
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        Ok(Self { endpoint, failing, matching, calls_failed, shutdown: Some(tx) })
    }

    pub fn set_failing(&self, on: bool) {
        self.failing.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Fails only the calls whose request body contains `needle` (e.g. `":solution"`: the
    /// writes of results), or stops doing so with `None`.
    pub fn set_failing_matching(&self, needle: Option<&str>) {
        if let Ok(mut m) = self.matching.lock() {
            *m = needle.map(str::to_owned);
        }
    }

    /// Calls answered with an injected fault so far.
    pub fn calls_failed(&self) -> u64 {
        self.calls_failed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// A store on `table` reached through this endpoint.
    pub fn store(&self, table: &str) -> TaskStore {
        TaskStore::new(client_for(&self.endpoint), table, Duration::from_secs(7 * 86_400))
    }
}

/// SQS from a moto server on loopback. `infra/test.sh` starts one and exports
/// `RELAY_TEST_SQS_ENDPOINT`; without it the SQS tests fail and say so.
pub struct LocalSqs {
    pub endpoint: String,
}

impl LocalSqs {
    pub fn from_env() -> anyhow::Result<Self> {
        let endpoint = std::env::var("RELAY_TEST_SQS_ENDPOINT").map_err(|_| {
            anyhow::anyhow!("RELAY_TEST_SQS_ENDPOINT is not set: run the tests with infra/test.sh, which starts moto")
        })?;
        Ok(Self { endpoint })
    }

    pub fn client(&self) -> aws_sdk_sqs::Client {
        sqs_client_for(&self.endpoint)
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

/// An SQS client for a local endpoint with dummy credentials.
pub fn sqs_client_for(endpoint: &str) -> aws_sdk_sqs::Client {
    let conf = aws_sdk_sqs::Config::builder()
        .behavior_version(aws_sdk_sqs::config::BehaviorVersion::latest())
        .region(aws_sdk_sqs::config::Region::new("us-east-1"))
        .credentials_provider(aws_sdk_sqs::config::Credentials::new("test", "test", None, None, "relay-testkit"))
        .endpoint_url(endpoint)
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

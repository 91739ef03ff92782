//! What local mode runs on: the embedded DynamoDB engine (`dynoxide`) served over HTTP on
//! loopback and reached through the ordinary AWS SDK client — so the store code local mode runs
//! is byte for byte the code that talks to AWS — plus what its demo needs: a fault injector in
//! front of the engine and an owner receiver for pushes. The tests use the same pieces
//! (`crate::testkit` re-exports them).
//!
//! Set `RELAY_TEST_DYNAMODB_ENDPOINT` (e.g. a moto server) to run the tests against another
//! engine instead.

use std::time::Duration;

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::config::{BehaviorVersion, Credentials, Region};

use crate::store::{TaskStore, schema};

pub mod receiver;

/// Stops a server on loopback when dropped (its graceful shutdown is told once).
#[derive(Debug, Default)]
pub struct StopOnDrop(Option<tokio::sync::oneshot::Sender<()>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        if let Some(tx) = self.0.take() {
            let _ = tx.send(());
        }
    }
}

impl StopOnDrop {
    /// A guard and the signal it sends when dropped.
    fn pair() -> (Self, impl std::future::Future<Output = ()> + Send + 'static) {
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        (Self(Some(tx)), async move {
            let _ = rx.await;
        })
    }
}

/// Serves `app` on 127.0.0.1 (a free port): its `http://` endpoint, and the guard that stops it.
pub async fn serve_on_loopback(app: axum::Router) -> anyhow::Result<(String, StopOnDrop)> {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    let (guard, stopped) = StopOnDrop::pair();
    tokio::spawn(async move {
        let _ = axum::serve(listener, app).with_graceful_shutdown(stopped).await;
    });
    Ok((endpoint, guard))
}

/// A running engine. Dropping it stops the embedded server.
pub struct LocalDynamo {
    pub endpoint: String,
    _server: StopOnDrop,
}

impl LocalDynamo {
    /// Starts an in-memory engine on 127.0.0.1 (a free port), or uses
    /// `RELAY_TEST_DYNAMODB_ENDPOINT` when it is set.
    pub async fn start() -> anyhow::Result<Self> {
        if let Ok(endpoint) = std::env::var("RELAY_TEST_DYNAMODB_ENDPOINT") {
            return Ok(Self { endpoint, _server: StopOnDrop::default() });
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
        let (guard, stopped) = StopOnDrop::pair();
        tokio::spawn(async move {
            let _ = dynoxide::server::serve_with_shutdown(listener, db, stopped).await;
        });
        Ok(Self { endpoint, _server: guard })
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

pub(crate) fn config_for(endpoint: &str) -> aws_sdk_dynamodb::config::Builder {
    aws_sdk_dynamodb::Config::builder()
        .behavior_version(BehaviorVersion::latest())
        .region(Region::new("us-east-1"))
        .credentials_provider(Credentials::new("test", "test", None, None, "relay-local"))
        .endpoint_url(endpoint)
        .http_client(http_client())
}

/// The functions' HTTP client (the SDK crates are built without a default one).
pub fn http_client() -> aws_smithy_runtime_api::client::http::SharedHttpClient {
    crate::aws_http_client().expect("the embedded AWS roots parse")
}

/// An AWS endpoint (DynamoDB, or SQS) in front of a real engine that fails on demand: while
/// `fail` is on, every call answers HTTP 500 `InternalServerError` (so the SDK retries, then
/// gives up), exactly as a struggling service would; a share of writes can fail at random; and
/// it watches the result writes that succeed, as an outside observer of "applied exactly once".
/// The failures reach the real handler code.
pub struct FlakyDynamo {
    pub endpoint: String,
    st: std::sync::Arc<FlakyShared>,
    _server: StopOnDrop,
}

#[derive(Default)]
struct FlakyShared {
    failing: std::sync::atomic::AtomicBool,
    matching: std::sync::Mutex<Option<String>>,
    calls_failed: std::sync::atomic::AtomicU64,
    /// Writes (PutItem, UpdateItem, DeleteItem) failed at random, in parts per million.
    write_failure_ppm: std::sync::atomic::AtomicU64,
    seq: std::sync::atomic::AtomicU64,
    /// Successful writes of a result (the task became solved or failed), by task reference.
    applied: std::sync::Mutex<std::collections::HashMap<String, u32>>,
}

#[derive(Clone)]
struct FlakyState {
    target: String,
    http: reqwest::Client,
    shared: std::sync::Arc<FlakyShared>,
}

/// splitmix64, for the random failures.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

async fn flaky_forward(
    axum::extract::State(st): axum::extract::State<FlakyState>,
    req: http::Request<axum::body::Body>,
) -> http::Response<axum::body::Body> {
    use std::sync::atomic::Ordering;
    let sh = &st.shared;
    let fail = || {
        sh.calls_failed.fetch_add(1, Ordering::SeqCst);
        http::Response::builder()
            .status(500)
            .header("content-type", "application/x-amz-json-1.0")
            .body(axum::body::Body::from(
                r#"{"__type":"com.amazonaws.dynamodb.v20120810#InternalServerError","message":"injected fault"}"#,
            ))
            .unwrap_or_default()
    };
    if sh.failing.load(Ordering::SeqCst) {
        return fail();
    }
    let (parts, body) = req.into_parts();
    let Ok(bytes) = axum::body::to_bytes(body, 16 * 1024 * 1024).await else { return fail() };
    let matched = sh
        .matching
        .lock()
        .ok()
        .and_then(|m| m.clone())
        .is_some_and(|needle| String::from_utf8_lossy(&bytes).contains(&needle));
    if matched {
        return fail();
    }
    let target = parts.headers.get("x-amz-target").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    let is_write = ["PutItem", "UpdateItem", "DeleteItem"].iter().any(|op| target.ends_with(op));
    let ppm = sh.write_failure_ppm.load(Ordering::SeqCst);
    if is_write && ppm > 0 && mix(sh.seq.fetch_add(1, Ordering::SeqCst)) % 1_000_000 < ppm {
        return fail();
    }
    let mut fwd = st.http.request(parts.method, format!("{}{}", st.target, parts.uri));
    for (k, v) in &parts.headers {
        if k != http::header::HOST && k != http::header::CONTENT_LENGTH {
            fwd = fwd.header(k, v);
        }
    }
    let Ok(resp) = fwd.body(bytes.clone()).send().await else { return fail() };
    let status = resp.status().as_u16();
    let mut out = http::Response::builder().status(status);
    for (k, v) in resp.headers() {
        if k != http::header::CONTENT_LENGTH && k != http::header::TRANSFER_ENCODING {
            out = out.header(k, v);
        }
    }
    let body = resp.bytes().await.unwrap_or_default();
    if status == 200 && target.ends_with("UpdateItem") {
        note_applied_result(sh, &bytes);
    }
    out.body(axum::body::Body::from(body)).unwrap_or_default()
}

/// Counts a successful UpdateItem that made a task solved or failed (the result writes), by
/// task, result and receipt time: the same delivery applied twice shows 2. (A result written
/// again with an earlier receipt time, or replaced by an earlier-received one, is another key.)
fn note_applied_result(sh: &FlakyShared, request: &[u8]) {
    let Ok(v) = serde_json::from_slice::<serde_json::Value>(request) else { return };
    let expr = v["UpdateExpression"].as_str().unwrap_or_default();
    if !(expr.contains("#state = :solved") || expr.contains("#state = :failedstate")) {
        return;
    }
    let values = &v["ExpressionAttributeValues"];
    let result = values[":solution"]["S"].as_str().or_else(|| values[":code"]["S"].as_str()).unwrap_or_default();
    let at = values[":at"]["N"].as_str().unwrap_or_default();
    if let (Some(pk), Ok(mut m)) = (v["Key"]["pk"]["S"].as_str(), sh.applied.lock()) {
        *m.entry(format!("{pk} {result} {at}")).or_default() += 1;
    }
}

impl FlakyDynamo {
    /// Fronts `target` (e.g. a [`LocalDynamo`] endpoint, or moto), healthy at first.
    pub async fn start(target: &str) -> anyhow::Result<Self> {
        let shared = std::sync::Arc::new(FlakyShared::default());
        let st = FlakyState {
            target: target.trim_end_matches('/').to_owned(),
            http: reqwest::Client::new(),
            shared: shared.clone(),
        };
        let (endpoint, server) = serve_on_loopback(axum::Router::new().fallback(flaky_forward).with_state(st)).await?;
        Ok(Self { endpoint, st: shared, _server: server })
    }

    pub fn set_failing(&self, on: bool) {
        self.st.failing.store(on, std::sync::atomic::Ordering::SeqCst);
    }

    /// Fails only the calls whose request body contains `needle` (e.g. `":solution"`: the
    /// writes of results), or stops doing so with `None`.
    pub fn set_failing_matching(&self, needle: Option<&str>) {
        if let Ok(mut m) = self.st.matching.lock() {
            *m = needle.map(str::to_owned);
        }
    }

    /// Fails this share (0..=1) of writes at random.
    pub fn set_write_failure_rate(&self, p: f64) {
        let ppm = (p.clamp(0.0, 1.0) * 1_000_000.0) as u64;
        self.st.write_failure_ppm.store(ppm, std::sync::atomic::Ordering::SeqCst);
    }

    /// Calls answered with an injected fault so far.
    pub fn calls_failed(&self) -> u64 {
        self.st.calls_failed.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Successful result writes seen, by task reference, result and receipt time (one delivery
    /// applied twice would show 2).
    pub fn applied_results(&self) -> std::collections::HashMap<String, u32> {
        self.st.applied.lock().map(|m| m.clone()).unwrap_or_default()
    }

    /// Tasks that had more than one different result written: a result replaced by one received
    /// earlier.
    pub fn replaced_results(&self) -> usize {
        let mut results: std::collections::HashMap<String, std::collections::HashSet<String>> = Default::default();
        for key in self.applied_results().into_keys() {
            let mut parts = key.splitn(3, ' ');
            if let (Some(pk), Some(result)) = (parts.next(), parts.next()) {
                results.entry(pk.to_owned()).or_default().insert(result.to_owned());
            }
        }
        results.values().filter(|r| r.len() > 1).count()
    }

    /// A store on `table` reached through this endpoint.
    pub fn store(&self, table: &str) -> TaskStore {
        TaskStore::new(client_for(&self.endpoint), table, Duration::from_secs(7 * 86_400))
    }
}

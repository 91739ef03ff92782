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

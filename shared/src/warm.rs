//! Opening a function's AWS connections at cold start, before the runtime loop asks for its
//! first event ([`crate::store::TaskStore::warm_up`], with [`WARM_UP_LIMIT`]).
//!
//! The SDK connects lazily: left alone, the first request of a cold function pays for the TCP
//! connection, the TLS handshake, the credentials' first resolution and the endpoint rules
//! (published measurements put the handshake at most of a first DynamoDB request on a small
//! Lambda). One cheap call during init pays for them there instead: the pooled connection is
//! the one the first request then uses. Init runs on a proactively started sandbox before any
//! event is waiting, and it is the phase Lambda gives its fastest start to.
//!
//! A warm-up is an optimisation, never a precondition: it is bounded in time, its failure is
//! logged and otherwise ignored, and the first request simply connects as it would have.

use std::future::Future;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::error::SdkError;

/// The longest a warm-up may hold up init. A handshake to an in-region endpoint takes tens of
/// milliseconds (hundreds at the smallest memory sizes); past this the service is having a bad
/// moment, and the first request will connect (or fail) on its own terms.
pub const WARM_UP_LIMIT: Duration = Duration::from_secs(2);

/// What a warm-up achieved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Warmed {
    /// The service answered (with data or with an error of its own, such as an access
    /// denial): the connection is open and pooled for the first request.
    Open(Duration),
    /// No answer: the call could not be sent, timed out or the answer was unreadable. The
    /// first request connects on its own.
    Failed(String),
}

/// Runs one warm-up call for `service`, at most `limit`, and logs what came of it. Any answer
/// of the service counts: what matters is the connection, not the call's result.
pub async fn run<T, E, R>(
    service: &'static str,
    limit: Duration,
    call: impl Future<Output = Result<T, SdkError<E, R>>>,
) -> Warmed
where
    E: std::error::Error + Send + Sync + 'static,
    R: std::fmt::Debug,
{
    let started = Instant::now();
    let warmed = match tokio::time::timeout(limit, call).await {
        Ok(Ok(_)) | Ok(Err(SdkError::ServiceError(_))) => Warmed::Open(started.elapsed()),
        Ok(Err(e)) => Warmed::Failed(aws_sdk_dynamodb::error::DisplayErrorContext(&e).to_string()),
        Err(_) => Warmed::Failed(format!("no answer within {} ms", limit.as_millis())),
    };
    match &warmed {
        Warmed::Open(took) => {
            tracing::info!(event = "warm_up", service, ms = took.as_millis() as u64, "connection opened at init");
        }
        Warmed::Failed(error) => tracing::info!(
            event = "warm_up_failed",
            service,
            ms = started.elapsed().as_millis() as u64,
            error = error.as_str(),
            "connection not opened at init: the first request will connect"
        ),
    }
    warmed
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;
    use crate::domain::TaskRef;
    use crate::store::TaskStore;

    /// A stand-in DynamoDB on loopback that counts the connections it accepts and answers every
    /// request on a connection with `status` and `body` (keep-alive), or never answers.
    async fn fake_dynamodb(status: u16, body: &'static str, answer: bool) -> (String, Arc<AtomicUsize>) {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("addr"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = accepted.clone();
        tokio::spawn(async move {
            while let Ok((mut conn, _)) = listener.accept().await {
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut buf = Vec::new();
                    let mut chunk = [0u8; 4096];
                    loop {
                        let Ok(n) = conn.read(&mut chunk).await else { return };
                        if n == 0 {
                            return;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                        // One request at a time: its headers, then Content-Length bytes of body.
                        let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else { continue };
                        let head = String::from_utf8_lossy(&buf[..end]).to_ascii_lowercase();
                        let len = head
                            .lines()
                            .find_map(|l| l.strip_prefix("content-length:"))
                            .and_then(|v| v.trim().parse::<usize>().ok())
                            .unwrap_or(0);
                        if buf.len() < end + 4 + len {
                            continue;
                        }
                        buf.drain(..end + 4 + len);
                        if !answer {
                            std::future::pending::<()>().await;
                        }
                        let reply = format!(
                            "HTTP/1.1 {status} X\r\ncontent-type: application/x-amz-json-1.0\r\n\
                             x-amzn-requestid: warm\r\ncontent-length: {}\r\n\r\n{body}",
                            body.len()
                        );
                        if conn.write_all(reply.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (url, accepted)
    }

    fn store_at(url: &str) -> TaskStore {
        TaskStore::new(crate::testkit::client_for(url), "tasks", Duration::from_secs(60))
    }

    #[tokio::test]
    async fn the_first_request_after_a_warm_up_reuses_its_connection() {
        // Given a DynamoDB that answers DescribeEndpoints (and, with the same body, a GetItem
        // that finds nothing)
        let (url, accepted) = fake_dynamodb(
            200,
            r#"{"Endpoints":[{"Address":"dynamodb.us-east-1.amazonaws.com","CachePeriodInMinutes":1440}]}"#,
            true,
        )
        .await;
        let store = store_at(&url);
        // When the store warms up, then serves its first request
        let warmed = store.warm_up(WARM_UP_LIMIT).await;
        let after_warm_up = accepted.load(Ordering::SeqCst);
        let task = store.tasks().get(&TaskRef::generate()).await.expect("the first request");
        // Then the warm-up opened the one connection, and the first request used it
        assert!(matches!(warmed, Warmed::Open(_)), "{warmed:?}");
        assert_eq!(after_warm_up, 1);
        assert!(task.is_none());
        assert_eq!(accepted.load(Ordering::SeqCst), 1, "the first request opened a connection of its own");
    }

    #[tokio::test]
    async fn an_error_answer_still_opens_the_connection() {
        // Given a DynamoDB that refuses the call (as a VPC endpoint policy without
        // dynamodb:DescribeEndpoints would)
        let (url, accepted) = fake_dynamodb(
            400,
            r#"{"__type":"com.amazon.coral.service#AccessDeniedException","message":"not authorized"}"#,
            true,
        )
        .await;
        // When the store warms up
        let warmed = store_at(&url).warm_up(WARM_UP_LIMIT).await;
        // Then the connection counts as open: the first request will find it in the pool
        assert!(matches!(warmed, Warmed::Open(_)), "{warmed:?}");
        assert_eq!(accepted.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_silent_service_holds_up_init_no_longer_than_the_limit() {
        // Given a DynamoDB that accepts the connection and never answers
        let (url, _) = fake_dynamodb(200, "{}", false).await;
        let store = store_at(&url);
        // When a warm-up runs with a short limit
        let started = Instant::now();
        let warmed = store.warm_up(Duration::from_millis(200)).await;
        // Then it gives up at the limit, and says so
        assert!(matches!(&warmed, Warmed::Failed(e) if e.contains("no answer within 200 ms")), "{warmed:?}");
        assert!(started.elapsed() < Duration::from_secs(2), "took {:?}", started.elapsed());
    }

    #[tokio::test]
    async fn an_unreachable_service_is_a_failed_warm_up_not_an_error() {
        // Given nothing listening (port 9 on loopback refuses connections)
        let store = store_at("http://127.0.0.1:9");
        // When the store warms up
        let warmed = store.warm_up(Duration::from_millis(500)).await;
        // Then it reports the failure and returns
        assert!(matches!(warmed, Warmed::Failed(_)), "{warmed:?}");
    }
}

//! The sender against real loopback HTTP servers (hand-written, so every connection is counted
//! and the server can misbehave exactly), and its resolver against a fixed table of names.

use super::*;
use crate::webhook::{WebhookSecret, verify};
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Instant, UNIX_EPOCH};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

fn now_secs() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

#[test]
fn retry_after_reads_seconds_and_dates_capped_at_a_day() {
    let now = UNIX_EPOCH + Duration::from_secs(1_700_000_000);
    assert_eq!(parse_retry_after("120", now), Some(Duration::from_secs(120)));
    assert_eq!(parse_retry_after(" 0 ", now), Some(Duration::ZERO));
    assert_eq!(parse_retry_after("999999", now), Some(MAX_RETRY_AFTER));
    assert_eq!(parse_retry_after("99999999999999999999999", now), Some(MAX_RETRY_AFTER));
    let later = httpdate::fmt_http_date(now + Duration::from_secs(3600));
    assert_eq!(parse_retry_after(&later, now), Some(Duration::from_secs(3600)));
    let past = httpdate::fmt_http_date(now - Duration::from_secs(3600));
    assert_eq!(parse_retry_after(&past, now), Some(Duration::ZERO));
    for bad in ["", "-5", "1.5", "soon", "Thu, 99 Foo 2023"] {
        assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
    }
}

#[derive(Clone)]
enum Reply {
    /// A whole response, written as is.
    Raw(String),
    /// Read the request, then say nothing for a minute.
    Hang,
    /// 200 announcing a 50 MB body: its first megabyte, then silence.
    Huge,
}

#[derive(Debug)]
struct Seen {
    request_line: String,
    headers: HashMap<String, String>,
    body: Vec<u8>,
}

struct Server {
    port: u16,
    connections: Arc<AtomicUsize>,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Server {
    fn connections(&self) -> usize {
        self.connections.load(Ordering::SeqCst)
    }
    fn url(&self, host: &str, path: &str) -> String {
        format!("http://{host}:{}{path}", self.port)
    }
}

async fn serve(reply: Reply) -> Server {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let connections = Arc::new(AtomicUsize::new(0));
    let seen = Arc::new(Mutex::new(Vec::new()));
    let (c, s) = (connections.clone(), seen.clone());
    let task = tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            c.fetch_add(1, Ordering::SeqCst);
            tokio::spawn(answer(stream, reply.clone(), s.clone()));
        }
    });
    Server { port, connections, seen, task }
}

async fn read_request(stream: &mut TcpStream) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
            break i;
        }
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 || buf.len() > 1 << 20 {
            return None;
        }
        buf.extend_from_slice(&chunk[..n]);
    };
    let head = String::from_utf8(buf[..head_end].to_vec()).ok()?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next()?.to_owned();
    let headers: HashMap<String, String> = lines
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.trim().to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    let len: usize = headers.get("content-length").and_then(|v| v.parse().ok()).unwrap_or(0);
    let mut body = buf[head_end + 4..].to_vec();
    while body.len() < len {
        let n = stream.read(&mut chunk).await.ok()?;
        if n == 0 {
            return None;
        }
        body.extend_from_slice(&chunk[..n]);
    }
    Some(Seen { request_line, headers, body })
}

async fn answer(mut stream: TcpStream, reply: Reply, seen: Arc<Mutex<Vec<Seen>>>) {
    let Some(req) = read_request(&mut stream).await else { return };
    seen.lock().expect("lock").push(req);
    match reply {
        Reply::Raw(text) => {
            let _ = stream.write_all(text.as_bytes()).await;
        }
        Reply::Hang => tokio::time::sleep(Duration::from_secs(60)).await,
        Reply::Huge => {
            let head = "HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 50000000\r\n\r\n";
            if stream.write_all(head.as_bytes()).await.is_err() {
                return;
            }
            // The first megabyte, then nothing: a client that reads the whole body waits
            // for its timeout instead of returning at once.
            let block = vec![b'x'; 64 * 1024];
            for _ in 0..16 {
                if stream.write_all(&block).await.is_err() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_secs(60)).await;
        }
    }
}

fn raw(status_line: &str, extra_headers: &str) -> Reply {
    Reply::Raw(format!("HTTP/1.1 {status_line}\r\n{extra_headers}content-length: 2\r\nconnection: close\r\n\r\nno"))
}

fn keys() -> (SigningKeys, WebhookSecret, WebhookSecret) {
    let (cur, _) = WebhookSecret::generate();
    let (prev, _) = WebhookSecret::generate();
    (SigningKeys::new(cur.clone(), Some(prev.clone())), cur, prev)
}

fn outgoing<'a>(url: &'a str, keys: &'a SigningKeys, body: &[u8]) -> Outgoing<'a> {
    Outgoing {
        url,
        method: PushMethod::Post,
        msg_id: "msg_2Vv8Qm3TfLxZ",
        timestamp: now_secs(),
        content_type: "application/json",
        body: body.to_vec(),
        keys,
    }
}

fn loopback_sender() -> Sender {
    Sender::new(UrlPolicy::AllowLoopback, Duration::from_secs(5)).expect("sender")
}

async fn send_to(reply: Reply) -> (AttemptResult, Server) {
    let server = serve(reply).await;
    let (k, _, _) = keys();
    let url = server.url("127.0.0.1", "/hook");
    let got = loopback_sender().send(&outgoing(&url, &k, b"{}")).await;
    (got, server)
}

#[tokio::test]
async fn sender_200_is_delivered_with_signed_headers_and_the_body_unchanged() {
    let server = serve(raw("200 OK", "")).await;
    let (k, cur, prev) = keys();
    let body = "{\"id\":\"t-1\",\"code\":\"résultat ✓\",\"n\":[1,2,3]}".as_bytes();
    let url = server.url("127.0.0.1", "/hooks/in?tenant=7");
    let req = outgoing(&url, &k, body);
    assert_eq!(loopback_sender().send(&req).await, AttemptResult::Delivered { status: 200 });
    let seen = server.seen.lock().expect("lock");
    assert_eq!(seen.len(), 1);
    let r = &seen[0];
    assert_eq!(r.request_line, "POST /hooks/in?tenant=7 HTTP/1.1");
    assert_eq!(r.body, body);
    assert_eq!(r.headers["webhook-id"], "msg_2Vv8Qm3TfLxZ");
    assert_eq!(r.headers["webhook-timestamp"], req.timestamp.to_string());
    assert_eq!(r.headers["content-type"], "application/json");
    assert_eq!(r.headers["user-agent"], USER_AGENT);
    let sig = &r.headers["webhook-signature"];
    assert_eq!(sig.split(' ').count(), 2, "{sig}");
    for s in [&cur, &prev] {
        assert_eq!(
            verify(s, &r.headers["webhook-id"], &r.headers["webhook-timestamp"], sig, &r.body, now_secs()),
            Ok(())
        );
    }
}

#[tokio::test]
async fn sender_500_is_retried() {
    let (got, _s) = send_to(raw("500 Internal Server Error", "")).await;
    assert_eq!(
        got,
        AttemptResult::Retry { status: Some(500), error: "HTTP 500 Internal Server Error".into(), retry_after: None }
    );
}

#[tokio::test]
async fn sender_429_with_retry_after_seconds() {
    let (got, _s) = send_to(raw("429 Too Many Requests", "Retry-After: 120\r\n")).await;
    let AttemptResult::Retry { status: Some(429), retry_after, .. } = got else { panic!("{got:?}") };
    assert_eq!(retry_after, Some(Duration::from_secs(120)));
}

#[tokio::test]
async fn sender_503_with_an_http_date_retry_after() {
    let at = httpdate::fmt_http_date(SystemTime::now() + Duration::from_secs(3600));
    let (got, _s) = send_to(raw("503 Service Unavailable", &format!("Retry-After: {at}\r\n"))).await;
    let AttemptResult::Retry { status: Some(503), retry_after: Some(after), .. } = got else { panic!("{got:?}") };
    assert!(after > Duration::from_secs(3590) && after <= Duration::from_secs(3600), "{after:?}");
}

#[tokio::test]
async fn sender_410_is_gone() {
    let (got, _s) = send_to(raw("410 Gone", "")).await;
    assert_eq!(got, AttemptResult::Gone);
}

#[tokio::test]
async fn sender_302_is_retried_and_not_followed() {
    let target = serve(raw("200 OK", "")).await;
    let location = format!("Location: {}\r\n", target.url("127.0.0.1", "/elsewhere"));
    let (got, _s) = send_to(raw("302 Found", &location)).await;
    assert!(matches!(got, AttemptResult::Retry { status: Some(302), .. }), "{got:?}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(target.connections(), 0, "the redirect was followed");
}

#[tokio::test]
async fn sender_gives_up_on_a_silent_server_within_the_timeout() {
    // A 1 s timeout, so the test is quick: the server reads the request and never answers.
    let server = serve(Reply::Hang).await;
    let sender = Sender::new(UrlPolicy::AllowLoopback, Duration::from_secs(1)).expect("sender");
    let (k, _, _) = keys();
    let url = server.url("127.0.0.1", "/hook");
    let started = Instant::now();
    let got = sender.send(&outgoing(&url, &k, b"{}")).await;
    let took = started.elapsed();
    let AttemptResult::Retry { status: None, error, retry_after: None } = got else { panic!("{got:?}") };
    assert!(error.starts_with("timed out"), "{error}");
    assert!(took >= Duration::from_millis(900) && took < Duration::from_secs(3), "{took:?}");
    assert_eq!(server.connections(), 1);
}

#[tokio::test]
async fn sender_reads_little_of_a_huge_response() {
    // The sender's timeout is 5 s: reading past the 16 KiB it needs would wait that long.
    let started = Instant::now();
    let (got, _s) = send_to(Reply::Huge).await;
    assert_eq!(got, AttemptResult::Delivered { status: 200 });
    assert!(started.elapsed() < Duration::from_secs(3), "{:?}", started.elapsed());
}

#[tokio::test]
async fn sender_connection_errors_are_retried_without_the_url() {
    let closed = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let port = closed.local_addr().expect("addr").port();
    drop(closed);
    let (k, _, _) = keys();
    let url = format!("http://127.0.0.1:{port}/hook?token=s3cr3t");
    let got = loopback_sender().send(&outgoing(&url, &k, b"{}")).await;
    let AttemptResult::Retry { status: None, error, .. } = got else { panic!("{got:?}") };
    assert!(error.starts_with("connection failed"), "{error}");
    assert!(!error.contains("s3cr3t") && !error.contains("/hook"), "{error}");
}

#[tokio::test]
async fn sender_refuses_loopback_under_public_https_without_connecting() {
    let server = serve(raw("200 OK", "")).await;
    let sender = Sender::new(UrlPolicy::PublicHttps, Duration::from_secs(5)).expect("sender");
    assert_eq!(sender.policy(), UrlPolicy::PublicHttps);
    let (k, _, _) = keys();
    for url in [
        format!("https://127.0.0.1:{}/", server.port),
        format!("https://[::ffff:127.0.0.1]:{}/", server.port),
        format!("https://2130706433:{}/", server.port),
        format!("https://localhost:{}/", server.port),
        format!("http://127.0.0.1:{}/", server.port),
    ] {
        let got = sender.send(&outgoing(&url, &k, b"{}")).await;
        assert!(matches!(got, AttemptResult::Refused { .. }), "{url}: {got:?}");
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.connections(), 0);
}

#[tokio::test]
async fn sender_refuses_an_oversized_body_without_connecting() {
    let server = serve(raw("200 OK", "")).await;
    let (k, _, _) = keys();
    let url = server.url("127.0.0.1", "/hook");
    let sender = loopback_sender();
    let got = sender.send(&outgoing(&url, &k, &vec![b'a'; MAX_BODY + 1])).await;
    assert!(matches!(got, AttemptResult::Refused { .. }), "{got:?}");
    assert_eq!(sender.send(&outgoing(&url, &k, &vec![b'a'; MAX_BODY])).await, AttemptResult::Delivered { status: 200 });
    assert_eq!(server.connections(), 1);
}

#[tokio::test]
async fn sender_under_allow_loopback_reaches_localhost_by_name() {
    let server = serve(raw("204 No Content", "")).await;
    let (k, _, _) = keys();
    let url = server.url("localhost", "/hook");
    assert_eq!(loopback_sender().send(&outgoing(&url, &k, b"{}")).await, AttemptResult::Delivered { status: 204 });
    assert_eq!(server.seen.lock().expect("lock").len(), 1);
}

fn table_sender(policy: UrlPolicy, entries: &[(&str, &[&str])]) -> Sender {
    let table = entries
        .iter()
        .map(|(name, ips)| (name.to_string(), ips.iter().map(|i| i.parse().expect("ip")).collect()))
        .collect();
    Sender::with_lookup(policy, Duration::from_secs(5), Lookup::Table(Arc::new(table))).expect("sender")
}

#[tokio::test]
async fn resolver_refuses_metadata_and_rebound_names_at_connect_time() {
    let server = serve(raw("200 OK", "")).await;
    let (k, _, _) = keys();
    // Metadata, even where loopback is allowed: names pass check_url, their addresses do not.
    let lo = table_sender(
        UrlPolicy::AllowLoopback,
        &[
            ("meta.example", &["169.254.169.254"]),
            ("meta6.example", &["fd00:ec2::254", "::ffff:169.254.169.254"]),
            ("mixed.example", &["169.254.169.254", "10.0.0.5", "127.0.0.1"]),
        ],
    );
    for name in ["meta.example", "meta6.example"] {
        let url = server.url(name, "/latest/meta-data?x=1");
        let got = lo.send(&outgoing(&url, &k, b"{}")).await;
        let AttemptResult::Refused { reason } = &got else { panic!("{name}: {got:?}") };
        assert!(reason.contains("refused addresses"), "{reason}");
        assert!(!reason.contains("x=1"), "{reason}");
    }
    // Only the allowed address of a mixed answer is used.
    let url = server.url("mixed.example", "/hook");
    assert_eq!(lo.send(&outgoing(&url, &k, b"{}")).await, AttemptResult::Delivered { status: 200 });
    assert_eq!(server.connections(), 1);
    // DNS rebinding under PublicHttps: a public-looking name that now resolves to loopback.
    let public = table_sender(UrlPolicy::PublicHttps, &[("hooks.example", &["127.0.0.1"])]);
    let url = format!("https://hooks.example:{}/hook", server.port);
    let got = public.send(&outgoing(&url, &k, b"{}")).await;
    assert!(matches!(got, AttemptResult::Refused { .. }), "{got:?}");
    // A name that does not resolve is worth retrying, not refused.
    let got = public.send(&outgoing(&format!("https://nowhere.example:{}/", server.port), &k, b"{}")).await;
    let AttemptResult::Retry { status: None, error, .. } = &got else { panic!("{got:?}") };
    assert!(error.starts_with("DNS lookup failed"), "{error}");
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(server.connections(), 1, "a refused address was connected to");
}

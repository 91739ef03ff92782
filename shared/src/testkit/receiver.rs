//! An owner's callback endpoint on loopback that fails the way real ones do, for the push
//! delivery tests. What it does depends on the request's path (its first segment) and on the
//! clock it is given (a simulated one in the simulations):
//!
//! | path          | answers                                                              |
//! | ------------- | -------------------------------------------------------------------- |
//! | `/ok/…`       | 200                                                                  |
//! | `/flaky/…`    | 500 to the first 2 requests for the path, then 200                   |
//! | `/once/…`     | 500 to the first request, then 200                                   |
//! | `/limited/…`  | 429 with `Retry-After: 120` to the first request, then 200           |
//! | `/slow/…`     | the first request never answered (the sender times out), then 200    |
//! | `/gone/…`     | 410                                                                  |
//! | `/never/…`    | 503, always                                                          |
//!
//! and while [`Receiver::set_down`] says so, every connection is cut without an answer (a
//! process that is down). Every request is recorded — headers that matter, body, clock time,
//! what it was answered — for the tests to check against.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::time::{Clock, Timestamp};

/// One request the receiver got.
#[derive(Debug, Clone)]
pub struct Hit {
    pub path: String,
    pub at: Timestamp,
    pub webhook_id: String,
    pub webhook_timestamp: String,
    pub webhook_signature: String,
    pub content_type: String,
    pub body: Vec<u8>,
    /// The status it was answered with; 0 when the connection was cut or left hanging.
    pub answered: u16,
}

#[derive(Default)]
struct State {
    hits: Vec<Hit>,
    seen: HashMap<String, u32>,
    down: bool,
}

/// The receiver. Cheap to clone.
#[derive(Clone)]
pub struct Receiver {
    pub base_url: String,
    state: Arc<Mutex<State>>,
}

impl Receiver {
    /// Starts it on 127.0.0.1 (a free port), with `clock` for the time of each hit.
    pub async fn start(clock: Arc<dyn Clock>) -> anyhow::Result<Self> {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base_url = format!("http://{}", listener.local_addr()?);
        let state = Arc::new(Mutex::new(State::default()));
        let st = state.clone();
        let app = axum::Router::new().fallback(move |uri: Uri, headers: HeaderMap, body: Bytes| {
            let (st, clock) = (st.clone(), clock.clone());
            async move { answer(&st, clock.as_ref(), &uri, &headers, body).await }
        });
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(Self { base_url, state })
    }

    /// While `down`, connections are cut without an answer.
    pub fn set_down(&self, down: bool) {
        if let Ok(mut s) = self.state.lock() {
            s.down = down;
        }
    }

    /// Every request so far.
    pub fn hits(&self) -> Vec<Hit> {
        self.state.lock().map(|s| s.hits.clone()).unwrap_or_default()
    }
}

async fn answer(st: &Mutex<State>, clock: &dyn Clock, uri: &Uri, headers: &HeaderMap, body: Bytes) -> Response {
    let path = uri.path().to_owned();
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let mut hit = Hit {
        path: path.clone(),
        at: clock.now(),
        webhook_id: header("webhook-id"),
        webhook_timestamp: header("webhook-timestamp"),
        webhook_signature: header("webhook-signature"),
        content_type: header("content-type"),
        body: body.to_vec(),
        answered: 0,
    };
    let (down, nth) = {
        let mut s = st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let down = s.down;
        let nth = s.seen.entry(path.clone()).or_default();
        *nth += 1;
        (down, *nth)
    };
    let pattern = path.trim_start_matches('/').split('/').next().unwrap_or_default().to_owned();
    let status = if down {
        None
    } else {
        match pattern.as_str() {
            "ok" => Some(StatusCode::OK),
            "flaky" if nth <= 2 => Some(StatusCode::INTERNAL_SERVER_ERROR),
            "flaky" => Some(StatusCode::OK),
            "once" if nth == 1 => Some(StatusCode::INTERNAL_SERVER_ERROR),
            "once" => Some(StatusCode::OK),
            "limited" if nth == 1 => Some(StatusCode::TOO_MANY_REQUESTS),
            "limited" => Some(StatusCode::OK),
            "slow" if nth == 1 => None,
            "slow" => Some(StatusCode::OK),
            "gone" => Some(StatusCode::GONE),
            "never" => Some(StatusCode::SERVICE_UNAVAILABLE),
            _ => Some(StatusCode::NOT_FOUND),
        }
    };
    hit.answered = status.map_or(0, |s| s.as_u16());
    if let Ok(mut s) = st.lock() {
        s.hits.push(hit);
    }
    match status {
        Some(StatusCode::TOO_MANY_REQUESTS) => {
            (StatusCode::TOO_MANY_REQUESTS, [("retry-after", "120")], "slow down").into_response()
        }
        Some(s) => (s, "").into_response(),
        None if pattern == "slow" && !down => {
            // Hangs past any sender's timeout (real time: the sender's clock is real).
            tokio::time::sleep(Duration::from_secs(120)).await;
            (StatusCode::OK, "").into_response()
        }
        // Down: the connection is cut without an answer.
        None => std::panic::resume_unwind(Box::new("receiver is down")),
    }
}

/// The repo's `.venv` python with the Standard Webhooks reference library (`standardwebhooks`,
/// pinned in `infra/requirements-sdk.txt`) importable: `infra/tools.sh sdk` installs it when it
/// is not there yet. Fails with a clear message if it cannot be installed.
pub fn python_with_standardwebhooks() -> anyhow::Result<std::path::PathBuf> {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let python = root.join(".venv/bin/python");
    let importable = || {
        std::process::Command::new(&python)
            .args(["-c", "import standardwebhooks.webhooks"])
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !importable() {
        let ok = std::process::Command::new("bash").arg(root.join("infra/tools.sh")).arg("sdk").status()?;
        anyhow::ensure!(
            ok.success() && importable(),
            "infra/tools.sh sdk could not make standardwebhooks importable by {} (it needs Python 3.10+)",
            python.display()
        );
    }
    Ok(python)
}

/// The verifier script the reference library runs in (`tests/compat/webhook_verify.py`).
pub fn webhook_verify_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/compat/webhook_verify.py")
}

/// Checks every hit's signature with the Standard Webhooks reference library, each at the time
/// it was received. Returns one answer per hit: `ok` or `fail: <reason>`.
pub fn verify_with_reference(secret: &str, hits: &[Hit]) -> anyhow::Result<Vec<String>> {
    use std::io::Write;
    let python = python_with_standardwebhooks()?;
    let mut child = std::process::Command::new(&python)
        .arg(webhook_verify_script())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()?;
    let mut input = String::new();
    for h in hits {
        let line = serde_json::json!({
            "secret": secret,
            "headers": {
                "webhook-id": h.webhook_id,
                "webhook-timestamp": h.webhook_timestamp,
                "webhook-signature": h.webhook_signature,
            },
            "body": String::from_utf8_lossy(&h.body),
            "now": h.at.as_secs(),
        });
        input.push_str(&line.to_string());
        input.push('\n');
    }
    let mut stdin = child.stdin.take().ok_or_else(|| anyhow::anyhow!("no stdin"))?;
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output()?;
    writer.join().map_err(|_| anyhow::anyhow!("writer panicked"))??;
    anyhow::ensure!(out.status.success(), "webhook_verify.py failed");
    Ok(String::from_utf8(out.stdout)?.lines().map(str::to_owned).collect())
}

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
//! | `/limited2/…` | 429 with `Retry-After: 2` to the first request, then 200             |
//! | `/slow/…`     | the first request never answered (the sender times out), then 200    |
//! | `/reset/…`    | the first request's connection cut without an answer, then 200       |
//! | `/redirect/…` | 302 to another URL for the first request (never followed), then 200  |
//! | `/slow7/…`    | 200, every time after 7 s                                            |
//! | `/large/…`    | 200 with a 4 MiB body                                                |
//! | `/gone/…`     | 410                                                                  |
//! | `/never/…`    | 503, always                                                          |
//!
//! and while [`Receiver::set_down`] says so, every connection is cut without an answer (a
//! process that is down). Every request is recorded — headers that matter, body, clock time,
//! what it was answered — for the tests to check against. Delays (a hang, a slow answer) are
//! waits on the receiver's clock: on a simulated clock they take simulated time, as the
//! sender's timeout does.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};

use crate::time::{Clock, Timestamp};

/// One request the receiver got.
#[derive(Debug, Clone)]
pub struct Hit {
    pub method: String,
    pub path: String,
    /// The URL's query (a CaptchaAI-style `GET` pingback carries `id` and `code` there).
    pub query: String,
    pub at: Timestamp,
    pub webhook_id: String,
    pub webhook_timestamp: String,
    pub webhook_signature: String,
    pub content_type: String,
    pub body: Vec<u8>,
    /// The status it was answered with; 0 when the connection was cut or left hanging.
    pub answered: u16,
    /// When the answer went out (later than `at` for a slow answer).
    pub answered_at: Timestamp,
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
        let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
            let (st, clock) = (st.clone(), clock.clone());
            async move { answer(&st, clock.as_ref(), &method, &uri, &headers, body).await }
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

/// A large answer's body.
const LARGE: usize = 4 * 1024 * 1024;

async fn answer(
    st: &Mutex<State>,
    clock: &dyn Clock,
    method: &Method,
    uri: &Uri,
    headers: &HeaderMap,
    body: Bytes,
) -> Response {
    // Held throughout, waits included: on a simulated clock a sleeper must hold a guard, or it
    // would stand in for some other actor that is working (its sender's own guard is matched by
    // the sender's timeout on the same clock).
    let busy = clock.busy();
    let path = uri.path().to_owned();
    let header = |n: &str| headers.get(n).and_then(|v| v.to_str().ok()).unwrap_or_default().to_owned();
    let at = clock.now();
    let mut hit = Hit {
        method: method.as_str().to_owned(),
        path: path.clone(),
        query: uri.query().unwrap_or_default().to_owned(),
        at,
        webhook_id: header("webhook-id"),
        webhook_timestamp: header("webhook-timestamp"),
        webhook_signature: header("webhook-signature"),
        content_type: header("content-type"),
        body: body.to_vec(),
        answered: 0,
        answered_at: at,
    };
    let (down, nth) = {
        let mut s = st.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let down = s.down;
        let nth = s.seen.entry(path.clone()).or_default();
        *nth += 1;
        (down, *nth)
    };
    let pattern = path.trim_start_matches('/').split('/').next().unwrap_or_default().to_owned();
    let first = nth == 1;
    // (status, extra header, delay); no status: no answer.
    let (status, extra, delay): (Option<StatusCode>, Option<(&str, &str)>, Duration) = if down {
        (None, None, Duration::ZERO)
    } else {
        let now = Duration::ZERO;
        match pattern.as_str() {
            "ok" | "large" => (Some(StatusCode::OK), None, now),
            "flaky" if nth <= 2 => (Some(StatusCode::INTERNAL_SERVER_ERROR), None, now),
            "once" if first => (Some(StatusCode::INTERNAL_SERVER_ERROR), None, now),
            "limited" if first => (Some(StatusCode::TOO_MANY_REQUESTS), Some(("retry-after", "120")), now),
            "limited2" if first => (Some(StatusCode::TOO_MANY_REQUESTS), Some(("retry-after", "2")), now),
            "redirect" if first => (Some(StatusCode::FOUND), Some(("location", "http://127.0.0.1:9/elsewhere")), now),
            "slow" | "reset" if first => (None, None, now),
            "slow7" => (Some(StatusCode::OK), None, Duration::from_secs(7)),
            "gone" => (Some(StatusCode::GONE), None, now),
            "never" => (Some(StatusCode::SERVICE_UNAVAILABLE), None, now),
            "flaky" | "once" | "limited" | "limited2" | "redirect" | "slow" | "reset" => {
                (Some(StatusCode::OK), None, now)
            }
            _ => (Some(StatusCode::NOT_FOUND), None, now),
        }
    };
    hit.answered = status.map_or(0, |s| s.as_u16());
    hit.answered_at = at.plus(delay);
    if let Ok(mut s) = st.lock() {
        s.hits.push(hit);
    }
    match status {
        Some(s) => {
            if !delay.is_zero() {
                clock.sleep_until(at.plus(delay)).await;
            }
            drop(busy);
            let mut resp =
                if pattern == "large" { (s, vec![b'x'; LARGE]).into_response() } else { (s, "").into_response() };
            if let Some((k, v)) = extra
                && let (Ok(k), Ok(v)) =
                    (axum::http::HeaderName::from_bytes(k.as_bytes()), axum::http::HeaderValue::from_str(v))
            {
                resp.headers_mut().insert(k, v);
            }
            resp
        }
        None if pattern == "slow" && !down => {
            // Hangs past any sender's timeout.
            clock.sleep_until(at.plus(Duration::from_secs(120))).await;
            drop(busy);
            (StatusCode::OK, "").into_response()
        }
        // Down, or a reset: the connection is cut without an answer.
        None => {
            drop(busy);
            std::panic::resume_unwind(Box::new("connection cut"))
        }
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

/// What the receiver's requests say about a set of tasks' pushes (see [`check_pushes`]).
#[derive(Debug, Default, Clone)]
pub struct PushCheck {
    pub tasks: usize,
    /// The push is recorded delivered and the receiver answered it 2xx.
    pub delivered: usize,
    /// The push is recorded gone and the receiver's path answers 410.
    pub gone: usize,
    /// Tasks whose push is neither (with what their delivery says).
    pub owed: Vec<String>,
    /// Results that carried a live token when they were recorded.
    pub fresh_at_record: usize,
    /// Of those, the ones whose first accepted push was sent after the token died (or no longer
    /// carried it). Should be none.
    pub pushed_after_death: Vec<String>,
    /// Delivered pushes whose first 2xx came more than `within` after the result's record.
    pub late: Vec<String>,
    /// Tasks whose requests carried more than one `webhook-id`.
    pub extra_ids: usize,
    /// Requests answered 2xx more than once for one task (the same webhook-id: duplicates an
    /// owner drops).
    pub repeats: usize,
    /// Per delivered push: from the result's record to the receiver's 2xx, ms.
    pub record_to_2xx_ms: Vec<u64>,
    /// Per delivered push that carried a token: its life left when the receiver got it, ms.
    pub life_left_ms: Vec<u64>,
    pub requests: usize,
}

/// Checks every task's push against the receiver's requests: `tasks` are the tasks as stored
/// now with the receiver path each was given; `within` is the time a delivered push may take
/// from the result's record to its first 2xx.
pub fn check_pushes(tasks: &[(crate::domain::Task, String)], hits: &[Hit], within: Duration) -> PushCheck {
    use crate::domain::{DeliveryStatus, TaskState};
    let mut by_path: HashMap<&str, Vec<&Hit>> = HashMap::new();
    for h in hits {
        by_path.entry(h.path.as_str()).or_default().push(h);
    }
    let mut c = PushCheck { tasks: tasks.len(), requests: hits.len(), ..PushCheck::default() };
    for (task, path) in tasks {
        let got = by_path.get(path.as_str()).cloned().unwrap_or_default();
        let ids: std::collections::BTreeSet<&str> = got.iter().map(|h| h.webhook_id.as_str()).collect();
        c.extra_ids += ids.len().saturating_sub(1);
        let ok: Vec<&&Hit> = got.iter().filter(|h| (200..300).contains(&h.answered)).collect();
        c.repeats += ok.len().saturating_sub(1);
        let first_ok = ok.iter().min_by_key(|h| h.at);
        let recorded = match &task.state {
            TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } => Some(*resolved_at),
            TaskState::Expired { late: Some(l), .. } => Some(l.received_at),
            TaskState::Expired { resolved_at, .. } => Some(*resolved_at),
            _ => None,
        };
        let dies = task.token_dies_at();
        let fresh = matches!((recorded, dies), (Some(r), Some(d)) if r < d);
        c.fresh_at_record += usize::from(fresh);
        let status = task.delivery.as_ref().map(|d| d.status);
        match (status, first_ok) {
            (Some(DeliveryStatus::Delivered), Some(h)) => {
                c.delivered += 1;
                let rec = recorded.unwrap_or(h.at);
                let took = h.answered_at.since(rec);
                c.record_to_2xx_ms.push(took.as_millis() as u64);
                if took > within {
                    c.late.push(format!("{} ({path}): first 2xx {} s after its record", task.task_ref, took.as_secs()));
                }
                if let Some(d) = dies {
                    let carried = carries_token(h);
                    if fresh && (h.at >= d || !carried) {
                        c.pushed_after_death.push(format!(
                            "{} ({path}): recorded {} s before its token died, first taken {} s after it",
                            task.task_ref,
                            d.since(rec).as_secs(),
                            h.at.since(d).as_secs()
                        ));
                    } else if carried {
                        c.life_left_ms.push(d.since(h.at).as_millis() as u64);
                    }
                }
            }
            (Some(DeliveryStatus::Gone), _) if got.iter().any(|h| h.answered == 410) => c.gone += 1,
            _ => c.owed.push(format!(
                "{} ({path}): task {}, CaptchaAI id {}, {:?}, {} requests",
                task.task_ref,
                task.state.name(),
                if task.captcha_id.is_some() { "known" } else { "unknown" },
                task.delivery,
                got.len()
            )),
        }
    }
    c
}

/// Whether a push holds a solution: a JSON `task.solved` with one, or a pingback (CaptchaAI's
/// `GET` query or 2captcha's form) whose `code` is not an error.
pub fn carries_token(h: &Hit) -> bool {
    if let Ok(v) = serde_json::from_slice::<serde_json::Value>(&h.body) {
        return v["type"] == "task.solved" && v["data"]["solution"].is_string()
            || v["data"]["late_result"]["solution"].is_string();
    }
    pingback_code(h).is_some_and(|c| !c.starts_with("ERROR_") && c != "CAPCHA_NOT_READY")
}

/// The `code` of a pingback: from the query of a `GET`, from the form body of a `POST`.
pub fn pingback_code(h: &Hit) -> Option<String> {
    let pairs: Vec<(String, String)> = if h.method == "GET" {
        serde_urlencoded::from_str(&h.query).unwrap_or_default()
    } else {
        serde_urlencoded::from_bytes(&h.body).unwrap_or_default()
    };
    pairs.into_iter().find(|(k, _)| k == "code").map(|(_, v)| v)
}

/// The median, 95th percentile and maximum of `v` (sorted in place), or zeros.
pub fn p50_p95_max(v: &mut [u64]) -> (u64, u64, u64) {
    v.sort_unstable();
    let at = |p: f64| v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0);
    (at(0.5), at(0.95), v.last().copied().unwrap_or(0))
}

//! A fake CaptchaAI: a real HTTP server speaking the 2captcha v1 protocol (in.php, res.php,
//! pingbacks by GET or POST form), with knobs for the faults the relay must survive.
//!
//! It solves each task after a delay, then delivers the pingback — or drops it, delivers it
//! twice, or late — and counts every request it receives so tests can assert on traffic.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use serde::{Deserialize, Serialize};

/// How pingbacks are delivered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallbackMode {
    /// CaptchaAI's way: `GET <url>?id=…&code=…`.
    Get,
    /// 2captcha's way: `POST <url>` with a form body `id=…&code=…`.
    Post,
}

/// The knobs. Change them at any time with [`FakeCaptchaAi::configure`] or `POST /_fake/config`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct FakeConfig {
    /// The account key in.php and res.php accept.
    pub api_key: String,
    /// Time from submit to solved.
    pub solve_delay_ms: u64,
    pub callback_mode: CallbackMode,
    /// Fraction (0..=1) of pingbacks never sent.
    pub drop_callbacks: f64,
    /// Fraction (0..=1) of pingbacks sent twice.
    pub duplicate_callbacks: f64,
    /// Extra wait between solving and sending the pingback.
    pub callback_delay_ms: u64,
    /// Codes that the next submits answer, one each, in order (then submits succeed).
    pub submit_errors: Vec<String>,
    /// If set, every task ends with this code instead of a solution.
    pub result_code: Option<String>,
    /// Whether `res.php?action=get&ids=…` is understood.
    pub batch_supported: bool,
    /// Seed for the drop/duplicate choices, so runs repeat.
    pub seed: u64,
    /// Delay before in.php answers (to provoke client timeouts).
    pub in_php_delay_ms: u64,
    /// Fraction (0..=1) of pingbacks sent late, `late_callback_ms` after the solve.
    pub late_callbacks: f64,
    pub late_callback_ms: u64,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            api_key: "0123456789abcdef0123456789abcdef".into(),
            solve_delay_ms: 50,
            callback_mode: CallbackMode::Get,
            drop_callbacks: 0.0,
            duplicate_callbacks: 0.0,
            callback_delay_ms: 0,
            submit_errors: Vec::new(),
            result_code: None,
            batch_supported: true,
            seed: 7,
            in_php_delay_ms: 0,
            late_callbacks: 0.0,
            late_callback_ms: 0,
        }
    }
}

/// Requests and deliveries counted so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counts {
    pub in_php: u64,
    pub res_php: u64,
    /// Task ids read through res.php (a batch read counts each id).
    pub res_php_ids: u64,
    pub tasks_accepted: u64,
    pub callbacks_sent: u64,
    pub callbacks_dropped: u64,
    /// Pingbacks that got no 2xx (or no answer) from the receiver.
    pub callbacks_failed: u64,
}

/// One task the fake knows.
#[derive(Debug, Clone, Serialize)]
pub struct FakeTask {
    pub id: u64,
    pub method: String,
    pub pingback: Option<String>,
    /// The answer (a token or an error code) once solved.
    pub answer: Option<String>,
    pub callback_statuses: Vec<u16>,
    /// Pingbacks the fake decided to send at solve time (0 = dropped, 2 = duplicated).
    pub pingbacks_planned: u8,
    /// Whether those pingbacks are sent late (`late_callback_ms` after the solve).
    pub late: bool,
    #[serde(skip)]
    solved_at: Option<Instant>,
}

impl FakeTask {
    /// Solved, and every pingback planned for now has been sent (late ones are not waited for).
    pub fn settled(&self) -> bool {
        self.answer.is_some() && (self.late || self.callback_statuses.len() >= usize::from(self.pingbacks_planned))
    }
}

struct Inner {
    config: FakeConfig,
    counts: Counts,
    tasks: HashMap<u64, FakeTask>,
    next_id: u64,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    http: reqwest::Client,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a test thread panicked; the data is still usable.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// A running fake. Dropping it stops the server.
pub struct FakeCaptchaAi {
    addr: SocketAddr,
    shared: Shared,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for FakeCaptchaAi {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// splitmix64: a tiny deterministic mixer for the fault choices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn chance(seed: u64, id: u64, salt: u64, p: f64) -> bool {
    let x = mix(seed ^ mix(id ^ salt)) as f64 / u64::MAX as f64;
    x < p
}

impl FakeCaptchaAi {
    /// Starts on 127.0.0.1 on a free port.
    pub async fn start(config: FakeConfig) -> anyhow::Result<Self> {
        Self::start_on("127.0.0.1:0", config).await
    }

    pub async fn start_on(bind: &str, config: FakeConfig) -> anyhow::Result<Self> {
        let shared = Shared {
            inner: Arc::new(Mutex::new(Inner {
                config,
                counts: Counts::default(),
                tasks: HashMap::new(),
                next_id: 70_000_000,
            })),
            http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
        };
        let app = Router::new()
            .route("/in.php", any(in_php))
            .route("/res.php", any(res_php))
            .route("/_fake/stats", get(stats))
            .route("/_fake/config", axum::routing::post(set_config))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.await;
                })
                .await;
        });
        Ok(Self { addr, shared, shutdown: Some(tx) })
    }

    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn api_key(&self) -> String {
        self.shared.lock().config.api_key.clone()
    }

    pub fn counts(&self) -> Counts {
        self.shared.lock().counts
    }

    /// Changes the knobs; applies to what happens from now on.
    pub fn configure(&self, f: impl FnOnce(&mut FakeConfig)) {
        f(&mut self.shared.lock().config);
    }

    pub fn task(&self, id: &str) -> Option<FakeTask> {
        let id: u64 = id.parse().ok()?;
        self.shared.lock().tasks.get(&id).cloned()
    }

    pub fn tasks(&self) -> Vec<FakeTask> {
        let mut v: Vec<FakeTask> = self.shared.lock().tasks.values().cloned().collect();
        v.sort_by_key(|t| t.id);
        v
    }

    /// Adds `n` tasks that are already solved, without pingbacks (for bulk poller tests).
    pub fn preload_solved(&self, n: usize) -> Vec<String> {
        let mut g = self.shared.lock();
        let seed = g.config.seed;
        (0..n)
            .map(|_| {
                g.next_id += 1;
                let id = g.next_id;
                let answer = Some(format!("fake-token-{id}-{:016x}", mix(seed ^ id)));
                g.tasks.insert(
                    id,
                    FakeTask {
                        id,
                        method: "turnstile".into(),
                        pingback: None,
                        answer,
                        callback_statuses: Vec::new(),
                        pingbacks_planned: 0,
                        late: false,
                        solved_at: Some(Instant::now()),
                    },
                );
                id.to_string()
            })
            .collect()
    }

    /// Sends a pingback for a task now, with the given answer (for tests of forged or
    /// conflicting deliveries). Returns the receiver's HTTP status.
    pub async fn deliver(&self, id: &str, code: &str) -> anyhow::Result<u16> {
        let id: u64 = id.parse()?;
        let (url, mode) = {
            let g = self.shared.lock();
            let t = g.tasks.get(&id).ok_or_else(|| anyhow::anyhow!("unknown task {id}"))?;
            (t.pingback.clone().ok_or_else(|| anyhow::anyhow!("task {id} has no pingback"))?, g.config.callback_mode)
        };
        Ok(send_pingback(&self.shared.http, &url, mode, id, code).await?)
    }
}

async fn send_pingback(
    http: &reqwest::Client,
    url: &str,
    mode: CallbackMode,
    id: u64,
    code: &str,
) -> reqwest::Result<u16> {
    let id = id.to_string();
    let req = match mode {
        CallbackMode::Get => http.get(url).query(&[("id", id.as_str()), ("code", code)]),
        CallbackMode::Post => http.post(url).form(&[("id", id.as_str()), ("code", code)]),
    };
    Ok(req.send().await?.status().as_u16())
}

/// Form or query parameters, whichever the request used.
async fn params(
    method: &Method,
    headers: &HeaderMap,
    query: HashMap<String, String>,
    body: axum::body::Bytes,
) -> HashMap<String, String> {
    let mut p = query;
    let is_form = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if *method == Method::POST
        && is_form
        && let Ok(form) = serde_urlencoded::from_bytes::<Vec<(String, String)>>(&body)
    {
        p.extend(form);
    }
    p
}

fn answer(json: bool, ok: bool, request: serde_json::Value) -> Response {
    if json {
        axum::Json(serde_json::json!({ "status": i32::from(ok), "request": request })).into_response()
    } else {
        let text = match request {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        };
        if ok { format!("OK|{text}") } else { text }.into_response()
    }
}

fn key_error(given: Option<&String>, want: &str) -> Option<&'static str> {
    match given {
        Some(k) if k == want => None,
        Some(k) if k.len() == 32 => Some("ERROR_KEY_DOES_NOT_EXIST"),
        _ => Some("ERROR_WRONG_USER_KEY"),
    }
}

fn missing_param(p: &HashMap<String, String>) -> Option<&'static str> {
    let has = |k: &str| p.get(k).is_some_and(|v| !v.is_empty());
    match p.get("method").map(String::as_str) {
        Some("userrecaptcha") if !has("googlekey") => Some("ERROR_GOOGLEKEY"),
        Some("userrecaptcha" | "hcaptcha" | "turnstile") if !has("pageurl") => Some("ERROR_PAGEURL"),
        Some("hcaptcha" | "turnstile") if !has("sitekey") => Some("ERROR_BAD_PARAMETERS"),
        Some("base64") if !has("body") => Some("ERROR_ZERO_CAPTCHA_FILESIZE"),
        Some("userrecaptcha" | "hcaptcha" | "turnstile" | "base64" | "post") => None,
        _ => Some("ERROR_BAD_PARAMETERS"),
    }
}

async fn in_php(
    State(shared): State<Shared>,
    method: Method,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let p = params(&method, &headers, query, body).await;
    let json = p.get("json").is_some_and(|v| v == "1");
    let slow = {
        let mut g = shared.lock();
        g.counts.in_php += 1;
        g.config.in_php_delay_ms
    };
    if slow > 0 {
        tokio::time::sleep(Duration::from_millis(slow)).await;
    }
    let (id, delay, recaptcha) = {
        let mut g = shared.lock();
        if let Some(e) = key_error(p.get("key"), &g.config.api_key) {
            return answer(json, false, e.into());
        }
        if let Some(e) = missing_param(&p) {
            return answer(json, false, e.into());
        }
        if !g.config.submit_errors.is_empty() {
            let code = g.config.submit_errors.remove(0);
            return answer(json, false, code.into());
        }
        g.next_id += 1;
        let id = g.next_id;
        g.counts.tasks_accepted += 1;
        let m = p.get("method").cloned().unwrap_or_default();
        let recaptcha = m == "userrecaptcha";
        g.tasks.insert(
            id,
            FakeTask {
                id,
                method: m,
                pingback: p.get("pingback").cloned(),
                answer: None,
                callback_statuses: Vec::new(),
                pingbacks_planned: 0,
                late: false,
                solved_at: None,
            },
        );
        (id, g.config.solve_delay_ms, recaptcha)
    };
    let worker = shared.clone();
    tokio::spawn(async move { solve_and_deliver(worker, id, delay).await });
    // The id comes back as a JSON number for userrecaptcha, as a string otherwise.
    let id_json = if recaptcha { serde_json::json!(id) } else { serde_json::json!(id.to_string()) };
    answer(json, true, id_json)
}

async fn solve_and_deliver(shared: Shared, id: u64, delay_ms: u64) {
    tokio::time::sleep(Duration::from_millis(delay_ms)).await;
    let plan = {
        let mut g = shared.lock();
        let cfg = g.config.clone();
        let Some(t) = g.tasks.get_mut(&id) else { return };
        let code = cfg.result_code.clone().unwrap_or_else(|| format!("fake-token-{id}-{:016x}", mix(cfg.seed ^ id)));
        t.answer = Some(code.clone());
        t.solved_at = Some(Instant::now());
        let url = t.pingback.clone();
        match url {
            None => None,
            Some(_) if chance(cfg.seed, id, 1, cfg.drop_callbacks) => {
                g.counts.callbacks_dropped += 1;
                None
            }
            Some(url) => {
                let times = if chance(cfg.seed, id, 2, cfg.duplicate_callbacks) { 2 } else { 1 };
                let late = chance(cfg.seed, id, 3, cfg.late_callbacks);
                if let Some(t) = g.tasks.get_mut(&id) {
                    t.pingbacks_planned = times;
                    t.late = late;
                }
                let delay = cfg.callback_delay_ms + if late { cfg.late_callback_ms } else { 0 };
                Some((url, code, times, cfg.callback_mode, delay))
            }
        }
    };
    let Some((url, code, times, mode, cb_delay)) = plan else { return };
    if cb_delay > 0 {
        tokio::time::sleep(Duration::from_millis(cb_delay)).await;
    }
    for _ in 0..times {
        let status = send_pingback(&shared.http, &url, mode, id, &code).await.unwrap_or(0);
        let mut g = shared.lock();
        g.counts.callbacks_sent += 1;
        if !(200..300).contains(&status) {
            g.counts.callbacks_failed += 1;
        }
        if let Some(t) = g.tasks.get_mut(&id) {
            t.callback_statuses.push(status);
        }
    }
}

fn read_one(g: &Inner, id: &str) -> (bool, String) {
    match id.trim().parse::<u64>().ok().and_then(|n| g.tasks.get(&n)) {
        None => (false, "ERROR_WRONG_CAPTCHA_ID".into()),
        Some(t) => match (&t.answer, &g.config.result_code) {
            (None, _) => (false, "CAPCHA_NOT_READY".into()),
            (Some(a), Some(c)) if a == c => (false, a.clone()),
            (Some(a), _) => (true, a.clone()),
        },
    }
}

async fn res_php(
    State(shared): State<Shared>,
    method: Method,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let p = params(&method, &headers, query, body).await;
    let json = p.get("json").is_some_and(|v| v == "1");
    let mut g = shared.lock();
    g.counts.res_php += 1;
    if let Some(e) = key_error(p.get("key"), &g.config.api_key) {
        return answer(json, false, e.into());
    }
    match p.get("action").map(String::as_str) {
        Some("get") => {}
        Some("getbalance") => return answer(json, true, "10.00".into()),
        Some("reportbad" | "reportgood") => return answer(json, true, "OK_REPORT_RECORDED".into()),
        _ => return answer(json, false, "ERROR_EMPTY_ACTION".into()),
    }
    if let Some(ids) = p.get("ids") {
        if !g.config.batch_supported {
            return answer(json, false, "ERROR_WRONG_ID_FORMAT".into());
        }
        let ids: Vec<&str> = ids.split(',').filter(|s| !s.is_empty()).collect();
        g.counts.res_php_ids += ids.len() as u64;
        let parts: Vec<String> = ids.iter().map(|id| read_one(&g, id).1).collect();
        return answer(json, true, parts.join("|").into());
    }
    let Some(id) = p.get("id") else { return answer(json, false, "ERROR_WRONG_ID_FORMAT".into()) };
    g.counts.res_php_ids += 1;
    let (ok, text) = read_one(&g, id);
    answer(json, ok, text.into())
}

async fn stats(State(shared): State<Shared>) -> impl IntoResponse {
    let g = shared.lock();
    axum::Json(serde_json::json!({ "counts": g.counts, "config": g.config, "tasks": g.tasks.len() }))
}

async fn set_config(State(shared): State<Shared>, axum::Json(cfg): axum::Json<FakeConfig>) -> impl IntoResponse {
    shared.lock().config = cfg;
    "ok"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fault_choices_follow_the_rates() {
        let dropped = (0..10_000u64).filter(|id| chance(7, *id, 1, 0.3)).count();
        assert!((2_700..3_300).contains(&dropped), "{dropped}");
        assert_eq!((0..1000u64).filter(|id| chance(7, *id, 1, 0.0)).count(), 0);
        assert_eq!((0..1000u64).filter(|id| chance(7, *id, 1, 1.0)).count(), 1000);
    }

    #[tokio::test]
    async fn speaks_in_php_and_res_php_in_json_and_plain() -> anyhow::Result<()> {
        let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 30, ..FakeConfig::default() }).await?;
        let http = reqwest::Client::new();
        let key = fake.api_key();
        let r: serde_json::Value = http
            .post(format!("{}/in.php", fake.base_url()))
            .form(&[
                ("key", key.as_str()),
                ("method", "userrecaptcha"),
                ("googlekey", "g"),
                ("pageurl", "https://a.example"),
                ("json", "1"),
            ])
            .send()
            .await?
            .json()
            .await?;
        assert_eq!(r["status"], 1);
        assert!(r["request"].is_number(), "userrecaptcha ids are JSON numbers: {r}");
        let id = r["request"].to_string();
        let url = format!("{}/res.php?key={key}&action=get&id={id}", fake.base_url());
        assert_eq!(http.get(&url).send().await?.text().await?, "CAPCHA_NOT_READY");
        tokio::time::sleep(Duration::from_millis(80)).await;
        let plain = http.get(&url).send().await?.text().await?;
        assert!(plain.starts_with("OK|fake-token-"), "{plain}");
        let bad =
            http.get(format!("{}/res.php?key=x&action=get&id={id}", fake.base_url())).send().await?.text().await?;
        assert_eq!(bad, "ERROR_WRONG_USER_KEY");
        assert_eq!(fake.counts().res_php, 3);
        assert_eq!(fake.counts().in_php, 1);
        Ok(())
    }
}

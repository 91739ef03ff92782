//! A fake CaptchaAI: a real HTTP server speaking the 2captcha v1 protocol (in.php, res.php,
//! pingbacks by GET or POST form) that can behave like CaptchaAI at its worst.
//!
//! It runs on a [`Clock`]: the system's for tests in real time, or a simulated one
//! ([`relay_time::ManualClock`]) so an hour of traffic takes seconds. On it:
//! - solve times per kind (`realistic_solve_times`: image and BLS 5–20 s, Turnstile 10–15 s,
//!   reCAPTCHA, hCaptcha, GeeTest and Cloudflare 15–60 s), each task's solve time recorded for age checks, and a share of
//!   tasks ending `ERROR_CAPTCHA_UNSOLVABLE` (after 90 s, 300 s for reCAPTCHA v2);
//! - pingbacks dropped, duplicated, late — by seeded chance, so runs repeat;
//! - `ids=` not understood (`batch_supported: false` answers what a server ignoring it would);
//! - the ban rules enforced: `ERROR: 1005` when res.php requests R > 20 × C + 1200 in the window,
//!   `ERROR: 1004` after 5 bad-key requests in a minute, `MAX_USER_TURN` for more than 60 submits
//!   in 3 s, and `IP_BANNED` on demand; every request during a ban is answered with the ban and
//!   counted;
//! - a thread plan (`threads`): with n threads, in.php answers "no free thread" (CaptchaAI's
//!   `ERROR_ZERO_BALANCE`; 2captcha's `ERROR_NO_SLOT_AVAILABLE`) while n
//!   tasks are in work (submitted and not yet solved on the clock), and the NO_SLOT ban rules are
//!   enforced: `ERROR: 1001` (10 min) after 120 NO_SLOT answers in a minute, `ERROR: 1003` (30 s)
//!   when the NO_SLOT answers of the last minute reach 3 × the captchas accepted in it (from 30
//!   NO_SLOT answers on); [`FakeCaptchaAi::max_no_slot_per_minute`] and
//!   [`FakeCaptchaAi::peak_in_work`] tell tests how close a client came;
//! - fault windows on the clock: 5xx, HTML pages and slow answers, on in.php or res.php;
//! - in.php answers that fail *after* the task was accepted (502, HTML, a cut connection, no
//!   answer in time): the task is paid for and solved all the same;
//! - CaptchaAI's own facts where they differ from 2captcha's ([`Flavor`]; docs/compat.md gives
//!   each one's public source): `hcaptcha` answered `ERROR_SERVER_ERROR`, reports answered with
//!   an empty 200, `threadsinfo`, a `user_agent` beside reCAPTCHA Enterprise and Cloudflare
//!   tokens, GeeTest v3 / Cloudflare challenge / BLS tasks, and a plan that has run out
//!   (`plan_expired`: `ERROR_ZERO_BALANCE` with threads free).
//!
//! It counts every request it receives, so tests assert on traffic, not on what the relay says.

use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, Method};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use relay_time::{Clock, SystemClock, Timestamp};
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

/// Which endpoint a fault window applies to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Endpoint {
    InPhp,
    ResPhp,
    Both,
}

/// What a fault window does to each request in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum FaultKind {
    /// HTTP 502 with an HTML body, as a CDN in front of the origin answers.
    Http5xx,
    /// HTTP 200 with a maintenance page.
    Html,
    /// The answer, after a real-time delay (to provoke client timeouts).
    Slow { ms: u64 },
}

/// A fault on the clock: from `from_ms` (inclusive) to `until_ms` (exclusive), epoch ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Fault {
    pub from_ms: u64,
    pub until_ms: u64,
    pub endpoint: Endpoint,
    #[serde(flatten)]
    pub kind: FaultKind,
}

/// How in.php fails after it accepted a task (the task exists and is solved all the same).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AfterAccept {
    /// HTTP 502 from a CDN in front of the origin.
    Http502,
    /// An HTML error page with status 200.
    Html,
    /// The connection is closed without an answer.
    Cut,
    /// No answer for this long (real time), then the normal answer.
    Slow { ms: u64 },
}

/// The knobs. Change them at any time with [`FakeCaptchaAi::configure`] or `POST /_fake/config`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct FakeConfig {
    /// The account key in.php and res.php accept.
    pub api_key: String,
    /// Time from submit to solved, when solve times are not realistic.
    pub solve_delay_ms: u64,
    /// Solve times drawn per kind from the protocol's figures instead of `solve_delay_ms`.
    pub realistic_solve_times: bool,
    /// Fraction (0..=1) of tasks that end `ERROR_CAPTCHA_UNSOLVABLE` (after 90 s, 300 s for
    /// reCAPTCHA v2; after `solve_delay_ms` when solve times are not realistic).
    pub unsolvable: f64,
    pub callback_mode: CallbackMode,
    /// Fraction (0..=1) of pingbacks never sent.
    pub drop_callbacks: f64,
    /// Fraction (0..=1) of pingbacks sent twice.
    pub duplicate_callbacks: f64,
    /// Extra wait between solving and sending the pingback.
    pub callback_delay_ms: u64,
    /// Codes that the next submits answer, one each, in order (then submits succeed).
    pub submit_errors: Vec<String>,
    /// How the next submits fail after accepting their task, one each, in order.
    pub after_accept: Vec<AfterAccept>,
    /// If set, every task ends with this code instead of a solution.
    pub result_code: Option<String>,
    /// Whether `res.php?action=get&ids=…` is understood. CaptchaAI is not known to: a server
    /// that ignores `ids=` sees no `id` and answers `ERROR_WRONG_CAPTCHA_ID`.
    pub batch_supported: bool,
    /// Seed for every chance choice, so runs repeat.
    pub seed: u64,
    /// Delay (real time) before in.php answers.
    pub in_php_delay_ms: u64,
    /// Fraction (0..=1) of pingbacks sent late, `late_callback_ms` after the solve.
    pub late_callbacks: f64,
    pub late_callback_ms: u64,
    /// Fraction (0..=1) of tasks that get a second pingback with a different answer
    /// (`conflict-<id>`) a second after the real one, as a confused or malicious sender would.
    pub conflicting_callbacks: f64,
    /// Enforce the ban rules (1001, 1003, 1004, 1005, MAX_USER_TURN).
    ///
    /// The NO_SLOT rules (only reachable with `threads` set) count the `ERROR_NO_SLOT_AVAILABLE`
    /// answers and the accepted captchas of the last 60 s, after each NO_SLOT answer (which is
    /// still given; the ban applies from the next request on): 120 of them ban the account for
    /// 10 minutes (`ERROR: 1001`); 30 or more that reach 3 × the captchas accepted ban it for 30 s
    /// (`ERROR: 1003`). A ban starts the NO_SLOT count afresh, so the first NO_SLOT after it lifts
    /// does not ban again at once.
    pub enforce_bans: bool,
    /// The window of the R ≤ 20 × C + 1200 rule. The protocol gives no window; a day is taken
    /// (the rule then holds for any client that keeps to ~20 reads a task). A 10-minute window
    /// would ban any client that polls a burst of never-solving tasks by the documented
    /// schedule, so it is not the rule CaptchaAI can be applying.
    pub ban_window_ms: u64,
    /// Fault windows on the clock.
    pub faults: Vec<Fault>,
    /// What `action=getbalance` answers.
    pub balance: String,
    /// The account's thread plan: how many tasks may be in work at once (from submit until
    /// solved, on the fake's clock). `None` (the default): unlimited. With `Some(n)`, a submit
    /// while n tasks are in work is answered "no free thread" (status 0; see [`Flavor`]); it creates no
    /// task and is not counted as accepted, but it is counted in [`Counts::no_slot`] and by the
    /// NO_SLOT ban rules (see `enforce_bans`). Scripted `submit_errors` are answered first.
    pub threads: Option<u32>,
    /// The upstream it plays (see [`Flavor`]): CaptchaAI (the default) or 2captcha.
    pub flavor: Flavor,
    /// CaptchaAI's plan has run out (expired, no balance): every submit is answered
    /// `ERROR_ZERO_BALANCE` while `threadsinfo` shows threads free.
    pub plan_expired: bool,
}

/// Which service's public behaviour the fake follows where CaptchaAI and 2captcha differ
/// (docs/compat.md lists each fact with its source).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Flavor {
    /// CaptchaAI: `hcaptcha` answered `ERROR_SERVER_ERROR`; reports answered with an empty
    /// 200; a full plan answered `ERROR_ZERO_BALANCE` ("no free threads"); `threadsinfo`;
    /// enterprise and Cloudflare answers with a `user_agent`; GeeTest answers as a JSON string.
    #[default]
    Captchaai,
    /// 2captcha: hCaptcha solved; reports answered `OK_REPORT_RECORDED`; a full plan answered
    /// `ERROR_NO_SLOT_AVAILABLE`; GeeTest answers as a JSON object.
    Twocaptcha,
}

impl Default for FakeConfig {
    fn default() -> Self {
        Self {
            api_key: "0123456789abcdef0123456789abcdef".into(),
            solve_delay_ms: 50,
            realistic_solve_times: false,
            unsolvable: 0.0,
            callback_mode: CallbackMode::Get,
            drop_callbacks: 0.0,
            duplicate_callbacks: 0.0,
            callback_delay_ms: 0,
            submit_errors: Vec::new(),
            after_accept: Vec::new(),
            result_code: None,
            batch_supported: true,
            seed: 7,
            in_php_delay_ms: 0,
            late_callbacks: 0.0,
            late_callback_ms: 0,
            conflicting_callbacks: 0.0,
            enforce_bans: true,
            ban_window_ms: 86_400_000,
            faults: Vec::new(),
            balance: "10.00".into(),
            threads: None,
            flavor: Flavor::Captchaai,
            plan_expired: false,
        }
    }
}

impl FakeConfig {
    /// CaptchaAI at its worst, for simulations: realistic solve times, `ids=` not understood,
    /// bans enforced. Faults and drop rates are the test's to add.
    pub fn captchaai_like() -> Self {
        Self { realistic_solve_times: true, batch_supported: false, ..Self::default() }
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
    /// Bans imposed (by a rule or on demand).
    pub bans: u64,
    /// Requests that arrived during a ban (each answered with it).
    pub requests_during_ban: u64,
    /// Requests answered by a fault window (5xx, HTML, slow).
    pub fault_answers: u64,
    /// Submits that were accepted and then answered with a failure.
    pub accepted_then_failed: u64,
    /// Pingbacks sent with a different answer than the task's.
    pub conflicting_sent: u64,
    /// `reportgood` / `reportbad` requests.
    pub reports_good: u64,
    pub reports_bad: u64,
    /// `getbalance` requests.
    pub balance_reads: u64,
    /// Submits answered "no free thread" (`ERROR_ZERO_BALANCE` as CaptchaAI, `ERROR_NO_SLOT_AVAILABLE`
    /// as 2captcha) because every thread was in work, or the plan had run out.
    pub no_slot: u64,
    /// `threadsinfo` requests.
    pub threads_info: u64,
}

/// One task the fake knows.
#[derive(Debug, Clone, Serialize)]
pub struct FakeTask {
    pub id: u64,
    pub method: String,
    pub pingback: Option<String>,
    /// The answer (a token or an error code), once solved.
    pub answer: Option<String>,
    pub submitted_at: Timestamp,
    /// When it is (or was) solved: a token's age counts from here.
    pub solved_at: Timestamp,
    pub callback_statuses: Vec<u16>,
    /// Pingbacks the fake decided to send (0 = dropped, 2 = duplicated).
    pub pingbacks_planned: u8,
    /// Whether those pingbacks are sent late (`late_callback_ms` after the solve).
    pub late: bool,
    /// res.php reads of this task (a batch read counts once per id).
    pub reads: u32,
    /// The in.php parameters it came with (all but `key`).
    pub params: std::collections::BTreeMap<String, String>,
    #[serde(skip)]
    result: String,
    /// The user agent its solution was earned with (reCAPTCHA Enterprise, Cloudflare).
    pub user_agent: Option<String>,
}

impl FakeTask {
    /// Solved, and every pingback planned for now has been sent (late ones are not waited for).
    pub fn settled(&self) -> bool {
        self.answer.is_some() && (self.late || self.callback_statuses.len() >= usize::from(self.pingbacks_planned))
    }
}

/// A pingback to send at a time: (time, task id, 0 = its answer / 1 = a conflicting one).
#[derive(Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Due(std::cmp::Reverse<(u64, u64, u8)>);

struct Inner {
    config: FakeConfig,
    counts: Counts,
    tasks: HashMap<u64, FakeTask>,
    next_id: u64,
    pingbacks: BinaryHeap<Due>,
    /// The ban in force: until (epoch ms) and its code.
    ban: Option<(u64, String)>,
    res_php_times: VecDeque<u64>,
    accept_times: VecDeque<u64>,
    bad_key_times: VecDeque<u64>,
    submit_times: VecDeque<u64>,
    /// When the tasks in work are solved (epoch ms), soonest first.
    in_work: BinaryHeap<std::cmp::Reverse<u64>>,
    /// The most tasks in work at once, as seen at an accept.
    peak_in_work: u32,
    /// NO_SLOT answers of the last minute (for the peak per minute).
    no_slot_times: VecDeque<u64>,
    /// res.php requests in the current whole second of the fake's clock (second, count), and
    /// the most in any one.
    res_php_second: (u64, u64),
    max_res_php_per_second: u64,
    max_no_slot_per_minute: u64,
    /// When the last NO_SLOT ban was imposed: the ban rules count only NO_SLOT answers after it.
    no_slot_banned_at: u64,
    /// Accepts of the last minute (for 1003).
    minute_accepts: VecDeque<u64>,
}

#[derive(Clone)]
struct Shared {
    inner: Arc<Mutex<Inner>>,
    http: reqwest::Client,
    clock: Arc<dyn Clock>,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A poisoned lock only means a test thread panicked; the data is still usable.
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn now(&self) -> u64 {
        self.clock.now().as_millis()
    }
}

/// A running fake. Dropping it stops the server and its pingbacks.
pub struct FakeCaptchaAi {
    addr: SocketAddr,
    shared: Shared,
    shutdown: Option<tokio::sync::watch::Sender<bool>>,
}

impl Drop for FakeCaptchaAi {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(true);
        }
    }
}

/// splitmix64: a tiny deterministic mixer for the chance choices.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// A uniform number in [0, 1) from the seed, the task and a salt.
fn unit(seed: u64, id: u64, salt: u64) -> f64 {
    (mix(seed ^ mix(id ^ salt)) >> 11) as f64 / (1u64 << 53) as f64
}

fn chance(seed: u64, id: u64, salt: u64, p: f64) -> bool {
    unit(seed, id, salt) < p
}

/// Solve time range (ms) by what was submitted, per the protocol's figures.
fn solve_range(p: &HashMap<String, String>) -> (u64, u64) {
    match p.get("method").map(String::as_str) {
        Some("turnstile") => (10_000, 15_000),
        Some("userrecaptcha" | "hcaptcha" | "geetest" | "cloudflare_challenge") => (15_000, 60_000),
        _ => (5_000, 20_000),
    }
}

/// When CaptchaAI gives up on a task (ms after submit).
fn give_up_after(p: &HashMap<String, String>) -> u64 {
    let v3 = p.get("version").is_some_and(|v| v == "v3");
    if p.get("method").is_some_and(|m| m == "userrecaptcha") && !v3 { 300_000 } else { 90_000 }
}

impl FakeCaptchaAi {
    /// Starts on 127.0.0.1 on a free port, in real time.
    pub async fn start(config: FakeConfig) -> anyhow::Result<Self> {
        Self::start_with_clock("127.0.0.1:0", config, Arc::new(SystemClock)).await
    }

    pub async fn start_on(bind: &str, config: FakeConfig) -> anyhow::Result<Self> {
        Self::start_with_clock(bind, config, Arc::new(SystemClock)).await
    }

    /// Starts on a clock of the caller's (a simulated one, say).
    pub async fn start_with_clock(bind: &str, config: FakeConfig, clock: Arc<dyn Clock>) -> anyhow::Result<Self> {
        let shared = Shared {
            inner: Arc::new(Mutex::new(Inner {
                config,
                counts: Counts::default(),
                tasks: HashMap::new(),
                next_id: 70_000_000,
                pingbacks: BinaryHeap::new(),
                ban: None,
                res_php_times: VecDeque::new(),
                accept_times: VecDeque::new(),
                bad_key_times: VecDeque::new(),
                submit_times: VecDeque::new(),
                in_work: BinaryHeap::new(),
                peak_in_work: 0,
                no_slot_times: VecDeque::new(),
                res_php_second: (0, 0),
                max_res_php_per_second: 0,
                max_no_slot_per_minute: 0,
                no_slot_banned_at: 0,
                minute_accepts: VecDeque::new(),
            })),
            http: reqwest::Client::builder().timeout(Duration::from_secs(10)).build()?,
            clock,
        };
        let app = Router::new()
            .route("/in.php", any(in_php))
            .route("/res.php", any(res_php))
            .route("/_fake/stats", get(stats))
            .route("/_fake/config", axum::routing::post(set_config))
            .with_state(shared.clone());
        let listener = tokio::net::TcpListener::bind(bind).await?;
        let addr = listener.local_addr()?;
        let (tx, rx) = tokio::sync::watch::channel(false);
        let mut server_rx = rx.clone();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = server_rx.wait_for(|s| *s).await;
                })
                .await;
        });
        // The pingback sender is an actor on the clock: it holds a busy guard for its life.
        let busy = shared.clock.busy();
        tokio::spawn(dispatch_pingbacks(shared.clone(), rx, busy));
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

    /// Tasks in work now: submitted and not yet solved on the fake's clock.
    pub fn in_work(&self) -> u32 {
        let now = self.shared.now();
        in_work_at(&mut self.shared.lock(), now)
    }

    /// The most tasks in work at once, as seen at an accept (the accepted task included).
    pub fn peak_in_work(&self) -> u32 {
        self.shared.lock().peak_in_work
    }

    /// The most res.php requests in any one whole second of the fake's clock so far (an
    /// account-wide rate the relay must hold across all its pollers).
    pub fn max_res_php_per_second(&self) -> u64 {
        self.shared.lock().max_res_php_per_second
    }

    /// The most `ERROR_NO_SLOT_AVAILABLE` answers in any 60 s window so far.
    pub fn max_no_slot_per_minute(&self) -> u64 {
        self.shared.lock().max_no_slot_per_minute
    }

    /// Bans every request (`IP_BANNED`) for `d` from now on the fake's clock.
    pub fn ban_ip(&self, d: Duration) {
        let until = self.shared.now().saturating_add(u64::try_from(d.as_millis()).unwrap_or(u64::MAX));
        let mut g = self.shared.lock();
        g.ban = Some((until, "IP_BANNED".into()));
        g.counts.bans += 1;
    }

    /// The ban in force now, if any: until when, and its code.
    pub fn ban_in_force(&self) -> Option<(Timestamp, String)> {
        let now = self.shared.now();
        self.shared.lock().ban.clone().filter(|(u, _)| *u > now).map(|(u, c)| (Timestamp::from_millis(u), c))
    }

    pub fn task(&self, id: &str) -> Option<FakeTask> {
        let id: u64 = id.trim().parse().ok()?;
        let now = self.shared.now();
        self.shared.lock().tasks.get(&id).map(|t| snapshot(t, now))
    }

    pub fn tasks(&self) -> Vec<FakeTask> {
        let now = self.shared.now();
        let mut v: Vec<FakeTask> = self.shared.lock().tasks.values().map(|t| snapshot(t, now)).collect();
        v.sort_by_key(|t| t.id);
        v
    }

    /// Adds `n` tasks that are already solved, without pingbacks (for bulk poller tests).
    pub fn preload_solved(&self, n: usize) -> Vec<String> {
        let now = self.shared.now();
        let mut g = self.shared.lock();
        let seed = g.config.seed;
        (0..n)
            .map(|_| {
                g.next_id += 1;
                let id = g.next_id;
                g.tasks.insert(
                    id,
                    FakeTask {
                        id,
                        method: "turnstile".into(),
                        pingback: None,
                        answer: None,
                        submitted_at: Timestamp::from_millis(now),
                        solved_at: Timestamp::from_millis(now),
                        callback_statuses: Vec::new(),
                        pingbacks_planned: 0,
                        late: false,
                        reads: 0,
                        params: std::collections::BTreeMap::new(),
                        result: token(seed, id),
                        user_agent: None,
                    },
                );
                accepted(&mut g, now, now);
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

fn token(seed: u64, id: u64) -> String {
    format!("fake-token-{id}-{:016x}", mix(seed ^ id))
}

fn snapshot(t: &FakeTask, now: u64) -> FakeTask {
    let mut s = t.clone();
    s.answer = (now >= t.solved_at.as_millis()).then(|| t.result.clone());
    s
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

/// Sends pingbacks when they fall due, on the clock, until the fake stops.
async fn dispatch_pingbacks(shared: Shared, mut stop: tokio::sync::watch::Receiver<bool>, busy: relay_time::Busy) {
    let _busy = busy;
    // How often it looks for new work when none is due sooner: simulated time is free to step.
    let cadence = if shared.clock.is_simulated() { Duration::from_secs(1) } else { Duration::from_millis(20) };
    loop {
        let now = shared.now();
        let due: Vec<(u64, String, String, CallbackMode)> = {
            let mut g = shared.lock();
            let mut out = Vec::new();
            while g.pingbacks.peek().is_some_and(|Due(std::cmp::Reverse((t, _, _)))| *t <= now) {
                let Some(Due(std::cmp::Reverse((_, id, variant)))) = g.pingbacks.pop() else { break };
                let mode = g.config.callback_mode;
                // A conflicting pingback goes out only once the real one was taken (2xx), so it
                // is a conflict and not a race; until then it waits.
                let real_taken =
                    g.tasks.get(&id).is_some_and(|t| t.callback_statuses.iter().any(|s| (200..300).contains(s)));
                if variant == 1 && !real_taken {
                    g.pingbacks.push(Due(std::cmp::Reverse((now + 60_000, id, 1))));
                    continue;
                }
                if let Some(t) = g.tasks.get(&id)
                    && let Some(url) = &t.pingback
                {
                    let code = if variant == 1 { format!("conflict-{id}") } else { t.result.clone() };
                    out.push((id, url.clone(), code, mode));
                }
                if variant == 1 {
                    g.counts.conflicting_sent += 1;
                }
            }
            out
        };
        // Each send holds a guard of its own, lent to the receiver while it works on it (a
        // receiver asleep on the clock balances it); the sender counts as asleep while it waits
        // for them (relay_time::Waiter). One guard for many concurrent sends would let the
        // clock race past the ones still at work as soon as one receiver slept.
        let mut sends = tokio::task::JoinSet::new();
        let waiter = shared.clock.waiter();
        for (id, url, code, mode) in due {
            let (http, shared, busy) = (shared.http.clone(), shared.clone(), waiter.busy());
            sends.spawn(async move {
                let _busy = busy;
                let status = send_pingback(&http, &url, mode, id, &code).await.unwrap_or(0);
                let mut g = shared.lock();
                g.counts.callbacks_sent += 1;
                if !(200..300).contains(&status) {
                    g.counts.callbacks_failed += 1;
                }
                if let Some(t) = g.tasks.get_mut(&id) {
                    t.callback_statuses.push(status);
                }
            });
        }
        while waiter.wait(sends.join_next()).await.is_some() {}
        let next = {
            let g = shared.lock();
            g.pingbacks.peek().map(|Due(std::cmp::Reverse((t, _, _)))| *t)
        };
        let wake = Timestamp::from_millis(now).plus(cadence);
        let wake = next.map_or(wake, |t| wake.min(Timestamp::from_millis(t)));
        tokio::select! {
            _ = shared.clock.sleep_until(wake) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// Form or query parameters, whichever the request used.
fn params(
    method: &Method,
    headers: &HeaderMap,
    query: HashMap<String, String>,
    body: &axum::body::Bytes,
) -> HashMap<String, String> {
    let mut p = query;
    let is_form = headers
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/x-www-form-urlencoded"));
    if *method == Method::POST
        && is_form
        && let Ok(form) = serde_urlencoded::from_bytes::<Vec<(String, String)>>(body)
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

fn missing_param(p: &HashMap<String, String>, flavor: Flavor) -> Option<&'static str> {
    let has = |k: &str| p.get(k).is_some_and(|v| !v.is_empty());
    match p.get("method").map(String::as_str) {
        // CaptchaAI does not solve hCaptcha: every probe of its own workflow tool was answered so.
        Some("hcaptcha") if flavor == Flavor::Captchaai => Some("ERROR_SERVER_ERROR"),
        Some("userrecaptcha") if !has("googlekey") => Some("ERROR_GOOGLEKEY"),
        Some("userrecaptcha" | "hcaptcha" | "turnstile" | "geetest" | "cloudflare_challenge") if !has("pageurl") => {
            Some("ERROR_PAGEURL")
        }
        Some("hcaptcha" | "turnstile") if !has("sitekey") => Some("ERROR_BAD_PARAMETERS"),
        Some("geetest") if !has("gt") || !has("challenge") => Some("ERROR_BAD_PARAMETERS"),
        Some("cloudflare_challenge") if !has("proxy") || !has("proxytype") => Some("ERROR_BAD_PROXY"),
        Some("bls") if !has("instructions") || !(1..=9).all(|i| has(&format!("image_base64_{i}"))) => {
            Some("ERROR_BAD_PARAMETERS")
        }
        Some("base64") if !has("body") => Some("ERROR_ZERO_CAPTCHA_FILESIZE"),
        Some(
            "userrecaptcha" | "hcaptcha" | "turnstile" | "base64" | "post" | "geetest" | "cloudflare_challenge" | "bls",
        ) => None,
        _ => Some("ERROR_BAD_PARAMETERS"),
    }
}

/// The answer a solved task gets for its method (a GeeTest object, BLS's cells, a token), as
/// text; what `res.php` and the pingback carry.
fn result_for(seed: u64, id: u64, p: &HashMap<String, String>, flavor: Flavor) -> String {
    let t = token(seed, id);
    match p.get("method").map(String::as_str) {
        Some("geetest") => {
            let keys = if flavor == Flavor::Captchaai {
                ("challenge", "validate", "seccode")
            } else {
                ("geetest_challenge", "geetest_validate", "geetest_seccode")
            };
            serde_json::json!({ keys.0: format!("{t}-c"), keys.1: format!("{t}-v"), keys.2: format!("{t}-v|jordan") })
                .to_string()
        }
        Some("bls") => format!("[{}, {}, {}]", 1 + id % 3, 4 + id % 3, 7 + id % 3),
        _ => t,
    }
}

/// The user agent a solution is earned with: the owner's (`userAgent`), else the solver's own,
/// for the kinds whose answers carry one (reCAPTCHA Enterprise, a Cloudflare challenge).
fn user_agent_for(p: &HashMap<String, String>) -> Option<String> {
    let carries = p.get("method").is_some_and(|m| m == "cloudflare_challenge")
        || (p.get("method").is_some_and(|m| m == "userrecaptcha") && p.get("enterprise").is_some_and(|e| e == "1"));
    carries.then(|| {
        p.get("userAgent").cloned().unwrap_or_else(|| "Mozilla/5.0 (Windows NT 10.0; Win64; x64) FakeSolver/1.0".into())
    })
}

fn html_page(status: u16) -> Response {
    let body = "<!DOCTYPE html><html><head><title>Error</title></head><body><h1>Bad gateway</h1></body></html>";
    (
        axum::http::StatusCode::from_u16(status).unwrap_or(axum::http::StatusCode::BAD_GATEWAY),
        axum::response::Html(body),
    )
        .into_response()
}

/// Drops the connection without an answer (the server task ends mid-request). No panic hook
/// runs for `resume_unwind`, so nothing is printed.
fn cut_connection() -> ! {
    std::panic::resume_unwind(Box::new("fake-captchaai: connection cut on purpose"))
}

/// The fault window in force for `endpoint` at `now`, if any.
fn fault_at(g: &Inner, endpoint: Endpoint, now: u64) -> Option<FaultKind> {
    g.config
        .faults
        .iter()
        .find(|f| (f.endpoint == endpoint || f.endpoint == Endpoint::Both) && (f.from_ms..f.until_ms).contains(&now))
        .map(|f| f.kind)
}

/// Keeps only the times inside the window ending now.
fn trim(times: &mut VecDeque<u64>, now: u64, window: u64) {
    while times.front().is_some_and(|t| *t + window <= now) {
        times.pop_front();
    }
}

/// The ban rules, before a request is served. `Some(code)`: answer that code.
fn ban_check(g: &mut Inner, now: u64) -> Option<String> {
    if let Some((until, code)) = &g.ban {
        if now < *until {
            let code = code.clone();
            g.counts.requests_during_ban += 1;
            return Some(code);
        }
        g.ban = None;
    }
    None
}

fn impose(g: &mut Inner, now: u64, ms: u64, code: &str) {
    g.ban = Some((now + ms, code.to_owned()));
    g.counts.bans += 1;
    tracing::warn!(code, "fake CaptchaAI imposed a ban");
}

/// Counts a bad-key answer; the fifth in a minute bans the IP for 10 minutes (`ERROR: 1004`).
fn bad_key(g: &mut Inner, now: u64) {
    g.bad_key_times.push_back(now);
    trim(&mut g.bad_key_times, now, 60_000);
    if g.config.enforce_bans && g.bad_key_times.len() >= 5 {
        impose(g, now, 600_000, "ERROR: 1004");
    }
}

/// Tasks in work at `now` (forgetting those solved by then).
fn in_work_at(g: &mut Inner, now: u64) -> u32 {
    while g.in_work.peek().is_some_and(|std::cmp::Reverse(t)| *t <= now) {
        g.in_work.pop();
    }
    u32::try_from(g.in_work.len()).unwrap_or(u32::MAX)
}

/// Counts an accepted task, solved at `solved_at`, and the tasks in work with it.
fn accepted(g: &mut Inner, now: u64, solved_at: u64) {
    g.counts.tasks_accepted += 1;
    g.accept_times.push_back(now);
    g.minute_accepts.push_back(now);
    trim(&mut g.minute_accepts, now, 60_000);
    if solved_at > now {
        g.in_work.push(std::cmp::Reverse(solved_at));
    }
    let in_work = in_work_at(g, now);
    g.peak_in_work = g.peak_in_work.max(in_work);
}

/// Counts a NO_SLOT answer and applies its ban rules: 120 in a minute ban the account for 10
/// minutes (`ERROR: 1001`); 30 or more in a minute reaching 3 × the captchas accepted in it ban
/// it for 30 s (`ERROR: 1003`). The answer itself is still NO_SLOT; a ban starts the count afresh.
fn no_slot(g: &mut Inner, now: u64) {
    g.counts.no_slot += 1;
    g.no_slot_times.push_back(now);
    trim(&mut g.no_slot_times, now, 60_000);
    g.max_no_slot_per_minute = g.max_no_slot_per_minute.max(g.no_slot_times.len() as u64);
    trim(&mut g.minute_accepts, now, 60_000);
    if !g.config.enforce_bans {
        return;
    }
    let after_ban = g.no_slot_times.iter().rev().take_while(|t| **t > g.no_slot_banned_at).count();
    let (n, c) = (after_ban as u64, g.minute_accepts.len() as u64);
    let ban = if n >= 120 {
        Some((600_000, "ERROR: 1001"))
    } else if n >= 30 && n >= 3 * c {
        Some((30_000, "ERROR: 1003"))
    } else {
        None
    };
    if let Some((ms, code)) = ban {
        impose(g, now, ms, code);
        g.no_slot_banned_at = now;
    }
}

/// A fault's answer, if one is in force (slow answers sleep in real time, then go on).
async fn apply_fault(shared: &Shared, endpoint: Endpoint) -> Option<Response> {
    let now = shared.now();
    let fault = {
        let mut g = shared.lock();
        let f = fault_at(&g, endpoint, now);
        if f.is_some() {
            g.counts.fault_answers += 1;
        }
        f
    };
    match fault? {
        FaultKind::Http5xx => Some(html_page(502)),
        FaultKind::Html => Some(html_page(200)),
        FaultKind::Slow { ms } => {
            tokio::time::sleep(Duration::from_millis(ms)).await;
            None
        }
    }
}

async fn in_php(
    State(shared): State<Shared>,
    method: Method,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let p = params(&method, &headers, query, &body);
    let json = p.get("json").is_some_and(|v| v == "1");
    let slow = {
        let mut g = shared.lock();
        g.counts.in_php += 1;
        g.config.in_php_delay_ms
    };
    if slow > 0 {
        tokio::time::sleep(Duration::from_millis(slow)).await;
    }
    if let Some(r) = apply_fault(&shared, Endpoint::InPhp).await {
        return r;
    }
    let now = shared.now();
    let (id, recaptcha, after) = {
        let mut g = shared.lock();
        if let Some(code) = ban_check(&mut g, now) {
            return answer(json, false, code.into());
        }
        if let Some(e) = key_error(p.get("key"), &g.config.api_key) {
            bad_key(&mut g, now);
            return answer(json, false, e.into());
        }
        g.submit_times.push_back(now);
        trim(&mut g.submit_times, now, 3_000);
        if g.config.enforce_bans && g.submit_times.len() > 60 {
            impose(&mut g, now, 10_000, "MAX_USER_TURN");
            return answer(json, false, "MAX_USER_TURN".into());
        }
        if let Some(e) = missing_param(&p, g.config.flavor) {
            return answer(json, false, e.into());
        }
        if g.config.plan_expired {
            // The plan ran out: CaptchaAI's "no free thread" code, with threads free.
            no_slot(&mut g, now);
            return answer(json, false, "ERROR_ZERO_BALANCE".into());
        }
        if !g.config.submit_errors.is_empty() {
            let code = g.config.submit_errors.remove(0);
            return answer(json, false, code.into());
        }
        if let Some(threads) = g.config.threads
            && in_work_at(&mut g, now) >= threads
        {
            no_slot(&mut g, now);
            // CaptchaAI's documented answer for "no free threads" is ERROR_ZERO_BALANCE;
            // 2captcha's, ERROR_NO_SLOT_AVAILABLE.
            let code =
                if g.config.flavor == Flavor::Captchaai { "ERROR_ZERO_BALANCE" } else { "ERROR_NO_SLOT_AVAILABLE" };
            return answer(json, false, code.into());
        }
        g.next_id += 1;
        let id = g.next_id;
        let cfg = g.config.clone();
        let (lo, hi) = solve_range(&p);
        let unsolvable = chance(cfg.seed, id, 4, cfg.unsolvable);
        let solve_ms = match (cfg.realistic_solve_times, unsolvable) {
            (true, true) => give_up_after(&p),
            (true, false) => lo + ((hi - lo) as f64 * unit(cfg.seed, id, 5)) as u64,
            (false, _) => cfg.solve_delay_ms,
        };
        let result = match (&cfg.result_code, unsolvable) {
            (Some(c), _) => c.clone(),
            (None, true) => "ERROR_CAPTCHA_UNSOLVABLE".into(),
            (None, false) => result_for(cfg.seed, id, &p, cfg.flavor),
        };
        let user_agent = user_agent_for(&p);
        let m = p.get("method").cloned().unwrap_or_default();
        let recaptcha = m == "userrecaptcha";
        let pingback = p.get("pingback").cloned();
        let solved_at = now + solve_ms;
        let mut planned = 0u8;
        let mut late = false;
        if pingback.is_some() {
            if chance(cfg.seed, id, 1, cfg.drop_callbacks) {
                g.counts.callbacks_dropped += 1;
            } else {
                planned = if chance(cfg.seed, id, 2, cfg.duplicate_callbacks) { 2 } else { 1 };
                late = chance(cfg.seed, id, 3, cfg.late_callbacks);
                let at = solved_at + cfg.callback_delay_ms + if late { cfg.late_callback_ms } else { 0 };
                for _ in 0..planned {
                    g.pingbacks.push(Due(std::cmp::Reverse((at, id, 0))));
                }
                if chance(cfg.seed, id, 6, cfg.conflicting_callbacks) {
                    g.pingbacks.push(Due(std::cmp::Reverse((at + 1_000, id, 1))));
                }
            }
        }
        g.tasks.insert(
            id,
            FakeTask {
                id,
                method: m,
                pingback,
                answer: None,
                submitted_at: Timestamp::from_millis(now),
                solved_at: Timestamp::from_millis(solved_at),
                callback_statuses: Vec::new(),
                pingbacks_planned: planned,
                late,
                reads: 0,
                params: p.iter().filter(|(k, _)| k.as_str() != "key").map(|(k, v)| (k.clone(), v.clone())).collect(),
                result,
                user_agent,
            },
        );
        accepted(&mut g, now, solved_at);
        let after = if g.config.after_accept.is_empty() { None } else { Some(g.config.after_accept.remove(0)) };
        if after.is_some() {
            g.counts.accepted_then_failed += 1;
        }
        (id, recaptcha, after)
    };
    match after {
        Some(AfterAccept::Http502) => return html_page(502),
        Some(AfterAccept::Html) => return html_page(200),
        Some(AfterAccept::Cut) => cut_connection(),
        Some(AfterAccept::Slow { ms }) => tokio::time::sleep(Duration::from_millis(ms)).await,
        None => {}
    }
    // The id comes back as a JSON number for userrecaptcha, as a string otherwise.
    let id_json = if recaptcha { serde_json::json!(id) } else { serde_json::json!(id.to_string()) };
    answer(json, true, id_json)
}

fn count_read(g: &mut Inner, id: &str) {
    if let Some(t) = id.trim().parse::<u64>().ok().and_then(|n| g.tasks.get_mut(&n)) {
        t.reads += 1;
    }
}

fn read_one(g: &Inner, id: &str, now: u64) -> (bool, String) {
    match id.trim().parse::<u64>().ok().and_then(|n| g.tasks.get(&n)) {
        None => (false, "ERROR_WRONG_CAPTCHA_ID".into()),
        Some(t) if now < t.solved_at.as_millis() => (false, "CAPCHA_NOT_READY".into()),
        Some(t) => {
            let is_code = t.result.starts_with("ERROR") || g.config.result_code.as_deref() == Some(t.result.as_str());
            (!is_code, t.result.clone())
        }
    }
}

async fn res_php(
    State(shared): State<Shared>,
    method: Method,
    headers: HeaderMap,
    Query(query): Query<HashMap<String, String>>,
    body: axum::body::Bytes,
) -> Response {
    let p = params(&method, &headers, query, &body);
    let json = p.get("json").is_some_and(|v| v == "1");
    {
        let now = shared.now();
        let mut g = shared.lock();
        g.counts.res_php += 1;
        let second = now / 1_000;
        let n = if g.res_php_second.0 == second { g.res_php_second.1 + 1 } else { 1 };
        g.res_php_second = (second, n);
        g.max_res_php_per_second = g.max_res_php_per_second.max(n);
    }
    if let Some(r) = apply_fault(&shared, Endpoint::ResPhp).await {
        return r;
    }
    let now = shared.now();
    let mut g = shared.lock();
    if let Some(code) = ban_check(&mut g, now) {
        return answer(json, false, code.into());
    }
    if let Some(e) = key_error(p.get("key"), &g.config.api_key) {
        bad_key(&mut g, now);
        return answer(json, false, e.into());
    }
    // R > 20 × C + 1200 within the window: the account is suspended (ERROR: 1005).
    let window = g.config.ban_window_ms;
    g.res_php_times.push_back(now);
    trim(&mut g.res_php_times, now, window);
    trim(&mut g.accept_times, now, window);
    let (r, c) = (g.res_php_times.len() as u64, g.accept_times.len() as u64);
    if g.config.enforce_bans && r > 20 * c + 1200 {
        impose(&mut g, now, 600_000, "ERROR: 1005");
        return answer(json, false, "ERROR: 1005".into());
    }
    match p.get("action").map(String::as_str) {
        Some("get") => {}
        Some("getbalance") => {
            g.counts.balance_reads += 1;
            return answer(json, true, g.config.balance.clone().into());
        }
        Some(r @ ("reportbad" | "reportgood")) => {
            let known =
                p.get("id").and_then(|id| id.trim().parse::<u64>().ok()).is_some_and(|id| g.tasks.contains_key(&id));
            if !known {
                return answer(json, false, "ERROR_WRONG_CAPTCHA_ID".into());
            }
            if r == "reportgood" {
                g.counts.reports_good += 1;
            } else {
                g.counts.reports_bad += 1;
            }
            // CaptchaAI answers a report with HTTP 200 and no body at all.
            if g.config.flavor == Flavor::Captchaai {
                return "".into_response();
            }
            return answer(json, true, "OK_REPORT_RECORDED".into());
        }
        Some("threadsinfo") if g.config.flavor == Flavor::Captchaai => {
            g.counts.threads_info += 1;
            let working = in_work_at(&mut g, now);
            let threads = g.config.threads.unwrap_or(UNLIMITED_PLAN);
            // An expired plan has no thread at work.
            let working = if g.config.plan_expired { 0 } else { working.min(threads) };
            return axum::Json(serde_json::json!({ "threads": threads, "working_threads": working })).into_response();
        }
        _ => return answer(json, false, "ERROR_EMPTY_ACTION".into()),
    }
    if let Some(ids) = p.get("ids") {
        if !g.config.batch_supported {
            // A server that does not know `ids=` looks for `id` and finds none.
            return answer(json, false, "ERROR_WRONG_CAPTCHA_ID".into());
        }
        let ids: Vec<String> = ids.split(',').filter(|s| !s.is_empty()).map(str::to_owned).collect();
        g.counts.res_php_ids += ids.len() as u64;
        ids.iter().for_each(|id| count_read(&mut g, id));
        let parts: Vec<String> = ids.iter().map(|id| read_one(&g, id, now).1).collect();
        return answer(json, true, parts.join("|").into());
    }
    let Some(id) = p.get("id") else { return answer(json, false, "ERROR_WRONG_CAPTCHA_ID".into()) };
    g.counts.res_php_ids += 1;
    count_read(&mut g, id);
    let (ok, text) = read_one(&g, id, now);
    let task = id.trim().parse::<u64>().ok().and_then(|n| g.tasks.get(&n));
    if json
        && ok
        && let Some(t) = task
    {
        let mut v = serde_json::json!({ "status": 1, "request": text });
        if g.config.flavor == Flavor::Twocaptcha
            && t.method == "geetest"
            && let Ok(obj) = serde_json::from_str::<serde_json::Value>(&text)
        {
            // 2captcha answers a GeeTest task with an object; CaptchaAI's SDK reads a string.
            v["request"] = obj;
        }
        if let Some(ua) = &t.user_agent {
            // Where CaptchaAI's own SDK reads it: beside the token, which it reads from `result`.
            v["user_agent"] = ua.clone().into();
            v["result"] = text.into();
        }
        return axum::Json(v).into_response();
    }
    answer(json, ok, text.into())
}

/// What `threadsinfo` says of a fake without a thread plan.
pub const UNLIMITED_PLAN: u32 = 10_000;

async fn stats(State(shared): State<Shared>) -> impl IntoResponse {
    let now = shared.now();
    let mut g = shared.lock();
    let in_work = in_work_at(&mut g, now);
    axum::Json(serde_json::json!({
        "counts": g.counts,
        "config": g.config,
        "tasks": g.tasks.len(),
        "in_work": in_work,
        "peak_in_work": g.peak_in_work,
        "max_no_slot_per_minute": g.max_no_slot_per_minute,
    }))
}

async fn set_config(State(shared): State<Shared>, axum::Json(cfg): axum::Json<FakeConfig>) -> impl IntoResponse {
    shared.lock().config = cfg;
    "ok"
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_time::ManualClock;

    #[test]
    fn chance_choices_follow_the_rates() {
        let dropped = (0..10_000u64).filter(|id| chance(7, *id, 1, 0.3)).count();
        assert!((2_700..3_300).contains(&dropped), "{dropped}");
        assert_eq!((0..1000u64).filter(|id| chance(7, *id, 1, 0.0)).count(), 0);
        assert_eq!((0..1000u64).filter(|id| chance(7, *id, 1, 1.0)).count(), 1000);
    }

    /// An in.php POST with the fake's key and these fields; the answer's body.
    async fn in_php(http: &reqwest::Client, fake: &FakeCaptchaAi, fields: &[(&str, &str)]) -> anyhow::Result<String> {
        let key = fake.api_key();
        let mut form = vec![("key", key.as_str())];
        form.extend_from_slice(fields);
        Ok(http.post(format!("{}/in.php", fake.base_url())).form(&form).send().await?.text().await?)
    }

    async fn submit(http: &reqwest::Client, fake: &FakeCaptchaAi, method: &str) -> anyhow::Result<serde_json::Value> {
        let fields = [
            ("method", method),
            ("googlekey", "g"),
            ("sitekey", "s"),
            ("pageurl", "https://a.example"),
            ("body", "aGk="),
            ("json", "1"),
        ];
        Ok(serde_json::from_str(&in_php(http, fake, &fields).await?)?)
    }

    #[tokio::test]
    async fn speaks_in_php_and_res_php_in_json_and_plain() -> anyhow::Result<()> {
        let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 30, ..FakeConfig::default() }).await?;
        let http = reqwest::Client::new();
        let key = fake.api_key();
        let r = submit(&http, &fake, "userrecaptcha").await?;
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

    #[tokio::test]
    async fn solve_times_follow_the_kind_on_a_simulated_clock() -> anyhow::Result<()> {
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let fake =
            FakeCaptchaAi::start_with_clock("127.0.0.1:0", FakeConfig::captchaai_like(), Arc::new(clock.clone()))
                .await?;
        let http = reqwest::Client::new();
        for (method, lo, hi) in [("turnstile", 10, 15), ("userrecaptcha", 15, 60), ("base64", 5, 20)] {
            for _ in 0..20 {
                let id = submit(&http, &fake, method).await?["request"].to_string().replace('"', "");
                let t = fake.task(&id).expect("known");
                let secs = t.solved_at.since(t.submitted_at).as_secs_f64();
                assert!((lo as f64..=hi as f64).contains(&secs), "{method}: {secs}");
                assert_eq!(t.answer, None, "not solved before its time");
            }
        }
        clock.advance(Duration::from_secs(61));
        assert!(fake.tasks().iter().all(|t| t.answer.is_some()), "all solved by 60 s");
        Ok(())
    }

    #[tokio::test]
    async fn bans_are_enforced_and_every_request_during_one_is_counted() -> anyhow::Result<()> {
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let fake =
            FakeCaptchaAi::start_with_clock("127.0.0.1:0", FakeConfig::default(), Arc::new(clock.clone())).await?;
        let http = reqwest::Client::new();
        let get = |key: String, id: &str| {
            let url = format!("{}/res.php?key={key}&action=get&id={id}", fake.base_url());
            let http = http.clone();
            async move { http.get(url).send().await?.text().await }
        };
        // 5 bad-key requests in a minute: the IP is banned for 10 minutes.
        for _ in 0..5 {
            assert_eq!(get("0000000000000000000000000000000x".into(), "1").await?, "ERROR_KEY_DOES_NOT_EXIST");
        }
        assert_eq!(get(fake.api_key(), "1").await?, "ERROR: 1004");
        clock.advance(Duration::from_secs(599));
        assert_eq!(get(fake.api_key(), "1").await?, "ERROR: 1004");
        clock.advance(Duration::from_secs(2));
        assert_eq!(get(fake.api_key(), "1").await?, "ERROR_WRONG_CAPTCHA_ID", "lifted after 10 minutes");
        assert_eq!(fake.counts().requests_during_ban, 2);
        // R > 20 C + 1200 with no captchas: the 1201st read is refused with ERROR: 1005.
        for _ in 0..1199 {
            get(fake.api_key(), "1").await?;
        }
        assert_eq!(get(fake.api_key(), "1").await?, "ERROR: 1005");
        // On demand.
        clock.advance(Duration::from_secs(601));
        fake.ban_ip(Duration::from_secs(300));
        assert_eq!(get(fake.api_key(), "1").await?, "IP_BANNED");
        Ok(())
    }

    /// A fake on a simulated clock, with the given thread plan and solve delay.
    async fn fake_on_clock(threads: Option<u32>, solve_delay_ms: u64) -> anyhow::Result<(FakeCaptchaAi, ManualClock)> {
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let config = FakeConfig { threads, solve_delay_ms, ..FakeConfig::default() };
        let fake = FakeCaptchaAi::start_with_clock("127.0.0.1:0", config, Arc::new(clock.clone())).await?;
        Ok((fake, clock))
    }

    /// Submits a Turnstile task and returns in.php's JSON `request` if accepted, or its code.
    async fn turnstile(http: &reqwest::Client, fake: &FakeCaptchaAi) -> anyhow::Result<Result<String, String>> {
        let r = submit(http, fake, "turnstile").await?;
        let request = r["request"].as_str().unwrap_or_default().to_owned();
        Ok(if r["status"] == 1 { Ok(request) } else { Err(request) })
    }

    async fn read(http: &reqwest::Client, fake: &FakeCaptchaAi, id: &str) -> anyhow::Result<String> {
        let url = format!("{}/res.php?key={}&action=get&id={id}", fake.base_url(), fake.api_key());
        Ok(http.get(url).send().await?.text().await?)
    }

    /// CaptchaAI's answer when every thread is in work (2captcha's would be ERROR_NO_SLOT_AVAILABLE).
    const NO_SLOT: &str = "ERROR_ZERO_BALANCE";

    #[tokio::test]
    async fn a_thread_plan_refuses_submits_while_every_thread_is_in_work() -> anyhow::Result<()> {
        let (fake, clock) = fake_on_clock(Some(2), 1_000).await?;
        let http = reqwest::Client::new();
        let first = turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        assert_eq!(fake.in_work(), 2);
        // The third concurrent submit: NO_SLOT, in JSON and in plain text; no task is made.
        let r = submit(&http, &fake, "turnstile").await?;
        assert_eq!(r, serde_json::json!({ "status": 0, "request": NO_SLOT }));
        let plain =
            in_php(&http, &fake, &[("method", "turnstile"), ("sitekey", "s"), ("pageurl", "https://a.example")])
                .await?;
        assert_eq!(plain, NO_SLOT);
        let c = fake.counts();
        assert_eq!((c.in_php, c.tasks_accepted, c.no_slot), (4, 2, 2));
        assert_eq!(fake.tasks().len(), 2);
        assert_eq!(fake.ban_in_force(), None);
        // Still in work a millisecond before the solve; free once solved.
        clock.advance(Duration::from_millis(999));
        assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
        assert_eq!(read(&http, &fake, &first).await?, "CAPCHA_NOT_READY");
        clock.advance(Duration::from_millis(1));
        assert_eq!(fake.in_work(), 0);
        assert!(read(&http, &fake, &first).await?.starts_with("OK|fake-token-"));
        turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        assert_eq!((fake.in_work(), fake.peak_in_work()), (1, 2));
        assert_eq!((fake.counts().tasks_accepted, fake.counts().no_slot, fake.max_no_slot_per_minute()), (3, 3, 3));
        // `threads` through POST /_fake/config; the other knobs keep their defaults.
        let ok = http
            .post(format!("{}/_fake/config", fake.base_url()))
            .json(&serde_json::json!({ "threads": 1, "solve_delay_ms": 1_000 }))
            .send()
            .await?
            .text()
            .await?;
        assert_eq!(ok, "ok");
        assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
        let stats: serde_json::Value =
            http.get(format!("{}/_fake/stats", fake.base_url())).send().await?.json().await?;
        assert_eq!(stats["config"]["threads"], 1);
        assert_eq!(stats["counts"]["no_slot"], 4);
        assert_eq!((stats["in_work"].clone(), stats["peak_in_work"].clone()), (1.into(), 2.into()));
        assert_eq!(stats["max_no_slot_per_minute"], 4);
        Ok(())
    }

    #[tokio::test]
    async fn without_a_thread_plan_every_submit_is_taken() -> anyhow::Result<()> {
        let (fake, _clock) = fake_on_clock(None, 60_000).await?;
        let http = reqwest::Client::new();
        for _ in 0..50 {
            turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        }
        assert_eq!((fake.in_work(), fake.peak_in_work(), fake.counts().no_slot), (50, 50, 0));
        // An old JSON config without `threads` still reads, as unlimited.
        let old: FakeConfig = serde_json::from_str(r#"{ "solve_delay_ms": 10, "enforce_bans": true }"#)?;
        assert_eq!(old.threads, None);
        Ok(())
    }

    #[tokio::test]
    async fn a_hundred_and_twenty_no_slots_in_a_minute_ban_the_account_with_1001() -> anyhow::Result<()> {
        // One thread, a task solved every 0.9 s and two NO_SLOTs beside each: NO_SLOTs stay under
        // 3 × the accepts (no 1003), and the 120th comes at 53.1 s.
        let (fake, clock) = fake_on_clock(Some(1), 500).await?;
        let http = reqwest::Client::new();
        let mut last = String::new();
        for step in 1..=60 {
            last = turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
            assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
            assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()), "the 120th is still answered NO_SLOT");
            if step < 60 {
                assert_eq!(fake.ban_in_force(), None, "step {step}");
                clock.advance(Duration::from_millis(900));
            }
        }
        assert_eq!(fake.max_no_slot_per_minute(), 120);
        let (until, code) = fake.ban_in_force().expect("banned");
        assert_eq!(code, "ERROR: 1001");
        assert_eq!(until, clock.now().plus(Duration::from_secs(600)));
        // Both endpoints answer the ban while it is in force.
        assert_eq!(turnstile(&http, &fake).await?, Err("ERROR: 1001".into()));
        assert_eq!(read(&http, &fake, &last).await?, "ERROR: 1001");
        clock.advance(Duration::from_secs(599));
        assert_eq!(read(&http, &fake, &last).await?, "ERROR: 1001");
        clock.advance(Duration::from_secs(1));
        assert!(read(&http, &fake, &last).await?.starts_with("OK|"), "lifted after 10 minutes");
        turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        let c = fake.counts();
        assert_eq!((c.no_slot, c.tasks_accepted, c.bans, c.requests_during_ban), (120, 61, 1, 3));
        assert_eq!(fake.peak_in_work(), 1);
        Ok(())
    }

    #[tokio::test]
    async fn no_slots_reaching_three_times_the_accepts_ban_the_account_with_1003() -> anyhow::Result<()> {
        let (fake, clock) = fake_on_clock(Some(1), 3_600_000).await?;
        let http = reqwest::Client::new();
        let id = turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        // 3 NO_SLOTs to 1 accept already, but the rule waits for 30 in the minute.
        for n in 1..30 {
            assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
            assert_eq!(fake.ban_in_force(), None, "after {n}");
        }
        assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()), "the 30th is still answered NO_SLOT");
        let (until, code) = fake.ban_in_force().expect("banned");
        assert_eq!((until, code.as_str()), (clock.now().plus(Duration::from_secs(30)), "ERROR: 1003"));
        assert_eq!(turnstile(&http, &fake).await?, Err("ERROR: 1003".into()));
        assert_eq!(read(&http, &fake, &id).await?, "ERROR: 1003");
        // Lifted after 30 s, and the count starts afresh: the next NO_SLOT does not ban again.
        clock.advance(Duration::from_secs(30));
        assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
        assert_eq!(fake.ban_in_force(), None);
        assert_eq!(read(&http, &fake, &id).await?, "CAPCHA_NOT_READY");
        let c = fake.counts();
        assert_eq!((c.no_slot, c.tasks_accepted, c.bans, c.requests_during_ban), (31, 1, 1, 2));
        assert_eq!(fake.max_no_slot_per_minute(), 31);
        // With bans not enforced, NO_SLOTs are answered all the same and never ban.
        fake.configure(|c| c.enforce_bans = false);
        for _ in 0..40 {
            assert_eq!(turnstile(&http, &fake).await?, Err(NO_SLOT.into()));
        }
        assert_eq!((fake.ban_in_force(), fake.max_no_slot_per_minute()), (None, 71));
        Ok(())
    }

    #[tokio::test]
    async fn max_no_slot_per_minute_is_the_busiest_sixty_seconds() -> anyhow::Result<()> {
        let (fake, clock) = fake_on_clock(Some(1), 3_600_000).await?;
        let http = reqwest::Client::new();
        let burst = |n: usize| {
            let (http, fake) = (&http, &fake);
            async move {
                for _ in 0..n {
                    assert_eq!(turnstile(http, fake).await?, Err(NO_SLOT.into()));
                }
                anyhow::Ok(())
            }
        };
        turnstile(&http, &fake).await?.map_err(anyhow::Error::msg)?;
        burst(10).await?;
        assert_eq!(fake.max_no_slot_per_minute(), 10);
        clock.advance(Duration::from_secs(40));
        burst(10).await?; // 20 in (−20 s, 40 s]
        clock.advance(Duration::from_secs(30));
        burst(5).await?; // 15 in (10 s, 70 s]
        assert_eq!(fake.max_no_slot_per_minute(), 20);
        clock.advance(Duration::from_secs(30));
        burst(16).await?; // 21 in (40 s, 100 s]
        assert_eq!(fake.max_no_slot_per_minute(), 21);
        assert_eq!((fake.counts().no_slot, fake.peak_in_work(), fake.in_work()), (41, 1, 1));
        assert_eq!(fake.ban_in_force(), None);
        Ok(())
    }

    #[tokio::test]
    async fn pingbacks_go_out_when_their_time_comes_on_the_clock() -> anyhow::Result<()> {
        // A receiver that records what it gets.
        let got = Arc::new(Mutex::new(Vec::<String>::new()));
        let g2 = got.clone();
        let app = Router::new().route(
            "/cb",
            get(move |Query(q): Query<HashMap<String, String>>| {
                let g2 = g2.clone();
                async move {
                    g2.lock().expect("lock").push(q.get("code").cloned().unwrap_or_default());
                    "ok"
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let cb = format!("http://{}/cb", listener.local_addr()?);
        tokio::spawn(async move { axum::serve(listener, app).await });
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let fake =
            FakeCaptchaAi::start_with_clock("127.0.0.1:0", FakeConfig::captchaai_like(), Arc::new(clock.clone()))
                .await?;
        let fields = [
            ("method", "turnstile"),
            ("sitekey", "s"),
            ("pageurl", "https://a.example"),
            ("pingback", cb.as_str()),
            ("json", "1"),
        ];
        let r: serde_json::Value = serde_json::from_str(&in_php(&reqwest::Client::new(), &fake, &fields).await?)?;
        let id = r["request"].as_str().unwrap_or_default().to_owned();
        clock.run_until(clock.now().plus(Duration::from_secs(9))).await;
        assert!(got.lock().expect("lock").is_empty(), "Turnstile takes 10–15 s");
        clock.run_until(clock.now().plus(Duration::from_secs(7))).await;
        assert_eq!(got.lock().expect("lock").clone(), vec![fake.task(&id).and_then(|t| t.answer).expect("solved")]);
        Ok(())
    }
}

//! Part 2: the relay's callback under load, against what users run today, under the same load
//! generator.
//!
//! Four targets, each started here on a free 127.0.0.1 port and stopped afterwards (process
//! groups, killed on drop if anything fails):
//!
//! 1. the relay, `relay-local serve` (the callback Lambda's handler behind one HTTP server, on an
//!    embedded DynamoDB engine persisted to SQLite); one task is created through its API, the
//!    built-in fake CaptchaAI's pingback delivers its result, and the load repeats that delivery
//!    at the task's signed callback path;
//! 2. the seed, the tutorial's "Muster 3" idempotent Flask handler (a dict and a lock), on
//!    Flask's development server (`app.run(threaded=True)`);
//! 3. the same app under gunicorn, one worker per core;
//! 4. a Python Lambda handler with AWS Lambda Powertools' `@idempotent` (DynamoDB persistence)
//!    and a conditional `update_item`, over boto3, against the same embedded engine (started in
//!    this process), behind a thin Flask front under gunicorn, one worker per core.
//!
//! Every loaded request is a duplicate of a result already recorded (each target gets one first
//! delivery before the load). Load: `wrk -t2 -c32 -d10s --latency`, 3 rounds, the order of the
//! targets rotated each round; `--quick`: 2 s, 1 round. Any non-2xx answer or socket error fails
//! the part.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, AttributeValue, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
};
use relay_shared::domain::{CaptchaKind, TaskRef};
use relay_shared::signing::CallbackSigner;
use relay_shared::testkit::{LocalDynamo, body_for};
use secrecy::SecretString;

use crate::Opts;
use crate::stats::{Spread, percentile};

const THREADS: u32 = 2;
const CONNECTIONS: u32 = 32;
/// Targets of issue 13: the relay against the seed on Flask's development server…
const DEV_THROUGHPUT_TARGET: f64 = 10.0;
const DEV_P99_TARGET: f64 = 0.1;
/// …and under gunicorn.
const GUNICORN_THROUGHPUT_TARGET: f64 = 3.0;
/// How long a target may take to answer its first request (gunicorn importing boto3 on a busy
/// two-core machine takes seconds).
const READY_WITHIN: Duration = Duration::from_secs(60);

/// What one `wrk --latency` run printed, in the units the report uses.
#[derive(Debug, Clone, PartialEq)]
pub struct WrkRun {
    pub requests: u64,
    pub requests_per_sec: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    /// "Non-2xx or 3xx responses" (absent: 0).
    pub non_2xx: u64,
    /// "Socket errors": connect, read, write, timeout (absent: all 0).
    pub socket_errors: [u64; 4],
}

impl WrkRun {
    /// Whether every request was answered 2xx/3xx with no socket error.
    fn problems(&self) -> Option<String> {
        let [connect, read, write, timeout] = self.socket_errors;
        let mut p = Vec::new();
        if self.requests == 0 {
            p.push("no request was answered".to_owned());
        }
        if self.non_2xx > 0 {
            p.push(format!("{} non-2xx/3xx responses", self.non_2xx));
        }
        if connect + read + write + timeout > 0 {
            p.push(format!("socket errors: connect {connect}, read {read}, write {write}, timeout {timeout}"));
        }
        (!p.is_empty()).then(|| p.join("; "))
    }
}

/// `20.69ms`, `661.00us`, `1.02s`, `1.00m` as milliseconds (wrk's `format_time`).
fn duration_ms(s: &str) -> Option<f64> {
    let s = s.trim();
    let split = s.find(|c: char| c.is_ascii_alphabetic())?;
    let (num, unit) = s.split_at(split);
    let v: f64 = num.parse().ok()?;
    let scale = match unit {
        "us" => 0.001,
        "ms" => 1.0,
        "s" => 1_000.0,
        "m" => 60_000.0,
        "h" => 3_600_000.0,
        _ => return None,
    };
    Some(v * scale)
}

/// Parses the output of `wrk --latency`.
pub fn parse_wrk(out: &str) -> anyhow::Result<WrkRun> {
    let mut rps = None;
    let mut requests = None;
    let (mut p50, mut p99) = (None, None);
    let mut non_2xx = 0;
    let mut socket_errors = [0; 4];
    let mut in_distribution = false;
    for line in out.lines().map(str::trim) {
        if line == "Latency Distribution" {
            in_distribution = true;
            continue;
        }
        if in_distribution {
            if let Some((pct, value)) = line.split_once('%') {
                let ms = duration_ms(value).with_context(|| format!("wrk latency `{line}` is not a duration"))?;
                match pct.trim() {
                    "50" => p50 = Some(ms),
                    "99" => p99 = Some(ms),
                    _ => {}
                }
                continue;
            }
            in_distribution = false;
        }
        if let Some(v) = line.strip_prefix("Requests/sec:") {
            rps = Some(v.trim().parse::<f64>().with_context(|| format!("wrk's `{line}`"))?);
        } else if let Some(v) = line.strip_prefix("Non-2xx or 3xx responses:") {
            non_2xx = v.trim().parse().with_context(|| format!("wrk's `{line}`"))?;
        } else if let Some(v) = line.strip_prefix("Socket errors:") {
            for part in v.split(',') {
                let (name, n) = part.trim().split_once(' ').with_context(|| format!("wrk's `{line}`"))?;
                let slot = match name {
                    "connect" => 0,
                    "read" => 1,
                    "write" => 2,
                    "timeout" => 3,
                    _ => bail!("wrk's `{line}`: unknown socket error `{name}`"),
                };
                socket_errors[slot] = n.trim().parse().with_context(|| format!("wrk's `{line}`"))?;
            }
        } else if let Some((n, rest)) = line.split_once(" requests in ")
            && !rest.is_empty()
        {
            requests = Some(n.trim().parse::<u64>().with_context(|| format!("wrk's `{line}`"))?);
        }
    }
    let missing = |what: &str| format!("wrk's output has no {what} (was --latency given?):\n{out}");
    Ok(WrkRun {
        requests: requests.with_context(|| missing("request count"))?,
        requests_per_sec: rps.with_context(|| missing("Requests/sec"))?,
        p50_ms: p50.with_context(|| missing("50% latency"))?,
        p99_ms: p99.with_context(|| missing("99% latency"))?,
        non_2xx,
        socket_errors,
    })
}

/// A directory removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> anyhow::Result<Self> {
        let p = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&p).with_context(|| format!("cannot create {}", p.display()))?;
        Ok(Self(p))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A process the bench started, leader of its own process group (gunicorn's workers are in it).
/// [`Proc::stop`] ends the group gracefully; dropping it (an error on the way) kills the group.
pub(crate) struct Proc {
    name: String,
    child: tokio::process::Child,
    pgid: Option<u32>,
    log: PathBuf,
}

impl Proc {
    pub(crate) fn spawn(name: &str, mut cmd: tokio::process::Command, log: PathBuf) -> anyhow::Result<Self> {
        let out = std::fs::File::create(&log).with_context(|| format!("cannot create {}", log.display()))?;
        cmd.stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .process_group(0)
            .kill_on_drop(true)
            // Loopback only: no proxy may stand between a target and its engine.
            .env_remove("HTTP_PROXY")
            .env_remove("HTTPS_PROXY")
            .env_remove("http_proxy")
            .env_remove("https_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy");
        let child = cmd.spawn().with_context(|| format!("cannot start {name}"))?;
        let pgid = child.id();
        Ok(Self { name: name.to_owned(), child, pgid, log })
    }

    fn signal_group(&self, signal: &str) {
        if let Some(pgid) = self.pgid {
            let _ = std::process::Command::new("kill")
                .args([signal, "--", &format!("-{pgid}")])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }

    /// The end of its output, for an error message.
    pub(crate) fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        let tail = lines[lines.len().saturating_sub(15)..].join("\n");
        if tail.is_empty() { "(no output)".into() } else { tail }
    }

    /// Waits until `url` answers anything at all (any status).
    pub(crate) async fn wait_ready(&mut self, http: &reqwest::Client, url: &str) -> anyhow::Result<()> {
        let until = Instant::now() + READY_WITHIN;
        loop {
            if let Some(status) = self.child.try_wait()? {
                bail!("{} exited ({status}) before it answered; its output:\n{}", self.name, self.log_tail());
            }
            if http.get(url).send().await.is_ok() {
                return Ok(());
            }
            if Instant::now() > until {
                bail!(
                    "{} did not answer at {url} within {READY_WITHIN:?}; its output:\n{}",
                    self.name,
                    self.log_tail()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// SIGTERM to the group, up to 10 s for the leader to finish, then SIGKILL to whatever is left.
    async fn stop(mut self) {
        self.signal_group("-TERM");
        let _ = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        self.signal_group("-KILL");
        self.pgid = None;
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.signal_group("-KILL");
    }
}

pub(crate) fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

pub(crate) fn random_secret() -> String {
    format!("{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

/// What the part needs on this machine.
struct Tools {
    relay_local: PathBuf,
    python: PathBuf,
    gunicorn: PathBuf,
    py_dir: PathBuf,
}

impl Tools {
    fn find(opts: &Opts) -> anyhow::Result<Self> {
        let cwd = std::env::current_dir()?;
        let has_wrk = std::process::Command::new("wrk")
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok();
        ensure!(has_wrk, "the `wrk` load generator is not on PATH: run `infra/tools.sh bench` (it installs it)");
        let venv = cwd.join(&opts.venv);
        let (python, gunicorn) = (venv.join("bin/python"), venv.join("bin/gunicorn"));
        ensure!(
            python.exists() && gunicorn.exists(),
            "no bench virtualenv at {} (Flask, gunicorn, Powertools): run `infra/tools.sh bench`",
            venv.display()
        );
        let relay_local = cwd.join(&opts.bin_dir).join("relay-local");
        ensure!(
            relay_local.exists(),
            "no relay-local binary at {}: build it (`cargo build --release -p relay-local`, or pass --bin-dir)",
            relay_local.display()
        );
        Ok(Self { relay_local, python, gunicorn, py_dir: cwd.join("tests/bench/py") })
    }

    fn python_cmd(&self, program: &Path) -> tokio::process::Command {
        let mut cmd = tokio::process::Command::new(program);
        cmd.current_dir(&self.py_dir).env("PYTHONDONTWRITEBYTECODE", "1").env("PYTHONUNBUFFERED", "1");
        cmd
    }

    fn gunicorn(&self, workers: usize, port: u16, app: &str) -> tokio::process::Command {
        let mut cmd = self.python_cmd(&self.gunicorn);
        cmd.args(["--workers", &workers.to_string(), "--no-control-socket", "--bind", &format!("127.0.0.1:{port}")])
            .args(["--chdir", &self.py_dir.to_string_lossy(), "--log-level", "warning", app]);
        cmd
    }
}

/// One target under load: its process and the URL wrk loads.
struct Target {
    name: &'static str,
    what: String,
    durable: &'static str,
    url: String,
    proc: Proc,
}

/// The result the load repeats: the relay's task, as the fake CaptchaAI solved it.
struct Delivered {
    captcha_id: String,
    token: String,
}

/// The relay's API, as its owner reaches it.
struct RelayApi {
    base: String,
    api_key: String,
    signer: CallbackSigner,
    /// The loaded delivery at its task's path with a wrong signature (refused before the store).
    wrong_signature_url: String,
}

impl RelayApi {
    /// `POST /tasks` (an image task); its reference and CaptchaAI id.
    async fn create_task(&self, http: &reqwest::Client) -> anyhow::Result<(TaskRef, String)> {
        let created = http
            .post(format!("{}/tasks", self.base))
            .bearer_auth(&self.api_key)
            .header("content-type", "application/json")
            .body(body_for(CaptchaKind::Image))
            .send()
            .await?;
        let status = created.status();
        let created: serde_json::Value = created.json().await.context("POST /tasks did not answer JSON")?;
        ensure!(status.is_success(), "POST /tasks answered {status}: {created}");
        let raw = created["task_ref"].as_str().with_context(|| format!("POST /tasks gave no task_ref: {created}"))?;
        let task_ref = TaskRef::parse(raw).map_err(|e| anyhow::anyhow!("task_ref `{raw}`: {e:?}"))?;
        let id =
            created["captcha_id"].as_str().with_context(|| format!("POST /tasks gave no captcha_id: {created}"))?;
        Ok((task_ref, id.to_owned()))
    }

    async fn get_task(&self, http: &reqwest::Client, task_ref: &TaskRef) -> anyhow::Result<serde_json::Value> {
        Ok(http.get(format!("{}/tasks/{task_ref}", self.base)).bearer_auth(&self.api_key).send().await?.json().await?)
    }
}

async fn start_relay(
    tools: &Tools,
    dir: &Path,
    http: &reqwest::Client,
    release: &str,
    cache: bool,
) -> anyhow::Result<(Target, RelayApi, Delivered)> {
    let port = free_port()?;
    let name = if cache { "relay" } else { "relay, cache off" };
    let dir = dir.join(if cache { "relay" } else { "relay-no-cache" });
    std::fs::create_dir_all(&dir)?;
    let dir = dir.as_path();
    let (api_key, secret) = (random_secret(), random_secret());
    let mut cmd = tokio::process::Command::new(&tools.relay_local);
    cmd.arg("serve")
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", dir.join("relay-data"))
        .env("RELAY_API_KEY", &api_key)
        .env("CALLBACK_SIGNING_SECRET", &secret)
        .env("CALLBACK_RECENT_RESULTS", if cache { "4096" } else { "0" })
        .env_remove("CAPTCHAAI_API_KEY")
        .env_remove("RELAY_PUBLIC_URL")
        .env_remove("RUST_LOG");
    let mut proc = Proc::spawn("relay-local serve", cmd, dir.join("relay.log"))?;
    let mut api = RelayApi {
        base: format!("http://127.0.0.1:{port}"),
        api_key,
        signer: CallbackSigner::new(SecretString::from(secret)),
        wrong_signature_url: String::new(),
    };
    proc.wait_ready(http, &format!("{}/health", api.base)).await?;

    // The built-in fake solves the task and sends its pingback (the first delivery) at once.
    let (task_ref, _) = api.create_task(http).await?;
    let until = Instant::now() + Duration::from_secs(30);
    let task = loop {
        let v = api.get_task(http, &task_ref).await?;
        if v["status"] == "solved" && v["solution"].is_string() && v["captcha_id"].is_string() {
            break v;
        }
        ensure!(Instant::now() < until, "the relay's task was not solved by the fake's pingback within 30 s: {v}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    ensure!(task["resolved_via"] == "callback", "the first delivery was not the pingback: {task}");
    let first = Delivered {
        captcha_id: task["captcha_id"].as_str().unwrap_or_default().to_owned(),
        token: task["solution"].as_str().unwrap_or_default().to_owned(),
    };
    let url = reqwest::Url::parse_with_params(
        &api.signer.callback_url(&api.base, &task_ref),
        [("id", &first.captcha_id), ("code", &first.token)],
    )?;
    let mut wrong = url.clone();
    wrong.set_path(&format!("/callback/{task_ref}/{}", "0".repeat(64)));
    api.wrong_signature_url = wrong.to_string();
    // What every loaded request will get: the duplicate answer.
    let answer = http.get(url.clone()).send().await?;
    let (status, body) = (answer.status(), answer.text().await?);
    ensure!(
        status == 200 && body.contains("duplicate"),
        "a repeated delivery to the relay answered {status} {body} (expected 200, duplicate)"
    );
    let target = Target {
        name,
        what: if cache {
            format!(
                "`relay-local serve` ({release}) as deployed: signed `/callback/{{ref}}/{{sig}}`; a repeat of a result \
                 this process stored is answered from its recent-results cache (the first delivery was one DynamoDB \
                 conditional write on the embedded engine, persisted to SQLite)"
            )
        } else {
            "the same with `CALLBACK_RECENT_RESULTS=0`: every delivery is one DynamoDB conditional write \
             (`UpdateItem`, refused for a duplicate) on the embedded engine, persisted to SQLite"
                .to_owned()
        },
        durable: "yes",
        url: url.to_string(),
        proc,
    };
    Ok((target, api, first))
}

/// Delivers the result once; the answer must be 200.
async fn first_delivery(http: &reqwest::Client, target: &Target) -> anyhow::Result<String> {
    let answer = http.get(&target.url).send().await?;
    let (status, body) = (answer.status(), answer.text().await?);
    ensure!(
        status == 200,
        "the first delivery to {} answered {status} {body}; its output:\n{}",
        target.name,
        target.proc.log_tail()
    );
    Ok(body)
}

fn seed_url(port: u16, r: &Delivered) -> anyhow::Result<String> {
    let url = reqwest::Url::parse_with_params(
        &format!("http://127.0.0.1:{port}/callback"),
        [("id", &r.captcha_id), ("code", &r.token)],
    )?;
    Ok(url.to_string())
}

async fn start_seed_dev(tools: &Tools, dir: &Path, http: &reqwest::Client, r: &Delivered) -> anyhow::Result<Target> {
    let port = free_port()?;
    let mut cmd = tools.python_cmd(&tools.python);
    cmd.args(["seed_callback.py", &port.to_string()]);
    let mut proc = Proc::spawn("the seed on Flask's dev server", cmd, dir.join("seed-dev.log"))?;
    proc.wait_ready(http, &format!("http://127.0.0.1:{port}/")).await?;
    Ok(Target {
        name: "seed, Flask dev server",
        what: "the tutorial's Muster 3 (dict + lock), `app.run(threaded=True)`".into(),
        durable: "no (a dict)",
        url: seed_url(port, r)?,
        proc,
    })
}

async fn start_seed_gunicorn(
    tools: &Tools,
    dir: &Path,
    http: &reqwest::Client,
    r: &Delivered,
    workers: usize,
) -> anyhow::Result<Target> {
    let port = free_port()?;
    let cmd = tools.gunicorn(workers, port, "seed_callback:app");
    let mut proc = Proc::spawn("the seed under gunicorn", cmd, dir.join("seed-gunicorn.log"))?;
    proc.wait_ready(http, &format!("http://127.0.0.1:{port}/")).await?;
    Ok(Target {
        name: "seed, gunicorn",
        what: format!("the same app, gunicorn, {workers} sync workers"),
        durable: "no (a dict per worker)",
        url: seed_url(port, r)?,
        proc,
    })
}

async fn create_table(client: &aws_sdk_dynamodb::Client, name: &str, key: &str) -> anyhow::Result<()> {
    client
        .create_table()
        .table_name(name)
        .attribute_definitions(
            AttributeDefinition::builder().attribute_name(key).attribute_type(ScalarAttributeType::S).build()?,
        )
        .key_schema(KeySchemaElement::builder().attribute_name(key).key_type(KeyType::Hash).build()?)
        .billing_mode(BillingMode::PayPerRequest)
        .send()
        .await
        .with_context(|| format!("creating table {name}"))?;
    Ok(())
}

/// The Powertools target and the names of its tables.
async fn start_powertools(
    tools: &Tools,
    dir: &Path,
    http: &reqwest::Client,
    db: &LocalDynamo,
    r: &Delivered,
    workers: usize,
) -> anyhow::Result<(Target, String)> {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (idem_table, tasks_table) = (format!("idempotency-{suffix}"), format!("tasks-{suffix}"));
    let client = db.client();
    create_table(&client, &idem_table, "id").await?;
    create_table(&client, &tasks_table, "task_id").await?;
    let port = free_port()?;
    let mut cmd = tools.gunicorn(workers, port, "powertools_front:app");
    cmd.env("AWS_ENDPOINT_URL_DYNAMODB", &db.endpoint)
        .env("AWS_DEFAULT_REGION", "us-east-1")
        .env("AWS_ACCESS_KEY_ID", "test")
        .env("AWS_SECRET_ACCESS_KEY", "test")
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_ENDPOINT_URL")
        .env("AWS_LAMBDA_FUNCTION_NAME", "powertools-callback")
        .env("POWERTOOLS_SERVICE_NAME", "powertools-callback")
        .env("IDEMPOTENCY_TABLE", &idem_table)
        .env("TASKS_TABLE", &tasks_table);
    let mut proc = Proc::spawn("the Powertools handler under gunicorn", cmd, dir.join("powertools.log"))?;
    proc.wait_ready(http, &format!("http://127.0.0.1:{port}/health")).await?;
    let url = reqwest::Url::parse_with_params(
        &format!("http://127.0.0.1:{port}/callback"),
        [("id", &r.captcha_id), ("code", &r.token)],
    )?;
    Ok((
        Target {
            name: "Powertools, gunicorn",
            what: format!(
                "Python handler, Powertools `@idempotent` (DynamoDBPersistenceLayer) + conditional `update_item`, \
                 boto3, the same engine (in memory, in the bench process); API Gateway v2 events from a Flask front, \
                 gunicorn, {workers} sync workers"
            ),
            durable: "yes",
            url: url.to_string(),
            proc,
        },
        tasks_table,
    ))
}

/// The Powertools handler's first delivery must have written the task.
async fn check_powertools_wrote(db: &LocalDynamo, table: &str, r: &Delivered) -> anyhow::Result<()> {
    let item = db
        .client()
        .get_item()
        .table_name(table)
        .key("task_id", AttributeValue::S(r.captcha_id.clone()))
        .consistent_read(true)
        .send()
        .await?
        .item
        .unwrap_or_default();
    let stored = item.get("solution").and_then(|v| v.as_s().ok());
    ensure!(stored == Some(&r.token), "the Powertools handler did not record the result in {table}: {item:?}");
    Ok(())
}

/// Sends `n` copies of one delivery at once; returns each answer's status and body.
async fn burst(http: &reqwest::Client, url: &str, n: usize) -> anyhow::Result<Vec<(u16, String)>> {
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (http, url) = (http.clone(), url.to_owned());
        set.spawn(async move {
            let answer = http.get(url).send().await?;
            let status = answer.status().as_u16();
            anyhow::Ok((status, answer.text().await?))
        });
    }
    let mut out = Vec::with_capacity(n);
    while let Some(joined) = set.join_next().await {
        out.push(joined??);
    }
    Ok(out)
}

/// Racing first deliveries (what a pingback and a poll, or a re-sent pingback, do): how each
/// durable target answers them.
struct RaceProbe {
    sent: usize,
    relay_ok: usize,
    relay_recorded: usize,
    powertools_500: usize,
}

const RACE_TASKS: usize = 4;
const RACE_COPIES: usize = 8;

async fn race_probe(http: &reqwest::Client, relay: &RelayApi, powertools: &Target) -> anyhow::Result<RaceProbe> {
    let mut p = RaceProbe { sent: RACE_TASKS * RACE_COPIES, relay_ok: 0, relay_recorded: 0, powertools_500: 0 };
    for _ in 0..RACE_TASKS {
        // A new task of the relay, delivered at once (before the fake's own pingback, 50 ms on):
        // one copy is recorded, the others are duplicates (or all conflicts, if the fake won).
        let (task_ref, captcha_id) = relay.create_task(http).await?;
        let code = format!("bench-race-{}", uuid::Uuid::new_v4().simple());
        let url = reqwest::Url::parse_with_params(
            &relay.signer.callback_url(&relay.base, &task_ref),
            [("id", &captcha_id), ("code", &code)],
        )?;
        for (status, body) in burst(http, url.as_str(), RACE_COPIES).await? {
            p.relay_ok += usize::from(status == 200);
            p.relay_recorded += usize::from(body.contains("recorded"));
        }
        let mut url = reqwest::Url::parse(&powertools.url)?;
        url.query_pairs_mut()
            .clear()
            .append_pair("id", &format!("race-{}", uuid::Uuid::new_v4().simple()))
            .append_pair("code", &code);
        for (status, _) in burst(http, url.as_str(), RACE_COPIES).await? {
            p.powertools_500 += usize::from(status == 500);
        }
    }
    Ok(p)
}

/// One wrk run against `url`.
async fn load(url: &str, secs: u64) -> anyhow::Result<(WrkRun, String)> {
    let mut cmd = tokio::process::Command::new("wrk");
    cmd.args([format!("-t{THREADS}"), format!("-c{CONNECTIONS}"), format!("-d{secs}s"), "--latency".into()])
        .arg(url)
        .stdin(Stdio::null())
        .kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(secs + 60), cmd.output())
        .await
        .context("wrk did not finish")?
        .context("cannot run wrk")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    ensure!(out.status.success(), "wrk failed ({}): {}{}", out.status, text, String::from_utf8_lossy(&out.stderr));
    Ok((parse_wrk(&text)?, text))
}

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let tools = Tools::find(opts)?;
    let (rounds, secs) = if opts.quick { (1, 2) } else { (3, 10) };
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    let release = if opts.bin_dir.ends_with("release") { "release build" } else { "debug build" };
    let dir = TempDir::new("relay-bench-wrk")?;
    let http = reqwest::Client::builder().no_proxy().timeout(Duration::from_secs(10)).build()?;

    let (relay, relay_api, result) = start_relay(&tools, &dir.0, &http, release, true).await?;
    let (relay_off, _, _) = start_relay(&tools, &dir.0, &http, release, false).await?;
    let dev = start_seed_dev(&tools, &dir.0, &http, &result).await?;
    let guni = start_seed_gunicorn(&tools, &dir.0, &http, &result, cores).await?;
    let db = LocalDynamo::start().await?;
    let (power, tasks_table) = start_powertools(&tools, &dir.0, &http, &db, &result, cores).await?;
    let mut targets = vec![relay, dev, guni, power, relay_off];
    // One first delivery each (the relay's was the fake's pingback): every loaded request is a
    // duplicate. For Powertools this also keeps the load clear of its in-progress window.
    for t in &targets[1..4] {
        let body = first_delivery(&http, t).await?;
        ensure!(body.trim() == "OK", "{} answered the first delivery with `{body}`", t.name);
    }
    check_powertools_wrote(&db, &tasks_table, &result).await?;

    // runs[target][round]
    let mut runs: Vec<Vec<WrkRun>> = vec![Vec::new(); targets.len()];
    let mut order: Vec<usize> = (0..targets.len()).collect();
    for round in 0..rounds {
        for &i in &order {
            let t = &targets[i];
            eprintln!("  wrk round {}/{rounds}: {} ({secs} s)", round + 1, t.name);
            let (run, text) = load(&t.url, secs).await.with_context(|| format!("loading {}", t.name))?;
            if let Some(problems) = run.problems() {
                bail!(
                    "{} under load: {problems} (no answer may be 4xx or 5xx, and no socket error may occur). wrk said:\n{text}\n\
                     its output:\n{}",
                    t.name,
                    t.proc.log_tail()
                );
            }
            runs[i].push(run);
        }
        order.rotate_left(1);
    }
    // Every duplicate must have been answered by the store, not parked as a dead letter (also a 200).
    for t in [&targets[0], &targets[4]] {
        let relay_log = std::fs::read_to_string(&t.proc.log).unwrap_or_default();
        if let Some(line) =
            relay_log.lines().find(|l| l.contains("dead_letter") || l.contains("not_stored") || l.contains("ERROR"))
        {
            bail!("{} did not store every delivery under load: {line}", t.name);
        }
    }
    // The relay without its store: the same load on a path it refuses before the write (403).
    eprintln!("  wrk: relay, wrong signature ({secs} s)");
    let (bare, text) =
        load(&relay_api.wrong_signature_url, secs).await.context("loading the relay with a wrong signature")?;
    ensure!(
        bare.requests > 0 && bare.non_2xx == bare.requests && bare.socket_errors == [0; 4],
        "the relay did not refuse every wrong signature cleanly:\n{text}"
    );
    let race = race_probe(&http, &relay_api, &targets[3]).await?;
    let section = render(&targets, &runs, &Extras { bare, race }, opts, secs, cores);
    for t in targets.drain(..) {
        t.proc.stop().await;
    }
    drop(db);
    Ok(section)
}

fn ms(v: f64) -> String {
    if v < 1.0 {
        format!("{:.0} µs", v * 1000.0)
    } else if v < 100.0 {
        format!("{v:.2} ms")
    } else {
        format!("{v:.0} ms")
    }
}

fn verdict(met: bool) -> &'static str {
    if met { "**met**" } else { "**missed**" }
}

struct Extras {
    /// The relay refusing a wrong signature: everything but the store.
    bare: WrkRun,
    race: RaceProbe,
}

fn render(targets: &[Target], runs: &[Vec<WrkRun>], extras: &Extras, opts: &Opts, secs: u64, cores: usize) -> String {
    let Extras { bare, race } = extras;
    let rounds = runs.first().map_or(0, Vec::len);
    let mut s = format!(
        "## 2. Callback under load: the relay against what users run today\n\n\
         The same load generator for every target: `wrk -t{THREADS} -c{CONNECTIONS} -d{secs}s --latency`, \
         {rounds} round(s), the order of the targets rotated each round, all on 127.0.0.1 and sharing the \
         machine's {cores} cores with wrk. Every loaded request is a duplicate delivery of one result already \
         recorded (each target got its first delivery before the load); no answer was an error status (wrk counts 4xx and 5xx) and no socket error occurred, or the part would have failed.\n\n\
         | target | what runs | durable | req/s median (min–max) | p50 | p99 |\n\
         | --- | --- | --- | --- | --- | --- |\n"
    );
    for (t, r) in targets.iter().zip(runs) {
        let rps: Vec<f64> = r.iter().map(|x| x.requests_per_sec).collect();
        let p50: Vec<f64> = r.iter().map(|x| x.p50_ms).collect();
        let p99: Vec<f64> = r.iter().map(|x| x.p99_ms).collect();
        s += &format!(
            "| {} | {} | {} | {} | {} | {} |\n",
            t.name,
            t.what,
            t.durable,
            Spread::of(&rps).show(0, ""),
            ms(percentile(&p50, 50.0)),
            ms(percentile(&p99, 50.0)),
        );
    }

    // Relay against each other target, round by round (the same round's runs are neighbours).
    let ratios = |base: usize, other: usize| -> (Spread, Spread) {
        let pairs = runs[base].iter().zip(&runs[other]);
        let thr: Vec<f64> = pairs.clone().map(|(a, b)| a.requests_per_sec / b.requests_per_sec).collect();
        let p99: Vec<f64> = pairs.map(|(a, b)| a.p99_ms / b.p99_ms).collect();
        (Spread::of(&thr), Spread::of(&p99))
    };
    s += "\nThe relay against each (median of the per-round ratios, min–max over rounds):\n\n\
          | pair | throughput (relay ÷ it) | p99 (relay ÷ it) | target | verdict |\n\
          | --- | --- | --- | --- | --- |\n";
    for (base, i) in [(0, 1), (0, 2), (0, 3), (4, 1), (4, 2), (4, 3)] {
        let t = &targets[i];
        let (thr, p99) = ratios(base, i);
        let (target, result) = match i {
            1 => (
                format!("≥ {DEV_THROUGHPUT_TARGET:.0}× throughput, p99 ≤ 1/{:.0}", 1.0 / DEV_P99_TARGET),
                format!(
                    "throughput {}, p99 {}",
                    verdict(thr.median >= DEV_THROUGHPUT_TARGET),
                    verdict(p99.median <= DEV_P99_TARGET)
                ),
            ),
            2 => (
                format!("≥ {GUNICORN_THROUGHPUT_TARGET:.0}× throughput"),
                format!("throughput {}", verdict(thr.median >= GUNICORN_THROUGHPUT_TARGET)),
            ),
            _ => ("none (for reference)".into(), "—".into()),
        };
        s += &format!(
            "| {} vs {} | {} | {} | {target} | {result} |\n",
            targets[base].name,
            t.name,
            thr.show(2, "×"),
            p99.show(3, "×")
        );
    }
    if opts.quick {
        s += "\nSmoke run (`--quick`): one short round; the verdicts above are not meaningful.\n";
    }
    if !opts.bin_dir.ends_with("release") {
        s += "\nThe relay ran as a debug build: its figures understate a release build.\n";
    }
    s += "\nWhat the figures are worth:\n\n\
- **The relay is durable, the seed is not.** Each of the relay's callbacks is checked against its HMAC \
  signature; a result is stored by a DynamoDB conditional write on the embedded engine, persisted to a \
  SQLite file, before the relay answers: a restart loses nothing. A repeat of a result the process has \
  stored is answered from memory (`RecentResults`: SHA-256 keys, bounded), which can only ever answer \
  `duplicate` for a delivery the store would not change; `relay, cache off` sends every repeat to the \
  store as a refused conditional write. The seed keeps results in a Python dict: a restart or a deploy loses \
  every result (the tutorial says so itself), and under gunicorn each worker has its own dict, so a \
  duplicate is caught only when it reaches the worker that saw the first delivery (under this load \
  the other workers record it again as a \"first\").\n";
    s += &format!(
        "- **Where the relay's time goes.** The same relay, same load, with a wrong signature (refused with 403 \
         before the store is asked: HTTP, routing, the API Gateway request, the HMAC check, a warning logged): {:.0} req/s, p50 {}, \
         p99 {}. Against `relay, cache off` ({:.0} req/s), the rest of each callback's cost there is the \
         conditional write's round trip to the engine (SDK, loopback HTTP, SQLite).\n",
        bare.requests_per_sec,
        ms(bare.p50_ms),
        ms(bare.p99_ms),
        percentile(
            &runs.get(4).map(|r| r.iter().map(|x| x.requests_per_sec).collect::<Vec<_>>()).unwrap_or_default(),
            50.0
        ),
    );
    s += &format!(
        "- **Powertools answers a duplicate that arrives while the first delivery is still in flight with a 500** \
         (`IdempotencyAlreadyInProgressError`), which a pingback sender takes for a failed delivery. That is why \
         the bench sends one first delivery before the load: every loaded request is a duplicate of a completed \
         record. Real duplicates (a re-sent pingback, a pingback and a poll) do not wait for each other: sent \
         {RACE_COPIES} copies of a new delivery at once, {RACE_TASKS} times, Powertools answered **{} of {} with \
         500**; the relay answered {} of {} with 200 ({} recorded, the rest duplicates): its conditional write \
         decides, there is no in-progress state.\n",
        race.powertools_500, race.sent, race.relay_ok, race.sent, race.relay_recorded
    );
    s += "- Powertools' engine runs in memory inside the bench process, the relay's on a SQLite file inside \
          its own process: the Powertools figures are, if anything, flattered.\n\
          - Python's targets use gunicorn's default sync workers: one request at a time per worker, a new \
          connection per request.\n";
    s += "\nPer round (req/s, p50, p99):\n\n| round | ";
    s += &targets.iter().map(|t| t.name).collect::<Vec<_>>().join(" | ");
    s += " |\n| --- |";
    s += &" --- |".repeat(targets.len());
    s += "\n";
    for round in 0..rounds {
        s += &format!("| {} |", round + 1);
        for r in runs {
            if let Some(x) = r.get(round) {
                s += &format!(" {:.0}, {}, {} |", x.requests_per_sec, ms(x.p50_ms), ms(x.p99_ms));
            }
        }
        s += "\n";
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Captured from `wrk -t2 -c32 -d1s --latency` (wrk 4.1.0, Debian 12) against the seed on
    /// Flask's development server.
    const CLEAN: &str = "Running 1s test @ http://127.0.0.1:18931/callback?id=123&code=abc
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    20.59ms    1.93ms  27.38ms   92.89%
    Req/Sec   769.65     23.60   800.00     65.00%
  Latency Distribution
     50%   20.69ms
     75%   21.28ms
     90%   21.90ms
     99%   25.22ms
  1533 requests in 1.00s, 260.66KB read
Requests/sec:   1531.06
Transfer/sec:    260.33KB
";

    /// The same server, a path it answers 404.
    const NOT_FOUND: &str = "Running 1s test @ http://127.0.0.1:18931/nope
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    22.68ms    3.96ms  41.06ms   87.51%
    Req/Sec   700.86    138.01     1.26k    90.48%
  Latency Distribution
     50%   22.85ms
     75%   23.78ms
     90%   25.61ms
     99%   35.54ms
  1465 requests in 1.10s, 555.45KB read
  Non-2xx or 3xx responses: 1465
Requests/sec:   1332.09
Transfer/sec:    505.06KB
";

    /// A server that closes every third connection unanswered (µs latencies, read errors).
    const SOCKET_ERRORS: &str = "Running 2s test @ http://127.0.0.1:18942/callback
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     1.07ms    1.46ms  31.16ms   90.81%
    Req/Sec    18.62k     4.93k   33.92k    77.50%
  Latency Distribution
     50%  661.00us
     75%    1.47ms
     90%    2.43ms
     99%    5.50ms
  74064 requests in 2.00s, 2.83MB read
  Socket errors: connect 0, read 16, write 0, timeout 0
Requests/sec:  37016.99
Transfer/sec:      1.41MB
";

    /// A server that accepts and never answers.
    const NOTHING: &str = "Running 2s test @ http://127.0.0.1:18941/callback
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     0.00us    0.00us   0.00us    -nan%
    Req/Sec     0.00      0.00     0.00      -nan%
  Latency Distribution
     50%    0.00us
     75%    0.00us
     90%    0.00us
     99%    0.00us
  0 requests in 2.00s, 0.00B read
Requests/sec:      0.00
Transfer/sec:       0.00B
";

    #[test]
    fn a_clean_run_is_parsed() -> anyhow::Result<()> {
        let r = parse_wrk(CLEAN)?;
        assert_eq!(
            r,
            WrkRun {
                requests: 1533,
                requests_per_sec: 1531.06,
                p50_ms: 20.69,
                p99_ms: 25.22,
                non_2xx: 0,
                socket_errors: [0; 4],
            }
        );
        assert_eq!(r.problems(), None);
        Ok(())
    }

    #[test]
    fn non_2xx_answers_are_a_problem() -> anyhow::Result<()> {
        let r = parse_wrk(NOT_FOUND)?;
        assert_eq!((r.requests, r.non_2xx, r.p99_ms), (1465, 1465, 35.54));
        assert_eq!(r.problems().as_deref(), Some("1465 non-2xx/3xx responses"));
        Ok(())
    }

    #[test]
    fn socket_errors_and_microseconds_are_read() -> anyhow::Result<()> {
        let r = parse_wrk(SOCKET_ERRORS)?;
        assert_eq!(r.socket_errors, [0, 16, 0, 0]);
        assert!((r.p50_ms - 0.661).abs() < 1e-9, "{}", r.p50_ms);
        assert_eq!((r.p99_ms, r.requests_per_sec), (5.5, 37016.99));
        assert_eq!(r.problems().as_deref(), Some("socket errors: connect 0, read 16, write 0, timeout 0"));
        Ok(())
    }

    #[test]
    fn a_run_with_no_answer_is_a_problem() -> anyhow::Result<()> {
        let r = parse_wrk(NOTHING)?;
        assert_eq!((r.requests, r.requests_per_sec), (0, 0.0));
        assert_eq!(r.problems().as_deref(), Some("no request was answered"));
        Ok(())
    }

    #[test]
    fn output_without_latency_distribution_is_refused() {
        let no_latency: String = CLEAN
            .lines()
            .filter(|l| !l.trim_start().starts_with(|c: char| c.is_ascii_digit() && l.contains('%')))
            .collect::<Vec<_>>()
            .join("\n");
        let err = parse_wrk(&no_latency).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("50% latency"), "{err}");
        assert!(parse_wrk("unable to connect to 127.0.0.1:1 Connection refused").is_err());
    }

    #[test]
    fn wrk_durations_become_milliseconds() {
        assert_eq!(duration_ms("20.69ms"), Some(20.69));
        assert_eq!(duration_ms("1.50s"), Some(1500.0));
        assert_eq!(duration_ms("1.00m"), Some(60_000.0));
        assert_eq!(duration_ms("500.00us"), Some(0.5));
        assert_eq!(duration_ms("12"), None);
        assert_eq!(duration_ms("3.0parsecs"), None);
    }
}

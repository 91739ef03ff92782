//! Part 3: cold start and footprint of each function, as Lambda starts it.
//!
//! Each release binary is started the way Lambda starts a `provided.al2023` function: with the
//! Runtime API served by the bench on 127.0.0.1 (`AWS_LAMBDA_RUNTIME_API`), Lambda's own
//! variables, and the function's environment as template.yaml deploys it — its secrets read from
//! SSM parameters at init, its table and queues — all on moto. Measured: process start to its first
//! `GET /next` (init), and to its answer to a first real event (init + first request: the first
//! request pays for connection set-up); peak RSS (VmHWM) after that answer; binary and zip sizes.
//! Against a minimal `lambda_runtime` function built the same way, and a Python Powertools
//! handler started by a minimal custom-runtime loop.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::extract::State;
use relay_shared::domain::{CaptchaId, CaptchaKind, IncomingResult, Outcome, Solution, Task, TaskRef, Via};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{TaskStore, schema};
use relay_shared::testkit::{ApiGatewayEvent, client_for, sqs_client_for};
use relay_shared::time::{Clock, SystemClock};
use secrecy::SecretString;

use crate::Opts;
use crate::stats::Spread;

const TARGET_RATIO: f64 = 2.0;
const TARGET_RSS_MB: f64 = 30.0;
const TARGET_ZIP_MB: f64 = 4.0;
const SIGNING_SECRET: &str = "bench-cold-signing-secret-0123456789";

/// What the Runtime API saw of one process.
#[derive(Default)]
struct Seen {
    event: String,
    served: bool,
    next_at: Option<Instant>,
    done_at: Option<Instant>,
    /// (succeeded, body)
    answer: Option<(bool, String)>,
}

type Shared = Arc<Mutex<Seen>>;

async fn next(State(seen): State<Shared>) -> axum::response::Response {
    let event = {
        let Ok(mut s) = seen.lock() else { return axum::response::Response::default() };
        if s.served {
            None
        } else {
            s.served = true;
            s.next_at = Some(Instant::now());
            Some(s.event.clone())
        }
    };
    let Some(event) = event else {
        // One event per process: the next poll waits until the process is stopped.
        std::future::pending::<()>().await;
        return axum::response::Response::default();
    };
    let deadline = SystemClock.now().plus(Duration::from_secs(29)).as_millis();
    axum::response::Response::builder()
        .header("lambda-runtime-aws-request-id", "8476a536-e9f4-11e8-9739-2dfe598c3fcd")
        .header("lambda-runtime-deadline-ms", deadline.to_string())
        .header("lambda-runtime-invoked-function-arn", "arn:aws:lambda:us-east-1:123456789012:function:bench")
        .header("lambda-runtime-trace-id", "Root=1-5bef4de7-ad49b0e87f6ef6c87fc2e700;Parent=9a9197af755a6419;Sampled=1")
        .header("content-type", "application/json")
        .body(axum::body::Body::from(event))
        .unwrap_or_default()
}

fn answered(seen: &Shared, ok: bool, body: String) {
    if let Ok(mut s) = seen.lock()
        && s.answer.is_none()
    {
        s.done_at = Some(Instant::now());
        s.answer = Some((ok, body));
    }
}

/// Serves the Runtime API for one process on a free loopback port.
async fn runtime_api(event: String) -> anyhow::Result<(String, Shared, relay_shared::local::StopOnDrop)> {
    use axum::routing::{get, post};
    let seen: Shared = Arc::new(Mutex::new(Seen { event, ..Seen::default() }));
    let app = axum::Router::new()
        .route("/2018-06-01/runtime/invocation/next", get(next))
        .route(
            "/2018-06-01/runtime/invocation/{id}/response",
            post(|State(s): State<Shared>, body: String| async move {
                answered(&s, true, body);
                axum::http::StatusCode::ACCEPTED
            }),
        )
        .route(
            "/2018-06-01/runtime/invocation/{id}/error",
            post(|State(s): State<Shared>, body: String| async move {
                answered(&s, false, body);
                axum::http::StatusCode::ACCEPTED
            }),
        )
        .route(
            "/2018-06-01/runtime/init/error",
            post(|State(s): State<Shared>, body: String| async move {
                answered(&s, false, format!("init error: {body}"));
                axum::http::StatusCode::ACCEPTED
            }),
        )
        .with_state(seen.clone());
    let (endpoint, server) = relay_shared::local::serve_on_loopback(app).await?;
    // The Runtime API is named by host:port, without the scheme.
    let addr = endpoint.trim_start_matches("http://").to_owned();
    Ok((addr, seen, server))
}

/// One cold start.
#[derive(Debug, Clone, Copy)]
struct Start {
    init_ms: f64,
    first_ms: f64,
    rss_mb: f64,
    /// CPU time the process used (all its threads) up to its answer: its own work, without the
    /// time it waited for its peers.
    cpu_ms: f64,
}

/// A function to start: its command and environment, and the event it gets.
struct Function {
    name: &'static str,
    program: PathBuf,
    args: Vec<String>,
    /// The Rust binary it runs (its size is reported); `None` for the Python handler.
    binary: Option<PathBuf>,
    env: Vec<(String, String)>,
    event: String,
    /// The answer's body must contain this.
    expect: &'static str,
}

/// CPU time of a process so far, all threads, in ms.
fn cpu_ms(pid: u32) -> f64 {
    crate::stats::cpu_ns(&pid.to_string()).map_or(0.0, |ns| ns as f64 / 1e6)
}

fn vm_hwm_mb(pid: u32) -> f64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1).and_then(|v| v.parse::<f64>().ok()))
        })
        .map_or(0.0, |kb| kb / 1024.0)
}

async fn start_once(f: &Function, log: &Path) -> anyhow::Result<Start> {
    let (addr, seen, stop) = runtime_api(f.event.clone()).await?;
    let out = std::fs::File::create(log)?;
    let mut cmd = std::process::Command::new(&f.program);
    cmd.args(&f.args)
        .env_clear()
        .env("PATH", std::env::var("PATH").unwrap_or_default())
        .envs(f.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("AWS_LAMBDA_RUNTIME_API", &addr)
        .stdout(out.try_clone()?)
        .stderr(out);
    let t0 = Instant::now();
    let mut child = cmd.spawn().map_err(|e| anyhow::anyhow!("starting {}: {e}", f.program.display()))?;
    let pid = child.id();
    let limit = t0 + Duration::from_secs(60);
    let result = loop {
        let done = seen.lock().ok().and_then(|s| s.answer.clone().map(|a| (a, s.next_at, s.done_at)));
        if let Some(((ok, body), next_at, Some(done_at))) = done {
            let (rss_mb, cpu_ms) = (vm_hwm_mb(pid), cpu_ms(pid));
            break if !ok {
                Err(anyhow::anyhow!("{} failed its first event: {body}", f.name))
            } else if !body.contains(f.expect) {
                Err(anyhow::anyhow!("{} answered `{body}`, expected it to contain `{}`", f.name, f.expect))
            } else {
                let ms = |t: Instant| t.duration_since(t0).as_secs_f64() * 1e3;
                Ok(Start { init_ms: next_at.map_or(0.0, ms), first_ms: ms(done_at), rss_mb, cpu_ms })
            };
        }
        if let Ok(Some(status)) = child.try_wait() {
            break Err(anyhow::anyhow!("{} exited ({status}) before answering; see {}", f.name, log.display()));
        }
        if Instant::now() > limit {
            break Err(anyhow::anyhow!("{} did not answer within 60 s; see {}", f.name, log.display()));
        }
        tokio::time::sleep(Duration::from_micros(500)).await;
    };
    let _ = child.kill();
    let _ = child.wait();
    drop(stop);
    result.map_err(|e| {
        let tail = std::fs::read_to_string(log).unwrap_or_default();
        let tail: String = tail.lines().rev().take(5).collect::<Vec<_>>().join("\n");
        e.context(format!("last lines of its output:\n{tail}"))
    })
}

/// Deflated zip of the binary as `bootstrap`, as `sam build` packs it: its size in MB.
fn zip_mb(bin: &Path, dir: &Path) -> anyhow::Result<f64> {
    let zip = dir.join(format!("{}.zip", bin.file_name().and_then(|n| n.to_str()).unwrap_or("bootstrap")));
    let status = std::process::Command::new("python3")
        .args([
            "-c",
            "import sys, zipfile\nwith zipfile.ZipFile(sys.argv[2], 'w', zipfile.ZIP_DEFLATED) as z: z.write(sys.argv[1], 'bootstrap')",
        ])
        .arg(bin)
        .arg(&zip)
        .status()?;
    anyhow::ensure!(status.success(), "zipping {} failed", bin.display());
    Ok(std::fs::metadata(&zip)?.len() as f64 / 1_048_576.0)
}

/// Table, queues, secrets and one open task on moto, as a deployed stack has them.
struct Stack {
    env: Vec<(String, String)>,
    task: TaskRef,
    captcha_id: CaptchaId,
    /// The floor yardstick's own open task.
    floor_task: TaskRef,
}

async fn stack(moto: &str) -> anyhow::Result<Stack> {
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let table = format!("cold-{suffix}");
    let client = client_for(moto);
    schema::create_table(&client, &table).await?;
    let sqs = sqs_client_for(moto);
    let dlq = sqs.create_queue().queue_name(format!("cold-dl-{suffix}")).send().await?.queue_url.unwrap_or_default();
    let poison =
        sqs.create_queue().queue_name(format!("cold-poison-{suffix}")).send().await?.queue_url.unwrap_or_default();
    let ssm = aws_sdk_ssm::Client::from_conf(
        aws_sdk_ssm::Config::builder()
            .behavior_version(aws_sdk_ssm::config::BehaviorVersion::latest())
            .region(aws_sdk_ssm::config::Region::new("us-east-1"))
            .credentials_provider(aws_sdk_ssm::config::Credentials::new("test", "test", None, None, "bench"))
            .endpoint_url(moto)
            .http_client(relay_shared::testkit::test_http_client())
            .build(),
    );
    let (key_param, secret_param) =
        (format!("/bench/{suffix}/captchaai-key"), format!("/bench/{suffix}/signing-secret"));
    for (name, value) in [(&key_param, "0123456789abcdef0123456789abcdef"), (&secret_param, SIGNING_SECRET)] {
        ssm.put_parameter()
            .name(name)
            .value(value)
            .r#type(aws_sdk_ssm::types::ParameterType::SecureString)
            .send()
            .await?;
    }
    let store = TaskStore::new(client.clone(), table.clone(), Duration::from_secs(7 * 86_400));
    let now = SystemClock.now();
    let task = TaskRef::generate();
    let captcha_id = CaptchaId::parse("81234567890")?;
    store
        .tasks()
        .create(&Task::new(task.clone(), CaptchaKind::RecaptchaV2, now), now.plus(Duration::from_secs(600)), None)
        .await?;
    store.tasks().mark_submitted(&task, &captcha_id, now, now.plus(Duration::from_secs(120))).await?;
    // A bare item for the floor, outside the relay's indexes: the poller's and the sweep's
    // starts must find nothing open.
    let floor_task = TaskRef::generate();
    client
        .put_item()
        .table_name(&table)
        .item("pk", aws_sdk_dynamodb::types::AttributeValue::S(floor_task.as_ref().to_owned()))
        .item("state", aws_sdk_dynamodb::types::AttributeValue::S("pending".into()))
        .send()
        .await?;
    let env = [
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_DEFAULT_REGION", "us-east-1".to_owned()),
        ("AWS_ACCESS_KEY_ID", "test".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "test".to_owned()),
        ("AWS_SESSION_TOKEN", "test".to_owned()),
        ("AWS_ENDPOINT_URL", moto.to_owned()),
        ("AWS_LAMBDA_FUNCTION_NAME", "bench".to_owned()),
        ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256".to_owned()),
        ("AWS_LAMBDA_FUNCTION_VERSION", "$LATEST".to_owned()),
        ("AWS_LAMBDA_LOG_GROUP_NAME", "/aws/lambda/bench".to_owned()),
        ("AWS_LAMBDA_LOG_STREAM_NAME", "2026/12/03/[$LATEST]bench".to_owned()),
        ("TABLE_NAME", table),
        ("RETENTION_DAYS", "7".to_owned()),
        ("RUST_LOG", "info".to_owned()),
        ("AUTH_MODE", "iam".to_owned()),
        ("DEAD_LETTER_QUEUE_URL", dlq),
        ("POISON_QUEUE_URL", poison),
        ("CAPTCHAAI_API_KEY_PARAM", key_param),
        ("CALLBACK_SIGNING_SECRET_PARAM", secret_param),
        // Inline here (the others come from SSM): the sweep finds nothing due, signs nothing.
        ("WEBHOOK_SECRETS", relay_shared::webhook::WebhookSecret::generate().1),
        // Nothing is due, so the poller never calls it; never the internet either way.
        ("CAPTCHAAI_BASE_URL", "http://127.0.0.1:9".to_owned()),
    ];
    Ok(Stack { env: env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(), task, captcha_id, floor_task })
}

/// How the Rust binaries are started: natively from a build directory, or — the arm64 builds
/// cargo-lambda makes (`target/lambda/<binary>/bootstrap`) — under qemu's user-mode emulation.
enum Launch {
    Native(PathBuf),
    Qemu { qemu: PathBuf, sysroot: PathBuf, dir: PathBuf },
}

impl Launch {
    fn binary(&self, name: &str) -> PathBuf {
        match self {
            Self::Native(dir) => dir.join(name),
            Self::Qemu { dir, .. } => dir.join(name).join("bootstrap"),
        }
    }

    /// The program and arguments that run `name`.
    fn command(&self, name: &str) -> (PathBuf, Vec<String>) {
        match self {
            Self::Native(_) => (self.binary(name), Vec::new()),
            Self::Qemu { qemu, sysroot, .. } => (
                qemu.clone(),
                vec![
                    "-L".into(),
                    sysroot.to_string_lossy().into_owned(),
                    self.binary(name).to_string_lossy().into_owned(),
                ],
            ),
        }
    }
}

fn functions(launch: &Launch, s: &Stack) -> anyhow::Result<Vec<Function>> {
    let signer = CallbackSigner::new(SecretString::from(SIGNING_SECRET.to_owned()));
    let callback = ApiGatewayEvent::new("GET", &format!("/callback/{}/{}", s.task.as_ref(), signer.sign(&s.task)))
        .query(&format!("id={}&code=03AGdBq2{}", s.captcha_id.as_ref(), "x".repeat(600)))
        .to_json();
    let api = ApiGatewayEvent::new("GET", &format!("/tasks/{}", s.task.as_ref())).iam_caller().to_json();
    let letter = relay_shared::deadletter::DeadLetter::new(
        &s.task,
        &IncomingResult {
            captcha_id: s.captcha_id.clone(),
            outcome: Outcome::Solved(Solution::parse("03AGdBq2-redriven")?),
            received_at: SystemClock.now(),
            via: Via::Callback,
            token_clock_start: relay_shared::time::Timestamp::from_millis(0),
        },
        "store unavailable",
        1,
    );
    let sqs_event = serde_json::json!({ "Records": [{
        "messageId": "059f36b4-87a3-44ab-83d2-661975830a7d",
        "receiptHandle": "AQEBwJnKyrHigUMZj6rYigCgxlaS3SLy0a",
        "body": letter.to_json(),
        "attributes": { "ApproximateReceiveCount": "1", "SentTimestamp": "1545082649183",
                        "SenderId": "AIDAIENQZJOLO23YVJ4VO", "ApproximateFirstReceiveTimestamp": "1545082649185" },
        "messageAttributes": {},
        "md5OfBody": "e4e68fb7bd0e697a0ae8f1bb342846b3",
        "eventSource": "aws:sqs",
        "eventSourceARN": "arn:aws:sqs:us-east-1:123456789012:dead-letters",
        "awsRegion": "us-east-1"
    }]})
    .to_string();
    let scheduler = include_str!("../../../functions/poller/tests/fixtures/scheduler-event.json").to_owned();
    let f = |name, binary: &str, event: String, expect| {
        let (program, args) = launch.command(binary);
        Function { name, program, args, binary: Some(launch.binary(binary)), env: s.env.clone(), event, expect }
    };
    Ok(vec![
        f("hello (lambda_runtime, nothing else)", "bench-hello", "{}".into(), "\"ok\":true"),
        f(
            "floor: hello + the callback's AWS calls (1 SSM read at init, 1 bare conditional UpdateItem)",
            "bench-floor",
            serde_json::json!({ "pk": s.floor_task.as_ref() }).to_string(),
            "\"ok\":true",
        ),
        f("callback (a pingback: one conditional write)", "relay-callback", callback, "recorded"),
        f("api (GET /tasks/{ref})", "relay-api", api, "\"statusCode\":200"),
        f("poller (a scheduled tick, nothing due)", "relay-poller", scheduler.clone(), "\"passes\""),
        f("redrive (one dead letter)", "relay-redrive", sqs_event, "batchItemFailures"),
        f("delivery (a scheduled sweep, nothing due)", "relay-delivery", scheduler.clone(), "\"delivered\""),
        f("submitter (a scheduled run, nothing queued)", "relay-submitter", scheduler, "\"released\""),
    ])
}

/// The Python handler of part 2 under a minimal custom-runtime loop, on moto's DynamoDB.
async fn python(opts: &Opts, moto: &str) -> anyhow::Result<Option<Function>> {
    let py = Opts::root().join(&opts.venv).join("bin/python");
    if !py.exists() {
        return Ok(None);
    }
    let client = client_for(moto);
    let suffix = uuid::Uuid::new_v4().simple().to_string();
    let (tasks, idem) = (format!("pt-tasks-{suffix}"), format!("pt-idem-{suffix}"));
    for (table, key) in [(&tasks, "task_id"), (&idem, "id")] {
        use aws_sdk_dynamodb::types::{
            AttributeDefinition, BillingMode, KeySchemaElement, KeyType, ScalarAttributeType,
        };
        client
            .create_table()
            .table_name(table)
            .billing_mode(BillingMode::PayPerRequest)
            .attribute_definitions(
                AttributeDefinition::builder().attribute_name(key).attribute_type(ScalarAttributeType::S).build()?,
            )
            .key_schema(KeySchemaElement::builder().attribute_name(key).key_type(KeyType::Hash).build()?)
            .send()
            .await?;
    }
    let event =
        ApiGatewayEvent::new("GET", "/callback").query(&format!("id=81234567890&code=03AGdBq2{}", "x".repeat(600)));
    let mut event: serde_json::Value = serde_json::from_str(&event.to_json())?;
    event["queryStringParameters"] =
        serde_json::json!({ "id": "81234567890", "code": format!("03AGdBq2{}", "x".repeat(600)) });
    let env = [
        ("AWS_REGION", "us-east-1".to_owned()),
        ("AWS_DEFAULT_REGION", "us-east-1".to_owned()),
        ("AWS_ACCESS_KEY_ID", "test".to_owned()),
        ("AWS_SECRET_ACCESS_KEY", "test".to_owned()),
        ("AWS_ENDPOINT_URL_DYNAMODB", moto.to_owned()),
        ("AWS_LAMBDA_FUNCTION_NAME", "bench-python".to_owned()),
        ("AWS_LAMBDA_FUNCTION_MEMORY_SIZE", "256".to_owned()),
        ("TASKS_TABLE", tasks),
        ("IDEMPOTENCY_TABLE", idem),
        ("PYTHONDONTWRITEBYTECODE", "1".to_owned()),
    ];
    Ok(Some(Function {
        name: "Python: Powertools idempotency + boto3 (part 2's handler)",
        program: py,
        args: vec![Opts::root().join("tests/bench/py/runtime_loop.py").to_string_lossy().into_owned()],
        binary: None,
        env: env.into_iter().map(|(k, v)| (k.to_owned(), v)).collect(),
        event: event.to_string(),
        expect: "\"statusCode\": 200",
    }))
}

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let moto = opts.moto.clone().ok_or_else(|| anyhow::anyhow!("the cold-start part needs a moto server (--moto)"))?;
    let repeats = if opts.quick { 1 } else { 7 };
    let dir = Opts::root().join("target/bench-coldstart");
    std::fs::create_dir_all(&dir)?;
    let rows = measure(&Launch::Native(opts.bin_dir.clone()), opts, &moto, repeats, &dir).await?;
    let mut report = render(&rows, repeats, opts);
    report.push_str(&arm64_sizes(&dir)?);
    report.push_str(&arm64_cold_starts(opts, &moto, repeats, &dir).await?);
    Ok(report)
}

/// Starts every function `repeats` times (the Python handler too, when run natively), each
/// repeat against a fresh stack, and sums up each one's starts.
async fn measure(launch: &Launch, opts: &Opts, moto: &str, repeats: usize, dir: &Path) -> anyhow::Result<Vec<Row>> {
    std::fs::create_dir_all(dir)?;
    let mut all: Vec<(&'static str, Option<PathBuf>, Vec<Start>)> = Vec::new();
    for repeat in 0..repeats {
        // A fresh stack per repeat: every start finds its task open, as a cold start would.
        let s = stack(moto).await?;
        let mut fs = functions(launch, &s)?;
        if matches!(launch, Launch::Native(_))
            && let Some(p) = python(opts, moto).await?
        {
            fs.push(p);
        }
        for (i, f) in fs.iter().enumerate() {
            let log = dir.join(format!("{i}.log"));
            let start = start_once(f, &log).await?;
            if repeat == 0 {
                all.push((f.name, f.binary.clone(), Vec::new()));
            }
            all[i].2.push(start);
        }
    }
    let mut rows = Vec::new();
    for (name, binary, starts) in all {
        let spread = |g: fn(&Start) -> f64| Spread::of(&starts.iter().map(g).collect::<Vec<_>>());
        let (size, zip) = match &binary {
            Some(b) => (std::fs::metadata(b).map(|m| m.len() as f64 / 1_048_576.0).unwrap_or(0.0), zip_mb(b, dir)?),
            None => (0.0, 0.0),
        };
        rows.push(Row {
            name,
            native: binary.is_some(),
            init: spread(|s| s.init_ms),
            first: spread(|s| s.first_ms),
            request: spread(|s| s.first_ms - s.init_ms),
            cpu: spread(|s| s.cpu_ms),
            rss: spread(|s| s.rss_mb),
            size,
            zip,
        });
    }
    Ok(rows)
}

/// The binaries cargo-lambda's arm64 build leaves in `target/lambda/<binary>/bootstrap`.
const ARM64_BINARIES: [&str; 8] = [
    "bench-hello",
    "bench-floor",
    "relay-callback",
    "relay-api",
    "relay-poller",
    "relay-redrive",
    "relay-delivery",
    "relay-submitter",
];

/// `true` if `path` is an AArch64 ELF executable (e_machine 183).
fn is_aarch64_elf(path: &Path) -> bool {
    let mut head = [0u8; 20];
    std::fs::File::open(path).and_then(|mut f| std::io::Read::read_exact(&mut f, &mut head)).is_ok()
        && head.starts_with(b"\x7fELF")
        && u16::from_le_bytes([head[18], head[19]]) == 183
}

/// The arm64 cold starts, under qemu's user-mode emulation, when cargo-lambda's arm64 builds of
/// every function and of the yardsticks are in `target/lambda` and qemu and an AArch64 glibc
/// are installed. Emulation slows every instruction many times over, and unevenly (system
/// calls run natively, crypto and plain code are translated), so only the ratios to the arm64
/// hello under the same emulation say something about a Graviton; the absolute times do not.
async fn arm64_cold_starts(opts: &Opts, moto: &str, repeats: usize, dir: &Path) -> anyhow::Result<String> {
    let mut s = String::from("\n### The arm64 cold start, under emulation\n\n");
    let lambda_dir = Opts::root().join("target/lambda");
    let missing: Vec<String> = ARM64_BINARIES
        .iter()
        .filter(|b| !is_aarch64_elf(&lambda_dir.join(b).join("bootstrap")))
        .map(|b| format!("`{b}`"))
        .collect();
    let qemu =
        ["/usr/bin/qemu-aarch64-static", "/usr/bin/qemu-aarch64"].into_iter().map(PathBuf::from).find(|p| p.exists());
    let sysroot = PathBuf::from("/usr/aarch64-linux-gnu");
    let qemu = match qemu {
        Some(q) if missing.is_empty() && sysroot.join("lib/ld-linux-aarch64.so.1").exists() => q,
        _ => {
            s.push_str(&format!(
                "Not measured in this run: it needs qemu-user (`apt-get install qemu-user-static`), an AArch64 glibc \
                 (`apt-get install libc6-arm64-cross`) and cargo-lambda's arm64 builds in `target/lambda` \
                 (`cargo lambda build --release --arm64 -p relay-bench-hello -p relay-callback …`; missing: {}).\n",
                if missing.is_empty() { "none".to_owned() } else { missing.join(", ") }
            ));
            return Ok(s);
        }
    };
    let launch = Launch::Qemu { qemu: qemu.clone(), sysroot: sysroot.clone(), dir: lambda_dir };
    let rows = measure(&launch, opts, moto, repeats, &dir.join("arm64")).await?;
    s.push_str(&format!(
        "The same starts against the same kind of stack on moto, with cargo-lambda's arm64 release builds \
         (`target/lambda/*/bootstrap`, as `sam build` makes them) run by `{} -L {}` on this x86_64 machine; \
         {repeats} start(s) each, medians (min–max). **Emulation inflates every absolute time and CPU figure many \
         times over, and unevenly: only the ratios to the arm64 hello under the same emulation carry over to a \
         Graviton.** Peak RSS is qemu's and the binary's together.\n\n",
        qemu.display(),
        sysroot.display()
    ));
    s.push_str(&table(&rows, false));
    Ok(s)
}

/// The arm64 build a deploy ships (`infra/sam-build.sh` → `.aws-sam/build/<Function>/bootstrap`),
/// if one is there: each bootstrap's size and its zip. Its cold start is measured (under
/// emulation, ratios only) from cargo-lambda's own output: [`arm64_cold_starts`].
fn arm64_sizes(dir: &Path) -> anyhow::Result<String> {
    let build = Opts::root().join(".aws-sam/build");
    let functions = [
        "ApiFunction",
        "CallbackFunction",
        "PollerFunction",
        "RedriveFunction",
        "DeliveryFunction",
        "SubmitterFunction",
    ];
    let mut s = String::from("\n### The arm64 build `sam build` makes (what a deploy ships)\n\n");
    let found: Vec<_> =
        functions.iter().map(|f| (f, build.join(f).join("bootstrap"))).filter(|(_, p)| p.exists()).collect();
    if found.is_empty() {
        s.push_str(
            "Not measured in this run: no `.aws-sam/build` here. Run `infra/sam-build.sh` (≈ 20 min on 2 cores) \
             and the bench again to get this table (the emulated cold starts below give the same builds' sizes).\n",
        );
        return Ok(s);
    }
    s.push_str(&format!(
        "From `.aws-sam/build` (cargo-lambda, release, aarch64); their cold starts, under emulation, are below. \
         Target: zip ≤ {TARGET_ZIP_MB} MB.\n\n\
         | function | binary | zip | target |\n| --- | --- | --- | --- |\n"
    ));
    for (f, p) in found {
        let arm = dir.join(format!("arm64-{f}"));
        std::fs::create_dir_all(&arm)?;
        let size = std::fs::metadata(&p)?.len() as f64 / 1_048_576.0;
        let zip = zip_mb(&p, &arm)?;
        let verdict = if zip <= TARGET_ZIP_MB { "met" } else { "missed" };
        s.push_str(&format!("| {f} | {size:.1} MB | {zip:.2} MB | {verdict} |\n"));
    }
    Ok(s)
}

struct Row {
    name: &'static str,
    /// A Rust binary (sizes apply); the Python handler is not.
    native: bool,
    init: Spread,
    first: Spread,
    /// The first request alone: from the first `GET /next` to the answer.
    request: Spread,
    cpu: Spread,
    rss: Spread,
    size: f64,
    zip: f64,
}

const FLOOR_PREFIX: &str = "floor:";

fn render(rows: &[Row], repeats: usize, opts: &Opts) -> String {
    let mut s = format!(
        "## 3. Cold start and footprint\n\n\
         Each function's {} binary (`{}`) started as Lambda starts it: the Runtime API served on \
         loopback, Lambda's variables, the function's environment as template.yaml sets it, its \
         secrets read from SSM parameters at init and its table and queues — all on moto. Init = \
         process start to its first `GET /next` (the functions open their DynamoDB connection \
         there); first request alone = from that `GET /next` to the answer to a real first event; \
         init + first request = process start to that answer, the figure a cold caller waits for. \
         CPU = the time the process itself ran (all threads, from the kernel's counters) up to that \
         answer: its own work, without the waits for moto. {repeats} start(s) each; medians \
         (min–max). Targets: init + first request ≤ {TARGET_RATIO}× hello, peak RSS ≤ \
         {TARGET_RSS_MB} MB, zip ≤ {TARGET_ZIP_MB} MB. The floor is a yardstick of ours: hello plus \
         only the AWS calls the callback must make, through the same SDK client — what a cold start \
         costs before any of the relay's own work.\n\n",
        if opts.bin_dir.ends_with("release") { "release" } else { "debug" },
        opts.bin_dir.display(),
    );
    s.push_str(&table(rows, true));
    if !rows.iter().any(|r| !r.native) {
        s.push_str("\nThe Python row is missing: `.venv-bench` is not installed (`infra/tools.sh bench`).\n");
    }
    s
}

/// The cold-start table: each row against the first (hello), the floor and, if measured, Python;
/// with `verdicts`, each function against the targets (not under emulation: its times and
/// RSS are qemu's too).
fn table(rows: &[Row], verdicts: bool) -> String {
    let hello = rows.first().map_or((1.0, 1.0), |r| (r.first.median.max(1e-9), r.cpu.median.max(1e-9)));
    let floor = rows.iter().find(|r| r.name.starts_with(FLOOR_PREFIX)).map(|r| r.first.median.max(1e-9));
    let python = rows.iter().find(|r| !r.native).map(|r| r.first.median);
    let mut s = format!(
        "| function | init | first request alone | init + first request | ÷ hello | ÷ floor |{} CPU (init + first) | CPU ÷ hello's | peak RSS | binary | zip | targets (time, RSS, zip) |\n\
         | --- | --- | --- | --- | --- | --- |{} --- | --- | --- | --- | --- | --- |\n",
        if python.is_some() { " ÷ Python |" } else { "" },
        if python.is_some() { " --- |" } else { "" },
    );
    for (i, r) in rows.iter().enumerate() {
        let ratio = r.first.median / hello.0;
        let yardstick = i == 0 || r.name.starts_with(FLOOR_PREFIX);
        let verdict = if yardstick || !r.native || !verdicts {
            "—".to_owned()
        } else {
            let v = |ok: bool| if ok { "met" } else { "missed" };
            format!("{}, {}, {}", v(ratio <= TARGET_RATIO), v(r.rss.median <= TARGET_RSS_MB), v(r.zip <= TARGET_ZIP_MB))
        };
        let py = python.map(|p| format!(" {:.2}× |", r.first.median / p)).unwrap_or_default();
        let to_floor = floor.map_or("—".to_owned(), |f| format!("{:.1}×", r.first.median / f));
        s.push_str(&format!(
            "| {} | {} | {} | {} | {ratio:.1}× | {to_floor} |{py} {} | {:.1}× | {} | {} | {} | {verdict} |\n",
            r.name,
            r.init.show(1, " ms"),
            r.request.show(1, " ms"),
            r.first.show(1, " ms"),
            r.cpu.show(1, " ms"),
            r.cpu.median / hello.1,
            r.rss.show(1, " MB"),
            if r.native { format!("{:.1} MB", r.size) } else { "—".into() },
            if r.native { format!("{:.2} MB", r.zip) } else { "—".into() },
        ));
    }
    s
}

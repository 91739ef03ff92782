//! `relay-e2e`: the real Lambda binaries, run by cargo lambda's emulator (`cargo lambda watch`,
//! no Docker), against moto (DynamoDB and SQS) with the table and queues created from what
//! `template.yaml` declares, and the fake CaptchaAI delivering pingbacks over HTTP.
//!
//! This harness plays the parts AWS plays: the schedules (it invokes the poller, the delivery
//! sweep and the submitter once a minute, invocations may overlap), the SQS event source
//! (receive with the queue's own visibility timeout → invoke the redrive function with a real SQS
//! event → delete all but the reported failures), the DynamoDB stream's event source mappings
//! (moto's table stream, read with GetRecords by each mapping with its own iterator, filtered by
//! its FilterCriteria from the template, batched by its BatchSize into DynamoDB stream events,
//! one batch in flight at a time, records older than its MaximumRecordAgeInSeconds dropped): the
//! delivery function's (a failed batch retried 3 times, then counted as sent to the failures
//! queue) and the submitter's wake-ups (writes of the `submitq#wake` item; a failed invocation is
//! not retried, only counted), and the delivery function's retry queue (its delayed messages
//! received as they become visible, each batch an SQS event for the delivery function). Half the
//! tasks carry an owner callback URL pointing at a receiver on loopback that fails by pattern
//! (500 once, 410): every push must end delivered or gone, one `webhook-id` per task, each
//! signature accepted by the Standard Webhooks reference library. The relay runs with the
//! template's defaults (callback grace per kind, poll rate, batching off, the submit queue's
//! settings); on real time, only the fake's timings are compressed.
//!
//!   relay-e2e [--tasks N] [--chaos] [--ban] [--seed S] [--threads N]
//!
//! Default (the test command's run): 200 tasks of every kind, 30 % of callbacks dropped, 10 %
//! duplicated, a burst of failed result writes, and a CaptchaAI plan of 18 threads (`--threads`,
//! 0 = unlimited): the owner's burst goes above it, so most tasks wait in the submit queue
//! (answered 202 `queued`, `OK|<id>` on /in.php — accepted tasks the owner reads until final as
//! any other) and the submitter releases them as threads free, meeting "no slot" answers.
//! `--chaos` adds everything the local chaos run injects that this stack can: 10 % late and 5 %
//! conflicting pingbacks, 10 % of store writes failing, a store outage, SQS sends failing in
//! bursts, res.php 5xx and HTML bursts; `--ban` one IP ban (5 minutes, as CaptchaAI gives it).
//! The documented run:
//!
//!   infra/e2e.sh --tasks 1000 --chaos --ban
//!
//! Pass: every task ends with the fake's solution or error, written once (lost = 0,
//! double-applied = 0), every in.php call a task the fake accepted or an explicit NO_SLOT
//! refusal (or, with `--ban`, a request the ban answered), no task paid twice, ≤ 20 res.php
//! reads per task, no ban but the injected one, at most 60 NO_SLOT answers in any minute, no
//! stale token handed out, no dead letter left, metrics from every function; with a thread plan,
//! tasks queued at submit and the submitter woken by the stream. Failed submitter invocations
//! are reported, not failures by themselves (neither of its triggers retries).
//!
//! Needs: `RELAY_TEMPLATE_JSON` (template.yaml as JSON) and `cargo lambda` on PATH
//! (`infra/e2e.sh` provides both); moto from `RELAY_TEST_SQS_ENDPOINT`, or one it starts.

use std::collections::HashMap;
use std::process::Stdio;
use std::time::{Duration, Instant};

use anyhow::{Context, bail, ensure};
use aws_sdk_dynamodb::types::{
    AttributeDefinition, BillingMode, GlobalSecondaryIndex, KeySchemaElement, KeyType, Projection, ProjectionType,
    ScalarAttributeType,
};
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::deadletter::SqsQueue;
use relay_shared::domain::{CaptchaKind, DeliveryStatus};
use relay_shared::testkit::receiver::{Receiver, verify_with_reference};
use relay_shared::testkit::{FlakyDynamo, body_for, client_for, sqs_client_for, sqs_event};
use relay_shared::time::{Clock, SystemClock, Timestamp};
use serde_json::{Value, json};

const API_KEY: &str = "e2e-owner-key";

fn s(v: &Value) -> anyhow::Result<&str> {
    v.as_str().with_context(|| format!("expected a string, got {v}"))
}

/// A template value with `Ref`s to parameters resolved to their defaults.
fn resolve(template: &Value, v: &Value) -> Value {
    match v.get("Ref").and_then(Value::as_str) {
        Some(p) => template["Parameters"][p]["Default"].clone(),
        None => v.clone(),
    }
}

async fn create_table(template: &Value, client: &aws_sdk_dynamodb::Client, name: &str) -> anyhow::Result<()> {
    let props = &template["Resources"]["TasksTable"]["Properties"];
    let key = |k: &Value| -> anyhow::Result<KeySchemaElement> {
        Ok(KeySchemaElement::builder()
            .attribute_name(s(&k["AttributeName"])?)
            .key_type(KeyType::from(s(&k["KeyType"])?))
            .build()?)
    };
    let mut req = client.create_table().table_name(name).billing_mode(BillingMode::PayPerRequest);
    for d in props["AttributeDefinitions"].as_array().context("AttributeDefinitions")? {
        req = req.attribute_definitions(
            AttributeDefinition::builder()
                .attribute_name(s(&d["AttributeName"])?)
                .attribute_type(ScalarAttributeType::from(s(&d["AttributeType"])?))
                .build()?,
        );
    }
    for k in props["KeySchema"].as_array().context("KeySchema")? {
        req = req.key_schema(key(k)?);
    }
    for g in props["GlobalSecondaryIndexes"].as_array().context("GlobalSecondaryIndexes")? {
        let mut gsi = GlobalSecondaryIndex::builder().index_name(s(&g["IndexName"])?).projection(
            Projection::builder().projection_type(ProjectionType::from(s(&g["Projection"]["ProjectionType"])?)).build(),
        );
        for k in g["KeySchema"].as_array().context("index KeySchema")? {
            gsi = gsi.key_schema(key(k)?);
        }
        req = req.global_secondary_indexes(gsi.build()?);
    }
    if let Some(view) = props["StreamSpecification"]["StreamViewType"].as_str() {
        req = req.stream_specification(
            aws_sdk_dynamodb::types::StreamSpecification::builder()
                .stream_enabled(true)
                .stream_view_type(aws_sdk_dynamodb::types::StreamViewType::from(view))
                .build()?,
        );
    }
    req.send().await?;
    let ttl = &props["TimeToLiveSpecification"];
    client
        .update_time_to_live()
        .table_name(name)
        .time_to_live_specification(
            aws_sdk_dynamodb::types::TimeToLiveSpecification::builder()
                .attribute_name(s(&ttl["AttributeName"])?)
                .enabled(ttl["Enabled"].as_bool().unwrap_or(false))
                .build()?,
        )
        .send()
        .await?;
    Ok(())
}

/// Creates the template's queues (poison first, then the dead-letter queue whose redrive
/// policy points at it, then the delivery function's retry queue). Returns (dead-letter queue,
/// poison queue, retry queue).
async fn create_queues(
    template: &Value,
    client: &aws_sdk_sqs::Client,
    suffix: &str,
) -> anyhow::Result<(SqsQueue, SqsQueue, SqsQueue)> {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let res = &template["Resources"];
    let mut urls = HashMap::new();
    let mut arns = HashMap::new();
    for name in ["PoisonQueue", "DeadLetterQueue", "DeliveryRetryQueue"] {
        let props = &res[name]["Properties"];
        let mut req = client.create_queue().queue_name(format!("{name}-{suffix}"));
        if let Some(v) = props.get("VisibilityTimeout") {
            req = req.attributes(A::VisibilityTimeout, resolve(template, v).to_string());
        }
        if let Some(v) = props.get("MessageRetentionPeriod") {
            req = req.attributes(A::MessageRetentionPeriod, resolve(template, v).to_string());
        }
        if let Some(p) = props.get("RedrivePolicy") {
            let target = p["deadLetterTargetArn"]["Fn::GetAtt"][0].as_str().context("redrive target")?;
            let policy = json!({
                "deadLetterTargetArn": arns.get(target).context("redrive target not created")?,
                "maxReceiveCount": resolve(template, &p["maxReceiveCount"]),
            });
            req = req.attributes(A::RedrivePolicy, policy.to_string());
        }
        let url = req.send().await?.queue_url.context("queue url")?;
        let arn = client
            .get_queue_attributes()
            .queue_url(&url)
            .attribute_names(A::QueueArn)
            .send()
            .await?
            .attributes
            .and_then(|a| a.get(&A::QueueArn).cloned())
            .context("queue arn")?;
        arns.insert(name, arn);
        urls.insert(name, url);
    }
    Ok((
        SqsQueue::new(client.clone(), urls["DeadLetterQueue"].clone()),
        SqsQueue::new(client.clone(), urls["PoisonQueue"].clone()),
        SqsQueue::new(client.clone(), urls["DeliveryRetryQueue"].clone()),
    ))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

#[derive(Clone)]
struct Emulator {
    base: String,
    http: reqwest::Client,
}

impl Emulator {
    async fn invoke(&self, function: &str, payload: &Value) -> anyhow::Result<Value> {
        let url = format!("{}/2015-03-31/functions/{function}/invocations", self.base);
        let resp = self.http.post(url).json(payload).timeout(Duration::from_secs(300)).send().await?;
        let status = resp.status();
        let body = resp.text().await?;
        ensure!(status.is_success(), "{function} answered {status}: {body}");
        Ok(serde_json::from_str(&body).unwrap_or(Value::String(body)))
    }

    async fn get_task(&self, task_ref: &str) -> anyhow::Result<Value> {
        let url = self.url("relay-api", &format!("/tasks/{task_ref}"));
        Ok(self.http.get(url).bearer_auth(API_KEY).send().await?.json().await?)
    }

    fn url(&self, function: &str, path: &str) -> String {
        format!("{}/lambda-url/{function}{path}", self.base)
    }
}

const USAGE: &str = "relay-e2e [--tasks N] [--chaos] [--ban] [--seed S] [--threads N]";

/// The fake CaptchaAI's thread plan by default: small enough that a burst of submits waits in
/// the submit queue, large enough that the run takes about what it took before the queue.
/// (Measured on 2 cores at seed 7: 8 threads took 436 s, 16 took 271 s, 18 took 149 s with
/// 153 tasks queued and a few NO_SLOT answers, 20 and more met no NO_SLOT answer.)
const DEFAULT_THREADS: u32 = 18;

/// What the run does.
#[derive(Debug, Clone)]
struct Config {
    tasks: usize,
    chaos: bool,
    ban: bool,
    seed: u64,
    /// The fake's thread plan (tasks in work at once; 0 = unlimited).
    threads: u32,
}

impl Config {
    fn from_args() -> anyhow::Result<Self> {
        let mut c = Self { tasks: 200, chaos: false, ban: false, seed: 7, threads: DEFAULT_THREADS };
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            let mut num = |name: &str| -> anyhow::Result<u64> {
                args.next()
                    .with_context(|| format!("{name} needs a value"))?
                    .parse()
                    .with_context(|| format!("{name} must be a whole number"))
            };
            match a.as_str() {
                "--tasks" => c.tasks = usize::try_from(num("--tasks")?)?,
                "--seed" => c.seed = num("--seed")?,
                "--threads" => c.threads = u32::try_from(num("--threads")?)?,
                "--chaos" => c.chaos = true,
                "--ban" => c.ban = true,
                "-h" | "--help" => {
                    println!("{USAGE}");
                    std::process::exit(0);
                }
                other => bail!("unknown argument `{other}` ({USAGE})"),
            }
        }
        ensure!(c.tasks > 0, "--tasks must be at least 1");
        Ok(c)
    }
}

/// One of the owner's tasks, as the owner saw it.
#[derive(Debug, Clone)]
struct Owned {
    kind: CaptchaKind,
    task_ref: String,
    /// When the owner first got a token, the token, and the path it came by.
    handed_out: Option<(Timestamp, String, String)>,
    done: bool,
    /// The owner callback URL it was submitted with.
    callback: Option<String>,
    /// Answered as queued at submit (202 `queued` on /tasks; on /in.php, whose `OK|<id>` says
    /// nothing of it, the task read from the store right after the answer).
    queued: bool,
}

/// The in.php form a 2captcha client sends for a kind (the relay key added by the caller).
fn compat_form(kind: CaptchaKind) -> &'static str {
    match kind {
        CaptchaKind::RecaptchaV2 => "method=userrecaptcha&googlekey=6Le-sim&pageurl=https://shop.example/login",
        CaptchaKind::RecaptchaV3 => {
            "method=userrecaptcha&version=v3&action=login&googlekey=6Le-sim&pageurl=https://shop.example/login"
        }
        CaptchaKind::RecaptchaEnterprise => {
            "method=userrecaptcha&enterprise=1&googlekey=6Le-sim&pageurl=https://shop.example/login"
        }
        CaptchaKind::Hcaptcha => "method=hcaptcha&sitekey=10000000-ffff&pageurl=https://shop.example/login",
        CaptchaKind::Turnstile => "method=turnstile&sitekey=0x4AAA&pageurl=https://shop.example/login",
        CaptchaKind::Image => {
            "method=base64&body=iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNkYPhfDwAChwGA60e6kgAAAABJRU5ErkJggg%3D%3D"
        }
        CaptchaKind::Geetest => {
            "method=geetest&gt=81388ea1fc187e0c335c0a8907ff2625&challenge=2e2f0f65240058b683cb6ea21c303eea&pageurl=https://shop.example/login"
        }
        CaptchaKind::CloudflareChallenge => {
            "method=cloudflare_challenge&pageurl=https://shop.example/login&proxy=user:pass@203.0.113.7:3128&proxytype=HTTP"
        }
        CaptchaKind::Bls => {
            "method=bls&instructions=664&image_base64_1=iVBORw0KGgo%3D&image_base64_2=iVBORw0KGgo%3D&image_base64_3=iVBORw0KGgo%3D&image_base64_4=iVBORw0KGgo%3D&image_base64_5=iVBORw0KGgo%3D&image_base64_6=iVBORw0KGgo%3D&image_base64_7=iVBORw0KGgo%3D&image_base64_8=iVBORw0KGgo%3D&image_base64_9=iVBORw0KGgo%3D"
        }
    }
}

/// `res.php?action=get` for a task submitted through `/in.php`.
async fn res_compat(emu: &Emulator, task_ref: &str, key: &str) -> anyhow::Result<String> {
    let r = relay_shared::domain::TaskRef::parse(task_ref)?;
    let id = r.compat_id().context("not a compat task")?;
    let url = emu.url("relay-api", &format!("/res.php?key={key}&action=get&id={id}"));
    Ok(emu.http.get(url).send().await?.text().await?)
}

/// Submits as a careful client does: an idempotency key; on a 429, or a 503 that says retrying
/// is safe, again after `Retry-After` with the same key; on no answer, again after 2 s. With a
/// relay key, through the 2captcha-compatible `/in.php` as an SDK would (retrying a 503 or
/// `ERROR_NO_SLOT_AVAILABLE`). A submit answered 202 `queued` (`OK|<id>` on /in.php) is an
/// accepted task like any other. Returns the task's reference and whether it was queued: on
/// /tasks the answer says so; on /in.php the task as the store holds it right after the answer
/// does (still queued, or released by the submitter since: `released_at` is set).
async fn submit(
    emu: &Emulator,
    store: &relay_shared::store::TaskStore,
    cfg: &Config,
    n: usize,
    kind: CaptchaKind,
    relay_key: Option<&str>,
    callback: Option<&str>,
) -> anyhow::Result<(String, bool)> {
    let json_body = match callback {
        Some(url) => {
            let mut v: Value = serde_json::from_str(body_for(kind))?;
            v["callback_url"] = Value::String(url.to_owned());
            v.to_string()
        }
        None => body_for(kind).to_owned(),
    };
    let pingback =
        callback.map(|u| format!("&pingback={}", u.replace(':', "%3A").replace('/', "%2F"))).unwrap_or_default();
    for _ in 0..200 {
        let req = match relay_key {
            None => emu
                .http
                .post(emu.url("relay-api", "/tasks"))
                .bearer_auth(API_KEY)
                .header("content-type", "application/json")
                .header("idempotency-key", format!("e2e-{}-{n}", cfg.seed))
                .body(json_body.clone()),
            Some(key) => emu
                .http
                .post(emu.url("relay-api", "/in.php"))
                .header("content-type", "application/x-www-form-urlencoded")
                .header("idempotency-key", format!("e2e-compat-{}-{n}", cfg.seed))
                .body(format!("key={key}&{}{pingback}", compat_form(kind))),
        };
        let wait = match req.timeout(Duration::from_secs(60)).send().await {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let after =
                    resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
                let text = resp.text().await.unwrap_or_default();
                if relay_key.is_some() {
                    if let Some(id) = text.strip_prefix("OK|") {
                        let task_ref = relay_shared::domain::TaskRef::from_compat_id(id)?;
                        let task =
                            store.tasks().get(&task_ref).await?.context("an accepted compat task is not stored")?;
                        let queued = matches!(task.state, relay_shared::domain::TaskState::Queued { .. })
                            || task.released_at.is_some();
                        return Ok((task_ref.to_string(), queued));
                    }
                    ensure!(
                        status == 503 || text == "ERROR_NO_SLOT_AVAILABLE",
                        "compat submit {n} answered {status}: {text}"
                    );
                    Duration::from_secs(after.unwrap_or(2))
                } else {
                    let v: Value = serde_json::from_str(&text).unwrap_or_default();
                    if matches!(status, 200 | 202) {
                        let queued = status == 202 && v["status"] == "queued";
                        return Ok((s(&v["task_ref"])?.to_owned(), queued));
                    }
                    ensure!(
                        matches!(status, 429 | 503) && v["error"]["retry_safe"] == true,
                        "submit {n} answered {status}: {v}"
                    );
                    Duration::from_secs(after.unwrap_or(5))
                }
            }
            Err(_) => Duration::from_secs(2),
        };
        tokio::time::sleep(wait).await;
    }
    bail!("submit {n} never got an answer")
}

/// The owner reading its open tasks every 5 s, as a client waiting for tokens does.
async fn read_open(emu: &Emulator, owned: &std::sync::Mutex<Vec<Owned>>) {
    let open: Vec<(usize, String)> = owned
        .lock()
        .map(|o| o.iter().enumerate().filter(|(_, t)| !t.done).map(|(i, t)| (i, t.task_ref.clone())).collect())
        .unwrap_or_default();
    for chunk in open.chunks(16) {
        let mut reads = tokio::task::JoinSet::new();
        for (i, r) in chunk.iter().cloned() {
            let emu = emu.clone();
            reads.spawn(async move { (i, emu.get_task(&r).await) });
        }
        while let Some(done) = reads.join_next().await {
            let Ok((i, Ok(v))) = done else { continue };
            let now = SystemClock.now();
            if let Ok(mut o) = owned.lock()
                && let Some(t) = o.get_mut(i)
            {
                let solution = v["solution"].as_str().or_else(|| v["late_result"]["solution"].as_str());
                if let (None, Some(sol)) = (&t.handed_out, solution) {
                    let via = v["resolved_via"].as_str().or_else(|| v["late_result"]["received_via"].as_str());
                    t.handed_out = Some((now, sol.to_owned(), via.unwrap_or_default().to_owned()));
                }
                t.done = t.handed_out.is_some() || matches!(v["status"].as_str(), Some("failed" | "expired"));
            }
        }
    }
}

fn threads_text(threads: u32) -> String {
    if threads == 0 { "unlimited".into() } else { threads.to_string() }
}

fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut v = v.to_vec();
    v.sort_by(f64::total_cmp);
    v[((p / 100.0) * (v.len() - 1) as f64).round() as usize]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cfg = Config::from_args()?;
    let started = Instant::now();
    let moto = relay_shared::testkit::LocalSqs::from_env()?.endpoint;
    let template: Value = serde_json::from_str(&std::fs::read_to_string(
        std::env::var("RELAY_TEMPLATE_JSON").context("RELAY_TEMPLATE_JSON is not set")?,
    )?)?;
    let suffix = format!("{}", std::process::id());
    let table = format!("e2e-tasks-{suffix}");
    create_table(&template, &client_for(&moto), &table).await.context("creating the table from the template")?;
    let (dlq, poison, retry_queue) =
        create_queues(&template, &sqs_client_for(&moto), &suffix).await.context("creating the queues")?;
    let visibility = resolve(&template, &template["Resources"]["DeadLetterQueue"]["Properties"]["VisibilityTimeout"])
        .as_i64()
        .and_then(|v| i32::try_from(v).ok())
        .context("the dead-letter queue's visibility timeout")?;
    let flaky = FlakyDynamo::start(&moto).await?;
    let flaky_sqs = FlakyDynamo::start(&moto).await?;
    let fake = FakeCaptchaAi::start(fake_config(&cfg)).await?;
    let receiver = Receiver::start(std::sync::Arc::new(SystemClock)).await?;
    let (_, webhook_secret) = relay_shared::webhook::WebhookSecret::generate();

    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    // The template's values for everything it sets; no CALLBACK_GRACE_SECS: the deployed
    // default (per kind) applies.
    let env = [
        ("TABLE_NAME", table.clone()),
        ("AWS_ENDPOINT_URL_DYNAMODB", flaky.endpoint.clone()),
        ("AWS_ENDPOINT_URL_SQS", flaky_sqs.endpoint.clone()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("CAPTCHAAI_BASE_URL", fake.base_url()),
        ("CAPTCHAAI_API_KEY", fake.api_key()),
        ("CALLBACK_SIGNING_SECRET", "e2e-signing-secret".into()),
        ("RELAY_API_KEY", API_KEY.into()),
        ("AUTH_MODE", "api_key".into()),
        ("CALLBACK_BASE_URL", format!("{base}/lambda-url/relay-callback")),
        ("DEAD_LETTER_QUEUE_URL", dlq.url().to_owned()),
        ("POISON_QUEUE_URL", poison.url().to_owned()),
        // Through the flaky proxy like every SQS call: a lost retry message costs only time.
        ("DELIVERY_RETRY_QUEUE_URL", retry_queue.url().to_owned()),
        ("WEBHOOK_SECRETS", webhook_secret.clone()),
        // The receiver is on loopback; on AWS the template sets public_https (the guard's own
        // tests cover it).
        ("DELIVERY_URL_POLICY", "allow_loopback".into()),
        ("RUST_LOG", "info".into()),
    ];
    let mut env_arg = env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
    // The submit queue's settings, as the template deploys them (the API's and the submitter's
    // are the same parameters): every variable the submitter gets from a parameter with a
    // default, unless set above (its key comes as CAPTCHAAI_API_KEY, not a parameter's name;
    // an empty CALLBACK_GRACE_SECS means per kind, as the code's default).
    let vars = template["Resources"]["SubmitterFunction"]["Properties"]["Environment"]["Variables"]
        .as_object()
        .context("the submitter's environment in the template")?;
    for (name, v) in vars {
        let value = match resolve(&template, v) {
            Value::String(s) => s,
            Value::Number(n) => n.to_string(),
            _ => continue,
        };
        if !value.is_empty() && !name.ends_with("_PARAM") && !env.iter().any(|(k, _)| k == name) {
            env_arg.push(format!("{name}={value}"));
        }
    }
    let log_path = "target/e2e-lambda.log";
    let log = std::fs::File::create(log_path)?;
    let mut cmd = tokio::process::Command::new("cargo");
    cmd.args([
        "lambda",
        "watch",
        "--ignore-changes",
        "--invoke-address",
        "127.0.0.1",
        "--invoke-port",
        &port.to_string(),
    ]);
    for e in &env_arg {
        cmd.args(["--env-var", e]);
    }
    let mut child = cmd.stdout(Stdio::from(log.try_clone()?)).stderr(Stdio::from(log)).kill_on_drop(true).spawn()?;
    let emu = Emulator { base: base.clone(), http: reqwest::Client::new() };
    let mut up = false;
    for _ in 0..1200 {
        if emu.http.get(&base).send().await.is_ok() {
            up = true;
            break;
        }
        if let Ok(Some(status)) = child.try_wait() {
            bail!("cargo lambda watch exited ({status}); see {log_path}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(up, "cargo lambda watch did not listen within 120 s; see {log_path}");

    let parts = Parts {
        emu: &emu,
        fake: &fake,
        flaky: &flaky,
        flaky_sqs: &flaky_sqs,
        dlq: &dlq,
        poison: &poison,
        retry_queue: &retry_queue,
        receiver: &receiver,
        webhook_secret: &webhook_secret,
    };
    let result = scenario(&cfg, &parts, &template, visibility, &table, &moto).await;
    let _ = child.kill().await;
    let logs = std::fs::read_to_string(log_path).unwrap_or_default();
    let metric_docs = logs.lines().filter(|l| l.contains("\"_aws\"") && l.contains("CaptchaRelay")).count();
    let result = result.and_then(|report| {
        ensure!(metric_docs > 0, "no EMF metric documents in {log_path}");
        let silent: Vec<&str> = ["api", "callback", "poller", "redrive", "delivery", "submitter"]
            .into_iter()
            .filter(|s| !logs.lines().any(|l| l.contains("\"_aws\"") && l.contains(&format!("\"service\":\"{s}\""))))
            .collect();
        ensure!(silent.is_empty(), "no metrics from {silent:?}");
        // Nothing secret in any log line or metric: keys, signing secret, tokens.
        let leaked: Vec<&String> =
            report.secrets.iter().filter(|s| s.len() >= 6 && logs.contains(s.as_str())).collect();
        ensure!(leaked.is_empty(), "{} secrets or tokens in the functions' logs", leaked.len());
        Ok(report)
    });
    match result {
        Ok(report) => {
            println!("{}", report.table);
            println!("{metric_docs} EMF documents; {:.1} s in all", started.elapsed().as_secs_f64());
            println!("1 passed, 0 failed");
            Ok(())
        }
        Err(e) => {
            eprintln!("e2e failed: {e:#}\n(logs of the functions: {log_path})");
            println!("0 passed, 1 failed");
            Err(e)
        }
    }
}

struct Parts<'a> {
    emu: &'a Emulator,
    fake: &'a FakeCaptchaAi,
    flaky: &'a FlakyDynamo,
    flaky_sqs: &'a FlakyDynamo,
    dlq: &'a SqsQueue,
    poison: &'a SqsQueue,
    retry_queue: &'a SqsQueue,
    receiver: &'a Receiver,
    webhook_secret: &'a str,
}

struct Report {
    table: String,
    secrets: Vec<String>,
}

/// The fake: CaptchaAI's protocol, bans enforced; solving compressed to a few seconds (the
/// relay's own timings are the template's).
fn fake_config(cfg: &Config) -> FakeConfig {
    let now = SystemClock.now().as_millis();
    let at = |secs: u64| now + secs * 1_000;
    let mut c = FakeConfig {
        seed: cfg.seed,
        solve_delay_ms: 3_000,
        drop_callbacks: 0.3,
        duplicate_callbacks: 0.1,
        ..FakeConfig::default()
    };
    if cfg.chaos {
        c.late_callbacks = 0.1;
        // After the poller has read it (first reads 20–65 s after submit, one invocation a
        // minute).
        c.late_callback_ms = 150_000;
        c.conflicting_callbacks = 0.05;
        c.unsolvable = 0.02;
        c.faults = vec![
            fake_captchaai::Fault {
                from_ms: at(50),
                until_ms: at(70),
                endpoint: fake_captchaai::Endpoint::ResPhp,
                kind: fake_captchaai::FaultKind::Http5xx,
            },
            fake_captchaai::Fault {
                from_ms: at(110),
                until_ms: at(130),
                endpoint: fake_captchaai::Endpoint::ResPhp,
                kind: fake_captchaai::FaultKind::Html,
            },
        ];
    }
    // The account's thread plan: a submit while that many tasks are in work is answered
    // ERROR_NO_SLOT_AVAILABLE (and NO_SLOT answers, repeated, ban).
    c.threads = (cfg.threads > 0).then_some(cfg.threads);
    c
}

/// One invocation of the submitter: what started it, and its run report (or why it failed).
#[derive(Debug, Clone)]
struct SubmitterRun {
    trigger: &'static str,
    report: Result<Value, String>,
}

type SubmitterRuns = std::sync::Arc<std::sync::Mutex<Vec<SubmitterRun>>>;

fn record_run(runs: &SubmitterRuns, trigger: &'static str, result: &anyhow::Result<Value>) {
    if let Err(e) = result {
        eprintln!("submitter invocation ({trigger}) failed: {e:#}");
    }
    let report = match result {
        Ok(v) => Ok(v.clone()),
        Err(e) => Err(format!("{e:#}")),
    };
    if let Ok(mut r) = runs.lock() {
        r.push(SubmitterRun { trigger, report });
    }
}

async fn scenario(
    cfg: &Config,
    p: &Parts<'_>,
    template: &Value,
    visibility: i32,
    table: &str,
    moto: &str,
) -> anyhow::Result<Report> {
    let t0 = Instant::now();
    let store = relay_shared::store::TaskStore::new(client_for(moto), table, Duration::from_secs(7 * 86_400));
    // A relay key, made as `relay-ops keys create` makes one, in the table the functions use.
    let relay_key = store.key_admin().create_relay_key("e2e", SystemClock.now()).await?;
    let relay_key = secrecy::ExposeSecret::expose_secret(&relay_key);
    let owned = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Owned>::with_capacity(cfg.tasks)));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let schedule: Value =
        serde_json::from_str(include_str!("../../../functions/poller/tests/fixtures/scheduler-event.json"))?;
    let invocations = std::sync::Arc::new(std::sync::Mutex::new(Vec::<Value>::new()));
    let submitter_runs = SubmitterRuns::default();
    let drained = std::sync::atomic::AtomicUsize::new(0);
    if cfg.chaos {
        p.flaky.set_write_failure_rate(0.1);
    }

    let submitter = async {
        for n in 0..cfg.tasks {
            if !cfg.chaos && n == cfg.tasks / 3 {
                // A burst of failed result writes from the callback function (its writes
                // throttled) while a slice of the results comes in: those callbacks are
                // dead-lettered, and the redrive, whose writes go through, applies them. (Failing
                // the redrive's writes too would park each letter for the queue's visibility
                // timeout, 185 s, and the poller — grace 120 s — would then win the race: that
                // interleaving is the chaos run's and the store tests'.)
                settle(p.fake).await;
                p.flaky.set_failing_matching(Some(r#"{"S":"callback"}"#));
            }
            if !cfg.chaos && n == cfg.tasks / 2 {
                settle(p.fake).await;
                p.flaky.set_failing_matching(None);
            }
            let kind = CaptchaKind::CAPTCHAAI[n % CaptchaKind::CAPTCHAAI.len()];
            // Every fourth task as a 2captcha SDK submits it: `/in.php` with a relay key.
            // Every other task with an owner callback URL (pattern by n: mostly fine, 500 once,
            // 410), the compat ones as a 2captcha `pingback`.
            let callback = (n % 2 == 1).then(|| {
                let pattern = ["ok", "ok", "ok", "once", "gone"][(n / 2) % 5];
                format!("{}/{pattern}/{n}", p.receiver.base_url)
            });
            let relay_key = (n % 4 == 3).then_some(relay_key);
            let (task_ref, queued) = submit(p.emu, &store, cfg, n, kind, relay_key, callback.as_deref()).await?;
            if let Ok(mut o) = owned.lock() {
                o.push(Owned { kind, task_ref, handed_out: None, done: false, callback, queued });
            }
            // Under the relay's account-wide pace (14 a second, below MAX_USER_TURN).
            tokio::time::sleep(Duration::from_millis(75)).await;
        }
        anyhow::Ok(())
    };
    // The faults on the clock (chaos): a store outage, SQS sends failing in bursts, a ban.
    let director = async {
        if !cfg.chaos {
            return;
        }
        // The store down while results pour in (callbacks dead-lettered, submits refused as
        // safe to retry), SQS down inside that (callbacks then answer 503, the poller is the
        // net), SQS down again among the late pingbacks, the ban once the submits are in.
        let mut plan: Vec<(u64, &str)> = vec![
            (20, "store down"),
            (30, "sqs down"),
            (40, "sqs up"),
            (50, "store up"),
            (150, "sqs down"),
            (170, "sqs up"),
        ];
        if cfg.ban {
            plan.push((200, "ban"));
        }
        plan.sort_by_key(|(t, _)| *t);
        for (at, step) in plan {
            tokio::time::sleep_until((t0 + Duration::from_secs(at)).into()).await;
            eprintln!("chaos: {step} at {at} s");
            match step {
                "sqs down" => p.flaky_sqs.set_failing(true),
                "sqs up" => p.flaky_sqs.set_failing(false),
                "store down" => p.flaky.set_failing(true),
                "store up" => p.flaky.set_failing(false),
                _ => p.fake.ban_ip(Duration::from_secs(300)),
            }
        }
    };
    // The schedule: one invocation a minute, overlapping if one runs long.
    let scheduler = async {
        // Each invocation runs on its own (it may outlast the minute, as on AWS); the schedule
        // does not wait for it.
        let mut running = tokio::task::JoinSet::new();
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let (emu, sweep) = (p.emu.clone(), schedule.clone());
            running.spawn(async move {
                // The delivery function's own schedule: a sweep a minute.
                if let Err(e) = emu.invoke("relay-delivery", &sweep).await {
                    eprintln!("delivery sweep failed: {e:#}");
                }
            });
            // The submitter's schedule (its backstop; no retry of a failed invocation).
            let (emu, event, runs) = (p.emu.clone(), schedule.clone(), submitter_runs.clone());
            running.spawn(async move {
                let result = emu.invoke("relay-submitter", &event).await;
                record_run(&runs, "schedule", &result);
            });
            let (emu, schedule, invocations) = (p.emu.clone(), schedule.clone(), invocations.clone());
            running.spawn(async move {
                match emu.invoke("relay-poller", &schedule).await {
                    Ok(v) => {
                        if let Ok(mut i) = invocations.lock() {
                            i.push(v);
                        }
                    }
                    Err(e) => eprintln!("poller invocation failed: {e:#}"),
                }
            });
            for _ in 0..60 {
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
        while running.join_next().await.is_some() {}
    };
    // The SQS event source, with the queue's own visibility timeout.
    let event_source = async {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            match drain_once(p.emu, p.dlq, visibility).await {
                Ok(0) | Err(_) => tokio::time::sleep(Duration::from_secs(1)).await,
                Ok(n) => {
                    drained.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
                }
            }
        }
    };
    // The retry queue's event source (no batching window, as the template's): a message visible
    // (its delay over) wakes the delivery function with it; all are deleted (a push the
    // function could not record stays due in the index, the sweep's).
    let retries = std::sync::atomic::AtomicUsize::new(0);
    let retry_source = async {
        while !stop.load(std::sync::atomic::Ordering::SeqCst) {
            let got = p.retry_queue.receive(10, 360, 1).await.unwrap_or_default();
            if got.is_empty() {
                tokio::time::sleep(Duration::from_millis(200)).await;
                continue;
            }
            let event = sqs_event("arn:aws:sqs:us-east-1:123456789012:DeliveryRetryQueue", &got);
            if let Err(e) = p.emu.invoke("relay-delivery", &event).await {
                eprintln!("retry batch failed: {e:#}");
            }
            retries.fetch_add(got.len(), std::sync::atomic::Ordering::SeqCst);
            for m in &got {
                let _ = p.retry_queue.delete(&m.receipt_handle).await;
            }
        }
    };
    // The DynamoDB stream's event source mappings, each with its own iterator and filter: the
    // delivery function's (retried, then to the failures queue) and the submitter's wake-ups
    // (never retried: a failed one is counted, the schedule is the backstop).
    let stream_failed = std::sync::atomic::AtomicUsize::new(0);
    // (Its failed wake-ups are in `submitter_runs`.)
    let wake_failed = std::sync::atomic::AtomicUsize::new(0);
    let wake_too_old = std::sync::atomic::AtomicUsize::new(0);
    let stream = async {
        let delivery =
            StreamConsumer { function: "relay-delivery", resource: "DeliveryFunction", event: "TableStream" };
        let wake = StreamConsumer { function: "relay-submitter", resource: "SubmitterFunction", event: "Wake" };
        let record = |result: &anyhow::Result<Value>| record_run(&submitter_runs, "stream", result);
        let (d, w) = tokio::join!(
            stream_source(p.emu, template, moto, table, &stop, &delivery, &stream_failed, &stream_failed, &|_| {}),
            stream_source(p.emu, template, moto, table, &stop, &wake, &wake_failed, &wake_too_old, &record),
        );
        for (name, result) in [("delivery", d), ("submitter", w)] {
            if let Err(e) = result {
                eprintln!("stream event source ({name}) failed: {e:#}");
                stream_failed.fetch_add(1_000_000, std::sync::atomic::Ordering::SeqCst);
            }
        }
    };
    let owner = async {
        let deadline = t0 + Duration::from_secs(45 * 60);
        loop {
            tokio::time::sleep(Duration::from_secs(5)).await;
            read_open(p.emu, &owned).await;
            let (n, open) = owned.lock().map(|o| (o.len(), o.iter().filter(|t| !t.done).count())).unwrap_or((0, 0));
            let settled = p.fake.tasks().iter().all(delivered);
            let letters = p.dlq.depth().await.unwrap_or(1) + p.poison.depth().await.unwrap_or(0);
            let pushed = n == cfg.tasks && open == 0 && pushes_settled(moto, table, &owned).await;
            if n == cfg.tasks && open == 0 && settled && letters == 0 && pushed {
                break;
            }
            if Instant::now() > deadline {
                break;
            }
        }
        stop.store(true, std::sync::atomic::Ordering::SeqCst);
    };
    let (submitted, (), (), (), (), (), ()) =
        tokio::join!(submitter, director, scheduler, event_source, retry_source, stream, owner);
    submitted?;
    // Poisoned letters: listed by the operator command's code, moved back, drained.
    let poisoned = relay_ops::list(p.poison, 10_000).await?;
    if !poisoned.is_empty() {
        relay_ops::move_messages(p.poison, p.dlq, u64::MAX, None, |_| {}).await?;
        drain_all(p.emu, p.dlq, visibility).await?;
    }
    check(
        cfg,
        p,
        &owned.lock().map(|o| o.clone()).unwrap_or_default(),
        table,
        moto,
        &invocations,
        &drained,
        poisoned.len(),
        t0,
        relay_key,
        (stream_failed.load(std::sync::atomic::Ordering::SeqCst), retries.load(std::sync::atomic::Ordering::SeqCst)),
        &Submitter {
            runs: submitter_runs.lock().map(|r| r.clone()).unwrap_or_default(),
            wakes_too_old: wake_too_old.load(std::sync::atomic::Ordering::SeqCst),
        },
    )
    .await
}

/// Whether every push owed to a task with a callback has ended (delivered or gone).
async fn pushes_settled(moto: &str, table: &str, owned: &std::sync::Mutex<Vec<Owned>>) -> bool {
    let store = relay_shared::store::TaskStore::new(client_for(moto), table, Duration::from_secs(7 * 86_400));
    let refs: Vec<String> = owned
        .lock()
        .map(|o| o.iter().filter(|t| t.callback.is_some()).map(|t| t.task_ref.clone()).collect())
        .unwrap_or_default();
    for r in refs {
        let Ok(task_ref) = relay_shared::domain::TaskRef::parse(&r) else { return false };
        let Ok(Some(task)) = store.tasks().get(&task_ref).await else { return false };
        let status = task.delivery.map(|d| d.status);
        if !matches!(status, Some(DeliveryStatus::Delivered | DeliveryStatus::Gone)) {
            return false;
        }
    }
    true
}

/// One DynamoDB Streams call to moto (its JSON protocol, as the SDK would send it).
async fn streams_call(http: &reqwest::Client, moto: &str, op: &str, body: &Value) -> anyhow::Result<Value> {
    let resp = http
        .post(moto)
        .header("x-amz-target", format!("DynamoDBStreams_20120810.{op}"))
        .header("content-type", "application/x-amz-json-1.0")
        .header(
            "authorization",
            "AWS4-HMAC-SHA256 Credential=test/20261204/us-east-1/dynamodb/aws4_request, SignedHeaders=host, Signature=0",
        )
        .body(body.to_string())
        .send()
        .await?;
    let status = resp.status();
    let text = resp.text().await?;
    ensure!(status.is_success(), "DynamoDB Streams {op}: {status} {text}");
    Ok(serde_json::from_str(&text)?)
}

/// A function the table's stream invokes: its binary, and the template's resource and DynamoDB
/// event that map the stream to it.
struct StreamConsumer {
    function: &'static str,
    resource: &'static str,
    event: &'static str,
}

/// An event source mapping's settings, as the template declares them.
#[derive(Debug)]
struct Mapping {
    /// The FilterCriteria's patterns (a record passes if any matches).
    patterns: Vec<Value>,
    batch_size: usize,
    retries: u32,
    max_age: Option<f64>,
}

impl Mapping {
    fn from_template(template: &Value, c: &StreamConsumer) -> anyhow::Result<Self> {
        let event = &template["Resources"][c.resource]["Properties"]["Events"][c.event];
        ensure!(event["Type"] == "DynamoDB", "{}.Events.{} is not a DynamoDB stream event", c.resource, c.event);
        let props = &event["Properties"];
        let patterns = props["FilterCriteria"]["Filters"]
            .as_array()
            .with_context(|| format!("{}.Events.{}: FilterCriteria", c.resource, c.event))?
            .iter()
            .map(|f| Ok(serde_json::from_str(s(&f["Pattern"])?)?))
            .collect::<anyhow::Result<Vec<Value>>>()?;
        let num = |name: &str| {
            resolve(template, &props[name])
                .as_u64()
                .with_context(|| format!("{}.Events.{}: {name}", c.resource, c.event))
        };
        Ok(Self {
            patterns,
            batch_size: usize::try_from(num("BatchSize")?)?,
            retries: u32::try_from(num("MaximumRetryAttempts")?)?,
            max_age: num("MaximumRecordAgeInSeconds").ok().map(|v| v as f64),
        })
    }

    fn passes(&self, record: &Value) -> bool {
        self.patterns.iter().any(|p| passes_filter(p, record))
    }
}

/// Whether a stream record passes one FilterCriteria pattern, as Lambda's event filtering reads
/// it: every key of the pattern present in the record (nested objects matched level by level),
/// and each leaf matching one of its list's rules — a string or number equal to the value, or
/// `{"exists": true|false}` (the leaf present or not).
fn passes_filter(pattern: &Value, record: &Value) -> bool {
    let Some(fields) = pattern.as_object() else { return false };
    fields.iter().all(|(key, rule)| {
        let value = &record[key];
        match rule {
            Value::Object(_) => passes_filter(rule, value),
            Value::Array(rules) => rules.iter().any(|r| match r {
                Value::Object(o) => match o.get("exists").and_then(Value::as_bool) {
                    Some(exists) if o.len() == 1 => exists == (*value != Value::Null),
                    _ => false,
                },
                Value::String(_) | Value::Number(_) | Value::Bool(_) => r == value,
                _ => false,
            }),
            _ => false,
        }
    })
}

/// An event source mapping of the table's stream: reads the stream from its start with its own
/// iterator, keeps the records its FilterCriteria pass, drops those older than its
/// `MaximumRecordAgeInSeconds` (counted in `too_old`), and invokes the function with batches of
/// its `BatchSize`, one at a time (one shard, one batch in flight, as Lambda does); a batch that
/// fails is retried `MaximumRetryAttempts` times, then counted in `failed` (for the delivery
/// function: sent to its failures queue). `invoked` sees every invocation's result.
#[allow(clippy::too_many_arguments)]
async fn stream_source(
    emu: &Emulator,
    template: &Value,
    moto: &str,
    table: &str,
    stop: &std::sync::atomic::AtomicBool,
    consumer: &StreamConsumer,
    failed: &std::sync::atomic::AtomicUsize,
    too_old: &std::sync::atomic::AtomicUsize,
    invoked: &(dyn Fn(&anyhow::Result<Value>) + Sync),
) -> anyhow::Result<()> {
    let mapping = Mapping::from_template(template, consumer)?;
    let http = reqwest::Client::new();
    let streams = streams_call(&http, moto, "ListStreams", &json!({ "TableName": table })).await?;
    let arn = s(&streams["Streams"][0]["StreamArn"])?.to_owned();
    let shards = streams_call(&http, moto, "DescribeStream", &json!({ "StreamArn": arn })).await?;
    let mut iterators = Vec::new();
    for shard in shards["StreamDescription"]["Shards"].as_array().context("shards")? {
        let it = streams_call(
            &http,
            moto,
            "GetShardIterator",
            &json!({ "StreamArn": arn, "ShardId": shard["ShardId"], "ShardIteratorType": "TRIM_HORIZON" }),
        )
        .await?;
        iterators.push(s(&it["ShardIterator"])?.to_owned());
    }
    while !stop.load(std::sync::atomic::Ordering::SeqCst) {
        let mut any = false;
        for it in &mut iterators {
            let out = streams_call(&http, moto, "GetRecords", &json!({ "ShardIterator": it, "Limit": 1000 })).await?;
            if let Some(next) = out["NextShardIterator"].as_str() {
                *it = next.to_owned();
            }
            let records: Vec<Value> = out["Records"]
                .as_array()
                .map(|r| r.iter().filter(|r| mapping.passes(r)).cloned().collect())
                .unwrap_or_default();
            for batch in records.chunks(mapping.batch_size.max(1)) {
                any = true;
                // Records too old when their batch comes up are not sent (Lambda discards them).
                let now = SystemClock.now().as_millis() as f64 / 1_000.0;
                let (fresh, old): (Vec<&Value>, Vec<&Value>) = batch.iter().partition(|r| {
                    let created = r["dynamodb"]["ApproximateCreationDateTime"].as_f64();
                    match (mapping.max_age, created) {
                        (Some(max), Some(at)) => now - at <= max,
                        _ => true,
                    }
                });
                too_old.fetch_add(old.len(), std::sync::atomic::Ordering::SeqCst);
                if fresh.is_empty() {
                    continue;
                }
                let event = json!({ "Records": fresh });
                let mut tries = 0;
                loop {
                    let result = emu.invoke(consumer.function, &event).await;
                    invoked(&result);
                    let Err(e) = result else { break };
                    tries += 1;
                    if tries > mapping.retries {
                        eprintln!(
                            "{} stream batch failed {tries} time(s), not retried further: {e:#}",
                            consumer.function
                        );
                        failed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        break;
                    }
                }
            }
        }
        if !any {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    Ok(())
}

/// What the harness saw of the submitter.
struct Submitter {
    runs: Vec<SubmitterRun>,
    /// Wake records dropped for their age before an invocation took them.
    wakes_too_old: usize,
}

#[allow(clippy::too_many_arguments)]
async fn check(
    cfg: &Config,
    p: &Parts<'_>,
    owned: &[Owned],
    table: &str,
    moto: &str,
    invocations: &std::sync::Mutex<Vec<Value>>,
    drained: &std::sync::atomic::AtomicUsize,
    poisoned: usize,
    t0: Instant,
    relay_key: &str,
    (stream_failed, retries): (usize, usize),
    sub: &Submitter,
) -> anyhow::Result<Report> {
    use relay_shared::domain::{Outcome, TaskRef, TaskState};
    let (mut compat_tasks, mut compat_disagree) = (0usize, Vec::new());
    let (mut pushes, mut pushed, mut gone, mut owed, mut extra_ids) = (0usize, 0usize, 0usize, Vec::new(), 0usize);
    let hits = p.receiver.hits();
    let store = relay_shared::store::TaskStore::new(client_for(moto), table, Duration::from_secs(7 * 86_400));
    let fake_tasks: HashMap<String, fake_captchaai::FakeTask> =
        p.fake.tasks().into_iter().map(|t| (t.id.to_string(), t)).collect();
    let (mut lost, mut stale, mut open, mut expired, mut max_reads) = (Vec::new(), 0usize, 0usize, 0usize, 0u32);
    let mut by_via: HashMap<&'static str, usize> = HashMap::new();
    let mut ages: HashMap<String, Vec<f64>> = HashMap::new();
    // Per route (/tasks, /in.php): tasks, of them answered queued, of them released from the
    // queue by the submitter (the store keeps `released_at`).
    let mut routes = [(0usize, 0usize, 0usize); 2];
    for o in owned {
        let task = store.tasks().get(&TaskRef::parse(&o.task_ref)?).await?.context("a task vanished")?;
        let route = &mut routes[usize::from(task.task_ref.compat_id().is_some())];
        route.0 += 1;
        route.1 += usize::from(o.queued);
        route.2 += usize::from(task.released_at.is_some());
        let ft = task.captcha_id.as_ref().and_then(|i| fake_tasks.get(&i.to_string()));
        if let Some(ft) = ft {
            max_reads = max_reads.max(ft.reads);
            if let Some(answer) = &ft.answer {
                let holds = match &task.state {
                    TaskState::Solved { solution, .. } => solution.expose() == answer,
                    TaskState::Failed { code, .. } => code.as_ref() == answer,
                    TaskState::Expired { late: Some(l), .. } => match &l.outcome {
                        Outcome::Solved(s) => s.expose() == answer,
                        Outcome::Failed(c) => c.as_ref() == answer,
                    },
                    _ => false,
                };
                if !holds {
                    lost.push(o.task_ref.clone());
                }
            }
        }
        match &task.state {
            TaskState::Solved { via, .. } | TaskState::Failed { via, .. } => {
                *by_via.entry(via.as_str()).or_default() += 1;
            }
            TaskState::Expired { .. } => expired += 1,
            _ => {}
        }
        if !task.state.is_final() {
            open += 1;
        }
        if let Some(url) = &o.callback {
            pushes += 1;
            let path = url.trim_start_matches(&p.receiver.base_url);
            let got: Vec<_> = hits.iter().filter(|h| h.path == path).collect();
            let ids: std::collections::BTreeSet<&str> = got.iter().map(|h| h.webhook_id.as_str()).collect();
            extra_ids += ids.len().saturating_sub(1);
            match task.delivery.as_ref().map(|d| d.status) {
                Some(DeliveryStatus::Delivered) if got.iter().any(|h| h.answered == 200) => pushed += 1,
                Some(DeliveryStatus::Gone) if path.starts_with("/gone/") => gone += 1,
                other => owed.push(format!("{} ({path}): {other:?}", o.task_ref)),
            }
        }
        // A task submitted through /in.php: res.php says what GET /tasks says (a token only
        // while fresh).
        if task.task_ref.compat_id().is_some() {
            compat_tasks += 1;
            let said = res_compat(p.emu, &o.task_ref, relay_key).await?;
            let now = SystemClock.now();
            let agrees = match &task.state {
                TaskState::Solved { solution, .. } => match task.solution_expires_at() {
                    Some(e) if now.plus(Duration::from_secs(2)) >= e => {
                        said == "ERROR_TOKEN_EXPIRED" || (now < e && said == format!("OK|{}", solution.expose()))
                    }
                    _ => said == format!("OK|{}", solution.expose()),
                },
                TaskState::Failed { code, .. } => said == code.as_ref(),
                TaskState::Expired { late: None, .. } => said == "ERROR_CAPTCHA_UNSOLVABLE",
                TaskState::Expired { late: Some(_), .. } => said.starts_with("OK|") || said.starts_with("ERROR_"),
                _ => false,
            };
            if !agrees {
                compat_disagree.push(format!("{}: {} vs {said}", o.task_ref, task.state.name()));
            }
        }
        if let (Some((at, token, via)), Some(ft)) = (&o.handed_out, ft) {
            let age = at.since(ft.solved_at);
            let lifetime = o.kind.token_lifetime();
            if Some(token) != ft.answer.as_ref() || lifetime.is_some_and(|l| age > l) {
                stale += 1;
            }
            if lifetime.is_some() {
                ages.entry(via.clone()).or_default().push(age.as_secs_f64());
            }
        }
    }
    let answers = verify_with_reference(p.webhook_secret, &hits)?;
    let verified = answers.iter().filter(|a| *a == "ok").count();
    let counts = p.fake.counts();
    let applied = p.flaky.applied_results();
    let double_applied = applied.values().filter(|n| **n > 1).count();
    // A second in.php for one task only when it was stranded (its outcome unknown) and overdue.
    let sends = relay_shared::testkit::sends(&store, fake_tasks.values().filter_map(|t| t.pingback.as_deref())).await?;
    let double_paid = sends.without_cause;
    let invs = invocations.lock().map(|i| i.clone()).unwrap_or_default();
    let queued: usize = routes.iter().map(|r| r.1).sum();
    let runs_by = |trigger: &str| sub.runs.iter().filter(|r| r.trigger == trigger).count();
    let failed_by = |trigger: &str| sub.runs.iter().filter(|r| r.trigger == trigger && r.report.is_err()).count();
    let run_sum =
        |field: &str| -> u64 { sub.runs.iter().filter_map(|r| r.report.as_ref().ok()?[field].as_u64()).sum() };
    let held_elsewhere =
        sub.runs.iter().filter(|r| r.report.as_ref().is_ok_and(|v| v["lease_held_elsewhere"] == true)).count();
    let (by_stream, by_schedule) = (runs_by("stream"), runs_by("schedule"));
    // Every in.php call either made a task (paid) or was refused explicitly (NO_SLOT: nothing
    // taken); during the injected ban, in.php calls are answered with the ban (nothing taken).
    let explained = counts.tasks_accepted + counts.no_slot;
    let in_php_ok = if cfg.ban {
        counts.in_php >= explained && counts.in_php - explained <= counts.requests_during_ban
    } else {
        counts.in_php == explained
    };
    let over_deadline = invs.iter().filter(|v| v["over_deadline"] == true).count();
    let left = p.dlq.depth().await? + p.poison.depth().await?;
    let bans_allowed = u64::from(cfg.ban);
    let age = |path: &str| {
        let v = ages.get(path).cloned().unwrap_or_default();
        format!("p50 {:>3.0} s  p95 {:>3.0} s  (n={})", percentile(&v, 50.0), percentile(&v, 95.0), v.len())
    };
    let rows: Vec<(&str, String)> = vec![
        ("tasks", owned.len().to_string()),
        (
            "of them through /in.php (res.php agrees)",
            format!("{compat_tasks} ({})", compat_tasks - compat_disagree.len()),
        ),
        (
            "by callback / poll / redrive",
            format!(
                "{} / {} / {}",
                by_via.get("callback").unwrap_or(&0),
                by_via.get("poll").unwrap_or(&0),
                by_via.get("redrive").unwrap_or(&0)
            ),
        ),
        ("expired (no result in time)", expired.to_string()),
        ("LOST", lost.len().to_string()),
        ("DOUBLE-APPLIED", double_applied.to_string()),
        ("result replaced by an earlier-received one", p.flaky.replaced_results().to_string()),
        ("SENT TWICE WITHOUT CAUSE", double_paid.to_string()),
        ("stranded and sent again (once)", sends.resent.to_string()),
        ("STALE HANDED OUT", stale.to_string()),
        (
            "in.php calls / accepted + NO_SLOT",
            format!("{} / {} + {}", counts.in_php, counts.tasks_accepted, counts.no_slot),
        ),
        (
            "queued at submit: /tasks, /in.php",
            format!("{} of {}, {} of {}", routes[0].1, routes[0].0, routes[1].1, routes[1].0),
        ),
        ("released from the queue", format!("{}", routes[0].2 + routes[1].2)),
        ("NO_SLOT answers (max in a minute)", format!("{} ({})", counts.no_slot, p.fake.max_no_slot_per_minute())),
        ("fake threads (peak in work)", format!("{} ({})", threads_text(cfg.threads), p.fake.peak_in_work())),
        (
            "submitter runs: schedule / stream",
            format!("{by_schedule} / {by_stream} (failed {} / {})", failed_by("schedule"), failed_by("stream")),
        ),
        (
            "submitter: sent / NO_SLOT / lease held",
            format!("{} / {} / {held_elsewhere}", run_sum("released"), run_sum("no_slot")),
        ),
        ("wake records dropped (too old)", sub.wakes_too_old.to_string()),
        ("res.php requests (max per task)", format!("{} ({max_reads})", counts.res_php)),
        (
            "bans (injected) / requests in it",
            format!("{} ({bans_allowed}) / {}", counts.bans, counts.requests_during_ban),
        ),
        ("token age at hand-out: callback", age("callback")),
        ("token age at hand-out: poll", age("poll")),
        ("token age at hand-out: redrive", age("redrive")),
        ("callbacks sent / dropped", format!("{} / {}", counts.callbacks_sent, counts.callbacks_dropped)),
        ("conflicting pingbacks sent", counts.conflicting_sent.to_string()),
        ("store / SQS faults injected", format!("{} / {}", p.flaky.calls_failed(), p.flaky_sqs.calls_failed())),
        ("dead letters drained / left", format!("{} / {left}", drained.load(std::sync::atomic::Ordering::SeqCst))),
        ("poisoned, listed and moved back", poisoned.to_string()),
        ("poller invocations (over deadline)", format!("{} ({over_deadline})", invs.len())),
        ("pushes: delivered / gone (410) / owed", format!("{pushed} / {gone} / {} of {pushes}", owed.len())),
        ("push requests / verified by standardwebhooks", format!("{} / {}", hits.len(), verified)),
        ("tasks pushed under > 1 webhook-id", extra_ids.to_string()),
        ("stream batches to the failures queue", stream_failed.to_string()),
        ("retry messages delivered (retry queue)", retries.to_string()),
        ("real time", format!("{:.0} s", t0.elapsed().as_secs_f64())),
    ];
    let mut table_text = format!(
        "e2e ({} tasks{}{}, seed {})\n",
        cfg.tasks,
        if cfg.chaos { ", chaos" } else { "" },
        if cfg.ban { ", ban" } else { "" },
        cfg.seed
    );
    for (k, v) in rows {
        table_text.push_str(&format!("| {k:<36} | {v:>40} |\n"));
    }
    let mut violations = Vec::new();
    let mut need = |ok: bool, what: String| {
        if !ok {
            violations.push(what);
        }
    };
    need(owned.len() == cfg.tasks, format!("{} of {} tasks submitted", owned.len(), cfg.tasks));
    need(lost.is_empty(), format!("lost = {} (e.g. {:?})", lost.len(), lost.iter().take(3).collect::<Vec<_>>()));
    need(double_applied == 0, format!("double-applied = {double_applied}"));
    need(double_paid == 0, format!("double-paid = {double_paid}"));
    need(
        compat_tasks > 0 && compat_disagree.is_empty(),
        format!("{compat_tasks} compat tasks, res.php disagrees: {compat_disagree:?}"),
    );
    need(
        counts.tasks_accepted == cfg.tasks as u64,
        format!("{} tasks accepted for {}", counts.tasks_accepted, cfg.tasks),
    );
    need(stale == 0, format!("stale handed out = {stale}"));
    need(
        in_php_ok,
        format!(
            "{} in.php calls for {} tasks accepted + {} NO_SLOT answers ({} requests during a ban)",
            counts.in_php, counts.tasks_accepted, counts.no_slot, counts.requests_during_ban
        ),
    );
    need(
        p.fake.max_no_slot_per_minute() <= 60,
        format!("{} NO_SLOT answers in a minute (at most 60)", p.fake.max_no_slot_per_minute()),
    );
    if cfg.threads > 0 {
        // A plan smaller than the burst: the queue must have been used, and woken by the stream.
        need(queued > 0, "no task was queued at submit".into());
        need(by_stream > 0, "the stream never invoked the submitter".into());
    }
    need(max_reads <= 20, format!("a task cost {max_reads} res.php reads"));
    need(counts.bans <= bans_allowed, format!("banned {} times ({bans_allowed} injected)", counts.bans));
    need(open == 0, format!("{open} tasks still open"));
    need(over_deadline == 0, format!("{over_deadline} poller invocations over their deadline"));
    need(left == 0, format!("{left} dead letters left"));
    need(
        pushes > 0 && owed.is_empty(),
        format!("{} of {pushes} pushes owed: {:?}", owed.len(), &owed[..owed.len().min(3)]),
    );
    need(extra_ids == 0, format!("{extra_ids} tasks pushed under more than one webhook-id"));
    need(verified == hits.len() && !hits.is_empty(), format!("{verified} of {} signatures verified", hits.len()));
    need(stream_failed == 0, format!("{stream_failed} stream batches failed"));
    // The 500-once receiver makes a retry of every such push: on a token's fast schedule it
    // must come back through the retry queue, not wait for the minute's sweep.
    need(retries > 0, "no retry came back through the retry queue".into());
    if !cfg.chaos {
        need(
            by_via.get("redrive").copied().unwrap_or(0) > 0,
            format!("no result recovered by the redrive: {by_via:?}"),
        );
    } else {
        need(p.flaky_sqs.calls_failed() > 0, "no SQS send met the SQS outages".into());
        need(p.flaky.calls_failed() > 0, "no store fault was injected".into());
    }
    ensure!(violations.is_empty(), "{table_text}violations: {violations:?}");
    let secrets = [p.fake.api_key(), API_KEY.to_owned(), "e2e-signing-secret".to_owned()]
        .into_iter()
        .chain(fake_tasks.values().filter_map(|t| t.answer.clone()).filter(|a| !a.starts_with("ERROR")))
        .collect();
    Ok(Report { table: table_text, secrets })
}

/// Waits until the fake has solved and delivered (or dropped) everything submitted so far.
async fn settle(fake: &FakeCaptchaAi) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        if fake.tasks().iter().all(fake_captchaai::FakeTask::settled) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Solved, and every planned pingback (late ones included) sent.
fn delivered(t: &fake_captchaai::FakeTask) -> bool {
    t.answer.is_some() && t.callback_statuses.len() >= usize::from(t.pingbacks_planned)
}
/// Drains the queue until a receive comes back empty; returns how many messages were handled.
async fn drain_all(emu: &Emulator, dlq: &SqsQueue, visibility: i32) -> anyhow::Result<usize> {
    let mut total = 0;
    loop {
        match drain_once(emu, dlq, visibility).await? {
            0 => return Ok(total),
            n => total += n,
        }
    }
}

/// The SQS event source: receive a batch, invoke redrive, delete all but the failures.
async fn drain_once(emu: &Emulator, dlq: &SqsQueue, visibility: i32) -> anyhow::Result<usize> {
    let got = dlq.receive(10, visibility, 0).await?;
    if got.is_empty() {
        return Ok(0);
    }
    let resp =
        emu.invoke("relay-redrive", &sqs_event("arn:aws:sqs:us-east-1:123456789012:DeadLetterQueue", &got)).await?;
    let failed: Vec<&str> = resp["batchItemFailures"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|f| f["itemIdentifier"].as_str())
        .collect();
    for m in &got {
        if !failed.contains(&m.message_id.as_str()) {
            dlq.delete(&m.receipt_handle).await?;
        }
    }
    Ok(got.len())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The template's two stream filters (delivery: a push due and not under a claim; the
    /// submitter: writes of the wake item).
    const DELIVERY: &str = r#"{"dynamodb": {"NewImage": {"dlv_shard": {"N": [{"exists": true}]}, "dlv_due": {"N": [{"exists": true}]}, "dlv_lease": {"S": [{"exists": false}]}}}}"#;
    const WAKE: &str = r#"{"dynamodb": {"Keys": {"pk": {"S": ["submitq#wake"]}}}}"#;

    fn record(pk: &str, image: Option<Value>) -> Value {
        let mut r = json!({ "eventName": "MODIFY", "dynamodb": { "Keys": { "pk": { "S": pk } } } });
        if let Some(i) = image {
            r["dynamodb"]["NewImage"] = i;
        }
        r
    }

    #[test]
    fn the_delivery_filter_passes_a_push_due_and_not_under_a_claim() -> anyhow::Result<()> {
        let p: Value = serde_json::from_str(DELIVERY)?;
        let due = json!({ "pk": { "S": "task#a" }, "dlv_shard": { "N": "3" }, "dlv_due": { "N": "17" } });
        assert!(passes_filter(&p, &record("task#a", Some(due.clone()))));
        let mut claimed = due.clone();
        claimed["dlv_lease"] = json!({ "S": "x" });
        assert!(!passes_filter(&p, &record("task#a", Some(claimed))));
        let mut not_due = due;
        not_due.as_object_mut().context("an object")?.remove("dlv_due");
        assert!(!passes_filter(&p, &record("task#a", Some(not_due))));
        // A removal carries no new image.
        assert!(!passes_filter(&p, &record("task#a", None)));
        Ok(())
    }

    #[test]
    fn the_wake_filter_passes_writes_of_the_wake_item_only() -> anyhow::Result<()> {
        let p: Value = serde_json::from_str(WAKE)?;
        let image = json!({ "pk": { "S": "submitq#wake" }, "wake_at": { "N": "1" } });
        assert!(passes_filter(&p, &record("submitq#wake", Some(image))));
        assert!(passes_filter(&p, &record("submitq#wake", None)));
        assert!(!passes_filter(&p, &record("submitq#wakes", None)));
        assert!(!passes_filter(&p, &record("task#a", Some(json!({ "pk": { "S": "submitq#wake" } })))));
        // A key of another type, or none.
        let mut n = record("x", None);
        n["dynamodb"]["Keys"]["pk"] = json!({ "N": "1" });
        assert!(!passes_filter(&p, &n));
        assert!(!passes_filter(&p, &json!({ "dynamodb": {} })));
        Ok(())
    }

    #[test]
    fn a_mapping_reads_its_own_event_from_the_template() -> anyhow::Result<()> {
        let template = json!({ "Resources": { "F": { "Properties": { "Events": {
            "Wake": { "Type": "DynamoDB", "Properties": {
                "BatchSize": 10, "MaximumRetryAttempts": 0, "MaximumRecordAgeInSeconds": 60,
                "FilterCriteria": { "Filters": [{ "Pattern": WAKE }] } } },
            "EveryMinute": { "Type": "ScheduleV2", "Properties": {} } } } } } });
        let c = StreamConsumer { function: "f", resource: "F", event: "Wake" };
        let m = Mapping::from_template(&template, &c)?;
        assert_eq!((m.batch_size, m.retries, m.max_age, m.patterns.len()), (10, 0, Some(60.0), 1));
        assert!(m.passes(&record("submitq#wake", None)));
        let schedule = StreamConsumer { function: "f", resource: "F", event: "EveryMinute" };
        assert!(Mapping::from_template(&template, &schedule).is_err());
        Ok(())
    }
}

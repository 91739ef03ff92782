//! Part 5: what a task costs on AWS, from counted operations, at published us-east-1 prices.
//!
//! The whole path runs in-process with the deployed handlers and settings (IAM auth, the
//! template's memory size): submit (`POST /tasks` with a `callback_url`, in.php on the fake), the
//! pingback, the push to the owner's endpoint (a receiver on loopback), the owner's read
//! (`GET /tasks/{ref}`), a duplicate pingback. A counting interceptor on the SDK client counts
//! every DynamoDB call per step, and the partition meter (`relay_sim::partitions`), a proxy in
//! front of the engine, counts the write and read units each call consumed — the table's and
//! every index's, from the items' images before and after — so no step's units are a model. The
//! bytes the functions log (JSON lines) and the EMF document each invocation flushes are counted
//! too. The fallback path's figures come
//! from part 4's stale-task run; the idle month from the template's resources and one idle poller
//! invocation.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_shared::domain::{CaptchaKind, TaskRef};
use relay_shared::http::Authorizer;
use relay_shared::store::TaskStore;
use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo, MemorySink, OperationCounter};
use relay_shared::time::{Clock, SystemClock};
use relay_sim::partitions::{MeterReport, PartitionMeter};
use secrecy::SecretString;

use crate::Opts;

/// Published us-east-1 list prices (USD), December 2026, before free tiers.
pub mod price {
    /// HTTP API, per request (first 300 million a month).
    pub const HTTP_API_REQUEST: f64 = 1.00 / 1e6;
    /// Lambda, per request.
    pub const LAMBDA_REQUEST: f64 = 0.20 / 1e6;
    /// Lambda on arm64, per GB-second.
    pub const LAMBDA_ARM_GB_S: f64 = 0.000_013_333_4;
    /// DynamoDB on-demand, per write request unit (1 KB) and read request unit (4 KB, strong).
    pub const DYNAMODB_WRU: f64 = 0.625 / 1e6;
    pub const DYNAMODB_RRU: f64 = 0.125 / 1e6;
    /// SQS standard, per request.
    pub const SQS_REQUEST: f64 = 0.40 / 1e6;
    /// EventBridge Scheduler, per invocation.
    pub const SCHEDULER_INVOCATION: f64 = 1.00 / 1e6;
    /// CloudWatch Logs ingestion, per byte (0.50 per GB).
    pub const LOG_BYTE: f64 = 0.50 / 1_073_741_824.0;
    /// CloudWatch: standard alarm per metric and month, dashboard per month, custom metric per month.
    pub const ALARM_METRIC_MONTH: f64 = 0.10;
    pub const DASHBOARD_MONTH: f64 = 3.00;
    pub const CUSTOM_METRIC_MONTH: f64 = 0.30;
    /// KMS customer-managed key per month.
    pub const KMS_KEY_MONTH: f64 = 1.00;
}

/// Assumed AWS-side latencies billed while a function waits (not measurable on loopback).
const DYNAMODB_CALL_MS: f64 = 5.0;
const IN_PHP_MS: f64 = 300.0;
/// Lambda's START/END/REPORT lines per invocation, bytes.
const PLATFORM_LOG_BYTES: u64 = 330;

/// One step of the path, measured over `n` calls.
#[derive(Debug, Default, Clone)]
struct Step {
    name: &'static str,
    n: u64,
    ops: HashMap<String, u64>,
    /// In-process time, summed (ms).
    cpu_ms: f64,
    log_bytes: u64,
    emf_bytes: u64,
    in_php: u64,
    /// Write and read units consumed, counted by the partition meter (index writes included).
    wcu: f64,
    rcu: f64,
    /// Of `wcu`, the indexes'.
    index_wcu: f64,
}

impl Step {
    fn per(&self, op: &str) -> f64 {
        self.ops.get(op).copied().unwrap_or(0) as f64 / self.n.max(1) as f64
    }

    fn calls(&self) -> f64 {
        self.ops.values().sum::<u64>() as f64 / self.n.max(1) as f64
    }

    /// Billed ms per invocation: in-process time plus the assumed waits, rounded up.
    fn billed_ms(&self) -> f64 {
        let per = self.cpu_ms / self.n.max(1) as f64;
        (per + self.calls() * DYNAMODB_CALL_MS + self.in_php as f64 / self.n.max(1) as f64 * IN_PHP_MS).ceil()
    }
}

/// Units the meter counted between `start` and `end` that no step holds (0 when the report
/// accounts for every one).
fn unaccounted(steps: &[Step], start: &MeterReport, end: &MeterReport) -> f64 {
    let (wcu, rcu): (f64, f64) = steps.iter().map(|s| (s.wcu, s.rcu)).fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1));
    (end.wcu - start.wcu - wcu) + (end.rcu - start.rcu - rcu)
}

fn item_kb(item: &HashMap<String, aws_sdk_dynamodb::types::AttributeValue>) -> f64 {
    use aws_sdk_dynamodb::types::AttributeValue as A;
    let bytes: usize = item
        .iter()
        .map(|(k, v)| {
            k.len()
                + match v {
                    A::S(s) => s.len(),
                    A::N(n) => n.len().div_ceil(2) + 1,
                    A::Bool(_) | A::Null(_) => 1,
                    _ => 16,
                }
        })
        .sum();
    bytes as f64 / 1024.0
}

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let n: usize = if opts.quick { 12 } else { 300 };
    let db = LocalDynamo::start().await?;
    // Every call of the path goes through the partition meter: what each consumed, counted.
    let meter = PartitionMeter::start(&db.endpoint, Arc::new(SystemClock)).await?;
    let (client, counter) = relay_shared::testkit::counting_client_for(&meter.endpoint);
    let table = format!("cost-{}", uuid::Uuid::new_v4().simple());
    relay_shared::store::schema::create_table(&client, &table).await?;
    let store = TaskStore::new(client.clone(), table.clone(), Duration::from_secs(7 * 86_400));
    let fake = fake_captchaai::FakeCaptchaAi::start(fake_captchaai::FakeConfig {
        solve_delay_ms: 0,
        drop_callbacks: 1.0,
        ..fake_captchaai::FakeConfig::default()
    })
    .await?;
    let captchaai = relay_shared::captchaai::CaptchaAiClient::new(
        &fake.base_url(),
        SecretString::from(fake.api_key()),
        Duration::from_secs(15),
        None,
    )?;
    let mut relay = relay_local::Relay::new(relay_local::LocalParts {
        store: store.clone(),
        captchaai,
        api_key: SecretString::from("unused-on-aws-0123456789".to_owned()),
        signing_secret: SecretString::from("bench-signing-secret-0123456789".to_owned()),
        callback_base_url: "https://relay.example/".into(),
        clock: Arc::new(SystemClock),
        dead_letters: Arc::new(MemorySink::default()),
        // The owner's endpoint is a receiver on loopback.
        delivery_policy: relay_shared::webhook::UrlPolicy::AllowLoopback,
    });
    let receiver = relay_shared::testkit::receiver::Receiver::start(Arc::new(SystemClock)).await?;
    let deliverer = {
        use relay_shared::delivery::{Deliverer, DeliverySettings, KeySource};
        let (secret, _) = relay_shared::webhook::WebhookSecret::generate();
        let keys = KeySource::new(relay_shared::webhook::SigningKeys::new(secret, None), Some(store.clone()));
        let settings =
            DeliverySettings { policy: relay_shared::webhook::UrlPolicy::AllowLoopback, ..DeliverySettings::default() };
        Deliverer::new(store.clone(), keys, settings)?
    };
    // As deployed: IAM authorisation at the HTTP API, the template's per-kind grace.
    relay.api.auth = Authorizer::Iam;
    let deployed = relay_sim::Deployed::from_template()?;
    relay.api.callback_grace = deployed.grace.clone();
    // The template's queue settings, on a plan these submits never fill (its threads known):
    // each goes inline with a permit, the path a task takes while CaptchaAI has a free thread.
    // (A task that waits in the submit queue costs two more writes of the account's state item
    // and two of its own item: docs/submit-queue.md.)
    relay.api.queue = relay_shared::submit::QueueSettings {
        window: relay_shared::submit::window::WindowSettings { threads: Some(10_000), ..deployed.queue.window.clone() },
        ..deployed.queue.clone()
    };
    let emf = crate::telemetry::metrics();

    // Submits, paced under the account-wide in.php rate (14/s) so none is told to wait.
    let made: std::cell::RefCell<Vec<(TaskRef, String)>> = std::cell::RefCell::default();
    let meter_start = meter.report();
    let submit = measure("submit", &counter, &meter, &fake, n, |i| {
        let (relay, made, hook) = (&relay, &made, &receiver.base_url);
        async move {
            tokio::time::sleep(Duration::from_millis(80)).await;
            let mut body: serde_json::Value =
                serde_json::from_str(relay_shared::testkit::body_for(CaptchaKind::RecaptchaV2))?;
            body["callback_url"] = serde_json::json!(format!("{hook}/ok/{i}"));
            let t = Instant::now();
            let req = ApiGatewayEvent::new("POST", "/tasks")
                .iam_caller()
                .header("content-type", "application/json")
                .header("idempotency-key", &format!("cost-{i}"))
                .body(&body.to_string())
                .build();
            let resp = relay_api::respond(req, &relay.api).await;
            let took = t.elapsed();
            let v = json_body(&resp);
            anyhow::ensure!(resp.status() == 202, "submit answered {} {v}", resp.status());
            let r = TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())?;
            let id = v["captcha_id"].as_str().unwrap_or_default().to_owned();
            made.borrow_mut().push((r, id));
            Ok(took)
        }
    })
    .await?;
    let tasks = made.into_inner();
    let deliver = |name: &'static str, expect: &'static str| {
        let (relay, tasks, fake, counter, meter) = (&relay, &tasks, &fake, &counter, &meter);
        measure(name, counter, meter, fake, n, move |i| async move {
            let (r, id) = &tasks[i];
            anyhow::ensure!(fake.task(id).is_some(), "the fake has no task {id}");
            // A reCAPTCHA token's typical size, unique per task.
            let code: String = format!("03AGdBq2{id}").chars().cycle().take(600).collect();
            let path = format!("/callback/{}/{}", r.as_ref(), relay.callback.signer.sign(r));
            let req = ApiGatewayEvent::new("GET", &path).query(&format!("id={id}&code={code}")).build();
            let t = Instant::now();
            let resp = relay_callback::respond(req, &relay.callback).await;
            let took = t.elapsed();
            let v = json_body(&resp);
            anyhow::ensure!(resp.status() == 200 && v["outcome"] == expect, "callback answered {} {v}", resp.status());
            Ok(took)
        })
    };
    let callback = deliver("callback", "recorded").await?;
    // The push each recorded result made due: claimed, sent to the owner's endpoint, its outcome
    // recorded. On AWS the table's stream hands the delivery function each due push; here the
    // harness lists them from the index, uncounted (not the relay's work).
    meter.set_counting(false);
    let mut due_pushes = HashMap::new();
    let pushes = store.pushes();
    for shard in 0..store.shards().read() {
        let (page, _) = pushes.due_deliveries(shard, SystemClock.now(), 10_000, None).await?;
        due_pushes.extend(page.into_iter().map(|d| (d.task_ref.clone(), d)));
    }
    meter.set_counting(true);
    let push = measure("push", &counter, &meter, &fake, n, |i| {
        let (deliverer, tasks, due_pushes) = (&deliverer, &tasks, &due_pushes);
        async move {
            let due = due_pushes.get(&tasks[i].0).ok_or_else(|| anyhow::anyhow!("no push due for task {i}"))?;
            let t = Instant::now();
            let attempt = deliverer.deliver(due, &SystemClock).await?;
            let took = t.elapsed();
            anyhow::ensure!(
                matches!(attempt, relay_shared::delivery::Attempt::Delivered { .. }),
                "push answered {attempt:?}"
            );
            Ok(took)
        }
    })
    .await?;
    anyhow::ensure!(receiver.hits().len() >= n, "{} pushes reached the owner, {n} sent", receiver.hits().len());
    let read = measure("owner read", &counter, &meter, &fake, n, |i| {
        let (relay, tasks) = (&relay, &tasks);
        async move {
            let (r, _) = &tasks[i];
            let req = ApiGatewayEvent::new("GET", &format!("/tasks/{}", r.as_ref())).iam_caller().build();
            let t = Instant::now();
            let resp = relay_api::respond(req, &relay.api).await;
            let took = t.elapsed();
            let v = json_body(&resp);
            anyhow::ensure!(resp.status() == 200 && v["status"] == "solved", "read answered {} {v}", resp.status());
            Ok(took)
        }
    })
    .await?;
    let duplicate = deliver("duplicate", "duplicate").await?;
    let mut steps = vec![submit, callback, push, read, duplicate];
    // Every unit the meter counted over the path is in a step of the report.
    let missing = unaccounted(&steps, &meter_start, &meter.report());
    anyhow::ensure!(missing.abs() < 1e-6, "{missing} units the meter counted are in no step of the report");
    // The EMF documents: flushed after each step, shared out over its calls.
    for s in &mut steps {
        s.emf_bytes = s.emf_bytes.max(1);
    }
    let _ = emf;

    let solved = store.tasks().get(&tasks[0].0).await?.ok_or_else(|| anyhow::anyhow!("task vanished"))?;
    let raw = client
        .get_item()
        .table_name(&table)
        .key("pk", aws_sdk_dynamodb::types::AttributeValue::S(solved.task_ref.as_ref().to_owned()))
        .send()
        .await?;
    let kb = item_kb(raw.item().unwrap_or(&HashMap::new()));

    let stale = match crate::poller::STALE_RUN.get() {
        Some(run) => run.clone(),
        None => crate::poller::stale(if opts.quick { 40 } else { 1_000 }, false).await?,
    };
    let idle = idle_tick(&deployed).await?;
    let sweep = idle_sweep().await?;
    let submit = idle_submit(&deployed).await?;
    Ok(render(&steps, kb, &stale, &idle, &[&sweep, &submit]))
}

fn json_body(resp: &lambda_http::Response<lambda_http::Body>) -> serde_json::Value {
    match resp.body() {
        lambda_http::Body::Text(t) => serde_json::from_str(t).unwrap_or_default(),
        lambda_http::Body::Binary(b) => serde_json::from_slice(b).unwrap_or_default(),
        _ => serde_json::Value::Null,
    }
}

/// Runs `call(i)` for i in 0..n and counts what the step cost.
async fn measure<F, Fut>(
    name: &'static str,
    counter: &OperationCounter,
    meter: &PartitionMeter,
    fake: &fake_captchaai::FakeCaptchaAi,
    n: usize,
    mut call: F,
) -> anyhow::Result<Step>
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Duration>>,
{
    let before = counter.snapshot();
    let units_before = meter.report();
    let logs = crate::telemetry::log_bytes();
    let in_php = fake.counts().in_php;
    let mut cpu = Duration::ZERO;
    for i in 0..n {
        cpu += call(i).await?;
    }
    let after = counter.snapshot();
    let ops = after
        .iter()
        .map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0)))
        .filter(|(_, v)| *v > 0)
        .collect();
    let emf_bytes = crate::telemetry::flush_metrics();
    let units = meter.report();
    Ok(Step {
        wcu: units.wcu - units_before.wcu,
        rcu: units.rcu - units_before.rcu,
        index_wcu: units.index_wcu - units_before.index_wcu,
        name,
        n: n as u64,
        ops,
        cpu_ms: cpu.as_secs_f64() * 1e3,
        log_bytes: crate::telemetry::log_bytes() - logs,
        emf_bytes,
        in_php: fake.counts().in_php - in_php,
    })
}

/// One poller invocation with nothing due, as every scheduled minute of an idle stack runs it.
struct Idle {
    ops: HashMap<String, u64>,
    cpu_ms: f64,
    emf_metrics: usize,
}

async fn idle_tick(deployed: &relay_sim::Deployed) -> anyhow::Result<Idle> {
    let db = LocalDynamo::start().await?;
    let (client, counter) = db.counting_client();
    let table = format!("idle-{}", uuid::Uuid::new_v4().simple());
    relay_shared::store::schema::create_table(&client, &table).await?;
    let fake = fake_captchaai::FakeCaptchaAi::start(fake_captchaai::FakeConfig::captchaai_like()).await?;
    let deps = relay_poller::Deps {
        store: relay_poller::Store::new(&TaskStore::new(client, table, Duration::from_secs(7 * 86_400))),
        captchaai: relay_shared::captchaai::CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            deployed.poller.read_timeout,
            None,
        )?,
        settings: deployed.poller.clone(),
        owner: "bench-idle".into(),
        dead_letters: Arc::new(MemorySink::default()),
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let _ = crate::telemetry::flush_metrics();
    // The table's creation went through the same client: count only the invocation's calls.
    let before = counter.snapshot();
    let t = Instant::now();
    let deadline = clock.now().plus(deployed.poller_timeout);
    let report = relay_poller::run_invocation(&deps, clock, deadline).await;
    let cpu_ms = t.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(report.res_php_requests == 0, "an idle tick read res.php");
    // What this invocation published: flushed as the runtime flushes after it.
    crate::telemetry::flush_metrics();
    let emf_metrics = crate::telemetry::metric_count();
    Ok(Idle { ops: calls_since(&before, &counter.snapshot()), cpu_ms, emf_metrics })
}

/// One delivery sweep with nothing due, as the schedule runs it every minute of an idle stack
/// (the code's delivery settings, which a test holds equal to the template's; the function's
/// 60 s timeout).
async fn idle_sweep() -> anyhow::Result<Idle> {
    use relay_shared::delivery::{Deliverer, DeliverySettings, KeySource};
    let db = LocalDynamo::start().await?;
    let (client, counter) = db.counting_client();
    let table = format!("idle-dlv-{}", uuid::Uuid::new_v4().simple());
    relay_shared::store::schema::create_table(&client, &table).await?;
    let store = TaskStore::new(client, table, Duration::from_secs(7 * 86_400));
    let (secret, _) = relay_shared::webhook::WebhookSecret::generate();
    let keys = KeySource::new(relay_shared::webhook::SigningKeys::new(secret, None), Some(store.clone()));
    let deliverer = Arc::new(Deliverer::new(store, keys, DeliverySettings::default())?);
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let _ = crate::telemetry::flush_metrics();
    let before = counter.snapshot();
    let t = Instant::now();
    let report = deliverer.sweep(clock.clone(), clock.now().plus(Duration::from_secs(60))).await;
    report.emit();
    let cpu_ms = t.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(report.delivered + report.retried + report.errors == 0, "an idle sweep did something: {report:?}");
    // What this invocation published: flushed as the runtime flushes after it.
    crate::telemetry::flush_metrics();
    let emf_metrics = crate::telemetry::metric_count();
    Ok(Idle { ops: calls_since(&before, &counter.snapshot()), cpu_ms, emf_metrics })
}

/// One submitter run with nothing queued, as its schedule starts one every minute of an idle
/// stack (the template's queue settings; the function's 90 s timeout).
async fn idle_submit(deployed: &relay_sim::Deployed) -> anyhow::Result<Idle> {
    let db = LocalDynamo::start().await?;
    let (client, counter) = db.counting_client();
    let table = format!("idle-sub-{}", uuid::Uuid::new_v4().simple());
    relay_shared::store::schema::create_table(&client, &table).await?;
    let fake = fake_captchaai::FakeCaptchaAi::start(fake_captchaai::FakeConfig::captchaai_like()).await?;
    let deps = relay_submitter::Deps {
        store: relay_submitter::Store::new(&TaskStore::new(client, table, Duration::from_secs(7 * 86_400))),
        captchaai: relay_shared::captchaai::CaptchaAiClient::new(
            &fake.base_url(),
            SecretString::from(fake.api_key()),
            Duration::from_secs(15),
            None,
        )?,
        dead_letters: Arc::new(MemorySink::default()),
        grace: deployed.grace.clone(),
        settings: relay_submitter::SubmitterSettings {
            queue: deployed.queue.clone(),
            ..relay_submitter::SubmitterSettings::default()
        },
        owner: "bench-idle".into(),
        waker: Arc::new(relay_shared::submit::NotifyWaker::default()),
    };
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let _ = crate::telemetry::flush_metrics();
    let before = counter.snapshot();
    let t = Instant::now();
    let report = relay_submitter::run(&deps, clock.clone(), clock.now().plus(Duration::from_secs(90)), None).await;
    let cpu_ms = t.elapsed().as_secs_f64() * 1e3;
    anyhow::ensure!(
        report.released + report.errors == 0 && fake.counts().in_php == 0,
        "an idle run did something: {report:?}"
    );
    // Its own metrics: this process's recorder re-sends every gauge the other parts set (the
    // simulations run a submitter too), so the run says whether it published its own.
    let emf_metrics = if report.metrics_published { relay_submitter::METRICS.len() } else { 0 };
    Ok(Idle { ops: calls_since(&before, &counter.snapshot()), cpu_ms, emf_metrics })
}

/// The calls made between two snapshots of a counter, by operation.
fn calls_since(before: &HashMap<String, u64>, after: &HashMap<String, u64>) -> HashMap<String, u64> {
    after.iter().map(|(op, n)| (op.clone(), n - before.get(op).copied().unwrap_or(0))).filter(|(_, n)| *n > 0).collect()
}

/// Counts in template.yaml: alarms (and the metrics each watches), dashboards, KMS keys.
fn template_counts() -> anyhow::Result<(usize, usize, usize, u64)> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../template.yaml"))?;
    let count = |ty: &str| text.matches(&format!("Type: {ty}\n")).count();
    let alarms = count("AWS::CloudWatch::Alarm");
    // A metric-math alarm is charged per metric it reads.
    let math_metrics = text.matches("MetricStat:").count();
    let plain = alarms.saturating_sub(text.matches("Metrics:\n").count());
    let memory: u64 = text
        .lines()
        .find_map(|l| l.trim().strip_prefix("MemorySize:").and_then(|v| v.trim().parse().ok()))
        .unwrap_or(128);
    Ok((plain + math_metrics, count("AWS::CloudWatch::Dashboard"), count("AWS::KMS::Key"), memory))
}

fn render(
    steps: &[Step],
    kb: f64,
    stale: &crate::poller::PollRun,
    idle: &Idle,
    [sweep, submit]: &[&Idle; 2],
) -> String {
    let (alarm_metrics, dashboards, keys, memory_mb) = template_counts().unwrap_or((0, 0, 0, 256));
    let gb = memory_mb as f64 / 1024.0;
    let mut s = format!(
        "## 5. Cost per million tasks (us-east-1 list prices, before free tiers)\n\n\
         Counted over an in-process run of the whole path with the deployed handlers and settings \
         (IAM auth, {memory_mb} MB arm64 functions): DynamoDB calls by an interceptor on the SDK \
         client, log bytes by the log writer, EMF bytes from the metrics recorder. Billed time per \
         invocation = measured in-process time + {DYNAMODB_CALL_MS} ms per DynamoDB call + \
         {IN_PHP_MS} ms per in.php call (assumed AWS-side waits), rounded up to 1 ms. Write and \
         read units as consumed, counted by the partition meter from the items' images (the \
         table's and every index's; a refused conditional write is charged). A solved task's \
         item is {kb:.2} KB (600-character token).\n\n\
         | step (per call) | DynamoDB calls | WRU (of which indexes) | RRU | billed ms | log + EMF bytes | $ per million |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let mut per_step = HashMap::new();
    for st in steps {
        let per = |u: f64| u / st.n.max(1) as f64;
        let (wru, rru, idx) = (per(st.wcu), per(st.rcu), per(st.index_wcu));
        let logs = (st.log_bytes + st.emf_bytes) as f64 / st.n.max(1) as f64 + PLATFORM_LOG_BYTES as f64;
        // A push is the delivery function's work, woken by the table's stream: no HTTP API request.
        let api = if st.name == "push" { 0.0 } else { price::HTTP_API_REQUEST };
        let cost = api
            + price::LAMBDA_REQUEST
            + st.billed_ms() / 1000.0 * gb * price::LAMBDA_ARM_GB_S
            + wru * price::DYNAMODB_WRU
            + rru * price::DYNAMODB_RRU
            + logs * price::LOG_BYTE;
        per_step.insert(st.name, cost);
        let calls: Vec<String> = {
            let mut v: Vec<_> = st.ops.keys().cloned().collect();
            v.sort();
            v.iter().map(|op| format!("{} {op}", fmt_n(st.per(op)))).collect()
        };
        s.push_str(&format!(
            "| {} | {} | {wru:.2} ({idx:.2}) | {rru:.2} | {:.0} | {logs:.0} | ${:.2} |\n",
            st.name,
            calls.join(", "),
            st.billed_ms(),
            cost * 1e6
        ));
    }
    let floor = price::HTTP_API_REQUEST
        + price::LAMBDA_REQUEST
        + price::DYNAMODB_WRU
        + 1.0 / 1000.0 * gb * price::LAMBDA_ARM_GB_S;
    let cb = per_step.get("callback").copied().unwrap_or(0.0);
    let sum = |names: &[&str]| names.iter().map(|k| per_step.get(k).copied().unwrap_or(0.0)).sum::<f64>();
    let pushed = sum(&["submit", "callback", "push"]);
    let task = sum(&["submit", "callback", "push", "owner read"]);
    let counted = |names: &[&str], f: fn(&Step) -> f64| {
        steps.iter().filter(|st| names.contains(&st.name)).map(|st| f(st) / st.n.max(1) as f64).sum::<f64>()
    };
    let path = ["submit", "callback", "push"];
    let (task_wcu, task_index_wcu) = (counted(&path, |st| st.wcu), counted(&path, |st| st.index_wcu));
    // The fallback path, per task recovered by the poller: its invocation time and DynamoDB
    // calls shared over the tasks (part 4's stale run), instead of the pingback.
    let reads = stale.res_php as f64 / stale.tasks.max(1) as f64;
    let ops = |op: &str| stale.ops.get(op).copied().unwrap_or(0) as f64 / stale.tasks.max(1) as f64;
    let poll_ms = stale.poller_ms as f64 / stale.tasks.max(1) as f64;
    let fallback = poll_ms / 1000.0 * gb * price::LAMBDA_ARM_GB_S
        + (ops("UpdateItem") * kb.ceil().max(1.0) + 1.0) * price::DYNAMODB_WRU
        + (ops("Query") + ops("GetItem")) * price::DYNAMODB_RRU;
    s.push_str(&format!(
        "\n| figure | $ per million | ratio to the floor | target |\n| --- | --- | --- | --- |\n\
         | floor: 1 HTTP API request + 1 Lambda invocation (1 ms) + 1 DynamoDB write | ${:.2} | 1.00× | |\n\
         | a pingback (the callback step) | ${:.2} | **{:.2}×** | ≤ 2.5× — {} |\n\
         | a task, callback path with its push (submit + pingback + push): {task_wcu:.2} WRU counted, \
         {task_index_wcu:.2} of them on indexes | ${:.2} | {:.2}× | |\n\
         | the same and the owner's read | ${:.2} | {:.2}× | |\n\
         | a task, fallback path (submit + poller recovery + push + owner's read; {reads:.2} res.php reads, \
         {:.1} Query, {:.1} UpdateItem, {poll_ms:.0} ms of poller time per task; the poller's units \
         from its calls, not metered) | ${:.2} | {:.2}× | |\n",
        floor * 1e6,
        cb * 1e6,
        cb / floor,
        if cb / floor <= 2.5 { "met" } else { "missed" },
        pushed * 1e6,
        pushed / floor,
        task * 1e6,
        task / floor,
        ops("Query"),
        ops("UpdateItem"),
        (task - cb + fallback) * 1e6,
        (task - cb + fallback) / floor,
    ));
    // An idle month: the schedule runs the poller every minute; the rest is fixed.
    let minutes = 43_200.0;
    let idle_calls = idle.ops.values().sum::<u64>() as f64;
    let idle_ms = (idle.cpu_ms + idle_calls * DYNAMODB_CALL_MS).ceil();
    let rru = |i: &Idle| {
        i.ops.get("Query").copied().unwrap_or(0) as f64 * 0.5 + i.ops.get("GetItem").copied().unwrap_or(0) as f64
    };
    let idle_rru = rru(idle);
    let sweep_calls = sweep.ops.values().sum::<u64>() as f64;
    let sweep_ms = (sweep.cpu_ms + sweep_calls * DYNAMODB_CALL_MS).ceil();
    let submit_calls = submit.ops.values().sum::<u64>() as f64;
    let submit_ms = (submit.cpu_ms + submit_calls * DYNAMODB_CALL_MS).ceil();
    let op = |i: &Idle, name: &str| i.ops.get(name).copied().unwrap_or(0) as f64;
    // The lease, its release and the reads (a Scan of the empty keys-only index is half a unit).
    let submit_store =
        op(submit, "UpdateItem") * price::DYNAMODB_WRU + (rru(submit) + op(submit, "Scan") * 0.5) * price::DYNAMODB_RRU;
    let lines = [
        ("scheduler invocations (1 a minute)", minutes * price::SCHEDULER_INVOCATION),
        (
            "poller invocations and their time",
            minutes * (price::LAMBDA_REQUEST + idle_ms / 1000.0 * gb * price::LAMBDA_ARM_GB_S),
        ),
        ("poller's DynamoDB reads", minutes * idle_rru * price::DYNAMODB_RRU),
        ("poller's logs", minutes * 600.0 * price::LOG_BYTE),
        (
            "delivery sweeps: scheduler, invocations and their time (1 a minute)",
            minutes
                * (price::SCHEDULER_INVOCATION
                    + price::LAMBDA_REQUEST
                    + sweep_ms / 1000.0 * gb * price::LAMBDA_ARM_GB_S),
        ),
        ("delivery sweeps' DynamoDB reads", minutes * rru(sweep) * price::DYNAMODB_RRU),
        ("delivery sweeps' logs", minutes * 600.0 * price::LOG_BYTE),
        ("custom metrics an idle delivery sweep publishes", sweep.emf_metrics as f64 * price::CUSTOM_METRIC_MONTH),
        (
            "submitter runs: scheduler, invocations and their time (1 a minute)",
            minutes
                * (price::SCHEDULER_INVOCATION
                    + price::LAMBDA_REQUEST
                    + submit_ms / 1000.0 * gb * price::LAMBDA_ARM_GB_S),
        ),
        ("submitter runs' DynamoDB reads and writes", minutes * submit_store),
        ("submitter runs' logs", minutes * 600.0 * price::LOG_BYTE),
        ("custom metrics an idle submitter run publishes", submit.emf_metrics as f64 * price::CUSTOM_METRIC_MONTH),
        ("redrive's SQS long polls (5 pollers, 20 s)", 5.0 * 3.0 * minutes * price::SQS_REQUEST),
        ("alarms", alarm_metrics as f64 * price::ALARM_METRIC_MONTH),
        ("dashboard", dashboards as f64 * price::DASHBOARD_MONTH),
        ("KMS key (alarm topic)", keys as f64 * price::KMS_KEY_MONTH),
        ("custom metrics the idle poller publishes", idle.emf_metrics as f64 * price::CUSTOM_METRIC_MONTH),
    ];
    let total: f64 = lines.iter().map(|(_, v)| v).sum();
    s.push_str(&format!(
        "\n**Idle stack, per month** (no traffic; one idle poller invocation measured: {} DynamoDB calls, \
         {idle_ms:.0} ms billed; one idle delivery sweep: {} DynamoDB calls, {sweep_ms:.0} ms billed; one idle \
         submitter run: {} DynamoDB calls, {submit_ms:.0} ms billed): **${total:.2}**\n\n\
         | item | $ per month |\n| --- | --- |\n",
        idle_calls, sweep_calls, submit_calls
    ));
    for (k, v) in lines {
        s.push_str(&format!("| {k} | {v:.2} |\n"));
    }
    s.push_str(
        "\nFree tiers (1 M Lambda requests and 400,000 GB-s, 14 M scheduler invocations, 1 M SQS \
         requests, 10 alarms, 3 dashboards, 10 custom metrics a month) cover most of the idle month.\n",
    );
    s
}

fn fmt_n(v: f64) -> String {
    if (v - v.round()).abs() < 0.005 { format!("{v:.0}") } else { format!("{v:.2}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_floor_is_one_request_one_invocation_one_write() {
        let floor = price::HTTP_API_REQUEST + price::LAMBDA_REQUEST + price::DYNAMODB_WRU;
        assert!((floor * 1e6 - 1.825).abs() < 1e-9);
    }

    #[test]
    fn units_the_meter_counted_outside_every_step_are_found() {
        let step = |wcu: f64, rcu: f64| Step { wcu, rcu, ..Step::default() };
        let at = |wcu: f64, rcu: f64| MeterReport { wcu, rcu, ..MeterReport::default() };
        let steps = [step(5.0, 0.0), step(2.0, 1.0)];
        assert_eq!(unaccounted(&steps, &at(10.0, 0.0), &at(17.0, 1.0)), 0.0);
        assert_eq!(unaccounted(&steps, &at(10.0, 0.0), &at(18.0, 1.0)), 1.0, "a write no step holds");
        assert_eq!(unaccounted(&steps, &at(10.0, 0.0), &at(17.0, 1.5)), 0.5, "a read no step holds");
    }
}

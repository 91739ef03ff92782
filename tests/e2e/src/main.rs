//! `relay-e2e`: the real Lambda binaries, run by cargo lambda's emulator (`cargo lambda watch`,
//! no Docker), against moto (DynamoDB and SQS) with the table and queues created from what
//! `template.yaml` declares, and the fake CaptchaAI delivering pingbacks over HTTP.
//!
//! This harness plays the parts AWS plays: the schedule (it invokes the poller), and the SQS
//! event source (receive → invoke the redrive function with a real SQS event → delete all but
//! the reported failures). Scenario: 200 tasks, 30 % of callbacks dropped, 10 % duplicated, a
//! burst of store failures. Pass: every task solved exactly once with the fake's solution, dead
//! letters drained, metrics emitted.
//!
//! Needs: `RELAY_TEST_SQS_ENDPOINT` (moto), `RELAY_TEMPLATE_JSON` (template.yaml as JSON),
//! `cargo lambda` on PATH. `infra/e2e.sh` provides all three.

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
use relay_shared::testkit::{FlakyDynamo, client_for, sqs_client_for, sqs_event};
use serde_json::{Value, json};

const TASKS: usize = 200;
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
/// policy points at it). Returns (dead-letter queue, poison queue).
async fn create_queues(
    template: &Value,
    client: &aws_sdk_sqs::Client,
    suffix: &str,
) -> anyhow::Result<(SqsQueue, SqsQueue)> {
    use aws_sdk_sqs::types::QueueAttributeName as A;
    let res = &template["Resources"];
    let mut urls = HashMap::new();
    let mut arns = HashMap::new();
    for name in ["PoisonQueue", "DeadLetterQueue"] {
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
    ))
}

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

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

async fn submit(emu: &Emulator, n: usize) -> anyhow::Result<String> {
    let body = match n % 3 {
        0 => r#"{"kind":"turnstile","sitekey":"0x4AAA","pageurl":"https://shop.example/login"}"#,
        1 => r#"{"kind":"recaptcha_v2","sitekey":"6Le","pageurl":"https://shop.example/login"}"#,
        _ => r#"{"kind":"image","body":"iVBORw0KGgo="}"#,
    };
    let resp = emu
        .http
        .post(emu.url("relay-api", "/tasks"))
        .bearer_auth(API_KEY)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await?;
    let status = resp.status();
    let v: Value = resp.json().await?;
    ensure!(status == 202, "submit {n} answered {status}: {v}");
    Ok(s(&v["task_ref"])?.to_owned())
}

/// Drains the queue until a receive comes back empty; returns how many messages were handled.
async fn drain_all(emu: &Emulator, dlq: &SqsQueue) -> anyhow::Result<usize> {
    let mut total = 0;
    loop {
        match drain_once(emu, dlq).await? {
            0 => return Ok(total),
            n => total += n,
        }
    }
}

/// The SQS event source: receive a batch, invoke redrive, delete all but the failures.
async fn drain_once(emu: &Emulator, dlq: &SqsQueue) -> anyhow::Result<usize> {
    let got = dlq.receive(10, 30, 0).await?;
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

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let started = Instant::now();
    let moto = std::env::var("RELAY_TEST_SQS_ENDPOINT").context("RELAY_TEST_SQS_ENDPOINT (moto) is not set")?;
    let template: Value = serde_json::from_str(&std::fs::read_to_string(
        std::env::var("RELAY_TEMPLATE_JSON").context("RELAY_TEMPLATE_JSON is not set")?,
    )?)?;
    let suffix = format!("{}", std::process::id());
    let table = format!("e2e-tasks-{suffix}");
    create_table(&template, &client_for(&moto), &table).await.context("creating the table from the template")?;
    let (dlq, poison) =
        create_queues(&template, &sqs_client_for(&moto), &suffix).await.context("creating the queues")?;
    let flaky = FlakyDynamo::start(&moto).await?;
    let fake = FakeCaptchaAi::start(FakeConfig {
        solve_delay_ms: 200,
        drop_callbacks: 0.3,
        duplicate_callbacks: 0.1,
        ..FakeConfig::default()
    })
    .await?;

    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let env = [
        ("TABLE_NAME", table.clone()),
        ("AWS_ENDPOINT_URL_DYNAMODB", flaky.endpoint.clone()),
        ("AWS_ENDPOINT_URL_SQS", moto.clone()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", "test".into()),
        ("AWS_SECRET_ACCESS_KEY", "test".into()),
        ("CAPTCHAAI_BASE_URL", fake.base_url()),
        ("CAPTCHAAI_API_KEY", fake.api_key()),
        ("CALLBACK_SIGNING_SECRET", "e2e-signing-secret".into()),
        ("RELAY_API_KEY", API_KEY.into()),
        ("AUTH_MODE", "api_key".into()),
        ("CALLBACK_BASE_URL", format!("{base}/lambda-url/relay-callback")),
        ("CALLBACK_GRACE_SECS", "5".into()),
        ("DEAD_LETTER_QUEUE_URL", dlq.url().to_owned()),
        ("POISON_QUEUE_URL", poison.url().to_owned()),
        ("RUST_LOG", "info".into()),
    ];
    let env_arg = env.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>();
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
    for _ in 0..600 {
        if emu.http.get(&base).send().await.is_ok() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let result = scenario(&emu, &fake, &flaky, &dlq, &poison).await;
    let _ = child.kill().await;
    let logs = std::fs::read_to_string(log_path).unwrap_or_default();
    let metric_docs = logs.lines().filter(|l| l.contains("\"_aws\"") && l.contains("CaptchaRelay")).count();
    match result {
        Ok(summary) => {
            ensure!(metric_docs > 0, "no EMF metric documents in {log_path}");
            let services: Vec<&str> = [
                "\"service\":\"api\"",
                "\"service\":\"callback\"",
                "\"service\":\"poller\"",
                "\"service\":\"redrive\"",
            ]
            .into_iter()
            .filter(|s| !logs.lines().any(|l| l.contains("\"_aws\"") && l.contains(s)))
            .collect();
            ensure!(services.is_empty(), "no metrics from {services:?}");
            // Exactly once: the conditional writes that succeeded, across all three paths.
            let count = |e: &str| logs.lines().filter(|l| l.contains(&format!("\"event\":\"{e}\""))).count();
            let writes = count("callback_recorded") + count("poll_recovered") + count("dead_letter_applied");
            ensure!(writes == TASKS, "{writes} result writes for {TASKS} tasks");
            println!("{summary}; {metric_docs} EMF documents; {:.1} s", started.elapsed().as_secs_f64());
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

async fn scenario(
    emu: &Emulator,
    fake: &FakeCaptchaAi,
    flaky: &FlakyDynamo,
    dlq: &SqsQueue,
    poison: &SqsQueue,
) -> anyhow::Result<String> {
    let mut refs = Vec::with_capacity(TASKS);
    for n in 0..TASKS {
        // A burst of store failures while a slice of the results comes in: only the writes of
        // results fail, so those callbacks are dead-lettered.
        if n == TASKS / 3 {
            settle(fake).await;
            flaky.set_failing_matching(Some(":solution"));
        }
        if n == TASKS / 2 {
            settle(fake).await;
            flaky.set_failing_matching(None);
        }
        refs.push(submit(emu, n).await?);
    }
    settle(fake).await;
    // The event source runs all the time: dead letters are drained at once.
    let mut drained = 0usize;
    drained += drain_all(emu, dlq).await?;
    // Past the (5 s) callback grace, the schedule fires and the event source drains.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let schedule: Value =
        serde_json::from_str(include_str!("../../../functions/poller/tests/fixtures/scheduler-event.json"))?;
    let mut recovered = 0u64;
    let deadline = Instant::now() + Duration::from_secs(180);
    let mut unsolved = refs.clone();
    while !unsolved.is_empty() {
        if Instant::now() > deadline {
            bail!("{} tasks never solved, e.g. {}", unsolved.len(), unsolved[0]);
        }
        let tick = emu.invoke("relay-poller", &schedule).await?;
        recovered += tick["recovered"].as_u64().unwrap_or(0);
        drained += drain_all(emu, dlq).await?;
        let mut still = Vec::new();
        for r in &unsolved {
            let v = emu.get_task(r).await?;
            if v["status"] != "solved" && v["status"] != "expired" {
                still.push(r.clone());
            }
        }
        unsolved = still;
        if !unsolved.is_empty() {
            tokio::time::sleep(Duration::from_secs(5)).await;
        }
    }
    // Every task: solved exactly once, with the solution the fake produced.
    let mut by_via: HashMap<String, usize> = HashMap::new();
    for r in &refs {
        let v = emu.get_task(r).await?;
        let id = s(&v["captcha_id"])?;
        let want = fake.task(id).and_then(|t| t.answer).context("the fake never solved it")?;
        ensure!(v["resolved_via"].is_string(), "{r}: {v}");
        if v["status"] == "solved" {
            ensure!(v["solution"].as_str() == Some(want.as_str()), "{r}: wrong solution");
        }
        *by_via.entry(s(&v["resolved_via"])?.to_owned()).or_default() += 1;
    }
    ensure!(dlq.depth().await? == 0, "dead letters left behind");
    ensure!(relay_ops_poison_empty(poison).await?, "messages in the poison queue");
    ensure!(drained > 0, "the burst of store failures produced no dead letters");
    ensure!(by_via.get("redrive").copied().unwrap_or(0) > 0, "no result was recovered by the redrive: {by_via:?}");
    let c = fake.counts();
    Ok(format!(
        "{TASKS} tasks solved once each (by path: {by_via:?}); callbacks sent {} dropped {}; poller recovered {recovered}; \
         {drained} dead letters drained; res.php requests {}",
        c.callbacks_sent, c.callbacks_dropped, c.res_php
    ))
}

/// Waits until the fake has solved and delivered (or dropped) everything submitted so far.
async fn settle(fake: &FakeCaptchaAi) {
    let deadline = Instant::now() + Duration::from_secs(60);
    while Instant::now() < deadline {
        let c = fake.counts();
        let dups = fake.tasks().iter().filter(|t| t.callback_statuses.len() > 1).count() as u64;
        if fake.tasks().iter().all(|t| t.answer.is_some())
            && c.callbacks_sent + c.callbacks_dropped >= c.tasks_accepted + dups
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn relay_ops_poison_empty(poison: &SqsQueue) -> anyhow::Result<bool> {
    Ok(poison.receive(10, 0, 0).await?.is_empty())
}

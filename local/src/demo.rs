//! `relay-local demo`: the three patterns doing their job. Submits N tasks to the built-in fake
//! with faults on — dropped, duplicated and late callbacks, and a burst of store failures —
//! then reports how every result arrived, and whether anything was lost. A quarter of the
//! tasks carry an owner's callback URL on a receiver the demo starts, which fails the way real
//! endpoints do (a 500, a 429 with `Retry-After`, a request left hanging past the push timeout,
//! one that never answers 2xx): the report says how each push arrived.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_captchaai::FakeConfig;
use indicatif::{ProgressBar, ProgressStyle};
use relay_shared::domain::{DeliveryStatus, TaskRef, TaskState, Via};
use relay_shared::local::receiver::{Hit, Receiver};

use crate::run::{LocalConfig, Options, start};

/// How the owner's receiver answers the pushes, by task (see
/// [`relay_shared::local::receiver`]): first try, a 500 then 200, a 429 with `Retry-After:
/// 2` then 200, a first request left hanging past the push timeout then 200. Each fails at most
/// once, so every push lands within the demo's run.
const PUSH_PATHS: [&str; 5] = ["ok", "once", "limited2", "ok", "slow"];

/// The one owner path that never answers 2xx: its push is parked after [`DEMO_PUSH_ATTEMPTS`].
const NEVER: &str = "never";

/// The demo's push settings: a 2 s timeout (a hanging owner is given up on quickly) and 2
/// attempts before a push is parked (at once and 5 s later; the template's 7 take 17 hours).
const DEMO_PUSH_TIMEOUT: Duration = Duration::from_secs(2);
const DEMO_PUSH_ATTEMPTS: u32 = 2;

/// The demo's outcome, checked against what the fake really solved.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DemoReport {
    pub tasks: usize,
    pub by_callback: usize,
    pub by_poll: usize,
    pub by_redrive: usize,
    /// Duplicate pingbacks the fake sent that changed nothing.
    pub duplicates_absorbed: u64,
    /// Late pingbacks that found the result already recorded.
    pub late_callbacks: usize,
    /// Pingbacks with a different answer than the recorded one: answered 200, first result kept.
    pub conflicts: usize,
    pub dead_lettered: usize,
    /// Store calls the fault injector failed during the burst.
    pub store_faults: u64,
    pub expired: usize,
    pub failed: usize,
    /// Tasks without the fake's solution at the end.
    pub lost: usize,
    pub elapsed: Duration,
    pub median_to_result: Duration,
    /// Tasks submitted with an owner callback URL.
    pub pushes: usize,
    /// Pushes the owner took (2xx) on the first request.
    pub pushed_first_try: usize,
    /// Pushes the owner took after one or more failed requests.
    pub pushed_after_retries: usize,
    /// Requests to the owner that failed (5xx, 429, no answer in time) and were tried again or
    /// parked.
    pub push_failures: usize,
    /// Pushes parked after every attempt failed (the owner path that never answers 2xx).
    pub parked: usize,
    /// Pushes whose signature the owner could not verify with the relay's webhook secret.
    pub bad_signatures: usize,
    /// Pushes that did not end as planned (delivered; parked for the failing path), with why.
    pub pushes_missed: Vec<String>,
}

impl DemoReport {
    pub fn table(&self) -> String {
        let rows = [
            ("tasks submitted", self.tasks.to_string()),
            ("delivered by callback", self.by_callback.to_string()),
            ("recovered by poll", self.by_poll.to_string()),
            ("recovered by redrive", self.by_redrive.to_string()),
            ("store faults injected", self.store_faults.to_string()),
            ("dead letters written", self.dead_lettered.to_string()),
            ("duplicates absorbed", self.duplicates_absorbed.to_string()),
            ("late callbacks absorbed", self.late_callbacks.to_string()),
            ("conflicts (first kept)", self.conflicts.to_string()),
            ("expired", self.expired.to_string()),
            ("failed", self.failed.to_string()),
            ("LOST", self.lost.to_string()),
            ("pushes to the owner", self.pushes.to_string()),
            ("  delivered, first try", self.pushed_first_try.to_string()),
            ("  delivered after retries", self.pushed_after_retries.to_string()),
            ("  failed requests", self.push_failures.to_string()),
            ("  parked (all tries failed)", self.parked.to_string()),
            ("  bad signatures", self.bad_signatures.to_string()),
            ("PUSHES MISSED", self.pushes_missed.len().to_string()),
            ("total time", format!("{:.1} s", self.elapsed.as_secs_f64())),
            ("median submit → result", format!("{:.2} s", self.median_to_result.as_secs_f64())),
        ];
        let line = "+-----------------------------+----------+";
        let mut out = format!("{line}\n");
        for (k, v) in rows {
            out.push_str(&format!("| {k:<27} | {v:>8} |\n"));
        }
        out.push_str(line);
        for why in &self.pushes_missed {
            out.push_str(&format!("\nmissed push: {why}"));
        }
        out
    }

    /// Nothing lost, every push as planned, every signature good.
    pub fn passed(&self) -> bool {
        self.lost == 0 && self.pushes_missed.is_empty() && self.bad_signatures == 0
    }
}

/// Runs the demo with `n` tasks in a fresh data dir; `progress` shows bars when true.
pub async fn run_demo(n: usize, data_dir: std::path::PathBuf, progress: bool) -> anyhow::Result<DemoReport> {
    let started = Instant::now();
    let cfg = LocalConfig {
        bind: "127.0.0.1:0".into(),
        data_dir,
        callback_grace_secs: Some(5),
        poll_interval_secs: 1,
        // The owner's receiver is on this machine.
        webhook_allow_loopback: true,
        ..LocalConfig::default()
    };
    let delivery = relay_shared::delivery::DeliverySettings {
        timeout: DEMO_PUSH_TIMEOUT,
        max_attempts: DEMO_PUSH_ATTEMPTS,
        ..crate::run::delivery_settings(&cfg)
    };
    let fake = FakeConfig {
        solve_delay_ms: 100,
        drop_callbacks: 0.3,
        duplicate_callbacks: 0.1,
        late_callbacks: 0.05,
        late_callback_ms: 8_000,
        ..FakeConfig::default()
    };
    let relay =
        start(&cfg, Options { fake: Some(fake), flaky_store: true, delivery: Some(delivery), ..Options::default() })
            .await?;
    let receiver = Receiver::start(Arc::new(relay_shared::time::SystemClock)).await?;
    let http = reqwest::Client::new();
    let bar = |len: usize, msg: &'static str| {
        let b = if progress { ProgressBar::new(len as u64) } else { ProgressBar::hidden() };
        b.set_style(
            ProgressStyle::with_template("{msg:>10} [{bar:40}] {pos}/{len}")
                .unwrap_or_else(|_| ProgressStyle::default_bar()),
        );
        b.set_message(msg);
        b
    };
    let kinds = [
        r#"{"kind":"turnstile","sitekey":"0x4AAA","pageurl":"https://shop.example/login"}"#,
        r#"{"kind":"image","body":"iVBORw0KGgo="}"#,
        r#"{"kind":"geetest","gt":"81388ea1fc187e0c335c0a8907ff2625","challenge":"2e2f0f65240058b683cb6ea21c303eea","pageurl":"https://shop.example/login"}"#,
    ];
    let flaky = relay.flaky.as_ref().context("demo runs with a fault injector")?;
    let submitting = bar(n, "submitted");
    let mut tasks: Vec<(TaskRef, Instant)> = Vec::with_capacity(n);
    // The tasks with an owner callback, and the receiver path each was given.
    let mut pushed: Vec<(TaskRef, String)> = Vec::new();
    for i in 0..n {
        // A burst of store failures on the writes of results for the middle fifth.
        if i == 2 * n / 5 {
            flaky.set_failing_matching(Some(":solution"));
        }
        if i == 3 * n / 5 {
            // Hold the outage until every result of the burst has come in (or been dropped).
            if let Some(fake) = &relay.fake {
                settle(fake).await;
            }
            flaky.set_failing_matching(None);
        }
        let path = push_path(i, kinds.len());
        let body = match &path {
            Some(path) => {
                let mut body: serde_json::Value = serde_json::from_str(kinds[i % kinds.len()])?;
                body["callback_url"] = serde_json::Value::String(format!("{}{path}", receiver.base_url));
                body.to_string()
            }
            None => kinds[i % kinds.len()].to_owned(),
        };
        let v = submit_politely(&http, &relay.base_url, &relay.api_key, &body, &format!("demo-{i}")).await?;
        let r = TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())
            .with_context(|| format!("submit answered {v}"))?;
        if let Some(path) = path {
            pushed.push((r.clone(), path));
        }
        tasks.push((r, Instant::now()));
        submitting.inc(1);
        // CaptchaAI bans more than 60 submits in 3 s (MAX_USER_TURN): keep them 80 ms apart (the relay paces 14 a second).
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    flaky.set_failing_matching(None);
    submitting.finish();

    let resolving = bar(n, "resolved");
    let mut resolved_at: HashMap<String, Duration> = HashMap::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while resolved_at.len() < n && Instant::now() < deadline {
        for (r, at) in &tasks {
            if resolved_at.contains_key(r.as_ref()) {
                continue;
            }
            if relay.store.tasks().get(r).await?.is_some_and(|t| t.state.is_final()) {
                resolved_at.insert(r.to_string(), at.elapsed());
                resolving.inc(1);
            }
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    resolving.finish();
    // Give late pingbacks their chance to arrive (and be absorbed), and the pushes theirs to
    // land or be parked (a retry after a failure comes 1 to 5 s later).
    let late_until = Instant::now() + Duration::from_millis(8_500);
    let pushes_until = Instant::now() + Duration::from_secs(60);
    loop {
        let mut open = 0;
        for (r, _) in &pushed {
            let status = relay.store.tasks().get(r).await?.and_then(|t| t.delivery).map(|d| d.status);
            open += usize::from(!matches!(
                status,
                Some(DeliveryStatus::Delivered | DeliveryStatus::Parked | DeliveryStatus::Gone)
            ));
        }
        if (open == 0 && Instant::now() >= late_until) || Instant::now() >= pushes_until {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    let fake = relay.fake.as_ref().context("demo runs on the built-in fake")?;
    // A few conflicting deliveries (another answer for a solved task), as a confused or
    // malicious sender would make: each is answered 200 and changes nothing.
    let mut conflicts = 0;
    for ft in fake.tasks().iter().filter(|t| t.pingback.is_some() && t.answer.is_some()).take((n / 40).max(1)) {
        let url = ft.pingback.clone().unwrap_or_default();
        let resp = http
            .get(&url)
            .query(&[("id", ft.id.to_string()), ("code", format!("conflicting-{}", ft.id))])
            .send()
            .await?;
        let outcome: serde_json::Value = resp.json().await.unwrap_or_default();
        if outcome["outcome"] == "conflict" {
            conflicts += 1;
        }
    }
    let mut report = DemoReport {
        tasks: n,
        dead_lettered: relay.queue.total_sent()? as usize,
        store_faults: flaky.calls_failed(),
        conflicts,
        ..DemoReport::default()
    };
    for (r, _) in &tasks {
        let task = relay.store.tasks().get(r).await?.context("task vanished")?;
        let want = task.captcha_id.as_ref().and_then(|id| fake.task(id.as_ref())).and_then(|t| t.answer);
        match &task.state {
            TaskState::Solved { solution, via, .. } if Some(solution.expose()) == want.as_deref() => match via {
                Via::Callback => report.by_callback += 1,
                Via::Poll => report.by_poll += 1,
                Via::Redrive => report.by_redrive += 1,
                _ => report.lost += 1,
            },
            TaskState::Expired { .. } => report.expired += 1,
            TaskState::Failed { .. } => report.failed += 1,
            _ => report.lost += 1,
        }
        if let Some(id) = &task.captcha_id
            && let Some(ft) = fake.task(id.as_ref())
        {
            report.duplicates_absorbed += ft.callback_statuses.len().saturating_sub(1) as u64;
            // A pingback that came after the poller had recorded the result.
            if !ft.callback_statuses.is_empty() && matches!(task.state, TaskState::Solved { via: Via::Poll, .. }) {
                report.late_callbacks += 1;
            }
        }
    }
    let (keys, _) = cfg.webhook_keys()?;
    check_pushes(&mut report, &relay.store, &pushed, &receiver.hits(), keys.current()).await?;
    let mut times: Vec<Duration> = resolved_at.into_values().collect();
    times.sort();
    report.median_to_result = times.get(times.len() / 2).copied().unwrap_or_default();
    report.elapsed = started.elapsed();
    relay.shutdown().await;
    Ok(report)
}

/// The receiver path task `i` pushes to, if it is one of the quarter submitted with a callback
/// URL: the first image task among them gets the path that never answers 2xx (an image answer
/// has no token lifetime, so its push is parked after the standard schedule's first two
/// attempts, while a token's would be retried fast for its whole life), the others fail at
/// most once.
fn push_path(i: usize, kinds: usize) -> Option<String> {
    if !i.is_multiple_of(4) {
        return None;
    }
    let first_image = (0..).step_by(4).find(|j| j % kinds == 1).unwrap_or(4);
    let pattern = if i == first_image { NEVER } else { PUSH_PATHS[(i / 4) % PUSH_PATHS.len()] };
    Some(format!("/{pattern}/{i}"))
}

/// Fills the report's push rows from what the owner's receiver got and what the store says,
/// checking every request's signature as the owner would.
async fn check_pushes(
    report: &mut DemoReport,
    store: &relay_shared::store::TaskStore,
    pushed: &[(TaskRef, String)],
    hits: &[Hit],
    secret: &relay_shared::webhook::WebhookSecret,
) -> anyhow::Result<()> {
    report.pushes = pushed.len();
    for h in hits {
        let ok = relay_shared::webhook::verify(
            secret,
            &h.webhook_id,
            &h.webhook_timestamp,
            &h.webhook_signature,
            &h.body,
            h.at.as_secs(),
        );
        report.bad_signatures += usize::from(ok.is_err());
    }
    for (r, path) in pushed {
        let got: Vec<&Hit> = hits.iter().filter(|h| &h.path == path).collect();
        let taken = got.iter().position(|h| (200..300).contains(&h.answered));
        report.push_failures += taken.unwrap_or(got.len());
        let status = store.tasks().get(r).await?.and_then(|t| t.delivery).map(|d| d.status);
        let never = path.starts_with(&format!("/{NEVER}/"));
        match (status, taken, never) {
            (Some(DeliveryStatus::Delivered), Some(0), false) => report.pushed_first_try += 1,
            (Some(DeliveryStatus::Delivered), Some(_), false) => report.pushed_after_retries += 1,
            (Some(DeliveryStatus::Parked), None, true) => report.parked += 1,
            _ => report.pushes_missed.push(format!("{r} ({path}): {status:?}, {} request(s)", got.len())),
        }
    }
    Ok(())
}

/// Waits until the fake has solved everything submitted so far and sent every pingback it
/// planned to send now (late ones are not waited for).
async fn settle(fake: &fake_captchaai::FakeCaptchaAi) {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until && !fake.tasks().iter().all(fake_captchaai::FakeTask::settled) {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Submits as a careful client does: with an idempotency key, and on a 503 that says retrying is
/// safe, again after its `Retry-After` with the same key (so a retry can never pay twice).
pub async fn submit_politely(
    http: &reqwest::Client,
    base: &str,
    api_key: &str,
    body: &str,
    idempotency_key: &str,
) -> anyhow::Result<serde_json::Value> {
    for _ in 0..10 {
        let resp = http
            .post(format!("{base}/tasks"))
            .bearer_auth(api_key)
            .header("content-type", "application/json")
            .header("idempotency-key", idempotency_key)
            .body(body.to_owned())
            .send()
            .await?;
        let status = resp.status().as_u16();
        let wait = resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse::<u64>().ok());
        let v: serde_json::Value = resp.json().await?;
        if matches!(status, 429 | 503) && v["error"]["retry_safe"] == true {
            tokio::time::sleep(Duration::from_secs(wait.unwrap_or(5).min(30))).await;
            continue;
        }
        return Ok(v);
    }
    anyhow::bail!("the relay kept answering 503")
}

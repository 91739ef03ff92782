//! Part 6: push delivery on the user's clock (issue 23). The `relay-local` binary as a user
//! runs it, the template's delivery defaults, a CaptchaAI fake solving each task in 0.5 s and
//! sending its pingback, and an owner receiver on loopback. N tasks, each with a
//! `callback_url`, are submitted through `POST /tasks` by 16 concurrent clients at 12 a second
//! in all — a steady load below the relay's in.php pace (14 a second), so no task waits in the
//! submit queue and the figures are the delivery path's (a burst above the pace or the plan waits
//! there: docs/submit-queue.md measures it); for each, the time from the submit's 202 to the
//! receiver's 2xx, and from the result's record (`resolved_at`) to the
//! receiver's 2xx, in real time. Two receivers: healthy (every answer at once), and one where
//! 20 % of the tasks' endpoints answer after 7 s (a slow answer must not hold up the others).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::domain::CaptchaKind;
use relay_shared::testkit::receiver::Receiver;
use relay_shared::time::{Clock, SystemClock, Timestamp};

use crate::Opts;

/// The clients' submits a second, in all: below the relay's in.php pace (14).
const SUBMITS_PER_SECOND: u64 = 12;
use crate::wrk::{Proc, free_port, random_secret};

/// One run's figures (milliseconds).
#[derive(Debug, Clone, Default)]
pub struct PushRun {
    pub name: &'static str,
    pub tasks: usize,
    pub delivered: usize,
    pub submit_to_2xx: Vec<u64>,
    pub record_to_2xx: Vec<u64>,
    /// The same, for the tasks whose endpoint answers at once (the slow run's other 80 %).
    pub fast_record_to_2xx: Vec<u64>,
    pub wall: Duration,
    /// Submits refused retry-safe (the relay's submit pace full) and tried again.
    pub refused: usize,
    /// From the first submit's answer to the last.
    pub submit_span: Duration,
}

fn pct(v: &[u64], p: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    s[((s.len() - 1) as f64 * p).round() as usize]
}

/// One run: `slow_every` = every n-th task's endpoint answers after 7 s (0: none).
pub async fn measure(opts: &Opts, name: &'static str, n: usize, slow_every: usize) -> anyhow::Result<PushRun> {
    let started = Instant::now();
    let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 500, ..FakeConfig::default() }).await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let receiver = Receiver::start(clock.clone()).await?;
    let cwd = std::env::current_dir()?;
    let bin = cwd.join(&opts.bin_dir).join("relay-local");
    anyhow::ensure!(bin.exists(), "no relay-local binary at {}: build it (infra/bench.sh does)", bin.display());
    let dir = cwd.join("target/bench-push").join(format!("{name}-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    let port = free_port()?;
    let key = random_secret();
    let mut cmd = tokio::process::Command::new(&bin);
    cmd.arg("serve")
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", dir.join("data"))
        .env("RELAY_API_KEY", &key)
        .env("CALLBACK_SIGNING_SECRET", random_secret())
        .env("CAPTCHAAI_API_KEY", fake.api_key())
        .env("CAPTCHAAI_BASE_URL", fake.base_url())
        .env("RELAY_PUBLIC_URL", format!("http://127.0.0.1:{port}"))
        .env("RELAY_WEBHOOK_ALLOW_LOOPBACK", "1")
        .env_remove("CALLBACK_GRACE_SECS")
        .env_remove("RUST_LOG");
    let mut proc = Proc::spawn("relay-local serve", cmd, dir.join("relay.log"))?;
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    proc.wait_ready(&http, &format!("{base}/health")).await?;

    // task_ref -> (path, submit answered at)
    let submitted: Arc<Mutex<BTreeMap<String, (String, Timestamp)>>> = Arc::default();
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    // The clients' common schedule: task i is submitted at start + i / 12 s.
    let (start, every) = (Instant::now(), Duration::from_millis(1000 / SUBMITS_PER_SECOND));
    let refused = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let (http, base, key, sub, next, rbase, clock, refused) = (
            http.clone(),
            base.clone(),
            key.clone(),
            submitted.clone(),
            next.clone(),
            receiver.base_url.clone(),
            clock.clone(),
            refused.clone(),
        );
        clients.spawn(async move {
            loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                if i >= n {
                    return Ok::<(), anyhow::Error>(());
                }
                tokio::time::sleep_until((start + every * u32::try_from(i)?).into()).await;
                let pattern = if slow_every > 0 && i % slow_every == 0 { "slow7" } else { "ok" };
                let path = format!("/{pattern}/{i}");
                let mut body: serde_json::Value =
                    serde_json::from_str(relay_shared::testkit::body_for(CaptchaKind::Turnstile))?;
                body["callback_url"] = serde_json::Value::String(format!("{rbase}{path}"));
                // A careful client: a retry-safe refusal (the relay's submit pace is full) is
                // tried again with the same idempotency key after a second.
                let v = loop {
                    let r = http
                        .post(format!("{base}/tasks"))
                        .bearer_auth(&key)
                        .header("idempotency-key", format!("push-bench-{i}"))
                        .json(&body)
                        .send()
                        .await?;
                    let status = r.status();
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    if status.as_u16() == 202 {
                        break v;
                    }
                    anyhow::ensure!(
                        v["error"]["retry_safe"] == true,
                        "POST /tasks answered {status}, not retry-safe: {v}"
                    );
                    refused.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_secs(1)).await;
                };
                let at = clock.now();
                let task_ref = v["task_ref"].as_str().unwrap_or_default().to_owned();
                sub.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.insert(task_ref, (path, at));
            }
        });
    }
    while let Some(r) = clients.join_next().await {
        r??;
    }
    // Every push answered 2xx, or a minute without progress.
    let mut last = (0, Instant::now());
    loop {
        let ok = receiver.hits().iter().filter(|h| (200..300).contains(&h.answered)).count();
        if ok >= n {
            break;
        }
        if ok != last.0 {
            last = (ok, Instant::now());
        } else if last.1.elapsed() > Duration::from_secs(60) {
            anyhow::bail!("{ok} of {n} pushes answered 2xx, none more for 60 s; relay log: {}", proc.log_tail());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let submitted = submitted.lock().map_err(|_| anyhow::anyhow!("poisoned"))?.clone();
    let by_path: BTreeMap<&str, (&str, Timestamp)> =
        submitted.iter().map(|(r, (p, at))| (p.as_str(), (r.as_str(), *at))).collect();
    let mut run = PushRun { name, tasks: n, ..PushRun::default() };
    run.refused = refused.load(std::sync::atomic::Ordering::SeqCst);
    let (first, last) =
        submitted.values().fold((u64::MAX, 0), |(a, b), (_, t)| (a.min(t.as_millis()), b.max(t.as_millis())));
    run.submit_span = Duration::from_millis(last.saturating_sub(first));
    let mut seen = std::collections::BTreeSet::new();
    for h in receiver.hits() {
        if !(200..300).contains(&h.answered) || !seen.insert(h.path.clone()) {
            continue;
        }
        let Some((_, at)) = by_path.get(h.path.as_str()) else { continue };
        let v: serde_json::Value = serde_json::from_slice(&h.body)?;
        let resolved = v["data"]["resolved_at"]
            .as_str()
            .and_then(Timestamp::parse_rfc3339)
            .ok_or_else(|| anyhow::anyhow!("a push without data.resolved_at: {v}"))?;
        run.delivered += 1;
        run.submit_to_2xx.push(h.answered_at.as_millis().saturating_sub(at.as_millis()));
        let rec = h.answered_at.as_millis().saturating_sub(resolved.as_millis());
        run.record_to_2xx.push(rec);
        if h.path.starts_with("/ok/") {
            run.fast_record_to_2xx.push(rec);
        }
    }
    anyhow::ensure!(run.delivered == n, "{} of {n} tasks pushed", run.delivered);
    drop(proc);
    let _ = std::fs::remove_dir_all(&dir);
    run.wall = started.elapsed();
    Ok(run)
}

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let n = if opts.quick { 40 } else { 200 };
    let healthy = measure(opts, "healthy", n, 0).await?;
    let slow = measure(opts, "20 % slow", n, 5).await?;
    Ok(render(&[healthy, slow], opts.quick))
}

fn secs(ms: u64) -> String {
    format!("{:.2} s", ms as f64 / 1000.0)
}

pub fn render(runs: &[PushRun], quick: bool) -> String {
    let mut s = String::from(
        "## 6. Push delivery: from the solve to the token in the owner's hands\n\n\
         Push delivery on the user's clock: the `relay-local` binary with the template's delivery \
         defaults (64 in flight and 50 a second per host, adaptive from 8), a fake CaptchaAI solving \
         each task in 0.5 s, an owner receiver on loopback; tasks submitted through `POST /tasks` by \
         16 concurrent clients at 12 a second in all (below the relay's in.php pace of 14: none waits \
         in the submit queue, see docs/submit-queue.md for bursts), all to one host. Real time. *submit* = the 202 of `POST /tasks`, \
         *record* = the result's `resolved_at`, *2xx* = the receiver's answer.\n\n\
         | receiver | tasks (submitted over) | delivered | submit → 2xx p50 / p90 / max | record → 2xx p50 / p90 / max | record → 2xx, endpoints answering at once: p50 / p90 | submits refused (retry-safe, tried again) |\n\
         | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in runs {
        s.push_str(&format!(
            "| {} | {} ({:.1} s) | {} | {} / {} / {} | {} / {} / {} | {} / {} | {} |\n",
            r.name,
            r.tasks,
            r.submit_span.as_secs_f64(),
            r.delivered,
            secs(pct(&r.submit_to_2xx, 0.5)),
            secs(pct(&r.submit_to_2xx, 0.9)),
            secs(pct(&r.submit_to_2xx, 1.0)),
            secs(pct(&r.record_to_2xx, 0.5)),
            secs(pct(&r.record_to_2xx, 0.9)),
            secs(pct(&r.record_to_2xx, 1.0)),
            secs(pct(&r.fast_record_to_2xx, 0.5)),
            secs(pct(&r.fast_record_to_2xx, 0.9)),
            r.refused,
        ));
    }
    if quick {
        s.push_str("\n(--quick: 40 tasks, a debug build; the figures check the part works, not timings.)\n");
    } else {
        s.push_str("\nTargets (issue 23): healthy receiver, submit → 2xx p50 ≤ 1.5 s and record → 2xx p50 ≤ 0.5 s.\n");
    }
    s
}

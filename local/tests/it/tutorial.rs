//! The tutorial this product grew from (../shared/seed/), run as its users run it: its Pattern 1
//! Flask app and its Pattern 3 idempotent handler, each as printed with only the host and the key
//! changed (tests/compat/tutorial_pattern{1,3}.py), pointed at `relay-local serve` over HTTPS.
//! CaptchaAI is the fake at its worst — its real solve times, 30 % of pingbacks dropped, bans
//! enforced — and the relay is killed with SIGKILL once while the tasks are being solved, then
//! started again on the same data. Each app must get every one of its results through its own
//! callback route (CaptchaAI's `GET /callback?id=…&code=…`, pushed by the relay), each the fake's
//! answer, each while its token lives; its own fallback poller must find nothing left to recover.
//! The relay runs with local mode's defaults (poller every 10 s, per-kind callback grace); the
//! apps with theirs (callback timeout 120 s, a poll every 30 s).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_shared::domain::{TaskRef, TaskState};
use serde_json::Value;

use crate::common;
use common::{Relay, free_port, spawn_relay, tmp_dir, wait_healthy};

const KEY: &str = "tutorial-relay-key-0123456789";
/// Tasks each app submits (the run: 20).
const TASKS: usize = 20;
/// A reCAPTCHA token's life from its solve.
const TOKEN_LIFE: Duration = Duration::from_secs(120);

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn relay(port: u16, tls_port: u16, data: &Path, fake: &FakeCaptchaAi) -> Relay {
    spawn_relay(
        port,
        data,
        fake,
        KEY,
        &[
            ("RELAY_TLS_BIND", &format!("127.0.0.1:{tls_port}")),
            // The apps listen on loopback, over plain http.
            ("RELAY_WEBHOOK_ALLOW_LOOPBACK", "1"),
            // Local mode's defaults, as a user runs it.
            ("CALLBACK_GRACE_SECS", ""),
            ("POLL_INTERVAL_SECS", ""),
        ],
    )
}

/// Runs one app to its end and reads the JSON object its driver prints last.
async fn app(script: &str, app_port: u16, env: &[(&str, String)]) -> anyhow::Result<Value> {
    let python = root().join(".venv/bin/python");
    let mut cmd = tokio::process::Command::new(&python);
    cmd.arg(root().join("tests/compat").join(script))
        .current_dir(root().join("tests/compat"))
        .env("TUTORIAL_PORT", app_port.to_string())
        .env("TUTORIAL_TASKS", TASKS.to_string())
        .env("TUTORIAL_WAIT_SECS", "300")
        .kill_on_drop(true)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = tokio::time::timeout(Duration::from_secs(420), cmd.spawn()?.wait_with_output())
        .await
        .with_context(|| format!("{script} did not finish"))??;
    let stdout = String::from_utf8_lossy(&out.stdout);
    ensure!(out.status.success(), "{script} failed:\n{stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    let last = stdout.lines().rev().find(|l| !l.trim().is_empty()).unwrap_or_default();
    let mut v: Value = serde_json::from_str(last).with_context(|| format!("{script} printed no JSON: {stdout}"))?;
    v["printed"] = Value::String(stdout.lines().filter(|l| *l != last).collect::<Vec<_>>().join("\n"));
    Ok(v)
}

/// What one app got, checked against the fake and the relay's store.
struct Landed {
    results: usize,
    by_callback: usize,
    by_own_poll: usize,
    /// Per result: the token's life left when it reached the app, ms.
    life_left_ms: Vec<u64>,
    /// The relay's own record of how each result came: (callback, poll, other).
    relay_via: (usize, usize, usize),
    callback_requests: String,
}

async fn check(name: &str, v: &Value, fake: &FakeCaptchaAi, data: &Path) -> anyhow::Result<Landed> {
    let submitted: Vec<String> =
        v["submitted"].as_array().context("submitted")?.iter().filter_map(|s| s.as_str().map(str::to_owned)).collect();
    ensure!(submitted.len() == TASKS, "{name}: {} of {TASKS} submits got an id: {v}", submitted.len());
    let store = relay_local::run::running_store(data).await?;
    let printed = v["printed"].as_str().unwrap_or_default();
    let mut l = Landed {
        results: 0,
        by_callback: 0,
        by_own_poll: 0,
        life_left_ms: Vec::new(),
        relay_via: (0, 0, 0),
        callback_requests: v["callback_requests"].to_string(),
    };
    for id in &submitted {
        let task =
            store.tasks().get(&TaskRef::from_compat_id(id)?).await?.with_context(|| format!("{name}: no task {id}"))?;
        let captcha_id = task.captcha_id.clone().with_context(|| format!("{name}: {id} has no CaptchaAI id"))?;
        let at_fake =
            fake.task(captcha_id.as_ref()).with_context(|| format!("{name}: the fake has no {captcha_id}"))?;
        let want = at_fake.answer.clone().with_context(|| format!("{name}: the fake has not solved {captcha_id}"))?;
        let got = v["results"][id].as_str().with_context(|| format!("{name}: no result for {id}: {v}"))?;
        ensure!(got == want, "{name}: {id} got another answer than the fake produced");
        let landed_ms = (v["landed_at"][id].as_f64().context("landed_at")? * 1000.0) as u64;
        let dies = at_fake.solved_at.as_millis() + TOKEN_LIFE.as_millis() as u64;
        ensure!(landed_ms < dies, "{name}: {id} reached the app {} ms after its token died", landed_ms - dies);
        l.life_left_ms.push(dies - landed_ms);
        l.results += 1;
        if printed.contains(&format!("Fallback poll recovered: {id}")) {
            l.by_own_poll += 1;
        } else {
            l.by_callback += 1;
        }
        match &task.state {
            TaskState::Solved { via, .. } => match via.as_str() {
                "callback" => l.relay_via.0 += 1,
                "poll" => l.relay_via.1 += 1,
                _ => l.relay_via.2 += 1,
            },
            other => anyhow::bail!("{name}: {id} is {} at the relay", other.name()),
        }
    }
    ensure!(v["pending"].as_array().is_some_and(Vec::is_empty), "{name}: tasks left pending: {v}");
    ensure!(!printed.contains("Task failed"), "{name}: its poller dropped a task: {printed}");
    Ok(l)
}

fn p50_min(v: &mut [u64]) -> (f64, f64) {
    v.sort_unstable();
    let p50 = v.get(v.len().saturating_sub(1) / 2).copied().unwrap_or(0);
    (p50 as f64 / 1000.0, v.first().copied().unwrap_or(0) as f64 / 1000.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tutorials_apps_as_printed_get_every_result_through_their_callback_alive_through_a_sigkill()
-> anyhow::Result<()> {
    let tools = tokio::process::Command::new("bash").arg(root().join("infra/tools.sh")).arg("sdk").status().await?;
    ensure!(tools.success(), "infra/tools.sh sdk failed");
    let fake =
        FakeCaptchaAi::start(FakeConfig { drop_callbacks: 0.3, seed: 36, ..FakeConfig::captchaai_like() }).await?;
    let (port, tls_port, data) = (free_port(), free_port(), tmp_dir());
    let http = reqwest::Client::new();
    let running = Arc::new(Mutex::new(Some(relay(port, tls_port, &data, &fake))));
    wait_healthy(&http, port).await?;
    let ca = data.join("tls/ca.pem").display().to_string();
    let env = vec![
        ("RELAY_SERVER", format!("127.0.0.1:{tls_port}")),
        ("CAPTCHAAI_API_KEY", KEY.to_owned()),
        ("REQUESTS_CA_BUNDLE", ca),
    ];
    let started = Instant::now();
    // SIGKILL once both apps' tasks are all with CaptchaAI and the first are solved: pingbacks,
    // polls and pushes in flight. Started again 2 s later on the same data and ports.
    let killer = {
        let (running, data, fake) = (running.clone(), data.clone(), &fake);
        async move {
            while fake.counts().tasks_accepted < (2 * TASKS) as u64 {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            tokio::time::sleep(Duration::from_secs(20)).await;
            let solved = fake.tasks().iter().filter(|t| t.answer.is_some()).count();
            if let Some(mut r) = running.lock().ok().and_then(|mut g| g.take()) {
                let _ = r.0.kill();
                let _ = r.0.wait();
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            if let Ok(mut g) = running.lock() {
                *g = Some(relay(port, tls_port, &data, fake));
            }
            solved
        }
    };
    let (one, three, solved_at_kill) = tokio::join!(
        app("tutorial_pattern1.py", free_port(), &env),
        app("tutorial_pattern3.py", free_port(), &env),
        killer
    );
    let (one, three) = (one?, three?);
    let wall = started.elapsed().as_secs();
    let counts = fake.counts();
    let mut rows = BTreeMap::new();
    for (name, v) in [("Pattern 1 app", &one), ("Pattern 3 handler", &three)] {
        rows.insert(name, check(name, v, &fake, &data).await?);
    }
    println!(
        "| tutorial app (as printed; host and key changed) | results / of them through its callback / its own poll | relay recorded by pingback / by its poll | token life left at the app p50 / min (s) | its callback route's requests |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for (name, l) in &mut rows {
        let (p50, min) = p50_min(&mut l.life_left_ms);
        println!(
            "| {name} | {} of {TASKS} / {} / {} | {} / {} | {p50:.0} / {min:.0} | {} |",
            l.results, l.by_callback, l.by_own_poll, l.relay_via.0, l.relay_via.1, l.callback_requests
        );
    }
    println!(
        "| pingbacks dropped by the fake / sent | {} / {} | tasks solved at the SIGKILL | {solved_at_kill} of {} | wall time | {wall} s |",
        counts.callbacks_dropped,
        counts.callbacks_sent,
        2 * TASKS
    );
    ensure!(counts.callbacks_dropped > 0, "no pingback was dropped: the relay's poller was not needed");
    ensure!(counts.tasks_accepted == (2 * TASKS) as u64, "paid once each: {} in.php tasks", counts.tasks_accepted);
    for (name, l) in &rows {
        ensure!(l.by_callback == TASKS, "{name}: {} of {TASKS} through its callback", l.by_callback);
        ensure!(l.by_own_poll == 0, "{name}: its own poller had to recover {}", l.by_own_poll);
    }
    drop(running);
    let _ = std::fs::remove_dir_all(&data);
    Ok(())
}

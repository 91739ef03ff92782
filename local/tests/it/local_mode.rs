//! Local mode as a user runs it: the demo scenario, the binary killed with SIGKILL mid-run and
//! restarted on the same data, and bad configuration.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fake_captchaai::{FakeCaptchaAi, FakeConfig};

use crate::common;
use common::{Relay, free_port, tmp_dir, wait_healthy};

const KILL_KEY: &str = "kill-test-key-0123456789";

fn spawn_relay(port: u16, data: &std::path::Path, fake: &FakeCaptchaAi) -> common::Relay {
    common::spawn_relay(port, data, fake, KILL_KEY, &[])
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_loses_nothing_and_its_table_matches_the_fake() -> anyhow::Result<()> {
    let report = relay_local::demo::run_demo(45, tmp_dir(), false).await?;
    assert_eq!(report.lost, 0, "{}", report.table());
    assert_eq!(report.by_callback + report.by_poll + report.by_redrive, 45, "{}", report.table());
    assert!(report.by_poll > 0 && report.by_redrive > 0, "all three paths at work:\n{}", report.table());
    assert!(report.dead_lettered >= report.by_redrive, "{}", report.table());
    assert_eq!(report.conflicts, 1, "the conflicting pingback was answered as a conflict:\n{}", report.table());
    // Pushes to the owner's receiver the demo starts: 12 of the 45 tasks, each ending as planned
    // (delivered, or parked on the path that never answers 2xx), signed with the relay's secret.
    let t = report.table();
    assert_eq!(report.pushes, 12, "{t}");
    assert!(report.pushes_missed.is_empty(), "{t}");
    assert_eq!(report.parked, 1, "the owner path that never answers 2xx is parked:\n{t}");
    assert_eq!(report.pushed_first_try + report.pushed_after_retries + report.parked, 12, "{t}");
    assert!(report.pushed_first_try > 0 && report.pushed_after_retries >= 5, "a 500, 429 and hang retried:\n{t}");
    assert!(report.push_failures >= report.pushed_after_retries + 2, "{t}");
    assert_eq!(report.bad_signatures, 0, "{t}");
    for row in ["pushes to the owner", "delivered after retries", "parked (all tries failed)", "PUSHES MISSED"] {
        assert!(t.contains(row), "the table shows `{row}`:\n{t}");
    }
    assert!(report.passed(), "{t}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread")]
async fn sigkill_mid_run_then_restart_on_the_same_data_completes_every_task_once() -> anyhow::Result<()> {
    // The fake lives in this test process, so it outlives the relay it calls back.
    // Solved 4 s after submit: long after the 20 submits, so the pingbacks find the relay dead.
    let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 4_000, ..FakeConfig::default() }).await?;
    let (port, data, http) = (free_port(), tmp_dir(), reqwest::Client::new());
    let mut relay = spawn_relay(port, &data, &fake);
    wait_healthy(&http, port).await?;
    let mut refs = Vec::new();
    for _ in 0..20 {
        let v: serde_json::Value = http
            .post(format!("http://127.0.0.1:{port}/tasks"))
            .bearer_auth(KILL_KEY)
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"iVBORw0KGgo="}"#)
            .send()
            .await?
            .json()
            .await?;
        refs.push(v["task_ref"].as_str().unwrap_or_default().to_owned());
        // The relay paces submits at 14 a second (CaptchaAI bans more than 60 in 3 s).
        tokio::time::sleep(Duration::from_millis(80)).await;
    }
    // Every task sent (those a burst queued, too): this test kills the relay after in.php
    // answered, before the pingbacks (a kill during a send is the burst test's).
    let sent_by = Instant::now() + Duration::from_secs(10);
    for r in &refs {
        read_until(&http, port, r, sent_by, |v| v.get("captcha_id").is_some())
            .await
            .map_err(|v| anyhow::anyhow!("{r} never sent: {v}"))?;
    }
    // SIGKILL: no shutdown, no flush. The pingbacks that come now find nobody.
    relay.0.kill()?;
    relay.0.wait()?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(fake.counts().callbacks_failed > 0, "some pingbacks hit the dead relay");

    let _relay = spawn_relay(port, &data, &fake);
    wait_healthy(&http, port).await?;
    let until = Instant::now() + Duration::from_secs(60);
    // What the fake solved, by our task (its signed pingback path names it).
    let answer_for = |r: &str| {
        fake.tasks()
            .into_iter()
            .find(|t| t.pingback.as_deref().is_some_and(|p| p.split('/').rev().nth(1) == Some(r)))
            .and_then(|t| t.answer)
    };
    for r in &refs {
        let v = read_until(&http, port, r, until, |v| v["status"] == "solved")
            .await
            .map_err(|v| anyhow::anyhow!("{r} never completed: {v}"))?;
        assert_eq!(v["solution"].as_str(), answer_for(r).as_deref(), "{r}: the fake's answer");
    }
    Ok(())
}

/// Reads `GET /tasks/{r}` until `done` holds of it (that answer), or `until` passes (`Err`: the
/// last answer).
async fn read_until(
    http: &reqwest::Client,
    port: u16,
    r: &str,
    until: Instant,
    done: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value, serde_json::Value> {
    loop {
        let v: serde_json::Value =
            match http.get(format!("http://127.0.0.1:{port}/tasks/{r}")).bearer_auth(KILL_KEY).send().await {
                Ok(resp) => resp.json().await.unwrap_or_default(),
                Err(e) => serde_json::Value::String(e.to_string()),
            };
        if done(&v) {
            return Ok(v);
        }
        if Instant::now() >= until {
            return Err(v);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn serve_with(env: &[(&str, &str)]) -> std::process::Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay-local"));
    cmd.arg("serve").env("RELAY_DATA_DIR", tmp_dir());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("run relay-local")
}

#[test]
fn bad_config_and_a_taken_port_fail_fast_with_a_clear_message() {
    const REAL: (&str, &str) = ("CAPTCHAAI_API_KEY", "0123456789abcdef0123456789abcdef");
    const PUBLIC: (&str, &str) = ("RELAY_PUBLIC_URL", "https://relay.example");
    let cases: [(&[(&str, &str)], &str); 8] = [
        (&[("RELAY_BIND", "not-an-address")], "bind `not-an-address`"),
        (&[("CALLBACK_GRACE_SECS", "soon")], "CALLBACK_GRACE_SECS"),
        (&[("CALLBACK_GRACE_SECS", "1")], "at least 5"),
        (&[REAL], "RELAY_PUBLIC_URL"),
        // A real (paid) account behind the published example secrets: refused before anything listens.
        (&[REAL, PUBLIC, ("RELAY_API_KEY", "local-dev-key")], "RELAY_API_KEY) is a published example value"),
        (&[REAL, PUBLIC, ("CALLBACK_SIGNING_SECRET", "local-dev-signing-secret")], "published example value"),
        (&[("RELAY_API_KEY", "short")], "at least 16 characters"),
        (&[("CALLBACK_RECENT_RESULTS", "lots")], "CALLBACK_RECENT_RESULTS must be a whole number"),
    ];
    for (env, needle) in cases {
        let out = serve_with(env);
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {err}");
        assert!(err.contains(needle), "{env:?}: {err}");
    }
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = serve_with(&[("RELAY_BIND", &addr)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("cannot listen"), "{err}");
    let file = tmp_dir().join("relay.json");
    std::fs::write(&file, r#"{"bind":"127.0.0.1:0","colour":"blue"}"#).expect("write");
    let out =
        Command::new(env!("CARGO_BIN_EXE_relay-local")).args(["serve", "--config"]).arg(&file).output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("colour"), "unknown keys are named: {err}");
}

#[tokio::test(flavor = "multi_thread")]
async fn with_a_real_key_and_no_secrets_given_random_ones_are_made_kept_and_used() -> anyhow::Result<()> {
    let fake = FakeCaptchaAi::start(FakeConfig::default()).await?;
    let (port, data, http) = (free_port(), tmp_dir(), reqwest::Client::new());
    let child = Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .arg("serve")
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", &data)
        .env("CAPTCHAAI_API_KEY", fake.api_key())
        .env("CAPTCHAAI_BASE_URL", fake.base_url())
        .env("RELAY_PUBLIC_URL", format!("http://127.0.0.1:{port}"))
        .env_remove("RELAY_API_KEY")
        .env_remove("CALLBACK_SIGNING_SECRET")
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()?;
    let mut relay = Relay(child);
    wait_healthy(&http, port).await?;
    let path = data.join("secrets.json");
    let secrets: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path)?)?;
    let key = secrets["api_key"].as_str().unwrap_or_default().to_owned();
    assert_eq!(key.len(), 64, "a long random key: {secrets}");
    assert!(!relay_local::run::PUBLISHED_DEFAULTS.contains(&key.as_str()));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&path)?.permissions().mode() & 0o777, 0o600, "owner-only");
    }
    let submit = |bearer: String| {
        http.post(format!("http://127.0.0.1:{port}/tasks"))
            .bearer_auth(bearer)
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"iVBORw0KGgo="}"#)
            .send()
    };
    assert_eq!(submit("local-dev-key".into()).await?.status(), 403, "the old example key opens nothing");
    assert_eq!(submit(key.clone()).await?.status(), 202, "the generated key works");
    // Where the secrets are is printed; with a real key, the key itself is not. The banner is
    // printed after start-up returns, so on a loaded machine it can come after our requests were
    // answered: read it up to its last line (the health URL) before stopping the relay.
    let stdout = relay.0.stdout.take().expect("piped stdout");
    let banner = tokio::task::spawn_blocking(move || {
        use std::io::BufRead;
        let mut out = String::new();
        for line in std::io::BufReader::new(stdout).lines() {
            let line = line?;
            out.push_str(&line);
            out.push('\n');
            if line.trim_end().ends_with("/health") {
                break;
            }
        }
        Ok::<_, std::io::Error>(out)
    });
    let out = tokio::time::timeout(Duration::from_secs(60), banner).await???;
    relay.0.kill()?;
    relay.0.wait()?;
    assert!(out.contains(&path.display().to_string()), "{out}");
    assert!(!out.contains(&key), "the key is not printed when a real account is behind it: {out}");
    Ok(())
}

//! Local mode as a user runs it: the demo scenario, the binary killed with SIGKILL mid-run and
//! restarted on the same data, and bad configuration.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fake_captchaai::{FakeCaptchaAi, FakeConfig};

fn tmp_dir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("relay-local-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).expect("tmp dir");
    d
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).map(|a| a.port()).expect("free port")
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_loses_nothing_and_its_table_matches_the_fake() -> anyhow::Result<()> {
    let report = relay_local::demo::run_demo(45, tmp_dir(), false).await?;
    assert_eq!(report.lost, 0, "{}", report.table());
    assert_eq!(report.by_callback + report.by_poll + report.by_redrive, 45, "{}", report.table());
    assert!(report.by_poll > 0 && report.by_redrive > 0, "all three paths at work:\n{}", report.table());
    assert!(report.dead_lettered >= report.by_redrive, "{}", report.table());
    assert_eq!(report.conflicts, 1, "the conflicting pingback was answered as a conflict:\n{}", report.table());
    Ok(())
}

struct Relay(std::process::Child);

impl Drop for Relay {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn spawn_relay(port: u16, data: &std::path::Path, fake: &FakeCaptchaAi) -> Relay {
    let child = Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .arg("serve")
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", data)
        .env("RELAY_API_KEY", "kill-test-key")
        .env("CALLBACK_SIGNING_SECRET", "kill-test-signing-secret")
        .env("CAPTCHAAI_API_KEY", fake.api_key())
        .env("CAPTCHAAI_BASE_URL", fake.base_url())
        .env("RELAY_PUBLIC_URL", format!("http://127.0.0.1:{port}"))
        .env("POLL_INTERVAL_SECS", "1")
        .env("CALLBACK_GRACE_SECS", "5")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn relay-local");
    Relay(child)
}

async fn wait_healthy(http: &reqwest::Client, port: u16) -> anyhow::Result<()> {
    let until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if http.get(format!("http://127.0.0.1:{port}/health")).send().await.is_ok() {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    anyhow::bail!("relay never became healthy")
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
            .bearer_auth("kill-test-key")
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"iVBORw0KGgo="}"#)
            .send()
            .await?
            .json()
            .await?;
        refs.push((
            v["task_ref"].as_str().unwrap_or_default().to_owned(),
            v["captcha_id"].as_str().unwrap_or_default().to_owned(),
        ));
    }
    // SIGKILL: no shutdown, no flush. The pingbacks that come now find nobody.
    relay.0.kill()?;
    relay.0.wait()?;
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert!(fake.counts().callbacks_failed > 0, "some pingbacks hit the dead relay");

    let _relay = spawn_relay(port, &data, &fake);
    wait_healthy(&http, port).await?;
    let until = Instant::now() + Duration::from_secs(60);
    for (r, id) in &refs {
        let want = fake.task(id).and_then(|t| t.answer).expect("the fake solved it");
        loop {
            let v: serde_json::Value = http
                .get(format!("http://127.0.0.1:{port}/tasks/{r}"))
                .bearer_auth("kill-test-key")
                .send()
                .await?
                .json()
                .await?;
            if v["status"] == "solved" {
                assert_eq!(v["solution"].as_str(), Some(want.as_str()), "{r}");
                break;
            }
            anyhow::ensure!(Instant::now() < until, "{r} never completed: {v}");
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
    Ok(())
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
    let cases: [(&[(&str, &str)], &str); 4] = [
        (&[("RELAY_BIND", "not-an-address")], "bind `not-an-address`"),
        (&[("CALLBACK_GRACE_SECS", "soon")], "CALLBACK_GRACE_SECS"),
        (&[("CALLBACK_GRACE_SECS", "1")], "at least 5"),
        (&[("CAPTCHAAI_API_KEY", "0123456789abcdef0123456789abcdef")], "RELAY_PUBLIC_URL"),
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

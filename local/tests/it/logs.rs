//! What `relay-local serve` writes when its output goes to a file, as a service manager or
//! `serve > relay.log 2>&1` has it: plain text without terminal colour codes, or with
//! `RELAY_LOG_FORMAT=json` (or `log_format` in the config file) JSON lines only, every one of
//! them parseable; and an error line that carries its cause.

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::common;
use common::{Relay, free_port, tmp_dir, wait_healthy};

const KEY: &str = "logs-test-key-0123456789";

/// Runs `serve` on a free port with stdout and stderr both into one file (`env` on top of the
/// test settings; RUST_LOG=info so every component writes), makes it log (a task, a refused
/// request, a forged pingback), stops it with SIGTERM and returns the file's text.
async fn serve_into_a_file(env: &[(&str, &str)], args: &[&str]) -> anyhow::Result<String> {
    let (port, dir) = (free_port(), tmp_dir());
    let log = dir.join("relay.log");
    let file = std::fs::File::create(&log)?;
    let child = Command::new(env!("CARGO_BIN_EXE_relay-local"))
        .arg("serve")
        .args(args)
        .env("RELAY_BIND", format!("127.0.0.1:{port}"))
        .env("RELAY_DATA_DIR", &dir)
        .env("RELAY_API_KEY", KEY)
        .env("POLL_INTERVAL_SECS", "1")
        .env("RUST_LOG", "info")
        .env_remove("RELAY_LOG_FORMAT")
        .env_remove("CAPTCHAAI_API_KEY")
        .envs(env.iter().copied())
        .stdout(Stdio::from(file.try_clone()?))
        .stderr(Stdio::from(file))
        .spawn()?;
    let mut relay = Relay(child);
    let http = reqwest::Client::new();
    wait_healthy(&http, port).await?;
    let base = format!("http://127.0.0.1:{port}");
    let submit = |key: &str| {
        http.post(format!("{base}/tasks"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"iVBORw0KGgo="}"#)
            .send()
    };
    assert_eq!(submit(KEY).await?.status(), 202);
    assert_eq!(submit("not-the-key-at-all").await?.status(), 403);
    http.get(format!("{base}/callback/tsk_forged/deadbeef?id=1&code=x")).send().await?;
    // A poller pass (every second here; later on a loaded machine), then a graceful stop.
    let until = Instant::now() + Duration::from_secs(30);
    while !std::fs::read_to_string(&log)?.contains("poll_tick") && Instant::now() < until {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop(&mut relay)?;
    Ok(std::fs::read_to_string(&log)?)
}

/// SIGTERM (a graceful stop, as a service manager sends), then waits for the exit.
fn stop(relay: &mut Relay) -> anyhow::Result<()> {
    let pid = relay.0.id().to_string();
    anyhow::ensure!(Command::new("kill").args(["-TERM", &pid]).status()?.success(), "kill -TERM {pid}");
    let until = Instant::now() + Duration::from_secs(20);
    while relay.0.try_wait()?.is_none() {
        anyhow::ensure!(Instant::now() < until, "no exit 20 s after SIGTERM");
        std::thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_logs_into_a_file_carry_no_colour_codes() -> anyhow::Result<()> {
    let text = serve_into_a_file(&[], &[]).await?;
    assert!(text.contains("relay listening on"), "the banner: {text}");
    assert!(text.contains(" INFO ") && text.contains("poll_tick"), "log lines were written: {text}");
    assert!(text.contains("shutting down"), "{text}");
    assert!(!text.contains('\u{1b}'), "no escape codes in a file:\n{text}");
    Ok(())
}

/// Every line of `text` as a JSON object.
fn json_lines(text: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    text.lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).with_context(|| format!("not a JSON line: {l}"))?;
            anyhow::ensure!(v.is_object() && v["level"].is_string() && v["timestamp"].is_string(), "{l}");
            Ok(v)
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_are_json_lines_only_from_the_environment_or_the_config_file() -> anyhow::Result<()> {
    let text = serve_into_a_file(&[("RELAY_LOG_FORMAT", "json")], &[]).await?;
    let lines = json_lines(&text)?;
    let events: Vec<&str> = lines.iter().filter_map(|v| v["event"].as_str()).collect();
    for want in ["relay_listening", "poll_tick", "relay_stopping"] {
        assert!(events.contains(&want), "`{want}` in {events:?}");
    }
    assert!(!text.contains(KEY), "never the API key");
    assert!(!text.contains('\u{1b}'), "{text}");

    let file = tmp_dir().join("relay.json");
    std::fs::write(&file, r#"{"log_format":"json"}"#)?;
    let text = serve_into_a_file(&[], &["--config", file.to_str().context("utf-8 path")?]).await?;
    assert!(json_lines(&text)?.iter().any(|v| v["event"] == "relay_listening"), "{text}");
    Ok(())
}

fn serve_on_a_taken_port(format: Option<&str>, dir: &Path) -> anyhow::Result<(String, std::net::TcpListener)> {
    let taken = std::net::TcpListener::bind("127.0.0.1:0")?;
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_relay-local"));
    cmd.arg("serve").env("RELAY_BIND", taken.local_addr()?.to_string()).env("RELAY_DATA_DIR", dir);
    match format {
        Some(f) => cmd.env("RELAY_LOG_FORMAT", f),
        None => cmd.env_remove("RELAY_LOG_FORMAT"),
    };
    let out = cmd.output()?;
    anyhow::ensure!(out.status.code() == Some(2), "exit {:?}", out.status);
    Ok((String::from_utf8(out.stderr)?, taken))
}

#[test]
fn an_error_line_carries_its_cause_in_either_format() -> anyhow::Result<()> {
    let (text, _taken) = serve_on_a_taken_port(None, &tmp_dir())?;
    assert!(text.starts_with("relay-local: cannot listen on"), "{text}");
    assert!(text.contains("in use"), "the OS's reason under the context: {text}");

    let (text, _taken) = serve_on_a_taken_port(Some("json"), &tmp_dir())?;
    let lines = json_lines(&text)?;
    let failed: Vec<&serde_json::Value> = lines.iter().filter(|v| v["level"] == "ERROR").collect();
    assert_eq!(failed.len(), 1, "{text}");
    let error = failed[0]["error"].as_str().unwrap_or_default();
    assert!(error.contains("cannot listen on") && error.contains("in use"), "{text}");

    let (text, _taken) = serve_on_a_taken_port(Some("yaml"), &tmp_dir())?;
    assert!(text.contains("RELAY_LOG_FORMAT must be text or json, got `yaml`"), "{text}");
    Ok(())
}

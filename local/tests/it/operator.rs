//! Local mode's operator commands through the `relay-local` binary, as `relay-ops` gives them
//! on AWS: a poisoned dead letter and a parked push are listed and replayed, against the relay
//! stopped (the command opens its files) and running (the command goes through its store), and
//! what is replayed is then applied or delivered. Only what was picked moves.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_local::run::{LocalConfig, Options, Running, start};
use relay_shared::domain::{CaptchaId, DeliveryStatus, IncomingResult, Outcome, Solution, TaskRef, TaskState, Via};
use relay_shared::testkit::receiver::Receiver;
use relay_shared::time::{Clock, ManualClock, SystemClock};

use crate::common;
use common::{free_port, tmp_dir};

const IMAGE: &str = r#"{"kind":"image","body":"iVBORw0KGgo="}"#;

/// Runs `relay-local <args>` on `dir` (off the runtime's threads: the command may call back
/// into the relay this test process runs). Returns the exit code, stdout and stderr.
async fn relay_local(dir: &Path, args: &[&str]) -> anyhow::Result<(i32, String, String)> {
    let (dir, args): (std::path::PathBuf, Vec<String>) =
        (dir.to_owned(), args.iter().map(|a| (*a).to_owned()).collect());
    let out = tokio::task::spawn_blocking(move || {
        Command::new(env!("CARGO_BIN_EXE_relay-local"))
            .args(&args)
            .env("RELAY_DATA_DIR", &dir)
            .env_remove("RUST_LOG")
            .env_remove("RELAY_LOG_FORMAT")
            .output()
    })
    .await??;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    Ok((out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr)))
}

/// The relay on `dir` and `port`, with `fake` (outside it, so it outlives restarts) as
/// CaptchaAI, and pushes parked after their first failed attempt.
async fn relay(dir: &Path, port: u16, fake: &FakeCaptchaAi) -> anyhow::Result<Running> {
    let cfg = LocalConfig {
        bind: format!("127.0.0.1:{port}"),
        data_dir: dir.to_owned(),
        captchaai_api_key: Some(fake.api_key()),
        captchaai_base_url: fake.base_url(),
        public_url: Some(format!("http://127.0.0.1:{port}")),
        callback_grace_secs: Some(5),
        poll_interval_secs: 3_600,
        webhook_allow_loopback: true,
        ..LocalConfig::default()
    };
    let delivery = relay_shared::delivery::DeliverySettings {
        timeout: Duration::from_secs(2),
        max_attempts: 1,
        ..relay_local::run::delivery_settings(&cfg)
    };
    start(&cfg, Options { delivery: Some(delivery), ..Options::default() }).await
}

async fn submit(relay: &Running, body: &str) -> anyhow::Result<TaskRef> {
    let v: serde_json::Value = reqwest::Client::new()
        .post(format!("{}/tasks", relay.base_url))
        .bearer_auth(&relay.api_key)
        .header("content-type", "application/json")
        .body(body.to_owned())
        .send()
        .await?
        .json()
        .await?;
    TaskRef::parse(v["task_ref"].as_str().unwrap_or_default()).with_context(|| format!("submit answered {v}"))
}

/// Waits until `done` holds of the stored task, up to 30 s.
async fn until_task(
    relay: &Running,
    r: &TaskRef,
    what: &str,
    done: impl Fn(&relay_shared::domain::Task) -> bool,
) -> anyhow::Result<relay_shared::domain::Task> {
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let task = relay.store.tasks().get(r).await?.context("task vanished")?;
        if done(&task) {
            return Ok(task);
        }
        anyhow::ensure!(Instant::now() < until, "{r} never {what}: {:?} {:?}", task.state.name(), task.delivery);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn status(t: &relay_shared::domain::Task) -> Option<DeliveryStatus> {
    t.delivery.as_ref().map(|d| d.status)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parked_pushes_are_listed_and_replayed_on_a_running_and_a_stopped_relay() -> anyhow::Result<()> {
    let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 50, ..FakeConfig::default() }).await?;
    let receiver = Receiver::start(Arc::new(SystemClock)).await?;
    let (dir, port) = (tmp_dir(), free_port());
    let running = relay(&dir, port, &fake).await?;
    // `/once/…` answers 500 to its first request, 200 after: with one attempt allowed, each
    // push is parked by that 500, and delivered when replayed.
    let with_callback = |path: &str| {
        let mut body: serde_json::Value = serde_json::from_str(IMAGE).unwrap_or_default();
        body["callback_url"] = format!("{}{path}", receiver.base_url).into();
        body.to_string()
    };
    let (a, b) =
        (submit(&running, &with_callback("/once/a")).await?, submit(&running, &with_callback("/once/b")).await?);
    let parked = |t: &relay_shared::domain::Task| status(t) == Some(DeliveryStatus::Parked);
    until_task(&running, &a, "parked", parked).await?;
    until_task(&running, &b, "parked", parked).await?;

    // Running: the command reaches the relay's store; only the task named is replayed.
    let (code, out, err) = relay_local(&dir, &["deliveries", "list"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("TASK") && out.contains(a.as_ref()) && out.contains(b.as_ref()), "{out}");
    assert!(out.contains("HTTP 500") && out.contains("127.0.0.1"), "the last outcome and the host: {out}");
    assert!(!out.contains("/once/"), "never the URL's path: {out}");
    let (code, out, err) = relay_local(&dir, &["deliveries", "list", "--json"]).await?;
    assert_eq!(code, 0, "{err}");
    let rows: serde_json::Value = serde_json::from_str(&out)?;
    assert_eq!(rows.as_array().map(Vec::len), Some(2), "{out}");
    let (code, out, err) = relay_local(&dir, &["deliveries", "replay", "--task", a.as_ref()]).await?;
    assert_eq!((code, out.trim()), (0, "1 push(es) due again now"), "{err}");
    assert!(err.contains("running relay"), "{err}");
    let delivered = |t: &relay_shared::domain::Task| status(t) == Some(DeliveryStatus::Delivered);
    until_task(&running, &a, "delivered after its replay", delivered).await?;
    assert_eq!(
        status(&running.store.tasks().get(&b).await?.context("b")?),
        Some(DeliveryStatus::Parked),
        "b not named"
    );

    // Stopped: the command opens the relay's files; the replayed push goes out when it starts.
    running.shutdown().await;
    let (code, out, err) = relay_local(&dir, &["deliveries", "list"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.contains(b.as_ref()) && !out.contains(a.as_ref()), "{out}");
    let (code, out, err) = relay_local(&dir, &["deliveries", "replay", "--since", "1h"]).await?;
    assert_eq!((code, out.trim()), (0, "1 push(es) due again now"), "{err}");
    assert!(err.contains("stopped"), "{err}");
    let running = relay(&dir, port, &fake).await?;
    until_task(&running, &b, "delivered after its replay", delivered).await?;
    let (code, out, _) = relay_local(&dir, &["deliveries", "list"]).await?;
    assert_eq!((code, out.lines().count()), (0, 1), "only the header is left: {out}");
    // Each push: the 500 that parked it, then the 2xx of its replay, under one webhook-id.
    for path in ["/once/a", "/once/b"] {
        let hits: Vec<_> = receiver.hits().into_iter().filter(|h| h.path == path).collect();
        assert_eq!(hits.iter().map(|h| h.answered).collect::<Vec<_>>(), [500, 200], "{path}");
        assert_eq!(hits[0].webhook_id, hits[1].webhook_id, "{path}: the same result, the same webhook-id");
    }
    running.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn poisoned_dead_letters_are_listed_redacted_and_only_the_picked_ones_replayed() -> anyhow::Result<()> {
    // Solved in an hour and no pingbacks: the tasks wait with their CaptchaAI ids, and only the
    // dead letters this test writes can resolve them.
    let fake =
        FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 3_600_000, drop_callbacks: 1.0, ..FakeConfig::default() })
            .await?;
    let (dir, port) = (tmp_dir(), free_port());
    let running = relay(&dir, port, &fake).await?;
    let (a, b) = (submit(&running, IMAGE).await?, submit(&running, IMAGE).await?);
    let sent = |t: &relay_shared::domain::Task| t.captcha_id.is_some();
    let ids = [
        until_task(&running, &a, "sent", sent).await?.captcha_id.context("a's id")?,
        until_task(&running, &b, "sent", sent).await?.captcha_id.context("b's id")?,
    ];
    running.shutdown().await;

    // Each task's result as a dead letter, received 5 times without being applied (the store
    // down all along): the next receive moves it to the poison queue.
    let clock = ManualClock::at(SystemClock.now());
    let queue = relay_local::queue::DiskQueue::open(
        &relay_local::ops::dead_letter_path(&dir),
        Arc::new(clock.clone()),
        Duration::from_secs(30),
        5,
    )?;
    let letter = |r: &TaskRef, id: &CaptchaId, token: &str| -> anyhow::Result<String> {
        let d = IncomingResult {
            captcha_id: id.clone(),
            outcome: Outcome::Solved(Solution::parse(token)?),
            received_at: clock.now(),
            via: Via::Callback,
            token_clock_start: clock.now(),
        };
        Ok(relay_shared::deadletter::DeadLetter::new(r, &d, "task store unavailable: throttled", 1).to_json())
    };
    let id_a = queue.send_body(&letter(&a, &ids[0], "secret-token-aaaa")?)?;
    let id_b = queue.send_body(&letter(&b, &ids[1], "secret-token-bbbb")?)?;
    for _ in 0..6 {
        queue.receive(10)?;
        clock.advance(Duration::from_secs(31));
    }
    assert_eq!(queue.poisoned_letters()?.len(), 2);
    drop(queue);

    // Stopped: listed, the solutions redacted unless asked for.
    let (code, out, err) = relay_local(&dir, &["dead-letters", "list"]).await?;
    assert_eq!(code, 0, "{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 2, "{out}");
    assert!(lines[0].starts_with(&format!("{id_a}  receives=5  task={a}  captcha_id={}", ids[0])), "{out}");
    assert!(lines[0].contains("error=task store unavailable: throttled"), "{out}");
    assert!(!out.contains("secret-token") && out.contains("<redacted 17 bytes>"), "{out}");
    let (_, out, _) = relay_local(&dir, &["dead-letters", "list", "--reveal"]).await?;
    assert!(out.contains("code=secret-token-aaaa"), "{out}");
    let (code, _, err) = relay_local(&dir, &["dead-letters", "replay"]).await?;
    assert_eq!(code, 2, "nothing picked, nothing moved: {err}");
    assert!(err.contains("--id") && err.contains("--all"), "{err}");
    let (code, _, err) = relay_local(&dir, &["dead-letters", "replay", "--id", "999"]).await?;
    assert_eq!(code, 1, "{err}");
    assert!(err.contains("not in the poison queue: 999"), "{err}");

    // Only the letter picked moves; the relay applies it when it starts.
    let (code, out, err) = relay_local(&dir, &["dead-letters", "replay", "--id", &id_a.to_string()]).await?;
    assert_eq!((code, out.trim()), (0, format!("moved 1 letter(s) back to the queue: {id_a}").as_str()), "{err}");
    let running = relay(&dir, port, &fake).await?;
    let redriven = |t: &relay_shared::domain::Task| matches!(t.state, TaskState::Solved { via: Via::Redrive, .. });
    let task = until_task(&running, &a, "applied from its replayed letter", redriven).await?;
    assert!(matches!(&task.state, TaskState::Solved { solution, .. } if solution.expose() == "secret-token-aaaa"));
    assert!(!running.store.tasks().get(&b).await?.context("b")?.state.is_final(), "b's letter was not picked");

    // Running: the other one, by its task.
    let (code, out, err) = relay_local(&dir, &["dead-letters", "list"]).await?;
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with(&format!("{id_b}  ")) && out.lines().count() == 1, "{out}");
    let (code, out, err) = relay_local(&dir, &["dead-letters", "replay", "--task", b.as_ref()]).await?;
    assert_eq!((code, out.trim()), (0, format!("moved 1 letter(s) back to the queue: {id_b}").as_str()), "{err}");
    until_task(&running, &b, "applied from its replayed letter", redriven).await?;
    let (code, out, err) = relay_local(&dir, &["dead-letters", "list"]).await?;
    assert_eq!((code, out.as_str()), (0, ""), "{err}");
    assert!(err.starts_with("0 poisoned letter(s) listed;"), "{err}");
    running.shutdown().await;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_relay_per_data_directory_and_commands_on_one_that_never_ran_say_so() -> anyhow::Result<()> {
    let dir = tmp_dir();
    let held = relay_local::ops::DataLock::try_take(&dir)?.context("a fresh directory is free")?;
    let err = relay_local::ops::DataLock::take(&dir, Duration::from_millis(300)).await.err().context("taken twice")?;
    assert!(format!("{err:#}").contains(&format!("pid {}", std::process::id())), "{err:#}");
    drop(held);
    assert!(relay_local::ops::DataLock::try_take(&dir)?.is_some(), "let go when dropped");

    let empty = tmp_dir();
    for args in [&["deliveries", "list"][..], &["dead-letters", "list"][..]] {
        let (code, _, err) = relay_local(&empty, args).await?;
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("is RELAY_DATA_DIR right?"), "{args:?}: {err}");
    }
    Ok(())
}

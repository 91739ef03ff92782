//! Push delivery in local mode as a user runs it (issue 15): the `relay-local` binary, 1,000
//! tasks submitted with a `callback_url`, their results pushed to a receiver on loopback that
//! fails by pattern (500 once, 429 with `Retry-After: 120`, a request left hanging past the
//! 10 s timeout, 410), the relay killed with SIGKILL while pushes are in flight and restarted
//! on the same data. Real time, local mode's defaults (the template's delivery settings; the
//! poller every second, as local mode's tests run it). What takes hours — the retries after
//! 5 min, parking after the 7th attempt — is the simulation's (`tests/sim/tests/delivery.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_captchaai::{FakeCaptchaAi, FakeConfig};

mod common;
use common::{Relay, spawn_relay as spawn_relay_with, wait_healthy};
use relay_shared::testkit::receiver::{Receiver, verify_with_reference};
use relay_shared::time::{Clock, SystemClock};

const KEY: &str = "delivery-test-key-0123456789";
const PATTERNS: [(&str, usize); 5] = [("ok", 600), ("once", 200), ("limited", 100), ("slow", 50), ("gone", 50)];

fn spawn_relay(port: u16, data: &std::path::Path, fake: &FakeCaptchaAi) -> Relay {
    spawn_relay_with(port, data, fake, KEY, &[("RELAY_WEBHOOK_ALLOW_LOOPBACK", "1")])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_pushes_survive_a_sigkill_and_a_failing_receiver() -> anyhow::Result<()> {
    let fake = FakeCaptchaAi::start(FakeConfig { solve_delay_ms: 2_000, drop_callbacks: 0.2, ..FakeConfig::default() })
        .await?;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let receiver = Receiver::start(clock).await?;
    let local = receiver.base_url.replace("127.0.0.1", "localhost");
    let data = std::env::temp_dir().join(format!("relay-delivery-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&data)?;
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let http = reqwest::Client::new();
    let relay = std::sync::Arc::new(std::sync::Mutex::new(Some(spawn_relay(port, &data, &fake))));
    wait_healthy(&http, port).await?;

    // SSRF: a metadata address is refused even with loopback allowed.
    let (status, body) = {
        let r = http
            .post(format!("http://127.0.0.1:{port}/tasks"))
            .bearer_auth(KEY)
            .header("content-type", "application/json")
            .body(r#"{"kind":"image","body":"iVBORw0KGgo=","callback_url":"http://169.254.169.254/latest/meta-data/"}"#)
            .send()
            .await?;
        (r.status().as_u16(), r.text().await?)
    };
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("invalid_callback_url"), "{body}");

    let started = Instant::now();
    // SIGKILL — no shutdown, no flush — once 300 pushes were answered 200: submits, callbacks,
    // polls and pushes all in flight. Restarted 2 s later on the same data and port.
    let killer = {
        let (relay, rcv, data, fake) = (relay.clone(), receiver.clone(), data.clone(), &fake);
        let spawn_again = move || spawn_relay(port, &data, fake);
        async move {
            while rcv.hits().iter().filter(|h| h.answered == 200).count() < 300 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let at_kill = rcv.hits().len();
            if let Some(mut r) = relay.lock().ok().and_then(|mut g| g.take()) {
                let _ = r.0.kill();
                let _ = r.0.wait();
            }
            tokio::time::sleep(Duration::from_secs(2)).await;
            if let Ok(mut g) = relay.lock() {
                *g = Some(spawn_again());
            }
            at_kill
        }
    };
    let mut tasks: BTreeMap<String, String> = BTreeMap::new();
    let submitter = async {
        for (pattern, n) in PATTERNS {
            for i in 0..n {
                let base = if pattern == "slow" { &local } else { &receiver.base_url };
                let url = format!("{base}/{pattern}/{i}");
                let body = serde_json::json!({ "kind": "image", "body": "iVBORw0KGgo=", "callback_url": url });
                // A careful client: the same idempotency key again after no answer (the relay may be
                // down: it is killed mid-way), never a second task.
                let v: serde_json::Value = loop {
                    let r = http
                        .post(format!("http://127.0.0.1:{port}/tasks"))
                        .bearer_auth(KEY)
                        .header("content-type", "application/json")
                        .header("idempotency-key", format!("{pattern}-{i}"))
                        .body(body.to_string())
                        .send()
                        .await;
                    if let Ok(r) = r
                        && r.status().as_u16() == 202
                    {
                        break r.json().await?;
                    }
                    tokio::time::sleep(Duration::from_millis(200)).await;
                };
                let task_ref = v["task_ref"].as_str().unwrap_or_default().to_owned();
                tasks.insert(task_ref, format!("/{pattern}/{i}"));
                // The relay paces submits at 14 a second (CaptchaAI bans more than 60 in 3 s).
                tokio::time::sleep(Duration::from_millis(75)).await;
            }
        }
        anyhow::Ok(())
    };
    let (submitted, at_kill) = tokio::join!(submitter, killer);
    submitted?;
    assert_eq!(tasks.len(), 1000);
    wait_healthy(&http, port).await?;

    // Every task's push ends delivered (or gone, for the 410s).
    let deadline = Instant::now() + Duration::from_secs(360);
    let mut status: BTreeMap<String, String> = BTreeMap::new();
    let _relay = relay;
    loop {
        status.clear();
        for r in tasks.keys() {
            let v: serde_json::Value =
                http.get(format!("http://127.0.0.1:{port}/tasks/{r}")).bearer_auth(KEY).send().await?.json().await?;
            let st = v["delivery"]["status"].as_str().unwrap_or("none").to_owned();
            if Instant::now() > deadline && st != "delivered" && st != "gone" {
                eprintln!("owed: {r} {} task {} delivery {}", tasks[r], v["status"], v["delivery"]);
            }
            status.insert(r.clone(), st);
        }
        if status.values().all(|s| s == "delivered" || s == "gone") || Instant::now() > deadline {
            break;
        }
        tokio::time::sleep(Duration::from_secs(5)).await;
    }
    let secret = std::fs::read_to_string(data.join("webhook-secrets"))?;
    let hits = receiver.hits();
    let mut by_path: BTreeMap<&str, Vec<&relay_shared::testkit::receiver::Hit>> = BTreeMap::new();
    for h in &hits {
        by_path.entry(h.path.as_str()).or_default().push(h);
    }
    let (mut delivered, mut gone, mut owed, mut extra_ids, mut repeats) = (0, 0, 0, 0, 0);
    for (r, path) in &tasks {
        let got = by_path.get(path.as_str()).cloned().unwrap_or_default();
        let ids: BTreeSet<&str> = got.iter().map(|h| h.webhook_id.as_str()).collect();
        extra_ids += ids.len().saturating_sub(1);
        let ok = got.iter().filter(|h| h.answered == 200).count();
        repeats += ok.saturating_sub(1);
        match status.get(r).map(String::as_str) {
            Some("delivered") => {
                delivered += 1;
                assert!(ok >= 1, "{r} ({path}) is marked delivered but was never answered 200");
            }
            Some("gone") => {
                gone += 1;
                assert!(path.starts_with("/gone/"), "{r}: gone from {path}?");
            }
            other => {
                owed += 1;
                eprintln!("{r} ({path}): push {other:?}");
            }
        }
    }
    let answers = verify_with_reference(secret.trim(), &hits)?;
    let failed: Vec<&String> = answers.iter().filter(|a| *a != "ok").collect();
    println!("| tasks / requests at the receiver before the SIGKILL / in all | 1000 / {at_kill} / {} |", hits.len());
    println!("| delivered / gone (410) / still owed | {delivered} / {gone} / {owed} |");
    println!(
        "| answered 200 more than once (same webhook-id) / tasks under more than one webhook-id | {repeats} / {extra_ids} |"
    );
    println!(
        "| signatures verified by the standardwebhooks library | {} of {} |",
        answers.len() - failed.len(),
        hits.len()
    );
    println!("| wall time | {} s |", started.elapsed().as_secs());
    assert_eq!(owed, 0, "every push delivered or gone");
    assert_eq!((delivered, gone), (950, 50));
    assert_eq!(extra_ids, 0, "one result, one webhook-id, across the SIGKILL");
    assert!(failed.is_empty(), "refused by the reference library: {:?}", &failed[..failed.len().min(5)]);
    let _ = std::fs::remove_dir_all(&data);
    Ok(())
}

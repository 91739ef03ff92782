//! Push delivery to owners' callbacks (issue 15) on the simulated clock: 1,000 tasks submitted
//! through `POST /tasks` with a `callback_url`, solved by the CaptchaAI-like fake (realistic
//! solve times, 30 % of pingbacks dropped, so the poller recovers those), each result pushed to
//! a receiver on loopback that fails in patterns — down for the first 10 minutes, 500s, 429 with
//! `Retry-After`, requests left hanging past the timeout, 410, an endpoint that never recovers —
//! with the worker killed mid-way and restarted. The delivery settings are the template's
//! defaults (10 s timeout, 7 attempts over ~18 h, 4 in flight and 10 a second per host); the
//! retry schedule runs on the simulated clock, request timeouts in real time.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::time::Duration;

use fake_captchaai::FakeConfig;
use relay_shared::delivery::{Deliverer, DeliverySettings, KeySource};
use relay_shared::domain::{CaptchaKind, DeliveryStatus, TaskRef};
use relay_shared::testkit::receiver::{Receiver, verify_with_reference};
use relay_shared::time::Clock;
use relay_shared::webhook::{SigningKeys, UrlPolicy, WebhookSecret};
use relay_sim::{EPOCH, World};

const PATTERNS: [(&str, usize); 6] =
    [("ok", 700), ("flaky", 100), ("limited", 80), ("slow", 20), ("gone", 50), ("never", 50)];

/// The template's DeliveryFunction defaults, read from template.yaml.
fn template_settings() -> anyhow::Result<DeliverySettings> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../template.yaml"))?;
    let t: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let default = |name: &str| -> anyhow::Result<u64> {
        t["Parameters"][name]["Default"].as_u64().ok_or_else(|| anyhow::anyhow!("no default for {name}"))
    };
    Ok(DeliverySettings {
        timeout: Duration::from_secs(default("DeliveryTimeoutSeconds")?),
        max_attempts: u32::try_from(default("DeliveryMaxAttempts")?)?,
        per_host_concurrency: usize::try_from(default("DeliveryPerHostConcurrency")?)?,
        per_host_per_second: u32::try_from(default("DeliveryPerHostPerSecond")?)?,
        // Loopback is where the receiver is; on AWS it is public_https (the unit tests of the
        // guard cover that).
        policy: UrlPolicy::AllowLoopback,
    })
}

/// The worker loop as the Lambda's sweep and local mode run it: a sweep whenever something is
/// due, otherwise asleep until the next push falls due (at most a minute).
fn start_worker(clock: &relay_time::ManualClock, deliverer: Arc<Deliverer>) -> tokio::task::AbortHandle {
    let clock: Arc<dyn Clock> = Arc::new(clock.clone());
    let busy = clock.busy();
    tokio::spawn(async move {
        let _busy = busy;
        loop {
            let now = clock.now();
            let report = deliverer.sweep(clock.clone(), now.plus(Duration::from_secs(55))).await;
            let idle = report.delivered + report.retried + report.parked + report.gone + report.already_delivered == 0;
            let next = match deliverer.store.oldest_delivery_due().await {
                Ok(Some(t)) if t > clock.now() => t.min(clock.now().plus(Duration::from_secs(60))),
                _ if idle => clock.now().plus(Duration::from_secs(1)),
                _ => clock.now(),
            };
            clock.sleep_until(next.max(clock.now().plus(Duration::from_millis(200)))).await;
        }
    })
    .abort_handle()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_results_reach_a_failing_receiver_or_are_parked_and_listed() -> anyhow::Result<()> {
    let w = World::start(FakeConfig { drop_callbacks: 0.3, ..FakeConfig::captchaai_like() }).await?;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let receiver = Receiver::start(clock.clone()).await?;
    // The slow ones go to `localhost`: another host for the per-host limits, as a slow owner
    // endpoint would be.
    let local = receiver.base_url.replace("127.0.0.1", "localhost");
    let (_, secret) = WebhookSecret::generate();
    let settings = template_settings()?;
    assert_eq!(
        (settings.timeout, settings.max_attempts),
        (DeliverySettings::default().timeout, DeliverySettings::default().max_attempts),
        "the code's defaults are the template's"
    );
    let deliverer = || -> anyhow::Result<Arc<Deliverer>> {
        Ok(Arc::new(Deliverer::new(
            w.store.clone(),
            KeySource::new(SigningKeys::parse_list(&secret)?, Some(w.store.clone())),
            settings.clone(),
        )?))
    };
    w.schedule_poller(EPOCH);

    // SSRF: owner URLs at private, link-local and metadata addresses are refused at submit.
    for bad in
        ["http://169.254.169.254/latest/meta-data/", "http://10.0.0.7/hook", "http://192.168.1.1/", "ftp://x.example/"]
    {
        let mut body: serde_json::Value =
            serde_json::from_str(relay_shared::testkit::body_for(CaptchaKind::Turnstile))?;
        body["callback_url"] = serde_json::Value::String(bad.into());
        let (status, answer, _) = w.post_task(&body.to_string(), None).await?;
        assert_eq!(status, 400, "{bad}: {answer}");
        assert_eq!(answer["error"]["code"], "invalid_callback_url", "{bad}: {answer}");
    }
    assert_eq!(w.fake.counts().in_php, 0, "nothing was sent for a refused URL");

    // The receiver is down for the first 10 minutes.
    receiver.set_down(true);
    let worker = Arc::new(std::sync::Mutex::new(Some(start_worker(&w.clock, deliverer()?))));
    let plan: Vec<(String, CaptchaKind)> = PATTERNS
        .iter()
        .flat_map(|(p, n)| (0..*n).map(move |i| ((*p).to_owned(), i)))
        .enumerate()
        .map(|(k, (p, i))| {
            let kind =
                [CaptchaKind::RecaptchaV2, CaptchaKind::Turnstile, CaptchaKind::Image, CaptchaKind::Hcaptcha][k % 4];
            let base = if p == "slow" { &local } else { &receiver.base_url };
            (format!("{base}/{p}/{i}"), kind)
        })
        .collect();
    let submitted: Arc<std::sync::Mutex<BTreeMap<String, String>>> = Arc::default();
    {
        // The owner submits 10 a second (under the relay's account-wide pace of 14).
        let (clock, sub, base, key) = (clock.clone(), submitted.clone(), w.base.clone(), w.api_key.clone());
        let http = reqwest::Client::new();
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            for (n, (url, kind)) in plan.into_iter().enumerate() {
                if n % 10 == 0 {
                    clock.sleep_until(EPOCH.plus(Duration::from_secs(n as u64 / 10))).await;
                }
                let mut body: serde_json::Value =
                    serde_json::from_str(relay_shared::testkit::body_for(kind)).unwrap_or_default();
                body["callback_url"] = serde_json::Value::String(url.clone());
                for _ in 0..5 {
                    let r = http
                        .post(format!("{base}/tasks"))
                        .bearer_auth(&key)
                        .header("content-type", "application/json")
                        .header("idempotency-key", format!("dlv-{n}"))
                        .body(body.to_string())
                        .send()
                        .await;
                    if let Ok(r) = r
                        && r.status().as_u16() == 202
                    {
                        let v: serde_json::Value = r.json().await.unwrap_or_default();
                        if let (Some(t), Ok(mut s)) = (v["task_ref"].as_str(), sub.lock()) {
                            s.insert(t.to_owned(), url.clone());
                        }
                        break;
                    }
                    clock.sleep_until(clock.now().plus(Duration::from_secs(1))).await;
                }
            }
        });
    }
    {
        // At 3 minutes the worker is killed mid-way (its claims lapse with their leases) and
        // started again 30 s later as a new process would be; at 10 minutes the receiver is back.
        let (clock, worker, rcv) = (clock.clone(), worker.clone(), receiver.clone());
        let fresh = deliverer()?;
        let w_clock = w.clock.clone();
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(EPOCH.plus(Duration::from_secs(180))).await;
            if let Some(h) = worker.lock().ok().and_then(|mut g| g.take()) {
                h.abort();
            }
            clock.sleep_until(EPOCH.plus(Duration::from_secs(210))).await;
            let h = start_worker(&w_clock, fresh);
            if let Ok(mut g) = worker.lock() {
                *g = Some(h);
            }
            clock.sleep_until(EPOCH.plus(Duration::from_secs(600))).await;
            rcv.set_down(false);
        });
    }
    // Long enough for the whole schedule (0, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, +20 % jitter).
    w.run_for(Duration::from_secs(22 * 3600)).await;
    if let Some(h) = worker.lock().ok().and_then(|mut g| g.take()) {
        h.abort();
    }

    let submitted = submitted.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(submitted.len(), 1000, "every task was accepted");
    let hits = receiver.hits();
    let mut by_path: BTreeMap<String, Vec<&relay_shared::testkit::receiver::Hit>> = BTreeMap::new();
    for h in &hits {
        by_path.entry(h.path.clone()).or_default().push(h);
    }
    let parked = relay_ops::deliveries::list(&w.store, EPOCH, w.clock.now(), 10_000).await?;
    let parked_refs: BTreeSet<String> = parked.iter().map(|p| p.task_ref.clone()).collect();
    let (mut delivered, mut gone, mut parked_n, mut lost, mut extra_ids, mut dup_deliveries) = (0, 0, 0, 0, 0, 0);
    let mut latencies = Vec::new();
    for (task_ref, url) in &submitted {
        let task = w.store.get(&TaskRef::parse(task_ref)?).await?.ok_or_else(|| anyhow::anyhow!("{task_ref} gone"))?;
        assert!(task.state.is_final(), "{task_ref} is still {}", task.state.name());
        let d = task.delivery.clone().unwrap_or_default();
        let path = url
            .split_once("://")
            .map(|(_, r)| r)
            .and_then(|r| r.find('/').map(|i| r[i..].to_owned()))
            .unwrap_or_default();
        let got = by_path.get(&path).cloned().unwrap_or_default();
        let ids: BTreeSet<&str> = got.iter().map(|h| h.webhook_id.as_str()).collect();
        extra_ids += ids.len().saturating_sub(1);
        let accepted: Vec<_> = got.iter().filter(|h| (200..300).contains(&h.answered)).collect();
        dup_deliveries += accepted.len().saturating_sub(1);
        match d.status {
            DeliveryStatus::Delivered => {
                delivered += 1;
                assert!(!accepted.is_empty(), "{task_ref} is marked delivered but {path} never answered 2xx");
                assert_eq!(d.delivered_id.as_deref(), task.webhook_id().as_deref());
                let first = accepted.iter().map(|h| h.at).min().unwrap_or(task.created_at);
                latencies.push(first.since(task.created_at).as_secs());
            }
            DeliveryStatus::Gone => {
                gone += 1;
                assert!(path.starts_with("/gone/"), "{task_ref}: 410 from {path}?");
            }
            DeliveryStatus::Parked => {
                parked_n += 1;
                assert!(parked_refs.contains(task_ref), "{task_ref} is parked but `deliveries list` does not show it");
                assert_eq!(d.attempts, settings.max_attempts, "{task_ref} parked after {} attempts", d.attempts);
            }
            other => {
                lost += 1;
                eprintln!("{task_ref} ({path}): push still {other:?} after 22 h: {d:?}");
            }
        }
    }
    let answers = verify_with_reference(&secret, &hits)?;
    let failed: Vec<&String> = answers.iter().filter(|a| *a != "ok").collect();
    latencies.sort_unstable();
    let pct = |p: f64| latencies.get(((latencies.len() as f64 - 1.0) * p) as usize).copied().unwrap_or(0);
    println!("| tasks (all terminal) | 1000 |");
    println!(
        "| delivered / gone (410) / parked and listed / still owed | {delivered} / {gone} / {parked_n} / {lost} |"
    );
    println!(
        "| requests at the receiver / answered 2xx more than once (same webhook-id) | {} / {dup_deliveries} |",
        hits.len()
    );
    println!("| tasks pushed under more than one webhook-id | {extra_ids} |");
    println!(
        "| signatures verified by the standardwebhooks library | {} of {} |",
        answers.len() - failed.len(),
        hits.len()
    );
    println!(
        "| submit → first 2xx at the receiver (s): p50 / p95 / max | {} / {} / {} |",
        pct(0.5),
        pct(0.95),
        pct(1.0)
    );
    assert_eq!(lost, 0, "every push is delivered, gone or parked");
    assert_eq!(gone, 50);
    assert_eq!(parked_n, 50, "only the endpoint that never recovers is parked");
    assert_eq!(delivered, 900);
    assert_eq!(extra_ids, 0, "one result, one webhook-id");
    assert!(failed.is_empty(), "signatures the reference library refused: {:?}", &failed[..failed.len().min(5)]);
    assert_eq!(answers.len(), hits.len());
    // Replay: every parked push goes out again (same webhook-id), and is parked again.
    let replayed = relay_ops::deliveries::replay_parked(&w.store, EPOCH, w.clock.now(), 10_000, w.clock.now()).await?;
    assert_eq!(replayed.replayed.len(), 50);
    let before = receiver.hits().len();
    let d = deliverer()?;
    let (c, busy) = (clock.clone(), clock.busy());
    let deadline = w.clock.now().plus(Duration::from_secs(55));
    // On the clock, as every worker runs: the host's spacing waits on it.
    let sweep = tokio::spawn(async move {
        let _busy = busy;
        d.sweep(c, deadline).await
    });
    w.run_for(Duration::from_secs(60)).await;
    let report = sweep.await?;
    assert!(report.retried >= 50, "{report:?}");
    let again: BTreeSet<String> = receiver.hits()[before..].iter().map(|h| h.path.clone()).collect();
    assert_eq!(again.len(), 50, "every parked push was sent again");
    assert!(again.iter().all(|p| p.starts_with("/never/")));
    Ok(())
}

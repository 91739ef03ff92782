//! Push delivery to owners' callbacks on the simulated clock, with the template's delivery
//! settings and local mode's worker loop (told of each result by the store as it is written,
//! retries on their schedule, a catch-up pass every 5 s). Three runs:
//!
//! - **The token's clock** (issue 23): 500 tasks, most carrying tokens (reCAPTCHA/hCaptcha 120 s,
//!   Turnstile 300 s), solved by the CaptchaAI-like fake (realistic solve times, 20 % of
//!   pingbacks dropped, so the poller recovers those), pushed to a receiver that fails every
//!   task's first request once — a 500, a 429 with `Retry-After: 2`, a request left hanging
//!   past the timeout, a reset connection, a redirect — answers 410 for some, and others slowly
//!   (7 s) or with 4 MiB bodies, all on one host; the relay is killed (connections cut, the
//!   worker and the poller aborted mid-way, nothing flushed) and restarted. Every result must be
//!   delivered (or gone) within 180 s of its record, and no result that was fresh when recorded
//!   may reach the owner after its token died.
//! - **The long schedule** (issue 15): 1,000 tasks, a receiver down for the first 10 minutes,
//!   then failing by pattern (500 twice, 429 with `Retry-After: 120`, hangs, 410, 503 for
//!   ever), the worker killed and restarted; 22 h simulated so the standard schedule runs out
//!   and the endpoint that never recovers is parked, listed and replayed.
//! - **The sweep through a store outage**: the delivery function's scheduled sweep (the net for
//!   pushes whose stream record or retry message met a store failure) meets 5 s in which every
//!   store call fails, and must still push every result within the same invocation.
//!
//! Request timeouts, hangs and slow answers all take simulated time: the sender's limit is on
//! the worker's clock, the receiver's waits on the same clock.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use fake_captchaai::FakeConfig;
use relay_shared::delivery::{Deliverer, DeliverySettings, Inbox, KeySource};
use relay_shared::domain::{CaptchaKind, DeliveryStatus, Task, TaskRef};
use relay_shared::store::{PushNotifier, TaskStore};
use relay_shared::testkit::receiver::{Receiver, check_pushes, p50_p95_max, verify_with_reference};
use relay_shared::time::Clock;
use relay_shared::webhook::{SigningKeys, UrlPolicy, WebhookSecret};
use relay_sim::{EPOCH, Options, World};

/// The template's DeliveryFunction defaults, read from template.yaml.
fn template_settings() -> anyhow::Result<DeliverySettings> {
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../template.yaml"))?;
    let t: serde_yaml::Value = serde_yaml::from_str(&text)?;
    let default = |name: &str| -> anyhow::Result<u64> {
        t["Parameters"][name]["Default"].as_u64().ok_or_else(|| anyhow::anyhow!("no default for {name}"))
    };
    let s = DeliverySettings {
        timeout: Duration::from_secs(default("DeliveryTimeoutSeconds")?),
        max_attempts: u32::try_from(default("DeliveryMaxAttempts")?)?,
        per_host_concurrency: u32::try_from(default("DeliveryPerHostConcurrency")?)?,
        per_host_per_second: u32::try_from(default("DeliveryPerHostPerSecond")?)?,
        // Loopback is where the receiver is; on AWS it is public_https (the unit tests of the
        // guard cover that).
        policy: UrlPolicy::AllowLoopback,
    };
    let code = DeliverySettings::default();
    anyhow::ensure!(
        (s.timeout, s.max_attempts, s.per_host_concurrency, s.per_host_per_second)
            == (code.timeout, code.max_attempts, code.per_host_concurrency, code.per_host_per_second),
        "the code's delivery defaults differ from the template's: {code:?} vs {s:?}"
    );
    Ok(s)
}

/// Local mode's delivery worker as a "process" that can be killed: a fresh worker (new lease
/// name, empty host gates, new inbox) each start; the store's notifier reaches whichever runs.
struct Worker {
    clock: Arc<dyn Clock>,
    store: TaskStore,
    secret: String,
    settings: DeliverySettings,
    inbox: Arc<Mutex<Option<Inbox>>>,
    running: Mutex<Option<tokio::task::JoinHandle<relay_shared::delivery::SweepReport>>>,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Worker {
    fn notifier(inbox: &Arc<Mutex<Option<Inbox>>>) -> PushNotifier {
        let inbox = inbox.clone();
        PushNotifier::new(move |due| {
            if let Some(i) = inbox.lock().ok().and_then(|g| g.clone()) {
                i.send(due);
            }
        })
    }

    fn start(&self) -> anyhow::Result<()> {
        let (inbox, rx) = Inbox::new(self.clock.clone());
        let d = Deliverer::new(
            self.store.clone(),
            KeySource::new(SigningKeys::parse_list(&self.secret)?, Some(self.store.clone())),
            self.settings.clone(),
        )?
        .with_wakeups(Arc::new(inbox.clone()));
        if let Ok(mut g) = self.inbox.lock() {
            *g = Some(inbox);
        }
        let run = Arc::new(d).run(self.clock.clone(), rx, relay_local::run::DELIVERY_CATCH_UP, self.stop.subscribe());
        if let Ok(mut g) = self.running.lock() {
            *g = Some(tokio::spawn(run));
        }
        Ok(())
    }

    /// Killed: no shutdown, its claims and slots lapse with their leases.
    fn kill(&self) {
        if let Ok(mut g) = self.inbox.lock() {
            *g = None;
        }
        if let Some(h) = self.running.lock().ok().and_then(|mut g| g.take()) {
            h.abort();
        }
    }
}

/// Submits `plan` (callback URL, kind) through `POST /tasks` at 10 a second from `from`, with
/// idempotency keys (a careful client retries through the relay's restart); returns the task
/// reference of each, with its receiver path.
fn submit_all(
    w: &World,
    clock: Arc<dyn Clock>,
    plan: Vec<(String, CaptchaKind)>,
    prefix: &'static str,
) -> Arc<Mutex<BTreeMap<String, String>>> {
    let submitted: Arc<Mutex<BTreeMap<String, String>>> = Arc::default();
    let (sub, base, key) = (submitted.clone(), w.base.clone(), w.api_key.clone());
    let http = reqwest::Client::new();
    let busy = clock.busy();
    tokio::spawn(async move {
        let _busy = busy;
        let start = clock.now();
        for (n, (url, kind)) in plan.into_iter().enumerate() {
            if n % 10 == 0 {
                clock.sleep_until(start.plus(Duration::from_secs(n as u64 / 10))).await;
            }
            let mut body: serde_json::Value =
                serde_json::from_str(relay_shared::testkit::body_for(kind)).unwrap_or_default();
            body["callback_url"] = serde_json::Value::String(url.clone());
            for _ in 0..30 {
                let r = http
                    .post(format!("{base}/tasks"))
                    .bearer_auth(&key)
                    .header("content-type", "application/json")
                    .header("idempotency-key", format!("{prefix}-{n}"))
                    .body(body.to_string())
                    .send()
                    .await;
                if let Ok(r) = r
                    && r.status().as_u16() == 202
                {
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    let path = url.split_once("://").and_then(|(_, r)| r.find('/').map(|i| r[i..].to_owned()));
                    if let (Some(t), Some(p), Ok(mut s)) = (v["task_ref"].as_str(), path, sub.lock()) {
                        s.insert(t.to_owned(), p);
                    }
                    break;
                }
                clock.sleep_until(clock.now().plus(Duration::from_secs(1))).await;
            }
        }
    });
    submitted
}

async fn stored(store: &TaskStore, submitted: &BTreeMap<String, String>) -> anyhow::Result<Vec<(Task, String)>> {
    let mut out = Vec::new();
    for (r, path) in submitted {
        let task = store.tasks().get(&TaskRef::parse(r)?).await?.ok_or_else(|| anyhow::anyhow!("{r} is gone"))?;
        out.push((task, path.clone()));
    }
    Ok(out)
}

const TOKEN_PATTERNS: [(&str, usize); 9] = [
    ("ok", 150),
    ("once", 50),
    ("limited2", 50),
    ("slow", 50),
    ("reset", 50),
    ("redirect", 50),
    ("gone", 30),
    ("slow7", 40),
    ("large", 30),
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_token_reaches_a_failing_owner_alive_through_a_kill() -> anyhow::Result<()> {
    let inbox: Arc<Mutex<Option<Inbox>>> = Arc::default();
    let opts = Options { push_notifier: Some(Worker::notifier(&inbox)), ..Options::default() };
    let w =
        Arc::new(World::start_with(FakeConfig { drop_callbacks: 0.2, ..FakeConfig::captchaai_like() }, opts).await?);
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let receiver = Receiver::start(clock.clone()).await?;
    let (_, secret) = WebhookSecret::generate();
    let (stop, _) = tokio::sync::watch::channel(false);
    let worker = Arc::new(Worker {
        clock: clock.clone(),
        store: w.store.clone(),
        secret: secret.clone(),
        settings: template_settings()?,
        inbox,
        running: Mutex::default(),
        stop,
    });
    w.schedule_poller(EPOCH);
    worker.start()?;
    let kinds =
        [CaptchaKind::RecaptchaV2, CaptchaKind::Turnstile, CaptchaKind::RecaptchaEnterprise, CaptchaKind::Image];
    let plan: Vec<(String, CaptchaKind)> = TOKEN_PATTERNS
        .iter()
        .flat_map(|(p, n)| (0..*n).map(move |i| ((*p).to_owned(), i)))
        .enumerate()
        .map(|(k, (p, i))| (format!("{}/{p}/{i}", receiver.base_url), kinds[k % kinds.len()]))
        .collect();
    let total = plan.len();
    let submitted = submit_all(&w, clock.clone(), plan, "clock");
    {
        // 40 s in — submits, pingbacks, polls and pushes in flight — the relay is killed: its
        // connections cut, the poller and the delivery worker aborted where they stand. It comes
        // back 5 s later on the same store.
        let (clock, worker) = (clock.clone(), worker.clone());
        let w2 = w.clone();
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(EPOCH.plus(Duration::from_secs(40))).await;
            worker.kill();
            w2.kill_and_restart(Duration::from_secs(5)).await;
            let _ = worker.start();
        });
    }
    w.run_for(Duration::from_secs(15 * 60)).await;
    worker.kill();

    let submitted = submitted.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(submitted.len(), total, "every task was accepted");
    let tasks = stored(&w.store, &submitted).await?;
    for (t, p) in &tasks {
        assert!(t.state.is_final(), "{} ({p}) is still {}", t.task_ref, t.state.name());
    }
    let hits = receiver.hits();
    let mut c = check_pushes(&tasks, &hits, Duration::from_secs(180));
    let answers = verify_with_reference(&secret, &hits)?;
    let failed: Vec<&String> = answers.iter().filter(|a| *a != "ok").collect();
    let (p50, p95, max) = p50_p95_max(&mut c.record_to_2xx_ms);
    let (l50, _, _) = p50_p95_max(&mut c.life_left_ms);
    let l_min = c.life_left_ms.first().copied().unwrap_or(0);
    let host = w.store.pushes().host_record(&receiver.base_url.replace("http://", "")).await?;
    println!("| tasks (all terminal) / of them fresh tokens when recorded | {} / {} |", c.tasks, c.fresh_at_record);
    println!(
        "| delivered / gone (410) / still owed / over 180 s | {} / {} / {} / {} |",
        c.delivered,
        c.gone,
        c.owed.len(),
        c.late.len()
    );
    println!("| fresh when recorded, pushed after the token died | {} |", c.pushed_after_death.len());
    println!("| record → owner's 2xx (s): p50 / p95 / max | {:.1} / {:.1} / {:.1} |", ms(p50), ms(p95), ms(max));
    println!("| token life left when the owner got it (s): p50 / min | {:.0} / {:.0} |", ms(l50), ms(l_min));
    println!(
        "| requests at the receiver / 2xx repeats (same webhook-id) / tasks under more than one webhook-id | {} / {} / {} |",
        c.requests, c.repeats, c.extra_ids
    );
    println!(
        "| signatures verified by the standardwebhooks library | {} of {} |",
        answers.len() - failed.len(),
        hits.len()
    );
    println!("| the host's adaptive limit at the end | {:?} |", host.limit);
    for line in c.owed.iter().chain(&c.late).chain(&c.pushed_after_death).take(20) {
        eprintln!("{line}");
    }
    assert!(c.owed.is_empty(), "{} pushes still owed", c.owed.len());
    assert!(c.late.is_empty(), "{} pushes took over 180 s", c.late.len());
    assert!(c.pushed_after_death.is_empty(), "{} tokens reached the owner dead", c.pushed_after_death.len());
    assert_eq!((c.delivered, c.gone), (total - 30, 30));
    assert!(c.fresh_at_record >= total * 7 / 10, "most results carried live tokens: {}", c.fresh_at_record);
    assert_eq!(c.extra_ids, 0, "one result, one webhook-id");
    assert!(failed.is_empty(), "refused by the reference library: {:?}", &failed[..failed.len().min(5)]);
    assert_eq!(answers.len(), hits.len());
    // Each failing pattern's first request really failed, and its retry went out at once.
    for p in ["once", "limited2", "slow", "reset", "redirect"] {
        let first_fail = hits.iter().filter(|h| h.path.starts_with(&format!("/{p}/")) && h.answered != 200).count();
        assert!(first_fail >= 45, "/{p}/: {first_fail} failed first requests");
    }
    Ok(())
}

fn ms(v: u64) -> f64 {
    v as f64 / 1000.0
}

const PATTERNS: [(&str, usize); 6] =
    [("ok", 700), ("flaky", 100), ("limited", 80), ("slow", 20), ("gone", 50), ("never", 50)];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_results_reach_a_failing_receiver_or_are_parked_and_listed() -> anyhow::Result<()> {
    let inbox: Arc<Mutex<Option<Inbox>>> = Arc::default();
    let opts = Options { push_notifier: Some(Worker::notifier(&inbox)), ..Options::default() };
    let w = World::start_with(FakeConfig { drop_callbacks: 0.3, ..FakeConfig::captchaai_like() }, opts).await?;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let receiver = Receiver::start(clock.clone()).await?;
    // The slow ones go to `localhost`: another host for the per-host limits, as a slow owner
    // endpoint would be.
    let local = receiver.base_url.replace("127.0.0.1", "localhost");
    let (_, secret) = WebhookSecret::generate();
    let settings = template_settings()?;
    let (stop, _) = tokio::sync::watch::channel(false);
    let worker = Arc::new(Worker {
        clock: clock.clone(),
        store: w.store.clone(),
        secret: secret.clone(),
        settings: settings.clone(),
        inbox,
        running: Mutex::default(),
        stop,
    });
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
    worker.start()?;
    let plan: Vec<(String, CaptchaKind)> = PATTERNS
        .iter()
        .flat_map(|(p, n)| (0..*n).map(move |i| ((*p).to_owned(), i)))
        .enumerate()
        .map(|(k, (p, i))| {
            let kind = [
                CaptchaKind::RecaptchaV2,
                CaptchaKind::Turnstile,
                CaptchaKind::Image,
                CaptchaKind::RecaptchaEnterprise,
            ][k % 4];
            let base = if p == "slow" { &local } else { &receiver.base_url };
            (format!("{base}/{p}/{i}"), kind)
        })
        .collect();
    let submitted = submit_all(&w, clock.clone(), plan, "dlv");
    {
        // At 3 minutes the worker is killed mid-way (its claims lapse with their leases) and
        // started again 30 s later as a new process would be; at 10 minutes the receiver is back.
        let (clock, worker, rcv) = (clock.clone(), worker.clone(), receiver.clone());
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(EPOCH.plus(Duration::from_secs(180))).await;
            worker.kill();
            clock.sleep_until(EPOCH.plus(Duration::from_secs(210))).await;
            let _ = worker.start();
            clock.sleep_until(EPOCH.plus(Duration::from_secs(600))).await;
            rcv.set_down(false);
        });
    }
    // Long enough for the whole standard schedule (the expired notice at the token's death,
    // then 5 s, 5 min, 30 min, 2 h, 5 h, 10 h, +20 % jitter).
    let real = std::time::Instant::now();
    w.run_for(Duration::from_secs(22 * 3600)).await;
    worker.kill();
    eprintln!("22 h simulated in {:?}", real.elapsed());

    let submitted = submitted.lock().map(|s| s.clone()).unwrap_or_default();
    assert_eq!(submitted.len(), 1000, "every task was accepted");
    let hits = receiver.hits();
    let parked = relay_ops::deliveries::list(&w.store, EPOCH, w.clock.now(), 10_000).await?;
    let parked_refs: BTreeSet<String> = parked.iter().map(|p| p.task_ref.clone()).collect();
    let tasks = stored(&w.store, &submitted).await?;
    let mut parked_n = 0;
    for (task, path) in &tasks {
        assert!(task.state.is_final(), "{} is still {}", task.task_ref, task.state.name());
        let d = task.delivery.clone().unwrap_or_default();
        if d.status == DeliveryStatus::Parked {
            parked_n += 1;
            assert!(path.starts_with("/never/"), "{}: parked from {path}", task.task_ref);
            assert!(parked_refs.contains(task.task_ref.as_ref()), "{} is parked but not listed", task.task_ref);
            assert_eq!(d.failures.standard + 1, settings.max_attempts, "{} parked after {d:?}", task.task_ref);
        }
    }
    let never: Vec<(Task, String)> = tasks.iter().filter(|(_, p)| !p.starts_with("/never/")).cloned().collect();
    let mut c = check_pushes(&never, &hits, Duration::from_secs(22 * 3600));
    let answers = verify_with_reference(&secret, &hits)?;
    let failed: Vec<&String> = answers.iter().filter(|a| *a != "ok").collect();
    let (p50, p95, max) = p50_p95_max(&mut c.record_to_2xx_ms);
    println!("| tasks (all terminal) | 1000 |");
    println!(
        "| delivered / gone (410) / parked and listed / still owed | {} / {} / {parked_n} / {} |",
        c.delivered,
        c.gone,
        c.owed.len()
    );
    println!(
        "| requests at the receiver / answered 2xx more than once (same webhook-id) | {} / {} |",
        c.requests, c.repeats
    );
    println!("| tasks pushed under more than one webhook-id | {} |", c.extra_ids);
    println!(
        "| signatures verified by the standardwebhooks library | {} of {} |",
        answers.len() - failed.len(),
        hits.len()
    );
    println!(
        "| record → first 2xx at the receiver (s): p50 / p95 / max | {} / {} / {} |",
        p50 / 1000,
        p95 / 1000,
        max / 1000
    );
    for line in c.owed.iter().take(20) {
        eprintln!("{line}");
    }
    assert!(c.owed.is_empty(), "every push is delivered, gone or parked");
    assert_eq!(c.gone, 50);
    assert_eq!(parked_n, 50, "only the endpoint that never recovers is parked");
    assert_eq!(c.delivered, 900);
    assert_eq!(c.extra_ids, 0, "one result, one webhook-id");
    assert!(failed.is_empty(), "signatures the reference library refused: {:?}", &failed[..failed.len().min(5)]);
    assert_eq!(answers.len(), hits.len());
    // Replay: every parked push goes out again (same webhook-id), and is parked again.
    let replayed = relay_ops::deliveries::replay_parked(&w.store, EPOCH, w.clock.now(), 10_000, w.clock.now()).await?;
    assert_eq!(replayed.replayed.len(), 50);
    let before = receiver.hits().len();
    let d = Arc::new(Deliverer::new(
        w.store.clone(),
        KeySource::new(SigningKeys::parse_list(&secret)?, Some(w.store.clone())),
        settings,
    )?);
    let (c2, busy) = (clock.clone(), clock.busy());
    let deadline = w.clock.now().plus(Duration::from_secs(55));
    // On the clock, as every worker runs: the host's spacing waits on it.
    let sweep = tokio::spawn(async move { d.sweep_held(c2, deadline, busy).await.0 });
    // A stalled simulated clock (a busy guard held while everything else sleeps on it) fails
    // here in real time instead of hanging the test command.
    tokio::time::timeout(Duration::from_secs(300), w.run_for(Duration::from_secs(60)))
        .await
        .map_err(|_| anyhow::anyhow!("the replay's minute did not pass in 300 s of real time: the clock stalled"))?;
    let report = sweep.await?;
    eprintln!("replayed in {:?}", real.elapsed());
    assert!(report.retried >= 50, "{report:?}");
    let again: BTreeSet<String> = receiver.hits()[before..].iter().map(|h| h.path.clone()).collect();
    assert_eq!(again.len(), 50, "every parked push was sent again");
    assert!(again.iter().all(|p| p.starts_with("/never/")));
    Ok(())
}

/// The scheduled sweep is the net for pushes whose stream record or retry message met a store
/// failure, and those carry tokens with a minute or two to live: a sweep that meets the store's
/// trouble must keep looking through its invocation, not leave them to the next one a minute
/// later. Here every store call fails for the sweep's first 5 s; the same invocation (the
/// template's timeout, less the margin the handler keeps) must still push every result, alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_that_meets_a_store_outage_keeps_going_through_its_invocation() -> anyhow::Result<()> {
    let opts = Options { flaky_relay_store: true, ..Options::default() };
    let w = World::start_with(FakeConfig { drop_callbacks: 0.0, ..FakeConfig::captchaai_like() }, opts).await?;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let receiver = Receiver::start(clock.clone()).await?;
    let (_, secret) = WebhookSecret::generate();
    let plan: Vec<(String, CaptchaKind)> =
        (0..20).map(|i| (format!("{}/ok/{i}", receiver.base_url), CaptchaKind::Turnstile)).collect();
    let submitted = submit_all(&w, clock.clone(), plan, "outage");
    // No worker runs: every result waits, due, in the index.
    let mut tasks = Vec::new();
    for _ in 0..60 {
        w.run_for(Duration::from_secs(5)).await;
        let s = submitted.lock().map(|s| s.clone()).unwrap_or_default();
        tasks = stored(&w.store, &s).await?;
        if s.len() == 20 && tasks.iter().all(|(t, _)| t.state.is_final()) {
            break;
        }
    }
    assert_eq!(tasks.len(), 20, "every task was accepted");
    for (t, _) in &tasks {
        assert!(t.state.is_final(), "{} is still {}", t.task_ref, t.state.name());
        assert_eq!(t.delivery.clone().unwrap_or_default().status, DeliveryStatus::Pending, "{}", t.task_ref);
    }
    assert!(receiver.hits().is_empty(), "nothing pushed before the sweep");

    let flaky = w.flaky.as_ref().ok_or_else(|| anyhow::anyhow!("no fault injector"))?;
    let store = flaky.store(w.store.table()).with_shards(w.store.shards()).with_queue_shards(w.store.queue_shards());
    let d = Arc::new(Deliverer::new(
        store.clone(),
        KeySource::new(SigningKeys::parse_list(&secret)?, Some(store)),
        template_settings()?,
    )?);
    flaky.set_failing(true);
    let start = w.clock.now();
    let deadline = start.plus(w.deployed.delivery_timeout.saturating_sub(relay_shared::delivery::SWEEP_END_MARGIN));
    let (c2, busy) = (clock.clone(), clock.busy());
    let sweep = tokio::spawn(async move { d.sweep_held(c2, deadline, busy).await.0 });
    // The world runs the invocation's minute; the store heals after 5 s.
    while w.clock.now() < start.plus(Duration::from_secs(60)) {
        tokio::time::timeout(Duration::from_secs(120), w.run_for(Duration::from_secs(1)))
            .await
            .map_err(|_| anyhow::anyhow!("the sweep's minute stalled"))?;
        if w.clock.now() >= start.plus(Duration::from_secs(5)) {
            flaky.set_failing(false);
        }
    }
    let report = sweep.await?;
    eprintln!("{report:?}; calls failed {}", flaky.calls_failed());
    assert!(flaky.calls_failed() > 0 && report.errors > 0, "the outage reached the sweep: {report:?}");
    assert_eq!(report.delivered, 20, "the same invocation pushed every result: {report:?}");
    let s = submitted.lock().map(|s| s.clone()).unwrap_or_default();
    let c = check_pushes(&stored(&w.store, &s).await?, &receiver.hits(), Duration::from_secs(300));
    assert_eq!(c.delivered, 20, "{:?}", c.owed);
    assert!(c.pushed_after_death.is_empty(), "{:?}", c.pushed_after_death);
    Ok(())
}

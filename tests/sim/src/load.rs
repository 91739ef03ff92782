//! The load simulation (issue 25): the whole relay path at a steady rate on the simulated clock,
//! against the embedded engine behind a model of DynamoDB's per-partition limits
//! ([`crate::partitions::PartitionMeter`]).
//!
//! Owners submit `rate` tasks a second — through `POST /tasks` (half of them with a callback URL
//! on an owner receiver) and through the 2captcha-compatible `/in.php` — for `duration`; the
//! submitter releases the queue to the CaptchaAI-like fake, whose pingbacks reach the callback
//! route except for a dropped share the scheduled poller must fetch; the delivery worker pushes
//! every result with a callback URL to the receiver. In the middle, a minute in which every
//! partition key's limits are cut (a throttling burst), and a spell in which the store fails
//! every result write (the callback dead-letters them; the redrive loop applies them later).
//! Then everything is checked against what the fake did and the receiver got.
//!
//! The settings are the template's, except what a user at this rate must set ([`settings_for`]).

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use fake_captchaai::FakeConfig;
use relay_shared::delivery::{Deliverer, DeliverySettings, Inbox, KeySource};
use relay_shared::domain::{CaptchaKind, Task, TaskRef, TaskState};
use relay_shared::store::PushNotifier;
use relay_shared::testkit::receiver::{Receiver, check_pushes};
use relay_shared::webhook::{SigningKeys, UrlPolicy, WebhookSecret};
use relay_time::Clock;

use crate::partitions::{MeterReport, RCU_PER_KEY, WCU_PER_KEY};
use crate::{EPOCH, Options, World, body_for, percentile};

/// The documented run's rate: 10 × the relay's old ceiling, when in.php submits were clamped to
/// 15 a second whatever the plan (issue 25). One CaptchaAI key at a pace of 188/s.
pub const FULL_RATE: u32 = 150;

/// What the run does. [`LoadConfig::full`] is the documented run, [`LoadConfig::short`] CI's.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// Tasks submitted per simulated second.
    pub rate: u32,
    /// How long the owners submit.
    pub duration: Duration,
    /// Time after the last submit for everything to finish.
    pub drain: Duration,
    /// Share of tasks submitted through `/in.php` (the rest through `POST /tasks`).
    pub in_php_share: f64,
    /// Share of `POST /tasks` submits that carry a callback URL (pushed by the delivery worker).
    pub callback_share: f64,
    /// Share of pingbacks CaptchaAI never sends (the poller fetches those results).
    pub drop_callbacks: f64,
    /// Share of tasks CaptchaAI cannot solve.
    pub unsolvable: f64,
    /// CaptchaAI's solve time (every task; the thread plan is sized from it).
    pub solve: Duration,
    /// The throttling burst: from (offset), for, every key's limits scaled by.
    pub throttle: Option<(Duration, Duration, f64)>,
    /// The dead-letter episode: every result write fails, from (offset), for.
    pub result_write_outage: Option<(Duration, Duration)>,
    pub seed: u64,
    /// Where local mode keeps its dead letters.
    pub data_dir: std::path::PathBuf,
    /// Print a progress line every this much simulated time.
    pub progress_every: Option<Duration>,
    /// The clock moves at least this far at a time (zero: exactly to the next wake-up). A
    /// wait may end up to this much late; in return, the many wake-ups a busy second holds are
    /// served together, which is where a run's real time goes (see tests/sim/LOAD.md).
    pub step: Duration,
}

impl LoadConfig {
    /// `rate` tasks a second for `duration`, the burst and the outage placed at the same
    /// fractions of the run.
    pub fn scaled(rate: u32, duration: Duration) -> Self {
        let at = |f: f64| duration.mul_f64(f);
        Self {
            rate,
            duration,
            drain: Duration::from_secs(240),
            in_php_share: 0.25,
            callback_share: 0.5,
            drop_callbacks: 0.1,
            unsolvable: 0.01,
            solve: Duration::from_secs(12),
            // A minute at 2 % of DynamoDB's limits (20 WCU/s, 60 RCU/s a key): the hot keys are
            // refused, every writer backs off and retries.
            throttle: Some((at(0.5), Duration::from_secs(60).min(duration / 4), 0.02)),
            result_write_outage: Some((at(0.3), Duration::from_secs(20).min(duration / 8))),
            seed: 7,
            data_dir: std::env::temp_dir().join(format!("relay-load-{}-{}", std::process::id(), rate)),
            progress_every: None,
            step: Duration::from_millis(50),
        }
    }

    /// The documented run: [`FULL_RATE`] for one simulated hour.
    pub fn full() -> Self {
        Self::scaled(FULL_RATE, Duration::from_secs(3600))
    }

    /// CI's run: 10 tasks/s for one simulated minute, every episode included.
    pub fn short() -> Self {
        let base = Self::scaled(10, Duration::from_secs(60));
        // At 10 tasks/s the busiest key takes well under 20 WCU/s since the state item's writes
        // were cut (one per admission, the submitter's once a tick): the burst cuts to 0.5 %
        // (5 WCU/s, 15 RCU/s a key) so that it still refuses the hot keys.
        let throttle = base.throttle.map(|(at, len, _)| (at, len, 0.005));
        Self { drain: Duration::from_secs(240), throttle, ..base }
    }
}

/// The settings a user at `rate` tasks/s sets on top of the template's, and why.
pub fn settings_for(cfg: &LoadConfig) -> Vec<(String, String, String)> {
    let rate = f64::from(cfg.rate);
    let max_pace = relay_shared::submit::MAX_SUBMITS_PER_SECOND;
    let pace = ((rate * 1.25).ceil() as u32).clamp(1, max_pace);
    let threads = threads_for(cfg);
    // Results the poller must fetch a second: the dropped pingbacks, read once or twice.
    let reads = ((rate * cfg.drop_callbacks * 2.5).ceil() as u32).clamp(10, 50);
    // Each task writes an index key about 3 times; half of DynamoDB's 1,000 writes/s per key.
    let shards = ((rate * 3.0 / 500.0).ceil() as u32).clamp(u32::from(relay_shared::store::DEFAULT_POLL_SHARDS), 64);
    vec![
        (
            "SUBMITS_PER_SECOND".into(),
            pace.to_string(),
            format!(
                "the in.php pace must exceed the arrival rate ({rate}/s) or the queue only grows (capped at {max_pace})"
            ),
        ),
        (
            "CAPTCHAAI_THREADS".into(),
            threads.to_string(),
            "the plan's threads: rate x solve time x 1.5 (the fake's plan)".into(),
        ),
        (
            "POLL_REQUESTS_PER_SECOND".into(),
            reads.to_string(),
            format!("the dropped pingbacks ({:.0} %) must be fetched as fast as they come", 100.0 * cfg.drop_callbacks),
        ),
        (
            "POLL_MAX_READS_PER_INVOCATION".into(),
            (reads * 75).to_string(),
            "the safety cap must not stop an invocation before its period ends at that rate".into(),
        ),
        (
            "POLL_SHARDS".into(),
            shards.to_string(),
            "index keys kept below half of 1,000 WCU/s at 3 writes a task".into(),
        ),
    ]
}

fn threads_for(cfg: &LoadConfig) -> u32 {
    (f64::from(cfg.rate) * cfg.solve.as_secs_f64() * 1.5).ceil() as u32
}

/// The delivery settings: the template's defaults, with the per-host rate and concurrency at
/// twice the pushes a second this run makes to its one owner host (the defaults, 50/s and 64,
/// serve a smaller user).
fn delivery_settings(cfg: &LoadConfig) -> DeliverySettings {
    let pushes = f64::from(cfg.rate) * (1.0 - cfg.in_php_share) * cfg.callback_share;
    let d = DeliverySettings::default();
    DeliverySettings {
        per_host_per_second: d.per_host_per_second.max((pushes * 2.0).ceil() as u32),
        per_host_concurrency: d.per_host_concurrency.max((pushes * 2.0).ceil() as u32),
        policy: UrlPolicy::AllowLoopback,
        ..d
    }
}

/// One task an owner submitted and the relay accepted.
#[derive(Debug, Clone)]
struct Submitted {
    task_ref: TaskRef,
    /// The receiver path its push goes to, if it has a callback URL.
    path: Option<String>,
}

#[derive(Debug, Default)]
struct Owners {
    submitted: Vec<Submitted>,
    attempted: u64,
    /// Submits the relay never accepted (after the client's retries).
    refused: u64,
    /// Answers that said "later" (429/503 with `retry_safe`), each retried.
    pushed_back: u64,
}

/// What the run found.
#[derive(Debug, Clone, Default)]
pub struct LoadReport {
    pub rate: u32,
    pub settings: Vec<(String, String, String)>,
    pub attempted: u64,
    pub accepted: usize,
    pub refused: u64,
    pub pushed_back: u64,
    pub solved: usize,
    pub failed: usize,
    pub open: usize,
    pub lost: usize,
    pub lost_refs: Vec<String>,
    pub double_paid: usize,
    pub with_callback: usize,
    pub delivered: usize,
    pub owed: Vec<String>,
    pub record_to_push_ms: Vec<f64>,
    /// Per push that carried a token: its life left when the owner's receiver got it, ms.
    pub life_left_ms: Vec<f64>,
    /// Tokens fresh when recorded whose first accepted push came after they died.
    pub pushed_after_death: Vec<String>,
    pub res_php: u64,
    pub in_php: u64,
    pub bans: u64,
    pub by_poll: usize,
    pub by_redrive: usize,
    pub dead_letter_faults: u64,
    pub meter: MeterReport,
    pub sim_time: Duration,
    pub real_time: Duration,
    /// Real time of the submitting part alone.
    pub real_submit_time: Duration,
    /// Times the simulated clock moved.
    pub clock_steps: u64,
    /// Times it was moved on past a stall of the harness's accounting (`ManualClock::nudges`).
    pub nudges: u64,
}

impl LoadReport {
    /// Tasks accepted per second of real time (the whole run, checks excluded).
    pub fn real_rate(&self) -> f64 {
        self.accepted as f64 / self.real_time.as_secs_f64().max(1e-9)
    }

    /// DynamoDB requests per accepted task, by operation and target.
    pub fn ops_per_task(&self) -> BTreeMap<String, f64> {
        let n = self.accepted.max(1) as f64;
        self.meter.ops.iter().map(|(k, v)| (k.clone(), *v as f64 / n)).collect()
    }

    /// What broke, if anything.
    pub fn violations(&self) -> Vec<String> {
        let mut v = Vec::new();
        if self.refused > 0 {
            v.push(format!("{} submits never accepted", self.refused));
        }
        if self.open > 0 {
            v.push(format!("{} tasks not final", self.open));
        }
        if self.lost > 0 {
            v.push(format!("{} results lost: {:?}", self.lost, &self.lost_refs[..self.lost_refs.len().min(5)]));
        }
        if self.double_paid > 0 {
            v.push(format!("{} tasks paid twice", self.double_paid));
        }
        if !self.owed.is_empty() {
            v.push(format!("{} pushes owed: {:?}", self.owed.len(), &self.owed[..self.owed.len().min(3)]));
        }
        if !self.pushed_after_death.is_empty() {
            v.push(format!(
                "{} tokens pushed after they died: {:?}",
                self.pushed_after_death.len(),
                &self.pushed_after_death[..self.pushed_after_death.len().min(3)]
            ));
        }
        if self.bans > 0 {
            v.push(format!("{} CaptchaAI bans", self.bans));
        }
        for k in self.meter.keys_over_limit() {
            v.push(format!("partition key over its limit: {k}"));
        }
        v
    }

    /// Keys throttled outside the burst are what the limit check is about: inside it, every key
    /// at a tenth of its limit is meant to be refused.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let p = |q: f64| percentile(&self.record_to_push_ms, q) / 1000.0;
        out.push_str(&format!(
            "| tasks submitted / accepted / refused (after retries) / answered 'later' | {} / {} / {} / {} |\n",
            self.attempted, self.accepted, self.refused, self.pushed_back
        ));
        out.push_str(&format!(
            "| solved / failed (CaptchaAI's verdict) / not final | {} / {} / {} |\n",
            self.solved, self.failed, self.open
        ));
        out.push_str(&format!(
            "| recovered by the poller / by the redrive | {} / {} |\n",
            self.by_poll, self.by_redrive
        ));
        out.push_str(&format!("| lost / paid twice | {} / {} |\n", self.lost, self.double_paid));
        out.push_str(&format!(
            "| pushes owed (tasks with a callback: delivered / owed) | {} ({} / {}) |\n",
            self.owed.len(),
            self.delivered,
            self.owed.len()
        ));
        out.push_str(&format!(
            "| record -> push (receiver 2xx), s: p50 / p99 / max | {:.1} / {:.1} / {:.1} |\n",
            p(50.0),
            p(99.0),
            p(100.0)
        ));
        out.push_str(&format!(
            "| token life left at the owner, s: p50 / p1 / min (pushed after death) | {:.1} / {:.1} / {:.1} ({}) |\n",
            percentile(&self.life_left_ms, 50.0) / 1000.0,
            percentile(&self.life_left_ms, 1.0) / 1000.0,
            percentile(&self.life_left_ms, 0.0) / 1000.0,
            self.pushed_after_death.len()
        ));
        out.push_str(&format!(
            "| res.php requests per task / in.php calls per task / bans | {:.3} / {:.3} / {} |\n",
            self.res_php as f64 / self.accepted.max(1) as f64,
            self.in_php as f64 / self.accepted.max(1) as f64,
            self.bans
        ));
        if let Some((k, pk)) = self.meter.hottest_write() {
            out.push_str(&format!(
                "| max WCU per partition key per second (limit {WCU_PER_KEY:.0}) | {:.0} on {k} at +{} s |\n",
                pk.units,
                pk.second.saturating_sub(EPOCH.as_millis() / 1000)
            ));
        }
        if let Some((k, pk)) = self.meter.hottest_read() {
            out.push_str(&format!(
                "| max RCU per partition key per second (limit {RCU_PER_KEY:.0}) | {:.1} on {k} at +{} s |\n",
                pk.units,
                pk.second.saturating_sub(EPOCH.as_millis() / 1000)
            ));
        }
        out.push_str(&format!(
            "| throttled requests (all in the burst unless listed below) | {} |\n",
            self.meter.throttled_total()
        ));
        out.push_str(&format!(
            "| result writes failed on purpose (dead-letter episode) | {} |\n",
            self.dead_letter_faults
        ));
        let n = self.accepted.max(1) as f64;
        out.push_str(&format!(
            "| per task: WCU / of which index WCU / RCU / scans | {:.2} / {:.2} / {:.2} / {} |\n",
            self.meter.wcu / n,
            self.meter.index_wcu / n,
            self.meter.rcu / n,
            self.meter.scans
        ));
        out.push_str(&format!(
            "| simulated / real time | {:.0} s / {:.1} s ({:.1} tasks/s of real time; {} clock steps, {} nudged past a stall) |\n",
            self.sim_time.as_secs_f64(),
            self.real_time.as_secs_f64(),
            self.real_rate(),
            self.clock_steps,
            self.nudges
        ));
        out.push_str("\nDynamoDB requests per task (as sent, throttled ones included):\n");
        for (k, v) in self.ops_per_task() {
            out.push_str(&format!("  {k:<32} {v:.3}\n"));
        }
        out.push_str("\nhottest keys (peak units in one simulated second):\n");
        for (k, p) in self.meter.top_writes(8) {
            out.push_str(&format!(
                "  WCU {:>7.0}  {k}  (+{} s)\n",
                p.units,
                p.second.saturating_sub(EPOCH.as_millis() / 1000)
            ));
        }
        for (k, p) in self.meter.top_reads(4) {
            out.push_str(&format!(
                "  RCU {:>7.1}  {k}  (+{} s)\n",
                p.units,
                p.second.saturating_sub(EPOCH.as_millis() / 1000)
            ));
        }
        out.push_str("\nthe hottest key of each kind (peak WCU in one simulated second):\n");
        let mut kinds: std::collections::BTreeMap<String, (f64, String, u64)> = std::collections::BTreeMap::new();
        for (k, p) in &self.meter.max_wcu {
            let family = k.family();
            let family = family.split_once(" key=").map_or(family.clone(), |(index, _)| format!("{index} key=…"));
            let e = kinds.entry(family).or_insert((0.0, String::new(), 0));
            if p.units > e.0 {
                *e = (p.units, k.to_string(), p.second);
            }
        }
        let mut kinds: Vec<_> = kinds.into_iter().filter(|(f, _)| !f.contains("<task ref>")).collect();
        kinds.sort_by(|a, b| b.1.0.total_cmp(&a.1.0));
        for (family, (units, key, second)) in kinds.into_iter().take(12) {
            out.push_str(&format!(
                "  WCU {units:>7.0}  {family}: {key}  (+{} s)\n",
                second.saturating_sub(EPOCH.as_millis() / 1000)
            ));
        }
        out.push_str("\nwho writes the hottest shared keys (requests in the run, by code path):\n");
        for (k, p) in self.meter.top_writes(12).into_iter().filter(|(k, _)| self.meter.writers.contains_key(k)).take(5)
        {
            out.push_str(&format!("  {k} (peak {:.0} WCU/s):\n", p.units));
            let mut w: Vec<(&String, &u64)> =
                self.meter.writers.get(&k).map(|m| m.iter().collect()).unwrap_or_default();
            w.sort_by(|a, b| b.1.cmp(a.1));
            for (what, n) in w.into_iter().take(4) {
                out.push_str(&format!("    {:>6.2} per task  {what}\n", *n as f64 / self.accepted.max(1) as f64));
            }
        }
        let mut thr: Vec<(&crate::partitions::PartKey, &u64)> = self.meter.throttled.iter().collect();
        thr.sort_by(|a, b| b.1.cmp(a.1));
        if !thr.is_empty() {
            out.push_str("\nthrottled requests by key (in the injected minute / at DynamoDB's own limits):\n");
            for (k, n) in thr.iter().take(8) {
                let own = self.meter.throttled_at_full_limits.get(*k).copied().unwrap_or(0);
                out.push_str(&format!("  {:>7} / {own:>5}  {k}\n", **n - own));
            }
        }
        out.push_str("\nsettings on top of the template's:\n");
        for (k, v, why) in &self.settings {
            out.push_str(&format!("  {k}={v}: {why}\n"));
        }
        out
    }
}

const IN_PHP_FORM: &str = "method=turnstile&sitekey=0x4AAA&pageurl=https://shop.example/login";
const KINDS: [CaptchaKind; 4] =
    [CaptchaKind::Turnstile, CaptchaKind::RecaptchaV2, CaptchaKind::RecaptchaEnterprise, CaptchaKind::Image];

/// splitmix64: the owners' choices, repeatable by seed.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn chance(seed: u64, n: u64, salt: u64, p: f64) -> bool {
    (mix(seed ^ n.wrapping_mul(0x1000_0000_01B3) ^ salt) % 1_000_000) < (p * 1_000_000.0) as u64
}

/// One owner submit, as a careful client sends it: with an idempotency key (`POST /tasks`),
/// again after `Retry-After` when told to come back later.
/// Where the owners send: the relay's base URL and their key.
struct Endpoint {
    http: reqwest::Client,
    base: String,
    key: String,
}

async fn submit_one(
    to: &Endpoint,
    n: u64,
    in_php: bool,
    callback: Option<String>,
    clock: &dyn Clock,
    owners: &Mutex<Owners>,
) {
    let (http, base, key) = (&to.http, &to.base, &to.key);
    for _ in 0..60 {
        let wait = if in_php {
            let r = http
                .post(format!("{base}/in.php"))
                .header("content-type", "application/x-www-form-urlencoded")
                .body(format!("key={key}&{IN_PHP_FORM}"))
                .send()
                .await;
            match r {
                Ok(r) => {
                    let text = r.text().await.unwrap_or_default();
                    if let Some(r) = text.strip_prefix("OK|").and_then(|id| TaskRef::from_compat_id(id).ok()) {
                        if let Ok(mut o) = owners.lock() {
                            o.submitted.push(Submitted { task_ref: r, path: None });
                        }
                        return;
                    }
                    // ERROR_NO_SLOT_AVAILABLE and the like: a 2captcha client waits and sends again.
                    Duration::from_secs(5)
                }
                Err(_) => Duration::from_secs(5),
            }
        } else {
            let kind = KINDS[(n % KINDS.len() as u64) as usize];
            let mut body: serde_json::Value = serde_json::from_str(body_for(kind)).unwrap_or_default();
            let path = callback
                .as_ref()
                .and_then(|url| url.split_once("://").and_then(|(_, r)| r.find('/').map(|i| r[i..].to_owned())));
            if let Some(url) = &callback {
                body["callback_url"] = serde_json::Value::String(url.clone());
            }
            let r = http
                .post(format!("{base}/tasks"))
                .bearer_auth(key)
                .header("content-type", "application/json")
                .header("idempotency-key", format!("load-{n}"))
                .body(body.to_string())
                .send()
                .await;
            match r {
                Ok(r) => {
                    let status = r.status().as_u16();
                    let after: Option<u64> =
                        r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
                    let v: serde_json::Value = r.json().await.unwrap_or_default();
                    if let Ok(t) = TaskRef::parse(v["task_ref"].as_str().unwrap_or_default())
                        && status == 202
                    {
                        if let Ok(mut o) = owners.lock() {
                            o.submitted.push(Submitted { task_ref: t, path });
                        }
                        return;
                    }
                    if !(matches!(status, 429 | 503) && v["error"]["retry_safe"] == true) {
                        tracing::error!(status, %v, "submit refused");
                        break;
                    }
                    Duration::from_secs(after.unwrap_or(5))
                }
                Err(_) => Duration::from_secs(5),
            }
        };
        if let Ok(mut o) = owners.lock() {
            o.pushed_back += 1;
        }
        clock.sleep_until(clock.now().plus(wait)).await;
    }
    if let Ok(mut o) = owners.lock() {
        o.refused += 1;
    }
}

/// The delivery worker of local mode, told of each result by the store.
fn start_delivery(
    w: &World,
    inbox: &Arc<Mutex<Option<Inbox>>>,
    secret: &str,
    settings: DeliverySettings,
    stop: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<tokio::task::JoinHandle<relay_shared::delivery::SweepReport>> {
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let (ibx, rx) = Inbox::new(clock.clone());
    let d = Deliverer::new(
        w.store.clone(),
        KeySource::new(SigningKeys::parse_list(secret)?, Some(w.store.clone())),
        settings,
    )?
    .with_wakeups(Arc::new(ibx.clone()));
    if let Ok(mut g) = inbox.lock() {
        *g = Some(ibx);
    }
    Ok(tokio::spawn(Arc::new(d).run(clock, rx, relay_local::run::DELIVERY_CATCH_UP, stop)))
}

/// Runs the simulation and measures it.
pub async fn run(cfg: &LoadConfig) -> anyhow::Result<LoadReport> {
    let real = Instant::now();
    let settings = settings_for(cfg);
    let shard_env = settings.iter().fold(relay_shared::config::Settings::default(), |s, (k, v, _)| s.with(k, v));
    // The store's shard count, read the way the functions read it.
    let shards = relay_shared::config::StoreConfig::from_settings(&shard_env.with("TABLE_NAME", "load"))?.shards;
    let inbox: Arc<Mutex<Option<Inbox>>> = Arc::default();
    let notifier = {
        let inbox = inbox.clone();
        PushNotifier::new(move |due| {
            if let Some(i) = inbox.lock().ok().and_then(|g| g.clone()) {
                i.send(due);
            }
        })
    };
    let _ = std::fs::remove_dir_all(&cfg.data_dir);
    let opts = Options {
        disk_queue: Some(cfg.data_dir.clone()),
        push_notifier: Some(notifier),
        partition_meter: Some(shards),
        settings: settings.iter().map(|(k, v, _)| (k.clone(), v.clone())).collect(),
        ..Options::default()
    };
    let fake = FakeConfig {
        threads: Some(threads_for(cfg)),
        solve_delay_ms: cfg.solve.as_millis() as u64,
        realistic_solve_times: false,
        drop_callbacks: cfg.drop_callbacks,
        unsolvable: cfg.unsolvable,
        seed: cfg.seed,
        // The fake's MAX_USER_TURN rule is 2captcha's 60 submits in 3 s; a plan that takes this
        // rate allows more (the relay paces itself at SUBMITS_PER_SECOND). The other ban rules
        // are off with it: `bans` below is then 0 by construction, and the NO_SLOT answers
        // are counted instead.
        enforce_bans: false,
        ..FakeConfig::captchaai_like()
    };
    let w = World::start_with(fake, opts).await?;
    let meter = w.meter.as_ref().context("the world has a partition meter")?;
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let receiver = Receiver::start(clock.clone()).await?;
    let (_, secret) = WebhookSecret::generate();
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    let worker = start_delivery(&w, &inbox, &secret, delivery_settings(cfg), stop_rx)?;
    w.schedule_poller(EPOCH);
    w.start_redrive_loop();

    // The owners: every 100 ms of simulated time, a tenth of the second's submits, at once.
    let owners: Arc<Mutex<Owners>> = Arc::default();
    {
        let (clock, owners, base, key, cfg) =
            (clock.clone(), owners.clone(), w.base.clone(), w.api_key.clone(), cfg.clone());
        let receiver_base = receiver.base_url.clone();
        let to =
            Arc::new(Endpoint { http: reqwest::Client::builder().pool_max_idle_per_host(256).build()?, base, key });
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            let ticks = cfg.duration.as_millis() as u64 / 100;
            let mut n = 0u64;
            for tick in 0..ticks {
                clock.sleep_until(EPOCH.plus(Duration::from_millis(100 * tick))).await;
                // This tick's share, without rounding drift.
                let due = (u64::from(cfg.rate) * (tick + 1)) / 10;
                while n < due {
                    let in_php = chance(cfg.seed, n, 1, cfg.in_php_share);
                    let callback = (!in_php && chance(cfg.seed, n, 2, cfg.callback_share))
                        .then(|| format!("{receiver_base}/ok/{n}"));
                    let (to, clock2, owners) = (to.clone(), clock.clone(), owners.clone());
                    if let Ok(mut o) = owners.lock() {
                        o.attempted += 1;
                    }
                    let busy = clock.busy();
                    tokio::spawn(async move {
                        let _busy = busy;
                        submit_one(&to, n, in_php, callback, clock2.as_ref(), &owners).await;
                    });
                    n += 1;
                }
            }
        });
    }
    // The throttling burst and the dead-letter episode.
    if let Some((at, len, factor)) = cfg.throttle {
        let (clock, m) = (clock.clone(), meter_handle(&w));
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(EPOCH.plus(at)).await;
            m(Episode::Throttle(factor));
            clock.sleep_until(EPOCH.plus(at + len)).await;
            m(Episode::Throttle(1.0));
        });
    }
    if let Some((at, len)) = cfg.result_write_outage {
        let (clock, m) = (clock.clone(), meter_handle(&w));
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(EPOCH.plus(at)).await;
            // The writes of solutions (the callback's, the poller's and the redrive's).
            m(Episode::FailResults(true));
            clock.sleep_until(EPOCH.plus(at + len)).await;
            m(Episode::FailResults(false));
        });
    }

    let end = EPOCH.plus(cfg.duration + cfg.drain);
    let step = cfg.progress_every.unwrap_or(cfg.duration + cfg.drain);
    let mut real_submit_time = Duration::ZERO;
    let mut steps = 0u64;
    let mut t = EPOCH;
    while t < end {
        t = t.plus(step).min(end);
        steps += run_until(&w.clock, t, cfg.step).await;
        if t <= EPOCH.plus(cfg.duration) {
            real_submit_time = real.elapsed();
        }
        if cfg.progress_every.is_some() {
            let (accepted, pushed_back) = owners.lock().map(|o| (o.submitted.len(), o.pushed_back)).unwrap_or_default();
            let r = meter.report();
            eprintln!(
                "+{:>5} s sim, {:>7.1} s real, {steps} clock steps: {accepted} accepted ({:.0}/s real), {pushed_back} told later, \
                 {} throttled, hottest write key {}",
                t.since(EPOCH).as_secs(),
                real.elapsed().as_secs_f64(),
                accepted as f64 / real.elapsed().as_secs_f64().max(1e-9),
                r.throttled_total(),
                r.hottest_write().map(|(k, p)| format!("{k} {:.0} WCU/s", p.units)).unwrap_or_default()
            );
        }
    }
    let real_time = real.elapsed();
    let _ = stop_tx.send(true);
    worker.abort();
    // What the relay did is counted; the checks below are the harness's own reads.
    meter.set_counting(false);
    let report_meter = meter.report();
    let dead_letter_faults = meter.faults();

    let owners = owners.lock().map(|mut o| std::mem::take(&mut *o)).unwrap_or_default();
    let mut r = LoadReport {
        rate: cfg.rate,
        settings,
        attempted: owners.attempted,
        accepted: owners.submitted.len(),
        refused: owners.refused,
        pushed_back: owners.pushed_back,
        meter: report_meter,
        dead_letter_faults,
        sim_time: w.clock.now().since(EPOCH),
        clock_steps: steps,
        nudges: w.clock.nudges(),
        real_time,
        real_submit_time,
        ..LoadReport::default()
    };
    check(&w, &receiver, &owners.submitted, &mut r).await?;
    Ok(r)
}

/// [`relay_time::ManualClock::run_until`], moving at least `step` at a time; returns how many
/// times the clock moved.
async fn run_until(clock: &relay_time::ManualClock, end: relay_time::Timestamp, step: Duration) -> u64 {
    let mut steps = 0;
    loop {
        clock.settle().await;
        match clock.next_wake() {
            Some(t) if t <= end => {
                clock.set(t.max(clock.now().plus(step)).min(end));
                steps += 1;
            }
            _ => {
                clock.set(end.max(clock.now()));
                clock.settle().await;
                return steps + 1;
            }
        }
    }
}

enum Episode {
    Throttle(f64),
    FailResults(bool),
}

/// A handle on the world's meter for an actor (the meter itself stays with the world).
fn meter_handle(w: &World) -> impl Fn(Episode) + Send + 'static {
    let endpoint = w.meter.as_ref().map(|m| m.control());
    move |e| {
        if let Some(c) = &endpoint {
            match e {
                Episode::Throttle(f) => c.set_limit_factor(f),
                Episode::FailResults(on) => c.set_failing_matching(on.then_some(":solution")),
            }
        }
    }
}

/// Checks every accepted task against the fake and the receiver.
async fn check(w: &World, receiver: &Receiver, submitted: &[Submitted], r: &mut LoadReport) -> anyhow::Result<()> {
    let fake_tasks = w.fake.tasks();
    // Tasks CaptchaAI took per task of ours (the signed pingback path names it): a second one
    // only for a stranded task sent again.
    let sends = relay_shared::testkit::sends(&w.store, fake_tasks.iter().filter_map(|t| t.pingback.as_deref())).await?;
    r.double_paid = sends.without_cause;
    let answers: HashMap<String, Option<String>> =
        fake_tasks.iter().map(|t| (t.id.to_string(), t.answer.clone())).collect();
    let mut tasks: Vec<Task> = Vec::with_capacity(submitted.len());
    for chunk in submitted.chunks(64) {
        let mut set = tokio::task::JoinSet::new();
        for s in chunk {
            let (store, t) = (w.store.clone(), s.task_ref.clone());
            set.spawn(async move { store.tasks().get(&t).await });
        }
        while let Some(got) = set.join_next().await {
            tasks.push(got??.context("a task vanished")?);
        }
    }
    let by_ref: HashMap<String, &Task> = tasks.iter().map(|t| (t.task_ref.to_string(), t)).collect();
    let mut with_callback: Vec<(Task, String)> = Vec::new();
    for s in submitted {
        let Some(task) = by_ref.get(s.task_ref.as_ref()) else { continue };
        let answer = task.captcha_id.as_ref().and_then(|i| answers.get(i.as_ref()).cloned().flatten());
        let (holds, via) = match &task.state {
            TaskState::Solved { solution, via, .. } => {
                r.solved += 1;
                (answer.as_deref() == Some(solution.expose()), Some(via.as_str()))
            }
            TaskState::Failed { code, via, .. } => {
                r.failed += 1;
                (answer.is_none() || answer.as_deref() == Some(code.as_ref()), Some(via.as_str()))
            }
            _ => {
                r.open += 1;
                (answer.is_none(), None)
            }
        };
        match via {
            Some("poll") => r.by_poll += 1,
            Some("redrive") => r.by_redrive += 1,
            _ => {}
        }
        if answer.is_some() && !holds {
            r.lost += 1;
            r.lost_refs.push(s.task_ref.to_string());
        }
        if let Some(p) = &s.path {
            with_callback.push(((*task).clone(), p.clone()));
        }
    }
    let c = check_pushes(&with_callback, &receiver.hits(), Duration::from_secs(3600));
    r.with_callback = with_callback.len();
    r.delivered = c.delivered;
    r.owed = c.owed;
    r.record_to_push_ms = c.record_to_2xx_ms.iter().map(|v| *v as f64).collect();
    r.life_left_ms = c.life_left_ms.iter().map(|v| *v as f64).collect();
    r.pushed_after_death = c.pushed_after_death;
    let counts = w.fake.counts();
    r.res_php = counts.res_php;
    r.in_php = counts.in_php;
    r.bans = counts.bans;
    Ok(())
}

//! The relay on a simulated clock, with the settings `template.yaml` deploys, against a fake
//! CaptchaAI that behaves like the real one at its worst.
//!
//! What runs is the relay's own code: the API and callback handlers behind the local HTTP
//! server, the poller's [`relay_poller::run_invocation`] started once per schedule period with
//! the function's timeout as its deadline, the DynamoDB store on the embedded engine. Only time
//! is simulated ([`ManualClock`]): the owner's submits, the fake's solves and pingbacks, the
//! poller's rate limit and sleeps all wait on it, and it jumps to the next such moment whenever
//! nothing is working — so an hour takes seconds, and the settings are the deployed ones.
//!
//! The owner (the relay's user) submits a planned workload through `POST /tasks` and reads each
//! task through `GET /tasks/{ref}` every few (simulated) seconds, as a client would; what it is
//! handed, and when, is measured against what the fake solved, and when.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Context;
use fake_captchaai::{FakeCaptchaAi, FakeConfig};
use relay_local::{LocalParts, Relay};
use relay_poller::{PollerSettings, TickReport};
use relay_shared::config::{CallbackGrace, Settings};
use relay_shared::domain::{CaptchaKind, TaskRef};
use relay_shared::store::TaskStore;
use relay_shared::testkit::{FlakyDynamo, LocalDynamo, MemorySink};
use relay_time::{Clock, ManualClock, Timestamp};
use secrecy::SecretString;

pub mod chaos;
pub mod load;
pub mod logs;
pub mod partitions;

/// The values `template.yaml` deploys, read from the template itself.
#[derive(Debug, Clone)]
pub struct Deployed {
    pub poller: PollerSettings,
    /// The poller function's timeout: each invocation's hard deadline.
    pub poller_timeout: Duration,
    /// The delivery function's timeout (its sweep's invocation).
    pub delivery_timeout: Duration,
    /// Time between scheduled poller invocations.
    pub schedule_every: Duration,
    /// The first read per kind (the API function's `CALLBACK_GRACE_SECS…`).
    pub grace: CallbackGrace,
    pub poller_env: Settings,
    pub api_env: Settings,
    /// The submit queue's settings (the API's and the submitter's).
    pub queue: relay_shared::submit::QueueSettings,
    /// The redrive function's environment: the dead-letter queue's visibility and receives.
    pub redrive_env: Settings,
}

fn scalar(v: &serde_yaml::Value) -> Option<String> {
    match v {
        serde_yaml::Value::String(s) => Some(s.clone()),
        serde_yaml::Value::Number(n) => Some(n.to_string()),
        serde_yaml::Value::Bool(b) => Some(b.to_string()),
        _ => None,
    }
}

impl Deployed {
    /// Reads `template.yaml`: a function's environment (globals and its own, `!Ref`s resolved to
    /// the parameters' defaults), its timeout, and the schedule.
    pub fn from_template() -> anyhow::Result<Self> {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../template.yaml");
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {path}"))?;
        let doc: serde_yaml::Value = serde_yaml::from_str(&text).context("parsing template.yaml")?;
        let params = &doc["Parameters"];
        let resolve = |v: &serde_yaml::Value| -> Option<String> {
            match v {
                serde_yaml::Value::Tagged(t) if t.tag == "!Ref" => {
                    scalar(&params[scalar(&t.value)?.as_str()]["Default"])
                }
                other => scalar(other),
            }
        };
        let env_of = |function: &str| -> Settings {
            let mut s = Settings::default();
            for vars in [
                &doc["Globals"]["Function"]["Environment"]["Variables"],
                &doc["Resources"][function]["Properties"]["Environment"]["Variables"],
            ] {
                if let serde_yaml::Value::Mapping(m) = vars {
                    for (k, v) in m {
                        if let (Some(k), Some(v)) = (scalar(k), resolve(v)) {
                            s = s.with(&k, &v);
                        }
                    }
                }
            }
            s
        };
        let poller_env = env_of("PollerFunction");
        let api_env = env_of("ApiFunction");
        let redrive_env = env_of("RedriveFunction");
        let timeout_of = |function: &str| -> anyhow::Result<Duration> {
            let secs = doc["Resources"][function]["Properties"]["Timeout"]
                .as_u64()
                .with_context(|| format!("{function} has a Timeout"))?;
            Ok(Duration::from_secs(secs))
        };
        let minutes: u64 = scalar(&params["PollScheduleMinutes"]["Default"]).context("PollScheduleMinutes")?.parse()?;
        Ok(Self {
            poller: PollerSettings::from_settings(&poller_env)?,
            poller_timeout: timeout_of("PollerFunction")?,
            delivery_timeout: timeout_of("DeliveryFunction")?,
            schedule_every: Duration::from_secs(60 * minutes),
            grace: CallbackGrace::from_settings(&api_env)?,
            queue: relay_shared::submit::QueueSettings::from_settings(&api_env)?,
            poller_env,
            api_env,
            redrive_env,
        })
    }
}

impl Deployed {
    /// The same deployment with `name` set to `value` in the functions' environments (what an
    /// operator sets for a workload the defaults do not fit), read again.
    pub fn with(mut self, name: &str, value: &str) -> anyhow::Result<Self> {
        self.api_env = self.api_env.with(name, value);
        self.poller_env = self.poller_env.with(name, value);
        self.poller = PollerSettings::from_settings(&self.poller_env)?;
        self.grace = CallbackGrace::from_settings(&self.api_env)?;
        self.queue = relay_shared::submit::QueueSettings::from_settings(&self.api_env)?;
        Ok(self)
    }
}

/// One planned submit.
#[derive(Debug, Clone)]
pub struct Planned {
    pub at: Timestamp,
    pub kind: CaptchaKind,
}

/// The `POST /tasks` body for a kind (one definition for every harness).
pub use relay_shared::testkit::body_for;

/// `n` submits spread evenly over `over`, starting at `from`, kinds in turn from `mix`.
pub fn steady(from: Timestamp, over: Duration, n: usize, mix: &[CaptchaKind]) -> Vec<Planned> {
    let step = over.as_millis() as u64 / (n as u64).max(1);
    (0..n)
        .map(|i| Planned { at: Timestamp::from_millis(from.as_millis() + step * i as u64), kind: mix[i % mix.len()] })
        .collect()
}

/// What the owner knows of one task.
#[derive(Debug, Clone)]
pub struct Owned {
    pub task_ref: TaskRef,
    pub kind: CaptchaKind,
    pub captcha_id: Option<String>,
    pub submitted_at: Timestamp,
    /// The answer to the submit (HTTP status).
    pub submit_status: u16,
    /// When the owner was first handed a solution, which one, and by which path.
    pub handed_out: Option<(Timestamp, String, String)>,
    /// The last status the owner read.
    pub status: String,
    pub error_code: Option<String>,
    /// The owner stops reading a task once it is final.
    pub done: bool,
}

/// One poller invocation, as the schedule started it.
#[derive(Debug, Clone)]
pub struct Invocation {
    pub started: Timestamp,
    pub deadline: Timestamp,
    pub ended: Timestamp,
    pub report: TickReport,
}

/// A relay, a fake CaptchaAI and an owner, on one simulated clock.
pub struct World {
    pub clock: ManualClock,
    pub db: LocalDynamo,
    pub store: TaskStore,
    pub fake: FakeCaptchaAi,
    pub base: String,
    pub api_key: String,
    pub deployed: Deployed,
    pub poller: relay_poller::Deps,
    pub dead_letters: MemorySink,
    /// The on-disk dead-letter queue, with [`Options::disk_queue`].
    pub queue: Option<relay_local::queue::DiskQueue>,
    /// While set, every dead-letter send fails (a queue outage).
    pub queue_fail: Arc<std::sync::atomic::AtomicBool>,
    /// The fault injector in front of the relay's store, with [`Options::flaky_relay_store`].
    pub flaky: Option<FlakyDynamo>,
    /// The partition meter in front of the engine, with [`Options::partition_meter`].
    pub meter: Option<partitions::PartitionMeter>,
    /// Whether the relay "process" is up: while down, its HTTP connections are cut, its poller
    /// and redrive loop do not run.
    pub up: Arc<std::sync::atomic::AtomicBool>,
    running: Arc<Mutex<Vec<tokio::task::AbortHandle>>>,
    pub invocations: Arc<Mutex<Vec<Invocation>>>,
    pub owned: Arc<Mutex<Vec<Owned>>>,
    /// How many owners were started: each uses its own idempotency keys.
    owners_started: std::sync::atomic::AtomicUsize,
    http: reqwest::Client,
    stop: tokio::sync::watch::Sender<bool>,
}

impl Drop for World {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

/// The relay's callback signing secret in the simulation.
pub const SIGNING_SECRET: &str = "sim-signing-secret-0123456789";

/// The simulated epoch: 2026-12-02T11:15:46Z.
pub const EPOCH: Timestamp = Timestamp::from_millis(1_796_210_146_000);

/// Variations of the world for particular tests.
#[derive(Debug, Clone)]
pub struct Options {
    /// The API's and the callback's store go through a fault injector ([`World::flaky`]).
    pub flaky_relay_store: bool,
    /// The poller's store too (with `flaky_relay_store`): every part of the relay sees the faults.
    pub flaky_poller_store: bool,
    /// The API's timeout for in.php (real time).
    pub submit_timeout: Duration,
    /// Dead letters go to local mode's on-disk queue in this directory, drained by a redrive
    /// loop every 5 s (instead of an in-memory list the test drains itself).
    pub disk_queue: Option<std::path::PathBuf>,
    /// Told of every push the relay's writes make due (a delivery worker in the same
    /// "process", as local mode runs it).
    pub push_notifier: Option<relay_shared::store::PushNotifier>,
    /// Every part of the relay reaches the engine through a [`partitions::PartitionMeter`]
    /// ([`World::meter`]), and its store spreads its indexes over these shards.
    pub partition_meter: Option<relay_shared::store::Shards>,
    /// Settings set on top of the template's ([`Deployed::with`]).
    pub settings: Vec<(String, String)>,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            flaky_relay_store: false,
            flaky_poller_store: false,
            submit_timeout: Duration::from_secs(15),
            disk_queue: None,
            push_notifier: None,
            partition_meter: None,
            settings: Vec::new(),
        }
    }
}

impl World {
    /// Starts everything (nothing is submitted and no poller runs until asked).
    pub async fn start(fake: FakeConfig) -> anyhow::Result<Self> {
        Self::start_with(fake, Options::default()).await
    }

    pub async fn start_with(fake: FakeConfig, opts: Options) -> anyhow::Result<Self> {
        let mut deployed = Deployed::from_template()?;
        for (name, value) in &opts.settings {
            deployed = deployed.with(name, value)?;
        }
        let clock = ManualClock::at(EPOCH);
        let dyn_clock: Arc<dyn Clock> = Arc::new(clock.clone());
        let db = LocalDynamo::start().await?;
        let mut store = db.fresh_store().await?;
        let meter = match opts.partition_meter {
            Some(shards) => {
                let m = partitions::PartitionMeter::start(&db.endpoint, dyn_clock.clone()).await?;
                store = TaskStore::new(
                    partitions::sim_client(&m.endpoint, dyn_clock.clone()),
                    store.table(),
                    Duration::from_secs(7 * 86_400),
                )
                .with_shards(shards);
                Some(m)
            }
            None => None,
        };
        // The submit queue's counts spread as deployed (`QueueShards`).
        let queue_shards: u8 =
            deployed.api_env.parse_or("QUEUE_SHARDS", relay_shared::store::queue::DEFAULT_QUEUE_SHARDS)?;
        store = store.with_queue_shards(queue_shards);
        let engine = meter.as_ref().map_or_else(|| db.endpoint.clone(), |m| m.endpoint.clone());
        if let Some(n) = opts.push_notifier.clone() {
            store = store.with_push_notifier(n);
        }
        let fake = FakeCaptchaAi::start_with_clock("127.0.0.1:0", fake, dyn_clock.clone()).await?;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let api_key = "sim-owner-key-0123456789".to_owned();
        let dead_letters = MemorySink::default();
        let queue = match &opts.disk_queue {
            Some(dir) => {
                std::fs::create_dir_all(dir)?;
                // The dead-letter queue as deployed: its visibility and its receives.
                let env = &deployed.redrive_env;
                Some(relay_local::queue::DiskQueue::open(
                    &dir.join("dead-letters.sqlite"),
                    dyn_clock.clone(),
                    Duration::from_secs(env.parse_or("DEAD_LETTER_VISIBILITY_SECONDS", 185)?),
                    env.parse_or("MAX_RECEIVE_COUNT", 12)?,
                )?)
            }
            None => None,
        };
        let inner: Arc<dyn relay_shared::deadletter::DeadLetterSink> = match &queue {
            Some(q) => Arc::new(q.clone()),
            None => Arc::new(dead_letters.clone()),
        };
        let sink = relay_shared::testkit::FailingSink::new(inner);
        let queue_fail = sink.fail.clone();
        let up = Arc::new(std::sync::atomic::AtomicBool::new(true));
        let client = |timeout| {
            relay_shared::captchaai::CaptchaAiClient::new(
                &fake.base_url(),
                SecretString::from(fake.api_key()),
                timeout,
                None,
            )
        };
        let flaky = if opts.flaky_relay_store { Some(FlakyDynamo::start(&engine).await?) } else { None };
        let relay_store = flaky.as_ref().map_or_else(
            || store.clone(),
            |f| f.store(store.table()).with_shards(store.shards()).with_queue_shards(store.queue_shards()),
        );
        let mut relay = Relay::new(LocalParts {
            store: relay_store,
            captchaai: client(opts.submit_timeout)?,
            api_key: SecretString::from(api_key.clone()),
            signing_secret: SecretString::from(SIGNING_SECRET.to_owned()),
            callback_base_url: base.clone(),
            clock: dyn_clock.clone(),
            dead_letters: Arc::new(sink.clone()),
            delivery_policy: relay_shared::webhook::UrlPolicy::AllowLoopback,
        });
        relay.api.callback_grace = deployed.grace.clone();
        relay.api.queue = deployed.queue.clone();
        let submitter = relay.submitter("sim-submitter");
        let submit_wake = relay.submit_wake.clone();
        let (stop, stop_rx) = tokio::sync::watch::channel(false);
        let running: Arc<Mutex<Vec<tokio::task::AbortHandle>>> = Arc::default();
        // The submitter, as local mode runs it (woken when the API queues a task, and once a
        // minute), while the relay "process" is up; killed with it.
        {
            let (clock, up, running, mut stop) = (dyn_clock.clone(), up.clone(), running.clone(), stop_rx.clone());
            tokio::spawn(async move {
                loop {
                    if *stop.borrow() {
                        return;
                    }
                    if up.load(std::sync::atomic::Ordering::SeqCst) {
                        let (deps, clock, wake, stop) =
                            (submitter.clone(), clock.clone(), submit_wake.clone(), stop.clone());
                        let h = tokio::spawn(async move {
                            relay_submitter::serve_local(&deps, clock, wake, stop).await;
                        });
                        if let Ok(mut r) = running.lock() {
                            r.push(h.abort_handle());
                        }
                        let _ = h.await;
                    }
                    tokio::select! {
                        _ = clock.sleep_until(clock.now().plus(Duration::from_secs(1))) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                }
            });
        }
        let mut rx = stop_rx.clone();
        // The relay's routes, behind a kill switch: while the "process" is down, every
        // connection is cut without an answer, as a dead process's would be.
        let switch = up.clone();
        let app = relay_local::router(Arc::new(relay)).layer(axum::middleware::from_fn(
            move |req: axum::extract::Request, next: axum::middleware::Next| {
                let up = switch.load(std::sync::atomic::Ordering::SeqCst);
                async move {
                    if !up {
                        std::panic::resume_unwind(Box::new("relay process is down"));
                    }
                    next.run(req).await
                }
            },
        ));
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = rx.wait_for(|s| *s).await;
                })
                .await;
        });
        let poller_store = match (&flaky, opts.flaky_poller_store) {
            (Some(f), true) => {
                f.store(store.table()).with_shards(store.shards()).with_queue_shards(store.queue_shards())
            }
            _ => store.clone(),
        };
        let poller = relay_poller::Deps {
            store: relay_poller::Store::new(&poller_store),
            captchaai: client(deployed.poller.read_timeout)?,
            settings: deployed.poller.clone(),
            owner: "sim-poller".into(),
            dead_letters: Arc::new(sink.clone()),
        };
        Ok(Self {
            clock,
            db,
            store,
            fake,
            base,
            api_key,
            deployed,
            poller,
            dead_letters,
            queue,
            queue_fail,
            flaky,
            meter,
            up,
            running,
            invocations: Arc::default(),
            owned: Arc::default(),
            owners_started: Default::default(),
            http: reqwest::Client::new(),
            stop,
        })
    }

    fn dyn_clock(&self) -> Arc<dyn Clock> {
        Arc::new(self.clock.clone())
    }

    /// Starts the schedule: a poller invocation every period from `from` on, each with the
    /// function's timeout as its deadline. Invocations may overlap, as on Lambda.
    pub fn schedule_poller(&self, from: Timestamp) {
        let (clock, deps, every, timeout) =
            (self.dyn_clock(), self.poller.clone(), self.deployed.schedule_every, self.deployed.poller_timeout);
        let (record, mut stop) = (self.invocations.clone(), self.stop.subscribe());
        let (up, running) = (self.up.clone(), self.running.clone());
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            let mut next = from;
            loop {
                tokio::select! {
                    _ = clock.sleep_until(next) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                next = next.plus(every);
                if !up.load(std::sync::atomic::Ordering::SeqCst) {
                    continue;
                }
                let (clock2, deps, record) = (clock.clone(), deps.clone(), record.clone());
                let started = clock.now();
                let deadline = started.plus(timeout);
                let busy = clock.busy();
                let h = tokio::spawn(async move {
                    let _busy = busy;
                    let report = relay_poller::run_invocation(&deps, clock2.clone(), deadline).await;
                    let ended = clock2.now();
                    if let Ok(mut r) = record.lock() {
                        r.push(Invocation { started, deadline, ended, report });
                    }
                });
                if let Ok(mut r) = running.lock() {
                    r.retain(|h| !h.is_finished());
                    r.push(h.abort_handle());
                }
            }
        });
    }

    /// Starts the owner: submits `plan` at its times, and (with `read_every`) reads every open
    /// task that often until it is final.
    pub fn start_owner(&self, plan: Vec<Planned>, read_every: impl Into<Option<Duration>>) {
        let read_every = read_every.into();
        let clock = self.dyn_clock();
        let generation = self.owners_started.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        // Submitter.
        {
            let (clock, http, base, key, owned, mut stop) = (
                clock.clone(),
                self.http.clone(),
                self.base.clone(),
                self.api_key.clone(),
                self.owned.clone(),
                self.stop.subscribe(),
            );
            let busy = clock.busy();
            tokio::spawn(async move {
                let _busy = busy;
                for (n, p) in plan.into_iter().enumerate() {
                    tokio::select! {
                        _ = clock.sleep_until(p.at) => {}
                        _ = stop.wait_for(|s| *s) => return,
                    }
                    match submit_politely(
                        &http,
                        &base,
                        &key,
                        p.kind,
                        &format!("owner-{generation}-{n}"),
                        clock.as_ref(),
                    )
                    .await
                    {
                        Ok((status, v)) => {
                            let Ok(task_ref) = TaskRef::parse(v["task_ref"].as_str().unwrap_or_default()) else {
                                tracing::error!(%v, "submit answered without a task");
                                continue;
                            };
                            if let Ok(mut o) = owned.lock() {
                                o.push(Owned {
                                    task_ref,
                                    kind: p.kind,
                                    captcha_id: v["captcha_id"].as_str().map(str::to_owned),
                                    submitted_at: clock.now(),
                                    submit_status: status,
                                    handed_out: None,
                                    status: v["status"].as_str().unwrap_or_default().to_owned(),
                                    error_code: None,
                                    done: false,
                                });
                            }
                        }
                        Err(e) => tracing::error!(error = %e, "submit failed"),
                    }
                }
            });
        }
        // Reader.
        let Some(read_every) = read_every else { return };
        let (http, base, key, owned, mut stop) =
            (self.http.clone(), self.base.clone(), self.api_key.clone(), self.owned.clone(), self.stop.subscribe());
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            loop {
                let open: Vec<(usize, TaskRef)> = owned
                    .lock()
                    .map(|o| {
                        o.iter().enumerate().filter(|(_, t)| !t.done).map(|(i, t)| (i, t.task_ref.clone())).collect()
                    })
                    .unwrap_or_default();
                // Up to 16 reads at a time, each with a guard of its own (lent to the API while
                // it answers); the reader counts as asleep while it waits for them.
                let (mut reads, waiter) = (tokio::task::JoinSet::new(), clock.waiter());
                let mut answers = Vec::new();
                let started = clock.now();
                for (i, r) in open {
                    while reads.len() >= 16 {
                        let done = waiter.wait(reads.join_next()).await;
                        answers.extend(done.and_then(|d| d.ok()).flatten());
                    }
                    let (http, base, key, clock, busy) =
                        (http.clone(), base.clone(), key.clone(), clock.clone(), waiter.busy());
                    reads.spawn(async move {
                        let _busy = busy;
                        let got = async {
                            http.get(format!("{base}/tasks/{r}"))
                                .bearer_auth(&key)
                                .send()
                                .await
                                .ok()?
                                .json::<serde_json::Value>()
                                .await
                                .ok()
                        }
                        .await;
                        got.map(|v| (i, v, clock.now()))
                    });
                }
                while let Some(done) = waiter.wait(reads.join_next()).await {
                    answers.extend(done.ok().flatten());
                }
                for (i, v, now) in answers {
                    if let Ok(mut o) = owned.lock()
                        && let Some(t) = o.get_mut(i)
                    {
                        t.status = v["status"].as_str().unwrap_or_default().to_owned();
                        t.error_code = v["error_code"].as_str().map(str::to_owned);
                        if t.captcha_id.is_none() {
                            t.captcha_id = v["captcha_id"].as_str().map(str::to_owned);
                        }
                        let solution = v["solution"].as_str().or_else(|| v["late_result"]["solution"].as_str());
                        if let (None, Some(sol)) = (&t.handed_out, solution) {
                            let via = v["resolved_via"].as_str().or_else(|| v["late_result"]["received_via"].as_str());
                            t.handed_out = Some((now, sol.to_owned(), via.unwrap_or_default().to_owned()));
                        }
                        t.done = t.handed_out.is_some() || matches!(t.status.as_str(), "failed" | "expired");
                    }
                }
                tokio::select! {
                    _ = clock.sleep_until(started.plus(read_every)) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
    }

    /// Kills the relay "process" now (connections cut, poller invocations and the redrive loop
    /// stopped mid-way) and starts it again after `down_for`, on the same store and queue.
    /// Call from an actor on the clock (it sleeps on it).
    pub async fn kill_and_restart(&self, down_for: Duration) {
        self.up.store(false, std::sync::atomic::Ordering::SeqCst);
        if let Ok(mut r) = self.running.lock() {
            for h in r.drain(..) {
                h.abort();
            }
        }
        self.clock.sleep_until(self.clock.now().plus(down_for)).await;
        self.up.store(true, std::sync::atomic::Ordering::SeqCst);
    }

    /// Starts local mode's redrive loop over the on-disk queue: a pass every 5 s while up.
    pub fn start_redrive_loop(&self) {
        let Some(queue) = self.queue.clone() else { return };
        let (clock, store, up, mut stop) =
            (self.dyn_clock(), self.redrive_store(), self.up.clone(), self.stop.subscribe());
        let busy = clock.busy();
        tokio::spawn(async move {
            let _busy = busy;
            loop {
                if up.load(std::sync::atomic::Ordering::SeqCst) {
                    relay_local::run::drain_dead_letters(&queue, &store).await;
                }
                tokio::select! {
                    _ = clock.sleep_until(clock.now().plus(Duration::from_secs(5))) => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
            }
        });
    }

    /// The store as the relay's functions see it (through the fault injector, if any).
    pub fn redrive_store(&self) -> TaskStore {
        self.flaky.as_ref().map_or_else(
            || self.store.clone(),
            |f| {
                f.store(self.store.table())
                    .with_shards(self.store.shards())
                    .with_queue_shards(self.store.queue_shards())
            },
        )
    }

    /// `POST /tasks` as an owner would send it, with an optional `Idempotency-Key`.
    pub async fn post_task(
        &self,
        body: &str,
        key: Option<&str>,
    ) -> anyhow::Result<(u16, serde_json::Value, reqwest::header::HeaderMap)> {
        let mut req = self
            .http
            .post(format!("{}/tasks", self.base))
            .bearer_auth(&self.api_key)
            .header("content-type", "application/json")
            .body(body.to_owned());
        if let Some(k) = key {
            req = req.header("idempotency-key", k);
        }
        let resp = req.send().await?;
        let (status, headers) = (resp.status().as_u16(), resp.headers().clone());
        Ok((status, resp.json().await.unwrap_or_default(), headers))
    }

    /// `POST /in.php` as a 2captcha client sends it (a form, plain answers), with this relay's
    /// key (local mode's API key is also a relay key) and the given parameters.
    pub async fn post_in_php(&self, params: &str) -> anyhow::Result<(u16, String)> {
        let resp = self
            .http
            .post(format!("{}/in.php", self.base))
            .header("content-type", "application/x-www-form-urlencoded")
            .body(format!("key={}&{params}", self.api_key))
            .send()
            .await?;
        Ok((resp.status().as_u16(), resp.text().await?))
    }

    /// `GET /res.php?action=get&id=…` (plain answers).
    pub async fn res_php(&self, id: &str) -> anyhow::Result<String> {
        Ok(self
            .http
            .get(format!("{}/res.php?key={}&action=get&id={id}", self.base, self.api_key))
            .send()
            .await?
            .text()
            .await?)
    }

    /// `GET /tasks/{ref}`.
    pub async fn get_task(&self, task_ref: &str) -> anyhow::Result<serde_json::Value> {
        Ok(self
            .http
            .get(format!("{}/tasks/{task_ref}", self.base))
            .bearer_auth(&self.api_key)
            .send()
            .await?
            .json()
            .await?)
    }

    /// Runs the simulation for `d` of simulated time.
    pub async fn run_for(&self, d: Duration) {
        let end = self.clock.now().plus(d);
        self.clock.run_until(end).await;
    }

    pub fn owned(&self) -> Vec<Owned> {
        self.owned.lock().map(|o| o.clone()).unwrap_or_default()
    }

    pub fn invocations(&self) -> Vec<Invocation> {
        self.invocations.lock().map(|o| o.clone()).unwrap_or_default()
    }

    /// Measures the run against what the fake really did.
    pub async fn figures(&self) -> anyhow::Result<Figures> {
        let mut f = Figures::default();
        let fake_tasks: HashMap<String, fake_captchaai::FakeTask> =
            self.fake.tasks().into_iter().map(|t| (t.id.to_string(), t)).collect();
        let now = self.clock.now();
        for o in self.owned() {
            f.tasks += 1;
            let task = self.store.tasks().get(&o.task_ref).await?.context("task vanished")?;
            let id = task.captcha_id.as_ref().map(|i| i.to_string());
            let ft = id.as_ref().and_then(|i| fake_tasks.get(i));
            if let Some(ft) = ft {
                f.reads.push(ft.reads);
            }
            use relay_shared::domain::TaskState;
            let resolved_via = match &task.state {
                TaskState::Solved { via, .. } | TaskState::Failed { via, .. } => Some(via.as_str()),
                _ => None,
            };
            match resolved_via {
                Some("callback") => f.by_callback += 1,
                Some("poll") => f.by_poll += 1,
                Some("redrive") => f.by_redrive += 1,
                _ => {}
            }
            // Lost: the fake solved it (or gave its verdict) and the relay does not hold that.
            if let Some(ft) = ft
                && let Some(answer) = &ft.answer
            {
                let holds = match &task.state {
                    TaskState::Solved { solution, .. } => solution.expose() == answer,
                    TaskState::Failed { code, .. } => code.as_ref() == answer,
                    TaskState::Expired { late: Some(l), .. } => match &l.outcome {
                        relay_shared::domain::Outcome::Solved(s) => s.expose() == answer,
                        relay_shared::domain::Outcome::Failed(c) => c.as_ref() == answer,
                    },
                    _ => false,
                };
                if !holds {
                    f.lost += 1;
                    f.lost_refs.push(o.task_ref.to_string());
                }
            }
            if matches!(task.state, TaskState::Expired { .. }) {
                f.expired += 1;
            }
            if let (Some((at, sol, via)), Some(ft)) = (&o.handed_out, ft) {
                let age = at.since(ft.solved_at);
                let lifetime = o.kind.token_lifetime();
                if Some(sol) != ft.answer.as_ref() || lifetime.is_some_and(|l| age > l) {
                    f.stale_handed_out += 1;
                }
                if let Some(l) = lifetime {
                    let entry = f.handout_age.entry(via.clone()).or_default();
                    entry.push(age.as_secs_f64());
                    if via == "poll" && l == Duration::from_secs(120) {
                        f.short_lived_by_poll += 1;
                        if l.saturating_sub(age) >= Duration::from_secs(60) {
                            f.short_lived_by_poll_with_60s += 1;
                        }
                    }
                }
            }
            if ft.is_some_and(|t| t.answer.as_ref().is_some_and(|a| !a.starts_with("ERROR"))) && o.handed_out.is_none()
            {
                f.never_handed_out += 1;
            }
            if !task.state.is_final() {
                f.open += 1;
            }
        }
        let inv = self.invocations();
        f.invocations = inv.len();
        f.over_deadline = inv.iter().filter(|i| i.ended > i.deadline || i.report.over_deadline).count();
        f.longest_invocation = inv.iter().map(|i| i.ended.since(i.started)).max().unwrap_or_default();
        f.res_php_requests = self.fake.counts().res_php;
        f.in_php = self.fake.counts().in_php;
        f.bans = self.fake.counts().bans;
        f.requests_during_ban = self.fake.counts().requests_during_ban;
        f.sim_time = now.since(EPOCH);
        Ok(f)
    }
}

/// Submits as a careful client does: with an idempotency key; on a 503 that says retrying is
/// safe, or no answer at all, again after `Retry-After` (on the clock) with the same key.
async fn submit_politely(
    http: &reqwest::Client,
    base: &str,
    key: &str,
    kind: CaptchaKind,
    idempotency_key: &str,
    clock: &dyn Clock,
) -> anyhow::Result<(u16, serde_json::Value)> {
    let mut last = None;
    for _ in 0..50 {
        let sent = http
            .post(format!("{base}/tasks"))
            .bearer_auth(key)
            .header("content-type", "application/json")
            .header("idempotency-key", idempotency_key)
            .body(body_for(kind))
            .send()
            .await;
        let wait = match sent {
            Ok(resp) => {
                let status = resp.status().as_u16();
                let after =
                    resp.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok());
                let v: serde_json::Value = resp.json().await.unwrap_or_default();
                if !matches!(status, 429 | 503) || v["error"]["retry_safe"] != true {
                    return Ok((status, v));
                }
                last = Some((status, v));
                Duration::from_secs(after.unwrap_or(5))
            }
            // The relay is down: try again a little later.
            Err(_) => Duration::from_secs(5),
        };
        clock.sleep_until(clock.now().plus(wait)).await;
    }
    last.ok_or_else(|| anyhow::anyhow!("the relay never answered"))
}

/// A run's outcome, measured against the fake.
#[derive(Debug, Default, Clone)]
pub struct Figures {
    pub tasks: usize,
    pub by_callback: usize,
    pub by_poll: usize,
    pub by_redrive: usize,
    pub expired: usize,
    pub open: usize,
    /// The fake solved it (or gave its verdict) and the relay does not hold that.
    pub lost: usize,
    pub lost_refs: Vec<String>,
    /// Handed out although older than its lifetime (by the fake's solve time), or not the
    /// fake's answer.
    pub stale_handed_out: usize,
    /// Solved by the fake but never handed to the owner.
    pub never_handed_out: usize,
    /// Age (s) at hand-out by path, for tokens that expire.
    pub handout_age: HashMap<String, Vec<f64>>,
    /// reCAPTCHA/hCaptcha tokens (120 s) handed out after a poll recovered them…
    pub short_lived_by_poll: usize,
    /// …of which with at least 60 s of life left.
    pub short_lived_by_poll_with_60s: usize,
    /// res.php reads per task, as the fake counted them.
    pub reads: Vec<u32>,
    pub res_php_requests: u64,
    pub in_php: u64,
    pub invocations: usize,
    pub over_deadline: usize,
    pub longest_invocation: Duration,
    pub bans: u64,
    pub requests_during_ban: u64,
    pub sim_time: Duration,
}

/// The `p`-th percentile (0..=100) of `v`.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let i = ((p / 100.0) * (s.len() - 1) as f64).round() as usize;
    s[i.min(s.len() - 1)]
}

impl Figures {
    pub fn reads_per_task(&self) -> f64 {
        self.res_php_requests as f64 / self.tasks.max(1) as f64
    }

    pub fn max_reads(&self) -> u32 {
        self.reads.iter().copied().max().unwrap_or(0)
    }

    /// Share of poll-recovered 120 s tokens handed out with ≥ 60 s of life left.
    pub fn fresh_share(&self) -> f64 {
        if self.short_lived_by_poll == 0 {
            return 1.0;
        }
        self.short_lived_by_poll_with_60s as f64 / self.short_lived_by_poll as f64
    }

    /// The figures as the tests print them.
    pub fn table(&self, title: &str) -> String {
        let ages = |path: &str| {
            let v = self.handout_age.get(path).cloned().unwrap_or_default();
            format!("p50 {:.0} s, p95 {:.0} s (n={})", percentile(&v, 50.0), percentile(&v, 95.0), v.len())
        };
        format!(
            "== {title} ==\n\
             tasks {}  (callback {}, poll {}, redrive {}; expired {}, open {})\n\
             lost {}  stale handed out {}  solved but never handed out {}\n\
             token age at hand-out: callback {}; poll {}\n\
             120 s tokens recovered by poll: {} of {} handed out with >= 60 s left ({:.1} %)\n\
             res.php requests {} ({:.2} per task, max {} for one task); in.php {}\n\
             poller invocations {} (over deadline {}, longest {:.1} s)\n\
             bans {}  requests during a ban {}  simulated time {:.0} s",
            self.tasks,
            self.by_callback,
            self.by_poll,
            self.by_redrive,
            self.expired,
            self.open,
            self.lost,
            self.stale_handed_out,
            self.never_handed_out,
            ages("callback"),
            ages("poll"),
            self.short_lived_by_poll_with_60s,
            self.short_lived_by_poll,
            100.0 * self.fresh_share(),
            self.res_php_requests,
            self.reads_per_task(),
            self.max_reads(),
            self.in_php,
            self.invocations,
            self.over_deadline,
            self.longest_invocation.as_secs_f64(),
            self.bans,
            self.requests_during_ban,
            self.sim_time.as_secs_f64(),
        )
    }
}

//! Pushing each result to its owner's callback, at least once, signed the Standard Webhooks
//! way, and scheduled against the life of what it carries. The same worker runs in the
//! delivery Lambda (woken by the table's stream, by its retry queue and by a sweep every
//! minute) and in local mode (a loop told of each result by the store as it is written).
//!
//! The outbox is the task item (see [`crate::store::deliveries`]): the terminal write made the
//! push due. A push is claimed with a lease that counts its attempt, the result is pinned (a
//! result once pushed never changes, as one shown by `GET /tasks/{ref}`), it waits for its
//! host's turn (earliest deadline first, within the host's limits: [`hosts`]), is sent, and the
//! outcome is recorded under the lease; a failure is retried on the schedule that fits the
//! result ([`schedule`]). The `webhook-id` follows from the result ([`Task::webhook_id`]): the
//! same on every retry and replay of the same result, so owners de-duplicate on it.
//!
//! Form: a compat task (submitted through `in.php` with `pingback`) gets the pingback its
//! handler already parses — CaptchaAI's `GET <pingback>?id=<id>&code=<answer>`, or 2captcha's
//! `POST` form where its relay key says so; other tasks get JSON
//! `{"type": "task.solved", "timestamp": …, "data": <the task view>}`. All signed.

pub mod hosts;
pub mod schedule;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use tokio::sync::mpsc;

use crate::config::{ConfigError, Settings};
use crate::domain::{PingbackForm, Task, TaskRef, TaskState, TaskView};
use crate::store::deliveries::DEFAULT_OWNER;
use crate::store::{DeliveryFinish, DueDelivery, PushNotifier, StoreError, TaskStore};
use crate::time::{Busy, Clock, Timestamp};
use crate::webhook::{AttemptResult, Outgoing, PushMethod, Sender, SigningKeys, UrlPolicy};
use hosts::{HostGates, Signal};

/// The sweep waits after a pass that met a store failure this long, doubled each time in a row,
/// up to [`SWEEP_TROUBLE_MAX_WAIT`]: 1 s, 2 s, 4 s, then every 8 s.
pub const SWEEP_TROUBLE_WAIT: Duration = Duration::from_secs(1);
pub const SWEEP_TROUBLE_MAX_WAIT: Duration = Duration::from_secs(8);

/// What the delivery function keeps of its invocation's time after the sweep's deadline (its
/// report and metrics).
pub const SWEEP_END_MARGIN: Duration = Duration::from_secs(2);

/// The push's limits and schedule.
#[derive(Debug, Clone)]
pub struct DeliverySettings {
    /// One request's time limit (`DELIVERY_TIMEOUT_SECS`, default 10).
    pub timeout: Duration,
    /// Attempts on the standard schedule before a push is parked (`DELIVERY_MAX_ATTEMPTS`,
    /// default 7: at once, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h). A token's fast retries while it
    /// lives come before these (see [`schedule`]).
    pub max_attempts: u32,
    /// The ceiling on requests in flight to one host, across every worker
    /// (`DELIVERY_PER_HOST_CONCURRENCY`, default 64); the adaptive limit moves below it.
    pub per_host_concurrency: u32,
    /// Requests a second to one host, across every worker (`DELIVERY_PER_HOST_PER_SECOND`,
    /// default 50: above the most results the relay makes a second at its default submit pace).
    pub per_host_per_second: u32,
    /// Which owner URLs may be used (`DELIVERY_URL_POLICY`: `public_https`, the default and
    /// the only one on AWS, or `allow_loopback`, local mode's explicit setting).
    pub policy: UrlPolicy,
}

impl Default for DeliverySettings {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            max_attempts: schedule::MAX_ATTEMPTS,
            per_host_concurrency: 64,
            per_host_per_second: 50,
            policy: UrlPolicy::PublicHttps,
        }
    }
}

/// Reads `DELIVERY_URL_POLICY`.
pub fn url_policy(env: &Settings) -> Result<UrlPolicy, ConfigError> {
    match env.optional("DELIVERY_URL_POLICY").as_deref().map(str::trim) {
        None | Some("public_https") => Ok(UrlPolicy::PublicHttps),
        Some("allow_loopback") => Ok(UrlPolicy::AllowLoopback),
        Some(other) => Err(ConfigError::Invalid {
            name: "DELIVERY_URL_POLICY".into(),
            reason: format!("`{other}`: use public_https or allow_loopback"),
        }),
    }
}

impl DeliverySettings {
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let s = Self {
            timeout: Duration::from_secs(env.parse_or("DELIVERY_TIMEOUT_SECS", d.timeout.as_secs())?),
            max_attempts: env.parse_or("DELIVERY_MAX_ATTEMPTS", d.max_attempts)?,
            per_host_concurrency: env.parse_or("DELIVERY_PER_HOST_CONCURRENCY", d.per_host_concurrency)?,
            per_host_per_second: env.parse_or("DELIVERY_PER_HOST_PER_SECOND", d.per_host_per_second)?,
            policy: url_policy(env)?,
        };
        let bad = |name: &str, reason: &str| Err(ConfigError::Invalid { name: name.into(), reason: reason.into() });
        if s.timeout.is_zero() || s.timeout > Duration::from_secs(30) {
            return bad("DELIVERY_TIMEOUT_SECS", "must be 1 to 30");
        }
        if s.max_attempts == 0 || s.max_attempts > 12 {
            return bad("DELIVERY_MAX_ATTEMPTS", "must be 1 to 12");
        }
        if s.per_host_concurrency == 0 || s.per_host_concurrency > crate::store::hosts::MAX_SLOTS {
            return bad("DELIVERY_PER_HOST_CONCURRENCY", "must be 1 to 256");
        }
        if s.per_host_per_second == 0 || s.per_host_per_second > 10_000 {
            return bad("DELIVERY_PER_HOST_PER_SECOND", "must be 1 to 10000");
        }
        Ok(s)
    }

    /// How long a claim holds: the wait for the host's turn (up to 10 s), the request's limit
    /// and the store writes around it.
    pub fn lease(&self) -> Duration {
        self.timeout + Duration::from_secs(15)
    }

    /// The latest a claimed push may start its request: its lease must outlast the request and
    /// the write of its outcome, or another worker would send it too.
    fn latest_start(&self, lease_until: Timestamp) -> Timestamp {
        lease_until.minus(self.timeout + Duration::from_secs(5))
    }
}

/// The secrets pushes are signed with: per owner (kept in the table by `relay-ops webhooks
/// rotate`), else the deployment's own (`WEBHOOK_SECRETS`). Looked up once a minute per owner.
pub struct KeySource {
    default: SigningKeys,
    store: Option<TaskStore>,
    cache: Mutex<HashMap<String, (Instant, SigningKeys)>>,
}

impl std::fmt::Debug for KeySource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeySource(<secrets>)")
    }
}

impl KeySource {
    const FRESH: Duration = Duration::from_secs(60);

    pub fn new(default: SigningKeys, store: Option<TaskStore>) -> Self {
        Self { default, store, cache: Mutex::new(HashMap::new()) }
    }

    pub async fn keys(&self, owner: &str) -> Result<SigningKeys, StoreError> {
        let Some(store) = &self.store else { return Ok(self.default.clone()) };
        if let Some((at, keys)) = self.cache.lock().map_err(|_| poisoned())?.get(owner)
            && at.elapsed() < Self::FRESH
        {
            return Ok(keys.clone());
        }
        let keys = match store.webhook_secrets(owner).await? {
            // A malformed stored value is an operator's mistake: sign with the deployment's
            // secrets (the owner's verification then fails visibly) rather than not at all.
            Some(text) => SigningKeys::parse_list(&text).unwrap_or_else(|e| {
                tracing::error!(event = "webhook_secret_invalid", owner, error = %e);
                self.default.clone()
            }),
            None => self.default.clone(),
        };
        self.cache.lock().map_err(|_| poisoned())?.insert(owner.to_owned(), (Instant::now(), keys.clone()));
        Ok(keys)
    }
}

fn poisoned() -> StoreError {
    StoreError::Rejected("webhook key cache lock poisoned".into())
}

/// Where a worker is told to come back to a push at a later moment (a retry, a push given
/// back): in local mode the worker loop's own inbox, on AWS a delayed message on the retry
/// queue. Best effort: the sweep is the net.
#[async_trait::async_trait]
pub trait Wakeups: Send + Sync {
    async fn due_at(&self, due: DueDelivery, now: Timestamp);
}

/// What a worker loop ([`Deliverer::run`]) is told: a push due now or later. Each carries a
/// [`Busy`] guard (on a simulated clock, the message is work until the loop takes it).
pub type InboxRx = mpsc::UnboundedReceiver<(DueDelivery, Busy)>;

/// The sending side of a worker loop's inbox: the store's [`PushNotifier`] (a result just
/// written) and the worker's own [`Wakeups`] (retries).
#[derive(Clone)]
pub struct Inbox {
    tx: mpsc::UnboundedSender<(DueDelivery, Busy)>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inbox")
    }
}

impl Inbox {
    pub fn new(clock: Arc<dyn Clock>) -> (Self, InboxRx) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx, clock }, rx)
    }

    pub fn send(&self, due: DueDelivery) {
        let _ = self.tx.send((due, self.clock.busy()));
    }

    /// For [`TaskStore::with_push_notifier`].
    pub fn notifier(&self) -> PushNotifier {
        let me = self.clone();
        PushNotifier::new(move |due| me.send(due))
    }
}

#[async_trait::async_trait]
impl Wakeups for Inbox {
    async fn due_at(&self, due: DueDelivery, _now: Timestamp) {
        self.send(due);
    }
}

/// What one sweep (or stream batch, or a stretch of the worker loop) did.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    pub delivered: u64,
    pub already_delivered: u64,
    pub retried: u64,
    pub parked: u64,
    pub gone: u64,
    pub refused: u64,
    /// Claims another worker or a newer result won, and pushes given back for a later turn.
    pub lost: u64,
    pub errors: u64,
    /// Pushes of a result that was fresh when recorded whose token died before the owner's
    /// endpoint took it (the first expired notice sent instead). Should be 0.
    pub token_died: u64,
    /// Of those, the ones the owner's endpoint then took (an expired notice delivered).
    pub delivered_after_death: u64,
    /// Seconds since the oldest push still owed fell due (0 when none is owed).
    pub oldest_due_secs: u64,
    /// Milliseconds from the result's record to its delivery, per delivered push.
    #[serde(skip)]
    pub latencies_ms: Vec<u64>,
    /// Milliseconds of life its token had left when a push carrying one was sent and taken.
    #[serde(skip)]
    pub life_left_ms: Vec<u64>,
}

impl SweepReport {
    /// Counts one push's outcome.
    pub fn add(&mut self, o: &Attempt) {
        match o {
            Attempt::Delivered { latency_ms, life_left_ms, after_death, token_died } => {
                self.delivered += 1;
                self.latencies_ms.push(*latency_ms);
                self.life_left_ms.extend(life_left_ms);
                self.delivered_after_death += u64::from(*after_death);
                self.token_died += u64::from(*token_died);
            }
            Attempt::AlreadyDelivered => self.already_delivered += 1,
            Attempt::Retried { token_died } => {
                self.retried += 1;
                self.token_died += u64::from(*token_died);
            }
            Attempt::Parked { refused } => {
                self.parked += 1;
                self.refused += u64::from(*refused);
            }
            Attempt::Gone => self.gone += 1,
            Attempt::Lost | Attempt::Deferred => self.lost += 1,
        }
    }

    /// The metrics the template's alarms and dashboard read.
    pub fn emit(&self) {
        metrics::counter!("deliveries_delivered").increment(self.delivered);
        metrics::counter!("deliveries_retried").increment(self.retried);
        metrics::counter!("deliveries_parked").increment(self.parked);
        metrics::counter!("deliveries_gone").increment(self.gone);
        metrics::counter!("deliveries_refused").increment(self.refused);
        metrics::counter!("delivery_errors").increment(self.errors);
        metrics::counter!("delivery_token_died").increment(self.token_died);
        metrics::counter!("deliveries_after_token_death").increment(self.delivered_after_death);
        metrics::gauge!("oldest_delivery_due_seconds").set(self.oldest_due_secs as f64);
        for ms in &self.latencies_ms {
            metrics::histogram!("delivery_latency_ms").record(*ms as f64);
        }
        for ms in &self.life_left_ms {
            metrics::histogram!("delivery_token_life_left_ms").record(*ms as f64);
        }
    }
}

/// How one claimed push ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    Delivered {
        /// From the result's record to the owner's 2xx.
        latency_ms: u64,
        /// The token's life left when it was sent, for a push that carried one.
        life_left_ms: Option<u64>,
        /// An expired notice, for a result that was fresh when recorded.
        after_death: bool,
        /// The first attempt after its token died (see [`SweepReport::token_died`]).
        token_died: bool,
    },
    AlreadyDelivered,
    Retried {
        token_died: bool,
    },
    Parked {
        refused: bool,
    },
    Gone,
    /// Another worker, or a newer result, got there first.
    Lost,
    /// Its host's turn came too late for the claim: given back, due again a moment later.
    Deferred,
}

/// The worker.
pub struct Deliverer {
    pub store: TaskStore,
    pub sender: Sender,
    pub keys: KeySource,
    pub settings: DeliverySettings,
    /// Names this worker's leases (unique per process).
    pub worker: String,
    /// The per-host gates (their state is logged and measured).
    pub hosts: HostGates,
    wakeups: Option<Arc<dyn Wakeups>>,
}

impl std::fmt::Debug for Deliverer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliverer").field("worker", &self.worker).field("settings", &self.settings).finish()
    }
}

/// The JSON push of a task that was not submitted through `in.php`.
#[derive(Serialize)]
struct Envelope<'a> {
    #[serde(rename = "type")]
    kind: String,
    timestamp: String,
    data: &'a TaskView,
}

/// A child push of a sweep or the worker loop: its task, what came of it, and its busy guard
/// handed back (see [`Deliverer::deliver_all`]).
type Child = (TaskRef, Result<Attempt, StoreError>, Busy);

impl Deliverer {
    pub fn new(store: TaskStore, keys: KeySource, settings: DeliverySettings) -> anyhow::Result<Self> {
        Ok(Self {
            // The request's time limit is kept on the worker's clock (so a simulation charges
            // it); the client's own is a backstop behind it.
            sender: Sender::new(settings.policy, settings.timeout + Duration::from_secs(30))?,
            store,
            keys,
            settings,
            worker: format!("dlv-{}", uuid::Uuid::new_v4().simple()),
            hosts: HostGates::default(),
            wakeups: None,
        })
    }

    /// The same worker, telling `w` when a push it put off falls due.
    #[must_use]
    pub fn with_wakeups(mut self, w: Arc<dyn Wakeups>) -> Self {
        self.wakeups = Some(w);
        self
    }

    /// Up to a page per shard of the pushes due at `now`; `true` if a shard had more.
    async fn due_now(&self, now: Timestamp, report: &mut SweepReport) -> (Vec<DueDelivery>, bool) {
        let mut batch = Vec::new();
        let mut more = false;
        let pages = (0..self.store.shards().read()).map(|shard| self.store.due_deliveries(shard, now, 100, None));
        for page in futures_util::future::join_all(pages).await {
            match page {
                Ok((due, next)) => {
                    more |= next.is_some();
                    batch.extend(due);
                }
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "delivery_query_failed", error = %e);
                }
            }
        }
        (batch, more)
    }

    /// The scheduled sweep: works through every push due, then — while its invocation has
    /// time — waits for the next one to fall due (a retry, a lapsing claim of a worker that
    /// died) and takes that too, looking again at least every 10 s; it ends at once when
    /// nothing will fall due before `deadline` (a request and its writes must fit before it).
    /// A store failure does not end it: it looks again after [`SWEEP_TROUBLE_WAIT`] (1 s,
    /// 2 s, 4 s, then every 8 s) for as long as its invocation has time. The sweep is what
    /// takes the pushes whose stream record or retry message met the store's trouble, and a
    /// token in one of them has a minute or two to live, not until the next sweep.
    pub async fn sweep(self: &Arc<Self>, clock: Arc<dyn Clock>, deadline: Timestamp) -> SweepReport {
        let busy = clock.busy();
        self.sweep_held(clock, deadline, busy).await.0
    }

    /// [`Self::sweep`] for a caller that holds a busy guard on a simulated clock: it is given
    /// and handed back.
    pub async fn sweep_held(
        self: &Arc<Self>,
        clock: Arc<dyn Clock>,
        deadline: Timestamp,
        mut busy: Busy,
    ) -> (SweepReport, Busy) {
        let mut report = SweepReport::default();
        let margin = self.settings.lease();
        // Passes in a row that met a store failure.
        let mut trouble = 0u32;
        loop {
            let errors_before = report.errors;
            loop {
                let now = clock.now();
                if now.plus(margin) > deadline {
                    break;
                }
                let (batch, _) = self.due_now(now, &mut report).await;
                if batch.is_empty() {
                    break;
                }
                let (_, b) = self.deliver_all(batch, &clock, &mut report, busy).await;
                busy = b;
                if report.errors > errors_before {
                    // The store is in trouble: wait before the next pass (below).
                    break;
                }
            }
            let now = clock.now();
            let oldest = match self.store.oldest_delivery_due().await {
                Ok(t) => t,
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "delivery_query_failed", error = %e);
                    None
                }
            };
            report.oldest_due_secs = oldest.map_or(0, |t| now.since(t).as_secs());
            let at = if report.errors > errors_before {
                // Whatever failed is still due in the index (a claim that was made lapses with
                // its lease): the next pass takes it, once the store has had a moment.
                trouble += 1;
                now.plus(crate::retry::backoff_delay(trouble, SWEEP_TROUBLE_WAIT, SWEEP_TROUBLE_MAX_WAIT))
            } else {
                trouble = 0;
                match oldest {
                    // Nothing falls due while a request and its writes still fit: done.
                    Some(t) if t.max(now).plus(margin) <= deadline => {
                        t.max(now.plus(Duration::from_millis(200))).min(now.plus(Duration::from_secs(10)))
                    }
                    _ => break,
                }
            };
            if at.plus(margin) > deadline {
                break;
            }
            clock.sleep_until(at).await;
        }
        self.log_hosts(clock.now());
        (report, busy)
    }

    /// Delivers `due` concurrently (within the per-host limits), counting each outcome into
    /// `report`. Returns the last store failure or panic, if any (those pushes stay due), and
    /// the busy guard: `busy` is given up while the pushes run (each holds its own) and the
    /// last one to finish hands back its own, so on a simulated clock time never moves between
    /// a push's end and the caller's next step.
    pub async fn deliver_all(
        self: &Arc<Self>,
        due: Vec<DueDelivery>,
        clock: &Arc<dyn Clock>,
        report: &mut SweepReport,
        busy: Busy,
    ) -> (Option<String>, Busy) {
        if due.is_empty() {
            return (None, busy);
        }
        let mut work = tokio::task::JoinSet::new();
        for d in due {
            self.spawn_push(&mut work, d, clock);
        }
        // The pushes hold their own guards now; this one would keep a simulated clock still
        // while they wait on it.
        drop(busy);
        let mut held = None;
        let mut failed = None;
        while let Some(done) = work.join_next().await {
            let e = match done {
                Ok((_, res, b)) => {
                    // Only the last push's guard is kept: one held while the others sleep on
                    // the clock would keep a simulated clock from ever moving.
                    held = work.is_empty().then_some(b);
                    match res {
                        Ok(a) => {
                            report.add(&a);
                            continue;
                        }
                        Err(e) => e.to_string(),
                    }
                }
                Err(e) => format!("a push panicked: {e}"),
            };
            report.errors += 1;
            tracing::error!(event = "delivery_failed", error = %e);
            failed = Some(e);
        }
        (failed, held.unwrap_or_else(|| clock.busy()))
    }

    fn spawn_push(self: &Arc<Self>, work: &mut tokio::task::JoinSet<Child>, d: DueDelivery, clock: &Arc<dyn Clock>) {
        let (me, clock) = (self.clone(), clock.clone());
        let busy = clock.busy();
        work.spawn(async move {
            let res = me.deliver(&d, clock.as_ref()).await;
            (d.task_ref, res, busy)
        });
    }

    /// The worker loop of local mode (and the simulations): pushes told of by `inbox` — a
    /// result the store just wrote, a retry falling due — at once or when they fall due, and a
    /// catch-up pass over the due-for-delivery index every `catch_up` (and when the earliest
    /// claim there lapses: a worker that died), until `stop`.
    pub async fn run(
        self: Arc<Self>,
        clock: Arc<dyn Clock>,
        mut inbox: InboxRx,
        catch_up: Duration,
        mut stop: tokio::sync::watch::Receiver<bool>,
    ) -> SweepReport {
        let mut busy = clock.busy();
        let mut report = SweepReport::default();
        let mut timers: BTreeSet<(Timestamp, TaskRef)> = BTreeSet::new();
        let mut running: HashSet<TaskRef> = HashSet::new();
        let mut work: tokio::task::JoinSet<Child> = tokio::task::JoinSet::new();
        let mut next_pass = clock.now();
        let mut last_log = Instant::now();
        loop {
            let now = clock.now();
            if now >= next_pass {
                // The pass's store calls, with the inbox read meanwhile: a wake-up waiting
                // unread would hold its guard while a call sleeps in the SDK's back-off, and on a
                // simulated clock stop time (this loop is working: its own guard covers them).
                let pass = async {
                    let (batch, more) = self.due_now(now, &mut report).await;
                    (batch, more, self.store.oldest_delivery_due().await)
                };
                tokio::pin!(pass);
                let mut told = Vec::new();
                let (batch, more, oldest) = loop {
                    tokio::select! {
                        r = &mut pass => break r,
                        Some((due, _b)) = inbox.recv() => told.push(due),
                    }
                };
                for d in batch {
                    if running.insert(d.task_ref.clone()) {
                        self.spawn_push(&mut work, d, &clock);
                    }
                }
                for due in told {
                    self.take_in(due, &clock, &mut running, &mut work, &mut timers);
                }
                let now = clock.now();
                next_pass = match oldest {
                    _ if more => now.plus(Duration::from_millis(100)),
                    Ok(Some(t)) if t > now => t.min(now.plus(catch_up)),
                    _ => now.plus(catch_up),
                };
            }
            while let Some((at, _)) = timers.first()
                && *at <= now
            {
                let Some((at, task_ref)) = timers.pop_first() else { break };
                if running.insert(task_ref.clone()) {
                    self.spawn_push(&mut work, DueDelivery { task_ref, due_at: at }, &clock);
                }
            }
            if last_log.elapsed() >= Duration::from_secs(60) {
                last_log = Instant::now();
                self.log_hosts(now);
            }
            let wake_at = timers.first().map_or(next_pass, |(t, _)| (*t).min(next_pass));
            tokio::select! {
                biased;
                _ = stop.wait_for(|s| *s) => break,
                Some(done) = work.join_next(), if !work.is_empty() => match done {
                    Ok((task_ref, res, b)) => {
                        running.remove(&task_ref);
                        busy = b;
                        match res {
                            Ok(a) => report.add(&a),
                            Err(e) => {
                                report.errors += 1;
                                tracing::error!(event = "delivery_failed", task_ref = %task_ref, error = %e);
                            }
                        }
                    }
                    Err(e) => {
                        // Its claim lapses with its lease and the catch-up pass takes it again.
                        report.errors += 1;
                        tracing::error!(event = "delivery_failed", error = %format!("a push panicked: {e}"));
                    }
                },
                m = inbox.recv() => match m {
                    Some((due, _b)) => self.take_in(due, &clock, &mut running, &mut work, &mut timers),
                    None => break,
                },
                () = clock.sleep_until(wake_at) => {}
            }
        }
        drop(busy);
        report
    }

    /// A push the inbox told of: started now if due (and not running), else timed.
    fn take_in(
        self: &Arc<Self>,
        due: DueDelivery,
        clock: &Arc<dyn Clock>,
        running: &mut HashSet<TaskRef>,
        work: &mut tokio::task::JoinSet<Child>,
        timers: &mut BTreeSet<(Timestamp, TaskRef)>,
    ) {
        if due.due_at <= clock.now() {
            if running.insert(due.task_ref.clone()) {
                self.spawn_push(work, due, clock);
            } else {
                // Pushed again while its attempt runs (a replay): look once it ends.
                timers.insert((clock.now().plus(Duration::from_secs(1)), due.task_ref));
            }
        } else {
            timers.insert((due.due_at, due.task_ref));
        }
    }

    fn log_hosts(&self, now: Timestamp) {
        for h in self.hosts.states(now, &self.settings) {
            metrics::histogram!("delivery_host_limit").record(f64::from(h.limit));
            tracing::info!(event = "delivery_host_state", host = %h.host, limit = h.limit, ceiling = h.ceiling, in_flight = h.in_flight, waiting = h.waiting);
        }
    }

    /// Claims one due push, waits for its host's turn, sends it, and records the outcome.
    pub async fn deliver(&self, due: &DueDelivery, clock: &dyn Clock) -> Result<Attempt, StoreError> {
        let now = clock.now();
        let lease_until = now.plus(self.settings.lease());
        let Some(mut task) = self.store.claim_delivery(due, &self.worker, lease_until).await? else {
            return Ok(Attempt::Lost);
        };
        let finish = |f: DeliveryFinish| async move {
            self.store.finish_delivery(&due.task_ref, &self.worker, lease_until, &f, clock.now()).await
        };
        let (Some(url), Some(id)) = (task.owner_callback.clone(), task.webhook_id()) else {
            // An open task in the index: nothing to push yet. Not reachable through the store's
            // writes; say so and leave it.
            finish(DeliveryFinish::Parked { outcome: "the task has no result to push".into() }).await?;
            return Ok(Attempt::Parked { refused: false });
        };
        let state = task.delivery.clone().unwrap_or_default();
        if state.delivered_id.as_deref() == Some(id.as_str()) {
            return Ok(if finish(DeliveryFinish::AlreadyDelivered { id }).await? {
                Attempt::AlreadyDelivered
            } else {
                Attempt::Lost
            });
        }
        // Claims that ended without an outcome (the worker died each time).
        let lost = state.attempts.saturating_sub(1 + state.failures.total());
        if lost >= schedule::LOST_ATTEMPTS_LIMIT {
            let outcome = format!("{lost} attempts were lost without an outcome (the worker stopped during each)");
            return Ok(if finish(DeliveryFinish::Parked { outcome }).await? {
                Attempt::Parked { refused: false }
            } else {
                Attempt::Lost
            });
        }
        // A pushed result is a result shown: pin it, as GET does, so it never changes after.
        if task.needs_pin(now) {
            match self.store.mark_handed_out(&task, now).await? {
                None => task.handed_out_at = Some(now),
                // A result received earlier replaced it meanwhile; that write made a new push
                // due (and took this lease): it goes out instead.
                Some(_) => return Ok(Attempt::Lost),
            }
        }
        let owner = task.webhook_owner.clone().unwrap_or_else(|| DEFAULT_OWNER.to_owned());
        let keys = self.keys.keys(&owner).await?;
        let host = url::Url::parse(&url)
            .ok()
            .and_then(|u| u.host_str().map(|h| format!("{h}:{}", u.port_or_known_default().unwrap_or(0))))
            .unwrap_or_default();
        let dies = task.token_dies_at();
        let recorded = resolved_at(&task).unwrap_or(now);
        let fresh_at_record = dies.is_some_and(|d| recorded < d);
        // Its place in the host's queue: when what it carries dies.
        let rank = match dies {
            Some(d) if now < d => d,
            _ => due.due_at.plus(hosts::NO_DEADLINE_SLACK),
        };
        let latest_start = self.settings.latest_start(lease_until);
        let gate = self.hosts.gate(&host);
        let Some(permit) = gate.acquire(&self.store, rank, latest_start, clock, &self.settings).await else {
            // No turn in time for this claim: given back, its attempt uncounted, due a moment
            // later.
            let at = clock.now().plus(Duration::from_secs(1));
            if !finish(DeliveryFinish::Deferred { at }).await? {
                return Ok(Attempt::Lost);
            }
            self.wake(&due.task_ref, at, clock.now()).await;
            return Ok(Attempt::Deferred);
        };
        if permit.not_before > clock.now() {
            clock.sleep_until(permit.not_before).await;
        }
        let sent_at = clock.now();
        // Built as it leaves: a token that died while it waited for its turn is not in it.
        let push = payload(&task, &url, sent_at);
        let out = Outgoing {
            url: &push.url,
            method: push.method,
            msg_id: &id,
            timestamp: sent_at.as_secs(),
            content_type: push.content_type,
            body: push.body,
            keys: &keys,
        };
        let result = {
            let _io = clock.io();
            tokio::select! {
                r = self.sender.send(&out) => r,
                () = clock.sleep_until(sent_at.plus(self.settings.timeout)) => {
                    AttemptResult::Retry { status: None, error: "timed out".into(), retry_after: None }
                }
            }
        };
        gate.release(permit, &self.store, signal_of(&result), clock, &self.settings).await;
        let now = clock.now();
        let attempts = state.attempts;
        let after_death = fresh_at_record && dies.is_some_and(|d| sent_at >= d);
        let token_died = after_death && state.failures.standard == 0;
        if token_died {
            tracing::warn!(event = "delivery_token_died", task_ref = %task.task_ref, recorded = %recorded, attempts);
        }
        let mut wake_at = None;
        let (f, attempt) = match result {
            AttemptResult::Delivered { status } => {
                let latency_ms = now.as_millis().saturating_sub(recorded.as_millis());
                let life_left_ms = dies.filter(|d| sent_at < *d).map(|d| d.since(sent_at).as_millis() as u64);
                (
                    DeliveryFinish::Delivered { id, outcome: format!("HTTP {status}") },
                    Attempt::Delivered { latency_ms, life_left_ms, after_death, token_died },
                )
            }
            AttemptResult::Retry { status, error, retry_after } => {
                let outcome = match status {
                    Some(s) => format!("HTTP {s}: {error}"),
                    None => error,
                };
                let failed = schedule::Failed { sent_at, ended_at: now, retry_after };
                match schedule::after_failure(dies, &failed, state.failures, self.settings.max_attempts, jitter()) {
                    schedule::Next::Retry { at, failures, .. } => {
                        wake_at = Some(at);
                        (DeliveryFinish::Retry { at, outcome, failures }, Attempt::Retried { token_died })
                    }
                    schedule::Next::Park => (
                        DeliveryFinish::Parked { outcome: format!("{attempts} attempts failed, the last: {outcome}") },
                        Attempt::Parked { refused: false },
                    ),
                }
            }
            AttemptResult::Gone => (DeliveryFinish::Gone { outcome: "HTTP 410".into() }, Attempt::Gone),
            AttemptResult::Refused { reason } => {
                tracing::warn!(event = "delivery_refused", task_ref = %task.task_ref, reason);
                (DeliveryFinish::Parked { outcome: format!("refused: {reason}") }, Attempt::Parked { refused: true })
            }
        };
        tracing::info!(event = "delivery_attempt", task_ref = %task.task_ref, webhook_id = %webhook_id_of(&f), attempts, outcome = ?attempt);
        if !finish(f).await? {
            return Ok(Attempt::Lost);
        }
        if let Some(at) = wake_at {
            self.wake(&due.task_ref, at, now).await;
        }
        Ok(attempt)
    }

    async fn wake(&self, task_ref: &TaskRef, at: Timestamp, now: Timestamp) {
        if let Some(w) = &self.wakeups {
            w.due_at(DueDelivery { task_ref: task_ref.clone(), due_at: at }, now).await;
        }
    }
}

/// What an attempt's answer says about the host's load (see [`hosts`]).
fn signal_of(r: &AttemptResult) -> Signal {
    match r {
        AttemptResult::Delivered { .. } | AttemptResult::Gone => Signal::Ok,
        AttemptResult::Retry { status: Some(429 | 503), .. } => Signal::Overloaded,
        AttemptResult::Retry { status: None, error, .. } if error.starts_with("connection failed") => {
            Signal::Overloaded
        }
        _ => Signal::Neutral,
    }
}

fn webhook_id_of(f: &DeliveryFinish) -> &str {
    match f {
        DeliveryFinish::Delivered { id, .. } | DeliveryFinish::AlreadyDelivered { id } => id,
        _ => "",
    }
}

fn resolved_at(task: &Task) -> Option<Timestamp> {
    match &task.state {
        TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } => Some(*resolved_at),
        TaskState::Expired { late: Some(l), .. } => Some(l.received_at),
        TaskState::Expired { resolved_at, .. } => Some(*resolved_at),
        _ => None,
    }
}

/// A number in [0, 1) for the retry schedule's jitter.
fn jitter() -> f64 {
    crate::retry::unit_random()
}

/// One push as it leaves: where, how, and what.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Push {
    pub method: PushMethod,
    pub url: String,
    pub content_type: &'static str,
    pub body: Vec<u8>,
}

/// The push of `task`'s result to `url` at `now`. A compat task (submitted through `in.php`
/// with a `pingback`) gets the pingback its handler already parses: CaptchaAI's
/// `GET <url>?id=<id>&code=<answer>` (appended to the URL's own query), or 2captcha's `POST`
/// form `id=<id>&code=<answer>` where its relay key says so. Other tasks get JSON. A token is in
/// it only while fresh, as in every other answer.
pub fn payload(task: &Task, url: &str, now: Timestamp) -> Push {
    if let Some(id) = task.task_ref.compat_id() {
        let (_, code) = task.compat_answer(now);
        let pairs = [("id", id.to_string()), ("code", code)];
        return match task.pingback_form {
            PingbackForm::Get => {
                let url = match url::Url::parse(url) {
                    Ok(mut u) => {
                        u.query_pairs_mut().extend_pairs(pairs.iter().map(|(k, v)| (*k, v.as_str())));
                        u.to_string()
                    }
                    // Checked at submit; an unparseable one is refused by the sender as it is.
                    Err(_) => url.to_owned(),
                };
                Push { method: PushMethod::Get, url, content_type: "", body: Vec::new() }
            }
            PingbackForm::Post => Push {
                method: PushMethod::Post,
                url: url.to_owned(),
                content_type: "application/x-www-form-urlencoded",
                body: serde_urlencoded::to_string(pairs).unwrap_or_default().into_bytes(),
            },
        };
    }
    let mut view = task.view(now);
    view.delivery = None;
    let env = Envelope { kind: format!("task.{}", view.status), timestamp: now.to_rfc3339(), data: &view };
    Push {
        method: PushMethod::Post,
        url: url.to_owned(),
        content_type: "application/json",
        body: serde_json::to_vec(&env).unwrap_or_default(),
    }
}

/// Checks an owner's callback URL when a task is submitted, with a message for the caller.
pub fn check_owner_url(url: &str, policy: UrlPolicy) -> Result<String, String> {
    crate::webhook::check_url(url, policy).map(|u| u.to_string()).map_err(|e| e.0)
}

/// Pushes to owners' callbacks that an operator looks at: the parked ones (every attempt
/// failed, or the URL was refused at send time), listed by when they were parked, and replayed
/// in bulk (by time range) or one task at a time. A replay makes the push due now with a fresh
/// set of attempts; the `webhook-id` stays the same for the same result.
pub mod operator {
    use crate::domain::{DeliveryStatus, TaskRef};
    use crate::store::{StoreError, TaskStore};
    use crate::time::Timestamp;

    /// One parked push, as `deliveries list` shows it (never the token, never the URL's path or
    /// query: only its host).
    #[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
    pub struct Parked {
        pub task_ref: String,
        pub parked_at: String,
        pub attempts: u32,
        pub last_outcome: String,
        pub host: String,
    }

    /// The parked pushes parked between `from` and `to`, oldest first.
    pub async fn list(
        store: &TaskStore,
        from: Timestamp,
        to: Timestamp,
        max: usize,
    ) -> Result<Vec<Parked>, StoreError> {
        let mut rows = Vec::new();
        for p in store.parked_deliveries(from, to, max).await? {
            // `to` is the listing's now: a task past its retention is not shown.
            let Some(task) = store.get_retained(&p.task_ref, to).await? else { continue };
            let Some(d) = task.delivery.as_ref().filter(|d| d.status == DeliveryStatus::Parked) else { continue };
            let host = task
                .owner_callback
                .as_deref()
                .and_then(|u| u.split("://").nth(1))
                .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or_default().to_owned())
                .unwrap_or_default();
            rows.push(Parked {
                task_ref: p.task_ref.to_string(),
                parked_at: p.due_at.to_rfc3339(),
                attempts: d.attempts,
                last_outcome: d.last_outcome.clone().unwrap_or_default(),
                host,
            });
        }
        Ok(rows)
    }

    /// What a replay did.
    #[derive(Debug, Default, Clone, PartialEq, Eq)]
    pub struct Replayed {
        /// Made due again.
        pub replayed: Vec<String>,
        /// Named but not replayable (no callback, still open, or already due), with the reason.
        pub skipped: Vec<(String, String)>,
    }

    /// Replays the named tasks' pushes (parked, gone or delivered alike: an owner may ask again).
    pub async fn replay_tasks(store: &TaskStore, refs: &[String], now: Timestamp) -> Result<Replayed, StoreError> {
        let mut out = Replayed::default();
        for raw in refs {
            let task_ref = match TaskRef::parse(raw.trim()).or_else(|_| TaskRef::from_compat_id(raw.trim())) {
                Ok(r) => r,
                Err(e) => {
                    out.skipped.push((raw.clone(), e.0));
                    continue;
                }
            };
            if store.get_retained(&task_ref, now).await?.is_none() {
                out.skipped.push((raw.clone(), "no such task (or its retention has ended)".into()));
                continue;
            }
            if store.replay_delivery(&task_ref, now).await? {
                out.replayed.push(task_ref.to_string());
            } else {
                out.skipped.push((
                    raw.clone(),
                    "no push to replay (no callback URL, the task is still open, or its push is already due)".into(),
                ));
            }
        }
        Ok(out)
    }

    /// Replays every push parked between `from` and `to`, at most `max`.
    pub async fn replay_parked(
        store: &TaskStore,
        from: Timestamp,
        to: Timestamp,
        max: usize,
        now: Timestamp,
    ) -> Result<Replayed, StoreError> {
        let refs: Vec<String> =
            store.parked_deliveries(from, to, max).await?.into_iter().map(|p| p.task_ref.to_string()).collect();
        replay_tasks(store, &refs, now).await
    }

    /// `deliveries list` as a table.
    pub fn render_table(rows: &[Parked]) -> String {
        let mut s =
            format!("{:<37} {:<25} {:>8}  {:<30} {}\n", "TASK", "PARKED AT", "ATTEMPTS", "HOST", "LAST OUTCOME");
        for r in rows {
            s.push_str(&format!(
                "{:<37} {:<25} {:>8}  {:<30} {}\n",
                r.task_ref, r.parked_at, r.attempts, r.host, r.last_outcome
            ));
        }
        s
    }

    /// A time given as RFC 3339 (`2026-12-04T07:00:00Z`) or as a span ago (`90m`, `24h`, `7d`).
    pub fn parse_time(text: &str, now: Timestamp) -> Result<Timestamp, String> {
        let t = text.trim();
        if let Ok(d) = humantime::parse_duration(t) {
            return Ok(now.minus(d));
        }
        humantime::parse_rfc3339_weak(t)
            .ok()
            .and_then(|st| st.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| Timestamp::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
            .ok_or_else(|| format!("`{t}` is neither a time like 2026-12-04T07:00:00Z nor a span ago like 24h"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::domain::{CaptchaKind, Solution, TaskRef, Via};

    fn solved(task_ref: TaskRef, token: &str) -> Task {
        let at = Timestamp::from_millis(1_000_000);
        Task {
            state: TaskState::Solved {
                solution: Solution::parse(token).expect("token"),
                resolved_at: at,
                via: Via::Callback,
                token_clock_start: at,
            },
            owner_callback: Some("https://owner.example/cb".into()),
            ..Task::new(task_ref, CaptchaKind::RecaptchaV2, Timestamp::from_millis(900_000))
        }
    }

    #[test]
    fn a_compat_push_is_captchaais_get_pingback_and_never_carries_a_stale_token() {
        let (r, id) = TaskRef::generate_compat();
        let task = solved(r, "03AGdBq2-token");
        // Appended to the URL's own query, as CaptchaAI does: the owner's route reads `id` and `code`.
        let p = payload(&task, "https://owner.example/cb?src=relay", Timestamp::from_millis(1_010_000));
        assert_eq!(p.method, PushMethod::Get);
        assert_eq!(p.url, format!("https://owner.example/cb?src=relay&id={id}&code=03AGdBq2-token"));
        assert!(p.body.is_empty());
        // 120 s after the solve the token is past its lifetime: the push says so instead.
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_121_000));
        assert_eq!(p.url, format!("https://owner.example/cb?id={id}&code=ERROR_TOKEN_EXPIRED"));
    }

    #[test]
    fn a_compat_push_of_a_2captcha_key_is_the_post_form() {
        let (r, id) = TaskRef::generate_compat();
        let task = Task { pingback_form: PingbackForm::Post, ..solved(r, "03AGdBq2 token+/=") };
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_010_000));
        assert_eq!((p.method, p.content_type), (PushMethod::Post, "application/x-www-form-urlencoded"));
        assert_eq!(p.url, "https://owner.example/cb");
        assert_eq!(String::from_utf8(p.body).expect("utf8"), format!("id={id}&code=03AGdBq2+token%2B%2F%3D"));
    }

    #[test]
    fn a_json_push_is_the_task_view_typed_by_status_and_its_id_follows_the_result() {
        let task = solved(TaskRef::generate(), "03AGdBq2-token");
        let p = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_010_000));
        assert_eq!((p.method, p.content_type), (PushMethod::Post, "application/json"));
        let v: serde_json::Value = serde_json::from_slice(&p.body).expect("json");
        assert_eq!(v["type"], "task.solved");
        assert_eq!(v["data"]["solution"], "03AGdBq2-token");
        assert_eq!(v["data"]["task_ref"], task.task_ref.as_ref());
        assert!(v["data"].get("delivery").is_none(), "the push does not describe itself");
        let body = payload(&task, "https://owner.example/cb", Timestamp::from_millis(1_121_000)).body;
        let v: serde_json::Value = serde_json::from_slice(&body).expect("json");
        assert_eq!(v["type"], "task.expired");
        assert!(v["data"].get("solution").is_none(), "a stale token is never pushed");
        // The webhook-id: the same for the same result whenever it is sent, another for another.
        let id = task.webhook_id().expect("terminal");
        assert!(id.starts_with("msg_") && id.len() == 36, "{id}");
        assert_eq!(solved(task.task_ref.clone(), "03AGdBq2-token").webhook_id(), Some(id.clone()));
        assert_ne!(solved(task.task_ref.clone(), "03AGdBq2-other").webhook_id(), Some(id));
        assert_eq!(Task::new(TaskRef::generate(), CaptchaKind::Image, Timestamp::from_millis(0)).webhook_id(), None);
    }

    #[test]
    fn settings_are_checked_with_clear_messages() {
        let env =
            |pairs: &[(&str, &str)]| DeliverySettings::from_settings(&Settings::from_pairs(pairs.iter().copied()));
        assert_eq!(env(&[]).expect("defaults").max_attempts, 7);
        assert_eq!(env(&[]).expect("defaults").policy, UrlPolicy::PublicHttps);
        assert_eq!(env(&[("DELIVERY_URL_POLICY", "allow_loopback")]).expect("ok").policy, UrlPolicy::AllowLoopback);
        for (k, v) in [
            ("DELIVERY_URL_POLICY", "anything"),
            ("DELIVERY_TIMEOUT_SECS", "0"),
            ("DELIVERY_TIMEOUT_SECS", "31"),
            ("DELIVERY_MAX_ATTEMPTS", "0"),
            ("DELIVERY_PER_HOST_CONCURRENCY", "0"),
            ("DELIVERY_PER_HOST_PER_SECOND", "x"),
        ] {
            let e = env(&[(k, v)]).expect_err(k).to_string();
            assert!(e.contains(k), "{e}");
        }
    }
}

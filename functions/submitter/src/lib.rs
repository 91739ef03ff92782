//! The submitter: releases the submit queue to CaptchaAI's in.php as its threads free.
//!
//! CaptchaAI sells threads; a burst above the plan is the normal day. The API accepts every
//! valid task: at once while a thread is free (a *permit* this function publishes), into the
//! queue otherwise (see [`relay_shared::submit`] and [`relay_shared::store::queue`]). One run of
//! this function — [`run`] — holds the queue's lease (one releaser at a time, whatever the
//! number of invocations) and, until its period ends:
//! - counts the tasks CaptchaAI may be working on (the index's in-work entries, plus its own
//!   releases the index may not show yet) and sends the next queued task whenever that count is
//!   below the learnt window ([`relay_shared::submit::window`]) and the account-wide in.php pace
//!   has a slot;
//! - picks the next task fairly: owners take turns, tokens before an owner's image backlog
//!   ([`relay_shared::submit::lanes`]), oldest first in each lane;
//! - sends each task at most once per release, marking it in work *before* in.php is called;
//!   a "no slot" answer, a ban or a server error code puts it back at its place in the queue
//!   (nothing was taken), an answer that proves nothing leaves it "outcome unknown" (never sent
//!   again), a final refusal fails it;
//! - fails a task that waited longer than `QUEUE_MAX_WAIT_SECS` (never sent, nothing paid);
//! - publishes, with each renewal of its lease, how many inline submits the API may make.
//!
//! Triggers: a write to the wake item (the API writes it when it queues a task and no releaser
//! runs; the table's stream invokes this function), and a schedule every minute (a backstop,
//! and the next run when one ends with tasks left — it also wakes its successor itself). Local
//! mode runs [`serve_local`], woken in-process. Every wait goes through a [`Clock`].

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;
use std::time::Duration;

use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError};
use relay_shared::config::{CallbackGrace, ConfigError, Settings};
use relay_shared::deadletter::{DeadLetterSink, SqsQueue};
use relay_shared::domain::TaskRef;
use relay_shared::store::{Publish, QueuedRef, Released, Stop, SubmitState, TaskStore};
use relay_shared::submit::lanes::{Fair, parse_lane};
use relay_shared::submit::window::{Gate, Window, WindowState};
use relay_shared::submit::{InPhp, QUEUE_TIMEOUT, QueueSettings, Recorder, Upstream, Waker};
use relay_shared::time::{Clock, Timestamp};
use serde::Serialize;

/// The most in.php calls the submitter has in flight at once (`SUBMIT_CONCURRENCY`).
pub const MAX_SUBMIT_CONCURRENCY: usize = 256;

/// The submitter's knobs. Defaults are what the template deploys.
#[derive(Debug, Clone)]
pub struct SubmitterSettings {
    pub queue: QueueSettings,
    /// How often it looks at the threads in use while tasks wait.
    pub tick: Duration,
    /// How long its lease lasts unrenewed (a run that dies frees the queue this long after).
    pub lease: Duration,
    /// How long a run that released tasks goes on once the queue is empty (new tasks then go
    /// inline with the permits it keeps publishing).
    pub linger: Duration,
    /// In.php calls in flight at once.
    pub concurrency: usize,
    /// A run releases within this period from its start (the schedule's).
    pub period: Duration,
    /// Kept back from the invocation's deadline.
    pub safety_margin: Duration,
    /// Longest wait for one in.php answer (the client's timeout).
    pub submit_timeout: Duration,
    /// A released task counts in work for at least this long after its release (DynamoDB may
    /// not list it in the index yet: a global secondary index is eventually consistent, typically
    /// within a second).
    pub index_lag: Duration,
    /// Nothing is sent for this long after in.php refused for now (a server error code, a
    /// connection that never opened).
    pub transient_pause: Duration,
}

impl Default for SubmitterSettings {
    fn default() -> Self {
        Self {
            queue: QueueSettings::default(),
            tick: Duration::from_millis(200),
            lease: Duration::from_secs(10),
            linger: Duration::from_secs(10),
            concurrency: 8,
            period: Duration::from_secs(60),
            safety_margin: Duration::from_secs(2),
            submit_timeout: Duration::from_secs(15),
            index_lag: Duration::from_secs(1),
            transient_pause: Duration::from_secs(2),
        }
    }
}

impl SubmitterSettings {
    /// The defaults for `queue`'s pace: a second of in.php calls at the pace in flight
    /// (CaptchaAI answers in.php in a few hundred ms; 8 calls at once would hold a pace of
    /// 100/s to 8 / latency), at least 8.
    pub fn for_queue(queue: QueueSettings) -> Self {
        let concurrency = Self::default().concurrency.max(queue.submits_per_second as usize);
        Self { queue, concurrency: concurrency.min(MAX_SUBMIT_CONCURRENCY), ..Self::default() }
    }

    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::for_queue(QueueSettings::from_settings(env)?);
        Ok(Self {
            concurrency: env.parse_or("SUBMIT_CONCURRENCY", d.concurrency)?.clamp(1, MAX_SUBMIT_CONCURRENCY),
            period: Duration::from_secs(60 * env.parse_or("SUBMIT_SCHEDULE_MINUTES", 1u64)?.max(1)),
            ..d
        })
    }
}

/// What the submitter needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: TaskStore,
    pub captchaai: CaptchaAiClient,
    pub dead_letters: Arc<dyn DeadLetterSink>,
    pub grace: CallbackGrace,
    pub settings: SubmitterSettings,
    /// This instance's name on the lease.
    pub owner: String,
    /// Wakes the next run when this one ends with tasks left.
    pub waker: Arc<dyn Waker>,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{CaptchaAiConfig, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let cai = CaptchaAiConfig::from_settings(&env)?;
        let settings = SubmitterSettings::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let key = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cai.api_key)
            .await
            .context("loading the CaptchaAI key")?;
        let store = TaskStore::from_config(&aws, &store_cfg);
        Ok(Self {
            waker: Arc::new(relay_shared::submit::StoreWaker(store.clone())),
            store,
            captchaai: CaptchaAiClient::new(&cai.base_url, key, cai.timeout, cai.soft_id)?,
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
            grace: CallbackGrace::from_settings(&env)?,
            settings: SubmitterSettings { submit_timeout: cai.timeout, ..settings },
            owner: format!("submitter-{}", uuid::Uuid::new_v4().simple()),
        })
    }
}

/// What one run did. Logged as one structured line.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RunReport {
    /// Another run holds the queue: this one did nothing.
    pub lease_held_elsewhere: bool,
    /// The lease was taken over mid-run (this run's renewals lapsed).
    pub lease_lost: bool,
    /// In.php calls made.
    pub released: u64,
    pub accepted: u64,
    /// "No slot" answers (back to the queue).
    pub no_slot: u64,
    /// Answers that prove nothing (never sent again).
    pub unknown: u64,
    /// Back to the queue for a ban or a server error code.
    pub requeued: u64,
    /// Refused for good at release.
    pub failed: u64,
    /// Waited longer than `QUEUE_MAX_WAIT_SECS`: failed, never sent.
    pub timed_out: u64,
    pub bans: u64,
    pub errors: u64,
    /// Tasks queued, most seen at once.
    pub max_queued: u64,
    /// Tasks queued at the end.
    pub queued_at_end: u64,
    /// The longest any task seen at the head of its lane had waited.
    pub oldest_queued_secs: u64,
    pub max_in_flight: u32,
    /// The window at the end.
    pub window: u32,
    /// The plan's threads as `threadsinfo` stated them in this run, if it was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<u32>,
    /// Whether this run found the plan run out (`ERROR_ZERO_BALANCE` with threads free) and
    /// stopped submits.
    pub plan_out: bool,
    /// Lane counts set right against the index.
    pub reconciled: u64,
    /// It ended with tasks queued and woke the next run.
    pub handed_over: bool,
    /// It published its metrics ([`METRICS`]; an idle run publishes none).
    pub metrics_published: bool,
}

/// The metrics a run that saw the queue used publishes (namespace `CaptchaRelay`, service
/// `submitter`).
pub const METRICS: [&str; 8] = [
    "submit_queue_depth",
    "submit_queue_oldest_seconds",
    "submit_window",
    "submit_in_flight",
    "submit_released",
    "submit_requeued",
    "submit_unknown",
    "submitter_errors",
];

/// The Lambda entry point (a schedule, or a stream batch with the wake item: the payload says
/// nothing the run needs).
pub async fn handle(
    event: lambda_runtime::LambdaEvent<serde_json::Value>,
    deps: &Deps,
    clock: Arc<dyn Clock>,
) -> Result<RunReport, lambda_runtime::Error> {
    let now = clock.now();
    let left = relay_shared::time_left(event.context.deadline, now);
    Ok(run(deps, clock, now.plus(left), None).await)
}

/// Local mode's submitter: a run whenever `wake` is notified (a task was queued) and once a
/// minute (the schedule), until `stop`.
pub async fn serve_local(
    deps: &Deps,
    clock: Arc<dyn Clock>,
    wake: Arc<tokio::sync::Notify>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let _busy = clock.busy();
    loop {
        let deadline = clock.now().plus(deps.settings.period + Duration::from_secs(15));
        tokio::select! {
            report = run(deps, clock.clone(), deadline, Some(wake.clone())) => {
                tracing::debug!(?report, "local submitter run");
            }
            _ = stop.wait_for(|s| *s) => return,
        }
        tokio::select! {
            _ = wake.notified() => {}
            _ = clock.sleep_until(clock.now().plus(deps.settings.period)) => {}
            _ = stop.wait_for(|s| *s) => return,
        }
    }
}

/// An in.php call that has answered.
struct Sent {
    released: Released,
    /// Tasks in work when it was sent (not counting it).
    in_flight: u32,
    answer: Result<relay_shared::domain::CaptchaId, CaptchaAiError>,
}

/// A lane's view in this run.
#[derive(Default)]
struct Lane {
    /// The next tasks, oldest first (read from the index).
    heads: VecDeque<QueuedRef>,
    /// The index listed nothing at this time, while the lane's count was this.
    empty: Option<(Timestamp, u64)>,
}

/// Longest wait for `threadsinfo`.
const PLAN_READ_TIMEOUT: Duration = Duration::from_secs(5);
/// `threadsinfo` asked after an `ERROR_ZERO_BALANCE` at most this often.
const PLAN_CHECK_EVERY: Duration = Duration::from_secs(10);
/// `threadsinfo` asked at most this often to correct the count of tasks in work.
const WORKING_READ_EVERY: Duration = Duration::from_secs(5);
/// How long submits stop once the plan is found run out; the next submit after it asks again.
pub const PLAN_OUT_PAUSE: Duration = Duration::from_secs(300);

/// One run: holds the queue's lease and releases queued tasks as threads free, until its
/// period ends (or, once the queue is empty, `linger` later; at once if it released nothing).
/// `deadline` is the invocation's hard end: sends start only while their answer and its writes
/// can finish before it. The caller holds the clock's busy guard for it (a simulated clock needs
/// one).
pub async fn run(
    deps: &Deps,
    clock: Arc<dyn Clock>,
    deadline: Timestamp,
    wake: Option<Arc<tokio::sync::Notify>>,
) -> RunReport {
    let s = &deps.settings;
    let mut report = RunReport::default();
    let start = clock.now();
    let send_until =
        start.plus(s.period).min(deadline.minus(s.safety_margin + s.submit_timeout + 2 * TaskStore::CALL_TIMEOUT));
    let mut state = match take_lease(deps, &clock, send_until, &mut report).await {
        Some(st) => st,
        None => return report,
    };
    let saved: Option<WindowState> = state.window.as_deref().and_then(|w| serde_json::from_str(w).ok());
    let mut r = Run {
        plan_out_seen: 0,
        plan_checked_at: None,
        working: None,
        sent_since_plan_read: 0,
        deps,
        clock: clock.clone(),
        window: Window::restore(s.queue.window.clone(), saved.as_ref()),
        lanes: HashMap::new(),
        fair: Fair::default(),
        mine: HashMap::new(),
        released: BTreeSet::new(),
        seen: None,
        released_at: VecDeque::new(),
        // Inline "no slot" answers no run took into the window yet (the first look applies them).
        api_no_slots: state.api_no_slots_seen,
        pause_until: start,
        pace_until: start,
        moved: BTreeMap::new(),
        looked_at: None,
        renewed_at: start,
    };
    // A lowered `QUEUE_SHARDS` leaves counts on items no longer read: folded in first.
    match r.deps.store.fold_queue_shards().await {
        Ok(0) => {}
        Ok(n) => {
            report.reconciled += n as u64;
            tracing::warn!(
                event = "queue_count_reconciled",
                items = n,
                "counts on queue shards beyond QUEUE_SHARDS folded in"
            );
        }
        Err(e) => {
            report.errors += 1;
            tracing::error!(event = "submitter_store_failed", error = %e, "could not fold the queue's counts");
        }
    }
    r.reconcile_lost_lanes(&state, &mut report).await;
    let mut calls: tokio::task::JoinSet<Sent> = tokio::task::JoinSet::new();
    let mut idle_since: Option<Timestamp> = None;
    let mut in_flight = 0;
    // Nothing queued, no inline "no slot" answer to learn from: republish the permits and end
    // (the scheduled run of an idle minute).
    let idle = state.queued == 0 && state.api_no_slots <= r.api_no_slots;
    // The plan, read rather than learnt from refusals, when there is work to release: at the
    // start and every few minutes — never while CaptchaAI traffic is stopped.
    if !idle
        && s.queue.upstream == Upstream::CaptchaAi
        && r.window.plan_due(start)
        && state.breaker.open_for_submits_at(start).is_none()
    {
        r.read_plan(&mut report).await;
    }
    loop {
        if idle {
            break;
        }
        let now = clock.now();
        report.max_queued = report.max_queued.max(state.queued);
        // The index once a tick; between looks, this run's own sends are counted as they go.
        let look = r.looked_at.is_none_or(|at| now.since(at) >= s.tick);
        let counted = if look {
            r.looked_at = Some(now);
            r.in_flight(now, &mut report).await.unwrap_or(in_flight)
        } else {
            in_flight
        };
        // What the table counts in work includes tasks whose pingback was lost (they look busy
        // until the poller reads them): with the plan known and the window full, CaptchaAI's
        // own count corrects it.
        let counted =
            if state.breaker.open_at(now).is_none() { r.corrected(counted, now, &mut report).await } else { counted };
        if counted < in_flight {
            // A task finished (its result recorded): progress, for the window's stall rule.
            r.window.finished(now);
        }
        in_flight = counted;
        report.max_in_flight = report.max_in_flight.max(in_flight);
        // "No slot" answers inline submits met since the last look: the plan is full.
        if state.api_no_slots > r.api_no_slots {
            r.window.no_slot(in_flight, now);
            r.api_no_slots = state.api_no_slots;
        }
        let breaker = state.breaker.open_for_submits_at(now);
        tracing::debug!(
            event = "submitter_tick",
            in_flight,
            limit = r.window.limit(now),
            gate = ?r.window.gate(in_flight, now),
            queued = state.queued,
            "a look at the queue"
        );
        if breaker.is_none() && now < send_until {
            r.release(&state, &mut in_flight, &mut calls, wake.is_some(), &mut report).await;
        } else {
            r.expire_heads(&state, now, &mut report).await;
        }
        // Wait for the next look: a tick, an answer, or (locally) a new task.
        let next = match breaker {
            Some(until) => until.min(now.plus(Duration::from_secs(5))),
            None => now.plus(s.tick),
        };
        tokio::select! {
            _ = clock.sleep_until(next) => {}
            Some(done) = calls.join_next(), if !calls.is_empty() => r.answered(done, &mut report).await,
            _ = async { match &wake { Some(w) => w.notified().await, None => std::future::pending().await } } => {}
        }
        while let Some(done) = calls.try_join_next() {
            r.answered(done, &mut report).await;
        }
        let now = clock.now();
        if now.since(r.renewed_at) < s.tick && now < send_until {
            // Renewed less than a tick ago (answers come faster than ticks at a high rate).
            continue;
        }
        r.flush_counts(&mut report).await;
        r.renewed_at = now;
        let publish = r.publish(in_flight, now);
        match deps.store.releaser_lease(&deps.owner, now, now.plus(s.lease), Some(&publish)).await {
            Ok(Some(st)) => state = st,
            Ok(None) => {
                // Another run took over (this one stalled past its lease): stop sending.
                tracing::warn!(event = "submitter_lease_lost", "another submitter holds the queue");
                report.lease_lost = true;
                break;
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not renew the queue's lease");
                report.errors += 1;
            }
        }
        if now >= send_until {
            break;
        }
        let waiting = state.queued > 0 || !calls.is_empty();
        if waiting {
            idle_since = None;
        } else {
            let since = *idle_since.get_or_insert(now);
            // Nothing released: nothing to linger for. Otherwise keep publishing permits a
            // little longer, for the tasks that follow a burst.
            if report.released == 0 || now.since(since) >= s.linger {
                break;
            }
        }
    }
    // The answers still owed (each call ends within the in.php timeout).
    while let Some(done) = calls.join_next().await {
        r.answered(done, &mut report).await;
    }
    let now = clock.now();
    r.flush_counts(&mut report).await;
    let in_flight = r.in_flight(now, &mut report).await.unwrap_or(in_flight);
    let publish = r.publish(in_flight, now);
    report.window = r.window.limit(now);
    if !report.lease_lost {
        if let Err(e) = deps.store.releaser_leave(&deps.owner, &publish).await {
            tracing::error!(event = "submitter_store_failed", error = %e, "could not leave the lease (it lapses)");
            report.errors += 1;
        }
        // A task queued while this run was ending must not wait for the schedule.
        match deps.store.submit_state().await {
            Ok(st) => {
                report.queued_at_end = st.queued;
                if st.queued > 0 {
                    report.handed_over = true;
                    deps.waker.wake(now).await;
                }
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e);
                report.errors += 1;
            }
        }
    }
    // An idle run publishes nothing: the queue's metrics exist while it is used (custom
    // metrics are billed by the hour they are published in).
    if report.max_queued + report.queued_at_end + report.released + report.errors > 0 {
        report.metrics_published = true;
        emit_metrics(&report);
    }
    tracing::info!(event = "submitter_run", report = %serde_json::to_string(&report).unwrap_or_default());
    report
}

/// Takes the queue's lease for this run. Held by another run: `None` at once — unless tasks
/// wait and the holder stopped renewing (it died): then it waits for the lease to lapse (within
/// the period) and takes it over.
async fn take_lease(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    send_until: Timestamp,
    report: &mut RunReport,
) -> Option<SubmitState> {
    let lease = deps.settings.lease;
    for attempt in 0..2 {
        let now = clock.now();
        match deps.store.releaser_lease(&deps.owner, now, now.plus(lease), None).await {
            Ok(Some(st)) => return Some(st),
            Ok(None) if attempt == 0 => {
                let st = match deps.store.submit_state().await {
                    Ok(st) => st,
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                        break;
                    }
                };
                let until = st.releaser_until.unwrap_or(now);
                // A live holder renews every tick: its lease ends about `lease` from now.
                let stalled = until.since(now) + Duration::from_secs(2) < lease;
                if st.queued == 0 || !stalled || until >= send_until {
                    break;
                }
                tracing::warn!(event = "submitter_lease_stalled", holder = ?st.releaser, "the queue's lease stopped being renewed: taking it over when it lapses");
                clock.sleep_until(until.plus(Duration::from_millis(50))).await;
            }
            Ok(None) => break,
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not take the queue's lease");
                report.errors += 1;
                return None;
            }
        }
    }
    report.lease_held_elsewhere = true;
    None
}

/// One run's working state.
struct Run<'a> {
    deps: &'a Deps,
    clock: Arc<dyn Clock>,
    window: Window,
    /// `ERROR_ZERO_BALANCE` answers in a row that `threadsinfo` showed with threads free.
    plan_out_seen: u32,
    /// When `threadsinfo` was last asked after such an answer.
    plan_checked_at: Option<Timestamp>,
    /// The plan's `working_threads` as last read while the window was full, and when.
    working: Option<(Timestamp, u32)>,
    /// Sends made since that read (they may be at work on top of what it counted).
    sent_since_plan_read: u32,
    lanes: HashMap<String, Lane>,
    fair: Fair,
    /// Tasks this run released: when (counted in work for `index_lag`, whatever the index says).
    mine: HashMap<TaskRef, Timestamp>,
    /// Tasks this run released that the index may still list (not inline submits).
    released: BTreeSet<TaskRef>,
    /// What the index listed in work at the last look (`None` before the first).
    seen: Option<BTreeSet<TaskRef>>,
    /// When each release of the last minute was made.
    released_at: VecDeque<Timestamp>,
    /// The count of inline "no slot" answers already taken into the window.
    api_no_slots: u64,
    /// No sends before this (a server error code).
    pause_until: Timestamp,
    /// The in.php pace's second was full: no sends before this.
    pace_until: Timestamp,
    /// Queue counts moved since the last write (releases, requeues, timeouts), per lane: one
    /// write a tick on the account's state item, not one per task.
    /// Count moves not written yet, by count item and lane.
    moved: BTreeMap<(u8, String), i64>,
    /// When the in-work index was last read, and the lease last renewed (at most once a tick
    /// each, however many answers come in between).
    looked_at: Option<Timestamp>,
    renewed_at: Timestamp,
}

impl Run<'_> {
    /// Tasks CaptchaAI may be working on: the index's in-work entries and this run's own
    /// recent sends. `None` if the index could not be read.
    ///
    /// Tasks that appear in work without this run having sent them were sent inline by the API
    /// with a permit, and CaptchaAI took them: the window learns from them as from its own.
    async fn in_flight(&mut self, now: Timestamp, report: &mut RunReport) -> Option<u32> {
        let lag = self.deps.settings.index_lag;
        self.mine.retain(|_, at| now.since(*at) < lag);
        match self.deps.store.in_work(now).await {
            Ok(refs) => {
                let listed: BTreeSet<TaskRef> = refs.into_iter().collect();
                let mut all = listed.clone();
                all.extend(self.mine.keys().cloned());
                if let Some(seen) = &self.seen {
                    let inline: Vec<&TaskRef> =
                        listed.iter().filter(|r| !seen.contains(*r) && !self.released.contains(*r)).collect();
                    let before = (all.len() - inline.len()) as u32;
                    for (i, _) in inline.iter().enumerate() {
                        self.window.accepted(before + i as u32, now);
                    }
                }
                self.released.retain(|r| listed.contains(r) || self.mine.contains_key(r));
                self.seen = Some(listed);
                Some(all.len() as u32)
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not count the tasks in work");
                report.errors += 1;
                None
            }
        }
    }

    /// What the next renewal publishes: the inline permits (none while anything waits).
    fn publish(&mut self, in_flight: u32, now: Timestamp) -> Publish {
        let from = now.minus(Duration::from_secs(60));
        while self.released_at.front().is_some_and(|t| *t <= from) {
            self.released_at.pop_front();
        }
        let queued = self.lanes.values().any(|l| !l.heads.is_empty());
        let permits = match self.window.gate(in_flight, now) {
            Gate::Open(n) if !queued && now >= self.pause_until => n.min(self.window.no_slot_budget_left(now)),
            _ => 0,
        };
        Publish {
            permits,
            window: serde_json::to_string(&self.window.state()).unwrap_or_default(),
            released_per_minute: self.released_at.len() as u64,
            api_no_slots_seen: self.api_no_slots,
        }
    }

    /// The lanes with tasks, as the counts say (less those the index just showed empty).
    fn waiting(&self, state: &SubmitState, now: Timestamp) -> BTreeSet<String> {
        state
            .lanes
            .iter()
            .filter(|(lane, count)| {
                parse_lane(lane).is_some()
                    && match self.lanes.get(*lane) {
                        Some(l) if !l.heads.is_empty() => true,
                        Some(Lane { empty: Some((at, seen)), .. }) => {
                            // Listed empty a moment ago at this count: look again in a second
                            // (the index lags a put).
                            **count > *seen || now.since(*at) >= Duration::from_secs(1)
                        }
                        _ => true,
                    }
            })
            .map(|(lane, _)| lane.clone())
            .collect()
    }

    /// The next task of `lane`, reading the index when its buffer is empty. A lane the index
    /// keeps listing empty while its count says otherwise has its count set right.
    async fn next_head(&mut self, lane: &str, state: &SubmitState, report: &mut RunReport) -> Option<QueuedRef> {
        let now = self.clock.now();
        let count = state.lanes.get(lane).copied().unwrap_or(0);
        let entry = self.lanes.entry(lane.to_owned()).or_default();
        if let Some(head) = entry.heads.pop_front() {
            return Some(head);
        }
        match self.deps.store.queue_heads(lane, 25).await {
            Ok(heads) if !heads.is_empty() => {
                entry.heads = heads.into();
                entry.empty = None;
                entry.heads.pop_front()
            }
            Ok(_) => {
                match entry.empty {
                    // Empty for 10 s at the same count: the count is a crash's leftover.
                    Some((since, seen)) if seen == count && now.since(since) >= Duration::from_secs(10) => {
                        match self.deps.store.reconcile_lane(lane, state, 0).await {
                            Ok(true) => {
                                report.reconciled += 1;
                                tracing::warn!(
                                    event = "queue_count_reconciled",
                                    lane,
                                    count,
                                    "a lane's count had no tasks behind it"
                                );
                            }
                            Ok(false) => {}
                            Err(e) => {
                                report.errors += 1;
                                tracing::error!(event = "submitter_store_failed", error = %e);
                            }
                        }
                        entry.empty = Some((now, 0));
                    }
                    Some((since, seen)) if seen == count => entry.empty = Some((since, seen)),
                    _ => entry.empty = Some((now, count)),
                }
                None
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not read the queue");
                entry.empty = Some((now, count));
                None
            }
        }
    }

    /// Lanes the index lists tasks in while their count says none (a count lost to a crash):
    /// counted again, so their tasks are released; and tasks listed on index shards a lowered
    /// `QUEUE_SHARDS` no longer reads: moved to theirs. Once per run.
    async fn reconcile_lost_lanes(&mut self, state: &SubmitState, report: &mut RunReport) {
        let listed = match self.deps.store.queued_lanes().await {
            Ok(l) => l,
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not scan the queue");
                return;
            }
        };
        let shards = self.deps.store.queue_shards();
        let mut per_lane: BTreeMap<String, u64> = BTreeMap::new();
        for ((lane, shard), n) in listed {
            *per_lane.entry(lane.clone()).or_default() += n;
            if shard >= shards {
                match self.deps.store.rehome_queued(&lane, shard).await {
                    Ok(moved) => {
                        report.reconciled += 1;
                        tracing::warn!(event = "queue_count_reconciled", lane = %lane, shard, moved, "queued tasks on a shard beyond QUEUE_SHARDS moved to theirs");
                    }
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                    }
                }
            }
        }
        for (lane, n) in per_lane {
            if state.lanes.get(&lane).copied().unwrap_or(0) == 0 {
                match self.deps.store.reconcile_lane(&lane, state, n).await {
                    Ok(true) => {
                        report.reconciled += 1;
                        tracing::warn!(event = "queue_count_reconciled", lane = %lane, n, "tasks queued in a lane counted empty");
                    }
                    Ok(false) => {}
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                    }
                }
            }
        }
    }

    /// Fails the tasks at the heads of their lanes that waited too long (while nothing can be
    /// sent: a ban, the end of the period).
    async fn expire_heads(&mut self, state: &SubmitState, now: Timestamp, report: &mut RunReport) {
        let lanes: Vec<String> = self.waiting(state, now).into_iter().collect();
        for lane in lanes {
            while let Some(head) = self.next_head(&lane, state, report).await {
                if !self.timed_out(&lane, &head, now, report).await {
                    self.lanes.entry(lane.clone()).or_default().heads.push_front(head);
                    break;
                }
            }
        }
    }

    /// Whether `head` waited too long (then it is failed, never sent).
    async fn timed_out(&mut self, lane: &str, head: &QueuedRef, now: Timestamp, report: &mut RunReport) -> bool {
        let waited = now.since(head.queued_at);
        report.oldest_queued_secs = report.oldest_queued_secs.max(waited.as_secs());
        let max = self.deps.settings.queue.max_wait;
        if waited < max {
            return false;
        }
        let detail = format!(
            "waited {} s in the relay's submit queue for a free CaptchaAI thread, longer than QUEUE_MAX_WAIT_SECS ({} s); \
             it was never sent to CaptchaAI and nothing was paid: submit it again",
            waited.as_secs(),
            max.as_secs()
        );
        match self.deps.store.fail_unsent(&head.task_ref, true, QUEUE_TIMEOUT, &detail, now).await {
            Ok(Some(_)) => {
                report.timed_out += 1;
                metrics::counter!("submit_queue_timeouts").increment(1);
                tracing::warn!(event = "queue_timeout", task_ref = %head.task_ref, waited_secs = waited.as_secs(), "queued too long; failed, never sent");
                self.uncount(lane, &head.task_ref);
            }
            Ok(None) => {}
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e);
            }
        }
        true
    }

    /// Counts a task out of `lane` on its count item (written with the tick's other moves,
    /// [`Self::flush_counts`]).
    fn uncount(&mut self, lane: &str, task_ref: &TaskRef) {
        let shard = self.deps.store.queue_shard(task_ref);
        *self.moved.entry((shard, lane.to_owned())).or_default() -= 1;
    }

    /// Writes the counts moved since the last flush, in one write. Failed, they are kept for
    /// the next one; a run that dies with some unwritten leaves its lanes counted too high,
    /// which the queue reconciles (a lane whose index is empty for 10 s is set to 0) — tasks are
    /// never unseen, only inline submits wait a little longer.
    async fn flush_counts(&mut self, report: &mut RunReport) {
        if self.moved.values().all(|d| *d == 0) {
            self.moved.clear();
            return;
        }
        let deltas: Vec<((u8, String), i64)> = std::mem::take(&mut self.moved).into_iter().collect();
        if let Err(e) = self.deps.store.count_queued_many(&deltas).await {
            // Items written before the failure are counted again: a count too high, which the
            // queue reconciles, never a task unseen.
            report.errors += 1;
            tracing::error!(event = "submitter_store_failed", error = %e, "could not move the queue's counts");
            for (key, d) in deltas {
                *self.moved.entry(key).or_default() += d;
            }
        }
    }

    /// Sends queued tasks while the window, the pace and the calls in flight allow.
    async fn release(
        &mut self,
        state: &SubmitState,
        in_flight: &mut u32,
        calls: &mut tokio::task::JoinSet<Sent>,
        local: bool,
        report: &mut RunReport,
    ) {
        let s = &self.deps.settings;
        let mut waiting = self.waiting(state, self.clock.now());
        loop {
            let now = self.clock.now();
            // Sends in flight count against the minute's budget of "no slot" answers: all of
            // them may come back refused.
            let budget = self.window.no_slot_budget_left(now) as usize;
            if now < self.pause_until || now < self.pace_until || calls.len() >= s.concurrency.min(budget) {
                break;
            }
            if !matches!(self.window.gate(*in_flight, now), Gate::Open(_)) {
                break;
            }
            let Some(lane) = self.fair.next(&waiting) else { break };
            let Some(head) = self.next_head(&lane, state, report).await else {
                waiting.remove(&lane);
                continue;
            };
            if self.timed_out(&lane, &head, now, report).await {
                continue;
            }
            match self.deps.store.take_submit_slot(now, s.queue.submits_per_second).await {
                Ok(true) => {}
                Ok(false) => {
                    self.lanes.entry(lane.clone()).or_default().heads.push_front(head);
                    self.pace_until = Timestamp::from_millis((now.as_secs() + 1) * 1000);
                    break;
                }
                Err(e) => {
                    self.lanes.entry(lane.clone()).or_default().heads.push_front(head);
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e, "could not take an in.php slot");
                    break;
                }
            }
            let released = match self.deps.store.release(&head.task_ref, now).await {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e, "could not release a task");
                    continue;
                }
            };
            self.uncount(&lane, &head.task_ref);
            self.mine.insert(released.task.task_ref.clone(), now);
            self.released.insert(released.task.task_ref.clone());
            self.released_at.push_back(now);
            report.released += 1;
            let sent_with = *in_flight;
            *in_flight += 1;
            report.max_in_flight = report.max_in_flight.max(*in_flight);
            let (client, busy) = (self.deps.captchaai.clone(), self.clock.busy());
            self.sent_since_plan_read += 1;
            calls.spawn(async move {
                let _busy = busy;
                let answer = client.submit(&released.request, &released.pingback).await;
                Sent { released, in_flight: sent_with, answer }
            });
            if local {
                // Yield so a burst of sends does not starve the answers in one process.
                tokio::task::yield_now().await;
            }
        }
    }

    /// Records what in.php answered to one release.
    async fn answered(&mut self, done: Result<Sent, tokio::task::JoinError>, report: &mut RunReport) {
        let Sent { released, in_flight, answer } = match done {
            Ok(sent) => sent,
            Err(e) => {
                // A panicking call: its task stays submitting without an outcome; the poller
                // expires it at its deadline (it may have been sent: never sent again).
                report.errors += 1;
                tracing::error!(event = "submit_call_panicked", error = %e);
                return;
            }
        };
        let now = self.clock.now();
        let task = &released.task;
        let recorder = Recorder {
            store: &self.deps.store,
            dead_letters: self.deps.dead_letters.as_ref(),
            clock: self.clock.as_ref(),
        };
        match InPhp::of(answer) {
            InPhp::Accepted(id) => {
                report.accepted += 1;
                self.plan_out_seen = 0;
                self.window.accepted(in_flight, now);
                recorder.accepted(task, &id, self.deps.grace.for_kind(task.kind)).await;
            }
            InPhp::Unknown(err) => {
                report.unknown += 1;
                recorder.unknown(task, &err).await;
            }
            InPhp::NoSlot(code) => {
                report.no_slot += 1;
                metrics::counter!("submit_no_slot", "path" => "release").increment(1);
                tracing::info!(event = "submit_no_slot", code = %code, in_flight, "no free CaptchaAI thread: back to the queue");
                self.window.no_slot(in_flight, now);
                if code == "ERROR_ZERO_BALANCE" && self.deps.settings.queue.upstream == Upstream::CaptchaAi {
                    self.zero_balance(now, report).await;
                }
                self.requeue(released, report).await;
            }
            InPhp::Banned(code, b) => {
                report.bans += 1;
                let until = now.plus(b.duration);
                let stop = relay_shared::store::Stop::Ban { needs_operator: b.needs_operator };
                if let Err(e) = self.deps.store.open_breaker(until, &code, stop, now).await {
                    report.errors += 1;
                    tracing::error!(event = "breaker_store_failed", error = %e);
                }
                metrics::counter!("breaker_opened", "reason" => if b.needs_operator { "key_rejected" } else { "ban" })
                    .increment(1);
                tracing::warn!(event = "breaker_opened", code = %code, until = %until, "in.php answered a ban; the queue waits");
                self.requeue(released, report).await;
            }
            InPhp::Transient(err) => {
                self.pause_until = now.plus(self.deps.settings.transient_pause);
                let refusals = match self.deps.store.count_refusal_for_now(&task.task_ref).await {
                    Ok(n) => n.unwrap_or(0),
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                        0
                    }
                };
                if refusals < relay_shared::submit::MAX_REFUSALS_FOR_NOW {
                    tracing::warn!(event = "submit_transient", error = %err, refusals, "in.php refused for now: back to the queue");
                    self.requeue(released, report).await;
                    return;
                }
                report.failed += 1;
                self.mine.remove(&task.task_ref);
                let detail = format!("in.php refused the task {refusals} times: {err}");
                match self.deps.store.fail_unsent(&task.task_ref, false, &err.code(), &detail, now).await {
                    Ok(_) => {
                        metrics::counter!("submits", "outcome" => "refused").increment(1);
                        tracing::warn!(event = "submit_refused", task_ref = %task.task_ref, error = %err, refusals, "in.php refused a task again and again: failed");
                    }
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                    }
                }
            }
            InPhp::Refused(err) => {
                report.failed += 1;
                self.mine.remove(&task.task_ref);
                let detail = format!("in.php refused the task: {err}");
                match self.deps.store.fail_unsent(&task.task_ref, false, &err.code(), &detail, now).await {
                    Ok(_) => {
                        metrics::counter!("submits", "outcome" => "refused").increment(1);
                        tracing::warn!(event = "submit_refused", task_ref = %task.task_ref, error = %err, "in.php refused a queued task for good");
                    }
                    Err(e) => {
                        // It stays submitting and expires at its deadline: still true.
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                    }
                }
            }
        }
    }

    /// Reads the plan (`threadsinfo`): the window's ceiling. A failure keeps what was known.
    async fn read_plan(&mut self, report: &mut RunReport) -> Option<relay_shared::captchaai::ThreadsInfo> {
        let asked = {
            let _io = self.clock.io();
            tokio::time::timeout(PLAN_READ_TIMEOUT, self.deps.captchaai.threads_info()).await
        };
        let now = self.clock.now();
        match asked {
            Ok(Ok(info)) => {
                self.window.set_plan(info.threads, now);
                report.plan = Some(info.threads);
                tracing::info!(event = "plan_read", threads = info.threads, working_threads = info.working_threads);
                Some(info)
            }
            Ok(Err(e)) => {
                tracing::warn!(event = "plan_read_failed", error = %e, "threadsinfo not read; the window learns the plan");
                None
            }
            Err(_) => {
                tracing::warn!(event = "plan_read_failed", error = "timed out");
                None
            }
        }
    }

    /// The tasks in work, `counted` from the table, corrected by CaptchaAI's own count when the
    /// plan is known and the window is full: a task whose pingback was lost looks busy in the
    /// table until the poller reads it (a minute for reCAPTCHA), while CaptchaAI's thread is
    /// long free. `threadsinfo` is asked at most every [`WORKING_READ_EVERY`]; the sends made
    /// since count on top of what it said.
    async fn corrected(&mut self, counted: u32, now: Timestamp, report: &mut RunReport) -> u32 {
        if self.deps.settings.queue.upstream != Upstream::CaptchaAi
            || self.window.plan().is_none()
            || !matches!(self.window.gate(counted, now), Gate::Full)
        {
            return counted;
        }
        if self.working.is_none_or(|(at, _)| now.since(at) >= WORKING_READ_EVERY) {
            if let Some(info) = self.read_plan(report).await {
                self.working = Some((self.clock.now(), info.working_threads));
                self.sent_since_plan_read = 0;
            } else {
                // Not readable now: the table's count stands, and it is not asked again at once.
                self.working = Some((now, u32::MAX));
            }
        }
        let working = self.working.map_or(u32::MAX, |(_, w)| w);
        counted.min(working.saturating_add(self.sent_since_plan_read))
    }

    /// CaptchaAI answered `ERROR_ZERO_BALANCE`: "no free thread" — or, with threads free, a plan
    /// that has expired or run out of balance (how CaptchaAI's own SDK tells them apart). Twice
    /// in a row with threads free: submits stop (the breaker, for [`PLAN_OUT_PAUSE`]; the alarm
    /// fires on `plan_out`) and clients are told why, instead of queueing in silence.
    async fn zero_balance(&mut self, now: Timestamp, report: &mut RunReport) {
        if self.plan_checked_at.is_some_and(|at| now.since(at) < PLAN_CHECK_EVERY) {
            return;
        }
        self.plan_checked_at = Some(now);
        let Some(info) = self.read_plan(report).await else { return };
        if info.free() == 0 {
            self.plan_out_seen = 0;
            return;
        }
        self.plan_out_seen += 1;
        if self.plan_out_seen < 2 {
            return;
        }
        let now = self.clock.now();
        let reason = format!(
            "ERROR_ZERO_BALANCE with {} of {} threads free: CaptchaAI's plan has expired or is out of balance",
            info.free(),
            info.threads
        );
        match self.deps.store.open_breaker(now.plus(PLAN_OUT_PAUSE), &reason, Stop::PlanOut, now).await {
            Ok(_) => {
                report.plan_out = true;
                metrics::counter!("plan_out").increment(1);
                tracing::error!(
                    event = "plan_out",
                    threads = info.threads,
                    working_threads = info.working_threads,
                    "{reason}; submits stop until it is renewed"
                );
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "breaker_store_failed", error = %e);
            }
        }
    }

    /// Puts a task in.php took nothing of back at its place in the queue.
    async fn requeue(&mut self, released: Released, report: &mut RunReport) {
        let Released { task, lane, queued_at, .. } = released;
        self.mine.remove(&task.task_ref);
        let shard = self.deps.store.queue_shard(&task.task_ref);
        *self.moved.entry((shard, lane.clone())).or_default() += 1;
        match self.deps.store.requeue(&task.task_ref, &lane, queued_at).await {
            Ok(true) => {
                report.requeued += 1;
                self.lanes.entry(lane).or_default().heads.push_front(QueuedRef { task_ref: task.task_ref, queued_at });
            }
            Ok(false) => self.uncount(&lane, &task.task_ref),
            Err(e) => {
                // It stays submitting without an outcome: the poller expires it at its
                // deadline; nothing was taken by in.php, so nothing is lost but the task.
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not put a task back in the queue");
                self.uncount(&lane, &task.task_ref);
            }
        }
    }
}

fn emit_metrics(r: &RunReport) {
    let [depth, oldest, window, in_flight, released, requeued, unknown, errors] = METRICS;
    metrics::gauge!(depth).set(r.max_queued as f64);
    metrics::gauge!(oldest).set(r.oldest_queued_secs as f64);
    metrics::gauge!(window).set(f64::from(r.window));
    metrics::gauge!(in_flight).set(f64::from(r.max_in_flight));
    metrics::counter!(released).increment(r.released);
    metrics::counter!(requeued).increment(r.requeued);
    metrics::counter!(unknown).increment(r.unknown);
    metrics::counter!(errors).increment(r.errors);
}

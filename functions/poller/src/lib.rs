//! The fallback poller: finds open tasks whose callback never came (the sparse `due-for-poll`
//! index), reads them from res.php within CaptchaAI's limits, and records what it finds through
//! the same conditional write the callback uses.
//!
//! One scheduled invocation is [`run_invocation`]: EventBridge Scheduler starts one a minute
//! (its finest rate), and the invocation keeps working through its minute for as long as tasks
//! fall due inside it — sleeping until the next one is due — and ends at once when none will.
//! That is what lets a task be read seconds after it falls due rather than up to a minute
//! later, so a recovered reCAPTCHA token is still young (see docs/poller.md).
//!
//! Within an invocation, each *pass* walks the due tasks oldest first across all index shards
//! and, for each one, waits for a slot of the global rate limit, claims the task (a conditional
//! write that also counts the read against the task's budget, before it is made), reads it and
//! records the answer as it arrives. A read is started only if it and its write can finish
//! before the invocation's deadline, so nothing is left half done; a task whose claim cannot be
//! used is released. A batch's result writes slowed by throttling can still outlast that
//! allowance: at its hard end (the deadline less half the safety margin) the invocation stops
//! waiting for them (`reads_abandoned`; their claims lapse and the tasks are read again), so it
//! never runs into Lambda's timeout. An account-wide breaker, kept in the table, stops every read — in this and
//! every other invocation, and in the API's submits — for a ban's documented duration.
//!
//! Every wait goes through a [`Clock`], so tests run hours of this, with the template's
//! settings, on a simulated clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError, ResAnswer};
use relay_shared::codes::{CodeClass, ban, retry_after_secs};
use relay_shared::config::{ConfigError, Settings};
use relay_shared::deadletter::{DeadLetter, DeadLetterSink, SqsQueue};
use relay_shared::domain::{CaptchaId, Delivery, Outcome, Via};
use relay_shared::store::{DueTask, RecordOutcome, Reschedule, Stop, StoreError, TaskStore};
use relay_shared::time::{Clock, Timestamp, Waiter};
use serde::Serialize;

/// The poller's knobs. Defaults are what the template deploys.
#[derive(Debug, Clone)]
pub struct PollerSettings {
    /// res.php reads a task may cost at most (`POLL_READ_BUDGET`).
    pub read_budget: u32,
    /// From submit to giving up, after a last read (`TASK_DEADLINE_SECS`).
    pub task_deadline: Duration,
    /// Unknown codes tolerated before the task is failed with the code.
    pub max_unknown_codes: u32,
    /// Global res.php requests per second (`POLL_REQUESTS_PER_SECOND`).
    pub requests_per_second: u32,
    /// Reads in flight at once (`POLL_CONCURRENCY`).
    pub concurrency: usize,
    /// How long a claim holds a task before another poller may take it.
    pub lease: Duration,
    /// Read up to 100 ids per res.php request (`POLL_BATCH`).
    pub batch: bool,
    /// Index page size.
    pub page_size: i32,
    /// The schedule's period (`POLL_SCHEDULE_MINUTES`): an invocation starts reads only within
    /// its period, so the next one takes over as this one winds down.
    pub window: Duration,
    /// Most res.php requests one invocation makes (`POLL_MAX_READS_PER_INVOCATION`).
    pub max_reads_per_invocation: u64,
    /// Kept back from the invocation's deadline.
    pub safety_margin: Duration,
    /// Longest wait for one res.php answer (`POLL_READ_TIMEOUT_MS`).
    pub read_timeout: Duration,
    /// Longest wait for one store write (the store's own bound).
    pub write_timeout: Duration,
    /// Longest sleep between passes: new tasks may fall due meanwhile.
    pub idle_wait: Duration,
    /// Failures without an answer (timeouts, 5xx, HTML) in a row that open the breaker.
    pub failures_to_open: u32,
    /// How long such a run of failures stops traffic.
    pub failure_pause: Duration,
    /// Whether a task whose in.php outcome is unknown (or lost in a crash) is sent again, once,
    /// when its result is overdue: yes on CaptchaAI, which bills threads and not solutions
    /// (`CAPTCHAAI_FLAVOR`).
    pub resend: bool,
    /// The account's in.php pace, which a resend takes its place in (`SUBMITS_PER_SECOND`).
    pub submits_per_second: u32,
    /// When a resent task's first poll falls due (`CALLBACK_GRACE_SECS…`).
    pub grace: relay_shared::config::CallbackGrace,
}

/// A task without a CaptchaAI id that is not (or no longer) to be sent again expires this long
/// after its kind's longest solve, counted from its (last) submit.
pub const NO_ID_GRACE: Duration = Duration::from_secs(60);

impl Default for PollerSettings {
    fn default() -> Self {
        Self {
            read_budget: 20,
            task_deadline: Duration::from_secs(600),
            max_unknown_codes: 3,
            requests_per_second: 10,
            concurrency: 8,
            lease: Duration::from_secs(90),
            batch: false,
            page_size: 100,
            window: Duration::from_secs(60),
            max_reads_per_invocation: 2_000,
            safety_margin: Duration::from_secs(2),
            read_timeout: Duration::from_secs(5),
            write_timeout: TaskStore::CALL_TIMEOUT,
            idle_wait: Duration::from_secs(10),
            failures_to_open: 5,
            failure_pause: Duration::from_secs(60),
            resend: true,
            submits_per_second: relay_shared::submit::SUBMITS_PER_SECOND,
            grace: relay_shared::config::CallbackGrace::default(),
        }
    }
}

impl PollerSettings {
    /// Reads the settings the template sets (and the defaults for the rest).
    pub fn from_settings(env: &Settings) -> Result<Self, ConfigError> {
        let d = Self::default();
        let s = Self {
            read_budget: env.parse_or("POLL_READ_BUDGET", d.read_budget)?,
            task_deadline: Duration::from_secs(env.parse_or("TASK_DEADLINE_SECS", d.task_deadline.as_secs())?),
            requests_per_second: env.parse_or("POLL_REQUESTS_PER_SECOND", d.requests_per_second)?,
            concurrency: env.parse_or("POLL_CONCURRENCY", d.concurrency)?,
            batch: env.parse_or("POLL_BATCH", d.batch)?,
            window: Duration::from_secs(60 * env.parse_or("POLL_SCHEDULE_MINUTES", 1u64)?.max(1)),
            max_reads_per_invocation: env.parse_or("POLL_MAX_READS_PER_INVOCATION", d.max_reads_per_invocation)?,
            read_timeout: Duration::from_millis(
                env.parse_or("POLL_READ_TIMEOUT_MS", u64::try_from(d.read_timeout.as_millis()).unwrap_or(5_000))?,
            ),
            resend: relay_shared::submit::Upstream::from_settings(env)?.resend_default(),
            submits_per_second: env.parse_or("SUBMITS_PER_SECOND", d.submits_per_second)?,
            grace: relay_shared::config::CallbackGrace::from_settings(env)?,
            ..d
        };
        let invalid = |name: &str, reason: &str| ConfigError::Invalid { name: name.into(), reason: reason.into() };
        if !(1..=20).contains(&s.read_budget) {
            // The ban rule allows about 20 reads per task; more would risk ERROR: 1005.
            return Err(invalid("POLL_READ_BUDGET", "must be 1 to 20 (CaptchaAI bans above ~20 reads per task)"));
        }
        if s.requests_per_second == 0 || s.concurrency == 0 || s.max_reads_per_invocation == 0 {
            return Err(invalid("POLL_REQUESTS_PER_SECOND", "rates, concurrency and limits must be at least 1"));
        }
        Ok(s)
    }

    /// Time a read needs to be started: its answer, then the write that records it.
    pub fn read_allowance(&self) -> Duration {
        self.read_timeout + self.write_timeout
    }
}

/// What the poller needs, built once at cold start.
#[derive(Debug, Clone)]
pub struct Deps {
    pub store: TaskStore,
    pub captchaai: CaptchaAiClient,
    pub settings: PollerSettings,
    /// This poller instance's name on its claims.
    pub owner: String,
    /// Where a result goes that was read but could not be stored.
    pub dead_letters: Arc<dyn DeadLetterSink>,
}

impl Deps {
    /// Reads the configuration and secrets (once, at cold start).
    pub async fn from_env() -> anyhow::Result<Self> {
        use anyhow::Context;
        use relay_shared::config::{CaptchaAiConfig, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let cai = CaptchaAiConfig::from_settings(&env)?;
        let settings = PollerSettings::from_settings(&env)?;
        let aws = relay_shared::aws_config().await;
        let key = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cai.api_key)
            .await
            .context("loading the CaptchaAI key")?;
        Ok(Self {
            store: TaskStore::from_config(&aws, &store_cfg),
            captchaai: CaptchaAiClient::new(&cai.base_url, key, cai.timeout.min(settings.read_timeout), None)?,
            settings,
            owner: format!("poller-{}", uuid::Uuid::new_v4().simple()),
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
        })
    }
}

/// What one invocation did. Logged as one structured line.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct TickReport {
    /// Passes over the due list.
    pub passes: u64,
    /// Due tasks listed (a task listed in two passes counts twice).
    pub due: u64,
    /// How long the longest-waiting listed task had been due, in seconds.
    pub oldest_due_secs: u64,
    /// Tasks claimed for a read.
    pub claimed: u64,
    /// res.php requests made.
    pub res_php_requests: u64,
    pub recovered: u64,
    pub not_ready: u64,
    pub failed: u64,
    /// Expired: past the deadline (after a last read, when the task had an id) or out of budget.
    pub expired: u64,
    /// Reads made after the deadline, before expiring.
    pub last_reads: u64,
    /// Tasks without a CaptchaAI id set aside until their deadline (or their resend).
    pub parked: u64,
    /// Tasks without a CaptchaAI id whose result was overdue, sent to in.php again (once).
    pub resent: u64,
    pub transient: u64,
    pub already_resolved: u64,
    /// Results read after their task was expired: kept on it as late results.
    pub late_kept: u64,
    pub dead_lettered: u64,
    pub lost_claims: u64,
    /// Claims given back unread (the breaker opened, or time ran out).
    pub released: u64,
    /// Reads still running at the invocation's hard end (deadline − half the safety margin),
    /// abandoned there: their claims lapse and the tasks are read again. A read's result
    /// writes, slowed by throttling, can outlast its allowance; the invocation still ends in
    /// time instead of being killed by Lambda.
    pub reads_abandoned: u64,
    pub errors: u64,
    /// The server answered a batch read in a way that says it does not take `ids=`.
    pub batch_unsupported: bool,
    /// The breaker was open at some point of this invocation.
    pub breaker_open: bool,
    /// This invocation opened (or extended) the breaker, with this code.
    pub breaker_opened_by: Option<String>,
    /// It ended with tasks due that it had no time left to read.
    pub stopped_early: bool,
    /// It finished after its deadline (must never happen).
    pub over_deadline: bool,
}

impl TickReport {
    fn add(&mut self, a: Applied) {
        match a {
            Applied::Recovered => self.recovered += 1,
            Applied::Failed => self.failed += 1,
            Applied::NotReady => self.not_ready += 1,
            Applied::Expired => self.expired += 1,
            Applied::Transient => self.transient += 1,
            Applied::AlreadyResolved => self.already_resolved += 1,
            Applied::LateKept => self.late_kept += 1,
            Applied::DeadLettered => self.dead_lettered += 1,
            Applied::Released => self.released += 1,
            Applied::Error => self.errors += 1,
        }
    }
}

/// Delay before the next read after `reads` reads: 5 s, 10 s, 15 s, 20 s, then every 30 s.
/// Never under the protocol's 5 s minimum.
pub fn next_poll_delay(reads: u32) -> Duration {
    Duration::from_secs(match reads {
        0 | 1 => 5,
        2 => 10,
        3 => 15,
        4 => 20,
        _ => 30,
    })
}

/// When to read a task again after `reads` reads, at `now`: the protocol's schedule
/// ([`next_poll_delay`]), stretched when needed so the reads left in the budget last until the
/// deadline — the last one falls on it, so no task expires without a last read.
pub fn next_read_at(reads: u32, now: Timestamp, deadline: Timestamp, s: &PollerSettings) -> Timestamp {
    let base = next_poll_delay(reads);
    let left = s.read_budget.saturating_sub(reads).max(1);
    // The first reads follow the schedule closely (a task just slower than usual is caught
    // within seconds); the rest are spread over the time left.
    if reads < 5 && left > 5 {
        return now.plus(base);
    }
    now.plus(base.max(deadline.since(now) / left))
}

/// What to do with a listed task, decided from its record alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Read it from res.php; `last`: it is past its deadline, and expires unless this read
    /// finds its result.
    Read { id: CaptchaId, last: bool },
    /// No CaptchaAI id (in.php's answer not stored, or its outcome unknown): only its pingback
    /// can resolve it. Set aside until `until`.
    Wait { until: Timestamp },
    /// No CaptchaAI id and its result overdue: send it to in.php again, once (the same task
    /// and pingback; whichever result comes first is its result).
    Resend,
    /// Give up now.
    Expire(String),
}

pub fn decide(due: &DueTask, now: Timestamp, s: &PollerSettings) -> Decision {
    let task = &due.task;
    let Some(id) = &task.captcha_id else {
        let kind = task.kind;
        if s.resend && task.resent_at.is_none() {
            let at = task.submitted_or_created_at().plus(kind.resend_after());
            return if now >= at { Decision::Resend } else { Decision::Wait { until: at } };
        }
        // Its deadline follows its kind: the longest solve after its (last) submit, and a grace.
        let since = task.resent_at.unwrap_or_else(|| task.submitted_or_created_at());
        let deadline = since.plus(kind.max_solve_time() + NO_ID_GRACE);
        return if now >= deadline {
            Decision::Expire(format!(
                "in.php's answer is unknown (no CaptchaAI id stored){} and no pingback came within {} s",
                if task.resent_at.is_some() { ", also after it was sent again," } else { "" },
                deadline.since(since).as_secs()
            ))
        } else {
            Decision::Wait { until: deadline }
        };
    };
    let deadline = task.submitted_or_created_at().plus(s.task_deadline);
    if due.reads >= s.read_budget {
        return Decision::Expire(format!("no result after {} res.php reads", due.reads));
    }
    Decision::Read { id: id.clone(), last: now >= deadline }
}

/// What a resend came to.
enum Resent {
    /// In.php took it (or may have): its pingback or a read resolves it.
    Sent,
    /// Not this poller's to send (claimed elsewhere, resolved meanwhile).
    Lost,
    /// Not now (no in.php slot, an explicit refusal for now): looked at again at `at`.
    Later,
    /// In.php refused it for good: failed.
    Refused,
    Error,
}

/// Sends a stranded task to in.php again: claimed, marked resent (before in.php hears of it,
/// so never twice), in the account's in.php pace; the answer recorded as a submit's is.
async fn resend(deps: &Deps, clock: &Arc<dyn Clock>, due: &DueTask) -> Resent {
    use relay_shared::submit::{InPhp, Recorder};
    let s = &deps.settings;
    let r = &due.task.task_ref;
    let now = clock.now();
    match deps.store.claim(due, &deps.owner, now.plus(s.lease), false).await {
        Ok(true) => {}
        Ok(false) => return Resent::Lost,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return Resent::Error;
        }
    }
    // Back on the due list at `at`, the lease ended.
    let later = |at: Timestamp| async move {
        match deps.store.reschedule(r, &deps.owner, Reschedule::at(at)).await {
            Ok(_) => Resent::Later,
            Err(_) => Resent::Error,
        }
    };
    let sendable = match deps.store.unsent_request(r).await {
        Ok(x) => x,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return later(now.plus(Duration::from_secs(5))).await;
        }
    };
    match deps.store.take_submit_slot(now, s.submits_per_second).await {
        Ok(true) => {}
        Ok(false) => return later(now.plus(Duration::from_secs(1))).await,
        Err(_) => return later(now.plus(Duration::from_secs(5))).await,
    }
    match deps.store.mark_resent(r, now).await {
        Ok(true) => {}
        Ok(false) => return Resent::Lost,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
            return later(now.plus(Duration::from_secs(5))).await;
        }
    }
    let Some((request, pingback)) = sendable else {
        // Kept from before requests were kept: it cannot be sent again; it waits out its kind's
        // deadline instead.
        tracing::warn!(event = "resend_impossible", task_ref = %r, "no request kept for a stranded task");
        return later(now.plus(due.task.kind.max_solve_time() + NO_ID_GRACE)).await;
    };
    let answer = {
        let _io = clock.io();
        deps.captchaai.submit(&request, &pingback).await
    };
    let recorder = Recorder { store: &deps.store, dead_letters: deps.dead_letters.as_ref(), clock: clock.as_ref() };
    let task = &due.task;
    metrics::counter!("submits_resent").increment(1);
    match InPhp::of(answer) {
        InPhp::Accepted(id) => {
            tracing::info!(event = "task_resent", task_ref = %r, captcha_id = %id, "a stranded task was sent again");
            recorder.accepted(task, &id, s.grace.for_kind(task.kind)).await;
            Resent::Sent
        }
        InPhp::Unknown(err) => {
            recorder.unknown(task, &err).await;
            let at = clock.now().plus(task.kind.max_solve_time() + NO_ID_GRACE);
            later(at).await;
            Resent::Sent
        }
        InPhp::NoSlot(_) | InPhp::Transient(_) | InPhp::Banned(..) => {
            // Nothing was taken: it may be sent again later.
            let _ = deps.store.clear_resent(r).await;
            later(clock.now().plus(Duration::from_secs(10))).await
        }
        InPhp::Refused(err) => {
            let detail = format!("in.php refused the task when it was sent again: {err}");
            match deps.store.mark_submit_failed(r, &err.code(), &detail, clock.now()).await {
                Ok(_) => Resent::Refused,
                Err(_) => Resent::Error,
            }
        }
    }
}

/// The Lambda entry point: one scheduled invocation, working until shortly before its
/// deadline. The schedule's payload carries nothing the poller needs.
pub async fn handle(
    event: lambda_runtime::LambdaEvent<serde_json::Value>,
    deps: &Deps,
    clock: Arc<dyn Clock>,
) -> Result<TickReport, lambda_runtime::Error> {
    let now = clock.now();
    let left = time_left(event.context.deadline, now);
    tracing::info!(
        event = "poll_invoked",
        deadline_ms = event.context.deadline,
        time_left_ms = u64::try_from(left.as_millis()).unwrap_or(u64::MAX)
    );
    Ok(run_invocation(deps, clock, now.plus(left)).await)
}

pub use relay_shared::time_left;

/// Spaces res.php requests at least `1/rps` apart, on the clock ([`Self::acquire`]), and takes
/// each read's place in the account-wide budget of its second ([`Self::budget`]: a counter in
/// the table shared by every invocation), so two invocations that overlap still read at `rps`
/// in all, not twice that. Used by the invocation's one main loop only.
struct RateLimiter {
    rps: u32,
    interval: Duration,
    next: Timestamp,
    store: TaskStore,
}

impl RateLimiter {
    fn new(rps: u32, store: TaskStore) -> Self {
        Self { rps: rps.max(1), interval: Duration::from_secs(1) / rps.max(1), next: Timestamp::from_millis(0), store }
    }

    /// The next free slot, if it comes before `latest`; waits for it. `None`: no slot in time.
    async fn acquire(&mut self, clock: &dyn Clock, latest: Timestamp) -> Option<Timestamp> {
        let slot = self.next.max(clock.now());
        if slot > latest {
            return None;
        }
        self.next = slot.plus(self.interval);
        if slot > clock.now() {
            clock.sleep_until(slot).await;
        }
        Some(slot)
    }

    /// A place for one read in the account's budget of the current second, waiting for the
    /// next second while this one is spent. Taken only for a task this invocation has claimed
    /// (a claim lost to another invocation spends nothing). A counter that cannot be written
    /// counts as spent: no read without its place. `false`: no place before `latest`.
    async fn budget(&mut self, clock: &dyn Clock, latest: Timestamp) -> bool {
        loop {
            let now = clock.now();
            match self.store.take_read_slot(now, self.rps).await {
                Ok(true) => return true,
                Ok(false) => {}
                Err(e) => tracing::warn!(error = %e, "res.php budget not taken; trying in the next second"),
            }
            let next_second = Timestamp::from_millis((now.as_secs() + 1) * 1_000);
            if next_second > latest {
                return false;
            }
            self.next = self.next.max(next_second);
            clock.sleep_until(next_second).await;
        }
    }
}

/// State shared by an invocation's main loop and its reads.
#[derive(Debug, Default)]
struct Shared {
    /// The breaker as this invocation knows it (epoch ms; 0 = closed).
    open_until: AtomicU64,
    /// Answers missing in a row (timeouts, 5xx, HTML).
    failures: AtomicU32,
    batch_unsupported: AtomicBool,
    opened_by: std::sync::Mutex<Option<String>>,
}

impl Shared {
    fn open_at(&self, now: Timestamp) -> Option<Timestamp> {
        let until = self.open_until.load(Ordering::SeqCst);
        (until > now.as_millis()).then_some(Timestamp::from_millis(until))
    }
}

/// Opens the breaker here at once (no new read starts in this invocation) and for everyone.
async fn open_breaker(deps: &Deps, shared: &Shared, until: Timestamp, reason: &str, stop: Stop, now: Timestamp) {
    shared.open_until.fetch_max(until.as_millis(), Ordering::SeqCst);
    if let Ok(mut by) = shared.opened_by.lock() {
        by.get_or_insert_with(|| reason.to_owned());
    }
    metrics::counter!("breaker_opened", "reason" => breaker_reason_label(reason)).increment(1);
    tracing::warn!(event = "breaker_opened", reason, until = %until, ?stop, "CaptchaAI traffic stopped");
    if let Err(e) = deps.store.open_breaker(until, reason, stop, now).await {
        // This invocation still stops; others learn of the ban from their own first answer.
        tracing::error!(event = "breaker_store_failed", error = %e);
    }
}

/// A small, fixed set of metric labels (codes vary).
fn breaker_reason_label(reason: &str) -> &'static str {
    match reason {
        r if r.starts_with("ERROR: 100") => "account_suspended",
        "IP_BANNED" => "ip_banned",
        "MAX_USER_TURN" => "max_user_turn",
        r if ban(r).is_some_and(|b| b.needs_operator) => "key_rejected",
        _ => "no_answers",
    }
}

/// One scheduled invocation: passes over the due tasks until nothing more falls due in its
/// window. Reads start only within the schedule's period from now (the next invocation takes
/// over after it) and only while a read and its write can finish before `deadline`, the
/// invocation's hard end. The caller holds the clock's busy guard for it (a simulated clock
/// needs one).
pub async fn run_invocation(deps: &Deps, clock: Arc<dyn Clock>, deadline: Timestamp) -> TickReport {
    let s = &deps.settings;
    let start = clock.now();
    let read_until = start.plus(s.window).min(deadline.minus(s.safety_margin + s.read_allowance()));
    let hard_end = deadline.minus(s.safety_margin / 2);
    let shared = Arc::new(Shared::default());
    let mut limiter = RateLimiter::new(s.requests_per_second, deps.store.clone());
    let mut report = TickReport::default();
    loop {
        if clock.now() >= read_until {
            break;
        }
        report.passes += 1;
        let next = pass(deps, &clock, read_until, hard_end, &shared, &mut limiter, &mut report).await;
        if report.res_php_requests >= s.max_reads_per_invocation {
            report.stopped_early = true;
            break;
        }
        // Nothing open at all: done until the next schedule.
        let Some(next) = next else { break };
        let now = clock.now();
        // A pass that stopped with work due comes back at once (its cause, a breaker or the
        // clock, is handled at the top of the next pass); otherwise sleep until the next task
        // falls due — but never so long that a task submitted meanwhile waits for nothing.
        let wake = next.max(now.plus(Duration::from_millis(100))).min(now.plus(s.idle_wait));
        if wake >= read_until {
            report.stopped_early = next <= now;
            break;
        }
        clock.sleep_until(wake).await;
    }
    report.over_deadline = clock.now() > deadline;
    if let Ok(by) = shared.opened_by.lock() {
        report.breaker_opened_by.clone_from(&by);
    }
    report.batch_unsupported = shared.batch_unsupported.load(Ordering::SeqCst);
    emit_metrics(&report);
    log_report(&report);
    report
}

/// The due list, oldest first across every shard (a k-way merge of per-shard index pages), so
/// no shard waits while another drains.
struct DueStream<'a> {
    store: &'a TaskStore,
    now: Timestamp,
    page_size: i32,
    shards: Vec<ShardCursor>,
    errors: u64,
}

struct ShardCursor {
    shard: u8,
    buffered: std::collections::VecDeque<DueTask>,
    next_page: Option<relay_shared::store::PageKey>,
    done: bool,
}

impl<'a> DueStream<'a> {
    fn new(store: &'a TaskStore, now: Timestamp, page_size: i32) -> Self {
        let shards = (0..store.shards().read())
            .map(|shard| ShardCursor { shard, buffered: Default::default(), next_page: None, done: false })
            .collect();
        Self { store, now, page_size, shards, errors: 0 }
    }

    async fn next(&mut self) -> Option<DueTask> {
        // Every shard that needs a page gets it at once: a pass's first listing is one round trip.
        let (store, now, page_size) = (self.store, self.now, self.page_size);
        let refills = self.shards.iter_mut().filter(|c| c.buffered.is_empty() && !c.done).map(|c| async move {
            let page = store.due_page(c.shard, now, page_size, c.next_page.take()).await;
            (c, page)
        });
        for (c, page) in futures_util::future::join_all(refills).await {
            match page {
                Ok(page) => {
                    c.done = page.next.is_none();
                    c.next_page = page.next;
                    c.buffered.extend(page.tasks);
                }
                Err(e) => {
                    tracing::error!(event = "poll_query_failed", shard = c.shard, error = %e);
                    self.errors += 1;
                    c.done = true;
                }
            }
        }
        let oldest = self
            .shards
            .iter_mut()
            .filter(|c| !c.buffered.is_empty())
            .min_by_key(|c| c.buffered.front().map(|d| d.due_at))?;
        oldest.buffered.pop_front()
    }
}

/// One pass: every task due now, oldest first, until time or the breaker stops it. Reads start
/// only before `read_until`. Returns when the poller next has work (`None`: no open task).
#[allow(clippy::too_many_arguments)]
async fn pass(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    read_until: Timestamp,
    hard_end: Timestamp,
    shared: &Arc<Shared>,
    limiter: &mut RateLimiter,
    report: &mut TickReport,
) -> Option<Timestamp> {
    let s = &deps.settings;
    let now = clock.now();
    // The account-wide breaker first: a ban seen by anyone stops everyone.
    match deps.store.breaker().await {
        Ok(b) => {
            if let Some(until) = b.open_at(now) {
                shared.open_until.fetch_max(until.as_millis(), Ordering::SeqCst);
            }
            if b.batch_unsupported {
                shared.batch_unsupported.store(true, Ordering::SeqCst);
            }
        }
        Err(e) => {
            tracing::error!(event = "breaker_read_failed", error = %e);
            report.errors += 1;
            return Some(now.plus(Duration::from_secs(5)));
        }
    }
    if let Some(until) = shared.open_at(now) {
        report.breaker_open = true;
        return Some(until);
    }

    let mut stream = DueStream::new(&deps.store, now, s.page_size);
    let mut inflight = Reads::new(clock.clone(), hard_end);
    let mut batch: Vec<(DueTask, CaptchaId, bool)> = Vec::new();
    let mut work_left = false;
    while let Some(due) = stream.next().await {
        report.due += 1;
        report.oldest_due_secs = report.oldest_due_secs.max(now.since(due.due_at).as_secs());
        let now = clock.now();
        if shared.open_at(now).is_some() || now >= read_until || report.res_php_requests >= s.max_reads_per_invocation {
            work_left = true;
            break;
        }
        let r = due.task.task_ref.clone();
        match decide(&due, now, s) {
            Decision::Expire(reason) => match deps.store.expire(&r, &reason, now, &deps.owner).await {
                Ok(true) => {
                    tracing::info!(event = "task_expired", task_ref = %r, reason);
                    report.expired += 1;
                }
                Ok(false) => report.lost_claims += 1,
                Err(e) => store_error(report, &r, &e),
            },
            Decision::Wait { until } => match deps.store.claim(&due, &deps.owner, until, false).await {
                Ok(true) => report.parked += 1,
                Ok(false) => report.lost_claims += 1,
                Err(e) => store_error(report, &r, &e),
            },
            Decision::Resend => match resend(deps, clock, &due).await {
                Resent::Sent => report.resent += 1,
                Resent::Lost => report.lost_claims += 1,
                Resent::Later => report.parked += 1,
                Resent::Refused => report.failed += 1,
                Resent::Error => report.errors += 1,
            },
            Decision::Read { id, last } if s.batch && !shared.batch_unsupported.load(Ordering::SeqCst) => {
                match deps.store.claim(&due, &deps.owner, now.plus(s.lease), true).await {
                    Ok(true) => {
                        report.claimed += 1;
                        report.last_reads += u64::from(last);
                        batch.push((due, id, last));
                        if batch.len() == 100 {
                            let chunk = std::mem::take(&mut batch);
                            if !start_batch(deps, clock, shared, limiter, &mut inflight, chunk, read_until, report)
                                .await
                            {
                                work_left = true;
                                break;
                            }
                        }
                    }
                    Ok(false) => report.lost_claims += 1,
                    Err(e) => store_error(report, &r, &e),
                }
            }
            Decision::Read { id, last } => {
                if limiter.acquire(clock.as_ref(), read_until).await.is_none() {
                    work_left = true;
                    break;
                }
                let now = clock.now();
                if shared.open_at(now).is_some() {
                    work_left = true;
                    break;
                }
                match deps.store.claim(&due, &deps.owner, now.plus(s.lease), true).await {
                    Ok(true) => {
                        report.claimed += 1;
                        report.last_reads += u64::from(last);
                        // The claim is a write too: only read if the answer can still be
                        // recorded in time, within the account's budget; else give it back.
                        if !limiter.budget(clock.as_ref(), read_until).await || clock.now() >= read_until {
                            let a = release(deps, &due, clock.now()).await;
                            report.add(a);
                            work_left = true;
                            break;
                        }
                        report.res_php_requests += 1;
                        inflight.make_room(s.concurrency, report).await;
                        let (deps, clock2, shared) = (deps.clone(), clock.clone(), shared.clone());
                        inflight.spawn(async move { vec![read_one(&deps, &clock2, &shared, due, id, last).await] });
                    }
                    Ok(false) => report.lost_claims += 1,
                    Err(e) => store_error(report, &r, &e),
                }
            }
        }
    }
    if !batch.is_empty() {
        let chunk = std::mem::take(&mut batch);
        if !start_batch(deps, clock, shared, limiter, &mut inflight, chunk, read_until, report).await {
            work_left = true;
        }
    }
    report.errors += stream.errors;
    while inflight.take_one(report).await {}
    if let Some(until) = shared.open_at(clock.now()) {
        report.breaker_open = true;
        return Some(until);
    }
    if work_left {
        return Some(clock.now());
    }
    // Anything due after this pass's listing — including tasks that fell due while it ran, and
    // claims it gave back — is the next work.
    match deps.store.next_due_after(now).await {
        Ok(next) => next,
        Err(e) => {
            tracing::error!(event = "poll_query_failed", error = %e);
            report.errors += 1;
            Some(clock.now().plus(Duration::from_secs(5)))
        }
    }
}

fn store_error(report: &mut TickReport, r: &relay_shared::domain::TaskRef, e: &StoreError) {
    tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
    report.errors += 1;
}

/// Starts one batch read (up to 100 claimed tasks) in a rate slot. `false` if no slot is left in
/// time: the claims are given back.
#[allow(clippy::too_many_arguments)]
async fn start_batch(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Arc<Shared>,
    limiter: &mut RateLimiter,
    inflight: &mut Reads,
    chunk: Vec<(DueTask, CaptchaId, bool)>,
    read_until: Timestamp,
    report: &mut TickReport,
) -> bool {
    let slot = limiter.acquire(clock.as_ref(), read_until).await;
    if slot.is_none() || !limiter.budget(clock.as_ref(), read_until).await || shared.open_at(clock.now()).is_some() {
        for (due, _, _) in &chunk {
            let a = release(deps, due, clock.now()).await;
            report.add(a);
        }
        return false;
    }
    report.res_php_requests += 1;
    inflight.make_room(deps.settings.concurrency, report).await;
    let (deps, clock2, shared) = (deps.clone(), clock.clone(), shared.clone());
    inflight.spawn(async move { read_batch(&deps, &clock2, &shared, chunk).await });
    true
}

/// Reads in flight, each holding a busy guard of its own; the invocation counts as asleep
/// while it waits for them (see [`Waiter`]). Waiting ends at `hard_end`: reads still running
/// then are abandoned (their claims lapse), so the invocation ends before its deadline.
struct Reads {
    set: tokio::task::JoinSet<Vec<Applied>>,
    waiter: Waiter,
    /// Turns true at the hard end. Told by a timer that is one more child of the waiter (its
    /// guard wakes the waiting invocation as it ends), not by a sleep inside the wait: a second
    /// sleep of the waiting invocation would count it asleep twice on a simulated clock.
    ended: tokio::sync::watch::Receiver<bool>,
    timer: tokio::task::JoinHandle<()>,
}

impl Drop for Reads {
    fn drop(&mut self) {
        self.timer.abort();
    }
}

impl Reads {
    fn new(clock: Arc<dyn Clock>, hard_end: Timestamp) -> Self {
        let waiter = clock.waiter();
        let (tell, ended) = tokio::sync::watch::channel(false);
        let busy = waiter.busy();
        let timer = tokio::spawn(async move {
            let _busy = busy;
            clock.sleep_until(hard_end).await;
            let _ = tell.send(true);
        });
        Self { set: tokio::task::JoinSet::new(), waiter, ended, timer }
    }

    fn spawn(&mut self, read: impl Future<Output = Vec<Applied>> + Send + 'static) {
        let busy = self.waiter.busy();
        self.set.spawn(async move {
            let _busy = busy;
            read.await
        });
    }

    /// Waits until fewer than `concurrency` reads are in flight.
    async fn make_room(&mut self, concurrency: usize, report: &mut TickReport) {
        while self.set.len() >= concurrency.max(1) {
            self.take_one(report).await;
        }
    }

    /// Takes one read's result, waiting for it until the hard end. `false` if none is in
    /// flight (any left at the hard end are abandoned).
    async fn take_one(&mut self, report: &mut TickReport) -> bool {
        let Self { set, waiter, ended, .. } = self;
        let done = waiter
            .wait(async {
                tokio::select! {
                    biased;
                    _ = ended.wait_for(|e| *e) => None,
                    done = set.join_next() => Some(done),
                }
            })
            .await;
        let done = match done {
            Some(Some(done)) => done,
            Some(None) => return false,
            None => {
                let left = set.len() as u64;
                if left > 0 {
                    tracing::warn!(
                        event = "poll_reads_abandoned",
                        reads = left,
                        "reads still running at the invocation's end: their claims lapse and the tasks are read again"
                    );
                    report.reads_abandoned += left;
                    // Aborted, they end without the clock: wait for them holding it still.
                    set.shutdown().await;
                }
                return false;
            }
        };
        match done {
            Ok(applied) => applied.into_iter().for_each(|a| report.add(a)),
            Err(e) => {
                // A panicking read: its claim lapses with the lease and the task is read again.
                tracing::error!(event = "poll_read_panicked", error = %e);
                report.errors += 1;
            }
        }
        true
    }
}

fn emit_metrics(r: &TickReport) {
    metrics::gauge!("tasks_due").set(r.due as f64);
    metrics::gauge!("oldest_due_seconds").set(r.oldest_due_secs as f64);
    metrics::gauge!("breaker_open").set(if r.breaker_open || r.breaker_opened_by.is_some() { 1.0 } else { 0.0 });
    metrics::counter!("recovered_by_poll").increment(r.recovered);
    metrics::counter!("res_php_requests").increment(r.res_php_requests);
    for (outcome, n) in [
        ("solved", r.recovered + r.already_resolved + r.late_kept),
        ("not_ready", r.not_ready),
        ("failed", r.failed),
        ("transient", r.transient),
        ("error", r.errors),
    ] {
        metrics::counter!("res_php_answers", "outcome" => outcome).increment(n);
    }
    metrics::counter!("poll_expired").increment(r.expired);
    metrics::counter!("poll_reads_abandoned").increment(r.reads_abandoned);
    metrics::counter!("poll_last_reads").increment(r.last_reads);
    metrics::counter!("late_results_kept", "via" => "poll").increment(r.late_kept);
    metrics::counter!("poll_errors").increment(r.errors);
    metrics::counter!("dead_lettered").increment(r.dead_lettered);
    metrics::counter!("tick_stopped_early").increment(u64::from(r.stopped_early));
    metrics::counter!("tick_over_deadline").increment(u64::from(r.over_deadline));
}

fn log_report(r: &TickReport) {
    tracing::info!(
        event = "poll_tick",
        passes = r.passes,
        due = r.due,
        oldest_due_secs = r.oldest_due_secs,
        claimed = r.claimed,
        res_php_requests = r.res_php_requests,
        recovered = r.recovered,
        not_ready = r.not_ready,
        failed = r.failed,
        expired = r.expired,
        last_reads = r.last_reads,
        parked = r.parked,
        transient = r.transient,
        already_resolved = r.already_resolved,
        late_kept = r.late_kept,
        dead_lettered = r.dead_lettered,
        lost_claims = r.lost_claims,
        released = r.released,
        reads_abandoned = r.reads_abandoned,
        errors = r.errors,
        batch_unsupported = r.batch_unsupported,
        breaker_open = r.breaker_open,
        breaker_opened_by = r.breaker_opened_by.as_deref().unwrap_or(""),
        stopped_early = r.stopped_early,
        over_deadline = r.over_deadline,
        "poller invocation done"
    );
}

/// What one answer did, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applied {
    Recovered,
    Failed,
    NotReady,
    Expired,
    Transient,
    AlreadyResolved,
    LateKept,
    DeadLettered,
    Released,
    Error,
}

/// Gives back a claim whose read was not made: the read it counted is taken back, and the task
/// is due again at once (or when the breaker closes).
async fn release(deps: &Deps, due: &DueTask, now: Timestamp) -> Applied {
    let r = Reschedule { unread: true, ..Reschedule::at(now) };
    match deps.store.reschedule(&due.task.task_ref, &deps.owner, r).await {
        Ok(_) => Applied::Released,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
            Applied::Error
        }
    }
}

async fn read_one(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    due: DueTask,
    id: CaptchaId,
    last: bool,
) -> Applied {
    // The breaker may have opened while this read waited for a permit: then it is not made.
    if shared.open_at(clock.now()).is_some() {
        let r = Reschedule { unread: true, ..Reschedule::at(clock.now()) };
        return match deps.store.reschedule(&due.task.task_ref, &deps.owner, r).await {
            Ok(_) => Applied::Released,
            Err(_) => Applied::Error,
        };
    }
    let answer = deps.captchaai.get_result(&id).await;
    note_answer(deps, clock, shared, answer.as_ref().err()).await;
    apply_answer(deps, clock, shared, due, answer, last).await
}

/// Counts one request's outcome: an answer ends a run of failures; a missing answer (timeout,
/// 5xx, HTML) extends it, and a run long enough opens the breaker for a while.
async fn note_answer(deps: &Deps, clock: &Arc<dyn Clock>, shared: &Shared, err: Option<&CaptchaAiError>) {
    let s = &deps.settings;
    match err {
        None | Some(CaptchaAiError::Code(_)) => shared.failures.store(0, Ordering::SeqCst),
        Some(e) => {
            let run = shared.failures.fetch_add(1, Ordering::SeqCst) + 1;
            let now = clock.now();
            if run >= s.failures_to_open && shared.open_at(now).is_none() {
                let reason = format!("{} answers missing in a row ({})", run, e.code());
                open_breaker(deps, shared, now.plus(s.failure_pause), &reason, Stop::NoAnswers, now).await;
            }
        }
    }
}

async fn read_batch(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    chunk: Vec<(DueTask, CaptchaId, bool)>,
) -> Vec<Applied> {
    let ids: Vec<CaptchaId> = chunk.iter().map(|(_, id, _)| id.clone()).collect();
    let mut out = Vec::with_capacity(chunk.len());
    let answers = deps.captchaai.get_results(&ids).await;
    note_answer(deps, clock, shared, answers.as_ref().err().filter(|e| !e.batch_unsupported())).await;
    match answers {
        Ok(answers) => {
            for ((due, _, last), answer) in chunk.into_iter().zip(answers) {
                out.push(apply_answer(deps, clock, shared, due, Ok(answer), last).await);
            }
        }
        Err(e) if e.batch_unsupported() => {
            // The server does not take `ids=`: read these one by one from the next pass on.
            tracing::warn!(event = "batch_unsupported", error = %e, "res.php does not take batch reads; reading singly");
            shared.batch_unsupported.store(true, Ordering::SeqCst);
            // Remembered for every invocation from now on, not learnt again at a batch's cost.
            if let Err(e) = deps.store.mark_batch_unsupported(clock.now()).await {
                tracing::error!(event = "poll_store_failed", error = %e);
            }
            for (due, _, _) in &chunk {
                out.push(release(deps, due, clock.now()).await);
            }
        }
        Err(e) => {
            // A ban, a timeout, a 5xx: the same for every task of the batch, applied to each (the
            // first opens the breaker, the rest are rescheduled after it).
            for (due, _, last) in chunk {
                out.push(apply_answer(deps, clock, shared, due, Err(e.clone()), last).await);
            }
        }
    }
    out
}

/// Records or reschedules a task after its read. The read was counted at the claim.
async fn apply_answer(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    shared: &Shared,
    due: DueTask,
    answer: Result<ResAnswer, CaptchaAiError>,
    last: bool,
) -> Applied {
    let s = &deps.settings;
    let now = clock.now();
    let reads = due.reads + 1;
    let deadline = due.task.submitted_or_created_at().plus(s.task_deadline);
    let next_read = Reschedule::at(next_read_at(reads, now, deadline, s));
    let r = &due.task.task_ref;
    match answer {
        Ok(ResAnswer::Ready(solution)) => record(deps, now, &due, Outcome::Solved(solution)).await,
        Ok(ResAnswer::NotReady) if last => {
            let reason = format!("no result within {} s of submit (last read: not ready)", s.task_deadline.as_secs());
            match deps.store.expire(r, &reason, now, &deps.owner).await {
                Ok(true) => {
                    tracing::info!(event = "task_expired", task_ref = %r, reason, last_read = true);
                    Applied::Expired
                }
                Ok(false) => Applied::AlreadyResolved,
                Err(e) => {
                    tracing::error!(event = "poll_store_failed", task_ref = %r, error = %e);
                    Applied::Error
                }
            }
        }
        Ok(ResAnswer::NotReady) => {
            let next = Reschedule { not_ready_at: Some(now), ..next_read };
            reschedule(deps, &due, next, Applied::NotReady).await
        }
        Ok(ResAnswer::Code(code)) => {
            if let Some(b) = ban(code.as_ref()) {
                // The breaker holds every read back until it closes (or an operator closes it
                // early); the task keeps its own schedule.
                let stop = Stop::Ban { needs_operator: b.needs_operator };
                open_breaker(deps, shared, now.plus(b.duration), code.as_ref(), stop, now).await;
                return reschedule(deps, &due, next_read, Applied::Transient).await;
            }
            match code.class() {
                CodeClass::TerminalForTask => record(deps, now, &due, Outcome::Failed(code)).await,
                CodeClass::Unknown | CodeClass::Permanent if due.unknown_codes + 1 >= s.max_unknown_codes => {
                    tracing::warn!(event = "unknown_code_terminal", task_ref = %r, %code);
                    record(deps, now, &due, Outcome::Failed(code)).await
                }
                CodeClass::Unknown | CodeClass::Permanent => {
                    tracing::warn!(event = "unknown_code", task_ref = %r, %code);
                    let next = Reschedule { unknown_code: true, ..next_read };
                    reschedule(deps, &due, next, Applied::Transient).await
                }
                CodeClass::Transient | CodeClass::NotReady => {
                    let wait = Duration::from_secs(retry_after_secs(code.as_ref()));
                    let next = Reschedule::at(next_read.next_due.max(now.plus(wait)));
                    reschedule(deps, &due, next, Applied::Transient).await
                }
            }
        }
        Err(e) => {
            // No answer (counted by the caller, per request): read again on schedule.
            tracing::warn!(event = "res_php_failed", task_ref = %r, error = %e);
            reschedule(deps, &due, next_read, Applied::Transient).await
        }
    }
}

async fn reschedule(deps: &Deps, due: &DueTask, r: Reschedule, applied: Applied) -> Applied {
    match deps.store.reschedule(&due.task.task_ref, &deps.owner, r).await {
        Ok(_) => applied,
        Err(e) => {
            // The lease lapses and the next pass reads it again: nothing is lost.
            tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
            Applied::Error
        }
    }
}

async fn record(deps: &Deps, now: Timestamp, due: &DueTask, outcome: Outcome) -> Applied {
    let Some(captcha_id) = due.task.captcha_id.clone() else { return Applied::Error };
    let solved = matches!(outcome, Outcome::Solved(_));
    // res.php cannot say when the solve happened; the token is no older than the last
    // "not ready" (or the submit), so its clock starts there.
    let d = Delivery {
        captcha_id,
        outcome,
        received_at: now,
        via: Via::Poll,
        token_clock_start: due.last_not_ready_at.unwrap_or_else(|| due.task.submitted_or_created_at()),
    };
    let r = &due.task.task_ref;
    match deps.store.record_result(r, &d).await {
        Ok(RecordOutcome::Recorded(_)) => {
            tracing::info!(event = "poll_recovered", task_ref = %r, solved);
            if solved { Applied::Recovered } else { Applied::Failed }
        }
        Ok(RecordOutcome::Replaced(_)) => {
            tracing::warn!(event = "result_replaced", task_ref = %r, via = "poll");
            metrics::counter!("results_replaced", "via" => "poll").increment(1);
            if solved { Applied::Recovered } else { Applied::Failed }
        }
        Ok(RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_)) => Applied::AlreadyResolved,
        Ok(RecordOutcome::Late(_)) => {
            tracing::warn!(event = "late_result_kept", task_ref = %r, via = "poll");
            Applied::LateKept
        }
        Ok(other) => {
            tracing::error!(event = "poll_record_refused", task_ref = %r, outcome = ?other);
            Applied::Error
        }
        Err(e) => {
            // Same path as the callback: keep the result as a dead letter. Should that fail too,
            // the lease lapses and a later pass reads it again: nothing is lost either way.
            match deps.dead_letters.send(&DeadLetter::new(r, &d, &e.to_string(), 1)).await {
                Ok(()) => {
                    tracing::warn!(event = "poll_dead_lettered", task_ref = %r, error = %e);
                    Applied::DeadLettered
                }
                Err(q) => {
                    tracing::error!(event = "poll_not_stored", task_ref = %r, store_error = %e, queue_error = %q);
                    Applied::Error
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_shared::domain::{CaptchaKind, Task, TaskRef, TaskState};

    /// Reads still running at the invocation's hard end are abandoned there, on the clock the
    /// invocation runs on: the wait ends at the hard end, not when the slow read would.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn reads_still_running_at_the_hard_end_are_abandoned() {
        let clock = relay_shared::time::ManualClock::at(Timestamp::from_millis(0));
        let hard_end = Timestamp::from_millis(74_000);
        let (c, parent_busy): (Arc<dyn Clock>, _) = (Arc::new(clock.clone()), clock.busy());
        let parent = tokio::spawn(async move {
            let _busy = parent_busy;
            let mut reads = Reads::new(c.clone(), hard_end);
            // One read done at 10 s, one whose writes back off until 200 s.
            for at in [10_000u64, 200_000] {
                let c = c.clone();
                reads.spawn(async move {
                    c.sleep_until(Timestamp::from_millis(at)).await;
                    vec![Applied::Recovered]
                });
            }
            let mut report = TickReport::default();
            let mut ends = Vec::new();
            while reads.take_one(&mut report).await {
                ends.push(c.now().as_millis());
            }
            ends.push(c.now().as_millis());
            (ends, report)
        });
        tokio::time::timeout(Duration::from_secs(20), clock.run_until(Timestamp::from_millis(300_000)))
            .await
            .expect("the clock runs");
        let (ends, report) = parent.await.expect("the invocation ends");
        assert_eq!(ends, vec![10_000, 74_000], "one read taken at 10 s, the wait given up at the hard end");
        assert_eq!((report.recovered, report.reads_abandoned), (1, 1), "{report:?}");
    }

    /// Two invocations reading at once, each pacing itself at the rate template.yaml deploys:
    /// the shared budget keeps every second of the pair at that rate, and both make progress.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_read_budget_holds_across_overlapping_invocations() -> anyhow::Result<()> {
        let db = relay_shared::testkit::LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        let clock = relay_shared::time::ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        let start = clock.now();
        let end = start.plus(Duration::from_secs(5));
        let rps = relay_sim::Deployed::from_template()?.poller.requests_per_second;
        let reads = Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut runs = Vec::new();
        for _ in 0..2 {
            let (store, reads) = (store.clone(), reads.clone());
            let c: Arc<dyn Clock> = Arc::new(clock.clone());
            let busy = c.busy();
            runs.push(tokio::spawn(async move {
                let _busy = busy;
                let mut limiter = RateLimiter::new(rps, store);
                while limiter.acquire(c.as_ref(), end).await.is_some() {
                    if limiter.budget(c.as_ref(), end).await {
                        reads.lock().expect("reads").push(c.now().as_secs());
                    }
                }
            }));
        }
        clock.run_until(end.plus(Duration::from_secs(1))).await;
        for r in runs {
            r.await?;
        }
        let reads = reads.lock().expect("reads").clone();
        let mut per_second = std::collections::BTreeMap::new();
        for s in &reads {
            *per_second.entry(*s).or_insert(0u32) += 1;
        }
        assert!(per_second.values().all(|n| *n <= rps), "at most {rps} a second in all: {per_second:?}");
        assert!(reads.len() as u32 >= 4 * rps, "the pair still reads at the rate (5 s x {rps}): {per_second:?}");
        Ok(())
    }

    fn due(state: TaskState, id: Option<&str>, reads: u32) -> DueTask {
        let mut task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, Timestamp::from_millis(0));
        task.state = state;
        task.captcha_id = id.map(|i| CaptchaId::parse(i).expect("id"));
        DueTask { task, due_at: Timestamp::from_millis(0), reads, unknown_codes: 0, last_not_ready_at: None }
    }

    #[test]
    fn deadline_is_read_as_epoch_or_as_a_plain_timeout() {
        let now = Timestamp::from_millis(1_796_210_146_000);
        assert_eq!(time_left(1_796_210_146_000 + 55_000, now), Duration::from_secs(55));
        assert_eq!(time_left(1_796_210_146_000 - 1, now), Duration::ZERO, "a past deadline leaves nothing");
        assert_eq!(time_left(600_000, now), Duration::from_secs(600), "the emulator's timeout-only form");
    }

    #[test]
    fn schedule_starts_at_five_seconds_and_backs_off_to_thirty() {
        let got: Vec<u64> = (0..8).map(|r| next_poll_delay(r).as_secs()).collect();
        assert_eq!(got, [5, 5, 10, 15, 20, 30, 30, 30]);
        assert!((0..100).all(|r| next_poll_delay(r) >= Duration::from_secs(5)), "never under the protocol minimum");
    }

    #[test]
    fn the_budget_is_spread_so_the_last_read_falls_on_the_deadline() {
        let s = PollerSettings::default();
        let t = |secs: u64| Timestamp::from_millis(secs * 1000);
        let deadline = t(600);
        // A task that never solves, first read at 25 s: 20 reads, the last at the deadline.
        let (mut now, mut reads, mut at) = (t(25), 1, vec![25]);
        while reads < s.read_budget {
            now = next_read_at(reads, now, deadline, &s);
            reads += 1;
            at.push(now.as_secs());
        }
        assert_eq!(at[..5], [25, 30, 40, 55, 75], "the protocol's schedule first");
        assert!(at.windows(2).all(|w| w[1] - w[0] >= 5), "never under 5 s apart: {at:?}");
        assert!(*at.last().unwrap_or(&0) >= 600, "the last read is at the deadline: {at:?}");
        assert!(at.iter().filter(|a| **a < 600).count() == 19, "{at:?}");
    }

    #[test]
    fn decisions_follow_deadline_budget_and_id() {
        let s = PollerSettings::default();
        let pending = TaskState::Pending { submitted_at: Timestamp::from_millis(1_000) };
        let t = |ms| Timestamp::from_millis(ms);
        assert!(matches!(
            decide(&due(pending.clone(), Some("7"), 0), t(130_000), &s),
            Decision::Read { last: false, .. }
        ));
        assert!(
            matches!(decide(&due(pending.clone(), Some("7"), 20), t(130_000), &s), Decision::Expire(r) if r.contains("20 res.php reads"))
        );
        assert!(
            matches!(decide(&due(pending, Some("7"), 3), t(601_000), &s), Decision::Read { last: true, .. }),
            "past the deadline: one last read before expiring"
        );
        // No CaptchaAI id (a Turnstile task): sent again once its result is overdue (2 × 15 s +
        // 30 s), then it follows its kind's deadline from the resend (90 s + 60 s).
        let stranded = due(TaskState::Submitting { unknown: None }, None, 0);
        assert_eq!(decide(&stranded, t(5_000), &s), Decision::Wait { until: t(60_000) });
        assert_eq!(decide(&stranded, t(60_000), &s), Decision::Resend);
        let resent = DueTask { task: Task { resent_at: Some(t(61_000)), ..stranded.task.clone() }, ..stranded.clone() };
        assert_eq!(decide(&resent, t(62_000), &s), Decision::Wait { until: t(211_000) });
        assert!(matches!(decide(&resent, t(211_000), &s), Decision::Expire(r) if r.contains("sent again")));
        // An upstream that bills per solution: never sent twice; the kind's deadline.
        let once = PollerSettings { resend: false, ..PollerSettings::default() };
        assert_eq!(decide(&stranded, t(5_000), &once), Decision::Wait { until: t(150_000) });
        assert!(matches!(decide(&stranded, t(150_000), &once), Decision::Expire(r) if r.contains("unknown")));
    }

    #[test]
    fn settings_are_read_from_the_environment_and_checked() {
        let s = PollerSettings::from_settings(&Settings::from_pairs([
            ("POLL_REQUESTS_PER_SECOND", "4"),
            ("POLL_CONCURRENCY", "2"),
            ("POLL_MAX_READS_PER_INVOCATION", "300"),
            ("POLL_BATCH", "true"),
        ]))
        .expect("valid");
        assert_eq!((s.requests_per_second, s.concurrency, s.max_reads_per_invocation, s.batch), (4, 2, 300, true));
        let d = PollerSettings::from_settings(&Settings::default()).expect("defaults");
        assert_eq!((d.requests_per_second, d.batch, d.read_budget), (10, false, 20), "the template's defaults");
        for (k, v) in [("POLL_READ_BUDGET", "50"), ("POLL_CONCURRENCY", "0"), ("POLL_BATCH", "sometimes")] {
            assert!(PollerSettings::from_settings(&Settings::from_pairs([(k, v)])).is_err(), "{k}={v}");
        }
    }
}

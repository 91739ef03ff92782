//! The fallback poller: once a minute it finds open tasks whose callback never came (the
//! sparse `due-for-poll` index), reads them from res.php within the rate budget, and records
//! what it finds through the same conditional write the callback uses.
//!
//! One tick is [`poll_once`]; the Lambda calls it with the invocation's deadline, tests call
//! it with a clock of their own.

use std::sync::Arc;
use std::time::{Duration, Instant};

use relay_shared::captchaai::{CaptchaAiClient, CaptchaAiError, ResAnswer};
use relay_shared::codes::{CodeClass, retry_after_secs};
use relay_shared::deadletter::{DeadLetter, DeadLetterSink, SqsQueue};
use relay_shared::domain::{CaptchaId, Delivery, Outcome, Via};
use relay_shared::store::{DueTask, POLL_SHARDS, RecordOutcome, TaskStore};
use relay_shared::time::Timestamp;
use serde::Serialize;
use tokio::sync::{Mutex, Semaphore};

/// The poller's knobs.
#[derive(Debug, Clone)]
pub struct PollerSettings {
    /// res.php reads a task may cost at most.
    pub read_budget: u32,
    /// From submit to giving up (expired).
    pub task_deadline: Duration,
    /// Unknown codes tolerated before the task is failed with the code.
    pub max_unknown_codes: u32,
    /// Global res.php requests per second.
    pub requests_per_second: u32,
    /// Tasks worked on at once.
    pub concurrency: usize,
    /// How long a claim holds a task before another poller may take it.
    pub lease: Duration,
    /// Read up to 100 ids per res.php request.
    pub batch: bool,
    /// Index page size.
    pub page_size: i32,
    /// Most tasks claimed in one tick; the rest wait for the next.
    pub max_tasks_per_tick: usize,
    /// Stop this long before the Lambda deadline (at most a quarter of the time given).
    pub safety_margin: Duration,
}

impl Default for PollerSettings {
    fn default() -> Self {
        Self {
            read_budget: 20,
            task_deadline: Duration::from_secs(600),
            max_unknown_codes: 3,
            requests_per_second: 10,
            concurrency: 8,
            lease: Duration::from_secs(90),
            batch: true,
            page_size: 100,
            max_tasks_per_tick: 2_000,
            safety_margin: Duration::from_secs(5),
        }
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
        use relay_shared::config::{CaptchaAiConfig, Settings, StoreConfig};
        let env = Settings::from_env();
        let store_cfg = StoreConfig::from_settings(&env)?;
        let cai = CaptchaAiConfig::from_settings(&env)?;
        let d = PollerSettings::default();
        let settings = PollerSettings {
            read_budget: env.parse_or("POLL_READ_BUDGET", d.read_budget)?,
            task_deadline: Duration::from_secs(env.parse_or("TASK_DEADLINE_SECS", d.task_deadline.as_secs())?),
            requests_per_second: env.parse_or("POLL_REQUESTS_PER_SECOND", d.requests_per_second)?,
            concurrency: env.parse_or("POLL_CONCURRENCY", d.concurrency)?,
            batch: env.parse_or("POLL_BATCH", d.batch)?,
            ..d
        };
        let aws = relay_shared::aws_config().await;
        let key = relay_shared::secrets::SecretLoader::new(&aws)
            .load(&cai.api_key)
            .await
            .context("loading the CaptchaAI key")?;
        Ok(Self {
            store: TaskStore::from_config(&aws, &store_cfg),
            captchaai: CaptchaAiClient::new(&cai.base_url, key, cai.timeout.min(Duration::from_secs(10)), None)?,
            settings,
            owner: format!("poller-{}", uuid::Uuid::new_v4().simple()),
            dead_letters: Arc::new(SqsQueue::new(aws_sdk_sqs::Client::new(&aws), env.url("DEAD_LETTER_QUEUE_URL")?)),
        })
    }
}

/// What one tick did. Logged as one structured line.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct TickReport {
    pub due: u64,
    /// How long the longest-waiting listed task has been due, in seconds.
    pub oldest_due_secs: u64,
    pub claimed: u64,
    pub polled: u64,
    pub recovered: u64,
    pub not_ready: u64,
    pub failed: u64,
    pub expired: u64,
    pub transient: u64,
    pub already_resolved: u64,
    pub dead_lettered: u64,
    pub lost_claims: u64,
    pub res_php_requests: u64,
    pub errors: u64,
    pub batch_rejected: bool,
    pub stopped_early: bool,
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

/// What to do with a listed task, decided from its record alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Read it from res.php.
    Read(CaptchaId),
    /// No CaptchaAI id yet (in.php's answer not stored): look again at `until`.
    Wait { until: Timestamp },
    /// Give up: past the deadline or out of read budget.
    Expire(String),
}

pub fn decide(due: &DueTask, now: Timestamp, s: &PollerSettings) -> Decision {
    let deadline = due.task.submitted_or_created_at().plus(s.task_deadline);
    if now >= deadline {
        return Decision::Expire(format!("no result within {} s of submit", s.task_deadline.as_secs()));
    }
    if due.reads >= s.read_budget {
        return Decision::Expire(format!("no result after {} res.php reads", due.reads));
    }
    match &due.task.captcha_id {
        Some(id) => Decision::Read(id.clone()),
        None => Decision::Wait { until: deadline },
    }
}

/// The Lambda entry point: one tick per scheduled invocation, stopping before the
/// invocation's deadline. The schedule's payload carries nothing the tick needs.
pub async fn handle(
    event: lambda_runtime::LambdaEvent<serde_json::Value>,
    deps: &Deps,
    clock: &dyn relay_shared::time::Clock,
) -> Result<TickReport, lambda_runtime::Error> {
    let now = clock.now();
    // The context's deadline is wall-clock epoch ms; turn it into a monotonic instant.
    let left = time_left(event.context.deadline, now);
    tracing::info!(
        event = "poll_invoked",
        deadline_ms = event.context.deadline,
        time_left_ms = left.as_millis() as u64
    );
    Ok(poll_once(deps, now, Instant::now() + left).await)
}

/// Time until the invocation's deadline. Lambda sends an epoch-ms deadline; cargo lambda's
/// emulator sends the timeout itself (e.g. `600000`). A value too small to be an epoch (before
/// 2001) is taken as a duration from now.
pub fn time_left(deadline_ms: u64, now: Timestamp) -> Duration {
    const PLAUSIBLE_EPOCH_MS: u64 = 1_000_000_000_000;
    if deadline_ms < PLAUSIBLE_EPOCH_MS {
        Duration::from_millis(deadline_ms)
    } else {
        Duration::from_millis(deadline_ms.saturating_sub(now.as_millis()))
    }
}

/// Spaces requests at least `1/rps` apart, across all tasks of the tick.
struct RateLimiter {
    interval: Duration,
    next: Mutex<Instant>,
}

impl RateLimiter {
    fn new(rps: u32) -> Self {
        Self { interval: Duration::from_secs(1) / rps.max(1), next: Mutex::new(Instant::now()) }
    }

    async fn acquire(&self) {
        let wait_until = {
            let mut next = self.next.lock().await;
            let slot = (*next).max(Instant::now());
            *next = slot + self.interval;
            slot
        };
        tokio::time::sleep_until(wait_until.into()).await;
    }
}

/// One tick: list due tasks, claim them, read res.php, record or reschedule.
pub async fn poll_once(deps: &Deps, now: Timestamp, stop_at: Instant) -> TickReport {
    let s = &deps.settings;
    let mut report = TickReport::default();
    // Keep back the safety margin, but never more than a quarter of the time given: a short
    // Lambda timeout must still leave the tick something to do.
    let margin = s.safety_margin.min(stop_at.saturating_duration_since(Instant::now()) / 4);
    let out_of_time = || Instant::now() + margin >= stop_at;
    let mut claimed: Vec<(DueTask, CaptchaId)> = Vec::new();

    'shards: for shard in 0..POLL_SHARDS {
        let mut start = None;
        loop {
            if out_of_time() || claimed.len() >= s.max_tasks_per_tick {
                report.stopped_early = true;
                break 'shards;
            }
            let page = match deps.store.due_page(shard, now, s.page_size, start).await {
                Ok(p) => p,
                Err(e) => {
                    tracing::error!(event = "poll_query_failed", shard, error = %e);
                    report.errors += 1;
                    continue 'shards;
                }
            };
            report.due += page.tasks.len() as u64;
            let oldest = page.tasks.iter().map(|d| now.since(d.due_at).as_secs()).max().unwrap_or(0);
            report.oldest_due_secs = report.oldest_due_secs.max(oldest);
            for (due, triage) in triage_page(deps, now, page.tasks).await {
                match triage {
                    Ok(Triage::Claimed(id)) => {
                        report.claimed += 1;
                        claimed.push((due, id));
                    }
                    Ok(Triage::LostClaim) => report.lost_claims += 1,
                    Ok(Triage::Expired) => report.expired += 1,
                    Ok(Triage::Waiting) => {}
                    Err(e) => {
                        tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
                        report.errors += 1;
                    }
                }
            }
            match page.next {
                Some(k) => start = Some(k),
                None => break,
            }
        }
    }

    let answers = read_all(deps, &claimed, &mut report).await;
    apply_all(deps, now, answers, &mut report).await;
    emit_tick_metrics(&report);
    tracing::info!(
        event = "poll_tick",
        due = report.due,
        oldest_due_secs = report.oldest_due_secs,
        claimed = report.claimed,
        polled = report.polled,
        recovered = report.recovered,
        not_ready = report.not_ready,
        failed = report.failed,
        expired = report.expired,
        transient = report.transient,
        already_resolved = report.already_resolved,
        dead_lettered = report.dead_lettered,
        lost_claims = report.lost_claims,
        res_php_requests = report.res_php_requests,
        errors = report.errors,
        batch_rejected = report.batch_rejected,
        stopped_early = report.stopped_early,
        "poller tick done"
    );
    report
}

/// What became of one listed task before any read.
enum Triage {
    Claimed(CaptchaId),
    LostClaim,
    Expired,
    Waiting,
}

/// Expires, parks or claims each task of a page, several at once.
async fn triage_page(
    deps: &Deps,
    now: Timestamp,
    tasks: Vec<DueTask>,
) -> Vec<(DueTask, Result<Triage, relay_shared::store::StoreError>)> {
    let sem = Arc::new(Semaphore::new(deps.settings.concurrency.max(1)));
    let mut set = tokio::task::JoinSet::new();
    for due in tasks {
        let (deps, sem) = (deps.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await;
            let s = &deps.settings;
            let r = &due.task.task_ref;
            let res = match decide(&due, now, s) {
                Decision::Expire(reason) => deps.store.expire(r, &reason, now).await.map(|done| {
                    if done {
                        tracing::info!(event = "task_expired", task_ref = %r, reason);
                        Triage::Expired
                    } else {
                        Triage::LostClaim
                    }
                }),
                Decision::Wait { until } => deps.store.claim(&due, &deps.owner, until).await.map(|_| Triage::Waiting),
                Decision::Read(id) => deps
                    .store
                    .claim(&due, &deps.owner, now.plus(s.lease))
                    .await
                    .map(|won| if won { Triage::Claimed(id) } else { Triage::LostClaim }),
            };
            (due, res)
        });
    }
    let mut out = Vec::new();
    while let Some(r) = set.join_next().await {
        match r {
            Ok(pair) => out.push(pair),
            Err(e) => tracing::error!(event = "poll_triage_panicked", error = %e),
        }
    }
    out
}

fn emit_tick_metrics(r: &TickReport) {
    metrics::gauge!("tasks_due").set(r.due as f64);
    metrics::gauge!("oldest_due_seconds").set(r.oldest_due_secs as f64);
    metrics::counter!("recovered_by_poll").increment(r.recovered);
    metrics::counter!("res_php_requests").increment(r.res_php_requests);
    for (outcome, n) in [
        ("solved", r.recovered + r.already_resolved),
        ("not_ready", r.not_ready),
        ("failed", r.failed),
        ("transient", r.transient),
        ("error", r.errors),
    ] {
        metrics::counter!("res_php_answers", "outcome" => outcome).increment(n);
    }
    metrics::counter!("poll_expired").increment(r.expired);
    metrics::counter!("poll_errors").increment(r.errors);
    metrics::counter!("dead_lettered").increment(r.dead_lettered);
    metrics::counter!("tick_stopped_early").increment(u64::from(r.stopped_early));
}

type Answer = (DueTask, Result<ResAnswer, CaptchaAiError>);

/// Reads every claimed task: in batches of up to 100 ids while the server takes them, else one
/// by one, never faster than the rate limit.
async fn read_all(deps: &Deps, claimed: &[(DueTask, CaptchaId)], report: &mut TickReport) -> Vec<Answer> {
    let limiter = Arc::new(RateLimiter::new(deps.settings.requests_per_second));
    let mut answers = Vec::with_capacity(claimed.len());
    let mut singles: Vec<&(DueTask, CaptchaId)> = Vec::new();
    if deps.settings.batch {
        for chunk in claimed.chunks(100) {
            if report.batch_rejected {
                singles.extend(chunk);
                continue;
            }
            limiter.acquire().await;
            report.res_php_requests += 1;
            let ids: Vec<CaptchaId> = chunk.iter().map(|(_, id)| id.clone()).collect();
            match deps.captchaai.get_results(&ids).await {
                Ok(got) => answers.extend(chunk.iter().map(|(d, _)| d.clone()).zip(got.into_iter().map(Ok))),
                Err(e) => {
                    // The batch form is not confirmed on CaptchaAI: any refusal means "read
                    // one by one" for the rest of this tick.
                    tracing::warn!(event = "batch_rejected", error = %e, "res.php refused the batch form; reading singly");
                    report.batch_rejected = true;
                    singles.extend(chunk);
                }
            }
        }
    } else {
        singles.extend(claimed);
    }
    let sem = Arc::new(Semaphore::new(deps.settings.concurrency.max(1)));
    let mut set = tokio::task::JoinSet::new();
    for (due, id) in singles.into_iter().cloned() {
        let (client, limiter, sem) = (deps.captchaai.clone(), limiter.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await;
            limiter.acquire().await;
            (due, client.get_result(&id).await)
        });
        report.res_php_requests += 1;
    }
    while let Some(r) = set.join_next().await {
        match r {
            Ok(a) => answers.push(a),
            Err(e) => {
                tracing::error!(event = "poll_read_panicked", error = %e);
                report.errors += 1;
            }
        }
    }
    report.polled = answers.len() as u64;
    answers
}

/// What one answer did, for the report.
enum Applied {
    Recovered,
    Failed,
    NotReady,
    Transient,
    AlreadyResolved,
    DeadLettered,
    Error,
}

async fn apply_all(deps: &Deps, now: Timestamp, answers: Vec<Answer>, report: &mut TickReport) {
    let sem = Arc::new(Semaphore::new(deps.settings.concurrency.max(1)));
    let mut set = tokio::task::JoinSet::new();
    for (due, answer) in answers {
        let (deps, sem) = (deps.clone(), sem.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await;
            apply_one(&deps, now, due, answer).await
        });
    }
    while let Some(r) = set.join_next().await {
        match r {
            Ok(Applied::Recovered) => report.recovered += 1,
            Ok(Applied::Failed) => report.failed += 1,
            Ok(Applied::NotReady) => report.not_ready += 1,
            Ok(Applied::Transient) => report.transient += 1,
            Ok(Applied::AlreadyResolved) => report.already_resolved += 1,
            Ok(Applied::DeadLettered) => report.dead_lettered += 1,
            Ok(Applied::Error) | Err(_) => report.errors += 1,
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
        Ok(RecordOutcome::Duplicate(_) | RecordOutcome::Conflict(_)) => Applied::AlreadyResolved,
        Ok(other) => {
            tracing::error!(event = "poll_record_refused", task_ref = %r, outcome = ?other);
            Applied::Error
        }
        Err(e) => {
            // Same path as the callback: keep the result as a dead letter. Should that fail too,
            // the lease lapses and the next tick reads it again: nothing is lost either way.
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

async fn reschedule(
    deps: &Deps,
    due: &DueTask,
    next: Timestamp,
    read: bool,
    unknown: bool,
    not_ready_at: Option<Timestamp>,
) -> bool {
    match deps.store.reschedule(&due.task.task_ref, &deps.owner, next, read, unknown, not_ready_at).await {
        Ok(_) => true,
        Err(e) => {
            tracing::error!(event = "poll_store_failed", task_ref = %due.task.task_ref, error = %e);
            false
        }
    }
}

async fn apply_one(deps: &Deps, now: Timestamp, due: DueTask, answer: Result<ResAnswer, CaptchaAiError>) -> Applied {
    let s = &deps.settings;
    let next = now.plus(next_poll_delay(due.reads + 1));
    match answer {
        Ok(ResAnswer::Ready(solution)) => record(deps, now, &due, Outcome::Solved(solution)).await,
        Ok(ResAnswer::NotReady) => {
            if reschedule(deps, &due, next, true, false, Some(now)).await {
                Applied::NotReady
            } else {
                Applied::Error
            }
        }
        Ok(ResAnswer::Code(code)) => match code.class() {
            CodeClass::TerminalForTask => record(deps, now, &due, Outcome::Failed(code)).await,
            CodeClass::Unknown if due.unknown_codes + 1 >= s.max_unknown_codes => {
                tracing::warn!(event = "unknown_code_terminal", task_ref = %due.task.task_ref, %code);
                record(deps, now, &due, Outcome::Failed(code)).await
            }
            CodeClass::Unknown => {
                tracing::warn!(event = "unknown_code", task_ref = %due.task.task_ref, %code);
                if reschedule(deps, &due, next, true, true, None).await { Applied::Transient } else { Applied::Error }
            }
            CodeClass::Permanent => {
                // A key or request problem of ours: the task is not at fault, keep it.
                tracing::error!(event = "res_php_permanent", task_ref = %due.task.task_ref, %code);
                reschedule(deps, &due, next, false, false, None).await;
                Applied::Error
            }
            CodeClass::Transient | CodeClass::NotReady => {
                let wait = next_poll_delay(due.reads + 1).max(Duration::from_secs(retry_after_secs(code.as_ref())));
                if reschedule(deps, &due, now.plus(wait), true, false, None).await {
                    Applied::Transient
                } else {
                    Applied::Error
                }
            }
        },
        Err(e) => {
            tracing::warn!(event = "res_php_failed", task_ref = %due.task.task_ref, error = %e);
            reschedule(deps, &due, next, true, false, None).await;
            Applied::Transient
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_shared::domain::{CaptchaKind, Task, TaskRef, TaskState};

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
    fn decisions_follow_deadline_budget_and_id() {
        let s = PollerSettings::default();
        let pending = TaskState::Pending { submitted_at: Timestamp::from_millis(1_000) };
        let t = |ms| Timestamp::from_millis(ms);
        assert!(matches!(decide(&due(pending.clone(), Some("7"), 0), t(130_000), &s), Decision::Read(_)));
        assert!(
            matches!(decide(&due(pending.clone(), Some("7"), 20), t(130_000), &s), Decision::Expire(r) if r.contains("20 res.php reads"))
        );
        assert!(
            matches!(decide(&due(pending, Some("7"), 0), t(601_000), &s), Decision::Expire(r) if r.contains("600 s"))
        );
        assert_eq!(decide(&due(TaskState::Submitting, None, 0), t(5_000), &s), Decision::Wait { until: t(600_000) });
    }
}

//! One scheduled invocation ([`run_invocation`]) and its passes over the due tasks: the main
//! loop that decides, claims, paces and starts every read.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use relay_shared::domain::CaptchaId;
use relay_shared::store::{DueTask, StoreError};
use relay_shared::time::{Clock, Timestamp};

use crate::Deps;
use crate::answer::{read_batch, read_one, release};
use crate::breaker::Shared;
use crate::due::DueStream;
use crate::limiter::RateLimiter;
use crate::reads::Reads;
use crate::report::{TickReport, emit_metrics, log_report};
use crate::resend::{Resent, resend};
use crate::schedule::{Decision, decide};

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
    let mut limiter = RateLimiter::new(s.requests_per_second, deps.store.account.clone());
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
    match deps.store.account.breaker().await {
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

    let mut stream = DueStream::new(&deps.store.poll, now, s.page_size);
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
            Decision::Expire(reason) => match deps.store.poll.expire(&r, &reason, now, &deps.owner).await {
                Ok(true) => {
                    tracing::info!(event = "task_expired", task_ref = %r, reason);
                    report.expired += 1;
                }
                Ok(false) => report.lost_claims += 1,
                Err(e) => store_error(report, &r, &e),
            },
            Decision::Wait { until } => match deps.store.poll.claim(&due, &deps.owner, until, false).await {
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
                match deps.store.poll.claim(&due, &deps.owner, now.plus(s.lease), true).await {
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
                match deps.store.poll.claim(&due, &deps.owner, now.plus(s.lease), true).await {
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
    match deps.store.poll.next_due_after(now).await {
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

//! What one invocation did: the [`TickReport`], the per-answer [`PollOutcome`] it counts, and the
//! metrics and the log line it ends as.

use serde::Serialize;

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
    pub(crate) fn add(&mut self, a: PollOutcome) {
        match a {
            PollOutcome::Recovered => self.recovered += 1,
            PollOutcome::Failed => self.failed += 1,
            PollOutcome::NotReady => self.not_ready += 1,
            PollOutcome::Expired => self.expired += 1,
            PollOutcome::Transient => self.transient += 1,
            PollOutcome::AlreadyResolved => self.already_resolved += 1,
            PollOutcome::LateKept => self.late_kept += 1,
            PollOutcome::DeadLettered => self.dead_lettered += 1,
            PollOutcome::Released => self.released += 1,
            PollOutcome::Error => self.errors += 1,
        }
    }
}

/// What one answer did, for the report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PollOutcome {
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

pub(crate) fn emit_metrics(r: &TickReport) {
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

pub(crate) fn log_report(r: &TickReport) {
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

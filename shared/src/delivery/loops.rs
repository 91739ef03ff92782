//! What sets the worker going: the sweep of the due-for-delivery index (the delivery
//! function's schedule), a batch of pushes (a stream batch, retry messages), and local mode's
//! worker loop fed by its inbox.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::inbox::InboxRx;
use super::report::{Attempt, SweepReport};
use super::worker::Deliverer;
use crate::domain::TaskRef;
use crate::store::{DueDelivery, StoreError};
use crate::time::{Busy, Clock, Timestamp};

/// The sweep waits after a pass that met a store failure this long, doubled each time in a row,
/// up to [`SWEEP_TROUBLE_MAX_WAIT`]: 1 s, 2 s, 4 s, then every 8 s.
pub const SWEEP_TROUBLE_WAIT: Duration = Duration::from_secs(1);
pub const SWEEP_TROUBLE_MAX_WAIT: Duration = Duration::from_secs(8);

/// What the delivery function keeps of its invocation's time after the sweep's deadline (its
/// report and metrics).
pub const SWEEP_END_MARGIN: Duration = Duration::from_secs(2);

/// A child push of a sweep or the worker loop: its task, what came of it, and its busy guard
/// handed back (see [`Deliverer::deliver_all`]).
type Child = (TaskRef, Result<Attempt, StoreError>, Busy);

impl Deliverer {
    /// Up to a page per shard of the pushes due at `now`; `true` if a shard had more.
    async fn due_now(&self, now: Timestamp, report: &mut SweepReport) -> (Vec<DueDelivery>, bool) {
        let mut batch = Vec::new();
        let mut more = false;
        let pushes = &self.pushes;
        let pages = (0..pushes.shards().read()).map(|shard| pushes.due_deliveries(shard, now, 100, None));
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
            let oldest = match self.pushes.oldest_delivery_due().await {
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
                    (batch, more, self.pushes.oldest_delivery_due().await)
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
}

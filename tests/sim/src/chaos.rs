//! The chaos run: local mode's relay (the same handlers, the poller, the on-disk dead-letter
//! queue and its redrive loop) under every fault at once, on the simulated clock, with the
//! template's settings, against the CaptchaAI-like fake — then checked against what the fake
//! really did.
//!
//! Faults: pingbacks dropped, duplicated, late (after the poller recorded the result) and
//! conflicting; a share of store writes failing (every retry of the same write fails) and a
//! store outage of minutes; dead-letter sends failing in bursts; res.php answering 5xx and HTML
//! in bursts, and one IP ban; the relay killed and restarted twice mid-run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use fake_captchaai::{Endpoint, FakeConfig, Fault, FaultKind};
use relay_shared::domain::CaptchaKind;
use relay_time::Clock;

use crate::{EPOCH, Figures, Options, World, percentile, steady};

/// What the run does; [`ChaosConfig::full`] is the documented run, [`ChaosConfig::short`] CI's.
#[derive(Debug, Clone)]
pub struct ChaosConfig {
    pub seed: u64,
    pub tasks: usize,
    /// Submits are spread evenly over this long (simulated).
    pub over: Duration,
    pub drop: f64,
    pub duplicate: f64,
    pub late: f64,
    pub conflicting: f64,
    /// Share of store writes that fail (with all their retries).
    pub store_write_failures: f64,
    /// A full store outage: from (offset from the start), for.
    pub store_outage: (Duration, Duration),
    /// Dead-letter sends failing: bursts, each (offset, length).
    pub queue_outages: Vec<(Duration, Duration)>,
    /// res.php bursts: (offset, length, kind).
    pub res_php_bursts: Vec<(Duration, Duration, FaultKind)>,
    /// One IP ban of 5 minutes, at this offset.
    pub ban_at: Duration,
    /// The relay killed at these offsets, down for 20 s each.
    pub kills: Vec<Duration>,
    /// Where local mode keeps its dead letters.
    pub data_dir: std::path::PathBuf,
}

const ALL_KINDS: [CaptchaKind; 8] = CaptchaKind::CAPTCHAAI;

impl ChaosConfig {
    /// The documented run: 10,000 tasks over 40 simulated minutes.
    pub fn full(seed: u64) -> Self {
        Self::scaled(seed, 10_000, Duration::from_secs(40 * 60))
    }

    /// The short run CI makes: 300 tasks over 10 simulated minutes, every fault included (the
    /// same timeline as the full run's, at a 30th of its density; about 2 minutes of real time
    /// on 2 cores).
    pub fn short(seed: u64) -> Self {
        Self::scaled(seed, 300, Duration::from_secs(10 * 60))
    }

    /// `tasks` over `over`, with the faults placed at the same fractions of the run.
    pub fn scaled(seed: u64, tasks: usize, over: Duration) -> Self {
        let at = |f: f64| over.mul_f64(f);
        Self {
            seed,
            tasks,
            over,
            drop: 0.3,
            duplicate: 0.1,
            late: 0.1,
            conflicting: 0.05,
            store_write_failures: 0.1,
            store_outage: (at(0.45), Duration::from_secs(180)),
            queue_outages: vec![(at(0.2), Duration::from_secs(60)), (at(0.47), Duration::from_secs(60))],
            res_php_bursts: vec![
                (at(0.3), Duration::from_secs(60), FaultKind::Http5xx),
                (at(0.6), Duration::from_secs(60), FaultKind::Html),
            ],
            ban_at: at(0.75),
            kills: vec![at(0.35), at(0.65)],
            data_dir: std::env::temp_dir().join(format!("relay-chaos-{seed}-{}", std::process::id())),
        }
    }
}

/// What the run found.
#[derive(Debug, Clone, Default)]
pub struct ChaosReport {
    pub figures: Figures,
    /// Deliveries written more than once: the same result with the same receipt time written
    /// twice to a task (seen by the store's fault injector).
    pub double_applied: usize,
    /// Tasks whose stored result was replaced by a different one received earlier (first
    /// received wins, before the owner is shown one).
    pub replaced: usize,
    /// Tasks the fake accepted beyond one per owner task.
    pub double_paid: usize,
    /// Tasks sent to in.php a second time, stranded by an unknown outcome (allowed, once).
    pub resent: usize,
    pub in_php_calls: u64,
    pub tasks_accepted: u64,
    pub duplicates_sent: u64,
    pub conflicting_sent: u64,
    /// Conflicting pingbacks for tasks that kept their first (real) result.
    pub conflicts_kept_first: usize,
    pub late_callbacks: u64,
    pub store_faults: u64,
    pub dead_letters_written: u64,
    pub dead_letters_left: u64,
    /// Poisoned letters the operator command listed, and moved back.
    pub poisoned_listed: usize,
    pub fake_bans: u64,
    pub requests_during_ban: u64,
    pub real_time: Duration,
    /// Everything a log line or metric must never contain: the keys, the signing secret, and
    /// every token the fake produced.
    pub secrets: Vec<String>,
}

impl ChaosReport {
    /// The secrets and tokens found in the captured logs and metrics.
    pub fn leaks(&self, logs: &crate::logs::Captured) -> Vec<String> {
        logs.leaks(self.secrets.iter().map(String::as_str))
    }

    /// The guarantees, checked: an empty list means the run kept every promise.
    pub fn violations(&self) -> Vec<String> {
        let f = &self.figures;
        let mut v = Vec::new();
        let mut check = |ok: bool, what: String| {
            if !ok {
                v.push(what);
            }
        };
        check(f.lost == 0, format!("lost = {} (e.g. {:?})", f.lost, f.lost_refs.iter().take(3).collect::<Vec<_>>()));
        check(self.double_applied == 0, format!("double-applied = {}", self.double_applied));
        check(self.double_paid == 0, format!("double-paid = {}", self.double_paid));
        check(f.stale_handed_out == 0, format!("stale handed out = {}", f.stale_handed_out));
        check(f.max_reads() <= 20, format!("a task cost {} res.php reads", f.max_reads()));
        check(self.fake_bans <= 1, format!("banned {} times (1 injected)", self.fake_bans));
        check(f.open == 0, format!("{} tasks still open past their deadline", f.open));
        check(f.over_deadline == 0, format!("{} poller invocations over their deadline", f.over_deadline));
        check(self.dead_letters_left == 0, format!("{} dead letters left", self.dead_letters_left));
        check(
            self.conflicts_kept_first as u64 == self.conflicting_sent,
            format!("conflicts kept first {} of {}", self.conflicts_kept_first, self.conflicting_sent),
        );
        v
    }

    pub fn table(&self) -> String {
        let f = &self.figures;
        let ages = |path: &str| {
            let v = f.handout_age.get(path).cloned().unwrap_or_default();
            format!("p50 {:>3.0} s  p95 {:>3.0} s  (n={})", percentile(&v, 50.0), percentile(&v, 95.0), v.len())
        };
        let rows: Vec<(&str, String)> = vec![
            ("tasks", f.tasks.to_string()),
            ("by callback / poll / redrive", format!("{} / {} / {}", f.by_callback, f.by_poll, f.by_redrive)),
            ("expired (no result in time)", f.expired.to_string()),
            ("LOST", f.lost.to_string()),
            ("DOUBLE-APPLIED", self.double_applied.to_string()),
            ("result replaced by an earlier-received one", self.replaced.to_string()),
            ("SENT TWICE WITHOUT CAUSE", self.double_paid.to_string()),
            ("stranded and sent again (once)", self.resent.to_string()),
            ("STALE HANDED OUT", f.stale_handed_out.to_string()),
            ("in.php calls / tasks accepted", format!("{} / {}", self.in_php_calls, self.tasks_accepted)),
            ("res.php requests (max per task)", format!("{} ({})", f.res_php_requests, f.max_reads())),
            ("bans (1 injected) / requests in it", format!("{} / {}", self.fake_bans, self.requests_during_ban)),
            ("token age at hand-out: callback", ages("callback")),
            ("token age at hand-out: poll", ages("poll")),
            ("token age at hand-out: redrive", ages("redrive")),
            ("duplicate pingbacks absorbed", self.duplicates_sent.to_string()),
            ("late pingbacks", self.late_callbacks.to_string()),
            (
                "conflicting pingbacks, first kept",
                format!("{} of {}", self.conflicts_kept_first, self.conflicting_sent),
            ),
            ("store faults injected", self.store_faults.to_string()),
            ("dead letters written / left", format!("{} / {}", self.dead_letters_written, self.dead_letters_left)),
            ("poisoned, listed and moved back", self.poisoned_listed.to_string()),
            ("poller invocations (over deadline)", format!("{} ({})", f.invocations, f.over_deadline)),
            (
                "simulated / real time",
                format!("{:.0} s / {:.1} s", f.sim_time.as_secs_f64(), self.real_time.as_secs_f64()),
            ),
        ];
        let mut out = String::new();
        for (k, v) in rows {
            out.push_str(&format!("| {k:<36} | {v:>36} |\n"));
        }
        out
    }
}

/// Runs the chaos scenario.
pub async fn run(cfg: &ChaosConfig) -> anyhow::Result<ChaosReport> {
    let started = Instant::now();
    let at = |d: Duration| EPOCH.plus(d).as_millis();
    let mut faults: Vec<Fault> = cfg
        .res_php_bursts
        .iter()
        .map(|(from, len, kind)| Fault {
            from_ms: at(*from),
            until_ms: at(*from + *len),
            endpoint: Endpoint::ResPhp,
            kind: *kind,
        })
        .collect();
    faults.sort_by_key(|f| f.from_ms);
    let fake = FakeConfig {
        seed: cfg.seed,
        drop_callbacks: cfg.drop,
        duplicate_callbacks: cfg.duplicate,
        late_callbacks: cfg.late,
        // Late: after the poller has read and recorded the result (first reads come 20–65 s
        // after submit).
        late_callback_ms: 90_000,
        conflicting_callbacks: cfg.conflicting,
        unsolvable: 0.02,
        faults,
        ..FakeConfig::captchaai_like()
    };
    let _ = std::fs::remove_dir_all(&cfg.data_dir);
    let w = Arc::new(
        World::start_with(
            fake,
            Options {
                flaky_relay_store: true,
                flaky_poller_store: true,
                disk_queue: Some(cfg.data_dir.clone()),
                ..Options::default()
            },
        )
        .await?,
    );
    let flaky = w.flaky.as_ref().ok_or_else(|| anyhow::anyhow!("chaos needs the fault injector"))?;
    flaky.set_write_failure_rate(cfg.store_write_failures);
    w.schedule_poller(EPOCH);
    w.start_redrive_loop();
    w.start_owner(steady(EPOCH, cfg.over, cfg.tasks, &ALL_KINDS), Duration::from_secs(5));
    spawn_director(w.clone(), cfg.clone());
    // The run: the submits, then the deadline (600 s) and a margin for the last reads.
    w.run_for(cfg.over + Duration::from_secs(900)).await;

    // The operator's turn: list what was poisoned, move it back, let it drain.
    let queue = w.queue.clone().ok_or_else(|| anyhow::anyhow!("chaos runs on the disk queue"))?;
    let poisoned = crate::chaos::operator_list(&queue)?;
    for (id, _) in &poisoned {
        queue.unpoison(*id)?;
    }
    flaky.set_write_failure_rate(0.0);
    w.run_for(Duration::from_secs(120)).await;

    let figures = w.figures().await?;
    let counts = w.fake.counts();
    let applied = flaky.applied_results();
    let fake_tasks = w.fake.tasks();
    // Sent twice: two tasks at the fake for one of ours (its pingback path names ours) — once
    // allowed for a task stranded by an unknown in.php outcome and overdue, never otherwise.
    let sends = relay_shared::testkit::sends(&w.store, fake_tasks.iter().filter_map(|t| t.pingback.as_deref())).await?;
    let mut conflicts_kept_first = 0;
    for t in fake_tasks.iter().filter(|t| t.callback_statuses.len() > usize::from(t.pingbacks_planned)) {
        let Some(p) = &t.pingback else { continue };
        let Ok(r) = relay_shared::domain::TaskRef::parse(p.split('/').rev().nth(1).unwrap_or_default()) else {
            continue;
        };
        if let Some(task) = w.store.tasks().get(&r).await? {
            let kept = match &task.state {
                relay_shared::domain::TaskState::Solved { solution, .. } => {
                    Some(solution.expose()) == t.answer.as_deref()
                }
                relay_shared::domain::TaskState::Failed { code, .. } => Some(code.as_ref()) == t.answer.as_deref(),
                _ => true,
            };
            conflicts_kept_first += usize::from(kept);
        }
    }
    Ok(ChaosReport {
        double_applied: applied.values().filter(|n| **n > 1).count(),
        replaced: flaky.replaced_results(),
        double_paid: sends.without_cause,
        resent: sends.resent,
        in_php_calls: counts.in_php,
        tasks_accepted: counts.tasks_accepted,
        duplicates_sent: fake_tasks.iter().filter(|t| t.pingbacks_planned == 2).count() as u64,
        conflicting_sent: counts.conflicting_sent,
        conflicts_kept_first,
        late_callbacks: fake_tasks.iter().filter(|t| t.late && t.pingbacks_planned > 0).count() as u64,
        store_faults: flaky.calls_failed(),
        dead_letters_written: queue.total_sent()?,
        dead_letters_left: queue.depth()?,
        poisoned_listed: poisoned.len(),
        fake_bans: counts.bans,
        requests_during_ban: counts.requests_during_ban,
        real_time: started.elapsed(),
        secrets: [w.fake.api_key(), w.api_key.clone(), crate::SIGNING_SECRET.to_owned()]
            .into_iter()
            .chain(fake_tasks.iter().filter_map(|t| t.answer.clone()).filter(|a| !a.starts_with("ERROR")))
            .collect(),
        figures,
    })
}

/// What `relay-local dead-letters list` shows: every poisoned letter, its id and a redacted
/// summary.
pub fn operator_list(queue: &relay_local::queue::DiskQueue) -> anyhow::Result<Vec<(i64, String)>> {
    relay_local::run::list_poisoned(queue, false)
}

/// The faults on the clock: an actor that switches them on and off at their times.
fn spawn_director(w: Arc<World>, cfg: ChaosConfig) {
    let clock: Arc<dyn Clock> = Arc::new(w.clock.clone());
    let busy = clock.busy();
    tokio::spawn(async move {
        let _busy = busy;
        #[derive(Debug)]
        enum Step {
            StoreDown(bool),
            QueueDown(bool),
            Ban,
            Kill,
        }
        let mut plan: Vec<(Duration, Step)> = vec![
            (cfg.store_outage.0, Step::StoreDown(true)),
            (cfg.store_outage.0 + cfg.store_outage.1, Step::StoreDown(false)),
            (cfg.ban_at, Step::Ban),
        ];
        for (from, len) in &cfg.queue_outages {
            plan.push((*from, Step::QueueDown(true)));
            plan.push((*from + *len, Step::QueueDown(false)));
        }
        plan.extend(cfg.kills.iter().map(|k| (*k, Step::Kill)));
        plan.sort_by_key(|(d, _)| *d);
        for (when, step) in plan {
            clock.sleep_until(EPOCH.plus(when)).await;
            tracing::info!(event = "chaos_step", ?step, at_secs = when.as_secs());
            match step {
                Step::StoreDown(on) => {
                    if let Some(f) = &w.flaky {
                        f.set_failing(on);
                    }
                }
                Step::QueueDown(on) => w.queue_fail.store(on, std::sync::atomic::Ordering::SeqCst),
                Step::Ban => w.fake.ban_ip(Duration::from_secs(300)),
                Step::Kill => w.kill_and_restart(Duration::from_secs(20)).await,
            }
        }
    });
}

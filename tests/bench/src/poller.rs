//! Part 4: the fallback poller, on the simulated clock with the template's settings.
//!
//! - Stale tasks: submits through the API, every pingback lost, CaptchaAI-like solve times;
//!   res.php requests and DynamoDB operations per 1,000 tasks, batching off (as deployed) and on,
//!   against the seed tutorial's poller (every 30 s, one res.php per task pending > 120 s),
//!   computed from the same tasks' submit and solve times.
//! - Drains: N tasks due at once (a callback outage's backlog), already solved at CaptchaAI:
//!   simulated time and requests to drain them at the template's limits.
//! - Independence: the same drain beside a table of resolved tasks; the poller's reads must not
//!   grow with the table.
//!
//! The simulation's clock is injected: the template's timeout, rate, schedule and grace apply
//! unchanged; only waiting is skipped.

use std::collections::HashMap;
use std::time::Duration;

use aws_sdk_dynamodb::types::{AttributeValue, PutRequest, WriteRequest};
use fake_captchaai::FakeConfig;
use relay_shared::domain::{CaptchaId, CaptchaKind, Task, TaskRef};
use relay_shared::store::TaskStore;
use relay_shared::testkit::OperationCounter;
use relay_shared::time::Clock;
use relay_sim::{EPOCH, World, steady};

use crate::Opts;

/// What one poller run cost.
#[derive(Debug, Default, Clone)]
pub struct PollRun {
    pub tasks: usize,
    pub res_php: u64,
    pub ops: HashMap<&'static str, u64>,
    pub recovered: u64,
    pub failed: u64,
    pub expired: u64,
    pub lost: usize,
    pub invocations: usize,
    pub over_deadline: usize,
    pub bans: u64,
    /// Simulated time from the first due task to the last one resolved.
    pub drain: Duration,
    /// Real (wall) time the run took.
    pub wall: Duration,
    /// The seed tutorial's res.php requests for the same tasks (stale runs only).
    pub seed_res_php: Option<u64>,
    /// The most requests the seed's poller makes in one of its 30 s ticks.
    pub seed_peak_tick: u64,
    /// Tokens that live 120 s (reCAPTCHA, hCaptcha) recovered by a read: their age at the read (s),
    /// for this poller and for the seed's.
    pub ages: Vec<f64>,
    pub seed_ages: Vec<f64>,
    /// Whether the poller read with `ids=` (and the fake took it).
    pub batching: bool,
    /// Billed poller time (simulated ms, rounded up per invocation).
    pub poller_ms: u64,
}

const OPS: [&str; 5] = ["Query", "UpdateItem", "GetItem", "PutItem", "Scan"];

impl PollRun {
    fn per_1000(&self, v: u64) -> f64 {
        v as f64 * 1000.0 / self.tasks.max(1) as f64
    }

    fn fill(&mut self, world: &World, counter: &OperationCounter) {
        for op in OPS {
            self.ops.insert(op, counter.count(op));
        }
        let inv = world.invocations();
        self.invocations = inv.len();
        self.over_deadline = inv.iter().filter(|i| i.ended > i.deadline || i.report.over_deadline).count();
        self.recovered = inv.iter().map(|i| i.report.recovered).sum();
        self.failed = inv.iter().map(|i| i.report.failed).sum();
        self.expired = inv.iter().map(|i| i.report.expired).sum();
        self.poller_ms = inv.iter().map(|i| i.ended.since(i.started).as_millis() as u64).sum();
        let c = world.fake.counts();
        self.res_php = c.res_php;
        self.bans = c.bans;
    }
}

/// Swaps the poller's store for one whose client counts what it sends.
fn count_poller(world: &mut World) -> OperationCounter {
    let (client, counter) = world.db.counting_client();
    world.poller.store =
        relay_poller::Store::new(&TaskStore::new(client, world.store.table(), Duration::from_secs(7 * 86_400)));
    counter
}

fn resolved(world: &World) -> u64 {
    world.invocations().iter().map(|i| i.report.recovered + i.report.failed + i.report.expired).sum()
}

/// Submits `n` tasks through the API with every pingback lost, and lets the poller recover them.
pub async fn stale(n: usize, batching: bool) -> anyhow::Result<PollRun> {
    let wall = std::time::Instant::now();
    let fake =
        FakeConfig { drop_callbacks: 1.0, batch_supported: batching, unsolvable: 0.05, ..FakeConfig::captchaai_like() };
    let mut world = World::start(fake).await?;
    world.poller.settings.batch = batching;
    let counter = count_poller(&mut world);
    let mix = [CaptchaKind::RecaptchaV2, CaptchaKind::RecaptchaEnterprise, CaptchaKind::Turnstile, CaptchaKind::Image];
    // At the API's submit rate (14/s), so the owner is never told to wait.
    let over = Duration::from_millis(n as u64 * 1000 / 12);
    world.start_owner(steady(EPOCH, over, n, &mix), None);
    world.schedule_poller(EPOCH.plus(Duration::from_secs(1)));
    let limit = over + Duration::from_secs(3_600);
    while resolved(&world) < n as u64 && world.clock.now().since(EPOCH) < limit {
        world.run_for(Duration::from_secs(60)).await;
    }
    let figures = world.figures().await?;
    let c = world.fake.counts();
    eprintln!("   stale n={n} batching={batching}: res.php {} ({} ids)", c.res_php, c.res_php_ids);
    let mut run = PollRun { tasks: n, lost: figures.lost, batching, ..PollRun::default() };
    run.fill(&world, &counter);
    run.drain = world
        .invocations()
        .iter()
        .filter(|i| i.report.claimed > 0)
        .map(|i| i.ended)
        .max()
        .unwrap_or(EPOCH)
        .since(EPOCH);
    let (seed, peak, seed_ages) = seed_requests(&world);
    (run.seed_res_php, run.seed_peak_tick, run.seed_ages) = (Some(seed), peak, seed_ages);
    // This poller's: when it read each short-lived token, against when the fake solved it.
    for o in world.owned().iter().filter(|o| o.kind.token_lifetime() == Some(Duration::from_secs(120))) {
        let task = world.store.tasks().get(&o.task_ref).await?;
        let solved = o.captcha_id.as_deref().and_then(|id| world.fake.task(id)).map(|t| t.solved_at);
        if let (Some(relay_shared::domain::TaskState::Solved { resolved_at, via, .. }), Some(solved)) =
            (task.map(|t| t.state), solved)
            && via.as_str() == "poll"
        {
            run.ages.push(resolved_at.since(solved).as_secs_f64());
        }
    }
    run.wall = wall.elapsed();
    anyhow::ensure!(
        resolved(&world) >= n as u64,
        "only {} of {n} stale tasks were resolved in {:?} of simulated time",
        resolved(&world),
        limit
    );
    Ok(run)
}

/// The seed tutorial's poller on the same tasks: every 30 s, one res.php request for each task
/// pending for more than 120 s, until a read finds it solved (or failed). No budget, no deadline.
fn seed_requests(world: &World) -> (u64, u64, Vec<f64>) {
    let tick = 30_000u64;
    let epoch = EPOCH.as_millis();
    let mut per_tick: HashMap<u64, u64> = HashMap::new();
    let mut ages = Vec::new();
    let total = world
        .fake
        .tasks()
        .iter()
        .map(|t| {
            let (sub, solved) = (t.submitted_at.as_millis(), t.solved_at.as_millis());
            // Ticks at epoch + k·30 s; the first one strictly more than 120 s after the submit.
            let first = epoch + ((sub + 120_001).saturating_sub(epoch)).div_ceil(tick) * tick;
            // Reads at first, first + 30 s, … up to the first tick at or after the solve.
            let reads = if solved <= first { 1 } else { (solved - first).div_ceil(tick) + 1 };
            for k in 0..reads {
                *per_tick.entry(first + k * tick).or_default() += 1;
            }
            if matches!(t.method.as_str(), "userrecaptcha" | "hcaptcha")
                && t.answer.as_deref().is_some_and(|a| !a.starts_with("ERROR"))
            {
                ages.push((first + (reads - 1) * tick).saturating_sub(solved) as f64 / 1000.0);
            }
            reads
        })
        .sum();
    (total, per_tick.values().copied().max().unwrap_or(0), ages)
}

/// Creates `n` tasks, all due now and already solved at CaptchaAI (a callback outage's backlog),
/// and, with `beside`, that many resolved tasks in the same table. Then lets the poller drain them.
pub async fn drain(n: usize, beside: usize, batching: bool) -> anyhow::Result<PollRun> {
    let wall = std::time::Instant::now();
    let mut world = World::start(FakeConfig { batch_supported: batching, ..FakeConfig::captchaai_like() }).await?;
    world.poller.settings.batch = batching;
    let counter = count_poller(&mut world);
    let ids = world.fake.preload_solved(n);
    let now = world.clock.now();
    // n due tasks, 16 writers at once.
    let mut set = tokio::task::JoinSet::new();
    for chunk in ids.chunks(n.div_ceil(16).max(1)) {
        let (store, chunk) = (world.store.clone(), chunk.to_vec());
        set.spawn(async move {
            for id in chunk {
                let task_ref = TaskRef::generate();
                let task = Task::new(task_ref.clone(), CaptchaKind::Turnstile, now);
                store.tasks().create(&task, now, None).await?;
                store.tasks().mark_submitted(&task_ref, &CaptchaId::parse(&id)?, now, now).await?;
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    fill_resolved(&world, beside).await?;
    eprintln!(
        "   {n} due tasks{} written in {:.0?}",
        if beside > 0 { format!(" and {beside} resolved") } else { String::new() },
        wall.elapsed()
    );
    world.schedule_poller(now.plus(Duration::from_secs(1)));
    // At 10 reads/s a drain takes n / 10 s; allow twice that and an hour.
    let limit = Duration::from_secs(n as u64 / 5 + 3_600);
    while resolved(&world) < n as u64 && world.clock.now().since(now) < limit {
        world.run_for(Duration::from_secs(60)).await;
    }
    let mut run = PollRun { tasks: n, batching, ..PollRun::default() };
    run.fill(&world, &counter);
    run.drain =
        world.invocations().iter().filter(|i| i.report.claimed > 0).map(|i| i.ended).max().unwrap_or(now).since(now);
    run.wall = wall.elapsed();
    anyhow::ensure!(
        resolved(&world) >= n as u64,
        "only {} of {n} due tasks were drained in {limit:?} of simulated time",
        resolved(&world)
    );
    Ok(run)
}

/// Writes `n` resolved tasks (as the relay leaves them: no poll attributes) with BatchWriteItem.
async fn fill_resolved(world: &World, n: usize) -> anyhow::Result<()> {
    if n == 0 {
        return Ok(());
    }
    let s = |v: &str| AttributeValue::S(v.to_owned());
    let num = |v: u64| AttributeValue::N(v.to_string());
    let at = world.clock.now().as_millis();
    let token = "x".repeat(600);
    let batches: Vec<Vec<WriteRequest>> = (0..n)
        .map(|i| {
            let item = HashMap::from([
                ("pk".to_owned(), s(TaskRef::generate().as_ref())),
                ("kind".to_owned(), s("turnstile")),
                ("state".to_owned(), s("solved")),
                ("created_at".to_owned(), num(at)),
                ("submitted_at".to_owned(), num(at)),
                ("captcha_id".to_owned(), s(&(90_000_000_000u64 + i as u64).to_string())),
                ("solution".to_owned(), s(&token)),
                ("token_clock_start".to_owned(), num(at)),
                ("resolved_at".to_owned(), num(at)),
                ("resolved_via".to_owned(), s("callback")),
                ("expires_ttl".to_owned(), num(at / 1000 + 7 * 86_400)),
            ]);
            Ok(WriteRequest::builder().put_request(PutRequest::builder().set_item(Some(item)).build()?).build())
        })
        .collect::<Result<Vec<_>, aws_sdk_dynamodb::error::BuildError>>()?
        .chunks(25)
        .map(<[_]>::to_vec)
        .collect();
    let writers = 8;
    let mut set = tokio::task::JoinSet::new();
    let per = batches.len().div_ceil(writers);
    for part in batches.chunks(per.max(1)).map(<[_]>::to_vec) {
        let (client, table) = (world.db.client(), world.store.table().to_owned());
        set.spawn(async move {
            for batch in part {
                let mut pending = Some(HashMap::from([(table.clone(), batch)]));
                while let Some(items) = pending.take().filter(|m| m.values().any(|v| !v.is_empty())) {
                    let out = client.batch_write_item().set_request_items(Some(items)).send().await?;
                    pending = out.unprocessed_items;
                }
            }
            anyhow::Ok(())
        });
    }
    while let Some(r) = set.join_next().await {
        r??;
    }
    Ok(())
}

/// The deployed-settings stale run of this process's poller part, for the cost part to price.
pub static STALE_RUN: std::sync::OnceLock<PollRun> = std::sync::OnceLock::new();

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let (stale_n, drains, beside) =
        if opts.quick { (60, vec![300], (300, 3_000)) } else { (1_000, vec![10_000, 100_000], (1_000, 1_000_000)) };
    let off = stale(stale_n, false).await?;
    let _ = STALE_RUN.set(off.clone());
    let on = stale(stale_n, true).await?;
    let mut drained = Vec::new();
    for n in drains {
        drained.push(drain(n, 0, false).await?);
    }
    drained.push(drain(drained[0].tasks, 0, true).await?);
    let alone = drain(beside.0, 0, false).await?;
    let next_to = drain(beside.0, beside.1, false).await?;
    Ok(render(&off, &on, &drained, &alone, &next_to, beside.1))
}

fn ops_cells(r: &PollRun) -> String {
    OPS.iter()
        .map(|op| format!("{:.0}", r.per_1000(r.ops.get(op).copied().unwrap_or(0))))
        .collect::<Vec<_>>()
        .join(" | ")
}

fn render(
    off: &PollRun,
    on: &PollRun,
    drained: &[PollRun],
    alone: &PollRun,
    next_to: &PollRun,
    beside: usize,
) -> String {
    let mut s = String::from(
        "## 4. Poller: the fallback path at the template's limits\n\n\
         On the simulated clock with template.yaml's poller settings (timeout, 10 res.php requests/s, \
         schedule every minute, per-kind grace, read budget, deadline) against the fake CaptchaAI \
         with bans enforced. DynamoDB operations are counted by an interceptor on the poller's own \
         SDK client.\n\n\
         **Stale tasks** (every pingback lost; realistic solve times, 5 % unsolvable), per 1,000 tasks:\n\n\
         | run | tasks | res.php | Query | UpdateItem | GetItem | PutItem | Scan | lost | bans | seed's res.php | seed's busiest 30 s |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (name, r) in [("batching off (deployed)", off), ("batching on (fake takes `ids=`)", on)] {
        s.push_str(&format!(
            "| {name} | {} | {:.0} | {} | {} | {} | {} | {} |\n",
            r.tasks,
            r.per_1000(r.res_php),
            ops_cells(r),
            r.lost,
            r.bans,
            r.seed_res_php.map_or("–".into(), |v| format!("{:.0}", r.per_1000(v))),
            r.seed_peak_tick,
        ));
    }
    let fresh = |ages: &[f64]| {
        let usable = ages.iter().filter(|a| **a <= 60.0).count();
        format!(
            "age at the read p50 {:.0} s, p95 {:.0} s; {} of {} read with ≥ 60 s of their 120 s left",
            crate::stats::percentile(ages, 50.0),
            crate::stats::percentile(ages, 95.0),
            usable,
            ages.len()
        )
    };
    s.push_str(&format!(
        "\n**Tokens still usable** (reCAPTCHA and hCaptcha live 120 s from the solve): this poller (deployed \
         settings): {}. The seed's: {}.\n",
        fresh(&off.ages),
        fresh(&off.seed_ages)
    ));
    s.push_str(
        "\nThe seed's poller (tutorial, pattern 1) reads every task pending more than 120 s, every 30 s, \
         one request each, with no rate limit, budget or deadline; its count is computed from the \
         same tasks' submit and solve times. It keeps its state in memory: no table reads, and \
         nothing survives a restart.\n\n\
         **Drains** (N tasks due at once, already solved at CaptchaAI):\n\n\
         | due tasks | batching | resolved beside | drained in (simulated) | res.php | per task: Query | UpdateItem | invocations | over deadline | bans | wall |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for (r, b) in drained.iter().map(|r| (r, 0)).chain([(alone, 0), (next_to, beside)]) {
        let per = |op: &str| r.ops.get(op).copied().unwrap_or(0) as f64 / r.tasks.max(1) as f64;
        s.push_str(&format!(
            "| {} | {} | {b} | {:.0} s | {} | {:.3} | {:.2} | {} | {} | {} | {:.0} s |\n",
            r.tasks,
            if r.batching { "on" } else { "off" },
            r.drain.as_secs_f64(),
            r.res_php,
            per("Query"),
            per("UpdateItem"),
            r.invocations,
            r.over_deadline,
            r.bans,
            r.wall.as_secs_f64(),
        ));
    }
    let q = |r: &PollRun| r.ops.get("Query").copied().unwrap_or(0);
    s.push_str(&format!(
        "\nReads beside {beside} resolved tasks: {} Query against {} without them — {}. Due tasks are \
         found through the sparse index `due-for-poll`, which only open tasks are in.\n",
        q(next_to),
        q(alone),
        if q(next_to) <= q(alone) + q(alone) / 10 + 4 { "independent of the table's size" } else { "NOT independent" },
    ));
    s
}

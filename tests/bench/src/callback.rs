//! Part 1: the callback path against the one write it needs.
//!
//! The callback handler, called as the Lambda calls it (JSON log subscriber and EMF metrics
//! recorder installed, the request already decoded from the API Gateway event), against ONE bare
//! conditional UpdateItem of the same size to the same engine from the same SDK client. Both for
//! a first delivery (a write) and a duplicate (a refused write). Rounds alternate the order
//! (ABAB, BABA) so drift on a shared machine hits both sides; the figure is the median over
//! rounds of the per-round ratio of p50s, with its spread. Run on the embedded engine and, when
//! a moto server is given, on moto's DynamoDB.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use aws_sdk_dynamodb::Client;
use aws_sdk_dynamodb::types::AttributeValue;
use relay_shared::deadletter::DeadLetterSink;
use relay_shared::domain::{CaptchaId, CaptchaKind, Task, TaskRef};
use relay_shared::signing::CallbackSigner;
use relay_shared::store::{TaskStore, schema};
use relay_shared::testkit::{ApiGatewayEvent, LocalDynamo, MemorySink, client_for};
use relay_shared::time::{Clock, SystemClock};
use secrecy::SecretString;

use crate::Opts;
use crate::stats::{Spread, percentile};

/// A reCAPTCHA token's typical length (they run 500–2,000 characters).
const TOKEN_LEN: usize = 600;
const TARGET_RATIO: f64 = 1.2;

struct Sizes {
    rounds: usize,
    calls: usize,
    concurrent_calls: usize,
}

/// One engine's figures.
struct EngineFigures {
    engine: &'static str,
    /// Per round: (handler p50, bare p50, handler p99, bare p99, store p50) in µs, for writes and
    /// duplicates.
    write: Vec<[f64; 5]>,
    dup: Vec<[f64; 5]>,
    /// CPU µs per call of the whole process (client, handler and engine): [write, duplicate] ×
    /// [handler, store alone, bare].
    cpu: [[Spread; 3]; 2],
    /// A duplicate with the recent-results cache on: (p50, p99) µs.
    cached: (f64, f64),
    /// Calls per second with 16 callers: (handler, bare), writes.
    throughput: (f64, f64),
}

pub async fn run(opts: &Opts) -> anyhow::Result<String> {
    let sizes = if opts.quick {
        Sizes { rounds: 2, calls: 40, concurrent_calls: 160 }
    } else {
        Sizes { rounds: 5, calls: 400, concurrent_calls: 4_000 }
    };
    let embedded = LocalDynamo::start().await?;
    let mut engines = vec![measure("embedded engine (dynoxide)", &embedded.endpoint, &sizes).await?];
    match &opts.moto {
        Some(moto) => engines.push(measure("moto", moto, &sizes).await?),
        None => eprintln!("no moto server given (--moto): part 1 runs on the embedded engine only"),
    }
    let instructions = instruction_counts(opts.quick).await?;
    Ok(render(&engines, &sizes, instructions.as_ref()))
}

struct Rig {
    client: Client,
    table: String,
    deps: relay_callback::Deps,
    store: TaskStore,
    signer: CallbackSigner,
    token: String,
}

impl Rig {
    async fn new(endpoint: &str) -> anyhow::Result<Self> {
        let client = client_for(endpoint);
        let table = format!("bench-{}", uuid::Uuid::new_v4().simple());
        schema::create_table(&client, &table).await?;
        let store = TaskStore::new(client.clone(), table.clone(), Duration::from_secs(7 * 86_400));
        let signer = CallbackSigner::new(SecretString::from("bench-signing-secret-0123456789".to_owned()));
        let dead_letters: Arc<dyn DeadLetterSink> = Arc::new(MemorySink::default());
        // The recent-results cache off: every duplicate is a refused write, as the target is about.
        let deps = relay_callback::Deps {
            results: store.results(),
            signer: signer.clone(),
            clock: Arc::new(SystemClock),
            dead_letters,
            recent: relay_callback::RecentResults::disabled(),
        };
        let token: String = std::iter::repeat("03AFcWeA6x").flat_map(str::chars).take(TOKEN_LEN).collect();
        Ok(Self { client, table, deps, store, signer, token })
    }

    /// `n` tasks accepted by in.php (state pending), as the API leaves them. Returns (ref, id).
    async fn pending_tasks(&self, n: usize) -> anyhow::Result<Vec<(TaskRef, CaptchaId)>> {
        let now = SystemClock.now();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let task_ref = TaskRef::generate();
            let id = CaptchaId::parse(&format!("{}", 70_000_000_000u64 + i as u64))?;
            let task = Task::new(task_ref.clone(), CaptchaKind::RecaptchaV2, now);
            self.store.tasks().create(&task, now.plus(Duration::from_secs(600)), None).await?;
            self.store.tasks().mark_submitted(&task_ref, &id, now, now.plus(Duration::from_secs(120))).await?;
            out.push((task_ref, id));
        }
        Ok(out)
    }

    /// The pingback request for a task, decoded from its API Gateway event as the runtime does.
    fn request(&self, task_ref: &TaskRef, id: &CaptchaId) -> lambda_http::Request {
        let path = format!("/callback/{}/{}", task_ref.as_ref(), self.signer.sign(task_ref));
        ApiGatewayEvent::new("GET", &path).query(&format!("id={}&code={}", id.as_ref(), self.token)).build()
    }

    /// The whole callback: signature, parsing, the store's one conditional write, logs, metrics.
    async fn handler(&self, req: lambda_http::Request, expect: &str) -> anyhow::Result<()> {
        let resp = relay_callback::respond(req, &self.deps).await;
        let body = match resp.body() {
            lambda_http::Body::Text(t) => t.clone(),
            lambda_http::Body::Binary(b) => String::from_utf8_lossy(b).into_owned(),
            _ => String::new(),
        };
        anyhow::ensure!(
            resp.status() == 200 && body.contains(expect),
            "callback answered {} {body}, expected 200 {expect}",
            resp.status()
        );
        Ok(())
    }

    /// The floor: one conditional UpdateItem writing the same attributes of the same size.
    /// `Ok(true)` written, `Ok(false)` refused by its condition.
    async fn bare(&self, task_ref: &TaskRef, id: &CaptchaId) -> anyhow::Result<bool> {
        let s = |v: &str| AttributeValue::S(v.to_owned());
        let n = |v: u64| AttributeValue::N(v.to_string());
        let now = SystemClock.now().as_millis();
        let res = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(task_ref.as_ref()))
            .update_expression("SET #state = :solved, solution = :solution, resolved_at = :at")
            .condition_expression("#state = :pending AND captcha_id = :id")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":solved", s("solved"))
            .expression_attribute_values(":pending", s("pending"))
            .expression_attribute_values(":solution", s(&self.token))
            .expression_attribute_values(":id", s(id.as_ref()))
            .expression_attribute_values(":at", n(now))
            .send()
            .await;
        match res {
            Ok(_) => Ok(true),
            Err(e) if e.as_service_error().is_some_and(|se| se.is_conditional_check_failed_exception()) => Ok(false),
            Err(e) => Err(anyhow::anyhow!("bare UpdateItem: {}", aws_sdk_dynamodb::error::DisplayErrorContext(e))),
        }
    }
}

/// One side and case for an instruction count (`relay-bench --callgrind-probe
/// handler|store|bare:write|dup:CALLS:SETUP`, run under `valgrind --tool=callgrind` by [`run`]):
/// SETUP tasks made pending on the embedded engine (and, for duplicates, their first delivery
/// written by the store), then the first CALLS of them called. Two runs that differ only in CALLS
/// give the instructions per call by difference, whatever the set-up costs.
pub async fn probe(spec: &str) -> anyhow::Result<()> {
    let parts: Vec<&str> = spec.split(':').collect();
    let [side, case, calls, setup] = parts[..] else {
        anyhow::bail!("--callgrind-probe takes SIDE:CASE:CALLS:SETUP, got `{spec}`");
    };
    let side = match side {
        "handler" => Side::Handler,
        "store" => Side::Store,
        "bare" => Side::Bare,
        other => anyhow::bail!("unknown side `{other}` (handler, store, bare)"),
    };
    let first = match case {
        "write" => true,
        "dup" => false,
        other => anyhow::bail!("unknown case `{other}` (write, dup)"),
    };
    let (calls, setup): (usize, usize) = (calls.parse()?, setup.parse()?);
    anyhow::ensure!(calls <= setup, "CALLS must not exceed SETUP");
    let embedded = LocalDynamo::start().await?;
    let rig = Rig::new(&embedded.endpoint).await?;
    // The same warm-up as the timed rounds: the connection pool and the engine's caches.
    let warm = rig.pending_tasks(20).await?;
    timed(&rig, Side::Handler, &warm[..10], true).await?;
    timed(&rig, Side::Bare, &warm[10..], true).await?;
    let tasks = rig.pending_tasks(setup).await?;
    if !first {
        timed(&rig, side, &tasks, true).await?;
    }
    if matches!(side, Side::Handler) {
        // `timed` builds each call's request (the runtime's event decoding, not the handler's
        // work): build the rest too, so runs that differ in CALLS build as many.
        for (r, id) in &tasks[calls..] {
            drop(rig.request(r, id));
        }
    }
    timed(&rig, side, &tasks[..calls], first).await?;
    Ok(())
}

/// Instructions per call counted by callgrind, whole process on one thread (SDK client, handler,
/// and the embedded engine serving it), per case [write, duplicate] and side [handler, store
/// alone, bare].
struct Instructions {
    counts: [[Count; 3]; 2],
    /// The binary counted: the release build itself, or its twin with symbols kept.
    binary: String,
}

/// One side's instructions per call, and where they went when the binary has symbols.
#[derive(Default, Clone, Copy)]
struct Count {
    total: f64,
    /// The engine serving the request (dynoxide's dispatch, SQLite under it).
    engine: Option<f64>,
    /// The SDK client's `send`: serialize, sign, HTTP, parse the answer.
    client: Option<f64>,
    /// The relay's own work around the write: the handler's (or the store's) minus `send`.
    own: Option<f64>,
}

/// Inclusive instructions of the functions whose names contain `name`, from callgrind_annotate.
fn inclusive(out: &std::path::Path, names: &[&str]) -> Option<Vec<f64>> {
    let text = std::process::Command::new("callgrind_annotate")
        .args(["--inclusive=yes", "--threshold=100", "--show-percs=no"])
        .arg(out)
        .output()
        .ok()?
        .stdout;
    let text = String::from_utf8_lossy(&text);
    names
        .iter()
        .map(|name| {
            text.lines()
                .find(|l| l.contains(name))
                .and_then(|l| l.split_whitespace().next().and_then(|n| n.replace(',', "").parse::<f64>().ok()))
        })
        .collect()
}

/// Runs [`probe`] under `valgrind --tool=callgrind` for each side and case, twice (CALLS and
/// SETUP calls) and takes the difference per call. `None` when valgrind is not installed or in
/// the smoke version. The release build's twin with symbols (`--profile profiling`, which
/// `infra/bench.sh` builds) is counted when it is there, for the breakdown.
async fn instruction_counts(quick: bool) -> anyhow::Result<Option<Instructions>> {
    let has_valgrind =
        std::process::Command::new("valgrind").arg("--version").output().is_ok_and(|o| o.status.success());
    if !has_valgrind || quick {
        return Ok(None);
    }
    let (calls, setup) = (25usize, 50usize);
    let symbols = Opts::root().join("target/profiling/relay-bench");
    let exe = if symbols.exists() { symbols } else { std::env::current_exe()? };
    let dir = Opts::root().join("target/bench-callgrind");
    std::fs::create_dir_all(&dir)?;
    let mut jobs = Vec::new();
    for case in ["write", "dup"] {
        for side in ["handler", "store", "bare"] {
            for n in [calls, setup] {
                jobs.push((case, side, n, dir.join(format!("{side}-{case}-{n}.out"))));
            }
        }
    }
    // Two at a time: the machine's cores. Each count is of its own process, so load does not
    // change it.
    let sem = Arc::new(tokio::sync::Semaphore::new(2));
    let mut set = tokio::task::JoinSet::new();
    for (case, side, n, out) in jobs {
        let (sem, exe) = (sem.clone(), exe.clone());
        set.spawn(async move {
            let _permit = sem.acquire_owned().await?;
            let status = tokio::process::Command::new("valgrind")
                .arg("--tool=callgrind")
                .arg(format!("--callgrind-out-file={}", out.display()))
                .arg(&exe)
                .arg(format!("--callgrind-probe={side}:{case}:{n}:{setup}"))
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .status()
                .await?;
            anyhow::ensure!(status.success(), "callgrind run {side}:{case}:{n} failed ({status})");
            let text = std::fs::read_to_string(&out)?;
            let total = text
                .lines()
                .find_map(|l| l.strip_prefix("totals:").or_else(|| l.strip_prefix("summary:")))
                .and_then(|v| v.split_whitespace().next()?.parse::<f64>().ok())
                .ok_or_else(|| anyhow::anyhow!("no total in {}", out.display()))?;
            let own_fn = match side {
                "handler" => "relay_callback::respond::{{closure}}",
                "store" => "relay_shared::store::TaskStore::record_result::{{closure}}",
                _ => "UpdateItemFluentBuilder::send::{{closure}}",
            };
            let parts = tokio::task::spawn_blocking(move || {
                inclusive(&out, &["dynoxide::server::dispatch ", "UpdateItemFluentBuilder::send::{{closure}}", own_fn])
            })
            .await?;
            Ok::<_, anyhow::Error>((case, side, n, total, parts))
        });
    }
    let mut runs = HashMap::new();
    while let Some(r) = set.join_next().await {
        let (case, side, n, total, parts) = r??;
        runs.insert((case, side, n), (total, parts));
    }
    let per_call = |case: &str, side: &str| {
        let ((a, pa), (b, pb)) = (&runs[&(case, side, calls)], &runs[&(case, side, setup)]);
        let d = |x: f64, y: f64| (y - x) / (setup - calls) as f64;
        let parts = pa.as_ref().zip(pb.as_ref()).map(|(pa, pb)| [0, 1, 2].map(|i| d(pa[i], pb[i])));
        Count {
            total: d(*a, *b),
            engine: parts.map(|p| p[0]),
            client: parts.map(|p| p[1]),
            own: parts.map(|p| p[2] - p[1]),
        }
    };
    let counts = ["write", "dup"].map(|case| ["handler", "store", "bare"].map(|side| per_call(case, side)));
    let binary = exe.strip_prefix(Opts::root()).unwrap_or(&exe).display().to_string();
    Ok(Some(Instructions { counts, binary }))
}

#[derive(Clone, Copy)]
enum Side {
    Handler,
    /// The store's result write alone (`TaskStore::record_result`): what the handler adds on
    /// top of it is its own work; what it adds over the bare write is the condition's.
    Store,
    Bare,
}

/// Latencies in µs of one call per task, in order, and the process's CPU µs per call (when the
/// kernel tells).
async fn timed(
    rig: &Rig,
    side: Side,
    tasks: &[(TaskRef, CaptchaId)],
    first: bool,
) -> anyhow::Result<(Vec<f64>, Option<f64>)> {
    // The runtime decodes the API Gateway event before the handler runs: not measured.
    let mut reqs: Vec<Option<lambda_http::Request>> =
        tasks.iter().map(|(r, id)| matches!(side, Side::Handler).then(|| rig.request(r, id))).collect();
    let mut lat = Vec::with_capacity(tasks.len());
    let cpu_before = crate::stats::process_cpu_ns();
    for ((r, id), req) in tasks.iter().zip(reqs.iter_mut()) {
        let t = Instant::now();
        match side {
            Side::Handler => {
                let req = req.take().ok_or_else(|| anyhow::anyhow!("no request"))?;
                rig.handler(req, if first { "recorded" } else { "duplicate" }).await?
            }
            Side::Store => {
                let d = relay_shared::domain::IncomingResult {
                    captcha_id: id.clone(),
                    outcome: relay_shared::domain::Outcome::Solved(relay_shared::domain::Solution::parse(&rig.token)?),
                    received_at: SystemClock.now(),
                    via: relay_shared::domain::Via::Callback,
                    token_clock_start: relay_shared::time::Timestamp::from_millis(0),
                };
                let out = rig.deps.results.record_result(r, &d).await?;
                anyhow::ensure!(
                    matches!(
                        (&out, first),
                        (relay_shared::store::RecordOutcome::Recorded(_), true)
                            | (relay_shared::store::RecordOutcome::Duplicate(_), false)
                    ),
                    "record_result: unexpected {out:?}"
                );
            }
            Side::Bare => anyhow::ensure!(rig.bare(r, id).await? == first, "bare write: unexpected condition result"),
        }
        lat.push(t.elapsed().as_secs_f64() * 1e6);
    }
    let cpu = match (cpu_before, crate::stats::process_cpu_ns()) {
        (Some(a), Some(b)) => Some((b - a) as f64 / 1e3 / tasks.len().max(1) as f64),
        _ => None,
    };
    Ok((lat, cpu))
}

fn p50_p99(h: &[f64], b: &[f64], st: &[f64]) -> [f64; 5] {
    [percentile(h, 50.0), percentile(b, 50.0), percentile(h, 99.0), percentile(b, 99.0), percentile(st, 50.0)]
}

async fn measure(engine: &'static str, endpoint: &str, sizes: &Sizes) -> anyhow::Result<EngineFigures> {
    let rig = Rig::new(endpoint).await?;
    // Warm the client's connection pool and the engine's caches on both paths.
    let warm = rig.pending_tasks(20).await?;
    timed(&rig, Side::Handler, &warm[..10], true).await?;
    timed(&rig, Side::Bare, &warm[10..], true).await?;

    let (mut write, mut dup) = (Vec::new(), Vec::new());
    let mut cpu_us: HashMap<(usize, bool), Vec<f64>> = HashMap::new();
    for round in 0..sizes.rounds {
        let h_tasks = rig.pending_tasks(sizes.calls).await?;
        let s_tasks = rig.pending_tasks(sizes.calls).await?;
        let b_tasks = rig.pending_tasks(sizes.calls).await?;
        // A then B, or B then A: alternate so a slow spell hits both.
        let order = if round % 2 == 0 {
            [Side::Handler, Side::Bare, Side::Store]
        } else {
            [Side::Store, Side::Bare, Side::Handler]
        };
        let mut lat: HashMap<(usize, bool), Vec<f64>> = HashMap::new();
        for first in [true, false] {
            for side in order {
                let tasks = match side {
                    Side::Handler => &h_tasks,
                    Side::Store => &s_tasks,
                    Side::Bare => &b_tasks,
                };
                let (l, cpu) = timed(&rig, side, tasks, first).await?;
                lat.insert((side as usize, first), l);
                if let Some(per_call) = cpu {
                    cpu_us.entry((side as usize, first)).or_default().push(per_call);
                }
            }
        }
        let get = |side: Side, first: bool| lat.get(&(side as usize, first)).cloned().unwrap_or_default();
        for (first, out) in [(true, &mut write), (false, &mut dup)] {
            out.push(p50_p99(&get(Side::Handler, first), &get(Side::Bare, first), &get(Side::Store, first)));
        }
    }

    // Duplicates once more, with the handler's recent-results cache on (as deployed): a repeat of
    // a result this process stored is answered without the store.
    let cached = {
        let mut with_cache = Rig::new(endpoint).await?;
        with_cache.deps.recent = relay_callback::RecentResults::default();
        let tasks = with_cache.pending_tasks(sizes.calls).await?;
        timed(&with_cache, Side::Handler, &tasks, true).await?;
        let (lat, _) = timed(&with_cache, Side::Handler, &tasks, false).await?;
        (percentile(&lat, 50.0), percentile(&lat, 99.0))
    };

    // Throughput: 16 callers at once, first deliveries.
    let rig = Arc::new(rig);
    let mut throughput = [0.0; 2];
    for (i, side) in [Side::Handler, Side::Bare].into_iter().enumerate() {
        let tasks = rig.pending_tasks(sizes.concurrent_calls).await?;
        let chunks: Vec<Vec<_>> = tasks.chunks(sizes.concurrent_calls.div_ceil(16)).map(<[_]>::to_vec).collect();
        let t = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for chunk in chunks {
            let rig = rig.clone();
            set.spawn(async move { timed(&rig, side, &chunk, true).await.map(|_| ()) });
        }
        while let Some(r) = set.join_next().await {
            r??;
        }
        throughput[i] = sizes.concurrent_calls as f64 / t.elapsed().as_secs_f64();
    }
    let cpu = |side: Side, first: bool| Spread::of(cpu_us.get(&(side as usize, first)).map_or(&[][..], |v| &v[..]));
    let cpu = [true, false].map(|first| [cpu(Side::Handler, first), cpu(Side::Store, first), cpu(Side::Bare, first)]);
    Ok(EngineFigures { engine, write, dup, cpu, cached, throughput: (throughput[0], throughput[1]) })
}

fn render(engines: &[EngineFigures], sizes: &Sizes, instructions: Option<&Instructions>) -> String {
    let mut s = format!(
        "## 1. Callback path: the handler against the one write it needs\n\n\
         The callback handler as the Lambda runs it (JSON log subscriber and EMF recorder installed; \
         request decoded beforehand) against one bare conditional UpdateItem writing the same \
         attributes ({TOKEN_LEN}-character token) to the same engine from the same SDK client, over \
         loopback HTTP; and the store's result write alone (`TaskStore::record_result`, the condition \
         that makes it exactly-once), which splits the difference into the handler's own work and the \
         larger write's. {} rounds of {} calls per side and case, order alternated per round; \
         figures are medians over rounds (min–max). Target: handler p50 ≤ {TARGET_RATIO}× the bare write.\n\n\
         | engine | case | handler p50 | store write alone p50 | bare p50 | ratio p50 | handler p99 | bare p99 | target |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        sizes.rounds, sizes.calls
    );
    for e in engines {
        for (case, rounds) in [("first delivery (write)", &e.write), ("duplicate (refused write)", &e.dup)] {
            let col = |i: usize| Spread::of(&rounds.iter().map(|r| r[i]).collect::<Vec<_>>());
            let ratio = Spread::of(&rounds.iter().map(|r| r[0] / r[1]).collect::<Vec<_>>());
            s.push_str(&format!(
                "| {} | {case} | {} | {} | {} | **{}** | {} | {} | {} |\n",
                e.engine,
                col(0).show(0, " µs"),
                col(4).show(0, " µs"),
                col(1).show(0, " µs"),
                ratio.show(2, "×"),
                col(2).show(0, " µs"),
                col(3).show(0, " µs"),
                if ratio.median <= TARGET_RATIO { "met" } else { "missed" },
            ));
        }
    }
    s.push_str(
        "\nThe rows above run with the handler's recent-results cache off, so every duplicate is the \
         refused write the target is about. As deployed it is on: a repeat of a result the same \
         process stored is answered without the store (`RecentResults` in functions/callback):\n\n\
         | engine | duplicate, cache on: p50 | p99 |\n| --- | --- | --- |\n",
    );
    for e in engines {
        s.push_str(&format!("| {} | {:.0} µs | {:.0} µs |\n", e.engine, e.cached.0, e.cached.1));
    }
    s.push_str(
        "\nCPU time per call of the whole process (SDK client, handler, and the engine serving it), \
         from the kernel's per-thread counters — less disturbed by other load than wall time:\n\n\
         | engine | case | handler | store write alone | bare UpdateItem | handler ÷ bare |\n| --- | --- | --- | --- | --- | --- |\n",
    );
    for e in engines {
        for (i, case) in ["first delivery", "duplicate"].iter().enumerate() {
            let [h, st, b] = e.cpu[i];
            s.push_str(&format!(
                "| {} | {case} | {} | {} | {} | {:.2}× |\n",
                e.engine,
                h.show(0, " µs"),
                st.show(0, " µs"),
                b.show(0, " µs"),
                h.median / b.median.max(1e-9)
            ));
        }
    }
    match instructions {
        Some(ins) => {
            s.push_str(&format!(
                "\nInstructions per call, counted by callgrind (`valgrind --tool=callgrind`, binary `{}`): the \
                 whole process on one thread — SDK client, handler, and the embedded engine serving it — the \
                 same from run to run whatever else the machine does. Per call = the difference between two \
                 runs that differ only in the number of calls (25 and 50; the set-up is the same), divided \
                 by 25. Where the binary has symbols, each is split into the engine serving the write \
                 (dynoxide and SQLite), the SDK client's `send` (serialize, sign, HTTP, parse the answer), \
                 and the relay's own work around it; the rest is the runtime and the engine's HTTP server.\n\n\
                 | case | side | instructions | engine | SDK client | relay's own | ÷ bare | target |\n\
                 | --- | --- | --- | --- | --- | --- | --- | --- |\n",
                ins.binary
            ));
            let k = |v: Option<f64>| v.map_or("—".to_owned(), |v| format!("{:.0} k", v / 1e3));
            for (i, case) in ["first delivery", "duplicate"].iter().enumerate() {
                let bare = ins.counts[i][2].total.max(1.0);
                for (j, side) in ["handler", "store write alone", "bare UpdateItem"].iter().enumerate() {
                    let c = ins.counts[i][j];
                    let ratio = c.total / bare;
                    let target = match j {
                        0 if ratio <= TARGET_RATIO => "met",
                        0 => "missed",
                        _ => "",
                    };
                    s.push_str(&format!(
                        "| {case} | {side} | {:.0} k | {} | {} | {} | {} | {target} |\n",
                        c.total / 1e3,
                        k(c.engine),
                        k(c.client),
                        // The store's own work is inlined into its caller: not split out.
                        if j == 0 { k(c.own) } else { "—".to_owned() },
                        if j == 2 { "1.00×".to_owned() } else { format!("**{ratio:.2}×**") },
                    ));
                }
            }
        }
        None => s.push_str(
            "\nInstruction counts: not taken in this run (the smoke version, or valgrind is not installed).\n",
        ),
    }
    s.push_str("\nThroughput, 16 concurrent callers, first deliveries:\n\n| engine | handler | bare UpdateItem | ratio |\n| --- | --- | --- | --- |\n");
    for e in engines {
        let (h, b) = e.throughput;
        s.push_str(&format!("| {} | {h:.0} /s | {b:.0} /s | {:.2}× |\n", e.engine, b / h));
    }
    s
}

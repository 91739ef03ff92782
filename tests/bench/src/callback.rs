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
    Ok(render(&engines, &sizes))
}

struct Rig {
    client: Client,
    table: String,
    deps: relay_callback::Deps,
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
            store,
            signer: signer.clone(),
            clock: Arc::new(SystemClock),
            dead_letters,
            recent: relay_callback::RecentResults::disabled(),
        };
        let token: String = std::iter::repeat("03AFcWeA6x").flat_map(str::chars).take(TOKEN_LEN).collect();
        Ok(Self { client, table, deps, signer, token })
    }

    /// `n` tasks accepted by in.php (state pending), as the API leaves them. Returns (ref, id).
    async fn pending_tasks(&self, n: usize) -> anyhow::Result<Vec<(TaskRef, CaptchaId)>> {
        let now = SystemClock.now();
        let mut out = Vec::with_capacity(n);
        for i in 0..n {
            let task_ref = TaskRef::generate();
            let id = CaptchaId::parse(&format!("{}", 70_000_000_000u64 + i as u64))?;
            let task = Task::new(task_ref.clone(), CaptchaKind::RecaptchaV2, now);
            self.deps.store.create(&task, now.plus(Duration::from_secs(600)), None).await?;
            self.deps.store.mark_submitted(&task_ref, &id, now, now.plus(Duration::from_secs(120))).await?;
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
                let d = relay_shared::domain::Delivery {
                    captcha_id: id.clone(),
                    outcome: relay_shared::domain::Outcome::Solved(relay_shared::domain::Solution::parse(&rig.token)?),
                    received_at: SystemClock.now(),
                    via: relay_shared::domain::Via::Callback,
                    token_clock_start: relay_shared::time::Timestamp::from_millis(0),
                };
                let out = rig.deps.store.record_result(r, &d).await?;
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

fn render(engines: &[EngineFigures], sizes: &Sizes) -> String {
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
    s.push_str("\nThroughput, 16 concurrent callers, first deliveries:\n\n| engine | handler | bare UpdateItem | ratio |\n| --- | --- | --- | --- |\n");
    for e in engines {
        let (h, b) = e.throughput;
        s.push_str(&format!("| {} | {h:.0} /s | {b:.0} /s | {:.2}× |\n", e.engine, b / h));
    }
    s
}

//! `load`: the whole relay path at a steady rate on the simulated clock, against the embedded
//! DynamoDB engine behind a model of its per-partition limits (tests/sim/LOAD.md).
//!
//!   cargo run --profile sim -p relay-sim --bin load                      # 150 tasks/s, one hour
//!   cargo run --profile sim -p relay-sim --bin load -- --rate 40 --seconds 120
//!
//! Prints the figures, writes them to target/load-report.md, and exits 1 if a guarantee broke
//! (a task not final, a result lost, a task paid twice, a push owed, a partition key over its
//! limit, a submit never accepted).

use std::time::Duration;

/// mimalloc, as the Lambdas and local mode: glibc's malloc took a third of a run's CPU (perf).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::Parser;
use relay_sim::load::{LoadConfig, run};

#[derive(Parser)]
#[command(about = "The relay's whole path under load, with DynamoDB's per-partition limits modelled")]
struct Args {
    /// Tasks submitted per simulated second (default: 150, 10 x the old 15/s submit clamp).
    #[arg(long)]
    rate: Option<u32>,
    /// Simulated seconds of submits.
    #[arg(long, default_value_t = 3600)]
    seconds: u64,
    /// Simulated seconds after the last submit for everything to finish.
    #[arg(long, default_value_t = 240)]
    drain: u64,
    /// Share of pingbacks CaptchaAI drops (the poller fetches those).
    #[arg(long, default_value_t = 0.1)]
    drop: f64,
    /// No throttling burst (every key keeps DynamoDB's limits throughout).
    #[arg(long)]
    no_burst: bool,
    /// A progress line every this many simulated seconds.
    #[arg(long, default_value_t = 60)]
    progress: u64,
    #[arg(long, default_value_t = 7)]
    seed: u64,
    /// The least the simulated clock moves at a time, ms (0: exactly to each wake-up).
    #[arg(long, default_value_t = 50)]
    step_ms: u64,
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<std::process::ExitCode> {
    let args = Args::parse();
    let rate = args.rate.unwrap_or(relay_sim::load::FULL_RATE);
    let mut cfg = LoadConfig::scaled(rate, Duration::from_secs(args.seconds));
    cfg.drain = Duration::from_secs(args.drain);
    cfg.drop_callbacks = args.drop;
    cfg.seed = args.seed;
    cfg.step = Duration::from_millis(args.step_ms);
    cfg.progress_every = Some(Duration::from_secs(args.progress.max(1)));
    if args.no_burst {
        cfg.throttle = None;
    }
    // The relay's own logs, for tracing one task through a run: `SIM_LOG=<file>` (filter with
    // RUST_LOG, default info). Off by default: they cost time.
    if let Some(path) = std::env::var_os("SIM_LOG") {
        let file = std::fs::File::create(path)?;
        let filter = tracing_subscriber::EnvFilter::try_from_default_env()
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
        let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::sync::Mutex::new(file)).try_init();
    }
    eprintln!("load run: {rate} tasks/s for {} simulated s (+{} s drain)…", args.seconds, args.drain);
    let report = run(&cfg).await?;
    let violations = report.violations();
    let mut out =
        format!("load run: {rate} tasks/s for {} simulated s, seed {}\n\n{}", args.seconds, args.seed, report.table());
    out.push_str(&if violations.is_empty() {
        "\nevery guarantee held\n".to_owned()
    } else {
        format!("\nBROKEN:\n  {}\n", violations.join("\n  "))
    });
    print!("{out}");
    let _ = std::fs::create_dir_all("target");
    let _ = std::fs::write("target/load-report.md", &out);
    Ok(if violations.is_empty() { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::from(1) })
}

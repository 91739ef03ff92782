//! `relay-bench`: the performance bench. Runs its parts in order, prints one report and writes
//! it to a file (saved after each part, so a failing part leaves the others' figures).
//!
//! ```text
//! infra/bench.sh            # release builds, every part, target/bench-report.md
//! infra/bench.sh --quick    # the smoke version the test command runs (checks the bench works)
//! ```

mod callback;
mod coldstart;
mod cost;
mod poller;
mod push;
mod report;
mod stats;
mod telemetry;
mod wrk;

use std::path::PathBuf;

use clap::Parser;

/// Which parts exist, in the order they run.
pub const PARTS: [&str; 6] = ["callback", "wrk", "coldstart", "poller", "cost", "push"];

#[derive(Debug, Clone, Parser)]
#[command(about = "The relay's performance bench: one report, written to a file")]
pub struct Opts {
    /// The smoke version: every part runs, on small numbers (checks the bench, not timings).
    #[arg(long)]
    pub quick: bool,
    /// Comma-separated parts to run (default: all): callback, wrk, coldstart, poller, cost, push.
    #[arg(long, value_delimiter = ',')]
    pub parts: Vec<String>,
    /// Where the report goes.
    #[arg(long, default_value = "target/bench-report.md")]
    pub out: PathBuf,
    /// A moto server (DynamoDB, SQS, SSM) on loopback: the second engine of part 1 and the AWS
    /// peers of the cold-start part. `infra/bench.sh` starts one.
    #[arg(long, env = "RELAY_BENCH_MOTO")]
    pub moto: Option<String>,
    /// Where the built binaries are (`target/release` for figures, `target/debug` for a smoke).
    #[arg(long, default_value = "target/release")]
    pub bin_dir: PathBuf,
    /// The Python virtualenv with the comparison apps' packages (tests/bench/py/requirements.txt).
    #[arg(long, default_value = ".venv-bench")]
    pub venv: PathBuf,
    /// Internal: run one side and case of part 1 for an instruction count under callgrind
    /// (`handler|store|bare:write|dup:CALLS:SETUP`) and exit; part 1 starts these itself.
    #[arg(long, hide = true)]
    pub callgrind_probe: Option<String>,
}

impl Opts {
    fn wants(&self, part: &str) -> bool {
        self.parts.is_empty() || self.parts.iter().any(|p| p == part)
    }

    /// The repository root (the bench runs from it; paths in the options are relative to it).
    pub fn root() -> PathBuf {
        PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../.."))
    }
}

fn main() -> anyhow::Result<()> {
    let opts = Opts::parse();
    if let Some(bad) = opts.parts.iter().find(|p| !PARTS.contains(&p.as_str())) {
        anyhow::bail!("unknown part `{bad}`; the parts are {}", PARTS.join(", "));
    }
    std::env::set_current_dir(Opts::root())?;
    telemetry::install();
    if let Some(spec) = &opts.callgrind_probe {
        // One thread: the count is then the same from run to run.
        return tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(callback::probe(spec));
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut report = report::Report::new(&opts)?;
    let mut failed = Vec::new();
    for part in PARTS.iter().copied().filter(|p| opts.wants(p)) {
        eprintln!("==> bench part: {part}");
        let started = std::time::Instant::now();
        let section = rt.block_on(async {
            match part {
                "callback" => callback::run(&opts).await,
                "wrk" => wrk::run(&opts).await,
                "coldstart" => coldstart::run(&opts).await,
                "poller" => poller::run(&opts).await,
                "cost" => cost::run(&opts).await,
                "push" => push::run(&opts).await,
                _ => unreachable!("parts are checked above"),
            }
        });
        match section {
            Ok(text) => report.add(part, &text, started.elapsed())?,
            Err(e) => {
                eprintln!("bench part {part} failed: {e:#}");
                report.add(part, &format!("**FAILED**: {e:#}\n"), started.elapsed())?;
                failed.push(part);
            }
        }
    }
    println!("{}", report.text());
    eprintln!("report written to {}", opts.out.display());
    if !failed.is_empty() {
        anyhow::bail!("bench parts failed: {}", failed.join(", "));
    }
    Ok(())
}

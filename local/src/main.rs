//! `relay-local`: the whole relay on one machine.
//!
//!   relay-local serve [--config relay.json]     # API + callback on RELAY_BIND, poller, redrive, pushes
//!   relay-local demo [--tasks 200]              # the three patterns and pushes at work; exit 1 if anything was lost
//!   relay-local dead-letters list [--reveal]    # the poison queue of RELAY_DATA_DIR
//!   relay-local dead-letters replay (--id <id>… | --task <ref>… | --all [--max N])
//!   relay-local deliveries list [--since 7d] [--until <time>] [--max 100] [--json]
//!   relay-local deliveries replay (--task <ref>… | --since <time> [--until <time>]) [--max N]
//!
//! The operator commands work on a running relay's data directory (through the store it
//! serves) and on a stopped one's (opening its files; see [`relay_local::ops`]).

use std::io::IsTerminal;
use std::path::PathBuf;

use clap::{Parser, Subcommand};
use relay_local::run::{LocalConfig, LogFormat, Options, start};

/// mimalloc, not glibc's malloc: under load glibc's allocator took a quarter of local mode's CPU
/// (perf, the bench's wrk part), the engine, SDK and HTTP stack allocating per request on every
/// thread.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(
    name = "relay-local",
    about = "The captcha relay on one machine (no AWS, no Docker)",
    after_help = "Logs go to stderr: plain text, coloured only on a terminal; RELAY_LOG_FORMAT=json \
                  (or \"log_format\": \"json\" in the config file) writes JSON lines as the Lambdas do. \
                  RUST_LOG picks the level (default: warnings; info with JSON). The operator commands \
                  (dead-letters, deliveries) work on a running or a stopped relay's data directory \
                  (RELAY_DATA_DIR). See docs/operations.md, \"Local mode\"."
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve the relay until Ctrl-C / SIGTERM.
    Serve {
        /// A JSON config file; environment variables override it.
        #[arg(long)]
        config: Option<PathBuf>,
    },
    /// The poison queue of a local relay (running or stopped): dead letters the relay could not
    /// apply after 5 tries. List them, move them back to be applied again.
    DeadLetters {
        #[arg(long, env = "RELAY_DATA_DIR", default_value = "relay-data")]
        data_dir: PathBuf,
        #[command(subcommand)]
        cmd: DeadLettersCmd,
    },
    /// Pushes to owners' callbacks of a local relay (running or stopped): list the parked ones,
    /// replay them.
    Deliveries {
        #[arg(long, env = "RELAY_DATA_DIR", default_value = "relay-data")]
        data_dir: PathBuf,
        #[command(subcommand)]
        cmd: DeliveriesCmd,
    },
    /// Erase one owner's tasks now (an erasure request), from a local relay running or stopped:
    /// every task submitted with relay key NAME (`--key`), or by OWNER (`--owner`, as `GET
    /// /tasks` callers are named: `api-key` for local mode's bearer key); then the task file is
    /// compacted so what they held leaves the disk. Prints how many went.
    Erase {
        #[arg(long, env = "RELAY_DATA_DIR", default_value = "relay-data")]
        data_dir: PathBuf,
        /// A relay key's name: its tasks (`key:<name>`).
        #[arg(long, conflicts_with = "owner")]
        key: Option<String>,
        #[arg(long)]
        owner: Option<String>,
    },
    /// Run the demo scenario against the built-in fake CaptchaAI, pushing to an owner receiver
    /// it starts.
    Demo {
        #[arg(long, default_value_t = 200)]
        tasks: usize,
        /// Data directory (default: a fresh temporary one).
        #[arg(long)]
        data_dir: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum DeadLettersCmd {
    /// List the poisoned letters, oldest first: id, receives, task, CaptchaAI id, code
    /// (solutions redacted unless --reveal), why it failed, when it was poisoned.
    List {
        #[arg(long, default_value_t = 50)]
        max: usize,
        #[arg(long)]
        reveal: bool,
    },
    /// Move poisoned letters back to the queue (the relay applies them again, at once if it
    /// runs, else when it starts): the ids `list` printed, a task's letters, or --all.
    #[command(visible_alias = "redrive")]
    Replay {
        /// A letter's id as `list` printed it; repeat for several.
        #[arg(long = "id", value_name = "ID")]
        ids: Vec<i64>,
        /// Every letter of this task; repeat for several.
        #[arg(long = "task", value_name = "REF", conflicts_with = "ids")]
        tasks: Vec<String>,
        /// Every letter poisoned now (oldest first, at most --max).
        #[arg(long, conflicts_with_all = ["ids", "tasks"])]
        all: bool,
        #[arg(long, default_value_t = usize::MAX, requires = "all")]
        max: usize,
    },
}

#[derive(Subcommand)]
enum DeliveriesCmd {
    /// Parked pushes (every attempt failed, or the URL was refused when sending), oldest first.
    List {
        /// Parked since: RFC 3339 or a span ago (`24h`, `7d`).
        #[arg(long, default_value = "7d")]
        since: String,
        /// Parked until (default: now).
        #[arg(long)]
        until: Option<String>,
        #[arg(long, default_value_t = 100)]
        max: usize,
        /// A JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Make pushes due again now, with a fresh set of attempts (same webhook-id for the same
    /// result): the named tasks, or every push parked in a time range.
    Replay {
        /// A task reference (or compat id); repeat for several.
        #[arg(long = "task", value_name = "REF")]
        tasks: Vec<String>,
        /// Every push parked since (RFC 3339 or `24h`).
        #[arg(long, conflicts_with = "tasks")]
        since: Option<String>,
        #[arg(long, requires = "since")]
        until: Option<String>,
        #[arg(long, default_value_t = 10_000)]
        max: usize,
    },
}

async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(t) => t,
            Err(_) => return std::future::pending().await,
        };
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = ctrl_c.await;
}

/// Installs the log subscriber on stderr in `format`, `default` when `RUST_LOG` is not set.
fn init_logs(format: LogFormat, default: &str) {
    match format {
        LogFormat::Json => relay_shared::telemetry::init_json(std::io::stderr, default),
        LogFormat::Text => {
            let _ = tracing_subscriber::fmt()
                .with_env_filter(
                    tracing_subscriber::EnvFilter::try_from_default_env()
                        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default)),
                )
                // Colour codes only for a person at a terminal, never into a file or a pipe.
                .with_ansi(std::io::stderr().is_terminal())
                .with_writer(std::io::stderr)
                .try_init();
        }
    }
}

/// What `main` runs: `serve` with its settings read (or why they could not be), or a command.
enum Job {
    Serve(anyhow::Result<LocalConfig>),
    Command(Cmd),
}

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let env = |k: &str| std::env::var(k).ok();
    // `serve` reads its settings first: the config file may choose the log format.
    let job = match cli.cmd {
        Cmd::Serve { config } => Job::Serve(LocalConfig::load(config.as_deref(), &env)),
        cmd => Job::Command(cmd),
    };
    let format = match &job {
        Job::Serve(Ok(cfg)) => Ok(cfg.log_format),
        _ => LogFormat::from_env(env("RELAY_LOG_FORMAT").as_deref()),
    };
    let format = match format {
        Ok(f) => f,
        Err(e) => {
            eprintln!("relay-local: {e:#}");
            return std::process::ExitCode::from(2);
        }
    };
    // The embedded engine reports every refused conditional write; that is normal here. JSON
    // lines are for machines: the Lambdas' level (info), as CloudWatch would get it.
    let default = match (&job, format) {
        (Job::Command(Cmd::Demo { .. }), _) => "error",
        (_, LogFormat::Json) => "info,dynoxide=error",
        (_, LogFormat::Text) => "warn,dynoxide=error",
    };
    init_logs(format, default);
    let result = match job {
        Job::Serve(cfg) => match cfg {
            Ok(cfg) => serve(cfg).await,
            Err(e) => Err(e),
        },
        Job::Command(cmd) => run(cmd).await,
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            match format {
                LogFormat::Text => eprintln!("relay-local: {e:#}"),
                LogFormat::Json => {
                    tracing::error!(event = "relay_local_failed", error = format!("{e:#}"), "relay-local stopped")
                }
            }
            std::process::ExitCode::from(2)
        }
    }
}

async fn serve(cfg: LocalConfig) -> anyhow::Result<std::process::ExitCode> {
    let relay = start(&cfg, Options::default()).await?;
    let (_, from_file) = cfg.secrets()?;
    if cfg.log_format == LogFormat::Json {
        // One line a machine reads, never a secret (the API key is in the secrets file).
        tracing::info!(
            event = "relay_listening",
            base_url = %relay.base_url,
            tls_url = relay.tls_url.as_deref().unwrap_or_default(),
            ca = %relay.ca_path.as_deref().map(|p| p.display().to_string()).unwrap_or_default(),
            data_dir = %cfg.data_dir.display(),
            secrets = %if from_file { cfg.secrets_path().display().to_string() } else { String::new() },
            webhook_secrets = %cfg.webhook_secrets_path().display(),
            webhook_allow_loopback = cfg.webhook_allow_loopback,
            captchaai = if relay.fake.is_some() { "built-in fake" } else { "CaptchaAI" },
            "relay listening"
        );
    } else {
        print_banner(&cfg, &relay, from_file);
    }
    shutdown_signal().await;
    match cfg.log_format {
        LogFormat::Text => eprintln!("shutting down: finishing in-flight work"),
        LogFormat::Json => tracing::info!(event = "relay_stopping", "shutting down: finishing in-flight work"),
    }
    relay.shutdown().await;
    Ok(std::process::ExitCode::SUCCESS)
}

fn print_banner(cfg: &LocalConfig, relay: &relay_local::run::Running, from_file: bool) {
    println!("relay listening on {} (data in {})", relay.base_url, cfg.data_dir.display());
    if relay.fake.is_some() {
        // Against the built-in fake nothing is paid: show the key so it can be tried at once.
        println!("  API key: {}", relay.api_key);
    }
    if from_file {
        println!("  secrets not given are kept in {} (owner-only)", cfg.secrets_path().display());
    }
    println!("  POST {}/tasks   (Authorization: Bearer <API key>)", relay.base_url);
    println!("  GET  {}/tasks/{{ref}}", relay.base_url);
    println!("  GET  {}/health", relay.base_url);
    println!("  2captcha-compatible: {0}/in.php and {0}/res.php, `key` = the API key (docs/compat.md)", relay.base_url);
    if let (Some(url), Some(ca)) = (&relay.tls_url, &relay.ca_path) {
        let (ca, server) = (ca.display(), url.trim_start_matches("https://"));
        println!("  HTTPS: the same routes on {url}, certificate signed by the local CA {ca}");
        println!("    (made on first start, kept across restarts; give clients that file)");
        println!("    Python requests:  REQUESTS_CA_BUNDLE={ca}");
        println!("    Node:             NODE_EXTRA_CA_CERTS={ca}");
        println!("    curl:             curl --cacert {ca} {url}/health");
        println!(
            "    2captcha SDKs:    server=\"{server}\", key = the API key (with the CA above; they build https://<server>/in.php)"
        );
    }
    println!(
        "  pushes to owners' callback URLs are signed with the secret in {} (or WEBHOOK_SECRETS); `relay-local deliveries list` shows parked ones{}",
        cfg.webhook_secrets_path().display(),
        if cfg.webhook_allow_loopback { "; loopback callback URLs allowed" } else { "" }
    );
    if relay.fake.is_some() {
        println!("  CaptchaAI: the built-in fake (set CAPTCHAAI_API_KEY and RELAY_PUBLIC_URL for the real one)");
    }
}

async fn run(cmd: Cmd) -> anyhow::Result<std::process::ExitCode> {
    match cmd {
        Cmd::Serve { .. } => anyhow::bail!("`serve` runs through `serve()`"),
        Cmd::Erase { data_dir, key, owner } => {
            let owner = relay_shared::store::retention::erasure_owner(key.as_deref(), owner.as_deref())
                .map_err(anyhow::Error::msg)?;
            let opened = relay_local::ops::open_store(&data_dir).await?;
            let removed = opened.store.retention().erase_owner(&owner).await?;
            relay_local::retention::compact(&data_dir.join("tasks.sqlite")).await?;
            println!("erased {} task(s) of `{owner}` ({} items read)", removed.deleted, removed.scanned);
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::DeadLetters { data_dir, cmd } => {
            let queue = relay_local::ops::open_queue(&data_dir)?;
            match cmd {
                DeadLettersCmd::List { max, reveal } => {
                    let letters = queue.poisoned_letters()?;
                    for p in letters.iter().take(max) {
                        println!("{}  {}", p.id, relay_local::ops::describe_letter(p, reveal));
                    }
                    eprintln!(
                        "{} poisoned letter(s) listed{}; {} waiting in the queue",
                        letters.len().min(max),
                        if letters.len() > max { format!(" of {}", letters.len()) } else { String::new() },
                        queue.depth()?
                    );
                }
                DeadLettersCmd::Replay { ids, tasks, all, max } => {
                    use relay_local::ops::Pick;
                    let pick = if all {
                        Pick::All { max }
                    } else if !ids.is_empty() {
                        Pick::Ids(ids)
                    } else if !tasks.is_empty() {
                        Pick::Tasks(tasks)
                    } else {
                        anyhow::bail!("name letters with --id <id> (as `list` prints them), --task <ref>, or --all")
                    };
                    let done = relay_local::ops::replay_dead_letters(&queue, &pick)?;
                    for what in &done.not_found {
                        eprintln!("not in the poison queue: {what}");
                    }
                    let ids: Vec<String> = done.moved.iter().map(i64::to_string).collect();
                    println!("moved {} letter(s) back to the queue: {}", done.moved.len(), ids.join(" "));
                    eprintln!("a running relay applies them within a second; a stopped one when it starts");
                    if done.moved.is_empty() && !done.not_found.is_empty() {
                        return Ok(std::process::ExitCode::from(1));
                    }
                }
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Deliveries { data_dir, cmd } => {
            use relay_shared::delivery::operator as d;
            let opened = relay_local::ops::open_store(&data_dir).await?;
            let store = &opened.store;
            let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
            let time = |t: &str| d::parse_time(t, now).map_err(anyhow::Error::msg);
            match cmd {
                DeliveriesCmd::List { since, until, max, json } => {
                    let to = until.as_deref().map(time).transpose()?.unwrap_or(now);
                    let rows = d::list(store, time(&since)?, to, max).await?;
                    if json {
                        println!("{}", serde_json::to_string_pretty(&rows)?);
                    } else {
                        print!("{}", d::render_table(&rows));
                        eprintln!("{} parked push(es)", rows.len());
                    }
                }
                DeliveriesCmd::Replay { tasks, since, until, max } => {
                    let done = match since {
                        Some(since) => {
                            let to = until.as_deref().map(time).transpose()?.unwrap_or(now);
                            d::replay_parked(store, time(&since)?, to, max, now).await?
                        }
                        None if tasks.is_empty() => {
                            anyhow::bail!("name tasks with --task <ref>, or a range with --since")
                        }
                        None => d::replay_tasks(store, &tasks, now).await?,
                    };
                    for (r, why) in &done.skipped {
                        eprintln!("skipped {r}: {why}");
                    }
                    println!("{} push(es) due again now", done.replayed.len());
                    eprintln!(
                        "{}",
                        if opened.relay_running {
                            "the running relay sends them within 5 s"
                        } else {
                            "the relay is stopped: they are sent when it starts"
                        }
                    );
                }
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Demo { tasks, data_dir } => {
            let dir =
                data_dir.unwrap_or_else(|| std::env::temp_dir().join(format!("relay-demo-{}", std::process::id())));
            let report = relay_local::demo::run_demo(tasks, dir, true).await?;
            println!("{}", report.table());
            Ok(if report.passed() { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::from(1) })
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Cmd, DeadLettersCmd};

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn a_dead_letter_replay_picks_one_way_and_redrive_still_works() -> anyhow::Result<()> {
        let parse = |args: &[&str]| Cli::try_parse_from([&["relay-local", "dead-letters"], args].concat());
        let cli = parse(&["replay", "--id", "3", "--id", "7"])?;
        assert!(
            matches!(cli.cmd, Cmd::DeadLetters { cmd: DeadLettersCmd::Replay { ids, all: false, .. }, .. } if ids == [3, 7])
        );
        let cli = parse(&["redrive", "--all", "--max", "5"])?;
        assert!(matches!(cli.cmd, Cmd::DeadLetters { cmd: DeadLettersCmd::Replay { all: true, max: 5, .. }, .. }));
        assert!(parse(&["replay", "--id", "3", "--all"]).is_err(), "ids or all, not both");
        assert!(parse(&["replay", "--id", "3", "--task", "tsk_x"]).is_err());
        assert!(parse(&["replay", "--max", "5"]).is_err(), "--max only with --all");
        Ok(())
    }
}

//! `relay-local`: the whole relay on one machine.
//!
//!   relay-local serve [--config relay.json]     # API + callback on RELAY_BIND, poller, redrive
//!   relay-local demo [--tasks 200]              # the three patterns at work; exit 1 if anything was lost
//!   relay-local dead-letters list [--reveal]    # poisoned dead letters of RELAY_DATA_DIR
//!   relay-local dead-letters redrive            # move them back to be applied again
//!   relay-local deliveries list [--since 7d]     # parked pushes to owners' callbacks (relay running)
//!   relay-local deliveries replay (--task <ref>… | --since <time>)

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use relay_local::run::{LocalConfig, Options, start};

/// mimalloc, not glibc's malloc: under load glibc's allocator took a quarter of local mode's CPU
/// (perf, the bench's wrk part), the engine, SDK and HTTP stack allocating per request on every
/// thread.
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser)]
#[command(name = "relay-local", about = "The captcha relay on one machine (no AWS, no Docker)")]
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
    /// Poisoned dead letters of a local relay's data directory (the operator command).
    DeadLetters {
        #[arg(long, env = "RELAY_DATA_DIR", default_value = "relay-data")]
        data_dir: PathBuf,
        #[command(subcommand)]
        cmd: DeadLettersCmd,
    },
    /// Pushes to owners' callbacks of the relay running on the data directory: list the parked
    /// ones, replay them.
    Deliveries {
        #[arg(long, env = "RELAY_DATA_DIR", default_value = "relay-data")]
        data_dir: PathBuf,
        #[command(subcommand)]
        cmd: DeliveriesCmd,
    },
    /// Run the demo scenario against the built-in fake CaptchaAI.
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
    /// List the poisoned letters (solutions redacted unless --reveal).
    List {
        #[arg(long)]
        reveal: bool,
    },
    /// Move every poisoned letter back to the queue; a running relay applies them again.
    Redrive,
}

#[derive(Subcommand)]
enum DeliveriesCmd {
    /// Parked pushes (every attempt failed, or the URL was refused when sending), oldest first.
    List {
        /// Parked since: RFC 3339 or a span ago (`24h`, `7d`).
        #[arg(long, default_value = "7d")]
        since: String,
        #[arg(long, default_value_t = 100)]
        max: usize,
    },
    /// Make pushes due again now (same webhook-id for the same result): the named tasks, or
    /// every push parked since a time.
    Replay {
        #[arg(long = "task", value_name = "REF")]
        tasks: Vec<String>,
        #[arg(long, conflicts_with = "tasks")]
        since: Option<String>,
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

#[tokio::main]
async fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    // The embedded engine reports every refused conditional write; that is normal here.
    let quiet = if matches!(cli.cmd, Cmd::Demo { .. }) { "error" } else { "warn,dynoxide=error" };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(quiet)),
        )
        .with_writer(std::io::stderr)
        .try_init();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("relay-local: {e:#}");
            std::process::ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<std::process::ExitCode> {
    match cli.cmd {
        Cmd::Serve { config } => {
            let cfg = LocalConfig::load(config.as_deref(), &|k| std::env::var(k).ok())?;
            let relay = start(&cfg, Options::default()).await?;
            let (_, from_file) = cfg.secrets()?;
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
            println!(
                "  2captcha-compatible: {0}/in.php and {0}/res.php, `key` = the API key (docs/compat.md)",
                relay.base_url
            );
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
                println!(
                    "  CaptchaAI: the built-in fake (set CAPTCHAAI_API_KEY and RELAY_PUBLIC_URL for the real one)"
                );
            }
            shutdown_signal().await;
            eprintln!("shutting down: finishing in-flight work");
            relay.shutdown().await;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::DeadLetters { data_dir, cmd } => {
            let path = data_dir.join("dead-letters.sqlite");
            anyhow::ensure!(path.exists(), "no dead-letter queue at {} (is RELAY_DATA_DIR right?)", path.display());
            let clock: std::sync::Arc<dyn relay_shared::time::Clock> =
                std::sync::Arc::new(relay_shared::time::SystemClock);
            let queue = relay_local::queue::DiskQueue::open(&path, clock, std::time::Duration::from_secs(30), 5)?;
            match cmd {
                DeadLettersCmd::List { reveal } => {
                    let listed = relay_local::run::list_poisoned(&queue, reveal)?;
                    for (id, line) in &listed {
                        println!("{id}  {line}");
                    }
                    eprintln!("{} poisoned letter(s); {} waiting in the queue", listed.len(), queue.depth()?);
                }
                DeadLettersCmd::Redrive => {
                    let mut moved = 0;
                    for (id, _) in queue.poisoned()? {
                        moved += usize::from(queue.unpoison(id)?);
                    }
                    eprintln!("moved {moved} letter(s) back to the queue");
                }
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Deliveries { data_dir, cmd } => {
            use relay_shared::delivery::operator as d;
            let store = relay_local::run::running_store(&data_dir).await?;
            let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
            let time = |t: &str| d::parse_time(t, now).map_err(anyhow::Error::msg);
            match cmd {
                DeliveriesCmd::List { since, max } => {
                    let rows = d::list(&store, time(&since)?, now, max).await?;
                    print!("{}", d::render_table(&rows));
                    eprintln!("{} parked push(es)", rows.len());
                }
                DeliveriesCmd::Replay { tasks, since } => {
                    let done = match since {
                        Some(since) => d::replay_parked(&store, time(&since)?, now, usize::MAX, now).await?,
                        None if tasks.is_empty() => {
                            anyhow::bail!("name tasks with --task <ref>, or a range with --since")
                        }
                        None => d::replay_tasks(&store, &tasks, now).await?,
                    };
                    for (r, why) in &done.skipped {
                        eprintln!("skipped {r}: {why}");
                    }
                    println!("{} push(es) due again now", done.replayed.len());
                }
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Demo { tasks, data_dir } => {
            let dir =
                data_dir.unwrap_or_else(|| std::env::temp_dir().join(format!("relay-demo-{}", std::process::id())));
            let report = relay_local::demo::run_demo(tasks, dir, true).await?;
            println!("{}", report.table());
            Ok(if report.lost == 0 { std::process::ExitCode::SUCCESS } else { std::process::ExitCode::from(1) })
        }
    }
}

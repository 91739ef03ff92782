//! `relay-ops`: look at poisoned dead letters and move them back for another try.
//!
//!   relay-ops list [--max 50] [--reveal]
//!   relay-ops show <message-id> [--reveal]
//!   relay-ops redrive [--max N]          poison queue → dead-letter queue
//!   relay-ops redrive-task <task-ref>    only that task's letters
//!   relay-ops breaker show|close         the account-wide CaptchaAI breaker (TABLE_NAME)
//!   relay-ops queue                      the submit queue: depth per lane, oldest wait, the
//!                                        submitter's lease and window (TABLE_NAME)
//!   relay-ops keys create <name> [--pingback get|post]  a relay key for /in.php and /res.php, printed once (TABLE_NAME)
//!   relay-ops keys list [--json]         names, digest prefixes, created, revoked (never a key)
//!   relay-ops keys revoke <name> [--digest <prefix>]
//!   relay-ops keys set <name> --pingback get|post   how its tasks' results reach their pingback
//!   relay-ops deliveries list [--since 24h] [--until <time>] [--max 100] [--json]
//!                                        parked pushes to owners' callbacks (TABLE_NAME)
//!   relay-ops deliveries replay (--task <ref>... | --since <time> [--until <time>]) [--max N]
//!   relay-ops webhooks rotate --owner <name>   a new signing secret, printed once; the old one
//!                                              still signs until `webhooks retire`
//!   relay-ops webhooks retire --owner <name>   stop signing with the previous secret
//!   relay-ops erase (--key <name> | --owner <owner>)   delete one owner's tasks now (TABLE_NAME)
//!
//! The table comes from `--table-name` / `TABLE_NAME` (the stack's `TasksTableName` output).
//! Queues come from `--poison-queue-url` / `POISON_QUEUE_URL` and `--dead-letter-queue-url` /
//! `DEAD_LETTER_QUEUE_URL`; AWS credentials and region as usual (`AWS_ENDPOINT_URL_SQS` for a
//! local SQS).

use std::time::Duration;

use clap::{Parser, Subcommand};
use relay_shared::deadletter::SqsQueue;

#[derive(Parser)]
#[command(
    name = "relay-ops",
    about = "Inspect and re-drive poisoned dead letters; look at and close the CaptchaAI breaker; manage relay keys"
)]
struct Cli {
    #[arg(long, env = "POISON_QUEUE_URL")]
    poison_queue_url: Option<String>,
    #[arg(long, env = "DEAD_LETTER_QUEUE_URL")]
    dead_letter_queue_url: Option<String>,
    /// The task table (for `breaker` and `keys`): the stack's `TasksTableName` output.
    #[arg(long, env = "TABLE_NAME")]
    table_name: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum BreakerCmd {
    /// Whether CaptchaAI traffic is stopped, why, and until when.
    Show,
    /// Lets traffic resume now (after fixing the key, or when a ban is known to be over).
    Close,
}

fn parse_pingback(s: &str) -> Result<relay_shared::domain::PingbackForm, String> {
    relay_shared::domain::PingbackForm::parse(s).map_err(|e| e.0)
}

#[derive(Subcommand)]
enum KeysCmd {
    /// Make a relay key named <name>; prints the key alone on stdout, once (only its digest is
    /// stored). `KEY=$(relay-ops keys create scraper)`.
    Create {
        name: String,
        /// How its tasks' results reach their `pingback`: `get` (CaptchaAI's GET ?id=&code=) or
        /// `post` (2captcha's form, for code written against 2captcha).
        #[arg(long, default_value = "get", value_parser = parse_pingback)]
        pingback: relay_shared::domain::PingbackForm,
    },
    /// Change how the live keys named <name> push results to a `pingback` (tasks submitted from
    /// then on).
    Set {
        name: String,
        #[arg(long, value_parser = parse_pingback)]
        pingback: relay_shared::domain::PingbackForm,
    },
    /// Every key, live and revoked: name, first 12 hex digits of its digest, created, revoked.
    List {
        /// A JSON array instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Revoke the live keys named <name>, or only the one whose digest starts with --digest.
    Revoke {
        name: String,
        /// At least 6 hex digits of the key's digest (as `keys list` shows it).
        #[arg(long, value_name = "PREFIX")]
        digest: Option<String>,
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

#[derive(Subcommand)]
enum WebhooksCmd {
    /// A new signing secret for <owner> (a relay key's name, or `default` for POST /tasks),
    /// printed alone on stdout, once. Pushes are signed with it and the previous one until
    /// `retire`: receivers can switch without losing a delivery.
    Rotate {
        #[arg(long)]
        owner: String,
    },
    /// Stop signing <owner>'s pushes with the previous secret.
    Retire {
        #[arg(long)]
        owner: String,
    },
}

#[derive(Subcommand)]
enum Cmd {
    /// List poisoned messages (solutions redacted unless --reveal).
    List {
        #[arg(long, default_value_t = 50)]
        max: usize,
        #[arg(long)]
        reveal: bool,
    },
    /// Show one poisoned message.
    Show {
        message_id: String,
        #[arg(long)]
        reveal: bool,
    },
    /// Move poisoned messages back to the dead-letter queue for another try.
    Redrive {
        #[arg(long, default_value_t = u64::MAX)]
        max: u64,
    },
    /// Move back only the letters of one task.
    RedriveTask { task_ref: String },
    /// The account-wide CaptchaAI breaker.
    Breaker {
        #[command(subcommand)]
        cmd: BreakerCmd,
    },
    /// The submit queue: tasks waiting for a CaptchaAI thread, per lane, and the submitter.
    Queue,
    /// Entries per shard of the due-for-poll and due-for-delivery indexes; with --count N (the
    /// new PollShards when lowering it), whether PollShardsPrevious may go back to 0.
    Shards {
        /// The shard count being moved to.
        #[arg(long)]
        count: Option<u8>,
    },
    /// Relay keys: the `key` 2captcha-style clients send to /in.php and /res.php.
    Keys {
        #[command(subcommand)]
        cmd: KeysCmd,
    },
    /// Pushes of results to owners' callbacks: list the parked ones, replay them.
    Deliveries {
        #[command(subcommand)]
        cmd: DeliveriesCmd,
    },
    /// The secrets owners' pushes are signed with.
    Webhooks {
        #[command(subcommand)]
        cmd: WebhooksCmd,
    },
    /// Erase one owner's tasks now (an erasure request): every task submitted with relay key
    /// NAME (`--key`), or by OWNER (`--owner`: a `POST /tasks` caller's IAM identity, as the
    /// relay records it). Prints how many were deleted. A scan of the table (TABLE_NAME).
    Erase {
        #[arg(long, conflicts_with = "owner")]
        key: Option<String>,
        #[arg(long)]
        owner: Option<String>,
    },
}

async fn deliveries(store: &relay_shared::store::TaskStore, cmd: DeliveriesCmd) -> anyhow::Result<()> {
    use relay_ops::deliveries::{self as d, parse_time};
    let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
    let time = |t: &str| parse_time(t, now).map_err(anyhow::Error::msg);
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
                None if tasks.is_empty() => anyhow::bail!("name tasks with --task <ref>, or a range with --since"),
                None => d::replay_tasks(store, &tasks, now).await?,
            };
            for (r, why) in &done.skipped {
                eprintln!("skipped {r}: {why}");
            }
            println!("{} push(es) due again now", done.replayed.len());
        }
    }
    Ok(())
}

async fn webhooks(store: &relay_shared::store::TaskStore, cmd: WebhooksCmd) -> anyhow::Result<()> {
    use relay_shared::webhook::{SigningKeys, WebhookSecret};
    match cmd {
        WebhooksCmd::Rotate { owner } => {
            let (_, new) = WebhookSecret::generate();
            let current = store.pushes().webhook_secrets(&owner).await?;
            let previous = current.as_deref().and_then(|c| c.split([',', ' ']).find(|p| !p.trim().is_empty()));
            let text = match previous {
                Some(p) => format!("{new},{}", p.trim()),
                None => new.clone(),
            };
            SigningKeys::parse_list(&text)?;
            store.pushes().put_webhook_secrets(&owner, &text).await?;
            println!("{new}");
            eprintln!(
                "pushes for `{owner}` are now signed with this secret{}; within a minute every worker uses it",
                if previous.is_some() { " and the previous one (retire it once receivers switched)" } else { "" }
            );
        }
        WebhooksCmd::Retire { owner } => {
            let Some(current) = store.pushes().webhook_secrets(&owner).await? else {
                anyhow::bail!("`{owner}` has no secret of its own (its pushes use the deployment's WEBHOOK_SECRETS)");
            };
            let first = current.split([',', ' ']).find(|p| !p.trim().is_empty()).unwrap_or_default().trim();
            SigningKeys::parse_list(first)?;
            store.pushes().put_webhook_secrets(&owner, first).await?;
            eprintln!("`{owner}`'s pushes are signed with its current secret only");
        }
    }
    Ok(())
}

fn task_store(aws: &aws_config::SdkConfig, table: Option<String>) -> anyhow::Result<relay_shared::store::TaskStore> {
    let table = table
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| anyhow::anyhow!("set --table-name or TABLE_NAME (the stack's TasksTableName output)"))?;
    Ok(relay_shared::store::TaskStore::new(aws_sdk_dynamodb::Client::new(aws), table, Duration::from_secs(86_400)))
}

async fn keys(store: &relay_shared::store::TaskStore, cmd: KeysCmd) -> anyhow::Result<()> {
    use relay_ops::keys;
    use secrecy::ExposeSecret;
    let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
    match cmd {
        KeysCmd::Create { name, pingback } => {
            let made = keys::create(store, &name, pingback, now).await?;
            // Only the key on stdout, so `KEY=$(relay-ops keys create scraper)` works.
            println!("{}", made.key.expose_secret());
            eprintln!("{}", made.hint(&name));
        }
        KeysCmd::List { json } => {
            let rows = keys::list(store).await?;
            if json {
                println!("{}", serde_json::to_string_pretty(&keys::render_json(&rows))?);
            } else {
                print!("{}", keys::render_table(&rows));
                let live = rows.iter().filter(|r| r.revoked_at.is_none()).count();
                eprintln!("{} relay key(s), {live} live", rows.len());
            }
        }
        KeysCmd::Revoke { name, digest } => {
            let n = keys::revoke(store, &name, digest.as_deref(), now).await?;
            println!("{}", keys::revoked_message(n, &name));
        }
        KeysCmd::Set { name, pingback } => {
            let n = keys::set_pingback(store, &name, pingback).await?;
            println!(
                "{n} key(s) named `{name}` now push results to a pingback in the `{}` form (running relays within 60 s)",
                pingback.as_str()
            );
        }
    }
    Ok(())
}

fn print(s: &relay_ops::Shown) {
    println!(
        "{}  receives={}  task={}  captcha_id={}  code={}  received_at={}  error={}{}",
        s.message_id,
        s.receive_count,
        s.task_ref.as_deref().unwrap_or("-"),
        s.captcha_id.as_deref().unwrap_or("-"),
        s.code.as_deref().unwrap_or("-"),
        s.received_at.as_deref().unwrap_or("-"),
        s.error.as_deref().unwrap_or("-"),
        s.raw.as_deref().map(|r| format!("  raw={r}")).unwrap_or_default(),
    );
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    let aws = relay_shared::aws_config().await;
    let cmd = match cli.cmd {
        Cmd::Keys { cmd } => return keys(&task_store(&aws, cli.table_name)?, cmd).await,
        Cmd::Deliveries { cmd } => return deliveries(&task_store(&aws, cli.table_name)?, cmd).await,
        Cmd::Webhooks { cmd } => return webhooks(&task_store(&aws, cli.table_name)?, cmd).await,
        Cmd::Erase { key, owner } => {
            let owner = relay_shared::store::retention::erasure_owner(key.as_deref(), owner.as_deref())
                .map_err(anyhow::Error::msg)?;
            let removed = task_store(&aws, cli.table_name)?.retention().erase_owner(&owner).await?;
            println!("erased {} task(s) of `{owner}` ({} items read)", removed.deleted, removed.scanned);
            return Ok(());
        }
        Cmd::Queue => {
            let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
            print!("{}", relay_ops::queue::report(&task_store(&aws, cli.table_name)?, now).await?);
            return Ok(());
        }
        Cmd::Shards { count } => {
            let store = task_store(&aws, cli.table_name)?;
            let rows = store.poll().shard_entries(relay_shared::store::MAX_POLL_SHARDS).await?;
            print!("{}", relay_ops::shards_report(&rows, count));
            return Ok(());
        }
        cmd => cmd,
    };
    if let Cmd::Breaker { cmd } = &cmd {
        let store = task_store(&aws, cli.table_name)?;
        let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
        if matches!(cmd, BreakerCmd::Close) {
            store.account().close_breaker().await?;
            eprintln!("breaker closed: CaptchaAI traffic resumes with the next poller pass");
        }
        let b = store.account().breaker().await?;
        match b.open_at(now).or(b.open_for_submits_at(now)) {
            Some(until) => println!(
                "OPEN until {until} ({} s left) because {}{}",
                until.since(now).as_secs(),
                b.reason.as_deref().unwrap_or("?"),
                if b.plan_out() {
                    "; submits only (results still read): renew the plan, then `relay-ops breaker close`"
                } else if b.needs_operator {
                    "; fix the key, then `relay-ops breaker close`"
                } else {
                    ""
                }
            ),
            None => println!("closed (last opened: {})", b.reason.as_deref().unwrap_or("never")),
        }
        println!(
            "batch reads (ids=): {}",
            if b.batch_unsupported { "not supported (learnt)" } else { "not known to be refused" }
        );
        return Ok(());
    }
    let client = aws_sdk_sqs::Client::new(&aws);
    let queue = |url: Option<String>, name: &str| {
        url.map(|u| SqsQueue::new(client.clone(), u))
            .ok_or_else(|| anyhow::anyhow!("set --{name} or its environment variable"))
    };
    let poison = queue(cli.poison_queue_url, "poison-queue-url")?;
    let dlq = queue(cli.dead_letter_queue_url, "dead-letter-queue-url")?;
    match cmd {
        Cmd::Breaker { .. }
        | Cmd::Keys { .. }
        | Cmd::Deliveries { .. }
        | Cmd::Webhooks { .. }
        | Cmd::Erase { .. }
        | Cmd::Queue
        | Cmd::Shards { .. } => {}
        Cmd::List { max, reveal } => {
            let msgs = relay_ops::list(&poison, max).await?;
            for m in &msgs {
                print(&relay_ops::show(m, reveal));
            }
            eprintln!("{} poisoned message(s) listed", msgs.len());
        }
        Cmd::Show { message_id, reveal } => {
            let msgs = relay_ops::list(&poison, 10_000).await?;
            let m = msgs.iter().find(|m| m.message_id == message_id);
            match m {
                Some(m) => print(&relay_ops::show(m, reveal)),
                None => anyhow::bail!("no poisoned message {message_id}"),
            }
        }
        Cmd::Redrive { max } => {
            let total = poison.depth().await?.min(max);
            let bar = indicatif::ProgressBar::new(total);
            let report = relay_ops::move_messages(&poison, &dlq, max, None, |r| bar.set_position(r.moved)).await?;
            bar.finish();
            eprintln!("moved {} message(s) back to the dead-letter queue", report.moved);
        }
        Cmd::RedriveTask { task_ref } => {
            let only = |m: &relay_shared::deadletter::Received| relay_ops::is_for_task(m, &task_ref);
            let bar = indicatif::ProgressBar::new_spinner();
            let report =
                relay_ops::move_messages(&poison, &dlq, u64::MAX, Some(&only), |r| bar.set_position(r.moved)).await?;
            bar.finish();
            if report.moved == 0 {
                anyhow::bail!("no poisoned letters for task {task_ref}");
            }
            eprintln!("moved {} letter(s) of {task_ref} back to the dead-letter queue", report.moved);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::{CommandFactory, Parser};

    use super::{Cli, Cmd, KeysCmd};

    #[test]
    fn the_command_line_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn keys_subcommands_parse() -> anyhow::Result<()> {
        let cli = Cli::try_parse_from(["relay-ops", "--table-name", "t", "keys", "create", "scraper"])?;
        assert_eq!(cli.table_name.as_deref(), Some("t"));
        assert!(
            matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::Create { name, pingback } } if name == "scraper" && pingback == relay_shared::domain::PingbackForm::Get)
        );
        let cli = Cli::try_parse_from(["relay-ops", "keys", "create", "old", "--pingback", "post"])?;
        assert!(
            matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::Create { pingback, .. } } if pingback == relay_shared::domain::PingbackForm::Post)
        );
        assert!(Cli::try_parse_from(["relay-ops", "keys", "create", "old", "--pingback", "put"]).is_err());
        let cli = Cli::try_parse_from(["relay-ops", "keys", "set", "old", "--pingback", "get"])?;
        assert!(matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::Set { .. } }));
        let cli = Cli::try_parse_from(["relay-ops", "keys", "list", "--json"])?;
        assert!(matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::List { json: true } }));
        let cli = Cli::try_parse_from(["relay-ops", "keys", "list"])?;
        assert!(matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::List { json: false } }));
        let cli = Cli::try_parse_from(["relay-ops", "keys", "revoke", "scraper"])?;
        assert!(matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::Revoke { name, digest: None } } if name == "scraper"));
        let cli = Cli::try_parse_from(["relay-ops", "keys", "revoke", "scraper", "--digest", "0a1b2c"])?;
        assert!(
            matches!(cli.cmd, Cmd::Keys { cmd: KeysCmd::Revoke { name, digest: Some(d) } } if name == "scraper" && d == "0a1b2c")
        );
        // A name is required; there is no way to pass a key in.
        assert!(Cli::try_parse_from(["relay-ops", "keys", "create"]).is_err());
        assert!(Cli::try_parse_from(["relay-ops", "keys", "revoke"]).is_err());
        assert!(Cli::try_parse_from(["relay-ops", "keys", "revoke", "x", "--digest"]).is_err());
        assert!(Cli::try_parse_from(["relay-ops", "keys", "list", "--key", "abc"]).is_err());
        Ok(())
    }
}

//! `relay-ops`: look at poisoned dead letters and move them back for another try.
//!
//!   relay-ops list [--max 50] [--reveal]
//!   relay-ops show <message-id> [--reveal]
//!   relay-ops redrive [--max N]          poison queue → dead-letter queue
//!   relay-ops redrive-task <task-ref>    only that task's letters
//!   relay-ops breaker show|close         the account-wide CaptchaAI breaker (TABLE_NAME)
//!
//! Queues come from `--poison-queue-url` / `POISON_QUEUE_URL` and `--dead-letter-queue-url` /
//! `DEAD_LETTER_QUEUE_URL`; AWS credentials and region as usual (`AWS_ENDPOINT_URL_SQS` for a
//! local SQS).

use std::time::Duration;

use clap::{Parser, Subcommand};
use relay_shared::deadletter::SqsQueue;

#[derive(Parser)]
#[command(
    name = "relay-ops",
    about = "Inspect and re-drive poisoned dead letters; look at and close the CaptchaAI breaker"
)]
struct Cli {
    #[arg(long, env = "POISON_QUEUE_URL")]
    poison_queue_url: Option<String>,
    #[arg(long, env = "DEAD_LETTER_QUEUE_URL")]
    dead_letter_queue_url: Option<String>,
    /// The task table (for `breaker`).
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
    if let Cmd::Breaker { cmd } = &cli.cmd {
        let table = cli.table_name.ok_or_else(|| anyhow::anyhow!("set --table-name or TABLE_NAME"))?;
        let store = relay_shared::store::TaskStore::new(
            aws_sdk_dynamodb::Client::new(&aws),
            table,
            Duration::from_secs(86_400),
        );
        let now = relay_shared::time::Clock::now(&relay_shared::time::SystemClock);
        if matches!(cmd, BreakerCmd::Close) {
            store.close_breaker().await?;
            eprintln!("breaker closed: CaptchaAI traffic resumes with the next poller pass");
        }
        let b = store.breaker().await?;
        match b.open_at(now) {
            Some(until) => println!(
                "OPEN until {until} ({} s left) because {}{}",
                until.since(now).as_secs(),
                b.reason.as_deref().unwrap_or("?"),
                if b.needs_operator { "; fix the key, then `relay-ops breaker close`" } else { "" }
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
    match cli.cmd {
        Cmd::Breaker { .. } => {}
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

//! `relay-ops`: look at poisoned dead letters and move them back for another try.
//!
//!   relay-ops list [--max 50] [--reveal]
//!   relay-ops show <message-id> [--reveal]
//!   relay-ops redrive [--max N]          poison queue → dead-letter queue
//!   relay-ops redrive-task <task-ref>    only that task's letters
//!
//! Queues come from `--poison-queue-url` / `POISON_QUEUE_URL` and `--dead-letter-queue-url` /
//! `DEAD_LETTER_QUEUE_URL`; AWS credentials and region as usual (`AWS_ENDPOINT_URL_SQS` for a
//! local SQS).

use clap::{Parser, Subcommand};
use relay_shared::deadletter::SqsQueue;

#[derive(Parser)]
#[command(name = "relay-ops", about = "Inspect and re-drive poisoned dead letters")]
struct Cli {
    #[arg(long, env = "POISON_QUEUE_URL")]
    poison_queue_url: String,
    #[arg(long, env = "DEAD_LETTER_QUEUE_URL")]
    dead_letter_queue_url: String,
    #[command(subcommand)]
    cmd: Cmd,
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
    let client = aws_sdk_sqs::Client::new(&aws);
    let poison = SqsQueue::new(client.clone(), cli.poison_queue_url);
    let dlq = SqsQueue::new(client, cli.dead_letter_queue_url);
    match cli.cmd {
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

//! What the operator command does, as functions the tests drive.
//!
//! Moving is receive → send → delete, one message at a time: a message is deleted from the
//! source only after the target accepted it, so an interrupted move loses nothing. The one
//! window — sent but not yet deleted — leaves a second copy behind, which re-applies as a
//! duplicate and changes nothing (the write is idempotent).

pub mod keys;
pub mod queue;

/// Pushes to owners' callbacks that an operator looks at (shared with `relay-local`).
pub use relay_shared::delivery::operator as deliveries;
use std::collections::HashSet;

use relay_shared::codes::is_error_code;
use relay_shared::deadletter::{DeadLetter, QueueError, Received, SqsQueue};
use relay_shared::telemetry::redact;

/// A poisoned message as the operator sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shown {
    pub message_id: String,
    pub receive_count: u32,
    /// The letter, if the body is one.
    pub task_ref: Option<String>,
    pub captcha_id: Option<String>,
    /// The result: an error code as is; a solution redacted unless revealed.
    pub code: Option<String>,
    pub error: Option<String>,
    pub received_at: Option<String>,
    /// The raw body when it is not a dead letter at all (redacted unless revealed).
    pub raw: Option<String>,
}

pub fn show(m: &Received, reveal: bool) -> Shown {
    let mut s = Shown {
        message_id: m.message_id.clone(),
        receive_count: m.receive_count,
        task_ref: None,
        captcha_id: None,
        code: None,
        error: None,
        received_at: None,
        raw: None,
    };
    match DeadLetter::parse(&m.body) {
        Ok(l) => {
            s.code = Some(if reveal || is_error_code(&l.code) { l.code.clone() } else { redact(&l.code) });
            s.task_ref = Some(l.task_ref);
            s.captcha_id = Some(l.captcha_id);
            s.error = Some(l.error);
            s.received_at = Some(l.received_at);
        }
        Err(e) => {
            s.error = Some(e.0);
            s.raw = Some(if reveal { m.body.clone() } else { redact(&m.body) });
        }
    }
    s
}

/// Peeks at up to `max` messages without taking them (they stay visible).
pub async fn list(queue: &SqsQueue, max: usize) -> Result<Vec<Received>, QueueError> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    let mut empty_rounds = 0;
    // Receives are sampled by SQS: keep asking until a few rounds bring nothing new.
    while out.len() < max && empty_rounds < 3 {
        let got = queue.receive(10, 0, 0).await?;
        let before = out.len();
        for m in got {
            if out.len() < max && seen.insert(m.message_id.clone()) {
                out.push(m);
            }
        }
        empty_rounds = if out.len() == before { empty_rounds + 1 } else { 0 };
    }
    Ok(out)
}

/// What a move did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct MoveReport {
    pub moved: u64,
    pub skipped: u64,
}

/// Moves up to `max` messages from `from` to `to` (receive → send → delete), those matching
/// `only` when given. `progress` is called after each message.
pub async fn move_messages(
    from: &SqsQueue,
    to: &SqsQueue,
    max: u64,
    only: Option<&dyn Fn(&Received) -> bool>,
    mut progress: impl FnMut(&MoveReport),
) -> Result<MoveReport, QueueError> {
    let mut report = MoveReport::default();
    let mut passed_over = HashSet::new();
    while report.moved < max {
        // Hidden for 30 s while we move it; if we die, it reappears in `from`.
        let batch = from.receive(10, 30, 0).await?;
        if batch.is_empty() || batch.iter().all(|m| passed_over.contains(&m.message_id)) {
            break;
        }
        for m in batch {
            if report.moved >= max || only.is_some_and(|keep| !keep(&m)) {
                if passed_over.insert(m.message_id.clone()) {
                    report.skipped += 1;
                }
                continue;
            }
            to.send_body(&m.body).await?;
            from.delete(&m.receipt_handle).await?;
            report.moved += 1;
            progress(&report);
        }
    }
    Ok(report)
}

/// Whether a message is a dead letter for `task_ref`.
pub fn is_for_task(m: &Received, task_ref: &str) -> bool {
    DeadLetter::parse(&m.body).is_ok_and(|l| l.task_ref == task_ref)
}

/// The `relay-ops shards` table: entries per shard (only shards that hold any), and with
/// `count` (the shard count being moved to) whether any entry still sits at or above it.
pub fn shards_report(rows: &[(u8, u64, u64)], count: Option<u8>) -> String {
    use std::fmt::Write;
    let mut out = String::from("shard  due-for-poll  due-for-delivery\n");
    for (shard, poll, delivery) in rows.iter().filter(|(_, p, d)| p + d > 0) {
        let _ = writeln!(out, "{shard:>5}  {poll:>12}  {delivery:>16}");
    }
    if let Some(count) = count {
        let left: u64 = rows.iter().filter(|(s, ..)| *s >= count).map(|(_, p, d)| p + d).sum();
        if left == 0 {
            let _ = writeln!(out, "no entry at or above shard {count}: PollShardsPrevious can go back to 0");
        } else {
            let _ = writeln!(
                out,
                "{left} entries at or above shard {count}: keep PollShardsPrevious until their tasks end (parked pushes: replay or wait for expiry)"
            );
        }
    }
    out
}

#[cfg(test)]
mod tests;

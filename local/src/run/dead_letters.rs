//! The local dead-letter queue as the relay works it: the redrive loop's passes, and the
//! listing of what is poisoned.

use relay_shared::store::TaskStore;

use crate::queue::DiskQueue;

/// The poisoned dead letters of a local relay, one line each: the queue id and what the letter
/// holds, its solution redacted unless `reveal` (what `relay-local dead-letters list` prints,
/// after the id).
pub fn list_poisoned(queue: &DiskQueue, reveal: bool) -> anyhow::Result<Vec<(i64, String)>> {
    Ok(queue.poisoned_letters()?.iter().map(|p| (p.id, crate::ops::describe_letter(p, reveal))).collect())
}

/// Batches one pass of the redrive loop takes at most (10 letters each): a pass drains a
/// backlog — thousands of letters after a store outage — instead of 10 letters every 5 s, which
/// left results recorded long after their tokens died. A letter that fails again is hidden by
/// its pacing, so a pass does not see it twice.
pub const DRAIN_BATCHES_PER_PASS: usize = 500;

/// One pass of the redrive loop over the on-disk dead-letter queue: until nothing is visible
/// (or [`DRAIN_BATCHES_PER_PASS`]). Letters are applied one at a time.
pub async fn drain_dead_letters(queue: &DiskQueue, store: &TaskStore) {
    for _ in 0..DRAIN_BATCHES_PER_PASS {
        if drain_batch(queue, store).await < 10 {
            return;
        }
    }
}

/// One batch of up to 10 letters; how many it received.
async fn drain_batch(queue: &DiskQueue, store: &TaskStore) -> usize {
    use relay_shared::telemetry::error_chain;
    let q = queue.clone();
    let batch = match tokio::task::spawn_blocking(move || q.receive(10)).await {
        Ok(Ok(batch)) => batch,
        Ok(Err(e)) => {
            tracing::error!(event = "dead_letter_receive_failed", error = error_chain(&e));
            return 0;
        }
        Err(e) => {
            tracing::error!(event = "dead_letter_receive_failed", error = error_chain(&e));
            return 0;
        }
    };
    let received = batch.len();
    for m in batch {
        let outcome = relay_redrive::redrive_one(&store.tasks(), &store.results(), &m.body).await;
        let q = queue.clone();
        let id = m.id;
        let done = tokio::task::spawn_blocking(move || match outcome {
            relay_redrive::Redriven::Applied | relay_redrive::Redriven::AlreadyRecorded => q.delete(&m).map(|_| ()),
            relay_redrive::Redriven::Permanent(_) => q.poison(&m).map(|_| ()),
            // Left leased: it comes back within seconds while its token may live, else when
            // its visibility lapses.
            relay_redrive::Redriven::Retry(_) => q.retry_paced(&m).map(|_| ()),
        })
        .await;
        // Either way the letter stays in the queue and comes back when its lease lapses.
        match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!(event = "dead_letter_settle_failed", id, error = error_chain(&e)),
            Err(e) => tracing::error!(event = "dead_letter_settle_failed", id, error = error_chain(&e)),
        }
    }
    received
}

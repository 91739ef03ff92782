//! Local mode keeps a result no longer than `RETENTION_DAYS`, as the table's TTL does on AWS —
//! and, unlike DynamoDB, within a minute of its end. A sweep runs at start (a relay started
//! again after a long stop catches up at once) and every [`SWEEP_EVERY`]: it deletes the task
//! items past their retention (bounded per pass, [`SWEEP_MAX`]), and the dead letters whose
//! results are as old. What they held then leaves the disk, not only the index: the
//! dead-letter file zeroes what it deletes (`secure_delete`), and the task file — written by
//! the embedded engine — is rebuilt without the freed pages (`VACUUM`) with its write-ahead log
//! emptied ([`compact`]). An erasure request (`relay-local erase`) ends the same way.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use relay_shared::store::TaskStore;
use relay_shared::time::Clock;

use crate::queue::DiskQueue;

/// How often the sweep runs.
pub const SWEEP_EVERY: Duration = Duration::from_secs(60);
/// Items one pass deletes at most (the next pass, a minute later, goes on).
pub const SWEEP_MAX: usize = 1_000;

/// What one pass removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Swept {
    pub tasks: usize,
    pub letters: usize,
    /// Whether the task file was compacted (something was deleted).
    pub compacted: bool,
}

/// The sweep over one data directory.
#[derive(Clone)]
pub struct Sweep {
    pub store: TaskStore,
    pub queue: DiskQueue,
    /// The embedded engine's file (`<data_dir>/tasks.sqlite`).
    pub tasks_file: PathBuf,
    pub retention: Duration,
    pub clock: Arc<dyn Clock>,
}

impl Sweep {
    /// One pass at the clock's now.
    pub async fn pass(&self) -> anyhow::Result<Swept> {
        let now = self.clock.now();
        let removed = self.store.retention().sweep_expired(now, SWEEP_MAX).await.context("sweeping the task table")?;
        let letters = self.queue.purge_before(now.minus(self.retention).as_millis()).context("purging dead letters")?;
        let mut swept = Swept { tasks: removed.deleted, letters, compacted: false };
        if removed.deleted > 0 {
            compact(&self.tasks_file).await?;
            swept.compacted = true;
        }
        if swept.tasks + swept.letters > 0 {
            tracing::info!(
                event = "retention_sweep",
                tasks = swept.tasks,
                letters = swept.letters,
                more = removed.more
            );
        }
        Ok(swept)
    }

    /// Passes now and every [`SWEEP_EVERY`] until `stop`.
    pub async fn run(self, mut stop: tokio::sync::watch::Receiver<bool>) {
        loop {
            if let Err(e) = self.pass().await {
                tracing::error!(event = "retention_sweep_failed", error = relay_shared::telemetry::error_chain(&*e));
            }
            tokio::select! {
                _ = tokio::time::sleep(SWEEP_EVERY) => {}
                _ = stop.wait_for(|s| *s) => return,
            }
        }
    }
}

/// Rebuilds the task file without the pages its deleted items held (`VACUUM`) and empties its
/// write-ahead log, from a connection of its own beside the engine's. Retried while the engine
/// is mid-write.
pub async fn compact(path: &Path) -> anyhow::Result<()> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        let conn = rusqlite::Connection::open(&path).with_context(|| format!("opening {}", path.display()))?;
        conn.busy_timeout(Duration::from_secs(10))?;
        conn.execute_batch("VACUUM;").with_context(|| format!("vacuuming {}", path.display()))?;
        conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(()))
            .with_context(|| format!("checkpointing {}", path.display()))?;
        Ok(())
    })
    .await?
}

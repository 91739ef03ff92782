//! Local mode's operator commands, as `relay-ops` gives them on AWS: the poison queue
//! (`relay-local dead-letters list|replay`) and the parked pushes (`relay-local deliveries
//! list|replay`) of a local relay's data directory, whether the relay runs or not.
//!
//! One process at a time works on a data directory's store file: a running relay holds
//! `relay.lock` ([`DataLock`]) for as long as it runs. A command that finds the lock held talks
//! to that relay's store through the endpoint it wrote (`dynamodb-endpoint`); a command that
//! finds it free takes it for its few moments and opens the store file itself, and a relay
//! started meanwhile waits for it ([`LOCK_WAIT`]) rather than have two engines write one file.
//! The dead-letter queue is a SQLite file both may open at once (each change is one
//! transaction).

use std::fs::{File, OpenOptions, TryLockError};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use relay_shared::codes::is_error_code;
use relay_shared::deadletter::DeadLetter;
use relay_shared::local::LocalDynamo;
use relay_shared::store::TaskStore;
use relay_shared::telemetry::redact;
use relay_shared::time::Timestamp;

use crate::queue::{DiskQueue, Poisoned};

/// The lock file in the data directory.
pub const LOCK_FILE: &str = "relay.lock";

/// How long a relay starting waits for the data directory (an operator command holding it
/// finishes in well under a second).
pub const LOCK_WAIT: Duration = Duration::from_secs(10);

/// The data directory held by this process (an advisory lock on `relay.lock`, which the
/// system lets go of when the process ends, killed or not).
#[derive(Debug)]
pub struct DataLock {
    _file: File,
}

impl DataLock {
    /// Takes the lock now, or `None` if another process holds it.
    pub fn try_take(dir: &Path) -> anyhow::Result<Option<Self>> {
        let path = dir.join(LOCK_FILE);
        let mut file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        match file.try_lock() {
            Ok(()) => {
                // Who holds it, for the message another process shows.
                let _ = file.set_len(0).and_then(|()| write!(file, "{}", std::process::id()));
                Ok(Some(Self { _file: file }))
            }
            Err(TryLockError::WouldBlock) => Ok(None),
            Err(TryLockError::Error(e)) => Err(e).with_context(|| format!("cannot lock {}", path.display())),
        }
    }

    /// Takes the lock, waiting up to `wait` for the process that holds it.
    pub async fn take(dir: &Path, wait: Duration) -> anyhow::Result<Self> {
        let until = Instant::now() + wait;
        loop {
            if let Some(lock) = Self::try_take(dir)? {
                return Ok(lock);
            }
            if Instant::now() >= until {
                let holder = std::fs::read_to_string(dir.join(LOCK_FILE)).unwrap_or_default();
                bail!(
                    "{} is in use by another relay-local (pid {}): one relay per data directory",
                    dir.display(),
                    Some(holder.trim()).filter(|h| !h.is_empty()).unwrap_or("?")
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A local relay's task store as an operator command reaches it.
pub struct OperatorStore {
    pub store: TaskStore,
    /// The relay is running (the store is its own, through its endpoint); otherwise this
    /// command opened the file and holds the data directory until it is dropped.
    pub relay_running: bool,
    _db: Option<LocalDynamo>,
    _lock: Option<DataLock>,
}

/// Opens the task store of the relay on `dir`, running or stopped.
pub async fn open_store(dir: &Path) -> anyhow::Result<OperatorStore> {
    let file = dir.join("tasks.sqlite");
    if !file.exists() {
        bail!("no relay has run on {} (no tasks.sqlite there; is RELAY_DATA_DIR right?)", dir.display());
    }
    let Some(lock) = DataLock::try_take(dir)? else {
        let store = crate::data_dir::running_store(dir).await?;
        return Ok(OperatorStore { store, relay_running: true, _db: None, _lock: None });
    };
    let db = LocalDynamo::start_at(&file).await.with_context(|| format!("cannot open {}", file.display()))?;
    let client = db.client();
    client
        .describe_table()
        .table_name("tasks")
        .send()
        .await
        .map_err(|e| anyhow::anyhow!(relay_shared::telemetry::error_chain(&e)))
        .with_context(|| format!("{} holds no task table", file.display()))?;
    Ok(OperatorStore {
        store: TaskStore::new(client, "tasks", crate::data_dir::RETENTION),
        relay_running: false,
        _db: Some(db),
        _lock: Some(lock),
    })
}

/// The dead-letter queue file of the relay on `dir`.
pub fn dead_letter_path(dir: &Path) -> PathBuf {
    dir.join("dead-letters.sqlite")
}

/// Opens the dead-letter queue of the relay on `dir` (running or not) with the relay's own
/// settings.
pub fn open_queue(dir: &Path) -> anyhow::Result<DiskQueue> {
    let path = dead_letter_path(dir);
    if !path.exists() {
        bail!("no dead-letter queue at {} (is RELAY_DATA_DIR right?)", path.display());
    }
    let clock: std::sync::Arc<dyn relay_shared::time::Clock> = std::sync::Arc::new(relay_shared::time::SystemClock);
    DiskQueue::open(&path, clock, Duration::from_secs(30), crate::data_dir::DEAD_LETTER_MAX_RECEIVES)
        .with_context(|| format!("cannot open {}", path.display()))
}

/// One poisoned letter as `dead-letters list` prints it after its id, in `relay-ops list`'s
/// shape: the solution redacted unless `reveal` (an error code is shown as is).
pub fn describe_letter(p: &Poisoned, reveal: bool) -> String {
    let poisoned_at = Timestamp::from_millis(p.poisoned_at_ms).to_rfc3339();
    match DeadLetter::parse(&p.body) {
        Ok(l) => format!(
            "receives={}  task={}  captcha_id={}  code={}  received_at={}  error={}  poisoned_at={poisoned_at}",
            p.receive_count,
            l.task_ref,
            l.captcha_id,
            if reveal || is_error_code(&l.code) { l.code.clone() } else { redact(&l.code) },
            l.received_at,
            l.error,
        ),
        Err(e) => format!(
            "receives={}  task=-  captcha_id=-  code=-  received_at=-  error={}  poisoned_at={poisoned_at}  raw={}",
            p.receive_count,
            e.0,
            if reveal { p.body.clone() } else { redact(&p.body) },
        ),
    }
}

/// Which poisoned letters `dead-letters replay` moves back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pick {
    /// These ids, as `dead-letters list` printed them.
    Ids(Vec<i64>),
    /// Every letter of these tasks.
    Tasks(Vec<String>),
    /// Every letter poisoned when the command looks, oldest first, at most `max`.
    All { max: usize },
}

/// What a replay did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MovedBack {
    /// The ids moved back to the queue.
    pub moved: Vec<i64>,
    /// What was named but matched nothing in the poison queue (gone, or never there).
    pub not_found: Vec<String>,
}

/// Moves the picked poisoned letters back to the queue, each in one transaction (never lost,
/// never doubled); the relay applies them again as it drains the queue. Only the letters picked
/// from what is poisoned now move: one poisoned after the look stays for the next list.
pub fn replay_dead_letters(queue: &DiskQueue, pick: &Pick) -> anyhow::Result<MovedBack> {
    let poisoned = queue.poisoned_letters()?;
    let mut out = MovedBack::default();
    let chosen: Vec<i64> = match pick {
        Pick::Ids(ids) => {
            for id in ids {
                if !poisoned.iter().any(|p| p.id == *id) {
                    out.not_found.push(id.to_string());
                }
            }
            poisoned.iter().filter(|p| ids.contains(&p.id)).map(|p| p.id).collect()
        }
        Pick::Tasks(refs) => {
            let task_of = |p: &Poisoned| DeadLetter::parse(&p.body).ok().map(|l| l.task_ref);
            for r in refs {
                if !poisoned.iter().any(|p| task_of(p).as_deref() == Some(r.trim())) {
                    out.not_found.push(r.clone());
                }
            }
            poisoned
                .iter()
                .filter(|p| task_of(p).is_some_and(|t| refs.iter().any(|r| r.trim() == t)))
                .map(|p| p.id)
                .collect()
        }
        Pick::All { max } => poisoned.iter().take(*max).map(|p| p.id).collect(),
    };
    for id in chosen {
        if queue.unpoison(id)? {
            out.moved.push(id);
        } else {
            // Moved by someone else between the look and the move.
            out.not_found.push(id.to_string());
        }
    }
    Ok(out)
}

//! A durable dead-letter queue on disk with SQS's contract, for the relay on one machine:
//! at-least-once delivery, a visibility timeout, a receive count, and a poison queue after
//! `max_receives` receives. It is a SQLite file (WAL, synchronous=FULL): a message acknowledged
//! by `send` survives `kill -9`; a received message that is never deleted comes back when its
//! visibility lapses, also after a restart.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use relay_shared::deadletter::{DeadLetter, DeadLetterSink, QueueError};
use relay_shared::time::Clock;
use rusqlite::{Connection, OptionalExtension, params};

/// A message handed out by [`DiskQueue::receive`]. Delete it with its receipt when done.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leased {
    pub id: i64,
    pub body: String,
    pub receive_count: u32,
    /// Proves this lease: a delete with an older receipt (the message came back meanwhile)
    /// does nothing.
    pub receipt: String,
}

/// A letter in the poison queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Poisoned {
    /// Its id in the queue file: what `dead-letters replay --id` takes.
    pub id: i64,
    pub body: String,
    pub receive_count: u32,
    pub poisoned_at_ms: u64,
}

#[derive(Clone)]
pub struct DiskQueue {
    conn: Arc<Mutex<Connection>>,
    clock: Arc<dyn Clock>,
    visibility: Duration,
    max_receives: u32,
}

impl std::fmt::Debug for DiskQueue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DiskQueue")
            .field("visibility", &self.visibility)
            .field("max_receives", &self.max_receives)
            .finish()
    }
}

fn qerr(e: impl std::fmt::Display) -> QueueError {
    QueueError(format!("disk queue: {e}"))
}

impl DiskQueue {
    /// Opens (or creates) the queue file.
    pub fn open(
        path: &Path,
        clock: Arc<dyn Clock>,
        visibility: Duration,
        max_receives: u32,
    ) -> Result<Self, QueueError> {
        let conn = Connection::open(path).map_err(qerr)?;
        conn.execute_batch(
            "PRAGMA journal_mode=WAL;
             PRAGMA synchronous=FULL;
             PRAGMA secure_delete=ON;
             CREATE TABLE IF NOT EXISTS messages (
                 id INTEGER PRIMARY KEY AUTOINCREMENT,
                 body TEXT NOT NULL,
                 visible_at INTEGER NOT NULL,
                 receive_count INTEGER NOT NULL DEFAULT 0,
                 receipt TEXT,
                 sent_at INTEGER NOT NULL
             );
             CREATE INDEX IF NOT EXISTS messages_visible ON messages (visible_at);
             CREATE TABLE IF NOT EXISTS poison (
                 id INTEGER PRIMARY KEY,
                 body TEXT NOT NULL,
                 receive_count INTEGER NOT NULL,
                 poisoned_at INTEGER NOT NULL
             );",
        )
        .map_err(qerr)?;
        Ok(Self { conn: Arc::new(Mutex::new(conn)), clock, visibility, max_receives: max_receives.max(1) })
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Connection>, QueueError> {
        self.conn.lock().map_err(|_| QueueError("disk queue lock poisoned".into()))
    }

    fn now(&self) -> i64 {
        i64::try_from(self.clock.now().as_millis()).unwrap_or(i64::MAX)
    }

    /// Stores a message durably (the call returns after the write is on disk).
    pub fn send_body(&self, body: &str) -> Result<i64, QueueError> {
        let conn = self.lock()?;
        let now = self.now();
        conn.execute("INSERT INTO messages (body, visible_at, sent_at) VALUES (?1, ?2, ?2)", params![body, now])
            .map_err(qerr)?;
        Ok(conn.last_insert_rowid())
    }

    /// Leases up to `max` visible messages for the visibility timeout. A message already
    /// received `max_receives` times moves to the poison queue instead of being handed out.
    pub fn receive(&self, max: usize) -> Result<Vec<Leased>, QueueError> {
        let mut conn = self.lock()?;
        let now = self.now();
        let until = now.saturating_add(i64::try_from(self.visibility.as_millis()).unwrap_or(i64::MAX));
        let tx = conn.transaction().map_err(qerr)?;
        let mut out = Vec::new();
        {
            let mut pick = tx
                .prepare("SELECT id, body, receive_count FROM messages WHERE visible_at <= ?1 ORDER BY id LIMIT ?2")
                .map_err(qerr)?;
            let rows: Vec<(i64, String, u32)> = pick
                .query_map(params![now, i64::try_from(max * 2).unwrap_or(i64::MAX)], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?))
                })
                .map_err(qerr)?
                .collect::<Result<_, _>>()
                .map_err(qerr)?;
            for (id, body, count) in rows {
                if count >= self.max_receives {
                    tx.execute(
                        "INSERT OR REPLACE INTO poison (id, body, receive_count, poisoned_at) VALUES (?1, ?2, ?3, ?4)",
                        params![id, body, count, now],
                    )
                    .map_err(qerr)?;
                    tx.execute("DELETE FROM messages WHERE id = ?1", params![id]).map_err(qerr)?;
                    continue;
                }
                if out.len() >= max {
                    continue;
                }
                let receipt = format!("{id}-{}", count + 1);
                tx.execute(
                    "UPDATE messages SET visible_at = ?1, receive_count = receive_count + 1, receipt = ?2 WHERE id = ?3",
                    params![until, receipt, id],
                )
                .map_err(qerr)?;
                out.push(Leased { id, body, receive_count: count + 1, receipt });
            }
        }
        tx.commit().map_err(qerr)?;
        Ok(out)
    }

    /// Leaves a leased message leased, to come back when
    /// [`relay_shared::deadletter::retry_delay`] says: within seconds while the token it carries
    /// may live, else when its lease lapses. Returns the delay. A stale lease changes nothing.
    pub fn retry_paced(&self, leased: &Leased) -> Result<Duration, QueueError> {
        let now = self.now();
        let delay = relay_shared::deadletter::DeadLetter::retry_delay_of(
            &leased.body,
            leased.receive_count,
            self.max_receives,
            relay_shared::time::Timestamp::from_millis(u64::try_from(now).unwrap_or(0)),
            self.visibility,
        );
        if delay < self.visibility {
            let at = now.saturating_add(i64::try_from(delay.as_millis()).unwrap_or(i64::MAX));
            let conn = self.lock()?;
            conn.execute(
                "UPDATE messages SET visible_at = ?1 WHERE id = ?2 AND receipt = ?3",
                params![at, leased.id, leased.receipt],
            )
            .map_err(qerr)?;
        }
        Ok(delay)
    }

    /// Deletes a leased message. `false` if the lease is stale (it came back and was leased
    /// again) or the message is gone.
    pub fn delete(&self, leased: &Leased) -> Result<bool, QueueError> {
        let conn = self.lock()?;
        let n = conn
            .execute("DELETE FROM messages WHERE id = ?1 AND receipt = ?2", params![leased.id, leased.receipt])
            .map_err(qerr)?;
        Ok(n == 1)
    }

    /// Moves a leased message to the poison queue now (it can never succeed).
    pub fn poison(&self, leased: &Leased) -> Result<bool, QueueError> {
        let mut conn = self.lock()?;
        let now = self.now();
        let tx = conn.transaction().map_err(qerr)?;
        let n = tx
            .execute(
                "INSERT INTO poison (id, body, receive_count, poisoned_at)
                 SELECT id, body, receive_count, ?3 FROM messages WHERE id = ?1 AND receipt = ?2",
                params![leased.id, leased.receipt, now],
            )
            .map_err(qerr)?;
        tx.execute("DELETE FROM messages WHERE id = ?1 AND receipt = ?2", params![leased.id, leased.receipt])
            .map_err(qerr)?;
        tx.commit().map_err(qerr)?;
        Ok(n == 1)
    }

    /// Messages ever sent to this queue file.
    pub fn total_sent(&self) -> Result<u64, QueueError> {
        let conn = self.lock()?;
        conn.query_row("SELECT COALESCE((SELECT seq FROM sqlite_sequence WHERE name = 'messages'), 0)", [], |r| {
            r.get::<_, i64>(0)
        })
        .map(|n| u64::try_from(n).unwrap_or(0))
        .map_err(qerr)
    }

    /// Messages waiting (visible or leased).
    pub fn depth(&self) -> Result<u64, QueueError> {
        let conn = self.lock()?;
        conn.query_row("SELECT COUNT(*) FROM messages", [], |r| r.get::<_, i64>(0))
            .map(|n| u64::try_from(n).unwrap_or(0))
            .map_err(qerr)
    }

    /// Bodies in the poison queue, oldest first.
    pub fn poisoned(&self) -> Result<Vec<(i64, String)>, QueueError> {
        let conn = self.lock()?;
        let mut st = conn.prepare("SELECT id, body FROM poison ORDER BY id").map_err(qerr)?;
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).map_err(qerr)?.collect::<Result<_, _>>().map_err(qerr)
    }

    /// The poison queue, oldest first, with each letter's receives and when it was poisoned
    /// (what `relay-local dead-letters list` shows).
    pub fn poisoned_letters(&self) -> Result<Vec<Poisoned>, QueueError> {
        let conn = self.lock()?;
        let mut st =
            conn.prepare("SELECT id, body, receive_count, poisoned_at FROM poison ORDER BY id").map_err(qerr)?;
        st.query_map([], |r| {
            Ok(Poisoned {
                id: r.get(0)?,
                body: r.get(1)?,
                receive_count: r.get(2)?,
                poisoned_at_ms: u64::try_from(r.get::<_, i64>(3)?).unwrap_or(0),
            })
        })
        .map_err(qerr)?
        .collect::<Result<_, _>>()
        .map_err(qerr)
    }

    /// Deletes every letter, queued or poisoned, whose result was received before `cutoff`
    /// (epoch ms; a letter that does not say when, by when it was queued or poisoned): its
    /// retention has ended. `secure_delete` zeroes what they held, and the write-ahead log is
    /// emptied, so the bytes leave the disk. Returns how many went.
    pub fn purge_before(&self, cutoff_ms: u64) -> Result<usize, QueueError> {
        let conn = self.lock()?;
        let cutoff = i64::try_from(cutoff_ms).unwrap_or(i64::MAX);
        let n = conn
            .execute(
                "DELETE FROM messages WHERE COALESCE(json_extract(body, '$.received_at_ms'), sent_at) < ?1",
                params![cutoff],
            )
            .map_err(qerr)?
            + conn
                .execute(
                    "DELETE FROM poison WHERE COALESCE(json_extract(body, '$.received_at_ms'), poisoned_at) < ?1",
                    params![cutoff],
                )
                .map_err(qerr)?;
        if n > 0 {
            conn.query_row("PRAGMA wal_checkpoint(TRUNCATE)", [], |_| Ok(())).map_err(qerr)?;
        }
        Ok(n)
    }

    /// Moves a poisoned message back to the queue (one transaction: never lost, never doubled).
    pub fn unpoison(&self, id: i64) -> Result<bool, QueueError> {
        let mut conn = self.lock()?;
        let now = self.now();
        let tx = conn.transaction().map_err(qerr)?;
        let body: Option<String> = tx
            .query_row("SELECT body FROM poison WHERE id = ?1", params![id], |r| r.get(0))
            .optional()
            .map_err(qerr)?;
        let Some(body) = body else { return Ok(false) };
        tx.execute("INSERT INTO messages (body, visible_at, sent_at) VALUES (?1, ?2, ?2)", params![body, now])
            .map_err(qerr)?;
        tx.execute("DELETE FROM poison WHERE id = ?1", params![id]).map_err(qerr)?;
        tx.commit().map_err(qerr)?;
        Ok(true)
    }
}

#[async_trait::async_trait]
impl DeadLetterSink for DiskQueue {
    async fn send(&self, letter: &DeadLetter) -> Result<(), QueueError> {
        let q = self.clone();
        let body = letter.to_json();
        tokio::task::spawn_blocking(move || q.send_body(&body)).await.map_err(qerr)?.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use relay_shared::time::{ManualClock, Timestamp};

    fn open(dir: &Path, clock: &ManualClock) -> DiskQueue {
        DiskQueue::open(&dir.join("dlq.sqlite"), Arc::new(clock.clone()), Duration::from_secs(30), 3).expect("open")
    }

    fn tmp() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("relay-queue-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&d).expect("tmp dir");
        d
    }

    #[test]
    fn a_received_message_is_hidden_until_its_visibility_lapses() {
        let dir = tmp();
        let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
        let q = open(&dir, &clock);
        q.send_body("a").expect("send");
        let first = q.receive(10).expect("receive");
        assert_eq!(first.len(), 1);
        assert!(q.receive(10).expect("receive").is_empty(), "hidden while leased");
        clock.advance(Duration::from_secs(31));
        let again = q.receive(10).expect("receive");
        assert_eq!((again[0].body.as_str(), again[0].receive_count), ("a", 2), "at least once");
        assert!(!q.delete(&first[0]).expect("delete"), "a stale lease deletes nothing");
        assert!(q.delete(&again[0]).expect("delete"));
        assert_eq!(q.depth().expect("depth"), 0);
    }

    #[test]
    fn a_letter_whose_token_may_live_is_retried_in_seconds_a_stale_one_at_the_visibility() {
        use relay_shared::deadletter::DeadLetter;
        use relay_shared::domain::{CaptchaId, IncomingResult, Outcome, Solution, TaskRef, Via};
        let dir = tmp();
        let clock = ManualClock::at(Timestamp::from_millis(1_796_210_146_000));
        // The deployed queue: 185 s visibility, 12 receives.
        let q = DiskQueue::open(&dir.join("dlq.sqlite"), Arc::new(clock.clone()), Duration::from_secs(185), 12)
            .expect("open");
        let letter = |token_at: Timestamp| {
            let d = IncomingResult {
                captcha_id: CaptchaId::parse("71000040").expect("id"),
                outcome: Outcome::Solved(Solution::parse("tok").expect("token")),
                received_at: token_at,
                via: Via::Callback,
                token_clock_start: token_at,
            };
            DeadLetter::new(&TaskRef::generate(), &d, "injected", 1).to_json()
        };
        let now = clock.now();
        q.send_body(&letter(now)).expect("send");
        q.send_body(&letter(now.minus(Duration::from_secs(600)))).expect("send");
        let got = q.receive(10).expect("receive");
        let delays: Vec<u64> = got.iter().map(|m| q.retry_paced(m).expect("pace").as_secs()).collect();
        assert_eq!(delays, vec![2, 185]);
        clock.advance(Duration::from_secs(2));
        let back = q.receive(10).expect("receive");
        assert_eq!(back.iter().map(|m| (m.id, m.receive_count)).collect::<Vec<_>>(), vec![(got[0].id, 2)]);
        assert_eq!(q.retry_paced(&back[0]).expect("pace").as_secs(), 4, "then 4 s");
        assert!(q.retry_paced(&got[0]).is_ok(), "a stale lease changes nothing");
        clock.advance(Duration::from_secs(3));
        assert!(q.receive(10).expect("receive").is_empty(), "not before its 4 s");
        clock.advance(Duration::from_secs(180));
        assert_eq!(q.receive(10).expect("receive").len(), 2, "both, the stale one at its visibility");
    }

    #[test]
    fn after_max_receives_a_message_is_poisoned_and_can_be_moved_back() {
        let dir = tmp();
        let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
        let q = open(&dir, &clock);
        q.send_body("bad").expect("send");
        for _ in 0..3 {
            assert_eq!(q.receive(10).expect("receive").len(), 1);
            clock.advance(Duration::from_secs(31));
        }
        assert!(q.receive(10).expect("receive").is_empty(), "the 4th receive poisons instead");
        let poisoned = q.poisoned().expect("poisoned");
        assert_eq!(poisoned.iter().map(|(_, b)| b.as_str()).collect::<Vec<_>>(), vec!["bad"]);
        assert!(q.unpoison(poisoned[0].0).expect("unpoison"));
        assert!(q.poisoned().expect("poisoned").is_empty());
        assert_eq!(q.receive(10).expect("receive")[0].receive_count, 1, "a fresh start");
    }

    #[test]
    fn messages_and_leases_survive_reopening_the_file() {
        let dir = tmp();
        let clock = ManualClock::at(Timestamp::from_millis(1_000_000));
        {
            let q = open(&dir, &clock);
            q.send_body("kept").expect("send");
            q.send_body("leased").expect("send");
            assert_eq!(q.receive(1).expect("receive")[0].body, "kept");
        } // dropped without deleting: as if the process died
        let q = open(&dir, &clock);
        assert_eq!(q.depth().expect("depth"), 2);
        assert_eq!(q.receive(10).expect("receive").iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), vec!["leased"]);
        clock.advance(Duration::from_secs(31));
        assert_eq!(q.receive(10).expect("receive")[0].body, "kept", "the dead process's lease lapsed");
    }
}

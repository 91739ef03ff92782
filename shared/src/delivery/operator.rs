//! Pushes to owners' callbacks that an operator looks at: the parked ones (every attempt
//! failed, or the URL was refused at send time), listed by when they were parked, and replayed
//! in bulk (by time range) or one task at a time. A replay makes the push due now with a fresh
//! set of attempts; the `webhook-id` stays the same for the same result.

use crate::domain::{DeliveryStatus, TaskRef};
use crate::store::{StoreError, TaskStore};
use crate::time::Timestamp;

/// One parked push, as `deliveries list` shows it (never the token, never the URL's path or
/// query: only its host).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Parked {
    pub task_ref: String,
    pub parked_at: String,
    pub attempts: u32,
    pub last_outcome: String,
    pub host: String,
}

/// The parked pushes parked between `from` and `to`, oldest first.
pub async fn list(store: &TaskStore, from: Timestamp, to: Timestamp, max: usize) -> Result<Vec<Parked>, StoreError> {
    let mut rows = Vec::new();
    for p in store.pushes().parked_deliveries(from, to, max).await? {
        // `to` is the listing's now: a task past its retention is not shown.
        let Some(task) = store.retention().get_retained(&p.task_ref, to).await? else { continue };
        let Some(d) = task.delivery.as_ref().filter(|d| d.status == DeliveryStatus::Parked) else { continue };
        let host = task
            .owner_callback
            .as_deref()
            .and_then(|u| u.split("://").nth(1))
            .map(|rest| rest.split(['/', '?', '#']).next().unwrap_or_default().to_owned())
            .unwrap_or_default();
        rows.push(Parked {
            task_ref: p.task_ref.to_string(),
            parked_at: p.due_at.to_rfc3339(),
            attempts: d.attempts,
            last_outcome: d.last_outcome.clone().unwrap_or_default(),
            host,
        });
    }
    Ok(rows)
}

/// What a replay did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// Made due again.
    pub replayed: Vec<String>,
    /// Named but not replayable (no callback, still open, or already due), with the reason.
    pub skipped: Vec<(String, String)>,
}

/// Replays the named tasks' pushes (parked, gone or delivered alike: an owner may ask again).
pub async fn replay_tasks(store: &TaskStore, refs: &[String], now: Timestamp) -> Result<Replayed, StoreError> {
    let mut out = Replayed::default();
    for raw in refs {
        let task_ref = match TaskRef::parse(raw.trim()).or_else(|_| TaskRef::from_compat_id(raw.trim())) {
            Ok(r) => r,
            Err(e) => {
                out.skipped.push((raw.clone(), e.0));
                continue;
            }
        };
        if store.retention().get_retained(&task_ref, now).await?.is_none() {
            out.skipped.push((raw.clone(), "no such task (or its retention has ended)".into()));
            continue;
        }
        if store.pushes().replay_delivery(&task_ref, now).await? {
            out.replayed.push(task_ref.to_string());
        } else {
            out.skipped.push((
                raw.clone(),
                "no push to replay (no callback URL, the task is still open, or its push is already due)".into(),
            ));
        }
    }
    Ok(out)
}

/// Replays every push parked between `from` and `to`, at most `max`.
pub async fn replay_parked(
    store: &TaskStore,
    from: Timestamp,
    to: Timestamp,
    max: usize,
    now: Timestamp,
) -> Result<Replayed, StoreError> {
    let refs: Vec<String> =
        store.pushes().parked_deliveries(from, to, max).await?.into_iter().map(|p| p.task_ref.to_string()).collect();
    replay_tasks(store, &refs, now).await
}

/// `deliveries list` as a table.
pub fn render_table(rows: &[Parked]) -> String {
    let mut s = format!("{:<37} {:<25} {:>8}  {:<30} {}\n", "TASK", "PARKED AT", "ATTEMPTS", "HOST", "LAST OUTCOME");
    for r in rows {
        s.push_str(&format!(
            "{:<37} {:<25} {:>8}  {:<30} {}\n",
            r.task_ref, r.parked_at, r.attempts, r.host, r.last_outcome
        ));
    }
    s
}

/// A time given as RFC 3339 (`2026-12-04T07:00:00Z`) or as a span ago (`90m`, `24h`, `7d`).
pub fn parse_time(text: &str, now: Timestamp) -> Result<Timestamp, String> {
    let t = text.trim();
    if let Ok(d) = humantime::parse_duration(t) {
        return Ok(now.minus(d));
    }
    humantime::parse_rfc3339_weak(t)
        .ok()
        .and_then(|st| st.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| Timestamp::from_millis(u64::try_from(d.as_millis()).unwrap_or(u64::MAX)))
        .ok_or_else(|| format!("`{t}` is neither a time like 2026-12-04T07:00:00Z nor a span ago like 24h"))
}

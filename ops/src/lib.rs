//! What the operator command does, as functions the tests drive.
//!
//! Moving is receive → send → delete, one message at a time: a message is deleted from the
//! source only after the target accepted it, so an interrupted move loses nothing. The one
//! window — sent but not yet deleted — leaves a second copy behind, which re-applies as a
//! duplicate and changes nothing (the write is idempotent).

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

/// Relay keys: the `key` that 2captcha-style clients send to the compat routes (`/in.php`,
/// `/res.php`). The table holds only each key's SHA-256 digest; a key is shown once, when made.
pub mod keys {
    use std::fmt;

    use relay_shared::domain::PingbackForm;
    use relay_shared::store::{KeyInfo, RelayKeys, StoreError, TaskStore};
    use relay_shared::time::Timestamp;
    use secrecy::{ExposeSecret, SecretString};
    use sha2::{Digest, Sha256};

    /// Hex digits of a key's digest shown by `keys list` (enough to tell keys apart, and to
    /// pass to `keys revoke --digest`).
    pub const SHOWN_DIGITS: usize = 12;
    /// Fewest hex digits `keys revoke --digest` takes.
    pub const MIN_PREFIX: usize = 6;

    /// Why a key command did nothing.
    #[derive(Debug)]
    pub enum KeysError {
        /// The task table failed or refused.
        Store(StoreError),
        /// A key name that the table would refuse.
        BadName(String),
        /// A `--digest` that is not 6 to 64 hex digits.
        BadPrefix(String),
        /// Nothing to revoke: the text says what was looked for and what exists.
        NoneMatched(String),
        /// A `--digest` prefix shared by several live keys of the name.
        Ambiguous { name: String, prefix: String, digests: Vec<String> },
    }

    impl fmt::Display for KeysError {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match self {
                Self::Store(e) => write!(f, "{e}"),
                Self::BadName(n) => {
                    write!(f, "key name `{n}` must be 1 to 64 characters of letters, digits, `_`, `.` and `-`")
                }
                Self::BadPrefix(p) => write!(
                    f,
                    "--digest `{p}` must be {MIN_PREFIX} to 64 hex digits of the key's digest (as `relay-ops keys list` shows it)"
                ),
                Self::NoneMatched(why) => write!(f, "nothing revoked: {why}"),
                Self::Ambiguous { name, prefix, digests } => write!(
                    f,
                    "nothing revoked: {} live keys named `{name}` have digests starting with `{prefix}` ({}); give more digits",
                    digests.len(),
                    digests.join(", ")
                ),
            }
        }
    }

    impl std::error::Error for KeysError {}

    impl From<StoreError> for KeysError {
        fn from(e: StoreError) -> Self {
            Self::Store(e)
        }
    }

    /// The same rule the store applies, checked first for a plain message.
    pub fn valid_name(name: &str) -> bool {
        !name.is_empty()
            && name.len() <= 64
            && name.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    }

    /// A `--digest` argument as the table spells digests (lower-case hex), or why it is refused.
    pub fn digest_prefix(raw: &str) -> Result<String, KeysError> {
        let p = raw.trim().to_ascii_lowercase();
        if (MIN_PREFIX..=64).contains(&p.len()) && p.bytes().all(|b| b.is_ascii_hexdigit()) {
            Ok(p)
        } else {
            Err(KeysError::BadPrefix(raw.to_owned()))
        }
    }

    /// A key's SHA-256 in lower-case hex: what the table holds for it.
    pub fn digest_of(key: &SecretString) -> String {
        format!("{:x}", Sha256::digest(key.expose_secret().as_bytes()))
    }

    /// A new key: the key itself (to print once) and its digest (to name it later).
    pub struct Created {
        pub key: SecretString,
        pub digest: String,
    }

    impl fmt::Debug for Created {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("Created").field("digest", &self.digest).finish_non_exhaustive()
        }
    }

    impl Created {
        /// What to tell the operator besides the key (on stderr, so stdout is the key alone).
        pub fn hint(&self, name: &str) -> String {
            let short = &self.digest[..SHOWN_DIGITS.min(self.digest.len())];
            format!(
                "relay key `{name}` created (digest {short}). It is shown only this once: the table keeps \
                 its SHA-256 digest, never the key. Clients send it as `key` to /in.php and /res.php. \
                 Revoke it with `relay-ops keys revoke {name} --digest {short}`."
            )
        }
    }

    /// Makes a key named `name` whose tasks' results go to their `pingback` in `pingback` form.
    pub async fn create(
        store: &TaskStore,
        name: &str,
        pingback: PingbackForm,
        now: Timestamp,
    ) -> Result<Created, KeysError> {
        if !valid_name(name) {
            return Err(KeysError::BadName(name.to_owned()));
        }
        let key = store.create_relay_key_with(name, pingback, now).await?;
        let digest = digest_of(&key);
        Ok(Created { key, digest })
    }

    /// Sets the pingback form of every live key named `name`; an error if none is live.
    pub async fn set_pingback(store: &TaskStore, name: &str, pingback: PingbackForm) -> Result<usize, KeysError> {
        match store.set_relay_key_pingback(name, pingback).await? {
            0 => Err(KeysError::NoneMatched(format!("no live relay key is named `{name}`"))),
            n => Ok(n),
        }
    }

    /// A stored key as `keys list` shows it: never the key, only the start of its digest.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Row {
        pub name: String,
        pub digest_prefix: String,
        pub created_at: Option<Timestamp>,
        pub revoked_at: Option<Timestamp>,
        pub pingback: PingbackForm,
    }

    impl From<&KeyInfo> for Row {
        fn from(k: &KeyInfo) -> Self {
            Self {
                name: k.name.clone(),
                digest_prefix: k.digest.chars().take(SHOWN_DIGITS).collect(),
                created_at: k.created_at,
                revoked_at: k.revoked_at,
                pingback: k.pingback,
            }
        }
    }

    /// Every key, live and revoked, oldest first.
    pub async fn list(store: &TaskStore) -> Result<Vec<Row>, KeysError> {
        Ok(store.list_relay_keys().await?.iter().map(Row::from).collect())
    }

    fn when(t: Option<Timestamp>) -> String {
        t.map_or_else(|| "-".to_owned(), |t| t.to_rfc3339())
    }

    /// The rows as an aligned table with a header.
    pub fn render_table(rows: &[Row]) -> String {
        let header = ["NAME", "DIGEST", "PINGBACK", "CREATED", "REVOKED"];
        let cells: Vec<[String; 5]> = rows
            .iter()
            .map(|r| {
                [
                    r.name.clone(),
                    r.digest_prefix.clone(),
                    r.pingback.as_str().to_owned(),
                    when(r.created_at),
                    when(r.revoked_at),
                ]
            })
            .collect();
        let mut width = header.map(str::len);
        for c in &cells {
            for (w, v) in width.iter_mut().zip(c) {
                *w = (*w).max(v.len());
            }
        }
        let line = |c: [&str; 5]| {
            let [a, b, p, d, e] = c;
            format!(
                "{a:<w0$}  {b:<w1$}  {p:<w2$}  {d:<w3$}  {e}",
                w0 = width[0],
                w1 = width[1],
                w2 = width[2],
                w3 = width[3]
            )
            .trim_end()
            .to_owned()
        };
        let mut out = line(header);
        out.push('\n');
        for c in &cells {
            out.push_str(&line([&c[0], &c[1], &c[2], &c[3], &c[4]]));
            out.push('\n');
        }
        out
    }

    /// The rows as a JSON array (times in RFC 3339, `null` when absent).
    pub fn render_json(rows: &[Row]) -> serde_json::Value {
        serde_json::Value::Array(
            rows.iter()
                .map(|r| {
                    serde_json::json!({
                        "name": r.name,
                        "digest_prefix": r.digest_prefix,
                        "created_at": r.created_at.map(Timestamp::to_rfc3339),
                        "revoked_at": r.revoked_at.map(Timestamp::to_rfc3339),
                        "live": r.revoked_at.is_none(),
                        "pingback": r.pingback.as_str(),
                    })
                })
                .collect(),
        )
    }

    /// Revokes the live keys named `name`, or only the one whose digest starts with `prefix`
    /// (at least [`MIN_PREFIX`] hex digits; a prefix shared by several live keys is refused).
    /// Returns how many were revoked; revoking nothing is an error saying why.
    pub async fn revoke(
        store: &TaskStore,
        name: &str,
        prefix: Option<&str>,
        now: Timestamp,
    ) -> Result<usize, KeysError> {
        let prefix = prefix.map(digest_prefix).transpose()?;
        let all = store.list_relay_keys().await?;
        let named: Vec<&KeyInfo> = all.iter().filter(|k| k.name == name).collect();
        let live: Vec<&KeyInfo> = named
            .iter()
            .copied()
            .filter(|k| k.revoked_at.is_none() && prefix.as_deref().is_none_or(|p| k.digest.starts_with(p)))
            .collect();
        if live.is_empty() {
            let why = if named.is_empty() {
                format!("no relay key is named `{name}` (see `relay-ops keys list`)")
            } else if let Some(p) = &prefix {
                format!("no live key named `{name}` has a digest starting with `{p}` (see `relay-ops keys list`)")
            } else {
                format!("every key named `{name}` is already revoked")
            };
            return Err(KeysError::NoneMatched(why));
        }
        if let Some(p) = &prefix
            && live.len() > 1
        {
            return Err(KeysError::Ambiguous {
                name: name.to_owned(),
                prefix: p.clone(),
                digests: live.iter().map(|k| k.digest.chars().take(SHOWN_DIGITS + 4).collect()).collect(),
            });
        }
        let n = store.revoke_relay_keys(name, prefix.as_deref(), now).await?;
        if n == 0 {
            // Revoked by someone else between the listing and the write.
            return Err(KeysError::NoneMatched(format!("the matching key named `{name}` was revoked meanwhile")));
        }
        Ok(n)
    }

    /// What to tell the operator after a revoke.
    pub fn revoked_message(n: usize, name: &str) -> String {
        format!(
            "revoked {n} key(s) named `{name}`; running API functions stop accepting it within {} s (their cache)",
            RelayKeys::CACHE_FOR.as_secs()
        )
    }
}

/// `relay-ops queue`: the submit queue as the table holds it.
pub mod queue {
    use relay_shared::store::TaskStore;
    use relay_shared::submit::window::{Gate, Window, WindowSettings, WindowState};
    use relay_shared::time::Timestamp;

    /// What `relay-ops queue` prints: depth per lane and its oldest task's wait, the submitter's
    /// lease, its learnt window, the inline permits and the release rate.
    pub async fn report(store: &TaskStore, now: Timestamp) -> anyhow::Result<String> {
        let st = store.submit_state().await?;
        let mut out = format!("queued: {} in {} lane(s)\n", st.queued, st.lanes.len());
        for (lane, n) in &st.lanes {
            let oldest = store.queue_heads(lane, 1).await?.first().map(|h| now.since(h.queued_at).as_secs());
            let class = if lane.ends_with(".i") { "images" } else { "tokens" };
            match oldest {
                Some(secs) => out.push_str(&format!("  lane {lane} ({class}): {n} waiting, the oldest for {secs} s\n")),
                None => out.push_str(&format!(
                    "  lane {lane} ({class}): counted {n}, none listed (set right by the next run)\n"
                )),
            }
        }
        match (&st.releaser, st.releaser_until) {
            (Some(who), Some(until)) if st.releaser_live(now) => {
                out.push_str(&format!("submitter: running ({who}, lease {} s left)\n", until.since(now).as_secs()))
            }
            _ => out.push_str("submitter: not running (woken when a task is queued, and every minute)\n"),
        }
        let saved: Option<WindowState> = st.window.as_deref().and_then(|w| serde_json::from_str(w).ok());
        match &saved {
            Some(state) => {
                let w = Window::restore(WindowSettings::default(), Some(state));
                let held = match w.gate(u32::MAX, now) {
                    Gate::Hold(until) => format!(", sends held {} s more", until.since(now).as_secs()),
                    _ => String::new(),
                };
                let full = match state.full_at {
                    Some(level) => format!(
                        "full at {level} in work {} s ago",
                        now.since(Timestamp::from_millis(state.full_seen_ms)).as_secs()
                    ),
                    None => "no \"no slot\" answer seen: growing".to_owned(),
                };
                out.push_str(&format!(
                    "window: {} tasks in work at once ({full}; {} \"no slot\" answer(s) in the last minute{held})\n",
                    w.limit(now),
                    w.no_slots_last_minute(now)
                ));
            }
            None => out.push_str("window: not learnt yet (no submitter has run)\n"),
        }
        out.push_str(&format!(
            "inline permits: {}\nreleased in the last minute: {}\ninline \"no slot\" answers: {} ({} taken into the window)\n",
            st.permits.map_or("none published yet".to_owned(), |p| p.max(0).to_string()),
            st.released_per_minute,
            st.api_no_slots,
            st.api_no_slots_seen
        ));
        if let Some(until) = st.breaker.open_for_submits_at(now) {
            out.push_str(&format!(
                "CaptchaAI traffic stopped until {until} ({}): nothing is released before (`relay-ops breaker show`)\n",
                st.breaker.reason.as_deref().unwrap_or("?")
            ));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use relay_shared::testkit::LocalDynamo;
    use relay_shared::time::Timestamp;
    use secrecy::ExposeSecret;

    use super::keys::{self, KeysError};

    const T0: Timestamp = Timestamp::from_millis(1_796_210_146_000);

    #[tokio::test]
    async fn keys_are_created_listed_without_the_key_and_revoked() -> anyhow::Result<()> {
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        assert!(keys::list(&store).await?.is_empty());

        let get = relay_shared::domain::PingbackForm::Get;
        let a = keys::create(&store, "scraper", get, T0).await?;
        let b = keys::create(&store, "scraper", get, T0.plus(Duration::from_secs(1))).await?;
        let c = keys::create(&store, "ci", relay_shared::domain::PingbackForm::Post, T0.plus(Duration::from_secs(2)))
            .await?;
        let key = a.key.expose_secret();
        assert_eq!(key.len(), 32);
        assert!(key.bytes().all(|x| x.is_ascii_hexdigit()));
        assert_eq!(a.digest.len(), 64);
        assert!(!a.hint("scraper").contains(key), "the hint never repeats the key");
        assert!(a.hint("scraper").contains(&a.digest[..keys::SHOWN_DIGITS]));

        let rows = keys::list(&store).await?;
        assert_eq!(rows.len(), 3);
        assert_eq!(rows[0].name, "scraper");
        assert_eq!(rows[0].digest_prefix, a.digest[..keys::SHOWN_DIGITS]);
        assert_eq!(rows[0].created_at, Some(T0));
        assert!(rows.iter().all(|r| r.revoked_at.is_none()));
        let table = keys::render_table(&rows);
        let json = keys::render_json(&rows).to_string();
        for shown in [&table, &json] {
            for k in [&a, &b, &c] {
                assert!(!shown.contains(k.key.expose_secret()), "a key was shown: {shown}");
                assert!(!shown.contains(&k.digest), "a whole digest was shown: {shown}");
                assert!(shown.contains(&k.digest[..keys::SHOWN_DIGITS]));
            }
        }
        assert!(table.starts_with("NAME"));
        assert_eq!(table.lines().count(), 4);
        assert!(table.contains("2026-12-02T11:15:46.000Z"), "{table}");
        assert_eq!(keys::render_json(&rows)[2]["name"], "ci");
        assert_eq!(keys::render_json(&rows)[2]["pingback"], "post", "a key for 2captcha code");
        assert_eq!(keys::render_json(&rows)[0]["pingback"], "get", "CaptchaAI's form by default");
        assert_eq!(keys::render_json(&rows)[0]["live"], true);
        assert_eq!(keys::render_json(&rows)[0]["revoked_at"], serde_json::Value::Null);

        // Rotation: revoke only `a`, by its digest prefix (upper case is fine); `b` stays live.
        let t1 = T0.plus(Duration::from_secs(60));
        let prefix = a.digest[..keys::MIN_PREFIX].to_ascii_uppercase();
        assert_eq!(keys::revoke(&store, "scraper", Some(&prefix), t1).await?, 1);
        let rows = keys::list(&store).await?;
        assert_eq!(rows[0].revoked_at, Some(t1));
        assert_eq!(rows[1].revoked_at, None);
        assert_eq!(keys::render_json(&rows)[0]["live"], false);
        assert!(keys::render_table(&rows).contains("2026-12-02T11:16:46.000Z"));
        // Revoking it again: nothing live matches.
        let again = keys::revoke(&store, "scraper", Some(&prefix), t1).await;
        assert!(matches!(&again, Err(KeysError::NoneMatched(m)) if m.contains("digest starting with")), "{again:?}");

        // By name: the remaining live `scraper` key, not `ci`.
        assert_eq!(keys::revoke(&store, "scraper", None, t1).await?, 1);
        let all_revoked = keys::revoke(&store, "scraper", None, t1).await;
        assert!(matches!(&all_revoked, Err(KeysError::NoneMatched(m)) if m.contains("already revoked")));
        let rows = keys::list(&store).await?;
        assert!(rows.iter().filter(|r| r.name == "scraper").all(|r| r.revoked_at.is_some()));
        assert!(rows.iter().any(|r| r.name == "ci" && r.revoked_at.is_none()));

        // Unknown names and bad arguments are errors that revoke nothing.
        let unknown = keys::revoke(&store, "nobody", None, t1).await;
        assert!(matches!(&unknown, Err(KeysError::NoneMatched(m)) if m.contains("no relay key is named `nobody`")));
        let wrong_name = keys::revoke(&store, "scraper", Some(&c.digest[..8]), t1).await;
        assert!(matches!(wrong_name, Err(KeysError::NoneMatched(_))), "`ci`'s digest under another name");
        for bad in ["abc12", "not-hex", "", &"a".repeat(65)] {
            assert!(matches!(keys::revoke(&store, "ci", Some(bad), t1).await, Err(KeysError::BadPrefix(_))), "{bad}");
        }
        assert!(matches!(keys::create(&store, "bad name", get, T0).await, Err(KeysError::BadName(_))));
        assert!(matches!(keys::create(&store, "", get, T0).await, Err(KeysError::BadName(_))));
        assert_eq!(keys::set_pingback(&store, "ci", get).await?, 1);
        assert_eq!(keys::render_json(&keys::list(&store).await?)[2]["pingback"], "get");
        assert!(
            matches!(keys::set_pingback(&store, "scraper", get).await, Err(KeysError::NoneMatched(_))),
            "all revoked"
        );
        assert!(keys::list(&store).await?.iter().any(|r| r.name == "ci" && r.revoked_at.is_none()), "ci untouched");
        Ok(())
    }

    #[tokio::test]
    async fn a_prefix_shared_by_two_live_keys_revokes_neither() -> anyhow::Result<()> {
        use aws_sdk_dynamodb::types::AttributeValue;
        let db = LocalDynamo::start().await?;
        let store = db.fresh_store().await?;
        // Two digests sharing their first 8 digits (random keys would almost never), stored the
        // way `create_relay_key` stores them.
        for (digest, at) in
            [("0123abcd".to_owned() + &"1".repeat(56), 1u64), ("0123abcd".to_owned() + &"2".repeat(56), 2)]
        {
            db.client()
                .put_item()
                .table_name(store.table())
                .item("pk", AttributeValue::S(format!("relaykey#{digest}")))
                .item("key_name", AttributeValue::S("fleet".into()))
                .item("created_at", AttributeValue::N(at.to_string()))
                .send()
                .await?;
        }
        let r = keys::revoke(&store, "fleet", Some("0123abcd"), T0).await;
        assert!(matches!(&r, Err(KeysError::Ambiguous { digests, .. }) if digests.len() == 2), "{r:?}");
        assert!(r.map_err(|e| e.to_string()).err().is_some_and(|m| m.contains("give more digits")));
        assert!(keys::list(&store).await?.iter().all(|k| k.revoked_at.is_none()), "neither was revoked");
        assert_eq!(keys::revoke(&store, "fleet", Some("0123ABCD1"), T0).await?, 1);
        let rows = keys::list(&store).await?;
        assert_eq!(rows.iter().filter(|k| k.revoked_at.is_some()).count(), 1);
        assert_eq!(rows[0].revoked_at, Some(T0), "the one whose digest starts 0123abcd1");
        Ok(())
    }
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
mod shard_tests {
    #[test]
    fn the_shards_report_says_when_the_previous_count_can_go() {
        let rows = [(0, 3, 1), (1, 0, 0), (5, 2, 0)];
        let r = super::shards_report(&rows, Some(4));
        assert!(r.contains("2 entries at or above shard 4"), "{r}");
        assert!(!r.contains("\n    1 "), "empty shards are left out: {r}");
        let r = super::shards_report(&rows[..2], Some(4));
        assert!(r.contains("can go back to 0"), "{r}");
    }
}

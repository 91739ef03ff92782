//! What an invocation's loop and its reads share ([`Shared`]: the breaker as this invocation
//! sees it, whether batch reads work), opening the breaker for everyone, and the run of missing
//! answers that opens it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

use relay_shared::captchaai::CaptchaAiError;
use relay_shared::codes::ban;
use relay_shared::store::Stop;
use relay_shared::time::{Clock, Timestamp};

use crate::Deps;

/// State shared by an invocation's main loop and its reads.
#[derive(Debug, Default)]
pub(crate) struct Shared {
    /// The breaker as this invocation knows it (epoch ms; 0 = closed).
    pub(crate) open_until: AtomicU64,
    /// Answers missing in a row (timeouts, 5xx, HTML).
    pub(crate) failures: AtomicU32,
    pub(crate) batch_unsupported: AtomicBool,
    pub(crate) opened_by: std::sync::Mutex<Option<String>>,
}

impl Shared {
    pub(crate) fn open_at(&self, now: Timestamp) -> Option<Timestamp> {
        let until = self.open_until.load(Ordering::SeqCst);
        (until > now.as_millis()).then_some(Timestamp::from_millis(until))
    }
}

/// Opens the breaker here at once (no new read starts in this invocation) and for everyone.
pub(crate) async fn open_breaker(
    deps: &Deps,
    shared: &Shared,
    until: Timestamp,
    reason: &str,
    stop: Stop,
    now: Timestamp,
) {
    shared.open_until.fetch_max(until.as_millis(), Ordering::SeqCst);
    if let Ok(mut by) = shared.opened_by.lock() {
        by.get_or_insert_with(|| reason.to_owned());
    }
    metrics::counter!("breaker_opened", "reason" => breaker_reason_label(reason)).increment(1);
    tracing::warn!(event = "breaker_opened", reason, until = %until, ?stop, "CaptchaAI traffic stopped");
    if let Err(e) = deps.store.account.open_breaker(until, reason, stop, now).await {
        // This invocation still stops; others learn of the ban from their own first answer.
        tracing::error!(event = "breaker_store_failed", error = %e);
    }
}

/// A small, fixed set of metric labels (codes vary).
fn breaker_reason_label(reason: &str) -> &'static str {
    match reason {
        r if r.starts_with("ERROR: 100") => "account_suspended",
        "IP_BANNED" => "ip_banned",
        "MAX_USER_TURN" => "max_user_turn",
        r if ban(r).is_some_and(|b| b.needs_operator) => "key_rejected",
        _ => "no_answers",
    }
}

/// Counts one request's outcome: an answer ends a run of failures; a missing answer (timeout,
/// 5xx, HTML) extends it, and a run long enough opens the breaker for a while.
pub(crate) async fn note_answer(deps: &Deps, clock: &Arc<dyn Clock>, shared: &Shared, err: Option<&CaptchaAiError>) {
    let s = &deps.settings;
    match err {
        None | Some(CaptchaAiError::Code(_)) => shared.failures.store(0, Ordering::SeqCst),
        Some(e) => {
            let run = shared.failures.fetch_add(1, Ordering::SeqCst) + 1;
            let now = clock.now();
            if run >= s.failures_to_open && shared.open_at(now).is_none() {
                let reason = format!("{} answers missing in a row ({})", run, e.code());
                open_breaker(deps, shared, now.plus(s.failure_pause), &reason, Stop::NoAnswers, now).await;
            }
        }
    }
}

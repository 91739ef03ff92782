//! The delivery worker and one push: claimed under a lease, its result pinned, its host's turn
//! awaited, sent, and its outcome recorded (a failure retried on [`schedule`]'s terms).

use std::sync::Arc;
use std::time::Duration;

use super::hosts::{self, HostGates};
use super::inbox::Wakeups;
use super::keys::KeySource;
use super::payload::payload;
use super::report::Attempt;
use super::schedule;
use super::settings::DeliverySettings;
use super::signal::signal_of;
use crate::domain::{Task, TaskRef, TaskState};
use crate::store::deliveries::DEFAULT_OWNER;
use crate::store::{DeliveryFinish, DueDelivery, Pushes, Results, StoreError, TaskStore};
use crate::time::{Clock, Timestamp};
use crate::webhook::{AttemptResult, Outgoing, Sender};

/// The worker.
pub struct Deliverer {
    /// The pushes: claims, outcomes, host slots (GetItem, UpdateItem; Query on `due-for-delivery`).
    pub pushes: Pushes,
    /// The result a push shows its owner, pinned (UpdateItem).
    pub results: Results,
    pub sender: Sender,
    pub keys: KeySource,
    pub settings: DeliverySettings,
    /// Names this worker's leases (unique per process).
    pub worker: String,
    /// The per-host gates (their state is logged and measured).
    pub hosts: HostGates,
    wakeups: Option<Arc<dyn Wakeups>>,
}

impl std::fmt::Debug for Deliverer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deliverer").field("worker", &self.worker).field("settings", &self.settings).finish()
    }
}

impl Deliverer {
    pub fn new(store: TaskStore, keys: KeySource, settings: DeliverySettings) -> anyhow::Result<Self> {
        Ok(Self {
            // The request's time limit is kept on the worker's clock (so a simulation charges
            // it); the client's own is a backstop behind it.
            sender: Sender::new(settings.policy, settings.timeout + Duration::from_secs(30))?,
            pushes: store.pushes(),
            results: store.results(),
            keys,
            settings,
            worker: format!("dlv-{}", uuid::Uuid::new_v4().simple()),
            hosts: HostGates::default(),
            wakeups: None,
        })
    }

    /// The same worker, telling `w` when a push it put off falls due.
    #[must_use]
    pub fn with_wakeups(mut self, w: Arc<dyn Wakeups>) -> Self {
        self.wakeups = Some(w);
        self
    }

    /// Claims one due push, waits for its host's turn, sends it, and records the outcome.
    pub async fn deliver(&self, due: &DueDelivery, clock: &dyn Clock) -> Result<Attempt, StoreError> {
        let now = clock.now();
        let lease_until = now.plus(self.settings.lease());
        let Some(mut task) = self.pushes.claim_delivery(due, &self.worker, lease_until).await? else {
            return Ok(Attempt::Lost);
        };
        let finish = |f: DeliveryFinish| async move {
            self.pushes.finish_delivery(&due.task_ref, &self.worker, lease_until, &f, clock.now()).await
        };
        let (Some(url), Some(id)) = (task.owner_callback.clone(), task.webhook_id()) else {
            // An open task in the index: nothing to push yet. Not reachable through the store's
            // writes; say so and leave it.
            finish(DeliveryFinish::Parked { outcome: "the task has no result to push".into() }).await?;
            return Ok(Attempt::Parked { refused: false });
        };
        let state = task.delivery.clone().unwrap_or_default();
        if state.delivered_id.as_deref() == Some(id.as_str()) {
            return Ok(if finish(DeliveryFinish::AlreadyDelivered { id }).await? {
                Attempt::AlreadyDelivered
            } else {
                Attempt::Lost
            });
        }
        // Claims that ended without an outcome (the worker died each time).
        let lost = state.attempts.saturating_sub(1 + state.failures.total());
        if lost >= schedule::LOST_ATTEMPTS_LIMIT {
            let outcome = format!("{lost} attempts were lost without an outcome (the worker stopped during each)");
            return Ok(if finish(DeliveryFinish::Parked { outcome }).await? {
                Attempt::Parked { refused: false }
            } else {
                Attempt::Lost
            });
        }
        // A pushed result is a result shown: pin it, as GET does, so it never changes after.
        if task.needs_pin(now) {
            match self.results.mark_handed_out(&task, now).await? {
                None => task.handed_out_at = Some(now),
                // A result received earlier replaced it meanwhile; that write made a new push
                // due (and took this lease): it goes out instead.
                Some(_) => return Ok(Attempt::Lost),
            }
        }
        let owner = task.webhook_owner.clone().unwrap_or_else(|| DEFAULT_OWNER.to_owned());
        let keys = self.keys.keys(&owner).await?;
        let host = url::Url::parse(&url)
            .ok()
            .and_then(|u| u.host_str().map(|h| format!("{h}:{}", u.port_or_known_default().unwrap_or(0))))
            .unwrap_or_default();
        let dies = task.token_dies_at();
        let recorded = resolved_at(&task).unwrap_or(now);
        let fresh_at_record = dies.is_some_and(|d| recorded < d);
        // Its place in the host's queue: when what it carries dies.
        let rank = match dies {
            Some(d) if now < d => d,
            _ => due.due_at.plus(hosts::NO_DEADLINE_SLACK),
        };
        let latest_start = self.settings.latest_start(lease_until);
        let gate = self.hosts.gate(&host);
        let Some(permit) = gate.acquire(&self.pushes, rank, latest_start, clock, &self.settings).await else {
            // No turn in time for this claim: given back, its attempt uncounted, due a moment
            // later.
            let at = clock.now().plus(Duration::from_secs(1));
            if !finish(DeliveryFinish::Deferred { at }).await? {
                return Ok(Attempt::Lost);
            }
            self.wake(&due.task_ref, at, clock.now()).await;
            return Ok(Attempt::Deferred);
        };
        if permit.not_before > clock.now() {
            clock.sleep_until(permit.not_before).await;
        }
        let sent_at = clock.now();
        // Built as it leaves: a token that died while it waited for its turn is not in it.
        let push = payload(&task, &url, sent_at);
        let out = Outgoing {
            url: &push.url,
            method: push.method,
            msg_id: &id,
            timestamp: sent_at.as_secs(),
            content_type: push.content_type,
            body: push.body,
            keys: &keys,
        };
        let result = {
            let _io = clock.io();
            tokio::select! {
                r = self.sender.send(&out) => r,
                () = clock.sleep_until(sent_at.plus(self.settings.timeout)) => {
                    AttemptResult::Retry { status: None, error: "timed out".into(), retry_after: None }
                }
            }
        };
        gate.release(permit, &self.pushes, signal_of(&result), clock, &self.settings).await;
        let now = clock.now();
        let attempts = state.attempts;
        let after_death = fresh_at_record && dies.is_some_and(|d| sent_at >= d);
        let token_died = after_death && state.failures.standard == 0;
        if token_died {
            tracing::warn!(event = "delivery_token_died", task_ref = %task.task_ref, recorded = %recorded, attempts);
        }
        let mut wake_at = None;
        let (f, attempt) = match result {
            AttemptResult::Delivered { status } => {
                let latency_ms = now.as_millis().saturating_sub(recorded.as_millis());
                let life_left_ms = dies.filter(|d| sent_at < *d).map(|d| d.since(sent_at).as_millis() as u64);
                (
                    DeliveryFinish::Delivered { id, outcome: format!("HTTP {status}") },
                    Attempt::Delivered { latency_ms, life_left_ms, after_death, token_died },
                )
            }
            AttemptResult::Retry { status, error, retry_after } => {
                let outcome = match status {
                    Some(s) => format!("HTTP {s}: {error}"),
                    None => error,
                };
                let failed = schedule::Failed { sent_at, ended_at: now, retry_after };
                match schedule::after_failure(dies, &failed, state.failures, self.settings.max_attempts, jitter()) {
                    schedule::Next::Retry { at, failures, .. } => {
                        wake_at = Some(at);
                        (DeliveryFinish::Retry { at, outcome, failures }, Attempt::Retried { token_died })
                    }
                    schedule::Next::Park => (
                        DeliveryFinish::Parked { outcome: format!("{attempts} attempts failed, the last: {outcome}") },
                        Attempt::Parked { refused: false },
                    ),
                }
            }
            AttemptResult::Gone => (DeliveryFinish::Gone { outcome: "HTTP 410".into() }, Attempt::Gone),
            AttemptResult::Refused { reason } => {
                tracing::warn!(event = "delivery_refused", task_ref = %task.task_ref, reason);
                (DeliveryFinish::Parked { outcome: format!("refused: {reason}") }, Attempt::Parked { refused: true })
            }
        };
        tracing::info!(event = "delivery_attempt", task_ref = %task.task_ref, webhook_id = %webhook_id_of(&f), attempts, outcome = ?attempt);
        if !finish(f).await? {
            return Ok(Attempt::Lost);
        }
        if let Some(at) = wake_at {
            self.wake(&due.task_ref, at, now).await;
        }
        Ok(attempt)
    }

    async fn wake(&self, task_ref: &TaskRef, at: Timestamp, now: Timestamp) {
        if let Some(w) = &self.wakeups {
            w.due_at(DueDelivery { task_ref: task_ref.clone(), due_at: at }, now).await;
        }
    }
}

fn webhook_id_of(f: &DeliveryFinish) -> &str {
    match f {
        DeliveryFinish::Delivered { id, .. } | DeliveryFinish::AlreadyDelivered { id } => id,
        _ => "",
    }
}

fn resolved_at(task: &Task) -> Option<Timestamp> {
    match &task.state {
        TaskState::Solved { resolved_at, .. } | TaskState::Failed { resolved_at, .. } => Some(*resolved_at),
        TaskState::Expired { late: Some(l), .. } => Some(l.received_at),
        TaskState::Expired { resolved_at, .. } => Some(*resolved_at),
        _ => None,
    }
}

/// A number in [0, 1) for the retry schedule's jitter.
fn jitter() -> f64 {
    crate::retry::unit_random()
}

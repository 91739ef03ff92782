//! What came of pushes: how one claimed push ended ([`Attempt`]), and the counts of a sweep, a
//! batch or a stretch of the worker loop ([`SweepReport`]) with the metrics they make.

use serde::Serialize;

/// What one sweep (or stream batch, or a stretch of the worker loop) did.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize)]
pub struct SweepReport {
    pub delivered: u64,
    pub already_delivered: u64,
    pub retried: u64,
    pub parked: u64,
    pub gone: u64,
    pub refused: u64,
    /// Claims another worker or a newer result won, and pushes given back for a later turn.
    pub lost: u64,
    pub errors: u64,
    /// Pushes of a result that was fresh when recorded whose token died before the owner's
    /// endpoint took it (the first expired notice sent instead). Should be 0.
    pub token_died: u64,
    /// Of those, the ones the owner's endpoint then took (an expired notice delivered).
    pub delivered_after_death: u64,
    /// Seconds since the oldest push still owed fell due (0 when none is owed).
    pub oldest_due_secs: u64,
    /// Milliseconds from the result's record to its delivery, per delivered push.
    #[serde(skip)]
    pub latencies_ms: Vec<u64>,
    /// Milliseconds of life its token had left when a push carrying one was sent and taken.
    #[serde(skip)]
    pub life_left_ms: Vec<u64>,
}

impl SweepReport {
    /// Counts one push's outcome.
    pub fn add(&mut self, o: &Attempt) {
        match o {
            Attempt::Delivered { latency_ms, life_left_ms, after_death, token_died } => {
                self.delivered += 1;
                self.latencies_ms.push(*latency_ms);
                self.life_left_ms.extend(life_left_ms);
                self.delivered_after_death += u64::from(*after_death);
                self.token_died += u64::from(*token_died);
            }
            Attempt::AlreadyDelivered => self.already_delivered += 1,
            Attempt::Retried { token_died } => {
                self.retried += 1;
                self.token_died += u64::from(*token_died);
            }
            Attempt::Parked { refused } => {
                self.parked += 1;
                self.refused += u64::from(*refused);
            }
            Attempt::Gone => self.gone += 1,
            Attempt::Lost | Attempt::Deferred => self.lost += 1,
        }
    }

    /// The metrics the template's alarms and dashboard read.
    pub fn emit(&self) {
        metrics::counter!("deliveries_delivered").increment(self.delivered);
        metrics::counter!("deliveries_retried").increment(self.retried);
        metrics::counter!("deliveries_parked").increment(self.parked);
        metrics::counter!("deliveries_gone").increment(self.gone);
        metrics::counter!("deliveries_refused").increment(self.refused);
        metrics::counter!("delivery_errors").increment(self.errors);
        metrics::counter!("delivery_token_died").increment(self.token_died);
        metrics::counter!("deliveries_after_token_death").increment(self.delivered_after_death);
        metrics::gauge!("oldest_delivery_due_seconds").set(self.oldest_due_secs as f64);
        for ms in &self.latencies_ms {
            metrics::histogram!("delivery_latency_ms").record(*ms as f64);
        }
        for ms in &self.life_left_ms {
            metrics::histogram!("delivery_token_life_left_ms").record(*ms as f64);
        }
    }
}

/// How one claimed push ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Attempt {
    Delivered {
        /// From the result's record to the owner's 2xx.
        latency_ms: u64,
        /// The token's life left when it was sent, for a push that carried one.
        life_left_ms: Option<u64>,
        /// An expired notice, for a result that was fresh when recorded.
        after_death: bool,
        /// The first attempt after its token died (see [`SweepReport::token_died`]).
        token_died: bool,
    },
    AlreadyDelivered,
    Retried {
        token_died: bool,
    },
    Parked {
        refused: bool,
    },
    Gone,
    /// Another worker, or a newer result, got there first.
    Lost,
    /// Its host's turn came too late for the claim: given back, due again a moment later.
    Deferred,
}

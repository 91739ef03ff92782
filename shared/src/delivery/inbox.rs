//! How a worker hears of pushes due now or later: the [`Wakeups`] it tells of a push it put
//! off, and local mode's [`Inbox`], which the store and the worker itself write to.

use std::sync::Arc;

use tokio::sync::mpsc;

use crate::store::{DueDelivery, PushNotifier};
use crate::time::{Busy, Clock, Timestamp};

/// Where a worker is told to come back to a push at a later moment (a retry, a push given
/// back): in local mode the worker loop's own inbox, on AWS a delayed message on the retry
/// queue. Best effort: the sweep is the net.
#[async_trait::async_trait]
pub trait Wakeups: Send + Sync {
    async fn due_at(&self, due: DueDelivery, now: Timestamp);
}

/// What a worker loop ([`Deliverer::run`](super::Deliverer::run)) is told: a push due now or
/// later. Each carries a [`Busy`] guard (on a simulated clock, the message is work until the
/// loop takes it).
pub type InboxRx = mpsc::UnboundedReceiver<(DueDelivery, Busy)>;

/// The sending side of a worker loop's inbox: the store's [`PushNotifier`] (a result just
/// written) and the worker's own [`Wakeups`] (retries).
#[derive(Clone)]
pub struct Inbox {
    tx: mpsc::UnboundedSender<(DueDelivery, Busy)>,
    clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Inbox {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Inbox")
    }
}

impl Inbox {
    pub fn new(clock: Arc<dyn Clock>) -> (Self, InboxRx) {
        let (tx, rx) = mpsc::unbounded_channel();
        (Self { tx, clock }, rx)
    }

    pub fn send(&self, due: DueDelivery) {
        let _ = self.tx.send((due, self.clock.busy()));
    }

    /// For [`TaskStore::with_push_notifier`](crate::store::TaskStore::with_push_notifier).
    pub fn notifier(&self) -> PushNotifier {
        let me = self.clone();
        PushNotifier::new(move |due| me.send(due))
    }
}

#[async_trait::async_trait]
impl Wakeups for Inbox {
    async fn due_at(&self, due: DueDelivery, _now: Timestamp) {
        self.send(due);
    }
}

//! Pushing each result to its owner's callback, at least once, signed the Standard Webhooks
//! way, and scheduled against the life of what it carries. The same worker runs in the
//! delivery Lambda (woken by the table's stream, by its retry queue and by a sweep every
//! minute) and in local mode (a loop told of each result by the store as it is written).
//!
//! The outbox is the task item (see [`crate::store::deliveries`]): the terminal write made the
//! push due. A push is claimed with a lease that counts its attempt, the result is pinned (a
//! result once pushed never changes, as one shown by `GET /tasks/{ref}`), it waits for its
//! host's turn (earliest deadline first, within the host's limits: [`hosts`]), is sent, and the
//! outcome is recorded under the lease; a failure is retried on the schedule that fits the
//! result ([`schedule`]). The `webhook-id` follows from the result
//! ([`Task::webhook_id`](crate::domain::Task::webhook_id)): the same on every retry and replay
//! of the same result, so owners de-duplicate on it.
//!
//! Form: a compat task (submitted through `in.php` with `pingback`) gets the pingback its
//! handler already parses — CaptchaAI's `GET <pingback>?id=<id>&code=<answer>`, or 2captcha's
//! `POST` form where its relay key says so; other tasks get JSON
//! `{"type": "task.solved", "timestamp": …, "data": <the task view>}`. All signed.

pub mod hosts;
pub mod operator;
/// The push schedule lives with the domain (a task's push state is counted by it).
pub use crate::domain::schedule;

mod inbox;
mod keys;
mod loops;
mod payload;
mod report;
mod settings;
mod signal;
mod worker;

pub use inbox::{Inbox, InboxRx, Wakeups};
pub use keys::KeySource;
pub use loops::{SWEEP_END_MARGIN, SWEEP_TROUBLE_MAX_WAIT, SWEEP_TROUBLE_WAIT};
pub use payload::{Push, payload};
pub use report::{Attempt, SweepReport};
pub use settings::{DeliverySettings, check_owner_url, url_policy};
pub use worker::Deliverer;

//! The task: parsed identifiers, the captcha kinds, and the task's life as a state machine.
//!
//! Every transition is a pure function of the current task and an input. The DynamoDB store
//! encodes the same rules as conditional writes; when such a write is refused, the store runs
//! the old item through these functions to say *why* (duplicate, conflict, wrong id).
//!
//! The parts: `ids` (references and CaptchaAI ids), `kinds` (captcha kinds and their
//! times), `result` (a result as it arrives), `push` (the push to the owner's callback),
//! `task` (the state machine), `answer` (the 2captcha answer and the webhook-id) and
//! `view` (what `GET /tasks/{ref}` shows). Their items are re-exported here: use them as
//! `crate::domain::X`.

mod answer;
mod ids;
mod kinds;
mod push;
mod result;
pub mod schedule;
mod task;
mod view;

#[cfg(test)]
mod tests;

pub use self::ids::{CaptchaId, TaskRef};
pub use self::kinds::CaptchaKind;
pub use self::push::{DeliveryState, DeliveryStatus, PingbackForm};
pub use self::result::{IncomingResult, Outcome, Solution, Via};
pub use self::task::{Applied, LateResult, Task, TaskState, TransitionError};
pub use self::view::{DeliveryView, LateView, QueueView, TaskView};
/// Why a value from outside could not be parsed (defined in [`crate::codes`], which the domain
/// builds on).
pub use crate::codes::ParseError;

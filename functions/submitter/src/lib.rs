//! The submitter: releases the submit queue to CaptchaAI's in.php as its threads free.
//!
//! CaptchaAI sells threads; a burst above the plan is the normal day. The API accepts every
//! valid task: at once while a thread is free (a *permit* this function publishes), into the
//! queue otherwise (see [`relay_shared::submit`] and [`relay_shared::store::queue`]). One run of
//! this function — [`run`] — holds the queue's lease (one releaser at a time, whatever the
//! number of invocations) and, until its period ends:
//! - counts the tasks CaptchaAI may be working on (the index's in-work entries, plus its own
//!   releases the index may not show yet) and sends the next queued task whenever that count is
//!   below the learnt window ([`relay_shared::submit::window`]) and the account-wide in.php pace
//!   has a slot;
//! - picks the next task fairly: owners take turns, tokens before an owner's image backlog
//!   ([`relay_shared::submit::lanes`]), oldest first in each lane;
//! - sends each task at most once per release, marking it in work *before* in.php is called;
//!   a "no slot" answer, a ban or a server error code puts it back at its place in the queue
//!   (nothing was taken), an answer that proves nothing leaves it "outcome unknown" (never sent
//!   again), a final refusal fails it;
//! - fails a task that waited longer than `QUEUE_MAX_WAIT_SECS` (never sent, nothing paid);
//! - publishes, with each renewal of its lease, how many inline submits the API may make.
//!
//! Triggers: a write to the wake item (the API writes it when it queues a task and no releaser
//! runs; the table's stream invokes this function), and a schedule every minute (a backstop,
//! and the next run when one ends with tasks left — it also wakes its successor itself). Local
//! mode runs [`serve_local`], woken in-process. Every wait goes through a
//! [`Clock`](relay_shared::time::Clock).

mod deps;
mod entry;
mod report;
mod run;
mod settings;

pub use deps::{Deps, Store};
pub use entry::{handle, serve_local};
pub use report::{METRICS, RunReport};
pub use run::{PLAN_OUT_PAUSE, run};
pub use settings::{MAX_SUBMIT_CONCURRENCY, SubmitterSettings};

//! Wall-clock time as milliseconds since the Unix epoch, behind a clock that tests can drive.
//!
//! Everything in the relay that waits — the poller between reads, between passes, until a ban
//! lifts — waits on a [`Clock`], never on `tokio::time` directly. In production that is the
//! [`SystemClock`]. In tests it is a [`ManualClock`], which is also a discrete-event simulator:
//! [`ManualClock::run_until`] moves time straight to the next moment something sleeps until, as
//! soon as nothing is working, so an hour of poller, fake CaptchaAI and owner takes seconds —
//! with the deployed settings (rates, timeouts, grace), not shrunken ones.
//!
//! The simulator's one rule: a task that sleeps on the clock, or does work the simulation must
//! wait for, holds a [`Busy`] guard ([`Clock::busy`]). Time moves only when every guard-holder
//! is asleep on the clock. Real I/O (HTTP to a fake, the embedded DynamoDB engine) takes no
//! simulated time; real timeouts (an HTTP client's) still run on real time.

mod clock;
mod guards;
mod manual;
mod sim;
mod timestamp;
mod waiter;

pub use clock::{Clock, Sleep, SystemClock};
pub use guards::{Busy, Io};
pub use manual::ManualClock;
pub use timestamp::Timestamp;
pub use waiter::Waiter;

#[cfg(test)]
mod tests;

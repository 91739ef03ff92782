//! The queue's lease — one releaser at a time: taken at the start (or taken over from a run that
//! died), renewed with the permits it publishes for inline submits, left at the end.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::Duration;

use relay_shared::store::{Publish, SubmitState};
use relay_shared::submit::window::Gate;
use relay_shared::time::{Clock, Timestamp};

use super::state::Run;
use crate::deps::Deps;
use crate::report::RunReport;

/// A live holder's lease ends about `lease` from now (it renews every tick); one that ends this
/// much sooner is no longer renewed.
const STALL_SLACK: Duration = Duration::from_secs(2);
/// Taking a lapsed lease over waits this long past its end.
const AFTER_LAPSE: Duration = Duration::from_millis(50);
/// Releases counted in `released_per_minute`.
const MINUTE: Duration = Duration::from_secs(60);

/// The lease held by another run, as `st` shows it at `now`: until when to wait before taking it
/// over, or `None` to give it up (leave the queue to its holder). Only a holder that stopped
/// renewing (it died) is waited for, and only while tasks wait and its lease lapses before this
/// run's sends end (`send_until`).
pub(super) fn take_over_at(
    st: &SubmitState,
    now: Timestamp,
    lease: Duration,
    send_until: Timestamp,
) -> Option<Timestamp> {
    let until = st.releaser_until.unwrap_or(now);
    let stalled = until.since(now) + STALL_SLACK < lease;
    if st.queued == 0 || !stalled || until >= send_until {
        return None;
    }
    Some(until.plus(AFTER_LAPSE))
}

/// Inline permits to publish: what the window's `gate` leaves open, within the minute's budget
/// of "no slot" answers — none while tasks are `queued` (they go first) or sends are paused.
pub(super) fn permits(gate: Gate, queued: bool, now: Timestamp, pause_until: Timestamp, no_slot_budget: u32) -> u32 {
    match gate {
        Gate::Open(n) if !queued && now >= pause_until => n.min(no_slot_budget),
        _ => 0,
    }
}

/// Forgets the releases made a minute or more before `now`.
pub(super) fn forget_before_the_minute(released_at: &mut VecDeque<Timestamp>, now: Timestamp) {
    let from = now.minus(MINUTE);
    while released_at.front().is_some_and(|t| *t <= from) {
        released_at.pop_front();
    }
}

/// Takes the queue's lease for this run. Held by another run: `None` at once — unless tasks
/// wait and the holder stopped renewing (it died): then it waits for the lease to lapse (within
/// the period) and takes it over.
pub(super) async fn take_lease(
    deps: &Deps,
    clock: &Arc<dyn Clock>,
    send_until: Timestamp,
    report: &mut RunReport,
) -> Option<SubmitState> {
    let lease = deps.settings.lease;
    for attempt in 0..2 {
        let now = clock.now();
        match deps.store.queue.releaser_lease(&deps.owner, now, now.plus(lease), None).await {
            Ok(Some(st)) => return Some(st),
            Ok(None) if attempt == 0 => {
                let st = match deps.store.queue.submit_state().await {
                    Ok(st) => st,
                    Err(e) => {
                        report.errors += 1;
                        tracing::error!(event = "submitter_store_failed", error = %e);
                        break;
                    }
                };
                let Some(at) = take_over_at(&st, now, lease, send_until) else { break };
                tracing::warn!(event = "submitter_lease_stalled", holder = ?st.releaser, "the queue's lease stopped being renewed: taking it over when it lapses");
                clock.sleep_until(at).await;
            }
            Ok(None) => break,
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not take the queue's lease");
                report.errors += 1;
                return None;
            }
        }
    }
    report.lease_held_elsewhere = true;
    None
}

/// What a renewal of the lease found.
pub(super) enum Renewal {
    /// Renewed: the queue's state now.
    Renewed(Box<SubmitState>),
    /// Another run took over (this one stalled past its lease): stop sending.
    Lost,
    /// Not written (the store failed): the run goes on with what it knew.
    Failed,
}

impl Run<'_> {
    /// What the next renewal publishes: the inline permits (none while anything waits).
    pub(super) fn publish(&mut self, in_flight: u32, now: Timestamp) -> Publish {
        forget_before_the_minute(&mut self.released_at, now);
        let queued = self.lanes.values().any(|l| !l.heads.is_empty());
        let gate = self.window.gate(in_flight, now);
        Publish {
            permits: permits(gate, queued, now, self.pause_until, self.window.no_slot_budget_left(now)),
            window: serde_json::to_string(&self.window.state()).unwrap_or_default(),
            released_per_minute: self.released_at.len() as u64,
            api_no_slots_seen: self.api_no_slots,
        }
    }

    /// Writes the counts moved, then renews the lease at `now` with what it publishes.
    pub(super) async fn renew(&mut self, in_flight: u32, now: Timestamp, report: &mut RunReport) -> Renewal {
        self.flush_counts(report).await;
        self.renewed_at = now;
        let publish = self.publish(in_flight, now);
        let s = &self.deps.settings;
        match self.deps.store.queue.releaser_lease(&self.deps.owner, now, now.plus(s.lease), Some(&publish)).await {
            Ok(Some(st)) => Renewal::Renewed(Box::new(st)),
            Ok(None) => {
                tracing::warn!(event = "submitter_lease_lost", "another submitter holds the queue");
                report.lease_lost = true;
                Renewal::Lost
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not renew the queue's lease");
                report.errors += 1;
                Renewal::Failed
            }
        }
    }

    /// Leaves the lease with `publish` as the last word, and wakes the next run if tasks are
    /// queued: a task queued while this run was ending must not wait for the schedule.
    pub(super) async fn leave(&self, publish: &Publish, now: Timestamp, report: &mut RunReport) {
        let deps = self.deps;
        if let Err(e) = deps.store.queue.releaser_leave(&deps.owner, publish).await {
            tracing::error!(event = "submitter_store_failed", error = %e, "could not leave the lease (it lapses)");
            report.errors += 1;
        }
        match deps.store.queue.submit_state().await {
            Ok(st) => {
                report.queued_at_end = st.queued;
                if st.queued > 0 {
                    report.handed_over = true;
                    deps.waker.wake(now).await;
                }
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e);
                report.errors += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LEASE: Duration = Duration::from_secs(10);

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    fn held_until(until: u64, queued: u64) -> SubmitState {
        SubmitState {
            queued,
            releaser: Some("submitter-other".into()),
            releaser_until: Some(at(until)),
            ..SubmitState::default()
        }
    }

    #[test]
    fn a_live_holder_keeps_the_lease() {
        // Arrange: renewed a moment ago, its lease ends about `lease` from now.
        let st = held_until(109, 5);

        // Act
        let verdict = take_over_at(&st, at(100), LEASE, at(160));

        // Assert
        assert_eq!(verdict, None);
    }

    #[test]
    fn a_stalled_holder_is_waited_for_and_its_lease_taken_just_after_it_lapses() {
        // Arrange: it ends in 3 s, far sooner than a renewing holder's would.
        let st = held_until(103, 5);

        // Act
        let verdict = take_over_at(&st, at(100), LEASE, at(160));

        // Assert
        assert_eq!(verdict, Some(at(103).plus(Duration::from_millis(50))));
    }

    #[test]
    fn a_stalled_holder_is_left_alone_when_nothing_is_queued() {
        // Arrange
        let st = held_until(103, 0);

        // Act
        let verdict = take_over_at(&st, at(100), LEASE, at(160));

        // Assert
        assert_eq!(verdict, None);
    }

    #[test]
    fn a_lease_that_lapses_after_this_runs_sends_end_is_given_up() {
        // Arrange
        let st = held_until(103, 5);

        // Act
        let verdict = take_over_at(&st, at(100), LEASE, at(103));

        // Assert
        assert_eq!(verdict, None);
    }

    #[test]
    fn permits_are_what_the_window_leaves_open_within_the_no_slot_budget() {
        // Arrange
        let now = at(100);

        // Act
        let open = permits(Gate::Open(7), false, now, now, 20);
        let budget_short = permits(Gate::Open(7), false, now, now, 3);

        // Assert
        assert_eq!(open, 7);
        assert_eq!(budget_short, 3);
    }

    #[test]
    fn no_permits_while_tasks_are_queued_sends_pause_or_the_window_is_shut() {
        // Arrange
        let now = at(100);

        // Act
        let queued = permits(Gate::Open(7), true, now, now, 20);
        let paused = permits(Gate::Open(7), false, now, at(101), 20);
        let full = permits(Gate::Full, false, now, now, 20);
        let held = permits(Gate::Hold(at(102)), false, now, now, 20);

        // Assert
        assert_eq!([queued, paused, full, held], [0; 4]);
    }

    #[test]
    fn releases_a_minute_old_or_more_are_forgotten() {
        // Arrange
        let mut released_at: VecDeque<Timestamp> = [at(30), at(40), at(41), at(99)].into();

        // Act
        forget_before_the_minute(&mut released_at, at(100));

        // Assert
        assert_eq!(released_at, VecDeque::from([at(41), at(99)]));
    }
}

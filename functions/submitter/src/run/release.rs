//! Releasing: the next queued task sent to in.php whenever the window, the account-wide pace
//! and the calls in flight allow it.

use relay_shared::store::{Released, SubmitState};
use relay_shared::submit::window::Gate;
use relay_shared::time::Timestamp;
use tokio::task::JoinSet;

use super::state::{Run, Sent};
use crate::report::RunReport;

/// What holds sends back at a moment, besides the window.
#[derive(Debug, Clone, Copy)]
pub(super) struct Holds {
    /// No sends before this (in.php refused for now).
    pub(super) pause_until: Timestamp,
    /// No sends before this (the pace's second was full).
    pub(super) pace_until: Timestamp,
    /// In.php calls in flight now.
    pub(super) calls: usize,
    /// Most calls in flight at once (`SUBMIT_CONCURRENCY`).
    pub(super) concurrency: usize,
    /// "No slot" answers the minute's budget has left: every call in flight may come back one.
    pub(super) no_slot_budget: usize,
}

/// Whether one more task may be sent at `now`, the window's gate being `gate`.
pub(super) fn may_send(h: Holds, gate: Gate, now: Timestamp) -> bool {
    now >= h.pause_until
        && now >= h.pace_until
        && h.calls < h.concurrency.min(h.no_slot_budget)
        && matches!(gate, Gate::Open(_))
}

/// The start of the second after `now`'s (the in.php pace counts whole seconds).
pub(super) fn next_second(now: Timestamp) -> Timestamp {
    Timestamp::from_millis((now.as_secs() + 1) * 1000)
}

impl Run<'_> {
    /// Sends queued tasks while the window, the pace and the calls in flight allow.
    pub(super) async fn release(
        &mut self,
        state: &SubmitState,
        in_flight: &mut u32,
        calls: &mut JoinSet<Sent>,
        local: bool,
        report: &mut RunReport,
    ) {
        let s = &self.deps.settings;
        let mut waiting = self.waiting(state, self.clock.now());
        loop {
            let now = self.clock.now();
            // Sends in flight count against the minute's budget of "no slot" answers: all of
            // them may come back refused.
            let holds = Holds {
                pause_until: self.pause_until,
                pace_until: self.pace_until,
                calls: calls.len(),
                concurrency: s.concurrency,
                no_slot_budget: self.window.no_slot_budget_left(now) as usize,
            };
            if !may_send(holds, self.window.gate(*in_flight, now), now) {
                break;
            }
            let Some(lane) = self.fair.next(&waiting) else { break };
            let Some(head) = self.next_head(&lane, state, report).await else {
                waiting.remove(&lane);
                continue;
            };
            if self.timed_out(&lane, &head, now, report).await {
                continue;
            }
            match self.deps.store.account.take_submit_slot(now, s.queue.submits_per_second).await {
                Ok(true) => {}
                Ok(false) => {
                    self.put_back(&lane, head);
                    self.pace_until = next_second(now);
                    break;
                }
                Err(e) => {
                    self.put_back(&lane, head);
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e, "could not take an in.php slot");
                    break;
                }
            }
            let released = match self.deps.store.queue.release(&head.task_ref, now).await {
                Ok(Some(r)) => r,
                Ok(None) => continue,
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e, "could not release a task");
                    continue;
                }
            };
            self.uncount(&lane, &head.task_ref);
            self.send(released, now, in_flight, calls, report);
            if local {
                // Yield so a burst of sends does not starve the answers in one process.
                tokio::task::yield_now().await;
            }
        }
    }

    /// Calls in.php for a task released at `now` (its answer joins `calls`), counting it in work.
    fn send(
        &mut self,
        released: Released,
        now: Timestamp,
        in_flight: &mut u32,
        calls: &mut JoinSet<Sent>,
        report: &mut RunReport,
    ) {
        self.mine.insert(released.task.task_ref.clone(), now);
        self.released.insert(released.task.task_ref.clone());
        self.released_at.push_back(now);
        report.released += 1;
        let sent_with = *in_flight;
        *in_flight += 1;
        report.max_in_flight = report.max_in_flight.max(*in_flight);
        let (client, busy) = (self.deps.captchaai.clone(), self.clock.busy());
        self.sent_since_plan_read += 1;
        calls.spawn(async move {
            let _busy = busy;
            let answer = client.submit(&released.request, &released.pingback).await;
            Sent { released, in_flight: sent_with, answer }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn free(now: Timestamp) -> Holds {
        Holds { pause_until: now, pace_until: now, calls: 0, concurrency: 8, no_slot_budget: 20 }
    }

    #[test]
    fn a_task_is_sent_when_nothing_holds_it_and_the_window_is_open() {
        // Arrange
        let now = at(10_000);

        // Act
        let sent = may_send(free(now), Gate::Open(1), now);

        // Assert
        assert!(sent);
    }

    #[test]
    fn the_window_shut_or_held_stops_sends() {
        // Arrange
        let now = at(10_000);

        // Act
        let full = may_send(free(now), Gate::Full, now);
        let held = may_send(free(now), Gate::Hold(at(11_000)), now);

        // Assert
        assert!(!full);
        assert!(!held);
    }

    #[test]
    fn a_pause_or_a_full_pace_second_stops_sends_until_it_ends() {
        // Arrange
        let now = at(10_000);
        let paused = Holds { pause_until: at(10_001), ..free(now) };
        let paced = Holds { pace_until: at(10_001), ..free(now) };

        // Act
        let verdicts = [may_send(paused, Gate::Open(5), now), may_send(paced, Gate::Open(5), now)];

        // Assert
        assert_eq!(verdicts, [false, false]);
    }

    #[test]
    fn calls_in_flight_are_capped_by_the_concurrency_and_the_no_slot_budget() {
        // Arrange
        let now = at(10_000);
        let at_concurrency = Holds { calls: 8, ..free(now) };
        let at_budget = Holds { calls: 2, no_slot_budget: 2, ..free(now) };
        let below_both = Holds { calls: 7, ..free(now) };

        // Act
        let verdicts = [at_concurrency, at_budget, below_both].map(|h| may_send(h, Gate::Open(5), now));

        // Assert
        assert_eq!(verdicts, [false, false, true]);
    }

    #[test]
    fn a_full_pace_second_holds_sends_to_the_start_of_the_next() {
        // Arrange / Act
        let (mid, start) = (next_second(at(12_345)), next_second(at(12_000)));

        // Assert
        assert_eq!(mid, at(13_000));
        assert_eq!(start, at(13_000));
    }
}

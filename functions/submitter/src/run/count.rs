//! How many tasks CaptchaAI may be working on: the in-work index read once a tick, this run's
//! own recent sends, and what the window learns from the change.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use relay_shared::domain::TaskRef;
use relay_shared::store::SubmitState;
use relay_shared::time::Timestamp;

use super::state::Run;
use crate::report::RunReport;

/// What one read of the in-work index shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct InWork {
    /// Tasks CaptchaAI may be working on: those listed and this run's recent sends.
    pub(super) total: u32,
    /// Of those, tasks listed for the first time that this run did not send: the API sent them
    /// inline with a permit, and CaptchaAI took them (none at the first read: nothing to compare).
    pub(super) inline: u32,
}

/// See [`InWork`]: `listed` by the index now, `mine` sent by this run lately, `seen` listed at
/// the last read, `released` sent by this run that the index may still list.
pub(super) fn in_work(
    listed: &BTreeSet<TaskRef>,
    mine: &HashMap<TaskRef, Timestamp>,
    seen: Option<&BTreeSet<TaskRef>>,
    released: &BTreeSet<TaskRef>,
) -> InWork {
    let total = listed.len() + mine.keys().filter(|r| !listed.contains(*r)).count();
    let inline = seen.map_or(0, |seen| listed.iter().filter(|r| !seen.contains(*r) && !released.contains(*r)).count());
    InWork { total: total as u32, inline: inline as u32 }
}

/// Whether the index is read at `now` (once a tick; between reads, this run's own sends are
/// counted as they go).
pub(super) fn look_due(looked_at: Option<Timestamp>, now: Timestamp, tick: Duration) -> bool {
    looked_at.is_none_or(|at| now.since(at) >= tick)
}

impl Run<'_> {
    /// One look at the tasks in work at `now`, `in_flight` as counted so far: the index once a
    /// tick, corrected by CaptchaAI's own count; the window learns from a task finished and from
    /// the inline "no slot" answers met since the last look. The count now.
    pub(super) async fn look(
        &mut self,
        state: &SubmitState,
        in_flight: u32,
        now: Timestamp,
        report: &mut RunReport,
    ) -> u32 {
        let counted = if look_due(self.looked_at, now, self.deps.settings.tick) {
            self.looked_at = Some(now);
            self.in_flight(now, report).await.unwrap_or(in_flight)
        } else {
            in_flight
        };
        // What the table counts in work includes tasks whose pingback was lost (they look busy
        // until the poller reads them): with the plan known and the window full, CaptchaAI's
        // own count corrects it.
        let counted =
            if state.breaker.open_at(now).is_none() { self.corrected(counted, now, report).await } else { counted };
        if counted < in_flight {
            // A task finished (its result recorded): progress, for the window's stall rule.
            self.window.finished(now);
        }
        report.max_in_flight = report.max_in_flight.max(counted);
        // "No slot" answers inline submits met since the last look: the plan is full.
        if state.api_no_slots > self.api_no_slots {
            self.window.no_slot(counted, now);
            self.api_no_slots = state.api_no_slots;
        }
        counted
    }

    /// Tasks CaptchaAI may be working on: the index's in-work entries and this run's own
    /// recent sends. `None` if the index could not be read.
    ///
    /// Tasks that appear in work without this run having sent them were sent inline by the API
    /// with a permit, and CaptchaAI took them: the window learns from them as from its own.
    pub(super) async fn in_flight(&mut self, now: Timestamp, report: &mut RunReport) -> Option<u32> {
        let lag = self.deps.settings.index_lag;
        self.mine.retain(|_, at| now.since(*at) < lag);
        match self.deps.store.queue.in_work(now).await {
            Ok(refs) => {
                let listed: BTreeSet<TaskRef> = refs.into_iter().collect();
                let InWork { total, inline } = in_work(&listed, &self.mine, self.seen.as_ref(), &self.released);
                let before = total - inline;
                for i in 0..inline {
                    self.window.accepted(before + i, now);
                }
                self.released.retain(|r| listed.contains(r) || self.mine.contains_key(r));
                self.seen = Some(listed);
                Some(total)
            }
            Err(e) => {
                tracing::error!(event = "submitter_store_failed", error = %e, "could not count the tasks in work");
                report.errors += 1;
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn refs(n: usize) -> Vec<TaskRef> {
        (0..n).map(|_| TaskRef::generate()).collect()
    }

    #[test]
    fn this_runs_recent_sends_count_in_work_before_the_index_lists_them() {
        // Arrange: two listed; two of this run's sends, one of them listed already.
        let r = refs(3);
        let listed = BTreeSet::from([r[0].clone(), r[1].clone()]);
        let mine =
            HashMap::from([(r[1].clone(), Timestamp::from_millis(1)), (r[2].clone(), Timestamp::from_millis(1))]);

        // Act
        let seen = in_work(&listed, &mine, None, &BTreeSet::new());

        // Assert
        assert_eq!(seen, InWork { total: 3, inline: 0 });
    }

    #[test]
    fn tasks_newly_listed_that_this_run_did_not_send_are_inline_submits() {
        // Arrange: r0 listed before; r1 released by this run; r2 and r3 new and not ours.
        let r = refs(4);
        let listed: BTreeSet<TaskRef> = r.iter().cloned().collect();
        let seen = BTreeSet::from([r[0].clone()]);
        let released = BTreeSet::from([r[1].clone()]);

        // Act
        let counted = in_work(&listed, &HashMap::new(), Some(&seen), &released);

        // Assert
        assert_eq!(counted, InWork { total: 4, inline: 2 });
    }

    #[test]
    fn the_first_read_learns_no_inline_submits() {
        // Arrange
        let listed: BTreeSet<TaskRef> = refs(3).into_iter().collect();

        // Act
        let counted = in_work(&listed, &HashMap::new(), None, &BTreeSet::new());

        // Assert
        assert_eq!(counted.inline, 0);
    }

    #[test]
    fn the_index_is_read_at_the_first_look_and_then_once_a_tick() {
        // Arrange
        let tick = Duration::from_millis(200);
        let last = Timestamp::from_millis(10_000);

        // Act
        let first = look_due(None, last, tick);
        let too_soon = look_due(Some(last), Timestamp::from_millis(10_199), tick);
        let a_tick_on = look_due(Some(last), Timestamp::from_millis(10_200), tick);

        // Assert
        assert!(first);
        assert!(!too_soon);
        assert!(a_tick_on);
    }
}

//! The run's view of the queue: which lanes wait, each lane's next task, tasks that waited too
//! long, tasks put back, and the lane counts it moves (written once a tick).

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use relay_shared::domain::TaskRef;
use relay_shared::store::{QueuedRef, Released, SubmitState};
use relay_shared::submit::QUEUE_TIMEOUT;
use relay_shared::submit::lanes::parse_lane;
use relay_shared::time::Timestamp;

use super::state::{Lane, Run};
use crate::report::RunReport;

/// Tasks read from a lane's index at once.
const HEADS_READ: i32 = 25;
/// A lane the index listed empty is looked at again after this, at the same count (the index
/// lags a put).
const EMPTY_LOOK_AGAIN: Duration = Duration::from_secs(1);
/// A lane the index keeps listing empty for this long at the same count has its count set right
/// (the count is a crash's leftover).
const EMPTY_RECONCILE_AFTER: Duration = Duration::from_secs(10);

/// Whether a lane counted `count` tasks is worth a look at `now`, given this run's view of it.
pub(super) fn lane_waits(view: Option<&Lane>, count: u64, now: Timestamp) -> bool {
    match view {
        Some(l) if !l.heads.is_empty() => true,
        Some(Lane { empty: Some((at, seen)), .. }) => {
            // Listed empty a moment ago at this count: look again in a second
            // (the index lags a put).
            count > *seen || now.since(*at) >= EMPTY_LOOK_AGAIN
        }
        _ => true,
    }
}

/// What to do when the index lists a lane empty at `now` while its count is `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum ListedEmpty {
    /// Empty for long enough at the same count: set the count right (to 0), and remember the lane
    /// empty at 0 from now.
    Reconcile,
    /// Remember the lane empty since this time at this count.
    Remember(Timestamp, u64),
}

/// See [`ListedEmpty`]: `before` is when the lane was first listed empty, at what count.
pub(super) fn listed_empty(before: Option<(Timestamp, u64)>, count: u64, now: Timestamp) -> ListedEmpty {
    match before {
        // Empty for 10 s at the same count: the count is a crash's leftover.
        Some((since, seen)) if seen == count && now.since(since) >= EMPTY_RECONCILE_AFTER => ListedEmpty::Reconcile,
        Some((since, seen)) if seen == count => ListedEmpty::Remember(since, seen),
        _ => ListedEmpty::Remember(now, count),
    }
}

/// How long `queued_at` has waited at `now` if that is `max` or more (the task is then failed,
/// never sent); `None` while it may still wait.
pub(super) fn waited_too_long(queued_at: Timestamp, now: Timestamp, max: Duration) -> Option<Duration> {
    let waited = now.since(queued_at);
    (waited >= max).then_some(waited)
}

/// What a task failed for waiting too long is told.
pub(super) fn timeout_detail(waited: Duration, max: Duration) -> String {
    format!(
        "waited {} s in the relay's submit queue for a free CaptchaAI thread, longer than QUEUE_MAX_WAIT_SECS ({} s); \
         it was never sent to CaptchaAI and nothing was paid: submit it again",
        waited.as_secs(),
        max.as_secs()
    )
}

/// Count moves to write: `None` when they add up to nothing on every item and lane.
pub(super) fn moves_to_write(moved: &BTreeMap<(u8, String), i64>) -> Option<Vec<((u8, String), i64)>> {
    if moved.values().all(|d| *d == 0) {
        return None;
    }
    Some(moved.iter().map(|(k, d)| (k.clone(), *d)).collect())
}

impl Run<'_> {
    /// The lanes with tasks, as the counts say (less those the index just showed empty).
    pub(super) fn waiting(&self, state: &SubmitState, now: Timestamp) -> BTreeSet<String> {
        state
            .lanes
            .iter()
            .filter(|(lane, count)| parse_lane(lane).is_some() && lane_waits(self.lanes.get(*lane), **count, now))
            .map(|(lane, _)| lane.clone())
            .collect()
    }

    /// The next task of `lane`, reading the index when its buffer is empty. A lane the index
    /// keeps listing empty while its count says otherwise has its count set right.
    pub(super) async fn next_head(
        &mut self,
        lane: &str,
        state: &SubmitState,
        report: &mut RunReport,
    ) -> Option<QueuedRef> {
        let now = self.clock.now();
        let count = state.lanes.get(lane).copied().unwrap_or(0);
        let entry = self.lanes.entry(lane.to_owned()).or_default();
        if let Some(head) = entry.heads.pop_front() {
            return Some(head);
        }
        match self.deps.store.queue.queue_heads(lane, HEADS_READ).await {
            Ok(heads) if !heads.is_empty() => {
                entry.heads = heads.into();
                entry.empty = None;
                entry.heads.pop_front()
            }
            Ok(_) => {
                entry.empty = match listed_empty(entry.empty, count, now) {
                    ListedEmpty::Reconcile => {
                        match self.deps.store.queue.reconcile_lane(lane, state, 0).await {
                            Ok(true) => {
                                report.reconciled += 1;
                                tracing::warn!(
                                    event = "queue_count_reconciled",
                                    lane,
                                    count,
                                    "a lane's count had no tasks behind it"
                                );
                            }
                            Ok(false) => {}
                            Err(e) => {
                                report.errors += 1;
                                tracing::error!(event = "submitter_store_failed", error = %e);
                            }
                        }
                        Some((now, 0))
                    }
                    ListedEmpty::Remember(since, seen) => Some((since, seen)),
                };
                None
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not read the queue");
                entry.empty = Some((now, count));
                None
            }
        }
    }

    /// Fails the tasks at the heads of their lanes that waited too long (while nothing can be
    /// sent: a ban, the end of the period).
    pub(super) async fn expire_heads(&mut self, state: &SubmitState, now: Timestamp, report: &mut RunReport) {
        let lanes: Vec<String> = self.waiting(state, now).into_iter().collect();
        for lane in lanes {
            while let Some(head) = self.next_head(&lane, state, report).await {
                if !self.timed_out(&lane, &head, now, report).await {
                    self.put_back(&lane, head);
                    break;
                }
            }
        }
    }

    /// Whether `head` waited too long (then it is failed, never sent).
    pub(super) async fn timed_out(
        &mut self,
        lane: &str,
        head: &QueuedRef,
        now: Timestamp,
        report: &mut RunReport,
    ) -> bool {
        report.oldest_queued_secs = report.oldest_queued_secs.max(now.since(head.queued_at).as_secs());
        let max = self.deps.settings.queue.max_wait;
        let Some(waited) = waited_too_long(head.queued_at, now, max) else { return false };
        let detail = timeout_detail(waited, max);
        match self.deps.store.queue.fail_unsent(&head.task_ref, true, QUEUE_TIMEOUT, &detail, now).await {
            Ok(Some(_)) => {
                report.timed_out += 1;
                metrics::counter!("submit_queue_timeouts").increment(1);
                tracing::warn!(event = "queue_timeout", task_ref = %head.task_ref, waited_secs = waited.as_secs(), "queued too long; failed, never sent");
                self.uncount(lane, &head.task_ref);
            }
            Ok(None) => {}
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e);
            }
        }
        true
    }

    /// Counts a task out of `lane` on its count item (written with the tick's other moves,
    /// [`Self::flush_counts`]).
    pub(super) fn uncount(&mut self, lane: &str, task_ref: &TaskRef) {
        let shard = self.deps.store.queue.queue_shard(task_ref);
        *self.moved.entry((shard, lane.to_owned())).or_default() -= 1;
    }

    /// Writes the counts moved since the last flush, in one write. Failed, they are kept for
    /// the next one; a run that dies with some unwritten leaves its lanes counted too high,
    /// which the queue reconciles (a lane whose index is empty for 10 s is set to 0) — tasks are
    /// never unseen, only inline submits wait a little longer.
    pub(super) async fn flush_counts(&mut self, report: &mut RunReport) {
        let Some(deltas) = moves_to_write(&self.moved) else {
            self.moved.clear();
            return;
        };
        self.moved.clear();
        if let Err(e) = self.deps.store.queue.count_queued_many(&deltas).await {
            // Items written before the failure are counted again: a count too high, which the
            // queue reconciles, never a task unseen.
            report.errors += 1;
            tracing::error!(event = "submitter_store_failed", error = %e, "could not move the queue's counts");
            for (key, d) in deltas {
                *self.moved.entry(key).or_default() += d;
            }
        }
    }

    /// Puts a task in.php took nothing of back at its place in the queue.
    pub(super) async fn requeue(&mut self, released: Released, report: &mut RunReport) {
        let Released { task, lane, queued_at, .. } = released;
        self.mine.remove(&task.task_ref);
        let shard = self.deps.store.queue.queue_shard(&task.task_ref);
        *self.moved.entry((shard, lane.clone())).or_default() += 1;
        match self.deps.store.queue.requeue(&task.task_ref, &lane, queued_at).await {
            Ok(true) => {
                report.requeued += 1;
                self.put_back(&lane, QueuedRef { task_ref: task.task_ref, queued_at });
            }
            Ok(false) => self.uncount(&lane, &task.task_ref),
            Err(e) => {
                // It stays submitting without an outcome: the poller expires it at its
                // deadline; nothing was taken by in.php, so nothing is lost but the task.
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not put a task back in the queue");
                self.uncount(&lane, &task.task_ref);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(secs: u64) -> Timestamp {
        Timestamp::from_millis(secs * 1000)
    }

    fn head() -> QueuedRef {
        QueuedRef { task_ref: TaskRef::generate(), queued_at: at(1) }
    }

    #[test]
    fn a_lane_not_yet_read_or_with_tasks_buffered_waits() {
        // Arrange
        let buffered = Lane { heads: [head()].into(), empty: Some((at(100), 3)) };

        // Act
        let unread = lane_waits(None, 3, at(100));
        let with_heads = lane_waits(Some(&buffered), 3, at(100));

        // Assert
        assert!(unread);
        assert!(with_heads);
    }

    #[test]
    fn a_lane_just_listed_empty_at_the_same_count_is_skipped_for_a_second() {
        // Arrange
        let listed_empty = Lane { heads: Default::default(), empty: Some((Timestamp::from_millis(100_000), 3)) };

        // Act
        let at_once = lane_waits(Some(&listed_empty), 3, Timestamp::from_millis(100_999));
        let a_second_on = lane_waits(Some(&listed_empty), 3, Timestamp::from_millis(101_000));
        let counted_more = lane_waits(Some(&listed_empty), 4, Timestamp::from_millis(100_001));

        // Assert
        assert!(!at_once);
        assert!(a_second_on);
        assert!(counted_more);
    }

    #[test]
    fn the_first_empty_listing_is_remembered_at_its_time_and_count() {
        // Arrange / Act
        let verdict = listed_empty(None, 3, at(100));

        // Assert
        assert_eq!(verdict, ListedEmpty::Remember(at(100), 3));
    }

    #[test]
    fn an_empty_listing_at_the_same_count_keeps_its_first_time() {
        // Arrange / Act
        let verdict = listed_empty(Some((at(100), 3)), 3, at(105));

        // Assert
        assert_eq!(verdict, ListedEmpty::Remember(at(100), 3));
    }

    #[test]
    fn ten_seconds_listed_empty_at_the_same_count_sets_the_count_right() {
        // Arrange / Act
        let verdict = listed_empty(Some((at(100), 3)), 3, at(110));

        // Assert
        assert_eq!(verdict, ListedEmpty::Reconcile);
    }

    #[test]
    fn a_changed_count_starts_the_empty_clock_again() {
        // Arrange / Act
        let verdict = listed_empty(Some((at(100), 3)), 5, at(130));

        // Assert
        assert_eq!(verdict, ListedEmpty::Remember(at(130), 5));
    }

    #[test]
    fn a_task_times_out_once_it_waited_the_maximum() {
        // Arrange
        let max = Duration::from_secs(300);

        // Act
        let short = waited_too_long(at(1_000), at(1_299), max);
        let exactly = waited_too_long(at(1_000), at(1_300), max);

        // Assert
        assert_eq!(short, None);
        assert_eq!(exactly, Some(max));
    }

    #[test]
    fn a_timed_out_task_is_told_how_long_it_waited_and_that_nothing_was_paid() {
        // Arrange / Act
        let detail = timeout_detail(Duration::from_secs(312), Duration::from_secs(300));

        // Assert
        assert!(detail.starts_with("waited 312 s"), "{detail}");
        assert!(detail.contains("QUEUE_MAX_WAIT_SECS (300 s)"), "{detail}");
        assert!(detail.contains("nothing was paid"), "{detail}");
    }

    #[test]
    fn moves_that_cancel_out_are_not_written() {
        // Arrange
        let moved = BTreeMap::from([((0u8, "a.t".to_owned()), 0i64), ((1, "b.i".to_owned()), 0)]);

        // Act
        let write = moves_to_write(&moved);

        // Assert
        assert_eq!(write, None);
    }

    #[test]
    fn any_move_writes_them_all_in_one_batch() {
        // Arrange
        let moved = BTreeMap::from([((0u8, "a.t".to_owned()), 0i64), ((1, "b.i".to_owned()), -2)]);

        // Act
        let write = moves_to_write(&moved);

        // Assert
        assert_eq!(write, Some(vec![((0, "a.t".to_owned()), 0), ((1, "b.i".to_owned()), -2)]));
    }
}

//! Once per run, before releasing: the queue's counts set right against what the index lists
//! (counts on shards a lowered `QUEUE_SHARDS` no longer reads, counts lost to a crash).

use std::collections::BTreeMap;

use relay_shared::store::SubmitState;

use super::state::Run;
use crate::report::RunReport;

/// What a scan of the queue's index lists, per `(lane, shard)`, summed per lane; and the
/// `(lane, shard)` pairs on shards at or beyond `shards` (no longer read: to be moved).
pub(super) fn tally_listed(
    listed: &BTreeMap<(String, u8), u64>,
    shards: u8,
) -> (BTreeMap<String, u64>, Vec<(String, u8)>) {
    let mut per_lane: BTreeMap<String, u64> = BTreeMap::new();
    let mut beyond = Vec::new();
    for ((lane, shard), n) in listed {
        *per_lane.entry(lane.clone()).or_default() += n;
        if *shard >= shards {
            beyond.push((lane.clone(), *shard));
        }
    }
    (per_lane, beyond)
}

/// The lanes with tasks listed while `state` counts them empty, with how many are listed.
pub(super) fn counted_empty(per_lane: BTreeMap<String, u64>, state: &SubmitState) -> Vec<(String, u64)> {
    per_lane.into_iter().filter(|(lane, _)| state.lanes.get(lane).copied().unwrap_or(0) == 0).collect()
}

impl Run<'_> {
    /// A lowered `QUEUE_SHARDS` leaves counts on items no longer read: folded in first.
    pub(super) async fn fold_queue_shards(&mut self, report: &mut RunReport) {
        match self.deps.store.queue.fold_queue_shards().await {
            Ok(0) => {}
            Ok(n) => {
                report.reconciled += n as u64;
                tracing::warn!(
                    event = "queue_count_reconciled",
                    items = n,
                    "counts on queue shards beyond QUEUE_SHARDS folded in"
                );
            }
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not fold the queue's counts");
            }
        }
    }

    /// Lanes the index lists tasks in while their count says none (a count lost to a crash):
    /// counted again, so their tasks are released; and tasks listed on index shards a lowered
    /// `QUEUE_SHARDS` no longer reads: moved to theirs. Once per run.
    pub(super) async fn reconcile_lost_lanes(&mut self, state: &SubmitState, report: &mut RunReport) {
        let listed = match self.deps.store.queue.queued_lanes().await {
            Ok(l) => l,
            Err(e) => {
                report.errors += 1;
                tracing::error!(event = "submitter_store_failed", error = %e, "could not scan the queue");
                return;
            }
        };
        let (per_lane, beyond) = tally_listed(&listed, self.deps.store.queue.queue_shards());
        for (lane, shard) in beyond {
            match self.deps.store.queue.rehome_queued(&lane, shard).await {
                Ok(moved) => {
                    report.reconciled += 1;
                    tracing::warn!(event = "queue_count_reconciled", lane = %lane, shard, moved, "queued tasks on a shard beyond QUEUE_SHARDS moved to theirs");
                }
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e);
                }
            }
        }
        for (lane, n) in counted_empty(per_lane, state) {
            match self.deps.store.queue.reconcile_lane(&lane, state, n).await {
                Ok(true) => {
                    report.reconciled += 1;
                    tracing::warn!(event = "queue_count_reconciled", lane = %lane, n, "tasks queued in a lane counted empty");
                }
                Ok(false) => {}
                Err(e) => {
                    report.errors += 1;
                    tracing::error!(event = "submitter_store_failed", error = %e);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listed_tasks_are_summed_per_lane_and_shards_beyond_the_count_are_picked_out() {
        // Arrange: 2 shards read (0 and 1); lane a listed on shards 0 and 2, lane b on 1 and 3.
        let listed = BTreeMap::from([
            (("a.t".to_owned(), 0u8), 2u64),
            (("a.t".to_owned(), 2), 5),
            (("b.i".to_owned(), 1), 1),
            (("b.i".to_owned(), 3), 4),
        ]);

        // Act
        let (per_lane, beyond) = tally_listed(&listed, 2);

        // Assert
        assert_eq!(per_lane, BTreeMap::from([("a.t".to_owned(), 7), ("b.i".to_owned(), 5)]));
        assert_eq!(beyond, vec![("a.t".to_owned(), 2), ("b.i".to_owned(), 3)]);
    }

    #[test]
    fn only_lanes_counted_empty_are_counted_again() {
        // Arrange
        let per_lane = BTreeMap::from([("a.t".to_owned(), 7u64), ("b.i".to_owned(), 1), ("c.t".to_owned(), 2)]);
        let state = SubmitState {
            lanes: BTreeMap::from([("a.t".to_owned(), 7), ("c.t".to_owned(), 0)]),
            ..SubmitState::default()
        };

        // Act
        let lost = counted_empty(per_lane, &state);

        // Assert
        assert_eq!(lost, vec![("b.i".to_owned(), 1), ("c.t".to_owned(), 2)]);
    }
}

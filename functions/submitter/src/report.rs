//! What one run did: the report logged as one structured line, and the metrics it publishes.

use serde::Serialize;

/// What one run did. Logged as one structured line.
#[derive(Debug, Clone, Default, Serialize, PartialEq, Eq)]
pub struct RunReport {
    /// Another run holds the queue: this one did nothing.
    pub lease_held_elsewhere: bool,
    /// The lease was taken over mid-run (this run's renewals lapsed).
    pub lease_lost: bool,
    /// In.php calls made.
    pub released: u64,
    pub accepted: u64,
    /// "No slot" answers (back to the queue).
    pub no_slot: u64,
    /// Answers that prove nothing (never sent again).
    pub unknown: u64,
    /// Back to the queue for a ban or a server error code.
    pub requeued: u64,
    /// Refused for good at release.
    pub failed: u64,
    /// Waited longer than `QUEUE_MAX_WAIT_SECS`: failed, never sent.
    pub timed_out: u64,
    pub bans: u64,
    pub errors: u64,
    /// Tasks queued, most seen at once.
    pub max_queued: u64,
    /// Tasks queued at the end.
    pub queued_at_end: u64,
    /// The longest any task seen at the head of its lane had waited.
    pub oldest_queued_secs: u64,
    pub max_in_flight: u32,
    /// The window at the end.
    pub window: u32,
    /// The plan's threads as `threadsinfo` stated them in this run, if it was read.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub plan: Option<u32>,
    /// Whether this run found the plan run out (`ERROR_ZERO_BALANCE` with threads free) and
    /// stopped submits.
    pub plan_out: bool,
    /// Lane counts set right against the index.
    pub reconciled: u64,
    /// It ended with tasks queued and woke the next run.
    pub handed_over: bool,
    /// It published its metrics ([`METRICS`]; an idle run publishes none).
    pub metrics_published: bool,
}

impl RunReport {
    /// Whether the run saw the queue used (tasks queued, sent, or a failure to look): only such
    /// a run publishes [`METRICS`] — the queue's metrics exist while it is used (custom metrics
    /// are billed by the hour they are published in).
    pub(crate) fn saw_the_queue_used(&self) -> bool {
        self.max_queued + self.queued_at_end + self.released + self.errors > 0
    }
}

/// The metrics a run that saw the queue used publishes (namespace `CaptchaRelay`, service
/// `submitter`).
pub const METRICS: [&str; 8] = [
    "submit_queue_depth",
    "submit_queue_oldest_seconds",
    "submit_window",
    "submit_in_flight",
    "submit_released",
    "submit_requeued",
    "submit_unknown",
    "submitter_errors",
];

/// Publishes `r` as [`METRICS`].
pub(crate) fn emit_metrics(r: &RunReport) {
    let [depth, oldest, window, in_flight, released, requeued, unknown, errors] = METRICS;
    metrics::gauge!(depth).set(r.max_queued as f64);
    metrics::gauge!(oldest).set(r.oldest_queued_secs as f64);
    metrics::gauge!(window).set(f64::from(r.window));
    metrics::gauge!(in_flight).set(f64::from(r.max_in_flight));
    metrics::counter!(released).increment(r.released);
    metrics::counter!(requeued).increment(r.requeued);
    metrics::counter!(unknown).increment(r.unknown);
    metrics::counter!(errors).increment(r.errors);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_idle_run_does_not_publish_metrics() {
        // Arrange: a run that found nothing queued, released nothing, failed nothing — even
        // with a window and a plan read.
        let report = RunReport { window: 10, plan: Some(5), reconciled: 2, ..RunReport::default() };

        // Act
        let used = report.saw_the_queue_used();

        // Assert
        assert!(!used);
    }

    #[test]
    fn any_queued_task_release_or_error_makes_the_run_publish() {
        // Arrange
        let reports = [
            RunReport { max_queued: 1, ..RunReport::default() },
            RunReport { queued_at_end: 1, ..RunReport::default() },
            RunReport { released: 1, ..RunReport::default() },
            RunReport { errors: 1, ..RunReport::default() },
        ];

        // Act
        let used = reports.map(|r| r.saw_the_queue_used());

        // Assert
        assert_eq!(used, [true; 4]);
    }

    #[test]
    fn the_plan_is_left_out_of_the_log_line_when_it_was_not_read() {
        // Arrange
        let unread = RunReport::default();
        let read = RunReport { plan: Some(12), ..RunReport::default() };

        // Act
        let (unread, read) = (serde_json::to_value(&unread).expect("json"), serde_json::to_value(&read).expect("json"));

        // Assert
        assert!(unread.get("plan").is_none());
        assert_eq!(read["plan"], 12);
        assert_eq!(read["released"], 0);
    }
}

//! When a task is read again and what a listed task needs: the read schedule ([`next_read_at`])
//! and the per-task [`decide`].

use std::time::Duration;

use relay_shared::domain::CaptchaId;
use relay_shared::store::DueTask;
use relay_shared::time::Timestamp;

use crate::settings::PollerSettings;

/// A task without a CaptchaAI id that is not (or no longer) to be sent again expires this long
/// after its kind's longest solve, counted from its (last) submit.
pub const NO_ID_GRACE: Duration = Duration::from_secs(60);

/// Delay before the next read after `reads` reads: 5 s, 10 s, 15 s, 20 s, then every 30 s.
/// Never under the protocol's 5 s minimum.
pub fn next_poll_delay(reads: u32) -> Duration {
    Duration::from_secs(match reads {
        0 | 1 => 5,
        2 => 10,
        3 => 15,
        4 => 20,
        _ => 30,
    })
}

/// When to read a task again after `reads` reads, at `now`: the protocol's schedule
/// ([`next_poll_delay`]), stretched when needed so the reads left in the budget last until the
/// deadline — the last one falls on it, so no task expires without a last read.
pub fn next_read_at(reads: u32, now: Timestamp, deadline: Timestamp, s: &PollerSettings) -> Timestamp {
    let base = next_poll_delay(reads);
    let left = s.read_budget.saturating_sub(reads).max(1);
    // The first reads follow the schedule closely (a task just slower than usual is caught
    // within seconds); the rest are spread over the time left.
    if reads < 5 && left > 5 {
        return now.plus(base);
    }
    now.plus(base.max(deadline.since(now) / left))
}

/// What to do with a listed task, decided from its record alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Read it from res.php; `last`: it is past its deadline, and expires unless this read
    /// finds its result.
    Read { id: CaptchaId, last: bool },
    /// No CaptchaAI id (in.php's answer not stored, or its outcome unknown): only its pingback
    /// can resolve it. Set aside until `until`.
    Wait { until: Timestamp },
    /// No CaptchaAI id and its result overdue: send it to in.php again, once (the same task
    /// and pingback; whichever result comes first is its result).
    Resend,
    /// Give up now.
    Expire(String),
}

pub fn decide(due: &DueTask, now: Timestamp, s: &PollerSettings) -> Decision {
    let task = &due.task;
    let Some(id) = &task.captcha_id else {
        let kind = task.kind;
        if s.resend && task.resent_at.is_none() {
            let at = task.submitted_or_created_at().plus(kind.resend_after());
            return if now >= at { Decision::Resend } else { Decision::Wait { until: at } };
        }
        // Its deadline follows its kind: the longest solve after its (last) submit, and a grace.
        let since = task.resent_at.unwrap_or_else(|| task.submitted_or_created_at());
        let deadline = since.plus(kind.max_solve_time() + NO_ID_GRACE);
        return if now >= deadline {
            Decision::Expire(format!(
                "in.php's answer is unknown (no CaptchaAI id stored){} and no pingback came within {} s",
                if task.resent_at.is_some() { ", also after it was sent again," } else { "" },
                deadline.since(since).as_secs()
            ))
        } else {
            Decision::Wait { until: deadline }
        };
    };
    let deadline = task.submitted_or_created_at().plus(s.task_deadline);
    if due.reads >= s.read_budget {
        return Decision::Expire(format!("no result after {} res.php reads", due.reads));
    }
    Decision::Read { id: id.clone(), last: now >= deadline }
}

#[cfg(test)]
mod tests {
    use relay_shared::domain::{CaptchaKind, Task, TaskRef, TaskState};

    use super::*;

    fn due(state: TaskState, id: Option<&str>, reads: u32) -> DueTask {
        let mut task = Task::new(TaskRef::generate(), CaptchaKind::Turnstile, Timestamp::from_millis(0));
        task.state = state;
        task.captcha_id = id.map(|i| CaptchaId::parse(i).expect("id"));
        DueTask { task, due_at: Timestamp::from_millis(0), reads, unknown_codes: 0, last_not_ready_at: None }
    }

    #[test]
    fn schedule_starts_at_five_seconds_and_backs_off_to_thirty() {
        let got: Vec<u64> = (0..8).map(|r| next_poll_delay(r).as_secs()).collect();
        assert_eq!(got, [5, 5, 10, 15, 20, 30, 30, 30]);
        assert!((0..100).all(|r| next_poll_delay(r) >= Duration::from_secs(5)), "never under the protocol minimum");
    }

    #[test]
    fn the_budget_is_spread_so_the_last_read_falls_on_the_deadline() {
        let s = PollerSettings::default();
        let t = |secs: u64| Timestamp::from_millis(secs * 1000);
        let deadline = t(600);
        // A task that never solves, first read at 25 s: 20 reads, the last at the deadline.
        let (mut now, mut reads, mut at) = (t(25), 1, vec![25]);
        while reads < s.read_budget {
            now = next_read_at(reads, now, deadline, &s);
            reads += 1;
            at.push(now.as_secs());
        }
        assert_eq!(at[..5], [25, 30, 40, 55, 75], "the protocol's schedule first");
        assert!(at.windows(2).all(|w| w[1] - w[0] >= 5), "never under 5 s apart: {at:?}");
        assert!(*at.last().unwrap_or(&0) >= 600, "the last read is at the deadline: {at:?}");
        assert!(at.iter().filter(|a| **a < 600).count() == 19, "{at:?}");
    }

    #[test]
    fn decisions_follow_deadline_budget_and_id() {
        let s = PollerSettings::default();
        let pending = TaskState::Pending { submitted_at: Timestamp::from_millis(1_000) };
        let t = |ms| Timestamp::from_millis(ms);
        assert!(matches!(
            decide(&due(pending.clone(), Some("7"), 0), t(130_000), &s),
            Decision::Read { last: false, .. }
        ));
        assert!(
            matches!(decide(&due(pending.clone(), Some("7"), 20), t(130_000), &s), Decision::Expire(r) if r.contains("20 res.php reads"))
        );
        assert!(
            matches!(decide(&due(pending, Some("7"), 3), t(601_000), &s), Decision::Read { last: true, .. }),
            "past the deadline: one last read before expiring"
        );
        // No CaptchaAI id (a Turnstile task): sent again once its result is overdue (2 × 15 s +
        // 30 s), then it follows its kind's deadline from the resend (90 s + 60 s).
        let stranded = due(TaskState::Submitting { unknown: None }, None, 0);
        assert_eq!(decide(&stranded, t(5_000), &s), Decision::Wait { until: t(60_000) });
        assert_eq!(decide(&stranded, t(60_000), &s), Decision::Resend);
        let resent = DueTask { task: Task { resent_at: Some(t(61_000)), ..stranded.task.clone() }, ..stranded.clone() };
        assert_eq!(decide(&resent, t(62_000), &s), Decision::Wait { until: t(211_000) });
        assert!(matches!(decide(&resent, t(211_000), &s), Decision::Expire(r) if r.contains("sent again")));
        // An upstream that bills per solution: never sent twice; the kind's deadline.
        let once = PollerSettings { resend: false, ..PollerSettings::default() };
        assert_eq!(decide(&stranded, t(5_000), &once), Decision::Wait { until: t(150_000) });
        assert!(matches!(decide(&stranded, t(150_000), &once), Decision::Expire(r) if r.contains("unknown")));
    }
}

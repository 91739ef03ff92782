//! A task's result as it leaves the relay for a client: the 2captcha answer (`res.php`, a
//! pingback's `code`) with its user agent, and the `webhook-id` a push of it carries.

use super::{LateResult, Outcome, Solution, Task, TaskState};
use crate::time::Timestamp;

impl Task {
    /// The 2captcha answer for this task at `now`, as `res.php?action=get` gives it and a
    /// 2captcha pingback carries it as `code`: `(true, token)` while the token is fresh,
    /// otherwise `(false, code)` — `CAPCHA_NOT_READY`, `ERROR_TOKEN_EXPIRED` (a token past its
    /// lifetime is never handed out), CaptchaAI's error code, or `ERROR_CAPTCHA_UNSOLVABLE` for a
    /// task that expired without a result.
    pub fn compat_answer(&self, now: Timestamp) -> (bool, String) {
        let fresh_or_expired = |solution: &Solution, clock: Timestamp| {
            if self.kind.token_lifetime().is_some_and(|life| now >= clock.plus(life)) {
                (false, "ERROR_TOKEN_EXPIRED".to_owned())
            } else {
                (true, solution.expose().to_owned())
            }
        };
        match &self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => {
                (false, "CAPCHA_NOT_READY".into())
            }
            TaskState::Solved { solution, token_clock_start, .. } => fresh_or_expired(solution, *token_clock_start),
            TaskState::Failed { code, .. } => (false, code.as_ref().to_owned()),
            TaskState::Expired { late, .. } => match late {
                Some(l) => match &l.outcome {
                    Outcome::Solved(s) => fresh_or_expired(s, l.token_clock_start),
                    Outcome::Failed(c) => (false, c.as_ref().to_owned()),
                },
                None => (false, "ERROR_CAPTCHA_UNSOLVABLE".into()),
            },
        }
    }

    /// The user agent to use the answer [`Self::compat_answer`] hands out with, if CaptchaAI
    /// named one (only while that answer is a fresh solution).
    pub fn compat_user_agent(&self, now: Timestamp) -> Option<&str> {
        let solution = match &self.state {
            TaskState::Solved { solution, .. } => solution,
            TaskState::Expired { late: Some(LateResult { outcome: Outcome::Solved(s), .. }), .. } => s,
            _ => return None,
        };
        if self.compat_answer(now).0 { solution.user_agent() } else { None }
    }

    /// The `webhook-id` of a push of this task's result: the same for the same result, however
    /// often it is sent (owners de-duplicate on it), different when the result changes (a
    /// replacement, a late result). `None` while the task is open.
    pub fn webhook_id(&self) -> Option<String> {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        h.update(self.task_ref.as_ref().as_bytes());
        let mut part = |b: &str| {
            h.update([0]);
            h.update(b.as_bytes());
        };
        match &self.state {
            TaskState::Queued { .. } | TaskState::Submitting { .. } | TaskState::Pending { .. } => return None,
            TaskState::Solved { solution, .. } => {
                part("solved");
                part(solution.expose());
            }
            TaskState::Failed { code, .. } => {
                part("failed");
                part(code.as_ref());
            }
            TaskState::Expired { late, .. } => {
                part("expired");
                match late.as_ref().map(|l| &l.outcome) {
                    Some(Outcome::Solved(s)) => part(s.expose()),
                    Some(Outcome::Failed(c)) => part(c.as_ref()),
                    None => {}
                }
            }
        }
        Some(format!("msg_{}", &hex::encode(h.finalize())[..32]))
    }
}

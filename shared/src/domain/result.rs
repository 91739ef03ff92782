//! A task's result as it arrives: the solution (redacted when printed), CaptchaAI's verdict,
//! and the delivery that carries either, with the path it came by.

use std::fmt;

use serde::{Deserialize, Serialize};

use super::CaptchaId;
use crate::codes::{ErrorCode, ParseError};
use crate::time::Timestamp;

/// A solved captcha's answer (a token, or an image's text), with the user agent it was earned
/// with where CaptchaAI names one (reCAPTCHA Enterprise, a Cloudflare challenge: the token works
/// only with it). Never printed: `Debug` redacts it. Two solutions are the same result when
/// their answers are: a user agent one delivery names and another does not changes nothing.
#[derive(Clone)]
pub struct Solution {
    text: String,
    user_agent: Option<String>,
}

impl PartialEq for Solution {
    fn eq(&self, other: &Self) -> bool {
        self.text == other.text
    }
}

impl Eq for Solution {}

impl Solution {
    /// Largest answer accepted; real tokens are a few KiB.
    pub const MAX_LEN: usize = 12 * 1024;
    /// Largest user agent kept.
    pub const MAX_USER_AGENT: usize = 1024;

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        if s.is_empty() {
            return Err(ParseError("solution is empty".into()));
        }
        if s.len() > Self::MAX_LEN {
            return Err(ParseError(format!("solution is longer than {} bytes", Self::MAX_LEN)));
        }
        // No token or image answer holds a control character; one that does is not a result.
        if s.chars().any(char::is_control) {
            return Err(ParseError("solution holds a control character".into()));
        }
        Ok(Self { text: s.to_owned(), user_agent: None })
    }

    /// The solution with the user agent it was earned with. One that is empty, too long or
    /// holds a control character is not a user agent and is left out.
    pub fn with_user_agent(mut self, ua: Option<&str>) -> Self {
        self.user_agent = ua
            .map(str::trim)
            .filter(|u| !u.is_empty() && u.len() <= Self::MAX_USER_AGENT && !u.chars().any(char::is_control))
            .map(str::to_owned);
        self
    }

    /// The token itself. Call only where it leaves to its owner (an API response, the store).
    pub fn expose(&self) -> &str {
        &self.text
    }

    /// The user agent to use the token with, when CaptchaAI named one.
    pub fn user_agent(&self) -> Option<&str> {
        self.user_agent.as_deref()
    }
}

impl fmt::Debug for Solution {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Solution(<redacted, {} bytes>)", self.text.len())
    }
}

/// How a task's final state was reached.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Via {
    /// The pingback from CaptchaAI.
    Callback,
    /// The fallback poller reading res.php.
    Poll,
    /// A dead letter re-applied by the redrive function.
    Redrive,
    /// The submit itself (in.php refused the task).
    Submit,
    /// The poller's deadline (no answer in time).
    Deadline,
}

impl Via {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Callback => "callback",
            Self::Poll => "poll",
            Self::Redrive => "redrive",
            Self::Submit => "submit",
            Self::Deadline => "deadline",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        [Self::Callback, Self::Poll, Self::Redrive, Self::Submit, Self::Deadline]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| ParseError(format!("unknown resolution path `{s}`")))
    }
}

/// The result CaptchaAI reported for a task.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    Solved(Solution),
    Failed(ErrorCode),
}

/// A result as it came in — by pingback, poll or redrive — before it is applied to its task.
/// (Not a push: the relay pushing a result to its owner is a delivery, `crate::delivery`.)
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingResult {
    pub captcha_id: CaptchaId,
    pub outcome: Outcome,
    pub received_at: Timestamp,
    pub via: Via,
    /// The earliest moment the token can have been issued, as far as this path knows: the
    /// freshness clock starts there, so a token is never handed out older than its lifetime. A
    /// poll knows the last moment res.php still said "not ready" (or the submit); a pingback
    /// knows nothing — it may have been delayed — so it says 0 and the task's creation bounds it.
    pub token_clock_start: Timestamp,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solution_debug_never_shows_the_token() {
        let s = Solution::parse("03AGdBq2-secret-token").expect("valid");
        let shown = format!("{s:?}");
        assert!(!shown.contains("secret"), "{shown}");
        assert!(Solution::parse("").is_err());
        assert!(Solution::parse(&"x".repeat(Solution::MAX_LEN + 1)).is_err());
    }
}

//! The plan's size: `threadsinfo`'s answer ([`ThreadsInfo`]), read as CaptchaAI's SDK reads it.

use serde::{Deserialize, Serialize};

use super::answer::{RawAnswer, code, parse_answer};
use super::error::CaptchaAiError;

/// The plan's size as `threadsinfo` states it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ThreadsInfo {
    /// Threads the plan has.
    pub threads: u32,
    /// Threads solving a task now (this relay's and any other client's on the account).
    pub working_threads: u32,
}

impl ThreadsInfo {
    pub fn free(&self) -> u32 {
        self.threads.saturating_sub(self.working_threads)
    }
}

/// Reads `threadsinfo`'s answer: top-level `threads` and `working_threads` (numbers or numeric
/// strings, as CaptchaAI's SDK reads them); a refusal is its code.
pub fn parse_threads_info(http_status: u16, body: &str) -> Result<ThreadsInfo, CaptchaAiError> {
    let count = |v: &serde_json::Value| match v {
        serde_json::Value::Number(n) => n.as_u64().and_then(|n| u32::try_from(n).ok()),
        serde_json::Value::String(s) => s.trim().parse().ok(),
        _ => None,
    };
    if let Ok(v) = serde_json::from_str::<serde_json::Value>(body.trim())
        && let (Some(threads), Some(working_threads)) = (count(&v["threads"]), count(&v["working_threads"]))
    {
        return Ok(ThreadsInfo { threads, working_threads });
    }
    match parse_answer(http_status, body)? {
        RawAnswer::Code(c) => Err(CaptchaAiError::Code(code(&c)?)),
        RawAnswer::Ok(_) => Err(CaptchaAiError::NotAnAnswer("threadsinfo without `threads`".into())),
    }
}

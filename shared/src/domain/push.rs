//! The push of a task's result to its owner's callback: the form a compat pingback takes and
//! where the push stands. Stored on the task; sent by [`crate::delivery`].

use serde::{Deserialize, Serialize};

use crate::codes::ParseError;
use crate::time::Timestamp;

/// How a task submitted through `in.php` with a `pingback` gets its result pushed there: as
/// CaptchaAI sends a pingback, `GET <url>?id=…&code=…` (the default: code written for
/// CaptchaAI has a GET route), or as 2captcha does, a `POST` form `id=…&code=…` — a setting of
/// the relay key, for code written against 2captcha.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PingbackForm {
    #[default]
    Get,
    Post,
}

impl PingbackForm {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Get => "get",
            Self::Post => "post",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        match s.trim().to_ascii_lowercase().as_str() {
            "get" | "captchaai" => Ok(Self::Get),
            "post" | "2captcha" => Ok(Self::Post),
            other => Err(ParseError(format!(
                "pingback form `{other}` is neither `get` (CaptchaAI's) nor `post` (2captcha's)"
            ))),
        }
    }
}

/// Where the push of a task's result to its owner's callback stands.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeliveryState {
    pub status: DeliveryStatus,
    /// Attempts made for the current result (a claim counts one before it is sent).
    pub attempts: u32,
    /// When the next attempt is due (while pending or retrying).
    pub next_attempt_at: Option<Timestamp>,
    pub last_attempt_at: Option<Timestamp>,
    /// What the last attempt got: `HTTP 500`, `timeout`, … (never a response body).
    pub last_outcome: Option<String>,
    pub delivered_at: Option<Timestamp>,
    /// The `webhook-id` last delivered: the same result is never pushed under another id.
    pub delivered_id: Option<String>,
    pub parked_at: Option<Timestamp>,
    /// Failed attempts recorded for the current result, per schedule: what the next wait
    /// follows (a lost attempt is not one).
    pub failures: super::schedule::Failures,
}

/// The push's status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DeliveryStatus {
    /// Nothing to push yet: the task is still open.
    #[default]
    Waiting,
    /// Due now (the first attempt, or a replay).
    Pending,
    /// An attempt failed; the next is scheduled.
    Retrying,
    /// The owner's endpoint answered 2xx.
    Delivered,
    /// Every attempt failed, or the URL was refused at send time: kept for an operator to list
    /// and replay.
    Parked,
    /// The owner's endpoint answered 410: no more attempts.
    Gone,
}

impl DeliveryStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Waiting => "waiting",
            Self::Pending => "pending",
            Self::Retrying => "retrying",
            Self::Delivered => "delivered",
            Self::Parked => "parked",
            Self::Gone => "gone",
        }
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        [Self::Waiting, Self::Pending, Self::Retrying, Self::Delivered, Self::Parked, Self::Gone]
            .into_iter()
            .find(|v| v.as_str() == s)
            .ok_or_else(|| ParseError(format!("unknown delivery status `{s}`")))
    }
}

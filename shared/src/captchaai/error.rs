//! [`CaptchaAiError`]: what went wrong talking to CaptchaAI, and how each kind of trouble is
//! classed (transient or not, whether a submit may have been accepted all the same).

use crate::codes::{CodeClass, ErrorCode};

/// What went wrong talking to CaptchaAI. Never carries the account key or a token.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CaptchaAiError {
    #[error("CaptchaAI answered {0}")]
    Code(ErrorCode),
    #[error("CaptchaAI answered HTTP {0}")]
    Http(u16),
    #[error("CaptchaAI answered something that is not a protocol answer: {0}")]
    NotAnAnswer(String),
    /// A batch read (`ids=`) answered with a different number of parts than ids.
    #[error("CaptchaAI's batch answer does not match the request: {0}")]
    BatchShape(String),
    #[error("CaptchaAI did not answer in time")]
    Timeout,
    #[error("could not connect to CaptchaAI: {0}")]
    Connect(String),
    #[error("request to CaptchaAI failed: {0}")]
    Transport(String),
}

impl CaptchaAiError {
    /// The protocol class: codes by the table, anything else from the transport is transient.
    pub fn class(&self) -> CodeClass {
        match self {
            Self::Code(c) => c.class(),
            Self::Http(s) if *s < 500 && *s != 429 => CodeClass::Unknown,
            _ => CodeClass::Transient,
        }
    }

    /// Whether this answer to a batch read (`ids=`) says the server does not take the batch form:
    /// a wrong part count, or a request-level code a server gives when it ignores `ids=` (it sees
    /// no `id`). Transient trouble (timeouts, 5xx, bans) never means that.
    pub fn batch_unsupported(&self) -> bool {
        match self {
            Self::BatchShape(_) => true,
            Self::Code(c) => matches!(
                c.as_ref(),
                "ERROR_WRONG_CAPTCHA_ID" | "ERROR_WRONG_ID_FORMAT" | "ERROR_EMPTY_ACTION" | "ERROR_BAD_PARAMETERS"
            ),
            _ => false,
        }
    }

    /// Whether CaptchaAI may have accepted the request even though we saw an error: anything but
    /// an explicit protocol answer, or a connection that never opened. A timeout, a connection
    /// cut after the request went out, an HTTP error or an HTML page (a CDN answers 502 after the
    /// origin took the task) prove nothing. A submit with this outcome must not be called failed,
    /// and sending it again could pay twice.
    pub fn outcome_unknown(&self) -> bool {
        !matches!(self, Self::Code(_) | Self::Connect(_))
    }

    /// The code to show and store: the CaptchaAI code, or a relay code for transport trouble.
    pub fn code(&self) -> String {
        match self {
            Self::Code(c) => c.as_ref().to_owned(),
            Self::Http(s) => format!("HTTP_{s}"),
            Self::NotAnAnswer(_) => "NOT_AN_ANSWER".into(),
            Self::BatchShape(_) => "BATCH_SHAPE".into(),
            Self::Timeout => "TIMEOUT".into(),
            Self::Connect(_) => "CONNECT_FAILED".into(),
            Self::Transport(_) => "TRANSPORT_FAILED".into(),
        }
    }

    pub(super) fn from_reqwest(e: reqwest::Error) -> Self {
        // The URL of a res.php read carries the account key: never keep it.
        let e = e.without_url();
        if e.is_timeout() {
            Self::Timeout
        } else if e.is_connect() {
            Self::Connect(e.to_string())
        } else {
            Self::Transport(e.to_string())
        }
    }
}

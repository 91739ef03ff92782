//! CaptchaAI's answer codes and what each one means for us, and the parse error every value
//! from outside (a code here, an id or a kind in [`crate::domain`]) is refused with.

use std::fmt;

/// Why a value from outside could not be parsed. The message is safe to show a caller.
///
/// Defined here, below the domain (which builds on [`ErrorCode`]), so the dependency runs one
/// way: `domain` uses `codes`, never the reverse. Also `crate::domain::ParseError`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(pub String);

/// A code CaptchaAI answers with instead of a result, e.g. `ERROR_CAPTCHA_UNSOLVABLE`.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct ErrorCode(String);

impl ErrorCode {
    pub fn parse(s: &str) -> Result<Self, ParseError> {
        let s = s.trim();
        if s.is_empty() || s.len() > 128 || s.chars().any(char::is_control) {
            return Err(ParseError("error code must be 1 to 128 printable characters".into()));
        }
        Ok(Self(s.to_owned()))
    }

    pub fn class(&self) -> CodeClass {
        classify(&self.0)
    }
}

impl AsRef<str> for ErrorCode {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// What to do about a code, per the protocol's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CodeClass {
    /// `CAPCHA_NOT_READY`: ask again later.
    NotReady,
    /// Back off and retry; never hammer.
    Transient,
    /// The task is over; mark it failed with the code. The client may submit again.
    TerminalForTask,
    /// The request or the account is wrong; reject with a clear error, do not retry.
    Permanent,
    /// Not in the table: transient a bounded number of times, then terminal.
    Unknown,
}

impl CodeClass {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::NotReady => "not_ready",
            Self::Transient => "transient",
            Self::TerminalForTask => "terminal",
            Self::Permanent => "permanent",
            Self::Unknown => "unknown",
        }
    }
}

const TRANSIENT: &[&str] = &[
    "ERROR_NO_SLOT_AVAILABLE",
    "ERROR_ZERO_BALANCE",
    "MAX_USER_TURN",
    "IP_BANNED",
    "ERROR_TOO_MUCH_REQUESTS",
    "ERROR_SERVER_ERROR",
    "ERROR_INTERNAL_SERVER_ERROR",
];

const TERMINAL: &[&str] = &[
    "ERROR_CAPTCHA_UNSOLVABLE",
    "ERROR_BAD_DUPLICATES",
    "ERROR_TOKEN_EXPIRED",
    "ERROR_PROXY_CONNECTION_FAILED",
    "ERROR_WRONG_CAPTCHA_ID",
];

const PERMANENT: &[&str] = &[
    "ERROR_WRONG_USER_KEY",
    "ERROR_KEY_DOES_NOT_EXIST",
    "ERROR_PAGEURL",
    "ERROR_GOOGLEKEY",
    "ERROR_WRONG_GOOGLEKEY",
    "ERROR_BAD_TOKEN_OR_PAGEURL",
    "ERROR_BAD_PARAMETERS",
    "ERROR_PROXY_FORMAT",
    "ERROR_BAD_PROXY",
    "ERROR_IP_NOT_ALLOWED",
    "ERROR_WRONG_ID_FORMAT",
    "ERROR_EMPTY_ACTION",
    "ERROR_ZERO_CAPTCHA_FILESIZE",
    "ERROR_TOO_BIG_CAPTCHA_FILESIZE",
    "ERROR_WRONG_FILE_EXTENSION",
    "ERROR_IMAGE_TYPE_NOT_SUPPORTED",
    "ERROR_UPLOAD",
    "ERROR_CAPTCHAIMAGE_BLOCKED",
];

/// Classifies a code CaptchaAI answered with. Account suspensions (`ERROR: 1001` to
/// `ERROR: 1005`) are transient: they lift after minutes.
pub fn classify(code: &str) -> CodeClass {
    let code = code.trim();
    if code == "CAPCHA_NOT_READY" || code == "CAPTCHA_NOT_READY" {
        CodeClass::NotReady
    } else if TRANSIENT.contains(&code) || code.starts_with("ERROR: 100") {
        CodeClass::Transient
    } else if TERMINAL.contains(&code) {
        CodeClass::TerminalForTask
    } else if PERMANENT.contains(&code) {
        CodeClass::Permanent
    } else {
        CodeClass::Unknown
    }
}

/// Whether a pingback's `code` is an error code rather than an answer. Answers are tokens or
/// an image's text; error codes are the listed ones or anything shaped `ERROR_…` / `ERROR: …`.
pub fn is_error_code(code: &str) -> bool {
    classify(code) != CodeClass::Unknown || code.starts_with("ERROR_") || code.starts_with("ERROR:")
}

/// How long to wait before asking again after a transient code.
pub fn retry_after_secs(code: &str) -> u64 {
    ban(code).map_or(5, |b| b.duration.as_secs())
}

/// A code that stops traffic for a while: an IP or account suspension, a rate ban, or a key
/// the service does not accept. Every further request extends or repeats it, so the relay stops
/// ALL CaptchaAI traffic (the account-wide breaker) for `duration`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ban {
    pub duration: std::time::Duration,
    /// A key or account problem: only an operator can end it; `duration` is the long back-off
    /// after which one request tries again.
    pub needs_operator: bool,
}

/// The ban a code means, with its documented duration (`ERROR: 1001`–`1005` per the protocol's
/// rate-limit table; `ERROR: 1005` is "5–10 min", so 10).
pub fn ban(code: &str) -> Option<Ban> {
    let secs = |s: u64| Some(Ban { duration: std::time::Duration::from_secs(s), needs_operator: false });
    match code.trim() {
        "IP_BANNED" => secs(300),
        "MAX_USER_TURN" => secs(10),
        "ERROR: 1001" => secs(600),
        "ERROR: 1002" => secs(300),
        "ERROR: 1003" => secs(30),
        "ERROR: 1004" | "ERROR: 1005" => secs(600),
        c if c.starts_with("ERROR: 100") => secs(600),
        "ERROR_KEY_DOES_NOT_EXIST" | "ERROR_WRONG_USER_KEY" | "ERROR_IP_NOT_ALLOWED" => {
            Some(Ban { duration: std::time::Duration::from_secs(3_600), needs_operator: true })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_in_the_protocol_table_has_its_class() {
        assert_eq!(classify("CAPCHA_NOT_READY"), CodeClass::NotReady);
        for c in TRANSIENT {
            assert_eq!(classify(c), CodeClass::Transient, "{c}");
        }
        for c in TERMINAL {
            assert_eq!(classify(c), CodeClass::TerminalForTask, "{c}");
        }
        for c in PERMANENT {
            assert_eq!(classify(c), CodeClass::Permanent, "{c}");
        }
        assert_eq!(classify("ERROR: 1005"), CodeClass::Transient);
        assert_eq!(classify("ERROR_SOMETHING_NEW"), CodeClass::Unknown);
    }

    #[test]
    fn error_codes_are_told_apart_from_answers() {
        assert!(is_error_code("ERROR_CAPTCHA_UNSOLVABLE"));
        assert!(is_error_code("ERROR_SOMETHING_NEW"));
        assert!(is_error_code("MAX_USER_TURN"));
        assert!(!is_error_code("03AGdBq24PBCbwiDRaS_MJ7Z"));
        assert!(!is_error_code("w68hp"));
    }

    #[test]
    fn retry_after_follows_the_documented_bans() {
        assert_eq!(retry_after_secs("IP_BANNED"), 300);
        assert_eq!(retry_after_secs("MAX_USER_TURN"), 10);
        assert_eq!(retry_after_secs("ERROR: 1003"), 30);
        assert_eq!(retry_after_secs("ERROR: 1005"), 600);
        assert_eq!(retry_after_secs("ERROR_NO_SLOT_AVAILABLE"), 5);
    }

    #[test]
    fn bans_and_key_errors_stop_traffic_other_codes_do_not() {
        for code in ["IP_BANNED", "MAX_USER_TURN", "ERROR: 1001", "ERROR: 1002", "ERROR: 1004", "ERROR: 1005"] {
            assert!(ban(code).is_some_and(|b| !b.needs_operator), "{code}");
        }
        for code in ["ERROR_KEY_DOES_NOT_EXIST", "ERROR_WRONG_USER_KEY"] {
            assert!(ban(code).is_some_and(|b| b.needs_operator && b.duration.as_secs() >= 3_600), "{code}");
        }
        for code in ["ERROR_NO_SLOT_AVAILABLE", "ERROR_CAPTCHA_UNSOLVABLE", "CAPCHA_NOT_READY", "ERROR_SERVER_ERROR"] {
            assert_eq!(ban(code), None, "{code}");
        }
    }
}

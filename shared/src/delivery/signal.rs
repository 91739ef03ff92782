//! What an attempt's answer says about its host's load: the signal the per-host gate's
//! adaptive limit moves by (see [`super::hosts`]).

use crate::webhook::AttemptResult;

/// What the host's answer says about its load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Signal {
    /// Taken (2xx), or an answer that is not about load (410, another 4xx).
    Ok,
    /// 429, 503 or a refused connection.
    Overloaded,
    /// Anything else (a timeout, a 500, a redirect): no change.
    Neutral,
}

/// What an attempt's answer says about the host's load (see [`super::hosts`]).
pub(super) fn signal_of(r: &AttemptResult) -> Signal {
    match r {
        AttemptResult::Delivered { .. } | AttemptResult::Gone => Signal::Ok,
        AttemptResult::Retry { status: Some(429 | 503), .. } => Signal::Overloaded,
        AttemptResult::Retry { status: None, error, .. } if error.starts_with("connection failed") => {
            Signal::Overloaded
        }
        _ => Signal::Neutral,
    }
}

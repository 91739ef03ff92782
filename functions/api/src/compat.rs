//! The 2captcha-compatible front: `/in.php` and `/res.php` as 2captcha and CaptchaAI answer
//! them, so existing code — the official SDKs with `server` pointed at the relay, or hand-written
//! v1 calls — works unchanged, and gains the relay's certain delivery.
//!
//! - `key` is a relay key (named, stored as a digest; see `relay_shared::store::RelayKeys`),
//!   never the CaptchaAI key, which stays in the relay.
//! - `in.php` goes through the very submit path `POST /tasks` uses (breaker, pacing, one
//!   conditional put, never retried after an ambiguous answer, the id never lost); an
//!   `Idempotency-Key` header makes it idempotent too. The id it answers is 18–19 digits.
//! - `res.php?action=get` is answered from the task table: the client's polling never reaches
//!   CaptchaAI (and so can never earn `ERROR: 1005`), and a token past its lifetime is answered
//!   `ERROR_TOKEN_EXPIRED`, never handed out. `getbalance` (cached a few seconds) and
//!   `reportgood`/`reportbad` are passed through to CaptchaAI.
//! - Answers are 2captcha's: HTTP 200 with `OK|…` / a code, or `{"status":…,"request":…}` with
//!   `json=1` (plus `error_text` saying what to do). The relay's own passing trouble (its store
//!   unavailable, CaptchaAI unreachable) is an HTTP 503 with `Retry-After`, which the SDKs treat
//!   as a network error — the Python SDK's polling simply asks again.

mod answer;
mod auth;
mod captcha;
mod form;
mod in_php;
mod params;
mod res_php;

pub use crate::compat_state::bucket::{READ_BURST, READS_PER_SECOND};
pub use crate::compat_state::{BALANCE_FOR, CompatState};
pub use captcha::MAX_IMAGE_BYTES;
pub use in_php::in_php;
pub use res_php::{MAX_IDS, res_php};

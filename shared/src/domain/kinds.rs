//! The captcha kinds: their names, which upstream solves them, their token lifetimes and the
//! solve times the relay's waits and deadlines are drawn from.

use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::codes::ParseError;

/// What kind of captcha a task is; decides token lifetime and solve-time limits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptchaKind {
    RecaptchaV2,
    RecaptchaV3,
    RecaptchaEnterprise,
    Hcaptcha,
    Turnstile,
    Image,
    /// GeeTest v3: the answer is a JSON object (`challenge`, `validate`, `seccode`).
    Geetest,
    /// Cloudflare's challenge page: the answer is a clearance, used with the user agent it was
    /// earned with.
    CloudflareChallenge,
    /// BLS's grid of nine images: the answer is a JSON list of the cells to click.
    Bls,
}

impl CaptchaKind {
    pub const ALL: [CaptchaKind; 9] = [
        Self::RecaptchaV2,
        Self::RecaptchaV3,
        Self::RecaptchaEnterprise,
        Self::Hcaptcha,
        Self::Turnstile,
        Self::Image,
        Self::Geetest,
        Self::CloudflareChallenge,
        Self::Bls,
    ];

    /// The kinds CaptchaAI solves (all but hCaptcha).
    pub const CAPTCHAAI: [CaptchaKind; 8] = [
        Self::RecaptchaV2,
        Self::RecaptchaV3,
        Self::RecaptchaEnterprise,
        Self::Turnstile,
        Self::Image,
        Self::Geetest,
        Self::CloudflareChallenge,
        Self::Bls,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::RecaptchaV2 => "recaptcha_v2",
            Self::RecaptchaV3 => "recaptcha_v3",
            Self::RecaptchaEnterprise => "recaptcha_enterprise",
            Self::Hcaptcha => "hcaptcha",
            Self::Turnstile => "turnstile",
            Self::Image => "image",
            Self::Geetest => "geetest",
            Self::CloudflareChallenge => "cloudflare_challenge",
            Self::Bls => "bls",
        }
    }

    /// Whether CaptchaAI solves it. hCaptcha is 2captcha's: CaptchaAI answers it
    /// `ERROR_SERVER_ERROR` (docs/compat.md), so the relay refuses it unless its upstream is
    /// a 2captcha-compatible service that solves it (`CAPTCHAAI_FLAVOR=2captcha`).
    pub fn captchaai_solves(self) -> bool {
        self != Self::Hcaptcha
    }

    /// Whether the answer is JSON (a GeeTest object, BLS's list of cells), handed out as JSON
    /// in `res.php`'s JSON answers as 2captcha does.
    pub fn structured_answer(self) -> bool {
        matches!(self, Self::Geetest | Self::Bls)
    }

    pub fn parse(s: &str) -> Result<Self, ParseError> {
        Self::ALL.into_iter().find(|k| k.as_str() == s).ok_or_else(|| ParseError(format!("unknown captcha kind `{s}`")))
    }

    /// How long a solution stays usable after it was issued. `None`: it does not expire
    /// (an image's text, BLS's cells). Where no lifetime is published (GeeTest's validate, a
    /// Cloudflare clearance, whose site may set its passage as short as 5 minutes), the long one
    /// of those known, 300 s, is taken.
    pub fn token_lifetime(self) -> Option<Duration> {
        match self {
            Self::RecaptchaV2 | Self::RecaptchaV3 | Self::RecaptchaEnterprise | Self::Hcaptcha => {
                Some(Duration::from_secs(120))
            }
            Self::Turnstile | Self::Geetest | Self::CloudflareChallenge => Some(Duration::from_secs(300)),
            Self::Image | Self::Bls => None,
        }
    }

    /// The typical solve time (the protocol's figures: image 5–20 s, Turnstile 10–15 s,
    /// reCAPTCHA 15–60 s; hCaptcha is not given and is taken as reCAPTCHA's; BLS as an image;
    /// GeeTest and a Cloudflare challenge, not published either, as reCAPTCHA's).
    pub fn typical_solve_time(self) -> (Duration, Duration) {
        let secs = |a, b| (Duration::from_secs(a), Duration::from_secs(b));
        match self {
            Self::Image | Self::Bls => secs(5, 20),
            Self::Turnstile => secs(10, 15),
            Self::RecaptchaV2
            | Self::RecaptchaV3
            | Self::RecaptchaEnterprise
            | Self::Hcaptcha
            | Self::Geetest
            | Self::CloudflareChallenge => secs(15, 60),
        }
    }

    /// When the fallback poller first reads a task that got no callback: 5 s after a typical
    /// solve is done. While callbacks work they have arrived by then (so reads stay rare), and a
    /// token recovered then is young: at most this long old, well inside its lifetime.
    pub fn first_read_after(self) -> Duration {
        self.typical_solve_time().1 + Duration::from_secs(5)
    }

    /// How long a task of this kind is counted as holding a CaptchaAI thread after it is sent,
    /// unless its result comes first: the upper end of its typical solve time. A task whose
    /// pingback was lost is not counted busy until the poller reads it (its grace), nor a slow
    /// one until CaptchaAI gives up; the submit queue's window learns the difference from
    /// CaptchaAI's "no slot" answers (see `crate::submit::window`).
    pub fn busy_for(self) -> Duration {
        self.typical_solve_time().1
    }

    /// After this long without an answer CaptchaAI gives up (`ERROR_CAPTCHA_UNSOLVABLE`): 300 s
    /// for reCAPTCHA, 90 s for the rest (a Cloudflare challenge, solved through the owner's
    /// proxy, is given reCAPTCHA's).
    pub fn max_solve_time(self) -> Duration {
        match self {
            Self::RecaptchaV2 | Self::RecaptchaV3 | Self::RecaptchaEnterprise | Self::CloudflareChallenge => {
                Duration::from_secs(300)
            }
            Self::Hcaptcha | Self::Turnstile | Self::Image | Self::Geetest | Self::Bls => Duration::from_secs(90),
        }
    }

    /// When a task whose in.php outcome is unknown (or whose answer a crash lost) and whose
    /// result has not come is sent again: by then its kind's results normally have come — the
    /// upper end of its typical solve time, doubled for the slow tail, plus the pingback's and
    /// the poller's grace (30 s).
    pub fn resend_after(self) -> Duration {
        self.typical_solve_time().1 * 2 + Duration::from_secs(30)
    }
}

impl fmt::Display for CaptchaKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kinds_round_trip_and_carry_lifetimes() {
        for k in CaptchaKind::ALL {
            assert_eq!(CaptchaKind::parse(k.as_str()), Ok(k));
        }
        assert_eq!(CaptchaKind::Turnstile.token_lifetime(), Some(Duration::from_secs(300)));
        assert_eq!(CaptchaKind::RecaptchaV2.token_lifetime(), Some(Duration::from_secs(120)));
        assert_eq!(CaptchaKind::Image.token_lifetime(), None);
    }
}

//! When a push is tried again: against the life of what it carries, not a generic backoff.
//!
//! A result that carries a token (reCAPTCHA and hCaptcha 120 s, Turnstile 300 s from its
//! issue) is worth something only while the token lives. Its retries are fast and many —
//! [`TOKEN_RETRY`] after each failure, `Retry-After` honoured only as far as the token's life
//! allows — and the last attempt that carries it starts [`TOKEN_LAST_START`] before it dies.
//! When no attempt with the token is left, the owner still learns the outcome: the push becomes
//! the expired notice (its body is built as it leaves, so it no longer holds the token), sent
//! when the token dies and then on the standard schedule. Results without a lifetime (image
//! answers, CaptchaAI's errors, expiries) have only the standard schedule, [`STANDARD_RETRY`].
//!
//! The schedule counts *failures*, the attempts whose outcome was recorded, one count per phase.
//! A lost attempt — the worker killed before or during the request, its claim lapsing — is
//! not a failure: the next try after it is in the slot a real failure would have given, never
//! a later one. A push whose attempts keep being lost without an outcome is parked after
//! [`LOST_ATTEMPTS_LIMIT`] of them, so a push that kills its worker cannot loop for ever.

use std::time::Duration;

use crate::time::Timestamp;

/// The longest wait a `Retry-After` can ask for; longer asks are cut to this.
pub const MAX_RETRY_AFTER: Duration = Duration::from_secs(24 * 60 * 60);

/// Waits after the 1st, 2nd, … failed attempt that carried a live token; every further wait is
/// the last one. ±10 % jitter.
pub const TOKEN_RETRY: [Duration; 6] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(15),
    Duration::from_secs(30),
];

/// The last attempt that carries a token starts at least this long before the token dies.
pub const TOKEN_LAST_START: Duration = Duration::from_secs(3);

/// Waits after the 1st, 2nd, … failed attempt of a result without a lifetime, or of a token's
/// expired notice: 5 s, 5 min, 30 min, 2 h, 5 h, 10 h (±20 % jitter), so with the first attempt
/// the standard schedule is at once, 5 s, 5 min, 30 min, 2 h, 5 h, 10 h. A `Retry-After`
/// longer than the wait wins, up to [`MAX_RETRY_AFTER`].
pub const STANDARD_RETRY: [Duration; 6] = [
    Duration::from_secs(5),
    Duration::from_secs(5 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(2 * 60 * 60),
    Duration::from_secs(5 * 60 * 60),
    Duration::from_secs(10 * 60 * 60),
];

/// Attempts on the standard schedule before a push is parked (`DELIVERY_MAX_ATTEMPTS`).
pub const MAX_ATTEMPTS: u32 = 7;

/// Attempts lost without an outcome (the worker died each time) before a push is parked.
pub const LOST_ATTEMPTS_LIMIT: u32 = 10;

/// Which schedule an attempt is on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// It carries a token that is still alive.
    Token,
    /// A result without a lifetime, or a token's expired notice.
    Standard,
}

impl Phase {
    /// The phase of an attempt made at `at` for a push whose token dies at `token_dies_at`.
    pub fn at(token_dies_at: Option<Timestamp>, at: Timestamp) -> Self {
        if token_dies_at.is_some_and(|d| at < d) { Self::Token } else { Self::Standard }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Token => "token",
            Self::Standard => "standard",
        }
    }
}

/// Failed attempts recorded for the current result, per phase.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Failures {
    pub token: u32,
    pub standard: u32,
}

impl Failures {
    pub fn total(self) -> u32 {
        self.token + self.standard
    }
}

/// A failed attempt, as the schedule sees it.
#[derive(Debug, Clone, Copy)]
pub struct Failed {
    /// When the request started (its body was built then: this says whether it held the token).
    pub sent_at: Timestamp,
    /// When its outcome was known.
    pub ended_at: Timestamp,
    /// What the owner asked for, if anything.
    pub retry_after: Option<Duration>,
}

/// What comes after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Try again at `at`, with these failure counts.
    Retry {
        at: Timestamp,
        failures: Failures,
        /// The attempt at `at` is the first after the token died: the push is the expired
        /// notice now.
        token_died: bool,
    },
    /// No attempts left: keep it for an operator.
    Park,
}

/// The next attempt after `failed`, for a push whose token (if it carries one) dies at
/// `token_dies_at`, with `before` failures recorded so far. `jitter` is a number in [0, 1)
/// (0.5 = none).
pub fn after_failure(
    token_dies_at: Option<Timestamp>,
    failed: &Failed,
    before: Failures,
    max_attempts: u32,
    jitter: f64,
) -> Next {
    let jitter = if jitter.is_finite() { jitter.clamp(0.0, 1.0) } else { 0.5 };
    let asked = failed.retry_after.map(|d| d.min(MAX_RETRY_AFTER));
    if let Some(dies) = token_dies_at
        && Phase::at(token_dies_at, failed.sent_at) == Phase::Token
    {
        let failures = Failures { token: before.token + 1, ..before };
        let wait = TOKEN_RETRY[(failures.token as usize - 1).min(TOKEN_RETRY.len() - 1)].mul_f64(0.9 + 0.2 * jitter);
        let wait = asked.map_or(wait, |a| wait.max(a));
        let last_start = dies.minus(TOKEN_LAST_START);
        let at = failed.ended_at.plus(wait);
        if at <= last_start {
            return Next::Retry { at, failures, token_died: false };
        }
        // One more attempt still fits before the token dies, at the latest moment it can start
        // (a longer Retry-After is honoured only this far).
        if failed.ended_at.plus(Duration::from_millis(250)) < last_start {
            return Next::Retry { at: last_start, failures, token_died: false };
        }
        // None fits: the expired notice, when the token dies, then the standard schedule.
        return Next::Retry { at: dies.max(failed.ended_at), failures, token_died: true };
    }
    let failures = Failures { standard: before.standard + 1, ..before };
    if failures.standard >= max_attempts {
        return Next::Park;
    }
    let wait =
        STANDARD_RETRY[(failures.standard as usize - 1).min(STANDARD_RETRY.len() - 1)].mul_f64(0.8 + 0.4 * jitter);
    let wait = asked.map_or(wait, |a| wait.max(a)).min(MAX_RETRY_AFTER);
    Next::Retry { at: failed.ended_at.plus(wait), failures, token_died: false }
}

/// The whole schedule of a push that fails every time, each request taking `took`, from a
/// result recorded at `recorded` whose token (if any) dies at `token_dies_at`: the start of
/// every attempt, until it is parked. For the README's table and the tests.
pub fn every_attempt(
    recorded: Timestamp,
    token_dies_at: Option<Timestamp>,
    took: Duration,
    max_attempts: u32,
) -> Vec<(Timestamp, Phase)> {
    let mut starts = Vec::new();
    let (mut at, mut failures) = (recorded, Failures::default());
    loop {
        starts.push((at, Phase::at(token_dies_at, at)));
        let f = Failed { sent_at: at, ended_at: at.plus(took), retry_after: None };
        match after_failure(token_dies_at, &f, failures, max_attempts, 0.5) {
            Next::Retry { at: next, failures: n, .. } => {
                at = next;
                failures = n;
            }
            Next::Park => return starts,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(ms: u64) -> Timestamp {
        Timestamp::from_millis(ms)
    }

    fn s(secs: u64) -> Duration {
        Duration::from_secs(secs)
    }

    fn offsets(starts: &[(Timestamp, Phase)], from: Timestamp) -> Vec<(u64, Phase)> {
        starts.iter().map(|(at, p)| (at.since(from).as_millis() as u64, *p)).collect()
    }

    #[test]
    fn a_recaptcha_token_is_tried_fast_until_just_before_it_dies_then_the_notice_follows_the_standard_schedule() {
        // Recorded 5 s after its issue: 115 s left. Each failure takes 100 ms.
        let rec = t(1_000_000);
        let dies = rec.plus(s(115));
        let all = every_attempt(rec, Some(dies), Duration::from_millis(100), MAX_ATTEMPTS);
        let got = offsets(&all, rec);
        use Phase::*;
        let token: Vec<(u64, Phase)> = got.iter().copied().filter(|(_, p)| *p == Token).collect();
        assert_eq!(
            token,
            [
                (0, Token),
                (1_100, Token),
                (3_200, Token),
                (7_300, Token),
                (15_400, Token),
                (30_500, Token),
                (60_600, Token),
                (90_700, Token),
                (112_000, Token), // the last start, 3 s before it dies (the 30 s step would be late)
            ]
        );
        let notice: Vec<u64> = got.iter().filter(|(_, p)| *p == Standard).map(|(o, _)| *o).collect();
        assert_eq!(notice[0], 115_000, "the expired notice goes when the token dies");
        let waits: Vec<u64> = notice.windows(2).map(|w| (w[1] - w[0]) / 100).collect();
        // 5 s, 5 min, 30 min, 2 h, 5 h, 10 h after each failure (in 100 ms units, + 100 ms each).
        assert_eq!(waits, [51, 3001, 18001, 72001, 180_001, 360_001]);
        assert_eq!(notice.len() as u32, MAX_ATTEMPTS, "then parked");
        assert!(all.iter().all(|(at, p)| *p == Standard || *at <= dies.minus(TOKEN_LAST_START)));
    }

    #[test]
    fn results_without_a_lifetime_have_the_standard_schedule_only() {
        let rec = t(0);
        let got: Vec<u64> =
            every_attempt(rec, None, Duration::ZERO, MAX_ATTEMPTS).iter().map(|(a, _)| a.as_secs()).collect();
        assert_eq!(got, [0, 5, 305, 2105, 9305, 27305, 63305]);
        assert_eq!(every_attempt(rec, None, Duration::ZERO, 3).len(), 3, "a smaller maximum parks earlier");
    }

    #[test]
    fn retry_after_is_honoured_only_as_far_as_the_token_allows() {
        let dies = t(120_000);
        let f = |ended: u64, asked: u64| Failed { sent_at: t(ended), ended_at: t(ended), retry_after: Some(s(asked)) };
        // Asked for 2 s with plenty of life left: 2 s (the 1 s step is shorter).
        assert_eq!(
            after_failure(Some(dies), &f(10_000, 2), Failures::default(), MAX_ATTEMPTS, 0.5),
            Next::Retry { at: t(12_000), failures: Failures { token: 1, standard: 0 }, token_died: false }
        );
        // Asked for 120 s with 110 s left: the last start that still carries the token.
        assert_eq!(
            after_failure(Some(dies), &f(10_000, 120), Failures::default(), MAX_ATTEMPTS, 0.5),
            Next::Retry { at: t(117_000), failures: Failures { token: 1, standard: 0 }, token_died: false }
        );
        // On the standard schedule it wins when longer, capped at a day.
        assert_eq!(
            after_failure(None, &f(0, 120), Failures::default(), MAX_ATTEMPTS, 0.5),
            Next::Retry { at: t(120_000), failures: Failures { token: 0, standard: 1 }, token_died: false }
        );
        let Next::Retry { at, .. } = after_failure(None, &f(0, 10 * 86_400), Failures::default(), MAX_ATTEMPTS, 0.5)
        else {
            panic!("parked")
        };
        assert_eq!(at, t(86_400_000));
    }

    #[test]
    fn a_request_that_hangs_past_the_death_of_its_token_is_followed_by_the_notice_at_once() {
        let dies = t(120_000);
        let f = Failed { sent_at: t(110_000), ended_at: t(121_000), retry_after: None };
        assert_eq!(
            after_failure(Some(dies), &f, Failures { token: 4, standard: 0 }, MAX_ATTEMPTS, 0.5),
            Next::Retry { at: t(121_000), failures: Failures { token: 5, standard: 0 }, token_died: true }
        );
        // An attempt made after the death is a standard one, whatever the counts say.
        let f = Failed { sent_at: t(121_000), ended_at: t(121_100), retry_after: None };
        assert_eq!(
            after_failure(Some(dies), &f, Failures { token: 5, standard: 0 }, MAX_ATTEMPTS, 0.5),
            Next::Retry { at: t(126_100), failures: Failures { token: 5, standard: 1 }, token_died: false }
        );
    }

    #[test]
    fn a_lost_attempt_never_moves_the_next_try_to_a_later_slot() {
        // The schedule counts recorded failures: a claim that lapsed (no outcome) leaves the
        // counts alone, so the failure after it gets the wait the first failure would have had.
        let dies = t(120_000);
        let failed = Failed { sent_at: t(30_000), ended_at: t(30_100), retry_after: None };
        let after_a_lost_one = after_failure(Some(dies), &failed, Failures::default(), MAX_ATTEMPTS, 0.5);
        assert_eq!(
            after_a_lost_one,
            Next::Retry { at: t(31_100), failures: Failures { token: 1, standard: 0 }, token_died: false }
        );
    }

    #[test]
    fn jitter_stays_in_its_band_and_bad_values_are_clamped() {
        for i in 0..100 {
            let j = f64::from(i) / 100.0;
            let f = Failed { sent_at: t(0), ended_at: t(0), retry_after: None };
            let Next::Retry { at, .. } = after_failure(Some(t(300_000)), &f, Failures::default(), 7, j) else {
                panic!()
            };
            assert!((900..1100).contains(&at.as_millis()), "{at:?}");
            let Next::Retry { at, .. } = after_failure(None, &f, Failures { token: 0, standard: 1 }, 7, j) else {
                panic!()
            };
            assert!((240_000..360_000).contains(&at.as_millis()), "{at:?}");
        }
        let f = Failed { sent_at: t(0), ended_at: t(0), retry_after: None };
        for bad in [f64::NAN, f64::INFINITY, -3.0, 7.0] {
            assert!(matches!(after_failure(None, &f, Failures::default(), 7, bad), Next::Retry { .. }));
        }
    }
}

//! Retry timing as a pure function, so it can be tested without waiting.

use std::time::Duration;

/// Exponential backoff: `base * 2^(attempt-1)`, capped. `attempt` counts from 1 (the delay
/// before the second try).
pub fn backoff_delay(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let factor = 2u32.saturating_pow(attempt.saturating_sub(1));
    base.saturating_mul(factor).min(cap)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_the_base_and_stops_at_the_cap() {
        let b = Duration::from_millis(200);
        let cap = Duration::from_secs(2);
        let got: Vec<u128> = (1..=6).map(|a| backoff_delay(a, b, cap).as_millis()).collect();
        assert_eq!(got, [200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(backoff_delay(100, b, cap), cap, "huge attempts saturate, never overflow");
    }
}

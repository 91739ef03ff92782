//! Retry timing as a pure function, so it can be tested without waiting.

use std::time::Duration;

/// Exponential backoff: `base * 2^(attempt-1)`, capped. `attempt` counts from 1 (the delay
/// before the second try).
pub fn backoff_delay(attempt: u32, base: Duration, cap: Duration) -> Duration {
    let factor = 2u32.saturating_pow(attempt.saturating_sub(1));
    base.saturating_mul(factor).min(cap)
}

/// A number in [0, 1), for the spreads and jitters.
pub fn unit_random() -> f64 {
    let b = uuid::Uuid::new_v4().into_bytes();
    f64::from(u32::from_le_bytes([b[0], b[1], b[2], b[3]])) / (f64::from(u32::MAX) + 1.0)
}

/// `base` plus a share `unit` (in [0, 1], clamped) of `spread`: callers told to come back
/// later return over a window rather than in the same second, so the retries of an outage do
/// not arrive as one wave when it ends.
pub fn spread(base: Duration, spread: Duration, unit: f64) -> Duration {
    base + spread.mul_f64(if unit.is_finite() { unit.clamp(0.0, 1.0) } else { 0.0 })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spread_stays_in_its_window_and_varies() {
        let (b, w) = (Duration::from_secs(5), Duration::from_secs(10));
        assert_eq!(spread(b, w, 0.0), b);
        assert_eq!(spread(b, w, 1.0), b + w);
        assert_eq!(spread(b, w, 7.0), b + w, "clamped");
        assert_eq!(spread(b, w, f64::NAN), b);
        let draws: Vec<f64> = (0..200).map(|_| unit_random()).collect();
        assert!(draws.iter().all(|u| (0.0..1.0).contains(u)));
        assert!(draws.iter().any(|u| *u < 0.3) && draws.iter().any(|u| *u > 0.7), "spread over the window");
    }

    #[test]
    fn doubles_from_the_base_and_stops_at_the_cap() {
        let b = Duration::from_millis(200);
        let cap = Duration::from_secs(2);
        let got: Vec<u128> = (1..=6).map(|a| backoff_delay(a, b, cap).as_millis()).collect();
        assert_eq!(got, [200, 400, 800, 1600, 2000, 2000]);
        assert_eq!(backoff_delay(100, b, cap), cap, "huge attempts saturate, never overflow");
    }
}

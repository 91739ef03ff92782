//! Small statistics for the report: percentiles, medians with their spread.

/// The `p`-th percentile (0–100) of `v`, nearest rank. `v` need not be sorted. 0 when empty.
pub fn percentile(v: &[f64], p: f64) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let rank = ((p / 100.0) * s.len() as f64).ceil() as usize;
    s[rank.clamp(1, s.len()) - 1]
}

/// A median with the smallest and largest value it was taken over.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Spread {
    pub median: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    pub fn of(v: &[f64]) -> Self {
        Self {
            median: percentile(v, 50.0),
            min: v.iter().copied().fold(f64::INFINITY, f64::min),
            max: v.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        }
    }

    /// `1.42× (1.35–1.45)` style, with `unit` after each number.
    pub fn show(&self, digits: usize, unit: &str) -> String {
        format!("{:.d$}{unit} ({:.d$}–{:.d$})", self.median, self.min, self.max, d = digits)
    }
}

/// CPU time this process has used, in ns, summed over its threads (`/proc/self/task/*/schedstat`,
/// nanosecond resolution on Linux): a cost figure that other processes on a shared machine disturb
/// far less than wall time. `None` where the kernel does not provide it.
pub fn process_cpu_ns() -> Option<u64> {
    cpu_ns("self")
}

/// The same for any process (`pid`, or `self`), from `/proc/<pid>/task/*/schedstat`.
pub fn cpu_ns(pid: &str) -> Option<u64> {
    let mut total = 0u64;
    for entry in std::fs::read_dir(format!("/proc/{pid}/task")).ok()? {
        let path = entry.ok()?.path().join("schedstat");
        // A thread may end between listing and reading: skip it.
        if let Ok(text) = std::fs::read_to_string(path) {
            total += text.split_whitespace().next()?.parse::<u64>().ok()?;
        }
    }
    Some(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 50.0), 50.0);
        assert_eq!(percentile(&v, 99.0), 99.0);
        assert_eq!(percentile(&v, 100.0), 100.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), 2.0);
        assert_eq!(percentile(&[], 50.0), 0.0);
    }

    #[test]
    fn cpu_time_grows_with_work() {
        let Some(before) = process_cpu_ns() else { return };
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        assert!(process_cpu_ns().expect("still readable") > before);
    }

    #[test]
    fn a_spread_has_its_median_and_bounds() {
        let s = Spread::of(&[1.5, 1.2, 1.4]);
        assert_eq!((s.median, s.min, s.max), (1.4, 1.2, 1.5));
        assert_eq!(s.show(2, "×"), "1.40× (1.20–1.50)");
    }
}

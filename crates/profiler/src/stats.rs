//! Repeat a measurement until its spread is small; keep the median and the spread.

use std::time::{Duration, Instant};

/// When to stop sampling one measurement.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    /// Samples always taken (after one discarded warm-up).
    pub min_samples: u32,
    /// Samples never exceeded.
    pub max_samples: u32,
    /// Stop once the relative spread (IQR / median) is at most this.
    pub target_spread: f64,
    /// Stop once this much wall time went into the measurement (after `min_samples`).
    pub budget: Duration,
}

/// The result of one measurement: the median of its samples and their relative spread.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stat {
    pub median: f64,
    /// Interquartile range over the median.
    pub spread: f64,
    pub samples: u32,
}

impl Stat {
    /// Median and spread of `xs` (not empty).
    #[must_use]
    pub fn of(xs: &[f64]) -> Stat {
        let mut v = xs.to_vec();
        v.sort_by(f64::total_cmp);
        let q = |p: f64| {
            let pos = p * (v.len() - 1) as f64;
            let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
            v[lo] + (pos - lo as f64) * (v[hi] - v[lo])
        };
        let median = q(0.5);
        let spread = if median > 0.0 { (q(0.75) - q(0.25)) / median } else { 0.0 };
        Stat { median, spread, samples: v.len() as u32 }
    }
}

/// Takes samples of `f` (each returns one value, e.g. nanoseconds) until `rule` is met. One warm-up call is
/// discarded first.
pub fn sample<E>(rule: Rule, mut f: impl FnMut() -> Result<f64, E>) -> Result<Stat, E> {
    f()?;
    let start = Instant::now();
    let mut xs = Vec::with_capacity(rule.min_samples as usize);
    loop {
        xs.push(f()?);
        let n = xs.len() as u32;
        if n >= rule.min_samples {
            let s = Stat::of(&xs);
            if s.spread <= rule.target_spread || n >= rule.max_samples || start.elapsed() >= rule.budget {
                return Ok(s);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_and_spread() {
        let s = Stat::of(&[10.0, 12.0, 11.0, 13.0, 9.0]);
        assert!((s.median - 11.0).abs() < 1e-12);
        assert!((s.spread - 2.0 / 11.0).abs() < 1e-12, "{s:?}");
        assert_eq!(s.samples, 5);
    }

    #[test]
    fn sampling_stops_when_the_spread_is_small_and_keeps_going_while_it_is_not() {
        let rule =
            Rule { min_samples: 3, max_samples: 50, target_spread: 0.05, budget: Duration::from_secs(5) };
        let mut calls = 0;
        let s = sample(rule, || -> Result<f64, ()> {
            calls += 1;
            Ok(100.0)
        })
        .unwrap();
        assert_eq!((s.samples, calls), (3, 4), "warm-up plus the minimum");
        // Alternating 50 / 150: the spread never falls, so sampling runs to the maximum.
        let mut i = 0;
        let s = sample(rule, || -> Result<f64, ()> {
            i += 1;
            Ok(if i % 2 == 0 { 50.0 } else { 150.0 })
        })
        .unwrap();
        assert_eq!(s.samples, 50);
        assert!(s.spread > 0.5);
    }
}

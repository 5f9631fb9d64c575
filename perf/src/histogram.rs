//! A fixed-size log-linear latency histogram (about 3 % resolution, 1 ns to ~1 h): recording is
//! an index computation and an increment, so it can sit on a receive loop.

/// Sub-buckets per power of two.
const SUB: u32 = 32;
const SUB_BITS: u32 = 5;
const BUCKETS: usize = (64 * SUB) as usize;

/// Counts of values (nanoseconds) by bucket.
#[derive(Clone)]
pub struct Histogram {
    counts: Vec<u64>,
    total: u64,
}

impl Default for Histogram {
    fn default() -> Self {
        Histogram {
            counts: vec![0; BUCKETS],
            total: 0,
        }
    }
}

fn bucket(value: u64) -> usize {
    if value < u64::from(SUB) {
        return value as usize;
    }
    let exponent = 63 - value.leading_zeros();
    let mantissa = (value >> (exponent - SUB_BITS)) as u32 & (SUB - 1);
    ((exponent - SUB_BITS + 1) * SUB + mantissa) as usize
}

fn lower_bound(bucket: usize) -> u64 {
    let bucket = bucket as u32;
    if bucket < SUB {
        return u64::from(bucket);
    }
    let exponent = bucket / SUB + SUB_BITS - 1;
    let mantissa = u64::from(bucket % SUB);
    (1u64 << exponent) | (mantissa << (exponent - SUB_BITS))
}

impl Histogram {
    /// Records one value.
    pub fn record(&mut self, value: u64) {
        let b = bucket(value).min(BUCKETS - 1);
        self.counts[b] += 1;
        self.total += 1;
    }

    /// Adds another histogram's counts.
    pub fn merge(&mut self, other: &Histogram) {
        for (a, b) in self.counts.iter_mut().zip(&other.counts) {
            *a += b;
        }
        self.total += other.total;
    }

    /// Values recorded.
    pub fn count(&self) -> u64 {
        self.total
    }

    /// The value at quantile `q` (0..=1), as the lower bound of its bucket; 0 when empty.
    pub fn quantile(&self, q: f64) -> u64 {
        if self.total == 0 {
            return 0;
        }
        let rank = ((q * self.total as f64).ceil() as u64).clamp(1, self.total);
        let mut seen = 0;
        for (i, &c) in self.counts.iter().enumerate() {
            seen += c;
            if seen >= rank {
                return lower_bound(i);
            }
        }
        lower_bound(BUCKETS - 1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_are_within_a_few_percent() {
        let mut h = Histogram::default();
        for v in 1..=100_000u64 {
            h.record(v * 1000);
        }
        for (q, want) in [
            (0.5, 50_000_000.0),
            (0.99, 99_000_000.0),
            (0.999, 99_900_000.0),
        ] {
            let got = h.quantile(q) as f64;
            assert!((got - want).abs() / want < 0.04, "q{q}: {got} vs {want}");
        }
        assert_eq!(Histogram::default().quantile(0.5), 0);
        for v in [0u64, 1, 31, 32, 33, 1 << 20, u64::MAX / 2] {
            assert!(lower_bound(bucket(v)) <= v, "{v}");
        }
    }
}

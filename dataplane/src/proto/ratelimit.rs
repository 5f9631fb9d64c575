//! A token bucket for log lines a client can trigger at will (permission denials): at most
//! [`BURST`] at once and [`PER_SECOND`] per second after that, as stunnerd's TURN logger. The
//! next line that gets through says how many were suppressed. Per shard, so nothing is shared.

use std::fmt;
use std::time::{Duration, Instant};

/// Lines allowed at once.
pub const BURST: u32 = 3;
/// Lines allowed per second once the burst is spent.
pub const PER_SECOND: u32 = 1;

/// The bucket.
#[derive(Debug, Default)]
pub struct LogLimiter {
    tokens: u32,
    refilled_at: Option<Instant>,
    suppressed: u64,
}

/// How many lines were suppressed before this one; displays as stunnerd's suffix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Suppressed(pub u64);

impl fmt::Display for Suppressed {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0 > 0 {
            write!(f, " (suppressed {} log events)", self.0)
        } else {
            Ok(())
        }
    }
}

impl LogLimiter {
    /// Whether a line may be logged at `now`; if so, the count suppressed since the last one.
    pub fn allow(&mut self, now: Instant) -> Option<Suppressed> {
        match self.refilled_at {
            None => {
                self.tokens = BURST;
                self.refilled_at = Some(now);
            }
            Some(at) => {
                let seconds = now.saturating_duration_since(at).as_secs();
                if seconds > 0 {
                    let refill = u32::try_from(seconds.saturating_mul(u64::from(PER_SECOND)))
                        .unwrap_or(u32::MAX);
                    self.tokens = self.tokens.saturating_add(refill).min(BURST);
                    self.refilled_at = Some(at + Duration::from_secs(seconds));
                }
            }
        }
        if self.tokens == 0 {
            self.suppressed += 1;
            return None;
        }
        self.tokens -= 1;
        Some(Suppressed(std::mem::take(&mut self.suppressed)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bursts_then_one_per_second_with_the_suppressed_count() {
        let mut limiter = LogLimiter::default();
        let t0 = Instant::now();
        let allowed: Vec<_> = (0..10).map(|_| limiter.allow(t0)).collect();
        assert_eq!(
            allowed.iter().filter(|a| a.is_some()).count(),
            BURST as usize
        );
        let next = limiter.allow(t0 + Duration::from_millis(1500)).unwrap();
        assert_eq!(next, Suppressed(7));
        assert_eq!(next.to_string(), " (suppressed 7 log events)");
        assert_eq!(limiter.allow(t0 + Duration::from_millis(1600)), None);
        assert_eq!(
            limiter.allow(t0 + Duration::from_millis(2100)),
            Some(Suppressed(1))
        );
        assert_eq!(Suppressed(0).to_string(), "");
    }
}

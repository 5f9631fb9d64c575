//! What a client may cost before and after it authenticates.
//!
//! - [`SourceBuckets`]: a token bucket per source IP, in a fixed table indexed by a keyed hash
//!   of the IP: no address is stored and nothing grows with the number of sources (sources
//!   whose hashes collide share a budget). The engine budgets the 401/438 challenges it sends
//!   on every transport with one, so a spoofed UDP source cannot turn the server into a
//!   reflection amplifier, nor a stream client that pipelines requests get challenges without
//!   end; second-chance forwarding budgets its owner queries with others
//!   ([`super::sibling::queries`]).
//! - [`AllocationLedger`]: allocations held per user-id and in all, shared by the shards. It is
//!   touched when an allocation is created or released, never per packet.

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

/// Buckets in a [`SourceBuckets`] table (8 bytes each).
pub const SOURCE_BUCKETS: usize = 16_384;

/// Default challenges per second per source IP (all transports).
pub const DEFAULT_CHALLENGE_RATE: u32 = 200;
/// Default challenges a source IP may get at once.
pub const DEFAULT_CHALLENGE_BURST: u32 = 2_000;
/// Default cap on allocations held by all clients together (each holds a relay socket).
pub const DEFAULT_MAX_ALLOCATIONS: usize = 65_536;
/// Default cap on the permissions one allocation may hold (more gets 508).
pub const DEFAULT_MAX_PERMISSIONS: usize = 256;

/// Limits that do not come from the config file (flags).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// 401/438 challenges per second per source IP, on every transport; 0 turns the limit off.
    pub challenge_rate: u32,
    /// Challenges a source may get at once before the rate applies.
    pub challenge_burst: u32,
    /// Allocations held by all clients together; 0 means no cap.
    pub max_allocations: usize,
    /// Permissions one allocation may hold.
    pub max_permissions: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            challenge_rate: DEFAULT_CHALLENGE_RATE,
            challenge_burst: DEFAULT_CHALLENGE_BURST,
            max_allocations: DEFAULT_MAX_ALLOCATIONS,
            max_permissions: DEFAULT_MAX_PERMISSIONS,
        }
    }
}

#[derive(Debug, Clone, Copy, Default)]
struct Bucket {
    tokens: u32,
    /// Milliseconds since the limiter's epoch at the last refill; 0 = never used.
    stamp_ms: u32,
}

/// Per-shard token buckets keyed by source IP, one table for all sources (or one bucket
/// all of them share).
pub struct SourceBuckets {
    rate: u32,
    burst: u32,
    epoch: Instant,
    /// SipHash under keys from the OS: sources cannot be chosen to share a victim's bucket.
    hasher: std::collections::hash_map::RandomState,
    buckets: Box<[Bucket]>,
}

impl SourceBuckets {
    /// Buckets allowing `burst` tokens at once and `rate` per second per source; `rate` 0
    /// allows everything (and allocates no table).
    pub fn new(rate: u32, burst: u32, epoch: Instant) -> SourceBuckets {
        SourceBuckets::with_buckets(rate, burst, epoch, SOURCE_BUCKETS)
    }

    /// One bucket that every source shares: `burst` at once and `rate` per second over all of
    /// them.
    pub fn shared(rate: u32, burst: u32, epoch: Instant) -> SourceBuckets {
        SourceBuckets::with_buckets(rate, burst, epoch, 1)
    }

    fn with_buckets(rate: u32, burst: u32, epoch: Instant, buckets: usize) -> SourceBuckets {
        let size = if rate == 0 { 0 } else { buckets };
        SourceBuckets {
            rate,
            burst: burst.max(1),
            epoch,
            hasher: std::collections::hash_map::RandomState::new(),
            buckets: vec![Bucket::default(); size].into_boxed_slice(),
        }
    }

    /// Whether `ip` may spend a token at `now` (a challenge sent to it, a query for its miss);
    /// takes the token if so.
    pub fn allow(&mut self, ip: IpAddr, now: Instant) -> bool {
        if self.rate == 0 {
            return true;
        }
        // Shifted by one so that 0 marks an unused bucket (wraps after 49 days: harmless, a
        // bucket then refills early once).
        let now_ms = (now.saturating_duration_since(self.epoch).as_millis() as u32).wrapping_add(1);
        let index = match self.buckets.len() {
            1 => 0,
            n => (self.hasher.hash_one(ip) as usize) % n,
        };
        let bucket = &mut self.buckets[index];
        if bucket.stamp_ms == 0 {
            *bucket = Bucket {
                tokens: self.burst,
                stamp_ms: now_ms,
            };
        } else {
            let elapsed = u64::from(now_ms.wrapping_sub(bucket.stamp_ms));
            let refill = elapsed * u64::from(self.rate) / 1000;
            if refill > 0 {
                let tokens = u64::from(bucket.tokens) + refill;
                bucket.tokens = tokens.min(u64::from(self.burst)) as u32;
                // Keep the remainder: advance the stamp only by the time the tokens took.
                let used_ms = refill * 1000 / u64::from(self.rate);
                bucket.stamp_ms = bucket.stamp_ms.wrapping_add(used_ms as u32).max(1);
                if bucket.tokens == self.burst {
                    bucket.stamp_ms = now_ms;
                }
            }
        }
        if bucket.tokens == 0 {
            return false;
        }
        bucket.tokens -= 1;
        true
    }
}

/// Why an allocation could not be reserved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuotaError {
    /// The user-id holds `admin.user_quota` allocations already (486).
    User,
    /// All clients together hold the global cap (508).
    Global,
}

/// Allocations held, per user-id and in all, shared by every shard of the process.
#[derive(Debug, Default)]
pub struct AllocationLedger {
    total: AtomicUsize,
    users: Mutex<HashMap<String, u32>>,
}

impl AllocationLedger {
    /// An empty ledger.
    pub fn new() -> AllocationLedger {
        AllocationLedger::default()
    }

    /// Reserves one allocation for `user_id`, unless it holds `user_quota` already (0: no
    /// quota) or all clients hold `max_total` (0: no cap).
    pub fn reserve(
        &self,
        user_id: &str,
        user_quota: u32,
        max_total: usize,
    ) -> Result<(), QuotaError> {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        if max_total > 0 && self.total.load(Ordering::Relaxed) >= max_total {
            return Err(QuotaError::Global);
        }
        let held = users.get(user_id).copied().unwrap_or(0);
        if user_quota > 0 && held >= user_quota {
            return Err(QuotaError::User);
        }
        match users.get_mut(user_id) {
            Some(count) => *count += 1,
            None => {
                users.insert(user_id.to_owned(), 1);
            }
        }
        self.total.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Releases one allocation of `user_id`.
    pub fn release(&self, user_id: &str) {
        let mut users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(count) = users.get_mut(user_id) {
            *count -= 1;
            if *count == 0 {
                users.remove(user_id);
            }
            self.total.fetch_sub(1, Ordering::Relaxed);
        }
    }

    /// Allocations held by `user_id`.
    pub fn held_by(&self, user_id: &str) -> u32 {
        let users = self.users.lock().unwrap_or_else(|e| e.into_inner());
        users.get(user_id).copied().unwrap_or(0)
    }

    /// Allocations held in all.
    pub fn total(&self) -> usize {
        self.total.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn challenge_bucket_spends_its_burst_then_refills_at_the_rate() {
        let t0 = Instant::now();
        let mut limiter = SourceBuckets::new(10, 5, t0);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let other: IpAddr = "192.0.2.2".parse().unwrap();
        let allowed = (0..20).filter(|_| limiter.allow(ip, t0)).count();
        assert_eq!(allowed, 5);
        // Another source has its own budget (unless the hashes collide: 1 in 16384).
        assert!(limiter.allow(other, t0));
        // 10/s: after 300 ms, 3 more.
        let later = t0 + Duration::from_millis(300);
        assert_eq!((0..20).filter(|_| limiter.allow(ip, later)).count(), 3);
        // Idle for long: back to the burst, never more.
        let much_later = t0 + Duration::from_secs(60);
        assert_eq!((0..20).filter(|_| limiter.allow(ip, much_later)).count(), 5);
    }

    #[test]
    fn a_shared_bucket_is_one_budget_for_every_source() {
        let t0 = Instant::now();
        let mut limiter = SourceBuckets::shared(10, 5, t0);
        let sources: Vec<IpAddr> = (1..=20u8).map(|i| IpAddr::from([192, 0, 2, i])).collect();
        assert_eq!(
            sources.iter().filter(|ip| limiter.allow(**ip, t0)).count(),
            5
        );
        let later = t0 + Duration::from_millis(300);
        assert_eq!(
            sources
                .iter()
                .filter(|ip| limiter.allow(**ip, later))
                .count(),
            3
        );
    }

    #[test]
    fn rate_zero_allows_everything() {
        let t0 = Instant::now();
        let mut limiter = SourceBuckets::new(0, 0, t0);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        assert!((0..10_000).all(|_| limiter.allow(ip, t0)));
    }

    #[test]
    fn ledger_counts_per_user_and_in_all() {
        let ledger = AllocationLedger::new();
        assert_eq!(ledger.reserve("alice", 2, 3), Ok(()));
        assert_eq!(ledger.reserve("alice", 2, 3), Ok(()));
        assert_eq!(ledger.reserve("alice", 2, 3), Err(QuotaError::User));
        assert_eq!(ledger.reserve("bob", 2, 3), Ok(()));
        assert_eq!(ledger.reserve("carol", 2, 3), Err(QuotaError::Global));
        ledger.release("alice");
        assert_eq!(ledger.held_by("alice"), 1);
        assert_eq!(ledger.reserve("carol", 2, 3), Ok(()));
        assert_eq!(ledger.total(), 3);
        // No quota, no cap.
        for _ in 0..100 {
            ledger.reserve("dave", 0, 0).unwrap();
        }
        assert_eq!(ledger.held_by("dave"), 100);
    }
}

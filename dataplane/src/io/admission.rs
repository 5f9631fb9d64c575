//! Caps on TCP/TLS connections that have not authenticated yet (no allocation), shared by
//! every shard: a client that opens connections and never authenticates holds at most
//! `per_ip` of them from one address and the pod at most `total`, whatever it does. Counted
//! on accept and released when the connection authenticates or closes, never per packet.
//!
//! Per-address counts live in a fixed table of atomic counters picked by a keyed hash of the
//! address (SipHash under a random key, as the challenge limiter's buckets, so a client cannot
//! choose addresses that land in a victim's counter): no state is created per client, and two
//! addresses whose hashes collide share one budget (odds 1 in `BUCKETS`).

use std::hash::BuildHasher;
use std::net::IpAddr;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};

/// Per-address counters in the table.
const BUCKETS: usize = 4096;

/// Default for `--max-unauthenticated-connections`.
pub const DEFAULT_MAX_UNAUTHENTICATED: usize = 4096;
/// Default for `--max-unauthenticated-connections-per-ip`.
pub const DEFAULT_MAX_UNAUTHENTICATED_PER_IP: u32 = 64;

/// The caps, from flags (0: no cap).
#[derive(Debug, Clone, Copy)]
pub struct StreamLimits {
    /// Unauthenticated TCP/TLS connections over the whole process.
    pub max_unauthenticated: usize,
    /// Unauthenticated TCP/TLS connections from one client IP address.
    pub max_unauthenticated_per_ip: u32,
}

impl Default for StreamLimits {
    fn default() -> StreamLimits {
        StreamLimits {
            max_unauthenticated: DEFAULT_MAX_UNAUTHENTICATED,
            max_unauthenticated_per_ip: DEFAULT_MAX_UNAUTHENTICATED_PER_IP,
        }
    }
}

/// Why a connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refused {
    /// Its address holds `max_unauthenticated_per_ip` unauthenticated connections already.
    PerIp,
    /// The process holds `max_unauthenticated` already.
    Total,
}

/// A place held by one unauthenticated connection; give it back with
/// [`StreamAdmission::leave`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Place {
    bucket: u16,
}

/// The shared counts.
pub(super) struct StreamAdmission {
    limits: StreamLimits,
    total: AtomicUsize,
    per_ip: Box<[AtomicU32]>,
    hasher: std::collections::hash_map::RandomState,
}

impl StreamAdmission {
    pub(super) fn new(limits: StreamLimits) -> StreamAdmission {
        StreamAdmission {
            limits,
            total: AtomicUsize::new(0),
            per_ip: (0..BUCKETS).map(|_| AtomicU32::new(0)).collect(),
            hasher: std::collections::hash_map::RandomState::new(),
        }
    }

    /// Takes a place for a new connection from `ip`, if the caps allow.
    pub(super) fn enter(&self, ip: IpAddr) -> Result<Place, Refused> {
        let bucket = (self.hasher.hash_one(ip) as usize % BUCKETS) as u16;
        let per_ip = &self.per_ip[usize::from(bucket)];
        let cap = self.limits.max_unauthenticated_per_ip;
        if per_ip
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (cap == 0 || n < cap).then_some(n + 1)
            })
            .is_err()
        {
            return Err(Refused::PerIp);
        }
        let cap = self.limits.max_unauthenticated;
        if self
            .total
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                (cap == 0 || n < cap).then_some(n + 1)
            })
            .is_err()
        {
            per_ip.fetch_sub(1, Ordering::AcqRel);
            return Err(Refused::Total);
        }
        Ok(Place { bucket })
    }

    /// Gives back a place (the connection authenticated or closed).
    pub(super) fn leave(&self, place: Place) {
        self.per_ip[usize::from(place.bucket)].fetch_sub(1, Ordering::AcqRel);
        self.total.fetch_sub(1, Ordering::AcqRel);
    }

    /// Places held now, over the process.
    #[cfg(test)]
    pub(super) fn held(&self) -> usize {
        self.total.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn admission(total: usize, per_ip: u32) -> StreamAdmission {
        StreamAdmission::new(StreamLimits {
            max_unauthenticated: total,
            max_unauthenticated_per_ip: per_ip,
        })
    }

    #[test]
    fn one_address_gets_its_cap_and_no_more_until_a_place_is_given_back() {
        let gate = admission(100, 3);
        let ip: IpAddr = "192.0.2.1".parse().unwrap();
        let places: Vec<Place> = (0..3).map(|_| gate.enter(ip).unwrap()).collect();
        assert_eq!(gate.enter(ip), Err(Refused::PerIp));
        assert_eq!(gate.held(), 3);
        gate.leave(places[0]);
        assert!(gate.enter(ip).is_ok());
        assert_eq!(gate.enter(ip), Err(Refused::PerIp));
    }

    #[test]
    fn the_total_cap_holds_across_addresses_and_a_refusal_holds_nothing() {
        let gate = admission(5, 2);
        let mut held = 0;
        let mut refused_total = 0;
        for i in 0..20u8 {
            match gate.enter(IpAddr::from([198, 51, 100, i])) {
                Ok(_) => held += 1,
                Err(Refused::Total) => refused_total += 1,
                Err(Refused::PerIp) => {}
            }
        }
        assert_eq!(held, 5);
        assert_eq!(gate.held(), 5);
        assert!(refused_total > 0);
        // Refusals for the total gave their per-address place back: once places free up, a
        // refused address gets in.
        let gate = admission(1, 2);
        let a = gate.enter("192.0.2.7".parse().unwrap()).unwrap();
        assert_eq!(
            gate.enter("192.0.2.8".parse().unwrap()),
            Err(Refused::Total)
        );
        gate.leave(a);
        assert!(gate.enter("192.0.2.8".parse().unwrap()).is_ok());
    }

    #[test]
    fn zero_means_no_cap() {
        let gate = admission(0, 0);
        let ip: IpAddr = "::1".parse().unwrap();
        for _ in 0..10_000 {
            gate.enter(ip).unwrap();
        }
        assert_eq!(gate.held(), 10_000);
    }
}

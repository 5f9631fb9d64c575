//! The cache of the routing answers: a time-passed-in map from address to answer.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// Answers per address, each for a while: `ttl` for an answer, `negative_ttl` for a failure
/// (`None`: "no route"), so that a client binding channels to thousands of unroutable peers
/// costs one lookup per address per TTL, not one per request. At most `capacity` entries;
/// when full, an insertion evicts the entry that expires first (an expired one if there is
/// one), in O(1) amortised: answers and failures each have their own TTL, so each kind's
/// oldest insertion is the first of that kind to expire.
pub(crate) struct RouteCache<T> {
    ttl: Duration,
    negative_ttl: Duration,
    capacity: usize,
    entries: HashMap<IpAddr, Cached<T>>,
    /// The insertions of answers, oldest first, each by its generation (a record whose
    /// entry was replaced since is stale, and skipped).
    answers: VecDeque<(IpAddr, u64)>,
    /// The insertions of failures, oldest first.
    failures: VecDeque<(IpAddr, u64)>,
    generation: u64,
}

struct Cached<T> {
    value: Option<T>,
    at: Instant,
    generation: u64,
}

impl<T: Clone> RouteCache<T> {
    pub(crate) fn new(ttl: Duration, negative_ttl: Duration, capacity: usize) -> Self {
        RouteCache {
            ttl,
            negative_ttl,
            capacity,
            entries: HashMap::new(),
            answers: VecDeque::new(),
            failures: VecDeque::new(),
            generation: 0,
        }
    }

    /// The cached answer for `ip` at `now` (`Some(None)`: a cached failure, "no route").
    pub(crate) fn get(&self, ip: IpAddr, now: Instant) -> Option<Option<T>> {
        let entry = self.entries.get(&ip)?;
        (self.remaining(entry, now) > Duration::ZERO).then(|| entry.value.clone())
    }

    pub(crate) fn insert(&mut self, ip: IpAddr, value: Option<T>, now: Instant) {
        if self.capacity == 0 {
            return;
        }
        if !self.entries.contains_key(&ip) {
            while self.entries.len() >= self.capacity && self.evict(now) {}
        }
        self.generation += 1;
        let generation = self.generation;
        if value.is_some() {
            self.answers.push_back((ip, generation));
        } else {
            self.failures.push_back((ip, generation));
        }
        self.entries.insert(
            ip,
            Cached {
                value,
                at: now,
                generation,
            },
        );
        // Replaced entries leave stale records behind: drop them once they outnumber the
        // live ones (at least `capacity` insertions apart, so O(1) amortised).
        if self.answers.len() + self.failures.len() > 2 * self.capacity + 16 {
            let entries = &self.entries;
            let live = |(ip, generation): &(IpAddr, u64)| {
                entries.get(ip).is_some_and(|e| e.generation == *generation)
            };
            self.answers.retain(live);
            self.failures.retain(live);
        }
    }

    /// The number of entries, expired ones included.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }

    /// How long `entry` has still to live at `now`.
    fn remaining(&self, entry: &Cached<T>, now: Instant) -> Duration {
        let ttl = if entry.value.is_some() {
            self.ttl
        } else {
            self.negative_ttl
        };
        ttl.saturating_sub(now.saturating_duration_since(entry.at))
    }

    /// Removes the entry that expires first; false if there is none.
    fn evict(&mut self, now: Instant) -> bool {
        for queue in [&mut self.answers, &mut self.failures] {
            while let Some((ip, generation)) = queue.front() {
                if self
                    .entries
                    .get(ip)
                    .is_some_and(|e| e.generation == *generation)
                {
                    break;
                }
                queue.pop_front();
            }
        }
        let remaining = |queue: &VecDeque<(IpAddr, u64)>| {
            queue
                .front()
                .and_then(|(ip, _)| self.entries.get(ip))
                .map(|entry| self.remaining(entry, now))
        };
        let queue = match (remaining(&self.answers), remaining(&self.failures)) {
            (Some(answer), Some(failure)) if failure < answer => &mut self.failures,
            (Some(_), _) => &mut self.answers,
            (None, Some(_)) => &mut self.failures,
            (None, None) => return false,
        };
        match queue.pop_front() {
            Some((ip, _)) => self.entries.remove(&ip).is_some(),
            None => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(a, b, c, d))
    }

    fn v6(text: &str) -> IpAddr {
        IpAddr::V6(text.parse::<Ipv6Addr>().unwrap())
    }

    #[test]
    fn cache_hits_until_the_ttl() {
        let t0 = Instant::now();
        let mut cache = RouteCache::new(Duration::from_secs(10), Duration::from_secs(2), 8);
        let ip = v4(192, 0, 2, 1);
        assert_eq!(cache.get(ip, t0), None);
        cache.insert(ip, Some(7u32), t0);
        assert_eq!(cache.get(ip, t0), Some(Some(7)));
        assert_eq!(
            cache.get(ip, t0 + Duration::from_millis(9_999)),
            Some(Some(7))
        );
        assert_eq!(cache.get(ip, t0 + Duration::from_secs(10)), None);
        assert_eq!(cache.get(v4(192, 0, 2, 2), t0), None);
        // An instant before the insertion (a caller's clock read early) is still a hit.
        assert_eq!(cache.get(ip, t0 - Duration::from_secs(1)), Some(Some(7)));
        // A new insertion starts a new TTL and replaces the value.
        cache.insert(ip, Some(8), t0 + Duration::from_secs(10));
        assert_eq!(cache.get(ip, t0 + Duration::from_secs(19)), Some(Some(8)));
        assert_eq!(cache.len(), 1);
    }

    #[test]
    fn cache_keeps_failures_for_the_negative_ttl() {
        let t0 = Instant::now();
        let mut cache = RouteCache::<u32>::new(Duration::from_secs(10), Duration::from_secs(2), 8);
        let ip = v6("2001:db8::1");
        cache.insert(ip, None, t0);
        assert_eq!(cache.get(ip, t0), Some(None));
        assert_eq!(cache.get(ip, t0 + Duration::from_millis(1_999)), Some(None));
        assert_eq!(cache.get(ip, t0 + Duration::from_secs(2)), None);
        // A failure replaced by an answer lives for the answer's TTL.
        cache.insert(ip, Some(1), t0 + Duration::from_secs(2));
        assert_eq!(cache.get(ip, t0 + Duration::from_secs(11)), Some(Some(1)));
    }

    #[test]
    fn cache_evicts_an_expired_entry_first() {
        let t0 = Instant::now();
        let mut cache = RouteCache::new(Duration::from_secs(10), Duration::from_secs(2), 3);
        cache.insert(v4(192, 0, 2, 1), Some(1u32), t0);
        // A failure inserted later but expired first.
        cache.insert(v4(192, 0, 2, 2), None, t0 + Duration::from_secs(1));
        cache.insert(v4(192, 0, 2, 3), Some(3), t0 + Duration::from_secs(2));
        let now = t0 + Duration::from_secs(4);
        cache.insert(v4(192, 0, 2, 4), Some(4), now);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(v4(192, 0, 2, 1), now), Some(Some(1)));
        assert_eq!(cache.get(v4(192, 0, 2, 3), now), Some(Some(3)));
        assert_eq!(cache.get(v4(192, 0, 2, 4), now), Some(Some(4)));
        // Nothing expired: the entry that would expire first goes. The answer of 0 s (until
        // 10 s) before the others...
        let now = t0 + Duration::from_secs(5);
        cache.insert(v4(192, 0, 2, 5), None, now);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(v4(192, 0, 2, 1), now), None);
        assert_eq!(cache.get(v4(192, 0, 2, 3), now), Some(Some(3)));
        assert_eq!(cache.get(v4(192, 0, 2, 4), now), Some(Some(4)));
        assert_eq!(cache.get(v4(192, 0, 2, 5), now), Some(None));
        // ... then the failure of 5 s (until 7 s) before the answer of 2 s (until 12 s).
        let now = t0 + Duration::from_secs(6);
        cache.insert(v4(192, 0, 2, 6), Some(6), now);
        assert_eq!(cache.len(), 3);
        assert_eq!(cache.get(v4(192, 0, 2, 3), now), Some(Some(3)));
        assert_eq!(cache.get(v4(192, 0, 2, 4), now), Some(Some(4)));
        assert_eq!(cache.get(v4(192, 0, 2, 5), now), None);
        assert_eq!(cache.get(v4(192, 0, 2, 6), now), Some(Some(6)));
        // An expired failure goes before an older answer that still lives: the failure of
        // 6 s (in place of the answer of 2 s), expired at 9 s, before the answer of 4 s.
        cache.insert(v4(192, 0, 2, 7), None, now);
        assert_eq!(cache.get(v4(192, 0, 2, 3), now), None);
        let now = t0 + Duration::from_secs(9);
        cache.insert(v4(192, 0, 2, 8), Some(8), now);
        assert_eq!(cache.get(v4(192, 0, 2, 4), now), Some(Some(4)));
        assert_eq!(cache.get(v4(192, 0, 2, 6), now), Some(Some(6)));
        assert_eq!(cache.get(v4(192, 0, 2, 8), now), Some(Some(8)));
        assert_eq!(cache.get(v4(192, 0, 2, 7), now), None);
        assert_eq!(cache.len(), 3);
    }

    #[test]
    fn cache_stays_within_its_capacity() {
        let t0 = Instant::now();
        let mut cache = RouteCache::new(Duration::from_secs(10), Duration::from_secs(2), 100);
        for i in 0..10_000u32 {
            let now = t0 + Duration::from_millis(u64::from(i));
            let ip = IpAddr::V4(Ipv4Addr::from(0xc000_0200 + i));
            cache.insert(ip, (i % 3 != 0).then_some(i), now);
            assert!(cache.len() <= 100);
            assert_eq!(cache.get(ip, now), Some((i % 3 != 0).then_some(i)));
        }
        // One address re-inserted over and over keeps the records bounded too.
        let ip = v4(198, 51, 100, 1);
        for i in 0..10_000u64 {
            cache.insert(ip, Some(1), t0 + Duration::from_secs(20 + i));
            assert!(cache.answers.len() + cache.failures.len() <= 2 * 100 + 16);
        }
        assert_eq!(cache.len(), 100);
        // No capacity: nothing is kept.
        let mut none = RouteCache::new(Duration::from_secs(1), Duration::from_secs(1), 0);
        none.insert(ip, Some(1u8), t0);
        assert_eq!(none.get(ip, t0), None);
    }
}

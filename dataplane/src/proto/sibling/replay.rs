//! Anti-replay for sibling messages: per sender, a sliding window over its message counters
//! (RFC 4303 §3.4.3's, as WireGuard keeps it: a bitmap of the last [`WINDOW`] counters below
//! the highest seen). A counter accepted before, or older than the window, is refused. Without
//! it, a message captured on the wire could be sent again as often as the clock check
//! ([`super::FRESH_WINDOW`]) allows, and each copy would be relayed.
//!
//! The senders are a bounded table ([`MAX_SENDERS`]) filled only by messages whose tag checked
//! (the caller's duty), so nobody without the key can make it grow. Forgetting a sender must
//! not reopen its window to its old messages: a message the receiver accepted at wall time `r`
//! carries a clock within [`super::FRESH_WINDOW`] of `r`, so any copy of it is stale
//! once the receiver's clock passes `r + 2 × FRESH_WINDOW`. A sender is therefore forgotten
//! only after [`SENDER_IDLE`] (that long) without a message: swept by
//! [`SenderWindows::handle_timeout`], or evicted, least recently seen first, to make room. A new
//! sender that finds the table full of senders heard from within [`SENDER_IDLE`] is refused
//! ([`SiblingError::TooManySenders`]) rather than evict one whose old messages are still fresh.

use super::{SiblingError, FRESH_WINDOW};
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::time::{Duration, Instant};

/// Words of a window's bitmap.
const WORDS: usize = 8;
/// Counters a window covers below (and including) the highest accepted.
pub const WINDOW: u64 = 64 * WORDS as u64;
/// Senders a receiver keeps a window for (a sender is one shard of one process of a sibling;
/// a rolling update has the old and the new processes' shards at once). At most this many
/// windows of about 100 bytes each: some 400 KiB per shard when full.
pub const MAX_SENDERS: usize = 4096;
/// How long a sender is kept without a message (see the module doc).
pub const SENDER_IDLE: Duration = Duration::from_secs(2 * FRESH_WINDOW.as_secs());

/// The counters accepted from one sender.
#[derive(Debug, Clone)]
pub struct ReplayWindow {
    /// One more than the highest counter accepted (0: none yet).
    next: u64,
    /// Bit `c % WINDOW` is set if counter `c`, within the window, was accepted.
    bits: [u64; WORDS],
}

impl Default for ReplayWindow {
    fn default() -> ReplayWindow {
        ReplayWindow::new()
    }
}

impl ReplayWindow {
    /// A window that has accepted nothing.
    pub fn new() -> ReplayWindow {
        ReplayWindow {
            next: 0,
            bits: [0; WORDS],
        }
    }

    fn bit(counter: u64) -> (usize, u64) {
        let index = counter % WINDOW;
        ((index / 64) as usize, 1u64 << (index % 64))
    }

    /// Clears the bits of counters `from..=to` (they slide into the window, replacing the
    /// counters a whole window below them).
    fn clear(&mut self, from: u64, to: u64) {
        if to - from >= WINDOW - 1 {
            self.bits = [0; WORDS];
            return;
        }
        let mut counter = from;
        loop {
            let last_in_word = (counter | 63).min(to);
            let width = last_in_word - counter + 1;
            let mask = if width == 64 {
                u64::MAX
            } else {
                ((1u64 << width) - 1) << (counter % 64)
            };
            self.bits[((counter % WINDOW) / 64) as usize] &= !mask;
            if last_in_word == to {
                return;
            }
            counter = last_in_word + 1;
        }
    }

    /// Accepts `counter` if it is new and not older than the window; false (and nothing
    /// changes) if it was accepted before or is too old.
    pub fn accept(&mut self, counter: u64) -> bool {
        if counter == u64::MAX {
            // Never sent (a sender stops short of it); refusing it keeps `next` finite.
            return false;
        }
        if counter >= self.next {
            self.clear(self.next, counter);
            let (word, mask) = ReplayWindow::bit(counter);
            self.bits[word] |= mask;
            self.next = counter + 1;
            return true;
        }
        if self.next - counter > WINDOW {
            return false;
        }
        let (word, mask) = ReplayWindow::bit(counter);
        if self.bits[word] & mask != 0 {
            return false;
        }
        self.bits[word] |= mask;
        true
    }
}

#[derive(Debug)]
struct Sender {
    window: ReplayWindow,
    seen: Instant,
}

/// The replay windows of the senders one receiver hears from, at most [`MAX_SENDERS`].
#[derive(Debug)]
pub struct SenderWindows {
    senders: HashMap<u64, Sender, RandomState>,
    capacity: usize,
}

impl Default for SenderWindows {
    fn default() -> SenderWindows {
        SenderWindows::with_capacity(MAX_SENDERS)
    }
}

impl SenderWindows {
    /// A table of at most `capacity` senders.
    pub fn with_capacity(capacity: usize) -> SenderWindows {
        SenderWindows {
            senders: HashMap::with_hasher(RandomState::default()),
            capacity: capacity.max(1),
        }
    }

    /// Accepts message `counter` of `sender` at `now` if it is new (call it only for messages
    /// whose tag checked): [`SiblingError::Replayed`] if not, [`SiblingError::TooManySenders`]
    /// if the sender is new and there is no room for it.
    pub fn accept(&mut self, sender: u64, counter: u64, now: Instant) -> Result<(), SiblingError> {
        if let Some(known) = self.senders.get_mut(&sender) {
            if !known.window.accept(counter) {
                return Err(SiblingError::Replayed);
            }
            known.seen = now;
            return Ok(());
        }
        if self.senders.len() >= self.capacity {
            // Full: make room by the least recently seen sender, if it is safe to forget.
            let oldest = self
                .senders
                .iter()
                .min_by_key(|(_, s)| s.seen)
                .map(|(id, s)| (*id, s.seen));
            match oldest {
                Some((id, seen)) if now.saturating_duration_since(seen) >= SENDER_IDLE => {
                    self.senders.remove(&id);
                }
                _ => return Err(SiblingError::TooManySenders),
            }
        }
        let mut window = ReplayWindow::new();
        if !window.accept(counter) {
            return Err(SiblingError::Replayed);
        }
        self.senders.insert(sender, Sender { window, seen: now });
        Ok(())
    }

    /// Forgets the senders not heard from for [`SENDER_IDLE`].
    pub fn handle_timeout(&mut self, now: Instant) {
        self.senders
            .retain(|_, s| now.saturating_duration_since(s.seen) < SENDER_IDLE);
    }

    /// How many senders it keeps a window for.
    pub fn len(&self) -> usize {
        self.senders.len()
    }

    /// Whether it keeps no sender.
    pub fn is_empty(&self) -> bool {
        self.senders.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_counter_is_accepted_once_in_any_order_within_the_window() {
        let mut window = ReplayWindow::new();
        assert!(window.accept(0));
        assert!(!window.accept(0));
        assert!(window.accept(5));
        // Late, but within the window and new.
        for late in [1, 4, 2, 3] {
            assert!(window.accept(late), "{late}");
            assert!(!window.accept(late), "{late} twice");
        }
        // Gaps are normal (a sender's counter is shared by all its receivers).
        assert!(window.accept(1000));
        assert!(window.accept(1000 - WINDOW + 1), "the window's oldest");
        assert!(!window.accept(1000 - WINDOW), "older than the window");
        assert!(!window.accept(5), "long gone");
        assert!(!window.accept(1000));
        assert!(!window.accept(u64::MAX));
    }

    #[test]
    fn sliding_clears_exactly_the_counters_that_leave_the_window() {
        // Against a model (the set of accepted counters) on a long, jumpy sequence: every
        // step, every slide width, every word boundary.
        let mut window = ReplayWindow::new();
        let mut accepted = std::collections::BTreeSet::new();
        let mut highest: Option<u64> = None;
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut counter: u64 = 0;
        for _ in 0..50_000 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let candidate = match x % 8 {
                // Mostly forward by a little, sometimes by a lot, sometimes back.
                0..=3 => counter + x % 3,
                4 => counter + (x >> 8) % (2 * WINDOW),
                5 => counter + 63 + (x >> 8) % 3,
                _ => counter.saturating_sub((x >> 8) % (WINDOW + 10)),
            };
            let too_old = highest.is_some_and(|h| h >= WINDOW && candidate <= h - WINDOW);
            let expected = !accepted.contains(&candidate) && !too_old;
            assert_eq!(window.accept(candidate), expected, "counter {candidate}");
            if expected {
                accepted.insert(candidate);
                highest = Some(highest.map_or(candidate, |h| h.max(candidate)));
            }
            counter = counter.max(candidate);
        }
    }

    #[test]
    fn senders_have_windows_of_their_own() {
        let t0 = Instant::now();
        let mut windows = SenderWindows::default();
        assert_eq!(windows.accept(1, 0, t0), Ok(()));
        assert_eq!(windows.accept(2, 0, t0), Ok(()));
        assert_eq!(windows.accept(1, 0, t0), Err(SiblingError::Replayed));
        assert_eq!(windows.accept(1, 1, t0), Ok(()));
        assert_eq!(windows.len(), 2);
    }

    #[test]
    fn a_full_table_evicts_only_a_sender_idle_past_any_replay_of_its_messages() {
        let t0 = Instant::now();
        let mut windows = SenderWindows::with_capacity(3);
        for sender in 0..3 {
            windows
                .accept(sender, 0, t0 + Duration::from_secs(sender))
                .unwrap();
        }
        // All heard from lately: a fourth is refused, the known ones go on.
        let soon = t0 + Duration::from_secs(10);
        assert_eq!(
            windows.accept(9, 0, soon),
            Err(SiblingError::TooManySenders)
        );
        assert_eq!(windows.accept(2, 1, soon), Ok(()));
        assert_eq!(windows.len(), 3);
        // Sender 0 is idle for SENDER_IDLE: it makes room, the least recently seen first.
        let later = t0 + SENDER_IDLE;
        assert_eq!(windows.accept(9, 0, later), Ok(()));
        assert_eq!(windows.accept(1, 1, later), Ok(()), "sender 1 kept");
        assert_eq!(windows.accept(9, 0, later), Err(SiblingError::Replayed));
        assert_eq!(windows.len(), 3);
    }

    #[test]
    fn idle_senders_are_swept() {
        let t0 = Instant::now();
        let mut windows = SenderWindows::default();
        windows.accept(1, 0, t0).unwrap();
        windows.accept(2, 0, t0 + Duration::from_secs(30)).unwrap();
        windows.handle_timeout(t0 + SENDER_IDLE - Duration::from_millis(1));
        assert_eq!(windows.len(), 2);
        windows.handle_timeout(t0 + SENDER_IDLE);
        assert_eq!(windows.len(), 1);
        windows.handle_timeout(t0 + Duration::from_secs(30) + SENDER_IDLE);
        assert!(windows.is_empty());
    }

    #[test]
    fn the_table_never_holds_more_than_its_capacity() {
        let t0 = Instant::now();
        let mut windows = SenderWindows::with_capacity(64);
        for sender in 0..10_000u64 {
            let now = t0 + Duration::from_secs(sender);
            let _ = windows.accept(sender, sender, now);
            assert!(windows.len() <= 64);
        }
    }
}

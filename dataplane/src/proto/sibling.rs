//! The messages gateway pods of one gateway ("siblings") exchange to give a client's datagram a
//! second chance: when a client's flow moves to a pod that holds no allocation for it, that pod
//! (the forwarder) hands the datagram to the pod that does (the owner), which answers through
//! the forwarder. This module is the messages' format, encoding and checking; beside it, all
//! without IO (the shards own the sockets and the clocks, and pass the time in):
//! - `keys.rs`: the keys the pods share ([`SiblingKeys`]);
//! - [`replay`]: the receiver's window of sender counters;
//! - [`queries`]: the budgets of owner queries;
//! - [`forwarding`]: the policy ([`Forwarding`]) that composes them and decides, for each miss
//!   and each message, what the shard does.
//!
//! Every message is authenticated with a key the pods of one gateway share
//! ([`SiblingKeys`]: sent under the current key, accepted under it or the next one, so that
//! the key can rotate without a restart): HMAC-SHA256 over the whole message, truncated to
//! [`TAG_LEN`] bytes. Under the tag, every message carries
//! - the sender's clock, which must be within [`FRESH_WINDOW`] of the receiver's;
//! - the sender's identity, a random 64-bit id each shard of each process draws at start (so
//!   that a restarted sender is a new one), and a counter the sender increments with every
//!   message ([`SiblingSender`]). The receiver keeps a sliding window of the counters it
//!   accepted per sender ([`replay::SenderWindows`], as IPsec's and WireGuard's anti-replay):
//!   a counter seen before, or older than the window, is refused as [`SiblingError::Replayed`].
//!   So a message captured on the wire and sent again, from any address, is accepted at most
//!   once by each receiving shard.
//!
//! Layout (big-endian): magic `UTsb` (4), version (1), kind (1), flags (1), listener name
//! length (1), sender time in ms since the Unix epoch (8), sender id (8), counter (8), client
//! address (family 4 or 6 (1), port (2), IP (4 or 16)), origin address (the same form; family
//! 0 when absent), listener name, payload, tag. Version 2 added the sender id and the counter;
//! a version-1 message is refused as malformed.

pub mod forwarding;
mod keys;
pub mod queries;
pub mod replay;

pub use forwarding::{Forwarding, ForwardingCounts, MessageAction, MissAction, SiblingForwarding};
pub use keys::{KeyError, SiblingKey, SiblingKeys, MIN_KEY_LEN};

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::{Duration, Instant};

/// The first bytes of every message.
const MAGIC: &[u8; 4] = b"UTsb";
/// The protocol version.
pub const VERSION: u8 = 2;
/// Bytes of HMAC-SHA256 kept as the tag.
pub const TAG_LEN: usize = 16;
/// How far a message's clock may be from the receiver's.
pub const FRESH_WINDOW: Duration = Duration::from_secs(30);
/// Bytes before the addresses: magic, version, kind, flags, name length, time, sender id,
/// counter.
const FIXED_LEN: usize = 4 + 1 + 1 + 1 + 1 + 8 + 8 + 8;
/// The longest message header: fixed part, two IPv6 addresses, a 255-byte listener name.
pub const MAX_OVERHEAD: usize = FIXED_LEN + 2 * 19 + 255 + TAG_LEN;

/// What a message is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Forwarder → owner: a datagram the client sent (the payload), as it arrived on the
    /// forwarder's listener.
    Forward = 1,
    /// Owner → forwarder: a datagram for the client (the payload), to send from the
    /// forwarder's listener.
    Return = 2,
    /// Owner → forwarder: "the client's allocation is here" (no payload), the answer to a
    /// [`FLAG_QUERY`] forward.
    Claim = 3,
    /// Former owner → forwarder: "the client's allocation is not here (any more)" (no
    /// payload), the answer to a forward that is no query: the forwarder stops forwarding.
    Gone = 4,
}

impl Kind {
    fn from_u8(b: u8) -> Option<Kind> {
        match b {
            1 => Some(Kind::Forward),
            2 => Some(Kind::Return),
            3 => Some(Kind::Claim),
            4 => Some(Kind::Gone),
            _ => None,
        }
    }
}

/// On a [`Kind::Forward`]: the forwarder does not know the owner yet and asked every sibling;
/// the owner answers with a [`Kind::Claim`], the others stay silent.
pub const FLAG_QUERY: u8 = 1;

/// A message's content, borrowing from the datagram it was read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SiblingMessage<'a> {
    /// What it is.
    pub kind: Kind,
    /// [`FLAG_QUERY`] or 0.
    pub flags: u8,
    /// The client's address as the forwarder's listener saw it.
    pub client: SocketAddr,
    /// Where an answer must go when it is not the datagram's source (a query handed on inside
    /// the owner pod); `None`: the source.
    pub origin: Option<SocketAddr>,
    /// The listener the client's datagram arrived on (the same config names it on every pod).
    pub listener: &'a str,
    /// The client's datagram (forward) or the datagram for the client (return).
    pub payload: &'a [u8],
}

/// Who sent a message and when, as it says under its tag.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp {
    /// The sender's clock, in ms since the Unix epoch.
    pub sent_ms: u64,
    /// The sender's id: random, one per shard of each process.
    pub sender: u64,
    /// The sender's message counter (one per sender, over all its receivers).
    pub counter: u64,
}

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SiblingError {
    /// Too short, not ours, another version, or a field out of range.
    Malformed,
    /// The tag does not match either key: not from a sibling (or altered).
    Unauthenticated,
    /// Its clock is further than [`FRESH_WINDOW`] from ours.
    Stale,
    /// Its sender's counter was accepted before, or is older than the sender's window.
    Replayed,
    /// A sender this receiver does not know, while it keeps as many senders as it may, all
    /// heard from lately (see [`replay::SenderWindows`]).
    TooManySenders,
    /// From an address that is no sibling's (nor loopback, where a query is handed on inside
    /// a pod).
    NotSibling,
    /// A claim, return or gone this shard did not ask for: no query pending for the client,
    /// or no forwarding of it to that sibling ([`Forwarding::handle_message`]).
    Unsolicited,
}

impl SiblingError {
    /// Every cause, for counters.
    pub const ALL: [SiblingError; 7] = [
        SiblingError::Malformed,
        SiblingError::Unauthenticated,
        SiblingError::Stale,
        SiblingError::Replayed,
        SiblingError::TooManySenders,
        SiblingError::NotSibling,
        SiblingError::Unsolicited,
    ];

    /// Stable index into counter arrays.
    pub fn index(self) -> usize {
        self as usize
    }
}

fn put_addr(out: &mut Vec<u8>, addr: Option<SocketAddr>) {
    match addr {
        None => out.push(0),
        Some(SocketAddr::V4(a)) => {
            out.push(4);
            out.extend_from_slice(&a.port().to_be_bytes());
            out.extend_from_slice(&a.ip().octets());
        }
        Some(SocketAddr::V6(a)) => {
            out.push(6);
            out.extend_from_slice(&a.port().to_be_bytes());
            out.extend_from_slice(&a.ip().octets());
        }
    }
}

/// Reads an address at `buf[*at..]`; `Ok(None)` for family 0.
fn get_addr(buf: &[u8], at: &mut usize) -> Result<Option<SocketAddr>, SiblingError> {
    let family = *buf.get(*at).ok_or(SiblingError::Malformed)?;
    *at += 1;
    let len = match family {
        0 => return Ok(None),
        4 => 4,
        6 => 16,
        _ => return Err(SiblingError::Malformed),
    };
    let bytes = buf.get(*at..*at + 2 + len).ok_or(SiblingError::Malformed)?;
    *at += 2 + len;
    let port = u16::from_be_bytes([bytes[0], bytes[1]]);
    let ip = if len == 4 {
        IpAddr::V4(Ipv4Addr::new(bytes[2], bytes[3], bytes[4], bytes[5]))
    } else {
        let mut octets = [0u8; 16];
        octets.copy_from_slice(&bytes[2..18]);
        IpAddr::V6(Ipv6Addr::from(octets))
    };
    Ok(Some(SocketAddr::new(ip, port)))
}

fn be_u64(bytes: &[u8]) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(word)
}

/// Writes a message into `out` (cleared first) under `key`, stamped with `stamp`. `None` if
/// the listener name is longer than 255 bytes.
pub fn encode(
    key: &SiblingKey,
    message: &SiblingMessage<'_>,
    stamp: Stamp,
    out: &mut Vec<u8>,
) -> Option<()> {
    let name_len = u8::try_from(message.listener.len()).ok()?;
    out.clear();
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(message.kind as u8);
    out.push(message.flags);
    out.push(name_len);
    out.extend_from_slice(&stamp.sent_ms.to_be_bytes());
    out.extend_from_slice(&stamp.sender.to_be_bytes());
    out.extend_from_slice(&stamp.counter.to_be_bytes());
    put_addr(out, Some(message.client));
    put_addr(out, message.origin);
    out.extend_from_slice(message.listener.as_bytes());
    out.extend_from_slice(message.payload);
    let tag = key.tag(out);
    out.extend_from_slice(&tag);
    Some(())
}

/// Checks and reads a message received at `now_ms` (the receiver's clock): its tag under
/// either key, its form and its clock. Stateless: whether its counter was seen before is
/// [`SiblingReceiver::open`]'s to say.
pub fn decode<'a>(
    keys: &SiblingKeys,
    buf: &'a [u8],
    now_ms: u64,
) -> Result<(SiblingMessage<'a>, Stamp), SiblingError> {
    if buf.len() < FIXED_LEN + 1 + TAG_LEN || &buf[..4] != MAGIC || buf[4] != VERSION {
        return Err(SiblingError::Malformed);
    }
    let (body, tag) = buf.split_at(buf.len() - TAG_LEN);
    let authentic = keys.current().verifies(body, tag)
        || keys.next().is_some_and(|next| next.verifies(body, tag));
    if !authentic {
        return Err(SiblingError::Unauthenticated);
    }
    let kind = Kind::from_u8(body[5]).ok_or(SiblingError::Malformed)?;
    let flags = body[6];
    let name_len = usize::from(body[7]);
    let stamp = Stamp {
        sent_ms: be_u64(&body[8..16]),
        sender: be_u64(&body[16..24]),
        counter: be_u64(&body[24..32]),
    };
    if stamp.sent_ms.abs_diff(now_ms) > FRESH_WINDOW.as_millis() as u64 {
        return Err(SiblingError::Stale);
    }
    let mut at = FIXED_LEN;
    let client = get_addr(body, &mut at)?.ok_or(SiblingError::Malformed)?;
    let origin = get_addr(body, &mut at)?;
    let name = body.get(at..at + name_len).ok_or(SiblingError::Malformed)?;
    let listener = std::str::from_utf8(name).map_err(|_| SiblingError::Malformed)?;
    let message = SiblingMessage {
        kind,
        flags,
        client,
        origin,
        listener,
        payload: &body[at + name_len..],
    };
    Ok((message, stamp))
}

/// The sending half of one shard's sibling link: its id and its counter.
#[derive(Debug)]
pub struct SiblingSender {
    id: u64,
    counter: u64,
}

impl SiblingSender {
    /// A sender with id `id` (draw it at random: a restarted process must not reuse one).
    pub fn new(id: u64) -> SiblingSender {
        SiblingSender { id, counter: 0 }
    }

    /// Writes `message` into `out` under the current key at `now_ms` (the sender's clock), with
    /// the next counter. `None` if the listener name is longer than 255 bytes (no counter
    /// spent).
    pub fn seal(
        &mut self,
        keys: &SiblingKeys,
        message: &SiblingMessage<'_>,
        now_ms: u64,
        out: &mut Vec<u8>,
    ) -> Option<()> {
        let stamp = Stamp {
            sent_ms: now_ms,
            sender: self.id,
            counter: self.counter,
        };
        encode(keys.current(), message, stamp, out)?;
        // 2^64 messages are never sent; wrapping would only make the receivers refuse them.
        self.counter = self.counter.wrapping_add(1);
        Some(())
    }
}

/// The receiving half of one shard's sibling link: [`decode`], then the sender's replay
/// window. Call [`SiblingReceiver::handle_timeout`] now and then (each tick) to forget
/// senders gone quiet.
#[derive(Debug, Default)]
pub struct SiblingReceiver {
    windows: replay::SenderWindows,
}

impl SiblingReceiver {
    /// A receiver that knows no sender yet.
    pub fn new() -> SiblingReceiver {
        SiblingReceiver::default()
    }

    /// Checks a datagram received at `now_ms` (wall clock) and `now` (monotonic): its tag,
    /// form and clock ([`decode`]), then that its sender's counter is new. Only an authentic
    /// message touches the windows.
    pub fn open<'a>(
        &mut self,
        keys: &SiblingKeys,
        buf: &'a [u8],
        now_ms: u64,
        now: Instant,
    ) -> Result<SiblingMessage<'a>, SiblingError> {
        let (message, stamp) = decode(keys, buf, now_ms)?;
        self.windows.accept(stamp.sender, stamp.counter, now)?;
        Ok(message)
    }

    /// Forgets the senders not heard from for [`replay::SENDER_IDLE`].
    pub fn handle_timeout(&mut self, now: Instant) {
        self.windows.handle_timeout(now);
    }

    /// How many senders it keeps a window for.
    pub fn senders(&self) -> usize {
        self.windows.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> SiblingKey {
        SiblingKey::new(&[byte; 32]).unwrap()
    }

    fn keys(byte: u8) -> SiblingKeys {
        key(byte).into()
    }

    fn stamp(sent_ms: u64) -> Stamp {
        Stamp {
            sent_ms,
            sender: 0x0123_4567_89ab_cdef,
            counter: 7,
        }
    }

    fn message<'a>(payload: &'a [u8], origin: Option<SocketAddr>) -> SiblingMessage<'a> {
        SiblingMessage {
            kind: Kind::Forward,
            flags: FLAG_QUERY,
            client: "[2001:db8::7]:50000".parse().unwrap(),
            origin,
            listener: "stunner/udp-gateway/udp-listener",
            payload,
        }
    }

    #[test]
    fn messages_round_trip_with_either_family_and_an_origin() {
        let now = 1_760_000_000_000;
        let mut buf = Vec::new();
        for origin in [None, Some("10.0.0.7:13480".parse().unwrap())] {
            for payload in [&b""[..], b"\x40\x00\x00\x04ping", &[0xab; 1500][..]] {
                let sent = message(payload, origin);
                encode(&key(1), &sent, stamp(now), &mut buf).unwrap();
                assert!(buf.len() <= payload.len() + MAX_OVERHEAD);
                assert_eq!(decode(&keys(1), &buf, now + 5_000), Ok((sent, stamp(now))));
            }
        }
        let v4 = SiblingMessage {
            kind: Kind::Return,
            flags: 0,
            client: "192.0.2.1:1".parse().unwrap(),
            origin: None,
            listener: "",
            payload: b"x",
        };
        encode(&key(1), &v4, stamp(now), &mut buf).unwrap();
        assert_eq!(decode(&keys(1), &buf, now), Ok((v4, stamp(now))));
    }

    #[test]
    fn a_wrong_key_an_altered_byte_or_an_old_clock_is_refused() {
        let now = 1_760_000_000_000;
        let mut buf = Vec::new();
        encode(&key(1), &message(b"data", None), stamp(now), &mut buf).unwrap();
        assert_eq!(
            decode(&keys(2), &buf, now),
            Err(SiblingError::Unauthenticated)
        );
        for i in 0..buf.len() {
            let mut altered = buf.clone();
            altered[i] ^= 0x01;
            assert!(decode(&keys(1), &altered, now).is_err(), "byte {i} altered");
        }
        let window = FRESH_WINDOW.as_millis() as u64;
        assert!(decode(&keys(1), &buf, now + window).is_ok());
        assert_eq!(
            decode(&keys(1), &buf, now + window + 1),
            Err(SiblingError::Stale)
        );
        assert_eq!(
            decode(&keys(1), &buf, now - window - 1),
            Err(SiblingError::Stale)
        );
        for len in 0..buf.len() {
            assert!(decode(&keys(1), &buf[..len], now).is_err(), "{len} bytes");
        }
    }

    #[test]
    fn a_version_1_message_is_malformed() {
        let mut buf = Vec::new();
        encode(&key(1), &message(b"data", None), stamp(1), &mut buf).unwrap();
        buf[4] = 1;
        assert_eq!(decode(&keys(1), &buf, 1), Err(SiblingError::Malformed));
    }

    #[test]
    fn messages_are_sent_under_the_current_key_and_accepted_under_either() {
        let now = 1_760_000_000_000;
        let (old, new) = (key(1), key(2));
        let mut buf = Vec::new();
        // Mid-rotation: one pod runs (OLD, NEW), the other (NEW, OLD) already.
        let before = SiblingKeys::new(old.clone(), Some(new.clone()));
        let after = SiblingKeys::new(new.clone(), Some(old.clone()));
        let mut sender = SiblingSender::new(1);
        for (from, to) in [(&before, &after), (&after, &before)] {
            sender
                .seal(from, &message(b"x", None), now, &mut buf)
                .unwrap();
            assert!(decode(to, &buf, now).is_ok());
            assert!(decode(from, &buf, now).is_ok());
        }
        // Sent under the current key only: the pod on NEW alone refuses what (OLD, NEW) sends.
        sender
            .seal(&before, &message(b"x", None), now, &mut buf)
            .unwrap();
        assert_eq!(
            decode(&SiblingKeys::from(new.clone()), &buf, now),
            Err(SiblingError::Unauthenticated)
        );
        assert!(decode(&SiblingKeys::from(old), &buf, now).is_ok());
    }

    #[test]
    fn a_message_is_opened_once_and_a_sender_counts_up() {
        let now_ms = 1_760_000_000_000;
        let t0 = Instant::now();
        let mut sender = SiblingSender::new(42);
        let mut receiver = SiblingReceiver::new();
        let mut first = Vec::new();
        sender
            .seal(&keys(1), &message(b"a", None), now_ms, &mut first)
            .unwrap();
        let mut second = Vec::new();
        sender
            .seal(&keys(1), &message(b"b", None), now_ms, &mut second)
            .unwrap();
        assert_eq!(decode(&keys(1), &first, now_ms).unwrap().1.counter, 0);
        assert_eq!(decode(&keys(1), &second, now_ms).unwrap().1.counter, 1);
        // Out of order is fine; the same twice is not.
        assert!(receiver.open(&keys(1), &second, now_ms, t0).is_ok());
        assert!(receiver.open(&keys(1), &first, now_ms, t0).is_ok());
        for replay in [&first, &second] {
            assert_eq!(
                receiver.open(&keys(1), replay, now_ms, t0),
                Err(SiblingError::Replayed)
            );
        }
        // A forged or stale message leaves no state behind.
        let mut forged = second.clone();
        forged[30] ^= 1;
        let mut fresh = SiblingReceiver::new();
        assert_eq!(
            fresh.open(&keys(1), &forged, now_ms, t0),
            Err(SiblingError::Unauthenticated)
        );
        assert_eq!(
            fresh.open(&keys(2), &first, now_ms, t0),
            Err(SiblingError::Unauthenticated)
        );
        assert_eq!(
            fresh.open(&keys(1), &first, now_ms + 31_000, t0),
            Err(SiblingError::Stale)
        );
        assert_eq!(fresh.senders(), 0);
        // Another sender's counters are its own.
        let mut other = SiblingSender::new(43);
        let mut buf = Vec::new();
        other
            .seal(&keys(1), &message(b"a", None), now_ms, &mut buf)
            .unwrap();
        assert!(receiver.open(&keys(1), &buf, now_ms, t0).is_ok());
        assert_eq!(receiver.senders(), 2);
    }

    #[test]
    fn a_listener_name_over_255_bytes_is_not_encoded() {
        let name = "l".repeat(256);
        let mut sent = message(b"x", None);
        sent.listener = &name;
        assert_eq!(encode(&key(1), &sent, stamp(1), &mut Vec::new()), None);
        let mut sender = SiblingSender::new(1);
        assert_eq!(sender.seal(&keys(1), &sent, 1, &mut Vec::new()), None);
        assert_eq!(sender.counter, 0);
    }
}

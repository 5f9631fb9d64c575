//! The messages gateway pods of one gateway ("siblings") exchange to give a client's datagram a
//! second chance: when a client's flow moves to a pod that holds no allocation for it, that pod
//! (the forwarder) hands the datagram to the pod that does (the owner), which answers through
//! the forwarder. Pure encoding and checking; the shards own the sockets.
//!
//! Every message is authenticated with a key the pods of one gateway share: HMAC-SHA256 over
//! the whole message, truncated to [`TAG_LEN`] bytes, and carries the sender's clock, which
//! must be within [`FRESH_WINDOW`] of the receiver's. A message captured and replayed within the
//! window repeats a datagram the network could have duplicated anyway; nothing else is
//! accepted without the key.
//!
//! Layout (big-endian): magic `UTsb` (4), version (1), kind (1), flags (1), listener name
//! length (1), sender time in ms since the Unix epoch (8), client address (family 4 or 6 (1),
//! port (2), IP (4 or 16)), origin address (the same form; family 0 when absent), listener
//! name, payload, tag.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

/// The first bytes of every message.
const MAGIC: &[u8; 4] = b"UTsb";
/// The protocol version.
const VERSION: u8 = 1;
/// Bytes of HMAC-SHA256 kept as the tag.
pub const TAG_LEN: usize = 16;
/// How far a message's clock may be from the receiver's.
pub const FRESH_WINDOW: Duration = Duration::from_secs(30);
/// Bytes before the addresses.
const FIXED_LEN: usize = 4 + 1 + 1 + 1 + 1 + 8;
/// The longest message header: fixed part, two IPv6 addresses, a 255-byte listener name.
pub const MAX_OVERHEAD: usize = FIXED_LEN + 2 * 19 + 255 + TAG_LEN;
/// The shortest key accepted.
pub const MIN_KEY_LEN: usize = 16;

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

/// A checked message, borrowing from the datagram it was read from.
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

/// Why a message was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SiblingError {
    /// Too short, not ours, another version, or a field out of range.
    Malformed,
    /// The tag does not match: not from a sibling (or altered).
    Unauthenticated,
    /// Its clock is further than [`FRESH_WINDOW`] from ours.
    Stale,
}

/// The key the pods of one gateway share.
#[derive(Clone)]
pub struct SiblingKey(Vec<u8>);

impl std::fmt::Debug for SiblingKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SiblingKey({} bytes)", self.0.len())
    }
}

impl SiblingKey {
    /// A key from its bytes (a key file's final line break ignored, nothing else: a binary
    /// key may hold any byte); at least [`MIN_KEY_LEN`] bytes.
    pub fn new(bytes: &[u8]) -> Result<SiblingKey, String> {
        let key = bytes
            .strip_suffix(b"\r\n")
            .or_else(|| bytes.strip_suffix(b"\n"))
            .unwrap_or(bytes);
        if key.len() < MIN_KEY_LEN {
            return Err(format!(
                "the sibling key has {} bytes: use at least {MIN_KEY_LEN} random bytes \
                 (e.g. head -c 32 /dev/urandom | base64)",
                key.len()
            ));
        }
        Ok(SiblingKey(key.to_vec()))
    }

    fn mac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length.
        Hmac::<Sha256>::new_from_slice(&self.0).expect("HMAC accepts any key length")
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

/// Writes a message into `out` (cleared first); `now_ms` is the sender's clock. `None` if the
/// listener name is longer than 255 bytes.
pub fn encode(
    key: &SiblingKey,
    message: &SiblingMessage<'_>,
    now_ms: u64,
    out: &mut Vec<u8>,
) -> Option<()> {
    let name_len = u8::try_from(message.listener.len()).ok()?;
    out.clear();
    out.extend_from_slice(MAGIC);
    out.push(VERSION);
    out.push(message.kind as u8);
    out.push(message.flags);
    out.push(name_len);
    out.extend_from_slice(&now_ms.to_be_bytes());
    put_addr(out, Some(message.client));
    put_addr(out, message.origin);
    out.extend_from_slice(message.listener.as_bytes());
    out.extend_from_slice(message.payload);
    let mut mac = key.mac();
    mac.update(out);
    let tag = mac.finalize().into_bytes();
    out.extend_from_slice(&tag[..TAG_LEN]);
    Some(())
}

/// Checks and reads a message received at `now_ms` (the receiver's clock).
pub fn decode<'a>(
    key: &SiblingKey,
    buf: &'a [u8],
    now_ms: u64,
) -> Result<SiblingMessage<'a>, SiblingError> {
    if buf.len() < FIXED_LEN + 1 + TAG_LEN || &buf[..4] != MAGIC || buf[4] != VERSION {
        return Err(SiblingError::Malformed);
    }
    let (body, tag) = buf.split_at(buf.len() - TAG_LEN);
    let mut mac = key.mac();
    mac.update(body);
    mac.verify_truncated_left(tag)
        .map_err(|_| SiblingError::Unauthenticated)?;
    let kind = Kind::from_u8(body[5]).ok_or(SiblingError::Malformed)?;
    let flags = body[6];
    let name_len = usize::from(body[7]);
    let mut sent = [0u8; 8];
    sent.copy_from_slice(&body[8..16]);
    let sent = u64::from_be_bytes(sent);
    if sent.abs_diff(now_ms) > FRESH_WINDOW.as_millis() as u64 {
        return Err(SiblingError::Stale);
    }
    let mut at = FIXED_LEN;
    let client = get_addr(body, &mut at)?.ok_or(SiblingError::Malformed)?;
    let origin = get_addr(body, &mut at)?;
    let name = body.get(at..at + name_len).ok_or(SiblingError::Malformed)?;
    let listener = std::str::from_utf8(name).map_err(|_| SiblingError::Malformed)?;
    Ok(SiblingMessage {
        kind,
        flags,
        client,
        origin,
        listener,
        payload: &body[at + name_len..],
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(byte: u8) -> SiblingKey {
        SiblingKey::new(&[byte; 32]).unwrap()
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
                encode(&key(1), &sent, now, &mut buf).unwrap();
                assert!(buf.len() <= payload.len() + MAX_OVERHEAD);
                assert_eq!(decode(&key(1), &buf, now + 5_000), Ok(sent));
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
        encode(&key(1), &v4, now, &mut buf).unwrap();
        assert_eq!(decode(&key(1), &buf, now), Ok(v4));
    }

    #[test]
    fn a_wrong_key_an_altered_byte_or_an_old_clock_is_refused() {
        let now = 1_760_000_000_000;
        let mut buf = Vec::new();
        encode(&key(1), &message(b"data", None), now, &mut buf).unwrap();
        assert_eq!(
            decode(&key(2), &buf, now),
            Err(SiblingError::Unauthenticated)
        );
        for i in 0..buf.len() {
            let mut altered = buf.clone();
            altered[i] ^= 0x01;
            assert!(decode(&key(1), &altered, now).is_err(), "byte {i} altered");
        }
        let window = FRESH_WINDOW.as_millis() as u64;
        assert!(decode(&key(1), &buf, now + window).is_ok());
        assert_eq!(
            decode(&key(1), &buf, now + window + 1),
            Err(SiblingError::Stale)
        );
        assert_eq!(
            decode(&key(1), &buf, now - window - 1),
            Err(SiblingError::Stale)
        );
        for len in 0..buf.len() {
            assert!(decode(&key(1), &buf[..len], now).is_err(), "{len} bytes");
        }
    }

    #[test]
    fn keys_are_at_least_16_bytes_and_lose_only_a_final_line_break() {
        assert!(SiblingKey::new(b"short").is_err());
        assert!(SiblingKey::new(b"0123456789abcde\r\n").is_err());
        assert!(
            SiblingKey::new(&[b' '; 16]).is_ok(),
            "binary keys keep every byte"
        );
        let a = SiblingKey::new(b"0123456789abcdef\n").unwrap();
        let b = SiblingKey::new(b"0123456789abcdef").unwrap();
        let mut buf = Vec::new();
        encode(&a, &message(b"x", None), 1, &mut buf).unwrap();
        assert!(decode(&b, &buf, 1).is_ok());
        assert_eq!(format!("{a:?}"), "SiblingKey(16 bytes)");
    }

    #[test]
    fn a_listener_name_over_255_bytes_is_not_encoded() {
        let name = "l".repeat(256);
        let mut sent = message(b"x", None);
        sent.listener = &name;
        assert_eq!(encode(&key(1), &sent, 1, &mut Vec::new()), None);
    }
}

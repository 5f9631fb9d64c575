//! `sibling`: the messages gateway pods exchange for second-chance forwarding
//! (`uturn_dataplane::proto::sibling`), on arbitrary datagrams: what any address can send to a
//! pod's sibling port.
//!
//! Input: `[key byte][clock offset: 1 byte][datagram]`. The key is 32 copies of the key byte;
//! the receiver's clock is a fixed instant plus the offset in seconds.
//!
//! Checks: never panics; a datagram is accepted only if it re-encodes, under the same key and
//! the clock it carries, to exactly itself (nothing unauthenticated or reinterpreted gets
//! through); one under another key is refused.

use crate::input::Input;
use uturn_dataplane::proto::sibling::{decode, encode, SiblingKey};

const NOW_MS: u64 = 1_760_000_000_000;

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let key_byte = input.u8();
    let offset = u64::from(input.u8()) * 1000;
    let datagram = input.rest();
    let key = SiblingKey::new(&[key_byte; 32]).expect("a 32-byte key");
    let Ok(message) = decode(&key, datagram, NOW_MS + offset) else {
        return;
    };
    let sent = u64::from_be_bytes(datagram[8..16].try_into().expect("8 bytes"));
    let mut again = Vec::new();
    encode(&key, &message, sent, &mut again).expect("a decoded message encodes");
    assert_eq!(again, datagram, "a message that does not re-encode to itself");
    let other = SiblingKey::new(&[key_byte.wrapping_add(1); 32]).expect("a 32-byte key");
    assert!(decode(&other, datagram, NOW_MS + offset).is_err());
}

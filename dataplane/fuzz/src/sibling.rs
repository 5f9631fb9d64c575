//! `sibling`: the messages gateway pods exchange for second-chance forwarding
//! (`uturn_dataplane::proto::sibling`), on arbitrary datagrams: what any address can send to a
//! pod's sibling port.
//!
//! Input: `[current key byte][next key byte][clock offset: 1 byte][datagram]`. The current key
//! is 32 copies of its byte; the next key likewise, none if its byte is 0; the receiver's
//! clock is a fixed instant plus the offset in seconds.
//!
//! Checks: never panics; a datagram is accepted only if it re-encodes, under one of the two
//! keys with the stamp (clock, sender, counter) it carries, to exactly itself (nothing
//! unauthenticated or reinterpreted gets through); a receiver opens it once, and refuses it as
//! replayed the second time; a refused datagram leaves no sender state behind; under a key
//! that is neither, it is refused.

use crate::input::Input;
use std::time::Instant;
use uturn_dataplane::proto::sibling::{
    decode, encode, SiblingError, SiblingKey, SiblingKeys, SiblingReceiver,
};

const NOW_MS: u64 = 1_760_000_000_000;

fn key(byte: u8) -> SiblingKey {
    SiblingKey::new(&[byte; 32]).expect("a 32-byte key")
}

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let current_byte = input.u8();
    let next_byte = input.u8();
    let offset = u64::from(input.u8()) * 1000;
    let datagram = input.rest();
    let next = (next_byte != 0).then(|| key(next_byte));
    let keys = SiblingKeys::new(key(current_byte), next.clone());
    let now_ms = NOW_MS + offset;
    let now = Instant::now();
    let mut receiver = SiblingReceiver::new();
    let Ok(message) = receiver.open(&keys, datagram, now_ms, now) else {
        assert_eq!(receiver.senders(), 0, "a refused datagram left a sender");
        return;
    };
    let (again, stamp) = decode(&keys, datagram, now_ms).expect("opened, so it decodes");
    assert_eq!(again, message);
    let reencodes = |key: &SiblingKey| {
        let mut out = Vec::new();
        encode(key, &message, stamp, &mut out).expect("a decoded message encodes");
        out == datagram
    };
    assert!(
        reencodes(&key(current_byte)) || next.as_ref().is_some_and(reencodes),
        "a message that does not re-encode to itself under either key"
    );
    assert_eq!(
        receiver.open(&keys, datagram, now_ms, now),
        Err(SiblingError::Replayed),
        "a message opened twice"
    );
    let other = (1..=u8::MAX)
        .map(|step| current_byte.wrapping_add(step))
        .find(|b| *b != current_byte && *b != next_byte)
        .expect("a third key byte");
    assert!(decode(&key(other).into(), datagram, now_ms).is_err());
}

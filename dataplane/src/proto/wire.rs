//! Writing STUN/TURN responses and indications into caller-owned buffers, and an error reply
//! as the [`ClientAction`] that sends it (or the counted drop that does not).
//!
//! stunnerd compatibility: no SOFTWARE attribute; FINGERPRINT only on Binding responses (and
//! there only when the request carried one, to keep the response within ~2x of the request);
//! authenticated responses carry MESSAGE-INTEGRITY (SHA1).

use super::contract::{ClientAction, DropReason, EngineStats};
use super::error::RequestError;
use super::AMPLIFICATION_FACTOR;
use std::net::SocketAddr;
use stun_proto::types::attribute::{
    Attribute, AttributeStaticType, AttributeType, AttributeWrite, ErrorCode, Fingerprint, Nonce,
    Realm, UnknownAttributes, XorMappedAddress,
};
use stun_proto::types::message::{
    IntegrityAlgorithm, IntegrityKey, Message, MessageClass, MessageType, MessageWrite,
    MessageWriteExt, MessageWriteMutSlice, Method, TransactionId,
};
use turn_types::attribute::{AddressErrorCode, Data, Lifetime, XorPeerAddress, XorRelayedAddress};
use turn_types::message::{ALLOCATE, DATA};
use turn_types::AddressFamily;

/// A response under construction in a caller buffer. Write failures (a too-small buffer) are
/// remembered and reported by [`ResponseWriter::finish`].
pub(super) struct ResponseWriter<'a> {
    writer: MessageWriteMutSlice<'a>,
    failed: bool,
}

impl<'a> ResponseWriter<'a> {
    fn new(class: MessageClass, method: Method, txid: TransactionId, out: &'a mut [u8]) -> Self {
        let failed = out.len() < 20;
        let writer = if failed {
            MessageWriteMutSlice::new(&mut [])
        } else {
            Message::builder(
                MessageType::from_class_method(class, method),
                txid,
                MessageWriteMutSlice::new(out),
            )
        };
        ResponseWriter { writer, failed }
    }

    /// A success response to `request`.
    pub(super) fn success(request: &Message<'_>, out: &'a mut [u8]) -> Self {
        Self::new(
            MessageClass::Success,
            request.method(),
            request.transaction_id(),
            out,
        )
    }

    /// Appends an attribute.
    pub(super) fn add(&mut self, attr: &dyn AttributeWrite) {
        if !self.failed && self.writer.add_attribute(attr).is_err() {
            self.failed = true;
        }
    }

    /// Adds MESSAGE-INTEGRITY when a key is given, and returns the message length.
    pub(super) fn finish(mut self, integrity: Option<&IntegrityKey>) -> Option<usize> {
        if let Some(key) = integrity {
            if !self.failed
                && self
                    .writer
                    .add_message_integrity_with_key(key, IntegrityAlgorithm::Sha1)
                    .is_err()
            {
                self.failed = true;
            }
        }
        (!self.failed).then(|| self.writer.finish())
    }

    fn finish_with_fingerprint(mut self) -> Option<usize> {
        if !self.failed && self.writer.add_fingerprint().is_err() {
            self.failed = true;
        }
        (!self.failed).then(|| self.writer.finish())
    }
}

/// Binding success: XOR-MAPPED-ADDRESS and FINGERPRINT, nothing else.
pub(super) fn binding_success(
    request: &Message<'_>,
    from: SocketAddr,
    out: &mut [u8],
) -> Option<usize> {
    let mut w = ResponseWriter::success(request, out);
    w.add(&XorMappedAddress::new(from, request.transaction_id()));
    // FINGERPRINT only when the request has one (RFC 8489 §7.3.1 does not require more), so the
    // response stays within ~2x of the request: 20 → 32 bytes (IPv4), 44 (IPv6).
    if request.has_attribute(Fingerprint::TYPE) {
        w.finish_with_fingerprint()
    } else {
        w.finish(None)
    }
}

/// An error response to `request` refusing it for `error`, with the reason phrase `reason`
/// (`error.reason()`, or empty where the reply must stay small).
pub(super) fn error_response(
    request: &Message<'_>,
    error: &RequestError,
    reason: &str,
    integrity: Option<&IntegrityKey>,
    out: &mut [u8],
) -> Option<usize> {
    error_response_raw(
        request.method(),
        request.transaction_id(),
        error,
        reason,
        integrity,
        out,
    )
}

/// The reply refusing `msg` for `error`, signed with `integrity` when given (a counted drop if
/// `out` is too small: our bug).
pub(super) fn error_reply(
    stats: &mut EngineStats,
    msg: &Message<'_>,
    error: RequestError,
    integrity: Option<&IntegrityKey>,
    out: &mut [u8],
) -> ClientAction {
    match error_response(msg, &error, error.reason(), integrity, out) {
        Some(n) => ClientAction::Reply(n),
        None => ClientAction::Drop(stats.count_drop(DropReason::Internal)),
    }
}

/// An error reply to a request that did not authenticate, within [`AMPLIFICATION_FACTOR`]
/// times the request's size: the reason phrase goes first (RFC 8489 §14.8: it is for humans),
/// then the whole reply (dropped and counted).
pub(super) fn unauthenticated_reply(
    stats: &mut EngineStats,
    msg: &Message<'_>,
    error: RequestError,
    out: &mut [u8],
) -> ClientAction {
    let budget = AMPLIFICATION_FACTOR * msg.as_bytes().len();
    let n = match error_response(msg, &error, error.reason(), None, out) {
        Some(n) if n > budget => error_response(msg, &error, "", None, out),
        written => written,
    };
    let Some(n) = n else {
        return ClientAction::Drop(stats.count_drop(DropReason::Internal));
    };
    let action = within_amplification_bound(stats, msg, n);
    // The first 401 (no credentials yet) and 438 are the normal challenge; only a 401 to a
    // request whose MESSAGE-INTEGRITY was checked counts as refused credentials.
    if matches!(error, RequestError::CredentialsRefused(_))
        && matches!(action, ClientAction::Reply(_))
    {
        stats.auth_failures += 1;
    }
    action
}

/// `out[..n]`, a reply to the unauthenticated request `msg`, if it is at most
/// [`AMPLIFICATION_FACTOR`] times as large; otherwise nothing, counted.
pub(super) fn within_amplification_bound(
    stats: &mut EngineStats,
    msg: &Message<'_>,
    n: usize,
) -> ClientAction {
    if n <= AMPLIFICATION_FACTOR * msg.as_bytes().len() {
        ClientAction::Reply(n)
    } else {
        ClientAction::Drop(stats.count_drop(DropReason::Amplification))
    }
}

/// An error response for `method` and `txid`, as [`error_response`].
pub(super) fn error_response_raw(
    method: Method,
    txid: TransactionId,
    error: &RequestError,
    reason: &str,
    integrity: Option<&IntegrityKey>,
    out: &mut [u8],
) -> Option<usize> {
    let mut w = ResponseWriter::new(MessageClass::Error, method, txid, out);
    let error_code = ErrorCode::builder(error.code())
        .reason(reason)
        .build()
        .ok()?;
    w.add(&error_code);
    let unknown = error.unknown_attributes();
    if !unknown.is_empty() {
        w.add(&UnknownAttributes::new(unknown));
    }
    if let Some(challenge) = error.challenge() {
        w.add(&Realm::new(&challenge.realm).ok()?);
        w.add(&Nonce::new(std::str::from_utf8(&challenge.nonce).ok()?).ok()?);
    }
    w.finish(integrity)
}

/// Allocate success: an XOR-RELAYED-ADDRESS per relay (IPv4 first), ADDRESS-ERROR-CODE for a
/// dual allocation's IPv6 relay that could not be had (RFC 8656 §7.2, §18.12), LIFETIME,
/// XOR-MAPPED-ADDRESS, MESSAGE-INTEGRITY.
pub(super) fn allocate_success(
    txid: TransactionId,
    relays: &[SocketAddr],
    ipv6_error: Option<&RequestError>,
    client: SocketAddr,
    lifetime_secs: u32,
    integrity: &IntegrityKey,
    out: &mut [u8],
) -> Option<usize> {
    let mut w = ResponseWriter::new(MessageClass::Success, ALLOCATE, txid, out);
    for &relay in relays {
        w.add(&XorRelayedAddress::new(relay, txid));
    }
    if let Some(error) = ipv6_error {
        let code = ErrorCode::builder(error.code())
            .reason(error.reason())
            .build()
            .ok()?;
        w.add(&AddressErrorCode::new(AddressFamily::IPV6, code));
    }
    w.add(&Lifetime::new(lifetime_secs));
    w.add(&XorMappedAddress::new(client, txid));
    w.finish(Some(integrity))
}

/// Data indication carrying `payload` from `peer` (RFC 8656 §10.3).
pub(super) fn data_indication(
    txid: TransactionId,
    peer: SocketAddr,
    payload: &[u8],
    out: &mut [u8],
) -> Option<usize> {
    let mut w = ResponseWriter::new(MessageClass::Indication, DATA, txid, out);
    w.add(&XorPeerAddress::new(peer, txid));
    w.add(&Data::new(payload));
    w.finish(None)
}

/// Comprehension-required attribute types this server understands in TURN requests.
const KNOWN_REQUIRED: [u16; 22] = [
    0x0001, // MAPPED-ADDRESS
    0x0006, // USERNAME
    0x0008, // MESSAGE-INTEGRITY
    0x0009, // ERROR-CODE
    0x000A, // UNKNOWN-ATTRIBUTES
    0x000C, // CHANNEL-NUMBER
    0x000D, // LIFETIME
    0x0012, // XOR-PEER-ADDRESS
    0x0013, // DATA
    0x0014, // REALM
    0x0015, // NONCE
    0x0016, // XOR-RELAYED-ADDRESS
    0x0017, // REQUESTED-ADDRESS-FAMILY
    0x0018, // EVEN-PORT
    0x0019, // REQUESTED-TRANSPORT
    0x001A, // DONT-FRAGMENT
    0x001C, // MESSAGE-INTEGRITY-SHA256
    0x001D, // PASSWORD-ALGORITHM
    0x0020, // XOR-MAPPED-ADDRESS
    0x0022, // RESERVATION-TOKEN
    0x0024, // PRIORITY
    0x0025, // USE-CANDIDATE
];

/// The most attribute types a 420's UNKNOWN-ATTRIBUTES lists (64 bytes).
const MAX_UNKNOWN_LISTED: usize = 32;

/// The comprehension-required attributes of `msg` that we do not understand, each once, at
/// most [`MAX_UNKNOWN_LISTED`].
pub(super) fn unknown_required_attributes(msg: &Message<'_>) -> Vec<AttributeType> {
    let mut unknown: Vec<AttributeType> = Vec::new();
    for t in msg.iter_attributes().map(|(_, attr)| attr.get_type()) {
        if t.comprehension_required()
            && !KNOWN_REQUIRED.contains(&t.value())
            && !unknown.contains(&t)
        {
            unknown.push(t);
            // A 420 names at most this many: a client sending more learns enough, and the
            // reply stays small (it must fit the reply buffer of every transport).
            if unknown.len() == MAX_UNKNOWN_LISTED {
                break;
            }
        }
    }
    unknown
}

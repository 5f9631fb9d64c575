//! The IO contract: what the engine takes from the shell and gives back. Listener and relay
//! handles, how a datagram arrived ([`Arrival`], [`PeerArrival`]), the actions a client or peer
//! datagram turns into (transmits as a range of the input or of the output buffer), the relay
//! socket request and its answer, and the drop reasons every counter is keyed by.

use super::limits::{AllocationLedger, Limits};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::{ClusterId, ListenerSpec, Snapshot};

/// Bytes the shell leaves free in front of a peer datagram, so ChannelData can be framed in place.
pub const PEER_HEADROOM: usize = 4;

/// Engine construction parameters.
#[derive(Clone)]
pub struct EngineConfig {
    /// An instant and the unix time (seconds) it corresponds to: the engine derives wall-clock
    /// time (ephemeral credentials, nonces) from the `now` it is given.
    pub epoch: Instant,
    /// Unix seconds at `epoch`.
    pub epoch_unix: u64,
    /// Secret for stateless nonces; share it between shards so any shard accepts them.
    pub nonce_key: [u8; 32],
    /// Caps set by flags.
    pub limits: Limits,
    /// Allocations held per user-id and in all; share it between shards.
    pub ledger: Arc<AllocationLedger>,
}

impl EngineConfig {
    /// A config with default [`Limits`] and a ledger of its own.
    pub fn new(epoch: Instant, epoch_unix: u64, nonce_key: [u8; 32]) -> EngineConfig {
        EngineConfig {
            epoch,
            epoch_unix,
            nonce_key,
            limits: Limits::default(),
            ledger: Arc::new(AllocationLedger::new()),
        }
    }
}

/// Per-shard counters, plain integers (the shard owns them).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Datagrams dropped, by [`DropReason::index`].
    pub dropped: [u64; DropReason::ALL.len()],
    /// Allocations ever created.
    pub allocations_created: u64,
    /// Allocations that expired or were deleted.
    pub allocations_deleted: u64,
    /// Requests whose credentials were refused (a 401 to a request with MESSAGE-INTEGRITY).
    pub auth_failures: u64,
    /// Allocates refused for a quota: the user-id's (486) or the global cap (508).
    pub quota_refusals: u64,
}

impl EngineStats {
    /// Counts a datagram dropped for `reason`, and gives the reason back.
    pub(super) fn count_drop(&mut self, reason: DropReason) -> DropReason {
        self.dropped[reason.index()] += 1;
        reason
    }
}

/// The shell's handle for a running listener, stable across reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u32);

/// The engine's handle for a relay socket: an allocation's slot and the socket's family, so an
/// allocation holds at most one relay socket of each family (two for a dual allocation, RFC
/// 8656 §7.2). The shell mirrors the ids in a dense table: slot `s` has ids `2s` (IPv4) and
/// `2s + 1` (IPv6).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RelayId(pub u32);

impl RelayId {
    /// The relay socket of family `family` of the allocation in `slot`.
    #[inline]
    pub(super) fn new(slot: u32, family: Family) -> RelayId {
        RelayId(slot << 1 | family as u32)
    }

    /// The slot of the allocation the socket belongs to.
    #[inline]
    pub(super) fn slot(self) -> u32 {
        self.0 >> 1
    }

    /// The family of the socket.
    #[inline]
    pub fn family(self) -> Family {
        if self.0 & 1 == 0 {
            Family::V4
        } else {
            Family::V6
        }
    }

    /// The relay socket of family `family` of the same allocation.
    #[inline]
    pub fn with_family(self, family: Family) -> RelayId {
        RelayId::new(self.slot(), family)
    }
}

/// A listener as the engine sees it on each call.
#[derive(Debug, Clone, Copy)]
pub struct ListenerRef<'a> {
    /// The shell's id for it.
    pub id: ListenerId,
    /// Its spec in the running snapshot.
    pub spec: &'a ListenerSpec,
}

/// How a client's datagram reached this shard (second-chance forwarding, in the README).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArrivalKind {
    /// Straight from the client to the listener: the per-packet case. With misses forwarded
    /// ([`super::Engine::set_forward_misses`]), one that needs an allocation this shard does
    /// not hold is a [`ClientAction::Miss`].
    Straight,
    /// Forwarded by the sibling pod at `via`, for a client whose allocation this shard holds:
    /// handled exactly as if it came straight, and what goes to the client from now on goes
    /// back through `via` ([`PeerAction::ToClient`]'s `forwarded`; the shell sends the reply
    /// back through it too).
    Forwarded {
        /// The sibling's address (the query's origin, for a query handed on inside its pod).
        via: SocketAddr,
    },
    /// Straight, a [`ClientAction::Miss`] that no sibling holds: answered as without
    /// forwarding (437, or a counted drop).
    AnsweredLocally,
}

/// A client's datagram as it arrived: when, under which snapshot, on which listener, from
/// whom and how. What every call of [`super::Engine::handle_client`] takes besides the bytes.
#[derive(Debug, Clone, Copy)]
pub struct Arrival<'a> {
    /// When it was received.
    pub now: Instant,
    /// The snapshot it is served under.
    pub snap: &'a Snapshot,
    /// The listener it arrived on (on the forwarder's pod, for a forwarded one: the same
    /// config names it on every pod).
    pub listener: ListenerRef<'a>,
    /// The client's address, as the listener saw it.
    pub client: SocketAddr,
    /// Straight, forwarded by a sibling, or a miss answered here.
    pub kind: ArrivalKind,
}

/// A peer's datagram as it arrived: when, under which snapshot, on which relay socket, from
/// whom. What [`super::Engine::handle_peer`] takes besides the buffers.
#[derive(Debug, Clone, Copy)]
pub struct PeerArrival<'a> {
    /// When it was received.
    pub now: Instant,
    /// The snapshot it is served under.
    pub snap: &'a Snapshot,
    /// The relay socket it arrived on.
    pub relay: RelayId,
    /// The peer's address.
    pub peer: SocketAddr,
}

/// What the shell must do with a datagram a client sent.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClientAction {
    /// Nothing to send; the datagram was consumed or dropped for `reason`.
    Drop(DropReason),
    /// Send `out[..len]` back to the client from the listener socket.
    Reply(usize),
    /// Send `data[payload]` to `peer` from relay socket `relay`.
    Relay {
        /// Relay socket to send from.
        relay: RelayId,
        /// Peer address.
        peer: SocketAddr,
        /// Payload, a range of the input datagram.
        payload: Range<usize>,
        /// The cluster that admitted the peer (for per-cluster counters).
        cluster: ClusterId,
    },
    /// Bind the relay sockets described, then call [`super::Engine::complete_allocate`].
    AllocateRelay(RelayRequest),
    /// No allocation on this 5-tuple for a datagram that needs one (ChannelData, Send, Refresh,
    /// CreatePermission, ChannelBind), arrived [`ArrivalKind::Straight`], and misses are
    /// forwarded ([`super::Engine::set_forward_misses`]): the shell may hand the datagram to
    /// the sibling pod that owns the client's allocation, or get today's answer by handing it
    /// in again as [`ArrivalKind::AnsweredLocally`]. Nothing was counted or answered.
    Miss,
}

/// A request for an allocation's relay sockets: one, or two for a dual allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayRequest {
    /// The socket to bind; its family ([`RelayId::family`]) is the one to bind (the wildcard
    /// of that family).
    pub relay: RelayId,
    /// Address family of `relay`.
    pub family: Family,
    /// A dual allocation's second socket (RFC 8656 ADDITIONAL-ADDRESS-FAMILY): IPv6, after
    /// `relay` (IPv4). Its bind may fail alone: the allocation then goes on without it.
    pub additional: Option<RelayId>,
    /// RFC 8656 EVEN-PORT: the port must be even (of each socket).
    pub even_port: bool,
    /// RFC 8656 DONT-FRAGMENT: set DF on relayed IPv4 datagrams.
    pub dont_fragment: bool,
}

impl RelayRequest {
    /// The sockets to bind, first `relay`, then the additional one.
    pub fn sockets(&self) -> impl Iterator<Item = RelayId> {
        std::iter::once(self.relay).chain(self.additional)
    }
}

/// The shell's answer to a [`RelayRequest`]: the port of each socket it bound, or why not.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BoundRelays {
    /// The socket of [`RelayRequest::relay`].
    pub relay: Result<u16, RelayBindError>,
    /// The socket of [`RelayRequest::additional`], when one was asked for (a shell that could
    /// not bind `relay` need not try it).
    pub additional: Option<Result<u16, RelayBindError>>,
}

impl From<Result<u16, RelayBindError>> for BoundRelays {
    /// The answer to a request for one socket.
    fn from(relay: Result<u16, RelayBindError>) -> Self {
        BoundRelays {
            relay,
            additional: None,
        }
    }
}

/// Why the shell could not bind (or watch) the relay socket an Allocate asked for; the client
/// gets 508 whatever the cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayBindError {
    /// The kind of the OS error (EMFILE and ENFILE, out of descriptors, are the usual ones).
    pub kind: std::io::ErrorKind,
}

impl From<&std::io::Error> for RelayBindError {
    fn from(error: &std::io::Error) -> Self {
        RelayBindError { kind: error.kind() }
    }
}

/// An IP address family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// IPv4.
    V4 = 0,
    /// IPv6.
    V6 = 1,
}

impl Family {
    /// Both families, IPv4 first.
    pub const ALL: [Family; 2] = [Family::V4, Family::V6];

    /// The family of a canonical address: IPv6 unless IPv4 (a caller that may hold an
    /// IPv4-mapped address uses [`Family::of`]).
    #[inline]
    pub(super) fn of_canonical(addr: SocketAddr) -> Family {
        if addr.is_ipv4() {
            Family::V4
        } else {
            Family::V6
        }
    }

    /// The family of `ip` once canonical (an IPv4-mapped IPv6 address is IPv4).
    pub(super) fn of(ip: IpAddr) -> Family {
        match unmapped_ip(ip) {
            IpAddr::V4(_) => Family::V4,
            IpAddr::V6(_) => Family::V6,
        }
    }
}

/// What the shell must do with a datagram a peer sent to a relay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PeerAction {
    /// Dropped for `reason`.
    Drop(DropReason),
    /// Send to `client` from listener `listener`: `buf[range]` (ChannelData framed in place)
    /// or `out[..len]` (a Data indication).
    ToClient {
        /// Listener whose socket sends.
        listener: ListenerId,
        /// Client address.
        client: SocketAddr,
        /// Where the bytes are.
        bytes: Bytes,
        /// The cluster that admitted the peer.
        cluster: ClusterId,
        /// Payload bytes received from the peer.
        payload_len: usize,
        /// The client's flow reaches us through a sibling pod: send the bytes back through it
        /// ([`super::Engine::via`]) instead of from the listener (second-chance forwarding).
        forwarded: bool,
    },
}

/// Where outgoing bytes lie.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Bytes {
    /// A range of the caller's input buffer.
    Input(Range<usize>),
    /// The first `n` bytes of the caller's output buffer.
    Output(usize),
}

/// Why a datagram produced nothing. Every reason is counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DropReason {
    /// Not a STUN message or ChannelData, or a malformed one.
    Malformed,
    /// A STUN response or unhandled method/class, ignored.
    Unhandled,
    /// Indication or ChannelData on a 5-tuple with no allocation.
    NoAllocation,
    /// ChannelData on an unbound (or expired) channel.
    NoChannel,
    /// Send indication or peer datagram without a permission.
    NoPermission,
    /// The peer address is not in a routed cluster (IP and port).
    NotAdmitted,
    /// The output buffer was too small (our bug).
    Internal,
    /// A 401/438 challenge not sent: its source IP spent its challenge budget.
    RateLimited,
    /// A reply to an unauthenticated request not sent: it would have been more than
    /// [`super::AMPLIFICATION_FACTOR`] times the request (a 401 to a 20-byte request).
    Amplification,
}

impl DropReason {
    /// Every reason, for counters.
    pub const ALL: [DropReason; 9] = [
        DropReason::Malformed,
        DropReason::Unhandled,
        DropReason::NoAllocation,
        DropReason::NoChannel,
        DropReason::NoPermission,
        DropReason::NotAdmitted,
        DropReason::Internal,
        DropReason::RateLimited,
        DropReason::Amplification,
    ];

    /// Stable index into counter arrays.
    pub fn index(self) -> usize {
        self as usize
    }

    /// Name for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            DropReason::Malformed => "malformed",
            DropReason::Unhandled => "unhandled",
            DropReason::NoAllocation => "no_allocation",
            DropReason::NoChannel => "no_channel",
            DropReason::NoPermission => "no_permission",
            DropReason::NotAdmitted => "not_admitted",
            DropReason::Internal => "internal",
            DropReason::RateLimited => "rate_limited",
            DropReason::Amplification => "amplification",
        }
    }
}

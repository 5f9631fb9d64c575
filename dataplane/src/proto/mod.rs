//! The sans-IO TURN engine (RFC 8656 over RFC 8489 message parsing from `stun-proto`).
//!
//! One [`Engine`] per shard. It never opens a socket or reads a clock: every call takes `now`
//! and the current [`Snapshot`], and returns what the IO shell must do.
//!
//! Call order, for the shell:
//! 1. A datagram from a client on a listener socket → [`Engine::handle_client`]. On
//!    [`ClientAction::AllocateRelay`] bind a relay socket as asked and call
//!    [`Engine::complete_allocate`] at once with the result; send its reply.
//! 2. A datagram from a peer on relay socket `r`, read into `buf[PEER_HEADROOM..]` →
//!    [`Engine::handle_peer`].
//! 3. When [`Engine::poll_timeout`] passes, call [`Engine::handle_timeout`].
//! 4. After any call, drain [`Engine::poll_close`] and close those relay sockets.
// Wire input reaches every line of this module: memory safety is the compiler's to prove.
#![forbid(unsafe_code)]

mod error;
pub mod limits;
mod nonce;
pub mod ratelimit;
mod wire;

pub use limits::{AllocationLedger, Limits};
pub use nonce::{NonceCheck, NonceIssuer, NONCE_LIFETIME_SECS};

use error::{Challenge, RequestError};
use foldhash::fast::RandomState;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};
use stun_proto::types::attribute::{
    Attribute, AttributeFromRaw, AttributeStaticType, MessageIntegrity, MessageIntegritySha256,
    Nonce, Realm, Username,
};
use stun_proto::types::message::{
    IntegrityAlgorithm, IntegrityKey, LongTermKeyCredentials, Message, MessageClass, TransactionId,
    BINDING,
};
use turn_types::attribute::{
    ChannelNumber, Data, DontFragment, EvenPort, Lifetime, RequestedAddressFamily,
    RequestedTransport, ReservationToken, XorPeerAddress,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH, SEND};
use turn_types::AddressFamily;
use uturn_shared::snapshot::{canonical_ip, ClusterId, ListenerSpec, Snapshot};
use wire::ResponseWriter;

/// Allocation lifetime when none (or 3600 s or more) is requested, as pion/stunnerd.
pub const DEFAULT_ALLOCATION_LIFETIME: Duration = Duration::from_secs(600);
/// Requested lifetimes at or above this fall back to the default (pion's rule).
pub const MAX_REQUESTED_LIFETIME_SECS: u32 = 3600;
/// Permission lifetime (RFC 8656 §9).
pub const PERMISSION_LIFETIME: Duration = Duration::from_secs(300);
/// Channel binding lifetime (RFC 8656 §12).
pub const CHANNEL_LIFETIME: Duration = Duration::from_secs(600);
/// How often [`Engine::handle_timeout`] sweeps for expired state.
pub const SWEEP_INTERVAL: Duration = Duration::from_secs(1);
/// Bytes the shell leaves free in front of a peer datagram, so ChannelData can be framed in place.
pub const PEER_HEADROOM: usize = 4;

/// RFC 9000 §8.1's anti-amplification rule, applied to every reply to a request that did not
/// authenticate, on every transport: at most this many times the request's size in bytes.
pub const AMPLIFICATION_FACTOR: usize = 3;

/// Channel numbers accepted (RFC 5766 range, as pion; RFC 8656 clients use a subset).
pub const CHANNEL_NUMBERS: std::ops::RangeInclusive<u16> = 0x4000..=0x7FFF;

/// IANA protocol number of UDP in REQUESTED-TRANSPORT.
const TRANSPORT_UDP: u8 = 17;

/// The shell's handle for a running listener, stable across reconciles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerId(pub u32);

/// The engine's handle for an allocation and its relay socket (an index the shell mirrors).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RelayId(pub u32);

/// A listener as the engine sees it on each call.
#[derive(Debug, Clone, Copy)]
pub struct ListenerRef<'a> {
    /// The shell's id for it.
    pub id: ListenerId,
    /// Its spec in the running snapshot.
    pub spec: &'a ListenerSpec,
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
    /// Bind a relay socket as described, then call [`Engine::complete_allocate`].
    AllocateRelay(RelayRequest),
}

/// A request for a relay socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RelayRequest {
    /// The slot the socket belongs to.
    pub relay: RelayId,
    /// Address family to bind (the wildcard of that family).
    pub family: Family,
    /// RFC 8656 EVEN-PORT: the port must be even.
    pub even_port: bool,
    /// RFC 8656 DONT-FRAGMENT: set DF on relayed IPv4 datagrams.
    pub dont_fragment: bool,
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
    V4,
    /// IPv6.
    V6,
}

impl Family {
    fn of(ip: IpAddr) -> Family {
        match canonical_ip(ip) {
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
    /// [`AMPLIFICATION_FACTOR`] times the request (a 401 to a 20-byte request).
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct ClientKey {
    listener: ListenerId,
    client: SocketAddr,
}

struct Permission {
    ip: IpAddr,
    expires_at: Instant,
    /// Admission verdict for the last peer port seen: (generation, port, admitting cluster).
    verdict: Option<(u64, u16, Option<ClusterId>)>,
}

struct Channel {
    number: u16,
    peer: SocketAddr,
    expires_at: Instant,
    /// Admission verdict for `peer` and the snapshot generation it was made under.
    verdict: Option<(u64, Option<ClusterId>)>,
}

struct Allocation {
    key: ClientKey,
    listener_name: String,
    family: Family,
    username: String,
    /// Whose quota the allocation counts against.
    user_id: String,
    expires_at: Instant,
    allocate_txid: TransactionId,
    allocate_response: Vec<u8>,
    permissions: Vec<Permission>,
    channels: Vec<Channel>,
}

struct PendingAllocate {
    relay: RelayId,
    key: ClientKey,
    listener_name: String,
    advertised_ip: IpAddr,
    family: Family,
    username: String,
    user_id: String,
    integrity: IntegrityKey,
    lifetime: Duration,
    txid: TransactionId,
}

/// An authenticated request: who sent it and the key its response is signed with.
struct Authed {
    username: String,
    user_id: String,
    integrity: IntegrityKey,
}

/// The TURN state machine of one shard.
pub struct Engine {
    config: EngineConfig,
    nonces: NonceIssuer,
    slots: Vec<Option<Allocation>>,
    free_slots: Vec<u32>,
    by_client: HashMap<ClientKey, u32, RandomState>,
    pending: Option<PendingAllocate>,
    closes: Vec<RelayId>,
    next_sweep: Option<Instant>,
    /// Transaction ids of Data indications: a CSPRNG of this engine's own, seeded from the
    /// OS, so the ids reveal nothing of the nonce key nor repeat another shard's.
    indication_txids: StdRng,
    stats: EngineStats,
    denial_log: ratelimit::LogLimiter,
    challenges: limits::ChallengeLimiter,
}

impl Engine {
    /// A new engine with no allocations.
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            challenges: limits::ChallengeLimiter::new(
                config.limits.challenge_rate,
                config.limits.challenge_burst,
                config.epoch,
            ),
            nonces: NonceIssuer::new(config.nonce_key),
            config,
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_client: HashMap::with_hasher(RandomState::default()),
            pending: None,
            closes: Vec::new(),
            next_sweep: None,
            indication_txids: StdRng::from_entropy(),
            stats: EngineStats::default(),
            denial_log: ratelimit::LogLimiter::default(),
        }
    }

    /// Live allocations on this shard.
    pub fn allocation_count(&self) -> usize {
        self.by_client.len()
    }

    /// The counters of this shard.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn unix_now(&self, now: Instant) -> u64 {
        self.config.epoch_unix + now.saturating_duration_since(self.config.epoch).as_secs()
    }

    fn dropped(&mut self, reason: DropReason) -> DropReason {
        self.stats.dropped[reason.index()] += 1;
        reason
    }

    /// Handles one datagram a client sent to `listener` from `from`, writing any reply into
    /// `out` (at least 1500 bytes).
    pub fn handle_client(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        data: &[u8],
        out: &mut [u8],
    ) -> ClientAction {
        // RFC 8656 §12.4: ChannelData starts with 0b01; STUN messages start with 0b00.
        match data.first().map(|b| b >> 6) {
            Some(0b01) => self.handle_channel_data(now, snap, listener.id, from, data),
            Some(0b00) => match Message::from_bytes(data) {
                Ok(msg) => self.handle_stun(now, snap, listener, from, &msg, out),
                Err(_) => ClientAction::Drop(self.dropped(DropReason::Malformed)),
            },
            _ => ClientAction::Drop(self.dropped(DropReason::Malformed)),
        }
    }

    fn handle_channel_data(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerId,
        from: SocketAddr,
        data: &[u8],
    ) -> ClientAction {
        if data.len() < 4 {
            return ClientAction::Drop(self.dropped(DropReason::Malformed));
        }
        let number = u16::from_be_bytes([data[0], data[1]]);
        let length = usize::from(u16::from_be_bytes([data[2], data[3]]));
        // RFC 8656 §12.5: over UDP the datagram may carry padding after `length` bytes.
        if !CHANNEL_NUMBERS.contains(&number) || 4 + length > data.len() {
            return ClientAction::Drop(self.dropped(DropReason::Malformed));
        }
        let key = ClientKey {
            listener,
            client: from,
        };
        let Some(&slot) = self.by_client.get(&key) else {
            return ClientAction::Drop(self.dropped(DropReason::NoAllocation));
        };
        let Some(alloc) = self.slots[slot as usize].as_mut() else {
            return ClientAction::Drop(self.dropped(DropReason::Internal));
        };
        let Some(channel) = alloc
            .channels
            .iter_mut()
            .find(|c| c.number == number && c.expires_at > now)
        else {
            return ClientAction::Drop(self.dropped(DropReason::NoChannel));
        };
        let peer = channel.peer;
        let Some(cluster) = admitted(snap, &alloc.listener_name, channel) else {
            return ClientAction::Drop(self.dropped(DropReason::NotAdmitted));
        };
        ClientAction::Relay {
            relay: RelayId(slot),
            peer,
            payload: 4..4 + length,
            cluster,
        }
    }

    fn handle_stun(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        msg: &Message<'_>,
        out: &mut [u8],
    ) -> ClientAction {
        let class = msg.class();
        let method = msg.method();
        if class == MessageClass::Indication {
            if method == SEND {
                return self.handle_send(now, snap, listener.id, from, msg);
            }
            // Binding indications are keepalives; nothing to answer.
            return ClientAction::Drop(self.dropped(DropReason::Unhandled));
        }
        if class != MessageClass::Request {
            return ClientAction::Drop(self.dropped(DropReason::Unhandled));
        }
        if method == BINDING {
            // RFC 8489 §6.3.1 / stunnerd: Binding is answered without authentication.
            return match wire::binding_success(msg, from, out) {
                Some(n) => self.within_amplification_bound(msg, n),
                None => ClientAction::Drop(self.dropped(DropReason::Internal)),
            };
        }
        if ![ALLOCATE, REFRESH, CREATE_PERMISSION, CHANNEL_BIND].contains(&method) {
            // Unknown requests (and RFC 6062 Connect on UDP) get 400, never silence that could
            // be mistaken for loss.
            return self.reply_unauthenticated(msg, RequestError::UnknownMethod, out);
        }
        // RFC 8489 §6.3.1: unknown comprehension-required attributes → 420.
        let unknown = wire::unknown_required_attributes(msg);
        if !unknown.is_empty() {
            return self.reply_unauthenticated(msg, RequestError::UnknownAttributes(unknown), out);
        }
        let key = ClientKey {
            listener: listener.id,
            client: from,
        };
        // RFC 8656 §7.2: a retransmitted Allocate is answered from the cached response, so
        // a lost success does not turn into 437.
        if method == ALLOCATE {
            if let Some(alloc) = self
                .by_client
                .get(&key)
                .and_then(|&s| self.slots[s as usize].as_ref())
            {
                if alloc.allocate_txid == msg.transaction_id()
                    && alloc.allocate_response.len() <= out.len()
                {
                    let n = alloc.allocate_response.len();
                    out[..n].copy_from_slice(&alloc.allocate_response);
                    return self.within_amplification_bound(msg, n);
                }
            }
        }
        let authed = match self.authenticate(now, snap, from, msg) {
            Ok(authed) => authed,
            Err(error) => {
                let challenge = error.challenge().is_some();
                let action = self.reply_unauthenticated(msg, error, out);
                // Challenges are the one reply an unauthenticated source gets larger than its
                // request: budget them per source IP. On UDP the source may be spoofed (a
                // reflection); on TCP, TLS and DTLS it is not, but a client that pipelines
                // requests and never authenticates must not get answers without end either.
                // A token is spent only on a challenge that is sent.
                if challenge
                    && matches!(action, ClientAction::Reply(_))
                    && !self.challenges.allow(from.ip(), now)
                {
                    return ClientAction::Drop(self.dropped(DropReason::RateLimited));
                }
                return action;
            }
        };
        let existing = self.by_client.get(&key).copied();
        if method == ALLOCATE {
            if existing.is_some() {
                // RFC 8656 §7.2 step 2: 5-tuple already in use.
                return self.reply_error(
                    msg,
                    RequestError::AllocationExists,
                    Some(&authed.integrity),
                    out,
                );
            }
            return self.handle_allocate(snap, listener, key, authed, msg, out);
        }
        // RFC 8656 §7.3, §9.2, §11.2: no allocation on this 5-tuple → 437.
        let Some(slot) = existing else {
            return self.reply_error(
                msg,
                RequestError::NoAllocation,
                Some(&authed.integrity),
                out,
            );
        };
        // RFC 8656 §5: requests on an allocation must use the credentials that created it.
        if self.slots[slot as usize]
            .as_ref()
            .is_none_or(|a| a.username != authed.username)
        {
            return self.reply_error(msg, RequestError::WrongCredentials, None, out);
        }
        let result = match method {
            REFRESH => self.handle_refresh(now, slot, msg),
            CREATE_PERMISSION => self.handle_create_permission(now, snap, slot, msg),
            _ => self.handle_channel_bind(now, snap, slot, msg),
        };
        match result {
            Ok(lifetime) => {
                let mut w = ResponseWriter::success(msg, out);
                if let Some(seconds) = lifetime {
                    w.add(&Lifetime::new(seconds));
                }
                match w.finish(Some(&authed.integrity)) {
                    Some(n) => ClientAction::Reply(n),
                    None => ClientAction::Drop(self.dropped(DropReason::Internal)),
                }
            }
            Err(error) => self.reply_error(msg, error, Some(&authed.integrity), out),
        }
    }

    fn reply_error(
        &mut self,
        msg: &Message<'_>,
        error: RequestError,
        integrity: Option<&IntegrityKey>,
        out: &mut [u8],
    ) -> ClientAction {
        match wire::error_response(msg, &error, error.reason(), integrity, out) {
            Some(n) => ClientAction::Reply(n),
            None => ClientAction::Drop(self.dropped(DropReason::Internal)),
        }
    }

    /// An error reply to a request that did not authenticate, within
    /// [`AMPLIFICATION_FACTOR`] times the request's size: the reason phrase goes first (RFC
    /// 8489 §14.8: it is for humans), then the whole reply (dropped and counted).
    fn reply_unauthenticated(
        &mut self,
        msg: &Message<'_>,
        error: RequestError,
        out: &mut [u8],
    ) -> ClientAction {
        let budget = AMPLIFICATION_FACTOR * msg.as_bytes().len();
        let n = match wire::error_response(msg, &error, error.reason(), None, out) {
            Some(n) if n > budget => wire::error_response(msg, &error, "", None, out),
            written => written,
        };
        let Some(n) = n else {
            return ClientAction::Drop(self.dropped(DropReason::Internal));
        };
        let action = self.within_amplification_bound(msg, n);
        // The first 401 (no credentials yet) and 438 are the normal challenge; only a 401 to a
        // request whose MESSAGE-INTEGRITY was checked counts as refused credentials.
        if matches!(error, RequestError::CredentialsRefused(_))
            && matches!(action, ClientAction::Reply(_))
        {
            self.stats.auth_failures += 1;
        }
        action
    }

    /// `out[..n]`, a reply to the unauthenticated request `msg`, if it is at most
    /// [`AMPLIFICATION_FACTOR`] times as large; otherwise nothing, counted.
    fn within_amplification_bound(&mut self, msg: &Message<'_>, n: usize) -> ClientAction {
        if n <= AMPLIFICATION_FACTOR * msg.as_bytes().len() {
            ClientAction::Reply(n)
        } else {
            ClientAction::Drop(self.dropped(DropReason::Amplification))
        }
    }

    /// The realm and a fresh nonce for `from`.
    fn challenge(&self, now: Instant, snap: &Snapshot, from: SocketAddr) -> Challenge {
        Challenge {
            realm: snap.auth.realm().to_owned(),
            nonce: self.nonces.issue(self.unix_now(now), from),
        }
    }

    /// RFC 8489 §9.2.4: long-term credential checks, in the RFC's order.
    fn authenticate(
        &self,
        now: Instant,
        snap: &Snapshot,
        from: SocketAddr,
        msg: &Message<'_>,
    ) -> Result<Authed, RequestError> {
        if !msg.has_attribute(MessageIntegrity::TYPE)
            && !msg.has_attribute(MessageIntegritySha256::TYPE)
        {
            return Err(RequestError::Unauthenticated(
                self.challenge(now, snap, from),
            ));
        }
        let (Ok(username), Ok(_realm), Ok(nonce)) = (
            msg.attribute::<Username>(),
            msg.attribute::<Realm>(),
            msg.attribute::<Nonce>(),
        ) else {
            return Err(RequestError::MissingCredentialAttributes);
        };
        let unix_now = self.unix_now(now);
        if self.nonces.check(nonce.nonce(), unix_now, from) == NonceCheck::Stale {
            return Err(RequestError::StaleNonce(self.challenge(now, snap, from)));
        }
        // RFC 8489 §9.2.4: a 401 to a request that used a valid nonce repeats that nonce, so
        // the client sees its credentials, not the nonce, were refused and does not loop.
        let refused = || {
            let mut echoed = [0u8; nonce::NONCE_LEN];
            echoed.copy_from_slice(nonce.nonce().as_bytes());
            RequestError::CredentialsRefused(Challenge {
                realm: snap.auth.realm().to_owned(),
                nonce: echoed,
            })
        };
        let credentials = match snap.auth.credentials(username.username(), unix_now) {
            Ok(c) => c,
            // auth type none: TURN is off; 400 so that clients do not retry (as stunnerd).
            Err(uturn_shared::auth::AuthError::TurnDisabled) => {
                return Err(RequestError::TurnDisabled)
            }
            Err(_) => return Err(refused()),
        };
        let integrity = LongTermKeyCredentials::new(
            username.username().to_owned(),
            credentials.password,
            snap.auth.realm().to_owned(),
        )
        .make_key(IntegrityAlgorithm::Sha1);
        if msg.validate_integrity_with_key(&integrity).is_err() {
            return Err(refused());
        }
        Ok(Authed {
            username: username.username().to_owned(),
            user_id: credentials.user_id,
            integrity,
        })
    }

    fn handle_allocate(
        &mut self,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        key: ClientKey,
        authed: Authed,
        msg: &Message<'_>,
        out: &mut [u8],
    ) -> ClientAction {
        let integrity = Some(&authed.integrity);
        // RFC 8656 §7.2 step 3: REQUESTED-TRANSPORT is required; only UDP relaying here.
        let Ok(transport) = msg.attribute::<RequestedTransport>() else {
            return self.reply_error(msg, RequestError::MissingRequestedTransport, integrity, out);
        };
        if transport.protocol() != TRANSPORT_UDP {
            return self.reply_error(msg, RequestError::UnsupportedTransport, integrity, out);
        }
        let has_even_port = msg.has_attribute(EvenPort::TYPE);
        let has_token = msg.has_attribute(ReservationToken::TYPE);
        let has_family = msg.has_attribute(RequestedAddressFamily::TYPE);
        // RFC 8656 §7.2 step 5/6: RESERVATION-TOKEN excludes EVEN-PORT and
        // REQUESTED-ADDRESS-FAMILY.
        if has_token && (has_even_port || has_family) {
            return self.reply_error(
                msg,
                RequestError::ReservationTokenWithEvenPortOrFamily,
                integrity,
                out,
            );
        }
        if has_token {
            // We never hand out reservations, so no token can be valid.
            return self.reply_error(
                msg,
                RequestError::ReservationTokenUnsupported,
                integrity,
                out,
            );
        }
        let even_port = match msg.attribute::<EvenPort>() {
            // We do not reserve the next port; a request for one cannot be met.
            Ok(even) if even.requested() => {
                return self.reply_error(
                    msg,
                    RequestError::PortReservationUnsupported,
                    integrity,
                    out,
                )
            }
            Ok(_) => true,
            Err(_) if has_even_port => {
                return self.reply_error(msg, RequestError::MalformedEvenPort, integrity, out)
            }
            Err(_) => false,
        };
        let advertised_ip = listener.spec.advertised_ip;
        let listener_family = Family::of(advertised_ip);
        let family = match msg.attribute::<RequestedAddressFamily>() {
            Ok(requested) if requested.family() == AddressFamily::IPV4 => Family::V4,
            Ok(_) => Family::V6,
            Err(_) if has_family => {
                return self.reply_error(msg, RequestError::MalformedAddressFamily, integrity, out)
            }
            Err(_) => listener_family,
        };
        if family != listener_family {
            // The advertised relay address is the listener's; it cannot be of another family.
            return self.reply_error(msg, RequestError::FamilyNotListeners, integrity, out);
        }
        let lifetime = requested_lifetime(msg).unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
        let lifetime = if lifetime.is_zero() {
            DEFAULT_ALLOCATION_LIFETIME
        } else {
            lifetime
        };
        // Reserved here, released in `complete_allocate` on a bind failure or in
        // `delete_allocation`.
        let (quota, cap) = (snap.user_quota, self.config.limits.max_allocations);
        if let Err(refused) = self.config.ledger.reserve(&authed.user_id, quota, cap) {
            self.stats.quota_refusals += 1;
            let error = match refused {
                limits::QuotaError::User => RequestError::UserQuotaReached,
                limits::QuotaError::Global => RequestError::AllocationCapReached,
            };
            return self.reply_error(msg, error, integrity, out);
        }
        let slot = match self.free_slots.pop() {
            Some(s) => s,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        };
        self.pending = Some(PendingAllocate {
            relay: RelayId(slot),
            key,
            listener_name: listener.spec.name.clone(),
            advertised_ip,
            family,
            username: authed.username,
            user_id: authed.user_id,
            integrity: authed.integrity,
            lifetime,
            txid: msg.transaction_id(),
        });
        ClientAction::AllocateRelay(RelayRequest {
            relay: RelayId(slot),
            family,
            even_port,
            dont_fragment: msg.has_attribute(DontFragment::TYPE),
        })
    }

    /// Completes the Allocate that asked for `relay`: `bound_port` is the relay socket's port,
    /// or why it could not be bound. Returns the length of the reply written to `out`.
    pub fn complete_allocate(
        &mut self,
        now: Instant,
        relay: RelayId,
        bound_port: Result<u16, RelayBindError>,
        out: &mut [u8],
    ) -> Option<usize> {
        let pending = self.pending.take().filter(|p| p.relay == relay)?;
        let port = match bound_port {
            Ok(port) => port,
            Err(bind_error) => {
                self.free_slots.push(relay.0);
                self.config.ledger.release(&pending.user_id);
                let error = RequestError::RelayBindFailed(bind_error);
                return wire::error_response_raw(
                    ALLOCATE,
                    pending.txid,
                    &error,
                    error.reason(),
                    Some(&pending.integrity),
                    out,
                );
            }
        };
        let relay_addr = SocketAddr::new(pending.advertised_ip, port);
        let Some(n) = wire::allocate_success(
            pending.txid,
            relay_addr,
            pending.key.client,
            pending.lifetime.as_secs() as u32,
            &pending.integrity,
            out,
        ) else {
            // `out` too small (our bug): the relay socket is closed and nothing is held.
            self.free_slots.push(relay.0);
            self.closes.push(relay);
            self.config.ledger.release(&pending.user_id);
            self.dropped(DropReason::Internal);
            return None;
        };
        self.slots[relay.0 as usize] = Some(Allocation {
            key: pending.key,
            listener_name: pending.listener_name,
            family: pending.family,
            username: pending.username,
            user_id: pending.user_id,
            expires_at: now + pending.lifetime,
            allocate_txid: pending.txid,
            allocate_response: out[..n].to_vec(),
            permissions: Vec::new(),
            channels: Vec::new(),
        });
        self.by_client.insert(pending.key, relay.0);
        self.stats.allocations_created += 1;
        self.next_sweep.get_or_insert(now + SWEEP_INTERVAL);
        Some(n)
    }

    fn handle_refresh(
        &mut self,
        now: Instant,
        slot: u32,
        msg: &Message<'_>,
    ) -> Result<Option<u32>, RequestError> {
        let Some(alloc) = self.slots[slot as usize].as_mut() else {
            return Err(RequestError::NoAllocation);
        };
        // RFC 8656 §7.3: a REQUESTED-ADDRESS-FAMILY that differs from the allocation's → 443.
        if let Ok(requested) = msg.attribute::<RequestedAddressFamily>() {
            let family = if requested.family() == AddressFamily::IPV4 {
                Family::V4
            } else {
                Family::V6
            };
            if family != alloc.family {
                return Err(RequestError::RefreshFamilyMismatch);
            }
        }
        match requested_lifetime(msg) {
            Some(lifetime) if lifetime.is_zero() => {
                // RFC 8656 §7.3: LIFETIME 0 deletes the allocation.
                self.delete_allocation(slot);
                Ok(Some(0))
            }
            requested => {
                let lifetime = requested.unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
                alloc.expires_at = now + lifetime;
                Ok(Some(lifetime.as_secs() as u32))
            }
        }
    }

    fn handle_create_permission(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        slot: u32,
        msg: &Message<'_>,
    ) -> Result<Option<u32>, RequestError> {
        let max_permissions = self.config.limits.max_permissions;
        let Some(alloc) = self.slots[slot as usize].as_mut() else {
            return Err(RequestError::NoAllocation);
        };
        alloc.permissions.retain(|p| p.expires_at > now);
        let route = snap.route(&alloc.listener_name);
        let log = &mut self.denial_log;
        let mut named = {
            let alloc = &*alloc;
            named_peers(msg, &alloc.permissions, max_permissions, |ip| {
                if Family::of(ip) != alloc.family {
                    return Err(RequestError::PeerFamilyMismatch);
                }
                // stunnerd: the peer IP must lie in a cluster routed from the listener; the
                // RFC's answer for a policy denial is 403. Any denied peer fails the whole
                // request.
                if !route.is_some_and(|r| snap.permits_ip(r, ip)) {
                    return Err(denied(log, now, alloc, ip));
                }
                Ok(())
            })?
        };
        // The whole request fits: refresh the held permissions it names, install the others.
        for permission in &mut alloc.permissions {
            if named.remove(&permission.ip) {
                permission.expires_at = now + PERMISSION_LIFETIME;
            }
        }
        alloc
            .permissions
            .extend(named.into_iter().map(|ip| Permission {
                ip,
                expires_at: now + PERMISSION_LIFETIME,
                verdict: None,
            }));
        Ok(None)
    }

    fn handle_channel_bind(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        slot: u32,
        msg: &Message<'_>,
    ) -> Result<Option<u32>, RequestError> {
        let max_permissions = self.config.limits.max_permissions;
        let Some(alloc) = self.slots[slot as usize].as_mut() else {
            return Err(RequestError::NoAllocation);
        };
        let (Ok(number), Ok(peer)) = (
            msg.attribute::<ChannelNumber>(),
            msg.attribute::<XorPeerAddress>(),
        ) else {
            return Err(RequestError::MissingChannelBindAttributes);
        };
        let number = number.channel();
        let peer = peer.addr(msg.transaction_id());
        let peer = SocketAddr::new(canonical_ip(peer.ip()), peer.port());
        // RFC 8656 §11.2 narrowed channel numbers to 0x4000-0x4FFF; RFC 5766 clients (coturn's
        // among them) still pick from 0x4000-0x7FFF, and pion/stunnerd accept that range.
        if !CHANNEL_NUMBERS.contains(&number) {
            return Err(RequestError::ChannelNumberOutOfRange);
        }
        if Family::of(peer.ip()) != alloc.family {
            return Err(RequestError::PeerFamilyMismatch);
        }
        // RFC 8656 §11.2: the number may not be bound to another peer, nor the peer to
        // another number.
        if alloc
            .channels
            .iter()
            .any(|c| c.expires_at > now && ((c.number == number) != (c.peer == peer)))
        {
            return Err(RequestError::ChannelBoundElsewhere);
        }
        let route = snap.route(&alloc.listener_name);
        if !route.is_some_and(|r| snap.permits_ip(r, peer.ip())) {
            return Err(denied(&mut self.denial_log, now, alloc, peer.ip()));
        }
        let bound = alloc.channels.iter().any(|c| c.number == number);
        if !bound {
            // Channels to one peer IP share its permission; cap them as permissions are.
            alloc.channels.retain(|c| c.expires_at > now);
            if alloc.channels.len() >= max_permissions {
                return Err(RequestError::TooManyChannels);
            }
        }
        install_permission(alloc, peer.ip(), now, max_permissions)?;
        match alloc.channels.iter_mut().find(|c| c.number == number) {
            Some(channel) => {
                channel.peer = peer;
                channel.expires_at = now + CHANNEL_LIFETIME;
            }
            None => alloc.channels.push(Channel {
                number,
                peer,
                expires_at: now + CHANNEL_LIFETIME,
                verdict: None,
            }),
        }
        Ok(None)
    }

    fn handle_send(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerId,
        from: SocketAddr,
        msg: &Message<'_>,
    ) -> ClientAction {
        let key = ClientKey {
            listener,
            client: from,
        };
        let Some(&slot) = self.by_client.get(&key) else {
            return ClientAction::Drop(self.dropped(DropReason::NoAllocation));
        };
        let Some(alloc) = self.slots[slot as usize].as_mut() else {
            return ClientAction::Drop(self.dropped(DropReason::Internal));
        };
        let (Ok(peer), Some((offset, data))) = (
            msg.attribute::<XorPeerAddress>(),
            msg.raw_attribute_and_offset(Data::TYPE),
        ) else {
            return ClientAction::Drop(self.dropped(DropReason::Malformed));
        };
        let peer = peer.addr(msg.transaction_id());
        let peer = SocketAddr::new(canonical_ip(peer.ip()), peer.port());
        // RFC 8656 §10.2: relayed only with a permission for the peer's IP (and, here, only
        // to a peer address a routed cluster admits).
        let cluster = match permission_admits(alloc, snap, peer, now) {
            Ok(cluster) => cluster,
            Err(reason) => return ClientAction::Drop(self.dropped(reason)),
        };
        let start = offset + 4;
        ClientAction::Relay {
            relay: RelayId(slot),
            peer,
            payload: start..start + data.length() as usize,
            cluster,
        }
    }

    /// Handles a datagram from `peer` on relay socket `relay`. The payload is
    /// `buf[PEER_HEADROOM..]`; the first `PEER_HEADROOM` bytes are free for framing.
    pub fn handle_peer(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        relay: RelayId,
        peer: SocketAddr,
        buf: &mut [u8],
        out: &mut [u8],
    ) -> PeerAction {
        let len = buf.len().saturating_sub(PEER_HEADROOM);
        let peer = SocketAddr::new(canonical_ip(peer.ip()), peer.port());
        let Some(alloc) = self
            .slots
            .get_mut(relay.0 as usize)
            .and_then(|s| s.as_mut())
        else {
            return PeerAction::Drop(self.dropped(DropReason::NoAllocation));
        };
        let listener = alloc.key.listener;
        let client = alloc.key.client;
        if len > usize::from(u16::MAX) || buf.len() < PEER_HEADROOM + len {
            return PeerAction::Drop(self.dropped(DropReason::Malformed));
        }
        if let Some(channel) = alloc
            .channels
            .iter_mut()
            .find(|c| c.peer == peer && c.expires_at > now)
        {
            let Some(cluster) = admitted(snap, &alloc.listener_name, channel) else {
                return PeerAction::Drop(self.dropped(DropReason::NotAdmitted));
            };
            // RFC 8656 §12.5: channel number, then length, then the payload.
            buf[..2].copy_from_slice(&channel.number.to_be_bytes());
            buf[2..4].copy_from_slice(&(len as u16).to_be_bytes());
            return PeerAction::ToClient {
                listener,
                client,
                bytes: Bytes::Input(0..PEER_HEADROOM + len),
                cluster,
                payload_len: len,
            };
        }
        // RFC 8656 §10.3: without a channel, a permission is needed, and a Data indication
        // carries the datagram.
        let cluster = match permission_admits(alloc, snap, peer, now) {
            Ok(cluster) => cluster,
            Err(reason) => return PeerAction::Drop(self.dropped(reason)),
        };
        // RFC 8489 §6: a transaction id is uniformly random; 96 of the generator's bits.
        let txid = TransactionId::from(self.indication_txids.gen::<u128>() >> 32);
        match wire::data_indication(txid, peer, &buf[PEER_HEADROOM..PEER_HEADROOM + len], out) {
            Some(n) => PeerAction::ToClient {
                listener,
                client,
                bytes: Bytes::Output(n),
                cluster,
                payload_len: len,
            },
            None => PeerAction::Drop(self.dropped(DropReason::Internal)),
        }
    }

    /// When [`Engine::handle_timeout`] should next run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_sweep
    }

    /// Expires allocations, permissions and channels whose time has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        let expired: Vec<u32> = self
            .by_client
            .values()
            .copied()
            .filter(|&s| {
                self.slots[s as usize]
                    .as_ref()
                    .is_none_or(|a| a.expires_at <= now)
            })
            .collect();
        for slot in expired {
            self.delete_allocation(slot);
        }
        for alloc in self.slots.iter_mut().flatten() {
            alloc.permissions.retain(|p| p.expires_at > now);
            alloc.channels.retain(|c| c.expires_at > now);
        }
        self.next_sweep = if self.by_client.is_empty() {
            None
        } else {
            Some(now + SWEEP_INTERVAL)
        };
    }

    /// Drops every allocation made on `listener` (it was closed or restarted).
    pub fn close_listener(&mut self, listener: ListenerId) {
        let slots: Vec<u32> = self
            .by_client
            .iter()
            .filter(|(k, _)| k.listener == listener)
            .map(|(_, &s)| s)
            .collect();
        for slot in slots {
            self.delete_allocation(slot);
        }
    }

    /// Drops the allocation of `client` on `listener`, if any: its stream connection (TCP,
    /// TLS) or DTLS session closed (RFC 8656 §3.1: the allocation lives no longer).
    pub fn close_client(&mut self, listener: ListenerId, client: SocketAddr) {
        if let Some(&slot) = self.by_client.get(&ClientKey { listener, client }) {
            self.delete_allocation(slot);
        }
    }

    /// Whether `client` holds an allocation on `listener`.
    pub fn has_allocation(&self, listener: ListenerId, client: SocketAddr) -> bool {
        self.by_client.contains_key(&ClientKey { listener, client })
    }

    /// The next relay socket the shell must close.
    pub fn poll_close(&mut self) -> Option<RelayId> {
        self.closes.pop()
    }

    fn delete_allocation(&mut self, slot: u32) {
        if let Some(alloc) = self.slots[slot as usize].take() {
            self.by_client.remove(&alloc.key);
            self.free_slots.push(slot);
            self.closes.push(RelayId(slot));
            self.stats.allocations_deleted += 1;
            self.config.ledger.release(&alloc.user_id);
        }
    }
}

/// The cached admission verdict of a channel, recomputed when the snapshot generation changes.
fn admitted(snap: &Snapshot, listener_name: &str, channel: &mut Channel) -> Option<ClusterId> {
    match channel.verdict {
        Some((generation, verdict)) if generation == snap.generation => verdict,
        _ => {
            let verdict = snap
                .route(listener_name)
                .and_then(|r| snap.admits(r, channel.peer));
            channel.verdict = Some((snap.generation, verdict));
            verdict
        }
    }
}

/// Whether a live permission covers `peer`'s IP and a routed cluster admits `peer` (IP and
/// port); the verdict is cached on the permission until the generation or the port changes.
fn permission_admits(
    alloc: &mut Allocation,
    snap: &Snapshot,
    peer: SocketAddr,
    now: Instant,
) -> Result<ClusterId, DropReason> {
    let listener_name = &alloc.listener_name;
    let Some(permission) = alloc
        .permissions
        .iter_mut()
        .find(|p| p.ip == peer.ip() && p.expires_at > now)
    else {
        return Err(DropReason::NoPermission);
    };
    let admitted = match permission.verdict {
        Some((generation, port, admitted))
            if generation == snap.generation && port == peer.port() =>
        {
            admitted
        }
        _ => {
            let admitted = snap.route(listener_name).and_then(|r| snap.admits(r, peer));
            permission.verdict = Some((snap.generation, peer.port(), admitted));
            admitted
        }
    };
    admitted.ok_or(DropReason::NotAdmitted)
}

/// A policy denial (RFC 8656: 403), logged as stunnerd does, rate-limited per shard.
fn denied(
    log: &mut ratelimit::LogLimiter,
    now: Instant,
    alloc: &Allocation,
    peer: IpAddr,
) -> RequestError {
    if let Some(suppressed) = log.allow(now) {
        tracing::info!(
            target: "auth",
            "permission denied on listener {:?} for client \"{}\" to peer {}: no route to endpoint{suppressed}",
            alloc.listener_name,
            alloc.key.client,
            peer
        );
    }
    RequestError::PeerDenied
}

/// The distinct peer IPs a CreatePermission names, in one pass over its attributes.
///
/// `check` judges each distinct IP once (family, policy). RFC 8656 §9.2: the request succeeds
/// only if all of it can, so the pass stops with 508 as soon as the new IPs and the `held`
/// permissions together exceed `cap`: a 64 KB request naming 5 444 peers costs no more than
/// one naming `cap + 1`, and repeats of a peer cost a hash lookup each.
fn named_peers(
    msg: &Message<'_>,
    held: &[Permission],
    cap: usize,
    mut check: impl FnMut(IpAddr) -> Result<(), RequestError>,
) -> Result<HashSet<IpAddr, RandomState>, RequestError> {
    let txid = msg.transaction_id();
    let held_ips: HashSet<IpAddr, RandomState> = held.iter().map(|p| p.ip).collect();
    let mut named: HashSet<IpAddr, RandomState> = HashSet::default();
    let mut new_peers = 0usize;
    for (_, raw) in msg.iter_attributes() {
        if raw.get_type() != XorPeerAddress::TYPE {
            continue;
        }
        let Ok(peer) = XorPeerAddress::from_raw_ref(&raw) else {
            return Err(RequestError::MalformedPeerAddress);
        };
        let ip = canonical_ip(peer.addr(txid).ip());
        if named.contains(&ip) {
            continue;
        }
        check(ip)?;
        named.insert(ip);
        if !held_ips.contains(&ip) {
            new_peers += 1;
            if held.len() + new_peers > cap {
                return Err(RequestError::TooManyPermissions);
            }
        }
    }
    // RFC 8656 §9.2: at least one XOR-PEER-ADDRESS.
    if named.is_empty() {
        return Err(RequestError::NoPeerAddress);
    }
    Ok(named)
}

fn install_permission(
    alloc: &mut Allocation,
    ip: IpAddr,
    now: Instant,
    max_permissions: usize,
) -> Result<(), RequestError> {
    let ip = canonical_ip(ip);
    if let Some(p) = alloc.permissions.iter_mut().find(|p| p.ip == ip) {
        p.expires_at = now + PERMISSION_LIFETIME;
        return Ok(());
    }
    alloc.permissions.retain(|p| p.expires_at > now);
    if alloc.permissions.len() >= max_permissions {
        return Err(RequestError::TooManyPermissions);
    }
    alloc.permissions.push(Permission {
        ip,
        expires_at: now + PERMISSION_LIFETIME,
        verdict: None,
    });
    Ok(())
}

/// pion's lifetime rule: a requested LIFETIME below 3600 s is honoured, anything else gives
/// the default. `None` when no LIFETIME was sent.
fn requested_lifetime(msg: &Message<'_>) -> Option<Duration> {
    let seconds = msg.attribute::<Lifetime>().ok()?.seconds();
    Some(if seconds < MAX_REQUESTED_LIFETIME_SECS {
        Duration::from_secs(u64::from(seconds))
    } else {
        DEFAULT_ALLOCATION_LIFETIME
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use stun_proto::types::message::{MessageWrite, MessageWriteExt, MessageWriteVec};

    fn create_permission(peers: impl Iterator<Item = SocketAddr>) -> Vec<u8> {
        let mut msg = Message::builder_request(CREATE_PERMISSION, MessageWriteVec::new());
        let txid = msg.transaction_id();
        for peer in peers {
            msg.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        }
        msg.finish()
    }

    fn peer(i: u32) -> SocketAddr {
        SocketAddr::new(std::net::Ipv4Addr::from(0x0a00_0000 + i).into(), 5000)
    }

    #[test]
    fn named_peers_judges_each_distinct_peer_once_and_stops_at_the_cap() {
        // 5 444 distinct peers (a 64 KB request) against a cap of 256: the pass stops at the
        // 257th, having judged no more.
        let data = create_permission((0..5_444).map(peer));
        let msg = Message::from_bytes(&data).unwrap();
        let mut judged = 0;
        let result = named_peers(&msg, &[], 256, |_| {
            judged += 1;
            Ok(())
        });
        assert_eq!(result.unwrap_err().code(), 508);
        assert_eq!(judged, 257);
        // With 200 held, the 57th new peer is one too many.
        let held: Vec<Permission> = (10_000..10_200)
            .map(|i| Permission {
                ip: peer(i).ip(),
                expires_at: Instant::now(),
                verdict: None,
            })
            .collect();
        judged = 0;
        let result = named_peers(&msg, &held, 256, |_| {
            judged += 1;
            Ok(())
        });
        assert_eq!(result.unwrap_err().code(), 508);
        assert_eq!(judged, 57);
        // One peer named 5 444 times is judged once and fits.
        let data = create_permission((0..5_444).map(|_| peer(1)));
        let msg = Message::from_bytes(&data).unwrap();
        judged = 0;
        let named = named_peers(&msg, &[], 256, |_| {
            judged += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((judged, named.len()), (1, 1));
    }
}

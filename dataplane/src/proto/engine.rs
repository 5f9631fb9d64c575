//! The [`Engine`]: one shard's TURN state machine. It composes the allocation store, the
//! authenticator and the per-source budgets, dispatches each message to its handler and turns
//! the handler's verdict into the reply, transmit or drop the shell acts on.

use super::allocate::{self, AllocateRequest, PendingAllocate, Refreshed};
use super::auth::{Authenticated, Authenticator};
use super::contract::{
    BoundRelays, ClientAction, DropReason, Family, ListenerId, ListenerRef, PeerAction, RelayId,
    RelayRequest,
};
use super::error::RequestError;
use super::limits::{AllocationLedger, ChallengeLimiter, Limits, QuotaError};
use super::ratelimit::LogLimiter;
use super::relay::Arrival;
use super::store::{AllocationStore, ClientKey};
use super::wire::{self, ResponseWriter};
use super::{permission, relay, AMPLIFICATION_FACTOR, SWEEP_INTERVAL};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;
use stun_proto::types::message::{IntegrityKey, Message, MessageClass, BINDING};
use turn_types::attribute::Lifetime;
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH, SEND};
use uturn_shared::snapshot::{ClusterId, Snapshot};

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

/// The TURN state machine of one shard.
///
/// It never opens a socket or reads a clock: every call takes `now` and the current
/// [`Snapshot`], and returns what the IO shell must do. The shell drives it in this order:
///
/// 1. A datagram (or a stream frame) from a client on a listener → [`Engine::handle_client`];
///    act on the [`ClientAction`] it returns. On [`ClientAction::AllocateRelay`], bind the relay
///    sockets the [`RelayRequest`] asks for (two for a dual allocation) and answer at once,
///    before any other call, with [`Engine::complete_allocate`] (each port, or the
///    [`super::RelayBindError`]); send the reply it writes.
/// 2. A datagram from a peer on relay socket `r`, read into `buf[PEER_HEADROOM..]` →
///    [`Engine::handle_peer`]; send what the [`PeerAction`] says.
/// 3. When the instant [`Engine::poll_timeout`] gives passes, call [`Engine::handle_timeout`];
///    ask `poll_timeout` again after every call, as a new allocation starts the timer.
/// 4. After any call, drain [`Engine::poll_close`] and close those relay sockets (soon: an
///    ended allocation's [`RelayId`]s are reused only once `poll_close` has returned them).
/// 5. A listener closed or restarted → [`Engine::close_listener`]; a stream connection or
///    DTLS session ended → [`Engine::close_client`]; then drain `poll_close` as in 4.
pub struct Engine {
    config: EngineConfig,
    auth: Authenticator,
    allocations: AllocationStore,
    /// The Allocate waiting for [`Engine::complete_allocate`].
    pending: Option<PendingAllocate>,
    /// Relay sockets the shell must close, drained by [`Engine::poll_close`].
    relays_to_close: Vec<RelayId>,
    next_sweep: Option<Instant>,
    /// Transaction ids of Data indications: a CSPRNG of this engine's own, seeded from the
    /// OS, so the ids reveal nothing of the nonce key nor repeat another shard's.
    indication_txids: StdRng,
    stats: EngineStats,
    denial_log: LogLimiter,
    challenges: ChallengeLimiter,
    /// With a kernel offload: allocations whose offloadable channels may have changed, drained
    /// by [`Engine::poll_offload`].
    offload_changes: Option<Vec<RelayId>>,
    /// Second-chance forwarding is on: misses are [`ClientAction::Miss`].
    forward_misses: bool,
}

/// A channel the kernel may relay: bound, its permission live, its peer admitted by the
/// running snapshot, until `expires_at` (the first of the channel's, the permission's and the
/// allocation's ends).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadChannel {
    /// The listener the client talks to.
    pub listener: ListenerId,
    /// The client's address.
    pub client: SocketAddr,
    /// The channel number.
    pub number: u16,
    /// The peer bound to it.
    pub peer: SocketAddr,
    /// When the kernel must stop relaying it unless told again.
    pub expires_at: Instant,
    /// The cluster that admitted the peer.
    pub cluster: ClusterId,
}

impl Engine {
    /// A new engine with no allocations.
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            challenges: ChallengeLimiter::new(
                config.limits.challenge_rate,
                config.limits.challenge_burst,
                config.epoch,
            ),
            auth: Authenticator::new(config.nonce_key, config.epoch, config.epoch_unix),
            config,
            allocations: AllocationStore::new(),
            pending: None,
            relays_to_close: Vec::new(),
            next_sweep: None,
            indication_txids: StdRng::from_entropy(),
            stats: EngineStats::default(),
            denial_log: LogLimiter::default(),
            offload_changes: None,
            forward_misses: false,
        }
    }

    /// Tells the engine that a kernel offload relays channels: from now on it records which
    /// allocations' channels may have changed ([`Engine::poll_offload`]).
    pub fn enable_offload(&mut self) {
        self.offload_changes.get_or_insert_with(Vec::new);
    }

    /// The next allocation whose offloadable channels may have changed (a ChannelBind,
    /// CreatePermission or Refresh on it), as its IPv4 relay socket (the kernel relays IPv4
    /// only): read them with [`Engine::offload_channels`]. An ended allocation (or relay) is
    /// reported by [`Engine::poll_close`] instead.
    pub fn poll_offload(&mut self) -> Option<RelayId> {
        self.offload_changes.as_mut()?.pop()
    }

    /// Reports every allocation with channels through [`Engine::poll_offload`]: the shell
    /// calls it when the snapshot changes, which may admit or deny peers.
    pub fn recheck_offload(&mut self) {
        if let Some(changes) = self.offload_changes.as_mut() {
            changes.clear();
            changes.extend(
                self.allocations
                    .with_channels()
                    .map(|slot| RelayId::new(slot, Family::V4)),
            );
        }
    }

    /// The channels of the allocation of relay socket `relay` that the kernel may relay at
    /// `now` under `snap` (none if the allocation ended).
    pub fn offload_channels(
        &mut self,
        relay: RelayId,
        snap: &Snapshot,
        now: Instant,
    ) -> Vec<OffloadChannel> {
        let Some(alloc) = self.allocations.get_mut(relay.slot()) else {
            return Vec::new();
        };
        alloc.offload_channels(snap, now)
    }

    /// Live allocations on this shard.
    pub fn allocation_count(&self) -> usize {
        self.allocations.len()
    }

    /// Live allocations on this shard by the name of the listener they were made on (once per
    /// tick, for `/status`).
    pub fn allocations_by_listener(&self) -> Vec<(String, u64)> {
        let mut counts: Vec<(String, u64)> = Vec::new();
        for alloc in self.allocations.iter() {
            match counts
                .iter_mut()
                .find(|(name, _)| *name == alloc.listener_name)
            {
                Some((_, n)) => *n += 1,
                None => counts.push((alloc.listener_name.clone(), 1)),
            }
        }
        counts
    }

    /// The counters of this shard.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn dropped(&mut self, reason: DropReason) -> DropReason {
        self.stats.count_drop(reason)
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
        let arrival = Arrival {
            via: None,
            forward_misses: self.forward_misses,
        };
        self.handle_arrival(now, snap, listener, from, data, out, arrival)
    }

    /// [`Engine::handle_client`] for a datagram of client `from` that sibling pod `via`
    /// forwarded (second-chance forwarding): handled exactly as if it came straight, and what
    /// goes to the client from now on goes back through `via`
    /// ([`PeerAction::ToClient::via`]; replies to it the shell sends back through `via`).
    #[allow(clippy::too_many_arguments)] // handle_client's, and the sibling
    pub fn handle_forwarded(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        data: &[u8],
        out: &mut [u8],
        via: SocketAddr,
    ) -> ClientAction {
        let arrival = Arrival {
            via: Some(via),
            forward_misses: false,
        };
        self.handle_arrival_out_of_line(now, snap, listener, from, data, out, arrival)
    }

    /// [`Engine::handle_client`] answering a miss as without forwarding (437, or a counted
    /// drop): for a datagram that no sibling owns.
    pub fn handle_client_local(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        data: &[u8],
        out: &mut [u8],
    ) -> ClientAction {
        let arrival = Arrival {
            via: None,
            forward_misses: false,
        };
        self.handle_arrival_out_of_line(now, snap, listener, from, data, out, arrival)
    }

    /// [`Engine::handle_arrival`] for the rare arrivals (forwarded, or a miss answered
    /// locally), out of line so that the per-packet path is the only inlined copy.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)] // handle_client's, and how the datagram arrived
    fn handle_arrival_out_of_line(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        data: &[u8],
        out: &mut [u8],
        arrival: Arrival,
    ) -> ClientAction {
        self.handle_arrival(now, snap, listener, from, data, out, arrival)
    }

    /// The sibling pod the client of relay `relay`'s allocation reaches us through, if it
    /// does ([`PeerAction::ToClient::forwarded`]).
    pub fn via(&self, relay: RelayId) -> Option<SocketAddr> {
        self.allocations.get(relay.slot())?.via
    }

    /// Whether this shard holds an allocation for `client` on `listener`.
    pub fn holds(&self, listener: ListenerId, client: SocketAddr) -> bool {
        self.allocations
            .slot_of(&ClientKey { listener, client })
            .is_some()
    }

    /// Second-chance forwarding: a datagram that needs an allocation and finds none is
    /// [`ClientAction::Miss`] instead of a 437 or a drop.
    pub fn set_forward_misses(&mut self, on: bool) {
        self.forward_misses = on;
    }

    #[inline(always)]
    #[allow(clippy::too_many_arguments)] // handle_client's, and how the datagram arrived
    fn handle_arrival(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        data: &[u8],
        out: &mut [u8],
        arrival: Arrival,
    ) -> ClientAction {
        // RFC 8656 §12.4: ChannelData starts with 0b01; STUN messages start with 0b00.
        match data.first().map(|b| b >> 6) {
            Some(0b01) => relay::channel_data(
                &mut self.allocations,
                &mut self.stats,
                now,
                snap,
                listener.id,
                from,
                data,
                arrival,
            ),
            Some(0b00) => match Message::from_bytes(data) {
                Ok(msg) => self.dispatch_stun(now, snap, listener, from, &msg, out, arrival),
                Err(_) => ClientAction::Drop(self.dropped(DropReason::Malformed)),
            },
            _ => ClientAction::Drop(self.dropped(DropReason::Malformed)),
        }
    }

    /// Sends a STUN message to the handler of its class and method.
    // Out of line so that `handle_client` stays small enough for the ChannelData path to be
    // inlined whole: a STUN message costs a parse anyway, a call is nothing beside it.
    #[inline(never)]
    #[allow(clippy::too_many_arguments)] // handle_client's, parsed, and how it arrived
    fn dispatch_stun(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        from: SocketAddr,
        msg: &Message<'_>,
        out: &mut [u8],
        arrival: Arrival,
    ) -> ClientAction {
        let class = msg.class();
        let method = msg.method();
        let key = ClientKey {
            listener: listener.id,
            client: from,
        };
        if class == MessageClass::Indication {
            if method == SEND {
                return relay::send_indication(
                    &mut self.allocations,
                    &mut self.stats,
                    now,
                    snap,
                    key,
                    msg,
                    arrival,
                );
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
        // RFC 8656 §7.2: a retransmitted Allocate is answered from the cached response, so
        // a lost success does not turn into 437.
        if method == ALLOCATE {
            if let Some(alloc) = self
                .allocations
                .slot_of(&key)
                .and_then(|slot| self.allocations.get(slot))
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
        // Second-chance forwarding: a request for an allocation held elsewhere goes to the
        // sibling that holds it, before authentication (its nonce is that sibling's).
        if arrival.forward_misses && method != ALLOCATE && self.allocations.slot_of(&key).is_none()
        {
            return ClientAction::Miss;
        }
        let authenticated = match self.auth.authenticate(now, snap, from, msg) {
            Ok(authenticated) => authenticated,
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
        let existing = self.allocations.slot_of(&key);
        if method == ALLOCATE {
            if existing.is_some() {
                // RFC 8656 §7.2 step 2: 5-tuple already in use.
                return self.reply_error(
                    msg,
                    RequestError::AllocationExists,
                    Some(&authenticated.integrity),
                    out,
                );
            }
            return self.handle_allocate(snap, listener, key, authenticated, msg, out);
        }
        // RFC 8656 §7.3, §9.2, §11.2: no allocation on this 5-tuple → 437.
        let Some(slot) = existing else {
            return self.reply_error(
                msg,
                RequestError::NoAllocation,
                Some(&authenticated.integrity),
                out,
            );
        };
        // RFC 8656 §5: requests on an allocation must use the credentials that created it.
        match self.allocations.get_mut(slot) {
            Some(alloc) if alloc.username == authenticated.username => arrival.follow(alloc),
            _ => return self.reply_error(msg, RequestError::WrongCredentials, None, out),
        }
        match self.handle_allocation_request(now, snap, slot, msg) {
            Ok(lifetime) => {
                let mut w = ResponseWriter::success(msg, out);
                if let Some(seconds) = lifetime {
                    w.add(&Lifetime::new(seconds));
                }
                match w.finish(Some(&authenticated.integrity)) {
                    Some(n) => ClientAction::Reply(n),
                    None => ClientAction::Drop(self.dropped(DropReason::Internal)),
                }
            }
            Err(error) => self.reply_error(msg, error, Some(&authenticated.integrity), out),
        }
    }

    /// A Refresh, CreatePermission or ChannelBind on the allocation in `slot`, authenticated
    /// as its owner: the LIFETIME for the success response, if it carries one.
    fn handle_allocation_request(
        &mut self,
        now: Instant,
        snap: &Snapshot,
        slot: u32,
        msg: &Message<'_>,
    ) -> Result<Option<u32>, RequestError> {
        let max_permissions = self.config.limits.max_permissions;
        let Some(alloc) = self.allocations.get_mut(slot) else {
            return Err(RequestError::NoAllocation);
        };
        let denial_log = &mut self.denial_log;
        if let Some(changes) = self.offload_changes.as_mut() {
            // The request may extend or add what the kernel relays for this allocation; the
            // shell reads it back through `offload_channels` (a failure changes nothing).
            let relay = RelayId::new(slot, Family::V4);
            if !changes.contains(&relay) {
                changes.push(relay);
            }
        }
        match msg.method() {
            REFRESH => match allocate::refresh(alloc, now, msg)? {
                Refreshed::Extended(lifetime) => Ok(Some(lifetime.as_secs() as u32)),
                Refreshed::Deleted => {
                    self.delete_allocation(slot);
                    Ok(Some(0))
                }
                // The relay named is deleted: its lifetime is zero, as for a whole allocation.
                Refreshed::RelayDeleted(family) => {
                    self.relays_to_close.push(RelayId::new(slot, family));
                    Ok(Some(0))
                }
            },
            CREATE_PERMISSION => {
                permission::create_permission(alloc, msg, snap, now, max_permissions, denial_log)
                    .map(|()| None)
            }
            _ => permission::channel_bind(alloc, msg, snap, now, max_permissions, denial_log)
                .map(|()| None),
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

    /// An authenticated Allocate on a free 5-tuple: reserves quota (one unit, dual or not) and
    /// a slot, and asks the shell for the relay sockets.
    fn handle_allocate(
        &mut self,
        snap: &Snapshot,
        listener: ListenerRef<'_>,
        key: ClientKey,
        authenticated: Authenticated,
        msg: &Message<'_>,
        out: &mut [u8],
    ) -> ClientAction {
        let integrity = Some(&authenticated.integrity);
        let request: AllocateRequest = match allocate::allocate_request(msg, listener.spec) {
            Ok(request) => request,
            Err(error) => return self.reply_error(msg, error, integrity, out),
        };
        // Reserved here, released in `complete_allocate` on a bind failure or in
        // `delete_allocation`.
        let user_quota = snap.user_quota;
        let max_allocations = self.config.limits.max_allocations;
        if let Err(refused) =
            self.config
                .ledger
                .reserve(&authenticated.user_id, user_quota, max_allocations)
        {
            self.stats.quota_refusals += 1;
            let error = match refused {
                QuotaError::User => RequestError::UserQuotaReached,
                QuotaError::Global => RequestError::AllocationCapReached,
            };
            return self.reply_error(msg, error, integrity, out);
        }
        let slot = self.allocations.reserve_slot();
        let (even_port, dont_fragment) = (request.even_port, request.dont_fragment);
        let pending = PendingAllocate::new(slot, key, listener.spec, request, authenticated, msg);
        let relay_request = RelayRequest {
            relay: pending.relay,
            family: pending.relay.family(),
            additional: pending.additional_relay(),
            even_port,
            dont_fragment,
        };
        self.pending = Some(pending);
        ClientAction::AllocateRelay(relay_request)
    }

    /// Completes the Allocate that asked for `relay`: `bound` is the port of each relay socket
    /// (a `Result<u16, RelayBindError>` for a request of one), or why it could not be bound.
    /// Returns the length of the reply written to `out`.
    pub fn complete_allocate(
        &mut self,
        now: Instant,
        relay: RelayId,
        bound: impl Into<BoundRelays>,
        out: &mut [u8],
    ) -> Option<usize> {
        let bound: BoundRelays = bound.into();
        let pending = self.pending.take().filter(|p| p.relay == relay)?;
        let slot = relay.slot();
        let additional = pending.additional_relay();
        let port = match bound.relay {
            Ok(port) => port,
            Err(bind_error) => {
                // The whole Allocate fails; an additional socket bound all the same is closed,
                // and the slot is free once it is.
                match (additional, bound.additional) {
                    (Some(socket), Some(Ok(_))) => self.relays_to_close.push(socket),
                    _ => self.allocations.release_slot(slot),
                }
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
        let additional_port = bound
            .additional
            .map(|port| port.map_err(RequestError::RelayBindFailed));
        let (relays, families, ipv6_error) = pending.relayed(port, additional_port);
        let Some(n) = wire::allocate_success(
            pending.txid,
            &relays,
            ipv6_error.as_ref(),
            pending.key.client,
            pending.lifetime.as_secs() as u32,
            &pending.integrity,
            out,
        ) else {
            // `out` too small (our bug): the relay sockets are closed and nothing is held (the
            // slot is freed once the shell has taken the closes, as for any ended allocation).
            self.relays_to_close
                .extend(families.iter().map(|family| RelayId::new(slot, family)));
            self.config.ledger.release(&pending.user_id);
            self.dropped(DropReason::Internal);
            return None;
        };
        self.allocations.insert(
            slot,
            pending.into_allocation(now, families, out[..n].to_vec()),
        );
        self.stats.allocations_created += 1;
        self.next_sweep.get_or_insert(now + SWEEP_INTERVAL);
        Some(n)
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
        // A socket the allocation does not have is none the shell holds either.
        let Some(alloc) = self
            .allocations
            .get_mut(relay.slot())
            .filter(|alloc| alloc.families.contains(relay.family()))
        else {
            return PeerAction::Drop(self.dropped(DropReason::NoAllocation));
        };
        relay::peer_datagram(
            alloc,
            &mut self.stats,
            now,
            snap,
            peer,
            buf,
            out,
            &mut self.indication_txids,
        )
    }

    /// When [`Engine::handle_timeout`] should next run.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.next_sweep
    }

    /// Expires allocations, permissions and channels whose time has passed.
    pub fn handle_timeout(&mut self, now: Instant) {
        for slot in self.allocations.expired(now) {
            self.delete_allocation(slot);
        }
        self.allocations.expire_permissions_and_channels(now);
        self.next_sweep = if self.allocations.is_empty() {
            None
        } else {
            Some(now + SWEEP_INTERVAL)
        };
    }

    /// Drops every allocation made on `listener` (it was closed or restarted).
    pub fn close_listener(&mut self, listener: ListenerId) {
        for slot in self.allocations.on_listener(listener) {
            self.delete_allocation(slot);
        }
    }

    /// Drops the allocation of `client` on `listener`, if any: its stream connection (TCP,
    /// TLS) or DTLS session closed (RFC 8656 §3.1: the allocation lives no longer).
    pub fn close_client(&mut self, listener: ListenerId, client: SocketAddr) {
        if let Some(slot) = self.allocations.slot_of(&ClientKey { listener, client }) {
            self.delete_allocation(slot);
        }
    }

    /// Whether `client` holds an allocation on `listener`.
    pub fn has_allocation(&self, listener: ListenerId, client: SocketAddr) -> bool {
        self.allocations
            .slot_of(&ClientKey { listener, client })
            .is_some()
    }

    /// The next relay socket the shell must close. Its [`RelayId`] is handed out again only
    /// after this call returned it (and every other socket of its allocation), so a socket
    /// opened for a new allocation is never the one a close meant for an ended allocation
    /// reaches (the shell may end an allocation and open a relay for the next Allocate before
    /// it drains this, e.g. within one batch).
    pub fn poll_close(&mut self) -> Option<RelayId> {
        let relay = self.relays_to_close.pop()?;
        let slot = relay.slot();
        if self.allocations.get(slot).is_none()
            && !self.relays_to_close.iter().any(|r| r.slot() == slot)
        {
            self.allocations.release_slot(slot);
        }
        Some(relay)
    }

    fn delete_allocation(&mut self, slot: u32) {
        if let Some(alloc) = self.allocations.remove(slot) {
            self.relays_to_close.extend(
                alloc
                    .families
                    .iter()
                    .map(|family| RelayId::new(slot, family)),
            );
            self.stats.allocations_deleted += 1;
            self.config.ledger.release(&alloc.user_id);
        }
    }
}

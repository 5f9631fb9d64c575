//! The [`Engine`]: one shard's TURN state machine. It composes the allocation store, the
//! authenticator and the per-source budgets, dispatches each message to its handler and turns
//! the handler's verdict into the reply, transmit or drop the shell acts on.

use super::allocate::{self, AllocateRequest, PendingAllocate, Refreshed};
use super::auth::{Authenticated, Authenticator};
use super::contract::{
    Arrival, ArrivalKind, BoundRelays, ClientAction, DropReason, EngineConfig, EngineStats, Family,
    ListenerId, ListenerRef, PeerAction, PeerArrival, RelayId, RelayRequest,
};
use super::error::RequestError;
use super::limits::{QuotaError, SourceBuckets};
use super::offload::{OffloadChange, OffloadChanges};
use super::ratelimit::LogLimiter;
use super::relay::Path;
use super::store::{AllocationStore, ClientKey};
use super::wire::{self, ResponseWriter};
use super::{permission, relay, SWEEP_INTERVAL};
use rand::rngs::StdRng;
use rand::SeedableRng;
use std::net::SocketAddr;
use std::time::Instant;
use stun_proto::types::message::{Message, MessageClass, BINDING};
use turn_types::attribute::Lifetime;
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH, SEND};
use uturn_shared::snapshot::Snapshot;
use uturn_shared::status::ListenerAllocations;

mod offload; // What the kernel offload reads of the allocations, and what changed of them.
mod persist; // Allocations across a restart: records, changes, adoption.

/// The TURN state machine of one shard.
///
/// It never opens a socket or reads a clock: every call takes `now` and the current
/// [`Snapshot`], and returns what the IO shell must do. The shell drives it in this order:
///
/// 1. A datagram (or a stream frame) from a client on a listener → [`Engine::handle_client`]
///    with its [`Arrival`] ([`ArrivalKind::Straight`]); act on the [`ClientAction`] it returns.
///    On [`ClientAction::AllocateRelay`], bind the relay sockets the [`RelayRequest`] asks for
///    (two for a dual allocation) and answer at once, before any other call, with
///    [`Engine::complete_allocate`] (each port, or the [`super::RelayBindError`]); send the
///    reply it writes.
/// 2. With second-chance forwarding ([`Engine::set_forward_misses`]): on
///    [`ClientAction::Miss`], hand the datagram to the sibling pod that owns the client, or,
///    if none does, to [`Engine::handle_client`] again as [`ArrivalKind::AnsweredLocally`]. A
///    datagram a sibling forwarded for a client this shard holds ([`Engine::has_allocation`])
///    → [`Engine::handle_client`] as [`ArrivalKind::Forwarded`]; send its reply back through
///    that sibling.
/// 3. A datagram from a peer on relay socket `r`, read into `buf[PEER_HEADROOM..]` →
///    [`Engine::handle_peer`] with its [`PeerArrival`]; send what the [`PeerAction`] says (back
///    through the sibling [`Engine::via`] names when it is `forwarded`).
/// 4. When the instant [`Engine::poll_timeout`] gives passes, call [`Engine::handle_timeout`];
///    ask `poll_timeout` again after every call, as a new allocation starts the timer.
/// 5. After any call, drain [`Engine::poll_close`] and close those relay sockets (soon: an
///    ended allocation's [`RelayId`]s are reused only once `poll_close` has returned them).
/// 6. A listener closed or restarted → [`Engine::close_listener`]; a stream connection or
///    DTLS session ended → [`Engine::close_client`]; then drain `poll_close` as in 5.
/// 7. With a kernel offload ([`Engine::enable_offload`]): after any call, drain
///    [`Engine::poll_offload`] and carry out each [`OffloadChange`] (reading
///    [`Engine::offload_channel`], [`Engine::offload_channels`], [`Engine::offload_permission`]
///    and [`Engine::offload_deadline`]); when the snapshot changes, [`Engine::recheck_offload`].
/// 8. With a journal ([`Engine::enable_persist`]): after each request's reply is written and
///    before it is sent, and once a tick, drain [`Engine::poll_persist`] into the journal. In
///    a new process, [`Engine::adopt`] each record the journal left before serving.
pub struct Engine {
    config: EngineConfig,
    auth: Authenticator,
    allocations: AllocationStore,
    /// The Allocate waiting for [`Engine::complete_allocate`].
    pending: Option<PendingAllocate>,
    next_sweep: Option<Instant>,
    /// Transaction ids of Data indications: a CSPRNG of this engine's own, seeded from the
    /// OS, so the ids reveal nothing of the nonce key nor repeat another shard's.
    indication_txids: StdRng,
    stats: EngineStats,
    denial_log: LogLimiter,
    /// The 401/438 challenges' budget per source IP.
    challenges: SourceBuckets,
    /// With a kernel offload: what changed of allocations the kernel may relay for, drained
    /// by [`Engine::poll_offload`].
    offload: OffloadChanges,
    /// Second-chance forwarding is on: misses are [`ClientAction::Miss`].
    forward_misses: bool,
    /// With a state directory: what changed of allocations, drained by [`Engine::poll_persist`].
    persist: persist::PersistChanges,
}

impl Engine {
    /// A new engine with no allocations.
    pub fn new(config: EngineConfig) -> Engine {
        Engine {
            challenges: SourceBuckets::new(
                config.limits.challenge_rate,
                config.limits.challenge_burst,
                config.epoch,
            ),
            auth: Authenticator::new(config.nonce_key, config.epoch, config.epoch_unix),
            config,
            allocations: AllocationStore::new(),
            pending: None,
            next_sweep: None,
            indication_txids: StdRng::from_entropy(),
            stats: EngineStats::default(),
            denial_log: LogLimiter::default(),
            offload: OffloadChanges::default(),
            forward_misses: false,
            persist: Default::default(),
        }
    }

    /// Live allocations on this shard.
    pub fn allocation_count(&self) -> usize {
        self.allocations.len()
    }

    /// Live allocations on this shard by the name of the listener they were made on (once per
    /// tick, for `/status`).
    pub fn allocations_by_listener(&self) -> Vec<ListenerAllocations> {
        self.allocations.by_listener()
    }

    /// The counters of this shard.
    pub fn stats(&self) -> &EngineStats {
        &self.stats
    }

    fn dropped(&mut self, reason: DropReason) -> DropReason {
        self.stats.count_drop(reason)
    }

    /// Second-chance forwarding: a datagram that arrives [`ArrivalKind::Straight`], needs an
    /// allocation and finds none is [`ClientAction::Miss`] instead of a 437 or a drop.
    pub fn set_forward_misses(&mut self, on: bool) {
        self.forward_misses = on;
    }

    /// Handles one datagram a client sent, as it [arrived](Arrival), writing any reply into
    /// `out` (at least 1500 bytes). One entry point for every [`ArrivalKind`]: straight (the
    /// per-packet path, inlined here), forwarded by a sibling or a miss answered here (out of
    /// line, as rare).
    #[inline]
    pub fn handle_client(
        &mut self,
        arrival: Arrival<'_>,
        data: &[u8],
        out: &mut [u8],
    ) -> ClientAction {
        if let ArrivalKind::Straight = arrival.kind {
            let path = Path {
                via: None,
                forward_misses: self.forward_misses,
            };
            return self.handle_arrival(&arrival, path, data, out);
        }
        self.handle_rare_arrival(&arrival, data, out)
    }

    /// [`Engine::handle_client`] for the rare arrivals (forwarded, or a miss answered
    /// locally), out of line so that the per-packet path is the only inlined copy. Neither
    /// misses again.
    #[inline(never)]
    fn handle_rare_arrival(
        &mut self,
        arrival: &Arrival<'_>,
        data: &[u8],
        out: &mut [u8],
    ) -> ClientAction {
        let via = match arrival.kind {
            ArrivalKind::Forwarded { via } => Some(via),
            ArrivalKind::Straight | ArrivalKind::AnsweredLocally => None,
        };
        let path = Path {
            via,
            forward_misses: false,
        };
        self.handle_arrival(arrival, path, data, out)
    }

    /// The sibling pod the client of relay `relay`'s allocation reaches us through, if it
    /// does ([`PeerAction::ToClient`]'s `forwarded`).
    pub fn via(&self, relay: RelayId) -> Option<SocketAddr> {
        self.allocations.get(relay.slot())?.via
    }

    #[inline(always)]
    fn handle_arrival(
        &mut self,
        arrival: &Arrival<'_>,
        path: Path,
        data: &[u8],
        out: &mut [u8],
    ) -> ClientAction {
        // RFC 8656 §12.4: ChannelData starts with 0b01; STUN messages start with 0b00.
        match data.first().map(|b| b >> 6) {
            Some(0b01) => {
                relay::channel_data(&mut self.allocations, &mut self.stats, arrival, path, data)
            }
            Some(0b00) => match Message::from_bytes(data) {
                Ok(msg) => self.dispatch_stun(arrival, path, &msg, out),
                Err(_) => ClientAction::Drop(self.dropped(DropReason::Malformed)),
            },
            _ => ClientAction::Drop(self.dropped(DropReason::Malformed)),
        }
    }

    /// Sends a STUN message to the handler of its class and method: what needs no credentials
    /// is answered here, TURN requests after [`Engine::authenticated_request`].
    // Out of line so that `handle_client` stays small enough for the ChannelData path to be
    // inlined whole: a STUN message costs a parse anyway, a call is nothing beside it.
    #[inline(never)]
    fn dispatch_stun(
        &mut self,
        arrival: &Arrival<'_>,
        path: Path,
        msg: &Message<'_>,
        out: &mut [u8],
    ) -> ClientAction {
        let class = msg.class();
        let method = msg.method();
        let key = ClientKey {
            listener: arrival.listener.id,
            client: arrival.client,
        };
        if class == MessageClass::Indication {
            if method == SEND {
                return relay::send_indication(
                    &mut self.allocations,
                    &mut self.stats,
                    arrival,
                    path,
                    msg,
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
            return match wire::binding_success(msg, arrival.client, out) {
                Some(n) => wire::within_amplification_bound(&mut self.stats, msg, n),
                None => ClientAction::Drop(self.dropped(DropReason::Internal)),
            };
        }
        if ![ALLOCATE, REFRESH, CREATE_PERMISSION, CHANNEL_BIND].contains(&method) {
            // Unknown requests (and RFC 6062 Connect on UDP) get 400, never silence that could
            // be mistaken for loss.
            return wire::unauthenticated_reply(
                &mut self.stats,
                msg,
                RequestError::UnknownMethod,
                out,
            );
        }
        // RFC 8489 §6.3.1: unknown comprehension-required attributes → 420.
        let unknown = wire::unknown_required_attributes(msg);
        if !unknown.is_empty() {
            return wire::unauthenticated_reply(
                &mut self.stats,
                msg,
                RequestError::UnknownAttributes(unknown),
                out,
            );
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
                    return wire::within_amplification_bound(&mut self.stats, msg, n);
                }
            }
        }
        // Second-chance forwarding: a request for an allocation held elsewhere goes to the
        // sibling that holds it, before authentication (its nonce is that sibling's).
        if path.forward_misses && method != ALLOCATE && self.allocations.slot_of(&key).is_none() {
            return ClientAction::Miss;
        }
        self.authenticated_request(arrival, path, key, msg, out)
    }

    /// A TURN request of the client of `key` (Allocate, Refresh, CreatePermission,
    /// ChannelBind): authenticated (a challenge if not, within its source's budget), then an
    /// Allocate on a free 5-tuple, or a request on the client's allocation.
    fn authenticated_request(
        &mut self,
        arrival: &Arrival<'_>,
        path: Path,
        key: ClientKey,
        msg: &Message<'_>,
        out: &mut [u8],
    ) -> ClientAction {
        let (now, snap, from) = (arrival.now, arrival.snap, arrival.client);
        let method = msg.method();
        let authenticated = match self.auth.authenticate(now, snap, from, msg) {
            Ok(authenticated) => authenticated,
            Err(error) => {
                let challenge = error.challenge().is_some();
                let action = wire::unauthenticated_reply(&mut self.stats, msg, error, out);
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
                return wire::error_reply(
                    &mut self.stats,
                    msg,
                    RequestError::AllocationExists,
                    Some(&authenticated.integrity),
                    out,
                );
            }
            return self.handle_allocate(snap, arrival.listener, key, authenticated, msg, out);
        }
        // RFC 8656 §7.3, §9.2, §11.2: no allocation on this 5-tuple → 437.
        let Some(slot) = existing else {
            return wire::error_reply(
                &mut self.stats,
                msg,
                RequestError::NoAllocation,
                Some(&authenticated.integrity),
                out,
            );
        };
        // RFC 8656 §5: requests on an allocation must use the credentials that created it.
        match self.allocations.get_mut(slot) {
            Some(alloc) if alloc.username == authenticated.username => {
                if path.follow(alloc) {
                    self.allocations.note_path_change(slot);
                }
            }
            _ => {
                return wire::error_reply(
                    &mut self.stats,
                    msg,
                    RequestError::WrongCredentials,
                    None,
                    out,
                )
            }
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
            Err(error) => wire::error_reply(
                &mut self.stats,
                msg,
                error,
                Some(&authenticated.integrity),
                out,
            ),
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
        // What the kernel relays for this allocation changes with the request's success (a
        // failure changes nothing): the shell reads it back (`offload_*`).
        let relay = RelayId::new(slot, Family::V4);
        let (lifetime, changes): (Option<u32>, &[OffloadChange]) = match msg.method() {
            REFRESH => match allocate::refresh(alloc, now, msg)? {
                Refreshed::Extended(lifetime) => (
                    Some(lifetime.as_secs() as u32),
                    &[OffloadChange::Deadline(relay)],
                ),
                Refreshed::Deleted => {
                    self.delete_allocation(slot);
                    (Some(0), &[])
                }
                // The relay named is deleted: its lifetime is zero, as for a whole allocation.
                Refreshed::RelayDeleted(family) => {
                    self.allocations.close(RelayId::new(slot, family));
                    (Some(0), &[OffloadChange::All(relay)])
                }
            },
            CREATE_PERMISSION => {
                let named = permission::create_permission(
                    alloc,
                    msg,
                    snap,
                    now,
                    max_permissions,
                    denial_log,
                )?;
                for ip in named {
                    self.offload.note(OffloadChange::Permission(relay, ip));
                }
                (None, &[])
            }
            _ => {
                let (number, ip) =
                    permission::channel_bind(alloc, msg, snap, now, max_permissions, denial_log)?;
                // The channel, and the permission the bind refreshed (its other channels).
                self.offload.note(OffloadChange::Channel(relay, number));
                self.offload.note(OffloadChange::Permission(relay, ip));
                (None, &[])
            }
        };
        for &change in changes {
            self.offload.note(change);
        }
        self.persist.changed(&self.allocations, slot);
        Ok(lifetime)
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
            Err(error) => return wire::error_reply(&mut self.stats, msg, error, integrity, out),
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
            return wire::error_reply(&mut self.stats, msg, error, integrity, out);
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
                    (Some(socket), Some(Ok(_))) => self.allocations.close(socket),
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
            for family in families.iter() {
                self.allocations.close(RelayId::new(slot, family));
            }
            self.config.ledger.release(&pending.user_id);
            self.dropped(DropReason::Internal);
            return None;
        };
        self.allocations.insert(
            slot,
            pending.into_allocation(now, families, out[..n].to_vec()),
        );
        self.persist.changed(&self.allocations, slot);
        self.stats.allocations_created += 1;
        self.next_sweep.get_or_insert(now + SWEEP_INTERVAL);
        Some(n)
    }

    /// Handles a datagram a peer sent to a relay socket, as it [arrived](PeerArrival). The
    /// payload is `buf[PEER_HEADROOM..]`; the first `PEER_HEADROOM` bytes are free for framing.
    pub fn handle_peer(
        &mut self,
        arrival: PeerArrival<'_>,
        buf: &mut [u8],
        out: &mut [u8],
    ) -> PeerAction {
        let relay = arrival.relay;
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
            &mut self.indication_txids,
            &arrival,
            buf,
            out,
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

    /// Whether `client` holds an allocation on `listener` (a sibling's forward is served here
    /// only then).
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
        self.allocations.poll_close()
    }

    fn delete_allocation(&mut self, slot: u32) {
        if let Some(alloc) = self.allocations.remove(slot) {
            self.persist.deleted(&alloc);
            self.stats.allocations_deleted += 1;
            self.config.ledger.release(&alloc.user_id);
        }
    }
}

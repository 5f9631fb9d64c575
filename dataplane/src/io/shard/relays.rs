//! The relay sockets of a shard's allocations, by [`RelayId`]: opened when the engine asks for
//! them (an Allocate: one socket, or an IPv4 and an IPv6 one for a dual allocation) and closed
//! when it says an allocation (or one of its relays) ended; and, with the kernel offload, what
//! the kernel relays for them: the engine's changes carried out in the shard's
//! [`OffloadTable`] ([`Relays::sync_offload`]), all allocations offered again when the
//! snapshot changes and the table's counters read once a second ([`Relays::tick_offload`]).

use super::listeners::{ListenerTransport, Listeners, RunningListener};
use crate::io::driver::{Driver, Interest, Token, Watched};
use crate::io::offload::{Delta, OffloadTable, COUNTER_SYNC};
use crate::io::socket::relay_socket;
use crate::proto::ratelimit::LogLimiter;
use crate::proto::{
    BoundRelays, Engine, Family, OffloadChange, OffloadChannel, RelayBindError, RelayId,
    RelayRequest,
};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::RawFd;
use std::time::Instant;
use uturn_shared::snapshot::Snapshot;

/// A relay socket and its port.
struct Relay<W> {
    watched: Watched<W>,
    port: u16,
}

/// The relay sockets, indexed by [`RelayId`] (the engine reuses ids, so the table stays dense),
/// and what the kernel offload relays for them.
pub(super) struct Relays<W> {
    sockets: Vec<Option<Relay<W>>>,
    /// The kernel offload's entries of this shard's allocations, if it runs.
    offload: Option<OffloadTable>,
    /// What offload entries relayed until they were removed or read, for the counters.
    offload_deltas: Vec<Delta>,
    /// When the offload's counters are read next, and the snapshot generation its entries
    /// were checked against.
    next_offload_sync: Instant,
    offload_generation: u64,
}

impl<W> Relays<W> {
    /// No relay sockets; `offload`: the kernel offload's table, if it runs.
    pub(super) fn new(offload: Option<OffloadTable>, now: Instant) -> Relays<W> {
        Relays {
            sockets: Vec::new(),
            offload,
            offload_deltas: Vec::new(),
            next_offload_sync: now + COUNTER_SYNC,
            offload_generation: 0,
        }
    }

    /// Opens and watches the relay sockets `request` asks for (the additional one only if the
    /// first could be): the engine's answer, each port or why it could not be had (logged,
    /// rate-limited by `log`: a client can exhaust descriptors and ports).
    pub(super) fn bind<D: Driver<Watch = W>>(
        &mut self,
        request: &RelayRequest,
        driver: &D,
        log: &mut LogLimiter,
        now: Instant,
    ) -> BoundRelays {
        let mut bound = |result: io::Result<u16>| {
            result.map_err(|e| {
                if let Some(suppressed) = log.allow(now) {
                    tracing::warn!(target: "stunner", "cannot allocate relay socket: {e}{suppressed}");
                }
                RelayBindError::from(&e)
            })
        };
        let relay = bound(self.open_one(request.relay, request, driver));
        let additional = match (&relay, request.additional) {
            (Ok(_), Some(additional)) => Some(bound(self.open_one(additional, request, driver))),
            _ => None,
        };
        BoundRelays { relay, additional }
    }

    /// Opens and watches socket `relay` of `request` (the family `relay` names); its port.
    fn open_one<D: Driver<Watch = W>>(
        &mut self,
        relay: RelayId,
        request: &RelayRequest,
        driver: &D,
    ) -> io::Result<u16> {
        let (socket, port) = relay_socket(relay.family(), request)?;
        let watched = driver.watch(socket, Token::Relay(relay), Interest::Datagrams)?;
        self.insert(relay, Relay { watched, port });
        Ok(port)
    }

    /// Watches `socket`, bound on `port` by a restart for an allocation the engine adopted, as
    /// relay socket `relay`.
    pub(super) fn adopt<D: Driver<Watch = W>>(
        &mut self,
        relay: RelayId,
        socket: socket2::Socket,
        port: u16,
        driver: &D,
    ) -> io::Result<()> {
        let watched = driver.watch(socket, Token::Relay(relay), Interest::Datagrams)?;
        self.insert(relay, Relay { watched, port });
        Ok(())
    }

    fn insert(&mut self, relay: RelayId, socket: Relay<W>) {
        let index = relay.0 as usize;
        if self.sockets.len() <= index {
            self.sockets.resize_with(index + 1, || None);
        }
        self.sockets[index] = Some(socket);
    }

    /// The fd of `relay`'s socket, if it is open.
    pub(super) fn fd(&self, relay: RelayId) -> Option<RawFd> {
        self.sockets
            .get(relay.0 as usize)
            .and_then(Option::as_ref)
            .map(|relay| relay.watched.fd)
    }

    /// The port of `relay`'s socket, if it is open.
    fn port(&self, relay: RelayId) -> Option<u16> {
        self.sockets
            .get(relay.0 as usize)
            .and_then(Option::as_ref)
            .map(|r| r.port)
    }

    /// Whether the kernel offload runs.
    pub(super) fn offloads(&self) -> bool {
        self.offload.is_some()
    }

    /// How many channels the kernel relays now.
    pub(super) fn offloaded_channels(&self) -> u64 {
        self.offload.as_ref().map_or(0, |table| table.len() as u64)
    }

    /// What offload entries relayed since the last call (removed entries', and those read),
    /// for the counters; emptied by the caller.
    pub(super) fn offload_deltas(&mut self) -> &mut Vec<Delta> {
        &mut self.offload_deltas
    }

    /// Carries out in the kernel offload what `engine` reports changed, each change at a cost
    /// in proportion to it (see [`OffloadChange`]), under `snap` and for the clients of
    /// `listeners`.
    pub(super) fn sync_offload(
        &mut self,
        engine: &mut Engine,
        snap: &Snapshot,
        listeners: &Listeners<W>,
        now: Instant,
    ) {
        while let Some(change) = engine.poll_offload() {
            match change {
                OffloadChange::All(relay) => {
                    self.offload_allocation(relay, engine, snap, listeners, now)
                }
                OffloadChange::Channel(relay, number) => {
                    let channel = engine
                        .offload_channel(relay, number, snap, now)
                        .and_then(|channel| offloadable(listeners, channel));
                    if let Some(deadline) = engine.offload_deadline(relay) {
                        self.offload_channel(relay, number, channel, deadline, now);
                    }
                }
                OffloadChange::Deadline(relay) => {
                    if let Some(deadline) = engine.offload_deadline(relay) {
                        self.offload_deadline(relay, deadline, now);
                    }
                }
                OffloadChange::Permission(relay, ip) => {
                    let Some(permission) = engine.offload_permission(relay, ip, now) else {
                        // Gone, or behind a sibling: what the kernel holds is checked whole.
                        self.offload_allocation(relay, engine, snap, listeners, now);
                        continue;
                    };
                    let (end, bound) = (permission.expires_at, permission.bound_channels);
                    if self.offload_permission(relay, ip, end, bound, now) {
                        // Channels to the peer came back with its permission: those alone.
                        let deadline = engine.offload_deadline(relay).unwrap_or(now);
                        let channels = engine.offload_channels(relay, snap, now);
                        for channel in channels.into_iter().filter(|c| c.peer.ip() == ip) {
                            let number = channel.number;
                            let channel = offloadable(listeners, channel);
                            self.offload_channel(relay, number, channel, deadline, now);
                        }
                    }
                }
            }
        }
    }

    /// Makes the kernel relay exactly the offloadable channels of allocation `relay`.
    fn offload_allocation(
        &mut self,
        relay: RelayId,
        engine: &mut Engine,
        snap: &Snapshot,
        listeners: &Listeners<W>,
        now: Instant,
    ) {
        let channels: Vec<_> = engine
            .offload_channels(relay, snap, now)
            .into_iter()
            .filter_map(|channel| offloadable(listeners, channel))
            .collect();
        let deadline = engine.offload_deadline(relay).unwrap_or(now);
        self.offload_channels(relay, &channels, deadline, now);
    }

    /// Checks every allocation again when the snapshot changed, reads the offload's counters
    /// when due (into [`Relays::offload_deltas`]) and checks the allocations whose entries
    /// ended.
    pub(super) fn tick_offload(
        &mut self,
        engine: &mut Engine,
        snap: &Snapshot,
        listeners: &Listeners<W>,
        now: Instant,
    ) {
        if snap.generation != self.offload_generation {
            self.offload_generation = snap.generation;
            engine.recheck_offload();
            self.sync_offload(engine, snap, listeners, now);
        }
        if now >= self.next_offload_sync {
            self.next_offload_sync = now + COUNTER_SYNC;
            let ended = match self.offload.as_mut() {
                Some(table) => table.sync(now, &mut self.offload_deltas),
                None => Vec::new(),
            };
            for relay in ended {
                self.offload_allocation(relay, engine, snap, listeners, now);
            }
        }
    }

    /// Makes the kernel offload relay `channels` (each with its listener's port) of allocation
    /// `relay`, which ends at `deadline`, and nothing else of it.
    fn offload_channels(
        &mut self,
        relay: RelayId,
        channels: &[(OffloadChannel, u16)],
        deadline: Instant,
        now: Instant,
    ) {
        let port = self.port(relay);
        if let (Some(table), Some(port)) = (self.offload.as_mut(), port) {
            table.set_all(
                relay,
                port,
                channels,
                deadline,
                now,
                &mut self.offload_deltas,
            );
        }
    }

    /// Makes the kernel offload relay channel `number` of allocation `relay` as `channel`
    /// says (`None`: not).
    fn offload_channel(
        &mut self,
        relay: RelayId,
        number: u16,
        channel: Option<(OffloadChannel, u16)>,
        deadline: Instant,
        now: Instant,
    ) {
        let port = self.port(relay);
        if let (Some(table), Some(port)) = (self.offload.as_mut(), port) {
            let deltas = &mut self.offload_deltas;
            match channel {
                Some(channel) => table.set_channel(relay, port, channel, deadline, now, deltas),
                None => table.unset_channel(relay, number, now, deltas),
            }
        }
    }

    /// The permission of allocation `relay` for `ip` ends at `end` now, in the kernel too
    /// (`bound` channels are bound to that peer); whether channels to the peer that the
    /// kernel could relay are missing.
    fn offload_permission(
        &mut self,
        relay: RelayId,
        ip: IpAddr,
        end: Instant,
        bound: usize,
        now: Instant,
    ) -> bool {
        self.offload.as_mut().is_some_and(|table| {
            table.set_permission(relay, ip, end, bound, now, &mut self.offload_deltas)
        })
    }

    /// Allocation `relay` ends at `deadline` now, in the kernel too.
    fn offload_deadline(&mut self, relay: RelayId, deadline: Instant, now: Instant) {
        if let Some(table) = self.offload.as_mut() {
            table.set_deadline(relay, deadline, now, &mut self.offload_deltas);
        }
    }

    /// Closes the sockets of every allocation `engine` has ended since the last call.
    pub(super) fn close_released(&mut self, engine: &mut Engine) {
        while let Some(relay) = engine.poll_close() {
            // The kernel stops relaying for it before its port can be reused.
            if let Some(table) = self.offload.as_mut() {
                table.forget(relay, &mut self.offload_deltas);
            }
            if let Some(slot) = self.sockets.get_mut(relay.0 as usize) {
                *slot = None;
            }
        }
    }

    /// Closes every relay socket.
    pub(super) fn clear(&mut self) {
        if let Some(table) = self.offload.as_mut() {
            for relay in 0..self.sockets.len() {
                table.forget(RelayId(relay as u32), &mut self.offload_deltas);
            }
        }
        self.sockets.clear();
    }
}

/// `channel` with its listener's port, if the kernel can relay it: a TURN-UDP client's (the
/// program sees no other transport).
fn offloadable<W>(
    listeners: &Listeners<W>,
    channel: OffloadChannel,
) -> Option<(OffloadChannel, u16)> {
    let listener = listeners.get(channel.listener)?;
    matches!(listener.transport, ListenerTransport::Udp).then(|| (channel, listener.spec.port))
}

/// Logs (debug) the relays `request` asked for and got, `bound`, for `client` of `listener`,
/// on shard `shard`: stunnerd's line for a new allocation.
pub(super) fn log_allocation<W>(
    request: &RelayRequest,
    bound: &BoundRelays,
    client: SocketAddr,
    listener: &RunningListener<W>,
    shard: usize,
) {
    let ports = [Some(bound.relay), bound.additional];
    for (relay, port) in request.sockets().zip(ports) {
        if let Some(Ok(port)) = port {
            let ip = listener
                .spec
                .relay
                .get(relay.family() == Family::V6)
                .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
            tracing::debug!(
                target: "stunner",
                "Allocation created: client={}-{}:{}, listener={}, relay-address={}, shard={}",
                client,
                listener.spec.port,
                listener.transport.name(),
                listener.spec.name,
                SocketAddr::new(ip, port),
                shard
            );
        }
    }
}

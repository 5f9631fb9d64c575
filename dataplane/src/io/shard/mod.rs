//! One shard's logic, whichever IO backend drives it (the contract is [`super::driver`]): a
//! shard-local [`Engine`] and the parts that own what the shard touches.
//!
//! - [`listeners`]: the listeners it runs (sockets, spec, transport), reconciled to each new
//!   snapshot;
//! - [`conns`]: the TCP/TLS connection table;
//! - [`datagrams`]: the receive batches and send queues UDP moves through, and the TURN-DTLS
//!   session tables;
//! - [`relays`]: the allocations' relay sockets;
//! - [`counters`]: what it counts, published once per tick;
//! - [`snapshots`]: which snapshot packets are served under.
//!
//! The shard composes them: it routes a readiness report to the part that owns the socket,
//! hands each TURN message to the engine ([`Shard::dispatch_turn_message`], the dispatch point) and
//! carries the engine's answer to the part that sends it. TURN-TCP and TURN-TLS connections
//! are read when readable and written when the shard flushes (or, when the client is slow,
//! whenever the socket can take more); TURN-DTLS runs a session per client address over UDP
//! listener sockets. Whatever the transport, the relay side is UDP and the same engine
//! decides.

mod conns;
mod counters;
mod datagrams;
mod listeners;
mod relays;
mod siblings;
mod snapshots;

pub use siblings::{SiblingCounts, SiblingSetup};

use super::admission::StreamAdmission;
use super::driver::{Driver, Readiness, Token, TICK};
use super::groups::ListenerGroups;
use super::metrics::ShardStats;
use super::offload::{Offload, OffloadTable, COUNTER_SYNC};
use super::socket::canonical;
use super::stream::Closed;
use super::sys;
use crate::proto::ratelimit::LogLimiter;
use crate::proto::{
    BoundRelays, Bytes, ClientAction, Engine, EngineConfig, ListenerId, ListenerRef, PeerAction,
    RelayId, PEER_HEADROOM,
};
use arc_swap::ArcSwap;
use conns::ConnTable;
use counters::{Counters, NO_SLOT};
use datagrams::{DatagramSocket, Datagrams};
use listeners::{ListenerTransport, Listeners};
use relays::Relays;
use snapshots::Snapshots;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_shared::snapshot::Snapshot;
use uturn_udp::{Datagram, RecvBatch, BATCH, MAX_UDP_PAYLOAD};

/// Client datagrams of this size or more are dropped as possibly truncated (as stunnerd).
/// Peer datagrams and stream frames are relayed whole up to the UDP maximum.
const MAX_DATAGRAM: usize = 1600;
/// Scratch for replies and Data indications: room for the largest UDP payload and the
/// indication's header and attributes around it.
const BUFFER: usize = MAX_UDP_PAYLOAD + 256;
/// Batches one readable socket may take before the shard serves the others.
const ROUNDS: usize = 4;
/// Connections one readable stream listener may accept before the shard serves the others.
const ACCEPTS: usize = 64;
/// How often connections and DTLS sessions are checked for handshake and idle timeouts.
const SWEEP: Duration = Duration::from_secs(1);
/// A TCP/TLS connection or DTLS session with no allocation is closed after this long without
/// a byte from its client, so that silent connections cannot hold descriptors for ever.
const IDLE_WITHOUT_ALLOCATION: Duration = Duration::from_secs(30);
/// Scratch for stream reads and DTLS plaintext.
const SCRATCH: usize = 64 << 10;

/// What a shard starts from.
pub(super) struct ShardSetup {
    /// Which shard this is (for logs, its counters and its share of listener sockets).
    pub index: usize,
    /// The running config, republished by the control thread.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    /// The TURN engine's config.
    pub engine: EngineConfig,
    /// Set when the dataplane stops.
    pub stop: Arc<AtomicBool>,
    /// Every shard's published counters; this one writes `stats[index]`.
    pub stats: Arc<Vec<ShardStats>>,
    /// Datagram listener sockets, opened for all shards by the first to need them.
    pub groups: Arc<ListenerGroups>,
    /// Places for unauthenticated TCP/TLS connections, shared by all shards.
    pub admission: Arc<StreamAdmission>,
    /// The kernel offload, if it runs.
    pub offload: Option<Arc<Offload>>,
    /// Second-chance forwarding between the gateway's pods, if configured, and how many
    /// shards this pod runs (each has a sibling socket).
    pub siblings: Option<(SiblingSetup, usize)>,
}

/// One shard: the TURN engine and the parts that own its sockets, buffers and counters.
pub(super) struct Shard<D: Driver> {
    index: usize,
    engine: Engine,
    snapshots: Snapshots,
    listeners: Listeners<D::Watch>,
    conns: ConnTable<D::Watch>,
    datagrams: Datagrams,
    relays: Relays<D::Watch>,
    counters: Counters,
    driver: D,
    /// Where the engine writes replies and Data indications.
    out: Box<[u8]>,
    /// Taken while a stream read or a DTLS datagram is handled.
    scratch: Option<Box<[u8]>>,
    next_sweep: Instant,
    /// Warnings about exhausted resources (descriptors, ports), which a client can cause.
    resource_log: LogLimiter,
    /// With the kernel offload: when its counters are read next, and the snapshot generation
    /// its entries were checked against.
    next_offload_sync: Instant,
    offload_generation: u64,
    /// Second-chance forwarding, if configured.
    siblings: Option<siblings::SiblingLink<D::Watch>>,
}

impl<D: Driver> Shard<D> {
    /// A shard with no listeners yet (they open on the first tick), driven by `driver`.
    pub(super) fn new(setup: &ShardSetup, driver: D) -> Shard<D> {
        let mut engine = Engine::new(setup.engine.clone());
        if setup.offload.is_some() {
            engine.enable_offload();
        }
        let siblings =
            setup.siblings.as_ref().and_then(
                |(sibling, shards)| match siblings::SiblingLink::open(
                    sibling,
                    setup.index,
                    *shards,
                    &driver,
                    Instant::now(),
                ) {
                    Ok(link) => {
                        engine.set_forward_misses(true);
                        Some(link)
                    }
                    Err(e) => {
                        tracing::error!(
                            target: "stunnerd",
                            "shard {}: cannot open the sibling socket on port {} + {}: {e}; this \
                             shard forwards no client to a sibling",
                            setup.index,
                            sibling.port,
                            setup.index
                        );
                        None
                    }
                },
            );
        Shard {
            index: setup.index,
            engine,
            snapshots: Snapshots::new(&setup.snapshot),
            listeners: Listeners::new(),
            conns: ConnTable::new(setup.admission.clone()),
            datagrams: Datagrams::new(),
            relays: Relays::new(setup.offload.clone().map(OffloadTable::new)),
            counters: Counters::default(),
            driver,
            out: vec![0u8; BUFFER].into_boxed_slice(),
            scratch: Some(vec![0u8; SCRATCH].into_boxed_slice()),
            next_sweep: Instant::now() + SWEEP,
            resource_log: Default::default(),
            next_offload_sync: Instant::now() + COUNTER_SYNC,
            offload_generation: 0,
            siblings,
        }
    }

    /// What waits for this shard's sockets.
    pub(super) fn driver(&self) -> &D {
        &self.driver
    }

    /// Picks up a new snapshot (opening and closing listeners), expires what is due and
    /// publishes the counters.
    pub(super) fn tick(&mut self, setup: &ShardSetup) {
        let now = Instant::now();
        if let Some(snap) = self.snapshots.pending_reconcile() {
            let complete = self.reconcile_listeners(&snap, setup);
            self.snapshots.reconciled(snap, complete);
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
            self.relays.close_released(&mut self.engine);
        }
        if now >= self.next_sweep {
            self.next_sweep = now + SWEEP;
            self.sweep(now);
        }
        if self.relays.offload.is_some() {
            self.tick_offload(now);
        }
        if let Some(link) = self.siblings.as_mut() {
            link.tick(now);
        }
        self.counters.publish(
            &setup.stats[self.index],
            &self.engine,
            &self.listeners,
            &self.conns,
            self.siblings
                .as_ref()
                .map(|link| (link.counts, link.forwarding_for())),
        );
    }

    /// Ticks if `next_tick` has passed (and sets the next one); false once the shard is told
    /// to stop. The backends call it on every wakeup.
    pub(super) fn tick_if_due(&mut self, setup: &ShardSetup, next_tick: &mut Instant) -> bool {
        let now = Instant::now();
        if now >= *next_tick {
            if setup.stop.load(Ordering::Relaxed) {
                return false;
            }
            self.tick(setup);
            *next_tick = now + TICK;
        }
        true
    }

    /// Installs and removes the kernel offload's entries of the allocations the engine reports.
    fn sync_offload(&mut self, now: Instant) {
        while let Some(relay) = self.engine.poll_offload() {
            self.offload_allocation(relay, now);
        }
    }

    /// Makes the kernel relay exactly the offloadable channels of allocation `relay`: those
    /// of TURN-UDP clients (the program sees no other transport).
    fn offload_allocation(&mut self, relay: RelayId, now: Instant) {
        let snap = self.snapshots.serving();
        let channels: Vec<_> = self
            .engine
            .offload_channels(relay, snap, now)
            .into_iter()
            .filter_map(|channel| {
                let listener = self.listeners.get(channel.listener)?;
                matches!(listener.transport, ListenerTransport::Udp)
                    .then(|| (channel, listener.spec.port))
            })
            .collect();
        self.relays.offload_channels(relay, &channels, now);
    }

    /// Reads the offload's counters into the shard's, checks every allocation again when the
    /// snapshot changed, and the allocations whose entries ended.
    fn tick_offload(&mut self, now: Instant) {
        let generation = self.snapshots.serving().generation;
        if generation != self.offload_generation {
            self.offload_generation = generation;
            self.engine.recheck_offload();
            self.sync_offload(now);
        }
        if now >= self.next_offload_sync {
            self.next_offload_sync = now + COUNTER_SYNC;
            let ended = match self.relays.offload.as_mut() {
                Some(table) => table.sync(now, &mut self.relays.offload_deltas),
                None => Vec::new(),
            };
            for relay in ended {
                self.offload_allocation(relay, now);
            }
        }
        self.count_offloaded();
        self.counters.offload_channels = self.relays.offload.as_ref().map_or(0, |t| t.len() as u64);
    }

    /// Adds what the kernel relayed to the counters, as if the shard had relayed it.
    fn count_offloaded(&mut self) {
        if self.relays.offload_deltas.is_empty() {
            return;
        }
        let deltas = std::mem::take(&mut self.relays.offload_deltas);
        let snap = self.snapshots.serving();
        let counters = &mut self.counters;
        for delta in &deltas {
            let (out, into) = (delta.out, delta.into);
            counters.offloaded_packets[0] += out.packets;
            counters.offloaded_packets[1] += into.packets;
            counters.listener_rx_packets += out.packets;
            counters.relayed_to_peer += out.packets;
            counters.relayed_to_client += into.packets;
            if let Some(listener) = self.listeners.get(delta.listener) {
                let traffic = &mut counters.listeners.traffic[listener.metric];
                // The client's datagrams carry the 4-byte ChannelData header.
                traffic.rx_packets += out.packets;
                traffic.rx_bytes += out.bytes + 4 * out.packets;
                traffic.tx_packets += into.packets;
                traffic.tx_bytes += into.bytes + 4 * into.packets;
            }
            if let Some(slot) = counters.cluster(snap, delta.cluster) {
                let traffic = &mut counters.clusters.traffic[slot];
                traffic.tx_packets += out.packets;
                traffic.tx_bytes += out.bytes;
                traffic.rx_packets += into.packets;
                traffic.rx_bytes += into.bytes;
            }
        }
        self.relays.offload_deltas = deltas;
        self.relays.offload_deltas.clear();
    }

    /// Closes every socket.
    pub(super) fn shutdown(&mut self, stats: &ShardStats) {
        for slot in self.conns.slots() {
            self.close_conn(slot, None);
        }
        self.listeners.clear();
        self.relays.clear();
        stats.allocations.store(0, Ordering::Relaxed);
    }

    /// Ends TLS handshakes that took too long, and connections and DTLS sessions that
    /// stalled or went quiet without an allocation.
    fn sweep(&mut self, now: Instant) {
        for (slot, why) in self.conns.late(now, &self.engine) {
            self.close_conn(slot, Some(why));
        }
        self.listeners.sweep_dtls(now, &mut self.engine);
        self.relays.close_released(&mut self.engine);
    }

    /// Opens listeners the snapshot adds and closes those it removes (or changes in a way
    /// that needs a restart), with their connections and allocations; unchanged listeners
    /// and their allocations are left alone. `false` if a listener could not open yet.
    fn reconcile_listeners(&mut self, snap: &Snapshot, setup: &ShardSetup) -> bool {
        setup.groups.reconciling(self.index, snap);
        for id in self.listeners.stale(snap) {
            for slot in self.conns.of_listener(id) {
                self.close_conn(slot, None);
            }
            self.engine.close_listener(id);
            self.relays.close_released(&mut self.engine);
            self.listeners.close(id, &setup.groups, self.index);
        }
        self.listeners.open_added(
            snap,
            &setup.groups,
            self.index,
            &self.driver,
            &mut self.counters.listeners,
        )
    }

    /// Receives and handles what waits on the socket behind `token`, up to [`ROUNDS`] batches.
    pub(super) fn readable(&mut self, token: Token) -> Readiness {
        match token {
            Token::Relay(relay) => self.relay_readable(relay),
            Token::Listener { id, socket } => {
                let stream = self.listeners.get(id).map(|l| l.transport.is_stream());
                match stream {
                    None => Readiness::Drained,
                    Some(true) => self.accept_ready(id, usize::from(socket)),
                    Some(false) => self.listener_readable(id, usize::from(socket)),
                }
            }
            Token::Conn { slot, generation } => self.conn_ready(slot, generation),
            Token::Sibling => self.sibling_readable(),
        }
    }

    /// Sends every queued datagram and writes what connections have queued.
    pub(super) fn flush(&mut self) {
        self.datagrams.flush_to_peers(&mut self.counters);
        self.datagrams.flush_to_clients(&mut self.counters);
        if let Some(link) = self.siblings.as_mut() {
            link.flush();
        }
        while let Some(slot) = self.conns.pop_dirty() {
            self.flush_conn(slot);
        }
    }

    /// Writes what connection `slot` has queued; closes it if that fails.
    fn flush_conn(&mut self, slot: u32) {
        if let Err(why) = self.conns.flush(slot, &self.driver) {
            self.close_conn(slot, Some(why));
        }
    }

    /// Accepts what waits on stream listener `id`'s socket `n`.
    fn accept_ready(&mut self, id: ListenerId, n: usize) -> Readiness {
        let Some(fd) = self.listeners.get(id).and_then(|l| l.socket_fd(n)) else {
            return Readiness::Drained;
        };
        for _ in 0..ACCEPTS {
            let socket = match sys::accept(fd) {
                Ok(socket) => socket,
                Err(error) => match error.kind() {
                    io::ErrorKind::WouldBlock => return Readiness::Drained,
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => continue,
                    _ => {
                        if self.accept_failed(fd, &error) {
                            continue;
                        }
                        return Readiness::Drained;
                    }
                },
            };
            self.accepted(id, socket);
        }
        Readiness::More
    }

    /// An accept on `listener_fd` failed with `error`: logs it (rate-limited) and, out of
    /// descriptors, refuses one waiting connection. True if one was refused (accept again).
    fn accept_failed(&mut self, listener_fd: RawFd, error: &io::Error) -> bool {
        self.conns
            .accept_failed(listener_fd, error, &mut self.resource_log)
    }

    /// Takes a connection accepted on stream listener `id`.
    fn accepted(&mut self, id: ListenerId, socket: socket2::Socket) {
        let Some(listener) = self.listeners.get(id) else {
            return;
        };
        let replaced = self.conns.admit(
            socket,
            listener,
            &self.driver,
            &mut self.counters,
            &mut self.resource_log,
            self.index,
        );
        if let Some(old) = replaced {
            self.close_conn(old, None);
        }
    }

    /// Connection `slot` is readable (or writable): writes what is queued, then reads and
    /// handles every complete frame.
    fn conn_ready(&mut self, slot: u32, generation: u16) -> Readiness {
        if !self.conns.is_current(slot, generation) {
            return Readiness::Closed;
        }
        if self.conns.pending(slot) > 0 {
            self.flush_conn(slot);
        }
        let Some(mut scratch) = self.scratch.take() else {
            return Readiness::Drained;
        };
        let outcome = self.conn_read(slot, &mut scratch);
        self.scratch = Some(scratch);
        self.datagrams.flush_to_peers(&mut self.counters);
        self.relays.close_released(&mut self.engine);
        match outcome {
            Ok(()) => Readiness::Drained,
            Err(why) => {
                self.close_conn(slot, Some(why));
                Readiness::Closed
            }
        }
    }

    /// Reads connection `slot` and hands every complete frame to the engine, queueing the
    /// replies on the connection.
    fn conn_read(&mut self, slot: u32, scratch: &mut [u8]) -> Result<(), Closed> {
        let now = Instant::now();
        let Some(mut read) = self.conns.read(slot, scratch, now) else {
            return Err(Closed::Error);
        };
        loop {
            let range = match read.rx.next_frame() {
                Ok(Some(range)) => range,
                Ok(None) => break,
                Err(why) => {
                    self.counters.unparsed += 1;
                    read.outcome = Err(why);
                    break;
                }
            };
            let frame = &read.rx.bytes()[range];
            self.counters.listener_rx_packets += 1;
            self.counters.listeners.traffic[read.metric].rx(frame.len());
            if let Some(n) = self.dispatch_turn_message(now, read.listener, read.client, frame) {
                if self.conns.queue(slot, &self.out[..n]) {
                    self.counters.listeners.traffic[read.metric].tx(n);
                } else {
                    self.counters.send_failed += 1;
                }
            }
        }
        self.conns.finish_read(slot, read.rx, &self.engine);
        read.outcome
    }

    /// Closes connection `slot` and frees its allocation (`why`: logged when given).
    fn close_conn(&mut self, slot: u32, why: Option<Closed>) {
        if let Some((listener, client)) = self.conns.close(slot, why) {
            self.engine.close_client(listener, client);
            self.relays.close_released(&mut self.engine);
        }
    }

    fn listener_readable(&mut self, id: ListenerId, n: usize) -> Readiness {
        let Some(socket) = self.listeners.get(id).and_then(|l| l.datagram_socket(n)) else {
            return Readiness::Drained;
        };
        let Some(mut batch) = self.datagrams.listener_batch.take() else {
            return Readiness::Drained;
        };
        let readiness = self.drain(socket.fd, &mut batch, |shard, now, datagram| {
            shard.client_datagram(now, socket, datagram)
        });
        self.datagrams.listener_batch = Some(batch);
        readiness
    }

    fn relay_readable(&mut self, relay: RelayId) -> Readiness {
        let Some(fd) = self.relays.fd(relay) else {
            return Readiness::Drained;
        };
        let Some(mut batch) = self.datagrams.relay_batch.take() else {
            return Readiness::Drained;
        };
        let readiness = self.drain(fd, &mut batch, |shard, now, datagram| {
            shard.peer_datagram(now, relay, datagram)
        });
        self.datagrams.relay_batch = Some(batch);
        readiness
    }

    /// Receives up to [`ROUNDS`] batches from `fd`, handing each datagram to `handle`.
    fn drain(
        &mut self,
        fd: RawFd,
        batch: &mut RecvBatch,
        mut handle: impl FnMut(&mut Self, Instant, Datagram<'_>),
    ) -> Readiness {
        let mut failed = false;
        for _ in 0..ROUNDS {
            let count = match batch.recv(fd) {
                Ok(count) => count,
                // A pending socket error is reported once and cleared: the next round reads
                // what is queued behind it (an edge-triggered backend would not report the
                // socket again for datagrams that are already waiting).
                Err(e) => {
                    tracing::debug!(target: "stunner", "receive failed: {e}");
                    if failed {
                        return Readiness::Drained;
                    }
                    failed = true;
                    continue;
                }
            };
            let now = Instant::now();
            for i in 0..count {
                handle(self, now, batch.get(i));
            }
            self.datagrams.flush_to_peers(&mut self.counters);
            self.relays.close_released(&mut self.engine);
            if self.relays.offload.is_some() {
                self.sync_offload(now);
            }
            if count < BATCH {
                return Readiness::Drained;
            }
        }
        Readiness::More
    }

    fn client_datagram(&mut self, now: Instant, socket: DatagramSocket, datagram: Datagram<'_>) {
        self.counters.listener_rx_packets += 1;
        self.counters.listeners.traffic[socket.metric].rx(datagram.len);
        let Some(from) = datagram.from.map(canonical) else {
            return;
        };
        if datagram.truncated || datagram.len >= MAX_DATAGRAM {
            self.counters.unparsed += 1;
            return;
        }
        let data = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
        if socket.dtls {
            self.dtls_datagram(now, socket, from, data);
            return;
        }
        if let Some(n) = self.dispatch_turn_message(now, socket.id, from, data) {
            // The kernel relays a channel from the moment its ChannelBind is answered: the
            // entry is installed before the answer leaves.
            if self.relays.offload.is_some() {
                self.sync_offload(now);
            }
            socket.send_to(from, &self.out[..n], &mut self.counters);
        }
    }

    /// A datagram from `from` on DTLS listener socket `socket`: handshake records go to (or
    /// start) its session; decrypted TURN messages go to the engine and their replies back
    /// encrypted.
    fn dtls_datagram(
        &mut self,
        now: Instant,
        socket: DatagramSocket,
        from: SocketAddr,
        data: &[u8],
    ) {
        let Some(dtls) = self.listeners.dtls_mut(socket.id) else {
            return;
        };
        let Some((mut session, datagram)) =
            dtls.take_session(now, from, data, &socket, &mut self.counters)
        else {
            return;
        };
        let Some(mut scratch) = self.scratch.take() else {
            return;
        };
        let received = session.receive(now, datagram, &mut scratch, |session, message| {
            if let Some(n) = self.dispatch_turn_message(now, socket.id, from, message) {
                if !session.send(&self.out[..n]) {
                    self.counters.send_failed += 1;
                }
            }
        });
        self.scratch = Some(scratch);
        session.drain(|datagram| socket.send_to(from, datagram, &mut self.counters));
        match received {
            Ok(()) => {
                if let Some(dtls) = self.listeners.dtls_mut(socket.id) {
                    dtls.restore(from, session);
                }
            }
            Err(why) => {
                tracing::debug!(target: "stunner", "DTLS session of {from} ended: {why:?}");
                self.engine.close_client(socket.id, from);
                self.relays.close_released(&mut self.engine);
            }
        }
    }

    /// The dispatch point for one TURN message from `from` on listener `id`, whatever carried
    /// it: relays, allocates or answers. Returns the length of the reply left in `self.out`.
    fn dispatch_turn_message(
        &mut self,
        now: Instant,
        id: ListenerId,
        from: SocketAddr,
        data: &[u8],
    ) -> Option<usize> {
        let snap: &Snapshot = self.snapshots.serving();
        let listener = self.listeners.get(id)?;
        let action = self.engine.handle_client(
            now,
            snap,
            ListenerRef {
                id,
                spec: &listener.spec,
            },
            from,
            data,
            &mut self.out,
        );
        match action {
            ClientAction::Drop(_) => None,
            ClientAction::Miss => self.miss(now, id, from, data),
            ClientAction::Reply(n) => Some(n),
            ClientAction::Relay {
                relay,
                peer,
                payload,
                cluster,
            } => {
                relay_to_peer(
                    &self.relays,
                    &mut self.counters,
                    &mut self.datagrams,
                    snap,
                    relay,
                    peer,
                    &data[payload],
                    cluster,
                );
                None
            }
            ClientAction::AllocateRelay(request) => {
                let (first, additional) = self.relays.open(&request, &self.driver);
                let mut bound = |result: std::io::Result<u16>| {
                    result.map_err(|e| {
                        if let Some(suppressed) = self.resource_log.allow(now) {
                            tracing::warn!(target: "stunner", "cannot allocate relay socket: {e}{suppressed}");
                        }
                        crate::proto::RelayBindError::from(&e)
                    })
                };
                let bound = BoundRelays {
                    relay: bound(first),
                    additional: additional.map(&mut bound),
                };
                let reply = self
                    .engine
                    .complete_allocate(now, request.relay, bound, &mut self.out);
                if reply.is_some() {
                    let ports = [Some(bound.relay), bound.additional];
                    for (relay, port) in request.sockets().zip(ports) {
                        if let Some(Ok(port)) = port {
                            tracing::debug!(
                                target: "stunner",
                                "Allocation created: client={}-{}:{}, listener={}, relay-address={}, shard={}",
                                from,
                                listener.spec.port,
                                listener.transport.name(),
                                listener.spec.name,
                                SocketAddr::new(
                                    listener
                                        .spec
                                        .relay
                                        .get(relay.family() == crate::proto::Family::V6)
                                        .unwrap_or(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
                                    port
                                ),
                                self.index
                            );
                        }
                    }
                }
                reply
            }
        }
    }

    /// A client datagram that needs an allocation this shard does not hold, with forwarding
    /// on: a UDP client's goes to the sibling that holds it (a moved flow); a stream or DTLS
    /// client's (a new connection is a new 5-tuple, which no sibling holds) and one no
    /// sibling claims get today's answer. The length of a reply left in `self.out`.
    fn miss(
        &mut self,
        now: Instant,
        id: ListenerId,
        from: SocketAddr,
        data: &[u8],
    ) -> Option<usize> {
        let udp = self
            .listeners
            .get(id)
            .is_some_and(|l| matches!(l.transport, ListenerTransport::Udp));
        if udp {
            if let siblings::MissVerdict::Forwarded = self.forward_miss(now, id, from, data) {
                return None;
            }
        }
        let snap: &Snapshot = self.snapshots.serving();
        let listener = self.listeners.get(id)?;
        let action = self.engine.handle_client_local(
            now,
            snap,
            ListenerRef {
                id,
                spec: &listener.spec,
            },
            from,
            data,
            &mut self.out,
        );
        let snap = self.snapshots.serving_arc();
        self.act(now, &snap, data, action)
    }

    /// Queues `payload` for `peer` on `relay`'s socket, counted under `cluster`.
    fn relay_to_peer(
        &mut self,
        snap: &Snapshot,
        relay: RelayId,
        peer: SocketAddr,
        payload: &[u8],
        cluster: uturn_shared::snapshot::ClusterId,
    ) {
        relay_to_peer(
            &self.relays,
            &mut self.counters,
            &mut self.datagrams,
            snap,
            relay,
            peer,
            payload,
            cluster,
        );
    }

    /// A datagram from a peer on `relay`'s socket: relayed to the client (as ChannelData or
    /// a Data indication) on whatever transport the client uses.
    fn peer_datagram(&mut self, now: Instant, relay: RelayId, datagram: Datagram<'_>) {
        let Some(peer) = datagram.from else {
            return;
        };
        if datagram.truncated {
            self.counters.unparsed += 1;
            return;
        }
        let snap: &Snapshot = self.snapshots.serving();
        let buf = &mut datagram.buf[..PEER_HEADROOM + datagram.len];
        let PeerAction::ToClient {
            listener,
            client,
            bytes,
            cluster,
            payload_len,
            forwarded,
        } = self
            .engine
            .handle_peer(now, snap, relay, peer, buf, &mut self.out)
        else {
            return;
        };
        let counters = &mut self.counters;
        if let Some(slot) = counters.cluster(snap, cluster) {
            counters.clusters.traffic[slot].rx(payload_len);
        }
        if let Some(via) = forwarded.then(|| self.engine.via(relay)).flatten() {
            // The client reaches us through a sibling now: back through it.
            self.counters.relayed_to_client += 1;
            match bytes {
                Bytes::Input(range) => self.return_through(via, listener, client, &buf[range]),
                Bytes::Output(n) => {
                    // Lent out (no copy) while the shard is borrowed to send it.
                    let out = std::mem::take(&mut self.out);
                    self.return_through(via, listener, client, &out[..n]);
                    self.out = out;
                }
            }
            return;
        }
        let counters = &mut self.counters;
        let Some(running) = self.listeners.get_mut(listener) else {
            return;
        };
        // Replies leave from the listener's first socket (any of its group would do).
        let Some(socket) = running.datagram_socket(0) else {
            return;
        };
        counters.relayed_to_client += 1;
        let data = match bytes {
            Bytes::Input(range) => &buf[range],
            Bytes::Output(n) => &self.out[..n],
        };
        match &mut running.transport {
            ListenerTransport::Udp => self
                .datagrams
                .queue_to_client(&socket, client, data, counters),
            ListenerTransport::Dtls(dtls) => dtls.send_to_client(client, data, &socket, counters),
            ListenerTransport::Tcp | ListenerTransport::Tls(_) => {
                if self.conns.queue_to_client(listener, client, data) {
                    counters.listeners.traffic[socket.metric].tx(data.len());
                } else {
                    counters.send_failed += 1;
                }
            }
        }
    }
}

/// Queues `payload` for `peer` on `relay`'s socket, counted under `cluster`.
#[allow(clippy::too_many_arguments)] // the shard's parts it touches, each borrowed apart
fn relay_to_peer(
    relays: &Relays<impl Sized>,
    counters: &mut Counters,
    datagrams: &mut Datagrams,
    snap: &Snapshot,
    relay: RelayId,
    peer: SocketAddr,
    payload: &[u8],
    cluster: uturn_shared::snapshot::ClusterId,
) {
    if let Some(fd) = relays.fd(relay) {
        counters.relayed_to_peer += 1;
        let cluster = counters.cluster(snap, cluster).unwrap_or(NO_SLOT);
        datagrams
            .to_peers
            .push(fd, payload, peer, cluster, &mut |cluster, outcome| {
                counters.sent_to_peer(cluster, outcome)
            });
    }
}

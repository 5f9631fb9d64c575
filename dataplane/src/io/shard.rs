//! One shard's logic, whichever IO engine drives it: the listener and relay sockets it owns,
//! the allocations made on them and a shard-local [`Engine`]. The engine ([`super::uring`] or
//! [`super::epoll`]) only waits: it tells the shard which socket is readable
//! ([`Shard::readable`]), when to flush queued sends ([`Shard::flush`]) and when to tick
//! ([`Shard::tick`]). The shard moves datagrams with batched, non-blocking syscalls
//! (`recvmmsg`, `sendto`, `sendmmsg`) into buffers allocated once.

use super::batch::{Datagram, RecvBatch, SendQueue, BATCH};
use super::metrics::{Named, ShardReport};
use super::socket::{canonical, for_socket, listener_socket, relay_socket, try_send_to};
use super::ShardStats;
use crate::proto::{
    Bytes, ClientAction, DropReason, Engine, EngineConfig, ListenerId, ListenerRef, PeerAction,
    RelayId, PEER_HEADROOM,
};
use arc_swap::{ArcSwap, Cache};
use socket2::Socket;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_shared::config::ListenerProtocol;
use uturn_shared::snapshot::{ClusterId, ListenerSpec, Snapshot};

/// Datagrams of this size or more are dropped as possibly truncated (as stunnerd).
const MAX_DATAGRAM: usize = 1600;
/// Scratch for replies and framed ChannelData.
const BUFFER: usize = 2048;
/// How often a shard picks up a new snapshot, expires allocations and publishes counters.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// Batches one readable socket may take before the shard serves the others.
const ROUNDS: usize = 4;

pub(super) struct ShardSetup {
    pub index: usize,
    pub shards: usize,
    pub udp_thread_num: usize,
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub engine: EngineConfig,
    pub stop: Arc<AtomicBool>,
    pub stats: Arc<Vec<ShardStats>>,
}

/// How many of a TURN-UDP listener's `udp_thread_num` sockets shard `index` of `shards` opens.
pub fn listener_sockets_on_shard(udp_thread_num: usize, shards: usize, index: usize) -> usize {
    let total = udp_thread_num.max(1);
    (0..total).filter(|j| j % shards.max(1) == index).count()
}

/// Which socket an engine reports readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Token {
    /// Socket `n` of a listener.
    Listener(ListenerId, u16),
    /// An allocation's relay socket.
    Relay(RelayId),
}

impl Token {
    const LISTENER: u64 = 1 << 63;

    /// A number to register with a poller.
    pub fn to_u64(self) -> u64 {
        match self {
            Token::Listener(id, n) => Token::LISTENER | (u64::from(id.0) << 16) | u64::from(n),
            Token::Relay(id) => u64::from(id.0),
        }
    }

    /// The token [`Token::to_u64`] made `raw` from.
    pub fn from_u64(raw: u64) -> Token {
        if raw & Token::LISTENER != 0 {
            Token::Listener(ListenerId((raw >> 16) as u32), raw as u16)
        } else {
            Token::Relay(RelayId(raw as u32))
        }
    }
}

/// What an IO engine provides: readiness reports for the sockets a shard opens.
pub(super) trait Driver {
    /// Keeps a watched socket open and reported; dropping it closes the socket.
    type Watch;

    /// Starts reporting `socket` as `token` (it is non-blocking). Returns its fd, valid for as
    /// long as the returned watch lives.
    fn watch(&self, socket: Socket, token: Token) -> io::Result<(RawFd, Self::Watch)>;
}

/// Whether a readable socket was emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readiness {
    /// The socket had nothing more (or is gone).
    Drained,
    /// The shard stopped after [`ROUNDS`] full batches; more is probably waiting.
    More,
}

struct RunningListener<W> {
    id: ListenerId,
    /// Slot of this listener's name in the shard's listener counters.
    metric: usize,
    spec: ListenerSpec,
    /// The address every socket of this listener is bound to (all share it via SO_REUSEPORT).
    local_addr: SocketAddr,
    sockets: Vec<(RawFd, W)>,
}

struct RelaySlot<W> {
    fd: RawFd,
    _watch: W,
}

#[derive(Default)]
struct Counters {
    listener_rx_packets: u64,
    relayed_to_peer: u64,
    relayed_to_client: u64,
    /// Datagrams dropped before the engine saw them (too big).
    oversized: u64,
    /// Datagrams the kernel would not take (full socket buffer or an error).
    send_failed: u64,
    listeners: Named,
    clusters: Named,
    /// `ClusterId` → slot in `clusters`, for the snapshot generation `cluster_generation`.
    cluster_slots: Vec<usize>,
    cluster_generation: Option<u64>,
}

impl Counters {
    /// The counter slot of cluster `id` of `snap`.
    fn cluster(&mut self, snap: &Snapshot, id: ClusterId) -> Option<usize> {
        if self.cluster_generation != Some(snap.generation) {
            self.cluster_generation = Some(snap.generation);
            let clusters = &mut self.clusters;
            self.cluster_slots = snap
                .clusters
                .iter()
                .map(|c| clusters.slot(&c.name))
                .collect();
        }
        self.cluster_slots.get(id).copied()
    }

    /// Counts a datagram sent (or not) to a client through listener counter slot `metric`.
    fn sent_to_client(&mut self, metric: usize, outcome: io::Result<usize>) {
        if let Some(n) = self.sent(outcome.map(Some)) {
            self.listeners.traffic[metric].tx(n);
        }
    }

    /// Counts a datagram relayed (or not) to a peer of cluster counter slot `cluster`.
    fn sent_to_peer(&mut self, cluster: usize, outcome: io::Result<usize>) {
        if let (Some(n), Some(traffic)) = (
            self.sent(outcome.map(Some)),
            self.clusters.traffic.get_mut(cluster),
        ) {
            traffic.tx(n);
        }
    }

    /// Counts the outcome of one send.
    fn sent(&mut self, outcome: io::Result<Option<usize>>) -> Option<usize> {
        match outcome {
            Ok(Some(n)) => Some(n),
            Ok(None) => {
                self.send_failed += 1;
                None
            }
            Err(e) => {
                self.send_failed += 1;
                tracing::debug!(target: "stunner", "send failed: {e}");
                None
            }
        }
    }
}

pub(super) struct Shard<D: Driver> {
    index: usize,
    engine: Engine,
    cache: Cache<Arc<ArcSwap<Snapshot>>, Arc<Snapshot>>,
    generation: Option<u64>,
    listeners: Vec<RunningListener<D::Watch>>,
    relays: Vec<Option<RelaySlot<D::Watch>>>,
    next_listener_id: u32,
    counters: Counters,
    driver: D,
    /// Taken while a batch is handled (so the shard can be borrowed alongside it).
    batch: Option<Box<RecvBatch>>,
    out: Box<[u8]>,
    /// Relayed client datagrams, tagged with their cluster's counter slot (or [`NO_SLOT`]):
    /// a run of datagrams for one relay socket (a video frame, say) leaves in one `sendmmsg`.
    to_peers: SendQueue,
    /// Datagrams for clients, tagged with their listener's counter slot.
    to_clients: SendQueue,
}

/// The tag of a relayed datagram whose cluster has no counter slot.
const NO_SLOT: usize = usize::MAX;

impl<D: Driver> Shard<D> {
    pub fn new(setup: &ShardSetup, driver: D) -> Shard<D> {
        Shard {
            index: setup.index,
            engine: Engine::new(setup.engine.clone()),
            cache: Cache::new(setup.snapshot.clone()),
            generation: None,
            listeners: Vec::new(),
            relays: Vec::new(),
            next_listener_id: 0,
            counters: Counters::default(),
            driver,
            batch: Some(Box::new(RecvBatch::new(PEER_HEADROOM))),
            out: vec![0u8; BUFFER].into_boxed_slice(),
            to_peers: SendQueue::new(),
            to_clients: SendQueue::new(),
        }
    }

    /// Picks up a new snapshot (opening and closing listeners), expires what is due and
    /// publishes the counters.
    pub fn tick(&mut self, setup: &ShardSetup) {
        let now = Instant::now();
        let snap = self.cache.load().clone();
        if self.generation != Some(snap.generation) {
            self.generation = Some(snap.generation);
            self.reconcile_listeners(&snap, setup);
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
            self.close_relays();
        }
        self.publish(&setup.stats[self.index]);
    }

    /// Closes every socket.
    pub fn shutdown(&mut self, stats: &ShardStats) {
        self.listeners.clear();
        self.relays.clear();
        stats.allocations.store(0, Ordering::Relaxed);
    }

    /// Receives and handles what waits on the socket behind `token`, up to [`ROUNDS`] batches.
    pub fn readable(&mut self, token: Token) -> Readiness {
        let Some(mut batch) = self.batch.take() else {
            return Readiness::Drained;
        };
        let readiness = match token {
            Token::Listener(id, n) => self.listener_readable(&mut batch, id, usize::from(n)),
            Token::Relay(relay) => self.relay_readable(&mut batch, relay),
        };
        self.batch = Some(batch);
        readiness
    }

    /// Sends every queued datagram.
    pub fn flush(&mut self) {
        self.flush_peers();
        if self.to_clients.is_empty() {
            return;
        }
        let counters = &mut self.counters;
        self.to_clients
            .flush(&mut |metric, outcome| counters.sent_to_client(metric, outcome));
    }

    fn flush_peers(&mut self) {
        if self.to_peers.is_empty() {
            return;
        }
        let counters = &mut self.counters;
        self.to_peers
            .flush(&mut |cluster, outcome| counters.sent_to_peer(cluster, outcome));
    }

    fn listener_readable(&mut self, batch: &mut RecvBatch, id: ListenerId, n: usize) -> Readiness {
        let Some((fd, metric, local)) = self
            .listeners
            .iter()
            .find(|l| l.id == id)
            .and_then(|l| l.sockets.get(n).map(|s| (s.0, l.metric, l.local_addr)))
        else {
            return Readiness::Drained;
        };
        self.drain(fd, batch, |shard, now, datagram| {
            shard.client_datagram(now, id, fd, metric, local, datagram)
        })
    }

    fn relay_readable(&mut self, batch: &mut RecvBatch, relay: RelayId) -> Readiness {
        let Some(fd) = self
            .relays
            .get(relay.0 as usize)
            .and_then(|r| r.as_ref())
            .map(|r| r.fd)
        else {
            return Readiness::Drained;
        };
        self.drain(fd, batch, |shard, now, datagram| {
            shard.peer_datagram(now, relay, datagram)
        })
    }

    /// Receives up to [`ROUNDS`] batches from `fd`, handing each datagram to `handle`.
    fn drain(
        &mut self,
        fd: RawFd,
        batch: &mut RecvBatch,
        mut handle: impl FnMut(&mut Self, Instant, Datagram<'_>),
    ) -> Readiness {
        for _ in 0..ROUNDS {
            let count = match batch.recv(fd) {
                Ok(count) => count,
                Err(e) => {
                    tracing::debug!(target: "stunner", "receive failed: {e}");
                    return Readiness::Drained;
                }
            };
            let now = Instant::now();
            for i in 0..count {
                handle(self, now, batch.get(i));
            }
            self.flush_peers();
            self.close_relays();
            if count < BATCH {
                return Readiness::Drained;
            }
        }
        Readiness::More
    }

    fn client_datagram(
        &mut self,
        now: Instant,
        id: ListenerId,
        fd: RawFd,
        metric: usize,
        local: SocketAddr,
        datagram: Datagram<'_>,
    ) {
        let Shard {
            engine,
            cache,
            listeners,
            relays,
            counters,
            driver,
            out,
            index,
            to_peers,
            ..
        } = self;
        counters.listener_rx_packets += 1;
        counters.listeners.traffic[metric].rx(datagram.len);
        let Some(from) = datagram.from.map(canonical) else {
            return;
        };
        if datagram.truncated || datagram.len >= MAX_DATAGRAM {
            counters.oversized += 1;
            return;
        }
        let data = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
        let snap: &Snapshot = cache.load();
        let Some(listener) = listeners.iter().find(|l| l.id == id) else {
            return;
        };
        let action = engine.handle_client(
            now,
            snap,
            ListenerRef {
                id,
                spec: &listener.spec,
            },
            from,
            data,
            out,
        );
        let reply = match action {
            ClientAction::Drop(_) => None,
            ClientAction::Reply(n) => Some(n),
            ClientAction::Relay {
                relay,
                peer,
                payload,
                cluster,
            } => {
                if let Some(slot) = relays.get(relay.0 as usize).and_then(|r| r.as_ref()) {
                    counters.relayed_to_peer += 1;
                    let cluster = counters.cluster(snap, cluster).unwrap_or(NO_SLOT);
                    to_peers.push(
                        slot.fd,
                        &data[payload],
                        peer,
                        cluster,
                        &mut |cluster, outcome| counters.sent_to_peer(cluster, outcome),
                    );
                }
                None
            }
            ClientAction::AllocateRelay(request) => {
                let bound = relay_socket(&request).and_then(|(socket, port)| {
                    let (fd, watch) = driver.watch(socket, Token::Relay(request.relay))?;
                    Ok((fd, watch, port))
                });
                let port = match bound {
                    Ok((fd, watch, port)) => {
                        let slot = request.relay.0 as usize;
                        if relays.len() <= slot {
                            relays.resize_with(slot + 1, || None);
                        }
                        relays[slot] = Some(RelaySlot { fd, _watch: watch });
                        Ok(port)
                    }
                    Err(e) => {
                        tracing::warn!(target: "stunner", "cannot allocate relay socket: {e}");
                        Err(())
                    }
                };
                let reply = engine.complete_allocate(now, request.relay, port, out);
                if let (Some(_), Ok(port)) = (reply, port) {
                    tracing::debug!(
                        target: "stunner",
                        "Allocation created: client={}-{}:UDP, listener={}, relay-address={}:{}, shard={}",
                        from,
                        listener.spec.port,
                        listener.spec.name,
                        listener.spec.advertised_ip,
                        port,
                        index
                    );
                }
                reply
            }
        };
        if let Some(n) = reply {
            let outcome = try_send_to(fd, &out[..n], for_socket(local, from));
            if let Some(sent) = counters.sent(outcome) {
                counters.listeners.traffic[metric].tx(sent);
            }
        }
    }

    fn peer_datagram(&mut self, now: Instant, relay: RelayId, datagram: Datagram<'_>) {
        let Shard {
            engine,
            cache,
            listeners,
            counters,
            out,
            to_clients,
            ..
        } = self;
        let Some(peer) = datagram.from else {
            return;
        };
        if datagram.truncated || datagram.len >= MAX_DATAGRAM {
            counters.oversized += 1;
            return;
        }
        let snap: &Snapshot = cache.load();
        let buf = &mut datagram.buf[..PEER_HEADROOM + datagram.len];
        let PeerAction::ToClient {
            listener,
            client,
            bytes,
            cluster,
            payload_len,
        } = engine.handle_peer(now, snap, relay, peer, buf, out)
        else {
            return;
        };
        if let Some(slot) = counters.cluster(snap, cluster) {
            counters.clusters.traffic[slot].rx(payload_len);
        }
        let Some((fd, local, metric)) = listeners
            .iter()
            .find(|l| l.id == listener)
            .and_then(|l| l.sockets.first().map(|s| (s.0, l.local_addr, l.metric)))
        else {
            return;
        };
        counters.relayed_to_client += 1;
        let data = match bytes {
            Bytes::Input(range) => &buf[range],
            Bytes::Output(n) => &out[..n],
        };
        to_clients.push(
            fd,
            data,
            for_socket(local, client),
            metric,
            &mut |metric, outcome| counters.sent_to_client(metric, outcome),
        );
    }

    fn close_relays(&mut self) {
        while let Some(relay) = self.engine.poll_close() {
            if let Some(slot) = self.relays.get_mut(relay.0 as usize) {
                *slot = None;
            }
        }
    }

    fn publish(&self, stats: &ShardStats) {
        let engine = self.engine.stats();
        let dropped: u64 = engine.dropped.iter().sum();
        stats
            .allocations
            .store(self.engine.allocation_count() as u64, Ordering::Relaxed);
        stats
            .allocations_created
            .store(engine.allocations_created, Ordering::Relaxed);
        stats.dropped.store(dropped, Ordering::Relaxed);
        stats.malformed.store(
            engine.dropped[DropReason::Malformed.index()],
            Ordering::Relaxed,
        );
        stats
            .listener_rx_packets
            .store(self.counters.listener_rx_packets, Ordering::Relaxed);
        stats
            .relayed_to_peer
            .store(self.counters.relayed_to_peer, Ordering::Relaxed);
        stats
            .relayed_to_client
            .store(self.counters.relayed_to_client, Ordering::Relaxed);
        let mut report = ShardReport {
            listeners: self.counters.listeners.clone(),
            clusters: self.counters.clusters.clone(),
            dropped: engine.dropped,
            auth_failed: engine.auth_failures,
            send_failed: self.counters.send_failed,
        };
        report.dropped[DropReason::Malformed.index()] += self.counters.oversized;
        for open in report.listeners.open.iter_mut() {
            *open = 0;
        }
        for l in &self.listeners {
            report.listeners.open[l.metric] += l.sockets.len() as u64;
        }
        if let Ok(mut published) = stats.report.lock() {
            *published = report;
        }
    }

    /// Opens listeners the snapshot adds and closes those it removes (or changes in a way
    /// that needs a restart); unchanged listeners and their allocations are left alone.
    fn reconcile_listeners(&mut self, snap: &Snapshot, setup: &ShardSetup) {
        let desired: Vec<&ListenerSpec> = snap
            .listeners
            .iter()
            .filter(|l| l.protocol == ListenerProtocol::TurnUdp)
            .collect();
        let removed: Vec<(ListenerId, String)> = self
            .listeners
            .iter()
            .filter(|running| !desired.iter().any(|d| **d == running.spec))
            .map(|running| (running.id, running.spec.name.clone()))
            .collect();
        for (id, name) in removed {
            self.engine.close_listener(id);
            self.close_relays();
            self.listeners.retain(|l| l.id != id);
            tracing::info!(target: "stunner", "listener {name:?} closed on shard {}", self.index);
        }
        let count = listener_sockets_on_shard(setup.udp_thread_num, setup.shards, setup.index);
        for spec in desired {
            if count == 0 || self.listeners.iter().any(|l| l.spec == *spec) {
                continue;
            }
            self.next_listener_id += 1;
            let id = ListenerId(self.next_listener_id);
            let mut sockets = Vec::new();
            let mut local_addr = None;
            for n in 0..count {
                let opened = listener_socket(spec.port).and_then(|socket| {
                    let local = socket.local_addr()?.as_socket();
                    let watched = self.driver.watch(socket, Token::Listener(id, n as u16))?;
                    Ok((local, watched))
                });
                match opened {
                    Ok((local, watched)) => {
                        local_addr = local_addr.or(local);
                        sockets.push(watched);
                    }
                    Err(e) => tracing::error!(
                        target: "stunner",
                        "cannot open listener {:?} on UDP port {}: {e}",
                        spec.name,
                        spec.port
                    ),
                }
            }
            let Some(local_addr) = local_addr else {
                continue;
            };
            let metric = self.counters.listeners.slot(&spec.name);
            tracing::info!(
                target: "stunner",
                "listener {:?} (TURN-UDP, port {}, relay address {}) serving on shard {} with {} socket(s)",
                spec.name,
                spec.port,
                spec.advertised_ip,
                setup.index,
                sockets.len()
            );
            self.counters.listeners.opened[metric] += sockets.len() as u64;
            self.listeners.push(RunningListener {
                id,
                metric,
                spec: spec.clone(),
                local_addr,
                sockets,
            });
        }
    }
}

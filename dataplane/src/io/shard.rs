//! One shard: a single-threaded glommio executor running listener, relay and tick tasks over
//! a shard-local engine. Tasks share the shard through `Rc<RefCell<_>>`; no borrow is held
//! across an `.await`.

use super::metrics::{Named, ShardReport};
use super::socket::{canonical, for_socket, listener_socket, relay_socket, try_send_to};
use super::ShardStats;
use crate::proto::{
    Bytes, ClientAction, DropReason, Engine, EngineConfig, ListenerId, ListenerRef, PeerAction,
    RelayId, PEER_HEADROOM,
};
use arc_swap::{ArcSwap, Cache};
use glommio::net::UdpSocket;
use glommio::{spawn_local, Task};
use std::cell::RefCell;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, FromRawFd, IntoRawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_shared::config::ListenerProtocol;
use uturn_shared::snapshot::{ClusterId, ListenerSpec, Snapshot};

/// Datagrams of this size or more are dropped as possibly truncated (as stunnerd).
const MAX_DATAGRAM: usize = 1600;
const BUFFER: usize = 2048;
const TICK: Duration = Duration::from_millis(100);

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

struct RunningListener {
    id: ListenerId,
    /// Slot of this listener's name in the shard's listener counters.
    metric: usize,
    spec: ListenerSpec,
    /// The address every socket of this listener is bound to (all share it via SO_REUSEPORT).
    local_addr: SocketAddr,
    sockets: Vec<Rc<UdpSocket>>,
    _tasks: Vec<Task<()>>,
}

struct RelaySlot {
    socket: Rc<UdpSocket>,
    _task: Task<()>,
}

#[derive(Default)]
struct Counters {
    listener_rx_packets: u64,
    relayed_to_peer: u64,
    relayed_to_client: u64,
    /// Datagrams dropped before the engine saw them (too big).
    oversized: u64,
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
}

struct Shard {
    index: usize,
    engine: Engine,
    cache: Cache<Arc<ArcSwap<Snapshot>>, Arc<Snapshot>>,
    listeners: Vec<RunningListener>,
    relays: Vec<Option<RelaySlot>>,
    next_listener_id: u32,
    counters: Counters,
}

type ShardRef = Rc<RefCell<Shard>>;

pub(super) async fn run(setup: ShardSetup) {
    let shard: ShardRef = Rc::new(RefCell::new(Shard {
        index: setup.index,
        engine: Engine::new(setup.engine.clone()),
        cache: Cache::new(setup.snapshot.clone()),
        listeners: Vec::new(),
        relays: Vec::new(),
        next_listener_id: 0,
        counters: Counters::default(),
    }));
    let mut generation = None;
    while !setup.stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        {
            let snap = shard.borrow_mut().cache.load().clone();
            if generation != Some(snap.generation) {
                generation = Some(snap.generation);
                reconcile_listeners(&shard, &snap, &setup);
            }
            let mut s = shard.borrow_mut();
            if s.engine.poll_timeout().is_some_and(|t| t <= now) {
                s.engine.handle_timeout(now);
                close_relays(&mut s);
            }
            publish(&s, &setup.stats[setup.index]);
        }
        glommio::timer::sleep(TICK).await;
    }
    // Dropping the tasks cancels them and closes every socket; this also breaks the
    // shard ↔ task reference cycle.
    let mut s = shard.borrow_mut();
    s.listeners.clear();
    s.relays.clear();
    setup.stats[setup.index]
        .allocations
        .store(0, Ordering::Relaxed);
}

fn publish(shard: &Shard, stats: &ShardStats) {
    let engine = shard.engine.stats();
    let dropped: u64 = engine.dropped.iter().sum();
    stats
        .allocations
        .store(shard.engine.allocation_count() as u64, Ordering::Relaxed);
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
        .store(shard.counters.listener_rx_packets, Ordering::Relaxed);
    stats
        .relayed_to_peer
        .store(shard.counters.relayed_to_peer, Ordering::Relaxed);
    stats
        .relayed_to_client
        .store(shard.counters.relayed_to_client, Ordering::Relaxed);
    let mut report = ShardReport {
        listeners: shard.counters.listeners.clone(),
        clusters: shard.counters.clusters.clone(),
        dropped: engine.dropped,
        auth_failed: engine.auth_failures,
    };
    report.dropped[DropReason::Malformed.index()] += shard.counters.oversized;
    for open in report.listeners.open.iter_mut() {
        *open = 0;
    }
    for l in &shard.listeners {
        report.listeners.open[l.metric] += l.sockets.len() as u64;
    }
    if let Ok(mut published) = stats.report.lock() {
        *published = report;
    }
}

/// Opens listeners the snapshot adds and closes those it removes (or changes in a way that
/// needs a restart); unchanged listeners and their allocations are left alone.
fn reconcile_listeners(shard: &ShardRef, snap: &Snapshot, setup: &ShardSetup) {
    let desired: Vec<&ListenerSpec> = snap
        .listeners
        .iter()
        .filter(|l| l.protocol == ListenerProtocol::TurnUdp)
        .collect();
    {
        let mut s = shard.borrow_mut();
        let removed: Vec<(ListenerId, String)> = s
            .listeners
            .iter()
            .filter(|running| !desired.iter().any(|d| **d == running.spec))
            .map(|running| (running.id, running.spec.name.clone()))
            .collect();
        for (id, name) in removed {
            s.engine.close_listener(id);
            close_relays(&mut s);
            s.listeners.retain(|l| l.id != id);
            tracing::info!(target: "stunner", "listener {name:?} closed on shard {}", s.index);
        }
    }
    let count = listener_sockets_on_shard(setup.udp_thread_num, setup.shards, setup.index);
    for spec in desired {
        if count == 0 || shard.borrow().listeners.iter().any(|l| l.spec == *spec) {
            continue;
        }
        let id = {
            let mut s = shard.borrow_mut();
            s.next_listener_id += 1;
            ListenerId(s.next_listener_id)
        };
        let mut sockets = Vec::new();
        for _ in 0..count {
            match listener_socket(spec.port) {
                // SAFETY: the fd comes from a socket we just created and hand over.
                Ok(socket) => sockets.push(Rc::new(unsafe {
                    UdpSocket::from_raw_fd(socket.into_raw_fd())
                })),
                Err(e) => tracing::error!(
                    target: "stunner",
                    "cannot open listener {:?} on UDP port {}: {e}",
                    spec.name,
                    spec.port
                ),
            }
        }
        if sockets.is_empty() {
            continue;
        }
        let metric = shard.borrow_mut().counters.listeners.slot(&spec.name);
        let tasks = sockets
            .iter()
            .map(|socket| spawn_local(listener_loop(shard.clone(), id, metric, socket.clone())))
            .collect();
        tracing::info!(
            target: "stunner",
            "listener {:?} (TURN-UDP, port {}, relay address {}) serving on shard {} with {} socket(s)",
            spec.name,
            spec.port,
            spec.advertised_ip,
            setup.index,
            sockets.len()
        );
        let Ok(local_addr) = sockets[0].local_addr() else {
            continue;
        };
        let mut s = shard.borrow_mut();
        s.counters.listeners.opened[metric] += sockets.len() as u64;
        s.listeners.push(RunningListener {
            id,
            metric,
            spec: spec.clone(),
            local_addr,
            sockets,
            _tasks: tasks,
        });
    }
}

fn close_relays(shard: &mut Shard) {
    while let Some(relay) = shard.engine.poll_close() {
        if let Some(slot) = shard.relays.get_mut(relay.0 as usize) {
            *slot = None;
        }
    }
}

enum Send {
    Nothing,
    Reply(usize),
    Relay(
        Rc<UdpSocket>,
        SocketAddr,
        std::ops::Range<usize>,
        Option<usize>,
    ),
}

async fn listener_loop(shard: ShardRef, id: ListenerId, metric: usize, socket: Rc<UdpSocket>) {
    let Ok(local) = socket.local_addr() else {
        return;
    };
    let mut buf = vec![0u8; BUFFER];
    let mut out = vec![0u8; BUFFER];
    loop {
        let (len, from) = match socket.recv_from(&mut buf).await {
            Ok(received) => received,
            Err(_) => continue,
        };
        let from = canonical(from);
        let send = {
            let mut guard = shard.borrow_mut();
            let s = &mut *guard;
            s.counters.listener_rx_packets += 1;
            s.counters.listeners.traffic[metric].rx(len);
            if len >= MAX_DATAGRAM {
                s.counters.oversized += 1;
                Send::Nothing
            } else {
                handle_client_datagram(s, &shard, id, from, &buf[..len], &mut out)
            }
        };
        match send {
            Send::Nothing => {}
            Send::Reply(n) => match send_now(&socket, &out[..n], for_socket(local, from)).await {
                Ok(sent) => shard.borrow_mut().counters.listeners.traffic[metric].tx(sent),
                Err(e) => tracing::debug!(target: "stunner", "send failed: {e}"),
            },
            Send::Relay(relay, peer, payload, cluster) => {
                match send_now(&relay, &buf[payload], peer).await {
                    Ok(sent) => {
                        if let Some(cluster) = cluster {
                            shard.borrow_mut().counters.clusters.traffic[cluster].tx(sent);
                        }
                    }
                    Err(e) => tracing::debug!(target: "stunner", "send failed: {e}"),
                }
            }
        }
    }
}

/// Sends with one direct non-blocking syscall, falling back to an io_uring send (which waits
/// for room) only when the socket buffer is full.
async fn send_now(socket: &UdpSocket, data: &[u8], to: SocketAddr) -> std::io::Result<usize> {
    match try_send_to(socket.as_raw_fd(), data, to)? {
        Some(sent) => Ok(sent),
        None => socket.send_to(data, to).await.map_err(std::io::Error::from),
    }
}

fn handle_client_datagram(
    s: &mut Shard,
    shard: &ShardRef,
    id: ListenerId,
    from: SocketAddr,
    data: &[u8],
    out: &mut [u8],
) -> Send {
    let now = Instant::now();
    let Shard {
        engine,
        cache,
        listeners,
        relays,
        counters,
        index,
        ..
    } = s;
    let snap: &Snapshot = cache.load();
    let Some(listener) = listeners.iter().find(|l| l.id == id) else {
        return Send::Nothing;
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
    let send = match action {
        ClientAction::Drop(_) => Send::Nothing,
        ClientAction::Reply(n) => Send::Reply(n),
        ClientAction::Relay {
            relay,
            peer,
            payload,
            cluster,
        } => match relays.get(relay.0 as usize).and_then(|r| r.as_ref()) {
            Some(slot) => {
                counters.relayed_to_peer += 1;
                let cluster = counters.cluster(snap, cluster);
                Send::Relay(slot.socket.clone(), peer, payload, cluster)
            }
            None => Send::Nothing,
        },
        ClientAction::AllocateRelay(request) => {
            let bound = relay_socket(&request).map(|(socket, port)| {
                // SAFETY: the fd comes from a socket we just created and hand over.
                (
                    Rc::new(unsafe { UdpSocket::from_raw_fd(socket.into_raw_fd()) }),
                    port,
                )
            });
            let port = match bound {
                Ok((socket, port)) => {
                    let slot = request.relay.0 as usize;
                    if relays.len() <= slot {
                        relays.resize_with(slot + 1, || None);
                    }
                    let task =
                        spawn_local(relay_loop(shard.clone(), request.relay, socket.clone()));
                    relays[slot] = Some(RelaySlot {
                        socket,
                        _task: task,
                    });
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
            match reply {
                Some(n) => Send::Reply(n),
                None => Send::Nothing,
            }
        }
    };
    close_relays(s);
    send
}

async fn relay_loop(shard: ShardRef, relay: RelayId, socket: Rc<UdpSocket>) {
    let mut buf = vec![0u8; BUFFER];
    let mut out = vec![0u8; BUFFER];
    loop {
        let (len, peer) = match socket.recv_from(&mut buf[PEER_HEADROOM..]).await {
            Ok(received) => received,
            Err(_) => continue,
        };
        if len >= MAX_DATAGRAM {
            continue;
        }
        let send = {
            let mut guard = shard.borrow_mut();
            let s = &mut *guard;
            let snap: &Snapshot = s.cache.load();
            match s.engine.handle_peer(
                Instant::now(),
                snap,
                relay,
                peer,
                &mut buf[..PEER_HEADROOM + len],
                &mut out,
            ) {
                PeerAction::Drop(_) => None,
                PeerAction::ToClient {
                    listener,
                    client,
                    bytes,
                    cluster,
                    payload_len,
                } => {
                    if let Some(slot) = s.counters.cluster(snap, cluster) {
                        s.counters.clusters.traffic[slot].rx(payload_len);
                    }
                    s.listeners
                        .iter()
                        .find(|l| l.id == listener)
                        .and_then(|l| {
                            l.sockets
                                .first()
                                .map(|socket| (socket.clone(), l.local_addr, l.metric))
                        })
                        .map(|(socket, local, metric)| {
                            s.counters.relayed_to_client += 1;
                            (socket, local, metric, client, bytes)
                        })
                }
            }
        };
        let Some((listener_socket, local, metric, client, bytes)) = send else {
            continue;
        };
        let data = match bytes {
            Bytes::Input(range) => &buf[range],
            Bytes::Output(n) => &out[..n],
        };
        match send_now(&listener_socket, data, for_socket(local, client)).await {
            Ok(sent) => shard.borrow_mut().counters.listeners.traffic[metric].tx(sent),
            Err(e) => tracing::debug!(target: "stunner", "send to client failed: {e}"),
        }
    }
}

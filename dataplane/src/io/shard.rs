//! One shard's logic, whichever IO engine drives it: the listener and relay sockets it owns,
//! the allocations made on them and a shard-local [`Engine`]. The engine ([`super::uring`] or
//! [`super::epoll`]) only waits: it tells the shard which socket is readable
//! ([`Shard::readable`]), when to flush queued sends ([`Shard::flush`]) and when to tick
//! ([`Shard::tick`]). The shard moves datagrams with batched, non-blocking syscalls
//! (`recvmmsg`, `sendto`, `sendmmsg`) into buffers allocated once.
//!
//! TURN-TCP and TURN-TLS listeners accept on a SO_REUSEPORT socket per shard; each connection
//! is a [`Conn`] with bounded buffers, read when readable and written when the shard flushes
//! (or, when the client is slow, whenever the socket can take more). TURN-DTLS runs sessions
//! per client address over UDP listener sockets ([`dtls`]). Whatever the transport, the relay
//! side is UDP and the same [`Engine`] decides.

use super::admission::{Refused, StreamAdmission};
use super::batch::{Datagram, RecvBatch, SendQueue, BATCH, MAX_UDP_PAYLOAD};
use super::dtls;
use super::groups::Take;
use super::metrics::{Named, ShardReport};
use super::socket::{
    canonical, for_socket, listener_socket, prepare_stream, relay_socket, stream_listener_socket,
    try_send_to,
};
use super::stream::{set_notsent_lowat, stream_len, Closed, Conn, UNAUTHENTICATED_NOTSENT};
use super::tls::MaterialError;
use super::{tls, ShardStats};
use crate::proto::{
    Bytes, ClientAction, DropReason, Engine, EngineConfig, ListenerId, ListenerRef, PeerAction,
    RelayId, PEER_HEADROOM,
};
use arc_swap::{ArcSwap, Cache};
use foldhash::fast::RandomState;
use rustls::{ServerConfig, ServerConnection};
use socket2::Socket;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_shared::config::ListenerProtocol;
use uturn_shared::snapshot::{ClusterId, ListenerSpec, Snapshot};

/// Client datagrams of this size or more are dropped as possibly truncated (as stunnerd).
/// Peer datagrams and stream frames are relayed whole up to the UDP maximum.
const MAX_DATAGRAM: usize = 1600;
/// Scratch for replies and Data indications: room for the largest UDP payload and the
/// indication's header and attributes around it.
const BUFFER: usize = MAX_UDP_PAYLOAD + 256;
/// How often a shard picks up a new snapshot, expires allocations and publishes counters.
pub(super) const TICK: Duration = Duration::from_millis(100);
/// Batches one readable socket may take before the shard serves the others.
const ROUNDS: usize = 4;
/// Connections one readable stream listener may accept before the shard serves the others.
const ACCEPTS: usize = 64;
/// DTLS sessions one shard holds at most (a new client beyond it is ignored until some end).
const MAX_DTLS_SESSIONS: usize = 16 << 10;
/// How often connections and DTLS sessions are checked for handshake and idle timeouts.
const SWEEP: Duration = Duration::from_secs(1);
/// A TCP/TLS connection or DTLS session with no allocation is closed after this long without
/// a byte from its client, so that silent connections cannot hold descriptors for ever.
const IDLE_WITHOUT_ALLOCATION: Duration = Duration::from_secs(30);
/// Scratch for stream reads and DTLS plaintext.
const SCRATCH: usize = 64 << 10;

pub(super) struct ShardSetup {
    pub index: usize,
    pub shards: usize,
    pub udp_thread_num: usize,
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    pub engine: EngineConfig,
    pub stop: Arc<AtomicBool>,
    pub stats: Arc<Vec<ShardStats>>,
    /// Datagram listener sockets, opened for all shards by the first to need them.
    pub groups: Arc<super::groups::ListenerGroups>,
    /// Places for unauthenticated TCP/TLS connections, shared by all shards.
    pub admission: Arc<StreamAdmission>,
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
    /// A TCP/TLS connection: its slot and the slot's generation.
    Conn(u32, u16),
}

impl Token {
    const LISTENER: u64 = 1 << 63;
    const CONN: u64 = 1 << 62;

    /// A number to register with a poller.
    pub fn to_u64(self) -> u64 {
        match self {
            Token::Listener(id, n) => Token::LISTENER | (u64::from(id.0) << 16) | u64::from(n),
            Token::Relay(id) => u64::from(id.0),
            Token::Conn(slot, generation) => {
                Token::CONN | (u64::from(generation) << 32) | u64::from(slot)
            }
        }
    }

    /// The token [`Token::to_u64`] made `raw` from.
    pub fn from_u64(raw: u64) -> Token {
        if raw & Token::LISTENER != 0 {
            Token::Listener(ListenerId((raw >> 16) as u32), raw as u16)
        } else if raw & Token::CONN != 0 {
            Token::Conn(raw as u32, (raw >> 32) as u16)
        } else {
            Token::Relay(RelayId(raw as u32))
        }
    }
}

/// What a watched socket is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Interest {
    /// A UDP socket: report it when datagrams wait.
    Datagrams,
    /// A listening TCP socket: hand accepted connections to [`Shard::accepted`] (io_uring) or
    /// report it readable so the shard accepts (epoll).
    Accept,
    /// A TCP connection: report it when bytes (or end of stream) wait, and when writable
    /// while [`Driver::want_writable`] asks.
    Stream,
}

/// What an IO engine provides: readiness reports for the sockets a shard opens.
pub(super) trait Driver {
    /// Keeps a watched socket reported. Dropping it stops the reports and closes the socket,
    /// except for streams on io_uring, whose fd lives until its task sees the shutdown the
    /// shard issues on close.
    type Watch;

    /// Starts reporting `socket` as `token` (it is non-blocking). Returns its fd, valid for as
    /// long as the returned watch lives.
    fn watch(
        &self,
        socket: Socket,
        token: Token,
        interest: Interest,
    ) -> io::Result<(RawFd, Self::Watch)>;

    /// Asks for (`on`) or stops asking for reports that stream `token` can take more bytes:
    /// the shard then calls [`Shard::readable`], which writes what is queued.
    fn want_writable(&self, fd: RawFd, token: Token, on: bool);
}

/// Whether a readable socket was emptied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Readiness {
    /// The socket had nothing more.
    Drained,
    /// The shard stopped after [`ROUNDS`] full batches; more is probably waiting.
    More,
    /// The socket is gone (a stream closed): stop watching it.
    Closed,
}

/// A UDP listener socket being drained, looked up once per readiness report rather than per
/// datagram.
#[derive(Clone, Copy)]
struct DatagramSocket {
    id: ListenerId,
    fd: RawFd,
    /// Listener counter slot.
    metric: usize,
    local: SocketAddr,
    /// TURN-DTLS: datagrams are records of per-client sessions.
    dtls: bool,
}

/// What a listener speaks, with its per-listener state.
enum Kind {
    Udp,
    Dtls {
        gate: dtls::Gate,
        sessions: HashMap<SocketAddr, dtls::Session, RandomState>,
    },
    Tcp,
    Tls(Arc<ServerConfig>),
}

impl Kind {
    fn is_stream(&self) -> bool {
        matches!(self, Kind::Tcp | Kind::Tls(_))
    }

    /// The client transport, for logs.
    fn transport(&self) -> &'static str {
        match self {
            Kind::Udp => "UDP",
            Kind::Dtls { .. } => "DTLS",
            Kind::Tcp => "TCP",
            Kind::Tls(_) => "TLS",
        }
    }
}

struct RunningListener<W> {
    id: ListenerId,
    /// Slot of this listener's name in the shard's listener counters.
    metric: usize,
    spec: ListenerSpec,
    /// The address every socket of this listener is bound to (all share it via SO_REUSEPORT).
    local_addr: SocketAddr,
    sockets: Vec<(RawFd, W)>,
    kind: Kind,
    /// Open TCP/TLS connections accepted on it (this shard).
    conns: u64,
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
    /// Input dropped before the engine saw it, counted as malformed: datagrams too big to be
    /// whole, stream bytes that are not TURN frames, DTLS sessions that did not start with a
    /// handshake record (or found the shard's session table full).
    unparsed: u64,
    /// Datagrams the kernel would not take (full socket buffer or an error).
    send_failed: u64,
    /// TCP/TLS connections closed at accept, by [`Refused`] (per address, total).
    refused_connections: [u64; 2],
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

/// The snapshot a shard serves packets under.
struct Serving {
    cache: Cache<Arc<ArcSwap<Snapshot>>, Arc<Snapshot>>,
    /// The snapshot the shard's listeners were last reconciled to (on a tick).
    reconciled: Arc<Snapshot>,
    /// A newer snapshot's generation, and whether it runs the same listeners.
    newer: Option<(u64, bool)>,
}

impl Serving {
    /// The newest snapshot if it runs the listeners this shard runs, so that new endpoints,
    /// credentials and quotas apply at once; else the reconciled one until the next tick. A
    /// listener about to restart must not serve under the snapshot of its next run: it would
    /// accept, say, the credentials of a new realm, and the allocations made with them would
    /// end with the restart a moment later.
    fn current(&mut self) -> &Snapshot {
        let Serving {
            cache,
            reconciled,
            newer,
        } = self;
        let latest: &Snapshot = cache.load();
        if latest.generation != reconciled.generation {
            let same = match *newer {
                Some((generation, same)) if generation == latest.generation => same,
                _ => {
                    let same = latest.listeners == reconciled.listeners;
                    *newer = Some((latest.generation, same));
                    same
                }
            };
            if !same {
                return reconciled;
            }
        }
        latest
    }
}

pub(super) struct Shard<D: Driver> {
    index: usize,
    engine: Engine,
    serving: Serving,
    generation: Option<u64>,
    listeners: Vec<RunningListener<D::Watch>>,
    relays: Vec<Option<RelaySlot<D::Watch>>>,
    next_listener_id: u32,
    counters: Counters,
    driver: D,
    /// Taken while a batch is handled (so the shard can be borrowed alongside it): one for
    /// listener sockets, one with room for the largest datagrams for relay sockets.
    batch: Option<Box<RecvBatch>>,
    relay_batch: Option<Box<RecvBatch>>,
    out: Box<[u8]>,
    /// Relayed client datagrams, tagged with their cluster's counter slot (or [`NO_SLOT`]):
    /// a run of datagrams for one relay socket (a video frame, say) leaves in one `sendmmsg`.
    to_peers: SendQueue,
    /// Datagrams for clients, tagged with their listener's counter slot.
    to_clients: SendQueue,
    /// TCP/TLS connections by slot, the generation of every slot ever used, free slots.
    conns: Vec<Option<Conn<D::Watch>>>,
    conn_generations: Vec<u16>,
    free_conns: Vec<u32>,
    conn_by_client: HashMap<(ListenerId, SocketAddr), u32, RandomState>,
    /// Connections with bytes queued since the last flush.
    dirty_conns: Vec<u32>,
    /// Taken while a stream read or a DTLS datagram is handled.
    scratch: Option<Box<[u8]>>,
    next_sweep: Instant,
    /// A descriptor held in reserve: out of descriptors, it is let go for a moment to accept
    /// and close a waiting connection, so the listener does not stay readable (epoll).
    spare_fd: Option<std::os::fd::OwnedFd>,
    /// Warnings about exhausted resources (descriptors, ports), which a client can cause.
    resource_log: crate::proto::ratelimit::LogLimiter,
    admission: Arc<StreamAdmission>,
}

/// The tag of a relayed datagram whose cluster has no counter slot.
const NO_SLOT: usize = usize::MAX;

impl<D: Driver> Shard<D> {
    pub fn new(setup: &ShardSetup, driver: D) -> Shard<D> {
        Shard {
            index: setup.index,
            engine: Engine::new(setup.engine.clone()),
            serving: Serving {
                cache: Cache::new(setup.snapshot.clone()),
                reconciled: setup.snapshot.load_full(),
                newer: None,
            },
            generation: None,
            listeners: Vec::new(),
            relays: Vec::new(),
            next_listener_id: 0,
            counters: Counters::default(),
            driver,
            batch: Some(Box::new(RecvBatch::new(PEER_HEADROOM))),
            relay_batch: Some(Box::new(RecvBatch::with_room(
                PEER_HEADROOM,
                MAX_UDP_PAYLOAD,
            ))),
            out: vec![0u8; BUFFER].into_boxed_slice(),
            to_peers: SendQueue::new(),
            to_clients: SendQueue::new(),
            conns: Vec::new(),
            conn_generations: Vec::new(),
            free_conns: Vec::new(),
            conn_by_client: HashMap::with_hasher(RandomState::default()),
            dirty_conns: Vec::new(),
            scratch: Some(vec![0u8; SCRATCH].into_boxed_slice()),
            next_sweep: Instant::now() + SWEEP,
            spare_fd: spare_fd(),
            resource_log: Default::default(),
            admission: setup.admission.clone(),
        }
    }

    /// Picks up a new snapshot (opening and closing listeners), expires what is due and
    /// publishes the counters.
    pub fn tick(&mut self, setup: &ShardSetup) {
        let now = Instant::now();
        let snap = self.serving.cache.load().clone();
        if self.generation != Some(snap.generation) {
            // A listener that must wait for another run's sockets to close is tried again on
            // the next tick.
            let complete = self.reconcile_listeners(&snap, setup);
            self.generation = complete.then_some(snap.generation);
            self.serving.reconciled = snap;
        }
        if self.engine.poll_timeout().is_some_and(|t| t <= now) {
            self.engine.handle_timeout(now);
            self.close_relays();
        }
        if now >= self.next_sweep {
            self.next_sweep = now + SWEEP;
            self.sweep(now);
        }
        self.publish(&setup.stats[self.index]);
    }

    /// Closes every socket.
    pub fn shutdown(&mut self, stats: &ShardStats) {
        for slot in 0..self.conns.len() {
            self.close_conn(slot as u32, None);
        }
        self.listeners.clear();
        self.relays.clear();
        stats.allocations.store(0, Ordering::Relaxed);
    }

    /// Ends TLS handshakes that took too long, and connections and DTLS sessions that
    /// stalled or went quiet without an allocation.
    fn sweep(&mut self, now: Instant) {
        let engine = &self.engine;
        let late: Vec<(u32, Closed)> = self
            .conns
            .iter()
            .enumerate()
            .filter_map(|(slot, c)| {
                let c = c.as_ref()?;
                let why = if c.handshake_deadline.is_some_and(|d| d <= now) {
                    Closed::Tls
                } else if c.auth_deadline.is_some_and(|d| d <= now)
                    && !engine.has_allocation(c.listener, c.client)
                {
                    Closed::Unauthenticated
                } else if now.saturating_duration_since(c.last_rx) >= IDLE_WITHOUT_ALLOCATION
                    && !engine.has_allocation(c.listener, c.client)
                {
                    Closed::Idle
                } else {
                    return None;
                };
                Some((slot as u32, why))
            })
            .collect();
        for (slot, why) in late {
            self.close_conn(slot, Some(why));
        }
        let engine = &mut self.engine;
        for listener in &mut self.listeners {
            let Kind::Dtls { sessions, .. } = &mut listener.kind else {
                continue;
            };
            let id = listener.id;
            sessions.retain(|client, session| {
                let stalled = session.handshake_deadline.is_some_and(|d| d <= now);
                let idle = now.saturating_duration_since(session.last_rx)
                    >= IDLE_WITHOUT_ALLOCATION
                    && !engine.has_allocation(id, *client);
                if stalled || idle {
                    engine.close_client(id, *client);
                }
                !(stalled || idle)
            });
        }
        self.close_relays();
    }

    /// Receives and handles what waits on the socket behind `token`, up to [`ROUNDS`] batches.
    pub fn readable(&mut self, token: Token) -> Readiness {
        if let Token::Relay(relay) = token {
            let Some(mut batch) = self.relay_batch.take() else {
                return Readiness::Drained;
            };
            let readiness = self.relay_readable(&mut batch, relay);
            self.relay_batch = Some(batch);
            return readiness;
        }
        let Some(mut batch) = self.batch.take() else {
            return Readiness::Drained;
        };
        let readiness = match token {
            Token::Listener(id, n) => {
                let stream = self
                    .listeners
                    .iter()
                    .find(|l| l.id == id)
                    .map(|l| l.kind.is_stream());
                match stream {
                    None => Readiness::Drained,
                    Some(true) => self.accept_ready(id, usize::from(n)),
                    Some(false) => self.listener_readable(&mut batch, id, usize::from(n)),
                }
            }
            Token::Relay(_) => Readiness::Drained,
            Token::Conn(slot, generation) => self.conn_ready(slot, generation),
        };
        self.batch = Some(batch);
        readiness
    }

    /// Whether stream `token` still has bytes queued (io_uring polls for writability with it).
    pub fn write_pending(&self, token: Token) -> bool {
        let Token::Conn(slot, generation) = token else {
            return false;
        };
        self.conns
            .get(slot as usize)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.generation == generation && c.pending() > 0)
    }

    /// Sends every queued datagram and writes what connections have queued.
    pub fn flush(&mut self) {
        self.flush_peers();
        if !self.to_clients.is_empty() {
            let counters = &mut self.counters;
            self.to_clients
                .flush(&mut |metric, outcome| counters.sent_to_client(metric, outcome));
        }
        while let Some(slot) = self.dirty_conns.pop() {
            self.flush_conn(slot);
        }
    }

    /// Writes what connection `slot` has queued; asks to hear when it can take the rest.
    fn flush_conn(&mut self, slot: u32) {
        let Some(conn) = self.conns.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        conn.dirty = false;
        let token = Token::Conn(slot, conn.generation);
        match conn.flush() {
            Ok(true) if conn.want_write => {
                conn.want_write = false;
                self.driver.want_writable(conn.fd, token, false);
            }
            Ok(true) => {}
            Ok(false) if !conn.want_write => {
                conn.want_write = true;
                self.driver.want_writable(conn.fd, token, true);
            }
            Ok(false) => {}
            Err(why) => self.close_conn(slot, Some(why)),
        }
    }

    /// Queues `bytes` (one frame) for connection `slot`. `false` if it is too far behind.
    fn queue_to_conn(
        conns: &mut [Option<Conn<D::Watch>>],
        dirty: &mut Vec<u32>,
        slot: u32,
        bytes: &[u8],
    ) -> bool {
        let Some(conn) = conns.get_mut(slot as usize).and_then(Option::as_mut) else {
            return false;
        };
        if !conn.queue(bytes, stream_len(bytes)) {
            return false;
        }
        if !conn.dirty {
            conn.dirty = true;
            dirty.push(slot);
        }
        true
    }

    /// Accepts what waits on stream listener `id`'s socket `n` (epoll; io_uring accepts
    /// itself and calls [`Shard::accepted`]).
    fn accept_ready(&mut self, id: ListenerId, n: usize) -> Readiness {
        let Some(fd) = self
            .listeners
            .iter()
            .find(|l| l.id == id)
            .and_then(|l| l.sockets.get(n).map(|s| s.0))
        else {
            return Readiness::Drained;
        };
        for _ in 0..ACCEPTS {
            // SAFETY: plain syscall on an open listening socket; no address is asked for.
            let accepted = unsafe {
                libc::accept4(
                    fd,
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
                )
            };
            if accepted < 0 {
                let error = io::Error::last_os_error();
                match error.kind() {
                    io::ErrorKind::WouldBlock => return Readiness::Drained,
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => continue,
                    _ => {
                        if self.accept_failed(fd, &error) {
                            continue;
                        }
                        return Readiness::Drained;
                    }
                }
            }
            // SAFETY: accept4 returned a new fd that nothing else owns.
            let socket = unsafe { <Socket as std::os::fd::FromRawFd>::from_raw_fd(accepted) };
            self.accepted(id, socket);
        }
        Readiness::More
    }

    /// An accept on `listener_fd` failed with `error`: logs it (rate-limited) and, out of
    /// descriptors, refuses one waiting connection. True if one was refused (accept again).
    pub fn accept_failed(&mut self, listener_fd: RawFd, error: &io::Error) -> bool {
        let refused = matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
            && self.refuse_one(listener_fd);
        if let Some(suppressed) = self.resource_log.allow(Instant::now()) {
            let what = if refused { ", connection refused" } else { "" };
            tracing::warn!(target: "stunner", "accept failed: {error}{what}{suppressed}");
        }
        refused
    }

    /// Out of descriptors: accepts one waiting connection on the spare descriptor and closes
    /// it at once, so that the level-triggered listener does not wake the shard in a loop
    /// and the client learns at once. False if there is no spare to use.
    fn refuse_one(&mut self, listener_fd: RawFd) -> bool {
        if self.spare_fd.take().is_none() {
            self.spare_fd = spare_fd();
            return false;
        }
        // SAFETY: plain syscall on an open listening socket; the result is closed at once.
        let accepted = unsafe {
            libc::accept4(
                listener_fd,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_CLOEXEC,
            )
        };
        if accepted >= 0 {
            // SAFETY: a new fd that nothing else owns.
            unsafe { libc::close(accepted) };
        }
        self.spare_fd = spare_fd();
        accepted >= 0
    }

    /// Takes a connection accepted on stream listener `id`.
    pub fn accepted(&mut self, id: ListenerId, socket: Socket) {
        let Some(client) = socket
            .peer_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(canonical)
        else {
            return;
        };
        let Some(listener) = self.listeners.iter_mut().find(|l| l.id == id) else {
            return;
        };
        // Closing the socket at once (dropping it) tells the client, and keeps the listener's
        // backlog moving.
        let place = match self.admission.enter(client.ip()) {
            Ok(place) => place,
            Err(why) => {
                self.counters.refused_connections[why as usize] += 1;
                if let Some(suppressed) = self.resource_log.allow(Instant::now()) {
                    tracing::warn!(target: "stunner", "connection from {client} refused: {}{suppressed}", match why {
                        Refused::PerIp => "too many unauthenticated connections from its address (--max-unauthenticated-connections-per-ip)",
                        Refused::Total => "too many unauthenticated connections (--max-unauthenticated-connections)",
                    });
                }
                return;
            }
        };
        let tls = match &listener.kind {
            Kind::Tls(config) => match ServerConnection::new(config.clone()) {
                Ok(tls) => Some(Box::new(tls)),
                Err(e) => {
                    tracing::warn!(target: "stunner", "TLS session setup failed: {e}");
                    self.admission.leave(place);
                    return;
                }
            },
            _ => None,
        };
        if let Err(e) = prepare_stream(&socket) {
            tracing::debug!(target: "stunner", "cannot use connection from {client}: {e}");
            self.admission.leave(place);
            return;
        }
        set_notsent_lowat(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            UNAUTHENTICATED_NOTSENT,
        );
        let slot = self.free_conns.pop().unwrap_or_else(|| {
            self.conns.push(None);
            self.conn_generations.push(0);
            (self.conns.len() - 1) as u32
        });
        let generation = self.conn_generations[slot as usize].wrapping_add(1);
        self.conn_generations[slot as usize] = generation;
        let watched = self
            .driver
            .watch(socket, Token::Conn(slot, generation), Interest::Stream);
        let (fd, watch) = match watched {
            Ok(watched) => watched,
            Err(e) => {
                tracing::warn!(target: "stunner", "cannot watch connection from {client}: {e}");
                self.free_conns.push(slot);
                self.admission.leave(place);
                return;
            }
        };
        listener.conns += 1;
        self.counters.listeners.opened[listener.metric] += 1;
        let mut conn = Conn::new(fd, watch, generation, id, listener.metric, client, tls);
        conn.admission = Some(place);
        self.conns[slot as usize] = Some(conn);
        // A client reconnecting from the same address replaces its old connection.
        if let Some(old) = self.conn_by_client.insert((id, client), slot) {
            if old != slot {
                self.close_conn(old, None);
                self.conn_by_client.insert((id, client), slot);
            }
        }
        tracing::debug!(target: "stunner", "{} connection from {client} on listener {:?}, shard {}",
            if self.conns[slot as usize].as_ref().is_some_and(|c| c.handshake_deadline.is_some()) { "TLS" } else { "TCP" },
            self.listeners.iter().find(|l| l.id == id).map_or("", |l| l.spec.name.as_str()),
            self.index);
    }

    /// Connection `slot` is readable (or writable): writes what is queued, then reads and
    /// handles every complete frame.
    fn conn_ready(&mut self, slot: u32, generation: u16) -> Readiness {
        let Some(conn) = self
            .conns
            .get_mut(slot as usize)
            .and_then(Option::as_mut)
            .filter(|c| c.generation == generation)
        else {
            return Readiness::Closed;
        };
        if conn.pending() > 0 {
            self.flush_conn(slot);
        }
        let Some(mut scratch) = self.scratch.take() else {
            return Readiness::Drained;
        };
        let outcome = self.conn_read(slot, &mut scratch);
        self.scratch = Some(scratch);
        self.flush_peers();
        self.close_relays();
        match outcome {
            Ok(()) => Readiness::Drained,
            Err(why) => {
                self.close_conn(slot, Some(why));
                Readiness::Closed
            }
        }
    }

    fn conn_read(&mut self, slot: u32, scratch: &mut [u8]) -> Result<(), Closed> {
        let Some(conn) = self.conns.get_mut(slot as usize).and_then(Option::as_mut) else {
            return Err(Closed::Error);
        };
        let now = Instant::now();
        let read = conn.read(scratch);
        if read.as_ref().is_ok_and(|&n| n > 0) {
            conn.last_rx = now;
        }
        let (id, client, metric) = (conn.listener, conn.client, conn.metric);
        let mut rx = conn.take_rx();
        // Frames that arrived before an end of stream are still handled.
        let mut outcome = read.map(drop);
        loop {
            let range = match rx.next_frame() {
                Ok(Some(range)) => range,
                Ok(None) => break,
                Err(why) => {
                    self.counters.unparsed += 1;
                    outcome = Err(why);
                    break;
                }
            };
            let frame = &rx.bytes()[range];
            self.counters.listener_rx_packets += 1;
            self.counters.listeners.traffic[metric].rx(frame.len());
            if let Some(n) = self.dispatch_turn_message(now, id, client, frame) {
                if Self::queue_to_conn(&mut self.conns, &mut self.dirty_conns, slot, &self.out[..n])
                {
                    self.counters.listeners.traffic[metric].tx(n);
                } else {
                    self.counters.send_failed += 1;
                }
            }
        }
        if let Some(conn) = self.conns.get_mut(slot as usize).and_then(Option::as_mut) {
            conn.restore_rx(rx);
            if !conn.is_authenticated() && self.engine.has_allocation(id, client) {
                if let Some(place) = conn.authenticated() {
                    self.admission.leave(place);
                }
            }
            // TLS handshake records (or an alert) to send.
            if conn.pending() > 0 && !conn.dirty {
                conn.dirty = true;
                self.dirty_conns.push(slot);
            }
        }
        outcome
    }

    /// Closes connection `slot` and frees its allocation (`why`: logged when given).
    fn close_conn(&mut self, slot: u32, why: Option<Closed>) {
        let Some(mut conn) = self.conns.get_mut(slot as usize).and_then(Option::take) else {
            return;
        };
        if let Some(place) = conn.admission.take() {
            self.admission.leave(place);
        }
        if self.conn_by_client.get(&(conn.listener, conn.client)) == Some(&slot) {
            self.conn_by_client.remove(&(conn.listener, conn.client));
        }
        self.engine.close_client(conn.listener, conn.client);
        self.close_relays();
        if let Some(listener) = self.listeners.iter_mut().find(|l| l.id == conn.listener) {
            listener.conns = listener.conns.saturating_sub(1);
        }
        if let Some(why) = why {
            tracing::debug!(target: "stunner", "connection from {} closed: {why:?}", conn.client);
        }
        // Wakes an io_uring watcher (which then closes the fd); epoll's watch closes it on drop.
        // SAFETY: the fd is open until the watch is dropped below.
        unsafe { libc::shutdown(conn.fd, libc::SHUT_RDWR) };
        self.free_conns.push(slot);
        drop(conn);
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
        let Some(socket) = self.listeners.iter().find(|l| l.id == id).and_then(|l| {
            l.sockets.get(n).map(|s| DatagramSocket {
                id,
                fd: s.0,
                metric: l.metric,
                local: l.local_addr,
                dtls: matches!(l.kind, Kind::Dtls { .. }),
            })
        }) else {
            return Readiness::Drained;
        };
        self.drain(socket.fd, batch, |shard, now, datagram| {
            shard.client_datagram(now, socket, datagram)
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

    fn client_datagram(&mut self, now: Instant, socket: DatagramSocket, datagram: Datagram<'_>) {
        let DatagramSocket {
            id,
            fd,
            metric,
            local,
            dtls,
        } = socket;
        self.counters.listener_rx_packets += 1;
        self.counters.listeners.traffic[metric].rx(datagram.len);
        let Some(from) = datagram.from.map(canonical) else {
            return;
        };
        if datagram.truncated || datagram.len >= MAX_DATAGRAM {
            self.counters.unparsed += 1;
            return;
        }
        let data = &datagram.buf[PEER_HEADROOM..PEER_HEADROOM + datagram.len];
        if dtls {
            self.dtls_datagram(now, id, fd, metric, local, from, data);
            return;
        }
        if let Some(n) = self.dispatch_turn_message(now, id, from, data) {
            let outcome = try_send_to(fd, &self.out[..n], for_socket(local, from));
            if let Some(sent) = self.counters.sent(outcome) {
                self.counters.listeners.traffic[metric].tx(sent);
            }
        }
    }

    /// A datagram from `from` on DTLS listener `id`: handshake records go to (or start) its
    /// session; decrypted TURN messages go to the engine and their replies back encrypted.
    #[allow(clippy::too_many_arguments)]
    fn dtls_datagram(
        &mut self,
        now: Instant,
        id: ListenerId,
        fd: RawFd,
        metric: usize,
        local: SocketAddr,
        from: SocketAddr,
        data: &[u8],
    ) {
        let Some(listener) = self.listeners.iter_mut().find(|l| l.id == id) else {
            return;
        };
        let Kind::Dtls { gate, sessions } = &mut listener.kind else {
            return;
        };
        // The session leaves the map while it is used, so the shard can be borrowed beside it.
        let (mut session, datagram) = match sessions.remove(&from) {
            Some(session) => (session, data),
            // Only a handshake record (content type 22) may start a session.
            None if data.first() != Some(&22) || sessions.len() >= MAX_DTLS_SESSIONS => {
                self.counters.unparsed += 1;
                return;
            }
            // RFC 6347 §4.2.1: a session only for a ClientHello that echoes our cookie; the
            // HelloVerifyRequest is smaller than the ClientHello, so no amplification either.
            None => {
                let counters = &mut self.counters;
                let admission = gate.admit(now, from, data, |datagram| {
                    let outcome = try_send_to(fd, datagram, for_socket(local, from));
                    if let Some(n) = counters.sent(outcome) {
                        counters.listeners.traffic[metric].tx(n);
                    }
                });
                match admission {
                    dtls::Admission::Session(session) => {
                        counters.listeners.opened[metric] += 1;
                        // OpenSSL holds the ClientHello: go on with no new datagram.
                        (session, &[][..])
                    }
                    dtls::Admission::Nothing => return,
                }
            }
        };
        let Some(mut scratch) = self.scratch.take() else {
            return;
        };
        let received = session.receive(now, datagram, &mut scratch, |session, message| {
            if let Some(n) = self.dispatch_turn_message(now, id, from, message) {
                if !session.send(&self.out[..n]) {
                    self.counters.send_failed += 1;
                }
            }
        });
        self.scratch = Some(scratch);
        let counters = &mut self.counters;
        session.drain(|datagram| {
            let outcome = try_send_to(fd, datagram, for_socket(local, from));
            if let Some(n) = counters.sent(outcome) {
                counters.listeners.traffic[metric].tx(n);
            }
        });
        match received {
            Ok(()) => {
                if let Some(Kind::Dtls { sessions, .. }) = self
                    .listeners
                    .iter_mut()
                    .find(|l| l.id == id)
                    .map(|l| &mut l.kind)
                {
                    sessions.insert(from, session);
                }
            }
            Err(why) => {
                tracing::debug!(target: "stunner", "DTLS session of {from} ended: {why:?}");
                self.engine.close_client(id, from);
                self.close_relays();
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
        let Shard {
            engine,
            serving,
            listeners,
            relays,
            counters,
            driver,
            out,
            index,
            to_peers,
            resource_log,
            ..
        } = self;
        let snap: &Snapshot = serving.current();
        let listener = listeners.iter().find(|l| l.id == id)?;
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
        match action {
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
                    let (fd, watch) =
                        driver.watch(socket, Token::Relay(request.relay), Interest::Datagrams)?;
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
                        if let Some(suppressed) = resource_log.allow(now) {
                            tracing::warn!(target: "stunner", "cannot allocate relay socket: {e}{suppressed}");
                        }
                        Err(crate::proto::RelayBindError::from(&e))
                    }
                };
                let reply = engine.complete_allocate(now, request.relay, port, out);
                if let (Some(_), Ok(port)) = (reply, port) {
                    tracing::debug!(
                        target: "stunner",
                        "Allocation created: client={}-{}:{}, listener={}, relay-address={}:{}, shard={}",
                        from,
                        listener.spec.port,
                        listener.kind.transport(),
                        listener.spec.name,
                        listener.spec.advertised_ip,
                        port,
                        index
                    );
                }
                reply
            }
        }
    }

    fn peer_datagram(&mut self, now: Instant, relay: RelayId, datagram: Datagram<'_>) {
        let Shard {
            engine,
            serving,
            listeners,
            counters,
            out,
            to_clients,
            conns,
            conn_by_client,
            dirty_conns,
            ..
        } = self;
        let Some(peer) = datagram.from else {
            return;
        };
        if datagram.truncated {
            counters.unparsed += 1;
            return;
        }
        let snap: &Snapshot = serving.current();
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
        let Some(running) = listeners.iter_mut().find(|l| l.id == listener) else {
            return;
        };
        let Some((fd, local, metric)) = running
            .sockets
            .first()
            .map(|s| (s.0, running.local_addr, running.metric))
        else {
            return;
        };
        counters.relayed_to_client += 1;
        let data = match bytes {
            Bytes::Input(range) => &buf[range],
            Bytes::Output(n) => &out[..n],
        };
        match &mut running.kind {
            Kind::Udp => to_clients.push(
                fd,
                data,
                for_socket(local, client),
                metric,
                &mut |metric, outcome| counters.sent_to_client(metric, outcome),
            ),
            Kind::Dtls { sessions, .. } => {
                let Some(session) = sessions.get_mut(&client) else {
                    counters.send_failed += 1;
                    return;
                };
                if !session.send(data) {
                    counters.send_failed += 1;
                }
                session.drain(|datagram| {
                    let outcome = try_send_to(fd, datagram, for_socket(local, client));
                    if let Some(n) = counters.sent(outcome) {
                        counters.listeners.traffic[metric].tx(n);
                    }
                });
            }
            Kind::Tcp | Kind::Tls(_) => {
                let queued = conn_by_client
                    .get(&(listener, client))
                    .is_some_and(|&slot| Self::queue_to_conn(conns, dirty_conns, slot, data));
                if queued {
                    counters.listeners.traffic[metric].tx(data.len());
                } else {
                    counters.send_failed += 1;
                }
            }
        }
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
            quota_refused: engine.quota_refusals,
            send_failed: self.counters.send_failed,
            refused_connections: self.counters.refused_connections,
            stream_buffer_bytes: self
                .conns
                .iter()
                .flatten()
                .map(|c| c.buffered() as u64)
                .sum(),
            unauthenticated_connections: self
                .conns
                .iter()
                .flatten()
                .filter(|c| !c.is_authenticated())
                .count() as u64,
        };
        report.dropped[DropReason::Malformed.index()] += self.counters.unparsed;
        for open in report.listeners.open.iter_mut() {
            *open = 0;
        }
        for l in &self.listeners {
            // stunnerd counts a UDP socket, a TCP/TLS connection and a DTLS session alike.
            report.listeners.open[l.metric] += match &l.kind {
                Kind::Udp => l.sockets.len() as u64,
                Kind::Dtls { sessions, .. } => sessions.len() as u64,
                Kind::Tcp | Kind::Tls(_) => l.conns,
            };
        }
        if let Ok(mut published) = stats.report.lock() {
            *published = report;
        }
    }

    /// Opens listeners the snapshot adds and closes those it removes (or changes in a way
    /// that needs a restart); unchanged listeners and their allocations are left alone.
    /// `false` if a listener could not open yet (an older run's sockets on its port are still
    /// open on another shard).
    fn reconcile_listeners(&mut self, snap: &Snapshot, setup: &ShardSetup) -> bool {
        setup.groups.reconciling(setup.index, snap);
        let mut complete = true;
        let desired: Vec<&ListenerSpec> = snap
            .listeners
            .iter()
            .filter(|l| {
                matches!(
                    l.protocol,
                    ListenerProtocol::TurnUdp
                        | ListenerProtocol::TurnTcp
                        | ListenerProtocol::TurnTls
                        | ListenerProtocol::TurnDtls
                )
            })
            .collect();
        let removed: Vec<(ListenerId, ListenerSpec, bool)> = self
            .listeners
            .iter()
            .filter(|running| !desired.iter().any(|d| **d == running.spec))
            .map(|running| (running.id, running.spec.clone(), running.kind.is_stream()))
            .collect();
        for (id, spec, stream) in removed {
            let conns: Vec<u32> = self
                .conns
                .iter()
                .enumerate()
                .filter(|(_, c)| c.as_ref().is_some_and(|c| c.listener == id))
                .map(|(slot, _)| slot as u32)
                .collect();
            for slot in conns {
                self.close_conn(slot, None);
            }
            self.engine.close_listener(id);
            self.close_relays();
            self.listeners.retain(|l| l.id != id);
            if !stream {
                setup.groups.released(setup.index, &spec);
            }
            tracing::info!(
                target: "stunner",
                "listener {:?} closed on shard {}",
                spec.name,
                self.index
            );
        }
        let datagram_sockets =
            listener_sockets_on_shard(setup.udp_thread_num, setup.shards, setup.index);
        for spec in desired {
            if self.listeners.iter().any(|l| l.spec == *spec) {
                continue;
            }
            let kind = match listener_kind(spec) {
                Ok(kind) => kind,
                Err(why) => {
                    tracing::error!(
                        target: "stunner",
                        "cannot open listener {:?} ({}): {why}",
                        spec.name,
                        spec.protocol.as_str()
                    );
                    continue;
                }
            };
            // Every shard accepts on its own stream socket; datagram sockets follow
            // --udp-thread-num.
            let (count, interest) = if kind.is_stream() {
                (1, Interest::Accept)
            } else {
                (datagram_sockets, Interest::Datagrams)
            };
            if count == 0 {
                continue;
            }
            let opened = if kind.is_stream() {
                vec![stream_listener_socket(spec.port)]
            } else {
                // Every shard's sockets at once, so the SO_REUSEPORT group is whole before a
                // client is hashed over it (see `groups`).
                match setup.groups.take(
                    setup.index,
                    spec,
                    |shard| listener_sockets_on_shard(setup.udp_thread_num, setup.shards, shard),
                    || listener_socket(spec.port),
                ) {
                    Take::Sockets(opened) => opened,
                    Take::Wait => {
                        complete = false;
                        continue;
                    }
                    Take::Over => continue,
                }
            };
            if opened.is_empty() {
                continue;
            }
            self.next_listener_id += 1;
            let id = ListenerId(self.next_listener_id);
            let mut sockets = Vec::new();
            let mut local_addr = None;
            for (n, socket) in opened.into_iter().enumerate() {
                let opened = socket.and_then(|socket| {
                    let local = socket.local_addr()?.as_socket();
                    let watched =
                        self.driver
                            .watch(socket, Token::Listener(id, n as u16), interest)?;
                    Ok((local, watched))
                });
                match opened {
                    Ok((local, watched)) => {
                        local_addr = local_addr.or(local);
                        sockets.push(watched);
                    }
                    Err(e) => tracing::error!(
                        target: "stunner",
                        "cannot open listener {:?} on {} port {}: {e}",
                        spec.name,
                        if kind.is_stream() { "TCP" } else { "UDP" },
                        spec.port
                    ),
                }
            }
            let Some(local_addr) = local_addr else {
                // Not one socket could be watched: this shard holds none of the group.
                if !kind.is_stream() {
                    setup.groups.released(setup.index, spec);
                }
                continue;
            };
            let metric = self.counters.listeners.slot(&spec.name);
            tracing::info!(
                target: "stunner",
                "listener {:?} ({}, port {}, relay address {}) serving on shard {} with {} socket(s)",
                spec.name,
                spec.protocol.as_str(),
                spec.port,
                spec.advertised_ip,
                setup.index,
                sockets.len()
            );
            if !kind.is_stream() {
                self.counters.listeners.opened[metric] += sockets.len() as u64;
            }
            self.listeners.push(RunningListener {
                id,
                metric,
                spec: spec.clone(),
                local_addr,
                sockets,
                kind,
                conns: 0,
            });
        }
        complete
    }
}

/// A descriptor to hold in reserve (`/dev/null`), if one can be had.
fn spare_fd() -> Option<std::os::fd::OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(Into::into)
}

/// What a listener spec needs to run: for TLS and DTLS, the context built from its
/// certificate and key, as [`super::check`] builds it before the config is applied.
fn listener_kind(spec: &ListenerSpec) -> Result<Kind, MaterialError> {
    let (cert, key) = (&spec.tls.cert, &spec.tls.key);
    Ok(match spec.protocol {
        ListenerProtocol::TurnTcp => Kind::Tcp,
        ListenerProtocol::TurnTls => Kind::Tls(tls::server_config_from_base64(cert, key)?),
        ListenerProtocol::TurnDtls => Kind::Dtls {
            gate: dtls::gate_from_base64(cert, key)?,
            sessions: HashMap::with_hasher(RandomState::default()),
        },
        _ => Kind::Udp,
    })
}

//! A shard's TCP/TLS connections: a table of slots (a slot's generation tells a stale
//! readiness report from a current one), the index by client, the connections with bytes to
//! flush, and the admission of new ones (the caps on unauthenticated connections, and a
//! spare descriptor to refuse one with when the process runs out).

use super::counters::Counters;
use super::listeners::{ListenerTransport, RunningListener};
use crate::io::admission::{Refused, StreamAdmission};
use crate::io::driver::{Driver, Interest, Readiness, Token};
use crate::io::socket::{canonical, prepare_stream};
use crate::io::stream::{set_notsent_lowat, stream_len, Closed, Conn, Rx, UNAUTHENTICATED_NOTSENT};
use crate::io::sys;
use crate::proto::ratelimit::LogLimiter;
use crate::proto::{Engine, ListenerId};
use foldhash::fast::RandomState;
use rustls::ServerConnection;
use socket2::Socket;
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{OwnedFd, RawFd};
use std::sync::Arc;
use std::time::Instant;

/// Connections one readable stream listener may accept before the shard serves the others.
const ACCEPTS: usize = 64;

/// What [`ConnTable::accept`] did.
pub(super) struct Accepted {
    /// Whether connections may still wait.
    pub readiness: Readiness,
    /// Older connections the new ones replace (the same client on the same listener), for the
    /// shard to close with their allocations.
    pub replaced: Vec<u32>,
}

/// The TCP/TLS connections of a shard.
pub(super) struct ConnTable<W> {
    /// Connections by slot.
    slots: Vec<Option<Conn<W>>>,
    /// The generation of every slot ever used.
    generations: Vec<u16>,
    free: Vec<u32>,
    by_client: HashMap<(ListenerId, SocketAddr), u32, RandomState>,
    /// Connections with bytes queued since the last flush.
    dirty: Vec<u32>,
    /// Places for unauthenticated connections, shared by all shards.
    admission: Arc<StreamAdmission>,
    /// A descriptor held in reserve: out of descriptors, it is let go for a moment to accept
    /// and close a waiting connection, so the listener does not stay readable (epoll).
    spare_fd: Option<OwnedFd>,
}

/// What a read from a connection gave, for the shard to handle frame by frame.
pub(super) struct ConnRead {
    pub listener: ListenerId,
    pub client: SocketAddr,
    /// Listener counter slot.
    pub metric: usize,
    /// The connection's received plaintext, lent out (give it back with
    /// [`ConnTable::finish_read`]).
    pub rx: Rx,
    /// How the read ended; frames that arrived before an end of stream are still handled.
    pub outcome: Result<(), Closed>,
}

impl<W> ConnTable<W> {
    /// No connections.
    pub(super) fn new(admission: Arc<StreamAdmission>) -> ConnTable<W> {
        ConnTable {
            slots: Vec::new(),
            generations: Vec::new(),
            free: Vec::new(),
            by_client: HashMap::with_hasher(RandomState::default()),
            dirty: Vec::new(),
            admission,
            spare_fd: spare_fd(),
        }
    }

    fn get_mut(&mut self, slot: u32) -> Option<&mut Conn<W>> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// Accepts what waits on socket `n` of stream listener `listener`, up to [`ACCEPTS`]
    /// connections, and admits each ([`ConnTable::admit`]); out of descriptors, refuses
    /// waiting ones ([`ConnTable::accept_failed`]).
    pub(super) fn accept<D: Driver<Watch = W>>(
        &mut self,
        listener: &RunningListener<W>,
        n: usize,
        driver: &D,
        counters: &mut Counters,
        resource_log: &mut LogLimiter,
        shard: usize,
    ) -> Accepted {
        let mut replaced = Vec::new();
        let Some(fd) = listener.socket_fd(n) else {
            return Accepted {
                readiness: Readiness::Drained,
                replaced,
            };
        };
        for _ in 0..ACCEPTS {
            let socket = match sys::accept(fd) {
                Ok(socket) => socket,
                Err(error) => match error.kind() {
                    io::ErrorKind::WouldBlock => {
                        return Accepted {
                            readiness: Readiness::Drained,
                            replaced,
                        }
                    }
                    io::ErrorKind::Interrupted | io::ErrorKind::ConnectionAborted => continue,
                    _ => {
                        if self.accept_failed(fd, &error, resource_log) {
                            continue;
                        }
                        return Accepted {
                            readiness: Readiness::Drained,
                            replaced,
                        };
                    }
                },
            };
            let admitted = self.admit(socket, listener, driver, counters, resource_log, shard);
            replaced.extend(admitted);
        }
        Accepted {
            readiness: Readiness::More,
            replaced,
        }
    }

    /// Takes connection `socket`, accepted on `listener`, unless a cap refuses it (then it is
    /// closed at once, which tells the client and keeps the listener's backlog moving). Returns
    /// the slot of an older connection from the same client on that listener, which the new
    /// one replaces and the shard must close.
    fn admit<D: Driver<Watch = W>>(
        &mut self,
        socket: Socket,
        listener: &RunningListener<W>,
        driver: &D,
        counters: &mut Counters,
        resource_log: &mut LogLimiter,
        shard: usize,
    ) -> Option<u32> {
        let client = socket
            .peer_addr()
            .ok()
            .and_then(|a| a.as_socket())
            .map(canonical)?;
        let place = match self.admission.enter(client.ip()) {
            Ok(place) => place,
            Err(why) => {
                counters.refused_connections[why as usize] += 1;
                if let Some(suppressed) = resource_log.allow(Instant::now()) {
                    tracing::warn!(target: "stunner", "connection from {client} refused: {}{suppressed}", match why {
                        Refused::PerIp => "too many unauthenticated connections from its address (--max-unauthenticated-connections-per-ip)",
                        Refused::Total => "too many unauthenticated connections (--max-unauthenticated-connections)",
                    });
                }
                return None;
            }
        };
        let tls = match &listener.transport {
            ListenerTransport::Tls(config) => match ServerConnection::new(config.clone()) {
                Ok(tls) => Some(Box::new(tls)),
                Err(e) => {
                    tracing::warn!(target: "stunner", "TLS session setup failed: {e}");
                    self.admission.leave(place);
                    return None;
                }
            },
            _ => None,
        };
        if let Err(e) = prepare_stream(&socket) {
            tracing::debug!(target: "stunner", "cannot use connection from {client}: {e}");
            self.admission.leave(place);
            return None;
        }
        set_notsent_lowat(
            std::os::fd::AsRawFd::as_raw_fd(&socket),
            UNAUTHENTICATED_NOTSENT,
        );
        let slot = self.free.pop().unwrap_or_else(|| {
            self.slots.push(None);
            self.generations.push(0);
            (self.slots.len() - 1) as u32
        });
        let generation = self.generations[slot as usize].wrapping_add(1);
        self.generations[slot as usize] = generation;
        let watched = driver.watch(socket, Token::Conn { slot, generation }, Interest::Stream);
        let watched = match watched {
            Ok(watched) => watched,
            Err(e) => {
                tracing::warn!(target: "stunner", "cannot watch connection from {client}: {e}");
                self.free.push(slot);
                self.admission.leave(place);
                return None;
            }
        };
        counters.listeners.opened[listener.metric] += 1;
        let mut conn = Conn::new(
            watched,
            generation,
            listener.id,
            listener.metric,
            client,
            tls,
        );
        conn.admission = Some(place);
        let kind = if conn.handshake_deadline.is_some() {
            "TLS"
        } else {
            "TCP"
        };
        self.slots[slot as usize] = Some(conn);
        tracing::debug!(target: "stunner", "{kind} connection from {client} on listener {:?}, shard {shard}",
            listener.spec.name.as_str());
        // A client reconnecting from the same address replaces its old connection.
        self.by_client
            .insert((listener.id, client), slot)
            .filter(|&old| old != slot)
    }

    /// An accept on `listener_fd` failed with `error`: logs it (rate-limited) and, out of
    /// descriptors, refuses one waiting connection. True if one was refused (accept again).
    fn accept_failed(
        &mut self,
        listener_fd: RawFd,
        error: &io::Error,
        resource_log: &mut LogLimiter,
    ) -> bool {
        let refused = matches!(error.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
            && self.refuse_one(listener_fd);
        if let Some(suppressed) = resource_log.allow(Instant::now()) {
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
        let refused = sys::accept_and_close(listener_fd);
        self.spare_fd = spare_fd();
        refused
    }

    /// Whether `slot` holds the connection of `generation`.
    pub(super) fn is_current(&self, slot: u32, generation: u16) -> bool {
        self.slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .is_some_and(|c| c.generation == generation)
    }

    /// Bytes connection `slot` has queued.
    pub(super) fn pending(&self, slot: u32) -> usize {
        self.slots
            .get(slot as usize)
            .and_then(Option::as_ref)
            .map_or(0, Conn::pending)
    }

    /// Reads what connection `slot` has (see [`Conn::read`]); `None` if the slot is empty.
    pub(super) fn read(&mut self, slot: u32, scratch: &mut [u8], now: Instant) -> Option<ConnRead> {
        let conn = self.get_mut(slot)?;
        let read = conn.read(scratch);
        if read.as_ref().is_ok_and(|&n| n > 0) {
            conn.last_rx = now;
        }
        Some(ConnRead {
            listener: conn.listener,
            client: conn.client,
            metric: conn.metric,
            rx: conn.take_rx(),
            outcome: read.map(drop),
        })
    }

    /// Gives connection `slot` back the buffer [`ConnTable::read`] lent; the client is
    /// authenticated once `engine` holds an allocation for it.
    pub(super) fn finish_read(&mut self, slot: u32, rx: Rx, engine: &Engine) {
        let Some(conn) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return;
        };
        conn.restore_rx(rx);
        if !conn.is_authenticated() && engine.has_allocation(conn.listener, conn.client) {
            if let Some(place) = conn.authenticated() {
                self.admission.leave(place);
            }
        }
        // TLS handshake records (or an alert) to send.
        if conn.pending() > 0 && !conn.dirty {
            conn.dirty = true;
            self.dirty.push(slot);
        }
    }

    /// Queues `bytes` (one frame) for connection `slot`. `false` if it is too far behind.
    pub(super) fn queue(&mut self, slot: u32, bytes: &[u8]) -> bool {
        let Some(conn) = self.slots.get_mut(slot as usize).and_then(Option::as_mut) else {
            return false;
        };
        if !conn.queue(bytes, stream_len(bytes)) {
            return false;
        }
        if !conn.dirty {
            conn.dirty = true;
            self.dirty.push(slot);
        }
        true
    }

    /// Queues `bytes` (one frame) for the connection of `client` on `listener`. `false` if
    /// there is none, or it is too far behind.
    pub(super) fn queue_to_client(
        &mut self,
        listener: ListenerId,
        client: SocketAddr,
        bytes: &[u8],
    ) -> bool {
        match self.by_client.get(&(listener, client)) {
            Some(&slot) => self.queue(slot, bytes),
            None => false,
        }
    }

    /// The next connection with bytes queued since the last flush.
    pub(super) fn pop_dirty(&mut self) -> Option<u32> {
        self.dirty.pop()
    }

    /// Writes what connection `slot` has queued; asks `driver` to report when it can take
    /// the rest. `Err` if the connection failed (the shard closes it).
    pub(super) fn flush<D: Driver<Watch = W>>(
        &mut self,
        slot: u32,
        driver: &D,
    ) -> Result<(), Closed> {
        let Some(conn) = self.get_mut(slot) else {
            return Ok(());
        };
        conn.dirty = false;
        let token = Token::Conn {
            slot,
            generation: conn.generation,
        };
        match conn.flush()? {
            true if conn.want_write => {
                conn.want_write = false;
                driver.want_writable(conn.fd, token, false);
            }
            false if !conn.want_write => {
                conn.want_write = true;
                driver.want_writable(conn.fd, token, true);
            }
            _ => {}
        }
        Ok(())
    }

    /// Closes connection `slot` (`why`: logged when given); the listener and client whose
    /// allocation the shard must now end.
    pub(super) fn close(
        &mut self,
        slot: u32,
        why: Option<Closed>,
    ) -> Option<(ListenerId, SocketAddr)> {
        let mut conn = self.slots.get_mut(slot as usize).and_then(Option::take)?;
        if let Some(place) = conn.admission.take() {
            self.admission.leave(place);
        }
        let key = (conn.listener, conn.client);
        if self.by_client.get(&key) == Some(&slot) {
            self.by_client.remove(&key);
        }
        if let Some(why) = why {
            tracing::debug!(target: "stunner", "connection from {} closed: {why:?}", conn.client);
        }
        // The peer sees the end at once; dropping the watch closes the fd.
        sys::shutdown(conn.fd);
        self.free.push(slot);
        drop(conn);
        Some(key)
    }

    /// Every slot, to close them all.
    pub(super) fn slots(&self) -> std::ops::Range<u32> {
        0..self.slots.len() as u32
    }

    /// The connections accepted on `listener`.
    pub(super) fn of_listener(&self, listener: ListenerId) -> Vec<u32> {
        self.slots
            .iter()
            .enumerate()
            .filter(|(_, c)| c.as_ref().is_some_and(|c| c.listener == listener))
            .map(|(slot, _)| slot as u32)
            .collect()
    }

    /// The connections to close now, and why: TLS handshakes that took too long, and
    /// connections that stalled or went quiet without an allocation.
    pub(super) fn late(&self, now: Instant, engine: &Engine) -> Vec<(u32, Closed)> {
        self.slots
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
                } else if now.saturating_duration_since(c.last_rx) >= super::IDLE_WITHOUT_ALLOCATION
                    && !engine.has_allocation(c.listener, c.client)
                {
                    Closed::Idle
                } else {
                    return None;
                };
                Some((slot as u32, why))
            })
            .collect()
    }

    /// Adds one at each connection's listener counter slot.
    pub(super) fn count_open(&self, open: &mut [u64]) {
        for conn in self.slots.iter().flatten() {
            open[conn.metric] += 1;
        }
    }

    /// Bytes of memory the connections' buffers hold.
    pub(super) fn buffered_bytes(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .map(|c| c.buffered() as u64)
            .sum()
    }

    /// Connections whose client holds no allocation yet.
    pub(super) fn unauthenticated(&self) -> u64 {
        self.slots
            .iter()
            .flatten()
            .filter(|c| !c.is_authenticated())
            .count() as u64
    }
}

/// A descriptor to hold in reserve (`/dev/null`), if one can be had.
fn spare_fd() -> Option<OwnedFd> {
    std::fs::File::open("/dev/null").ok().map(Into::into)
}

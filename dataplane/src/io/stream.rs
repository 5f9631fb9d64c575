//! One TURN-TCP or TURN-TLS connection as a shard holds it: bounded receive and send buffers,
//! RFC 8656 §12.5 framing, and (for TLS) a rustls server session driven without blocking.
//! Nothing here waits: a read takes what the socket has, a write leaves the rest queued, and a
//! client that stops reading only fills its own bounded queue.

use rustls::ServerConnection;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::ops::Range;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};
use uturn_shared::framing::{frame_len, padded, FrameError, MAX_FRAME};

use super::driver::Watched;
use super::sys;
use super::tls::HANDSHAKE_TIMEOUT;
use crate::proto::ListenerId;

/// Bytes read from the socket per `recv`.
const READ_CHUNK: usize = 16 << 10;
/// `recv`s per readiness report, so one busy connection cannot hold the shard.
const READ_ROUNDS: usize = 8;
/// Bytes queued for one client (after TLS) beyond which datagrams for it are dropped.
pub(super) const SEND_LIMIT: usize = 256 << 10;
/// The same for a client that has not authenticated yet (no allocation): room for a few
/// challenges, so that a client that pipelines requests and never reads holds little.
pub(super) const UNAUTHENTICATED_SEND_LIMIT: usize = 4 << 10;
/// What TLS adds to one frame at most: a frame of up to [`MAX_FRAME`] bytes spans five
/// 16 KiB records, each with a header, a tag and padding well under 64 bytes.
const TLS_OVERHEAD: usize = 5 * 64;
/// The send buffer's capacity never exceeds this: the limit, plus one frame over it (the one
/// that found room), plus what TLS adds, plus handshake records.
pub(super) const SEND_CAPACITY: usize = SEND_LIMIT + MAX_FRAME + TLS_OVERHEAD + (16 << 10);
/// A send buffer that empties keeps at most this much capacity, so a burst does not hold
/// memory for the connection's whole life.
const IDLE_CAPACITY: usize = 16 << 10;

/// Why a connection ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Closed {
    /// The client closed it.
    Eof,
    /// A socket error.
    Error,
    /// Bytes that are not STUN or ChannelData.
    Framing(FrameError),
    /// The TLS session failed (bad record, refused version, ...).
    Tls,
    /// No allocation, and nothing from the client for a while.
    Idle,
    /// No allocation within [`AUTHENTICATION_DEADLINE`] of the accept.
    Unauthenticated,
}

/// A TCP/TLS client must hold an allocation this long after its connection was accepted, or
/// the connection closes: whatever it sends meanwhile (Bindings, refused Allocates) does not
/// extend it, so an unauthenticated connection holds its place for a bounded time.
pub(super) const AUTHENTICATION_DEADLINE: Duration = Duration::from_secs(30);

pub(super) struct Conn<W> {
    pub fd: RawFd,
    _watch: W,
    /// Bumped each time the slot is reused, so a stale readiness report is ignored.
    pub generation: u16,
    pub listener: ListenerId,
    /// Listener counter slot.
    pub metric: usize,
    pub client: SocketAddr,
    tls: Option<Box<ServerConnection>>,
    /// Plaintext received and not yet handled.
    rx: Rx,
    /// Bytes for the socket (ciphertext for TLS); `tx[tx_start..]` is pending, `tx[..tx_start]`
    /// is sent and reclaimed once it is at least as long as what is pending (so each byte is
    /// moved at most once), and `tx`'s capacity stays within [`SEND_CAPACITY`].
    tx: Vec<u8>,
    tx_start: usize,
    /// Pending bytes beyond which frames for this client are dropped: small until the client
    /// holds an allocation ([`Conn::authenticated`]).
    send_limit: usize,
    /// Until when the TLS handshake may run.
    pub handshake_deadline: Option<Instant>,
    /// When the client last sent bytes.
    pub last_rx: Instant,
    /// Until when the client must have authenticated (held an allocation); `None` once it has.
    pub auth_deadline: Option<Instant>,
    /// The place this connection holds among the unauthenticated ones, until it authenticates.
    pub admission: Option<super::admission::Place>,
    /// Whether the shard has it on its list of connections to flush.
    pub dirty: bool,
    /// Whether the IO backend was asked to report it writable.
    pub want_write: bool,
}

impl<W> Conn<W> {
    pub(super) fn new(
        watched: Watched<W>,
        generation: u16,
        listener: ListenerId,
        metric: usize,
        client: SocketAddr,
        tls: Option<Box<ServerConnection>>,
    ) -> Conn<W> {
        let now = Instant::now();
        Conn {
            fd: watched.fd,
            _watch: watched.watch,
            generation,
            listener,
            metric,
            client,
            handshake_deadline: tls.as_ref().map(|_| now + HANDSHAKE_TIMEOUT),
            last_rx: now,
            auth_deadline: Some(now + AUTHENTICATION_DEADLINE),
            admission: None,
            tls,
            rx: Rx::default(),
            tx: Vec::new(),
            tx_start: 0,
            send_limit: UNAUTHENTICATED_SEND_LIMIT,
            dirty: false,
            want_write: false,
        }
    }

    /// Reads what the socket has (at most [`READ_ROUNDS`] chunks, and never more than one
    /// frame's worth of unhandled plaintext), decrypting TLS. `Ok(n)`: bytes read from the
    /// socket; call [`Rx::next_frame`] until it gives `None`, then read again if `n` was
    /// large.
    pub(super) fn read(&mut self, scratch: &mut [u8]) -> Result<usize, Closed> {
        let mut total = 0;
        for _ in 0..READ_ROUNDS {
            if self.rx.pending() >= MAX_FRAME {
                break;
            }
            let chunk = READ_CHUNK.min(scratch.len());
            let n = recv(self.fd, &mut scratch[..chunk])?;
            let Some(n) = n else { break };
            if n == 0 {
                return Err(Closed::Eof);
            }
            total += n;
            match self.tls.as_deref_mut() {
                None => self.rx.buf.extend_from_slice(&scratch[..n]),
                Some(tls) => {
                    let mut input = &scratch[..n];
                    while !input.is_empty() {
                        tls.read_tls(&mut input).map_err(|_| Closed::Tls)?;
                        let state = tls.process_new_packets();
                        // Whatever rustls wants to say (an alert, handshake records) goes out
                        // even when the session failed.
                        if !drain_tls(tls, &mut self.tx, &mut self.tx_start) {
                            // The client makes us write (handshakes, key updates) without
                            // reading what we wrote.
                            return Err(Closed::Tls);
                        }
                        if let Err(e) = state {
                            tracing::debug!(target: "stunner", "TLS session of {} failed: {e}", self.client);
                            let _ = self.flush();
                            return Err(Closed::Tls);
                        }
                        read_plaintext(tls, &mut self.rx.buf)?;
                    }
                    if !tls.is_handshaking() {
                        self.handshake_deadline = None;
                    }
                }
            }
            if n < READ_CHUNK {
                break;
            }
        }
        Ok(total)
    }

    /// The receive buffer, to take the frames out of while the shard handles them (give it
    /// back with [`Conn::restore_rx`]).
    pub(super) fn take_rx(&mut self) -> Rx {
        std::mem::take(&mut self.rx)
    }

    /// Puts back the buffer [`Conn::take_rx`] lent. An unauthenticated client's buffer is
    /// given back to the allocator once it is empty: thousands of such connections then hold
    /// nothing but their place in the table.
    pub(super) fn restore_rx(&mut self, mut rx: Rx) {
        if rx.pending() == 0 && !self.is_authenticated() {
            rx = Rx::default();
        }
        self.rx = rx;
    }

    /// Queues one frame for the client, `bytes` followed by zeros up to `padded_len`. `false`
    /// (nothing queued) when the client is too far behind.
    pub(super) fn queue(&mut self, bytes: &[u8], padded_len: usize) -> bool {
        if self.pending() + padded_len > self.send_limit {
            return false;
        }
        let pad = padded_len.saturating_sub(bytes.len());
        match self.tls.as_deref_mut() {
            None => {
                make_room(&mut self.tx, &mut self.tx_start, padded_len);
                self.tx.extend_from_slice(bytes);
                self.tx.extend(std::iter::repeat_n(0u8, pad));
            }
            Some(tls) => {
                let mut writer = tls.writer();
                if writer.write_all(bytes).is_err() || writer.write_all(&[0u8; 3][..pad]).is_err() {
                    return false;
                }
                if !drain_tls(tls, &mut self.tx, &mut self.tx_start) {
                    return false;
                }
            }
        }
        true
    }

    /// Writes what is queued. `Ok(true)` when nothing is left.
    pub(super) fn flush(&mut self) -> Result<bool, Closed> {
        while self.tx_start < self.tx.len() {
            match send(self.fd, &self.tx[self.tx_start..])? {
                Some(n) => self.tx_start += n,
                None => return Ok(false),
            }
        }
        self.tx.clear();
        self.tx_start = 0;
        if !self.is_authenticated() {
            self.tx = Vec::new();
        } else if self.tx.capacity() > IDLE_CAPACITY {
            self.tx.shrink_to(IDLE_CAPACITY);
        }
        Ok(true)
    }

    /// The client holds an allocation: from now on it may have up to [`SEND_LIMIT`] queued,
    /// and the kernel's send queue is no longer held short. Gives back its admission place.
    pub(super) fn authenticated(&mut self) -> Option<super::admission::Place> {
        self.send_limit = SEND_LIMIT;
        self.auth_deadline = None;
        set_notsent_lowat(self.fd, 0);
        self.admission.take()
    }

    /// Whether the client has held an allocation on this connection.
    pub(super) fn is_authenticated(&self) -> bool {
        self.auth_deadline.is_none()
    }

    /// Bytes of memory the connection's buffers hold (their capacity).
    pub(super) fn buffered(&self) -> usize {
        self.tx.capacity() + self.rx.buf.capacity()
    }

    /// Bytes waiting for the socket.
    pub(super) fn pending(&self) -> usize {
        self.tx.len() - self.tx_start
    }
}

/// Received plaintext: `buf[start..]` is not handled yet.
#[derive(Default)]
pub(super) struct Rx {
    buf: Vec<u8>,
    start: usize,
}

impl Rx {
    fn pending(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next complete frame, as a range of [`Rx::bytes`].
    pub(super) fn next_frame(&mut self) -> Result<Option<Range<usize>>, Closed> {
        let pending = &self.buf[self.start..];
        match frame_len(pending) {
            Err(e) => Err(Closed::Framing(e)),
            Ok(Some(n)) if n <= pending.len() => {
                let range = self.start..self.start + n;
                self.start += n;
                Ok(Some(range))
            }
            Ok(_) => {
                // Keep only the incomplete frame; a buffer a large frame grew is given back.
                self.buf.drain(..self.start);
                self.start = 0;
                if self.buf.is_empty() && self.buf.capacity() > IDLE_CAPACITY {
                    self.buf.shrink_to(IDLE_CAPACITY);
                }
                Ok(None)
            }
        }
    }

    /// What the ranges [`Rx::next_frame`] gives index.
    pub(super) fn bytes(&self) -> &[u8] {
        &self.buf
    }
}

/// Makes room in `tx` for `more` bytes: reclaims the sent prefix once it is at least as long
/// as what is pending (or when the bytes would not fit otherwise), and grows the capacity by
/// doubling, never past [`SEND_CAPACITY`] unless a single frame needs it.
fn make_room(tx: &mut Vec<u8>, tx_start: &mut usize, more: usize) {
    if *tx_start > 0 && (*tx_start >= tx.len() - *tx_start || tx.len() + more > tx.capacity()) {
        tx.drain(..*tx_start);
        *tx_start = 0;
    }
    let needed = tx.len() + more;
    if needed > tx.capacity() {
        let target = (tx.capacity() * 2).clamp(needed, SEND_CAPACITY.max(needed));
        tx.reserve_exact(target - tx.len());
    }
}

/// Moves rustls's outgoing records into `tx`. `false` if that would take `tx` past
/// [`SEND_CAPACITY`] (the records stay with rustls, and the connection should close).
fn drain_tls(tls: &mut ServerConnection, tx: &mut Vec<u8>, tx_start: &mut usize) -> bool {
    while tls.wants_write() {
        // One record at a time, at most a 16 KiB record with its overhead.
        make_room(tx, tx_start, (16 << 10) + 64);
        if tx.len() - *tx_start > SEND_CAPACITY - (16 << 10) - 64 {
            return false;
        }
        if tls.write_tls(&mut TlsSink(tx)).is_err() {
            break;
        }
    }
    true
}

/// Takes one `write_tls` call's records without letting the buffer grow on its own: rustls
/// writes at most what [`make_room`] made room for.
struct TlsSink<'a>(&'a mut Vec<u8>);

impl Write for TlsSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        let room = self.0.capacity() - self.0.len();
        let n = buf.len().min(room);
        if n == 0 && !buf.is_empty() {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.0.extend_from_slice(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Moves decrypted plaintext into `rx`.
fn read_plaintext(tls: &mut ServerConnection, rx: &mut Vec<u8>) -> Result<(), Closed> {
    let mut chunk = [0u8; 4096];
    loop {
        match tls.reader().read(&mut chunk) {
            Ok(0) => return Ok(()),
            Ok(n) => rx.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(()),
            Err(_) => return Err(Closed::Tls),
        }
    }
}

/// Unsent bytes the kernel keeps for an unauthenticated client: a client that never reads
/// cannot make the socket hold more than this beyond what its window took.
pub(super) const UNAUTHENTICATED_NOTSENT: u32 = 4 << 10;

/// Sets `TCP_NOTSENT_LOWAT` on `fd`: sends fail with EAGAIN once `bytes` wait unsent (0: the
/// system default, no limit). Unlike a small `SO_SNDBUF` this can be undone, so an
/// authenticated connection keeps the kernel's buffer autotuning.
pub(super) fn set_notsent_lowat(fd: RawFd, bytes: u32) {
    // Failure only leaves the default.
    let _ = sys::set_int_option(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_NOTSENT_LOWAT,
        bytes as libc::c_int,
    );
}

/// One non-blocking `recv`: `Ok(None)` when nothing is waiting.
fn recv(fd: RawFd, buf: &mut [u8]) -> Result<Option<usize>, Closed> {
    retry(|| sys::recv(fd, buf))
}

/// One non-blocking `send`: `Ok(None)` when the socket buffer is full.
fn send(fd: RawFd, data: &[u8]) -> Result<Option<usize>, Closed> {
    retry(|| sys::send(fd, data))
}

/// Runs `call` again while a signal interrupts it: `Ok(None)` when the socket would block.
fn retry(mut call: impl FnMut() -> io::Result<usize>) -> Result<Option<usize>, Closed> {
    loop {
        match call() {
            Ok(n) => return Ok(Some(n)),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return Err(Closed::Error),
        }
    }
}

/// A frame's length on the wire to a stream client: ChannelData is padded to 4 bytes.
pub(super) fn stream_len(frame: &[u8]) -> usize {
    match frame.first().map(|b| b >> 6) {
        Some(0b01) => padded(frame.len()),
        _ => frame.len(),
    }
}

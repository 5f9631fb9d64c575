//! The client end of the four TURN transports, one connection per flow: a connected UDP
//! socket, a TCP connection, TLS over TCP (rustls) or DTLS over UDP (OpenSSL).
//!
//! [`Connector::connect`] returns a [`Sender`], shared by every thread that writes to the
//! server, and a [`Receiver`], owned by the one thread that reads: call [`Receiver::recv`]
//! (it returns within [`READ_TICK`] when nothing arrives), then take frames with
//! [`Receiver::next_frame`] until it yields `None`. The TLS and DTLS states sit behind a mutex
//! that is held only for the cipher work, never across a blocking read, so the reader does not
//! stall the writers.

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use openssl::ssl::{
    ErrorCode as SslErrorCode, HandshakeError, MidHandshakeSslStream, SslConnector, SslStream,
};
use rustls::pki_types::ServerName;
use rustls::ClientConnection;
use uturn_shared::framing::{frame_len, MAX_FRAME};

use crate::client::roomy;

/// How long a [`Receiver::recv`] waits before returning with nothing, so the flow's timers run.
pub const READ_TICK: Duration = Duration::from_millis(100);
/// How long connecting and the TLS/DTLS handshakes may take.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// The DTLS path MTU: handshake messages are fragmented to fit it.
pub const DTLS_MTU: u32 = 1200;
/// A blocked write to a stream gives up after this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(30);
/// Largest UDP datagram.
const MAX_DATAGRAM: usize = 65_536;

/// The transport to the TURN server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// TURN over UDP.
    Udp,
    /// TURN over TCP.
    Tcp,
    /// TURN over TLS over TCP.
    Tls,
    /// TURN over DTLS over UDP.
    Dtls,
}

impl Protocol {
    /// A byte stream: ChannelData is padded to 4 bytes and frames are split with
    /// [`frame_len`] (RFC 8656 §12.5), and requests are not retransmitted.
    pub fn is_stream(self) -> bool {
        matches!(self, Protocol::Tcp | Protocol::Tls)
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Protocol::Udp => "udp",
            Protocol::Tcp => "tcp",
            Protocol::Tls => "tls",
            Protocol::Dtls => "dtls",
        })
    }
}

/// The security material of a TLS or DTLS connection.
#[derive(Clone)]
pub enum Security {
    /// No encryption (UDP, TCP).
    Plain,
    /// A rustls client config.
    Tls(Arc<rustls::ClientConfig>),
    /// An OpenSSL DTLS connector; `verify` is false with `--insecure`.
    Dtls {
        /// The DTLS context.
        connector: SslConnector,
        /// Whether to verify the certificate and its name.
        verify: bool,
    },
}

/// Opens connections to one TURN server.
#[derive(Clone)]
pub struct Connector {
    /// The transport.
    pub protocol: Protocol,
    /// The server's address.
    pub server: SocketAddr,
    /// The name the server's certificate is checked against (and sent as SNI).
    pub server_name: String,
    /// TLS or DTLS material, matching `protocol`.
    pub security: Security,
}

/// Writes frames to the server; every frame goes out whole, in the order of the calls.
pub enum Sender {
    /// A connected UDP socket: one frame per datagram.
    Udp(UdpSocket),
    /// A TCP connection.
    Tcp(Mutex<TcpStream>),
    /// A TLS connection.
    Tls(Arc<TlsShared>),
    /// A DTLS session: one frame per record.
    Dtls(Arc<Mutex<SslStream<DatagramIo>>>),
}

/// Reads frames from the server.
pub struct Receiver {
    inner: ReceiverInner,
    /// Datagrams (UDP) and DTLS records land here.
    datagram: Vec<u8>,
    /// The length of a datagram not yet handed out by [`Receiver::next_frame`].
    datagram_ready: Option<usize>,
    /// Bytes of a TCP or TLS stream not yet split into frames.
    stream: StreamBuffer,
}

enum ReceiverInner {
    Udp(UdpSocket),
    Tcp(TcpStream),
    Tls {
        tcp: TcpStream,
        shared: Arc<TlsShared>,
        scratch: Vec<u8>,
    },
    Dtls {
        socket: UdpSocket,
        session: Arc<Mutex<SslStream<DatagramIo>>>,
    },
}

/// A rustls connection shared by the reader and the writers. Lock order: `wire`, then
/// `conn`; `conn` is never held across socket IO.
pub struct TlsShared {
    conn: Mutex<ClientConnection>,
    wire: Mutex<TlsWire>,
}

struct TlsWire {
    tcp: TcpStream,
    out: Vec<u8>,
}

/// The datagram side of an OpenSSL DTLS session: each read yields one datagram, each write
/// sends one. During the handshake reads block on the socket; afterwards they yield the one
/// datagram the receiver fed in, then `WouldBlock`.
pub struct DatagramIo {
    socket: UdpSocket,
    inbox: Vec<u8>,
    inbox_full: bool,
    handshaking: bool,
}

/// Locks a mutex, taking over the data if another thread panicked while holding it.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn context(error: io::Error, what: impl fmt::Display) -> io::Error {
    io::Error::new(error.kind(), format!("{what}: {error}"))
}

impl Connector {
    /// Connects (and for TLS/DTLS completes the handshake) within [`CONNECT_TIMEOUT`].
    pub fn connect(&self) -> io::Result<(Arc<Sender>, Receiver)> {
        let server = self.server;
        let (sender, inner) = match (&self.protocol, &self.security) {
            (Protocol::Udp, _) => {
                let socket = udp_connected(server)?;
                let reader = socket.try_clone()?;
                (Sender::Udp(socket), ReceiverInner::Udp(reader))
            }
            (Protocol::Tcp, _) => {
                let tcp = tcp_connected(server)?;
                let reader = tcp.try_clone()?;
                (Sender::Tcp(Mutex::new(tcp)), ReceiverInner::Tcp(reader))
            }
            (Protocol::Tls, Security::Tls(config)) => {
                let shared = Arc::new(self.tls_handshake(config.clone())?);
                let tcp = lock(&shared.wire).tcp.try_clone()?;
                (
                    Sender::Tls(shared.clone()),
                    ReceiverInner::Tls {
                        tcp,
                        shared,
                        scratch: vec![0; 16 * 1024 + 256],
                    },
                )
            }
            (Protocol::Dtls, Security::Dtls { connector, verify }) => {
                let socket = udp_connected(server)?;
                let reader = socket.try_clone()?;
                let session =
                    Arc::new(Mutex::new(self.dtls_handshake(connector, *verify, socket)?));
                (
                    Sender::Dtls(session.clone()),
                    ReceiverInner::Dtls {
                        socket: reader,
                        session,
                    },
                )
            }
            (protocol, _) => {
                return Err(io::Error::other(format!(
                    "no TLS/DTLS configuration for transport {protocol}"
                )))
            }
        };
        let receiver = Receiver {
            inner,
            datagram: vec![0; MAX_DATAGRAM],
            datagram_ready: None,
            stream: StreamBuffer::default(),
        };
        Ok((Arc::new(sender), receiver))
    }

    fn tls_handshake(&self, config: Arc<rustls::ClientConfig>) -> io::Result<TlsShared> {
        let name = ServerName::try_from(self.server_name.clone()).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "--sni {:?}: not a DNS name or IP address ({e}): give the name in the \
                     server's certificate",
                    self.server_name
                ),
            )
        })?;
        let mut conn = ClientConnection::new(config, name)
            .map_err(|e| io::Error::other(format!("TLS setup: {e}")))?;
        let mut tcp = tcp_connected(self.server)?;
        tcp.set_read_timeout(Some(CONNECT_TIMEOUT))?;
        while conn.is_handshaking() {
            conn.complete_io(&mut tcp).map_err(|e| {
                let hint = if e.to_string().contains("certificate") {
                    ": pass -i/--insecure to accept any certificate, or --ca FILE to trust its \
                     issuer"
                } else {
                    ""
                };
                io::Error::new(
                    e.kind(),
                    format!("TLS handshake with {} failed: {e}{hint}", self.server),
                )
            })?;
        }
        tcp.set_read_timeout(Some(READ_TICK))?;
        Ok(TlsShared {
            conn: Mutex::new(conn),
            wire: Mutex::new(TlsWire {
                tcp,
                out: Vec::new(),
            }),
        })
    }

    fn dtls_handshake(
        &self,
        connector: &SslConnector,
        verify: bool,
        socket: UdpSocket,
    ) -> io::Result<SslStream<DatagramIo>> {
        let failed = |why: String| {
            io::Error::other(format!("DTLS handshake with {} failed: {why}", self.server))
        };
        let mut config = connector.configure().map_err(|e| failed(e.to_string()))?;
        if !verify {
            config.set_verify_hostname(false);
            config.set_verify(openssl::ssl::SslVerifyMode::NONE);
        }
        let mut ssl = config
            .into_ssl(&self.server_name)
            .map_err(|e| failed(e.to_string()))?;
        ssl.set_mtu(DTLS_MTU).map_err(|e| failed(e.to_string()))?;
        // Handshake reads block this long, then the handshake is stepped again so OpenSSL can
        // retransmit its flight (RFC 6347 §4.2.4; its first timer is 1 s).
        socket.set_read_timeout(Some(Duration::from_millis(250)))?;
        let io = DatagramIo {
            socket,
            inbox: Vec::with_capacity(MAX_DATAGRAM),
            inbox_full: false,
            handshaking: true,
        };
        let deadline = Instant::now() + CONNECT_TIMEOUT;
        let mut step = ssl.connect(io);
        let mut stream = loop {
            let mid: MidHandshakeSslStream<DatagramIo> = match step {
                Ok(stream) => break stream,
                Err(HandshakeError::WouldBlock(mid)) => mid,
                Err(HandshakeError::Failure(mid)) => {
                    let verify = mid.ssl().verify_result();
                    let hint = if verify.as_raw() != 0 {
                        format!(
                            " (certificate: {}): pass -i/--insecure to accept any \
                             certificate, or --ca FILE to trust its issuer",
                            verify.error_string()
                        )
                    } else {
                        String::new()
                    };
                    return Err(failed(format!("{}{hint}", mid.error())));
                }
                Err(HandshakeError::SetupFailure(e)) => return Err(failed(e.to_string())),
            };
            if Instant::now() >= deadline {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "DTLS handshake with {} timed out after {} s: check the server \
                         address, port and transport",
                        self.server,
                        CONNECT_TIMEOUT.as_secs()
                    ),
                ));
            }
            step = mid.handshake();
        };
        stream.get_mut().handshaking = false;
        stream.get_ref().socket.set_read_timeout(Some(READ_TICK))?;
        Ok(stream)
    }
}

fn udp_connected(server: SocketAddr) -> io::Result<UdpSocket> {
    let local = if server.is_ipv4() {
        "0.0.0.0:0"
    } else {
        "[::]:0"
    };
    let socket = UdpSocket::bind(local)?;
    roomy(&socket);
    socket
        .connect(server)
        .map_err(|e| context(e, format_args!("connect to {server}")))?;
    socket.set_read_timeout(Some(READ_TICK))?;
    Ok(socket)
}

fn tcp_connected(server: SocketAddr) -> io::Result<TcpStream> {
    let tcp = TcpStream::connect_timeout(&server, CONNECT_TIMEOUT)
        .map_err(|e| context(e, format_args!("TCP connect to {server}")))?;
    tcp.set_nodelay(true)?;
    tcp.set_read_timeout(Some(READ_TICK))?;
    tcp.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok(tcp)
}

impl Sender {
    /// Sends one frame (a STUN message or a ChannelData message, padded already over
    /// streams).
    pub fn send(&self, frame: &[u8]) -> io::Result<()> {
        match self {
            Sender::Udp(socket) => socket.send(frame).map(drop),
            Sender::Tcp(tcp) => lock(tcp).write_all(frame),
            Sender::Tls(shared) => shared.send(frame),
            Sender::Dtls(session) => match lock(session).ssl_write(frame) {
                Ok(_) => Ok(()),
                Err(e) => Err(ssl_io_error(e)),
            },
        }
    }
}

impl TlsShared {
    /// Encrypts `frame` (nothing when empty) with whatever rustls wants to send anyway, then
    /// writes it all to the socket.
    fn send(&self, frame: &[u8]) -> io::Result<()> {
        let mut wire = lock(&self.wire);
        let TlsWire { tcp, out } = &mut *wire;
        out.clear();
        {
            let mut conn = lock(&self.conn);
            let mut rest = frame;
            loop {
                let written = if rest.is_empty() {
                    0
                } else {
                    conn.writer().write(rest)?
                };
                rest = &rest[written..];
                while conn.wants_write() {
                    conn.write_tls(out)?;
                }
                if rest.is_empty() {
                    break;
                }
                if written == 0 {
                    return Err(io::Error::new(
                        io::ErrorKind::WriteZero,
                        "the TLS connection accepts no more data",
                    ));
                }
            }
        }
        tcp.write_all(out)
    }
}

fn ssl_io_error(error: openssl::ssl::Error) -> io::Error {
    match error.into_io_error() {
        Ok(io) => io,
        Err(error) => io::Error::other(format!("DTLS: {error}")),
    }
}

impl Read for DatagramIo {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if self.handshaking {
            return self.socket.recv(buf);
        }
        if !self.inbox_full {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.inbox_full = false;
        // A datagram longer than the buffer is cut short, as recv(2) would.
        let n = self.inbox.len().min(buf.len());
        buf[..n].copy_from_slice(&self.inbox[..n]);
        Ok(n)
    }
}

impl Write for DatagramIo {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.socket.send(buf)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Bytes of a stream, split into TURN frames at the front: `bytes[start..end]` is unread.
#[derive(Default)]
struct StreamBuffer {
    bytes: Vec<u8>,
    start: usize,
    end: usize,
}

impl StreamBuffer {
    /// Room for at least `want` more bytes after the unread ones; the unread tail (less than
    /// one frame) moves to the front when the end is near.
    fn space(&mut self, want: usize) -> &mut [u8] {
        if self.start == self.end {
            self.start = 0;
            self.end = 0;
        }
        if self.bytes.len() - self.end < want {
            self.bytes.copy_within(self.start..self.end, 0);
            self.end -= self.start;
            self.start = 0;
            if self.bytes.len() - self.end < want {
                self.bytes.resize(self.end + want.max(MAX_FRAME), 0);
            }
        }
        &mut self.bytes[self.end..]
    }

    /// Marks `filled` bytes of the last [`StreamBuffer::space`] as received.
    fn commit(&mut self, filled: usize) {
        self.end += filled;
    }

    fn next_frame(&mut self) -> io::Result<Option<&[u8]>> {
        let unread = &self.bytes[self.start..self.end];
        match frame_len(unread) {
            Ok(Some(n)) if n <= unread.len() => {
                let frame = &self.bytes[self.start..self.start + n];
                self.start += n;
                Ok(Some(frame))
            }
            Ok(_) => Ok(None),
            Err(e) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("the server sent bytes that are not TURN framing ({e:?})"),
            )),
        }
    }
}

fn timed_out(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut | io::ErrorKind::Interrupted
    )
}

fn closed() -> io::Error {
    io::Error::new(
        io::ErrorKind::UnexpectedEof,
        "the server closed the connection",
    )
}

impl Receiver {
    /// Waits up to [`READ_TICK`] for input; `Ok(false)` when none came. An error means the
    /// connection is unusable.
    pub fn recv(&mut self) -> io::Result<bool> {
        match &mut self.inner {
            ReceiverInner::Udp(socket) => match socket.recv(&mut self.datagram) {
                Ok(n) => {
                    self.datagram_ready = Some(n);
                    Ok(true)
                }
                Err(e) if timed_out(&e) => Ok(false),
                Err(e) => Err(context(e, "receive from the server")),
            },
            ReceiverInner::Tcp(tcp) => match tcp.read(self.stream.space(16 * 1024)) {
                Ok(0) => Err(closed()),
                Ok(n) => {
                    self.stream.commit(n);
                    Ok(true)
                }
                Err(e) if timed_out(&e) => Ok(false),
                Err(e) => Err(context(e, "receive from the server")),
            },
            ReceiverInner::Tls {
                tcp,
                shared,
                scratch,
            } => {
                let n = match tcp.read(scratch) {
                    Ok(0) => return Err(closed()),
                    Ok(n) => n,
                    Err(e) if timed_out(&e) => return Ok(false),
                    Err(e) => return Err(context(e, "receive from the server")),
                };
                let wants_write = {
                    let mut conn = lock(&shared.conn);
                    let mut input = &scratch[..n];
                    while !input.is_empty() {
                        conn.read_tls(&mut input)?;
                        let state = conn
                            .process_new_packets()
                            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
                        let plaintext = state.plaintext_bytes_to_read();
                        if plaintext > 0 {
                            let space = self.stream.space(plaintext);
                            let got = conn.reader().read(&mut space[..plaintext]);
                            self.stream.commit(got.unwrap_or(0));
                        }
                        if state.peer_has_closed() {
                            return Err(closed());
                        }
                    }
                    conn.wants_write()
                };
                if wants_write {
                    shared.send(&[])?;
                }
                Ok(true)
            }
            ReceiverInner::Dtls { socket, session } => match socket.recv(&mut self.datagram) {
                Ok(n) => {
                    let mut session = lock(session);
                    let io = session.get_mut();
                    io.inbox.clear();
                    io.inbox.extend_from_slice(&self.datagram[..n]);
                    io.inbox_full = true;
                    Ok(true)
                }
                Err(e) if timed_out(&e) => Ok(false),
                Err(e) => Err(context(e, "receive from the server")),
            },
        }
    }

    /// The next complete frame received, if any.
    pub fn next_frame(&mut self) -> io::Result<Option<&[u8]>> {
        match &mut self.inner {
            ReceiverInner::Udp(_) => Ok(self.datagram_ready.take().map(|n| &self.datagram[..n])),
            ReceiverInner::Tcp(_) | ReceiverInner::Tls { .. } => self.stream.next_frame(),
            ReceiverInner::Dtls { session, .. } => {
                let mut session = lock(session);
                match session.ssl_read(&mut self.datagram) {
                    Ok(0) => Err(closed()),
                    Ok(n) => Ok(Some(&self.datagram[..n])),
                    Err(e) if e.code() == SslErrorCode::WANT_READ => Ok(None),
                    Err(e) if e.code() == SslErrorCode::ZERO_RETURN => Err(closed()),
                    Err(e) => Err(ssl_io_error(e)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream of a STUN message, padded ChannelData of every length modulo 4, and one
    /// 65535-byte ChannelData, fed in chunks of every size from 1 to 7 and one large one.
    #[test]
    fn stream_bytes_split_into_frames_whatever_the_chunking() {
        let mut stun = vec![0x01, 0x01, 0x00, 0x08, 0x21, 0x12, 0xa4, 0x42];
        stun.extend_from_slice(&[7; 12 + 8]);
        let mut frames = vec![stun];
        for len in [0usize, 1, 2, 3, 4, 5, 65_535] {
            let mut frame = crate::client::channel_data_header(0x4000, len).to_vec();
            frame.extend((0..len).map(|i| i as u8));
            frame.resize(4 + uturn_shared::framing::padded(len), 0);
            frames.push(frame);
        }
        let wire: Vec<u8> = frames.concat();
        for chunk in [1, 2, 3, 4, 5, 6, 7, 16 * 1024] {
            let mut buffer = StreamBuffer::default();
            let mut got = Vec::new();
            for piece in wire.chunks(chunk) {
                let space = buffer.space(piece.len());
                space[..piece.len()].copy_from_slice(piece);
                buffer.commit(piece.len());
                while let Some(frame) = buffer.next_frame().unwrap() {
                    got.push(frame.to_vec());
                }
            }
            assert_eq!(got, frames, "chunks of {chunk}");
            assert!(buffer.bytes.len() <= 2 * MAX_FRAME, "chunks of {chunk}");
        }
    }

    #[test]
    fn bytes_that_are_not_turn_end_the_stream() {
        let mut buffer = StreamBuffer::default();
        buffer.space(4)[..4].copy_from_slice(&[0x80, 0, 0, 0]);
        buffer.commit(4);
        let error = buffer.next_frame().unwrap_err();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
    }
}

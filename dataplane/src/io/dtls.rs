//! TURN-DTLS: DTLS 1.2 sessions over a shard's UDP listener sockets, one per client address,
//! with OpenSSL (the `openssl` crate over the system libssl) driven through memory buffers:
//! the shard moves datagrams with its own batched syscalls, and a session only turns records
//! into TURN messages and back. Nothing here blocks or reads a socket.

use openssl::error::ErrorStack;
use openssl::pkey::PKey;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslMode, SslOptions, SslStream,
    SslVersion,
};
use openssl::x509::X509;
use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// The largest datagram a session writes: fits the common 1280-byte IPv6 minimum MTU with
/// room for headers.
const MTU: u32 = 1200;
/// A DTLS handshake must finish within this.
pub(super) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// A session with no allocation behind it is dropped after this long without a datagram.
pub(super) const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// A DTLS server context for a listener's PEM certificate (chain) and key.
pub(super) fn context(cert_pem: &[u8], key_pem: &[u8]) -> Result<SslContext, String> {
    let build = || -> Result<SslContext, ErrorStack> {
        let mut builder = SslContextBuilder::new(SslMethod::dtls())?;
        builder.set_min_proto_version(Some(SslVersion::DTLS1_2))?;
        let mut chain = X509::stack_from_pem(cert_pem)?.into_iter();
        if let Some(leaf) = chain.next() {
            builder.set_certificate(&leaf)?;
        }
        for extra in chain {
            builder.add_extra_chain_cert(extra)?;
        }
        let key = PKey::private_key_from_pem(key_pem)?;
        builder.set_private_key(&key)?;
        builder.check_private_key()?;
        // The memory transport cannot be asked for the path MTU; MTU is set per session.
        builder.set_options(SslOptions::NO_QUERY_MTU);
        builder.set_mode(SslMode::RELEASE_BUFFERS);
        Ok(builder.build())
    };
    build().map_err(|e| format!("cannot use the DTLS certificate and key: {e}"))
}

/// The transport a session sees: the datagram being handled, and the datagrams it wrote.
#[derive(Default)]
struct Mem {
    incoming: Vec<u8>,
    has_incoming: bool,
    /// Datagrams to send, back to back; `lens` splits them.
    outgoing: Vec<u8>,
    lens: Vec<usize>,
}

impl Read for Mem {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if !self.has_incoming {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        self.has_incoming = false;
        // A datagram larger than the buffer is truncated, as a UDP socket would.
        let n = self.incoming.len().min(buf.len());
        buf[..n].copy_from_slice(&self.incoming[..n]);
        Ok(n)
    }
}

impl Write for Mem {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.outgoing.extend_from_slice(buf);
        self.lens.push(buf.len());
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Why a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Ended {
    /// The client sent close_notify.
    Closed,
    /// The handshake or a record failed.
    Failed,
}

/// One client's DTLS session.
pub(super) struct Session {
    stream: SslStream<Mem>,
    established: bool,
    /// Until when the handshake may run.
    pub handshake_deadline: Option<Instant>,
    /// When the client last sent a datagram.
    pub last_rx: Instant,
}

impl Session {
    pub fn new(context: &SslContext, now: Instant) -> Result<Session, ErrorStack> {
        let mut ssl = Ssl::new(context)?;
        ssl.set_mtu(MTU)?;
        ssl.set_accept_state();
        Ok(Session {
            stream: SslStream::new(ssl, Mem::default())?,
            established: false,
            handshake_deadline: Some(now + HANDSHAKE_TIMEOUT),
            last_rx: now,
        })
    }

    /// Takes one datagram from the client; each TURN message it carried is passed to
    /// `message`, decrypted.
    pub fn receive(
        &mut self,
        now: Instant,
        datagram: &[u8],
        scratch: &mut [u8],
        mut message: impl FnMut(&mut Session, &[u8]),
    ) -> Result<(), Ended> {
        self.last_rx = now;
        let mem = self.stream.get_mut();
        mem.incoming.clear();
        mem.incoming.extend_from_slice(datagram);
        mem.has_incoming = true;
        if !self.established {
            match self.stream.do_handshake() {
                Ok(()) => {
                    self.established = true;
                    self.handshake_deadline = None;
                }
                Err(e) if wants_more(e.code()) => return Ok(()),
                Err(_) => return Err(Ended::Failed),
            }
        }
        loop {
            match self.stream.ssl_read(scratch) {
                Ok(0) => return Ok(()),
                Ok(n) => {
                    // `message` may send (and so borrow the session): lend it a copy.
                    let mut plain = std::mem::take(&mut self.stream.get_mut().incoming);
                    plain.clear();
                    plain.extend_from_slice(&scratch[..n]);
                    message(self, &plain);
                    self.stream.get_mut().incoming = plain;
                }
                Err(e) if e.code() == ErrorCode::ZERO_RETURN => return Err(Ended::Closed),
                Err(e) if wants_more(e.code()) => return Ok(()),
                // A record that does not decrypt is dropped, as DTLS does (RFC 6347 §4.1.2.7).
                Err(e) if e.code() == ErrorCode::SSL => return Ok(()),
                Err(_) => return Err(Ended::Failed),
            }
        }
    }

    /// Encrypts one TURN message for the client (after the handshake). `false` if it cannot.
    pub fn send(&mut self, plaintext: &[u8]) -> bool {
        self.established
            && self
                .stream
                .ssl_write(plaintext)
                .is_ok_and(|n| n == plaintext.len())
    }

    /// Hands every datagram the session wrote to `send`, oldest first.
    pub fn drain(&mut self, mut send: impl FnMut(&[u8])) {
        let mem = self.stream.get_mut();
        let mut at = 0;
        for &len in &mem.lens {
            send(&mem.outgoing[at..at + len]);
            at += len;
        }
        mem.outgoing.clear();
        mem.lens.clear();
    }
}

fn wants_more(code: ErrorCode) -> bool {
    code == ErrorCode::WANT_READ || code == ErrorCode::WANT_WRITE
}

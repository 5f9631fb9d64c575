//! TURN-DTLS: DTLS 1.2 sessions over a shard's UDP listener sockets, one per client address,
//! with OpenSSL (the `openssl` crate over the system libssl) driven through memory buffers:
//! the shard moves datagrams with its own batched syscalls, and a session only turns records
//! into TURN messages and back. Nothing here blocks or reads a socket.
//!
//! No state is kept for a client before it proves its address: a [`Gate`] answers a first
//! ClientHello with a HelloVerifyRequest whose cookie is an HMAC of the client's address and
//! the time (RFC 6347 §4.2.1), statelessly through OpenSSL's `DTLSv1_listen`, and a
//! [`Session`] is made only for a ClientHello that echoes a valid cookie.

use foreign_types::ForeignTypeRef;
use hmac::{Hmac, Mac};
use openssl::error::ErrorStack;
use openssl::ex_data::Index;
use openssl::pkey::PKey;
use openssl::ssl::{
    ErrorCode, Ssl, SslContext, SslContextBuilder, SslMethod, SslMode, SslOptions, SslRef,
    SslStream, SslVersion,
};
use openssl::x509::X509;
use sha2::Sha256;
use std::io::{self, Read, Write};
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use super::tls::{decode_pem, MaterialError, HANDSHAKE_TIMEOUT};

/// The largest datagram a session writes: fits the common 1280-byte IPv6 minimum MTU with
/// room for headers.
const MTU: u32 = 1200;

/// A TURN-DTLS listener's gate from the config's base64 `cert` and `key`: what the listener
/// serves with, and what a new config is checked with before it is applied.
pub(super) fn gate_from_base64(cert_base64: &str, key_base64: &str) -> Result<Gate, MaterialError> {
    let cert_pem =
        decode_pem(cert_base64).map_err(|e| MaterialError::Cert(format!("cert is {e}")))?;
    let key_pem = decode_pem(key_base64).map_err(|e| MaterialError::Key(format!("key is {e}")))?;
    let context = context_from_pem(&cert_pem, &key_pem)?;
    Gate::new(context).map_err(|e| MaterialError::Setup(format!("DTLS setup failed: {e}")))
}

/// A DTLS server context for a listener's PEM certificate (chain) and key.
pub(super) fn context_from_pem(
    cert_pem: &[u8],
    key_pem: &[u8],
) -> Result<SslContext, MaterialError> {
    let setup = |e: ErrorStack| MaterialError::Setup(format!("DTLS setup failed: {e}"));
    let chain = X509::stack_from_pem(cert_pem)
        .map_err(|e| MaterialError::Cert(format!("cannot read the DTLS certificate: {e}")))?;
    let mut chain = chain.into_iter();
    let Some(leaf) = chain.next() else {
        return Err(MaterialError::Cert(
            "the DTLS certificate PEM holds no CERTIFICATE block".into(),
        ));
    };
    let key = PKey::private_key_from_pem(key_pem)
        .map_err(|e| MaterialError::Key(format!("cannot read the DTLS private key: {e}")))?;
    if leaf
        .public_key()
        .is_ok_and(|public| !public.public_eq(&key))
    {
        return Err(MaterialError::Mismatch(
            "the DTLS private key does not match the certificate".into(),
        ));
    }
    let mut builder = SslContextBuilder::new(SslMethod::dtls()).map_err(setup)?;
    builder
        .set_min_proto_version(Some(SslVersion::DTLS1_2))
        .map_err(setup)?;
    builder
        .set_certificate(&leaf)
        .map_err(|e| MaterialError::Cert(format!("cannot use the DTLS certificate: {e}")))?;
    for extra in chain {
        builder.add_extra_chain_cert(extra).map_err(|e| {
            MaterialError::Cert(format!("cannot use the DTLS certificate chain: {e}"))
        })?;
    }
    builder
        .set_private_key(&key)
        .map_err(|e| MaterialError::Key(format!("cannot use the DTLS private key: {e}")))?;
    builder.check_private_key().map_err(|e| {
        MaterialError::Mismatch(format!(
            "the DTLS private key does not match the certificate ({e})"
        ))
    })?;
    // The memory transport cannot be asked for the path MTU; MTU is set per session.
    builder.set_options(SslOptions::NO_QUERY_MTU);
    builder.set_mode(SslMode::RELEASE_BUFFERS);
    let mut secret = [0u8; 32];
    openssl::rand::rand_bytes(&mut secret).map_err(setup)?;
    let cookies = CookieJar { secret };
    builder.set_cookie_generate_cb(move |ssl, out| {
        let client = client_of(ssl)?;
        let cookie = cookies.cookie(client, unix_now());
        // OpenSSL lends 255 bytes; a panic here would cross into C.
        let out = out.get_mut(..COOKIE_LEN).ok_or_else(ErrorStack::get)?;
        out.copy_from_slice(&cookie);
        Ok(COOKIE_LEN)
    });
    builder.set_cookie_verify_cb(move |ssl, cookie| {
        client_of(ssl).is_ok_and(|client| cookies.verify(client, unix_now(), cookie))
    });
    Ok(builder.build())
}

/// The client a gate is answering, for the cookie callbacks.
fn client_index() -> Index<Ssl, SocketAddr> {
    static INDEX: OnceLock<Index<Ssl, SocketAddr>> = OnceLock::new();
    *INDEX.get_or_init(|| Ssl::new_ex_index().expect("an SSL ex-data index"))
}

fn client_of(ssl: &SslRef) -> Result<SocketAddr, ErrorStack> {
    ssl.ex_data(client_index())
        .copied()
        .ok_or_else(ErrorStack::get)
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A cookie: the low byte of its time window, then 16 bytes of HMAC-SHA256 over the window
/// and the client's address. Well below DTLS 1.2's 255-byte limit.
const COOKIE_LEN: usize = 17;
/// A cookie is valid in the window it was made in and the next one: 30 to 60 s, ample for a
/// client to echo it, too short to hoard.
const COOKIE_WINDOW_SECS: u64 = 30;

/// Makes and checks the stateless cookies of one DTLS context.
#[derive(Clone, Copy)]
struct CookieJar {
    secret: [u8; 32],
}

impl CookieJar {
    fn cookie_in(&self, client: SocketAddr, window: u64) -> [u8; COOKIE_LEN] {
        let mut mac = Hmac::<Sha256>::new_from_slice(&self.secret).expect("any key length");
        mac.update(&window.to_be_bytes());
        match client.ip() {
            std::net::IpAddr::V4(ip) => mac.update(&ip.octets()),
            std::net::IpAddr::V6(ip) => mac.update(&ip.octets()),
        }
        mac.update(&client.port().to_be_bytes());
        let tag = mac.finalize().into_bytes();
        let mut cookie = [0u8; COOKIE_LEN];
        cookie[0] = window as u8;
        cookie[1..].copy_from_slice(&tag[..COOKIE_LEN - 1]);
        cookie
    }

    fn cookie(&self, client: SocketAddr, unix_secs: u64) -> [u8; COOKIE_LEN] {
        self.cookie_in(client, unix_secs / COOKIE_WINDOW_SECS)
    }

    fn verify(&self, client: SocketAddr, unix_secs: u64, cookie: &[u8]) -> bool {
        let current = unix_secs / COOKIE_WINDOW_SECS;
        [current, current.saturating_sub(1)]
            .into_iter()
            .any(|window| {
                cookie.len() == COOKIE_LEN
                    && cookie[0] == window as u8
                    && openssl::memcmp::eq(&self.cookie_in(client, window), cookie)
            })
    }
}

/// OpenSSL's `BIO_ADDR`, opaque.
enum BioAddr {}

extern "C" {
    // libssl (linked through the openssl crate), OpenSSL 1.1.0 and later; the openssl crates
    // do not bind these.
    fn DTLSv1_listen(ssl: *mut openssl_sys::SSL, client: *mut BioAddr) -> i32;
    fn BIO_ADDR_new() -> *mut BioAddr;
    fn BIO_ADDR_free(addr: *mut BioAddr);
}

/// What a gate made of a datagram from a client without a session.
pub(super) enum Admission {
    /// A ClientHello with a valid cookie: the session, to be driven with
    /// [`Session::receive`] and an empty datagram.
    Session(Session),
    /// Answered (a HelloVerifyRequest, now in `drain`) or dropped; nothing is kept.
    Nothing,
}

/// The stateless front of a DTLS listener: one SSL object, cleared for every datagram.
pub(super) struct Gate {
    context: SslContext,
    stream: SslStream<Mem>,
    /// Where `DTLSv1_listen` writes the peer it could not learn from a memory transport.
    scratch_addr: *mut BioAddr,
}

impl Gate {
    pub(super) fn new(context: SslContext) -> Result<Gate, ErrorStack> {
        let stream = listening_stream(&context)?;
        // SAFETY: BIO_ADDR_new has no preconditions; null means out of memory.
        let scratch_addr = unsafe { BIO_ADDR_new() };
        if scratch_addr.is_null() {
            return Err(ErrorStack::get());
        }
        Ok(Gate {
            context,
            stream,
            scratch_addr,
        })
    }

    /// Takes a datagram from `client`, which has no session. What the gate writes (a
    /// HelloVerifyRequest) is handed to `send`.
    pub(super) fn admit(
        &mut self,
        now: Instant,
        client: SocketAddr,
        datagram: &[u8],
        send: impl FnMut(&[u8]),
    ) -> Admission {
        // SAFETY: the SSL object is owned by `self.stream` and not borrowed elsewhere; the
        // cookie callbacks read this (and again when the session verifies the cookie).
        let ssl = unsafe { SslRef::from_ptr_mut(self.stream.ssl().as_ptr()) };
        ssl.set_ex_data(client_index(), client);
        let mem = self.stream.get_mut();
        mem.incoming.clear();
        mem.incoming.extend_from_slice(datagram);
        mem.has_incoming = true;
        // SAFETY: the SSL object is live and owned by `self.stream`, its BIOs are set, and
        // `scratch_addr` is a BIO_ADDR from BIO_ADDR_new, freed only on drop.
        let verdict = unsafe { DTLSv1_listen(self.stream.ssl().as_ptr(), self.scratch_addr) };
        drain(self.stream.get_mut(), send);
        self.stream.get_mut().has_incoming = false;
        if verdict <= 0 {
            // 0: no valid cookie (a HelloVerifyRequest went out) or not a ClientHello; below
            // 0: an error, whose queued reasons are dropped here so that they do not surface
            // in a later, unrelated error. Nothing is kept either way; OpenSSL clears the
            // object next time.
            if verdict < 0 {
                drop(ErrorStack::get());
            }
            return Admission::Nothing;
        }
        let Ok(fresh) = listening_stream(&self.context) else {
            return Admission::Nothing;
        };
        let stream = std::mem::replace(&mut self.stream, fresh);
        Admission::Session(Session {
            stream,
            established: false,
            handshake_deadline: Some(now + HANDSHAKE_TIMEOUT),
            last_rx: now,
        })
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        // SAFETY: allocated by BIO_ADDR_new in `Gate::new`, freed once.
        unsafe { BIO_ADDR_free(self.scratch_addr) }
    }
}

/// A server-side SSL object over an empty memory transport.
fn listening_stream(context: &SslContext) -> Result<SslStream<Mem>, ErrorStack> {
    let mut ssl = Ssl::new(context)?;
    ssl.set_mtu(MTU)?;
    ssl.set_accept_state();
    SslStream::new(ssl, Mem::default())
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
    /// Takes one datagram from the client (empty: go on with what OpenSSL holds, as after
    /// [`Gate::admit`]); each TURN message it carried is passed to `message`, decrypted.
    pub(super) fn receive(
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
        mem.has_incoming = !datagram.is_empty();
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
    pub(super) fn send(&mut self, plaintext: &[u8]) -> bool {
        self.established
            && self
                .stream
                .ssl_write(plaintext)
                .is_ok_and(|n| n == plaintext.len())
    }

    /// Hands every datagram the session wrote to `send`, oldest first.
    pub(super) fn drain(&mut self, send: impl FnMut(&[u8])) {
        drain(self.stream.get_mut(), send);
    }
}

/// Hands every datagram written to `mem` to `send`, oldest first.
fn drain(mem: &mut Mem, mut send: impl FnMut(&[u8])) {
    let mut at = 0;
    for &len in &mem.lens {
        send(&mem.outgoing[at..at + len]);
        at += len;
    }
    mem.outgoing.clear();
    mem.lens.clear();
}

fn wants_more(code: ErrorCode) -> bool {
    code == ErrorCode::WANT_READ || code == ErrorCode::WANT_WRITE
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cookies_are_bound_to_the_client_address_and_expire() {
        let jar = CookieJar { secret: [7; 32] };
        let client: SocketAddr = "192.0.2.1:5000".parse().unwrap();
        let other_port: SocketAddr = "192.0.2.1:5001".parse().unwrap();
        let other_ip: SocketAddr = "[2001:db8::1]:5000".parse().unwrap();
        let t = 1_000_000;
        let cookie = jar.cookie(client, t);
        assert!(jar.verify(client, t, &cookie));
        assert!(jar.verify(client, t + COOKIE_WINDOW_SECS, &cookie));
        assert!(!jar.verify(client, t + 2 * COOKIE_WINDOW_SECS, &cookie));
        assert!(!jar.verify(other_port, t, &cookie));
        assert!(!jar.verify(other_ip, t, &cookie));
        assert!(!jar.verify(client, t, &cookie[..COOKIE_LEN - 1]));
        let mut bent = cookie;
        bent[5] ^= 1;
        assert!(!jar.verify(client, t, &bent));
        let other_secret = CookieJar { secret: [8; 32] };
        assert!(!other_secret.verify(client, t, &cookie));
    }
}

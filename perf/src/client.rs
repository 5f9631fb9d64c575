//! A minimal blocking TURN client over UDP or TCP for load tools and benchmarks: allocate
//! (long-term auth), create permissions, bind channels; the data path is the caller's
//! (ChannelData is a 4-byte header, see [`channel_data_header`]; over TCP it is padded to 4
//! bytes).

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::os::fd::{AsRawFd, RawFd};
use std::time::Duration;
use stun_proto::types::attribute::{ErrorCode, Nonce, Realm, Username};
use stun_proto::types::message::{
    IntegrityAlgorithm, LongTermKeyCredentials, Message, MessageClass, MessageIntegrityCredentials,
    MessageType, MessageWrite, MessageWriteExt, MessageWriteVec, Method, TransactionId,
};
use turn_types::attribute::{
    ChannelNumber, Lifetime, RequestedTransport, XorPeerAddress, XorRelayedAddress,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH};

/// A client's connection to the server: a connected UDP socket, or a TCP connection (left
/// blocking for writes; read it with `MSG_DONTWAIT`).
pub enum Link {
    /// TURN over UDP.
    Udp(UdpSocket),
    /// TURN over TCP.
    Tcp(TcpStream),
}

impl Link {
    /// Sends one datagram (UDP) or writes all of `data` (TCP).
    pub fn send(&self, data: &[u8]) -> io::Result<usize> {
        match self {
            Link::Udp(s) => s.send(data),
            Link::Tcp(s) => (&*s).write_all(data).map(|()| data.len()),
        }
    }

    /// Non-blocking UDP; TCP stays blocking (its readers pass `MSG_DONTWAIT`).
    pub fn set_nonblocking(&self, on: bool) -> io::Result<()> {
        match self {
            Link::Udp(s) => s.set_nonblocking(on),
            Link::Tcp(_) => Ok(()),
        }
    }

    /// Whether this is a byte stream (frames need [`uturn_shared::framing::frame_len`]).
    pub fn is_stream(&self) -> bool {
        matches!(self, Link::Tcp(_))
    }

    /// One whole STUN message from the server (during setup, nothing else arrives).
    fn recv_message(&self) -> io::Result<Vec<u8>> {
        match self {
            Link::Udp(s) => {
                let mut buf = vec![0u8; 2048];
                let n = s.recv(&mut buf)?;
                buf.truncate(n);
                Ok(buf)
            }
            Link::Tcp(s) => {
                let mut header = [0u8; 20];
                (&*s).read_exact(&mut header)?;
                let mut message = header.to_vec();
                message.resize(
                    20 + usize::from(u16::from_be_bytes([header[2], header[3]])),
                    0,
                );
                (&*s).read_exact(&mut message[20..])?;
                Ok(message)
            }
        }
    }
}

impl AsRawFd for Link {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            Link::Udp(s) => s.as_raw_fd(),
            Link::Tcp(s) => s.as_raw_fd(),
        }
    }
}

/// A client with one allocation.
pub struct BenchClient {
    /// The client's connection to the server.
    pub socket: Link,
    /// The relay address the server advertised.
    pub relay: SocketAddr,
    user: String,
    pass: String,
    realm: String,
    nonce: String,
}

fn other(msg: String) -> io::Error {
    io::Error::other(msg)
}

impl BenchClient {
    /// A client of udprelay (no TURN): `socket` is connected to its listen port, `relay` is
    /// its relay port.
    pub fn plain(socket: UdpSocket, relay: SocketAddr) -> BenchClient {
        BenchClient {
            socket: Link::Udp(socket),
            relay,
            user: String::new(),
            pass: String::new(),
            realm: String::new(),
            nonce: String::new(),
        }
    }

    /// Allocates on `server` over UDP with static credentials.
    pub fn allocate(server: SocketAddr, user: &str, pass: &str) -> io::Result<BenchClient> {
        BenchClient::allocate_over(server, user, pass, false)
    }

    /// Allocates on `server` over UDP, or over a TCP connection of its own if `tcp`. A 437
    /// (Allocation Mismatch: the kernel gave this socket the 5-tuple of an allocation a client
    /// that went away still holds) is retried from a fresh socket, as RFC 8656 advises
    /// (a new client transport address), up to 3 times.
    pub fn allocate_over(
        server: SocketAddr,
        user: &str,
        pass: &str,
        tcp: bool,
    ) -> io::Result<BenchClient> {
        BenchClient::allocate_from(server, None, user, pass, tcp)
    }

    /// [`BenchClient::allocate_over`] from source address `source` (UDP only; `None`: the
    /// loopback address of the server's family).
    pub fn allocate_from(
        server: SocketAddr,
        source: Option<std::net::IpAddr>,
        user: &str,
        pass: &str,
        tcp: bool,
    ) -> io::Result<BenchClient> {
        if tcp && source.is_some() {
            return Err(other("a source address is for UDP clients only".into()));
        }
        let mut tries = 0;
        loop {
            tries += 1;
            match BenchClient::allocate_once(server, source, user, pass, tcp) {
                Err(e) if tries < 3 && e.kind() == io::ErrorKind::AddrInUse => continue,
                result => return result,
            }
        }
    }

    fn allocate_once(
        server: SocketAddr,
        source: Option<std::net::IpAddr>,
        user: &str,
        pass: &str,
        tcp: bool,
    ) -> io::Result<BenchClient> {
        let socket = if tcp {
            let stream = TcpStream::connect_timeout(&server, Duration::from_secs(2))?;
            stream.set_nodelay(true)?;
            stream.set_read_timeout(Some(Duration::from_secs(2)))?;
            Link::Tcp(stream)
        } else {
            let local: std::net::IpAddr = match source {
                Some(ip) => ip,
                None if server.is_ipv4() => std::net::Ipv4Addr::LOCALHOST.into(),
                None => std::net::Ipv6Addr::LOCALHOST.into(),
            };
            let socket = UdpSocket::bind((local, 0))?;
            roomy(&socket);
            socket.connect(server)?;
            socket.set_read_timeout(Some(Duration::from_secs(2)))?;
            Link::Udp(socket)
        };
        let mut client = BenchClient {
            socket,
            relay: server,
            user: user.into(),
            pass: pass.into(),
            realm: String::new(),
            nonce: String::new(),
        };
        let challenge = client.request(ALLOCATE, &udp_transport, false)?;
        let msg = Message::from_bytes(&challenge).map_err(|e| other(e.to_string()))?;
        client.realm = msg
            .attribute::<Realm>()
            .map_err(|e| other(e.to_string()))?
            .realm()
            .into();
        client.nonce = msg
            .attribute::<Nonce>()
            .map_err(|e| other(e.to_string()))?
            .nonce()
            .into();
        client.reallocate()?;
        Ok(client)
    }

    /// Creates a permission for `peer`'s IP.
    pub fn create_permission(&mut self, peer: SocketAddr) -> io::Result<()> {
        let attrs = move |m: &mut MessageWriteVec, txid: TransactionId| {
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        };
        self.succeed(CREATE_PERMISSION, &attrs, "create permission")
    }

    /// A Send indication carrying `data` to `peer` (RFC 8656 §10.1).
    pub fn send_indication(&self, peer: SocketAddr, data: &[u8]) -> Vec<u8> {
        let txid = TransactionId::generate();
        let mut msg = Message::builder(
            MessageType::from_class_method(MessageClass::Indication, turn_types::message::SEND),
            txid,
            MessageWriteVec::new(),
        );
        msg.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        msg.add_attribute(&turn_types::attribute::Data::new(data))
            .unwrap();
        msg.finish()
    }

    /// Binds `channel` to `peer`.
    pub fn bind_channel(&mut self, channel: u16, peer: SocketAddr) -> io::Result<()> {
        let attrs = move |m: &mut MessageWriteVec, txid: TransactionId| {
            m.add_attribute(&ChannelNumber::new(channel)).unwrap();
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        };
        self.succeed(CHANNEL_BIND, &attrs, "channel bind")
    }

    /// Allocates (again, after [`BenchClient::delete`]) on this client's 5-tuple, with the
    /// realm and nonce it learned. A 437 (this 5-tuple is taken) is an `AddrInUse` error, so
    /// that a caller may retry from another socket.
    pub fn reallocate(&mut self) -> io::Result<()> {
        let reply = self.request(ALLOCATE, &udp_transport, true)?;
        let msg = Message::from_bytes(&reply).map_err(|e| other(e.to_string()))?;
        self.relay = msg
            .attribute::<XorRelayedAddress>()
            .map_err(|_| {
                let code = msg.attribute::<ErrorCode>().ok();
                let kind = if code.as_ref().is_some_and(|c| c.code() == 437) {
                    io::ErrorKind::AddrInUse
                } else {
                    io::ErrorKind::Other
                };
                io::Error::new(kind, format!("allocate failed: {code:?}"))
            })?
            .addr(msg.transaction_id());
        Ok(())
    }

    /// Refreshes the allocation for `lifetime` seconds, with the nonce it has.
    pub fn refresh(&mut self, lifetime: u32) -> io::Result<()> {
        let attrs = move |m: &mut MessageWriteVec, _: TransactionId| {
            m.add_attribute(&Lifetime::new(lifetime)).unwrap();
        };
        self.succeed(REFRESH, &attrs, "refresh")
    }

    /// Deletes the allocation (a Refresh with LIFETIME 0).
    pub fn delete(&mut self) -> io::Result<()> {
        let attrs = |m: &mut MessageWriteVec, _: TransactionId| {
            m.add_attribute(&Lifetime::new(0)).unwrap();
        };
        self.succeed(REFRESH, &attrs, "delete")
    }

    /// Sends an authenticated request; an error unless the answer is a success.
    fn succeed(
        &self,
        method: Method,
        attrs: &dyn Fn(&mut MessageWriteVec, TransactionId),
        what: &str,
    ) -> io::Result<()> {
        let reply = self.request(method, attrs, true)?;
        let msg = Message::from_bytes(&reply).map_err(|e| other(e.to_string()))?;
        if msg.class() != MessageClass::Success {
            return Err(other(format!(
                "{what} failed: {:?}",
                msg.attribute::<ErrorCode>().ok()
            )));
        }
        Ok(())
    }

    fn request(
        &self,
        method: Method,
        attrs: &dyn Fn(&mut MessageWriteVec, TransactionId),
        auth: bool,
    ) -> io::Result<Vec<u8>> {
        let credentials = auth.then(|| Credentials {
            user: &self.user,
            pass: &self.pass,
            realm: &self.realm,
            nonce: &self.nonce,
        });
        let request = build_request(method, attrs, credentials.as_ref()).map_err(other)?;
        self.socket.send(&request)?;
        self.socket.recv_message()
    }
}

/// Long-term credentials with the realm and nonce a 401 taught.
#[derive(Debug, Clone, Copy)]
pub struct Credentials<'a> {
    /// Username.
    pub user: &'a str,
    /// Password.
    pub pass: &'a str,
    /// Realm from the server's 401.
    pub realm: &'a str,
    /// Nonce from the server's 401.
    pub nonce: &'a str,
}

/// A STUN/TURN request for `method` with `attrs`, signed with `credentials` if given
/// (USERNAME, REALM, NONCE, MESSAGE-INTEGRITY).
pub fn build_request(
    method: Method,
    attrs: &dyn Fn(&mut MessageWriteVec, TransactionId),
    credentials: Option<&Credentials<'_>>,
) -> Result<Vec<u8>, String> {
    let txid = TransactionId::generate();
    let mut msg = Message::builder(
        MessageType::from_class_method(MessageClass::Request, method),
        txid,
        MessageWriteVec::new(),
    );
    attrs(&mut msg, txid);
    if let Some(c) = credentials {
        let bad = |e: &dyn std::fmt::Display| e.to_string();
        msg.add_attribute(&Username::new(c.user).map_err(|e| bad(&e))?)
            .map_err(|e| bad(&e))?;
        msg.add_attribute(&Realm::new(c.realm).map_err(|e| bad(&e))?)
            .map_err(|e| bad(&e))?;
        msg.add_attribute(&Nonce::new(c.nonce).map_err(|e| bad(&e))?)
            .map_err(|e| bad(&e))?;
        let creds: MessageIntegrityCredentials =
            LongTermKeyCredentials::new(c.user.into(), c.pass.into(), c.realm.into()).into();
        msg.add_message_integrity(&creds, IntegrityAlgorithm::Sha1)
            .map_err(|e| bad(&e))?;
    }
    Ok(msg.finish())
}

/// Asks for 4 MiB socket buffers (as the servers under test do), so a burst the load
/// generator is too busy to read at once is not lost in its own socket.
pub fn roomy(socket: &UdpSocket) {
    use std::os::fd::AsRawFd;
    let size: libc::c_int = 4 << 20;
    for option in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: a valid fd and a c_int option value of the right size.
        unsafe {
            libc::setsockopt(
                socket.as_raw_fd(),
                libc::SOL_SOCKET,
                option,
                (&size as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
}

/// Adds REQUESTED-TRANSPORT UDP (an Allocate's one required attribute).
pub fn udp_transport(m: &mut MessageWriteVec, _: TransactionId) {
    m.add_attribute(&RequestedTransport::new(17)).unwrap();
}

/// The ChannelData header for `len` payload bytes on `channel` (RFC 8656 §12.4).
pub fn channel_data_header(channel: u16, len: usize) -> [u8; 4] {
    let c = channel.to_be_bytes();
    let l = (len as u16).to_be_bytes();
    [c[0], c[1], l[0], l[1]]
}

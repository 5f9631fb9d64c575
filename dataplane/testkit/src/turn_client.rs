//! A `turn-client-proto` client (an independent TURN implementation) driven over a real UDP
//! socket, with its own clock, which a test can move forward to make the client refresh.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use stun_proto::types::attribute::ErrorCode;
use stun_proto::types::message::{Message, MessageClass};
use turn_client_proto::api::{TurnClientApi, TurnConfig, TurnEvent, TurnRecvRet};
use turn_client_proto::udp::TurnClientUdp;
use turn_types::stun::TransportType;
use turn_types::{AddressFamily, Instant, TurnCredentials};

/// A STUN response the client received: method, class and ERROR-CODE (if any).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Response {
    /// The STUN method (e.g. 0x008 CreatePermission).
    pub method: u16,
    /// Whether it is a success response.
    pub success: bool,
    /// The ERROR-CODE of an error response.
    pub error_code: Option<u16>,
}

/// A `turn-client-proto` UDP client on a real socket.
pub struct TurnClient {
    /// The client under test.
    pub client: TurnClientUdp,
    socket: UdpSocket,
    epoch: std::time::Instant,
    offset: Duration,
    /// Peer data received: (peer, payload).
    pub received: Vec<(SocketAddr, Vec<u8>)>,
    /// Every STUN response seen on the wire.
    pub responses: Vec<Response>,
    /// Every event the client gave.
    pub events: Vec<String>,
    /// Datagrams and bytes this client's socket sent to the server.
    pub sent: (u64, u64),
    /// Datagrams and bytes this client's socket received.
    pub recvd: (u64, u64),
    server: SocketAddr,
}

impl TurnClient {
    /// A client that starts allocating on `server` with `user`/`pass`.
    pub fn new(server: SocketAddr, user: &str, pass: &str) -> TurnClient {
        TurnClient::with_families(server, user, pass, &[AddressFamily::IPV4])
    }

    /// A client on the loopback address of `server`'s family that starts allocating relays
    /// of `families` on `server`: IPv6 alone asks with REQUESTED-ADDRESS-FAMILY, IPv4 and IPv6
    /// with ADDITIONAL-ADDRESS-FAMILY (a dual allocation, RFC 8656 §7.2).
    pub fn with_families(
        server: SocketAddr,
        user: &str,
        pass: &str,
        families: &[AddressFamily],
    ) -> TurnClient {
        let local = if server.is_ipv4() {
            "127.0.0.1:0"
        } else {
            "[::1]:0"
        };
        TurnClient::on(local.parse().unwrap(), server, user, pass, families)
    }

    /// A client on `local` (an address of the network namespace the calling thread is in:
    /// the socket stays there) that starts allocating relays of `families` on `server`.
    pub fn on(
        local: SocketAddr,
        server: SocketAddr,
        user: &str,
        pass: &str,
        families: &[AddressFamily],
    ) -> TurnClient {
        let socket = UdpSocket::bind(local).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(2)))
            .unwrap();
        let local = socket.local_addr().unwrap();
        let mut config = TurnConfig::new(TurnCredentials::new(user, pass));
        config.set_address_family(families[0]);
        for &family in &families[1..] {
            config.add_address_family(family);
        }
        let client = TurnClientUdp::allocate(local, server, config);
        TurnClient {
            client,
            socket,
            epoch: std::time::Instant::now(),
            offset: Duration::ZERO,
            received: Vec::new(),
            responses: Vec::new(),
            events: Vec::new(),
            sent: (0, 0),
            recvd: (0, 0),
            server,
        }
    }

    /// The client's clock: real time since creation, plus what `warp` added.
    pub fn now(&self) -> Instant {
        Instant::from_nanos((self.epoch.elapsed() + self.offset).as_nanos() as i64)
    }

    /// Moves the client's clock forward (the server keeps real time), so that it refreshes
    /// what would expire by then.
    pub fn warp(&mut self, by: Duration) {
        self.offset += by;
    }

    /// One round: timers, transmissions, and every datagram waiting on the socket.
    fn pump(&mut self, want: &dyn Fn(&TurnEvent) -> bool) -> Option<TurnEvent> {
        let local = self.socket.local_addr().unwrap();
        let mut buf = [0u8; 2048];
        let t = self.now();
        let _ = self.client.poll(t);
        while let Some(transmit) = self.client.poll_transmit(t) {
            let data: &[u8] = transmit.data.as_ref();
            if self.socket.send_to(data, transmit.to).is_ok() {
                self.sent.0 += 1;
                self.sent.1 += data.len() as u64;
            }
        }
        while let Some(event) = self.client.poll_event() {
            self.events.push(format!("{event:?}"));
            if want(&event) {
                return Some(event);
            }
        }
        while let Ok((n, from)) = self.socket.recv_from(&mut buf) {
            self.recvd.0 += 1;
            self.recvd.1 += n as u64;
            if let Ok(msg) = Message::from_bytes(&buf[..n]) {
                if msg.is_response() {
                    self.responses.push(Response {
                        method: msg.method().value(),
                        success: msg.has_class(MessageClass::Success),
                        error_code: msg.attribute::<ErrorCode>().ok().map(|e| e.code()),
                    });
                }
            }
            let transmit = stun_proto::agent::Transmit {
                data: &buf[..n],
                transport: TransportType::Udp,
                from,
                to: local,
            };
            if let TurnRecvRet::PeerData(data) = self.client.recv(transmit, self.now()) {
                self.received.push((data.peer, data.data().to_vec()));
            }
        }
        None
    }

    /// Moves packets until an event matching `want` arrives, or `secs` pass.
    pub fn until_for(&mut self, secs: f64, want: &dyn Fn(&TurnEvent) -> bool) -> Option<TurnEvent> {
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
        while std::time::Instant::now() < deadline {
            if let Some(event) = self.pump(want) {
                return Some(event);
            }
        }
        None
    }

    /// Moves packets until an event matching `want` arrives (or 5 s pass).
    pub fn until(&mut self, want: &dyn Fn(&TurnEvent) -> bool) -> Option<TurnEvent> {
        self.until_for(5.0, want)
    }

    /// Moves packets for `secs`.
    pub fn drive(&mut self, secs: f64) {
        self.until_for(secs, &|_| false);
    }

    /// Allocates; the relayed address.
    pub fn allocate(&mut self) -> Option<SocketAddr> {
        match self.until(&|e| {
            matches!(
                e,
                TurnEvent::AllocationCreated(..) | TurnEvent::AllocationCreateFailed(_)
            )
        }) {
            Some(TurnEvent::AllocationCreated(_, relay)) => Some(relay),
            _ => None,
        }
    }

    /// The relayed addresses the client holds (after [`TurnClient::allocate`]).
    pub fn relayed(&self) -> Vec<SocketAddr> {
        self.client.relayed_addresses().map(|(_, a)| a).collect()
    }

    /// Creates a permission for `peer`'s IP; whether it was granted.
    pub fn permit(&mut self, peer: std::net::IpAddr) -> bool {
        let now = self.now();
        self.client
            .create_permission(TransportType::Udp, peer, now)
            .unwrap();
        matches!(
            self.until(&|e| matches!(
                e,
                TurnEvent::PermissionCreated(..) | TurnEvent::PermissionCreateFailed(..)
            )),
            Some(TurnEvent::PermissionCreated(..))
        )
    }

    /// Binds a channel to `peer`; whether it was bound.
    pub fn bind(&mut self, peer: SocketAddr) -> bool {
        let now = self.now();
        self.client
            .bind_channel(TransportType::Udp, peer, now)
            .unwrap();
        matches!(
            self.until(&|e| matches!(
                e,
                TurnEvent::ChannelCreated(..) | TurnEvent::ChannelCreateFailed(..)
            )),
            Some(TurnEvent::ChannelCreated(..))
        )
    }

    /// Sends `data` to `peer` (ChannelData once a channel is bound, else a Send indication).
    pub fn send(&mut self, peer: SocketAddr, data: &[u8]) {
        let now = self.now();
        if let Some(transmit) = self
            .client
            .send_to(TransportType::Udp, peer, data.to_vec(), now)
            .unwrap()
        {
            let transmit = transmit.build();
            if self.socket.send_to(&transmit.data, transmit.to).is_ok() {
                self.sent.0 += 1;
                self.sent.1 += transmit.data.len() as u64;
            }
        }
    }

    /// Sends raw bytes to the server from the client's socket.
    pub fn send_raw(&mut self, data: &[u8]) {
        if self.socket.send_to(data, self.server).is_ok() {
            self.sent.0 += 1;
            self.sent.1 += data.len() as u64;
        }
    }

    /// Sends raw bytes from the client's socket to `to`, which need not be the server.
    pub fn send_raw_to(&mut self, to: SocketAddr, data: &[u8]) {
        if self.socket.send_to(data, to).is_ok() {
            self.sent.0 += 1;
            self.sent.1 += data.len() as u64;
        }
    }

    /// The client's own address.
    pub fn local(&self) -> SocketAddr {
        self.socket.local_addr().unwrap()
    }

    /// Deletes the allocation (Refresh with LIFETIME 0).
    pub fn delete(&mut self) {
        let now = self.now();
        let _ = self.client.delete(now);
        self.drive(0.3);
    }
}

/// Sends `n` sequenced datagrams to `peer` one per 2 ms; how many came back.
pub fn stream(d: &mut TurnClient, peer: SocketAddr, tag: &str, n: u32) -> usize {
    let before = d.received.len();
    for seq in 0..n {
        d.send(peer, format!("{tag} {seq:04}").as_bytes());
        d.drive(0.002);
    }
    d.drive(0.3);
    d.received[before..]
        .iter()
        .filter(|(_, p)| p.starts_with(tag.as_bytes()))
        .count()
}

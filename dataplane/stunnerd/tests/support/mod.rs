//! Shared by the stunnerd end-to-end tests: a `turn-client-proto` client driven over a real
//! UDP socket (with its own clock, which a test can move forward to make the client refresh),
//! the stunnerd process, and plain HTTP to its health-check server.
#![allow(dead_code)]

use serde_json::Value;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::process::{Child, Command, Stdio};
use std::time::Duration;
use stun_proto::types::attribute::ErrorCode;
use stun_proto::types::message::{Message, MessageClass};
use turn_client_proto::api::{TurnClientApi, TurnConfig, TurnEvent, TurnRecvRet};
use turn_client_proto::udp::TurnClientUdp;
use turn_types::stun::TransportType;
use turn_types::{Instant, TurnCredentials};

/// A port free for UDP and TCP that no other test in this process gets (see
/// `uturn_perf::ports`: two stunnerds sharing a port by chance split one client's packets).
pub use uturn_perf::ports::free_port;

/// A fresh path in the temp dir for a test's file called `name`.
pub fn temp_file(name: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!(
        "uturn-{}-{}-{name}",
        std::process::id(),
        free_port()
    ))
}

/// A stunnerd process, killed when dropped; its output goes to `log`.
pub struct Stunnerd {
    child: Child,
    /// Where stdout and stderr go.
    pub log: std::path::PathBuf,
}

impl Stunnerd {
    /// Starts `stunnerd ARGS` with `envs` (one shard unless `envs` sets `UTURN_SHARDS`).
    pub fn start(args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        Stunnerd::start_under(&[], args, envs)
    }

    /// As [`Stunnerd::start`], run through `wrapper` (a command that execs the rest, such as
    /// `prlimit --memlock=…` or `taskset -c 0`).
    pub fn start_under(wrapper: &[&str], args: &[&str], envs: &[(&str, &str)]) -> Stunnerd {
        Stunnerd::start_with(wrapper, args, envs, |_| {})
    }

    /// As [`Stunnerd::start_under`], with `customize` applied to the command last (a
    /// `pre_exec` hook, say).
    pub fn start_with(
        wrapper: &[&str],
        args: &[&str],
        envs: &[(&str, &str)],
        customize: impl FnOnce(&mut Command),
    ) -> Stunnerd {
        let log = std::env::temp_dir().join(format!(
            "uturn-stunnerd-{}-{}.log",
            std::process::id(),
            free_port()
        ));
        let out = std::fs::File::create(&log).unwrap();
        let binary = env!("CARGO_BIN_EXE_stunnerd");
        let mut command = match wrapper.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(binary);
                command
            }
            None => Command::new(binary),
        };
        command
            .args(args)
            .env("UTURN_SHARDS", "1")
            .envs(envs.iter().copied())
            .stdout(Stdio::from(out.try_clone().unwrap()))
            .stderr(Stdio::from(out));
        customize(&mut command);
        let child = command.spawn().unwrap();
        Stunnerd { child, log }
    }

    /// What the process logged so far.
    pub fn logs(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends `signal` to the process.
    pub fn signal(&self, signal: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, signal);
        }
    }

    /// Waits up to `secs` for the process to exit; its exit code.
    pub fn wait_exit_for(&mut self, secs: f64) -> Option<i32> {
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// Waits for the process to exit (up to 10 s) and returns its exit code.
    pub fn wait_exit(&mut self) -> Option<i32> {
        for _ in 0..200 {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        None
    }
}

impl Drop for Stunnerd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if !std::thread::panicking() {
            let _ = std::fs::remove_file(&self.log);
        }
    }
}

/// `GET path` from `127.0.0.1:port`: the status code and body (`None` if nothing answers).
pub fn http_get(port: u16, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect(("127.0.0.1", port)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// The `/status` document, if the health server answers.
pub fn status(port: u16) -> Option<Value> {
    let (code, body) = http_get(port, "/status")?;
    (code == 200).then(|| serde_json::from_str(&body).ok())?
}

/// Polls `check` every 50 ms for up to `secs`; true as soon as it holds.
pub fn wait_until(secs: u64, mut check: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + Duration::from_secs(secs);
    while std::time::Instant::now() < deadline {
        if check() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

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
pub struct Driver {
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

impl Driver {
    /// A client that starts allocating on `server` with `user`/`pass`.
    pub fn new(server: SocketAddr, user: &str, pass: &str) -> Driver {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(2)))
            .unwrap();
        let local = socket.local_addr().unwrap();
        let client = TurnClientUdp::allocate(
            local,
            server,
            TurnConfig::new(TurnCredentials::new(user, pass)),
        );
        Driver {
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

    /// Deletes the allocation (Refresh with LIFETIME 0).
    pub fn delete(&mut self) {
        let now = self.now();
        let _ = self.client.delete(now);
        self.drive(0.3);
    }
}

/// An echo peer on 127.0.0.1 that counts what it receives and sends; it stops when dropped.
pub struct Peer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    counts: std::sync::Arc<std::sync::Mutex<[u64; 4]>>,
}

impl Peer {
    /// A peer on 127.0.0.1.
    pub fn start() -> Peer {
        Peer::on("127.0.0.1")
    }

    /// A peer on `ip`.
    pub fn on(ip: &str) -> Peer {
        let socket = UdpSocket::bind((ip, 0)).unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let counts = std::sync::Arc::new(std::sync::Mutex::new([0u64; 4]));
        let (stop2, counts2) = (stop.clone(), counts.clone());
        std::thread::spawn(move || {
            // Room for the largest UDP datagram, so large relayed payloads come back whole.
            let mut buf = vec![0u8; 65_536];
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    let mut c = counts2.lock().unwrap();
                    c[0] += 1;
                    c[1] += n as u64;
                    if socket.send_to(&buf[..n], from).is_ok() {
                        c[2] += 1;
                        c[3] += n as u64;
                    }
                }
            }
        });
        Peer { addr, stop, counts }
    }

    /// (received packets, received bytes, sent packets, sent bytes).
    pub fn counts(&self) -> [u64; 4] {
        *self.counts.lock().unwrap()
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// Sends `n` sequenced datagrams to `peer` one per 2 ms; how many came back.
pub fn stream(d: &mut Driver, peer: SocketAddr, tag: &str, n: u32) -> usize {
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

/// The value of the first `/metrics` sample on `port` whose line starts with `line_start`
/// (a metric name and its labels, with the trailing space).
pub fn metric(port: u16, line_start: &str) -> Option<f64> {
    let (_, body) = http_get(port, "/metrics")?;
    body.lines()
        .find_map(|l| l.strip_prefix(line_start))
        .and_then(|v| v.trim().parse().ok())
}

/// A TURN client over any of the four transports (turncat's [`Connector`]: UDP, TCP, TLS,
/// DTLS), driven one request at a time: what a peer-policy test needs to reach every entry
/// point (CreatePermission, ChannelBind, Send, ChannelData) and to see what is relayed back.
///
/// [`Connector`]: uturn_perf::turncat::transport::Connector
pub struct TurnLink {
    sender: std::sync::Arc<uturn_perf::turncat::transport::Sender>,
    receiver: uturn_perf::turncat::transport::Receiver,
    stream: bool,
    realm: String,
    nonce: String,
    /// Relayed data received, in order: (peer, payload); the peer is `None` for ChannelData.
    pub data: Vec<(Option<SocketAddr>, Vec<u8>)>,
    /// ChannelData received: (channel, payload).
    pub channel_data: Vec<(u16, Vec<u8>)>,
}

/// The username and password every [`TurnLink`] uses.
pub const LINK_CREDS: (&str, &str) = ("user1", "pass1");

impl TurnLink {
    /// Connects to `server` over `protocol` (any certificate accepted for TLS and DTLS).
    pub fn connect(
        protocol: uturn_perf::turncat::transport::Protocol,
        server: SocketAddr,
    ) -> std::io::Result<TurnLink> {
        use uturn_perf::turncat::secure::{dtls_connector, tls_config, Trust};
        use uturn_perf::turncat::transport::{Connector, Protocol, Security};
        let trust = Trust {
            insecure: true,
            ca_file: None,
        };
        let security = match protocol {
            Protocol::Udp | Protocol::Tcp => Security::Plain,
            Protocol::Tls => Security::Tls(tls_config(&trust).map_err(std::io::Error::other)?),
            Protocol::Dtls => Security::Dtls {
                connector: dtls_connector(&trust).map_err(std::io::Error::other)?,
                verify: false,
            },
        };
        let connector = Connector {
            protocol,
            server,
            server_name: server.ip().to_string(),
            security,
        };
        let (sender, receiver) = connector.connect()?;
        Ok(TurnLink {
            sender,
            receiver,
            stream: protocol.is_stream(),
            realm: String::new(),
            nonce: String::new(),
            data: Vec::new(),
            channel_data: Vec::new(),
        })
    }

    /// Sends one frame (ChannelData is padded here over streams).
    pub fn send_frame(&self, frame: &[u8]) {
        let mut frame = frame.to_vec();
        if self.stream && frame.first().is_some_and(|b| b & 0xc0 == 0x40) {
            frame.resize(frame.len().div_ceil(4) * 4, 0);
        }
        self.sender.send(&frame).expect("send to the server");
    }

    /// Reads for up to `secs`, keeping relayed data; the first STUN response for `txid`.
    fn read(&mut self, secs: f64, txid: Option<[u8; 12]>) -> Option<Vec<u8>> {
        use turn_types::attribute::{Data, XorPeerAddress};
        let deadline = std::time::Instant::now() + Duration::from_secs_f64(secs);
        while std::time::Instant::now() < deadline {
            if !self.receiver.recv().unwrap_or(false) {
                continue;
            }
            while let Ok(Some(frame)) = self.receiver.next_frame() {
                if frame.len() >= 4 && frame[0] & 0xc0 == 0x40 {
                    let channel = u16::from_be_bytes([frame[0], frame[1]]);
                    let len = usize::from(u16::from_be_bytes([frame[2], frame[3]]));
                    let payload = frame[4..(4 + len).min(frame.len())].to_vec();
                    self.channel_data.push((channel, payload.clone()));
                    self.data.push((None, payload));
                    continue;
                }
                let Ok(msg) = Message::from_bytes(frame) else {
                    continue;
                };
                if msg.has_class(MessageClass::Indication) {
                    let peer = msg
                        .attribute::<XorPeerAddress>()
                        .ok()
                        .map(|a| a.addr(msg.transaction_id()));
                    if let Ok(data) = msg.attribute::<Data>() {
                        self.data.push((peer, data.data().to_vec()));
                    }
                    continue;
                }
                if txid.is_some_and(|t| frame[8..20] == t) {
                    return Some(frame.to_vec());
                }
            }
        }
        None
    }

    /// Sends `method` with `attrs` (signed once a 401 taught the realm and nonce) and waits up
    /// to 5 s for its response: `Ok(response)` on success, `Err(code)` on an error (0: none).
    pub fn request(
        &mut self,
        method: stun_proto::types::message::Method,
        attrs: &dyn Fn(
            &mut stun_proto::types::message::MessageWriteVec,
            stun_proto::types::message::TransactionId,
        ),
    ) -> Result<Vec<u8>, u16> {
        use stun_proto::types::attribute::{Nonce, Realm};
        for _ in 0..3 {
            let creds = uturn_perf::client::Credentials {
                user: LINK_CREDS.0,
                pass: LINK_CREDS.1,
                realm: &self.realm,
                nonce: &self.nonce,
            };
            let signed = (!self.realm.is_empty()).then_some(&creds);
            let request = uturn_perf::client::build_request(method, attrs, signed).unwrap();
            let txid: [u8; 12] = request[8..20].try_into().unwrap();
            // Over UDP and DTLS a lost request is sent again (every 500 ms, for 5 s).
            let (tries, wait) = if self.stream { (1, 5.0) } else { (10, 0.5) };
            let mut reply = None;
            for _ in 0..tries {
                self.sender.send(&request).expect("send to the server");
                reply = self.read(wait, Some(txid));
                if reply.is_some() {
                    break;
                }
            }
            let reply = reply.ok_or(0u16)?;
            let msg = Message::from_bytes(&reply).map_err(|_| 0u16)?;
            if msg.has_class(MessageClass::Success) {
                return Ok(reply);
            }
            let code = msg.attribute::<ErrorCode>().map_or(0, |e| e.code());
            if code == 401 || code == 438 {
                if let (Ok(realm), Ok(nonce)) = (msg.attribute::<Realm>(), msg.attribute::<Nonce>())
                {
                    self.realm = realm.realm().into();
                    self.nonce = nonce.nonce().into();
                    continue;
                }
            }
            return Err(code);
        }
        Err(401)
    }

    /// Allocates a UDP relay (IPv6 if `ipv6`, with DONT-FRAGMENT if `dont_fragment`); the
    /// relayed address.
    pub fn allocate(&mut self, ipv6: bool, dont_fragment: bool) -> Result<SocketAddr, u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use stun_proto::types::AddressFamily;
        use turn_types::attribute::{DontFragment, RequestedAddressFamily, XorRelayedAddress};
        let reply = self.request(turn_types::message::ALLOCATE, &|m, txid| {
            uturn_perf::client::udp_transport(m, txid);
            if ipv6 {
                m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
                    .unwrap();
            }
            if dont_fragment {
                m.add_attribute(&DontFragment::new()).unwrap();
            }
        })?;
        let msg = Message::from_bytes(&reply).unwrap();
        Ok(msg
            .attribute::<XorRelayedAddress>()
            .unwrap()
            .addr(msg.transaction_id()))
    }

    /// CreatePermission for `peer`'s IP: `Err(code)` when refused.
    pub fn create_permission(&mut self, peer: SocketAddr) -> Result<(), u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use turn_types::attribute::XorPeerAddress;
        self.request(turn_types::message::CREATE_PERMISSION, &|m, txid| {
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        })
        .map(drop)
    }

    /// ChannelBind of `channel` to `peer`: `Err(code)` when refused.
    pub fn bind_channel(&mut self, channel: u16, peer: SocketAddr) -> Result<(), u16> {
        use stun_proto::types::message::MessageWriteExt as _;
        use turn_types::attribute::{ChannelNumber, XorPeerAddress};
        self.request(turn_types::message::CHANNEL_BIND, &|m, txid| {
            m.add_attribute(&ChannelNumber::new(channel)).unwrap();
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        })
        .map(drop)
    }

    /// Sends `data` to `peer` in a Send indication.
    pub fn send_indication(&self, peer: SocketAddr, data: &[u8]) {
        use stun_proto::types::message::{
            MessageType, MessageWrite, MessageWriteExt, MessageWriteVec, TransactionId,
        };
        use turn_types::attribute::{Data, XorPeerAddress};
        let txid = TransactionId::generate();
        let mut msg = Message::builder(
            MessageType::from_class_method(MessageClass::Indication, turn_types::message::SEND),
            txid,
            MessageWriteVec::new(),
        );
        msg.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        msg.add_attribute(&Data::new(data)).unwrap();
        self.sender.send(&msg.finish()).expect("send to the server");
    }

    /// Sends `data` as ChannelData on `channel`.
    pub fn send_channel_data(&self, channel: u16, data: &[u8]) {
        let mut frame = uturn_perf::client::channel_data_header(channel, data.len()).to_vec();
        frame.extend_from_slice(data);
        self.send_frame(&frame);
    }

    /// Reads for `secs`, keeping relayed data in [`TurnLink::data`].
    pub fn drain(&mut self, secs: f64) {
        self.read(secs, None);
    }
}

/// A STUN Binding request: what a relay would send a TURN listener to see whether it answers.
pub fn binding_request() -> Vec<u8> {
    use stun_proto::types::message::{
        MessageType, MessageWrite, MessageWriteVec, TransactionId, BINDING,
    };
    Message::builder(
        MessageType::from_class_method(MessageClass::Request, BINDING),
        TransactionId::generate(),
        MessageWriteVec::new(),
    )
    .finish()
}

/// `GET path` from `addr` (any family): the status code and body (`None` if nothing answers).
pub fn http_get_from(addr: SocketAddr, path: &str) -> Option<(u16, String)> {
    use std::io::{Read, Write};
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(2)).ok()?;
    stream.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut response = String::new();
    stream.read_to_string(&mut response).ok()?;
    let status = response.split_whitespace().nth(1)?.parse().ok()?;
    let body = response.split_once("\r\n\r\n")?.1.to_string();
    Some((status, body))
}

/// An echo peer on 127.0.0.1 that remembers how many datagrams came from each address: a
/// client's relay address, so a client whose allocation was lost and made again shows up
/// under a second address. Stops when dropped.
pub struct RecordingPeer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    senders: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<SocketAddr, u64>>>,
}

impl RecordingPeer {
    /// A peer on 127.0.0.1.
    pub fn start() -> RecordingPeer {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let senders: std::sync::Arc<std::sync::Mutex<std::collections::HashMap<SocketAddr, u64>>> =
            Default::default();
        let (stop2, senders2) = (stop.clone(), senders.clone());
        std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stop2.load(std::sync::atomic::Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    *senders2.lock().unwrap().entry(from).or_insert(0) += 1;
                    let _ = socket.send_to(&buf[..n], from);
                }
            }
        });
        RecordingPeer {
            addr,
            stop,
            senders,
        }
    }

    /// Datagrams received, by sender.
    pub fn senders(&self) -> std::collections::HashMap<SocketAddr, u64> {
        self.senders.lock().unwrap().clone()
    }
}

impl Drop for RecordingPeer {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// A turncat tunnel (uturn-perf's, in this process) from a fresh local UDP port through the
/// TURN server at `server_uri` (any certificate accepted) to `peer`, and a socket connected
/// to that port, once a datagram has made the round trip. The tunnel runs until the test
/// process ends.
pub fn turncat_tunnel(server_uri: &str, peer: SocketAddr) -> UdpSocket {
    use uturn_perf::turncat::{Args, Tunnel};
    let local = SocketAddr::from(([127, 0, 0, 1], free_port()));
    let tunnel = Tunnel::resolve(
        &Args {
            client: format!("udp://{local}"),
            server: server_uri.to_string(),
            peer: format!("udp://{peer}"),
            insecure: true,
            ..Args::default()
        },
        0,
    )
    .unwrap();
    std::thread::spawn(move || tunnel.run());
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket.connect(local).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(100)))
        .unwrap();
    let mut buf = [0u8; 64];
    let through = wait_until(15, || {
        let _ = socket.send(b"hello");
        matches!(socket.recv(&mut buf), Ok(5))
    });
    assert!(through, "no round trip through {server_uri}");
    // Echoes of the extra hellos still in flight.
    std::thread::sleep(Duration::from_millis(300));
    while socket.recv(&mut buf).is_ok() {}
    socket
}

/// Sends numbered datagrams through `socket` (see [`turncat_tunnel`]) one per 10 ms until
/// `stop`, then waits for the stragglers; (sent, echoed back).
pub fn paced_echo(socket: &UdpSocket, stop: &std::sync::atomic::AtomicBool) -> (u64, u64) {
    let (mut sent, mut echoed) = (0u64, 0u64);
    let mut buf = [0u8; 64];
    socket
        .set_read_timeout(Some(Duration::from_millis(10)))
        .unwrap();
    let mut drain = |echoed: &mut u64| {
        while let Ok(n) = socket.recv(&mut buf) {
            if buf[..n].starts_with(b"seq ") {
                *echoed += 1;
            }
        }
    };
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        if socket.send(format!("seq {sent:06}").as_bytes()).is_ok() {
            sent += 1;
        }
        drain(&mut echoed);
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    while echoed < sent && std::time::Instant::now() < deadline {
        drain(&mut echoed);
    }
    (sent, echoed)
}

/// The server certificate (PEM) `openssl s_client` sees on 127.0.0.1:`port`, over DTLS 1.2
/// if `dtls`, else TLS.
pub fn served_certificate(port: u16, dtls: bool) -> Option<String> {
    let mut command = Command::new("timeout");
    command.args(["10", "openssl", "s_client"]);
    if dtls {
        command.arg("-dtls1_2");
    }
    let output = command
        .args(["-connect", &format!("127.0.0.1:{port}")])
        .stdin(Stdio::null())
        .output()
        .expect("openssl (apt-get install openssl)");
    let text = String::from_utf8_lossy(&output.stdout);
    let begin = text.find("-----BEGIN CERTIFICATE-----")?;
    let end = text[begin..].find("-----END CERTIFICATE-----")? + begin;
    Some(text[begin..end + "-----END CERTIFICATE-----".len()].to_string() + "\n")
}

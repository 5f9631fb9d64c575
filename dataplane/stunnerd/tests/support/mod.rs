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
            let mut buf = [0u8; 2048];
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

//! turncat as a test drives it: the real `turncat` binary in front of a TURN server (any
//! server that listens on loopback and accepts `turn://` URIs), or uturn-perf's tunnel in
//! this process; and the datagram round trips that check what comes back.

use crate::peers::Peer;
use crate::stunnerd::{free_port, wait_until, workspace_binary, Killed};
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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

/// Datagrams a transport test sends.
pub const DATAGRAMS: usize = 10_000;

/// Datagrams in flight at most: well under any socket buffer.
pub const WINDOW: usize = 64;

/// The bound on one transport test's relay phase.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A running `turncat` listening on a loopback UDP port; killed when dropped.
pub struct Turncat {
    /// Where it listens for clients.
    pub listen: SocketAddr,
    stderr: Arc<Mutex<Vec<String>>>,
    _child: Killed,
}

impl Turncat {
    /// Starts `turncat [extra_args] udp://127.0.0.1:FREE <server_uri> udp://<peer>`.
    pub fn start(server_uri: &str, peer: SocketAddr, extra_args: &[&str]) -> Turncat {
        let listen: SocketAddr = format!("127.0.0.1:{}", free_port()).parse().unwrap();
        let mut child = Command::new(workspace_binary("turncat"))
            .args(extra_args)
            .arg(format!("udp://{listen}"))
            .arg(server_uri)
            .arg(format!("udp://{peer}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("start the turncat binary");
        let pipe = child.stderr.take().unwrap();
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let lines = stderr.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                lines.lock().unwrap().push(line);
            }
        });
        Turncat {
            listen,
            stderr,
            _child: Killed(child),
        }
    }

    /// Everything turncat printed to stderr so far.
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().join("\n")
    }

    /// Waits for the "allocation ready" line of the flow from `client`, and returns it.
    pub fn wait_ready(&self, client: SocketAddr, timeout: Duration) -> Result<String, String> {
        let prefix = format!("turncat: {client} -> relay ");
        let deadline = Instant::now() + timeout;
        loop {
            let found = self
                .stderr
                .lock()
                .unwrap()
                .iter()
                .find(|line| line.starts_with(&prefix))
                .cloned();
            if let Some(line) = found {
                return Ok(line);
            }
            if Instant::now() >= deadline {
                return Err(format!(
                    "no ready line for {client} after {timeout:?}; turncat said:\n{}",
                    self.stderr()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// What a [`roundtrip`] moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Roundtrip {
    /// Datagrams sent (and, on success, received back).
    pub datagrams: usize,
    /// Payload bytes sent.
    pub bytes_sent: usize,
    /// Payload bytes received.
    pub bytes_received: usize,
    /// How long the relay phase took.
    pub elapsed: Duration,
}

/// Datagram `seq` of a run: the sequence number, then filler derived from it, 100 to 1000
/// bytes in all.
pub fn payload(seq: u64) -> Vec<u8> {
    let len = 100 + (seq.wrapping_mul(7919) % 901) as usize;
    let mut bytes = seq.to_be_bytes().to_vec();
    bytes.extend((8..len).map(|i| (seq as usize).wrapping_mul(31).wrapping_add(i) as u8));
    bytes
}

/// Sends `count` distinct datagrams from `client` to `target` with at most `window`
/// unanswered, and checks each echo arrives, whole and in order, before `deadline` elapses.
pub fn roundtrip(
    client: &UdpSocket,
    target: SocketAddr,
    count: usize,
    window: usize,
    deadline: Duration,
) -> Result<Roundtrip, String> {
    client
        .set_read_timeout(Some(Duration::from_secs(5)))
        .unwrap();
    let start = Instant::now();
    let mut report = Roundtrip {
        datagrams: count,
        bytes_sent: 0,
        bytes_received: 0,
        elapsed: Duration::ZERO,
    };
    let mut buf = vec![0u8; 65_536];
    let (mut sent, mut received) = (0usize, 0usize);
    while received < count {
        if start.elapsed() > deadline {
            return Err(format!(
                "deadline {deadline:?} passed with {received} of {count} datagrams back"
            ));
        }
        while sent < count && sent - received < window {
            let data = payload(sent as u64);
            client
                .send_to(&data, target)
                .map_err(|e| format!("send datagram {sent}: {e}"))?;
            report.bytes_sent += data.len();
            sent += 1;
        }
        let n = client.recv(&mut buf).map_err(|e| {
            format!("datagram {received} did not come back within 5 s ({sent} sent): {e}")
        })?;
        let want = payload(received as u64);
        if buf[..n] != want[..] {
            let got_seq = buf
                .get(..8)
                .map(|b| u64::from_be_bytes(b.try_into().unwrap()));
            return Err(format!(
                "datagram {received}: got {n} bytes (sequence {got_seq:?}), want {} bytes: \
                 lost, reordered or corrupted",
                want.len()
            ));
        }
        report.bytes_received += n;
        received += 1;
    }
    report.elapsed = start.elapsed();
    Ok(report)
}

/// Sends a warm-up datagram every 500 ms (turncat may not be listening yet) until one comes
/// back, checks the flow printed its ready line, and drains the other warm-up echoes.
pub fn warm_up(client: &UdpSocket, turncat: &Turncat, timeout: Duration) -> Result<(), String> {
    const WARM_UP: &[u8] = b"warm-up";
    client
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let deadline = Instant::now() + timeout;
    let mut buf = [0u8; 64];
    loop {
        if Instant::now() >= deadline {
            return Err(format!(
                "no warm-up echo after {timeout:?}; turncat said:\n{}",
                turncat.stderr()
            ));
        }
        client.send_to(WARM_UP, turncat.listen).unwrap();
        if matches!(client.recv(&mut buf), Ok(n) if &buf[..n] == WARM_UP) {
            break;
        }
    }
    turncat.wait_ready(client.local_addr().unwrap(), Duration::from_secs(1))?;
    client
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    for _ in 0..1000 {
        match client.recv(&mut buf) {
            Ok(n) if &buf[..n] == WARM_UP => continue,
            Ok(n) => return Err(format!("unexpected {n}-byte datagram after the warm-up")),
            Err(_) => return Ok(()),
        }
    }
    Err("warm-up echoes do not stop".to_owned())
}

/// The whole check for one server URI: an echo peer, a turncat with `turncat_args` in front
/// of the server, one warm-up datagram (and the flow's ready line), then [`DATAGRAMS`]
/// datagrams through [`roundtrip`]. Panics with turncat's stderr on failure.
pub fn relay_through(server_uri: &str, turncat_args: &[&str]) -> Roundtrip {
    let echo = Peer::start();
    let turncat = Turncat::start(server_uri, echo.addr, turncat_args);
    let client = UdpSocket::bind("127.0.0.1:0").unwrap();
    warm_up(&client, &turncat, Duration::from_secs(20))
        .unwrap_or_else(|e| panic!("{server_uri}: {e}"));
    let report = roundtrip(&client, turncat.listen, DATAGRAMS, WINDOW, DEADLINE)
        .unwrap_or_else(|e| panic!("{server_uri}: {e}; turncat said:\n{}", turncat.stderr()));
    assert_eq!(report.bytes_sent, report.bytes_received, "{server_uri}");
    eprintln!(
        "{server_uri}: {} datagrams, {} bytes each way in {:?}",
        report.datagrams, report.bytes_sent, report.elapsed
    );
    report
}

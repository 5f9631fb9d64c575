//! End-to-end helpers for turncat, generic over the TURN server: any server that listens on
//! loopback and accepts `turn://…` URIs works. A test starts its server, then calls
//! [`relay_through`] with the server's URI; the helpers own the UDP echo peer, the real
//! `turncat` binary and the client socket, and stop every process they started.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Datagrams a transport test sends.
pub const DATAGRAMS: usize = 10_000;
/// Datagrams in flight at most: well under any socket buffer.
pub const WINDOW: usize = 64;
/// The bound on one transport test's relay phase.
pub const DEADLINE: Duration = Duration::from_secs(60);

/// A child process killed (and reaped) when dropped.
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A port free for UDP and TCP that no other test in this process gets (see
/// `uturn_perf::ports`: two stunnerds sharing a port by chance split one client's packets).
pub use uturn_perf::ports::free_port;

/// Waits until something accepts TCP connections on `addr`.
pub fn wait_for_tcp(addr: SocketAddr, timeout: Duration) -> Result<(), String> {
    let deadline = Instant::now() + timeout;
    loop {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return Ok(());
        }
        if Instant::now() >= deadline {
            return Err(format!("nothing listens on tcp {addr} after {timeout:?}"));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A fresh directory under the system temp dir.
pub fn temp_dir(label: &str) -> PathBuf {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let dir = std::env::temp_dir().join(format!(
        "uturn-{label}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A self-signed certificate for `localhost` and 127.0.0.1 and its key, as PEM files.
pub struct Certificate {
    /// The certificate.
    pub cert: PathBuf,
    /// The private key.
    pub key: PathBuf,
}

/// Writes a self-signed P-256 certificate (CN=localhost) into `dir`.
pub fn self_signed_cert(dir: &Path) -> Certificate {
    use openssl::asn1::Asn1Time;
    use openssl::bn::BigNum;
    use openssl::ec::{EcGroup, EcKey};
    use openssl::hash::MessageDigest;
    use openssl::nid::Nid;
    use openssl::pkey::PKey;
    use openssl::x509::extension::SubjectAlternativeName;
    use openssl::x509::{X509Builder, X509NameBuilder};

    let group = EcGroup::from_curve_name(Nid::X9_62_PRIME256V1).unwrap();
    let key = PKey::from_ec_key(EcKey::generate(&group).unwrap()).unwrap();
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_nid(Nid::COMMONNAME, "localhost")
        .unwrap();
    let name = name.build();
    let mut x509 = X509Builder::new().unwrap();
    x509.set_version(2).unwrap();
    let serial = BigNum::from_u32(1).unwrap().to_asn1_integer().unwrap();
    x509.set_serial_number(&serial).unwrap();
    x509.set_subject_name(&name).unwrap();
    x509.set_issuer_name(&name).unwrap();
    x509.set_pubkey(&key).unwrap();
    x509.set_not_before(&Asn1Time::days_from_now(0).unwrap())
        .unwrap();
    x509.set_not_after(&Asn1Time::days_from_now(1).unwrap())
        .unwrap();
    let san = SubjectAlternativeName::new()
        .dns("localhost")
        .ip("127.0.0.1")
        .build(&x509.x509v3_context(None, None))
        .unwrap();
    x509.append_extension(san).unwrap();
    x509.sign(&key, MessageDigest::sha256()).unwrap();
    let cert = dir.join("cert.pem");
    let key_path = dir.join("key.pem");
    std::fs::write(&cert, x509.build().to_pem().unwrap()).unwrap();
    std::fs::write(&key_path, key.private_key_to_pem_pkcs8().unwrap()).unwrap();
    Certificate {
        cert,
        key: key_path,
    }
}

/// A UDP echo peer on loopback, stopped when dropped.
pub struct EchoServer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl EchoServer {
    /// Starts an echo peer on a free loopback port.
    pub fn start() -> EchoServer {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let addr = socket.local_addr().unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = vec![0u8; 65_536];
            while !stopped.load(Ordering::Relaxed) {
                if let Ok((n, from)) = socket.recv_from(&mut buf) {
                    let _ = socket.send_to(&buf[..n], from);
                }
            }
        });
        EchoServer {
            addr,
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for EchoServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

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
        let mut child = Command::new(env!("CARGO_BIN_EXE_turncat"))
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
    let echo = EchoServer::start();
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

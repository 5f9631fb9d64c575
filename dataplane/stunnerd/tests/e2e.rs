//! End to end on loopback: the real `stunnerd` binary against coturn's `turnutils_uclient` and
//! `turnutils_peer`.

use std::io::Read;
use std::net::UdpSocket;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

fn free_udp_port() -> u16 {
    UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A process killed (by PID) when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

impl Proc {
    fn stdout(mut self) -> String {
        let _ = self.0.kill();
        let _ = self.0.wait();
        let mut out = String::new();
        if let Some(mut s) = self.0.stdout.take() {
            let _ = s.read_to_string(&mut out);
        }
        out
    }
}

fn stunnerd(args: &[&str], shards: &str) -> Proc {
    let child = Command::new(env!("CARGO_BIN_EXE_stunnerd"))
        .args(args)
        .env("UTURN_SHARDS", shards)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start stunnerd");
    std::thread::sleep(Duration::from_millis(500));
    Proc(child)
}

fn config_file(auth: &str, port: u16, cluster: &str) -> tempfile_path::Path {
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {auth}\nlisteners: [{{name: udp, address: 127.0.0.1, port: {port}, routes: [media]}}]\nclusters: [{{name: media, endpoints: [\"{cluster}\"]}}]\n"
    );
    tempfile_path::Path::new(&text)
}

mod tempfile_path {
    /// A temporary file removed on drop.
    pub struct Path(pub std::path::PathBuf);
    impl Path {
        pub fn new(text: &str) -> Path {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("uturn-e2e-{}-{n}.yaml", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Path(path)
        }
        pub fn origin(&self) -> String {
            format!("file://{}", self.0.display())
        }
    }
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn turnutils_peer(port: u16) -> Proc {
    let child = Command::new("turnutils_peer")
        .args(["-p", &port.to_string(), "-L", "127.0.0.1"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("turnutils_peer (apt-get install coturn)");
    Proc(child)
}

/// Runs `turnutils_uclient` and returns (messages sent, messages received, output).
fn uclient(args: &[&str]) -> (u64, u64, String) {
    let output = Command::new("timeout")
        .arg("60")
        .arg("turnutils_uclient")
        .args(args)
        .output()
        .expect("turnutils_uclient (apt-get install coturn)");
    let text = String::from_utf8_lossy(&output.stdout).to_string()
        + &String::from_utf8_lossy(&output.stderr);
    let last = |key: &str| {
        text.lines()
            .rev()
            .find_map(|l| l.split(key).nth(1))
            .and_then(|rest| rest.split(',').next())
            .and_then(|n| n.trim().parse::<u64>().ok())
            .unwrap_or(0)
    };
    (last("tot_send_msgs="), last("tot_recv_msgs="), text)
}

const STATIC: &str = "{type: static, credentials: {username: user1, password: \"pa$$w0rd\"}}";

struct Setup {
    _server: Proc,
    _peer: Proc,
    _config: tempfile_path::Path,
    port: String,
    peer_port: String,
}

fn setup(auth: &str) -> Setup {
    let port = free_udp_port();
    let peer_port = free_udp_port();
    let config = config_file(auth, port, "127.0.0.1");
    let server = stunnerd(&["-c", &config.origin()], "2");
    let peer = turnutils_peer(peer_port);
    Setup {
        _server: server,
        _peer: peer,
        _config: config,
        port: port.to_string(),
        peer_port: peer_port.to_string(),
    }
}

fn relay_all(s: &Setup, extra: &[&str], creds: &[&str]) {
    let mut args = vec![
        "-c",
        "-n",
        "20",
        "-l",
        "120",
        "-p",
        &s.port,
        "-e",
        "127.0.0.1",
        "-r",
        &s.peer_port,
    ];
    args.extend_from_slice(creds);
    args.extend_from_slice(extra);
    args.push("127.0.0.1");
    let (sent, received, text) = uclient(&args);
    assert!(sent > 0, "nothing sent:\n{text}");
    assert_eq!(received, sent, "lost datagrams:\n{text}");
}

#[test]
fn uclient_channel_mode_static_credentials() {
    let s = setup(STATIC);
    relay_all(&s, &["-m", "4"], &["-u", "user1", "-w", "pa$$w0rd"]);
}

#[test]
fn uclient_send_indication_mode_with_dont_fragment() {
    let s = setup(STATIC);
    relay_all(
        &s,
        &["-s", "-g", "-m", "2"],
        &["-u", "user1", "-w", "pa$$w0rd"],
    );
}

#[test]
fn uclient_ephemeral_credentials() {
    let s = setup("{type: ephemeral, credentials: {secret: s3cr3t}}");
    relay_all(&s, &["-m", "2"], &["-W", "s3cr3t", "-u", "alice"]);
}

#[test]
fn uclient_client_to_client() {
    let port = free_udp_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let _server = stunnerd(&["-c", &config.origin()], "2");
    let port = port.to_string();
    let (sent, received, text) = uclient(&[
        "-c",
        "-y",
        "-n",
        "20",
        "-m",
        "2",
        "-p",
        &port,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(sent > 0, "{text}");
    assert_eq!(received, sent, "{text}");
}

#[test]
fn turn_uri_mode_relays() {
    let port = free_udp_port();
    let peer_port = free_udp_port();
    let uri = format!("turn://user1:pass1@127.0.0.1:{port}?transport=udp");
    let server = stunnerd(&[&uri], "1");
    let _peer = turnutils_peer(peer_port);
    let (port, peer_port) = (port.to_string(), peer_port.to_string());
    let (sent, received, text) = uclient(&[
        "-c",
        "-n",
        "10",
        "-p",
        &port,
        "-e",
        "127.0.0.1",
        "-r",
        &peer_port,
        "-u",
        "user1",
        "-w",
        "pass1",
        "127.0.0.1",
    ]);
    assert!(sent > 0 && received == sent, "{text}");
    let log = server.stdout();
    assert!(
        log.contains("use username \"user1\" and password \"pass1\""),
        "{log}"
    );
}

#[test]
fn wrong_password_is_refused_and_allocates_nothing() {
    let port = free_udp_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let server = stunnerd(&["-l", "all:DEBUG", "-c", &config.origin()], "1");
    let port = port.to_string();
    let (_, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-p",
        &port,
        "-e",
        "127.0.0.1",
        "-r",
        "9",
        "-u",
        "user1",
        "-w",
        "wrong",
        "127.0.0.1",
    ]);
    assert_eq!(received, 0);
    assert!(text.contains("Cannot complete Allocation"), "{text}");
    let log = server.stdout();
    assert!(!log.contains("Allocation created"), "{log}");
}

#[test]
fn peer_outside_routed_clusters_gets_403_and_nothing_relayed() {
    let port = free_udp_port();
    let peer_port = free_udp_port();
    // Only 127.0.0.1 is routed; the peer listens on 127.0.0.2.
    let config = config_file(STATIC, port, "127.0.0.1");
    let _server = stunnerd(&["-c", &config.origin()], "1");
    let peer = Command::new("turnutils_peer")
        .args(["-p", &peer_port.to_string(), "-L", "127.0.0.2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Proc)
        .unwrap();
    let (port, peer_port) = (port.to_string(), peer_port.to_string());
    let (_, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-p",
        &port,
        "-e",
        "127.0.0.2",
        "-r",
        &peer_port,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(text.contains("error 403"), "{text}");
    assert_eq!(received, 0, "{text}");
    drop(peer);
}

#[test]
fn malformed_datagrams_leave_the_server_serving() {
    let s = setup(STATIC);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let target = format!("127.0.0.1:{}", s.port);
    let mut seed: u32 = 0xdead_beef;
    for i in 0..1000u32 {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let len = (seed % 200) as usize;
        let mut data: Vec<u8> = (0..len)
            .map(|j| (seed.rotate_left(j as u32) ^ i) as u8)
            .collect();
        if i % 2 == 0 && len >= 20 {
            data[0] = 0;
            data[1] = 3;
            data[4..8].copy_from_slice(&[0x21, 0x12, 0xA4, 0x42]);
        }
        if i % 5 == 0 && len >= 4 {
            data[0] = 0x40;
        }
        socket.send_to(&data, &target).unwrap();
    }
    relay_all(&s, &["-m", "2"], &["-u", "user1", "-w", "pa$$w0rd"]);
}

#[test]
fn udp_thread_num_spreads_64_clients_over_two_shards() {
    let port = free_udp_port();
    let peer_port = free_udp_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let server = stunnerd(&["-l", "all:DEBUG", "-u", "4", "-c", &config.origin()], "2");
    let _peer = turnutils_peer(peer_port);
    let (port_s, peer_s) = (port.to_string(), peer_port.to_string());
    let (sent, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-m",
        "64",
        "-z",
        "5",
        "-p",
        &port_s,
        "-e",
        "127.0.0.1",
        "-r",
        &peer_s,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(sent >= 64 * 5, "{text}");
    assert_eq!(received, sent, "{text}");
    let log = server.stdout();
    let on = |shard: &str| {
        log.lines()
            .filter(|l| l.contains("Allocation created") && l.ends_with(shard))
            .count()
    };
    let (zero, one) = (on("shard=0"), on("shard=1"));
    // turnutils_uclient -m 64 opens two sessions per client.
    assert!(zero + one >= 64, "{zero}+{one} allocations:\n{log}");
    assert!(
        zero > 0 && one > 0,
        "all allocations on one shard: {zero}/{one}"
    );
}

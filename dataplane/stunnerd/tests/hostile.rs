//! Hostile input against the real stunnerd on loopback, each load bounded in count and time:
//! spoofed-looking Allocate floods, malformed datagrams and half-open TCP connections beside a
//! live relay, one user's allocation flood against its quota, relay socket exhaustion, and
//! DTLS ClientHellos that must not create sessions before a cookie round trip.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, UdpSocket};
use std::sync::Mutex;
use std::time::{Duration, Instant};
use stun_proto::types::attribute::ErrorCode;
use stun_proto::types::message::Message;
use turn_types::message::ALLOCATE;
use uturn_perf::client::{build_request, udp_transport, BenchClient, Credentials};
use uturn_shared::auth::{ephemeral_password, ephemeral_username};
use uturn_testkit::peers::Peer;
use uturn_testkit::stunnerd::{free_port, metric, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::{stream, TurnClient};

/// These tests load the machine: one at a time, so that none measures another's load.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// A stunnerd on `config`, its metrics on `metrics`, up once /metrics answers.
fn start(config: &str, metrics: u16, args: &[&str]) -> (Stunnerd, std::path::PathBuf) {
    start_with(config, metrics, args, |_| {})
}

fn start_with(
    config: &str,
    metrics: u16,
    args: &[&str],
    customize: impl FnOnce(&mut std::process::Command),
) -> (Stunnerd, std::path::PathBuf) {
    let path = temp_file("hostile.yaml");
    std::fs::write(&path, config).unwrap();
    let origin = format!("file://{}", path.display());
    let mut all = vec!["-c", origin.as_str()];
    all.extend_from_slice(args);
    let server = Stunnerd::start_with(&[], &all, &[], customize);
    assert!(
        wait_until(10, || metric(metrics, "stunner_allocations_active ")
            .is_some()),
        "stunnerd did not come up:\n{}",
        server.logs()
    );
    (server, path)
}

/// The sum of every `uturn_dropped_datagrams_total` sample.
fn dropped_total(metrics: u16) -> f64 {
    let (_, body) = uturn_testkit::stunnerd::http_get(metrics, "/metrics").expect("/metrics");
    body.lines()
        .filter(|l| l.starts_with("uturn_dropped_datagrams_total{"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

fn rss_kib(server: &Stunnerd) -> u64 {
    uturn_perf::load::rss_kib(server.pid()).expect("VmRSS")
}

fn error_code(datagram: &[u8]) -> Option<u16> {
    let msg = Message::from_bytes(datagram).ok()?;
    msg.attribute::<ErrorCode>().ok().map(|e| e.code())
}

const STATIC: &str =
    "{type: static, realm: hostile, credentials: {username: user1, password: pass1}}";

fn udp_config(turn: u16, metrics: u16, auth: &str, admin_extra: &str) -> String {
    format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"{admin_extra}}}\n\
         auth: {auth}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
         clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
    )
}

/// A TURN-UDP and a TURN-TCP listener.
fn udp_tcp_config(turn: u16, tcp: u16, metrics: u16) -> String {
    format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {STATIC}\n\
         listeners:\n\
         - {{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {tcp}, routes: [media]}}\n\
         clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
    )
}

/// An echo peer and a client with a channel bound to it, through `target`.
fn live_relay(target: SocketAddr) -> (Peer, TurnClient) {
    let peer = Peer::start();
    let mut live = TurnClient::new(target, "user1", "pass1");
    assert!(live.allocate().is_some(), "{:?}", live.events);
    assert!(live.bind(peer.addr));
    (peer, live)
}

/// `n` connections to `target` that never finish a message: half say nothing, half stop in
/// the middle of a STUN header.
fn half_open(target: SocketAddr, n: usize) -> Vec<TcpStream> {
    (0..n)
        .map(|i| {
            let mut conn = TcpStream::connect(target).unwrap();
            if i % 2 == 1 {
                conn.write_all(&[0x00, 0x03, 0x00, 0x10, 0x21]).unwrap();
            }
            conn
        })
        .collect()
}

const FLOOD_IPS: u8 = 10;
const PORTS_PER_IP: usize = 1000;
const ALLOCATES_PER_PORT: usize = 10;
const CHALLENGE_RATE: u64 = 100;
const CHALLENGE_BURST: u64 = 300;

/// 100 000 Allocates, unauthenticated or with made-up credentials, from 10 000 source ports
/// on 10 loopback addresses: no allocation, RSS within 10 MB, challenges to each source IP
/// within its token bucket, and a real client still served afterwards.
#[test]
fn spoofed_allocate_flood_creates_nothing_and_costs_no_memory() {
    let _serial = serial();
    let (turn, metrics) = (free_port(), free_port());
    let (server, _config) = start(
        &udp_config(turn, metrics, STATIC, ""),
        metrics,
        &[
            "--challenge-rate",
            &CHALLENGE_RATE.to_string(),
            "--challenge-burst",
            &CHALLENGE_BURST.to_string(),
        ],
    );
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let garbage = Credentials {
        user: "mallory",
        pass: "guess",
        realm: "hostile",
        nonce: "0123456789abcdef0123456789abcdef",
    };
    // Ten request shapes: half without credentials, half signed with made-up ones.
    let requests: Vec<Vec<u8>> = (0..ALLOCATES_PER_PORT)
        .map(|i| {
            let credentials = (i % 2 == 1).then_some(&garbage);
            build_request(ALLOCATE, &udp_transport, credentials).unwrap()
        })
        .collect();

    // Warm up what the server allocates once (buffers, tables) before the baseline.
    let warm = UdpSocket::bind("127.0.2.1:0").unwrap();
    for request in requests.iter().cycle().take(2000) {
        warm.send_to(request, target).unwrap();
    }
    std::thread::sleep(Duration::from_millis(500));
    let rss_before = rss_kib(&server);

    let started = Instant::now();
    let mut sources = HashSet::new();
    let mut challenges: HashMap<IpAddr, u64> = HashMap::new();
    let mut sent = 0u64;
    let mut buf = [0u8; 1500];
    for host in 1..=FLOOD_IPS {
        let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 1, host));
        let sockets: Vec<UdpSocket> = (0..PORTS_PER_IP)
            .map(|_| {
                let socket = UdpSocket::bind((ip, 0)).unwrap();
                socket.set_nonblocking(true).unwrap();
                sources.insert(socket.local_addr().unwrap());
                socket
            })
            .collect();
        let mut drain = |sockets: &[UdpSocket], challenges: &mut HashMap<IpAddr, u64>| {
            for socket in sockets {
                while let Ok(n) = socket.recv(&mut buf) {
                    if matches!(error_code(&buf[..n]), Some(401 | 438)) {
                        *challenges.entry(ip).or_default() += 1;
                    }
                }
            }
        };
        for request in &requests {
            for socket in &sockets {
                // A full send buffer is retried: every one of the 100 000 leaves.
                while socket.send_to(request, target).is_err() {
                    std::thread::sleep(Duration::from_micros(100));
                }
                sent += 1;
            }
            drain(&sockets, &mut challenges);
        }
        let settle = Instant::now();
        while settle.elapsed() < Duration::from_millis(300) {
            drain(&sockets, &mut challenges);
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    std::thread::sleep(Duration::from_millis(300));
    let rss_after = rss_kib(&server);

    assert_eq!(sent, 100_000);
    assert_eq!(sources.len(), 10_000, "distinct source ports");
    assert_eq!(
        metric(metrics, "stunner_allocations_active "),
        Some(0.0),
        "the flood made an allocation"
    );
    let limited = metric(
        metrics,
        "uturn_dropped_datagrams_total{reason=\"rate_limited\"} ",
    )
    .expect("rate_limited metric");
    assert!(limited > 0.0, "nothing was rate limited");
    // Each source IP: at most its bucket's burst plus what refilled while the test ran.
    let bound = CHALLENGE_BURST + (CHALLENGE_RATE as f64 * elapsed).ceil() as u64;
    assert_eq!(
        challenges.len(),
        FLOOD_IPS as usize,
        "every IP was answered: {challenges:?}"
    );
    for (ip, n) in &challenges {
        assert!(
            *n <= bound,
            "{ip} got {n} challenges, bucket allows {bound} in {elapsed:.1} s"
        );
    }
    let total: u64 = challenges.values().sum();
    assert!(
        total * 10 < sent,
        "{total} challenges for {sent} requests: not an amplifier"
    );
    let grown = rss_after.saturating_sub(rss_before);
    assert!(
        grown <= 10 * 1024,
        "RSS grew {grown} KiB ({rss_before} -> {rss_after} KiB)"
    );
    eprintln!(
        "flood: {sent} Allocates from {} ports in {elapsed:.1} s; {total} challenges (bound {bound}/IP); \
         {limited} rate limited; RSS {rss_before} -> {rss_after} KiB",
        sources.len()
    );

    // A real client, from an address that did not flood, is served as before.
    let mut client = TurnClient::new(target, "user1", "pass1");
    assert!(client.allocate().is_some(), "{:?}", client.events);
}

/// Malformed datagram kinds: junk, truncated and lying STUN headers, ChannelData from nowhere,
/// a DTLS-looking record, an oversized datagram.
fn malformed(i: usize) -> Vec<u8> {
    let mut junk = vec![0u8; 1 + (i * 7919) % 1400];
    for (j, b) in junk.iter_mut().enumerate() {
        *b = (i.wrapping_mul(31) ^ j.wrapping_mul(131)) as u8;
    }
    match i % 8 {
        0 => junk,
        1 => vec![0x00, 0x01, 0x00],
        // A Binding header that claims 64 bytes of attributes and has none.
        2 => vec![
            0x00, 0x01, 0x00, 0x40, 0x21, 0x12, 0xa4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
        ],
        // The wrong magic cookie.
        3 => vec![
            0x00, 0x03, 0x00, 0x00, 0xde, 0xad, 0xbe, 0xef, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
        ],
        // ChannelData for a channel nobody bound.
        4 => [&[0x40, 0x01, 0x00, 0x08][..], b"nochanel"].concat(),
        // An attribute that runs past the message.
        5 => vec![
            0x00, 0x03, 0x00, 0x08, 0x21, 0x12, 0xa4, 0x42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,
            0x00, 0x19, 0x00, 0x40, 0x11, 0x00, 0x00, 0x00,
        ],
        6 => [&[22u8, 0xfe, 0xfd][..], &junk].concat(),
        _ => vec![0xff; 9000],
    }
}

const MALFORMED: usize = 50_000;
const HALF_OPEN: usize = 1_000;
const LIVE: u32 = 1_500;

/// 50 000 malformed datagrams and 1 000 half-open TCP connections while a relay streams:
/// the relay loses nothing, and a new TCP client still allocates.
#[test]
fn malformed_flood_and_half_open_tcp_leave_relays_lossless() {
    let _serial = serial();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let config = udp_tcp_config(turn, tcp, metrics);
    // The 1 000 half-open connections come from one address: lift the per-address cap on
    // unauthenticated connections, which stalled_pipelining_... tests on its own.
    let (server, _config) = start(
        &config,
        metrics,
        &["--max-unauthenticated-connections-per-ip", "0"],
    );
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let (peer, mut live) = live_relay(target);

    // Half-open connections: half say nothing, half stop mid-header.
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let half_open = half_open(tcp_target, HALF_OPEN);
    assert!(
        wait_until(10, || metric(
            metrics,
            "stunner_listener_connections{name=\"tcp\"} "
        )
        .is_some_and(|open| open >= HALF_OPEN as f64)),
        "the half-open connections were not all accepted"
    );

    let dropped_before = dropped_total(metrics);
    let flood = std::thread::spawn(move || {
        let sockets: Vec<UdpSocket> = (0..10)
            .map(|_| UdpSocket::bind("127.0.0.1:0").unwrap())
            .collect();
        let datagrams: Vec<Vec<u8>> = (0..64).map(malformed).collect();
        // Paced, 1 000 every 20 ms (50 000 in about a second): a flood the server must
        // absorb, not one that fills the kernel's queue for everyone on the port.
        let mut sent = 0;
        while sent < MALFORMED {
            let tick = Instant::now();
            for _ in 0..1000 {
                let socket = &sockets[sent % sockets.len()];
                if socket
                    .send_to(&datagrams[sent % datagrams.len()], target)
                    .is_ok()
                {
                    sent += 1;
                }
            }
            std::thread::sleep(Duration::from_millis(20).saturating_sub(tick.elapsed()));
        }
        sent
    });
    let echoed = stream(&mut live, peer.addr, "live", LIVE);
    let flooded = flood.join().unwrap();
    let [peer_received, ..] = peer.counts();

    assert_eq!(flooded, MALFORMED);
    assert_eq!(
        peer_received,
        u64::from(LIVE),
        "datagrams lost on the way to the peer"
    );
    assert_eq!(echoed, LIVE as usize, "datagrams lost on the way back");
    assert!(
        wait_until(5, || dropped_total(metrics) - dropped_before
            >= MALFORMED as f64 * 0.9),
        "the server saw {} of {MALFORMED} malformed datagrams",
        dropped_total(metrics) - dropped_before
    );
    // A new TCP client is still served beside the half-open connections.
    let client = BenchClient::allocate_over(tcp_target, "user1", "pass1", true);
    assert!(client.is_ok(), "{:?}", client.err());
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
    drop(half_open);
}

/// One user's allocation flood stops at `admin.user_quota` (486) while another user still
/// allocates, and a deleted allocation gives its place back at once.
#[test]
fn allocation_flood_by_one_user_stops_at_its_quota() {
    let _serial = serial();
    let (turn, metrics) = (free_port(), free_port());
    let auth = "{type: ephemeral, realm: hostile, credentials: {secret: s3cr3t}}";
    let (_server, _config) = start(
        &udp_config(turn, metrics, auth, ", user_quota: 3"),
        metrics,
        &[],
    );
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let expiry = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
        + 3600;
    let user = |id: &str| {
        let name = ephemeral_username(expiry, id);
        let pass = ephemeral_password("s3cr3t", &name);
        (name, pass)
    };
    let (alice, alice_pass) = user("alice");
    let (bob, bob_pass) = user("bob");

    let mut held = Vec::new();
    let mut refused = 0;
    for _ in 0..30 {
        let mut d = TurnClient::new(target, &alice, &alice_pass);
        if d.allocate().is_some() {
            held.push(d);
        } else {
            assert!(
                d.responses.iter().any(|r| r.error_code == Some(486)),
                "{:?}",
                d.responses
            );
            refused += 1;
        }
    }
    assert_eq!((held.len(), refused), (3, 27));
    let mut other = TurnClient::new(target, &bob, &bob_pass);
    assert!(other.allocate().is_some(), "{:?}", other.responses);
    // Shards publish their counters every tick (100 ms).
    assert!(wait_until(2, || metric(
        metrics,
        "stunner_allocations_active "
    ) == Some(4.0)));
    assert!(wait_until(2, || metric(
        metrics,
        "uturn_dropped_datagrams_total{reason=\"quota\"} "
    ) == Some(27.0)));

    held.pop().unwrap().delete();
    let mut again = TurnClient::new(target, &alice, &alice_pass);
    assert!(again.allocate().is_some(), "{:?}", again.responses);
    let mut over = TurnClient::new(target, &alice, &alice_pass);
    assert!(over.allocate().is_none());
    assert!(over.responses.iter().any(|r| r.error_code == Some(486)));
}

/// Allocate/delete cycles of the churn test, before and after the first RSS sample.
const CHURN_WARMUP: usize = 2_000;
const CHURN: usize = 20_000;

/// Allocations that come and go cost nothing once they are gone: 20 000 allocate/delete
/// cycles (each opens and closes a relay socket) leave the server's RSS within 2 MiB of where
/// it was after a warm-up, the allocation count back at 0 and no relay socket open. (The
/// glommio engine leaked each relay socket's task, ~0.5 KB an allocation, so a gateway grew
/// ~0.5 MiB a minute under a steady 2 allocations a second.)
#[test]
fn allocation_churn_leaves_memory_and_sockets_where_they_were() {
    let _serial = serial();
    let (turn, metrics) = (free_port(), free_port());
    let (server, _config) = start(&udp_config(turn, metrics, STATIC, ""), metrics, &[]);
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let mut client = BenchClient::allocate(target, "user1", "pass1").expect("allocate");
    let mut cycle = |n: usize| {
        for i in 0..n {
            client
                .delete()
                .unwrap_or_else(|e| panic!("delete {i}: {e}"));
            client
                .reallocate()
                .unwrap_or_else(|e| panic!("allocate {i}: {e}"));
        }
    };
    cycle(CHURN_WARMUP);
    std::thread::sleep(Duration::from_millis(300));
    let before = rss_kib(&server);
    let sockets_before = open_udp_sockets(server.pid());
    cycle(CHURN);
    client.delete().expect("last delete");
    std::thread::sleep(Duration::from_millis(300));
    let after = rss_kib(&server);
    let sockets_after = open_udp_sockets(server.pid());
    eprintln!(
        "{CHURN} allocate/delete cycles: RSS {before} -> {after} KiB, UDP sockets \
         {sockets_before} -> {sockets_after}"
    );
    assert!(
        after <= before + 2 * 1024,
        "RSS grew from {before} to {after} KiB over {CHURN} allocations"
    );
    // The one allocation held while sampling is gone now.
    assert_eq!(sockets_after + 1, sockets_before);
    assert!(wait_until(2, || metric(
        metrics,
        "stunner_allocations_active "
    ) == Some(0.0)));
}

/// UDP sockets open in process `pid`, from `/proc/net/udp` and `/proc/PID/fd`.
fn open_udp_sockets(pid: u32) -> usize {
    let inodes: std::collections::HashSet<String> = ["/proc/net/udp", "/proc/net/udp6"]
        .iter()
        .flat_map(|table| {
            std::fs::read_to_string(table)
                .unwrap_or_default()
                .lines()
                .skip(1)
                .filter_map(|l| l.split_whitespace().nth(9).map(str::to_owned))
                .collect::<Vec<_>>()
        })
        .collect();
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|fd| std::fs::read_link(fd.path()).ok())
        .filter_map(|link| {
            link.to_str()?
                .strip_prefix("socket:[")?
                .strip_suffix(']')
                .map(str::to_owned)
        })
        .filter(|inode| inodes.contains(inode))
        .count()
}

/// The open-file limit the exhaustion tests give stunnerd.
const FD_LIMIT: libc::rlim_t = 64;

/// Lowers the child's open-file limit (soft and hard, so stunnerd cannot raise it).
fn fd_limit(command: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    // SAFETY: setrlimit is async-signal-safe; it runs in the child before exec.
    unsafe {
        command.pre_exec(|| {
            let limit = libc::rlimit {
                rlim_cur: FD_LIMIT,
                rlim_max: FD_LIMIT,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// With file descriptors for only a few relay sockets, the allocation that finds none gets
/// 508, and one freed by a delete is taken by the next client.
#[test]
fn relay_socket_exhaustion_gives_508_and_recovers() {
    let _serial = serial();
    let (turn, metrics) = (free_port(), free_port());
    let (server, _config) = start_with(
        &udp_config(turn, metrics, STATIC, ""),
        metrics,
        &[],
        fd_limit,
    );
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let mut held = Vec::new();
    let mut refused = None;
    for _ in 0..FD_LIMIT {
        let mut d = TurnClient::new(target, "user1", "pass1");
        if d.allocate().is_some() {
            held.push(d);
        } else {
            refused = Some(d);
            break;
        }
    }
    let refused = refused.expect("no allocation was refused within the fd limit");
    assert!(
        refused.responses.iter().any(|r| r.error_code == Some(508)),
        "{:?}",
        refused.responses
    );
    assert!(held.len() >= 5, "only {} allocations fit", held.len());
    // Deleting one frees its socket: the next client gets it.
    held.pop().unwrap().delete();
    let mut next = TurnClient::new(target, "user1", "pass1");
    assert!(next.allocate().is_some(), "{:?}", next.responses);
    // With one more deleted, a descriptor is free for the metrics server to answer, and the
    // refused allocation holds nothing.
    held.pop().unwrap().delete();
    let expected = (held.len() + 1) as f64;
    assert!(
        wait_until(2, || metric(metrics, "stunner_allocations_active ")
            == Some(expected)),
        "{:?} allocations active, expected {expected}",
        metric(metrics, "stunner_allocations_active ")
    );
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
}

/// Whether the server closed `conn` (end of stream or reset), waiting up to 20 ms.
fn closed_by_server(conn: &TcpStream) -> bool {
    let mut conn = conn;
    conn.set_read_timeout(Some(Duration::from_millis(20)))
        .unwrap();
    match std::io::Read::read(&mut conn, &mut [0u8; 64]) {
        Ok(0) => true,
        Ok(_) => false,
        Err(e) => e.kind() == std::io::ErrorKind::ConnectionReset,
    }
}

/// TCP connections that never allocate are closed after 30 s of silence, so they cannot
/// hold descriptors for ever; a connection with an allocation stays.
#[test]
fn silent_connections_without_an_allocation_are_closed() {
    let _serial = serial();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let (_server, _config) = start(&udp_tcp_config(turn, tcp, metrics), metrics, &[]);
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let open = || metric(metrics, "stunner_listener_connections{name=\"tcp\"} ");
    let mut allocated = BenchClient::allocate_over(tcp_target, "user1", "pass1", true).unwrap();
    let silent = half_open(tcp_target, 50);
    let started = Instant::now();
    assert!(wait_until(5, || open() == Some(51.0)), "{:?}", open());
    assert!(
        wait_until(45, || open() == Some(1.0)),
        "{:?} connections still open",
        open()
    );
    let took = started.elapsed();
    assert!(took >= Duration::from_secs(29), "closed after {took:?}");
    assert!(silent.iter().all(closed_by_server));
    // The allocation's connection is still served.
    let peer: SocketAddr = ([127, 0, 0, 1], 9).into();
    allocated.create_permission(peer).unwrap();
}

/// Out of file descriptors, connections waiting to be accepted neither make the shard spin
/// nor flood the log, relays go on, and once descriptors are back TCP clients are served.
#[test]
fn out_of_descriptors_accept_neither_spins_nor_floods_the_log() {
    let _serial = serial();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let config = udp_tcp_config(turn, tcp, metrics);
    let (server, _config) = start_with(&config, metrics, &[], fd_limit);
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let (peer, mut live) = live_relay(target);

    // More connections than descriptors: the kernel queues what stunnerd cannot accept.
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let conns: Vec<TcpStream> = (0..2 * FD_LIMIT)
        .filter_map(|_| TcpStream::connect_timeout(&tcp_target, Duration::from_secs(1)).ok())
        .collect();
    assert!(conns.len() as u64 > FD_LIMIT, "{} connections", conns.len());
    std::thread::sleep(Duration::from_millis(500));
    let pid = server.pid();
    let cpu_before = uturn_perf::load::cpu_seconds(pid).expect("CPU time");
    let echoed = stream(&mut live, peer.addr, "starved", 500);
    std::thread::sleep(Duration::from_millis(500));
    let cpu = uturn_perf::load::cpu_seconds(pid).expect("CPU time") - cpu_before;
    assert_eq!(
        echoed, 500,
        "the relay lost datagrams while accept was starved"
    );
    // About 1.5 s of wall time: a spinning shard would burn most of it.
    assert!(
        cpu < 0.5,
        "stunnerd used {cpu:.2} s of CPU while out of descriptors"
    );
    let logs = server.logs();
    let accept_lines = logs.lines().filter(|l| l.contains("accept")).count();
    assert!(
        accept_lines <= 20,
        "{accept_lines} accept log lines:\n{logs}"
    );

    // What could not be accepted was refused (closed), not left hanging in the backlog.
    let refused = conns.iter().filter(|c| closed_by_server(c)).count();
    eprintln!("out of descriptors: {cpu:.2} s CPU, {accept_lines} accept log lines, {refused} of {} connections refused", conns.len());
    assert!(refused > 0, "no waiting connection was refused");

    drop(conns);
    let served = wait_until(10, || {
        BenchClient::allocate_over(tcp_target, "user1", "pass1", true).is_ok()
    });
    assert!(served, "no TCP client served after descriptors came back");
}

/// A DTLS client on memory buffers, to make ClientHellos the way a real client does.
mod dtls_client {
    use openssl::ssl::{Ssl, SslContext, SslMethod, SslStream, SslVerifyMode};
    use std::collections::VecDeque;
    use std::io::{self, Read, Write};

    #[derive(Default)]
    pub(crate) struct Wire {
        pub inbox: VecDeque<Vec<u8>>,
        pub outbox: Vec<Vec<u8>>,
    }

    impl Read for Wire {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let datagram = self.inbox.pop_front().ok_or(io::ErrorKind::WouldBlock)?;
            let n = datagram.len().min(buf.len());
            buf[..n].copy_from_slice(&datagram[..n]);
            Ok(n)
        }
    }

    impl Write for Wire {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            self.outbox.push(buf.to_vec());
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    pub(crate) fn client() -> SslStream<Wire> {
        let mut context = SslContext::builder(SslMethod::dtls()).unwrap();
        context.set_verify(SslVerifyMode::NONE);
        let mut ssl = Ssl::new(&context.build()).unwrap();
        ssl.set_connect_state();
        SslStream::new(ssl, Wire::default()).unwrap()
    }

    /// Steps the handshake and returns what the client wrote.
    pub(crate) fn step(stream: &mut SslStream<Wire>) -> Vec<Vec<u8>> {
        let _ = stream.do_handshake();
        std::mem::take(&mut stream.get_mut().outbox)
    }
}

/// The DTLS handshake message type of a record (RFC 6347 §4.2.2): 3 HelloVerifyRequest,
/// 2 ServerHello.
fn handshake_type(record: &[u8]) -> Option<u8> {
    (record.len() > 13 && record[0] == 22).then(|| record[13])
}

fn exchange(socket: &UdpSocket, to: SocketAddr, datagram: &[u8]) -> Vec<u8> {
    socket.send_to(datagram, to).unwrap();
    let mut buf = [0u8; 2048];
    let (n, _) = socket.recv_from(&mut buf).expect("a DTLS answer");
    buf[..n].to_vec()
}

/// A ClientHello creates no DTLS session until it echoes the cookie of a HelloVerifyRequest,
/// and a cookie is good only from the address it was made for.
#[test]
fn dtls_sessions_start_only_after_a_cookie_round_trip() {
    let _serial = serial();
    let (port, metrics) = (free_port(), free_port());
    let (cert, key) = {
        use base64::Engine as _;
        let (cert, key) = uturn_dataplane::io::tls::self_signed("127.0.0.1").unwrap();
        let encode = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
        (encode(&cert), encode(&key))
    };
    let config = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {STATIC}\n\
         listeners: [{{name: dtls, protocol: TURN-DTLS, address: 127.0.0.1, port: {port}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}]\n\
         clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
    );
    let (server, _config) = start(&config, metrics, &[]);
    let target: SocketAddr = ([127, 0, 0, 1], port).into();
    let sessions = || metric(metrics, "stunner_listener_connections{name=\"dtls\"} ");
    let opened = || {
        metric(
            metrics,
            "stunner_listener_connections_total{name=\"dtls\"} ",
        )
    };

    // The listener socket itself counts as one opened connection, as in stunnerd.
    let opened_at_start = opened().expect("DTLS listener metrics");
    let mut client = dtls_client::client();
    let hello = dtls_client::step(&mut client).remove(0);
    // 2 000 cookieless ClientHellos from 200 source ports: each gets a HelloVerifyRequest no
    // larger than itself, and no session is made.
    let mut answers = 0;
    let mut largest = 0;
    for _ in 0..200 {
        let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
        socket
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        for _ in 0..10 {
            let answer = exchange(&socket, target, &hello);
            assert_eq!(handshake_type(&answer), Some(3), "{answer:?}");
            largest = largest.max(answer.len());
            answers += 1;
        }
    }
    assert_eq!(answers, 2000);
    assert!(
        largest <= hello.len(),
        "{largest} bytes answer a {}-byte hello",
        hello.len()
    );
    // Shards publish their counters every tick (100 ms).
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(sessions(), Some(0.0));
    assert_eq!(opened(), Some(opened_at_start));

    // The real client: its ClientHello, the HelloVerifyRequest, the ClientHello with cookie.
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let verify = exchange(&socket, target, &hello);
    assert_eq!(handshake_type(&verify), Some(3));
    client.get_mut().inbox.push_back(verify);
    let with_cookie = dtls_client::step(&mut client).remove(0);
    // Replayed from another address, the cookie is refused: another HelloVerifyRequest.
    let thief = UdpSocket::bind("127.0.0.1:0").unwrap();
    thief
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    assert_eq!(
        handshake_type(&exchange(&thief, target, &with_cookie)),
        Some(3)
    );
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(opened(), Some(opened_at_start));
    // From its own address, the handshake goes on: a ServerHello, and one session.
    assert_eq!(
        handshake_type(&exchange(&socket, target, &with_cookie)),
        Some(2)
    );
    assert!(wait_until(2, || opened() == Some(opened_at_start + 1.0)));
    assert!(wait_until(2, || sessions() == Some(1.0)));
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
}

/// Splits whole TURN frames (STUN messages, padded ChannelData) off the front of `stream`.
fn take_frames(stream: &mut Vec<u8>) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut start = 0;
    while let Ok(Some(n)) = uturn_shared::framing::frame_len(&stream[start..]) {
        if start + n > stream.len() {
            break;
        }
        frames.push(stream[start..start + n].to_vec());
        start += n;
    }
    stream.drain(..start);
    frames
}

/// One non-blocking read of at most `max` bytes into `into`; 0 when nothing waits.
fn read_some(conn: &TcpStream, max: usize, into: &mut Vec<u8>) -> usize {
    let mut buf = vec![0u8; max];
    conn.set_nonblocking(true).unwrap();
    let n = std::io::Read::read(&mut &*conn, &mut buf).unwrap_or(0);
    conn.set_nonblocking(false).unwrap();
    into.extend_from_slice(&buf[..n]);
    n
}

/// The last whole frame `conn` has within 5 s (reading into `stream`), echoing `what`.
fn next_frame(conn: &TcpStream, stream: &mut Vec<u8>, what: &str) -> Vec<u8> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        read_some(conn, 1 << 17, stream);
        if let Some(frame) = take_frames(stream).pop() {
            return frame;
        }
        assert!(Instant::now() < deadline, "no echo of {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

const SLOW_READ: usize = 12 << 10;
const SLOW_SECS: u64 = 22;

/// Two TCP clients that keep reading, but more slowly than they are sent to: one allocated,
/// whose peer sends it 2 MB/s, and one unauthenticated that pipelines Bindings. Each reads
/// 12 KB every 50 ms for 22 s. The server's memory stays flat (the send queue is bounded
/// whatever the pattern of partial sends), its connection buffers stay within the bound, and
/// what the clients do read arrives whole and in order.
#[test]
fn slow_stream_readers_hold_bounded_memory() {
    let _serial = serial();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let (server, _config) = start(&udp_tcp_config(turn, tcp, metrics), metrics, &[]);
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let mut receiver = BenchClient::allocate_over(tcp_target, "user1", "pass1", true).unwrap();
    let blaster = UdpSocket::bind("127.0.0.1:0").unwrap();
    receiver
        .bind_channel(0x4000, blaster.local_addr().unwrap())
        .unwrap();
    let uturn_perf::client::Link::Tcp(receiver_conn) = &receiver.socket else {
        unreachable!("a TCP client");
    };
    let relay = receiver.relay;
    let sender = std::thread::spawn(move || {
        // 100 datagrams of 1000 bytes every 50 ms: 2 MB/s. Each carries its sequence number
        // and is filled with its low byte, so a reader can tell order and integrity.
        let mut seq = 0u64;
        let until = Instant::now() + Duration::from_secs(SLOW_SECS);
        while Instant::now() < until {
            let tick = Instant::now();
            for _ in 0..100 {
                let mut datagram = vec![seq as u8; 1000];
                datagram[..8].copy_from_slice(&seq.to_be_bytes());
                let _ = blaster.send_to(&datagram, relay);
                seq += 1;
            }
            std::thread::sleep(Duration::from_millis(50).saturating_sub(tick.elapsed()));
        }
        seq
    });
    let pipeliner = TcpStream::connect(tcp_target).unwrap();
    let binding = build_request(stun_proto::types::message::BINDING, &|_, _| {}, None).unwrap();
    let bindings: Vec<u8> = binding.repeat(500);

    let (mut received, mut answers) = (Vec::new(), Vec::new());
    let (mut last_seq, mut frames, mut binding_answers) = (None::<u64>, 0u64, 0u64);
    let (mut rss, mut buffered) = (Vec::new(), Vec::new());
    let started = Instant::now();
    let mut next_sample = started;
    while started.elapsed() < Duration::from_secs(SLOW_SECS) {
        let tick = Instant::now();
        // 500 Bindings (10 KB) every 50 ms, never waiting for the server to take them.
        pipeliner.set_nonblocking(true).unwrap();
        let _ = (&pipeliner).write(&bindings);
        pipeliner.set_nonblocking(false).unwrap();
        read_some(receiver_conn, SLOW_READ, &mut received);
        read_some(&pipeliner, SLOW_READ, &mut answers);
        for frame in take_frames(&mut received) {
            assert_eq!(
                &frame[..2],
                &[0x40, 0x00],
                "not our channel: {:?}",
                &frame[..4]
            );
            let payload = &frame[4..4 + usize::from(u16::from_be_bytes([frame[2], frame[3]]))];
            assert_eq!(payload.len(), 1000);
            let seq = u64::from_be_bytes(payload[..8].try_into().unwrap());
            assert!(
                payload[8..].iter().all(|&b| b == seq as u8),
                "datagram {seq} corrupted"
            );
            assert!(
                last_seq.is_none_or(|last| seq > last),
                "{seq} after {last_seq:?}"
            );
            last_seq = Some(seq);
            frames += 1;
        }
        for frame in take_frames(&mut answers) {
            let msg = Message::from_bytes(&frame).expect("a whole STUN message");
            assert!(msg.has_class(stun_proto::types::message::MessageClass::Success));
            binding_answers += 1;
        }
        if tick >= next_sample {
            next_sample += Duration::from_secs(1);
            rss.push(rss_kib(&server));
            buffered.push(metric(metrics, "uturn_stream_buffer_bytes ").unwrap_or(0.0));
        }
        std::thread::sleep(Duration::from_millis(50).saturating_sub(tick.elapsed()));
    }
    let sent = sender.join().unwrap();
    // After 4 s every buffer has reached its steady size; from then on nothing may grow.
    let baseline = rss[4];
    let peak = *rss[4..].iter().max().unwrap();
    eprintln!(
        "RSS KiB per second: {rss:?}; stream buffer bytes: {buffered:?}; {frames} of {sent} \
         datagrams and {binding_answers} Binding answers read"
    );
    assert!(
        peak <= baseline + 2048,
        "RSS grew from {baseline} KiB to {peak} KiB under slow readers: {rss:?}"
    );
    let most = buffered.iter().cloned().fold(0.0, f64::max);
    assert!(
        most <= (1 << 20) as f64,
        "connection buffers held {most} bytes: {buffered:?}"
    );
    assert!(frames >= 1000, "only {frames} datagrams read");
    assert!(
        binding_answers >= 100,
        "only {binding_answers} Binding answers read"
    );
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
}

/// ChannelData larger than a UDP client could send (3 000 and 9 000 bytes, and near the
/// 65 535-byte maximum) goes through a TCP client's allocation whole, both ways.
#[test]
fn large_channel_data_over_tcp_is_relayed_whole() {
    let _serial = serial();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let (server, _config) = start(&udp_tcp_config(turn, tcp, metrics), metrics, &[]);
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let echo = Peer::start();
    let peer = echo.addr;
    let mut client = BenchClient::allocate_over(tcp_target, "user1", "pass1", true).unwrap();
    client.bind_channel(0x4001, peer).unwrap();
    let uturn_perf::client::Link::Tcp(conn) = &client.socket else {
        unreachable!("a TCP client");
    };
    let mut stream = Vec::new();
    for size in [3000usize, 9000, 65_000, 1200] {
        let payload: Vec<u8> = (0..size).map(|i| (i * 13 + size) as u8).collect();
        let mut frame = uturn_perf::client::channel_data_header(0x4001, size).to_vec();
        frame.extend_from_slice(&payload);
        frame.resize(uturn_shared::framing::padded(frame.len()), 0);
        (&*conn).write_all(&frame).unwrap();
        let echoed = next_frame(conn, &mut stream, &format!("{size} bytes"));
        assert_eq!(&echoed[..2], &[0x40, 0x01]);
        let len = usize::from(u16::from_be_bytes([echoed[2], echoed[3]]));
        assert_eq!(len, size, "echo of {size} bytes came back as {len}");
        assert!(
            echoed[4..4 + len] == payload[..],
            "{size} bytes changed on the way"
        );
    }
    // A Send indication carries a large payload whole too; the answer comes on the channel.
    let payload = vec![0x5au8; 9000];
    (&*conn)
        .write_all(&client.send_indication(peer, &payload))
        .unwrap();
    let echoed = next_frame(conn, &mut stream, "the Send indication");
    assert!(echoed[4..] == payload[..], "9000 bytes changed on the way");
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
}

/// Memory the server's connected sockets on TCP port `port` hold in the kernel (what `ss -m`
/// reports per socket: receive queue, send queue, forward allocation and options), in bytes.
fn server_socket_memory(port: u16) -> u64 {
    let out = std::process::Command::new("ss")
        .args([
            "-tmnH",
            "state",
            "established",
            "sport",
            "=",
            &format!(":{port}"),
        ])
        .output()
        .expect("ss (iproute2)");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("skmem:(")
        .skip(1)
        .map(|rest| {
            let fields = rest.split(')').next().unwrap_or_default();
            fields
                .split(',')
                .filter(|f| matches!(f.as_bytes().first(), Some(b'r' | b'w' | b'f' | b'o')))
                .filter(|f| !f.starts_with("rb"))
                .filter_map(|f| f[1..].parse::<u64>().ok())
                .sum::<u64>()
        })
        .sum()
}

/// Raises this test process's open-file limit to its hard limit (it holds 1 000 sockets).
fn raise_own_fd_limit() {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) == 0 {
            limit.rlim_cur = limit.rlim_max;
            libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
        }
    }
}

/// A TCP connection to `target` from `source` (any port).
fn connect_from(source: IpAddr, target: SocketAddr) -> Option<TcpStream> {
    let socket = socket2::Socket::new(
        socket2::Domain::IPV4,
        socket2::Type::STREAM,
        Some(socket2::Protocol::TCP),
    )
    .ok()?;
    socket.bind(&SocketAddr::new(source, 0).into()).ok()?;
    socket
        .connect_timeout(&target.into(), Duration::from_secs(2))
        .ok()?;
    Some(socket.into())
}

const STALLED: usize = 1_000;

/// 1 000 connections that pipeline 8 KB of Allocates each and never read, first from one
/// address, then from ten, beside a live UDP and a live TCP relay: each address keeps at
/// most its cap of unauthenticated connections (the rest are closed at accept and counted),
/// the server's memory and its sockets' kernel memory stay small, the live relays lose
/// nothing, and the count of unauthenticated connections falls back to 0 when they close.
#[test]
fn stalled_pipelining_connections_are_capped_and_cost_little() {
    let _serial = serial();
    raise_own_fd_limit();
    let (turn, tcp, metrics) = (free_port(), free_port(), free_port());
    let (server, _config) = start(&udp_tcp_config(turn, tcp, metrics), metrics, &[]);
    let target: SocketAddr = ([127, 0, 0, 1], turn).into();
    let tcp_target: SocketAddr = ([127, 0, 0, 1], tcp).into();
    let (peer, mut live_udp) = live_relay(target);
    let mut live_tcp = BenchClient::allocate_over(tcp_target, "user1", "pass1", true).unwrap();
    let tcp_peer = Peer::start();
    live_tcp.bind_channel(0x4002, tcp_peer.addr).unwrap();
    let allocate = build_request(ALLOCATE, &udp_transport, None).unwrap();
    let pipelined = allocate.repeat((8 << 10) / allocate.len());
    let per_ip = f64::from(uturn_dataplane::io::admission::DEFAULT_MAX_UNAUTHENTICATED_PER_IP);
    let unauthenticated = || metric(metrics, "uturn_unauthenticated_connections ");
    let refused = || {
        metric(
            metrics,
            "uturn_refused_connections_total{reason=\"per_ip\"} ",
        )
    };
    std::thread::sleep(Duration::from_millis(300));
    let rss_before = rss_kib(&server);
    let kernel_before = server_socket_memory(tcp);

    let phases: [(&str, Vec<IpAddr>); 2] = [
        ("one address", vec![IpAddr::from([127, 0, 3, 1])]),
        (
            "ten addresses",
            (1..=10).map(|h| IpAddr::from([127, 0, 4, h])).collect(),
        ),
    ];
    let mut live_seq = 0u32;
    for (label, sources) in phases {
        let refused_before = refused().unwrap_or(0.0);
        let stalled: Vec<TcpStream> = (0..STALLED)
            .filter_map(|i| connect_from(sources[i % sources.len()], tcp_target))
            .collect();
        for conn in &stalled {
            conn.set_nonblocking(true).unwrap();
            let _ = (&*conn).write(&pipelined);
        }
        let held = per_ip * sources.len() as f64;
        // Every held connection's 8 KB of Allocates is answered (a 401 each) while the rest
        // are accepted: a debug build on a busy machine takes seconds for ten addresses.
        let waited = Instant::now();
        assert!(
            wait_until(30, || unauthenticated() == Some(held)),
            "{label}: {:?} unauthenticated connections held, expected {held}; {} connected, \
             {:?} refused since the phase began",
            unauthenticated(),
            stalled.len(),
            refused().map(|r| r - refused_before)
        );
        eprintln!(
            "{label}: every address at its cap after {:?}",
            waited.elapsed()
        );
        assert!(
            wait_until(5, || refused().unwrap_or(0.0) - refused_before
                >= STALLED as f64 - held),
            "{label}: {:?} refused",
            refused()
        );
        std::thread::sleep(Duration::from_secs(1));
        let rss = rss_kib(&server);
        let kernel = server_socket_memory(tcp);
        eprintln!(
            "{label}: {} connected, RSS {rss_before} -> {rss} KiB, server socket memory \
             {kernel_before} -> {kernel} bytes",
            stalled.len()
        );
        assert!(
            rss <= rss_before + 8 * 1024,
            "{label}: RSS grew from {rss_before} to {rss} KiB"
        );
        assert!(
            kernel <= kernel_before + (16 << 20),
            "{label}: the server's sockets hold {kernel} bytes"
        );
        // Both live relays lose nothing meanwhile.
        let echoed = stream(&mut live_udp, peer.addr, label, 500);
        assert_eq!(echoed, 500, "{label}: UDP relay lost datagrams");
        let uturn_perf::client::Link::Tcp(conn) = &live_tcp.socket else {
            unreachable!("a TCP client");
        };
        let mut back = Vec::new();
        let mut got = 0;
        // Paced as a call is (10 every 5 ms), so no UDP socket on the way overflows.
        for i in 0..500 {
            let mut frame = uturn_perf::client::channel_data_header(0x4002, 8).to_vec();
            frame.extend_from_slice(&u64::from(live_seq).to_be_bytes());
            live_seq += 1;
            (&*conn).write_all(&frame).unwrap();
            if i % 10 == 9 {
                std::thread::sleep(Duration::from_millis(5));
                read_some(conn, 1 << 16, &mut back);
                got += take_frames(&mut back).len();
            }
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while got < 500 && Instant::now() < deadline {
            read_some(conn, 1 << 16, &mut back);
            got += take_frames(&mut back).len();
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(got, 500, "{label}: TCP relay lost datagrams");
        drop(stalled);
        assert!(
            wait_until(10, || unauthenticated() == Some(0.0)),
            "{label}: {:?} unauthenticated connections left after they all closed",
            unauthenticated()
        );
    }
    assert!(server.logs().lines().all(|l| !l.contains("panicked")));
}

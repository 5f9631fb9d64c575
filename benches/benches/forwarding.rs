//! What second-chance forwarding costs a packet (`cargo bench -p uturn-benches --bench
//! forwarding`; root, network namespaces and nftables, as `tests/second_chance.rs`): a call's
//! ChannelData echoed by a peer, straight through pod a (the owner), then with the client's flow
//! moved to pod b, which forwards to a and returns a's answers. Reports the round-trip time
//! (median, p90, p99 of sequential pings) and the CPU both gateway pods spent per relayed
//! packet (`/proc/<pid>/task/*/schedstat`, every thread) at fixed rates and at saturation (as
//! many as the pods echo with `WINDOW` packets in flight), for each path, in one run. Bounded:
//! `PINGS` round trips, `RATES` × `SECONDS` paced packets and `SECONDS` of saturation per
//! path. It runs the release `stunnerd`: `cargo build --release -p uturn-stunnerd` first.

use std::net::UdpSocket;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use uturn_benches::process_cpu_ns;
use uturn_perf::client::{channel_data_header, BenchClient, Link};
use uturn_testkit::cluster::Cluster;
use uturn_testkit::link::LINK_CREDS;
use uturn_testkit::peers::Peer;

const PINGS: usize = 500;
/// Echoed packets a second, each for `SECONDS`.
const RATES: [u32; 3] = [500, 5_000, 20_000];
const SECONDS: u32 = 2;
/// Packets in flight at saturation.
const WINDOW: usize = 64;
const PAYLOAD: usize = 160;

fn percentile(sorted: &[Duration], p: f64) -> Duration {
    sorted[((sorted.len() - 1) as f64 * p).round() as usize]
}

fn frame() -> Vec<u8> {
    let mut frame = channel_data_header(0x4000, PAYLOAD).to_vec();
    frame.extend_from_slice(&[0x5a; PAYLOAD]);
    frame
}

/// Sequential ChannelData round trips: their times, sorted.
fn pings(socket: &UdpSocket) -> Vec<Duration> {
    let frame = frame();
    let mut buf = [0u8; 2048];
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut times = Vec::with_capacity(PINGS);
    for _ in 0..PINGS {
        let sent = Instant::now();
        socket.send(&frame).unwrap();
        if socket.recv(&mut buf).is_ok() {
            times.push(sent.elapsed());
        }
    }
    times.sort();
    times
}

/// The CPU time (ns) of pods a and b together.
fn pods_cpu(cluster: &mut Cluster) -> u64 {
    let pids = [cluster.stunnerd(0).pid(), cluster.stunnerd(1).pid()];
    pids.iter().map(|&p| process_cpu_ns(p)).sum()
}

/// What a phase measured: gateway CPU ns per echoed packet (two relayed datagrams each), echoed
/// packets a second, and the share of sent packets echoed.
struct Phase {
    cpu_per_echo: f64,
    echoes_per_second: f64,
    echoed_share: f64,
}

/// Runs `send_all` (which returns how many it sent and echoes it saw), then collects late echoes.
fn phase(
    cluster: &mut Cluster,
    socket: &UdpSocket,
    send_all: impl FnOnce(&UdpSocket) -> (usize, usize),
) -> Phase {
    let before = pods_cpu(cluster);
    socket.set_nonblocking(true).unwrap();
    let start = Instant::now();
    let (sent, mut echoed) = send_all(socket);
    let elapsed = start.elapsed();
    let mut buf = [0u8; 2048];
    let end = Instant::now() + Duration::from_millis(300);
    while Instant::now() < end {
        while socket.recv(&mut buf).is_ok() {
            echoed += 1;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    socket.set_nonblocking(false).unwrap();
    let after = pods_cpu(cluster);
    Phase {
        cpu_per_echo: (after - before) as f64 / echoed.max(1) as f64,
        echoes_per_second: echoed as f64 / elapsed.as_secs_f64(),
        echoed_share: echoed as f64 / sent.max(1) as f64,
    }
}

/// `rate` ChannelData a second for `SECONDS`.
fn paced(cluster: &mut Cluster, socket: &UdpSocket, rate: u32) -> Phase {
    let frame = frame();
    phase(cluster, socket, |socket| {
        let total = rate * SECONDS;
        let mut echoed = 0usize;
        let mut buf = [0u8; 2048];
        let start = Instant::now();
        for i in 0..total {
            let due = start + Duration::from_secs_f64(f64::from(i) / f64::from(rate));
            while Instant::now() < due {
                while socket.recv(&mut buf).is_ok() {
                    echoed += 1;
                }
                std::thread::sleep(Duration::from_micros(200));
            }
            let _ = socket.send(&frame);
        }
        (total as usize, echoed)
    })
}

/// As many ChannelData as come back with `WINDOW` in flight, for `SECONDS` (a window not
/// answered within 5 ms counts as lost and opens again).
fn saturated(cluster: &mut Cluster, socket: &UdpSocket) -> Phase {
    let frame = frame();
    phase(cluster, socket, |socket| {
        let (mut sent, mut echoed, mut in_flight) = (0usize, 0usize, 0usize);
        let mut buf = [0u8; 2048];
        let end = Instant::now() + Duration::from_secs(u64::from(SECONDS));
        let mut last_echo = Instant::now();
        while Instant::now() < end {
            while in_flight < WINDOW && socket.send(&frame).is_ok() {
                sent += 1;
                in_flight += 1;
            }
            while socket.recv(&mut buf).is_ok() {
                echoed += 1;
                in_flight = in_flight.saturating_sub(1);
                last_echo = Instant::now();
            }
            if last_echo.elapsed() > Duration::from_millis(5) {
                in_flight = 0;
                last_echo = Instant::now();
            }
        }
        (sent, echoed)
    })
}

fn main() {
    if std::env::args().any(|a| a == "--list") {
        return;
    }
    let mut cluster = Cluster::new(2);
    let config = cluster.static_config();
    let siblings = format!("static:{},{}", cluster.pod(0).ip, cluster.pod(1).ip);
    cluster.start_pods(
        &config,
        &["--siblings", &siblings],
        &[("UTURN_SIBLING_KEY", "0123456789abcdef0123456789abcdef")],
    );
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let client_ip = IpAddr::from(cluster.client_ip());
    let mut client = cluster.in_client(|| {
        BenchClient::allocate_from(
            cluster.vip(),
            Some(client_ip),
            LINK_CREDS.0,
            LINK_CREDS.1,
            false,
        )
        .expect("an allocation through the VIP")
    });
    let relay = client.relay;
    assert_eq!(relay.ip(), IpAddr::from(cluster.pod(0).ip));
    client.create_permission(peer.addr).expect("a permission");
    client.bind_channel(0x4000, peer.addr).expect("a channel");
    let Link::Udp(socket) = &client.socket else {
        unreachable!("a UDP client");
    };
    println!(
        "second-chance forwarding, {PAYLOAD}-byte ChannelData echoed by a peer; {PINGS} \
         sequential round trips, then {RATES:?}/s for {SECONDS} s each, then saturation \
         ({WINDOW} in flight, {SECONDS} s), per path"
    );
    for (path, to) in [("straight (pod a)", 0), ("forwarded (b → a → b)", 1)] {
        if to != cluster.target() {
            cluster.move_flow(to);
            // The query and its claim.
            let _ = pings(socket);
        }
        let times = pings(socket);
        println!(
            "{path:24} rtt median {:>7.1} µs  p90 {:>7.1} µs  p99 {:>7.1} µs  ({} of {PINGS})",
            percentile(&times, 0.5).as_secs_f64() * 1e6,
            percentile(&times, 0.9).as_secs_f64() * 1e6,
            percentile(&times, 0.99).as_secs_f64() * 1e6,
            times.len(),
        );
        let mut phases: Vec<(String, Phase)> = RATES
            .iter()
            .map(|&rate| (format!("{rate}/s"), paced(&mut cluster, socket, rate)))
            .collect();
        phases.push(("saturated".into(), saturated(&mut cluster, socket)));
        for (load, phase) in phases {
            println!(
                "{path:24} {load:>9} | gateway CPU {:>6.2} µs per echoed packet, {:>8.0} \
                 echoes/s, {:.1} % echoed",
                phase.cpu_per_echo / 1000.0,
                phase.echoes_per_second,
                phase.echoed_share * 100.0
            );
        }
    }
    let senders: Vec<SocketAddr> = peer.senders().into_keys().collect();
    assert_eq!(senders, vec![relay], "the peer heard another relay");
}

//! What a restart costs a call (`cargo bench -p uturn-benches --bench restart`, or
//! `perf/restart.sh` for several runs): a paced call, 50 ChannelData/s from the client to an
//! echo-less peer and 50/s from the peer to the client's relay address, through the release
//! `stunnerd` on loopback; two seconds in, the process is ended and a new one started on the
//! same config at once, and the call goes on for four more seconds, then the client sends a
//! Refresh with the nonce it has. For each way it reports the datagrams lost and the longest
//! gap between two that arrived, and whether the Refresh succeeded, per case:
//!
//! - `kill -9, no state dir`: today's restart, the baseline (the call is lost);
//! - `kill -9, --state-dir`: a crash, with the state directory;
//! - `SIGTERM --no-graceful-shutdown, --state-dir`: a restart that skips the drain.
//!
//! Then the time to re-adopt `RESTART_ALLOCATIONS` allocations (default 10 000): from the new
//! process's spawn to its `/ready` 200, beside the same process started on an empty state
//! directory; and what the journal costs a request: 5 000 Refreshes one after the other, the
//! server's CPU and the round trip per Refresh, with and without `--state-dir`. Bounded: each
//! case runs 6 s; the allocations are made once.
//! It runs the release `stunnerd`: `cargo build --release -p uturn-stunnerd` first.

use std::net::{SocketAddr, UdpSocket};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_benches::process_cpu_ns;
use uturn_perf::client::{channel_data_header, BenchClient, Link};
use uturn_testkit::stunnerd::{
    free_port, http_get, metric, temp_dir, wait_until, workspace_binary, Stunnerd,
};

const RATE: u32 = 50;
const BEFORE: Duration = Duration::from_secs(2);
const AFTER: Duration = Duration::from_secs(4);
const PAYLOAD: usize = 160;

/// A config on ports of its own, its file, and the health and metrics ports.
struct Setup {
    turn: u16,
    health: u16,
    metrics: u16,
    origin: String,
}

impl Setup {
    fn new(dir: &Path) -> Setup {
        let (turn, health, metrics) = (free_port(), free_port(), free_port());
        let config = format!(
            "version: v1\nadmin: {{name: bench/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\", \
             metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
             auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\n\
             listeners: [{{name: bench/gw/udp, address: 127.0.0.1, port: {turn}, routes: [bench/peers]}}]\n\
             clusters: [{{name: bench/peers, endpoints: [127.0.0.1]}}]\n"
        );
        let path = dir.join("stunnerd.yaml");
        std::fs::write(&path, config).unwrap();
        Setup {
            turn,
            health,
            metrics,
            origin: format!("file://{}", path.display()),
        }
    }

    fn start(&self, state: Option<&Path>, no_graceful: bool) -> Stunnerd {
        // No challenge budget: the re-adoption case allocates from one address, fast.
        let mut args = vec![
            "-c".to_string(),
            self.origin.clone(),
            "--challenge-rate=0".to_string(),
        ];
        if let Some(state) = state {
            args.push(format!("--state-dir={}", state.display()));
        }
        if no_graceful {
            args.push("--no-graceful-shutdown".into());
        }
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let binary = workspace_binary("stunnerd");
        Stunnerd::start_binary(&binary, &args, &[("UTURN_SHARDS", "2")])
    }

    fn ready(&self) -> bool {
        http_get(self.health, "/ready").is_some_and(|(code, _)| code == 200)
    }

    fn server(&self) -> SocketAddr {
        SocketAddr::from(([127, 0, 0, 1], self.turn))
    }
}

/// A case: its name, whether it runs with a state directory and with
/// `--no-graceful-shutdown`, and how the process ends.
type Case<'a> = (&'a str, bool, bool, &'a dyn Fn(&mut Stunnerd));

/// How one way of the call went: datagrams sent and received, and the longest gap between
/// two that arrived.
#[derive(Default, Clone, Copy)]
struct Way {
    sent: u64,
    received: u64,
    longest_gap: Duration,
}

/// Sends `RATE` datagrams a second from `send` until `stop`; counts what `recv` gets.
fn pace(send: impl Fn() + Send + 'static, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<u64> {
    std::thread::spawn(move || {
        let period = Duration::from_secs(1) / RATE;
        let start = Instant::now();
        let mut sent = 0u64;
        while !stop.load(Ordering::Relaxed) {
            send();
            sent += 1;
            let next = start + period * sent as u32;
            std::thread::sleep(next.saturating_duration_since(Instant::now()));
        }
        sent
    })
}

/// Counts what `socket` receives until `stop`, and the longest gap between two datagrams.
fn count(socket: UdpSocket, stop: Arc<AtomicBool>) -> std::thread::JoinHandle<(u64, Duration)> {
    std::thread::spawn(move || {
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let mut buf = [0u8; 2048];
        let (mut received, mut longest) = (0u64, Duration::ZERO);
        let mut last = Instant::now();
        while !stop.load(Ordering::Relaxed) {
            if socket.recv(&mut buf).is_ok() {
                received += 1;
                longest = longest.max(last.elapsed());
                last = Instant::now();
            }
        }
        longest = longest.max(last.elapsed());
        (received, longest)
    })
}

/// One case: the paced call through `setup`'s server, `event` half-way; both ways, the
/// Refresh's outcome and how long the new process took to be ready.
fn call(
    setup: &Setup,
    state: Option<&Path>,
    no_graceful: bool,
    event: impl Fn(&mut Stunnerd),
) -> ([Way; 2], bool, Duration) {
    let mut server = setup.start(state, no_graceful);
    assert!(wait_until(10, || setup.ready()), "{}", server.logs());
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    let peer_addr = peer.local_addr().unwrap();
    let mut client = BenchClient::allocate(setup.server(), "user1", "pass1").unwrap();
    client.create_permission(peer_addr).unwrap();
    client.bind_channel(0x4000, peer_addr).unwrap();
    let relay = client.relay;
    let Link::Udp(socket) = &client.socket else {
        unreachable!()
    };
    let socket = socket.try_clone().unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let mut frame = channel_data_header(0x4000, PAYLOAD).to_vec();
    frame.extend_from_slice(&[0x5a; PAYLOAD]);
    let to_peer = socket.try_clone().unwrap();
    let up = pace(move || drop(to_peer.send(&frame)), stop.clone());
    let from_peer = peer.try_clone().unwrap();
    let down = pace(
        move || drop(from_peer.send_to(&[0xa5; PAYLOAD], relay)),
        stop.clone(),
    );
    let at_peer = count(peer, stop.clone());
    let at_client = count(socket, stop.clone());
    std::thread::sleep(BEFORE);
    event(&mut server);
    let restarted = Instant::now();
    let mut server = setup.start(state, no_graceful);
    wait_until(10, || setup.ready());
    let ready_after = restarted.elapsed();
    std::thread::sleep(AFTER.saturating_sub(ready_after));
    stop.store(true, Ordering::Relaxed);
    let (up, down) = (up.join().unwrap(), down.join().unwrap());
    let (at_peer, at_client) = (at_peer.join().unwrap(), at_client.join().unwrap());
    std::thread::sleep(Duration::from_millis(100));
    let refreshed = client.refresh(600).is_ok();
    server.signal(libc::SIGKILL);
    server.wait_exit_for(5.0);
    let ways = [
        Way {
            sent: up,
            received: at_peer.0,
            longest_gap: at_peer.1,
        },
        Way {
            sent: down,
            received: at_client.0,
            longest_gap: at_client.1,
        },
    ];
    (ways, refreshed, ready_after)
}

/// Time from spawn to `/ready` of a process started on `state` (polled every millisecond).
fn time_to_ready(setup: &Setup, state: &Path) -> (Duration, Stunnerd) {
    let started = Instant::now();
    let server = setup.start(Some(state), false);
    while !setup.ready() {
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "{}",
            server.logs()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    (started.elapsed(), server)
}

/// One server of [`request_cost`]: its name, config, process, client, and the CPU and time its
/// Refreshes took.
type Side<'a> = (&'a str, Setup, Stunnerd, BenchClient, u64, Duration);

/// What a request costs with and without the journal: two servers side by side, one with
/// `--state-dir`, and `ROUNDS` rounds of `PER_ROUND` Refreshes one after the other on each in
/// turn; the server's CPU (every thread) and the round trip per Refresh, for each.
fn request_cost() {
    const ROUNDS: u32 = 10;
    const PER_ROUND: u32 = 500;
    let dir = temp_dir("restart-bench-requests");
    let mut sides: Vec<Side> = [false, true]
        .into_iter()
        .map(|with_state| {
            let side_dir = dir.join(if with_state { "with" } else { "without" });
            std::fs::create_dir_all(&side_dir).unwrap();
            let setup = Setup::new(&side_dir);
            let state = side_dir.join("state");
            let server = setup.start(with_state.then_some(state.as_path()), false);
            assert!(wait_until(10, || setup.ready()), "{}", server.logs());
            let client = BenchClient::allocate(setup.server(), "user1", "pass1").unwrap();
            let name = if with_state {
                "--state-dir"
            } else {
                "no state dir"
            };
            (name, setup, server, client, 0, Duration::ZERO)
        })
        .collect();
    for _ in 0..ROUNDS {
        for (_, _, server, client, cpu, time) in sides.iter_mut() {
            let (before, started) = (process_cpu_ns(server.pid()), Instant::now());
            for _ in 0..PER_ROUND {
                client.refresh(600).unwrap();
            }
            *time += started.elapsed();
            *cpu += process_cpu_ns(server.pid()) - before;
        }
    }
    let requests = ROUNDS * PER_ROUND;
    let mut line = String::from("request cost:");
    for (name, _, _, _, cpu, time) in &sides {
        line += &format!(
            " {name}: {:.1} us server CPU, {:.1} us round trip per Refresh;",
            *cpu as f64 / f64::from(requests) / 1e3,
            (*time / requests).as_secs_f64() * 1e6
        );
    }
    println!("{}", line.trim_end_matches(';'));
    drop(sides);
    let _ = std::fs::remove_dir_all(dir);
}

fn readopt(n: usize) {
    let dir = temp_dir("restart-bench-many");
    let setup = Setup::new(&dir);
    let state = dir.join("state");
    let empty = dir.join("empty");
    let (empty_ready, mut server) = time_to_ready(&setup, &empty);
    server.signal(libc::SIGKILL);
    server.wait_exit_for(5.0);
    let (_, mut server) = time_to_ready(&setup, &state);
    let made = Instant::now();
    let clients: Vec<BenchClient> = (0..n)
        .map_while(|_| BenchClient::allocate(setup.server(), "user1", "pass1").ok())
        .collect();
    let made = made.elapsed();
    server.signal(libc::SIGKILL);
    server.wait_exit_for(5.0);
    let (ready, server) = time_to_ready(&setup, &state);
    let outcome = |name: &str| {
        let line = format!("uturn_restored_allocations_total{{outcome=\"{name}\"}}");
        metric(setup.metrics, &line).unwrap_or(0.0)
    };
    let (adopted, no_relay) = (outcome("adopted"), outcome("no_relay"));
    println!(
        "re-adopt: {} allocations (made in {:.1} s): ready {:.0} ms after spawn, {adopted} adopted ({no_relay} without a relay port); \
         the same start on an empty state dir: ready after {:.0} ms",
        clients.len(),
        made.as_secs_f64(),
        ready.as_secs_f64() * 1e3,
        empty_ready.as_secs_f64() * 1e3
    );
    drop(server);
    drop(clients);
    let _ = std::fs::remove_dir_all(dir);
}

fn main() {
    // Raise the descriptor limit: the re-adoption case holds a socket per allocation.
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: plain syscalls on a local struct.
    unsafe {
        libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit);
        limit.rlim_cur = limit.rlim_max;
        libc::setrlimit(libc::RLIMIT_NOFILE, &limit);
    }
    let kill = |s: &mut Stunnerd| {
        s.signal(libc::SIGKILL);
        s.wait_exit_for(5.0);
    };
    let term = |s: &mut Stunnerd| {
        s.signal(libc::SIGTERM);
        s.wait_exit_for(5.0);
    };
    let cases: [Case; 3] = [
        ("kill -9, no state dir", false, false, &kill),
        ("kill -9, --state-dir", true, false, &kill),
        (
            "SIGTERM --no-graceful-shutdown, --state-dir",
            true,
            true,
            &term,
        ),
    ];
    for (name, with_state, no_graceful, event) in cases {
        let dir = temp_dir("restart-bench");
        let setup = Setup::new(&dir);
        let state: Option<PathBuf> = with_state.then(|| dir.join("state"));
        let (ways, refreshed, ready) = call(&setup, state.as_deref(), no_graceful, event);
        let [up, down] = ways;
        println!(
            "{name}: client->peer lost {}/{} longest gap {:.0} ms; peer->client lost {}/{} \
             longest gap {:.0} ms; Refresh after: {}; new process ready after {:.0} ms",
            up.sent.saturating_sub(up.received),
            up.sent,
            up.longest_gap.as_secs_f64() * 1e3,
            down.sent.saturating_sub(down.received),
            down.sent,
            down.longest_gap.as_secs_f64() * 1e3,
            if refreshed { "success" } else { "failed" },
            ready.as_secs_f64() * 1e3
        );
        let _ = std::fs::remove_dir_all(dir);
    }
    let n = std::env::var("RESTART_ALLOCATIONS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000);
    readopt(n);
    request_cost();
}

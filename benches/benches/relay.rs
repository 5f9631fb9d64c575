//! End-to-end relay throughput: ChannelData from a client through the real dataplane (one
//! shard) to a peer on loopback, with each IO backend (io_uring where it works here, and
//! epoll). Reports packets per second received by the peer, median of several bounded runs.

use arc_swap::ArcSwap;
use std::net::UdpSocket;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_dataplane::io::{probe, Dataplane, DataplaneConfig, IoBackend};
use uturn_perf::BenchClient;
use uturn_shared::config::parse_config;
use uturn_shared::snapshot::Snapshot;

const RUNS: usize = 5;
const RUN_TIME: Duration = Duration::from_secs(2);
const MAX_PACKETS_PER_RUN: u64 = 5_000_000;
const PAYLOAD: usize = 100;

fn main() {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not: then run one short pass.
    let quick = !std::env::args().any(|a| a == "--bench");
    match probe::probe_uring() {
        Ok(()) => bench(IoBackend::Uring, quick),
        Err(why) => println!("relay/uring: skipped: {why}"),
    }
    bench(IoBackend::Epoll, quick);
}

fn bench(backend: IoBackend, quick: bool) {
    let port = UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let config = parse_config(&format!(
        "version: v1\nauth: {{credentials: {{username: u, password: p}}}}\nlisteners: [{{name: l, address: 127.0.0.1, port: {port}, routes: [c]}}]\nclusters: [{{name: c, endpoints: [127.0.0.1]}}]\n"
    ))
    .unwrap();
    let snapshot = Arc::new(ArcSwap::from_pointee(Snapshot::from_config(
        &config,
        1,
        &|_| Vec::new(),
    )));
    let dataplane = Dataplane::start(DataplaneConfig {
        shards: 1,
        udp_thread_num: 0,
        snapshot,
        nonce_key: [9; 32],
        backend,
        limits: Default::default(),
        stream_limits: Default::default(),
        offload: None,
        siblings: None,
        state: None,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(300));

    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.set_read_timeout(Some(Duration::from_millis(200)))
        .unwrap();
    let mut client =
        BenchClient::allocate(format!("127.0.0.1:{port}").parse().unwrap(), "u", "p").unwrap();
    client
        .bind_channel(0x4000, peer.local_addr().unwrap())
        .unwrap();

    let mut frame = vec![0u8; 4 + PAYLOAD];
    frame[..2].copy_from_slice(&0x4000u16.to_be_bytes());
    frame[2..4].copy_from_slice(&(PAYLOAD as u16).to_be_bytes());

    let runs = if quick { 1 } else { RUNS };
    let run_time = if quick {
        Duration::from_millis(300)
    } else {
        RUN_TIME
    };
    let mut results = Vec::new();
    for _ in 0..runs {
        let received = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let counter = {
            let (received, stop, peer) =
                (received.clone(), stop.clone(), peer.try_clone().unwrap());
            std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(Ordering::Relaxed) {
                    if peer.recv(&mut buf).is_ok() {
                        received.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        };
        let start = Instant::now();
        let mut sent = 0u64;
        while start.elapsed() < run_time && sent < MAX_PACKETS_PER_RUN {
            if client.socket.send(&frame).is_ok() {
                sent += 1;
            }
        }
        let elapsed = start.elapsed();
        std::thread::sleep(Duration::from_millis(300));
        stop.store(true, Ordering::Relaxed);
        counter.join().unwrap();
        let got = received.load(Ordering::Relaxed);
        let pps = got as f64 / elapsed.as_secs_f64();
        println!(
            "relay/{backend}/channeldata-{PAYLOAD}B: sent {sent}, relayed {got} ({:.1}%), {pps:.0} pkts/s",
            100.0 * got as f64 / sent.max(1) as f64
        );
        results.push(pps);
    }
    results.sort_by(|a, b| a.total_cmp(b));
    println!(
        "relay/{backend}/channeldata-{PAYLOAD}B: median {:.0} pkts/s over {} run(s) (1 shard, loopback)",
        results[results.len() / 2],
        results.len()
    );
    dataplane.stop();
}

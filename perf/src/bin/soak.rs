//! soak: one stunnerd under a bounded, steady mix of everything a production gateway sees, for
//! minutes, with its memory, descriptors and allocations sampled every second.
//!
//! - Live relays, which must lose nothing: turnperf over UDP and TCP (paced, both directions),
//!   coturn's `turnutils_uclient` over TLS and DTLS to `turnutils_peer`.
//! - Churn: allocate, relay, delete, over and over: `turnutils_uclient` runs on all four
//!   transports, and our own clients that delete explicitly over UDP and close TCP connections.
//! - Slow readers: TCP clients with a channel whose peer sends faster than they read.
//! - Hostile input: malformed datagrams on the UDP and DTLS ports, an unauthenticated
//!   Allocate flood, and waves of TCP and TLS connections that pipeline requests or garbage
//!   and never read.
//!
//! It writes `samples.jsonl` (one line a second) and `soak.md` (the result table) to `--out`,
//! and beside them what each client printed (`turnperf-<transport>-<segment>.json`,
//! `uclient-tls.txt`, `uclient-dtls.txt`, the last churn run's `uclient-churn.txt`); it exits
//! 1 if the server died, a live relay lost a packet, or a slow reader saw frames out of order. Every loop is bounded by `--duration`; every process it starts it stops by PID.

use clap::Parser;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_perf::client::{channel_data_header, BenchClient, Link};
use uturn_perf::load::rss_kib;
use uturn_perf::ports::free_port;
use uturn_shared::framing::frame_len;

#[derive(Parser, Debug)]
#[command(name = "soak", about = "A bounded soak run of stunnerd")]
struct Cli {
    /// The stunnerd binary.
    #[arg(long, default_value = "target/release/stunnerd")]
    stunnerd: PathBuf,
    /// The turnperf binary.
    #[arg(long, default_value = "target/release/turnperf")]
    turnperf: PathBuf,
    /// Seconds of load.
    #[arg(short, long, default_value_t = 900)]
    duration: u64,
    /// Where the samples, logs and result table go.
    #[arg(long, default_value = "target/soak")]
    out: PathBuf,
}

const USER: &str = "user1";
const PASS: &str = "pass1";
/// Datagrams per second per live-relay client and direction.
const RATE: u64 = 50;
/// Slow readers, the bytes each reads per 50 ms, and what their peer sends each a second.
const SLOW_READERS: usize = 8;
const SLOW_READ: usize = 12_000;
const SLOW_SEND_PPS: u64 = 300;
const SLOW_SEND_SIZE: usize = 1_000;

/// Everything the run counted; the workers add to it.
#[derive(Default)]
struct Tally {
    churn_cycles: AtomicU64,
    churn_failures: AtomicU64,
    churn_errors: std::sync::Mutex<Vec<String>>,
    uclient_churn_runs: AtomicU64,
    uclient_churn_sent: AtomicU64,
    uclient_churn_received: AtomicU64,
    slow_bytes: AtomicU64,
    slow_frames: AtomicU64,
    slow_out_of_order: AtomicU64,
    slow_broken_streams: AtomicU64,
    hostile_datagrams: AtomicU64,
    hostile_connections: AtomicU64,
}

/// A child process, killed and reaped when dropped.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A client whose stdout and stderr go to a file. Not a pipe: a pipe that is read only once
/// the client exits fills after 64 KiB and then blocks the client in its next write (uclient
/// prints a line a second, so a live session stopped after about 515 s).
struct Logged {
    proc: Proc,
    log: PathBuf,
}

impl Logged {
    fn spawn(command: &mut Command, log: PathBuf, what: &str) -> Logged {
        let file = std::fs::File::create(&log).unwrap_or_else(|e| panic!("{}: {e}", log.display()));
        let child = command
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("log file"))
            .stderr(file)
            .spawn()
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        Logged {
            proc: Proc(child),
            log,
        }
    }

    /// Waits for the client to exit; what it printed.
    fn output(mut self) -> String {
        let _ = self.proc.0.wait();
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("soak: {e}");
            ExitCode::from(2)
        }
    }
}

struct Ports {
    udp: u16,
    tcp: u16,
    tls: u16,
    dtls: u16,
    health: u16,
    metrics: u16,
    peer: u16,
}

fn run(cli: &Cli) -> Result<bool, String> {
    std::fs::create_dir_all(&cli.out).map_err(|e| format!("{}: {e}", cli.out.display()))?;
    let ports = Ports {
        udp: free_port(),
        tcp: free_port(),
        tls: free_port(),
        dtls: free_port(),
        health: free_port(),
        metrics: free_port(),
        peer: free_port(),
    };
    let config = cli.out.join("stunnerd.yaml");
    let (cert, key) = certificate(&cli.out)?;
    std::fs::write(&config, config_text(&ports, &cert, &key)).map_err(|e| e.to_string())?;
    let log = std::fs::File::create(cli.out.join("stunnerd.log")).map_err(|e| e.to_string())?;
    let mut server = Proc(
        Command::new(&cli.stunnerd)
            .args(["-c", &format!("file://{}", config.display())])
            // Live allocations of clients that never delete (turnperf's) end the drain here.
            .args(["--drain-timeout", "10"])
            .stdout(log.try_clone().map_err(|e| e.to_string())?)
            .stderr(log)
            .spawn()
            .map_err(|e| format!("{}: {e}", cli.stunnerd.display()))?,
    );
    let pid = server.0.id();
    if !wait_ready(ports.health, Duration::from_secs(10)) {
        return Err("stunnerd did not become ready; see stunnerd.log".into());
    }
    let _peer = Proc(
        Command::new("turnutils_peer")
            .args(["-p", &ports.peer.to_string(), "-L", "127.0.0.1"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .map_err(|e| format!("turnutils_peer (apt-get install coturn): {e}"))?,
    );
    let started = Instant::now();
    let deadline = started + Duration::from_secs(cli.duration);
    let stop = Arc::new(AtomicBool::new(false));
    let tally = Arc::new(Tally::default());
    println!(
        "soak: stunnerd pid {pid}, {} s of load; samples in {}",
        cli.duration,
        cli.out.display()
    );

    // Live relays: they start first and end last, so churn and hostile load run beside them.
    let secs = cli.duration.saturating_sub(20).max(10);
    let udp = turnperf_segments(cli, ports.udp, "udp", 32, secs);
    let tcp = turnperf_segments(cli, ports.tcp, "tcp", 16, secs);
    let messages = (secs.saturating_sub(30).max(5) * RATE).to_string();
    let tls = uclient(
        &[
            &["-t", "-S"].map(String::from)[..],
            &live(&ports, ports.tls, &messages),
        ]
        .concat(),
        cli.duration + 60,
        cli.out.join("uclient-tls.txt"),
    );
    let dtls = uclient(
        &[
            &["-S"].map(String::from)[..],
            &live(&ports, ports.dtls, &messages),
        ]
        .concat(),
        cli.duration + 60,
        cli.out.join("uclient-dtls.txt"),
    );

    let mut workers = Vec::new();
    {
        let (stop, tally) = (stop.clone(), tally.clone());
        let turn = [ports.udp, ports.tcp];
        workers.push(std::thread::spawn(move || own_churn(turn, &stop, &tally)));
    }
    {
        let (stop, tally) = (stop.clone(), tally.clone());
        let transports = [
            (ports.udp, &[][..]),
            (ports.tcp, &["-t"][..]),
            (ports.tls, &["-t", "-S"][..]),
            (ports.dtls, &["-S"][..]),
        ]
        .map(|(p, f)| (p, f.iter().map(|s| s.to_string()).collect::<Vec<_>>()));
        let (peer, log) = (ports.peer, cli.out.join("uclient-churn.txt"));
        workers.push(std::thread::spawn(move || {
            uclient_churn(&transports, peer, &log, &stop, &tally)
        }));
    }
    {
        let (stop, tally) = (stop.clone(), tally.clone());
        let server = SocketAddr::from(([127, 0, 0, 1], ports.tcp));
        workers.push(std::thread::spawn(move || {
            slow_readers(server, &stop, &tally)
        }));
    }
    {
        let (stop, tally) = (stop.clone(), tally.clone());
        let targets = (ports.udp, ports.dtls, ports.tcp, ports.tls);
        workers.push(std::thread::spawn(move || hostile(targets, &stop, &tally)));
    }

    // Sample every second until the deadline, watching for a crash.
    let mut samples =
        std::fs::File::create(cli.out.join("samples.jsonl")).map_err(|e| e.to_string())?;
    let mut rows = Vec::new();
    let mut crashed = None;
    while Instant::now() < deadline {
        std::thread::sleep(Duration::from_secs(1));
        if let Ok(Some(status)) = server.0.try_wait() {
            crashed = Some(status.to_string());
            break;
        }
        let row = Sample {
            t: started.elapsed().as_secs(),
            rss_kib: rss_kib(pid).unwrap_or(0),
            fds: std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, |d| d.count() as u64),
            allocations: http_get(ports.health, "/status")
                .and_then(|b| serde_json::from_str::<serde_json::Value>(&b).ok())
                .and_then(|v| v["allocationCount"].as_u64())
                .unwrap_or(0),
        };
        let _ = writeln!(
            samples,
            "{{\"t\":{},\"rss_kib\":{},\"fds\":{},\"allocations\":{}}}",
            row.t, row.rss_kib, row.fds, row.allocations
        );
        rows.push(row);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.join();
    }
    let relays = [
        (
            "UDP",
            "turnperf, 32 allocations",
            udp.join().unwrap_or((0, 0, Some("panicked".into()))),
        ),
        (
            "TCP",
            "turnperf, 16 allocations",
            tcp.join().unwrap_or((0, 0, Some("panicked".into()))),
        ),
        ("TLS", "turnutils_uclient, 4 clients", finish_uclient(tls)),
        ("DTLS", "turnutils_uclient, 4 clients", finish_uclient(dtls)),
    ];
    let metrics = http_get(ports.metrics, "/metrics").unwrap_or_default();
    // A clean stop: SIGTERM, and stunnerd must exit 0 (no allocations are left by then).
    let exit = if crashed.is_none() {
        // SAFETY: kill(2) on the pid of our own child.
        unsafe { libc::kill(pid as i32, libc::SIGTERM) };
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            match server.0.try_wait() {
                Ok(Some(status)) => break status.code(),
                _ if Instant::now() > until => break None,
                _ => std::thread::sleep(Duration::from_millis(100)),
            }
        }
    } else {
        None
    };
    let report = Report {
        seconds: cli.duration,
        rows: &rows,
        relays: &relays,
        tally: &tally,
        crashed: crashed.as_deref(),
        exit,
        metrics: &metrics,
    };
    let text = report.render();
    std::fs::write(cli.out.join("soak.md"), &text).map_err(|e| e.to_string())?;
    print!("{text}");
    Ok(report.passed())
}

/// The config: one listener of each transport, the peers on 127.0.0.1 (listed exactly, as the
/// own-address rule asks), health and metrics on loopback.
fn config_text(p: &Ports, cert: &str, key: &str) -> String {
    format!(
        "version: v1\n\
         admin: {{name: soak, loglevel: \"all:WARN\", healthcheck_endpoint: \"http://127.0.0.1:{}\", metrics_endpoint: \"http://127.0.0.1:{}/metrics\"}}\n\
         auth: {{type: static, credentials: {{username: {USER}, password: {PASS}}}}}\n\
         listeners:\n\
         - {{name: udp, protocol: TURN-UDP, address: 127.0.0.1, port: {}, routes: [media]}}\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {}, routes: [media]}}\n\
         - {{name: tls, protocol: TURN-TLS, address: 127.0.0.1, port: {}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}\n\
         - {{name: dtls, protocol: TURN-DTLS, address: 127.0.0.1, port: {}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n",
        p.health, p.metrics, p.udp, p.tcp, p.tls, p.dtls
    )
}

/// A self-signed certificate and key (base64 PEM, as the config carries them), from openssl.
fn certificate(dir: &Path) -> Result<(String, String), String> {
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    let status = Command::new("openssl")
        .args([
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
        ])
        .args(["-nodes", "-days", "2", "-subj", "/CN=localhost", "-keyout"])
        .arg(&key)
        .arg("-out")
        .arg(&cert)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| format!("openssl: {e}"))?;
    if !status.success() {
        return Err("openssl req failed".into());
    }
    use base64::Engine as _;
    let b64 = |p: &Path| {
        std::fs::read(p)
            .map(|pem| base64::engine::general_purpose::STANDARD.encode(pem))
            .map_err(|e| e.to_string())
    };
    Ok((b64(&cert)?, b64(&key)?))
}

fn wait_ready(health: u16, within: Duration) -> bool {
    let until = Instant::now() + within;
    while Instant::now() < until {
        if http_get(health, "/ready").is_some_and(|b| b.contains("READY")) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    false
}

/// The body of a GET on 127.0.0.1:`port`.
fn http_get(port: u16, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(
        &SocketAddr::from(([127, 0, 0, 1], port)),
        Duration::from_secs(2),
    )
    .ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: soak\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut text = String::new();
    s.read_to_string(&mut text).ok()?;
    text.split_once("\r\n\r\n")
        .map(|(_, body)| body.to_string())
}

/// turnperf never refreshes its allocations, so a live relay longer than their 600 s lifetime
/// runs as back-to-back turnperf runs of at most `SEGMENT` seconds, their counts summed.
fn turnperf_segments(
    cli: &Cli,
    port: u16,
    transport: &'static str,
    allocations: usize,
    secs: u64,
) -> std::thread::JoinHandle<Relay> {
    const SEGMENT: u64 = 300;
    let (turnperf_bin, duration, out) = (cli.turnperf.clone(), cli.duration, cli.out.clone());
    std::thread::spawn(move || {
        let cli = Cli {
            stunnerd: PathBuf::new(),
            turnperf: turnperf_bin,
            duration,
            out,
        };
        let (mut sent, mut received, mut problem) = (0, 0, None);
        let mut left = secs;
        let mut segment = 0;
        while left > 0 && problem.is_none() {
            let run = left.min(SEGMENT);
            left -= run;
            segment += 1;
            // Each segment's report stays beside soak.md, so a loss can be traced to a
            // segment, a direction and a number of dead allocations.
            let log = cli.out.join(format!("turnperf-{transport}-{segment}.json"));
            let text = turnperf(&cli, port, transport, allocations, run, log).output();
            let (s, r, p) = finish_turnperf(&text);
            if s != r {
                eprintln!(
                    "soak: {transport} turnperf segment {segment} lost {} of {s}: {}",
                    s.saturating_sub(r),
                    cli.out
                        .join(format!("turnperf-{transport}-{segment}.json"))
                        .display()
                );
            }
            sent += s;
            received += r;
            problem = p;
        }
        (sent, received, problem)
    })
}

fn turnperf(
    cli: &Cli,
    port: u16,
    transport: &str,
    allocations: usize,
    secs: u64,
    log: PathBuf,
) -> Logged {
    Logged::spawn(
        Command::new(&cli.turnperf)
            .arg(format!("127.0.0.1:{port}"))
            .args([
                "-u",
                USER,
                "-p",
                PASS,
                "-s",
                "200",
                "--direction",
                "both",
                "--json",
                "-q",
            ])
            .args(["--transport", transport, "--peer-ip", "127.0.0.1"])
            .args([
                "-n",
                &allocations.to_string(),
                "-r",
                &RATE.to_string(),
                "-d",
                &secs.to_string(),
            ]),
        log,
        "turnperf (cargo build --release -p uturn-perf)",
    )
}

/// uclient's arguments for a live relay of `messages` per client at [`RATE`].
fn live(p: &Ports, port: u16, messages: &str) -> Vec<String> {
    vec![
        "-c".to_string(),
        "-m".into(),
        "4".into(),
        "-l".into(),
        "200".into(),
        "-z".into(),
        (1000 / RATE).to_string(),
        "-n".into(),
        messages.to_string(),
        "-p".into(),
        port.to_string(),
        "-e".into(),
        "127.0.0.1".into(),
        "-r".into(),
        p.peer.to_string(),
        "-u".into(),
        USER.into(),
        "-w".into(),
        PASS.into(),
        "127.0.0.1".into(),
    ]
}

/// uclient with `args`, stopped after `secs`, printing into `log`.
fn uclient<S: AsRef<std::ffi::OsStr>>(args: &[S], secs: u64, log: PathBuf) -> Logged {
    Logged::spawn(
        Command::new("timeout")
            .arg(secs.to_string())
            .arg("turnutils_uclient")
            .args(args),
        log,
        "turnutils_uclient (apt-get install coturn)",
    )
}

/// (sent, received, what went wrong) of one live relay, both directions summed.
type Relay = (u64, u64, Option<String>);

fn finish_turnperf(text: &str) -> Relay {
    let Some(doc) = text
        .lines()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
    else {
        return (0, 0, Some(format!("no report: {}", text.trim())));
    };
    let count = |key: &str| {
        ["up", "down"]
            .iter()
            .map(|d| doc["report"][d][key].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    (count("sent"), count("delivered"), None)
}

/// The last value of `key=N` in uclient's output.
fn uclient_count(text: &str, key: &str) -> u64 {
    text.lines()
        .rev()
        .find_map(|l| l.split(key).nth(1))
        .and_then(|rest| rest.split(',').next())
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0)
}

/// uclient's counts; its whole output stays in its log (a loss can then be placed in time).
fn finish_uclient(p: Logged) -> Relay {
    let text = p.output();
    let (sent, received) = (
        uclient_count(&text, "tot_send_msgs="),
        uclient_count(&text, "tot_recv_msgs="),
    );
    let problem = (sent == 0).then(|| text.lines().rev().take(5).collect::<Vec<_>>().join(" | "));
    (sent, received, problem)
}

/// Our own clients: allocate, permit, relay a datagram, delete (UDP) or close (TCP), in turn.
fn own_churn(turn: [u16; 2], stop: &AtomicBool, tally: &Tally) {
    let peer = UdpSocket::bind("127.0.0.1:0").expect("churn peer");
    peer.set_read_timeout(Some(Duration::from_millis(500))).ok();
    let peer_addr = peer.local_addr().expect("churn peer address");
    let mut i = 0usize;
    while !stop.load(Ordering::Relaxed) {
        let tcp = i % 2 == 1;
        let server = SocketAddr::from(([127, 0, 0, 1], turn[i % 2]));
        i += 1;
        let cycle = || -> std::io::Result<()> {
            let mut c = BenchClient::allocate_over(server, USER, PASS, tcp)?;
            c.create_permission(peer_addr)?;
            c.socket.send(&c.send_indication(peer_addr, b"churn"))?;
            let mut buf = [0u8; 64];
            let (n, _) = peer.recv_from(&mut buf)?;
            if &buf[..n] != b"churn" {
                return Err(std::io::Error::other("wrong payload"));
            }
            if !tcp {
                c.delete()?;
            }
            Ok(())
        };
        match cycle() {
            Ok(()) => tally.churn_cycles.fetch_add(1, Ordering::Relaxed),
            Err(e) => {
                if let Ok(mut errors) = tally.churn_errors.lock() {
                    if errors.len() < 3 {
                        errors.push(format!("{} {e}", if tcp { "TCP" } else { "UDP" }));
                    }
                }
                tally.churn_failures.fetch_add(1, Ordering::Relaxed)
            }
        };
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// coturn's client on each transport in turn: 8 clients, 20 messages each, then exit.
fn uclient_churn(
    transports: &[(u16, Vec<String>)],
    peer: u16,
    log: &Path,
    stop: &AtomicBool,
    tally: &Tally,
) {
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let (port, flags) = &transports[i % transports.len()];
        i += 1;
        let (port, peer) = (port.to_string(), peer.to_string());
        let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
        args.extend([
            "-c",
            "-m",
            "8",
            "-n",
            "20",
            "-z",
            "10",
            "-p",
            &port,
            "-e",
            "127.0.0.1",
            "-r",
            &peer,
            "-u",
            USER,
            "-w",
            PASS,
            "127.0.0.1",
        ]);
        let text = uclient(&args, 40, log.to_path_buf()).output();
        tally.uclient_churn_runs.fetch_add(1, Ordering::Relaxed);
        tally
            .uclient_churn_sent
            .fetch_add(uclient_count(&text, "tot_send_msgs="), Ordering::Relaxed);
        tally
            .uclient_churn_received
            .fetch_add(uclient_count(&text, "tot_recv_msgs="), Ordering::Relaxed);
    }
}

/// TCP clients whose peer sends [`SLOW_SEND_PPS`] datagrams a second on a channel while they
/// read [`SLOW_READ`] bytes every 50 ms: the server must hold a bounded queue for each and
/// drop, never reorder or cut, what does not fit.
fn slow_readers(server: SocketAddr, stop: &AtomicBool, tally: &Tally) {
    let peer = UdpSocket::bind("127.0.0.1:0").expect("slow peer");
    let peer_addr = peer.local_addr().expect("slow peer address");
    let mut readers = Vec::new();
    for _ in 0..SLOW_READERS {
        let Ok(mut c) = BenchClient::allocate_over(server, USER, PASS, true) else {
            tally.slow_broken_streams.fetch_add(1, Ordering::Relaxed);
            continue;
        };
        if c.bind_channel(0x4000, peer_addr).is_err() {
            tally.slow_broken_streams.fetch_add(1, Ordering::Relaxed);
            continue;
        }
        if let Link::Tcp(s) = &c.socket {
            s.set_nonblocking(true).ok();
        }
        readers.push((c, Vec::<u8>::new(), 0u64));
    }
    let mut payload = vec![0u8; SLOW_SEND_SIZE];
    let mut seq = 0u64;
    let tick = Duration::from_millis(50);
    let per_tick = (SLOW_SEND_PPS / 20).max(1);
    let mut next = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        for _ in 0..per_tick {
            seq += 1;
            payload[..8].copy_from_slice(&seq.to_be_bytes());
            for (c, _, _) in &readers {
                let _ = peer.send_to(&payload, c.relay);
            }
        }
        for (c, pending, last) in &mut readers {
            let Link::Tcp(s) = &c.socket else { continue };
            let start = pending.len();
            pending.resize(start + SLOW_READ, 0);
            let n: usize = (&*s).read(&mut pending[start..]).unwrap_or_default();
            pending.truncate(start + n);
            tally.slow_bytes.fetch_add(n as u64, Ordering::Relaxed);
            let mut at = 0;
            loop {
                match frame_len(&pending[at..]) {
                    Ok(Some(len)) if pending.len() - at >= len => {
                        let frame = &pending[at..at + len];
                        if frame[..2] == channel_data_header(0x4000, 0)[..2] && frame.len() >= 12 {
                            let s = u64::from_be_bytes(frame[4..12].try_into().unwrap_or([0; 8]));
                            if s < *last {
                                tally.slow_out_of_order.fetch_add(1, Ordering::Relaxed);
                            }
                            *last = s;
                            tally.slow_frames.fetch_add(1, Ordering::Relaxed);
                        }
                        at += len;
                    }
                    Ok(_) => break,
                    Err(_) => {
                        tally.slow_broken_streams.fetch_add(1, Ordering::Relaxed);
                        at = pending.len();
                        break;
                    }
                }
            }
            pending.drain(..at);
        }
        next += tick;
        std::thread::sleep(next.saturating_duration_since(Instant::now()));
    }
}

/// Malformed datagrams and unauthenticated Allocates on the UDP and DTLS ports (about 1 000 a
/// second), and every 30 s a wave of 300 TCP and 100 TLS connections from ten addresses that
/// send requests or garbage and never read, held 15 s.
fn hostile(ports: (u16, u16, u16, u16), stop: &AtomicBool, tally: &Tally) {
    let (udp, dtls, tcp, tls) = ports;
    let socket = UdpSocket::bind("127.0.0.1:0").expect("hostile socket");
    socket.set_nonblocking(true).ok();
    let mut allocate = vec![0u8; 20];
    allocate[..4].copy_from_slice(&[0x00, 0x03, 0x00, 0x00]);
    allocate[4..8].copy_from_slice(&0x2112_A442u32.to_be_bytes());
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut wave: Vec<TcpStream> = Vec::new();
    let mut last_wave = Instant::now() - Duration::from_secs(25);
    while !stop.load(Ordering::Relaxed) {
        for i in 0..50u64 {
            let r = random();
            let target = SocketAddr::from(([127, 0, 0, 1], if i % 2 == 0 { udp } else { dtls }));
            let len = (r % 300) as usize;
            let mut junk: Vec<u8> = (0..len).map(|k| (r >> (k % 56)) as u8).collect();
            match i % 5 {
                // A STUN header whose length lies.
                0 if len >= 20 => junk[..4].copy_from_slice(&[0x00, 0x01, 0x01, 0x00]),
                // An unauthenticated Allocate (a 401 at most, within the challenge budget).
                1 => {
                    allocate[8..16].copy_from_slice(&r.to_be_bytes());
                    junk.clone_from(&allocate);
                }
                _ => {}
            }
            if socket.send_to(&junk, target).is_ok() {
                tally.hostile_datagrams.fetch_add(1, Ordering::Relaxed);
            }
        }
        let mut sink = [0u8; 2048];
        while socket.recv_from(&mut sink).is_ok() {}
        if last_wave.elapsed() >= Duration::from_secs(30) {
            last_wave = Instant::now();
            let mut pipelined = Vec::new();
            for _ in 0..400 {
                allocate[8..16].copy_from_slice(&random().to_be_bytes());
                pipelined.extend_from_slice(&allocate);
            }
            for k in 0..400u16 {
                let (port, tls_port) = if k < 300 { (tcp, false) } else { (tls, true) };
                let local = SocketAddr::from(([127, 0, 9, 1 + (k % 10) as u8], 0));
                let Ok(s) = connect_from(local, SocketAddr::from(([127, 0, 0, 1], port))) else {
                    continue;
                };
                s.set_nonblocking(true).ok();
                // TCP ones pipeline Allocates; TLS ones stall in the handshake.
                if !tls_port {
                    let _ = (&s).write(&pipelined);
                }
                tally.hostile_connections.fetch_add(1, Ordering::Relaxed);
                wave.push(s);
            }
        } else if last_wave.elapsed() >= Duration::from_secs(15) {
            wave.clear();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn connect_from(local: SocketAddr, remote: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
    socket.bind(&local.into())?;
    socket.connect_timeout(&remote.into(), Duration::from_secs(1))?;
    Ok(socket.into())
}

struct Sample {
    t: u64,
    rss_kib: u64,
    fds: u64,
    allocations: u64,
}

struct Report<'a> {
    seconds: u64,
    rows: &'a [Sample],
    relays: &'a [(&'a str, &'a str, Relay)],
    tally: &'a Tally,
    crashed: Option<&'a str>,
    exit: Option<i32>,
    metrics: &'a str,
}

impl Report<'_> {
    fn passed(&self) -> bool {
        let lossless = self.relays.iter().all(|(_, _, (sent, received, problem))| {
            problem.is_none() && *sent > 0 && sent == received
        });
        self.crashed.is_none()
            && self.exit == Some(0)
            && lossless
            && self.tally.slow_out_of_order.load(Ordering::Relaxed) == 0
            && self.tally.slow_broken_streams.load(Ordering::Relaxed) == 0
    }

    fn render(&self) -> String {
        let mut s = String::new();
        let t = self.tally;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        s += &format!("## Soak: {} s\n\n", self.seconds);
        s += "| minute | RSS MiB (min-max) | open fds (min-max) | allocations (min-max) |\n|---|---|---|---|\n";
        for (minute, chunk) in self.rows.chunks(60).enumerate() {
            let range = |f: &dyn Fn(&Sample) -> u64| {
                let (lo, hi) = chunk
                    .iter()
                    .map(f)
                    .fold((u64::MAX, 0), |(lo, hi), v| (lo.min(v), hi.max(v)));
                (lo, hi)
            };
            let (r0, r1) = range(&|x| x.rss_kib);
            let (f0, f1) = range(&|x| x.fds);
            let (a0, a1) = range(&|x| x.allocations);
            s += &format!(
                "| {} | {:.1}-{:.1} | {f0}-{f1} | {a0}-{a1} |\n",
                minute + 1,
                r0 as f64 / 1024.0,
                r1 as f64 / 1024.0
            );
        }
        let after_first = self.rows.iter().skip(60);
        let (peak_rss, peak_fds) =
            after_first.fold((0, 0), |(r, f), x| (r.max(x.rss_kib), f.max(x.fds)));
        let first_minute_rss = self
            .rows
            .iter()
            .take(60)
            .map(|x| x.rss_kib)
            .max()
            .unwrap_or(0);
        s += &format!(
            "\nRSS peak after the first minute: {:.1} MiB (first minute's peak {:.1} MiB); open fds peak after the first minute: {peak_fds}.\n\n",
            peak_rss as f64 / 1024.0,
            first_minute_rss as f64 / 1024.0
        );
        s += "| live relay | client | sent | received | lost |\n|---|---|---|---|---|\n";
        for (name, client, (sent, received, problem)) in self.relays {
            s += &format!(
                "| {name} | {client} | {sent} | {received} | {}{} |\n",
                sent.saturating_sub(*received),
                problem
                    .as_ref()
                    .map(|p| format!(" ({p})"))
                    .unwrap_or_default()
            );
        }
        s += "\nturnperf's own report of each segment (per direction, with the allocations that \
              delivered nothing) is in `turnperf-<transport>-<segment>.json` beside this file, \
              uclient's output in `uclient-tls.txt` and `uclient-dtls.txt`.\n";
        s += &format!(
            "\n- churn, own clients (allocate, permit, relay, delete or close; UDP and TCP): {} cycles, {} failed {:?}\n\
             - churn, turnutils_uclient runs of 8 clients x 20 messages over UDP, TCP, TLS, DTLS in turn: {} runs, {} of {} messages echoed\n\
             - slow readers ({SLOW_READERS} TCP channels, {} KB/s in, {} KB/s read): {} bytes, {} frames read, {} out of order, {} broken streams\n\
             - hostile: {} malformed datagrams and unauthenticated Allocates, {} stalled TCP/TLS connections\n\
             - crashes: {}; exit code after SIGTERM: {}\n",
            get(&t.churn_cycles),
            get(&t.churn_failures),
            t.churn_errors.lock().map(|e| e.clone()).unwrap_or_default(),
            get(&t.uclient_churn_runs),
            get(&t.uclient_churn_received),
            get(&t.uclient_churn_sent),
            SLOW_SEND_PPS * SLOW_SEND_SIZE as u64 / 1000,
            SLOW_READ as u64 * 20 / 1000,
            get(&t.slow_bytes),
            get(&t.slow_frames),
            get(&t.slow_out_of_order),
            get(&t.slow_broken_streams),
            get(&t.hostile_datagrams),
            get(&t.hostile_connections),
            self.crashed.unwrap_or("none"),
            self.exit.map_or("none".to_string(), |c| c.to_string()),
        );
        let counters: Vec<&str> = self
            .metrics
            .lines()
            .filter(|l| {
                !l.starts_with('#')
                    && (l.contains("drop") || l.contains("refused") || l.contains("malformed"))
            })
            .filter(|l| !l.ends_with(" 0"))
            .collect();
        if !counters.is_empty() {
            s += "\nThe server's own counts at the end (nonzero drop/refusal counters):\n\n```\n";
            for l in counters {
                s += l;
                s.push('\n');
            }
            s += "```\n";
        }
        s += &format!(
            "\nResult: {}\n",
            if self.passed() { "PASS" } else { "FAIL" }
        );
        s
    }
}

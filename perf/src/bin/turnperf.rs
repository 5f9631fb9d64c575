//! turnperf: a TURN/UDP load generator and reporter. Sets up N allocations (each its own
//! client socket and 5-tuple) with auth, relays timestamped datagrams through the server to its
//! own peer, and reports delivered packets/s, Mbit/s, loss, one-way latency percentiles, the
//! allocation setup rate and (with `--server-pid`) the server's CPU time and context switches
//! per relayed packet, and the whole machine's busy CPU time per relayed packet. `--mode
//! direct` runs the same traffic between the clients and the peer with no relay at all: the
//! baseline a relay's machine cost is the difference from.

use clap::Parser;
use std::net::{IpAddr, ToSocketAddrs};
use std::process::ExitCode;
use std::time::Duration;
use uturn_perf::load::{rss_kib, setup, Auth, Direction, LoadConfig, Mode, Report};

#[derive(Parser, Debug)]
#[command(
    name = "turnperf",
    version,
    about = "TURN/UDP load generator and reporter"
)]
struct Cli {
    /// The TURN server, HOST:PORT (with --mode direct: not used, any value, e.g. "direct").
    server: String,
    /// Username (static credentials, or the user id of ephemeral ones).
    #[arg(short = 'u', long, default_value = "user1")]
    user: String,
    /// Password (static credentials).
    #[arg(short = 'p', long, default_value = "pass1")]
    password: String,
    /// Shared secret: mint ephemeral (TURN REST) credentials instead.
    #[arg(long)]
    secret: Option<String>,
    /// Allocations, each its own client 5-tuple (1 to 10000).
    #[arg(short = 'n', long, default_value_t = 64)]
    allocations: usize,
    /// Payload bytes per datagram (24 to 1400).
    #[arg(short = 's', long, default_value_t = 100)]
    size: usize,
    /// Datagrams per second per allocation and direction; 0: as fast as possible.
    #[arg(short = 'r', long, default_value_t = 0)]
    rate: u64,
    /// Seconds per run.
    #[arg(short = 'd', long, default_value_t = 5.0)]
    duration: f64,
    /// client→peer (up), peer→client (down) or both.
    #[arg(long, value_enum, default_value = "up")]
    direction: Direction,
    /// ChannelData, Send indications, plain (no TURN: through udprelay), or direct (no relay
    /// at all: clients and peer exchange the datagrams themselves; UDP only).
    #[arg(long, value_enum, default_value = "channel")]
    mode: Mode,
    /// With --mode plain: udprelay's relay address.
    #[arg(long)]
    plain_relay: Option<std::net::SocketAddr>,
    /// Client transport: udp, or tcp (each allocation on its own TCP connection).
    #[arg(long, default_value = "udp", value_parser = ["udp", "tcp"])]
    transport: String,
    /// Address the built-in peer binds (must be in a routed cluster).
    #[arg(long, default_value = "127.0.0.1")]
    peer_ip: IpAddr,
    /// UDP clients allocate from this many loopback addresses in turn (127.0.0.1 to
    /// 127.0.0.N, at most 254), so that thousands of allocations are not paced by the server's
    /// per-source challenge limit. An IPv4 loopback server only.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u8).range(1..=254))]
    sources: u8,
    /// The server's pid, for its CPU time and context switches per relayed packet.
    #[arg(long)]
    server_pid: Option<u32>,
    /// Search for the highest total rate with loss below --max-loss.
    #[arg(long)]
    find_max: bool,
    /// Loss bound for --find-max, percent.
    #[arg(long, default_value_t = 0.5)]
    max_loss: f64,
    /// Print the report as JSON.
    #[arg(long)]
    json: bool,
    /// No progress lines.
    #[arg(short = 'q', long)]
    quiet: bool,
    /// Client→server batches (unpaced, or --burst when paced) as one UDP GSO message each (the
    /// server still receives separate datagrams): a cheaper sender, so the load generator can
    /// outrun the server.
    #[arg(long)]
    gso: bool,
    /// Paced runs (--rate): datagrams each allocation sends back to back when due (1 to 16),
    /// as a video frame leaves a media server; with --gso as one GSO message.
    #[arg(long, default_value_t = 1)]
    burst: usize,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let direct = cli.mode == Mode::Direct;
    let resolved = if direct {
        // Not used: the clients send to the peer.
        Some(std::net::SocketAddr::new(cli.peer_ip, 0))
    } else {
        cli.server.to_socket_addrs().ok().and_then(|mut a| a.next())
    };
    let Some(server) = resolved else {
        eprintln!(
            "turnperf: cannot resolve server {:?}: give HOST:PORT",
            cli.server
        );
        return ExitCode::from(2);
    };
    let auth = match &cli.secret {
        Some(secret) => Auth::Ephemeral {
            secret: secret.clone(),
            user: cli.user.clone(),
        },
        None => Auth::Static {
            user: cli.user.clone(),
            pass: cli.password.clone(),
        },
    };
    let config = LoadConfig {
        server,
        auth,
        allocations: cli.allocations,
        size: cli.size,
        peer_ip: cli.peer_ip,
        mode: cli.mode,
        plain_relay: cli.plain_relay,
        gso: cli.gso,
        tcp: cli.transport == "tcp",
        burst: cli.burst,
        sources: if cli.sources > 1 {
            (1..=cli.sources)
                .map(|h| IpAddr::from([127, 0, 0, h]))
                .collect()
        } else {
            Vec::new()
        },
    };
    if cli.sources > 1 && !(server.is_ipv4() && server.ip().is_loopback()) {
        eprintln!(
            "turnperf: --sources binds 127.0.0.1-127.0.0.N: it needs an IPv4 loopback server"
        );
        return ExitCode::from(2);
    }
    let rss_before = cli.server_pid.and_then(rss_kib);
    let setup = match setup(&config) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("turnperf: setup failed: {e}");
            return ExitCode::from(1);
        }
    };
    if !cli.quiet {
        eprintln!(
            "turnperf: {} allocation(s) on {server} in {:.0}/s, peer {}",
            cli.allocations,
            setup.setup_rate,
            setup.peer_addr()
        );
    }
    // Resident memory the idle allocations cost the server (sampled before any load).
    std::thread::sleep(Duration::from_millis(300));
    let rss_after = cli.server_pid.and_then(rss_kib);
    let rss_per_allocation = match (rss_before, rss_after) {
        (Some(before), Some(after)) => {
            Some((after as f64 - before as f64) * 1024.0 / cli.allocations.max(1) as f64)
        }
        _ => None,
    };
    let duration = Duration::from_secs_f64(cli.duration.max(0.1));
    let report = if cli.find_max {
        find_max(&setup, &cli, duration)
    } else {
        let rate = cli.rate.saturating_mul(cli.allocations as u64);
        setup.run(cli.direction, rate, duration, cli.server_pid, !cli.quiet)
    };
    if cli.json {
        let doc = serde_json::json!({
            "server": if direct { "direct".to_string() } else { server.to_string() },
            "allocations": cli.allocations,
            "size": cli.size,
            "mode": cli.mode,
            "direction": cli.direction,
            "setup_rate": setup.setup_rate,
            "server_rss_before_kib": rss_before,
            "server_rss_after_setup_kib": rss_after,
            "server_rss_bytes_per_allocation": rss_per_allocation,
            "report": report,
        });
        println!("{doc}");
    } else {
        print_table(&cli, setup.setup_rate, &report);
        if let (Some(before), Some(after), Some(per)) = (rss_before, rss_after, rss_per_allocation)
        {
            println!(
                "server memory: {before} KiB before setup, {after} KiB with the allocations idle: {per:.0} bytes per allocation"
            );
        }
    }
    ExitCode::SUCCESS
}

/// Doubles the offered total rate until loss exceeds the bound, then bisects.
fn find_max(setup: &uturn_perf::load::Setup, cli: &Cli, duration: Duration) -> Report {
    let try_rate = |rate: u64| {
        let r = setup.run(cli.direction, rate, duration, cli.server_pid, false);
        if !cli.quiet {
            eprintln!(
                "find-max: offered {rate} pkt/s: delivered {:.0} pkt/s, loss {:.2}%",
                r.delivered_pps(),
                r.loss_pct()
            );
        }
        r
    };
    let mut low: Option<Report> = None;
    let mut rate = 10_000u64;
    let mut high = None;
    while rate <= 4_000_000 {
        let r = try_rate(rate);
        if r.loss_pct() <= cli.max_loss {
            low = Some(r);
            rate *= 2;
        } else {
            high = Some(rate);
            break;
        }
    }
    let (mut lo, mut hi) = (rate / 2, high.unwrap_or(rate));
    for _ in 0..5 {
        if hi <= lo + lo / 50 {
            break;
        }
        let mid = (lo + hi) / 2;
        let r = try_rate(mid);
        if r.loss_pct() <= cli.max_loss {
            lo = mid;
            low = Some(r);
        } else {
            hi = mid;
        }
    }
    low.unwrap_or_else(|| try_rate(1_000))
}

fn print_table(cli: &Cli, setup_rate: f64, report: &Report) {
    println!(
        "turnperf: {} allocations, {} B payload, {:?}, {:?}, {:.1} s, offered {}",
        cli.allocations,
        cli.size,
        cli.mode,
        cli.direction,
        report.seconds,
        if report.offered_pps == 0 {
            "as fast as possible".to_string()
        } else {
            format!("{} pkt/s", report.offered_pps)
        }
    );
    println!("setup: {setup_rate:.0} allocations/s (Allocate + CreatePermission + ChannelBind, with auth)");
    println!(
        "{:<5} {:>10} {:>10} {:>10} {:>8} {:>7} {:>8} {:>8} {:>8}",
        "dir", "sent", "delivered", "pkt/s", "Mbit/s", "loss%", "p50 µs", "p99 µs", "p99.9 µs"
    );
    for (name, d) in [("up", &report.up), ("down", &report.down)] {
        if let Some(d) = d {
            println!(
                "{name:<5} {:>10} {:>10} {:>10.0} {:>8.1} {:>7.2} {:>8.1} {:>8.1} {:>8.1}",
                d.sent, d.delivered, d.pps, d.mbps, d.loss_pct, d.p50_us, d.p99_us, d.p999_us
            );
            if d.silent_allocations > 0 {
                println!(
                    "{name:<5} {} allocation(s) delivered nothing",
                    d.silent_allocations
                );
            }
        }
    }
    if let Some(cpu) = report.server_cpu_us_per_packet {
        println!("server CPU: {cpu:.2} µs per relayed packet");
    }
    if let Some(wakeups) = report.server_wakeups_per_packet {
        println!("server context switches: {wakeups:.3} per relayed packet");
    }
    if let (Some(busy), Some(us), Some(softirq)) = (
        report.machine_busy_cpus,
        report.machine_us_per_packet,
        report.machine_softirq_us_per_packet,
    ) {
        println!(
            "machine CPU: {busy:.2} CPUs busy, {us:.2} µs per relayed packet ({softirq:.2} µs softirq)"
        );
    }
    if let Some(cpus) = &report.cpu_busy {
        let each: Vec<String> = cpus.iter().map(|b| format!("{:.0} %", b * 100.0)).collect();
        println!("busy per CPU: {}", each.join(", "));
    }
}

//! turnperf against a TURN server no one here wrote: coturn's `turnserver` on loopback.

use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::time::Duration;
use uturn_testkit::stunnerd::{free_port, temp_dir, wait_for_tcp, Killed, Stunnerd};

fn coturn() -> (Killed, u16) {
    // A port free for UDP and TCP (coturn serves both on it).
    let port = loop {
        let port = UdpSocket::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            break port;
        }
    };
    let child = Command::new("turnserver")
        .args([
            "-n",
            "--listening-ip=127.0.0.1",
            &format!("--listening-port={port}"),
            "--relay-ip=127.0.0.1",
            "--user=user1:pass1",
            "--realm=test",
            "--lt-cred-mech",
            "--no-tls",
            "--no-dtls",
            "--allow-loopback-peers",
            "--no-cli",
            "--log-file=stdout",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("coturn's turnserver (bash .ci/run installs it)");
    // Ready once it accepts on TCP (it opens UDP first), or after 10 s.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err()
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(200));
    (Killed(child), port)
}

fn turnperf(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_turnperf"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

/// Checks a paced run's `dir` report in `doc`: about the offered count sent (`sent` within
/// `offered`) and at least 99 % of it delivered; gives the report back.
fn assert_delivered<'a>(
    doc: &'a serde_json::Value,
    dir: &str,
    offered: std::ops::RangeInclusive<u64>,
) -> &'a serde_json::Value {
    let d = &doc["report"][dir];
    let (sent, delivered) = (
        d["sent"].as_u64().unwrap(),
        d["delivered"].as_u64().unwrap(),
    );
    assert!(offered.contains(&sent), "{dir}: {d}");
    assert!(delivered * 100 >= sent * 99, "{dir}: {d}");
    d
}

/// 8 allocations at 200/s each, both ways, for 1.5 s: about 2 400 datagrams each way.
const EIGHT_BOTH_WAYS: &[&str] = &["-n", "8", "-r", "200", "-d", "1.5", "--direction", "both"];

/// turnperf `args` with [`EIGHT_BOTH_WAYS`] and `--json`: checks that it succeeds and that
/// both directions delivered about everything; the document.
fn eight_both_ways(args: &[&str]) -> serde_json::Value {
    let (code, out, err) = turnperf(&[args, EIGHT_BOTH_WAYS, &["--json"]].concat());
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    for dir in ["up", "down"] {
        assert_delivered(&doc, dir, 2000..=2600);
    }
    doc
}

#[test]
fn turnperf_relays_through_coturn_both_ways_and_reports() {
    let (server, port) = coturn();
    let addr = format!("127.0.0.1:{port}");
    let (code, out, err) = turnperf(&[
        &addr,
        "-n",
        "16",
        "-r",
        "200",
        "-d",
        "1.5",
        "--direction",
        "both",
        "--json",
        "--server-pid",
        &server.0.id().to_string(),
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["allocations"], 16);
    assert!(doc["setup_rate"].as_f64().unwrap() > 0.0);
    for dir in ["up", "down"] {
        // 16 allocations × 200/s × 1.5 s, paced.
        let d = assert_delivered(&doc, dir, 4000..=5200);
        assert!(d["p50_us"].as_f64().unwrap() > 0.0, "{dir}: {d}");
        assert!(d["p999_us"].as_f64().unwrap() >= d["p50_us"].as_f64().unwrap());
    }
    assert!(
        doc["report"]["server_cpu_us_per_packet"].as_f64().is_some(),
        "{doc}"
    );

    // Send indications, and the human table.
    let (code, out, err) = turnperf(&[
        &addr, "-n", "4", "-r", "100", "-d", "1", "--mode", "send", "-q",
    ]);
    assert_eq!(code, 0, "{err}");
    let row = out.lines().find(|l| l.starts_with("up")).expect(&out);
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(
        cols[1], cols[2],
        "sent must equal delivered at this rate: {out}"
    );
    drop(server);
}

/// `--gso` sends each unpaced batch as one GSO message; coturn must still see (and relay)
/// separate, well-formed ChannelData datagrams, which the peer counts by their headers.
#[test]
fn gso_batches_reach_the_server_as_separate_datagrams() {
    let (server, port) = coturn();
    let addr = format!("127.0.0.1:{port}");
    let (code, out, err) = turnperf(&[&addr, "-n", "4", "-r", "0", "-d", "1", "--gso", "--json"]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    let up = &doc["report"]["up"];
    let (sent, delivered) = (
        up["sent"].as_u64().unwrap(),
        up["delivered"].as_u64().unwrap(),
    );
    assert!(sent > 1000, "{up}");
    assert!(delivered > 1000 && delivered <= sent, "{up}");
    // Batches are 16 datagrams: had the server seen one merged datagram per batch, at most a
    // sixteenth could arrive.
    assert!(delivered * 16 > sent, "{up}");
    drop(server);
}

#[test]
fn turnperf_rejects_bad_options_clearly() {
    let (code, _, err) = turnperf(&["127.0.0.1:9", "-s", "8"]);
    assert_eq!(code, 1);
    assert!(err.contains("--size 8"), "{err}");
    let (code, _, err) = turnperf(&["127.0.0.1:9", "-n", "20000"]);
    assert_eq!(code, 1);
    assert!(err.contains("--allocations 20000"), "{err}");
    let (code, _, err) = turnperf(&["127.0.0.1:9", "--burst", "17"]);
    assert_eq!(code, 1);
    assert!(err.contains("--burst 17"), "{err}");
}

/// Over TCP each allocation has its own connection; ChannelData goes padded both ways and the
/// receivers reassemble frames from the stream.
#[test]
fn turnperf_relays_over_tcp_both_ways() {
    let (server, port) = coturn();
    let addr = format!("127.0.0.1:{port}");
    eight_both_ways(&[&addr, "--transport", "tcp", "-s", "101"]);
    drop(server);
}

/// Paced bursts: each allocation sends 8 back to back when due (as one GSO message), and the
/// offered rate is still kept.
#[test]
fn paced_bursts_keep_the_rate() {
    let (server, port) = coturn();
    let addr = format!("127.0.0.1:{port}");
    let (code, out, err) = turnperf(&[
        &addr, "-n", "8", "-r", "400", "-d", "1.5", "--burst", "8", "--gso", "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    // 8 allocations × 400/s × 1.5 s.
    assert_delivered(&doc, "up", 4200..=5200);
    drop(server);
}

/// `--mode plain` through udprelay, the "no TURN" ceiling: both directions relayed whole, and
/// each datagram back to the client whose index it carries.
#[test]
fn plain_mode_relays_through_udprelay_both_ways() {
    let mut relay = Killed(
        Command::new(env!("CARGO_BIN_EXE_udprelay"))
            .arg("127.0.0.1:0")
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(relay.0.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let mut words = line.split_whitespace();
    let (listen, relay_addr) = (words.nth(2).expect(&line), words.nth(1).expect(&line));
    eight_both_ways(&[listen, "--mode", "plain", "--plain-relay", relay_addr]);
    drop(relay);
}

/// `--sources N` spreads the UDP clients over 127.0.0.1 to 127.0.0.N (so thousands of
/// allocations are not paced by a server's per-source challenge limit) and still relays;
/// a server it cannot reach from those addresses is refused with exit 2.
#[test]
fn sources_spread_the_clients_over_loopback_addresses() {
    let (server, port) = coturn();
    let addr = format!("127.0.0.1:{port}");
    let (code, out, err) = turnperf(&[
        &addr,
        "-n",
        "8",
        "-r",
        "100",
        "-d",
        "1",
        "--sources",
        "4",
        "--json",
    ]);
    assert_eq!(code, 0, "{err}");
    let doc: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(doc["allocations"], 8);
    assert_delivered(&doc, "up", 700..=900);
    let (code, _, err) = turnperf(&[&format!("[::1]:{port}"), "--sources", "4", "-d", "1"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("needs an IPv4 loopback server"), "{err}");
    drop(server);
}

/// `--mode direct`: no server at all (the address is not used), the clients and the peer
/// exchange the paced datagrams themselves; the machine's CPU time per packet is reported, as
/// the baseline a relay's cost is measured against.
#[test]
fn direct_mode_runs_without_a_server_and_reports_machine_cpu() {
    let doc = eight_both_ways(&["direct", "--mode", "direct"]);
    assert_eq!(doc["server"], "direct");
    let report = &doc["report"];
    assert!(
        report["machine_us_per_packet"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    let busy = report["machine_busy_cpus"].as_f64().unwrap();
    assert!(busy > 0.0 && busy <= 1024.0, "{report}");
    assert!(report["machine_softirq_us_per_packet"].as_f64().is_some());
    // No server pid: no server figures.
    assert!(report["server_wakeups_per_packet"].is_null(), "{report}");
    let (code, _, err) = turnperf(&["direct", "--mode", "direct", "--transport", "tcp"]);
    assert_eq!(code, 1);
    assert!(err.contains("UDP only"), "{err}");
}

/// With `--server-pid` of a running uturn, the server's context switches per relayed packet
/// (over all its threads) are reported.
#[test]
fn server_wakeups_are_counted_for_uturn() {
    let dir = temp_dir("turnperf-wakeups");
    let port = free_port();
    let config = dir.join("stunnerd.yaml");
    let route = format!("address: 127.0.0.1, port: {port}, routes: [peers]");
    std::fs::write(
        &config,
        format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"\", loglevel: \"all:WARN\"}}\n\
             auth: {{type: static, realm: perf, credentials: {{username: user1, password: pass1}}}}\n\
             listeners:\n\
             - {{name: udp, protocol: TURN-UDP, {route}}}\n\
             - {{name: tcp, protocol: TURN-TCP, {route}}}\n\
             clusters: [{{name: peers, endpoints: [\"127.0.0.1\"]}}]\n"
        ),
    )
    .unwrap();
    let server = Stunnerd::start(&["-c", &format!("file://{}", config.display())], &[]);
    let addr = format!("127.0.0.1:{port}");
    // The TCP listener opens with the UDP one.
    if let Err(e) = wait_for_tcp(addr.parse().unwrap(), Duration::from_secs(10)) {
        panic!("stunnerd did not listen on {port}: {e}\n{}", server.logs());
    }
    let doc = eight_both_ways(&[&addr, "--server-pid", &server.pid().to_string()]);
    let report = &doc["report"];
    let wakeups = report["server_wakeups_per_packet"].as_f64();
    assert!(wakeups.is_some_and(|w| w > 0.0), "{report}");
    assert!(report["server_cpu_us_per_packet"].as_f64().is_some());
    assert!(
        report["machine_us_per_packet"].as_f64().unwrap() > 0.0,
        "{report}"
    );
    drop(server);
    let _ = std::fs::remove_dir_all(&dir);
}

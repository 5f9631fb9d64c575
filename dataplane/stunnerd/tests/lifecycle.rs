//! What an operator sees: the real `stunnerd` binary under real signals, its probes, its
//! metrics (parsed by the official Prometheus client's parser) and its dry run.

use serde_json::Value;
use std::net::SocketAddr;
use std::time::Duration;
use uturn_testkit::peers::Peer;
use uturn_testkit::stunnerd::{free_port, http_get, status, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::{stream, TurnClient};

const REFRESH: u16 = 0x0004;
const CHANNEL_BIND: u16 = 0x0009;

fn config(turn: u16, health: u16, metrics: u16, realm: &str) -> String {
    format!(
        "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\", \
         metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {{type: static, realm: {realm}, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: media/gw/udp, address: 127.0.0.1, port: {turn}, routes: [media/peers]}}]\n\
         clusters: [{{name: media/peers, endpoints: [127.0.0.1, 127.0.0.3]}}]\n"
    )
}

fn ready(health: u16) -> Option<(u16, String)> {
    http_get(health, "/ready")
}

/// A test's config file (realm `r`) on ports of its own, and its `file://` origin.
struct ConfigFile {
    turn: u16,
    health: u16,
    metrics: u16,
    path: std::path::PathBuf,
    origin: String,
}

impl ConfigFile {
    fn new(name: &str) -> ConfigFile {
        let (turn, health, metrics) = (free_port(), free_port(), free_port());
        let path = temp_file(name);
        std::fs::write(&path, config(turn, health, metrics, "r")).unwrap();
        let origin = format!("file://{}", path.display());
        ConfigFile {
            turn,
            health,
            metrics,
            path,
            origin,
        }
    }
}

/// The second field report: a draining gateway keeps every live call working, and exits as
/// soon as the last allocation ends.
fn drain_scenario(force_ready: bool) {
    let (turn, health, metrics) = (free_port(), free_port(), free_port());
    let path = temp_file("drain.yaml");
    std::fs::write(&path, config(turn, health, metrics, "before")).unwrap();
    let mut args = vec!["-w", "-c"];
    let origin = format!("file://{}", path.display());
    args.push(&origin);
    if force_ready {
        args.push("--force-ready-status");
    }
    let port = default_health_port();
    let mut server = Stunnerd::start(&args, &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    drop(port);
    let peer = Peer::start();
    let other = Peer::on("127.0.0.3");
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(d.permit(peer.addr.ip()));
    assert!(d.bind(peer.addr));
    assert_eq!(stream(&mut d, peer.addr, "before", 100), 100);

    server.signal(libc::SIGTERM);
    assert!(
        wait_until(5, || server.logs().contains(
            "Commencing graceful shutdown with 1 active connection(s)"
        )),
        "{}",
        server.logs()
    );
    assert!(wait_until(5, || server
        .logs()
        .contains("Canceling config loader")));
    let (code, body) = ready(health).expect("the health server stops during the drain");
    if force_ready {
        assert_eq!(
            (code, body.as_str()),
            (200, "{\"status\":200,\"message\":\"READY\"}\n")
        );
    } else {
        assert_eq!(
            (code, body.as_str()),
            (503, "{\"status\":503,\"message\":\"stunnerd not ready\"}\n")
        );
    }
    assert_eq!(status(health).unwrap()["status"], "TERMINATING");
    assert_eq!(http_get(health, "/live").unwrap().0, 200);

    // The stream goes on; so do Send/Data indications to a new peer, a new permission, a new
    // channel, and refreshes of the allocation, the permission and the channel.
    assert_eq!(
        stream(&mut d, peer.addr, "during", 200),
        200,
        "the stream broke in the drain"
    );
    assert!(d.permit(other.addr.ip()));
    assert!(d.bind(other.addr));
    assert_eq!(stream(&mut d, other.addr, "bound", 50), 50);
    let before = d.responses.len();
    // Half an hour of client time in one-minute steps: every permission (300 s), channel
    // (600 s) and the allocation itself (turn-client-proto asks for 1800 s) comes due.
    for _ in 0..30 {
        d.warp(Duration::from_secs(60));
        d.drive(0.12);
    }
    let refreshed = &d.responses[before..];
    assert!(
        refreshed.iter().any(|r| r.method == REFRESH && r.success),
        "no successful Refresh: {refreshed:?}"
    );
    assert!(refreshed
        .iter()
        .any(|r| r.method == CHANNEL_BIND && r.success));
    assert!(refreshed.iter().all(|r| r.success), "{refreshed:?}");
    assert_eq!(stream(&mut d, peer.addr, "after", 100), 100);

    // A config change is no longer followed.
    std::fs::write(&path, config(turn, health, metrics, "after")).unwrap();
    std::thread::sleep(Duration::from_millis(700));
    assert_eq!(status(health).unwrap()["auth"]["realm"], "before");
    assert_eq!(
        server.wait_exit_for(0.1),
        None,
        "exited with a live allocation"
    );

    let deleted_at = std::time::Instant::now();
    d.delete();
    assert_eq!(server.wait_exit_for(2.0), Some(0), "{}", server.logs());
    assert!(deleted_at.elapsed() < Duration::from_secs(2));
    assert!(server.logs().contains("Normal exit on graceful shutdown"));
    let _ = std::fs::remove_file(path);
}

#[test]
fn drain_keeps_live_allocations_working_and_exits_after_the_last() {
    drain_scenario(false);
}

#[test]
fn drain_with_force_ready_status_keeps_ready_at_200() {
    drain_scenario(true);
}

/// A ready stunnerd on a config file of its own, started with `flags`, holding one
/// allocation; the client that holds it, and the config file.
fn serving_one_allocation(name: &str, flags: &[&str]) -> (Stunnerd, TurnClient, ConfigFile) {
    let file = ConfigFile::new(name);
    let mut args = vec!["-c", file.origin.as_str()];
    args.extend_from_slice(flags);
    let server = Stunnerd::start(&args, &[]);
    let health = file.health;
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    let turn_addr: SocketAddr = format!("127.0.0.1:{}", file.turn).parse().unwrap();
    let mut client = TurnClient::new(turn_addr, "alice", "s3cret");
    client.allocate().expect("allocation");
    assert!(wait_until(5, || status(health)
        .is_some_and(|s| s["allocationCount"] == 1)));
    (server, client, file)
}

#[test]
fn drain_timeout_bounds_the_wait() {
    let (mut server, _client, file) =
        serving_one_allocation("timeout.yaml", &["--drain-timeout", "1"]);
    server.signal(libc::SIGINT);
    assert_eq!(server.wait_exit_for(4.0), Some(0), "{}", server.logs());
    assert!(
        server.logs().contains("graceful shutdown timed out"),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(file.path);
}

/// Ctrl-C with a live allocation: the drain says what it waits for, how long, and how to skip
/// it; a second Ctrl-C exits at once (0), with the allocations it leaves.
#[test]
fn a_second_ctrl_c_ends_the_drain_at_once() {
    let (mut server, _client, file) = serving_one_allocation("twice.yaml", &[]);
    server.signal(libc::SIGINT);
    assert!(
        wait_until(5, || server
            .logs()
            .contains("to exit now, press Ctrl-C again")),
        "{}",
        server.logs()
    );
    let logs = server.logs();
    assert!(
        logs.contains(
            "waiting for the 1 allocation(s) to end, until each is deleted or expires: up to \
             its lifetime"
        ),
        "{logs}"
    );
    assert!(
        logs.contains("--no-graceful-shutdown skips the drain"),
        "{logs}"
    );
    // Still draining a second later: the allocation is live.
    assert_eq!(server.wait_exit_for(1.0), None, "{logs}");
    server.signal(libc::SIGINT);
    assert_eq!(server.wait_exit_for(2.0), Some(0), "{}", server.logs());
    assert!(
        server
            .logs()
            .contains("signal 2 during graceful shutdown: exiting now with 1 active connection(s)"),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(file.path);
}

#[test]
fn sigterm_without_allocations_exits_at_once() {
    let ConfigFile {
        health,
        path,
        origin,
        ..
    } = ConfigFile::new("idle.yaml");
    let mut server = Stunnerd::start(&["-c", &origin], &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    server.signal(libc::SIGTERM);
    assert_eq!(server.wait_exit_for(2.0), Some(0));
    let logs = server.logs();
    assert!(logs.contains("Commencing graceful shutdown with 0 active connection(s)"));
    assert!(logs.contains("Normal exit on graceful shutdown"));
    let _ = std::fs::remove_file(path);
}

/// Every sample of a scrape as parsed by the official Prometheus client: name → [(labels,
/// value)]. A scrape the parser rejects fails the test.
fn parse_scrape(text: &str) -> std::collections::BTreeMap<String, Vec<(Value, f64)>> {
    use std::io::Write;
    let script = "import json, sys\n\
                  from prometheus_client.parser import text_string_to_metric_families\n\
                  out = {}\n\
                  for family in text_string_to_metric_families(sys.stdin.read()):\n\
                  \x20   for s in family.samples:\n\
                  \x20       out.setdefault(s.name, []).append([s.labels, s.value])\n\
                  print(json.dumps(out))\n";
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed (bash .ci/run installs prometheus_client)");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the Prometheus parser rejected the scrape (or prometheus_client is missing: run bash .ci/run): {}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed: std::collections::BTreeMap<String, Vec<(Value, f64)>> =
        serde_json::from_slice(&output.stdout).unwrap();
    parsed
}

fn sample(
    scrape: &std::collections::BTreeMap<String, Vec<(Value, f64)>>,
    name: &str,
    labels: &[(&str, &str)],
) -> Option<f64> {
    scrape
        .get(name)?
        .iter()
        .find_map(|(l, v)| labels.iter().all(|(k, want)| l[*k] == *want).then_some(*v))
}

#[test]
fn metrics_and_status_match_the_traffic_a_client_made() {
    let ConfigFile {
        turn,
        health,
        metrics,
        path,
        origin,
    } = ConfigFile::new("metrics.yaml");
    let _server = Stunnerd::start(&["-c", &origin], &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    let peer = Peer::start();
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut clients = Vec::new();
    for _ in 0..3 {
        let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
        d.allocate().expect("allocation");
        clients.push(d);
    }
    let d = &mut clients[0];
    assert!(d.permit(peer.addr.ip()));
    d.send(peer.addr, b"via a send indication");
    assert!(d.bind(peer.addr));
    assert_eq!(stream(d, peer.addr, "counted", 40), 40);
    d.send_raw(b"\x00\x01\x00\x08 this is not STUN");
    for d in clients.iter_mut() {
        d.drive(0.05);
    }
    std::thread::sleep(Duration::from_millis(400));

    let (code, body) = http_get(metrics, "/metrics").expect("metrics server");
    assert_eq!(code, 200);
    let scrape = parse_scrape(&body);
    let status = status(health).unwrap();
    assert_eq!(status["allocationCount"], 3);
    assert_eq!(
        sample(&scrape, "stunner_allocations_active", &[]),
        Some(3.0)
    );
    let listener = "media/gw/udp";
    let (sent, recvd) = clients.iter().fold(((0, 0), (0, 0)), |(s, r), d| {
        (
            (s.0 + d.sent.0, s.1 + d.sent.1),
            (r.0 + d.recvd.0, r.1 + d.recvd.1),
        )
    });
    let l =
        |name: &str, dir: &str| sample(&scrape, name, &[("name", listener), ("direction", dir)]);
    assert_eq!(
        l("stunner_listener_packets_total", "rx"),
        Some(sent.0 as f64),
        "{body}"
    );
    assert_eq!(l("stunner_listener_bytes_total", "rx"), Some(sent.1 as f64));
    assert_eq!(
        l("stunner_listener_packets_total", "tx"),
        Some(recvd.0 as f64)
    );
    assert_eq!(
        l("stunner_listener_bytes_total", "tx"),
        Some(recvd.1 as f64)
    );
    let [peer_rx, peer_rx_bytes, peer_tx, peer_tx_bytes] = peer.counts();
    let c = |name: &str, dir: &str| {
        sample(
            &scrape,
            name,
            &[("name", "media/peers"), ("direction", dir)],
        )
    };
    assert_eq!(
        c("stunner_cluster_packets_total", "tx"),
        Some(peer_rx as f64)
    );
    assert_eq!(
        c("stunner_cluster_bytes_total", "tx"),
        Some(peer_rx_bytes as f64)
    );
    assert_eq!(
        c("stunner_cluster_packets_total", "rx"),
        Some(peer_tx as f64)
    );
    assert_eq!(
        c("stunner_cluster_bytes_total", "rx"),
        Some(peer_tx_bytes as f64)
    );
    assert_eq!(peer_rx, 41, "one Send indication and 40 ChannelData");
    assert_eq!(
        sample(
            &scrape,
            "stunner_listener_connections",
            &[("name", listener)]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "stunner_listener_connections_total",
            &[("name", listener)]
        ),
        Some(1.0)
    );
    assert_eq!(
        sample(
            &scrape,
            "uturn_dropped_datagrams_total",
            &[("reason", "malformed")]
        ),
        Some(1.0)
    );
    assert!(sample(&scrape, "process_resident_memory_bytes", &[]).is_some_and(|v| v > 0.0));
    assert!(sample(&scrape, "process_open_fds", &[]).is_some_and(|v| v > 0.0));
    assert!(scrape.contains_key("process_cpu_seconds_total"));
    // HELP and TYPE as stunnerd's exporter writes them.
    assert!(body.contains("# HELP stunner_listener_packets_total Number of datagrams sent or received at a listener\n# TYPE stunner_listener_packets_total counter\n"));
    assert!(body.contains("# TYPE stunner_allocations_active gauge\n"));
    assert_eq!(http_get(metrics, "/other").unwrap().0, 404);
    let _ = std::fs::remove_file(path);
}

#[test]
fn status_never_prints_secrets() {
    let (turn, health, metrics) = (free_port(), free_port(), free_port());
    let path = temp_file("secret.yaml");
    std::fs::write(
        &path,
        config(turn, health, metrics, "r").replace(
            "auth: {type: static, realm: r, credentials: {username: alice, password: s3cret}}",
            "auth: {type: ephemeral, realm: r, credentials: {secret: t0p-s3cret-v4lue}}",
        ),
    )
    .unwrap();
    let origin = format!("file://{}", path.display());
    let _server = Stunnerd::start(&["-c", &origin], &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    let (code, body) = http_get(health, "/status").unwrap();
    assert_eq!(code, 200);
    assert!(!body.contains("t0p-s3cret-v4lue"), "{body}");
    let doc: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(doc["auth"]["credentials"]["secret"], "<redacted>");
    assert_eq!(doc["auth"]["type"], "ephemeral");
    assert_eq!(doc["status"], "READY");
    assert_eq!(doc["version"], "v1");
    let (code, body) = http_get(health, "/live").unwrap();
    assert_eq!((code, body.as_str()), (200, "{}\n"));
    assert_eq!(http_get(health, "/nope").unwrap().0, 404);

    let out = std::process::Command::new(env!("CARGO_BIN_EXE_stunnerd"))
        .args(["-d", "-c", &origin])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("\"realm\": \"r\""),
        "dry run must print the config: {stdout}"
    );
    assert!(!stdout.contains("t0p-s3cret-v4lue"));
    let _ = std::fs::remove_file(path);
}

/// Watch mode starts from the zero config, whose health server is the default `:8086`; tests
/// that start a watcher take turns on it.
fn default_health_port() -> std::sync::MutexGuard<'static, ()> {
    static PORT: std::sync::Mutex<()> = std::sync::Mutex::new(());
    PORT.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn not_ready_before_a_config_unless_forced() {
    let _port = default_health_port();
    // Watching a file that does not exist yet: only the zero config runs.
    let missing = temp_file("never.yaml");
    let origin = format!("file://{}", missing.display());
    for (force, want) in [(false, 503), (true, 200)] {
        let mut args = vec!["-w", "-c", origin.as_str()];
        if force {
            args.push("--force-ready-status");
        }
        let server = Stunnerd::start(&args, &[]);
        assert!(
            wait_until(5, || http_get(8086, "/ready").is_some()),
            "port 8086 is not ours: {}",
            server.logs()
        );
        assert_eq!(http_get(8086, "/ready").unwrap().0, want, "force={force}");
        assert_eq!(status(8086).unwrap()["status"], "NOT-READY");
        drop(server);
        assert!(wait_until(5, || http_get(8086, "/live").is_none()));
    }
}

/// `-l` specs apply left to right, lines keep stunnerd's text format, and a client that keeps
/// asking for a denied peer cannot flood the log: denials are rate-limited with stunnerd's
/// suffix.
#[test]
fn log_specs_format_and_rate_limited_denials() {
    let ConfigFile {
        turn,
        health,
        path,
        origin,
        ..
    } = ConfigFile::new("logs.yaml");
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let denied: std::net::IpAddr = "127.0.0.9".parse().unwrap();

    let server = Stunnerd::start(&["-c", &origin, "-l", "all:WARN,auth:INFO"], &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    for _ in 0..8 {
        assert!(!d.permit(denied));
    }
    std::thread::sleep(Duration::from_millis(1100));
    assert!(!d.permit(denied));
    std::thread::sleep(Duration::from_millis(200));
    let logs = server.logs();
    let denials: Vec<&str> = logs
        .lines()
        .filter(|l| l.contains("permission denied"))
        .collect();
    assert_eq!(denials.len(), 4, "3 at once, then 1 per second: {logs}");
    // The cause, where the policy's rules and not the routes refuse the peer.
    assert!(
        denials[3].ends_with(
            "no route to endpoint: 127.0.0.9 is a loopback address: only an endpoint inside \
             that scope admits it (such as 127.0.0.9 itself), never 0.0.0.0/0 or ::/0 \
             (suppressed 5 log events)"
        ),
        "{logs}"
    );
    assert!(
        !logs.contains("starting stunnerd"),
        "all:WARN must hide INFO: {logs}"
    );
    // HH:MM:SS.micro file.rs:line: scope LEVEL: message
    for line in &denials {
        let (time, rest) = line.split_once(' ').unwrap();
        assert!(
            time.len() == 15 && time.as_bytes()[2] == b':' && time.as_bytes()[8] == b'.',
            "{line}"
        );
        let (file, rest) = rest.split_once(": ").unwrap();
        assert!(file.contains(".rs:"), "{line}");
        assert!(
            rest.starts_with("auth INFO: permission denied on listener \"media/gw/udp\""),
            "{line}"
        );
    }
    drop(server);

    // The other order: auth:INFO, then all:WARN overrides it.
    let server = Stunnerd::start(&["-c", &origin, "-l", "auth:INFO,all:WARN"], &[]);
    assert!(wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)));
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(!d.permit(denied));
    std::thread::sleep(Duration::from_millis(200));
    assert!(
        !server.logs().contains("permission denied"),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(path);
}

/// A stunnerd killed with allocations on it and started again at once on the same host (a
/// process supervisor's restart) comes up: the sockets the kernel is still tearing down after
/// the old process exited are waited out, not taken for another process serving the port.
#[test]
fn a_stunnerd_restarted_at_once_after_a_kill_serves() {
    let ConfigFile {
        turn,
        health,
        path,
        origin,
        ..
    } = ConfigFile::new("restart.yaml");
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    for round in 0..5 {
        let server = Stunnerd::start(&["-c", &origin], &[]);
        assert!(
            wait_until(10, || ready(health).is_some_and(|(c, _)| c == 200)),
            "round {round}: {}",
            server.logs()
        );
        let mut clients: Vec<TurnClient> = (0..4)
            .map(|_| TurnClient::new(turn_addr, "alice", "s3cret"))
            .collect();
        for d in &mut clients {
            d.allocate().expect("allocation");
        }
        // Killed, and reaped, with its allocations and their clients live.
        drop(server);
    }
    let _ = std::fs::remove_file(path);
}

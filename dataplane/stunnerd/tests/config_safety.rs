//! A config mistake must not close a serving port or split its clients: a certificate and key
//! that do not load or do not match are refused before any listener restarts, at start and on
//! reload; a port another process serves is refused (unless `--allow-shared-ports`). The
//! real stunnerd binary, live relays through turncat (TLS, DTLS) and turn-client-proto (UDP).

use base64::Engine as _;
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;
use uturn_testkit::peers::Peer;
use uturn_testkit::stunnerd::{free_port, http_get, metric, temp_file, wait_until, Stunnerd};
use uturn_testkit::tls::{chain_between, served_certificate, INTERMEDIATE_SUBJECT};
use uturn_testkit::turn_client::{stream, TurnClient};
use uturn_testkit::turncat::{paced_echo, turncat_tunnel};

const AUTH: &str = "{type: static, credentials: {username: user1, password: pass1}}";

/// A fresh certificate and key as PEM.
fn pem_pair() -> (String, String) {
    uturn_dataplane::io::tls::self_signed("127.0.0.1").unwrap()
}

fn b64(pem: &str) -> String {
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// A port free for UDP and TCP.
fn free_stream_port() -> u16 {
    loop {
        let port = free_port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// Ports of a test's stunnerd: health, metrics, and the TLS/DTLS listeners' shared port.
struct Ports {
    health: u16,
    metrics: u16,
    secure: u16,
}

/// TURN-TLS and TURN-DTLS on one port, each with its own (cert, key) as PEM.
fn secure_config(ports: &Ports, tls: &(String, String), dtls: &(String, String)) -> String {
    let Ports {
        health,
        metrics,
        secure,
    } = ports;
    format!(
        "version: v1\n\
         admin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {AUTH}\n\
         listeners:\n\
         - {{name: tls, protocol: TURN-TLS, address: 127.0.0.1, port: {secure}, routes: [media], cert: \"{}\", key: \"{}\"}}\n\
         - {{name: dtls, protocol: TURN-DTLS, address: 127.0.0.1, port: {secure}, routes: [media], cert: \"{}\", key: \"{}\"}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n",
        b64(&tls.0),
        b64(&tls.1),
        b64(&dtls.0),
        b64(&dtls.1),
    )
}

fn allocations(metrics: u16) -> Option<f64> {
    metric(metrics, "stunner_allocations_active ")
}

fn ready(health: u16) -> bool {
    http_get(health, "/ready").is_some_and(|(code, _)| code == 200)
}

/// Writes `text` the way a ConfigMap update lands: aside, then renamed over.
fn rewrite(path: &std::path::Path, text: &str) {
    let aside = path.with_extension("next");
    std::fs::write(&aside, text).unwrap();
    std::fs::rename(&aside, path).unwrap();
}

/// `stunnerd -c ORIGIN -w` on 2 shards. A watcher starts from the zero config, whose health
/// server is on the default :8086 until the file's config arrives; another watcher starting
/// at the same moment (a parallel test) may hold it, so this retries (bounded).
fn start_watching(origin: &str) -> Stunnerd {
    for _ in 0..40 {
        let mut server = Stunnerd::start(&["-c", origin, "-w"], &[("UTURN_SHARDS", "2")]);
        if server.wait_exit_for(0.5).is_none() {
            return server;
        }
        if !server.logs().contains(":8086") {
            panic!("stunnerd exited:\n{}", server.logs());
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    panic!("the default health port :8086 stayed taken");
}

/// How many times `needle` occurs in the log.
fn log_count(server: &Stunnerd, needle: &str) -> usize {
    server.logs().matches(needle).count()
}

#[test]
fn a_mismatched_key_on_reload_drops_nothing_and_a_good_rotation_applies() {
    let ports = Ports {
        health: free_stream_port(),
        metrics: free_stream_port(),
        secure: free_stream_port(),
    };
    let old = pem_pair();
    let new = pem_pair();
    let mismatched = (new.0.clone(), old.1.clone());
    let path = temp_file("config-safety-rotation.yaml");
    std::fs::write(&path, secure_config(&ports, &old, &old)).unwrap();
    let origin = format!("file://{}", path.display());
    let server = start_watching(&origin);
    assert!(
        wait_until(10, || ready(ports.health)),
        "not ready:\n{}",
        server.logs()
    );

    // Live relays over TLS and DTLS, through turncat to an echo peer.
    let peer = Peer::start();
    let tls_uri = format!(
        "turns://user1:pass1@127.0.0.1:{}?transport=tcp",
        ports.secure
    );
    let dtls_uri = format!(
        "turns://user1:pass1@127.0.0.1:{}?transport=udp",
        ports.secure
    );
    let relays = [
        turncat_tunnel(&tls_uri, peer.addr),
        turncat_tunnel(&dtls_uri, peer.addr),
    ];
    assert_eq!(allocations(ports.metrics), Some(2.0));
    let stop = Arc::new(AtomicBool::new(false));
    let runs: Vec<_> = relays
        .into_iter()
        .map(|socket| {
            let stop = stop.clone();
            std::thread::spawn(move || paced_echo(&socket, &stop))
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));

    // Rotations that must be refused whole: a key of another certificate on both listeners,
    // then a good pair on TLS beside a mismatched one on DTLS (the good half is not applied
    // either, so TLS does not restart).
    let refused = [
        (secure_config(&ports, &mismatched, &mismatched), "tls", 0),
        (secure_config(&ports, &new, &mismatched), "dtls", 1),
    ];
    for (round, (text, listener, index)) in refused.iter().enumerate() {
        let applied = log_count(&server, "Reconciliation ready");
        rewrite(&path, text);
        let handled = wait_until(10, || {
            log_count(&server, "config rejected") > round
                || log_count(&server, "Reconciliation ready") > applied
        });
        assert!(handled, "the rotation was not read:\n{}", server.logs());
        std::thread::sleep(Duration::from_millis(1500));
        assert_eq!(
            allocations(ports.metrics),
            Some(2.0),
            "allocations dropped:\n{}",
            server.logs()
        );
        assert!(ready(ports.health), "/ready fell");
        let logs = server.logs();
        let rejection = logs
            .lines()
            .filter(|line| line.contains("config rejected"))
            .nth(round)
            .unwrap_or_else(|| panic!("not rejected:\n{logs}"));
        for needle in [
            format!("listeners[{index}].key"),
            format!("listener \"{listener}\""),
            "does not match the certificate".into(),
            "rotate the cert and the key together".into(),
        ] {
            assert!(
                rejection.contains(&needle),
                "{needle:?} missing: {rejection}"
            );
        }
    }
    stop.store(true, Ordering::Relaxed);
    for (run, name) in runs.into_iter().zip(["TLS", "DTLS"]) {
        let (sent, echoed) = run.join().unwrap();
        assert!(sent > 200, "{name}: only {sent} sent");
        assert_eq!(
            echoed, sent,
            "{name}: lost datagrams across the refused rotations"
        );
    }
    // Each relay kept its one allocation: one relay address each at the peer.
    let senders = peer.senders();
    assert_eq!(senders.len(), 2, "allocations were made again: {senders:?}");
    for (dtls, name) in [(false, "TLS"), (true, "DTLS")] {
        assert_eq!(
            served_certificate(ports.secure, dtls).as_deref(),
            Some(old.0.as_str()),
            "{name} no longer serves the running certificate"
        );
    }

    // A good rotation applies: a new handshake sees the new certificate.
    rewrite(&path, &secure_config(&ports, &new, &new));
    for (dtls, name) in [(false, "TLS"), (true, "DTLS")] {
        let rotated = wait_until(15, || {
            served_certificate(ports.secure, dtls).as_deref() == Some(new.0.as_str())
        });
        assert!(
            rotated,
            "{name} does not serve the new certificate:\n{}",
            server.logs()
        );
    }
    assert_eq!(
        log_count(&server, "config rejected"),
        2,
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(&path);
}

/// Seconds since the Unix epoch.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

#[test]
fn each_certificates_expiry_is_a_gauge_and_an_expired_or_expiring_one_is_logged() {
    const DAY: i64 = 86_400;
    let ports = Ports {
        health: free_stream_port(),
        metrics: free_stream_port(),
        secure: free_stream_port(),
    };
    let now = unix_now();
    let between = |from: i64, until: i64| {
        uturn_dataplane::io::tls::self_signed_between("127.0.0.1", from, until).unwrap()
    };
    let valid = between(now - DAY, now + 30 * DAY);
    let expired = between(now - 2 * DAY, now - DAY);
    let path = temp_file("config-safety-expiry.yaml");
    std::fs::write(&path, secure_config(&ports, &valid, &expired)).unwrap();
    let server = start_watching(&format!("file://{}", path.display()));
    assert!(
        wait_until(10, || ready(ports.health)),
        "not ready:\n{}",
        server.logs()
    );
    let gauge = |name: &str| {
        metric(
            ports.metrics,
            &format!("uturn_listener_certificate_expiry_timestamp_seconds{{name=\"{name}\"}} "),
        )
    };
    assert_eq!(gauge("tls"), Some((now + 30 * DAY) as f64));
    assert_eq!(gauge("dtls"), Some((now - DAY) as f64));
    // The expired certificate is served (clients that do not verify it still connect) and
    // logged as an error naming the listener and the field; the valid one is not logged.
    let logs = server.logs();
    let line = |needle: &str| logs.lines().find(|l| l.contains(needle)).map(str::to_owned);
    let error = line("its certificate expired").unwrap_or_else(|| panic!("not logged:\n{logs}"));
    for needle in [
        "listener \"dtls\"",
        "expired 1 days ago",
        "listeners[1].cert",
        "ERROR",
    ] {
        assert!(error.contains(needle), "{needle:?} missing: {error}");
    }
    assert!(
        !logs
            .lines()
            .any(|l| l.contains("listener \"tls\"") && l.contains("its certificate")),
        "{logs}"
    );

    // The DTLS listener goes, the TLS certificate is replaced by one that ends in 3 days.
    let soon = between(now - DAY, now + 3 * DAY + 3600);
    // The config with its TLS listener alone, serving `pair`.
    let tls_only = |pair: &(String, String)| -> String {
        secure_config(&ports, pair, pair)
            .lines()
            .filter(|l| !l.contains("name: dtls"))
            .map(|l| format!("{l}\n"))
            .collect()
    };
    rewrite(&path, &tls_only(&soon));
    assert!(
        wait_until(10, || log_count(
            &server,
            "its certificate expires in 3 days"
        ) == 1),
        "the renewal was not logged:\n{}",
        server.logs()
    );
    let warning = server.logs();
    let warning = warning
        .lines()
        .find(|l| l.contains("expires in 3 days"))
        .unwrap();
    for needle in ["listener \"tls\"", "listeners[0].cert", "WARN"] {
        assert!(warning.contains(needle), "{needle:?} missing: {warning}");
    }
    // The renewed certificate's end replaces the old one; the removed listener's certificate
    // leaves the page (an alert on it would otherwise fire for good).
    let gone = wait_until(10, || {
        gauge("tls") == Some((now + 3 * DAY + 3600) as f64) && gauge("dtls").is_none()
    });
    assert!(
        gone,
        "{:?}",
        http_get(ports.metrics, "/metrics").map(|(_, body)| body)
    );

    // A certificate that expires while it is served, with no config change: logged when it
    // does.
    let ending = between(now - DAY, unix_now() + 4);
    rewrite(&path, &tls_only(&ending));
    assert!(
        wait_until(10, || log_count(
            &server,
            "its certificate expires in 0 days"
        ) == 1),
        "the short certificate was not logged:\n{}",
        server.logs()
    );
    assert!(
        wait_until(10, || log_count(
            &server,
            "its certificate expired 0 days ago"
        ) == 1),
        "the certificate's expiry was not logged:\n{}",
        server.logs()
    );
    let _ = std::fs::remove_file(&path);
}

/// A Unix time as a certificate log line prints it (openssl's `Jan  2 03:04:05 2026 GMT`).
fn certificate_time(unix: i64) -> String {
    openssl::asn1::Asn1Time::from_unix(unix as libc::time_t)
        .unwrap()
        .to_string()
}

#[test]
fn a_chains_first_certificate_to_end_is_the_gauge_and_a_not_yet_valid_one_is_logged() {
    const DAY: i64 = 86_400;
    let ports = Ports {
        health: free_stream_port(),
        metrics: free_stream_port(),
        secure: free_stream_port(),
    };
    let now = unix_now();
    // TLS serves a chain whose intermediate ends in 5 days, long before its leaf; DTLS a
    // certificate valid from the day after tomorrow.
    let ends = now + 5 * DAY + 3600;
    let chain = chain_between((now - DAY, now + 300 * DAY), (now - 2 * DAY, ends));
    let starts = now + 2 * DAY + 3600;
    let early =
        uturn_dataplane::io::tls::self_signed_between("127.0.0.1", starts, now + 60 * DAY).unwrap();
    let path = temp_file("config-safety-chain.yaml");
    std::fs::write(&path, secure_config(&ports, &chain, &early)).unwrap();
    let server = start_watching(&format!("file://{}", path.display()));
    assert!(
        wait_until(10, || ready(ports.health)),
        "not ready:\n{}",
        server.logs()
    );
    let gauge = |name: &str| {
        metric(
            ports.metrics,
            &format!("uturn_listener_certificate_expiry_timestamp_seconds{{name=\"{name}\"}} "),
        )
    };
    // The chain ends with its intermediate, not its leaf.
    assert_eq!(gauge("tls"), Some(ends as f64));
    assert_eq!(gauge("dtls"), Some((now + 60 * DAY) as f64));
    let logs = server.logs();
    let line = |needle: &str| logs.lines().find(|l| l.contains(needle)).map(str::to_owned);
    let warning = line("its certificate expires").unwrap_or_else(|| panic!("not logged:\n{logs}"));
    let subject = format!("subject \"{INTERMEDIATE_SUBJECT}\"");
    for needle in [
        "WARN",
        "listener \"tls\"",
        "its certificate expires in 5 days",
        &certificate_time(ends),
        "certificate 2 (an intermediate)",
        &subject,
        "listeners[0].cert",
    ] {
        assert!(warning.contains(needle), "{needle:?} missing: {warning}");
    }
    let error =
        line("its certificate is not valid until").unwrap_or_else(|| panic!("not logged:\n{logs}"));
    for needle in [
        "ERROR",
        "listener \"dtls\"",
        &certificate_time(starts),
        "in 2 days",
        "listeners[1].cert",
    ] {
        assert!(error.contains(needle), "{needle:?} missing: {error}");
    }
    // Both are served all the same (clients that do not verify them still connect).
    let leaf_end = chain.0.find("-----END CERTIFICATE-----\n").unwrap();
    let leaf = &chain.0[..leaf_end + "-----END CERTIFICATE-----\n".len()];
    assert_eq!(
        served_certificate(ports.secure, false).as_deref(),
        Some(leaf)
    );
    assert_eq!(
        served_certificate(ports.secure, true).as_deref(),
        Some(early.0.as_str())
    );

    // A certificate that becomes valid while it is served, with no config change: logged as
    // not valid yet, then when it becomes valid.
    let soon =
        uturn_dataplane::io::tls::self_signed_between("127.0.0.1", unix_now() + 5, now + 300 * DAY)
            .unwrap();
    let tls_only: String = secure_config(&ports, &soon, &soon)
        .lines()
        .filter(|l| !l.contains("name: dtls"))
        .map(|l| format!("{l}\n"))
        .collect();
    rewrite(&path, &tls_only);
    assert!(
        wait_until(10, || log_count(
            &server,
            "its certificate is not valid until"
        ) == 2),
        "the early certificate was not logged:\n{}",
        server.logs()
    );
    assert!(
        wait_until(15, || log_count(&server, "its certificate became valid")
            == 1),
        "its start of validity was not logged:\n{}",
        server.logs()
    );
    let logs = server.logs();
    let valid = line_of(&logs, "its certificate became valid");
    assert!(valid.contains("listener \"tls\""), "{valid}");
    assert!(
        wait_until(10, || gauge("tls") == Some((now + 300 * DAY) as f64)
            && gauge("dtls").is_none()),
        "{:?}",
        http_get(ports.metrics, "/metrics").map(|(_, body)| body)
    );
    let _ = std::fs::remove_file(&path);
}

/// The first line of `logs` holding `needle`.
fn line_of<'a>(logs: &'a str, needle: &str) -> &'a str {
    logs.lines()
        .find(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not logged:\n{logs}"))
}

#[test]
fn a_start_config_whose_key_does_not_load_or_match_exits_1_naming_the_listener() {
    let (cert, _) = pem_pair();
    let (_, other_key) = pem_pair();
    let cases = [
        (
            "TURN-TLS",
            other_key.clone(),
            "does not match the certificate",
        ),
        ("TURN-DTLS", other_key, "does not match the certificate"),
        (
            "TURN-TLS",
            "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n".into(),
            "private key",
        ),
    ];
    for (protocol, bad_key, why) in cases {
        let port = free_stream_port();
        let path = temp_file("config-safety-start.yaml");
        std::fs::write(
            &path,
            format!(
                "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {AUTH}\nlisteners:\n\
                 - {{name: secure-media, protocol: {protocol}, address: 127.0.0.1, port: {port}, routes: [media], cert: \"{}\", key: \"{}\"}}\n\
                 clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n",
                b64(&cert),
                b64(&bad_key)
            ),
        )
        .unwrap();
        let mut server = Stunnerd::start(&["-c", &format!("file://{}", path.display())], &[]);
        let code = server.wait_exit();
        let logs = server.logs();
        assert_eq!(code, Some(1), "{protocol}: {logs}");
        for needle in [
            "listeners[0].key",
            "listener \"secure-media\"",
            why,
            "set key to",
        ] {
            assert!(
                logs.contains(needle),
                "{protocol}: {needle:?} missing:\n{logs}"
            );
        }
        let _ = std::fs::remove_file(&path);
    }
}

// Ports another process serves.

/// A UDP socket on 127.0.0.1:`port` with SO_REUSEPORT, as another stunnerd holds its port.
fn reuseport_udp_socket(port: u16) -> UdpSocket {
    use std::os::fd::FromRawFd;
    // SAFETY: plain socket calls on a descriptor this function owns until it is wrapped.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        assert!(fd >= 0);
        let on: libc::c_int = 1;
        let rc = libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_REUSEPORT,
            (&on as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        );
        assert_eq!(rc, 0);
        let addr = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: port.to_be(),
            sin_addr: libc::in_addr {
                s_addr: u32::from(std::net::Ipv4Addr::LOCALHOST).to_be(),
            },
            sin_zero: [0; 8],
        };
        let rc = libc::bind(
            fd,
            (&addr as *const libc::sockaddr_in).cast(),
            std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
        );
        assert_eq!(rc, 0, "bind 127.0.0.1:{port}");
        UdpSocket::from_raw_fd(fd)
    }
}

/// One TURN-UDP listener (and a TURN-TCP one on the same port if `tcp`) on `turn`.
fn udp_config(turn: u16, health: u16, tcp: bool) -> String {
    let tcp = if tcp {
        format!(
            "- {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {turn}, routes: [media]}}\n"
        )
    } else {
        String::new()
    };
    format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\nauth: {AUTH}\n\
         listeners:\n\
         - {{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}\n\
         {tcp}\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
    )
}

/// Live UDP clients of `turn`, each with a permission for `peer`.
fn udp_clients(turn: u16, peer: &Peer, n: usize) -> Vec<TurnClient> {
    let server: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    (0..n)
        .map(|_| {
            let mut client = TurnClient::new(server, "user1", "pass1");
            assert!(client.allocate().is_some(), "{:?}", client.events);
            assert!(client.permit(peer.addr.ip()));
            client
        })
        .collect()
}

/// Whether every client still relays: 20 datagrams each, every one echoed.
fn all_relay(clients: &mut [TurnClient], peer: &Peer, tag: &str) -> bool {
    clients
        .iter_mut()
        .all(|client| stream(client, peer.addr, tag, 20) == 20)
}

#[test]
fn a_second_stunnerd_on_a_served_port_exits_1_naming_it_and_the_first_keeps_its_clients() {
    let (turn, health, health2) = (free_stream_port(), free_stream_port(), free_stream_port());
    let first_path = temp_file("config-safety-first.yaml");
    std::fs::write(&first_path, udp_config(turn, health, true)).unwrap();
    let first = Stunnerd::start(
        &["-c", &format!("file://{}", first_path.display())],
        &[("UTURN_SHARDS", "2")],
    );
    assert!(
        wait_until(10, || ready(health)),
        "not ready:\n{}",
        first.logs()
    );
    let peer = Peer::start();
    let mut clients = udp_clients(turn, &peer, 8);
    assert!(all_relay(&mut clients, &peer, "before"));

    // The same port, from another process.
    let second_path = temp_file("config-safety-second.yaml");
    std::fs::write(&second_path, udp_config(turn, health2, true)).unwrap();
    let second_origin = format!("file://{}", second_path.display());
    let mut second = Stunnerd::start(&["-c", &second_origin], &[("UTURN_SHARDS", "2")]);
    let code = second.wait_exit();
    let logs = second.logs();
    assert_eq!(code, Some(1), "the second stunnerd kept running:\n{logs}");
    for needle in [
        &format!("port {turn}/udp"),
        "listeners[0].port",
        "already served by another process",
        "--allow-shared-ports",
    ] {
        assert!(logs.contains(needle), "{needle:?} missing:\n{logs}");
    }
    assert!(all_relay(&mut clients, &peer, "after"));
    assert!(ready(health));
    drop(first);
    let _ = std::fs::remove_file(&first_path);
    let _ = std::fs::remove_file(&second_path);
}

#[test]
fn with_allow_shared_ports_a_second_stunnerd_starts_on_a_served_port() {
    let (turn, health, health2) = (free_stream_port(), free_stream_port(), free_stream_port());
    let first_path = temp_file("config-safety-shared-first.yaml");
    std::fs::write(&first_path, udp_config(turn, health, false)).unwrap();
    let first = Stunnerd::start(&["-c", &format!("file://{}", first_path.display())], &[]);
    assert!(wait_until(10, || ready(health)), "{}", first.logs());
    let second_path = temp_file("config-safety-shared-second.yaml");
    std::fs::write(&second_path, udp_config(turn, health2, false)).unwrap();
    let mut second = Stunnerd::start(
        &[
            "-c",
            &format!("file://{}", second_path.display()),
            "--allow-shared-ports",
        ],
        &[],
    );
    assert!(
        wait_until(10, || ready(health2)),
        "the second stunnerd did not start:\n{}",
        second.logs()
    );
    assert_eq!(second.wait_exit_for(1.0), None, "{}", second.logs());
    drop((first, second));
    let _ = std::fs::remove_file(&first_path);
    let _ = std::fs::remove_file(&second_path);
}

#[test]
fn a_reload_onto_a_port_another_process_holds_is_refused_and_the_running_listener_stays() {
    let (turn, health) = (free_stream_port(), free_stream_port());
    // Another process's socket, as a stale stunnerd would hold it: SO_REUSEPORT, unconnected.
    let held = free_stream_port();
    let holder = reuseport_udp_socket(held);

    let path = temp_file("config-safety-move.yaml");
    std::fs::write(&path, udp_config(turn, health, false)).unwrap();
    let server = start_watching(&format!("file://{}", path.display()));
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    let peer = Peer::start();
    let mut clients = udp_clients(turn, &peer, 4);
    assert!(all_relay(&mut clients, &peer, "before"));

    // Move the listener onto the held port.
    rewrite(&path, &udp_config(held, health, false));
    let refused = wait_until(10, || server.logs().contains("config rejected"));
    let logs = server.logs();
    assert!(refused, "the move was not refused:\n{logs}");
    for needle in [
        &format!("port {held}/udp"),
        "listener \"udp\"",
        "already served by another process",
    ] {
        assert!(logs.contains(needle), "{needle:?} missing:\n{logs}");
    }
    std::thread::sleep(Duration::from_millis(1000));
    assert!(all_relay(&mut clients, &peer, "after"), "{}", server.logs());
    assert!(ready(health));
    drop(holder);
    let _ = std::fs::remove_file(&path);
}

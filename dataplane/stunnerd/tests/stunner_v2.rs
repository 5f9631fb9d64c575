//! STUNner v2 compatibility end to end, with the real `stunnerd` binary: the v2 example configs
//! of `deploy/examples/` served to coturn's `turnutils_uclient` and the turn-client-proto
//! client; v2 configs from a watched file and from the config discovery service (v1 and v2
//! frames mixed, plain and TLS); what uturn refuses, with the running config kept; `/status` of
//! a v2 config; and the v2 command line.

use std::path::PathBuf;
use std::time::{Duration, Instant};
use turn_types::AddressFamily;
use uturn_testkit::cds::FakeCds;
use uturn_testkit::peers::{turnutils_peer, Peer};
use uturn_testkit::stunnerd::{
    free_port, run_stunnerd, status, temp_file, uclient, wait_until, Stunnerd,
};
use uturn_testkit::turn_client::{stream, TurnClient};

fn example(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy/examples")
        .join(name);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// `text` with `pairs` replaced, each of which must occur.
fn edited(text: &str, pairs: &[(&str, &str)]) -> String {
    let mut text = text.to_owned();
    for (from, to) in pairs {
        assert!(text.contains(from), "{from:?} not in the example");
        text = text.replace(from, to);
    }
    text
}

fn write(name: &str, text: &str) -> (PathBuf, String) {
    let path = temp_file(name);
    std::fs::write(&path, text).unwrap();
    let origin = format!("file://{}", path.display());
    (path, origin)
}

fn ready(health: u16) -> bool {
    uturn_testkit::stunnerd::http_get(health, "/ready").is_some_and(|(code, _)| code == 200)
}

/// The minimal v2 example relays coturn's uclient (channels and Send indications) and the
/// turn-client-proto client byte-exact, with the relay address from `$STUNNER_ADDR`.
#[test]
fn minimal_v2_example_relays_uclient_and_turn_client_proto() {
    let (turn, health, peer_port) = (free_port(), free_port(), free_port());
    let text = edited(
        &example("stunnerd-v2-minimal.yaml"),
        &[
            ("port: 3478", &format!("port: {turn}")),
            ("http://:8086", &format!("http://127.0.0.1:{health}")),
            ("\"10.0.0.0/8\"", "\"127.0.0.1\""),
        ],
    );
    let (_file, origin) = write("v2-minimal.yaml", &text);
    let server = Stunnerd::start(&["-c", &origin], &[("STUNNER_ADDR", "127.0.0.1")]);
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    let _peer = turnutils_peer("127.0.0.1", peer_port);
    for mode in [&["-m", "2"][..], &["-s", "-m", "2"][..]] {
        let mut args = vec!["-c", "-n", "20", "-l", "120", "-e", "127.0.0.1", "-r"];
        let (port, peer) = (turn.to_string(), peer_port.to_string());
        args.extend([
            peer.as_str(),
            "-p",
            port.as_str(),
            "-u",
            "alice",
            "-w",
            "s3cret",
        ]);
        args.extend_from_slice(mode);
        args.push("127.0.0.1");
        let (sent, received, out) = uclient(60, &args);
        assert!(sent > 0, "{out}");
        assert_eq!(sent, received, "{mode:?} lost datagrams:\n{out}");
    }
    let peer = Peer::start();
    let mut client = TurnClient::new(
        format!("127.0.0.1:{turn}").parse().unwrap(),
        "alice",
        "s3cret",
    );
    let relay = client.allocate().expect("an allocation");
    assert_eq!(
        relay.ip().to_string(),
        "127.0.0.1",
        "relay address from STUNNER_ADDR"
    );
    assert!(client.permit(peer.addr.ip()));
    assert_eq!(stream(&mut client, peer.addr, "send", 20), 20);
    assert!(client.bind(peer.addr));
    assert_eq!(stream(&mut client, peer.addr, "chan", 20), 20);
    // A peer its cluster does not list gets no permission.
    assert!(!client.permit("127.0.0.2".parse().unwrap()));
    let doc = status(health).unwrap();
    assert_eq!(doc["version"], "v2");
    assert_eq!(doc["servers"][0]["name"], "stunner/udp-gateway/udp");
    assert_eq!(doc["servers"][0]["type"], "turn");
    // uclient's allocations live on after it exits: the server's sessions are all of them.
    let sessions = doc["servers"][0]["sessions"].as_u64().unwrap();
    assert!(sessions >= 1, "{doc}");
    assert_eq!(doc["allocationCount"], sessions, "{doc}");
    assert_eq!(doc["status"], "READY");
}

/// Two listeners with their own servers and two clusters: UDP and TCP clients relay, a
/// STRICT_DNS cluster admits what its name resolves to, and v2 does not enforce ports.
#[test]
fn two_listener_v2_example_serves_udp_and_tcp_with_two_clusters() {
    let (udp, tcp, health, metrics) = (free_port(), free_port(), free_port(), free_port());
    let text = edited(
        &example("stunnerd-v2-two-listeners.yaml"),
        &[
            ("port: 3478\n", &format!("port: {udp}\n")),
            ("port: 3479", &format!("port: {tcp}")),
            ("http://:8086", &format!("http://127.0.0.1:{health}")),
            (
                "http://:8080/metrics",
                &format!("http://127.0.0.1:{metrics}/metrics"),
            ),
            ("\"10.80.0.0/16:10000-20000\"", "\"127.0.0.1:10000-20000\""),
            ("sfu.media.svc.cluster.local", "localhost"),
        ],
    );
    let (_file, origin) = write("v2-two.yaml", &text);
    let server = Stunnerd::start(&["-c", &origin], &[("STUNNER_ADDR", "127.0.0.1")]);
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    assert!(
        server
            .logs()
            .contains("the port of endpoint \"127.0.0.1:10000-20000\" is not enforced"),
        "{}",
        server.logs()
    );
    let peer_port = free_port();
    let _peer = turnutils_peer("127.0.0.1", peer_port);
    let (peer, turn_udp, turn_tcp) = (peer_port.to_string(), udp.to_string(), tcp.to_string());
    // Ephemeral credentials: uclient derives the password from the secret.
    for (port, extra) in [(&turn_udp, &[][..]), (&turn_tcp, &["-t"][..])] {
        let mut args = vec!["-c", "-n", "20", "-l", "120", "-m", "2", "-e", "127.0.0.1"];
        args.extend([
            "-r",
            peer.as_str(),
            "-p",
            port.as_str(),
            "-W",
            "my-shared-secret",
        ]);
        args.extend(["-u", "alice"]);
        args.extend_from_slice(extra);
        args.push("127.0.0.1");
        let (sent, received, out) = uclient(60, &args);
        assert!(sent > 0, "{out}");
        assert_eq!(sent, received, "port {port} {extra:?}:\n{out}");
    }
    let doc = status(health).unwrap();
    let servers: Vec<&str> = doc["servers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["name"].as_str().unwrap())
        .collect();
    assert_eq!(
        servers,
        ["stunner/multi-gateway/udp", "stunner/multi-gateway/tcp"]
    );
    assert_eq!(doc["servers"][1]["clusters"][1], "media/sfu");
}

/// The dual-stack example: relay addresses of both families from STUNNER_ADDRS; an Allocate
/// for an IPv6 relay gets `::1`, and relays to an IPv6 peer on `::1`.
#[test]
fn dual_stack_v2_example_gives_relays_of_both_families() {
    let (turn, health) = (free_port(), free_port());
    let text = edited(
        &example("stunnerd-v2-dual-stack.json"),
        &[
            ("\"port\": 3478", &format!("\"port\": {turn}")),
            ("http://:8086", &format!("http://127.0.0.1:{health}")),
            ("\"10.0.0.0/8\", \"fd00:10::/64\"", "\"127.0.0.1\", \"::1\""),
        ],
    );
    let (_file, origin) = write("v2-dual.json", &text);
    let server = Stunnerd::start(
        &["-l", "all:DEBUG", "-c", &origin],
        &[("STUNNER_ADDRS", "127.0.0.1,::1")],
    );
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    assert!(
        server.logs().contains("relay address 127.0.0.1, ::1"),
        "{}",
        server.logs()
    );
    let peer_port = free_port();
    let _peer = turnutils_peer("::1", peer_port);
    let (port, peer) = (turn.to_string(), peer_port.to_string());
    // -x: an IPv6 relay (REQUESTED-ADDRESS-FAMILY), to the peer on ::1.
    let (sent, received, out) = uclient(
        60,
        &[
            "-c",
            "-x",
            "-n",
            "20",
            "-l",
            "120",
            "-m",
            "2",
            "-e",
            "::1",
            "-r",
            &peer,
            "-p",
            &port,
            "-u",
            "alice",
            "-w",
            "s3cret",
            "127.0.0.1",
        ],
    );
    assert!(sent > 0, "{out}");
    assert_eq!(sent, received, "IPv6 relay lost datagrams:\n{out}");
    assert!(
        server.logs().contains("relay-address=[::1]:"),
        "no IPv6 relayed address: {}",
        server.logs()
    );
    // -Z: a dual allocation (an IPv4 and an IPv6 relay), to the IPv6 peer and an IPv4 one.
    let peer4_port = free_port();
    let _peer4 = turnutils_peer("127.0.0.1", peer4_port);
    let peer4 = peer4_port.to_string();
    for (ip, peer) in [("::1", &peer), ("127.0.0.1", &peer4)] {
        let (sent, received, out) = uclient(
            60,
            &[
                "-Z",
                "-n",
                "20",
                "-l",
                "120",
                "-m",
                "2",
                "-e",
                ip,
                "-r",
                peer,
                "-p",
                &port,
                "-u",
                "alice",
                "-w",
                "s3cret",
                "127.0.0.1",
            ],
        );
        assert!(sent > 0, "{out}");
        assert_eq!(
            sent, received,
            "dual allocation to {ip} lost datagrams:\n{out}"
        );
    }
    // The turn-client-proto client: an IPv6 relay, then a dual allocation reaching an IPv4 and
    // an IPv6 echo peer each through the relay of its family (Send/Data indications).
    let server_addr = format!("127.0.0.1:{turn}").parse().unwrap();
    let (echo4, echo6) = (Peer::on("127.0.0.1"), Peer::on("::1"));
    let mut v6 = TurnClient::with_families(server_addr, "alice", "s3cret", &[AddressFamily::IPV6]);
    let relay = v6.allocate().expect("an IPv6 allocation");
    assert_eq!(relay.ip().to_string(), "::1");
    assert!(v6.permit(echo6.addr.ip()));
    assert_eq!(stream(&mut v6, echo6.addr, "six", 20), 20);
    let mut dual = TurnClient::with_families(
        server_addr,
        "alice",
        "s3cret",
        &[AddressFamily::IPV4, AddressFamily::IPV6],
    );
    dual.allocate().expect("a dual allocation");
    let mut families: Vec<bool> = dual.relayed().iter().map(|a| a.is_ipv6()).collect();
    families.sort();
    assert_eq!(families, [false, true], "{:?}", dual.relayed());
    for echo in [&echo4, &echo6] {
        assert!(dual.permit(echo.addr.ip()));
        assert_eq!(
            stream(&mut dual, echo.addr, "dual", 20),
            20,
            "{}",
            echo.addr
        );
        let relay = dual
            .relayed()
            .into_iter()
            .find(|a| a.is_ipv6() == echo.addr.is_ipv6())
            .unwrap();
        assert!(echo.senders().contains_key(&relay), "{:?}", echo.senders());
    }
}

/// An IPv6-only pod (STUNNER_ADDRS names one IPv6 address, the config none): clients reach
/// the listener over IPv6 and get IPv6 relays without asking for the family (a request for a
/// family the listener does not serve gets 440: `dual_stack.rs`).
#[test]
fn ipv6_only_pod_relays_over_ipv6() {
    let (turn, health) = (free_port(), free_port());
    let text = edited(
        &example("stunnerd-v2-minimal.yaml"),
        &[
            ("port: 3478", &format!("port: {turn}")),
            ("http://:8086", &format!("http://127.0.0.1:{health}")),
            ("\"10.0.0.0/8\"", "\"::1\""),
            ("    addresses: [\"$STUNNER_ADDR\"]\n", ""),
        ],
    );
    let (_file, origin) = write("v2-v6only.yaml", &text);
    let server = Stunnerd::start(
        &["-l", "all:DEBUG", "-c", &origin],
        &[("STUNNER_ADDRS", "::1")],
    );
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    let peer_port = free_port();
    let _peer = turnutils_peer("::1", peer_port);
    let (port, peer) = (turn.to_string(), peer_port.to_string());
    let run = |family: &[&str]| {
        let mut args = vec![
            "-c", "-n", "20", "-l", "120", "-m", "2", "-e", "::1", "-r", &peer,
        ];
        args.extend(["-p", &port, "-u", "alice", "-w", "s3cret"]);
        args.extend_from_slice(family);
        args.push("::1");
        uclient(30, &args)
    };
    let (sent, received, out) = run(&[]);
    assert!(sent > 0, "{out}\n{}", server.logs());
    assert_eq!(sent, received, "{out}");
    assert!(
        server.logs().contains("relay-address=[::1]:"),
        "{}",
        server.logs()
    );
    assert!(
        !server.logs().contains("relay-address=0.0.0.0"),
        "an IPv4 relay was served: {}",
        server.logs()
    );
}

/// v2 configs arrive from a watched file and from the config discovery service, over
/// WebSocket, HTTP and TLS, mixed with v1 frames; the operator's query carries both node forms.
#[test]
fn v2_configs_apply_from_watched_files_and_cds_mixed_with_v1() {
    // Each server gets ports of its own: one killed a moment ago may hold its ports a while.
    let (turn, health) = (std::cell::Cell::new(0), std::cell::Cell::new(0));
    let fresh_ports = || {
        turn.set(free_port());
        health.set(free_port());
    };
    let v2 = |realm: &str| {
        let (turn, health) = (turn.get(), health.get());
        format!(
            r#"{{"version":"v2","admin":{{"name":"media/gw","healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"realm":"{realm}","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"udp","protocol":"UDP","port":{turn},"servers":["turn"]}}],"servers":[{{"name":"turn","clusters":["media"]}}],"clusters":[{{"name":"media","protocol":"UDP","endpoints":["127.0.0.1"],"addresses":["127.0.0.1"]}}]}}"#
        )
    };
    let v1 = |realm: &str| {
        let (turn, health) = (turn.get(), health.get());
        format!(
            r#"{{"version":"v1","admin":{{"name":"media/gw","healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"realm":"{realm}","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"udp","address":"127.0.0.1","port":{turn},"routes":["media"]}}],"clusters":[{{"name":"media","endpoints":["127.0.0.1"]}}]}}"#
        )
    };
    let realm_is = |realm: &str| status(health.get()).is_some_and(|s| s["auth"]["realm"] == realm);
    let version_is = |v: &str| status(health.get()).is_some_and(|s| s["version"] == v);

    // A watched file: v2, then v1, then v2 again.
    fresh_ports();
    let (path, origin) = write("v2-watch.json", &v2("file-one"));
    let server = Stunnerd::start(&["-w", "-c", &origin], &[]);
    assert!(wait_until(10, || realm_is("file-one")), "{}", server.logs());
    std::fs::write(&path, v1("file-two")).unwrap();
    assert!(wait_until(10, || realm_is("file-two") && version_is("v1")));
    std::fs::write(&path, v2("file-three")).unwrap();
    assert!(wait_until(10, || realm_is("file-three") && version_is("v2")));
    drop(server);

    // CDS over WebSocket: frames of both versions, then a list mixing them.
    fresh_ports();
    let cds = FakeCds::start("127.0.0.1:0");
    cds.push("media/gw", &v2("cds-one"));
    let server = Stunnerd::start(
        &[
            "-w",
            "-c",
            &format!("http://{}", cds.addr()),
            "--id",
            "media/gw",
        ],
        &[("STUNNER_NODENAME", "node-1")],
    );
    assert!(wait_until(10, || realm_is("cds-one")), "{}", server.logs());
    cds.push("media/gw", &v1("cds-two"));
    assert!(wait_until(10, || realm_is("cds-two") && version_is("v1")));
    let other = v1("other").replace("media/gw", "media/other");
    cds.push(
        "media/gw",
        &format!(
            r#"{{"version":"v2","items":[{other},{}]}}"#,
            v2("cds-three")
        ),
    );
    assert!(
        wait_until(10, || realm_is("cds-three") && version_is("v2")),
        "{}",
        server.logs()
    );
    assert!(
        cds.requests()
            .iter()
            .any(|r| r == "/api/v1/configs/media/gw?label=node%3Dnode-1&node=node-1&watch=true"),
        "{:?}",
        cds.requests()
    );
    drop(server);

    // A one-shot HTTP load of a v2 config.
    fresh_ports();
    cds.push("media/gw", &v2("cds-three"));
    let server = Stunnerd::start(
        &["-c", &format!("http://{}", cds.addr()), "--id", "media/gw"],
        &[],
    );
    assert!(
        wait_until(10, || realm_is("cds-three")),
        "{}",
        server.logs()
    );
    drop(server);
    drop(cds);

    // https / wss: the server's certificate is trusted through SSL_CERT_FILE.
    let dir = uturn_testkit::stunnerd::temp_dir("cds-tls");
    let cert = uturn_testkit::tls::self_signed_cert(&dir);
    let cds = FakeCds::start_tls("127.0.0.1:0", &cert.cert, &cert.key);
    fresh_ports();
    cds.push("media/gw", &v2("tls-one"));
    let ca = cert.cert.to_str().unwrap();
    let https = format!("https://127.0.0.1:{}", cds.addr().port());
    let server = Stunnerd::start(
        &["-c", &https, "--id", "media/gw"],
        &[("SSL_CERT_FILE", ca)],
    );
    assert!(wait_until(10, || realm_is("tls-one")), "{}", server.logs());
    drop(server);
    fresh_ports();
    cds.push("media/gw", &v2("tls-one"));
    let server = Stunnerd::start(
        &["-w", "-c", &https, "--id", "media/gw"],
        &[("SSL_CERT_FILE", ca)],
    );
    assert!(wait_until(10, || realm_is("tls-one")), "{}", server.logs());
    assert!(
        server.logs().contains("wss://127.0.0.1"),
        "the watch is not over wss: {}",
        server.logs()
    );
    cds.push("media/gw", &v2("tls-two"));
    assert!(wait_until(10, || realm_is("tls-two")), "{}", server.logs());
    drop(server);
    // Without the CA the server is not trusted, and says why.
    let server = Stunnerd::start(&["-c", &https, "--id", "media/gw"], &[]);
    let mut server = server;
    assert_eq!(server.wait_exit_for(15.0), Some(1), "{}", server.logs());
    assert!(server.logs().contains("TLS"), "{}", server.logs());
}

/// An L4 server, a tunnelled cluster and a STDIN listener are refused: on a reload with the
/// object named and the running config kept (still relaying), at start with exit 1.
#[test]
fn refused_objects_keep_the_running_config() {
    let (turn, health) = (free_port(), free_port());
    let good = format!(
        r#"{{"version":"v2","admin":{{"healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"realm":"kept","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"udp","port":{turn},"servers":["turn"]}}],"servers":[{{"name":"turn","clusters":["media"]}}],"clusters":[{{"name":"media","protocol":"UDP","endpoints":["127.0.0.1"],"addresses":["127.0.0.1"]}}]}}"#
    );
    let refused = [
        (
            good.replace(
                r#""clusters":["media"]}]"#,
                r#""clusters":["media"]},{"name":"proxy","type":"l4"}]"#,
            ),
            "servers[1].type",
        ),
        (
            good.replace(
                r#""addresses":["127.0.0.1"]}"#,
                r#""addresses":["127.0.0.1"],"tunnel":{"url":"turn:192.0.2.1:3478"}}"#,
            ),
            "clusters[0].tunnel",
        ),
        (
            good.replace(
                r#"[{"name":"udp","#,
                r#"[{"name":"in","protocol":"STDIN","servers":["turn"]},{"name":"udp","#,
            ),
            "listeners[0].protocol",
        ),
    ];
    let (path, origin) = write("v2-refused.json", &good);
    let server = Stunnerd::start(&["-w", "-c", &origin], &[]);
    assert!(
        wait_until(10, || status(health)
            .is_some_and(|s| s["auth"]["realm"] == "kept")),
        "{}",
        server.logs()
    );
    let peer = Peer::start();
    for (text, field) in &refused {
        std::fs::write(&path, text.replace("\"kept\"", "\"changed\"")).unwrap();
        assert!(
            wait_until(10, || server.logs().contains(field)),
            "{field} not named: {}",
            server.logs()
        );
        assert_eq!(status(health).unwrap()["auth"]["realm"], "kept");
        let mut client = TurnClient::new(
            format!("127.0.0.1:{turn}").parse().unwrap(),
            "alice",
            "s3cret",
        );
        assert!(client.allocate().is_some(), "{field}: not serving");
        assert!(client.permit(peer.addr.ip()));
        assert_eq!(stream(&mut client, peer.addr, field, 10), 10);
    }
    drop(server);
    for (text, field) in &refused {
        let (_file, origin) = write("v2-refused-start.json", text);
        let mut server = Stunnerd::start(&["-c", &origin], &[]);
        assert_eq!(server.wait_exit_for(10.0), Some(1), "{}", server.logs());
        assert!(server.logs().contains(field), "{}", server.logs());
    }
}

/// `--no-graceful-shutdown`: SIGTERM with a live allocation exits at once (status 0) instead
/// of draining; without it the allocation keeps the process up.
#[test]
fn no_graceful_shutdown_exits_at_once_with_a_live_allocation() {
    let turn = free_port();
    let config = format!(
        "version: v2\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {{credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, port: {turn}, servers: [turn]}}]\nservers: [{{name: turn, clusters: [media]}}]\n\
         clusters: [{{name: media, protocol: UDP, endpoints: [127.0.0.1], addresses: [127.0.0.1]}}]\n"
    );
    let (_file, origin) = write("v2-shutdown.yaml", &config);
    for immediate in [true, false] {
        let args: &[&str] = if immediate {
            &["--no-graceful-shutdown", "-c", &origin]
        } else {
            &["-c", &origin]
        };
        let mut server = Stunnerd::start(args, &[]);
        let mut client = TurnClient::new(
            format!("127.0.0.1:{turn}").parse().unwrap(),
            "alice",
            "s3cret",
        );
        assert!(
            wait_until(10, || client.allocate().is_some()),
            "{}",
            server.logs()
        );
        // The count is published once per 100 ms tick.
        client.drive(0.3);
        let sent = Instant::now();
        server.signal(libc::SIGTERM);
        if immediate {
            assert_eq!(server.wait_exit_for(1.0), Some(0), "{}", server.logs());
            assert!(sent.elapsed() < Duration::from_secs(1));
            assert!(
                server
                    .logs()
                    .contains("exiting with 1 active connection(s): graceful shutdown is disabled"),
                "{}",
                server.logs()
            );
        } else {
            assert_eq!(
                server.wait_exit_for(1.5),
                None,
                "a drain ended with an allocation live"
            );
            client.delete();
            assert_eq!(server.wait_exit_for(5.0), Some(0), "{}", server.logs());
        }
    }
}

/// The v2 command line: `--license` is checked (and shown redacted in `/status`), tunnel mode
/// and other argument counts are refused with the reason, `--sni`/`--insecure` are accepted.
#[test]
fn v2_command_line() {
    let (code, text) = run_stunnerd(&[
        "--license",
        "{\"key\":\"k\"}",
        "-d",
        "-c",
        "file:///dev/null",
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(
        text.contains("invalid --license: expecting the JSON licensegen writes"),
        "{text}"
    );
    let (code, text) = run_stunnerd(&["--license", "not json"]);
    assert_eq!(code, 1, "{text}");
    let (code, text) = run_stunnerd(&[
        "udp://127.0.0.1:5000",
        "turn://u:p@127.0.0.1:3478",
        "udp://127.0.0.1:9000",
    ]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("tunnel mode"), "{text}");
    let (code, text) = run_stunnerd(&["turn://u:p@127.0.0.1:3478", "extra"]);
    assert_eq!(code, 1, "{text}");
    assert!(text.contains("2 positional arguments"), "{text}");

    let (turn, health) = (free_port(), free_port());
    let config = format!(
        "version: v2\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\nauth: {{credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, port: {turn}, servers: [turn]}}]\nservers: [{{name: turn, clusters: []}}]\n"
    );
    let (_file, origin) = write("v2-license.yaml", &config);
    let server = Stunnerd::start(
        &[
            "--license",
            r#"{"license_config":{"key":"k3y","hmac":"hm4c"}}"#,
            "--sni",
            "example.com",
            "--insecure",
            "--offload",
            "none",
            "-u",
            "16",
            "-c",
            &origin,
        ],
        &[],
    );
    assert!(
        wait_until(10, || status(health).is_some()),
        "{}",
        server.logs()
    );
    // /status shows the admin section as STUNner's AdminStatus: the license as its tier,
    // never the key.
    let doc = status(health).unwrap();
    assert_eq!(doc["admin"]["licensing_info"], "{tier:free}", "{doc}");
    assert!(doc["admin"].get("license_config").is_none(), "{doc}");
    assert!(!doc.to_string().contains("k3y"));
}

/// A v2 listener's `address` is its bind address: the port is taken on that address only (a
/// socket of another process may bind it on another address), and TURN is served there. An
/// empty address binds every address of both families, as a v1 listener does.
#[test]
fn v2_listener_address_is_the_bind_address() {
    let (udp, tcp, health) = (free_port(), free_port(), free_port());
    let config = format!(
        "version: v2\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {udp}, servers: [turn]}},\n\
                     {{name: tcp, protocol: TCP, address: 127.0.0.1, port: {tcp}, servers: [turn]}}]\n\
         servers: [{{name: turn, clusters: [media]}}]\n\
         clusters: [{{name: media, protocol: UDP, endpoints: [127.0.0.1], addresses: [127.0.0.1]}}]\n"
    );
    let (_file, origin) = write("v2-bind.yaml", &config);
    let server = Stunnerd::start(&["-c", &origin], &[]);
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    // Another address of the host keeps the ports free.
    assert!(
        std::net::UdpSocket::bind(("127.0.0.2", udp)).is_ok(),
        "UDP port {udp} taken beyond 127.0.0.1"
    );
    assert!(
        std::net::TcpListener::bind(("127.0.0.2", tcp)).is_ok(),
        "TCP port {tcp} taken beyond 127.0.0.1"
    );
    assert!(std::net::UdpSocket::bind(("127.0.0.1", udp)).is_err());
    let peer = Peer::start();
    let mut client = TurnClient::new(
        format!("127.0.0.1:{udp}").parse().unwrap(),
        "alice",
        "s3cret",
    );
    assert!(client.allocate().is_some(), "{}", server.logs());
    assert!(client.permit(peer.addr.ip()));
    assert_eq!(stream(&mut client, peer.addr, "bound", 10), 10);
    drop(server);

    // Without an address: every address (the wildcard), as before.
    let config = config.replace("address: 127.0.0.1, ", "");
    let (_file, origin) = write("v2-wildcard.yaml", &config);
    let server = Stunnerd::start(&["-c", &origin], &[]);
    assert!(wait_until(10, || ready(health)), "{}", server.logs());
    assert!(
        std::net::UdpSocket::bind(("127.0.0.2", udp)).is_err(),
        "the wildcard listener left UDP port {udp} free on 127.0.0.2"
    );
    drop(server);
}

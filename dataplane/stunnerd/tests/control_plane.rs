//! The control plane end to end: the real `stunnerd` binary following a config file, a config
//! discovery server speaking STUNner's protocol, and a Kubernetes API-server fake (LIST and
//! chunked WATCH) through the real kube-rs client, with `turn-client-proto` relaying through it.

use apiserver::{endpoint_slice, service, FakeApiServer, Resource};
use serde_json::Value;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::Duration;
use turn_client_proto::api::TurnEvent;
use uturn_testkit::stunnerd::{free_port, status, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::TurnClient;
use uturn_testkit::{apiserver, cds};

const CREATE_PERMISSION: u16 = 0x0008;
const CHANNEL_BIND: u16 = 0x0009;

/// The discovery entry of `service` in `/status`.
fn discovered(health: u16, service: &str) -> Option<Value> {
    status(health)?["discovery"]["kubernetes"]
        .as_array()?
        .iter()
        .find(|s| s["service"] == service)
        .cloned()
}

fn listed(entry: &Option<Value>, field: &str, ip: &str) -> bool {
    entry
        .as_ref()
        .and_then(|e| e[field].as_array().cloned())
        .is_some_and(|a| a.iter().any(|v| v == ip))
}

fn kubernetes_config(turn: u16, health: u16, service: &str) -> String {
    format!(
        "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
         clusters: [{{name: media, type: KUBERNETES, endpoints: [\"{service}\"]}}]\n"
    )
}

/// A UDP "pod" on its own loopback address.
fn pod(ip: &str) -> UdpSocket {
    let socket = UdpSocket::bind((ip, 0)).unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    socket
}

fn recv(socket: &UdpSocket) -> Option<Vec<u8>> {
    let mut buf = [0u8; 2048];
    socket
        .recv_from(&mut buf)
        .ok()
        .map(|(n, _)| buf[..n].to_vec())
}

fn got(d: &TurnClient, data: &[u8]) -> bool {
    d.received.iter().any(|(_, p)| p == data)
}

/// [`kubernetes_config`] as a STUNner v2 document.
fn kubernetes_config_v2(turn: u16, health: u16, service: &str) -> String {
    format!(
        "version: v2\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
         listeners: [{{name: udp, port: {turn}, servers: [turn]}}]\n\
         servers: [{{name: turn, clusters: [media]}}]\n\
         clusters: [{{name: media, type: KUBERNETES, protocol: UDP, endpoints: [\"{service}\"], \
         addresses: [127.0.0.1]}}]\n"
    )
}

/// The first field report: a media pod that starts draining keeps its calls, and only when
/// its endpoint is finally gone does the gateway refuse it.
#[test]
fn terminating_endpoint_keeps_relaying_until_it_is_deleted() {
    terminating_endpoint_scenario(kubernetes_config);
}

/// The same with a STUNner v2 config: terminating endpoints and the peer policy apply alike.
#[test]
fn terminating_endpoint_keeps_relaying_until_it_is_deleted_v2() {
    terminating_endpoint_scenario(kubernetes_config_v2);
}

fn terminating_endpoint_scenario(config_of: fn(u16, u16, &str) -> String) {
    let api = FakeApiServer::start();
    api.apply(
        Resource::Service,
        service("media", "media-server", &["10.96.0.10"]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "media",
            "media-server-abc",
            "media-server",
            &[("127.0.0.2", true, true, false)],
        ),
    );
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("seed.yaml");
    std::fs::write(&config, config_of(turn, health, "media/media-server")).unwrap();
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let server = Stunnerd::start(
        &["-c", &format!("file://{}", config.display())],
        &[("KUBECONFIG", kubeconfig.to_str().unwrap())],
    );
    assert!(
        wait_until(20, || listed(
            &discovered(health, "media/media-server"),
            "addresses",
            "127.0.0.2"
        )),
        "the pod was never discovered: {:?}\n{}",
        status(health),
        server.logs()
    );
    let entry = discovered(health, "media/media-server");
    assert!(listed(&entry, "clusterIPs", "10.96.0.10"), "{entry:?}");

    let media = pod("127.0.0.2");
    let media_addr = media.local_addr().unwrap();
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    let relay = d.allocate().expect("allocation");
    assert!(d.permit(media_addr.ip()));
    assert!(d.bind(media_addr));
    d.send(media_addr, b"hello pod");
    assert_eq!(recv(&media).as_deref(), Some(&b"hello pod"[..]));
    media.send_to(b"hello client", relay).unwrap();
    d.drive(0.3);
    assert!(got(&d, b"hello client"));

    // The pod is deleted: it drains, its endpoint turns ready=false serving=true terminating=true.
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "media",
            "media-server-abc",
            "media-server",
            &[("127.0.0.2", false, true, true)],
        ),
    );
    assert!(wait_until(10, || listed(
        &discovered(health, "media/media-server"),
        "terminating",
        "127.0.0.2"
    )));
    // Refresh the permission (twice) and the channel: the client thinks minutes have passed.
    let before = d.responses.len();
    d.warp(Duration::from_secs(250));
    d.drive(0.5);
    d.warp(Duration::from_secs(295));
    d.drive(0.5);
    let refreshes = &d.responses[before..];
    let ok = |method| refreshes.iter().any(|r| r.method == method && r.success);
    assert!(
        ok(CREATE_PERMISSION),
        "no successful permission refresh: {refreshes:?}"
    );
    assert!(
        ok(CHANNEL_BIND),
        "no successful channel refresh: {refreshes:?}"
    );
    assert!(refreshes.iter().all(|r| r.success), "{refreshes:?}");
    assert!(
        !d.events.iter().any(|e| e.contains("Failed")),
        "{:?}",
        d.events
    );
    d.send(media_addr, b"still there");
    assert_eq!(recv(&media).as_deref(), Some(&b"still there"[..]));
    media.send_to(b"still here", relay).unwrap();
    d.drive(0.3);
    assert!(got(&d, b"still here"));

    // The endpoint is finally removed.
    api.delete(Resource::EndpointSlice, "media", "media-server-abc");
    assert!(wait_until(10, || {
        let entry = discovered(health, "media/media-server");
        entry.is_some() && !listed(&entry, "addresses", "127.0.0.2")
    }));
    let mut late = TurnClient::new(turn_addr, "alice", "s3cret");
    late.allocate().expect("allocation");
    assert!(
        !late.permit(media_addr.ip()),
        "permission to a deleted endpoint granted"
    );
    assert!(
        late.responses
            .iter()
            .any(|r| r.method == CREATE_PERMISSION && r.error_code == Some(403)),
        "{:?}",
        late.responses
    );
    d.send(media_addr, b"dropped");
    assert_eq!(
        recv(&media),
        None,
        "a datagram to a deleted endpoint was relayed"
    );
    media.send_to(b"dropped too", relay).unwrap();
    d.drive(0.5);
    assert!(
        !got(&d, b"dropped too"),
        "a datagram from a deleted endpoint was relayed"
    );
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(kubeconfig);
}

/// Two slices for one Service; one is deleted while the API server is away and its history
/// compacted. The watch resumes with 410 Expired, relists, and the deleted slice's addresses go.
#[test]
fn relist_after_an_outage_drops_slices_deleted_meanwhile() {
    let api = FakeApiServer::start();
    api.apply(
        Resource::Service,
        service("media", "sfu", &["10.96.0.20", "fd00::20"]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice("media", "sfu-a", "sfu", &[("127.0.0.3", true, true, false)]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice("media", "sfu-b", "sfu", &[("127.0.0.4", true, true, false)]),
    );
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("relist.yaml");
    std::fs::write(&config, kubernetes_config(turn, health, "media/sfu")).unwrap();
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let server = Stunnerd::start(
        &[
            "-c",
            &format!("file://{}", config.display()),
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        &[],
    );
    let both = || {
        let e = discovered(health, "media/sfu");
        listed(&e, "addresses", "127.0.0.3") && listed(&e, "addresses", "127.0.0.4")
    };
    assert!(
        wait_until(20, both),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    assert!(listed(
        &discovered(health, "media/sfu"),
        "clusterIPs",
        "fd00::20"
    ));

    api.set_up(false);
    assert!(
        wait_until(20, || discovered(health, "media/sfu").is_some_and(|e| e
            ["api"]
            .as_str()
            .unwrap_or("")
            .starts_with("unreachable"))),
        "{:?}",
        discovered(health, "media/sfu")
    );
    assert!(
        server.logs().contains("Kubernetes API unreachable"),
        "{}",
        server.logs()
    );
    api.delete(Resource::EndpointSlice, "media", "sfu-b");
    api.compact();
    // Meanwhile the last known endpoints stay in force.
    assert!(
        both(),
        "endpoints were dropped while the API server was away"
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(d.permit("127.0.0.4".parse::<IpAddr>().unwrap()));

    api.set_up(true);
    assert!(
        wait_until(30, || {
            let e = discovered(health, "media/sfu");
            listed(&e, "addresses", "127.0.0.3")
                && !listed(&e, "addresses", "127.0.0.4")
                && e.is_some_and(|e| e["api"] == "connected")
        }),
        "{:?}\n{}",
        discovered(health, "media/sfu"),
        server.logs()
    );
    assert!(server.logs().contains("Kubernetes API reachable again"));
    let lists = api
        .requests()
        .iter()
        .filter(|r| r.contains("endpointslices") && !r.contains("watch=true"))
        .count();
    assert!(lists >= 2, "no relist: {:?}", api.requests());
    assert!(
        api.expired_served() >= 1,
        "the watch never resumed from the compacted version: {:?}",
        api.requests()
    );
    let mut late = TurnClient::new(turn_addr, "alice", "s3cret");
    late.allocate().expect("allocation");
    assert!(!late.permit("127.0.0.4".parse::<IpAddr>().unwrap()));
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(kubeconfig);
}

fn static_config(turn: u16, health: u16, password: &str, extra: bool) -> String {
    let (routes, clusters, loglevel) = if extra {
        (
            "[media, extra]",
            "[{name: media, endpoints: [127.0.0.1]}, {name: extra, endpoints: [127.0.0.9]}]",
            "all:INFO,k8s:DEBUG",
        )
    } else {
        (
            "[media]",
            "[{name: media, endpoints: [127.0.0.1]}]",
            "all:INFO",
        )
    };
    format!(
        "version: v1\nadmin: {{name: media/gw, loglevel: \"{loglevel}\", healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: alice, password: {password}}}}}\n\
         listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: {routes}}}]\n\
         clusters: {clusters}\n"
    )
}

/// A stunnerd watching a file holding [`static_config`] on free ports, once it is READY; with
/// the file and the TURN and health ports.
fn watching_static_config(name: &str) -> (Stunnerd, std::path::PathBuf, u16, u16) {
    let (turn, health) = (free_port(), free_port());
    let config = temp_file(name);
    std::fs::write(&config, static_config(turn, health, "s3cret", false)).unwrap();
    let server = Stunnerd::start(&["-w", "-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || status(health)
            .is_some_and(|s| s["status"] == "READY")),
        "{}",
        server.logs()
    );
    (server, config, turn, health)
}

/// An echo peer on 127.0.0.1, answering until `stop` is set.
fn echo_peer(stop: std::sync::Arc<std::sync::atomic::AtomicBool>) -> SocketAddr {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let addr = socket.local_addr().unwrap();
    std::thread::spawn(move || {
        let mut buf = [0u8; 2048];
        while !stop.load(std::sync::atomic::Ordering::Relaxed) {
            if let Ok((n, from)) = socket.recv_from(&mut buf) {
                let _ = socket.send_to(&buf[..n], from);
            }
        }
    });
    addr
}

/// A ConfigMap-style replacement of the config file (write aside, rename over) that adds a
/// route and a cluster and rotates the password, while an allocation relays: nothing is lost.
#[test]
fn file_reconfiguration_loses_no_packet_of_a_live_allocation() {
    let (server, config, turn, health) = watching_static_config("watch.yaml");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let peer = echo_peer(stop.clone());
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(d.permit(peer.ip()));
    assert!(d.bind(peer));

    const PACKETS: u32 = 1500;
    let mut applied_mid_flow = false;
    let started = std::time::Instant::now();
    for seq in 0..PACKETS {
        d.send(peer, format!("seq {seq:05}").as_bytes());
        // One packet every 2 ms; the config changes a third of the way in.
        while started.elapsed() < Duration::from_millis(2 * u64::from(seq + 1)) {
            d.drive(0.001);
        }
        if seq == PACKETS / 3 {
            let aside = config.with_extension("new");
            std::fs::write(&aside, static_config(turn, health, "n3w", true)).unwrap();
            std::fs::rename(&aside, &config).unwrap();
        }
        if seq == 2 * PACKETS / 3 {
            // /status redacts the password; the rotation is checked by allocating below.
            applied_mid_flow = status(health).is_some_and(|s| {
                s["admin"]["loglevel"] == "all:INFO,k8s:DEBUG"
                    && s["clusters"].as_array().is_some_and(|c| c.len() == 2)
            });
        }
    }
    d.drive(0.5);
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(
        applied_mid_flow,
        "the new config was not live while traffic flowed: {:?}",
        status(health)
    );
    let echoed: std::collections::BTreeSet<Vec<u8>> =
        d.received.iter().map(|(_, p)| p.clone()).collect();
    let missing: Vec<u32> = (0..PACKETS)
        .filter(|seq| !echoed.contains(format!("seq {seq:05}").as_bytes()))
        .collect();
    assert!(
        missing.is_empty(),
        "lost {} packets: {:?}",
        missing.len(),
        &missing[..missing.len().min(20)]
    );
    let status = status(health).unwrap();
    assert_eq!(
        status["allocationCount"], 1,
        "the live allocation did not survive"
    );
    let logs = server.logs();
    assert!(logs.contains("restarted objects: 0"), "{logs}");
    assert!(
        logs.contains("Setting loglevel to \"all:INFO,k8s:DEBUG\""),
        "admin change not applied: {logs}"
    );

    // The rotation is in force: the new password allocates, the old one does not.
    let mut fresh = TurnClient::new(turn_addr, "alice", "n3w");
    assert!(fresh.allocate().is_some());
    let mut stale = TurnClient::new(turn_addr, "alice", "s3cret");
    let event = stale.until_for(2.0, &|e| matches!(e, TurnEvent::AllocationCreated(..)));
    assert!(event.is_none(), "the old password still allocates");
    let _ = std::fs::remove_file(config);
}

/// A realm change restarts the listener (stunnerd.md §2.8): its allocations go.
#[test]
fn realm_change_restarts_the_listener() {
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("realm.yaml");
    let text = static_config(turn, health, "s3cret", false);
    std::fs::write(&config, &text).unwrap();
    let server = Stunnerd::start(&["-w", "-c", &format!("file://{}", config.display())], &[]);
    assert!(wait_until(10, || status(health)
        .is_some_and(|s| s["status"] == "READY")));
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(wait_until(5, || status(health)
        .is_some_and(|s| s["allocationCount"] == 1)));
    std::fs::write(
        &config,
        text.replace("auth: {", "auth: {realm: other.example, "),
    )
    .unwrap();
    assert!(
        wait_until(10, || status(health).is_some_and(|s| s["allocationCount"]
            == 0
            && s["auth"]["realm"] == "other.example")),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    assert!(server.logs().contains("restarted objects: 1"));
    let mut again = TurnClient::new(turn_addr, "alice", "s3cret");
    assert!(
        again.allocate().is_some(),
        "the restarted listener does not serve"
    );
    let _ = std::fs::remove_file(config);
}

fn cds_config(turn: u16, health: u16, realm: &str) -> String {
    format!(
        r#"{{"version":"v1","admin":{{"name":"media/gw","loglevel":"all:INFO","healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"type":"static","realm":"{realm}","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"media/gw/udp","protocol":"TURN-UDP","address":"127.0.0.1","port":{turn},"routes":["media/route"]}}],"clusters":[{{"name":"media/route","type":"STATIC","protocol":"UDP","endpoints":["127.0.0.1"]}}]}}"#
    )
}

fn realm_is(health: u16, realm: &str) -> bool {
    status(health).is_some_and(|s| s["auth"]["realm"] == realm)
}

/// A CDS server pushes three configs over the WebSocket, a delete (zero config) that is
/// ignored, and is then restarted: stunnerd reconnects and applies the next one.
#[test]
fn cds_watch_applies_pushes_and_survives_a_server_restart() {
    let cds = cds::FakeCds::start("127.0.0.1:0");
    let addr = cds.addr();
    let (turn, health) = (free_port(), free_port());
    cds.push("media/gw", &cds_config(turn, health, "one"));
    let server = Stunnerd::start(
        &["-w", "-c", &format!("http://{addr}"), "--id", "media/gw"],
        &[("STUNNER_NODENAME", "node-1")],
    );
    assert!(
        wait_until(10, || realm_is(health, "one")),
        "{}",
        server.logs()
    );
    cds.push("media/gw", &cds_config(turn, health, "two"));
    assert!(
        wait_until(10, || realm_is(health, "two")),
        "{}",
        server.logs()
    );
    cds.push("media/gw", &cds_config(turn, health, "three"));
    assert!(
        wait_until(10, || realm_is(health, "three")),
        "{}",
        server.logs()
    );
    let zero = r#"{"version":"v1","admin":{"name":"media/gw"},"auth":{"type":"static","realm":"stunner.l7mp.io","credentials":{"username":"dummy-username","password":"dummy-password"}},"listeners":[],"clusters":[]}"#;
    cds.push("media/gw", zero);
    cds.push(
        "media/gw",
        "{\"version\": \"v1\", \"listeners\": [{\"name\": \"x\", \"port\": 99999}]}",
    );
    assert!(
        wait_until(5, || {
            let logs = server.logs();
            logs.contains("Ignoring delete configuration update")
                && logs.contains("listeners[0].port")
        }),
        "a delete or an invalid config was not reported (the field must be named): {}",
        server.logs()
    );
    assert!(
        realm_is(health, "three"),
        "a delete or an invalid config replaced the running one"
    );
    // Keepalive pings, one at once and then every 5 s.
    assert!(wait_until(8, || cds
        .pings()
        .iter()
        .filter(|p| p.as_slice() == b"keepalive")
        .count()
        >= 2));
    assert!(
        cds.requests()
            .iter()
            .any(|r| r == "/api/v1/configs/media/gw?label=node%3Dnode-1&node=node-1&watch=true"),
        "{:?}",
        cds.requests()
    );
    assert!(
        cds.origins().iter().any(|o| *o == format!("http://{addr}")),
        "{:?}",
        cds.origins()
    );
    // The live listener relays through the watch.
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    assert!(d.allocate().is_some());

    cds.stop();
    std::thread::sleep(Duration::from_millis(1500));
    let cds = cds::FakeCds::start(&addr.to_string());
    cds.push("media/gw", &cds_config(turn, health, "four"));
    assert!(
        wait_until(15, || realm_is(health, "four")),
        "{}",
        server.logs()
    );
    assert!(
        server
            .logs()
            .matches("connection successfully opened to config discovery server")
            .count()
            >= 2
    );
}

/// Without -w, one GET: the config is applied; an unknown gateway is a clear error, exit 1.
#[test]
fn cds_one_shot_load() {
    let cds = cds::FakeCds::start("127.0.0.1:0");
    let addr = cds.addr();
    let (turn, health) = (free_port(), free_port());
    cds.push("media/gw", &cds_config(turn, health, "once"));
    let _server = Stunnerd::start(&["-c", &format!("http://{addr}"), "--id", "media/gw"], &[]);
    assert!(wait_until(10, || realm_is(health, "once")));
    assert!(
        cds.requests()
            .iter()
            .any(|r| r == "/api/v1/configs/media/gw"),
        "{:?}",
        cds.requests()
    );
    // The bare HOST:PORT form from the environment, the id from STUNNER_NAMESPACE/NAME.
    let mut missing = Stunnerd::start(
        &[],
        &[
            ("STUNNER_CONFIG_ORIGIN", &addr.to_string()),
            ("STUNNER_NAMESPACE", "media"),
            ("STUNNER_NAME", "nope"),
        ],
    );
    assert_eq!(missing.wait_exit(), Some(1));
    assert!(
        missing
            .logs()
            .contains("Config not found for ID media/nope"),
        "{}",
        missing.logs()
    );
}

/// A STRICT_DNS cluster admits what its hostname resolves to (IP only), and nothing else.
#[test]
fn strict_dns_cluster_admits_resolved_addresses() {
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("dns.yaml");
    std::fs::write(
        &config,
        format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
             auth: {{credentials: {{username: alice, password: s3cret}}}}\n\
             listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [dns]}}]\n\
             clusters: [{{name: dns, type: STRICT_DNS, endpoints: [localhost]}}]\n"
        ),
    )
    .unwrap();
    let server = Stunnerd::start(&["-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || status(health)
            .is_some_and(|s| s["discovery"]["dns"][0]["addresses"]
                .as_array()
                .is_some_and(|a| a.iter().any(|ip| ip == "127.0.0.1")))),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    let peer = pod("127.0.0.1");
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    let relay = d.allocate().expect("allocation");
    assert!(d.permit(peer.local_addr().unwrap().ip()));
    d.send(peer.local_addr().unwrap(), b"resolved");
    assert_eq!(recv(&peer).as_deref(), Some(&b"resolved"[..]));
    peer.send_to(b"back", relay).unwrap();
    d.drive(0.3);
    assert!(got(&d, b"back"));
    assert!(!d.permit("127.0.0.5".parse().unwrap()));
    let _ = std::fs::remove_file(config);
}

/// `config` with a second TURN-UDP listener, "extra" on `port`, listed first.
fn with_extra_listener(config: &str, port: u16) -> String {
    config.replace(
        "listeners: [",
        &format!(
            "listeners: [{{name: extra, address: 127.0.0.1, port: {port}, routes: [media]}}, "
        ),
    )
}

/// A listener added by a reconcile opens on every shard that owns one of its sockets; removing
/// it closes them and frees its allocations, while the other listener keeps its own.
#[test]
fn listeners_open_and_close_live_on_every_shard() {
    let (turn, extra, health) = (free_port(), free_port(), free_port());
    let config = temp_file("listeners.yaml");
    let one = static_config(turn, health, "s3cret", false);
    let two = with_extra_listener(&one, extra);
    std::fs::write(&config, &one).unwrap();
    let server = Stunnerd::start(
        &[
            "-w",
            "-u",
            "2",
            "-c",
            &format!("file://{}", config.display()),
        ],
        &[("UTURN_SHARDS", "2")],
    );
    assert!(
        wait_until(10, || status(health)
            .is_some_and(|s| s["status"] == "READY")),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let extra_addr: SocketAddr = format!("127.0.0.1:{extra}").parse().unwrap();
    let mut kept = TurnClient::new(turn_addr, "alice", "s3cret");
    kept.allocate().expect("allocation");

    std::fs::write(&config, &two).unwrap();
    let opened = |shard: usize| {
        format!("listener \"extra\" (TURN-UDP, port {extra}, relay address 127.0.0.1) serving on shard {shard}")
    };
    assert!(
        wait_until(10, || {
            let logs = server.logs();
            logs.contains(&opened(0)) && logs.contains(&opened(1))
        }),
        "{}",
        server.logs()
    );
    let mut d = TurnClient::new(extra_addr, "alice", "s3cret");
    d.allocate().expect("allocation on the new listener");
    assert!(wait_until(5, || status(health)
        .is_some_and(|s| s["allocationCount"] == 2)));

    std::fs::write(&config, &one).unwrap();
    assert!(
        wait_until(10, || status(health)
            .is_some_and(|s| s["allocationCount"] == 1)),
        "the removed listener's allocation was not freed: {:?}",
        status(health)
    );
    // Each shard closes its socket on its next tick (100 ms); wait for both.
    assert!(
        wait_until(5, || {
            let logs = server.logs();
            logs.contains("listener \"extra\" closed on shard 0")
                && logs.contains("listener \"extra\" closed on shard 1")
        }),
        "{}",
        server.logs()
    );
    let mut late = TurnClient::new(extra_addr, "alice", "s3cret");
    assert!(late
        .until_for(1.5, &|e| matches!(e, TurnEvent::AllocationCreated(..)))
        .is_none());
    let peer = pod("127.0.0.1");
    assert!(
        kept.permit(peer.local_addr().unwrap().ip()),
        "the kept allocation lost its permission: {:?}\n{}",
        status(health),
        server.logs()
    );
    kept.send(peer.local_addr().unwrap(), b"kept");
    assert_eq!(recv(&peer).as_deref(), Some(&b"kept"[..]));
    let _ = std::fs::remove_file(config);
}

/// `clients` threads that allocate on `server` as soon as it answers: each retries at once on
/// "port unreachable" (a connected UDP socket reports it), so they all allocate within a few
/// milliseconds of the first socket opening.
fn allocate_as_it_opens(
    server: SocketAddr,
    password: &'static str,
    clients: usize,
) -> Vec<std::thread::JoinHandle<Option<uturn_perf::client::BenchClient>>> {
    (0..clients)
        .map(|_| {
            std::thread::spawn(move || {
                let deadline = std::time::Instant::now() + Duration::from_secs(10);
                while std::time::Instant::now() < deadline {
                    if let Ok(client) =
                        uturn_perf::client::BenchClient::allocate(server, "alice", password)
                    {
                        return Some(client);
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
                None
            })
        })
        .collect()
}

/// Waits until listener `name` on `port` has started `runs` times on all `SHARDS` shards,
/// then asserts that every one of `clients` can still create a permission and send to a peer
/// through its allocation.
fn all_allocations_kept(
    server: &Stunnerd,
    name: &str,
    port: u16,
    runs: usize,
    clients: Vec<std::thread::JoinHandle<Option<uturn_perf::client::BenchClient>>>,
) {
    let mut clients: Vec<_> = clients
        .into_iter()
        .map(|c| {
            c.join()
                .unwrap()
                .expect("an allocation as the listener opened")
        })
        .collect();
    let opened = |shard: usize| {
        format!("listener \"{name}\" (TURN-UDP, port {port}, relay address 127.0.0.1) serving on shard {shard}")
    };
    assert!(
        wait_until(10, || {
            let logs = server.logs();
            (0..SHARDS).all(|shard| logs.matches(&opened(shard)).count() >= runs)
        }),
        "{}",
        server.logs()
    );
    let peer = pod("127.0.0.1");
    let peer_addr = peer.local_addr().unwrap();
    let refused: Vec<String> = clients
        .iter_mut()
        .enumerate()
        .filter_map(|(n, c)| {
            c.create_permission(peer_addr)
                .err()
                .map(|e| format!("client {n}: {e}"))
        })
        .collect();
    assert!(
        refused.is_empty(),
        "listener {name:?}, run {runs}: {} of {} allocations were lost when the other shards opened: {refused:?}",
        refused.len(),
        clients.len()
    );
    let mut sent: Vec<Vec<u8>> = Vec::new();
    for (n, c) in clients.iter().enumerate() {
        let data = format!("{name} client {n}").into_bytes();
        c.socket.send(&c.send_indication(peer_addr, &data)).unwrap();
        sent.push(data);
    }
    let mut heard: Vec<Vec<u8>> = (0..clients.len()).filter_map(|_| recv(&peer)).collect();
    heard.sort();
    sent.sort();
    assert_eq!(heard, sent, "listener {name:?}");
}

/// Shards (and SO_REUSEPORT sockets) of the stunnerd in
/// `allocations_made_while_a_listener_opens_survive_the_other_shards_opening`.
const SHARDS: usize = 4;

/// Clients that allocate in the first moments of a TURN-UDP listener, at startup or added by a
/// reconcile, keep their allocations once every shard serves it. Each shard reads its own
/// SO_REUSEPORT socket and the kernel hashes a client over the sockets bound at that moment,
/// so a shard opening its socket a tick after another used to move many of those clients to
/// a shard that never saw them: 437 to their CreatePermission, their media dropped.
#[test]
fn allocations_made_while_a_listener_opens_survive_the_other_shards_opening() {
    const CLIENTS: usize = 16;
    let (turn, extra, health) = (free_port(), free_port(), free_port());
    let config = temp_file("opening.yaml");
    let one = static_config(turn, health, "s3cret", false);
    let two = with_extra_listener(&one, extra);
    std::fs::write(&config, &one).unwrap();
    let at_start = allocate_as_it_opens(
        format!("127.0.0.1:{turn}").parse().unwrap(),
        "s3cret",
        CLIENTS,
    );
    let shards = SHARDS.to_string();
    let server = Stunnerd::start(
        &[
            "-w",
            "-u",
            &shards,
            "-c",
            &format!("file://{}", config.display()),
        ],
        &[("UTURN_SHARDS", &shards)],
    );
    all_allocations_kept(&server, "udp", turn, 1, at_start);
    let added = allocate_as_it_opens(
        format!("127.0.0.1:{extra}").parse().unwrap(),
        "s3cret",
        CLIENTS,
    );
    std::fs::write(&config, &two).unwrap();
    all_allocations_kept(&server, "extra", extra, 1, added);
    assert!(wait_until(5, || status(health)
        .is_some_and(|s| s["allocationCount"] == 2 * CLIENTS)));
    let _ = std::fs::remove_file(config);
}

/// A listener restarted on its port (a new realm) opens its new sockets only once every shard
/// has closed its old one: an old socket leaving the SO_REUSEPORT group later would move
/// clients that had just allocated on the new one to a shard without their allocation.
#[test]
fn allocations_made_while_a_listener_restarts_survive_the_old_sockets_closing() {
    const CLIENTS: usize = 16;
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("restarting.yaml");
    let before = static_config(turn, health, "s3cret", false);
    std::fs::write(&config, &before).unwrap();
    let shards = SHARDS.to_string();
    let server = Stunnerd::start(
        &[
            "-w",
            "-u",
            &shards,
            // The clients retry at once on a 401 from the old run: no challenge budget.
            "--challenge-rate",
            "0",
            "-c",
            &format!("file://{}", config.display()),
        ],
        &[("UTURN_SHARDS", &shards)],
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    all_allocations_kept(&server, "udp", turn, 1, Vec::new());
    // The old run refuses the new password, so these clients can only allocate on the new run.
    let restarted = allocate_as_it_opens(turn_addr, "n3w", CLIENTS);
    std::fs::write(
        &config,
        before
            .replace("auth: {", "auth: {realm: other.example, ")
            .replace("password: s3cret", "password: n3w"),
    )
    .unwrap();
    all_allocations_kept(&server, "udp", turn, 2, restarted);
    assert!(server.logs().contains("restarted objects: 1"));
    let _ = std::fs::remove_file(config);
}

/// `-w` on a file that does not exist yet waits for it; an invalid or empty update is
/// reported with the field and value and the running config stays.
#[test]
fn file_watch_waits_for_the_file_and_keeps_the_config_on_bad_updates() {
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("later.yaml");
    let server = Stunnerd::start(&["-w", "-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || server.logs().contains("Waiting for config file")),
        "{}",
        server.logs()
    );
    std::fs::write(&config, static_config(turn, health, "s3cret", false)).unwrap();
    assert!(wait_until(10, || status(health)
        .is_some_and(|s| s["status"] == "READY")));
    std::fs::write(
        &config,
        static_config(turn, health, "s3cret", false).replace(
            "address: 127.0.0.1",
            "address: 127.0.0.1, protocol: TURN-SCTP",
        ),
    )
    .unwrap();
    assert!(
        wait_until(10, || server.logs().contains("TURN-SCTP")),
        "the invalid value is not named: {}",
        server.logs()
    );
    let logs = server.logs();
    assert!(
        logs.contains("listeners[0].protocol"),
        "the invalid field is not named: {logs}"
    );
    std::fs::write(&config, "").unwrap();
    std::thread::sleep(Duration::from_millis(600));
    let running = status(health).unwrap();
    assert_eq!(running["status"], "READY");
    assert_eq!(running["listeners"][0]["protocol"], "TURN-UDP");
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    assert!(d.allocate().is_some(), "the running config stopped serving");
    let _ = std::fs::remove_file(config);
}

fn http_at(ip: &str, port: u16, path: &str) -> Option<u16> {
    let addr = SocketAddr::new(ip.parse().unwrap(), port);
    uturn_testkit::stunnerd::http_get_from(addr, path).map(|(code, _)| code)
}

/// `http://:PORT` (the default form) listens dual-stack, as stunnerd's Go listener does: kubelet
/// probes an IPv6-only pod on its IPv6 address.
#[test]
fn admin_servers_on_an_empty_host_answer_on_ipv4_and_ipv6() {
    let (turn, health, metrics) = (free_port(), free_port(), free_port());
    let config = temp_file("dual-stack.yaml");
    std::fs::write(
        &config,
        format!(
            "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://:{health}\", metrics_endpoint: \"http://:{metrics}/metrics\"}}\n\
             auth: {{type: static, credentials: {{username: alice, password: s3cret}}}}\n\
             listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
             clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
        ),
    )
    .unwrap();
    let server = Stunnerd::start(&["-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || http_at("127.0.0.1", health, "/ready") == Some(200)),
        "{}",
        server.logs()
    );
    for ip in ["127.0.0.1", "::1"] {
        assert_eq!(http_at(ip, health, "/live"), Some(200), "/live on {ip}");
        assert_eq!(http_at(ip, health, "/ready"), Some(200), "/ready on {ip}");
        assert_eq!(
            http_at(ip, metrics, "/metrics"),
            Some(200),
            "/metrics on {ip}"
        );
    }
    assert!(
        server.logs().contains(&format!(
            "health-check server listening on http://[::]:{health}/"
        )),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(config);
}

/// A config that names a taken admin port is rejected: the running config and its servers
/// stay. A later good config applies; at start a taken port exits 1 naming the field.
#[test]
fn an_admin_endpoint_that_cannot_listen_rejects_the_config() {
    let (turn, health, metrics) = (free_port(), free_port(), free_port());
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken_port = taken.local_addr().unwrap().port();
    let write = |path: &std::path::Path, health: u16, metrics_path: &str, realm: &str| {
        std::fs::write(
            path,
            format!(
                "version: v1\nadmin: {{name: media/gw, healthcheck_endpoint: \"http://127.0.0.1:{health}\", metrics_endpoint: \"http://127.0.0.1:{metrics}{metrics_path}\"}}\n\
                 auth: {{type: static, realm: {realm}, credentials: {{username: alice, password: s3cret}}}}\n\
                 listeners: [{{name: udp, address: 127.0.0.1, port: {turn}, routes: [media]}}]\n\
                 clusters: [{{name: media, endpoints: [127.0.0.1]}}]\n"
            ),
        )
        .unwrap();
    };
    let config = temp_file("admin-bind.yaml");
    write(&config, health, "/metrics", "one");
    let server = Stunnerd::start(&["-w", "-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || realm_is(health, "one")),
        "{}",
        server.logs()
    );

    write(&config, taken_port, "/metrics", "two");
    assert!(
        wait_until(10, || server.logs().contains("config rejected")),
        "{}",
        server.logs()
    );
    let logs = server.logs();
    assert!(
        logs.contains("admin.healthcheck_endpoint")
            && logs.contains(&format!("127.0.0.1:{taken_port}"))
            && logs.contains("free address"),
        "the rejection must name the field, the value and the fix: {logs}"
    );
    std::thread::sleep(Duration::from_millis(300));
    assert!(realm_is(health, "one"), "the rejected config was applied");
    assert_eq!(http_at("127.0.0.1", metrics, "/metrics"), Some(200));

    // A new path on the same port (the running server holds it) applies.
    write(&config, health, "/other", "three");
    assert!(
        wait_until(10, || realm_is(health, "three")),
        "{}",
        server.logs()
    );
    assert!(wait_until(5, || http_at("127.0.0.1", metrics, "/other") == Some(200)));
    assert_eq!(http_at("127.0.0.1", metrics, "/metrics"), Some(404));
    // Moving the health server to a free port applies, and the old port closes.
    let moved = free_port();
    write(&config, moved, "/other", "four");
    assert!(
        wait_until(10, || realm_is(moved, "four")),
        "{}",
        server.logs()
    );
    assert!(wait_until(5, || http_at("127.0.0.1", health, "/live").is_none()));

    // At start, a taken admin port is fatal.
    let start = temp_file("admin-bind-start.yaml");
    write(&start, taken_port, "/metrics", "one");
    let (turn2, metrics2) = (free_port(), free_port());
    let text = std::fs::read_to_string(&start)
        .unwrap()
        .replace(&format!("port: {turn}"), &format!("port: {turn2}"))
        .replace(&format!(":{metrics}/"), &format!(":{metrics2}/"));
    std::fs::write(&start, text).unwrap();
    let mut refused = Stunnerd::start(&["-c", &format!("file://{}", start.display())], &[]);
    assert_eq!(refused.wait_exit(), Some(1), "{}", refused.logs());
    assert!(
        refused.logs().contains("admin.healthcheck_endpoint")
            && refused.logs().contains(&taken_port.to_string()),
        "{}",
        refused.logs()
    );
    drop(taken);
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(start);
}

fn ready(health: u16) -> Option<u16> {
    uturn_testkit::stunnerd::http_get(health, "/ready").map(|(code, _)| code)
}

/// A new pod must not report ready before it knows the endpoints of its Services, or it
/// answers 403 to every peer while taking traffic; with the API server down it becomes ready
/// after --discovery-timeout and says why.
#[test]
fn ready_waits_for_the_first_endpoint_list_up_to_the_discovery_timeout() {
    let api = FakeApiServer::start();
    api.apply(
        Resource::Service,
        service("media", "ready-svc", &["10.96.0.30"]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "media",
            "ready-svc-a",
            "ready-svc",
            &[("127.0.0.5", true, true, false)],
        ),
    );
    api.set_up(false);
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let start = |timeout: &str| {
        let (turn, health) = (free_port(), free_port());
        let config = temp_file("ready.yaml");
        std::fs::write(&config, kubernetes_config(turn, health, "media/ready-svc")).unwrap();
        let server = Stunnerd::start(
            &[
                "-c",
                &format!("file://{}", config.display()),
                "--kubeconfig",
                kubeconfig.to_str().unwrap(),
                "--discovery-timeout",
                timeout,
            ],
            &[],
        );
        (server, health, config)
    };

    // The API server stays down: 503 until the timeout, then 200 and a warning naming the Service.
    let started = std::time::Instant::now();
    let (server, health, config) = start("4");
    assert!(
        wait_until(10, || ready(health).is_some()),
        "{}",
        server.logs()
    );
    assert_eq!(
        ready(health),
        Some(503),
        "ready before the Service was listed"
    );
    let entry = discovered(health, "media/ready-svc");
    assert!(
        entry
            .as_ref()
            .is_some_and(|e| e["synced"] == false && e["syncTimedOut"] == false),
        "{entry:?}"
    );
    assert!(
        status(health).is_some_and(|s| s["discovery"]["readyWaitsFor"][0] == "media/ready-svc"),
        "{:?}",
        status(health)
    );
    std::thread::sleep(Duration::from_secs(2).saturating_sub(started.elapsed()));
    assert_eq!(ready(health), Some(503));
    assert!(
        wait_until(10, || ready(health) == Some(200)),
        "{}",
        server.logs()
    );
    assert!(
        started.elapsed() >= Duration::from_secs(4),
        "ready before the timeout"
    );
    let logs = server.logs();
    assert!(
        logs.contains("Service media/ready-svc not synced within --discovery-timeout"),
        "{logs}"
    );
    assert!(discovered(health, "media/ready-svc").is_some_and(|e| e["syncTimedOut"] == true));
    drop(server);
    let _ = std::fs::remove_file(config);

    // The API server comes back before the timeout: ready exactly once the list is in.
    let (server, health, config) = start("60");
    assert!(
        wait_until(10, || ready(health).is_some()),
        "{}",
        server.logs()
    );
    std::thread::sleep(Duration::from_secs(2));
    assert_eq!(ready(health), Some(503));
    api.set_up(true);
    assert!(
        wait_until(30, || ready(health) == Some(200)),
        "{}",
        server.logs()
    );
    let entry = discovered(health, "media/ready-svc");
    assert!(
        listed(&entry, "addresses", "127.0.0.5"),
        "ready without the endpoints: {entry:?}"
    );
    assert!(
        !server.logs().contains("not synced within"),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(kubeconfig);
}

fn cds_kubernetes_config(turn: u16, health: u16, with_service: bool) -> String {
    let (routes, clusters) = if with_service {
        (
            r#"["media/static","media/svc"]"#,
            r#"[{"name":"media/static","type":"STATIC","endpoints":["127.0.0.9"]},{"name":"media/svc","type":"KUBERNETES","endpoints":["media/batch-svc"]}]"#,
        )
    } else {
        (
            r#"["media/static"]"#,
            r#"[{"name":"media/static","type":"STATIC","endpoints":["127.0.0.9"]}]"#,
        )
    };
    format!(
        r#"{{"version":"v1","admin":{{"name":"media/gw","healthcheck_endpoint":"http://127.0.0.1:{health}"}},"auth":{{"type":"static","credentials":{{"username":"alice","password":"s3cret"}}}},"listeners":[{{"name":"media/gw/udp","protocol":"TURN-UDP","address":"127.0.0.1","port":{turn},"routes":{routes}}}],"clusters":{clusters}}}"#
    )
}

/// A Service whose cluster is removed and added again in one config batch keeps its
/// endpoints: its watch restarts (a kept watch only sends changes, never the list again).
#[test]
fn a_service_removed_and_readded_in_one_batch_keeps_its_endpoints() {
    let api = FakeApiServer::start();
    api.apply(
        Resource::Service,
        service("media", "batch-svc", &["10.96.0.40"]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "media",
            "batch-svc-a",
            "batch-svc",
            &[("127.0.0.6", true, true, false)],
        ),
    );
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let cds = cds::FakeCds::start("127.0.0.1:0");
    let (turn, health) = (free_port(), free_port());
    cds.push("media/gw", &cds_kubernetes_config(turn, health, true));
    let server = Stunnerd::start(
        &[
            "-w",
            "-c",
            &format!("http://{}", cds.addr()),
            "--id",
            "media/gw",
            "--kubeconfig",
            kubeconfig.to_str().unwrap(),
        ],
        &[],
    );
    let known = || {
        listed(
            &discovered(health, "media/batch-svc"),
            "addresses",
            "127.0.0.6",
        )
    };
    assert!(
        wait_until(20, known),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    let first_watch = api.requests().len();

    cds.push_many(
        "media/gw",
        &[
            &cds_kubernetes_config(turn, health, false),
            &cds_kubernetes_config(turn, health, true),
        ],
    );
    // Both configs applied (two reconciliations), then the endpoints are back.
    assert!(
        wait_until(10, || server.logs().matches("Reconciliation ready").count()
            >= 3),
        "{}",
        server.logs()
    );
    assert!(
        wait_until(10, known),
        "the Service lost its endpoints: {:?}\n{}",
        discovered(health, "media/batch-svc"),
        server.logs()
    );
    assert!(
        api.requests().len() > first_watch,
        "the watch was not restarted"
    );
    let turn_addr: SocketAddr = format!("127.0.0.1:{turn}").parse().unwrap();
    let mut d = TurnClient::new(turn_addr, "alice", "s3cret");
    d.allocate().expect("allocation");
    assert!(
        d.permit("127.0.0.6".parse::<IpAddr>().unwrap()),
        "{:?}",
        d.responses
    );
    let _ = std::fs::remove_file(kubeconfig);
}

/// In watch mode the bootstrap config's health server (`:8086`, stunnerd's zero config) is only
/// a placeholder: a port another process holds is logged, and the watched config still applies
/// and serves its own health endpoint. (Tests that start `-w` in parallel all want `:8086`.)
#[test]
fn watch_mode_boots_when_the_bootstrap_health_port_is_taken() {
    // Hold :8086 ourselves; another test's stunnerd may hold it for a moment first.
    let mut holder = None;
    assert!(wait_until(20, || {
        holder = std::net::TcpListener::bind("[::]:8086").ok();
        holder.is_some()
    }));
    let (server, config, turn, _) = watching_static_config("bootstrap-port.yaml");
    assert!(server
        .logs()
        .contains("bootstrap config: admin.healthcheck_endpoint \"http://:8086\""));
    let mut d = TurnClient::new(
        format!("127.0.0.1:{turn}").parse().unwrap(),
        "alice",
        "s3cret",
    );
    d.allocate().expect("allocation");
    drop(holder);
    let _ = std::fs::remove_file(config);
}

/// Second-chance forwarding's siblings, with `--siblings k8s:<ns>/<service>`, follow the
/// EndpointSlices of the gateway's own Service through the real kube-rs client: ready and
/// terminating pods are siblings (a draining pod still owns its calls), a removed one goes,
/// and `/status` lists them.
#[test]
fn siblings_follow_the_gateway_services_endpoint_slices() {
    let api = FakeApiServer::start();
    api.apply(
        Resource::Service,
        service("stunner", "udp-gateway", &["10.96.0.30"]),
    );
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "stunner",
            "udp-gateway-abc",
            "udp-gateway",
            &[
                ("10.244.1.5", true, true, false),
                ("10.244.2.7", false, true, true),
            ],
        ),
    );
    let (turn, health) = (free_port(), free_port());
    let config = temp_file("siblings.yaml");
    std::fs::write(&config, static_config(turn, health, "s3cret", false)).unwrap();
    let kubeconfig = api.kubeconfig(&std::env::temp_dir());
    let sibling_port = free_port();
    let server = Stunnerd::start(
        &[
            "-c",
            &format!("file://{}", config.display()),
            "--siblings",
            "k8s:stunner/udp-gateway",
            "--sibling-port",
            &sibling_port.to_string(),
        ],
        &[
            ("KUBECONFIG", kubeconfig.to_str().unwrap()),
            ("UTURN_SIBLING_KEY", "a key of at least sixteen bytes"),
        ],
    );
    let siblings = || -> Vec<String> {
        status(health)
            .and_then(|s| s["siblings"].as_array().cloned())
            .unwrap_or_default()
            .iter()
            .filter_map(|s| s["address"].as_str().map(str::to_owned))
            .collect()
    };
    assert!(
        wait_until(20, || siblings() == ["10.244.1.5", "10.244.2.7"]),
        "{:?}\n{}",
        status(health),
        server.logs()
    );
    // The terminating pod is deleted.
    api.apply(
        Resource::EndpointSlice,
        endpoint_slice(
            "stunner",
            "udp-gateway-abc",
            "udp-gateway",
            &[("10.244.1.5", true, true, false)],
        ),
    );
    assert!(
        wait_until(10, || siblings() == ["10.244.1.5"]),
        "{:?}",
        status(health)
    );
    api.delete(Resource::EndpointSlice, "stunner", "udp-gateway-abc");
    assert!(
        wait_until(10, || siblings().is_empty()),
        "{:?}",
        status(health)
    );
    let _ = std::fs::remove_file(config);
    let _ = std::fs::remove_file(kubeconfig);
}

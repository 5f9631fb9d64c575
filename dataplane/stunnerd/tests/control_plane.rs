//! The control plane end to end: the real `stunnerd` binary following a config file (watched
//! and reloaded), a config discovery server speaking STUNner's protocol (the CDS fake), STRICT_DNS
//! clusters, and listeners and admin servers opened and closed live, with `turn-client-proto`
//! relaying through it.
//!
//! Kubernetes discovery (KUBERNETES clusters, siblings, readiness, relists, refusals) runs
//! against a real kube-apiserver in control_plane_k8s.rs. None of this suite's scenarios needs
//! the API-server fake any more: no fault it tests is one a real API server cannot be made to
//! produce (outages, 410 Gone after compaction, RBAC refusals are all real there).

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use turn_client_proto::api::TurnEvent;
use uturn_testkit::cds;
use uturn_testkit::stunnerd::{free_port, status, temp_file, wait_until, Stunnerd};
use uturn_testkit::turn_client::TurnClient;

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

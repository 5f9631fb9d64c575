//! The peer policy end to end, against the real stunnerd binary and independent clients on
//! real sockets: the gateway's own addresses (every interface address of the host, both
//! families) are refused as peers unless a cluster lists them exactly.

mod support;

use std::net::{IpAddr, SocketAddr};
use support::{binding_request, free_port, wait_until, Stunnerd, TurnLink};
use uturn_perf::turncat::transport::Protocol;

/// A config with TURN-UDP listeners on `port` (advertised 127.0.0.1, as the README's quick
/// start) and `port + 1` (advertised ::1: IPv6 relays), health and metrics on the wildcard,
/// routed to one cluster of `endpoints`.
fn config(port: u16, health: u16, metrics: u16, endpoints: &str) -> String {
    let port6 = port + 1;
    format!(
        "version: v1\n\
         admin: {{healthcheck_endpoint: \"http://:{health}\", metrics_endpoint: \"http://:{metrics}/metrics\"}}\n\
         auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\n\
         listeners: [{{name: udp, protocol: TURN-UDP, address: 127.0.0.1, port: {port}, routes: [any]}}, \
         {{name: udp6, protocol: TURN-UDP, address: \"::1\", port: {port6}, routes: [any]}}]\n\
         clusters: [{{name: any, endpoints: [{endpoints}]}}]\n"
    )
}

/// Writes `text` to `path` through a rename, so a watcher never reads half of it.
fn write_config(path: &std::path::Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// Every address on this host's interfaces (`getifaddrs`), loopback included.
fn own_addresses() -> Vec<IpAddr> {
    let ips = uturn_shared::policy::host_ips();
    assert!(
        ips.iter().any(|ip| !ip.is_loopback()),
        "this test needs a non-loopback interface address (ip -o addr): {ips:?}"
    );
    ips
}

/// Link-local addresses need a scope id to be sent to; the relay has none.
fn sendable(ip: &IpAddr) -> bool {
    !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

#[test]
fn own_addresses_are_refused_on_every_port_unless_listed_exactly() {
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let path = support::temp_file("own.yaml");
    let any = "\"0.0.0.0/0\", \"::/0\"";
    write_config(&path, &config(port, health, metrics, any));
    let origin = format!("file://{}", path.display());
    let server_proc = Stunnerd::start(&["-w", "-c", &origin], &[]);
    let server: SocketAddr = ([127, 0, 0, 1], port).into();
    let server6: SocketAddr = ([127, 0, 0, 1], port + 1).into();
    assert!(
        wait_until(10, || support::http_get(health, "/ready")
            .is_some_and(|(c, _)| c == 200)),
        "not ready: {}",
        server_proc.logs()
    );
    let own = own_addresses();
    // For each family: client A probes, client B's relay port is a target.
    let mut clients = Vec::new();
    for ipv6 in [false, true] {
        let at = if ipv6 { server6 } else { server };
        let mut a = TurnLink::connect(Protocol::Udp, at).unwrap();
        let mut b = TurnLink::connect(Protocol::Udp, at).unwrap();
        a.allocate(ipv6, false)
            .unwrap_or_else(|e| panic!("allocate A: {e}: {}", server_proc.logs()));
        let b_relay = b.allocate(ipv6, false).expect("allocate B");
        clients.push((a, b, b_relay.port()));
    }
    let probe = binding_request();
    for ip in &own {
        let (a, _, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        for target_port in [port, port + 1, *b_port, health, metrics] {
            let target = SocketAddr::new(*ip, target_port);
            assert_eq!(
                a.create_permission(target),
                Err(403),
                "CreatePermission {target}"
            );
            assert_eq!(
                a.bind_channel(0x4000, target),
                Err(403),
                "ChannelBind {target}"
            );
            if sendable(ip) {
                a.send_indication(target, &probe);
            }
        }
    }
    for (a, b, _) in &mut clients {
        a.drain(0.5);
        b.drain(0.2);
        assert!(a.data.is_empty(), "relayed back to A: {:?}", a.data);
        assert!(b.data.is_empty(), "reached B's relay: {:?}", b.data);
    }

    // Listed exactly, an own address is a peer: the listener answers a Binding request through
    // the relay, and B's relay port receives what A sends it. This also shows that the probes
    // above would have been seen.
    let listed: Vec<IpAddr> = own
        .iter()
        .copied()
        .filter(|ip| !ip.is_loopback() && sendable(ip))
        .collect();
    let exact: Vec<String> = listed.iter().map(|ip| format!("\"{ip}\"")).collect();
    write_config(
        &path,
        &config(
            port,
            health,
            metrics,
            &format!("{any}, {}", exact.join(", ")),
        ),
    );
    let first = SocketAddr::new(listed[0], port);
    assert!(
        wait_until(10, || clients[usize::from(first.is_ipv6())]
            .0
            .create_permission(first)
            .is_ok()),
        "the exact listing did not apply: {}",
        server_proc.logs()
    );
    for ip in &listed {
        let (a, b, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        let listener = SocketAddr::new(*ip, port);
        a.create_permission(listener)
            .expect("listed listener address");
        a.data.clear();
        a.send_indication(listener, &probe);
        a.drain(0.5);
        assert!(
            a.data.iter().any(|(from, _)| *from == Some(listener)),
            "no answer from the listener at {listener}: {:?}",
            a.data
        );
        // B lets A's relay in (A's relay sends from `ip` to `ip`).
        b.create_permission(SocketAddr::new(*ip, 0))
            .expect("B permits");
        let b_target = SocketAddr::new(*ip, *b_port);
        a.create_permission(b_target).expect("A permits");
        b.data.clear();
        a.send_indication(b_target, b"to B's relay");
        b.drain(0.5);
        assert!(
            b.data.iter().any(|(_, p)| p == b"to B's relay"),
            "B's relay at {b_target} got nothing: {:?}",
            b.data
        );
    }

    // Back to the catch-all: the reloaded snapshot refuses the host's addresses again, for the
    // permissions granted meanwhile too.
    write_config(&path, &config(port, health, metrics, any));
    let (a, _, _) = &mut clients[usize::from(first.is_ipv6())];
    assert!(
        wait_until(10, || a.create_permission(first) == Err(403)),
        "the reload did not refuse {first}: {}",
        server_proc.logs()
    );
    for ip in &listed {
        let (a, b, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        a.data.clear();
        b.data.clear();
        a.send_indication(SocketAddr::new(*ip, port), &probe);
        a.send_indication(SocketAddr::new(*ip, *b_port), b"to B's relay");
        a.drain(0.5);
        b.drain(0.2);
        assert!(
            a.data.is_empty(),
            "after reload, relayed back: {:?}",
            a.data
        );
        assert!(b.data.is_empty(), "after reload, reached B: {:?}", b.data);
    }
    let _ = std::fs::remove_file(&path);
}

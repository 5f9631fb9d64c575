//! The peer policy's rules for the host's own addresses and for 6to4 and Teredo peers, through
//! the snapshot every check goes through (CreatePermission, ChannelBind, Send, each datagram).

use std::net::{IpAddr, SocketAddr};
use uturn_shared::config::parse_config;
use uturn_shared::policy::host_ips;
use uturn_shared::snapshot::{Host, Snapshot};

/// A snapshot with one listener (advertised `0.0.0.0`, as in the README's quick start) routed
/// to one cluster of `endpoints`, on a host whose interfaces carry `host`.
fn snapshot(endpoints: &str, host: Option<&[IpAddr]>) -> Snapshot {
    let text = format!(
        "version: v1\nauth: {{type: static, credentials: {{username: u, password: p}}}}\n\
         listeners: [{{name: l, address: 0.0.0.0, port: 3478, routes: [c]}}]\n\
         clusters: [{{name: c, endpoints: [{endpoints}]}}]\n"
    );
    let config = parse_config(&text).unwrap_or_else(|e| panic!("{e}"));
    match host {
        Some(ips) => Snapshot::from_config_on_host(
            &config,
            1,
            &|_| Vec::new(),
            &Host {
                ips: ips.to_vec(),
                ..Host::default()
            },
        ),
        None => Snapshot::from_config(&config, 1, &|_| Vec::new()),
    }
}

fn verdict(snap: &Snapshot, peer: &str) -> (bool, bool) {
    let route = snap.route("l").unwrap();
    let ip: IpAddr = peer.parse().unwrap();
    (
        snap.permits_ip(route, ip),
        snap.admits(route, SocketAddr::new(ip, 5000)).is_some(),
    )
}

#[test]
fn host_interface_addresses_need_an_exact_endpoint() {
    let host: Vec<IpAddr> = ["127.0.0.1", "::1", "10.1.2.3", "fd00::2", "fe80::1"]
        .iter()
        .map(|s| s.parse().unwrap())
        .collect();
    // (cluster endpoints, peer, admitted)
    let cases: &[(&str, &str, bool)] = &[
        ("0.0.0.0/0", "10.1.2.3", false),
        ("0.0.0.0/0", "::ffff:10.1.2.3", false),
        ("0.0.0.0/0", "::10.1.2.3", false),
        ("0.0.0.0/0", "64:ff9b::a01:203", false),
        ("0.0.0.0/0", "10.1.2.4", true),
        ("10.0.0.0/8", "10.1.2.3", false),
        ("10.1.2.3/31", "10.1.2.3", false),
        ("10.1.2.3", "10.1.2.3", true),
        ("10.1.2.3/32", "::ffff:10.1.2.3", true),
        ("\"::/0\"", "fd00::2", false),
        ("\"fd00::/64\"", "fd00::2", false),
        ("\"fd00::/64\"", "fd00::3", true),
        ("\"fd00::2/128\"", "fd00::2", true),
        ("\"fe80::/10\"", "fe80::1", false),
        ("\"fe80::1\"", "fe80::1", true),
        // Loopback is guarded by its scope: naming it is the explicit choice.
        ("0.0.0.0/0", "127.0.0.1", false),
        ("127.0.0.0/8", "127.0.0.1", true),
        ("\"::/0\"", "::1", false),
        ("\"::1\"", "::1", true),
    ];
    for &(endpoints, peer, want) in cases {
        let snap = snapshot(endpoints, Some(&host));
        assert_eq!(verdict(&snap, peer), (want, want), "{endpoints} -> {peer}");
    }
    // On a host without those addresses the same clusters admit them: the host's list is what
    // refuses them.
    for (endpoints, peer) in [("0.0.0.0/0", "10.1.2.3"), ("\"fd00::/64\"", "fd00::2")] {
        let bare = snapshot(endpoints, Some(&[]));
        assert_eq!(verdict(&bare, peer), (true, true), "{endpoints} -> {peer}");
    }
}

#[test]
fn every_snapshot_refuses_the_addresses_this_host_has() {
    let own: Vec<IpAddr> = host_ips()
        .into_iter()
        .filter(|ip| !ip.is_loopback())
        .collect();
    assert!(
        !own.is_empty(),
        "this test needs a non-loopback interface address (ip -o addr)"
    );
    let snap = snapshot("0.0.0.0/0, \"::/0\"", None);
    for ip in &own {
        assert_eq!(verdict(&snap, &ip.to_string()), (false, false), "{ip}");
        let exact = format!("\"{ip}\"");
        let listed = snapshot(&exact, None);
        assert_eq!(verdict(&listed, &ip.to_string()), (true, true), "{ip}");
    }
}

/// A 6to4 or Teredo peer is an IPv6 destination reached through an IPv4 address: an IPv6
/// endpoint must admit the address and the IPv4 address must be permitted as well.
#[test]
fn six_to_four_and_teredo_peers_are_judged_as_ipv6_and_by_their_ipv4() {
    // 2002:a00:1::5 travels through 10.0.0.1; 2002:7f00:1::5 through 127.0.0.1; the Teredo
    // address through 127.0.0.1 (its last 32 bits inverted), the other through 10.0.0.1.
    let teredo_loop = "2001:0:4136:e378:8000:63bf:80ff:fffe";
    let teredo_ten = "2001:0:4136:e378:8000:63bf:f5ff:fffe";
    let cases: &[(&str, &str, bool)] = &[
        // The IPv4 address alone no longer admits an IPv6 destination.
        ("0.0.0.0/0", "2002:a00:1::5", false),
        ("10.0.0.0/8", "2002:a00:1::5", false),
        ("0.0.0.0/0", teredo_ten, false),
        // The IPv6 address alone does not either: it travels through 10.0.0.1.
        ("\"::/0\"", "2002:a00:1::5", false),
        ("\"2002::/16\"", "2002:a00:1::5", false),
        ("\"::/0\"", teredo_ten, false),
        // Both.
        ("10.0.0.0/8, \"::/0\"", "2002:a00:1::5", true),
        ("10.0.0.1, \"2002:a00:1::/48\"", "2002:a00:1::5", true),
        ("0.0.0.0/0, \"::/0\"", teredo_ten, true),
        // Never through loopback, whatever the IPv6 ranges.
        ("0.0.0.0/0, \"::/0\"", "2002:7f00:1::5", false),
        ("0.0.0.0/0, \"::/0\"", teredo_loop, false),
        // Unless loopback is named too.
        ("127.0.0.1, \"::/0\"", "2002:7f00:1::5", true),
        // Ordinary IPv6 and the reduced forms are unchanged.
        ("\"::/0\"", "2001:db8::1", true),
        ("10.0.0.0/8", "::ffff:10.0.0.1", true),
        ("10.0.0.0/8", "64:ff9b::a00:1", true),
    ];
    for &(endpoints, peer, want) in cases {
        let snap = snapshot(endpoints, Some(&[]));
        assert_eq!(verdict(&snap, peer), (want, want), "{endpoints} -> {peer}");
    }
}

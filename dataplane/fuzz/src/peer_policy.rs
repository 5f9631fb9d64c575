//! `peer_policy`: arbitrary IPv4/IPv6 peers through `uturn_shared::policy` and a snapshot with
//! three clusters (`world`: 0.0.0.0/0 and ::/0, `private`: 10.0.0.0/8, `loop`: exactly
//! 127.0.0.1) routed from three listeners.
//!
//! Input: `[sel][v4: 4][v6: 16][network: 16][prefix len][port: 2][extra: 8]`, zero-padded.
//!
//! Checks: `canonical_peer` is idempotent and leaves IPv4 alone; `scope` agrees with the
//! standard library's predicates on the canonical address; `in_prefix` agrees with plain mask
//! arithmetic; every IPv6 form `canonical_peer` reduces (mapped, compatible, NAT64 64:ff9b::/96)
//! gets exactly the verdict of the IPv4 address it embeds, from `scope`, `endpoint_admits` and
//! the snapshot; a tunnel form (6to4 2002::/16, Teredo 2001::/32) is not reduced, yields its
//! IPv4 through `tunnel_ipv4`, and is admitted only where that IPv4 is permitted too; special-scope peers (unspecified,
//! loopback, link-local, multicast, broadcast) and the gateway's own addresses are never
//! admitted through 0.0.0.0/0 or ::/0, only through an endpoint that lists them; and each
//! route's verdict equals the one its cluster list implies.

use crate::input::Input;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::OnceLock;
use uturn_shared::config::parse_config;
use uturn_shared::policy::{canonical_peer, endpoint_admits, in_prefix, scope, tunnel_ipv4, Scope};
use uturn_shared::snapshot::{ClusterId, Snapshot};

/// The fixed config of the snapshot.
pub const CONFIG: &str = r#"
version: v1
auth:
  type: static
  credentials: {username: u, password: p}
listeners:
  - name: all
    address: 203.0.113.5
    routes: [world, private, loop]
  - name: world
    address: "2001:db8::5"
    port: 3479
    routes: [world]
  - name: private
    port: 3480
    routes: [private]
clusters:
  - name: world
    endpoints: ["0.0.0.0/0", "::/0"]
  - name: private
    endpoints: ["10.0.0.0/8"]
  - name: loop
    endpoints: ["127.0.0.1"]
"#;

const OWN: [&str; 2] = ["203.0.113.5", "2001:db8::5"];

struct Fixture {
    snap: Snapshot,
    world: ClusterId,
    private: ClusterId,
    looped: ClusterId,
    own: [IpAddr; 2],
}

fn fixture() -> &'static Fixture {
    static F: OnceLock<Fixture> = OnceLock::new();
    F.get_or_init(|| {
        let cfg = parse_config(CONFIG).expect("peer_policy config");
        let snap = Snapshot::from_config_on_host(&cfg, 1, &|_| Vec::new(), &Default::default());
        let id = |name: &str| snap.clusters.iter().position(|c| c.name == name).unwrap();
        Fixture {
            world: id("world"),
            private: id("private"),
            looped: id("loop"),
            own: OWN.map(|s| s.parse().unwrap()),
            snap,
        }
    })
}

/// Networks every peer is checked against (plus one from the input).
fn fixed_networks() -> &'static [(IpAddr, u8)] {
    static N: OnceLock<Vec<(IpAddr, u8)>> = OnceLock::new();
    N.get_or_init(|| {
        [
            ("0.0.0.0", 0),
            ("::", 0),
            ("10.0.0.0", 8),
            ("127.0.0.1", 32),
            ("127.0.0.0", 8),
            ("169.254.0.0", 16),
            ("224.0.0.0", 4),
            ("255.255.255.255", 32),
            ("0.0.0.0", 8),
            ("::1", 128),
            ("fe80::", 10),
            ("ff00::", 8),
            ("2001:db8::", 32),
        ]
        .iter()
        .map(|&(a, l)| (a.parse().unwrap(), l))
        .collect()
    })
}

/// The scope the standard library's predicates give canonical `ip`.
fn std_scope(ip: IpAddr) -> Scope {
    match ip {
        IpAddr::V4(a) if a.octets()[0] == 0 => Scope::Unspecified,
        IpAddr::V4(a) if a.is_loopback() => Scope::Loopback,
        IpAddr::V4(a) if a.is_link_local() => Scope::LinkLocal,
        IpAddr::V4(a) if a.is_multicast() => Scope::Multicast,
        IpAddr::V4(a) if a.is_broadcast() => Scope::Broadcast,
        IpAddr::V6(a) if a.is_unspecified() => Scope::Unspecified,
        IpAddr::V6(a) if a.is_loopback() => Scope::Loopback,
        IpAddr::V6(a) if a.is_unicast_link_local() => Scope::LinkLocal,
        IpAddr::V6(a) if a.is_multicast() => Scope::Multicast,
        _ => Scope::Global,
    }
}

fn mask_in(network: IpAddr, len: u8, ip: IpAddr) -> bool {
    match (network, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let len = u32::from(len.min(32));
            let shift = 32 - len;
            len == 0 || (u32::from(n) >> shift) == (u32::from(a) >> shift)
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let len = u32::from(len.min(128));
            let shift = 128 - len;
            len == 0 || (u128::from(n) >> shift) == (u128::from(a) >> shift)
        }
        _ => false,
    }
}

/// What a route of the fixture must say for `peer`, from its cluster list alone.
fn expected(f: &Fixture, route: &str, peer: SocketAddr) -> Option<ClusterId> {
    let ip = canonical_peer(peer.ip());
    // No port range in the config: ports 1-65535.
    if peer.port() == 0 {
        return None;
    }
    // A tunnel form (6to4, Teredo) is judged as the IPv6 host and by the IPv4 it travels
    // through: that IPv4 must be permitted by the route too.
    if let Some(v4) = tunnel_ipv4(ip) {
        let through = SocketAddr::new(IpAddr::V4(v4), peer.port());
        if expected(f, route, through).is_none() {
            return None;
        }
    }
    let own = f.own.iter().any(|&o| canonical_peer(o) == ip);
    let global = scope(ip) == Scope::Global;
    let loopback_listed = ip == IpAddr::V4(Ipv4Addr::LOCALHOST);
    let private = mask_in("10.0.0.0".parse().unwrap(), 8, ip);
    // Routes are sorted by name: loop, private, world.
    let order: &[(&str, ClusterId, bool)] = &[
        ("loop", f.looped, loopback_listed),
        ("private", f.private, private),
        ("world", f.world, global && !own),
    ];
    let routed: &[&str] = match route {
        "all" => &["loop", "private", "world"],
        "world" => &["world"],
        _ => &["private"],
    };
    order
        .iter()
        .find(|(name, _, ok)| routed.contains(name) && *ok)
        .map(|&(_, id, _)| id)
}

fn check_peer(f: &Fixture, ip: IpAddr, port: u16, networks: &[(IpAddr, u8)]) {
    let c = canonical_peer(ip);
    assert_eq!(
        canonical_peer(c),
        c,
        "canonical_peer not idempotent on {ip}"
    );
    if ip.is_ipv4() {
        assert_eq!(c, ip, "canonical_peer changed IPv4 {ip}");
    }
    let s = scope(ip);
    assert_eq!(s, scope(c), "scope({ip}) != scope({c})");
    assert_eq!(s, std_scope(c), "scope({ip}) disagrees with std on {c}");
    for &(net, len) in networks {
        let admitted = endpoint_admits(net, len, ip);
        assert_eq!(
            in_prefix(net, len, c),
            mask_in(net, len, c),
            "in_prefix({net}/{len}, {c})"
        );
        if admitted {
            assert!(in_prefix(net, len, c), "{net}/{len} admits {ip} outside it");
        }
        if len == 0 && s != Scope::Global {
            assert!(!admitted, "{net}/0 admits {ip} of scope {s:?}");
        }
    }
    let peer = SocketAddr::new(ip, port);
    for route_name in ["all", "world", "private"] {
        let route = f.snap.route(route_name).expect("route");
        let got = f.snap.admits(route, peer);
        assert_eq!(
            got,
            expected(f, route_name, peer),
            "route {route_name}, peer {peer}"
        );
        if got.is_some() {
            assert!(
                f.snap.permits_ip(route, ip),
                "{peer} admitted, not permitted"
            );
        }
        if route_name == "world" {
            let special_or_own = s != Scope::Global || f.own.contains(&c);
            if special_or_own {
                assert!(!f.snap.permits_ip(route, ip), "world permits {ip} ({s:?})");
            }
        }
    }
}

/// The IPv6 forms `canonical_peer` reduces to `a`, built with `extra` in the free bits.
pub fn embeddings(a: Ipv4Addr, _extra: [u8; 8]) -> Vec<Ipv6Addr> {
    let v = u32::from(a);
    let hi = (v >> 16) as u16;
    let lo = v as u16;
    let mut forms = vec![
        a.to_ipv6_mapped(),
        Ipv6Addr::new(0x64, 0xff9b, 0, 0, 0, 0, hi, lo),
    ];
    // IPv4-compatible, except where it spells :: or ::1.
    if v > 1 {
        forms.push(Ipv6Addr::new(0, 0, 0, 0, 0, 0, hi, lo));
    }
    forms
}

/// The tunnel forms (6to4, Teredo) that carry `a`, built with `extra` in the free bits: IPv6
/// hosts reached through `a`, judged as both.
pub fn tunnels(a: Ipv4Addr, extra: [u8; 8]) -> Vec<Ipv6Addr> {
    let o = a.octets();
    let v = u32::from(a);
    let hi = (v >> 16) as u16;
    let lo = v as u16;
    let e = |i: usize| u16::from_be_bytes([extra[i], extra[i + 1]]);
    vec![
        Ipv6Addr::new(
            0x2002,
            u16::from_be_bytes([o[0], o[1]]),
            u16::from_be_bytes([o[2], o[3]]),
            e(0),
            e(2),
            e(4),
            e(6),
            e(0) ^ e(6),
        ),
        // Teredo: server address, flags, obfuscated port, then the client address inverted.
        Ipv6Addr::new(0x2001, 0, e(0), e(2), e(4), e(6), !hi, !lo),
    ]
}

/// The fuzz target.
pub fn run(data: &[u8]) {
    let f = fixture();
    let mut input = Input::new(data);
    let sel = input.u8();
    let v4 = Ipv4Addr::from(input.array::<4>());
    let v6 = Ipv6Addr::from(input.array::<16>());
    let net_bytes = input.array::<16>();
    let len = input.u8();
    let port = input.u16();
    let extra = input.array::<8>();

    let net = if sel & 1 == 0 {
        IpAddr::V4(Ipv4Addr::new(
            net_bytes[0],
            net_bytes[1],
            net_bytes[2],
            net_bytes[3],
        ))
    } else {
        IpAddr::V6(Ipv6Addr::from(net_bytes))
    };
    let full = if net.is_ipv4() { 33 } else { 129 };
    let mut networks = fixed_networks().to_vec();
    networks.push((net, len % full));

    check_peer(f, IpAddr::V4(v4), port, &networks);
    check_peer(f, IpAddr::V6(v6), port, &networks);
    // The network address itself as a peer, too.
    check_peer(f, net, port, &networks);

    let a = IpAddr::V4(v4);
    for form in tunnels(v4, extra) {
        let form = IpAddr::V6(form);
        assert_eq!(canonical_peer(form), form, "{form} is reduced");
        assert_eq!(tunnel_ipv4(form), Some(v4), "{form} does not carry {a}");
        for route_name in ["all", "world", "private"] {
            let route = f.snap.route(route_name).unwrap();
            if f.snap.admits(route, SocketAddr::new(form, port)).is_some() {
                assert!(
                    f.snap.permits_ip(route, a),
                    "route {route_name}: {form} admitted though {a} is not permitted"
                );
            }
        }
    }
    for form in embeddings(v4, extra) {
        let form = IpAddr::V6(form);
        assert_eq!(canonical_peer(form), a, "{form} does not reduce to {a}");
        assert_eq!(scope(form), scope(a), "scope({form}) != scope({a})");
        for &(n, l) in &networks {
            assert_eq!(
                endpoint_admits(n, l, form),
                endpoint_admits(n, l, a),
                "{n}/{l}: {form} and {a} get different verdicts"
            );
        }
        for route_name in ["all", "world", "private"] {
            let route = f.snap.route(route_name).unwrap();
            assert_eq!(
                f.snap.admits(route, SocketAddr::new(form, port)),
                f.snap.admits(route, SocketAddr::new(a, port)),
                "route {route_name}: {form} vs {a} port {port}"
            );
            assert_eq!(
                f.snap.permits_ip(route, form),
                f.snap.permits_ip(route, a),
                "route {route_name}: permits {form} vs {a}"
            );
        }
    }
}

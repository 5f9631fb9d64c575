//! The rtnetlink client against the real kernel, in network namespaces of its own (root): a
//! test-kit topology ([`Shape`]) with the lab's own addresses and routes.

use super::*;
use std::net::{Ipv4Addr, Ipv6Addr, UdpSocket};
use uturn_testkit::netns::{Shape, Topology};

/// The lab's namespaces: the lookups run in `near`; `far` is the other end of its one link.
const NEAR: &str = "near";
const FAR: &str = "far";

/// The loopback's index, the same in every namespace (the kernel's `LOOPBACK_IFINDEX`).
const LOOPBACK: u32 = 1;

fn v4(a: u8, b: u8, c: u8, d: u8) -> IpAddr {
    IpAddr::V4(Ipv4Addr::new(a, b, c, d))
}

fn v6(text: &str) -> IpAddr {
    IpAddr::V6(text.parse::<Ipv6Addr>().unwrap())
}

/// Two network namespaces joined by a veth pair: `near` (where the lookups run, end `va`,
/// [`Lab::va`]) and `far` (end `vb`), a [`Topology`] whose addresses on the link make way for
/// the lab's. Both are deleted when it drops, also when the test fails.
///
/// In `near`: lo up, `va` 198.51.100.1/24 and 2001:db8:77::1/64; routes to 203.0.113.0/24
/// via 198.51.100.2, to 203.0.114.0/24 via 2001:db8:77::2 (RTA_VIA) and to 2001:db8:78::/64
/// via 2001:db8:77::2; `unreachable`, `blackhole` and
/// `prohibit` routes to 192.0.2.0/26, .64/26, .128/26 and 2001:db8:79:{1,2,3}::/64. In
/// `far`: `vb` 198.51.100.2/24 and 2001:db8:77::2/64. No default route in `near` (it forwards
/// IPv4, as a topology's router does: no lookup here asks about forwarded traffic).
struct Lab {
    topology: Topology,
}

impl Lab {
    fn new() -> Lab {
        let lab = Lab {
            topology: Shape::new("urt").router(NEAR, &[FAR]).build(),
        };
        let (va, vb) = (lab.va_name(), lab.topology.dev(FAR));
        for (role, command) in [
            (NEAR, format!("-4 addr flush dev {va}")),
            (FAR, format!("-4 addr flush dev {vb}")),
            (NEAR, format!("addr add 198.51.100.1/24 dev {va}")),
            (NEAR, format!("addr add 2001:db8:77::1/64 dev {va} nodad")),
            (FAR, format!("addr add 198.51.100.2/24 dev {vb}")),
            (FAR, format!("addr add 2001:db8:77::2/64 dev {vb} nodad")),
            (NEAR, "route add 203.0.113.0/24 via 198.51.100.2".to_owned()),
            (
                NEAR,
                format!("route add 203.0.114.0/24 via inet6 2001:db8:77::2 dev {va}"),
            ),
            (
                NEAR,
                "route add 2001:db8:78::/64 via 2001:db8:77::2".to_owned(),
            ),
            (NEAR, "route add unreachable 192.0.2.0/26".to_owned()),
            (NEAR, "route add blackhole 192.0.2.64/26".to_owned()),
            (NEAR, "route add prohibit 192.0.2.128/26".to_owned()),
            (NEAR, "route add unreachable 2001:db8:79:1::/64".to_owned()),
            (NEAR, "route add blackhole 2001:db8:79:2::/64".to_owned()),
            (NEAR, "route add prohibit 2001:db8:79:3::/64".to_owned()),
        ] {
            lab.ip(role, &command.split_whitespace().collect::<Vec<_>>());
        }
        lab
    }

    /// `ip ARGS` in namespace `role`: its output.
    fn ip(&self, role: &str, args: &[&str]) -> String {
        self.topology.run_in(role, &[&["ip"], args].concat())
    }

    /// The name of `va`, `near`'s end of the link.
    fn va_name(&self) -> &str {
        self.topology.gateway_dev(FAR)
    }

    /// The ifindex and MAC address of `va`.
    fn va(&self) -> (u32, [u8; 6]) {
        let va = self.topology.gateway_interface(FAR);
        (va.index, va.mac)
    }

    /// The MAC address of `vb`, `far`'s end of the link.
    fn vb_mac(&self) -> [u8; 6] {
        self.topology.interface(FAR).mac
    }

    /// Runs `f` in `near` with a netlink socket of its own.
    fn near<T>(&self, f: impl FnOnce(&mut Netlink) -> T) -> T {
        self.topology
            .in_ns(NEAR, || f(&mut Netlink::open().unwrap()))
    }
}

#[test]
fn loopback_is_local_with_itself_as_source() {
    let mut netlink = Netlink::open().unwrap();
    let route = netlink.route(v4(127, 0, 0, 1)).unwrap().unwrap();
    assert!(route.local, "{route:?}");
    assert_eq!(route.source, v4(127, 0, 0, 1));
    assert_eq!(route.gateway, None);
    // The answer keeps coming on the same socket.
    for _ in 0..100 {
        assert_eq!(netlink.route(v4(127, 0, 0, 1)).unwrap(), Some(route));
    }
}

#[test]
fn own_addresses_are_local() {
    let lab = Lab::new();
    let lo = LOOPBACK;
    lab.near(|netlink| {
        for ip in [
            v4(127, 0, 0, 1),
            v4(127, 1, 2, 3),
            v4(198, 51, 100, 1),
            v6("::1"),
            v6("2001:db8:77::1"),
        ] {
            let route = netlink.route(ip).unwrap().unwrap();
            assert!(route.local, "{ip}: {route:?}");
            let source = if ip == v4(127, 1, 2, 3) {
                // The whole of 127/8 is local; its source is the loopback's address.
                v4(127, 0, 0, 1)
            } else {
                ip
            };
            assert_eq!(route.source, source, "{ip}");
            // The kernel delivers its own addresses through the loopback.
            assert_eq!(route.ifindex, lo, "{ip}");
            assert_eq!(route.gateway, None, "{ip}");
        }
    });
}

#[test]
fn addresses_on_the_veth_link_are_not_local() {
    let lab = Lab::new();
    let (va, _) = lab.va();
    lab.near(|netlink| {
        for (ip, source) in [
            (v4(198, 51, 100, 2), v4(198, 51, 100, 1)),
            (v4(198, 51, 100, 200), v4(198, 51, 100, 1)),
            // RTN_BROADCAST: delivered here too, but not an address of this host's.
            (v4(198, 51, 100, 255), v4(198, 51, 100, 1)),
            (v6("2001:db8:77::2"), v6("2001:db8:77::1")),
        ] {
            let route = netlink.route(ip).unwrap().unwrap();
            assert_eq!(
                route,
                Route {
                    source,
                    ifindex: va,
                    gateway: None,
                    local: false,
                },
                "{ip}"
            );
        }
    });
}

#[test]
fn routes_via_a_gateway_report_it() {
    let lab = Lab::new();
    let (va, _) = lab.va();
    lab.near(|netlink| {
        for (ip, source, gateway) in [
            (v4(203, 0, 113, 5), v4(198, 51, 100, 1), v4(198, 51, 100, 2)),
            // An IPv4 route through an IPv6 next hop (RFC 5549).
            (
                v4(203, 0, 114, 5),
                v4(198, 51, 100, 1),
                v6("2001:db8:77::2"),
            ),
            (
                v6("2001:db8:78::5"),
                v6("2001:db8:77::1"),
                v6("2001:db8:77::2"),
            ),
        ] {
            let route = netlink.route(ip).unwrap().unwrap();
            assert_eq!(
                route,
                Route {
                    source,
                    ifindex: va,
                    gateway: Some(gateway),
                    local: false,
                },
                "{ip}"
            );
        }
    });
}

#[test]
fn unusable_routes_are_none() {
    let lab = Lab::new();
    lab.near(|netlink| {
        for ip in [
            v4(192, 0, 2, 1),       // unreachable
            v4(192, 0, 2, 65),      // blackhole
            v4(192, 0, 2, 129),     // prohibit
            v4(8, 8, 8, 8),         // no route at all
            v6("2001:db8:79:1::1"), // unreachable
            v6("2001:db8:79:2::1"), // blackhole
            v6("2001:db8:79:3::1"), // prohibit
            v6("2001:db8:ffff::1"), // no route at all
        ] {
            assert_eq!(netlink.route(ip).unwrap(), None, "{ip}");
        }
        // The socket is still in step afterwards.
        assert!(netlink.route(v4(127, 0, 0, 1)).unwrap().unwrap().local);
    });
}

#[test]
fn neighbours_in_usable_states_only() {
    let lab = Lab::new();
    let (va, _) = lab.va();
    let permanent = [2, 0, 0, 0, 0, 9];
    for (ip, nud) in [
        ("198.51.100.9", "permanent"),
        ("2001:db8:77::9", "permanent"),
        ("198.51.100.10", "stale"),
        ("198.51.100.11", "noarp"),
    ] {
        lab.ip(
            NEAR,
            &[
                "neigh",
                "add",
                ip,
                "lladdr",
                "02:00:00:00:00:09",
                "dev",
                lab.va_name(),
                "nud",
                nud,
            ],
        );
    }
    lab.near(|netlink| {
        assert_eq!(
            netlink.neighbour(v4(198, 51, 100, 9), va).unwrap(),
            Some(permanent)
        );
        assert_eq!(
            netlink.neighbour(v6("2001:db8:77::9"), va).unwrap(),
            Some(permanent)
        );
        assert_eq!(
            netlink.neighbour(v4(198, 51, 100, 10), va).unwrap(),
            Some(permanent)
        );
        // NOARP: no link-layer address to speak of.
        assert_eq!(netlink.neighbour(v4(198, 51, 100, 11), va).unwrap(), None);
        // Not on that interface, not in the table, no such interface.
        assert_eq!(netlink.neighbour(v4(198, 51, 100, 9), 1).unwrap(), None);
        assert_eq!(netlink.neighbour(v4(198, 51, 100, 99), va).unwrap(), None);
        assert_eq!(
            netlink.neighbour(v4(198, 51, 100, 9), 999_999).unwrap(),
            None
        );
        // A kernel before 5.0's way: the same answers from a dump of the table.
        assert_eq!(
            netlink
                .neighbour_from_dump(v4(198, 51, 100, 9), va)
                .unwrap(),
            Some(permanent)
        );
        assert_eq!(
            netlink
                .neighbour_from_dump(v6("2001:db8:77::9"), va)
                .unwrap(),
            Some(permanent)
        );
        assert_eq!(
            netlink
                .neighbour_from_dump(v4(198, 51, 100, 11), va)
                .unwrap(),
            None
        );
        assert_eq!(
            netlink
                .neighbour_from_dump(v4(198, 51, 100, 99), va)
                .unwrap(),
            None
        );

        // Traffic to an address nobody has: an INCOMPLETE entry while it is resolved.
        let socket = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        socket
            .send_to(b"x", (Ipv4Addr::new(198, 51, 100, 77), 9))
            .unwrap();
        assert_eq!(netlink.neighbour(v4(198, 51, 100, 77), va).unwrap(), None);
        assert_eq!(
            netlink
                .neighbour_from_dump(v4(198, 51, 100, 77), va)
                .unwrap(),
            None
        );
    });
    let text = lab.ip(NEAR, &["neigh", "show", "198.51.100.77"]);
    assert!(
        text.contains("INCOMPLETE") || text.contains("FAILED"),
        "the entry of an address nobody has: {text}"
    );
}

#[test]
fn neighbour_resolved_by_the_kernel() {
    let lab = Lab::new();
    let (va, _) = lab.va();
    let vb_mac = lab.vb_mac();
    lab.near(|netlink| {
        let socket4 = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).unwrap();
        let socket6 = UdpSocket::bind((Ipv6Addr::UNSPECIFIED, 0)).unwrap();
        for ip in [v4(198, 51, 100, 2), v6("2001:db8:77::2")] {
            let socket = if ip.is_ipv4() { &socket4 } else { &socket6 };
            // ARP or neighbour discovery, answered by `vb` in the other namespace.
            let deadline = Instant::now() + Duration::from_secs(5);
            let mac = loop {
                socket.send_to(b"x", (ip, 9)).unwrap();
                if let Some(mac) = netlink.neighbour(ip, va).unwrap() {
                    break mac;
                }
                assert!(Instant::now() < deadline, "{ip}: never resolved");
                std::thread::sleep(Duration::from_millis(20));
            };
            assert_eq!(mac, vb_mac, "{ip}");
        }
    });
}

#[test]
fn link_mac_of_the_veth() {
    let lab = Lab::new();
    let (va, va_mac) = lab.va();
    let lo = LOOPBACK;
    lab.near(|netlink| {
        assert_eq!(netlink.link_mac(va).unwrap(), Some(va_mac));
        // The loopback has an all-zero Ethernet address.
        assert_eq!(netlink.link_mac(lo).unwrap(), Some([0; 6]));
        assert_eq!(netlink.link_mac(999_999).unwrap(), None);
    });
}

/// The defect this module fixes: with `ip_nonlocal_bind`, `bind()` accepts any address, but
/// the routing table still says which are this host's own.
#[test]
fn nonlocal_bind_does_not_make_an_address_local() {
    let lab = Lab::new();
    let peers = [
        v4(198, 51, 100, 2),
        v4(203, 0, 113, 5),
        v6("2001:db8:77::2"),
        v6("2001:db8:78::5"),
    ];
    lab.near(|netlink| {
        for ip in peers {
            let refused = UdpSocket::bind((ip, 0)).unwrap_err();
            assert_eq!(refused.raw_os_error(), Some(libc::EADDRNOTAVAIL), "{ip}");
        }
        // This thread's namespace's sysctls (/proc/sys/net follows the opener's).
        std::fs::write("/proc/sys/net/ipv4/ip_nonlocal_bind", "1").unwrap();
        std::fs::write("/proc/sys/net/ipv6/ip_nonlocal_bind", "1").unwrap();
        for ip in peers {
            UdpSocket::bind((ip, 0)).unwrap_or_else(|e| panic!("bind {ip}: {e}"));
            let route = netlink.route(ip).unwrap().unwrap();
            assert!(!route.local, "{ip}: {route:?}");
        }
        assert!(netlink.route(v4(198, 51, 100, 1)).unwrap().unwrap().local);
    });
    let host = std::fs::read_to_string("/proc/sys/net/ipv4/ip_nonlocal_bind").unwrap();
    let inside = lab
        .topology
        .run_in(NEAR, &["cat", "/proc/sys/net/ipv4/ip_nonlocal_bind"]);
    assert_eq!(inside.trim(), "1", "the sysctl was set in the namespace");
    assert_eq!(
        host.trim(),
        "0",
        "and not on the host (unless the host had it already)"
    );
}

#[test]
fn a_late_reply_is_skipped() {
    let mut netlink = Netlink::open().unwrap();
    // Requests whose replies nobody reads: they wait in the socket, ahead of the next (the
    // first of another family: taken for the answer, it would fail the lookup).
    for ip in [v6("::1"), v4(127, 0, 0, 2)] {
        let mut message = RouteMessage::default();
        message.header.address_family = family(ip);
        message.header.destination_prefix_length = if ip.is_ipv4() { 32 } else { 128 };
        message
            .attributes
            .push(RouteAttribute::Destination(RouteAddress::from(ip)));
        netlink
            .send(RouteNetlinkMessage::GetRoute(message), NLM_F_REQUEST)
            .unwrap();
    }
    let mut message = NeighbourMessage::default();
    message.header.family = AddressFamily::Inet;
    netlink
        .send(
            RouteNetlinkMessage::GetNeighbour(message),
            NLM_F_REQUEST | NLM_F_DUMP,
        )
        .unwrap();
    let route = netlink.route(v4(127, 0, 0, 1)).unwrap().unwrap();
    assert_eq!(route.source, v4(127, 0, 0, 1));
}

#[test]
fn no_reply_times_out() {
    let mut netlink = Netlink::open().unwrap();
    // Without NLM_F_REQUEST the kernel does not answer.
    let start = Instant::now();
    let error = netlink
        .exchange(
            RouteNetlinkMessage::GetRoute(RouteMessage::default()),
            0,
            &mut |_, _| Ok(()),
        )
        .unwrap_err();
    assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
    // It waited for its timeout (how much longer depends on the machine's load).
    let waited = start.elapsed();
    assert!(waited >= TIMEOUT, "{waited:?}");
    // And the socket still works.
    assert!(netlink.route(v4(127, 0, 0, 1)).unwrap().unwrap().local);
}

/// The kernel's replies to `request`, datagram by datagram.
fn replies(netlink: &mut Netlink, request: RouteNetlinkMessage, flags: u16) -> Vec<Vec<u8>> {
    let seq = netlink.send(request, flags).unwrap();
    let mut datagrams = Vec::new();
    loop {
        let len = netlink
            .receive(Instant::now() + Duration::from_secs(1))
            .unwrap();
        let datagram = netlink.buffer[..len].to_vec();
        let done = scan(
            &datagram,
            netlink.port,
            seq,
            flags & NLM_F_DUMP == NLM_F_DUMP,
            &mut |_, _| Ok(()),
        )
        .unwrap();
        datagrams.push(datagram);
        if done.is_some() {
            return datagrams;
        }
    }
}

/// Real replies, cut at every length and with bytes changed at random: an error or an
/// answer, never a panic.
#[test]
fn damaged_replies_do_not_panic() {
    let lab = Lab::new();
    let (va, _) = lab.va();
    lab.ip(
        NEAR,
        &[
            "neigh",
            "add",
            "198.51.100.9",
            "lladdr",
            "02:00:00:00:00:09",
            "dev",
            lab.va_name(),
            "nud",
            "permanent",
        ],
    );
    let (port, samples) = lab.near(|netlink| {
        let mut samples = Vec::new();
        for ip in [v4(203, 0, 113, 5), v6("2001:db8:78::5"), v4(192, 0, 2, 1)] {
            let mut message = RouteMessage::default();
            message.header.address_family = family(ip);
            message.header.destination_prefix_length = if ip.is_ipv4() { 32 } else { 128 };
            message
                .attributes
                .push(RouteAttribute::Destination(RouteAddress::from(ip)));
            let request = RouteNetlinkMessage::GetRoute(message);
            samples.push((ip, replies(netlink, request, NLM_F_REQUEST)));
        }
        let ip = v4(198, 51, 100, 9);
        let mut message = NeighbourMessage::default();
        message.header.family = AddressFamily::Inet;
        message.header.ifindex = va;
        message
            .attributes
            .push(NeighbourAttribute::Destination(NeighbourAddress::from(ip)));
        let request = RouteNetlinkMessage::GetNeighbour(message);
        samples.push((ip, replies(netlink, request, NLM_F_REQUEST)));
        let mut message = NeighbourMessage::default();
        message.header.family = AddressFamily::Inet;
        let request = RouteNetlinkMessage::GetNeighbour(message);
        samples.push((ip, replies(netlink, request, NLM_F_REQUEST | NLM_F_DUMP)));
        let mut message = LinkMessage::default();
        message.header.index = va;
        let request = RouteNetlinkMessage::GetLink(message);
        samples.push((ip, replies(netlink, request, NLM_F_REQUEST)));
        (netlink.port, samples)
    });
    // What the parsers make of a datagram: how many answers they found in it.
    let parse_all = |ip: IpAddr, datagram: &[u8]| -> io::Result<usize> {
        let seq = u32::from_ne_bytes(datagram[8..12].try_into().unwrap());
        let mut answers = 0;
        let answer = scan(datagram, port, seq, true, &mut |kind, payload| {
            answers += match kind {
                libc::RTM_NEWROUTE => usize::from(parse_route(ip, payload)?.is_some()),
                libc::RTM_NEWNEIGH => usize::from(parse_neighbour(ip, va, payload)?.is_some()),
                libc::RTM_NEWLINK => usize::from(parse_link(va, payload)?.is_some()),
                _ => 0,
            };
            Ok(())
        })?;
        // The kernel's refusal (the unreachable route's) counts as an answer.
        Ok(answers + usize::from(matches!(answer, Some(Err(_)))))
    };
    // xorshift: the same damage every run.
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut random = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut checked = 0;
    for (ip, datagrams) in &samples {
        // The intact reply parses to one answer.
        let answers: usize = datagrams.iter().map(|d| parse_all(*ip, d).unwrap()).sum();
        assert_eq!(answers, 1, "{ip}: {datagrams:?}");
        for datagram in datagrams {
            assert!(datagram.len() >= 16);
            // Cut anywhere: anything but a panic.
            for cut in 16..datagram.len() {
                let _ = parse_all(*ip, &datagram[..cut]);
                checked += 1;
            }
            for _ in 0..2_000 {
                let mut damaged = datagram.clone();
                for _ in 0..1 + random() % 4 {
                    let at = (random() % damaged.len() as u64) as usize;
                    damaged[at] = random() as u8;
                }
                let cut = 16 + (random() % (damaged.len() as u64 - 15)) as usize;
                let _ = parse_all(*ip, &damaged[..cut]);
                checked += 1;
            }
        }
    }
    assert!(checked > 10_000, "{checked}");
}

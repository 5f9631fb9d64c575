//! The peer policy's address rules: every IPv6 form whose packets reach an IPv4 address
//! (mapped, compatible, NAT64) is reduced to it before any check; 6to4 and Teredo addresses are
//! IPv6 destinations that travel through the IPv4 address they embed, so both are judged;
//! addresses of special scope (unspecified, loopback, link-local, multicast, broadcast) are
//! reachable only through an endpoint that names that scope explicitly (a range inside it),
//! never through a wider range such as `0.0.0.0/0`; and the host's own addresses
//! ([`host_ips`]) only through an endpoint that is exactly that address.
//!
//! [`crate::snapshot::Snapshot::permits_ip`] and [`crate::snapshot::Snapshot::admits`], which
//! every check calls (CreatePermission, ChannelBind, Send, each relayed datagram), apply them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// The address a dual-stack socket means by `ip`: IPv4-mapped IPv6 (`::ffff:a.b.c.d`, which
/// such a socket reports for an IPv4 peer and sends as IPv4) becomes that IPv4 address; every
/// other address is itself. The one form the wire and the sockets treat as IPv4; the policy
/// reduces more ([`canonical_peer`]).
pub fn unmapped_ip(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
        IpAddr::V4(_) => ip,
    }
}

/// The address a peer IP really designates: IPv4-mapped (`::ffff:a.b.c.d`, sent as IPv4 by a
/// dual-stack socket; [`unmapped_ip`]), IPv4-compatible (`::a.b.c.d`, except `::` and `::1`)
/// and NAT64 (`64:ff9b::/96`, translated to it) forms become that IPv4 address. 6to4 and
/// Teredo stay IPv6: see [`tunnel_ipv4`].
pub fn canonical_peer(ip: IpAddr) -> IpAddr {
    let ip = unmapped_ip(ip);
    let IpAddr::V6(v6) = ip else {
        return ip;
    };
    let s = v6.segments();
    let o = v6.octets();
    let last32 = Ipv4Addr::new(o[12], o[13], o[14], o[15]);
    if s[..6] == [0; 6] && !(v6.is_unspecified() || v6.is_loopback()) {
        return IpAddr::V4(last32);
    }
    if s[0] == 0x64 && s[1] == 0xff9b && s[2..6] == [0; 4] {
        return IpAddr::V4(last32);
    }
    ip
}

/// The IPv4 address a 6to4 (`2002::/16`, the site's border router) or Teredo (`2001::/32`, the
/// client's NAT, stored inverted) address travels through: a packet for it is sent to the IPv6
/// address, and where a 6to4 or Teredo relay carries it (on this host or on the path), it leaves
/// encapsulated to this IPv4 address. `None` for every other address.
pub fn tunnel_ipv4(ip: IpAddr) -> Option<Ipv4Addr> {
    let IpAddr::V6(v6) = ip else {
        return None;
    };
    let s = v6.segments();
    let o = v6.octets();
    if s[0] == 0x2002 {
        return Some(Ipv4Addr::new(o[2], o[3], o[4], o[5]));
    }
    if s[0] == 0x2001 && s[1] == 0 {
        return Some(Ipv4Addr::from(!u32::from_be_bytes([
            o[12], o[13], o[14], o[15],
        ])));
    }
    None
}

/// Every address configured on this host's interfaces, both families, loopback included
/// (`getifaddrs(3)`); empty if the call fails. A relay that sends to one of them reaches the
/// gateway's own sockets (listeners, relay ports, health, metrics) whatever address the
/// listeners advertise.
pub fn host_ips() -> Vec<IpAddr> {
    let Ok(interfaces) = nix::ifaddrs::getifaddrs() else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = interfaces
        .filter_map(|interface| {
            let address = interface.address?;
            match address.as_sockaddr_in() {
                Some(v4) => Some(IpAddr::V4(Ipv4Addr::from(v4.ip()))),
                None => address.as_sockaddr_in6().map(|v6| IpAddr::V6(v6.ip())),
            }
        })
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

/// Where an address is reachable from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scope {
    /// `0.0.0.0/8`, `::`.
    Unspecified,
    /// `127.0.0.0/8`, `::1`.
    Loopback,
    /// `169.254.0.0/16` (cloud metadata included), `fe80::/10`.
    LinkLocal,
    /// `224.0.0.0/4`, `ff00::/8`.
    Multicast,
    /// `255.255.255.255`.
    Broadcast,
    /// Everything else.
    Global,
}

impl Scope {
    /// The scope's name in a sentence: `loopback`, `link-local`, …
    pub fn name(&self) -> &'static str {
        match self {
            Scope::Unspecified => "unspecified",
            Scope::Loopback => "loopback",
            Scope::LinkLocal => "link-local",
            Scope::Multicast => "multicast",
            Scope::Broadcast => "broadcast",
            Scope::Global => "global",
        }
    }
}

/// The special-scope range holding canonical `ip`, with its scope.
fn special_range(ip: IpAddr) -> Option<(IpAddr, u8, Scope)> {
    let v4 = |a, b, c, d, len, scope| Some((IpAddr::V4(Ipv4Addr::new(a, b, c, d)), len, scope));
    let v6 = |addr: Ipv6Addr, len, scope| Some((IpAddr::V6(addr), len, scope));
    match ip {
        IpAddr::V4(a) => match a.octets() {
            [0, ..] => v4(0, 0, 0, 0, 8, Scope::Unspecified),
            [127, ..] => v4(127, 0, 0, 0, 8, Scope::Loopback),
            [169, 254, ..] => v4(169, 254, 0, 0, 16, Scope::LinkLocal),
            [224..=239, ..] => v4(224, 0, 0, 0, 4, Scope::Multicast),
            [255, 255, 255, 255] => v4(255, 255, 255, 255, 32, Scope::Broadcast),
            _ => None,
        },
        IpAddr::V6(a) if a.is_unspecified() => v6(a, 128, Scope::Unspecified),
        IpAddr::V6(a) if a.is_loopback() => v6(a, 128, Scope::Loopback),
        IpAddr::V6(a) if a.segments()[0] & 0xffc0 == 0xfe80 => v6(
            Ipv6Addr::new(0xfe80, 0, 0, 0, 0, 0, 0, 0),
            10,
            Scope::LinkLocal,
        ),
        IpAddr::V6(a) if a.segments()[0] & 0xff00 == 0xff00 => v6(
            Ipv6Addr::new(0xff00, 0, 0, 0, 0, 0, 0, 0),
            8,
            Scope::Multicast,
        ),
        IpAddr::V6(_) => None,
    }
}

/// The scope of `ip` (after [`canonical_peer`]).
pub fn scope(ip: IpAddr) -> Scope {
    special_range(canonical_peer(ip)).map_or(Scope::Global, |(_, _, s)| s)
}

/// Whether `ip` lies in `network/prefix_len` (same family; `network` has its host bits clear).
pub fn in_prefix(network: IpAddr, prefix_len: u8, ip: IpAddr) -> bool {
    match (network, ip) {
        (IpAddr::V4(n), IpAddr::V4(a)) => {
            let len = u32::from(prefix_len.min(32));
            let mask = if len == 0 { 0 } else { u32::MAX << (32 - len) };
            u32::from(a) & mask == u32::from(n) & mask
        }
        (IpAddr::V6(n), IpAddr::V6(a)) => {
            let len = u32::from(prefix_len.min(128));
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - len)
            };
            u128::from(a) & mask == u128::from(n) & mask
        }
        _ => false,
    }
}

/// Whether an endpoint `network/prefix_len` may admit peer `ip`: `ip` (canonical) lies in it,
/// and if `ip` is of special scope, the whole endpoint lies inside that scope's range (so
/// `127.0.0.1` or `127.0.0.0/8` admit loopback, `0.0.0.0/0` does not).
pub fn endpoint_admits(network: IpAddr, prefix_len: u8, ip: IpAddr) -> bool {
    let ip = canonical_peer(ip);
    if !in_prefix(network, prefix_len, ip) {
        return false;
    }
    match special_range(ip) {
        None => true,
        Some((range, range_len, _)) => {
            prefix_len >= range_len && in_prefix(range, range_len, network)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn every_ipv4_embedding_reduces_to_the_ipv4_address() {
        for (v6, v4) in [
            ("::ffff:127.0.0.1", "127.0.0.1"),
            ("::127.0.0.1", "127.0.0.1"),
            ("::0.0.0.0", "::"),
            ("::1", "::1"),
            ("64:ff9b::a9fe:a9fe", "169.254.169.254"),
            // 6to4 and Teredo are IPv6 destinations (see `tunnel_ipv4`).
            ("2002:7f00:1::", "2002:7f00:1::"),
            (
                "2001:0:4136:e378:8000:63bf:80ff:fffe",
                "2001:0:4136:e378:8000:63bf:80ff:fffe",
            ),
            ("2001:db8::1", "2001:db8::1"),
            ("fd00::1", "fd00::1"),
            ("10.1.2.3", "10.1.2.3"),
        ] {
            assert_eq!(canonical_peer(ip(v6)), ip(v4), "{v6}");
        }
    }

    #[test]
    fn only_the_mapped_form_is_unmapped() {
        for (v6, unmapped) in [
            ("::ffff:127.0.0.1", "127.0.0.1"),
            ("::ffff:10.1.2.3", "10.1.2.3"),
            ("::127.0.0.1", "::127.0.0.1"),
            ("64:ff9b::a9fe:a9fe", "64:ff9b::a9fe:a9fe"),
            ("::", "::"),
            ("2001:db8::1", "2001:db8::1"),
            ("10.1.2.3", "10.1.2.3"),
        ] {
            assert_eq!(unmapped_ip(ip(v6)), ip(unmapped), "{v6}");
        }
    }

    #[test]
    fn six_to_four_and_teredo_travel_through_their_ipv4_address() {
        for (v6, v4) in [
            ("2002:7f00:1::", Some("127.0.0.1")),
            ("2002:a00:1:1234::1", Some("10.0.0.1")),
            // Teredo: the client address is the last 32 bits, inverted.
            ("2001:0:4136:e378:8000:63bf:80ff:fffe", Some("127.0.0.1")),
            ("2001:db8::1", None),
            ("::ffff:127.0.0.1", None),
            ("10.0.0.1", None),
        ] {
            assert_eq!(tunnel_ipv4(ip(v6)), v4.map(|s| s.parse().unwrap()), "{v6}");
        }
    }

    #[test]
    fn host_ips_include_loopback_of_both_families_where_configured() {
        let ips = host_ips();
        assert!(ips.contains(&ip("127.0.0.1")), "{ips:?}");
    }

    #[test]
    fn special_scopes_need_an_endpoint_inside_them() {
        let any4 = (ip("0.0.0.0"), 0);
        let any6 = (ip("::"), 0);
        // (endpoint, peer, admitted)
        let cases = [
            (any4, "10.0.0.1", true),
            (any4, "0.0.0.0", false),
            (any4, "0.1.2.3", false),
            (any4, "127.0.0.1", false),
            (any4, "169.254.169.254", false),
            (any4, "224.0.0.1", false),
            (any4, "255.255.255.255", false),
            (any4, "::ffff:127.0.0.1", false),
            (any4, "::127.0.0.1", false),
            (any4, "2002:7f00:1::", false),
            (any4, "64:ff9b::7f00:1", false),
            (any4, "2001:0:4136:e378:8000:63bf:80ff:fffe", false),
            // A 6to4 address is an IPv6 destination: an IPv6 endpoint judges it (the snapshot
            // judges the IPv4 address it travels through as well).
            (any4, "2002:a00:1::1", false),
            (any6, "2002:a00:1::1", true),
            (any4, "::ffff:10.0.0.1", true),
            (any6, "::", false),
            (any6, "::1", false),
            (any6, "fe80::1", false),
            (any6, "ff02::1", false),
            (any6, "2001:db8::1", true),
            ((ip("127.0.0.1"), 32), "127.0.0.1", true),
            ((ip("127.0.0.1"), 32), "::ffff:127.0.0.1", true),
            ((ip("127.0.0.0"), 8), "127.0.0.2", true),
            ((ip("127.0.0.0"), 7), "127.0.0.2", false),
            ((ip("169.254.169.254"), 32), "169.254.169.254", true),
            ((ip("::1"), 128), "::1", true),
            ((ip("fe80::"), 10), "fe80::1", true),
            ((ip("10.0.0.0"), 8), "127.0.0.1", false),
        ];
        for ((network, len), peer, want) in cases {
            assert_eq!(
                endpoint_admits(network, len, ip(peer)),
                want,
                "{network}/{len} -> {peer}"
            );
        }
        assert_eq!(scope(ip("::ffff:169.254.169.254")), Scope::LinkLocal);
        assert_eq!(scope(ip("8.8.8.8")), Scope::Global);
    }
}

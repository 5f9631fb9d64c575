//! `config`: the config parser on arbitrary text, the TURN URI parser, the endpoint forms, and
//! the snapshot built from whatever parses.
//!
//! Input: `[mode: u8][UTF-8 text]`. Mode % 4: 0 = config with a fixed environment
//! (`parse_config_with_env`, reproducible anywhere), 1 = config with the process environment
//! (`parse_config`), 2 = TURN URI (`parse_turn_uri`, `StunnerConfig::from_turn_uri`),
//! 3 = one endpoint per line (v1's `StaticEndpoint` and `ServiceEndpoint`, v2's `Endpoint`
//! and `ServiceEndpoint::parse_v2`, the v1 → v2 rewriting, `parse_http_endpoint`). Configs of
//! both versions (v1 documents through the v1 → v2 conversion) go through modes 0 and 1.
//!
//! Checks: errors are returned, never panics; a parsed config validates again to itself;
//! its JSON (`to_json`, the document as written) parses back to the same config; the snapshot
//! routes every listener, and whatever it admits lies in a cluster of the listener's TURN
//! server and is permitted at permission time; a v1 endpoint rewritten to v2 names the same
//! peers.

use crate::input::Input;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use uturn_shared::config::{
    parse_config, parse_config_with_env, parse_http_endpoint, parse_turn_uri, v1_endpoint_to_v2,
    Endpoint, ServiceEndpoint, StaticEndpoint, StunnerConfig,
};
use uturn_shared::policy::{canonical_peer, in_prefix};
use uturn_shared::snapshot::Snapshot;

/// The environment of mode 0.
pub fn fixed_env(key: &str) -> Option<String> {
    let value = match key {
        "STUNNER_ADDR" => "10.0.0.1",
        "STUNNER_PUBLIC_ADDR" => "203.0.113.7",
        "STUNNER_PUBLIC_PORT" => "3478",
        "STUNNER_USERNAME" => "user1",
        "STUNNER_PASSWORD" => "pa$$word",
        "STUNNER_REALM" => "fuzz.example",
        "EMPTY" => "",
        _ => return None,
    };
    Some(value.to_owned())
}

/// The fuzz target.
pub fn run(data: &[u8]) {
    let mut input = Input::new(data);
    let mode = input.u8();
    let Ok(text) = std::str::from_utf8(input.rest()) else {
        return;
    };
    match mode % 4 {
        0 => {
            if let Ok(cfg) = parse_config_with_env(text, &fixed_env) {
                check_config(&cfg, true);
            }
        }
        1 => {
            if let Ok(cfg) = parse_config(text) {
                check_config(&cfg, true);
            }
        }
        2 => turn_uri(text),
        _ => endpoints(text),
    }
}

fn turn_uri(text: &str) {
    let parsed = parse_turn_uri(text);
    let built = StunnerConfig::from_turn_uri(text);
    if let Ok(uri) = &parsed {
        assert!(!uri.username.is_empty() && !uri.password.is_empty());
        assert!(uri.protocol.is_turn(), "a TURN URI gave {:?}", uri.protocol);
    }
    if let Ok(cfg) = built {
        let uri = parsed.expect("from_turn_uri accepted a URI parse_turn_uri refuses");
        assert_eq!(cfg.listeners.len(), 1);
        assert_eq!(cfg.listener_protocol(&cfg.listeners[0]), Some(uri.protocol));
        assert_eq!(cfg.listeners[0].port, uri.port);
        // TLS/DTLS: the caller adds the certificate, so full validation would refuse it.
        check_config(&cfg, !uri.protocol.needs_cert());
    }
}

fn endpoints(text: &str) {
    for line in text.lines().take(32) {
        if let Ok(e) = StaticEndpoint::parse(line) {
            let full = if e.addr.is_ipv4() { 32 } else { 128 };
            assert!(e.prefix_len <= full, "{line:?} -> {e:?}");
            if let IpAddr::V6(v6) = e.addr {
                assert!(
                    v6.to_ipv4_mapped().is_none() || e.prefix_len < 96,
                    "{line:?}: an IPv4-mapped prefix was kept as IPv6: {e:?}"
                );
            }
            assert_eq!(
                masked(e.addr, e.prefix_len),
                e.addr,
                "{line:?}: host bits set"
            );
            assert!(
                in_prefix(e.addr, e.prefix_len, e.addr),
                "{line:?}: {e:?} does not contain itself"
            );
        }
        if let Ok(s) = ServiceEndpoint::parse(line) {
            assert!(!s.namespace.is_empty() && !s.name.is_empty());
            assert_eq!(ServiceEndpoint::parse(&service_text(&s)), Ok(s.clone()));
        }
        if let Ok(s) = ServiceEndpoint::parse_v2(line) {
            assert!(
                s.port_min >= 1 && s.port_min <= s.port_max,
                "{line:?} -> {s:?}"
            );
        }
        match Endpoint::parse(line) {
            Ok(Endpoint::Ip(e)) => {
                assert!(
                    e.port_min >= 1 && e.port_min <= e.port_max,
                    "{line:?} -> {e:?}"
                );
                assert_eq!(
                    masked(e.addr, e.prefix_len),
                    e.addr,
                    "{line:?}: host bits set"
                );
            }
            Ok(Endpoint::Domain {
                host,
                port_min,
                port_max,
            }) => {
                assert!(
                    !host.is_empty() && port_min >= 1 && port_min <= port_max,
                    "{line:?}"
                );
            }
            Err(e) => assert!(e.starts_with("invalid "), "{line:?}: {e}"),
        }
        // The v1 → v2 rewriting keeps the peers a v1 endpoint names (a lower bound of 0 reads
        // as 1: no peer has port 0).
        if let (Ok(v1), Ok(v2)) = (StaticEndpoint::parse(line), v1_endpoint_to_v2(line)) {
            match Endpoint::parse(&v2) {
                Ok(Endpoint::Ip(e)) => {
                    assert_eq!(
                        (e.addr, e.prefix_len),
                        (v1.addr, v1.prefix_len),
                        "{line:?} -> {v2:?}"
                    );
                    assert_eq!(
                        (e.port_min, e.port_max),
                        (v1.port_min.max(1), v1.port_max),
                        "{line:?} -> {v2:?}"
                    );
                }
                other => assert!(
                    v1.port_min.max(1) > v1.port_max,
                    "{line:?} -> {v2:?} -> {other:?}: an admitting v1 endpoint does not convert"
                ),
            }
        }
        let _ = parse_http_endpoint(line, 8080);
    }
}

fn service_text(s: &ServiceEndpoint) -> String {
    if (s.port_min, s.port_max) == (1, u16::MAX) {
        s.key()
    } else {
        format!("{}:<{}-{}>", s.key(), s.port_min, s.port_max)
    }
}

fn masked(ip: IpAddr, len: u8) -> IpAddr {
    match ip {
        IpAddr::V4(a) => {
            let bits = u32::from(a);
            let mask = if len == 0 {
                0
            } else {
                u32::MAX << (32 - u32::from(len))
            };
            IpAddr::V4(Ipv4Addr::from(bits & mask))
        }
        IpAddr::V6(a) => {
            let bits = u128::from(a);
            let mask = if len == 0 {
                0
            } else {
                u128::MAX << (128 - u32::from(len))
            };
            IpAddr::V6(Ipv6Addr::from(bits & mask))
        }
    }
}

/// What every accepted config must satisfy. `revalidate`: run full validation again.
pub fn check_config(cfg: &StunnerConfig, revalidate: bool) {
    if revalidate {
        let mut again = cfg.clone();
        if let Err(e) = again.validate() {
            panic!("a validated config fails validation again: {e}\n{cfg:#?}");
        }
        assert_eq!(&again, cfg, "validation is not idempotent");
        let json = cfg.to_json();
        // `$` would be substituted again on the way back in.
        if !json.contains('$') {
            match parse_config_with_env(&json, &|_| None) {
                Ok(back) => assert_eq!(&back, cfg, "to_json does not round-trip: {json}"),
                Err(e) => panic!("to_json output does not parse: {e}\n{json}"),
            }
        }
    }
    let _ = cfg.is_zero();
    let snap = Snapshot::from_config_on_host(cfg, 1, &|_| Vec::new(), &Default::default());
    check_snapshot(cfg, &snap);
}

fn check_snapshot(cfg: &StunnerConfig, snap: &Snapshot) {
    assert_eq!(snap.listeners.len(), cfg.listeners.len());
    assert_eq!(snap.clusters.len(), cfg.clusters.len());
    let _ = snap.auth.realm();
    // Peers to probe: fixed special and global addresses, every endpoint's network and its
    // neighbours, every listener's address.
    let mut probes: Vec<IpAddr> = [
        "0.0.0.0",
        "127.0.0.1",
        "10.1.2.3",
        "169.254.169.254",
        "224.0.0.1",
        "255.255.255.255",
        "8.8.8.8",
        "::",
        "::1",
        "fe80::1",
        "ff02::1",
        "2001:db8::1",
        "::ffff:127.0.0.1",
        "64:ff9b::a01:203",
    ]
    .iter()
    .map(|s| s.parse().unwrap())
    .collect();
    let mut ports = vec![0u16, 1, 3478, 5000, 65535];
    for c in &snap.clusters {
        for e in c.endpoints.iter().take(8) {
            probes.push(e.addr);
            probes.push(next(e.addr));
            ports.push(e.port_min);
            ports.push(e.port_max);
        }
    }
    for l in &snap.listeners {
        probes.extend(l.relay.iter());
    }
    probes.truncate(64);
    ports.truncate(16);
    for l in &snap.listeners {
        let route = snap
            .route(&l.name)
            .unwrap_or_else(|| panic!("listener {:?} has no route", l.name));
        for &ip in &probes {
            let permitted = snap.permits_ip(route, ip);
            for &port in &ports {
                let Some(c) = snap.admits(route, SocketAddr::new(ip, port)) else {
                    continue;
                };
                assert!(c < snap.clusters.len());
                assert!(permitted, "{ip}:{port} admitted but not permitted");
                let routed = cfg
                    .listeners
                    .iter()
                    .find(|x| x.name == l.name)
                    .and_then(|x| cfg.turn_server(x))
                    .is_some_and(|server| server.clusters.contains(&snap.clusters[c].name));
                assert!(routed, "{ip}:{port} admitted by unrouted cluster {c}");
                let peer = SocketAddr::new(canonical_peer(ip), port);
                assert!(
                    snap.clusters[c]
                        .endpoints
                        .iter()
                        .any(|e| e.admits_ip(peer.ip()) && (!snap.enforce_ports || e.admits(peer))),
                    "{ip}:{port} admitted by cluster {c} but none of its endpoints admits it"
                );
            }
        }
    }
}

/// The address after `ip` (wrapping).
fn next(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V4(a) => IpAddr::V4(Ipv4Addr::from(u32::from(a).wrapping_add(1))),
        IpAddr::V6(a) => IpAddr::V6(Ipv6Addr::from(u128::from(a).wrapping_add(1))),
    }
}

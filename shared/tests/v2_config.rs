//! STUNner v2 configs and the one model both versions are read into: v2 defaults and
//! validation, what uturn refuses, the v1 → v2 conversion (STUNner v2's rules), and what the
//! snapshot makes of each version (peer ports, relay addresses per family, routing policy).

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use uturn_shared::config::*;
use uturn_shared::snapshot::{Host, RelayAddresses, Snapshot};

fn env_of(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |key| vars.get(key).cloned()
}

fn parse(text: &str) -> Result<StunnerConfig, ConfigError> {
    parse_config_with_env(text, &|_| None)
}

fn parse_ok(text: &str) -> StunnerConfig {
    parse(text).unwrap_or_else(|e| panic!("config should parse: {e}\n{text}"))
}

fn pem_b64(label: &str) -> String {
    use base64::Engine as _;
    let pem = format!("-----BEGIN {label}-----\nMIIB\n-----END {label}-----\n");
    base64::engine::general_purpose::STANDARD.encode(pem)
}

/// A v2 document with static auth and `body` (JSON members after `auth`).
fn v2_with(body: &str) -> String {
    format!(
        r#"{{"version": "v2", "auth": {{"credentials": {{"username": "u", "password": "p"}}}}{}{body}}}"#,
        if body.is_empty() { "" } else { ", " }
    )
}

const MINIMAL: &str = r#"
version: v2
auth:
  type: static
  credentials: {username: alice, password: s3cret}
listeners:
  - name: udp
    protocol: UDP
    servers: [turn]
servers:
  - name: turn
    clusters: [media]
clusters:
  - name: media
    protocol: UDP
    endpoints: ["10.0.0.0/8"]
    addresses: ["192.0.2.10"]
"#;

#[test]
fn minimal_v2_config_gets_every_default() {
    let config = parse_ok(MINIMAL);
    assert_eq!(config.version, "v2");
    assert_eq!(config.source_version(), "v2");
    assert_eq!(config.admin.name, "default-stunnerd");
    assert_eq!(config.admin.loglevel, "all:INFO");
    assert_eq!(
        config.admin.healthcheck_endpoint.as_deref(),
        Some("http://:8086")
    );
    assert_eq!(config.admin.offload_engine, "None");
    assert_eq!(config.auth.realm, "stunner.l7mp.io");
    let listener = &config.listeners[0];
    assert_eq!(
        (listener.protocol, listener.port, listener.address.as_str()),
        (Transport::Udp, 3478, "")
    );
    assert_eq!(config.servers[0].server_type, ServerType::Turn);
    let cluster = &config.clusters[0];
    assert_eq!(cluster.cluster_type, ClusterType::Static);
    assert_eq!(cluster.routing_policy, RoutingPolicy::Filter);
    assert_eq!(cluster.protocol, ClusterProtocol::Udp);
    // The JSON written back reads the same.
    assert_eq!(parse_ok(&config.to_json()), config);
    assert!(config.to_json().contains(r#""version":"v2""#));
    assert!(
        config
            .to_json()
            .contains(r#""servers":[{"name":"turn","type":"turn","clusters":["media"]}]"#),
        "{}",
        config.to_json()
    );
}

#[test]
fn dual_stack_example_expands_addresses_and_reads_both_formats() {
    let json = format!(
        r#"{{
  "version": "v2",
  "admin": {{ "name": "stunner/udp-gateway", "metrics_endpoint": "http://:8080/metrics" }},
  "auth": {{ "type": "ephemeral", "credentials": {{ "secret": "my-shared-secret" }} }},
  "listeners": [
    {{ "name": "stunner/udp-gateway/udp-listener", "protocol": "UDP", "port": 3478,
       "public_addresses": ["198.51.100.7", "2001:db8:1::7"],
       "servers": ["stunner/udp-gateway/udp-listener"] }},
    {{ "name": "stunner/udp-gateway/tls-listener", "protocol": "tls", "port": 443,
       "cert": "{cert}", "key": "{key}", "pqc_mode": "Preferred",
       "servers": ["stunner/udp-gateway/tls-listener"] }}
  ],
  "servers": [
    {{ "name": "stunner/udp-gateway/udp-listener", "type": "turn", "clusters": ["media/rtp"] }},
    {{ "name": "stunner/udp-gateway/tls-listener", "type": "TURN",
       "clusters": ["media/rtp", "media/sfu-dns"] }}
  ],
  "clusters": [
    {{ "name": "media/rtp", "type": "STATIC", "protocol": "UDP", "routing_policy": "FILTER",
       "endpoints": ["10.76.1.3", "10.80.0.0/16:10000-20000", "fd00:10::/64"],
       "addresses": ["$STUNNER_ADDRS"] }},
    {{ "name": "media/sfu-dns", "type": "strict_dns", "protocol": "udp",
       "endpoints": ["sfu.media.svc.cluster.local"], "addresses": ["$STUNNER_ADDRS"] }}
  ]
}}"#,
        cert = pem_b64("CERTIFICATE"),
        key = pem_b64("PRIVATE KEY")
    );
    let env = env_of(&[("STUNNER_ADDRS", "10.244.1.5,fd00:244::5")]);
    let config = parse_config_with_env(&json, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.clusters[0].addresses, ["10.244.1.5", "fd00:244::5"]);
    assert_eq!(config.listeners[1].protocol, Transport::Tls);
    assert_eq!(config.listeners[1].pqc_mode, "preferred");
    assert_eq!(config.servers[1].server_type, ServerType::Turn);
    assert_eq!(config.clusters[1].cluster_type, ClusterType::StrictDns);
    // Endpoints are sorted.
    assert_eq!(
        config.clusters[0].endpoints,
        ["10.76.1.3", "10.80.0.0/16:10000-20000", "fd00:10::/64"]
    );
    // The same document as YAML reads the same.
    let yaml = serde_norway::to_string(&serde_json::from_str::<serde_json::Value>(&json).unwrap())
        .unwrap();
    assert_eq!(parse_config_with_env(&yaml, &env).unwrap(), config);
    // Both relay families come from the cluster; the TLS listener relays through media/rtp,
    // the first of its clusters that makes UDP relays.
    let snap = Snapshot::from_config_on_host(&config, 1, &|_| Vec::new(), &Host::default());
    for listener in &snap.listeners {
        assert_eq!(listener.relay.to_string(), "10.244.1.5, fd00:244::5");
        assert_eq!(listener.bind, None);
    }
    assert_eq!(
        snap.listeners[1].protocol,
        ListenerProtocol::TurnTls,
        "a TLS listener feeding a TURN server serves TURN-TLS"
    );
}

#[test]
fn v2_validation_names_field_value_and_fix() {
    let cases: &[(&str, &str, &str)] = &[
        (
            r#""listeners": [{"name": "l", "protocol": "TURN-UDP", "servers": []}]"#,
            "listeners[0].protocol",
            "TURN-UDP is written UDP",
        ),
        (
            r#""listeners": [{"protocol": "UDP"}]"#,
            "listeners[0].name",
            "missing name in listener",
        ),
        (
            r#""listeners": [{"name": "l", "port": 70000}]"#,
            "listeners[0].port",
            "must be 1-65535",
        ),
        (
            r#""listeners": [{"name": "l", "pqc_mode": "always"}]"#,
            "listeners[0].pqc_mode",
            "unknown PQC mode",
        ),
        (
            r#""listeners": [{"name": "l", "address": "gw.example.com"}]"#,
            "listeners[0].address",
            "bind address must be an IP",
        ),
        (
            r#""listeners": [{"name": "l", "protocol": "TLS"}]"#,
            "listeners[0].cert",
            "base64",
        ),
        (
            r#""listeners": [{"name": "a"}, {"name": "a"}]"#,
            "listeners[1].name",
            "duplicate listener name",
        ),
        (
            r#""servers": [{"name": "s", "type": "proxy"}]"#,
            "servers[0].type",
            "unknown server type",
        ),
        (
            r#""servers": [{"name": "s"}, {"name": "s"}]"#,
            "servers[1].name",
            "duplicate server name",
        ),
        (
            r#""clusters": [{"name": "c", "endpoints": ["10.0.0.1"]}]"#,
            "clusters[0].protocol",
            "must name its protocol",
        ),
        (
            r#""clusters": [{"name": "c", "protocol": "TURN-UDP"}]"#,
            "clusters[0].protocol",
            "unknown cluster protocol",
        ),
        (
            r#""clusters": [{"name": "c", "protocol": "UDP", "routing_policy": "RANDOM"}]"#,
            "clusters[0].routing_policy",
            "unknown routing policy",
        ),
        (
            r#""clusters": [{"name": "c", "protocol": "UDP", "type": "EDS"}]"#,
            "clusters[0].type",
            "unknown cluster type",
        ),
        (
            r#""clusters": [{"name": "c", "protocol": "UDP"}, {"name": "c", "protocol": "UDP"}]"#,
            "clusters[1].name",
            "duplicate cluster name",
        ),
        (
            r#""listeners": [{"name": "a", "servers": ["t"]}, {"name": "b", "servers": ["t"]}], "servers": [{"name": "t"}]"#,
            "listeners[1].port",
            "split the port's clients",
        ),
    ];
    for (body, field, why) in cases {
        let err = parse(&v2_with(body)).expect_err(body);
        assert_eq!(err.field, *field, "{body}: {err}");
        assert!(err.message.contains(why), "{body}: {err}");
    }
    // A listener and a server may share a name; dangling names are skipped at runtime.
    let ok = parse_ok(&v2_with(
        r#""listeners": [{"name": "x", "servers": ["x", "missing"]}], "servers": [{"name": "x", "clusters": ["missing"]}]"#,
    ));
    assert_eq!(ok.listeners[0].name, ok.servers[0].name);
    // Missing credentials are no error in v2: every client is refused, with a warning.
    let open = parse_ok(r#"{"version": "v2", "auth": {"type": "ephemeral"}}"#);
    assert!(
        open.warnings()
            .iter()
            .any(|w| w.contains("every client is refused")),
        "{:?}",
        open.warnings()
    );
    // v1 keys in a v2 document are dropped.
    let dropped = parse_ok(&v2_with(
        r#""listeners": [{"name": "l", "routes": ["c"], "servers": []}]"#,
    ));
    assert!(dropped.listeners[0].servers.is_empty());
}

#[test]
fn v2_endpoints_parse_every_form_and_refuse_the_rest() {
    let ok: &[(&str, Endpoint)] = &[
        ("10.1.0.7", ip("10.1.0.7", 32, 1, 65535)),
        ("2001:db8::7", ip("2001:db8::7", 128, 1, 65535)),
        ("[2001:db8::7]", ip("2001:db8::7", 128, 1, 65535)),
        ("10.1.0.0/16", ip("10.1.0.0", 16, 1, 65535)),
        ("::/0", ip("::", 0, 1, 65535)),
        ("10.1.0.7:5000", ip("10.1.0.7", 32, 5000, 5000)),
        ("10.1.0.0/16:5000", ip("10.1.0.0", 16, 5000, 5000)),
        ("[2001:db8::7]:5000", ip("2001:db8::7", 128, 5000, 5000)),
        ("10.2.3.4:5000-5100", ip("10.2.3.4", 32, 5000, 5100)),
        (
            "[2001:db8::/32]:5000-6000",
            ip("2001:db8::", 32, 5000, 6000),
        ),
        ("10.2.3.4:1-65535", ip("10.2.3.4", 32, 1, 65535)),
        (
            "media.default.svc",
            Endpoint::Domain {
                host: "media.default.svc".into(),
                port_min: 1,
                port_max: 65535,
            },
        ),
        (
            "media.default.svc:5000",
            Endpoint::Domain {
                host: "media.default.svc".into(),
                port_min: 5000,
                port_max: 5000,
            },
        ),
    ];
    for (text, want) in ok {
        assert_eq!(Endpoint::parse(text).as_ref(), Ok(want), "{text}");
    }
    let bad: &[(&str, &str)] = &[
        ("", "empty host"),
        ("[]:5000", "empty host"),
        (":5000", "empty host"),
        ("10.0.0.1:0", "invalid port"),
        ("10.0.0.1:70000", "invalid port"),
        ("10.0.0.1:http", "invalid port"),
        ("10.0.0.1:6000-5000", "invalid port range"),
        ("10.0.0.1:5000-70000", "invalid port range"),
        ("10.1.0.0/40", "invalid endpoint"),
        ("tcp://10.0.0.1", "invalid endpoint"),
        // v1's form is not v2's: only the converter rewrites it.
        ("10.0.0.1:<5000-6000>", "invalid port"),
        ("not a host", "invalid endpoint"),
    ];
    for (text, why) in bad {
        let err = Endpoint::parse(text).expect_err(text);
        assert!(err.contains(why), "{text}: {err}");
        assert!(err.starts_with("invalid "), "{text}: {err}");
    }
    // In a config the error names the endpoint.
    let err = parse(&v2_with(
        r#""clusters": [{"name": "c", "protocol": "UDP", "endpoints": ["10.0.0.1", "10.0.0.2:0"]}]"#,
    ))
    .unwrap_err();
    assert_eq!(
        (err.field.as_str(), err.value.as_str()),
        ("clusters[0].endpoints[1]", "10.0.0.2:0")
    );
}

fn ip(addr: &str, prefix_len: u8, port_min: u16, port_max: u16) -> Endpoint {
    Endpoint::Ip(StaticEndpoint {
        addr: addr.parse().unwrap(),
        prefix_len,
        port_min,
        port_max,
    })
}

/// What uturn does not serve is refused with the object named, in both versions.
#[test]
fn l4_servers_tunnels_and_stdin_listeners_are_refused() {
    let cases: &[(String, &str, &str)] = &[
        (
            v2_with(r#""servers": [{"name": "proxy", "type": "L4", "clusters": []}]"#),
            "servers[0].type",
            "server \"proxy\": uturn serves TURN only",
        ),
        (
            v2_with(
                r#""clusters": [{"name": "up", "protocol": "UDP", "tunnel": {"url": "turn:10.0.0.1:3478"}}]"#,
            ),
            "clusters[0].tunnel",
            "cluster \"up\": uturn does not reach peers through an upstream TURN server",
        ),
        (
            v2_with(r#""listeners": [{"name": "in", "protocol": "stdin"}]"#),
            "listeners[0].protocol",
            "listener \"in\": uturn serves no STDIN listener",
        ),
        (
            r#"{"version": "v1", "auth": {"credentials": {"username": "u", "password": "p"}},
                "listeners": [{"name": "plain", "protocol": "UDP"}]}"#
                .to_owned(),
            "listeners[0].protocol",
            "listener \"plain\": uturn serves TURN only",
        ),
    ];
    for (text, field, why) in cases {
        let err = parse(text).expect_err(text);
        assert_eq!(err.field, *field, "{err}");
        assert!(err.message.contains(why), "{err}");
    }
}

#[test]
fn versions_other_than_v1_and_v2_are_refused() {
    for version in ["v3", "", "V2", "v2alpha1"] {
        let err = parse(&format!(r#"{{"version": "{version}"}}"#)).unwrap_err();
        assert_eq!(err.field, "version", "{version:?}");
        assert!(err.message.contains("\"v2\" or \"v1\""), "{err}");
    }
    // uturn keeps reading v1alpha1 as v1 (STUNner v2 no longer does): a v1 operator may send it.
    let old = parse_ok(
        r#"{"version": "v1alpha1", "auth": {"credentials": {"username": "u", "password": "p"}}}"#,
    );
    assert_eq!(old.source_version(), "v1");
}

/// The reference's worked example, and the cases of STUNner v2's converter test.
#[test]
fn v1_documents_convert_as_stunner_v2_converts_them() {
    let v1 = r#"{"version":"v1","admin":{"name":"ns/gw"},"auth":{"type":"static","credentials":{"username":"u","password":"p"}},"listeners":[{"name":"ns/gw/udp","protocol":"TURN-UDP","address":"10.0.0.5","port":3478,"routes":["ns/media"]}],"clusters":[{"name":"ns/media","endpoints":["10.1.0.0/16:<5000-6000>","10.2.0.9:<1-65535>"]}]}"#;
    let config = parse_ok(v1);
    assert_eq!(config.source_version(), "v1");
    let l = &config.listeners[0];
    assert_eq!(
        (l.name.as_str(), l.protocol, l.port, l.address.as_str()),
        ("ns/gw/udp", Transport::Udp, 3478, "")
    );
    assert_eq!(l.servers, ["ns/gw/udp"]);
    let s = &config.servers[0];
    assert_eq!(
        (s.name.as_str(), s.server_type, s.clusters.as_slice()),
        ("ns/gw/udp", ServerType::Turn, &["ns/media".to_owned()][..])
    );
    let c = &config.clusters[0];
    assert_eq!(
        (c.cluster_type, c.protocol, c.routing_policy),
        (
            ClusterType::Static,
            ClusterProtocol::Udp,
            RoutingPolicy::Filter
        )
    );
    assert_eq!(c.endpoints, ["10.1.0.0/16:5000-6000", "10.2.0.9"]);
    assert_eq!(c.addresses, ["10.0.0.5"]);
    // /status shows a v1 config as the v1 document it is.
    assert!(config.to_json().contains(r#""version":"v1""#));
    assert!(config.to_json().contains(r#""routes":["ns/media"]"#));

    // Relay addresses: the first IPv4 and the first IPv6 of the routing listeners, in listener
    // order; unspecified ones dropped; a placeholder kept once.
    let two = r#"
version: v1
auth: {credentials: {username: u, password: p}}
listeners:
  - {name: a, address: 0.0.0.0, routes: [c, d]}
  - {name: b, protocol: TURN-TCP, address: "fd00::5", routes: [c]}
  - {name: e, protocol: TURN-TLS, port: 443, address: "10.0.0.7", routes: [c], cert: CERT, key: KEY}
  - {name: f, protocol: TURN-DTLS, port: 443, address: "10.0.0.8", routes: [d], cert: CERT, key: KEY}
clusters:
  - {name: c, endpoints: ["2001:db8::/32:<7000-7100>", "10.0.0.1:<5000-5000>", "10.0.0.2:<0-100>"]}
  - {name: d, type: STRICT_DNS, endpoints: [media.svc]}
  - {name: k, type: KUBERNETES, endpoints: ["media/sfu:<10000-20000>"]}
"#
    .replace("CERT", &pem_b64("CERTIFICATE"))
    .replace("KEY", &pem_b64("PRIVATE KEY"));
    let config = parse_ok(&two);
    let cluster = |name: &str| config.cluster(name).unwrap();
    assert_eq!(cluster("c").addresses, ["10.0.0.7", "fd00::5"]);
    assert_eq!(cluster("d").addresses, ["10.0.0.8"]);
    assert!(cluster("k").addresses.is_empty());
    assert_eq!(
        cluster("c").endpoints,
        [
            "10.0.0.1:5000",
            "10.0.0.2:1-100",
            "[2001:db8::/32]:7000-7100"
        ]
    );
    assert_eq!(cluster("d").endpoints, ["media.svc"]);
    assert_eq!(cluster("k").endpoints, ["media/sfu:10000-20000"]);
    assert_eq!(cluster("k").routing_policy, RoutingPolicy::Filter);
    assert_eq!(config.servers[0].clusters, ["c", "d"]);

    // A v1 endpoint v2 cannot express is a conversion error naming it.
    let err = parse(
        r#"{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},"clusters":[{"name":"c","endpoints":["10.0.0.1:<6000-5000>"]}]}"#,
    )
    .unwrap_err();
    assert_eq!(err.field, "clusters[0].endpoints[0]", "{err}");
    assert!(err.message.contains("converted config is invalid"), "{err}");
}

#[test]
fn v1_and_v2_zero_configs_are_both_zero() {
    let v2_zero = r#"{"version":"v2","admin":{"name":"ns/gw"},"auth":{"type":"static","realm":"stunner.l7mp.io","credentials":{"username":"dummy-username","password":"dummy-password"}}}"#;
    let v1_zero = r#"{"version":"v1","admin":{"name":"ns/gw"},"auth":{"type":"static","realm":"stunner.l7mp.io","credentials":{"username":"dummy-username","password":"dummy-password"}},"listeners":[],"clusters":[]}"#;
    for text in [v2_zero, v1_zero] {
        assert!(parse_ok(text).is_zero(), "{text}");
    }
    let zero = StunnerConfig::zero("ns/gw");
    assert_eq!(parse_ok(v2_zero), zero);
    let mut converted = parse_ok(v1_zero);
    converted.v1 = None;
    assert_eq!(converted, zero);
    // The v2 zero config leaves its empty lists out.
    assert!(!zero.to_json().contains("listeners"), "{}", zero.to_json());
    assert!(!parse_ok(MINIMAL).is_zero());
}

fn verdicts(snap: &Snapshot, listener: &str, peer: &str) -> (bool, bool) {
    let route = snap.route(listener).unwrap();
    let peer: SocketAddr = peer.parse().unwrap();
    (
        snap.permits_ip(route, peer.ip()),
        snap.admits(route, peer).is_some(),
    )
}

/// v1 enforces its port ranges on every datagram; v2 admits by IP only (STUNner v2: "a port
/// range is accepted and ignored"), and a ROUND_ROBIN cluster admits no TURN peer.
#[test]
fn peer_admission_follows_the_version() {
    let v1 = parse_ok(
        r#"{"version":"v1","auth":{"credentials":{"username":"u","password":"p"}},
            "listeners":[{"name":"l","routes":["c"]}],
            "clusters":[{"name":"c","endpoints":["10.0.0.0/8:<5000-6000>"]}]}"#,
    );
    let snap = Snapshot::from_config_on_host(&v1, 1, &|_| Vec::new(), &Host::default());
    assert_eq!(verdicts(&snap, "l", "10.1.2.3:5500"), (true, true));
    assert_eq!(verdicts(&snap, "l", "10.1.2.3:7000"), (true, false));
    assert_eq!(verdicts(&snap, "l", "11.1.2.3:5500"), (false, false));

    let v2 = parse_ok(&v2_with(
        r#""listeners": [{"name": "l", "servers": ["t"]}],
           "servers": [{"name": "t", "clusters": ["rr", "c"]}],
           "clusters": [{"name": "c", "protocol": "UDP", "endpoints": ["10.0.0.0/8:5000-6000"]},
                        {"name": "rr", "protocol": "UDP", "routing_policy": "ROUND_ROBIN",
                         "endpoints": ["11.0.0.1:3478"], "addresses": ["192.0.2.1"]}]"#,
    ));
    let snap = Snapshot::from_config_on_host(&v2, 1, &|_| Vec::new(), &Host::default());
    assert_eq!(verdicts(&snap, "l", "10.1.2.3:5500"), (true, true));
    assert_eq!(verdicts(&snap, "l", "10.1.2.3:7000"), (true, true));
    assert_eq!(verdicts(&snap, "l", "11.0.0.1:3478"), (false, false));
    // The ROUND_ROBIN cluster is the first UDP one: it still gives the relay address.
    assert_eq!(snap.listeners[0].relay.to_string(), "192.0.2.1");
    let warnings = v2.warnings();
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("the port of endpoint \"10.0.0.0/8:5000-6000\" is not enforced")),
        "{warnings:?}"
    );
    assert!(warnings.iter().any(|w| w.contains("ROUND_ROBIN")));
}

/// The relay address of each family: the cluster's `addresses`, then STUNNER_ADDRS /
/// STUNNER_ADDR, then IPv4 on the relay socket's wildcard. The bind address is the
/// listener's `address`.
#[test]
fn relay_addresses_come_from_the_cluster_then_the_environment() {
    let config = |addresses: &str| {
        parse_ok(&v2_with(&format!(
            r#""listeners": [{{"name": "l", "address": "127.0.0.1", "servers": ["t"]}}],
               "servers": [{{"name": "t", "clusters": ["tcp", "c"]}}],
               "clusters": [{{"name": "tcp", "protocol": "TCP", "addresses": ["203.0.113.9"]}},
                            {{"name": "c", "protocol": "UDP", "addresses": [{addresses}]}}]"#
        )))
    };
    let host = |addrs: &str| Host {
        ips: Vec::new(),
        relay: RelayAddresses::from_env(&env_of(&[("STUNNER_ADDRS", addrs)])),
    };
    let relay = |addresses: &str, env: &str| {
        let snap =
            Snapshot::from_config_on_host(&config(addresses), 1, &|_| Vec::new(), &host(env));
        assert_eq!(
            snap.listeners[0].bind,
            Some("127.0.0.1".parse::<IpAddr>().unwrap())
        );
        snap.listeners[0].relay.to_string()
    };
    assert_eq!(relay(r#""192.0.2.10""#, ""), "192.0.2.10");
    assert_eq!(
        relay(r#""192.0.2.10,2001:db8::10""#, ""),
        "192.0.2.10, 2001:db8::10"
    );
    assert_eq!(relay(r#""2001:db8::10""#, ""), "2001:db8::10");
    assert_eq!(
        relay(r#""192.0.2.10""#, "10.244.1.5,fd00::5"),
        "192.0.2.10, fd00::5"
    );
    assert_eq!(
        relay(r#""$UNSET""#, "10.244.1.5,fd00::5"),
        "10.244.1.5, fd00::5"
    );
    assert_eq!(relay(r#""0.0.0.0""#, ""), "0.0.0.0");
}

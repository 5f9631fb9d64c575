//! Scenarios for the stunnerd v1 config: defaults, aliases, key matching, env substitution,
//! validation errors, endpoints, TURN URIs, the zero config and admin HTTP endpoints.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use uturn_shared::config::*;

fn no_env(_: &str) -> Option<String> {
    None
}

fn with_env(vars: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let vars: HashMap<String, String> = vars
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |key| vars.get(key).cloned()
}

/// The v1 document as validated (the model's conversion is tested in `v2_config.rs`).
fn parse(text: &str) -> Result<v1::StunnerDocument, ConfigError> {
    v1::parse_config_with_env(text, &no_env)
}

/// The running model of a v1 or v2 document.
fn model(text: &str) -> StunnerConfig {
    parse_config_with_env(text, &no_env)
        .unwrap_or_else(|e| panic!("config should parse: {e}\n{text}"))
}

fn parse_ok(text: &str) -> v1::StunnerDocument {
    match parse(text) {
        Ok(config) => config,
        Err(e) => panic!("config should parse: {e}\n{text}"),
    }
}

const STATIC_AUTH: &str = r#""auth": {"credentials": {"username": "u", "password": "p"}}"#;

fn json_with(body: &str) -> String {
    format!(r#"{{"version": "v1", {STATIC_AUTH}, {body}}}"#)
}

fn pem_b64(label: &str) -> String {
    use base64::Engine as _;
    let pem = format!("-----BEGIN {label}-----\nMIIB\n-----END {label}-----\n");
    base64::engine::general_purpose::STANDARD.encode(pem)
}

#[test]
fn minimal_config_gets_every_default() {
    let config = parse_ok(
        "version: v1\nauth:\n  credentials: {username: u, password: p}\nlisteners:\n  - name: l\nclusters:\n  - name: c\n",
    );
    assert_eq!(config.version, "v1");
    assert_eq!(config.admin.name, "default-stunnerd");
    assert_eq!(config.admin.loglevel, "all:INFO");
    assert_eq!(config.admin.metrics_endpoint, "");
    assert_eq!(
        config.admin.healthcheck_endpoint.as_deref(),
        Some("http://:8086")
    );
    assert_eq!(config.admin.user_quota, 0);
    assert_eq!(config.admin.offload_engine, "None");
    assert!(config.admin.offload_interfaces.is_empty());
    assert_eq!(config.admin.license_config, None);
    assert_eq!(config.auth.auth_type, AuthType::Static);
    assert_eq!(config.auth.realm, "stunner.l7mp.io");
    let listener = &config.listeners[0];
    assert_eq!(listener.protocol, ListenerProtocol::TurnUdp);
    assert_eq!(listener.address, "0.0.0.0");
    assert_eq!(listener.port, 3478);
    assert!(listener.routes.is_empty());
    let cluster = &config.clusters[0];
    assert_eq!(cluster.cluster_type, ClusterType::Static);
    assert_eq!(cluster.protocol, ClusterProtocol::Udp);
    assert!(cluster.endpoints.is_empty());
}

#[test]
fn missing_sections_become_empty() {
    let config = parse_ok(&format!(r#"{{"version": "v1", {STATIC_AUTH}}}"#));
    assert!(config.listeners.is_empty());
    assert!(config.clusters.is_empty());
    let config = parse_ok(&json_with(
        r#""listeners": null, "clusters": null, "admin": null"#,
    ));
    assert!(config.listeners.is_empty());
    assert_eq!(config.admin.name, "default-stunnerd");
}

#[test]
fn reference_json_example_parses() {
    let cert = pem_b64("CERTIFICATE");
    let key = pem_b64("PRIVATE KEY");
    let text = format!(
        r#"{{
  "version": "v1",
  "admin": {{"name": "stunner/udp-gateway", "loglevel": "all:INFO",
    "metrics_endpoint": "http://:8080/metrics", "healthcheck_endpoint": "http://:8086",
    "offload_engine": "None"}},
  "auth": {{"type": "ephemeral", "realm": "stunner.l7mp.io",
    "credentials": {{"secret": "my-shared-secret"}}}},
  "listeners": [
    {{"name": "stunner/udp-gateway/udp-listener", "protocol": "TURN-UDP",
      "public_address": "34.118.88.91", "public_port": 3478, "address": "$STUNNER_ADDR",
      "port": 3478, "routes": ["media-plane/media-route"]}},
    {{"name": "stunner/udp-gateway/tls-listener", "protocol": "TURN-TLS",
      "public_address": "34.118.88.91", "public_port": 5349, "address": "$STUNNER_ADDR",
      "port": 5349, "cert": "{cert}", "key": "{key}", "routes": ["media-plane/media-route"]}}
  ],
  "clusters": [
    {{"name": "media-plane/media-route", "type": "STATIC", "protocol": "UDP",
      "endpoints": ["10.76.1.3", "10.80.7.104", "10.120.5.36", "10.0.8.0/24:<10000-20000>"]}}
  ]
}}"#
    );
    let config = v1::parse_config_with_env(&text, &with_env(&[("STUNNER_ADDR", "10.1.2.3")]))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.auth.auth_type, AuthType::Ephemeral);
    assert_eq!(config.listeners[0].address, "10.1.2.3");
    assert_eq!(config.listeners[0].public_port, 3478);
    assert_eq!(config.listeners[1].protocol, ListenerProtocol::TurnTls);
    assert_eq!(config.listeners[1].port, 5349);
    assert_eq!(
        config.clusters[0].endpoints,
        [
            "10.0.8.0/24:<10000-20000>",
            "10.120.5.36",
            "10.76.1.3",
            "10.80.7.104"
        ]
    );
}

#[test]
fn reference_yaml_example_parses() {
    let text = r#"
version: v1
admin:
  name: my-stunnerd
  loglevel: all:INFO,turn:WARN
  healthcheck_endpoint: "http://:8086"
  metrics_endpoint: "http://0.0.0.0:8080/metrics"
auth:
  type: static            # or: plaintext / ephemeral / longterm
  realm: stunner.l7mp.io
  credentials:
    username: user-1
    password: "pa$$word"  # not env-expanded
listeners:
  - name: udp-listener
    protocol: TURN-UDP
    address: "$STUNNER_ADDR"   # advertised relay IP
    port: 3478
    routes: [media, dns-media]
  - name: tcp-listener
    protocol: TURN-TCP
    address: "$STUNNER_ADDR"
    port: 3478
    routes: [media]
clusters:
  - name: media
    type: STATIC
    endpoints: ["10.0.0.0/16", "192.168.1.10:<40000-49999>"]
  - name: dns-media
    type: STRICT_DNS
    endpoints: ["media.default.svc.cluster.local"]
"#;
    let config = v1::parse_config_with_env(text, &with_env(&[("STUNNER_ADDR", "::1")]))
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.admin.loglevel, "all:INFO,turn:WARN");
    assert_eq!(config.auth.credentials["password"], "pa$$word");
    assert_eq!(config.listeners[0].address, "::1");
    assert_eq!(config.listeners[0].routes, ["dns-media", "media"]);
    assert_eq!(config.clusters[1].cluster_type, ClusterType::StrictDns);
}

#[test]
fn auth_types_and_aliases_are_case_sensitive() {
    let cases = [
        ("static", Some(AuthType::Static)),
        ("plaintext", Some(AuthType::Static)),
        ("ephemeral", Some(AuthType::Ephemeral)),
        ("longterm", Some(AuthType::Ephemeral)),
        ("none", Some(AuthType::None)),
        ("", Some(AuthType::Static)),
        ("Static", None),
        ("EPHEMERAL", None),
        ("timewindowed", None),
    ];
    for (raw, want) in cases {
        let text = format!(
            r#"{{"version": "v1", "auth": {{"type": "{raw}",
               "credentials": {{"username": "u", "password": "p", "secret": "s"}}}}}}"#
        );
        match (parse(&text), want) {
            (Ok(config), Some(want)) => assert_eq!(config.auth.auth_type, want, "{raw:?}"),
            (Err(e), None) => {
                assert_eq!(e.field, "auth.type", "{raw:?}");
                assert_eq!(e.value, raw);
            }
            (got, want) => panic!("type {raw:?}: got {got:?}, want {want:?}"),
        }
    }
    let config = parse_ok(
        r#"{"version": "v1", "auth": {"type": "plaintext", "credentials": {"username": "u", "password": "p"}}}"#,
    );
    assert!(config.to_json().contains(r#""type":"static""#));
}

#[test]
fn enum_fields_parse_case_insensitively_and_normalize() {
    let cases = [
        ("turn-udp", ListenerProtocol::TurnUdp),
        ("TURN-TCP", ListenerProtocol::TurnTcp),
        ("Turn-Tcp", ListenerProtocol::TurnTcp),
        ("udp", ListenerProtocol::Udp),
        ("tcp", ListenerProtocol::Tcp),
        ("", ListenerProtocol::TurnUdp),
    ];
    for (raw, want) in cases {
        let config = parse_ok(&json_with(&format!(
            r#""listeners": [{{"name": "l", "protocol": "{raw}"}}]"#
        )));
        assert_eq!(config.listeners[0].protocol, want, "{raw:?}");
    }
    let config = parse_ok(&json_with(
        r#""clusters": [{"name": "a", "type": "strict_dns", "protocol": "tcp"},
                        {"name": "b", "type": "Static", "protocol": "Udp"}]"#,
    ));
    assert_eq!(config.clusters[0].cluster_type, ClusterType::StrictDns);
    assert_eq!(config.clusters[0].protocol, ClusterProtocol::Tcp);
    assert_eq!(config.clusters[1].cluster_type, ClusterType::Static);
    let json = config.to_json();
    assert!(
        json.contains(r#""type":"STRICT_DNS","protocol":"TCP""#),
        "{json}"
    );
    assert_eq!(
        ListenerProtocol::parse("TURN-UDP").map(|p| p.as_str()),
        Some("TURN-UDP")
    );
    assert!(ListenerProtocol::TurnTls.needs_cert() && !ListenerProtocol::Udp.is_turn());
}

#[test]
fn keys_match_case_insensitively_but_underscores_matter() {
    let config = parse_ok(
        r#"
Version: v1
ADMIN:
  Name: n
  logLevel: all:DEBUG
  metricsEndpoint: "http://:9999"
  Metrics_Endpoint: "http://:8080/metrics"
Auth:
  Type: static
  Credentials: {username: u, password: p}
Listeners:
  - NAME: l
    Port: 1234
"#,
    );
    assert_eq!(config.admin.name, "n");
    assert_eq!(config.admin.loglevel, "all:DEBUG");
    assert_eq!(config.admin.metrics_endpoint, "http://:8080/metrics");
    assert_eq!(config.listeners[0].port, 1234);
}

#[test]
fn unknown_keys_and_nulls_are_ignored() {
    let config = parse_ok(
        r#"
version: v1alpha1
extra: {anything: [1, 2]}
admin:
  name: null
  loglevel: ~
  healthcheck_endpoint: null
  future_field: 7
auth:
  credentials: {username: u, password: p}
listeners:
  - name: l
    min_relay_port: 10000
    max_relay_port: 20000
    address: null
    port: null
"#,
    );
    assert_eq!(config.version, "v1");
    assert_eq!(config.admin.name, "default-stunnerd");
    assert_eq!(
        config.admin.healthcheck_endpoint.as_deref(),
        Some("http://:8086")
    );
    assert_eq!(config.listeners[0].address, "0.0.0.0");
    assert_eq!(config.listeners[0].port, 3478);
}

/// What a typo does in a config that still runs: each is a warning naming the key or value,
/// where it is, and the fix (the running config is not refused: stunnerd runs these too).
#[test]
fn typos_that_still_run_are_warned_about_with_their_fix() {
    let config = model(
        r#"
version: v1
admin: {loglevel: "all:INFOO,stunerd:DEBUG"}
auth: {credentials: {username: u, password: p}}
listeners:
  - {name: l, protcol: TURN-TCP, adress: 10.0.0.1, port: 0, routes: [media, medai-server]}
clusters:
  - {name: media-server, endpoints: [10.0.0.0/8]}
"#,
    );
    // The typo is ignored, as stunnerd ignores it: a UDP listener on 3478 that advertises
    // 0.0.0.0.
    assert_eq!(config.listeners[0].protocol, Transport::Udp);
    assert_eq!(config.listeners[0].port, 3478);
    let warnings = config.warnings_with_env(&no_env);
    let find = |needle: &str| {
        warnings
            .iter()
            .find(|w| w.contains(needle))
            .unwrap_or_else(|| panic!("no warning with {needle:?}: {warnings:#?}"))
    };
    assert!(find("\"listeners[0].protcol\"").contains("did you mean \"protocol\"?"));
    assert!(find("\"listeners[0].adress\"").contains("did you mean \"address\"?"));
    assert!(find("listeners[0].port is 0").contains("leave the key out for 3478"));
    assert!(find("route \"media\"").contains("add a cluster named \"media\""));
    assert!(find("route \"medai-server\"").contains("did you mean \"media-server\"?"));
    assert!(find("all:INFOO").contains("did you mean INFO?"));
    assert!(find("\"stunerd\"").contains("did you mean stunnerd?"));
    assert!(find("no relay address is configured").contains("STUNNER_ADDR"));
    assert_eq!(warnings.len(), 8, "{warnings:#?}");
    // STUNNER_ADDR gives the relay address: that warning goes.
    let with_addr = config.warnings_with_env(&with_env(&[("STUNNER_ADDR", "10.1.2.3")]));
    assert_eq!(with_addr.len(), 7, "{with_addr:#?}");

    // v2: a server's cluster and a listener's server that do not exist.
    let v2 = model(
        r#"
version: v2
auth: {credentials: {username: u, password: p}}
listeners: [{name: l, servers: [s, t]}]
servers: [{name: s, clusters: [c, d]}]
clusters: [{name: c, protocol: UDP, endpoints: [10.0.0.0/8], addresses: [10.0.0.1]}]
"#,
    );
    let warnings = v2.warnings_with_env(&no_env);
    assert_eq!(warnings.len(), 2, "{warnings:#?}");
    assert!(
        warnings[0].contains("server \"t\" is not in servers (s)"),
        "{warnings:#?}"
    );
    assert!(
        warnings[1].contains("servers[0] \"s\": cluster \"d\" names no cluster of the config (c)"),
        "{warnings:#?}"
    );

    // A clean config has none.
    let clean = model(&json_with(
        r#""listeners": [{"name": "l", "address": "10.0.0.1", "routes": ["c"]}],
           "clusters": [{"name": "c", "endpoints": ["10.0.0.0/8"]}]"#,
    ));
    assert_eq!(clean.warnings_with_env(&no_env), Vec::<String>::new());
}

#[test]
fn version_must_be_v1_or_v1alpha1() {
    for version in ["v2", "V1", "", "v1beta1"] {
        let text = format!(r#"{{"version": "{version}", {STATIC_AUTH}}}"#);
        let e = parse(&text).expect_err(version);
        assert_eq!(e.field, "version");
        assert_eq!(e.value, version);
    }
    let e = parse("{}").expect_err("no version");
    assert_eq!(e.field, "version");
    assert_eq!(parse("").expect_err("empty").field, "version");
    assert_eq!(parse("version: 1").expect_err("number").field, "version");
    let config = parse_ok(&format!(r#"{{"version": "v1alpha1", {STATIC_AUTH}}}"#));
    assert_eq!(config.version, "v1");
}

#[test]
fn env_is_expanded_everywhere_but_credentials() {
    let text = r#"
version: v1
admin:
  name: $NAME
  loglevel: "${LEVEL}"
auth:
  credentials:
    username: $USER
    password: pa$$w${0}rd$HOME
listeners:
  - name: l-${NAME}
    address: $STUNNER_ADDR
    routes: ["$UNSET_ROUTE", c]
"#;
    let env = with_env(&[
        ("NAME", "gw"),
        ("LEVEL", "all:TRACE"),
        ("USER", "expanded-user"),
        ("HOME", "/root"),
        ("STUNNER_ADDR", "192.0.2.7"),
    ]);
    let config = v1::parse_config_with_env(text, &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.admin.name, "gw");
    assert_eq!(config.admin.loglevel, "all:TRACE");
    assert_eq!(config.auth.credentials["username"], "$USER");
    assert_eq!(config.auth.credentials["password"], "pa$$w${0}rd$HOME");
    assert_eq!(config.listeners[0].name, "l-gw");
    assert_eq!(config.listeners[0].address, "192.0.2.7");
    // An unset variable is empty.
    assert_eq!(config.listeners[0].routes, ["", "c"]);
}

/// Found by the `cds_message` fuzz target: a `$` in a credentials key expanded into a second
/// key beside the literal one, so the config written back as JSON read differently.
#[test]
fn credential_keys_are_literal_too() {
    let text = r#"{"version": "v1", "auth": {"type": "static", "realm": "r",
        "credentials": {"username": "u", "password": "p", "note$HOME": "n"}}, "listeners": [], "clusters": []}"#;
    let env = with_env(&[("HOME", "word")]);
    let config = v1::parse_config_with_env(text, &env).unwrap_or_else(|e| panic!("{e}"));
    let keys: Vec<&str> = config.auth.credentials.keys().map(String::as_str).collect();
    assert_eq!(keys, ["note$HOME", "password", "username"]);
    let again =
        v1::parse_config_with_env(&config.to_json(), &env).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(again, config);
}

#[test]
fn unset_stunner_addr_falls_back_to_the_default_address() {
    let text = json_with(r#""listeners": [{"name": "l", "address": "$STUNNER_ADDR"}]"#);
    assert_eq!(parse_ok(&text).listeners[0].address, "0.0.0.0");
}

#[test]
fn stunner_port_defaults_from_public_port_or_3478() {
    let text = "version: v1\nauth: {credentials: {username: u, password: p}}\n\
                listeners:\n  - {name: a, port: $STUNNER_PORT}\n  - {name: b, protocol: TURN-TCP, port: \"${STUNNER_PORT}\"}\n";
    let cases: &[(&[(&str, &str)], u16)] = &[
        (&[], 3478),
        (&[("STUNNER_PORT", "4000")], 4000),
        (
            &[("STUNNER_PORT", "4000"), ("STUNNER_PUBLIC_PORT", "5000")],
            4000,
        ),
        (
            &[("STUNNER_PORT", "abc"), ("STUNNER_PUBLIC_PORT", "5000")],
            5000,
        ),
        (
            &[("STUNNER_PORT", ""), ("STUNNER_PUBLIC_PORT", "5001")],
            5001,
        ),
        (&[("STUNNER_PUBLIC_PORT", "5002")], 5002),
        (&[("STUNNER_PUBLIC_PORT", "x")], 3478),
        (&[("STUNNER_PORT", "-1")], 3478),
    ];
    for (vars, want) in cases {
        let config = v1::parse_config_with_env(text, &with_env(vars))
            .unwrap_or_else(|e| panic!("{vars:?}: {e}"));
        assert_eq!(config.listeners[0].port, *want, "{vars:?}");
        assert_eq!(config.listeners[1].port, *want, "{vars:?}");
    }
}

#[test]
fn listener_ports_accept_numbers_and_numeric_strings() {
    let cases: &[(&str, Result<u16, ()>)] = &[
        ("3479", Ok(3479)),
        ("\"3480\"", Ok(3480)),
        ("1", Ok(1)),
        ("65535", Ok(65535)),
        ("0", Ok(3478)),
        ("\"\"", Ok(3478)),
        ("65536", Err(())),
        ("70000", Err(())),
        ("-1", Err(())),
        ("\"http\"", Err(())),
        ("34.5", Err(())),
        ("true", Err(())),
    ];
    for (raw, want) in cases {
        let text = json_with(&format!(
            r#""listeners": [{{"name": "ok", "protocol": "TURN-TCP"}}, {{"name": "l", "port": {raw}}}]"#
        ));
        match (parse(&text), want) {
            (Ok(config), Ok(port)) => assert_eq!(config.listeners[1].port, *port, "{raw}"),
            (Err(e), Err(())) => {
                assert_eq!(e.field, "listeners[1].port", "{raw}");
                assert!(
                    e.message.contains("must be") || e.message.contains("number"),
                    "{e}"
                );
            }
            (got, want) => panic!("port {raw}: got {got:?}, want {want:?}"),
        }
    }
    let e = parse(&json_with(r#""listeners": [{"name": "l", "port": 70000}]"#)).unwrap_err();
    assert_eq!(
        e.to_string(),
        r#"invalid config: listeners[0].port = "70000": must be 1-65535: set a valid port, or leave it out for 3478"#
    );
}

#[test]
fn admin_fields_are_normalized() {
    let config = parse_ok(&json_with(
        r#""admin": {"user_quota": -5, "offload_engine": "xdp",
                     "offload_interfaces": ["eth1", "eth0"], "healthcheck_endpoint": "",
                     "license_config": {"key": "k", "hmac": "h"}}"#,
    ));
    assert_eq!(config.admin.user_quota, 0);
    assert_eq!(config.admin.offload_engine, "XDP");
    assert_eq!(config.admin.offload_interfaces, ["eth0", "eth1"]);
    assert_eq!(config.admin.healthcheck_endpoint.as_deref(), Some(""));
    assert!(config.admin.license_config.is_some());
    for (raw, want) in [
        ("none", "None"),
        ("TC", "TC"),
        ("AUTO", "Auto"),
        ("", "None"),
    ] {
        let text = json_with(&format!(r#""admin": {{"offload_engine": "{raw}"}}"#));
        assert_eq!(parse_ok(&text).admin.offload_engine, want);
    }
    let config = parse_ok(&json_with(r#""admin": {"user_quota": "7"}"#));
    assert_eq!(config.admin.user_quota, 7);
}

/// Every user-fixable error names its field path and the value.
#[test]
fn validation_errors_name_the_field() {
    let cert = pem_b64("CERTIFICATE");
    let key = pem_b64("PRIVATE KEY");
    let raw_pem = "-----BEGIN CERTIFICATE-----";
    let cases: Vec<(String, &str, &str)> = vec![
        (
            json_with(r#""admin": {"offload_engine": "DPDK"}"#),
            "admin.offload_engine",
            "DPDK",
        ),
        (
            json_with(r#""admin": {"metrics_endpoint": "ftp://x"}"#),
            "admin.metrics_endpoint",
            "ftp://x",
        ),
        (
            json_with(r#""admin": {"healthcheck_endpoint": "http://host.example:8086"}"#),
            "admin.healthcheck_endpoint",
            "http://host.example:8086",
        ),
        (json_with(r#""admin": {"name": 5}"#), "admin.name", "5"),
        (
            json_with(r#""admin": {"user_quota": "lots"}"#),
            "admin.user_quota",
            "lots",
        ),
        (
            json_with(r#""admin": {"license_config": "key"}"#),
            "admin.license_config",
            "key",
        ),
        (json_with(r#""admin": []"#), "admin", "[]"),
        (
            r#"{"version": "v1", "auth": {"credentials": {"username": "u"}}}"#.into(),
            "auth.credentials.password",
            "",
        ),
        (
            r#"{"version": "v1", "auth": {"credentials": {"password": "p"}}}"#.into(),
            "auth.credentials.username",
            "",
        ),
        (
            r#"{"version": "v1"}"#.into(),
            "auth.credentials.username",
            "",
        ),
        (
            r#"{"version": "v1", "auth": {"type": "ephemeral", "credentials": {"username": "u"}}}"#
                .into(),
            "auth.credentials.secret",
            "",
        ),
        (
            r#"{"version": "v1", "auth": {"credentials": {"username": "u", "password": 1234}}}"#
                .into(),
            "auth.credentials.password",
            "(a number)",
        ),
        (
            json_with(r#""listeners": [{"protocol": "TURN-UDP"}]"#),
            "listeners[0].name",
            "",
        ),
        (
            json_with(r#""listeners": [{"name": "a"}, {"name": "b"}, {"name": "a"}]"#),
            "listeners[2].name",
            "a",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "protocol": "QUIC"}]"#),
            "listeners[0].protocol",
            "QUIC",
        ),
        (
            json_with(r#""listeners": [{"name": "a"}, {"name": "b", "address": "my-host"}]"#),
            "listeners[1].address",
            "my-host",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "address": "[::1]"}]"#),
            "listeners[0].address",
            "[::1]",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "address": "__node_address_placeholder"}]"#),
            "listeners[0].address",
            "__node_address_placeholder",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "protocol": "TURN-TLS"}]"#),
            "listeners[0].cert",
            "",
        ),
        (
            json_with(&format!(
                r#""listeners": [{{"name": "a", "protocol": "TURN-DTLS", "cert": "{cert}"}}]"#
            )),
            "listeners[0].key",
            "",
        ),
        (
            json_with(&format!(
                r#""listeners": [{{"name": "a", "protocol": "TLS", "cert": "{raw_pem}", "key": "{key}"}}]"#
            )),
            "listeners[0].cert",
            raw_pem,
        ),
        (
            json_with(&format!(
                r#""listeners": [{{"name": "a", "protocol": "DTLS", "cert": "{cert}", "key": "not base64!"}}]"#
            )),
            "listeners[0].key",
            "<11 bytes>",
        ),
        (
            json_with(&format!(
                r#""listeners": [{{"name": "a", "protocol": "TURN-TLS", "cert": "aGVsbG8=", "key": "{key}"}}]"#
            )),
            "listeners[0].cert",
            "aGVsbG8=",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "routes": "c"}]"#),
            "listeners[0].routes",
            "c",
        ),
        (
            json_with(r#""listeners": [{"name": "a", "routes": ["c", 3]}]"#),
            "listeners[0].routes[1]",
            "3",
        ),
        (
            json_with(r#""listeners": {"name": "a"}"#),
            "listeners",
            r#"{"name":"a"}"#,
        ),
        (json_with(r#""listeners": ["a"]"#), "listeners[0]", "a"),
        (
            json_with(r#""clusters": [{"endpoints": []}]"#),
            "clusters[0].name",
            "",
        ),
        (
            json_with(r#""clusters": [{"name": "c"}, {"name": "c"}]"#),
            "clusters[1].name",
            "c",
        ),
        (
            json_with(r#""clusters": [{"name": "c", "type": "EDS"}]"#),
            "clusters[0].type",
            "EDS",
        ),
        (
            json_with(r#""clusters": [{"name": "c", "protocol": "SCTP"}]"#),
            "clusters[0].protocol",
            "SCTP",
        ),
        (
            json_with(r#""clusters": [{"name": "c", "endpoints": ["10.0.0.1", "10.0.0.0/33"]}]"#),
            "clusters[0].endpoints[1]",
            "10.0.0.0/33",
        ),
        (
            json_with(r#""clusters": [{"name": "c", "endpoints": ["media.svc"]}]"#),
            "clusters[0].endpoints[0]",
            "media.svc",
        ),
        ("[1, 2]".into(), "config", "[1,2]"),
    ];
    for (text, field, value) in cases {
        match parse(&text) {
            Ok(config) => panic!("{field}: expected an error, got {config:?}"),
            Err(e) => {
                assert_eq!(e.field, field, "{e}\n{text}");
                assert_eq!(e.value, value, "{e}\n{text}");
                assert!(!e.message.is_empty());
                let shown = e.to_string();
                assert!(
                    shown.starts_with(&format!("invalid config: {field} = ")),
                    "{shown}"
                );
            }
        }
    }
}

#[test]
fn syntax_errors_say_so() {
    let e = parse("version: v1\nadmin: [unclosed\n").unwrap_err();
    assert_eq!(e.field, "");
    assert!(
        e.message.contains("YAML") && e.message.contains("line 2"),
        "{e}"
    );
    assert!(!e.message.contains("JSON"), "{e}");
    let e = parse("{\"version\" \"v1\"}").unwrap_err();
    assert!(
        e.message.starts_with("could not parse config as JSON"),
        "{e}"
    );
    assert!(e.to_string().starts_with("invalid config: could not parse"));
}

#[test]
fn json_strings_are_read_exactly_as_written() {
    // YAML 1.1 would fold U+0085 (NEL) into a line break; JSON keeps it, and so does the
    // config's own JSON, read back.
    let text = r#"{"version": "v1", "auth": {"type": "static", "credentials": {"username": "u", "password": "pqr"}}}"#;
    let raw = text.replace("\\u0085", "\u{85}");
    for text in [text, raw.as_str()] {
        let config = parse_ok(text);
        assert_eq!(config.auth.credentials["password"], "p\u{85}q\u{85}\u{85}r");
        let again = parse_ok(&config.to_json());
        assert_eq!(again, config);
    }
}

#[test]
fn tls_listener_with_base64_pem_validates() {
    let text = json_with(&format!(
        r#""listeners": [{{"name": "t", "protocol": "turn-tls", "cert": "{}", "key": "{}"}}]"#,
        pem_b64("CERTIFICATE"),
        pem_b64("EC PRIVATE KEY")
    ));
    let config = parse_ok(&text);
    assert_eq!(config.listeners[0].protocol, ListenerProtocol::TurnTls);
    // A plain UDP listener does not need a cert.
    parse_ok(&json_with(
        r#""listeners": [{"name": "u", "protocol": "UDP"}]"#,
    ));
}

#[test]
fn localhost_address_maps_to_loopback() {
    let config = parse_ok(&json_with(
        r#""listeners": [{"name": "l", "address": "localhost"}]"#,
    ));
    assert_eq!(config.listeners[0].address, "127.0.0.1");
    let config = parse_ok(&json_with(
        r#""listeners": [{"name": "l", "address": "fd00::1"}]"#,
    ));
    assert_eq!(config.listeners[0].address, "fd00::1");
}

#[test]
fn routes_and_endpoints_are_sorted_but_entries_stay_in_order() {
    let config = parse_ok(&json_with(
        r#""listeners": [{"name": "z", "routes": ["b", "a"]}, {"name": "a", "port": 3479}],
           "clusters": [{"name": "y", "endpoints": ["10.0.0.2", "10.0.0.1", "::1"]}, {"name": "x"}]"#,
    ));
    assert_eq!(config.listeners[0].name, "z");
    assert_eq!(config.listeners[0].routes, ["a", "b"]);
    assert_eq!(config.clusters[0].name, "y");
    assert_eq!(
        config.clusters[0].endpoints,
        ["10.0.0.1", "10.0.0.2", "::1"]
    );
}

#[test]
fn strict_dns_endpoints_are_not_validated() {
    let config = parse_ok(&json_with(
        r#""clusters": [{"name": "d", "type": "STRICT_DNS", "endpoints": ["media.default.svc", "not an ip"]}]"#,
    ));
    assert_eq!(config.clusters[0].endpoints.len(), 2);
}

#[test]
fn static_endpoints_parse_every_form() {
    let ip = |s: &str| s.parse::<IpAddr>().unwrap();
    let cases = [
        ("10.0.0.1", ip("10.0.0.1"), 32, 1, 65535),
        ("10.0.0.0/8", ip("10.0.0.0"), 8, 1, 65535),
        ("10.1.2.3/8", ip("10.0.0.0"), 8, 1, 65535),
        ("0.0.0.0/0", ip("0.0.0.0"), 0, 1, 65535),
        ("10.0.0.1:<5000-6000>", ip("10.0.0.1"), 32, 5000, 6000),
        (
            "10.0.8.0/24:<10000-20000>",
            ip("10.0.8.0"),
            24,
            10000,
            20000,
        ),
        ("fd00::1", ip("fd00::1"), 128, 1, 65535),
        ("fd00::/64:<1-1024>", ip("fd00::"), 64, 1, 1024),
        ("::/0", ip("::"), 0, 1, 65535),
        ("::1:<0-0>", ip("::1"), 128, 0, 0),
        ("::ffff:10.0.0.1", ip("10.0.0.1"), 32, 1, 65535),
        ("::ffff:10.0.0.0/104", ip("10.0.0.0"), 8, 1, 65535),
        ("10.0.0.1:<6000-5000>", ip("10.0.0.1"), 32, 6000, 5000),
        ("10.0.0.1:<5000-99999>", ip("10.0.0.1"), 32, 5000, 65535),
    ];
    for (input, addr, prefix_len, port_min, port_max) in cases {
        let want = StaticEndpoint {
            addr,
            prefix_len,
            port_min,
            port_max,
        };
        assert_eq!(StaticEndpoint::parse(input), Ok(want), "{input}");
    }
    for bad in [
        "",
        "10.0.0",
        "10.0.0.1/33",
        "fd00::/129",
        "10.0.0.1/",
        "10.0.0.1/-1",
        "10.0.0.1:5000",
        "10.0.0.1:<5000>",
        "10.0.0.1:<a-b>",
        "10.0.0.1:<70000-80000>",
        "[::1]",
        "fe80::1%eth0",
        "example.com",
        "010.0.0.1",
    ] {
        assert!(
            StaticEndpoint::parse(bad).is_err(),
            "{bad:?} should not parse"
        );
    }
}

#[test]
fn static_endpoints_match_ip_and_port() {
    let sock = |s: &str| s.parse::<SocketAddr>().unwrap();
    let net = StaticEndpoint::parse("10.0.8.0/24:<10000-20000>").unwrap();
    assert!(net.admits_ip("10.0.8.77".parse().unwrap()));
    assert!(!net.admits_ip("10.0.9.1".parse().unwrap()));
    assert!(net.admits_ip("::ffff:10.0.8.1".parse().unwrap()));
    assert!(net.admits(sock("10.0.8.1:10000")));
    assert!(net.admits(sock("10.0.8.1:20000")));
    assert!(!net.admits(sock("10.0.8.1:9999")));
    assert!(!net.admits(sock("10.0.8.1:20001")));
    assert!(net.admits(sock("[::ffff:10.0.8.1]:15000")));

    let any_v4 = StaticEndpoint::parse("0.0.0.0/0").unwrap();
    assert!(any_v4.admits(sock("203.0.113.9:1")));
    assert!(!any_v4.admits(sock("203.0.113.9:0")));
    assert!(!any_v4.admits_ip("2001:db8::1".parse().unwrap()));
    // The peer policy's scope rule: a wide range never reaches loopback in any form.
    assert!(!any_v4.admits(sock("127.0.0.1:3478")));
    assert!(!any_v4.admits(sock("[::ffff:127.0.0.1]:3478")));
    assert!(!any_v4.admits_ip("169.254.169.254".parse().unwrap()));
    let loopback = StaticEndpoint::parse("127.0.0.1").unwrap();
    assert!(loopback.admits(sock("127.0.0.1:3478")));

    let v6 = StaticEndpoint::parse("fd00::/64:<1-1024>").unwrap();
    assert!(v6.admits(sock("[fd00::abcd]:443")));
    assert!(!v6.admits(sock("[fd00::abcd]:1025")));
    assert!(!v6.admits(sock("[fd00:0:0:1::1]:443")));
    assert!(!v6.admits_ip("10.0.0.1".parse().unwrap()));

    let empty = StaticEndpoint::parse("10.0.0.1:<6000-5000>").unwrap();
    assert!(!empty.admits(sock("10.0.0.1:5500")));
}

#[test]
fn turn_uri_forms() {
    let cases = [
        (
            "turn://user:pass@127.0.0.1:3478?transport=udp",
            ListenerProtocol::TurnUdp,
            "127.0.0.1",
            3478,
        ),
        (
            "turn://user:pass@127.0.0.1",
            ListenerProtocol::TurnUdp,
            "127.0.0.1",
            3478,
        ),
        (
            "turn://user:pass@10.0.0.1:3479?transport=tcp",
            ListenerProtocol::TurnTcp,
            "10.0.0.1",
            3479,
        ),
        (
            "turns://user:pass@10.0.0.1?transport=tcp",
            ListenerProtocol::TurnTls,
            "10.0.0.1",
            443,
        ),
        (
            "turns://user:pass@10.0.0.1?transport=udp",
            ListenerProtocol::TurnDtls,
            "10.0.0.1",
            443,
        ),
        (
            "turns://user:pass@10.0.0.1",
            ListenerProtocol::TurnDtls,
            "10.0.0.1",
            443,
        ),
        (
            "turn://user:pass@10.0.0.1?transport=tls",
            ListenerProtocol::TurnTls,
            "10.0.0.1",
            443,
        ),
        (
            "turn://user:pass@10.0.0.1?transport=DTLS",
            ListenerProtocol::TurnDtls,
            "10.0.0.1",
            443,
        ),
        (
            "turns://user:pass@10.0.0.1:5349?transport=tls",
            ListenerProtocol::TurnTls,
            "10.0.0.1",
            5349,
        ),
        (
            "TURN://user:pass@[::1]:3478",
            ListenerProtocol::TurnUdp,
            "::1",
            3478,
        ),
        (
            "turn://user:pass@:3478",
            ListenerProtocol::TurnUdp,
            "",
            3478,
        ),
        (
            "turn://user:pass@localhost:",
            ListenerProtocol::TurnUdp,
            "localhost",
            3478,
        ),
    ];
    for (uri, protocol, host, port) in cases {
        let parsed = parse_turn_uri(uri).unwrap_or_else(|e| panic!("{uri}: {e}"));
        assert_eq!(parsed.protocol, protocol, "{uri}");
        assert_eq!(parsed.host, host, "{uri}");
        assert_eq!(parsed.port, port, "{uri}");
        assert_eq!(parsed.username, "user");
        assert_eq!(parsed.password, "pass");
    }
    let tricky = parse_turn_uri("turn://us%40er:p%3Aa:ss@10.0.0.1").unwrap();
    assert_eq!(tricky.username, "us@er");
    assert_eq!(tricky.password, "p:a:ss");
}

#[test]
fn turn_uri_errors_name_turn_uri_and_hide_the_password() {
    for bad in [
        "turn://127.0.0.1:3478",
        "turn://user@127.0.0.1:3478",
        "turn://user:@127.0.0.1:3478",
        "turn://:secret@127.0.0.1:3478",
        "stun://user:secret@127.0.0.1",
        "turn:user:secret@127.0.0.1",
        "turn://user:secret@127.0.0.1?transport=sctp",
        "turn://user:secret@127.0.0.1:99999",
        "turn://user:secret@127.0.0.1:0",
        "turn://user:secret@127.0.0.1:http",
        "turn://user:secret@[::1",
        "turn://user:sec%zzret@127.0.0.1",
        "",
    ] {
        let e = parse_turn_uri(bad).expect_err(bad);
        assert_eq!(e.field, "TURN-URI", "{bad}");
        assert!(!e.to_string().contains("secret"), "{e}");
        assert!(!e.message.is_empty());
    }
    let e = parse_turn_uri("turn://127.0.0.1:3478").unwrap_err();
    assert!(e.message.contains("username/password must be set"), "{e}");
    // Port 0 would have become 3478 in validation, whatever the scheme's default.
    let e = parse_turn_uri("turns://user:secret@127.0.0.1:0").unwrap_err();
    assert!(
        e.message.contains("port 0") && e.message.contains("for 443"),
        "{e}"
    );
    assert!(StunnerConfig::from_turn_uri("turn://user:secret@127.0.0.1:0").is_err());
}

#[test]
fn turn_uri_builds_the_default_config() {
    let config = StunnerConfig::from_turn_uri("turn://user1:pa$s@127.0.0.1:3478?transport=udp")
        .unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(config.source_version(), "v1");
    assert_eq!(config.admin.name, "default-stunnerd");
    assert_eq!(config.admin.loglevel, "all:INFO");
    assert_eq!(config.admin.healthcheck_endpoint.as_deref(), Some(""));
    assert_eq!(config.admin.metrics_endpoint, "");
    assert_eq!(config.auth.auth_type, AuthType::Static);
    assert_eq!(config.auth.realm, "stunner.l7mp.io");
    assert_eq!(config.auth.credentials["username"], "user1");
    assert_eq!(config.auth.credentials["password"], "pa$s");
    let doc = config.v1.as_deref().expect("built as v1");
    let listener = &doc.listeners[0];
    assert_eq!(listener.name, "default-listener");
    assert_eq!(listener.protocol, ListenerProtocol::TurnUdp);
    assert_eq!(listener.address, "127.0.0.1");
    assert_eq!(listener.port, 3478);
    assert_eq!(listener.routes, ["allow-any"]);
    // The model: the listener binds the URI host (an address of this machine), its server
    // relays through allow-any, which advertises the URI host and, the host being loopback,
    // admits exactly it as a peer.
    assert_eq!(config.listeners[0].protocol, Transport::Udp);
    assert_eq!(config.listeners[0].address, "127.0.0.1");
    assert_eq!(config.listeners[0].servers, ["default-listener"]);
    assert_eq!(config.servers[0].clusters, ["allow-any"]);
    assert_eq!(config.clusters[0].addresses, ["127.0.0.1"]);
    let cluster = &config.clusters[0];
    assert_eq!(cluster.name, "allow-any");
    assert_eq!(cluster.cluster_type, ClusterType::Static);
    assert_eq!(cluster.endpoints, ["0.0.0.0/0", "127.0.0.1"]);
    assert!(!config.is_zero());

    // A host that is not this machine's (a public address behind NAT) binds every address
    // and admits no loopback peer, as stunnerd.
    let tls = StunnerConfig::from_turn_uri("turns://u:p@10.0.0.1?transport=tcp").unwrap();
    assert_eq!(tls.listeners[0].address, "");
    assert_eq!(tls.clusters[0].endpoints, ["0.0.0.0/0"]);
    assert_eq!(tls.listeners[0].protocol, Transport::Tls);
    assert_eq!(tls.listeners[0].port, 443);
    assert!(
        tls.listeners[0].cert.is_empty(),
        "the caller generates the certificate"
    );

    let local = StunnerConfig::from_turn_uri("turn://u:p@localhost").unwrap();
    assert_eq!(local.clusters[0].addresses, ["127.0.0.1"]);
    assert_eq!(local.listeners[0].address, "127.0.0.1");
    let v6 = StunnerConfig::from_turn_uri("turn://u:p@[::1]:3478").unwrap();
    assert_eq!(v6.listeners[0].address, "::1");
    assert_eq!(v6.clusters[0].endpoints, ["0.0.0.0/0", "::1"]);
    let any = StunnerConfig::from_turn_uri("turn://u:p@0.0.0.0").unwrap();
    assert_eq!(any.listeners[0].address, "");
    assert_eq!(any.clusters[0].endpoints, ["0.0.0.0/0"]);

    let e = StunnerConfig::from_turn_uri("turn://u:secret@example.com:3478").unwrap_err();
    assert_eq!(e.field, "TURN-URI");
    assert!(e.message.contains("listeners[0].address"), "{e}");
    assert!(!e.to_string().contains("secret"), "{e}");
    assert_eq!(
        StunnerConfig::from_turn_uri("turn://10.0.0.1")
            .unwrap_err()
            .field,
        "TURN-URI"
    );
}

#[test]
fn zero_config_round_trips_and_is_zero() {
    let zero = StunnerConfig::zero("default/stunnerd-host");
    assert_eq!(zero.admin.name, "default/stunnerd-host");
    assert_eq!(zero.auth.credentials["username"], "dummy-username");
    assert_eq!(zero.auth.credentials["password"], "dummy-password");
    assert!(zero.listeners.is_empty() && zero.clusters.is_empty());
    assert!(zero.is_zero());

    let reparsed = model(&zero.to_json());
    assert_eq!(reparsed, zero);
    assert!(reparsed.is_zero());

    // The literal stunnerd's CDS sends as a delete.
    let literal = r#"{"version":"v1","admin":{"name":"ns/gw"},"auth":{"type":"static","realm":"stunner.l7mp.io","credentials":{"username":"dummy-username","password":"dummy-password"}},"listeners":[],"clusters":[]}"#;
    let mut deleted = model(literal);
    assert!(deleted.is_zero());
    assert_eq!(deleted.source_version(), "v1");
    deleted.v1 = None;
    assert_eq!(deleted, StunnerConfig::zero("ns/gw"));

    // The log level is ignored; anything else makes it a real config.
    let mut louder = zero.clone();
    louder.admin.loglevel = "all:TRACE".into();
    assert!(louder.is_zero());
    let mut unvalidated = StunnerConfig::zero("x");
    unvalidated.admin.offload_engine.clear();
    unvalidated.admin.healthcheck_endpoint = None;
    assert!(unvalidated.is_zero());
    let mut with_listener = zero.clone();
    with_listener.listeners.push(ListenerConfig {
        name: "l".into(),
        ..ListenerConfig::default()
    });
    assert!(!with_listener.is_zero());
    let mut other_password = zero.clone();
    other_password
        .auth
        .credentials
        .insert("password".into(), "real".into());
    assert!(!other_password.is_zero());
    let mut no_health = zero;
    no_health.admin.healthcheck_endpoint = Some(String::new());
    assert!(!no_health.is_zero());
}

#[test]
fn to_json_uses_stunnerd_keys_and_round_trips() {
    let text = json_with(&format!(
        r#""admin": {{"name": "gw", "metrics_endpoint": "http://:8080/metrics", "user_quota": 3,
                     "healthcheck_endpoint": ""}},
           "listeners": [{{"name": "l", "protocol": "turn-dtls", "public_address": "1.2.3.4",
                          "public_port": 30478, "address": "10.0.0.1", "port": 3478,
                          "cert": "{}", "key": "{}", "routes": ["c"]}}],
           "clusters": [{{"name": "c", "endpoints": ["10.0.0.0/8"]}}]"#,
        pem_b64("CERTIFICATE"),
        pem_b64("PRIVATE KEY")
    ));
    let config = parse_ok(&text);
    let json = config.to_json();
    let value: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(value["version"], "v1");
    assert_eq!(value["admin"]["metrics_endpoint"], "http://:8080/metrics");
    assert_eq!(value["admin"]["healthcheck_endpoint"], "");
    assert_eq!(value["admin"]["user_quota"], 3);
    assert_eq!(value["admin"]["offload_engine"], "None");
    assert_eq!(value["auth"]["type"], "static");
    assert_eq!(value["listeners"][0]["protocol"], "TURN-DTLS");
    assert_eq!(value["listeners"][0]["public_port"], 30478);
    assert_eq!(value["clusters"][0]["type"], "STATIC");
    assert_eq!(value["clusters"][0]["protocol"], "UDP");
    assert!(value["admin"].get("license_config").is_none());
    assert_eq!(parse_ok(&json), config);
}

#[test]
fn yaml_anchors_merge_keys_and_numeric_keys_work() {
    let config = parse_ok(
        r#"
version: v1
auth: {credentials: {username: u, password: p}}
listeners:
  - &base {name: a, protocol: TURN-TCP, port: 4000}
  - <<: *base
    name: b
    protocol: TURN-UDP
"#,
    );
    assert_eq!(config.listeners[1].name, "b");
    assert_eq!(config.listeners[1].protocol, ListenerProtocol::TurnUdp);
    assert_eq!(config.listeners[1].port, 4000);
}

#[test]
fn http_endpoints_parse() {
    let sock = |s: &str| s.parse::<SocketAddr>().unwrap();
    let cases = [
        ("http://:8086", 8086, "0.0.0.0:8086", "/"),
        ("http://:8080/metrics", 8080, "0.0.0.0:8080", "/metrics"),
        ("http://127.0.0.1:9000/x", 8080, "127.0.0.1:9000", "/x"),
        ("http://0.0.0.0", 8086, "0.0.0.0:8086", "/"),
        ("http://", 8080, "0.0.0.0:8080", "/"),
        ("http://localhost:1234/", 8080, "127.0.0.1:1234", "/"),
        ("HTTP://[::1]:9090/m?x=1", 8080, "[::1]:9090", "/m"),
        ("http://[::]", 8086, "[::]:8086", "/"),
        ("http://10.0.0.1:/a/b", 8080, "10.0.0.1:8080", "/a/b"),
    ];
    for (url, default_port, addr, path) in cases {
        let endpoint =
            parse_http_endpoint(url, default_port).unwrap_or_else(|e| panic!("{url}: {e}"));
        assert_eq!(endpoint.addr, sock(addr), "{url}");
        assert_eq!(endpoint.path, path, "{url}");
    }
    for bad in [
        "",
        ":8080",
        "0.0.0.0:8080",
        "https://:8080",
        "http://example.com:80",
        "http://::1:8080",
        "http://[::1:8080",
        "http://:99999",
        "http://:80a",
        "http://user@:8080",
    ] {
        let e = parse_http_endpoint(bad, 8080).expect_err(bad);
        assert!(e.contains("http://"), "{bad}: {e}");
    }
}

#[test]
fn errors_display_field_value_and_fix() {
    let e = ConfigError::new("listeners[1].address", "my-host", "must be an IP");
    assert_eq!(
        e.to_string(),
        r#"invalid config: listeners[1].address = "my-host": must be an IP"#
    );
    let boxed: Box<dyn std::error::Error> = Box::new(e);
    assert!(boxed.to_string().contains("listeners[1]"));
}

#[test]
fn hostile_input_never_panics() {
    let inputs = [
        "\0",
        "{",
        "- - - -",
        "version: v1\nlisteners: [[[]]]",
        "version: v1\nauth: {credentials: [1]}",
        "version: v1\nauth: {credentials: {username: {a: b}}}",
        "version: v1\nlisteners: [{name: x, port: 1e400}]",
        "version: v1\nlisteners: [{name: x, port: 18446744073709551616}]",
        "version: v1\nclusters: [{name: c, endpoints: [\":<1-2>\", \"/\", \"::/:<-1>\"]}]",
        "version: !!binary aGVsbG8=",
        "? [a, b]\n: c",
        "$$$${{{}}}${",
        "version: v1\nadmin: {metrics_endpoint: \"http://[\"}",
        "\u{feff}version: v1",
        "version: \"\u{1F600}\"",
    ];
    for input in inputs {
        let _ = parse(input);
        let _ = parse_turn_uri(input);
        let _ = parse_http_endpoint(input, 1);
        let _ = StaticEndpoint::parse(input);
        let _ = StunnerConfig::from_turn_uri(input);
    }
}

#[test]
fn odd_but_valid_documents_parse() {
    // Keys differing only in case: the last in byte order wins, as after sigs.k8s.io/yaml.
    let config = parse_ok(&json_with(
        r#""admin": {"logLevel": "x:INFO", "loglevel": "y:INFO", "LOGLEVEL": null}"#,
    ));
    assert_eq!(config.admin.loglevel, "y:INFO");
    // JSON with tabs, which YAML refuses, goes through the JSON parser.
    let tabbed = "{\n\t\"version\":\t\"v1\",\n\t\"auth\": {\"credentials\": {\"username\": \"u\", \"password\": \"p\"}}}";
    assert_eq!(parse_ok(tabbed).version, "v1");
    // A UTF-8 byte order mark is skipped.
    let bom = "\u{feff}version: v1\nauth: {credentials: {username: u, password: p}}";
    assert_eq!(parse_ok(bom).version, "v1");
}

#[test]
fn kubernetes_cluster_endpoints_name_services() {
    let config = parse_ok(&json_with(
        r#""clusters": [{"name": "k", "type": "kubernetes", "endpoints": ["media/media-server:<10000-20000>", "media/sfu"]}]"#,
    ));
    assert_eq!(config.clusters[0].cluster_type, ClusterType::Kubernetes);
    let service = ServiceEndpoint::parse(&config.clusters[0].endpoints[0]).unwrap();
    assert_eq!(
        (service.key(), service.port_min, service.port_max),
        ("media/media-server".to_string(), 10000, 20000)
    );
    let sfu = ServiceEndpoint::parse("media/sfu").unwrap();
    assert_eq!((sfu.port_min, sfu.port_max), (1, 65535));
    for (bad, why) in [
        ("media-server", "no namespace"),
        ("Media/x", "DNS-1123"),
        ("media/-x", "DNS-1123"),
        ("media/", "DNS-1123"),
    ] {
        let err = parse(&json_with(&format!(
            r#""clusters": [{{"name": "k", "type": "KUBERNETES", "endpoints": ["{bad}"]}}]"#
        )))
        .unwrap_err();
        assert_eq!(err.field, "clusters[0].endpoints[0]", "{bad}");
        assert_eq!(err.value, bad);
        assert!(err.message.contains(why), "{bad}: {err}");
    }
    let err = parse(&json_with(r#""clusters": [{"name": "k", "type": "EDS"}]"#)).unwrap_err();
    assert!(err.message.contains("KUBERNETES"), "{err}");
}

/// The one peer policy, through the snapshot every check goes through (CreatePermission,
/// ChannelBind, Send and each relayed datagram): encodings of special-scope addresses under a
/// catch-all cluster, explicit listing, and the gateway's own address.
#[test]
fn peer_policy_refuses_special_scopes_and_own_addresses_unless_listed() {
    use uturn_shared::snapshot::Snapshot;
    let config = |clusters: &str| {
        let text = format!(
            "version: v1\nauth: {{type: static, credentials: {{username: u, password: p}}}}\n\
             listeners: [{{name: l, address: 10.9.9.9, port: 3478, routes: [c]}}]\n\
             clusters: [{{name: c, endpoints: [{clusters}]}}]\n"
        );
        Snapshot::from_config(&model(&text), 1, &|_| Vec::new())
    };
    let cases: &[(&str, &str, bool)] = &[
        // A catch-all admits global peers only.
        ("0.0.0.0/0", "203.0.113.7", true),
        ("0.0.0.0/0", "10.0.0.1", true),
        ("0.0.0.0/0", "0.0.0.0", false),
        ("0.0.0.0/0", "127.0.0.1", false),
        ("0.0.0.0/0", "169.254.169.254", false),
        ("0.0.0.0/0", "224.0.0.251", false),
        ("0.0.0.0/0", "255.255.255.255", false),
        ("0.0.0.0/0", "::ffff:127.0.0.1", false),
        ("0.0.0.0/0", "::ffff:169.254.169.254", false),
        ("0.0.0.0/0", "::127.0.0.1", false),
        ("0.0.0.0/0", "64:ff9b::7f00:1", false),
        ("0.0.0.0/0", "2002:7f00:1::", false),
        ("0.0.0.0/0", "2001:0:4136:e378:8000:63bf:80ff:fffe", false),
        ("0.0.0.0/0", "::ffff:203.0.113.7", true),
        ("\"::/0\"", "::", false),
        ("\"::/0\"", "::1", false),
        ("\"::/0\"", "fe80::1", false),
        ("\"::/0\"", "ff02::1", false),
        ("\"::/0\"", "2001:db8::7", true),
        // Listed explicitly, a special scope is reachable (loopback tests, node-local media).
        ("127.0.0.1", "127.0.0.1", true),
        ("127.0.0.1", "::ffff:127.0.0.1", true),
        ("127.0.0.0/8", "127.0.0.53", true),
        ("169.254.169.254", "169.254.169.254", true),
        ("\"::1\"", "::1", true),
        // The gateway's own (advertised) address needs an exact entry.
        ("10.0.0.0/8", "10.9.9.9", false),
        ("10.0.0.0/8", "10.9.9.8", true),
        ("10.0.0.0/8, 10.9.9.9", "10.9.9.9", true),
    ];
    for (clusters, peer, want) in cases {
        let snap = config(clusters);
        let route = snap.route("l").unwrap();
        let ip: IpAddr = peer.parse().unwrap();
        assert_eq!(snap.permits_ip(route, ip), *want, "{clusters} -> {peer}");
        let at = SocketAddr::new(ip, 5000);
        assert_eq!(
            snap.admits(route, at).is_some(),
            *want,
            "{clusters} -> {at}"
        );
    }
}

#[test]
fn listeners_of_one_transport_on_one_port_are_an_error_naming_both() {
    let (cert, key) = (pem_b64("CERTIFICATE"), pem_b64("PRIVATE KEY"));
    let listener = |name: &str, protocol: &str, address: &str, port: u16| {
        format!(
            r#"{{"name": "{name}", "protocol": "{protocol}", "address": "{address}", "port": {port}, "cert": "{cert}", "key": "{key}"}}"#
        )
    };
    // (first, second, whether they clash)
    let cases = [
        (("TURN-UDP", "127.0.0.1"), ("TURN-UDP", "127.0.0.1"), true),
        (("TURN-UDP", "127.0.0.1"), ("TURN-DTLS", "127.0.0.1"), true),
        (("TURN-TCP", "127.0.0.1"), ("TURN-TLS", "127.0.0.1"), true),
        (("TURN-TLS", "127.0.0.1"), ("TURN-TLS", "127.0.0.1"), true),
        // The address is only advertised: both bind the port on every address.
        (("TURN-UDP", "10.0.0.1"), ("TURN-UDP", "10.0.0.2"), true),
        (("TURN-DTLS", "0.0.0.0"), ("TURN-UDP", "::1"), true),
        // One UDP-based and one TCP-based listener share a port, as STUNner's do.
        (("TURN-UDP", "127.0.0.1"), ("TURN-TCP", "127.0.0.1"), false),
        (("TURN-TLS", "127.0.0.1"), ("TURN-DTLS", "127.0.0.1"), false),
        // Plain protocols are not served, so they hold no port.
        (("UDP", "127.0.0.1"), ("TURN-UDP", "127.0.0.1"), false),
    ];
    for ((p1, a1), (p2, a2), clash) in cases {
        let text = json_with(&format!(
            r#""listeners": [{}, {}, {}]"#,
            listener("other", "TURN-UDP", "127.0.0.1", 4000),
            listener("media-a", p1, a1, 3478),
            listener("media-b", p2, a2, 3478)
        ));
        let result = parse(&text);
        if !clash {
            assert!(result.is_ok(), "{p1} and {p2}: {result:?}");
            continue;
        }
        let e = result.expect_err(&format!("{p1} {a1} and {p2} {a2} share port 3478"));
        assert_eq!(e.field, "listeners[2].port", "{e}");
        assert_eq!(e.value, "3478");
        let text = e.to_string();
        for needle in [
            "\"media-a\"",
            "\"media-b\"",
            "listeners[1]",
            "port 3478",
            "give one of them another port",
        ] {
            assert!(text.contains(needle), "{needle:?} missing from: {text}");
        }
    }
    // The default port counts: two UDP listeners without one clash on 3478.
    let e = parse(&json_with(r#""listeners": [{"name": "a"}, {"name": "b"}]"#)).unwrap_err();
    assert_eq!(e.field, "listeners[1].port");
    assert!(e.to_string().contains("both use UDP port 3478"), "{e}");
}

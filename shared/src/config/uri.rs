//! The positional `TURN-URI` (`turn://user:pass@host:port?transport=udp`) and the built-in
//! config stunnerd runs for it (stunnerd.md §2.7).

use super::endpoint::split_host_port;
use super::{
    v1, AdminConfig, AuthConfig, AuthType, ClusterProtocol, ClusterType, ConfigError,
    ListenerProtocol, StunnerConfig, API_VERSION_V1, DEFAULT_LOG_LEVEL, DEFAULT_PORT,
    DEFAULT_REALM,
};
use serde::Serialize;
use std::collections::BTreeMap;

/// Field name used in every TURN URI error.
const FIELD: &str = "TURN-URI";
const FORM: &str =
    "write it as turn://<user>:<password>@<host>[:<port>][?transport=udp|tcp|tls|dtls] \
                    (or turns://…)";

/// A parsed TURN server URI.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TurnUri {
    /// Username (percent-decoded).
    pub username: String,
    /// Password (percent-decoded).
    pub password: String,
    /// Host as written, without IPv6 brackets; may be empty.
    pub host: String,
    /// Port: as given, else 443 for TLS/DTLS and 3478 otherwise.
    pub port: u16,
    /// `turn`+udp: TURN-UDP, `turn`+tcp: TURN-TCP, `turns`+udp: TURN-DTLS, `turns`+tcp:
    /// TURN-TLS; `transport=tls|dtls` wins over the scheme.
    pub protocol: ListenerProtocol,
}

/// Parses a TURN URI; the username and password are mandatory.
pub fn parse_turn_uri(uri: &str) -> Result<TurnUri, ConfigError> {
    let shown = redact(uri);
    let error = |message: String| ConfigError::new(FIELD, shown.as_str(), message);

    let Some((scheme, rest)) = uri.split_once("://") else {
        return Err(error(format!("missing scheme: {FORM}")));
    };
    let secure = match scheme.to_ascii_lowercase().as_str() {
        "turn" => false,
        "turns" => true,
        _ => {
            return Err(error(format!(
                "scheme {scheme:?} is not turn or turns: {FORM}"
            )))
        }
    };
    let rest = rest.split_once('#').map_or(rest, |(before, _)| before);
    let (before_query, query) = rest.split_once('?').unwrap_or((rest, ""));
    let authority = before_query
        .split_once('/')
        .map_or(before_query, |(authority, _)| authority);

    let Some((userinfo, hostport)) = authority.rsplit_once('@') else {
        return Err(error(format!("username/password must be set: {FORM}")));
    };
    let (user, pass) = userinfo.split_once(':').unwrap_or((userinfo, ""));
    let username = percent_decode(user)
        .ok_or_else(|| error(format!("bad %-escape in the username: {FORM}")))?;
    let password = percent_decode(pass)
        .ok_or_else(|| error(format!("bad %-escape in the password: {FORM}")))?;
    if username.is_empty() || password.is_empty() {
        return Err(error(format!("username/password must be set: {FORM}")));
    }

    let (host, port) = split_host_port(hostport).map_err(|why| error(format!("{why}: {FORM}")))?;

    let transport = query
        .split('&')
        .filter_map(|pair| pair.split_once('=').or(Some((pair, ""))))
        .find(|(key, _)| *key == "transport")
        .map(|(_, value)| value.to_ascii_lowercase())
        .unwrap_or_else(|| "udp".to_owned());
    let protocol = match (transport.as_str(), secure) {
        ("tls", _) => ListenerProtocol::TurnTls,
        ("dtls", _) => ListenerProtocol::TurnDtls,
        ("udp", false) => ListenerProtocol::TurnUdp,
        ("tcp", false) => ListenerProtocol::TurnTcp,
        ("udp", true) => ListenerProtocol::TurnDtls,
        ("tcp", true) => ListenerProtocol::TurnTls,
        _ => {
            return Err(error(format!(
                "transport {transport:?} is not udp, tcp, tls or dtls: {FORM}"
            )))
        }
    };
    let default_port = if protocol.needs_cert() {
        443
    } else {
        DEFAULT_PORT
    };

    if port == Some(0) {
        return Err(error(format!(
            "port 0 is no port a client can reach: give the listener's port, or leave it out \
             for {default_port}: {FORM}"
        )));
    }

    Ok(TurnUri {
        username,
        password,
        host: host.to_owned(),
        port: port.unwrap_or(default_port),
        protocol,
    })
}

/// The built-in config: static auth with the URI's credentials, one `default-listener` whose
/// address is the URI host, one `allow-any` cluster (`0.0.0.0/0`), health checks disabled.
///
/// Where uturn differs from stunnerd (which binds every address whatever the host): a URI
/// whose host is an address of this machine binds that address alone, so
/// `turn://…@127.0.0.1` serves this machine only, as its URI says (a host that is not local,
/// such as a cloud VM's public address in front of its private one, still binds every
/// address). And a loopback host is also admitted as a peer, exactly that address: its
/// clients are on this machine and reach it anyway, and a peer beside the server is how one
/// tries it (loopback and the host's own addresses are refused otherwise).
pub(super) fn config_from_turn_uri(uri: &str) -> Result<StunnerConfig, ConfigError> {
    let turn = parse_turn_uri(uri)?;
    let host_ip = if turn.host.eq_ignore_ascii_case("localhost") {
        Some(std::net::IpAddr::from([127, 0, 0, 1]))
    } else {
        turn.host.parse::<std::net::IpAddr>().ok()
    };
    let mut endpoints = vec!["0.0.0.0/0".to_owned()];
    if let Some(ip) = host_ip.filter(|ip| ip.is_loopback()) {
        endpoints.push(ip.to_string());
    }
    let mut config = v1::StunnerDocument {
        version: API_VERSION_V1.to_owned(),
        admin: AdminConfig {
            loglevel: DEFAULT_LOG_LEVEL.to_owned(),
            healthcheck_endpoint: Some(String::new()),
            ..AdminConfig::default()
        },
        auth: AuthConfig {
            auth_type: AuthType::Static,
            realm: DEFAULT_REALM.to_owned(),
            credentials: BTreeMap::from([
                ("username".to_owned(), turn.username),
                ("password".to_owned(), turn.password),
            ]),
            lifetime: String::new(),
        },
        listeners: vec![v1::ListenerDocument {
            name: "default-listener".to_owned(),
            protocol: turn.protocol,
            address: turn.host,
            port: turn.port,
            routes: vec!["allow-any".to_owned()],
            ..v1::ListenerDocument::default()
        }],
        clusters: vec![v1::ClusterDocument {
            name: "allow-any".to_owned(),
            cluster_type: ClusterType::Static,
            protocol: ClusterProtocol::Udp,
            endpoints,
        }],
    };
    // The certificate of a TLS/DTLS listener is generated by the caller.
    let error = |inner: ConfigError| {
        ConfigError::new(
            FIELD,
            redact(uri),
            format!("{} {:?}: {}", inner.field, inner.value, inner.message),
        )
    };
    config.validate_with(false).map_err(error)?;
    let mut config = super::convert::from_v1(config, false).map_err(error)?;
    let local = |ip: &std::net::IpAddr| ip.is_loopback() || crate::policy::host_ips().contains(ip);
    if let Some(ip) = host_ip.filter(|ip| !ip.is_unspecified() && local(ip)) {
        for listener in &mut config.listeners {
            listener.address = ip.to_string();
        }
    }
    Ok(config)
}

/// The URI with its password replaced by `****`, for error messages. Also covers the
/// scheme-only form `turn:user:pass@host` that is refused.
fn redact(uri: &str) -> String {
    let userinfo_start = match uri.find("://") {
        Some(i) => i + 3,
        None => uri.find(':').map_or(0, |i| i + 1),
    };
    let rest = &uri[userinfo_start..];
    let authority_end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let Some(at) = rest[..authority_end].rfind('@') else {
        return uri.to_owned();
    };
    match rest[..at].find(':') {
        Some(colon) => format!(
            "{}{}:****{}",
            &uri[..userinfo_start],
            &rest[..colon],
            &rest[at..]
        ),
        None => uri.to_owned(),
    }
}

/// Decodes `%XX` escapes; `None` on a malformed escape or non-UTF-8 result.
fn percent_decode(s: &str) -> Option<String> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            if !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
                return None;
            }
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

//! The v1 → v2 conversion, as STUNner v2's converter does it: each v1 listener becomes a v2
//! listener (binding every address) plus a TURN server of the same name whose clusters are the
//! listener's routes; each v1 cluster keeps its name, type and protocol, its endpoints
//! rewritten to the v2 syntax, and advertises as relay addresses the first IPv4 and the first
//! IPv6 `address` of the listeners that route to it (unspecified ones dropped).

use super::v1;
use super::{
    v1_endpoint_to_v2, ClusterConfig, ConfigError, ListenerConfig, ListenerProtocol, RoutingPolicy,
    ServerConfig, ServerType, StunnerConfig, Transport, API_VERSION,
};
use std::net::IpAddr;
use std::sync::Arc;

/// Converts a validated v1 config into the model; the v1 document is kept for display.
/// `require_cert`: TLS/DTLS listeners must carry their cert and key (not so for the TURN-URI
/// config, whose certificate the caller generates).
pub(super) fn from_v1(
    v1: v1::StunnerDocument,
    require_cert: bool,
) -> Result<StunnerConfig, ConfigError> {
    for (i, listener) in v1.listeners.iter().enumerate() {
        if !listener.protocol.is_turn() {
            return Err(ConfigError::new(
                format!("listeners[{i}].protocol"),
                listener.protocol.as_str(),
                format!(
                    "listener {:?}: uturn serves TURN only, not a plain {} proxy (stunnerd \
                     refuses to start it too): use TURN-{}",
                    listener.name,
                    listener.protocol.as_str(),
                    listener.protocol.as_str()
                ),
            ));
        }
    }
    let listeners = v1.listeners.iter().map(listener).collect();
    let servers = v1
        .listeners
        .iter()
        .map(|l| ServerConfig {
            name: l.name.clone(),
            server_type: if l.protocol.is_turn() {
                ServerType::Turn
            } else {
                ServerType::L4
            },
            clusters: l.routes.clone(),
        })
        .collect();
    let clusters = v1
        .clusters
        .iter()
        .enumerate()
        .map(|(i, c)| cluster(&v1, i, c))
        .collect::<Result<_, _>>()?;
    let mut config = StunnerConfig {
        version: API_VERSION.to_owned(),
        admin: v1.admin.clone(),
        auth: v1.auth.clone(),
        listeners,
        servers,
        clusters,
        v1: None,
        document_warnings: super::DocumentWarnings::default(),
    };
    config.validate_with(require_cert).map_err(|e| {
        ConfigError::new(
            e.field,
            e.value,
            format!("converted config is invalid: {}", e.message),
        )
    })?;
    config.v1 = Some(Arc::new(v1));
    Ok(config)
}

fn listener(l: &v1::ListenerDocument) -> ListenerConfig {
    let protocol = match l.protocol {
        ListenerProtocol::TurnUdp | ListenerProtocol::Udp => Transport::Udp,
        ListenerProtocol::TurnTcp | ListenerProtocol::Tcp => Transport::Tcp,
        ListenerProtocol::TurnTls | ListenerProtocol::Tls => Transport::Tls,
        ListenerProtocol::TurnDtls | ListenerProtocol::Dtls => Transport::Dtls,
    };
    ListenerConfig {
        name: l.name.clone(),
        protocol,
        // v1's address is the relay address (it moves to the clusters); v1 bound every address.
        address: String::new(),
        port: l.port,
        public_address: l.public_address.clone(),
        public_port: l.public_port,
        public_addresses: Vec::new(),
        cert: l.cert.clone(),
        key: l.key.clone(),
        pqc_mode: String::new(),
        servers: vec![l.name.clone()],
    }
}

fn cluster(
    v1: &v1::StunnerDocument,
    index: usize,
    c: &v1::ClusterDocument,
) -> Result<ClusterConfig, ConfigError> {
    let endpoints = c
        .endpoints
        .iter()
        .enumerate()
        .map(|(j, e)| {
            v1_endpoint_to_v2(e).map_err(|why| {
                ConfigError::new(
                    format!("clusters[{index}].endpoints[{j}]"),
                    e.as_str(),
                    format!("cluster {:?}: cannot convert endpoint: {why}", c.name),
                )
            })
        })
        .collect::<Result<Vec<_>, _>>()?;
    let routing: Vec<&v1::ListenerDocument> = v1
        .listeners
        .iter()
        .filter(|l| l.routes.contains(&c.name))
        .collect();
    let (mut v4, mut v6, mut other) = (None, None, Vec::new());
    for address in routing.iter().map(|l| l.address.as_str()) {
        match address.parse::<IpAddr>() {
            Ok(ip) if ip.is_unspecified() => {}
            Ok(IpAddr::V4(_)) => v4 = v4.or(Some(address.to_owned())),
            Ok(IpAddr::V6(_)) => v6 = v6.or(Some(address.to_owned())),
            Err(_) if !address.is_empty() && !other.iter().any(|o| o == address) => {
                other.push(address.to_owned())
            }
            Err(_) => {}
        }
    }
    let routing_policy = match routing.first() {
        Some(l) if !l.protocol.is_turn() => RoutingPolicy::RoundRobin,
        _ => RoutingPolicy::Filter,
    };
    Ok(ClusterConfig {
        name: c.name.clone(),
        cluster_type: c.cluster_type,
        protocol: c.protocol,
        endpoints,
        routing_policy,
        addresses: v4.into_iter().chain(v6).chain(other).collect(),
        tunnel: None,
    })
}

//! STUNner v2's config document: the reader, the validation (syntax, as stunnerd's: a
//! listener naming a missing server or a server naming a missing cluster is skipped at
//! runtime), and what uturn refuses (an L4 server, a tunnelled cluster, a STDIN listener).

use super::document::{admin_and_auth, as_section, Section};
use super::ports::{check_shared_ports, Binding, PortUse};
use super::validate::{check_endpoints, check_pem, validate_admin, validate_auth};
use super::{
    ClusterConfig, ClusterProtocol, ClusterType, ConfigError, Endpoint, ListenerConfig,
    RoutingPolicy, ServerConfig, ServerType, ServiceEndpoint, StunnerConfig, Transport,
    API_VERSION, DEFAULT_PORT,
};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};

/// Reads a parsed v2 document into a validated config.
pub(super) fn config_from_document(
    doc: &Value,
    literal_credentials: Option<&BTreeMap<String, String>>,
) -> Result<StunnerConfig, ConfigError> {
    let root = super::document::root(doc)?;
    let (admin, auth) = admin_and_auth(&root, literal_credentials)?;
    let items = |key: &str| -> Result<Vec<Section<'_>>, ConfigError> {
        root.list(key)?
            .iter()
            .enumerate()
            .map(|(i, item)| as_section(item, format!("{key}[{i}]")))
            .collect()
    };
    let mut config = StunnerConfig {
        version: API_VERSION.to_owned(),
        admin,
        auth,
        listeners: items("listeners")?
            .iter()
            .map(listener_from)
            .collect::<Result<_, _>>()?,
        servers: items("servers")?
            .iter()
            .map(server_from)
            .collect::<Result<_, _>>()?,
        clusters: items("clusters")?
            .iter()
            .map(cluster_from)
            .collect::<Result<_, _>>()?,
        v1: None,
        document_warnings: super::DocumentWarnings::default(),
    };
    config.validate()?;
    Ok(config)
}

fn enum_field<T>(
    section: &Section<'_>,
    key: &str,
    parse: impl Fn(&str) -> Option<T>,
    fix: &str,
) -> Result<Option<T>, ConfigError> {
    match section.string(key)?.as_deref() {
        None | Some("") => Ok(None),
        Some(raw) => parse(raw)
            .map(Some)
            .ok_or_else(|| ConfigError::new(section.path_of(key), raw, fix)),
    }
}

fn listener_from(section: &Section<'_>) -> Result<ListenerConfig, ConfigError> {
    let protocol = enum_field(
        section,
        "protocol",
        Transport::parse,
        "unknown listener protocol: use UDP, TCP, TLS or DTLS (in a v2 config the server \
         type says TURN: TURN-UDP is written UDP)",
    )?
    .unwrap_or_default();
    let port = section.port("port")?;
    Ok(ListenerConfig {
        name: section.string("name")?.unwrap_or_default(),
        protocol,
        address: section.string("address")?.unwrap_or_default(),
        port,
        public_address: section.string("public_address")?.unwrap_or_default(),
        public_port: section.integer("public_port")?.unwrap_or_default(),
        public_addresses: section.strings("public_addresses")?,
        cert: section.string("cert")?.unwrap_or_default(),
        key: section.string("key")?.unwrap_or_default(),
        pqc_mode: section.string("pqc_mode")?.unwrap_or_default(),
        servers: section.strings("servers")?,
    })
}

fn server_from(section: &Section<'_>) -> Result<ServerConfig, ConfigError> {
    Ok(ServerConfig {
        name: section.string("name")?.unwrap_or_default(),
        server_type: enum_field(
            section,
            "type",
            ServerType::parse,
            "unknown server type: use turn",
        )?
        .unwrap_or_default(),
        clusters: section.strings("clusters")?,
    })
}

fn cluster_from(section: &Section<'_>) -> Result<ClusterConfig, ConfigError> {
    let cluster_type = enum_field(
        section,
        "type",
        ClusterType::parse,
        "unknown cluster type: use STATIC, STRICT_DNS or KUBERNETES",
    )?
    .unwrap_or_default();
    let protocol = enum_field(
        section,
        "protocol",
        ClusterProtocol::parse,
        "unknown cluster protocol: use UDP or TCP",
    )?
    .ok_or_else(|| {
        ConfigError::new(
            section.path_of("protocol"),
            "",
            "unknown cluster protocol: a v2 cluster must name its protocol, UDP or TCP",
        )
    })?;
    let routing_policy = enum_field(
        section,
        "routing_policy",
        RoutingPolicy::parse,
        "unknown routing policy: use FILTER (or ROUND_ROBIN)",
    )?
    .unwrap_or_default();
    let addresses = section
        .strings("addresses")?
        .iter()
        .flat_map(|entry| entry.split(','))
        .map(str::trim)
        .filter(|a| !a.is_empty())
        .map(str::to_owned)
        .collect();
    Ok(ClusterConfig {
        name: section.string("name")?.unwrap_or_default(),
        cluster_type,
        protocol,
        endpoints: section.strings("endpoints")?,
        routing_policy,
        addresses,
        tunnel: section.get("tunnel").cloned(),
    })
}

/// Unique names per kind: a listener and a server may share one (the v1 converter relies on it).
fn check_names<'a>(
    kind: &str,
    names: impl Iterator<Item = &'a String>,
    fix: &str,
) -> Result<(), ConfigError> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (i, name) in names.enumerate() {
        if name.is_empty() {
            return Err(ConfigError::new(
                format!("{kind}s[{i}].name"),
                "",
                format!("missing name in {kind} configuration: {fix}"),
            ));
        }
        if let Some(first) = seen.insert(name, i) {
            return Err(ConfigError::new(
                format!("{kind}s[{i}].name"),
                name.as_str(),
                format!("duplicate {kind} name, also used by {kind}s[{first}]: {kind} names must be unique"),
            ));
        }
    }
    Ok(())
}

impl StunnerConfig {
    /// Injects defaults, normalizes and checks the config in stunnerd's order (admin, auth,
    /// listeners, servers, clusters), then refuses what uturn does not serve. A converted v1
    /// config passes too.
    pub fn validate(&mut self) -> Result<(), ConfigError> {
        self.validate_with(true)
    }

    /// [`StunnerConfig::validate`], optionally letting TLS/DTLS listeners lack a cert and key.
    pub(super) fn validate_with(&mut self, require_cert: bool) -> Result<(), ConfigError> {
        if self.version != API_VERSION {
            return Err(super::document::unsupported_version(&self.version));
        }
        validate_admin(&mut self.admin)?;
        validate_auth(&mut self.auth, false)?;
        check_names(
            "listener",
            self.listeners.iter().map(|l| &l.name),
            "give every listener a unique name",
        )?;
        for (i, listener) in self.listeners.iter_mut().enumerate() {
            let field = |name: &str| format!("listeners[{i}].{name}");
            if listener.port == 0 {
                listener.port = DEFAULT_PORT;
            }
            let pqc = listener.pqc_mode.to_ascii_lowercase();
            listener.pqc_mode = match pqc.as_str() {
                "" | "default" => String::new(),
                "preferred" | "enforced" => pqc,
                _ => {
                    return Err(ConfigError::new(
                        field("pqc_mode"),
                        listener.pqc_mode.as_str(),
                        "unknown PQC mode: use default, preferred or enforced",
                    ))
                }
            };
            if !listener.address.is_empty() && listener.address.parse::<std::net::IpAddr>().is_err()
            {
                return Err(ConfigError::new(
                    field("address"),
                    listener.address.as_str(),
                    "invalid listener address: the bind address must be an IP address, or \
                     empty to bind every address (the relay address is the cluster's \
                     addresses, not the listener's)",
                ));
            }
            if require_cert && matches!(listener.protocol, Transport::Tls | Transport::Dtls) {
                let protocol = listener.protocol.as_str();
                let name = &listener.name;
                for (key, label) in [("cert", "CERTIFICATE"), ("key", "PRIVATE KEY")] {
                    let value = if key == "cert" {
                        &listener.cert
                    } else {
                        &listener.key
                    };
                    check_pem(value, label, protocol, key).map_err(|(value, why)| {
                        ConfigError::new(field(key), value, format!("listener {name:?}: {why}"))
                    })?;
                }
            }
        }
        check_names(
            "server",
            self.servers.iter().map(|s| &s.name),
            "give every server a unique name (listeners name it in servers)",
        )?;
        check_names(
            "cluster",
            self.clusters.iter().map(|c| &c.name),
            "give every cluster a unique name (servers name it in clusters)",
        )?;
        for (i, cluster) in self.clusters.iter_mut().enumerate() {
            check_endpoints(
                i,
                cluster.cluster_type,
                &cluster.endpoints,
                |cluster_type, endpoint| match cluster_type {
                    ClusterType::Kubernetes => ServiceEndpoint::parse_v2(endpoint).map(drop),
                    ClusterType::Static | ClusterType::StrictDns => {
                        Endpoint::parse(endpoint).map(drop)
                    }
                },
            )?;
            cluster.endpoints.sort();
        }
        self.check_shared_ports()?;
        self.refuse_unsupported()
    }

    /// Listeners that would split a port's clients ([`super::ports`]): a v2 listener binds its
    /// `address`, or every address when it has none.
    fn check_shared_ports(&self) -> Result<(), ConfigError> {
        let uses: Vec<Option<PortUse<'_>>> = self
            .listeners
            .iter()
            .map(|listener| {
                let protocol = self.listener_protocol(listener)?;
                Some(PortUse {
                    name: &listener.name,
                    protocol: listener.protocol.as_str(),
                    datagram: protocol.is_datagram(),
                    port: listener.port,
                    bind: Some(listener.address.as_str()).filter(|a| !a.is_empty()),
                })
            })
            .collect();
        check_shared_ports(&uses, Binding::Address)
    }

    /// What uturn does not serve is refused, never half-served: a config asking for it is an
    /// error naming the object (at start the process exits; on a reload the running config
    /// stays).
    fn refuse_unsupported(&self) -> Result<(), ConfigError> {
        for (i, listener) in self.listeners.iter().enumerate() {
            if listener.protocol == Transport::Stdin {
                return Err(ConfigError::new(
                    format!("listeners[{i}].protocol"),
                    "STDIN",
                    format!(
                        "listener {:?}: uturn serves no STDIN listener (stunnerd's tunnel \
                         mode): use UDP, TCP, TLS or DTLS",
                        listener.name
                    ),
                ));
            }
        }
        for (i, server) in self.servers.iter().enumerate() {
            if server.server_type == ServerType::L4 {
                return Err(ConfigError::new(
                    format!("servers[{i}].type"),
                    "l4",
                    format!(
                        "server {:?}: uturn serves TURN only, not an L4 proxy (a v1 listener \
                         of plain UDP/TCP/TLS/DTLS converts to one): use type turn (a v1 \
                         listener protocol TURN-UDP, TURN-TCP, TURN-TLS or TURN-DTLS)",
                        server.name
                    ),
                ));
            }
        }
        for (i, cluster) in self.clusters.iter().enumerate() {
            if cluster.tunnel.is_some() {
                return Err(ConfigError::new(
                    format!("clusters[{i}].tunnel"),
                    cluster
                        .tunnel
                        .as_ref()
                        .and_then(|t| t.get("url"))
                        .and_then(Value::as_str)
                        .unwrap_or_default(),
                    format!(
                        "cluster {:?}: uturn does not reach peers through an upstream TURN \
                         server: remove the tunnel (a v1 TURN-* cluster converts to one)",
                        cluster.name
                    ),
                ));
            }
        }
        Ok(())
    }
}

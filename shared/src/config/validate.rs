//! v1's `StunnerConfig::validate`: stunnerd's defaults, normalization and checks, in
//! stunnerd's order (version, admin, auth, listeners, clusters); the first problem is returned.
//! The `admin` and `auth` rules are shared with v2 ([`validate_admin`], [`validate_auth`]).

use super::document::unsupported_version;
use super::v1::StunnerConfig;
use super::{
    parse_http_endpoint, AdminConfig, AuthConfig, AuthType, ClusterType, ConfigError,
    ServiceEndpoint, StaticEndpoint, API_VERSION_V1, API_VERSION_V1ALPHA1,
    DEFAULT_HEALTHCHECK_ENDPOINT, DEFAULT_HEALTHCHECK_PORT, DEFAULT_LISTENER_ADDRESS,
    DEFAULT_LOG_LEVEL, DEFAULT_METRICS_PORT, DEFAULT_PORT, DEFAULT_REALM, DEFAULT_STUNNERD_NAME,
};
use base64::Engine as _;
use std::collections::HashMap;
use std::net::IpAddr;

const OFFLOAD_ENGINES: [&str; 4] = ["None", "XDP", "TC", "Auto"];

impl StunnerConfig {
    /// Injects defaults, normalizes and checks the config; `parse_config` already calls it.
    pub fn validate(&mut self) -> Result<(), ConfigError> {
        self.validate_with(true)
    }

    /// [`StunnerConfig::validate`], optionally letting TLS/DTLS listeners lack a cert and key
    /// (the TURN-URI config, whose certificate the caller generates).
    pub(super) fn validate_with(&mut self, require_cert: bool) -> Result<(), ConfigError> {
        if self.version == API_VERSION_V1ALPHA1 {
            self.version = API_VERSION_V1.to_owned();
        }
        if self.version != API_VERSION_V1 {
            return Err(unsupported_version(&self.version));
        }
        validate_admin(&mut self.admin)?;
        validate_auth(&mut self.auth, true)?;
        self.validate_listeners(require_cert)?;
        self.validate_clusters()
    }

    fn validate_listeners(&mut self, require_cert: bool) -> Result<(), ConfigError> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, listener) in self.listeners.iter_mut().enumerate() {
            let field = |name: &str| format!("listeners[{i}].{name}");
            if listener.name.is_empty() {
                return Err(ConfigError::new(
                    field("name"),
                    "",
                    "missing name in listener configuration: give every listener a unique name",
                ));
            }
            if let Some(first) = seen.insert(listener.name.clone(), i) {
                return Err(ConfigError::new(
                    field("name"),
                    listener.name.as_str(),
                    format!(
                        "duplicate listener name, also used by listeners[{first}]: listener \
                         names must be unique"
                    ),
                ));
            }

            if listener.address.is_empty() {
                listener.address = DEFAULT_LISTENER_ADDRESS.to_owned();
            } else if listener.address.eq_ignore_ascii_case("localhost") {
                listener.address = "127.0.0.1".to_owned();
            } else if listener.address.parse::<IpAddr>().is_err() {
                return Err(ConfigError::new(
                    field("address"),
                    listener.address.as_str(),
                    "invalid listener address: must be an IP address or localhost after env \
                     substitution (it is the relay address advertised to clients; check that \
                     $STUNNER_ADDR is set)",
                ));
            }

            if listener.port == 0 {
                listener.port = DEFAULT_PORT;
            }

            if listener.protocol.needs_cert() && require_cert {
                let protocol = listener.protocol.as_str();
                let name = &listener.name;
                check_pem(&listener.cert, "CERTIFICATE", protocol, "cert").map_err(
                    |(value, why)| {
                        ConfigError::new(field("cert"), value, format!("listener {name:?}: {why}"))
                    },
                )?;
                check_pem(&listener.key, "PRIVATE KEY", protocol, "key").map_err(
                    |(value, why)| {
                        ConfigError::new(field("key"), value, format!("listener {name:?}: {why}"))
                    },
                )?;
            }

            listener.routes.sort();
        }
        self.check_shared_ports()
    }

    /// Two served listeners of one transport on one port would split its clients: a listener
    /// binds its port on every address (its `address` is only what it advertises), with
    /// SO_REUSEPORT, and the kernel hashes clients over all the sockets on the port.
    fn check_shared_ports(&self) -> Result<(), ConfigError> {
        let mut taken: HashMap<(bool, u16), usize> = HashMap::new();
        for (i, listener) in self.listeners.iter().enumerate() {
            if !listener.protocol.is_turn() {
                continue;
            }
            let datagram = listener.protocol.is_datagram();
            let Some(&first) = taken.get(&(datagram, listener.port)) else {
                taken.insert((datagram, listener.port), i);
                continue;
            };
            let other = &self.listeners[first];
            let (transport, pairs) = if datagram {
                ("UDP", "TURN-UDP and TURN-DTLS")
            } else {
                ("TCP", "TURN-TCP and TURN-TLS")
            };
            return Err(ConfigError::new(
                format!("listeners[{i}].port"),
                listener.port.to_string(),
                format!(
                    "listener {:?} ({}) and listener {:?} ({}, listeners[{first}]) both use {} \
                     port {}: listeners bind their port on every address, so the two would \
                     split the port's clients between them; give one of them another port \
                     ({pairs} are both {transport}; a {transport}-based and a {}-based \
                     listener may share a port)",
                    listener.name,
                    listener.protocol.as_str(),
                    other.name,
                    other.protocol.as_str(),
                    transport,
                    listener.port,
                    if datagram { "TCP" } else { "UDP" },
                ),
            ));
        }
        Ok(())
    }

    fn validate_clusters(&mut self) -> Result<(), ConfigError> {
        let mut seen: HashMap<String, usize> = HashMap::new();
        for (i, cluster) in self.clusters.iter_mut().enumerate() {
            if cluster.name.is_empty() {
                return Err(ConfigError::new(
                    format!("clusters[{i}].name"),
                    "",
                    "missing name in cluster configuration: give every cluster a unique name \
                     (listeners refer to it in routes)",
                ));
            }
            if let Some(first) = seen.insert(cluster.name.clone(), i) {
                return Err(ConfigError::new(
                    format!("clusters[{i}].name"),
                    cluster.name.as_str(),
                    format!(
                        "duplicate cluster name, also used by clusters[{first}]: cluster names \
                         must be unique"
                    ),
                ));
            }
            check_endpoints(
                i,
                cluster.cluster_type,
                &cluster.endpoints,
                |cluster_type, endpoint| match cluster_type {
                    ClusterType::Static => StaticEndpoint::parse(endpoint).map(drop),
                    ClusterType::Kubernetes => ServiceEndpoint::parse(endpoint).map(drop),
                    ClusterType::StrictDns => Ok(()),
                },
            )?;
            cluster.endpoints.sort();
        }
        Ok(())
    }
}

/// Checks a TLS listener's `cert` or `key`: non-empty, std base64 (line breaks ignored, as Go
/// does), decoding to PEM. On failure gives the value to show (never key material) and why.
pub(super) fn check_pem(
    encoded: &str,
    pem_label: &str,
    protocol: &str,
    field: &str,
) -> Result<(), (String, String)> {
    let what = if field == "cert" { "cert" } else { "key" };
    let shown = || {
        if field == "cert" {
            let head: String = encoded.chars().take(40).collect();
            if head.len() < encoded.len() {
                format!("{head}…")
            } else {
                head
            }
        } else {
            format!("<{} bytes>", encoded.len())
        }
    };
    if encoded.trim().is_empty() {
        return Err((
            String::new(),
            format!(
                "empty TLS {what} for {protocol} listener: set {field} to the base64-encoded \
                 PEM {pem_label} (e.g. base64 -w0 file.pem)"
            ),
        ));
    }
    if encoded.trim_start().starts_with("-----BEGIN") {
        return Err((
            shown(),
            format!(
                "TLS {what} for {protocol} listener is raw PEM: base64-encode it \
                 (e.g. base64 -w0 file.pem)"
            ),
        ));
    }
    let compact: String = encoded
        .chars()
        .filter(|c| *c != '\n' && *c != '\r')
        .collect();
    let decoded = base64::engine::general_purpose::STANDARD
        .decode(compact.trim())
        .map_err(|e| {
            (
                shown(),
                format!(
                    "TLS {what} for {protocol} listener is not valid base64 ({e}): set it to \
                     the standard base64 encoding of the PEM file (e.g. base64 -w0 file.pem)"
                ),
            )
        })?;
    if !String::from_utf8_lossy(&decoded).contains("-----BEGIN") {
        return Err((
            shown(),
            format!(
                "TLS {what} for {protocol} listener does not decode to PEM: expected a \
                 -----BEGIN ...{pem_label}----- block inside the base64"
            ),
        ));
    }
    Ok(())
}

/// `admin`'s defaults and checks (both versions).
pub(super) fn validate_admin(admin: &mut AdminConfig) -> Result<(), ConfigError> {
    if admin.name.is_empty() {
        admin.name = DEFAULT_STUNNERD_NAME.to_owned();
    }
    if admin.loglevel.is_empty() {
        admin.loglevel = DEFAULT_LOG_LEVEL.to_owned();
    }
    if !admin.metrics_endpoint.is_empty() {
        parse_http_endpoint(&admin.metrics_endpoint, DEFAULT_METRICS_PORT).map_err(|why| {
            ConfigError::new(
                "admin.metrics_endpoint",
                admin.metrics_endpoint.as_str(),
                format!("{why} (leave it empty to run no metrics server)"),
            )
        })?;
    }
    match &admin.healthcheck_endpoint {
        None => admin.healthcheck_endpoint = Some(DEFAULT_HEALTHCHECK_ENDPOINT.to_owned()),
        Some(url) if url.is_empty() => {}
        Some(url) => {
            parse_http_endpoint(url, DEFAULT_HEALTHCHECK_PORT).map_err(|why| {
                ConfigError::new(
                    "admin.healthcheck_endpoint",
                    url.as_str(),
                    format!("{why} (set it to \"\" to disable health checks)"),
                )
            })?;
        }
    }
    if admin.user_quota < 0 {
        admin.user_quota = 0;
    }
    if admin.offload_engine.is_empty() {
        admin.offload_engine = OFFLOAD_ENGINES[0].to_owned();
    }
    match OFFLOAD_ENGINES
        .iter()
        .find(|engine| engine.eq_ignore_ascii_case(&admin.offload_engine))
    {
        Some(engine) => admin.offload_engine = (*engine).to_owned(),
        None => {
            return Err(ConfigError::new(
                "admin.offload_engine",
                admin.offload_engine.as_str(),
                "unknown offload mode: use None, XDP, TC or Auto",
            ))
        }
    }
    admin.offload_interfaces.sort();
    Ok(())
}

/// `auth`'s defaults and checks; v1 requires the credentials its type needs
/// (`require_credentials`), v2 lets them be missing (every client is then refused).
pub(super) fn validate_auth(
    auth: &mut AuthConfig,
    require_credentials: bool,
) -> Result<(), ConfigError> {
    let missing =
        |key: &str, message: &str| ConfigError::new(format!("auth.credentials.{key}"), "", message);
    match auth.auth_type {
        _ if !require_credentials => {}
        AuthType::Static => {
            for key in ["username", "password"] {
                if !auth.credentials.contains_key(key) {
                    return Err(missing(
                        key,
                        "static: empty username or password: static auth needs both the \
                         username and the password key under auth.credentials",
                    ));
                }
            }
        }
        AuthType::Ephemeral => {
            if !auth.credentials.contains_key("secret") {
                return Err(missing(
                    "secret",
                    "no secret found in ephemeral auth config: set the shared secret as \
                     auth.credentials.secret",
                ));
            }
        }
        AuthType::None => {}
    }
    if auth.realm.is_empty() {
        auth.realm = DEFAULT_REALM.to_owned();
    }
    if !auth.lifetime.is_empty() && go_duration(&auth.lifetime).is_none() {
        return Err(ConfigError::new(
            "auth.lifetime",
            auth.lifetime.as_str(),
            "invalid credential lifetime: write a duration such as 1h, 30m or 1h30m",
        ));
    }
    Ok(())
}

/// A Go `time.ParseDuration` value (`1h`, `1.5h`, `1h30m`, `300ms`, `-2s`), in seconds.
pub(super) fn go_duration(text: &str) -> Option<f64> {
    let (sign, mut rest) = match text.strip_prefix('-') {
        Some(rest) => (-1.0, rest),
        None => (1.0, text.strip_prefix('+').unwrap_or(text)),
    };
    if rest == "0" {
        return Some(0.0);
    }
    if rest.is_empty() {
        return None;
    }
    let mut total = 0.0;
    while !rest.is_empty() {
        let number_len = rest
            .bytes()
            .take_while(|b| b.is_ascii_digit() || *b == b'.')
            .count();
        let number: f64 = rest[..number_len].parse().ok()?;
        rest = &rest[number_len..];
        let unit_len = rest
            .bytes()
            .take_while(|b| !b.is_ascii_digit() && *b != b'.')
            .count();
        let scale = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" | "μs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return None,
        };
        rest = &rest[unit_len..];
        total += number * scale;
    }
    Some(sign * total)
}

/// Checks each endpoint of cluster `index` (of type `cluster_type`) with `parse`; the first
/// that fails, named by its field.
pub(super) fn check_endpoints(
    index: usize,
    cluster_type: ClusterType,
    endpoints: &[String],
    parse: impl Fn(ClusterType, &str) -> Result<(), String>,
) -> Result<(), ConfigError> {
    for (j, endpoint) in endpoints.iter().enumerate() {
        parse(cluster_type, endpoint).map_err(|why| {
            ConfigError::new(
                format!("clusters[{index}].endpoints[{j}]"),
                endpoint.as_str(),
                why,
            )
        })?;
    }
    Ok(())
}

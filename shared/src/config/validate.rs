//! v1's `StunnerDocument::validate`: stunnerd's defaults, normalization and checks, in
//! stunnerd's order (version, admin, auth, listeners, clusters); the first problem is returned.
//! The `admin` and `auth` rules are shared with v2 ([`validate_admin`], [`validate_auth`]).

use super::document::unsupported_version;
use super::ports::{check_shared_ports, Binding, PortUse};
use super::v1::StunnerDocument;
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

impl StunnerDocument {
    /// Injects defaults, normalizes and checks the config; `parse_config` already calls it.
    pub fn validate(&mut self) -> Result<(), ConfigError> {
        self.validate_with(true)
    }

    /// [`StunnerDocument::validate`], optionally letting TLS/DTLS listeners lack a cert and key
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

    /// Listeners that would split a port's clients ([`super::ports`]): a v1 listener binds its
    /// port on every address (its `address` is only what it advertises).
    fn check_shared_ports(&self) -> Result<(), ConfigError> {
        let uses: Vec<Option<PortUse<'_>>> = self
            .listeners
            .iter()
            .map(|listener| {
                listener.protocol.is_turn().then(|| PortUse {
                    name: &listener.name,
                    protocol: listener.protocol.as_str(),
                    datagram: listener.protocol.is_datagram(),
                    port: listener.port,
                    bind: None,
                })
            })
            .collect();
        check_shared_ports(&uses, Binding::EveryAddress)
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
    if !auth.lifetime.is_empty() && crate::go::parse_duration(&auth.lifetime).is_none() {
        return Err(ConfigError::new(
            "auth.lifetime",
            auth.lifetime.as_str(),
            "invalid credential lifetime: write a duration such as 1h, 30m or 1h30m",
        ));
    }
    Ok(())
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

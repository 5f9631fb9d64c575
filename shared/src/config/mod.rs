//! The stunnerd config: STUNner's v1 and v2 documents, parsed from YAML or JSON with stunnerd's
//! env substitution, defaults, normalization and validation, and read into one model of
//! STUNner v2's shape ([`StunnerConfig`]: listeners feed servers, servers relay through
//! clusters). A v1 document is validated by the v1 rules and converted as STUNner v2 converts
//! it ([`v1`]); what uturn does not serve (L4 servers, tunnelled clusters, STDIN listeners) is
//! refused with the field that asks for it.
//!
//! Parsing follows `sigs.k8s.io/yaml` + Go `encoding/json` as stunnerd uses them: unknown keys
//! are ignored, struct keys match case-insensitively (underscores matter), `null` is absent.
//! Every error names the field path, the offending value and the fix ([`ConfigError`]).

mod convert;
mod document;
mod endpoint;
mod uri;
pub mod v1;
mod v2;
mod validate;

pub use endpoint::{
    parse_http_endpoint, v1_endpoint_to_v2, Endpoint, HttpEndpoint, ServiceEndpoint, StaticEndpoint,
};
pub use uri::{parse_turn_uri, TurnUri};

use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;

/// The API version of the model every accepted config is read into (STUNner v2's).
pub const API_VERSION: &str = "v2";
/// STUNner v1's API version, converted on input.
pub const API_VERSION_V1: &str = "v1";
/// The older v1 API version, read as v1.
pub const API_VERSION_V1ALPHA1: &str = "v1alpha1";
/// Default `admin.name`.
pub const DEFAULT_STUNNERD_NAME: &str = "default-stunnerd";
/// Default `admin.loglevel`.
pub const DEFAULT_LOG_LEVEL: &str = "all:INFO";
/// Default `auth.realm`.
pub const DEFAULT_REALM: &str = "stunner.l7mp.io";
/// Default listener `port` (and `STUNNER_PORT`).
pub const DEFAULT_PORT: u16 = 3478;
/// Default v1 listener `address`.
pub const DEFAULT_LISTENER_ADDRESS: &str = "0.0.0.0";
/// Default `admin.healthcheck_endpoint` when the key is absent.
pub const DEFAULT_HEALTHCHECK_ENDPOINT: &str = "http://:8086";
/// Port of a health-check endpoint that names none.
pub const DEFAULT_HEALTHCHECK_PORT: u16 = 8086;
/// Port of a metrics endpoint that names none.
pub const DEFAULT_METRICS_PORT: u16 = 8080;

/// The running config, whatever API version it was written in: STUNner v2's shape (`admin`,
/// `auth`, `listeners`, `servers`, `clusters`). Only [`parse_config`] (and the constructors
/// below) make one, validated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StunnerConfig {
    /// Always [`API_VERSION`] (`v2`); [`StunnerConfig::v1`] tells a converted v1 document.
    pub version: String,
    /// Administrative settings.
    pub admin: AdminConfig,
    /// TURN authentication.
    pub auth: AuthConfig,
    /// The sockets clients reach, in config order; each hands its clients to its servers.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub listeners: Vec<ListenerConfig>,
    /// The TURN servers, in config order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub servers: Vec<ServerConfig>,
    /// The peers servers may reach and the relay addresses they advertise, in config order.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub clusters: Vec<ClusterConfig>,
    /// The v1 document this config was converted from (validated): what `/status` shows of a
    /// v1 config, and what makes peer admission enforce v1's port ranges. `None` for v2.
    #[serde(skip)]
    pub v1: Option<Arc<v1::StunnerConfig>>,
}

impl Default for StunnerConfig {
    fn default() -> Self {
        StunnerConfig {
            version: API_VERSION.to_owned(),
            admin: AdminConfig::default(),
            auth: AuthConfig::default(),
            listeners: Vec::new(),
            servers: Vec::new(),
            clusters: Vec::new(),
            v1: None,
        }
    }
}

/// The `admin` section.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct AdminConfig {
    /// Instance name; default `default-stunnerd`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub name: String,
    /// Log level spec; default `all:INFO`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub loglevel: String,
    /// Metrics server URL; empty means no metrics server.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub metrics_endpoint: String,
    /// Health-check server URL: `None` (absent) becomes `http://:8086`; `Some("")` disables it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub healthcheck_endpoint: Option<String>,
    /// Allocations allowed per user-id; 0 means no quota (negative values clamp to 0).
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub user_quota: i64,
    /// Offload engine, normalized to `None`, `XDP`, `TC` or `Auto`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub offload_engine: String,
    /// Interfaces to offload on (empty: all), sorted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub offload_interfaces: Vec<String>,
    /// Premium license info (`{"key": …, "hmac": …}`), kept as given.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub license_config: Option<serde_json::Value>,
}

/// The `auth` section.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct AuthConfig {
    /// Authentication mechanism (JSON key `type`).
    #[serde(rename = "type")]
    pub auth_type: AuthType,
    /// Realm used in challenges and in every long-term key; default `stunner.l7mp.io`.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub realm: String,
    /// Credentials: `username`+`password` (static) or `secret` (ephemeral), taken literally.
    pub credentials: BTreeMap<String, String>,
    /// v2: the lifetime of credentials stunnerd generates as a TURN client (a Go duration such
    /// as `1h`); uturn generates none, so it is only checked and shown.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub lifetime: String,
}

/// How TURN requests are authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AuthType {
    /// A fixed username and password (input alias `plaintext`).
    #[default]
    Static,
    /// TURN REST time-windowed credentials from a shared secret (input alias `longterm`).
    Ephemeral,
    /// TURN disabled; only Binding is served.
    None,
}

impl AuthType {
    /// Parses a config value exactly as stunnerd does: case-sensitive, with the old aliases.
    pub fn parse(s: &str) -> Option<AuthType> {
        match s {
            "static" | "plaintext" => Some(AuthType::Static),
            "ephemeral" | "longterm" => Some(AuthType::Ephemeral),
            "none" => Some(AuthType::None),
            _ => None,
        }
    }

    /// The normalized name: `static`, `ephemeral` or `none`.
    pub fn as_str(&self) -> &'static str {
        match self {
            AuthType::Static => "static",
            AuthType::Ephemeral => "ephemeral",
            AuthType::None => "none",
        }
    }
}

/// One `listeners[]` entry: a socket that hands its clients to a chain of servers.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ListenerConfig {
    /// Unique listener name (required).
    pub name: String,
    /// Transport; default `UDP`.
    pub protocol: Transport,
    /// The bind address: empty (the default) binds every address of both families.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub address: String,
    /// The port; default 3478.
    pub port: u16,
    /// Informational public address (ignored by the server).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub public_address: String,
    /// Informational public port (ignored by the server).
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub public_port: i64,
    /// Informational public addresses, one per family (ignored by the server).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub public_addresses: Vec<String>,
    /// Base64 (std) PEM certificate, required for TLS/DTLS.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cert: String,
    /// Base64 (std) PEM private key, required for TLS/DTLS.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub key: String,
    /// Post-quantum TLS mode (`preferred`, `enforced`; empty is the default), accepted and
    /// not acted on, as STUNner's open-source build does.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub pqc_mode: String,
    /// The servers its clients go to, in order: the first one serves them.
    pub servers: Vec<String>,
}

/// A listener's transport (v2 `protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Transport {
    /// UDP.
    #[default]
    Udp,
    /// TCP.
    Tcp,
    /// TLS over TCP.
    Tls,
    /// DTLS over UDP.
    Dtls,
    /// The process's stdin and stdout: refused by uturn.
    Stdin,
}

impl Transport {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<Transport> {
        [
            Transport::Udp,
            Transport::Tcp,
            Transport::Tls,
            Transport::Dtls,
            Transport::Stdin,
        ]
        .into_iter()
        .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, upper-case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            Transport::Udp => "UDP",
            Transport::Tcp => "TCP",
            Transport::Tls => "TLS",
            Transport::Dtls => "DTLS",
            Transport::Stdin => "STDIN",
        }
    }

    /// The TURN listener protocol of this transport (`None` for STDIN).
    pub fn turn(&self) -> Option<ListenerProtocol> {
        match self {
            Transport::Udp => Some(ListenerProtocol::TurnUdp),
            Transport::Tcp => Some(ListenerProtocol::TurnTcp),
            Transport::Tls => Some(ListenerProtocol::TurnTls),
            Transport::Dtls => Some(ListenerProtocol::TurnDtls),
            Transport::Stdin => None,
        }
    }
}

/// One `servers[]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ServerConfig {
    /// Unique server name (required); listeners name it in `servers`.
    pub name: String,
    /// What it serves (JSON key `type`); default `turn`.
    #[serde(rename = "type")]
    pub server_type: ServerType,
    /// The clusters it admits peers through and relays with, in order.
    pub clusters: Vec<String>,
}

/// What a server does with the clients a listener hands it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ServerType {
    /// TURN.
    #[default]
    Turn,
    /// A plain L4 proxy: refused by uturn.
    L4,
}

impl ServerType {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ServerType> {
        [ServerType::Turn, ServerType::L4]
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, lower-case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            ServerType::Turn => "turn",
            ServerType::L4 => "l4",
        }
    }
}

/// A listener's protocol stack as the dataplane serves it (and as a v1 document names it:
/// `TURN-UDP`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ListenerProtocol {
    /// TURN over UDP.
    #[default]
    TurnUdp,
    /// TURN over TCP.
    TurnTcp,
    /// TURN over TLS.
    TurnTls,
    /// TURN over DTLS.
    TurnDtls,
    /// Plain `UDP`: validates, but stunnerd refuses to start such a listener.
    Udp,
    /// Plain `TCP`: validates, but stunnerd refuses to start such a listener.
    Tcp,
    /// Plain `TLS`: validates, but stunnerd refuses to start such a listener.
    Tls,
    /// Plain `DTLS`: validates, but stunnerd refuses to start such a listener.
    Dtls,
}

impl ListenerProtocol {
    /// Every protocol, TURN ones first.
    pub const ALL: [ListenerProtocol; 8] = [
        ListenerProtocol::TurnUdp,
        ListenerProtocol::TurnTcp,
        ListenerProtocol::TurnTls,
        ListenerProtocol::TurnDtls,
        ListenerProtocol::Udp,
        ListenerProtocol::Tcp,
        ListenerProtocol::Tls,
        ListenerProtocol::Dtls,
    ];

    /// Parses a config value case-insensitively (`turn-udp`, `TURN-TLS`, `udp`, …).
    pub fn parse(s: &str) -> Option<ListenerProtocol> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, upper-case name (`TURN-UDP`, …).
    pub fn as_str(&self) -> &'static str {
        match self {
            ListenerProtocol::TurnUdp => "TURN-UDP",
            ListenerProtocol::TurnTcp => "TURN-TCP",
            ListenerProtocol::TurnTls => "TURN-TLS",
            ListenerProtocol::TurnDtls => "TURN-DTLS",
            ListenerProtocol::Udp => "UDP",
            ListenerProtocol::Tcp => "TCP",
            ListenerProtocol::Tls => "TLS",
            ListenerProtocol::Dtls => "DTLS",
        }
    }

    /// Whether stunnerd actually serves this protocol (only the four `TURN-*` ones).
    pub fn is_turn(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnUdp
                | ListenerProtocol::TurnTcp
                | ListenerProtocol::TurnTls
                | ListenerProtocol::TurnDtls
        )
    }

    /// Whether the listener needs `cert` and `key` (TLS and DTLS variants).
    pub fn needs_cert(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnTls
                | ListenerProtocol::TurnDtls
                | ListenerProtocol::Tls
                | ListenerProtocol::Dtls
        )
    }

    /// Whether the transport underneath is datagram based (UDP or DTLS).
    pub fn is_datagram(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnUdp
                | ListenerProtocol::TurnDtls
                | ListenerProtocol::Udp
                | ListenerProtocol::Dtls
        )
    }
}

/// One `clusters[]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ClusterConfig {
    /// Unique cluster name (required); servers name it in `clusters`.
    pub name: String,
    /// Address resolution policy (JSON key `type`); default `STATIC`.
    #[serde(rename = "type")]
    pub cluster_type: ClusterType,
    /// Relay transport (mandatory in a v2 document).
    pub protocol: ClusterProtocol,
    /// Peers, in the v2 syntax ([`Endpoint::parse`]; KUBERNETES: [`ServiceEndpoint::parse_v2`]).
    /// Sorted.
    pub endpoints: Vec<String>,
    /// How peers are admitted; default `FILTER`.
    pub routing_policy: RoutingPolicy,
    /// The relay addresses the cluster advertises, one per family (entries split on commas).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub addresses: Vec<String>,
    /// An upstream TURN server the peers are reached through: refused by uturn.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tunnel: Option<serde_json::Value>,
}

/// How a cluster admits peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RoutingPolicy {
    /// Admits the peers its endpoints contain (by IP in a v2 config).
    #[default]
    Filter,
    /// Picks one endpoint per flow (for L4 servers): admits no TURN peer.
    RoundRobin,
}

impl RoutingPolicy {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<RoutingPolicy> {
        [RoutingPolicy::Filter, RoutingPolicy::RoundRobin]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `FILTER` or `ROUND_ROBIN`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RoutingPolicy::Filter => "FILTER",
            RoutingPolicy::RoundRobin => "ROUND_ROBIN",
        }
    }
}

/// A cluster's address resolution policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ClusterType {
    /// Endpoints are IP prefixes with optional port ranges.
    #[default]
    Static,
    /// Endpoints are hostnames, re-resolved every 5 s, matched on IP only.
    StrictDns,
    /// Endpoints are Kubernetes Services, `<namespace>/<service>[:<min-max>]`: the cluster
    /// admits every address their EndpointSlices list (ready, serving and terminating) plus
    /// the Services' ClusterIPs.
    Kubernetes,
}

impl ClusterType {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ClusterType> {
        [
            ClusterType::Static,
            ClusterType::StrictDns,
            ClusterType::Kubernetes,
        ]
        .into_iter()
        .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `STATIC`, `STRICT_DNS` or `KUBERNETES`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ClusterType::Static => "STATIC",
            ClusterType::StrictDns => "STRICT_DNS",
            ClusterType::Kubernetes => "KUBERNETES",
        }
    }
}

/// A cluster's relay transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ClusterProtocol {
    /// UDP relaying.
    #[default]
    Udp,
    /// TCP relaying (RFC 6062).
    Tcp,
}

impl ClusterProtocol {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ClusterProtocol> {
        [ClusterProtocol::Udp, ClusterProtocol::Tcp]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `UDP` or `TCP`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ClusterProtocol::Udp => "UDP",
            ClusterProtocol::Tcp => "TCP",
        }
    }
}

macro_rules! string_enum_impls {
    ($($ty:ty),*) => {$(
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }
    )*};
}

string_enum_impls!(
    AuthType,
    ListenerProtocol,
    Transport,
    ServerType,
    ClusterType,
    ClusterProtocol,
    RoutingPolicy
);

fn is_zero_i64(n: &i64) -> bool {
    *n == 0
}

/// A config the user must fix: which field, what it held, and what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ConfigError {
    /// Path of the offending field, e.g. `listeners[0].port` (empty for a syntax error).
    pub field: String,
    /// The offending value as written (secrets redacted).
    pub value: String,
    /// What is wrong and how to fix it.
    pub message: String,
}

impl ConfigError {
    /// Builds an error for `field` holding `value`.
    pub fn new(
        field: impl Into<String>,
        value: impl Into<String>,
        message: impl Into<String>,
    ) -> Self {
        ConfigError {
            field: field.into(),
            value: value.into(),
            message: message.into(),
        }
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid config: {}", self.message)
        } else {
            write!(
                f,
                "invalid config: {} = {:?}: {}",
                self.field, self.value, self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

/// Parses and validates a config with the process environment for `$VAR` substitution.
pub fn parse_config(text: &str) -> Result<StunnerConfig, ConfigError> {
    parse_config_with_env(text, &|key| std::env::var(key).ok())
}

/// Parses and validates a v1 or v2 config, looking up `$VAR`/`${VAR}` with `env`
/// (stunnerd.md §2.6): substitution runs first, then `version` picks the schema (`v1` and
/// `v1alpha1` are validated as v1 and converted, `v2` is validated as it is).
///
/// `STUNNER_PORT` is defaulted first: if `env` has no numeric value for it, it reads as
/// `STUNNER_PUBLIC_PORT` (when numeric) or `3478`. The process environment is never touched.
/// `auth.credentials` values are taken from the text before substitution.
pub fn parse_config_with_env(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StunnerConfig, ConfigError> {
    let (doc, raw_credentials) = document::read(text, env)?;
    match document::version(&doc)?.as_str() {
        API_VERSION => v2::config_from_document(&doc, raw_credentials.as_ref()),
        API_VERSION_V1 | API_VERSION_V1ALPHA1 => {
            let mut v1 = v1::config_from_document(&doc, raw_credentials.as_ref())?;
            v1.validate()?;
            convert::from_v1(v1, true)
        }
        other => Err(document::unsupported_version(other)),
    }
}

impl StunnerConfig {
    /// The zero config stunnerd bootstraps with and that CDS sends as a delete (v2's, which a
    /// v1 zero config converts to), validated.
    pub fn zero(id: &str) -> Self {
        let mut config = StunnerConfig {
            admin: AdminConfig {
                name: id.to_owned(),
                ..AdminConfig::default()
            },
            auth: AuthConfig {
                auth_type: AuthType::Static,
                realm: DEFAULT_REALM.to_owned(),
                credentials: BTreeMap::from([
                    ("username".to_owned(), "dummy-username".to_owned()),
                    ("password".to_owned(), "dummy-password".to_owned()),
                ]),
                lifetime: String::new(),
            },
            ..StunnerConfig::default()
        };
        // The literal above always validates; validation only fills in the defaults.
        let _ = config.validate();
        config
    }

    /// Whether this is a zero (delete) config, of either version: equal to
    /// [`StunnerConfig::zero`] of its own name, with the log level and the license ignored
    /// (`--license` sets it in every config; the bootstrap config stays a zero one).
    pub fn is_zero(&self) -> bool {
        let mut this = self.clone();
        this.v1 = None;
        this.admin.license_config = None;
        if this.validate().is_err() {
            return false;
        }
        let mut zero = StunnerConfig::zero(&this.admin.name);
        zero.admin.loglevel = this.admin.loglevel.clone();
        this == zero
    }

    /// The API version the config was written in: `v1` or `v2`.
    pub fn source_version(&self) -> &'static str {
        if self.v1.is_some() {
            API_VERSION_V1
        } else {
            API_VERSION
        }
    }

    /// Serializes the config as written, with stunnerd's JSON key names (empty optional
    /// fields left out): a v1 config as its (validated) v1 document, a v2 one as v2.
    pub fn to_json(&self) -> String {
        let json = match &self.v1 {
            Some(v1) => serde_json::to_string(v1.as_ref()),
            None => serde_json::to_string(self),
        };
        json.unwrap_or_else(|_| String::from("{}"))
    }

    /// The built-in config of a TURN URI (stunnerd.md §2.7), validated; errors name `TURN-URI`.
    ///
    /// For `turns:` and `transport=tls|dtls` the listener's `cert` and `key` are left empty:
    /// the caller generates a self-signed pair (stunnerd uses RSA-4096) and sets them.
    pub fn from_turn_uri(uri: &str) -> Result<Self, ConfigError> {
        uri::config_from_turn_uri(uri)
    }

    /// The server called `name`.
    pub fn server(&self, name: &str) -> Option<&ServerConfig> {
        self.servers.iter().find(|s| s.name == name)
    }

    /// The cluster called `name`.
    pub fn cluster(&self, name: &str) -> Option<&ClusterConfig> {
        self.clusters.iter().find(|c| c.name == name)
    }

    /// The TURN server that serves `listener`'s clients: the first of its chain, if that is
    /// a TURN server (a missing one is skipped at runtime, as stunnerd does).
    pub fn turn_server(&self, listener: &ListenerConfig) -> Option<&ServerConfig> {
        let server = self.server(listener.servers.first()?)?;
        (server.server_type == ServerType::Turn).then_some(server)
    }

    /// The protocol the dataplane serves `listener` with: TURN over its transport when a TURN
    /// server serves it, `None` when nothing does.
    pub fn listener_protocol(&self, listener: &ListenerConfig) -> Option<ListenerProtocol> {
        self.turn_server(listener)?;
        listener.protocol.turn()
    }

    /// The clusters `server` relays through, in its order (missing ones skipped).
    pub fn server_clusters<'a>(
        &'a self,
        server: &'a ServerConfig,
    ) -> impl Iterator<Item = &'a ClusterConfig> + 'a {
        server.clusters.iter().filter_map(|name| self.cluster(name))
    }

    /// What the config asks for that works otherwise than its author may expect, one line
    /// each, for the log when it is applied.
    pub fn warnings(&self) -> Vec<String> {
        v2::warnings(self)
    }
}

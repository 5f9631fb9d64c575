//! The stunnerd v1 config schema (`StunnerConfig`): parsing YAML or JSON with stunnerd's env
//! substitution, defaults, normalization and validation, the zero config and the built-in
//! config of a TURN URI.
//!
//! Parsing follows `sigs.k8s.io/yaml` + Go `encoding/json` as stunnerd uses them: unknown keys
//! are ignored, struct keys match case-insensitively (underscores matter), `null` is absent.
//! Every error names the field path, the offending value and the fix ([`ConfigError`]).

mod document;
mod endpoint;
mod uri;
mod validate;

pub use endpoint::{parse_http_endpoint, HttpEndpoint, ServiceEndpoint, StaticEndpoint};
pub use uri::{parse_turn_uri, TurnUri};

use serde::{Serialize, Serializer};
use std::collections::BTreeMap;
use std::fmt;

/// The API version every accepted config is converted to.
pub const API_VERSION: &str = "v1";
/// The older API version accepted on input and converted to [`API_VERSION`].
pub const API_VERSION_V1ALPHA1: &str = "v1alpha1";
/// Default `admin.name`.
pub const DEFAULT_STUNNERD_NAME: &str = "default-stunnerd";
/// Default `admin.loglevel`.
pub const DEFAULT_LOG_LEVEL: &str = "all:INFO";
/// Default `auth.realm`.
pub const DEFAULT_REALM: &str = "stunner.l7mp.io";
/// Default listener `port` (and `STUNNER_PORT`).
pub const DEFAULT_PORT: u16 = 3478;
/// Default listener `address`.
pub const DEFAULT_LISTENER_ADDRESS: &str = "0.0.0.0";
/// Default `admin.healthcheck_endpoint` when the key is absent.
pub const DEFAULT_HEALTHCHECK_ENDPOINT: &str = "http://:8086";
/// Port of a health-check endpoint that names none.
pub const DEFAULT_HEALTHCHECK_PORT: u16 = 8086;
/// Port of a metrics endpoint that names none.
pub const DEFAULT_METRICS_PORT: u16 = 8080;

/// A complete stunnerd config (`version`, `admin`, `auth`, `listeners`, `clusters`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StunnerConfig {
    /// API version; `"v1"` once validated.
    pub version: String,
    /// Administrative settings.
    pub admin: AdminConfig,
    /// TURN authentication.
    pub auth: AuthConfig,
    /// The server sockets exposed to clients, in config order.
    pub listeners: Vec<ListenerConfig>,
    /// The peers clients may reach, in config order.
    pub clusters: Vec<ClusterConfig>,
}

impl Default for StunnerConfig {
    fn default() -> Self {
        StunnerConfig {
            version: API_VERSION.to_owned(),
            admin: AdminConfig::default(),
            auth: AuthConfig::default(),
            listeners: Vec::new(),
            clusters: Vec::new(),
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

/// One `listeners[]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ListenerConfig {
    /// Unique listener name (required).
    pub name: String,
    /// Transport and protocol stack; default `TURN-UDP`.
    pub protocol: ListenerProtocol,
    /// Informational public address (ignored by the server).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub public_address: String,
    /// Informational public port (ignored by the server).
    #[serde(skip_serializing_if = "is_zero_i64")]
    pub public_port: i64,
    /// The relay IP advertised in XOR-RELAYED-ADDRESS (not the bind address); default `0.0.0.0`.
    pub address: String,
    /// The port bound on the wildcard address; default 3478.
    pub port: u16,
    /// Base64 (std) PEM certificate, required for TLS/DTLS.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub cert: String,
    /// Base64 (std) PEM private key, required for TLS/DTLS.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub key: String,
    /// Names of the clusters this listener may relay to, sorted.
    pub routes: Vec<String>,
}

/// A listener's protocol stack.
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
    /// Unique cluster name (required); listeners name it in `routes`.
    pub name: String,
    /// Address resolution policy (JSON key `type`); default `STATIC`.
    #[serde(rename = "type")]
    pub cluster_type: ClusterType,
    /// Relay transport; default `UDP`.
    pub protocol: ClusterProtocol,
    /// STATIC: `IP[/len][:<min-max>]`; STRICT_DNS: hostnames; KUBERNETES:
    /// `<namespace>/<service>[:<min-max>]`. Sorted.
    pub endpoints: Vec<String>,
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

string_enum_impls!(AuthType, ListenerProtocol, ClusterType, ClusterProtocol);

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

/// Parses and validates a config, looking up `$VAR`/`${VAR}` with `env` (stunnerd.md §2.6).
///
/// `STUNNER_PORT` is defaulted first: if `env` has no numeric value for it, it reads as
/// `STUNNER_PUBLIC_PORT` (when numeric) or `3478`. The process environment is never touched.
/// `auth.credentials` values are taken from the text before substitution.
pub fn parse_config_with_env(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StunnerConfig, ConfigError> {
    let env_with_port = |key: &str| {
        if key == "STUNNER_PORT" {
            Some(document::stunner_port(env))
        } else {
            env(key)
        }
    };
    let expanded = document::expand_env(text, &env_with_port);
    // stunnerd#102: credentials are taken literally, so a `$` in a password survives.
    let raw_credentials = document::parse_document(text)
        .ok()
        .and_then(|raw| document::literal_credentials(&raw));
    let doc = document::parse_document(&expanded)?;
    let mut config = document::config_from_document(&doc, raw_credentials.as_ref())?;
    config.validate()?;
    Ok(config)
}

impl StunnerConfig {
    /// The zero config stunnerd bootstraps with and that CDS sends as a delete, validated.
    pub fn zero(id: &str) -> Self {
        let mut config = StunnerConfig {
            version: API_VERSION.to_owned(),
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
            },
            listeners: Vec::new(),
            clusters: Vec::new(),
        };
        // The literal above always validates; validation only fills in the defaults.
        let _ = config.validate();
        config
    }

    /// Whether this is a zero (delete) config: equal to [`StunnerConfig::zero`] of its own
    /// name after validation, with the log level ignored.
    pub fn is_zero(&self) -> bool {
        let mut this = self.clone();
        if this.validate().is_err() {
            return false;
        }
        let mut zero = StunnerConfig::zero(&this.admin.name);
        zero.admin.loglevel = this.admin.loglevel.clone();
        this == zero
    }

    /// Serializes with stunnerd's JSON key names (empty optional fields left out).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }

    /// The built-in config of a TURN URI (stunnerd.md §2.7), validated; errors name `TURN-URI`.
    ///
    /// For `turns:` and `transport=tls|dtls` the listener's `cert` and `key` are left empty:
    /// the caller generates a self-signed pair (stunnerd uses RSA-4096) and sets them.
    pub fn from_turn_uri(uri: &str) -> Result<Self, ConfigError> {
        uri::config_from_turn_uri(uri)
    }
}

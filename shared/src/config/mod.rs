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
mod error;
mod keys;
mod ports;
mod uri;
pub mod v1;
mod v2;
mod validate;
mod values;
mod warnings;

pub use endpoint::{
    parse_http_endpoint, v1_endpoint_to_v2, Endpoint, HttpEndpoint, ServiceEndpoint, StaticEndpoint,
};
pub use error::ConfigError;
pub use uri::{parse_turn_uri, TurnUri};
pub use values::{
    AuthType, ClusterProtocol, ClusterType, ListenerProtocol, RoutingPolicy, ServerType, Transport,
};

use serde::Serialize;
use std::collections::BTreeMap;
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
    pub v1: Option<Arc<v1::StunnerDocument>>,
    /// What the reader noticed in the document that is not an error (an unknown key, a port
    /// written as 0), each naming the fix; [`StunnerConfig::warnings`] lists them. They do
    /// not make two configs differ.
    #[serde(skip)]
    pub document_warnings: DocumentWarnings,
}

/// Warnings about a config's document ([`StunnerConfig::document_warnings`]): equal to any
/// other, so that a config compares by what it says, not by how it was written (a document
/// with an unknown key and its own JSON, which drops the key, are the same config).
#[derive(Debug, Clone, Default, Eq)]
pub struct DocumentWarnings(pub Vec<String>);

impl PartialEq for DocumentWarnings {
    fn eq(&self, _: &DocumentWarnings) -> bool {
        true
    }
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
            document_warnings: DocumentWarnings::default(),
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
    /// uturn: the state directory that keeps allocations across a restart (`--state-dir`
    /// overrides it); read when the process starts. Empty: none.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub state_dir: String,
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

/// Whether an integer field holds its default, 0 (left out of the JSON).
pub(super) fn is_zero_i64(n: &i64) -> bool {
    *n == 0
}

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
    let version = document::version(&doc)?;
    let mut config = match version.as_str() {
        API_VERSION => v2::config_from_document(&doc, raw_credentials.as_ref()),
        API_VERSION_V1 | API_VERSION_V1ALPHA1 => {
            let mut v1 = v1::config_from_document(&doc, raw_credentials.as_ref())?;
            v1.validate()?;
            convert::from_v1(v1, true)
        }
        other => Err(document::unsupported_version(other)),
    }?;
    config.document_warnings = DocumentWarnings(keys::document_warnings(&doc, &version));
    Ok(config)
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
}

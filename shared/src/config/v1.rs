//! STUNner v1's config document: read and validated by v1's rules (the listener `address` is
//! the relay address, `routes` name clusters, endpoints are `IP[/len][:<min-max>]`), then
//! converted into the running model ([`super::StunnerConfig`]) as STUNner v2 converts it.

use super::{
    is_zero_i64, AdminConfig, AuthConfig, ClusterProtocol, ClusterType, ConfigError,
    ListenerProtocol, API_VERSION_V1,
};
use serde::Serialize;

pub(super) use super::document::v1_config_from_document as config_from_document;

/// Parses and validates a v1 (or v1alpha1) document, with `env` for `$VAR` substitution, as
/// the v1 document it is (the model reads it through [`super::parse_config_with_env`]).
pub fn parse_config_with_env(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<StunnerDocument, ConfigError> {
    let (doc, raw_credentials) = super::document::read(text, env)?;
    let mut config = config_from_document(&doc, raw_credentials.as_ref())?;
    config.validate()?;
    Ok(config)
}

/// A STUNner v1 config document (`version`, `admin`, `auth`, `listeners`, `clusters`), as
/// written: the model it converts to is [`super::StunnerConfig`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StunnerDocument {
    /// API version; `"v1"` once validated.
    pub version: String,
    /// Administrative settings.
    pub admin: AdminConfig,
    /// TURN authentication.
    pub auth: AuthConfig,
    /// The server sockets exposed to clients, in config order.
    pub listeners: Vec<ListenerDocument>,
    /// The peers clients may reach, in config order.
    pub clusters: Vec<ClusterDocument>,
}

impl Default for StunnerDocument {
    fn default() -> Self {
        StunnerDocument {
            version: API_VERSION_V1.to_owned(),
            admin: AdminConfig::default(),
            auth: AuthConfig::default(),
            listeners: Vec::new(),
            clusters: Vec::new(),
        }
    }
}

impl StunnerDocument {
    /// Serializes with stunnerd's JSON key names (empty optional fields left out).
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_else(|_| String::from("{}"))
    }
}

/// One `listeners[]` entry of a v1 document (the model's is [`super::ListenerConfig`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ListenerDocument {
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

/// One `clusters[]` entry of a v1 document (the model's is [`super::ClusterConfig`]).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize)]
pub struct ClusterDocument {
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

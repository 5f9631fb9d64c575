//! Config origins as stunnerd names them: which one a `-c` value means, the one-shot load, and
//! the watchers that follow a file ([`file`](mod@file)) or a config discovery server
//! ([`cds`]) and send every new valid config.

pub mod cds;
pub mod cds_message;
pub mod file;

use std::path::PathBuf;
use uturn_shared::config::{parse_config, StunnerConfig};

/// Where the config comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConfigOrigin {
    /// `file://PATH`.
    File(PathBuf),
    /// A CDS server URL (`http://`, `https://`, `ws://`, `wss://`; bare `IP:port` gets `http://`).
    Cds(String),
    /// `k8s`: discover the CDS server in Kubernetes.
    K8s,
}

impl ConfigOrigin {
    /// Parses an origin exactly as stunnerd does: anything without a known scheme is CDS.
    pub fn parse(origin: &str) -> ConfigOrigin {
        if let Some(path) = origin.strip_prefix("file://") {
            return ConfigOrigin::File(PathBuf::from(path));
        }
        if origin == "k8s" {
            return ConfigOrigin::K8s;
        }
        if ["http://", "https://", "ws://", "wss://"]
            .iter()
            .any(|p| origin.starts_with(p))
        {
            return ConfigOrigin::Cds(origin.to_string());
        }
        ConfigOrigin::Cds(format!("http://{origin}"))
    }
}

/// Why a config could not be loaded.
#[derive(Debug)]
pub enum LoadError {
    /// The file could not be read.
    Read(PathBuf, std::io::Error),
    /// The config is invalid.
    Invalid(uturn_shared::config::ConfigError),
    /// The config discovery service failed or sent an invalid config.
    Cds(String),
    /// This origin is not implemented yet.
    Unsupported(String),
}

impl std::fmt::Display for LoadError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LoadError::Read(path, e) => write!(f, "cannot read config file {path:?}: {e}"),
            LoadError::Invalid(e) => write!(f, "{e}"),
            LoadError::Cds(what) | LoadError::Unsupported(what) => write!(f, "{what}"),
        }
    }
}

impl std::error::Error for LoadError {}

/// Loads one config from `origin` (no watching); `id` (`<namespace>/<name>`) and `node` say
/// which config to ask a CDS server for.
pub fn load_once(
    origin: &ConfigOrigin,
    id: &str,
    node: Option<&str>,
) -> Result<StunnerConfig, LoadError> {
    match origin {
        ConfigOrigin::File(path) => {
            let text =
                std::fs::read_to_string(path).map_err(|e| LoadError::Read(path.clone(), e))?;
            parse_config(&text).map_err(LoadError::Invalid)
        }
        ConfigOrigin::Cds(url) => {
            let target = cds::CdsTarget::new(url, id, node).map_err(LoadError::Cds)?;
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| LoadError::Cds(e.to_string()))?;
            runtime
                .block_on(cds::fetch(&target))
                .map_err(LoadError::Cds)
        }
        ConfigOrigin::K8s => Err(LoadError::Unsupported(
            "config origin \"k8s\" (finding the CDS server through the Kubernetes API) is not supported yet by uturn; give the CDS address instead: -c http://HOST:13478".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_parse_like_stunnerd() {
        assert_eq!(
            ConfigOrigin::parse("file:///etc/stunnerd.conf"),
            ConfigOrigin::File("/etc/stunnerd.conf".into())
        );
        assert_eq!(
            ConfigOrigin::parse(":13478"),
            ConfigOrigin::Cds("http://:13478".into())
        );
        // A bare path is a CDS URL in stunnerd too.
        assert_eq!(
            ConfigOrigin::parse("/etc/x.conf"),
            ConfigOrigin::Cds("http:///etc/x.conf".into())
        );
        assert_eq!(ConfigOrigin::parse("k8s"), ConfigOrigin::K8s);
        assert_eq!(
            ConfigOrigin::parse("ws://a:1"),
            ConfigOrigin::Cds("ws://a:1".into())
        );
    }
}

//! Second-chance forwarding as the binary sets it up: `--siblings` read into a
//! [`SiblingsFlag`], where the control plane finds the siblings and the key the shards
//! authenticate them with ([`forwarding`]), and `/status`'s `siblings` section
//! ([`status_section`]).

use std::net::IpAddr;
use std::path::Path;
use uturn_control::state::Siblings;
use uturn_dataplane::io::{Dataplane, SiblingSetup};
use uturn_dataplane::proto::sibling::SiblingKeys;
use uturn_shared::snapshot::SnapshotHandle;

/// `--siblings`: where the other pods of this gateway are found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum SiblingsFlag {
    /// `k8s`: the pods of the Service `--id` names (`<namespace>/<gateway>` under STUNner's
    /// operator).
    OwnService,
    /// `k8s:<namespace>/<service>`: the pods of that Service.
    Service(String),
    /// `static:<ip>,<ip>,…`: a fixed list (outside Kubernetes).
    Static(Vec<IpAddr>),
}

impl std::str::FromStr for SiblingsFlag {
    type Err = String;

    fn from_str(spec: &str) -> Result<SiblingsFlag, String> {
        match spec.split_once(':') {
            None if spec == "k8s" => Ok(SiblingsFlag::OwnService),
            Some(("k8s", service)) if service.split_once('/').is_some() => {
                Ok(SiblingsFlag::Service(service.to_owned()))
            }
            Some(("static", list)) => list
                .split(',')
                .filter(|s| !s.trim().is_empty())
                .map(|s| {
                    s.trim()
                        .parse()
                        .map_err(|_| format!("{s:?} is not an IP address"))
                })
                .collect::<Result<_, _>>()
                .map(SiblingsFlag::Static),
            _ => Err("use k8s, k8s:<namespace>/<service> or static:<ip>,<ip>".to_owned()),
        }
    }
}

/// Where the control plane finds the siblings of `flag` (`id` is this instance's
/// `<namespace>/<name>`, the Service `k8s` means), and the shards' forwarding setup with the
/// key the pods share: from `key_file` (followed, so a key rotates without a restart), else
/// from `UTURN_SIBLING_KEY` (read once). `None` when forwarding is off.
pub(crate) fn forwarding(
    flag: Option<&SiblingsFlag>,
    id: &str,
    key_file: Option<&str>,
    port: u16,
) -> Result<Option<(Siblings, SiblingSetup)>, String> {
    let Some(flag) = flag else {
        return Ok(None);
    };
    let siblings = match flag {
        SiblingsFlag::OwnService => Siblings::Service(id.to_owned()),
        SiblingsFlag::Service(service) => Siblings::Service(service.clone()),
        SiblingsFlag::Static(ips) => Siblings::Static(ips.clone()),
    };
    let setup = match (key_file, std::env::var("UTURN_SIBLING_KEY")) {
        (Some(path), _) => SiblingSetup::from_key_file(Path::new(path), port)?,
        (None, Ok(keys)) => SiblingSetup::new(
            SiblingKeys::parse(keys.as_bytes()).map_err(|e| format!("UTURN_SIBLING_KEY: {e}"))?,
            port,
        ),
        (None, Err(_)) => {
            return Err(
                "--siblings needs the key the gateway's pods share: --sibling-key-file PATH \
                 (a mounted Secret) or UTURN_SIBLING_KEY"
                    .to_owned(),
            )
        }
    };
    Ok(Some((siblings, setup)))
}

/// `/status`'s `siblings` section: each sibling the running snapshot names, and how many
/// clients this pod forwards to it.
pub(crate) fn status_section(
    dataplane: &Dataplane,
    snapshot: &SnapshotHandle,
) -> serde_json::Value {
    let forwarding_for = dataplane.forwarding_by_sibling();
    let siblings: Vec<serde_json::Value> = snapshot
        .load()
        .sibling_ips
        .iter()
        .map(|ip| {
            let n = forwarding_for
                .iter()
                .find(|counted| counted.sibling == *ip)
                .map_or(0, |counted| counted.clients);
            serde_json::json!({"address": ip, "forwarding_for": n})
        })
        .collect();
    serde_json::Value::Array(siblings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn siblings_specs_parse_into_their_modes() {
        assert_eq!("k8s".parse(), Ok(SiblingsFlag::OwnService));
        assert_eq!(
            "k8s:media/gw".parse(),
            Ok(SiblingsFlag::Service("media/gw".into()))
        );
        assert_eq!(
            "static:10.0.0.2, 10.0.0.3,".parse(),
            Ok(SiblingsFlag::Static(vec![
                "10.0.0.2".parse().unwrap(),
                "10.0.0.3".parse().unwrap()
            ]))
        );
        assert!("static:10.0.0.x"
            .parse::<SiblingsFlag>()
            .unwrap_err()
            .contains("\"10.0.0.x\" is not an IP address"));
        for bad in ["k8s:gw", "dns:x", ""] {
            assert!(
                bad.parse::<SiblingsFlag>().unwrap_err().contains("use k8s"),
                "{bad}"
            );
        }
    }
}

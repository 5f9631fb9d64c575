//! KUBERNETES clusters: watch a Service's `discovery.k8s.io/v1` EndpointSlices and the Service
//! itself with the kube-rs runtime watcher (with its default backoff), and report every address
//! the slices list, ready, serving and terminating alike (a draining media pod keeps its calls),
//! plus the Service's ClusterIPs.

use crate::outbox::Outbox;
use crate::state::{ServiceChange, SliceAddresses};
use futures_util::StreamExt;
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

const CLIENT_RETRY: Duration = Duration::from_secs(5);

/// The Service a watch follows, `<namespace>/<service>`, and which watch of it this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceWatch {
    /// `<namespace>/<service>`.
    pub key: String,
    /// The [`crate::state::ServiceState::watch`] id the watch was started for.
    pub watch: u64,
}

impl std::fmt::Display for ServiceWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}

/// What a Service watch reports: a change one watch of one Service saw.
#[derive(Debug)]
pub struct ServiceUpdate {
    /// The Service and the watch that saw the change.
    pub service: ServiceWatch,
    /// The change.
    pub change: ServiceChange,
}

/// How to reach the API server: the kubectl flags stunnerd accepts. With none set, kube-rs
/// infers the config: `KUBECONFIG` or `~/.kube/config`, else the in-cluster service account.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KubeOptions {
    /// `--kubeconfig`.
    pub kubeconfig: Option<PathBuf>,
    /// `--context`.
    pub context: Option<String>,
    /// `--cluster`.
    pub cluster: Option<String>,
    /// `--user`.
    pub user: Option<String>,
    /// `--server`: the API server URL, overriding the kubeconfig's.
    pub server: Option<String>,
    /// `--token`: a bearer token, overriding the kubeconfig's.
    pub token: Option<String>,
    /// `--insecure-skip-tls-verify`.
    pub insecure_skip_tls_verify: bool,
    /// `--tls-server-name`.
    pub tls_server_name: Option<String>,
    /// `--certificate-authority`: a PEM file of CAs for the API server, overriding the
    /// kubeconfig's (re-read as it changes).
    pub certificate_authority: Option<PathBuf>,
    /// `--client-certificate`: a PEM client certificate file, overriding the kubeconfig's.
    pub client_certificate: Option<PathBuf>,
    /// `--client-key`: the PEM key file of `--client-certificate`.
    pub client_key: Option<PathBuf>,
    /// `--as`: the user to impersonate.
    pub impersonate: Option<String>,
    /// `--as-group`: the groups to impersonate (repeatable).
    pub impersonate_groups: Vec<String>,
    /// `--as-uid`: the UID to impersonate.
    pub impersonate_uid: Option<String>,
    /// `--request-timeout`: bounds connecting to the API server and sending a request (a
    /// watch that stays open is not cut by it).
    pub request_timeout: Option<Duration>,
}

impl KubeOptions {
    /// Checks what can be checked before the first connection: the files the flags name are
    /// readable. The error names the flag, the value and the fix.
    pub fn check(&self) -> Result<(), String> {
        for (flag, path) in [
            ("--certificate-authority", &self.certificate_authority),
            ("--client-certificate", &self.client_certificate),
            ("--client-key", &self.client_key),
        ] {
            if let Some(path) = path {
                std::fs::metadata(path)
                    .and_then(|m| {
                        if m.is_file() {
                            std::fs::File::open(path).map(|_| ())
                        } else {
                            Err(std::io::Error::other("not a file"))
                        }
                    })
                    .map_err(|e| {
                        format!(
                            "{flag} {:?}: cannot read it: {e}; name a readable PEM file",
                            path.display().to_string()
                        )
                    })?;
            }
        }
        if self.client_certificate.is_some() != self.client_key.is_some() {
            return Err(
                "--client-certificate and --client-key go together: give both, or neither".into(),
            );
        }
        Ok(())
    }
}

/// Parses `--request-timeout` as kubectl does: `0` is no timeout, a bare integer is seconds,
/// otherwise a Go duration such as `5s`, `1m30s` or `500ms`.
pub fn parse_request_timeout(value: &str) -> Result<Option<Duration>, String> {
    let bad = || {
        format!(
            "--request-timeout {value:?} is not a duration; use e.g. 30s, 1m or 500ms (0: no timeout)"
        )
    };
    if let Ok(seconds) = value.parse::<u64>() {
        return Ok((seconds > 0).then(|| Duration::from_secs(seconds)));
    }
    let mut total = Duration::ZERO;
    let mut rest = value;
    if rest.is_empty() {
        return Err(bad());
    }
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let number: f64 = rest[..digits].parse().map_err(|_| bad())?;
        rest = &rest[digits..];
        let unit_len = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let unit = match &rest[..unit_len] {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        rest = &rest[unit_len..];
        total += Duration::try_from_secs_f64(number * unit).map_err(|_| bad())?;
    }
    Ok((!total.is_zero()).then_some(total))
}

/// Builds a kube-rs client from `options`.
pub async fn client(options: &KubeOptions) -> Result<Client, String> {
    use kube::config::{KubeConfigOptions, Kubeconfig};
    let selection = KubeConfigOptions {
        context: options.context.clone(),
        cluster: options.cluster.clone(),
        user: options.user.clone(),
    };
    let explicit =
        selection.context.is_some() || selection.cluster.is_some() || selection.user.is_some();
    let mut config = match &options.kubeconfig {
        Some(path) => {
            let kubeconfig = Kubeconfig::read_from(path)
                .map_err(|e| format!("cannot read kubeconfig {}: {e}", path.display()))?;
            kube::Config::from_custom_kubeconfig(kubeconfig, &selection)
                .await
                .map_err(|e| format!("invalid kubeconfig {}: {e}", path.display()))?
        }
        None if explicit => kube::Config::from_kubeconfig(&selection)
            .await
            .map_err(|e| format!("invalid kubeconfig: {e}"))?,
        None => kube::Config::infer().await.map_err(|e| {
            format!(
                "no Kubernetes credentials: {e} (run in a pod with a service account, or set \
                 KUBECONFIG or --kubeconfig)"
            )
        })?,
    };
    if let Some(server) = &options.server {
        config.cluster_url = server
            .parse()
            .map_err(|e| format!("--server {server:?} is not a URL: {e}"))?;
    }
    if let Some(token) = &options.token {
        config.auth_info.token = Some(token.clone().into());
    }
    if options.insecure_skip_tls_verify {
        config.accept_invalid_certs = true;
    }
    if let Some(name) = &options.tls_server_name {
        config.tls_server_name = Some(name.clone());
    }
    if let Some(ca) = &options.certificate_authority {
        config.root_cert_file = Some(ca.clone());
    }
    if let (Some(cert), Some(key)) = (&options.client_certificate, &options.client_key) {
        config.auth_info.client_certificate = Some(cert.display().to_string());
        config.auth_info.client_certificate_data = None;
        config.auth_info.client_key = Some(key.display().to_string());
        config.auth_info.client_key_data = None;
    }
    if let Some(user) = &options.impersonate {
        config.auth_info.impersonate = Some(user.clone());
    }
    if !options.impersonate_groups.is_empty() {
        config.auth_info.impersonate_groups = Some(options.impersonate_groups.clone());
    }
    if let Some(uid) = &options.impersonate_uid {
        config.auth_info.impersonate_uid = Some(uid.clone());
    }
    if let Some(timeout) = options.request_timeout {
        config.connect_timeout = Some(timeout);
        config.write_timeout = Some(timeout);
    }
    Client::try_from(config).map_err(|e| format!("cannot create Kubernetes client: {e}"))
}

/// Watches the Service `<namespace>/<name>` (its slices and itself) and sends what changes
/// as [`ServiceChange`]s keyed `<namespace>/<name>` and tagged with `watch`, until the
/// receiver goes away.
pub async fn watch_service(
    namespace: String,
    name: String,
    watch: u64,
    options: KubeOptions,
    updates: Outbox<ServiceUpdate>,
) {
    let watched = ServiceWatch {
        key: format!("{namespace}/{name}"),
        watch,
    };
    let client = loop {
        match client(&options).await {
            Ok(client) => break client,
            Err(e) => {
                tracing::error!(target: "k8s", "cannot watch Service {watched}: {e}; retrying in 5s");
                let failed = ServiceUpdate {
                    service: watched.clone(),
                    change: ServiceChange::Api(Some(e)),
                };
                if updates.send(failed).is_err() {
                    return;
                }
                tokio::time::sleep(CLIENT_RETRY).await;
            }
        }
    };
    tokio::join!(
        watch_slices(client.clone(), &namespace, &name, &watched, &updates),
        watch_cluster_ips(client, &namespace, &name, &watched, &updates)
    );
}

/// Tracks whether the API server answers, logging each transition once.
struct ApiHealth<'a> {
    watched: &'a ServiceWatch,
    what: &'static str,
    failing: bool,
}

impl ApiHealth<'_> {
    fn ok(&mut self, updates: &Outbox<ServiceUpdate>) {
        if self.failing {
            self.failing = false;
            tracing::info!(target: "k8s", "Kubernetes API reachable again: watching {} of Service {}", self.what, self.watched);
            let _ = updates.send(ServiceUpdate {
                service: self.watched.clone(),
                change: ServiceChange::Api(None),
            });
        }
    }

    fn failed(&mut self, error: &watcher::Error, updates: &Outbox<ServiceUpdate>) {
        if !self.failing {
            self.failing = true;
            tracing::warn!(
                target: "k8s",
                "Kubernetes API unreachable while watching {} of Service {}: {error}; keeping its last known endpoints",
                self.what,
                self.watched
            );
        }
        let _ = updates.send(ServiceUpdate {
            service: self.watched.clone(),
            change: ServiceChange::Api(Some(error.to_string())),
        });
    }
}

/// Runs a kube-rs watcher (with its default backoff) and sends what `translate` makes of each
/// event, tracking whether the API server answers; returns when the receiver goes away.
async fn follow<K>(
    api: Api<K>,
    config: watcher::Config,
    watched: &ServiceWatch,
    what: &'static str,
    updates: &Outbox<ServiceUpdate>,
    mut translate: impl FnMut(watcher::Event<K>) -> Option<ServiceChange>,
) where
    K: kube::Resource + Clone + std::fmt::Debug + serde::de::DeserializeOwned + Send + 'static,
{
    let mut stream = std::pin::pin!(watcher(api, config).default_backoff());
    let mut health = ApiHealth {
        watched,
        what,
        failing: false,
    };
    while let Some(item) = stream.next().await {
        match item {
            Ok(event) => {
                health.ok(updates);
                if let Some(change) = translate(event) {
                    let update = ServiceUpdate {
                        service: watched.clone(),
                        change,
                    };
                    if updates.send(update).is_err() {
                        return;
                    }
                }
            }
            Err(e) => health.failed(&e, updates),
        }
    }
}

async fn watch_slices(
    client: Client,
    namespace: &str,
    name: &str,
    watched: &ServiceWatch,
    updates: &Outbox<ServiceUpdate>,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, namespace);
    let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={name}"));
    // Init…InitDone replaces the whole set: slices deleted while disconnected never show up
    // as deletes, so a relist must not be merged into the old set.
    let mut relist: Option<BTreeMap<String, SliceAddresses>> = None;
    follow(
        api,
        config,
        watched,
        "EndpointSlices",
        updates,
        |event| match event {
            watcher::Event::Init => {
                relist = Some(BTreeMap::new());
                None
            }
            watcher::Event::InitApply(slice) => {
                if let Some(set) = relist.as_mut() {
                    set.insert(slice_name(&slice), slice_addresses(&slice));
                }
                None
            }
            watcher::Event::InitDone => relist.take().map(ServiceChange::ReplaceSlices),
            watcher::Event::Apply(slice) => Some(ServiceChange::UpsertSlice(
                slice_name(&slice),
                slice_addresses(&slice),
            )),
            watcher::Event::Delete(slice) => Some(ServiceChange::RemoveSlice(slice_name(&slice))),
        },
    )
    .await;
}

async fn watch_cluster_ips(
    client: Client,
    namespace: &str,
    name: &str,
    watched: &ServiceWatch,
    updates: &Outbox<ServiceUpdate>,
) {
    let api: Api<Service> = Api::namespaced(client, namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut relist: Option<Vec<IpAddr>> = None;
    follow(api, config, watched, "the Service", updates, |event| {
        let ips = match event {
            watcher::Event::Init => {
                relist = Some(Vec::new());
                None
            }
            watcher::Event::InitApply(service) => {
                relist = Some(cluster_ips(&service));
                None
            }
            watcher::Event::InitDone => relist.take(),
            watcher::Event::Apply(service) => Some(cluster_ips(&service)),
            watcher::Event::Delete(_) => Some(Vec::new()),
        };
        ips.map(ServiceChange::ClusterIps)
    })
    .await;
}

fn slice_name(slice: &EndpointSlice) -> String {
    slice.metadata.name.clone().unwrap_or_default()
}

/// Every address of every endpoint in the slice, whatever its conditions: an ACL, not a load
/// balancer, so terminating and not-yet-ready pods stay reachable. FQDN slices are ignored.
pub fn slice_addresses(slice: &EndpointSlice) -> SliceAddresses {
    let mut out = SliceAddresses::default();
    if slice.address_type == "FQDN" {
        return out;
    }
    for endpoint in &slice.endpoints {
        let terminating = endpoint
            .conditions
            .as_ref()
            .and_then(|c| c.terminating)
            .unwrap_or(false);
        for address in &endpoint.addresses {
            if let Ok(ip) = address.parse::<IpAddr>() {
                out.addresses.push(ip);
                if terminating {
                    out.terminating.push(ip);
                }
            }
        }
    }
    out.addresses.sort();
    out.addresses.dedup();
    out.terminating.sort();
    out.terminating.dedup();
    out
}

/// The Service's ClusterIPs, IPv4 and IPv6 (none for a headless Service).
pub fn cluster_ips(service: &Service) -> Vec<IpAddr> {
    let Some(spec) = &service.spec else {
        return Vec::new();
    };
    let mut ips: Vec<IpAddr> = spec
        .cluster_ips
        .iter()
        .flatten()
        .chain(spec.cluster_ip.iter())
        .filter_map(|ip| ip.parse().ok())
        .collect();
    ips.sort();
    ips.dedup();
    ips
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_timeouts_parse_as_kubectl_does() {
        assert_eq!(parse_request_timeout("0"), Ok(None));
        assert_eq!(parse_request_timeout("5"), Ok(Some(Duration::from_secs(5))));
        assert_eq!(
            parse_request_timeout("5s"),
            Ok(Some(Duration::from_secs(5)))
        );
        assert_eq!(
            parse_request_timeout("1m30s"),
            Ok(Some(Duration::from_secs(90)))
        );
        assert_eq!(
            parse_request_timeout("500ms"),
            Ok(Some(Duration::from_millis(500)))
        );
        for bad in ["", "5x", "s", "-1s", "1.2.3s"] {
            assert!(
                parse_request_timeout(bad)
                    .unwrap_err()
                    .contains("--request-timeout"),
                "{bad}"
            );
        }
    }
}

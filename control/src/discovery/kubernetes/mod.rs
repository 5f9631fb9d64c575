//! KUBERNETES clusters: watch a Service's `discovery.k8s.io/v1` EndpointSlices and the Service
//! itself with the kube-rs runtime watcher, and report every address the slices list, ready,
//! serving and terminating alike (a draining media pod keeps its calls), plus the Service's
//! ClusterIPs.
//!
//! Failures are reported once, when they start, and say what they are: a 401 or 403 names the
//! user, the verb, the resource and the namespace the API server refused, and the permissions
//! to grant (retried with a backoff up to a minute); anything else is "unreachable" (retried
//! as client-go does); a 410 Gone is a relist. Recovery is reported once a list or a watch
//! actually succeeded.
//!
//! The parts: `client.rs` makes the kube-rs client from the kubectl flags ([`KubeOptions`]);
//! `follow.rs` runs one watcher (the EndpointSlices' or the Service's) and keeps kube-rs's own
//! retry noise out of the log; `api_health.rs` says what a failure is, paces the retries and
//! reports each change of the API server's answer once; `tests.rs` tests them.

mod api_health;
mod client;
mod follow;
#[cfg(test)]
mod tests;

pub use client::{client, parse_request_timeout, KubeOptions};

use crate::outbox::Outbox;
use crate::state::{ServiceChange, SliceAddresses};
use api_health::ApiReport;
use follow::{follow, Watched};
use k8s_openapi::api::core::v1::Service;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use kube::runtime::watcher;
use kube::{Api, Client};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

/// How long to wait before trying again to build a client that could not be built.
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
    let mut reported: Option<String> = None;
    let client = loop {
        match client(&options).await {
            Ok(client) => break client,
            Err(e) => {
                // Once per distinct error, not once per retry.
                if reported.as_ref() != Some(&e) {
                    tracing::error!(target: "k8s", "cannot watch Service {watched}: {e}; retrying every {}s", CLIENT_RETRY.as_secs());
                    let failed = ServiceUpdate {
                        service: watched.clone(),
                        change: ServiceChange::Api(Some(format!(
                            "unreachable, keeping last known endpoints: {e}"
                        ))),
                    };
                    if updates.send(failed).is_err() {
                        return;
                    }
                    reported = Some(e);
                }
                tokio::time::sleep(CLIENT_RETRY).await;
            }
        }
    };
    let report = ApiReport {
        service: &watched,
        updates: &updates,
        state: std::sync::Mutex::new((
            [None, None],
            reported.map(|e| format!("unreachable, keeping last known endpoints: {e}")),
        )),
    };
    let slices = Watched {
        service: &watched,
        namespace: &namespace,
        what: "EndpointSlices",
        resource: "endpointslices",
        report: &report,
        slot: 0,
    };
    let service = Watched {
        what: "the ClusterIPs",
        resource: "services",
        slot: 1,
        ..slices
    };
    tokio::join!(
        watch_slices(client.clone(), &name, slices, &updates),
        watch_cluster_ips(client, &name, service, &updates)
    );
}

async fn watch_slices(
    client: Client,
    name: &str,
    watched: Watched<'_>,
    updates: &Outbox<ServiceUpdate>,
) {
    let api: Api<EndpointSlice> = Api::namespaced(client, watched.namespace);
    let config = watcher::Config::default().labels(&format!("kubernetes.io/service-name={name}"));
    // Init…InitDone replaces the whole set: slices deleted while disconnected never show up
    // as deletes, so a relist must not be merged into the old set.
    let mut relist: Option<BTreeMap<String, SliceAddresses>> = None;
    follow(api, config, watched, updates, |event| match event {
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
    })
    .await;
}

async fn watch_cluster_ips(
    client: Client,
    name: &str,
    watched: Watched<'_>,
    updates: &Outbox<ServiceUpdate>,
) {
    let api: Api<Service> = Api::namespaced(client, watched.namespace);
    let config = watcher::Config::default().fields(&format!("metadata.name={name}"));
    let mut relist: Option<Vec<IpAddr>> = None;
    follow(api, config, watched, updates, |event| {
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

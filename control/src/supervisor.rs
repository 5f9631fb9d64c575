//! Task supervision: the tasks that feed the control loop (the config origin's watcher, one
//! watch per Kubernetes Service, one resolver per STRICT_DNS hostname), kept in step with what
//! the state says must be watched.

use crate::discovery::dns::{self, DnsUpdate};
use crate::discovery::kubernetes::{self, KubeOptions, ServiceUpdate};
use crate::origin::{cds, file};
use crate::outbox::Outbox;
use crate::state::ControlState;
use crate::Source;
use std::collections::BTreeMap;
use tokio::task::JoinHandle;
use uturn_shared::config::{ServiceEndpoint, StunnerConfig};

/// The running tasks and where they report.
pub(crate) struct Supervisor {
    kube: KubeOptions,
    service_updates: Outbox<ServiceUpdate>,
    dns_updates: Outbox<DnsUpdate>,
    origin: Option<JoinHandle<()>>,
    /// Service key (`<namespace>/<service>`) → its watch.
    service_watches: BTreeMap<String, ServiceWatchTask>,
    /// Hostname → its resolver.
    resolvers: BTreeMap<String, JoinHandle<()>>,
}

/// The task watching one Service, and the [`crate::state::ServiceState::watch`] id it runs for.
struct ServiceWatchTask {
    watch: u64,
    task: JoinHandle<()>,
}

impl Supervisor {
    /// Starts following `source` (no task for [`Source::Fixed`]); discovery tasks report
    /// through the outboxes given.
    pub(crate) fn new(
        source: Source,
        configs: Outbox<Box<StunnerConfig>>,
        service_updates: Outbox<ServiceUpdate>,
        dns_updates: Outbox<DnsUpdate>,
        kube: KubeOptions,
    ) -> Supervisor {
        let origin = match source {
            Source::Fixed => None,
            Source::File(path) => Some(tokio::spawn(file::watch(path, configs))),
            Source::Cds(target) => Some(tokio::spawn(cds::watch(target, configs))),
        };
        Supervisor {
            kube,
            service_updates,
            dns_updates,
            origin,
            service_watches: BTreeMap::new(),
            resolvers: BTreeMap::new(),
        }
    }

    /// Stops following the config origin (graceful shutdown).
    pub(crate) fn stop_origin(&mut self) {
        if let Some(task) = self.origin.take() {
            tracing::info!(target: "stunnerd", "Canceling config loader");
            task.abort();
        }
    }

    /// Starts the watches and resolvers `state` needs and stops those it no longer does.
    pub(crate) fn sync(&mut self, state: &ControlState) {
        // A watch only sends changes after its first list, so a state created anew (the
        // Service left the config and came back within one batch) needs a watch of its own.
        self.service_watches.retain(|key, running| {
            let keep = state
                .services()
                .get(key)
                .is_some_and(|s| s.watch == running.watch);
            if !keep {
                running.task.abort();
            }
            keep
        });
        for (key, service_state) in state.services() {
            if self.service_watches.contains_key(key) {
                continue;
            }
            let Ok(service) = ServiceEndpoint::parse(key) else {
                continue;
            };
            tracing::info!(target: "k8s", "watching EndpointSlices and Service {key}");
            let task = tokio::spawn(kubernetes::watch_service(
                service.namespace,
                service.name,
                service_state.watch,
                self.kube.clone(),
                self.service_updates.clone(),
            ));
            let watch = service_state.watch;
            self.service_watches
                .insert(key.clone(), ServiceWatchTask { watch, task });
        }
        self.resolvers.retain(|host, task| {
            let keep = state.dns_names().contains_key(host);
            if !keep {
                task.abort();
            }
            keep
        });
        for host in state.dns_names().keys() {
            if !self.resolvers.contains_key(host) {
                let resolver = dns::resolve_forever(host.clone(), self.dns_updates.clone());
                self.resolvers.insert(host.clone(), tokio::spawn(resolver));
            }
        }
    }
}

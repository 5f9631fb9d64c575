//! The control plane's state, without IO: the running config, the endpoints discovered for
//! KUBERNETES and STRICT_DNS clusters, and the reconcile rules of stunnerd.md §2.8.
//!
//! Call order: feed changes with `handle_config` and `handle_discovery` (any number, a batch),
//! then `handle_timeout(now)`, then `poll_snapshot` once: it builds and returns the next
//! [`Snapshot`] if the batch changed anything the dataplane sees. `services` and `dns_names` say
//! what the shell must watch (a Service's `watch` id changes when its watch must restart), and
//! `poll_timeout` when to call `handle_timeout` again if no change comes.
//!
//! What is known of each Service is `services.rs`; how a config change is counted for the log,
//! `reconcile.rs`; the scenarios that test it all, `tests.rs`.

mod reconcile;
mod services;
#[cfg(test)]
mod tests;

pub use reconcile::{reconcile, Reconciliation};
pub use services::{ServiceChange, ServiceState, SliceAddresses};

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};
use uturn_shared::config::{
    ClusterConfig, ClusterType, Endpoint, ServiceEndpoint, StaticEndpoint, StunnerConfig,
};
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::{host_endpoint, Host, ListenerSpec, Snapshot};

/// Why a config was not applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Skipped {
    /// It equals the running config.
    Duplicate,
    /// It is the zero config (a CDS delete), which a watcher ignores.
    Delete,
}

/// Where this pod's siblings (the other pods of its gateway, for second-chance forwarding)
/// come from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Siblings {
    /// No forwarding.
    #[default]
    Off,
    /// A fixed list (outside Kubernetes).
    Static(Vec<IpAddr>),
    /// The endpoints of the gateway's own Service, `<namespace>/<service>`: ready, serving
    /// and terminating pods alike (a draining pod still owns its calls).
    Service(String),
}

/// A Service that readiness stopped waiting for: not listed in full within the discovery
/// timeout ([`ControlState::handle_timeout`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnsyncedService {
    /// The Service, `<namespace>/<service>`.
    pub service: String,
    /// Why it is not listed: the Kubernetes API server's error, or that no complete list came.
    pub why: String,
}

/// The control plane's state.
#[derive(Debug)]
pub struct ControlState {
    siblings: Siblings,
    config: StunnerConfig,
    services: BTreeMap<String, ServiceState>,
    dns: BTreeMap<String, Vec<IpAddr>>,
    generation: u64,
    dirty: bool,
    ready: bool,
    /// Whether readiness no longer waits for discovery: once set, it stays (a Service added by
    /// a later config does not take a serving pod out of its load balancer).
    settled: bool,
    discovery_timeout: Duration,
    next_watch: u64,
    /// The listeners of the last snapshot built, with their runs: an unchanged listener keeps
    /// its run in the next one, and with it its sockets on every shard.
    listeners: Vec<ListenerSpec>,
}

impl ControlState {
    /// Starts from `config`, published as `generation` (by [`ControlState::snapshot`] of a
    /// state made the same way, e.g. [`crate::first_snapshot`]).
    pub fn new(config: StunnerConfig, generation: u64) -> ControlState {
        let env_relay = Host::current().relay;
        let listeners = config
            .listeners
            .iter()
            .map(|l| ListenerSpec::from_config(&config, l, generation, env_relay))
            .collect();
        let mut state = ControlState {
            siblings: Siblings::Off,
            listeners,
            ready: !config.is_zero(),
            config,
            services: BTreeMap::new(),
            dns: BTreeMap::new(),
            generation,
            dirty: false,
            settled: false,
            discovery_timeout: Duration::ZERO,
            next_watch: 1,
        };
        state.sync_watches();
        state.settle();
        state
    }

    /// Follows `siblings` for second-chance forwarding (a Service is watched like a
    /// KUBERNETES cluster's, but readiness does not wait for it).
    pub fn with_siblings(mut self, siblings: Siblings) -> ControlState {
        if siblings != Siblings::Off {
            self.siblings = siblings;
            self.sync_watches();
            self.dirty = true;
        }
        self
    }

    /// The siblings' addresses now, this host's own left out.
    fn sibling_ips(&self) -> Vec<IpAddr> {
        let mut ips: Vec<IpAddr> = match &self.siblings {
            Siblings::Off => return Vec::new(),
            Siblings::Static(ips) => ips.clone(),
            Siblings::Service(key) => self
                .services
                .get(key)
                .map(|s| {
                    s.slices
                        .values()
                        .flat_map(|slice| slice.addresses.iter().copied())
                        .map(unmapped_ip)
                        .collect()
                })
                .unwrap_or_default(),
        };
        let own = uturn_shared::policy::host_ips();
        ips.retain(|ip| !own.contains(ip));
        ips.sort();
        ips.dedup();
        ips
    }

    /// Makes readiness wait up to `timeout` for the first full EndpointSlice list of every
    /// Service a KUBERNETES cluster names (zero: do not wait, as stunnerd).
    pub fn with_discovery_timeout(mut self, timeout: Duration) -> ControlState {
        self.discovery_timeout = timeout;
        self.settled = false;
        self.settle();
        self
    }

    /// The running config.
    pub fn config(&self) -> &StunnerConfig {
        &self.config
    }

    /// Whether `/ready` may answer 200: a non-zero config has been applied (stunnerd's
    /// readiness) and every Service it names has been listed in full or waited for up to the
    /// discovery timeout.
    pub fn ready(&self) -> bool {
        self.ready && self.settled
    }

    /// The Services readiness still waits for (empty once ready).
    pub fn waiting_for(&self) -> Vec<&str> {
        if self.settled {
            return Vec::new();
        }
        let siblings = match &self.siblings {
            Siblings::Service(key) => Some(key.as_str()),
            _ => None,
        };
        self.services
            .iter()
            .filter(|(key, s)| !s.synced && !s.sync_timed_out && Some(key.as_str()) != siblings)
            .map(|(key, _)| key.as_str())
            .collect()
    }

    /// Starts the discovery clock of Services that began waiting and gives up on those that
    /// waited longer than the discovery timeout: they no longer hold readiness. Returns each
    /// Service given up on now, with why it is not listed.
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<UnsyncedService> {
        let mut expired = Vec::new();
        if self.discovery_timeout.is_zero() {
            return expired;
        }
        for (key, state) in &mut self.services {
            if state.synced || state.sync_timed_out {
                continue;
            }
            let since = *state.waiting_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= self.discovery_timeout {
                state.sync_timed_out = true;
                let why = match &state.api_error {
                    Some(e) => format!("the Kubernetes API server failed: {e}"),
                    None => "no complete EndpointSlice list from the Kubernetes API server yet"
                        .to_string(),
                };
                expired.push(UnsyncedService {
                    service: key.clone(),
                    why,
                });
            }
        }
        self.settle();
        expired
    }

    /// When `handle_timeout` must run next if nothing else happens.
    pub fn poll_timeout(&self) -> Option<Instant> {
        if self.discovery_timeout.is_zero() {
            return None;
        }
        self.services
            .values()
            .filter(|s| !s.synced && !s.sync_timed_out)
            .filter_map(|s| s.waiting_since)
            .map(|since| since + self.discovery_timeout)
            .min()
    }

    /// The configured discovery timeout.
    pub fn discovery_timeout(&self) -> Duration {
        self.discovery_timeout
    }

    fn settle(&mut self) {
        if self.ready
            && !self.settled
            && (self.discovery_timeout.is_zero()
                || self.services.values().all(|s| s.synced || s.sync_timed_out))
        {
            self.settled = true;
        }
    }

    /// The generation of the last snapshot built.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Applies a validated config unless it is a duplicate or (with `ignore_delete`) a zero
    /// config. Discovered endpoints of Services and hostnames still named are kept.
    pub fn handle_config(
        &mut self,
        config: StunnerConfig,
        ignore_delete: bool,
    ) -> Result<Reconciliation, Skipped> {
        if config == self.config {
            return Err(Skipped::Duplicate);
        }
        if ignore_delete && config.is_zero() {
            return Err(Skipped::Delete);
        }
        let summary = reconcile(&self.config, &config);
        if !config.is_zero() {
            self.ready = true;
        }
        self.config = config;
        self.sync_watches();
        self.settle();
        self.dirty = true;
        Ok(summary)
    }

    /// Applies a change that watch `watch` saw for a Service; changes to Services no longer
    /// named, or from a watch that is no longer theirs, are ignored.
    pub fn handle_discovery(&mut self, service: &str, watch: u64, change: ServiceChange) {
        let Some(state) = self.services.get_mut(service) else {
            return;
        };
        if state.watch != watch {
            return;
        }
        let before = state.addresses();
        match change {
            ServiceChange::ReplaceSlices(slices) => {
                state.slices = slices;
                state.synced = true;
            }
            ServiceChange::UpsertSlice(name, addresses) => {
                state.slices.insert(name, addresses);
            }
            ServiceChange::RemoveSlice(name) => {
                state.slices.remove(&name);
            }
            ServiceChange::ClusterIps(ips) => state.cluster_ips = ips,
            ServiceChange::Api(error) => state.api_error = error,
        }
        if state.addresses() != before {
            self.dirty = true;
        }
        self.settle();
    }

    /// Records the addresses `hostname` currently resolves to.
    pub fn handle_dns(&mut self, hostname: &str, mut addresses: Vec<IpAddr>) {
        addresses.sort();
        addresses.dedup();
        if let Some(current) = self.dns.get_mut(hostname) {
            if *current != addresses {
                *current = addresses;
                self.dirty = true;
            }
        }
    }

    /// The next snapshot, if anything the dataplane sees changed since the last one.
    pub fn poll_snapshot(&mut self) -> Option<Snapshot> {
        if !self.dirty {
            return None;
        }
        self.dirty = false;
        self.generation += 1;
        let snapshot = self.snapshot();
        self.listeners.clone_from(&snapshot.listeners);
        Some(snapshot)
    }

    /// The snapshot of the current state, at the current generation. Config becomes a
    /// snapshot here and nowhere else in the process. Listeners unchanged since the last
    /// snapshot keep their runs ([`ListenerSpec::same_as`] decides).
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot::from_config(&self.config, self.generation, &|cluster| {
            self.cluster_endpoints(cluster)
        });
        snapshot.carry_listener_runs(&self.listeners);
        snapshot.sibling_ips = self.sibling_ips().into();
        snapshot
    }

    /// The Services the shell must watch, `<namespace>/<service>`, with what is known of each.
    pub fn services(&self) -> &BTreeMap<String, ServiceState> {
        &self.services
    }

    /// The hostnames of STRICT_DNS clusters the shell must resolve, with their last addresses.
    pub fn dns_names(&self) -> &BTreeMap<String, Vec<IpAddr>> {
        &self.dns
    }

    fn cluster_endpoints(&self, cluster: &ClusterConfig) -> Vec<StaticEndpoint> {
        let mut endpoints = Vec::new();
        match cluster.cluster_type {
            // A domain endpoint is resolved whatever the type, as STUNner v2 does (a v1
            // STRICT_DNS cluster lists hostnames only; its IPs are admitted on every port).
            ClusterType::Static | ClusterType::StrictDns => {
                for (host, port_min, port_max) in domains(cluster) {
                    for ip in self.dns.get(&host).into_iter().flatten() {
                        endpoints.push(host_endpoint(*ip, port_min, port_max));
                    }
                }
            }
            ClusterType::Kubernetes => {
                for raw in &cluster.endpoints {
                    let Ok(service) = ServiceEndpoint::parse_v2(raw) else {
                        continue;
                    };
                    let Some(state) = self.services.get(&service.key()) else {
                        continue;
                    };
                    for ip in state.addresses() {
                        endpoints.push(host_endpoint(ip, service.port_min, service.port_max));
                    }
                }
            }
        }
        endpoints
    }

    /// Keeps the watched Services and hostnames in step with the clusters of the config.
    fn sync_watches(&mut self) {
        let mut services = BTreeSet::new();
        let mut hosts = BTreeSet::new();
        for cluster in &self.config.clusters {
            match cluster.cluster_type {
                ClusterType::Static | ClusterType::StrictDns => {
                    hosts.extend(domains(cluster).map(|(host, _, _)| host))
                }
                ClusterType::Kubernetes => services.extend(
                    cluster
                        .endpoints
                        .iter()
                        .filter_map(|e| ServiceEndpoint::parse_v2(e).ok())
                        .map(|s| s.key()),
                ),
            }
        }
        if let Siblings::Service(key) = &self.siblings {
            services.insert(key.clone());
        }
        self.services.retain(|key, _| services.contains(key));
        for key in services {
            let next_watch = &mut self.next_watch;
            self.services.entry(key).or_insert_with(|| {
                *next_watch += 1;
                ServiceState {
                    watch: *next_watch,
                    ..ServiceState::default()
                }
            });
        }
        self.dns.retain(|host, _| hosts.contains(host));
        for host in hosts {
            self.dns.entry(host).or_default();
        }
    }
}

/// The domain endpoints of `cluster`, with the ports each names.
fn domains(cluster: &ClusterConfig) -> impl Iterator<Item = (String, u16, u16)> + '_ {
    cluster
        .endpoints
        .iter()
        .filter_map(|e| match Endpoint::parse(e) {
            Ok(Endpoint::Domain {
                host,
                port_min,
                port_max,
            }) => Some((host, port_min, port_max)),
            _ => None,
        })
}

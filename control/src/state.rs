//! The control plane's state, without IO: the running config, the endpoints discovered for
//! KUBERNETES and STRICT_DNS clusters, and the reconcile rules of stunnerd.md §2.8.
//!
//! Call order: feed changes with `handle_config` and `handle_discovery` (any number, a batch),
//! then `handle_timeout(now)`, then `poll_snapshot` once: it builds and returns the next
//! [`Snapshot`] if the batch changed anything the dataplane sees. `services` and `dns_names` say
//! what the shell must watch (a Service's `watch` id changes when its watch must restart), and
//! `poll_timeout` when to call `handle_timeout` again if no change comes.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::time::{Duration, Instant};
use uturn_shared::config::{
    ClusterConfig, ClusterType, Endpoint, ServiceEndpoint, StaticEndpoint, StunnerConfig,
};
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::{host_endpoint, Host, ListenerSpec, RelayAddresses, Snapshot};

/// A change to the addresses of one watched Kubernetes Service (`<namespace>/<service>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceChange {
    /// A full relist of the Service's EndpointSlices (`Init…InitDone`): slice name → addresses.
    /// Slices missing here are gone, also those deleted while the watch was down.
    ReplaceSlices(BTreeMap<String, SliceAddresses>),
    /// One slice was added or modified.
    UpsertSlice(String, SliceAddresses),
    /// One slice was deleted.
    RemoveSlice(String),
    /// The Service's ClusterIPs (empty when the Service is gone).
    ClusterIps(Vec<IpAddr>),
    /// The API server answered again (`None`) or failed (`Some(why)`) for this Service.
    Api(Option<String>),
}

/// The addresses one EndpointSlice lists, all of them (ready, serving and terminating).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct SliceAddresses {
    /// Every endpoint address in the slice.
    pub addresses: Vec<IpAddr>,
    /// The subset whose endpoint is terminating (for `/status` and logs only).
    pub terminating: Vec<IpAddr>,
}

/// What the control thread knows about one Service.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ServiceState {
    /// Slice name → its addresses.
    pub slices: BTreeMap<String, SliceAddresses>,
    /// The Service's ClusterIPs.
    pub cluster_ips: Vec<IpAddr>,
    /// The last API error, while the API server is unreachable.
    pub api_error: Option<String>,
    /// Whether a full list has been seen since the watch started.
    pub synced: bool,
    /// Which watch feeds this state: a state created anew (a Service dropped from the config
    /// and named again) gets a new id, and changes from an older watch are ignored.
    pub watch: u64,
    /// When `handle_timeout` first saw this Service waiting for its first full list.
    pub waiting_since: Option<Instant>,
    /// Whether the first full list took longer than the discovery timeout.
    pub sync_timed_out: bool,
}

impl ServiceState {
    /// Every address a peer may use: the union of all slices plus the ClusterIPs.
    pub fn addresses(&self) -> BTreeSet<IpAddr> {
        self.slices
            .values()
            .flat_map(|s| s.addresses.iter().copied())
            .chain(self.cluster_ips.iter().copied())
            .map(unmapped_ip)
            .collect()
    }

    /// The addresses of terminating endpoints.
    pub fn terminating(&self) -> BTreeSet<IpAddr> {
        self.slices
            .values()
            .flat_map(|s| s.terminating.iter().copied())
            .collect()
    }
}

/// What a config change did, in stunnerd's terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Reconciliation {
    /// Objects that did not exist before.
    pub new: usize,
    /// Objects whose config changed.
    pub changed: usize,
    /// Objects that were removed.
    pub deleted: usize,
    /// Listeners opened (new ones).
    pub started: usize,
    /// Listeners closed and reopened (protocol, address, port, cert/key or realm changed);
    /// their allocations are dropped.
    pub restarted: usize,
}

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
    pub fn handle_timeout(&mut self, now: Instant) -> Vec<(String, String)> {
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
                expired.push((key.clone(), why));
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

/// Counts the objects of one kind that `new` adds, changes or deletes from `old` (by name).
fn objects<T: PartialEq>(
    old: &[T],
    new: &[T],
    name: impl Fn(&T) -> &String,
    count: &mut impl FnMut(bool, bool, bool),
) {
    for item in new {
        let before = old.iter().find(|o| name(o) == name(item));
        count(before.is_some(), true, before.is_some_and(|b| b != item));
    }
    for item in old {
        if !new.iter().any(|n| name(n) == name(item)) {
            count(true, false, false);
        }
    }
}

/// Counts what going from `old` to `new` does, object by object (matched by name).
pub fn reconcile(old: &StunnerConfig, new: &StunnerConfig) -> Reconciliation {
    let mut summary = Reconciliation::default();
    let mut count = |before: bool, after: bool, changed: bool| match (before, after) {
        (false, true) => summary.new += 1,
        (true, false) => summary.deleted += 1,
        (true, true) if changed => summary.changed += 1,
        _ => {}
    };
    count(true, true, old.admin != new.admin);
    count(true, true, old.auth != new.auth);
    // Objects of the documents as written: a v1 config's listeners and clusters, a v2
    // config's listeners, servers and clusters (stunnerd's counts for each).
    match (&old.v1, &new.v1) {
        (Some(old), Some(new)) => {
            objects(&old.listeners, &new.listeners, |l| &l.name, &mut count);
            objects(&old.clusters, &new.clusters, |c| &c.name, &mut count);
        }
        _ => {
            objects(&old.listeners, &new.listeners, |l| &l.name, &mut count);
            objects(&old.servers, &new.servers, |s| &s.name, &mut count);
            objects(&old.clusters, &new.clusters, |c| &c.name, &mut count);
        }
    }
    for l in &new.listeners {
        match old.listeners.iter().find(|o| o.name == l.name) {
            None => summary.started += 1,
            Some(before) => {
                // The environment is the process's, the same on both sides.
                let env = RelayAddresses::default();
                let after = ListenerSpec::from_config(new, l, 0, env);
                if after.restarts_from(&ListenerSpec::from_config(old, before, 0, env)) {
                    summary.restarted += 1;
                }
            }
        }
    }
    summary
}

#[cfg(test)]
mod tests {
    use super::*;
    use uturn_shared::config::parse_config;

    fn config(clusters: &str, realm: &str) -> StunnerConfig {
        parse_config(&format!(
            "version: v1\nadmin: {{name: t}}\nauth: {{realm: {realm}, credentials: {{username: u, password: p}}}}\n\
             listeners: [{{name: l, address: 127.0.0.1, port: 3478, routes: [k]}}]\nclusters: {clusters}\n"
        ))
        .unwrap()
    }

    fn slice(ips: &[&str]) -> SliceAddresses {
        SliceAddresses {
            addresses: ips.iter().map(|s| s.parse().unwrap()).collect(),
            terminating: Vec::new(),
        }
    }

    /// Siblings follow the EndpointSlices of the gateway's own Service: ready and terminating
    /// pods alike, not the ClusterIP, not this host's own addresses; a removed pod goes. The
    /// Service is watched, but readiness does not wait for it.
    #[test]
    fn siblings_follow_the_gateways_own_service() {
        let mut state = ControlState::new(config("[]", "r"), 1)
            .with_siblings(Siblings::Service("stunner/udp-gateway".into()));
        assert!(
            state.waiting_for().is_empty(),
            "readiness waits for siblings"
        );
        let svc = "stunner/udp-gateway";
        let watch = state.services()[svc].watch;
        let siblings = |state: &mut ControlState| -> Vec<String> {
            let snap = state.poll_snapshot().expect("a snapshot");
            snap.sibling_ips.iter().map(ToString::to_string).collect()
        };
        assert!(siblings(&mut state).is_empty());
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::UpsertSlice(
                "a".into(),
                SliceAddresses {
                    addresses: ["10.244.1.5", "10.244.2.7", "127.0.0.1"]
                        .iter()
                        .map(|s| s.parse().unwrap())
                        .collect(),
                    terminating: vec!["10.244.2.7".parse().unwrap()],
                },
            ),
        );
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::ClusterIps(vec!["10.96.0.20".parse().unwrap()]),
        );
        assert_eq!(siblings(&mut state), ["10.244.1.5", "10.244.2.7"]);
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::UpsertSlice("a".into(), slice(&["10.244.1.5"])),
        );
        assert_eq!(siblings(&mut state), ["10.244.1.5"]);
        state.handle_discovery(svc, watch, ServiceChange::RemoveSlice("a".into()));
        assert!(siblings(&mut state).is_empty());
        // Static siblings, this host's own address left out.
        let mut fixed =
            ControlState::new(config("[]", "r"), 1).with_siblings(Siblings::Static(vec![
                "198.51.100.9".parse().unwrap(),
                "127.0.0.1".parse().unwrap(),
            ]));
        assert_eq!(siblings(&mut fixed), ["198.51.100.9"]);
    }

    #[test]
    fn an_address_leaves_only_when_no_slice_lists_it() {
        let mut state = ControlState::new(
            config(
                "[{name: k, type: KUBERNETES, endpoints: [\"media/srv:<10000-20000>\"]}]",
                "r",
            ),
            1,
        );
        let svc = "media/srv";
        let watch = state.services()[svc].watch;
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::UpsertSlice("a".into(), slice(&["10.0.0.1"])),
        );
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::UpsertSlice("b".into(), slice(&["10.0.0.1", "10.0.0.2"])),
        );
        let snap = state.poll_snapshot().unwrap();
        assert_eq!(snap.generation, 2, "one batch, one snapshot");
        assert!(state.poll_snapshot().is_none());
        let route = snap.route("l").unwrap();
        assert!(snap
            .admits(route, "10.0.0.1:15000".parse().unwrap())
            .is_some());
        assert!(snap
            .admits(route, "10.0.0.1:9999".parse().unwrap())
            .is_none());
        state.handle_discovery(svc, watch, ServiceChange::RemoveSlice("b".into()));
        let snap = state.poll_snapshot().unwrap();
        let route = snap.route("l").unwrap();
        assert!(snap.permits_ip(route, "10.0.0.1".parse().unwrap()));
        assert!(!snap.permits_ip(route, "10.0.0.2".parse().unwrap()));
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::ReplaceSlices(BTreeMap::from([("c".into(), slice(&["fd00::5"]))])),
        );
        state.handle_discovery(
            svc,
            watch,
            ServiceChange::ClusterIps(vec!["10.96.0.9".parse().unwrap()]),
        );
        let snap = state.poll_snapshot().unwrap();
        let route = snap.route("l").unwrap();
        assert!(!snap.permits_ip(route, "10.0.0.1".parse().unwrap()));
        assert!(snap.permits_ip(route, "fd00::5".parse().unwrap()));
        assert!(snap.permits_ip(route, "10.96.0.9".parse().unwrap()));
        // An API error alone changes nothing the dataplane sees.
        state.handle_discovery(svc, watch, ServiceChange::Api(Some("refused".into())));
        assert!(state.poll_snapshot().is_none());
    }

    #[test]
    fn reconcile_counts_like_stunnerd() {
        let old = config("[{name: k, endpoints: [10.0.0.1]}]", "r");
        let mut new = config(
            "[{name: k, endpoints: [10.0.0.2]}, {name: k2, endpoints: [10.0.0.3]}]",
            "r",
        );
        let summary = reconcile(&old, &new);
        assert_eq!((summary.new, summary.changed, summary.deleted), (1, 1, 0));
        assert_eq!((summary.started, summary.restarted), (0, 0));
        new.auth.realm = "other".into();
        let summary = reconcile(&old, &new);
        assert_eq!(
            summary.restarted, 1,
            "a realm change restarts every listener"
        );
        let mut state = ControlState::new(old.clone(), 1);
        assert_eq!(
            state.handle_config(old.clone(), true),
            Err(Skipped::Duplicate)
        );
        assert_eq!(
            state.handle_config(StunnerConfig::zero("t"), true),
            Err(Skipped::Delete)
        );
        assert!(state.handle_config(new, true).is_ok());
        assert!(state.poll_snapshot().is_some());
    }

    const ONE_SERVICE: &str =
        "[{name: k, type: KUBERNETES, endpoints: [\"media/srv:<10000-20000>\"]}]";

    #[test]
    fn readiness_waits_for_the_first_list_up_to_the_timeout() {
        let timeout = Duration::from_secs(10);
        let t0 = Instant::now();
        let mut state =
            ControlState::new(config(ONE_SERVICE, "r"), 1).with_discovery_timeout(timeout);
        assert!(!state.ready(), "ready before the Service was listed");
        assert_eq!(state.waiting_for(), vec!["media/srv"]);
        assert!(state.handle_timeout(t0).is_empty());
        assert_eq!(state.poll_timeout(), Some(t0 + timeout));
        let watch = state.services()["media/srv"].watch;
        state.handle_discovery(
            "media/srv",
            watch,
            ServiceChange::UpsertSlice("a".into(), slice(&["10.0.0.1"])),
        );
        assert!(!state.ready(), "a single change is not a complete list");
        state.handle_discovery(
            "media/srv",
            watch,
            ServiceChange::ReplaceSlices(BTreeMap::new()),
        );
        assert!(state.ready());
        assert_eq!(state.poll_timeout(), None);

        let mut state =
            ControlState::new(config(ONE_SERVICE, "r"), 1).with_discovery_timeout(timeout);
        let watch = state.services()["media/srv"].watch;
        state.handle_discovery(
            "media/srv",
            watch,
            ServiceChange::Api(Some("connection refused".into())),
        );
        assert!(state.handle_timeout(t0).is_empty());
        assert!(state.handle_timeout(t0 + timeout / 2).is_empty());
        assert!(!state.ready());
        let expired = state.handle_timeout(t0 + timeout);
        assert_eq!(expired.len(), 1);
        assert!(expired[0].1.contains("connection refused"), "{expired:?}");
        assert!(state.ready(), "the timeout did not make it ready");
        assert!(state.services()["media/srv"].sync_timed_out);
        // Once ready, a Service named later does not take readiness away.
        let mut two = config(ONE_SERVICE, "r");
        two.clusters[0].endpoints.push("media/other".into());
        state.handle_config(two, true).unwrap();
        assert!(state.ready());

        let zero = ControlState::new(config(ONE_SERVICE, "r"), 1);
        assert!(zero.ready(), "a zero discovery timeout waits for nothing");
    }

    #[test]
    fn a_service_named_again_in_one_batch_gets_a_new_watch() {
        let mut state = ControlState::new(config(ONE_SERVICE, "r"), 1);
        let first = state.services()["media/srv"].watch;
        state.handle_discovery(
            "media/srv",
            first,
            ServiceChange::ReplaceSlices(BTreeMap::from([("a".into(), slice(&["10.0.0.1"]))])),
        );
        state.handle_config(config("[]", "r"), true).unwrap();
        state.handle_config(config(ONE_SERVICE, "r"), true).unwrap();
        let second = state.services()["media/srv"].watch;
        assert_ne!(first, second, "the recreated state kept the old watch");
        // A change the old watch queued before it was stopped is not applied to the new state.
        state.handle_discovery(
            "media/srv",
            first,
            ServiceChange::ReplaceSlices(BTreeMap::new()),
        );
        assert!(!state.services()["media/srv"].synced);
        state.handle_discovery(
            "media/srv",
            second,
            ServiceChange::ReplaceSlices(BTreeMap::from([("a".into(), slice(&["10.0.0.1"]))])),
        );
        assert!(state.services()["media/srv"]
            .addresses()
            .contains(&"10.0.0.1".parse::<IpAddr>().unwrap()));
    }
}

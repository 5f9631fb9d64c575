//! The immutable, generation-numbered view of the running config that shards read on the hot
//! path: which listeners run, which peers each listener may reach, and how to authenticate.
//!
//! The control thread builds a new [`Snapshot`] per accepted config (or endpoint change) and
//! publishes it through a [`SnapshotHandle`]; shards read it with `arc_swap::Cache`, never lock,
//! and re-check a cached verdict only when [`Snapshot::generation`] changes.

use crate::auth::Authenticator;
use crate::config::{
    ClusterConfig, ClusterType, ListenerConfig, ListenerProtocol, StaticEndpoint, StunnerConfig,
};
use arc_swap::ArcSwap;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;

/// The shared, swappable pointer to the current snapshot.
pub type SnapshotHandle = Arc<ArcSwap<Snapshot>>;

/// Index of a cluster in [`Snapshot::clusters`].
pub type ClusterId = usize;

/// A listener the dataplane must serve.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSpec {
    /// Listener name (the key routes are looked up by).
    pub name: String,
    /// Protocol, normalized.
    pub protocol: ListenerProtocol,
    /// The relay address advertised in XOR-RELAYED-ADDRESS (listener `address`).
    pub advertised_ip: IpAddr,
    /// The port the listener binds on the wildcard address.
    pub port: u16,
    /// The realm it serves: a realm change restarts every listener, as in stunnerd.
    pub realm: String,
    /// The listener's TLS/DTLS certificate and key: changing either restarts the listener.
    pub tls: TlsMaterial,
    /// Which run of the listener this is: the generation of the snapshot that started it,
    /// carried over while the listener stays the same ([`Snapshot::carry_listener_runs`]). A
    /// listener removed and added back starts a new run, so a shard that skipped the snapshot
    /// without it still sees it as new.
    pub run: u64,
}

impl ListenerSpec {
    /// The listener `listener` of a config whose realm is `realm`, in run `run`.
    pub fn from_config(listener: &ListenerConfig, realm: &str, run: u64) -> ListenerSpec {
        ListenerSpec {
            name: listener.name.clone(),
            protocol: listener.protocol,
            advertised_ip: listener
                .address
                .parse()
                .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
            port: listener.port,
            realm: realm.to_owned(),
            tls: TlsMaterial {
                digest: tls_digest(&listener.cert, &listener.key),
                cert: listener.cert.as_str().into(),
                key: listener.key.as_str().into(),
            },
            run,
        }
    }

    /// Whether `self` and `other` describe the same listener, whatever their runs.
    ///
    /// This is the one rule for when a listener restarts (its sockets close and reopen, and
    /// its allocations end): when any field but the run differs. That is stunnerd's rule —
    /// protocol, address, port, certificate or key, or the realm changed. The control plane
    /// counts restarts with it ([`ListenerSpec::restarts_from`]) and carries runs with it
    /// ([`Snapshot::carry_listener_runs`]); the shards follow the runs.
    pub fn same_as(&self, other: &ListenerSpec) -> bool {
        // Through the derived equality, so a field added later is compared too.
        let mut mine = self.clone();
        mine.run = other.run;
        mine == *other
    }

    /// Whether going from `before` (the same name in the previous config) to `self` restarts
    /// the listener; see [`ListenerSpec::same_as`].
    pub fn restarts_from(&self, before: &ListenerSpec) -> bool {
        !self.same_as(before)
    }
}

/// A listener's certificate and key as the config gives them (base64 PEM). `Debug` shows a
/// digest only, so key material never reaches a log.
#[derive(Clone, PartialEq, Eq, Default)]
pub struct TlsMaterial {
    /// Digest of both (0 when none), compared first.
    pub digest: u64,
    /// Base64 PEM certificate chain.
    pub cert: Arc<str>,
    /// Base64 PEM private key.
    pub key: Arc<str>,
}

impl std::fmt::Debug for TlsMaterial {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TlsMaterial {{ digest: {:016x} }}", self.digest)
    }
}

/// A cluster as the dataplane matches peers against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterSpec {
    /// Cluster name (used in logs and metrics).
    pub name: String,
    /// Address matchers: IP prefixes with port ranges.
    pub endpoints: Vec<StaticEndpoint>,
}

/// The peers one listener may reach: the union of the clusters in its `routes`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Route {
    clusters: Vec<ClusterId>,
}

/// One immutable generation of the running config.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Bumped on every publish; cached verdicts carry the generation they were made under.
    pub generation: u64,
    /// How requests are authenticated.
    pub auth: Authenticator,
    /// Listeners to serve.
    pub listeners: Vec<ListenerSpec>,
    /// Clusters, in config order.
    pub clusters: Vec<ClusterSpec>,
    /// `admin.user_quota`: allocations one user-id may hold at once; 0 means no quota.
    pub user_quota: u32,
    routes: Vec<Route>,
    /// The gateway's own addresses: the listeners' advertised (relay) addresses and the host's
    /// interface addresses (loopback aside, which its scope already guards); never a peer
    /// unless a routed cluster lists that exact address.
    own_ips: Vec<IpAddr>,
}

/// A stable digest of a listener's cert and key (FNV-1a; change detection only).
fn tls_digest(cert: &str, key: &str) -> u64 {
    if cert.is_empty() && key.is_empty() {
        return 0;
    }
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in cert.bytes().chain([0]).chain(key.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
    hash
}

/// An endpoint admitting exactly `ip`, on ports `port_min..=port_max`.
pub fn host_endpoint(ip: IpAddr, port_min: u16, port_max: u16) -> StaticEndpoint {
    let ip = crate::policy::unmapped_ip(ip);
    StaticEndpoint {
        addr: ip,
        prefix_len: if ip.is_ipv4() { 32 } else { 128 },
        port_min,
        port_max,
    }
}

impl Snapshot {
    /// Builds the snapshot of a validated config. `discovered` gives the current endpoints of
    /// a STRICT_DNS or KUBERNETES cluster (resolved or watched by the control thread); STATIC
    /// clusters are taken from the config. The host's interface addresses are read now
    /// ([`crate::policy::host_ips`]), so every snapshot, at start and after each reload or
    /// endpoint change, refuses the addresses the host has then.
    pub fn from_config(
        config: &StunnerConfig,
        generation: u64,
        discovered: &dyn Fn(&ClusterConfig) -> Vec<StaticEndpoint>,
    ) -> Snapshot {
        Snapshot::from_config_on_host(config, generation, discovered, &crate::policy::host_ips())
    }

    /// [`Snapshot::from_config`] on a host whose interface addresses are `host_ips` (for
    /// harnesses that must not depend on the machine they run on).
    pub fn from_config_on_host(
        config: &StunnerConfig,
        generation: u64,
        discovered: &dyn Fn(&ClusterConfig) -> Vec<StaticEndpoint>,
        host_ips: &[IpAddr],
    ) -> Snapshot {
        let clusters: Vec<ClusterSpec> = config
            .clusters
            .iter()
            .map(|cluster| {
                let endpoints = match cluster.cluster_type {
                    ClusterType::Static => cluster
                        .endpoints
                        .iter()
                        .filter_map(|e| StaticEndpoint::parse(e).ok())
                        .collect(),
                    ClusterType::StrictDns | ClusterType::Kubernetes => discovered(cluster),
                };
                ClusterSpec {
                    name: cluster.name.clone(),
                    endpoints,
                }
            })
            .collect();
        let mut listeners = Vec::new();
        let mut routes = Vec::new();
        for listener in &config.listeners {
            listeners.push(ListenerSpec::from_config(
                listener,
                &config.auth.realm,
                generation,
            ));
            // Clusters named in routes but missing from the config are skipped, as stunnerd does.
            routes.push(Route {
                clusters: listener
                    .routes
                    .iter()
                    .filter_map(|r| clusters.iter().position(|c| &c.name == r))
                    .collect(),
            });
        }
        // The host's loopback addresses are left to their scope rule: all of 127.0.0.0/8 is
        // the host, and an endpoint inside it is already an explicit choice to reach it.
        let host_ips = host_ips
            .iter()
            .map(|&ip| crate::policy::canonical_peer(ip))
            .filter(|&ip| crate::policy::scope(ip) != crate::policy::Scope::Loopback);
        let mut own_ips: Vec<IpAddr> = listeners
            .iter()
            .map(|l| crate::policy::canonical_peer(l.advertised_ip))
            .chain(host_ips)
            .filter(|ip| !ip.is_unspecified())
            .collect();
        own_ips.sort();
        own_ips.dedup();
        Snapshot {
            generation,
            auth: Authenticator::from_config(&config.auth),
            listeners,
            clusters,
            user_quota: u32::try_from(config.admin.user_quota.max(0)).unwrap_or(u32::MAX),
            routes,
            own_ips,
        }
    }

    /// Keeps the run of every listener that `previous` (the listeners of the snapshot this one
    /// replaces) had unchanged, so that only new and changed listeners start a new run.
    pub fn carry_listener_runs(&mut self, previous: &[ListenerSpec]) {
        for listener in &mut self.listeners {
            if let Some(before) = previous.iter().find(|p| p.same_as(listener)) {
                listener.run = before.run;
            }
        }
    }

    /// Whether `self` runs exactly the listeners `other` runs, in the same runs: a shard
    /// serving `other` may serve packets under `self` without reconciling its listeners.
    pub fn same_listener_runs(&self, other: &Snapshot) -> bool {
        self.listeners == other.listeners
    }

    /// The route of the listener called `listener`, if it runs.
    pub fn route(&self, listener: &str) -> Option<&Route> {
        self.listeners
            .iter()
            .position(|l| l.name == listener)
            .map(|i| &self.routes[i])
    }

    /// Permission-time check (IP only, port ranges ignored): may a client of `route` reach
    /// `ip`? The one peer policy ([`Snapshot::admits`] adds the port): the address is
    /// canonicalised ([`crate::policy::canonical_peer`]), a special-scope address needs an
    /// endpoint inside its scope, the gateway's own addresses need an exact endpoint, and a
    /// 6to4 or Teredo address is admitted only if the IPv4 address it travels through
    /// ([`crate::policy::tunnel_ipv4`]) is permitted too.
    pub fn permits_ip(&self, route: &Route, ip: IpAddr) -> bool {
        self.admitting(route, ip, None).is_some()
    }

    /// Per-datagram admission (IP and port): the first routed cluster that admits `peer`.
    pub fn admits(&self, route: &Route, peer: SocketAddr) -> Option<ClusterId> {
        self.admitting(route, peer.ip(), Some(peer.port()))
    }

    fn admitting(&self, route: &Route, ip: IpAddr, port: Option<u16>) -> Option<ClusterId> {
        let ip = crate::policy::canonical_peer(ip);
        // The packet goes to the IPv6 address, through the IPv4 one: both must be reachable.
        if let Some(via) = crate::policy::tunnel_ipv4(ip) {
            self.admitting(route, IpAddr::V4(via), None)?;
        }
        let own = self.own_ips.contains(&ip);
        let full = if ip.is_ipv4() { 32 } else { 128 };
        route.clusters.iter().copied().find(|&c| {
            self.clusters[c].endpoints.iter().any(|e| {
                e.admits_ip(ip)
                    && (!own || e.prefix_len == full)
                    && port.is_none_or(|p| e.admits_port(p))
            })
        })
    }
}

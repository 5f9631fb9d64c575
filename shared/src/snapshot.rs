//! The immutable, generation-numbered view of the running config that shards read on the hot
//! path: which listeners run, which peers each listener may reach, and how to authenticate.
//!
//! The control thread builds a new [`Snapshot`] per accepted config (or endpoint change) and
//! publishes it through a [`SnapshotHandle`]; shards read it with `arc_swap::Cache`, never lock,
//! and re-check a cached verdict only when [`Snapshot::generation`] changes.

use crate::auth::Authenticator;
use crate::config::{
    ClusterConfig, ClusterProtocol, ClusterType, Endpoint, ListenerConfig, ListenerProtocol,
    RoutingPolicy, StaticEndpoint, StunnerConfig,
};
use arc_swap::ArcSwap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
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
    /// The relay address advertised in XOR-RELAYED-ADDRESS, per family served.
    pub relay: RelayAddresses,
    /// The address it binds: `None` binds every address of both families.
    pub bind: Option<IpAddr>,
    /// The port it binds.
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
    /// The listener `listener` of `config`, in run `run`. It is served as TURN over its
    /// transport when a TURN server serves it (else its protocol is a plain one, which no
    /// shard opens); its relay addresses are the `addresses` of the first UDP cluster of that
    /// server, then `env_relay` for a family they name none of ([`Host::relay`]), then IPv4 on
    /// the relay socket's wildcard address.
    pub fn from_config(
        config: &StunnerConfig,
        listener: &ListenerConfig,
        run: u64,
        env_relay: RelayAddresses,
    ) -> ListenerSpec {
        let server = config.turn_server(listener);
        let protocol = match config.listener_protocol(listener) {
            Some(protocol) => protocol,
            None => match listener.protocol {
                crate::config::Transport::Udp | crate::config::Transport::Stdin => {
                    ListenerProtocol::Udp
                }
                crate::config::Transport::Tcp => ListenerProtocol::Tcp,
                crate::config::Transport::Tls => ListenerProtocol::Tls,
                crate::config::Transport::Dtls => ListenerProtocol::Dtls,
            },
        };
        let relay_cluster = server.and_then(|server| {
            config
                .server_clusters(server)
                .find(|c| c.protocol == ClusterProtocol::Udp)
        });
        let configured = relay_cluster
            .map(|c| RelayAddresses::parse_list(c.addresses.iter().map(String::as_str)))
            .unwrap_or_default();
        ListenerSpec {
            name: listener.name.clone(),
            protocol,
            relay: configured.or(env_relay).or_wildcard(),
            bind: listener.address.parse().ok(),
            port: listener.port,
            realm: config.auth.realm.clone(),
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
    /// protocol, address, port, certificate or key, or the realm changed — and a change of its
    /// relay addresses (v1's listener address; in v2 the relaying cluster's `addresses`,
    /// which STUNner v2 applies without a restart: uturn's allocations keep the relay address
    /// they were made with, so new ones can only get the new address from a new run). The control plane
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

/// What a snapshot takes from the host it is built on.
#[derive(Debug, Clone, Default)]
pub struct Host {
    /// The addresses of its interfaces ([`crate::policy::host_ips`]).
    pub ips: Vec<IpAddr>,
    /// The relay addresses its environment names ([`RelayAddresses::from_env`]), for the
    /// families a config gives no address of.
    pub relay: RelayAddresses,
}

impl Host {
    /// This host, now.
    pub fn current() -> Host {
        Host {
            ips: crate::policy::host_ips(),
            relay: RelayAddresses::from_env(&|key| std::env::var(key).ok()),
        }
    }
}

/// The relay addresses a listener advertises, one per address family it relays: an
/// unspecified address advertises the relay socket's own (wildcard) address, as stunnerd does
/// when no address is configured; `None` means the family is not served (440 to an Allocate
/// that asks for it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RelayAddresses {
    /// IPv4 relays.
    pub v4: Option<Ipv4Addr>,
    /// IPv6 relays.
    pub v6: Option<Ipv6Addr>,
}

impl RelayAddresses {
    /// The first IPv4 and the first IPv6 address of `items`, each of which may hold several
    /// separated by commas (as `status.podIPs` renders in `STUNNER_ADDRS`); blanks, unspecified
    /// addresses and anything that is not an IP (an unexpanded `$VAR`) are skipped.
    pub fn parse_list<'a>(items: impl IntoIterator<Item = &'a str>) -> RelayAddresses {
        let mut relay = RelayAddresses::default();
        for ip in items
            .into_iter()
            .flat_map(|item| item.split(','))
            .filter_map(|item| item.trim().parse::<IpAddr>().ok())
            .filter(|ip| !ip.is_unspecified())
        {
            match ip {
                IpAddr::V4(v4) => relay.v4 = relay.v4.or(Some(v4)),
                IpAddr::V6(v6) => relay.v6 = relay.v6.or(Some(v6)),
            }
        }
        relay
    }

    /// The relay addresses the environment names: `STUNNER_ADDRS` (the pod's addresses, one
    /// per family), then `STUNNER_ADDR` (the pod's primary address).
    pub fn from_env(env: &dyn Fn(&str) -> Option<String>) -> RelayAddresses {
        let addrs = env("STUNNER_ADDRS").unwrap_or_default();
        let addr = env("STUNNER_ADDR").unwrap_or_default();
        RelayAddresses::parse_list([addrs.as_str(), addr.as_str()])
    }

    /// `self`, each family it lacks taken from `fallback`.
    pub fn or(self, fallback: RelayAddresses) -> RelayAddresses {
        RelayAddresses {
            v4: self.v4.or(fallback.v4),
            v6: self.v6.or(fallback.v6),
        }
    }

    /// `self`, or IPv4 advertised as the relay socket's wildcard address if it names no
    /// address at all (stunnerd's behaviour without a relay address).
    pub fn or_wildcard(self) -> RelayAddresses {
        if self.v4.is_none() && self.v6.is_none() {
            RelayAddresses {
                v4: Some(Ipv4Addr::UNSPECIFIED),
                v6: None,
            }
        } else {
            self
        }
    }

    /// Only the family of `ip`, advertised as `ip`.
    pub fn of(ip: IpAddr) -> RelayAddresses {
        match ip {
            IpAddr::V4(v4) => RelayAddresses {
                v4: Some(v4),
                v6: None,
            },
            IpAddr::V6(v6) => RelayAddresses {
                v4: None,
                v6: Some(v6),
            },
        }
    }

    /// The address advertised for IPv6 relays if `ipv6`, else for IPv4 ones.
    pub fn get(&self, ipv6: bool) -> Option<IpAddr> {
        if ipv6 {
            self.v6.map(IpAddr::V6)
        } else {
            self.v4.map(IpAddr::V4)
        }
    }

    /// The addresses of every family served, IPv4 first.
    pub fn iter(&self) -> impl Iterator<Item = IpAddr> {
        self.get(false).into_iter().chain(self.get(true))
    }
}

impl std::fmt::Display for RelayAddresses {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut any = false;
        for ip in self.iter() {
            if any {
                f.write_str(", ")?;
            }
            write!(f, "{ip}")?;
            any = true;
        }
        if !any {
            f.write_str("none")?;
        }
        Ok(())
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
    /// Per-datagram admission checks the peer's port against the endpoints' port ranges (a
    /// v1 config); a v2 config admits by IP only, as STUNner v2 does.
    pub enforce_ports: bool,
    /// The other gateway pods of this gateway (second-chance forwarding), this pod's own
    /// addresses left out; empty when forwarding is off.
    pub sibling_ips: Arc<[IpAddr]>,
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
    /// clusters are taken from the config. The host's interface addresses and relay addresses
    /// are read now ([`Host::current`]), so every snapshot, at start and after each reload or
    /// endpoint change, refuses the addresses the host has then.
    pub fn from_config(
        config: &StunnerConfig,
        generation: u64,
        discovered: &dyn Fn(&ClusterConfig) -> Vec<StaticEndpoint>,
    ) -> Snapshot {
        Snapshot::from_config_on_host(config, generation, discovered, &Host::current())
    }

    /// [`Snapshot::from_config`] on `host` (for
    /// harnesses that must not depend on the machine they run on).
    pub fn from_config_on_host(
        config: &StunnerConfig,
        generation: u64,
        discovered: &dyn Fn(&ClusterConfig) -> Vec<StaticEndpoint>,
        host: &Host,
    ) -> Snapshot {
        let clusters: Vec<ClusterSpec> = config
            .clusters
            .iter()
            .map(|cluster| {
                let endpoints = if cluster.routing_policy == RoutingPolicy::RoundRobin {
                    // STUNner v2: a ROUND_ROBIN cluster routes flows, it admits no TURN peer.
                    Vec::new()
                } else {
                    let mut endpoints: Vec<StaticEndpoint> = match cluster.cluster_type {
                        ClusterType::Static | ClusterType::StrictDns => cluster
                            .endpoints
                            .iter()
                            .filter_map(|e| match Endpoint::parse(e) {
                                Ok(Endpoint::Ip(ip)) => Some(ip),
                                _ => None,
                            })
                            .collect(),
                        ClusterType::Kubernetes => Vec::new(),
                    };
                    endpoints.extend(discovered(cluster));
                    endpoints
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
                config, listener, generation, host.relay,
            ));
            // The clusters of the TURN server that serves the listener, in its order; ones
            // missing from the config are skipped, as stunnerd does.
            routes.push(Route {
                clusters: config
                    .turn_server(listener)
                    .map(|server| {
                        server
                            .clusters
                            .iter()
                            .filter_map(|r| clusters.iter().position(|c| &c.name == r))
                            .collect()
                    })
                    .unwrap_or_default(),
            });
        }
        // The host's loopback addresses are left to their scope rule: all of 127.0.0.0/8 is
        // the host, and an endpoint inside it is already an explicit choice to reach it.
        let host_ips = host
            .ips
            .iter()
            .map(|&ip| crate::policy::canonical_peer(ip))
            .filter(|&ip| crate::policy::scope(ip) != crate::policy::Scope::Loopback);
        let mut own_ips: Vec<IpAddr> = listeners
            .iter()
            .flat_map(|l| l.relay.iter())
            .map(crate::policy::canonical_peer)
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
            enforce_ports: config.v1.is_some(),
            sibling_ips: Arc::from(Vec::new()),
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

    /// Why `ip` is refused to a client of `route` when the cause is not plainly "no routed
    /// endpoint contains it": the route reaches no cluster, or the address is one only an
    /// explicit endpoint admits (the gateway's own, a special scope, a tunnel through a refused
    /// IPv4 address). For the denial log, never the packet path.
    pub fn refusal_reason(&self, route: Option<&Route>, ip: IpAddr) -> Option<String> {
        let canonical = crate::policy::canonical_peer(ip);
        let route = match route {
            Some(route) if !route.clusters.is_empty() => route,
            _ => {
                return Some(
                    "this listener's server routes to no cluster the config has (check the \
                     names in its routes or clusters)"
                        .to_owned(),
                )
            }
        };
        if let Some(via) = crate::policy::tunnel_ipv4(canonical) {
            if !self.permits_ip(route, IpAddr::V4(via)) {
                return Some(format!(
                    "{ip} travels through {via}, which is refused: {}",
                    self.refusal_reason(Some(route), IpAddr::V4(via))
                        .unwrap_or_else(|| "no routed endpoint contains it".to_owned())
                ));
            }
        }
        if self.own_ips.contains(&canonical) {
            return Some(format!(
                "{canonical} is an address of this gateway (its host's or a relay address): only \
                 an endpoint naming exactly {canonical} admits it, never a range"
            ));
        }
        match crate::policy::scope(canonical) {
            crate::policy::Scope::Global => None,
            scope => Some(format!(
                "{canonical} is a {} address: only an endpoint inside that scope admits it \
                 (such as {canonical} itself), never 0.0.0.0/0 or ::/0",
                scope.name()
            )),
        }
    }

    fn admitting(&self, route: &Route, ip: IpAddr, port: Option<u16>) -> Option<ClusterId> {
        let ip = crate::policy::canonical_peer(ip);
        let port = port.filter(|_| self.enforce_ports);
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

#[cfg(test)]
mod relay_tests {
    use super::*;

    #[test]
    fn relay_addresses_take_the_first_of_each_family_then_the_environment() {
        let list = RelayAddresses::parse_list(["$STUNNER_ADDR", " 10.0.0.1 , fd00::1", "10.0.0.2"]);
        assert_eq!(list.to_string(), "10.0.0.1, fd00::1");
        let env = |key: &str| match key {
            "STUNNER_ADDRS" => Some("10.244.1.5,fd00:244::5".to_owned()),
            "STUNNER_ADDR" => Some("10.244.1.5".to_owned()),
            _ => None,
        };
        let from_env = RelayAddresses::from_env(&env);
        assert_eq!(from_env.to_string(), "10.244.1.5, fd00:244::5");
        // A configured family wins; the environment fills the other.
        let v4_only = RelayAddresses::parse_list(["192.0.2.10"]);
        assert_eq!(v4_only.or(from_env).to_string(), "192.0.2.10, fd00:244::5");
        // Unspecified addresses name nothing; with nothing named, IPv4 on the wildcard.
        let wildcard = RelayAddresses::parse_list(["0.0.0.0", "::"]);
        assert_eq!(wildcard, RelayAddresses::default());
        assert_eq!(wildcard.or_wildcard().to_string(), "0.0.0.0");
        assert_eq!(
            RelayAddresses::from_env(&|_| None),
            RelayAddresses::default()
        );
    }
}

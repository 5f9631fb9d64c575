//! What a config asks for that works otherwise than its author may expect: one line each, with
//! its fix, for the log when the config is applied ([`StunnerConfig::warnings`]), and the two
//! lines stunnerd itself logs for a config with no listeners or no clusters
//! ([`StunnerConfig::empty_warnings`]).

use super::{
    AuthType, ClusterProtocol, ClusterType, Endpoint, RoutingPolicy, ServiceEndpoint, StunnerConfig,
};
use crate::snapshot::RelayAddresses;

/// stunnerd's words for a config that runs no listener.
const NO_LISTENERS: &str = "Running with no listeners: gateway unreachable";
/// stunnerd's words for a config that admits no peer.
const NO_CLUSTERS: &str = "Running with no clusters: TURN forwarding to peers not permitted";

impl StunnerConfig {
    /// What the config asks for that works otherwise than its author may expect, one line
    /// each with its fix, for the log when it is applied: what the document's reader noticed
    /// (unknown keys, `port: 0`), then what the config means (a route to a missing cluster, a
    /// log spec with unknown items, no relay address a client can reach, …), with the relay
    /// addresses the process environment gives (`STUNNER_ADDR`, `STUNNER_ADDRS`).
    pub fn warnings(&self) -> Vec<String> {
        self.warnings_with_env(&|key| std::env::var(key).ok())
    }

    /// [`StunnerConfig::warnings`], with the environment looked up in `env`.
    pub fn warnings_with_env(&self, env: &dyn Fn(&str) -> Option<String>) -> Vec<String> {
        let mut out = self.document_warnings.0.clone();
        loglevel(self, &mut out);
        dangling_names(self, &mut out);
        relay_addresses(self, env, &mut out);
        credentials(self, &mut out);
        unserved_listeners(self, &mut out);
        peer_admission(self, &mut out);
        out
    }

    /// What stunnerd logs (in its words, under its `stunner` scope) when it runs a config
    /// with no listeners or no clusters; nothing for the zero config a watcher starts from,
    /// which is no one's config.
    pub fn empty_warnings(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if (self.listeners.is_empty() || self.clusters.is_empty()) && !self.is_zero() {
            if self.listeners.is_empty() {
                out.push(NO_LISTENERS);
            }
            if self.clusters.is_empty() {
                out.push(NO_CLUSTERS);
            }
        }
        out
    }
}

/// Items of `admin.loglevel` that are not `scope:LEVEL` with a known scope and level.
fn loglevel(config: &StunnerConfig, out: &mut Vec<String>) {
    for problem in crate::logspec::check(&config.admin.loglevel) {
        let skipped = if problem.is_skipped() {
            " (the item is skipped)"
        } else {
            ""
        };
        out.push(format!(
            "admin.loglevel {:?}: {problem}{skipped}",
            config.admin.loglevel
        ));
    }
}

/// A listener's server or a server's cluster (a v1 listener's route) that the config lacks.
fn dangling_names(config: &StunnerConfig, out: &mut Vec<String>) {
    let v1 = config.v1.is_some();
    for (i, listener) in config.listeners.iter().enumerate() {
        for name in &listener.servers {
            if config.server(name).is_none() && !v1 {
                out.push(format!(
                    "listeners[{i}] {:?}: server {name:?} is not in servers ({}): it is \
                     skipped; add the server or fix the name",
                    listener.name,
                    names(config.servers.iter().map(|s| s.name.as_str()))
                ));
            }
        }
    }
    for (i, server) in config.servers.iter().enumerate() {
        for name in &server.clusters {
            if config.cluster(name).is_some() {
                continue;
            }
            let known = || config.clusters.iter().map(|c| c.name.as_str());
            let near = crate::spelling::nearest(name, known())
                .map(|near| format!("did you mean {near:?}? "))
                .unwrap_or_default();
            let place = if v1 {
                format!("listener {:?}: route {name:?}", server.name)
            } else {
                format!("servers[{i}] {:?}: cluster {name:?}", server.name)
            };
            out.push(format!(
                "{place} names no cluster of the config ({}): no peer is admitted through it; \
                 {near}add a cluster named {name:?} or fix the name",
                names(known())
            ));
        }
    }
}

/// A served listener whose clients would be told the relay address 0.0.0.0.
fn relay_addresses(
    config: &StunnerConfig,
    env: &dyn Fn(&str) -> Option<String>,
    out: &mut Vec<String>,
) {
    for listener in &config.listeners {
        let Some(server) = config.turn_server(listener) else {
            continue;
        };
        let configured = config
            .server_clusters(server)
            .find(|c| c.protocol == ClusterProtocol::Udp)
            .map(|c| RelayAddresses::parse_list(c.addresses.iter().map(String::as_str)))
            .unwrap_or_default()
            .or(RelayAddresses::from_env(env));
        if configured == RelayAddresses::default() {
            let field = if config.v1.is_some() {
                "the listener's address"
            } else {
                "the relaying cluster's addresses"
            };
            out.push(format!(
                "listener {:?}: no relay address is configured, so clients are told their relay \
                 is 0.0.0.0, which no peer can send to: set STUNNER_ADDR to the pod's address \
                 (STUNner's operator does), or {field}",
                listener.name
            ));
        }
    }
}

/// An auth type without the credentials it needs (v2 lets them be missing).
fn credentials(config: &StunnerConfig, out: &mut Vec<String>) {
    let auth = &config.auth;
    let needs: &[&str] = match auth.auth_type {
        AuthType::Static => &["username", "password"],
        AuthType::Ephemeral => &["secret"],
        AuthType::None => &[],
    };
    if needs
        .iter()
        .any(|key| auth.credentials.get(*key).is_none_or(String::is_empty))
    {
        out.push(format!(
            "auth handler: {} auth without credentials: every client is refused",
            auth.auth_type
        ));
    }
}

/// A listener no TURN server serves: its port stays closed.
fn unserved_listeners(config: &StunnerConfig, out: &mut Vec<String>) {
    for listener in &config.listeners {
        if config.listener_protocol(listener).is_none() {
            out.push(format!(
                "listener {:?}: no TURN server serves it (servers {:?}): its port is not opened",
                listener.name, listener.servers
            ));
        }
    }
}

/// A cluster that admits otherwise than it reads: a ROUND_ROBIN one admits no peer, and a v2
/// FILTER cluster admits by IP whatever port its endpoints name.
fn peer_admission(config: &StunnerConfig, out: &mut Vec<String>) {
    for cluster in &config.clusters {
        if cluster.routing_policy == RoutingPolicy::RoundRobin {
            out.push(format!(
                "cluster {:?}: a ROUND_ROBIN cluster admits no TURN peer (it may still provide \
                 the relay address)",
                cluster.name
            ));
            continue;
        }
        if config.v1.is_some() {
            continue;
        }
        for endpoint in &cluster.endpoints {
            let restricts = match cluster.cluster_type {
                ClusterType::Kubernetes => ServiceEndpoint::parse_v2(endpoint)
                    .is_ok_and(|e| (e.port_min, e.port_max) != (1, u16::MAX)),
                _ => Endpoint::parse(endpoint).is_ok_and(|e| e.restricts_ports()),
            };
            if restricts {
                out.push(format!(
                    "cluster {}: the port of endpoint {endpoint:?} is not enforced: a FILTER \
                     cluster admits peers by IP",
                    cluster.name
                ));
            }
        }
    }
}

/// Names for a message: `a, b, c`, or `there are none`.
fn names<'a>(names: impl Iterator<Item = &'a str>) -> String {
    let all: Vec<&str> = names.collect();
    if all.is_empty() {
        "there are none".to_owned()
    } else {
        all.join(", ")
    }
}

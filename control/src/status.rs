//! What `/ready` and `/status` show: the control loop writes a view of its state after every
//! batch, and the health server reads it.

use crate::admin::HealthSource;
use crate::state::ControlState;
use serde_json::{json, Value};
use std::sync::{Arc, Mutex};
use uturn_shared::config::StunnerConfig;

/// The last view the control loop wrote.
#[derive(Default)]
struct StatusView {
    config: Value,
    /// A v2 config's servers: name, type, clusters, and the listeners they serve.
    servers: Option<Vec<ServerView>>,
    ready: bool,
    draining: bool,
    discovery: Value,
}

/// A server of a v2 config as `/status` shows it.
struct ServerView {
    name: String,
    server_type: &'static str,
    clusters: Vec<String>,
    /// The listeners whose clients it serves (its sessions are theirs).
    listeners: Vec<String>,
}

/// The status the health server answers with, shared between the control loop, the health
/// server and [`crate::Control`].
pub(crate) struct StatusBoard {
    allocations: Arc<dyn Fn() -> u64 + Send + Sync>,
    listener_allocations: crate::ListenerAllocations,
    force_ready: bool,
    dataplane: crate::DataplaneStatus,
    view: Mutex<StatusView>,
}

const REDACTED: &str = "<redacted>";

/// The running config as `/status` shows it: passwords, shared secrets, TLS keys and license
/// keys are replaced, so a status scrape never leaks a credential.
pub fn redacted(config: &StunnerConfig) -> Value {
    let mut doc: Value = serde_json::from_str(&config.to_json()).unwrap_or(Value::Null);
    if let Some(credentials) = doc["auth"]["credentials"].as_object_mut() {
        for (key, value) in credentials.iter_mut() {
            if key != "username" {
                *value = json!(REDACTED);
            }
        }
    }
    if let Some(listeners) = doc["listeners"].as_array_mut() {
        for listener in listeners {
            if listener["key"].as_str().is_some_and(|k| !k.is_empty()) {
                listener["key"] = json!(REDACTED);
            }
        }
    }
    if let Some(admin) = doc["admin"].as_object_mut() {
        if admin.contains_key("license_config") {
            admin.insert("license_config".into(), json!(REDACTED));
        }
    }
    doc
}

impl HealthSource for StatusBoard {
    fn ready(&self) -> bool {
        self.force_ready || self.view.lock().is_ok_and(|v| v.ready && !v.draining)
    }

    fn status_json(&self) -> String {
        let Ok(view) = self.view.lock() else {
            return "{}".into();
        };
        let mut doc = match &view.config {
            Value::Object(map) => map.clone(),
            _ => serde_json::Map::new(),
        };
        if let Some(servers) = &view.servers {
            let by_listener = (self.listener_allocations)();
            let sessions = |listeners: &[String]| -> u64 {
                by_listener
                    .iter()
                    .filter(|(name, _)| listeners.contains(name))
                    .map(|(_, n)| n)
                    .sum()
            };
            let servers: Vec<Value> = servers
                .iter()
                .map(|s| {
                    json!({
                        "name": s.name,
                        "type": s.server_type,
                        "clusters": s.clusters,
                        "sessions": sessions(&s.listeners),
                    })
                })
                .collect();
            doc.insert("servers".into(), Value::Array(servers));
        }
        doc.insert("allocationCount".into(), json!((self.allocations)()));
        let status = if view.draining {
            "TERMINATING"
        } else if view.ready {
            "READY"
        } else {
            "NOT-READY"
        };
        doc.insert("status".into(), json!(status));
        doc.insert("discovery".into(), view.discovery.clone());
        (self.dataplane)(&mut doc);
        Value::Object(doc).to_string()
    }
}

impl StatusBoard {
    /// A board that counts `allocations` for `/status`; with `force_ready`, `/ready` answers
    /// 200 always (`--force-ready-status`).
    pub(crate) fn new(
        allocations: Arc<dyn Fn() -> u64 + Send + Sync>,
        listener_allocations: crate::ListenerAllocations,
        force_ready: bool,
        dataplane: crate::DataplaneStatus,
    ) -> StatusBoard {
        StatusBoard {
            allocations,
            listener_allocations,
            force_ready,
            dataplane,
            view: Mutex::new(StatusView::default()),
        }
    }

    /// Graceful shutdown: `/ready` fails (unless forced) and `/status` says `TERMINATING`.
    pub(crate) fn begin_drain(&self) {
        if let Ok(mut view) = self.view.lock() {
            view.draining = true;
        }
    }

    /// Shows `state`: the redacted config, readiness and what discovery knows.
    pub(crate) fn update(&self, state: &ControlState) {
        let services: Vec<Value> = state
            .services()
            .iter()
            .map(|(key, s)| {
                json!({
                    "service": key,
                    "addresses": s.addresses(),
                    "terminating": s.terminating(),
                    "clusterIPs": s.cluster_ips,
                    "slices": s.slices.len(),
                    "synced": s.synced,
                    "syncTimedOut": s.sync_timed_out,
                    "api": match &s.api_error {
                        None => "connected".to_string(),
                        Some(e) => format!("unreachable, keeping last known endpoints: {e}"),
                    },
                })
            })
            .collect();
        let dns: Vec<Value> = state
            .dns_names()
            .iter()
            .map(|(host, ips)| json!({"hostname": host, "addresses": ips}))
            .collect();
        let config = state.config();
        let servers = config.v1.is_none().then(|| {
            config
                .servers
                .iter()
                .map(|server| ServerView {
                    name: server.name.clone(),
                    server_type: server.server_type.as_str(),
                    clusters: server.clusters.clone(),
                    listeners: config
                        .listeners
                        .iter()
                        .filter(|l| config.turn_server(l).is_some_and(|t| t.name == server.name))
                        .map(|l| l.name.clone())
                        .collect(),
                })
                .collect()
        });
        if let Ok(mut view) = self.view.lock() {
            view.config = redacted(config);
            view.servers = servers;
            view.ready = state.ready();
            view.discovery = json!({
                "kubernetes": services,
                "dns": dns,
                "readyWaitsFor": state.waiting_for(),
                "timeoutSeconds": state.discovery_timeout().as_secs_f64(),
            });
        }
    }
}

//! What `/ready` and `/status` show: the control loop writes a view of its state after every
//! batch, and the health server reads it. Each section comes from the part that owns it: the
//! running config and its servers from here, discovery from [`crate::discovery::status`], the
//! allocations and the dataplane's own sections (the kernel offload, the siblings) through the
//! [`DataplaneHandle`].

use crate::admin::HealthSource;
use crate::state::ControlState;
use crate::DataplaneHandle;
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
    dataplane: Arc<dyn DataplaneHandle>,
    force_ready: bool,
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

/// The running config's document in the shape of STUNner's `StunnerStatus` (what
/// `stunnerctl status` decodes, `{.admin.quota}` and all): the admin section as STUNner's
/// `AdminStatus` (`quota`, `offload` as `ENGINE[interfaces]`, `licensing_info`; the config's
/// `user_quota`, `offload_engine`, `offload_interfaces`, `license_config` and uturn's
/// `state_dir` are not shown),
/// listeners and clusters sorted by name, each with STUNner's `stats` (its offload engine's
/// counters, which its open-source build leaves at zero, as uturn does: uturn's offloaded
/// traffic is in the metrics, `uturn_offloaded_packets_total`).
fn stunner_shape(doc: &mut serde_json::Map<String, Value>) {
    if let Some(admin) = doc.get_mut("admin").and_then(Value::as_object_mut) {
        admin.remove("state_dir");
        let quota = admin
            .remove("user_quota")
            .and_then(|q| q.as_i64())
            .unwrap_or(0);
        let engine = admin
            .remove("offload_engine")
            .and_then(|e| e.as_str().map(str::to_owned))
            .filter(|e| !e.is_empty())
            .unwrap_or_else(|| "None".to_owned());
        let interfaces: Vec<String> = admin
            .remove("offload_interfaces")
            .and_then(|i| serde_json::from_value(i).ok())
            .unwrap_or_default();
        let interfaces = if engine == "None" || interfaces.is_empty() {
            "all".to_owned()
        } else {
            interfaces.join(",")
        };
        admin.remove("license_config");
        admin.insert("quota".into(), json!(quota.to_string()));
        admin.insert("offload".into(), json!(format!("{engine}[{interfaces}]")));
        admin.insert("licensing_info".into(), json!("{tier:free}"));
    }
    let zero = json!({"pkts": 0, "bytes": 0, "timestamp": 0});
    for kind in ["listeners", "clusters"] {
        if let Some(items) = doc.get_mut(kind).and_then(Value::as_array_mut) {
            items.sort_by(|a, b| a["name"].as_str().cmp(&b["name"].as_str()));
            for item in items.iter_mut().filter_map(Value::as_object_mut) {
                item.insert("stats".into(), json!({"rx": zero, "tx": zero}));
            }
        }
    }
}

impl HealthSource for StatusBoard {
    fn ready(&self) -> bool {
        let view = self.view.lock().is_ok_and(|v| v.ready && !v.draining);
        self.force_ready || (view && self.dataplane.restored())
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
            let by_listener = self.dataplane.listener_allocations();
            let sessions = |listeners: &[String]| -> u64 {
                by_listener
                    .iter()
                    .filter(|counted| listeners.contains(&counted.listener))
                    .map(|counted| counted.allocations)
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
        stunner_shape(&mut doc);
        doc.insert(
            "allocationCount".into(),
            json!(self.dataplane.allocations()),
        );
        let status = if view.draining {
            "TERMINATING"
        } else if view.ready {
            "READY"
        } else {
            "NOT-READY"
        };
        doc.insert("status".into(), json!(status));
        doc.insert("discovery".into(), view.discovery.clone());
        for section in self.dataplane.status_sections() {
            doc.insert(section.key.into(), section.value);
        }
        Value::Object(doc).to_string()
    }
}

impl StatusBoard {
    /// A board that asks `dataplane` for its allocations and sections at each `/status`; with
    /// `force_ready`, `/ready` answers 200 always (`--force-ready-status`).
    pub(crate) fn new(dataplane: Arc<dyn DataplaneHandle>, force_ready: bool) -> StatusBoard {
        StatusBoard {
            dataplane,
            force_ready,
            view: Mutex::new(StatusView::default()),
        }
    }

    /// Graceful shutdown: `/ready` fails (unless forced) and `/status` says `TERMINATING`.
    pub(crate) fn begin_drain(&self) {
        if let Ok(mut view) = self.view.lock() {
            view.draining = true;
        }
    }

    /// Shows `state`: the redacted config, its servers, readiness and what discovery knows.
    pub(crate) fn update(&self, state: &ControlState) {
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
            view.discovery = crate::discovery::status(state);
        }
    }
}

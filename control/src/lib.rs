//! uturn's control plane: config origins (file, CDS, TURN URI), Kubernetes and DNS discovery,
//! and the health-check server, on one control thread that publishes arc-swap snapshots to
//! the dataplane shards.
//!
//! [`Control::start`] runs a single-threaded tokio runtime on a thread of its own. Config
//! sources, Service watchers and DNS resolvers are tasks that send [`Event`]s to one loop; the
//! loop applies every event that is ready (a batch), then publishes at most one snapshot.
#![deny(missing_docs)]

pub mod cds;
pub mod dns;
pub mod file;
pub mod health;
pub mod kubernetes;
pub mod origin;
pub mod process;
pub mod state;

use kubernetes::KubeOptions;
use serde_json::{json, Value};
use state::{ControlState, ServiceChange, Skipped};
use std::collections::BTreeMap;
use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinHandle;
use uturn_shared::config::{parse_http_endpoint, ServiceEndpoint, StunnerConfig};
use uturn_shared::snapshot::SnapshotHandle;

/// The default health-check port (`http://:8086`).
pub const DEFAULT_HEALTHCHECK_PORT: u16 = 8086;
/// The default metrics port (`http://:8080/metrics`).
pub const DEFAULT_METRICS_PORT: u16 = 8080;

/// Something the control loop must apply.
#[derive(Debug)]
pub enum Event {
    /// A new validated config from the watched origin.
    Config(Box<StunnerConfig>),
    /// A change to a watched Kubernetes Service, keyed `<namespace>/<service>`.
    Service(String, ServiceChange),
    /// The addresses a STRICT_DNS hostname resolves to now.
    Dns(String, Vec<IpAddr>),
    /// Stop following the config origin (graceful shutdown): no later config is applied.
    StopWatching,
}

/// Where later configs come from.
#[derive(Debug, Clone)]
pub enum Source {
    /// Nowhere: the initial config runs until exit.
    Fixed,
    /// Follow a file (`-c file://PATH -w`).
    File(PathBuf),
    /// Follow a CDS server over a WebSocket (`-c http://HOST:PORT -w`).
    Cds(cds::CdsTarget),
}

/// How to run the control plane.
pub struct ControlConfig {
    /// Where later configs come from.
    pub source: Source,
    /// The config the dataplane starts with (already published in `snapshot`).
    pub initial: StunnerConfig,
    /// The snapshot the shards read; the control thread republishes it.
    pub snapshot: SnapshotHandle,
    /// How to reach the Kubernetes API server (KUBERNETES clusters).
    pub kube: KubeOptions,
    /// Live allocations over all shards (for `/status`).
    pub allocations: Arc<dyn Fn() -> u64 + Send + Sync>,
    /// Called after each applied config (e.g. to apply `admin.loglevel`).
    pub on_config: Box<dyn Fn(&StunnerConfig) + Send>,
    /// Appends the dataplane's metrics (Prometheus text) for a scrape.
    pub metrics: Arc<dyn Fn(&mut String) + Send + Sync>,
    /// `--force-ready-status`: `/ready` answers 200 always, also while draining.
    pub force_ready: bool,
}

/// The running control thread.
pub struct Control {
    events: UnboundedSender<Event>,
    status: Arc<StatusBoard>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Control {
    /// Starts the control thread.
    pub fn start(config: ControlConfig) -> std::io::Result<Control> {
        let (events, receiver) = unbounded_channel();
        let status = Arc::new(StatusBoard {
            allocations: config.allocations.clone(),
            force_ready: config.force_ready,
            view: Mutex::new(StatusView::default()),
        });
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let board = status.clone();
        let sender = events.clone();
        let thread = std::thread::Builder::new()
            .name("uturn-control".into())
            .spawn(move || runtime.block_on(run(config, sender, receiver, board)))?;
        Ok(Control {
            events,
            status,
            thread: Some(thread),
        })
    }

    /// Stops following the config origin: the running config stays until exit.
    pub fn stop_watching(&self) {
        let _ = self.events.send(Event::StopWatching);
    }

    /// Graceful shutdown: no later config is applied, `/ready` fails (unless forced) and
    /// `/status` says `TERMINATING`. Everything else keeps running.
    pub fn begin_drain(&self) {
        if let Ok(mut view) = self.status.view.lock() {
            view.draining = true;
        }
        self.stop_watching();
    }

    /// Whether a non-zero config has been applied.
    pub fn ready(&self) -> bool {
        health::HealthSource::ready(&*self.status)
    }

    /// The `/status` document.
    pub fn status_json(&self) -> String {
        health::HealthSource::status_json(&*self.status)
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // The thread runs until the process exits; dropping the handle detaches it.
        let _ = self.thread.take();
    }
}

#[derive(Default)]
struct StatusView {
    config: Value,
    ready: bool,
    draining: bool,
    discovery: Value,
}

struct StatusBoard {
    allocations: Arc<dyn Fn() -> u64 + Send + Sync>,
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

impl health::HealthSource for StatusBoard {
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
        Value::Object(doc).to_string()
    }
}

impl StatusBoard {
    fn update(&self, state: &ControlState) {
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
        if let Ok(mut view) = self.view.lock() {
            view.config = redacted(state.config());
            view.ready = state.ready();
            view.discovery = json!({"kubernetes": services, "dns": dns});
        }
    }
}

/// The tasks the loop keeps in step with the config.
#[derive(Default)]
struct Tasks {
    source: Option<JoinHandle<()>>,
    services: BTreeMap<String, JoinHandle<()>>,
    dns: BTreeMap<String, JoinHandle<()>>,
    health: Option<(String, JoinHandle<()>)>,
    metrics: Option<(String, JoinHandle<()>)>,
}

impl Tasks {
    fn sync(
        &mut self,
        state: &ControlState,
        events: &UnboundedSender<Event>,
        kube: &KubeOptions,
        board: &Arc<StatusBoard>,
        metrics: &Arc<dyn Fn(&mut String) + Send + Sync>,
    ) {
        self.services.retain(|key, task| {
            let keep = state.services().contains_key(key);
            if !keep {
                task.abort();
            }
            keep
        });
        for key in state.services().keys() {
            if self.services.contains_key(key) {
                continue;
            }
            let Ok(service) = ServiceEndpoint::parse(key) else {
                continue;
            };
            tracing::info!(target: "k8s", "watching EndpointSlices and Service {key}");
            let task = tokio::spawn(kubernetes::watch_service(
                service.namespace,
                service.name,
                kube.clone(),
                events.clone(),
            ));
            self.services.insert(key.clone(), task);
        }
        self.dns.retain(|host, task| {
            let keep = state.dns_names().contains_key(host);
            if !keep {
                task.abort();
            }
            keep
        });
        for host in state.dns_names().keys() {
            if !self.dns.contains_key(host) {
                let task = tokio::spawn(dns::resolve_forever(host.clone(), events.clone()));
                self.dns.insert(host.clone(), task);
            }
        }
        let endpoint = state
            .config()
            .admin
            .healthcheck_endpoint
            .clone()
            .unwrap_or_default();
        if self.health.as_ref().map(|(e, _)| e) != Some(&endpoint) {
            if let Some((_, task)) = self.health.take() {
                task.abort();
            }
            let source: Arc<dyn health::HealthSource> = board.clone();
            let task = start_http("health-check", &endpoint, DEFAULT_HEALTHCHECK_PORT, |_| {
                health::health_handler(source)
            });
            self.health = Some((endpoint, task));
        }
        let endpoint = state.config().admin.metrics_endpoint.clone();
        if self.metrics.as_ref().map(|(e, _)| e) != Some(&endpoint) {
            if let Some((_, task)) = self.metrics.take() {
                task.abort();
            }
            let dataplane = metrics.clone();
            let task = start_http("metrics", &endpoint, DEFAULT_METRICS_PORT, move |path| {
                let path = path.into_bytes();
                Arc::new(move |request: &[u8]| {
                    if request != path.as_slice() {
                        return health::not_found();
                    }
                    let mut body = String::with_capacity(4096);
                    dataplane(&mut body);
                    process::render(&mut body);
                    (200, health::PROMETHEUS, body)
                })
            });
            self.metrics = Some((endpoint, task));
        }
    }
}

/// Starts the `what` HTTP server on `endpoint` (nothing if empty), with the handler that
/// `handler` makes for the endpoint's path.
fn start_http(
    what: &'static str,
    endpoint: &str,
    default_port: u16,
    handler: impl FnOnce(String) -> health::Handler + Send + 'static,
) -> JoinHandle<()> {
    let endpoint = endpoint.to_string();
    tokio::spawn(async move {
        if endpoint.is_empty() {
            return;
        }
        let parsed = match parse_http_endpoint(&endpoint, default_port) {
            Ok(e) => e,
            Err(e) => {
                tracing::error!(target: "stunnerd", "{what} server not started: {e}");
                return;
            }
        };
        match tokio::net::TcpListener::bind(parsed.addr).await {
            Ok(listener) => {
                tracing::info!(target: "stunnerd", "{what} server listening on http://{}{}", parsed.addr, parsed.path);
                health::serve(listener, handler(parsed.path)).await;
            }
            Err(e) => tracing::error!(
                target: "stunnerd",
                "cannot open the {what} server on {}: {e}; set the admin endpoint to a free address, or \"\" to disable it",
                parsed.addr
            ),
        }
    })
}

async fn run(
    config: ControlConfig,
    events: UnboundedSender<Event>,
    mut receiver: UnboundedReceiver<Event>,
    board: Arc<StatusBoard>,
) {
    let generation = config.snapshot.load().generation;
    let mut state = ControlState::new(config.initial, generation);
    let mut tasks = Tasks {
        source: match config.source {
            Source::Fixed => None,
            Source::File(path) => Some(tokio::spawn(file::watch(path, events.clone()))),
            Source::Cds(target) => Some(tokio::spawn(cds::watch(target, events.clone()))),
        },
        ..Tasks::default()
    };
    // Discovery fills in KUBERNETES and STRICT_DNS clusters of the initial config as it lands.
    loop {
        tasks.sync(&state, &events, &config.kube, &board, &config.metrics);
        board.update(&state);
        let Some(first) = receiver.recv().await else {
            return;
        };
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Config(new) => apply_config(&mut state, *new, &*config.on_config),
                Event::Service(key, change) => state.handle_discovery(&key, change),
                Event::Dns(host, ips) => state.handle_dns(&host, ips),
                Event::StopWatching => {
                    if let Some(task) = tasks.source.take() {
                        tracing::info!(target: "stunnerd", "Canceling config loader");
                        task.abort();
                    }
                }
            }
            next = receiver.try_recv().ok();
        }
        if let Some(mut snapshot) = state.poll_snapshot() {
            // An unchanged listener keeps its run, and with it its sockets on every shard.
            snapshot.carry_listener_runs(&config.snapshot.load());
            tracing::debug!(target: "stunner", "publishing dataplane snapshot generation {}", snapshot.generation);
            config.snapshot.store(Arc::new(snapshot));
        }
    }
}

fn apply_config(state: &mut ControlState, new: StunnerConfig, on_config: &dyn Fn(&StunnerConfig)) {
    match state.handle_config(new, true) {
        Ok(summary) => {
            tracing::info!(
                target: "stunner",
                "Reconciliation ready: new objects: {}, changed objects: {}, deleted objects: {}, started objects: {}, restarted objects: {}",
                summary.new,
                summary.changed,
                summary.deleted,
                summary.started,
                summary.restarted
            );
            if state.config().listeners.is_empty() {
                tracing::warn!(target: "stunner", "Running with no listeners: gateway unreachable");
            }
            if state.config().clusters.is_empty() {
                tracing::warn!(target: "stunner", "Running with no clusters: TURN forwarding to peers not permitted");
            }
            on_config(state.config());
        }
        Err(Skipped::Duplicate) => {
            tracing::debug!(target: "stunner", "ignoring a config identical to the running one");
        }
        Err(Skipped::Delete) => {
            tracing::info!(target: "stunner", "Ignoring delete configuration update");
        }
    }
}

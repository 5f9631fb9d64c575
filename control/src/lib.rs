//! uturn's control plane: config origins (file, CDS, TURN URI), Kubernetes and DNS discovery,
//! and the health-check server, on one control thread that publishes arc-swap snapshots to
//! the dataplane shards.
//!
//! [`Control::start`] runs a single-threaded tokio runtime on a thread of its own. Config
//! sources, Service watchers and DNS resolvers are tasks that send [`Event`]s to one loop; the
//! loop applies every event that is ready (a batch), then publishes at most one snapshot.
#![deny(missing_docs)]

pub mod cds;
pub mod cds_message;
pub mod dns;
pub mod file;
pub mod health;
pub mod http;
pub mod kubernetes;
pub mod origin;
pub mod process;
pub mod state;

use kubernetes::KubeOptions;
use serde_json::{json, Value};
use state::{ControlState, ServiceChange, Skipped};
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};
use tokio::task::JoinHandle;
use uturn_shared::config::{
    parse_http_endpoint, HttpEndpoint, ServiceEndpoint, StunnerConfig, DEFAULT_HEALTHCHECK_PORT,
    DEFAULT_METRICS_PORT,
};
use uturn_shared::snapshot::SnapshotHandle;

/// The default of `--discovery-timeout`: how long `/ready` waits for the first EndpointSlice
/// list of each watched Service. A healthy API server lists in well under a second, and the
/// kube-rs watcher retries a failed list within about a second, so 10 s rides out a few
/// failures; it stays well inside the 30 s a kubelet gives a pod with the usual readiness probe
/// (period 10 s, failure threshold 3) and keeps a rollout moving when the API server is down.
pub const DEFAULT_DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// The Service a watch follows, `<namespace>/<service>`, and which watch of it this is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServiceWatch {
    /// `<namespace>/<service>`.
    pub key: String,
    /// The [`state::ServiceState::watch`] id the watch was started for.
    pub watch: u64,
}

impl std::fmt::Display for ServiceWatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.key)
    }
}

/// Something the control loop must apply.
#[derive(Debug)]
pub enum Event {
    /// A new validated config from the watched origin.
    Config(Box<StunnerConfig>),
    /// A change to a watched Kubernetes Service, seen by one watch of it.
    Service(ServiceWatch, ServiceChange),
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
    /// `--discovery-timeout`: how long `/ready` waits for the first full EndpointSlice list of
    /// each Service a KUBERNETES cluster names (zero: not at all, as stunnerd).
    pub discovery_timeout: Duration,
    /// Checks a new config (second argument) against what the dataplane can run, given the
    /// running one (first): TLS material that loads, ports no one else holds. An error rejects
    /// the config with that message, and the running config stays.
    pub check: ConfigCheck,
}

/// See [`ControlConfig::check`].
pub type ConfigCheck = Box<dyn Fn(&StunnerConfig, &StunnerConfig) -> Result<(), String> + Send>;

/// The running control thread.
pub struct Control {
    events: UnboundedSender<Event>,
    status: Arc<StatusBoard>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Control {
    /// Starts the control thread. Fails if an admin server of the initial config cannot
    /// listen, with a message naming the field, the value and the fix.
    pub fn start(config: ControlConfig) -> std::io::Result<Control> {
        let (events, receiver) = unbounded_channel();
        let admin = Admin::start(&config).map_err(std::io::Error::other)?;
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
            .spawn(move || runtime.block_on(run(config, admin, sender, receiver, board)))?;
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
        if let Ok(mut view) = self.view.lock() {
            view.config = redacted(state.config());
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

/// The tasks the loop keeps in step with the config.
#[derive(Default)]
struct Tasks {
    source: Option<JoinHandle<()>>,
    /// Service key → the watch id it runs for, and its task.
    services: BTreeMap<String, (u64, JoinHandle<()>)>,
    dns: BTreeMap<String, JoinHandle<()>>,
}

impl Tasks {
    fn sync(&mut self, state: &ControlState, events: &UnboundedSender<Event>, kube: &KubeOptions) {
        // A watch only sends changes after its first list, so a state created anew (the
        // Service left the config and came back within one batch) needs a watch of its own.
        self.services.retain(|key, (watch, task)| {
            let keep = state.services().get(key).is_some_and(|s| s.watch == *watch);
            if !keep {
                task.abort();
            }
            keep
        });
        for (key, service_state) in state.services() {
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
                service_state.watch,
                kube.clone(),
                events.clone(),
            ));
            self.services
                .insert(key.clone(), (service_state.watch, task));
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
    }
}

/// The two admin HTTP servers.
struct Admin {
    health: AdminServer,
    metrics: AdminServer,
}

impl Admin {
    /// Opens the admin servers' sockets for the initial config (they serve once the control
    /// thread runs).
    fn start(config: &ControlConfig) -> Result<Admin, String> {
        let mut admin = Admin {
            health: AdminServer::new(
                "health-check",
                "admin.healthcheck_endpoint",
                DEFAULT_HEALTHCHECK_PORT,
            ),
            metrics: AdminServer::new("metrics", "admin.metrics_endpoint", DEFAULT_METRICS_PORT),
        };
        let (health, metrics) = admin_endpoints(&config.initial);
        // In watch mode the initial config is only the bootstrap one (stunnerd's zero config,
        // health on `:8086`) until the watched origin sends the real one: a port it cannot
        // open is logged, as stunnerd logs a failed bootstrap reconcile, and the next config
        // binds what it names. A fixed config has no next one: it fails the start.
        let watching = !matches!(config.source, Source::Fixed);
        for (server, endpoint) in [(&mut admin.health, health), (&mut admin.metrics, metrics)] {
            match server.bind(&endpoint) {
                Ok(bound) => server.pending = Some(bound),
                Err(e) if watching => tracing::error!(
                    target: "stunnerd",
                    "bootstrap config: {e}; serving without it until the watched config arrives"
                ),
                Err(e) => return Err(e),
            }
        }
        Ok(admin)
    }

    /// Binds what `new` asks for that differs from the running servers; on failure nothing
    /// changes and the error names the field, the value and the fix.
    async fn prepare(&mut self, new: &StunnerConfig) -> Result<(), String> {
        let (health, metrics) = admin_endpoints(new);
        let prepared = match self.health.prepare(&health).await {
            Ok(()) => self.metrics.prepare(&metrics).await,
            Err(e) => Err(e),
        };
        if prepared.is_err() {
            self.rollback();
        }
        prepared
    }

    /// Serves what `prepare` (or `start`) bound.
    fn commit(
        &mut self,
        board: &Arc<StatusBoard>,
        metrics: &Arc<dyn Fn(&mut String) + Send + Sync>,
    ) {
        let source: Arc<dyn health::HealthSource> = board.clone();
        self.health
            .commit(move |_path| health::health_handler(source));
        let dataplane = metrics.clone();
        self.metrics.commit(move |path| {
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
    }

    fn rollback(&mut self) {
        self.health.rollback();
        self.metrics.rollback();
    }
}

/// The health-check and metrics endpoints of `config` ("" when off).
fn admin_endpoints(config: &StunnerConfig) -> (String, String) {
    (
        config
            .admin
            .healthcheck_endpoint
            .clone()
            .unwrap_or_default(),
        config.admin.metrics_endpoint.clone(),
    )
}

/// A socket bound for an admin endpoint, not serving yet.
struct Bound {
    endpoint: String,
    /// `None`: the endpoint is "" (the server is off).
    socket: Option<(std::net::TcpListener, SocketAddr, HttpEndpoint)>,
}

/// A running admin server.
struct Serving {
    endpoint: HttpEndpoint,
    task: JoinHandle<()>,
}

/// One admin HTTP server, kept in step with its config field: a new endpoint is bound before
/// the config that names it is committed, so a port that cannot be opened rejects the config
/// and leaves the running server as it was.
struct AdminServer {
    what: &'static str,
    field: &'static str,
    default_port: u16,
    /// The endpoint the running server (if any) serves.
    endpoint: String,
    serving: Option<Serving>,
    /// Bound by `prepare`, served by `commit`, dropped by `rollback`.
    pending: Option<Bound>,
    /// Whether `prepare` had to stop the running server to bind (same port).
    stopped: Option<HttpEndpoint>,
}

impl AdminServer {
    fn new(what: &'static str, field: &'static str, default_port: u16) -> AdminServer {
        AdminServer {
            what,
            field,
            default_port,
            endpoint: String::new(),
            serving: None,
            pending: None,
            stopped: None,
        }
    }

    fn bind(&self, endpoint: &str) -> Result<Bound, String> {
        if endpoint.is_empty() {
            return Ok(Bound {
                endpoint: String::new(),
                socket: None,
            });
        }
        let parsed = parse_http_endpoint(endpoint, self.default_port)
            .map_err(|e| format!("{} {endpoint:?}: {e}", self.field))?;
        let (listener, bound) =
            health::bind(parsed.addr).map_err(|e| self.cannot_listen(endpoint, parsed.addr, &e))?;
        Ok(Bound {
            endpoint: endpoint.to_string(),
            socket: Some((listener, bound, parsed)),
        })
    }

    fn cannot_listen(&self, endpoint: &str, addr: SocketAddr, e: &std::io::Error) -> String {
        format!(
            "{} {endpoint:?}: the {} server cannot listen on {addr}: {e}; set it to a free \
             address and port, or \"\" to disable the {} server",
            self.field, self.what, self.what
        )
    }

    async fn prepare(&mut self, endpoint: &str) -> Result<(), String> {
        self.pending = None;
        self.stopped = None;
        if endpoint == self.endpoint {
            return Ok(());
        }
        match self.bind(endpoint) {
            Ok(bound) => {
                self.pending = Some(bound);
                Ok(())
            }
            Err(e) => {
                // The running server itself may hold the port (another path, or a wildcard
                // and a specific address): stop it and try once more, restoring it on failure.
                let own_port = self.serving.as_ref().map(|s| s.endpoint.addr.port());
                let wanted = parse_http_endpoint(endpoint, self.default_port).ok();
                let Some(wanted) = wanted.filter(|w| Some(w.addr.port()) == own_port) else {
                    return Err(e);
                };
                let Some(serving) = self.serving.take() else {
                    return Err(e);
                };
                serving.task.abort();
                // The listener closes when the aborted task is dropped, which awaiting it waits for.
                let _ = serving.task.await;
                self.stopped = Some(serving.endpoint);
                match health::bind(wanted.addr) {
                    Ok((listener, bound)) => {
                        self.pending = Some(Bound {
                            endpoint: endpoint.to_string(),
                            socket: Some((listener, bound, wanted)),
                        });
                        Ok(())
                    }
                    Err(again) => Err(self.cannot_listen(endpoint, wanted.addr, &again)),
                }
            }
        }
    }

    /// Serves the pending socket (if `prepare` or `start` bound one) with what `handler` makes
    /// for its path, stopping the server it replaces.
    fn commit(&mut self, handler: impl FnOnce(String) -> health::Handler) {
        self.stopped = None;
        let Some(bound) = self.pending.take() else {
            return;
        };
        if let Some(old) = self.serving.take() {
            old.task.abort();
        }
        self.endpoint = bound.endpoint;
        let Some((listener, addr, endpoint)) = bound.socket else {
            return;
        };
        match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                tracing::info!(target: "stunnerd", "{} server listening on http://{addr}{}", self.what, endpoint.path);
                let task = tokio::spawn(health::serve(listener, handler(endpoint.path.clone())));
                self.serving = Some(Serving { endpoint, task });
            }
            Err(e) => {
                tracing::error!(target: "stunnerd", "{} server on {addr} not started: {e}", self.what);
            }
        }
    }

    /// Drops what `prepare` bound; restarts the running server if `prepare` stopped it.
    fn rollback(&mut self) {
        self.pending = None;
        if let Some(endpoint) = self.stopped.take() {
            match health::bind(endpoint.addr) {
                Ok((listener, addr)) => {
                    self.pending = Some(Bound {
                        endpoint: std::mem::take(&mut self.endpoint),
                        socket: Some((listener, addr, endpoint)),
                    });
                }
                Err(e) => tracing::error!(
                    target: "stunnerd",
                    "the {} server could not reopen {}: {e}", self.what, endpoint.addr
                ),
            }
        }
    }
}

async fn run(
    config: ControlConfig,
    mut admin: Admin,
    events: UnboundedSender<Event>,
    mut receiver: UnboundedReceiver<Event>,
    board: Arc<StatusBoard>,
) {
    let generation = config.snapshot.load().generation;
    let mut state = ControlState::new(config.initial, generation)
        .with_discovery_timeout(config.discovery_timeout);
    let mut tasks = Tasks {
        source: match config.source {
            Source::Fixed => None,
            Source::File(path) => Some(tokio::spawn(file::watch(path, events.clone()))),
            Source::Cds(target) => Some(tokio::spawn(cds::watch(target, events.clone()))),
        },
        ..Tasks::default()
    };
    admin.commit(&board, &config.metrics);
    // Discovery fills in KUBERNETES and STRICT_DNS clusters of the initial config as it lands.
    loop {
        tasks.sync(&state, &events, &config.kube);
        for (service, why) in state.handle_timeout(std::time::Instant::now()) {
            tracing::warn!(
                target: "k8s",
                "Service {service} not synced within --discovery-timeout ({:?}): {why}; \
                 ready without its endpoints, which peers get once they are listed",
                state.discovery_timeout()
            );
        }
        board.update(&state);
        let deadline = state.poll_timeout();
        let first = tokio::select! {
            event = receiver.recv() => event,
            _ = tokio::time::sleep_until(deadline.map_or_else(tokio::time::Instant::now, tokio::time::Instant::from_std)), if deadline.is_some() => continue,
        };
        let Some(first) = first else {
            return;
        };
        let mut next = Some(first);
        while let Some(event) = next.take() {
            match event {
                Event::Config(new) => {
                    apply_config(
                        &mut state,
                        &mut admin,
                        *new,
                        &*config.check,
                        &*config.on_config,
                    )
                    .await;
                    admin.commit(&board, &config.metrics);
                }
                Event::Service(watch, change) => {
                    state.handle_discovery(&watch.key, watch.watch, change)
                }
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

async fn apply_config(
    state: &mut ControlState,
    admin: &mut Admin,
    new: StunnerConfig,
    check: &(dyn Fn(&StunnerConfig, &StunnerConfig) -> Result<(), String> + Send),
    on_config: &dyn Fn(&StunnerConfig),
) {
    if let Err(e) = check(state.config(), &new) {
        tracing::error!(target: "stunner", "config rejected: {e}; the running config stays");
        return;
    }
    if new != *state.config() && !new.is_zero() {
        if let Err(e) = admin.prepare(&new).await {
            tracing::error!(target: "stunner", "config rejected: {e}; the running config stays");
            return;
        }
    }
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
        Err(skipped) => {
            admin.rollback();
            match skipped {
                Skipped::Duplicate => {
                    tracing::debug!(target: "stunner", "ignoring a config identical to the running one");
                }
                Skipped::Delete => {
                    tracing::info!(target: "stunner", "Ignoring delete configuration update");
                }
            }
        }
    }
}

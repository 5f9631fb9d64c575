//! The admin HTTP servers: health checks at `admin.healthcheck_endpoint` (`/live`, `/ready`,
//! `/status`, byte for byte as stunnerd answers them, stunnerd.md §5: paths match exactly and
//! accept any method, anything else is a 404) and Prometheus metrics at
//! `admin.metrics_endpoint`. Each follows its config field: a new endpoint is bound before the
//! config that names it is committed ([`AdminServers::prepare`], `commit`, `rollback`).

mod metrics_page;
mod process_metrics;
mod routes;
mod server;

use metrics_page::MetricsPage;
use server::Handler;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::task::JoinHandle;
use uturn_shared::config::{parse_http_endpoint, HttpEndpoint, StunnerConfig};

/// Records the dataplane's metrics into the given recorder at each scrape; the metrics server
/// renders what was recorded as Prometheus text.
pub(crate) type MetricsSource = Arc<dyn Fn(&dyn metrics::Recorder) + Send + Sync>;

/// What the health server reports; filled in by the control loop.
pub(crate) trait HealthSource: Send + Sync {
    /// Whether `/ready` answers 200.
    fn ready(&self) -> bool;
    /// The `/status` body.
    fn status_json(&self) -> String;
}

/// The health-check and the metrics server.
pub(crate) struct AdminServers {
    health: AdminServer,
    metrics: AdminServer,
    /// What the metrics server serves; it outlives a change of endpoint.
    page: Arc<MetricsPage>,
}

impl AdminServers {
    /// Opens the servers' sockets for the initial config (they serve once `commit` runs on the
    /// control thread). With `watching`, the initial config is only the bootstrap one
    /// (stunnerd's zero config, health on `:8086`) until the watched origin sends the real one:
    /// a port it cannot open is logged, as stunnerd logs a failed bootstrap reconcile, and the
    /// next config binds what it names. A fixed config has no next one: it fails the start.
    pub(crate) fn open(initial: &StunnerConfig, watching: bool) -> Result<AdminServers, String> {
        let mut admin = AdminServers {
            health: AdminServer::new(
                "health-check",
                "admin.healthcheck_endpoint",
                uturn_shared::config::DEFAULT_HEALTHCHECK_PORT,
            ),
            metrics: AdminServer::new(
                "metrics",
                "admin.metrics_endpoint",
                uturn_shared::config::DEFAULT_METRICS_PORT,
            ),
            page: Arc::new(MetricsPage::new()),
        };
        let (health, metrics) = admin_endpoints(initial);
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
    pub(crate) async fn prepare(&mut self, new: &StunnerConfig) -> Result<(), String> {
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

    /// Serves what `prepare` (or `open`) bound.
    pub(crate) fn commit(&mut self, health: &Arc<dyn HealthSource>, metrics: &MetricsSource) {
        let health = health.clone();
        self.health.commit(move |_path| health_handler(health));
        let metrics = metrics.clone();
        let page = self.page.clone();
        self.metrics
            .commit(move |path| metrics_handler(path, page, metrics));
    }

    /// Drops what `prepare` bound, restoring a server it stopped.
    pub(crate) fn rollback(&mut self) {
        self.health.rollback();
        self.metrics.rollback();
    }
}

/// The health-check routes over `source`.
fn health_handler(source: Arc<dyn HealthSource>) -> Handler {
    Arc::new(move |path| routes::health_route(path, || source.ready(), || source.status_json()))
}

/// The metrics page at `metrics_path`, with what `dataplane` records at each scrape.
fn metrics_handler(
    metrics_path: String,
    page: Arc<MetricsPage>,
    dataplane: MetricsSource,
) -> Handler {
    Arc::new(move |path| routes::metrics_route(path, &metrics_path, || page.render(&dataplane)))
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
    socket: Option<BoundSocket>,
}

/// An open listening socket and the endpoint it was opened for.
struct BoundSocket {
    listener: std::net::TcpListener,
    /// The address the socket is bound to (`[::]` for a dual-stack wildcard).
    local_addr: SocketAddr,
    endpoint: HttpEndpoint,
}

/// An admin server that is serving.
struct RunningServer {
    endpoint: HttpEndpoint,
    task: JoinHandle<()>,
}

/// One admin HTTP server, kept in step with its config field: a new endpoint is bound before
/// the config that names it is committed, so a port that cannot be opened rejects the config
/// and leaves the running server as it was.
struct AdminServer {
    /// What the logs call it: `health-check` or `metrics`.
    name: &'static str,
    /// The config field that names its endpoint.
    config_field: &'static str,
    default_port: u16,
    /// The endpoint the running server (if any) serves.
    endpoint: String,
    running: Option<RunningServer>,
    /// Bound by `prepare`, served by `commit`, dropped by `rollback`.
    pending: Option<Bound>,
    /// The endpoint of the running server `prepare` had to stop to bind (same port).
    stopped: Option<HttpEndpoint>,
}

impl AdminServer {
    fn new(name: &'static str, config_field: &'static str, default_port: u16) -> AdminServer {
        AdminServer {
            name,
            config_field,
            default_port,
            endpoint: String::new(),
            running: None,
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
            .map_err(|e| format!("{} {endpoint:?}: {e}", self.config_field))?;
        let socket =
            bind_endpoint(parsed).map_err(|(addr, e)| self.cannot_listen(endpoint, addr, &e))?;
        Ok(Bound {
            endpoint: endpoint.to_string(),
            socket: Some(socket),
        })
    }

    fn cannot_listen(&self, endpoint: &str, addr: SocketAddr, e: &std::io::Error) -> String {
        format!(
            "{} {endpoint:?}: the {} server cannot listen on {addr}: {e}; set it to a free \
             address and port, or \"\" to disable the {} server",
            self.config_field, self.name, self.name
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
                let own_port = self.running.as_ref().map(|s| s.endpoint.addr.port());
                let wanted = parse_http_endpoint(endpoint, self.default_port).ok();
                let Some(wanted) = wanted.filter(|w| Some(w.addr.port()) == own_port) else {
                    return Err(e);
                };
                let Some(running) = self.running.take() else {
                    return Err(e);
                };
                running.task.abort();
                // The listener closes when the aborted task is dropped, which awaiting it waits for.
                let _ = running.task.await;
                self.stopped = Some(running.endpoint);
                match bind_endpoint(wanted) {
                    Ok(socket) => {
                        self.pending = Some(Bound {
                            endpoint: endpoint.to_string(),
                            socket: Some(socket),
                        });
                        Ok(())
                    }
                    Err((addr, again)) => Err(self.cannot_listen(endpoint, addr, &again)),
                }
            }
        }
    }

    /// Serves the pending socket (if `prepare` or `open` bound one) with what `handler` makes
    /// for its path, stopping the server it replaces.
    fn commit(&mut self, handler: impl FnOnce(String) -> Handler) {
        self.stopped = None;
        let Some(bound) = self.pending.take() else {
            return;
        };
        if let Some(old) = self.running.take() {
            old.task.abort();
        }
        self.endpoint = bound.endpoint;
        let Some(BoundSocket {
            listener,
            local_addr,
            endpoint,
        }) = bound.socket
        else {
            return;
        };
        match tokio::net::TcpListener::from_std(listener) {
            Ok(listener) => {
                tracing::info!(target: "stunnerd", "{} server listening on http://{local_addr}{}", self.name, endpoint.path);
                let task = tokio::spawn(server::serve(listener, handler(endpoint.path.clone())));
                self.running = Some(RunningServer { endpoint, task });
            }
            Err(e) => {
                tracing::error!(target: "stunnerd", "{} server on {local_addr} not started: {e}", self.name);
            }
        }
    }

    /// Drops what `prepare` bound; restarts the running server if `prepare` stopped it.
    fn rollback(&mut self) {
        self.pending = None;
        if let Some(endpoint) = self.stopped.take() {
            let addr = endpoint.addr;
            match bind_endpoint(endpoint) {
                Ok(socket) => {
                    self.pending = Some(Bound {
                        endpoint: std::mem::take(&mut self.endpoint),
                        socket: Some(socket),
                    });
                }
                Err((_, e)) => tracing::error!(
                    target: "stunnerd",
                    "the {} server could not reopen {addr}: {e}", self.name
                ),
            }
        }
    }
}

/// Opens the listening socket of `endpoint`; an error comes with the address it tried.
fn bind_endpoint(endpoint: HttpEndpoint) -> Result<BoundSocket, (SocketAddr, std::io::Error)> {
    match server::bind(endpoint.addr) {
        Ok((listener, local_addr)) => Ok(BoundSocket {
            listener,
            local_addr,
            endpoint,
        }),
        Err(e) => Err((endpoint.addr, e)),
    }
}

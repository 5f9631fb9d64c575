//! uturn's control plane: config origins (file, CDS, TURN URI), Kubernetes and DNS discovery,
//! and the admin servers (health checks, status, metrics), on one control thread that publishes
//! arc-swap snapshots to the dataplane shards.
//!
//! [`Control::start`] runs a single-threaded tokio runtime on a thread of its own. The modules
//! follow the jobs on it:
//! - the control loop (`control_loop`) applies what the tasks report, a batch at a time, and
//!   publishes at most one snapshot per batch; [`state`] is its sans-IO state;
//! - task supervision (`supervisor`) keeps the tasks in step with the state;
//! - config origins ([`origin`]) load the config and follow a file or a CDS server;
//! - discovery ([`discovery`]) watches Kubernetes Services and resolves STRICT_DNS hostnames;
//! - the admin servers (`admin`) answer `/live`, `/ready`, `/status` (from `status`) and
//!   the metrics scrape.
//!
//! Tasks report through an `Outbox` of their own output type, so none of them names the loop's
//! event type. The dataplane is one [`DataplaneHandle`], which the binary implements.
#![deny(missing_docs)]

mod admin;
mod control_loop;
pub mod discovery;
mod handle;
mod license;
pub mod origin;
mod outbox;
pub mod state;
mod status;
mod supervisor;

pub use handle::{DataplaneHandle, StatusSection};
pub use license::License;

/// The Kubernetes client options, at the path the binary imports them from.
pub use discovery::kubernetes;
/// The CDS client, at the path the binary imports it from.
pub use origin::cds;
pub use status::redacted;

use admin::{AdminServers, HealthSource};
use control_loop::Event;
use kubernetes::KubeOptions;
use status::StatusBoard;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc::{unbounded_channel, UnboundedSender};
use uturn_shared::config::StunnerConfig;
use uturn_shared::snapshot::SnapshotHandle;

/// The default of `--discovery-timeout`: how long `/ready` waits for the first EndpointSlice
/// list of each watched Service. A healthy API server lists in well under a second, and the
/// kube-rs watcher retries a failed list within about a second, so 10 s rides out a few
/// failures; it stays well inside the 30 s a kubelet gives a pod with the usual readiness probe
/// (period 10 s, failure threshold 3) and keeps a rollout moving when the API server is down.
pub const DEFAULT_DISCOVERY_TIMEOUT: Duration = Duration::from_secs(10);

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

/// The first snapshot of `config`, for the dataplane to start on before the control thread
/// runs. Pass the same handle and config to [`Control::start`], which republishes it as
/// discovery and later configs change what the shards must do.
pub fn first_snapshot(config: &StunnerConfig) -> SnapshotHandle {
    let first = state::ControlState::new(config.clone(), 1).snapshot();
    Arc::new(arc_swap::ArcSwap::from_pointee(first))
}

/// How to run the control plane.
pub struct ControlConfig {
    /// Where later configs come from.
    pub source: Source,
    /// The config the dataplane starts with (already published in `snapshot`).
    pub initial: StunnerConfig,
    /// The snapshot the shards read, made by [`first_snapshot`] of `initial`; the control
    /// thread republishes it.
    pub snapshot: SnapshotHandle,
    /// How to reach the Kubernetes API server (KUBERNETES clusters).
    pub kube: KubeOptions,
    /// `--discovery-timeout`: how long `/ready` waits for the first full EndpointSlice list of
    /// each Service a KUBERNETES cluster names (zero: not at all, as stunnerd).
    pub discovery_timeout: Duration,
    /// Where the pod's siblings come from (second-chance forwarding).
    pub siblings: state::Siblings,
    /// `--force-ready-status`: `/ready` answers 200 always, also while draining.
    pub force_ready: bool,
    /// `--license`: set in every config received, before it is checked.
    pub license: Option<License>,
    /// The dataplane: its allocations, its check of each config, its metrics and its `/status`
    /// sections.
    pub dataplane: Arc<dyn DataplaneHandle>,
}

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
        let watching = !matches!(config.source, Source::Fixed);
        let admin = AdminServers::open(&config.initial, watching).map_err(std::io::Error::other)?;
        let status = Arc::new(StatusBoard::new(
            config.dataplane.clone(),
            config.force_ready,
        ));
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        let board = status.clone();
        let sender = events.clone();
        let thread = std::thread::Builder::new()
            .name("uturn-control".into())
            .spawn(move || {
                runtime.block_on(control_loop::run(config, admin, sender, receiver, board))
            })?;
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
        self.status.begin_drain();
        self.stop_watching();
    }

    /// Whether a non-zero config has been applied.
    pub fn ready(&self) -> bool {
        self.status.ready()
    }

    /// The `/status` document.
    pub fn status_json(&self) -> String {
        self.status.status_json()
    }
}

impl Drop for Control {
    fn drop(&mut self) {
        // The thread runs until the process exits; dropping the handle detaches it.
        let _ = self.thread.take();
    }
}

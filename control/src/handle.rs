//! The control plane's one handle on the dataplane it runs beside ([`DataplaneHandle`]). The
//! binary implements it over the shards; `control` never names a dataplane type, so this
//! crate builds, and is tested, without the dataplane.

use uturn_shared::config::StunnerConfig;
use uturn_shared::status::ListenerAllocations;

/// What the control plane asks of the dataplane: its allocations (for `/status`), whether it
/// can run a config, that a config was applied, its metrics at a scrape, and its own `/status`
/// sections. Called from the control thread and the admin servers' tasks.
pub trait DataplaneHandle: Send + Sync {
    /// Live allocations over all shards (`/status`'s `allocationCount`).
    fn allocations(&self) -> u64;

    /// Live allocations by listener name, over all shards (a v2 config's `/status` counts a
    /// server's `sessions` from them).
    fn listener_allocations(&self) -> Vec<ListenerAllocations>;

    /// Whether the allocations a previous process left (a state directory) have all been
    /// adopted or dropped: `/ready` waits for it.
    fn restored(&self) -> bool {
        true
    }

    /// Checks a new config against what the dataplane can run, given the running one: TLS
    /// material that loads, ports no one else holds. An error rejects the config with that
    /// message, and the running config stays.
    fn check(&self, running: &StunnerConfig, new: &StunnerConfig) -> Result<(), String>;

    /// Called after each applied config (to follow `admin.loglevel`, watch the certificates'
    /// expiry, say that the offload is chosen at start).
    fn config_applied(&self, config: &StunnerConfig);

    /// Records the dataplane's metrics into `recorder` for a scrape; the metrics server renders
    /// what was recorded as Prometheus text.
    fn record_metrics(&self, recorder: &dyn metrics::Recorder);

    /// The `/status` sections the dataplane owns (the kernel offload's, the siblings'), added
    /// to every `/status` body.
    fn status_sections(&self) -> Vec<StatusSection>;
}

/// A section of the `/status` body that the dataplane owns.
#[derive(Debug, Clone, PartialEq)]
pub struct StatusSection {
    /// Its top-level key (`offload`, `siblings`).
    pub key: &'static str,
    /// What it shows under that key.
    pub value: serde_json::Value,
}

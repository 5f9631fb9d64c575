//! The kernel offload as the binary runs it: chosen once, at start (`--offload`, else the first
//! config's `admin.offload_engine`), shown in `/status`'s `offload` section, and named in a
//! warning when a later config asks for another.

use std::sync::{Arc, Mutex};
use uturn_dataplane::io::offload::{self, Offload, OffloadMode, OffloadStatus};
use uturn_dataplane::io::Dataplane;
use uturn_shared::config::StunnerConfig;

/// The offload to run: `--offload` if given, else what `config` asks for.
pub(crate) fn mode(
    flag: Option<OffloadMode>,
    config: &StunnerConfig,
) -> Result<OffloadMode, String> {
    match flag {
        Some(mode) => Ok(mode),
        None => config
            .admin
            .offload_engine
            .parse()
            .map_err(|e| format!("admin.offload_engine: {e}")),
    }
}

/// What was chosen at start, and what the configs asked for since.
pub(crate) struct OffloadChoice {
    /// What [`offload::start`] chose and why.
    status: OffloadStatus,
    /// Whether `--offload` chose it (the configs' `admin.offload_engine` is then not theirs to
    /// choose, and asks for nothing).
    flag_set: bool,
    /// The `admin.offload_engine` and `offload_interfaces` last seen in a config.
    seen: Mutex<(String, Vec<String>)>,
}

impl OffloadChoice {
    /// Starts the offload `mode` on the interfaces `config` names; the running program (if any)
    /// for the shards, and the choice.
    pub(crate) fn start(
        mode: OffloadMode,
        flag_set: bool,
        config: &StunnerConfig,
    ) -> (Option<Arc<Offload>>, OffloadChoice) {
        let (running, status) = offload::start(mode, &config.admin.offload_interfaces);
        let seen = (
            config.admin.offload_engine.clone(),
            config.admin.offload_interfaces.clone(),
        );
        let choice = OffloadChoice {
            status,
            flag_set,
            seen: Mutex::new(seen),
        };
        (running, choice)
    }

    /// Warns once per change when an applied config asks for another offload than runs: it is
    /// chosen at start.
    pub(crate) fn config_applied(&self, config: &StunnerConfig) {
        let asked = (
            config.admin.offload_engine.clone(),
            config.admin.offload_interfaces.clone(),
        );
        let Ok(mut seen) = self.seen.lock() else {
            return;
        };
        if self.flag_set || asked == *seen {
            return;
        }
        tracing::warn!(
            target: "stunnerd",
            "admin.offload_engine {:?} / offload_interfaces {:?}: the offload is chosen at \
             start ({} runs); restart stunnerd to change it",
            asked.0,
            asked.1,
            self.status.running
        );
        *seen = asked;
    }

    /// `/status`'s `offload` section: what was asked for, what runs (live: XDP is taken off an
    /// interface that drops what it sends), why, where, and how many channels it relays.
    pub(crate) fn status_section(&self, dataplane: &Dataplane) -> serde_json::Value {
        let (running, xdp_interfaces) = match dataplane.offload() {
            Some(o) => (o.running(), o.xdp_interfaces()),
            None => (self.status.running, Vec::new()),
        };
        serde_json::json!({
            "requested": self.status.requested.name(),
            "running": running,
            "reason": self.status.reason,
            "interfaces": self.status.interfaces,
            "xdp_interfaces": xdp_interfaces,
            "channels": dataplane.offload_channels(),
        })
    }
}

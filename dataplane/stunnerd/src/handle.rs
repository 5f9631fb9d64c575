//! The control plane's handle on this process's dataplane ([`Gateway`], a
//! [`DataplaneHandle`]): the shards' counters, the check of each config, the log level and the
//! certificates each applied config sets, the metrics at a scrape, and the `/status` sections
//! the dataplane owns (the kernel offload's, the siblings').

use crate::logging::FollowedLevel;
use crate::offload::OffloadChoice;
use crate::siblings;
use uturn_control::{DataplaneHandle, StatusSection};
use uturn_dataplane::io::certificates::CertificateExpiry;
use uturn_dataplane::io::check::{check_config, SharedPorts};
use uturn_dataplane::io::Dataplane;
use uturn_shared::config::StunnerConfig;
use uturn_shared::snapshot::SnapshotHandle;
use uturn_shared::status::ListenerAllocations;

/// The running dataplane and what the binary keeps beside it.
pub(crate) struct Gateway {
    dataplane: Dataplane,
    offload: OffloadChoice,
    /// The snapshot the shards run, whose siblings `/status` lists; `None` without
    /// second-chance forwarding.
    siblings: Option<SnapshotHandle>,
    /// When the listeners' certificates expire: seen at each applied config, rechecked every
    /// second, recorded at each scrape.
    certificates: CertificateExpiry,
    shared_ports: SharedPorts,
    loglevel: FollowedLevel,
    /// The last `admin.state_dir` said to wait for the next start (said once per value).
    state_dir_said: std::sync::Mutex<String>,
}

impl Gateway {
    /// The handle on `dataplane`, started with `offload`; `siblings` is the snapshot the shards
    /// run when forwarding is on.
    pub(crate) fn new(
        dataplane: Dataplane,
        offload: OffloadChoice,
        siblings: Option<SnapshotHandle>,
        shared_ports: SharedPorts,
        loglevel: FollowedLevel,
    ) -> Gateway {
        Gateway {
            dataplane,
            offload,
            siblings,
            certificates: CertificateExpiry::new(),
            shared_ports,
            loglevel,
            state_dir_said: Default::default(),
        }
    }

    /// The shards.
    pub(crate) fn dataplane(&self) -> &Dataplane {
        &self.dataplane
    }

    /// A config naming a state directory other than the one in use: said once per value, since
    /// the directory is chosen when the process starts.
    fn state_dir_applied(&self, named: &str) {
        let in_use = self.dataplane.state_dir();
        if named.is_empty() || in_use == Some(std::path::Path::new(named)) {
            return;
        }
        let Ok(mut said) = self.state_dir_said.lock() else {
            return;
        };
        if *said != named {
            *said = named.to_owned();
            let in_use = in_use.map_or("none".into(), |dir| dir.display().to_string());
            tracing::warn!(
                target: "stunnerd",
                "admin.state_dir {named:?} is read when stunnerd starts (or --state-dir overrides \
                 it): this process keeps its allocations in {in_use} until it restarts"
            );
        }
    }

    /// What is due once a second: the certificates' expiry is checked against the clock.
    pub(crate) fn every_second(&self) {
        self.certificates.recheck(unix_now());
    }
}

impl DataplaneHandle for Gateway {
    fn allocations(&self) -> u64 {
        self.dataplane.allocation_count()
    }

    fn listener_allocations(&self) -> Vec<ListenerAllocations> {
        self.dataplane.listener_allocations()
    }

    fn restored(&self) -> bool {
        self.dataplane.restored()
    }

    fn check(&self, running: &StunnerConfig, new: &StunnerConfig) -> Result<(), String> {
        check_config(running, new, self.shared_ports)
    }

    fn config_applied(&self, config: &StunnerConfig) {
        self.certificates.observe(config, unix_now());
        self.loglevel.apply(&config.admin.loglevel);
        self.offload.config_applied(config);
        self.state_dir_applied(&config.admin.state_dir);
    }

    fn record_metrics(&self, recorder: &dyn metrics::Recorder) {
        self.dataplane.record_metrics(recorder);
        self.certificates.record(recorder);
    }

    fn status_sections(&self) -> Vec<StatusSection> {
        let mut sections = Vec::new();
        if let Some(snapshot) = &self.siblings {
            sections.push(StatusSection {
                key: "siblings",
                value: siblings::status_section(&self.dataplane, snapshot),
            });
        }
        sections.push(StatusSection {
            key: "offload",
            value: self.offload.status_section(&self.dataplane),
        });
        sections
    }
}

/// Seconds since the Unix epoch.
fn unix_now() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

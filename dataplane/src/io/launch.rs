//! Starting and stopping the dataplane: one thread per shard, run by the chosen IO backend and
//! placed on a CPU as [`super::placement`] says, sharing what must be shared across shards
//! (the allocation ledger, the datagram listener groups, the stream admission caps).

use super::metrics::{add_count, ShardReport, ShardStats};
use super::placement::{allowed_cpus, shard_placement};
use super::state::{monotonic_epoch, StateDir, Unplaced};
use super::{admission, epoll, groups, shard, sys, uring, IoBackend};
use crate::proto::sibling::SiblingForwarding;
use arc_swap::ArcSwap;
use std::io;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use uturn_shared::snapshot::Snapshot;
use uturn_shared::status::ListenerAllocations;

/// How to run the dataplane.
#[derive(Clone)]
pub struct DataplaneConfig {
    /// Number of shards (threads). See [`super::usable_cpus`].
    pub shards: usize,
    /// `--udp-thread-num`: SO_REUSEPORT sockets per TURN-UDP listener (0 means one), spread
    /// over the shards.
    pub udp_thread_num: usize,
    /// The running config, republished by the control thread.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    /// Secret for stateless nonces, shared by all shards.
    pub nonce_key: [u8; 32],
    /// What waits for the sockets: io_uring or epoll (see [`super::select_backend`]).
    pub backend: IoBackend,
    /// Quotas and rate limits set by flags.
    pub limits: crate::proto::Limits,
    /// Caps on TCP/TLS connections that have not authenticated.
    pub stream_limits: admission::StreamLimits,
    /// The kernel offload, if it runs (see [`super::offload::start`]).
    pub offload: Option<Arc<super::offload::Offload>>,
    /// Second-chance forwarding between the gateway's pods, if configured.
    pub siblings: Option<super::SiblingSetup>,
    /// The state directory (`--state-dir`), if configured: the allocations it holds are
    /// adopted before [`Dataplane::restored`], and each shard keeps its journal there.
    pub state: Option<Arc<StateDir>>,
}

/// A running dataplane: its shards, their published counters and the kernel offload they
/// share. What the control plane asks of it (allocations, metrics, `/status`) it answers from
/// the counters each shard publishes once per tick, never from a shard itself.
pub struct Dataplane {
    threads: Vec<std::thread::JoinHandle<()>>,
    stop: Arc<AtomicBool>,
    stats: Arc<Vec<ShardStats>>,
    offload: Option<Arc<super::offload::Offload>>,
    state: Option<Arc<StateDir>>,
}

impl Dataplane {
    /// Starts `config.shards` shards. Listeners open on each shard's first tick.
    pub fn start(config: DataplaneConfig) -> io::Result<Dataplane> {
        let shards = config.shards.max(1);
        let stop = Arc::new(AtomicBool::new(false));
        let stats: Arc<Vec<ShardStats>> =
            Arc::new((0..shards).map(|_| ShardStats::default()).collect());
        let epoch = Instant::now();
        let epoch_unix = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let mut threads = Vec::with_capacity(shards);
        let placement = shard_placement(shards, &allowed_cpus());
        // One ledger for all shards: a user's quota counts allocations on every shard.
        let ledger = Arc::new(crate::proto::AllocationLedger::new());
        let groups = Arc::new(groups::ListenerGroups::new(shards, config.udp_thread_num));
        let admission = Arc::new(admission::StreamAdmission::new(config.stream_limits));
        let mut states = shard_states(config.state.as_deref(), shards, config.udp_thread_num);
        for (index, &cpu) in placement.iter().enumerate() {
            match cpu {
                Some(cpu) => tracing::info!(target: "stunnerd", "shard {index} on CPU {cpu}"),
                None if index == 0 => tracing::info!(
                    target: "stunnerd",
                    "shards not pinned: {} CPU(s) allowed for {shards} shard(s) (a shared CPU pool)",
                    allowed_cpus().len()
                ),
                None => {}
            }
            let shard = shard::ShardSetup {
                index,
                snapshot: config.snapshot.clone(),
                engine: crate::proto::EngineConfig {
                    epoch,
                    epoch_unix,
                    nonce_key: config.nonce_key,
                    limits: config.limits,
                    ledger: ledger.clone(),
                },
                stop: stop.clone(),
                stats: stats.clone(),
                groups: groups.clone(),
                admission: admission.clone(),
                offload: config.offload.clone(),
                siblings: config.siblings.clone().map(|setup| (setup, shards)),
                state: states.next().flatten(),
            };
            let name = format!("uturn-shard-{index}");
            let backend = config.backend;
            let thread = std::thread::Builder::new()
                .name(name)
                .spawn(move || {
                    if let Some(cpu) = cpu {
                        if let Err(e) = sys::set_cpu_affinity(cpu) {
                            tracing::warn!(target: "stunnerd", "shard {index} not pinned to CPU {cpu}: {e}");
                        }
                    }
                    let ran = match backend {
                        IoBackend::Uring => uring::run(shard),
                        IoBackend::Epoll => epoll::run(shard),
                    };
                    if let Err(e) = ran {
                        tracing::error!(target: "stunner", "shard {index} stopped: {e}");
                    }
                })
                .map_err(|e| io::Error::other(format!("cannot start shard {index}: {e}")))?;
            threads.push(thread);
        }
        Ok(Dataplane {
            threads,
            stop,
            stats,
            offload: config.offload,
            state: config.state,
        })
    }

    /// The state directory this process keeps its allocations in, if any.
    pub fn state_dir(&self) -> Option<&std::path::Path> {
        self.state.as_deref().map(StateDir::path)
    }

    /// Whether every allocation the state directory held has been adopted (or dropped):
    /// `/ready` waits for it. True without a state directory.
    pub fn restored(&self) -> bool {
        self.state
            .as_ref()
            .is_none_or(|state| state.counts().done())
    }

    /// Live allocations over all shards.
    pub fn allocation_count(&self) -> u64 {
        self.stats
            .iter()
            .map(|s| s.allocations.load(Ordering::Relaxed))
            .sum()
    }

    /// A shareable handle on the counters.
    pub fn stats_handle(&self) -> Arc<Vec<ShardStats>> {
        self.stats.clone()
    }

    /// Live allocations by listener name, over all shards.
    pub fn listener_allocations(&self) -> Vec<ListenerAllocations> {
        let mut total = Vec::new();
        for report in self.reports() {
            for counted in &report.listener_allocations {
                add_count(&mut total, counted);
            }
        }
        total
    }

    /// Channels the kernel offload relays, over all shards.
    pub fn offload_channels(&self) -> u64 {
        self.reports().map(|r| r.offload_channels).sum()
    }

    /// The kernel offload, if it runs.
    pub fn offload(&self) -> Option<&Arc<super::offload::Offload>> {
        self.offload.as_ref()
    }

    /// Each sibling pod this one forwards clients to, and how many, over all shards (empty
    /// without second-chance forwarding).
    pub fn forwarding_by_sibling(&self) -> Vec<SiblingForwarding> {
        let mut total = Vec::new();
        for report in self.reports() {
            for counted in report.siblings.iter().flat_map(|s| &s.forwarding) {
                add_count(&mut total, counted);
            }
        }
        total
    }

    /// Records the dataplane's metrics into `recorder` for a scrape ([`super::metrics::record`]).
    pub fn record_metrics(&self, recorder: &dyn metrics::Recorder) {
        super::metrics::record(&self.stats, recorder);
        if let Some(state) = &self.state {
            state.counts().record(recorder);
        }
    }

    /// Each shard's last published report (a shard whose lock is poisoned is left out).
    fn reports(&self) -> impl Iterator<Item = std::sync::MutexGuard<'_, ShardReport>> {
        self.stats
            .iter()
            .filter_map(|shard| shard.report.lock().ok())
    }

    /// Stops every shard (closing all sockets) and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            let _ = thread.join();
        }
    }
}

/// Each shard's part of the state directory, if there is one: the allocations the journals
/// left, their relay sockets bound again before any shard serves (so that no new allocation
/// takes their ports), given to the shards that adopt them.
fn shard_states(
    state: Option<&StateDir>,
    shards: usize,
    udp_thread_num: usize,
) -> std::vec::IntoIter<Option<Arc<shard::ShardState>>> {
    let epoch = monotonic_epoch();
    let restored = state.map(|dir| dir.restore(shards, epoch));
    let mut unplaced = None;
    if let (Some(dir), Some(restored)) = (state, &restored) {
        if dir.note_layout(shards, udp_thread_num.max(1), restored.found) {
            unplaced = Some(Arc::new(Unplaced::default()));
        }
        tracing::info!(
            target: "stunnerd",
            "state directory {}: {} allocation(s) to carry on",
            dir.path().display(),
            restored.found
        );
    }
    let mut by_shard = restored.map(|r| r.by_shard).unwrap_or_default();
    if let (Some(dir), Some(unplaced)) = (state, &unplaced) {
        unplaced.hold(dir, by_shard.iter_mut().flat_map(std::mem::take).collect());
    }
    let mut by_shard = by_shard.into_iter();
    let states: Vec<_> = (0..shards)
        .map(|_| {
            let dir = state?;
            let restoring = by_shard.next().unwrap_or_default();
            if !restoring.is_empty() {
                dir.counts().restoring();
            }
            Some(Arc::new(shard::ShardState {
                dir: dir.path().to_path_buf(),
                boot_id: dir.boot_id(),
                epoch,
                counts: dir.counts().clone(),
                shards,
                unplaced: unplaced.clone(),
                restoring: std::sync::Mutex::new(restoring),
            }))
        })
        .collect();
    states.into_iter()
}

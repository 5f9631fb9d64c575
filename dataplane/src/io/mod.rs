//! The IO shell: one shard per usable CPU, each a single-threaded event loop that owns its
//! SO_REUSEPORT listener sockets, the allocations made on them, their relay sockets and a
//! [`crate::proto::Engine`]. Two IO engines drive the same shard logic: glommio (io_uring)
//! executors, or threads waiting in epoll where io_uring is blocked ([`probe`]). The config
//! arrives as an arc-swap [`Snapshot`] that every shard reads through its own
//! `arc_swap::Cache`; nothing is locked or shared per packet.

pub mod admission;
pub mod batch;
pub mod check;
mod dtls;
mod epoll;
mod groups;
pub mod metrics;
pub mod ports;
pub mod probe;
mod shard;
pub mod socket;
mod stream;
mod sys;
pub mod tls;
mod uring;

use arc_swap::ArcSwap;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use uturn_shared::snapshot::Snapshot;

pub use probe::{select as select_engine, EngineChoice, IoEngine};
pub use shard::listener_sockets_on_shard;

/// How to run the dataplane.
#[derive(Clone)]
pub struct DataplaneConfig {
    /// Number of shards (executor threads). See [`usable_cpus`].
    pub shards: usize,
    /// `--udp-thread-num`: SO_REUSEPORT sockets per TURN-UDP listener (0 means one), spread
    /// over the shards.
    pub udp_thread_num: usize,
    /// The running config, republished by the control thread.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    /// Secret for stateless nonces, shared by all shards.
    pub nonce_key: [u8; 32],
    /// What waits for the sockets: io_uring or epoll (see [`select_engine`]).
    pub engine: IoEngine,
    /// Quotas and rate limits set by flags.
    pub limits: crate::proto::Limits,
    /// Caps on TCP/TLS connections that have not authenticated.
    pub stream_limits: admission::StreamLimits,
}

/// The CPUs this process may use: `available_parallelism` (cgroup quota and affinity aware).
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The CPUs this process may run on (`sched_getaffinity`: a pod's cpuset, or `taskset`).
pub fn allowed_cpus() -> Vec<usize> {
    sys::cpu_affinity().unwrap_or_default()
}

/// Where each of `shards` shards runs, given the CPUs allowed: one shard per CPU, pinned, when
/// the cpuset holds exactly as many CPUs as there are shards (a Guaranteed pod's exclusive
/// CPUs under the static CPU manager, or `taskset`); unpinned otherwise, since a cpuset larger
/// than the CPU quota is a pool shared with other pods and the scheduler should place the
/// shards in it.
pub fn shard_placement(shards: usize, allowed: &[usize]) -> Vec<Option<usize>> {
    if allowed.len() == shards {
        allowed.iter().map(|&cpu| Some(cpu)).collect()
    } else {
        vec![None; shards]
    }
}

/// Counters one shard publishes once per tick (single writer, read at scrape time).
#[derive(Debug, Default)]
#[repr(align(128))]
pub struct ShardStats {
    /// Live allocations.
    pub allocations: AtomicU64,
    /// Allocations ever created.
    pub allocations_created: AtomicU64,
    /// Datagrams received on listener sockets.
    pub listener_rx_packets: AtomicU64,
    /// Datagrams dropped (malformed, no allocation, not admitted, …).
    pub dropped: AtomicU64,
    /// Datagrams dropped as malformed.
    pub malformed: AtomicU64,
    /// Datagrams relayed client → peer.
    pub relayed_to_peer: AtomicU64,
    /// Datagrams relayed peer → client.
    pub relayed_to_client: AtomicU64,
    /// Traffic by listener and cluster, and drops by reason; replaced once per tick.
    pub report: std::sync::Mutex<metrics::ShardReport>,
}

/// A running dataplane: its shards and their published counters.
pub struct Dataplane {
    threads: Vec<ShardThread>,
    stop: Arc<AtomicBool>,
    stats: Arc<Vec<ShardStats>>,
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
        let groups = Arc::new(groups::ListenerGroups::new(shards));
        let admission = Arc::new(admission::StreamAdmission::new(config.stream_limits));
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
                shards,
                udp_thread_num: config.udp_thread_num,
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
            };
            let name = format!("uturn-shard-{index}");
            let cannot = |e: &dyn std::fmt::Display| {
                io::Error::other(format!("cannot start shard {index}: {e}"))
            };
            let thread = match config.engine {
                IoEngine::Uring => glommio::LocalExecutorBuilder::new(match cpu {
                    Some(cpu) => glommio::Placement::Fixed(cpu),
                    None => glommio::Placement::Unbound,
                })
                    .name(&name)
                    // glommio registers io_memory as fixed buffers on three rings; keep it well
                    // under RLIMIT_MEMLOCK/4 (8 MiB on most container runtimes).
                    .io_memory(512 << 10)
                    .spawn(move || uring::run(shard))
                    .map(ShardThread::Uring)
                    .map_err(|e| cannot(&e))?,
                IoEngine::Epoll => std::thread::Builder::new()
                    .name(name)
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            if let Err(e) = sys::set_cpu_affinity(cpu) {
                                tracing::warn!(target: "stunnerd", "shard {index} not pinned to CPU {cpu}: {e}");
                            }
                        }
                        if let Err(e) = epoll::run(shard) {
                            tracing::error!(target: "stunner", "shard {index} stopped: {e}");
                        }
                    })
                    .map(ShardThread::Epoll)
                    .map_err(|e| cannot(&e))?,
            };
            threads.push(thread);
        }
        Ok(Dataplane {
            threads,
            stop,
            stats,
        })
    }

    /// Live allocations over all shards.
    pub fn allocation_count(&self) -> u64 {
        self.stats
            .iter()
            .map(|s| s.allocations.load(Ordering::Relaxed))
            .sum()
    }

    /// The published counters, one entry per shard.
    pub fn shard_stats(&self) -> &[ShardStats] {
        &self.stats
    }

    /// A shareable handle on the counters.
    pub fn stats_handle(&self) -> Arc<Vec<ShardStats>> {
        self.stats.clone()
    }

    /// Stops every shard (closing all sockets) and waits for them.
    pub fn stop(self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads {
            match thread {
                ShardThread::Uring(handle) => {
                    let _ = handle.join();
                }
                ShardThread::Epoll(handle) => {
                    let _ = handle.join();
                }
            }
        }
    }
}

enum ShardThread {
    Uring(glommio::ExecutorJoinHandle<()>),
    Epoll(std::thread::JoinHandle<()>),
}

#[cfg(test)]
mod tests {
    use super::shard_placement;

    #[test]
    fn shards_are_pinned_only_to_a_cpuset_of_their_own_size() {
        assert_eq!(shard_placement(2, &[3, 5]), vec![Some(3), Some(5)]);
        assert_eq!(shard_placement(1, &[7]), vec![Some(7)]);
        // A quota smaller than the cpuset: a shared pool, left to the scheduler.
        assert_eq!(shard_placement(2, &[0, 1, 2, 3]), vec![None, None]);
        // More shards than CPUs (UTURN_SHARDS): nothing pinned.
        assert_eq!(shard_placement(4, &[0, 1]), vec![None; 4]);
    }
}

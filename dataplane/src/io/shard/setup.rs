//! What a shard starts from: its index, the snapshot it serves, the engine's config, and what
//! it shares with the other shards (the stop flag, their published counters, the listener
//! sockets' groups, the stream admission, the kernel offload, the sibling keys).

use super::SiblingSetup;
use crate::io::admission::StreamAdmission;
use crate::io::groups::ListenerGroups;
use crate::io::metrics::ShardStats;
use crate::io::offload::Offload;
use crate::proto::EngineConfig;
use arc_swap::ArcSwap;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use uturn_shared::snapshot::Snapshot;

/// What a shard starts from.
pub(in crate::io) struct ShardSetup {
    /// Which shard this is (for logs, its counters and its share of listener sockets).
    pub index: usize,
    /// The running config, republished by the control thread.
    pub snapshot: Arc<ArcSwap<Snapshot>>,
    /// The TURN engine's config.
    pub engine: EngineConfig,
    /// Set when the dataplane stops.
    pub stop: Arc<AtomicBool>,
    /// Every shard's published counters; this one writes `stats[index]`.
    pub stats: Arc<Vec<ShardStats>>,
    /// Datagram listener sockets, opened for all shards by the first to need them.
    pub groups: Arc<ListenerGroups>,
    /// Places for unauthenticated TCP/TLS connections, shared by all shards.
    pub admission: Arc<StreamAdmission>,
    /// The kernel offload, if it runs.
    pub offload: Option<Arc<Offload>>,
    /// Second-chance forwarding between the gateway's pods, if configured, and how many
    /// shards this pod runs (each has a sibling socket).
    pub siblings: Option<(SiblingSetup, usize)>,
    /// The state directory's part for this shard, if `--state-dir` is set.
    pub state: Option<Arc<super::ShardState>>,
}

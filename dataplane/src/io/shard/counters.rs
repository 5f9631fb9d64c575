//! A shard's own counters: plain integers bumped on the packet path, published once per tick
//! into its [`ShardStats`] for the scrape to sum.

use super::conns::ConnTable;
use super::listeners::Listeners;
use crate::io::metrics::{CountersByName, ShardReport, ShardStats, SiblingReport};
use crate::io::offload::Delta;
use crate::proto::{DropReason, Engine};
use std::io;
use std::sync::atomic::Ordering;
use uturn_shared::snapshot::{ClusterId, Snapshot};

/// The tag of a relayed datagram whose cluster has no counter slot.
pub(super) const NO_SLOT: usize = usize::MAX;

/// What a shard counts besides what its engine counts.
#[derive(Default)]
pub(super) struct Counters {
    pub listener_rx_packets: u64,
    pub relayed_to_peer: u64,
    pub relayed_to_client: u64,
    /// Input dropped before the engine saw it, counted as malformed: datagrams too big to be
    /// whole, stream bytes that are not TURN frames, DTLS sessions that did not start with a
    /// handshake record (or found the shard's session table full).
    pub unparsed: u64,
    /// Datagrams not sent for want of room: a full socket buffer, a slow reader's full queue.
    pub send_failed: u64,
    /// Datagrams the kernel refused with an error (a firewall's drop, no route, no buffer
    /// memory): a fault of the path, not of the load.
    pub send_errors: u64,
    /// TCP/TLS connections closed at accept, by [`crate::io::admission::Refused`] (per
    /// address, total).
    pub refused_connections: [u64; 2],
    pub listeners: CountersByName,
    pub clusters: CountersByName,
    /// Channels the kernel offload relays for this shard now.
    pub offload_channels: u64,
    /// Datagrams it relayed: client → peer, peer → client.
    pub offloaded_packets: [u64; 2],
    /// `ClusterId` → slot in `clusters`, for the snapshot generation `cluster_generation`.
    cluster_slots: Vec<usize>,
    cluster_generation: Option<u64>,
}

impl Counters {
    /// The counter slot of cluster `id` of `snap`.
    pub(super) fn cluster(&mut self, snap: &Snapshot, id: ClusterId) -> Option<usize> {
        if self.cluster_generation != Some(snap.generation) {
            self.cluster_generation = Some(snap.generation);
            let clusters = &mut self.clusters;
            self.cluster_slots = snap
                .clusters
                .iter()
                .map(|c| clusters.slot(&c.name))
                .collect();
        }
        self.cluster_slots.get(id).copied()
    }

    /// Counts a datagram sent (or not) to a client through listener counter slot `metric`.
    pub(super) fn sent_to_client(&mut self, metric: usize, outcome: io::Result<usize>) {
        if let Some(n) = self.sent(outcome.map(Some)) {
            self.listeners.traffic[metric].tx(n);
        }
    }

    /// Counts a datagram relayed (or not) to a peer of cluster counter slot `cluster`.
    pub(super) fn sent_to_peer(&mut self, cluster: usize, outcome: io::Result<usize>) {
        if let (Some(n), Some(traffic)) = (
            self.sent(outcome.map(Some)),
            self.clusters.traffic.get_mut(cluster),
        ) {
            traffic.tx(n);
        }
    }

    /// Counts the outcome of one send.
    pub(super) fn sent(&mut self, outcome: io::Result<Option<usize>>) -> Option<usize> {
        match outcome {
            Ok(Some(n)) => Some(n),
            Err(e) if e.kind() != io::ErrorKind::WouldBlock => {
                self.send_errors += 1;
                tracing::debug!(target: "stunner", "send failed: {e}");
                None
            }
            // No room: a full socket buffer.
            Ok(None) | Err(_) => {
                self.send_failed += 1;
                None
            }
        }
    }

    /// Adds what the kernel offload relayed (`deltas`, emptied) to the counters, as if the
    /// shard had relayed it, under `snap` and for the clients of `listeners`.
    pub(super) fn count_offloaded<W>(
        &mut self,
        deltas: &mut Vec<Delta>,
        snap: &Snapshot,
        listeners: &Listeners<W>,
    ) {
        for delta in deltas.drain(..) {
            let (out, into) = (delta.out, delta.into);
            self.offloaded_packets[0] += out.packets;
            self.offloaded_packets[1] += into.packets;
            self.listener_rx_packets += out.packets;
            self.relayed_to_peer += out.packets;
            self.relayed_to_client += into.packets;
            if let Some(listener) = listeners.get(delta.listener) {
                let traffic = &mut self.listeners.traffic[listener.metric];
                // The client's datagrams carry the 4-byte ChannelData header.
                traffic.rx_packets += out.packets;
                traffic.rx_bytes += out.bytes + 4 * out.packets;
                traffic.tx_packets += into.packets;
                traffic.tx_bytes += into.bytes + 4 * into.packets;
            }
            if let Some(slot) = self.cluster(snap, delta.cluster) {
                let traffic = &mut self.clusters.traffic[slot];
                traffic.tx_packets += out.packets;
                traffic.tx_bytes += out.bytes;
                traffic.rx_packets += into.packets;
                traffic.rx_bytes += into.bytes;
            }
        }
    }

    /// Publishes these counters, with `engine`'s and what the listeners and connections hold
    /// open now, into `stats`.
    pub(super) fn publish<W>(
        &self,
        stats: &ShardStats,
        engine: &Engine,
        listeners: &Listeners<W>,
        conns: &ConnTable<W>,
        siblings: Option<SiblingReport>,
    ) {
        let engine_stats = engine.stats();
        let dropped: u64 = engine_stats.dropped.iter().sum();
        stats
            .allocations
            .store(engine.allocation_count() as u64, Ordering::Relaxed);
        stats
            .allocations_created
            .store(engine_stats.allocations_created, Ordering::Relaxed);
        stats.dropped.store(dropped, Ordering::Relaxed);
        stats.malformed.store(
            engine_stats.dropped[DropReason::Malformed.index()],
            Ordering::Relaxed,
        );
        stats
            .listener_rx_packets
            .store(self.listener_rx_packets, Ordering::Relaxed);
        stats
            .relayed_to_peer
            .store(self.relayed_to_peer, Ordering::Relaxed);
        stats
            .relayed_to_client
            .store(self.relayed_to_client, Ordering::Relaxed);
        let mut report = ShardReport {
            listeners: self.listeners.clone(),
            clusters: self.clusters.clone(),
            listener_allocations: engine.allocations_by_listener(),
            siblings,
            dropped: engine_stats.dropped,
            auth_failed: engine_stats.auth_failures,
            quota_refused: engine_stats.quota_refusals,
            send_failed: self.send_failed,
            send_errors: self.send_errors,
            refused_connections: self.refused_connections,
            stream_buffer_bytes: conns.buffered_bytes(),
            unauthenticated_connections: conns.unauthenticated(),
            offload_channels: self.offload_channels,
            offloaded_packets: self.offloaded_packets,
        };
        report.dropped[DropReason::Malformed.index()] += self.unparsed;
        for open in report.listeners.open.iter_mut() {
            *open = 0;
        }
        // stunnerd counts a UDP socket, a TCP/TLS connection and a DTLS session alike.
        listeners.count_open(&mut report.listeners.open);
        conns.count_open(&mut report.listeners.open);
        if let Ok(mut published) = stats.report.lock() {
            *published = report;
        }
    }
}

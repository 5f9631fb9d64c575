//! Traffic counters: each shard counts into its own plain integers on the packet path and
//! publishes a copy once per tick; a scrape sums the copies and records the totals through the
//! `metrics` facade ([`record`]) with stunnerd's metric names, types, labels and help strings
//! (stunnerd.md §7), plus uturn's drop counters. The control plane owns the recorder that
//! renders them as Prometheus text.

use crate::proto::sibling::SiblingForwarding;
use crate::proto::DropReason;
use metrics::{counter, describe_counter, describe_gauge, gauge};
use std::sync::atomic::{AtomicU64, Ordering};
use uturn_shared::status::ListenerAllocations;

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
    pub report: std::sync::Mutex<ShardReport>,
}

/// Datagrams and bytes, each way (`rx`: received by uturn, `tx`: sent by uturn).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Datagrams received.
    pub rx_packets: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Datagrams sent.
    pub tx_packets: u64,
    /// Bytes sent.
    pub tx_bytes: u64,
}

impl Traffic {
    /// Counts one received datagram of `bytes`.
    pub fn rx(&mut self, bytes: usize) {
        self.rx_packets += 1;
        self.rx_bytes += bytes as u64;
    }

    /// Counts one sent datagram of `bytes`.
    pub fn tx(&mut self, bytes: usize) {
        self.tx_packets += 1;
        self.tx_bytes += bytes as u64;
    }

    fn add(&mut self, other: &Traffic) {
        self.rx_packets += other.rx_packets;
        self.rx_bytes += other.rx_bytes;
        self.tx_packets += other.tx_packets;
        self.tx_bytes += other.tx_bytes;
    }
}

/// Cumulative counters by name (a listener or a cluster), kept by one shard. Names are never
/// forgotten, so a counter survives its object being restarted or removed and re-added.
#[derive(Debug, Clone, Default)]
pub struct CountersByName {
    /// Names, in first-seen order.
    pub names: Vec<String>,
    /// Traffic, parallel to `names`.
    pub traffic: Vec<Traffic>,
    /// Sockets ever opened (listeners only), parallel to `names`.
    pub opened: Vec<u64>,
    /// Sockets open now (listeners only), parallel to `names`.
    pub open: Vec<u64>,
}

impl CountersByName {
    /// The slot of `name`, created on first use.
    pub fn slot(&mut self, name: &str) -> usize {
        if let Some(i) = self.names.iter().position(|n| n == name) {
            return i;
        }
        self.names.push(name.to_string());
        self.traffic.push(Traffic::default());
        self.opened.push(0);
        self.open.push(0);
        self.names.len() - 1
    }
}

/// What one shard publishes per tick besides its atomics.
#[derive(Debug, Clone, Default)]
pub struct ShardReport {
    /// Per listener name.
    pub listeners: CountersByName,
    /// Per cluster name.
    pub clusters: CountersByName,
    /// Live allocations by listener name.
    pub listener_allocations: Vec<ListenerAllocations>,
    /// Second-chance forwarding's, if it is configured.
    pub siblings: Option<SiblingReport>,
    /// Datagrams dropped, by [`DropReason::index`] (oversized ones count as malformed).
    pub dropped: [u64; DropReason::ALL.len()],
    /// Requests rejected for their credentials (401 or 438 sent).
    pub auth_failed: u64,
    /// Allocates refused for a quota (486 per user-id, 508 for the global cap).
    pub quota_refused: u64,
    /// Datagrams not sent for want of room (a full socket buffer or slow reader's queue).
    pub send_failed: u64,
    /// Datagrams the kernel refused with an error.
    pub send_errors: u64,
    /// TCP/TLS connections closed at accept for a cap: per client address, and in total.
    pub refused_connections: [u64; 2],
    /// Bytes of memory TCP/TLS connections' buffers hold now.
    pub stream_buffer_bytes: u64,
    /// TCP/TLS connections whose client holds no allocation yet.
    pub unauthenticated_connections: u64,
    /// Channels the kernel offload relays now.
    pub offload_channels: u64,
    /// Datagrams the kernel offload relayed: client → peer, peer → client (also counted in
    /// the listener and cluster counters).
    pub offloaded_packets: [u64; 2],
}

/// One name's counters summed over the shards.
#[derive(Default)]
struct NameTotal {
    name: String,
    traffic: Traffic,
    opened: u64,
    open: u64,
}

/// The counters `pick` chooses from each report, summed by name, sorted by name.
fn sum_by_name(
    reports: &[ShardReport],
    pick: fn(&ShardReport) -> &CountersByName,
) -> Vec<NameTotal> {
    let mut totals: Vec<NameTotal> = Vec::new();
    for report in reports {
        let counters = pick(report);
        for (i, name) in counters.names.iter().enumerate() {
            let slot = match totals.iter().position(|total| total.name == *name) {
                Some(slot) => slot,
                None => {
                    totals.push(NameTotal {
                        name: name.clone(),
                        ..NameTotal::default()
                    });
                    totals.len() - 1
                }
            };
            let total = &mut totals[slot];
            total.traffic.add(&counters.traffic[i]);
            total.opened += counters.opened[i];
            total.open += counters.open[i];
        }
    }
    totals.sort_by(|a, b| a.name.cmp(&b.name));
    totals
}

/// What one shard's second-chance forwarding publishes per tick.
#[derive(Debug, Clone)]
pub struct SiblingReport {
    /// Its counters.
    pub counts: super::SiblingCounts,
    /// How many clients this shard forwards to each sibling.
    pub forwarding: Vec<SiblingForwarding>,
}

/// An entry of a short list of counts, one a key (a listener, a sibling), that [`add_count`]
/// sums the shards' lists into.
pub trait Tally: Clone {
    /// Whether `other` counts for the same key.
    fn same_key(&self, other: &Self) -> bool;
    /// Adds `other`'s count to this one's.
    fn add(&mut self, other: &Self);
}

impl Tally for ListenerAllocations {
    fn same_key(&self, other: &Self) -> bool {
        self.listener == other.listener
    }

    fn add(&mut self, other: &Self) {
        self.allocations += other.allocations;
    }
}

impl Tally for SiblingForwarding {
    fn same_key(&self, other: &Self) -> bool {
        self.sibling == other.sibling
    }

    fn add(&mut self, other: &Self) {
        self.clients += other.clients;
    }
}

/// Adds `entry`'s count to its key's in `counts` (a short list, kept in first-seen order).
pub fn add_count<T: Tally>(counts: &mut Vec<T>, entry: &T) {
    match counts.iter_mut().find(|counted| counted.same_key(entry)) {
        Some(counted) => counted.add(entry),
        None => counts.push(entry.clone()),
    }
}

/// Records the dataplane's metrics, summed over `shards`, into `recorder` for a scrape: stunnerd's
/// names, types, labels and HELP text (stunnerd.md §7), then uturn's own. Called at scrape time
/// only; the packet path counts into its shard's plain integers and never reaches `metrics`.
/// The totals only grow (every shard's counters do, and a name is never forgotten), so a
/// counter is set with `absolute`.
pub fn record(shards: &[ShardStats], recorder: &dyn metrics::Recorder) {
    metrics::with_local_recorder(recorder, || record_totals(shards));
}

fn record_totals(shards: &[ShardStats]) {
    let reports: Vec<ShardReport> = shards
        .iter()
        .map(|s| s.report.lock().map(|r| r.clone()).unwrap_or_default())
        .collect();
    let allocations: u64 = shards
        .iter()
        .map(|s| s.allocations.load(Ordering::Relaxed))
        .sum();
    describe_gauge!("stunner_allocations_active", "Number of active allocations");
    gauge!("stunner_allocations_active").set(allocations as f64);

    let listeners = sum_by_name(&reports, |r| &r.listeners);
    describe_gauge!(
        "stunner_listener_connections",
        "Number of active downstream connections at a listener"
    );
    describe_counter!(
        "stunner_listener_connections_total",
        "Number of all downstream connections observed at a listener"
    );
    for total in &listeners {
        let name = total.name.clone();
        gauge!("stunner_listener_connections", "name" => name.clone()).set(total.open as f64);
        counter!("stunner_listener_connections_total", "name" => name).absolute(total.opened);
    }
    let clusters = sum_by_name(&reports, |r| &r.clusters);
    for (packets, bytes, help, rows) in [
        (
            "stunner_listener_packets_total",
            "stunner_listener_bytes_total",
            [
                "Number of datagrams sent or received at a listener",
                "Number of bytes sent or received at a listener",
            ],
            &listeners,
        ),
        (
            "stunner_cluster_packets_total",
            "stunner_cluster_bytes_total",
            [
                "Number of datagrams sent to or received from backends",
                "Number of bytes sent to or received from backends",
            ],
            &clusters,
        ),
    ] {
        describe_counter!(packets, help[0]);
        describe_counter!(bytes, help[1]);
        for total in rows.iter() {
            let traffic = &total.traffic;
            for (metric, rx, tx) in [
                (packets, traffic.rx_packets, traffic.tx_packets),
                (bytes, traffic.rx_bytes, traffic.tx_bytes),
            ] {
                let name = total.name.clone();
                counter!(metric, "direction" => "rx", "name" => name.clone()).absolute(rx);
                counter!(metric, "direction" => "tx", "name" => name).absolute(tx);
            }
        }
    }

    describe_counter!(
        "uturn_dropped_datagrams_total",
        "Datagrams and requests uturn dropped or rejected, by reason"
    );
    let sum = |pick: fn(&ShardReport) -> u64| -> u64 { reports.iter().map(pick).sum() };
    let dropped = |reason: &'static str, n: u64| {
        counter!("uturn_dropped_datagrams_total", "reason" => reason).absolute(n);
    };
    for reason in DropReason::ALL {
        dropped(
            reason.name(),
            reports.iter().map(|r| r.dropped[reason.index()]).sum(),
        );
    }
    dropped("auth_failed", sum(|r| r.auth_failed));
    dropped("quota", sum(|r| r.quota_refused));
    dropped("send_failed", sum(|r| r.send_failed));
    dropped("send_error", sum(|r| r.send_errors));

    describe_counter!(
        "uturn_refused_connections_total",
        "TCP/TLS connections closed at accept for a cap on unauthenticated connections"
    );
    for (i, reason) in ["per_ip", "total"].into_iter().enumerate() {
        let refused: u64 = reports.iter().map(|r| r.refused_connections[i]).sum();
        counter!("uturn_refused_connections_total", "reason" => reason).absolute(refused);
    }
    describe_gauge!(
        "uturn_unauthenticated_connections",
        "TCP/TLS connections whose client holds no allocation yet"
    );
    gauge!("uturn_unauthenticated_connections").set(sum(|r| r.unauthenticated_connections) as f64);
    describe_gauge!(
        "uturn_stream_buffer_bytes",
        "Bytes of memory held by TCP/TLS connections' send and receive buffers"
    );
    gauge!("uturn_stream_buffer_bytes").set(sum(|r| r.stream_buffer_bytes) as f64);
    describe_gauge!(
        "uturn_offload_channels",
        "Channels the kernel offload relays now"
    );
    gauge!("uturn_offload_channels").set(sum(|r| r.offload_channels) as f64);
    describe_counter!(
        "uturn_offloaded_packets_total",
        "Datagrams the kernel offload relayed (also in the listener and cluster counters)"
    );
    for (i, direction) in ["to_peer", "to_client"].into_iter().enumerate() {
        let relayed: u64 = reports.iter().map(|r| r.offloaded_packets[i]).sum();
        counter!("uturn_offloaded_packets_total", "direction" => direction).absolute(relayed);
    }
    record_siblings(&reports);
}

/// Second-chance forwarding's counters (only when it is configured).
fn record_siblings(reports: &[ShardReport]) {
    let counts: Vec<super::SiblingCounts> = reports
        .iter()
        .filter_map(|r| r.siblings.as_ref().map(|s| s.counts))
        .collect();
    if counts.is_empty() {
        return;
    }
    let sum = |pick: fn(&super::SiblingCounts) -> u64| -> u64 { counts.iter().map(pick).sum() };
    describe_counter!(
        "uturn_sibling_packets_total",
        "Client datagrams handed to a sibling gateway pod (forwarded_out) or from one \
         (forwarded_in), and datagrams for clients sent back through one (returned_out) or \
         from one (returned_in)"
    );
    for (direction, n) in [
        ("forwarded_out", sum(|c| c.forwarded_out)),
        ("forwarded_in", sum(|c| c.forwarded_in)),
        ("returned_out", sum(|c| c.returned_out)),
        ("returned_in", sum(|c| c.returned_in)),
    ] {
        counter!("uturn_sibling_packets_total", "direction" => direction).absolute(n);
    }
    describe_counter!(
        "uturn_sibling_queries_total",
        "Owner queries for clients whose allocation this pod does not hold, by outcome \
         (sent, claimed by a sibling, unclaimed, not sent for the source's query budget)"
    );
    for (outcome, n) in [
        ("sent", sum(|c| c.queries)),
        ("hit", sum(|c| c.hits)),
        ("miss", sum(|c| c.misses)),
        ("rate_limited", sum(|c| c.rate_limited)),
    ] {
        counter!("uturn_sibling_queries_total", "outcome" => outcome).absolute(n);
    }
    describe_counter!(
        "uturn_sibling_refused_total",
        "Sibling messages refused, by reason"
    );
    for (reason, n) in [
        ("unauthenticated", sum(|c| c.unauthenticated)),
        ("stale", sum(|c| c.stale)),
        ("malformed", sum(|c| c.malformed)),
        ("not_sibling", sum(|c| c.not_sibling)),
        ("replayed", sum(|c| c.replayed)),
        ("too_many_senders", sum(|c| c.too_many_senders)),
        ("unsolicited", sum(|c| c.unsolicited)),
    ] {
        counter!("uturn_sibling_refused_total", "reason" => reason).absolute(n);
    }
}

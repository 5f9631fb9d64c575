//! A shard's side of the offload: it resolves the addresses of the channels the engine offers
//! (how this host reaches each client and peer, from the routing and neighbour tables through
//! netlink, cached), feeds them to [`Entries`] (which decides what the kernel should hold) and
//! carries out the map operations it answers with, booking what removed entries relayed to
//! the shard's counters.

use super::entries::{Entries, Op, Wanted};
use super::maps::{EntrySpec, Relayed, IN_COUNTERS, IN_VALUE, OUT_COUNTERS, OUT_VALUE};
use super::routes::{Netlink, RouteCache};
use super::Offload;
use crate::io::sys::monotonic_ns;
use crate::proto::{OffloadChannel, RelayId};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How long a route is trusted, and a failed lookup remembered.
const ROUTE_TTL: Duration = Duration::from_secs(10);
const NO_ROUTE_TTL: Duration = Duration::from_secs(2);
/// Routes cached per shard at most.
const ROUTES: usize = 4096;
/// Map writes that failed (a full map) are logged at most this often, with their count.
const FAILURE_LOG: Duration = Duration::from_secs(60);
/// Entries whose counters one periodic pass reads at most (the rest wait for their turn:
/// with more channels than this, a channel's traffic reaches the metrics within
/// channels / COUNTER_READS passes).
const COUNTER_READS: usize = 1024;

/// How this host reaches an address: the source it sends from, the interface (0: the address
/// is this host's own) and, for XDP, the Ethernet destination and source there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Path {
    source: Ipv4Addr,
    ifindex: u32,
    macs: Option<[u8; 12]>,
}

/// What an offloaded channel relayed since the last read, for the shard's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Delta {
    pub listener: crate::proto::ListenerId,
    pub cluster: uturn_shared::snapshot::ClusterId,
    /// Client → peer.
    pub out: Relayed,
    /// Peer → client.
    pub into: Relayed,
}

/// A shard's entries and the means to write them.
pub(crate) struct OffloadTable {
    offload: Arc<Offload>,
    entries: Entries,
    netlink: Option<Netlink>,
    paths: RouteCache<Path>,
    ops: Vec<Op>,
    /// Map writes that failed since the last log line, and when that was.
    failures: u64,
    last_failure: Option<String>,
    failure_logged: Option<Instant>,
    /// Where the next pass's counter reads start.
    read_cursor: usize,
}

impl OffloadTable {
    pub(crate) fn new(offload: Arc<Offload>) -> OffloadTable {
        let netlink = match Netlink::open() {
            Ok(netlink) => Some(netlink),
            Err(e) => {
                tracing::warn!(
                    target: "stunnerd",
                    "offload: cannot open a netlink socket to read the routing table ({e}): \
                     this shard relays its channels in user space"
                );
                None
            }
        };
        OffloadTable {
            offload,
            entries: Entries::new(Instant::now(), monotonic_ns()),
            netlink,
            paths: RouteCache::new(ROUTE_TTL, NO_ROUTE_TTL, ROUTES),
            ops: Vec::new(),
            failures: 0,
            last_failure: None,
            failure_logged: None,
            read_cursor: 0,
        }
    }

    /// How this host reaches `to`, cached (failures too).
    fn path(&mut self, to: Ipv4Addr, now: Instant) -> Option<Path> {
        let ip = IpAddr::V4(to);
        if let Some(cached) = self.paths.get(ip, now) {
            return cached;
        }
        let with_macs = self.offload.xdp_running();
        let path = self.netlink.as_mut().and_then(|netlink| {
            let route = netlink.route(ip).ok()??;
            let IpAddr::V4(source) = route.source else {
                return None;
            };
            if route.local {
                return Some(Path {
                    source,
                    ifindex: 0,
                    macs: None,
                });
            }
            let macs = if with_macs {
                let next_hop = route.gateway.unwrap_or(ip);
                let dst = netlink.neighbour(next_hop, route.ifindex).ok().flatten();
                let src = netlink.link_mac(route.ifindex).ok().flatten();
                dst.zip(src).map(|(dst, src)| {
                    let mut macs = [0u8; 12];
                    macs[..6].copy_from_slice(&dst);
                    macs[6..].copy_from_slice(&src);
                    macs
                })
            } else {
                None
            };
            Some(Path {
                source,
                ifindex: route.ifindex,
                macs,
            })
        });
        self.paths.insert(ip, path, now);
        path
    }

    /// The entry pair for `channel` of the allocation whose relay socket has port
    /// `relay_port`, for a client on listener port `listener_port`; `None` where the program
    /// cannot relay it (IPv6, no route).
    fn wanted(
        &mut self,
        channel: &OffloadChannel,
        listener_port: u16,
        relay_port: u16,
        now: Instant,
    ) -> Option<Wanted> {
        let (SocketAddr::V4(client), SocketAddr::V4(peer)) = (channel.client, channel.peer) else {
            return None;
        };
        let toward_client = self.path(*client.ip(), now)?;
        let toward_peer = self.path(*peer.ip(), now)?;
        Some(Wanted {
            spec: EntrySpec {
                client,
                listener: SocketAddrV4::new(toward_client.source, listener_port),
                channel: channel.number,
                relay: SocketAddrV4::new(toward_peer.source, relay_port),
                peer,
                peer_ifindex: toward_peer.ifindex,
                client_ifindex: toward_client.ifindex,
                peer_macs: toward_peer.macs,
                client_macs: toward_client.macs,
                alloc: 0,
                perm: 0,
                expires_ns: self.entries.ns(channel.expires_at),
            },
            listener: channel.listener,
            cluster: channel.cluster,
            expires_at: channel.expires_at,
            permission_expires_at: channel.permission_expires_at,
        })
    }

    /// Makes the kernel hold exactly `channels` (each with its listener's port) of allocation
    /// `relay`, whose relay socket has port `relay_port` and which ends at `deadline`.
    pub(crate) fn set_all(
        &mut self,
        relay: RelayId,
        relay_port: u16,
        channels: &[(OffloadChannel, u16)],
        deadline: Instant,
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) {
        let wanted: Vec<Wanted> = channels
            .iter()
            .filter_map(|(channel, port)| self.wanted(channel, *port, relay_port, now))
            .collect();
        self.carry_out(now, deltas, |entries, new_alloc, ops| {
            entries.set_all(relay, &wanted, deadline, now, new_alloc, ops)
        });
    }

    /// Makes the kernel hold `channel` (with its listener's port) of allocation `relay`, as
    /// [`OffloadTable::set_all`] for one channel; one the program cannot relay (IPv6, no
    /// route) is not held.
    pub(crate) fn set_channel(
        &mut self,
        relay: RelayId,
        relay_port: u16,
        (channel, port): (OffloadChannel, u16),
        deadline: Instant,
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) {
        let number = channel.number;
        let wanted = self.wanted(&channel, port, relay_port, now);
        self.carry_out(now, deltas, |entries, new_alloc, ops| match wanted {
            Some(want) => entries.set_channel(relay, want, deadline, now, new_alloc, ops),
            None => entries.unset_channel(relay, number, ops),
        });
    }

    /// Channel `number` of allocation `relay` is not held any more.
    pub(crate) fn unset_channel(
        &mut self,
        relay: RelayId,
        number: u16,
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) {
        self.carry_out(now, deltas, |entries, _, ops| {
            entries.unset_channel(relay, number, ops)
        });
    }

    /// Allocation `relay` ends at `deadline` now (a Refresh).
    pub(crate) fn set_deadline(
        &mut self,
        relay: RelayId,
        deadline: Instant,
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) {
        self.carry_out(now, deltas, |entries, _, ops| {
            entries.set_deadline(relay, deadline, now, ops)
        });
    }

    /// The permission of allocation `relay` for peer `ip` ends at `end` now, with `bound`
    /// channels bound to that peer (a CreatePermission or ChannelBind refreshed it). Whether
    /// channels to the peer are missing that the kernel could relay (the peer is reached):
    /// the shell then offers them.
    pub(crate) fn set_permission(
        &mut self,
        relay: RelayId,
        ip: IpAddr,
        end: Instant,
        bound: usize,
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) -> bool {
        // The kernel relays IPv4 channels only: an IPv6 permission has nothing there.
        let IpAddr::V4(v4) = ip else {
            return false;
        };
        let mut missing = false;
        self.carry_out(now, deltas, |entries, _, ops| {
            missing = entries.set_permission(relay, v4, end, bound, now, ops)
        });
        // A peer with no route (cached) would be offered in vain at every request.
        missing && self.path(v4, now).is_some()
    }

    /// Removes the entries of allocation `relay` (it ended).
    pub(crate) fn forget(&mut self, relay: RelayId, deltas: &mut Vec<Delta>) {
        self.carry_out(Instant::now(), deltas, |entries, _, ops| {
            entries.forget(relay, ops)
        });
    }

    /// Asks the entry table (`decide`, given a source of deadline slots) what to do, and
    /// carries it out.
    fn carry_out(
        &mut self,
        now: Instant,
        deltas: &mut Vec<Delta>,
        decide: impl FnOnce(&mut Entries, &mut dyn FnMut() -> Option<u32>, &mut Vec<Op>),
    ) {
        let mut ops = std::mem::take(&mut self.ops);
        let offload = self.offload.clone();
        decide(
            &mut self.entries,
            &mut || offload.acquire_deadline(),
            &mut ops,
        );
        self.apply(&mut ops, now, deltas);
        self.ops = ops;
    }

    /// Carries out `ops` in order; an entry the kernel refused is not held (the table hears
    /// of it, and what that undoes is carried out too).
    fn apply(&mut self, ops: &mut Vec<Op>, now: Instant, deltas: &mut Vec<Delta>) {
        let mut refused = Vec::new();
        while !ops.is_empty() {
            self.apply_once(ops, &mut refused, deltas);
            for spec in refused.drain(..) {
                self.entries.refused(&spec, ops);
            }
        }
        self.log_failures(now);
    }

    fn apply_once(
        &mut self,
        ops: &mut Vec<Op>,
        refused: &mut Vec<EntrySpec>,
        deltas: &mut Vec<Delta>,
    ) {
        for op in ops.drain(..) {
            let written = match op {
                Op::Deadline { slot, ns } => self.offload.set_deadline(slot, ns),
                Op::Install(spec) => {
                    let installed = self.offload.install(&spec);
                    if installed.is_err() {
                        // Half of the pair may be in: neither stays.
                        self.offload.remove(&spec);
                        refused.push(spec);
                    }
                    installed
                }
                Op::Update(spec) => self.update(&spec),
                Op::Remove(mut held) => {
                    // Counts first: what it relayed until now is still the allocation's.
                    let kernel = self.offload.values(&held.spec);
                    if let Some(delta) = account(&mut held, &kernel) {
                        deltas.push(delta);
                    }
                    self.offload.remove(&held.spec);
                    Ok(())
                }
                Op::Free { slot } => {
                    self.offload.release_deadline(slot);
                    Ok(())
                }
            };
            if let Err(e) = written {
                self.failures += 1;
                self.last_failure = Some(e.to_string());
            }
        }
    }

    /// New values under `spec`'s keys, the kernel's counters kept (what the program counts
    /// between the read and the write is lost: microseconds).
    fn update(&self, spec: &EntrySpec) -> std::io::Result<()> {
        let (out_now, into_now) = self.offload.values(spec);
        let mut out = spec.out_value();
        let mut into = spec.in_value();
        if let Some(kernel) = out_now {
            out[OUT_COUNTERS..].copy_from_slice(&kernel[OUT_COUNTERS..]);
        }
        if let Some(kernel) = into_now {
            into[IN_COUNTERS..].copy_from_slice(&kernel[IN_COUNTERS..]);
        }
        self.offload.write(spec, &out, &into)
    }

    /// One WARN for the map writes that failed (a full map), at most every [`FAILURE_LOG`]:
    /// a client that binds channels past the map's size cannot flood the log.
    fn log_failures(&mut self, now: Instant) {
        if self.failures == 0 || self.failure_logged.is_some_and(|at| now < at + FAILURE_LOG) {
            return;
        }
        tracing::warn!(
            target: "stunner",
            "offload: {} map write(s) failed ({}); those channels are relayed in user space",
            self.failures,
            self.last_failure.take().unwrap_or_default()
        );
        self.failures = 0;
        self.failure_logged = Some(now);
    }

    /// Reads every entry's counters and writes the extensions that waited; the allocations to
    /// offer again (marked, or with an entry that ended by `now`). With XDP running, an
    /// entry still missing the MAC addresses of a next hop is offered again too, once the
    /// neighbour table may have them.
    pub(crate) fn sync(&mut self, now: Instant, deltas: &mut Vec<Delta>) -> Vec<RelayId> {
        let xdp = self.offload.xdp_running();
        if xdp {
            self.offload.check_xdp();
        }
        let mut ops = std::mem::take(&mut self.ops);
        let again = self.entries.sync(now, xdp, &mut ops);
        self.apply(&mut ops, now, deltas);
        self.ops = ops;
        // Counters: at most COUNTER_READS entries a pass, taking turns, so that a shard's
        // periodic cost is bounded however many channels its clients bind (each read is two
        // bpf(2) calls); an entry's last counts are read when it goes, whatever its turn.
        let offload = self.offload.clone();
        let held = self.entries.len();
        let start = if held == 0 {
            0
        } else {
            self.read_cursor % held
        };
        for entry in self.entries.held_mut().skip(start).take(COUNTER_READS) {
            let kernel = offload.values(&entry.spec);
            if let Some(delta) = account(entry, &kernel) {
                deltas.push(delta);
            }
        }
        let wrapped = held.saturating_sub(start);
        if wrapped < COUNTER_READS {
            for entry in self
                .entries
                .held_mut()
                .take((COUNTER_READS - wrapped).min(start))
            {
                let kernel = offload.values(&entry.spec);
                if let Some(delta) = account(entry, &kernel) {
                    deltas.push(delta);
                }
            }
        }
        self.read_cursor = start + COUNTER_READS;
        again
    }

    /// Entry pairs installed.
    pub(crate) fn len(&self) -> usize {
        self.entries.len()
    }
}

/// An entry pair's values as the kernel has them (client → peer, peer → client).
pub(super) type KernelValues = (Option<[u8; OUT_VALUE]>, Option<[u8; IN_VALUE]>);

/// What `held` relayed since its last read, given the kernel's `values` of it (an entry the
/// kernel no longer has counts as unchanged).
fn account(held: &mut super::entries::Held, values: &KernelValues) -> Option<Delta> {
    let out = values
        .0
        .map_or(held.seen_out, |v| Relayed::read(&v, OUT_COUNTERS));
    let into = values
        .1
        .map_or(held.seen_in, |v| Relayed::read(&v, IN_COUNTERS));
    let delta = Delta {
        listener: held.listener,
        cluster: held.cluster,
        out: out.since(held.seen_out),
        into: into.since(held.seen_in),
    };
    held.seen_out = out;
    held.seen_in = into;
    (delta.out.packets + delta.into.packets > 0).then_some(delta)
}

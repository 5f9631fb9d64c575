//! The [`Engine`]'s side of [`crate::proto::persist`]: its allocations as records, what
//! changed of them as journal entries ([`Engine::poll_persist`]), and a record re-created as
//! an allocation in a new process, as [`Engine::complete_allocate`] does for an Allocate.

use super::Engine;
use crate::proto::contract::{Family, ListenerId, RelayId};
use crate::proto::limits::QuotaError;
use crate::proto::offload::OffloadChange;
use crate::proto::persist::{
    AdoptError, AllocationRecord, ChannelRecord, JournalEntry, MonotonicEpoch, PermissionRecord,
    RelayPorts,
};
use crate::proto::store::{Allocation, AllocationStore, Channel, ClientKey, Families, Permission};
use crate::proto::{
    CHANNEL_LIFETIME, CHANNEL_NUMBERS, MAX_REQUESTED_LIFETIME_SECS, PERMISSION_LIFETIME,
    SWEEP_INTERVAL,
};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use stun_proto::types::message::Message;
use turn_types::attribute::XorRelayedAddress;
use uturn_shared::config::ListenerProtocol;
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::Snapshot;

/// What changed of the allocations since the shell last asked, in order; nothing is kept
/// until the shell [enables](Engine::enable_persist) it.
#[derive(Default)]
pub(super) struct PersistChanges {
    queue: Option<VecDeque<Change>>,
}

#[derive(PartialEq)]
enum Change {
    /// The allocation of this client, in this slot, was made or changed: its record now.
    Put(u32, ClientKey),
    /// The allocation of this client on the listener of this name ended.
    Delete(String, SocketAddr),
}

impl PersistChanges {
    /// The allocation in `slot` of `store` was made or changed (a request succeeded on it,
    /// its client's path moved).
    pub(super) fn changed(&mut self, store: &AllocationStore, slot: u32) {
        let (Some(queue), Some(alloc)) = (self.queue.as_mut(), store.get(slot)) else {
            return;
        };
        let change = Change::Put(slot, alloc.key);
        if !queue.contains(&change) {
            queue.push_back(change);
        }
    }

    /// `alloc` ended (deleted, expired, its listener closed).
    pub(super) fn deleted(&mut self, alloc: &Allocation) {
        if let Some(queue) = self.queue.as_mut() {
            let key = (alloc.listener_name.clone(), alloc.key.client);
            queue.retain(|c| !matches!(c, Change::Put(_, k) if *k == alloc.key));
            queue.push_back(Change::Delete(key.0, key.1));
        }
    }
}

impl Engine {
    /// Tells the engine that a journal keeps its allocations (a state directory): from now on
    /// it records what changed of each ([`Engine::poll_persist`]).
    pub fn enable_persist(&mut self) {
        self.persist.queue.get_or_insert_with(Default::default);
        self.allocations.record_path_changes();
    }

    /// The next change to the allocations, as the journal entry that records it, deadlines
    /// on `epoch`'s clock: an allocation made or changed (an Allocate, Refresh,
    /// CreatePermission or ChannelBind that succeeded, its client's flow moving to or from a
    /// sibling) is a [`JournalEntry::Put`] of its record as it is now, one that ended (deleted,
    /// expired, its listener closed) a [`JournalEntry::Delete`]. Never per packet: the shell
    /// drains it after each request, before the answer leaves, and once a tick.
    pub fn poll_persist(&mut self, epoch: MonotonicEpoch) -> Option<JournalEntry> {
        self.route_path_changes();
        let queue = self.persist.queue.as_mut()?;
        while let Some(change) = queue.pop_front() {
            match change {
                Change::Put(slot, key) => {
                    let alloc = self.allocations.get(slot).filter(|a| a.key == key);
                    if let Some(alloc) = alloc {
                        return Some(JournalEntry::Put(record(alloc, epoch)));
                    }
                }
                Change::Delete(listener, client) => {
                    return Some(JournalEntry::Delete { listener, client })
                }
            }
        }
        None
    }

    /// Every live allocation as a record, its deadlines on `epoch`'s monotonic clock: what a
    /// new process needs to [adopt](Engine::adopt) them.
    pub fn allocation_records(&self, epoch: MonotonicEpoch) -> Vec<AllocationRecord> {
        self.allocations
            .iter()
            .map(|alloc| record(alloc, epoch))
            .collect()
    }

    /// Re-creates the allocation `record` describes, before the shell serves (a restart):
    /// `listener` is the shell's id of the listener the record names, `bound` the ports of the
    /// relay sockets the shell bound again for it (each on its recorded port), `epoch` this
    /// process's reading of the monotonic clock. Its deadline, permissions and channels keep
    /// their ends; a permission or channel whose peer `snap` no longer permits is left out,
    /// as is a relay not bound on its port (with the permissions and channels of its family).
    ///
    /// Returns the ids to register the bound sockets under, IPv4 first; a socket the shell
    /// bound of a family not among them, or for a record refused, is the shell's to close.
    pub fn adopt(
        &mut self,
        record: AllocationRecord,
        listener: ListenerId,
        bound: RelayPorts,
        snap: &Snapshot,
        now: Instant,
        epoch: MonotonicEpoch,
    ) -> Result<Vec<RelayId>, AdoptError> {
        let now_ns = epoch.ns_at(now);
        if record.expires_at_ns <= now_ns {
            return Err(AdoptError::Expired);
        }
        let spec = snap.listeners.iter().find(|l| l.name == record.listener);
        match spec.map(|spec| spec.protocol) {
            None => return Err(AdoptError::ListenerGone),
            Some(ListenerProtocol::TurnUdp) => {}
            // RFC 8656 §3.1: an allocation on a connection lives no longer than it, and the
            // connection ended with the process that held it.
            Some(_) => return Err(AdoptError::ConnectionEnded),
        }
        let key = ClientKey {
            listener,
            client: record.client,
        };
        if self.allocations.slot_of(&key).is_some() {
            return Err(AdoptError::Exists);
        }
        // A relay on another port is not the one the client and its peers know.
        let families = Family::ALL
            .into_iter()
            .filter(|&f| {
                record
                    .relays
                    .get(f)
                    .is_some_and(|p| bound.get(f) == Some(p))
            })
            .fold(Families::NONE, Families::with);
        if families == Families::NONE {
            return Err(AdoptError::NoRelay);
        }
        let max_allocations = self.config.limits.max_allocations;
        self.config
            .ledger
            .reserve(&record.user_id, snap.user_quota, max_allocations)
            .map_err(|refused| match refused {
                QuotaError::User => AdoptError::UserQuotaReached,
                QuotaError::Global => AdoptError::AllocationCapReached,
            })?;
        let clock = Clock { now, now_ns, epoch };
        let mut alloc = Allocation {
            key,
            listener_name: record.listener,
            families,
            dont_fragment: record.dont_fragment,
            username: record.username,
            user_id: record.user_id,
            // Never beyond what a request could have given: a wrong epoch must not make an
            // allocation that outlives every client.
            expires_at: clock.deadline(
                record.expires_at_ns,
                Duration::from_secs(u64::from(MAX_REQUESTED_LIFETIME_SECS)),
            ),
            allocate_txid: record.allocate_txid,
            allocate_response: record.allocate_response,
            permissions: Vec::new(),
            channels: Vec::new(),
            via: record.via,
            forwarded: record.via.is_some(),
        };
        let max_permissions = self.config.limits.max_permissions;
        adopt_permissions(
            &mut alloc,
            &record.permissions,
            snap,
            clock,
            max_permissions,
        );
        adopt_channels(&mut alloc, &record.channels, snap, clock, max_permissions);
        let slot = self.allocations.reserve_slot();
        self.allocations.insert(slot, alloc);
        // Journaled by the shard that adopted it from now on.
        self.persist.changed(&self.allocations, slot);
        self.stats.allocations_created += 1;
        self.next_sweep.get_or_insert(now + SWEEP_INTERVAL);
        self.offload
            .note(OffloadChange::All(RelayId::new(slot, Family::V4)));
        Ok(families.iter().map(|f| RelayId::new(slot, f)).collect())
    }
}

/// `alloc` as a record, its deadlines on `epoch`'s clock.
fn record(alloc: &Allocation, epoch: MonotonicEpoch) -> AllocationRecord {
    AllocationRecord {
        listener: alloc.listener_name.clone(),
        client: alloc.key.client,
        relays: relay_ports(alloc),
        dont_fragment: alloc.dont_fragment,
        username: alloc.username.clone(),
        user_id: alloc.user_id.clone(),
        expires_at_ns: epoch.ns_at(alloc.expires_at),
        allocate_txid: alloc.allocate_txid,
        allocate_response: alloc.allocate_response.clone(),
        permissions: alloc
            .permissions
            .iter()
            .map(|p| PermissionRecord {
                ip: p.ip,
                expires_at_ns: epoch.ns_at(p.expires_at),
            })
            .collect(),
        channels: alloc
            .channels
            .iter()
            .map(|c| ChannelRecord {
                number: c.number,
                peer: c.peer,
                expires_at_ns: epoch.ns_at(c.expires_at),
            })
            .collect(),
        via: alloc.via,
    }
}

/// The ports of `alloc`'s relays, read back from the XOR-RELAYED-ADDRESSes of the Allocate
/// success it sent: the engine keeps no other copy of them (the shell holds the sockets).
fn relay_ports(alloc: &Allocation) -> RelayPorts {
    let Ok(msg) = Message::from_bytes(&alloc.allocate_response) else {
        return RelayPorts::default();
    };
    let txid = msg.transaction_id();
    (0..)
        .map_while(|i| msg.nth_attribute::<XorRelayedAddress>(i).ok())
        .map(|relayed| relayed.addr(txid))
        .map(|relayed| (Family::of_canonical(relayed), relayed.port()))
        // A relay of a dual allocation deleted since (RFC 8656 §7.3) is in the success still.
        .filter(|&(family, _)| alloc.families.contains(family))
        .fold(RelayPorts::default(), |ports, (family, port)| {
            ports.with(family, port)
        })
}

/// The moment an adoption happens, on both clocks.
#[derive(Clone, Copy)]
struct Clock {
    now: Instant,
    now_ns: u64,
    epoch: MonotonicEpoch,
}

impl Clock {
    /// Deadline `ns` as an instant, at most `longest` from now.
    fn deadline(self, ns: u64, longest: Duration) -> Instant {
        let cap = self.now + longest;
        self.epoch.instant_at(ns).map_or(cap, |at| at.min(cap))
    }

    /// Deadline `ns` as an instant, if it is still ahead.
    fn live(self, ns: u64, longest: Duration) -> Option<Instant> {
        (ns > self.now_ns).then(|| self.deadline(ns, longest))
    }
}

/// Whether `alloc` may still reach `ip`: a relay of its family, and a cluster its listener
/// routes to permits it (RFC 8656 §9.2, §11.2, as the requests judge it).
fn permitted(alloc: &Allocation, snap: &Snapshot, ip: IpAddr) -> bool {
    alloc.relays_to(ip)
        && snap
            .route(&alloc.listener_name)
            .is_some_and(|route| snap.permits_ip(route, ip))
}

/// Gives `alloc` the live, permitted permissions of `recorded`, within `max`.
fn adopt_permissions(
    alloc: &mut Allocation,
    recorded: &[PermissionRecord],
    snap: &Snapshot,
    clock: Clock,
    max: usize,
) {
    for permission in recorded {
        let ip = unmapped_ip(permission.ip);
        if alloc.permissions.len() >= max
            || alloc.permissions.iter().any(|p| p.ip == ip)
            || !permitted(alloc, snap, ip)
        {
            continue;
        }
        if let Some(at) = clock.live(permission.expires_at_ns, PERMISSION_LIFETIME) {
            alloc.permissions.push(Permission::new(ip, at));
        }
    }
}

/// Gives `alloc` the live, permitted channels of `recorded`, within `max`: each number bound
/// to one peer, each peer to one number (RFC 8656 §11.2).
fn adopt_channels(
    alloc: &mut Allocation,
    recorded: &[ChannelRecord],
    snap: &Snapshot,
    clock: Clock,
    max: usize,
) {
    for channel in recorded {
        let peer = SocketAddr::new(unmapped_ip(channel.peer.ip()), channel.peer.port());
        if alloc.channels.len() >= max
            || !CHANNEL_NUMBERS.contains(&channel.number)
            || alloc
                .channels
                .iter()
                .any(|c| c.number == channel.number || c.peer == peer)
            || !permitted(alloc, snap, peer.ip())
        {
            continue;
        }
        if let Some(at) = clock.live(channel.expires_at_ns, CHANNEL_LIFETIME) {
            alloc.channels.push(Channel::new(channel.number, peer, at));
        }
    }
}

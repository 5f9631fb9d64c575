//! What the engine tells a kernel offload (the shell's `io/offload`): which allocations changed
//! in a way that changes what the kernel may relay for them ([`OffloadChange`], queued by
//! [`OffloadChanges`] until the shell polls them), the channels it may relay
//! ([`OffloadChannel`]) and a permission as the kernel holds it ([`OffloadPermission`]). The
//! engine stays the authority: the kernel relays only what these say, until the instants they
//! carry.

use super::contract::{Family, ListenerId, RelayId};
use super::store::{Allocation, AllocationStore};
use std::collections::VecDeque;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use uturn_shared::snapshot::{ClusterId, Snapshot};

/// What changed of an allocation that the kernel offload may relay for, each as its IPv4
/// relay socket (the kernel relays IPv4 only), for the shell to carry out: each costs the
/// shell work in proportion to what changed, never to how many channels the allocation holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadChange {
    /// Its end moved (a Refresh): one word in the kernel
    /// ([`super::Engine::offload_deadline`]).
    Deadline(RelayId),
    /// Channel `number` was bound, or bound again: its entry now
    /// ([`super::Engine::offload_channel`]).
    Channel(RelayId, u16),
    /// The permission for a peer IP was installed or refreshed: one word in the kernel
    /// ([`super::Engine::offload_permission`]).
    Permission(RelayId, IpAddr),
    /// Anything may have changed (a new snapshot, the client's flow moved to or from a
    /// sibling pod): every channel, now ([`super::Engine::offload_channels`]).
    All(RelayId),
}

/// A channel the kernel may relay: bound, its permission live, its peer admitted by the
/// running snapshot, its client not reached through a sibling pod, until `expires_at` and
/// `permission_expires_at` (the allocation's own end is [`super::Engine::offload_deadline`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadChannel {
    /// The listener the client talks to.
    pub listener: ListenerId,
    /// The client's address.
    pub client: SocketAddr,
    /// The channel number.
    pub number: u16,
    /// The peer bound to it.
    pub peer: SocketAddr,
    /// When the channel ends unless bound again.
    pub expires_at: Instant,
    /// When its permission ends unless refreshed.
    pub permission_expires_at: Instant,
    /// The cluster that admitted the peer.
    pub cluster: ClusterId,
}

/// A live permission of an allocation the kernel may relay for, as the kernel holds it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OffloadPermission {
    /// When it ends unless refreshed.
    pub expires_at: Instant,
    /// How many live channels are bound to its peer.
    pub bound_channels: usize,
}

impl OffloadPermission {
    /// The permission of `alloc` for peer `ip` at `now`, if live and the kernel may relay for
    /// the allocation (its client comes straight, not through a sibling pod).
    pub(super) fn of(alloc: &Allocation, ip: IpAddr, now: Instant) -> Option<OffloadPermission> {
        if alloc.via.is_some() {
            return None;
        }
        let expires_at = alloc
            .permissions
            .iter()
            .find(|p| p.ip == ip && p.expires_at > now)?
            .expires_at;
        let bound_channels = alloc
            .channels
            .iter()
            .filter(|c| c.peer.ip() == ip && c.expires_at > now)
            .count();
        Some(OffloadPermission {
            expires_at,
            bound_channels,
        })
    }
}

/// The changes waiting for the shell, in the order they happened, each once while it waits;
/// nothing is recorded until the offload is enabled.
#[derive(Default)]
pub(super) struct OffloadChanges {
    queue: Option<VecDeque<OffloadChange>>,
}

impl OffloadChanges {
    /// From now on, changes are recorded (and `store` records its clients' path changes).
    pub(super) fn enable(&mut self, store: &mut AllocationStore) {
        self.queue.get_or_insert_with(Default::default);
        store.record_path_changes();
    }

    /// Records `change` (once while it waits).
    pub(super) fn note(&mut self, change: OffloadChange) {
        if let Some(queue) = self.queue.as_mut() {
            if !queue.contains(&change) {
                queue.push_back(change);
            }
        }
    }

    /// The next change (the engine adds the allocations whose client moved between straight
    /// and forwarded first, as [`OffloadChange::All`]).
    pub(super) fn poll(&mut self) -> Option<OffloadChange> {
        self.queue.as_mut()?.pop_front()
    }

    /// Replaces what waits with every allocation of `store` that has channels, whole.
    pub(super) fn recheck(&mut self, store: &AllocationStore) {
        if let Some(queue) = self.queue.as_mut() {
            queue.clear();
            queue.extend(
                store
                    .with_channels()
                    .map(|slot| OffloadChange::All(RelayId::new(slot, Family::V4))),
            );
        }
    }
}

/// The channels of the allocation of `relay` in `store` that the kernel may relay at `now`
/// under `snap`: none if it ended, or its client comes through a sibling pod (what goes to
/// that client must go back through the sibling, which only user space does).
pub(super) fn channels(
    store: &mut AllocationStore,
    relay: RelayId,
    snap: &Snapshot,
    now: Instant,
) -> Vec<OffloadChannel> {
    match store.get_mut(relay.slot()) {
        Some(alloc) if alloc.via.is_none() => alloc.offload_channels(snap, now),
        _ => Vec::new(),
    }
}

/// Channel `number` of the allocation of `relay`, if the kernel may relay it (as
/// [`channels`]).
pub(super) fn channel(
    store: &mut AllocationStore,
    relay: RelayId,
    number: u16,
    snap: &Snapshot,
    now: Instant,
) -> Option<OffloadChannel> {
    match store.get_mut(relay.slot()) {
        Some(alloc) if alloc.via.is_none() => alloc.offload_channel(number, snap, now),
        _ => None,
    }
}

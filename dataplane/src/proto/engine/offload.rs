//! What the kernel offload reads of the [`Engine`]'s allocations ([`crate::proto::offload`]
//! says what each means), and the queue of what changed of them.

use super::Engine;
use crate::proto::contract::{Family, RelayId};
use crate::proto::offload::{self, OffloadChange, OffloadChannel, OffloadPermission};
use std::net::IpAddr;
use std::time::Instant;
use uturn_shared::snapshot::Snapshot;

impl Engine {
    /// Tells the engine that a kernel offload relays channels: from now on it records what
    /// changed of each allocation ([`Engine::poll_offload`]).
    pub fn enable_offload(&mut self) {
        self.offload.enable(&mut self.allocations);
    }

    /// The next change to an allocation the kernel may relay for (a ChannelBind,
    /// CreatePermission or Refresh on it, its client's flow moving to or from a sibling), in
    /// the order they happened. An ended allocation (or relay) is reported by
    /// [`Engine::poll_close`] instead.
    pub fn poll_offload(&mut self) -> Option<OffloadChange> {
        self.route_path_changes();
        self.offload.poll()
    }

    /// Reports every allocation with channels through [`Engine::poll_offload`] as
    /// [`OffloadChange::All`]: the shell calls it when the snapshot changes, which may admit
    /// or deny peers.
    pub fn recheck_offload(&mut self) {
        self.offload.recheck(&self.allocations);
    }

    /// The channels of the allocation of relay socket `relay` that the kernel may relay at
    /// `now` under `snap` (none if the allocation ended, or its client comes through a
    /// sibling pod: what goes to that client must go back through the sibling, which only
    /// user space does).
    pub fn offload_channels(
        &mut self,
        relay: RelayId,
        snap: &Snapshot,
        now: Instant,
    ) -> Vec<OffloadChannel> {
        offload::channels(&mut self.allocations, relay, snap, now)
    }

    /// Channel `number` of the allocation of `relay`, if the kernel may relay it at `now`
    /// under `snap` (as [`Engine::offload_channels`]).
    pub fn offload_channel(
        &mut self,
        relay: RelayId,
        number: u16,
        snap: &Snapshot,
        now: Instant,
    ) -> Option<OffloadChannel> {
        offload::channel(&mut self.allocations, relay, number, snap, now)
    }

    /// When the allocation of `relay` ends, unless refreshed.
    pub fn offload_deadline(&self, relay: RelayId) -> Option<Instant> {
        self.allocations.get(relay.slot()).map(|a| a.expires_at)
    }

    /// The live permission of the allocation of `relay` for peer `ip` (none if the allocation
    /// ended, or its client comes through a sibling pod).
    pub fn offload_permission(
        &self,
        relay: RelayId,
        ip: IpAddr,
        now: Instant,
    ) -> Option<OffloadPermission> {
        OffloadPermission::of(self.allocations.get(relay.slot())?, ip, now)
    }

    /// Hands the slots whose client moved between straight and forwarded to the queues that
    /// follow them: the offload's (every channel of the allocation) and the journal's.
    pub(super) fn route_path_changes(&mut self) {
        for slot in self.allocations.take_path_changes() {
            self.offload
                .note(OffloadChange::All(RelayId::new(slot, Family::V4)));
            self.persist.changed(&self.allocations, slot);
        }
    }
}

//! What the kernel should hold for one shard's allocations, as a pure state machine: it takes
//! what the engine says of an allocation (its offloadable channels, one channel, its end, a
//! permission's end) with the time passed in, and answers with the map operations ([`Op`])
//! that make the kernel hold exactly that; [`super::table::OffloadTable`] carries them out. No
//! BPF here: the tests run on a virtual clock.
//!
//! The cost of a request stays in proportion to what it changed, never to the channels an
//! allocation holds: a new channel is one entry pair, a Refresh one deadline word (the
//! allocation's), a CreatePermission one word per peer IP it names (each permission's: the
//! entries name both deadline slots, so every channel under them follows). An extension is
//! written at once only when the kernel's end is near ([`EXTEND_AT_SYNC`]), else at the next
//! sync: a client refreshing as fast as it likes costs at most one write per word per sync.
//! Anything that ends earlier is written at once: the kernel never relays past what admitted a
//! channel.

use super::maps::{EntrySpec, Relayed};
use crate::proto::{ListenerId, RelayId};
use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::time::{Duration, Instant};
use uturn_shared::snapshot::ClusterId;

/// An end further than this away is extended at the next sync rather than at once.
pub(crate) const EXTEND_AT_SYNC: Duration = Duration::from_secs(3);

/// A channel as the engine offers it, its addresses resolved: the entry pair to hold (its
/// deadline slots are filled in here) and what its counts are booked to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wanted {
    pub spec: EntrySpec,
    pub listener: ListenerId,
    pub cluster: ClusterId,
    /// The engine's end of the channel (the kernel's may lag behind while an extension waits).
    pub expires_at: Instant,
    /// The engine's end of the channel's permission.
    pub permission_expires_at: Instant,
}

/// An entry pair held in the kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Held {
    /// As the kernel has it.
    pub spec: EntrySpec,
    pub listener: ListenerId,
    pub cluster: ClusterId,
    /// The engine's end of the channel.
    pub expires_at: Instant,
    /// The kernel's counters as last read.
    pub seen_out: Relayed,
    pub seen_in: Relayed,
}

/// One map operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Op {
    /// Deadline slot `slot` (an allocation's or a permission's) ends at `ns`
    /// (CLOCK_MONOTONIC; 0: ended); written before the first entry that names it.
    Deadline { slot: u32, ns: u64 },
    /// A new entry pair, counters zero.
    Install(EntrySpec),
    /// New values under the same keys, the kernel's counters kept.
    Update(EntrySpec),
    /// The entry pair goes (read its counters first: they are booked to `held`).
    Remove(Held),
    /// Deadline slot `slot` names nothing any more: it is free.
    Free { slot: u32 },
}

/// `at` as CLOCK_MONOTONIC nanoseconds, given that clock's reading `epoch_ns` at `epoch`.
fn monotonic_ns_at(epoch: Instant, epoch_ns: u64, at: Instant) -> u64 {
    match at.checked_duration_since(epoch) {
        Some(after) => epoch_ns + after.as_nanos() as u64,
        None => epoch_ns.saturating_sub(epoch.duration_since(at).as_nanos() as u64),
    }
}

/// A deadline word: its slot, the engine's end and the kernel's.
#[derive(Debug, Clone, Copy)]
struct Word {
    slot: u32,
    end: Instant,
    written_ns: u64,
}

impl Word {
    fn new(slot: u32, end: Instant, end_ns: u64, ops: &mut Vec<Op>) -> Word {
        ops.push(Op::Deadline { slot, ns: end_ns });
        Word {
            slot,
            end,
            written_ns: end_ns,
        }
    }

    /// The engine's end is `end` now: written at once if it moved earlier, or later with the
    /// kernel's end near (`near`); else at the next sync.
    fn set(&mut self, end: Instant, end_ns: u64, near: u64, ops: &mut Vec<Op>) {
        self.end = end;
        let kernel = self.written_ns;
        if end_ns < kernel || (end_ns > kernel && kernel <= near) {
            self.write(end_ns, ops);
        }
    }

    fn write(&mut self, ns: u64, ops: &mut Vec<Op>) {
        self.written_ns = ns;
        ops.push(Op::Deadline {
            slot: self.slot,
            ns,
        });
    }

    /// The slot goes: zeroed, then free.
    fn release(self, ops: &mut Vec<Op>) {
        ops.push(Op::Deadline {
            slot: self.slot,
            ns: 0,
        });
        ops.push(Op::Free { slot: self.slot });
    }
}

/// A permission with held channels: its deadline word and how many it covers.
#[derive(Debug, Clone, Copy)]
struct Permission {
    word: Word,
    channels: usize,
}

struct Allocation {
    word: Word,
    permissions: HashMap<Ipv4Addr, Permission>,
    channels: HashMap<u16, Held>,
}

impl Allocation {
    /// `held` goes: removed from the kernel, its permission released with the last channel
    /// under it.
    fn remove(&mut self, held: Held, ops: &mut Vec<Op>) {
        ops.push(Op::Remove(held));
        let ip = *held.spec.peer.ip();
        if let Some(permission) = self.permissions.get_mut(&ip) {
            permission.channels = permission.channels.saturating_sub(1);
            if permission.channels == 0 {
                if let Some(gone) = self.permissions.remove(&ip) {
                    gone.word.release(ops);
                }
            }
        }
    }
}

/// The entries of a shard's allocations.
pub(crate) struct Entries {
    by_relay: HashMap<RelayId, Allocation>,
    /// Allocations whose channels the shell should offer again at the next sync (channels to
    /// a permission's peer that are not held: after a permission lapsed and came back, or an
    /// install the kernel refused).
    dirty: Vec<RelayId>,
    /// CLOCK_MONOTONIC nanoseconds at `epoch`.
    epoch: Instant,
    epoch_ns: u64,
}

impl Entries {
    /// No entries; `epoch_ns` is CLOCK_MONOTONIC at `epoch` (what `Instant`s are converted by).
    pub(crate) fn new(epoch: Instant, epoch_ns: u64) -> Entries {
        Entries {
            by_relay: HashMap::new(),
            dirty: Vec::new(),
            epoch,
            epoch_ns,
        }
    }

    /// `at` as CLOCK_MONOTONIC nanoseconds.
    pub(crate) fn ns(&self, at: Instant) -> u64 {
        monotonic_ns_at(self.epoch, self.epoch_ns, at)
    }

    /// Makes allocation `relay` hold exactly `wanted` (one per channel number), its end at
    /// `deadline`. `new_slot` gives a deadline slot (for an allocation or a permission that
    /// has none yet; `None`: none free, and those channels stay in user space).
    pub(crate) fn set_all(
        &mut self,
        relay: RelayId,
        wanted: &[Wanted],
        deadline: Instant,
        now: Instant,
        new_slot: &mut dyn FnMut() -> Option<u32>,
        ops: &mut Vec<Op>,
    ) {
        let mut keep: Vec<u16> = wanted.iter().map(|w| w.spec.channel).collect();
        keep.sort_unstable();
        if let Some(allocation) = self.by_relay.get_mut(&relay) {
            let gone: Vec<u16> = allocation
                .channels
                .keys()
                .copied()
                .filter(|n| keep.binary_search(n).is_err())
                .collect();
            for number in gone {
                if let Some(held) = allocation.channels.remove(&number) {
                    allocation.remove(held, ops);
                }
            }
        }
        for want in wanted {
            self.set_one(relay, *want, deadline, now, new_slot, ops);
        }
        self.release_if_empty(relay, ops);
    }

    /// Makes channel `want.spec.channel` of allocation `relay` held as `want`, the
    /// allocation's end at `deadline` (as [`Entries::set_all`], for one channel).
    pub(crate) fn set_channel(
        &mut self,
        relay: RelayId,
        want: Wanted,
        deadline: Instant,
        now: Instant,
        new_slot: &mut dyn FnMut() -> Option<u32>,
        ops: &mut Vec<Op>,
    ) {
        self.set_one(relay, want, deadline, now, new_slot, ops);
        self.release_if_empty(relay, ops);
    }

    /// Channel `number` of allocation `relay` is not held (any more); what is left with
    /// nothing held gives its deadline slots back.
    pub(crate) fn unset_channel(&mut self, relay: RelayId, number: u16, ops: &mut Vec<Op>) {
        if let Some(allocation) = self.by_relay.get_mut(&relay) {
            if let Some(held) = allocation.channels.remove(&number) {
                allocation.remove(held, ops);
            }
        }
        self.release_if_empty(relay, ops);
    }

    /// Makes channel `want.spec.channel` of allocation `relay` held as `want`; the caller
    /// releases what is left with nothing held.
    fn set_one(
        &mut self,
        relay: RelayId,
        mut want: Wanted,
        deadline: Instant,
        now: Instant,
        new_slot: &mut dyn FnMut() -> Option<u32>,
        ops: &mut Vec<Op>,
    ) {
        let number = want.spec.channel;
        let (deadline_ns, near) = (self.ns(deadline), self.ns(now + EXTEND_AT_SYNC));
        let permission_ns = self.ns(want.permission_expires_at);
        let allocation = match self.by_relay.entry(relay) {
            std::collections::hash_map::Entry::Occupied(slot) => slot.into_mut(),
            std::collections::hash_map::Entry::Vacant(vacant) => {
                let Some(slot) = new_slot() else {
                    return;
                };
                vacant.insert(Allocation {
                    word: Word::new(slot, deadline, deadline_ns, ops),
                    permissions: HashMap::new(),
                    channels: HashMap::new(),
                })
            }
        };
        allocation.word.set(deadline, deadline_ns, near, ops);
        let ip = *want.spec.peer.ip();
        let perm = match allocation.permissions.get_mut(&ip) {
            Some(permission) => {
                permission
                    .word
                    .set(want.permission_expires_at, permission_ns, near, ops);
                permission.word.slot
            }
            None => {
                let Some(slot) = new_slot() else {
                    // No word for the permission: the channel stays in user space.
                    if let Some(held) = allocation.channels.remove(&number) {
                        allocation.remove(held, ops);
                    }
                    return;
                };
                let word = Word::new(slot, want.permission_expires_at, permission_ns, ops);
                allocation
                    .permissions
                    .insert(ip, Permission { word, channels: 0 });
                slot
            }
        };
        want.spec.alloc = allocation.word.slot;
        want.spec.perm = perm;
        let wanted_ns = want.spec.expires_ns;
        match allocation.channels.get(&number).copied() {
            Some(held) if held.spec.same_keys(&want.spec) && held.spec.perm == perm => {
                let kernel = held.spec.expires_ns;
                // An end that moves earlier is written now; a later one now only if the
                // kernel's is near, else at the next sync.
                let extend_now = wanted_ns < kernel || kernel <= near;
                let spec = EntrySpec {
                    expires_ns: if extend_now { wanted_ns } else { kernel },
                    ..want.spec
                };
                let entry = allocation.channels.get_mut(&number).expect("held");
                entry.expires_at = want.expires_at;
                entry.listener = want.listener;
                entry.cluster = want.cluster;
                if spec != entry.spec {
                    entry.spec = spec;
                    ops.push(Op::Update(spec));
                }
            }
            Some(held) => {
                // Other keys (the route to the client or the peer changed) or another peer:
                // the old pair goes first, so that the new one is never deleted under the
                // same keys.
                allocation.channels.remove(&number);
                // The new channel counts under its permission before the old one's release,
                // which may be the same permission.
                Self::count_in(allocation, ip);
                allocation.remove(held, ops);
                allocation.channels.insert(number, Self::fresh(want));
                ops.push(Op::Install(want.spec));
            }
            None => {
                Self::count_in(allocation, ip);
                allocation.channels.insert(number, Self::fresh(want));
                ops.push(Op::Install(want.spec));
            }
        }
    }

    fn count_in(allocation: &mut Allocation, ip: Ipv4Addr) {
        if let Some(permission) = allocation.permissions.get_mut(&ip) {
            permission.channels += 1;
        }
    }

    fn fresh(want: Wanted) -> Held {
        Held {
            spec: want.spec,
            listener: want.listener,
            cluster: want.cluster,
            expires_at: want.expires_at,
            seen_out: Relayed::default(),
            seen_in: Relayed::default(),
        }
    }

    /// Allocation `relay` ends at `deadline` (a Refresh): at most one word written.
    pub(crate) fn set_deadline(
        &mut self,
        relay: RelayId,
        deadline: Instant,
        now: Instant,
        ops: &mut Vec<Op>,
    ) {
        let (deadline_ns, near) = (self.ns(deadline), self.ns(now + EXTEND_AT_SYNC));
        if let Some(allocation) = self.by_relay.get_mut(&relay) {
            allocation.word.set(deadline, deadline_ns, near, ops);
        }
    }

    /// The permission of allocation `relay` for peer `ip` ends at `end` (a CreatePermission or
    /// a ChannelBind refreshed it), and `bound` channels are bound to that peer: at most one
    /// word written. Whether fewer channels to the peer are held than are bound (the
    /// permission had lapsed, and its channels went): then the shell offers them.
    #[must_use]
    pub(crate) fn set_permission(
        &mut self,
        relay: RelayId,
        ip: Ipv4Addr,
        end: Instant,
        bound: usize,
        now: Instant,
        ops: &mut Vec<Op>,
    ) -> bool {
        let (end_ns, near) = (self.ns(end), self.ns(now + EXTEND_AT_SYNC));
        let held = match self
            .by_relay
            .get_mut(&relay)
            .and_then(|a| a.permissions.get_mut(&ip))
        {
            Some(permission) => {
                permission.word.set(end, end_ns, near, ops);
                permission.channels
            }
            None => 0,
        };
        bound > held
    }

    /// The kernel refused to install `spec` (its map is full): it is not held, and its
    /// allocation is offered again at the next sync; what is left with nothing held gives its
    /// deadline slot back.
    pub(crate) fn refused(&mut self, spec: &EntrySpec, ops: &mut Vec<Op>) {
        let Some((&relay, allocation)) = self
            .by_relay
            .iter_mut()
            .find(|(_, a)| a.word.slot == spec.alloc)
        else {
            return;
        };
        if allocation
            .channels
            .get(&spec.channel)
            .is_some_and(|held| held.spec == *spec)
        {
            if let Some(held) = allocation.channels.remove(&spec.channel) {
                allocation.remove(held, ops);
            }
            // Its pair is not in the kernel: nothing to remove there.
            ops.retain(|op| !matches!(op, Op::Remove(h) if h.spec == *spec));
        }
        self.mark(relay);
        self.release_if_empty(relay, ops);
    }

    /// Allocation `relay`'s channels are to be offered again at the next sync.
    pub(crate) fn mark(&mut self, relay: RelayId) {
        if !self.dirty.contains(&relay) {
            self.dirty.push(relay);
        }
    }

    /// Allocation `relay` ended: its entries go, then its deadline slots.
    pub(crate) fn forget(&mut self, relay: RelayId, ops: &mut Vec<Op>) {
        if let Some(allocation) = self.by_relay.remove(&relay) {
            ops.extend(allocation.channels.into_values().map(Op::Remove));
            for permission in allocation.permissions.into_values() {
                permission.word.release(ops);
            }
            allocation.word.release(ops);
        }
        self.dirty.retain(|r| *r != relay);
    }

    fn release_if_empty(&mut self, relay: RelayId, ops: &mut Vec<Op>) {
        if self
            .by_relay
            .get(&relay)
            .is_some_and(|a| a.channels.is_empty())
        {
            self.forget(relay, ops);
        }
    }

    /// The periodic pass: the extensions that waited are written, and the allocations to
    /// offer again are returned: those marked, and those with a channel or a permission whose
    /// end passed (the kernel stopped relaying it at its end already; the engine says
    /// whether it lives on).
    ///
    /// `want_macs` (XDP runs): an allocation with an entry toward another host that still
    /// lacks the next hop's MAC addresses is offered again too (the neighbour table may have
    /// them by now; XDP sends only entries that have them).
    pub(crate) fn sync(
        &mut self,
        now: Instant,
        want_macs: bool,
        ops: &mut Vec<Op>,
    ) -> Vec<RelayId> {
        let mut again = std::mem::take(&mut self.dirty);
        let (epoch, epoch_ns) = (self.epoch, self.epoch_ns);
        let ns = |at: Instant| monotonic_ns_at(epoch, epoch_ns, at);
        for (relay, allocation) in &mut self.by_relay {
            let words = std::iter::once(&mut allocation.word)
                .chain(allocation.permissions.values_mut().map(|p| &mut p.word));
            let mut ended = false;
            for word in words {
                let end_ns = ns(word.end);
                if end_ns != word.written_ns {
                    word.write(end_ns, ops);
                }
                ended |= word.end <= now;
            }
            for held in allocation.channels.values_mut() {
                let wanted_ns = ns(held.expires_at);
                if wanted_ns > held.spec.expires_ns {
                    held.spec.expires_ns = wanted_ns;
                    ops.push(Op::Update(held.spec));
                }
                ended |= held.expires_at <= now;
                ended |= want_macs
                    && ((held.spec.peer_ifindex != 0 && held.spec.peer_macs.is_none())
                        || (held.spec.client_ifindex != 0 && held.spec.client_macs.is_none()));
            }
            if ended && !again.contains(relay) {
                again.push(*relay);
            }
        }
        again
    }

    /// Every entry pair held, for reading their counters.
    pub(crate) fn held_mut(&mut self) -> impl Iterator<Item = &mut Held> {
        self.by_relay
            .values_mut()
            .flat_map(|a| a.channels.values_mut())
    }

    /// Entry pairs held.
    pub(crate) fn len(&self) -> usize {
        self.by_relay.values().map(|a| a.channels.len()).sum()
    }
}

#[cfg(test)]
mod tests;

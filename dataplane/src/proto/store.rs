//! The allocation store: a shard's allocations, their permissions and channel bindings, and
//! the one lookup the hot path makes (client 5-tuple → allocation).
//!
//! An allocation lives in a slot whose index is part of its relay sockets' [`super::RelayId`]s: the
//! shell mirrors the slots with its relay sockets, so a peer datagram finds its allocation by
//! index, without a hash.

use super::contract::{DropReason, Family, ListenerId, RelayId};
use super::error::RequestError;
use super::PERMISSION_LIFETIME;
use foldhash::fast::RandomState;
use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use stun_proto::types::message::TransactionId;
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::{ClusterId, Snapshot};
use uturn_shared::status::ListenerAllocations;

/// A client's end of an allocation: the listener it came in on and its address (with the
/// listener's transport and address, the 5-tuple of RFC 8656 §2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct ClientKey {
    pub(super) listener: ListenerId,
    pub(super) client: SocketAddr,
}

/// foldhash, with `hash_one` inlined into each lookup. std's provided `hash_one` is not
/// `#[inline]`: instantiated once per crate, it can land in another codegen unit than the
/// per-packet lookup, which then pays a call for it (+0.6 ns of 18 on ChannelData in
/// `cargo bench --bench engine`).
#[derive(Clone, Default)]
struct ClientKeyHasher(RandomState);

impl BuildHasher for ClientKeyHasher {
    type Hasher = <RandomState as BuildHasher>::Hasher;

    #[inline]
    fn build_hasher(&self) -> Self::Hasher {
        self.0.build_hasher()
    }

    // What std's provided method does, but `#[inline]`: the point of this type.
    #[inline]
    #[allow(clippy::manual_hash_one)]
    fn hash_one<T: Hash>(&self, value: T) -> u64 {
        let mut hasher = self.0.build_hasher();
        value.hash(&mut hasher);
        hasher.finish()
    }
}

/// Which cluster admitted a peer, under which snapshot generation.
#[derive(Debug, Clone, Copy)]
struct ChannelVerdict {
    generation: u64,
    cluster: Option<ClusterId>,
}

/// Which cluster admitted a peer port, under which snapshot generation.
#[derive(Debug, Clone, Copy)]
struct PermissionVerdict {
    generation: u64,
    peer_port: u16,
    cluster: Option<ClusterId>,
}

/// RFC 8656 §9: a permission for a peer IP.
pub(super) struct Permission {
    pub(super) ip: IpAddr,
    pub(super) expires_at: Instant,
    /// Admission verdict for the last peer port seen.
    verdict: Option<PermissionVerdict>,
}

impl Permission {
    /// A permission for `ip` that expires at `expires_at`, judged by no snapshot yet.
    pub(super) fn new(ip: IpAddr, expires_at: Instant) -> Permission {
        Permission {
            ip,
            expires_at,
            verdict: None,
        }
    }
}

/// RFC 8656 §12: a channel bound to a peer address.
pub(super) struct Channel {
    pub(super) number: u16,
    /// The family of `peer`: of the relay socket its datagrams leave from.
    pub(super) family: Family,
    pub(super) peer: SocketAddr,
    pub(super) expires_at: Instant,
    /// Admission verdict for `peer`.
    verdict: Option<ChannelVerdict>,
}

impl Channel {
    /// Channel `number` bound to `peer` until `expires_at`, judged by no snapshot yet.
    pub(super) fn new(number: u16, peer: SocketAddr, expires_at: Instant) -> Channel {
        Channel {
            number,
            family: Family::of_canonical(peer),
            peer,
            expires_at,
            verdict: None,
        }
    }

    /// The cluster that admits the channel's peer from listener `listener_name`; the verdict
    /// is cached until the snapshot generation changes.
    #[inline]
    pub(super) fn admitted(&mut self, snap: &Snapshot, listener_name: &str) -> Option<ClusterId> {
        match self.verdict {
            Some(verdict) if verdict.generation == snap.generation => verdict.cluster,
            _ => self.judge(snap, listener_name),
        }
    }

    /// Judges the peer under `snap` and caches the verdict; once per channel and generation,
    /// so kept out of the per-packet path.
    #[cold]
    fn judge(&mut self, snap: &Snapshot, listener_name: &str) -> Option<ClusterId> {
        let cluster = snap
            .route(listener_name)
            .and_then(|r| snap.admits(r, self.peer));
        self.verdict = Some(ChannelVerdict {
            generation: snap.generation,
            cluster,
        });
        cluster
    }
}

/// `channel` of the allocation of `key` as the kernel may relay it at `now`, its permission
/// ending at `permission`: live and admitted by `snap`, until the first of the two ends.
fn offloadable(
    key: ClientKey,
    listener_name: &str,
    channel: &mut Channel,
    permission: Instant,
    snap: &Snapshot,
    now: Instant,
) -> Option<super::offload::OffloadChannel> {
    if channel.expires_at <= now || permission <= now {
        return None;
    }
    let cluster = channel.admitted(snap, listener_name)?;
    Some(super::offload::OffloadChannel {
        listener: key.listener,
        client: key.client,
        number: channel.number,
        peer: channel.peer,
        expires_at: channel.expires_at,
        permission_expires_at: permission,
        cluster,
    })
}

/// The families an allocation has a relay socket of: one, or both for a dual allocation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Families(u8);

impl Families {
    /// No family.
    pub(super) const NONE: Families = Families(0);

    /// `self` and `family`.
    pub(super) fn with(self, family: Family) -> Families {
        Families(self.0 | 1 << family as u8)
    }

    /// `self` without `family`.
    pub(super) fn without(self, family: Family) -> Families {
        Families(self.0 & !(1 << family as u8))
    }

    /// Whether `family` is in.
    #[inline]
    pub(super) fn contains(self, family: Family) -> bool {
        self.0 & 1 << family as u8 != 0
    }

    /// The families in, IPv4 first.
    pub(super) fn iter(self) -> impl Iterator<Item = Family> {
        Family::ALL.into_iter().filter(move |&f| self.contains(f))
    }
}

/// One allocation: its client, credentials, lifetime and the peers it may reach.
pub(super) struct Allocation {
    pub(super) key: ClientKey,
    pub(super) listener_name: String,
    /// The families of its relay sockets: a peer of another family is refused (443) and
    /// never reached.
    pub(super) families: Families,
    /// RFC 8656 DONT-FRAGMENT: its relay sockets set DF (kept for the record of it).
    pub(super) dont_fragment: bool,
    pub(super) username: String,
    /// Whose quota the allocation counts against.
    pub(super) user_id: String,
    pub(super) expires_at: Instant,
    pub(super) allocate_txid: TransactionId,
    pub(super) allocate_response: Vec<u8>,
    pub(super) permissions: Vec<Permission>,
    pub(super) channels: Vec<Channel>,
    /// The sibling pod the client's flow now reaches us through (second-chance forwarding):
    /// what goes to the client goes back through it. `None`: straight from our listener. The
    /// newest path wins: a datagram straight from the client, or through another sibling,
    /// replaces it.
    pub(super) via: Option<SocketAddr>,
    /// `via.is_some()`, kept beside the fields every datagram reads: the per-packet test.
    pub(super) forwarded: bool,
}

impl Allocation {
    /// Whether a live permission covers `peer`'s IP and a routed cluster admits `peer` (IP and
    /// port); the verdict is cached on the permission until the generation or the port changes.
    #[inline]
    pub(super) fn permission_admits(
        &mut self,
        snap: &Snapshot,
        peer: SocketAddr,
        now: Instant,
    ) -> Result<ClusterId, DropReason> {
        let listener_name = &self.listener_name;
        let Some(permission) = self
            .permissions
            .iter_mut()
            .find(|p| p.ip == peer.ip() && p.expires_at > now)
        else {
            return Err(DropReason::NoPermission);
        };
        let cluster = match permission.verdict {
            Some(verdict)
                if verdict.generation == snap.generation && verdict.peer_port == peer.port() =>
            {
                verdict.cluster
            }
            _ => {
                let cluster = snap.route(listener_name).and_then(|r| snap.admits(r, peer));
                permission.verdict = Some(PermissionVerdict {
                    generation: snap.generation,
                    peer_port: peer.port(),
                    cluster,
                });
                cluster
            }
        };
        cluster.ok_or(DropReason::NotAdmitted)
    }

    /// The channels the kernel may relay at `now`: live, with a live permission, admitted
    /// by `snap` (see [`super::offload::OffloadChannel`]). Linear in the channels and
    /// permissions together (the permissions are indexed once), never their product.
    pub(super) fn offload_channels(
        &mut self,
        snap: &Snapshot,
        now: Instant,
    ) -> Vec<super::offload::OffloadChannel> {
        let permissions: HashMap<IpAddr, Instant, RandomState> = self
            .permissions
            .iter()
            .filter(|p| p.expires_at > now)
            .map(|p| (p.ip, p.expires_at))
            .collect();
        let key = self.key;
        let listener_name = &self.listener_name;
        self.channels
            .iter_mut()
            .filter_map(|channel| {
                let permission = *permissions.get(&channel.peer.ip())?;
                offloadable(key, listener_name, channel, permission, snap, now)
            })
            .collect()
    }

    /// Channel `number`, if the kernel may relay it at `now` (as
    /// [`Allocation::offload_channels`]).
    pub(super) fn offload_channel(
        &mut self,
        number: u16,
        snap: &Snapshot,
        now: Instant,
    ) -> Option<super::offload::OffloadChannel> {
        let channel = self.channels.iter_mut().find(|c| c.number == number)?;
        let permission = self
            .permissions
            .iter()
            .find(|p| p.ip == channel.peer.ip() && p.expires_at > now)?
            .expires_at;
        offloadable(
            self.key,
            &self.listener_name,
            channel,
            permission,
            snap,
            now,
        )
    }

    /// Whether the allocation has a relay socket of `ip`'s family (RFC 8656 §9.2, §11.2: a peer
    /// of another family gets 443).
    pub(super) fn relays_to(&self, ip: IpAddr) -> bool {
        self.families.contains(Family::of(ip))
    }

    /// Removes the relay of `family` (a dual allocation's Refresh with LIFETIME 0 and that
    /// REQUESTED-ADDRESS-FAMILY) with the permissions and channels that went through it.
    pub(super) fn remove_family(&mut self, family: Family) {
        self.families = self.families.without(family);
        self.permissions.retain(|p| Family::of(p.ip) != family);
        self.channels
            .retain(|c| Family::of_canonical(c.peer) != family);
    }

    /// Installs or refreshes the permission for `ip`, within `max_permissions`.
    pub(super) fn install_permission(
        &mut self,
        ip: IpAddr,
        now: Instant,
        max_permissions: usize,
    ) -> Result<(), RequestError> {
        let ip = unmapped_ip(ip);
        if let Some(p) = self.permissions.iter_mut().find(|p| p.ip == ip) {
            p.expires_at = now + PERMISSION_LIFETIME;
            return Ok(());
        }
        self.permissions.retain(|p| p.expires_at > now);
        if self.permissions.len() >= max_permissions {
            return Err(RequestError::TooManyPermissions);
        }
        self.permissions
            .push(Permission::new(ip, now + PERMISSION_LIFETIME));
        Ok(())
    }
}

/// The allocations of one shard, in slots (the slot of a relay socket's [`super::RelayId`]).
pub(super) struct AllocationStore {
    slots: Vec<Option<Allocation>>,
    free_slots: Vec<u32>,
    by_client: HashMap<ClientKey, u32, ClientKeyHasher>,
    /// With a kernel offload: the slots whose client moved between straight and forwarded
    /// since the engine last asked (their kernel entries change).
    path_changes: Option<Vec<u32>>,
    /// Relay sockets the shell must close, drained by [`AllocationStore::poll_close`]; their
    /// slots stay taken until then.
    to_close: Vec<RelayId>,
}

impl AllocationStore {
    /// An empty store.
    pub(super) fn new() -> AllocationStore {
        AllocationStore {
            slots: Vec::new(),
            free_slots: Vec::new(),
            by_client: HashMap::with_hasher(ClientKeyHasher::default()),
            path_changes: None,
            to_close: Vec::new(),
        }
    }

    /// From now on, [`AllocationStore::note_path_change`] records.
    pub(super) fn record_path_changes(&mut self) {
        self.path_changes.get_or_insert_with(Vec::new);
    }

    /// The client of the allocation in `slot` moved between straight and forwarded (rare:
    /// once per move of a flow).
    #[cold]
    pub(super) fn note_path_change(&mut self, slot: u32) {
        if let Some(changes) = self.path_changes.as_mut() {
            if !changes.contains(&slot) {
                changes.push(slot);
            }
        }
    }

    /// The slots noted since the last call.
    pub(super) fn take_path_changes(&mut self) -> Vec<u32> {
        self.path_changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Live allocations.
    pub(super) fn len(&self) -> usize {
        self.by_client.len()
    }

    /// Every live allocation, once each.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Allocation> {
        self.by_client.values().filter_map(|&slot| self.get(slot))
    }

    /// Whether no allocation is live.
    pub(super) fn is_empty(&self) -> bool {
        self.by_client.is_empty()
    }

    /// The slot of `key`'s allocation.
    #[inline]
    pub(super) fn slot_of(&self, key: &ClientKey) -> Option<u32> {
        self.by_client.get(key).copied()
    }

    /// The allocation in `slot`.
    #[inline]
    pub(super) fn get(&self, slot: u32) -> Option<&Allocation> {
        self.slots.get(slot as usize).and_then(Option::as_ref)
    }

    /// The allocation in `slot`, to change.
    #[inline]
    pub(super) fn get_mut(&mut self, slot: u32) -> Option<&mut Allocation> {
        self.slots.get_mut(slot as usize).and_then(Option::as_mut)
    }

    /// A free slot for an allocation under way; give it back with
    /// [`AllocationStore::release_slot`] or fill it with [`AllocationStore::insert`].
    pub(super) fn reserve_slot(&mut self) -> u32 {
        match self.free_slots.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                (self.slots.len() - 1) as u32
            }
        }
    }

    /// Gives back a reserved slot that holds no allocation.
    pub(super) fn release_slot(&mut self, slot: u32) {
        self.free_slots.push(slot);
    }

    /// Puts `allocation` in its reserved slot.
    pub(super) fn insert(&mut self, slot: u32, allocation: Allocation) {
        self.by_client.insert(allocation.key, slot);
        self.slots[slot as usize] = Some(allocation);
    }

    /// Takes the allocation out of `slot`, and asks the shell to close its relay sockets. The
    /// slot stays taken until [`AllocationStore::poll_close`] has returned them: a relay socket
    /// is open until the shell closes it, and an id handed out again before that would have
    /// the shell close the new socket.
    pub(super) fn remove(&mut self, slot: u32) -> Option<Allocation> {
        let allocation = self.slots.get_mut(slot as usize)?.take()?;
        self.by_client.remove(&allocation.key);
        let relays = allocation.families.iter();
        self.to_close
            .extend(relays.map(|family| RelayId::new(slot, family)));
        Some(allocation)
    }

    /// Asks the shell to close relay socket `relay` (its slot is released once every socket
    /// of the slot is closed and no allocation holds it).
    pub(super) fn close(&mut self, relay: RelayId) {
        self.to_close.push(relay);
    }

    /// The next relay socket the shell must close; its slot is free again once no socket of
    /// it waits and no allocation holds it.
    pub(super) fn poll_close(&mut self) -> Option<RelayId> {
        let relay = self.to_close.pop()?;
        let slot = relay.slot();
        if self.get(slot).is_none() && !self.to_close.iter().any(|r| r.slot() == slot) {
            self.release_slot(slot);
        }
        Some(relay)
    }

    /// Live allocations by the name of the listener they were made on.
    pub(super) fn by_listener(&self) -> Vec<ListenerAllocations> {
        let mut counts: Vec<ListenerAllocations> = Vec::new();
        for alloc in self.iter() {
            match counts
                .iter_mut()
                .find(|counted| counted.listener == alloc.listener_name)
            {
                Some(counted) => counted.allocations += 1,
                None => counts.push(ListenerAllocations {
                    listener: alloc.listener_name.clone(),
                    allocations: 1,
                }),
            }
        }
        counts
    }

    /// The slots whose allocation expired by `now`.
    pub(super) fn expired(&self, now: Instant) -> Vec<u32> {
        self.by_client
            .values()
            .copied()
            .filter(|&slot| self.get(slot).is_none_or(|a| a.expires_at <= now))
            .collect()
    }

    /// The slots of the allocations made on `listener`.
    pub(super) fn on_listener(&self, listener: ListenerId) -> Vec<u32> {
        self.by_client
            .iter()
            .filter(|(key, _)| key.listener == listener)
            .map(|(_, &slot)| slot)
            .collect()
    }

    /// The slots of the allocations that have channels.
    pub(super) fn with_channels(&self) -> impl Iterator<Item = u32> + '_ {
        self.by_client
            .values()
            .copied()
            .filter(|&slot| self.get(slot).is_some_and(|a| !a.channels.is_empty()))
    }

    /// Drops the permissions and channels that expired by `now`.
    pub(super) fn expire_permissions_and_channels(&mut self, now: Instant) {
        for allocation in self.slots.iter_mut().flatten() {
            allocation.permissions.retain(|p| p.expires_at > now);
            allocation.channels.retain(|c| c.expires_at > now);
        }
    }
}

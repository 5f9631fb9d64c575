//! The data path (RFC 8656 §10-12): ChannelData and Send indications from clients to peers,
//! peer datagrams back to clients. No allocation and no log line per packet: one lookup of the
//! allocation, the channel or permission, and its cached admission verdict.
//!
//! Each function counts its own drops and returns the action itself, not a `Result` the
//! engine unpacks: the action is then written once, where the shell receives it, and never
//! read back. Through a `Result` the Relay action was written field by field and copied again
//! in wider loads, and checking a returned action for a drop read back what had just been
//! written: store-forwarding stalls that took ChannelData from 18 to 27 and then 19 ns in
//! `cargo bench --bench engine`.

use super::contract::{
    Arrival, Bytes, ClientAction, DropReason, EngineStats, Family, PeerAction, PeerArrival, RelayId,
};
use super::store::{Allocation, AllocationStore, ClientKey};
use super::wire;
use super::{CHANNEL_NUMBERS, PEER_HEADROOM};
use rand::rngs::StdRng;
use rand::Rng;
use std::net::SocketAddr;
use stun_proto::types::attribute::{Attribute, AttributeStaticType};
use stun_proto::types::message::{Message, TransactionId};
use turn_types::attribute::{Data, XorPeerAddress};
use uturn_shared::policy::unmapped_ip;

/// What the engine makes of a client datagram's [`super::ArrivalKind`]: the sibling it came
/// through, and whether a miss is handed to the shell. Two words, tested per packet.
#[derive(Debug, Clone, Copy)]
pub(super) struct Path {
    /// The sibling it came through.
    pub(super) via: Option<SocketAddr>,
    /// A datagram that finds no allocation is [`ClientAction::Miss`], not dropped or 437.
    pub(super) forward_misses: bool,
}

impl Path {
    /// What a datagram that needs an allocation and finds none gets.
    #[inline]
    pub(super) fn miss(self, stats: &mut EngineStats) -> ClientAction {
        if self.forward_misses {
            ClientAction::Miss
        } else {
            ClientAction::Drop(stats.count_drop(DropReason::NoAllocation))
        }
    }

    /// The allocation follows the newest path of its client; whether it moved between
    /// straight and forwarded (what the kernel offload may relay for it changes). Straight
    /// from the client (the per-packet case) this is one test of a flag that is almost always
    /// clear.
    #[inline(always)]
    #[must_use]
    pub(super) fn follow(self, alloc: &mut Allocation) -> bool {
        match self.via {
            None => {
                if alloc.forwarded {
                    alloc.forwarded = false;
                    alloc.via = None;
                    return true;
                }
                false
            }
            Some(via) => {
                let moved = !alloc.forwarded;
                alloc.forwarded = true;
                alloc.via = Some(via);
                moved
            }
        }
    }
}

/// ChannelData as it arrived (RFC 8656 §12.4): the peer and the payload's range.
// Inlined into the engine's one call site, so the action is written where the shell gets it.
#[inline(always)]
pub(super) fn channel_data(
    store: &mut AllocationStore,
    stats: &mut EngineStats,
    arrival: &Arrival<'_>,
    path: Path,
    data: &[u8],
) -> ClientAction {
    if data.len() < 4 {
        return ClientAction::Drop(stats.count_drop(DropReason::Malformed));
    }
    let number = u16::from_be_bytes([data[0], data[1]]);
    let length = usize::from(u16::from_be_bytes([data[2], data[3]]));
    // RFC 8656 §12.5: over UDP the datagram may carry padding after `length` bytes.
    if !CHANNEL_NUMBERS.contains(&number) || 4 + length > data.len() {
        return ClientAction::Drop(stats.count_drop(DropReason::Malformed));
    }
    let key = ClientKey {
        listener: arrival.listener.id,
        client: arrival.client,
    };
    let Some(slot) = store.slot_of(&key) else {
        return path.miss(stats);
    };
    let Some(mut alloc) = store.get_mut(slot) else {
        return ClientAction::Drop(stats.count_drop(DropReason::Internal));
    };
    if path.follow(alloc) {
        store.note_path_change(slot);
        let Some(again) = store.get_mut(slot) else {
            return ClientAction::Drop(stats.count_drop(DropReason::Internal));
        };
        alloc = again;
    }
    let Some(channel) = alloc
        .channels
        .iter_mut()
        .find(|c| c.number == number && c.expires_at > arrival.now)
    else {
        return ClientAction::Drop(stats.count_drop(DropReason::NoChannel));
    };
    let (peer, family) = (channel.peer, channel.family);
    let Some(cluster) = channel.admitted(arrival.snap, &alloc.listener_name) else {
        return ClientAction::Drop(stats.count_drop(DropReason::NotAdmitted));
    };
    ClientAction::Relay {
        // A channel's peer is of a family the allocation relays (ChannelBind checked it, and
        // a relay deleted took its channels with it).
        relay: RelayId::new(slot, family),
        peer,
        payload: 4..4 + length,
        cluster,
    }
}

/// A Send indication as it arrived (RFC 8656 §10.2): the peer and the DATA attribute's range.
pub(super) fn send_indication(
    store: &mut AllocationStore,
    stats: &mut EngineStats,
    arrival: &Arrival<'_>,
    path: Path,
    msg: &Message<'_>,
) -> ClientAction {
    let key = ClientKey {
        listener: arrival.listener.id,
        client: arrival.client,
    };
    let Some(slot) = store.slot_of(&key) else {
        return path.miss(stats);
    };
    let Some(mut alloc) = store.get_mut(slot) else {
        return ClientAction::Drop(stats.count_drop(DropReason::Internal));
    };
    if path.follow(alloc) {
        store.note_path_change(slot);
        let Some(again) = store.get_mut(slot) else {
            return ClientAction::Drop(stats.count_drop(DropReason::Internal));
        };
        alloc = again;
    }
    let (Ok(peer), Some((offset, data))) = (
        msg.attribute::<XorPeerAddress>(),
        msg.raw_attribute_and_offset(Data::TYPE),
    ) else {
        return ClientAction::Drop(stats.count_drop(DropReason::Malformed));
    };
    let peer = peer.addr(msg.transaction_id());
    let peer = SocketAddr::new(unmapped_ip(peer.ip()), peer.port());
    // RFC 8656 §10.2: relayed only with a permission for the peer's IP (and, here, only
    // to a peer address a routed cluster admits).
    let cluster = match alloc.permission_admits(arrival.snap, peer, arrival.now) {
        Ok(cluster) => cluster,
        Err(reason) => return ClientAction::Drop(stats.count_drop(reason)),
    };
    let start = offset + 4;
    ClientAction::Relay {
        // A permission is only held for a family the allocation relays.
        relay: RelayId::new(slot, Family::of_canonical(peer)),
        peer,
        payload: start..start + data.length() as usize,
        cluster,
    }
}

/// A datagram a peer sent to `alloc`'s relay socket, its payload in `buf[PEER_HEADROOM..]`:
/// framed as ChannelData in place, or as a Data indication in `out` (RFC 8656 §10.3, §12.5),
/// its transaction id drawn from `indication_txids`.
// Inlined into the engine's one call site, so the action is written where the shell gets it.
#[inline(always)]
pub(super) fn peer_datagram(
    alloc: &mut Allocation,
    stats: &mut EngineStats,
    indication_txids: &mut StdRng,
    arrival: &PeerArrival<'_>,
    buf: &mut [u8],
    out: &mut [u8],
) -> PeerAction {
    let (now, snap) = (arrival.now, arrival.snap);
    let len = buf.len().saturating_sub(PEER_HEADROOM);
    let peer = SocketAddr::new(unmapped_ip(arrival.peer.ip()), arrival.peer.port());
    let listener = alloc.key.listener;
    let client = alloc.key.client;
    let forwarded = alloc.forwarded;
    if len > usize::from(u16::MAX) || buf.len() < PEER_HEADROOM + len {
        return PeerAction::Drop(stats.count_drop(DropReason::Malformed));
    }
    if let Some(channel) = alloc
        .channels
        .iter_mut()
        .find(|c| c.peer == peer && c.expires_at > now)
    {
        let Some(cluster) = channel.admitted(snap, &alloc.listener_name) else {
            return PeerAction::Drop(stats.count_drop(DropReason::NotAdmitted));
        };
        // RFC 8656 §12.5: channel number, then length, then the payload.
        buf[..2].copy_from_slice(&channel.number.to_be_bytes());
        buf[2..4].copy_from_slice(&(len as u16).to_be_bytes());
        return PeerAction::ToClient {
            forwarded,
            listener,
            client,
            bytes: Bytes::Input(0..PEER_HEADROOM + len),
            cluster,
            payload_len: len,
        };
    }
    // RFC 8656 §10.3: without a channel, a permission is needed, and a Data indication
    // carries the datagram.
    let cluster = match alloc.permission_admits(snap, peer, now) {
        Ok(cluster) => cluster,
        Err(reason) => return PeerAction::Drop(stats.count_drop(reason)),
    };
    // RFC 8489 §6: a transaction id is uniformly random; 96 of the generator's bits.
    let txid = TransactionId::from(indication_txids.gen::<u128>() >> 32);
    match wire::data_indication(txid, peer, &buf[PEER_HEADROOM..PEER_HEADROOM + len], out) {
        Some(n) => PeerAction::ToClient {
            forwarded,
            listener,
            client,
            bytes: Bytes::Output(n),
            cluster,
            payload_len: len,
        },
        None => PeerAction::Drop(stats.count_drop(DropReason::Internal)),
    }
}

//! The CreatePermission and ChannelBind requests (RFC 8656 §9, §11): which peers an
//! allocation may reach, judged against the peer policy of the running snapshot.

use super::error::RequestError;
use super::ratelimit::LogLimiter;
use super::store::{Allocation, Channel, Permission};
use super::{CHANNEL_LIFETIME, CHANNEL_NUMBERS, PERMISSION_LIFETIME};
use foldhash::fast::RandomState;
use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Instant;
use stun_proto::types::attribute::{Attribute, AttributeFromRaw, AttributeStaticType};
use stun_proto::types::message::Message;
use turn_types::attribute::{ChannelNumber, XorPeerAddress};
use uturn_shared::policy::unmapped_ip;
use uturn_shared::snapshot::Snapshot;

/// Installs or refreshes a permission for every peer IP the CreatePermission `msg` names, or
/// none of them (RFC 8656 §9.2).
pub(super) fn create_permission(
    alloc: &mut Allocation,
    msg: &Message<'_>,
    snap: &Snapshot,
    now: Instant,
    max_permissions: usize,
    denial_log: &mut LogLimiter,
) -> Result<Vec<IpAddr>, RequestError> {
    alloc.permissions.retain(|p| p.expires_at > now);
    let route = snap.route(&alloc.listener_name);
    let mut named = {
        let alloc = &*alloc;
        named_peers(msg, &alloc.permissions, max_permissions, |ip| {
            if !alloc.relays_to(ip) {
                return Err(RequestError::PeerFamilyMismatch);
            }
            // stunnerd: the peer IP must lie in a cluster routed from the listener; the RFC's
            // answer for a policy denial is 403. Any denied peer fails the whole request.
            if !route.is_some_and(|r| snap.permits_ip(r, ip)) {
                return Err(denied(denial_log, now, alloc, ip, snap));
            }
            Ok(())
        })?
    };
    // The whole request fits: refresh the held permissions it names, install the others.
    let mut refreshed = Vec::with_capacity(named.len());
    for permission in &mut alloc.permissions {
        if named.remove(&permission.ip) {
            permission.expires_at = now + PERMISSION_LIFETIME;
            refreshed.push(permission.ip);
        }
    }
    refreshed.extend(named.iter().copied());
    alloc.permissions.extend(
        named
            .into_iter()
            .map(|ip| Permission::new(ip, now + PERMISSION_LIFETIME)),
    );
    Ok(refreshed)
}

/// Binds (or refreshes) the channel the ChannelBind `msg` names, with the permission for its
/// peer (RFC 8656 §11.2).
pub(super) fn channel_bind(
    alloc: &mut Allocation,
    msg: &Message<'_>,
    snap: &Snapshot,
    now: Instant,
    max_permissions: usize,
    denial_log: &mut LogLimiter,
) -> Result<(u16, IpAddr), RequestError> {
    let (Ok(number), Ok(peer)) = (
        msg.attribute::<ChannelNumber>(),
        msg.attribute::<XorPeerAddress>(),
    ) else {
        return Err(RequestError::MissingChannelBindAttributes);
    };
    let number = number.channel();
    let peer = peer.addr(msg.transaction_id());
    let peer = SocketAddr::new(unmapped_ip(peer.ip()), peer.port());
    // RFC 8656 §11.2 narrowed channel numbers to 0x4000-0x4FFF; RFC 5766 clients (coturn's
    // among them) still pick from 0x4000-0x7FFF, and pion/stunnerd accept that range.
    if !CHANNEL_NUMBERS.contains(&number) {
        return Err(RequestError::ChannelNumberOutOfRange);
    }
    if !alloc.relays_to(peer.ip()) {
        return Err(RequestError::PeerFamilyMismatch);
    }
    // RFC 8656 §11.2: the number may not be bound to another peer, nor the peer to
    // another number.
    if alloc
        .channels
        .iter()
        .any(|c| c.expires_at > now && ((c.number == number) != (c.peer == peer)))
    {
        return Err(RequestError::ChannelBoundElsewhere);
    }
    let route = snap.route(&alloc.listener_name);
    if !route.is_some_and(|r| snap.permits_ip(r, peer.ip())) {
        return Err(denied(denial_log, now, alloc, peer.ip(), snap));
    }
    let bound = alloc.channels.iter().any(|c| c.number == number);
    if !bound {
        // Channels to one peer IP share its permission; cap them as permissions are.
        alloc.channels.retain(|c| c.expires_at > now);
        if alloc.channels.len() >= max_permissions {
            return Err(RequestError::TooManyChannels);
        }
    }
    alloc.install_permission(peer.ip(), now, max_permissions)?;
    match alloc.channels.iter_mut().find(|c| c.number == number) {
        Some(channel) if channel.peer == peer => channel.expires_at = now + CHANNEL_LIFETIME,
        // An expired number bound to another peer: a new channel, judged afresh (the old
        // peer's admission verdict and family are not the new one's).
        Some(channel) => *channel = Channel::new(number, peer, now + CHANNEL_LIFETIME),
        None => alloc
            .channels
            .push(Channel::new(number, peer, now + CHANNEL_LIFETIME)),
    }
    Ok((number, peer.ip()))
}

/// A policy denial (RFC 8656: 403), logged as stunnerd does (with the cause, where it is not
/// plainly that no routed endpoint contains the peer), rate-limited per shard.
fn denied(
    log: &mut LogLimiter,
    now: Instant,
    alloc: &Allocation,
    peer: IpAddr,
    snap: &Snapshot,
) -> RequestError {
    if let Some(suppressed) = log.allow(now) {
        let reason = snap
            .refusal_reason(snap.route(&alloc.listener_name), peer)
            .map(|why| format!(": {why}"))
            .unwrap_or_default();
        tracing::info!(
            target: "auth",
            "permission denied on listener {:?} for client \"{}\" to peer {}: no route to endpoint{reason}{suppressed}",
            alloc.listener_name,
            alloc.key.client,
            peer
        );
    }
    RequestError::PeerDenied
}

/// The distinct peer IPs a CreatePermission names, in one pass over its attributes.
///
/// `check` judges each distinct IP once (family, policy). RFC 8656 §9.2: the request succeeds
/// only if all of it can, so the pass stops with 508 as soon as the new IPs and the `held`
/// permissions together exceed `cap`: a 64 KB request naming 5 444 peers costs no more than
/// one naming `cap + 1`, and repeats of a peer cost a hash lookup each.
fn named_peers(
    msg: &Message<'_>,
    held: &[Permission],
    cap: usize,
    mut check: impl FnMut(IpAddr) -> Result<(), RequestError>,
) -> Result<HashSet<IpAddr, RandomState>, RequestError> {
    let txid = msg.transaction_id();
    let held_ips: HashSet<IpAddr, RandomState> = held.iter().map(|p| p.ip).collect();
    let mut named: HashSet<IpAddr, RandomState> = HashSet::default();
    let mut new_peers = 0usize;
    for (_, raw) in msg.iter_attributes() {
        if raw.get_type() != XorPeerAddress::TYPE {
            continue;
        }
        let Ok(peer) = XorPeerAddress::from_raw_ref(&raw) else {
            return Err(RequestError::MalformedPeerAddress);
        };
        let ip = unmapped_ip(peer.addr(txid).ip());
        if named.contains(&ip) {
            continue;
        }
        check(ip)?;
        named.insert(ip);
        if !held_ips.contains(&ip) {
            new_peers += 1;
            if held.len() + new_peers > cap {
                return Err(RequestError::TooManyPermissions);
            }
        }
    }
    // RFC 8656 §9.2: at least one XOR-PEER-ADDRESS.
    if named.is_empty() {
        return Err(RequestError::NoPeerAddress);
    }
    Ok(named)
}

#[cfg(test)]
mod tests {
    use super::*;
    use stun_proto::types::message::{MessageWrite, MessageWriteExt, MessageWriteVec};
    use turn_types::message::CREATE_PERMISSION;

    fn create_permission_request(peers: impl Iterator<Item = SocketAddr>) -> Vec<u8> {
        let mut msg = Message::builder_request(CREATE_PERMISSION, MessageWriteVec::new());
        let txid = msg.transaction_id();
        for peer in peers {
            msg.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        }
        msg.finish()
    }

    fn peer(i: u32) -> SocketAddr {
        SocketAddr::new(std::net::Ipv4Addr::from(0x0a00_0000 + i).into(), 5000)
    }

    #[test]
    fn named_peers_judges_each_distinct_peer_once_and_stops_at_the_cap() {
        // 5 444 distinct peers (a 64 KB request) against a cap of 256: the pass stops at the
        // 257th, having judged no more.
        let data = create_permission_request((0..5_444).map(peer));
        let msg = Message::from_bytes(&data).unwrap();
        let mut judged = 0;
        let result = named_peers(&msg, &[], 256, |_| {
            judged += 1;
            Ok(())
        });
        assert_eq!(result.unwrap_err().code(), 508);
        assert_eq!(judged, 257);
        // With 200 held, the 57th new peer is one too many.
        let held: Vec<Permission> = (10_000..10_200)
            .map(|i| Permission::new(peer(i).ip(), Instant::now()))
            .collect();
        judged = 0;
        let result = named_peers(&msg, &held, 256, |_| {
            judged += 1;
            Ok(())
        });
        assert_eq!(result.unwrap_err().code(), 508);
        assert_eq!(judged, 57);
        // One peer named 5 444 times is judged once and fits.
        let data = create_permission_request((0..5_444).map(|_| peer(1)));
        let msg = Message::from_bytes(&data).unwrap();
        judged = 0;
        let named = named_peers(&msg, &[], 256, |_| {
            judged += 1;
            Ok(())
        })
        .unwrap();
        assert_eq!((judged, named.len()), (1, 1));
    }
}

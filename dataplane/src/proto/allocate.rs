//! The Allocate and Refresh requests (RFC 8656 §7): what an Allocate asks for, the allocation
//! it becomes once its relay socket is bound, and a Refresh's new lifetime.

use super::auth::Authenticated;
use super::contract::{Family, RelayId};
use super::error::RequestError;
use super::store::{Allocation, ClientKey};
use super::{DEFAULT_ALLOCATION_LIFETIME, MAX_REQUESTED_LIFETIME_SECS};
use std::net::IpAddr;
use std::time::{Duration, Instant};
use stun_proto::types::attribute::AttributeStaticType;
use stun_proto::types::message::{IntegrityKey, Message, TransactionId};
use turn_types::attribute::{
    DontFragment, EvenPort, Lifetime, RequestedAddressFamily, RequestedTransport, ReservationToken,
};
use turn_types::AddressFamily;
use uturn_shared::snapshot::ListenerSpec;

/// IANA protocol number of UDP in REQUESTED-TRANSPORT.
const TRANSPORT_UDP: u8 = 17;

/// What a well-formed Allocate asks for.
pub(super) struct AllocateRequest {
    /// The relay's address family: the one requested, else IPv4 (or IPv6 on a listener that
    /// relays only IPv6).
    pub(super) family: Family,
    /// The relay address's IP: the listener's for that family.
    pub(super) advertised_ip: IpAddr,
    /// EVEN-PORT without the reservation of the next port.
    pub(super) even_port: bool,
    /// DONT-FRAGMENT.
    pub(super) dont_fragment: bool,
    /// The allocation's lifetime, never zero.
    pub(super) lifetime: Duration,
}

/// Reads an Allocate made on `listener`, refusing what cannot be served (RFC 8656 §7.2 steps
/// 3-6; step 2, a 5-tuple in use, is the store's to judge).
pub(super) fn allocate_request(
    msg: &Message<'_>,
    listener: &ListenerSpec,
) -> Result<AllocateRequest, RequestError> {
    // RFC 8656 §7.2 step 3: REQUESTED-TRANSPORT is required; only UDP relaying here.
    let Ok(transport) = msg.attribute::<RequestedTransport>() else {
        return Err(RequestError::MissingRequestedTransport);
    };
    if transport.protocol() != TRANSPORT_UDP {
        return Err(RequestError::UnsupportedTransport);
    }
    let has_even_port = msg.has_attribute(EvenPort::TYPE);
    let has_token = msg.has_attribute(ReservationToken::TYPE);
    let has_family = msg.has_attribute(RequestedAddressFamily::TYPE);
    // RFC 8656 §7.2 step 5/6: RESERVATION-TOKEN excludes EVEN-PORT and
    // REQUESTED-ADDRESS-FAMILY.
    if has_token && (has_even_port || has_family) {
        return Err(RequestError::ReservationTokenWithEvenPortOrFamily);
    }
    if has_token {
        // We never hand out reservations, so no token can be valid.
        return Err(RequestError::ReservationTokenUnsupported);
    }
    let even_port = match msg.attribute::<EvenPort>() {
        // We do not reserve the next port; a request for one cannot be met.
        Ok(even) if even.requested() => return Err(RequestError::PortReservationUnsupported),
        Ok(_) => true,
        Err(_) if has_even_port => return Err(RequestError::MalformedEvenPort),
        Err(_) => false,
    };
    let family = match msg.attribute::<RequestedAddressFamily>() {
        Ok(requested) => requested_family(&requested),
        Err(_) if has_family => return Err(RequestError::MalformedAddressFamily),
        // RFC 8656 §7.2: IPv4 by default; a listener that relays IPv6 only relays that.
        Err(_) if listener.relay.v4.is_none() && listener.relay.v6.is_some() => Family::V6,
        Err(_) => Family::V4,
    };
    let Some(advertised_ip) = listener.relay.get(family == Family::V6) else {
        // No relay address of that family is configured for this listener.
        return Err(RequestError::FamilyNotListeners);
    };
    let lifetime = requested_lifetime(msg).unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
    let lifetime = if lifetime.is_zero() {
        DEFAULT_ALLOCATION_LIFETIME
    } else {
        lifetime
    };
    Ok(AllocateRequest {
        family,
        advertised_ip,
        even_port,
        dont_fragment: msg.has_attribute(DontFragment::TYPE),
        lifetime,
    })
}

/// An authenticated Allocate waiting for its relay socket.
pub(super) struct PendingAllocate {
    pub(super) relay: RelayId,
    pub(super) key: ClientKey,
    pub(super) listener_name: String,
    /// The relay address's IP: the listener's for the requested family.
    pub(super) advertised_ip: IpAddr,
    pub(super) family: Family,
    pub(super) username: String,
    pub(super) user_id: String,
    pub(super) integrity: IntegrityKey,
    pub(super) lifetime: Duration,
    pub(super) txid: TransactionId,
}

impl PendingAllocate {
    /// The Allocate `msg` from `key` on `listener`, for relay slot `relay`.
    pub(super) fn new(
        relay: RelayId,
        key: ClientKey,
        listener: &ListenerSpec,
        request: &AllocateRequest,
        authenticated: Authenticated,
        msg: &Message<'_>,
    ) -> PendingAllocate {
        PendingAllocate {
            relay,
            key,
            listener_name: listener.name.clone(),
            advertised_ip: request.advertised_ip,
            family: request.family,
            username: authenticated.username,
            user_id: authenticated.user_id,
            integrity: authenticated.integrity,
            lifetime: request.lifetime,
            txid: msg.transaction_id(),
        }
    }

    /// The allocation, its relay socket bound at `now`; `response` is the success sent, kept
    /// for retransmissions of the Allocate.
    pub(super) fn into_allocation(self, now: Instant, response: Vec<u8>) -> Allocation {
        Allocation {
            key: self.key,
            listener_name: self.listener_name,
            family: self.family,
            username: self.username,
            user_id: self.user_id,
            expires_at: now + self.lifetime,
            allocate_txid: self.txid,
            allocate_response: response,
            permissions: Vec::new(),
            channels: Vec::new(),
        }
    }
}

/// Applies a Refresh to `alloc` (RFC 8656 §7.3) and returns the lifetime granted; zero means
/// the client deleted the allocation, which the caller then removes.
pub(super) fn refresh(
    alloc: &mut Allocation,
    now: Instant,
    msg: &Message<'_>,
) -> Result<Duration, RequestError> {
    // RFC 8656 §7.3: a REQUESTED-ADDRESS-FAMILY that differs from the allocation's → 443.
    if let Ok(requested) = msg.attribute::<RequestedAddressFamily>() {
        if requested_family(&requested) != alloc.family {
            return Err(RequestError::RefreshFamilyMismatch);
        }
    }
    match requested_lifetime(msg) {
        // RFC 8656 §7.3: LIFETIME 0 deletes the allocation.
        Some(lifetime) if lifetime.is_zero() => Ok(Duration::ZERO),
        requested => {
            let lifetime = requested.unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
            alloc.expires_at = now + lifetime;
            Ok(lifetime)
        }
    }
}

/// The family a REQUESTED-ADDRESS-FAMILY names (0x01 IPv4; anything else IPv6).
fn requested_family(requested: &RequestedAddressFamily) -> Family {
    if requested.family() == AddressFamily::IPV4 {
        Family::V4
    } else {
        Family::V6
    }
}

/// pion's lifetime rule: a requested LIFETIME below 3600 s is honoured, anything else gives
/// the default. `None` when no LIFETIME was sent.
fn requested_lifetime(msg: &Message<'_>) -> Option<Duration> {
    let seconds = msg.attribute::<Lifetime>().ok()?.seconds();
    Some(if seconds < MAX_REQUESTED_LIFETIME_SECS {
        Duration::from_secs(u64::from(seconds))
    } else {
        DEFAULT_ALLOCATION_LIFETIME
    })
}

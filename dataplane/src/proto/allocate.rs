//! The Allocate and Refresh requests (RFC 8656 §7): what an Allocate asks for (one relay, or
//! an IPv4 and an IPv6 one for a dual allocation), the allocation it becomes once its relay
//! sockets are bound, and what a Refresh does to it.

use super::auth::Authenticated;
use super::contract::{Family, RelayId};
use super::error::RequestError;
use super::store::{Allocation, ClientKey, Families};
use super::{DEFAULT_ALLOCATION_LIFETIME, MAX_REQUESTED_LIFETIME_SECS};
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use stun_proto::types::attribute::{AttributeStaticType, AttributeType};
use stun_proto::types::message::{IntegrityKey, Message, TransactionId};
use turn_types::attribute::{
    AdditionalAddressFamily, DontFragment, EvenPort, Lifetime, RequestedAddressFamily,
    RequestedTransport, ReservationToken,
};
use turn_types::AddressFamily;
use uturn_shared::snapshot::ListenerSpec;

/// IANA protocol number of UDP in REQUESTED-TRANSPORT.
const TRANSPORT_UDP: u8 = 17;

/// ADDITIONAL-ADDRESS-FAMILY as coturn's clients send it (`turnutils_uclient -Z`, coturn 4.6):
/// the code of the draft RFC 8656 grew from (draft-ietf-tram-turn-ipv6), same value format.
const ADDITIONAL_ADDRESS_FAMILY_DRAFT: AttributeType = AttributeType::new(0x8032);

/// Whether `msg` asks for a dual allocation (ADDITIONAL-ADDRESS-FAMILY, RFC 8656 §7.2, or its
/// draft code): `None` if not, else whether the family is IPv6 (the one it can add).
fn additional_family(msg: &Message<'_>) -> Option<Result<(), RequestError>> {
    let raw = msg
        .raw_attribute(AdditionalAddressFamily::TYPE)
        .or_else(|| msg.raw_attribute(ADDITIONAL_ADDRESS_FAMILY_DRAFT))?;
    // RFC 8656 §18.11: the family, then three reserved bytes; 0x02 is IPv6.
    Some(match raw.value[..] {
        [0x02, _, _, _] => Ok(()),
        _ => Err(RequestError::AdditionalFamilyNotIpv6),
    })
}

/// What a well-formed Allocate asks for.
pub(super) struct AllocateRequest {
    /// The relay's address family: the one requested, else IPv4 (or IPv6 on a listener that
    /// relays only IPv6).
    pub(super) family: Family,
    /// The relay address's IP: the listener's for that family.
    pub(super) advertised_ip: IpAddr,
    /// ADDITIONAL-ADDRESS-FAMILY (RFC 8656 §7.2: a dual allocation, `family` IPv4): the IPv6
    /// relay address's IP, or why the listener cannot give one (440 in ADDRESS-ERROR-CODE;
    /// the allocation goes on with IPv4 alone).
    pub(super) additional: Option<Result<IpAddr, RequestError>>,
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
    let additional_family = additional_family(msg);
    let has_additional = additional_family.is_some();
    // RFC 8656 §7.2 step 5/6: RESERVATION-TOKEN excludes EVEN-PORT, REQUESTED-ADDRESS-FAMILY
    // and ADDITIONAL-ADDRESS-FAMILY.
    if has_token && (has_even_port || has_family || has_additional) {
        return Err(RequestError::ReservationTokenWithEvenPortOrFamily);
    }
    // RFC 8656 §7.2: REQUESTED-ADDRESS-FAMILY and ADDITIONAL-ADDRESS-FAMILY exclude each
    // other, and ADDITIONAL-ADDRESS-FAMILY can only add IPv6 to the default IPv4.
    if has_family && has_additional {
        return Err(RequestError::RequestedAndAdditionalFamily);
    }
    if let Some(Err(error)) = additional_family {
        return Err(error);
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
        // A dual allocation's first relay is IPv4, served or not (440 then).
        Err(_) if has_additional => Family::V4,
        // RFC 8656 §7.2: IPv4 by default; a listener that relays IPv6 only relays that.
        Err(_) if listener.relay.v4.is_none() && listener.relay.v6.is_some() => Family::V6,
        Err(_) => Family::V4,
    };
    let Some(advertised_ip) = listener.relay.get(family == Family::V6) else {
        // No relay address of that family is configured for this listener.
        return Err(RequestError::FamilyNotListeners);
    };
    // RFC 8656 §7.2: an additional family the server cannot serve does not fail the request;
    // the success says why in ADDRESS-ERROR-CODE.
    let additional = has_additional.then(|| {
        listener
            .relay
            .get(true)
            .ok_or(RequestError::FamilyNotListeners)
    });
    let lifetime = requested_lifetime(msg).unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
    let lifetime = if lifetime.is_zero() {
        DEFAULT_ALLOCATION_LIFETIME
    } else {
        lifetime
    };
    Ok(AllocateRequest {
        family,
        advertised_ip,
        additional,
        even_port,
        dont_fragment: msg.has_attribute(DontFragment::TYPE),
        lifetime,
    })
}

/// An authenticated Allocate waiting for its relay sockets.
pub(super) struct PendingAllocate {
    /// The first relay socket (its family the requested one, IPv4 for a dual allocation).
    pub(super) relay: RelayId,
    pub(super) key: ClientKey,
    pub(super) listener_name: String,
    /// The relay address's IP: the listener's for the requested family.
    pub(super) advertised_ip: IpAddr,
    /// A dual allocation's IPv6 relay socket and its address's IP, or why the listener
    /// cannot give one.
    pub(super) additional: Option<Result<(RelayId, IpAddr), RequestError>>,
    pub(super) username: String,
    pub(super) user_id: String,
    pub(super) integrity: IntegrityKey,
    pub(super) lifetime: Duration,
    pub(super) txid: TransactionId,
    pub(super) dont_fragment: bool,
}

impl PendingAllocate {
    /// The Allocate `msg` from `key` on `listener`, for the relay sockets of slot `slot`.
    pub(super) fn new(
        slot: u32,
        key: ClientKey,
        listener: &ListenerSpec,
        request: AllocateRequest,
        authenticated: Authenticated,
        msg: &Message<'_>,
    ) -> PendingAllocate {
        PendingAllocate {
            relay: RelayId::new(slot, request.family),
            key,
            listener_name: listener.name.clone(),
            advertised_ip: request.advertised_ip,
            additional: request
                .additional
                .map(|ip| ip.map(|ip| (RelayId::new(slot, Family::V6), ip))),
            username: authenticated.username,
            user_id: authenticated.user_id,
            integrity: authenticated.integrity,
            lifetime: request.lifetime,
            txid: msg.transaction_id(),
            dont_fragment: request.dont_fragment,
        }
    }

    /// The additional relay socket the shell must bind, if any.
    pub(super) fn additional_relay(&self) -> Option<RelayId> {
        self.additional
            .as_ref()?
            .as_ref()
            .ok()
            .map(|&(relay, _)| relay)
    }

    /// The relay addresses of the success (IPv4 first) for the ports bound, with the families
    /// they give the allocation, and the ADDRESS-ERROR-CODE of an additional family that could
    /// not be had.
    pub(super) fn relayed(
        &self,
        port: u16,
        additional_port: Option<Result<u16, RequestError>>,
    ) -> (Vec<SocketAddr>, Families, Option<RequestError>) {
        let mut addresses = vec![SocketAddr::new(self.advertised_ip, port)];
        let mut families = Families::NONE.with(self.relay.family());
        let additional = match (&self.additional, additional_port) {
            (Some(Ok((relay, ip))), Some(Ok(port))) => {
                addresses.push(SocketAddr::new(*ip, port));
                families = families.with(relay.family());
                None
            }
            (Some(Err(error)), _) => Some(error.clone()),
            (Some(Ok(_)), Some(Err(error))) => Some(error),
            // A shell that answered nothing for the additional socket could not bind it.
            (Some(Ok(_)), None) => Some(RequestError::RelayBindFailed(
                super::contract::RelayBindError {
                    kind: std::io::ErrorKind::Other,
                },
            )),
            (None, _) => None,
        };
        (addresses, families, additional)
    }

    /// The allocation of `families`, its relay sockets bound at `now`; `response` is the
    /// success sent, kept for retransmissions of the Allocate.
    pub(super) fn into_allocation(
        self,
        now: Instant,
        families: Families,
        response: Vec<u8>,
    ) -> Allocation {
        Allocation {
            key: self.key,
            listener_name: self.listener_name,
            families,
            dont_fragment: self.dont_fragment,
            username: self.username,
            user_id: self.user_id,
            expires_at: now + self.lifetime,
            allocate_txid: self.txid,
            allocate_response: response,
            permissions: Vec::new(),
            channels: Vec::new(),
            via: None,
            forwarded: false,
        }
    }
}

/// What a Refresh did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Refreshed {
    /// The allocation lives `Duration` more (all its relays: one lifetime).
    Extended(Duration),
    /// LIFETIME 0: the client deleted the allocation; the caller removes it.
    Deleted,
    /// LIFETIME 0 with the REQUESTED-ADDRESS-FAMILY of one relay of a dual allocation: that
    /// relay is gone (its permissions and channels with it), the other lives on; the caller
    /// closes its socket.
    RelayDeleted(Family),
}

/// Applies a Refresh to `alloc` (RFC 8656 §7.3).
pub(super) fn refresh(
    alloc: &mut Allocation,
    now: Instant,
    msg: &Message<'_>,
) -> Result<Refreshed, RequestError> {
    // RFC 8656 §7.3: a REQUESTED-ADDRESS-FAMILY of no relay of the allocation → 443.
    let family = match msg.attribute::<RequestedAddressFamily>() {
        Ok(requested) => {
            let family = requested_family(&requested);
            if !alloc.families.contains(family) {
                return Err(RequestError::RefreshFamilyMismatch);
            }
            Some(family)
        }
        Err(_) => None,
    };
    match requested_lifetime(msg) {
        // RFC 8656 §7.3: LIFETIME 0 deletes the allocation; with REQUESTED-ADDRESS-FAMILY, only
        // the relay of that family, unless it is the allocation's only one.
        Some(lifetime) if lifetime.is_zero() => match family {
            Some(family) if alloc.families != Families::NONE.with(family) => {
                alloc.remove_family(family);
                Ok(Refreshed::RelayDeleted(family))
            }
            _ => Ok(Refreshed::Deleted),
        },
        requested => {
            let lifetime = requested.unwrap_or(DEFAULT_ALLOCATION_LIFETIME);
            alloc.expires_at = now + lifetime;
            Ok(Refreshed::Extended(lifetime))
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

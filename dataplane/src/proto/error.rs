//! Why the engine refuses a request: one variant per cause, each mapped to the STUN error code
//! (and reason phrase) stunnerd sends for it, at one place.

use super::nonce::NONCE_LEN;
use super::RelayBindError;
use stun_proto::types::attribute::AttributeType;

/// The REALM and NONCE a 401 or 438 carries (RFC 8489 §9.2.4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Challenge {
    /// The realm of the running config.
    pub(super) realm: String,
    /// A nonce for the client, or the one it sent back when only its credentials failed.
    pub(super) nonce: [u8; NONCE_LEN],
}

/// Why a request is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RequestError {
    /// A request method the server does not serve (RFC 6062 Connect on UDP among them).
    UnknownMethod,
    /// MESSAGE-INTEGRITY without a readable USERNAME, REALM and NONCE.
    MissingCredentialAttributes,
    /// The running config has auth type none: TURN is off (400, so clients do not retry).
    TurnDisabled,
    /// An Allocate without a readable REQUESTED-TRANSPORT (RFC 8656 §7.2 step 3).
    MissingRequestedTransport,
    /// RESERVATION-TOKEN together with EVEN-PORT, REQUESTED-ADDRESS-FAMILY or
    /// ADDITIONAL-ADDRESS-FAMILY (RFC 8656 §7.2).
    ReservationTokenWithEvenPortOrFamily,
    /// REQUESTED-ADDRESS-FAMILY together with ADDITIONAL-ADDRESS-FAMILY (RFC 8656 §7.2).
    RequestedAndAdditionalFamily,
    /// An ADDITIONAL-ADDRESS-FAMILY other than IPv6 (RFC 8656 §7.2: IPv4 → 400).
    AdditionalFamilyNotIpv6,
    /// An EVEN-PORT attribute that does not parse.
    MalformedEvenPort,
    /// A CreatePermission XOR-PEER-ADDRESS that does not parse.
    MalformedPeerAddress,
    /// A CreatePermission without XOR-PEER-ADDRESS (RFC 8656 §9.2).
    NoPeerAddress,
    /// A ChannelBind without a readable CHANNEL-NUMBER and XOR-PEER-ADDRESS.
    MissingChannelBindAttributes,
    /// A channel number outside [`super::CHANNEL_NUMBERS`].
    ChannelNumberOutOfRange,
    /// The channel is bound to another peer, or the peer to another channel (RFC 8656 §11.2).
    ChannelBoundElsewhere,
    /// No credentials yet: the challenge that starts every session.
    Unauthenticated(Challenge),
    /// The credentials were checked and refused; the challenge repeats the client's nonce.
    CredentialsRefused(Challenge),
    /// The peer IP is in no cluster the listener routes to.
    PeerDenied,
    /// Comprehension-required attributes the server does not understand (RFC 8489 §14.13).
    UnknownAttributes(Vec<AttributeType>),
    /// An Allocate on a 5-tuple that holds an allocation already (RFC 8656 §7.2 step 2).
    AllocationExists,
    /// A request other than Allocate on a 5-tuple without an allocation.
    NoAllocation,
    /// The nonce is not ours, not this client's or too old.
    StaleNonce(Challenge),
    /// A REQUESTED-ADDRESS-FAMILY that does not parse.
    MalformedAddressFamily,
    /// A relay family other than the listener's: its advertised address is the relay's.
    FamilyNotListeners,
    /// A request on an allocation under credentials other than those that created it.
    WrongCredentials,
    /// A REQUESTED-TRANSPORT other than UDP.
    UnsupportedTransport,
    /// A Refresh whose REQUESTED-ADDRESS-FAMILY is not the allocation's (RFC 8656 §7.3).
    RefreshFamilyMismatch,
    /// A peer address of a family other than the allocation's.
    PeerFamilyMismatch,
    /// The user-id holds its `admin.user_quota` of allocations.
    UserQuotaReached,
    /// A RESERVATION-TOKEN: no reservations are handed out, so none is valid.
    ReservationTokenUnsupported,
    /// EVEN-PORT asking to reserve the next port, which is never done.
    PortReservationUnsupported,
    /// All clients together hold `--max-allocations`.
    AllocationCapReached,
    /// The shell could not bind the relay socket.
    RelayBindFailed(RelayBindError),
    /// The allocation holds `--max-permissions` permissions.
    TooManyPermissions,
    /// The allocation holds `--max-permissions` channels.
    TooManyChannels,
}

/// The STUN error codes the engine sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Status {
    BadRequest,
    Unauthorized,
    Forbidden,
    UnknownAttribute,
    AllocationMismatch,
    StaleNonce,
    AddressFamilyNotSupported,
    WrongCredentials,
    UnsupportedTransportProtocol,
    PeerAddressFamilyMismatch,
    AllocationQuotaReached,
    InsufficientCapacity,
}

impl Status {
    fn code(self) -> u16 {
        match self {
            Status::BadRequest => 400,
            Status::Unauthorized => 401,
            Status::Forbidden => 403,
            Status::UnknownAttribute => 420,
            Status::AllocationMismatch => 437,
            Status::StaleNonce => 438,
            Status::AddressFamilyNotSupported => 440,
            Status::WrongCredentials => 441,
            Status::UnsupportedTransportProtocol => 442,
            Status::PeerAddressFamilyMismatch => 443,
            Status::AllocationQuotaReached => 486,
            Status::InsufficientCapacity => 508,
        }
    }

    /// The reason phrases of RFC 8489 §14.8 and RFC 8656 §19, as stunnerd sends them.
    fn reason(self) -> &'static str {
        match self {
            Status::BadRequest => "Bad Request",
            Status::Unauthorized => "Unauthorized",
            Status::Forbidden => "Forbidden",
            Status::UnknownAttribute => "Unknown Attribute",
            Status::AllocationMismatch => "Allocation Mismatch",
            Status::StaleNonce => "Stale Nonce",
            Status::AddressFamilyNotSupported => "Address Family not Supported",
            Status::WrongCredentials => "Wrong Credentials",
            Status::UnsupportedTransportProtocol => "Unsupported Transport Protocol",
            Status::PeerAddressFamilyMismatch => "Peer Address Family Mismatch",
            Status::AllocationQuotaReached => "Allocation Quota Reached",
            Status::InsufficientCapacity => "Insufficient Capacity",
        }
    }
}

impl RequestError {
    fn status(&self) -> Status {
        use RequestError as E;
        match self {
            E::UnknownMethod
            | E::MissingCredentialAttributes
            | E::TurnDisabled
            | E::MissingRequestedTransport
            | E::ReservationTokenWithEvenPortOrFamily
            | E::RequestedAndAdditionalFamily
            | E::AdditionalFamilyNotIpv6
            | E::MalformedEvenPort
            | E::MalformedPeerAddress
            | E::NoPeerAddress
            | E::MissingChannelBindAttributes
            | E::ChannelNumberOutOfRange
            | E::ChannelBoundElsewhere => Status::BadRequest,
            E::Unauthenticated(_) | E::CredentialsRefused(_) => Status::Unauthorized,
            E::PeerDenied => Status::Forbidden,
            E::UnknownAttributes(_) => Status::UnknownAttribute,
            E::AllocationExists | E::NoAllocation => Status::AllocationMismatch,
            E::StaleNonce(_) => Status::StaleNonce,
            E::MalformedAddressFamily | E::FamilyNotListeners => Status::AddressFamilyNotSupported,
            E::WrongCredentials => Status::WrongCredentials,
            E::UnsupportedTransport => Status::UnsupportedTransportProtocol,
            E::RefreshFamilyMismatch | E::PeerFamilyMismatch => Status::PeerAddressFamilyMismatch,
            E::UserQuotaReached => Status::AllocationQuotaReached,
            E::ReservationTokenUnsupported
            | E::PortReservationUnsupported
            | E::AllocationCapReached
            | E::RelayBindFailed(_)
            | E::TooManyPermissions
            | E::TooManyChannels => Status::InsufficientCapacity,
        }
    }

    /// The STUN error code to send.
    pub(super) fn code(&self) -> u16 {
        self.status().code()
    }

    /// The reason phrase to send with [`RequestError::code`].
    pub(super) fn reason(&self) -> &'static str {
        self.status().reason()
    }

    /// The REALM and NONCE the response carries, for 401 and 438.
    pub(super) fn challenge(&self) -> Option<&Challenge> {
        match self {
            RequestError::Unauthenticated(challenge)
            | RequestError::CredentialsRefused(challenge)
            | RequestError::StaleNonce(challenge) => Some(challenge),
            _ => None,
        }
    }

    /// The attribute types a 420 lists in UNKNOWN-ATTRIBUTES; empty for every other code.
    pub(super) fn unknown_attributes(&self) -> &[AttributeType] {
        match self {
            RequestError::UnknownAttributes(unknown) => unknown,
            _ => &[],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_cause_sends_stunnerds_code_and_phrase() {
        let challenge = Challenge {
            realm: "stunner.l7mp.io".to_owned(),
            nonce: [b'n'; NONCE_LEN],
        };
        let table = [
            (RequestError::UnknownMethod, 400, "Bad Request"),
            (RequestError::TurnDisabled, 400, "Bad Request"),
            (RequestError::ChannelBoundElsewhere, 400, "Bad Request"),
            (
                RequestError::Unauthenticated(challenge.clone()),
                401,
                "Unauthorized",
            ),
            (
                RequestError::CredentialsRefused(challenge.clone()),
                401,
                "Unauthorized",
            ),
            (RequestError::PeerDenied, 403, "Forbidden"),
            (
                RequestError::UnknownAttributes(Vec::new()),
                420,
                "Unknown Attribute",
            ),
            (RequestError::NoAllocation, 437, "Allocation Mismatch"),
            (RequestError::StaleNonce(challenge), 438, "Stale Nonce"),
            (
                RequestError::FamilyNotListeners,
                440,
                "Address Family not Supported",
            ),
            (RequestError::WrongCredentials, 441, "Wrong Credentials"),
            (
                RequestError::UnsupportedTransport,
                442,
                "Unsupported Transport Protocol",
            ),
            (
                RequestError::PeerFamilyMismatch,
                443,
                "Peer Address Family Mismatch",
            ),
            (
                RequestError::UserQuotaReached,
                486,
                "Allocation Quota Reached",
            ),
            (RequestError::TooManyChannels, 508, "Insufficient Capacity"),
        ];
        for (error, code, reason) in table {
            assert_eq!((error.code(), error.reason()), (code, reason), "{error:?}");
        }
    }
}

//! The values a config field takes from a closed set: the auth type, a listener's transport
//! and (v1) protocol stack, a server's type, a cluster's type, protocol and routing policy.
//! Each parses as stunnerd does and prints (and serializes) its normalized name.

use serde::{Serialize, Serializer};
use std::fmt;

/// How TURN requests are authenticated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum AuthType {
    /// A fixed username and password (input alias `plaintext`).
    #[default]
    Static,
    /// TURN REST time-windowed credentials from a shared secret (input alias `longterm`).
    Ephemeral,
    /// TURN disabled; only Binding is served.
    None,
}

impl AuthType {
    /// Parses a config value exactly as stunnerd does: case-sensitive, with the old aliases.
    pub fn parse(s: &str) -> Option<AuthType> {
        match s {
            "static" | "plaintext" => Some(AuthType::Static),
            "ephemeral" | "longterm" => Some(AuthType::Ephemeral),
            "none" => Some(AuthType::None),
            _ => None,
        }
    }

    /// The normalized name: `static`, `ephemeral` or `none`.
    pub fn as_str(&self) -> &'static str {
        match self {
            AuthType::Static => "static",
            AuthType::Ephemeral => "ephemeral",
            AuthType::None => "none",
        }
    }
}

/// A listener's transport (v2 `protocol`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Transport {
    /// UDP.
    #[default]
    Udp,
    /// TCP.
    Tcp,
    /// TLS over TCP.
    Tls,
    /// DTLS over UDP.
    Dtls,
    /// The process's stdin and stdout: refused by uturn.
    Stdin,
}

impl Transport {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<Transport> {
        [
            Transport::Udp,
            Transport::Tcp,
            Transport::Tls,
            Transport::Dtls,
            Transport::Stdin,
        ]
        .into_iter()
        .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, upper-case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            Transport::Udp => "UDP",
            Transport::Tcp => "TCP",
            Transport::Tls => "TLS",
            Transport::Dtls => "DTLS",
            Transport::Stdin => "STDIN",
        }
    }

    /// The TURN listener protocol of this transport (`None` for STDIN).
    pub fn turn(&self) -> Option<ListenerProtocol> {
        match self {
            Transport::Udp => Some(ListenerProtocol::TurnUdp),
            Transport::Tcp => Some(ListenerProtocol::TurnTcp),
            Transport::Tls => Some(ListenerProtocol::TurnTls),
            Transport::Dtls => Some(ListenerProtocol::TurnDtls),
            Transport::Stdin => None,
        }
    }
}

/// What a server does with the clients a listener hands it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ServerType {
    /// TURN.
    #[default]
    Turn,
    /// A plain L4 proxy: refused by uturn.
    L4,
}

impl ServerType {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ServerType> {
        [ServerType::Turn, ServerType::L4]
            .into_iter()
            .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, lower-case name.
    pub fn as_str(&self) -> &'static str {
        match self {
            ServerType::Turn => "turn",
            ServerType::L4 => "l4",
        }
    }
}

/// A listener's protocol stack as the dataplane serves it (and as a v1 document names it:
/// `TURN-UDP`, …).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ListenerProtocol {
    /// TURN over UDP.
    #[default]
    TurnUdp,
    /// TURN over TCP.
    TurnTcp,
    /// TURN over TLS.
    TurnTls,
    /// TURN over DTLS.
    TurnDtls,
    /// Plain `UDP`: validates, but stunnerd refuses to start such a listener.
    Udp,
    /// Plain `TCP`: validates, but stunnerd refuses to start such a listener.
    Tcp,
    /// Plain `TLS`: validates, but stunnerd refuses to start such a listener.
    Tls,
    /// Plain `DTLS`: validates, but stunnerd refuses to start such a listener.
    Dtls,
}

impl ListenerProtocol {
    /// Every protocol, TURN ones first.
    pub const ALL: [ListenerProtocol; 8] = [
        ListenerProtocol::TurnUdp,
        ListenerProtocol::TurnTcp,
        ListenerProtocol::TurnTls,
        ListenerProtocol::TurnDtls,
        ListenerProtocol::Udp,
        ListenerProtocol::Tcp,
        ListenerProtocol::Tls,
        ListenerProtocol::Dtls,
    ];

    /// Parses a config value case-insensitively (`turn-udp`, `TURN-TLS`, `udp`, …).
    pub fn parse(s: &str) -> Option<ListenerProtocol> {
        Self::ALL
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized, upper-case name (`TURN-UDP`, …).
    pub fn as_str(&self) -> &'static str {
        match self {
            ListenerProtocol::TurnUdp => "TURN-UDP",
            ListenerProtocol::TurnTcp => "TURN-TCP",
            ListenerProtocol::TurnTls => "TURN-TLS",
            ListenerProtocol::TurnDtls => "TURN-DTLS",
            ListenerProtocol::Udp => "UDP",
            ListenerProtocol::Tcp => "TCP",
            ListenerProtocol::Tls => "TLS",
            ListenerProtocol::Dtls => "DTLS",
        }
    }

    /// Whether stunnerd actually serves this protocol (only the four `TURN-*` ones).
    pub fn is_turn(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnUdp
                | ListenerProtocol::TurnTcp
                | ListenerProtocol::TurnTls
                | ListenerProtocol::TurnDtls
        )
    }

    /// Whether the listener needs `cert` and `key` (TLS and DTLS variants).
    pub fn needs_cert(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnTls
                | ListenerProtocol::TurnDtls
                | ListenerProtocol::Tls
                | ListenerProtocol::Dtls
        )
    }

    /// Whether the transport underneath is datagram based (UDP or DTLS).
    pub fn is_datagram(&self) -> bool {
        matches!(
            self,
            ListenerProtocol::TurnUdp
                | ListenerProtocol::TurnDtls
                | ListenerProtocol::Udp
                | ListenerProtocol::Dtls
        )
    }
}

/// How a cluster admits peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RoutingPolicy {
    /// Admits the peers its endpoints contain (by IP in a v2 config).
    #[default]
    Filter,
    /// Picks one endpoint per flow (for L4 servers): admits no TURN peer.
    RoundRobin,
}

impl RoutingPolicy {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<RoutingPolicy> {
        [RoutingPolicy::Filter, RoutingPolicy::RoundRobin]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `FILTER` or `ROUND_ROBIN`.
    pub fn as_str(&self) -> &'static str {
        match self {
            RoutingPolicy::Filter => "FILTER",
            RoutingPolicy::RoundRobin => "ROUND_ROBIN",
        }
    }
}

/// A cluster's address resolution policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ClusterType {
    /// Endpoints are IP prefixes with optional port ranges.
    #[default]
    Static,
    /// Endpoints are hostnames, re-resolved every 5 s, matched on IP only.
    StrictDns,
    /// Endpoints are Kubernetes Services, `<namespace>/<service>[:<min-max>]`: the cluster
    /// admits every address their EndpointSlices list (ready, serving and terminating) plus
    /// the Services' ClusterIPs.
    Kubernetes,
}

impl ClusterType {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ClusterType> {
        [
            ClusterType::Static,
            ClusterType::StrictDns,
            ClusterType::Kubernetes,
        ]
        .into_iter()
        .find(|t| t.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `STATIC`, `STRICT_DNS` or `KUBERNETES`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ClusterType::Static => "STATIC",
            ClusterType::StrictDns => "STRICT_DNS",
            ClusterType::Kubernetes => "KUBERNETES",
        }
    }
}

/// A cluster's relay transport.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum ClusterProtocol {
    /// UDP relaying.
    #[default]
    Udp,
    /// TCP relaying (RFC 6062).
    Tcp,
}

impl ClusterProtocol {
    /// Parses a config value case-insensitively.
    pub fn parse(s: &str) -> Option<ClusterProtocol> {
        [ClusterProtocol::Udp, ClusterProtocol::Tcp]
            .into_iter()
            .find(|p| p.as_str().eq_ignore_ascii_case(s))
    }

    /// The normalized name: `UDP` or `TCP`.
    pub fn as_str(&self) -> &'static str {
        match self {
            ClusterProtocol::Udp => "UDP",
            ClusterProtocol::Tcp => "TCP",
        }
    }
}

macro_rules! string_enum_impls {
    ($($ty:ty),*) => {$(
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl Serialize for $ty {
            fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(self.as_str())
            }
        }
    )*};
}

string_enum_impls!(
    AuthType,
    ListenerProtocol,
    Transport,
    ServerType,
    ClusterType,
    ClusterProtocol,
    RoutingPolicy
);

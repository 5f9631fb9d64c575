//! What lets allocations outlive the process: each allocation as an [`AllocationRecord`], a
//! journal of them ([`JournalEntry`], written and read by [`encode_header`], [`encode_entry`]
//! and [`decode`]), the live set a journal leaves ([`replay`]), and the clock they are kept on
//! ([`MonotonicEpoch`]).
//!
//! The failure it prevents: a restarted process that forgot its allocations answers every
//! ChannelData, Refresh and peer datagram of a running call with silence or 437, and the call
//! drops. Deadlines are kept as `CLOCK_MONOTONIC` nanoseconds: a container restart keeps the
//! kernel, so the monotonic clock carries on where the old process left it, where an
//! [`Instant`] means nothing outside the process that made it. A host reboot restarts that
//! clock: the journal's header carries the boot id, for the shell to compare.
//!
//! Sans-IO like the rest of `proto`: no files, no clock. The shell reads the clock into a
//! [`MonotonicEpoch`], writes the bytes where it keeps them and, in a new process, binds each
//! record's relay ports and hands it to [`super::Engine::adopt`] before it serves.

mod codec;

pub use codec::{
    decode, encode_entry, encode_header, DecodeError, Decoded, EncodeError, JournalHeader,
    JOURNAL_MAGIC, JOURNAL_VERSION, MAX_RECORD_LEN,
};

use super::contract::Family;
use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::time::{Duration, Instant};
use stun_proto::types::message::TransactionId;
use uturn_shared::config::ListenerProtocol;

/// An [`Instant`] and the `CLOCK_MONOTONIC` reading (nanoseconds) taken at it: how deadlines
/// go from one process's clock to the next one's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MonotonicEpoch {
    /// The instant of the reading.
    pub instant: Instant,
    /// `CLOCK_MONOTONIC` at `instant`, in nanoseconds.
    pub monotonic_ns: u64,
}

impl MonotonicEpoch {
    /// `at` as `CLOCK_MONOTONIC` nanoseconds (saturating at 0 and `u64::MAX`).
    pub fn ns_at(self, at: Instant) -> u64 {
        if at >= self.instant {
            self.monotonic_ns.saturating_add(nanos(at - self.instant))
        } else {
            self.monotonic_ns.saturating_sub(nanos(self.instant - at))
        }
    }

    /// The instant of `CLOCK_MONOTONIC` reading `ns`, if this platform's [`Instant`] reaches it.
    pub fn instant_at(self, ns: u64) -> Option<Instant> {
        if ns >= self.monotonic_ns {
            let ahead = Duration::from_nanos(ns - self.monotonic_ns);
            self.instant.checked_add(ahead)
        } else {
            let behind = Duration::from_nanos(self.monotonic_ns - ns);
            self.instant.checked_sub(behind)
        }
    }
}

/// `duration` in nanoseconds, saturating.
fn nanos(duration: Duration) -> u64 {
    u64::try_from(duration.as_nanos()).unwrap_or(u64::MAX)
}

/// The port of an allocation's relay socket of each family (both for a dual allocation).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RelayPorts {
    /// The IPv4 relay socket's port.
    pub v4: Option<u16>,
    /// The IPv6 relay socket's port.
    pub v6: Option<u16>,
}

impl RelayPorts {
    /// The port of the relay of `family`.
    pub fn get(self, family: Family) -> Option<u16> {
        match family {
            Family::V4 => self.v4,
            Family::V6 => self.v6,
        }
    }

    /// `self` with the relay of `family` on `port`.
    pub fn with(mut self, family: Family, port: u16) -> RelayPorts {
        match family {
            Family::V4 => self.v4 = Some(port),
            Family::V6 => self.v6 = Some(port),
        }
        self
    }
}

/// A permission (RFC 8656 §9) as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PermissionRecord {
    /// The peer IP it lets through.
    pub ip: IpAddr,
    /// When it ends, `CLOCK_MONOTONIC` nanoseconds.
    pub expires_at_ns: u64,
}

/// A channel binding (RFC 8656 §12) as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChannelRecord {
    /// The channel number.
    pub number: u16,
    /// The peer bound to it.
    pub peer: SocketAddr,
    /// When it ends, `CLOCK_MONOTONIC` nanoseconds.
    pub expires_at_ns: u64,
}

/// Everything a new process needs to re-create one allocation
/// ([`super::Engine::allocation_records`] gives them, [`super::Engine::adopt`] takes one).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AllocationRecord {
    /// The name of the listener it was made on (listener ids do not outlive the process).
    pub listener: String,
    /// The client's address, as the listener saw it.
    pub client: SocketAddr,
    /// Its relay sockets' ports, read back from the Allocate success it sent.
    pub relays: RelayPorts,
    /// RFC 8656 DONT-FRAGMENT: the relay sockets set DF.
    pub dont_fragment: bool,
    /// The username that created it (RFC 8656 §5: later requests must use it).
    pub username: String,
    /// Whose quota it counts against.
    pub user_id: String,
    /// When it ends unless refreshed, `CLOCK_MONOTONIC` nanoseconds.
    pub expires_at_ns: u64,
    /// The Allocate's transaction id (RFC 8656 §7.2: its retransmissions get `allocate_response`).
    pub allocate_txid: TransactionId,
    /// The Allocate success sent.
    pub allocate_response: Vec<u8>,
    /// Its permissions.
    pub permissions: Vec<PermissionRecord>,
    /// Its channels.
    pub channels: Vec<ChannelRecord>,
    /// The sibling pod its client's flow reaches us through, if it does.
    pub via: Option<SocketAddr>,
}

/// One change to the set of allocations, as a journal holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JournalEntry {
    /// The allocation is now as recorded (made, or changed).
    Put(AllocationRecord),
    /// The allocation of `client` on listener `listener` ended.
    Delete {
        /// The name of its listener.
        listener: String,
        /// Its client's address.
        client: SocketAddr,
    },
}

/// The allocations a journal's `entries` leave live at `now_ns` (`CLOCK_MONOTONIC`), in the
/// order of their listener name and client: of each client's entries the last counts (a
/// `Put` replaces, a `Delete` removes), and an allocation whose deadline passed is left out.
pub fn replay(
    entries: impl IntoIterator<Item = JournalEntry>,
    now_ns: u64,
) -> Vec<AllocationRecord> {
    let mut live: BTreeMap<(String, SocketAddr), AllocationRecord> = BTreeMap::new();
    for entry in entries {
        match entry {
            JournalEntry::Put(record) => {
                live.insert((record.listener.clone(), record.client), record);
            }
            JournalEntry::Delete { listener, client } => {
                live.remove(&(listener, client));
            }
        }
    }
    live.into_values()
        .filter(|record| record.expires_at_ns > now_ns)
        .collect()
}

/// Why [`super::Engine::adopt`] did not re-create an allocation: one variant per cause.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdoptError {
    /// Its deadline has passed.
    Expired,
    /// The snapshot runs no listener of its name.
    ListenerGone,
    /// Its listener is TCP, TLS or DTLS: the connection or session it lived on ended with the
    /// process that held it (RFC 8656 §3.1).
    ConnectionEnded,
    /// Its client holds an allocation on that listener already.
    Exists,
    /// None of its relay sockets was bound again on its recorded port.
    NoRelay,
    /// Its user-id holds `admin.user_quota` allocations already.
    UserQuotaReached,
    /// All clients together hold the global cap.
    AllocationCapReached,
}

impl AdoptError {
    /// Name for logs and metrics.
    pub fn name(self) -> &'static str {
        match self {
            AdoptError::Expired => "expired",
            AdoptError::ListenerGone => "listener_gone",
            AdoptError::ConnectionEnded => "connection_ended",
            AdoptError::Exists => "exists",
            AdoptError::NoRelay => "no_relay",
            AdoptError::UserQuotaReached => "user_quota_reached",
            AdoptError::AllocationCapReached => "allocation_cap_reached",
        }
    }
}

/// How long a restored allocation waits for its listener to open on its shard, once a config
/// with listeners runs, before it is dropped as gone.
pub const LISTENER_WAIT: Duration = Duration::from_secs(10);

/// What becomes of a restored allocation at a shard's tick ([`placement`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Its listener runs here: adopt it now.
    Adopt,
    /// Its listener is in the config but not open here yet: ask again next tick.
    Wait,
    /// Never: why.
    Drop(AdoptError),
}

/// Whether a restored allocation is adopted, waits or is dropped, at `now`: `protocol` is its
/// listener's in the running config (`None`: the config has no listener of its name), `open`
/// whether that listener runs on the shard with a socket, `since` when the first config with
/// listeners ran. A TURN-UDP listener not open within [`LISTENER_WAIT`] is as good as gone; a
/// TCP, TLS or DTLS one ended the allocation with the connection or session it lived on
/// (RFC 8656 §3.1).
pub fn placement(
    protocol: Option<ListenerProtocol>,
    open: bool,
    since: Instant,
    now: Instant,
) -> Placement {
    match (protocol, open) {
        (Some(ListenerProtocol::TurnUdp), true) => Placement::Adopt,
        (Some(ListenerProtocol::TurnUdp), false) if now < since + LISTENER_WAIT => Placement::Wait,
        (None, _) | (Some(ListenerProtocol::TurnUdp), false) => {
            Placement::Drop(AdoptError::ListenerGone)
        }
        (Some(_), _) => Placement::Drop(AdoptError::ConnectionEnded),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn record(listener: &str, client: &str, expires_at_ns: u64) -> AllocationRecord {
        AllocationRecord {
            listener: listener.into(),
            client: client.parse().unwrap(),
            relays: RelayPorts::default().with(Family::V4, 50002),
            dont_fragment: false,
            username: "user1".into(),
            user_id: "user1".into(),
            expires_at_ns,
            allocate_txid: TransactionId::from(7),
            allocate_response: vec![1, 2, 3],
            permissions: Vec::new(),
            channels: Vec::new(),
            via: None,
        }
    }

    #[test]
    fn replay_keeps_the_last_put_drops_the_deleted_and_the_expired() {
        let a = record("udp", "192.0.2.1:1000", 5_000);
        let mut a2 = a.clone();
        a2.expires_at_ns = 9_000;
        let b = record("udp", "192.0.2.2:1000", 9_000);
        let c = record("udp", "192.0.2.3:1000", 1_000);
        let entries = vec![
            JournalEntry::Put(a.clone()),
            JournalEntry::Put(b.clone()),
            JournalEntry::Put(a2.clone()),
            JournalEntry::Put(c),
            JournalEntry::Delete {
                listener: "udp".into(),
                client: b.client,
            },
        ];
        assert_eq!(replay(entries.clone(), 2_000), vec![a2.clone()]);
        // Deleted, then made again: live.
        let mut again = entries;
        again.push(JournalEntry::Put(b.clone()));
        assert_eq!(replay(again.clone(), 2_000), vec![a2, b]);
        // A deadline is not a moment of life: at 9 000 both ended.
        assert_eq!(replay(again, 9_000), Vec::new());
    }

    #[test]
    fn monotonic_epoch_carries_instants_both_ways() {
        let instant = Instant::now();
        let epoch = MonotonicEpoch {
            instant,
            monotonic_ns: 1_000_000_000_000,
        };
        let later = instant + Duration::from_secs(600);
        assert_eq!(epoch.ns_at(later), 1_600_000_000_000);
        assert_eq!(epoch.instant_at(1_600_000_000_000), Some(later));
        // The next process reads the same clock at another instant: one deadline, the same
        // distance from its reading.
        let next = MonotonicEpoch {
            instant: instant + Duration::from_secs(3),
            monotonic_ns: 1_000_000_000_000 + 7_000_000_000,
        };
        assert_eq!(
            next.instant_at(epoch.ns_at(later)),
            Some(later - Duration::from_secs(4))
        );
        // Before the reading, saturating at 0.
        assert_eq!(
            epoch.ns_at(instant - Duration::from_secs(1)),
            999_000_000_000
        );
        let early = MonotonicEpoch {
            instant: later,
            monotonic_ns: 5,
        };
        assert_eq!(early.ns_at(instant), 0);
    }

    #[test]
    fn a_restored_allocation_waits_ten_seconds_for_its_udp_listener_and_no_longer() {
        let since = Instant::now();
        let udp = Some(ListenerProtocol::TurnUdp);
        assert_eq!(placement(udp, true, since, since), Placement::Adopt);
        assert_eq!(placement(udp, false, since, since), Placement::Wait);
        let almost = since + LISTENER_WAIT - Duration::from_millis(1);
        assert_eq!(placement(udp, false, since, almost), Placement::Wait);
        assert_eq!(
            placement(udp, false, since, since + LISTENER_WAIT),
            Placement::Drop(AdoptError::ListenerGone)
        );
        // Open late, but open: adopted.
        let late = since + LISTENER_WAIT * 3;
        assert_eq!(placement(udp, true, since, late), Placement::Adopt);
        // Gone from the config: at once.
        assert_eq!(
            placement(None, false, since, since),
            Placement::Drop(AdoptError::ListenerGone)
        );
        for protocol in [
            ListenerProtocol::TurnTcp,
            ListenerProtocol::TurnTls,
            ListenerProtocol::TurnDtls,
        ] {
            assert_eq!(
                placement(Some(protocol), true, since, since),
                Placement::Drop(AdoptError::ConnectionEnded),
                "{protocol:?}"
            );
        }
    }
}

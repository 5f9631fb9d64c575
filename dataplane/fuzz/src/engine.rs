//! The two engine targets and the harness they share: an [`Engine`] on a virtual clock, driven
//! as the IO shell drives it (2048-byte output buffer, datagrams under 1600 bytes,
//! `complete_allocate` right after `AllocateRelay`, `poll_close` drained after every call),
//! next to a model of what it must do.
//!
//! The model tracks, per allocation, its client, relay sockets (one per family: an IPv4 and
//! an IPv6 one for a dual allocation), lifetime, permissions and channels, learnt only from
//! the engine's own success responses; and it predicts the outcome of every
//! ChannelData message, Send indication and peer datagram exactly (relay or the drop reason),
//! with the peer admission verdict computed from the config's cluster list
//! (`StaticEndpoint::admits_ip` and `admits_port` per endpoint, the gateway's own addresses).
//!
//! `engine_unauth` input: `[flags][address: 16][port: 2][datagram...]`.
//! `engine_session` input: `[settings]` then operations (see [`run_session`]).

use crate::input::Input;
use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use stun_proto::types::attribute::{Attribute, AttributeStaticType, Fingerprint};
use stun_proto::types::attribute::{
    AttributeType, ErrorCode, MessageIntegrity, MessageIntegritySha256, Nonce, RawAttribute, Realm,
    UnknownAttributes, Username, XorMappedAddress,
};
use stun_proto::types::message::{
    IntegrityAlgorithm, IntegrityKey, Message, MessageClass, MessageType, MessageWrite,
    MessageWriteExt, MessageWriteVec, Method, TransactionId, BINDING,
};
use turn_types::attribute::{
    AdditionalAddressFamily, ChannelNumber, Data, Lifetime, RequestedAddressFamily,
    RequestedTransport, XorPeerAddress, XorRelayedAddress,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, DATA, REFRESH, SEND};
use uturn_dataplane::proto::{
    AllocationLedger, Arrival, ArrivalKind, BoundRelays, Bytes, ClientAction, DropReason, Engine,
    Family, ListenerId, ListenerRef, PeerAction, PeerArrival, RelayBindError, RelayId,
    AMPLIFICATION_FACTOR, CHANNEL_LIFETIME, CHANNEL_NUMBERS, PEER_HEADROOM, PERMISSION_LIFETIME,
};
use uturn_shared::config::{parse_config, StunnerConfig};
use uturn_shared::framing::MAX_FRAME;
use uturn_shared::policy::{canonical_peer, unmapped_ip};
use uturn_shared::snapshot::{ClusterId, Host, RelayAddresses, Snapshot};
use uturn_testkit::engine::{engine_config, long_term_key};

// The virtual clock's Unix epoch, the nonce key, the one static user and the reply buffer
// size are the test kit's, as the engine scenarios use them.
pub use uturn_testkit::engine::{EPOCH_UNIX, NONCE_KEY, OUT_LEN, PASS, USER};
/// The realm of every config here.
pub const REALM: &str = "fuzz.example";
/// Largest datagram the shell hands the engine (it drops 1600 bytes or more).
pub const MAX_DATAGRAM: usize = 1599;
/// Transaction id of the setup Allocate in `engine_session` (a seed retransmits it).
pub const SETUP_ALLOCATE_TXID: u128 = 0xA11A_11A1_1A11_A11A_11A1_1A11;
/// Operations one `engine_session` input may run.
pub const MAX_OPS: usize = 64;

/// The IPv6 relay address the session host's environment names (`STUNNER_ADDRS`): the `udp`
/// and `tcp` listeners relay IPv4 as their address and IPv6 as this, so they make dual
/// allocations.
pub const HOST_RELAY6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0, 0, 0, 0, 0, 2);

/// The session config: two TURN-UDP listeners (IPv4 and IPv6 relay addresses, and IPv6 from
/// the host for the first) with different routes. `{media}` and `{world}` are filled per
/// variant.
const SESSION_CONFIG: &str = r#"
version: v1
auth:
  type: static
  realm: fuzz.example
  credentials:
    username: user1
    password: pass1
listeners:
  - name: udp
    protocol: TURN-UDP
    address: 198.51.100.1
    port: 3478
    routes: [media, loop]
  - name: udp6
    protocol: TURN-UDP
    address: "2001:db8::1"
    port: 3479
    routes: [media, world]
  - name: tcp
    protocol: TURN-TCP
    address: 198.51.100.1
    port: 3478
    routes: [media, loop]
clusters:
  - name: media
    endpoints: {media}
  - name: loop
    endpoints: {loop}
  - name: world
    endpoints: {world}
  - name: other
    endpoints: ["172.16.0.0/12"]
"#;

/// The session config text of `variant` (0: full, 1: narrowed).
pub fn session_config(variant: usize) -> String {
    let (media, lo, world) = match variant {
        0 => (
            r#"["10.0.0.0/8:<5000-6000>", "fd00::/64"]"#,
            r#"["127.0.0.1"]"#,
            r#"["0.0.0.0/0", "::/0"]"#,
        ),
        // Narrowed, as a config update would: the verdicts cached under the old generation
        // must be made again.
        _ => (r#"["10.0.0.0/8:<1-100>"]"#, "[]", r#"["0.0.0.0/0"]"#),
    };
    SESSION_CONFIG
        .replace("{media}", media)
        .replace("{loop}", lo)
        .replace("{world}", world)
}

const UNAUTH_STATIC: &str = r#"
version: v1
auth:
  type: static
  realm: fuzz.example
  credentials: {username: user1, password: pass1}
listeners:
  - name: udp
    protocol: TURN-UDP
    address: 198.51.100.1
    routes: [any]
  - name: tcp
    protocol: TURN-TCP
    address: 198.51.100.1
    routes: [any]
clusters:
  - name: any
    endpoints: ["0.0.0.0/0", "::/0"]
"#;

/// A config and the snapshot built from it.
pub struct Variant {
    /// The validated config.
    pub cfg: StunnerConfig,
    /// Its snapshot (generation 1).
    pub snap: Snapshot,
}

fn variant(text: &str, host: &Host) -> Variant {
    let cfg = parse_config(text).unwrap_or_else(|e| panic!("harness config: {e}"));
    let snap = Snapshot::from_config_on_host(&cfg, 1, &|_| Vec::new(), host);
    Variant { cfg, snap }
}

/// The session configs (full, narrowed), on a host that names [`HOST_RELAY6`].
pub fn session_variants() -> &'static [Variant] {
    static V: OnceLock<Vec<Variant>> = OnceLock::new();
    V.get_or_init(|| {
        let host = Host {
            ips: Vec::new(),
            relay: RelayAddresses {
                v4: None,
                v6: Some(HOST_RELAY6),
            },
        };
        vec![
            variant(&session_config(0), &host),
            variant(&session_config(1), &host),
        ]
    })
}

/// The unauthenticated configs (static, ephemeral auth).
pub fn unauth_variants() -> &'static [Variant] {
    static V: OnceLock<Vec<Variant>> = OnceLock::new();
    V.get_or_init(|| {
        let ephemeral = UNAUTH_STATIC.replace(
            "type: static\n  realm: fuzz.example\n  credentials: {username: user1, password: pass1}",
            "type: ephemeral\n  realm: fuzz.example\n  credentials: {secret: s3cr3t}",
        );
        assert_ne!(ephemeral, UNAUTH_STATIC);
        let host = Host::default();
        vec![variant(UNAUTH_STATIC, &host), variant(&ephemeral, &host)]
    })
}

/// Whether `UTURN_FUZZ_TRACE` is set: the harness then prints every call and its outcome.
pub fn tracing() -> bool {
    static T: OnceLock<bool> = OnceLock::new();
    *T.get_or_init(|| std::env::var_os("UTURN_FUZZ_TRACE").is_some())
}

/// The virtual clock's epoch (one per process; only differences from it matter).
pub fn epoch() -> Instant {
    static E: OnceLock<Instant> = OnceLock::new();
    *E.get_or_init(Instant::now)
}

/// The user's keys, made once: SHA-1, SHA-256, and SHA-1 with a wrong password.
fn keys() -> &'static [IntegrityKey; 3] {
    static K: OnceLock<[IntegrityKey; 3]> = OnceLock::new();
    K.get_or_init(|| {
        [
            long_term_key(USER, PASS, REALM, IntegrityAlgorithm::Sha1),
            long_term_key(USER, PASS, REALM, IntegrityAlgorithm::Sha256),
            long_term_key(USER, "wrong", REALM, IntegrityAlgorithm::Sha1),
        ]
    })
}

/// Clients of `engine_session`: (listener index, address).
pub const CLIENTS: [(usize, &str); 5] = [
    (0, "192.0.2.10:40000"),
    (0, "192.0.2.10:40001"),
    (1, "[2001:db8::10]:40000"),
    (1, "192.0.2.10:40000"),
    // TURN-TCP: a stream connection's frames, up to MAX_FRAME bytes.
    (2, "192.0.2.10:40000"),
];

/// Peers the operations pick by index (and the XOR-PEER-ADDRESS mask of a request).
pub const PEERS: [&str; 16] = [
    "10.1.2.3:5500",           // 0: permitted and bound to 0x4001 at setup
    "10.1.2.3:7000",           // 1: outside media's port range
    "10.1.2.4:5500",           // 2: admitted, no permission
    "[::ffff:10.1.2.3]:5500",  // 3: mapped form of 0
    "[64:ff9b::a01:203]:5500", // 4: NAT64 form of 0
    "[fd00::5]:5000",          // 5: media, IPv6
    "172.16.0.1:5000",         // 6: an unrouted cluster
    "127.0.0.1:5000",          // 7: loop lists it exactly
    "127.0.0.2:5000",          // 8: loopback, not listed
    "198.51.100.1:5000",       // 9: the gateway's own relay address
    "8.8.8.8:53",              // 10: world (udp6 routes it)
    "[2001:db8:1::1]:5000",    // 11: world, IPv6
    "[fe80::1]:5000",          // 12: link-local
    "169.254.169.254:80",      // 13: cloud metadata
    "[2002:a01:203::1]:5500",  // 14: 6to4 form of 0
    "[::10.1.2.3]:5500",       // 15: IPv4-compatible form of 0
];

/// Index of the setup peer in [`PEERS`] and the channel bound to it.
pub const SETUP_PEER: usize = 0;
/// The channel bound at setup.
pub const SETUP_CHANNEL: u16 = 0x4001;

fn peer(i: usize) -> SocketAddr {
    PEERS[i % PEERS.len()].parse().unwrap()
}

/// Methods an authenticated request picks by index (the last takes a raw method).
pub const METHODS: [Method; 7] = [
    ALLOCATE,
    REFRESH,
    CREATE_PERMISSION,
    CHANNEL_BIND,
    SEND,
    BINDING,
    DATA,
];

/// The TURN methods uturn serves (any other request but Binding gets 400).
const TURN_METHODS: [Method; 4] = [ALLOCATE, REFRESH, CREATE_PERMISSION, CHANNEL_BIND];

/// Comprehension-required attribute types uturn understands in a TURN request (the
/// dataplane's `proto::wire::KNOWN_REQUIRED`, which is private).
const KNOWN_REQUIRED: [u16; 22] = [
    0x0001, 0x0006, 0x0008, 0x0009, 0x000A, 0x000C, 0x000D, 0x0012, 0x0013, 0x0014, 0x0015, 0x0016,
    0x0017, 0x0018, 0x0019, 0x001A, 0x001C, 0x001D, 0x0020, 0x0022, 0x0024, 0x0025,
];

/// The most attribute types a 420's UNKNOWN-ATTRIBUTES lists.
pub const MAX_UNKNOWN_LISTED: usize = 32;

/// What a 420 to `req` lists: its comprehension-required attribute types (below 0x8000) that
/// uturn does not understand, each once, in order of first appearance, the first
/// [`MAX_UNKNOWN_LISTED`].
fn unknown_required(req: &Message<'_>) -> Vec<AttributeType> {
    let mut all: Vec<AttributeType> = req
        .iter_attributes()
        .map(|(_, a)| a.get_type())
        .filter(|t| u16::from(*t) < 0x8000 && !KNOWN_REQUIRED.contains(&u16::from(*t)))
        .collect();
    let mut seen = std::collections::HashSet::new();
    all.retain(|t| seen.insert(*t));
    all.truncate(MAX_UNKNOWN_LISTED);
    all
}

struct AllocModel {
    client: usize,
    /// Its slot: relay socket ids `2 * slot` (IPv4) and `2 * slot + 1` (IPv6).
    slot: u32,
    /// The ids of its relay sockets open.
    relays: Vec<u32>,
    expires: Instant,
    allocate_response: Vec<u8>,
    permissions: HashMap<IpAddr, Instant>,
    channels: HashMap<u16, (SocketAddr, Instant)>,
}

/// What the model predicts for a datagram.
#[derive(Debug, PartialEq, Eq)]
enum Expect {
    Relay {
        relay: u32,
        peer: SocketAddr,
        payload: std::ops::Range<usize>,
        cluster: ClusterId,
    },
    Drop(DropReason),
    /// A request: answered (`Reply`) or, for an Allocate, `AllocateRelay`.
    Answer,
}

/// The harness: an engine, its snapshot, the virtual clock and the model.
pub struct Harness {
    engine: Engine,
    ledger: Arc<AllocationLedger>,
    variants: &'static [Variant],
    variant: usize,
    snap: Snapshot,
    now: Instant,
    out: Vec<u8>,
    next_port: u16,
    clients: Vec<(usize, SocketAddr)>,
    nonces: Vec<Option<String>>,
    /// By slot.
    allocs: HashMap<u32, AllocModel>,
    /// Relay sockets the engine must close though their allocation lives on (or never was):
    /// one relay of a dual allocation deleted, or bound for an Allocate that failed.
    to_close: Vec<u32>,
    /// Whether an allocation may be made at all (false: unauthenticated input only).
    authenticated: bool,
}

impl Harness {
    /// An engine with `max_permissions` and `max_allocations`, the first of `variants`, and
    /// `clients`.
    pub fn new(
        variants: &'static [Variant],
        clients: Vec<(usize, SocketAddr)>,
        max_permissions: usize,
        max_allocations: usize,
        authenticated: bool,
    ) -> Harness {
        let mut config = engine_config(epoch());
        // 0 turns the 401/438 rate limit off, so it hides no path.
        config.limits.challenge_rate = 0;
        config.limits.max_permissions = max_permissions;
        config.limits.max_allocations = max_allocations;
        let ledger = config.ledger.clone();
        let n = clients.len();
        Harness {
            engine: Engine::new(config),
            ledger,
            variants,
            variant: 0,
            snap: variants[0].snap.clone(),
            now: epoch(),
            out: vec![0; OUT_LEN],
            next_port: 50000,
            clients,
            nonces: vec![None; n],
            allocs: HashMap::new(),
            to_close: Vec::new(),
            authenticated,
        }
    }

    fn cfg(&self) -> &StunnerConfig {
        &self.variants[self.variant].cfg
    }

    fn listener_id(listener: usize) -> ListenerId {
        ListenerId(listener as u32 + 1)
    }

    fn has_allocation(&self, client: usize) -> bool {
        let (l, addr) = self.clients[client];
        self.engine.has_allocation(Self::listener_id(l), addr)
    }

    fn alloc_of(&self, client: usize) -> Option<&AllocModel> {
        self.allocs.values().find(|a| a.client == client)
    }

    /// The admission verdict for `peer` on `listener`, from the config's cluster list.
    fn oracle(&self, listener: usize, ip: IpAddr, port: Option<u16>) -> Option<ClusterId> {
        let cfg = self.cfg();
        let name = &self.snap.listeners[listener].name;
        let l = cfg.listeners.iter().find(|l| &l.name == name)?;
        let ip = canonical_peer(ip);
        let own = self
            .snap
            .listeners
            .iter()
            .flat_map(|l| l.relay.iter())
            .map(canonical_peer)
            .any(|a| !a.is_unspecified() && a == ip);
        let full = if ip.is_ipv4() { 32 } else { 128 };
        let port = port.filter(|_| self.snap.enforce_ports);
        let routes = cfg
            .turn_server(l)
            .map(|s| s.clusters.as_slice())
            .unwrap_or_default();
        for r in routes {
            let Some(c) = self.snap.clusters.iter().position(|c| &c.name == r) else {
                continue;
            };
            let hit = self.snap.clusters[c].endpoints.iter().any(|e| {
                e.admits_ip(ip)
                    && (!own || e.prefix_len == full)
                    && port.is_none_or(|p| e.admits_port(p))
            });
            if hit {
                return Some(c);
            }
        }
        None
    }

    /// Swaps to the other config variant under a new generation.
    pub fn swap_config(&mut self) {
        let generation = self.snap.generation + 1;
        self.variant = (self.variant + 1) % self.variants.len();
        self.snap = self.variants[self.variant].snap.clone();
        self.snap.generation = generation;
    }

    /// Moves the clock on and sweeps, then checks what expired.
    pub fn advance(&mut self, by: Duration) {
        self.now += by;
        self.engine.handle_timeout(self.now);
        let now = self.now;
        let mut expired: Vec<u32> = self
            .allocs
            .values()
            .filter(|a| a.expires <= now)
            .flat_map(|a| a.relays.iter().copied())
            .collect();
        expired.sort_unstable();
        let mut closed = self.drain_closes();
        closed.sort_unstable();
        // The allocations that expired were closed and removed from the model by the drain.
        assert_eq!(
            closed,
            expired,
            "sweep at +{:?} closed the wrong relays",
            now - epoch()
        );
        self.check_global();
    }

    /// Relays the engine asked to close; an allocation leaves the model with its last.
    fn drain_closes(&mut self) -> Vec<u32> {
        let mut closed = Vec::new();
        while let Some(RelayId(r)) = self.engine.poll_close() {
            if let Some(i) = self.to_close.iter().position(|&c| c == r) {
                self.to_close.swap_remove(i);
                continue;
            }
            let Some(a) = self.allocs.get_mut(&(r >> 1)) else {
                panic!("engine closed relay {r}, which holds no allocation");
            };
            let Some(i) = a.relays.iter().position(|&c| c == r) else {
                panic!("engine closed relay {r}, which its allocation does not have");
            };
            a.relays.swap_remove(i);
            if a.relays.is_empty() {
                let a = self.allocs.remove(&(r >> 1)).unwrap();
                assert!(
                    !self.has_allocation(a.client),
                    "relay {r} closed but client {} still has an allocation",
                    a.client
                );
            }
            closed.push(r);
        }
        assert!(
            self.to_close.is_empty(),
            "relays {:?} not closed",
            self.to_close
        );
        closed
    }

    /// Consistency of the engine, the ledger and the model at rest.
    fn check_global(&mut self) {
        let count = self.engine.allocation_count();
        let per_client = (0..self.clients.len())
            .filter(|&c| self.has_allocation(c))
            .count();
        assert_eq!(
            count, per_client,
            "allocation_count {count} != allocations of known 5-tuples {per_client}"
        );
        assert_eq!(
            count,
            self.allocs.len(),
            "engine and model disagree on allocations"
        );
        for a in self.allocs.values() {
            assert!(self.has_allocation(a.client));
        }
        assert_eq!(
            self.ledger.total(),
            count,
            "ledger holds {} for {count} allocations",
            self.ledger.total()
        );
        let stats = self.engine.stats();
        assert_eq!(
            stats.allocations_created - stats.allocations_deleted,
            count as u64,
            "created - deleted != live"
        );
        assert_eq!(
            stats.dropped[DropReason::Internal.index()],
            0,
            "a Drop(Internal)"
        );
        if count > 0 {
            assert!(
                self.engine.poll_timeout().is_some(),
                "allocations but no sweep scheduled: they would never expire"
            );
        }
        if !self.authenticated {
            assert_eq!(count, 0, "unauthenticated input created an allocation");
            assert_eq!(stats.allocations_created, 0);
        }
    }

    /// The model's prediction for a client datagram.
    fn expect_client(&self, client: usize, data: &[u8]) -> Expect {
        let (listener, _) = self.clients[client];
        let alloc = self.alloc_of(client);
        match data.first().map(|b| b >> 6) {
            Some(0b01) => {
                if data.len() < 4 {
                    return Expect::Drop(DropReason::Malformed);
                }
                let number = u16::from_be_bytes([data[0], data[1]]);
                let len = usize::from(u16::from_be_bytes([data[2], data[3]]));
                if !CHANNEL_NUMBERS.contains(&number) || 4 + len > data.len() {
                    return Expect::Drop(DropReason::Malformed);
                }
                let Some(alloc) = alloc else {
                    return Expect::Drop(DropReason::NoAllocation);
                };
                let Some(&(peer, _)) = alloc
                    .channels
                    .get(&number)
                    .filter(|(_, exp)| *exp > self.now)
                else {
                    return Expect::Drop(DropReason::NoChannel);
                };
                match self.oracle(listener, peer.ip(), Some(peer.port())) {
                    Some(cluster) => Expect::Relay {
                        relay: relay_of(alloc, peer),
                        peer,
                        payload: 4..4 + len,
                        cluster,
                    },
                    None => Expect::Drop(DropReason::NotAdmitted),
                }
            }
            Some(0b00) => {
                let Ok(msg) = Message::from_bytes(data) else {
                    return Expect::Drop(DropReason::Malformed);
                };
                match msg.class() {
                    MessageClass::Request => Expect::Answer,
                    MessageClass::Indication if msg.method() == SEND => {
                        let Some(alloc) = alloc else {
                            return Expect::Drop(DropReason::NoAllocation);
                        };
                        let (Ok(p), Some((offset, d))) = (
                            msg.attribute::<XorPeerAddress>(),
                            msg.raw_attribute_and_offset(Data::TYPE),
                        ) else {
                            return Expect::Drop(DropReason::Malformed);
                        };
                        let p = p.addr(msg.transaction_id());
                        let p = SocketAddr::new(unmapped_ip(p.ip()), p.port());
                        if !self.permitted(alloc, p.ip()) {
                            return Expect::Drop(DropReason::NoPermission);
                        }
                        match self.oracle(listener, p.ip(), Some(p.port())) {
                            Some(cluster) => Expect::Relay {
                                relay: relay_of(alloc, p),
                                peer: p,
                                payload: offset + 4..offset + 4 + d.length() as usize,
                                cluster,
                            },
                            None => Expect::Drop(DropReason::NotAdmitted),
                        }
                    }
                    _ => Expect::Drop(DropReason::Unhandled),
                }
            }
            _ => Expect::Drop(DropReason::Malformed),
        }
    }

    /// The largest message the shell hands the engine from `client`'s listener.
    fn max_message(&self, client: usize) -> usize {
        if self.snap.listeners[self.clients[client].0]
            .protocol
            .is_datagram()
        {
            MAX_DATAGRAM
        } else {
            MAX_FRAME
        }
    }

    /// Whether a live permission covers `ip`.
    fn permitted(&self, a: &AllocModel, ip: IpAddr) -> bool {
        debug_assert!(a.permissions.keys().all(|&p| relays_to(a, p)));
        a.permissions.get(&ip).is_some_and(|exp| *exp > self.now)
    }

    /// Sends `data` from client `client`; `bind_ok`: whether a relay socket bind succeeds.
    pub fn client(&mut self, client: usize, data: &[u8], bind_ok: bool) {
        let data = &data[..data.len().min(self.max_message(client))];
        let expect = self.expect_client(client, data);
        let had = self.has_allocation(client);
        let (listener, from) = self.clients[client];
        let arrival = Arrival {
            now: self.now,
            snap: &self.snap,
            listener: ListenerRef {
                id: Self::listener_id(listener),
                spec: &self.snap.listeners[listener],
            },
            client: from,
            kind: ArrivalKind::Straight,
        };
        let action = self.engine.handle_client(arrival, data, &mut self.out);
        if tracing() {
            eprintln!(
                "+{:?} client {client} {} bytes: {action:?} (model {expect:?})",
                self.now - epoch(),
                data.len()
            );
            if let ClientAction::Reply(n) = action {
                if let Ok(m) = Message::from_bytes(&self.out[..n]) {
                    let code = m.attribute::<ErrorCode>().map(|e| e.code()).ok();
                    eprintln!("    reply {:?} {:?} error {code:?}", m.method(), m.class());
                }
            }
        }
        match (&expect, action) {
            (Expect::Answer, ClientAction::Reply(n)) => self.reply(client, data, n),
            (Expect::Answer, ClientAction::Drop(DropReason::Amplification)) => {
                // The largest reply to an unauthenticated request is a 420 naming 32
                // attributes (116 bytes); no request of 39 bytes or more loses its reply.
                assert!(
                    AMPLIFICATION_FACTOR * data.len() < 116,
                    "a {}-byte request dropped for amplification",
                    data.len()
                );
            }
            (Expect::Answer, ClientAction::AllocateRelay(req)) => {
                assert!(
                    self.authenticated,
                    "unauthenticated input reached AllocateRelay: {:02x?}",
                    data
                );
                assert!(!had, "AllocateRelay for a 5-tuple that holds an allocation");
                let relay = self.snap.listeners[listener].relay;
                assert!(
                    relay.get(req.family == Family::V6).is_some(),
                    "relay family {:?} is not one the listener serves ({relay})",
                    req.family
                );
                assert_eq!(req.family, req.relay.family());
                let slot = req.relay.0 >> 1;
                assert!(
                    !self.allocs.contains_key(&slot),
                    "AllocateRelay reuses live slot {slot}"
                );
                let msg = Message::from_bytes(data).expect("Allocate parsed");
                assert_eq!(msg.method(), ALLOCATE);
                // RFC 8656's code, or the draft code coturn's clients send (0x8032).
                let dual = msg.has_attribute(AdditionalAddressFamily::TYPE)
                    || msg.has_attribute(AttributeType::new(0x8032));
                if let Some(additional) = req.additional {
                    assert!(dual, "an additional relay not asked for");
                    assert_eq!(
                        (req.family, additional.family(), additional.0 >> 1),
                        (Family::V4, Family::V6, slot)
                    );
                    assert!(relay.v6.is_some(), "an IPv6 relay the listener does not serve");
                }
                self.next_port = self.next_port.wrapping_add(2).max(1024);
                let port = self.next_port;
                let failed = || {
                    Err(RelayBindError {
                        kind: std::io::ErrorKind::AddrInUse,
                    })
                };
                // The IPv6 socket of a dual allocation fails to bind for a quarter of the
                // requests (by the last byte of their MESSAGE-INTEGRITY); bound even when the
                // first failed, so that the engine must close it.
                let additional_ok = data.last().is_some_and(|b| b & 3 != 0);
                let bound = BoundRelays {
                    relay: if bind_ok { Ok(port) } else { failed() },
                    additional: req.additional.map(|_| {
                        if additional_ok {
                            Ok(port.wrapping_add(1))
                        } else {
                            failed()
                        }
                    }),
                };
                if tracing() {
                    eprintln!("    AllocateRelay {req:?} -> bind {bound:?}");
                }
                let n = self
                    .engine
                    .complete_allocate(self.now, req.relay, bound, &mut self.out)
                    .expect("complete_allocate wrote no reply");
                assert!(n <= self.out.len());
                let reply = self.out[..n].to_vec();
                let r = Message::from_bytes(&reply).expect("Allocate reply does not parse");
                assert_eq!(r.transaction_id(), msg.transaction_id());
                assert_eq!(r.method(), ALLOCATE);
                assert!(
                    r.validate_integrity_with_key(&keys()[0]).is_ok(),
                    "Allocate reply not signed with the user's key"
                );
                if bind_ok {
                    assert_eq!(r.class(), MessageClass::Success);
                    let txid = r.transaction_id();
                    let relayed: Vec<SocketAddr> = (0..)
                        .map_while(|i| r.nth_attribute::<XorRelayedAddress>(i).ok())
                        .map(|a| a.addr(txid))
                        .collect();
                    let mut want = vec![SocketAddr::new(
                        relay.get(req.family == Family::V6).unwrap(),
                        port,
                    )];
                    let mut relays = vec![req.relay.0];
                    if let (Some(additional), true) = (req.additional, additional_ok) {
                        want.push(SocketAddr::new(relay.v6.unwrap().into(), port.wrapping_add(1)));
                        relays.push(additional.0);
                    }
                    assert_eq!(relayed, want, "XOR-RELAYED-ADDRESS");
                    // RFC 8656 §7.2: a dual Allocate's IPv6 relay not had is said, not failed.
                    assert_eq!(
                        r.has_attribute(AttributeType::new(0x8001)),
                        dual && relays.len() == 1,
                        "ADDRESS-ERROR-CODE"
                    );
                    let mapped = r.attribute::<XorMappedAddress>().expect("mapped").addr(txid);
                    assert_eq!(mapped, from);
                    let lifetime = r.attribute::<Lifetime>().expect("lifetime").seconds();
                    assert!((1..3600).contains(&lifetime), "granted lifetime {lifetime}");
                    assert!(self.has_allocation(client));
                    self.allocs.insert(
                        slot,
                        AllocModel {
                            client,
                            slot,
                            relays,
                            expires: self.now + Duration::from_secs(u64::from(lifetime)),
                            allocate_response: reply,
                            permissions: HashMap::new(),
                            channels: HashMap::new(),
                        },
                    );
                } else {
                    assert_eq!(r.class(), MessageClass::Error);
                    assert_eq!(r.attribute::<ErrorCode>().map(|e| e.code()), Ok(508));
                    assert!(!self.has_allocation(client));
                    if let (Some(additional), true) = (req.additional, additional_ok) {
                        self.to_close.push(additional.0);
                    }
                }
            }
            (
                Expect::Relay {
                    relay,
                    peer,
                    payload,
                    cluster,
                },
                ClientAction::Relay {
                    relay: r,
                    peer: p,
                    payload: range,
                    cluster: c,
                },
            ) => {
                assert!(range.start <= range.end && range.end <= data.len(), "payload {range:?} outside the {}-byte input", data.len());
                assert_eq!((*relay, *peer, payload, *cluster), (r.0, p, &range, c), "relay differs from the model");
                assert_eq!(r.family(), family_of(p.ip()), "relayed from a socket of another family");
            }
            (Expect::Drop(want), ClientAction::Drop(got)) => {
                assert_eq!(*want, got, "drop reason differs from the model for {data:02x?}");
            }
            (expect, action) => panic!(
                "client {client} datagram {data:02x?}: model expects {expect:?}, engine did {action:?}"
            ),
        }
        self.drain_closes();
        self.check_global();
    }

    /// Checks a reply to a request and updates the model from it.
    fn reply(&mut self, client: usize, data: &[u8], n: usize) {
        assert!(
            n <= self.out.len(),
            "Reply({n}) past the {}-byte buffer",
            self.out.len()
        );
        let reply = self.out[..n].to_vec();
        let req = Message::from_bytes(data).expect("a reply to a request that does not parse");
        let r = Message::from_bytes(&reply)
            .unwrap_or_else(|e| panic!("reply does not parse ({e:?}): {reply:02x?}"));
        assert_eq!(
            r.transaction_id(),
            req.transaction_id(),
            "reply transaction id"
        );
        assert_eq!(r.method(), req.method(), "reply method");
        assert!(r.class().is_response(), "reply class {:?}", r.class());
        let (_, from) = self.clients[client];
        let signed = r.has_attribute(MessageIntegrity::TYPE);
        if signed {
            assert!(
                self.authenticated,
                "unauthenticated request got a signed reply"
            );
            assert!(
                r.validate_integrity_with_key(&keys()[0]).is_ok(),
                "reply MESSAGE-INTEGRITY does not validate"
            );
        }
        assert!(!r.has_attribute(MessageIntegritySha256::TYPE));
        if !signed {
            // RFC 9000 §8.1's rule: a reply not signed (so to a request that did not
            // authenticate, or a 441) is at most 3x the request.
            assert!(
                n <= AMPLIFICATION_FACTOR * data.len(),
                "{n}-byte unsigned reply to a {}-byte request",
                data.len()
            );
        }
        if req.method() == BINDING {
            assert_eq!(r.class(), MessageClass::Success, "Binding refused");
            let mapped = r
                .attribute::<XorMappedAddress>()
                .expect("Binding reply XOR-MAPPED-ADDRESS")
                .addr(r.transaction_id());
            assert_eq!(mapped, from);
            assert!(!signed);
            // stunnerd's amplification bound: at most ~2x the request.
            assert!(
                n * 10 <= data.len() * 22,
                "Binding reply {n} bytes for {}",
                data.len()
            );
            assert_eq!(
                r.has_attribute(Fingerprint::TYPE),
                req.has_attribute(Fingerprint::TYPE)
            );
            return;
        }
        let code = r.attribute::<ErrorCode>().ok().map(|e| e.code());
        if !TURN_METHODS.contains(&req.method()) {
            // Any other request, whatever its attributes, is refused.
            assert_eq!(code, Some(400), "{:?} request not refused", req.method());
        } else {
            // RFC 8489 §6.3.1, before authentication; each type once, at most 32.
            let unknown = unknown_required(&req);
            if unknown.is_empty() {
                assert_ne!(code, Some(420), "420 without an unknown attribute");
            } else {
                assert_eq!(
                    code,
                    Some(420),
                    "unknown attributes {unknown:?} not refused"
                );
                assert!(!signed, "420 signed");
                let listed = r
                    .attribute::<UnknownAttributes>()
                    .expect("420 UNKNOWN-ATTRIBUTES");
                assert_eq!(listed, UnknownAttributes::new(&unknown), "420 lists");
            }
        }
        if r.class() == MessageClass::Error {
            let code = code.unwrap_or_else(|| panic!("error reply without ERROR-CODE"));
            assert!((300..700).contains(&code), "error code {code}");
            if code == 401 || code == 438 {
                let nonce = r.attribute::<Nonce>().expect("challenge NONCE");
                let realm = r.attribute::<Realm>().expect("challenge REALM");
                assert_eq!(realm.realm(), REALM);
                self.nonces[client] = Some(nonce.nonce().to_owned());
            }
            return;
        }
        // Success for a TURN method: only ever to the one user, for an allocation it holds.
        assert!(signed, "unsigned success to {:?}", req.method());
        let slot = self
            .alloc_of(client)
            .map(|a| a.slot)
            .unwrap_or_else(|| panic!("success to {:?} without an allocation", req.method()));
        let now = self.now;
        let txid = req.transaction_id();
        let method = req.method();
        if method == ALLOCATE {
            let a = &self.allocs[&slot];
            assert_eq!(
                reply, a.allocate_response,
                "retransmitted Allocate got another answer"
            );
        } else if method == REFRESH {
            let lifetime = r
                .attribute::<Lifetime>()
                .expect("Refresh LIFETIME")
                .seconds();
            // RFC 8656 §7.3: a REQUESTED-ADDRESS-FAMILY names a relay the allocation has.
            let family = req.attribute::<RequestedAddressFamily>().ok().map(|f| {
                if f.family() == turn_types::AddressFamily::IPV4 {
                    Family::V4
                } else {
                    Family::V6
                }
            });
            let held = self.has_allocation(client);
            let a = self.allocs.get_mut(&slot).unwrap();
            if let Some(family) = family {
                assert!(
                    a.relays.contains(&(slot << 1 | family as u32)),
                    "Refresh naming {family:?}, which the allocation has no relay of"
                );
            }
            if lifetime == 0 {
                match family {
                    // LIFETIME 0 and a family, on a dual allocation: that relay is deleted,
                    // with the permissions and channels of its family.
                    Some(family) if a.relays.len() == 2 => {
                        assert!(held, "one relay deleted, not both");
                        let r = slot << 1 | family as u32;
                        a.relays.retain(|&c| c != r);
                        a.permissions.retain(|&ip, _| family_of(ip) != family);
                        a.channels.retain(|_, (p, _)| family_of(p.ip()) != family);
                        self.to_close.push(r);
                    }
                    _ => assert!(!held, "Refresh 0 left the allocation"),
                }
            } else {
                assert!(lifetime < 3600, "Refresh granted {lifetime}");
                a.expires = now + Duration::from_secs(u64::from(lifetime));
            }
        } else if method == CREATE_PERMISSION {
            let mut peers = Vec::new();
            for i in 0.. {
                match req.nth_attribute::<XorPeerAddress>(i) {
                    Ok(p) => peers.push(unmapped_ip(p.addr(txid).ip())),
                    Err(_) => break,
                }
            }
            assert!(!peers.is_empty(), "CreatePermission success without a peer");
            let listener = self.clients[client].0;
            for ip in peers {
                assert!(
                    self.oracle(listener, ip, None).is_some(),
                    "permission to {ip} granted against the policy"
                );
                let a = self.allocs.get_mut(&slot).unwrap();
                assert!(relays_to(a, ip), "permission to {ip}, a family not relayed");
                a.permissions.insert(ip, now + PERMISSION_LIFETIME);
            }
        } else if method == CHANNEL_BIND {
            let number = req
                .attribute::<ChannelNumber>()
                .expect("bound CHANNEL-NUMBER")
                .channel();
            let p = req
                .attribute::<XorPeerAddress>()
                .expect("bound peer")
                .addr(txid);
            let p = SocketAddr::new(unmapped_ip(p.ip()), p.port());
            assert!(CHANNEL_NUMBERS.contains(&number));
            let listener = self.clients[client].0;
            assert!(
                self.oracle(listener, p.ip(), None).is_some(),
                "channel to {p} granted against the policy"
            );
            let a = self.allocs.get_mut(&slot).unwrap();
            assert!(relays_to(a, p.ip()), "channel to {p}, a family not relayed");
            for (&other, &(q, exp)) in &a.channels {
                if exp > now {
                    assert!(
                        (other == number) == (q == p),
                        "channel {number:#x} -> {p} bound while {other:#x} -> {q} is live"
                    );
                }
            }
            a.channels.insert(number, (p, now + CHANNEL_LIFETIME));
            a.permissions.insert(p.ip(), now + PERMISSION_LIFETIME);
        } else {
            panic!("success to method {method:?}");
        }
    }

    /// The model's prediction for a peer datagram: (client, listener, admitting cluster, the
    /// channel number if framed in place), or the drop reason.
    fn expect_peer(
        &self,
        relay: u32,
        peer: SocketAddr,
    ) -> Result<(usize, usize, ClusterId, Option<u16>), DropReason> {
        // A socket the allocation does not have (or no allocation): nothing to relay to.
        let Some(a) = self
            .allocs
            .get(&(relay >> 1))
            .filter(|a| a.relays.contains(&relay))
        else {
            return Err(DropReason::NoAllocation);
        };
        let listener = self.clients[a.client].0;
        let peer = SocketAddr::new(unmapped_ip(peer.ip()), peer.port());
        let channel = a
            .channels
            .iter()
            .find(|(_, (p, exp))| *p == peer && *exp > self.now)
            .map(|(&n, _)| n);
        if channel.is_none() && !self.permitted(a, peer.ip()) {
            return Err(DropReason::NoPermission);
        }
        match self.oracle(listener, peer.ip(), Some(peer.port())) {
            Some(c) => Ok((a.client, listener, c, channel)),
            None => Err(DropReason::NotAdmitted),
        }
    }

    /// A datagram from `peer` to relay `relay`.
    pub fn peer(&mut self, relay: u32, peer: SocketAddr, payload: &[u8]) {
        let payload = &payload[..payload.len().min(MAX_DATAGRAM)];
        let expect = self.expect_peer(relay, peer);
        let mut buf = vec![0u8; PEER_HEADROOM + payload.len()];
        buf[PEER_HEADROOM..].copy_from_slice(payload);
        let arrival = PeerArrival {
            now: self.now,
            snap: &self.snap,
            relay: RelayId(relay),
            peer,
        };
        let action = self.engine.handle_peer(arrival, &mut buf, &mut self.out);
        if tracing() {
            eprintln!(
                "+{:?} peer {peer} -> relay {relay}: {action:?} (model {expect:?})",
                self.now - epoch()
            );
        }
        match (expect, action) {
            (Err(want), PeerAction::Drop(got)) => {
                assert_eq!(want, got, "peer {peer} -> relay {relay}")
            }
            (
                Ok((client, listener, want_cluster, channel)),
                PeerAction::ToClient {
                    listener: l,
                    client: to,
                    bytes,
                    cluster,
                    payload_len,
                    forwarded,
                },
            ) => {
                assert!(self.authenticated, "ToClient without an allocation");
                assert!(!forwarded, "ToClient through a sibling, with no forwarding");
                assert_eq!(
                    l,
                    Self::listener_id(listener),
                    "ToClient on another listener"
                );
                assert_eq!(to, self.clients[client].1, "ToClient to another client");
                assert_eq!(
                    cluster, want_cluster,
                    "ToClient admitted by another cluster"
                );
                assert_eq!(payload_len, payload.len());
                let cpeer = SocketAddr::new(unmapped_ip(peer.ip()), peer.port());
                match (channel, bytes) {
                    (Some(number), Bytes::Input(range)) => {
                        assert_eq!(range, 0..PEER_HEADROOM + payload.len());
                        assert_eq!(u16::from_be_bytes([buf[0], buf[1]]), number);
                        assert_eq!(
                            usize::from(u16::from_be_bytes([buf[2], buf[3]])),
                            payload.len()
                        );
                        assert_eq!(&buf[PEER_HEADROOM..], payload);
                    }
                    (None, Bytes::Output(n)) => {
                        assert!(n <= self.out.len());
                        let m =
                            Message::from_bytes(&self.out[..n]).expect("Data indication parses");
                        assert_eq!(m.class(), MessageClass::Indication);
                        assert_eq!(m.method(), DATA);
                        let p = m
                            .attribute::<XorPeerAddress>()
                            .expect("Data indication peer");
                        assert_eq!(p.addr(m.transaction_id()), cpeer);
                        assert_eq!(
                            m.attribute::<Data>().expect("Data indication DATA").data(),
                            payload
                        );
                    }
                    (channel, bytes) => {
                        panic!("peer {peer}: channel {channel:?} but bytes {bytes:?}")
                    }
                }
            }
            (expect, action) => panic!(
                "peer {peer} -> relay {relay}: model expects {expect:?}, engine did {action:?}"
            ),
        }
        self.drain_closes();
        self.check_global();
    }

    /// An authenticated request from `client`: the harness adds USERNAME, REALM, the nonce
    /// learnt from a 401 and MESSAGE-INTEGRITY after the fuzzed attributes (unless `flags` says
    /// to break one of them).
    pub fn authenticated_request(&mut self, client: usize, req: &AuthRequest<'_>) {
        if self.nonces[client].is_none() {
            self.learn_nonce(client);
        }
        let bytes = req.build(self.nonces[client].as_deref());
        if bytes.len() <= self.max_message(client) {
            self.client(client, &bytes, req.flags & AuthRequest::BIND_FAILS == 0);
        }
    }

    /// Sends an unsigned Refresh, whose 401 carries the client's nonce (with a LIFETIME: 28
    /// bytes, so the 401 fits 3x of it).
    pub fn learn_nonce(&mut self, client: usize) {
        let mut probe = Message::builder_request(REFRESH, MessageWriteVec::new());
        probe.add_attribute(&Lifetime::new(600)).unwrap();
        let probe = probe.finish();
        self.client(client, &probe, true);
        assert!(self.nonces[client].is_some(), "no nonce learnt from a 401");
    }

    /// The usual start of a session: client 0 allocates, permits the setup peer and binds
    /// [`SETUP_CHANNEL`] to it.
    pub fn setup(&mut self) {
        let udp = RequestedTransport::new(17);
        let mut allocate = AuthRequest::new(ALLOCATE, SETUP_ALLOCATE_TXID);
        allocate.typed.push(&udp);
        self.authenticated_request(0, &allocate);
        assert!(self.has_allocation(0), "setup Allocate failed");
        let mut permission = AuthRequest::new(CREATE_PERMISSION, SETUP_ALLOCATE_TXID + 1);
        permission.peer_mask = 1 << SETUP_PEER;
        self.authenticated_request(0, &permission);
        let number = ChannelNumber::new(SETUP_CHANNEL);
        let mut bind = AuthRequest::new(CHANNEL_BIND, SETUP_ALLOCATE_TXID + 2);
        bind.peer_mask = 1 << SETUP_PEER;
        bind.typed.push(&number);
        self.authenticated_request(0, &bind);
        let a = self.alloc_of(0).expect("setup allocation");
        assert!(
            a.channels.contains_key(&SETUP_CHANNEL),
            "setup ChannelBind failed"
        );
    }

    /// The relay sockets of the allocations held, in order.
    pub fn relays(&self) -> Vec<u32> {
        let mut r: Vec<u32> = self
            .allocs
            .values()
            .flat_map(|a| a.relays.iter().copied())
            .collect();
        r.sort_unstable();
        r
    }
}

/// Whether `a` has a relay socket of `ip`'s family.
fn relays_to(a: &AllocModel, ip: IpAddr) -> bool {
    a.relays.contains(&(a.slot << 1 | family_of(ip) as u32))
}

/// The family of `ip` once canonical (IPv4-mapped is IPv4).
fn family_of(ip: IpAddr) -> Family {
    if unmapped_ip(ip).is_ipv4() {
        Family::V4
    } else {
        Family::V6
    }
}

/// The relay socket of `a` a datagram to `peer` leaves from: the one of the peer's family.
fn relay_of(a: &AllocModel, peer: SocketAddr) -> u32 {
    a.slot << 1 | u32::from(peer.is_ipv6())
}

/// A request the harness signs.
pub struct AuthRequest<'a> {
    /// Method.
    pub method: Method,
    /// Class.
    pub class: MessageClass,
    /// Transaction id (96 bits).
    pub txid: u128,
    /// What to break: see the constants.
    pub flags: u8,
    /// Which [`PEERS`] to add as XOR-PEER-ADDRESS (encoded with this transaction id), first.
    pub peer_mask: u16,
    /// Typed attributes (seeds and setup), after the peers.
    pub typed: Vec<&'a dyn stun_proto::types::attribute::AttributeWrite>,
    /// Raw attribute TLVs from the input, after those.
    pub raw: &'a [u8],
}

impl<'a> AuthRequest<'a> {
    /// Leave USERNAME out.
    pub const NO_USERNAME: u8 = 1;
    /// Leave REALM out.
    pub const NO_REALM: u8 = 2;
    /// Leave NONCE out.
    pub const NO_NONCE: u8 = 4;
    /// Leave MESSAGE-INTEGRITY out.
    pub const NO_INTEGRITY: u8 = 8;
    /// Sign with a wrong password.
    pub const WRONG_KEY: u8 = 16;
    /// Sign with MESSAGE-INTEGRITY-SHA256.
    pub const SHA256: u8 = 32;
    /// Add FINGERPRINT.
    pub const FINGERPRINT: u8 = 64;
    /// The relay socket bind fails (when it is an Allocate).
    pub const BIND_FAILS: u8 = 128;

    /// A correctly signed request with no attributes.
    pub fn new(method: Method, txid: u128) -> Self {
        AuthRequest {
            method,
            class: MessageClass::Request,
            txid,
            flags: 0,
            peer_mask: 0,
            typed: Vec::new(),
            raw: &[],
        }
    }

    /// The message, signed with the nonce if there is one.
    pub fn build(&self, nonce: Option<&str>) -> Vec<u8> {
        let txid = TransactionId::from(self.txid & ((1u128 << 96) - 1));
        let mut msg = Message::builder(
            MessageType::from_class_method(self.class, self.method),
            txid,
            MessageWriteVec::with_capacity(256),
        );
        for (i, p) in PEERS.iter().enumerate() {
            if self.peer_mask & (1 << i) != 0 {
                let _ = msg.add_attribute(&XorPeerAddress::new(p.parse().unwrap(), txid));
            }
        }
        for a in &self.typed {
            let _ = msg.add_attribute(*a);
        }
        let mut raw = Input::new(self.raw);
        while raw.remaining() >= 4 {
            let t = raw.u16();
            let len = raw.u16();
            let value = raw.bytes(usize::from(len));
            // The harness adds these itself; the builder refuses them.
            if [
                MessageIntegrity::TYPE,
                MessageIntegritySha256::TYPE,
                Fingerprint::TYPE,
            ]
            .contains(&AttributeType::new(t))
            {
                continue;
            }
            if msg
                .add_attribute(&RawAttribute::new(AttributeType::new(t), value))
                .is_err()
            {
                break;
            }
        }
        let f = self.flags;
        if f & Self::NO_USERNAME == 0 {
            let _ = msg.add_attribute(&Username::new(USER).unwrap());
        }
        if f & Self::NO_REALM == 0 {
            let _ = msg.add_attribute(&Realm::new(REALM).unwrap());
        }
        if f & Self::NO_NONCE == 0 {
            let nonce = nonce.unwrap_or("0000000000000000000000000000000a");
            let _ = msg.add_attribute(&Nonce::new(nonce).unwrap());
        }
        if f & Self::NO_INTEGRITY == 0 {
            let k = keys();
            let (key, alg) = match (f & Self::WRONG_KEY != 0, f & Self::SHA256 != 0) {
                (true, _) => (&k[2], IntegrityAlgorithm::Sha1),
                (false, true) => (&k[1], IntegrityAlgorithm::Sha256),
                (false, false) => (&k[0], IntegrityAlgorithm::Sha1),
            };
            let _ = msg.add_message_integrity_with_key(key, alg);
        }
        if f & Self::FINGERPRINT != 0 {
            let _ = msg.add_fingerprint();
        }
        msg.finish()
    }
}

fn message_class(b: u8) -> MessageClass {
    match b % 8 {
        5 => MessageClass::Indication,
        6 => MessageClass::Success,
        7 => MessageClass::Error,
        _ => MessageClass::Request,
    }
}

/// A peer address: from [`PEERS`] (`sel` < 0x80) or raw from the input.
fn read_peer(input: &mut Input<'_>) -> SocketAddr {
    let sel = input.u8();
    if sel < 0x80 {
        return peer(usize::from(sel));
    }
    let ip = if sel & 1 == 0 {
        IpAddr::V4(Ipv4Addr::from(input.array::<4>()))
    } else {
        IpAddr::V6(Ipv6Addr::from(input.array::<16>()))
    };
    SocketAddr::new(ip, input.u16())
}

/// Operation codes of `engine_session` (the op byte modulo 6).
pub mod op {
    /// `[client][len: u16][datagram]`: a raw datagram from a client.
    pub const CLIENT: u8 = 0;
    /// `[relay][peer][len: u16][payload]`: a datagram from a peer to a relay.
    pub const PEER: u8 = 1;
    /// `[seconds: u16]`: advance the clock (seconds % 4000) and sweep.
    pub const ADVANCE: u8 = 2;
    /// `[client][method][class][txid: 12][flags][peer mask: u16][len: u16][attribute TLVs]`:
    /// a request the harness signs.
    pub const AUTH: u8 = 3;
    /// No arguments: swap to the other config under a new generation.
    pub const RECONFIGURE: u8 = 4;
    /// `[client][peer][txid: 12][len: u16][data]`: a well-formed Send indication.
    pub const SEND: u8 = 5;
}

/// `engine_session`: `[settings]` then up to [`MAX_OPS`] operations ([`op`]). Settings: bits
/// 0-1 pick max_permissions (256, 1, 2, 4), bits 2-3 max_allocations (65536, 1, 2, 0 = no cap).
pub fn run_session(data: &[u8]) {
    let mut input = Input::new(data);
    let settings = input.u8();
    let max_permissions = [256, 1, 2, 4][usize::from(settings & 3)];
    let max_allocations = [65536, 1, 2, 0][usize::from((settings >> 2) & 3)];
    let clients = CLIENTS
        .iter()
        .map(|&(l, a)| (l, a.parse().unwrap()))
        .collect();
    let mut h = Harness::new(
        session_variants(),
        clients,
        max_permissions,
        max_allocations,
        true,
    );
    h.setup();
    for _ in 0..MAX_OPS {
        if input.is_empty() {
            break;
        }
        match input.u8() % 6 {
            op::CLIENT => {
                let client = usize::from(input.u8()) % CLIENTS.len();
                let datagram = input.len_prefixed(MAX_FRAME);
                h.client(client, datagram, true);
            }
            op::PEER => {
                let relay = u32::from(input.u8() % 10);
                let peer = read_peer(&mut input);
                let payload = input.len_prefixed(MAX_DATAGRAM);
                h.peer(relay, peer, payload);
            }
            op::ADVANCE => {
                let secs = u64::from(input.u16() % 4000);
                h.advance(Duration::from_secs(secs));
            }
            op::AUTH => {
                let client = usize::from(input.u8()) % CLIENTS.len();
                let m = usize::from(input.u8());
                let method = if m % 8 == 7 {
                    Method::new(input.u16() & 0x0fff)
                } else {
                    METHODS[m % 8]
                };
                let class = message_class(input.u8());
                let txid = u128::from_be_bytes({
                    let mut b = [0u8; 16];
                    b[4..].copy_from_slice(&input.array::<12>());
                    b
                });
                let flags = input.u8();
                let peer_mask = input.u16();
                let raw = input.len_prefixed(MAX_FRAME);
                let req = AuthRequest {
                    method,
                    class,
                    txid,
                    flags,
                    peer_mask,
                    typed: Vec::new(),
                    raw,
                };
                h.authenticated_request(client, &req);
            }
            op::RECONFIGURE => h.swap_config(),
            _ => {
                let client = usize::from(input.u8()) % CLIENTS.len();
                let p = read_peer(&mut input);
                let txid = TransactionId::from(u128::from_be_bytes({
                    let mut b = [0u8; 16];
                    b[4..].copy_from_slice(&input.array::<12>());
                    b
                }));
                let payload = input.len_prefixed(MAX_FRAME);
                let mut msg = Message::builder(
                    MessageType::from_class_method(MessageClass::Indication, SEND),
                    txid,
                    MessageWriteVec::new(),
                );
                let _ = msg.add_attribute(&XorPeerAddress::new(p, txid));
                let _ = msg.add_attribute(&Data::new(payload));
                let bytes = msg.finish();
                h.client(client, &bytes, true);
            }
        }
    }
}

/// `engine_unauth`: flags bit 0 = IPv6 source, bit 1 = ephemeral auth, bits 2-4 = the relay
/// id the same bytes are sent to as a peer datagram, bit 5 = the TURN-TCP listener (a stream
/// frame up to MAX_FRAME bytes instead of a datagram under 1600); then the source address (16 bytes, the
/// first 4 for IPv4) and port, then the datagram.
pub fn run_unauth(data: &[u8]) {
    let mut input = Input::new(data);
    let flags = input.u8();
    let addr = input.array::<16>();
    let port = input.u16();
    let datagram = input.rest();
    let ip = if flags & 1 == 0 {
        IpAddr::V4(Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]))
    } else {
        IpAddr::V6(Ipv6Addr::from(addr))
    };
    let from = SocketAddr::new(ip, port);
    let variants = &unauth_variants()[usize::from(flags >> 1 & 1)..];
    let listener = usize::from(flags >> 5 & 1);
    let mut h = Harness::new(variants, vec![(listener, from)], 256, 65536, false);
    h.client(0, datagram, true);
    h.peer(u32::from(flags >> 2 & 7), from, datagram);
    // Much later: nothing to expire, nothing to close.
    h.advance(Duration::from_secs(3601));
    h.client(0, datagram, true);
}

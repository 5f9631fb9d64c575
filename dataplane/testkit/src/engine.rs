//! The engine on a virtual clock, as the IO shell drives it, and a client that signs its
//! requests with long-term credentials: what `dataplane/tests/engine.rs`, the engine
//! benchmarks and the fuzz targets share.
//!
//! [`Harness`] holds one [`Engine`], the snapshot it serves under and the clock; a [`Client`]
//! learns realm and nonce from a 401 and signs with [`sign`]. The request builders
//! ([`udp`], [`peer_attr`], [`channel_attrs`], [`send_indication`]) fill in attributes.

use std::net::SocketAddr;
use std::time::{Duration, Instant};
use stun_proto::types::attribute::{ErrorCode, Nonce, Realm, Username};
use stun_proto::types::message::{
    IntegrityAlgorithm, IntegrityKey, LongTermKeyCredentials, Message, MessageClass,
    MessageIntegrityCredentials, MessageType, MessageWrite, MessageWriteExt, MessageWriteVec,
    Method, TransactionId,
};
use turn_types::attribute::{
    ChannelNumber, Data, RequestedTransport, XorPeerAddress, XorRelayedAddress,
};
use turn_types::message::{ALLOCATE, SEND};
use uturn_dataplane::proto::{
    Arrival, ArrivalKind, BoundRelays, Bytes, ClientAction, Engine, EngineConfig, ListenerId,
    ListenerRef, PeerAction, PeerArrival, RelayBindError, RelayId, PEER_HEADROOM,
};
use uturn_shared::config::parse_config;
use uturn_shared::snapshot::{Host, RelayAddresses, Snapshot};

/// Unix time at the virtual clock's epoch.
pub const EPOCH_UNIX: u64 = 1_800_000_000;
/// The engines' nonce key (two shards of one process share it).
pub const NONCE_KEY: [u8; 32] = [42; 32];
/// The static user of the harness configs.
pub const USER: &str = "user1";
/// Its password.
pub const PASS: &str = "pass1";
/// The shell's reply buffer size (`io::shard::BUFFER`).
pub const OUT_LEN: usize = 2048;
/// The client address requests come from unless a scenario says otherwise.
pub const CLIENT: &str = "192.0.2.10:40000";
/// A peer the default config's `media` cluster admits.
pub const PEER: &str = "10.1.2.3:5500";

/// The default config with `auth` (indented YAML lines) as its auth section: one TURN-UDP
/// listener routed to `media` (10.0.0.0/8 ports 5000-6000, fd00::/64); `other` is not routed.
pub fn config(auth: &str) -> String {
    format!(
        r#"
version: v1
auth:
{auth}
listeners:
  - name: udp
    protocol: TURN-UDP
    address: 198.51.100.1
    port: 3478
    routes: [media]
clusters:
  - name: media
    endpoints: ["10.0.0.0/8:<5000-6000>", "fd00::/64"]
  - name: other
    endpoints: ["172.16.0.0/12"]
"#
    )
}

/// Static auth with [`USER`] and [`PASS`], as [`config`] takes it.
pub const STATIC_AUTH: &str =
    "  type: static\n  credentials:\n    username: user1\n    password: pass1";

/// An engine config on the harness clock: epoch `now`, [`EPOCH_UNIX`] and [`NONCE_KEY`].
pub fn engine_config(now: Instant) -> EngineConfig {
    EngineConfig::new(now, EPOCH_UNIX, NONCE_KEY)
}

/// One engine on a virtual clock, serving the first listener of its snapshot.
pub struct Harness {
    /// The engine under test.
    pub engine: Engine,
    /// The snapshot it serves under.
    pub snap: Snapshot,
    /// The virtual clock.
    pub now: Instant,
    /// The reply buffer.
    pub out: Vec<u8>,
    /// The relay port the last allocation got (each new one takes the port two above; a dual
    /// allocation's IPv6 relay the one above that).
    pub next_port: u16,
    /// Why the IPv6 socket of a dual allocation cannot be bound, if it cannot.
    pub additional_bind_error: Option<RelayBindError>,
}

/// A reply the engine wrote.
pub struct Reply {
    /// Its bytes.
    pub bytes: Vec<u8>,
}

impl Reply {
    /// The reply parsed.
    pub fn msg(&self) -> Message<'_> {
        Message::from_bytes(&self.bytes).expect("reply parses")
    }

    /// Its class.
    pub fn class(&self) -> MessageClass {
        self.msg().class()
    }

    /// Its ERROR-CODE, if any.
    pub fn error_code(&self) -> Option<u16> {
        self.msg().attribute::<ErrorCode>().ok().map(|e| e.code())
    }
}

impl Harness {
    /// A harness on [`config`] with `auth`.
    pub fn new(auth: &str) -> Harness {
        Harness::with(&config(auth), |_| {})
    }

    /// A harness on config text `yaml`, with the engine config adjusted by `tune`.
    pub fn with(yaml: &str, tune: impl FnOnce(&mut EngineConfig)) -> Harness {
        Harness::on_host(yaml, RelayAddresses::default(), tune)
    }

    /// As [`Harness::with`], on a host whose environment names the relay addresses `relay`
    /// (`STUNNER_ADDRS`: the families the config's listener address does not give).
    pub fn on_host(
        yaml: &str,
        relay: RelayAddresses,
        tune: impl FnOnce(&mut EngineConfig),
    ) -> Harness {
        let cfg = parse_config(yaml).expect("config");
        let now = Instant::now();
        let mut engine_config = engine_config(now);
        tune(&mut engine_config);
        let host = Host {
            ips: Vec::new(),
            relay,
        };
        Harness {
            engine: Engine::new(engine_config),
            snap: Snapshot::from_config_on_host(&cfg, 1, &|_| Vec::new(), &host),
            now,
            out: vec![0; OUT_LEN],
            next_port: 50000,
            additional_bind_error: None,
        }
    }

    /// Moves the clock `secs` forward and lets the engine expire what is due.
    pub fn advance(&mut self, secs: u64) {
        self.now += Duration::from_secs(secs);
        self.engine.handle_timeout(self.now);
    }

    /// Hands `data` from `from` to the engine on the first listener, straight from the
    /// client; what it asks for, as is (an `AllocateRelay` is left for the caller to
    /// complete).
    pub fn handle(&mut self, from: &str, data: &[u8]) -> ClientAction {
        self.handle_as(from, data, ArrivalKind::Straight)
    }

    /// As [`Harness::handle`], for a datagram of client `from` that arrived as `kind`
    /// (forwarded by a sibling, or a miss answered here).
    pub fn handle_as(&mut self, from: &str, data: &[u8], kind: ArrivalKind) -> ClientAction {
        let arrival = Arrival {
            now: self.now,
            snap: &self.snap,
            listener: ListenerRef {
                id: ListenerId(1),
                spec: &self.snap.listeners[0],
            },
            client: from.parse().unwrap(),
            kind,
        };
        self.engine.handle_client(arrival, data, &mut self.out)
    }

    /// As [`Harness::handle`], but an `AllocateRelay` is completed at once with the next
    /// relay port (and the one above it for a dual allocation's IPv6 relay, unless
    /// [`Harness::additional_bind_error`]) and comes back as its `Reply`.
    pub fn send(&mut self, from: &str, data: &[u8]) -> ClientAction {
        let action = self.handle(from, data);
        if let ClientAction::AllocateRelay(request) = action {
            self.next_port += 2;
            let bound = BoundRelays {
                relay: Ok(self.next_port),
                additional: request.additional.map(|_| {
                    self.additional_bind_error
                        .map_or(Ok(self.next_port + 1), Err)
                }),
            };
            let n = self
                .engine
                .complete_allocate(self.now, request.relay, bound, &mut self.out)
                .expect("allocate reply");
            return ClientAction::Reply(n);
        }
        action
    }

    /// As [`Harness::send`], for a request that must be answered; the answer.
    pub fn request(&mut self, from: &str, data: &[u8]) -> Reply {
        match self.send(from, data) {
            ClientAction::Reply(n) => Reply {
                bytes: self.out[..n].to_vec(),
            },
            other => panic!("expected a reply, got {other:?}"),
        }
    }

    /// A datagram from `peer` to `relay`: what the engine did and the bytes it sends the
    /// client (empty when dropped).
    pub fn peer(&mut self, relay: RelayId, peer: &str, payload: &[u8]) -> (PeerAction, Vec<u8>) {
        let mut buf = vec![0u8; PEER_HEADROOM + payload.len()];
        buf[PEER_HEADROOM..].copy_from_slice(payload);
        let arrival = PeerArrival {
            now: self.now,
            snap: &self.snap,
            relay,
            peer: peer.parse().unwrap(),
        };
        let action = self.engine.handle_peer(arrival, &mut buf, &mut self.out);
        let bytes = match &action {
            PeerAction::ToClient {
                bytes: Bytes::Input(r),
                ..
            } => buf[r.clone()].to_vec(),
            PeerAction::ToClient {
                bytes: Bytes::Output(n),
                ..
            } => self.out[..*n].to_vec(),
            PeerAction::Drop(_) => Vec::new(),
        };
        (action, bytes)
    }
}

/// The long-term key of `user`/`pass` in `realm` (RFC 8489 §9.2.2) for `algorithm`.
pub fn long_term_key(
    user: &str,
    pass: &str,
    realm: &str,
    algorithm: IntegrityAlgorithm,
) -> IntegrityKey {
    LongTermKeyCredentials::new(user.into(), pass.into(), realm.into()).make_key(algorithm)
}

/// Signs `msg` as `user` would with long-term credentials: USERNAME, REALM, NONCE, then
/// MESSAGE-INTEGRITY (HMAC-SHA1) over them.
pub fn sign(msg: &mut MessageWriteVec, user: &str, pass: &str, realm: &str, nonce: &str) {
    msg.add_attribute(&Username::new(user).unwrap()).unwrap();
    msg.add_attribute(&Realm::new(realm).unwrap()).unwrap();
    msg.add_attribute(&Nonce::new(nonce).unwrap()).unwrap();
    let creds: MessageIntegrityCredentials =
        LongTermKeyCredentials::new(user.into(), pass.into(), realm.into()).into();
    msg.add_message_integrity(&creds, IntegrityAlgorithm::Sha1)
        .unwrap();
}

/// A client-side view: credentials plus the realm/nonce learnt from a 401.
pub struct Client {
    /// Username.
    pub user: String,
    /// Password.
    pub pass: String,
    /// Realm from the last 401 or 438.
    pub realm: String,
    /// Nonce from the last 401 or 438.
    pub nonce: String,
}

/// What adds a request's attributes, given the transaction id (for XOR-encoded addresses).
pub type Attrs<'a> = &'a dyn Fn(&mut MessageWriteVec, TransactionId);

impl Client {
    /// A client of `user`/`pass` that has learnt nothing yet.
    pub fn new(user: &str, pass: &str) -> Client {
        Client {
            user: user.into(),
            pass: pass.into(),
            realm: String::new(),
            nonce: String::new(),
        }
    }

    /// A `method` request with `txid` and `attrs`, signed (see [`sign`]) if `auth`.
    pub fn build(
        &self,
        method: Method,
        txid: TransactionId,
        attrs: Attrs<'_>,
        auth: bool,
    ) -> Vec<u8> {
        let mut msg = Message::builder(
            MessageType::from_class_method(MessageClass::Request, method),
            txid,
            MessageWriteVec::new(),
        );
        attrs(&mut msg, txid);
        if auth {
            sign(&mut msg, &self.user, &self.pass, &self.realm, &self.nonce);
        }
        msg.finish()
    }

    /// Takes realm and nonce from a 401 or 438.
    pub fn learn(&mut self, reply: &Reply) {
        let msg = reply.msg();
        self.realm = msg.attribute::<Realm>().unwrap().realm().to_string();
        self.nonce = msg.attribute::<Nonce>().unwrap().nonce().to_string();
    }

    /// Learns `from`'s nonce from the 401 to an unauthenticated Allocate of the smallest shape
    /// real clients send (REQUESTED-TRANSPORT only, 28 bytes: the challenge fits 3x of it).
    pub fn learn_nonce(&mut self, h: &mut Harness, from: &str) {
        let challenge = h.request(
            from,
            &self.build(ALLOCATE, TransactionId::generate(), &udp, false),
        );
        assert_eq!(challenge.error_code(), Some(401));
        self.learn(&challenge);
    }

    /// Sends `method` authenticated from `from`, learning that address's nonce first.
    pub fn call_from(
        &mut self,
        h: &mut Harness,
        from: &str,
        method: Method,
        attrs: Attrs<'_>,
    ) -> Reply {
        self.learn_nonce(h, from);
        h.request(
            from,
            &self.build(method, TransactionId::generate(), attrs, true),
        )
    }

    /// Sends `method` authenticated from [`CLIENT`], learning a nonce first when needed.
    pub fn call(&mut self, h: &mut Harness, method: Method, attrs: Attrs<'_>) -> Reply {
        if self.nonce.is_empty() {
            self.learn_nonce(h, CLIENT);
        }
        h.request(
            CLIENT,
            &self.build(method, TransactionId::generate(), attrs, true),
        )
    }
}

/// Adds REQUESTED-TRANSPORT UDP (an Allocate's one required attribute).
pub fn udp(m: &mut MessageWriteVec, _: TransactionId) {
    m.add_attribute(&RequestedTransport::new(17)).unwrap();
}

/// Adds XOR-PEER-ADDRESS `peer`.
pub fn peer_attr(peer: &'static str) -> impl Fn(&mut MessageWriteVec, TransactionId) {
    move |m: &mut MessageWriteVec, txid| {
        m.add_attribute(&XorPeerAddress::new(peer.parse().unwrap(), txid))
            .unwrap();
    }
}

/// Adds CHANNEL-NUMBER `number` and XOR-PEER-ADDRESS `peer` (a ChannelBind's attributes).
pub fn channel_attrs(
    number: u16,
    peer: &'static str,
) -> impl Fn(&mut MessageWriteVec, TransactionId) {
    move |m: &mut MessageWriteVec, txid| {
        m.add_attribute(&ChannelNumber::new(number)).unwrap();
        m.add_attribute(&XorPeerAddress::new(peer.parse().unwrap(), txid))
            .unwrap();
    }
}

/// Allocates as [`USER`] from [`CLIENT`]; the client (with its nonce) and the relayed address.
pub fn allocate(h: &mut Harness) -> (Client, SocketAddr) {
    let mut c = Client::new(USER, PASS);
    let reply = c.call(h, ALLOCATE, &udp);
    assert_eq!(
        reply.class(),
        MessageClass::Success,
        "{:?}",
        reply.error_code()
    );
    let msg = reply.msg();
    let relay = msg
        .attribute::<XorRelayedAddress>()
        .unwrap()
        .addr(msg.transaction_id());
    (c, relay)
}

/// A Send indication carrying `payload` to `peer`.
pub fn send_indication(peer: &str, payload: &[u8]) -> Vec<u8> {
    send_indication_to(peer.parse().unwrap(), payload)
}

/// A Send indication carrying `payload` to `peer` (RFC 8656 §11.1), with a fresh transaction id.
pub fn send_indication_to(peer: SocketAddr, payload: &[u8]) -> Vec<u8> {
    let txid = TransactionId::generate();
    let mut msg = Message::builder(
        MessageType::from_class_method(MessageClass::Indication, SEND),
        txid,
        MessageWriteVec::new(),
    );
    msg.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
    msg.add_attribute(&Data::new(payload)).unwrap();
    msg.finish()
}

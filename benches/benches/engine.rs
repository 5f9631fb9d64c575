//! Criterion benchmarks of the sans-IO engine: the per-packet ChannelData decision (the hot
//! path), a peer datagram framed back to the client, and an authenticated Allocate (long-term
//! credentials, HMAC-SHA1 check, nonce, allocation) with its relay completion, and the
//! largest CreatePermission a client can send (64 KB, 5 444 peers, refused 508 at the cap).

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use std::hint::black_box;
use std::net::SocketAddr;
use std::time::Instant;
use stun_proto::types::attribute::Nonce;
use stun_proto::types::message::{Message, MessageWriteExt, MessageWriteVec, TransactionId};
use turn_types::attribute::{ChannelNumber, XorPeerAddress};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION};
use uturn_dataplane::proto::{
    Arrival, ArrivalKind, ClientAction, Engine, ListenerId, ListenerRef, PeerAction, PeerArrival,
    RelayId, PEER_HEADROOM,
};
use uturn_perf::client::channel_data_header;
use uturn_shared::config::parse_config;
use uturn_shared::snapshot::Snapshot;
use uturn_testkit::engine::{engine_config, udp, Attrs, Client, Reply, PASS, USER};

const PEER: &str = "10.0.0.7:5000";

struct Bench {
    engine: Engine,
    snap: Snapshot,
    now: Instant,
    out: Vec<u8>,
    /// Signs requests with the realm and nonce of the last 401.
    client: Client,
    next_port: u16,
}

impl Bench {
    fn new() -> Bench {
        let config = parse_config(
            "version: v1\nauth: {credentials: {username: user1, password: pass1}}\n\
             listeners: [{name: l, address: 127.0.0.1, port: 3478, routes: [c]}]\n\
             clusters: [{name: c, endpoints: [10.0.0.0/8]}]\n",
        )
        .unwrap();
        let now = Instant::now();
        let mut bench = Bench {
            engine: Engine::new({
                // Every timed Allocate comes after a 401 from one of 250 sources: no limit.
                let mut config = engine_config(now);
                config.limits.challenge_rate = 0;
                config
            }),
            snap: Snapshot::from_config(&config, 1, &|_| Vec::new()),
            now,
            out: vec![0; 2048],
            client: Client::new(USER, PASS),
            next_port: 40000,
        };
        let challenge = bench.unsigned(ALLOCATE, &udp);
        let n = bench.reply("192.0.2.1:1000".parse().unwrap(), &challenge);
        bench.client.learn(&Reply {
            bytes: bench.out[..n].to_vec(),
        });
        bench
    }

    fn handle(&mut self, from: SocketAddr, data: &[u8]) -> ClientAction {
        let arrival = Arrival {
            now: self.now,
            snap: &self.snap,
            listener: ListenerRef {
                id: ListenerId(1),
                spec: &self.snap.listeners[0],
            },
            client: from,
            kind: ArrivalKind::Straight,
        };
        self.engine.handle_client(arrival, data, &mut self.out)
    }

    /// Handles a request and completes an allocation if it asks for one; the reply length.
    fn reply(&mut self, from: SocketAddr, data: &[u8]) -> usize {
        match self.handle(from, data) {
            ClientAction::Reply(n) => n,
            ClientAction::AllocateRelay(request) => {
                self.next_port = self.next_port.wrapping_add(2).max(40000);
                self.engine
                    .complete_allocate(self.now, request.relay, Ok(self.next_port), &mut self.out)
                    .unwrap()
            }
            other => panic!("{other:?}"),
        }
    }

    fn signed(&self, method: stun_proto::types::message::Method, attrs: Attrs<'_>) -> Vec<u8> {
        self.client
            .build(method, TransactionId::generate(), attrs, true)
    }

    fn unsigned(&self, method: stun_proto::types::message::Method, attrs: Attrs<'_>) -> Vec<u8> {
        self.client
            .build(method, TransactionId::generate(), attrs, false)
    }
}

fn channel_data(c: &mut Criterion) {
    let mut b = Bench::new();
    let client: SocketAddr = "192.0.2.1:1000".parse().unwrap();
    let allocate = b.signed(ALLOCATE, &udp);
    b.reply(client, &allocate);
    let peer: SocketAddr = PEER.parse().unwrap();
    let bind = b.signed(CHANNEL_BIND, &|m: &mut MessageWriteVec, txid| {
        m.add_attribute(&ChannelNumber::new(0x4000)).unwrap();
        m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
    });
    b.reply(client, &bind);
    let mut frame = channel_data_header(0x4000, 100).to_vec();
    frame.extend_from_slice(&[0xab; 100]);
    assert!(matches!(
        b.handle(client, &frame),
        ClientAction::Relay { .. }
    ));

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    group.bench_function("channeldata_client_to_peer_100B", |bencher| {
        bencher.iter(|| black_box(b.handle(client, black_box(&frame))))
    });
    let mut buf = vec![0u8; PEER_HEADROOM + 100];
    group.bench_function("peer_to_client_channeldata_100B", |bencher| {
        bencher.iter(|| {
            let arrival = PeerArrival {
                now: b.now,
                snap: &b.snap,
                relay: RelayId(0),
                peer,
            };
            let action = b
                .engine
                .handle_peer(arrival, black_box(&mut buf), &mut b.out);
            assert!(matches!(action, PeerAction::ToClient { .. }));
            black_box(action)
        })
    });
    group.finish();
}

fn allocate_with_auth(c: &mut Criterion) {
    // Nonces are bound to the client's address, so each new 5-tuple first gets its 401 (in
    // the untimed setup, with the client-side signing); the timed part is the server's work
    // on the signed Allocate: parse, nonce and HMAC-SHA1 check, allocation, relay completion
    // and the signed success response.
    let bench = std::cell::RefCell::new(Bench::new());
    let mut port: u16 = 1;
    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    group.bench_function("allocate_long_term_auth", |bencher| {
        bencher.iter_batched(
            || {
                port = port.wrapping_add(1).max(1);
                let from: SocketAddr = format!("198.51.100.{}:{port}", 1 + port % 250)
                    .parse()
                    .unwrap();
                let mut b = bench.borrow_mut();
                if b.engine.allocation_count() > 50_000 {
                    *b = Bench::new();
                }
                let challenge = b.unsigned(ALLOCATE, &udp);
                let n = b.reply(from, &challenge);
                let msg = Message::from_bytes(&b.out[..n]).unwrap();
                b.client.nonce = msg.attribute::<Nonce>().unwrap().nonce().to_string();
                (from, b.signed(ALLOCATE, &udp))
            },
            |(from, request)| black_box(bench.borrow_mut().reply(from, &request)),
            BatchSize::SmallInput,
        )
    });
    group.finish();
}

/// XOR-PEER-ADDRESS attributes (12 bytes each for IPv4) that fit one 64 KB request beside its
/// USERNAME, REALM, NONCE and MESSAGE-INTEGRITY.
const MAX_PEERS_IN_ONE_REQUEST: u32 = 5_444;

fn create_permission_many_peers(c: &mut Criterion) {
    // Issue #18 point 6: one request naming 5 444 distinct peers, far over the permission cap
    // (256). The engine answers 508 and installs nothing; the timed part is that answer.
    let mut b = Bench::new();
    let client: SocketAddr = "192.0.2.1:1000".parse().unwrap();
    let allocate = b.signed(ALLOCATE, &udp);
    b.reply(client, &allocate);
    let request = b.signed(CREATE_PERMISSION, &|m: &mut MessageWriteVec, txid| {
        for i in 0..MAX_PEERS_IN_ONE_REQUEST {
            let ip = std::net::Ipv4Addr::from(0x0a00_0000 + i + 1);
            let peer = SocketAddr::new(ip.into(), 5000);
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        }
    });
    assert!(request.len() <= usize::from(u16::MAX), "{}", request.len());
    let n = b.reply(client, &request);
    let code = Message::from_bytes(&b.out[..n])
        .unwrap()
        .attribute::<stun_proto::types::attribute::ErrorCode>()
        .unwrap()
        .code();
    assert_eq!(code, 508);

    let mut group = c.benchmark_group("engine");
    group.throughput(Throughput::Elements(1));
    group.bench_function("create_permission_5444_peers_508", |bencher| {
        bencher.iter(|| black_box(b.reply(client, black_box(&request))))
    });
    group.finish();
}

criterion_group!(
    benches,
    channel_data,
    allocate_with_auth,
    create_permission_many_peers
);
criterion_main!(benches);

//! Engine scenarios on a virtual clock: one per method and per error path.

use std::io::ErrorKind;
use std::net::{Ipv6Addr, SocketAddr};
use std::time::Duration;
use stun_proto::types::attribute::{
    AttributeStaticType, AttributeType, ErrorCode, Fingerprint, MessageIntegrity, Nonce,
    RawAttribute, Realm, XorMappedAddress,
};
use stun_proto::types::message::{
    Message, MessageClass, MessageType, MessageWrite, MessageWriteExt, MessageWriteVec, Method,
    TransactionId, BINDING,
};
use turn_types::attribute::{
    AdditionalAddressFamily, ChannelNumber, Data, Lifetime, RequestedAddressFamily,
    RequestedTransport, XorPeerAddress, XorRelayedAddress,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, DATA, REFRESH, SEND};
use turn_types::AddressFamily;
use uturn_dataplane::proto::{
    Arrival, ArrivalKind, BoundRelays, ClientAction, DropReason, EngineConfig, Family, ListenerId,
    ListenerRef, OffloadPermission, PeerAction, RelayBindError, RelayId, RelayRequest,
};
use uturn_shared::auth::{ephemeral_password, ephemeral_username};
use uturn_shared::config::parse_config;
use uturn_shared::snapshot::{Host, RelayAddresses, Snapshot};
use uturn_testkit::engine::{
    allocate, channel_attrs, config, peer_attr, send_indication, udp, Attrs, Client, Harness,
    Reply, CLIENT, EPOCH_UNIX, PASS, PEER, STATIC_AUTH, USER,
};

#[test]
fn binding_is_answered_without_auth_and_at_most_about_twice_its_size() {
    let mut h = Harness::new(STATIC_AUTH);
    let bare = Message::builder_request(BINDING, MessageWriteVec::new()).finish();
    let mut with_fp = Message::builder_request(BINDING, MessageWriteVec::new());
    with_fp.add_fingerprint().unwrap();
    let with_fp = with_fp.finish();
    // (request, source, response size, FINGERPRINT in the response)
    for (req, from, size, fingerprint) in [
        (&bare, CLIENT, 32, false),
        (&bare, "[2001:db8::1]:40000", 44, false),
        (&with_fp, CLIENT, 40, true),
        (&with_fp, "[2001:db8::1]:40000", 52, true),
    ] {
        let reply = h.request(from, req);
        let msg = reply.msg();
        assert_eq!(msg.class(), MessageClass::Success);
        let mapped = msg
            .attribute::<XorMappedAddress>()
            .unwrap()
            .addr(msg.transaction_id());
        assert_eq!(mapped, from.parse::<SocketAddr>().unwrap());
        assert_eq!(reply.bytes.len(), size, "{from} fingerprint={fingerprint}");
        assert!(reply.bytes.len() as f64 <= 2.2 * req.len() as f64);
        assert_eq!(msg.has_attribute(Fingerprint::TYPE), fingerprint);
        assert!(!msg.has_attribute(MessageIntegrity::TYPE));
        // No SOFTWARE (0x8022), ever.
        assert!(msg.raw_attribute(AttributeType::new(0x8022)).is_none());
    }
}

fn unauthenticated_allocate() -> Vec<u8> {
    Client::new("user1", "pass1").build(ALLOCATE, TransactionId::generate(), &udp, false)
}

#[test]
fn challenges_to_one_source_ip_are_rate_limited_on_udp() {
    let mut h = Harness::with(&config(STATIC_AUTH), |c| {
        c.limits.challenge_rate = 10;
        c.limits.challenge_burst = 5;
    });
    let req = unauthenticated_allocate();
    let outcomes: Vec<ClientAction> = (0..20)
        .map(|i| h.send(&format!("192.0.2.10:{}", 40000 + i), &req))
        .collect();
    // The budget is per IP, whatever the port.
    assert_eq!(
        outcomes
            .iter()
            .filter(|a| matches!(a, ClientAction::Reply(_)))
            .count(),
        5
    );
    assert_eq!(
        outcomes
            .iter()
            .filter(|a| **a == ClientAction::Drop(DropReason::RateLimited))
            .count(),
        15
    );
    assert_eq!(
        h.engine.stats().dropped[DropReason::RateLimited.index()],
        15
    );
    // Another source still gets its challenge.
    assert_eq!(h.request("192.0.2.99:40000", &req).error_code(), Some(401));
    // 10 per second once the burst is spent.
    h.now += Duration::from_millis(500);
    let later = (0..20)
        .filter(|_| matches!(h.send(CLIENT, &req), ClientAction::Reply(_)))
        .count();
    assert_eq!(later, 5);
    // A Binding (not a challenge) is never limited, and no allocation exists.
    let binding = Message::builder_request(BINDING, MessageWriteVec::new()).finish();
    assert_eq!(h.request(CLIENT, &binding).class(), MessageClass::Success);
    assert_eq!(h.engine.allocation_count(), 0);
}

#[test]
fn challenges_to_one_source_ip_are_rate_limited_on_streams_and_dtls_too() {
    use uturn_shared::config::ListenerProtocol;
    let mut h = Harness::with(&config(STATIC_AUTH), |c| {
        c.limits.challenge_rate = 10;
        c.limits.challenge_burst = 5;
    });
    let req = unauthenticated_allocate();
    // A TCP, TLS or DTLS client that pipelines unauthenticated Allocates and never answers a
    // challenge gets the burst, then drops (issue #18 point 2), each source IP on its own.
    for (i, protocol) in [
        ListenerProtocol::TurnTcp,
        ListenerProtocol::TurnTls,
        ListenerProtocol::TurnDtls,
    ]
    .into_iter()
    .enumerate()
    {
        let mut spec = h.snap.listeners[0].clone();
        spec.protocol = protocol;
        let from: SocketAddr = format!("192.0.2.{}:40000", 50 + i).parse().unwrap();
        let outcomes: Vec<ClientAction> = (0..20)
            .map(|_| {
                let arrival = Arrival {
                    now: h.now,
                    snap: &h.snap,
                    listener: ListenerRef {
                        id: ListenerId(2 + i as u32),
                        spec: &spec,
                    },
                    client: from,
                    kind: ArrivalKind::Straight,
                };
                h.engine.handle_client(arrival, &req, &mut h.out)
            })
            .collect();
        let replies = outcomes
            .iter()
            .filter(|a| matches!(a, ClientAction::Reply(_)))
            .count();
        let limited = outcomes
            .iter()
            .filter(|a| **a == ClientAction::Drop(DropReason::RateLimited))
            .count();
        assert_eq!((replies, limited), (5, 15), "{protocol:?}");
    }
    assert_eq!(
        h.engine.stats().dropped[DropReason::RateLimited.index()],
        45
    );
    assert_eq!(h.engine.allocation_count(), 0);
}

fn quota_config(quota: u32) -> String {
    let auth = "  type: ephemeral\n  credentials:\n    secret: s3cr3t";
    format!("admin:\n  user_quota: {quota}\n{}", config(auth))
}

fn ephemeral_client(user_id: &str) -> Client {
    let user = ephemeral_username(EPOCH_UNIX + 3600, user_id);
    Client::new(&user, &ephemeral_password("s3cr3t", &user))
}

#[test]
fn user_quota_gives_486_per_user_id_and_is_released_at_once() {
    let mut h = Harness::with(&quota_config(2), |_| {});
    let mut alice = ephemeral_client("alice");
    let a1 = "192.0.2.10:1001";
    let a2 = "192.0.2.10:1002";
    let a3 = "192.0.2.10:1003";
    for from in [a1, a2] {
        let reply = alice.call_from(&mut h, from, ALLOCATE, &udp);
        assert_eq!(reply.class(), MessageClass::Success);
    }
    let refused = alice.call_from(&mut h, a3, ALLOCATE, &udp);
    assert_eq!(refused.error_code(), Some(486));
    // Signed with the user's key, so the client trusts it.
    assert!(refused.msg().has_attribute(MessageIntegrity::TYPE));
    // The same user-id under another expiry is the same user.
    let mut alice_later = {
        let user = ephemeral_username(EPOCH_UNIX + 7200, "alice");
        Client::new(&user, &ephemeral_password("s3cr3t", &user))
    };
    assert_eq!(
        alice_later
            .call_from(&mut h, a3, ALLOCATE, &udp)
            .error_code(),
        Some(486)
    );
    // Another user is not affected.
    let mut bob = ephemeral_client("bob");
    assert_eq!(
        bob.call_from(&mut h, "192.0.2.20:2000", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
    // A Refresh to 0 releases the quota at once.
    let zero =
        |m: &mut MessageWriteVec, _: TransactionId| m.add_attribute(&Lifetime::new(0)).unwrap();
    let deleted = alice.call_from(&mut h, a1, REFRESH, &zero);
    assert_eq!(deleted.class(), MessageClass::Success);
    assert_eq!(
        alice.call_from(&mut h, a3, ALLOCATE, &udp).class(),
        MessageClass::Success
    );
    assert_eq!(
        alice.call_from(&mut h, a1, ALLOCATE, &udp).error_code(),
        Some(486)
    );
    // Expiry releases it too (allocations here live the default 600 s).
    h.advance(601);
    assert_eq!(h.engine.allocation_count(), 0);
    for from in [a1, a2] {
        assert_eq!(
            alice.call_from(&mut h, from, ALLOCATE, &udp).class(),
            MessageClass::Success
        );
    }
    assert_eq!(h.engine.stats().quota_refusals, 3);
}

#[test]
fn user_quota_zero_means_no_quota() {
    let mut h = Harness::with(&quota_config(0), |_| {});
    let mut alice = ephemeral_client("alice");
    for port in 0..50 {
        let from = format!("192.0.2.10:{}", 1000 + port);
        assert_eq!(
            alice.call_from(&mut h, &from, ALLOCATE, &udp).class(),
            MessageClass::Success
        );
    }
}

#[test]
fn global_cap_gives_508_across_shards_sharing_a_ledger() {
    let ledger = std::sync::Arc::new(uturn_dataplane::proto::AllocationLedger::new());
    let tune = |c: &mut EngineConfig| {
        c.limits.max_allocations = 2;
        c.ledger = ledger.clone();
    };
    let mut shard0 = Harness::with(&config(STATIC_AUTH), tune);
    let mut shard1 = Harness::with(&config(STATIC_AUTH), tune);
    let mut c = Client::new("user1", "pass1");
    assert_eq!(
        c.call_from(&mut shard0, "192.0.2.10:1", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
    assert_eq!(
        c.call_from(&mut shard1, "192.0.2.10:2", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
    assert_eq!(
        c.call_from(&mut shard0, "192.0.2.10:3", ALLOCATE, &udp)
            .error_code(),
        Some(508)
    );
    assert_eq!(ledger.total(), 2);
    shard1.advance(601);
    assert_eq!(ledger.total(), 1);
    assert_eq!(
        c.call_from(&mut shard0, "192.0.2.10:3", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
}

#[test]
fn relay_bind_failure_gives_508_and_holds_nothing() {
    let mut h = Harness::with(&quota_config(1), |_| {});
    let mut alice = ephemeral_client("alice");
    let from = "192.0.2.10:1001";
    let challenge = h.request(
        from,
        &alice.build(ALLOCATE, TransactionId::generate(), &udp, false),
    );
    alice.learn(&challenge);
    let req = alice.build(ALLOCATE, TransactionId::generate(), &udp, true);
    let action = h.handle(from, &req);
    let ClientAction::AllocateRelay(request) = action else {
        panic!("{action:?}");
    };
    let n = h
        .engine
        .complete_allocate(
            h.now,
            request.relay,
            Err(RelayBindError {
                kind: ErrorKind::AddrInUse,
            }),
            &mut h.out,
        )
        .unwrap();
    let reply = Reply {
        bytes: h.out[..n].to_vec(),
    };
    assert_eq!(reply.error_code(), Some(508));
    assert_eq!(h.engine.allocation_count(), 0);
    // The failed attempt took none of the user's quota of 1: the retry succeeds.
    assert_eq!(
        alice.call_from(&mut h, from, ALLOCATE, &udp).class(),
        MessageClass::Success
    );
}

#[test]
fn permissions_and_channels_per_allocation_are_capped() {
    let mut h = Harness::with(&config(STATIC_AUTH), |c| c.limits.max_permissions = 3);
    let (mut c, _) = allocate(&mut h);
    for peer in ["10.0.0.1:5000", "10.0.0.2:5000", "10.0.0.3:5000"] {
        let reply = c.call(&mut h, CREATE_PERMISSION, &peer_attr(peer));
        assert_eq!(reply.class(), MessageClass::Success, "{peer}");
    }
    // Refreshing one held is fine; a fourth is not.
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("10.0.0.1:5000"))
            .class(),
        MessageClass::Success
    );
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("10.0.0.4:5000"))
            .error_code(),
        Some(508)
    );
    // Channels: three to the permitted IPs, then 508.
    for (n, peer) in [
        (0x4000, "10.0.0.1:5000"),
        (0x4001, "10.0.0.1:5001"),
        (0x4002, "10.0.0.2:5000"),
    ] {
        let reply = c.call(&mut h, CHANNEL_BIND, &channel_attrs(n, peer));
        assert_eq!(reply.class(), MessageClass::Success, "{peer}");
    }
    assert_eq!(
        c.call(
            &mut h,
            CHANNEL_BIND,
            &channel_attrs(0x4003, "10.0.0.3:5000")
        )
        .error_code(),
        Some(508)
    );
    // Once the permissions expire (300 s) the room is back.
    h.advance(301);
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("10.0.0.4:5000"))
            .class(),
        MessageClass::Success
    );
}

#[test]
fn create_permission_over_the_cap_installs_and_refreshes_nothing() {
    let mut h = Harness::with(&config(STATIC_AUTH), |c| c.limits.max_permissions = 2);
    let (mut c, _) = allocate(&mut h);
    let held = c.call(&mut h, CREATE_PERMISSION, &peer_attr("10.0.0.1:5000"));
    assert_eq!(held.class(), MessageClass::Success);
    // Two new peers where only one fits: 508, and neither is installed (RFC 8656 §9.2).
    h.advance(200);
    let two_new = |m: &mut MessageWriteVec, txid| {
        for peer in ["10.0.0.1:5000", "10.0.0.8:5000", "10.0.0.9:5000"] {
            m.add_attribute(&XorPeerAddress::new(peer.parse().unwrap(), txid))
                .unwrap();
        }
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &two_new).error_code(),
        Some(508)
    );
    assert_eq!(
        h.peer(RelayId(0), "10.0.0.8:5000", b"x").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
    // The held one was not refreshed by the refused request: it ends 300 s after it was made.
    h.advance(101);
    assert_eq!(
        h.peer(RelayId(0), "10.0.0.1:5000", b"x").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
    // A peer named twice counts once.
    let twice = |m: &mut MessageWriteVec, txid| {
        for peer in ["10.0.0.8:5000", "10.0.0.8:6000", "10.0.0.9:5000"] {
            m.add_attribute(&XorPeerAddress::new(peer.parse().unwrap(), txid))
                .unwrap();
        }
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &twice).class(),
        MessageClass::Success
    );
}

/// The most IPv4 XOR-PEER-ADDRESS attributes one 64 KB CreatePermission carries beside its
/// credentials (issue #18 point 6).
const MAX_PEERS_IN_ONE_REQUEST: u32 = 5_444;

fn peer_number(i: u32) -> SocketAddr {
    SocketAddr::new(std::net::Ipv4Addr::from(0x0a00_0000 + i + 1).into(), 5000)
}

#[test]
fn create_permission_naming_thousands_of_peers_gets_508_and_stops_at_the_cap() {
    // Default cap: 256 permissions per allocation.
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    let many = |m: &mut MessageWriteVec, txid| {
        for i in 0..MAX_PEERS_IN_ONE_REQUEST {
            m.add_attribute(&XorPeerAddress::new(peer_number(i), txid))
                .unwrap();
        }
    };
    let reply = c.call(&mut h, CREATE_PERMISSION, &many);
    assert_eq!(reply.error_code(), Some(508));
    // RFC 8656 §9.2: refused as a whole, so none of them is installed.
    for i in [0, 1, 255, 5443] {
        let peer = peer_number(i).to_string();
        assert_eq!(
            h.peer(RelayId(0), &peer, b"x").0,
            PeerAction::Drop(DropReason::NoPermission),
            "{peer}"
        );
    }
    // The engine stops at the 257th new peer: what follows is never looked at, so a denied
    // peer (403), a peer of the other family (443) or a malformed XOR-PEER-ADDRESS (400) there
    // does not change the answer.
    let spoiled = |m: &mut MessageWriteVec, txid| {
        for i in 0..300 {
            m.add_attribute(&XorPeerAddress::new(peer_number(i), txid))
                .unwrap();
        }
        m.add_attribute(&XorPeerAddress::new(
            "172.16.0.1:5000".parse().unwrap(),
            txid,
        ))
        .unwrap();
        m.add_attribute(&XorPeerAddress::new(
            "[fd00::1]:5000".parse().unwrap(),
            txid,
        ))
        .unwrap();
        m.add_attribute(&stun_proto::types::attribute::RawAttribute::new(
            XorPeerAddress::TYPE,
            &[0xff],
        ))
        .unwrap();
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &spoiled).error_code(),
        Some(508)
    );
    // Within the cap, the same spoilers are answered as before.
    let denied = |m: &mut MessageWriteVec, txid| {
        for i in 0..10 {
            m.add_attribute(&XorPeerAddress::new(peer_number(i), txid))
                .unwrap();
        }
        m.add_attribute(&XorPeerAddress::new(
            "172.16.0.1:5000".parse().unwrap(),
            txid,
        ))
        .unwrap();
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &denied).error_code(),
        Some(403)
    );
    // 256 distinct peers, each named many times, fit exactly.
    let repeated = |m: &mut MessageWriteVec, txid| {
        for i in 0..MAX_PEERS_IN_ONE_REQUEST {
            m.add_attribute(&XorPeerAddress::new(peer_number(i % 256), txid))
                .unwrap();
        }
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &repeated).class(),
        MessageClass::Success
    );
    assert!(matches!(
        h.peer(RelayId(0), &peer_number(255).to_string(), b"x").0,
        PeerAction::ToClient { .. }
    ));
}

#[test]
fn unknown_attributes_reply_is_bounded() {
    let mut h = Harness::new(STATIC_AUTH);
    let c = Client::new("user1", "pass1");
    // 1000 unknown comprehension-required attributes, 400 distinct: the 420 names 32, once each.
    let many = |m: &mut MessageWriteVec, t| {
        udp(m, t);
        for i in 0..1000u16 {
            m.add_attribute(&stun_proto::types::attribute::RawAttribute::new(
                AttributeType::new(0x6000 + i % 400),
                &[],
            ))
            .unwrap();
        }
    };
    // Checked before authentication, as RFC 8489 §6.3.1 orders it.
    let reply = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &many, false),
    );
    assert_eq!(reply.error_code(), Some(420));
    let listed = reply
        .msg()
        .attribute::<stun_proto::types::attribute::UnknownAttributes>()
        .unwrap();
    let listed: Vec<u16> = (0x6000..0x6000 + 400)
        .filter(|&t| listed.has_attribute(AttributeType::new(t)))
        .collect();
    assert_eq!(listed, (0x6000..0x6000 + 32).collect::<Vec<u16>>());
    assert!(reply.bytes.len() <= 200, "{} bytes", reply.bytes.len());
    assert_eq!(h.engine.allocation_count(), 0);
}

#[test]
fn allocate_challenges_then_succeeds_with_advertised_relay_address() {
    let mut h = Harness::new(STATIC_AUTH);
    let (_, relay) = allocate(&mut h);
    assert_eq!(relay, "198.51.100.1:50002".parse().unwrap());
    assert_eq!(h.engine.allocation_count(), 1);
}

#[test]
fn allocate_lifetime_follows_pion_rules() {
    for (requested, granted) in [
        (None, 600),
        (Some(300), 300),
        (Some(3599), 3599),
        (Some(3600), 600),
        (Some(90000), 600),
    ] {
        let mut h = Harness::new(STATIC_AUTH);
        let mut c = Client::new("user1", "pass1");
        let attrs = move |m: &mut MessageWriteVec, t| {
            udp(m, t);
            if let Some(s) = requested {
                m.add_attribute(&Lifetime::new(s)).unwrap();
            }
        };
        let reply = c.call(&mut h, ALLOCATE, &attrs);
        assert_eq!(
            reply.msg().attribute::<Lifetime>().unwrap().seconds(),
            granted
        );
    }
}

#[test]
fn wrong_password_gets_401_and_no_allocation() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new("user1", "wrong");
    let reply = c.call(&mut h, ALLOCATE, &udp);
    assert_eq!(reply.error_code(), Some(401));
    assert!(reply.msg().attribute::<Nonce>().is_ok());
    assert_eq!(h.engine.allocation_count(), 0);
    let mut c = Client::new("nobody", "pass1");
    assert_eq!(c.call(&mut h, ALLOCATE, &udp).error_code(), Some(401));
    assert_eq!(h.engine.allocation_count(), 0);
}

#[test]
fn missing_fields_and_bad_transport() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new("user1", "pass1");
    assert_eq!(c.call(&mut h, ALLOCATE, &|_, _| {}).error_code(), Some(400));
    let tcp = |m: &mut MessageWriteVec, _| m.add_attribute(&RequestedTransport::new(6)).unwrap();
    assert_eq!(c.call(&mut h, ALLOCATE, &tcp).error_code(), Some(442));
    let v6 = |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
            .unwrap();
    };
    assert_eq!(c.call(&mut h, ALLOCATE, &v6).error_code(), Some(440));
    // An unknown comprehension-required attribute → 420.
    let unknown = |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&stun_proto::types::attribute::RawAttribute::new(
            AttributeType::new(0x7777),
            &[0, 0, 0, 0],
        ))
        .unwrap();
    };
    assert_eq!(c.call(&mut h, ALLOCATE, &unknown).error_code(), Some(420));
    assert_eq!(h.engine.allocation_count(), 0);
}

#[test]
fn stale_nonce_gets_438_with_a_fresh_nonce() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new("user1", "pass1");
    let challenge = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &udp, false),
    );
    c.learn(&challenge);
    h.advance(3601);
    let reply = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &udp, true),
    );
    assert_eq!(reply.error_code(), Some(438));
    c.learn(&reply);
    let reply = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &udp, true),
    );
    assert_eq!(reply.class(), MessageClass::Success);
}

#[test]
fn retransmitted_allocate_is_answered_from_cache_and_new_one_gets_437() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new("user1", "pass1");
    let challenge = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &udp, false),
    );
    c.learn(&challenge);
    let request = c.build(ALLOCATE, TransactionId::generate(), &udp, true);
    let first = h.request(CLIENT, &request);
    let again = h.request(CLIENT, &request);
    assert_eq!(first.bytes, again.bytes);
    assert_eq!(h.engine.allocation_count(), 1);
    let other = h.request(
        CLIENT,
        &c.build(ALLOCATE, TransactionId::generate(), &udp, true),
    );
    assert_eq!(other.error_code(), Some(437));
}

#[test]
fn refresh_extends_and_zero_deletes() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    let lifetime = |s: u32| {
        move |m: &mut MessageWriteVec, _: TransactionId| m.add_attribute(&Lifetime::new(s)).unwrap()
    };
    let reply = c.call(&mut h, REFRESH, &lifetime(120));
    assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 120);
    let v6 = |m: &mut MessageWriteVec, _: TransactionId| {
        m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
            .unwrap()
    };
    assert_eq!(c.call(&mut h, REFRESH, &v6).error_code(), Some(443));
    let reply = c.call(&mut h, REFRESH, &lifetime(0));
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(h.engine.allocation_count(), 0);
    assert_eq!(h.engine.poll_close(), Some(RelayId(0)));
    // RFC 8656: no allocation → 437 (stunnerd stays silent).
    assert_eq!(
        c.call(&mut h, REFRESH, &lifetime(60)).error_code(),
        Some(437)
    );
}

/// The shell may end an allocation and open the relay of the next Allocate before it drains
/// `poll_close` (a Refresh 0 and an Allocate in one receive batch or stream read): the ended
/// allocation's relay id must not be handed out again until its close was taken, or the
/// shell's close would land on the new allocation's socket and leave it dead.
#[test]
fn an_ended_allocations_relay_id_is_reused_only_after_its_close_is_taken() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    let lifetime_zero =
        |m: &mut MessageWriteVec, _: TransactionId| m.add_attribute(&Lifetime::new(0)).unwrap();
    assert_eq!(
        c.call(&mut h, REFRESH, &lifetime_zero).class(),
        MessageClass::Success
    );
    // The next Allocate on the same 5-tuple, before the shell drained the close of relay 0.
    let req = c.build(ALLOCATE, TransactionId::generate(), &udp, true);
    let action = h.handle(CLIENT, &req);
    let ClientAction::AllocateRelay(request) = action else {
        panic!("{action:?}");
    };
    assert_ne!(
        request.relay,
        RelayId(0),
        "relay 0 is still to be closed but was handed to a new allocation"
    );
    h.engine
        .complete_allocate(h.now, request.relay, Ok(50_100), &mut h.out)
        .expect("allocate reply");
    assert_eq!(h.engine.poll_close(), Some(RelayId(0)));
    assert_eq!(h.engine.poll_close(), None);
    // Once closed, the id serves the next allocation as usual.
    let mut other = Client::new("user1", "pass1");
    assert_eq!(
        other
            .call_from(&mut h, "192.0.2.11:40000", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
    assert_eq!(h.engine.allocation_count(), 2);
    assert_eq!(h.engine.poll_close(), None);
}

#[test]
fn allocation_expires_and_frees_its_relay() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new("user1", "pass1");
    let short = |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&Lifetime::new(30)).unwrap();
    };
    assert_eq!(
        c.call(&mut h, ALLOCATE, &short).class(),
        MessageClass::Success
    );
    h.advance(29);
    assert_eq!(h.engine.allocation_count(), 1);
    h.advance(2);
    assert_eq!(h.engine.allocation_count(), 0);
    assert_eq!(h.engine.poll_close(), Some(RelayId(0)));
}

#[test]
fn create_permission_checks_routes_family_and_peers() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &|_, _| {}).error_code(),
        Some(400)
    );
    // Outside every routed cluster ("other" is not routed): 403.
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("172.16.0.1:5000"))
            .error_code(),
        Some(403)
    );
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("[fd00::1]:5000"))
            .error_code(),
        Some(443)
    );
    // Several peers: one denied fails the request.
    let two = |m: &mut MessageWriteVec, t| {
        peer_attr("10.0.0.1:5000")(m, t);
        peer_attr("8.8.8.8:5000")(m, t);
    };
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &two).error_code(),
        Some(403)
    );
    let reply = c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    assert_eq!(reply.class(), MessageClass::Success);
    assert!(reply.msg().has_attribute(MessageIntegrity::TYPE));
}

#[test]
fn send_and_data_indications_relay_with_permission_and_admission() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    let indication = send_indication(PEER, b"hello");
    assert_eq!(
        h.send(CLIENT, &indication),
        ClientAction::Drop(DropReason::NoPermission)
    );
    c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    match h.send(CLIENT, &indication) {
        ClientAction::Relay {
            relay,
            peer,
            payload,
            ..
        } => {
            assert_eq!(relay, RelayId(0));
            assert_eq!(peer, PEER.parse().unwrap());
            assert_eq!(&indication[payload], b"hello");
        }
        other => panic!("{other:?}"),
    }
    // Port ranges apply per datagram: 10.1.2.3:7000 is outside <5000-6000>.
    assert_eq!(
        h.send(CLIENT, &send_indication("10.1.2.3:7000", b"x")),
        ClientAction::Drop(DropReason::NotAdmitted)
    );
    // Peer → client without a channel: a Data indication.
    let (action, bytes) = h.peer(RelayId(0), PEER, b"world");
    assert!(
        matches!(action, PeerAction::ToClient { client, .. } if client == CLIENT.parse().unwrap())
    );
    let msg = Message::from_bytes(&bytes).unwrap();
    assert_eq!(msg.class(), MessageClass::Indication);
    assert_eq!(msg.method(), DATA);
    assert_eq!(msg.attribute::<Data>().unwrap().data(), b"world");
    assert_eq!(
        msg.attribute::<XorPeerAddress>()
            .unwrap()
            .addr(msg.transaction_id()),
        PEER.parse().unwrap()
    );
    // From a peer without permission, or outside the port range: dropped.
    assert_eq!(
        h.peer(RelayId(0), "10.9.9.9:5500", b"x").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
    assert_eq!(
        h.peer(RelayId(0), "10.1.2.3:7000", b"x").0,
        PeerAction::Drop(DropReason::NotAdmitted)
    );
    // The permission expires after 300 s.
    h.advance(301);
    assert_eq!(
        h.peer(RelayId(0), PEER, b"late").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
}

#[test]
fn channel_bind_and_channel_data_both_ways() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x3FFF, PEER))
            .error_code(),
        Some(400)
    );
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x8000, PEER))
            .error_code(),
        Some(400)
    );
    assert_eq!(
        c.call(
            &mut h,
            CHANNEL_BIND,
            &channel_attrs(0x4001, "172.16.0.1:5000")
        )
        .error_code(),
        Some(403)
    );
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER))
            .class(),
        MessageClass::Success
    );
    // Refresh of the same binding is fine; conflicts are 400.
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER))
            .class(),
        MessageClass::Success
    );
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4002, PEER))
            .error_code(),
        Some(400)
    );
    assert_eq!(
        c.call(
            &mut h,
            CHANNEL_BIND,
            &channel_attrs(0x4001, "10.1.2.4:5500")
        )
        .error_code(),
        Some(400)
    );

    let mut frame = vec![0x40, 0x01, 0x00, 0x03];
    frame.extend_from_slice(b"abc\0");
    match h.send(CLIENT, &frame) {
        ClientAction::Relay { peer, payload, .. } => {
            assert_eq!(peer, PEER.parse().unwrap());
            assert_eq!(&frame[payload], b"abc");
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        h.send(CLIENT, &[0x40, 0x02, 0, 1, 9]),
        ClientAction::Drop(DropReason::NoChannel)
    );
    assert_eq!(
        h.send(CLIENT, &[0x40, 0x01, 0, 9, 1]),
        ClientAction::Drop(DropReason::Malformed)
    );
    assert_eq!(
        h.send("192.0.2.99:1", &frame),
        ClientAction::Drop(DropReason::NoAllocation)
    );

    let (_, bytes) = h.peer(RelayId(0), PEER, b"pong");
    assert_eq!(bytes, [0x40, 0x01, 0x00, 0x04, b'p', b'o', b'n', b'g']);
}

#[test]
fn admission_verdict_is_rechecked_when_the_config_changes() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER));
    let frame = [0x40, 0x01, 0x00, 0x01, b'z'];
    assert!(matches!(h.send(CLIENT, &frame), ClientAction::Relay { .. }));
    let indication = send_indication(PEER, b"y");
    assert!(matches!(
        h.send(CLIENT, &indication),
        ClientAction::Relay { .. }
    ));
    let narrowed = config(STATIC_AUTH).replace("10.0.0.0/8:<5000-6000>", "10.0.0.0/8:<1-100>");
    h.snap = Snapshot::from_config(&parse_config(&narrowed).unwrap(), 2, &|_| Vec::new());
    assert_eq!(
        h.send(CLIENT, &frame),
        ClientAction::Drop(DropReason::NotAdmitted)
    );
}

#[test]
fn ephemeral_credentials_work_until_they_expire() {
    let auth = "  type: ephemeral\n  credentials:\n    secret: s3cr3t";
    let mut h = Harness::new(auth);
    let user = ephemeral_username(EPOCH_UNIX + 60, "alice");
    let mut c = Client::new(&user, &ephemeral_password("s3cr3t", &user));
    assert_eq!(
        c.call(&mut h, ALLOCATE, &udp).class(),
        MessageClass::Success
    );
    let mut h = Harness::new(auth);
    let old = ephemeral_username(EPOCH_UNIX - 1, "alice");
    let mut c = Client::new(&old, &ephemeral_password("s3cr3t", &old));
    assert_eq!(c.call(&mut h, ALLOCATE, &udp).error_code(), Some(401));
    let mut c = Client::new(&user, &ephemeral_password("wrong", &user));
    assert_eq!(c.call(&mut h, ALLOCATE, &udp).error_code(), Some(401));
}

#[test]
fn auth_none_is_stun_only() {
    let mut h = Harness::new("  type: none");
    let mut c = Client::new("x", "y");
    assert_eq!(c.call(&mut h, ALLOCATE, &udp).error_code(), Some(400));
    let req = Message::builder_request(BINDING, MessageWriteVec::new()).finish();
    assert_eq!(h.request(CLIENT, &req).class(), MessageClass::Success);
}

#[test]
fn malformed_datagrams_are_dropped_and_counted() {
    let mut h = Harness::new(STATIC_AUTH);
    let mut seed: u64 = 0x1234_5678;
    for i in 0..5000usize {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let len = (seed % 120) as usize;
        let mut data: Vec<u8> = (0..len)
            .map(|j| (seed >> (j % 56)) as u8 ^ j as u8)
            .collect();
        if i % 3 == 0 && len >= 20 {
            // A STUN-looking header with a bogus body.
            data[0] = 0x00;
            data[1] = 0x03;
            data[4..8].copy_from_slice(&[0x21, 0x12, 0xA4, 0x42]);
        }
        let _ = h.send(CLIENT, &data);
    }
    assert!(h.engine.stats().dropped[DropReason::Malformed.index()] > 1000);
    assert_eq!(h.engine.allocation_count(), 0);
    allocate(&mut h);
}

/// The transaction ids of `count` Data indications relayed from PEER to an allocation.
fn data_indication_txids(h: &mut Harness, count: usize) -> Vec<u128> {
    let (mut c, _) = allocate(h);
    let permitted = c.call(h, CREATE_PERMISSION, &peer_attr(PEER));
    assert_eq!(permitted.class(), MessageClass::Success);
    (0..count)
        .map(|_| {
            let (action, bytes) = h.peer(RelayId(0), PEER, b"media");
            assert!(matches!(action, PeerAction::ToClient { .. }), "{action:?}");
            let msg = Message::from_bytes(&bytes).unwrap();
            assert_eq!(msg.method(), DATA);
            u128::from(msg.transaction_id())
        })
        .collect()
}

#[test]
fn data_indication_txids_are_random_and_unrelated_to_the_nonce_key() {
    // Two shards of one process share the nonce key ([42; 32] in both harnesses).
    let mut shard0 = Harness::new(STATIC_AUTH);
    let mut shard1 = Harness::new(STATIC_AUTH);
    let ids0 = data_indication_txids(&mut shard0, 500);
    let ids1 = data_indication_txids(&mut shard1, 500);
    // No repeats, within a shard or across shards.
    let all: std::collections::HashSet<u128> = ids0.iter().chain(&ids1).copied().collect();
    assert_eq!(all.len(), 1000);
    // Every one of the 96 bits varies as a fair coin's would (500 draws: 250 ± 11 each; the
    // bound is ±6.8 sigma), so no bit is a constant such as a bit of the nonce key.
    let key_bits = u128::from_be_bytes([42; 16]) >> 32;
    for ids in [&ids0, &ids1] {
        for bit in 0..96 {
            let ones = ids.iter().filter(|&&id| id >> bit & 1 == 1).count();
            assert!((175..=325).contains(&ones), "bit {bit}: {ones} of 500");
        }
        // Consecutive ids differ in about half their bits, not in a few low ones (a counter).
        let close = ids
            .windows(2)
            .filter(|w| (w[0] ^ w[1]).count_ones() < 16)
            .count();
        assert_eq!(close, 0);
        assert!(ids.iter().all(|&id| id != key_bits));
    }
}

/// `signed` with an attribute of type `atype` appended after its MESSAGE-INTEGRITY (the
/// header's length grows to cover it; the integrity stays valid for what it covered).
fn append_after_integrity(signed: &[u8], atype: u16, value: &[u8]) -> Vec<u8> {
    let mut data = signed.to_vec();
    data.extend_from_slice(&atype.to_be_bytes());
    data.extend_from_slice(&(value.len() as u16).to_be_bytes());
    data.extend_from_slice(value);
    data.resize(data.len().next_multiple_of(4), 0);
    let length = (data.len() - 20) as u16;
    data[2..4].copy_from_slice(&length.to_be_bytes());
    data
}

#[test]
fn attributes_after_message_integrity_are_ignored() {
    let mut h = Harness::new(STATIC_AUTH);
    let (c, _) = allocate(&mut h);
    let lifetime = |secs: u32| {
        move |m: &mut MessageWriteVec, _: TransactionId| {
            m.add_attribute(&Lifetime::new(secs)).unwrap();
        }
    };
    // Refresh for 300 s, with a LIFETIME 0 (delete) appended after the integrity.
    let signed = c.build(REFRESH, TransactionId::generate(), &lifetime(300), true);
    let reply = h.request(
        CLIENT,
        &append_after_integrity(&signed, Lifetime::TYPE.value(), &0u32.to_be_bytes()),
    );
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 300);
    assert_eq!(h.engine.allocation_count(), 1);
    // A Refresh with no LIFETIME and one appended: the default (600 s), not the appended 60.
    let signed = c.build(REFRESH, TransactionId::generate(), &|_, _| {}, true);
    let reply = h.request(
        CLIENT,
        &append_after_integrity(&signed, Lifetime::TYPE.value(), &60u32.to_be_bytes()),
    );
    assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 600);
    // A CreatePermission for one peer with another appended: only the first is installed.
    let signed = c.build(
        CREATE_PERMISSION,
        TransactionId::generate(),
        &peer_attr("10.0.0.1:5000"),
        true,
    );
    let txid = Message::from_bytes(&signed).unwrap().transaction_id();
    let appended = {
        // XOR-PEER-ADDRESS 10.0.0.2:5000 under the request's transaction id.
        let mut m = Message::builder(
            MessageType::from_class_method(MessageClass::Request, CREATE_PERMISSION),
            txid,
            MessageWriteVec::new(),
        );
        m.add_attribute(&XorPeerAddress::new("10.0.0.2:5000".parse().unwrap(), txid))
            .unwrap();
        m.finish()[24..].to_vec()
    };
    let reply = h.request(
        CLIENT,
        &append_after_integrity(&signed, XorPeerAddress::TYPE.value(), &appended),
    );
    assert_eq!(reply.class(), MessageClass::Success);
    assert!(matches!(
        h.peer(RelayId(0), "10.0.0.1:5000", b"x").0,
        PeerAction::ToClient { .. }
    ));
    assert_eq!(
        h.peer(RelayId(0), "10.0.0.2:5000", b"x").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
    // A ChannelBind whose CHANNEL-NUMBER comes after the integrity lacks one: 400.
    let signed = c.build(
        CHANNEL_BIND,
        TransactionId::generate(),
        &peer_attr("10.0.0.1:5000"),
        true,
    );
    let reply = h.request(
        CLIENT,
        &append_after_integrity(&signed, ChannelNumber::TYPE.value(), &[0x40, 0, 0, 0]),
    );
    assert_eq!(reply.error_code(), Some(400));
    // An Allocate whose REQUESTED-TRANSPORT comes after the integrity lacks one: 400, and a
    // LIFETIME there does not set the allocation's.
    let mut other = Client::new("user1", "pass1");
    let from = "192.0.2.77:4000";
    other.learn_nonce(&mut h, from);
    let signed = other.build(ALLOCATE, TransactionId::generate(), &|_, _| {}, true);
    let reply = h.request(
        from,
        &append_after_integrity(&signed, RequestedTransport::TYPE.value(), &[17, 0, 0, 0]),
    );
    assert_eq!(reply.error_code(), Some(400));
    let signed = other.build(ALLOCATE, TransactionId::generate(), &udp, true);
    let reply = h.request(
        from,
        &append_after_integrity(&signed, Lifetime::TYPE.value(), &60u32.to_be_bytes()),
    );
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 600);
}

/// An unauthenticated request of each kind a client (or a spoofer) can send, padded to exactly
/// `size` bytes with a comprehension-optional attribute the engine ignores; `None` when the
/// kind's smallest form is larger. `creds` signs it (a refused password or a stale nonce).
fn sized_request(kind: &str, size: usize, creds: &Client) -> Option<Vec<u8>> {
    let pad = |m: &mut MessageWriteVec, base: usize| {
        if size > base {
            let value = vec![0u8; size - base - 4];
            m.add_attribute(&stun_proto::types::attribute::RawAttribute::new(
                AttributeType::new(0xC0DE),
                &value,
            ))
            .unwrap();
        }
    };
    let fits = |base: usize| size == base || size >= base + 4;
    let request = |method: Method, base: usize, attrs: Attrs<'_>, signed: bool| {
        fits(base).then(|| {
            let padded = |m: &mut MessageWriteVec, t| {
                attrs(m, t);
                pad(m, base);
            };
            creds.build(method, TransactionId::generate(), &padded, signed)
        })
    };
    let peer = |m: &mut MessageWriteVec, t| {
        m.add_attribute(&XorPeerAddress::new(PEER.parse().unwrap(), t))
            .unwrap()
    };
    // USERNAME "user1" (12) + REALM "stunner.l7mp.io" (20) + NONCE (20) + MESSAGE-INTEGRITY (24).
    let signed_base = 20 + 12 + 20 + 4 + creds.nonce.len().next_multiple_of(4) + 24;
    let built = match kind {
        "Binding" => request(BINDING, 20, &|_, _| {}, false),
        "Allocate" => request(ALLOCATE, 20, &|_, _| {}, false),
        "Allocate+REQUESTED-TRANSPORT" => request(ALLOCATE, 28, &udp, false),
        "Refresh" => request(REFRESH, 20, &|_, _| {}, false),
        "CreatePermission" => request(CREATE_PERMISSION, 32, &peer, false),
        "ChannelBind" => request(CHANNEL_BIND, 40, &channel_attrs(0x4000, PEER), false),
        "unknown method" => request(Method::new(0x0FF), 20, &|_, _| {}, false),
        "unknown attribute (420)" => request(
            ALLOCATE,
            24,
            &|m: &mut MessageWriteVec, _| {
                m.add_attribute(&stun_proto::types::attribute::RawAttribute::new(
                    AttributeType::new(0x7777),
                    &[],
                ))
                .unwrap()
            },
            false,
        ),
        "bad integrity (401)" | "stale nonce (438)" => {
            request(REFRESH, signed_base, &|_, _| {}, true)
        }
        "Send indication" => fits(36).then(|| {
            let mut msg = Message::builder(
                MessageType::from_class_method(MessageClass::Indication, SEND),
                TransactionId::generate(),
                MessageWriteVec::new(),
            );
            let txid = msg.transaction_id();
            peer(&mut msg, txid);
            msg.add_attribute(&Data::new(&[])).unwrap();
            pad(&mut msg, 36);
            msg.finish()
        }),
        other => panic!("{other}"),
    }?;
    assert_eq!(built.len(), size, "{kind}");
    Some(built)
}

#[test]
fn every_reply_to_an_unauthenticated_request_is_at_most_3x_its_size() {
    use uturn_shared::config::ListenerProtocol;
    let mut h = Harness::with(&config(STATIC_AUTH), |c| c.limits.challenge_rate = 0);
    let anonymous = Client::new("user1", "pass1");
    // A refused password, with a nonce the engine issued to each source.
    let mut refused = Client::new("user1", "wrong");
    // A nonce the engine did not issue: 438.
    let mut stale = Client::new("user1", "pass1");
    stale.realm = "stunner.l7mp.io".into();
    stale.nonce = "AAAAAAAAAAAAAAAA".into();
    let kinds = [
        "Binding",
        "Allocate",
        "Allocate+REQUESTED-TRANSPORT",
        "Refresh",
        "CreatePermission",
        "ChannelBind",
        "unknown method",
        "unknown attribute (420)",
        "bad integrity (401)",
        "stale nonce (438)",
        "Send indication",
    ];
    let mut dropped_sizes = std::collections::BTreeSet::new();
    for from in [CLIENT, "[2001:db8::10]:40000"] {
        refused.learn_nonce(&mut h, from);
        for protocol in [
            ListenerProtocol::TurnUdp,
            ListenerProtocol::TurnTcp,
            ListenerProtocol::TurnTls,
            ListenerProtocol::TurnDtls,
        ] {
            let mut spec = h.snap.listeners[0].clone();
            spec.protocol = protocol;
            for kind in kinds {
                let creds = match kind {
                    "bad integrity (401)" => &refused,
                    "stale nonce (438)" => &stale,
                    _ => &anonymous,
                };
                for size in (20..=256).step_by(4) {
                    let Some(request) = sized_request(kind, size, creds) else {
                        continue;
                    };
                    let arrival = Arrival {
                        now: h.now,
                        snap: &h.snap,
                        listener: ListenerRef {
                            id: ListenerId(1),
                            spec: &spec,
                        },
                        client: from.parse().unwrap(),
                        kind: ArrivalKind::Straight,
                    };
                    let action = h.engine.handle_client(arrival, &request, &mut h.out);
                    let case = format!("{kind}, {size} bytes, from {from} over {protocol:?}");
                    match action {
                        ClientAction::Reply(n) => {
                            assert!(n <= 3 * size, "{case}: a {n}-byte reply");
                            let reply = Message::from_bytes(&h.out[..n]).unwrap();
                            let code = reply.attribute::<ErrorCode>().ok().map(|e| e.code());
                            let expected = match kind {
                                "Binding" => None,
                                "unknown method" => Some(400),
                                "unknown attribute (420)" => Some(420),
                                "stale nonce (438)" => Some(438),
                                _ => Some(401),
                            };
                            assert_eq!(code, expected, "{case}");
                            if matches!(code, Some(401 | 438)) {
                                // A challenge always carries what a client needs to answer it.
                                assert!(reply.has_attribute(Realm::TYPE), "{case}");
                                assert!(reply.has_attribute(Nonce::TYPE), "{case}");
                            }
                        }
                        ClientAction::Drop(DropReason::NoAllocation) => {
                            assert_eq!(kind, "Send indication", "{case}");
                        }
                        ClientAction::Drop(DropReason::Amplification) => {
                            dropped_sizes.insert(size);
                        }
                        other => panic!("{case}: {other:?}"),
                    }
                }
            }
        }
    }
    // Only a challenge to a bare 20-byte request cannot fit (60 bytes; it takes 68 with this
    // 15-character realm). The smallest Allocate a real client sends (REQUESTED-TRANSPORT,
    // 28 bytes) gets its 401 whole: 80 bytes, reason phrase included.
    assert_eq!(dropped_sizes.into_iter().collect::<Vec<_>>(), vec![20]);
    let allocate = sized_request("Allocate+REQUESTED-TRANSPORT", 28, &anonymous).unwrap();
    for from in [CLIENT, "[2001:db8::10]:40000"] {
        let reply = h.request(from, &allocate);
        assert_eq!(reply.error_code(), Some(401));
        assert_eq!(reply.bytes.len(), 80);
        let reason = reply.msg().attribute::<ErrorCode>().unwrap();
        assert_eq!(reason.reason(), "Unauthorized");
    }
    assert!(h.engine.stats().dropped[DropReason::Amplification.index()] > 0);
}

/// A small xorshift generator: property tests run a fixed list of seeds, so a failure
/// reproduces.
struct Xorshift(u64);

impl Xorshift {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[test]
fn accounting_invariants_hold_after_any_sequence_of_operations() {
    const USERS: [&str; 3] = ["alice", "bob", "carol"];
    const CLIENTS: usize = 8;
    let (mut created, mut refused, mut failed_binds) = (0u64, 0u64, 0u64);
    for seed in [1u64, 2, 3, 0xdead_beef, 0x1234_5678_9abc, 42, 7, 99] {
        let ledger = std::sync::Arc::new(uturn_dataplane::proto::AllocationLedger::new());
        let tune = |c: &mut EngineConfig| {
            c.limits.max_allocations = 5;
            c.limits.challenge_rate = 0;
            c.ledger = ledger.clone();
        };
        // Two shards sharing the ledger; user quota 2.
        let mut shards = [
            Harness::with(&quota_config(2), tune),
            Harness::with(&quota_config(2), tune),
        ];
        let from = |i: usize| format!("192.0.2.{}:{}", 10 + i % 3, 1000 + i);
        let shard_of = |i: usize| i % 2;
        let mut clients: Vec<Client> = (0..CLIENTS)
            .map(|i| ephemeral_client(USERS[i % USERS.len()]))
            .collect();
        // The user whose quota each client's live allocation holds, from its success reply.
        let mut holder: Vec<Option<&str>> = vec![None; CLIENTS];
        let (mut opened, mut closed, mut bind_failures) = (0u64, 0u64, 0u64);
        let mut rng = Xorshift(seed);
        for step in 0..400 {
            let i = rng.below(CLIENTS as u64) as usize;
            let h = &mut shards[shard_of(i)];
            let op = rng.below(6);
            match op {
                // Allocate; its relay bind succeeds (0) or fails (1).
                0 | 1 => {
                    clients[i].learn_nonce(h, &from(i));
                    let request = clients[i].build(ALLOCATE, TransactionId::generate(), &udp, true);
                    let action = h.handle(&from(i), &request);
                    if let ClientAction::AllocateRelay(relay) = action {
                        let bound = if op == 0 {
                            opened += 1;
                            h.next_port += 2;
                            Ok(h.next_port)
                        } else {
                            bind_failures += 1;
                            Err(RelayBindError {
                                kind: ErrorKind::AddrInUse,
                            })
                        };
                        let n = h
                            .engine
                            .complete_allocate(h.now, relay.relay, bound, &mut h.out)
                            .unwrap();
                        let reply = Message::from_bytes(&h.out[..n]).unwrap();
                        if reply.class() == MessageClass::Success {
                            holder[i] = Some(USERS[i % USERS.len()]);
                        }
                    }
                }
                // Refresh to a random lifetime; 0 deletes.
                2 => {
                    let seconds = [0, 0, 30, 300, 700][rng.below(5) as usize];
                    let lifetime = move |m: &mut MessageWriteVec, _: TransactionId| {
                        m.add_attribute(&Lifetime::new(seconds)).unwrap();
                    };
                    clients[i].call_from(h, &from(i), REFRESH, &lifetime);
                }
                // Time passes; allocations expire.
                3 => {
                    let secs = [1, 29, 31, 299, 601][rng.below(5) as usize];
                    h.advance(secs);
                }
                // The client's connection closes.
                4 => h
                    .engine
                    .close_client(ListenerId(1), from(i).parse().unwrap()),
                // A retransmitted (or replayed) Allocate, and a Binding: nothing changes.
                _ => {
                    let binding = Message::builder_request(BINDING, MessageWriteVec::new());
                    h.request(&from(i), &binding.finish());
                }
            }
            for h in shards.iter_mut() {
                while h.engine.poll_close().is_some() {
                    closed += 1;
                }
            }
            for (i, held) in holder.iter_mut().enumerate() {
                if !shards[shard_of(i)]
                    .engine
                    .has_allocation(ListenerId(1), from(i).parse().unwrap())
                {
                    *held = None;
                }
            }
            let case = format!("seed {seed:#x}, step {step}, op {op} on client {i}");
            let live: usize = shards.iter().map(|h| h.engine.allocation_count()).sum();
            for user in USERS {
                let holding = holder.iter().filter(|&&u| u == Some(user)).count();
                assert_eq!(ledger.held_by(user) as usize, holding, "{case}: {user}");
            }
            assert_eq!(ledger.total(), live, "{case}: ledger total");
            assert_eq!(opened, closed + live as u64, "{case}: relay sockets");
            for h in &shards {
                let stats = h.engine.stats();
                assert_eq!(
                    stats.allocations_created - stats.allocations_deleted,
                    h.engine.allocation_count() as u64,
                    "{case}: created - deleted"
                );
            }
        }
        // The sequences went through every outcome: allocations, quota and cap refusals, and
        // failed binds.
        created += shards
            .iter()
            .map(|h| h.engine.stats().allocations_created)
            .sum::<u64>();
        refused += shards
            .iter()
            .map(|h| h.engine.stats().quota_refusals)
            .sum::<u64>();
        failed_binds += bind_failures;
    }
    assert!(
        created > 100 && refused > 10 && failed_binds > 10,
        "{created} {refused} {failed_binds}"
    );
}

/// With a kernel offload, the engine reports what each request changed, at the grain the shell
/// can carry out in proportion to it (a ChannelBind: that channel, and its peer's permission;
/// a CreatePermission: the permissions; a Refresh: the allocation's deadline), and says which of
/// its channels the kernel may relay until when: the first of the channel's and its
/// permission's ends, the allocation's own end being its deadline. Past that instant, or once
/// the peer is no longer admitted, the channel is not offloadable (the kernel program checks
/// the same instants per packet; `stunnerd/tests/offload.rs` shows it on the wire).
#[test]
fn offloadable_channels_end_with_the_first_of_channel_permission_and_allocation() {
    use uturn_dataplane::proto::OffloadChange;
    let mut h = Harness::new(STATIC_AUTH);
    h.engine.enable_offload();
    let t0 = h.now;
    let secs = |s: u64| t0 + Duration::from_secs(s);
    let (mut c, _) = allocate(&mut h);
    assert_eq!(
        h.engine.poll_offload(),
        None,
        "an Allocate binds no channel"
    );
    let reply = c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4000, PEER));
    assert_eq!(reply.class(), MessageClass::Success);
    let Some(OffloadChange::Channel(relay, 0x4000)) = h.engine.poll_offload() else {
        panic!("the ChannelBind's channel is reported first")
    };
    let peer: std::net::SocketAddr = PEER.parse().unwrap();
    let permission = OffloadChange::Permission(relay, peer.ip());
    assert_eq!(h.engine.poll_offload(), Some(permission));
    assert_eq!(h.engine.poll_offload(), None);
    let snap = h.snap.clone();
    let channel = h.engine.offload_channel(relay, 0x4000, &snap, h.now);
    let offloadable = |h: &mut Harness| h.engine.offload_channels(relay, &h.snap.clone(), h.now);
    let channels = offloadable(&mut h);
    assert_eq!(channel.as_ref(), channels.first());
    assert_eq!(channels.len(), 1);
    assert_eq!(channels[0].number, 0x4000);
    assert_eq!(channels[0].peer, peer);
    // Channel 600 s, permission 300 s, allocation 600 s (its deadline), each apart.
    assert_eq!(channels[0].expires_at, secs(600));
    assert_eq!(channels[0].permission_expires_at, secs(300));
    assert_eq!(h.engine.offload_deadline(relay), Some(secs(600)));
    assert_eq!(
        h.engine.offload_permission(relay, peer.ip(), h.now),
        Some(OffloadPermission {
            expires_at: secs(300),
            bound_channels: 1
        })
    );
    // A CreatePermission at 200 s: the permission now ends at 500 s; one change, its own.
    h.advance(200);
    c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    assert_eq!(h.engine.poll_offload(), Some(permission));
    assert_eq!(h.engine.poll_offload(), None);
    assert_eq!(offloadable(&mut h)[0].permission_expires_at, secs(500));
    // Permission expiry: at 500 s nothing is offloadable any more.
    h.advance(300);
    assert!(
        offloadable(&mut h).is_empty(),
        "offloadable past its permission"
    );
    // A new permission (until 800 s) and a longer allocation (Refresh: until 1 100 s, one
    // deadline change): the channel, bound at 0 s, ends first, at 600 s.
    c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    c.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(600)).unwrap();
    });
    assert_eq!(h.engine.poll_offload(), Some(permission));
    assert_eq!(
        h.engine.poll_offload(),
        Some(OffloadChange::Deadline(relay))
    );
    assert_eq!(h.engine.offload_deadline(relay), Some(secs(1_100)));
    assert_eq!(offloadable(&mut h)[0].expires_at, secs(600));
    assert_eq!(offloadable(&mut h)[0].permission_expires_at, secs(800));
    // A failed request changes nothing: no report.
    let reply = c.call(
        &mut h,
        CHANNEL_BIND,
        &channel_attrs(0x4000, "10.9.9.9:5000"),
    );
    assert_eq!(reply.class(), MessageClass::Error);
    assert_eq!(h.engine.poll_offload(), None);
    // Channel expiry: at 600 s the permission lives on, the channel does not.
    h.advance(100);
    assert!(
        offloadable(&mut h).is_empty(),
        "offloadable past its channel"
    );
    // A peer the snapshot stops admitting is not offloadable either, whatever its lifetimes.
    let reply = c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER));
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(offloadable(&mut h).len(), 1);
    h.snap = Snapshot::from_config(
        &parse_config(&config(STATIC_AUTH).replace("10.0.0.0/8:<5000-6000>", "10.9.9.9")).unwrap(),
        2,
        &|_| Vec::new(),
    );
    h.engine.recheck_offload();
    assert_eq!(h.engine.poll_offload(), Some(OffloadChange::All(relay)));
    assert!(
        offloadable(&mut h).is_empty(),
        "offloadable to a peer no cluster admits"
    );
    // Deleted: nothing, and the shell hears of it from poll_close.
    c.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(0)).unwrap();
    });
    assert!(offloadable(&mut h).is_empty());
    assert_eq!(h.engine.poll_close(), Some(relay));
}

/// An allocation whose client comes through a sibling pod is not offloaded (what goes to the
/// client must go back through the sibling, which only user space does): when its flow moves
/// to a sibling, the engine reports the allocation whole and offers none of its channels; when
/// the flow comes straight again, it reports it again and offers them back.
#[test]
fn a_client_reached_through_a_sibling_is_not_offloaded() {
    use uturn_dataplane::proto::OffloadChange;
    let mut h = Harness::new(STATIC_AUTH);
    h.engine.enable_offload();
    h.engine.set_forward_misses(true);
    let (mut c, _) = allocate(&mut h);
    let reply = c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4000, PEER));
    assert_eq!(reply.class(), MessageClass::Success);
    let Some(OffloadChange::Channel(relay, _)) = h.engine.poll_offload() else {
        panic!("the channel is reported")
    };
    while h.engine.poll_offload().is_some() {}
    let offered = |h: &mut Harness| {
        h.engine
            .offload_channels(relay, &h.snap.clone(), h.now)
            .len()
    };
    assert_eq!(offered(&mut h), 1);
    // The flow moves: a ChannelData forwarded by sibling 10.1.0.2.
    let via: std::net::SocketAddr = "10.1.0.2:13479".parse().unwrap();
    let data = [0x40, 0x00, 0x00, 0x02, b'h', b'i'];
    let forwarded = |h: &mut Harness| h.handle_as(CLIENT, &data, ArrivalKind::Forwarded { via });
    assert!(matches!(forwarded(&mut h), ClientAction::Relay { .. }));
    assert_eq!(h.engine.poll_offload(), Some(OffloadChange::All(relay)));
    assert_eq!(
        offered(&mut h),
        0,
        "offloaded while the client is behind a sibling"
    );
    let snap = h.snap.clone();
    assert_eq!(h.engine.offload_channel(relay, 0x4000, &snap, h.now), None);
    // More forwarded datagrams change nothing more.
    forwarded(&mut h);
    assert_eq!(h.engine.poll_offload(), None);
    // Straight again: reported, and offered back.
    assert!(matches!(h.send(CLIENT, &data), ClientAction::Relay { .. }));
    assert_eq!(h.engine.poll_offload(), Some(OffloadChange::All(relay)));
    assert_eq!(offered(&mut h), 1);
}

// Dual stack (RFC 8656 with RFC 6156's families): IPv6 relays, dual allocations
// (ADDITIONAL-ADDRESS-FAMILY) and the per-family checks.

/// An IPv6 peer the dual config's `media` cluster admits (ports 5000-6000).
const PEER6: &str = "[fd00::1]:5500";

/// The default config with `media` admitting IPv6 peers on ports 5000-6000 only, on a host
/// whose environment names `::1` as the IPv6 relay address when `ipv6` (`STUNNER_ADDRS`): the
/// listener then relays IPv4 as 198.51.100.1 and IPv6 as ::1.
fn dual_harness(ipv6: bool) -> Harness {
    let yaml = config(STATIC_AUTH).replace("\"fd00::/64\"", "\"fd00::/64:<5000-6000>\"");
    let relay = RelayAddresses {
        v4: None,
        v6: ipv6.then_some(Ipv6Addr::LOCALHOST),
    };
    Harness::on_host(&yaml, relay, |_| {})
}

/// Adds REQUESTED-TRANSPORT UDP and REQUESTED-ADDRESS-FAMILY `family`.
fn udp_family(family: AddressFamily) -> impl Fn(&mut MessageWriteVec, TransactionId) {
    move |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&RequestedAddressFamily::new(family))
            .unwrap();
    }
}

/// Adds REQUESTED-TRANSPORT UDP and an ADDITIONAL-ADDRESS-FAMILY of value `family` (0x02
/// IPv6; anything else is written as is).
fn udp_additional(family: u8) -> impl Fn(&mut MessageWriteVec, TransactionId) {
    move |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&RawAttribute::new(
            AdditionalAddressFamily::TYPE,
            &[family, 0, 0, 0],
        ))
        .unwrap();
    }
}

/// An authenticated Allocate with `attrs` from `client`, up to the relay sockets it asks for:
/// the request and the message (for a retransmission).
fn relay_request(
    h: &mut Harness,
    c: &mut Client,
    client: &str,
    attrs: Attrs<'_>,
) -> (RelayRequest, Vec<u8>) {
    c.learn_nonce(h, client);
    let req = c.build(ALLOCATE, TransactionId::generate(), attrs, true);
    match h.handle(client, &req) {
        ClientAction::AllocateRelay(request) => (request, req),
        other => panic!("no relay asked for: {other:?}"),
    }
}

/// The Allocate reply `complete_allocate` writes for `relay` with `bound`.
fn complete(h: &mut Harness, relay: RelayId, bound: impl Into<BoundRelays>) -> Reply {
    let n = h
        .engine
        .complete_allocate(h.now, relay, bound, &mut h.out)
        .expect("allocate reply");
    Reply {
        bytes: h.out[..n].to_vec(),
    }
}

/// The XOR-RELAYED-ADDRESSes of an Allocate success, in order.
fn relayed(reply: &Reply) -> Vec<SocketAddr> {
    let msg = reply.msg();
    (0..)
        .map_while(|i| msg.nth_attribute::<XorRelayedAddress>(i).ok())
        .map(|a| a.addr(msg.transaction_id()))
        .collect()
}

/// The family byte and error code of an Allocate success's ADDRESS-ERROR-CODE.
fn address_error(reply: &Reply) -> Option<(u8, u16)> {
    let msg = reply.msg();
    let raw = msg.raw_attribute(AttributeType::new(0x8001))?;
    let v = &raw.value;
    Some((v[0], u16::from(v[2] & 7) * 100 + u16::from(v[3])))
}

/// The relay socket a client datagram was sent from, with the peer and payload.
fn relayed_to(action: ClientAction, data: &[u8]) -> (RelayId, SocketAddr, Vec<u8>) {
    match action {
        ClientAction::Relay {
            relay,
            peer,
            payload,
            ..
        } => (relay, peer, data[payload].to_vec()),
        other => panic!("not relayed: {other:?}"),
    }
}

/// The peer and payload of a Data indication.
fn data_indication(bytes: &[u8]) -> (SocketAddr, Vec<u8>) {
    let msg = Message::from_bytes(bytes).unwrap();
    assert_eq!(
        (msg.class(), msg.method()),
        (MessageClass::Indication, DATA)
    );
    let peer = msg.attribute::<XorPeerAddress>().unwrap();
    (
        peer.addr(msg.transaction_id()),
        msg.attribute::<Data>().unwrap().data().to_vec(),
    )
}

/// `client` relays through `relay` to `peer` and back, byte-exact: Send and Data indications,
/// then ChannelData on `channel`.
fn relays_both_ways(
    h: &mut Harness,
    c: &mut Client,
    client: &str,
    relay: RelayId,
    peer: &'static str,
    channel: u16,
) {
    let call = |h: &mut Harness, c: &mut Client, method, attrs: Attrs<'_>| {
        h.request(
            client,
            &c.build(method, TransactionId::generate(), attrs, true),
        )
    };
    let payload: Vec<u8> = (0..=255u8).collect();
    let reply = call(h, c, CREATE_PERMISSION, &peer_attr(peer));
    assert_eq!(
        reply.class(),
        MessageClass::Success,
        "{:?}",
        reply.error_code()
    );
    let indication = send_indication(peer, &payload);
    let sent = relayed_to(h.send(client, &indication), &indication);
    assert_eq!(sent, (relay, peer.parse().unwrap(), payload.clone()));
    let (action, bytes) = h.peer(relay, peer, &payload);
    assert!(
        matches!(action, PeerAction::ToClient { client: to, .. } if to == client.parse().unwrap()),
        "{action:?}"
    );
    assert_eq!(
        data_indication(&bytes),
        (peer.parse().unwrap(), payload.clone())
    );
    let reply = call(h, c, CHANNEL_BIND, &channel_attrs(channel, peer));
    assert_eq!(
        reply.class(),
        MessageClass::Success,
        "{:?}",
        reply.error_code()
    );
    let mut frame = channel.to_be_bytes().to_vec();
    frame.extend_from_slice(&(payload.len() as u16).to_be_bytes());
    frame.extend_from_slice(&payload);
    let sent = relayed_to(h.send(client, &frame), &frame);
    assert_eq!(sent, (relay, peer.parse().unwrap(), payload.clone()));
    let (_, bytes) = h.peer(relay, peer, &payload);
    assert_eq!(bytes, frame);
}

#[test]
fn ipv6_relay_relays_to_ipv6_peers_both_ways_for_ipv4_and_ipv6_clients() {
    for client in [CLIENT, "[2001:db8::10]:40000"] {
        let mut h = dual_harness(true);
        let mut c = Client::new(USER, PASS);
        let (request, _) = relay_request(&mut h, &mut c, client, &udp_family(AddressFamily::IPV6));
        assert_eq!((request.family, request.additional), (Family::V6, None));
        assert_eq!(request.relay.family(), Family::V6);
        let reply = complete(&mut h, request.relay, Ok(50_002));
        assert_eq!(relayed(&reply), ["[::1]:50002".parse().unwrap()]);
        assert_eq!(address_error(&reply), None);
        relays_both_ways(&mut h, &mut c, client, request.relay, PEER6, 0x4001);
        // An IPv4 peer on an IPv6-only allocation: 443, and a Send to one is dropped.
        let call = |h: &mut Harness, c: &mut Client, method, attrs: Attrs<'_>| {
            h.request(
                client,
                &c.build(method, TransactionId::generate(), attrs, true),
            )
        };
        assert_eq!(
            call(&mut h, &mut c, CREATE_PERMISSION, &peer_attr(PEER)).error_code(),
            Some(443)
        );
        assert_eq!(
            call(&mut h, &mut c, CHANNEL_BIND, &channel_attrs(0x4002, PEER)).error_code(),
            Some(443)
        );
        let dropped = h.engine.stats().dropped[DropReason::NoPermission.index()];
        assert_eq!(
            h.send(client, &send_indication(PEER, b"x")),
            ClientAction::Drop(DropReason::NoPermission)
        );
        assert_eq!(
            h.engine.stats().dropped[DropReason::NoPermission.index()],
            dropped + 1
        );
    }
    // Not served without an IPv6 relay address: 440.
    let mut h = dual_harness(false);
    let mut c = Client::new(USER, PASS);
    let reply = c.call(&mut h, ALLOCATE, &udp_family(AddressFamily::IPV6));
    assert_eq!(reply.error_code(), Some(440));
    assert_eq!(h.engine.allocation_count(), 0);
}

#[test]
fn dual_allocation_has_an_ipv4_and_an_ipv6_relay_as_one_allocation() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    let (request, req) = relay_request(&mut h, &mut c, CLIENT, &udp_additional(2));
    let (v4, v6) = (request.relay, request.additional.expect("an IPv6 relay"));
    assert_eq!(
        (request.family, v4.family(), v6.family()),
        (Family::V4, Family::V4, Family::V6)
    );
    assert_eq!(v6, v4.with_family(Family::V6));
    let bound = BoundRelays {
        relay: Ok(50_002),
        additional: Some(Ok(50_003)),
    };
    let reply = complete(&mut h, v4, bound);
    assert_eq!(reply.class(), MessageClass::Success);
    // Two XOR-RELAYED-ADDRESS, IPv4 first; one allocation.
    assert_eq!(
        relayed(&reply),
        [
            "198.51.100.1:50002".parse::<SocketAddr>().unwrap(),
            "[::1]:50003".parse().unwrap()
        ]
    );
    assert_eq!(address_error(&reply), None);
    assert_eq!(h.engine.allocation_count(), 1);
    assert_eq!(h.engine.stats().allocations_created, 1);
    // A retransmission gets the same response.
    assert_eq!(h.request(CLIENT, &req).bytes, reply.bytes);
    // Each peer through the relay of its family, both ways.
    relays_both_ways(&mut h, &mut c, CLIENT, v4, PEER, 0x4001);
    relays_both_ways(&mut h, &mut c, CLIENT, v6, PEER6, 0x4002);
    // One lifetime: a Refresh (with either family) extends both, expiry ends both.
    let refresh = |seconds: u32, family: Option<AddressFamily>| {
        move |m: &mut MessageWriteVec, _: TransactionId| {
            m.add_attribute(&Lifetime::new(seconds)).unwrap();
            if let Some(family) = family {
                m.add_attribute(&RequestedAddressFamily::new(family))
                    .unwrap();
            }
        }
    };
    for family in [None, Some(AddressFamily::IPV4), Some(AddressFamily::IPV6)] {
        let reply = c.call(&mut h, REFRESH, &refresh(120, family));
        assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 120);
    }
    h.advance(119);
    assert_eq!(h.engine.allocation_count(), 1);
    let (_, bytes) = h.peer(v6, PEER6, b"six");
    assert_eq!(bytes, [0x40, 0x02, 0, 3, b's', b'i', b'x']);
    h.advance(2);
    assert_eq!(h.engine.allocation_count(), 0);
    let mut closed = [h.engine.poll_close(), h.engine.poll_close()];
    closed.sort_by_key(|r| r.map(|r| r.0));
    assert_eq!(closed, [Some(v4), Some(v6)]);
    assert_eq!(h.engine.poll_close(), None);
    assert_eq!(h.engine.stats().allocations_deleted, 1);
    // Deleted (Refresh 0) or its listener closed: both sockets close, once.
    for end in ["refresh", "listener"] {
        let mut c = Client::new(USER, PASS);
        let reply = c.call(&mut h, ALLOCATE, &udp_additional(2));
        assert_eq!(relayed(&reply).len(), 2);
        match end {
            "refresh" => {
                c.call(&mut h, REFRESH, &refresh(0, None));
            }
            _ => h.engine.close_listener(ListenerId(1)),
        }
        assert_eq!(h.engine.allocation_count(), 0);
        let closed: Vec<_> = std::iter::from_fn(|| h.engine.poll_close()).collect();
        assert_eq!(closed.len(), 2, "{end}: {closed:?}");
        assert_eq!(closed[0], closed[1].with_family(closed[0].family()));
        assert_ne!(closed[0].family(), closed[1].family());
    }
}

#[test]
fn dual_allocation_counts_once_against_the_quota() {
    let yaml = quota_config(1);
    let relay = RelayAddresses {
        v4: None,
        v6: Some(Ipv6Addr::LOCALHOST),
    };
    let mut h = Harness::on_host(&yaml, relay, |_| {});
    let mut alice = ephemeral_client("alice");
    let reply = alice.call(&mut h, ALLOCATE, &udp_additional(2));
    assert_eq!(relayed(&reply).len(), 2, "{:?}", reply.error_code());
    let mut again = ephemeral_client("alice");
    assert_eq!(
        again
            .call_from(&mut h, "192.0.2.10:1002", ALLOCATE, &udp)
            .error_code(),
        Some(486)
    );
    alice.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(0)).unwrap()
    });
    assert_eq!(
        again
            .call_from(&mut h, "192.0.2.10:1002", ALLOCATE, &udp)
            .class(),
        MessageClass::Success
    );
}

#[test]
fn dual_allocation_refusals_and_an_ipv6_relay_not_had() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    // With REQUESTED-ADDRESS-FAMILY (either family): 400.
    for family in [AddressFamily::IPV4, AddressFamily::IPV6] {
        let both = |m: &mut MessageWriteVec, t| {
            udp_additional(2)(m, t);
            m.add_attribute(&RequestedAddressFamily::new(family))
                .unwrap();
        };
        assert_eq!(c.call(&mut h, ALLOCATE, &both).error_code(), Some(400));
    }
    // Naming IPv4, or no family at all: 400.
    for value in [1, 0, 3] {
        assert_eq!(
            c.call(&mut h, ALLOCATE, &udp_additional(value))
                .error_code(),
            Some(400),
            "ADDITIONAL-ADDRESS-FAMILY {value}"
        );
    }
    assert_eq!(h.engine.allocation_count(), 0);
    // The IPv6 socket cannot be bound: IPv4 alone, ADDRESS-ERROR-CODE IPv6 508.
    h.additional_bind_error = Some(RelayBindError {
        kind: ErrorKind::AddrInUse,
    });
    let reply = c.call(&mut h, ALLOCATE, &udp_additional(2));
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(relayed(&reply), ["198.51.100.1:50002".parse().unwrap()]);
    assert_eq!(address_error(&reply), Some((2, 508)));
    // That allocation has no IPv6 relay: an IPv6 peer gets 443.
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER6))
            .error_code(),
        Some(443)
    );
    assert_eq!(
        c.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
            m.add_attribute(&RequestedAddressFamily::new(AddressFamily::IPV6))
                .unwrap()
        })
        .error_code(),
        Some(443)
    );
    // A listener that serves no IPv6: IPv4 alone, ADDRESS-ERROR-CODE IPv6 440; no IPv6
    // socket asked for.
    let mut h = dual_harness(false);
    let mut c = Client::new(USER, PASS);
    let (request, _) = relay_request(&mut h, &mut c, CLIENT, &udp_additional(2));
    assert_eq!(request.additional, None);
    let reply = complete(&mut h, request.relay, Ok(50_002));
    assert_eq!(relayed(&reply), ["198.51.100.1:50002".parse().unwrap()]);
    assert_eq!(address_error(&reply), Some((2, 440)));
    // The IPv4 socket cannot be bound: the whole Allocate fails (508) and holds nothing, the
    // IPv6 socket bound all the same included.
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    let (request, _) = relay_request(&mut h, &mut c, CLIENT, &udp_additional(2));
    let bound = BoundRelays {
        relay: Err(RelayBindError {
            kind: ErrorKind::AddrInUse,
        }),
        additional: Some(Ok(50_003)),
    };
    let reply = complete(&mut h, request.relay, bound);
    assert_eq!(reply.error_code(), Some(508));
    assert_eq!(h.engine.allocation_count(), 0);
    assert_eq!(h.engine.poll_close(), request.additional);
    assert_eq!(h.engine.poll_close(), None);
}

#[test]
fn refresh_lifetime_zero_with_a_family_deletes_that_relay_of_a_dual_allocation() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    let reply = c.call(&mut h, ALLOCATE, &udp_additional(2));
    assert_eq!(relayed(&reply).len(), 2);
    let (v4, v6) = (RelayId(0), RelayId(0).with_family(Family::V6));
    for (peer, channel) in [(PEER, 0x4001), (PEER6, 0x4002)] {
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(channel, peer));
    }
    let delete = |family: AddressFamily| {
        move |m: &mut MessageWriteVec, _: TransactionId| {
            m.add_attribute(&Lifetime::new(0)).unwrap();
            m.add_attribute(&RequestedAddressFamily::new(family))
                .unwrap();
        }
    };
    let reply = c.call(&mut h, REFRESH, &delete(AddressFamily::IPV6));
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(reply.msg().attribute::<Lifetime>().unwrap().seconds(), 0);
    // The IPv6 relay is closed, the allocation lives on with IPv4.
    assert_eq!(h.engine.allocation_count(), 1);
    assert_eq!(h.engine.poll_close(), Some(v6));
    assert_eq!(h.engine.poll_close(), None);
    // Its channel and permission went with it; IPv6 is refused from now on.
    let frame = [0x40, 0x02, 0, 1, b'x'];
    assert_eq!(
        h.send(CLIENT, &frame),
        ClientAction::Drop(DropReason::NoChannel)
    );
    assert_eq!(
        h.send(CLIENT, &send_indication(PEER6, b"x")),
        ClientAction::Drop(DropReason::NoPermission)
    );
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER6))
            .error_code(),
        Some(443)
    );
    assert_eq!(
        c.call(&mut h, REFRESH, &delete(AddressFamily::IPV6))
            .error_code(),
        Some(443)
    );
    // The IPv4 relay still works.
    let frame = [0x40, 0x01, 0, 1, b'y'];
    assert_eq!(relayed_to(h.send(CLIENT, &frame), &frame).0, v4);
    // Its slot is not handed out while the allocation lives.
    let mut other = Client::new(USER, PASS);
    let (request, _) = relay_request(&mut h, &mut other, "192.0.2.11:40000", &udp_additional(2));
    assert_ne!(request.relay, v4);
    assert_ne!(request.additional, Some(v6));
    complete(&mut h, request.relay, Ok(50_100));
    // LIFETIME 0 naming the last relay deletes the allocation.
    let reply = c.call(&mut h, REFRESH, &delete(AddressFamily::IPV4));
    assert_eq!(reply.class(), MessageClass::Success);
    assert_eq!(h.engine.allocation_count(), 1);
    assert_eq!(h.engine.poll_close(), Some(v4));
    assert_eq!(h.engine.poll_close(), None);
}

/// A relay id is reused only once every socket of its allocation was closed, whatever order
/// the closes come in and however the shell interleaves them with Allocates.
#[test]
fn a_dual_allocations_slot_is_reused_only_after_both_closes_are_taken() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    c.call(&mut h, ALLOCATE, &udp_additional(2));
    c.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(0)).unwrap()
    });
    // One close taken, one waiting: the next Allocate must not get slot 0.
    let first = h.engine.poll_close().unwrap();
    let (request, _) = relay_request(&mut h, &mut c, CLIENT, &udp_additional(2));
    assert_ne!(
        request.relay.with_family(Family::V4),
        first.with_family(Family::V4)
    );
    let second = h.engine.poll_close().unwrap();
    assert_eq!(second, first.with_family(second.family()));
    assert_eq!(h.engine.poll_close(), None);
}

#[test]
fn peer_admission_applies_to_ipv6_peers_as_to_ipv4_ones() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    c.call(&mut h, ALLOCATE, &udp_additional(2));
    let v6 = RelayId(0).with_family(Family::V6);
    // Outside every routed cluster: 403.
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr("[2001:db8::1]:5500"))
            .error_code(),
        Some(403)
    );
    assert_eq!(
        c.call(
            &mut h,
            CHANNEL_BIND,
            &channel_attrs(0x4001, "[2001:db8::1]:5500")
        )
        .error_code(),
        Some(403)
    );
    // The permission is per IP; the port range applies per datagram, both ways.
    assert_eq!(
        c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER6)).class(),
        MessageClass::Success
    );
    assert_eq!(
        h.send(CLIENT, &send_indication("[fd00::1]:7000", b"x")),
        ClientAction::Drop(DropReason::NotAdmitted)
    );
    assert_eq!(
        h.peer(v6, "[fd00::1]:7000", b"x").0,
        PeerAction::Drop(DropReason::NotAdmitted)
    );
    assert_eq!(
        h.peer(v6, "[fd00::2]:5500", b"x").0,
        PeerAction::Drop(DropReason::NoPermission)
    );
    assert!(matches!(
        h.peer(v6, PEER6, b"x").0,
        PeerAction::ToClient { .. }
    ));
    // A config that stops admitting the peer stops its datagrams.
    h.snap = Snapshot::from_config_on_host(
        &parse_config(&config(STATIC_AUTH).replace("\"fd00::/64\"", "\"fd00::9\"")).unwrap(),
        2,
        &|_| Vec::new(),
        &Host {
            ips: Vec::new(),
            relay: RelayAddresses {
                v4: None,
                v6: Some(Ipv6Addr::LOCALHOST),
            },
        },
    );
    assert_eq!(
        h.peer(v6, PEER6, b"x").0,
        PeerAction::Drop(DropReason::NotAdmitted)
    );
    assert_eq!(
        h.send(CLIENT, &send_indication(PEER6, b"x")),
        ClientAction::Drop(DropReason::NotAdmitted)
    );
}

/// coturn's clients (`turnutils_uclient -Z`) send ADDITIONAL-ADDRESS-FAMILY under the draft's
/// code 0x8032: a dual allocation all the same.
#[test]
fn additional_address_family_under_coturns_draft_code_makes_a_dual_allocation() {
    let mut h = dual_harness(true);
    let mut c = Client::new(USER, PASS);
    let draft = |family: u8| {
        move |m: &mut MessageWriteVec, t| {
            udp(m, t);
            m.add_attribute(&RawAttribute::new(
                AttributeType::new(0x8032),
                &[family, 0, 0, 0],
            ))
            .unwrap();
        }
    };
    assert_eq!(c.call(&mut h, ALLOCATE, &draft(1)).error_code(), Some(400));
    let reply = c.call(&mut h, ALLOCATE, &draft(2));
    assert_eq!(relayed(&reply).len(), 2, "{:?}", reply.error_code());
}

/// An expired channel number bound again to another peer is judged for that peer: the old
/// peer's admission verdict (and family) do not carry over.
#[test]
fn a_channel_number_rebound_to_another_peer_is_judged_afresh() {
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, _) = allocate(&mut h);
    let frame = [0x40, 0x01, 0, 1, b'x'];
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER))
            .class(),
        MessageClass::Success
    );
    assert!(matches!(h.send(CLIENT, &frame), ClientAction::Relay { .. }));
    c.call(&mut h, REFRESH, &|m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(1200)).unwrap()
    });
    // Expired, before the sweep removes it.
    h.now += Duration::from_secs(601);
    // Same IP (so the permission check passes), a port outside media's <5000-6000>.
    assert_eq!(
        c.call(
            &mut h,
            CHANNEL_BIND,
            &channel_attrs(0x4001, "10.1.2.3:7000")
        )
        .class(),
        MessageClass::Success
    );
    assert_eq!(
        h.send(CLIENT, &frame),
        ClientAction::Drop(DropReason::NotAdmitted)
    );
}

/// Second-chance forwarding, the engine's part: with misses forwarded, a datagram that needs
/// an allocation this shard does not hold is a `Miss` (nothing answered or counted) — a
/// request before authentication, since the nonce it carries is the owner's; an Allocate and a
/// Binding are served as always; arrived `AnsweredLocally`, today's answer. On the owner, a
/// forwarded datagram is handled as if it came straight, and what goes to the client then goes
/// back through the sibling it came through, until the client's flow comes straight again.
#[test]
fn misses_are_handed_to_the_shell_and_forwarded_datagrams_answer_through_their_sibling() {
    let elsewhere = "192.0.2.99:41000";
    let sibling: SocketAddr = "10.244.2.7:13479".parse().unwrap();
    let mut h = Harness::new(STATIC_AUTH);
    let (mut c, relay) = allocate(&mut h);
    assert_eq!(
        c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4000, PEER))
            .class(),
        MessageClass::Success
    );
    let channel_data = [0x40, 0x00, 0x00, 0x04, b'p', b'i', b'n', b'g'];
    h.engine.set_forward_misses(true);
    let dropped_before = h.engine.stats().dropped;
    // From a 5-tuple with no allocation here: misses, whatever the datagram.
    let mut stranger = Client::new(USER, PASS);
    // (An Allocate is served here, forwarding or not: it gives the stranger a nonce.)
    stranger.learn_nonce(&mut h, elsewhere);
    let refresh = stranger.build(REFRESH, TransactionId::generate(), &|_, _| {}, true);
    let permit = stranger.build(
        CREATE_PERMISSION,
        TransactionId::generate(),
        &peer_attr(PEER),
        false,
    );
    for data in [
        &channel_data[..],
        &send_indication(PEER, b"x"),
        &refresh,
        &permit,
    ] {
        assert_eq!(h.handle(elsewhere, data), ClientAction::Miss);
    }
    assert_eq!(
        h.engine.stats().dropped,
        dropped_before,
        "a miss was counted"
    );
    // An Allocate (a new call lands here) and a Binding are answered as always.
    let allocate = Client::new(USER, PASS).build(ALLOCATE, TransactionId::generate(), &udp, false);
    assert_eq!(h.request(elsewhere, &allocate).error_code(), Some(401));
    let binding = Message::builder_request(BINDING, MessageWriteVec::new()).finish();
    assert_eq!(
        h.request(elsewhere, &binding).class(),
        MessageClass::Success
    );
    // Today's answer for a miss no sibling owns: a counted drop, a 437 once authenticated.
    let local =
        |h: &mut Harness, data: &[u8]| h.handle_as(elsewhere, data, ArrivalKind::AnsweredLocally);
    assert_eq!(
        local(&mut h, &channel_data),
        ClientAction::Drop(DropReason::NoAllocation)
    );
    let answer = local(&mut h, &refresh);
    let ClientAction::Reply(n) = answer else {
        panic!("{answer:?}");
    };
    let reply = Reply {
        bytes: h.out[..n].to_vec(),
    };
    assert_eq!(reply.error_code(), Some(437));
    assert!(h
        .engine
        .has_allocation(ListenerId(1), CLIENT.parse().unwrap()));
    assert!(!h
        .engine
        .has_allocation(ListenerId(1), elsewhere.parse().unwrap()));

    // The owner: the client's ChannelData forwarded by a sibling is relayed to the peer...
    let forwarded = |h: &mut Harness, data: &[u8]| {
        h.handle_as(CLIENT, data, ArrivalKind::Forwarded { via: sibling })
    };
    assert!(matches!(
        forwarded(&mut h, &channel_data),
        ClientAction::Relay { .. }
    ));
    // ... and the peer's answer goes back through that sibling,
    // The first allocation's IPv4 relay.
    assert!(relay.is_ipv4());
    let relay_id = RelayId(0);
    let (action, _) = h.peer(relay_id, PEER, b"pong");
    assert!(
        matches!(
            action,
            PeerAction::ToClient {
                forwarded: true,
                ..
            }
        ) && h.engine.via(relay_id) == Some(sibling),
        "{action:?}"
    );
    // as does the answer to a forwarded request (the shell sends the reply through it).
    let refresh = c.build(REFRESH, TransactionId::generate(), &|_, _| {}, true);
    assert!(matches!(
        forwarded(&mut h, &refresh),
        ClientAction::Reply(_)
    ));
    // The client's flow comes straight again: so does the peer's answer.
    assert!(matches!(
        h.handle(CLIENT, &channel_data),
        ClientAction::Relay { .. }
    ));
    let (action, _) = h.peer(relay_id, PEER, b"pong");
    assert!(
        matches!(
            action,
            PeerAction::ToClient {
                forwarded: false,
                ..
            }
        ),
        "{action:?}"
    );
    // A request straight from the client moves it back too.
    assert!(matches!(
        forwarded(&mut h, &channel_data),
        ClientAction::Relay { .. }
    ));
    c.learn_nonce(&mut h, CLIENT);
    let refresh = c.build(REFRESH, TransactionId::generate(), &|_, _| {}, true);
    assert!(matches!(h.handle(CLIENT, &refresh), ClientAction::Reply(_)));
    let (action, _) = h.peer(relay_id, PEER, b"pong");
    assert!(matches!(
        action,
        PeerAction::ToClient {
            forwarded: false,
            ..
        }
    ));
}

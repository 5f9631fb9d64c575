//! Allocations across a restart, on a virtual clock: one engine's allocations exported as
//! records, written to a journal and read back, adopted by a fresh engine that then serves the
//! same client and peers as before.

use std::net::{Ipv6Addr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;
use stun_proto::types::attribute::{AttributeStaticType, RawAttribute};
use stun_proto::types::message::{MessageClass, MessageWriteExt, MessageWriteVec, TransactionId};
use turn_types::attribute::{
    AdditionalAddressFamily, DontFragment, Lifetime, RequestedAddressFamily,
};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH};
use turn_types::AddressFamily;
use uturn_dataplane::proto::persist::{
    decode, encode_entry, encode_header, replay, AdoptError, AllocationRecord, JournalEntry,
    JournalHeader, MonotonicEpoch, RelayPorts,
};
use uturn_dataplane::proto::{
    AllocationLedger, ClientAction, DropReason, Family, ListenerId, RelayId,
};
use uturn_shared::snapshot::RelayAddresses;
use uturn_testkit::engine::{
    channel_attrs, config, peer_attr, send_indication, udp, Client, Harness, CLIENT, PASS, PEER,
    STATIC_AUTH, USER,
};

/// `CLOCK_MONOTONIC` when the first process exports its allocations.
const EXPORTED_AT_NS: u64 = 100_000_000_000_000;
/// A second peer the default config's `media` cluster admits.
const OTHER_PEER: &str = "10.200.0.1:5500";

/// The first process: an Allocate from [`CLIENT`], a permission for [`PEER`] and channel
/// 0x4001 bound to it; the client, the Allocate request and the reply it got.
fn first_process() -> (Harness, Client, Vec<u8>, Vec<u8>) {
    let mut h = Harness::new(STATIC_AUTH);
    let mut c = Client::new(USER, PASS);
    c.learn_nonce(&mut h, CLIENT);
    let request = c.build(ALLOCATE, TransactionId::generate(), &udp, true);
    let reply = h.request(CLIENT, &request);
    assert_eq!(reply.class(), MessageClass::Success);
    let permission = c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    assert_eq!(permission.class(), MessageClass::Success);
    let bind = c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER));
    assert_eq!(bind.class(), MessageClass::Success);
    (h, c, request, reply.bytes)
}

/// The allocations of `h`'s engine through a journal, read `gap` seconds later: the live ones
/// and the monotonic clock then.
fn through_journal(h: &Harness, gap: u64) -> (Vec<AllocationRecord>, u64) {
    let epoch = MonotonicEpoch {
        instant: h.now,
        monotonic_ns: EXPORTED_AT_NS,
    };
    let mut journal = Vec::new();
    encode_header(&JournalHeader { boot_id: [7; 16] }, &mut journal);
    for record in h.engine.allocation_records(epoch) {
        encode_entry(&JournalEntry::Put(record), &mut journal).unwrap();
    }
    let decoded = decode(&journal).unwrap();
    assert_eq!((decoded.corrupt, decoded.torn), (0, 0));
    let now_ns = EXPORTED_AT_NS + gap * 1_000_000_000;
    (replay(decoded.entries, now_ns), now_ns)
}

/// A fresh engine on `yaml` whose monotonic clock reads `now_ns`, sharing `ledger`, and
/// what came of adopting each of `records` with every relay bound again on its port.
fn second_process(
    yaml: &str,
    ledger: &Arc<AllocationLedger>,
    records: Vec<AllocationRecord>,
    now_ns: u64,
) -> (Harness, Vec<Result<Vec<RelayId>, AdoptError>>) {
    let mut h = Harness::with(yaml, |c| c.ledger = ledger.clone());
    let epoch = MonotonicEpoch {
        instant: h.now,
        monotonic_ns: now_ns,
    };
    let snap = h.snap.clone();
    let adopted = records
        .into_iter()
        .map(|record| {
            let bound = record.relays;
            h.engine
                .adopt(record, ListenerId(1), bound, &snap, h.now, epoch)
        })
        .collect();
    (h, adopted)
}

/// ChannelData on `number` from [`CLIENT`]: where it was relayed, or why not.
fn channel_data(h: &mut Harness, number: u16) -> Result<(RelayId, SocketAddr), DropReason> {
    let frame = [(number >> 8) as u8, number as u8, 0, 3, b'a', b'b', b'c', 0];
    match h.send(CLIENT, &frame) {
        ClientAction::Relay { relay, peer, .. } => Ok((relay, peer)),
        ClientAction::Drop(reason) => Err(reason),
        other => panic!("{other:?}"),
    }
}

#[test]
fn an_adopted_allocation_serves_its_client_and_peers_as_before() {
    let (h1, mut c, allocate, allocate_reply) = first_process();
    let epoch = MonotonicEpoch {
        instant: h1.now,
        monotonic_ns: EXPORTED_AT_NS,
    };
    let exported = h1.engine.allocation_records(epoch);
    assert_eq!(exported.len(), 1);
    let record = &exported[0];
    assert_eq!(record.relays, RelayPorts::default().with(Family::V4, 50002));
    assert_eq!(
        (record.username.as_str(), record.user_id.as_str()),
        (USER, USER)
    );
    assert_eq!(record.expires_at_ns, EXPORTED_AT_NS + 600_000_000_000);
    assert_eq!(record.permissions.len(), 1);
    assert_eq!(record.channels.len(), 1);

    let peer: SocketAddr = PEER.parse().unwrap();
    let ledger = Arc::new(AllocationLedger::new());
    let (records, now_ns) = through_journal(&h1, 5);
    let (mut h2, adopted) = second_process(&config(STATIC_AUTH), &ledger, records, now_ns);
    assert_eq!(adopted, [Ok(vec![RelayId(0)])]);
    assert_eq!((h2.engine.allocation_count(), ledger.held_by(USER)), (1, 1));
    // The deadlines go on from where they were, 5 s of restart later.
    let relay = RelayId(0);
    assert_eq!(
        h2.engine.offload_deadline(relay),
        Some(h2.now + Duration::from_secs(595))
    );
    let permission = h2.engine.offload_permission(relay, peer.ip(), h2.now);
    assert_eq!(
        permission.map(|p| p.expires_at),
        Some(h2.now + Duration::from_secs(295))
    );

    // The media flows on, both ways, on the same channel and relay.
    assert_eq!(channel_data(&mut h2, 0x4001), Ok((relay, peer)));
    let (_, bytes) = h2.peer(relay, PEER, b"pong");
    assert_eq!(bytes, [0x40, 0x01, 0x00, 0x04, b'p', b'o', b'n', b'g']);
    // A retransmitted Allocate gets the success the first process sent.
    assert_eq!(h2.request(CLIENT, &allocate).bytes, allocate_reply);
    // The client goes on with its credentials (and this process's nonce).
    c.learn_nonce(&mut h2, CLIENT);
    let refresh = c.call(&mut h2, REFRESH, &udp);
    assert_eq!(refresh.class(), MessageClass::Success);
    let permission = c.call(&mut h2, CREATE_PERMISSION, &peer_attr(OTHER_PEER));
    assert_eq!(permission.class(), MessageClass::Success);
    let bind = c.call(&mut h2, CHANNEL_BIND, &channel_attrs(0x4001, PEER));
    assert_eq!(bind.class(), MessageClass::Success);
    // And it ends when its time is up, as any allocation.
    h2.advance(601);
    assert_eq!(h2.engine.allocation_count(), 0);
    assert_eq!(h2.engine.poll_close(), Some(relay));
    assert_eq!(ledger.held_by(USER), 0);
}

#[test]
fn an_expired_allocation_is_not_adopted() {
    let (h1, ..) = first_process();
    // Read back after its deadline, the journal leaves nothing live.
    let (records, _) = through_journal(&h1, 601);
    assert!(records.is_empty());
    // Handed over all the same, exactly at its deadline: refused, nothing held.
    let (records, now_ns) = through_journal(&h1, 0);
    let ledger = Arc::new(AllocationLedger::new());
    let at_deadline = now_ns + 600_000_000_000;
    let (h2, adopted) = second_process(&config(STATIC_AUTH), &ledger, records, at_deadline);
    assert_eq!(adopted, [Err(AdoptError::Expired)]);
    assert_eq!((h2.engine.allocation_count(), ledger.total()), (0, 0));
}

#[test]
fn a_peer_the_new_snapshot_refuses_loses_its_permission_and_channel_not_the_allocation() {
    let (mut h1, mut c, ..) = first_process();
    let bind = c.call(&mut h1, CHANNEL_BIND, &channel_attrs(0x4002, OTHER_PEER));
    assert_eq!(bind.class(), MessageClass::Success);
    let (records, now_ns) = through_journal(&h1, 1);
    assert_eq!(records[0].channels.len(), 2);
    // The new config routes the listener to 10.200.0.0/16 alone: PEER is out.
    let narrowed = config(STATIC_AUTH).replace("10.0.0.0/8:<5000-6000>", "10.200.0.0/16");
    let ledger = Arc::new(AllocationLedger::new());
    let (mut h2, adopted) = second_process(&narrowed, &ledger, records, now_ns);
    assert_eq!(adopted, [Ok(vec![RelayId(0)])]);
    assert_eq!(
        channel_data(&mut h2, 0x4001),
        Err(DropReason::NoChannel),
        "the refused peer's channel is gone"
    );
    assert_eq!(
        channel_data(&mut h2, 0x4002),
        Ok((RelayId(0), OTHER_PEER.parse().unwrap()))
    );
    assert_eq!(
        h2.send(CLIENT, &send_indication(PEER, b"x")),
        ClientAction::Drop(DropReason::NoPermission),
        "the refused peer's permission is gone"
    );
    c.learn_nonce(&mut h2, CLIENT);
    assert_eq!(
        c.call(&mut h2, REFRESH, &udp).class(),
        MessageClass::Success
    );
}

#[test]
fn a_record_whose_listener_relay_or_client_is_taken_is_refused_and_holds_nothing() {
    let (h1, ..) = first_process();
    let (records, now_ns) = through_journal(&h1, 1);
    let yaml = config(STATIC_AUTH);
    let renamed = yaml.replace("- name: udp", "- name: udp-2");
    let tcp = yaml.replace("TURN-UDP", "TURN-TCP");
    for (yaml, refusal) in [
        (&renamed, AdoptError::ListenerGone),
        (&tcp, AdoptError::ConnectionEnded),
    ] {
        let ledger = Arc::new(AllocationLedger::new());
        let (h2, adopted) = second_process(yaml, &ledger, records.clone(), now_ns);
        assert_eq!(adopted, [Err(refusal)], "{}", refusal.name());
        assert_eq!((h2.engine.allocation_count(), ledger.total()), (0, 0));
    }
    // A relay bound again on another port is not the relay the client knows.
    let ledger = Arc::new(AllocationLedger::new());
    let (mut h2, _) = second_process(&yaml, &ledger, Vec::new(), now_ns);
    let epoch = MonotonicEpoch {
        instant: h2.now,
        monotonic_ns: now_ns,
    };
    let snap = h2.snap.clone();
    let moved = RelayPorts::default().with(Family::V4, 50004);
    let adopt = |h2: &mut Harness, bound| {
        h2.engine.adopt(
            records[0].clone(),
            ListenerId(1),
            bound,
            &snap,
            h2.now,
            epoch,
        )
    };
    assert_eq!(adopt(&mut h2, moved), Err(AdoptError::NoRelay));
    assert_eq!(adopt(&mut h2, records[0].relays), Ok(vec![RelayId(0)]));
    // Adopted twice (a journal replayed twice): the second is refused.
    assert_eq!(adopt(&mut h2, records[0].relays), Err(AdoptError::Exists));
    assert_eq!((h2.engine.allocation_count(), ledger.total()), (1, 1));
}

#[test]
fn deadlines_read_on_a_clock_that_went_back_end_no_later_than_a_request_could_make_them() {
    let (h1, ..) = first_process();
    let (records, now_ns) = through_journal(&h1, 0);
    // A wrong reading (another boot's clock, say): every deadline looks hours away.
    let behind = now_ns - 10_000_000_000_000;
    let ledger = Arc::new(AllocationLedger::new());
    let (h2, adopted) = second_process(&config(STATIC_AUTH), &ledger, records, behind);
    assert_eq!(adopted, [Ok(vec![RelayId(0)])]);
    let hour = Duration::from_secs(3600);
    assert_eq!(h2.engine.offload_deadline(RelayId(0)), Some(h2.now + hour));
    let peer: SocketAddr = PEER.parse().unwrap();
    let permission = h2.engine.offload_permission(RelayId(0), peer.ip(), h2.now);
    assert_eq!(
        permission.map(|p| p.expires_at),
        Some(h2.now + Duration::from_secs(300))
    );
}

#[test]
fn a_dual_allocation_keeps_the_relays_it_still_has() {
    let yaml = config(STATIC_AUTH).replace("\"fd00::/64\"", "\"fd00::/64:<5000-6000>\"");
    let relay = RelayAddresses {
        v4: None,
        v6: Some(Ipv6Addr::LOCALHOST),
    };
    let mut h1 = Harness::on_host(&yaml, relay, |_| {});
    let mut c = Client::new(USER, PASS);
    let dual = |m: &mut MessageWriteVec, t| {
        udp(m, t);
        let ipv6 = RawAttribute::new(AdditionalAddressFamily::TYPE, &[0x02, 0, 0, 0]);
        m.add_attribute(&ipv6).unwrap();
        m.add_attribute(&DontFragment::new()).unwrap();
    };
    assert_eq!(
        c.call(&mut h1, ALLOCATE, &dual).class(),
        MessageClass::Success
    );
    let both = RelayPorts::default()
        .with(Family::V4, 50002)
        .with(Family::V6, 50003);
    let (records, _) = through_journal(&h1, 0);
    assert_eq!((records[0].relays, records[0].dont_fragment), (both, true));
    // RFC 8656 §7.3: LIFETIME 0 for IPv6 deletes that relay; the success still names it.
    let delete_v6 = |m: &mut MessageWriteVec, _| {
        m.add_attribute(&Lifetime::new(0)).unwrap();
        let family = RequestedAddressFamily::new(AddressFamily::IPV6);
        m.add_attribute(&family).unwrap();
    };
    assert_eq!(
        c.call(&mut h1, REFRESH, &delete_v6).class(),
        MessageClass::Success
    );
    let (records, now_ns) = through_journal(&h1, 0);
    assert_eq!(
        records[0].relays,
        RelayPorts::default().with(Family::V4, 50002)
    );
    let ledger = Arc::new(AllocationLedger::new());
    let (_, adopted) = second_process(&yaml, &ledger, records, now_ns);
    assert_eq!(adopted, [Ok(vec![RelayId(0)])]);
}

/// What `h`'s engine reports changed since the last call, on a fixed epoch.
fn drained(h: &mut Harness) -> Vec<JournalEntry> {
    let epoch = MonotonicEpoch {
        instant: h.now,
        monotonic_ns: EXPORTED_AT_NS,
    };
    std::iter::from_fn(|| h.engine.poll_persist(epoch)).collect()
}

/// The kinds of `entries`: `P<permissions><channels>` for a Put, `D` for a Delete.
fn kinds(entries: &[JournalEntry]) -> Vec<String> {
    entries
        .iter()
        .map(|entry| match entry {
            JournalEntry::Put(r) => format!("P{}{}", r.permissions.len(), r.channels.len()),
            JournalEntry::Delete { .. } => "D".into(),
        })
        .collect()
}

#[test]
fn the_journal_hears_of_every_request_that_changed_an_allocation_and_of_no_packet() {
    let mut h = Harness::new(STATIC_AUTH);
    h.engine.enable_persist();
    let mut c = Client::new(USER, PASS);
    c.learn_nonce(&mut h, CLIENT);
    // A 401 changes nothing.
    assert!(drained(&mut h).is_empty());
    let request = c.build(ALLOCATE, TransactionId::generate(), &udp, true);
    assert_eq!(h.request(CLIENT, &request).class(), MessageClass::Success);
    let mut journal = drained(&mut h);
    assert_eq!(kinds(&journal), ["P00"]);
    c.call(&mut h, CREATE_PERMISSION, &peer_attr(PEER));
    let changes = drained(&mut h);
    assert_eq!(kinds(&changes), ["P10"]);
    journal.extend(changes);
    // Two changes before the shell asks: one Put, of the allocation as it is now.
    c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, PEER));
    c.call(&mut h, CREATE_PERMISSION, &peer_attr(OTHER_PEER));
    let changes = drained(&mut h);
    assert_eq!(kinds(&changes), ["P21"]);
    journal.extend(changes);
    // Media, both ways, and a refused request: nothing to record.
    assert!(channel_data(&mut h, 0x4001).is_ok());
    h.peer(RelayId(0), PEER, b"back");
    let refused = c.call(&mut h, CHANNEL_BIND, &channel_attrs(0x4001, OTHER_PEER));
    assert_eq!(refused.class(), MessageClass::Error);
    assert!(drained(&mut h).is_empty());
    // A Refresh moves the deadline; the journal read back is what the engine holds.
    h.advance(60);
    let refresh = |m: &mut MessageWriteVec, _| m.add_attribute(&Lifetime::new(300)).unwrap();
    c.call(&mut h, REFRESH, &refresh);
    journal.extend(drained(&mut h));
    let JournalEntry::Put(last) = journal.last().unwrap() else {
        panic!("{journal:?}")
    };
    let epoch = MonotonicEpoch {
        instant: h.now,
        monotonic_ns: EXPORTED_AT_NS,
    };
    assert_eq!(last.expires_at_ns, EXPORTED_AT_NS + 300_000_000_000);
    assert_eq!(
        replay(journal.clone(), 0),
        h.engine.allocation_records(epoch)
    );
    // Deleted by the client: a Delete, and the journal replays to nothing.
    let delete = |m: &mut MessageWriteVec, _| m.add_attribute(&Lifetime::new(0)).unwrap();
    c.call(&mut h, REFRESH, &delete);
    let changes = drained(&mut h);
    assert_eq!(kinds(&changes), ["D"]);
    journal.extend(changes);
    assert!(replay(journal, 0).is_empty());
    // Expired: a Delete too.
    let mut c = Client::new(USER, PASS);
    c.learn_nonce(&mut h, CLIENT);
    let request = c.build(ALLOCATE, TransactionId::generate(), &udp, true);
    assert_eq!(h.request(CLIENT, &request).class(), MessageClass::Success);
    assert_eq!(kinds(&drained(&mut h)), ["P00"]);
    h.advance(601);
    assert_eq!(kinds(&drained(&mut h)), ["D"]);
}

#[test]
fn an_engine_without_a_journal_keeps_no_changes() {
    let (mut h, _, _, _) = first_process();
    assert!(drained(&mut h).is_empty());
}

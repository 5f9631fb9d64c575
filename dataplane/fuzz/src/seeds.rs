//! The committed seed corpus, as code: `examples/gen_corpus.rs` writes these to
//! `corpus/<target>/<name>` and replays each through its target's checks.

use crate::engine::{
    op, AuthRequest, PASS, PEERS, REALM, SETUP_ALLOCATE_TXID, SETUP_CHANNEL, SETUP_PEER, USER,
};
use crate::input::Output;
use std::net::SocketAddr;
use stun_proto::types::attribute::{AttributeType, RawAttribute, Username};
use stun_proto::types::message::{
    Message, MessageClass, MessageType, MessageWrite, MessageWriteExt, MessageWriteVec, Method,
    TransactionId, BINDING,
};
use turn_types::attribute::{ChannelNumber, Data, Lifetime, RequestedTransport, XorPeerAddress};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, DATA, REFRESH, SEND};
use uturn_testkit::engine::sign;

/// One seed: target, file name, bytes.
pub struct Seed {
    /// Fuzz target.
    pub target: &'static str,
    /// File name in `corpus/<target>/`.
    pub name: String,
    /// Contents.
    pub bytes: Vec<u8>,
}

const TXID: u128 = 0x0102_0304_0506_0708_090a_0b0c;

fn msg(
    class: MessageClass,
    method: Method,
    attrs: &[&dyn stun_proto::types::attribute::AttributeWrite],
) -> MessageWriteVec {
    let mut m = Message::builder(
        MessageType::from_class_method(class, method),
        TransactionId::from(TXID),
        MessageWriteVec::new(),
    );
    for a in attrs {
        m.add_attribute(*a).unwrap();
    }
    m
}

fn request(method: Method, attrs: &[&dyn stun_proto::types::attribute::AttributeWrite]) -> Vec<u8> {
    msg(MessageClass::Request, method, attrs).finish()
}

fn xor_peer(i: usize) -> XorPeerAddress {
    XorPeerAddress::new(PEERS[i].parse().unwrap(), TransactionId::from(TXID))
}

/// A request signed as the user would, with a made-up (stale) nonce.
fn signed_with_bad_nonce(
    method: Method,
    attrs: &[&dyn stun_proto::types::attribute::AttributeWrite],
) -> Vec<u8> {
    let mut m = msg(MessageClass::Request, method, attrs);
    sign(
        &mut m,
        USER,
        PASS,
        REALM,
        "00000001ffffffffffffffffffffffff",
    );
    m.finish()
}

/// Raw attribute TLVs, as the session target's AUTH operation takes them.
fn tlvs(attrs: &[(u16, &[u8])]) -> Vec<u8> {
    let mut out = Output::new();
    for (t, v) in attrs {
        out.u16(*t).len_prefixed(v);
    }
    out.bytes
}

fn unauth(flags: u8, from: &str, datagram: &[u8]) -> Vec<u8> {
    let addr: SocketAddr = from.parse().unwrap();
    let mut ip = [0u8; 16];
    match addr.ip() {
        std::net::IpAddr::V4(a) => ip[..4].copy_from_slice(&a.octets()),
        std::net::IpAddr::V6(a) => ip.copy_from_slice(&a.octets()),
    }
    let v6 = u8::from(addr.is_ipv6());
    let mut out = Output::new();
    out.u8(flags | v6).raw(&ip).u16(addr.port()).raw(datagram);
    out.bytes
}

fn engine_unauth() -> Vec<(String, Vec<u8>)> {
    let v4 = "192.0.2.10:40000";
    let v6 = "[2001:db8::10]:40000";
    let udp = RequestedTransport::new(17);
    let binding = request(BINDING, &[]);
    let mut fp = msg(MessageClass::Request, BINDING, &[]);
    fp.add_fingerprint().unwrap();
    let binding_fp = fp.finish();
    let mut send = msg(
        MessageClass::Indication,
        SEND,
        &[&xor_peer(0), &Data::new(b"hello")],
    );
    send.add_fingerprint().unwrap();
    let send = send.finish();
    let unknown = RawAttribute::new(AttributeType::new(0x7777), &[0, 0, 0, 0]);
    let ephemeral_user = Username::new("1800003600:alice").unwrap();
    // 1000 unknown comprehension-required attributes cycling through 40 types (and one
    // comprehension-optional type, not listed), over TURN-TCP: the 420 lists 0x7700..=0x771f,
    // once each. Regression: a 420 listing every one needed 2048+ bytes, more than the
    // shell's reply buffer, and the request was dropped as Drop(Internal).
    let mut many_unknown = msg(
        MessageClass::Request,
        ALLOCATE,
        &[&RequestedTransport::new(17)],
    );
    for i in 0..1000u16 {
        let t = if i % 100 == 99 {
            0x8888
        } else {
            0x7700 + i % 40
        };
        many_unknown
            .add_attribute(&RawAttribute::new(AttributeType::new(t), &[]))
            .unwrap();
    }
    let many_unknown = many_unknown.finish();
    let channel = ChannelNumber::new(SETUP_CHANNEL);
    vec![
        ("binding_v4".into(), unauth(0, v4, &binding)),
        ("binding_v6".into(), unauth(0, v6, &binding)),
        ("binding_fingerprint".into(), unauth(0, v6, &binding_fp)),
        (
            "binding_indication".into(),
            unauth(0, v4, &msg(MessageClass::Indication, BINDING, &[]).finish()),
        ),
        (
            "binding_success".into(),
            unauth(0, v4, &msg(MessageClass::Success, BINDING, &[]).finish()),
        ),
        (
            "allocate_401".into(),
            unauth(0, v4, &request(ALLOCATE, &[&udp])),
        ),
        (
            "allocate_438".into(),
            unauth(0, v4, &signed_with_bad_nonce(ALLOCATE, &[&udp])),
        ),
        (
            "allocate_ephemeral".into(),
            unauth(2, v4, &request(ALLOCATE, &[&udp, &ephemeral_user])),
        ),
        (
            "allocate_420".into(),
            unauth(0, v4, &request(ALLOCATE, &[&udp, &unknown])),
        ),
        (
            "refresh_401".into(),
            unauth(0, v6, &request(REFRESH, &[&Lifetime::new(0)])),
        ),
        (
            "create_permission_401".into(),
            unauth(0, v4, &request(CREATE_PERMISSION, &[&xor_peer(0)])),
        ),
        (
            "channel_bind_438".into(),
            unauth(
                0,
                v4,
                &signed_with_bad_nonce(CHANNEL_BIND, &[&channel, &xor_peer(0)]),
            ),
        ),
        ("send_indication".into(), unauth(0, v4, &send)),
        (
            "data_indication".into(),
            unauth(
                0,
                v4,
                &msg(MessageClass::Indication, DATA, &[&Data::new(b"x")]).finish(),
            ),
        ),
        (
            "connect_400".into(),
            unauth(0, v4, &request(Method::new(0x000a), &[])),
        ),
        (
            "channel_data".into(),
            unauth(4, v4, &[0x40, 0x01, 0x00, 0x03, b'a', b'b', b'c', 0]),
        ),
        (
            "channel_data_short".into(),
            unauth(0, v4, &[0x40, 0x01, 0x00]),
        ),
        ("not_turn".into(), unauth(0, v4, &[0x80, 0, 0, 0])),
        ("tcp_binding".into(), unauth(0x20, v4, &binding)),
        (
            "tcp_allocate_420".into(),
            unauth(
                0x20,
                v4,
                &request(ALLOCATE, &[&udp, &unknown, &unknown, &unknown, &unknown]),
            ),
        ),
        (
            "tcp_420_many_unknown".into(),
            unauth(0x20, v4, &many_unknown),
        ),
    ]
}

struct Session {
    out: Output,
}

impl Session {
    fn new(settings: u8) -> Self {
        let mut out = Output::new();
        out.u8(settings);
        Session { out }
    }

    fn client(&mut self, client: u8, datagram: &[u8]) -> &mut Self {
        self.out.u8(op::CLIENT).u8(client).len_prefixed(datagram);
        self
    }

    fn peer(&mut self, relay: u8, peer: u8, payload: &[u8]) -> &mut Self {
        self.out
            .u8(op::PEER)
            .u8(relay)
            .u8(peer)
            .len_prefixed(payload);
        self
    }

    fn advance(&mut self, secs: u16) -> &mut Self {
        self.out.u8(op::ADVANCE).u16(secs);
        self
    }

    fn reconfigure(&mut self) -> &mut Self {
        self.out.u8(op::RECONFIGURE);
        self
    }

    fn send(&mut self, client: u8, peer: u8, txid: u128, data: &[u8]) -> &mut Self {
        self.out
            .u8(op::SEND)
            .u8(client)
            .u8(peer)
            .raw(&txid.to_be_bytes()[4..])
            .len_prefixed(data);
        self
    }

    /// `method`: index into `engine::METHODS`.
    #[allow(clippy::too_many_arguments)]
    fn auth(
        &mut self,
        client: u8,
        method: u8,
        txid: u128,
        flags: u8,
        peer_mask: u16,
        attrs: &[(u16, &[u8])],
    ) -> &mut Self {
        self.out
            .u8(op::AUTH)
            .u8(client)
            .u8(method)
            .u8(0)
            .raw(&txid.to_be_bytes()[4..])
            .u8(flags)
            .u16(peer_mask)
            .len_prefixed(&tlvs(attrs));
        self
    }

    fn done(&mut self) -> Vec<u8> {
        std::mem::take(&mut self.out.bytes)
    }
}

// Indexes into engine::METHODS.
const M_ALLOCATE: u8 = 0;
const M_REFRESH: u8 = 1;
const M_PERMISSION: u8 = 2;
const M_BIND: u8 = 3;
const M_BINDING: u8 = 5;

const UDP: (u16, &[u8]) = (0x0019, &[17, 0, 0, 0]);

fn bit(peer: usize) -> u16 {
    1 << peer
}

fn engine_session() -> Vec<(String, Vec<u8>)> {
    let p = SETUP_PEER as u8;
    let lifetime = |s: u32| s.to_be_bytes();
    let (l0, l120, l30, l3599) = (lifetime(0), lifetime(120), lifetime(30), lifetime(3599));
    let cd = |n: u16, payload: &[u8]| {
        let mut f = n.to_be_bytes().to_vec();
        f.extend_from_slice(&(payload.len() as u16).to_be_bytes());
        f.extend_from_slice(payload);
        f.resize(f.len().next_multiple_of(4), 0);
        f
    };
    let mut seeds: Vec<(String, Vec<u8>)> = Vec::new();
    let mut add = |name: &str, bytes: Vec<u8>| seeds.push((name.into(), bytes));

    add("setup_only", Session::new(0).done());
    add(
        "channel_data_both_ways",
        Session::new(0)
            .client(0, &cd(SETUP_CHANNEL, b"hello"))
            .peer(0, p, b"world")
            .client(0, &cd(0x4002, b"unbound"))
            .client(1, &cd(SETUP_CHANNEL, b"no allocation"))
            .done(),
    );
    add(
        "send_and_data_indication",
        Session::new(0)
            .send(0, p, 1, b"to the permitted peer")
            .send(0, 1, 2, b"port outside the range")
            .send(0, 2, 3, b"no permission")
            .send(0, 3, 4, b"mapped form")
            .peer(0, 2, b"from a peer without permission")
            .done(),
    );
    add(
        "permission_then_data",
        Session::new(0)
            .auth(0, M_PERMISSION, 10, 0, bit(2) | bit(7), &[])
            .send(0, 2, 11, b"now permitted")
            .peer(0, 2, b"data indication back")
            .peer(0, 7, b"loopback listed exactly")
            .auth(0, M_PERMISSION, 12, 0, bit(6), &[])
            .auth(0, M_PERMISSION, 13, 0, bit(8) | bit(9) | bit(13), &[])
            .auth(0, M_PERMISSION, 14, 0, 0, &[])
            .auth(0, M_PERMISSION, 15, 0, bit(5), &[])
            .done(),
    );
    add(
        "refresh_delete_reallocate",
        Session::new(0)
            .auth(0, M_REFRESH, 20, 0, 0, &[(0x000D, &l120)])
            .auth(0, M_REFRESH, 21, 0, 0, &[(0x0017, &[2, 0, 0, 0])])
            .auth(0, M_REFRESH, 22, 0, 0, &[(0x000D, &l0)])
            .client(0, &cd(SETUP_CHANNEL, b"gone"))
            .auth(0, M_REFRESH, 23, 0, 0, &[(0x000D, &l30)])
            .auth(0, M_ALLOCATE, 24, 0, 0, &[UDP, (0x000D, &l30)])
            .advance(31)
            .done(),
    );
    add(
        "allocate_retransmit",
        Session::new(0)
            .auth(0, M_ALLOCATE, SETUP_ALLOCATE_TXID, 0, 0, &[UDP])
            .auth(0, M_ALLOCATE, 30, 0, 0, &[UDP])
            .done(),
    );
    add(
        "allocate_errors",
        Session::new(0)
            .auth(1, M_ALLOCATE, 40, 0, 0, &[])
            .auth(1, M_ALLOCATE, 41, 0, 0, &[(0x0019, &[6, 0, 0, 0])])
            .auth(1, M_ALLOCATE, 42, 0, 0, &[UDP, (0x0017, &[2, 0, 0, 0])])
            .auth(1, M_ALLOCATE, 43, 0, 0, &[UDP, (0x0018, &[0x80])])
            .auth(1, M_ALLOCATE, 44, 0, 0, &[UDP, (0x0022, &[1; 8])])
            .auth(1, M_ALLOCATE, 45, 0, 0, &[UDP, (0x7777, &[0; 4])])
            .auth(1, M_ALLOCATE, 46, AuthRequest::BIND_FAILS, 0, &[UDP])
            .auth(
                1,
                M_ALLOCATE,
                47,
                0,
                0,
                &[UDP, (0x0018, &[0]), (0x001A, &[])],
            )
            .done(),
    );
    add(
        "broken_credentials",
        Session::new(0)
            .auth(1, M_ALLOCATE, 50, AuthRequest::WRONG_KEY, 0, &[UDP])
            .auth(1, M_ALLOCATE, 51, AuthRequest::NO_NONCE, 0, &[UDP])
            .auth(1, M_ALLOCATE, 52, AuthRequest::NO_USERNAME, 0, &[UDP])
            .auth(1, M_ALLOCATE, 53, AuthRequest::SHA256, 0, &[UDP])
            .auth(1, M_ALLOCATE, 54, AuthRequest::NO_INTEGRITY, 0, &[UDP])
            .auth(1, M_ALLOCATE, 55, AuthRequest::FINGERPRINT, 0, &[UDP])
            .auth(1, M_BINDING, 56, AuthRequest::FINGERPRINT, 0, &[])
            .done(),
    );
    add(
        "ipv6_listener",
        Session::new(0)
            .auth(2, M_ALLOCATE, 60, 0, 0, &[UDP])
            .auth(2, M_PERMISSION, 61, 0, bit(4) | bit(5) | bit(11), &[])
            .auth(2, M_PERMISSION, 62, 0, bit(14) | bit(12), &[])
            .send(2, 4, 63, b"via NAT64")
            .send(2, 11, 64, b"world v6")
            .peer(3, 5, b"from fd00::5")
            .auth(3, M_ALLOCATE, 65, 0, 0, &[UDP, (0x0017, &[2, 0, 0, 0])])
            .auth(2, M_BIND, 66, 0, bit(5), &[(0x000C, &[0x40, 0x10, 0, 0])])
            .peer(3, 5, b"framed in place")
            .done(),
    );
    // Relay socket ids: slot * 2 for IPv4, slot * 2 + 1 for IPv6; client 1's allocation has
    // slot 1 (the setup's has 0).
    let v6 = (0x0017, &[2u8, 0, 0, 0][..]);
    let additional = |family: u8| (0x8000, [family, 0, 0, 0]);
    let (add6, add4) = (additional(2), additional(1));
    let (add6, add4) = ((add6.0, &add6.1[..]), (add4.0, &add4.1[..]));
    add(
        "dual_allocation",
        Session::new(0)
            .auth(1, M_ALLOCATE, 130, 0, 0, &[UDP, add6])
            .auth(1, M_PERMISSION, 131, 0, bit(2) | bit(5), &[])
            .send(1, 2, 132, b"to the IPv4 peer")
            .send(1, 5, 133, b"to the IPv6 peer")
            .peer(2, 2, b"back from IPv4")
            .peer(3, 5, b"back from IPv6")
            .auth(1, M_BIND, 134, 0, bit(5), &[(0x000C, &[0x40, 0x05, 0, 0])])
            .peer(3, 5, b"framed in place")
            .auth(1, M_ALLOCATE, 130, 0, 0, &[UDP, add6])
            .auth(1, M_REFRESH, 135, 0, 0, &[(0x000D, &l120), v6])
            .auth(1, M_REFRESH, 136, 0, 0, &[(0x000D, &l0), v6])
            .send(1, 5, 137, b"IPv6 relay deleted")
            .peer(3, 5, b"IPv6 relay deleted")
            .peer(2, 2, b"IPv4 lives on")
            .auth(1, M_PERMISSION, 138, 0, bit(5), &[])
            .auth(
                1,
                M_REFRESH,
                139,
                0,
                0,
                &[(0x000D, &l0), (0x0017, &[1, 0, 0, 0])],
            )
            .done(),
    );
    // coturn's clients (`turnutils_uclient -Z`) send ADDITIONAL-ADDRESS-FAMILY under the draft
    // code 0x8032, which the engine reads too.
    let draft6 = (0x8032, &[2u8, 0, 0, 0][..]);
    add(
        "dual_allocation_draft_code",
        Session::new(0)
            .auth(1, M_ALLOCATE, 150, 0, 0, &[UDP, draft6])
            .auth(1, M_PERMISSION, 151, 0, bit(5), &[])
            .send(1, 5, 152, b"to the IPv6 peer")
            .peer(3, 5, b"back from IPv6")
            .done(),
    );
    add(
        "dual_allocate_errors",
        Session::new(0)
            .auth(1, M_ALLOCATE, 140, 0, 0, &[UDP, add4])
            .auth(1, M_ALLOCATE, 141, 0, 0, &[UDP, add6, v6])
            .auth(2, M_ALLOCATE, 142, 0, 0, &[UDP, add6])
            .auth(1, M_ALLOCATE, 143, AuthRequest::BIND_FAILS, 0, &[UDP, add6])
            .auth(1, M_ALLOCATE, 144, 0, 0, &[UDP, add6, (0x0018, &[0])])
            .auth(3, M_ALLOCATE, 145, 0, 0, &[UDP, v6])
            .advance(700)
            .done(),
    );
    add(
        "expiry",
        Session::new(0)
            .advance(301)
            .peer(0, p, b"channel outlives the permission")
            .send(0, p, 70, b"permission expired")
            .advance(300)
            .client(0, &cd(SETUP_CHANNEL, b"after expiry"))
            .done(),
    );
    add(
        "stale_nonce",
        Session::new(0)
            .auth(0, M_REFRESH, 80, 0, 0, &[(0x000D, &l3599)])
            .advance(3000)
            .auth(0, M_REFRESH, 81, 0, 0, &[(0x000D, &l3599)])
            .advance(700)
            .auth(0, M_REFRESH, 82, 0, 0, &[(0x000D, &l120)])
            .auth(0, M_REFRESH, 83, 0, 0, &[(0x000D, &l120)])
            .done(),
    );
    add(
        "reconfigure",
        Session::new(0)
            .client(0, &cd(SETUP_CHANNEL, b"admitted"))
            .reconfigure()
            .client(0, &cd(SETUP_CHANNEL, b"narrowed"))
            .peer(0, p, b"narrowed")
            .reconfigure()
            .client(0, &cd(SETUP_CHANNEL, b"back"))
            .done(),
    );
    add(
        "channel_bind",
        Session::new(0)
            .auth(0, M_BIND, 90, 0, bit(2), &[(0x000C, &[0x40, 0x02, 0, 0])])
            .auth(0, M_BIND, 91, 0, bit(2), &[(0x000C, &[0x40, 0x01, 0, 0])])
            .auth(0, M_BIND, 92, 0, bit(7), &[(0x000C, &[0x3f, 0xff, 0, 0])])
            .auth(0, M_BIND, 93, 0, bit(6), &[(0x000C, &[0x40, 0x03, 0, 0])])
            .auth(0, M_BIND, 94, 0, bit(5), &[(0x000C, &[0x40, 0x04, 0, 0])])
            .client(0, &cd(0x4002, b"second channel"))
            .peer(0, 2, b"second channel back")
            .done(),
    );
    add(
        "quota",
        Session::new(1 | 4)
            .auth(0, M_PERMISSION, 100, 0, bit(2), &[])
            .auth(0, M_BIND, 101, 0, bit(2), &[(0x000C, &[0x40, 0x02, 0, 0])])
            .auth(1, M_ALLOCATE, 102, 0, 0, &[UDP])
            .done(),
    );
    add(
        "tcp_client",
        Session::new(0)
            .auth(4, M_ALLOCATE, 120, 0, 0, &[UDP])
            .auth(4, M_BIND, 121, 0, bit(2), &[(0x000C, &[0x40, 0x00, 0, 0])])
            .client(4, &cd(0x4000, &[7; 2000]))
            .peer(2, 2, b"over the stream")
            .auth(
                4,
                M_REFRESH,
                122,
                0,
                0,
                &[(0x7777, &[0; 4]), (0x7778, &[]), (0x7779, &[])],
            )
            .done(),
    );
    // max_permissions 2; the setup holds 10.1.2.3 (permission and channel). Regression: a
    // CreatePermission answered with 508 installed (or refreshed) the peers before the one
    // over the cap, and data then flowed to and from a peer whose request was refused.
    add(
        "create_permission_508_atomic",
        Session::new(2)
            // 10.1.2.4 and 127.0.0.1 are new: 1 + 2 > 2, so 508 and 10.1.2.4 stays closed.
            .auth(0, M_PERMISSION, 0x508, 0, bit(2) | bit(7), &[])
            .send(0, 2, 0x509, b"not relayed after a 508")
            .peer(0, 2, b"nor back")
            // 10.1.2.3 is held, so again 508: its permission must not be refreshed.
            .advance(200)
            .auth(
                0,
                M_PERMISSION,
                0x50a,
                0,
                bit(SETUP_PEER) | bit(2) | bit(7),
                &[],
            )
            .advance(101)
            .send(0, p, 0x50b, b"permission expired at 300 s")
            // Expired permissions are dropped before the cap is checked: 0 + 2 <= 2.
            .auth(0, M_PERMISSION, 0x50c, 0, bit(2) | bit(7), &[])
            .send(0, 2, 0x50d, b"now permitted")
            .peer(0, 7, b"from loopback")
            .done(),
    );
    add(
        "stun_in_session",
        Session::new(0)
            .auth(0, M_BINDING, 110, 0, 0, &[])
            .client(0, &request(BINDING, &[]))
            .client(0, &request(REFRESH, &[]))
            .done(),
    );
    seeds
}

fn framer() -> Vec<(String, Vec<u8>)> {
    let binding = request(BINDING, &[]);
    let allocate = request(
        ALLOCATE,
        &[&RequestedTransport::new(17), &Lifetime::new(600)],
    );
    let cd = [0x40, 0x01, 0x00, 0x05, 1, 2, 3, 4, 5, 0, 0, 0];
    let mut stream = binding.clone();
    stream.extend_from_slice(&cd);
    stream.extend_from_slice(&allocate);
    let with_cuts = |cuts: &[u16], s: &[u8]| {
        let mut out = Output::new();
        out.u8(cuts.len() as u8);
        for c in cuts {
            out.u16(*c);
        }
        out.raw(s);
        out.bytes
    };
    let mut bad_len = binding.clone();
    bad_len[3] = 6;
    let mut not_turn = stream.clone();
    not_turn.extend_from_slice(&[0xc0, 0, 0, 0]);
    vec![
        ("one_binding".into(), with_cuts(&[], &binding)),
        (
            "mixed_stream_split".into(),
            with_cuts(&[1, 3, 4, 19, 20, 21, 33, 40], &stream),
        ),
        ("bad_length".into(), with_cuts(&[2], &bad_len)),
        ("not_turn_after_frames".into(), with_cuts(&[5], &not_turn)),
        (
            "huge_channel_header".into(),
            with_cuts(&[], &[0x7f, 0xff, 0xff, 0xff, 0]),
        ),
        (
            "huge_stun_header".into(),
            with_cuts(&[1], &[0x00, 0x01, 0xff, 0xfc, 0x21, 0x12]),
        ),
        ("short".into(), with_cuts(&[], &[0x40, 0x00])),
    ]
}

fn text_seed(mode: u8, text: &str) -> Vec<u8> {
    let mut v = vec![mode];
    v.extend_from_slice(text.as_bytes());
    v
}

fn config() -> Vec<(String, Vec<u8>)> {
    let minimal = "version: v1\nauth:\n  credentials: {username: u, password: p}\nlisteners:\n  - name: l\nclusters:\n  - name: c\n";
    let json = r#"{"version": "v1", "admin": {"name": "gw", "loglevel": "all:DEBUG", "metrics_endpoint": "http://:8080/metrics", "healthcheck_endpoint": "http://[::1]:8086", "user_quota": 5, "offload_engine": "xdp"}, "auth": {"type": "ephemeral", "realm": "r", "credentials": {"secret": "s3cr3t"}}, "listeners": [{"name": "udp", "protocol": "turn-udp", "address": "203.0.113.1", "port": 3478, "routes": ["media", "missing"]}, {"name": "tcp", "protocol": "TURN-TCP", "port": 3479, "routes": ["media"]}], "clusters": [{"name": "media", "type": "STATIC", "protocol": "udp", "endpoints": ["10.0.0.0/8:<5000-6000>", "fd00::/64", "::ffff:192.168.0.0/112", "127.0.0.1"]}, {"name": "dns", "type": "STRICT_DNS", "endpoints": ["media.example.com"]}, {"name": "k8s", "type": "KUBERNETES", "endpoints": ["media/server:<1000-2000>"]}]}"#;
    let env = "version: v1\nauth:\n  type: plaintext\n  credentials:\n    username: $STUNNER_USERNAME\n    password: pa$$word\n  realm: ${STUNNER_REALM}\nlisteners:\n  - name: l\n    address: $STUNNER_ADDR\n    port: $STUNNER_PORT\n    public_address: $STUNNER_PUBLIC_ADDR\n    public_port: $STUNNER_PUBLIC_PORT\n    routes: [c]\nclusters:\n  - name: c\n    endpoints: [\"0.0.0.0/0\"]\n";
    let v1alpha1 = r#"{"version": "v1alpha1", "auth": {"type": "longterm", "credentials": {"secret": "x"}}, "listeners": [{"name": "dtls", "protocol": "TURN-DTLS", "cert": "Y2VydA==", "key": "a2V5"}]}"#;
    let none = "version: v1\nauth: {type: none}\nadmin: {healthcheck_endpoint: \"\"}\n";
    let bad =
        "version: v2\nauth: {credentials: {username: u}}\nlisteners: [{name: l, port: 70000}]\n";
    // Found by fuzzing: U+0085 (NEL), which YAML 1.1 folds into a line break, in a JSON key
    // (YAML refuses the document) and in a string (which must not change on the way back).
    let nel = "{\"version\":\"v1\",\"auth\":{\"credentials\":{\"username\":\"u\",\"password\":\"p\"}},\"listeners\":[{\"name\":\"l\",\"x\u{85}\u{85}y\":1,\"cert\":\"c\u{85}\u{85}d\"}]}";
    vec![
        ("minimal_yaml".into(), text_seed(0, minimal)),
        ("full_json".into(), text_seed(0, json)),
        ("env_substitution".into(), text_seed(0, env)),
        ("process_env".into(), text_seed(1, env)),
        ("v1alpha1_dtls".into(), text_seed(0, v1alpha1)),
        ("auth_none".into(), text_seed(0, none)),
        ("errors".into(), text_seed(0, bad)),
        ("json_nel_round_trip".into(), text_seed(0, nel)),
        ("session_config".into(), text_seed(0, &crate::engine::session_config(0))),
        ("uri_udp".into(), text_seed(2, "turn://user1:pass1@203.0.113.1:3478?transport=udp")),
        ("uri_turns".into(), text_seed(2, "turns://us%40er:p%3Ass@[2001:db8::1]?transport=tcp")),
        ("uri_dtls".into(), text_seed(2, "turn://u:p@host.example:5349?foo=bar&transport=DTLS#frag")),
        ("uri_bad".into(), text_seed(2, "turn:u:p@host")),
        ("endpoints".into(), text_seed(3, "10.0.0.0/8:<5000-6000>\n::ffff:10.0.0.0/104\nfd00::1/129\n1.2.3.4:<70000-1>\nns/svc:<1-2>\nhttp://[::1]:8080/metrics\nhttp://localhost\n0.0.0.0/0\n")),
    ]
}

fn addr_seed(
    sel: u8,
    v4: [u8; 4],
    v6: &str,
    net: &str,
    len: u8,
    port: u16,
    extra: [u8; 8],
) -> Vec<u8> {
    let v6: std::net::Ipv6Addr = v6.parse().unwrap();
    let net_bytes: [u8; 16] = match net.parse::<std::net::IpAddr>().unwrap() {
        std::net::IpAddr::V4(a) => {
            let mut b = [0u8; 16];
            b[..4].copy_from_slice(&a.octets());
            b
        }
        std::net::IpAddr::V6(a) => a.octets(),
    };
    let mut out = Output::new();
    out.u8(sel)
        .raw(&v4)
        .raw(&v6.octets())
        .raw(&net_bytes)
        .u8(len)
        .u16(port)
        .raw(&extra);
    out.bytes
}

fn peer_policy() -> Vec<(String, Vec<u8>)> {
    vec![
        (
            "loopback".into(),
            addr_seed(0, [127, 0, 0, 1], "::1", "127.0.0.0", 8, 5000, [0; 8]),
        ),
        (
            "metadata".into(),
            addr_seed(1, [169, 254, 169, 254], "fe80::1", "fe80::", 10, 80, [0; 8]),
        ),
        (
            "private".into(),
            addr_seed(0, [10, 1, 2, 3], "fd00::1", "10.0.0.0", 8, 5500, [1; 8]),
        ),
        (
            "own_address".into(),
            addr_seed(
                1,
                [203, 0, 113, 5],
                "2001:db8::5",
                "2001:db8::",
                32,
                3478,
                [0; 8],
            ),
        ),
        (
            "multicast".into(),
            addr_seed(0, [224, 0, 0, 1], "ff02::1", "224.0.0.0", 4, 1, [0; 8]),
        ),
        (
            "broadcast".into(),
            addr_seed(0, [255, 255, 255, 255], "::", "0.0.0.0", 0, 0, [0; 8]),
        ),
        (
            "global".into(),
            addr_seed(1, [8, 8, 8, 8], "2606:4700::1111", "::", 0, 53, [0xff; 8]),
        ),
        (
            "mapped_loopback".into(),
            addr_seed(
                1,
                [0, 0, 0, 1],
                "::ffff:127.0.0.1",
                "::ffff:0.0.0.0",
                96,
                9,
                [0; 8],
            ),
        ),
        (
            "teredo".into(),
            addr_seed(
                1,
                [1, 2, 3, 4],
                "2001:0:4136:e378:8000:63bf:80ff:fffe",
                "2001::",
                32,
                3544,
                [0x41, 0x36, 0xe3, 0x78, 0x80, 0, 0x63, 0xbf],
            ),
        ),
        (
            "six_to_four".into(),
            addr_seed(
                1,
                [192, 168, 1, 1],
                "2002:7f00:1::",
                "2002::",
                16,
                1,
                [0; 8],
            ),
        ),
        (
            "nat64".into(),
            addr_seed(
                1,
                [100, 64, 0, 1],
                "64:ff9b::a9fe:a9fe",
                "64:ff9b::",
                96,
                80,
                [0; 8],
            ),
        ),
    ]
}

/// `[current key byte][next key byte][clock offset][datagram]`, the datagram sealed under the
/// key of `sealed_by` at the receiver's clock.
fn sibling_seed(
    keys: (u8, u8),
    sealed_by: u8,
    message: &uturn_dataplane::proto::sibling::SiblingMessage<'_>,
    counter: u64,
) -> Vec<u8> {
    use uturn_dataplane::proto::sibling::{encode, SiblingKey, Stamp};
    let key = SiblingKey::new(&[sealed_by; 32]).unwrap();
    let stamp = Stamp {
        sent_ms: 1_760_000_000_000,
        sender: 0x0123_4567_89ab_cdef,
        counter,
    };
    let mut datagram = Vec::new();
    encode(&key, message, stamp, &mut datagram).unwrap();
    [&[keys.0, keys.1, 0][..], &datagram].concat()
}

fn sibling() -> Vec<(String, Vec<u8>)> {
    use uturn_dataplane::proto::sibling::{Kind, SiblingMessage, FLAG_QUERY};
    let ping = [0x40, 0x00, 0x00, 0x04, b'p', b'i', b'n', b'g'];
    let forward = SiblingMessage {
        kind: Kind::Forward,
        flags: FLAG_QUERY,
        client: "192.0.2.1:50000".parse().unwrap(),
        origin: None,
        listener: "udp",
        payload: &ping,
    };
    let claim = SiblingMessage {
        kind: Kind::Claim,
        flags: 0,
        origin: Some("10.0.0.7:13480".parse().unwrap()),
        payload: &[],
        ..forward.clone()
    };
    let returned = SiblingMessage {
        kind: Kind::Return,
        flags: 0,
        client: "[2001:db8::7]:40000".parse().unwrap(),
        listener: "stunner/udp-gateway/udp-listener",
        ..forward.clone()
    };
    let gone = SiblingMessage {
        kind: Kind::Gone,
        flags: 0,
        payload: &[],
        ..forward.clone()
    };
    let mut version_1 = sibling_seed((7, 0), 7, &forward, 0);
    version_1[3 + 4] = 1;
    vec![
        ("forward_query".into(), sibling_seed((7, 0), 7, &forward, 0)),
        ("claim_origin".into(), sibling_seed((7, 0), 7, &claim, 1)),
        ("return_v6".into(), sibling_seed((7, 0), 7, &returned, 2)),
        ("gone".into(), sibling_seed((7, 0), 7, &gone, 3)),
        // Mid-rotation: sealed under the next key, and under the current key with a next one.
        (
            "forward_next_key".into(),
            sibling_seed((7, 9), 9, &forward, 4),
        ),
        (
            "forward_current_key".into(),
            sibling_seed((9, 7), 9, &forward, 5),
        ),
        // Sealed under a key the receiver does not run.
        (
            "forward_old_key".into(),
            sibling_seed((9, 0), 7, &forward, 6),
        ),
        // The last counter a window refuses (a sender never sends it).
        (
            "forward_last_counter".into(),
            sibling_seed((7, 0), 7, &forward, u64::MAX),
        ),
        // A version-1 message (no sender id nor counter): malformed.
        ("version_1".into(), version_1),
    ]
}

/// Every seed.
pub fn all() -> Vec<Seed> {
    let mut out = Vec::new();
    for (target, seeds) in [
        ("engine_unauth", engine_unauth()),
        ("engine_session", engine_session()),
        ("framer", framer()),
        ("config", config()),
        ("peer_policy", peer_policy()),
        ("sibling", sibling()),
    ] {
        for (name, bytes) in seeds {
            out.push(Seed {
                target,
                name,
                bytes,
            });
        }
    }
    out
}

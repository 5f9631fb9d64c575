//! Dual stack end to end on loopback: the real `stunnerd` with a v1 config whose listener
//! address is 127.0.0.1 and, where a test says so, `STUNNER_ADDRS=127.0.0.1,::1` (the pod's
//! addresses: IPv6 relays are advertised as ::1). IPv6 relays (REQUESTED-ADDRESS-FAMILY) and
//! dual allocations (ADDITIONAL-ADDRESS-FAMILY) driven by coturn's `turnutils_uclient` (`-x`,
//! `-Z`) against `turnutils_peer`, and by the `turn-client-proto` client against echo peers of
//! both families, from IPv4 and IPv6 client addresses. Run with `UTURN_IO_ENGINE=epoll` too to
//! cover both IO engines.

use std::net::{SocketAddr, UdpSocket};
use std::time::Duration;
use stun_proto::types::message::{MessageWriteExt, MessageWriteVec, TransactionId};
use turn_types::attribute::{RequestedAddressFamily, XorPeerAddress, XorRelayedAddress};
use turn_types::message::{ALLOCATE, CREATE_PERMISSION};
use turn_types::AddressFamily;
use uturn_testkit::engine::{udp, Client, Reply};
use uturn_testkit::peers::{self, Peer};
use uturn_testkit::stunnerd::{
    free_port, metric, temp_file, uclient, wait_until, Killed, Stunnerd,
};
use uturn_testkit::turn_client::TurnClient;

const USER: &str = "user1";
const PASS: &str = "pass1";

/// A stunnerd whose TURN-UDP listener is 127.0.0.1 (IPv4 relays as 127.0.0.1) routed to
/// loopback peers of both families; with `ipv6`, `STUNNER_ADDRS` names ::1 for IPv6 relays.
struct Server {
    _stunnerd: Stunnerd,
    port: u16,
    metrics: u16,
}

impl Server {
    fn start(ipv6: bool) -> Server {
        let (port, metrics) = (free_port(), free_port());
        let config = temp_file("dual-stack.yaml");
        std::fs::write(
            &config,
            format!(
                "version: v1\n\
                 admin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
                 auth: {{type: static, credentials: {{username: {USER}, password: {PASS}}}}}\n\
                 listeners: [{{name: udp, address: 127.0.0.1, port: {port}, routes: [media]}}]\n\
                 clusters: [{{name: media, endpoints: [127.0.0.1, \"::1\"]}}]\n"
            ),
        )
        .unwrap();
        let origin = format!("file://{}", config.display());
        let mut envs = vec![("UTURN_SHARDS", "2")];
        if ipv6 {
            envs.push(("STUNNER_ADDRS", "127.0.0.1,::1"));
        }
        let stunnerd = Stunnerd::start(&["-c", &origin], &envs);
        assert!(
            wait_until(10, || metric(metrics, "stunner_allocations_active ")
                .is_some()),
            "stunnerd did not come up:\n{}",
            stunnerd.logs()
        );
        Server {
            _stunnerd: stunnerd,
            port,
            metrics,
        }
    }

    /// The listener at `ip` (127.0.0.1 or ::1: the listener socket is dual-stack).
    fn addr(&self, ip: &str) -> SocketAddr {
        SocketAddr::new(ip.parse().unwrap(), self.port)
    }

    fn allocations(&self) -> Option<f64> {
        metric(self.metrics, "stunner_allocations_active ")
    }
}

/// coturn's echo peer on `ip`; its port.
fn turnutils_peer(ip: &str) -> (Killed, u16) {
    let port = free_port();
    let peer = peers::turnutils_peer(ip, port);
    std::thread::sleep(Duration::from_millis(200));
    (peer, port)
}

/// `turnutils_uclient` through `server` (reached at `server_ip`) to the echo peer at
/// `peer_ip:peer_port`, with `family_flags` (`-x`, `-Z`): 20 messages of 120 bytes from each
/// of two clients, every one back.
fn relay_with_uclient(
    server: &Server,
    server_ip: &str,
    peer_ip: &str,
    peer_port: u16,
    flags: &[&str],
) {
    let (port, peer_port) = (server.port.to_string(), peer_port.to_string());
    let mut args = vec![
        "-n", "20", "-l", "120", "-m", "2", "-p", &port, "-e", peer_ip, "-r", &peer_port, "-u",
        USER, "-w", PASS,
    ];
    args.extend_from_slice(flags);
    args.push(server_ip);
    let (sent, received, text) = uclient(60, &args);
    assert!(
        sent >= 40,
        "{flags:?} to {peer_ip}: too little sent:\n{text}"
    );
    assert_eq!(
        received, sent,
        "{flags:?} to {peer_ip}: lost datagrams:\n{text}"
    );
}

#[test]
fn uclient_relays_through_an_ipv6_relay_to_an_ipv6_peer() {
    let server = Server::start(true);
    let (_peer, peer_port) = turnutils_peer("::1");
    // Channels, then Send/Data indications (-s); from an IPv4 client and an IPv6 one.
    for server_ip in ["127.0.0.1", "::1"] {
        for mode in [&["-x", "-c"][..], &["-x", "-c", "-s"]] {
            relay_with_uclient(&server, server_ip, "::1", peer_port, mode);
        }
    }
}

#[test]
fn uclient_dual_allocation_relays_to_ipv4_and_ipv6_peers() {
    let server = Server::start(true);
    let (_peer4, port4) = turnutils_peer("127.0.0.1");
    let (_peer6, port6) = turnutils_peer("::1");
    for (peer_ip, peer_port) in [("127.0.0.1", port4), ("::1", port6)] {
        relay_with_uclient(&server, "127.0.0.1", peer_ip, peer_port, &["-Z"]);
        relay_with_uclient(&server, "127.0.0.1", peer_ip, peer_port, &["-Z", "-s"]);
    }
}

/// `payload` to `peer` and back through `d`, byte-exact: the echo the client receives comes
/// from `peer`, and what the peer saw came from one of `d`'s relays (`relay`).
fn echo(d: &mut TurnClient, peer: &Peer, relay: SocketAddr, payload: &[u8]) {
    let before = d.received.len();
    d.send(peer.addr, payload);
    let deadline = std::time::Instant::now() + Duration::from_secs(3);
    while d.received.len() == before && std::time::Instant::now() < deadline {
        d.drive(0.005);
    }
    let back: Vec<_> = d.received[before..]
        .iter()
        .filter(|(from, _)| *from == peer.addr)
        .collect();
    assert_eq!(back.len(), 1, "{relay} -> {}: {:?}", peer.addr, d.events);
    assert_eq!(back[0].1, payload, "not byte-exact");
    assert!(
        peer.senders().contains_key(&relay),
        "{} heard from {:?}, not from relay {relay}",
        peer.addr,
        peer.senders()
    );
}

/// Payloads of every byte value and of sizes from 1 to 1200 bytes.
fn payloads() -> Vec<Vec<u8>> {
    [1usize, 100, 256, 1200]
        .iter()
        .map(|&n| (0..n).map(|i| (i * 7 + n) as u8).collect())
        .collect()
}

/// Relays to `peer` through `relay` of `d`: Send/Data indications, then (with `channel`)
/// ChannelData.
fn relay_both_ways(d: &mut TurnClient, peer: &Peer, relay: SocketAddr, channel: bool) {
    assert!(d.permit(peer.addr.ip()), "permission to {}", peer.addr);
    for payload in payloads() {
        echo(d, peer, relay, &payload);
    }
    if channel {
        assert!(d.bind(peer.addr), "channel to {}", peer.addr);
        for payload in payloads() {
            echo(d, peer, relay, &payload);
        }
    }
}

#[test]
fn turn_client_proto_ipv6_and_dual_allocations_relay_byte_exact() {
    let server = Server::start(true);
    let peer4 = Peer::on("127.0.0.1");
    let peer6 = Peer::on("::1");
    // An IPv6 relay, for a client on IPv4 and for one on IPv6.
    for server_ip in ["127.0.0.1", "::1"] {
        let mut d =
            TurnClient::with_families(server.addr(server_ip), USER, PASS, &[AddressFamily::IPV6]);
        let relay = d.allocate().expect("IPv6 allocation");
        assert_eq!(relay.ip().to_string(), "::1");
        relay_both_ways(&mut d, &peer6, relay, true);
        d.delete();
    }
    // A dual allocation: one XOR-RELAYED-ADDRESS per family, each peer through its own.
    let mut d = TurnClient::with_families(
        server.addr("127.0.0.1"),
        USER,
        PASS,
        &[AddressFamily::IPV4, AddressFamily::IPV6],
    );
    d.allocate().expect("dual allocation");
    let relays = d.relayed();
    let relay4 = *relays.iter().find(|a| a.is_ipv4()).expect("an IPv4 relay");
    let relay6 = *relays.iter().find(|a| a.is_ipv6()).expect("an IPv6 relay");
    assert_eq!(relays.len(), 2, "{relays:?}");
    assert_eq!(relay4.ip().to_string(), "127.0.0.1");
    assert_eq!(relay6.ip().to_string(), "::1");
    // One allocation.
    assert!(wait_until(5, || server.allocations() == Some(1.0)));
    relay_both_ways(&mut d, &peer4, relay4, true);
    // turn-client-proto numbers channels per relay, so it binds 0x4000 again for the IPv6
    // peer; on one 5-tuple that number is taken (a ChannelData names no relay): 400, RFC 8656
    // §11.2. The IPv6 peer is reached with indications.
    relay_both_ways(&mut d, &peer6, relay6, false);
    assert!(!d.bind(peer6.addr));
    assert_eq!(d.responses.last().and_then(|r| r.error_code), Some(400));
    // Deleted: both relays go (the peers' datagrams to them are not answered any more).
    d.delete();
    assert!(wait_until(5, || server.allocations() == Some(0.0)));
    let probe = UdpSocket::bind("[::1]:0").unwrap();
    probe.send_to(b"anyone?", relay6).unwrap();
    let before = d.received.len();
    d.drive(0.3);
    assert_eq!(d.received.len(), before);
}

/// An authenticated Allocate with `family` over a raw socket at `server`, then a
/// CreatePermission for `peer`: the two replies.
fn allocate_then_permit(
    server: SocketAddr,
    family: AddressFamily,
    peer: SocketAddr,
) -> (Reply, Reply) {
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    socket
        .set_read_timeout(Some(Duration::from_secs(2)))
        .unwrap();
    let exchange = |bytes: Vec<u8>| {
        socket.send_to(&bytes, server).unwrap();
        let mut buf = [0u8; 2048];
        let (n, _) = socket.recv_from(&mut buf).expect("a reply");
        Reply {
            bytes: buf[..n].to_vec(),
        }
    };
    let mut c = Client::new(USER, PASS);
    let with_family = move |m: &mut MessageWriteVec, t| {
        udp(m, t);
        m.add_attribute(&RequestedAddressFamily::new(family))
            .unwrap();
    };
    c.learn(&exchange(c.build(
        ALLOCATE,
        TransactionId::generate(),
        &with_family,
        false,
    )));
    let allocated = exchange(c.build(ALLOCATE, TransactionId::generate(), &with_family, true));
    let permit = move |m: &mut MessageWriteVec, t| {
        m.add_attribute(&XorPeerAddress::new(peer, t)).unwrap();
    };
    let permitted = exchange(c.build(CREATE_PERMISSION, TransactionId::generate(), &permit, true));
    (allocated, permitted)
}

#[test]
fn families_a_listener_does_not_serve_or_an_allocation_lacks_are_refused() {
    // No IPv6 relay address (no STUNNER_ADDRS): an IPv6 relay gets 440, a dual allocation
    // IPv4 alone.
    let server = Server::start(false);
    let mut d =
        TurnClient::with_families(server.addr("127.0.0.1"), USER, PASS, &[AddressFamily::IPV6]);
    assert_eq!(d.allocate(), None);
    assert!(
        d.responses.iter().any(|r| r.error_code == Some(440)),
        "{:?}",
        d.responses
    );
    let mut d = TurnClient::with_families(
        server.addr("127.0.0.1"),
        USER,
        PASS,
        &[AddressFamily::IPV4, AddressFamily::IPV6],
    );
    d.allocate().expect("the IPv4 relay");
    d.drive(0.2);
    let relays = d.relayed();
    assert_eq!(relays.len(), 1, "{relays:?}");
    assert!(relays[0].is_ipv4());
    drop(server);
    // An IPv4 peer on an IPv6-only allocation: 443.
    let server = Server::start(true);
    let (allocated, permitted) = allocate_then_permit(
        server.addr("127.0.0.1"),
        AddressFamily::IPV6,
        "127.0.0.1:5000".parse().unwrap(),
    );
    let msg = allocated.msg();
    let relay = msg
        .attribute::<XorRelayedAddress>()
        .expect("an IPv6 relay")
        .addr(msg.transaction_id());
    assert_eq!(relay.ip().to_string(), "::1");
    assert_eq!(permitted.error_code(), Some(443));
    let (_, permitted) = allocate_then_permit(
        server.addr("127.0.0.1"),
        AddressFamily::IPV4,
        "[::1]:5000".parse().unwrap(),
    );
    assert_eq!(permitted.error_code(), Some(443));
}

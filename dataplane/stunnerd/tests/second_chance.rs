//! A client's UDP flow moved from one gateway pod to another, with real kernel networking:
//! network namespaces for the pods, the client and the media server, and a service VIP that
//! the node NATs to one pod and the test re-points (`uturn_testkit::cluster`, what kube-proxy
//! or a load balancer does when endpoints change). First the harness itself (a raw UDP flow
//! moves A → B → C → A, answered by whichever pod the VIP points at), then the baseline:
//! without forwarding between gateway pods, the move kills a TURN call.

use std::net::{IpAddr, SocketAddr, SocketAddrV4, UdpSocket};
use std::time::{Duration, Instant};
use stun_proto::types::message::MessageWriteExt;
use uturn_dataplane::proto::sibling::{
    decode, Kind, SiblingKey, SiblingKeys, SiblingMessage, SiblingSender, FLAG_QUERY,
};
use uturn_testkit::cluster::{udp_checksum_errors, Cluster, VIP_PORT};
use uturn_testkit::link::TurnLink;
use uturn_testkit::peers::Peer;

/// UDP checksum errors in the client's and every pod's namespace.
fn checksum_errors(cluster: &Cluster) -> Vec<u64> {
    std::iter::once(cluster.ns("client"))
        .chain(cluster.pods().iter().map(|p| p.ns.clone()))
        .map(|ns| udp_checksum_errors(&ns))
        .collect()
}

#[test]
fn the_vip_moves_a_raw_udp_flow_from_pod_to_pod_at_once() {
    let mut cluster = Cluster::new(3);
    let _echoes: Vec<_> = (0..3).map(|i| cluster.tagged_echo(i, VIP_PORT)).collect();
    // One client socket, so one 5-tuple, for the whole test.
    let socket = cluster.in_client(|| UdpSocket::bind("0.0.0.0:0").unwrap());
    socket
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let errors_before = checksum_errors(&cluster);
    let mut buf = [0u8; 256];
    for (step, to) in [0, 1, 2, 0].into_iter().enumerate() {
        if step > 0 {
            cluster.move_flow(to);
        }
        assert_eq!(cluster.target(), to);
        let name = cluster.pod(to).name;
        for probe in 0..3 {
            let text = format!("probe {step}.{probe}");
            socket.send_to(text.as_bytes(), cluster.vip()).unwrap();
            let (n, from) = socket.recv_from(&mut buf).unwrap_or_else(|e| {
                panic!(
                    "step {step}: no answer to {text:?} ({e})\n{}",
                    cluster.describe()
                )
            });
            assert_eq!(
                (from, String::from_utf8_lossy(&buf[..n]).into_owned()),
                (cluster.vip(), format!("{name} {text}")),
                "step {step}: not pod {name} behind the VIP\n{}",
                cluster.describe()
            );
        }
        // The NAT rewrote exactly this step's datagrams, both ways.
        assert_eq!(
            cluster.steered(),
            (3, 3),
            "step {step}\n{}",
            cluster.describe()
        );
    }
    assert_eq!(
        checksum_errors(&cluster),
        errors_before,
        "UDP checksum errors (client, pods)\n{}",
        cluster.describe()
    );
}

/// Sends ChannelData with sequence numbers `seqs` on channel 0x4000, one per 20 ms (a voice
/// call's pace), then reads the echoes (the socket holds them meanwhile), waiting up to 0.5 s
/// for missing ones: the sequence numbers echoed. (TurnLink's reads wait 100 ms when nothing
/// comes, too long to read between datagrams.)
fn paced_call(link: &mut TurnLink, seqs: std::ops::Range<u32>) -> Vec<u32> {
    link.channel_data.clear();
    let expected = seqs.len();
    for seq in seqs {
        link.send_channel_data(0x4000, format!("seq {seq:05}").as_bytes());
        std::thread::sleep(Duration::from_millis(20));
    }
    let deadline = Instant::now() + Duration::from_millis(500);
    while link.channel_data.len() < expected && Instant::now() < deadline {
        link.drain(0.05);
    }
    let mut echoed: Vec<u32> = link
        .channel_data
        .iter()
        .filter_map(|(_, payload)| {
            std::str::from_utf8(payload)
                .ok()?
                .strip_prefix("seq ")?
                .parse()
                .ok()
        })
        .collect();
    echoed.sort_unstable();
    echoed
}

#[test]
fn without_forwarding_a_moved_flow_kills_the_call() {
    let mut cluster = Cluster::new(2);
    let config = cluster.static_config();
    cluster.start_pods(&config, &[], &[]);
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let mut link = cluster.in_client(|| {
        TurnLink::connect(uturn_perf::turncat::transport::Protocol::Udp, cluster.vip())
            .expect("a UDP socket in the client namespace")
    });
    let relay = link
        .allocate(false, false)
        .unwrap_or_else(|code| panic!("allocation: {code}\n{}", cluster.describe()));
    assert_eq!(
        relay.ip(),
        IpAddr::from(cluster.pod(0).ip),
        "not allocated on pod a"
    );
    link.create_permission(peer.addr)
        .unwrap_or_else(|code| panic!("permission: {code}\n{}", cluster.describe()));
    link.bind_channel(0x4000, peer.addr)
        .unwrap_or_else(|code| panic!("channel: {code}\n{}", cluster.describe()));

    // The call, through pod a: everything arrives.
    let before = paced_call(&mut link, 0..50);
    assert_eq!(
        before,
        (0..50).collect::<Vec<_>>(),
        "lost before the move\n{}",
        cluster.describe()
    );
    assert_eq!(peer.counts()[0], 50);

    // The VIP moves to pod b, which knows nothing of the allocation: the call is dead.
    cluster.move_flow(1);
    let after = paced_call(&mut link, 50..100);
    assert_eq!(
        after,
        Vec::<u32>::new(),
        "echoes after the move\n{}",
        cluster.describe()
    );
    assert_eq!(peer.counts()[0], 50, "the peer got data after the move");
    let (to_b, _) = cluster.steered();
    assert!(
        to_b >= 50,
        "only {to_b} datagrams reached pod b\n{}",
        cluster.describe()
    );
    // What the client's stack sees when it tries to keep the allocation: 437 from pod b.
    let refresh = link.request(turn_types::message::REFRESH, &|_, _| {});
    assert_eq!(
        refresh.err(),
        Some(437),
        "Refresh after the move\n{}",
        cluster.describe()
    );
    assert_eq!(
        link.create_permission(peer.addr).err(),
        Some(437),
        "CreatePermission after the move\n{}",
        cluster.describe()
    );
    // Pod a still holds the stranded allocation, pod b has none; only a's relay reached the
    // peer.
    let allocations = |i| cluster.status(i).map(|s| s["allocationCount"].clone());
    assert_eq!(
        (allocations(0), allocations(1)),
        (Some(1.into()), Some(0.into())),
        "{}",
        cluster.describe()
    );
    assert_eq!(
        cluster.metric(1, "stunner_allocations_active "),
        Some(0.0),
        "{}",
        cluster.describe()
    );
    let senders: Vec<SocketAddr> = peer.senders().into_keys().collect();
    assert_eq!(senders, vec![relay]);
}

/// The key the test gateway's pods share.
const SIBLING_KEY: &str = "0123456789abcdef0123456789abcdef";

/// Starts every pod of `cluster` with second-chance forwarding among them.
fn start_forwarding(cluster: &mut Cluster) {
    start_forwarding_with(cluster, &[]);
}

/// [`start_forwarding`], with `extra` arguments for every pod.
fn start_forwarding_with(cluster: &mut Cluster, extra: &[&str]) {
    let config = cluster.static_config();
    let ips: Vec<String> = cluster.pods().iter().map(|p| p.ip.to_string()).collect();
    let siblings = format!("static:{}", ips.join(","));
    let mut args = vec!["--siblings", siblings.as_str()];
    args.extend_from_slice(extra);
    cluster.start_pods(&config, &args, &[("UTURN_SIBLING_KEY", SIBLING_KEY)]);
}

/// A call set up through the VIP (on pod a): the client's link, the echo peer, the relay.
fn call(cluster: &Cluster) -> (TurnLink, Peer, SocketAddr) {
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let mut link = cluster.in_client(|| {
        TurnLink::connect(uturn_perf::turncat::transport::Protocol::Udp, cluster.vip())
            .expect("a UDP socket in the client namespace")
    });
    let relay = link
        .allocate(false, false)
        .unwrap_or_else(|code| panic!("allocation: {code}\n{}", cluster.describe()));
    link.create_permission(peer.addr)
        .unwrap_or_else(|code| panic!("permission: {code}\n{}", cluster.describe()));
    link.bind_channel(0x4000, peer.addr)
        .unwrap_or_else(|code| panic!("channel: {code}\n{}", cluster.describe()));
    (link, peer, relay)
}

/// At most the datagrams in flight at a move may be lost (the one that asks the siblings
/// who owns the client, and those sent while the answer is on its way).
fn mostly(echoed: &[u32], seqs: std::ops::Range<u32>, cluster: &Cluster) {
    let lost: Vec<u32> = seqs.clone().filter(|s| !echoed.contains(s)).collect();
    assert!(
        lost.len() <= 3,
        "lost {lost:?} of {seqs:?}\n{}\n{}",
        cluster.describe(),
        sibling_metrics(cluster)
    );
}

/// Every pod's `uturn_sibling_*` metrics, for a failure message.
fn sibling_metrics(cluster: &Cluster) -> String {
    (0..cluster.pods().len())
        .map(|i| {
            let page = cluster
                .http_get(i, uturn_testkit::cluster::METRICS_PORT, "/metrics")
                .map(|(_, body)| body)
                .unwrap_or_default();
            let lines: Vec<&str> = page
                .lines()
                .filter(|l| l.starts_with("uturn_sibling") || l.starts_with("uturn_dropped"))
                .collect();
            format!("pod {i}: {}", lines.join("; "))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The first field report, solved in the gateway: pod a drains (NotReady at once, no
/// --force-ready-status), the client's flow moves to pod b, and the call keeps flowing through
/// b to the allocation a still holds: media both ways, Refresh, CreatePermission and
/// ChannelBind; a exits 0 once the call deletes its allocation.
#[test]
fn with_forwarding_a_moved_call_keeps_flowing_until_it_ends() {
    let mut cluster = Cluster::new(2);
    start_forwarding(&mut cluster);
    let (mut link, peer, relay) = call(&cluster);
    assert_eq!(relay.ip(), IpAddr::from(cluster.pod(0).ip));
    assert_eq!(paced_call(&mut link, 0..50), (0..50).collect::<Vec<_>>());

    // Pod a drains: NotReady, TERMINATING, still serving.
    cluster.stunnerd(0).signal(libc::SIGTERM);
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || cluster
            .status(0)
            .is_some_and(|s| s["status"] == "TERMINATING")),
        "{}",
        cluster.describe()
    );
    assert_eq!(
        cluster
            .http_get(0, uturn_testkit::cluster::HEALTH_PORT, "/ready")
            .map(|(code, _)| code),
        Some(503)
    );
    cluster.move_flow(1);
    mostly(&paced_call(&mut link, 50..150), 50..150, &cluster);
    // Requests go through b to a, and come back through b.
    link.request(turn_types::message::REFRESH, &|_, _| {})
        .unwrap_or_else(|code| panic!("Refresh through b: {code}\n{}", cluster.describe()));
    link.create_permission(peer.addr).unwrap_or_else(|code| {
        panic!("CreatePermission through b: {code}\n{}", cluster.describe())
    });
    link.bind_channel(0x4000, peer.addr)
        .unwrap_or_else(|code| panic!("ChannelBind through b: {code}\n{}", cluster.describe()));
    assert_eq!(
        paced_call(&mut link, 150..200),
        (150..200).collect::<Vec<_>>(),
        "{}",
        cluster.describe()
    );
    // Send and Data indications too, to a peer port with no channel (the owner builds the
    // Data indication, b returns it).
    let other = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    link.data.clear();
    link.send_indication(other.addr, b"indicated");
    link.drain(0.5);
    assert!(
        link.data
            .iter()
            .any(|(from, payload)| *from == Some(other.addr) && payload == b"indicated"),
        "{:?}\n{}",
        link.data,
        cluster.describe()
    );
    // The peer still hears from a's relay only; b forwards for one client.
    let senders: Vec<SocketAddr> = peer.senders().into_keys().collect();
    assert_eq!(senders, vec![relay]);
    let b = cluster.status(1).expect("b's status");
    assert_eq!(
        b["siblings"][0]["address"],
        cluster.pod(0).ip.to_string(),
        "{b}"
    );
    assert_eq!(b["siblings"][0]["forwarding_for"], 1, "{b}");
    assert!(
        cluster
            .metric(
                1,
                "uturn_sibling_packets_total{direction=\"forwarded_out\"}"
            )
            .unwrap_or(0.0)
            >= 150.0,
        "{}",
        cluster.describe()
    );
    assert_eq!(
        cluster.metric(1, "stunner_allocations_active "),
        Some(0.0),
        "b made an allocation of its own"
    );
    // The call ends: its allocation on a goes, and a, drained, exits 0.
    link.request(turn_types::message::REFRESH, &|m, _| {
        m.add_attribute(&turn_types::attribute::Lifetime::new(0))
            .unwrap();
    })
    .unwrap_or_else(|code| panic!("delete through b: {code}\n{}", cluster.describe()));
    assert_eq!(
        cluster.stunnerd(0).wait_exit_for(5.0),
        Some(0),
        "{}",
        cluster.describe()
    );
}

/// The flow moves a → b → c → a: the owner follows the newest forwarder, and the call keeps
/// flowing when the flow comes straight back to its owner.
#[test]
fn a_call_follows_its_flow_from_pod_to_pod_and_back() {
    let mut cluster = Cluster::new(3);
    start_forwarding(&mut cluster);
    let (mut link, peer, relay) = call(&cluster);
    let mut next = 0;
    for to in [1, 2, 0, 2] {
        cluster.move_flow(to);
        mostly(
            &paced_call(&mut link, next..next + 50),
            next..next + 50,
            &cluster,
        );
        next += 50;
        link.request(turn_types::message::REFRESH, &|_, _| {})
            .unwrap_or_else(|code| panic!("Refresh via pod {to}: {code}\n{}", cluster.describe()));
    }
    let senders: Vec<SocketAddr> = peer.senders().into_keys().collect();
    assert_eq!(senders, vec![relay]);
    // The call ends through its current forwarder; what the client sends next gets today's
    // answer from that pod (the owner says the allocation is gone): 437.
    link.request(turn_types::message::REFRESH, &|m, _| {
        m.add_attribute(&turn_types::attribute::Lifetime::new(0))
            .unwrap();
    })
    .unwrap_or_else(|code| panic!("delete: {code}\n{}", cluster.describe()));
    assert_eq!(
        link.create_permission(peer.addr).err(),
        Some(437),
        "{}\n{}",
        cluster.describe(),
        sibling_metrics(&cluster)
    );
}

/// Only siblings with the key can forward: a forward from a non-sibling address or with a
/// wrong key is dropped and counted, and a flood of misses from many source ports asks the
/// siblings no more than the per-source query budget allows.
#[test]
fn forwards_need_the_key_and_a_sibling_address_and_misses_are_rate_limited() {
    let mut cluster = Cluster::new(2);
    start_forwarding(&mut cluster);
    let sibling_port = 13479;
    let forward = |key: &[u8]| {
        let message = SiblingMessage {
            kind: Kind::Forward,
            flags: FLAG_QUERY,
            client: "192.0.2.1:4000".parse().unwrap(),
            origin: None,
            listener: "udp",
            payload: &[0x40, 0, 0, 4, 1, 2, 3, 4],
        };
        seal(key, &mut SiblingSender::new(1), &message)
    };
    let pod_a = SocketAddr::new(IpAddr::from(cluster.pod(0).ip), sibling_port);
    // From the client's namespace (no sibling), with the right key: not a sibling.
    cluster.in_client(|| {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        socket
            .send_to(&forward(SIBLING_KEY.as_bytes()), pod_a)
            .unwrap();
    });
    // From pod b (a sibling), with a wrong key: unauthenticated.
    cluster.in_pod(1, || {
        let socket = UdpSocket::bind("0.0.0.0:0").unwrap();
        socket
            .send_to(&forward(b"not the gateway's key at all"), pod_a)
            .unwrap();
    });
    let refused = |reason: &str| {
        cluster
            .metric(
                0,
                &format!("uturn_sibling_refused_total{{reason=\"{reason}\"}}"),
            )
            .unwrap_or(0.0)
    };
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || refused("not_sibling") >= 1.0
            && refused("unauthenticated") >= 1.0),
        "{}",
        cluster.describe()
    );

    // 300 misses (ChannelData from 300 source ports nobody holds) reach pod a through the VIP:
    // queries are limited per source IP (a burst of 100, then 50 a second).
    let started = Instant::now();
    let over_budget = cluster.in_client(|| {
        // Held until all are sent: a closed socket's port may come back, and one 5-tuple
        // with a query in flight asks nothing more.
        let sockets: Vec<UdpSocket> = (0..300)
            .map(|_| UdpSocket::bind("0.0.0.0:0").unwrap())
            .collect();
        for socket in &sockets {
            socket
                .send_to(&[0x40, 0, 0, 4, 1, 2, 3, 4], cluster.vip())
                .unwrap();
        }
        // A Refresh right after, over the budget: it may be a moved call whose owner is not
        // asked yet, so it gets no answer (a 437 would end that call at its client).
        let refresh = UdpSocket::bind("0.0.0.0:0").unwrap();
        // With a 200-byte SOFTWARE, so that today's answer (a 401) is not held back as an
        // amplification.
        let mut request = vec![0x00, 0x04, 0x00, 204, 0x21, 0x12, 0xa4, 0x42];
        request.extend_from_slice(b"over-budget!");
        request.extend_from_slice(&[0x80, 0x22, 0x00, 200]);
        request.extend_from_slice(&[b'x'; 200]);
        refresh.send_to(&request, cluster.vip()).unwrap();
        refresh
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        let mut buf = [0u8; 1500];
        refresh.recv(&mut buf).ok().map(|n| buf[..n].to_vec())
    });
    assert_eq!(
        over_budget, None,
        "a miss over the query budget was answered"
    );
    let queries = |outcome: &str| {
        cluster
            .metric(
                0,
                &format!("uturn_sibling_queries_total{{outcome=\"{outcome}\"}}"),
            )
            .unwrap_or(0.0)
    };
    // Every miss is counted (the counters are published every 100 ms).
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || queries("sent") + queries("rate_limited")
            >= 301.0),
        "{} + {}\n{}",
        queries("sent"),
        queries("rate_limited"),
        sibling_metrics(&cluster)
    );
    let budget = 100.0 + 50.0 * (started.elapsed().as_secs_f64() + 1.0);
    let sent = queries("sent");
    assert!(
        sent >= 1.0 && sent <= budget,
        "{sent} queries sent for 301 misses (budget {budget})\n{}",
        cluster.describe()
    );
    // Nobody owns those clients: the queries went unclaimed.
    assert!(uturn_testkit::stunnerd::wait_until(3, || cluster
        .metric(0, "uturn_sibling_queries_total{outcome=\"miss\"}")
        .unwrap_or(0.0)
        >= sent));
}

/// TURN over TCP is not forwarded: a moved TCP flow is a new connection (the old one is reset
/// or times out, and its allocation ends with it, RFC 6062/8656), so no sibling could continue
/// it. With forwarding on, a TURN-TCP call relays as without it, and a request on a TCP
/// connection with no allocation gets today's 437 at once, asking no sibling.
#[test]
fn turn_over_tcp_is_served_as_without_forwarding() {
    let mut cluster = Cluster::new(2);
    let config = cluster.static_config().replace(
        "listeners: [",
        &format!("listeners: [{{name: tcp, protocol: TURN-TCP, address: $STUNNER_ADDR, port: {}, routes: [media]}}, ", VIP_PORT + 1),
    );
    let ips: Vec<String> = cluster.pods().iter().map(|p| p.ip.to_string()).collect();
    let siblings = format!("static:{}", ips.join(","));
    cluster.start_pods(
        &config,
        &["--siblings", &siblings],
        &[("UTURN_SIBLING_KEY", SIBLING_KEY)],
    );
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let pod_a = SocketAddr::new(IpAddr::from(cluster.pod(0).ip), VIP_PORT + 1);
    let mut link = cluster.in_client(|| {
        TurnLink::connect(uturn_perf::turncat::transport::Protocol::Tcp, pod_a)
            .expect("a TCP connection to pod a")
    });
    link.allocate(false, false)
        .unwrap_or_else(|code| panic!("allocation: {code}\n{}", cluster.describe()));
    link.create_permission(peer.addr).unwrap();
    link.bind_channel(0x4000, peer.addr).unwrap();
    assert_eq!(paced_call(&mut link, 0..20), (0..20).collect::<Vec<_>>());
    // A new connection (what a moved TCP flow is) holds no allocation anywhere: 437.
    let pod_b = SocketAddr::new(IpAddr::from(cluster.pod(1).ip), VIP_PORT + 1);
    let mut moved = cluster.in_client(|| {
        TurnLink::connect(uturn_perf::turncat::transport::Protocol::Tcp, pod_b).unwrap()
    });
    assert_eq!(
        moved.create_permission(peer.addr).err(),
        Some(437),
        "{}",
        cluster.describe()
    );
    assert_eq!(
        cluster
            .metric(1, "uturn_sibling_queries_total{outcome=\"sent\"}")
            .unwrap_or(0.0),
        0.0,
        "a TCP miss asked the siblings\n{}",
        sibling_metrics(&cluster)
    );
}

/// The sibling port of every test pod's one shard (the test kit runs each stunnerd with one).
const SIBLING_PORT: u16 = 13479;

fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64
}

/// `message` sealed under `key` by `sender`, as a sibling pod seals what it sends: what a test
/// injects, or what an attacker who captured it sends again.
fn seal(key: &[u8], sender: &mut SiblingSender, message: &SiblingMessage<'_>) -> Vec<u8> {
    let keys = SiblingKeys::from(SiblingKey::new(key).unwrap());
    let mut out = Vec::new();
    sender.seal(&keys, message, unix_ms(), &mut out).unwrap();
    out
}

/// A message for listener `udp` about `client`.
fn sibling_message(
    kind: Kind,
    flags: u8,
    client: SocketAddr,
    payload: &[u8],
) -> SiblingMessage<'_> {
    SiblingMessage {
        kind,
        flags,
        client,
        origin: None,
        listener: "udp",
        payload,
    }
}

/// The sibling messages `socket` receives in `secs` that check under `key`: kind and payload.
fn received(socket: &UdpSocket, key: &str, secs: f64) -> Vec<(Kind, Vec<u8>)> {
    let keys = SiblingKeys::from(SiblingKey::new(key.as_bytes()).unwrap());
    socket
        .set_read_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let mut buf = [0u8; 2048];
    let mut messages = Vec::new();
    while Instant::now() < deadline {
        let Ok(n) = socket.recv(&mut buf) else {
            continue;
        };
        if let Ok((message, _)) = decode(&keys, &buf[..n], unix_ms()) {
            messages.push((message.kind, message.payload.to_vec()));
        }
    }
    messages
}

/// Pod `i`'s `uturn_sibling_refused_total` for `reason`.
fn refused(cluster: &Cluster, i: usize, reason: &str) -> f64 {
    cluster
        .metric(
            i,
            &format!("uturn_sibling_refused_total{{reason=\"{reason}\"}} "),
        )
        .unwrap_or(0.0)
}

/// Pod `i`'s `uturn_sibling_queries_total` for `outcome`.
fn queries(cluster: &Cluster, i: usize, outcome: &str) -> f64 {
    cluster
        .metric(
            i,
            &format!("uturn_sibling_queries_total{{outcome=\"{outcome}\"}} "),
        )
        .unwrap_or(0.0)
}

/// A UDP socket in pod `i`'s namespace, on its address: sends as that sibling would.
fn socket_in_pod(cluster: &Cluster, i: usize) -> UdpSocket {
    cluster.in_pod(i, || UdpSocket::bind((cluster.pod(i).ip, 0)).unwrap())
}

/// A call allocated through the VIP (on pod a) by turnperf's client, whose one socket
/// sends each request once: the client and its address (as every pod sees it).
fn bench_call(cluster: &Cluster, peer: &Peer) -> (uturn_perf::client::BenchClient, SocketAddr) {
    let (user, pass) = uturn_testkit::link::LINK_CREDS;
    let mut client = cluster
        .in_client(|| {
            uturn_perf::client::BenchClient::allocate_from(
                cluster.vip(),
                Some(cluster.client_ip().into()),
                user,
                pass,
                false,
            )
        })
        .unwrap_or_else(|e| panic!("allocation: {e}\n{}", cluster.describe()));
    assert_eq!(client.relay.ip(), IpAddr::from(cluster.pod(0).ip));
    client.create_permission(peer.addr).unwrap();
    client.bind_channel(0x4000, peer.addr).unwrap();
    let uturn_perf::client::Link::Udp(socket) = &client.socket else {
        unreachable!("a UDP client")
    };
    let addr = socket.local_addr().unwrap();
    (client, addr)
}

fn channel_data(payload: &[u8]) -> Vec<u8> {
    let mut frame = uturn_perf::client::channel_data_header(0x4000, payload.len()).to_vec();
    frame.extend_from_slice(payload);
    frame
}

/// A sibling message captured on the wire and sent again (a query forward for a real call,
/// sent 50 times from a sibling's address) is taken once: its datagram reaches the peer once,
/// the owner claims the client and answers once, and the 49 copies are refused as replayed.
#[test]
fn a_replayed_forward_is_relayed_and_claimed_once() {
    let mut cluster = Cluster::new(2);
    start_forwarding(&mut cluster);
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let (_client, client_addr) = bench_call(&cluster, &peer);
    // What pod b sends pod a when the client's flow moves to b: its ChannelData, as a query.
    let data = channel_data(b"replayed");
    let captured = seal(
        SIBLING_KEY.as_bytes(),
        &mut SiblingSender::new(0x7e57),
        &sibling_message(Kind::Forward, FLAG_QUERY, client_addr, &data),
    );
    let socket = socket_in_pod(&cluster, 1);
    let pod_a = SocketAddr::new(IpAddr::from(cluster.pod(0).ip), SIBLING_PORT);
    let relayed_before = peer.counts()[0];
    for _ in 0..50 {
        socket.send_to(&captured, pod_a).unwrap();
    }
    // The owner answers the sender: one claim, and the peer's echo returned through it.
    let answers = received(&socket, SIBLING_KEY, 1.5);
    let count = |kind| answers.iter().filter(|(k, _)| *k == kind).count();
    assert_eq!(
        (
            peer.counts()[0] - relayed_before,
            count(Kind::Claim),
            count(Kind::Return)
        ),
        (1, 1, 1),
        "(relayed to the peer, claims, returns) for 50 copies of one forward\n{}\n{}",
        cluster.describe(),
        sibling_metrics(&cluster)
    );
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || refused(&cluster, 0, "replayed") == 49.0),
        "{}",
        sibling_metrics(&cluster)
    );
}

/// A pod takes from its siblings only what it asked for or forwards: a Return naming a client
/// it forwards to no sibling is not sent to that address from its listener, and a Claim for a
/// client it asked nobody about does not steer that client's datagrams to the claimant. Both
/// come from a sibling's address under the gateway's key, and are dropped and counted.
#[test]
fn returns_and_claims_are_accepted_only_for_what_the_pod_asked() {
    let mut cluster = Cluster::new(2);
    start_forwarding(&mut cluster);
    let pod_a = SocketAddr::new(IpAddr::from(cluster.pod(0).ip), SIBLING_PORT);
    let (victim, moved) = cluster.in_client(|| {
        let bind = || UdpSocket::bind((cluster.client_ip(), 0)).unwrap();
        (bind(), bind())
    });
    let claimant = socket_in_pod(&cluster, 1);
    let mut sender = SiblingSender::new(0x5e17);
    let unasked_return = seal(
        SIBLING_KEY.as_bytes(),
        &mut sender,
        &sibling_message(Kind::Return, 0, victim.local_addr().unwrap(), b"injected"),
    );
    let unasked_claim = seal(
        SIBLING_KEY.as_bytes(),
        &mut sender,
        &sibling_message(Kind::Claim, 0, moved.local_addr().unwrap(), b""),
    );
    claimant.send_to(&unasked_return, pod_a).unwrap();
    claimant.send_to(&unasked_claim, pod_a).unwrap();
    // The claim is taken (or not) by now; then the "claimed" client sends to pod a.
    std::thread::sleep(Duration::from_millis(300));
    moved
        .send_to(&channel_data(b"steered?"), cluster.vip())
        .unwrap();
    victim
        .set_read_timeout(Some(Duration::from_secs(1)))
        .unwrap();
    let mut buf = [0u8; 2048];
    let injected = victim.recv(&mut buf).ok().map(|n| buf[..n].to_vec());
    assert_eq!(
        injected,
        None,
        "pod a sent an unasked Return's payload to the address it named\n{}",
        sibling_metrics(&cluster)
    );
    let steered = received(&claimant, SIBLING_KEY, 1.0);
    assert_eq!(
        steered,
        Vec::new(),
        "pod a forwarded to an unasked claimant\n{}",
        sibling_metrics(&cluster)
    );
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || refused(&cluster, 0, "unsolicited") == 2.0),
        "{}",
        sibling_metrics(&cluster)
    );
    // The moved client was asked about, as any unknown one (nobody claimed it).
    assert!(
        queries(&cluster, 0, "sent") >= 1.0,
        "{}",
        sibling_metrics(&cluster)
    );
}

/// How many times pod `i` logged that its key file changed.
fn key_changes(cluster: &mut Cluster, i: usize) -> usize {
    cluster
        .stunnerd(i)
        .logs()
        .matches("changed: current ")
        .count()
}

/// The sibling key rotates without a restart, one pod at a time (as the kubelet updates a
/// Secret's mount on each node in its own time): each pod's key file gets the new key as next,
/// then as current with the old one as next, then alone. A call forwarded from pod b to pod a
/// keeps flowing at every step, also while one pod sends under the new key and the other under
/// the old; at the end the old key is refused and the new one taken.
#[test]
fn a_rotated_key_keeps_two_pods_forwarding() {
    const OLD: &str = SIBLING_KEY;
    const NEW: &str = "the gateway's next key, 32 bytes";
    let mut cluster = Cluster::new(2);
    let files: Vec<String> = (0..2)
        .map(|i| {
            let file = uturn_testkit::stunnerd::temp_file(&format!("sibling-{i}.key"));
            std::fs::write(&file, format!("{OLD}\n")).unwrap();
            file.to_str().unwrap().to_owned()
        })
        .collect();
    let config = cluster.static_config();
    let siblings = format!("static:{},{}", cluster.pod(0).ip, cluster.pod(1).ip);
    for (i, file) in files.iter().enumerate() {
        cluster.start_pod(
            i,
            &config,
            &["--siblings", &siblings, "--sibling-key-file", file],
            &[],
        );
    }
    let (mut link, peer, relay) = call(&cluster);
    cluster.move_flow(1);
    let mut next = 0;
    mostly(&paced_call(&mut link, 0..25), 0..25, &cluster);
    let steps = [
        (1, format!("{OLD}\n{NEW}\n")),
        (0, format!("{OLD}\n{NEW}\n")),
        (1, format!("{NEW}\n{OLD}\n")),
        (0, format!("{NEW}\n{OLD}\n")),
        (1, format!("{NEW}\n")),
        (0, format!("{NEW}\n")),
    ];
    for (step, (pod, keys)) in steps.iter().enumerate() {
        let changes = key_changes(&mut cluster, *pod);
        std::fs::write(&files[*pod], keys).unwrap();
        assert!(
            uturn_testkit::stunnerd::wait_until(10, || key_changes(&mut cluster, *pod) > changes),
            "step {step}: pod {pod} did not take its new keys\n{}",
            cluster.describe()
        );
        next += 25;
        mostly(
            &paced_call(&mut link, next..next + 25),
            next..next + 25,
            &cluster,
        );
        link.request(turn_types::message::REFRESH, &|_, _| {})
            .unwrap_or_else(|code| {
                panic!(
                    "step {step}: Refresh: {code}\n{}\n{}",
                    cluster.describe(),
                    sibling_metrics(&cluster)
                )
            });
    }
    let senders: Vec<SocketAddr> = peer.senders().into_keys().collect();
    assert_eq!(senders, vec![relay]);
    // The old key is refused now; the new one is taken (a forward for a client pod a does not
    // hold is answered Gone).
    let socket = socket_in_pod(&cluster, 1);
    let pod_a = SocketAddr::new(IpAddr::from(cluster.pod(0).ip), SIBLING_PORT);
    let data = channel_data(b"x");
    let forward = sibling_message(Kind::Forward, 0, "192.0.2.1:4000".parse().unwrap(), &data);
    let mut sender = SiblingSender::new(0x01d);
    let unauthenticated = refused(&cluster, 0, "unauthenticated");
    socket
        .send_to(&seal(OLD.as_bytes(), &mut sender, &forward), pod_a)
        .unwrap();
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || refused(&cluster, 0, "unauthenticated")
            > unauthenticated),
        "{}",
        sibling_metrics(&cluster)
    );
    socket
        .send_to(&seal(NEW.as_bytes(), &mut sender, &forward), pod_a)
        .unwrap();
    let answers: Vec<Kind> = received(&socket, NEW, 1.0)
        .into_iter()
        .map(|(kind, _)| kind)
        .collect();
    assert_eq!(answers, vec![Kind::Gone], "{}", sibling_metrics(&cluster));
}

/// Misses spoofed from many source addresses (the client's own among them) spend the query
/// budget of unsigned datagrams at pod b; the moved call's Refresh, signed by its user, has a
/// budget of its own, and its one transmission finds the owner (pod a) and is answered.
#[test]
fn a_refresh_finds_its_owner_at_once_during_a_flood_of_spoofed_misses() {
    let mut cluster = Cluster::new(2);
    start_forwarding(&mut cluster);
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let (mut client, client_addr) = bench_call(&cluster, &peer);
    cluster.move_flow(1);
    let spoofer = cluster.spoofer();
    // 120 addresses, and the client's own for every fourth datagram (so that its source's
    // bucket is empty too); a new source port each round, so every miss is a new client.
    let mut sources: Vec<std::net::Ipv4Addr> = Vec::new();
    for i in 0..120 {
        sources.push(cluster.spoofed_ip(i));
        if i.is_multiple_of(3) {
            sources.push(cluster.client_ip());
        }
    }
    let SocketAddr::V4(vip) = cluster.vip() else {
        unreachable!("an IPv4 VIP")
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let stopped = stop.clone();
    let client_port = client_addr.port();
    let flood = std::thread::spawn(move || {
        let (mut sent, mut port) = (0u64, 1024u16);
        let data = channel_data(b"spoofed!");
        while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
            // About 10 000 a second, evenly: a pause between bursts would let the budgets
            // refill for whatever comes then.
            for _ in 0..10 {
                let source = sources[sent as usize % sources.len()];
                if (sent as usize).is_multiple_of(sources.len()) {
                    port = if port == u16::MAX { 1024 } else { port + 1 };
                    if port == client_port {
                        port += 1;
                    }
                }
                let _ = spoofer.send(SocketAddrV4::new(source, port), vip, &data);
                sent += 1;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        sent
    });
    // The flood has emptied the shard's unsigned budget.
    let drained =
        uturn_testkit::stunnerd::wait_until(10, || queries(&cluster, 1, "rate_limited") >= 3000.0);
    let refreshed = drained.then(|| client.delete());
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let sent = flood.join().unwrap();
    assert!(
        drained,
        "{sent} spoofed misses did not empty pod b's query budget\n{}",
        sibling_metrics(&cluster)
    );
    refreshed.unwrap().unwrap_or_else(|e| {
        panic!(
            "the moved call's Refresh, sent once during the flood: {e}\n{}\n{}",
            cluster.describe(),
            sibling_metrics(&cluster)
        )
    });
    assert!(
        uturn_testkit::stunnerd::wait_until(5, || cluster
            .status(0)
            .is_some_and(|s| s["allocationCount"] == 0)),
        "the Refresh (lifetime 0) did not reach pod a\n{}",
        cluster.describe()
    );
}

/// Issue 30: with the kernel offload on, a call whose flow moves to a sibling gets its
/// downstream media through that sibling, as without the offload. The owner's kernel entries
/// for the call go when the flow moves (they would send the peer's datagrams straight from the
/// owner to the client, whose NAT drops them behind a load balancer) and come back when the
/// flow does.
#[test]
fn with_the_offload_a_moved_call_gets_its_media_through_the_sibling() {
    let mut cluster = Cluster::new(2);
    start_forwarding_with(&mut cluster, &["--offload", "tc"]);
    let offloaded = |cluster: &Cluster| cluster.metric(0, "uturn_offload_channels ");
    let (mut link, _peer, relay) = call(&cluster);
    assert_eq!(relay.ip(), IpAddr::from(cluster.pod(0).ip));
    assert_eq!(paced_call(&mut link, 0..50), (0..50).collect::<Vec<_>>());
    assert_eq!(offloaded(&cluster), Some(1.0), "{}", cluster.describe());
    cluster.move_flow(1);
    mostly(&paced_call(&mut link, 50..150), 50..150, &cluster);
    assert_eq!(
        offloaded(&cluster),
        Some(0.0),
        "the owner kept its kernel entries for a client behind a sibling\n{}",
        cluster.describe()
    );
    // The flow comes back to its owner: straight again, and in the kernel again.
    cluster.move_flow(0);
    mostly(&paced_call(&mut link, 150..250), 150..250, &cluster);
    assert!(
        uturn_testkit::stunnerd::wait_until(3, || offloaded(&cluster) == Some(1.0)),
        "{}",
        cluster.describe()
    );
    assert_eq!(
        paced_call(&mut link, 250..300),
        (250..300).collect::<Vec<_>>()
    );
}

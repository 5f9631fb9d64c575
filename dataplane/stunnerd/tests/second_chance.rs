//! A client's UDP flow moved from one gateway pod to another, with real kernel networking:
//! network namespaces for the pods, the client and the media server, and a service VIP that
//! the node NATs to one pod and the test re-points (`uturn_testkit::cluster`, what kube-proxy
//! or a load balancer does when endpoints change). First the harness itself (a raw UDP flow
//! moves A → B → C → A, answered by whichever pod the VIP points at), then the baseline:
//! without forwarding between gateway pods, the move kills a TURN call.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};
use stun_proto::types::message::MessageWriteExt;
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
    let config = cluster.static_config();
    let ips: Vec<String> = cluster.pods().iter().map(|p| p.ip.to_string()).collect();
    let siblings = format!("static:{}", ips.join(","));
    cluster.start_pods(
        &config,
        &["--siblings", &siblings],
        &[("UTURN_SIBLING_KEY", SIBLING_KEY)],
    );
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
        let key = uturn_dataplane::proto::sibling::SiblingKey::new(key).unwrap();
        let message = uturn_dataplane::proto::sibling::SiblingMessage {
            kind: uturn_dataplane::proto::sibling::Kind::Forward,
            flags: uturn_dataplane::proto::sibling::FLAG_QUERY,
            client: "192.0.2.1:4000".parse().unwrap(),
            origin: None,
            listener: "udp",
            payload: &[0x40, 0, 0, 4, 1, 2, 3, 4],
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        let mut out = Vec::new();
        uturn_dataplane::proto::sibling::encode(&key, &message, now, &mut out).unwrap();
        out
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

//! A client's UDP flow moved from one gateway pod to another, with real kernel networking:
//! network namespaces for the pods, the client and the media server, and a service VIP that
//! the node NATs to one pod and the test re-points (`uturn_testkit::cluster`, what kube-proxy
//! or a load balancer does when endpoints change). First the harness itself (a raw UDP flow
//! moves A → B → C → A, answered by whichever pod the VIP points at), then the baseline:
//! without forwarding between gateway pods, the move kills a TURN call.

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::time::{Duration, Instant};
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

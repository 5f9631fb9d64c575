//! A datagram the kernel refuses on the way to a peer (a firewall's drop in the pod) is counted
//! apart from one dropped for want of room: `uturn_dropped_datagrams_total{reason="send_error"}`
//! is a fault of the path, `reason="send_failed"` a matter of load. The real stunnerd in a
//! network namespace (`uturn_testkit::cluster`), with an nftables output rule in the pod's
//! namespace that the test adds and removes (the namespace goes with the cluster).

use std::time::{Duration, Instant};
use uturn_perf::turncat::transport::Protocol;
use uturn_testkit::cluster::Cluster;
use uturn_testkit::link::TurnLink;
use uturn_testkit::peers::Peer;

const TABLE: &str = "uturn_test_path_fault";

/// `n` ChannelData on channel 0x4000, paced.
fn send(link: &mut TurnLink, n: usize) {
    for i in 0..n {
        link.send_channel_data(0x4000, format!("datagram {i}").as_bytes());
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Waits up to 3 s for `done`.
fn wait(done: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        if done() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    done()
}

#[test]
fn a_datagram_the_kernel_refuses_is_a_send_error_not_a_full_buffer() {
    let mut cluster = Cluster::new(1);
    let config = cluster.static_config();
    cluster.start_pods(&config, &[], &[]);
    let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
    let mut link = cluster.in_client(|| {
        TurnLink::connect(Protocol::Udp, cluster.vip()).expect("a UDP socket in the client")
    });
    link.allocate(false, false)
        .unwrap_or_else(|code| panic!("allocation: {code}\n{}", cluster.describe()));
    link.create_permission(peer.addr)
        .unwrap_or_else(|code| panic!("permission: {code}\n{}", cluster.describe()));
    link.bind_channel(0x4000, peer.addr)
        .unwrap_or_else(|code| panic!("channel: {code}\n{}", cluster.describe()));
    let dropped = |reason: &str| {
        cluster
            .metric(
                0,
                &format!("uturn_dropped_datagrams_total{{reason=\"{reason}\"}} "),
            )
            .unwrap_or(-1.0)
    };

    send(&mut link, 20);
    assert!(wait(|| peer.counts()[0] == 20), "{:?}", peer.counts());

    // The pod's firewall drops what it sends to the peer: the kernel refuses each datagram
    // (EPERM), which is a send error, not a full buffer.
    let nft = |rule: &str| {
        let args: Vec<&str> = std::iter::once("nft").chain(rule.split(' ')).collect();
        cluster.topology().run_in("pod-a", &args);
    };
    nft(&format!("add table inet {TABLE}"));
    nft(&format!(
        "add chain inet {TABLE} out {{ type filter hook output priority 0 ; }}"
    ));
    nft(&format!(
        "add rule inet {TABLE} out ip daddr {} udp dport {} drop",
        peer.addr.ip(),
        peer.addr.port()
    ));
    send(&mut link, 20);
    assert!(
        wait(|| dropped("send_error") >= 20.0),
        "send_error = {}\n{}",
        dropped("send_error"),
        cluster.describe()
    );
    assert_eq!(dropped("send_failed"), 0.0, "counted as a full buffer");
    assert_eq!(peer.counts()[0], 20, "the firewall let datagrams through");

    // The path mended: the same channel relays again.
    nft(&format!("delete table inet {TABLE}"));
    send(&mut link, 20);
    assert!(wait(|| peer.counts()[0] == 40), "{:?}", peer.counts());
    assert_eq!(dropped("send_error"), 20.0);
}

//! The kernel offload (`--offload tc`) with the real stunnerd: independent clients relay
//! byte-exact through the TC program, its counters reach the metrics, and everything that ends
//! a channel in user space (allocation expiry and delete, an endpoint removed from the config)
//! stops the kernel relaying it, checked on the wire. Where BPF is denied the server falls
//! back and says why. CI runs as root, which the program needs (CAP_BPF, CAP_NET_ADMIN).

use std::net::SocketAddr;
use std::time::Duration;
use uturn_testkit::link::{TurnLink, LINK_CREDS};
use uturn_testkit::netns::{Shape, Topology};
use uturn_testkit::peers::Peer;
use uturn_testkit::stunnerd::{
    free_port, http_get, metric, status, temp_dir, temp_file, wait_until, Stunnerd,
};
use uturn_testkit::turn_client::TurnClient;

/// A server with `--offload MODE` (and `extra` arguments), its health and metrics ports.
struct Server {
    server: Stunnerd,
    port: u16,
    health: u16,
    metrics: u16,
    config: std::path::PathBuf,
}

fn config_text(port: u16, health: u16, metrics: u16, endpoint: &str) -> String {
    config_on("127.0.0.1", port, health, metrics, endpoint)
}

/// The same with the listener, health and metrics servers on address `addr`.
fn config_on(addr: &str, port: u16, health: u16, metrics: u16, endpoint: &str) -> String {
    format!(
        "version: v1\nadmin: {{name: offload, healthcheck_endpoint: \"http://{addr}:{health}\", \
         metrics_endpoint: \"http://{addr}:{metrics}/metrics\"}}\n\
         auth: {{type: static, credentials: {{username: {}, password: {}}}}}\n\
         listeners: [{{name: udp, address: {addr}, port: {port}, routes: [media]}}]\n\
         clusters: [{{name: media, endpoints: [\"{endpoint}\"]}}]\n",
        LINK_CREDS.0, LINK_CREDS.1
    )
}

fn start(mode: &str, extra: &[&str], customize: impl FnOnce(&mut std::process::Command)) -> Server {
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let config = temp_file("offload.yaml");
    std::fs::write(&config, config_text(port, health, metrics, "127.0.0.1")).unwrap();
    let origin = format!("file://{}", config.display());
    let mut args = vec!["--offload", mode, "-c", &origin];
    args.extend_from_slice(extra);
    let server = Stunnerd::start_with(&[], &args, &[], customize);
    assert!(
        wait_until(10, || status(health).is_some()),
        "no /status: {}",
        server.logs()
    );
    Server {
        server,
        port,
        health,
        metrics,
        config,
    }
}

impl Server {
    fn addr(&self) -> SocketAddr {
        ([127, 0, 0, 1], self.port).into()
    }

    fn offload(&self) -> serde_json::Value {
        status(self.health)
            .map(|s| s["offload"].clone())
            .unwrap_or_default()
    }

    fn offloaded(&self, direction: &str) -> u64 {
        metric(
            self.metrics,
            &format!("uturn_offloaded_packets_total{{direction=\"{direction}\"}} "),
        )
        .unwrap_or(0.0) as u64
    }

    fn channels(&self) -> u64 {
        metric(self.metrics, "uturn_offload_channels ").unwrap_or(0.0) as u64
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

/// `n` payloads of 1 to 1 200 bytes, each different from the others.
fn payloads(n: usize) -> Vec<Vec<u8>> {
    (0..n)
        .map(|i| {
            (0..1 + (i * 367) % 1200)
                .map(|j| (j * 7 + i) as u8)
                .collect()
        })
        .collect()
}

#[test]
fn turn_client_proto_relays_byte_exact_through_the_kernel_and_the_metrics_count_it() {
    let s = start("tc", &[], |_| {});
    assert_eq!(s.offload()["running"], "tc", "{}", s.server.logs());
    let peer = Peer::start();
    let mut client = TurnClient::new(s.addr(), LINK_CREDS.0, LINK_CREDS.1);
    client.allocate().expect("allocation");
    assert!(client.bind(peer.addr), "channel refused");
    assert!(
        wait_until(5, || s.channels() == 1),
        "channel not offloaded: {}",
        s.server.logs()
    );
    let sent = payloads(200);
    for payload in &sent {
        client.send(peer.addr, payload);
        client.drive(0.001);
    }
    assert!(wait_until(5, || {
        client.drive(0.05);
        client.received.len() >= sent.len()
    }));
    let mut echoed: Vec<Vec<u8>> = client
        .received
        .iter()
        .map(|(from, data)| {
            assert_eq!(*from, peer.addr);
            data.clone()
        })
        .collect();
    let mut expected = sent.clone();
    echoed.sort();
    expected.sort();
    assert_eq!(echoed, expected, "not byte-exact through the kernel");
    // The kernel relayed all of it (the shard reads its counters once a second), and the
    // listener and cluster counters include it as if the shard had.
    let bytes: u64 = sent.iter().map(|p| p.len() as u64).sum();
    assert!(
        wait_until(5, || s.offloaded("to_peer") == 200
            && s.offloaded("to_client") == 200),
        "offloaded {} / {}",
        s.offloaded("to_peer"),
        s.offloaded("to_client")
    );
    assert_eq!(peer.counts()[..2], [200, bytes]);
    let cluster = |d: &str| {
        metric(
            s.metrics,
            &format!("stunner_cluster_bytes_total{{direction=\"{d}\",name=\"media\"}} "),
        )
        .unwrap_or(0.0) as u64
    };
    assert_eq!((cluster("tx"), cluster("rx")), (bytes, bytes));
    let listener_tx = metric(
        s.metrics,
        "stunner_listener_bytes_total{direction=\"tx\",name=\"udp\"} ",
    )
    .unwrap_or(0.0) as u64;
    // ChannelData back to the client: 4 header bytes per datagram, besides the responses.
    assert!(listener_tx >= bytes + 4 * 200, "{listener_tx}");
}

#[test]
fn uclient_channel_mode_relays_through_the_kernel() {
    let s = start("tc", &[], |_| {});
    let peer_port = free_port();
    let _peer = uturn_testkit::stunnerd::Killed(
        std::process::Command::new("turnutils_peer")
            .args(["-p", &peer_port.to_string(), "-L", "127.0.0.1"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("turnutils_peer (apt-get install coturn)"),
    );
    let peer_port = peer_port.to_string();
    let (sent, received, text) = uturn_testkit::stunnerd::uclient(
        60,
        &[
            "-c",
            "-n",
            "50",
            "-l",
            "170",
            "-u",
            LINK_CREDS.0,
            "-w",
            LINK_CREDS.1,
            "-p",
            &s.port.to_string(),
            "-e",
            "127.0.0.1",
            "-r",
            &peer_port,
            "127.0.0.1",
        ],
    );
    assert!(sent > 0, "nothing sent:\n{text}");
    assert_eq!(received, sent, "lost datagrams:\n{text}");
    // uclient's messages went through the kernel (its first ones may precede the binding's
    // install by a round trip, so not necessarily all of them).
    assert!(
        wait_until(5, || s.offloaded("to_peer") >= sent / 2
            && s.offloaded("to_client") >= sent / 2),
        "sent {sent}, offloaded {} / {}",
        s.offloaded("to_peer"),
        s.offloaded("to_client")
    );
}

/// A TurnLink with a channel `0x4000` bound to `peer`, on an allocation of `lifetime` seconds
/// (the server's default if `None`).
fn channel_to(server: SocketAddr, peer: SocketAddr, lifetime: Option<u32>) -> TurnLink {
    use stun_proto::types::message::MessageWriteExt as _;
    let mut link =
        TurnLink::connect(uturn_perf::turncat::transport::Protocol::Udp, server).unwrap();
    link.request(turn_types::message::ALLOCATE, &|m, txid| {
        uturn_perf::client::udp_transport(m, txid);
        if let Some(seconds) = lifetime {
            m.add_attribute(&turn_types::attribute::Lifetime::new(seconds))
                .unwrap();
        }
    })
    .expect("allocation");
    link.bind_channel(0x4000, peer).expect("channel");
    link
}

/// Sends `n` ChannelData datagrams on channel 0x4000 and waits a moment: how many echoes came
/// back.
fn echoes(link: &mut TurnLink, n: usize) -> usize {
    link.channel_data.clear();
    for i in 0..n {
        link.send_channel_data(0x4000, format!("datagram {i}").as_bytes());
    }
    link.drain(0.5);
    link.channel_data.len()
}

#[test]
fn allocation_expiry_and_delete_stop_kernel_forwarding_on_the_wire() {
    let s = start("tc", &[], |_| {});
    let peer = Peer::start();
    // Expiry: a 3-second allocation, never refreshed.
    let mut expiring = channel_to(s.addr(), peer.addr, Some(3));
    assert!(wait_until(5, || s.channels() == 1));
    assert_eq!(echoes(&mut expiring, 10), 10);
    std::thread::sleep(Duration::from_millis(3_200));
    let before = peer.counts()[0];
    assert_eq!(
        echoes(&mut expiring, 10),
        0,
        "relayed after the allocation expired"
    );
    assert_eq!(
        peer.counts()[0],
        before,
        "the peer got datagrams after expiry"
    );
    assert!(
        wait_until(5, || s.channels() == 0),
        "entries left after expiry"
    );
    // Delete: Refresh with LIFETIME 0.
    let mut deleted = channel_to(s.addr(), peer.addr, None);
    assert!(wait_until(5, || s.channels() == 1));
    assert_eq!(echoes(&mut deleted, 10), 10);
    assert!(s.offloaded("to_peer") <= 20);
    assert!(
        wait_until(5, || s.offloaded("to_peer") == 20),
        "{}",
        s.offloaded("to_peer")
    );
    {
        use stun_proto::types::message::MessageWriteExt as _;
        deleted
            .request(turn_types::message::REFRESH, &|m, _| {
                m.add_attribute(&turn_types::attribute::Lifetime::new(0))
                    .unwrap();
            })
            .expect("delete");
    }
    assert!(
        wait_until(2, || s.channels() == 0),
        "entries left after the delete"
    );
    let before = peer.counts()[0];
    assert_eq!(
        echoes(&mut deleted, 10),
        0,
        "relayed after the allocation was deleted"
    );
    assert_eq!(peer.counts()[0], before);
}

#[test]
fn an_endpoint_removed_from_the_config_stops_kernel_forwarding_within_one_reconcile() {
    let s = start("tc", &["-w"], |_| {});
    let peer = Peer::start();
    let mut link = channel_to(s.addr(), peer.addr, None);
    assert!(wait_until(5, || s.channels() == 1));
    assert_eq!(echoes(&mut link, 10), 10);
    // The cluster no longer holds the peer's address.
    let text = std::fs::read_to_string(&s.config).unwrap();
    std::fs::write(
        &s.config,
        text.replace("\"127.0.0.1\"]", "\"10.99.99.99\"]"),
    )
    .unwrap();
    assert!(
        wait_until(10, || s.channels() == 0),
        "entry kept after the endpoint went: {}",
        s.server.logs()
    );
    let before = peer.counts()[0];
    assert_eq!(
        echoes(&mut link, 10),
        0,
        "relayed to a peer no cluster admits"
    );
    assert_eq!(peer.counts()[0], before);
}

#[test]
fn offload_tc_under_a_filter_that_denies_bpf_falls_back_with_the_cause_and_auto_serves() {
    for mode in ["tc", "auto"] {
        let s = start(mode, &[], uturn_testkit::stunnerd::denying(libc::SYS_bpf));
        let offload = s.offload();
        assert_eq!(offload["running"], "none", "{mode}: {offload}");
        let reason = offload["reason"].as_str().unwrap_or_default().to_owned();
        assert!(
            reason.contains("Operation not permitted") && reason.contains("CAP_BPF"),
            "{mode}: {reason}"
        );
        assert!(
            s.server.logs().contains("offload: none"),
            "{mode}: {}",
            s.server.logs()
        );
        // It serves, in user space.
        let peer = Peer::start();
        let mut link = channel_to(s.addr(), peer.addr, None);
        assert_eq!(echoes(&mut link, 10), 10, "{mode}");
        assert_eq!(s.offloaded("to_peer"), 0);
    }
}

#[test]
fn a_drain_counts_offloaded_calls_and_exits_when_they_end() {
    let mut s = start("tc", &[], |_| {});
    let peer = Peer::start();
    let mut link = channel_to(s.addr(), peer.addr, Some(4));
    assert!(wait_until(5, || s.channels() == 1));
    s.server.signal(libc::SIGTERM);
    // Draining: the call goes on through the kernel, and is counted.
    assert_eq!(echoes(&mut link, 10), 10);
    assert!(
        wait_until(3, || s.offloaded("to_peer") >= 10),
        "{}",
        s.offloaded("to_peer")
    );
    assert_eq!(s.server.wait_exit_for(10.0), Some(0), "{}", s.server.logs());
}

/// The shape of a pod on a node: network namespaces for the gateway pod, a client and a media
/// server (the peer), each joined by a veth pair to a "node" namespace that routes between
/// them, the veths' checksum offloads on (`checksum_offload`) or off: off, every end computes
/// and verifies checksums in software, so a datagram the program rewrote with a wrong checksum
/// is dropped by its receiver and counted. Removed (with everything running in it) on drop.
fn pod_shape(checksum_offload: bool) -> Topology {
    Shape::new("uo")
        .router("node", &["pod", "client", "peer"])
        .checksum_offload(checksum_offload)
        .build()
}

/// `GET path` on `addr` from inside namespace `role`: the body, empty on failure.
fn get(shape: &Topology, role: &str, addr: SocketAddr, path: &str) -> String {
    shape
        .http_get(role, addr, path)
        .map(|(_, body)| body)
        .unwrap_or_default()
}

/// A stunnerd in the pod namespace of `shape` with `--offload MODE`, relaying to its echo peer.
struct PodServer {
    server: Stunnerd,
    port: u16,
    peer_port: u16,
    metrics: SocketAddr,
    health: SocketAddr,
    config: std::path::PathBuf,
}

impl PodServer {
    fn start(shape: &mut Topology, mode: &str) -> PodServer {
        let peer_port = shape.echo_peer("peer", free_port()).port();
        let (port, metrics, health) = (free_port(), free_port(), free_port());
        let config = temp_file("offload-pod.yaml");
        let (pod, peer) = (shape.ip("pod").to_string(), shape.ip("peer").to_string());
        std::fs::write(&config, config_on(&pod, port, health, metrics, &peer)).unwrap();
        let server = Stunnerd::start_under(
            &shape.exec("pod"),
            &[
                "--offload",
                mode,
                "-c",
                &format!("file://{}", config.display()),
            ],
            &[],
        );
        let (metrics, health) = (
            (shape.ip("pod"), metrics).into(),
            (shape.ip("pod"), health).into(),
        );
        assert!(
            wait_until(10, || get(shape, "pod", metrics, "/metrics")
                .contains("uturn_offload_channels")),
            "{}",
            server.logs()
        );
        PodServer {
            server,
            port,
            peer_port,
            metrics,
            health,
            config,
        }
    }

    /// `/status`'s `offload` object.
    fn offload(&self, shape: &Topology) -> serde_json::Value {
        serde_json::from_str::<serde_json::Value>(&get(shape, "pod", self.health, "/status"))
            .map(|s| s["offload"].clone())
            .unwrap_or_default()
    }

    fn offloaded(&self, shape: &Topology, direction: &str) -> u64 {
        metric_in(
            shape,
            "pod",
            self.metrics,
            &format!("uturn_offloaded_packets_total{{direction=\"{direction}\"}} "),
        )
    }

    /// coturn's uclient in the client namespace, channel mode, `n` messages of 500 bytes:
    /// (sent, received, its output).
    fn uclient(&self, shape: &Topology, n: u32) -> (u64, u64, String) {
        let (port, peer_port, n) = (
            self.port.to_string(),
            self.peer_port.to_string(),
            n.to_string(),
        );
        let (pod, peer) = (shape.ip("pod").to_string(), shape.ip("peer").to_string());
        uturn_testkit::stunnerd::uclient_under(
            &shape.exec("client"),
            60,
            &[
                "-c",
                "-n",
                &n,
                "-l",
                "500",
                "-u",
                LINK_CREDS.0,
                "-w",
                LINK_CREDS.1,
                "-p",
                &port,
                "-e",
                &peer,
                "-r",
                &peer_port,
                &pod,
            ],
        )
    }
}

impl Drop for PodServer {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

/// Relays uclient's 100 messages through `pod`: none lost, at least half of each direction
/// offloaded, no UDP checksum error anywhere. The count sent.
fn relay_checked(shape: &Topology, pod: &PodServer) -> u64 {
    let errors_before: Vec<u64> = ["client", "peer", "pod"]
        .iter()
        .map(|r| shape.checksum_errors(r))
        .collect();
    let (sent, received, text) = pod.uclient(shape, 100);
    assert!(sent > 0, "nothing sent:\n{text}\n{}", pod.server.logs());
    assert_eq!(received, sent, "lost datagrams:\n{text}");
    assert!(
        wait_until(5, || pod.offloaded(shape, "to_peer") >= sent / 2
            && pod.offloaded(shape, "to_client") >= sent / 2),
        "sent {sent}, offloaded {} / {}",
        pod.offloaded(shape, "to_peer"),
        pod.offloaded(shape, "to_client")
    );
    let errors_after: Vec<u64> = ["client", "peer", "pod"]
        .iter()
        .map(|r| shape.checksum_errors(r))
        .collect();
    assert_eq!(
        errors_after, errors_before,
        "UDP checksum errors (client, peer, pod)"
    );
    sent
}

#[test]
fn relays_through_the_kernel_between_namespaces_shaped_like_a_pod_with_valid_checksums() {
    let mut shape = pod_shape(false);
    let pod = PodServer::start(&mut shape, "tc");
    assert!(
        pod.server.logs().contains("offload: tc"),
        "{}",
        pod.server.logs()
    );
    relay_checked(&shape, &pod);
}

/// The pod's interface's count of frames its XDP program sent back out (`ethtool -S`).
fn xdp_tx(shape: &Topology) -> u64 {
    shape
        .run_in("pod", &["ethtool", "-S", shape.dev("pod")])
        .lines()
        .filter_map(|l| l.trim().strip_prefix("rx_queue_"))
        .filter_map(|l| l.split_once("_xdp_tx: "))
        .filter_map(|(_, v)| v.trim().parse::<u64>().ok())
        .sum()
}

#[test]
fn xdp_relays_in_the_driver_of_a_pods_veth_with_valid_checksums() {
    // Checksum offloads on (a veth's default): datagrams arrive with partial checksums, which
    // the XDP program cannot tell from complete ones; it computes them whole.
    let mut shape = pod_shape(true);
    shape.xdp_pass_on_gateway("pod");
    let pod = PodServer::start(&mut shape, "xdp");
    let offload = pod.offload(&shape);
    assert_eq!(
        offload["running"],
        "xdp",
        "{offload}\n{}",
        pod.server.logs()
    );
    assert_eq!(
        offload["xdp_interfaces"],
        serde_json::json!([shape.dev("pod")]),
        "{offload}"
    );
    let tx_before = xdp_tx(&shape);
    relay_checked(&shape, &pod);
    // Both legs of the offloaded traffic left through XDP_TX, not through TC.
    let offloaded = pod.offloaded(&shape, "to_peer") + pod.offloaded(&shape, "to_client");
    let tx = xdp_tx(&shape) - tx_before;
    assert!(
        tx >= offloaded,
        "XDP sent {tx} of {offloaded} offloaded datagrams\n{}",
        pod.server.logs()
    );
    // Killed (SIGKILL), the server leaves no XDP program on the interface.
    drop(pod);
    let link = shape.run_in("pod", &["ip", "link", "show", shape.dev("pod")]);
    assert!(!link.contains("xdp"), "{link}");
}

#[test]
fn xdp_on_a_veth_whose_peer_drops_what_it_sends_gives_way_to_tc() {
    // A veth's default: no XDP program (and no GRO) on the node's side, so no NAPI there, and
    // every frame the pod's XDP program sends back out is dropped. The server sees the drops, takes XDP off
    // within a second, says why, and TC relays from then on.
    let mut shape = pod_shape(true);
    let pod = PodServer::start(&mut shape, "xdp");
    assert_eq!(
        pod.offload(&shape)["running"],
        "xdp",
        "{}",
        pod.server.logs()
    );
    let _ = pod.uclient(&shape, 20);
    assert!(
        wait_until(5, || pod.server.logs().contains("XDP taken off")),
        "{}",
        pod.server.logs()
    );
    let offload = pod.offload(&shape);
    assert_eq!(offload["running"], "tc", "{offload}");
    assert_eq!(
        offload["xdp_interfaces"],
        serde_json::json!([]),
        "{offload}"
    );
    let before = pod.offloaded(&shape, "to_peer");
    let (sent, received, text) = pod.uclient(&shape, 100);
    assert!(sent > 0, "nothing sent:\n{text}\n{}", pod.server.logs());
    assert_eq!(received, sent, "lost datagrams after XDP gave way:\n{text}");
    assert!(
        wait_until(5, || pod.offloaded(&shape, "to_peer") >= before + sent / 2),
        "TC did not take over: {} offloaded before, {} after, {sent} sent",
        before,
        pod.offloaded(&shape, "to_peer")
    );
}

/// What the deploy overlay grants (deploy/overlays/offload): a root process whose bounding set
/// holds CAP_BPF and CAP_NET_ADMIN and nothing else loads, attaches and relays. (A program
/// that needs more, say CAP_PERFMON for pointer arithmetic, fails here.)
#[test]
fn the_offload_runs_with_exactly_cap_bpf_and_cap_net_admin() {
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let config = temp_file("offload-caps.yaml");
    std::fs::write(&config, config_text(port, health, metrics, "127.0.0.1")).unwrap();
    let server = Stunnerd::start_under(
        &[
            "setpriv",
            "--bounding-set=-all,+bpf,+net_admin",
            "--inh-caps=-all",
        ],
        &[
            "--offload",
            "tc",
            "-c",
            &format!("file://{}", config.display()),
        ],
        &[],
    );
    assert!(
        wait_until(10, || status(health).is_some()),
        "{}",
        server.logs()
    );
    let offload = status(health).unwrap()["offload"].clone();
    assert_eq!(offload["running"], "tc", "{offload}\n{}", server.logs());
    let peer = Peer::start();
    let mut link = channel_to(([127, 0, 0, 1], port).into(), peer.addr, None);
    // No wait: the entry is installed before the ChannelBind's answer leaves, so even the
    // first ChannelData goes through the kernel.
    assert_eq!(echoes(&mut link, 10), 10);
    let offloaded = || {
        metric(
            metrics,
            "uturn_offloaded_packets_total{direction=\"to_peer\"} ",
        )
        .unwrap_or(0.0)
    };
    assert!(wait_until(5, || offloaded() == 10.0), "{}", offloaded());
    let _ = std::fs::remove_file(&config);
}

/// The ids of the BPF programs process `pid` holds, from its descriptors' fdinfo.
fn bpf_programs_of(pid: u32) -> Vec<u32> {
    let mut ids = Vec::new();
    for fd in std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
    {
        let target = std::fs::read_link(fd.path()).unwrap_or_default();
        if !target.to_string_lossy().contains("bpf-prog") {
            continue;
        }
        let info = std::fs::read_to_string(format!(
            "/proc/{pid}/fdinfo/{}",
            fd.file_name().to_string_lossy()
        ))
        .unwrap_or_default();
        ids.extend(
            info.lines()
                .filter_map(|l| l.strip_prefix("prog_id:"))
                .filter_map(|v| v.trim().parse::<u32>().ok()),
        );
    }
    ids
}

/// Whether BPF program `id` still exists (BPF_PROG_GET_FD_BY_ID).
fn bpf_program_exists(id: u32) -> bool {
    let mut attr = [0u8; 128];
    attr[..4].copy_from_slice(&id.to_ne_bytes());
    // SAFETY: BPF_PROG_GET_FD_BY_ID (13) reads the id from a zeroed attribute of this size.
    let fd = unsafe { libc::syscall(libc::SYS_bpf, 13, attr.as_mut_ptr(), attr.len() as u32) };
    if fd >= 0 {
        // SAFETY: a descriptor the kernel just gave us.
        unsafe { libc::close(fd as i32) };
    }
    fd >= 0
}

#[test]
fn a_killed_server_leaves_no_program_behind_and_the_next_one_attaches() {
    let mut ids = Vec::new();
    for round in 0..2 {
        let s = start("tc", &[], |_| {});
        assert_eq!(
            s.offload()["running"],
            "tc",
            "round {round}: {}",
            s.server.logs()
        );
        let held = bpf_programs_of(s.server.pid());
        assert!(!held.is_empty(), "round {round}: no BPF program held");
        assert!(held.iter().all(|&id| bpf_program_exists(id)));
        let peer = Peer::start();
        let mut link = channel_to(s.addr(), peer.addr, None);
        assert!(wait_until(5, || s.channels() == 1));
        assert_eq!(echoes(&mut link, 10), 10);
        assert!(
            wait_until(3, || s.offloaded("to_peer") == 10),
            "round {round}"
        );
        ids.extend(held);
        // SIGKILL: no chance to clean up; the kernel detaches and frees it all.
        drop(s);
        assert!(
            wait_until(5, || ids.iter().all(|&id| !bpf_program_exists(id))),
            "round {round}: programs {ids:?} outlived their process"
        );
    }
}

/// With `--state-dir`, a call carried over a `kill -9` is relayed in the kernel again by the
/// next process: the adopted allocation's channel is offloaded anew, and the new process's
/// counters see the kernel relay its datagrams.
#[test]
fn a_call_carried_over_a_kill_by_the_state_directory_is_relayed_in_the_kernel_again() {
    let state = temp_dir("offload-state").join("state");
    let state_arg = state.to_str().unwrap().to_owned();
    let mut s = start("tc", &["--state-dir", &state_arg], |_| {});
    assert_eq!(s.offload()["running"], "tc", "{}", s.server.logs());
    let peer = Peer::start();
    let mut link = channel_to(s.addr(), peer.addr, None);
    assert!(wait_until(5, || s.channels() == 1));
    assert_eq!(echoes(&mut link, 10), 10);
    assert!(wait_until(3, || s.offloaded("to_peer") == 10));
    s.server.signal(libc::SIGKILL);
    s.server.wait_exit_for(5.0);
    let origin = format!("file://{}", s.config.display());
    let args = ["--offload", "tc", "-c", &origin, "--state-dir", &state_arg];
    s.server = Stunnerd::start_with(&[], &args, &[], |_| {});
    let health = s.health;
    assert!(
        wait_until(10, || http_get(health, "/ready")
            .is_some_and(|(c, _)| c == 200)),
        "{}",
        s.server.logs()
    );
    assert!(wait_until(5, || s.channels() == 1), "{}", s.server.logs());
    assert_eq!(echoes(&mut link, 10), 10, "{}", s.server.logs());
    assert!(
        wait_until(3, || s.offloaded("to_peer") == 10),
        "the kernel did not relay the carried call: {}",
        s.server.logs()
    );
    let _ = std::fs::remove_dir_all(state.parent().unwrap());
}

/// A client that refreshes as fast as it likes (here 2 000 CreatePermissions on a channel's
/// peer, each extending the channel's entry) costs the kernel map at most a write per channel
/// per second: the extension waits for the shard's next counter read. Counted with strace on
/// the server's `bpf(2)` calls.
#[test]
fn refreshing_as_fast_as_possible_writes_the_map_once_a_second_at_most() {
    let s = start("tc", &[], |_| {});
    let peer = Peer::start();
    let mut link = channel_to(s.addr(), peer.addr, None);
    assert!(wait_until(5, || s.channels() == 1));
    let trace = temp_file("offload-strace.txt");
    let mut strace = uturn_testkit::stunnerd::Killed(
        std::process::Command::new("strace")
            .args(["-f", "-qq", "-e", "trace=bpf", "-o"])
            .arg(&trace)
            .args(["-p", &s.server.pid().to_string()])
            .spawn()
            .expect("strace (apt-get install strace)"),
    );
    // strace attaches to every thread before the storm starts.
    std::thread::sleep(Duration::from_millis(500));
    let started = std::time::Instant::now();
    for _ in 0..2_000 {
        link.create_permission(peer.addr).expect("permission");
    }
    let storm = started.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    // SAFETY: SIGINT to the strace this test started, so it writes out what it traced.
    unsafe {
        libc::kill(strace.0.id() as i32, libc::SIGINT);
    }
    let _ = strace.0.wait();
    let traced = std::fs::read_to_string(&trace).unwrap_or_default();
    let _ = std::fs::remove_file(&trace);
    let writes = traced.matches("BPF_MAP_UPDATE_ELEM").count();
    // Two maps per write, one write per counter read (once a second), and slack for one more.
    let bound = 2 * (storm.as_secs() as usize + 2);
    assert!(
        writes <= bound,
        "{writes} map writes for 2 000 refreshes in {storm:?} (bound {bound})"
    );
    // The channel still relays, through the kernel.
    assert_eq!(echoes(&mut link, 10), 10);
    assert!(wait_until(3, || s.offloaded("to_peer") >= 10));
}

/// The offload is chosen at start. A config that asks for another later (admin.offload_engine
/// from the config origin, without --offload) gets a warning naming it, and the running
/// choice stays.
#[test]
fn a_reload_asking_for_another_offload_is_told_to_restart() {
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let config = temp_file("offload-reload.yaml");
    std::fs::write(&config, config_text(port, health, metrics, "127.0.0.1")).unwrap();
    let server = Stunnerd::start(&["-w", "-c", &format!("file://{}", config.display())], &[]);
    assert!(
        wait_until(10, || status(health).is_some()),
        "{}",
        server.logs()
    );
    assert_eq!(status(health).unwrap()["offload"]["running"], "none");
    assert!(
        server
            .logs()
            .contains("offload: none (--offload none (the default)"),
        "{}",
        server.logs()
    );
    let text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(
        &config,
        text.replace(
            "admin: {name: offload,",
            "admin: {name: offload, offload_engine: TC,",
        ),
    )
    .unwrap();
    assert!(
        wait_until(10, || server
            .logs()
            .contains("restart stunnerd to change it")),
        "{}",
        server.logs()
    );
    assert_eq!(status(health).unwrap()["offload"]["running"], "none");
    let _ = std::fs::remove_file(&config);
}

/// A gateway in the node namespace of `shape` (a hostNetwork pod on a node that routes for
/// its pods), `--offload tc`, its listener advertising the node's address toward the client,
/// its cluster the peer; (server, listener port, metrics address, config file).
fn node_gateway(
    shape: &Topology,
    envs: &[(&str, &str)],
) -> (Stunnerd, u16, SocketAddr, std::path::PathBuf) {
    let toward_client = shape.gateway("client").to_string();
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let config = temp_file("offload-node.yaml");
    std::fs::write(
        &config,
        config_on(
            &toward_client,
            port,
            health,
            metrics,
            &shape.ip("peer").to_string(),
        ),
    )
    .unwrap();
    let server = Stunnerd::start_under(
        &shape.exec("node"),
        &[
            "--offload",
            "tc",
            "-c",
            &format!("file://{}", config.display()),
        ],
        envs,
    );
    let metrics = (shape.gateway("client"), metrics).into();
    assert!(
        wait_until(10, || get(shape, "node", metrics, "/metrics")
            .contains("uturn_offload_channels")),
        "{}",
        server.logs()
    );
    (server, port, metrics, config)
}

/// The value of metric line `name ` on the `/metrics` page at `addr`, from namespace `role`.
fn metric_in(shape: &Topology, role: &str, addr: SocketAddr, name: &str) -> u64 {
    get(shape, role, addr, "/metrics")
        .lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// A UDP socket bound to `port` of `role`'s address, reading with a short timeout.
fn socket_in(shape: &Topology, role: &str, port: u16) -> std::net::UdpSocket {
    let socket = shape.udp_socket(role, port);
    socket
        .set_read_timeout(Some(Duration::from_millis(300)))
        .unwrap();
    socket
}

/// What `socket` receives until it has been quiet for its timeout.
fn drain(socket: &std::net::UdpSocket) -> Vec<Vec<u8>> {
    let mut got = Vec::new();
    let mut buf = [0u8; 2048];
    while let Ok(n) = socket.recv(&mut buf) {
        got.push(buf[..n].to_vec());
    }
    got
}

/// A client in the client namespace of `shape` with an allocation on the node gateway at
/// `port` and a channel bound to `peer`, installed in the kernel.
fn node_client(shape: &Topology, port: u16, peer: SocketAddr, metrics: SocketAddr) -> TurnClient {
    let (client_ip, gateway) = (shape.ip("client"), shape.gateway("client"));
    let mut client = shape.in_ns("client", || {
        TurnClient::on(
            (client_ip, 0).into(),
            (gateway, port).into(),
            LINK_CREDS.0,
            LINK_CREDS.1,
            &[turn_types::AddressFamily::IPV4],
        )
    });
    assert!(client.allocate().is_some(), "{:?}", client.events);
    assert!(client.bind(peer), "{:?}", client.events);
    assert!(
        wait_until(5, || metric_in(
            shape,
            "node",
            metrics,
            "uturn_offload_channels "
        ) == 1),
        "the channel was not offloaded"
    );
    client
}

/// Issue 30: a gateway that routes (a hostNetwork pod on a node forwarding for the node's
/// pods) relays in the kernel only what is addressed to it. A peer's datagram to another host
/// on a port equal to a relay port reaches that host, and a client's ChannelData to another
/// host on the listener port reaches that host, as without the offload; before the entries'
/// keys held the destination address, both went into the relay (to the TURN client, to the
/// peer). What is addressed to the gateway still relays through the kernel.
#[test]
fn a_routing_gateway_relays_in_the_kernel_only_what_is_addressed_to_it() {
    let shape = pod_shape(false);
    let (server, port, metrics, config) = node_gateway(&shape, &[]);
    let relay_side = shape.gateway("peer");
    let peer_socket = socket_in(&shape, "peer", free_port());
    let peer = peer_socket.local_addr().unwrap();
    let mut client = node_client(&shape, port, peer, metrics);
    let relay_port = client.relayed()[0].port();
    // The other host: the pod namespace behind the node, with sockets on the relay port and
    // on the listener port.
    let other = shape.ip("pod");
    let other_relay = socket_in(&shape, "pod", relay_port);
    let other_listener = socket_in(&shape, "pod", port);

    // Peer → another host on the relay port: that host gets it, the client nothing.
    peer_socket
        .send_to(b"for the other host", (other, relay_port))
        .unwrap();
    assert_eq!(drain(&other_relay), [b"for the other host".to_vec()]);
    client.drive(0.3);
    assert!(client.received.is_empty(), "{:?}", client.received);

    // Client → another host on the listener port, ChannelData of the bound channel: that host
    // gets it as sent, the peer nothing.
    let mut data = vec![0x40, 0x00, 0x00, 0x05];
    data.extend_from_slice(b"hello");
    client.send_raw_to((other, port).into(), &data);
    assert_eq!(drain(&other_listener), [data.clone()]);
    assert!(drain(&peer_socket).is_empty());
    let before = metric_in(
        &shape,
        "node",
        metrics,
        "uturn_offloaded_packets_total{direction=\"to_client\"} ",
    );

    // Addressed to the gateway, both directions relay, through the kernel.
    peer_socket
        .send_to(b"to the client", (relay_side, relay_port))
        .unwrap();
    client.drive(0.5);
    assert_eq!(client.received, [(peer, b"to the client".to_vec())]);
    client.send(peer, b"to the peer");
    assert_eq!(drain(&peer_socket), [b"to the peer".to_vec()]);
    assert!(
        wait_until(3, || metric_in(
            &shape,
            "node",
            metrics,
            "uturn_offloaded_packets_total{direction=\"to_client\"} "
        ) > before),
        "{}",
        server.logs()
    );
    let _ = std::fs::remove_file(config);
}

/// Issue 30: "is this address one of this host's own" is what the routing table says, not
/// what bind(2) allows. With net.ipv4.ip_nonlocal_bind=1 (keepalived, kube-vip, MetalLB-style
/// nodes) bind(2) succeeds for any address; before, every peer looked local, and every
/// offloaded channel was sent into the loopback and lost while the metrics counted it relayed.
#[test]
fn with_nonlocal_bind_offloaded_channels_still_reach_their_peers() {
    let mut shape = pod_shape(false);
    shape.run_in("pod", &["sysctl", "-qw", "net.ipv4.ip_nonlocal_bind=1"]);
    let pod = PodServer::start(&mut shape, "tc");
    relay_checked(&shape, &pod);
}

/// Issue 30: a full channel map (here `UTURN_OFFLOAD_MAX_CHANNELS=2`) is one WARN with the
/// count of failed writes, not one per channel per request (a client binding channels past
/// the map's size cannot flood the log); the channels that did not fit relay in user space.
#[test]
fn a_full_map_is_one_warning_and_the_rest_relays_in_user_space() {
    let s = start("tc", &[], |c| {
        c.env("UTURN_OFFLOAD_MAX_CHANNELS", "2");
    });
    let peers: Vec<Peer> = (0..6).map(|_| Peer::start()).collect();
    let mut link = TurnLink::connect(uturn_perf::turncat::transport::Protocol::Udp, s.addr())
        .expect("a UDP socket");
    link.allocate(false, false).expect("an allocation");
    // Each channel bound three times: every request used to try the ones that did not fit.
    for _ in 0..3 {
        for (i, peer) in peers.iter().enumerate() {
            link.bind_channel(0x4000 + i as u16, peer.addr)
                .unwrap_or_else(|code| panic!("ChannelBind: {code}\n{}", s.server.logs()));
        }
    }
    link.drain(1.5);
    assert!(
        wait_until(3, || s.channels() == 2),
        "{} offloaded",
        s.channels()
    );
    link.channel_data.clear();
    for i in 0..peers.len() {
        link.send_channel_data(0x4000 + i as u16, format!("echo {i}").as_bytes());
    }
    link.drain(1.0);
    for i in 0..peers.len() {
        assert!(
            link.channel_data
                .iter()
                .any(|(channel, data)| *channel == 0x4000 + i as u16
                    && data == format!("echo {i}").as_bytes()),
            "channel {i} did not relay: {:?}",
            link.channel_data
        );
    }
    let logs = s.server.logs();
    assert_eq!(logs.matches("map write(s) failed").count(), 1, "{logs}");
}

//! A Kubernetes-shaped cluster of gateway pods in network namespaces, with a service VIP in
//! front that a test re-points from one pod to another while a client's UDP flow goes on:
//! what kube-proxy (or a load balancer) does to a TURN client when endpoints change.
//!
//! # Layout
//!
//! Every [`Cluster`] gets its own namespace names (`uc<pid>x<seq>-<role>`) and its own /24,
//! `10.215.T.0/24`, so the tests of one binary run side by side. A `node` namespace routes
//! (`ip_forward=1`) between the others, each joined to it by a veth pair (`to-<role>` on the
//! node, `eth0` in the namespace, a /30 each, default route via the node's end):
//!
//! | role              | address        | runs                                              |
//! | ----------------- | -------------- | ------------------------------------------------- |
//! | `pod-a`, `-b`, `-c` | `10.215.T.2`, `.6`, `.10` | a real `stunnerd` ([`Cluster::start_pods`]), `STUNNER_ADDR` its own IP, so its relay addresses are the pod IP |
//! | `client`          | `10.215.T.14`  | the TURN client ([`Cluster::in_client`])          |
//! | `peer`            | `10.215.T.18`  | the media server ([`Cluster::in_peer`])           |
//! | `node`            | `.1`, `.5`, … and the VIP rules | nftables, the admin probes ([`Cluster::status`]) |
//!
//! The service VIP is `10.215.T.100:3478` ([`Cluster::vip`]); it sits on no interface (as with
//! kube-proxy's iptables mode): the node's rules alone make it answer. Every veth end computes
//! and verifies checksums in software (offloads off), so a datagram the NAT rewrote with a wrong
//! checksum would be dropped by its receiver and counted ([`udp_checksum_errors`]).
//!
//! # How the NAT works: stateless, so a move is immediate
//!
//! kube-proxy DNATs a service statefully: conntrack pins a 5-tuple to the backend it first
//! picked, and only deleting the conntrack entry (conntrack netlink, `conntrack -D`) or its
//! timeout moves an existing flow. There is no conntrack netlink here, and a timeout-based move
//! (a short `nf_conntrack_udp_timeout` and a client silence longer than it) is slow and racy.
//! So the node NATs the VIP **statelessly**, in table `ip uturn_vip`:
//!
//! - chain `untracked` (prerouting, priority raw): `notrack` for datagrams to the VIP's port
//!   and from port 3478 to the client, so conntrack keeps no state for the flow at all;
//! - chain `to_pod` (prerouting, priority mangle, before routing): `ip daddr VIP udp dport 3478
//!   ip daddr set POD` (the "DNAT"; port 3478 on the pod too);
//! - chain `from_pod` (postrouting, priority mangle): `ip saddr POD udp sport 3478 ip daddr
//!   CLIENT ip saddr set VIP` (the "un-DNAT": the client only ever sees the VIP).
//!
//! nftables fixes the IP header checksum and, as the address is part of the UDP pseudo-header,
//! the UDP checksum (`csum_flags 0x1` in `nft --debug=netlink`) of every rewritten datagram.
//!
//! [`Cluster::move_flow`] replaces the rules of `to_pod` and `from_pod` in one nftables
//! transaction (`flush chain …; add rule …`, atomic): the very next datagram of the existing
//! client 5-tuple reaches the new pod, and its answers come back from the VIP. Nothing else
//! changes: the client keeps its socket, the old pod keeps its allocations (and times them out
//! as it would in a cluster where the client went elsewhere).
//!
//! # Use
//!
//! ```ignore
//! let mut cluster = Cluster::new(2); // pods a and b; the VIP points at a
//! let config = cluster.static_config();
//! cluster.start_pods(&config, &[], &[]); // a stunnerd in each, /status answering
//! let peer = cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()));
//! let mut link = cluster.in_client(|| TurnLink::connect(Protocol::Udp, cluster.vip()).unwrap());
//! // ... allocate (on a), bind a channel to peer.addr, talk ...
//! cluster.move_flow(1); // the same client 5-tuple now reaches b
//! assert_eq!(cluster.status(1).unwrap()["allocationCount"], 0, "{}", cluster.describe());
//! ```
//!
//! A socket belongs to the namespace it was made in, so a client made in `in_client` talks
//! from the client namespace from any thread. [`Cluster::describe`] gives the layout, the
//! rules with their counters and the pods' logs for a failure message.
//!
//! # Limits
//!
//! - Only UDP to the VIP is NATed (TCP/TLS to the VIP is not served); a pod's other traffic
//!   (relay to the peer, admin ports, pod to pod) is routed as is, on the pod IPs.
//! - Answers are un-NATed only from the *current* target: after a move, a datagram the old pod
//!   still sends the client from its port 3478 reaches it with the old pod's IP as source (as
//!   once kube-proxy has deleted the old endpoint's conntrack entries), so a client socket
//!   connected to the VIP drops it.
//! - One client address ([`Cluster::client_ip`]): every client of a test shares it and differs
//!   by port; all of them move together.
//! - The admin endpoints (health 8086, metrics 8080, [`HEALTH_PORT`], [`METRICS_PORT`]) are read
//!   on the pod IPs from inside the node namespace, as a kubelet probe would; nothing is
//!   reachable from the root namespace.
//! - Root is needed (namespaces, veths, nftables); `nft` (Debian's nftables) and `ethtool` must
//!   be installed. Everything is removed on drop, also on panic: the processes (by PID, then
//!   any left in the cluster's own namespaces), then the namespaces, which takes their veths
//!   and nftables tables with them.

use crate::stunnerd::{http_get_from, Killed, Stunnerd};
use serde_json::Value;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The service's port on the VIP, and the TURN listener's port on every pod.
pub const VIP_PORT: u16 = 3478;
/// The port of each pod's health server (`/status`, `/live`, `/ready`) in [`Cluster::static_config`].
pub const HEALTH_PORT: u16 = 8086;
/// The port of each pod's metrics server (`/metrics`) in [`Cluster::static_config`].
pub const METRICS_PORT: u16 = 8080;

/// The names of the pods, in order.
const POD_NAMES: [&str; 3] = ["a", "b", "c"];

/// The /30 of namespace `role` (whatever the number of pods): pods `a` to `c` 0 to 2, then the
/// client and the peer.
fn slot(role: &str) -> u8 {
    match role {
        "client" => 3,
        "peer" => 4,
        pod => POD_NAMES
            .iter()
            .position(|p| pod.strip_prefix("pod-") == Some(*p))
            .unwrap_or_else(|| panic!("no namespace role {pod}")) as u8,
    }
}

/// Runs `args` (a program and its arguments) to its end and returns its stdout; panics with its
/// stderr if it fails (namespaces and nftables need root).
pub fn run(args: &[&str]) -> String {
    run_with_input(args, "")
}

/// As [`run`], with `input` on its standard input.
fn run_with_input(args: &[&str], input: &str) -> String {
    use std::io::Write;
    let mut child = Command::new(args[0])
        .args(&args[1..])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{}: {e}", args[0]));
    if let Some(mut stdin) = child.stdin.take() {
        let _ = stdin.write_all(input.as_bytes());
    }
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "{}: {} (this makes network namespaces and nftables rules: it must run as root)",
        args.join(" "),
        String::from_utf8_lossy(&output.stderr).trim()
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Makes namespace `ns` route IPv4 between its interfaces (`net.ipv4.ip_forward=1`): a node.
pub fn forward_ipv4(ns: &str) {
    run(&[
        "ip",
        "netns",
        "exec",
        ns,
        "sysctl",
        "-qw",
        "net.ipv4.ip_forward=1",
    ]);
}

/// Runs `f` on the calling thread inside network namespace `ns` (a name under
/// `/var/run/netns`), then puts the thread back, also if `f` panics. Sockets `f` creates stay
/// in `ns` for their whole life, from whatever thread uses them later; threads `f` spawns
/// start in `ns`.
pub fn in_netns<T>(ns: &str, f: impl FnOnce() -> T) -> T {
    struct Back(std::fs::File);
    impl Drop for Back {
        fn drop(&mut self) {
            // SAFETY: setns(2) on a descriptor of the thread's own former namespace.
            let rc = unsafe { libc::setns(self.0.as_raw_fd(), libc::CLONE_NEWNET) };
            if rc != 0 && !std::thread::panicking() {
                panic!(
                    "setns back to the original namespace: {}",
                    std::io::Error::last_os_error()
                );
            }
        }
    }
    let back = Back(std::fs::File::open("/proc/thread-self/ns/net").expect("own namespace"));
    let target = std::fs::File::open(format!("/var/run/netns/{ns}"))
        .unwrap_or_else(|e| panic!("network namespace {ns}: {e}"));
    // SAFETY: setns(2) on a namespace descriptor; it changes this thread only.
    let rc = unsafe { libc::setns(target.as_raw_fd(), libc::CLONE_NEWNET) };
    assert_eq!(rc, 0, "setns {ns}: {}", std::io::Error::last_os_error());
    let result = f();
    drop(back);
    result
}

/// UDP datagrams namespace `ns` received with a bad checksum (`InCsumErrors` of
/// `/proc/net/snmp`).
pub fn udp_checksum_errors(ns: &str) -> u64 {
    let snmp = in_netns(ns, || std::fs::read_to_string("/proc/thread-self/net/snmp")).unwrap();
    let udp: Vec<&str> = snmp.lines().filter(|l| l.starts_with("Udp:")).collect();
    let (names, values) = (udp[0].split_whitespace(), udp[1].split_whitespace());
    names
        .zip(values)
        .find(|(n, _)| *n == "InCsumErrors")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap()
}

/// A veth pair that joins namespace `ns` to namespace `node` (both made already), each end
/// on a /30 of its own: what a CNI plugin gives a pod on its node.
pub struct VethPair<'a> {
    /// The routing namespace.
    pub node: &'a str,
    /// The node's end's name.
    pub node_side: &'a str,
    /// The node's end's address (the far end's gateway).
    pub node_ip: Ipv4Addr,
    /// The namespace joined to the node.
    pub ns: &'a str,
    /// The far end's name (in `ns`).
    pub far_side: &'a str,
    /// The far end's address.
    pub far_ip: Ipv4Addr,
}

impl VethPair<'_> {
    /// Makes the pair, addresses both ends (/30), brings them and `ns`'s loopback up and
    /// routes `ns` by default via the node. With `checksum_offload` false, both ends compute
    /// and verify checksums in software, so that every receiver checks what a rewrite did.
    pub fn create(&self, checksum_offload: bool) {
        let (node, ns) = (self.node, self.ns);
        run(&[
            "ip",
            "-n",
            node,
            "link",
            "add",
            self.node_side,
            "type",
            "veth",
            "peer",
            "name",
            self.far_side,
            "netns",
            ns,
        ]);
        let ends = [
            (node, self.node_side, self.node_ip),
            (ns, self.far_side, self.far_ip),
        ];
        for (n, dev, ip) in ends {
            run(&[
                "ip",
                "-n",
                n,
                "addr",
                "add",
                &format!("{ip}/30"),
                "dev",
                dev,
            ]);
            run(&["ip", "-n", n, "link", "set", dev, "up"]);
            if !checksum_offload {
                run(&[
                    "ip", "netns", "exec", n, "ethtool", "-K", dev, "tx", "off", "rx", "off",
                ]);
            }
        }
        run(&["ip", "-n", ns, "link", "set", "lo", "up"]);
        let gateway = self.node_ip.to_string();
        run(&["ip", "-n", ns, "route", "add", "default", "via", &gateway]);
    }
}

/// One gateway pod: its namespace, its address and the stunnerd running in it.
pub struct Pod {
    /// `a`, `b` or `c`.
    pub name: &'static str,
    /// Its network namespace.
    pub ns: String,
    /// Its address (`STUNNER_ADDR`, so also its relay address).
    pub ip: Ipv4Addr,
    /// Its stunnerd, once started ([`Cluster::start_pod`]).
    pub server: Option<Stunnerd>,
    config: Option<PathBuf>,
}

/// Node, pods, client and peer namespaces with the VIP's NAT; removed on drop.
pub struct Cluster {
    prefix: String,
    subnet: u8,
    /// The namespaces made so far (a half-made cluster is undone too).
    namespaces: Vec<String>,
    pods: Vec<Pod>,
    target: usize,
    procs: Vec<Killed>,
}

impl Cluster {
    /// A node with `pods` gateway pods (1 to 3), a client and a peer, the VIP pointing at pod
    /// 0 (`a`). Nothing runs in the pods yet: see [`Cluster::start_pods`].
    pub fn new(pods: usize) -> Cluster {
        assert!((1..=POD_NAMES.len()).contains(&pods), "1 to 3 pods");
        static CLUSTERS: AtomicU32 = AtomicU32::new(0);
        let seq = CLUSTERS.fetch_add(1, Ordering::Relaxed);
        let pid = std::process::id();
        let mut cluster = Cluster {
            prefix: format!("uc{pid}x{seq}"),
            subnet: ((pid % 8) * 32 + seq % 32) as u8,
            namespaces: Vec::new(),
            pods: Vec::new(),
            target: 0,
            procs: Vec::new(),
        };
        let node = cluster.ns("node");
        cluster.add_netns(&node);
        forward_ipv4(&node);
        let roles = POD_NAMES[..pods]
            .iter()
            .map(|p| format!("pod-{p}"))
            .chain(["client".to_owned(), "peer".to_owned()]);
        for role in roles {
            let far = cluster.link(&role);
            if let Some(name) = role.strip_prefix("pod-") {
                let name = POD_NAMES.iter().find(|p| **p == name).unwrap();
                cluster.pods.push(Pod {
                    name,
                    ns: cluster.ns(&role),
                    ip: far,
                    server: None,
                    config: None,
                });
            }
        }
        let (vip, client) = (cluster.vip_ip(), cluster.client_ip());
        run_with_input(
            &["ip", "netns", "exec", &node, "nft", "-f", "-"],
            &format!(
                "table ip uturn_vip {{\n\
                 chain untracked {{\ntype filter hook prerouting priority raw; policy accept;\n\
                 ip daddr {vip} udp dport {VIP_PORT} notrack\n\
                 udp sport {VIP_PORT} ip daddr {client} notrack\n}}\n\
                 chain to_pod {{\ntype filter hook prerouting priority mangle; policy accept;\n}}\n\
                 chain from_pod {{\ntype filter hook postrouting priority mangle; policy accept;\n}}\n\
                 }}\n"
            ),
        );
        cluster.move_flow(0);
        cluster
    }

    fn add_netns(&mut self, ns: &str) {
        run(&["ip", "netns", "add", ns]);
        self.namespaces.push(ns.to_owned());
    }

    /// Namespace `role`, joined to the node by a veth pair on the next /30; its address.
    fn link(&mut self, role: &str) -> Ipv4Addr {
        let (node, ns) = (self.ns("node"), self.ns(role));
        self.add_netns(&ns);
        let node_ip = self.address(4 * slot(role) + 1);
        let far_ip = self.address(4 * slot(role) + 2);
        VethPair {
            node: &node,
            node_side: &format!("to-{role}"),
            node_ip,
            ns: &ns,
            far_side: "eth0",
            far_ip,
        }
        .create(false);
        far_ip
    }

    fn address(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, 215, self.subnet, last)
    }

    /// The name of namespace `role`: `node`, `client`, `peer`, `pod-a`, `pod-b`, `pod-c`.
    pub fn ns(&self, role: &str) -> String {
        format!("{}-{role}", self.prefix)
    }

    fn vip_ip(&self) -> Ipv4Addr {
        self.address(100)
    }

    /// The service address the client talks to: `10.215.T.100:3478`.
    pub fn vip(&self) -> SocketAddr {
        (self.vip_ip(), VIP_PORT).into()
    }

    /// The client namespace's address.
    pub fn client_ip(&self) -> Ipv4Addr {
        self.namespace_ip("client")
    }

    /// The peer (media server) namespace's address.
    pub fn peer_ip(&self) -> Ipv4Addr {
        self.namespace_ip("peer")
    }

    fn namespace_ip(&self, role: &str) -> Ipv4Addr {
        self.address(4 * slot(role) + 2)
    }

    /// The pods, `a` first.
    pub fn pods(&self) -> &[Pod] {
        &self.pods
    }

    /// Pod `i` (0 is `a`).
    pub fn pod(&self, i: usize) -> &Pod {
        &self.pods[i]
    }

    /// Pod `i`'s stunnerd, to signal it or read its logs (panics if not started).
    pub fn stunnerd(&mut self, i: usize) -> &mut Stunnerd {
        self.pods[i].server.as_mut().expect("pod started")
    }

    /// A v1 config every pod can run: static auth with [`crate::link::LINK_CREDS`], a UDP
    /// listener `udp` on `$STUNNER_ADDR:3478` routing to cluster `media` (the peer's address),
    /// health and metrics on [`HEALTH_PORT`] and [`METRICS_PORT`] of every address.
    pub fn static_config(&self) -> String {
        let (user, pass) = crate::link::LINK_CREDS;
        format!(
            "version: v1\n\
             admin: {{name: gateway, healthcheck_endpoint: \"http://0.0.0.0:{HEALTH_PORT}\", \
             metrics_endpoint: \"http://0.0.0.0:{METRICS_PORT}/metrics\"}}\n\
             auth: {{type: static, credentials: {{username: {user}, password: {pass}}}}}\n\
             listeners: [{{name: udp, protocol: TURN-UDP, address: $STUNNER_ADDR, port: {VIP_PORT}, \
             routes: [media]}}]\n\
             clusters: [{{name: media, type: STATIC, endpoints: [\"{}/32\"]}}]\n",
            self.peer_ip()
        )
    }

    /// Starts stunnerd in pod `i` with `config` (a file origin, `-c file://…`; `$STUNNER_ADDR`
    /// is the pod's IP), then `args` and `envs`, and waits (up to 10 s) until its `/status`
    /// answers on [`HEALTH_PORT`] (so `config` must serve it there).
    pub fn start_pod(&mut self, i: usize, config: &str, args: &[&str], envs: &[(&str, &str)]) {
        let pod = &mut self.pods[i];
        let path = crate::stunnerd::temp_file(&format!("pod-{}.yaml", pod.name));
        std::fs::write(&path, config).unwrap();
        pod.config = Some(path.clone());
        let origin = format!("file://{}", path.display());
        let ip = pod.ip.to_string();
        let mut all_args = vec!["-c", &origin];
        all_args.extend_from_slice(args);
        let mut all_envs = vec![("STUNNER_ADDR", ip.as_str())];
        all_envs.extend_from_slice(envs);
        pod.server = Some(Stunnerd::start_under(
            &["ip", "netns", "exec", &pod.ns],
            &all_args,
            &all_envs,
        ));
        // Up to 10 s, or until the process gives up (a config it refuses, say).
        let mut served = false;
        for _ in 0..100 {
            served = self.status(i).is_some();
            if served || self.stunnerd(i).wait_exit_for(0.1).is_some() {
                break;
            }
        }
        assert!(
            served,
            "pod {} never served /status\n{}",
            self.pods[i].name,
            self.describe()
        );
    }

    /// [`Cluster::start_pod`] for every pod, with the same `config`, `args` and `envs`.
    pub fn start_pods(&mut self, config: &str, args: &[&str], envs: &[(&str, &str)]) {
        for i in 0..self.pods.len() {
            self.start_pod(i, config, args, envs);
        }
    }

    /// Runs `f` inside the client namespace (see [`in_netns`]): a socket made there is the
    /// client's, whichever thread uses it.
    pub fn in_client<T>(&self, f: impl FnOnce() -> T) -> T {
        in_netns(&self.ns("client"), f)
    }

    /// Runs `f` inside the peer namespace: an echo peer there is
    /// `cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()))`.
    pub fn in_peer<T>(&self, f: impl FnOnce() -> T) -> T {
        in_netns(&self.ns("peer"), f)
    }

    /// Runs `f` inside pod `i`'s namespace.
    pub fn in_pod<T>(&self, i: usize, f: impl FnOnce() -> T) -> T {
        in_netns(&self.pods[i].ns, f)
    }

    /// Runs `f` inside the node namespace (where every address of the cluster is reachable).
    pub fn in_node<T>(&self, f: impl FnOnce() -> T) -> T {
        in_netns(&self.ns("node"), f)
    }

    /// Spawns `program ARGS` inside namespace `role` (`ip netns exec`), its output discarded;
    /// killed when the cluster drops. Its PID.
    pub fn spawn_in(&mut self, role: &str, program: &str, args: &[&str]) -> u32 {
        let child = Command::new("ip")
            .args(["netns", "exec", &self.ns(role), program])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("ip netns exec … {program}: {e}"));
        let pid = child.id();
        self.procs.push(Killed(child));
        pid
    }

    /// Moves the VIP, and with it every client flow at once, to pod `to`: both NAT rules are
    /// replaced in one nftables transaction (see the module doc).
    pub fn move_flow(&mut self, to: usize) {
        let (vip, client, pod) = (self.vip_ip(), self.client_ip(), self.pods[to].ip);
        run_with_input(
            &["ip", "netns", "exec", &self.ns("node"), "nft", "-f", "-"],
            &format!(
                "flush chain ip uturn_vip to_pod\n\
                 flush chain ip uturn_vip from_pod\n\
                 add rule ip uturn_vip to_pod ip daddr {vip} udp dport {VIP_PORT} counter \
                 ip daddr set {pod}\n\
                 add rule ip uturn_vip from_pod ip saddr {pod} udp sport {VIP_PORT} \
                 ip daddr {client} counter ip saddr set {vip}\n"
            ),
        );
        self.target = to;
    }

    /// The pod the VIP points at (0 is `a`).
    pub fn target(&self) -> usize {
        self.target
    }

    /// Datagrams (to the pod, from the pod) that the NAT rewrote since the last
    /// [`Cluster::move_flow`]: how much of the flow reached the current target.
    pub fn steered(&self) -> (u64, u64) {
        let count = |chain: &str| {
            let rules = run(&[
                "ip",
                "netns",
                "exec",
                &self.ns("node"),
                "nft",
                "list",
                "chain",
                "ip",
                "uturn_vip",
                chain,
            ]);
            rules
                .split("counter packets ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        (count("to_pod"), count("from_pod"))
    }

    /// `GET path` on `port` of pod `i`'s address, from the node: status code and body.
    pub fn http_get(&self, i: usize, port: u16, path: &str) -> Option<(u16, String)> {
        let addr = SocketAddr::from((self.pods[i].ip, port));
        self.in_node(|| http_get_from(addr, path))
    }

    /// Pod `i`'s `/status` document (on [`HEALTH_PORT`]), if it answers.
    pub fn status(&self, i: usize) -> Option<Value> {
        let (code, body) = self.http_get(i, HEALTH_PORT, "/status")?;
        (code == 200).then(|| serde_json::from_str(&body).ok())?
    }

    /// The value of the first sample of pod `i`'s `/metrics` (on [`METRICS_PORT`]) whose line
    /// starts with `line_start` (a name and its labels, with the trailing space).
    pub fn metric(&self, i: usize, line_start: &str) -> Option<f64> {
        let (_, body) = self.http_get(i, METRICS_PORT, "/metrics")?;
        body.lines()
            .find_map(|l| l.strip_prefix(line_start))
            .and_then(|v| v.trim().parse().ok())
    }

    /// Answers every UDP datagram to `port` of pod `i` with `"<pod name> <datagram>"`, from a
    /// thread in the pod's namespace, until the guard drops: tells which pod a flow reaches,
    /// without a stunnerd.
    pub fn tagged_echo(&self, i: usize, port: u16) -> TaggedEcho {
        let (name, ip) = (self.pods[i].name, self.pods[i].ip);
        let socket = self.in_pod(i, || UdpSocket::bind((ip, port)).expect("bind in the pod"));
        socket
            .set_read_timeout(Some(Duration::from_millis(20)))
            .unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut buf = [0u8; 2048];
            while !stopped.load(Ordering::Relaxed) {
                let Ok((n, from)) = socket.recv_from(&mut buf) else {
                    continue;
                };
                let answer = [name.as_bytes(), b" ", &buf[..n]].concat();
                let _ = socket.send_to(&answer, from);
            }
        });
        TaggedEcho {
            stop,
            thread: Some(thread),
        }
    }

    /// Everything a failed assertion needs: the layout, the NAT rules with their counters,
    /// and the end of each pod's stunnerd log.
    pub fn describe(&self) -> String {
        let mut text = format!(
            "cluster {}: VIP {} -> pod {} ({}); client {}, peer {}\n",
            self.prefix,
            self.vip(),
            self.pods[self.target].name,
            self.pods[self.target].ip,
            self.client_ip(),
            self.peer_ip()
        );
        for pod in &self.pods {
            text += &format!("pod {}: {} in namespace {}\n", pod.name, pod.ip, pod.ns);
        }
        let rules = Command::new("ip")
            .args(["netns", "exec", &self.ns("node"), "nft", "list", "ruleset"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        text += &format!("node's nftables:\n{rules}");
        for pod in &self.pods {
            if let Some(server) = &pod.server {
                let logs = server.logs();
                let lines: Vec<&str> = logs.lines().collect();
                let tail = lines[lines.len().saturating_sub(40)..].join("\n");
                text += &format!(
                    "--- pod {} stunnerd log (last 40 lines) ---\n{tail}\n",
                    pod.name
                );
            }
        }
        text
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        // Our processes by PID first, then anything left in our own namespaces (only ours can
        // be there), so none keeps a namespace alive; deleting a namespace removes its veth
        // ends (and so the pairs) and its nftables tables.
        for pod in &mut self.pods {
            pod.server = None;
            if let Some(config) = pod.config.take() {
                let _ = std::fs::remove_file(config);
            }
        }
        self.procs.clear();
        for ns in self.namespaces.iter().rev() {
            crate::peers::kill_netns_processes(ns);
            let _ = Command::new("ip")
                .args(["netns", "del", ns])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .status();
        }
    }
}

/// A pod's tagged UDP echo ([`Cluster::tagged_echo`]); stops when dropped.
pub struct TaggedEcho {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Drop for TaggedEcho {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

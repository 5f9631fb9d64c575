//! A Kubernetes-shaped cluster of gateway pods in network namespaces, with a service VIP in
//! front that a test re-points from one pod to another while a client's UDP flow goes on:
//! what kube-proxy (or a load balancer) does to a TURN client when endpoints change.
//!
//! # Layout
//!
//! A [`crate::netns::Shape`]: namespace `node` routes between the gateway pods `pod-a` (to
//! `pod-c`), a `client` and a `peer`, each joined to it by a veth pair on a /30 of the
//! topology's `10.219.T.0/24` (see [`crate::netns`] for the names and addresses), every veth
//! end computing and verifying checksums in software (offloads off), so that a datagram the
//! NAT rewrote with a wrong checksum is dropped by its receiver and counted
//! ([`udp_checksum_errors`]):
//!
//! | role                | runs                                                           |
//! | ------------------- | -------------------------------------------------------------- |
//! | `pod-a`, `-b`, `-c` | a real `stunnerd` ([`Cluster::start_pods`]), `STUNNER_ADDR` its own IP, so its relay addresses are the pod IP |
//! | `client`            | the TURN client ([`Cluster::in_client`])                       |
//! | `peer`              | the media server ([`Cluster::in_peer`])                        |
//! | `node`              | the VIP's stateless NAT, the admin probes ([`Cluster::status`]) |
//!
//! The service VIP is `10.219.T.100:3478` ([`Cluster::vip`]), NATed by the node for the client
//! to the current pod, statelessly, so that [`Cluster::move_flow`] moves an existing client
//! 5-tuple at once ([`crate::netns`]'s "The VIP"). Nothing else changes on a move: the client
//! keeps its socket, the old pod keeps its allocations (and times them out as it would in a
//! cluster where the client went elsewhere).
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
//!   be installed. Everything is removed on drop, also on panic: the pods' stunnerds, then the
//!   topology ([`crate::netns::Topology`]'s cleanup).

use crate::netns::{Shape, Topology};
use crate::stunnerd::Stunnerd;
use serde_json::Value;
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A pod's count of datagrams it dropped for a bad checksum (`second_chance` imports it from
/// here).
pub use crate::netns::udp_checksum_errors;

/// The service's port on the VIP, and the TURN listener's port on every pod.
pub const VIP_PORT: u16 = 3478;
/// The port of each pod's health server (`/status`, `/live`, `/ready`) in [`Cluster::static_config`].
pub const HEALTH_PORT: u16 = 8086;
/// The port of each pod's metrics server (`/metrics`) in [`Cluster::static_config`].
pub const METRICS_PORT: u16 = 8080;

/// The names of the pods, in order.
const POD_NAMES: [&str; 3] = ["a", "b", "c"];

/// The first of the addresses [`Cluster::spoofed_ip`] gives (`.128/25` of the topology).
const SPOOFED_FIRST: u8 = 128;

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

impl Pod {
    /// Its role in the topology: `pod-a`, ….
    fn role(&self) -> String {
        format!("pod-{}", self.name)
    }
}

/// Node, pods, client and peer namespaces with the VIP's NAT; removed on drop.
pub struct Cluster {
    pods: Vec<Pod>,
    target: usize,
    /// Dropped after the pods' stunnerds (see `Drop`).
    topology: Topology,
}

impl Cluster {
    /// A node with `pods` gateway pods (1 to 3), a client and a peer, the VIP pointing at pod
    /// 0 (`a`). Nothing runs in the pods yet: see [`Cluster::start_pods`].
    pub fn new(pods: usize) -> Cluster {
        assert!((1..=POD_NAMES.len()).contains(&pods), "1 to 3 pods");
        let roles: Vec<String> = POD_NAMES[..pods]
            .iter()
            .map(|p| format!("pod-{p}"))
            .chain(["client".to_owned(), "peer".to_owned()])
            .collect();
        let roles: Vec<&str> = roles.iter().map(String::as_str).collect();
        let topology = Shape::new("uc")
            .router("node", &roles)
            .checksum_offload(false)
            .vip("node", "client", VIP_PORT)
            .build();
        let pods = POD_NAMES[..pods]
            .iter()
            .map(|name| {
                let role = format!("pod-{name}");
                Pod {
                    name,
                    ns: topology.ns(&role).to_owned(),
                    ip: topology.ip(&role),
                    server: None,
                    config: None,
                }
            })
            .collect();
        let mut cluster = Cluster {
            pods,
            target: 0,
            topology,
        };
        cluster.move_flow(0);
        cluster
    }

    /// The namespaces, links and VIP under the cluster.
    pub fn topology(&self) -> &Topology {
        &self.topology
    }

    /// The name of namespace `role`: `node`, `client`, `peer`, `pod-a`, `pod-b`, `pod-c`.
    pub fn ns(&self, role: &str) -> String {
        self.topology.ns(role).to_owned()
    }

    /// The service address the client talks to: `10.219.T.100:3478`.
    pub fn vip(&self) -> SocketAddr {
        self.topology.vip()
    }

    /// The client namespace's address.
    pub fn client_ip(&self) -> Ipv4Addr {
        self.topology.ip("client")
    }

    /// The peer (media server) namespace's address.
    pub fn peer_ip(&self) -> Ipv4Addr {
        self.topology.ip("peer")
    }

    /// Address `i` (0 to [`SPOOFED_IPS`] − 1) of a range no interface holds, `10.219.T.128/25`,
    /// that the node routes to the client namespace: the sources of a [`Spoofer`].
    pub fn spoofed_ip(&self, i: u8) -> Ipv4Addr {
        assert!(i < SPOOFED_IPS, "spoofed address {i} beyond {SPOOFED_IPS}");
        self.topology.address(SPOOFED_FIRST + i)
    }

    /// A raw socket in the client namespace that sends UDP from any source address (see
    /// [`Spoofer`]); the node routes [`Cluster::spoofed_ip`]'s range to the client namespace,
    /// so that reverse-path filtering passes them and answers go back (where nothing takes
    /// them).
    pub fn spoofer(&self) -> Spoofer {
        let range = format!("{}/25", self.topology.address(SPOOFED_FIRST));
        let client = self.client_ip().to_string();
        self.topology
            .run_in("node", &["ip", "route", "replace", &range, "via", &client]);
        self.in_client(Spoofer::new)
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

    /// Runs `f` inside the client namespace (see [`crate::netns::in_netns`]): a socket made
    /// there is the client's, whichever thread uses it.
    pub fn in_client<T>(&self, f: impl FnOnce() -> T) -> T {
        self.topology.in_ns("client", f)
    }

    /// Runs `f` inside the peer namespace: an echo peer there is
    /// `cluster.in_peer(|| Peer::on(&cluster.peer_ip().to_string()))`.
    pub fn in_peer<T>(&self, f: impl FnOnce() -> T) -> T {
        self.topology.in_ns("peer", f)
    }

    /// Runs `f` inside pod `i`'s namespace.
    pub fn in_pod<T>(&self, i: usize, f: impl FnOnce() -> T) -> T {
        self.topology.in_ns(&self.pods[i].role(), f)
    }

    /// Runs `f` inside the node namespace (where every address of the cluster is reachable).
    pub fn in_node<T>(&self, f: impl FnOnce() -> T) -> T {
        self.topology.in_ns("node", f)
    }

    /// Spawns `program ARGS` inside namespace `role` (`ip netns exec`), its output discarded;
    /// killed when the cluster drops. Its PID.
    pub fn spawn_in(&mut self, role: &str, program: &str, args: &[&str]) -> u32 {
        self.topology.spawn_in(role, program, args)
    }

    /// Moves the VIP, and with it every client flow at once, to pod `to`: both NAT rules are
    /// replaced in one nftables transaction (see [`crate::netns`]'s "The VIP").
    pub fn move_flow(&mut self, to: usize) {
        self.topology.point_vip(&self.pods[to].role());
        self.target = to;
    }

    /// The pod the VIP points at (0 is `a`).
    pub fn target(&self) -> usize {
        self.target
    }

    /// Datagrams (to the pod, from the pod) that the NAT rewrote since the last
    /// [`Cluster::move_flow`]: how much of the flow reached the current target.
    pub fn steered(&self) -> (u64, u64) {
        self.topology.vip_steered()
    }

    /// `GET path` on `port` of pod `i`'s address, from the node: status code and body.
    pub fn http_get(&self, i: usize, port: u16, path: &str) -> Option<(u16, String)> {
        let addr = SocketAddr::from((self.pods[i].ip, port));
        self.topology.http_get("node", addr, path)
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
            "cluster: VIP {} -> pod {} ({}); client {}, peer {}\n",
            self.vip(),
            self.pods[self.target].name,
            self.pods[self.target].ip,
            self.client_ip(),
            self.peer_ip()
        );
        text += &self.topology.describe();
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
        // The pods' stunnerds first (by PID), then the topology (its own processes, whatever
        // is left in its namespaces, the namespaces).
        for pod in &mut self.pods {
            pod.server = None;
            if let Some(config) = pod.config.take() {
                let _ = std::fs::remove_file(config);
            }
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

/// How many addresses [`Cluster::spoofed_ip`] gives.
pub const SPOOFED_IPS: u8 = 127;

/// A raw IPv4 socket (`IPPROTO_RAW`, the IP header ours) that sends UDP datagrams from any
/// source address and port: what an attacker who spoofs its sources sends. Made with
/// [`Cluster::spoofer`] in the client namespace.
pub struct Spoofer {
    fd: std::os::fd::OwnedFd,
}

impl Spoofer {
    fn new() -> Spoofer {
        use std::os::fd::FromRawFd;
        // SAFETY: socket(2) with constant arguments; the descriptor is owned from here on.
        let fd = unsafe { libc::socket(libc::AF_INET, libc::SOCK_RAW, libc::IPPROTO_RAW) };
        assert!(
            fd >= 0,
            "raw socket: {} (needs root)",
            std::io::Error::last_os_error()
        );
        Spoofer {
            // SAFETY: a fresh descriptor nothing else owns.
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        }
    }

    /// Sends `payload` in a UDP datagram from `from` to `to` (the UDP checksum computed, the IP
    /// header's filled in by the kernel).
    pub fn send(
        &self,
        from: std::net::SocketAddrV4,
        to: std::net::SocketAddrV4,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let udp_len = 8 + payload.len();
        let total = 20 + udp_len;
        let mut packet = Vec::with_capacity(total);
        packet.extend_from_slice(&[0x45, 0]);
        packet.extend_from_slice(&(total as u16).to_be_bytes());
        // Id 0 (the kernel fills it), don't fragment, TTL 64, UDP, checksum 0 (filled too).
        packet.extend_from_slice(&[0, 0, 0x40, 0, 64, 17, 0, 0]);
        packet.extend_from_slice(&from.ip().octets());
        packet.extend_from_slice(&to.ip().octets());
        packet.extend_from_slice(&from.port().to_be_bytes());
        packet.extend_from_slice(&to.port().to_be_bytes());
        packet.extend_from_slice(&(udp_len as u16).to_be_bytes());
        packet.extend_from_slice(&[0, 0]);
        packet.extend_from_slice(payload);
        // RFC 768: the one's complement sum over the pseudo-header, header and data.
        let mut pseudo = Vec::with_capacity(12 + udp_len + 1);
        pseudo.extend_from_slice(&from.ip().octets());
        pseudo.extend_from_slice(&to.ip().octets());
        pseudo.extend_from_slice(&[0, 17]);
        pseudo.extend_from_slice(&(udp_len as u16).to_be_bytes());
        pseudo.extend_from_slice(&packet[20..]);
        if pseudo.len() % 2 == 1 {
            pseudo.push(0);
        }
        let mut sum: u32 = pseudo
            .chunks(2)
            .map(|w| u32::from(u16::from_be_bytes([w[0], w[1]])))
            .sum();
        while sum > 0xffff {
            sum = (sum & 0xffff) + (sum >> 16);
        }
        let checksum = match !(sum as u16) {
            0 => 0xffff,
            c => c,
        };
        packet[26..28].copy_from_slice(&checksum.to_be_bytes());
        let dest = libc::sockaddr_in {
            sin_family: libc::AF_INET as libc::sa_family_t,
            sin_port: 0,
            sin_addr: libc::in_addr {
                s_addr: u32::from_ne_bytes(to.ip().octets()),
            },
            sin_zero: [0; 8],
        };
        // SAFETY: sendto(2) on our descriptor, with a buffer and an address of the sizes given.
        let sent = unsafe {
            libc::sendto(
                std::os::fd::AsRawFd::as_raw_fd(&self.fd),
                packet.as_ptr().cast(),
                packet.len(),
                0,
                (&dest as *const libc::sockaddr_in).cast(),
                std::mem::size_of::<libc::sockaddr_in>() as libc::socklen_t,
            )
        };
        if sent < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(())
    }
}

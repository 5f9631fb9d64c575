//! [`Shape`] and [`Topology`]: the topology a test describes and the one made of it (see the
//! module doc of [`super`]).

use super::{
    build_bpf, forward_ipv4, in_netns, ip_in, quiet, run, run_with_input, udp_checksum_errors,
};
use super::{veth, End, HOST};
use crate::stunnerd::{http_get_from, wait_until, Killed};
use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::Duration;

/// The second octet of every topology's addresses: `10.219.T.0/24`.
const NET: u8 = 219;

/// The last octet of the VIP in its topology's /24.
const VIP_LAST: u8 = 100;

/// A link of a shape: `far` (a namespace) joined to `near` (a router, or [`HOST`]).
struct LinkSpec {
    near: String,
    far: String,
}

/// What a test needs: its namespaces (roles), which route, which are joined to which, the
/// veths' checksum offloads and a VIP. Described with the methods below, made with
/// [`Shape::build`].
pub struct Shape {
    tag: String,
    routers: Vec<String>,
    links: Vec<LinkSpec>,
    checksum_offload: bool,
    mtu: Option<u32>,
    static_neighbours: bool,
    vip: Option<(String, String, u16)>,
}

impl Shape {
    /// An empty shape; `tag` (a few letters) starts its namespaces' names, so that a leftover
    /// tells which test made it.
    pub fn new(tag: &str) -> Shape {
        Shape {
            tag: tag.to_owned(),
            routers: Vec::new(),
            links: Vec::new(),
            checksum_offload: true,
            mtu: None,
            static_neighbours: false,
            vip: None,
        }
    }

    /// Namespace `router` routes (`ip_forward=1`) between namespaces `roles`, each joined to it
    /// by a veth pair and routed by default via it: a node and its pods.
    pub fn router(mut self, router: &str, roles: &[&str]) -> Shape {
        if !self.routers.iter().any(|r| r == router) {
            self.routers.push(router.to_owned());
        }
        for role in roles {
            self.links.push(LinkSpec {
                near: router.to_owned(),
                far: (*role).to_owned(),
            });
        }
        self
    }

    /// Namespace `role` joined to the test's own namespace ([`HOST`]) by a veth pair: the host
    /// reaches [`Topology::ip`] of `role`, which is not one of the host's addresses.
    pub fn host(mut self, role: &str) -> Shape {
        self.links.push(LinkSpec {
            near: HOST.to_owned(),
            far: role.to_owned(),
        });
        self
    }

    /// Whether the veths keep their checksum offloads (on, a veth's default, unless this says
    /// otherwise). Off, every end computes and verifies checksums in software, so a datagram
    /// rewritten with a wrong checksum is dropped by its receiver and counted
    /// ([`Topology::checksum_errors`]).
    pub fn checksum_offload(mut self, on: bool) -> Shape {
        self.checksum_offload = on;
        self
    }

    /// The MTU of every veth end (a veth's default, 1 500, unless this says otherwise).
    pub fn mtu(mut self, mtu: u32) -> Shape {
        self.mtu = Some(mtu);
        self
    }

    /// Both ends of every link know each other's MAC address from the start: a permanent
    /// neighbour entry on each for the other, so no ARP runs and nothing waits for one.
    pub fn static_neighbours(mut self) -> Shape {
        self.static_neighbours = true;
        self
    }

    /// A service VIP on `router` for UDP `port`, NATed statelessly for role `client` to the
    /// backend [`Topology::point_vip`] names (none until then): see the module doc.
    pub fn vip(mut self, router: &str, client: &str, port: u16) -> Shape {
        self.vip = Some((router.to_owned(), client.to_owned(), port));
        self
    }

    /// Makes the namespaces, links, routes and rules. Panics (having undone what it made) if a
    /// step fails: it needs root.
    pub fn build(self) -> Topology {
        static TOPOLOGIES: AtomicU32 = AtomicU32::new(0);
        let seq = TOPOLOGIES.fetch_add(1, Ordering::Relaxed) % 4096;
        let pid = std::process::id();
        let on_host = self.links.iter().any(|l| l.near == HOST);
        let mut topology = Topology {
            name: format!("{}{pid}x{seq}", self.tag),
            subnet: claim_subnet(pid, seq, on_host),
            namespaces: Vec::new(),
            routers: self.routers.clone(),
            links: Vec::new(),
            host_devs: Vec::new(),
            procs: Vec::new(),
            vip: None,
        };
        let roles = self.routers.iter().chain(self.links.iter().map(|l| &l.far));
        for role in roles {
            if !topology.namespaces.iter().any(|(r, _)| r == role) {
                topology.add_namespace(role);
            }
        }
        for router in &self.routers {
            forward_ipv4(topology.ns(router));
        }
        for (k, spec) in self.links.iter().enumerate() {
            topology.add_link(k, spec, pid, seq, &self);
        }
        if self.static_neighbours {
            topology.pin_neighbours();
        }
        if let Some((router, client, port)) = self.vip {
            let (vip, client_ip) = (topology.address(VIP_LAST), topology.ip(&client));
            run_with_input(
                &[&topology.exec(&router)[..], &["nft", "-f", "-"]].concat(),
                &format!(
                    "table ip uturn_vip {{\n\
                     chain untracked {{\ntype filter hook prerouting priority raw; policy accept;\n\
                     ip daddr {vip} udp dport {port} notrack\n\
                     udp sport {port} ip daddr {client_ip} notrack\n}}\n\
                     chain to_pod {{\ntype filter hook prerouting priority mangle; policy accept;\n}}\n\
                     chain from_pod {{\ntype filter hook postrouting priority mangle; policy accept;\n}}\n\
                     }}\n"
                ),
            );
            topology.vip = Some(Vip {
                router,
                client,
                port,
                backend: None,
            });
        }
        topology
    }
}

/// The third octets (`10.219.T.0/24`) the live topologies of this process hold.
static CLAIMED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

/// A /24 no live topology of this process holds, and, `on_host`, in which the host has no
/// address (another process's topology, say); the search starts at a place of its own per
/// process and topology.
fn claim_subnet(pid: u32, seq: u32, on_host: bool) -> u8 {
    let start = pid.wrapping_mul(31).wrapping_add(seq.wrapping_mul(7));
    let on_the_host = |t: u8| {
        let subnet = format!("10.{NET}.{t}.0/24");
        !run(&["ip", "-o", "-4", "addr", "show", "to", &subnet])
            .trim()
            .is_empty()
    };
    let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
    let free = (0..256u32)
        .map(|i| (start.wrapping_add(i) % 256) as u8)
        .find(|t| !claimed.contains(t) && (!on_host || !on_the_host(*t)))
        .unwrap_or_else(|| panic!("no free /24 in 10.{NET}.0.0/16"));
    claimed.push(free);
    free
}

/// One end of a link as the kernel has it, for a test that builds and injects frames itself
/// ([`Topology::interface`], [`Topology::gateway_interface`]).
#[derive(Clone, Debug)]
pub struct Interface {
    /// Its name in its namespace.
    pub name: String,
    /// Its address (on its link's /30).
    pub ip: Ipv4Addr,
    /// Its MAC address.
    pub mac: [u8; 6],
    /// Its index in its namespace.
    pub index: u32,
}

impl Interface {
    /// Interface `name`, of address `ip`, in namespace `ns` (`None`: the test's own).
    fn read(ns: Option<&str>, name: &str, ip: Ipv4Addr) -> Interface {
        let text = ip_in(ns, &["-j", "link", "show", "dev", name]);
        let link = serde_json::from_str::<serde_json::Value>(&text).unwrap_or_default();
        let index = link[0]["ifindex"]
            .as_u64()
            .and_then(|i| u32::try_from(i).ok());
        let mac = link[0]["address"].as_str().and_then(|mac| {
            let bytes = mac.split(':').map(|b| u8::from_str_radix(b, 16).ok());
            <[u8; 6]>::try_from(bytes.collect::<Option<Vec<u8>>>()?).ok()
        });
        let (Some(index), Some(mac)) = (index, mac) else {
            panic!("no index or MAC address of {name} in: {text}");
        };
        Interface {
            name: name.to_owned(),
            ip,
            mac,
            index,
        }
    }
}

/// A link as made.
struct Link {
    near: String,
    far: String,
    near_dev: String,
    far_dev: String,
    near_ip: Ipv4Addr,
    far_ip: Ipv4Addr,
}

/// The VIP of a topology.
struct Vip {
    router: String,
    client: String,
    port: u16,
    backend: Option<String>,
}

/// A [`Shape`] as made: its namespaces, links and VIP, and the processes started in it; all
/// removed on drop.
pub struct Topology {
    name: String,
    subnet: u8,
    /// (role, namespace) made so far (a half-made topology is undone too).
    namespaces: Vec<(String, String)>,
    routers: Vec<String>,
    links: Vec<Link>,
    /// The near ends made on the host, deleted on drop.
    host_devs: Vec<String>,
    procs: Vec<Killed>,
    vip: Option<Vip>,
}

impl Topology {
    fn add_namespace(&mut self, role: &str) {
        assert!(role != HOST, "{HOST} is the test's own namespace");
        assert!(
            role.len() <= 12,
            "role {role}: 12 characters at most (interface names)"
        );
        let ns = format!("{}-{role}", self.name);
        // Only a dead process with this one's PID can have left a namespace of this name.
        quiet(&["ip", "netns", "del", &ns]);
        run(&["ip", "netns", "add", &ns]);
        self.namespaces.push((role.to_owned(), ns.clone()));
        ip_in(Some(&ns), &["link", "set", "lo", "up"]);
    }

    fn add_link(&mut self, k: usize, spec: &LinkSpec, pid: u32, seq: u32, shape: &Shape) {
        assert!(k < 25, "25 links at most (the /30s below .100)");
        let on_host = spec.near == HOST;
        let near_dev = if on_host {
            format!("ut{pid:x}x{seq:x}l{k}")
        } else {
            format!("to-{}", spec.far)
        };
        let taken = self.links.iter().filter(|l| l.far == spec.far).count();
        let link = Link {
            near: spec.near.clone(),
            far: spec.far.clone(),
            near_dev,
            far_dev: format!("eth{taken}"),
            near_ip: self.address(4 * k as u8 + 1),
            far_ip: self.address(4 * k as u8 + 2),
        };
        let near_ns = (!on_host).then(|| self.ns(&link.near).to_owned());
        if on_host {
            quiet(&["ip", "link", "del", &link.near_dev]);
            self.host_devs.push(link.near_dev.clone());
        }
        let far_ns = self.ns(&link.far).to_owned();
        veth(
            End {
                ns: near_ns.as_deref(),
                dev: &link.near_dev,
                ip: link.near_ip,
            },
            End {
                ns: Some(&far_ns),
                dev: &link.far_dev,
                ip: link.far_ip,
            },
            shape.checksum_offload,
            shape.mtu,
        );
        if taken == 0 && self.routers.contains(&link.near) {
            let gateway = link.near_ip.to_string();
            ip_in(Some(&far_ns), &["route", "add", "default", "via", &gateway]);
        }
        self.links.push(link);
    }

    /// The link whose far end is `role` (its first).
    fn link(&self, role: &str) -> &Link {
        self.links
            .iter()
            .find(|l| l.far == role)
            .unwrap_or_else(|| panic!("no link to role {role} in {}", self.name))
    }

    /// The network namespace of `role` (not [`HOST`]).
    pub fn ns(&self, role: &str) -> &str {
        self.namespaces
            .iter()
            .find(|(r, _)| r == role)
            .map(|(_, ns)| ns.as_str())
            .unwrap_or_else(|| panic!("no role {role} in {}", self.name))
    }

    /// Address `last` of the topology's /24 (`10.219.T.last`): links hold `.1` to `.99`, the
    /// VIP `.100`; the rest is the test's.
    pub fn address(&self, last: u8) -> Ipv4Addr {
        Ipv4Addr::new(10, NET, self.subnet, last)
    }

    /// The address of `role` (its end of its link).
    pub fn ip(&self, role: &str) -> Ipv4Addr {
        self.link(role).far_ip
    }

    /// The address `role` is joined to: its router's (or the host's) end of its link, the
    /// router's address toward `role`.
    pub fn gateway(&self, role: &str) -> Ipv4Addr {
        self.link(role).near_ip
    }

    /// `role`'s interface (its end of its link, in its namespace).
    pub fn dev(&self, role: &str) -> &str {
        &self.link(role).far_dev
    }

    /// The other end of `role`'s link (in the router's namespace, or on the host).
    pub fn gateway_dev(&self, role: &str) -> &str {
        &self.link(role).near_dev
    }

    /// `role`'s interface ([`Topology::dev`]) with its index and MAC address.
    pub fn interface(&self, role: &str) -> Interface {
        let link = self.link(role);
        Interface::read(Some(self.ns(role)), &link.far_dev, link.far_ip)
    }

    /// The other end of `role`'s link ([`Topology::gateway_dev`]) with its index and MAC
    /// address.
    pub fn gateway_interface(&self, role: &str) -> Interface {
        let link = self.link(role);
        Interface::read(self.near_ns(link), &link.near_dev, link.near_ip)
    }

    /// The namespace of `link`'s near end (`None`: the host's).
    fn near_ns(&self, link: &Link) -> Option<&str> {
        (link.near != HOST).then(|| self.ns(&link.near))
    }

    /// On each end of every link, a permanent neighbour entry for the other end
    /// ([`Shape::static_neighbours`]).
    fn pin_neighbours(&self) {
        for link in &self.links {
            let far_ns = Some(self.ns(&link.far));
            let near_ns = self.near_ns(link);
            let far = Interface::read(far_ns, &link.far_dev, link.far_ip);
            let near = Interface::read(near_ns, &link.near_dev, link.near_ip);
            for (ns, on, other) in [(near_ns, &near, &far), (far_ns, &far, &near)] {
                let (ip, mac) = (other.ip.to_string(), other.mac.map(|b| format!("{b:02x}")));
                let entry = [
                    "neigh",
                    "replace",
                    &ip,
                    "lladdr",
                    &mac.join(":"),
                    "dev",
                    &on.name,
                ];
                ip_in(ns, &[&entry[..], &["nud", "permanent"]].concat());
            }
        }
    }

    /// The command prefix that runs a program in `role`'s namespace (`ip netns exec NS`;
    /// nothing for [`HOST`]): a wrapper for [`crate::stunnerd::Stunnerd::start_under`].
    pub fn exec(&self, role: &str) -> Vec<&str> {
        if role == HOST {
            return Vec::new();
        }
        vec!["ip", "netns", "exec", self.ns(role)]
    }

    /// Runs `args` in `role`'s namespace to its end (see [`run`]): its stdout.
    pub fn run_in(&self, role: &str, args: &[&str]) -> String {
        run(&[&self.exec(role)[..], args].concat())
    }

    /// Runs `f` on this thread inside `role`'s namespace (see [`in_netns`]): a socket made
    /// there is `role`'s, whichever thread uses it.
    pub fn in_ns<T>(&self, role: &str, f: impl FnOnce() -> T) -> T {
        if role == HOST {
            return f();
        }
        in_netns(self.ns(role), f)
    }

    /// A UDP socket of `role` bound to its address and `port` (0: any).
    pub fn udp_socket(&self, role: &str, port: u16) -> UdpSocket {
        let ip = self.ip(role);
        self.in_ns(role, || UdpSocket::bind((ip, port)))
            .unwrap_or_else(|e| panic!("bind {ip}:{port} in {role}: {e}"))
    }

    /// Spawns `program ARGS` inside `role`'s namespace, its output discarded; killed when the
    /// topology drops. Its PID.
    pub fn spawn_in(&mut self, role: &str, program: &str, args: &[&str]) -> u32 {
        let command = [&self.exec(role)[..], &[program]].concat();
        let child = Command::new(command[0])
            .args(&command[1..])
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("{program} in {role}: {e}"));
        let pid = child.id();
        self.procs.push(Killed(child));
        pid
    }

    /// A UDP echo peer (python3) on `role`'s address and `port`, killed when the topology
    /// drops; returns once it has echoed a datagram from `role`'s gateway.
    pub fn echo_peer(&mut self, role: &str, port: u16) -> SocketAddr {
        let ip = self.ip(role);
        self.procs.push(crate::peers::echo_peer_in_netns(
            self.ns(role),
            ip.into(),
            port,
        ));
        let peer = SocketAddr::from((ip, port));
        let gateway = self.gateway(role);
        let near = self.link(role).near.clone();
        let probe = self.in_ns(&near, || UdpSocket::bind((gateway, 0))).unwrap();
        probe
            .set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let mut buf = [0u8; 16];
        let echoes = wait_until(10, || {
            let _ = probe.send_to(b"ready?", peer);
            matches!(probe.recv_from(&mut buf), Ok((6, from)) if from == peer)
        });
        assert!(echoes, "the echo peer in {} never answered", self.ns(role));
        peer
    }

    /// `GET path` on `addr` from `role`'s namespace: status code and body.
    pub fn http_get(&self, role: &str, addr: SocketAddr, path: &str) -> Option<(u16, String)> {
        self.in_ns(role, || http_get_from(addr, path))
    }

    /// UDP datagrams `role` received with a bad checksum (`InCsumErrors`).
    pub fn checksum_errors(&self, role: &str) -> u64 {
        udp_checksum_errors(self.ns(role))
    }

    /// Runs an XDP program that passes everything on the router's end of `role`'s link: a
    /// veth delivers the frames XDP sends out of its other end only to a peer that runs XDP
    /// (what a CNI that uses XDP does on the host side). Built with clang ([`build_bpf`]).
    pub fn xdp_pass_on_gateway(&self, role: &str) {
        let object = build_bpf(
            "xdp-pass",
            "#include <linux/bpf.h>\n\
             __attribute__((section(\"xdp\"), used)) int pass(struct xdp_md *c) { return XDP_PASS; }\n\
             char _license[] __attribute__((section(\"license\"), used)) = \"GPL\";\n",
        );
        let link = self.link(role);
        let near = self.near_ns(link);
        let object_path = object.display().to_string();
        let attach = [
            "link",
            "set",
            "dev",
            &link.near_dev,
            "xdpdrv",
            "obj",
            &object_path,
            "sec",
            "xdp",
        ];
        ip_in(near, &attach);
        let _ = std::fs::remove_file(&object);
    }

    fn the_vip(&self) -> &Vip {
        self.vip.as_ref().expect("a shape with a VIP (Shape::vip)")
    }

    /// The service address of [`Shape::vip`]: `10.219.T.100:PORT`.
    pub fn vip(&self) -> SocketAddr {
        (self.address(VIP_LAST), self.the_vip().port).into()
    }

    /// Points the VIP, and with it every flow of the client at once, at role `backend`: both
    /// NAT rules replaced in one nftables transaction (see the module doc).
    pub fn point_vip(&mut self, backend: &str) {
        let vip = self.the_vip();
        let (address, port, client) = (self.address(VIP_LAST), vip.port, self.ip(&vip.client));
        let pod = self.ip(backend);
        run_with_input(
            &[&self.exec(&vip.router)[..], &["nft", "-f", "-"]].concat(),
            &format!(
                "flush chain ip uturn_vip to_pod\n\
                 flush chain ip uturn_vip from_pod\n\
                 add rule ip uturn_vip to_pod ip daddr {address} udp dport {port} counter \
                 ip daddr set {pod}\n\
                 add rule ip uturn_vip from_pod ip saddr {pod} udp sport {port} \
                 ip daddr {client} counter ip saddr set {address}\n"
            ),
        );
        self.vip.as_mut().unwrap().backend = Some(backend.to_owned());
    }

    /// Datagrams (to the backend, from the backend) that the NAT rewrote since the last
    /// [`Topology::point_vip`].
    pub fn vip_steered(&self) -> (u64, u64) {
        let router = &self.the_vip().router;
        let count = |chain: &str| {
            self.run_in(router, &["nft", "list", "chain", "ip", "uturn_vip", chain])
                .split("counter packets ")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        (count("to_pod"), count("from_pod"))
    }

    /// The layout (roles, namespaces, addresses, interfaces) and the VIP's rules with their
    /// counters, for a failure message.
    pub fn describe(&self) -> String {
        let mut text = format!("topology {}:\n", self.name);
        for l in &self.links {
            text += &format!(
                "{} {} ({} in {}) -- {} {} ({})\n",
                l.far,
                l.far_ip,
                l.far_dev,
                self.ns(&l.far),
                l.near,
                l.near_ip,
                l.near_dev
            );
        }
        if let Some(vip) = &self.vip {
            let rules = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    self.ns(&vip.router),
                    "nft",
                    "list",
                    "ruleset",
                ])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            text += &format!(
                "VIP {} on {} for {} -> {}; {}'s nftables:\n{rules}",
                self.vip(),
                vip.router,
                vip.client,
                vip.backend.as_deref().unwrap_or("nothing"),
                vip.router
            );
        }
        text
    }
}

impl Drop for Topology {
    fn drop(&mut self) {
        // Our processes by PID first, then anything left in our own namespaces (only ours can
        // be there), so none keeps a namespace alive; deleting a namespace removes its veth
        // ends (and so the pairs) and its nftables tables.
        self.procs.clear();
        for (_, ns) in self.namespaces.iter().rev() {
            crate::peers::kill_netns_processes(ns);
            quiet(&["ip", "netns", "del", ns]);
        }
        for dev in &self.host_devs {
            quiet(&["ip", "link", "del", dev]);
        }
        let mut claimed = CLAIMED.lock().unwrap_or_else(|e| e.into_inner());
        claimed.retain(|t| *t != self.subnet);
    }
}

//! The test kit's one network-namespace topology: a test describes the shape it needs (which
//! namespaces, which of them route, which are joined to which, checksum offloads, a NATed
//! service VIP) with a [`Shape`], and [`Shape::build`] makes it: a [`Topology`] that owns the
//! namespaces, veth pairs, nftables rules and processes, and removes them all on drop, also
//! when the test panics (or the build itself fails half-way).
//!
//! ```ignore
//! // A pod on a node: `node` routes between `pod`, `client` and `peer`.
//! let shape = Shape::new("uo")
//!     .router("node", &["pod", "client", "peer"])
//!     .checksum_offload(false)
//!     .build();
//! let peer = shape.echo_peer("peer", free_port()); // python3, killed on drop
//! let server = Stunnerd::start_under(&shape.exec("pod"), &args, &[]);
//! let socket = shape.udp_socket("client", 0);
//! // A namespace joined to the test's own (the host's) namespace.
//! let net = Shape::new("ue").host("peer").build();
//! ```
//!
//! # Names and addresses
//!
//! A role (`node`, `pod-a`, `client`, …) is a network namespace named
//! `<tag><pid>x<seq>-<role>`, unique per process and per topology, so the tests of one binary
//! run side by side; [`HOST`] is the test process's own namespace. Every topology has a /24
//! of its own, `10.219.T.0/24` ([`Topology::address`]): unique among this process's live
//! topologies, and, for one with a [`Shape::host`] link, unused by any address of the host
//! (other test processes included). Link `k` (in the order the shape names them) is the /30
//! `.4k`: the near end (the router's, or the host's) is `.4k+1` ([`Topology::gateway`]), the
//! far end `.4k+2` ([`Topology::ip`]); `.100` and up are free for a test's own use (a VIP,
//! routed ranges).
//!
//! The far end of a link is `eth0` in its namespace ([`Topology::dev`]), the near end
//! `to-<role>` in a router ([`Topology::gateway_dev`]) or, on the host, a name unique on the
//! host. Every namespace's loopback is up. A namespace joined to a router has its default
//! route via the router's end; one joined to the host has none (it reaches the host's end
//! on-link, and nothing else). [`Shape::mtu`] sets the veths' MTU, and
//! [`Shape::static_neighbours`] gives both ends of every link a permanent neighbour entry for
//! the other (no ARP); [`Topology::interface`] and [`Topology::gateway_interface`] tell an
//! end's index and MAC address, for a test that builds and injects frames itself.
//!
//! # The VIP: a stateless NAT, so a move is immediate
//!
//! [`Shape::vip`] puts a service address, `10.219.T.100:PORT` ([`Topology::vip`]), on a
//! router, held by no interface (as with kube-proxy's iptables mode): the router's rules alone
//! make it answer, for the one client role. kube-proxy DNATs statefully (conntrack pins a
//! 5-tuple to its first backend until the entry is deleted or times out); to move a flow at
//! once, the router NATs the VIP **statelessly**, in table `ip uturn_vip`:
//!
//! - chain `untracked` (prerouting, priority raw): `notrack` for datagrams to the VIP's port
//!   and from that port to the client, so conntrack keeps no state for the flow at all;
//! - chain `to_pod` (prerouting, priority mangle, before routing): `ip daddr VIP udp dport PORT
//!   ip daddr set BACKEND` (the "DNAT"; the same port on the backend);
//! - chain `from_pod` (postrouting, priority mangle): `ip saddr BACKEND udp sport PORT ip daddr
//!   CLIENT ip saddr set VIP` (the "un-DNAT": the client only ever sees the VIP).
//!
//! nftables fixes the IP header checksum and, as the address is part of the UDP
//! pseudo-header, the UDP checksum of every rewritten datagram. [`Topology::point_vip`]
//! replaces both rules in one nftables transaction: the very next datagram of an existing
//! client 5-tuple reaches the new backend. Only UDP to the VIP is NATed; answers are un-NATed
//! only from the current backend.
//!
//! # Cleanup
//!
//! On drop: the processes the topology started (by PID), then any process left in its
//! namespaces (only its own can be there), then the namespaces (which takes their veth ends,
//! so the pairs, and their nftables tables), then its links on the host. Root is needed; so
//! are `ip` (iproute2), and `ethtool`, `nft`, `python3` or clang where a shape or a test asks
//! for them.

use std::net::Ipv4Addr;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::process::{Command, Stdio};

mod topology;
pub use topology::{Interface, Shape, Topology};

/// The role of the test process's own network namespace (the host's, as the tests run it).
pub const HOST: &str = "host";

/// Runs `args` (a program and its arguments) to its end and returns its stdout; panics with
/// its stderr if it fails (namespaces and nftables need root).
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

/// Runs `args`, its output and failure ignored (cleanup).
fn quiet(args: &[&str]) {
    let _ = Command::new(args[0])
        .args(&args[1..])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
}

/// Makes namespace `ns` route IPv4 between its interfaces (`net.ipv4.ip_forward=1`): a node.
fn forward_ipv4(ns: &str) {
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

/// `ip ARGS` in namespace `ns`, or in the test's own namespace where `ns` is `None`.
fn ip_in(ns: Option<&str>, args: &[&str]) -> String {
    let mut all = vec!["ip"];
    if let Some(ns) = ns {
        all.extend(["-n", ns]);
    }
    all.extend_from_slice(args);
    run(&all)
}

/// One end of a veth pair: its namespace (`None`: the test's own), name and address.
struct End<'a> {
    ns: Option<&'a str>,
    dev: &'a str,
    ip: Ipv4Addr,
}

/// Makes a veth pair from `near` to `far` (both namespaces made already), addresses both ends
/// on one /30, sets their `mtu` (if any) and brings them up; with `checksum_offload` false, both
/// ends compute and verify checksums in software, so that every receiver checks what a rewrite
/// did.
fn veth(near: End, far: End, checksum_offload: bool, mtu: Option<u32>) {
    let far_ns = far.ns.expect("the far end of a link is in a namespace");
    ip_in(
        near.ns,
        &[
            "link", "add", near.dev, "type", "veth", "peer", "name", far.dev, "netns", far_ns,
        ],
    );
    for end in [&near, &far] {
        ip_in(
            end.ns,
            &["addr", "add", &format!("{}/30", end.ip), "dev", end.dev],
        );
        if let Some(mtu) = mtu {
            ip_in(end.ns, &["link", "set", end.dev, "mtu", &mtu.to_string()]);
        }
        ip_in(end.ns, &["link", "set", end.dev, "up"]);
        if !checksum_offload {
            let ethtool = ["ethtool", "-K", end.dev, "tx", "off", "rx", "off"];
            match end.ns {
                Some(ns) => run(&[&["ip", "netns", "exec", ns][..], &ethtool].concat()),
                None => run(&ethtool),
            };
        }
    }
}

/// Compiles BPF C `source` with the clang the dataplane's build found
/// (`uturn_dataplane::io::offload::BPF_CLANG`: the one search for a clang) and returns the
/// object file, a temporary file the caller removes. Panics if the build found none, or if it
/// does not build `source`.
pub fn build_bpf(name: &str, source: &str) -> PathBuf {
    let path = crate::stunnerd::temp_file(&format!("{name}.c"));
    let object = path.with_extension("o");
    std::fs::write(&path, source).unwrap();
    let include = format!("/usr/include/{}-linux-gnu", std::env::consts::ARCH);
    let clang = uturn_dataplane::io::offload::BPF_CLANG.unwrap_or_else(|| {
        panic!("no clang to build BPF program {name} (the README's test command installs it)")
    });
    let built = Command::new(clang)
        .args(["-g", "-O2", "-target", "bpf", "-I", &include, "-c"])
        .arg(&path)
        .arg("-o")
        .arg(&object)
        .status()
        .is_ok_and(|s| s.success());
    let _ = std::fs::remove_file(&path);
    assert!(built, "{clang} did not build BPF program {name}");
    object
}

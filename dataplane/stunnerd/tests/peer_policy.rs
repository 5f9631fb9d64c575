//! The peer policy end to end, against the real stunnerd binary and independent clients on
//! real sockets: the gateway's own addresses (every interface address of the host, both
//! families) are refused as peers unless a cluster lists them exactly.

use std::net::{IpAddr, SocketAddr};
use uturn_perf::turncat::transport::Protocol;
use uturn_testkit::link::{binding_request, TurnLink};
use uturn_testkit::stunnerd::{free_port, wait_until, Stunnerd};

/// A config with TURN-UDP listeners on `port` (advertised 127.0.0.1, as the README's quick
/// start) and `port + 1` (advertised ::1: IPv6 relays), health and metrics on the wildcard,
/// routed to one cluster of `endpoints`.
fn config(port: u16, health: u16, metrics: u16, endpoints: &str) -> String {
    let port6 = port + 1;
    format!(
        "version: v1\n\
         admin: {{healthcheck_endpoint: \"http://:{health}\", metrics_endpoint: \"http://:{metrics}/metrics\"}}\n\
         auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\n\
         listeners: [{{name: udp, protocol: TURN-UDP, address: 127.0.0.1, port: {port}, routes: [any]}}, \
         {{name: udp6, protocol: TURN-UDP, address: \"::1\", port: {port6}, routes: [any]}}]\n\
         clusters: [{{name: any, endpoints: [{endpoints}]}}]\n"
    )
}

/// Writes `text` to `path` through a rename, so a watcher never reads half of it.
fn write_config(path: &std::path::Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// Every address on this host's interfaces (`getifaddrs`), loopback included.
fn own_addresses() -> Vec<IpAddr> {
    let ips = uturn_shared::policy::host_ips();
    assert!(
        ips.iter().any(|ip| !ip.is_loopback()),
        "this test needs a non-loopback interface address (ip -o addr): {ips:?}"
    );
    ips
}

/// Link-local addresses need a scope id to be sent to; the relay has none.
fn sendable(ip: &IpAddr) -> bool {
    !matches!(ip, IpAddr::V6(v6) if v6.segments()[0] & 0xffc0 == 0xfe80)
}

#[test]
fn own_addresses_are_refused_on_every_port_unless_listed_exactly() {
    let (port, health, metrics) = (free_port(), free_port(), free_port());
    let path = uturn_testkit::stunnerd::temp_file("own.yaml");
    let any = "\"0.0.0.0/0\", \"::/0\"";
    write_config(&path, &config(port, health, metrics, any));
    let origin = format!("file://{}", path.display());
    let server_proc = Stunnerd::start(&["-w", "-c", &origin], &[]);
    let server: SocketAddr = ([127, 0, 0, 1], port).into();
    let server6: SocketAddr = ([127, 0, 0, 1], port + 1).into();
    assert!(
        wait_until(10, || uturn_testkit::stunnerd::http_get(health, "/ready")
            .is_some_and(|(c, _)| c == 200)),
        "not ready: {}",
        server_proc.logs()
    );
    let own = own_addresses();
    // For each family: client A probes, client B's relay port is a target.
    let mut clients = Vec::new();
    for ipv6 in [false, true] {
        let at = if ipv6 { server6 } else { server };
        let mut a = TurnLink::connect(Protocol::Udp, at).unwrap();
        let mut b = TurnLink::connect(Protocol::Udp, at).unwrap();
        a.allocate(ipv6, false)
            .unwrap_or_else(|e| panic!("allocate A: {e}: {}", server_proc.logs()));
        let b_relay = b.allocate(ipv6, false).expect("allocate B");
        clients.push((a, b, b_relay.port()));
    }
    let probe = binding_request();
    for ip in &own {
        let (a, _, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        for target_port in [port, port + 1, *b_port, health, metrics] {
            let target = SocketAddr::new(*ip, target_port);
            assert_eq!(
                a.create_permission(target),
                Err(403),
                "CreatePermission {target}"
            );
            assert_eq!(
                a.bind_channel(0x4000, target),
                Err(403),
                "ChannelBind {target}"
            );
            if sendable(ip) {
                a.send_indication(target, &probe);
            }
        }
    }
    for (a, b, _) in &mut clients {
        a.drain(0.5);
        b.drain(0.2);
        assert!(a.data.is_empty(), "relayed back to A: {:?}", a.data);
        assert!(b.data.is_empty(), "reached B's relay: {:?}", b.data);
    }

    // Listed exactly, an own address is a peer: the listener answers a Binding request through
    // the relay, and B's relay port receives what A sends it. This also shows that the probes
    // above would have been seen.
    let listed: Vec<IpAddr> = own
        .iter()
        .copied()
        .filter(|ip| !ip.is_loopback() && sendable(ip))
        .collect();
    let exact: Vec<String> = listed.iter().map(|ip| format!("\"{ip}\"")).collect();
    write_config(
        &path,
        &config(
            port,
            health,
            metrics,
            &format!("{any}, {}", exact.join(", ")),
        ),
    );
    let first = SocketAddr::new(listed[0], port);
    assert!(
        wait_until(10, || clients[usize::from(first.is_ipv6())]
            .0
            .create_permission(first)
            .is_ok()),
        "the exact listing did not apply: {}",
        server_proc.logs()
    );
    for ip in &listed {
        let (a, b, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        let listener = SocketAddr::new(*ip, port);
        a.create_permission(listener)
            .expect("listed listener address");
        a.data.clear();
        a.send_indication(listener, &probe);
        a.drain(0.5);
        assert!(
            a.data.iter().any(|(from, _)| *from == Some(listener)),
            "no answer from the listener at {listener}: {:?}",
            a.data
        );
        // B lets A's relay in (A's relay sends from `ip` to `ip`).
        b.create_permission(SocketAddr::new(*ip, 0))
            .expect("B permits");
        let b_target = SocketAddr::new(*ip, *b_port);
        a.create_permission(b_target).expect("A permits");
        b.data.clear();
        a.send_indication(b_target, b"to B's relay");
        b.drain(0.5);
        assert!(
            b.data.iter().any(|(_, p)| p == b"to B's relay"),
            "B's relay at {b_target} got nothing: {:?}",
            b.data
        );
    }

    // Back to the catch-all: the reloaded snapshot refuses the host's addresses again, for the
    // permissions granted meanwhile too.
    write_config(&path, &config(port, health, metrics, any));
    let (a, _, _) = &mut clients[usize::from(first.is_ipv6())];
    assert!(
        wait_until(10, || a.create_permission(first) == Err(403)),
        "the reload did not refuse {first}: {}",
        server_proc.logs()
    );
    for ip in &listed {
        let (a, b, b_port) = &mut clients[usize::from(ip.is_ipv6())];
        a.data.clear();
        b.data.clear();
        a.send_indication(SocketAddr::new(*ip, port), &probe);
        a.send_indication(SocketAddr::new(*ip, *b_port), b"to B's relay");
        a.drain(0.5);
        b.drain(0.2);
        assert!(
            a.data.is_empty(),
            "after reload, relayed back: {:?}",
            a.data
        );
        assert!(b.data.is_empty(), "after reload, reached B: {:?}", b.data);
    }
    let _ = std::fs::remove_file(&path);
}

/// Payloads received, with the address each came to.
type Received = std::sync::Arc<std::sync::Mutex<Vec<(IpAddr, Vec<u8>)>>>;

/// A UDP socket on each of `ips` at two ports (`port`, `port + 1`), recording every payload (with the address it
/// came to) and echoing it from that address; stops when dropped.
struct Peers {
    port: u16,
    got: Received,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Peers {
    fn on(ips: &[IpAddr]) -> Peers {
        let port = free_port();
        let got: Received = Default::default();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        for (ip, at) in ips.iter().flat_map(|&ip| [(ip, port), (ip, port + 1)]) {
            let socket = std::net::UdpSocket::bind((ip, at)).expect("peer bind");
            socket
                .set_read_timeout(Some(std::time::Duration::from_millis(20)))
                .unwrap();
            let (got, stop) = (got.clone(), stop.clone());
            std::thread::spawn(move || {
                let mut buf = [0u8; 2048];
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    if let Ok((n, from)) = socket.recv_from(&mut buf) {
                        got.lock().unwrap().push((ip, buf[..n].to_vec()));
                        let _ = socket.send_to(&buf[..n], from);
                    }
                }
            });
        }
        Peers { port, got, stop }
    }

    /// The payloads received that start with `tag`.
    fn tagged(&self, tag: &str) -> Vec<IpAddr> {
        let got = self.got.lock().unwrap();
        got.iter()
            .filter(|(_, p)| p.starts_with(tag.as_bytes()))
            .map(|(ip, _)| *ip)
            .collect()
    }
}

impl Drop for Peers {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The host's first non-loopback, non-link-local address of each family.
fn host_address(v6: bool) -> Option<IpAddr> {
    uturn_shared::policy::host_ips()
        .into_iter()
        .find(|ip| ip.is_ipv6() == v6 && !ip.is_loopback() && sendable(ip) && !ip.is_unspecified())
}

fn certificate() -> (String, String) {
    use base64::Engine as _;
    let (cert, key) = uturn_dataplane::io::tls::self_signed("127.0.0.1").unwrap();
    let encode = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
    (encode(&cert), encode(&key))
}

/// One table across every entry point (CreatePermission, ChannelBind, Send indication,
/// ChannelData, datagrams from the peer to the relay) × every client transport (UDP, TCP, TLS,
/// DTLS) × every address encoding, against the real stunnerd: the cluster is the catch-all
/// plus `127.0.0.2` and the host's IPv6 address listed exactly (the admitted controls, which
/// show that each entry point would have carried the packet).
#[test]
fn peer_policy_table_over_entry_points_transports_and_encodings() {
    let own4 = host_address(false).expect("a non-loopback IPv4 address (ip -o addr)");
    let own6 = host_address(true).expect("a global IPv6 address (ip -o addr)");
    let (udp, tcp, secure, health) = (free_port(), free_port(), free_port(), free_port());
    let (cert, key) = certificate();
    let listener = |name: &str, proto: &str, ip: &str, port: u16| {
        let tls = if proto.ends_with("TLS") {
            format!(", cert: \"{cert}\", key: \"{key}\"")
        } else {
            String::new()
        };
        format!(
            "  - {{name: {name}, protocol: {proto}, address: \"{ip}\", port: {port}, routes: [any]{tls}}}\n"
        )
    };
    let mut text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\nlisteners:\n"
    );
    for (kind, proto, port) in [
        ("udp", "TURN-UDP", udp),
        ("tcp", "TURN-TCP", tcp),
        ("tls", "TURN-TLS", secure),
        ("dtls", "TURN-DTLS", secure),
    ] {
        text += &listener(kind, proto, "127.0.0.1", port);
        text += &listener(&format!("{kind}6"), proto, "::1", port + 1);
    }
    text += &format!(
        "clusters: [{{name: any, endpoints: [\"0.0.0.0/0\", \"::/0\", \"127.0.0.2\", \"{own6}\"]}}]\n"
    );
    let path = uturn_testkit::stunnerd::temp_file("table.yaml");
    std::fs::write(&path, &text).unwrap();
    let server = Stunnerd::start(&["-c", &format!("file://{}", path.display())], &[]);
    assert!(
        wait_until(10, || uturn_testkit::stunnerd::http_get(health, "/ready")
            .is_some_and(|(c, _)| c == 200)),
        "not ready: {}",
        server.logs()
    );
    let loop4: IpAddr = "127.0.0.1".parse().unwrap();
    let loop6: IpAddr = "::1".parse().unwrap();
    let allowed4: IpAddr = "127.0.0.2".parse().unwrap();
    let peers = Peers::on(&[allowed4, loop4, loop6, own4, own6]);
    let IpAddr::V4(o4) = own4 else { unreachable!() };
    let o4 = o4.octets();
    let own4_hex = format!(
        "{:x}:{:x}",
        u16::from_be_bytes([o4[0], o4[1]]),
        u16::from_be_bytes([o4[2], o4[3]])
    );
    // (encoding, peer IP as the client writes it, admitted)
    let cases: Vec<(&str, String, bool)> = vec![
        ("plain IPv4 (listed)", "127.0.0.2".into(), true),
        ("mapped (listed)", "::ffff:127.0.0.2".into(), true),
        ("own IPv6 (listed exactly)", own6.to_string(), true),
        ("plain IPv4 loopback", "127.0.0.1".into(), false),
        ("plain IPv4 own", own4.to_string(), false),
        ("mapped loopback", "::ffff:127.0.0.1".into(), false),
        ("mapped own", format!("::ffff:{own4}"), false),
        ("compatible loopback", "::127.0.0.1".into(), false),
        ("compatible own", format!("::{own4}"), false),
        ("NAT64 loopback", "64:ff9b::7f00:1".into(), false),
        ("NAT64 own", format!("64:ff9b::{own4_hex}"), false),
        ("6to4 loopback", "2002:7f00:1::1".into(), false),
        ("6to4 own", format!("2002:{own4_hex}::1"), false),
        (
            "Teredo loopback",
            "2001:0:4136:e378:8000:63bf:80ff:fffe".into(),
            false,
        ),
        ("IPv6 loopback", "::1".into(), false),
        ("unspecified IPv4", "0.0.0.0".into(), false),
        ("unspecified IPv6", "::".into(), false),
        ("metadata", "169.254.169.254".into(), false),
        ("mapped metadata", "::ffff:169.254.169.254".into(), false),
    ];
    let mut failures = Vec::new();
    for (kind, protocol, port) in [
        ("udp", Protocol::Udp, udp),
        ("tcp", Protocol::Tcp, tcp),
        ("tls", Protocol::Tls, secure),
        ("dtls", Protocol::Dtls, secure),
    ] {
        // One client per relay family, on the listener that advertises it.
        let mut links = Vec::new();
        for ipv6 in [false, true] {
            let at = SocketAddr::from(([127, 0, 0, 1], port + u16::from(ipv6)));
            let mut link = TurnLink::connect(protocol, at).expect("connect");
            let relay = link
                .allocate(ipv6, false)
                .unwrap_or_else(|e| panic!("{kind}: allocate: {e}: {}", server.logs()));
            links.push((link, relay));
        }
        for (n, (encoding, literal, admitted)) in cases.iter().enumerate() {
            let ip: IpAddr = literal.parse().unwrap();
            // A peer takes one channel only (RFC 8656 §12): the same IPv4 peer in two encodings
            // gets two ports.
            let peer = SocketAddr::new(ip, peers.port + (n % 2) as u16);
            let v6 = uturn_shared::policy::unmapped_ip(ip).is_ipv6();
            let (link, _) = &mut links[usize::from(v6)];
            let channel = 0x4000 + n as u16;
            let case = format!("{kind} {encoding} {peer}");
            let permit = link.create_permission(peer);
            let bind = link.bind_channel(channel, peer);
            let want = if *admitted { Ok(()) } else { Err(403) };
            if permit != want || bind != want {
                failures.push(format!(
                    "{case}: CreatePermission {permit:?}, ChannelBind {bind:?}"
                ));
            }
            let send_tag = format!("send {case}");
            let channel_tag = format!("chan {case}");
            link.data.clear();
            link.send_indication(peer, send_tag.as_bytes());
            link.send_channel_data(channel, channel_tag.as_bytes());
            link.drain(0.3);
            let reached = (
                peers.tagged(&send_tag).len(),
                peers.tagged(&channel_tag).len(),
            );
            let echoed = link.data.len();
            let want_reach = usize::from(*admitted);
            if reached != (want_reach, want_reach) || (echoed > 0) != *admitted {
                failures.push(format!(
                    "{case}: Send reached {}, ChannelData reached {}, echoes back {echoed}",
                    reached.0, reached.1
                ));
            }
        }
        // Datagrams from refused peers to the relays: never delivered (the relays hold
        // permissions for the listed peers only).
        for (link, relay) in &mut links {
            link.data.clear();
            for from in [loop4, own4, loop6, own6] {
                if from.is_ipv6() != relay.is_ipv6() || from == own6 {
                    continue;
                }
                let socket = std::net::UdpSocket::bind((from, 0)).unwrap();
                socket
                    .send_to(format!("inbound from {from}").as_bytes(), *relay)
                    .unwrap();
            }
            link.drain(0.3);
            if !link.data.is_empty() {
                failures.push(format!("{kind}: inbound delivered {:?}", link.data));
            }
        }
    }
    let _ = std::fs::remove_file(&path);
    assert!(
        failures.is_empty(),
        "{}\n{}",
        failures.join("\n"),
        server.logs()
    );
}

/// The TTL (IPv4) or hop limit (IPv6) of the next datagram on `socket`, which has
/// IP_RECVTTL / IPV6_RECVHOPLIMIT on; `None` if nothing arrives within its read timeout.
fn received_hop_limit(socket: &std::net::UdpSocket) -> Option<i32> {
    use std::os::fd::AsRawFd;
    let mut buf = [0u8; 2048];
    let mut control = [0u8; 256];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: a zeroed msghdr pointing at live buffers of the given lengths.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = control.len();
    // SAFETY: recvmsg on a valid fd with the msghdr above.
    if unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, 0) } < 0 {
        return None;
    }
    // SAFETY: walking the control messages recvmsg filled in, within msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            let c = &*cmsg;
            if (c.cmsg_level, c.cmsg_type) == (libc::IPPROTO_IP, libc::IP_TTL)
                || (c.cmsg_level, c.cmsg_type) == (libc::IPPROTO_IPV6, libc::IPV6_HOPLIMIT)
            {
                return Some(std::ptr::read_unaligned(
                    libc::CMSG_DATA(cmsg).cast::<i32>(),
                ));
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    None
}

fn sysctl(path: &str) -> i32 {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .trim()
        .parse()
        .unwrap()
}

/// Relayed datagrams leave with the system's default TTL and hop limit, never 1 (a TTL of 1
/// would keep media on the node; one the client could set would let it probe the network).
#[test]
fn relayed_datagrams_leave_with_the_default_ttl_and_hop_limit() {
    use std::os::fd::AsRawFd;
    let (port, health) = (free_port(), free_port());
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"http://127.0.0.1:{health}\"}}\n\
         auth: {{type: static, credentials: {{username: user1, password: pass1}}}}\n\
         listeners: [{{name: udp, protocol: TURN-UDP, address: 127.0.0.1, port: {port}, routes: [peers]}}, \
         {{name: udp6, protocol: TURN-UDP, address: \"::1\", port: {}, routes: [peers]}}]\n\
         clusters: [{{name: peers, endpoints: [\"127.0.0.1\", \"::1\"]}}]\n",
        port + 1
    );
    let path = uturn_testkit::stunnerd::temp_file("ttl.yaml");
    std::fs::write(&path, &text).unwrap();
    let server = Stunnerd::start(&["-c", &format!("file://{}", path.display())], &[]);
    assert!(
        wait_until(10, || uturn_testkit::stunnerd::http_get(health, "/ready")
            .is_some_and(|(c, _)| c == 200)),
        "not ready: {}",
        server.logs()
    );
    for (ipv6, peer_ip, want) in [
        (
            false,
            "127.0.0.1",
            sysctl("/proc/sys/net/ipv4/ip_default_ttl"),
        ),
        (true, "::1", sysctl("/proc/sys/net/ipv6/conf/lo/hop_limit")),
    ] {
        let peer = std::net::UdpSocket::bind((peer_ip, 0)).unwrap();
        peer.set_read_timeout(Some(std::time::Duration::from_secs(2)))
            .unwrap();
        let (level, option) = if ipv6 {
            (libc::IPPROTO_IPV6, libc::IPV6_RECVHOPLIMIT)
        } else {
            (libc::IPPROTO_IP, libc::IP_RECVTTL)
        };
        let on: libc::c_int = 1;
        // SAFETY: a valid fd and a c_int option value of the right size.
        let rc = unsafe {
            libc::setsockopt(
                peer.as_raw_fd(),
                level,
                option,
                (&on as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        assert_eq!(rc, 0);
        let mut link = TurnLink::connect(
            Protocol::Udp,
            ([127, 0, 0, 1], port + u16::from(ipv6)).into(),
        )
        .unwrap();
        link.allocate(ipv6, false).expect("allocate");
        let to = peer.local_addr().unwrap();
        link.create_permission(to).expect("permission");
        link.send_indication(to, b"how many hops");
        let got = received_hop_limit(&peer);
        assert_eq!(
            got,
            Some(want),
            "{peer_ip}: relayed with {got:?}, default {want}"
        );
        assert_ne!(got, Some(1));
    }
    let _ = std::fs::remove_file(&path);
}

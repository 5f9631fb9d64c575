//! End to end on loopback: the real `stunnerd` binary against coturn's `turnutils_uclient` and
//! `turnutils_peer`.

use std::io::Read;
use std::net::UdpSocket;
use std::process::{Command, Stdio};
use std::time::Duration;
use uturn_testkit::netns::Shape;
use uturn_testkit::stunnerd::{free_port, metric, Killed};

fn stunnerd(args: &[&str], shards: &str) -> Killed {
    let child = Command::new(env!("CARGO_BIN_EXE_stunnerd"))
        .args(args)
        .env("UTURN_SHARDS", shards)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start stunnerd");
    std::thread::sleep(Duration::from_millis(500));
    Killed(child)
}

fn config_file(auth: &str, port: u16, cluster: &str) -> tempfile_path::Path {
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {auth}\nlisteners: [{{name: udp, address: 127.0.0.1, port: {port}, routes: [media]}}]\nclusters: [{{name: media, endpoints: [\"{cluster}\"]}}]\n"
    );
    tempfile_path::Path::new(&text)
}

mod tempfile_path {
    /// A temporary file removed on drop.
    pub(crate) struct Path(pub std::path::PathBuf);
    impl Path {
        pub(crate) fn new(text: &str) -> Path {
            static COUNTER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = COUNTER.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path =
                std::env::temp_dir().join(format!("uturn-e2e-{}-{n}.yaml", std::process::id()));
            std::fs::write(&path, text).unwrap();
            Path(path)
        }
        pub(crate) fn origin(&self) -> String {
            format!("file://{}", self.0.display())
        }
    }
    impl Drop for Path {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }
}

fn turnutils_peer(port: u16) -> Killed {
    uturn_testkit::peers::turnutils_peer("127.0.0.1", port)
}

/// Runs `turnutils_uclient` and returns (messages sent, messages received, output).
fn uclient(args: &[&str]) -> (u64, u64, String) {
    uclient_for(60, args)
}

/// As [`uclient`], given up after `secs` seconds.
fn uclient_for(secs: u32, args: &[&str]) -> (u64, u64, String) {
    uturn_testkit::stunnerd::uclient(secs, args)
}

const STATIC: &str = "{type: static, credentials: {username: user1, password: \"pa$$w0rd\"}}";

struct Setup {
    _server: Killed,
    _peer: Killed,
    _config: tempfile_path::Path,
    port: String,
    peer_port: String,
}

fn setup(auth: &str) -> Setup {
    let port = free_port();
    let peer_port = free_port();
    let config = config_file(auth, port, "127.0.0.1");
    let server = stunnerd(&["-c", &config.origin()], "2");
    let peer = turnutils_peer(peer_port);
    Setup {
        _server: server,
        _peer: peer,
        _config: config,
        port: port.to_string(),
        peer_port: peer_port.to_string(),
    }
}

fn relay_all(s: &Setup, extra: &[&str], creds: &[&str]) {
    relay_through(60, &s.port, &s.peer_port, extra, creds);
}

/// uclient through listener `port` to the peer on `peer_port`: everything sent comes back.
fn relay_through(secs: u32, port: &str, peer_port: &str, extra: &[&str], creds: &[&str]) {
    relay_to(secs, port, "127.0.0.1", peer_port, extra, creds);
}

/// As [`relay_through`], to a peer on `peer_ip`.
fn relay_to(secs: u32, port: &str, peer_ip: &str, peer_port: &str, extra: &[&str], creds: &[&str]) {
    let mut args = vec![
        "-c", "-n", "20", "-l", "120", "-p", port, "-e", peer_ip, "-r", peer_port,
    ];
    args.extend_from_slice(creds);
    args.extend_from_slice(extra);
    args.push("127.0.0.1");
    let (sent, received, text) = uclient_for(secs, &args);
    assert!(sent > 0, "nothing sent:\n{text}");
    assert_eq!(received, sent, "lost datagrams:\n{text}");
}

#[test]
fn uclient_channel_mode_static_credentials() {
    let s = setup(STATIC);
    relay_all(&s, &["-m", "4"], &["-u", "user1", "-w", "pa$$w0rd"]);
}

#[test]
fn uclient_send_indication_mode_with_dont_fragment() {
    let s = setup(STATIC);
    relay_all(
        &s,
        &["-s", "-g", "-m", "2"],
        &["-u", "user1", "-w", "pa$$w0rd"],
    );
}

#[test]
fn uclient_ephemeral_credentials() {
    let s = setup("{type: ephemeral, credentials: {secret: s3cr3t}}");
    relay_all(&s, &["-m", "2"], &["-W", "s3cr3t", "-u", "alice"]);
}

#[test]
fn uclient_client_to_client() {
    let port = free_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let _server = stunnerd(&["-c", &config.origin()], "2");
    let port = port.to_string();
    let (sent, received, text) = uclient(&[
        "-c",
        "-y",
        "-n",
        "20",
        "-m",
        "2",
        "-p",
        &port,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(sent > 0, "{text}");
    assert_eq!(received, sent, "{text}");
}

/// This host's address on its main interface: a peer of global scope, which a TURN URI's
/// `allow-any` cluster (0.0.0.0/0) admits (loopback peers it refuses, by design).
fn host_ip() -> String {
    let probe = UdpSocket::bind("0.0.0.0:0").unwrap();
    // No datagram is sent: connecting only picks the route and so the source address.
    probe
        .connect("198.51.100.1:9")
        .expect("these tests need a non-loopback interface with a route (eth0 here)");
    let ip = probe.local_addr().unwrap().ip();
    assert!(
        !ip.is_loopback() && !ip.is_unspecified(),
        "no host address: {ip}"
    );
    ip.to_string()
}

#[test]
fn turn_uri_mode_relays() {
    let port = free_port();
    let peer_port = free_port();
    let uri = format!("turn://user1:pass1@127.0.0.1:{port}?transport=udp");
    let server = stunnerd(&[&uri], "1");
    let host = host_ip();
    let _peer = uturn_testkit::peers::turnutils_peer(&host, peer_port);
    let (port, peer_port) = (port.to_string(), peer_port.to_string());
    let args = |peer: &str| {
        [
            "-c",
            "-n",
            "10",
            "-p",
            &port,
            "-e",
            peer,
            "-r",
            &peer_port,
            "-u",
            "user1",
            "-w",
            "pass1",
            "127.0.0.1",
        ]
        .map(str::to_owned)
    };
    // allow-any is 0.0.0.0/0, but the gateway's own addresses are never peers (issue 18 #9):
    // the host's address is refused as loopback is. (A relay that succeeds needs a peer off this
    // host: `turn_uri_mode_relays_to_a_peer_in_a_network_namespace`.)
    let (_, received, text) = uclient(&args(&host).each_ref().map(String::as_str));
    assert!(text.contains("error 403"), "{text}");
    assert_eq!(received, 0, "{text}");
    // allow-any does not reach loopback (CVE-2020-26262's class of bug): the URI's own
    // loopback host is the one address its built-in config names (the README's quickstart),
    // every other loopback address is refused.
    let (_, received, text) = uclient(&args("127.0.0.2").each_ref().map(String::as_str));
    assert!(text.contains("error 403"), "{text}");
    assert_eq!(received, 0, "{text}");
    let (_, _, text) = uclient(&args("127.0.0.1").each_ref().map(String::as_str));
    assert!(!text.contains("error 403"), "{text}");
    let log = server.stdout();
    assert!(
        log.contains("use username \"user1\"") && !log.contains("pass1"),
        "{log}"
    );
}

/// The relay success the tests above cannot show: a TURN-URI stunnerd (allow-any, 0.0.0.0/0)
/// relays to a peer that is not one of this host's addresses, one in a network namespace.
#[test]
fn turn_uri_mode_relays_to_a_peer_in_a_network_namespace() {
    // A peer in a namespace of the test's own, joined to the host: not one of its addresses.
    let mut netns = Shape::new("ue").host("peer").build();
    let peer = netns.echo_peer("peer", free_port());
    let port = free_port();
    // Started after the veth exists, so its host side is one of the gateway's own addresses.
    let uri = format!("turn://user1:pass1@127.0.0.1:{port}?transport=udp");
    let _server = stunnerd(&[&uri], "1");
    let mut client = uturn_testkit::turn_client::TurnClient::new(
        ([127, 0, 0, 1], port).into(),
        "user1",
        "pass1",
    );
    let relay = client.allocate().expect("allocation");
    assert!(client.permit(peer.ip()), "permission for {peer} refused");
    // Ten datagrams of 40 to 913 bytes, each different from the others.
    let payloads: Vec<Vec<u8>> = (0..10u8)
        .map(|i| (0..40 + 97 * usize::from(i)).map(|j| j as u8 ^ i).collect())
        .collect();
    let mut expected = payloads.clone();
    expected.sort();
    // Send indications (back as Data indications), then ChannelData both ways.
    for (how, bind) in [("Send indications", false), ("a channel", true)] {
        if bind {
            assert!(client.bind(peer), "channel to {peer} refused");
        }
        client.received.clear();
        for payload in &payloads {
            client.send(peer, payload);
        }
        let all_back = uturn_testkit::stunnerd::wait_until(5, || {
            client.drive(0.05);
            client.received.len() >= payloads.len()
        });
        let mut echoed: Vec<Vec<u8>> = client
            .received
            .iter()
            .map(|(from, data)| {
                assert_eq!(*from, peer, "data from elsewhere than the peer");
                data.clone()
            })
            .collect();
        echoed.sort();
        assert!(
            all_back,
            "{} of 10 echoed through {relay} by {how}",
            echoed.len()
        );
        assert_eq!(echoed, expected, "through {relay} by {how}");
    }
    // The host side of the veth is one of the gateway's own addresses: refused.
    let host_side = std::net::IpAddr::V4(netns.gateway("peer"));
    assert!(!client.permit(host_side), "{host_side} admitted as a peer");
    assert_eq!(
        client.responses.last().and_then(|r| r.error_code),
        Some(403)
    );
}

#[test]
fn wrong_password_is_refused_and_allocates_nothing() {
    let port = free_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let server = stunnerd(&["-l", "all:DEBUG", "-c", &config.origin()], "1");
    let port = port.to_string();
    let (_, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-p",
        &port,
        "-e",
        "127.0.0.1",
        "-r",
        "9",
        "-u",
        "user1",
        "-w",
        "wrong",
        "127.0.0.1",
    ]);
    assert_eq!(received, 0);
    assert!(text.contains("Cannot complete Allocation"), "{text}");
    let log = server.stdout();
    assert!(!log.contains("Allocation created"), "{log}");
}

#[test]
fn peer_outside_routed_clusters_gets_403_and_nothing_relayed() {
    let port = free_port();
    let peer_port = free_port();
    // Only 127.0.0.1 is routed; the peer listens on 127.0.0.2.
    let config = config_file(STATIC, port, "127.0.0.1");
    let _server = stunnerd(&["-c", &config.origin()], "1");
    let peer = Command::new("turnutils_peer")
        .args(["-p", &peer_port.to_string(), "-L", "127.0.0.2"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map(Killed)
        .unwrap();
    let (port, peer_port) = (port.to_string(), peer_port.to_string());
    let (_, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-p",
        &port,
        "-e",
        "127.0.0.2",
        "-r",
        &peer_port,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(text.contains("error 403"), "{text}");
    assert_eq!(received, 0, "{text}");
    drop(peer);
}

#[test]
fn malformed_datagrams_leave_the_server_serving() {
    let s = setup(STATIC);
    let socket = UdpSocket::bind("127.0.0.1:0").unwrap();
    let target = format!("127.0.0.1:{}", s.port);
    let mut seed: u32 = 0xdead_beef;
    for i in 0..1000u32 {
        seed ^= seed << 13;
        seed ^= seed >> 17;
        seed ^= seed << 5;
        let len = (seed % 200) as usize;
        let mut data: Vec<u8> = (0..len)
            .map(|j| (seed.rotate_left(j as u32) ^ i) as u8)
            .collect();
        if i % 2 == 0 && len >= 20 {
            data[0] = 0;
            data[1] = 3;
            data[4..8].copy_from_slice(&[0x21, 0x12, 0xA4, 0x42]);
        }
        if i % 5 == 0 && len >= 4 {
            data[0] = 0x40;
        }
        socket.send_to(&data, &target).unwrap();
    }
    relay_all(&s, &["-m", "2"], &["-u", "user1", "-w", "pa$$w0rd"]);
}

#[test]
fn udp_thread_num_spreads_64_clients_over_two_shards() {
    let port = free_port();
    let peer_port = free_port();
    let config = config_file(STATIC, port, "127.0.0.1");
    let server = stunnerd(&["-l", "all:DEBUG", "-u", "4", "-c", &config.origin()], "2");
    let _peer = turnutils_peer(peer_port);
    let (port_s, peer_s) = (port.to_string(), peer_port.to_string());
    let (sent, received, text) = uclient(&[
        "-c",
        "-n",
        "5",
        "-m",
        "64",
        "-z",
        "5",
        "-p",
        &port_s,
        "-e",
        "127.0.0.1",
        "-r",
        &peer_s,
        "-u",
        "user1",
        "-w",
        "pa$$w0rd",
        "127.0.0.1",
    ]);
    assert!(sent >= 64 * 5, "{text}");
    assert_eq!(received, sent, "{text}");
    let log = server.stdout();
    let on = |shard: &str| {
        log.lines()
            .filter(|l| l.contains("Allocation created") && l.ends_with(shard))
            .count()
    };
    let (zero, one) = (on("shard=0"), on("shard=1"));
    // turnutils_uclient -m 64 opens two sessions per client.
    assert!(zero + one >= 64, "{zero}+{one} allocations:\n{log}");
    assert!(
        zero > 0 && one > 0,
        "all allocations on one shard: {zero}/{one}"
    );
}

// TURN over TCP, TLS and DTLS: the same uclient runs through each listener kind.

fn free_stream_port() -> u16 {
    loop {
        let port = free_port();
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}

/// A fresh certificate and key as a config carries them (base64 PEM).
fn test_certificate() -> (String, String) {
    use base64::Engine as _;
    let (cert, key) = uturn_dataplane::io::tls::self_signed("127.0.0.1").unwrap();
    let encode = |pem: &str| base64::engine::general_purpose::STANDARD.encode(pem);
    (encode(&cert), encode(&key))
}

const CREDS: [&str; 4] = ["-u", "user1", "-w", "pa$$w0rd"];

/// uclient picks TLS 1.0, 1.1, 1.2 or "any" at random per connection and retries refused
/// ones (TLS 1.0 and 1.1 are refused) about 10 s later: give TLS runs room.
const TLS_SECS: u32 = 170;

struct Streams {
    server: Killed,
    _peer: Killed,
    _config: tempfile_path::Path,
    tcp: String,
    /// TURN-TLS on TCP and TURN-DTLS on UDP share this port.
    secure: String,
    peer_port: String,
}

fn streams_setup(shards: &str) -> Streams {
    let (cert, key) = test_certificate();
    let (tcp, secure, peer_port) = (free_stream_port(), free_stream_port(), free_port());
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {STATIC}\nlisteners:\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {tcp}, routes: [media]}}\n\
         - {{name: tls, protocol: TURN-TLS, address: 127.0.0.1, port: {secure}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}\n\
         - {{name: dtls, protocol: TURN-DTLS, address: 127.0.0.1, port: {secure}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
    );
    let config = tempfile_path::Path::new(&text);
    let server = stunnerd(&["-c", &config.origin()], shards);
    Streams {
        server,
        _peer: turnutils_peer(peer_port),
        _config: config,
        tcp: tcp.to_string(),
        secure: secure.to_string(),
        peer_port: peer_port.to_string(),
    }
}

#[test]
fn uclient_over_tcp_with_channels() {
    let s = streams_setup("2");
    relay_through(60, &s.tcp, &s.peer_port, &["-t", "-m", "2"], &CREDS);
}

#[test]
fn uclient_over_tcp_with_send_indications() {
    let s = streams_setup("2");
    relay_through(60, &s.tcp, &s.peer_port, &["-t", "-s"], &CREDS);
}

#[test]
fn uclient_over_tls_with_channels() {
    let s = streams_setup("2");
    relay_through(TLS_SECS, &s.secure, &s.peer_port, &["-t", "-S"], &CREDS);
}

#[test]
fn uclient_over_tls_with_send_indications() {
    let s = streams_setup("2");
    relay_through(
        TLS_SECS,
        &s.secure,
        &s.peer_port,
        &["-t", "-S", "-s"],
        &CREDS,
    );
}

#[test]
fn uclient_over_dtls_with_channels() {
    let s = streams_setup("2");
    relay_through(60, &s.secure, &s.peer_port, &["-S", "-m", "2"], &CREDS);
}

#[test]
fn uclient_over_dtls_with_send_indications() {
    let s = streams_setup("2");
    relay_through(60, &s.secure, &s.peer_port, &["-S", "-s"], &CREDS);
}

/// A TLS 1.0 ClientHello (no supported_versions extension, TLS 1.0 ciphers).
fn tls10_client_hello() -> Vec<u8> {
    let mut body = vec![0x03, 0x01];
    body.extend([7u8; 32]);
    body.push(0);
    body.extend([0x00, 0x04, 0x00, 0x2f, 0x00, 0x35, 0x01, 0x00]);
    let mut handshake = vec![0x01, 0x00, 0x00, body.len() as u8];
    handshake.extend(body);
    let mut record = vec![0x16, 0x03, 0x01, 0x00, handshake.len() as u8];
    record.extend(handshake);
    record
}

/// What `openssl s_client` with `version_flag` reports about a handshake with `port`.
fn s_client(port: &str, version_flag: &str) -> String {
    let output = Command::new("timeout")
        .args(["10", "openssl", "s_client", "-brief", version_flag])
        .arg(format!("127.0.0.1:{port}"))
        .stdin(Stdio::null())
        .output()
        .expect("openssl (apt-get install openssl)");
    String::from_utf8_lossy(&output.stdout).to_string() + &String::from_utf8_lossy(&output.stderr)
}

#[test]
fn tls_speaks_1_2_and_1_3_and_refuses_1_0() {
    use std::io::Write;
    let s = streams_setup("1");
    for (flag, version) in [("-tls1_2", "TLSv1.2"), ("-tls1_3", "TLSv1.3")] {
        let out = s_client(&s.secure, flag);
        assert!(
            out.contains(&format!("Protocol version: {version}")),
            "{flag}:\n{out}"
        );
    }
    let mut conn = std::net::TcpStream::connect(format!("127.0.0.1:{}", s.secure)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    conn.write_all(&tls10_client_hello()).unwrap();
    let mut reply = Vec::new();
    // The server answers with an alert (never a ServerHello) and closes the connection.
    let closed = conn.read_to_end(&mut reply).is_ok();
    assert!(closed, "connection left open after a TLS 1.0 hello");
    assert_eq!(reply.first(), Some(&0x15), "not an alert: {reply:02x?}");
}

#[test]
fn tls_and_dtls_listeners_without_a_certificate_are_config_errors_naming_them() {
    for protocol in ["TURN-TLS", "TURN-DTLS"] {
        let port = free_stream_port();
        let text = format!(
            "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {STATIC}\nlisteners:\n\
             - {{name: secure-media, protocol: {protocol}, address: 127.0.0.1, port: {port}, routes: [media]}}\n\
             clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
        );
        let config = tempfile_path::Path::new(&text);
        let output = Command::new("timeout")
            .args(["10", env!("CARGO_BIN_EXE_stunnerd"), "-c", &config.origin()])
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(1), "{protocol}: {stderr}");
        assert!(
            stderr.contains("listeners[0].cert") && stderr.contains("\"secure-media\""),
            "{protocol}: {stderr}"
        );
    }
}

#[test]
fn turns_uri_listeners_get_a_self_signed_certificate() {
    let peer_port = free_port();
    let host = host_ip();
    let _peer = uturn_testkit::peers::turnutils_peer(&host, peer_port);
    let peer_port = peer_port.to_string();
    for (transport, flags) in [("tcp", &["-t", "-S"][..]), ("udp", &["-S"][..])] {
        let port = free_stream_port();
        let uri = format!("turns://user1:pass1@127.0.0.1:{port}?transport={transport}");
        let _server = stunnerd(&[&uri], "1");
        eprintln!("uclient through {uri}");
        // The self-signed certificate serves the handshake; the host's own address is then
        // refused as a peer (issue 18 #9), as every TURN-URI peer on this host is.
        let port = port.to_string();
        let mut args = vec![
            "-c", "-n", "5", "-p", &port, "-e", &host, "-r", &peer_port, "-u", "user1", "-w",
            "pass1",
        ];
        args.extend_from_slice(flags);
        args.push("127.0.0.1");
        let (_, received, text) = uclient_for(TLS_SECS, &args);
        assert!(text.contains("session connected"), "{text}");
        assert!(text.contains("error 403"), "{text}");
        assert_eq!(received, 0, "{text}");
    }
}

#[test]
fn stalled_and_idle_stream_clients_leave_other_relays_unaffected() {
    use std::io::Write;
    // One shard: every client below shares it with the relays under test.
    let s = streams_setup("1");
    let tcp = format!("127.0.0.1:{}", s.tcp);
    // Half a STUN message (the header promises 100 bytes), then silence.
    let mut stalled = std::net::TcpStream::connect(&tcp).unwrap();
    stalled
        .write_all(&[0x00, 0x03, 0x00, 0x64, 0x21, 0x12, 0xa4, 0x42, 1, 2, 3, 4])
        .unwrap();
    // Half a TLS record on the TLS listener.
    let mut stalled_tls = std::net::TcpStream::connect(format!("127.0.0.1:{}", s.secure)).unwrap();
    stalled_tls.write_all(&tls10_client_hello()[..9]).unwrap();
    // 500 connections that never send anything, from another address than the relays' (one
    // address holds at most 64 unauthenticated connections; the rest are closed at accept).
    let idle: Vec<socket2::Socket> = (0..500)
        .filter_map(|_| {
            let socket =
                socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).ok()?;
            socket
                .bind(&std::net::SocketAddr::from(([127, 0, 5, 1], 0)).into())
                .ok()?;
            let to: std::net::SocketAddr = tcp.parse().ok()?;
            socket.connect(&to.into()).ok()?;
            Some(socket)
        })
        .collect();
    assert_eq!(idle.len(), 500);
    relay_through(60, &s.tcp, &s.peer_port, &["-t", "-m", "4"], &CREDS);
    relay_through(60, &s.secure, &s.peer_port, &["-S", "-m", "4"], &CREDS);
    drop((stalled, stalled_tls, idle));
    let log = s.server.stdout();
    assert!(!log.contains("panicked"), "{log}");
}

/// A TURN client over its own TCP connection (turnperf's blocking client): allocates with
/// long-term credentials and permits `peer`; returns it and its relay address.
fn tcp_allocation(
    server: &str,
    peer: std::net::SocketAddr,
) -> (uturn_perf::client::BenchClient, std::net::SocketAddr) {
    let mut client = uturn_perf::client::BenchClient::allocate_over(
        server.parse().unwrap(),
        "user1",
        "pa$$w0rd",
        true,
    )
    .expect("allocate over TCP");
    client.create_permission(peer).expect("permission");
    let relay = client.relay;
    (client, relay)
}

#[test]
fn a_client_that_stops_reading_cannot_hold_the_shard() {
    let (tcp, peer_port, metrics) = (free_stream_port(), free_port(), free_stream_port());
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {STATIC}\nlisteners:\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {tcp}, routes: [media]}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
    );
    let config = tempfile_path::Path::new(&text);
    // One shard: the slow client and the relays under test share it.
    let _server = stunnerd(&["-c", &config.origin()], "1");
    let _peer = turnutils_peer(peer_port);
    let flooder = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (slow, relay) = tcp_allocation(&format!("127.0.0.1:{tcp}"), flooder.local_addr().unwrap());
    // The peer floods the client that never reads: 40 000 × 1000 bytes, far more than the
    // kernel's socket buffers and uturn's per-connection queue hold, paced over ~4 s.
    let flood = std::thread::spawn(move || {
        let data = [0x5au8; 1000];
        for i in 0..40_000u32 {
            let _ = flooder.send_to(&data, relay);
            if i % 100 == 0 {
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    });
    std::thread::sleep(Duration::from_millis(500));
    relay_through(
        60,
        &tcp.to_string(),
        &peer_port.to_string(),
        &["-t", "-m", "4"],
        &CREDS,
    );
    flood.join().unwrap();
    let dropped = metric(
        metrics,
        "uturn_dropped_datagrams_total{reason=\"send_failed\"}",
    );
    assert!(
        dropped.is_some_and(|n| n > 0.0),
        "the stalled client's queue was not bounded: send_failed = {dropped:?}"
    );
    drop(slow);
}

/// One STUN message from a TURN-TCP stream (header, then the length it gives).
fn read_stun(conn: &mut std::net::TcpStream) -> Vec<u8> {
    let mut message = vec![0u8; 20];
    conn.read_exact(&mut message).expect("a STUN header");
    let len = usize::from(u16::from_be_bytes([message[2], message[3]]));
    message.resize(20 + len, 0);
    conn.read_exact(&mut message[20..]).expect("a STUN body");
    message
}

/// A client that deletes its allocation and allocates again in one TCP write hands the server
/// both requests in one read: the new allocation must relay (the first one's relay socket is
/// closed, not the new one's).
#[test]
fn an_allocation_made_in_the_read_that_deleted_the_last_one_relays() {
    use std::io::Write;
    use stun_proto::types::attribute::{ErrorCode, Nonce, Realm};
    use stun_proto::types::message::{
        Message, MessageClass, MessageType, MessageWrite as _, MessageWriteExt as _,
        MessageWriteVec, TransactionId,
    };
    use turn_types::attribute::{Data, Lifetime, XorPeerAddress, XorRelayedAddress};
    use turn_types::message::{ALLOCATE, CREATE_PERMISSION, REFRESH, SEND};
    use uturn_perf::client::{build_request, udp_transport, Credentials};
    let tcp = free_stream_port();
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\"}}\nauth: {STATIC}\nlisteners:\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {tcp}, routes: [media]}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
    );
    let config = tempfile_path::Path::new(&text);
    // One shard, so the new Allocate is sure to land where the deleted allocation lived.
    let _server = stunnerd(&["-c", &config.origin()], "1");
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    peer.set_read_timeout(Some(Duration::from_secs(3))).unwrap();
    let mut conn = std::net::TcpStream::connect(("127.0.0.1", tcp)).unwrap();
    conn.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let challenge = build_request(ALLOCATE, &udp_transport, None).unwrap();
    conn.write_all(&challenge).unwrap();
    let reply = read_stun(&mut conn);
    let msg = Message::from_bytes(&reply).unwrap();
    let (realm, nonce) = (
        msg.attribute::<Realm>().unwrap().realm().to_string(),
        msg.attribute::<Nonce>().unwrap().nonce().to_string(),
    );
    let creds = Credentials {
        user: "user1",
        pass: "pa$$w0rd",
        realm: &realm,
        nonce: &nonce,
    };
    let signed =
        |method, attrs: &dyn Fn(&mut _, _)| build_request(method, attrs, Some(&creds)).unwrap();
    let relay_of = |reply: &[u8]| {
        let msg = Message::from_bytes(reply).unwrap();
        assert_eq!(
            msg.class(),
            MessageClass::Success,
            "{:?}",
            msg.attribute::<ErrorCode>().ok()
        );
        msg.attribute::<XorRelayedAddress>()
            .unwrap()
            .addr(msg.transaction_id())
    };
    conn.write_all(&signed(ALLOCATE, &udp_transport)).unwrap();
    relay_of(&read_stun(&mut conn));
    // Delete, and allocate again, in one write.
    let mut both = signed(REFRESH, &|m, _| m.add_attribute(&Lifetime::new(0)).unwrap());
    both.extend_from_slice(&signed(ALLOCATE, &udp_transport));
    conn.write_all(&both).unwrap();
    let deleted = read_stun(&mut conn);
    assert_eq!(
        Message::from_bytes(&deleted).unwrap().class(),
        MessageClass::Success
    );
    let relay = relay_of(&read_stun(&mut conn));
    let peer_addr = peer.local_addr().unwrap();
    let permit = signed(CREATE_PERMISSION, &|m, txid| {
        m.add_attribute(&XorPeerAddress::new(peer_addr, txid))
            .unwrap()
    });
    conn.write_all(&permit).unwrap();
    assert_eq!(
        Message::from_bytes(&read_stun(&mut conn)).unwrap().class(),
        MessageClass::Success
    );
    // The peer reaches the client through the new relay, and the client the peer.
    peer.send_to(b"to the client", relay).unwrap();
    let indication = read_stun(&mut conn);
    assert!(
        indication.windows(13).any(|w| w == b"to the client"),
        "no Data indication through the new allocation's relay"
    );
    let txid = TransactionId::generate();
    let mut send = Message::builder(
        MessageType::from_class_method(MessageClass::Indication, SEND),
        txid,
        MessageWriteVec::new(),
    );
    send.add_attribute(&XorPeerAddress::new(peer_addr, txid))
        .unwrap();
    send.add_attribute(&Data::new(b"to the peer")).unwrap();
    conn.write_all(&send.finish()).unwrap();
    let mut buf = [0u8; 64];
    let (n, from) = peer
        .recv_from(&mut buf)
        .expect("the peer heard nothing from the new allocation's relay");
    assert_eq!(
        (&buf[..n], from.port()),
        (&b"to the peer"[..], relay.port())
    );
}

#[test]
fn closing_a_connection_frees_its_allocation_and_a_stalled_tls_handshake_is_cut_at_10_s() {
    use std::io::Write;
    let (cert, key) = test_certificate();
    let (tcp, tls, metrics) = (free_stream_port(), free_stream_port(), free_stream_port());
    let text = format!(
        "version: v1\nadmin: {{healthcheck_endpoint: \"\", metrics_endpoint: \"http://127.0.0.1:{metrics}/metrics\"}}\n\
         auth: {STATIC}\nlisteners:\n\
         - {{name: tcp, protocol: TURN-TCP, address: 127.0.0.1, port: {tcp}, routes: [media]}}\n\
         - {{name: tls, protocol: TURN-TLS, address: 127.0.0.1, port: {tls}, routes: [media], cert: \"{cert}\", key: \"{key}\"}}\n\
         clusters: [{{name: media, endpoints: [\"127.0.0.1\"]}}]\n"
    );
    let config = tempfile_path::Path::new(&text);
    let _server = stunnerd(&["-c", &config.origin()], "1");
    // A TLS client that stops in the middle of its hello.
    let mut stalled = std::net::TcpStream::connect(("127.0.0.1", tls)).unwrap();
    stalled.write_all(&tls10_client_hello()[..9]).unwrap();
    let stalled_at = std::time::Instant::now();
    let active = || metric(metrics, "stunner_allocations_active ");
    let peer = UdpSocket::bind("127.0.0.1:0").unwrap();
    let (client, _relay) = tcp_allocation(&format!("127.0.0.1:{tcp}"), peer.local_addr().unwrap());
    // Counters are published every 100 ms.
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(active(), Some(1.0));
    drop(client);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(
        active(),
        Some(0.0),
        "the allocation outlived its connection"
    );
    // The server ends the stalled handshake after 10 s (checked once a second): EOF here.
    stalled
        .set_read_timeout(Some(Duration::from_secs(15)))
        .unwrap();
    let mut buf = [0u8; 64];
    let n = stalled.read(&mut buf).unwrap_or(usize::MAX);
    let waited = stalled_at.elapsed();
    assert_eq!(n, 0, "expected the server to close the connection");
    assert!(
        waited >= Duration::from_secs(9) && waited <= Duration::from_secs(13),
        "closed after {waited:?}"
    );
}

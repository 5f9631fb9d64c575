//! What a request on an allocation costs the server with the kernel offload on (`--offload
//! tc`) and off (`--offload none`), side by side in one run (`cargo bench -p uturn-benches
//! --bench offload_requests`; root, network namespaces, BPF). It runs the release `stunnerd`
//! beside this bench's executable: `cargo build --release -p uturn-stunnerd` first.
//!
//! Two real stunnerd processes, one per mode, each with one shard (`UTURN_SHARDS=1`), each in a
//! test-kit topology of its own ([`Shape`]) with the same layout: namespace `gateway` (the
//! server, its relays and the client, all on the gateway's end of its one veth link) and `hop`,
//! the link's far end and the next hop of a route to `198.18.0.0/15` (it forwards nothing: what
//! it gets is dropped). Nothing else is routed: `100.64.0.0/10` has no route. The v1 config's
//! one cluster admits both ranges, so every request succeeds in the engine; the kernel entry of
//! a channel to an unroutable peer cannot be installed (the tc server's `/status` says how many
//! it holds). With two CPUs or more the servers run on CPU 1 and the client on CPU 0, spinning
//! on a non-blocking socket (so that an answer costs the server no wakeup of the client).
//!
//! For each layout of peers (`ports`: N ports on 198.18.0.1; `ips`: N addresses in
//! 198.18.0.0/15; `unroutable ports` and `unroutable ips`: the same in 100.64.0.0/10) and each
//! N, a round makes a fresh allocation on each server, binds N channels to N distinct peers,
//! waits 1.15 s (the sync that follows the binds goes by), then sends K requests of each kind,
//! each answered before the next, then K more in bursts of [`W`] (a burst answered before the
//! next), alternating between the servers kind by kind (which goes first alternates by round):
//!
//! - `refresh`: Refresh with LIFETIME 600;
//! - `permission`: CreatePermission naming one bound peer (request i: peer i mod N), a refresh;
//! - `rebind`: ChannelBind of a bound channel to its peer (request i: channel i mod N);
//! - `new channel`: ChannelBind of a new channel to a new peer (last, as it grows the
//!   allocation: the round ends with N + 2K channels; `--max-permissions` leaves room).
//!
//! The server's CPU for a window is read from `/proc/<pid>/task/<tid>/schedstat` (ns run)
//! before and after, for the shard thread (`uturn-shard-0`, the table's figure) and for every
//! thread of the process; divided by K. The figure is the median over the rounds; the
//! round-trip time is the client's median over all requests of the rounds.
//!
//! The offload defers work to its once-a-second sync, which reads every entry's counters
//! (requests or not) and, when a request marked the allocation (a CreatePermission or
//! ChannelBind does), offers all its channels again: a pass over them, the route cache's misses
//! looked up through netlink. A window of K back-to-back requests rarely holds a sync (the
//! median drops it), so a second measurement, after the rounds, on a fresh allocation: the
//! shard's CPU read every millisecond, a sync being the heaviest 200 ms stretch of a 1.25 s
//! poll (which holds one sync at least). Idle: the median of three idle polls. Then one lone
//! request of each kind and the two syncs after it (the first offers the allocation again; an
//! end it extended is written by the next), less two idle ones. Then a series of 8.5 s with a
//! CreatePermission every 250 ms, so that every sync is marked: each sync's extra over an idle
//! one (min, median, max, mean of the 7 heaviest stretches at least 600 ms apart). none has no
//! such sync: its figures there are the method's floor (a stretch that holds a request, and
//! the bias of picking the heaviest).
//!
//! `--quick` (or `OFFLOAD_REQUESTS_QUICK=1`, or a run without `--bench` as `cargo test
//! --benches` makes): one round of K = 50, no sync measurement. `OFFLOAD_REQUESTS_LAYOUTS=ips,
//! unroutable-ips` runs only those layouts; `OFFLOAD_REQUESTS_PROFILE` profiles one case (see
//! [`profile`]). Without root, or where the BPF program cannot load, it says why and exits 0.

use std::net::{Ipv4Addr, SocketAddr, UdpSocket};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use stun_proto::types::attribute::{ErrorCode, Nonce, Realm};
use stun_proto::types::message::{
    Message, MessageClass, MessageWriteExt, MessageWriteVec, Method, TransactionId,
};
use turn_types::attribute::{ChannelNumber, Lifetime, XorPeerAddress};
use turn_types::message::{ALLOCATE, CHANNEL_BIND, CREATE_PERMISSION, REFRESH};
use uturn_benches::process_cpu_ns;
use uturn_perf::client::{build_request, roomy, udp_transport, Credentials};
use uturn_testkit::netns::{Shape, Topology};
use uturn_testkit::stunnerd::{http_get_from, stunnerd_binary, Stunnerd};

const CHANNELS: [usize; 2] = [256, 2048];
/// Whether clients spin on a non-blocking socket (they have a CPU of their own) or block.
static SPIN: AtomicBool = AtomicBool::new(false);
/// Rounds (the CPU figure is their median) and requests of each kind per round.
const ROUNDS: usize = 5;
const K: usize = 200;
const QUICK_K: usize = 50;
/// The namespace of a server, its relays and its client, and the next hop beyond it.
const GATEWAY: &str = "gateway";
const HOP: &str = "hop";
const PORT: u16 = 3478;
const HEALTH: u16 = 8086;
const USER: &str = "user1";
const PASS: &str = "pass1";
/// How long a poll for the offload's sync lasts (the sync runs every 1 to 1.1 s), and the
/// window its burst is found in.
const POLL: Duration = Duration::from_millis(1250);
const BURST: Duration = Duration::from_millis(200);
/// A poll that holds two syncs at least.
const LONE: Duration = Duration::from_millis(2350);
/// Two syncs are this far apart at least.
const SYNC_APART: Duration = Duration::from_millis(600);
/// The series of marked syncs: a CreatePermission every 250 ms for this long.
const SERIES: Duration = Duration::from_millis(8500);

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Layout {
    Ports,
    Ips,
    UnroutablePorts,
    UnroutableIps,
}

impl Layout {
    const ALL: [Layout; 4] = [
        Layout::Ports,
        Layout::Ips,
        Layout::UnroutablePorts,
        Layout::UnroutableIps,
    ];

    fn name(self) -> &'static str {
        match self {
            Layout::Ports => "ports",
            Layout::Ips => "ips",
            Layout::UnroutablePorts => "unroutable ports",
            Layout::UnroutableIps => "unroutable ips",
        }
    }

    fn routable(self) -> bool {
        matches!(self, Layout::Ports | Layout::Ips)
    }

    /// Peer `i`: distinct ports on one address, or distinct addresses (250 per /24).
    fn peer(self, i: usize) -> SocketAddr {
        let first = if self.routable() {
            [198, 18]
        } else {
            [100, 64]
        };
        match self {
            Layout::Ports | Layout::UnroutablePorts => SocketAddr::new(
                Ipv4Addr::new(first[0], first[1], 0, 1).into(),
                10_000 + i as u16,
            ),
            Layout::Ips | Layout::UnroutableIps => SocketAddr::new(
                Ipv4Addr::new(first[0], first[1], 1 + (i / 250) as u8, 1 + (i % 250) as u8).into(),
                9_000,
            ),
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Refresh,
    Permission,
    Rebind,
    NewChannel,
}

impl Kind {
    const ALL: [Kind; 4] = [
        Kind::Refresh,
        Kind::Permission,
        Kind::Rebind,
        Kind::NewChannel,
    ];

    fn name(self) -> &'static str {
        match self {
            Kind::Refresh => "refresh",
            Kind::Permission => "permission",
            Kind::Rebind => "rebind",
            Kind::NewChannel => "new channel",
        }
    }
}

/// A blocking TURN client over UDP that signs its requests (long-term credentials) and
/// follows a 438 (stale nonce) with the new nonce.
struct Client {
    socket: UdpSocket,
    realm: String,
    nonce: String,
    /// The next channel number and peer index of a new channel.
    next: usize,
}

fn failed(what: &str, reply: &Message<'_>) -> String {
    format!(
        "{what}: {:?} {:?}",
        reply.class(),
        reply
            .attribute::<ErrorCode>()
            .ok()
            .map(|e| (e.code(), e.reason().to_owned()))
    )
}

impl Client {
    /// Allocates on `server` from a fresh socket on its address (made in its namespace).
    fn allocate(server: &Server) -> Client {
        let socket = server
            .topo
            .in_ns(GATEWAY, || UdpSocket::bind((server.ip, 0)))
            .expect("a client socket");
        roomy(&socket);
        socket.connect(server.addr()).unwrap();
        // Spinning on its own CPU, the client needs no wakeup: the server's answer costs it
        // no IPI. On one CPU it blocks (a 500 ms timeout).
        if SPIN.load(Ordering::Relaxed) {
            socket.set_nonblocking(true).unwrap();
        } else {
            socket
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
        }
        let mut client = Client {
            socket,
            realm: String::new(),
            nonce: String::new(),
            next: 0,
        };
        let (challenge, _) = client.exchange(ALLOCATE, &udp_transport, false);
        let msg = Message::from_bytes(&challenge).unwrap();
        client.realm = msg.attribute::<Realm>().unwrap().realm().into();
        client.nonce = msg.attribute::<Nonce>().unwrap().nonce().into();
        client.request(ALLOCATE, &udp_transport, "allocate");
        client
    }

    /// Sends a request (signed if `auth`) until an answer with its transaction id comes back
    /// (3 tries of 500 ms): the answer and its round-trip time.
    fn exchange(
        &self,
        method: Method,
        attrs: &dyn Fn(&mut MessageWriteVec, TransactionId),
        auth: bool,
    ) -> (Vec<u8>, Duration) {
        let credentials = Credentials {
            user: USER,
            pass: PASS,
            realm: &self.realm,
            nonce: &self.nonce,
        };
        let mut buf = [0u8; 2048];
        for _ in 0..3 {
            let request = build_request(method, attrs, auth.then_some(&credentials)).unwrap();
            let txid = Message::from_bytes(&request).unwrap().transaction_id();
            let sent = Instant::now();
            self.socket.send(&request).unwrap();
            let deadline = sent + Duration::from_millis(500);
            while Instant::now() < deadline {
                let n = match self.socket.recv(&mut buf) {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::hint::spin_loop();
                        continue;
                    }
                    Err(_) => break,
                };
                let rtt = sent.elapsed();
                if Message::from_bytes(&buf[..n]).is_ok_and(|m| m.transaction_id() == txid) {
                    return (buf[..n].to_vec(), rtt);
                }
            }
        }
        panic!("no answer to {method:?} after 3 tries");
    }

    /// A signed request that must succeed; its round-trip time.
    fn request(
        &mut self,
        method: Method,
        attrs: &dyn Fn(&mut MessageWriteVec, TransactionId),
        what: &str,
    ) -> Duration {
        loop {
            let (reply, rtt) = self.exchange(method, attrs, true);
            let msg = Message::from_bytes(&reply).unwrap();
            if msg.class() == MessageClass::Success {
                return rtt;
            }
            match (msg.attribute::<ErrorCode>(), msg.attribute::<Nonce>()) {
                (Ok(code), Ok(nonce)) if code.code() == 438 => {
                    self.nonce = nonce.nonce().into();
                }
                _ => panic!("{}", failed(what, &msg)),
            }
        }
    }

    fn bind(&mut self, channel: usize, peer: SocketAddr) -> Duration {
        let (method, attrs) = bind_attrs(channel, peer);
        self.request(method, &*attrs, "channel bind")
    }

    fn refresh(&mut self, seconds: u32) -> Duration {
        self.request(
            REFRESH,
            &move |m: &mut MessageWriteVec, _| {
                m.add_attribute(&Lifetime::new(seconds)).unwrap();
            },
            "refresh",
        )
    }

    /// The method and attributes of request `i` of `kind` on an allocation whose channels
    /// 0..n are bound to `layout`'s peers 0..n (a new channel takes the next number).
    fn attrs(&mut self, kind: Kind, i: usize, n: usize, layout: Layout) -> (Method, Attrs) {
        match kind {
            Kind::Refresh => (
                REFRESH,
                Box::new(|m: &mut MessageWriteVec, _| {
                    m.add_attribute(&Lifetime::new(600)).unwrap();
                }),
            ),
            Kind::Permission => {
                let peer = layout.peer(i % n);
                (
                    CREATE_PERMISSION,
                    Box::new(move |m: &mut MessageWriteVec, txid| {
                        m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
                    }),
                )
            }
            Kind::Rebind => bind_attrs(i % n, layout.peer(i % n)),
            Kind::NewChannel => {
                let next = self.next;
                self.next += 1;
                bind_attrs(next, layout.peer(next))
            }
        }
    }

    /// Request `i` of `kind` (see [`Client::attrs`]), answered: its round-trip time.
    fn send(&mut self, kind: Kind, i: usize, n: usize, layout: Layout) -> Duration {
        let (method, attrs) = self.attrs(kind, i, n, layout);
        self.request(method, &*attrs, kind.name())
    }

    /// Requests `i..i + w` of `kind` sent at once, then their answers (each a success).
    fn burst(
        &mut self,
        kind: Kind,
        i: usize,
        w: usize,
        n: usize,
        layout: Layout,
    ) -> Result<(), String> {
        let mut txids = Vec::with_capacity(w);
        for j in i..i + w {
            let (method, attrs) = self.attrs(kind, j, n, layout);
            let credentials = Credentials {
                user: USER,
                pass: PASS,
                realm: &self.realm,
                nonce: &self.nonce,
            };
            let request = build_request(method, &*attrs, Some(&credentials)).unwrap();
            txids.push(Message::from_bytes(&request).unwrap().transaction_id());
            self.socket.send(&request).unwrap();
        }
        let mut buf = [0u8; 2048];
        let deadline = Instant::now() + Duration::from_secs(1);
        while !txids.is_empty() {
            if Instant::now() > deadline {
                return Err(format!(
                    "{} answers of a burst of {w} {} missing",
                    txids.len(),
                    kind.name()
                ));
            }
            let n = match self.socket.recv(&mut buf) {
                Ok(n) => n,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    continue;
                }
                Err(e) => panic!("recv: {e}"),
            };
            let Ok(msg) = Message::from_bytes(&buf[..n]) else {
                continue;
            };
            if let Some(at) = txids.iter().position(|t| *t == msg.transaction_id()) {
                assert!(
                    msg.class() == MessageClass::Success,
                    "{}",
                    failed(kind.name(), &msg)
                );
                txids.swap_remove(at);
            }
        }
        Ok(())
    }
}

/// A request's attributes, given its transaction id.
type Attrs = Box<dyn Fn(&mut MessageWriteVec, TransactionId)>;

fn bind_attrs(channel: usize, peer: SocketAddr) -> (Method, Attrs) {
    let number = 0x4000 + channel as u16;
    (
        CHANNEL_BIND,
        Box::new(move |m: &mut MessageWriteVec, txid| {
            m.add_attribute(&ChannelNumber::new(number)).unwrap();
            m.add_attribute(&XorPeerAddress::new(peer, txid)).unwrap();
        }),
    )
}

/// A server's namespaces (see the module doc), removed when dropped: `gateway`, joined to
/// `hop`, with 198.18.0.0/15 routed via `hop`, which forwards nothing (whatever the host's
/// `ip_forward` a new namespace copied).
fn topology() -> Topology {
    let topo = Shape::new("uor").router(GATEWAY, &[HOP]).build();
    topo.run_in(HOP, &["sysctl", "-qw", "net.ipv4.ip_forward=0"]);
    let hop = topo.ip(HOP).to_string();
    topo.run_in(
        GATEWAY,
        &["ip", "route", "add", "198.18.0.0/15", "via", &hop],
    );
    topo
}

/// A stunnerd in a namespace of its own (dropped before it).
struct Server {
    stunnerd: Stunnerd,
    /// `/proc/<pid>/task/<shard tid>/schedstat`.
    shard_stat: PathBuf,
    pid: u32,
    config: PathBuf,
    /// The server's address (listener and relays), in `topo`'s `gateway`.
    ip: Ipv4Addr,
    topo: Topology,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.config);
    }
}

/// The first field of a schedstat file: ns the task has run.
fn schedstat(path: &std::path::Path) -> u64 {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0)
}

impl Server {
    fn start(mode: &'static str, max_permissions: usize, pin: bool) -> Result<Server, String> {
        let topo = topology();
        let ip = topo.gateway(HOP);
        let config = std::env::temp_dir().join(format!(
            "uturn-offload-requests-{}-{mode}.yaml",
            std::process::id()
        ));
        std::fs::write(
            &config,
            format!(
                "version: v1\n\
                 admin: {{name: gateway, healthcheck_endpoint: \"http://127.0.0.1:{HEALTH}\"}}\n\
                 auth: {{type: static, credentials: {{username: {USER}, password: {PASS}}}}}\n\
                 listeners: [{{name: udp, protocol: TURN-UDP, address: $STUNNER_ADDR, \
                 port: {PORT}, routes: [media]}}]\n\
                 clusters: [{{name: media, type: STATIC, \
                 endpoints: [\"198.18.0.0/15\", \"100.64.0.0/10\"]}}]\n"
            ),
        )
        .unwrap();
        let origin = format!("file://{}", config.display());
        let max = max_permissions.to_string();
        let host = ip.to_string();
        let mut wrapper = topo.exec(GATEWAY);
        if pin {
            wrapper.extend_from_slice(&["taskset", "-c", "1"]);
        }
        let stunnerd = Stunnerd::start_under(
            &wrapper,
            &["-c", &origin, "--offload", mode, "--max-permissions", &max],
            &[("STUNNER_ADDR", host.as_str()), ("UTURN_SHARDS", "1")],
        );
        let pid = stunnerd.pid();
        let mut server = Server {
            stunnerd,
            shard_stat: PathBuf::new(),
            pid,
            config,
            ip,
            topo,
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if server.status().is_some() {
                break;
            }
            if Instant::now() > deadline || server.stunnerd.wait_exit_for(0.05).is_some() {
                return Err(format!(
                    "stunnerd --offload {mode} never served /status:\n{}",
                    server.stunnerd.logs()
                ));
            }
        }
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).unwrap();
        let shard = tasks
            .filter_map(|t| t.ok())
            .find(|t| {
                std::fs::read_to_string(t.path().join("comm"))
                    .is_ok_and(|c| c.trim() == "uturn-shard-0")
            })
            .ok_or("no thread uturn-shard-0")?;
        server.shard_stat = shard.path().join("schedstat");
        Ok(server)
    }

    /// The `/status` document, if it answers.
    fn status(&self) -> Option<String> {
        let (code, body) = self.topo.in_ns(GATEWAY, || {
            http_get_from(SocketAddr::from(([127, 0, 0, 1], HEALTH)), "/status")
        })?;
        (code == 200).then_some(body)
    }

    /// The offload as `/status` has it: what runs, and the channels the kernel relays.
    fn offload(&self) -> (String, u64) {
        let status = self.status().unwrap_or_default();
        let offload = status.split_once("\"offload\"").map_or("", |(_, o)| o);
        let field = |key: &str| {
            let rest = offload
                .split_once(&format!("\"{key}\""))
                .map_or("", |(_, r)| r);
            let rest = rest.trim_start().trim_start_matches(':').trim_start();
            let end = rest.find([',', '}']).unwrap_or(rest.len());
            rest[..end].trim().trim_matches('"').to_owned()
        };
        (field("running"), field("channels").parse().unwrap_or(0))
    }

    fn addr(&self) -> SocketAddr {
        (self.ip, PORT).into()
    }

    /// (shard thread, whole process) ns run.
    fn cpu(&self) -> (u64, u64) {
        (schedstat(&self.shard_stat), process_cpu_ns(self.pid))
    }

    /// A fresh allocation with channels 0..n bound to `layout`'s peers 0..n.
    fn allocation(&self, n: usize, layout: Layout) -> Client {
        let mut client = Client::allocate(self);
        for i in 0..n {
            client.bind(i, layout.peer(i));
        }
        client.next = n;
        client
    }
}

/// What one window of K requests cost: shard and process ns per request, and the round trips.
struct Window {
    shard: f64,
    process: f64,
    rtts: Vec<Duration>,
}

fn window(
    server: &Server,
    client: &mut Client,
    kind: Kind,
    k: usize,
    n: usize,
    layout: Layout,
) -> Window {
    // The shard asleep since the last answer: its counters are whole.
    std::thread::sleep(Duration::from_millis(2));
    let before = server.cpu();
    let rtts = (0..k).map(|i| client.send(kind, i, n, layout)).collect();
    std::thread::sleep(Duration::from_millis(2));
    let after = server.cpu();
    Window {
        shard: (after.0 - before.0) as f64 / k as f64,
        process: (after.1 - before.1) as f64 / k as f64,
        rtts,
    }
}

/// Bursts of requests in flight at once.
const W: usize = 16;

/// Shard ns per request of K requests sent in bursts of [`W`], each burst answered before the
/// next: the server reads a burst in one wakeup, so what it pays per wakeup is shared.
fn burst_window(
    server: &Server,
    client: &mut Client,
    kind: Kind,
    k: usize,
    n: usize,
    layout: Layout,
) -> f64 {
    std::thread::sleep(Duration::from_millis(2));
    let before = server.cpu();
    for i in (0..k).step_by(W) {
        if let Err(e) = client.burst(kind, i, W.min(k - i), n, layout) {
            panic!("{e}; the server's log:\n{}", server.stunnerd.logs());
        }
    }
    std::thread::sleep(Duration::from_millis(2));
    (server.cpu().0 - before.0) as f64 / k as f64
}

/// Samples of a shard's CPU: (when, ns run so far).
type Samples = Vec<(Instant, u64)>;

/// Reads the shard threads of `servers` every millisecond for `length`, calling `between`
/// every `every` (the first time at once).
fn sample(
    servers: &[&Server],
    length: Duration,
    every: Duration,
    between: &mut dyn FnMut(),
) -> Vec<Samples> {
    let mut samples: Vec<Samples> = vec![Vec::new(); servers.len()];
    let start = Instant::now();
    let mut next = start;
    while start.elapsed() < length {
        if Instant::now() >= next {
            between();
            next += every;
        }
        for (s, server) in samples.iter_mut().zip(servers) {
            s.push((Instant::now(), schedstat(&server.shard_stat)));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    samples
}

/// Reads the shard threads of `servers` for [`POLL`], doing nothing else.
fn poll(servers: &[&Server]) -> Vec<Samples> {
    sample(servers, POLL, POLL * 2, &mut || {})
}

/// The CPU of every [`BURST`]-long stretch of `s` ending at a sample: (its end, ns).
fn stretches(s: &Samples) -> Vec<(Instant, u64)> {
    let mut first = 0;
    (0..s.len())
        .map(|last| {
            while s[last].0 - s[first].0 > BURST {
                first += 1;
            }
            (s[last].0, s[last].1 - s[first].1)
        })
        .collect()
}

/// The most CPU any [`BURST`] of `s` held.
fn heaviest(s: &Samples) -> u64 {
    stretches(s).iter().map(|&(_, ns)| ns).max().unwrap_or(0)
}

/// The `count` heaviest [`BURST`]s of `s` at least [`SYNC_APART`] apart (one per sync).
fn syncs(s: &Samples, count: usize) -> Vec<u64> {
    let mut all = stretches(s);
    all.sort_by_key(|&(_, ns)| std::cmp::Reverse(ns));
    let mut chosen: Vec<(Instant, u64)> = Vec::new();
    for (at, ns) in all {
        if chosen.len() == count {
            break;
        }
        let apart = |c: &(Instant, u64)| {
            let d = if c.0 > at { c.0 - at } else { at - c.0 };
            d >= SYNC_APART
        };
        if chosen.iter().all(apart) {
            chosen.push((at, ns));
        }
    }
    chosen.into_iter().map(|(_, ns)| ns).collect()
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

fn median_duration(values: &mut [Duration]) -> Duration {
    values.sort();
    values[values.len() / 2]
}

/// One table row: a (layout, N, kind) for both modes.
#[derive(Default)]
struct Row {
    /// Per mode (none, tc): per-round shard and process ns per request, and every round trip.
    shard: [Vec<f64>; 2],
    process: [Vec<f64>; 2],
    rtts: [Vec<Duration>; 2],
    /// Per mode: per-round shard ns per request in bursts of [`W`].
    burst: [Vec<f64>; 2],
    /// Per mode: what the sync after a lone request owed it (ns), if measured.
    deferred: [Option<f64>; 2],
}

struct Case {
    layout: Layout,
    n: usize,
    /// Channels the tc server's kernel held after the binds.
    held: u64,
    /// Per mode: the heaviest 200 ms of an idle poll, and idle ns per second.
    idle: [Option<(u64, f64)>; 2],
    /// Per mode: what each sync of a series of marked ones cost more than an idle one, ns.
    passes: [Vec<f64>; 2],
    rows: Vec<(Kind, Row)>,
}

fn pin_self_to_cpu0() {
    // SAFETY: a zeroed cpu_set_t filled by the libc macros, for this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(0, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set);
    }
}

fn run_case(
    layout: Layout,
    n: usize,
    rounds: usize,
    k: usize,
    deferred: bool,
    pin: bool,
) -> Result<Case, String> {
    // Room for the new channels (and their permissions) of a round and the lone one.
    let max_permissions = n + 2 * k + 64;
    let servers = [
        Server::start("none", max_permissions, pin)?,
        Server::start("tc", max_permissions, pin)?,
    ];
    let (running, _) = servers[1].offload();
    if running != "tc" {
        return Err(format!(
            "stunnerd --offload tc runs offload {running:?}:\n{}",
            servers[1].stunnerd.logs()
        ));
    }
    let mut rows: Vec<(Kind, Row)> = Kind::ALL.iter().map(|&k| (k, Row::default())).collect();
    let mut held = 0;
    let mut clients: [Option<Client>; 2] = [None, None];
    for round in 0..rounds {
        let order = if round % 2 == 0 { [0, 1] } else { [1, 0] };
        for (m, server) in servers.iter().enumerate() {
            if let Some(mut old) = clients[m].take() {
                old.refresh(0);
            }
            clients[m] = Some(server.allocation(n, layout));
        }
        // The sync after the binds (and the full pass they marked) goes by.
        std::thread::sleep(Duration::from_millis(1150));
        held = servers[1].offload().1;
        for (kind, row) in rows.iter_mut() {
            for m in order {
                let client = clients[m].as_mut().unwrap();
                let w = window(&servers[m], client, *kind, k, n, layout);
                row.shard[m].push(w.shard);
                row.process[m].push(w.process);
                row.rtts[m].extend(w.rtts);
                row.burst[m].push(burst_window(&servers[m], client, *kind, k, n, layout));
            }
        }
    }
    let mut idle = [None, None];
    let mut passes: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    if deferred {
        let [none, tc] = &servers;
        let mut fresh = [
            Some(none.allocation(n, layout)),
            Some(tc.allocation(n, layout)),
        ];
        for (m, client) in clients.iter_mut().enumerate() {
            if let Some(mut old) = client.take() {
                old.refresh(0);
            }
            *client = fresh[m].take();
        }
        // Flush what the binds marked (a sync's pass, the extensions it left to the next
        // one), then three idle polls (their medians count: the idle shard sees a stray heavy
        // stretch now and then, in both servers at once).
        poll(&[none, tc]);
        poll(&[none, tc]);
        held = tc.offload().1;
        let quiet = [poll(&[none, tc]), poll(&[none, tc]), poll(&[none, tc])];
        for m in 0..2 {
            let mut bursts: Vec<f64> = quiet.iter().map(|q| heaviest(&q[m]) as f64).collect();
            let mut rates: Vec<f64> = quiet
                .iter()
                .map(|q| (q[m][q[m].len() - 1].1 - q[m][0].1) as f64 / POLL.as_secs_f64())
                .collect();
            idle[m] = Some((median(&mut bursts) as u64, median(&mut rates)));
        }
        let idle_burst = |m: usize| idle[m].map_or(0.0, |(burst, _)| burst as f64);
        // One lone request of each kind, the two syncs after it (the first offers the
        // allocation again, the second writes the extensions that waited for it).
        for (kind, row) in rows.iter_mut() {
            for client in clients.iter_mut() {
                client.as_mut().unwrap().send(*kind, 1, n, layout);
            }
            std::thread::sleep(Duration::from_millis(2));
            let after = sample(&[none, tc], LONE, LONE * 2, &mut || {});
            for (m, samples) in after.iter().enumerate() {
                let two: u64 = syncs(samples, 2).iter().sum();
                row.deferred[m] = Some(two as f64 - 2.0 * idle_burst(m));
            }
        }
        // A CreatePermission every 250 ms for SERIES: every sync is marked.
        let mut i = 0;
        let series = sample(&[none, tc], SERIES, Duration::from_millis(250), &mut || {
            for client in clients.iter_mut() {
                client
                    .as_mut()
                    .unwrap()
                    .send(Kind::Permission, i, n, layout);
            }
            i += 1;
        });
        let count = (SERIES.as_secs_f64() / 1.1).floor() as usize;
        for m in 0..2 {
            passes[m] = syncs(&series[m], count)
                .into_iter()
                .map(|ns| ns as f64 - idle_burst(m))
                .collect();
        }
    }
    drop(clients);
    Ok(Case {
        layout,
        n,
        held,
        idle,
        passes,
        rows,
    })
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let quick = args.iter().any(|a| a == "--quick")
        || !args.iter().any(|a| a == "--bench")
        || std::env::var("OFFLOAD_REQUESTS_QUICK").is_ok_and(|v| !v.is_empty() && v != "0");
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        println!("offload_requests: skipped: needs root (network namespaces, BPF)");
        return;
    }
    if let Err(why) = uturn_dataplane::io::offload::Offload::load() {
        println!("offload_requests: skipped: the BPF program cannot load: {why}");
        return;
    }
    let binary = stunnerd_binary();
    let (rounds, k, deferred) = if quick {
        (1, QUICK_K, false)
    } else {
        (ROUNDS, K, true)
    };
    // Two CPUs or more: the servers on CPU 1, this client on CPU 0.
    let pin = std::thread::available_parallelism().is_ok_and(|n| n.get() >= 2);
    if pin {
        pin_self_to_cpu0();
        SPIN.store(true, Ordering::Relaxed);
    }
    println!(
        "offload_requests: {} (modified {:?} ago); {rounds} round(s) of K = {k} requests of \
         each kind per layout and N, alternating --offload none and tc; servers {}",
        binary.display(),
        std::fs::metadata(&binary)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.elapsed().ok())
            .map(|d| Duration::from_secs(d.as_secs()))
            .unwrap_or_default(),
        if pin {
            "pinned to CPU 1, client on CPU 0"
        } else {
            "not pinned (one CPU)"
        }
    );
    if let Ok(spec) = std::env::var("OFFLOAD_REQUESTS_PROFILE") {
        profile(&spec, pin);
        return;
    }
    let started = Instant::now();
    let mut cases = Vec::new();
    // OFFLOAD_REQUESTS_LAYOUTS=ips,unroutable-ips: only those.
    let only = std::env::var("OFFLOAD_REQUESTS_LAYOUTS").unwrap_or_default();
    for layout in Layout::ALL {
        if !only.is_empty()
            && !only
                .split(',')
                .any(|l| l == layout.name().replace(' ', "-"))
        {
            continue;
        }
        for n in CHANNELS {
            let t = Instant::now();
            match run_case(layout, n, rounds, k, deferred, pin) {
                Ok(case) => {
                    println!(
                        "  {:<16} N = {n:>4}: tc kernel holds {} channels after the binds ({:.1} s)",
                        layout.name(),
                        case.held,
                        t.elapsed().as_secs_f64()
                    );
                    cases.push(case);
                }
                Err(why) => {
                    println!("offload_requests: skipped: {why}");
                    return;
                }
            }
        }
    }
    println!();
    println!(
        "Server CPU per request, µs of the shard thread (uturn-shard-0), median of {rounds} \
         round(s) of K = {k}: one at a time (each answered before the next), and in bursts of \
         {W}; all threads of the process one at a time; the client's round trip (median, one at \
         a time). * marks tc over 2x none."
    );
    println!(
        "| peers | N | request | none | tc | tc/none | all threads none | all threads tc | \
         burst none | burst tc | burst tc/none | rtt none | rtt tc |"
    );
    println!("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
    for case in &mut cases {
        for (kind, row) in case.rows.iter_mut() {
            let shard = [median(&mut row.shard[0]), median(&mut row.shard[1])];
            let process = [median(&mut row.process[0]), median(&mut row.process[1])];
            let burst = [median(&mut row.burst[0]), median(&mut row.burst[1])];
            let rtt = [
                median_duration(&mut row.rtts[0]),
                median_duration(&mut row.rtts[1]),
            ];
            let ratio = |r: f64| format!("{r:.2}{}", if r > 2.0 { " *" } else { "" });
            println!(
                "| {} | {} | {} | {:.2} | {:.2} | {} | {:.2} | {:.2} | {:.2} | {:.2} | {} | {:.1} | {:.1} |",
                case.layout.name(),
                case.n,
                kind.name(),
                shard[0] / 1e3,
                shard[1] / 1e3,
                ratio(shard[1] / shard[0]),
                process[0] / 1e3,
                process[1] / 1e3,
                burst[0] / 1e3,
                burst[1] / 1e3,
                ratio(burst[1] / burst[0]),
                rtt[0].as_secs_f64() * 1e6,
                rtt[1].as_secs_f64() * 1e6,
            );
        }
    }
    if deferred {
        println!();
        println!(
            "The once-a-second sync, µs of shard CPU. idle: the heaviest {} ms of an idle {:.2} s \
             (a sync's counter reads; median of 3 polls) and the idle shard's µs per second. \
             refresh .. new channel: the two syncs after one lone request, less two idle ones. \
             series (a CreatePermission every 250 ms, every sync marked): each sync less an \
             idle one.",
            BURST.as_millis(),
            POLL.as_secs_f64()
        );
        println!(
            "| peers | N | mode | idle burst | idle µs/s | refresh | permission | rebind | \
             new channel | series min | median | max | mean |"
        );
        println!("|---|--:|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|");
        for case in &mut cases {
            for (m, mode) in ["none", "tc"].iter().enumerate() {
                let idle = case.idle[m].unwrap_or_default();
                let owed: Vec<String> = case
                    .rows
                    .iter()
                    .map(|(_, row)| format!("{:.0}", row.deferred[m].unwrap_or(f64::NAN) / 1e3))
                    .collect();
                let passes = &mut case.passes[m];
                let mean = passes.iter().sum::<f64>() / passes.len().max(1) as f64;
                let (min, max) = (
                    passes.iter().copied().fold(f64::INFINITY, f64::min),
                    passes.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                );
                println!(
                    "| {} | {} | {mode} | {:.0} | {:.0} | {} | {:.0} | {:.0} | {:.0} | {:.0} |",
                    case.layout.name(),
                    case.n,
                    idle.0 as f64 / 1e3,
                    idle.1 / 1e3,
                    owed.join(" | "),
                    min / 1e3,
                    median(passes) / 1e3,
                    max / 1e3,
                    mean / 1e3,
                );
            }
        }
        println!();
        println!(
            "A CreatePermission alone in its second (one request a second on the allocation): \
             µs of shard CPU; none: one at a time (above); tc: one at a time plus what a marked \
             sync costs more than none's stretch with a request (series means, tc less none)"
        );
        println!("| peers | N | none | tc | tc/none |");
        println!("|---|--:|--:|--:|--:|");
        for case in &mut cases {
            let mean = |m: usize| {
                let passes = &case.passes[m];
                passes.iter().sum::<f64>() / passes.len().max(1) as f64
            };
            let pass = (mean(1) - mean(0)).max(0.0);
            let row = &mut case.rows[1].1;
            let lone = [median(&mut row.shard[0]), median(&mut row.shard[1]) + pass];
            println!(
                "| {} | {} | {:.1} | {:.1} | {:.1}{} |",
                case.layout.name(),
                case.n,
                lone[0] / 1e3,
                lone[1] / 1e3,
                lone[1] / lone[0],
                if lone[1] > 2.0 * lone[0] { " *" } else { "" }
            );
        }
    }
    println!();
    println!("offload_requests: {:.0} s", started.elapsed().as_secs_f64());
}

/// `OFFLOAD_REQUESTS_PROFILE=LAYOUT:N:KIND:MODE:SECONDS[:INTERVAL_MS]` (`ips:2048:rebind:tc:10`;
/// layouts `ports`, `ips`, `unroutable-ports`, `unroutable-ips`; kinds `refresh`,
/// `permission`, `rebind`, `new-channel`): one server and allocation as a round makes them,
/// then requests of the one kind back to back (or one every INTERVAL_MS) for SECONDS under
/// `perf record --call-graph dwarf` (if perf is installed; else the pid is printed for another
/// profiler), and
/// the shard's CPU per request (all of it, syncs included).
fn profile(spec: &str, pin: bool) {
    let parts: Vec<&str> = spec.split(':').collect();
    let (&[layout, n, kind, mode, secs], interval) = (&parts[..5.min(parts.len())], parts.get(5))
    else {
        panic!("OFFLOAD_REQUESTS_PROFILE={spec}: LAYOUT:N:KIND:MODE:SECONDS[:INTERVAL_MS]");
    };
    let interval = interval.map(|ms| Duration::from_millis(ms.parse().expect("INTERVAL_MS")));
    let layout = *Layout::ALL
        .iter()
        .find(|l| l.name().replace(' ', "-") == layout)
        .expect("a layout: ports, ips, unroutable-ports, unroutable-ips");
    let kind = *Kind::ALL
        .iter()
        .find(|k| k.name().replace(' ', "-") == kind)
        .expect("a kind: refresh, permission, rebind, new-channel");
    let n: usize = n.parse().expect("N");
    let secs: f64 = secs.parse().expect("SECONDS");
    let mode = if mode == "tc" { "tc" } else { "none" };
    let server = Server::start(mode, n + 200_000, pin).unwrap_or_else(|e| panic!("{e}"));
    let mut client = server.allocation(n, layout);
    std::thread::sleep(Duration::from_millis(1150));
    let out = std::env::temp_dir().join(format!("offload-requests-{mode}.perf.data"));
    let perf = std::process::Command::new("perf")
        .args(["record", "--call-graph", "dwarf,16384", "-F", "2000", "-o"])
        .arg(&out)
        .args(["-p", &server.pid.to_string(), "--", "sleep"])
        .arg(secs.to_string())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn();
    println!(
        "profile: {} N = {n} {} --offload {mode}: pid {}, {} for {secs} s",
        layout.name(),
        kind.name(),
        server.pid,
        match &perf {
            Ok(_) => format!("perf record --call-graph dwarf into {}", out.display()),
            Err(e) => format!("no perf ({e})"),
        }
    );
    // Rebinds and refreshes go on as long as asked; new channels until the numbers run out.
    let before = server.cpu();
    let start = Instant::now();
    let mut requests = 0;
    while start.elapsed().as_secs_f64() < secs && (kind != Kind::NewChannel || client.next < 0x3f00)
    {
        client.send(kind, requests, n, layout);
        requests += 1;
        if let Some(interval) = interval {
            std::thread::sleep(interval);
        }
    }
    let after = server.cpu();
    println!(
        "profile: {requests} requests, shard {:.2} µs each (process {:.2})",
        (after.0 - before.0) as f64 / requests as f64 / 1e3,
        (after.1 - before.1) as f64 / requests as f64 / 1e3
    );
    if let Ok(mut perf) = perf {
        let _ = perf.wait();
    }
}

//! turnperf's load: N allocations (each its own client socket, so its own 5-tuple), a built-in
//! peer, paced or unpaced senders for each direction, and receivers that time every datagram
//! from the timestamp it carries.
//!
//! Payload layout (at least [`HEADER`] bytes): `UTPF`, allocation index (u32), sequence (u64),
//! send time in ns since the run's epoch (u64), then zero padding.

use crate::client::{channel_data_header, roomy, BenchClient};
use crate::histogram::Histogram;
use serde::Serialize;
use std::io;
use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use uturn_udp::SendQueue;

/// Bytes of the timing header every payload starts with.
pub const HEADER: usize = 24;
const MAGIC: &[u8; 4] = b"UTPF";
const FIRST_CHANNEL: u16 = 0x4000;
/// The most allocations one run may hold.
pub const MAX_ALLOCATIONS: usize = 10_000;
const BATCH: usize = 16;

/// Credentials.
#[derive(Debug, Clone)]
pub enum Auth {
    /// Static username and password.
    Static {
        /// Username.
        user: String,
        /// Password.
        pass: String,
    },
    /// TURN REST (ephemeral) credentials minted from a shared secret.
    Ephemeral {
        /// The shared secret.
        secret: String,
        /// The user id part of the username.
        user: String,
    },
}

impl Auth {
    fn credentials(&self) -> (String, String) {
        match self {
            Auth::Static { user, pass } => (user.clone(), pass.clone()),
            Auth::Ephemeral { secret, user } => {
                let expiry = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_secs())
                    .unwrap_or(0)
                    + 3600;
                let username = uturn_shared::auth::ephemeral_username(expiry, user);
                let password = uturn_shared::auth::ephemeral_password(secret, &username);
                (username, password)
            }
        }
    }
}

/// Which way data flows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Direction {
    /// Client → peer.
    Up,
    /// Peer → client.
    Down,
    /// Both at once.
    Both,
}

/// How the client frames data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// ChannelData (after ChannelBind).
    Channel,
    /// Send indications (the server answers with Data indications).
    Send,
    /// No TURN at all: raw datagrams through udprelay, the machine's ceiling.
    Plain,
    /// No relay at all (UDP): each client socket exchanges its datagrams with the built-in
    /// peer directly, the same traffic a relay would carry. The baseline a relay's machine
    /// cost is measured against; `server` is not used.
    Direct,
}

/// What to run.
#[derive(Debug, Clone)]
pub struct LoadConfig {
    /// The TURN server (UDP).
    pub server: SocketAddr,
    /// Credentials.
    pub auth: Auth,
    /// Allocations, 1 to [`MAX_ALLOCATIONS`].
    pub allocations: usize,
    /// Payload bytes per datagram (at least [`HEADER`]).
    pub size: usize,
    /// Where the built-in peer binds.
    pub peer_ip: IpAddr,
    /// Framing.
    pub mode: Mode,
    /// With [`Mode::Plain`]: udprelay's relay port (`server` is its listen port).
    pub plain_relay: Option<SocketAddr>,
    /// Unpaced client→server batches go as one UDP GSO message each (the server still
    /// receives separate datagrams): a cheaper sender, so the generator can outrun a server.
    pub gso: bool,
    /// TURN over TCP: each allocation on its own connection.
    pub tcp: bool,
    /// Paced runs send this many datagrams per allocation back to back when they are due
    /// (1 to 16; a video frame is a burst like this), as one GSO message with `gso`.
    pub burst: usize,
    /// Source addresses the UDP clients bind, in turn (empty: the loopback address). Many
    /// allocations from one address meet the server's per-source challenge limit.
    pub sources: Vec<IpAddr>,
}

/// The allocations and the peer, ready for runs.
pub struct Setup {
    clients: Vec<BenchClient>,
    peer: UdpSocket,
    peer_addr: SocketAddr,
    /// Allocations set up per second (Allocate + CreatePermission + ChannelBind, with auth).
    pub setup_rate: f64,
    size: usize,
    mode: Mode,
    gso: bool,
    tcp: bool,
    burst: usize,
}

/// Allocates, permits and binds every allocation to the built-in peer.
pub fn setup(config: &LoadConfig) -> io::Result<Setup> {
    if config.allocations == 0 || config.allocations > MAX_ALLOCATIONS {
        return Err(io::Error::other(format!(
            "--allocations {}: use 1 to {MAX_ALLOCATIONS}",
            config.allocations
        )));
    }
    if config.size < HEADER || config.size > 1400 {
        return Err(io::Error::other(format!(
            "--size {}: use {HEADER} to 1400 bytes (the timing header takes {HEADER})",
            config.size
        )));
    }
    if config.burst == 0 || config.burst > BATCH {
        return Err(io::Error::other(format!(
            "--burst {}: use 1 to {BATCH}",
            config.burst
        )));
    }
    if config.tcp && matches!(config.mode, Mode::Plain | Mode::Direct) {
        let mode = if config.mode == Mode::Plain {
            "plain (udprelay)"
        } else {
            "direct"
        };
        return Err(io::Error::other(format!(
            "--mode {mode} is UDP only: drop --transport tcp"
        )));
    }
    let peer = UdpSocket::bind((config.peer_ip, 0))?;
    roomy(&peer);
    let peer_addr = peer.local_addr()?;
    let started = Instant::now();
    let mut clients = Vec::with_capacity(config.allocations);
    if config.mode == Mode::Plain {
        let relay = config.plain_relay.ok_or_else(|| {
            io::Error::other("--mode plain needs --plain-relay ADDR (udprelay prints it)")
        })?;
        peer.send_to(b"UTPF-PEER", relay)?;
        for i in 0..config.allocations {
            let socket = connected(config.server.ip(), config.server)?;
            socket.send(format!("UTPF-CLIENT {i}").as_bytes())?;
            clients.push(BenchClient::plain(socket, relay));
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    if config.mode == Mode::Direct {
        // Each client talks to the peer itself; the peer sends (down) to the client's own
        // address, where a relay would have given its relay address.
        for i in 0..config.allocations {
            let source = config
                .sources
                .get(i % config.sources.len().max(1))
                .copied()
                .unwrap_or(config.peer_ip);
            let socket = connected(source, peer_addr)?;
            let own = socket.local_addr()?;
            clients.push(BenchClient::plain(socket, own));
        }
    }
    for i in 0..config.allocations {
        if matches!(config.mode, Mode::Plain | Mode::Direct) {
            break;
        }
        let (user, pass) = config.auth.credentials();
        let source = (!config.sources.is_empty()).then(|| config.sources[i % config.sources.len()]);
        let mut client =
            BenchClient::allocate_from(config.server, source, &user, &pass, config.tcp)
                .map_err(|e| io::Error::other(format!("allocation {i}: {e}")))?;
        client
            .create_permission(peer_addr)
            .map_err(|e| io::Error::other(format!("allocation {i}: {e}")))?;
        client
            .bind_channel(FIRST_CHANNEL, peer_addr)
            .map_err(|e| io::Error::other(format!("allocation {i}: {e}")))?;
        clients.push(client);
    }
    let setup_rate = config.allocations as f64 / started.elapsed().as_secs_f64().max(1e-9);
    for c in &clients {
        c.socket.set_nonblocking(true)?;
    }
    peer.set_read_timeout(Some(Duration::from_millis(50)))?;
    Ok(Setup {
        clients,
        peer,
        peer_addr,
        setup_rate,
        size: config.size,
        mode: config.mode,
        gso: config.gso && !config.tcp,
        tcp: config.tcp,
        burst: config.burst,
    })
}

/// A roomy UDP socket bound to `ip` (any port) and connected to `to`.
fn connected(ip: IpAddr, to: SocketAddr) -> io::Result<UdpSocket> {
    let socket = UdpSocket::bind((ip, 0))?;
    roomy(&socket);
    socket.connect(to)?;
    Ok(socket)
}

/// One direction's results.
#[derive(Debug, Clone, Serialize)]
pub struct DirectionReport {
    /// Datagrams sent.
    pub sent: u64,
    /// Datagrams that arrived.
    pub delivered: u64,
    /// Delivered per second.
    pub pps: f64,
    /// Delivered payload, Mbit/s.
    pub mbps: f64,
    /// Lost, percent of sent.
    pub loss_pct: f64,
    /// One-way latency percentiles, µs.
    pub p50_us: f64,
    /// 99th percentile, µs.
    pub p99_us: f64,
    /// 99.9th percentile, µs.
    pub p999_us: f64,
    /// Allocations that delivered nothing in this direction (a dead allocation, where a loss
    /// spread over all would be congestion).
    pub silent_allocations: u64,
}

/// A run's results.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Offered load, datagrams per second per direction (0: as fast as possible).
    pub offered_pps: u64,
    /// Seconds the senders ran.
    pub seconds: f64,
    /// Client → peer.
    pub up: Option<DirectionReport>,
    /// Peer → client.
    pub down: Option<DirectionReport>,
    /// Server CPU time per relayed datagram, µs (with a server pid).
    pub server_cpu_us_per_packet: Option<f64>,
    /// The server's context switches (voluntary and not, all its threads) per relayed
    /// datagram (with a server pid).
    pub server_wakeups_per_packet: Option<f64>,
    /// The whole machine's busy CPUs, on average over the run: the wall time times the CPUs
    /// less their idle and iowait time (/proc/stat, whose idle time a tickless kernel measures
    /// exactly): load generator, server, softirq and everything else running. (The busy
    /// fields themselves are sampled at ticks, which a tickless idle CPU does not take: the
    /// softirq work of an otherwise idle CPU, where a kernel offload relays, hardly shows
    /// there.)
    pub machine_busy_cpus: Option<f64>,
    /// Each CPU's busy fraction over the run (wall time less idle, as `machine_busy_cpus`), in
    /// CPU order: where the work landed (with RPS steering loopback's softirq to the server's
    /// CPU, that CPU's share is the relay's whole cost there).
    pub cpu_busy: Option<Vec<f64>>,
    /// The whole machine's busy CPU time per relayed datagram, µs.
    pub machine_us_per_packet: Option<f64>,
    /// The machine's softirq time (the kernel's network receive path, mostly) per relayed
    /// datagram, µs, as sampled at ticks (a lower bound: see `machine_busy_cpus`); part of
    /// `machine_us_per_packet`.
    pub machine_softirq_us_per_packet: Option<f64>,
}

impl Report {
    /// Worst loss over the directions run.
    pub fn loss_pct(&self) -> f64 {
        [&self.up, &self.down]
            .iter()
            .filter_map(|d| d.as_ref().map(|d| d.loss_pct))
            .fold(0.0, f64::max)
    }

    /// Delivered datagrams per second, all directions.
    pub fn delivered_pps(&self) -> f64 {
        [&self.up, &self.down]
            .iter()
            .filter_map(|d| d.as_ref().map(|d| d.pps))
            .sum()
    }
}

/// Counters a receiver publishes.
#[derive(Default)]
struct Received {
    packets: AtomicU64,
    histogram: Mutex<Histogram>,
    /// Datagrams delivered per allocation index, merged when the receiver stops.
    per_allocation: Mutex<Vec<u64>>,
}

impl Received {
    /// Folds a receiver's local tallies in when it stops.
    fn finish(&self, count: u64, local: &Histogram, per_allocation: &[u64]) {
        self.packets.store(count, Ordering::Relaxed);
        self.histogram.lock().unwrap().merge(local);
        let mut mine = self.per_allocation.lock().unwrap();
        if mine.len() < per_allocation.len() {
            mine.resize(per_allocation.len(), 0);
        }
        for (m, n) in mine.iter_mut().zip(per_allocation) {
            *m += n;
        }
    }

    /// Allocations (of `allocations`) that delivered nothing.
    fn silent(&self, allocations: usize) -> u64 {
        let mine = self.per_allocation.lock().unwrap();
        (0..allocations)
            .filter(|&i| mine.get(i).copied().unwrap_or(0) == 0)
            .count() as u64
    }
}

/// Reads the timing header: the allocation index and the send time (ns), if it is ours.
fn stamp(payload: &[u8]) -> Option<(usize, u64)> {
    let start = payload.windows(4).take(64).position(|w| w == MAGIC)?;
    let header = payload.get(start..start + HEADER)?;
    let index = u32::from_be_bytes(header[4..8].try_into().ok()?) as usize;
    Some((index, u64::from_be_bytes(header[16..24].try_into().ok()?)))
}

/// Counts one delivered datagram of allocation `index` (indexes beyond `allocations` are not
/// ours and count only in the total).
fn tally(per_allocation: &mut [u64], index: usize) {
    if let Some(n) = per_allocation.get_mut(index) {
        *n += 1;
    }
}

fn write_header(payload: &mut [u8], index: u32, seq: u64, now_ns: u64) {
    payload[..4].copy_from_slice(MAGIC);
    payload[4..8].copy_from_slice(&index.to_be_bytes());
    payload[8..16].copy_from_slice(&seq.to_be_bytes());
    payload[16..24].copy_from_slice(&now_ns.to_be_bytes());
}

/// Clock ticks (USER_HZ) per second, the unit of /proc's CPU times.
fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    if ticks > 0.0 {
        ticks
    } else {
        100.0
    }
}

/// The server's CPU time so far (user + system), from /proc.
pub fn cpu_seconds(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let utime: f64 = fields.get(11)?.parse().ok()?;
    let stime: f64 = fields.get(12)?.parse().ok()?;
    Some((utime + stime) / clock_ticks())
}

/// The whole machine's CPU time so far, seconds (summed over CPUs), from /proc/stat's
/// aggregate `cpu` line.
#[derive(Debug, Clone, PartialEq)]
pub struct MachineCpu {
    /// user + nice + system + irq + softirq + steal (guest time is inside user already), as
    /// sampled at ticks.
    pub busy: f64,
    /// softirq alone, as sampled at ticks.
    pub softirq: f64,
    /// busy + idle + iowait.
    pub total: f64,
    /// idle + iowait: measured exactly by a tickless kernel (`get_cpu_idle_time_us`).
    pub idle: f64,
    /// The CPUs (`cpuN` lines).
    pub cpus: usize,
    /// Each CPU's idle + iowait, in `cpuN` order.
    pub idle_per_cpu: Vec<f64>,
}

impl MachineCpu {
    /// Reads /proc/stat now.
    pub fn now() -> Option<MachineCpu> {
        MachineCpu::parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }

    /// The `cpu` line of a /proc/stat text.
    fn parse(stat: &str) -> Option<MachineCpu> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let jiffies: Vec<f64> = line
            .split_whitespace()
            .skip(1)
            .map_while(|f| f.parse().ok())
            .collect();
        let field = |i: usize| jiffies.get(i).copied().unwrap_or(0.0);
        // user nice system idle iowait irq softirq steal guest guest_nice
        let busy = field(0) + field(1) + field(2) + field(5) + field(6) + field(7);
        let ticks = clock_ticks();
        let idle_per_cpu: Vec<f64> = stat
            .lines()
            .filter(|l| l.starts_with("cpu") && l.as_bytes().get(3).is_some_and(u8::is_ascii_digit))
            .map(|l| {
                let f: Vec<f64> = l
                    .split_whitespace()
                    .skip(1)
                    .map_while(|f| f.parse().ok())
                    .collect();
                (f.get(3).copied().unwrap_or(0.0) + f.get(4).copied().unwrap_or(0.0)) / ticks
            })
            .collect();
        (jiffies.len() >= 4).then(|| MachineCpu {
            busy: busy / ticks,
            softirq: field(6) / ticks,
            total: (busy + field(3) + field(4)) / ticks,
            idle: (field(3) + field(4)) / ticks,
            cpus: idle_per_cpu.len().max(1),
            idle_per_cpu,
        })
    }
}

/// The server's context switches so far, voluntary and not, summed over its threads (from
/// /proc/PID/task/*/status; a thread that exits takes its count along).
pub fn context_switches(pid: u32) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    let mut total = 0;
    for task in tasks.flatten() {
        let Ok(status) = std::fs::read_to_string(task.path().join("status")) else {
            continue;
        };
        total += status
            .lines()
            .filter_map(|l| {
                l.strip_prefix("voluntary_ctxt_switches:")
                    .or_else(|| l.strip_prefix("nonvoluntary_ctxt_switches:"))
            })
            .filter_map(|v| v.trim().parse::<u64>().ok())
            .sum::<u64>();
    }
    Some(total)
}

/// The server's resident memory (VmRSS), KiB, from /proc.
pub fn rss_kib(pid: u32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()
}

/// One iovec per buffer.
fn iovecs_of(bufs: &mut [Vec<u8>]) -> Vec<libc::iovec> {
    bufs.iter_mut()
        .map(|b| libc::iovec {
            iov_base: b.as_mut_ptr().cast(),
            iov_len: b.len(),
        })
        .collect()
}

/// Writes `frames` back to back on a blocking TCP connection (one `writev` unless the kernel
/// takes less); how many frames went whole.
fn write_stream(fd: i32, frames: &mut [Vec<u8>]) -> usize {
    let total: usize = frames.iter().map(Vec::len).sum();
    let mut iovecs = iovecs_of(frames);
    // SAFETY: the iovecs point into `frames`, which outlive the call.
    let wrote = unsafe { libc::writev(fd, iovecs.as_mut_ptr(), iovecs.len() as i32) };
    let Ok(mut wrote) = usize::try_from(wrote) else {
        return 0;
    };
    // A short write leaves a frame cut: finish it, so the stream stays framed.
    let all: Vec<u8> = frames.concat();
    while wrote < total {
        // SAFETY: `all[wrote..]` is valid for reads of its length.
        let n = unsafe { libc::write(fd, all[wrote..].as_ptr().cast(), total - wrote) };
        match usize::try_from(n) {
            Ok(n) if n > 0 => wrote += n,
            _ => return 0,
        }
    }
    frames.len()
}

/// A pacer: how many datagrams may go now to keep `rate` per second (0: no limit).
struct Pacer {
    rate: u64,
    started: Instant,
    sent: u64,
}

impl Pacer {
    fn new(rate: u64) -> Pacer {
        Pacer {
            rate,
            started: Instant::now(),
            sent: 0,
        }
    }

    /// Waits until at least `want` datagrams are due; how many may go now (`None` once
    /// `stop` is set).
    fn due(&self, stop: &AtomicBool, want: usize) -> Option<usize> {
        while !stop.load(Ordering::Relaxed) {
            let budget = self.budget() as usize;
            if budget >= want.max(1) {
                return Some(budget);
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        None
    }

    /// Records `n` datagrams sent and publishes the total.
    fn sent(&mut self, n: usize, total: &AtomicU64) {
        self.sent += n as u64;
        total.store(self.sent, Ordering::Relaxed);
    }

    fn budget(&self) -> u64 {
        if self.rate == 0 {
            return BATCH as u64;
        }
        let due = (self.started.elapsed().as_secs_f64() * self.rate as f64) as u64;
        due.saturating_sub(self.sent).min(BATCH as u64)
    }
}

impl Setup {
    /// The built-in peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer_addr
    }

    /// Runs `direction` for `duration` at `rate` datagrams per second per direction (0: as
    /// fast as possible), printing progress each second if `progress`.
    pub fn run(
        &self,
        direction: Direction,
        rate: u64,
        duration: Duration,
        server_pid: Option<u32>,
        progress: bool,
    ) -> Report {
        let epoch = Instant::now();
        let stop_senders = Arc::new(AtomicBool::new(false));
        let stop_receivers = Arc::new(AtomicBool::new(false));
        let up_rx = Arc::new(Received::default());
        let down_rx = Arc::new(Received::default());
        let up_sent = Arc::new(AtomicU64::new(0));
        let down_sent = Arc::new(AtomicU64::new(0));
        let cpu_before = server_pid.and_then(cpu_seconds);
        let switches_before = server_pid.and_then(context_switches);
        let machine_before = MachineCpu::now();
        let window = Instant::now();
        let up = matches!(direction, Direction::Up | Direction::Both);
        let down = matches!(direction, Direction::Down | Direction::Both);
        let allocations = self.clients.len();
        let seconds = std::thread::scope(|scope| {
            // The peer: counts and times what the clients sent (up).
            let peer = &self.peer;
            {
                let (stop, rx) = (stop_receivers.clone(), up_rx.clone());
                scope.spawn(move || {
                    let mut buf = [0u8; 2048];
                    let mut local = Histogram::default();
                    let mut count = 0u64;
                    let mut per_allocation = vec![0u64; allocations];
                    while !stop.load(Ordering::Relaxed) {
                        let Ok(n) = peer.recv(&mut buf) else { continue };
                        if let Some((index, sent_ns)) = stamp(&buf[..n]) {
                            let now = epoch.elapsed().as_nanos() as u64;
                            local.record(now.saturating_sub(sent_ns));
                            tally(&mut per_allocation, index);
                            count += 1;
                            if count.is_multiple_of(256) {
                                rx.packets.store(count, Ordering::Relaxed);
                            }
                        }
                    }
                    rx.finish(count, &local, &per_allocation);
                });
            }
            // The clients' receiver: epoll over every client socket (down).
            {
                let (stop, rx) = (stop_receivers.clone(), down_rx.clone());
                let clients = &self.clients;
                scope.spawn(move || receive_clients(clients, epoch, &stop, &rx));
            }
            if up {
                let (stop, sent) = (stop_senders.clone(), up_sent.clone());
                scope.spawn(move || self.send_up(rate, epoch, &stop, &sent));
            }
            if down {
                let (stop, sent) = (stop_senders.clone(), down_sent.clone());
                scope.spawn(move || self.send_down(rate, epoch, &stop, &sent));
            }
            let started = Instant::now();
            let mut last = (0u64, 0u64, Instant::now());
            while started.elapsed() < duration {
                std::thread::sleep(
                    Duration::from_millis(100).min(duration.saturating_sub(started.elapsed())),
                );
                if progress && last.2.elapsed() >= Duration::from_secs(1) {
                    let (u, d) = (
                        up_rx.packets.load(Ordering::Relaxed),
                        down_rx.packets.load(Ordering::Relaxed),
                    );
                    let secs = last.2.elapsed().as_secs_f64();
                    eprintln!(
                        "[{:>4.1}s] delivered up {:>9.0} pkt/s, down {:>9.0} pkt/s",
                        started.elapsed().as_secs_f64(),
                        (u - last.0) as f64 / secs,
                        (d - last.1) as f64 / secs
                    );
                    last = (u, d, Instant::now());
                }
            }
            stop_senders.store(true, Ordering::Relaxed);
            let seconds = started.elapsed().as_secs_f64();
            // Let in-flight datagrams land.
            std::thread::sleep(Duration::from_millis(300));
            stop_receivers.store(true, Ordering::Relaxed);
            seconds
        });
        // The same window for the server's and the machine's counters: from before the
        // senders start until every in-flight datagram has landed.
        let cpu = match (cpu_before, server_pid.and_then(cpu_seconds)) {
            (Some(before), Some(after)) => Some(after - before),
            _ => None,
        };
        let switches = match (switches_before, server_pid.and_then(context_switches)) {
            (Some(before), Some(after)) => Some(after.saturating_sub(before) as f64),
            _ => None,
        };
        let machine_after = MachineCpu::now();
        let window = window.elapsed().as_secs_f64();
        let machine = match (machine_before, machine_after) {
            // Busy: the wall time on every CPU less the (exactly measured) idle time.
            (Some(before), Some(after)) => Some(MachineCpu {
                busy: (window * after.cpus as f64 - (after.idle - before.idle)).max(0.0),
                softirq: after.softirq - before.softirq,
                total: window * after.cpus as f64,
                idle: after.idle - before.idle,
                cpus: after.cpus,
                idle_per_cpu: after
                    .idle_per_cpu
                    .iter()
                    .zip(&before.idle_per_cpu)
                    .map(|(a, b)| a - b)
                    .collect(),
            }),
            _ => None,
        };
        let report_of = |sent: &AtomicU64, rx: &Received| {
            let sent = sent.load(Ordering::Relaxed);
            let delivered = rx.packets.load(Ordering::Relaxed);
            let h = rx.histogram.lock().unwrap();
            DirectionReport {
                sent,
                delivered,
                pps: delivered as f64 / seconds,
                mbps: delivered as f64 * self.size as f64 * 8.0 / seconds / 1e6,
                loss_pct: if sent == 0 {
                    0.0
                } else {
                    100.0 * sent.saturating_sub(delivered) as f64 / sent as f64
                },
                p50_us: h.quantile(0.5) as f64 / 1000.0,
                p99_us: h.quantile(0.99) as f64 / 1000.0,
                p999_us: h.quantile(0.999) as f64 / 1000.0,
                silent_allocations: rx.silent(allocations),
            }
        };
        let up_report = up.then(|| report_of(&up_sent, &up_rx));
        let down_report = down.then(|| report_of(&down_sent, &down_rx));
        let relayed = up_report.as_ref().map_or(0, |r| r.delivered)
            + down_report.as_ref().map_or(0, |r| r.delivered);
        // Per relayed (delivered, in the directions run) datagram; seconds become µs.
        let per_packet = |v: Option<f64>, scale: f64| {
            v.filter(|_| relayed > 0)
                .map(|v| v * scale / relayed as f64)
        };
        Report {
            offered_pps: rate,
            seconds,
            up: up_report,
            down: down_report,
            server_cpu_us_per_packet: per_packet(cpu, 1e6),
            server_wakeups_per_packet: per_packet(switches, 1.0),
            machine_busy_cpus: machine.as_ref().map(|m| m.busy / window.max(1e-9)),
            cpu_busy: machine.as_ref().map(|m| {
                m.idle_per_cpu
                    .iter()
                    .map(|idle| (1.0 - idle / window.max(1e-9)).clamp(0.0, 1.0))
                    .collect()
            }),
            machine_us_per_packet: per_packet(machine.as_ref().map(|m| m.busy), 1e6),
            machine_softirq_us_per_packet: per_packet(machine.as_ref().map(|m| m.softirq), 1e6),
        }
    }

    fn frames(&self, index: usize) -> Vec<Vec<u8>> {
        let client = &self.clients[index];
        let payload = vec![0u8; self.size];
        (0..BATCH)
            .map(|_| match self.mode {
                Mode::Plain | Mode::Direct => payload.clone(),
                Mode::Channel => {
                    let mut frame = channel_data_header(FIRST_CHANNEL, self.size).to_vec();
                    frame.extend_from_slice(&payload);
                    if self.tcp {
                        // RFC 8656 §12.5: padded to 4 bytes over streams.
                        frame.resize(uturn_shared::framing::padded(frame.len()), 0);
                    }
                    frame
                }
                Mode::Send => {
                    let mut marked = payload.clone();
                    marked[..4].copy_from_slice(MAGIC);
                    client.send_indication(self.peer_addr, &marked)
                }
            })
            .collect()
    }

    fn send_up(&self, rate: u64, epoch: Instant, stop: &AtomicBool, sent: &AtomicU64) {
        let mut frames: Vec<Vec<Vec<u8>>> =
            (0..self.clients.len()).map(|i| self.frames(i)).collect();
        // Where the payload starts in each allocation's frame.
        let offsets: Vec<usize> = frames
            .iter()
            .map(|f| match self.mode {
                Mode::Plain | Mode::Direct => 0,
                Mode::Channel => 4,
                Mode::Send => f[0].windows(4).position(|w| w == MAGIC).unwrap_or(4),
            })
            .collect();
        let mut pacer = Pacer::new(rate);
        let mut seq = 0u64;
        let mut next = 0usize;
        // Client sockets are non-blocking: a full buffer drops the rest of a batch.
        let mut queue = if self.gso {
            SendQueue::new()
        } else {
            SendQueue::new().without_gso()
        };
        let want = if rate == 0 { 1 } else { self.burst };
        while let Some(budget) = pacer.due(stop, want) {
            // Unpaced: a batch per allocation; paced: a burst per allocation in turn.
            let count = if rate == 0 { budget } else { want };
            let i = next;
            next = (next + 1) % self.clients.len();
            let now = epoch.elapsed().as_nanos() as u64;
            for frame in frames[i].iter_mut().take(count) {
                write_header(&mut frame[offsets[i]..], i as u32, seq, now);
                seq += 1;
            }
            let fd = self.clients[i].socket.as_raw_fd();
            if self.tcp {
                let n = write_stream(fd, &mut frames[i][..count]);
                pacer.sent(n, sent);
                continue;
            }
            // Equal-size frames to one server: with `gso`, one UDP GSO message per batch (until
            // the kernel refuses GSO).
            let mut n = 0;
            let mut count_sent = |_, outcome: io::Result<usize>| n += usize::from(outcome.is_ok());
            for frame in &frames[i][..count] {
                queue.push_connected(fd, frame, 0, &mut count_sent);
            }
            queue.flush(&mut count_sent);
            pacer.sent(n, sent);
        }
    }

    fn send_down(&self, rate: u64, epoch: Instant, stop: &AtomicBool, sent: &AtomicU64) {
        let relays: Vec<SocketAddr> = self.clients.iter().map(|c| c.relay).collect();
        let mut payload = vec![0u8; self.size];
        // The peer's socket blocks: a full buffer holds the sender back, as a media server's
        // would. One datagram per message, each to its own allocation's relay address.
        let mut queue = SendQueue::new().without_gso().waiting();
        let mut pacer = Pacer::new(rate);
        let mut seq = 0u64;
        let mut next = 0usize;
        let fd = self.peer.as_raw_fd();
        while let Some(budget) = pacer.due(stop, 1) {
            let now = epoch.elapsed().as_nanos() as u64;
            let mut n = 0;
            let mut count_sent = |_, outcome: io::Result<usize>| n += usize::from(outcome.is_ok());
            for _ in 0..budget {
                write_header(&mut payload, next as u32, seq, now);
                queue.push(fd, &payload, relays[next], 0, &mut count_sent);
                seq += 1;
                next = (next + 1) % relays.len();
            }
            queue.flush(&mut count_sent);
            pacer.sent(n, sent);
        }
    }
}

fn receive_clients(clients: &[BenchClient], epoch: Instant, stop: &AtomicBool, rx: &Received) {
    // SAFETY: epoll_create1 has no preconditions; the fd is closed below.
    let epoll = unsafe { libc::epoll_create1(0) };
    if epoll < 0 {
        return;
    }
    for (i, c) in clients.iter().enumerate() {
        let mut event = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: i as u64,
        };
        // SAFETY: valid epoll fd, socket fd and event.
        unsafe { libc::epoll_ctl(epoll, libc::EPOLL_CTL_ADD, c.socket.as_raw_fd(), &mut event) };
    }
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 256];
    let mut buf = vec![0u8; 64 << 10];
    // TCP: bytes of a frame not complete yet, per client.
    let mut partial: Vec<Vec<u8>> = vec![Vec::new(); clients.len()];
    let mut local = Histogram::default();
    let mut count = 0u64;
    let mut per_allocation = vec![0u64; clients.len()];
    let record = |frame: &[u8], local: &mut Histogram, count: &mut u64, tallies: &mut [u64]| {
        if let Some((index, sent_ns)) = stamp(frame) {
            let now = epoch.elapsed().as_nanos() as u64;
            local.record(now.saturating_sub(sent_ns));
            tally(tallies, index);
            *count += 1;
        }
    };
    while !stop.load(Ordering::Relaxed) {
        // SAFETY: the events buffer is valid for its length.
        let ready =
            unsafe { libc::epoll_wait(epoll, events.as_mut_ptr(), events.len() as i32, 50) };
        for event in events.iter().take(usize::try_from(ready).unwrap_or(0)) {
            let index = event.u64 as usize;
            let link = &clients[index].socket;
            loop {
                // SAFETY: `buf` is valid for writes of its length; never blocks.
                let n = unsafe {
                    libc::recv(
                        link.as_raw_fd(),
                        buf.as_mut_ptr().cast(),
                        buf.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                let Ok(n) = usize::try_from(n) else { break };
                if n == 0 {
                    break;
                }
                if !link.is_stream() {
                    record(&buf[..n], &mut local, &mut count, &mut per_allocation);
                    continue;
                }
                let pending = &mut partial[index];
                pending.extend_from_slice(&buf[..n]);
                let mut at = 0;
                while let Ok(Some(len)) = uturn_shared::framing::frame_len(&pending[at..]) {
                    if at + len > pending.len() {
                        break;
                    }
                    record(
                        &pending[at..at + len],
                        &mut local,
                        &mut count,
                        &mut per_allocation,
                    );
                    at += len;
                }
                pending.drain(..at);
            }
        }
        rx.packets.store(count, Ordering::Relaxed);
    }
    // SAFETY: closing the epoll fd we created.
    unsafe { libc::close(epoll) };
    rx.finish(count, &local, &per_allocation);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_inside_framing() {
        let mut payload = vec![0u8; 100];
        write_header(&mut payload, 7, 42, 123_456);
        let mut framed = channel_data_header(0x4000, 100).to_vec();
        framed.extend_from_slice(&payload);
        assert_eq!(stamp(&framed), Some((7, 123_456)));
        assert_eq!(stamp(&[0u8; 40]), None);
    }

    #[test]
    fn machine_cpu_reads_the_aggregate_line() {
        let stat = "cpu  100 10 50 1000 20 5 15 2 7 0\ncpu0 1 2 3 4 5 6 7 8 9 10\n\
                    cpu1 1 2 3 4 5 6 7 8 9 10\nintr 5\n";
        let m = MachineCpu::parse(stat).unwrap();
        let ticks = clock_ticks();
        let close = |seconds: f64, jiffies: f64| (seconds * ticks - jiffies).abs() < 1e-6;
        assert!(close(m.busy, 182.0), "{m:?}");
        assert!(close(m.softirq, 15.0), "{m:?}");
        assert!(close(m.total, 1202.0), "{m:?}");
        assert!(close(m.idle, 1020.0), "{m:?}");
        assert_eq!(m.cpus, 2);
        assert_eq!(MachineCpu::parse("intr 1 2 3\n"), None);
        assert!(MachineCpu::now().is_some_and(|m| m.busy > 0.0 && m.total >= m.busy));
        assert!(context_switches(std::process::id()).is_some_and(|n| n > 0));
    }
}

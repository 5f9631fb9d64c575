//! The kernel offload (`--offload`): an eBPF program at TC ingress of the interfaces that carry
//! client and peer traffic relays the ChannelData of established channels without waking a
//! shard, and with `xdp` an XDP program in the driver relays those it can send straight back out
//! of the interface they arrived on, before the kernel builds a socket buffer, passing the rest
//! to the TC program (`offload.c` says what each does to a packet).
//!
//! User space stays the authority. [`start`] loads the programs once for the process (their
//! maps shared by the shards) and attaches them with links (tcx, XDP), which the kernel removes
//! when the process exits, however it exits. Each shard keeps an [`OffloadTable`] of the entries of its
//! own allocations: it installs a channel's pair of entries when the engine reports a change on
//! the allocation ([`crate::proto::Engine::poll_offload`]) and the channel is bound, its
//! permission live and its peer admitted; it removes them when the allocation ends, and when a
//! later check (a request on the allocation, a new snapshot, the entry's end) finds the channel
//! no longer offloadable. Every entry carries the instant it ends, which the program checks per
//! packet, so a channel or permission expires exactly as it does in user space. Once per
//! second the shard reads the entries' counters into its own metrics.

mod bpf;
mod object;

pub use bpf::TestRun;

use crate::proto::{OffloadChannel, RelayId};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, SocketAddrV4, UdpSocket};
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uturn_shared::snapshot::ClusterId;

/// The program clang built from `offload.c` (see `build.rs`), if it was built.
#[cfg(uturn_bpf)]
const OBJECT: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/offload.o")));
#[cfg(not(uturn_bpf))]
const OBJECT: Option<&[u8]> = None;

/// Entries per direction across all shards (hash maps allocated as entries are added).
const MAX_ENTRIES: u32 = 262_144;
/// Bytes of the per-CPU scratch buffer (`SCRATCH` in `offload.c`).
const SCRATCH: usize = 2048;
/// How often a shard reads its entries' counters.
pub(crate) const COUNTER_SYNC: Duration = Duration::from_secs(1);

/// `--offload`: which kernel offload to run.
///
/// `xdp` adds the XDP program on every interface whose driver runs XDP (not the loopback), the
/// TC program staying on all of them for what XDP passes up. `auto` never picks XDP: attaching
/// it makes many NIC drivers rebuild their rings (a link flap for every pod of a host-network
/// node), and a veth sends XDP_TX frames only to a peer that runs XDP itself, which a pod can
/// neither see nor set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OffloadMode {
    /// None (the default until it has run in the field).
    #[default]
    None,
    /// TC ingress (tcx links, Linux 6.6).
    Tc,
    /// XDP in the driver where it runs, TC for the rest.
    Xdp,
    /// TC if the kernel, the capabilities and the build allow it, else none.
    Auto,
}

impl OffloadMode {
    /// The flag's spelling.
    pub fn name(self) -> &'static str {
        match self {
            OffloadMode::None => "none",
            OffloadMode::Tc => "tc",
            OffloadMode::Xdp => "xdp",
            OffloadMode::Auto => "auto",
        }
    }
}

impl std::str::FromStr for OffloadMode {
    type Err = String;

    fn from_str(s: &str) -> Result<OffloadMode, String> {
        match s.to_ascii_lowercase().as_str() {
            "none" => Ok(OffloadMode::None),
            "tc" => Ok(OffloadMode::Tc),
            "xdp" => Ok(OffloadMode::Xdp),
            "auto" => Ok(OffloadMode::Auto),
            _ => Err(format!("unknown offload {s:?}: use none, tc, xdp or auto")),
        }
    }
}

/// What [`start`] chose and why, for the log and `/status`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OffloadStatus {
    /// What runs: `none`, `tc`, or `xdp` (with TC for what XDP passes up).
    pub running: &'static str,
    /// What was asked for.
    pub requested: OffloadMode,
    /// Why it runs or not, with the fix when it does not.
    pub reason: String,
    /// The interfaces the TC program is attached to (those with XDP too:
    /// [`Offload::xdp_interfaces`]).
    pub interfaces: Vec<String>,
}

/// The loaded program and its maps, shared by the shards; dropping the last handle detaches
/// the program from every interface.
pub struct Offload {
    out: bpf::Map,
    into: bpf::Map,
    _scratch: bpf::Map,
    program: OwnedFd,
    links: Vec<OwnedFd>,
    /// The XDP program, or why the kernel refused it.
    xdp_program: Result<OwnedFd, String>,
    /// Interfaces with the XDP program (entries carry MAC addresses while there are any).
    xdp_links: std::sync::Mutex<Vec<XdpLink>>,
}

/// The XDP program on one interface, and the drops it has seen there.
struct XdpLink {
    name: String,
    index: u32,
    _link: OwnedFd,
    /// The interface's `tx_dropped` when the program was attached or last checked.
    tx_dropped: u64,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("links", &self.links.len())
            .finish()
    }
}

/// Why the offload cannot run, with the fix.
fn unavailable(e: &io::Error, what: &str) -> String {
    match e.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => format!(
            "{what}: {e}; the process needs CAP_BPF and CAP_NET_ADMIN (deploy/overlays/offload adds them)"
        ),
        Some(libc::ENOSYS) => format!("{what}: {e}; this kernel has no bpf(2) or a filter denies it"),
        _ => format!("{what}: {e}"),
    }
}

impl Offload {
    /// Loads the program (not attached anywhere yet).
    pub fn load() -> Result<Offload, String> {
        let Some(elf) = OBJECT else {
            return Err(
                "this build has no BPF program (clang and libbpf-dev were missing when \
                        it was built; install them and rebuild)"
                    .into(),
            );
        };
        let out = bpf::Map::create(
            "uturn_chan_out",
            bpf::MAP_HASH,
            OUT_KEY,
            OUT_VALUE,
            MAX_ENTRIES,
            bpf::MAP_NO_PREALLOC,
        )
        .map_err(|e| unavailable(&e, "cannot create a BPF map"))?;
        let into = bpf::Map::create(
            "uturn_chan_in",
            bpf::MAP_HASH,
            IN_KEY,
            IN_VALUE,
            MAX_ENTRIES,
            bpf::MAP_NO_PREALLOC,
        )
        .map_err(|e| unavailable(&e, "cannot create a BPF map"))?;
        let scratch = bpf::Map::create("uturn_scratch", bpf::MAP_PERCPU_ARRAY, 4, SCRATCH, 1, 0)
            .map_err(|e| unavailable(&e, "cannot create a BPF map"))?;
        let maps = HashMap::from([
            ("chan_out", out.fd()),
            ("chan_in", into.fd()),
            ("scratch", scratch.fd()),
        ]);
        let load = |section: &str, name: &str, kind: u32| -> Result<OwnedFd, String> {
            let program = object::program(elf, section, &maps).map_err(|e| e.to_string())?;
            bpf::load_program(name, kind, &program.insns, &program.license).map_err(|refused| {
                if refused.log.is_empty() {
                    unavailable(
                        &refused.error,
                        &format!("the kernel refused the {section} program"),
                    )
                } else {
                    format!(
                        "the verifier refused the {section} program ({}): {}",
                        refused.error,
                        refused.log.replace('\n', " | ")
                    )
                }
            })
        };
        let program = load("tc", "uturn_offload", bpf::PROG_SCHED_CLS)?;
        let xdp_program = load("xdp", "uturn_xdp", bpf::PROG_XDP);
        Ok(Offload {
            out,
            into,
            _scratch: scratch,
            program,
            links: Vec::new(),
            xdp_program,
            xdp_links: std::sync::Mutex::new(Vec::new()),
        })
    }

    /// Runs the XDP program in the driver of interface `name`.
    pub fn attach_xdp(&mut self, name: &str) -> Result<(), String> {
        let program = self.xdp_program.as_ref().map_err(Clone::clone)?;
        let index = ifindex(name).map_err(|e| format!("interface {name}: {e}"))?;
        let link = bpf::link_create(program, index, bpf::ATTACH_XDP, bpf::XDP_DRIVER_MODE)
            .map_err(|e| match e.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::EINVAL) => {
                    format!("no XDP on {name}: its driver does not run XDP programs ({e})")
                }
                _ => unavailable(&e, &format!("cannot attach XDP to {name}")),
            })?;
        let tx_dropped = tx_dropped(name);
        self.xdp_links
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .push(XdpLink {
                name: name.to_owned(),
                index,
                _link: link,
                tx_dropped,
            });
        Ok(())
    }

    /// Whether any interface runs the XDP program.
    pub fn xdp_running(&self) -> bool {
        let links = self.xdp_links.lock().unwrap_or_else(|e| e.into_inner());
        !links.is_empty()
    }

    /// What runs now: `xdp` while any interface runs the XDP program, else `tc`.
    pub fn running(&self) -> &'static str {
        if self.xdp_running() {
            "xdp"
        } else {
            "tc"
        }
    }

    /// The interfaces that run the XDP program.
    pub fn xdp_interfaces(&self) -> Vec<String> {
        let links = self.xdp_links.lock().unwrap_or_else(|e| e.into_inner());
        links.iter().map(|l| l.name.clone()).collect()
    }

    /// Takes the XDP program off every interface whose transmit drops grew since the last
    /// check (a veth whose peer has no NAPI drops every XDP_TX frame), logging why and the fix;
    /// the TC program carries its traffic from then on. Called from every shard's
    /// once-a-second sync (the first to see the drops takes it off).
    pub(crate) fn check_xdp(&self) {
        let mut links = self.xdp_links.lock().unwrap_or_else(|e| e.into_inner());
        links.retain_mut(|link| {
            let now = tx_dropped(&link.name);
            let grew = now > link.tx_dropped;
            link.tx_dropped = now;
            if grew {
                tracing::warn!(
                    target: "stunnerd",
                    "offload: XDP taken off {} (interface {}): it dropped frames the program sent back \
                     out (a veth passes them on only to a peer end that runs an XDP program \
                     itself); TC relays its channels",
                    link.name,
                    link.index
                );
            }
            !grew
        });
    }

    /// Attaches the program at TC ingress of interface `name`.
    pub fn attach(&mut self, name: &str) -> Result<(), String> {
        let index = ifindex(name).map_err(|e| format!("interface {name}: {e}"))?;
        let link = bpf::link_create(&self.program, index, bpf::ATTACH_TCX_INGRESS, 0).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                format!("cannot attach to {name}: {e}; TC offload needs tcx links (Linux 6.6 or later)")
            } else {
                unavailable(&e, &format!("cannot attach to {name}"))
            }
        })?;
        self.links.push(link);
        Ok(())
    }

    /// Runs the program `repeat` times on `packet` (an Ethernet frame), in the kernel
    /// (`BPF_PROG_TEST_RUN`): the benchmark of its per-packet cost.
    pub fn test_run(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        bpf::test_run(&self.program, packet, repeat)
    }

    /// Runs the XDP program `repeat` times on `packet`, as [`Offload::test_run`].
    pub fn test_run_xdp(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        let program = self
            .xdp_program
            .as_ref()
            .map_err(|e| io::Error::other(e.clone()))?;
        bpf::test_run(program, packet, repeat)
    }

    /// The program that only redirects every packet back out of its interface: the limit
    /// the offload's per-packet cost is measured against (`cargo bench --bench offload`).
    pub fn limit_program() -> Result<LimitProgram, String> {
        Offload::limit("tc/limit", bpf::PROG_SCHED_CLS)
    }

    /// The XDP limit: a program that sends every frame straight back out (XDP_TX).
    pub fn limit_program_xdp() -> Result<LimitProgram, String> {
        Offload::limit("xdp/limit", bpf::PROG_XDP)
    }

    fn limit(section: &str, kind: u32) -> Result<LimitProgram, String> {
        let elf = OBJECT.ok_or("this build has no BPF program")?;
        let program = object::program(elf, section, &HashMap::new()).map_err(|e| e.to_string())?;
        bpf::load_program("uturn_limit", kind, &program.insns, &program.license)
            .map(LimitProgram)
            .map_err(|refused| unavailable(&refused.error, "the kernel refused the BPF program"))
    }

    /// Installs a channel by hand (benchmarks and tests of the program itself; the shards
    /// install what the engine admits).
    pub fn install(&self, entry: &EntrySpec) -> io::Result<()> {
        self.out.update(&entry.out_key(), &entry.out_value())?;
        self.into.update(&entry.in_key(), &entry.in_value())
    }
}

/// See [`Offload::limit_program`].
#[derive(Debug)]
pub struct LimitProgram(OwnedFd);

impl LimitProgram {
    /// As [`Offload::test_run`].
    pub fn test_run(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        bpf::test_run(&self.0, packet, repeat)
    }
}

/// Interface names to attach to when none are configured: every interface that is up and
/// carries Ethernet frames (or is the loopback), as `/sys/class/net` lists them.
pub fn default_interfaces() -> Vec<String> {
    let mut names = Vec::new();
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return names;
    };
    for entry in dir.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let read = |file: &str| {
            std::fs::read_to_string(entry.path().join(file))
                .map(|s| s.trim().to_owned())
                .unwrap_or_default()
        };
        let up = u32::from_str_radix(read("flags").trim_start_matches("0x"), 16)
            .is_ok_and(|flags| flags & libc::IFF_UP as u32 != 0);
        // ARPHRD_ETHER, ARPHRD_LOOPBACK: frames start with an Ethernet header.
        if up && matches!(read("type").as_str(), "1" | "772") {
            names.push(name);
        }
    }
    names.sort();
    names
}

/// Whether interface `name` is the loopback.
fn is_loopback(name: &str) -> bool {
    std::fs::read_to_string(format!("/sys/class/net/{name}/type")).is_ok_and(|t| t.trim() == "772")
}

/// Interface `name`'s transmit drops (`/sys/class/net/NAME/statistics/tx_dropped`; a veth
/// counts there the XDP_TX frames its peer could not take).
fn tx_dropped(name: &str) -> u64 {
    std::fs::read_to_string(format!("/sys/class/net/{name}/statistics/tx_dropped"))
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Interface `name`'s MAC address.
fn mac_of(name: &str) -> Option<[u8; 6]> {
    parse_mac(
        std::fs::read_to_string(format!("/sys/class/net/{name}/address"))
            .ok()?
            .trim(),
    )
}

fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split(':');
    for byte in &mut mac {
        *byte = u8::from_str_radix(parts.next()?, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// The MAC address of neighbour `ip` on interface `name`, if the neighbour table has it
/// complete (`/proc/net/arp`).
fn neighbour_mac(ip: Ipv4Addr, name: &str) -> Option<[u8; 6]> {
    let table = std::fs::read_to_string("/proc/net/arp").ok()?;
    let ip = ip.to_string();
    table.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        let complete = f
            .get(2)
            .and_then(|flags| u32::from_str_radix(flags.trim_start_matches("0x"), 16).ok())
            .is_some_and(|flags| flags & 0x2 != 0);
        (f.first() == Some(&ip.as_str()) && f.get(5) == Some(&name) && complete)
            .then(|| f.get(3).and_then(|mac| parse_mac(mac)))
            .flatten()
    })
}

fn ifindex(name: &str) -> io::Result<u32> {
    let name =
        std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: a NUL-terminated name.
    match unsafe { libc::if_nametoindex(name.as_ptr()) } {
        0 => Err(io::Error::last_os_error()),
        index => Ok(index),
    }
}

/// Starts the offload `mode` asks for on `interfaces` (none: [`default_interfaces`]), and logs
/// one line saying what runs and, if nothing does, why and how to fix it. Never fails: without
/// an offload the shards relay everything, as with `none`.
pub fn start(mode: OffloadMode, interfaces: &[String]) -> (Option<Arc<Offload>>, OffloadStatus) {
    let status = |running, reason: String, interfaces| OffloadStatus {
        running,
        requested: mode,
        reason,
        interfaces,
    };
    if mode == OffloadMode::None {
        let reason = "--offload none (the default)".to_owned();
        tracing::info!(
            target: "stunnerd",
            "offload: none ({reason}; --offload tc or xdp relays channels in the kernel)"
        );
        return (None, status("none", reason, Vec::new()));
    }
    let names = if interfaces.is_empty() {
        default_interfaces()
    } else {
        interfaces.to_vec()
    };
    let outcome = Offload::load().and_then(|mut offload| {
        let mut attached = Vec::new();
        let mut errors = Vec::new();
        for name in &names {
            match offload.attach(name) {
                Ok(()) => attached.push(name.clone()),
                Err(e) => errors.push(e),
            }
        }
        if attached.is_empty() {
            return Err(errors
                .into_iter()
                .next()
                .unwrap_or_else(|| "no interface to attach to".to_owned()));
        }
        for e in &errors {
            tracing::warn!(target: "stunnerd", "offload: {e}");
        }
        // XDP where the driver runs it: every interface but the loopback.
        let mut xdp_skipped = Vec::new();
        if mode == OffloadMode::Xdp {
            for name in attached.iter().filter(|name| !is_loopback(name)) {
                if let Err(e) = offload.attach_xdp(name) {
                    xdp_skipped.push(e);
                }
            }
        }
        Ok((offload, attached, xdp_skipped))
    });
    match outcome {
        Ok((offload, attached, xdp_skipped)) => {
            let xdp = offload.xdp_interfaces();
            let mut reason = format!("TC ingress program attached to {}", attached.join(", "));
            if !xdp.is_empty() {
                reason = format!(
                    "XDP program in the driver of {}, passing the rest to the {reason}",
                    xdp.join(", ")
                );
            }
            let running = offload.running();
            if mode == OffloadMode::Xdp && xdp.is_empty() {
                let why = xdp_skipped
                    .first()
                    .cloned()
                    .unwrap_or_else(|| "no interface but the loopback".to_owned());
                reason = format!("{reason}; XDP runs nowhere: {why}");
                tracing::warn!(target: "stunnerd", "offload: tc ({reason})");
            } else {
                for e in &xdp_skipped {
                    tracing::info!(target: "stunnerd", "offload: {e}");
                }
                tracing::info!(target: "stunnerd", "offload: {running} ({reason})");
            }
            (Some(Arc::new(offload)), status(running, reason, attached))
        }
        Err(reason) => {
            match mode {
                OffloadMode::Auto => tracing::info!(
                    target: "stunnerd",
                    "offload: none (auto: {reason}); relaying in user space"
                ),
                _ => tracing::warn!(
                    target: "stunnerd",
                    "offload: none ({} unavailable: {reason}); relaying in user space",
                    mode.name()
                ),
            }
            (None, status("none", reason, Vec::new()))
        }
    }
}

const OUT_KEY: usize = 12;
const OUT_VALUE: usize = 64;
const IN_KEY: usize = 8;
const IN_VALUE: usize = 72;
/// Where the counters (packets, bytes, last seen) start in each value.
const OUT_COUNTERS: usize = 40;
const IN_COUNTERS: usize = 48;

/// One channel as the program sees it: both directions' addresses, where each leaves, and
/// when the entry ends (CLOCK_MONOTONIC nanoseconds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntrySpec {
    /// The client's address.
    pub client: SocketAddrV4,
    /// The listener address the client sends to (its source toward the client).
    pub listener: SocketAddrV4,
    /// The channel number.
    pub channel: u16,
    /// The relay address (its source toward the peer).
    pub relay: SocketAddrV4,
    /// The peer's address.
    pub peer: SocketAddrV4,
    /// Where the peer is reached (0: this host).
    pub peer_ifindex: u32,
    /// Where the client is reached (0: this host).
    pub client_ifindex: u32,
    /// The Ethernet destination and source toward the peer, if known: XDP sends only those.
    pub peer_macs: Option<[u8; 12]>,
    /// The same toward the client.
    pub client_macs: Option<[u8; 12]>,
    /// When the program stops relaying the channel.
    pub expires_ns: u64,
}

impl EntrySpec {
    fn out_key(&self) -> [u8; OUT_KEY] {
        let mut k = [0u8; OUT_KEY];
        k[0..4].copy_from_slice(&self.client.ip().octets());
        k[4..6].copy_from_slice(&self.client.port().to_be_bytes());
        k[6..8].copy_from_slice(&self.listener.port().to_be_bytes());
        k[8..10].copy_from_slice(&self.channel.to_be_bytes());
        k
    }

    fn out_value(&self) -> [u8; OUT_VALUE] {
        let mut v = [0u8; OUT_VALUE];
        v[0..4].copy_from_slice(&self.relay.ip().octets());
        v[4..8].copy_from_slice(&self.peer.ip().octets());
        v[8..10].copy_from_slice(&self.relay.port().to_be_bytes());
        v[10..12].copy_from_slice(&self.peer.port().to_be_bytes());
        v[12..16].copy_from_slice(&self.peer_ifindex.to_ne_bytes());
        if let Some(macs) = self.peer_macs {
            v[16..28].copy_from_slice(&macs);
            v[28] = 1;
        }
        v[32..40].copy_from_slice(&self.expires_ns.to_ne_bytes());
        v
    }

    fn in_key(&self) -> [u8; IN_KEY] {
        let mut k = [0u8; IN_KEY];
        k[0..4].copy_from_slice(&self.peer.ip().octets());
        k[4..6].copy_from_slice(&self.peer.port().to_be_bytes());
        k[6..8].copy_from_slice(&self.relay.port().to_be_bytes());
        k
    }

    fn in_value(&self) -> [u8; IN_VALUE] {
        let mut v = [0u8; IN_VALUE];
        v[0..4].copy_from_slice(&self.listener.ip().octets());
        v[4..8].copy_from_slice(&self.client.ip().octets());
        v[8..10].copy_from_slice(&self.listener.port().to_be_bytes());
        v[10..12].copy_from_slice(&self.client.port().to_be_bytes());
        v[12..14].copy_from_slice(&self.channel.to_be_bytes());
        v[16..20].copy_from_slice(&self.client_ifindex.to_ne_bytes());
        if let Some(macs) = self.client_macs {
            v[20..32].copy_from_slice(&macs);
            v[32] = 1;
        }
        v[40..48].copy_from_slice(&self.expires_ns.to_ne_bytes());
        v
    }
}

/// Packets and payload bytes an entry relayed in one direction.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Relayed {
    /// Datagrams.
    pub packets: u64,
    /// Payload bytes (without the 4-byte ChannelData header).
    pub bytes: u64,
}

impl Relayed {
    fn read(value: &[u8], at: usize) -> Relayed {
        let word = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&value[at + i * 8..at + i * 8 + 8]);
            u64::from_ne_bytes(w)
        };
        Relayed {
            packets: word(0),
            bytes: word(1),
        }
    }

    fn since(self, before: Relayed) -> Relayed {
        Relayed {
            packets: self.packets.saturating_sub(before.packets),
            bytes: self.bytes.saturating_sub(before.bytes),
        }
    }
}

/// What an offloaded channel relayed since the last read, for the shard's counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Delta {
    pub listener: crate::proto::ListenerId,
    pub cluster: ClusterId,
    /// Client → peer.
    pub out: Relayed,
    /// Peer → client.
    pub into: Relayed,
}

/// One installed channel.
struct Installed {
    /// As the kernel has it (`expires_ns` included).
    spec: EntrySpec,
    listener: crate::proto::ListenerId,
    cluster: ClusterId,
    /// When the engine says the channel ends: later than the kernel's `expires_ns` while an
    /// extension waits for the next [`OffloadTable::sync`].
    expires_at: Instant,
    seen_out: Relayed,
    seen_in: Relayed,
}

/// How this host reaches an address: the source it sends from, whether the address is its own,
/// the interface (0: its own), the Ethernet destination and source there (if the neighbour
/// table has the next hop), and when that was found.
#[derive(Clone, Copy)]
struct Route {
    source: Ipv4Addr,
    ifindex: u32,
    macs: Option<[u8; 12]>,
    found: Instant,
}

/// How long a [`Route`] is trusted.
const ROUTE_TTL: Duration = Duration::from_secs(10);
/// Routes cached per shard at most (the cache starts over beyond it).
const ROUTES: usize = 4096;
/// An entry whose end is further than this away is extended at the next sync rather than at
/// once: a client refreshing as fast as it likes costs at most one map write per channel per
/// sync.
const EXTEND_AT_SYNC: Duration = Duration::from_secs(3);

/// A shard's entries, by allocation.
pub(crate) struct OffloadTable {
    offload: Arc<Offload>,
    by_relay: HashMap<RelayId, Vec<Installed>>,
    routes: HashMap<Ipv4Addr, Route>,
    /// CLOCK_MONOTONIC nanoseconds at `epoch` (the clock `Instant` and the program share).
    epoch: Instant,
    epoch_ns: u64,
}

/// The CLOCK_MONOTONIC time, nanoseconds (what `bpf_ktime_get_ns` reads).
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec to fill.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// How this host reaches `to`: the source address a wildcard-bound socket sends from, the
/// interface (0 if `to` is an address of this host, which the program delivers through the
/// loopback) and, `with_macs` (for XDP), the next hop's and the interface's MAC addresses.
fn route_to(to: Ipv4Addr, with_macs: bool, now: Instant) -> Option<Route> {
    let probe = UdpSocket::bind((Ipv4Addr::UNSPECIFIED, 0)).ok()?;
    probe.connect((to, 9)).ok()?;
    let IpAddr::V4(source) = probe.local_addr().ok()?.ip() else {
        return None;
    };
    let local = to.is_loopback() || UdpSocket::bind((to, 0)).is_ok();
    let (ifindex, macs) = if local {
        (0, None)
    } else if !with_macs {
        (ifindex(&interface_to(to)?.0).ok()?, None)
    } else {
        let (name, gateway) = interface_to(to)?;
        let next_hop = gateway.unwrap_or(to);
        let macs = neighbour_mac(next_hop, &name)
            .zip(mac_of(&name))
            .map(|(dst, src)| {
                let mut macs = [0u8; 12];
                macs[..6].copy_from_slice(&dst);
                macs[6..].copy_from_slice(&src);
                macs
            });
        (ifindex(&name).ok()?, macs)
    };
    Some(Route {
        source,
        ifindex,
        macs,
        found: now,
    })
}

/// The interface this host routes `to` through, by the main table's longest prefix
/// (`/proc/net/route`), and the gateway if the route has one.
fn interface_to(to: Ipv4Addr) -> Option<(String, Option<Ipv4Addr>)> {
    let table = std::fs::read_to_string("/proc/net/route").ok()?;
    let to = u32::from_ne_bytes(to.octets());
    let mut best: Option<(u32, &str, u32)> = None;
    for line in table.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (Some(name), Some(dest), Some(gateway), Some(mask)) =
            (f.first(), f.get(1), f.get(2), f.get(7))
        else {
            continue;
        };
        let (Ok(dest), Ok(gateway), Ok(mask)) = (
            u32::from_str_radix(dest, 16),
            u32::from_str_radix(gateway, 16),
            u32::from_str_radix(mask, 16),
        ) else {
            continue;
        };
        if to & mask == dest && best.is_none_or(|(m, _, _)| mask.count_ones() > m.count_ones()) {
            best = Some((mask, name, gateway));
        }
    }
    let (_, name, gateway) = best?;
    let gateway = (gateway != 0).then(|| Ipv4Addr::from(gateway.to_ne_bytes()));
    Some((name.to_owned(), gateway))
}

/// An entry pair's values as the kernel has them (client → peer, peer → client).
type KernelValues = (Option<[u8; OUT_VALUE]>, Option<[u8; IN_VALUE]>);

/// What `entry` relayed since its last read, given the kernel's `values` of it (an entry the
/// kernel no longer has counts as unchanged).
fn account(entry: &mut Installed, values: &KernelValues) -> Option<Delta> {
    let out = values
        .0
        .map_or(entry.seen_out, |v| Relayed::read(&v, OUT_COUNTERS));
    let into = values
        .1
        .map_or(entry.seen_in, |v| Relayed::read(&v, IN_COUNTERS));
    let delta = Delta {
        listener: entry.listener,
        cluster: entry.cluster,
        out: out.since(entry.seen_out),
        into: into.since(entry.seen_in),
    };
    entry.seen_out = out;
    entry.seen_in = into;
    (delta.out.packets + delta.into.packets > 0).then_some(delta)
}

impl OffloadTable {
    pub(crate) fn new(offload: Arc<Offload>) -> OffloadTable {
        OffloadTable {
            offload,
            by_relay: HashMap::new(),
            routes: HashMap::new(),
            epoch: Instant::now(),
            epoch_ns: monotonic_ns(),
        }
    }

    fn ns(&self, at: Instant) -> u64 {
        match at.checked_duration_since(self.epoch) {
            Some(after) => self.epoch_ns + after.as_nanos() as u64,
            None => self
                .epoch_ns
                .saturating_sub(self.epoch.duration_since(at).as_nanos() as u64),
        }
    }

    /// How this host reaches `to`, cached for [`ROUTE_TTL`].
    fn route(&mut self, to: Ipv4Addr, now: Instant) -> Option<Route> {
        if let Some(route) = self.routes.get(&to).filter(|r| now < r.found + ROUTE_TTL) {
            return Some(*route);
        }
        if self.routes.len() >= ROUTES {
            self.routes.clear();
        }
        let route = route_to(to, self.offload.xdp_running(), now)?;
        self.routes.insert(to, route);
        Some(route)
    }

    /// The entry for `channel` of the allocation whose relay socket has port `relay_port`,
    /// for a client on listener port `listener_port`; `None` where the program cannot relay it
    /// (IPv6, no route).
    fn spec(
        &mut self,
        channel: &OffloadChannel,
        listener_port: u16,
        relay_port: u16,
        now: Instant,
    ) -> Option<EntrySpec> {
        let (SocketAddr::V4(client), SocketAddr::V4(peer)) = (channel.client, channel.peer) else {
            return None;
        };
        let toward_client = self.route(*client.ip(), now)?;
        let toward_peer = self.route(*peer.ip(), now)?;
        Some(EntrySpec {
            client,
            listener: SocketAddrV4::new(toward_client.source, listener_port),
            channel: channel.number,
            relay: SocketAddrV4::new(toward_peer.source, relay_port),
            peer,
            peer_ifindex: toward_peer.ifindex,
            client_ifindex: toward_client.ifindex,
            peer_macs: toward_peer.macs,
            client_macs: toward_client.macs,
            expires_ns: self.ns(channel.expires_at),
        })
    }

    /// Makes the entries of allocation `relay` those of `channels` (each with its listener's
    /// port): new ones installed, gone ones removed (their last counts into `deltas`), kept
    /// ones keep their counters; an entry whose end moves later is extended at once only if its
    /// current end is near, else at the next [`OffloadTable::sync`].
    pub(crate) fn set(
        &mut self,
        relay: RelayId,
        relay_port: u16,
        channels: &[(OffloadChannel, u16)],
        now: Instant,
        deltas: &mut Vec<Delta>,
    ) {
        let mut old = self.by_relay.remove(&relay).unwrap_or_default();
        let mut new = Vec::with_capacity(channels.len());
        for (channel, listener_port) in channels {
            let Some(spec) = self.spec(channel, *listener_port, relay_port, now) else {
                continue;
            };
            let kept = old.iter().position(|o| {
                EntrySpec {
                    expires_ns: spec.expires_ns,
                    ..o.spec
                } == spec
            });
            let entry = match kept {
                Some(i) => {
                    let mut entry = old.swap_remove(i);
                    entry.expires_at = channel.expires_at;
                    let later = spec.expires_ns >= entry.spec.expires_ns;
                    let near = self.ns(now + EXTEND_AT_SYNC) >= entry.spec.expires_ns;
                    if spec.expires_ns != entry.spec.expires_ns && (!later || near) {
                        let spec = EntrySpec {
                            expires_ns: spec.expires_ns,
                            ..entry.spec
                        };
                        self.rewrite(&mut entry, spec, deltas);
                    }
                    entry
                }
                None => {
                    if let Err(e) = self.offload.install(&spec) {
                        tracing::warn!(target: "stunner", "offload: cannot install channel {:#x} of {}: {e}", spec.channel, spec.client);
                        continue;
                    }
                    Installed {
                        spec,
                        listener: channel.listener,
                        cluster: channel.cluster,
                        expires_at: channel.expires_at,
                        seen_out: Relayed::default(),
                        seen_in: Relayed::default(),
                    }
                }
            };
            new.push(entry);
        }
        for gone in old {
            self.remove(gone, deltas);
        }
        if !new.is_empty() {
            self.by_relay.insert(relay, new);
        }
    }

    /// Gives `entry` a new end or new MAC addresses (`spec`, same keys) in the kernel, keeping
    /// its counters there (what the program counts between the read and the write is lost:
    /// microseconds).
    fn rewrite(&self, entry: &mut Installed, spec: EntrySpec, deltas: &mut Vec<Delta>) {
        let kernel = self.values(&entry.spec);
        if let Some(delta) = account(entry, &kernel) {
            deltas.push(delta);
        }
        let mut out = spec.out_value();
        let mut into = spec.in_value();
        if let Some(kernel) = kernel.0 {
            out[OUT_COUNTERS..].copy_from_slice(&kernel[OUT_COUNTERS..]);
        }
        if let Some(kernel) = kernel.1 {
            into[IN_COUNTERS..].copy_from_slice(&kernel[IN_COUNTERS..]);
        }
        let written = self
            .offload
            .out
            .update(&spec.out_key(), &out)
            .and_then(|()| self.offload.into.update(&spec.in_key(), &into));
        match written {
            Ok(()) => entry.spec = spec,
            Err(e) => {
                tracing::warn!(target: "stunner", "offload: cannot extend channel {:#x} of {}: {e}", spec.channel, spec.client)
            }
        }
    }

    /// Removes the entries of allocation `relay` (it ended).
    pub(crate) fn forget(&mut self, relay: RelayId, deltas: &mut Vec<Delta>) {
        for gone in self.by_relay.remove(&relay).unwrap_or_default() {
            self.remove(gone, deltas);
        }
    }

    fn remove(&self, mut gone: Installed, deltas: &mut Vec<Delta>) {
        // Counts first: what it relayed until now is still the allocation's traffic.
        if let Some(delta) = self.read(&mut gone) {
            deltas.push(delta);
        }
        let _ = self.offload.out.delete(&gone.spec.out_key());
        let _ = self.offload.into.delete(&gone.spec.in_key());
    }

    /// What `entry` relayed since its last read.
    fn read(&self, entry: &mut Installed) -> Option<Delta> {
        let kernel = self.values(&entry.spec);
        account(entry, &kernel)
    }

    /// The kernel's values of `spec`'s two entries (`None` for one that is not there).
    fn values(&self, spec: &EntrySpec) -> KernelValues {
        let mut out = [0u8; OUT_VALUE];
        let mut into = [0u8; IN_VALUE];
        let out =
            matches!(self.offload.out.lookup(&spec.out_key(), &mut out), Ok(true)).then_some(out);
        let into = matches!(
            self.offload.into.lookup(&spec.in_key(), &mut into),
            Ok(true)
        )
        .then_some(into);
        (out, into)
    }

    /// Reads every entry's counters and writes the extensions that waited: the allocations
    /// with an entry that ended by `now` (the program stopped relaying it at its end already),
    /// to check again.
    /// With XDP running, an entry still missing the MAC addresses of a next hop gets them once
    /// the neighbour table has them (routes are looked up again every [`ROUTE_TTL`]).
    pub(crate) fn sync(&mut self, now: Instant, deltas: &mut Vec<Delta>) -> Vec<RelayId> {
        let mut ended = Vec::new();
        let xdp = self.offload.xdp_running();
        if xdp {
            self.offload.check_xdp();
        }
        let mut by_relay = std::mem::take(&mut self.by_relay);
        for (relay, entries) in &mut by_relay {
            for entry in entries.iter_mut() {
                let mut spec = EntrySpec {
                    expires_ns: self.ns(entry.expires_at).max(entry.spec.expires_ns),
                    ..entry.spec
                };
                if xdp {
                    self.learn_macs(&mut spec, now);
                }
                if spec != entry.spec {
                    self.rewrite(entry, spec, deltas);
                } else if let Some(delta) = self.read(entry) {
                    deltas.push(delta);
                }
            }
            if entries.iter().any(|e| e.expires_at <= now) {
                ended.push(*relay);
            }
        }
        self.by_relay = by_relay;
        ended
    }

    /// Fills in the MAC addresses `spec` lacks toward a next hop, if the neighbour table has
    /// them now.
    fn learn_macs(&mut self, spec: &mut EntrySpec, now: Instant) {
        if spec.peer_ifindex != 0 && spec.peer_macs.is_none() {
            spec.peer_macs = self.route(*spec.peer.ip(), now).and_then(|r| r.macs);
        }
        if spec.client_ifindex != 0 && spec.client_macs.is_none() {
            spec.client_macs = self.route(*spec.client.ip(), now).and_then(|r| r.macs);
        }
    }

    /// Channels installed.
    pub(crate) fn len(&self) -> usize {
        self.by_relay.values().map(Vec::len).sum()
    }
}

//! The kernel offload (`--offload`): an eBPF program at TC ingress of the interfaces that carry
//! client and peer traffic relays the ChannelData of established channels without waking a
//! shard, and with `xdp` an XDP program in the driver relays those it can send straight back out
//! of the interface they arrived on, before the kernel builds a socket buffer, passing the rest
//! to the TC program (`offload.c` says what each does to a packet).
//!
//! User space stays the authority. [`start`] loads the programs once for the process (their
//! maps shared by the shards) and attaches them with links (tcx, XDP), which the kernel removes
//! when the process exits, however it exits. Each shard keeps an `OffloadTable` of the entries of its
//! own allocations: it installs a channel's pair of entries when the engine reports a change on
//! the allocation ([`crate::proto::Engine::poll_offload`]) and the channel is bound, its
//! permission live and its peer admitted; it removes them when the allocation ends, and when a
//! later check (a request on the allocation, a new snapshot, the entry's end) finds the channel
//! no longer offloadable. Every entry carries the instant it ends, which the program checks per
//! packet, so a channel or permission expires exactly as it does in user space. Once per
//! second the shard reads the entries' counters into its own metrics.
//!
//! Where each part lives: `mode.rs` which offload runs where ([`start`], [`OffloadMode`]);
//! `program.rs` the loader (aya); `maps.rs` the maps' layout (generated from `offload.h`) and
//! handles; `error.rs` why it cannot run ([`OffloadError`]); `entries.rs`, `table.rs` and
//! `routes.rs` a shard's entries.

mod entries;
mod error;
mod maps;
mod mode;
mod program;
mod routes;
mod table;

pub use error::{OffloadError, OffloadStep};
pub use maps::{EntrySpec, Relayed};
pub use mode::{default_interfaces, start, OffloadMode, OffloadStatus};
pub use program::{LimitProgram, TestRun, BPF_CLANG};
pub(crate) use table::{Delta, OffloadTable};

use maps::{Maps, IN_VALUE, OUT_VALUE};
use mode::XdpLinks;
use program::Programs;
use std::io;
use std::time::Duration;

/// How often a shard reads its entries' counters.
pub(crate) const COUNTER_SYNC: Duration = Duration::from_secs(1);

/// The loaded program and its maps, shared by the shards; dropping the last handle detaches
/// the program from every interface.
pub struct Offload {
    /// Interfaces with the XDP program.
    xdp_links: XdpLinks,
    maps: Maps,
    programs: Programs,
}

impl std::fmt::Debug for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Offload")
            .field("links", &self.programs.tc_links())
            .finish()
    }
}

impl Offload {
    /// Loads the program (not attached anywhere yet).
    pub fn load() -> Result<Offload, OffloadError> {
        let mut programs = Programs::load(maps::max_channels())?;
        let maps = Maps::take(programs.ebpf())?;
        Ok(Offload {
            xdp_links: XdpLinks::default(),
            maps,
            programs,
        })
    }

    /// Attaches the program at TC ingress of interface `name`.
    pub fn attach(&mut self, name: &str) -> Result<(), OffloadError> {
        mode::ifindex(name)?;
        self.programs.attach_tc(name)
    }

    /// Runs the XDP program in the driver of interface `name`.
    pub fn attach_xdp(&mut self, name: &str) -> Result<(), OffloadError> {
        let index = mode::ifindex(name)?;
        let link = self.programs.attach_xdp(name, index)?;
        self.xdp_links.push(name, index, link);
        Ok(())
    }

    /// Whether any interface runs the XDP program.
    pub fn xdp_running(&self) -> bool {
        self.xdp_links.any()
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
        self.xdp_links.names()
    }

    /// Takes the XDP program off every interface whose transmit drops grew since the last
    /// check, the TC program carrying its traffic from then on. Called from every shard's
    /// once-a-second sync (the first to see the drops takes it off).
    pub(crate) fn check_xdp(&self) {
        self.xdp_links.check();
    }

    /// Runs the program `repeat` times on `packet` (an Ethernet frame), in the kernel
    /// (`BPF_PROG_TEST_RUN`): the benchmark of its per-packet cost.
    pub fn test_run(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        self.programs.test_run(packet, repeat)
    }

    /// Runs the XDP program `repeat` times on `packet`, as [`Offload::test_run`].
    pub fn test_run_xdp(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        self.programs.test_run_xdp(packet, repeat)
    }

    /// The program that only redirects every packet back out of its interface: the limit
    /// the offload's per-packet cost is measured against (`cargo bench --bench offload`).
    pub fn limit_program() -> Result<LimitProgram, OffloadError> {
        LimitProgram::load(false)
    }

    /// The XDP limit: a program that sends every frame straight back out (XDP_TX).
    pub fn limit_program_xdp() -> Result<LimitProgram, OffloadError> {
        LimitProgram::load(true)
    }

    /// Installs a channel by hand (benchmarks and tests of the program itself; the shards
    /// install what the engine admits). It relays only while its allocation's deadline
    /// ([`Offload::set_deadline`]) and its own end are ahead.
    pub fn install(&self, entry: &EntrySpec) -> io::Result<()> {
        self.write(entry, &entry.out_value(), &entry.in_value())
    }

    /// Writes `entry`'s two keys with the values given.
    fn write(
        &self,
        entry: &EntrySpec,
        out: &[u8; OUT_VALUE],
        into: &[u8; IN_VALUE],
    ) -> io::Result<()> {
        self.maps.write(entry, out, into)
    }

    /// Removes `entry`'s two keys (each may be gone already).
    pub fn remove(&self, entry: &EntrySpec) {
        self.maps.remove(entry);
    }

    /// The kernel's values of `entry`'s two keys (`None` for one that is not there).
    fn values(&self, entry: &EntrySpec) -> table::KernelValues {
        self.maps.values(entry)
    }

    /// What `entry`'s two keys counted in the kernel: client → peer, peer → client (zero for
    /// a key that is not there).
    pub fn relayed(&self, entry: &EntrySpec) -> (Relayed, Relayed) {
        let (out, into) = self.values(entry);
        (
            out.map_or_else(Relayed::default, |v| Relayed::read(&v, maps::OUT_COUNTERS)),
            into.map_or_else(Relayed::default, |v| Relayed::read(&v, maps::IN_COUNTERS)),
        )
    }

    /// Allocation slot `alloc` ends at `ns` (CLOCK_MONOTONIC nanoseconds; 0: ended).
    pub fn set_deadline(&self, alloc: u32, ns: u64) -> io::Result<()> {
        self.maps.set_deadline(alloc, ns)
    }

    /// A free deadline slot, if any is left.
    pub fn acquire_deadline(&self) -> Option<u32> {
        self.maps.acquire_deadline()
    }

    /// Gives deadline slot `alloc` back (its entries are gone, its deadline zero).
    fn release_deadline(&self, alloc: u32) {
        self.maps.release_deadline(alloc);
    }
}

//! The loader: the object clang built from `offload.c` (see `build.rs`), loaded with aya (its
//! maps created from the object's BTF-described `.maps`, its programs relocated and verified),
//! the TC program attached with tcx links and the XDP program in drivers with XDP links. A link
//! lives as long as its handle here: the kernel detaches the programs when the process exits,
//! however it exits.
//!
//! What aya leaves to us: naming the failures (`OffloadError`). aya 0.14 does every `bpf(2)`
//! call the offload makes, `BPF_PROG_TEST_RUN` included; each map write is still one
//! `BPF_MAP_UPDATE_ELEM`. One difference from a bare link: its XDP attach falls back to a
//! netlink attachment (which would outlive a killed process) when `bpf_link_create` answers
//! `EINVAL`. On the kernels the TC program needs (tcx: 6.6 and later) that answer comes from
//! the driver refusing the program in native mode (an MTU too large for XDP, say), and the
//! netlink attach in driver mode asks the same driver and is refused the same way, so the
//! interface is reported as running no XDP, as before.

use super::error::{copy, os_error, OffloadError, OffloadStep};
use aya::programs::tc::TcAttachOptions;
use aya::programs::xdp::XdpLink;
use aya::programs::{
    LinkOrder, ProgramError, SchedClassifier, TcAttachType, TestRun as _, TestRunOptions,
    TestRunResult, Xdp, XdpMode,
};
use aya::{Ebpf, EbpfLoader};
use std::io;

/// The program clang built from `offload.c` (see `build.rs`), if it was built.
/// The clang `dataplane/build.rs` built the offload's programs with: the one search for a
/// clang (`$UTURN_CLANG`, else `clang`, then `clang-21` down to `clang-14`), which tests that
/// build BPF programs of their own take too. `None`: the build found no clang that built them.
pub const BPF_CLANG: Option<&str> = option_env!("UTURN_BPF_CLANG");

#[cfg(uturn_bpf)]
const OBJECT: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/offload.o")));
#[cfg(not(uturn_bpf))]
const OBJECT: Option<&[u8]> = None;
/// The bench-only limit programs (`limit.c`), built apart from the production object.
#[cfg(uturn_bpf)]
const LIMIT_OBJECT: Option<&[u8]> = Some(include_bytes!(concat!(env!("OUT_DIR"), "/limit.o")));
#[cfg(not(uturn_bpf))]
const LIMIT_OBJECT: Option<&[u8]> = None;

/// The TC program's function name in `offload.c` (section `classifier`).
const TC: &str = "uturn_offload";
/// The XDP program's (section `xdp`).
const XDP: &str = "uturn_offload_xdp";

/// The loaded object: its programs, their tcx links, and the maps the programs alone use.
pub(super) struct Programs {
    ebpf: Ebpf,
    /// Whether the XDP program loaded, or why not.
    xdp: Result<(), OffloadError>,
    /// Interfaces with the TC program.
    tc_links: usize,
}

/// The object's error, named by what it was doing: a refusal of the kernel keeps its errno.
fn kernel_error(step: OffloadStep, error: aya::EbpfError) -> OffloadError {
    match os_error(&error) {
        Some(error) => OffloadError::Kernel { step, error },
        None => OffloadError::BadObject(error.to_string()),
    }
}

/// Loads `elf` (its maps created; `max_channels` entries in each channel map, if given).
fn open(elf: &[u8], max_channels: Option<u32>) -> Result<Ebpf, OffloadError> {
    let mut loader = EbpfLoader::new();
    // The programs use no CO-RE relocations: the kernel's own BTF is not read.
    loader.btf(None);
    if let Some(n) = max_channels {
        loader
            .map_max_entries("chan_out", n)
            .map_max_entries("chan_in", n);
    }
    loader
        .load(elf)
        .map_err(|e| kernel_error(OffloadStep::CreateMaps, e))
}

/// A program's load failure: the verifier's reason when it gave one.
fn refused(section: &'static str, error: ProgramError) -> OffloadError {
    if let ProgramError::LoadError {
        io_error,
        verifier_log,
    } = &error
    {
        let log = verifier_log.to_string();
        let lines: Vec<&str> = log.lines().filter(|l| !l.is_empty()).collect();
        if !lines.is_empty() {
            return OffloadError::Verifier {
                section,
                error: copy(io_error),
                log: lines[lines.len().saturating_sub(8)..].join("\n"),
            };
        }
    }
    match os_error(&error) {
        Some(error) => OffloadError::Kernel {
            step: OffloadStep::LoadProgram(section),
            error,
        },
        None => OffloadError::BadObject(format!("the {section} program: {error}")),
    }
}

/// `ebpf`'s program `name` as a `P` (for a test run).
fn find<'a, P: 'a>(ebpf: &'a Ebpf, name: &str) -> io::Result<&'a P>
where
    &'a P: TryFrom<&'a aya::programs::Program>,
{
    ebpf.program(name)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| io::Error::other(format!("no program {name}")))
}

/// `ebpf`'s program `name` as a `P` (to attach it).
fn find_mut<'a, P: 'a>(ebpf: &'a mut Ebpf, name: &str) -> Result<&'a mut P, OffloadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    ebpf.program_mut(name)
        .and_then(|p| p.try_into().ok())
        .ok_or_else(|| OffloadError::BadObject(format!("no program {name}")))
}

/// Loads `ebpf`'s program `name` (a `P`, in `section`) into the kernel.
fn load_program<'a, P: 'a>(
    ebpf: &'a mut Ebpf,
    name: &str,
    section: &'static str,
    load: impl FnOnce(&mut P) -> Result<(), ProgramError>,
) -> Result<(), OffloadError>
where
    &'a mut P: TryFrom<&'a mut aya::programs::Program>,
{
    load(find_mut::<P>(ebpf, name)?).map_err(|e| refused(section, e))
}

impl Programs {
    /// Loads the object (`max_channels` entries in each channel map) and its programs
    /// (attached nowhere yet). Only the TC program must load; the XDP program's refusal is
    /// kept for [`Programs::attach_xdp`] to report.
    pub(super) fn load(max_channels: u32) -> Result<Programs, OffloadError> {
        let elf = OBJECT.ok_or(OffloadError::NoProgram)?;
        let mut ebpf = open(elf, Some(max_channels))?;
        load_program::<SchedClassifier>(&mut ebpf, TC, "classifier", SchedClassifier::load)?;
        let xdp = load_program::<Xdp>(&mut ebpf, XDP, "xdp", Xdp::load);
        Ok(Programs {
            ebpf,
            xdp,
            tc_links: 0,
        })
    }

    /// The object, for its maps.
    pub(super) fn ebpf(&mut self) -> &mut Ebpf {
        &mut self.ebpf
    }

    /// Attaches the TC program at ingress of `interface` with a tcx link.
    pub(super) fn attach_tc(&mut self, interface: &str) -> Result<(), OffloadError> {
        let program: &mut SchedClassifier = find_mut(&mut self.ebpf, TC)?;
        let options = TcAttachOptions::TcxOrder(LinkOrder::default());
        program
            .attach_with_options(interface, TcAttachType::Ingress, options)
            .map_err(|e| OffloadError::TcAttach {
                interface: interface.to_owned(),
                error: os_error(&e).unwrap_or_else(|| io::Error::other(e.to_string())),
            })?;
        self.tc_links += 1;
        Ok(())
    }

    /// Runs the XDP program in the driver of interface `index` (`name`), or not at all (no
    /// generic-mode fallback: the TC program carries what XDP would have).
    pub(super) fn attach_xdp(&mut self, name: &str, index: u32) -> Result<XdpLink, OffloadError> {
        // Every interface is told why the XDP program did not load.
        self.xdp.clone()?;
        let program: &mut Xdp = find_mut(&mut self.ebpf, XDP)?;
        let failed = |e: ProgramError| OffloadError::XdpAttach {
            interface: name.to_owned(),
            error: os_error(&e).unwrap_or_else(|| io::Error::other(e.to_string())),
        };
        let id = program
            .attach_to_if_index(index, XdpMode::Driver)
            .map_err(failed)?;
        program.take_link(id).map_err(failed)
    }

    /// Interfaces with the TC program.
    pub(super) fn tc_links(&self) -> usize {
        self.tc_links
    }

    /// Runs the TC program `repeat` times on `packet`.
    pub(super) fn test_run(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        let program: &SchedClassifier = find(&self.ebpf, TC)?;
        test_run(packet, repeat, |options| program.test_run(options))
    }

    /// Runs the XDP program `repeat` times on `packet`.
    pub(super) fn test_run_xdp(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        if let Err(e) = &self.xdp {
            return Err(io::Error::other(e.to_string()));
        }
        let program: &Xdp = find(&self.ebpf, XDP)?;
        test_run(packet, repeat, |options| program.test_run(options))
    }
}

/// One `BPF_PROG_TEST_RUN`: a program runs `repeat` times on a packet.
#[derive(Debug)]
pub struct TestRun {
    /// The program's return code.
    pub verdict: u32,
    /// Mean nanoseconds per run, as the kernel measured.
    pub duration_ns: u32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
}

/// Runs `run` on `packet` with room for what the program adds to it.
fn test_run(
    packet: &[u8],
    repeat: u32,
    run: impl FnOnce(TestRunOptions<'_>) -> Result<TestRunResult, ProgramError>,
) -> io::Result<TestRun> {
    let mut out = vec![0u8; packet.len() + 256];
    let options = TestRunOptions {
        data_in: Some(packet),
        data_out: Some(&mut out),
        repeat,
        ..TestRunOptions::default()
    };
    let result = run(options)
        .map_err(|e| os_error(&e).unwrap_or_else(|| io::Error::other(e.to_string())))?;
    out.truncate(result.data_size_out as usize);
    Ok(TestRun {
        verdict: result.return_value,
        duration_ns: u32::try_from(result.duration.as_nanos()).unwrap_or(u32::MAX),
        packet: out,
    })
}

/// A program that only sends every packet back where it came from: the limit the offload's
/// per-packet cost is measured against (`cargo bench --bench offload`). See
/// [`super::Offload::limit_program`].
pub struct LimitProgram {
    ebpf: Ebpf,
    xdp: bool,
}

impl std::fmt::Debug for LimitProgram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LimitProgram")
            .field("xdp", &self.xdp)
            .finish()
    }
}

/// The limit programs' function names in `limit.c`.
const LIMIT_TC: &str = "uturn_limit";
const LIMIT_XDP: &str = "uturn_limit_xdp";

impl LimitProgram {
    /// Loads the TC limit (`xdp`: the XDP limit).
    pub(super) fn load(xdp: bool) -> Result<LimitProgram, OffloadError> {
        let elf = LIMIT_OBJECT.ok_or(OffloadError::NoProgram)?;
        let mut ebpf = open(elf, None)?;
        if xdp {
            load_program::<Xdp>(&mut ebpf, LIMIT_XDP, "xdp", Xdp::load)?;
        } else {
            load_program::<SchedClassifier>(
                &mut ebpf,
                LIMIT_TC,
                "classifier",
                SchedClassifier::load,
            )?;
        }
        Ok(LimitProgram { ebpf, xdp })
    }

    /// As [`super::Offload::test_run`].
    pub fn test_run(&self, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
        if self.xdp {
            let program: &Xdp = find(&self.ebpf, LIMIT_XDP)?;
            test_run(packet, repeat, |options| program.test_run(options))
        } else {
            let program: &SchedClassifier = find(&self.ebpf, LIMIT_TC)?;
            test_run(packet, repeat, |options| program.test_run(options))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn garbage_is_a_bad_object_not_a_panic() {
        for elf in [&b""[..], b"\x7fELF\x02\x01rest", &[0xff; 64]] {
            assert!(matches!(open(elf, None), Err(OffloadError::BadObject(_))));
        }
    }
}

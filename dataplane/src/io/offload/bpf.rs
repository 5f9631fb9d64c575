//! The few `bpf(2)` commands the offload uses, on raw attribute buffers (the kernel's
//! `union bpf_attr`, zero-filled past the fields a command reads).

use std::ffi::CString;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const BPF_MAP_CREATE: i64 = 0;
const BPF_MAP_LOOKUP_ELEM: i64 = 1;
const BPF_MAP_UPDATE_ELEM: i64 = 2;
const BPF_MAP_DELETE_ELEM: i64 = 3;
const BPF_PROG_LOAD: i64 = 5;
const BPF_PROG_TEST_RUN: i64 = 10;
const BPF_LINK_CREATE: i64 = 28;

/// `bpf_map_type` values.
pub(super) const MAP_HASH: u32 = 1;
pub(super) const MAP_PERCPU_ARRAY: u32 = 6;
/// Hash map entries allocated when inserted, not all at creation.
pub(super) const MAP_NO_PREALLOC: u32 = 1;
/// `bpf_prog_type` of TC classifiers.
pub(super) const PROG_SCHED_CLS: u32 = 3;
/// `bpf_prog_type` of XDP programs.
pub(super) const PROG_XDP: u32 = 6;
/// `bpf_attach_type` of a tcx ingress link (Linux 6.6).
pub(super) const ATTACH_TCX_INGRESS: u32 = 46;
/// `bpf_attach_type` of an XDP link.
pub(super) const ATTACH_XDP: u32 = 37;
/// `XDP_FLAGS_DRV_MODE`: run in the driver, or not at all (no generic-mode fallback).
pub(super) const XDP_DRIVER_MODE: u32 = 1 << 2;
/// `BPF_ANY`: create or replace.
const UPDATE_ANY: u64 = 0;

/// The attribute union, as 8-byte words (its largest member is well under 128 bytes).
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Attr {
        Attr([0; 128])
    }

    fn u32(&mut self, offset: usize, value: u32) -> &mut Attr {
        self.0[offset..offset + 4].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn u64(&mut self, offset: usize, value: u64) -> &mut Attr {
        self.0[offset..offset + 8].copy_from_slice(&value.to_ne_bytes());
        self
    }

    fn ptr<T>(&mut self, offset: usize, value: *const T) -> &mut Attr {
        self.u64(offset, value as u64)
    }

    fn read_u32(&self, offset: usize) -> u32 {
        let mut word = [0; 4];
        word.copy_from_slice(&self.0[offset..offset + 4]);
        u32::from_ne_bytes(word)
    }

    /// Runs `cmd` with this attribute: its non-negative result.
    fn call(&mut self, cmd: i64) -> io::Result<i64> {
        // SAFETY: the buffer is as large as the kernel reads for every command used here, and
        // the pointers in it point at live buffers of the sizes stated beside them.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                cmd,
                self.0.as_mut_ptr(),
                self.0.len() as libc::c_uint,
            )
        };
        if ret < 0 {
            Err(io::Error::last_os_error())
        } else {
            Ok(ret)
        }
    }

    /// Runs `cmd`, which returns a new file descriptor.
    fn call_fd(&mut self, cmd: i64) -> io::Result<OwnedFd> {
        let fd = self.call(cmd)?;
        // SAFETY: the kernel returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
    }
}

/// A BPF map.
#[derive(Debug)]
pub(super) struct Map {
    fd: OwnedFd,
    key_size: usize,
    value_size: usize,
}

impl Map {
    /// Creates a map of `kind` (named `name`, at most 15 bytes, for `bpftool`).
    pub(super) fn create(
        name: &str,
        kind: u32,
        key_size: usize,
        value_size: usize,
        max_entries: u32,
        flags: u32,
    ) -> io::Result<Map> {
        let mut attr = Attr::new();
        attr.u32(0, kind)
            .u32(4, key_size as u32)
            .u32(8, value_size as u32)
            .u32(12, max_entries)
            .u32(16, flags);
        let name = name.as_bytes();
        let n = name.len().min(15);
        attr.0[28..28 + n].copy_from_slice(&name[..n]);
        let fd = attr.call_fd(BPF_MAP_CREATE)?;
        Ok(Map {
            fd,
            key_size,
            value_size,
        })
    }

    pub(super) fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    fn check(&self, key: &[u8], value: Option<&[u8]>) -> io::Result<()> {
        if key.len() != self.key_size || value.is_some_and(|v| v.len() != self.value_size) {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(())
    }

    /// Creates or replaces `key`'s value.
    pub(super) fn update(&self, key: &[u8], value: &[u8]) -> io::Result<()> {
        self.check(key, Some(value))?;
        let mut attr = Attr::new();
        attr.u32(0, self.fd() as u32)
            .ptr(8, key.as_ptr())
            .ptr(16, value.as_ptr())
            .u64(24, UPDATE_ANY);
        attr.call(BPF_MAP_UPDATE_ELEM).map(drop)
    }

    /// Removes `key` (`Ok(false)` if it was not there).
    pub(super) fn delete(&self, key: &[u8]) -> io::Result<bool> {
        self.check(key, None)?;
        let mut attr = Attr::new();
        attr.u32(0, self.fd() as u32).ptr(8, key.as_ptr());
        match attr.call(BPF_MAP_DELETE_ELEM) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// `key`'s value into `value` (`Ok(false)` if there is none).
    pub(super) fn lookup(&self, key: &[u8], value: &mut [u8]) -> io::Result<bool> {
        self.check(key, Some(value))?;
        let mut attr = Attr::new();
        attr.u32(0, self.fd() as u32)
            .ptr(8, key.as_ptr())
            .ptr(16, value.as_mut_ptr());
        match attr.call(BPF_MAP_LOOKUP_ELEM) {
            Ok(_) => Ok(true),
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
            Err(e) => Err(e),
        }
    }
}

/// A program the verifier refused: its error and the end of the verifier's log.
#[derive(Debug)]
pub(super) struct Refused {
    pub(super) error: io::Error,
    pub(super) log: String,
}

/// Loads `insns` (8-byte instructions) as a program of `kind`.
pub(super) fn load_program(
    name: &str,
    kind: u32,
    insns: &[u8],
    license: &str,
) -> Result<OwnedFd, Refused> {
    let license = CString::new(license).unwrap_or_default();
    let mut attr = Attr::new();
    attr.u32(0, kind)
        .u32(4, (insns.len() / 8) as u32)
        .ptr(8, insns.as_ptr())
        .ptr(16, license.as_ptr());
    let name = name.as_bytes();
    let n = name.len().min(15);
    attr.0[48..48 + n].copy_from_slice(&name[..n]);
    match attr.call_fd(BPF_PROG_LOAD) {
        Ok(fd) => Ok(fd),
        Err(error) => {
            // Again with the verifier's log, to say why.
            let mut log = vec![0u8; 1 << 20];
            attr.u32(24, 1)
                .u32(28, log.len() as u32)
                .ptr(32, log.as_mut_ptr());
            let again = attr.call_fd(BPF_PROG_LOAD);
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            let text = String::from_utf8_lossy(&log[..end]);
            let lines: Vec<&str> = text.lines().collect();
            let tail = lines[lines.len().saturating_sub(8)..].join("\n");
            match again {
                Ok(fd) => Ok(fd),
                Err(_) => Err(Refused { error, log: tail }),
            }
        }
    }
}

/// Attaches `program` to interface `ifindex` as a link of `attach_type`; the program stays
/// attached while the returned descriptor is open (and not a moment longer: a killed process
/// leaves nothing behind).
pub(super) fn link_create(
    program: &OwnedFd,
    ifindex: u32,
    attach_type: u32,
    flags: u32,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.u32(0, program.as_raw_fd() as u32)
        .u32(4, ifindex)
        .u32(8, attach_type)
        .u32(12, flags);
    attr.call_fd(BPF_LINK_CREATE)
}

/// One `BPF_PROG_TEST_RUN`: `program` runs `repeat` times on `packet`.
#[derive(Debug)]
pub struct TestRun {
    /// The program's return code.
    pub verdict: u32,
    /// Mean nanoseconds per run, as the kernel measured.
    pub duration_ns: u32,
    /// The packet as the program left it.
    pub packet: Vec<u8>,
}

pub(super) fn test_run(program: &OwnedFd, packet: &[u8], repeat: u32) -> io::Result<TestRun> {
    let mut out = vec![0u8; packet.len() + 256];
    let mut attr = Attr::new();
    attr.u32(0, program.as_raw_fd() as u32)
        .u32(8, packet.len() as u32)
        .u32(12, out.len() as u32)
        .ptr(16, packet.as_ptr())
        .ptr(24, out.as_mut_ptr())
        .u32(32, repeat);
    attr.call(BPF_PROG_TEST_RUN)?;
    out.truncate(attr.read_u32(12) as usize);
    Ok(TestRun {
        verdict: attr.read_u32(4),
        duration_ns: attr.read_u32(36),
        packet: out,
    })
}

//! Which IO backend can run here. io_uring is often blocked in containers (RuntimeDefault
//! seccomp profiles of containerd 2.x, Docker 25+ and CRI-O; the `kernel.io_uring_disabled`
//! sysctl), and glommio also needs RLIMIT_MEMLOCK of at least 512 KiB.

use super::sys::{self, IO_URING_PROBE_HEADER, IO_URING_PROBE_OP};
use std::fmt;
use std::os::fd::OwnedFd;

/// What waits for the shards' sockets (`--io-engine`; not the TURN engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackend {
    /// glommio executors over io_uring.
    Uring,
    /// Threads waiting in epoll.
    Epoll,
}

impl fmt::Display for IoBackend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoBackend::Uring => "uring",
            IoBackend::Epoll => "epoll",
        })
    }
}

/// glommio refuses to start below this RLIMIT_MEMLOCK.
const GLOMMIO_MEMLOCK: u64 = 512 * 1024;

/// Why io_uring cannot be used here, with the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks, once, what the io_uring backend needs: the sysctl, the memlock limit, a real ring
/// (`io_uring_setup` with four entries, closed at once) and, through `io_uring_register`'s
/// opcode probe, the operations the shards submit.
pub fn probe_uring() -> Result<(), Unavailable> {
    let sysctl = std::fs::read_to_string("/proc/sys/kernel/io_uring_disabled")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if sysctl == 2 {
        return Err(Unavailable(
            "io_uring is disabled by the sysctl kernel.io_uring_disabled=2; set it to 0 on the \
             node, or use --io-engine epoll"
                .into(),
        ));
    }
    if let Some(limit) = sys::memlock_limit().filter(|&limit| limit < GLOMMIO_MEMLOCK) {
        return Err(Unavailable(format!(
            "RLIMIT_MEMLOCK is {} KiB and the io_uring engine needs at least {} KiB; raise the \
             memlock limit (ulimit -l, or the container runtime's default), or use --io-engine \
             epoll",
            limit / 1024,
            GLOMMIO_MEMLOCK / 1024
        )));
    }
    // Dropping the ring closes it.
    let error = match sys::io_uring_setup(4) {
        Ok(ring) => return probe_opcodes(&ring),
        Err(error) => error,
    };
    Err(Unavailable(match error.raw_os_error() {
        Some(libc::ENOSYS) => format!(
            "io_uring_setup failed with ENOSYS ({error}): the kernel has no io_uring, or a \
             seccomp profile hides it; allow io_uring_setup, io_uring_enter and \
             io_uring_register (deploy/ has such a profile), or use --io-engine epoll"
        ),
        Some(libc::EPERM) if sysctl == 1 => format!(
            "io_uring_setup failed with EPERM ({error}): kernel.io_uring_disabled=1 limits \
             io_uring to the io_uring_group; set the sysctl to 0, or use --io-engine epoll"
        ),
        Some(libc::EPERM) => format!(
            "io_uring_setup failed with EPERM ({error}): a seccomp profile (the RuntimeDefault \
             of containerd 2.x, Docker 25+ or CRI-O) blocks it; allow io_uring_setup, \
             io_uring_enter and io_uring_register (deploy/ has such a profile), or use \
             --io-engine epoll"
        ),
        Some(libc::ENOMEM) => format!(
            "io_uring_setup failed with ENOMEM ({error}): raise the memlock limit, or use \
             --io-engine epoll"
        ),
        _ => format!("io_uring_setup failed ({error}); use --io-engine epoll"),
    }))
}

/// `--io-engine`: what the operator asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// io_uring when it works here, else epoll.
    Auto,
    /// io_uring or an error.
    Uring,
    /// epoll.
    Epoll,
}

/// The backend to run for `choice`, and why (one line for the log), or why the forced io_uring
/// backend cannot run.
pub fn select(choice: BackendChoice) -> Result<(IoBackend, String), Unavailable> {
    match choice {
        BackendChoice::Epoll => Ok((IoBackend::Epoll, "--io-engine epoll".into())),
        BackendChoice::Uring => {
            probe_uring().map(|()| (IoBackend::Uring, "--io-engine uring".into()))
        }
        BackendChoice::Auto => Ok(match probe_uring() {
            Ok(()) => (IoBackend::Uring, "io_uring is available".into()),
            Err(why) => (
                IoBackend::Epoll,
                format!("io_uring is not available: {why}"),
            ),
        }),
    }
}

/// The io_uring operations glommio submits for the shards: poll, recvmsg (UDP peek), timeout,
/// accept, cancel, recv (TCP peek), by their `IORING_OP_*` numbers.
const NEEDED_OPS: [(u8, &str); 6] = [
    (6, "POLL_ADD"),
    (10, "RECVMSG"),
    (11, "TIMEOUT"),
    (13, "ACCEPT"),
    (14, "ASYNC_CANCEL"),
    (27, "RECV"),
];

/// Asks `ring` which operations the kernel supports (`IORING_REGISTER_PROBE`); an error
/// names the first missing one, or says that `io_uring_register` itself is refused.
fn probe_opcodes(ring: &OwnedFd) -> Result<(), Unavailable> {
    const OPS: usize = 64;
    // struct io_uring_probe: last_op u8, ops_len u8, resv u16, resv2 [u32; 3], then OPS
    // entries of struct io_uring_probe_op (op u8, resv u8, flags u16, resv2 u32).
    let mut probe = [0u8; IO_URING_PROBE_HEADER + OPS * IO_URING_PROBE_OP];
    if let Err(error) = sys::io_uring_register_probe(ring, &mut probe) {
        return Err(Unavailable(format!(
            "io_uring_register failed ({error}): a seccomp profile allows io_uring_setup but \
             not io_uring_register; allow io_uring_setup, io_uring_enter and io_uring_register \
             (deploy/ has such a profile), or use --io-engine epoll"
        )));
    }
    let ops_len = usize::from(probe[1]).min(OPS);
    for (op, name) in NEEDED_OPS {
        let supported = (0..ops_len).any(|i| {
            let at = IO_URING_PROBE_HEADER + i * IO_URING_PROBE_OP;
            let entry = &probe[at..at + IO_URING_PROBE_OP];
            entry[0] == op && u16::from_ne_bytes([entry[2], entry[3]]) & 1 != 0
        });
        if !supported {
            return Err(Unavailable(format!(
                "the kernel's io_uring lacks IORING_OP_{name}, which the io_uring engine \
                 needs; use a newer kernel, or --io-engine epoll"
            )));
        }
    }
    Ok(())
}

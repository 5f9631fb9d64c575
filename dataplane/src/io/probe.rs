//! Which IO engine can run here. io_uring is often blocked in containers (RuntimeDefault
//! seccomp profiles of containerd 2.x, Docker 25+ and CRI-O; the `kernel.io_uring_disabled`
//! sysctl), and glommio also needs RLIMIT_MEMLOCK of at least 512 KiB.

use std::fmt;

/// The IO engine that runs the shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoEngine {
    /// glommio executors over io_uring.
    Uring,
    /// Threads waiting in epoll.
    Epoll,
}

impl fmt::Display for IoEngine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            IoEngine::Uring => "uring",
            IoEngine::Epoll => "epoll",
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

/// Checks, once, what the io_uring engine needs: the sysctl, the memlock limit, a real ring
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
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is valid for the call.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut limit) } == 0
        && limit.rlim_cur != libc::RLIM_INFINITY
        && limit.rlim_cur < GLOMMIO_MEMLOCK
    {
        return Err(Unavailable(format!(
            "RLIMIT_MEMLOCK is {} KiB and the io_uring engine needs at least {} KiB; raise the \
             memlock limit (ulimit -l, or the container runtime's default), or use --io-engine \
             epoll",
            limit.rlim_cur / 1024,
            GLOMMIO_MEMLOCK / 1024
        )));
    }
    // struct io_uring_params is 120 bytes; all-zero asks for defaults.
    let mut params = [0u8; 120];
    // SAFETY: io_uring_setup(entries, params) with a zeroed params buffer of the right size.
    let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4u32, params.as_mut_ptr()) };
    if fd >= 0 {
        let ops = probe_opcodes(fd as libc::c_int);
        // SAFETY: the ring fd we just got.
        unsafe { libc::close(fd as libc::c_int) };
        return ops;
    }
    let error = std::io::Error::last_os_error();
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
pub enum EngineChoice {
    /// io_uring when it works here, else epoll.
    Auto,
    /// io_uring or an error.
    Uring,
    /// epoll.
    Epoll,
}

/// The engine to run for `choice`, and why (one line for the log), or why the forced io_uring
/// engine cannot run.
pub fn select(choice: EngineChoice) -> Result<(IoEngine, String), Unavailable> {
    match choice {
        EngineChoice::Epoll => Ok((IoEngine::Epoll, "--io-engine epoll".into())),
        EngineChoice::Uring => {
            probe_uring().map(|()| (IoEngine::Uring, "--io-engine uring".into()))
        }
        EngineChoice::Auto => Ok(match probe_uring() {
            Ok(()) => (IoEngine::Uring, "io_uring is available".into()),
            Err(why) => (IoEngine::Epoll, format!("io_uring is not available: {why}")),
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

/// Asks ring `fd` which operations the kernel supports (`IORING_REGISTER_PROBE`); an error
/// names the first missing one, or says that `io_uring_register` itself is refused.
fn probe_opcodes(fd: libc::c_int) -> Result<(), Unavailable> {
    const IORING_REGISTER_PROBE: libc::c_uint = 8;
    const OPS: usize = 64;
    // struct io_uring_probe: last_op u8, ops_len u8, resv u16, resv2 [u32; 3], then OPS
    // entries of struct io_uring_probe_op (op u8, resv u8, flags u16, resv2 u32).
    let mut probe = [0u8; 16 + OPS * 8];
    // SAFETY: the buffer holds the header and OPS entries, as nr_args says.
    let rc = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            fd,
            IORING_REGISTER_PROBE,
            probe.as_mut_ptr(),
            OPS as libc::c_uint,
        )
    };
    if rc < 0 {
        let error = std::io::Error::last_os_error();
        return Err(Unavailable(format!(
            "io_uring_register failed ({error}): a seccomp profile allows io_uring_setup but \
             not io_uring_register; allow io_uring_setup, io_uring_enter and io_uring_register \
             (deploy/ has such a profile), or use --io-engine epoll"
        )));
    }
    let ops_len = usize::from(probe[1]).min(OPS);
    for (op, name) in NEEDED_OPS {
        let supported = (0..ops_len).any(|i| {
            let entry = &probe[16 + i * 8..16 + i * 8 + 8];
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

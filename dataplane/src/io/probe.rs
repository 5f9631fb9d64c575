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

/// Checks, once, what the io_uring engine needs: the sysctl, the memlock limit and a real ring
/// (`io_uring_setup` with four entries, closed at once).
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
        // SAFETY: the ring fd we just got.
        unsafe { libc::close(fd as libc::c_int) };
        return Ok(());
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

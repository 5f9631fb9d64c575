//! Which IO backend can run here. io_uring is often blocked in containers (RuntimeDefault
//! seccomp profiles of containerd 2.x, Docker 25+ and CRI-O; the `kernel.io_uring_disabled`
//! sysctl).

use super::uring::new_ring;
use io_uring::{opcode, IoUring, Probe};
use std::fmt;

/// What waits for the shards' sockets (`--io-engine`; not the TURN engine).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IoBackend {
    /// A ring per shard thread.
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

/// Why io_uring cannot be used here, with the fix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unavailable(pub String);

impl fmt::Display for Unavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks, once, what the io_uring backend needs: the sysctl, a real ring of the size the
/// shards use (closed at once), the features it relies on and, through `io_uring_register`'s
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
    // Dropping the ring closes it.
    let error = match new_ring() {
        Ok(ring) => return probe_ring(&ring),
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
            "io_uring_setup failed with ENOMEM ({error}): kernels before 5.12 charge rings to \
             RLIMIT_MEMLOCK; raise the memlock limit, or use --io-engine epoll"
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

/// The io_uring operations the shards submit, with their names for the error.
const NEEDED_OPS: [(u8, &str); 2] = [
    (opcode::PollAdd::CODE, "POLL_ADD"),
    (opcode::PollRemove::CODE, "POLL_REMOVE"),
];

/// Checks that `ring` waits with a timeout in one call (`IORING_FEAT_EXT_ARG`, Linux 5.11)
/// and keeps completions that overflow (`IORING_FEAT_NODROP`), and asks the kernel which
/// operations it supports (`IORING_REGISTER_PROBE`); an error names what is missing, or says
/// that `io_uring_register` itself is refused.
fn probe_ring(ring: &IoUring) -> Result<(), Unavailable> {
    let params = ring.params();
    for (has, name) in [
        (
            params.is_feature_ext_arg(),
            "IORING_FEAT_EXT_ARG (Linux 5.11)",
        ),
        (params.is_feature_nodrop(), "IORING_FEAT_NODROP (Linux 5.5)"),
    ] {
        if !has {
            return Err(Unavailable(format!(
                "the kernel's io_uring lacks {name}, which the io_uring engine needs; use a \
                 newer kernel, or --io-engine epoll"
            )));
        }
    }
    let mut probe = Probe::new();
    if let Err(error) = ring.submitter().register_probe(&mut probe) {
        return Err(Unavailable(format!(
            "io_uring_register failed ({error}): a seccomp profile allows io_uring_setup but \
             not io_uring_register; allow io_uring_setup, io_uring_enter and io_uring_register \
             (deploy/ has such a profile), or use --io-engine epoll"
        )));
    }
    for (op, name) in NEEDED_OPS {
        if !probe.is_supported(op) {
            return Err(Unavailable(format!(
                "the kernel's io_uring lacks IORING_OP_{name}, which the io_uring engine \
                 needs; use a newer kernel, or --io-engine epoll"
            )));
        }
    }
    Ok(())
}

//! Why the offload cannot run, as one closed type: each variant names what failed, and its
//! text (the log line and `/status`'s `offload.reason`) says how to fix it.

use std::fmt;
use std::io;

/// What the offload was doing when the kernel said no.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OffloadStep {
    /// Loading the object: creating its maps.
    CreateMaps,
    /// Writing the settings map.
    WriteSettings,
    /// Loading the program of this section.
    LoadProgram(&'static str),
}

impl fmt::Display for OffloadStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OffloadStep::CreateMaps => f.write_str("cannot create a BPF map"),
            OffloadStep::WriteSettings => f.write_str("cannot write the offload's settings"),
            OffloadStep::LoadProgram(section) => {
                write!(f, "the kernel refused the {section} program")
            }
        }
    }
}

/// Why the offload, or a part of it, cannot run.
#[derive(Debug)]
pub enum OffloadError {
    /// The build has no BPF object: clang or libbpf's headers were missing.
    NoProgram,
    /// The object clang built is not one the loader reads (a build bug, not the host's).
    BadObject(String),
    /// A `bpf(2)` call failed at `step` (no permission, no `bpf(2)`, or another refusal).
    Kernel {
        /// What was being done.
        step: OffloadStep,
        /// What the kernel answered.
        error: io::Error,
    },
    /// The verifier refused a program; the end of its log says why.
    Verifier {
        /// The program's section (`classifier`, `xdp`).
        section: &'static str,
        /// What the kernel answered.
        error: io::Error,
        /// The verifier log's last lines.
        log: String,
    },
    /// No interface of that name.
    NoInterface {
        /// The name asked for.
        interface: String,
        /// What the lookup answered.
        error: io::Error,
    },
    /// Attaching at TC ingress failed (`EINVAL`: no tcx links before Linux 6.6).
    TcAttach {
        /// The interface.
        interface: String,
        /// What the kernel answered.
        error: io::Error,
    },
    /// Attaching XDP in the driver failed (`EOPNOTSUPP`, `EINVAL`: the driver runs no XDP).
    XdpAttach {
        /// The interface.
        interface: String,
        /// What the kernel answered.
        error: io::Error,
    },
    /// No interface was given or found to attach to.
    NoInterfaces,
}

/// A copy of `error` (its errno, else its kind and text).
pub(super) fn copy(error: &io::Error) -> io::Error {
    match error.raw_os_error() {
        Some(code) => io::Error::from_raw_os_error(code),
        None => io::Error::new(error.kind(), error.to_string()),
    }
}

impl Clone for OffloadError {
    fn clone(&self) -> OffloadError {
        match self {
            OffloadError::NoProgram => OffloadError::NoProgram,
            OffloadError::BadObject(why) => OffloadError::BadObject(why.clone()),
            OffloadError::Kernel { step, error } => OffloadError::Kernel {
                step: *step,
                error: copy(error),
            },
            OffloadError::Verifier {
                section,
                error,
                log,
            } => OffloadError::Verifier {
                section,
                error: copy(error),
                log: log.clone(),
            },
            OffloadError::NoInterface { interface, error } => OffloadError::NoInterface {
                interface: interface.clone(),
                error: copy(error),
            },
            OffloadError::TcAttach { interface, error } => OffloadError::TcAttach {
                interface: interface.clone(),
                error: copy(error),
            },
            OffloadError::XdpAttach { interface, error } => OffloadError::XdpAttach {
                interface: interface.clone(),
                error: copy(error),
            },
            OffloadError::NoInterfaces => OffloadError::NoInterfaces,
        }
    }
}

/// The fix for a refusal the kernel gives every `bpf(2)` call alike, if it is one.
fn fix(error: &io::Error) -> Option<&'static str> {
    match error.raw_os_error() {
        Some(libc::EPERM) | Some(libc::EACCES) => {
            Some("the process needs CAP_BPF and CAP_NET_ADMIN (deploy/overlays/offload adds them)")
        }
        Some(libc::ENOSYS) => Some("this kernel has no bpf(2) or a filter denies it"),
        _ => None,
    }
}

/// `what: error`, and the fix when the error has a well-known one.
fn refused(f: &mut fmt::Formatter<'_>, what: &dyn fmt::Display, error: &io::Error) -> fmt::Result {
    match fix(error) {
        Some(fix) => write!(f, "{what}: {error}; {fix}"),
        None => write!(f, "{what}: {error}"),
    }
}

impl fmt::Display for OffloadError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OffloadError::NoProgram => f.write_str(
                "this build has no BPF program (clang and libbpf-dev were missing when it was \
                 built; install them and rebuild)",
            ),
            OffloadError::BadObject(why) => write!(f, "BPF object: {why}"),
            OffloadError::Kernel { step, error } => refused(f, step, error),
            OffloadError::Verifier {
                section,
                error,
                log,
            } => write!(
                f,
                "the verifier refused the {section} program ({error}): {}",
                log.replace('\n', " | ")
            ),
            OffloadError::NoInterface { interface, error } => {
                write!(f, "interface {interface}: {error}")
            }
            OffloadError::TcAttach { interface, error } => {
                if error.raw_os_error() == Some(libc::EINVAL) {
                    write!(
                        f,
                        "cannot attach to {interface}: {error}; TC offload needs tcx links \
                         (Linux 6.6 or later)"
                    )
                } else {
                    refused(f, &format_args!("cannot attach to {interface}"), error)
                }
            }
            OffloadError::XdpAttach { interface, error } => match error.raw_os_error() {
                Some(libc::EOPNOTSUPP) | Some(libc::EINVAL) => write!(
                    f,
                    "no XDP on {interface}: its driver does not run XDP programs ({error})"
                ),
                _ => refused(f, &format_args!("cannot attach XDP to {interface}"), error),
            },
            OffloadError::NoInterfaces => f.write_str("no interface to attach to"),
        }
    }
}

impl std::error::Error for OffloadError {}

/// The `io::Error` at the root of an aya error, if the kernel gave one.
pub(super) fn os_error(error: &(dyn std::error::Error + 'static)) -> Option<io::Error> {
    let mut cause = Some(error);
    while let Some(e) = cause {
        if let Some(io) = e.downcast_ref::<io::Error>() {
            return Some(copy(io));
        }
        cause = e.source();
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_denied_bpf_call_names_the_capabilities() {
        let e = OffloadError::Kernel {
            step: OffloadStep::CreateMaps,
            error: io::Error::from_raw_os_error(libc::EPERM),
        };
        let text = e.to_string();
        assert!(text.starts_with("cannot create a BPF map: Operation not permitted"));
        assert!(text.contains("CAP_BPF and CAP_NET_ADMIN"), "{text}");
    }

    #[test]
    fn a_tc_attach_without_tcx_names_the_kernel_version() {
        let e = OffloadError::TcAttach {
            interface: "eth0".into(),
            error: io::Error::from_raw_os_error(libc::EINVAL),
        };
        assert!(e.to_string().contains("Linux 6.6 or later"), "{e}");
    }
}

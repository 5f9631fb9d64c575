//! Which offload runs where: `--offload`'s modes, [`start`] (load, attach, and the one log line
//! saying what runs or why not), the interfaces it picks, and XDP giving way to TC on an
//! interface that drops what XDP sends back out.

use super::error::OffloadError;
use super::Offload;
use aya::programs::xdp::XdpLink as AyaXdpLink;
use std::io;
use std::sync::{Arc, Mutex};

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

/// Interface `name`'s index.
pub(super) fn ifindex(name: &str) -> Result<u32, OffloadError> {
    let missing = |error| OffloadError::NoInterface {
        interface: name.to_owned(),
        error,
    };
    let c_name =
        std::ffi::CString::new(name).map_err(|_| missing(io::ErrorKind::InvalidInput.into()))?;
    // SAFETY: a NUL-terminated name.
    match unsafe { libc::if_nametoindex(c_name.as_ptr()) } {
        0 => Err(missing(io::Error::last_os_error())),
        index => Ok(index),
    }
}

/// The XDP program on one interface, and the drops it has seen there.
struct XdpLink {
    name: String,
    index: u32,
    /// Dropping it takes the program off the interface.
    _link: AyaXdpLink,
    /// The interface's `tx_dropped` when the program was attached or last checked.
    tx_dropped: u64,
}

/// The interfaces that run the XDP program (entries carry MAC addresses while there are any).
#[derive(Default)]
pub(super) struct XdpLinks(Mutex<Vec<XdpLink>>);

impl XdpLinks {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<XdpLink>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Keeps `link`, the XDP program on interface `name` (`index`).
    pub(super) fn push(&self, name: &str, index: u32, link: AyaXdpLink) {
        self.lock().push(XdpLink {
            name: name.to_owned(),
            index,
            _link: link,
            tx_dropped: tx_dropped(name),
        });
    }

    /// The interfaces' names.
    pub(super) fn names(&self) -> Vec<String> {
        self.lock().iter().map(|l| l.name.clone()).collect()
    }

    /// Whether any interface runs the program.
    pub(super) fn any(&self) -> bool {
        !self.lock().is_empty()
    }

    /// Takes the XDP program off every interface whose transmit drops grew since the last
    /// check (a veth whose peer has no NAPI drops every XDP_TX frame), logging why and the fix;
    /// the TC program carries its traffic from then on.
    pub(super) fn check(&self) {
        self.lock().retain_mut(|link| {
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
}

/// What attaching found: the interfaces with the TC program, and why XDP runs on none of
/// those it was tried on.
struct Attached {
    tc: Vec<String>,
    xdp_skipped: Vec<OffloadError>,
}

/// Loads the offload and attaches it to `names` as `mode` asks; an error if no interface
/// takes the TC program.
fn load_and_attach(
    mode: OffloadMode,
    names: &[String],
) -> Result<(Offload, Attached), OffloadError> {
    let mut offload = Offload::load()?;
    let mut tc = Vec::new();
    let mut errors = Vec::new();
    for name in names {
        match offload.attach(name) {
            Ok(()) => tc.push(name.clone()),
            Err(e) => errors.push(e),
        }
    }
    if tc.is_empty() {
        return Err(errors
            .into_iter()
            .next()
            .unwrap_or(OffloadError::NoInterfaces));
    }
    for e in &errors {
        tracing::warn!(target: "stunnerd", "offload: {e}");
    }
    // XDP where the driver runs it: every interface but the loopback.
    let mut xdp_skipped = Vec::new();
    if mode == OffloadMode::Xdp {
        for name in tc.iter().filter(|name| !is_loopback(name)) {
            if let Err(e) = offload.attach_xdp(name) {
                xdp_skipped.push(e);
            }
        }
    }
    Ok((offload, Attached { tc, xdp_skipped }))
}

/// The reason a running offload gives, logged as it runs.
fn running_reason(mode: OffloadMode, offload: &Offload, attached: &Attached) -> String {
    let xdp = offload.xdp_interfaces();
    let mut reason = format!("TC ingress program attached to {}", attached.tc.join(", "));
    if !xdp.is_empty() {
        reason = format!(
            "XDP program in the driver of {}, passing the rest to the {reason}",
            xdp.join(", ")
        );
    }
    if mode == OffloadMode::Xdp && xdp.is_empty() {
        let why = attached.xdp_skipped.first().map_or_else(
            || "no interface but the loopback".to_owned(),
            |e| e.to_string(),
        );
        reason = format!("{reason}; XDP runs nowhere: {why}");
        tracing::warn!(target: "stunnerd", "offload: tc ({reason})");
    } else {
        for e in &attached.xdp_skipped {
            tracing::info!(target: "stunnerd", "offload: {e}");
        }
        tracing::info!(target: "stunnerd", "offload: {} ({reason})", offload.running());
    }
    reason
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
    match load_and_attach(mode, &names) {
        Ok((offload, attached)) => {
            let reason = running_reason(mode, &offload, &attached);
            let running = offload.running();
            (
                Some(Arc::new(offload)),
                status(running, reason, attached.tc),
            )
        }
        Err(error) => {
            let reason = error.to_string();
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

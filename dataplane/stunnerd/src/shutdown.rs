//! Shutting down as stunnerd does: SIGTERM and SIGINT are blocked in every thread and taken
//! by [`run_until_drained`] alone, which drains (or, with `--no-graceful-shutdown`, exits at
//! once).

use std::time::Duration;
use uturn_control::Control;
use uturn_dataplane::io::Dataplane;

/// Blocks SIGTERM and SIGINT in the calling thread and every thread it starts later, so that
/// only [`next_signal`] sees them. Call before any thread is spawned.
fn block_shutdown_signals() -> libc::sigset_t {
    // SAFETY: plain libc signal-set manipulation on a set we own.
    unsafe {
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, libc::SIGTERM);
        libc::sigaddset(&mut set, libc::SIGINT);
        libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut());
        set
    }
}

/// Waits up to `timeout` for SIGTERM or SIGINT; the signal, if one came.
fn next_signal(set: &libc::sigset_t, timeout: Duration) -> Option<i32> {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: set and ts are valid for the call; no siginfo is requested.
    let signal = unsafe { libc::sigtimedwait(set, std::ptr::null_mut(), &ts) };
    (signal > 0).then_some(signal)
}

/// Runs until SIGTERM or SIGINT, then drains as stunnerd does: the config loader stops,
/// readiness fails (unless forced), every allocation keeps working, and the process exits once
/// the last allocation is gone (or `drain_timeout` passes).
///
/// With `--no-graceful-shutdown` (`immediate`) it exits at once instead, closing every socket.
/// Until the signal it calls `every_second` about once a second.
pub(crate) fn run_until_drained(
    dataplane: &Dataplane,
    control: &Control,
    drain_timeout: Option<Duration>,
    immediate: bool,
    every_second: &dyn Fn(),
) {
    let signals = SHUTDOWN_SIGNALS
        .get()
        .copied()
        .unwrap_or_else(block_shutdown_signals);
    const POLL: Duration = Duration::from_millis(250);
    while next_signal(&signals, Duration::from_secs(1)).is_none() {
        every_second();
    }
    if immediate {
        tracing::info!(
            target: "stunnerd",
            "exiting with {} active connection(s): graceful shutdown is disabled",
            dataplane.allocation_count()
        );
        return;
    }
    let live = dataplane.allocation_count();
    tracing::info!(
        target: "stunnerd",
        "Commencing graceful shutdown with {live} active connection(s)"
    );
    if live > 0 {
        let wait = match drain_timeout {
            Some(t) => format!("at most {} s (--drain-timeout)", t.as_secs()),
            None => "until each is deleted or expires: up to its lifetime (600 s unless the \
                     client asked for another) after its client's last refresh; \
                     --drain-timeout SECONDS caps the wait"
                .to_owned(),
        };
        tracing::info!(
            target: "stunnerd",
            "waiting for the {live} allocation(s) to end, {wait}; to exit now, press Ctrl-C \
             again (or send another SIGINT or SIGTERM); --no-graceful-shutdown skips the drain"
        );
    }
    control.begin_drain();
    let started = std::time::Instant::now();
    loop {
        if dataplane.allocation_count() == 0 {
            tracing::info!(target: "stunnerd", "Normal exit on graceful shutdown");
            return;
        }
        if drain_timeout.is_some_and(|t| started.elapsed() >= t) {
            tracing::warn!(
                target: "stunnerd",
                "graceful shutdown timed out (--drain-timeout) with {} active connection(s): exiting",
                dataplane.allocation_count()
            );
            return;
        }
        if let Some(signal) = next_signal(&signals, POLL) {
            // A second signal is someone who will not wait (Kubernetes sends one SIGTERM,
            // then SIGKILL at the grace period's end): exit now, as --no-graceful-shutdown.
            tracing::warn!(
                target: "stunnerd",
                "signal {signal} during graceful shutdown: exiting now with {} active \
                 connection(s)",
                dataplane.allocation_count()
            );
            return;
        }
    }
}

/// The signal set blocked at the start of `main`.
static SHUTDOWN_SIGNALS: std::sync::OnceLock<libc::sigset_t> = std::sync::OnceLock::new();

/// Blocks SIGTERM and SIGINT for the whole process: call first in `main`, before any thread
/// exists, so that every thread inherits the mask and only the drain loop sees them.
pub(crate) fn block_signals() {
    let _ = SHUTDOWN_SIGNALS.set(block_shutdown_signals());
}

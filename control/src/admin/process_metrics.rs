//! Process metrics in the Prometheus client's standard names, read from `/proc/self`.
//!
//! Written as text, not through the `metrics` recorder: `process_cpu_seconds_total` is a
//! counter of fractional seconds, and a `metrics` counter holds whole numbers. The
//! `metrics-process` crate rounds it (and the start time) down to whole seconds for that
//! reason, or turns it into a gauge, and brings `procfs`; these six reads are exact.

use std::fmt::Write as _;

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    if ticks > 0 {
        ticks as f64
    } else {
        100.0
    }
}

fn page_size() -> u64 {
    // SAFETY: sysconf has no preconditions.
    let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    u64::try_from(size).unwrap_or(4096)
}

/// Fields of `/proc/self/stat` after the command name, 0-based from field 3 (`state`).
fn stat_fields() -> Vec<String> {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The command name may hold spaces and parentheses; it ends at the last ')'.
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.split_whitespace().map(str::to_string).collect())
        .unwrap_or_default()
}

fn boot_time() -> Option<u64> {
    std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse().ok())
}

/// Appends `process_*` metrics.
pub(crate) fn render(out: &mut String) {
    let fields = stat_fields();
    let field = |i: usize| fields.get(i).and_then(|f| f.parse::<u64>().ok());
    let ticks = clock_ticks();
    // stat(5): utime is field 14, stime 15, starttime 22, vsize 23, rss 24 (1-based); the
    // slice starts at field 3.
    if let (Some(utime), Some(stime)) = (field(11), field(12)) {
        let _ = writeln!(
            out,
            "# HELP process_cpu_seconds_total Total user and system CPU time spent in seconds."
        );
        let _ = writeln!(out, "# TYPE process_cpu_seconds_total counter");
        let _ = writeln!(
            out,
            "process_cpu_seconds_total {}",
            (utime + stime) as f64 / ticks
        );
    }
    if let Some(vsize) = field(20) {
        let _ = writeln!(
            out,
            "# HELP process_virtual_memory_bytes Virtual memory size in bytes."
        );
        let _ = writeln!(out, "# TYPE process_virtual_memory_bytes gauge");
        let _ = writeln!(out, "process_virtual_memory_bytes {vsize}");
    }
    if let Some(rss) = field(21) {
        let _ = writeln!(
            out,
            "# HELP process_resident_memory_bytes Resident memory size in bytes."
        );
        let _ = writeln!(out, "# TYPE process_resident_memory_bytes gauge");
        let _ = writeln!(out, "process_resident_memory_bytes {}", rss * page_size());
    }
    if let (Some(start), Some(boot)) = (field(19), boot_time()) {
        let _ = writeln!(out, "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.");
        let _ = writeln!(out, "# TYPE process_start_time_seconds gauge");
        let _ = writeln!(
            out,
            "process_start_time_seconds {}",
            boot as f64 + start as f64 / ticks
        );
    }
    if let Ok(fds) = std::fs::read_dir("/proc/self/fd") {
        let _ = writeln!(
            out,
            "# HELP process_open_fds Number of open file descriptors."
        );
        let _ = writeln!(out, "# TYPE process_open_fds gauge");
        let _ = writeln!(out, "process_open_fds {}", fds.count());
    }
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes into the struct we own.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } == 0 {
        let _ = writeln!(
            out,
            "# HELP process_max_fds Maximum number of open file descriptors."
        );
        let _ = writeln!(out, "# TYPE process_max_fds gauge");
        let _ = writeln!(out, "process_max_fds {}", limit.rlim_cur);
    }
}

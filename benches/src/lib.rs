//! `cargo bench -p uturn-benches`: see `benches/`. The TURN client lives in `uturn-perf`.

/// CPU time (ns) every thread of process `pid` has run (`/proc/<pid>/task/*/schedstat`);
/// 0 once the process is gone.
pub fn process_cpu_ns(pid: u32) -> u64 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    tasks
        .filter_map(|t| t.ok())
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

//! Where shards run: how many CPUs this process may use, which ones, and whether a shard is
//! pinned to one.

use super::sys;

/// The CPUs this process may use: `available_parallelism` (cgroup quota and affinity aware).
pub fn usable_cpus() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// The CPUs this process may run on (`sched_getaffinity`: a pod's cpuset, or `taskset`).
pub fn allowed_cpus() -> Vec<usize> {
    sys::cpu_affinity().unwrap_or_default()
}

/// Where each of `shards` shards runs, given the CPUs allowed: one shard per CPU, pinned, when
/// the cpuset holds exactly as many CPUs as there are shards (a Guaranteed pod's exclusive
/// CPUs under the static CPU manager, or `taskset`); unpinned otherwise, since a cpuset larger
/// than the CPU quota is a pool shared with other pods and the scheduler should place the
/// shards in it.
pub fn shard_placement(shards: usize, allowed: &[usize]) -> Vec<Option<usize>> {
    if allowed.len() == shards {
        allowed.iter().map(|&cpu| Some(cpu)).collect()
    } else {
        vec![None; shards]
    }
}

#[cfg(test)]
mod tests {
    use super::shard_placement;

    #[test]
    fn shards_are_pinned_only_to_a_cpuset_of_their_own_size() {
        assert_eq!(shard_placement(2, &[3, 5]), vec![Some(3), Some(5)]);
        assert_eq!(shard_placement(1, &[7]), vec![Some(7)]);
        // A quota smaller than the cpuset: a shared pool, left to the scheduler.
        assert_eq!(shard_placement(2, &[0, 1, 2, 3]), vec![None, None]);
        // More shards than CPUs (UTURN_SHARDS): nothing pinned.
        assert_eq!(shard_placement(4, &[0, 1]), vec![None; 4]);
    }
}

#!/usr/bin/env bash
# perf/restart.sh: what a restart costs a call, REPS runs (default 3) of
# `cargo bench --bench restart`: a paced call (50 ChannelData/s each way) through the release
# stunnerd on loopback, the process ended 2 s in and a new one started at once on the same
# config; per case (kill -9 without a state directory, kill -9 with --state-dir, SIGTERM with
# --no-graceful-shutdown and --state-dir) the datagrams lost each way, the longest gap and
# whether a Refresh after the restart succeeds; then the time from spawn to /ready of a process
# re-adopting RESTART_ALLOCATIONS (default 10000) allocations, beside an empty state directory.
#
#   perf/restart.sh                          # 3 runs
#   REPS=5 RESTART_ALLOCATIONS=20000 perf/restart.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
cargo build --release -q -p uturn-stunnerd
for rep in $(seq 1 "$REPS"); do
  echo "== run $rep of $REPS"
  cargo bench -q -p uturn-benches --bench restart 2>&1 | grep -E "^(kill|SIGTERM|re-adopt|request cost)"
done

#!/usr/bin/env bash
# perf/bench-ab.sh BASE_TARGET_DIR [ROUNDS]: the engine and relay benches of two builds,
# alternated round by round (base, this checkout, base, ...), so that a noisy machine weighs on
# both alike. BASE_TARGET_DIR is the target dir of another checkout (e.g. an older commit in a
# worktree of its own) where `cargo bench -p uturn-benches --bench engine --bench relay
# --no-run` has run; this checkout's benches are built here. Prints each round's criterion
# estimates and relay medians; compare the medians of the rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
base=${1:?usage: perf/bench-ab.sh BASE_TARGET_DIR [ROUNDS]}
rounds=${2:-3}
cargo bench -q -p uturn-benches --bench engine --bench relay --no-run
newest() { ls -t "$1"/release/deps/"$2"-* | grep -v '\.d$' | head -1; }
here=${CARGO_TARGET_DIR:-target}
for round in $(seq 1 "$rounds"); do
  for side in base this; do
    dir=$base
    [ "$side" = this ] && dir=$here
    echo "== round $round $side engine"
    "$(newest "$dir" engine)" --bench --warm-up-time 1 --measurement-time 4 --noplot 2>&1 |
      grep -E "^engine/|^ +time:" | grep -v "%"
    echo "== round $round $side relay"
    "$(newest "$dir" relay)" --bench 2>&1 | grep median
  done
done

#!/usr/bin/env bash
# perf/soak.sh: a bounded soak of stunnerd (release build) on loopback: live relays on all four
# transports, allocation churn, slow readers and hostile input for DURATION seconds (600), with
# RSS, open descriptors and allocations sampled every second. Writes OUT/samples.jsonl and
# OUT/soak.md (the result table) and exits 1 if the server died, a live relay lost a packet or
# a slow reader saw frames out of order.
#
#   perf/soak.sh                 # 10 minutes
#   DURATION=60 perf/soak.sh     # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-600}
OUT=${OUT:-target/soak}
command -v turnutils_uclient >/dev/null 2>&1 || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq coturn
}
cargo build --release -q -p uturn-stunnerd -p uturn-perf
exec target/release/soak --duration "$DURATION" --out "$OUT"

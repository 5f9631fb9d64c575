#!/usr/bin/env bash
# perf/soak.sh: a bounded soak of stunnerd (release build) on loopback: live relays on all four
# transports, allocation churn, slow readers and hostile input for DURATION seconds (900, past
# the 600 s allocation lifetime, so the allocations of clients that vanish without deleting
# expire while new ones arrive), with RSS, open descriptors and live allocations sampled every
# second. Writes OUT/samples.jsonl and OUT/soak.md (the result table); exits 1 if the server
# died, a live relay lost a packet, a slow reader saw frames out of order or stunnerd did not
# exit 0 after SIGTERM.
#
#   perf/soak.sh                 # 15 minutes
#   DURATION=60 perf/soak.sh     # a quick look
set -euo pipefail
cd "$(dirname "$0")/.."
DURATION=${DURATION:-900}
OUT=${OUT:-target/soak}
command -v turnutils_uclient >/dev/null 2>&1 || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq coturn
}
cargo build --release -q -p uturn-stunnerd -p uturn-perf
exec target/release/soak --duration "$DURATION" --out "$OUT"

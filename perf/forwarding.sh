#!/usr/bin/env bash
# perf/forwarding.sh: what second-chance forwarding costs a packet, REPS runs (default 3) of
# `cargo bench --bench forwarding` (root: network namespaces and nftables). Each run builds a
# namespace cluster (two gateway pods behind a NAT-ed VIP, a client, an echo peer) and measures,
# for a call straight through its owner and for the same call with its flow moved to the other
# pod (which forwards to the owner): ChannelData round-trip times (median, p90, p99 of 500
# sequential pings), and the CPU both pods spend per echoed packet at 500, 5000 and 20000
# packets/s (2 s each) and at saturation (64 in flight, 2 s; with the echoes a second).
#
#   perf/forwarding.sh            # 3 runs
#   REPS=5 perf/forwarding.sh
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
command -v nft >/dev/null 2>&1 || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nftables
}
cargo build --release -q -p uturn-stunnerd
for rep in $(seq 1 "$REPS"); do
  echo "== run $rep of $REPS"
  cargo bench -q -p uturn-benches --bench forwarding 2>&1 | grep -E "^(second-chance|straight|forwarded)"
done

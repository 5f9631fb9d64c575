#!/usr/bin/env bash
# perf/compare.sh: uturn, coturn, pion/turn and a plain batched UDP relay (the "no TURN"
# ceiling), one after another on this machine under the same turnperf load. Servers alternate
# run by run (A B C D A B C D ...), every cell is repeated REPS times, and one table of medians
# is printed with the ratios uturn/coturn, uturn/pion and uturn/plain.
#
#   perf/compare.sh                      # the full matrix (about 10 minutes on 2 cores)
#   REPS=1 SIZES=100 ALLOCS=64 THREADS=1 DURATION=2 perf/compare.sh   # a quick look
#
# Environment: REPS (3), DURATION seconds per run (3), SIZES ("100 1200"), ALLOCS ("64 1000"),
# THREADS ("1 2"), SERVERS ("uturn coturn pion plain"), RATE per allocation (0 = as fast as
# possible), FIND_MAX=1 (search each cell's highest rate with loss under MAX_LOSS percent, 1;
# slower), OUT (target/compare). Every loop is bounded by these counts; every server is
# started and stopped by this script, by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
DURATION=${DURATION:-3}
SIZES=${SIZES:-"100 1200"}
ALLOCS=${ALLOCS:-"64 1000"}
THREADS=${THREADS:-"1 2"}
SERVERS=${SERVERS:-"uturn coturn pion plain"}
RATE=${RATE:-0}
FIND_MAX=${FIND_MAX:-0}
MAX_LOSS=${MAX_LOSS:-1}
OUT=${OUT:-target/compare}
mkdir -p "$OUT"
results="$OUT/results.jsonl"
: > "$results"

need_apt=()
command -v turnserver >/dev/null 2>&1 || need_apt+=(coturn)
command -v go >/dev/null 2>&1 || need_apt+=(golang-go)
[ -d /usr/share/gocode/src/github.com/pion/turn/v2 ] || need_apt+=(golang-github-pion-turn.v2-dev)
if [ ${#need_apt[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi
cargo build --release -q -p uturn-stunnerd -p uturn-perf
perf/pion/build.sh "$PWD/target/release/pionturn"

free_port() {
  python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

server_pid=""
stop_server() {
  if [ -n "$server_pid" ]; then
    # SIGKILL: on SIGTERM stunnerd (like stunnerd) drains until its allocations expire.
    kill -9 "$server_pid" 2>/dev/null || true
    wait "$server_pid" 2>/dev/null || true
    server_pid=""
  fi
}
trap stop_server EXIT

# start_server NAME THREADS PORT: starts it in the background, sets server_pid (and
# plain_relay for udprelay).
start_server() {
  local name=$1 threads=$2 port=$3
  case $name in
    uturn)
      cat > "$OUT/uturn.yaml" <<EOF
version: v1
admin: {name: perf/uturn, loglevel: "all:WARN", healthcheck_endpoint: ""}
auth: {type: static, realm: perf, credentials: {username: user1, password: pass1}}
listeners: [{name: udp, address: 127.0.0.1, port: $port, routes: [peers]}]
clusters: [{name: peers, endpoints: [127.0.0.1]}]
EOF
      UTURN_SHARDS=$threads target/release/stunnerd -u "$threads" -c "file://$PWD/$OUT/uturn.yaml" \
        > "$OUT/server.log" 2>&1 &
      ;;
    coturn)
      turnserver -n --listening-ip=127.0.0.1 --listening-port="$port" --relay-ip=127.0.0.1 \
        --user=user1:pass1 --realm=perf --lt-cred-mech --no-tls --no-dtls --no-cli \
        --allow-loopback-peers --relay-threads="$threads" --log-file=stdout --simple-log \
        --no-stdout-log > "$OUT/server.log" 2>&1 &
      ;;
    pion)
      GOMAXPROCS=$threads target/release/pionturn -listen "127.0.0.1:$port" -threads "$threads" \
        -realm perf > "$OUT/server.log" 2>&1 &
      ;;
    plain)
      target/release/udprelay "127.0.0.1:$port" > "$OUT/server.log" 2>&1 &
      ;;
  esac
  server_pid=$!
  sleep 0.7
  if [ "$name" = plain ]; then
    plain_relay=$(awk '/relay/ {print $5}' "$OUT/server.log")
  fi
}

run=0
total=$(( REPS * $(wc -w <<<"$THREADS") * $(wc -w <<<"$SIZES") * $(wc -w <<<"$ALLOCS") * $(wc -w <<<"$SERVERS") ))
for rep in $(seq 1 "$REPS"); do
  for threads in $THREADS; do
    for size in $SIZES; do
      for allocs in $ALLOCS; do
        for name in $SERVERS; do
          run=$((run + 1))
          port=$(free_port)
          start_server "$name" "$threads" "$port"
          mode=(--mode channel)
          [ "$name" = plain ] && mode=(--mode plain --plain-relay "$plain_relay")
          [ "$FIND_MAX" = 1 ] && mode+=(--find-max --max-loss "$MAX_LOSS")
          echo "[$run/$total] $name threads=$threads size=$size allocations=$allocs rep=$rep" >&2
          if report=$(target/release/turnperf "127.0.0.1:$port" -n "$allocs" -s "$size" -r "$RATE" \
              -d "$DURATION" --server-pid "$server_pid" "${mode[@]}" --json -q); then
            echo "{\"server\":\"$name\",\"threads\":$threads,\"rep\":$rep,\"result\":$report}" >> "$results"
          else
            echo "  run failed; see $OUT/server.log" >&2
          fi
          stop_server
        done
      done
    done
  done
done

python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
cells = {}
for r in rows:
    res = r["result"]
    key = (r["threads"], res["size"], res["allocations"])
    up = res["report"]["up"]
    cells.setdefault(key, {}).setdefault(r["server"], []).append(
        (up["pps"], up["loss_pct"], up["p99_us"], res["report"].get("server_cpu_us_per_packet")))
def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
print("| threads | payload | allocations | server | delivered pkt/s | loss % | p99 µs | server CPU µs/pkt | runs |")
print("|---|---|---|---|---|---|---|---|---|")
ratios = []
for key in sorted(cells):
    servers = cells[key]
    m = {s: [med([v[i] for v in runs]) for i in range(4)] + [len(runs)] for s, runs in servers.items()}
    for s in ["uturn", "coturn", "pion", "plain"]:
        if s in m:
            pps, loss, p99, cpu, n = m[s]
            cpu_s = f"{cpu:.2f}" if cpu is not None else "-"
            print(f"| {key[0]} | {key[1]} B | {key[2]} | {s} | {pps:,.0f} | {loss:.1f} | {p99:,.0f} | {cpu_s} | {n} |")
    u = m.get("uturn", [None])[0]
    def ratio(s):
        o = m.get(s, [None])[0]
        return f"{u / o:.2f}" if u and o else "-"
    ratios.append(f"| {key[0]} | {key[1]} B | {key[2]} | {ratio('coturn')} | {ratio('pion')} | {ratio('plain')} |")
print()
print("| threads | payload | allocations | uturn/coturn | uturn/pion | uturn/plain |")
print("|---|---|---|---|---|---|")
print("\n".join(ratios))
PY

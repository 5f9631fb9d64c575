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
# THREADS ("1 2"), SERVERS ("uturn uturn-epoll coturn pion plain": uturn is the io_uring
# engine), RATE per allocation (0 = as fast as possible), FIND_MAX=1 (search each cell's
# highest rate with loss under MAX_LOSS percent, 1; slower), PIN (1: in 1-thread cells the
# server runs on CPU 1 and turnperf on CPU 0, so they do not take turns on one core),
# LATENCY=1 (after the matrix: per cell, find coturn's highest rate, then run every server at
# half of it and compare p99), GSO=1 (turnperf sends its client batches as UDP GSO, so it can
# outrun a fast server; every server still receives separate datagrams), BURST (1: paced runs
# send this many datagrams per allocation back to back when due, as a video frame leaves a
# media server), TRANSPORT (udp or tcp: the clients' transport; tcp leaves out plain, which is
# UDP only), SOURCES (1: UDP clients allocate from 127.0.0.1 to 127.0.0.SOURCES in turn, so
# that thousands of allocations are not paced by a server's per-source challenge limit), OUT
# (target/compare). Every loop is bounded by these counts;
# every server is started and stopped by this script, by PID.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
DURATION=${DURATION:-3}
SIZES=${SIZES:-"100 1200"}
ALLOCS=${ALLOCS:-"64 1000"}
THREADS=${THREADS:-"1 2"}
SERVERS_SET=${SERVERS:-}
SERVERS=${SERVERS:-"uturn uturn-epoll coturn pion plain"}
RATE=${RATE:-0}
FIND_MAX=${FIND_MAX:-0}
MAX_LOSS=${MAX_LOSS:-1}
PIN=${PIN:-1}
GSO=${GSO:-0}
LATENCY=${LATENCY:-0}
BURST=${BURST:-1}
TRANSPORT=${TRANSPORT:-udp}
SOURCES=${SOURCES:-1}
if [ "$TRANSPORT" = tcp ] && [ -z "${SERVERS_SET:-}" ]; then
  SERVERS=${SERVERS//plain/}
fi
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

# pin THREADS: the taskset prefixes for the server and for turnperf in this cell.
pin() {
  server_cpu=() client_cpu=()
  if [ "$PIN" = 1 ] && [ "$1" = 1 ] && [ "$(nproc)" -ge 2 ]; then
    server_cpu=(taskset -c 1) client_cpu=(taskset -c 0)
  fi
}

# start_server NAME THREADS PORT: starts it in the background, sets server_pid (and
# plain_relay for udprelay).
start_server() {
  local name=$1 threads=$2 port=$3
  pin "$threads"
  case $name in
    uturn|uturn-epoll)
      engine=uring
      [ "$name" = uturn-epoll ] && engine=epoll
      cat > "$OUT/uturn.yaml" <<EOF
version: v1
admin: {name: perf/uturn, loglevel: "all:WARN", healthcheck_endpoint: ""}
auth: {type: static, realm: perf, credentials: {username: user1, password: pass1}}
listeners: [{name: $TRANSPORT, protocol: TURN-${TRANSPORT^^}, address: 127.0.0.1, port: $port, routes: [peers]}]
clusters: [{name: peers, endpoints: [127.0.0.1]}]
EOF
      UTURN_SHARDS=$threads "${server_cpu[@]}" target/release/stunnerd -u "$threads" \
        --io-engine "$engine" -c "file://$PWD/$OUT/uturn.yaml" > "$OUT/server.log" 2>&1 &
      ;;
    coturn)
      "${server_cpu[@]}" turnserver -n --listening-ip=127.0.0.1 --listening-port="$port" --relay-ip=127.0.0.1 \
        --user=user1:pass1 --realm=perf --lt-cred-mech --no-tls --no-dtls --no-cli \
        --allow-loopback-peers --relay-threads="$threads" --log-file=stdout --simple-log \
        --no-stdout-log > "$OUT/server.log" 2>&1 &
      ;;
    pion)
      GOMAXPROCS=$threads "${server_cpu[@]}" target/release/pionturn -listen "127.0.0.1:$port" -threads "$threads" \
        -realm perf > "$OUT/server.log" 2>&1 &
      ;;
    plain)
      "${server_cpu[@]}" target/release/udprelay "127.0.0.1:$port" > "$OUT/server.log" 2>&1 &
      ;;
  esac
  server_pid=$!
  sleep 0.7
  if [ "$name" = plain ]; then
    plain_relay=$(awk '/relay/ {print $5}' "$OUT/server.log")
  fi
}

# measure NAME THREADS SIZE ALLOCS RATE FILE JSON [turnperf options]: one turnperf run against
# a fresh server; appends {"server", "threads" JSON, "result"} to FILE.
measure() {
  local name=$1 threads=$2 size=$3 allocs=$4 rate=$5 file=$6 extra=$7
  shift 7
  local port report
  port=$(free_port)
  start_server "$name" "$threads" "$port"
  local mode=(--mode channel)
  [ "$name" = plain ] && mode=(--mode plain --plain-relay "$plain_relay")
  if report=$("${client_cpu[@]}" target/release/turnperf "127.0.0.1:$port" -n "$allocs" -s "$size" \
      -r "$rate" -d "$DURATION" --server-pid "$server_pid" "${mode[@]}" "$@" --json -q); then
    echo "{\"server\":\"$name\",\"threads\":$threads$extra,\"result\":$report}" >> "$file"
  else
    echo "  run failed; see $OUT/server.log" >&2
  fi
  stop_server
}

opts=(--transport "$TRANSPORT" --burst "$BURST")
[ "$SOURCES" != 1 ] && opts+=(--sources "$SOURCES")
[ "$GSO" = 1 ] && opts+=(--gso)
find=("${opts[@]}")
[ "$FIND_MAX" = 1 ] && find+=(--find-max --max-loss "$MAX_LOSS")
run=0
total=$(( REPS * $(wc -w <<<"$THREADS") * $(wc -w <<<"$SIZES") * $(wc -w <<<"$ALLOCS") * $(wc -w <<<"$SERVERS") ))
for rep in $(seq 1 "$REPS"); do
  for threads in $THREADS; do
    for size in $SIZES; do
      for allocs in $ALLOCS; do
        for name in $SERVERS; do
          run=$((run + 1))
          echo "[$run/$total] $name threads=$threads size=$size allocations=$allocs rep=$rep" >&2
          measure "$name" "$threads" "$size" "$allocs" "$RATE" "$results" ",\"rep\":$rep" "${find[@]}"
        done
      done
    done
  done
done

if [ "$LATENCY" = 1 ]; then
  # Per cell: coturn's highest rate with loss under MAX_LOSS, then every server at half of it.
  latency="$OUT/latency.jsonl"
  : > "$latency"
  for threads in $THREADS; do
    for size in $SIZES; do
      for allocs in $ALLOCS; do
        port=$(free_port)
        start_server coturn "$threads" "$port"
        echo "[latency] coturn's highest rate: threads=$threads size=$size allocations=$allocs" >&2
        max=$("${client_cpu[@]}" target/release/turnperf "127.0.0.1:$port" -n "$allocs" -s "$size" \
          -d "$DURATION" --find-max --max-loss "$MAX_LOSS" "${opts[@]}" --json -q \
          | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["report"]["up"]["pps"]))')
        stop_server
        per_alloc=$(( max / 2 / allocs ))
        [ "$per_alloc" -lt 1 ] && per_alloc=1
        for rep in $(seq 1 "$REPS"); do
          for name in $SERVERS; do
            echo "[latency] $name at $((per_alloc * allocs)) pkt/s (coturn max $max) rep=$rep" >&2
            measure "$name" "$threads" "$size" "$allocs" "$per_alloc" "$latency" \
              ",\"rep\":$rep,\"coturn_max\":$max" "${opts[@]}"
          done
        done
      done
    done
  done
fi

python3 - "$results" "${latency:-}" <<'PY'
import json, os, statistics, sys
SERVERS = ["uturn", "uturn-epoll", "coturn", "pion", "plain"]
def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
def fmt(v, spec):
    return format(v, spec) if v is not None else "-"
def cells_of(path):
    rows = [json.loads(l) for l in open(path) if l.strip()]
    cells = {}
    for r in rows:
        res = r["result"]
        key = (r["threads"], res["size"], res["allocations"])
        up = res["report"]["up"]
        cells.setdefault(key, {}).setdefault(r["server"], []).append({
            "pps": up["pps"], "loss": up["loss_pct"], "p99": up["p99_us"],
            "cpu": res["report"].get("server_cpu_us_per_packet"),
            "setup": res.get("setup_rate"),
            "rss": res.get("server_rss_bytes_per_allocation"),
            "coturn_max": r.get("coturn_max"),
            "offered": res["report"].get("offered_pps"),
        })
    return cells
def medians(runs):
    return {k: med([r[k] for r in runs]) for k in runs[0]} | {"n": len(runs)}

cells = cells_of(sys.argv[1])
print("| threads | payload | allocations | server | delivered pkt/s | loss % | p99 µs | server CPU µs/pkt | setups/s | RSS B/allocation | runs |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
ratios = []
for key in sorted(cells):
    m = {s: medians(runs) for s, runs in cells[key].items()}
    for s in SERVERS:
        if s in m:
            v = m[s]
            print(f"| {key[0]} | {key[1]} B | {key[2]} | {s} | {fmt(v['pps'], ',.0f')} | {fmt(v['loss'], '.1f')} | "
                  f"{fmt(v['p99'], ',.0f')} | {fmt(v['cpu'], '.2f')} | {fmt(v['setup'], ',.0f')} | {fmt(v['rss'], ',.0f')} | {v['n']} |")
    def ratio(a, b, k="pps"):
        x, y = m.get(a, {}).get(k), m.get(b, {}).get(k)
        return f"{x / y:.2f}" if x and y else "-"
    for u in ["uturn", "uturn-epoll"]:
        if u in m:
            ratios.append(f"| {key[0]} | {key[1]} B | {key[2]} | {u} | {ratio(u, 'coturn')} | {ratio(u, 'pion')} | "
                          f"{ratio(u, 'plain')} | {ratio(u, 'plain', 'cpu')} | {ratio(u, 'coturn', 'setup')} | {ratio(u, 'coturn', 'rss')} |")
print()
print("| threads | payload | allocations | engine | pkt/s vs coturn | pkt/s vs pion | pkt/s vs plain | CPU/pkt vs plain | setups/s vs coturn | RSS/allocation vs coturn |")
print("|---|---|---|---|---|---|---|---|---|---|")
print("\n".join(ratios))

if len(sys.argv) > 2 and sys.argv[2] and os.path.exists(sys.argv[2]):
    cells = cells_of(sys.argv[2])
    print()
    print("p99 one-way latency at half of coturn's highest rate (loss-bounded):")
    print()
    print("| threads | payload | allocations | coturn max pkt/s | offered pkt/s | server | delivered pkt/s | loss % | p99 µs | p99 vs coturn |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for key in sorted(cells):
        m = {s: medians(runs) for s, runs in cells[key].items()}
        base = m.get("coturn", {}).get("p99")
        for s in SERVERS:
            if s in m:
                v = m[s]
                rel = f"{v['p99'] / base:.2f}" if base and v["p99"] else "-"
                print(f"| {key[0]} | {key[1]} B | {key[2]} | {fmt(v['coturn_max'], ',.0f')} | {fmt(v['offered'], ',.0f')} | {s} | {fmt(v['pps'], ',.0f')} | "
                      f"{fmt(v['loss'], '.2f')} | {fmt(v['p99'], ',.0f')} | {rel} |")
PY

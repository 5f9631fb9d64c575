#!/usr/bin/env bash
# perf/compare.sh: uturn, STUNner's own stunnerd, coturn, pion/turn and a plain batched UDP
# relay (the "no TURN" ceiling), one after another on this machine under the same turnperf load.
# Servers alternate run by run (A B C D A B C D ...), every cell is repeated REPS times, and one
# table of medians is printed with the ratios uturn/STUNner, uturn/coturn, uturn/pion and
# uturn/plain.
#
#   perf/compare.sh                      # the full matrix (about 10 minutes on 2 cores)
#   REPS=1 SIZES=100 ALLOCS=64 THREADS=1 DURATION=2 perf/compare.sh   # a quick look
#
# Environment: REPS (3), DURATION seconds per run (3), SIZES ("100 1200"), ALLOCS ("64 1000"),
# THREADS ("1 2"), SERVERS ("uturn uturn-epoll stunner stunner-mt coturn pion plain": uturn is
# the io_uring engine; uturn-offload, not in the default list, is it with --offload tc: see
# below; stunner and stunner-mt are STUNner's stunnerd, see below), RATE per
# allocation (0 = as fast as possible), FIND_MAX=1 (search each cell's highest rate with loss
# under MAX_LOSS percent, 1; slower), PIN (1: in 1-thread cells the server runs on CPU 1 and
# turnperf on CPU 0, so they do not take turns on one core),
# LATENCY=1 (after the matrix: per cell, find coturn's highest rate, then run every server at
# half of it and compare p99), GSO=1 (turnperf sends its client batches as UDP GSO, so it can
# outrun a fast server; every server still receives separate datagrams), BURST (1: paced runs
# send this many datagrams per allocation back to back when due, as a video frame leaves a
# media server), TRANSPORT (udp or tcp: the clients' transport; tcp leaves out plain, which is
# UDP only), SOURCES (1: UDP clients allocate from 127.0.0.1 to 127.0.0.SOURCES in turn, so
# that thousands of allocations are not paced by a server's per-source challenge limit),
# FRACTIONS (empty: the matrix above; else, e.g. "10 50 90", instead of it: per cell, find
# coturn's highest rate with loss under MAX_LOSS, then run every server at each of these
# percentages of it), RPS (1: in 1-thread cells, loopback's receive processing (the softirq in
# which the kernel offload relays) is steered to the server's CPU with RPS, so that the server's
# CPU carries the whole relay and turnperf's CPU only the load; the old mask is restored on
# exit), OUT (target/compare). Every loop is bounded by these counts;
# every server is started and stopped by this script, by PID.
#
# `uturn-offload` is uturn with the kernel offload (stunnerd --offload tc, attached to lo only):
# channel traffic is relayed by the TC program in the softirq of the sender's CPU, so the server
# process stays nearly idle and its cost shows in machine µs/pkt instead. Needs root (CAP_BPF,
# CAP_NET_ADMIN), Linux 6.6 and a build that found clang and libbpf-dev; the column "offloaded
# %" is the share of delivered packets the kernel relayed (stunnerd's
# uturn_offloaded_packets_total, scraped after the run; left out of FIND_MAX runs, whose counter
# spans the whole search); its server.log says why when 0.
#
# `uturn-base` is uturn (io_uring, as `uturn`) run from another build of stunnerd, UTURN_BASE_BIN
# (e.g. an older commit's, built in a worktree of its own): an A/B of two commits, alternated
# run by run like every server here.
#
# `stunner` is STUNner's own stunnerd (github.com/l7mp/stunner v1.2.1, cmd/stunnerd, the binary
# `bash .ci/go-components` builds into target/go/bin/stunnerd-stunner; STUNNER_BIN overrides)
# with its default flags (one UDP socket per listener, -u 0), on the same v1 config as uturn;
# `stunner-mt` is the same with --udp-thread-num equal to the CPU count (nproc: one
# SO_REUSEPORT socket and read loop per CPU, as the operator's -u 16 does on a 16-CPU node).
# Go schedules on the CPUs the server may use (GOMAXPROCS follows the 1-thread cells' taskset).
#
# `direct` is a pseudo-server for SERVERS: no server process, turnperf --mode direct sends the
# same traffic straight between its clients and its peer (UDP only). It is the baseline of the
# machine's CPU: a relay's machine cost is the machine's CPU with the relay minus the direct
# run's at the same rate. When SERVERS is not set it is appended to the default list if
# RATE > 0 or FRACTIONS is set (and TRANSPORT is udp).
#
# Columns: delivered pkt/s, loss %, p99 µs (one-way), server CPU µs/pkt (the server process's
# user + system time per relayed packet), wakeups/pkt (the server's context switches, all
# threads, per relayed packet), machine µs/pkt (the whole machine's busy CPU time per relayed
# packet: the run's wall time on every CPU less their idle time from /proc/stat, which a
# tickless kernel measures exactly, so the softirq work of an otherwise idle CPU counts too;
# load generator, server, kernel and whatever else runs; on a shared machine, noisy),
# softirq µs/pkt (its softirq part as sampled at ticks: a lower bound), busy CPUs (machine CPUs busy on
# average), relay machine µs/pkt (machine µs/pkt minus the direct run's in the same cell and
# fraction), and ratios against coturn. Results: OUT/results.jsonl (matrix),
# OUT/fractions.jsonl (FRACTIONS: rows carry "fraction" and "coturn_max"), OUT/latency.jsonl.
set -euo pipefail
cd "$(dirname "$0")/.."
REPS=${REPS:-3}
DURATION=${DURATION:-3}
SIZES=${SIZES:-"100 1200"}
ALLOCS=${ALLOCS:-"64 1000"}
THREADS=${THREADS:-"1 2"}
SERVERS_SET=${SERVERS:-}
SERVERS=${SERVERS:-"uturn uturn-epoll stunner stunner-mt coturn pion plain"}
RATE=${RATE:-0}
FIND_MAX=${FIND_MAX:-0}
MAX_LOSS=${MAX_LOSS:-1}
PIN=${PIN:-1}
GSO=${GSO:-0}
RPS=${RPS:-0}
LATENCY=${LATENCY:-0}
BURST=${BURST:-1}
TRANSPORT=${TRANSPORT:-udp}
SOURCES=${SOURCES:-1}
FRACTIONS=${FRACTIONS:-}
if [ "$TRANSPORT" = tcp ] && [ -z "${SERVERS_SET:-}" ]; then
  SERVERS=${SERVERS//plain/}
fi
if [ "$TRANSPORT" = udp ] && [ -z "${SERVERS_SET:-}" ] && { [ "$RATE" != 0 ] || [ -n "$FRACTIONS" ]; }; then
  SERVERS="$SERVERS direct"
fi
OUT=${OUT:-target/compare}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # absolute: the servers' config paths are built from it
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
STUNNER_BIN=${STUNNER_BIN:-$PWD/target/go/bin/stunnerd-stunner}
if [[ " $SERVERS " == *" uturn-base "* ]] && [ ! -x "${UTURN_BASE_BIN:-}" ]; then
  echo "compare.sh: uturn-base needs UTURN_BASE_BIN, another build's stunnerd" >&2; exit 1
fi
if [[ " $SERVERS " == *" stunner"* ]] && [ ! -x "$STUNNER_BIN" ]; then
  bash .ci/go-components
  [ -x "$STUNNER_BIN" ] || { echo "compare.sh: no STUNner stunnerd at $STUNNER_BIN" >&2; exit 1; }
fi

# free_port [tcp]: a free UDP (or TCP) port on 127.0.0.1.
free_port() {
  python3 -c 'import socket, sys; s=socket.socket(socket.AF_INET, socket.SOCK_STREAM if sys.argv[1:] == ["tcp"] else socket.SOCK_DGRAM); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])' "$@"
}

# offloaded: the packets uturn-offload's kernel program relayed (both directions), from its
# metrics endpoint; the shards publish the counters once a second.
offloaded() {
  sleep 1.5
  python3 - "$metrics_port" <<'PY' || echo null
import sys, urllib.request
text = urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/metrics", timeout=2).read().decode()
print(int(sum(float(l.split()[-1]) for l in text.splitlines()
              if l.startswith("uturn_offloaded_packets_total{"))))
PY
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
rps_file=/sys/class/net/lo/queues/rx-0/rps_cpus
rps_saved=$(cat "$rps_file" 2>/dev/null || echo 0)
cleanup() {
  stop_server
  if [ "$RPS" = 1 ]; then echo "$rps_saved" > "$rps_file" 2>/dev/null || true; fi
}
trap cleanup EXIT

# pin THREADS: the taskset prefixes for the server and for turnperf in this cell.
pin() {
  server_cpu=() client_cpu=()
  if [ "$PIN" = 1 ] && [ "$1" = 1 ] && [ "$(nproc)" -ge 2 ]; then
    server_cpu=(taskset -c 1) client_cpu=(taskset -c 0)
    if [ "$RPS" = 1 ]; then echo 2 > "$rps_file"; fi
  elif [ "$RPS" = 1 ]; then
    echo "$rps_saved" > "$rps_file"
  fi
}

# start_server NAME THREADS PORT: starts it in the background, sets server_pid (and
# plain_relay for udprelay); `direct` starts nothing and leaves server_pid empty.
start_server() {
  local name=$1 threads=$2 port=$3
  pin "$threads"
  if [ "$name" = direct ]; then
    server_pid=""
    return
  fi
  case $name in
    uturn|uturn-epoll|uturn-offload|uturn-base)
      engine=uring offload=none metrics="" bin=target/release/stunnerd
      [ "$name" = uturn-base ] && bin=$UTURN_BASE_BIN
      [ "$name" = uturn-epoll ] && engine=epoll
      if [ "$name" = uturn-offload ]; then
        offload=tc metrics_port=$(free_port tcp)
        metrics=", metrics_endpoint: \"http://127.0.0.1:$metrics_port/metrics\", offload_interfaces: [lo]"
      fi
      cat > "$OUT/uturn.yaml" <<EOF
version: v1
admin: {name: perf/uturn, loglevel: "all:WARN", healthcheck_endpoint: ""$metrics}
auth: {type: static, realm: perf, credentials: {username: user1, password: pass1}}
listeners: [{name: $TRANSPORT, protocol: TURN-${TRANSPORT^^}, address: 127.0.0.1, port: $port, routes: [peers]}]
clusters: [{name: peers, endpoints: [127.0.0.1]}]
EOF
      UTURN_SHARDS=$threads "${server_cpu[@]}" "$bin" -u "$threads" \
        --io-engine "$engine" --offload "$offload" -c "file://$OUT/uturn.yaml" > "$OUT/server.log" 2>&1 &
      ;;
    stunner|stunner-mt)
      # The same document as uturn's (STUNner reads v1; 127.0.0.1 is the peer's endpoint).
      cat > "$OUT/stunner.yaml" <<EOF
version: v1
admin: {name: perf/stunner, loglevel: "all:WARN", healthcheck_endpoint: ""}
auth: {type: static, realm: perf, credentials: {username: user1, password: pass1}}
listeners: [{name: $TRANSPORT, protocol: TURN-${TRANSPORT^^}, address: 127.0.0.1, port: $port, routes: [peers]}]
clusters: [{name: peers, endpoints: [127.0.0.1]}]
EOF
      local udp_threads=0
      [ "$name" = stunner-mt ] && udp_threads=$(nproc)
      "${server_cpu[@]}" "$STUNNER_BIN" -u "$udp_threads" -c "file://$OUT/stunner.yaml" \
        > "$OUT/server.log" 2>&1 &
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
  [ "$name" = direct ] && mode=(--mode direct)
  [ -n "$server_pid" ] && mode+=(--server-pid "$server_pid")
  if report=$("${client_cpu[@]}" target/release/turnperf "127.0.0.1:$port" -n "$allocs" -s "$size" \
      -r "$rate" -d "$DURATION" "${mode[@]}" "$@" --json -q); then
    # Not for --find-max runs: the counter covers every step of the search, not the last one.
    if [ "$name" = uturn-offload ] && [[ " $* " != *" --find-max "* ]]; then
      extra="$extra,\"offloaded\":$(offloaded)"
    fi
    echo "{\"server\":\"$name\",\"threads\":$threads$extra,\"result\":$report}" >> "$file"
  else
    echo "  run failed; see $OUT/server.log" >&2
  fi
  stop_server
}

# coturn_max THREADS SIZE ALLOCS: sets max to coturn's highest delivered rate (pkt/s, all
# allocations) with loss under MAX_LOSS in this cell, by turnperf --find-max. (In this shell,
# not a subshell, so that the EXIT trap stops coturn if the search fails.)
coturn_max() {
  local threads=$1 size=$2 allocs=$3 port
  port=$(free_port)
  start_server coturn "$threads" "$port"
  echo "[max] coturn's highest rate: threads=$threads size=$size allocations=$allocs" >&2
  max=$("${client_cpu[@]}" target/release/turnperf "127.0.0.1:$port" -n "$allocs" -s "$size" \
    -d "$DURATION" --find-max --max-loss "$MAX_LOSS" "${opts[@]}" --json -q \
    | python3 -c 'import json,sys; print(int(json.load(sys.stdin)["report"]["up"]["pps"]))')
  stop_server
}

opts=(--transport "$TRANSPORT" --burst "$BURST")
[ "$SOURCES" != 1 ] && opts+=(--sources "$SOURCES")
[ "$GSO" = 1 ] && opts+=(--gso)
find=("${opts[@]}")
[ "$FIND_MAX" = 1 ] && find+=(--find-max --max-loss "$MAX_LOSS")
cells=$(( $(wc -w <<<"$THREADS") * $(wc -w <<<"$SIZES") * $(wc -w <<<"$ALLOCS") ))
# The matrix, unless FRACTIONS runs instead of it.
matrix_reps=$REPS
[ -n "$FRACTIONS" ] && matrix_reps=0
run=0
total=$(( matrix_reps * cells * $(wc -w <<<"$SERVERS") ))
for rep in $(seq 1 "$matrix_reps"); do
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

if [ -n "$FRACTIONS" ]; then
  # Per cell: coturn's highest rate with loss under MAX_LOSS, then every server at each
  # fraction of it (total over the allocations), interleaved.
  fractions="$OUT/fractions.jsonl"
  : > "$fractions"
  run=0
  total=$(( cells * $(wc -w <<<"$FRACTIONS") * REPS * $(wc -w <<<"$SERVERS") ))
  for threads in $THREADS; do
    for size in $SIZES; do
      for allocs in $ALLOCS; do
        coturn_max "$threads" "$size" "$allocs"
        for fraction in $FRACTIONS; do
          per_alloc=$(( max * fraction / 100 / allocs ))
          [ "$per_alloc" -lt 1 ] && per_alloc=1
          for rep in $(seq 1 "$REPS"); do
            for name in $SERVERS; do
              run=$((run + 1))
              echo "[$run/$total] $name at $fraction% of coturn's $max = $((per_alloc * allocs)) pkt/s threads=$threads size=$size allocations=$allocs rep=$rep" >&2
              measure "$name" "$threads" "$size" "$allocs" "$per_alloc" "$fractions" \
                ",\"rep\":$rep,\"coturn_max\":$max,\"fraction\":$fraction" "${opts[@]}"
            done
          done
        done
      done
    done
  done
fi

if [ "$LATENCY" = 1 ]; then
  # Per cell: coturn's highest rate with loss under MAX_LOSS, then every server at half of it.
  latency="$OUT/latency.jsonl"
  : > "$latency"
  for threads in $THREADS; do
    for size in $SIZES; do
      for allocs in $ALLOCS; do
        coturn_max "$threads" "$size" "$allocs"
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

python3 - "$results" "${latency:-}" "${fractions:-}" <<'PY'
import json, os, statistics, sys
SERVERS = ["uturn", "uturn-base", "uturn-epoll", "uturn-offload", "stunner", "stunner-mt", "coturn", "pion", "plain", "direct"]
def med(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None
def fmt(v, spec):
    return format(v, spec) if v is not None else "-"
def cells_of(path):
    """{(threads, size, allocations, fraction): {server: [run]}} of a JSONL file."""
    if not path or not os.path.exists(path):
        return {}
    rows = [json.loads(l) for l in open(path) if l.strip()]
    cells = {}
    for r in rows:
        res = r["result"]
        rep = res["report"]
        key = (r["threads"], res["size"], res["allocations"], r.get("fraction", 0))
        up = rep["up"]
        cells.setdefault(key, {}).setdefault(r["server"], []).append({
            "pps": up["pps"], "loss": up["loss_pct"], "p99": up["p99_us"],
            "cpu": rep.get("server_cpu_us_per_packet"),
            "wakeups": rep.get("server_wakeups_per_packet"),
            "machine": rep.get("machine_us_per_packet"),
            "softirq": rep.get("machine_softirq_us_per_packet"),
            "busy": rep.get("machine_busy_cpus"),
            "setup": res.get("setup_rate") if r["server"] != "direct" else None,
            "rss": res.get("server_rss_bytes_per_allocation"),
            "coturn_max": r.get("coturn_max"),
            "offered": rep.get("offered_pps"),
            # uturn-offload: the share of the delivered packets that its kernel program relayed.
            "offloaded": 100 * r["offloaded"] / max(1, up["delivered"] + (rep.get("down") or {}).get("delivered", 0))
            if r.get("offloaded") is not None else None,
        })
    return cells
def medians(runs):
    return {k: med([r[k] for r in runs]) for k in runs[0]} | {"n": len(runs)}
def cell_medians(runs_by_server):
    """Medians per server, each with "relay": its machine µs/pkt minus direct's."""
    m = {s: medians(runs) for s, runs in runs_by_server.items()}
    base = m.get("direct", {}).get("machine")
    for s, v in m.items():
        known = v["machine"] is not None and base is not None and s != "direct"
        v["relay"] = v["machine"] - base if known else None
    return m
def ratio(m, a, b, k):
    x, y = m.get(a, {}).get(k), m.get(b, {}).get(k)
    return f"{x / y:.2f}" if x is not None and y and y > 0 else "-"
# Columns: (header, text of (cell key, server, its medians, the cell's medians)).
def col(header, k, spec):
    return (header, lambda key, s, v, m: fmt(v[k], spec))
def vs(header, base, k):
    return (header, lambda key, s, v, m: ratio(m, s, base, k))
CELL = [("threads", lambda key, *_: str(key[0])), ("payload", lambda key, *_: f"{key[1]} B"),
        ("allocations", lambda key, *_: str(key[2]))]
SERVER = ("server", lambda key, s, *_: s)
RUNS = col("runs", "n", "d")
def offloaded(cells):
    """The "offloaded %" column, where a run has it (uturn-offload)."""
    runs = [r for by_server in cells.values() for rs in by_server.values() for r in rs]
    return [col("offloaded %", "offloaded", ".1f")] if any(r["offloaded"] is not None for r in runs) else []
def table(cells, columns, servers=SERVERS):
    """One row per cell and server (of `servers`) run in it."""
    print("| " + " | ".join(h for h, _ in columns) + " |")
    print("|" + "---|" * len(columns))
    for key in sorted(cells):
        m = cell_medians(cells[key])
        for s in servers:
            if s in m:
                print("| " + " | ".join(f(key, s, m[s], m) for _, f in columns) + " |")

cells = cells_of(sys.argv[1])
if cells:
    table(cells, CELL + [
        SERVER, col("delivered pkt/s", "pps", ",.0f"), col("loss %", "loss", ".1f"), col("p99 µs", "p99", ",.0f"),
        col("server CPU µs/pkt", "cpu", ".2f"), col("wakeups/pkt", "wakeups", ".3f"),
        col("machine µs/pkt", "machine", ".2f"), col("relay machine µs/pkt", "relay", ".2f"),
        col("setups/s", "setup", ",.0f"), col("RSS B/allocation", "rss", ",.0f")] + offloaded(cells) + [RUNS])
    print()
    table(cells, CELL + [
        ("engine", SERVER[1]), vs("pkt/s vs STUNner", "stunner", "pps"),
        vs("pkt/s vs STUNner -u nproc", "stunner-mt", "pps"), vs("CPU/pkt vs STUNner", "stunner", "cpu"),
        vs("pkt/s vs coturn", "coturn", "pps"), vs("pkt/s vs pion", "pion", "pps"),
        vs("pkt/s vs plain", "plain", "pps"), vs("CPU/pkt vs plain", "plain", "cpu"),
        vs("setups/s vs coturn", "coturn", "setup"), vs("RSS/allocation vs coturn", "coturn", "rss")],
        servers=["uturn", "uturn-epoll", "uturn-offload"])

cells = cells_of(sys.argv[3] if len(sys.argv) > 3 else "")
if cells:
    print()
    print("Cost per packet at fixed rates, fractions of coturn's highest rate (loss-bounded); "
          "relay machine µs/pkt = machine µs/pkt minus direct's (no relay) at the same rate:")
    print()
    table(cells, CELL + [
        col("coturn max pkt/s", "coturn_max", ",.0f"), ("fraction %", lambda key, *_: str(key[3])), SERVER,
        col("offered pkt/s", "offered", ",.0f"), col("delivered pkt/s", "pps", ",.0f"), col("loss %", "loss", ".2f"),
        col("server CPU µs/pkt", "cpu", ".2f"), col("wakeups/pkt", "wakeups", ".3f"),
        col("machine µs/pkt", "machine", ".2f"), col("softirq µs/pkt", "softirq", ".2f"),
        col("busy CPUs", "busy", ".2f"), col("relay machine µs/pkt", "relay", ".2f"),
        vs("server CPU vs STUNner", "stunner", "cpu"), vs("server CPU vs coturn", "coturn", "cpu"),
        vs("relay machine vs coturn", "coturn", "relay")]
        + offloaded(cells) + [RUNS])

cells = cells_of(sys.argv[2])
if cells:
    print()
    print("p99 one-way latency at half of coturn's highest rate (loss-bounded):")
    print()
    table(cells, CELL + [
        col("coturn max pkt/s", "coturn_max", ",.0f"), col("offered pkt/s", "offered", ",.0f"), SERVER,
        col("delivered pkt/s", "pps", ",.0f"), col("loss %", "loss", ".2f"), col("p99 µs", "p99", ",.0f"),
        vs("p99 vs STUNner", "stunner", "p99"), vs("p99 vs coturn", "coturn", "p99")])
PY

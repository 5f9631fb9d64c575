#!/usr/bin/env bash
# Builds uturn's fuzz targets with libFuzzer coverage instrumentation on the stable toolchain
# and runs each for SECONDS, one after the other.
#
#   dataplane/fuzz/run.sh SECONDS [TARGET...]     (default: all targets)
#   dataplane/fuzz/run.sh 0 [TARGET...]           build, then run every seed once (-runs=0)
#
# Works from any directory. Build output, a scratch working corpus, logs and crash artifacts go
# under <repo>/target/fuzz; the committed seeds in dataplane/fuzz/corpus/<target>/ are only read.
# Exits non-zero if a target finds a crash, a timeout or an out-of-memory input (or fails to
# build). Extra libFuzzer flags can be passed in FUZZ_ARGS; VERBOSE=1 shows libFuzzer's output.
set -euo pipefail

ALL_TARGETS=(engine_unauth engine_session framer config peer_policy admin_http cds_message sibling)

usage() {
    echo "usage: $0 SECONDS [TARGET...]   targets: ${ALL_TARGETS[*]}" >&2
    exit 2
}

[[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] || usage
SECONDS_PER_TARGET=$1
shift
TARGETS=("$@")
if [[ ${#TARGETS[@]} -eq 0 ]]; then
    TARGETS=("${ALL_TARGETS[@]}")
fi
for t in "${TARGETS[@]}"; do
    [[ " ${ALL_TARGETS[*]} " == *" $t "* ]] || { echo "unknown target: $t" >&2; usage; }
done

FUZZ_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO=$(cd "$FUZZ_DIR/../.." && pwd)
OUT=$REPO/target/fuzz
HOST=$(rustc -vV | sed -n 's/^host: //p')
BIN_DIR=$OUT/$HOST/release

# SanitizerCoverage as cargo-fuzz sets it up, on stable: inline 8-bit edge counters, the PC
# table and comparison tracing for libFuzzer; debug assertions and overflow checks on.
# `--target` keeps these flags off build scripts and proc macros.
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module \
-Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters \
-Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares \
-Cdebug-assertions -Coverflow-checks"
export CARGO_TARGET_DIR=$OUT

build_start=$(date +%s)
echo "== building ${ALL_TARGETS[*]} (release, $HOST) into $OUT"
(cd "$FUZZ_DIR" && cargo build --release --target "$HOST" --bins)
echo "== build took $(( $(date +%s) - build_start )) s"

mkdir -p "$OUT/logs"
failed=()
summary=()
for t in "${TARGETS[@]}"; do
    seeds=$FUZZ_DIR/corpus/$t
    work=$OUT/corpus/$t
    artifacts=$OUT/artifacts/$t
    log=$OUT/logs/$t.log
    mkdir -p "$work" "$artifacts" "$seeds"
    marker=$(mktemp)
    args=(-rss_limit_mb=2048 -timeout=10 "-artifact_prefix=$artifacts/" -print_final_stats=1)
    if [[ $SECONDS_PER_TARGET -eq 0 ]]; then
        args+=(-runs=0)
        limit=600
    else
        args+=("-max_total_time=$SECONDS_PER_TARGET")
        limit=$((SECONDS_PER_TARGET + 120))
    fi
    if [[ -f $FUZZ_DIR/dict/$t.dict ]]; then
        args+=("-dict=$FUZZ_DIR/dict/$t.dict")
    fi
    # shellcheck disable=SC2206 # FUZZ_ARGS is a list of flags.
    args+=(${FUZZ_ARGS:-})
    echo "== $t: ${SECONDS_PER_TARGET}s, seeds $seeds, working corpus $work, log $log"
    start=$(date +%s)
    # The first corpus directory receives new inputs; the seed directory is only read.
    set +e
    if [[ ${VERBOSE:-0} == 1 ]]; then
        timeout "$limit" "$BIN_DIR/$t" "${args[@]}" "$work" "$seeds" 2>&1 | tee "$log"
        rc=${PIPESTATUS[0]}
    else
        timeout "$limit" "$BIN_DIR/$t" "${args[@]}" "$work" "$seeds" >"$log" 2>&1
        rc=$?
    fi
    set -e
    took=$(( $(date +%s) - start ))
    new_artifacts=$(find "$artifacts" -type f -newer "$marker" | sort)
    rm -f "$marker"
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -1)
    rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log" | tail -1)
    cov=$(grep -E '^#[0-9]+.*cov: ' "$log" | tail -1 || true)
    line="$t: rc=$rc ${took}s execs=${execs:-?} exec/s=${rate:-?} | ${cov:-no coverage line}"
    summary+=("$line")
    echo "   $line"
    if [[ $rc -ne 0 || -n $new_artifacts ]]; then
        failed+=("$t")
        echo "!! $t found something (exit $rc); last lines of $log:"
        tail -n 40 "$log" | sed 's/^/   | /'
        for a in $new_artifacts; do
            echo "!! artifact: $a ($(stat -c %s "$a") bytes)"
        done
    fi
done

echo "== summary"
printf '   %s\n' "${summary[@]}"
if [[ ${#failed[@]} -gt 0 ]]; then
    echo "== FAILED: ${failed[*]}"
    exit 1
fi
echo "== all clean"

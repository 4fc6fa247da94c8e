#!/usr/bin/env bash
# The accelerator check for the lent GPU machine as it is: one NVIDIA H100 or H200, 16 cores, no network, python3
# with torch (CUDA), transformers, accelerate, peft and pytest preinstalled (no trl, no zlib-ng: both optional here).
#
#   scripts/device_check.sh [all|lane|bench] [--dry-run]
#
#   lane   the accelerator lane (tests/accel/test_lane.py, test_device_index.py) on `cuda`, each case against one
#          CPU process: 2 processes on the one GPU with their collectives over gloo (NCCL refuses two ranks on one
#          device; gloo's send/recv cannot move CUDA tensors, so pp and cp skip there, saying so), then world size 1
#          over NCCL. At most LANE_BUDGET_S (default 260 s; 240 under `all`); prints the lane's table.
#   bench  scripts/bench_single_gpu.py: a ~1B Llama training step (bf16, seq 2048), optimum_parallel at tp=1 against
#          plain transformers, eager and compiled: tokens/s, MFU, each variant's own peak memory. At most
#          BENCH_BUDGET_S (default 260 s; 190 under `all`); prints its table (under `all` with the lane's rows too).
#   all    (default) both, one after the other: under 8 minutes with the set-up.
#
# Every part prints its table even when a case fails or its budget runs out (the run is interrupted with SIGINT, and
# what ran is reported; the cut part is a failure). Nothing is fetched: the package is installed with
# `pip install --no-deps --no-build-isolation -e .` (or, where pip cannot, made importable from here with its entry
# points); wheels under .whl/ (git-ignored), if any, are installed from there first, without an index. Exit status 0
# when everything passed, 1 otherwise. Logs and JUnit files in $LOGS (default device-check-logs/).
#
# --dry-run (no GPU needed): the same steps on the simulated neuron device of tests/accel (simulated_neuron.py) and
# the benchmark on the CPU with a tiny model (BENCH_ARGS), with the same budgets; prints the time it took.
set -uo pipefail
cd "$(dirname "$0")/.."

part=all
dry=0
for arg in "$@"; do
    case "$arg" in
        all|lane|bench) part=$arg ;;
        --dry-run) dry=1 ;;
        *) echo "usage: $0 [all|lane|bench] [--dry-run]" >&2; exit 2 ;;
    esac
done
if [ "$dry" = 1 ]; then
    export OP_TEST_DEVICE=neuron BENCH_DEVICE=${BENCH_DEVICE:-cpu}
    BENCH_ARGS=${BENCH_ARGS:-"--hidden 128 --intermediate 256 --layers 2 --heads 4 --kv-heads 2 --vocab 512 --seq 64
        --batch 2 --steps 2 --warmup 1 --dtype float32"}
fi
DEVICE=${OP_TEST_DEVICE:-cuda}
BENCH_DEVICE=${BENCH_DEVICE:-$DEVICE}
BENCH_ARGS=${BENCH_ARGS:-}
LOGS=${LOGS:-device-check-logs}
WHEELS=.whl
PY=${PYTHON:-python3}
[ "$dry" = 1 ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
# a part may overrun its budget by the 15 s its interrupted python gets to print (timeout -k 15), and the set-up
# takes ~15 s: all = 15 + 240 + 190 + 2 x 15 < 480 s; one part alone: 15 + 260 + 15 < 300 s
if [ "$part" = all ]; then
    LANE_BUDGET_S=${LANE_BUDGET_S:-240} BENCH_BUDGET_S=${BENCH_BUDGET_S:-190}
else
    LANE_BUDGET_S=${LANE_BUDGET_S:-260} BENCH_BUDGET_S=${BENCH_BUDGET_S:-260}
fi
# a hung lane case is given up after 2 x this (tests/accel/_accel.py), not the 2 minutes of the default
export OP_TEST_PG_TIMEOUT_S=${OP_TEST_PG_TIMEOUT_S:-30}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
case "$PY" in */*) PATH="$(cd "$(dirname "$PY")" && pwd):$PATH" ;; esac  # the simulated device's hooks: its ninja
mkdir -p "$LOGS"
started=$(date +%s)
say() { echo "[device_check $(($(date +%s) - started))s] $*"; }
status=0

# ---- 1. this package in the image's python, nothing fetched ---------------------------------------------------
if [ "$DEVICE" = neuron ]; then  # the simulated device: any torch, the CPU's
    "$PY" -c "import torch" || exit 1
elif ! "$PY" -c "import sys, torch; sys.exit(not torch.${DEVICE}.is_available())" 2>/dev/null; then
    say "torch in $PY does not see a $DEVICE device: $("$PY" -c "import torch; print(torch.__version__)" 2>&1)"
    exit 1
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then  # carried wheels (e.g. pytest-timeout), never an index
    "$PY" -m pip install --quiet --no-index --no-deps "$WHEELS"/*.whl >"$LOGS/wheels.log" 2>&1 \
        || say "wheels in $WHEELS/ not installed (see $LOGS/wheels.log); going on without them"
fi
installed() {
    "$PY" -c "import optimum_parallel, sys; sys.exit(not optimum_parallel.__file__.startswith('$PWD/'))" 2>/dev/null \
        && "$PY" -c "from importlib.metadata import entry_points as e; assert e(group='optimum_parallel.parallelizers')" \
            2>/dev/null
}
if ! installed; then
    { "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . \
        || "$PY" -m pip install --quiet --no-deps --no-build-isolation --break-system-packages -e .; } \
        >"$LOGS/pip.log" 2>&1
    if ! installed; then  # no setuptools, no pip: the entry points from pyproject.toml, next to the sources
        say "pip could not install the package (see $LOGS/pip.log): its entry points from pyproject.toml instead"
        "$PY" scripts/_dist_info.py "$LOGS/site" || exit 1
        export PYTHONPATH="$PYTHONPATH:$PWD/$LOGS/site"
    fi
fi
say "python $("$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__,
    "transformers", transformers.__version__)') | device $DEVICE | parts: $part | budgets: lane ${LANE_BUDGET_S}s," \
    "bench ${BENCH_BUDGET_S}s"
[ "$DEVICE" = cuda ] && nvidia-smi -L

# ---- 2. the accelerator lane on the device ---------------------------------------------------------------------
junit=()
cuts=()
lane() {  # label, backend override ("" for the device's own), seconds, pytest arguments...
    local label=$1 backend=$2 seconds=$3 name
    shift 3
    name="lane-${label//[^a-zA-Z0-9]/-}"
    if [ "$seconds" -lt 20 ]; then  # too little left to start python and torch: not run, and said so
        say "lane: $label not run: the lane's budget is spent"
        cuts+=(--cut "$label=not run: lane budget spent")
        junit+=(--junit "$label=$LOGS/$name.xml")
        rm -f "$LOGS/$name.xml"
        return
    fi
    say "lane: $label (at most ${seconds}s)"
    rm -f "$LOGS/$name.xml"
    OP_TEST_DEVICE=$DEVICE OP_TEST_BACKEND=$backend timeout -s INT -k 15 "$seconds" "$PY" -m pytest -q -rs \
        -p no:cacheprovider --junitxml "$LOGS/$name.xml" "$@" >"$LOGS/$name.log" 2>&1
    local code=$?
    tail -5 "$LOGS/$name.log"
    if [ "$code" = 124 ] || [ "$code" = 137 ]; then
        cuts+=(--cut "$label=stopped at its ${seconds}s budget")
    fi
    junit+=(--junit "$label=$LOGS/$name.xml")
}
run_lane() {
    local deadline=$(($(date +%s) + LANE_BUDGET_S)) first
    first=$((LANE_BUDGET_S * 2 / 3))
    if [ "$DEVICE" = cuda ]; then
        lane "2 ranks on 1 GPU, gloo" gloo "$first" tests/accel/test_lane.py -k "not world_size_one" \
            tests/accel/test_device_index.py
        lane "1 rank, nccl" "" $((deadline - $(date +%s))) tests/accel/test_lane.py -k "world_size_one or device_module"
    else
        lane "2 ranks, $DEVICE backend" "" "$first" tests/accel/test_lane.py -k "not world_size_one" \
            tests/accel/test_device_index.py
        lane "1 rank, $DEVICE backend" "" $((deadline - $(date +%s))) tests/accel/test_lane.py -k "world_size_one"
    fi
}
if [ "$part" != bench ]; then
    lane_started=$(date +%s)
    run_lane
    "$PY" scripts/bench_single_gpu.py --lane-only "${junit[@]}" "${cuts[@]}" | tee "$LOGS/lane-table.log"
    status=${PIPESTATUS[0]}
    say "lane took $(($(date +%s) - lane_started))s"
fi

# ---- 3. the single-GPU benchmark, and the one table ------------------------------------------------------------
if [ "$part" != lane ]; then
    bench_started=$(date +%s)
    say "benchmark on $BENCH_DEVICE (at most ${BENCH_BUDGET_S}s)"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
    timeout -s INT -k 15 "$BENCH_BUDGET_S" "$PY" scripts/bench_single_gpu.py --device "$BENCH_DEVICE" \
        --budget-s $((BENCH_BUDGET_S - 60)) "${junit[@]}" "${cuts[@]}" $BENCH_ARGS \
        2>"$LOGS/bench.err" | tee "$LOGS/bench.log"
    bench_status=${PIPESTATUS[0]}
    [ "$bench_status" = 0 ] || { tail -30 "$LOGS/bench.err"; status=1; }
    say "benchmark took $(($(date +%s) - bench_started))s"
fi
[ "$status" = 0 ] || status=1
say "done ($part$([ "$dry" = 1 ] && echo ", dry run on the simulated $DEVICE device")), exit status $status," \
    "wall time $(($(date +%s) - started))s"
exit "$status"

#!/usr/bin/env bash
# The accelerator check, one command on a machine with one CUDA GPU (under 8 minutes on an H100):
#
#   1. Python: $PYTHON (default python3) when its torch sees a GPU -- a GPU image's own; else a venv, .venv-gpu,
#      with torch from PyPI's default (CUDA) build ($TORCH_SPEC, default torch==2.13.0). This package is installed
#      into it (editable); its other dependencies from PyPI only where they are missing.
#   2. The accelerator lane (tests/accel/test_lane.py) on `cuda`, each case against one CPU process:
#      2 processes on the one GPU with their collectives over gloo (NCCL refuses two ranks on one device; gloo's
#      send/recv cannot move CUDA tensors, so pp and cp skip there, saying so), then world size 1 over NCCL.
#   3. scripts/bench_single_gpu.py: a ~1B Llama training step (bf16, seq 2048), optimum_parallel at tp=1 against
#      plain transformers, eager and compiled, with tokens/s and MFU; it prints the one table, with the lane's
#      results in it.
#
# Exit status 0 when everything passed, 1 on any failure or mismatch. Logs and JUnit files in $LOGS
# (default device-check-logs/). Without a GPU, OP_TEST_DEVICE=neuron runs the same steps on the simulated
# neuron device (tests/accel/simulated_neuron.py) and BENCH_ARGS passes a small model to the benchmark, on the CPU:
#   OP_TEST_DEVICE=neuron BENCH_DEVICE=cpu BENCH_ARGS="--hidden 128 --intermediate 256 --layers 2 --heads 4
#     --kv-heads 2 --vocab 512 --seq 64 --batch 2 --steps 2 --warmup 1 --dtype float32" scripts/device_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=${OP_TEST_DEVICE:-cuda}
BENCH_DEVICE=${BENCH_DEVICE:-$DEVICE}
BENCH_ARGS=${BENCH_ARGS:-}
LOGS=${LOGS:-device-check-logs}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
mkdir -p "$LOGS"
started=$(date +%s)
say() { echo "[device_check $(($(date +%s) - started))s] $*"; }

# ---- 1. Python with torch on the device, and this package ------------------------------------------------------
sees_device() { "$1" -c "import sys, torch; sys.exit(not torch.${DEVICE}.is_available())" 2>/dev/null; }
if [ "$DEVICE" = cuda ] && ! sees_device "$PY"; then
    say "$PY has no torch that sees a GPU: a venv with $TORCH_SPEC from PyPI (its default build is CUDA's)"
    [ -x .venv-gpu/bin/python ] || python3 -m venv .venv-gpu || exit 1
    PY=.venv-gpu/bin/python
    "$PY" -m pip install --quiet --upgrade pip && "$PY" -m pip install --quiet "$TORCH_SPEC" || exit 1
fi
if [ "$DEVICE" = neuron ]; then  # the simulated device: any torch, the CPU's
    "$PY" -c "import torch" || exit 1
elif ! sees_device "$PY"; then
    say "torch in $PY does not see a $DEVICE device"; exit 1
fi
if "$PY" -c "import transformers, accelerate, safetensors, tqdm, click, pytest" 2>/dev/null; then
    deps=(--no-deps --no-build-isolation)  # all there (a GPU image without network): no index asked
else
    deps=()
fi
if ! "$PY" -c "import optimum_parallel, sys; sys.exit(not optimum_parallel.__file__.startswith('$PWD/'))" 2>/dev/null \
    || ! "$PY" -c "from importlib.metadata import entry_points as e; assert e(group='optimum_parallel.parallelizers')" \
        2>/dev/null; then
    "$PY" -m pip install --quiet "${deps[@]}" -e ".[dev]" >"$LOGS/pip.log" 2>&1 \
        || "$PY" -m pip install --quiet "${deps[@]}" --break-system-packages -e ".[dev]" >>"$LOGS/pip.log" 2>&1 \
        || { cat "$LOGS/pip.log"; exit 1; }
fi
say "python $("$PY" -c 'import sys, torch, transformers; print(sys.version.split()[0], "torch", torch.__version__,
    "transformers", transformers.__version__)')"
[ "$DEVICE" = cuda ] && nvidia-smi -L

# ---- 2. the accelerator lane on the device ---------------------------------------------------------------------
lane() {  # label, backend override ("" for the device's own), pytest -k expression
    local file="$LOGS/lane-${1//[^a-zA-Z0-9]/-}.xml"
    say "lane: $1"
    OP_TEST_DEVICE=$DEVICE OP_TEST_BACKEND=$2 timeout 300 "$PY" -m pytest tests/accel/test_lane.py -q -rs -k "$3" \
        -p no:cacheprovider --junitxml "$file" 2>&1 | tee "$LOGS/lane-${1//[^a-zA-Z0-9]/-}.log" | tail -15
    junit+=(--junit "$1=$file")
}
junit=()
if [ "$DEVICE" = cuda ]; then
    lane "2 ranks on 1 GPU, gloo" gloo "not world_size_one"
    lane "1 rank, nccl" "" "world_size_one or device_module"
else
    lane "2 ranks, $DEVICE backend" "" "not world_size_one"
    lane "1 rank, $DEVICE backend" "" "world_size_one"
fi

# ---- 3. the single-GPU benchmark, and the one table ------------------------------------------------------------
say "benchmark on $BENCH_DEVICE"
# shellcheck disable=SC2086  # BENCH_ARGS is a list of arguments
timeout 420 "$PY" scripts/bench_single_gpu.py --device "$BENCH_DEVICE" "${junit[@]}" $BENCH_ARGS \
    2>"$LOGS/bench.err" | tee "$LOGS/bench.log"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || tail -30 "$LOGS/bench.err"
say "done, exit status $status"
exit "$status"

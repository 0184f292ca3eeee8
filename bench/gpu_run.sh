#!/usr/bin/env bash
# One GPU session's checks (issue 18), in stages that each have their own time limit, so one that hangs
# leaves the others their time. Run from the repository root on the GPU machine, with the wheels of
# docs/benchmarks.md ("Memory (CUDA): how to run it") in .whl/; results go to $OUT (default ./gpu-out).
#
#   bash bench/gpu_run.sh [stage ...]     stages: env bench-bf16 tests bench-fp32 bench-read bench-weights
#                                         (default: all, in that order)
#
# Limits per stage (seconds) come from the environment: BENCH_BF16_S, TESTS_S, BENCH_FP32_S, BENCH_READ_S,
# BENCH_WEIGHTS_S; BENCH_READ_ARGS adds options to bench/checkpoint_read_cuda.py;
# TESTS_PATHS narrows the tests (default tests/gpu).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
STAGES=${*:-env bench-bf16 tests bench-fp32 bench-read bench-weights}

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1

stop_engines() {  # an engine left by a stage killed at its limit would hold device memory for the next
    pkill -9 -f "node_engine" 2>/dev/null
    for _ in $(seq 50); do pgrep -f node_engine >/dev/null || break; sleep 0.2; done
}

stage() {  # stage NAME LIMIT_S COMMAND...
    local name=$1 limit=$2
    shift 2
    echo "=== $name (limit ${limit}s) $(date -u +%H:%M:%S)"
    local started=$SECONDS
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "=== $name rc=$rc in $((SECONDS - started))s"
    tail -n 60 "$OUT/$name.log"
    stop_engines
    find /tmp/pt -name '*.log' 2>/dev/null | tar czf "$OUT/engine-logs.tgz" -T - 2>/dev/null
    return $rc
}

for s in $STAGES; do
    case $s in
        env) stage env 60 bash -c 'nvidia-smi; python3 -c "import torch;
print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"; free -g; python3 bench/import_check.py' \
            || exit 1 ;;
        bench-bf16) stage bench-bf16 "${BENCH_BF16_S:-200}" python3 bench/memory_cycle.py --device cuda \
            --cuda-model 0.5b --cuda-dtype bfloat16 --json "$OUT/cuda-bf16.json" ;;
        tests) stage tests "${TESTS_S:-240}" python3 -m pytest -q -s -p no:cacheprovider --basetemp=/tmp/pt \
            -o timeout=280 ${TESTS_PATHS:-tests/gpu} ;;
        bench-fp32) stage bench-fp32 "${BENCH_FP32_S:-120}" python3 bench/memory_cycle.py --device cuda \
            --cuda-model tiny --cuda-dtype float32 --repeats 5 --json "$OUT/cuda-tiny.json" ;;
        bench-read) stage bench-read "${BENCH_READ_S:-120}" python3 bench/checkpoint_read_cuda.py \
            ${BENCH_READ_ARGS:-} --json "$OUT/read-cuda.json" ;;
        bench-weights) stage bench-weights "${BENCH_WEIGHTS_S:-240}" python3 bench/weight_sync_cuda.py \
            --json "$OUT/weights-cuda.json" ;;
        *) echo "unknown stage $s"; exit 2 ;;
    esac
done
exit 0

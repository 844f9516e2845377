#!/usr/bin/env bash
# The GPU checks of issue 32 in one command, within 3 minutes on an H100: the reference learner's step on
# the CUDA device (bf16 autocast over fp32 master weights, and fp32) against the same step on the CPU
# (bench/gpu_check.py), then the learner's `gpu` tests (tests/e2e/test_gpu_learner.py: micro-batches, LoRA)
# and, where its imports are there, the torch backend's (tests/e2e/test_gpu.py). One PASS, FAIL or SKIP
# line per check; the whole log goes to build/gpu_check.log.
#
#   bench/gpu_check.sh [PYTHON]
#
# PYTHON (default python3): one with torch for CUDA, transformers, peft, safetensors and pytest, as the device
# machine's own python3 has; the repository need not be installed. test_gpu.py also needs pydantic and
# nats-py (the inference package's imports): carried as wheels (see the device notes), or it is skipped.
# TURNSTILE_GPU_TEST_DEVICE=cpu runs every check on the CPU, to check the script where there is no GPU.
set -uo pipefail
python=${1:-python3}
cd "$(dirname "$0")/.."
mkdir -p build
log=build/gpu_check.log
: >"$log"
device=${TURNSTILE_GPU_TEST_DEVICE:-cuda}
export TURNSTILE_GPU_TEST_DEVICE=$device HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
check="import sys, torch; sys.exit(0 if '$device' == 'cpu' or torch.cuda.is_available() else 1)"
if ! "$python" -c "$check" >>"$log" 2>&1; then
    echo "FAIL setup: $python has no torch or sees no CUDA device (see $log)"
    exit 2
fi
failed=0

# The learner's step, CUDA against CPU: its own PASS/FAIL lines
timeout --kill-after=10 90 "$python" bench/gpu_check.py --device "$device" 2>>"$log" | tee -a "$log" | grep -E '^(PASS|FAIL|torch)'
status=${PIPESTATUS[0]}
if [ "$status" -ne 0 ]; then
    failed=1
    [ "$status" -eq 124 ] && echo "FAIL bench/gpu_check.py: past 90 s (see $log)"
fi

# A gpu-marked test file under pytest: one line with its counts
run_tests() {
    local file=$1 seconds=$2 out
    out=$(timeout --kill-after=10 "$seconds" "$python" -m pytest -q -m gpu --noconftest -p no:cacheprovider \
        "$file" 2>&1)
    local status=$?
    printf '%s\n' "$out" >>"$log"
    local counts
    counts=$(printf '%s\n' "$out" | grep -E '[0-9]+ (passed|failed|error|skipped)' | tail -1)
    if [ "$status" -eq 0 ] && ! printf '%s' "$counts" | grep -qE 'skipped|failed|error'; then
        echo "PASS $file: $counts"
    else
        echo "FAIL $file: ${counts:-status $status (124: past $seconds s)} (see $log)"
        failed=1
    fi
}

run_tests tests/e2e/test_gpu_learner.py 60
if "$python" -c 'import pipeline.inference.backends.torch_backend' >>"$log" 2>&1; then
    run_tests tests/e2e/test_gpu.py 60
else
    echo "SKIP tests/e2e/test_gpu.py: $python cannot import the torch backend (pydantic, nats-py: see $log)"
fi
[ "$failed" -eq 0 ] && echo "PASS gpu_check.sh" || echo "FAIL gpu_check.sh"
exit "$failed"

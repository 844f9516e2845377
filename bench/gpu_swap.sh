#!/usr/bin/env bash
# bench/version_swap.py for vLLM on a GPU, in one command: the in-flight policies restart and drain against the
# engine-restart baseline, at 8- and 32-token requests, on one engine (one start, then one restart per request
# size for the baseline), printing the table. Meant to finish within 150 s on an H100.
#
#   bench/gpu_swap.sh PYTHON
#
# PYTHON: a python whose environment has vLLM's CUDA build and this repository (`pip install vllm -e .`);
# the device machine has no wheels of its own. The whole log goes to build/gpu_swap.log.
set -euo pipefail
python=${1:?"usage: bench/gpu_swap.sh PYTHON (a python with vLLM for CUDA and this repository installed)"}
cd "$(dirname "$0")/.."
mkdir -p build
check='import importlib.util as u, sys, torch; sys.exit(0 if u.find_spec("vllm") and torch.cuda.is_available() else 1)'
"$python" -c "$check" || {
    echo "error: $python has no vLLM or sees no CUDA device; give the python of a venv that has vLLM for CUDA" >&2
    exit 2
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the repository, installed or not
set +e  # the bench's own status is the script's, not grep's
timeout --signal=INT --kill-after=10 150 "$python" bench/version_swap.py --backends vllm --max-tokens 8,32 \
    --in-flight restart,drain --swaps 2 --restarts 1 2>&1 | tee build/gpu_swap.log \
    | grep --line-buffered -E '^(SUMMARY|\||Traceback)|^[0-9:]{8} (Python|vllm: the backend counted)|Error:'
status=${PIPESTATUS[0]}
set -e
[ "$status" -eq 0 ] || echo "bench/version_swap.py ended with status $status (124: past 150 s): see build/gpu_swap.log" >&2
exit "$status"

#!/usr/bin/env bash
# One short check on a GPU machine (under 5 minutes): the device, a build of the CUDA kernels,
# the CUDA and op tests, and the kernel timings. Needs a CUDA build of torch in $PYTHON
# (default: .venv/bin/python when present, else python3) and nvcc (or QSYNC_CUDA_LIB).
#
#     bash benchmarks/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

echo "== nvidia-smi"
nvidia-smi
echo
echo "== torch"
"$PYTHON" - <<'EOF'
import sys, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available: {torch.cuda.is_available()}")
if not torch.cuda.is_available():
    sys.exit("torch has no CUDA device here: install a CUDA build of torch first")
print(f"device: {torch.cuda.get_device_name()} (sm_{''.join(map(str, torch.cuda.get_device_capability()))})")
EOF
echo
echo "== build"
if [[ -z "${QSYNC_CUDA_LIB:-}" ]]; then
    start=$(date +%s)
    QSYNC_CUDA_LIB=$(timeout 90 "$PYTHON" -m qsync_opt.cuda.build)
    echo "built in $(( $(date +%s) - start )) s"
fi
export QSYNC_CUDA_LIB
echo "QSYNC_CUDA_LIB=$QSYNC_CUDA_LIB"
echo
echo "== tests"
tests=(tests/test_cuda.py)
if [[ -f tests/test_ops.py ]]; then tests+=(tests/test_ops.py); fi
timeout 120 "$PYTHON" -m pytest -q "${tests[@]}"
echo
echo "== timings"
timeout 60 "$PYTHON" benchmarks/bench_cuda.py --sizes 2048 4096 --repeats 50

#!/usr/bin/env bash
# The checks that need a CUDA device, as one short script for a GPU machine (about 8 minutes
# on an H200). Run from anywhere; it works in the repository's root. Needs a CUDA build of
# torch in $PYTHON (default: .venv/bin/python when present, else python3) and nvcc.
#
#     OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# A machine with no package registry: this project and the packages it lacks there travel as
# wheels in .whl/ (docs/BENCHMARKS.md, "On a GPU", says how they are made); they are
# installed into a folder of their own and put on PYTHONPATH first.
#
# 1. the device, and a timed build of the CUDA kernels (sm_75..sm_90 + PTX);
# 2. the GPU tests: the CUDA kernels bit for bit against their references (tests/ops/test_cuda.py,
#    which also compiles them with nvcc for every architecture), the ops on CUDA
#    (tests/ops/test_ops.py), profiling on CUDA (tests/profile/test_profile.py), the fused arrays on
#    CUDA (tests/hfta/test_hfta_cuda.py);
# 3. compute-sanitizer's memcheck over the int8/int4 kernel tests, where it is installed;
# 4. the kernels' timings against the torch ops they replace (benchmarks/bench_cuda.py);
# 5. the fused arrays on the card (benchmarks/bench_hfta.py --device cuda).
# Each part has its own time limit (seconds: TEST_S, SAN_S, KERNEL_S, BENCH_S), so a hang in
# one leaves the others' output; what they print is also written under $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/qsync-gpu}
mkdir -p "$OUT"
if [[ -z "${PYTHON:-}" ]]; then
    if [[ -x .venv/bin/python ]]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/qsync-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/qsync-site
fi
export PYTHONUNBUFFERED=1
# -P: the working directory (the source tree, whose qsync_opt/ lacks the subpackages that
# live beside it) is not put on sys.path ahead of the installed package
PY=("$PYTHON" -P)
PYTEST=("${PY[@]}" -m pytest -q -p no:cacheprovider)

echo "== 1. the device and the build"
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    "${PY[@]}" -c "import sys, torch; print('python', sys.version.split()[0], 'torch', \
torch.__version__, 'CUDA', torch.version.cuda, torch.cuda.get_device_name(), \
torch.cuda.get_device_capability())" || exit 1
    nvcc --version | tail -1
    echo "cores $(nproc); $(uptime)"
    start=$(date +%s)
    QSYNC_CUDA_LIB=$(timeout 300 "${PY[@]}" -m qsync_opt.cuda.build) || exit 1
    echo "built $QSYNC_CUDA_LIB in $(( $(date +%s) - start )) s"
} 2>&1 | tee "$OUT/machine.txt"
lib=$(tail -1 "$OUT/machine.txt" | sed -n 's/^built \(.*\) in .*/\1/p')
if [[ -n "$lib" ]]; then export QSYNC_CUDA_LIB=$lib; fi

echo "== 2. GPU tests"
timeout "${TEST_S:-300}" "${PYTEST[@]}" tests/ops/test_cuda.py tests/ops/test_ops.py \
    tests/profile/test_profile.py tests/hfta/test_hfta_cuda.py 2>&1 | tee "$OUT/pytest.log" | tail -40
echo "pytest exit: ${PIPESTATUS[0]}"

echo "== 3. compute-sanitizer memcheck on the kernel tests"
if command -v compute-sanitizer >/dev/null; then
    timeout "${SAN_S:-150}" compute-sanitizer --tool memcheck --error-exitcode 9 \
        "${PYTEST[@]}" tests/ops/test_cuda.py -k "int4_pack_and_gemm or grid_stride or ties" \
        2>&1 | tee "$OUT/memcheck.log" | tail -15
    echo "memcheck exit: ${PIPESTATUS[0]}"
else
    echo "no compute-sanitizer here"
fi

echo "== 4. kernel timings"
timeout "${KERNEL_S:-60}" "${PY[@]}" benchmarks/bench_cuda.py --sizes 2048 4096 --repeats 50 \
    2>&1 | tee "$OUT/bench_cuda.log"

echo "== 5. fused arrays on the card"
timeout "${BENCH_S:-240}" "${PY[@]}" benchmarks/bench_hfta.py --device cuda \
    --models "${MODELS:-digits_cnn,resnet18_32}" --B "${BS:-1,4,16}" \
    --batches "${BATCHES:-16,256}" --reps "${REPS:-3}" --min-round-s 0.3 \
    --max-samples digits_cnn=4096,resnet18_32=4096 --dump "$OUT/hfta_gpu.jsonl" \
    2>&1 | tee "$OUT/hfta_gpu.log"
echo "bench exit: ${PIPESTATUS[0]}; $(uptime)"

#!/usr/bin/env bash
# Everything a GPU session does, in phases that each fit one 10-minute command:
#
#   bash benchmarks/gpu_session.sh check     # GPU paths against the reference (pytest)
#   bash benchmarks/gpu_session.sh bench-1   # full sweep, S 512..2048
#   bash benchmarks/gpu_session.sh bench-2   # full sweep, S 4096 and 8192
#   bash benchmarks/gpu_session.sh bench-3   # full sweep, S 16384 and the 64k check
#
# The bench phases append to one result (benchmarks/results/<gpu>/full.*); with $OUT set
# (the device tool's output folder) a copy of the results lands there too.  Assumes jax
# with CUDA, flax and torch are installed (as on this project's lent GPU machines).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import jax, torch; print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.cuda.get_device_name(0))"

phase=${1:-check}
case "$phase" in
  check)
    # The GPU table (both frameworks on the GPU against float64), then the whole suite
    # with JAX on the GPU (the module matrix's "auto" and "fused" cases take cuDNN there).
    export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
    # Correctness only: XLA's GEMM autotuning took 10-20 s per compile on an H100 (about
    # 2 s without it) and changes no result beyond rounding; the bench phases keep it.
    export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" OMP_NUM_THREADS=2
    log=${OUT:-/tmp}
    python -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 parity_tests/test_gpu.py \
      --junitxml="$log/gpu-table.xml" 2>&1 | tee "$log/gpu-table.log" | tail -40
    table=${PIPESTATUS[0]}
    timeout 420 python -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 parity_tests \
      --deselect parity_tests/test_gpu.py --junitxml="$log/gpu-suite.xml" 2>&1 \
      | tee "$log/gpu-suite.log" | tail -60
    suite=${PIPESTATUS[0]}
    echo "gpu table exit $table, suite exit $suite"
    [ "$table" = 0 ] && [ "$suite" = 0 ]
    ;;
  bench-1) python -m benchmarks --seq 512,1024,2048 ;;
  bench-2) python -m benchmarks --seq 4096,8192 --append ;;
  bench-3) python -m benchmarks --seq 16384,65536 --append ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac
status=$?
if [ -n "${OUT:-}" ]; then
  cp benchmarks/results/*/full.* "$OUT"/ 2>/dev/null || true
fi
exit $status

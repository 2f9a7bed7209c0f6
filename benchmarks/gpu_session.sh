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
    python -m pip install -q hypothesis pytest >/dev/null 2>&1 || true
    python -m pytest -q -x -p no:cacheprovider \
      parity_tests/test_implementations.py parity_tests/test_float64.py parity_tests/test_jit.py \
      parity_tests/test_masks_dropout.py parity_tests/test_tutorial_numbers.py
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

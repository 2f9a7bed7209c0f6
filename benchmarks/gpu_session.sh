#!/usr/bin/env bash
# Everything a GPU session does, in phases that each fit one 10-minute command:
#
#   bash benchmarks/gpu_session.sh check                # GPU paths against the reference, fused/auto tests
#   bash benchmarks/gpu_session.sh short [BUDGET_S]     # one call of a short lease: the GPU table, the
#                                                       # fused/auto tests for 240 s, the cores at S 4k/16k
#   bash benchmarks/gpu_session.sh decode               # the cache's and decoding tests with JAX on the GPU
#   bash benchmarks/gpu_session.sh suite                # the rest of the suite, through nox -s tests-cuda
#   bash benchmarks/gpu_session.sh core [BUDGET_S]      # the sweep: every kernel alone (CORE_SYSTEMS)
#   bash benchmarks/gpu_session.sh modules [BUDGET_S]   # the sweep: ours, Flax's and torch's modules
#   bash benchmarks/gpu_session.sh extra [BUDGET_S]     # the sweep: the other paths, torch.compile
#
# The bench phases append to one result, benchmarks/results/<gpu>/full.{json,md,png}; with
# $OUT set (the device tool's output folder) they write to $OUT/full/ instead, starting
# from the repository's result, so that what a killed command measured comes back.  No
# case starts after BUDGET_S seconds (default 270); those left are recorded as not run.
# Assumes jax with CUDA, flax and torch are installed (as on this project's lent GPU machines).
# check and suite together run the whole suite with JAX on the GPU; suite needs nox, which
# it installs from the wheels in .whl/nox (carried to the machine) when it is missing.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
python -c "import jax, torch; print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.cuda.get_device_name(0))"

tests_on_gpu() {  # the settings of the test phases; logs go to $log
  export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several pytest workers share the GPU
  # Correctness only: XLA's GEMM autotuning took 10-20 s per compile on an H100 (about
  # 2 s without it) and changes no result beyond rounding (it does make GEMMs slow: the
  # bench phases keep it on).
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" OMP_NUM_THREADS=2
  log=${OUT:-/tmp}
}

phase=${1:-check}
case "$phase" in
  check)
    # The GPU table (both frameworks on the GPU against float64), then every test of the
    # suite that runs a fused or auto path (about 500 of 2700; the whole suite with JAX on
    # the GPU did not fit one 10-minute command), with JAX on the GPU: the module matrix's
    # "auto" and "fused" cases take cuDNN there.
    tests_on_gpu
    python -m benchmarks.routes 2>&1 | tee "$log/routes.log"  # what auto takes here, and why
    python -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 tests/kernels/test_gpu.py \
      --junitxml="$log/gpu-table.xml" 2>&1 | tee "$log/gpu-table.log" | tail -40
    table=${PIPESTATUS[0]}
    timeout 420 python -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 tests \
      -k "fused or auto" --deselect tests/kernels/test_gpu.py --junitxml="$log/gpu-suite.xml" 2>&1 \
      | tee "$log/gpu-suite.log" | tail -60
    suite=${PIPESTATUS[0]}
    echo "gpu table exit $table, fused/auto tests exit $suite"
    [ "$table" = 0 ] && [ "$suite" = 0 ]
    exit $?
    ;;
  short)
    # For a lease of about 15 minutes: the GPU table (every option), the fused/auto tests
    # (cut off after 240 s: what ran is in the log), then the cores against each other at
    # S 4096 and 16384 (ours with layout="bshd", as cuDNN takes it) for BUDGET_S seconds.
    tests_on_gpu
    python -m benchmarks.routes 2>&1 | tee "$log/routes.log" | tail -5
    python -m pytest -q -p no:cacheprovider -p no:benchmark -n 8 tests/kernels/test_gpu.py \
      --junitxml="$log/gpu-table.xml" 2>&1 | tee "$log/gpu-table.log" | tail -15
    table=${PIPESTATUS[0]}
    timeout 240 python -m pytest -q -p no:cacheprovider -p no:benchmark -n 12 tests \
      -k "fused or auto" --deselect tests/kernels/test_gpu.py 2>&1 | tee "$log/gpu-suite.log" | tail -25
    suite=${PIPESTATUS[0]}
    unset XLA_FLAGS
    mkdir -p "$log/core"
    python -m benchmarks --systems core-jax-fused,core-jax-cudnn,core-torch-sdpa-cudnn,core-torch-sdpa-flash \
      --seq 4096,16384 --out "$log/core" --budget-s "${2:-150}" 2>&1 | tee "$log/core.log" | tail -30
    echo "gpu table exit $table, fused/auto tests exit $suite (124: cut off)"
    [ "$table" = 0 ]
    exit $?
    ;;
  decode)
    # The cache's tests (compiled decoding: no host round trip, donation in place, the
    # overflow record) with JAX on the GPU.  (benchmarks.decode times PyTorch on the CPU
    # only, so it has no GPU comparison to make.)
    tests_on_gpu
    timeout 450 python -m pytest -q -rfE -p no:cacheprovider -p no:benchmark -n 8 \
      tests/modules/test_compiled_decoding.py tests/modules/test_cache_and_call_checks.py \
      --junitxml="$log/gpu-decode.xml" 2>&1 | tee "$log/gpu-decode.log" | tail -40
    tests=${PIPESTATUS[0]}
    echo "decoding tests exit $tests"
    exit "$tests"
    ;;
  suite)
    # Every test that check leaves out (about 2200), with JAX on the GPU, through the noxfile's
    # tests-cuda session in this interpreter (--no-venv --no-install: nothing to install from).
    tests_on_gpu
    python -m nox --version >/dev/null 2>&1 \
      || python -m pip install -q --no-index --find-links .whl/nox nox || exit 1
    timeout 570 python -m nox -s tests-cuda --no-venv --no-install -- -q -p no:cacheprovider \
      -p no:benchmark -n 12 tests -k "not (fused or auto)" --deselect tests/kernels/test_gpu.py \
      --junitxml="$log/gpu-rest.xml" 2>&1 | tee "$log/gpu-rest.log" | tail -60
    rest=${PIPESTATUS[0]}
    echo "rest of the suite exit $rest"
    exit "$rest"
    ;;
  core|modules|extra)
    results=benchmarks/results/$(python -c "from benchmarks.environment import host_environment, device_slug; print(device_slug(host_environment()))")
    out=$results
    if [ -n "${OUT:-}" ]; then
      out=$OUT/full; mkdir -p "$out"
      [ -e "$out"/full.json ] || cp "$results"/full.json "$out"/ 2>/dev/null || true
    fi
    # Each system runs all its configs (the issue's target group first) before the next
    # starts: the quick ones and those the targets compare go first, in case the budget ends.
    core=core-jax-fused,core-torch-sdpa-flash,core-torch-sdpa-cudnn,core-torch-sdpa-efficient,core-torch-fused,core-jax-cudnn,core-flax
    modules=ours-torch-sdpa,torch-nn-mha,ours-jax-fused,flax-nnx-mha
    extra=ours-torch-reference,ours-jax-auto,ours-torch-compile,ours-jax-reference,ours-jax-blockwise
    # XLA's defaults: with GEMM autotuning off (--xla_gpu_autotune_level=0) a bfloat16
    # 8192^3 product ran at 10.8 instead of 678 TFLOP/s on the H100 (jax 0.11.2), and the
    # projections took 35 ms of every module call.  SYSTEMS=a,b overrides the phase's list.
    python -m benchmarks --systems "${SYSTEMS:-${!phase}}" --append --out "$out" --budget-s "${2:-270}" 2>&1 \
      | tee -a "${OUT:-/tmp}/bench-$phase.log" | grep -v "^ours\|^core\|^flax\|^torch\|^| B"
    exit "${PIPESTATUS[0]}"
    ;;
  *) echo "unknown phase $phase"; exit 2 ;;
esac

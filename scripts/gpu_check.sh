#!/usr/bin/env bash
# On the device machine (CUDA, torch preinstalled, no package index): install the core and
# every plugin without dependencies, run all GPU tests and the benchmarks, and write the
# results under $OUT (default ./out).
#   GPU_TESTS   pytest paths (default: tests plugins)
#   SKIP_BENCH=1  tests only; BENCH_ARGS  extra flags for cuda-graph-runner bench
#   RUN_BENCHMARKS=1  also run benchmarks/run.py (the comparison suite)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
pkgs=(-e .)
for p in plugins/*/pyproject.toml; do pkgs+=(-e "$(dirname "$p")"); done
$PY -m pip install -q --no-deps --no-build-isolation --no-index "${pkgs[@]}" 2>&1 | tail -3
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$OUT/gpu.txt" 2>&1
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" >> "$OUT/gpu.txt"
status=0
# shellcheck disable=SC2086
$PY -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests plugins} -rs --junitxml="$OUT/gpu-tests.xml" \
  2>&1 | tee "$OUT/gpu-tests.log" || status=1
cuda-graph-runner backends | tee "$OUT/backends.txt"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # shellcheck disable=SC2086
  cuda-graph-runner bench --json "$OUT/bench.json" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" || status=1
fi
if [ "${RUN_BENCHMARKS:-0}" = 1 ] && [ -f benchmarks/run.py ]; then
  $PY benchmarks/run.py --out "$OUT" 2>&1 | tee "$OUT/benchmarks.log" || status=1
fi
exit $status

#!/usr/bin/env bash
# On the device machine (CUDA, torch preinstalled, no package index): install the core and
# every plugin without dependencies, run all GPU tests and the benchmarks, and write the
# results under $OUT (default ./out).
#   GPU_TESTS   pytest paths (default: tests plugins)
#   SKIP_BENCH=1  tests only; BENCH_ARGS  extra flags for cuda-graph-runner bench
#   RUN_BENCHMARKS=1  also run benchmarks/run.py (the comparison suite)
#   BENCH_RUNS=N  regression mode instead of tests and bench: run benchmarks/run.py N times
#                 ($BENCH_RUN_ARGS, default the baseline's settings) into $OUT/bench-run-1..N,
#                 compare runs 2..N with run 1 and every run with $BASELINE (unless it is the
#                 placeholder), and write $OUT/benchmarks-doc.md (make_docs.py) from all runs.
#                 Exit 1 when a compare flags a regression.
#   BENCH_SLOW=METHOD=MS  (with BENCH_RUNS) TEST ONLY: then one more run, $OUT/bench-run-slow, with
#                 --inject-sleep-ms METHOD=MS, compared with run 1: the compare must flag it
#                 (exit 1 if it does not)
#   BENCH_COLD_CACHE=1  (with BENCH_RUNS) each run gets an empty inductor cache, as on a fresh machine
#   COMPILE_CACHE_STARTS=N  also N pairs of cold and warm starts (fresh processes, an empty cache
#                 per pair) of full:inductor and tc_piecewise:inductor on `tiny`
#                 (benchmarks/compile_cache_starts.py) into $OUT/compile-cache-starts.txt
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
if [ "${BENCH_RUNS:-0}" -gt 0 ]; then
  # No GPU tests first: they would warm inductor's cache, and run 1 is meant to meet the cold start.
  BASELINE=${BASELINE:-benchmarks/baseline/h200-llama-3.2-1b.json}
  BENCH_RUN_ARGS=${BENCH_RUN_ARGS:---models llama-3.2-1b --batch-sizes 1 32 128 --backends full,tc_piecewise:inductor,breakable --quick --prefill-tokens}
  bench_once() {  # $1: folder, then extra flags
    local d=$1; shift
    mkdir -p "$d"
    if [ "${BENCH_COLD_CACHE:-0}" = 1 ]; then export TORCHINDUCTOR_CACHE_DIR="$d/inductor-cache"; fi
    echo "== benchmark $d: $(date -u +%T)"
    # shellcheck disable=SC2086
    $PY benchmarks/run.py --out "$d" $BENCH_RUN_ARGS "$@" > "$d/run.log" 2>&1 || { status=1; tail -20 "$d/run.log"; }
    grep -E "^(llama|qwen|tiny)|^note" "$d/run.log" || true
  }
  runs=()
  for i in $(seq 1 "$BENCH_RUNS"); do
    bench_once "$OUT/bench-run-$i"
    [ -f "$OUT/bench-run-$i/benchmarks.json" ] && runs+=("$OUT/bench-run-$i/benchmarks.json")
  done
  for r in ${runs[@]+"${runs[@]:1}"}; do
    echo "== compare $r with run 1"
    $PY benchmarks/compare.py "$r" --baseline "${runs[0]}" 2>&1 | tee "${r%.json}-vs-run1.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  for r in ${runs[@]+"${runs[@]}"}; do
    echo "== compare $r with $BASELINE"
    $PY benchmarks/compare.py "$r" --baseline "$BASELINE" 2>&1 | tee "${r%.json}-vs-baseline.txt"
    rc=${PIPESTATUS[0]}
    [ "$rc" = 1 ] && status=1  # 2: placeholder baseline or other GPU, said above; not a regression
  done
  if [ -n "${BENCH_SLOW:-}" ] && [ ${#runs[@]} -gt 0 ]; then
    bench_once "$OUT/bench-run-slow" --inject-sleep-ms "$BENCH_SLOW"
    echo "== compare the deliberately slowed run ($BENCH_SLOW) with run 1: it must be flagged"
    $PY benchmarks/compare.py "$OUT/bench-run-slow/benchmarks.json" --baseline "${runs[0]}" 2>&1 \
      | tee "$OUT/bench-run-slow/benchmarks-vs-run1.txt"
    if [ "${PIPESTATUS[0]}" = 1 ]; then echo "slowed run flagged, as it must be"; else echo "FAIL: slowed run not flagged"; status=1; fi
  fi
  [ ${#runs[@]} -gt 0 ] && $PY benchmarks/make_docs.py "${runs[@]}" --print > "$OUT/benchmarks-doc.md"
  echo "== done $(date -u +%T), status $status"
  exit $status
fi
# shellcheck disable=SC2086
$PY -m pytest -m gpu -q -p no:cacheprovider ${GPU_TESTS:-tests plugins} -rs --junitxml="$OUT/gpu-tests.xml" \
  2>&1 | tee "$OUT/gpu-tests.log" || status=1
cuda-graph-runner backends | tee "$OUT/backends.txt"
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  # The picture (docs/cli.md) where the optional matplotlib is installed.
  plot=(); $PY -c "import matplotlib" 2>/dev/null && plot=(--plot "$OUT/bench.png")
  # shellcheck disable=SC2086
  cuda-graph-runner -v bench --json "$OUT/bench.json" "${plot[@]}" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.txt" || status=1
fi
if [ "${COMPILE_CACHE_STARTS:-0}" -gt 0 ]; then
  for b in full:inductor tc_piecewise:inductor; do
    $PY benchmarks/compile_cache_starts.py --backend "$b" --device cuda --dtype bfloat16 \
      --sizes 1 2 4 8 12 16 --pairs "$COMPILE_CACHE_STARTS" 2>&1 | tee -a "$OUT/compile-cache-starts.txt" || status=1
  done
fi
if [ "${RUN_BENCHMARKS:-0}" = 1 ] && [ -f benchmarks/run.py ]; then
  $PY benchmarks/run.py --out "$OUT" 2>&1 | tee "$OUT/benchmarks.log" || status=1
fi
exit $status

#!/usr/bin/env bash
# The third-party plugin path, end to end: build the core's wheel and the example
# plugin's wheel (examples/acme_backend), install both into a clean virtual environment
# (no system site-packages, nothing editable, no other plugin), then check that
# `cuda-graph-runner backends` lists `acme`, that a config selects it, and run the
# example's own tests (the conformance kit included) against the installed wheels.
#   BUILD_PYTHON  interpreter with `build` and setuptools (default .venv/bin/python, else python3)
#   TORCH_SPEC    torch requirement for the clean venv (default torch==2.13.0, a CPU build)
#   KEEP_TMP=1    keep the work directory (printed) for inspection
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUILD_PYTHON=${BUILD_PYTHON:-$([ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || command -v python3)}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cgr-example-plugin.XXXXXX")
if [ "${KEEP_TMP:-0}" != 1 ]; then trap 'rm -rf "$WORK"' EXIT; fi
start=$SECONDS
step() { printf '[example_plugin %3ds] %s\n' $((SECONDS - start)) "$*"; }

# Build from copies of the files git knows about (tracked or not ignored): a stale
# in-tree build/ directory can never leak old modules into a wheel.
copy_tree() {  # copy_tree DEST PATH...
  local dest=$1; shift
  mkdir -p "$dest"
  git ls-files -z --cached --others --exclude-standard -- "$@" | (cd "$REPO" && xargs -0 cp --parents -t "$dest")
}
step "building wheels with $BUILD_PYTHON"
copy_tree "$WORK/src/core" pyproject.toml README.md core
copy_tree "$WORK/src/example" examples/acme_backend
"$BUILD_PYTHON" -m build --wheel --no-isolation --outdir "$WORK/wheels" "$WORK/src/core" >"$WORK/build-core.log" 2>&1 \
  || { cat "$WORK/build-core.log"; exit 1; }
"$BUILD_PYTHON" -m build --wheel --no-isolation --outdir "$WORK/wheels" "$WORK/src/example/examples/acme_backend" \
  >"$WORK/build-example.log" 2>&1 || { cat "$WORK/build-example.log"; exit 1; }
ls "$WORK/wheels"

step "clean venv: $TORCH_SPEC pluggy tqdm safetensors pytest + the two wheels"
"$BUILD_PYTHON" -m venv "$WORK/venv"
PY=$WORK/venv/bin/python
# Dependencies from the configured index; our two distributions only from the wheels
# just built (--no-index second pass), so nothing else can stand in for them.
"$PY" -m pip install -q --disable-pip-version-check "$TORCH_SPEC" pluggy tqdm safetensors pytest 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -m pip install -q --disable-pip-version-check --no-index --find-links "$WORK/wheels" \
  cuda-graph-runner cuda-graph-runner-acme
"$PY" -m pip list --format=freeze 2>/dev/null | grep -i cuda-graph-runner

cd "$WORK"  # away from the source tree: every import below comes from the venv
# torch warns at import that numpy is absent; numpy is not a dependency of ours.
export PYTHONWARNINGS="ignore:Failed to initialize NumPy"
step "cuda-graph-runner backends"
"$WORK/venv/bin/cuda-graph-runner" backends | tee backends.txt
grep -Eq '^ *acme +cuda-graph-runner-acme +0\.1\.0 +decode +[*] +available' backends.txt \
  || { echo "FAIL: acme is not listed as available from cuda-graph-runner-acme" >&2; exit 1; }
"$WORK/venv/bin/cuda-graph-runner" backends --json >backends.json

step "a config selects acme"
"$PY" - <<'PY'
import json
from importlib import metadata

import acme_cgr
import cuda_graph_runner
from cuda_graph_runner import CudaGraphConfig, registry
from cuda_graph_runner.errors import UnknownBackendError

for mod in (acme_cgr, cuda_graph_runner):  # installed copies, not the repository's
    assert "site-packages" in mod.__file__, mod.__file__
rows = {r["name"]: r for r in json.load(open("backends.json"))}
assert rows["acme"]["status"] == "available" and rows["acme"]["api_version"] == "1.0", rows["acme"]
assert set(rows) == {"acme", "disabled"}, sorted(rows)  # a clean environment: no in-repo plugin
config = CudaGraphConfig.from_dict({"decode": {"backend": "acme", "max_bs": 4}})
config.validate(registry.backend_phases())
backend = registry.resolve_decode_backend(config, device="cpu")
assert type(backend).__name__ == "AcmeDebugBackend" and backend.name == "acme", backend
assert registry.verify("acme").contract == "ok"
try:
    registry.resolve_decode_backend("full", device="cpu")
except UnknownBackendError as exc:
    assert "pip install cuda-graph-runner-full" in str(exc), exc
else:
    raise AssertionError("'full' resolved in an environment without cuda-graph-runner-full")
# The conformance kit is opt-in: no distribution of ours registers a pytest11 plugin.
assert not [ep for ep in metadata.entry_points(group="pytest11") if "cuda" in (ep.dist.name if ep.dist else "")]
print(f"selected {type(backend).__module__}.{type(backend).__name__} from {acme_cgr.__file__}")
PY
"$WORK/venv/bin/cuda-graph-runner" config --cuda-graph-backend-decode acme >config.txt \
  || { cat config.txt; echo "FAIL: cuda-graph-runner config rejects backend acme" >&2; exit 1; }

step "the example's tests (conformance kit included) against the installed wheels"
mkdir -p example-tests && cp -r "$REPO/examples/acme_backend/tests" example-tests/
(cd example-tests && "$PY" -m pytest -q -p no:cacheprovider -rs -W "ignore:Failed to initialize NumPy" tests)
step "ok"

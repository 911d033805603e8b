#!/usr/bin/env bash
# The packaging path, end to end, from wheels only:
# 1. build every wheel of the repository (the core, each plugin, examples/acme_backend)
#    with the LOWEST setuptools the pyproject files declare, in a build venv of its own;
# 2. install the core and the example plugin's wheels into a clean virtual environment
#    (no system site-packages, nothing editable, no other plugin), check that the CLI
#    prints no warning (torch's "Failed to initialize NumPy" included), that
#    `cuda-graph-runner backends` lists `acme`, that a config selects it, and run the
#    example's own tests (the conformance kit included) against the installed wheels;
# 3. install `cuda-graph-runner[all]` into it with --no-index --find-links: every
#    distribution of ours comes from the wheels just built, never from an index (the
#    extras name distributions that are not published: no dependency confusion), and
#    check versions, py.typed, licenses and that every backend registers.
#   BUILD_PYTHON  interpreter that creates the venvs (default python3)
#   TORCH_SPEC    torch requirement for the clean venv (default torch==2.13.0, a CPU build)
#   KEEP_TMP=1    keep the work directory (printed) for inspection
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
BUILD_PYTHON=${BUILD_PYTHON:-$(command -v python3)}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/cgr-example-plugin.XXXXXX")
if [ "${KEEP_TMP:-0}" != 1 ]; then trap 'rm -rf "$WORK"' EXIT; fi
start=$SECONDS
step() { printf '[example_plugin %3ds] %s\n' $((SECONDS - start)) "$*"; }
PIP_QUIET=(-q --disable-pip-version-check)

# Build from copies of the files git knows about (tracked or not ignored): a stale
# in-tree build/ directory can never leak old modules into a wheel.
copy_tree() {  # copy_tree DEST PATH...
  local dest=$1; shift
  mkdir -p "$dest"
  git ls-files -z --cached --others --exclude-standard -- "$@" | (cd "$REPO" && xargs -0 cp --parents -t "$dest")
}
projects=(. plugins/full plugins/breakable plugins/tc_piecewise plugins/npu plugins/compiled examples/acme_backend)
# The one setuptools floor every pyproject declares (they must agree).
SETUPTOOLS_FLOOR=$("$BUILD_PYTHON" - "${projects[@]}" <<'PY'
import re, sys, tomllib
floors = {}
for project in sys.argv[1:]:
    with open(f"{project}/pyproject.toml", "rb") as f:
        requires = tomllib.load(f)["build-system"]["requires"]
    [spec] = [r for r in requires if r.startswith("setuptools")]
    floors[project] = re.fullmatch(r"setuptools>=([0-9.]+)", spec).group(1)
if len(set(floors.values())) != 1:
    sys.exit(f"FAIL: the pyproject files declare different setuptools floors: {floors}")
print(floors[sys.argv[1]])
PY
)
step "build venv: setuptools==$SETUPTOOLS_FLOOR (the declared floor)"
# No pip of its own (ensurepip costs tens of seconds): BUILD_PYTHON's pip works on it (--python).
"$BUILD_PYTHON" -m venv --without-pip "$WORK/build-venv"
BUILD_PIP=("$BUILD_PYTHON" -m pip --python "$WORK/build-venv/bin/python")
"${BUILD_PIP[@]}" install "${PIP_QUIET[@]}" "setuptools==$SETUPTOOLS_FLOOR" 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
"$WORK/build-venv/bin/python" -c "import setuptools; assert setuptools.__version__ == '$SETUPTOOLS_FLOOR', setuptools.__version__"
step "building ${#projects[@]} wheels with setuptools $SETUPTOOLS_FLOOR"
copy_tree "$WORK/src" pyproject.toml README.md LICENSE core plugins examples/acme_backend
# One pip call for all (each pip start costs seconds); --no-build-isolation: the build
# venv's setuptools (the floor), not the newest one an isolated build would fetch.
"${BUILD_PIP[@]}" wheel "${PIP_QUIET[@]}" --no-deps --no-build-isolation \
  --wheel-dir "$WORK/wheels" "${projects[@]/#/$WORK/src/}" >"$WORK/build.log" 2>&1 || { cat "$WORK/build.log"; exit 1; }
ls "$WORK/wheels"

step "clean venv: $TORCH_SPEC pluggy tqdm safetensors packaging pytest + the two wheels"
"$BUILD_PYTHON" -m venv "$WORK/venv"
PY=$WORK/venv/bin/python
# Dependencies from the configured index; our two distributions only from the wheels
# just built (--no-index second pass), so nothing else can stand in for them.
"$PY" -m pip install "${PIP_QUIET[@]}" "$TORCH_SPEC" pluggy tqdm safetensors packaging pytest 2>&1 \
  | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -m pip install "${PIP_QUIET[@]}" --no-index --find-links "$WORK/wheels" \
  cuda-graph-runner cuda-graph-runner-acme
"$PY" -m pip list --format=freeze 2>/dev/null | grep -i cuda-graph-runner

cd "$WORK"  # away from the source tree: every import below comes from the venv
step "cuda-graph-runner backends (no numpy here: torch's NumPy warning must not show)"
"$PY" -c "import importlib.util as u; assert u.find_spec('numpy') is None, 'numpy is installed'"
"$WORK/venv/bin/cuda-graph-runner" backends 2>stderr.txt | tee backends.txt
if [ -s stderr.txt ]; then cat stderr.txt; echo "FAIL: cuda-graph-runner backends wrote to stderr" >&2; exit 1; fi
grep -Eq '^ *acme +cuda-graph-runner-acme +0\.1\.0 +decode,prefill +[*] +available' backends.txt \
  || { echo "FAIL: acme is not listed as available from cuda-graph-runner-acme" >&2; exit 1; }
"$WORK/venv/bin/cuda-graph-runner" backends --json >backends.json

step "a config selects acme"
"$PY" -W "ignore:Failed to initialize NumPy" - <<'PY'
import json
from importlib import metadata

import acme_cgr
import cuda_graph_runner
from cuda_graph_runner import CudaGraphConfig, registry
from cuda_graph_runner.backend.errors import UnknownBackendError

for mod in (acme_cgr, cuda_graph_runner):  # installed copies, not the repository's
    assert "site-packages" in mod.__file__, mod.__file__
rows = {r["name"]: r for r in json.load(open("backends.json"))}
assert rows["acme"]["status"] == "available" and rows["acme"]["api_version"] == "1.1", rows["acme"]
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

step "cuda-graph-runner[all] from the wheels only (--no-index --find-links)"
# The extras' third-party requirements come from the index first; then pip may take no
# distribution from anywhere but the wheel folder.
"$PY" -m pip install "${PIP_QUIET[@]}" "matplotlib>=3.5" 2>&1 | grep -v "is ignored: it is neither a file nor a directory" || true
"$PY" -m pip install "${PIP_QUIET[@]}" --no-index --find-links "$WORK/wheels" "cuda-graph-runner[all]"
"$WORK/venv/bin/cuda-graph-runner" backends --json >backends-all.json
"$PY" -W "ignore:Failed to initialize NumPy" - <<'PY'
import importlib, json
from importlib import metadata, resources

rows = {r["name"]: r for r in json.load(open("backends-all.json"))}
expected = {"acme", "breakable", "compiled", "disabled", "full", "npu", "tc_piecewise"}
assert set(rows) == expected, sorted(rows)
packages = {"cuda-graph-runner": "cuda_graph_runner", "cuda-graph-runner-full": "cuda_graph_runner_full",
            "cuda-graph-runner-breakable": "cuda_graph_runner_breakable",
            "cuda-graph-runner-tc-piecewise": "cuda_graph_runner_tc_piecewise",
            "cuda-graph-runner-npu": "cuda_graph_runner_npu", "cuda-graph-runner-compiled": "cuda_graph_runner_compiled",
            "cuda-graph-runner-acme": "acme_cgr"}
for dist, package in packages.items():
    module = importlib.import_module(package)
    meta = metadata.metadata(dist)
    assert "site-packages" in module.__file__, module.__file__
    assert meta["Version"] == module.__version__, (dist, meta["Version"], module.__version__)
    assert meta["License-Expression"] == "Apache-2.0", (dist, meta["License-Expression"])
    files = [str(f) for f in metadata.files(dist)]
    assert any(f.endswith("licenses/LICENSE") for f in files), (dist, files)
    assert resources.files(package).joinpath("py.typed").is_file(), f"{dist}: no py.typed in {package}"
for name in expected - {"disabled"}:
    assert rows[name]["version"] == metadata.version(rows[name]["distribution"]), rows[name]
print("all seven distributions installed from the wheels; versions single-sourced; py.typed and LICENSE in each")
PY
step "ok"

"""A backend plugin written to the letter of the flat-layout plugin guide installs, is listed
and selected, and passes the conformance kit, warned only by a ``DeprecationWarning`` for
each old module path it imports, naming the old path and the new one.

The flat-layout guide (docs/plugin-authors.md while the core's modules lay flat in the
package) has plugins import ``cuda_graph_runner.hookspecs``, ``cuda_graph_runner.buffers``,
... : paths that resolve through the core's ``MOVED_MODULES`` table. The sources below are
that guide's code blocks, with only the names filled in: §1's ``pyproject.toml`` and layout,
§2's registration modules (``backend_hooks`` and the hand-written ``@hookimpl`` hooks with a
``DefaultClaim``), §3's ``EagerBackend`` (it runs on any device, so the kit's device tests
run here on the CPU) and §4's test module, run as §4 says (``pytest -rs``, the
distribution installed, not editable). The warning check deliberately runs without
``-W error::DeprecationWarning``: old paths must work, warned, not fail.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any, Dict, Iterator, List, Tuple

import pytest

import cuda_graph_runner
from cuda_graph_runner.testing.conformance import BackendConformanceTests, install_plugin_distributions, run_python

#: §1: the guide's pyproject template (names filled in).
PYPROJECT = """
[build-system]
requires = ["setuptools>=77.0.3"]
build-backend = "setuptools.build_meta"

[project]
name = "{dist}"
version = "0.1.0"
dependencies = ["cuda-graph-runner>=0.1,<0.2"]

[project.optional-dependencies]
test = ["pytest>=7"]  # your tests; the conformance kit comes with cuda-graph-runner[testing]

[tool.setuptools]
packages = ["{package}"]

[project.entry-points."cuda_graph_runner.backends"]
{name} = "{package}.plugin"
"""

#: §2: the registration module of a plugin that provides one backend.
REGISTRATION = '''
from cuda_graph_runner.hookspecs import BackendSpec, backend_hooks


def probe(device_type):
    """None when the backend can run on device_type here, else why not (one line)."""


# The two pluggy hooks of a plugin that provides one backend, bound to their hook names.
cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="oldguide",  # = the entry-point name
        backend_class="oldguide_cgr.backend:EagerBackend",  # a string: imported on selection
        phases=("decode", "prefill"),  # subset of ("decode", "prefill")
        devices=("*",),  # ("cuda",) (the default), ("npu",), or "*" for any
        probe="oldguide_cgr.plugin:probe",  # optional: "module:function" or the function itself
        api_version="1.2",  # a literal: the API you wrote for
        description="one line for `cuda-graph-runner backends`",
        options=(),  # backend options you read, e.g. ("tc_compiler",); () is the default
    ),
    default_for=[],  # (phase, device_type) pairs where "oldguide" claims the default
)
'''

#: §2: the hooks written by hand (several backends, a default claim with a priority). The
#: guide's second backend is an NPU one; here it is an XPU one, so that its claim does not
#: meet the ``npu`` plugin's (two claims give a RuntimeWarning, which is not what this tests).
HAND_WRITTEN_HOOKS = """
from cuda_graph_runner.hookspecs import BackendSpec, DefaultClaim, hookimpl


@hookimpl
def cuda_graph_runner_backend_specs():
    return [
        BackendSpec(name="oldhooks", backend_class="oldhooks_cgr.backend:EagerBackend", phases=("decode", "prefill"),
                    devices=("*",), api_version="1.2", description="the guide's hand-written hooks"),
        BackendSpec(name="oldhooks_xpu", backend_class="oldhooks_cgr.backend:EagerBackend", phases=("decode",),
                    devices=("xpu",),
                    api_version="1.2", description="the guide's hand-written hooks, XPU"),
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase, device_type):
    return DefaultClaim("oldhooks_xpu", priority=10) if (phase, device_type) == ("decode", "xpu") else None
"""

#: §3: the eager backend that runs the forward on the batch ``replay`` receives.
BACKEND = """
from cuda_graph_runner.backend import BaseCudaGraphBackend
from cuda_graph_runner.buffers import copy_into


class EagerBackend(BaseCudaGraphBackend):
    host_value_guard = "off"  # every replay re-runs the Python: nothing is frozen

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        self.graph_table.check_new(key)
        self.warm_up(forward_fn, post_warmup_hook, key=key)
        self.graph_table.add(key, None, forward_fn())  # keep the output's storage

    def replay(self, key, static_batch):
        output = self.graph_table.output(key)  # KeyError for an uncaptured key
        copy_into(output, self.capture_plan.forward(static_batch))  # never forward_fn()
        return output
"""

#: §4: the plugin's conformance test module.
CONFORMANCE = """
# tests/test_conformance.py
from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestOldguideConformance(BackendConformanceTests):
    backend_name = "oldguide"
    distribution = "cuda-graph-runner-oldguide"
"""

#: A pytest plugin (``-p``) that only observes the kit's run: every warning pytest records,
#: each test's outcome, and the file each plugin module was imported from.
OBSERVER = """
import json, os, sys

_log = {"warnings": [], "outcomes": {}, "modules": {}}


def pytest_warning_recorded(warning_message, when, nodeid, location):
    _log["warnings"].append([warning_message.category.__name__, str(warning_message.message), when])


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        reason = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else ""
        _log["outcomes"][report.nodeid.split("::")[-1]] = [report.outcome, reason]


def pytest_sessionfinish(session, exitstatus):
    for name in ("oldguide_cgr.plugin", "oldguide_cgr.backend", "oldhooks_cgr.plugin"):
        module = sys.modules.get(name)
        _log["modules"][name] = getattr(module, "__file__", None)
    with open(os.environ["OLD_GUIDE_OBSERVER_LOG"], "w") as f:
        json.dump(_log, f)
"""

#: Every old module path the flat-layout guide names, with the names it shows read from it
#: (``backend``, ``registry`` and ``testing.conformance`` kept their paths).
GUIDE_NAMES: Dict[str, List[str]] = {
    "hookspecs": ["BackendSpec", "backend_hooks", "DefaultClaim", "hookimpl", "PLUGIN_API_VERSION"],
    "backend": ["BaseCudaGraphBackend"],
    "buffers": ["copy_into"],
    "graph_table": ["CapturedGraphs"],
    "capture_plan": ["CapturePlan"],
    "capture_report": ["CaptureOutOfMemoryError"],
    "graph_break": [
        "eager_op",
        "break_handler",
        "capture_safe_now",
        "breaks_refused",
        "marked_op_bodies",
        "DECODE_LIKE_MODES",
    ],
    "model_forward": ["forward_replaced", "forward_as_written"],
    "nested": ["map_tensors", "iter_tensors", "map_pairs"],
    "weak_ref": ["weak_ref_tensors"],
    "host_guard": [],
    "verify": [],
    "model_protocol": [],
    "profiling": [],
    "envs": ["define", "get"],
    "testing.model": ["ReferenceLlamaForCausalLM"],
    "testing.model.attention_backend": [],
    "testing.conformance": [
        "BackendConformanceTests",
        "write_plugin_source",
        "install_plugin_distributions",
        "run_python",
        "registry_snapshot",
    ],
    "registry": ["check_backend_class", "verify", "verify_all", "reset_registry", "prefer", "register"],
}

NAME = "cuda_graph_runner"
MOVED: Dict[str, str] = cuda_graph_runner.MOVED_MODULES
#: The two forms of the core's deprecation messages: a moved module, a moved registry name.
_MODULE_MESSAGE = re.compile(rf"^{NAME}\.(\S+) is deprecated: import {NAME}\.(\S+) instead ")
_NAME_MESSAGE = re.compile(rf"^{NAME}\.registry\.(\w+) is deprecated: import (\w+) from (\S+) instead ")


#: The subprocesses' extra environment: no warning options; one CPU thread each (the tiny
#: model gains nothing from more, and the kit runs beside the other checks).
ONE_THREAD = {"PYTHONWARNINGS": "", "OMP_NUM_THREADS": "1"}


def _clean_env() -> Dict[str, str]:
    """This process's environment without warning options or the core's own variables, as a
    plugin author's shell has it (the suite's filters live in its pytest config only)."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS" and not k.startswith("CUDA_GRAPH_RUNNER_")}


def _write(root: Path, files: Dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return root


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory: pytest.TempPathFactory) -> Tuple[Path, Path]:
    """(the install directory, the ``oldguide`` source tree): both distributions pip-installed
    (not editable) in one run."""
    root = tmp_path_factory.mktemp("old_guide")
    oldguide = _write(
        root / "cuda-graph-runner-oldguide",
        {
            "pyproject.toml": PYPROJECT.format(
                dist="cuda-graph-runner-oldguide", package="oldguide_cgr", name="oldguide"
            ),
            "oldguide_cgr/__init__.py": "",
            "oldguide_cgr/plugin.py": REGISTRATION,
            "oldguide_cgr/backend.py": BACKEND,
            "tests/test_conformance.py": CONFORMANCE,
        },
    )
    oldhooks = _write(
        root / "cuda-graph-runner-oldhooks",
        {
            "pyproject.toml": PYPROJECT.format(
                dist="cuda-graph-runner-oldhooks", package="oldhooks_cgr", name="oldhooks"
            ),
            "oldhooks_cgr/__init__.py": "",
            "oldhooks_cgr/plugin.py": HAND_WRITTEN_HOOKS,
            "oldhooks_cgr/backend.py": BACKEND,
        },
    )
    return install_plugin_distributions(root / "site", oldguide, oldhooks), oldguide


def _check_deprecations(warnings: List[List[str]]) -> Dict[str, int]:
    """Asserts each recorded ``[category, message, ...]`` is a DeprecationWarning naming an old
    path and the new one of the alias table (or a moved registry name and its new home);
    returns how many times each old module path warned."""
    count: Dict[str, int] = {}
    for category, message, *_ in warnings:
        assert category == "DeprecationWarning", (category, message)
        module = _MODULE_MESSAGE.match(message)
        if module:
            old, new = module.groups()
            assert MOVED.get(old) == new, f"{message!r} does not name a pair of MOVED_MODULES"
            count[old] = count.get(old, 0) + 1
            continue
        name = _NAME_MESSAGE.match(message)
        assert name, f"a DeprecationWarning that names no old and new path: {message!r}"
    return count


# -- installed, listed, selected ----------------------------------------------------------------

LISTING = """
import contextlib, io, json, warnings

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import oldguide_cgr
    from cuda_graph_runner import DecodeCudaGraphRunner, registry
    from cuda_graph_runner.cli import main
    from cuda_graph_runner.testing.model import ReferenceLlamaForCausalLM

    rows = {e.name: [e.distribution, e.version, str(e.status), e.contract] for e in registry.list_backends("cpu")}
    model = ReferenceLlamaForCausalLM.from_preset("tiny", device="cpu")
    model.create_kv_cache(num_slots=64, max_reqs=4, max_context_len=16)
    selected = {}
    for name in ("oldguide", "oldhooks"):
        runner = DecodeCudaGraphRunner(model, {"decode": {"backend": name, "max_bs": 2}}, show_progress=False)
        selected[name] = [type(runner.backend).__module__, type(runner.backend).__name__, runner.backend.name]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        status = main(["backends", "--check"])
print(json.dumps({
    "rows": rows, "selected": selected, "cli": [status, printed.getvalue()], "package": oldguide_cgr.__file__,
    "warnings": [[w.category.__name__, str(w.message)] for w in caught],
}))
"""


@pytest.fixture(scope="module")
def listing(plugin_site: Tuple[Path, Path], kit_process: subprocess.Popen) -> Dict[str, Any]:
    # kit_process: the kit starts first, so that it and these checks share the machine's cores
    site, _ = plugin_site
    return run_python(LISTING, pythonpath=[site], env=ONE_THREAD)


def test_both_plugins_are_installed_listed_and_usable(listing, plugin_site):
    site, _ = plugin_site
    assert Path(listing["package"]).resolve().is_relative_to(site.resolve())  # the installed copy
    rows = listing["rows"]
    assert rows["oldguide"] == ["cuda-graph-runner-oldguide", "0.1.0", "available", ""], rows
    assert rows["oldhooks"][:3] == ["cuda-graph-runner-oldhooks", "0.1.0", "available"], rows
    assert rows["oldhooks_xpu"][0] == "cuda-graph-runner-oldhooks", rows  # the second spec of one hook


def test_a_config_selects_each_plugin_by_its_backend_name(listing):
    assert listing["selected"] == {
        "oldguide": ["oldguide_cgr.backend", "EagerBackend", "oldguide"],
        "oldhooks": ["oldhooks_cgr.backend", "EagerBackend", "oldhooks"],
    }


def test_the_command_lists_and_checks_the_plugin(listing):
    status, printed = listing["cli"]
    assert status == 0, printed
    [row] = [line.split() for line in printed.splitlines() if line.startswith("oldguide ")]
    assert row[:7] == ["oldguide", "cuda-graph-runner-oldguide", "0.1.0", "decode,prefill", "*", "available", "ok"]


def test_listing_and_selecting_warn_only_of_the_old_paths(listing):
    count = _check_deprecations(listing["warnings"])
    # the registration module's, the backend module's and the guide's model path, once each
    assert {k: count.get(k) for k in ("hookspecs", "buffers", "testing.model")} == {
        "hookspecs": 1,
        "buffers": 1,
        "testing.model": 1,
    }, listing["warnings"]


# -- the conformance kit, run as the guide says ---------------------------------------------------


@pytest.fixture(scope="module")
def kit_process(plugin_site: Tuple[Path, Path]) -> Iterator[subprocess.Popen]:
    """The plugin's own tests run as §4 says (``pytest -rs`` in its tests, its distribution
    installed), observed by :data:`OBSERVER`; ``-W error::DeprecationWarning`` is not given.
    Started here, read by ``kit_run``; stopped if still running when the module ends."""
    site, source = plugin_site
    observer = _write(source.parent / "observer", {"old_guide_observer.py": OBSERVER})
    env = _clean_env()
    env.update(ONE_THREAD)
    env["PYTHONPATH"] = os.pathsep.join([str(site), str(observer)])
    env["OLD_GUIDE_OBSERVER_LOG"] = str(source.parent / "observer.json")
    with open(source.parent / "kit.out", "w") as out, open(source.parent / "kit.err", "w") as err:
        # cwd is the plugin's tests/ folder: ``python -m`` puts the cwd on sys.path, and the
        # source root there would shadow the installed package.
        proc = subprocess.Popen(
            [sys.executable, "-m", "pytest", "-rs", "-p", "old_guide_observer"],
            cwd=source / "tests",
            env=env,
            stdout=out,
            stderr=err,
        )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def kit_run(plugin_site: Tuple[Path, Path], kit_process: subprocess.Popen) -> Dict[str, Any]:
    """What the kit's run gave: ``returncode``, ``stdout``, ``stderr`` and :data:`OBSERVER`'s log."""
    _, source = plugin_site
    returncode = kit_process.wait(timeout=600)
    stdout, stderr = (source.parent / "kit.out").read_text(), (source.parent / "kit.err").read_text()
    log = source.parent / "observer.json"
    assert log.exists(), stdout[-4000:] + stderr[-4000:]
    return {"returncode": returncode, "stdout": stdout, "stderr": stderr, **json.loads(log.read_text())}


def test_the_guides_conformance_kit_passes(kit_run, plugin_site):
    assert kit_run["returncode"] == 0, kit_run["stdout"][-6000:]
    outcomes = kit_run["outcomes"]
    standard = sorted(n for n in dir(BackendConformanceTests) if n.startswith("test_"))
    assert sorted(outcomes) == standard, sorted(set(standard) ^ set(outcomes))
    not_passed = {n: o for n, o in outcomes.items() if o[0] != "passed"}
    # On one CPU only the second-device test may skip, and it says why.
    assert set(not_passed) <= {"test_device_runner_on_second_device_matches_eager"}, not_passed
    assert all(o == "skipped" and reason for o, reason in not_passed.values()), not_passed
    # The backend ran: the device tests captured and replayed through it on the CPU.
    assert outcomes["test_device_prefill_capture_replay_matches_eager"][0] == "passed"
    site, _ = plugin_site
    for name, path in kit_run["modules"].items():
        if name.startswith("oldguide_cgr."):
            assert path and Path(path).resolve().is_relative_to(site.resolve()), (name, path)


def test_the_kit_run_warns_only_of_each_old_path_once(kit_run):
    count = _check_deprecations(kit_run["warnings"])
    assert count.get("hookspecs") == 1 and count.get("buffers") == 1, kit_run["warnings"]
    assert all(n == 1 for n in count.values()), count
    assert "Warning" not in kit_run["stderr"], kit_run["stderr"][-4000:]  # none went unrecorded


# -- every old path the guide names -------------------------------------------------------------


def test_every_old_path_the_guide_names_gives_its_names_with_one_warning():
    code = f"""
import importlib, json, warnings
out = {{}}
for old, names in {GUIDE_NAMES!r}.items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            module = importlib.import_module("{NAME}." + old)
        except ImportError as exc:
            out[old] = [None, f"{{type(exc).__name__}}: {{exc}}", []]
            continue
        missing = [n for n in names if not hasattr(module, n)]
    out[old] = [module.__name__, missing, [[w.category.__name__, str(w.message)] for w in caught]]
print(json.dumps(out))
"""
    result = run_python(code, env=ONE_THREAD)
    for old, (module, missing, caught) in result.items():
        assert module is not None, f"{NAME}.{old}, which the guide shows, does not import: {missing}"
        assert not missing, f"{NAME}.{old} lacks {missing}, which the guide shows"
        if old in MOVED:
            assert module == f"{NAME}.{MOVED[old]}", (old, module)
            assert _check_deprecations(caught) == {old: 1}, (old, caught)
        else:
            assert module == f"{NAME}.{old}" and caught == [], (old, module, caught)


def test_the_kit_has_the_class_attributes_the_guide_tunes_it_with():
    # §4: "Class attributes tune the suite", and device_marks, fake_device_backend_kwargs
    attributes = (
        "backend_name distribution device_type supports_target_verify model_preset dtype decode_max_bs "
        "decode_batch_sizes prefill_max_tokens prefill_prompt_lens atol rtol lazy_backend_import device_marks "
        "fake_device_backend_kwargs"
    ).split()
    assert [a for a in attributes if not hasattr(BackendConformanceTests, a)] == []

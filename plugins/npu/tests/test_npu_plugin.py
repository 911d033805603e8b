"""The ``npu`` plugin as a vendor would ship it: entry point, lazy torch_npu, probe reasons,
default-backend hook, optional torch-npu extra.

torch_npu is faked with small packages on ``sys.path`` (in a subprocess where the fake
changes torch's global device registry), so these run on any machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from cuda_graph_runner.backend import ENTRY_POINT_GROUP, BackendUnavailableError
from cuda_graph_runner.testing.workload import get_registry, list_backends, reset_registry, resolve_decode_backend
from cuda_graph_runner_npu import plugin, torch_npu_api

PLUGIN_ROOT = Path(__file__).resolve().parents[1]

# A torch_npu.npu with the graph API the backend calls (built from the recording double).
_GOOD_NPU = """
import types
from cuda_graph_runner_npu.testing import RecordingNPUModule

recorder = RecordingNPUModule()
npu = types.ModuleType("torch_npu.npu")
for _name in ("NPUGraph", "graph", "graph_pool_handle", "Stream", "stream", "synchronize"):
    setattr(npu, _name, getattr(recorder, _name))
npu.is_available = lambda: {available}
npu.device_count = lambda: {count}
npu.current_device = lambda: 0
"""


def write_fake_torch_npu(root: Path, body: str, version: str = "2.13.0") -> Path:
    """A ``torch_npu`` package (and its dist-info, for the version) under ``root``."""
    pkg = root / "torch_npu"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(textwrap.dedent(body))
    info = root / f"torch_npu-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch_npu\nVersion: {version}\n")
    return root


@pytest.fixture
def fake_torch_npu(tmp_path, monkeypatch):
    """Install a fake torch_npu for this test: ``fake_torch_npu(body)``; undone afterwards."""

    def install(body: str) -> None:
        write_fake_torch_npu(tmp_path, body)
        monkeypatch.syspath_prepend(str(tmp_path))

    saved = {k: v for k, v in sys.modules.items() if k == "torch_npu" or k.startswith("torch_npu.")}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    torch_npu_api.reset_cache()
    yield install
    for name in [k for k in sys.modules if k == "torch_npu" or k.startswith("torch_npu.")]:
        del sys.modules[name]
    sys.modules.update(saved)
    torch_npu_api.reset_cache()


@pytest.fixture
def no_torch_npu(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_npu", None)  # hides a real one, if any
    torch_npu_api.reset_cache()
    yield
    torch_npu_api.reset_cache()


def run_python(code: str, extra_path: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDA_GRAPH_RUNNER_")}
    env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ packaging


def test_entry_point_names_the_light_plugin_module():
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "npu"]
    assert len(eps) == 1
    assert eps[0].value == "cuda_graph_runner_npu.plugin"
    assert eps[0].dist.name == "cuda-graph-runner-npu"


def test_torch_npu_is_an_optional_extra_not_a_dependency():
    import tomllib

    project = tomllib.loads((PLUGIN_ROOT / "pyproject.toml").read_text())["project"]
    assert project["name"] == "cuda-graph-runner-npu"
    assert not any(d.lower().replace("_", "-").startswith("torch-npu") for d in project["dependencies"])
    assert any(d.startswith("torch-npu") for d in project["optional-dependencies"]["torch-npu"])
    assert project["entry-points"][ENTRY_POINT_GROUP] == {"npu": "cuda_graph_runner_npu.plugin"}
    requires = metadata.requires("cuda-graph-runner-npu") or []
    npu_reqs = [r for r in requires if r.lower().replace("_", "-").startswith("torch-npu")]
    assert npu_reqs and all('extra == "torch-npu"' in r for r in npu_reqs)


def test_plugin_module_imports_neither_torch_nor_torch_npu(tmp_path):
    out = run_python(
        """
        import json, sys
        import cuda_graph_runner_npu.plugin, cuda_graph_runner_npu.torch_npu_api
        print(json.dumps({m: m in sys.modules for m in ("torch", "torch_npu", "cuda_graph_runner_npu.backend")}))
    """,
        tmp_path,
    )
    assert out == {"torch": False, "torch_npu": False, "cuda_graph_runner_npu.backend": False}


def test_discovery_never_imports_torch_npu_but_the_probe_does_and_quotes_its_failure(tmp_path):
    marker = tmp_path / "imported"
    write_fake_torch_npu(
        tmp_path / "site",
        f"""
        open({str(marker)!r}, "w").close()
        raise ImportError("libascend_hal.so: cannot open shared object file: No such file or directory")
    """,
    )
    out = run_python(
        """
        import json, os, sys
        from cuda_graph_runner.testing.workload import get_registry, list_backends
        reg = get_registry()
        names = reg.names()
        after_scan = {"names": names, "torch_npu": "torch_npu" in sys.modules,
                      "backend": "cuda_graph_runner_npu.backend" in sys.modules,
                      "marker": os.path.exists(%r)}
        row = [e for e in list_backends() if e.name == "npu"][0]
        others = {e.name: e.status for e in list_backends() if e.name != "npu"}
        print(json.dumps({"scan": after_scan, "status": row.status, "reason": row.reason,
                          "marker": os.path.exists(%r), "others_failed": [n for n, s in others.items() if s == "failed"]}))
    """
        % (str(marker), str(marker)),
        tmp_path / "site",
    )
    assert "npu" in out["scan"]["names"]
    assert out["scan"]["torch_npu"] is False and out["scan"]["backend"] is False and out["scan"]["marker"] is False
    assert out["marker"] is True  # probing imported it
    assert out["status"] == "unavailable"
    assert out["reason"].startswith(
        "torch_npu 2.13.0 is installed but importing it failed: ImportError: libascend_hal.so"
    )
    assert out["others_failed"] == []  # one broken vendor stack breaks no other backend


# ----------------------------------------------------------------------------- the probe


def test_probe_on_another_device_type():
    assert plugin.probe("cuda") == "needs an Ascend NPU device ('npu'), not 'cuda'"


def test_probe_without_torch_npu(no_torch_npu):
    reason = plugin.probe("npu")
    assert reason.startswith("torch_npu is not installed; pip install 'cuda-graph-runner-npu[torch-npu]'")


def test_probe_when_torch_npu_fails_to_import(fake_torch_npu):
    fake_torch_npu('raise RuntimeError("Two accelerators cannot be used at the same time in PyTorch: npu and cuda.")')
    reason = plugin.probe("npu")
    assert reason == (
        "torch_npu 2.13.0 is installed but importing it failed: RuntimeError: "
        "Two accelerators cannot be used at the same time in PyTorch: npu and cuda."
    )
    _, _, error = torch_npu_api.load_torch_npu()
    assert isinstance(error, RuntimeError)


def test_probe_without_an_npu_device(fake_torch_npu):
    fake_torch_npu(_GOOD_NPU.format(available=False, count=0))
    reason = plugin.probe("npu")
    assert reason.startswith("torch_npu 2.13.0 imported but no NPU device is visible")
    assert "is_available() is False" in reason


def test_probe_when_torch_npu_lacks_the_update_api(fake_torch_npu):
    fake_torch_npu(
        _GOOD_NPU.format(available=True, count=1)
        + textwrap.dedent("""
        class NPUGraph:
            def replay(self): pass
            def reset(self): pass
        def graph(npu_graph, pool=None, stream=None, capture_error_mode="global"): pass
        npu.NPUGraph, npu.graph = NPUGraph, graph
    """)
    )
    reason = plugin.probe("npu")
    assert reason.startswith("torch_npu 2.13.0 lacks the graph API this backend calls:")
    assert "graph has no parameter 'auto_dispatch_capture'" in reason and "no NPUGraph.update" in reason


def test_probe_with_a_working_torch_npu(fake_torch_npu):
    fake_torch_npu(_GOOD_NPU.format(available=True, count=1))
    assert plugin.probe("npu") is None


# -------------------------------------------------------------------- registry and hooks


def test_default_backend_hook_names_npu_for_decode_on_npu_only():
    reg = get_registry()
    reg.names()  # scan: entry-point plugins join the plugin manager
    hook = reg.pm.hook.cuda_graph_runner_default_backend
    assert hook(phase="decode", device_type="npu") == "npu"
    assert plugin.cuda_graph_runner_default_backend(phase="prefill", device_type="npu") is None
    assert plugin.cuda_graph_runner_default_backend(phase="decode", device_type="cuda") is None


def test_default_on_npu_falls_back_to_disabled_while_unavailable_and_is_npu_once_usable(no_torch_npu, monkeypatch):
    reg = get_registry()
    assert reg.default_backend("decode", "npu") == "disabled"
    monkeypatch.setattr(plugin, "probe", lambda device_type: None)
    # A probe's answer is kept per registry and device type: a fresh registry asks again.
    assert reg.default_backend("decode", "npu") == "disabled"
    reset_registry()
    assert get_registry().default_backend("decode", "npu") == "npu"


def test_list_and_resolve_say_why_npu_is_unavailable(no_torch_npu):
    (row,) = [e for e in list_backends() if e.name == "npu"]
    assert row.status == "unavailable" and row.distribution == "cuda-graph-runner-npu"
    assert row.phases == ("decode",) and row.devices == ("npu",)
    assert row.reason.startswith("torch_npu is not installed")
    with pytest.raises(BackendUnavailableError, match="backend 'npu'.*torch_npu is not installed"):
        resolve_decode_backend("npu", device="npu:0")


def test_found_by_name_and_default_on_an_npu_device_with_torch_npu(tmp_path):
    # The fake registers an 'npu' device type and torch.npu module, as torch_npu does;
    # in a subprocess, since torch's device registry cannot be undone.
    write_fake_torch_npu(
        tmp_path,
        _GOOD_NPU.format(available=True, count=1)
        + textwrap.dedent("""
        import torch
        torch.utils.rename_privateuse1_backend("npu")
        torch._register_device_module("npu", npu)
    """),
    )
    out = run_python(
        """
        import json, sys, torch
        from cuda_graph_runner.testing.workload import get_registry, resolve_decode_backend
        from cuda_graph_runner.backend import ShapeKey
        assert "torch_npu" not in sys.modules
        default = get_registry().default_backend("decode", "npu")
        by_name = resolve_decode_backend("npu", device="npu:0")
        by_default = resolve_decode_backend(None, device="npu:0")
        import torch_npu
        with by_name.capture_session(None):
            by_name.capture_one(ShapeKey(1, "decode"), lambda: None)
        print(json.dumps({"default": default, "by_name": type(by_name).__name__,
                          "by_default": type(by_default).__name__, "device": str(by_name.device),
                          "module_is_torch_npu": by_name.device_module is torch.npu,
                          "events": torch_npu.recorder.names("capture_begin", "capture_end")}))
    """,
        tmp_path,
    )
    assert out == {
        "default": "npu",
        "by_name": "NPUCudaGraphBackend",
        "by_default": "NPUCudaGraphBackend",
        "device": "npu:0",
        "module_is_torch_npu": True,
        "events": ["capture_begin", "capture_end"],
    }

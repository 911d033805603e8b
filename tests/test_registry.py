"""Registry: real entry points, failures kept per plugin, errors that say what to do."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from importlib import metadata
from pathlib import Path

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend import BaseCudaGraphBackend, DisabledBackend
from cuda_graph_runner.backend.errors import (
    BackendConflictError,
    BackendContractError,
    BackendUnavailableError,
    UnknownBackendError,
)
from cuda_graph_runner.backend.hookspecs import ENTRY_POINT_GROUP, BackendSpec
from cuda_graph_runner.config import WELL_KNOWN_DISTRIBUTIONS
from cuda_graph_runner.testing.conformance import install_plugin_distributions

REPO = Path(__file__).resolve().parents[1]


def test_full_plugin_is_found_through_its_installed_entry_point():
    eps = [ep for ep in metadata.entry_points(group=ENTRY_POINT_GROUP) if ep.name == "full"]
    assert len(eps) == 1, eps
    assert eps[0].dist.name == "cuda-graph-runner-full"
    rows = {e.name: e for e in registry.list_backends()}
    assert rows["full"].distribution == "cuda-graph-runner-full"
    assert rows["full"].phases == ("decode", "prefill")
    assert rows["disabled"].status == "available"


def test_listing_does_not_import_backend_code():
    code = (
        "import sys; from cuda_graph_runner import registry; registry.list_backends();"
        "print(json.dumps(sorted(m for m in sys.modules if m.startswith('cuda_graph_runner_'))))"
    )
    out = subprocess.run([sys.executable, "-c", "import json;" + code], capture_output=True, text=True, check=True)
    loaded = json.loads(out.stdout)
    assert "cuda_graph_runner_full.plugin" in loaded
    assert "cuda_graph_runner_full.backend" not in loaded  # only resolve imports it


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the CPU-only reason; this machine has CUDA")
def test_full_is_unavailable_on_cpu_with_reason():
    row = {e.name: e for e in registry.list_backends()}["full"]
    assert row.status == "unavailable"
    assert "CUDA" in row.reason
    with pytest.raises(BackendUnavailableError, match="full.*CUDA"):
        registry.resolve_decode_backend({"backend": "full"}, device="cuda")


def test_disabled_resolves_everywhere():
    backend = registry.resolve_decode_backend({"backend": "disabled"}, device="cpu")
    assert isinstance(backend, DisabledBackend)
    assert registry.resolve_prefill_backend("disabled", device="cpu").phase == "prefill"


def test_default_on_cpu_is_disabled():
    assert isinstance(registry.resolve_decode_backend(None, device="cpu"), DisabledBackend)


def test_unknown_name_lists_installed_and_suggests_distribution(monkeypatch):
    monkeypatch.setitem(WELL_KNOWN_DISTRIBUTIONS, "hexagon", "cuda-graph-runner-hexagon")
    with pytest.raises(UnknownBackendError) as info:
        registry.resolve_decode_backend({"backend": "hexagon"}, device="cpu")
    msg = str(info.value)
    assert "'hexagon'" in msg and "pip install cuda-graph-runner-hexagon" in msg
    assert "full (cuda-graph-runner-full)" in msg and "disabled" in msg
    with pytest.raises(UnknownBackendError, match="Did you mean 'full'"):
        registry.resolve_decode_backend({"backend": "ful"}, device="cpu")


def test_installed_but_filtered_plugin_says_why(monkeypatch):
    monkeypatch.setenv(registry.ENV_PLUGINS, "full")
    registry.reset_registry()
    with pytest.raises(UnknownBackendError) as info:
        registry.resolve_decode_backend({"backend": "npu"}, device="cpu")
    assert "cuda-graph-runner-npu provides 'npu'" in str(info.value)
    assert registry.ENV_PLUGINS in str(info.value)


def test_phase_not_supported_is_named():
    registry.register(
        BackendSpec(name="decode_only", backend_class=DisabledBackend, phases=("decode",), devices=("*",))
    )
    with pytest.raises(BackendUnavailableError, match="does not support phase 'prefill'"):
        registry.resolve_prefill_backend("decode_only", device="cpu")


def test_autoload_off_keeps_builtins(monkeypatch):
    monkeypatch.setenv(registry.ENV_DISABLE_AUTOLOAD, "1")
    registry.reset_registry()
    assert registry.get_registry().names() == ["disabled"]


def test_in_process_register_and_conflict():
    spec = BackendSpec(name="mine", backend_class=DisabledBackend, phases=("decode", "prefill"), devices=("*",))
    registry.register(spec)
    assert type(registry.resolve_decode_backend("mine", device="cpu")) is DisabledBackend
    with pytest.raises(BackendConflictError, match="already registered"):
        registry.register(spec)
    registry.register(spec, replace=True)


class _NoHook(BaseCudaGraphBackend):
    def capture_session(self, stream): ...
    def capture_one(self, key, forward_fn): ...  # lacks post_warmup_hook
    def can_run(self, batch, key): ...
    def replay_session(self): ...
    def replay(self, key, static_batch): ...
    def cleanup(self): ...


class _Abstract(BaseCudaGraphBackend):
    def capture_session(self, stream): ...


def test_contract_check_names_class_method_and_parameter():
    with pytest.raises(BackendContractError, match=r"_NoHook\.capture_one.*post_warmup_hook"):
        registry.check_backend_class(_NoHook, "nohook")
    with pytest.raises(BackendContractError, match=r"_Abstract does not implement .*capture_one"):
        registry.check_backend_class(_Abstract, "abstract")
    with pytest.raises(BackendContractError, match="not a subclass of BaseCudaGraphBackend"):
        registry.check_backend_class(dict, "dict")


def _install_plugin(tmp_path: Path, name: str, module_source: str, ep_name: str) -> Path:
    """pip-install a one-module plugin distribution into a private site dir."""
    src = tmp_path / f"src_{name}"
    src.mkdir()
    (src / f"{name}.py").write_text(textwrap.dedent(module_source))
    (src / "pyproject.toml").write_text(
        textwrap.dedent(f"""
        [build-system]
        requires = ["setuptools>=68"]
        build-backend = "setuptools.build_meta"
        [project]
        name = "{name.replace("_", "-")}"
        version = "0.0.1"
        [project.entry-points."cuda_graph_runner.backends"]
        {ep_name} = "{name}"
        [tool.setuptools]
        py-modules = ["{name}"]
    """)
    )
    return install_plugin_distributions(tmp_path / "site", src)


def _scan_with_site(site: Path, monkeypatch) -> dict:
    """The registry's rows with ``site`` first on ``sys.path`` (entry points are read at each scan)."""
    monkeypatch.syspath_prepend(str(site))
    registry.reset_registry(keep_in_process=False)
    return {e.name: e for e in registry.list_backends()}


def test_broken_plugin_distribution_is_listed_failed_and_others_still_work(tmp_path, monkeypatch):
    from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

    site = _install_plugin(
        tmp_path, "broken_cgr_plugin", "raise ImportError('vendor SDK libacme.so not found')\n", "acme"
    )
    rows = _scan_with_site(site, monkeypatch)
    acme = rows["acme"]
    full_cls = registry.get_registry().load_class(rows["full"])
    full = full_cls("cuda", phase="decode", device_module=FakeGraphDeviceModule(), memory_pool="p")
    assert acme.status == "failed"
    assert acme.distribution == "broken-cgr-plugin"
    assert "libacme.so" in acme.reason and "ImportError" in repr(acme.error)
    assert type(full).__name__ == "FullCudaGraphBackend" and rows["full"].status != "failed"
    assert type(registry.resolve_decode_backend("disabled", device="cpu")).__name__ == "DisabledBackend"


def test_plugin_whose_hook_raises_is_failed_with_cause(tmp_path, monkeypatch):
    site = _install_plugin(
        tmp_path,
        "raising_cgr_plugin",
        """
        from cuda_graph_runner.backend.hookspecs import hookimpl
        @hookimpl
        def cuda_graph_runner_backend_specs():
            raise RuntimeError("device table corrupt")
    """,
        "raising",
    )
    rows = _scan_with_site(site, monkeypatch)
    assert rows["raising"].status == "failed" and "device table corrupt" in rows["raising"].reason
    assert "full" in rows and "disabled" in rows

"""Throwaway plugin distributions for the registry tests: module sources and one pip call
that installs several distributions into a private site directory.

The tests that pip-install plugins (failures, isolation, controls, contract, default
claims) build their distributions from these pieces; each keeps only what its own
plugins do differently.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, NamedTuple

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.testing.conformance import install_plugin_distributions, write_plugin_source

RECORDING_BACKEND = "cuda_graph_runner.testing.fakes:RecordingBackend"


def minimal_backend_source(class_name: str) -> str:
    """Source of a module defining ``class_name``: a backend that honours the contract
    and never replays (``can_run`` is False; ``replay`` raises ``KeyError``)."""
    return f"""
    import contextlib
    from cuda_graph_runner.backend import BaseCudaGraphBackend

    class {class_name}(BaseCudaGraphBackend):
        @contextlib.contextmanager
        def capture_session(self, stream):
            yield
        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            pass
        def can_run(self, batch, key):
            return False
        @contextlib.contextmanager
        def replay_session(self):
            yield
        def replay(self, key, static_batch):
            raise KeyError(key)
        def cleanup(self):
            pass
"""


def spec_module(
    name: str,
    *,
    backend_class: str = RECORDING_BACKEND,
    phases: str = '("decode",)',
    api_version: str = "1.1",
    extra_spec: str = "",
    before: str = "",
    in_hook: str = "",
    extra: str = "",
) -> str:
    """Source of a plugin module whose specs hook registers backend ``name``.

    Args:
        backend_class, phases, api_version: the spec's fields (``phases`` as Python source).
        extra_spec: more keyword arguments of the spec, as source starting with ``", "``.
        before: source run at import, before the hook is defined.
        in_hook: source run inside the hook, before it returns.
        extra: more module source after the hook (indented 8 spaces, as this template).
    """
    return f"""
        {before}
        from cuda_graph_runner.backend.hookspecs import BackendSpec, hookimpl

        @hookimpl
        def cuda_graph_runner_backend_specs():
            {in_hook or "pass"}
            return [BackendSpec(name="{name}", backend_class="{backend_class}", phases={phases},
                                devices=("*",), api_version="{api_version}"{extra_spec})]
        {extra}
    """


class PluginDist(NamedTuple):
    """One throwaway distribution: ``{module: source}`` and ``{backend: "module[:attr]"}``."""

    name: str
    modules: Mapping[str, str]
    entry_points: Mapping[str, str]
    version: str = "0.0.1"


def install_plugins(root: Path, *dists: PluginDist) -> Path:
    """Write each of ``dists`` under ``root`` and pip-install them all (one pip run) into
    ``root / "site"``; returns that directory, to put on ``sys.path``.

    Raises:
        subprocess.CalledProcessError: pip failed.
    """
    sources = [write_plugin_source(root / d.name, d.name, d.modules, d.entry_points, version=d.version) for d in dists]
    return install_plugin_distributions(root / "site", *sources)


def load_only(monkeypatch: pytest.MonkeyPatch, plugins: str) -> None:
    """Rescan the registry with ``CUDA_GRAPH_RUNNER_PLUGINS=plugins``."""
    monkeypatch.setenv(registry.ENV_PLUGINS, plugins)
    registry.reset_registry()

"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import List, Optional

from cuda_graph_runner.hookspecs import BackendSpec, hookimpl

from .toolchain import probe  # noqa: F401 - the spec names it here; torch loads lazily


@hookimpl
def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
    return [
        BackendSpec(
            name="compiled",
            backend_class="cuda_graph_runner_compiled.backend:CompiledBackend",
            phases=("decode",),
            devices=("cpu",),
            probe="cuda_graph_runner_compiled.plugin:probe",
            api_version="1.1",
            options=(),  # always inductor (tc_compiler's default 'eager' would gain nothing here)
            description="torch.compile (inductor) of the forward per batch-size bucket, no device graph (CPU)",
        )
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
    # Never the runner's default: compiling costs tens of seconds per size on a small CPU.
    # `cuda-graph-runner bench` picks it on the CPU by name (cuda_graph_runner.bench).
    return None

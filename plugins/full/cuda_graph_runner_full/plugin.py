"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import List, Optional

from cuda_graph_runner.hookspecs import BackendSpec, hookimpl
from cuda_graph_runner.probes import cuda_graphs as probe  # noqa: F401 - the spec names it here; torch loads lazily


@hookimpl
def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
    return [
        BackendSpec(
            name="full",
            backend_class="cuda_graph_runner_full.backend:FullCudaGraphBackend",
            phases=("decode",),
            devices=("cuda",),
            probe="cuda_graph_runner_full.plugin:probe",
            api_version="1.1",
            options=("tc_compiler",),  # inductor: compiled full (cuda_graph_runner_full.compiled)
            description="one CUDA graph per batch size, shared memory pool (tc_compiler inductor: compiled first)",
        )
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
    return "full" if (phase, device_type) == ("decode", "cuda") else None

"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import List, Optional

from cuda_graph_runner.hookspecs import BackendSpec, hookimpl
from cuda_graph_runner.probes import cuda_graphs as probe  # noqa: F401 - the spec names it here; torch loads lazily


@hookimpl
def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
    return [
        BackendSpec(
            name="breakable",
            backend_class="cuda_graph_runner_breakable.backend:BreakableCudaGraphBackend",
            phases=("decode", "prefill"),
            devices=("cuda",),
            probe="cuda_graph_runner_breakable.plugin:probe",
            api_version="1.1",
            options=(),  # reads no backend option (tc_compiler is tc_piecewise's)
            description="CUDA graph segments split at marked eager ops (attention runs live); no torch.compile",
        )
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
    # Prefill needs attention on live variable-length metadata; decode defaults to "full".
    return "breakable" if (phase, device_type) == ("prefill", "cuda") else None

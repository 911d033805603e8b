"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import List, Optional

from cuda_graph_runner.hookspecs import BackendSpec, hookimpl


@hookimpl
def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
    return [
        BackendSpec(
            name="full",
            backend_class="cuda_graph_runner_full.backend:FullCudaGraphBackend",
            phases=("decode",),
            devices=("cuda",),
            probe="cuda_graph_runner_full.plugin:probe",
            api_version="1.0",
            description="one CUDA graph per batch size, shared memory pool",
        )
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
    return "full" if (phase, device_type) == ("decode", "cuda") else None


def probe(device_type: str) -> Optional[str]:
    """None when CUDA graphs can be captured here, else why not (imports torch, not the backend)."""
    import torch

    if device_type != "cuda":
        return f"needs a CUDA device, not {device_type!r}"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None

"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import List, Optional

from cuda_graph_runner.hookspecs import BackendSpec, hookimpl


@hookimpl
def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
    return [
        BackendSpec(
            name="tc_piecewise",
            backend_class="cuda_graph_runner_tc_piecewise.backend:TcPiecewiseCudaGraphBackend",
            phases=("decode", "prefill"),
            devices=("cuda",),
            probe="cuda_graph_runner_tc_piecewise.plugin:probe",
            api_version="1.0",
            description="torch.compile split at marked eager ops; each piece a CUDA graph per size (eager|inductor)",
        )
    ]


@hookimpl
def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
    # Never the default: compiling costs seconds to minutes; users opt in by name.
    return None


def probe(device_type: str) -> Optional[str]:
    """None when the backend can run on ``device_type``, else why not.

    Imports torch (not the backend). Whether the ``inductor`` compiler has Triton is
    checked when a backend is built with it, since the probe does not see the config.
    """
    import torch

    if device_type != "cuda":
        return f"needs a CUDA device, not {device_type!r}"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None

"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from typing import Optional

from cuda_graph_runner.backend import BackendSpec, backend_hooks, envs

#: The variable this plugin reads (envs.get), declared here so the one table lists it.
DEBUG = envs.define(
    "CUDA_GRAPH_RUNNER_TC_PIECEWISE_DEBUG",
    "bool",
    False,
    "tc_piecewise: check input addresses at every replay. Read when a TcPiecewiseCudaGraphBackend is "
    "built without debug.",
    owner="cuda-graph-runner-tc-piecewise",
).name

# Never the default (no default_for): compiling costs seconds to minutes; users opt in by name.
cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="tc_piecewise",
        backend_class="cuda_graph_runner_tc_piecewise.backend:TcPiecewiseCudaGraphBackend",
        phases=("decode", "prefill"),
        # devices: ("cuda",), the default
        probe="cuda_graph_runner_tc_piecewise.plugin:probe",
        api_version="1.2",
        options=("tc_compiler",),  # reads tc_compiler (eager|inductor) for its pieces
        description="torch.compile split at marked eager ops; each piece a CUDA graph per size (eager|inductor)",
    )
)


def probe(device_type: str) -> Optional[str]:
    """CUDA graphs (:func:`cuda_graph_runner.backend.probes.cuda_graphs`) and torch.compile.

    Whether the ``inductor`` compiler has Triton is checked when a backend is built with
    it, since the probe does not see the config.
    """
    from cuda_graph_runner.backend import cuda_graphs

    reason = cuda_graphs(device_type)
    if reason is None:
        import torch

        if not hasattr(torch, "compile"):
            return f"torch {torch.__version__} has no torch.compile"
    return reason

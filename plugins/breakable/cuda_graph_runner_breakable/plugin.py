"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from cuda_graph_runner.backend import BackendSpec, backend_hooks
from cuda_graph_runner.backend import cuda_graphs as probe  # torch loads lazily, when it is called

cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="breakable",
        backend_class="cuda_graph_runner_breakable.backend:BreakableCudaGraphBackend",
        phases=("decode", "prefill"),
        # devices: ("cuda",), the default
        probe=probe,
        api_version="1.2",
        # options: none read (tc_compiler is tc_piecewise's)
        description="CUDA graph segments split at marked eager ops (attention runs live); no torch.compile",
    ),
    # Prefill needs attention on live variable-length metadata; decode defaults to "full".
    default_for=[("prefill", "cuda")],
)

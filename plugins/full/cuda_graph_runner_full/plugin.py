"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from cuda_graph_runner.backend import BackendSpec, backend_hooks
from cuda_graph_runner.backend import cuda_graphs as probe  # torch loads lazily, when it is called

cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="full",
        backend_class="cuda_graph_runner_full.backend:FullCudaGraphBackend",
        # prefill: one graph per token bucket with fixed request slots (full_prefill_max_req);
        # needs an attention whose metadata the replay hook updates (the prefill runner checks)
        phases=("decode", "prefill"),
        # devices: ("cuda",), the default
        probe=probe,
        api_version="1.1",
        # torch_compile: compiled full (cuda_graph_runner_full.compiled)
        options=("compile_sizes", "torch_compile", "torch_compile_max_bs"),
        description="one CUDA graph per batch size, shared memory pool (torch_compile: the forward compiled first)",
    ),
    default_for=[("decode", "cuda")],
)

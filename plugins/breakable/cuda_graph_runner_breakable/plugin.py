"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from cuda_graph_runner.backend import BackendSpec, backend_hooks, envs
from cuda_graph_runner.backend import cuda_graphs as probe  # torch loads lazily, when it is called

_OWNER = "cuda-graph-runner-breakable"
#: The variables this plugin reads (envs.get), declared here so the one table lists them.
WEAK_REF_ARGS = envs.define(
    "CUDA_GRAPH_RUNNER_BREAKABLE_WEAK_REF_ARGS",
    "bool",
    True,
    "breakable: hand eager ops weak references to graph-owned arguments (default on). Read when a "
    "BreakableCudaGraphBackend is built without weak_ref_args.",
    owner=_OWNER,
).name
INLINE_SAFE_OPS = envs.define(
    "CUDA_GRAPH_RUNNER_BREAKABLE_INLINE_SAFE_OPS",
    "bool",
    True,
    "breakable: record marked ops declared capture-safe for the batch's mode inside the segments "
    "(default on; off breaks at every marked op). Read when a BreakableCudaGraphBackend is built without "
    "inline_capture_safe_ops.",
    owner=_OWNER,
).name
CHECK_LEAKED_OUTPUTS = envs.define(
    "CUDA_GRAPH_RUNNER_BREAKABLE_CHECK_LEAKED_OUTPUTS",
    "bool",
    False,
    "breakable: at capture, report tensors a marked op made between segments that later code reads "
    "without the op declaring them (a debug switch, default off). Read when a BreakableCudaGraphBackend "
    "is built without check_leaked_outputs.",
    owner=_OWNER,
).name

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

"""Registration module named by the entry point: hooks only, no torch import."""

from __future__ import annotations

from cuda_graph_runner.backend import BackendSpec, backend_hooks, envs

from .toolchain import probe  # torch loads lazily, when it is called

_OWNER = "cuda-graph-runner-compiled"
#: The variables this plugin reads (envs.get), declared here so the one table lists them.
COMPILER = envs.define(
    "CUDA_GRAPH_RUNNER_COMPILED_COMPILER",
    "str",
    "inductor",
    "compiled: the torch.compile backend (inductor, aot_eager or eager; the last two skip code generation, "
    "for tests). Read when a CompiledBackend is built without compiler.",
    owner=_OWNER,
).name
BUDGET_S = envs.define(
    "CUDA_GRAPH_RUNNER_COMPILED_BUDGET_S",
    "optional_count",
    None,
    "compiled: seconds of compilation per backend after which the remaining sizes run eagerly "
    "(unset: 600). Read when a CompiledBackend is built without compile_budget_s.",
    owner=_OWNER,
).name

# Never the runner's default (no default_for): compiling costs tens of seconds per size
# on a small CPU. `cuda-graph-runner bench` picks it on the CPU by name (cuda_graph_runner.cli.bench.command).
cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="compiled",
        backend_class="cuda_graph_runner_compiled.backend:CompiledBackend",
        phases=("decode",),
        devices=("cpu",),
        probe=probe,
        api_version="1.1",
        # options: none read; always inductor (tc_compiler's default 'eager' would gain nothing here)
        description="torch.compile (inductor) of the forward per batch-size bucket, no device graph (CPU)",
    )
)

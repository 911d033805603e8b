"""Registration module named by the entry point: hooks and the probe only.

Importing it imports neither torch nor torch_npu nor the backend class, so discovery
(``cuda-graph-runner backends``, ``resolve_*_backend`` of another backend) never pays
for torch_npu and never breaks when torch_npu is broken. The probe imports torch_npu
lazily, when the registry asks whether ``npu`` can run.
"""

from __future__ import annotations

from typing import Optional

from cuda_graph_runner.backend import BackendSpec, backend_hooks

BACKEND_NAME = "npu"
DEVICE_TYPE = "npu"


# On an ``npu`` device the default decode backend is ``npu``; elsewhere it passes.
cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name=BACKEND_NAME,
        backend_class="cuda_graph_runner_npu.backend:NPUCudaGraphBackend",
        phases=("decode",),
        devices=(DEVICE_TYPE,),
        probe="cuda_graph_runner_npu.plugin:probe",
        # A literal: the plugin API this plugin was written for (not the core's constant).
        api_version="1.1",
        # options: none read (tc_compiler is tc_piecewise's)
        description="torch_npu NPUGraph per batch size, shared pool, update-then-replay of host seq lens",
    ),
    default_for=[("decode", DEVICE_TYPE)],
)


def probe(device_type: str) -> Optional[str]:
    """None when NPU graphs can be captured on ``device_type``, else why not (one line).

    Reasons, most basic first: not an ``npu`` device; torch_npu not installed;
    installed but its import fails (the cause is quoted); its graph API lacks what the
    backend calls; no NPU device visible. See
    :func:`cuda_graph_runner_npu.torch_npu_api.unavailable_reason`.
    """
    if device_type != DEVICE_TYPE:
        return f"needs an Ascend NPU device ('npu'), not {device_type!r}"
    from .torch_npu_api import unavailable_reason

    return unavailable_reason()

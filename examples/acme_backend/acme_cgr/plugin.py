"""Registration module named by the entry point: hooks only, no torch, no backend import.

Listing backends imports this module in every process that looks for backends, so it
must stay cheap and must not fail: the backend class is referred to by a string.
"""

from __future__ import annotations

from typing import Optional

from cuda_graph_runner.backend import BackendSpec, backend_hooks

#: The plugin API version this plugin was written for, as a literal: importing the
#: core's PLUGIN_API_VERSION here would always match and defeat the handshake.
API_VERSION = "1.1"


# The two hooks for one backend. A debugging backend is never anyone's default (no
# default_for): it must be asked for by name.
cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
    BackendSpec(
        name="acme",
        backend_class="acme_cgr.backend:AcmeDebugBackend",
        # Both phases: replay runs the capture plan's forward on the live static batch.
        phases=("decode", "prefill"),
        devices=("*",),
        probe="acme_cgr.plugin:probe",
        api_version=API_VERSION,
        # options: none read (tc_compiler is tc_piecewise's)
        description="eager replay with call counts and graph-invariant checks (debugging, any device)",
    )
)


def probe(device_type: str) -> Optional[str]:
    """None when ``acme`` can run on ``device_type`` (any device torch knows), else why not."""
    import torch

    try:
        torch.device(device_type)
    except RuntimeError as exc:
        return f"torch does not know device type {device_type!r}: {exc}"
    return None

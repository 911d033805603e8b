"""Availability probes plugins can name in their ``BackendSpec`` (torch imported lazily).

A probe returns None when the backend can run on ``device_type``, else one line saying
why not; ``cuda-graph-runner backends`` shows that line.
"""

from __future__ import annotations

from typing import Optional


def cuda_graphs(device_type: str) -> Optional[str]:
    """None when CUDA graphs can be captured on ``device_type`` here, else why not."""
    import torch

    if device_type != "cuda":
        return f"needs a CUDA device, not {device_type!r}"
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        return f"torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False)"
    return None

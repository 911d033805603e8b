"""Checks of a runner's constructor arguments: the device to capture on, the backend
argument. (The config argument is converted by :func:`cuda_graph_runner.config.as_config`.)"""

from __future__ import annotations

from typing import Any

import torch

from ..backend import BaseCudaGraphBackend


def model_device(model: Any, runner: str) -> torch.device:
    """The device of ``model``'s first parameter, else of its first buffer.

    Raises:
        ValueError: the model has neither (no silent CPU fallback: a CUDA model without
            parameters would otherwise be captured on the CPU).
    """
    for attr in ("parameters", "buffers"):
        tensors = getattr(model, attr, None)
        if callable(tensors):
            try:
                first = next(iter(tensors()), None)
            except TypeError:
                first = None
            if isinstance(first, torch.Tensor):
                return first.device
    raise ValueError(
        f"{runner}: cannot tell which device to capture on: the model ({type(model).__name__}) has no "
        "parameters or buffers; pass device=, e.g. device='cuda:0'"
    )


def check_backend_arg(backend: Any) -> None:
    """Raises TypeError for a ``backend=`` that is not an instance, a name or None."""
    if backend is None or isinstance(backend, (str, BaseCudaGraphBackend)):
        return
    accepted = (
        "a backend instance (a BaseCudaGraphBackend subclass, built with its device and phase), "
        "a backend name (a str such as 'full'), or None for the config's backend"
    )
    if isinstance(backend, type) and issubclass(backend, BaseCudaGraphBackend):
        raise TypeError(f"backend={backend.__name__} is a backend class, not an instance; pass {accepted}")
    raise TypeError(f"backend={backend!r} ({type(backend).__name__}) is not accepted; pass {accepted}")

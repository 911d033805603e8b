"""Checks of a runner's constructor arguments: the device to capture on, the backend
argument and who owns a backend instance. (The config argument is converted by
:func:`cuda_graph_runner.config.as_config`.)"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..backend.base import BaseCudaGraphBackend


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


#: Where a backend instance keeps a weak reference to the runner that owns it.
_OWNER = "_cuda_graph_runner_owner"


def describe_runner(runner: Any) -> str:
    """``"DecodeCudaGraphRunner(decode, model ToyModel) at 0x7f.."``: names one runner in errors."""
    # A decode runner is told apart by its forward mode (decode, target_verify, ...); a
    # prefill runner by its phase (its mode is always extend).
    phase = getattr(runner, "phase", "?")
    mode = getattr(runner, "mode", None) if phase == "decode" else None
    what = getattr(mode, "value", None) or phase
    return f"{type(runner).__name__}({what}, model {type(getattr(runner, 'model', None)).__name__}) at {id(runner):#x}"


def claim_backend(backend: BaseCudaGraphBackend, runner: Any) -> None:
    """Make ``runner`` the owner of ``backend`` (at construction and before each capture).

    A backend holds one runner's capture plan, graphs and outputs, so a second runner
    capturing on the same instance would make the first replay with the second's model
    and plan. The owner is kept as a weak reference; an instance whose owner is gone or
    holds no captured graph (never captured, failed, or ``cleanup()``) can be taken.

    Raises:
        ValueError: another live runner owns ``backend`` and holds graphs on it (names
            both runners).
    """
    ref = backend.__dict__.get(_OWNER)
    owner = ref() if ref is not None else None
    if owner is not None and owner is not runner and getattr(owner, "captured_keys", None):
        label = backend.name or type(backend).__name__
        raise ValueError(
            f"backend instance {label!r} ({type(backend).__name__} at {id(backend):#x}) already belongs to "
            f"{describe_runner(owner)}, which holds {len(owner.captured_keys)} captured graphs on it; "
            f"{describe_runner(runner)} cannot use it too: a backend keeps one runner's capture plan and graphs. "
            "Give each runner its own instance (build another one, or pass a backend name)"
        )
    backend.__dict__[_OWNER] = weakref.ref(runner)

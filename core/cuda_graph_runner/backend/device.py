"""Device helpers that always name the device: guard, synchronize, new stream.

A runner on ``cuda:1`` must capture and replay on ``cuda:1`` whatever the current
device is. Anything that relies on the *current* device goes wrong there: a
``Stream()`` made on device 0 captures nothing of the model's kernels (torch warns "The
CUDA Graph is empty"), a ``synchronize()`` waits on the wrong device, and
``torch.cuda.graph`` itself synchronizes and empties the cache of the current device on
entry. These helpers take the device explicitly and work through the device module
(``torch.cuda``, ``torch.npu``, a test fake), never a ``torch.cuda`` literal.

Borrowed: PyTorch's ``torch.cuda.device`` guard and ``torch.cuda.stream`` context (which
switches to the stream's device); sglang's graph runner, which keeps every capture
inside ``torch.cuda.device(model_runner.device)``-scoped code with streams created for
that device.

Stream semantics: graphs replay on the *caller's current stream of the runner's
device* (``CUDAGraph.replay`` launches on the current stream of the graph's device), so
an engine that enqueues the next batch's preparation on its own stream while the device
is busy (overlap scheduling) keeps its ordering; nothing here synchronizes on replay.
"""

from __future__ import annotations

import contextlib
from typing import Any, ContextManager, Optional

import torch


def device_module_of(device: "torch.device | str", device_module: Optional[Any] = None) -> Any:
    """``device_module`` if given, else ``torch.get_device_module(device)``."""
    return device_module if device_module is not None else torch.get_device_module(torch.device(device))


def resolve_device(device: "torch.device | str", device_module: Optional[Any] = None) -> torch.device:
    """``device`` with its index filled in from the module's current device.

    ``"cuda"`` means "the current device" at the moment of each call; the runner resolves
    it once so that a later change of the current device does not move its graphs.
    The CPU (and a module without ``current_device``) stays as given.
    """
    device = torch.device(device)
    if device.index is not None or device.type == "cpu":
        return device
    try:
        current = getattr(device_module_of(device, device_module), "current_device", None)
        index = current() if current is not None else None
    except Exception:  # no such device in this build (CUDA on a CPU-only torch): keep it as given
        return device
    return device if index is None else torch.device(device.type, index)


def device_guard(device: "torch.device | str", device_module: Optional[Any] = None) -> ContextManager[Any]:
    """``device_module.device(device)``: makes ``device`` current for the block, then
    restores the previous current device (a no-op on the CPU, for an index-less device,
    or where the module has no ``device`` guard)."""
    device = torch.device(device)
    if device.type == "cpu" or device.index is None:
        return contextlib.nullcontext()
    guard = getattr(device_module_of(device, device_module), "device", None)
    if guard is None:
        return contextlib.nullcontext()
    return guard(device)


def synchronize(device: "torch.device | str", device_module: Optional[Any] = None) -> None:
    """Wait for all work on ``device`` (only that device; the CPU has nothing to wait on
    unless a module is given, e.g. a recording fake)."""
    device = torch.device(device)
    if device.type == "cpu" and device_module is None:
        return
    device_module_of(device, device_module).synchronize(device)


def new_stream(device: "torch.device | str", device_module: Optional[Any] = None) -> Any:
    """A new side stream on ``device`` (``device_module.Stream(device=device)``), or None
    on the CPU or where the module has no streams.

    A module whose ``Stream`` takes no ``device`` argument gets one made under a device
    guard instead.
    """
    device = torch.device(device)
    module = device_module_of(device, device_module)
    stream_cls = getattr(module, "Stream", None)
    if stream_cls is None or device.type == "cpu":
        return None
    try:
        return stream_cls(device=device)
    except TypeError:
        with device_guard(device, module):
            return stream_cls()

"""The host-value guard: reading a batch's host values where a graph would freeze them is an error.

Whatever Python runs while a graph is recorded is frozen into it: a branch on
``max(batch.seq_lens_cpu)`` takes the path of the capture's dummy lengths at every replay,
with no error (the same kind of bug makes Hugging Face ``LlamaForCausalLM`` with a static
cache replay wrong tokens: its mask code branches on host values). The runner therefore
hands the model a :class:`~cuda_graph_runner.backend.forward_batch.StaticForwardBatch` whose host
fields are guarded properties, and turns the guard on while the backend records:

========================  =====================================================================
backend scope             where a host read is an error
========================  =====================================================================
``"forward"``             the whole captured forward, marked ops included (``full``, ``npu``
                          without host-input updates, and any backend that does not say
                          otherwise: a vendor backend gets the strictest rule by default)
``"outside_marked_ops"``  the captured forward except inside marked ops
                          (:func:`cuda_graph_runner.backend.graph_break.eager_op`), which run eagerly
                          at replay on the live batch (``breakable``; ``npu`` with updates);
                          an op ``breakable`` records because it is declared capture-safe
                          for the batch's mode stays guarded (it runs without the lift)
``"trace"``               only while torch.compile traces the forward (``tc_piecewise``:
                          the traced pieces replay without Dynamo; the marked ops and the
                          decode LM head run eagerly)
``"off"``                 nowhere (``disabled``: everything runs eagerly)
========================  =====================================================================

A backend states its scope in its ``host_value_guard`` attribute
(:class:`~cuda_graph_runner.backend.BaseCudaGraphBackend`). Reads on the eager path, in
``init_forward_metadata_capture`` / ``init_forward_metadata_replay`` hooks (they run
before the recorded forward) and at replay time are always free. A user turns the guard
off per phase with the config key ``host_value_guard: false`` (then verify mode, in
:mod:`cuda_graph_runner.runner.verify`, is the way to find what replays wrong).

Guarded fields: ``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu``,
and the *host values* in ``extra``: Python numbers and bools, lists and tuples, numpy
arrays, and tensors on another device than the batch's ``input_ids`` (on a CPU runner a
CPU tensor is a device tensor). A key the captured code looks up in ``extra`` and
does not find (``extra.get("temperature", 1.0)``: the capture batch's ``extra`` holds only
the model's declared static inputs) is remembered; a live batch whose ``extra`` holds it
raises :class:`~cuda_graph_runner.backend.errors.CudaGraphHostValueError` naming the key at replay
instead of replaying the capture-time default. Strings, ``None``, device tensors and other objects in
``extra`` are not guarded (an engine keeping host values inside its own objects is not
seen: put them in ``extra`` directly, or read them only inside marked ops).

Under torch.compile the check is marked ``assume_constant_result``, so Dynamo runs it for
real while tracing (an error surfaces through Dynamo's, and ``tc_piecewise`` unwraps it).
The idea of failing loudly where Python is frozen follows vLLM's and sglang's warnings
about CPU-side state in captured graphs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import numbers
import threading
from collections.abc import MutableMapping
from typing import Any, Iterator, Optional

import torch

from .errors import CudaGraphHostValueError

SCOPE_FORWARD = "forward"
SCOPE_OUTSIDE_MARKED_OPS = "outside_marked_ops"
SCOPE_TRACE = "trace"
SCOPE_OFF = "off"
SCOPES = (SCOPE_FORWARD, SCOPE_OUTSIDE_MARKED_OPS, SCOPE_TRACE, SCOPE_OFF)

#: The host-side fields of ``ForwardBatch`` the guard watches (``extra`` is handled per value).
HOST_FIELDS = ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")

__all__ = [
    "HOST_FIELDS",
    "SCOPES",
    "GuardedExtra",
    "check_host_read",
    "guard_engaged",
    "host_value_guard",
    "is_host_value",
    "missing_extra_error",
    "note_missing_extra",
    "run_marked_op",
]


@dataclasses.dataclass
class _Guard:
    backend: str
    phase: str
    scope: str
    lifted: int = 0
    missing_extra: Optional[set] = None


class _Local(threading.local):
    guard: Optional[_Guard] = None


_local = _Local()


@contextlib.contextmanager
def host_value_guard(backend: str, phase: str, scope: str, missing_extra: Optional[set] = None) -> Iterator[None]:
    """Guard host reads of static batches in this thread for the block (the runner's job).

    Args:
        backend: backend name, for the message.
        phase: ``"decode"`` or ``"prefill"``, for the message.
        scope: one of :data:`SCOPES` (``"off"`` leaves reads free).
        missing_extra: a set that collects the ``extra`` keys the guarded code looked up
            and did not find (``extra.get(k, default)``, ``k in extra``): the graph keeps
            what the model did without them, so a live batch holding one must not replay
            (:func:`missing_extra_error`).

    Raises:
        ValueError: an unknown scope (the message lists the accepted ones).
    """
    if scope not in SCOPES:
        raise ValueError(
            f"backend {backend!r}: host_value_guard={scope!r} is not a scope; accepted: " + ", ".join(SCOPES)
        )
    previous = _local.guard
    _local.guard = None if scope == SCOPE_OFF else _Guard(backend, phase, scope, missing_extra=missing_extra)
    try:
        yield
    finally:
        _local.guard = previous


def run_marked_op(fn: Any, args: tuple, kwargs: dict) -> Any:
    """``fn(*args, **kwargs)`` with the host-value guard lifted while a marked op's body runs
    (graph_break wraps every marked op in it), unless the backend's scope is ``"forward"``
    (it records marked ops into the graph too). A plain call, not a context manager:
    marked ops run once per layer at every breakable / tc_piecewise replay."""
    guard = _local.guard
    if guard is None or guard.scope == SCOPE_FORWARD:
        return fn(*args, **kwargs)
    guard.lifted += 1
    try:
        return fn(*args, **kwargs)
    finally:
        guard.lifted -= 1


def _armed(guard: Optional[_Guard]) -> bool:
    if guard is None or guard.lifted:
        return False
    return guard.scope != SCOPE_TRACE or _dynamo_tracing()


def _dynamo_tracing() -> bool:
    # Called for real by Dynamo (assume_constant_result) while it traces. torch >= 2.12 sets
    # is_compiling() then; torch 2.11 does not, but its tracing context is active.
    if torch.compiler.is_compiling():
        return True
    try:
        from torch._guards import TracingContext
    except ImportError:  # a torch without it: is_compiling() is all there is
        return False
    return TracingContext.try_get() is not None


@torch.compiler.assume_constant_result
def guard_engaged() -> bool:
    """True when a host read here and now would raise (under Dynamo: evaluated for real)."""
    return _armed(_local.guard)


@torch.compiler.assume_constant_result
def check_host_read(field: str) -> None:
    """Called by every guarded read; raises where the read would be frozen into a graph.

    Raises:
        CudaGraphHostValueError: names the field, the backend, the phase and the fixes.
    """
    guard = _local.guard
    if guard is None or not _armed(guard):
        return
    raise CudaGraphHostValueError(_message(field, guard), field=field, backend=guard.backend, phase=guard.phase)


@torch.compiler.assume_constant_result
def note_missing_extra(key: Any) -> bool:
    """Called by a guarded ``extra`` lookup that found no ``key``: remembers it where the
    lookup would be frozen into a graph (under Dynamo: evaluated for real). Returns True."""
    guard = _local.guard
    if guard is not None and guard.missing_extra is not None and _armed(guard):
        guard.missing_extra.add(key)
    return True


def missing_extra_error(key: Any, backend: str, phase: str) -> CudaGraphHostValueError:
    """The error for a live batch whose ``extra[key]`` the captured graph looked up and did
    not find at capture (it would replay with what the model did without it)."""
    return CudaGraphHostValueError(
        f"the live batch's extra holds {key!r}, which the model looked up during capture and did not find "
        f"(backend {backend!r}, phase {phase!r}): the graph keeps what the model did without it (a default such "
        f"as extra.get({key!r}, default)) and a replay would silently ignore the live value. Fixes: declare it "
        "as a static input (model.static_inputs(), cuda_graph_runner.runner.StaticInput), which the runner "
        "copies into a buffer the graph reads; or read it only inside an op marked with "
        "cuda_graph_runner.backend.graph_break.eager_op (with a backend that runs marked ops eagerly) or in "
        "init_forward_metadata_replay; or leave it out of the extra of batches that replay",
        field=f"extra[{key!r}]",
        backend=backend,
        phase=phase,
    )


def _message(field: str, guard: _Guard) -> str:
    where = {
        SCOPE_FORWARD: "during capture (this backend records the whole forward, marked ops included)",
        SCOPE_OUTSIDE_MARKED_OPS: "during capture, outside a marked eager op (only marked ops run again at replay)",
        SCOPE_TRACE: "while torch.compile traces the forward (the traced pieces replay without re-running Python)",
    }[guard.scope]
    return (
        f"the model read the host value ForwardBatch.{field} {where}; backend {guard.backend!r}, phase "
        f"{guard.phase!r}. The graph would keep the value (and any branch on it) of the capture's dummy batch "
        "and every replay would silently reuse it. Fixes: compute it from the device tensors (seq_lens, "
        "extend_seq_lens, extend_prefix_lens) with tensor ops; or move the read into an op marked with "
        "cuda_graph_runner.backend.graph_break.eager_op and use a backend that runs marked ops eagerly at replay "
        "(breakable, tc_piecewise); or read it in init_forward_metadata_capture/replay. To capture anyway, set "
        f"the config key {guard.phase}.host_value_guard to false (then check replays with verify mode). "
        "Copying the batch counts as reading every field: use batch.replace(...), not dataclasses.replace."
    )


def is_host_value(value: Any, device: Optional[torch.device]) -> bool:
    """The ``extra`` rule: Python numbers/bools, lists, tuples, numpy arrays, and tensors on
    another device than ``device`` are host values; anything else is not."""
    if isinstance(value, torch.Tensor):
        return device is not None and not _same_device(value.device, device)
    if isinstance(value, (numbers.Number, list, tuple)):
        return True
    return type(value).__module__ == "numpy" and type(value).__name__ == "ndarray"


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index is None or b.index is None or a.index == b.index


class GuardedExtra(MutableMapping):
    """What ``StaticForwardBatch.extra`` returns while a guard is engaged: the same dict,
    whose host values (:func:`is_host_value`) raise on read; a lookup of a key it lacks is
    remembered (:func:`note_missing_extra`); writes go through."""

    __slots__ = ("_data", "_device")

    def __init__(self, data: dict, device: Optional[torch.device]) -> None:
        self._data = data
        self._device = device

    def __getitem__(self, key: Any) -> Any:
        try:
            value = self._data[key]
        except KeyError:
            note_missing_extra(key)  # .get(key, default) and .pop(key, default) come here too
            raise
        if is_host_value(value, self._device):
            check_host_read(f"extra[{key!r}]")
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._data[key] = value

    def __delitem__(self, key: Any) -> None:
        del self._data[key]

    def __iter__(self) -> Iterator[Any]:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Any) -> bool:
        if key in self._data:
            return True
        note_missing_extra(key)
        return False

    def __repr__(self) -> str:
        return f"GuardedExtra(keys={list(self._data)!r})"

"""Graph memory before the KV cache is sized: a real capture against the smallest KV cache
that has the engine's ``max_reqs`` and ``max_context_len``.

An engine sizes its KV cache from the device memory left after the graphs, but the
graphs are captured after the cache exists. Graph memory depends on the batch sizes,
the model and the attention backend's metadata (tables ``[max_reqs, max_context_len]``,
split-KV workspaces sized by the context), not on how many KV slots the cache has. So
:func:`estimate_graph_memory` attaches a cache with those two dimensions and the fewest
slots (2: the reserved padding slot 0 and one more; every capture writes its KV into
slot 0), captures every size of every phase the config enables, exactly as the real
runners will (same backends, same sizes, same pool, decode then prefill), measures, and
gives everything back (graphs, pool, the model's capture state, the small cache; the
model's previous ``kv_cache`` is put back).

What is measured, per phase and in total (CUDA; :class:`GraphMemoryEstimate`):

* ``pool_bytes``: the growth of the shared graph memory pool (caching-allocator
  snapshot, :func:`cuda_graph_runner.backend.pool.pool_memory_bytes`), the memory
  ``runner.graph_memory_bytes()`` reports after the real capture. Phases share the pool
  and prefill reuses blocks decode freed, so the total is less than the phases' sum
  would be apart.
* ``outside_pool_bytes``: what the capture kept allocated outside the pool: the runner's
  static input buffers (``static_buffer_bytes`` of it) and the state the model's
  attention capture hooks (``init_forward_metadata_capture``) allocate with torch
  (wrappers' index buffers, workspaces). Counted from ``memory_reserved`` less the pool.
  Memory a hook takes outside torch's allocator (a library's own ``cudaMalloc``) and the
  driver's graph objects are not in it; ``device_bytes`` (the drop of free device memory,
  ``mem_get_info``, over the whole estimate) covers them and everything else.

``outside_pool_counted`` says whether the device could tell (False on the CPU and on
devices without ``memory_reserved``/``mem_get_info``; then only the backend's own
``graph_memory_bytes`` is reported, or None). Measure in a process where nothing else
allocates on the device meanwhile.

Idea: vLLM profiles graph memory before sizing the KV cache
(``profile_cudagraph_memory``) by capturing a sample into a throwaway pool and
extrapolating, which its users report wrong both ways (vllm-project/vllm#45178, #57475);
here nothing is extrapolated: every size is captured once.
"""

from __future__ import annotations

import dataclasses
import numbers
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

import torch

from ..config import ConfigInput, Phase, as_config
from .capture_report import device_memory_info

#: KV slots of the estimate's cache: the reserved padding slot 0 and one more.
FEWEST_SLOTS = 2


@dataclasses.dataclass
class PhaseEstimate:
    """Graph memory of one phase, in capture order after the phases before it.

    Attributes:
        phase, backend: the phase and its backend name (``"disabled"``: nothing captured).
        sizes: the sizes captured, descending.
        pool_bytes: growth of the shared graph pool (bytes); None where the device cannot tell.
        outside_pool_bytes: growth of memory kept outside the pool (static buffers, the
            attention hooks' capture state); None where the device cannot tell.
        static_buffer_bytes: the runner's static input buffers (part of ``outside_pool_bytes``).
        seconds: wall time of the capture.
    """

    phase: str
    backend: str
    sizes: List[int]
    pool_bytes: Optional[int]
    outside_pool_bytes: Optional[int]
    static_buffer_bytes: int
    seconds: float


@dataclasses.dataclass
class GraphMemoryEstimate:
    """What :func:`estimate_graph_memory` measured (bytes).

    Attributes:
        phases: per phase, in capture order (decode, then prefill).
        pool_bytes: the shared graph pool after every phase (the graph memory proper).
        outside_pool_bytes: memory kept outside the pool by every phase.
        device_bytes: the drop of free device memory (``mem_get_info``) from before the
            first runner to after the last capture: everything the graphs cost.
        outside_pool_counted: whether ``outside_pool_bytes`` and ``device_bytes`` were
            measured (False: the device cannot tell; they are None).
        max_reqs, max_context_len, num_slots: the KV cache the capture ran against.
    """

    phases: Dict[str, PhaseEstimate]
    pool_bytes: Optional[int]
    outside_pool_bytes: Optional[int]
    device_bytes: Optional[int]
    outside_pool_counted: bool
    max_reqs: int
    max_context_len: int
    num_slots: int

    @property
    def total_bytes(self) -> Optional[int]:
        """Pool plus outside-pool bytes (the pool alone where outside is not counted)."""
        if self.pool_bytes is None:
            return None
        return self.pool_bytes + (self.outside_pool_bytes or 0)

    def to_dict(self) -> Dict[str, Any]:
        """Plain JSON."""
        out = dataclasses.asdict(self)
        out["total_bytes"] = self.total_bytes
        return out


def _dimension(value: Any, name: str, smallest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < smallest:
        raise ValueError(f"{name}={value!r}: expected an integer >= {smallest}")
    return int(value)


def _reserved(module: Any, device: torch.device) -> Optional[int]:
    reserved = getattr(module, "memory_reserved", None) if module is not None else None
    if reserved is None or device.type == "cpu":
        return None
    try:
        return int(reserved(device))
    except Exception:  # a measurement never breaks the estimate
        return None


def _empty_cache(module: Any) -> None:
    empty = getattr(module, "empty_cache", None) if module is not None else None
    if empty is not None:
        empty()


def _device_and_module(model: Any, device: Any, backends: Optional[Mapping[str, Any]]) -> tuple:
    """The device the estimate's runners capture on and its device module (a backend
    instance's own, which may be a test fake), known before any runner allocates."""
    from ..backend.base import BaseCudaGraphBackend
    from ..backend.device import resolve_device
    from .arguments import model_device

    for backend in (backends or {}).values():
        if isinstance(backend, BaseCudaGraphBackend):
            dev = backend.device
            return dev, (backend.device_module if dev.type != "cpu" else None)
    dev = resolve_device(device) if device is not None else model_device(model, "estimate_graph_memory")
    return dev, (torch.get_device_module(dev) if dev.type != "cpu" else None)


def _runner_class(phase: str) -> Any:
    from . import DecodeCudaGraphRunner, PrefillCudaGraphRunner

    return DecodeCudaGraphRunner if phase == Phase.DECODE else PrefillCudaGraphRunner


def estimate_graph_memory(
    model: Any,
    config: ConfigInput = None,
    *,
    max_reqs: int,
    max_context_len: int,
    phases: Optional[Sequence[str]] = None,
    device: "torch.device | str | None" = None,
    backends: Optional[Mapping[str, Any]] = None,
    make_kv_cache: Optional[Callable[..., Any]] = None,
    num_slots: int = FEWEST_SLOTS,
) -> GraphMemoryEstimate:
    """Capture every size of each phase against a KV cache of ``max_reqs`` request rows
    and ``max_context_len`` tokens per request with ``num_slots`` slots, measure the
    graph memory and give it all back (see the module docstring).

    Args:
        model: a :class:`~cuda_graph_runner.runner.model_protocol.GraphModel` with
            ``create_kv_cache(num_slots=, max_reqs=, max_context_len=)`` that attaches the
            cache as ``model.kv_cache`` (the reference model's), unless ``make_kv_cache``
            is given.
        config: the config the real runners will get (any form ``as_config`` takes).
        max_reqs, max_context_len: the KV cache's request rows and tokens per request,
            as the engine will pass them to ``create_kv_cache``.
        phases: the phases to capture, in order; None: decode and prefill (a phase whose
            backend resolves to ``disabled`` captures nothing and counts 0).
        device: as the runners' ``device``.
        backends: ``{phase: backend instance or name}`` as the runners' ``backend``
            (instances: each is used by one estimate runner and cleaned up after).
        make_kv_cache: ``(num_slots, max_reqs, max_context_len) -> cache`` attaching
            it to the model, instead of ``model.create_kv_cache``.
        num_slots: KV slots (default :data:`FEWEST_SLOTS`).

    Returns:
        A :class:`GraphMemoryEstimate`.

    Raises:
        ValueError: ``max_reqs``/``max_context_len`` not an int >= 2 / >= 1, an unknown phase.
        TypeError: the model cannot make a KV cache and ``make_kv_cache`` is None.
        What the runners' construction and ``capture()`` raise (the graphs made so far
        are given back first).
    """
    max_reqs = _dimension(max_reqs, "max_reqs", 2)
    max_context_len = _dimension(max_context_len, "max_context_len", 1)
    num_slots = _dimension(num_slots, "num_slots", FEWEST_SLOTS)
    order = list(phases) if phases is not None else [Phase.DECODE, Phase.PREFILL]
    for phase in order:
        if phase not in Phase.ALL:
            raise ValueError(f"phase {phase!r}: expected one of {', '.join(Phase.ALL)}")
    create = make_kv_cache
    if create is None:
        method = getattr(model, "create_kv_cache", None)
        if not callable(method):
            raise TypeError(
                f"{type(model).__name__} has no create_kv_cache(num_slots=, max_reqs=, max_context_len=): "
                "pass make_kv_cache=, a function of (num_slots, max_reqs, max_context_len) that attaches a cache"
            )

        def create(slots: int, reqs: int, context: int) -> Any:
            return method(num_slots=slots, max_reqs=reqs, max_context_len=context)

    cfg = as_config(config, order[0] if order else Phase.DECODE)  # a one-phase form: the first phase
    had_cache = hasattr(model, "kv_cache")
    previous_cache = getattr(model, "kv_cache", None)
    runners: List[Any] = []
    results: Dict[str, PhaseEstimate] = {}
    try:
        create(num_slots, max_reqs, max_context_len)
        dev, module = _device_and_module(model, device, backends)
        _empty_cache(module)
        free_before, _ = device_memory_info(dev, module)
        pool_so_far = 0  # the shared pool before this phase
        for phase in order:
            backend = backends.get(phase) if backends else None
            kwargs: Dict[str, Any] = {"backend": backend, "show_progress": False}
            if device is not None:
                kwargs["device"] = device
            reserved_before = _reserved(module, dev)
            runner = _runner_class(phase)(model, cfg, **kwargs)
            runners.append(runner)
            pool_before = runner.backend.graph_memory_bytes()
            pool_before = pool_so_far if pool_before is None else pool_before
            start = time.perf_counter()
            runner.capture()
            runner.capture_step(None)  # capture eager_first: the estimate needs every graph
            seconds = time.perf_counter() - start
            pool_after = runner.backend.graph_memory_bytes()
            pool = None if pool_after is None else pool_after - pool_before
            if runner.is_disabled:
                pool = 0
            elif pool_after is not None:
                pool_so_far = pool_after
            reserved_after = _reserved(module, dev)
            outside = (
                None
                if reserved_before is None or reserved_after is None
                else reserved_after - reserved_before - (pool or 0)
            )
            results[phase] = PhaseEstimate(
                phase=phase,
                backend=runner.backend.name,
                sizes=runner._captured_sizes(),
                pool_bytes=pool,
                outside_pool_bytes=outside,
                static_buffer_bytes=runner.buffers.nbytes(),
                seconds=seconds,
            )
        free_after, _ = device_memory_info(dev, module)
        known = [p for p in (r.backend.graph_memory_bytes() for r in runners if not r.is_disabled) if p is not None]
        outside_all = [p.outside_pool_bytes for p in results.values()]
        counted = bool(results) and all(o is not None for o in outside_all) and free_after is not None
        return GraphMemoryEstimate(
            phases=results,
            # One shared pool: each backend reports all of it.
            pool_bytes=max(known) if known else (0 if all(r.is_disabled for r in runners) else None),
            outside_pool_bytes=sum(o for o in outside_all if o is not None) if counted else None,
            device_bytes=(free_before - free_after) if counted and free_before is not None else None,
            outside_pool_counted=counted,
            max_reqs=max_reqs,
            max_context_len=max_context_len,
            num_slots=num_slots,
        )
    finally:
        # Give everything back, last runner first, whatever failed: graphs, pool, the
        # model's capture state, the small cache.
        give_back = None
        for runner in reversed(runners):
            give_back = runner._graph_device()[1]
            runner.cleanup()
        runners.clear()
        if had_cache:
            model.kv_cache = previous_cache
        else:
            try:
                del model.kv_cache
            except AttributeError:
                pass
        _empty_cache(give_back)

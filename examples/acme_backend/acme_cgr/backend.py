"""``AcmeDebugBackend``: graph semantics without a graph, for debugging runners and models.

``capture_one`` does what a graph backend does before recording (warm-ups, the
post-warm-up hook) and then runs the forward once, keeping its output tensors;
``replay`` runs the forward on the live static batch and copies the result into those
same tensors,
so callers see the aliasing a real graph gives them (every replay overwrites the
previous output). Along the way it checks the invariants a real device graph silently
depends on, and raises where a graph would have produced garbage:

* the replayed output has the captured structure, shapes and dtypes;
* the static batch a runner replays a key with keeps its tensors at the same addresses
  (a graph bakes addresses in at capture);
* nothing is replayed that was not captured, nor captured twice without ``cleanup()``.

It also counts warm-ups, captures and replays per shape (:attr:`stats`), which is how
a runner's policy (sizes, padding, eager fallback) can be checked on any device,
including the CPU.

A replay runs the runner's forward (the capture plan's) on the live static batch, so
``acme`` serves decode and prefill alike.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from cuda_graph_runner.backend import (
    BaseCudaGraphBackend,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
    iter_tensors,
    map_pairs,
)

#: Static-batch fields whose addresses must not change between replays of one key, per
#: phase: decode keys by batch size, so the per-request tensors live in static buffers
#: too; prefill keys by token count, and its per-request tensors vary with the batch.
STATIC_FIELDS = {
    "decode": ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"),
    "prefill": ("input_ids", "positions", "out_cache_loc"),
}


class GraphInvariantError(RuntimeError):
    """What a real device graph would have silently got wrong."""


class AcmeDebugBackend(BaseCudaGraphBackend):
    """Eager "replay" that counts calls and checks graph invariants.

    What it writes itself is only what is its own (plugin API 1.1): the base class keeps
    the table of captured keys and outputs (``graph_table``: the "already captured"
    ``ValueError``, the ``KeyError`` of an unknown key), ``can_run``, ``cleanup``,
    ``captured_keys``, the warm-up loop and the replay session.

    What a replay runs: inside a runner, the runner's forward on the live static batch,
    ``self.capture_plan.forward(static_batch)`` (the runner enters the forward context).
    Never the ``forward_fn`` given to ``capture_one``: that closure is bound to the
    capture-time dummy batch, so re-running it would compute the dummy batch again
    (invisible in decode, whose inputs all live in the static buffers; wrong in prefill,
    whose per-request lengths live in the batch). Only outside a runner (no capture plan:
    unit tests driving the backend by hand) does a replay re-run ``forward_fn``.

    Attributes:
        stats: ``Counter`` of ``("warmup" | "capture" | "replay", key)`` and
            ``("post_warmup_hook", key)``; ``stats_total(kind)`` sums one kind.
    """

    #: Every replay re-runs the forward's Python on the live batch: nothing is frozen, so
    #: host reads (prefill's per-request lengths) are free (cuda_graph_runner.backend.host_guard).
    host_value_guard = "off"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._addresses: Dict[ShapeKey, Tuple[Tuple[str, int], ...]] = {}
        self._in_session = False
        self.stats: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        with self.bind_capture_stream(stream):
            self._in_session = True
            try:
                yield
            finally:
                self._in_session = False

    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up (the base loop, counted), run ``forward_fn`` once and keep its output.

        Raises:
            GraphInvariantError: outside ``capture_session``.
        """
        if not self._in_session:
            raise GraphInvariantError(
                f"capture_one({key}) outside capture_session(): a graph needs its stream and pool"
            )
        self.graph_table.check_new(key)

        def counted_warmup() -> Any:
            self.stats["warmup", key] += 1
            return forward_fn()

        def counted_hook() -> None:
            self.stats["post_warmup_hook", key] += 1
            post_warmup_hook()  # type: ignore[misc]

        self.warm_up(counted_warmup, counted_hook if post_warmup_hook is not None else None, key=key)
        self.stats["capture", key] += 1
        # Kept as the "graph" only for replays outside a runner (see the class docstring).
        self.graph_table.add(key, forward_fn, forward_fn())

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Run the forward on ``static_batch`` into ``key``'s captured output tensors.

        Raises:
            KeyError: ``key`` was not captured.
            GraphInvariantError: the static inputs moved, or the output changed shape.
        """
        captured_fn, output = self.graph_table.get(key)
        addresses = tuple(
            (f, getattr(static_batch, f).data_ptr())
            for f in STATIC_FIELDS.get(self.phase, STATIC_FIELDS["decode"])
            if isinstance(getattr(static_batch, f, None), torch.Tensor)
        )
        first = self._addresses.setdefault(key, addresses)
        if addresses != first:
            moved = [f for (f, a), (_, b) in zip(first, addresses) if a != b]
            raise GraphInvariantError(
                f"replay of {key}: static input(s) {moved} moved since the first replay; "
                "a device graph would read the old addresses"
            )
        self.stats["replay", key] += 1
        plan = self.capture_plan
        fresh = plan.forward(static_batch) if plan is not None else captured_fn()
        _copy_into(output, fresh, f"replay of {key}")
        return output

    def cleanup(self) -> None:
        super().cleanup()
        self._addresses.clear()

    def graph_memory_bytes(self) -> Optional[int]:
        """Bytes held by the kept outputs (what a graph pool would at least hold)."""
        return sum(t.numel() * t.element_size() for t in _tensors(list(self.graph_table.outputs())))

    def stats_total(self, kind: str) -> int:
        """Sum of one kind of count over every key."""
        return sum(n for (k, _), n in self.stats.items() if k == kind)


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    # The core's one walker over nested outputs: tuples, NamedTuples, lists, dicts, dataclasses.
    return (t for _, t in iter_tensors(obj))


def _copy_into(dst: Any, src: Any, where: str) -> None:
    def copy(d: torch.Tensor, s: Any) -> None:
        if not isinstance(s, torch.Tensor) or s.shape != d.shape or s.dtype != d.dtype:
            got = f"{tuple(s.shape)} {s.dtype}" if isinstance(s, torch.Tensor) else type(s).__name__
            raise GraphInvariantError(f"{where}: output was {tuple(d.shape)} {d.dtype} at capture, now {got}")
        d.copy_(s)

    try:
        map_pairs(copy, dst, src, where="output")
    except ValueError as exc:  # map_pairs: another container type, length, keys or fields
        raise GraphInvariantError(f"{where}: output structure changed since capture: {exc}") from exc

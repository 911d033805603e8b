"""``AcmeDebugBackend``: graph semantics without a graph, for debugging runners and models.

``capture_one`` does what a graph backend does before recording (warm-ups, the
post-warm-up hook) and then runs the forward once, keeping its output tensors;
``replay`` re-runs the captured forward and copies the result into those same tensors,
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

Re-running the captured closure is exact only when every input lives in the runner's
static buffers, which holds for the decode runner; the spec therefore declares the
decode phase only.
"""

from __future__ import annotations

import collections
import contextlib
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from cuda_graph_runner.backend import BaseCudaGraphBackend, ForwardFn, ShapeKey
from cuda_graph_runner.forward_batch import ForwardBatch
from cuda_graph_runner.nested import iter_tensors, map_pairs

#: Static-batch fields whose addresses must not change between replays of one key.
STATIC_FIELDS = ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens")


class GraphInvariantError(RuntimeError):
    """What a real device graph would have silently got wrong."""


class AcmeDebugBackend(BaseCudaGraphBackend):
    """Eager "replay" that counts calls and checks graph invariants.

    Attributes:
        stats: ``Counter`` of ``("warmup" | "capture" | "replay", key)`` and
            ``("post_warmup_hook", key)``; ``stats_total(kind)`` sums one kind.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._fns: Dict[ShapeKey, ForwardFn] = {}
        self._outputs: Dict[ShapeKey, Any] = {}
        self._addresses: Dict[ShapeKey, Tuple[Tuple[str, int], ...]] = {}
        self._in_session = False
        self.stats: collections.Counter = collections.Counter()

    @contextlib.contextmanager
    def capture_session(self, stream: Any) -> Iterator[None]:
        self._in_session = True
        try:
            yield
        finally:
            self._in_session = False

    def capture_one(
        self,
        key: ShapeKey,
        forward_fn: ForwardFn,
        *,
        post_warmup_hook: Optional[Callable[[], None]] = None,
    ) -> None:
        """Warm up, run the hook, run ``forward_fn`` once and keep its output.

        Raises:
            GraphInvariantError: outside ``capture_session``, or ``key`` already captured.
        """
        if not self._in_session:
            raise GraphInvariantError(
                f"capture_one({key}) outside capture_session(): a graph needs its stream and pool"
            )
        if key in self._fns:
            raise GraphInvariantError(f"shape {key} is already captured; call cleanup() before capturing it again")
        for _ in range(self.num_warmups):
            self.stats["warmup", key] += 1
            forward_fn()
        if post_warmup_hook is not None:
            self.stats["post_warmup_hook", key] += 1
            post_warmup_hook()
        self.stats["capture", key] += 1
        self._outputs[key] = forward_fn()
        self._fns[key] = forward_fn

    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        return key in self._fns

    @contextlib.contextmanager
    def replay_session(self) -> Iterator[None]:
        yield

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Re-run the captured forward of ``key`` into its captured output tensors.

        Raises:
            KeyError: ``key`` was not captured.
            GraphInvariantError: the static inputs moved, or the output changed shape.
        """
        if key not in self._fns:
            raise KeyError(f"no graph captured for {key}; captured: {sorted(self._fns)}")
        addresses = tuple(
            (f, getattr(static_batch, f).data_ptr())
            for f in STATIC_FIELDS
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
        _copy_into(self._outputs[key], self._fns[key](), f"replay of {key}")
        return self._outputs[key]

    def cleanup(self) -> None:
        self._fns.clear()
        self._outputs.clear()
        self._addresses.clear()

    def graph_memory_bytes(self) -> Optional[int]:
        """Bytes held by the kept outputs (what a graph pool would at least hold)."""
        return sum(t.numel() * t.element_size() for t in _tensors(self._outputs))

    def stats_total(self, kind: str) -> int:
        """Sum of one kind of count over every key."""
        return sum(n for (k, _), n in self.stats.items() if k == kind)

    @property
    def captured_keys(self) -> List[ShapeKey]:
        return list(self._fns)


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

"""Tensor-parallel group handle over ``torch.distributed`` (NCCL on GPUs, gloo on CPU).

One process per device; every rank of a TP group runs the same model shard and the
same runner. What the runners need from the group is small and lives here:

* :class:`TPGroup`: rank, size, the device group (NCCL on CUDA, gloo on CPU) for the
  model's collectives, a gloo CPU group for host decisions (no device sync, as sglang's
  ``cpu_group``), :meth:`TPGroup.barrier`, :meth:`TPGroup.all_true` (every rank agrees
  on a flag), :meth:`TPGroup.agree_ints` (every rank checks it holds the same ints) and
  :meth:`TPGroup.agree_step` (each batch's replay-or-eager decision and graph).
* :func:`all_reduce` / :func:`all_gather_last_dim`: the model's collectives, in one
  place. Run eagerly they call ``torch.distributed`` directly; traced by Dynamo
  (``torch.compile``, the ``tc_piecewise`` backend) they become the opaque custom ops
  ``cuda_graph_runner::tp_all_reduce`` / ``tp_all_gather_last_dim`` (see
  :mod:`cuda_graph_runner.runner.tp_ops`), so one trace serves every size.
* :func:`per_rank_compile_cache`: each rank's inductor cache in a directory of its own.
* :func:`init_tensor_parallel` (from torchrun's environment or explicit arguments) and
  :func:`shutdown` / :func:`exit_now`: teardown in bounded time. A
  ``destroy_process_group`` after a successful NCCL run was seen to hang until the
  job's timeout on a 2-GPU machine; :func:`shutdown` runs it in a daemon thread and
  gives up after ``timeout_s``, and :func:`exit_now` flushes and ``os._exit``s so no
  exit-time hook can hang either.

Failures end on every rank within seconds, not at the group's timeout, wherever a rank
fails before or between the agreement points: the backend's ``prepare`` and each size's
capture (:func:`tp_agree`, :func:`tp_capture_step`: a failing rank raises its error, the
others :class:`TensorParallelCaptureError` naming it and its error; a capture step that
failed anywhere is rolled back on every rank, so the ranks keep the same graphs) and each
batch's decision (:meth:`TPGroup.agree_step`: the same size, the same graph, i.e. padded
size and variant, or a :class:`TensorParallelMismatchError` naming each rank's; a decision
that raised on one rank is a :class:`TensorParallelStepError` on all). The group stays
usable after any of them.

Every collective the runner issues to coordinate the ranks (these agreements, their
error gathers, the capture barriers) runs on the gloo group with ``async_op=True`` and a
deadline on its wait (:meth:`TPGroup.wait_bounded`), so a rank that died, hung or never
reached an agreement is an error on every rank that waits, within the bound, not at the
process group's timeout: :attr:`TPGroup.step_timeout_s` (default 10 s) for each batch's
agreements, a :class:`TensorParallelStepError`, and :attr:`TPGroup.capture_timeout_s`
(default 120 s) for the capture-time ones, a :class:`TensorParallelCaptureError`. A
capture-time bound covers the wait after this rank's own part finished (its ``prepare``,
compile included, or its capture of a size) for the slowest other rank to finish its
own, so it must exceed how much longer one rank may legitimately take. A wait that ran
out leaves the group's collectives out of step: the error names the agreement and its
bound, and every later agreement on the group raises the same at once (end the process).
Out of scope: a failure inside the model's forward between two
of its own collectives (a warm-up, an eager step) or inside a replayed graph; the other
ranks then wait in that collective until the process group's timeout
(:func:`init_tensor_parallel`'s ``timeout_s``) and get the communication library's error.
Tensor parallelism assumes every rank is given the same batch each step: checks that run
after the ranks agreed to replay (a live input of another dtype, an ``extra`` key the
capture lacked) see the same batch, and so raise on every rank alike.

The model's collectives run on the current stream of the rank's device: during a
graph capture that is the capture stream, so they are recorded into the graph
(PyTorch's ProcessGroupNCCL supports capture). Borrowed from sglang's
``parallel_state`` (device + CPU groups, ``graph_capture``) and vLLM's
``GroupCoordinator``.
"""

from __future__ import annotations

import array
import contextlib
import dataclasses
import datetime
import hashlib
import logging
import math
import numbers
import os
import pickle
import sys
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ..backend import envs
from ..config.exceptions import CudaGraphRunnerError

if TYPE_CHECKING:
    from ..backend.base import ShapeKey

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CAPTURE_TIMEOUT_S",
    "DEFAULT_STEP_TIMEOUT_S",
    "TPGroup",
    "TensorParallelCaptureError",
    "TensorParallelMismatchError",
    "TensorParallelStepError",
    "all_gather_last_dim",
    "all_reduce",
    "check_timeout",
    "exit_now",
    "init_tensor_parallel",
    "per_rank_compile_cache",
    "shutdown",
    "tp_agree",
    "tp_capture_step",
]

#: Default seconds a collective may block before the process group gives up. A rank
#: that died or took another path must not leave the others blocked for the library's
#: 10-minute default.
DEFAULT_TIMEOUT_S = 300.0

#: Default seconds a rank waits for the other ranks in one step's agreement (a rank that
#: died or never reached it): far above the ranks' skew within a step, far below the
#: process group's timeout.
DEFAULT_STEP_TIMEOUT_S = 10.0

#: Default seconds a rank waits, after its own part of a capture-time agreement finished
#: (``prepare`` with its compile, one size's capture), for the other ranks to finish
#: theirs: room for one rank compiling or capturing slower than another, below the
#: process group's timeout.
DEFAULT_CAPTURE_TIMEOUT_S = 120.0


class TensorParallelMismatchError(CudaGraphRunnerError, RuntimeError):
    """Ranks of one TP group disagree on something they must share (e.g. a batch's size)."""


class TensorParallelCaptureError(CudaGraphRunnerError, RuntimeError):
    """Capture (or the backend's ``prepare``) failed on another rank of the TP group, so it
    fails here too; the message names that rank and its error."""


class TensorParallelStepError(CudaGraphRunnerError, RuntimeError):
    """The replay-or-eager decision of one batch failed on a rank of the TP group (the
    model's ``graph_variant`` raised, say), so every rank stops at that batch; the message
    names that rank and its error. Also: the batch's agreement did not complete within
    :attr:`TPGroup.step_timeout_s` (a rank died or never reached it), or the group is
    unusable after such a timeout."""


def check_timeout(name: str, value: Any) -> float:
    """``value`` as seconds, for the bound called ``name`` in the error.

    Raises:
        TypeError: not a number (a bool is refused).
        ValueError: not finite and > 0.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}={value!r}: expected seconds as a number > 0")
    seconds = float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise ValueError(f"{name}={value!r}: expected a finite number of seconds > 0")
    return seconds


@dataclasses.dataclass
class TPGroup:
    """A rank's view of its tensor-parallel group.

    Attributes:
        rank: this process's rank in the group, ``0 <= rank < size``.
        size: the TP size (any positive int).
        device: the rank's device (``cuda:<local rank>`` or ``cpu``).
        group: process group of the model's collectives (NCCL on CUDA, gloo on CPU);
            None means the default group.
        cpu_group: gloo group for host-side agreement (flags, sizes); None means
            ``group`` (already gloo on CPU).
        name: the name the compiled collectives find this group by
            (:func:`cuda_graph_runner.runner.tp_ops.register_group`); given at creation when
            ``size > 1``, empty otherwise.
        step_timeout_s: seconds a per-batch agreement (:meth:`agree_step`, verify mode's
            check) waits for the other ranks before it raises
            :class:`TensorParallelStepError` (default :data:`DEFAULT_STEP_TIMEOUT_S`).
        capture_timeout_s: seconds a capture-time agreement (:func:`tp_agree`,
            :func:`tp_capture_step`'s barrier, the sizes to capture) waits, after this
            rank's own part finished, for the other ranks before it raises
            :class:`TensorParallelCaptureError` (default :data:`DEFAULT_CAPTURE_TIMEOUT_S`).
    """

    #: The parallelism the group stands for, in error messages ("TP"; "DP" for
    #: :class:`cuda_graph_runner.runner.dp_group.DPGroup`).
    kind: ClassVar[str] = "TP"
    #: What a per-step agreement of the group raises when it times out.
    step_error: ClassVar[type] = TensorParallelStepError

    rank: int
    size: int
    device: torch.device
    group: Any = None
    cpu_group: Any = None
    name: str = dataclasses.field(default="", compare=False)
    _key_digests: Dict[ShapeKey, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _min_buffers: Dict[int, Tuple["array.array[int]", torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    step_timeout_s: float = dataclasses.field(default=DEFAULT_STEP_TIMEOUT_S, compare=False)
    capture_timeout_s: float = dataclasses.field(default=DEFAULT_CAPTURE_TIMEOUT_S, compare=False)
    #: Why the group is unusable (an agreement's wait ran out), or None.
    _broken: Optional[str] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"TPGroup: rank={self.rank} size={self.size}; need size >= 1 and 0 <= rank < size")
        self.step_timeout_s = check_timeout(f"{type(self).__name__}: step_timeout_s", self.step_timeout_s)
        self.capture_timeout_s = check_timeout(f"{type(self).__name__}: capture_timeout_s", self.capture_timeout_s)
        if self.size > 1 and not self.name:
            from .tp_ops import register_group

            self.name = register_group(self)

    @property
    def is_parallel(self) -> bool:
        """Whether there is more than one rank (size 1 runs no collective)."""
        return self.size > 1

    def _cpu(self) -> Any:
        return self.cpu_group if self.cpu_group is not None else self.group

    def variants_agreed(self, variants: Sequence[str]) -> None:
        """Every rank of the group declared these graph variants (a capture-time
        agreement checked it). The TP step agreement's length does not depend on them."""

    def check_usable(self, *, capture: bool = False) -> None:
        """Raise at once when an earlier agreement's wait on this group ran out (the
        group's collectives are out of step, so any further one would pair wrongly).

        Raises:
            TensorParallelCaptureError (``capture``) or :attr:`step_error`: the group is
                unusable; the message names the agreement that timed out and says to end
                the process.
        """
        if self._broken is not None:
            raise (TensorParallelCaptureError if capture else self.step_error)(self._broken)

    def wait_bounded(self, work: Any, what: str, *, capture: bool = False) -> None:
        """Wait for ``work``, an ``async_op=True`` collective of this group's gloo group,
        at most :attr:`capture_timeout_s` (``capture``) or :attr:`step_timeout_s` seconds.
        Every runner-issued coordination collective of TP and DP groups ends here.

        Raises:
            TensorParallelCaptureError (``capture``) or :attr:`step_error`: the wait ran
                out, or the collective failed (a rank's connection closed); the message
                names ``what``, this rank and the bound. The group is unusable from then
                on (:meth:`check_usable`).
        """
        setting, bound = (
            ("capture_timeout_s", self.capture_timeout_s) if capture else ("step_timeout_s", self.step_timeout_s)
        )
        try:
            if work.wait(timeout=datetime.timedelta(seconds=bound)) is False:
                raise TimeoutError(f"the wait returned without completion after {bound:g} s")
        except Exception as exc:
            self._broken = (
                f"{what} did not complete on {self.kind} rank {self.rank} of {self.size} "
                f"({type(exc).__name__}: {_one_line(exc, 300)}; the wait is bounded by {setting}={bound:g} s): "
                f"another {self.kind} rank died, hung, or did not reach it in time; the group is unusable "
                "(its collectives are out of step), end the process"
            )
            raise (TensorParallelCaptureError if capture else self.step_error)(self._broken) from exc

    def barrier(self, *, what: str = "a barrier of the group", capture: bool = True) -> None:
        """Block until every rank reaches this point (gloo, host only: no device sync),
        at most :attr:`capture_timeout_s` (``capture``) or :attr:`step_timeout_s`.

        Raises:
            As :meth:`wait_bounded` (a rank did not arrive in time; names ``what``).
        """
        if self.is_parallel:
            import torch.distributed as dist

            self.check_usable(capture=capture)
            self.wait_bounded(dist.barrier(group=self._cpu(), async_op=True), what, capture=capture)

    def all_true(self, flag: bool, *, what: str = "an agreement on a flag", capture: bool = False) -> bool:
        """Whether ``flag`` is true on every rank (one host all-reduce of an int, MIN;
        bounded as :meth:`host_min`)."""
        return bool(self.host_min([1 if flag else 0], what=what, capture=capture)[0])

    def host_min(self, values: Sequence[int], *, what: str = "a host agreement", capture: bool = False) -> List[int]:
        """The element-wise minimum of ``values`` (int64s) over the ranks: one host
        all-reduce (gloo, MIN, ``async_op=True``, no device sync). The per-step agreements'
        one collective.

        The values travel in an int64 tensor kept per length and reused, whose memory
        is a Python ``array`` the values are written into and read back from: a step
        makes no tensor and runs no torch op but the collective.

        Raises:
            As :meth:`wait_bounded`: the other ranks' values did not arrive within the
            bound (:attr:`capture_timeout_s` with ``capture``, else
            :attr:`step_timeout_s`), or the group is unusable after such a timeout.
        """
        if not self.is_parallel:
            return [int(v) for v in values]
        import torch.distributed as dist

        self.check_usable(capture=capture)
        held = self._min_buffers.get(len(values))
        if held is None:
            host = array.array("q", bytes(8 * len(values)))
            held = self._min_buffers[len(values)] = (host, torch.frombuffer(host, dtype=torch.int64))
        host, buf = held
        host[:] = array.array("q", values)
        work = dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self._cpu(), async_op=True)
        self.wait_bounded(work, what, capture=capture)
        return host.tolist()

    def agree_ints(self, values: Sequence[int], what: str, *, capture: bool = False) -> List[int]:
        """Check every rank holds the same ``values`` (one host all-reduce, bounded as
        :meth:`host_min`).

        Returns:
            ``list(values)``.

        Raises:
            TensorParallelMismatchError: a rank holds other values (names ``what`` and
                the minimum and maximum over ranks).
        """
        vals = [int(v) for v in values]
        if not self.is_parallel:
            return vals
        # MIN of (v, -v) gives min and -max in one collective.
        got = self.host_min(vals + [-v for v in vals], what=f"the agreement on {what}", capture=capture)
        n = len(vals)
        lo, hi = got[:n], [-v for v in got[n:]]
        if lo != hi:
            raise TensorParallelMismatchError(
                f"{self.kind} ranks disagree on {what}: rank {self.rank} has {vals}, min over ranks {lo}, max {hi}; "
                "every rank must run the same batch"
            )
        return vals

    def agree_step(
        self, size: int, replay: bool, key: Optional[ShapeKey] = None, *, failed: Optional[str] = None
    ) -> bool:
        """The decision every rank takes for one batch: replay only if all ranks can.

        One host all-reduce (gloo, no device sync) of six int64s carries the batch size
        (checked equal: ranks of a TP group run the same batch), the graph each rank would
        replay (``key``: its size and variant, as one 62-bit digest made once per key;
        checked equal among the ranks that would replay), the replay flag (MIN) and
        whether this rank's decision failed. Only a disagreement or a failure costs a
        second collective (every rank sees the same sums, so all of them take it): a
        gather of each rank's values, to name them in the error.

        Args:
            size: the batch's size along the runner's axis.
            replay: whether this rank can replay the batch.
            key: the ``ShapeKey`` this rank would replay (None: it cannot replay).
            failed: the one-line error of this rank's decision (it raised), or None.

        Returns:
            True when every rank replays (then every rank replays the same key).

        Raises:
            TensorParallelMismatchError: the ranks' batch sizes, or the graphs they would
                replay, differ (names each rank's value).
            TensorParallelStepError: the decision failed on another rank (names it and its
                error); the rank whose decision failed gets this too, naming itself. Or
                the other ranks' values did not arrive within :attr:`step_timeout_s` (a
                rank died or never reached this batch's agreement), or the group is
                unusable after such a timeout (the message says to end the process).
        """
        if not self.is_parallel:
            if failed is not None:
                raise TensorParallelStepError(f"the replay decision failed on rank {self.rank}: {failed}")
            return bool(replay)
        # A rank without a key sends _NO_KEY in both key slots: the MIN's neutral value.
        if key is not None and replay:
            digest = self._digest(key)
            lo_slot, hi_slot = digest, -digest
        else:
            lo_slot = hi_slot = _NO_KEY
        lo, neg_hi, key_lo, neg_key_hi, flag, ok = self.host_min(
            [size, -size, lo_slot, hi_slot, 1 if replay else 0, 0 if failed else 1], what=_STEP
        )
        if ok and lo == -neg_hi and (key_lo == _NO_KEY or key_lo == -neg_key_hi):
            return bool(flag)
        mine = (size, repr(key) if key is not None and replay else None, failed)
        ranks = self.gather_objects(mine, what=f"{_STEP} (each rank's values)")
        if not ok:
            bad = "; ".join(f"rank {r}: {v[2]}" for r, v in enumerate(ranks) if v[2] is not None)
            raise TensorParallelStepError(
                f"the replay decision failed on another TP rank ({bad}); this is rank {self.rank} of {self.size}"
            )
        if lo != -neg_hi:
            seen = ", ".join(f"rank {r}: {v[0]}" for r, v in enumerate(ranks))
            raise TensorParallelMismatchError(
                f"TP ranks run batches of different sizes ({seen}); this is rank {self.rank}; "
                "every rank of a TP group must run the same batch"
            )
        seen = ", ".join(f"rank {r}: {v[1] or 'runs eagerly'}" for r, v in enumerate(ranks))
        raise TensorParallelMismatchError(
            f"TP ranks would replay different graphs for one batch ({seen}); this is rank {self.rank}; "
            "every rank must pick the same padded size and graph variant (model.graph_variant(batch) "
            "must answer the same on every rank)"
        )

    def _digest(self, key: ShapeKey) -> int:
        digest = self._key_digests.get(key)
        if digest is None:
            digest = label_digest(f"{key.size}|{key.variant}|{key.requests or ''}")  # both axes of a 2-D key
            if len(self._key_digests) >= 4096:  # bounded, as the runner's replay plans
                self._key_digests.clear()
            self._key_digests[key] = digest
        return digest

    def gather_objects(
        self, value: Any, *, what: str = "a gather of every rank's values", capture: bool = False
    ) -> List[Any]:
        """Every rank's ``value`` (picklable), in rank order (for error paths and
        capture-time checks, not per step). ``[value]`` at size 1.

        Two host all-gathers (gloo, ``async_op=True``): each rank's pickled length, then
        the pickles padded to the longest (what ``all_gather_object`` does, which has no
        bounded wait). Each wait is bounded as :meth:`host_min`'s.

        Raises:
            As :meth:`wait_bounded` (a rank did not arrive in time; names ``what``).
        """
        if not self.is_parallel:
            return [value]
        import torch.distributed as dist

        self.check_usable(capture=capture)
        data = pickle.dumps(value)
        lengths = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        mine = torch.tensor([len(data)], dtype=torch.int64)
        self.wait_bounded(dist.all_gather(lengths, mine, group=self._cpu(), async_op=True), what, capture=capture)
        sizes = [int(n) for n in lengths]
        longest = max(sizes)
        held = [bytearray(longest) for _ in range(self.size)]
        sent = bytearray(data) + bytearray(longest - len(data))
        outs = [torch.frombuffer(b, dtype=torch.uint8) for b in held]
        work = dist.all_gather(outs, torch.frombuffer(sent, dtype=torch.uint8), group=self._cpu(), async_op=True)
        self.wait_bounded(work, what, capture=capture)
        # The peers are this group's own ranks, as for torch's all_gather_object.
        return [pickle.loads(bytes(b[:n])) for b, n in zip(held, sizes)]


def label_digest(text: str) -> int:
    """A 62-bit digest of ``text`` (blake2b): ``-digest`` fits an int64, so a MIN
    all-reduce of ``(digest, -digest)`` gives the lowest and highest over ranks."""
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(raw, "little") >> 2


#: What a rank that would not replay sends in :meth:`TPGroup.agree_step`'s key slots:
#: above every digest, so the MIN over ranks compares only the ranks that would replay.
_NO_KEY = 1 << 62

#: :meth:`TPGroup.agree_step`'s agreement, in a timeout's message.
_STEP = "the batch's replay agreement"


@contextlib.contextmanager
def tp_agree(tp: Optional[TPGroup], what: str) -> Iterator[None]:
    """Run the block on every rank of ``tp``, then agree on whether it succeeded everywhere.

    After the block, one host all-reduce of "did it succeed" (and, only when something
    failed, a gather of each rank's error line): a rank whose block raised re-raises its
    own error; every other rank raises :class:`TensorParallelCaptureError` naming the
    failing rank(s) and their errors. Every rank takes part in the same collectives
    whatever happened, so the group stays usable for the next attempt. The block itself
    must run no collective a failing rank could skip (``backend.prepare``: the trace and
    compile; a collective inside it is the model's, and a rank failing between two of
    them leaves the others blocked until the group's timeout). A no-op without a group.

    The agreement waits at most :attr:`TPGroup.capture_timeout_s` after this rank's block
    ended for the other ranks to end theirs.

    Raises:
        TensorParallelCaptureError: this rank succeeded but another failed; or the other
            ranks did not end their block within ``capture_timeout_s`` (names ``what``
            and the bound; the group is unusable then: end the process).
    """
    if tp is None or not tp.is_parallel:
        yield
        return
    agreement = f"the agreement after {what}"
    try:
        yield
    except BaseException as exc:
        tp.all_true(False, what=agreement, capture=True)
        tp.gather_objects(f"{type(exc).__name__}: {_one_line(exc)}", what=agreement, capture=True)
        raise
    if not tp.all_true(True, what=agreement, capture=True):
        errors = tp.gather_objects(None, what=agreement, capture=True)
        bad = "; ".join(f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None)
        raise TensorParallelCaptureError(
            f"{what} failed on another {tp.kind} rank ({bad}); this is rank {tp.rank} of {tp.size}, "
            "so it fails here too and every rank keeps the same graphs"
        )


def _one_line(exc: BaseException, limit: int = 500) -> str:
    text = " ".join(str(exc).split())
    return text[:limit] + ("..." if len(text) > limit else "")


@contextlib.contextmanager
def tp_capture_step(tp: Optional[TPGroup], what: str) -> Iterator[None]:
    """Wrap one size's capture so every rank of ``tp`` does it in step.

    A barrier on entry (ranks warm up together, as sglang's per-size TP barrier), then
    :func:`tp_agree`: a capture failure on one rank (e.g. out of memory) fails capture on
    all ranks, each naming the failing rank and its error (the runner then rolls the
    step back on every rank). A rank that fails between two of the model's collectives
    leaves the others blocked in a device collective until the process group's timeout
    (see :func:`init_tensor_parallel`): bounded, never a hang. A no-op without a group.
    The barrier and the agreement each wait at most :attr:`TPGroup.capture_timeout_s`.

    Raises:
        TensorParallelCaptureError: this rank succeeded but another failed; or another
            rank did not reach the barrier, or end its capture, within
            ``capture_timeout_s`` (the group is unusable then: end the process).
    """
    if tp is not None and tp.is_parallel:
        tp.barrier(what=f"the barrier before capture of {what}", capture=True)
    with tp_agree(tp, f"capture of {what}"):
        yield


def all_reduce(x: torch.Tensor, tp: Optional[TPGroup]) -> torch.Tensor:
    """Sum ``x`` over the TP group on the current stream; use the returned tensor.

    Eagerly the sum is made in place and ``x`` is returned. Traced by Dynamo it is the
    opaque custom op ``cuda_graph_runner::tp_all_reduce`` (:mod:`cuda_graph_runner.runner.tp_ops`),
    which returns a new tensor and leaves ``x`` as it was. A no-op without a group or at
    size 1.
    """
    if tp is None or not tp.is_parallel:
        return x
    if torch.compiler.is_compiling():
        from .tp_ops import all_reduce_op

        return all_reduce_op(x, tp.name)
    import torch.distributed as dist

    dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: Optional[TPGroup]) -> torch.Tensor:
    """Concatenate every rank's ``x`` ``[..., n]`` along the last dim: ``[..., size * n]``,
    rank order (same dtype and device). ``x`` itself without a group or at size 1.
    Traced by Dynamo: the custom op ``cuda_graph_runner::tp_all_gather_last_dim``."""
    if tp is None or not tp.is_parallel:
        return x
    if torch.compiler.is_compiling():
        from .tp_ops import all_gather_last_dim_op

        return all_gather_last_dim_op(x, tp.name, tp.size)
    return _gather_last_dim(x, tp)


def gather_rows(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """Every rank's ``x`` ``[n, ...]`` stacked along dim 0 in rank order: ``[size * n, ...]``
    (eager ``torch.distributed``; every rank must give the same shape)."""
    import torch.distributed as dist

    x = x.contiguous()
    out = torch.empty((tp.size * x.shape[0],) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    gather(out, x, group=tp.group)
    return out


def _gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    x = x.contiguous()
    # Ranks stacked along dim 0 (the layout gloo and NCCL both take), then moved last.
    out = gather_rows(x, tp).view((tp.size,) + tuple(x.shape))
    return out.movedim(0, -2).reshape(*x.shape[:-1], tp.size * x.shape[-1])


def init_tensor_parallel(
    tp_size: Optional[int] = None,
    *,
    device_type: Optional[str] = None,
    rank: Optional[int] = None,
    init_method: Optional[str] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    capture_timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S,
) -> TPGroup:
    """Join (or start) the default process group and return this rank's :class:`TPGroup`.

    Under ``torchrun`` everything comes from its environment (``RANK``, ``WORLD_SIZE``,
    ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``). The whole world is one TP group.

    Args:
        tp_size: expected world size; None accepts the environment's.
        device_type: ``"cuda"`` (NCCL, device ``cuda:<LOCAL_RANK>``) or ``"cpu"``
            (gloo); None picks cuda when available.
        rank: this process's rank when not under torchrun (with ``init_method``).
        init_method: e.g. ``"tcp://127.0.0.1:29500"`` or ``"file:///tmp/x"``; None
            reads the environment (``env://``).
        timeout_s: seconds a collective may block before failing (the model's
            collectives; the runner's own agreements are bounded by the next two).
        step_timeout_s: :attr:`TPGroup.step_timeout_s`, seconds a batch's agreement
            waits for the other ranks.
        capture_timeout_s: :attr:`TPGroup.capture_timeout_s`, seconds a capture-time
            agreement waits for the other ranks after this rank's own part finished.

    On CUDA, ``NCCL_NVLS_ENABLE`` defaults to ``0`` (NVLink multicast off) when unset.
    With more than one rank, the inductor cache goes per rank (:func:`per_rank_compile_cache`).

    Raises:
        ValueError: the world size differs from ``tp_size``, a bad ``device_type``,
            fewer CUDA devices than local ranks, or a bound that is not a finite number
            of seconds > 0 (each message names the values; TypeError for a bound that is
            not a number).
    """
    import torch.distributed as dist

    # Checked before joining: a bad bound must not leave a half-made group behind.
    step_timeout_s = check_timeout("step_timeout_s", step_timeout_s)
    capture_timeout_s = check_timeout("capture_timeout_s", capture_timeout_s)

    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type={device_type!r}: accepted 'cuda' (NCCL) or 'cpu' (gloo)")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        kwargs: dict = {"timeout": timeout}
        if init_method is not None:
            kwargs.update(init_method=init_method, rank=rank, world_size=tp_size)
        local_rank = dist.get_node_local_rank(fallback_rank=rank if rank is not None else 0)  # torchrun's LOCAL_RANK
        if device_type == "cuda":
            # NVLink SHARP (multicast) off unless the user chose: the lent 2-GPU machines
            # must not use it, and small decode all-reduces gain nothing from it.
            os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
            if local_rank >= torch.cuda.device_count():
                raise ValueError(
                    f"local rank {local_rank} needs cuda:{local_rank}, "
                    f"but {torch.cuda.device_count()} CUDA devices are visible"
                )
            torch.cuda.set_device(local_rank)
            kwargs["device_id"] = torch.device("cuda", local_rank)
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo", **kwargs)
    world, me = dist.get_world_size(), dist.get_rank()
    if tp_size is not None and world != tp_size:
        raise ValueError(
            f"--tp {tp_size} but the process group has {world} ranks; start it with torchrun --nproc-per-node {tp_size}"
        )
    local_rank = dist.get_node_local_rank(fallback_rank=me)
    if world > 1:
        per_rank_compile_cache(me)
    if device_type == "cuda":
        device = torch.device("cuda", local_rank)
        cpu_group = dist.new_group(backend="gloo", timeout=timeout)
    else:
        device, cpu_group = torch.device("cpu"), None
    return TPGroup(
        rank=me,
        size=world,
        device=device,
        group=None,
        cpu_group=cpu_group,
        step_timeout_s=step_timeout_s,
        capture_timeout_s=capture_timeout_s,
    )


def per_rank_compile_cache(rank: int) -> str:
    """Give this process's inductor compile cache a directory of its own: ``<base>/rank_<rank>``.

    ``<base>`` is ``$TORCHINDUCTOR_CACHE_DIR`` when set, else inductor's default
    (``<tmp>/torchinductor_<user>``); the result is written back to
    ``$TORCHINDUCTOR_CACHE_DIR`` (which inductor reads at each use, and Triton's cache
    follows unless ``$TRITON_CACHE_DIR`` is set). Idempotent. Ranks of one machine then
    never read or write each other's entries while they compile at once; their traced
    graphs differ anyway (each names its rank's group, see
    :mod:`cuda_graph_runner.runner.tp_ops`). vLLM keeps a ``rank_<i>`` cache directory likewise.

    Returns:
        The directory.
    """
    # Inductor's own reading of its variable (set, or its default); only written here.
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    leaf = f"rank_{rank}"
    path = cache_dir()
    if os.path.basename(path) != leaf:
        path = os.path.join(path, leaf)
    envs.set_external("TORCHINDUCTOR_CACHE_DIR", path)
    return path


def shutdown(timeout_s: float = 30.0) -> bool:
    """Destroy the default process group, giving up after ``timeout_s`` seconds.

    Runs ``destroy_process_group`` in a daemon thread (it can hang after NCCL work);
    a thread still blocked is abandoned, and the caller should then leave through
    :func:`exit_now`.

    Returns:
        True when the group was destroyed (or none existed), False on timeout (logged).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception as exc:  # teardown problems must not mask the run's result
            logger.warning("destroy_process_group failed: %s", exc)
        done.set()

    threading.Thread(target=destroy, name="cgr-pg-destroy", daemon=True).start()
    if done.wait(timeout_s):
        return True
    logger.warning("destroy_process_group did not finish in %.0f s; leaving it behind", timeout_s)
    return False


def exit_now(code: int) -> None:
    """Flush stdout/stderr and end the process with ``code`` at once (``os._exit``):
    no atexit or library exit hook (NCCL's among them) can hang it."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # a closed pipe must not change the exit code
            pass
    os._exit(code)

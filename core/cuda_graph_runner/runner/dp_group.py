"""Data-parallel attention group over ``torch.distributed``: ranks that run different
batches replay the same graph size, in step.

With data-parallel attention each rank runs its own requests through attention, but
the layers around it (expert parallelism, gathered MLPs) run collectives over all the
ranks, which only pair up when every rank runs the same number of rows. So every step:

1. the ranks exchange their live sizes (one host all-reduce over gloo, no device sync:
   :meth:`DPGroup.agree_batch`; of one int64 once a capture agreed on one graph variant,
   plus a five-int64 all-reduce when a rank cannot replay; of five int64s otherwise),
   together with whether each can replay and the graph variant it would replay;
2. every rank pads its batch to the largest live size (a rank without requests runs a
   dummy batch of that size), so the ranks' forwards have the same rows;
3. every rank takes the same replay-or-eager decision and the same graph key, derived
   from the same agreed values (the ranks captured the same sizes: the capture-time
   agreements of :mod:`cuda_graph_runner.runner.distributed` run over this group too);
4. each rank keeps only its own live rows of the output.

The runner side is :func:`cuda_graph_runner.runner.data_parallel.dp_forward`; a runner
uses it when its model has a ``dp_group`` attribute holding a :class:`DPGroup`.

Sources: sglang's DP attention (graph size = max over DP ranks, one replay-or-eager vote
for all ranks, idle ranks run a dummy batch: ``prepare_mlp_sync_batch_raw`` in
``python/sglang/srt/managers/scheduler_dp_attn_mixin.py`` gathers each rank's token
count and ``can_cuda_graph`` from its schedule batch, before the ``ForwardBatch`` is
built, into ``global_num_tokens`` and ``can_run_dp_cuda_graph``) and vLLM's DP with
synchronized graph mode (``coordinate_batch_across_dp`` in ``vllm/v1/worker/dp_utils.py``:
the ranks' token counts and graph modes all-reduced per step, every rank padded to the
maximum, the graph mode the minimum; ``DPMetadata`` in ``vllm/forward_context.py``
carries the result into the forward). Both block on the collective; a start/finish split
of vLLM's (``coordinate_batch_across_dp_start`` / ``DPSyncHandle.finish``, gloo
``async_op=True`` started before ``_prepare_inputs``) is seen in forks of vLLM, and is
the overlapped agreement's model.

Overlapped agreement: the all-reduce can start as soon as a rank knows its live size
(:meth:`DPGroup.start_agree_batch`, ``async_op=True``) and be waited on only when the
step needs its result (:meth:`PendingAgreement.wait`), so its latency overlaps the
engine's batch building; :meth:`DPGroup.agree_batch` is the same start waited on at
once. With one graph variant, a step with a rank that cannot replay takes a second
all-reduce, issued inside the wait (it needs the first one's result), so only the first
overlaps. The runner side is ``runner.start_step_agreement``
(:func:`cuda_graph_runner.runner.data_parallel.start_step_agreement`). Every wait is
bounded by :attr:`DPGroup.step_timeout_s`: a rank that died, or never started its
agreement for the step, is a :class:`DataParallelStepError` on every rank that waits,
within that many seconds (the group is then unusable: end the process).

Failures: a decision that raises on one rank (the model's ``graph_variant``, a
backend's ``can_run``) still takes part in the step's all-reduce, so every rank raises
at once (:class:`DataParallelStepError` naming the rank and its error; the failing
rank raises its own). Ranks whose live batches would replay different graph variants
raise :class:`DataParallelMismatchError` naming each rank's. Capture and ``prepare``
failures end on every rank as under tensor parallelism
(:class:`~cuda_graph_runner.runner.distributed.TensorParallelCaptureError`, "another DP
rank"). Out of scope: a failure inside the model's forward between two of its own
collectives, or inside a replayed graph: the other ranks then wait in that collective
until the process group's timeout (:func:`init_data_parallel`'s ``timeout_s``) and get
the communication library's error.

Scope: data parallelism alone (every rank holds the whole attention); DP combined with
tensor parallelism is not supported (a model holding both groups is refused).
"""

from __future__ import annotations

import array
import dataclasses
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..config.exceptions import CudaGraphRunnerError
from .distributed import (
    DEFAULT_CAPTURE_TIMEOUT_S,
    DEFAULT_STEP_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    TPGroup,
    all_reduce,
    gather_rows,
    init_tensor_parallel,
    label_digest,
)

__all__ = [
    "DEFAULT_STEP_TIMEOUT_S",
    "DPGroup",
    "PendingAgreement",
    "DataParallelMismatchError",
    "DataParallelStepError",
    "all_gather_rows",
    "gathered_mlp",
    "init_data_parallel",
]

#: What a rank without a variant to replay (no requests, or it cannot replay) sends in
#: the variant slots: above every digest, so the MIN compares only the ranks that have one.
_NONE = 1 << 62

#: The one-word agreement (a runner with one graph variant): bit 62 "this rank's decision
#: did not fail", bit 61 "ready", bit 60 "no variant" and, below, ``_SIZE_ONES - size``.
#: Under a MIN all-reduce the word's fields are compared in that order, so each is the
#: MIN over every rank as long as the fields above it are equal on every rank: the flags
#: are exact; with every rank ok and ready, the ranks with requests are exactly the
#: ranks with the variant (a ready rank with requests and no variant is sent as not
#: ready), so the size field is the largest live size. Any rank not ready (an eager
#: step) takes a second, five-word all-reduce for the exact values; a failure, the gather
#: that names it.
_OK_BIT, _READY_BIT, _NO_VARIANT_BIT = 1 << 62, 1 << 61, 1 << 60
_SIZE_ONES = (1 << 60) - 1


class DataParallelMismatchError(CudaGraphRunnerError, RuntimeError):
    """Ranks of one DP group would replay different graph variants for one step (the
    message names each rank's)."""


class DataParallelStepError(CudaGraphRunnerError, RuntimeError):
    """The step's decision failed on a rank of the DP group (the model's
    ``graph_variant`` raised, say), so every rank stops at that step; the message names
    that rank and its error."""


@dataclasses.dataclass
class DPGroup(TPGroup):
    """A rank's view of its data-parallel group: the handle of
    :class:`~cuda_graph_runner.runner.distributed.TPGroup` (rank, size, device, the device group
    for the model's collectives, the gloo group for host decisions, ``barrier``,
    ``all_true``, ``gather_objects``) plus the per-step agreement :meth:`agree_batch`.

    Runners read it as ``model.dp_group``. Every rank holds the whole model except what
    its collectives share (the reference model's DP layout: attention per rank, the MLP
    split over the group between an all-gather and an all-reduce).
    """

    kind = "DP"
    step_error = DataParallelStepError
    _variant_digests: Dict[str, int] = dataclasses.field(default_factory=dict, compare=False, repr=False)
    _step_buffers: Dict[int, Tuple["array.array[int]", torch.Tensor]] = dataclasses.field(
        default_factory=dict, compare=False, repr=False
    )
    _pending: Optional["PendingAgreement"] = dataclasses.field(default=None, compare=False, repr=False)
    #: The labels of one-variant runners every rank declared (:meth:`variants_agreed`).
    _one_word_variants: Set[str] = dataclasses.field(default_factory=set, compare=False, repr=False)

    @classmethod
    def of(
        cls,
        group: TPGroup,
        *,
        step_timeout_s: Optional[float] = None,
        capture_timeout_s: Optional[float] = None,
    ) -> "DPGroup":
        """The DP group over the same ranks and process groups as ``group``, with its
        bounds unless given (:attr:`step_timeout_s`, :attr:`capture_timeout_s`)."""
        return cls(
            rank=group.rank,
            size=group.size,
            device=group.device,
            group=group.group,
            cpu_group=group.cpu_group,
            step_timeout_s=group.step_timeout_s if step_timeout_s is None else step_timeout_s,
            capture_timeout_s=group.capture_timeout_s if capture_timeout_s is None else capture_timeout_s,
        )

    def variants_agreed(self, variants: Sequence[str]) -> None:
        """Every rank of the group declared ``variants`` (the capture-time gather of
        :meth:`~cuda_graph_runner.runner.base.BaseCudaGraphRunner.capture` checked it): a
        step agreement with one variant may then take the one-word all-reduce. Before that
        (no capture yet, a disabled runner) a step takes the five-word one, whose length is
        the same on every rank whatever each declared, so ranks that differ get a
        :class:`DataParallelMismatchError` instead of all-reduces of different lengths."""
        if len(variants) == 1:
            self._one_word_variants.add(variants[0])

    def _variant_digest(self, variant: str) -> int:
        digest = self._variant_digests.get(variant)
        if digest is None:
            if len(self._variant_digests) >= 4096:  # bounded: labels come from the model
                self._variant_digests.clear()
            digest = self._variant_digests[variant] = label_digest(variant)
        return digest

    def agree_batch(
        self,
        size: int,
        ready: bool,
        variant: Optional[str],
        *,
        variants: Sequence[str] = ("",),
        failed: Optional[str] = None,
    ) -> Tuple[int, bool, Optional[str]]:
        """One step's agreement, blocking: :meth:`start_agree_batch` waited on at once.

        Returns:
            ``(max size, every rank ready, the agreed variant)``; the variant is None when
            no rank has one (every rank idle, or none can replay).

        Raises:
            As :meth:`PendingAgreement.wait`.
        """
        return self.start_agree_batch(size, ready, variant, variants=variants, failed=failed).wait()

    def start_agree_batch(
        self,
        size: int,
        ready: bool,
        variant: Optional[str],
        *,
        variants: Sequence[str] = ("",),
        failed: Optional[str] = None,
    ) -> "PendingAgreement":
        """Start one step's agreement (the largest live size, whether every rank can
        replay, the graph variant) and return at once; :meth:`PendingAgreement.wait` gives
        its result.

        One host all-reduce (gloo, MIN, ``async_op=True``, no device sync). With one
        captured variant (``len(variants) == 1``, every runner without graph variants)
        that every rank declared (:meth:`variants_agreed`, at capture) it is of one int64:
        whether this rank's decision failed, the ready flag, whether it has the variant and
        the live size, packed so that the MIN gives each (on the H200 host a gloo
        all-reduce of one element costs about two thirds of one of five); a step with a
        rank not ready (it runs eagerly) then takes a second all-reduce, of the five below,
        for the exact values, issued and waited on inside :meth:`PendingAgreement.wait`.
        With several variants it is of
        five int64s: ``-size`` (the maximum), the ready flag, the variant's digest as
        ``(digest, -digest)`` (equal among the ranks that have one) and whether this
        rank's decision failed. The values travel in an int64 tensor reused every step
        (backed by a Python ``array``: no tensor is made and no torch op runs but the
        collective), so one agreement at a time is in flight on a group. Ranks that give
        different ``variants`` before a capture agreed on them take the five-word all-reduce
        and get a :class:`DataParallelMismatchError` when their variants differ.

        Args:
            size: this rank's live size (0: no requests).
            ready: whether this rank can replay (a rank without requests: True).
            variant: the graph variant this rank's batch would replay; None without
                requests, or when it cannot replay.
            variants: the labels the runner captures (a rank without a variant learns
                the agreed one among them).
            failed: the one-line error of this rank's decision (it raised), or None.

        Raises:
            RuntimeError: an agreement started on this group has not been waited on.
            DataParallelStepError: an earlier agreement of this group timed out or
                failed in the collective (the group is unusable).
        """
        self.check_usable()
        if self._pending is not None:
            raise RuntimeError(
                f"DP rank {self.rank}: a step agreement was started and not waited on; one agreement at a time "
                "(forward() the step it was started for before starting the next)"
            )
        if variant is not None:
            lo_slot, hi_slot = self._variant_digest(variant), -self._variant_digest(variant)
        else:
            lo_slot = hi_slot = _NONE
        one_word = len(variants) == 1 and variants[0] in self._one_word_variants
        if self.is_parallel and one_word and failed is None:  # what one word cannot say
            if variant is not None and variant != variants[0]:
                failed = f"variant {variant!r} is not among the captured variants {list(variants)}"
            elif size > _SIZE_ONES:
                failed = f"live size {size} is above the agreement's bound {_SIZE_ONES}"
        five = [-size, 1 if ready else 0, lo_slot, hi_slot, 0 if failed else 1]
        pending = PendingAgreement(self, size, variant, tuple(variants), failed)
        pending._five = five
        if not self.is_parallel:
            pending._values = five
            return pending
        values = five
        pending._one_word = one_word
        if one_word:
            # A ready rank with requests but no variant is sent as not ready: the
            # size field is only the maximum when such ranks do not exist (see _OK_BIT).
            ready_one = ready and (variant is not None or size == 0)
            values = [
                (0 if failed else _OK_BIT)
                | (_READY_BIT if ready_one else 0)
                | (_NO_VARIANT_BIT if variant is None else 0)
                | (_SIZE_ONES - min(max(size, 0), _SIZE_ONES))
            ]
        pending._work = self._all_reduce_min(values)
        self._pending = pending
        return pending

    def _all_reduce_min(self, values: List[int]) -> Any:
        import torch.distributed as dist

        buffers = self._step_buffers.get(len(values))
        if buffers is None:
            host = array.array("q", bytes(8 * len(values)))
            buffers = self._step_buffers[len(values)] = (host, torch.frombuffer(host, dtype=torch.int64))
        host, buf = buffers
        host[:] = array.array("q", values)
        return dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self._cpu(), async_op=True)

    def _finish(self, pending: "PendingAgreement") -> List[int]:
        """Wait (bounded) for ``pending``'s all-reduce; the reduced values, always the five
        (a one-word all-reduce decoded, or followed by the five-word one it calls for)."""
        work, pending._work = pending._work, None
        self._pending = None
        self.wait_bounded(work, "the step's agreement")
        if not pending._one_word:
            return self._step_buffers[5][0].tolist()
        (word,) = self._step_buffers[1][0].tolist()
        if word & _OK_BIT and word & _READY_BIT:
            no_variant = bool(word & _NO_VARIANT_BIT)
            digest = _NONE if no_variant else self._variant_digest(pending.variants[0])
            return [-(_SIZE_ONES - (word & _SIZE_ONES)), 1, digest, -digest if not no_variant else _NONE, 1]
        if not word & _OK_BIT:  # some rank failed: _decide gathers every rank's values to name it
            return [-pending.size, 0, _NONE, _NONE, 0]
        # Some rank is not ready (the step runs eagerly): the exact values, every rank alike.
        work = self._all_reduce_min(list(pending._five))
        self.wait_bounded(work, "the step's agreement (its second round)")
        return self._step_buffers[5][0].tolist()

    def _decide(self, pending: "PendingAgreement", reduced: List[int]) -> Tuple[int, bool, Optional[str]]:
        size, variant, failed = pending.size, pending.variant, pending.failed
        if not self.is_parallel:
            if failed is not None:
                raise DataParallelStepError(f"the step's decision failed on DP rank {self.rank}: {failed}")
            return size, bool(reduced[1]), variant
        neg_max, all_ready, v_lo, neg_v_hi, ok = reduced
        if ok and (v_lo == _NONE or v_lo == -neg_v_hi):
            agreed = None
            if v_lo != _NONE:
                agreed = variant if variant is not None else self._label_of(v_lo, pending.variants)
            return -neg_max, bool(all_ready), agreed
        # Every rank sees the same reduced values, so all of them take this gather.
        ranks = self.gather_objects((size, variant, failed), what="the step's agreement (each rank's values)")
        if not ok:
            bad = "; ".join(f"rank {r}: {v[2]}" for r, v in enumerate(ranks) if v[2] is not None)
            raise DataParallelStepError(
                f"the step's decision failed on a DP rank ({bad}); this is rank {self.rank} of {self.size}"
            )
        seen = ", ".join(
            f"rank {r}: {'no requests' if v[0] == 0 else repr(v[1]) if v[1] is not None else 'runs eagerly'}"
            for r, v in enumerate(ranks)
        )
        raise DataParallelMismatchError(
            f"DP ranks would replay different graph variants in one step ({seen}); this is rank {self.rank}; "
            "every rank replays one graph per step, so model.graph_variant(batch) must answer the same on "
            "every rank with requests"
        )

    def _label_of(self, digest: int, variants: Sequence[str]) -> str:
        for label in variants:
            if self._variant_digest(label) == digest:
                return label
        raise DataParallelMismatchError(
            f"DP rank {self.rank} captured none of the variant the other ranks replay (its variants: "
            f"{list(variants)}); every rank needs the same config"
        )


class PendingAgreement:
    """One step's agreement in flight (:meth:`DPGroup.start_agree_batch`): wait on it once
    the step needs the agreed values."""

    def __init__(
        self, group: DPGroup, size: int, variant: Optional[str], variants: Tuple[str, ...], failed: Optional[str]
    ) -> None:
        self.group, self.size, self.variant, self.variants, self.failed = group, size, variant, variants, failed
        self._work: Any = None
        self._one_word = False
        self._five: List[int] = []
        self._values: Optional[List[int]] = None
        self._result: Optional[Tuple[int, bool, Optional[str]]] = None
        self._error: Optional[BaseException] = None

    def wait(self) -> Tuple[int, bool, Optional[str]]:
        """Block until every rank's values are in (at most the group's ``step_timeout_s``).
        A second call returns (or raises) what the first did.

        Returns:
            ``(max live size over the ranks, every rank ready, the agreed variant)``; the
            variant is None when no rank has one (every rank idle, or none can replay).

        Raises:
            DataParallelStepError: the decision failed on some rank (names it and its
                error; the failing rank gets this too, naming itself), or the ranks' values
                did not all arrive within ``step_timeout_s`` (a rank died or never started
                its agreement; the group is then unusable).
            DataParallelMismatchError: ranks would replay different variants (names each).
        """
        if self._result is not None:
            return self._result
        if self._error is not None:
            raise self._error
        try:
            if self._values is None:
                self._values = self.group._finish(self)
            self._result = self.group._decide(self, self._values)
        except BaseException as exc:
            self._error = exc
            raise
        return self._result


def all_gather_rows(x: torch.Tensor, dp: Optional[TPGroup]) -> torch.Tensor:
    """Every rank's ``x`` ``[n, ...]`` stacked in rank order: ``[size * n, ...]`` (same
    dtype and device; every rank must give the same ``n``, which the DP step's padding
    ensures). ``x`` itself without a group or at size 1. Traced by Dynamo it is the
    opaque custom op ``cuda_graph_runner::tp_all_gather_rows``
    (:mod:`cuda_graph_runner.runner.tp_ops`)."""
    if dp is None or not dp.is_parallel:
        return x
    if torch.compiler.is_compiling():
        from .tp_ops import all_gather_rows_op

        return all_gather_rows_op(x, dp.name, dp.size)
    return gather_rows(x, dp)


def gathered_mlp(x: torch.Tensor, mlp: Any, dp: Optional[TPGroup]) -> torch.Tensor:
    """``mlp`` over every rank's rows, then this rank's rows: the DP stand-in for expert
    parallelism (sglang's DP attention before a tensor-parallel MLP or MoE).

    ``x`` ``[n, hidden]`` (the same ``n`` on every rank) is gathered to ``[size * n,
    hidden]``, ``mlp`` (this rank's shard, giving a partial sum) runs on all of it, the
    partial sums are all-reduced, and rows ``rank * n .. (rank + 1) * n`` are returned.
    Two collectives per call: a rank out of step (another ``n``, another graph) hangs or
    fails them, so the runner keeps the ranks in step.
    """
    if dp is None or not dp.is_parallel:
        return mlp(x)
    n = x.shape[0]
    full = all_reduce(mlp(all_gather_rows(x, dp)), dp)
    return full[dp.rank * n : (dp.rank + 1) * n]


def init_data_parallel(
    dp_size: Optional[int] = None,
    *,
    device_type: Optional[str] = None,
    rank: Optional[int] = None,
    init_method: Optional[str] = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S,
    capture_timeout_s: float = DEFAULT_CAPTURE_TIMEOUT_S,
) -> DPGroup:
    """Join (or start) the default process group and return this rank's :class:`DPGroup`;
    the whole world is one DP group. Arguments as
    :func:`~cuda_graph_runner.runner.distributed.init_tensor_parallel`'s (torchrun's environment,
    NCCL on CUDA with a gloo group for host decisions, gloo on CPU, bounded timeouts);
    ``step_timeout_s``: :attr:`DPGroup.step_timeout_s`, seconds a step's agreement waits
    for the other ranks; ``capture_timeout_s``: seconds a capture-time agreement waits
    for them after this rank's own part finished (as under TP).

    Raises:
        ValueError: the world size differs from ``dp_size`` (names both and the torchrun
            line), a bad ``device_type``, fewer CUDA devices than local ranks, or a bound
            that is not a finite number of seconds > 0 (TypeError: not a number).
    """
    # The world size is checked here, with DP's words (an explicit init_method needs it).
    world = dp_size if init_method is not None else None
    group = init_tensor_parallel(
        world,
        device_type=device_type,
        rank=rank,
        init_method=init_method,
        timeout_s=timeout_s,
        step_timeout_s=step_timeout_s,
        capture_timeout_s=capture_timeout_s,
    )
    if dp_size is not None and group.size != dp_size:
        raise ValueError(
            f"--dp {dp_size} but the process group has {group.size} ranks; "
            f"start it with torchrun --nproc-per-node {dp_size}"
        )
    return DPGroup.of(group)

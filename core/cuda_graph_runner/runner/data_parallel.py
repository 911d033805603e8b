"""One step of a runner under data-parallel attention (:mod:`cuda_graph_runner.runner.dp_group`).

:func:`dp_forward` is what ``runner.forward(batch)`` runs when the model holds a
:class:`~cuda_graph_runner.runner.dp_group.DPGroup`: the step's agreement (one host
all-reduce), the rank's batch padded to the largest live size over the group (a dummy
batch of that size on a rank without requests), the same replay-or-eager decision and
graph key on every rank, and the rank's own live rows of the output.

Padding rows are the runners' own (``runner.pad_batch``, as ``replay_prepare`` pads):
decode requests on the reserved request row 0 and KV slot 0 with ``seq_len_fill_value``;
prefill tokens (token 0, position 0, slot 0) past the live requests, belonging to no
request. A replay then pads the step's size up to its captured bucket as for any batch;
the eager path is ``runner.eager`` (``padded_eager`` applies).

:func:`start_step_agreement` (``runner.start_step_agreement``) starts the step's
agreement before the batch is built and ``dp_forward`` waits on it, after this rank's
own checks of the built batch: the all-reduce's latency overlaps the engine's batch
building. Without it, ``dp_forward`` starts and waits at once (blocking). Both paths
send the same values and derive the key from the agreed values alone, so ranks may mix
them within one step.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional, Tuple, Union

import torch

from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..backend.profiling import eager_range_name, profiler_enabled
from .decision import EagerDecision
from .dp_group import DataParallelStepError, DPGroup, PendingAgreement
from .sleep import asleep_error
from .stats import REASON_EMPTY, REASON_VARIANT

__all__ = ["StepAgreement", "dp_forward", "padded_batch", "start_step_agreement"]


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:500]}"


class StepAgreement:
    """A step's agreement started on this rank (``runner.start_step_agreement``): the
    values it sent, and the all-reduce in flight. The runner's next ``forward`` waits on
    it; :meth:`wait` gives the agreed values earlier.

    Attributes:
        live: the live size this rank declared (requests for decode, tokens for prefill;
            0: no requests).
        variant: the graph variant it declared (None: no requests, or it cannot replay).
        ready: whether it declared it can replay.
        batch: the batch it was started from (None when started from a size).
    """

    def __init__(
        self, runner: Any, pending: PendingAgreement, live: int, ready: bool, variant: Optional[str], batch: Any
    ) -> None:
        self.runner, self.pending = runner, pending
        self.live, self.ready, self.variant, self.batch = live, ready, variant, batch

    def wait(self) -> Tuple[int, bool, Optional[str]]:
        """``(max live size over the ranks, every rank ready, the agreed variant)``; raises
        as :meth:`cuda_graph_runner.runner.dp_group.PendingAgreement.wait`."""
        return self.pending.wait()


def start_step_agreement(
    runner: Any, dp: DPGroup, batch: Union[ForwardBatch, int, None], *, variant: Optional[str] = None
) -> StepAgreement:
    """Start this rank's agreement for the next step and return without waiting.

    Called as soon as the rank knows its live size, before it builds the step's
    ``ForwardBatch`` (input tensors, attention metadata), so the all-reduce's latency
    overlaps that work; ``runner.forward(batch)`` of the step then waits on it. The
    host cost is the issue (a few µs) and whatever of the collective's latency the
    building did not cover.

    Args:
        batch: this rank's live size as an int (decode: requests; prefill: tokens), or
            the step's ``ForwardBatch`` (then every check of the blocking path runs
            here), or None (no requests).
        variant: the graph variant the batch will replay (``model.graph_variant`` of
            it) when ``batch`` is a size and the runner captures several; with one
            captured variant it is that one.

    Started from a size, the checks that need the built batch run in ``forward``: a
    batch whose size or variant differs from the declared one, or that the replay
    would refuse (:func:`check_live_batch`), runs the agreed step as a rank without
    requests (the ranks' collectives stay paired) and then raises on this rank alone;
    a batch the agreed graph cannot take (``backend.can_run``, the runner's own limits)
    runs eagerly padded to the agreed graph's size, in step with the ranks that replay.
    That pairs only where the model's collectives are the same calls eagerly and in a
    graph (NCCL or gloo collectives; not graph-registered custom all-reduce buffers):
    with such a model, start the agreement from the built batch.

    Raises:
        ValueError: a negative size, a ``variant`` the runner did not capture, no
            ``variant`` with several captured, or what the blocking path raises for a
            ``ForwardBatch`` (after telling the other ranks, as there).
        RuntimeError: an agreement is already started on this runner's group.
        DataParallelStepError: the group is unusable after an agreement timed out.
    """
    live, ready, chosen, built = _this_rank(runner, dp, batch, variant)
    pending = dp.start_agree_batch(live, ready, chosen, variants=runner.capture_variants())
    return StepAgreement(runner, pending, live, ready, chosen, built)


def _this_rank(
    runner: Any, dp: DPGroup, batch: Union[ForwardBatch, int, None], variant: Optional[str]
) -> Tuple[int, bool, Optional[str], Optional[ForwardBatch]]:
    """This rank's values for the step's agreement: ``(live size, ready, variant, the
    built batch or None)``. A check that raises still takes part in the step's agreement
    (blocking, with the error), so the other ranks stop at once too; then it raises here."""
    built = batch if batch is None or isinstance(batch, ForwardBatch) else None
    live, ready, chosen = 0, bool(runner.captured_keys) and not runner.is_disabled, None
    try:
        if built is not None or batch is None:
            live, ready, chosen = _local_decision(runner, built, ready)
        else:
            live, chosen = _declared(runner, batch, variant)
            _refuse_model_inputs(runner)
            if not ready:  # as from a batch: a rank that cannot replay names no variant
                chosen = None
        _step_checks(runner, ready)
    except Exception as exc:
        with contextlib.suppress(DataParallelStepError):
            dp.agree_batch(live, False, None, variants=runner.capture_variants(), failed=_one_line(exc))
        raise
    return live, ready, chosen, built


def _declared(runner: Any, live: Any, variant: Optional[str]) -> Tuple[int, Optional[str]]:
    if isinstance(live, bool) or not isinstance(live, int) or live < 0:
        raise ValueError(
            f"start_step_agreement({live!r}): accepted a live size (int >= 0: requests for decode, tokens for "
            "prefill), the step's ForwardBatch, or None (no requests)"
        )
    if live == 0:
        return 0, None
    captured = list(runner.capture_variants())
    if variant is None:
        if len(captured) > 1:
            raise ValueError(
                f"start_step_agreement({live}) on a runner with graph variants {captured}: give variant= "
                "(model.graph_variant of the batch this step runs)"
            )
        return live, captured[0]
    if variant not in captured:
        raise ValueError(f"start_step_agreement(variant={variant!r}): accepted one of the captured variants {captured}")
    return live, variant


def _refuse_model_inputs(runner: Any) -> None:
    if runner.phase == "decode" and runner.model_inputs is not None:
        raise ValueError(
            "data parallelism does not pad model-owned static inputs (model.static_inputs() declares some, "
            "LoRA adapter ids say): run the data-parallel model without them"
        )


def _local_decision(runner: Any, batch: Optional[ForwardBatch], ready: bool) -> Tuple[int, bool, Optional[str]]:
    """This rank's live size, whether it can replay and its variant, from its built batch."""
    _refuse_model_inputs(runner)
    if batch is None:
        return 0, ready, None
    live = runner.size_of(batch)
    check_live_batch(runner, batch)
    if ready:  # what decide() refuses on this rank alone must not reach the replay
        ready = runner.batch_matches(batch) and runner.fits_graphs(batch)
    variant = None
    if ready:
        variant = runner.variant_of(batch)
        # The backend's per-batch conditions, before the size is known, asked of the
        # variant's largest captured graph (the ranks capture the same sizes; under
        # ``capture: eager_first`` the largest size may not be captured yet).
        probe = _largest_captured(runner, variant)
        ready = probe is not None and bool(runner.backend.can_run(batch, probe))
        if not ready:
            variant = None
    return live, ready, variant


def _largest_captured(runner: Any, variant: Optional[str]) -> Any:
    key = runner.variant_key(runner.max_size, variant)
    if key in runner.captured_keys:
        return key
    sizes = [k.size for k in runner.captured_keys if runner.variant_key(k.size, variant) == k]
    return runner.variant_key(max(sizes), variant) if sizes else None


def _step_checks(runner: Any, ready: bool) -> None:
    # As forward() without a group: a rank whose weights moved under its graphs, or
    # that is asleep and raises, stops every rank at this step's agreement.
    if ready and runner._weights_every:
        runner._weights_tick()
    if runner.sleep_state is not None and runner._asleep_raises:
        raise asleep_error(runner)


def dp_forward(
    runner: Any, dp: DPGroup, batch: Optional[ForwardBatch], agreement: Optional[StepAgreement] = None
) -> Any:
    """Run one data-parallel step of ``runner`` (call it on every rank, every step).

    Args:
        runner: a decode or prefill runner whose model's ``dp_group`` is ``dp``.
        batch: this rank's live batch, or None when it has no requests this step.
        agreement: the step's agreement started by :func:`start_step_agreement` (waited
            on here, after this rank's own checks of ``batch``), or None: the agreement
            runs here, blocking.

    Returns:
        The output of this rank's live rows only (decode logits ``[bs * width, vocab]``;
        prefill logits ``[requests, vocab]``; zero rows for a rank without requests), or
        None when no rank of the group has requests (nothing runs).

    Raises:
        DataParallelStepError: the step's decision failed on another rank (named), or
            the agreement did not complete within ``dp.step_timeout_s``.
        DataParallelMismatchError: ranks would replay different graph variants.
        ValueError: (this rank's own, the other ranks get DataParallelStepError) a live
            batch the replay would refuse (:func:`check_live_batch`), or a model with
            model-owned static inputs. With an ``agreement`` started from a size: a batch
            whose size or variant differs from the declared one, or that the replay would
            refuse (raised after the step ran in step, the other ranks unaffected).
        cuda_graph_runner.runner.weights.StaleWeightsError: (this rank's own, as the ValueError)
            the phase config's ``check_weights_every`` check found moved weights.
        cuda_graph_runner.runner.sleep.RunnerAsleepError: (this rank's own, as the
            ValueError) the runner is asleep and ``forward_asleep`` is ``raise``.
        Whatever else this rank's own decision raised (after the other ranks were told).
    """
    problem: Optional[Exception] = None
    if agreement is None:  # blocking: this rank's values from its batch, agreed here
        live, ready, chosen, _ = _this_rank(runner, dp, batch, None)
        size, all_ready, agreed = dp.agree_batch(live, ready, chosen, variants=runner.capture_variants())
        return _run_step(runner, batch, live, ready, size, all_ready, agreed, checked=True)
    if agreement.batch is None:
        try:  # the checks the start from a size could not make, while the all-reduce runs
            _check_declared(runner, agreement, batch)
        except Exception as exc:
            problem = exc
    elif agreement.batch is not batch:
        problem = ValueError(
            "forward(batch) got another batch than the one start_step_agreement(batch) was given; "
            "accepted: the same ForwardBatch object (or start from a size)"
        )
    size, all_ready, agreed = agreement.wait()
    if problem is not None:
        if size:  # in step as a rank without requests (the others' collectives pair with it)
            _run_key(runner, padded_batch(runner, None, size), _agreed_key(runner, size, all_ready, agreed), agreed)
        raise problem
    checked = agreement.batch is not None
    return _run_step(runner, batch, agreement.live, agreement.ready, size, all_ready, agreed, checked=checked)


def _run_step(
    runner: Any,
    batch: Optional[ForwardBatch],
    live: int,
    ready: bool,
    size: int,
    all_ready: bool,
    agreed: Optional[str],
    *,
    checked: bool,
) -> Any:
    """The step after its agreement: ``batch`` padded to the agreed ``size``, through the
    agreed graph or eagerly; this rank's own rows. ``checked``: whether this rank's values
    came from its built batch (else the agreed graph's conditions are checked here)."""
    if size == 0:
        return None
    key = _agreed_key(runner, size, all_ready, agreed)
    refused = _refusal(runner, batch, key) if key is not None and batch is not None and not checked else None
    if refused is not None:
        # The agreed graph cannot take this rank's batch: eagerly at the graph's size,
        # so this rank's collectives pair with the replaying ranks'.
        runner.stats.record_fallback(refused)
        return own_rows(runner, _eager(runner, padded_batch(runner, batch, key.size), refused), batch, key.size)
    work = padded_batch(runner, batch, size)
    if key is not None:
        runner.stats.record_replay(size)
        output = _run_key(runner, work, key, agreed)
    else:
        if batch is None:
            reason = REASON_EMPTY
        else:  # this rank's own reason on the step's padded batch (a batch it could
            # replay alone: another rank's), counted as traffic for eager_first's order
            reason = runner._eager_reason(runner.decide(work))
        runner.stats.record_fallback(reason)
        output = _eager(runner, work, reason)
    return own_rows(runner, output, batch, size)


def _check_declared(runner: Any, agreement: StepAgreement, batch: Optional[ForwardBatch]) -> None:
    live = 0 if batch is None else runner.size_of(batch)
    if live != agreement.live:
        raise ValueError(
            f"forward(batch) got a batch of {live} (along the {runner.phase} runner's axis) but "
            f"start_step_agreement declared {agreement.live}; accepted: the declared size"
        )
    if batch is None:
        return
    check_live_batch(runner, batch)
    if agreement.variant is not None and runner.batch_matches(batch):
        got = runner.variant_of(batch)
        if got != agreement.variant:
            raise ValueError(
                f"model.graph_variant(batch) is {got!r} but start_step_agreement declared variant="
                f"{agreement.variant!r}; accepted: the declared variant"
            )


def _refusal(runner: Any, batch: ForwardBatch, key: Any) -> Optional[str]:
    """Why the agreed graph ``key`` cannot replay this rank's built ``batch`` (a reason of
    the run statistics), or None when it can."""
    if not runner.batch_matches(batch):
        return REASON_VARIANT
    if not runner.fits_graphs(batch):  # the runner's own limit (prefill: request slots)
        decision = runner.decide(batch)
        return decision.reason if isinstance(decision, EagerDecision) else REASON_VARIANT
    try:
        return None if runner.backend.can_run(batch, key) else REASON_VARIANT
    except Exception:  # a can_run that raises: this batch cannot replay the graph
        return REASON_VARIANT


def _run_key(runner: Any, work: ForwardBatch, key: Any, agreed: Optional[str]) -> Any:
    """``work`` through the agreed graph ``key``, or eagerly when ``key`` is None."""
    if key is None:
        return runner.eager(work)
    runner._decided = (work, agreed or "")  # replay_prepare reads the agreed variant
    try:
        return runner.replay(work)
    finally:
        runner._decided = None


def _eager(runner: Any, work: ForwardBatch, reason: str) -> Any:
    if profiler_enabled():  # the eager step is named in a trace, as a replay is
        with torch.profiler.record_function(eager_range_name(runner.phase, reason)):
            return runner.eager(work)
    return runner.eager(work)


def check_live_batch(runner: Any, batch: ForwardBatch) -> None:
    """Refuse, before the step's agreement, what the replay would refuse after it on this
    rank alone (the ranks' batches differ, so the others would be left in the model's
    collectives): token fields without the rows their axis needs, a float token field,
    an ``extra`` key the captured forward looked up and did not find, a prefill batch
    without ``extend_seq_lens`` for graphs with request slots.

    Raises:
        ValueError: a field's rows or dtype (names the field, its shape or dtype, and
            what is accepted); ``extend_seq_lens`` missing (request slots).
        cuda_graph_runner.backend.errors.CudaGraphHostValueError: the ``extra`` key (named).
    """
    from ..backend.host_guard import missing_extra_error

    for name in ("input_ids", "positions", "out_cache_loc"):
        # Decode rows per request are the runner's slot width (a draft runner's
        # out_cache_loc holds one KV slot per step); prefill's are the batch's tokens.
        rows = batch.batch_size * runner.slot_width(name) if runner.phase == "decode" else batch.num_tokens
        t = getattr(batch, name)
        if t.shape[:1] != (rows,) or t.dtype.is_floating_point or t.dtype.is_complex:
            raise ValueError(
                f"batch.{name} is {tuple(t.shape)} {t.dtype}; accepted: [{rows}] of an integer dtype "
                f"({runner.phase} batch of {batch.batch_size} requests)"
            )
    if getattr(runner, "request_slots", None) is not None and batch.extend_seq_lens is None:
        raise ValueError(
            "batch.extend_seq_lens is None; accepted: [requests] int32 new tokens per request "
            "(prefill graphs with request slots pad the request axis from it)"
        )
    for name in runner._missing_extra:
        if name in batch.extra:
            raise missing_extra_error(name, runner._backend_label(), runner.phase)


def _agreed_key(runner: Any, size: int, all_ready: bool, variant: Optional[str]) -> Any:
    """The graph every rank replays for a step of ``size`` rows, or None (every rank runs
    eagerly). A function of agreed values and of the captured graphs only, which the
    ranks share (capture agreed on them), so it is the same on every rank."""
    if not all_ready or variant is None or size > runner.max_size:
        return None
    padded, _ = runner.replay_target(size)
    if runner.phase == "prefill":
        from .prefill import MAX_PADDING_RATIO  # the prefill runner's own rule, on the agreed size

        if padded > MAX_PADDING_RATIO * size:
            return None
    key = runner.variant_key(padded, variant)
    return key if key in runner.captured_keys else None


def padded_batch(runner: Any, batch: Optional[ForwardBatch], size: int) -> ForwardBatch:
    """``batch`` with padding rows up to ``size`` along the runner's axis (decode:
    requests, prefill: tokens) as a replay pads it (``runner.pad_batch``), or a dummy
    batch of ``size`` (an empty batch so padded) when ``batch`` is None; ``batch``
    itself when it already has ``size``."""
    if batch is None:
        batch = _empty_batch(runner)
    elif runner.size_of(batch) == size:
        return batch
    return runner.pad_batch(batch, size)


def _empty_batch(runner: Any) -> ForwardBatch:
    """A batch of no request and no token in the runner's mode, on its device."""
    device = runner.device
    i64, i32 = torch.zeros(0, dtype=torch.int64, device=device), torch.zeros(0, dtype=torch.int32, device=device)
    if runner.phase == "prefill":
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=i64,
            positions=i64,
            out_cache_loc=i64,
            req_pool_indices=i64,
            seq_lens=i32,
            extend_seq_lens=i32,
            extend_prefix_lens=i32,
            seq_lens_cpu=[],
            extend_seq_lens_cpu=[],
            extend_prefix_lens_cpu=[],
        )
    return ForwardBatch(
        forward_mode=runner.mode,
        input_ids=i64,
        positions=i64,
        out_cache_loc=i64,
        req_pool_indices=i64,
        seq_lens=i32,
        seq_lens_cpu=[],
        num_tokens_per_req=runner.num_tokens_per_req,
    )


def own_rows(runner: Any, output: Any, batch: Optional[ForwardBatch], size: int) -> Any:
    """``output`` of a step padded to ``size`` requests cut to ``batch``'s own rows (the
    decode runner's per-token and per-request tensors; zero rows for ``batch`` None).
    Prefill outputs are per request already: its padding is tokens of no request."""
    if runner.phase != "decode":
        return output
    bs = 0 if batch is None else batch.batch_size
    if bs == size:
        return output
    return runner.live_rows(output, None, size, bs * runner.num_tokens_per_req, bs)

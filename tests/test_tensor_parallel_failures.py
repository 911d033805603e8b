"""Multi-rank failures end at once, on every rank, with the group still usable (gloo, two
CPU ranks): ranks picking different graphs for one batch, a capture step failing on one
rank (rolled back on both), ranks with different sizes to capture, a decision raising on
one rank, and ``backend.prepare`` failing on one rank. A rank that never reaches a batch's
or a capture's agreement: an error on the waiting rank within the group's bound, after
which the group refuses every agreement.

One launch runs every scenario in order, with a 5 s process-group timeout: a rank left
waiting in a collective would get gloo's timeout error instead of the error asserted
here. The launch is bounded by :func:`run_ranks`'s own deadline; each test asserts on
what the ranks returned for its scenario.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.runner.distributed import TPGroup, all_reduce
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.tp_launch import run_ranks

GROUP_TIMEOUT_S = 5.0
#: The stalled scenarios' step_timeout_s and capture_timeout_s, and how long the rank
#: that hangs in its capture stays there (past the bound).
BOUND_S = 1.0
STALL_S = 1.3


class TPToy(ToyModel):
    """ToyModel whose hidden state is summed over the TP group (one all-reduce per
    forward), with graph variants ``a``/``b`` picked by ``self.choice(batch)``."""

    def __init__(self, tp: Optional[TPGroup]) -> None:
        super().__init__()
        self.tp_group = tp
        self.choice: Callable[[ForwardBatch], str] = lambda batch: "a"

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return all_reduce(super().forward(batch), self.tp_group)

    def graph_variants(self):
        return ["a", "b"]

    def graph_variant(self, batch: ForwardBatch) -> str:
        return self.choice(batch)


class QuietTPToy(TPToy):
    """TPToy whose forward runs no collective: the only ones are the runner's agreements."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return ToyModel.forward(self, batch)


def _outcome(fn: Callable[[], Any]) -> Tuple[str, Optional[str]]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", None


def _sizes(keys) -> list:
    return sorted({k.size for k in keys})


def _replays_like_eager(runner, model, bs: int) -> bool:
    """One batch through the runner (a replay: the group's collectives run in it) equals
    the eager forward, and it was a replay."""
    before = sum(runner.stats.replays_by_size.values())
    batch = decode_batch(bs)
    got = runner.forward(batch).clone()
    want = runner.eager_forward(batch)
    return sum(runner.stats.replays_by_size.values()) == before + 1 and torch.allclose(got, want)


def _runner(model, backend, max_bs: int = 4):
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    config = {"decode": {"max_bs": max_bs}}
    return DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)


def _rank_scenarios(tp: TPGroup, names: Sequence[str]) -> Dict[str, Any]:
    """Run the scenarios ``names`` (functions of this module) in order on this rank."""
    torch.set_num_threads(1)  # ranks share the CI machine's cores
    out: Dict[str, Any] = {"rank": tp.rank}
    model = TPToy(tp)
    for scenario in (globals()[name] for name in names):
        try:
            scenario(tp, model, out)
        except Exception as exc:  # what a scenario did not expect: its test fails, naming it
            out[scenario.__name__] = f"{type(exc).__name__}: {exc}"
    return out


def _variants(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # Ranks picking different variants for one batch: an error on both, no replay.
    runner = _runner(model, RecordingBackend("cpu", phase="decode"))
    runner.capture()
    model.choice = lambda batch: "a" if tp.rank == 0 else "b"
    out["variant"] = _outcome(lambda: runner.forward(decode_batch(3)))
    model.choice = lambda batch: "b"
    out["variant_then"] = _replays_like_eager(runner, model, 3)


def _capture_rollback(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # A capture step failing on rank 1 (variant b of size 2, after variant a): rolled
    # back on both ranks; the next capture() captures the same sizes on both.
    class FailOnce(RecordingBackend):
        fail = True

        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)
            if self.fail and tp.rank == 1 and key.size == 2 and key.variant.endswith("|b"):
                raise RuntimeError("injected capture failure")

    backend = FailOnce("cpu", phase="decode")
    runner = _runner(model, backend)
    out["capture"] = _outcome(runner.capture)
    out["capture_kept"] = (_sizes(runner.captured_keys), _sizes(backend._fns))
    backend.fail = False
    out["capture_again"] = _outcome(runner.capture)
    out["capture_then"] = (_sizes(runner.captured_keys), _replays_like_eager(runner, model, 2))


def _sizes_to_capture(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # Ranks with different sizes to capture: an error on both before any capture.
    mixed = _runner(model, RecordingBackend("cpu", phase="decode"), max_bs=4 if tp.rank == 0 else 8)
    out["sizes"] = _outcome(mixed.capture)
    runner = _runner(model, RecordingBackend("cpu", phase="decode"))
    runner.capture()
    out["sizes_then"] = _replays_like_eager(runner, model, 2)
    # One rank with nothing left to capture (all captured), the other after cleanup(): the
    # rank returning early still meets the agreement, so both raise instead of waiting.
    if tp.rank == 0:
        runner.cleanup()
    out["sizes_none_left"] = _outcome(runner.capture)
    # Ranks whose models declare different graph variants: named at capture, not left to
    # a step agreement of another length on each rank.
    other = TPToy(tp)
    if tp.rank == 1:
        other.graph_variants = lambda: ["a"]
    out["variants_to_capture"] = _outcome(_runner(other, RecordingBackend("cpu", phase="decode")).capture)


def _decision(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # The decision raising on rank 1 (its graph_variant): an error on both ranks.
    runner = _runner(model, RecordingBackend("cpu", phase="decode"))
    runner.capture()

    def choice(batch: ForwardBatch) -> str:
        if tp.rank == 1:
            raise ValueError("injected graph_variant failure")
        return "a"

    model.choice = choice
    out["decision"] = _outcome(lambda: runner.forward(decode_batch(2)))
    model.choice = lambda batch: "a"
    out["decision_then"] = _replays_like_eager(runner, model, 2)


def _prepare(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # backend.prepare failing on rank 1: an error on both ranks, then a second attempt.
    class PrepareFailsOnce(RecordingBackend):
        fail = True

        def prepare(self, plan):
            if self.fail and tp.rank == 1:
                raise RuntimeError("injected prepare failure")

    backend = PrepareFailsOnce("cpu", phase="decode")
    runner = _runner(model, backend)
    out["prepare"] = _outcome(runner.capture)
    backend.fail = False
    out["prepare_again"] = _outcome(runner.capture)
    out["prepare_then"] = (_sizes(runner.captured_keys), _replays_like_eager(runner, model, 3))


def _weights_and_sleep(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # Weights re-assigned on rank 1 only (check_weights_every=1): an error on both ranks.
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    config = {"decode": {"max_bs": 4, "check_weights_every": 1, "forward_asleep": "raise"}}
    backend = RecordingBackend("cpu", phase="decode")
    runner = DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    kept = model.head
    if tp.rank == 1:
        model.head = torch.nn.Parameter(kept.detach().clone())
    out["stale"] = _outcome(lambda: runner.forward(decode_batch(2)))
    model.head = kept
    out["stale_then"] = _replays_like_eager(runner, model, 2)
    # Rank 1 asleep with forward_asleep raise, rank 0 awake: an error on both ranks.
    if tp.rank == 1:
        runner.sleep()
    out["asleep"] = _outcome(lambda: runner.forward(decode_batch(2)))
    runner.sleep()  # both asleep: both wake, so both meet the capture's size agreement
    runner.wake()
    out["asleep_then"] = _replays_like_eager(runner, model, 2)
    # Only rank 1 slept: a wake on both raises on both (rank 0 meets the size agreement).
    if tp.rank == 1:
        runner.sleep()
    out["half_wake"] = (_outcome(runner.wake), runner.asleep)


def _verify(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # Verify mode: the replay differs from its reference on rank 1 only; both ranks raise.
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    model.choice = lambda batch: "a"
    config = {"decode": {"max_bs": 4, "verify": True, "verify_first_n": 100}}
    backend = RecordingBackend("cpu", phase="decode")
    runner = DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    replay = backend.replay
    if tp.rank == 1:
        backend.replay = lambda key, batch: replay(key, batch) + 1.0
    out["verify"] = _outcome(lambda: runner.forward(decode_batch(3)))
    backend.replay = replay
    out["verify_then"] = _replays_like_eager(runner, model, 3)


def _stalled(tp: TPGroup, model: TPToy, out: Dict[str, Any]) -> None:
    # Rank 1 never reaches the batch's agreement, then hangs in its capture of size 2,
    # each on a group of its own (a wait that ran out leaves its group out of step); the
    # bounds are made short once the ranks are in step (the launch's group's barrier).
    import time

    import torch.distributed as dist

    groups = [TPGroup(tp.rank, tp.size, tp.device, group=dist.new_group(backend="gloo")) for _ in range(2)]
    runner = _runner(QuietTPToy(groups[0]), RecordingBackend("cpu", phase="decode"))
    runner.capture()
    groups[0].step_timeout_s = BOUND_S
    if tp.rank == 0:  # rank 1 goes on to the barrier: it never reaches this batch's agreement
        start = time.monotonic()
        out["stalled_step"] = _outcome(lambda: runner.forward(decode_batch(2)))
        out["stalled_step_s"] = time.monotonic() - start
        out["stalled_step_then"] = _outcome(lambda: runner.forward(decode_batch(2)))
        out["stalled_step_then_capture"] = _outcome(lambda: runner.capture())
    tp.barrier()

    class HangsOnRankOne(RecordingBackend):
        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            if tp.rank == 1 and key.size == 2 and key.variant.endswith("|a"):
                time.sleep(STALL_S)
            super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)

    runner = _runner(QuietTPToy(groups[1]), HangsOnRankOne("cpu", phase="decode"))
    groups[1].capture_timeout_s = BOUND_S
    start = time.monotonic()
    out["stalled_capture"] = _outcome(runner.capture)
    out["stalled_capture_s"] = time.monotonic() - start
    out["stalled_capture_kept"] = _sizes(runner.captured_keys)
    out["stalled_capture_then"] = _outcome(lambda: runner.forward(decode_batch(4)))


SCENARIOS = (
    "_variants",
    "_capture_rollback",
    "_sizes_to_capture",
    "_decision",
    "_prepare",
    "_weights_and_sleep",
    "_verify",
    "_stalled",  # last: it leaves groups of its own unusable
)


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_rank_scenarios, 2, SCENARIOS, timeout_s=120, group_timeout_s=GROUP_TIMEOUT_S)


def _done(ranks, scenario: str) -> None:
    for r in ranks:
        assert scenario not in r, f"rank {r['rank']}: {r[scenario]}"  # it raised what it did not expect


def test_ranks_picking_different_graph_variants_both_raise(ranks):
    _done(ranks, "_variants")
    for r in ranks:
        kind, message = r["variant"]
        assert kind == "TensorParallelMismatchError", (r["rank"], kind, message)
        assert "rank 0: ShapeKey(size=4, variant='decode|a')" in message
        assert "rank 1: ShapeKey(size=4, variant='decode|b')" in message
        assert r["variant_then"] is True  # the group is usable; the same variant replays


def test_a_capture_step_failing_on_one_rank_is_rolled_back_on_every_rank(ranks):
    _done(ranks, "_capture_rollback")
    assert ranks[1]["capture"] == ("RuntimeError", "injected capture failure")
    kind, message = ranks[0]["capture"]
    assert kind == "TensorParallelCaptureError" and "rank 1: RuntimeError: injected capture failure" in message
    for r in ranks:
        # Size 4 was captured before; size 2 is gone in both variants on both ranks.
        assert r["capture_kept"] == ([4], [4]), r["rank"]
        assert r["capture_again"] == ("ok", None), r["rank"]
        assert r["capture_then"] == ([1, 2, 4], True), r["rank"]


def test_ranks_with_different_sizes_to_capture_both_raise(ranks):
    _done(ranks, "_sizes_to_capture")
    for r in ranks:
        kind, message = r["sizes"]
        assert kind == "TensorParallelMismatchError", (r["rank"], kind, message)
        assert "rank 0: [4, 2, 1]" in message and "rank 1: [8, 4, 2, 1]" in message
        assert r["sizes_then"] is True
        kind, message = r["sizes_none_left"]
        assert kind == "TensorParallelMismatchError", (r["rank"], kind, message)
        assert "rank 0: [4, 2, 1]" in message and "rank 1: []" in message
        kind, message = r["variants_to_capture"]
        assert kind == "TensorParallelMismatchError", (r["rank"], kind, message)
        assert "different decode graph variants (rank 0: ['a', 'b']; rank 1: ['a'])" in message, message


def test_a_decision_failing_on_one_rank_raises_on_every_rank(ranks):
    _done(ranks, "_decision")
    assert ranks[1]["decision"] == ("ValueError", "injected graph_variant failure")
    kind, message = ranks[0]["decision"]
    assert kind == "TensorParallelStepError", (kind, message)
    assert "rank 1: ValueError: injected graph_variant failure" in message
    for r in ranks:
        assert r["decision_then"] is True


def test_prepare_failing_on_one_rank_raises_on_every_rank_and_the_group_stays_usable(ranks):
    _done(ranks, "_prepare")
    assert ranks[1]["prepare"] == ("RuntimeError", "injected prepare failure")
    kind, message = ranks[0]["prepare"]
    assert kind == "TensorParallelCaptureError", (kind, message)
    assert "rank 1: RuntimeError: injected prepare failure" in message and "prepare of decode" in message
    for r in ranks:
        assert r["prepare_again"] == ("ok", None), r["rank"]
        assert r["prepare_then"] == ([1, 2, 4], True), r["rank"]


def test_weights_moved_or_asleep_on_one_rank_raise_on_every_rank(ranks):
    _done(ranks, "_weights_and_sleep")
    kind, message = ranks[1]["stale"]
    assert kind == "StaleWeightsError" and "head" in message
    kind, message = ranks[0]["stale"]
    assert kind == "TensorParallelStepError" and "rank 1: StaleWeightsError" in message, (kind, message)
    assert ranks[1]["asleep"][0] == "RunnerAsleepError"
    kind, message = ranks[0]["asleep"]
    assert kind == "TensorParallelStepError" and "rank 1: RunnerAsleepError" in message, (kind, message)
    for r in ranks:
        assert r["stale_then"] is True and r["asleep_then"] is True, r["rank"]
        (kind, message), asleep = r["half_wake"]
        assert kind == "TensorParallelMismatchError" and "rank 1: [4, 2, 1]" in message, (r["rank"], kind, message)
        assert asleep is (r["rank"] == 1)  # rank 1 stays asleep, as it was before the wake


def test_a_failed_capture_step_is_rolled_back_without_a_group_too():
    """One process: a size whose second variant fails keeps neither variant, in the runner
    and in the backend, and the next capture() captures it."""
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    class FailOnce(RecordingBackend):
        fail = True

        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)
            if self.fail and key.size == 2 and key.variant.endswith("|b"):
                raise RuntimeError("injected capture failure")

    model = TPToy(None)
    backend = FailOnce("cpu", phase="decode")
    runner = DecodeCudaGraphRunner(model, {"decode": {"max_bs": 4}}, device="cpu", backend=backend, show_progress=False)
    with pytest.raises(RuntimeError, match="injected capture failure"):
        runner.capture()
    assert _sizes(runner.captured_keys) == _sizes(backend._fns) == [4]
    assert ("discard", ShapeKey(2, "decode|a")) in backend.events
    backend.fail = False
    runner.capture()
    assert _sizes(runner.captured_keys) == [1, 2, 4] and len(runner.captured_keys) == 6


def test_a_verify_mismatch_on_one_rank_raises_on_every_rank(ranks):
    _done(ranks, "_verify")
    assert ranks[1]["verify"][0] == "CudaGraphVerifyError", ranks[1]["verify"]
    kind, message = ranks[0]["verify"]
    assert kind == "TensorParallelStepError" and "another TP rank" in message, (kind, message)
    for r in ranks:
        assert r["verify_then"] is True, r["rank"]


def test_a_rank_that_never_reaches_the_batch_agreement_is_an_error_within_the_step_timeout(ranks):
    """Rank 1 never calls forward: rank 0 raises TensorParallelStepError within
    step_timeout_s (not the process group's timeout), naming the agreement and the bound;
    then the group refuses every agreement at once, a batch's and a capture's."""
    _done(ranks, "_stalled")
    r0 = ranks[0]
    kind, message = r0["stalled_step"]
    assert kind == "TensorParallelStepError", (kind, message)
    assert "the batch's replay agreement did not complete on TP rank 0 of 2" in message, message
    assert "step_timeout_s=1 s" in message and "end the process" in message, message
    assert r0["stalled_step_s"] < GROUP_TIMEOUT_S, r0["stalled_step_s"]  # the step's bound, not the group's timeout
    assert r0["stalled_step_then"] == ("TensorParallelStepError", message)
    assert r0["stalled_step_then_capture"] == ("TensorParallelCaptureError", message)


def test_a_rank_that_hangs_in_its_capture_is_an_error_within_the_capture_timeout(ranks):
    """Rank 1 hangs in its capture of size 2 past capture_timeout_s: rank 0, done with its
    own capture of it, raises TensorParallelCaptureError naming that agreement and the
    bound, keeps the sizes captured before it, and refuses the next batch at once; rank 1
    raises once it comes back (the group's agreements are out of step)."""
    _done(ranks, "_stalled")
    r0, r1 = ranks
    kind, message = r0["stalled_capture"]
    assert kind == "TensorParallelCaptureError", (kind, message)
    assert "the agreement after capture of decode size 2 did not complete on TP rank 0 of 2" in message, message
    assert "capture_timeout_s=1 s" in message and "end the process" in message, message
    assert r0["stalled_capture_s"] < GROUP_TIMEOUT_S, r0["stalled_capture_s"]
    assert r0["stalled_capture_kept"] == [4]  # size 2 rolled back
    assert r0["stalled_capture_then"] == ("TensorParallelStepError", message)
    kind, message = r1["stalled_capture"]
    assert kind == "TensorParallelCaptureError" and "capture_timeout_s=1 s" in message, (kind, message)

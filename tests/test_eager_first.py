"""The ``eager_first`` capture policy on emulated graphs (CPU): ``capture()`` queues,
``forward`` serves eagerly until a size is captured, ``capture_step(budget_ms)`` captures
the sizes live traffic used first, a size replays only once whole, a failure or a
``cleanup()``/``sleep()`` between steps leaves nothing half-done, the capture never
touches a live request's KV, and tensor-parallel ranks switch a size at the same step."""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

import pytest
import torch
from toy_model import ToyModel, decode_batch

from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.distributed import TPGroup, all_reduce
from cuda_graph_runner.runner.stats import REASON_ASLEEP, REASON_NOT_CAPTURED, REASON_NOT_CAPTURED_YET, format_summary
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.tp_launch import run_ranks

#: A budget no size fits in: every call captures exactly one size.
ONE_SIZE = 1e-6


class VariantToy(ToyModel):
    """ToyModel with graph variants ``a``/``b`` (picked by ``self.choice``), summed over
    its TP group when it has one."""

    def __init__(self, tp: Optional[TPGroup] = None) -> None:
        super().__init__()
        self.tp_group = tp
        self.choice = "a"

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return all_reduce(super().forward(batch), self.tp_group)

    def graph_variants(self):
        return ["a", "b"]

    def graph_variant(self, batch: ForwardBatch) -> str:
        return self.choice


class FailingBackend(RecordingBackend):
    """Emulated graphs whose capture of ``fail_key`` (size, variant suffix) raises after
    the backend recorded it: a half-made graph the runner must roll back."""

    fail_key: Optional[tuple] = None

    def capture_one(self, key, forward_fn, **kwargs):
        super().capture_one(key, forward_fn, **kwargs)
        if self.fail_key is not None and (key.size, key.variant.rsplit("|", 1)[-1]) == self.fail_key:
            raise RuntimeError(f"injected capture failure at {key}")


def make_runner(model=None, backend=None, **decode: Any) -> DecodeCudaGraphRunner:
    config = {"decode": {"bs": [1, 2, 4, 8], "capture": "eager_first", **decode}}
    return DecodeCudaGraphRunner(
        model if model is not None else ToyModel(),
        config,
        device="cpu",
        backend=backend if backend is not None else RecordingBackend("cpu", phase="decode", share_pool=True),
        show_progress=False,
    )


def assert_every_size_equals_eager(runner: DecodeCudaGraphRunner, captured: set) -> None:
    """Every live size 1..8 through ``forward`` equals its eager forward, and replays
    exactly when its capture size is in ``captured``."""
    for bs in range(1, 9):
        batch = decode_batch(bs)
        before = runner.stats.replays_by_size[bs]
        got = runner.forward(batch).clone()
        torch.testing.assert_close(got, runner.eager_forward(batch))
        padded = runner.padded_size(bs)
        assert runner.stats.replays_by_size[bs] == before + (padded in captured), (bs, captured)


def test_capture_key_default_and_bad_value():
    assert CudaGraphConfig.from_dict({}).decode.capture == "blocking"
    assert CudaGraphConfig.from_dict({"prefill": {"capture": "eager_first"}}).prefill.capture == "eager_first"
    with pytest.raises(CudaGraphConfigError, match=r"capture.*'lazy'.*blocking, eager_first"):
        CudaGraphConfig.from_dict({"decode": {"capture": "lazy"}})


def test_capture_returns_at_once_and_forward_runs_eagerly_counted():
    runner = make_runner()
    report = runner.capture()
    assert report.sizes == [] and runner.captured_keys == []
    assert runner.backend.events == []  # nothing warmed up or recorded yet
    assert_every_size_equals_eager(runner, set())
    stats = runner.run_stats()
    assert stats["eager_fallbacks"] == {REASON_NOT_CAPTURED_YET: 8}
    assert stats["capture"]["ready"] == 0 and stats["capture"]["total"] == 4 and stats["capture"]["pending"] == 4
    assert "0 of 4 sizes ready" in format_summary("decode", stats)


def test_no_graph_work_before_the_first_capture_step(monkeypatch):
    # capture() and the eager steps before the first capture_step do an eager forward's
    # work and no more: no capture plan or prepare, no capture session, no gc freeze or
    # collection, no device synchronize, no weights fingerprint; the first step does them.
    import gc

    import cuda_graph_runner.runner.base as base

    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(base, "build_capture_plan", spy("plan", base.build_capture_plan))
    monkeypatch.setattr(base, "freeze_gc", spy("freeze_gc", base.freeze_gc))
    monkeypatch.setattr(base.WeightsFingerprint, "take", spy("fingerprint", base.WeightsFingerprint.take))
    monkeypatch.setattr(gc, "collect", spy("gc.collect", gc.collect))
    runner = make_runner()
    disabled = DecodeCudaGraphRunner(ToyModel(), {"decode": {"bs": [1, 2, 4, 8]}}, device="cpu", backend="disabled")
    monkeypatch.setattr(runner, "_synchronize", spy("sync", runner._synchronize))
    monkeypatch.setattr(runner.backend, "new_capture_session", spy("session", runner.backend.new_capture_session))
    forwards = {}
    for name, r in (("eager_first", runner), ("disabled", disabled)):
        r.model.forward = spy(name, r.model.forward)
        r.capture()
        for bs in (3, 1, 8):
            r.forward(decode_batch(bs))
        forwards[name] = calls.count(name)
    assert [c for c in calls if c not in forwards] == []  # nothing but the model's forwards
    assert forwards["eager_first"] == forwards["disabled"] == 3
    assert runner.backend.events == []  # nothing warmed up, recorded or begun on the backend
    runner.capture_step(ONE_SIZE)
    assert {"plan", "freeze_gc", "fingerprint", "sync", "session"} <= set(calls)


def test_steps_capture_observed_sizes_first_then_largest_first(caplog):
    runner = make_runner()
    runner.capture()
    for bs in (3, 3, 4, 1, 2):  # capture size 4 three times, 2 once, 1 once
        runner.forward(decode_batch(bs))
    assert runner.lazy_capture.observed == {4: 3, 1: 1, 2: 1}
    with caplog.at_level(logging.INFO, logger="cuda_graph_runner"):
        order = [runner.capture_step(ONE_SIZE).sizes for _ in range(4)]
    assert order == [[4], [2], [1], [8]]  # most observed, ties larger first, then the rest
    assert "decode capture step: 1 sizes (4)" in caplog.text and "1 of 4 ready, 3 to go" in caplog.text  # -v
    last = runner.capture_step(ONE_SIZE)
    assert last.sizes == [] and last.done and last.ready == 4


def test_budget_fits_several_sizes_and_none_captures_all():
    runner = make_runner()
    runner.capture()
    step = runner.capture_step(60_000.0)  # ample: every size fits
    assert sorted(step.sizes) == [1, 2, 4, 8] and step.remaining == 0 and len(step.ms) == 4
    runner.cleanup()
    runner.capture()
    assert runner.capture_step(None).sizes == [8, 4, 2, 1]  # nothing observed: largest first


def test_backend_prepares_once_per_capture_not_per_step():
    class CountingPrepare(RecordingBackend):
        prepares = 0

        def prepare(self, plan):
            self.prepares += 1

    backend = CountingPrepare("cpu", phase="decode")
    runner = make_runner(backend=backend)
    runner.capture()
    assert backend.prepares == 0  # capture() only queues
    for _ in range(4):
        runner.capture_step(ONE_SIZE)
    assert backend.prepares == 1 and len(runner.captured_keys) == 4
    runner.cleanup()
    runner.capture()
    runner.capture_step(ONE_SIZE)
    runner.capture_step(ONE_SIZE)
    assert backend.prepares == 2  # a new capture after cleanup() prepares again


def test_later_steps_continue_the_capture_session():
    # The session's first size warms up fully (num_warmups), later sizes by the warm-up
    # policy (auto: one), across capture steps as within one blocking capture.
    runner = make_runner()
    runner.capture()
    for _ in range(4):
        runner.capture_step(ONE_SIZE)
    warmups = [sum(1 for e in runner.backend.events if e == ("warmup", k)) for k in runner.captured_keys]
    assert warmups == [runner.backend.num_warmups, 1, 1, 1]
    assert runner.backend.continue_capture_session is False


def test_switch_over_equals_eager_with_verify_on():
    runner = make_runner(verify=True, verify_first_n=1000)
    runner.capture()
    assert_every_size_equals_eager(runner, set())
    captured: set = set()
    while True:
        step = runner.capture_step(ONE_SIZE)
        if not step.sizes:
            break
        captured.update(step.sizes)
        assert step.ready == len(captured) and step.remaining == 4 - len(captured)
        assert_every_size_equals_eager(runner, captured)  # verify mode checks every replay too
    assert len(runner.verifier.checked) > 0
    assert runner.run_stats()["capture"]["ready"] == 4


def test_failure_mid_size_leaves_it_uncaptured_and_eager_serves_it():
    backend = FailingBackend("cpu", phase="decode")
    backend.fail_key = (4, "b")  # variant a of size 4 recorded, then variant b fails
    model = VariantToy()
    runner = make_runner(model, backend)
    runner.capture()
    assert runner.capture_step(ONE_SIZE).sizes == [8]
    with pytest.raises(RuntimeError, match="injected capture failure"):
        runner.capture_step(None)
    assert sorted({k.size for k in runner.captured_keys}) == [8]
    assert {k.size for k in backend._fns} == {8}  # the half-made size 4 rolled back
    for choice in ("a", "b"):  # neither variant of size 4 replays
        model.choice = choice
        assert_every_size_equals_eager(runner, {8})
    assert runner.run_stats()["eager_fallbacks"][REASON_NOT_CAPTURED_YET] > 0
    backend.fail_key = None
    assert runner.capture_step(None).sizes == [4, 2, 1]  # the next call tries it again
    assert_every_size_equals_eager(runner, {1, 2, 4, 8})


def test_cleanup_between_steps_drops_graphs_and_queue():
    runner = make_runner()
    runner.capture()
    runner.capture_step(ONE_SIZE)
    runner.cleanup()
    assert runner.captured_keys == [] and runner.backend._fns == {}
    assert runner.capture_step(None).sizes == []  # nothing queued after cleanup
    runner.forward(decode_batch(2))
    assert runner.run_stats()["eager_fallbacks"] == {REASON_NOT_CAPTURED: 1}
    runner.capture()
    assert runner.capture_step(None).sizes == [8, 4, 2, 1]
    assert_every_size_equals_eager(runner, {1, 2, 4, 8})


def test_sleep_between_steps_remembers_captured_and_queued_sizes():
    runner = make_runner()
    runner.capture()
    assert runner.capture_step(ONE_SIZE).sizes == [8]
    runner.sleep()
    assert runner.asleep and runner.captured_keys == [] and runner.backend._fns == {}
    assert runner.capture_step(None).sizes == []  # asleep: nothing to capture
    runner.forward(decode_batch(3))
    assert runner.run_stats()["eager_fallbacks"] == {REASON_ASLEEP: 1}
    report = runner.wake()
    assert not runner.asleep and report.sizes == []  # eager_first: wake queues
    assert runner.lazy_capture.pending() == {1, 2, 4, 8}
    assert runner.capture_step(None).sizes == [8, 4, 2, 1]
    assert_every_size_equals_eager(runner, {1, 2, 4, 8})


def test_blocking_policy_capture_step_is_a_no_op_and_budget_checked():
    runner = make_runner(capture="blocking")
    assert runner.lazy_capture is None
    runner.capture()
    step = runner.capture_step(5.0)
    assert step.sizes == [] and step.ready == 4 and step.done
    assert "capture" not in runner.run_stats()
    for bad, error in ((0, ValueError), (-1.0, ValueError), (float("nan"), ValueError), ("5", TypeError)):
        with pytest.raises(error, match="budget_ms"):
            runner.capture_step(bad)


def test_capture_never_touches_live_kv_slots():
    from cuda_graph_runner.testing.reference_setup import prefilled_decode_batch, reference_model

    model = reference_model("tiny", requests=4, context=32, device="cpu")
    cache = model.kv_cache
    config = {"decode": {"bs": [1, 2, 4], "capture": "eager_first"}}
    backend = RecordingBackend("cpu", phase="decode")
    runner = DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    session, batch = prefilled_decode_batch(model, [[1, 2, 3], [4, 5, 6, 7]], decode_steps=1)
    runner.forward(batch)  # eager, writes the live slots of this step
    live_k = [k[1:].clone() for k in cache.k_buffers]
    live_v = [v[1:].clone() for v in cache.v_buffers]
    rows = cache.req_to_token[1:].clone()
    dummy = cache.k_buffers[0][0].clone()
    runner.capture_step(None)  # warm-ups and recordings of every size
    for layer, (k, v) in enumerate(zip(cache.k_buffers, cache.v_buffers)):
        assert torch.equal(k[1:], live_k[layer]) and torch.equal(v[1:], live_v[layer]), layer
    assert torch.equal(cache.req_to_token[1:], rows) and not cache.req_to_token[0].any()
    assert not torch.equal(cache.k_buffers[0][0], dummy)  # the capture wrote the reserved slot 0
    session.close()


# -- tensor parallel over gloo ---------------------------------------------------------------
def _tp_rank(tp: TPGroup) -> Dict[str, Any]:
    torch.set_num_threads(1)
    out: Dict[str, Any] = {}
    model = VariantToy(tp)
    backend = FailingBackend("cpu", phase="decode")
    runner = make_runner(model, backend)
    runner.capture()
    for bs in (3, 3, 1):
        runner.forward(decode_batch(bs))
    # Rank 0 has ample time, rank 1 none: both capture one size per call, the same one.
    steps = []
    budget = 60_000.0 if tp.rank == 0 else ONE_SIZE
    for _ in range(2):
        steps.append(runner.capture_step(budget).sizes)
        replays = sum(runner.stats.replays_by_size.values())
        got = runner.forward(decode_batch(3)).clone()
        steps.append(
            (
                sum(runner.stats.replays_by_size.values()) - replays,
                torch.allclose(got, runner.eager_forward(decode_batch(3))),
            )
        )
    out["steps"] = steps
    # A failure on rank 1 only: both ranks raise, both keep the same sizes.
    backend.fail_key = (8, "b") if tp.rank == 1 else None
    try:
        runner.capture_step(None)
        out["failure"] = "ok"
    except Exception as exc:
        out["failure"] = type(exc).__name__
    out["after_failure"] = sorted({k.size for k in runner.captured_keys})
    backend.fail_key = None
    out["rest"] = runner.capture_step(None).sizes
    return out


def test_tensor_parallel_ranks_switch_a_size_at_the_same_step():
    results = run_ranks(_tp_rank, 2, timeout_s=90.0, group_timeout_s=10.0)
    for rank, out in enumerate(results):
        # size 4 (observed twice) then 1: one per call on both ranks, replayed at once
        assert out["steps"] == [[4], (1, True), [1], (1, True)], (rank, out)
        assert out["failure"] == ("RuntimeError" if rank == 1 else "TensorParallelCaptureError"), (rank, out)
        assert out["after_failure"] == [1, 4], (rank, out)
        assert out["rest"] == [8, 2], (rank, out)


def test_graph_memory_estimate_finishes_an_eager_first_capture():
    from cuda_graph_runner.runner.memory_estimate import estimate_graph_memory
    from cuda_graph_runner.testing.reference_setup import reference_model

    model = reference_model("tiny", requests=4, context=32, device="cpu")
    config = {"decode": {"bs": [1, 2, 4], "capture": "eager_first"}, "prefill": {"backend": "disabled"}}
    backend = RecordingBackend("cpu", phase="decode")
    estimate = estimate_graph_memory(model, config, max_reqs=5, max_context_len=32, backends={"decode": backend})
    assert estimate.phases["decode"].sizes == [4, 2, 1]
    assert len(backend.captured()) == 3


def test_prefill_eager_first_orders_by_observed_token_counts_and_replays_equal_eager():
    from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
    from cuda_graph_runner.runner import PrefillCudaGraphRunner
    from cuda_graph_runner.testing.reference_setup import reference_model

    model = reference_model("tiny", requests=6, context=32, device="cpu")
    # Emulated graphs re-run the whole forward: the reference prefill reads host lengths in it.
    config = {"prefill": {"bs": [16, 32, 64], "capture": "eager_first", "host_value_guard": False}}
    backend = RecordingBackend("cpu", phase="prefill")
    runner = PrefillCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    eager = eager_logits_fn(model)
    runner.capture()

    def serve(lens, seed):
        batch = make_extend_batch(
            model.kv_cache, make_dummy_prompts(len(lens), lens, model.config.vocab_size, seed=seed)
        )
        expected = eager(batch).clone()
        torch.testing.assert_close(runner.forward(batch), expected)
        for row in batch.req_pool_indices.tolist():
            model.kv_cache.free_request(row)

    serve([9, 12], 0)  # 21 tokens: capture size 32
    assert runner.run_stats()["eager_fallbacks"] == {REASON_NOT_CAPTURED_YET: 1}
    assert runner.capture_step(ONE_SIZE).sizes == [32]  # observed first, before the larger 64
    serve([10, 11], 1)
    assert runner.run_stats()["replays"] == 1
    assert runner.capture_step(None).sizes == [64, 16]

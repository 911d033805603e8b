"""Run statistics of a runner: replays, eager fallbacks by reason, padding waste."""

from __future__ import annotations

import logging

from toy_model import ToyModel, decode_batch

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.decision import EagerDecision
from cuda_graph_runner.runner.stats import (
    REASON_DISABLED,
    REASON_NOT_CAPTURED,
    REASON_NOT_CAPTURED_YET,
    REASON_OTHER_RANK,
    REASON_SLOTS,
    REASON_TOO_LARGE,
    REASON_VARIANT,
    RunStats,
    format_summary,
)
from cuda_graph_runner.testing.fakes import RecordingBackend


def make_runner(max_bs=4, bs=None):
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": max_bs, **({"bs": bs} if bs else {})}})
    return DecodeCudaGraphRunner(
        ToyModel(), cfg, device="cpu", backend=RecordingBackend("cpu", phase="decode"), show_progress=False
    )


def test_replays_and_each_fallback_reason_are_counted():
    runner = make_runner(max_bs=4, bs=[1, 2, 4])
    runner.forward(decode_batch(2))  # before capture
    runner.capture()
    runner.forward(decode_batch(3))  # pads to 4
    runner.forward(decode_batch(3))
    runner.forward(decode_batch(1))
    runner.forward(decode_batch(6))  # above max_bs
    runner.forward(decode_batch(2, width=2))  # target-verify batch into a decode runner
    runner.backend.can_run = lambda batch, key: False  # the backend holds no graph for this variant
    runner.forward(decode_batch(2))
    stats = runner.run_stats()
    assert stats["replays"] == 3
    assert stats["eager_fallbacks"] == {REASON_NOT_CAPTURED: 1, REASON_TOO_LARGE: 1, REASON_VARIANT: 2}
    assert stats["eager_total"] == 4
    assert stats["padding"] == [
        {"captured_size": 1, "replays": 1, "real_rows": 1, "padded_rows": 0, "waste": 0.0},
        {"captured_size": 4, "replays": 2, "real_rows": 6, "padded_rows": 2, "waste": 2 / 6},
    ]


class CountingRunner(DecodeCudaGraphRunner):
    """A decode runner whose decisions are counted; a batch of 3 requests gets a reason only
    this decision gives (a decode runner has no request slots), so a recount would differ."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.decided = []

    def decide(self, batch):
        self.decided.append(batch.batch_size)
        if batch.batch_size == 3:
            return EagerDecision(REASON_SLOTS)
        return super().decide(batch)


def test_the_recorded_reason_is_the_one_decide_returned_and_each_batch_is_decided_once():
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": 4, "bs": [1, 2, 4]}})
    runner = CountingRunner(ToyModel(), cfg, device="cpu", backend=RecordingBackend("cpu"), show_progress=False)
    runner.forward(decode_batch(2))  # before capture
    runner.capture()
    for bs in (3, 6, 2):
        runner.forward(decode_batch(bs))
    assert runner.decided == [2, 3, 6, 2]  # one decision per forward: the statistics never ask again
    stats = runner.run_stats()
    assert stats["eager_fallbacks"] == {REASON_NOT_CAPTURED: 1, REASON_SLOTS: 1, REASON_TOO_LARGE: 1}
    assert stats["replays"] == 1


class _AnotherRankCannot:
    """A tensor-parallel group whose other rank cannot replay: every step runs eagerly."""

    def agree_step(self, size, replay, key=None, *, failed=None):
        return False


def test_under_tensor_parallel_a_rank_that_could_replay_says_another_rank_cannot():
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": 4, "bs": [1, 2, 4]}})
    runner = CountingRunner(ToyModel(), cfg, device="cpu", backend=RecordingBackend("cpu"), show_progress=False)
    runner.capture()
    runner.tp_group = _AnotherRankCannot()
    for bs in (2, 3, 6):
        runner.forward(decode_batch(bs))
    assert runner.decided == [2, 3, 6]
    assert runner.run_stats()["eager_fallbacks"] == {REASON_OTHER_RANK: 1, REASON_SLOTS: 1, REASON_TOO_LARGE: 1}


def test_disabled_backend_fallbacks_say_disabled_and_reset_starts_over():
    runner = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "disabled", "max_bs": 4}}, device="cpu")
    runner.capture()
    runner.forward(decode_batch(2))
    assert runner.run_stats()["eager_fallbacks"] == {REASON_DISABLED: 1}
    runner.stats.reset()
    assert runner.run_stats() == {
        "replays": 0,
        "eager_fallbacks": {},
        "eager_total": 0,
        "padding": [],
        "real_rows": 0,
        "padded_rows": 0,
        "waste": 0.0,
        "pool_mib": None,  # disabled: no capture, no pool
    }


def test_summary_line_names_counts_reasons_and_waste():
    stats = RunStats()
    for size in (3, 3, 4):
        stats.record_replay(size)
    stats.record_fallback(REASON_TOO_LARGE)
    line = format_summary("decode runner full", stats.summary([1, 2, 4]))
    assert line == "decode runner full: 3 replays, 1 eager (too large 1), padding waste 20.0%"


def test_bench_json_and_log_carry_the_run_stats(tmp_path, capsys, caplog, monkeypatch):
    """The bench's JSON has each runner's run_stats; -v logs the one-line summary."""
    import json

    from cuda_graph_runner.cli.bench import command as bench

    # A CPU-capturable backend for the bench: the recording fake instead of the registry's choice.
    from cuda_graph_runner.cli.bench.backends import BackendChoice
    from cuda_graph_runner.cli.command import main

    def plan(phase, selection, config, device, default_max, *_):
        if phase != "decode":
            return [BackendChoice(phase, "disabled", config, None, "eager only")]
        backend = RecordingBackend("cpu", phase="decode")
        return [BackendChoice(phase, "recording", config.with_phase(phase, max_bs=default_max), backend)]

    monkeypatch.setattr(bench, "plan_phase", plan)
    path = tmp_path / "b.json"
    with caplog.at_level(logging.INFO, logger="cuda_graph_runner"):
        args = "bench -v --device cpu --batch-sizes 1 3 --no-prefill --iters 1 --warmup 0 --steps 1 --prompt-len 2"
        code = main([*args.split(), "--json", str(path)])
    capsys.readouterr()
    assert code == 0
    [runner] = json.loads(path.read_text())["runners"]
    stats = runner["run_stats"]
    assert stats["replays"] > 0 and stats["eager_total"] == 0
    assert {p["captured_size"] for p in stats["padding"]} <= set(runner["sizes"])
    assert any("decode runner" in r.getMessage() and "replays" in r.getMessage() for r in caplog.records)


def test_eager_first_a_queued_size_is_decided_once_and_counted_once_as_its_traffic():
    cfg = CudaGraphConfig.from_dict({"decode": {"bs": [1, 2, 4, 8], "capture": "eager_first"}})
    runner = CountingRunner(ToyModel(), cfg, device="cpu", backend=RecordingBackend("cpu"), show_progress=False)
    runner.capture()  # queues the sizes
    assert runner.decide(decode_batch(5)) == EagerDecision(REASON_NOT_CAPTURED_YET, queued=8)
    assert not runner.can_run(decode_batch(5))  # a question: no traffic counted
    assert runner.lazy_capture.observed == {}
    runner.decided.clear()
    runner.forward(decode_batch(5))
    runner.forward(decode_batch(9))
    assert runner.decided == [5, 9]
    assert runner.lazy_capture.observed == {8: 1}
    assert runner.run_stats()["eager_fallbacks"] == {REASON_NOT_CAPTURED_YET: 1, REASON_TOO_LARGE: 1}

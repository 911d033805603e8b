"""``bench_measure.block_means_s``: what each timed block counts (a fake clock, no waiting)."""

from __future__ import annotations

import types

import pytest

from cuda_graph_runner.cli.bench import measure as bench_measure


@pytest.fixture()
def clock(monkeypatch):
    """A clock that only the calls below move: a call costs 0.25 s, a synchronize 1 s."""
    fake = types.SimpleNamespace(now=0.0)
    fake.perf_counter = lambda: fake.now
    monkeypatch.setattr(bench_measure, "time", fake)
    return fake


def _samples(clock, host_only: bool) -> list:
    def call():
        clock.now += 0.25

    def sync():
        clock.now += 1.0

    return bench_measure.block_means_s(call, iters=2, warmup=1, sync=sync, repeats=3, host_only=host_only)


def test_device_time_counts_the_synchronize_that_ends_each_block(clock):
    assert _samples(clock, host_only=False) == [0.75] * 3  # (2 * 0.25 + 1.0) / 2


def test_host_only_counts_the_calls_alone(clock):
    assert _samples(clock, host_only=True) == [0.25] * 3


def test_time_ms_is_the_median_device_time_block_in_ms(clock):
    def call():
        clock.now += 0.25

    def sync():
        clock.now += 1.0

    assert bench_measure.time_ms(call, iters=2, warmup=1, sync=sync) == pytest.approx(750.0)


def test_paired_ms_interleaves_rounds_and_takes_the_median_per_round_ratio(clock):
    """Eager and graph alternate which goes first per round; a stall spoils one round's
    ratio (the spread shows it), not the median."""
    order = []
    eager_costs = iter([9.0] * 2 + [2.0, 2.0, 2.0, 2.0, 40.0, 40.0, 2.0, 2.0, 2.0, 2.0])  # warm-up, then 5 rounds
    graph_costs = iter([9.0] * 2 + [1.0] * 10)

    def eager():
        order.append("e")
        clock.now += next(eager_costs)

    def graph():
        order.append("g")
        clock.now += next(graph_costs)

    got = bench_measure.paired_ms(eager, graph, iters=2, warmup=2, sync=lambda: None, rounds=5)
    assert "".join(order) == "egeg" + "eegg" + "ggee" + "eegg" + "ggee" + "eegg"
    assert got["eager_samples_ms"] == [2000.0, 2000.0, 40000.0, 2000.0, 2000.0]
    assert got["graph_samples_ms"] == [1000.0] * 5
    assert (got["eager_ms"], got["graph_ms"]) == (2000.0, 1000.0)
    assert (got["speedup"], got["speedup_lo"], got["speedup_hi"]) == (2.0, 2.0, 40.0)


def test_paired_ms_refuses_no_rounds():
    with pytest.raises(ValueError, match=r"rounds >= 1 and iters >= 1, got rounds=0, iters=2"):
        bench_measure.paired_ms(lambda: None, lambda: None, iters=2, warmup=0, sync=lambda: None, rounds=0)


def _row(eager, graph=None, **where):
    row = {"batch_size": 2, "backend": "compiled", **where, "eager_samples_ms": eager}
    if graph is not None:
        row["graph_samples_ms"] = graph
    return row


def test_the_busy_note_follows_the_rounds_spread_not_the_load():
    """The note shows when some row's slowest round is more than BUSY_SPREAD times its
    fastest (eager or graph), names that row, its spread and the threshold; steady rounds
    give no note whatever the machine's load."""
    steady = [_row([1.0, 1.2, 1.1], [0.5, 0.55, 0.6]), _row([2.0, 2.1], backend="disabled")]
    assert bench_measure.busy_note(steady) == ""
    just_within = [_row([1.0, 2.0, 1.5])]  # exactly the threshold: not more than it
    assert bench_measure.BUSY_SPREAD == 2.0 and bench_measure.busy_note(just_within) == ""
    stalled = steady + [_row([1.0, 1.1], [0.5, 6.0], batch_size=4)]
    note = bench_measure.busy_note(stalled)
    assert "decode batch 4 (backend compiled) spread 12.0x" in note and "above 2.0x" in note, note
    prefill = [{"num_tokens": 16, "requests": 4, "backend": "disabled", "eager_samples_ms": [3.0, 9.5]}]
    assert "prefill 16 tokens in 4 requests (backend disabled) spread 3.2x" in bench_measure.busy_note(prefill)
    assert bench_measure.busy_note(stalled, threshold=20.0) == ""
    assert bench_measure.busy_note([{"batch_size": 1, "eager_ms": 1.0}, _row([5.0])]) == ""  # no two rounds


def test_an_eager_only_row_keeps_its_rounds(clock):
    """Rows without a backend keep their per-round samples, so the busy note sees them too."""
    costs = iter([1.0] + [0.25] * 3 + [4.0] * 3)

    def eager(batch):
        clock.now += next(costs)

    got = bench_measure.row_times(eager, None, "batch", iters=1, warmup=1, sync=lambda: None, rounds=6)
    assert got["eager_samples_ms"] == [250.0] * 3 + [4000.0] * 3 and got["eager_ms"] == pytest.approx(2125.0)
    assert "spread 16.0x" in bench_measure.busy_note([{"batch_size": 1, **got}])

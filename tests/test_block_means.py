"""``bench_measure.block_means_s``: what each timed block counts (a fake clock, no waiting)."""

from __future__ import annotations

import types

import pytest

from cuda_graph_runner import bench_measure


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


@pytest.mark.parametrize(
    "threads, cpus, load, noted",
    [(2, 2, 1.5, True), (2, 2, 0.3, False), (1, 2, 5.0, False), (4, 16, 3.0, False), (16, 16, 2.0, True)],
)
def test_a_busy_machine_is_noted_when_its_load_leaves_the_threads_no_cpus(threads, cpus, load, noted):
    note = bench_measure.cpu_contention_note(threads, cpus=cpus, load=load)
    assert bool(note) == noted
    if noted:
        assert f"load average {load:.1f} on {cpus} CPUs" in note and "OMP_NUM_THREADS=1" in note

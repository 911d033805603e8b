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

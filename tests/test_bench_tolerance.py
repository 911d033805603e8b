"""The bench judges a graph result by its backend's tolerance on the same inputs
(teacher-forced), not by free-running greedy tokens, which part at near-ties when a
backend's kernels round differently (tc_piecewise:inductor in bfloat16 on the H200)."""

from __future__ import annotations

import types

import pytest
import torch

from cuda_graph_runner.cli.bench.measure import bench_decode, bench_prefill, within_tolerance
from cuda_graph_runner.reference.batches import eager_logits_fn
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM


class _OffsetRunner:
    """Eager logits plus ``offset`` (a stand-in for a graph backend's rounding or bug)."""

    def __init__(self, model, offset: float, tolerance=(1e-4, 1e-3)):
        self.eager = eager_logits_fn(model)
        self.offset = offset
        self.backend = types.SimpleNamespace(verify_tolerance=lambda dtype: tolerance)

    def forward(self, batch):
        return self.eager(batch) + self.offset

    def can_run(self, batch):
        return False  # no replay_prepare timing for a stand-in


@pytest.fixture(scope="module")
def model():
    m = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cpu")
    m.create_kv_cache(num_slots=4 * 64 + 1, max_reqs=5, max_context_len=64)
    return m


def _decode(model, runner):
    with torch.no_grad():
        return bench_decode(model, runner, batch_sizes=[2], prompt_len=5, steps=3, iters=1, warmup=0)[0]


def test_a_result_within_the_backends_tolerance_passes(model):
    row = _decode(model, _OffsetRunner(model, 5e-5))
    assert row["within_tolerance"] is True and 0 < row["max_abs_diff"] < 1e-4
    assert row["tokens_match"] is True


def test_a_result_outside_it_fails_even_when_tokens_agree(model):
    # A constant shift keeps every argmax (tokens agree) but is a wrong result.
    row = _decode(model, _OffsetRunner(model, 0.5))
    assert row["tokens_match"] is True
    assert row["within_tolerance"] is False and row["max_abs_diff"] == pytest.approx(0.5, rel=1e-3)


def test_a_wider_tolerance_is_the_backends_own(model):
    row = _decode(model, _OffsetRunner(model, 0.5, tolerance=(1.0, 0.0)))
    assert row["within_tolerance"] is True


def test_prefill_rows_are_judged_the_same_way(model):
    with torch.no_grad():
        rows = bench_prefill(model, _OffsetRunner(model, 0.5), token_counts=[8], requests=[1], iters=1, warmup=0)
    assert rows[0]["within_tolerance"] is False and rows[0]["argmax_match"] is True


def test_within_tolerance_compares_token_ids_exactly_and_logits_within_it():
    tokens = torch.tensor([30000, 5])
    assert within_tolerance(tokens, tokens.clone(), 0.05, 0.05)
    # One id apart: inside 0.05 + 0.05 * 30000, yet a different token.
    assert not within_tolerance(tokens + torch.tensor([1, 0]), tokens, 0.05, 0.05)
    assert not within_tolerance(tokens[:1], tokens, 1e9, 1e9)
    assert within_tolerance(torch.tensor([1.0]), torch.tensor([1.01]), 0.05, 0.0)
    assert not within_tolerance(torch.tensor([1.0]), torch.tensor([1.2]), 0.05, 0.0)

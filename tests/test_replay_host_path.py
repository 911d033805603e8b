"""The replay path's host work with the optional features off: profiler ranges, eager-through
mode, sleep, the weights check, verify mode, padded eager and data parallelism each cost at
most an attribute test (the profiler: one C flag) per replay, decided when the runner is
built, never a call into their machinery, an environment read or a context manager of theirs.

What is counted is calls, through ``sys.setprofile`` over whole ``forward`` calls (never
wall-clock time); each feature turned on shows up in the same count, so the counter sees it.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from typing import Any, Callable, Dict

import pytest
import torch

from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.runner import DecodeCudaGraphRunner, DraftDecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend

REPLAYS = 6

#: Where a feature's per-replay machinery lives: no call may land here while it is off.
_FEATURE_FILES = {
    "profiling": os.path.join("backend", "profiling.py"),
    "eager_through": os.path.join("runner", "eager_through.py"),
    "sleep": os.path.join("runner", "sleep.py"),
    "weights": os.path.join("runner", "weights.py"),
    "verify": os.path.join("runner", "verify.py"),
    "padded_eager": os.path.join("runner", "padded_eager.py"),
    "data_parallel": "data_parallel.py",
    "dp_group": os.path.join("runner", "dp_group.py"),
    "envs": os.path.join("backend", "envs.py"),
    "torch profiler": os.path.join("torch", "autograd", "profiler.py"),
    "torch.profiler": os.path.join("torch", "profiler", ""),
    "environment": os.sep + "os.py",
}


class _StoredOutputBackend(RecordingBackend):
    """Replays by returning the captured output (RecordingBackend re-runs the forward)."""

    def replay(self, key: Any, static_batch: ForwardBatch) -> Any:
        return self._outputs[key]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1), requires_grad=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return batch.input_ids.float()[:, None] + self.w

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return torch.cat([hidden, -hidden], dim=-1)


def _decode_batch(bs: int, slots_per_req: int = 1) -> ForwardBatch:
    seq = torch.arange(bs, dtype=torch.int32) + 7
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.arange(bs) + 1,
        positions=torch.arange(bs) + 3,
        out_cache_loc=torch.arange(bs * slots_per_req) + 9,
        req_pool_indices=torch.arange(bs) + 1,
        seq_lens=seq,
        seq_lens_cpu=seq.tolist(),
    )


def _extend_batch(lengths: list) -> ForwardBatch:
    tokens, n = sum(lengths), len(lengths)
    lens = torch.tensor(lengths, dtype=torch.int32)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.arange(tokens) + 1,
        positions=torch.arange(tokens),
        out_cache_loc=torch.arange(tokens) + 1,
        req_pool_indices=torch.arange(n) + 1,
        seq_lens=lens,
        extend_seq_lens=lens,
        extend_prefix_lens=torch.zeros(n, dtype=torch.int32),
        seq_lens_cpu=list(lengths),
        extend_seq_lens_cpu=list(lengths),
        extend_prefix_lens_cpu=[0] * n,
    )


def _decode(extra: Dict[str, Any]) -> tuple:
    cfg = {"decode": {"bs": [2, 4, 8], "max_bs": 8, **extra}}
    return DecodeCudaGraphRunner(
        _Model(), cfg, backend=_StoredOutputBackend("cpu"), show_progress=False
    ), _decode_batch(5)


def _draft(extra: Dict[str, Any]) -> tuple:
    cfg = {"decode": {"bs": [2, 4, 8], "max_bs": 8, **extra}}
    runner = DraftDecodeCudaGraphRunner(
        _Model(), cfg, num_steps=3, backend=_StoredOutputBackend("cpu"), show_progress=False
    )
    return runner, _decode_batch(5, slots_per_req=3)


def _prefill(extra: Dict[str, Any]) -> tuple:
    cfg = {"prefill": {"bs": [64, 128], "max_bs": 128, **extra}}
    backend = _StoredOutputBackend("cpu", phase="prefill")
    return PrefillCudaGraphRunner(_Model(), cfg, backend=backend, show_progress=False), _extend_batch([40, 30, 30])


RUNNERS: Dict[str, Callable[[Dict[str, Any]], tuple]] = {"decode": _decode, "draft": _draft, "prefill": _prefill}


def _calls_per_forward(runner: Any, batch: ForwardBatch, replays: int = REPLAYS) -> Counter:
    """Calls of each feature's machinery (and of ``profiler_enabled``'s C flag and of
    ``graph_forward``) over ``replays`` forwards of ``batch``, after one unprofiled forward."""
    runner.forward(batch)  # plans and static batches built: what follows is the steady path
    seen: Counter = Counter()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            filename = frame.f_code.co_filename
            for feature, where in _FEATURE_FILES.items():
                if where in filename:
                    seen[feature] += 1
            if frame.f_code.co_name == "graph_forward":
                seen["graph_forward"] += 1
        elif event == "c_call" and getattr(arg, "__name__", "") == "_profiler_enabled":
            seen["profiler flag"] += 1

    sys.setprofile(profile)
    try:
        for _ in range(replays):
            runner.forward(batch)
    finally:
        sys.setprofile(None)
    assert runner.stats.summary(runner.capture_sizes)["replays"] == replays + 1  # every one a replay
    return seen


@pytest.fixture(autouse=True)
def _no_switches(monkeypatch):
    for name in ("CUDA_GRAPH_RUNNER_EAGER_THROUGH", "CUDA_GRAPH_RUNNER_VERIFY", "CUDA_GRAPH_RUNNER_VERIFY_EVERY"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_a_replay_with_every_feature_off_calls_none_of_their_machinery(kind):
    runner, batch = RUNNERS[kind]({})
    runner.capture()
    seen = _calls_per_forward(runner, batch)
    assert seen.pop("profiler flag", 0) <= REPLAYS  # the one C flag per replay
    assert seen.pop("graph_forward", 0) == 0  # the backend replays; nothing runs the forward
    assert not seen, f"{kind} replay with every feature off called into {dict(seen)} over {REPLAYS} replays"


@pytest.mark.parametrize("kind", sorted(RUNNERS))
def test_each_feature_on_is_seen_by_the_same_count(kind):
    # The control: a count that cannot see a feature's calls would pass the test above vacuously.
    runner, batch = RUNNERS[kind]({"eager_through": True, "check_weights_every": 1})
    runner.capture()
    seen = _calls_per_forward(runner, batch)
    assert seen["graph_forward"] == REPLAYS  # eager-through runs the forward on every replay
    assert seen["weights"] >= REPLAYS  # the weights check on every replay
    runner, batch = RUNNERS[kind]({})
    runner.capture()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        seen = _calls_per_forward(runner, batch, replays=2)
    assert seen["profiler flag"] == 2 and seen["torch profiler"] >= 2  # a named range per replay

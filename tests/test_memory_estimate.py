"""estimate_graph_memory on emulated graphs with an emulated shared pool: every size of
every phase captured against the smallest KV cache of the engine's dimensions, the same
pool as the real capture, everything given back."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.memory_estimate import FEWEST_SLOTS, estimate_graph_memory
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.reference_setup import reference_model

# Emulated graphs re-run the whole forward: the reference prefill reads host lengths in it.
CONFIG = {"decode": {"bs": [1, 2, 4]}, "prefill": {"bs": [16, 32], "host_value_guard": False}}


class SharedPoolBackend(RecordingBackend):
    """Emulated graphs whose outputs live in one pool shared by the backends given the
    same dict (as decode and prefill share the device's pool); ``graph_memory_bytes``
    counts it."""

    def __init__(self, pool, *args, **kwargs):
        super().__init__(*args, share_pool=True, **kwargs)
        self._pool = pool

    def graph_memory_bytes(self):
        return sum(t.numel() * t.element_size() for t in self._pool.values())


def backends():
    pool: dict = {}
    return {
        "decode": SharedPoolBackend(pool, "cpu", phase="decode"),
        "prefill": SharedPoolBackend(pool, "cpu", phase="prefill"),
    }


def test_estimate_equals_the_real_capture_and_gives_everything_back():
    model = reference_model("tiny", requests=4, context=64, device="cpu")
    real_cache = model.kv_cache
    chosen = backends()
    estimate = estimate_graph_memory(model, CONFIG, max_reqs=5, max_context_len=64, backends=chosen)
    assert model.kv_cache is real_cache  # put back
    assert (estimate.max_reqs, estimate.max_context_len, estimate.num_slots) == (5, 64, FEWEST_SLOTS)
    # Every size captured once, then given back.
    assert len(chosen["decode"].captured()) == 3 and len(chosen["prefill"].captured()) == 2
    assert chosen["decode"].graph_memory_bytes() == 0 and ("cleanup",) in chosen["prefill"].events
    decode, prefill = estimate.phases["decode"], estimate.phases["prefill"]
    assert (decode.sizes, prefill.sizes) == ([4, 2, 1], [32, 16])
    assert decode.pool_bytes > 0 and prefill.pool_bytes >= 0
    assert decode.static_buffer_bytes > 0
    assert estimate.outside_pool_counted is False and estimate.outside_pool_bytes is None  # the CPU cannot tell

    # The real capture, on the real (larger) cache, into a fresh shared pool.
    real = backends()
    cfg = CudaGraphConfig.from_dict(CONFIG)
    runners = [
        DecodeCudaGraphRunner(model, cfg, backend=real["decode"], show_progress=False),
        PrefillCudaGraphRunner(model, cfg, backend=real["prefill"], show_progress=False),
    ]
    runners[0].capture()
    assert runners[0].graph_memory_bytes() == decode.pool_bytes
    runners[1].capture()
    assert runners[1].graph_memory_bytes() == estimate.pool_bytes == estimate.total_bytes
    assert estimate.pool_bytes == decode.pool_bytes + prefill.pool_bytes
    assert estimate.to_dict()["phases"]["decode"]["sizes"] == [4, 2, 1]


def test_estimate_runs_on_a_cache_of_the_given_dimensions_and_restores_on_failure():
    model = reference_model("tiny", requests=2, context=16, device="cpu")
    real_cache = model.kv_cache
    seen = []

    class Failing(RecordingBackend):
        def capture_one(self, key, forward_fn, **kwargs):
            cache = model.kv_cache
            seen.append((cache.k_buffers[0].shape[0], tuple(cache.req_to_token.shape)))
            raise RuntimeError("no memory for this")

    with pytest.raises(RuntimeError, match="no memory"):
        estimate_graph_memory(
            model, CONFIG, max_reqs=7, max_context_len=48, phases=["decode"], backends={"decode": Failing("cpu")}
        )
    assert seen == [(FEWEST_SLOTS, (7, 48))]
    assert model.kv_cache is real_cache


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"max_reqs": 1, "max_context_len": 8}, "max_reqs=1"),
        ({"max_reqs": 4, "max_context_len": 0}, "max_context_len=0"),
        ({"max_reqs": 4, "max_context_len": True}, "max_context_len=True"),
        ({"max_reqs": 4, "max_context_len": 8, "phases": ["extend"]}, "'extend'"),
    ],
)
def test_bad_dimensions_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        estimate_graph_memory(torch.nn.Linear(1, 1), **kwargs)


def test_a_model_without_a_kv_cache_maker_is_told_what_to_pass():
    with pytest.raises(TypeError, match="make_kv_cache"):
        estimate_graph_memory(torch.nn.Linear(1, 1), max_reqs=4, max_context_len=8)

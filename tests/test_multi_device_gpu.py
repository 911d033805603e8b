"""GPU: a runner on ``cuda:1`` while device 0 is current, and the graph-memory estimate.

For full, breakable and tc_piecewise: the ``tiny`` reference model in float32 on
``cuda:1`` with ``cuda:0`` current; capture; a decode step for 5 requests replays equal
to eager; torch warns no "CUDA Graph is empty"; nothing is allocated on ``cuda:0``
(its peak) and its reserved memory does not grow; the current device stays 0. Needs two GPUs (kind ``nvidia-h200-x2``).
"""

from __future__ import annotations

import gc
import warnings

import pytest
import torch

from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.capture_report import ESTIMATE_FACTOR, ESTIMATE_SLACK_BYTES

pytestmark = pytest.mark.gpu

BACKENDS = ["full", "breakable", "tc_piecewise"]


def _two_gpus() -> None:
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.skip(f"needs 2 CUDA devices (a runner on cuda:1 while cuda:0 is current); this machine has {n}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_runner_on_cuda1_while_cuda0_is_current_replays_eager(backend):
    _two_gpus()
    torch.cuda.set_device(0)
    dev = torch.device("cuda", 1)
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device=dev)
    model.create_kv_cache(num_slots=16 * 64 + 1, max_reqs=17, max_context_len=64)
    cache = model.kv_cache
    torch.cuda.synchronize(0)
    # An allocation on cuda:0 shows in its peak; its reserved memory may only shrink (a
    # capture empties the cache on every device, releasing blocks earlier tests left free).
    gc.collect()
    torch.cuda.empty_cache()
    reserved0 = torch.cuda.memory_reserved(0)
    allocated0 = torch.cuda.memory_allocated(0)
    torch.cuda.reset_peak_memory_stats(0)
    config = {"decode": {"backend": backend, "max_bs": 8}}
    if backend == "tc_piecewise":
        config["decode"]["tc_compiler"] = "eager"
    runner = DecodeCudaGraphRunner(model, config, show_progress=False)
    assert runner.device == dev and runner.backend.device == dev
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        runner.capture()
        session = GreedySession(model, cache)
        session.prefill(make_dummy_prompts(5, [3, 4, 5, 6, 7], model.config.vocab_size, seed=5))
        batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
        expected = eager_logits_fn(model)(batch).clone()
        assert runner.can_run(batch)
        got = runner.forward(batch).clone()
        torch.cuda.synchronize(dev)
    empty = [str(w.message) for w in caught if "graph is empty" in str(w.message).lower()]
    assert not empty, f"{backend}: torch warned {empty}"
    assert torch.cuda.current_device() == 0, "the runner left another device current"
    assert got.device == dev and got.shape == expected.shape == (5, model.config.vocab_size)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    torch.cuda.synchronize(0)
    assert torch.cuda.max_memory_allocated(0) <= allocated0, "the runner on cuda:1 allocated on cuda:0"
    assert torch.cuda.memory_reserved(0) <= reserved0, "the runner on cuda:1 reserved memory on cuda:0"
    session.close()
    runner.cleanup()


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_graph_memory_after_the_largest_size_bounds_the_final_pool(backend):
    """The documented accuracy of ``capture(sizes=[max_size])`` + ``graph_memory_bytes()``."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from cuda_graph_runner.backend.pool import reset_global_graph_memory_pools

    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cuda")
    model.create_kv_cache(num_slots=64 * 64 + 1, max_reqs=65, max_context_len=64)
    reset_global_graph_memory_pools()  # a pool of its own: other tests' graphs must not count
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "max_bs": 64}}, show_progress=False)
    with torch.no_grad():
        first = runner.capture(sizes=[runner.max_size])
        estimate = runner.graph_memory_bytes()
        assert first.sizes == [64] and first.first_size_pool_bytes == estimate
        rest = runner.capture()
    final = runner.graph_memory_bytes()
    assert estimate is not None and estimate > 0 and final is not None
    assert rest.sizes == sorted(runner.capture_sizes, reverse=True)[1:]
    print(f"{backend}: estimate {estimate / 2**20:.1f} MiB, final {final / 2**20:.1f} MiB")
    assert estimate <= final <= ESTIMATE_FACTOR * estimate + ESTIMATE_SLACK_BYTES
    runner.cleanup()
    reset_global_graph_memory_pools()

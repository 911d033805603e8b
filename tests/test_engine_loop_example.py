"""examples/engine_loop.py on the CPU: the continuous-batching engine through emulated graphs
that really replay (``full`` decode, ``breakable`` prefill) gives the tokens of an eager run
of the same schedule in float32 (greedy and seeded temperature sampling), chunks its
prefills, replays its decode steps, stops on ``max_new_tokens`` and on a stop token, keeps
owned logits, frees the cache, and reports its statistics. GPU: test_engine_loop_example_gpu.py.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch

from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "engine_loop.py"


def _load():
    spec = importlib.util.spec_from_file_location("engine_loop", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


engine_loop = _load()
SHAPE = dict(max_running=4, chunk_size=8, prefill_token_budget=16)


@pytest.fixture(scope="module")
def model():
    return ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cpu")


def _emulated():
    return {
        "decode_backend": FullCudaGraphBackend(
            "cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="p"
        ),
        "prefill_backend": BreakableCudaGraphBackend(
            "cpu", phase="prefill", device_module=EmulatedGraphDeviceModule(), memory_pool="p"
        ),
    }


@pytest.fixture(scope="module")
def runs(model):
    requests = engine_loop.workload(
        5, model.config.vocab_size, temperature=0.9, seed=3, prompt_lens=(5, 20), new_tokens=(3, 7)
    )
    graphs = engine_loop.run_engine(model, requests, keep_logits=True, **_emulated(), **SHAPE)
    eager = engine_loop.run_engine(model, requests, decode_backend="disabled", prefill_backend="disabled", **SHAPE)
    return requests, graphs, eager


def test_tokens_equal_an_eager_run_of_the_same_schedule(runs):
    requests, (graphs, stats), (eager, eager_stats) = runs
    assert [r.output for r in graphs] == [r.output for r in eager]
    assert all(r.finish_reason == "length" and len(r.output) == p.max_new_tokens for r, (_, p) in zip(graphs, requests))
    # Both sampling paths ran, and the seeded one is not the greedy one.
    sampled = [r for r in graphs if r.params.temperature > 0]
    assert sampled and any(r.output[1:] != [int(x.argmax()) for x in r.logits[1:]] for r in sampled)
    assert stats.generated_tokens == eager_stats.generated_tokens == sum(p.max_new_tokens for _, p in requests)


def test_prefill_is_chunked_and_decode_replays(runs):
    requests, (graphs, stats), _ = runs
    assert stats.prompt_tokens == sum(len(p) for p, _ in requests)
    longest = max(len(p) for p, _ in requests)
    assert longest > SHAPE["chunk_size"] and stats.prefill_batches >= longest // SHAPE["chunk_size"]
    assert stats.decode_runner["replays"] == stats.decode_batches > 0
    assert stats.decode_runner["eager_total"] == 0
    assert stats.prefill_runner["replays"] > 0
    text = "\n".join(stats.lines())
    assert "tokens/s" in text and "decode runner:" in text and "padding waste" in text


def test_kept_logits_are_owned_and_match_the_tokens(runs):
    _, (graphs, _), _ = runs
    greedy = [r for r in graphs if r.params.temperature == 0]
    assert greedy
    for request in greedy:
        assert [int(x.argmax()) for x in request.logits] == request.output
    pointers = {x.untyped_storage().data_ptr() for r in graphs for x in r.logits}
    assert len(pointers) > 1  # not one graph output buffer, overwritten by every replay


def test_stop_token_ends_a_request_and_frees_its_row(model):
    prompt = engine_loop.workload(1, model.config.vocab_size, temperature=0.0, seed=5, prompt_lens=(6, 6))[0][0]
    params = engine_loop.SamplingParams(max_new_tokens=8)
    [free], _ = engine_loop.run_engine(model, [(prompt, params)], **SHAPE)
    stop = free.output[2]
    first = free.output.index(stop)
    stopped_params = engine_loop.SamplingParams(max_new_tokens=8, stop_token_ids=(stop,))
    [stopped], stats = engine_loop.run_engine(model, [(prompt, stopped_params)], **SHAPE)
    assert stopped.output == free.output[: first + 1] and stopped.finish_reason == "stop"
    assert stats.finished == {"stop": 1}
    assert model.kv_cache.num_free_requests == model.kv_cache.max_reqs - 1


def test_bad_requests_are_refused_with_the_reason(model):
    cache = model.create_kv_cache(num_slots=65, max_reqs=3, max_context_len=32)
    decode, prefill = engine_loop.build_runners(model, max_running=2, prefill_token_budget=8, decode_backend="disabled")
    engine = engine_loop.Engine(model, cache, decode, prefill, max_running=2, chunk_size=4, prefill_token_budget=8)
    with pytest.raises(ValueError, match="non-empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="exceeds the cache's context 32"):
        engine.add_request([1] * 30, engine_loop.SamplingParams(max_new_tokens=8))
    small = model.create_kv_cache(num_slots=17, max_reqs=3, max_context_len=32)
    tight = engine_loop.Engine(model, small, decode, prefill, max_running=2, chunk_size=4, prefill_token_budget=8)
    with pytest.raises(ValueError, match="more KV slots than the cache has"):
        tight.add_request([1] * 12, engine_loop.SamplingParams(max_new_tokens=8))
    with pytest.raises(ValueError, match="owned_outputs"):
        engine_loop.Engine(model, cache, decode, prefill, keep_logits=True)

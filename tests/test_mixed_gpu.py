"""GPU: the mixed runner (prefill chunks and decodes in one CUDA graph per requests x
tokens key) on llama-3.2-1b in bfloat16, replay against eager within the model's
tolerance in a continuous-batching schedule with chunked prefill:

* ``full`` with the ``triton`` attention (the replay hook re-plans each key's extend tile
  table from the slot-padded host lengths);
* ``breakable`` with ``triton`` and, when importable, ``flashinfer`` (attention runs
  eagerly between the graph's segments);
* ``full`` with ``flashinfer`` is refused (its replay hook re-plans decode graphs only).

Run on the device machine: ``python -m pytest -m gpu tests/test_mixed_gpu.py``.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Dict, List

import pytest
import torch

from cuda_graph_runner.config import CudaGraphConfigError
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import MixedCudaGraphRunner
from cuda_graph_runner.runner.decision import ReplayDecision
from cuda_graph_runner.runner.mixed import choose_key
from cuda_graph_runner.runner.stats import REASON_NO_KEY
from cuda_graph_runner.testing.tolerances import model_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (extra [triton])"),
]

CONTEXT = 512
TOKENS = [64, 160, 288]
REQUESTS = [4, 16, 32]
CHUNK = 128


def _flashinfer() -> Any:
    if importlib.util.find_spec("flashinfer") is None:
        return pytest.param("flashinfer", marks=pytest.mark.skip(reason="flashinfer is not importable here"))
    return "flashinfer"


def llama(attention: str, requests: int = 40) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_preset(
        "llama-3.2-1b", dtype=torch.bfloat16, device="cuda", attention=attention
    )
    model.create_kv_cache(num_slots=requests * CONTEXT + 1, max_reqs=requests + 1, max_context_len=CONTEXT)
    return model


def mixed_runner(model: Any, backend: str) -> MixedCudaGraphRunner:
    config = {"prefill": {"backend": backend, "mixed_tokens": TOKENS, "mixed_requests": REQUESTS}}
    return MixedCudaGraphRunner(model, config, show_progress=False)


@pytest.mark.parametrize(
    "backend,attention", [("full", "triton"), ("breakable", "triton"), pytest.param("breakable", _flashinfer())]
)
def test_continuous_batching_with_chunked_prefill_replays_close_to_eager(backend, attention):
    model = llama(attention)
    runner = mixed_runner(model, backend)
    cache = model.kv_cache
    eager = eager_logits_fn(model)
    tol = model_tolerance(model.config, torch.bfloat16, context_len=CONTEXT)
    vocab = model.config.vocab_size
    arrivals = {0: [300, 40], 1: [20] * 12, 3: [260], 5: [20] * 20}
    waiting: List[List[Any]] = []  # [row, tokens left to prefill]
    decoding: Dict[int, int] = {}  # row -> decodes done
    replayed = mixed = 0
    with torch.no_grad():
        runner.capture()
        keys = list(runner.captured_keys)
        seed = 0
        for step in range(12):
            for n in arrivals.get(step, []):
                waiting.append([cache.alloc_request(), make_dummy_prompts(1, [n], vocab, seed=seed)[0]])
                seed += 1
            rows: List[int] = []
            tokens: List[List[int]] = []
            if waiting:  # one prefill chunk per step, the oldest prompt first
                row, left = waiting[0]
                rows.append(row)
                tokens.append(left[:CHUNK])
                waiting[0][1] = left[CHUNK:]
            for row in decoding:
                rows.append(row)
                tokens.append([(row * 31 + decoding[row]) % vocab])
            batch = make_extend_batch(cache, tokens, rows=rows)
            if waiting and not waiting[0][1]:
                decoding[waiting.pop(0)[0]] = 0
            decision = runner.decide(batch)
            want = choose_key(keys, len(rows), batch.num_tokens)
            assert getattr(decision, "key", None) == want, f"step {step}"
            expected = eager(batch).clone()
            got = runner.forward(batch).clone()
            torch.testing.assert_close(got, expected, **tol, msg=lambda m: f"step {step} ({len(rows)} requests): {m}")
            replayed += isinstance(decision, ReplayDecision)
            mixed += isinstance(decision, ReplayDecision) and len(rows) > 1 and len(tokens[0]) > 1
            for row in list(decoding):
                if len(tokens[rows.index(row)]) == 1:
                    decoding[row] += 1
                    if decoding[row] == 6:
                        del decoding[row]
                        cache.free_request(row)
        stats = runner.run_stats()
    assert mixed >= 5 and stats["replays"] == replayed
    assert set(stats["eager_fallbacks"]) <= {REASON_NO_KEY}
    assert stats["shape_waste"]["tokens"] > 0


def test_full_with_flashinfer_is_refused_naming_the_attention():
    if importlib.util.find_spec("flashinfer") is None:
        pytest.skip("flashinfer is not importable here")
    with pytest.raises(CudaGraphConfigError, match="attention 'flashinfer'") as info:
        mixed_runner(llama("flashinfer", requests=4), "full")
    assert info.value.key == "backend" and "breakable" in str(info.value)

"""GPU: compiled full (``full`` with ``tc_compiler: inductor``) in a sequence of runners on
one model, as ``benchmarks/run.py`` makes them: a compiled-full runner, a tc_piecewise
runner on the same model (its forward dispatcher stays after its cleanup), both cleaned
up, then a new compiled-full runner of another config ("largest size alone"), a
target-verify one, and the first runner captured again. Every runner compiles the
model's forward as written (never the dispatcher, which Dynamo cannot trace), with
Dynamo's package cache on, and computes what eager does.

Run on the device machine: ``pytest -m gpu tests/test_runner_sequences_gpu.py``
(inductor builds Triton kernels: a minute or two cold).
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled full needs a CUDA device"),
]


def _runner(model, options, width=1):
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    runner = DecodeCudaGraphRunner(model, {"decode": options}, show_progress=False, mode=mode, num_tokens_per_req=width)
    runner.capture()
    return runner


def _check(model, runner, bs, seed, width=1):
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(bs, [4 + (i % 5) for i in range(bs)], model.config.vocab_size, seed=seed))
    session.decode()
    drafts = [[t[-1]] * width for t in session.tokens]
    batch = make_decode_batch(
        model.kv_cache, session.rows, None, drafts if width > 1 else [t[-1] for t in session.tokens]
    )
    with torch.no_grad():
        expected = eager_logits_fn(model)(batch).clone()
        got = runner.forward(batch)
    torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=f"bs {bs}, width {width}")
    session.close()


def test_compiled_full_runners_in_sequence_with_tc_piecewise_on_one_model(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cuda")
    model.create_kv_cache(num_slots=40 * 64 + 1, max_reqs=41, max_context_len=64)
    compiled_full = {"backend": "full", "tc_compiler": "inductor"}
    first = _runner(model, {**compiled_full, "bs": [1, 4], "compile_sizes": [4]})
    tc = _runner(model, {"backend": "tc_piecewise", "bs": [1, 4]})
    _check(model, first, 3, seed=1)
    _check(model, tc, 3, seed=2)
    first.cleanup()
    tc.cleanup()  # its dispatcher stays on the model until the backend is uninstalled
    alone = _runner(model, {**compiled_full, "bs": [8], "max_bs": 8})
    verify = _runner(model, {**compiled_full, "bs": [2]}, width=2)
    _check(model, alone, 8, seed=3)
    _check(model, verify, 2, seed=4, width=2)
    first.capture()  # the first runner again, next to the others
    _check(model, first, 4, seed=5)
    _check(model, alone, 5, seed=6)
    for runner in (first, alone, verify):
        runner.cleanup()
    tc.backend.uninstall()
    assert "forward" not in model.__dict__
    torch._dynamo.reset()

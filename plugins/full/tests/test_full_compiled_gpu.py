"""GPU: compiled full (``torch_compile: true`` on ``full``) — the forward compiled with
inductor, then captured whole per size.

Checks: one Dynamo graph for every size >= 2 plus one for size 1, none made while
capturing or serving; a replay equals the compiled forward run without the graph (same
kernels: near-exact); greedy tokens equal eager's in bf16; a second start compiles from
the disk cache (Dynamo's traced code loaded, nothing traced or generated) and computes
what eager does; sizes of ``compile_sizes`` get static graphs, with the marked ops'
bodies compiled too, that match eager. The bench's ``full+torch_compile`` on its default
model: tests/test_bench_tolerance_gpu.py.

Run on the device machine: ``pytest -m gpu plugins/full/tests/test_full_compiled_gpu.py``
(inductor builds Triton kernels: about a minute cold).
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import as_static_batch, forward_context
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    greedy_generate,
    make_decode_batch,
    make_dummy_prompts,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled full needs a CUDA device"),
]

SIZES = [1, 2, 4, 8, 16]


def _model(dtype):
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=dtype, device="cuda")
    model.create_kv_cache(num_slots=40 * 64 + 1, max_reqs=41, max_context_len=64)
    return model


@pytest.fixture(scope="module")
def compiled_fp32(tmp_path_factory):
    torch._dynamo.reset()
    model = _model(torch.float32)
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"backend": "full", "bs": SIZES, "torch_compile": True}}, show_progress=False
    )
    with pytest.MonkeyPatch.context() as mp:  # an empty compile cache: Dynamo traces (graph counts below)
        mp.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path_factory.mktemp("compile-cache")))
        runner.capture()
    yield model, runner
    runner.cleanup()


def _step(model, bs, seed):
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(bs, [4 + (i % 5) for i in range(bs)], model.config.vocab_size, seed=seed))
    session.decode()
    return session, make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])


def test_one_graph_for_sizes_from_two_one_for_size_one_and_no_recompile(compiled_fp32):
    model, runner = compiled_fp32
    backend = runner.backend
    assert backend.compiler == "inductor" and backend.compiled_forward is not None
    assert backend.compiled_forward.dynamo_graphs == 2  # sizes >= 2 share one; 1 is specialized
    assert backend.compile_seconds is not None and backend.compile_seconds > 0
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        for bs in (1, 3, 5, 16, 2):
            session, batch = _step(model, bs, seed=bs)
            runner.forward(batch)
            # The compiled forward run without a graph on a batch of the captured type must not
            # recompile either (a plain ForwardBatch costs one more graph: verify mode's first
            # reference, documented in full's verify_reference).
            static = as_static_batch(batch)
            with backend._compiled_active(), forward_context(static):
                model.compute_logits(model.forward(static), static)
            session.close()
    assert backend.compiled_forward.dynamo_graphs == 2
    assert "forward" not in model.__dict__  # eager fallback sees the model as written


def test_replay_equals_the_compiled_forward_without_graphs(compiled_fp32):
    model, runner = compiled_fp32
    for bs in (1, 3, 8, 16):
        with torch.no_grad():
            session, batch = _step(model, bs, seed=100 + bs)
            key, static = runner.replay_prepare(batch)
            with runner.backend._compiled_active(), forward_context(static):
                expected = runner.graph_forward(static)[:bs].clone()  # same padded shape, same kernels
            got = runner.forward(batch).clone()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"bs {bs}")
        session.close()


def test_compiled_full_matches_eager_within_fp32_tolerance(compiled_fp32):
    model, runner = compiled_fp32
    eager = eager_logits_fn(model)
    for bs in (1, 5, 16):
        with torch.no_grad():
            session, batch = _step(model, bs, seed=200 + bs)
            expected = eager(batch).clone()
            got = runner.forward(batch)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=f"bs {bs}")
        session.close()


def test_greedy_tokens_match_eager_bf16():
    torch._dynamo.reset()
    model = _model(torch.bfloat16)
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"backend": "full", "bs": [1, 2, 4], "torch_compile": True}}, show_progress=False
    )
    runner.capture()
    prompts = make_dummy_prompts(3, [5, 9, 12], model.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = greedy_generate(model, model.kv_cache, prompts, 8)
        got = greedy_generate(model, model.kv_cache, prompts, 8, decode_fn=lambda b: runner.forward(b).clone())
    assert got == expected
    runner.cleanup()


def test_second_start_compiles_from_the_disk_cache(tmp_path, monkeypatch):
    from cuda_graph_runner.backend import cache_counters

    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))
    model = _model(torch.float32)
    counts = []
    for _ in range(2):
        torch._dynamo.reset()
        before = cache_counters()
        runner = DecodeCudaGraphRunner(
            model, {"decode": {"backend": "full", "bs": [1, 4], "torch_compile": True}}, show_progress=False
        )
        runner.capture()
        counts.append({k: v - before[k] for k, v in cache_counters().items()})
        if not counts[1:]:
            runner.cleanup()
    first, second = counts
    assert first["fx_miss"] >= 1 and first["fx_hit"] == 0 and first["dynamo_miss"] == 1, first
    # The second start loads Dynamo's traced code (cuda_graph_runner.backend.compile_cache_dynamo):
    # no trace, so no FX or AOTAutograd lookup either; nothing generated.
    assert second["dynamo_hit"] == 1 and second["fx_miss"] == 0 and second["aot_miss"] == 0, second
    assert runner.backend.compiled_forward.dynamo_graphs == 0, "Dynamo traced again in the second start"
    for bs in (1, 3):  # the loaded code, captured, computes what eager does
        with torch.no_grad():
            session, batch = _step(model, bs, seed=300 + bs)
            expected = eager_logits_fn(model)(batch).clone()
            got = runner.forward(batch)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=f"bs {bs}")
        session.close()
    runner.cleanup()


def test_compile_sizes_static_graphs_match_eager_and_serve_without_recompiles(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))  # a cold cache: every graph compiled here
    torch._dynamo.reset()
    model = _model(torch.float32)
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"backend": "full", "bs": [1, 4, 16], "torch_compile": True, "compile_sizes": [4, 16]}},
        show_progress=False,
    )
    runner.capture()
    compiled = runner.backend.compiled_forward
    assert compiled.static_sizes == (4, 16)
    assert compiled.dynamo_graphs == 3  # static 16, static 4, size 1 (specialized anyway)
    # The attention op's body compiled at each compile size (a few graphs: it
    # graph-breaks where it reads the forward context).
    body_graphs = compiled.op_body_graphs
    by_size = compiled.op_body_graphs_by_size
    assert sorted(by_size) == [4, 16] and min(by_size.values()) >= 1, by_size
    eager = eager_logits_fn(model)
    with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
        for bs in (3, 4, 13, 16, 1):
            session, batch = _step(model, bs, seed=300 + bs)
            expected = eager(batch).clone()
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-3, msg=f"bs {bs}")
            session.close()
    assert compiled.dynamo_graphs == 3 and compiled.op_body_graphs == body_graphs
    runner.cleanup()

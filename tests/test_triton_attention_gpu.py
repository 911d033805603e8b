"""GPU: the ``triton`` attention (:mod:`cuda_graph_runner.reference.model.triton_attention`).

* the kernels against the reference attention (``torch``) on llama-3.2-1b's head layout
  (32 query heads, 8 KV heads, head_dim 64): decode, target-verify (3), DLLM block (4),
  sliding window, padded rows, contexts up to 4096 (32 splits at batch 1); extend with
  ragged requests, cached prefixes, an empty request and a window; float32 (IEEE dots)
  tight, bfloat16 within the tolerance of two different bf16 kernels
  (:func:`~cuda_graph_runner.testing.tolerances.assert_kernels_close`);
* the split count of the padded size: the rows of an eager batch of 3 equal, bit for
  bit, the same rows of the batch padded to 8 (the order a replay reduces in);
* the reference model (tiny, float32, a sliding window) with ``triton`` equals itself
  with ``torch``, eager, in decode and prefill;
* replay equals eager with ``triton`` through ``full``, ``breakable`` (the op recorded in
  its one segment) and ``tc_piecewise`` in decode and target-verify, and through compiled
  full (``tc_compiler: inductor``) in decode (captured and padded
  sizes, a changing batch over steps), and through ``breakable`` and ``tc_piecewise`` in
  prefill (ragged requests, chunked prefill);
* bf16 llama-3.2-1b through ``full``: 12 greedy tokens equal eager's;
* compiled full with compile sizes (``torch_compile: true``, ``compile_sizes``) on a
  2-layer model of llama-3.2-1b's layer shapes in bf16: no marked-op body compiled, replay
  equals eager within ``compiled_verify_tolerance`` at compile sizes, dynamic sizes and
  padded ones, nothing recompiled while serving;
* the decode kernel traced by inductor (a user-defined Triton kernel, its scale a float
  argument) equals the kernel run eagerly;
* benchmarks/run.py with ``--attention triton``: compiled full with a compile size, and
  breakable's prefill rows for 1 and 4 requests with their floors.

Run on the device machine: ``python -m pytest -m gpu tests/test_triton_attention_gpu.py``
(about a minute on an H200).
"""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.reference.batches import (
    GreedySession,
    eager_logits_fn,
    make_decode_batch,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model import paged_attention_model as pam
from cuda_graph_runner.reference.model.attention import AttentionCall, _decode_attention, _extend_attention
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import assert_greedy_tokens_equal_eager
from cuda_graph_runner.testing.tolerances import assert_kernels_close

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs the triton package (extra [triton])"),
]

KV_HEADS, HEAD_DIM, HEADS = 8, 64, 32  # llama-3.2-1b
OP = "triton_paged_attention"
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def assert_kernel_equals_torch(got, expected, what: str = "") -> None:
    """float32: within ``TOL`` (IEEE dots on both sides); 16-bit: two different kernels'
    rounding, scaled by the output's largest magnitude."""
    if expected.dtype == torch.float32:
        tol = TOL[torch.float32]
        torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=lambda m: f"{what}: {m}")
    else:
        assert_kernels_close(got, expected, msg=what)


def kernels():
    from cuda_graph_runner.reference.model import triton_kernels

    return triton_kernels


def paged_cache(dtype, rows: int, context: int):
    gen = torch.Generator(device="cuda").manual_seed(0)
    slots = rows * context + 1
    k = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    v = torch.randn(slots, KV_HEADS, HEAD_DIM, device="cuda", generator=gen).to(dtype)
    perm = torch.randperm(slots - 1, device="cuda", generator=gen)[: rows * context] + 1
    return k, v, perm.view(rows, context).to(torch.int64)


def decode_batch(mode, rows, lens, width) -> ForwardBatch:
    z = torch.zeros(len(rows) * width, dtype=torch.int64, device="cuda")
    return ForwardBatch(
        forward_mode=mode, input_ids=z, positions=z, out_cache_loc=z,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64, device="cuda"),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device="cuda"), seq_lens_cpu=list(lens),
        num_tokens_per_req=width,
    )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "mode,width,window,context",
    [
        (ForwardMode.DECODE, 1, 0, 512),
        (ForwardMode.DECODE, 1, 0, 4096),
        (ForwardMode.DECODE, 1, 100, 512),
        (ForwardMode.TARGET_VERIFY, 3, 0, 512),
        (ForwardMode.DLLM_EXTEND, 4, 0, 512),
    ],
    ids=["decode-512", "decode-4096", "decode-window", "verify3", "dllm4"],
)
def test_decode_kernels_equal_torch_attention(dtype, mode, width, window, context):
    k, v, r2t = paged_cache(dtype, 6, context)
    for rows, lens in (([2], [context - 3]), ([1, 3, 5, 4, 0], [context, 17, width, context // 2, width])):
        batch = decode_batch(mode, rows, lens, width)
        q = torch.randn(len(rows) * width, HEADS * HEAD_DIM, device="cuda", dtype=dtype)
        expected, got = torch.empty_like(q), torch.empty_like(q)
        with forward_context(batch):
            _decode_attention(AttentionCall(expected, q, k, v, r2t, HEAD_DIM**-0.5, window, batch), True)
        splits = pam.decode_num_splits(len(rows), KV_HEADS, context)
        kernels().decode_attention(
            got, q, k, v, r2t, batch.req_pool_indices, batch.seq_lens, width=width, num_splits=splits,
            scaling=HEAD_DIM**-0.5, sliding_window=window, bidirectional=mode.is_block_bidirectional(),
        )  # fmt: skip
        assert_kernel_equals_torch(got, expected, f"{mode.name} rows {rows}, lens {lens}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [0, 64], ids=["causal", "window"])
def test_extend_kernel_equals_torch_attention(dtype, window):
    k, v, r2t = paged_cache(dtype, 6, 1024)
    ext, pre, rows = [7, 300, 0, 129, 64], [0, 100, 5, 700, 0], [2, 4, 1, 5, 3]
    t = sum(ext) + 11  # a padded tail
    z = torch.zeros(t, dtype=torch.int64, device="cuda")
    i32 = lambda xs: torch.tensor(xs, dtype=torch.int32, device="cuda")  # noqa: E731
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, input_ids=z, positions=z, out_cache_loc=z,
        req_pool_indices=torch.tensor(rows, device="cuda"), seq_lens=i32([a + b for a, b in zip(ext, pre)]),
        extend_seq_lens=i32(ext), extend_prefix_lens=i32(pre), extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre,
    )  # fmt: skip
    q = torch.randn(t, HEADS * HEAD_DIM, device="cuda", dtype=dtype)
    expected, got = torch.empty_like(q), torch.full_like(q, 3.0)
    with forward_context(batch):
        _extend_attention(AttentionCall(expected, q, k, v, r2t, HEAD_DIM**-0.5, window, batch))
    tk = kernels()
    tiles = pam.extend_tiles(ext, pre, 64)
    tk.extend_attention(
        got, q, k, v, r2t, batch.req_pool_indices, tk.extend_tile_tensor(tiles, q.device), len(tiles),
        scaling=HEAD_DIM**-0.5, sliding_window=window,
    )  # fmt: skip
    n = sum(ext)
    assert_kernel_equals_torch(got[:n], expected[:n], f"EXTEND window {window}")


def test_the_padded_size_split_count_reduces_in_the_replays_order():
    k, v, r2t = paged_cache(torch.float32, 6, 2048)
    q = torch.randn(8, HEADS * HEAD_DIM, device="cuda")
    splits = pam.decode_num_splits(8, KV_HEADS, 2048)
    outs = []
    # An eager batch of 3 with the count of the size it pads to (8), and that padded batch.
    for rows, lens in (([1, 2, 3], [2000, 77, 1500]), ([1, 2, 3] + [0] * 5, [2000, 77, 1500] + [1] * 5)):
        batch = decode_batch(ForwardMode.DECODE, rows, lens, 1)
        out = torch.empty(len(rows), HEADS * HEAD_DIM, device="cuda")
        kernels().decode_attention(
            out, q[: len(rows)], k, v, r2t, batch.req_pool_indices, batch.seq_lens,
            width=1, num_splits=splits, scaling=HEAD_DIM**-0.5,
        )  # fmt: skip
        outs.append(out)
    assert torch.equal(outs[0], outs[1][:3])
    assert pam.decode_num_splits(3, KV_HEADS, 2048) != splits  # its own size would reduce in another order


def tiny_model(attention: str, *, requests: int = 24, context: int = 96, window=8, dtype=torch.float32):
    config = dataclasses.replace(PRESETS["tiny"], sliding_window=window)
    model = ReferenceLlamaForCausalLM.from_config(config, dtype=dtype, device="cuda", attention=attention)
    model.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
    return model


def test_the_model_with_triton_equals_the_model_with_torch():
    a, b = tiny_model("triton"), tiny_model("torch")
    logits = {}
    for name, model in (("triton", a), ("torch", b)):
        session = GreedySession(model, model.kv_cache)
        with torch.no_grad():
            # In chunks of 16: the later chunks attend to cached prefixes.
            prompts = make_dummy_prompts(5, [3, 40, 17, 60, 1], model.config.vocab_size, seed=1)
            got = [session.prefill(prompts, chunk_size=16)]
            for _ in range(4):
                got.append(session.decode())
        session.close()
        logits[name] = got
    for i, (x, y) in enumerate(zip(logits["triton"], logits["torch"])):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4, msg=lambda m: f"step {i}: {m}")


def _uninstall(runner) -> None:
    runner.cleanup()
    uninstall = getattr(runner.backend, "uninstall", None)  # tc_piecewise gives the model its forward back
    if uninstall is not None:
        uninstall()


@pytest.fixture(scope="module")
def model():
    return tiny_model("triton")


DECODE_CASES = [(label, width) for label in ("full", "breakable", "tc_piecewise") for width in (1, 3)] + [
    ("full:inductor", 1)
]  # compiled full: the op opaque to Dynamo, recorded in the graph


@pytest.mark.parametrize("label,width", DECODE_CASES, ids=[f"{b}-w{w}" for b, w in DECODE_CASES])
def test_decode_replay_equals_eager(model, label, width):
    cache, vocab = model.kv_cache, model.config.vocab_size
    mode = "decode" if width == 1 else "target_verify"
    backend, _, compiler = label.partition(":")
    phase = {"backend": backend, "bs": [1, 2, 4, 8], **({"tc_compiler": compiler} if compiler else {})}
    runner = DecodeCudaGraphRunner(model, {"decode": phase}, mode=mode, num_tokens_per_req=width, show_progress=False)
    eager = eager_logits_fn(model)
    tol = 1e-3 if compiler else 1e-4  # inductor's fusions reorder float math (ten times the base)
    try:
        with torch.no_grad():
            runner.capture()
        if backend == "breakable":  # the op recorded inside the one segment of every size
            layers = model.config.num_hidden_layers
            assert all(runner.backend.graph(key).inlined == [OP] * layers for key in runner.backend.captured_keys)
        session = GreedySession(model, cache)
        with torch.no_grad():
            session.prefill(make_dummy_prompts(8, [3 + (7 * i) % 29 for i in range(8)], vocab, seed=width))
            for step, bs in enumerate((1, 3, 8, 5, 2)):  # 3 and 5 padded; a changing batch
                rows, last = session.rows[:bs], [t[-1] for t in session.tokens[:bs]]
                tokens = [[t] + [(t + j) % vocab for j in range(1, width)] for t in last] if width > 1 else last
                batch = make_decode_batch(cache, rows, None, tokens)
                expected = eager(batch).clone()
                assert runner.can_run(batch)
                got = runner.forward(batch)
                torch.testing.assert_close(got, expected, atol=tol, rtol=tol, msg=lambda m: f"step {step} bs {bs}: {m}")
                for i, t in enumerate(got.view(bs, width, vocab)[:, -1].argmax(-1).tolist()):
                    session.tokens[i].append(t)
        session.close()
    finally:
        _uninstall(runner)


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise"])
def test_prefill_replay_equals_eager(model, backend):
    cache, vocab = model.kv_cache, model.config.vocab_size
    runner = PrefillCudaGraphRunner(model, {"prefill": {"backend": backend, "bs": [32, 64, 128]}}, show_progress=False)
    eager = eager_logits_fn(model)
    try:
        with torch.no_grad():
            runner.capture()
        rows = []
        for step, lens in enumerate(([5, 20, 1], [30, 2], [9, 9, 9, 9, 9, 9, 9])):
            prompts = make_dummy_prompts(len(lens), lens, vocab, seed=step)
            # The second batch continues the first's requests (chunked prefill: cached prefixes).
            batch = make_extend_batch(cache, prompts, rows=rows[: len(lens)] if step == 1 else None)
            expected = eager(batch).clone()
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"batch {step}: {m}")
            rows = batch.req_pool_indices.tolist()
    finally:
        _uninstall(runner)


def test_bf16_llama_greedy_tokens_through_full_equal_eager():
    model = ReferenceLlamaForCausalLM.from_preset(
        "llama-3.2-1b", dtype=torch.bfloat16, device="cuda", attention="triton"
    )
    model.create_kv_cache(num_slots=16 * 64 + 1, max_reqs=17, max_context_len=64)
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": "full", "bs": [1, 4, 8]}}, show_progress=False)
    try:
        with torch.no_grad():
            runner.capture()
        assert_greedy_tokens_equal_eager(model, 12, decode_fn=runner.forward, what="llama-3.2-1b triton")
    finally:
        _uninstall(runner)


def small_llama(dtype=torch.bfloat16, *, requests: int = 16, context: int = 128):
    """llama-3.2-1b's layer shapes (32 query heads, 8 KV heads, head_dim 64), 2 layers."""
    config = dataclasses.replace(PRESETS["llama-3.2-1b"], num_hidden_layers=2, vocab_size=8192)
    model = ReferenceLlamaForCausalLM.from_config(config, dtype=dtype, device="cuda", attention="triton")
    model.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
    return model


def test_compiled_full_with_compile_sizes_replay_equals_eager_bf16(tmp_path, monkeypatch):
    # Compiled full with compile sizes once failed in inductor (the op's body compiled per
    # size traced into the Triton kernels and typed the softmax scale fp64).
    from cuda_graph_runner.backend import compiled_verify_tolerance

    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))  # a cold cache: everything compiles here
    torch._dynamo.reset()
    model = small_llama()
    cache, vocab = model.kv_cache, model.config.vocab_size
    phase = {"backend": "full", "bs": [1, 4, 8, 16], "torch_compile": True, "compile_sizes": [1, 4]}
    runner = DecodeCudaGraphRunner(model, {"decode": phase}, show_progress=False)
    eager = eager_logits_fn(model)
    atol, rtol = compiled_verify_tolerance(torch.bfloat16)
    try:
        with torch.no_grad():
            runner.capture()
        compiled = runner.backend.compiled_forward
        assert compiled.static_sizes == (1, 4)
        assert compiled.op_body_graphs == 0  # the attention's body is not compiled: its kernels are opaque ops
        graphs = compiled.dynamo_graphs
        session = GreedySession(model, cache)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
            session.prefill(make_dummy_prompts(16, [3 + (11 * i) % 100 for i in range(16)], vocab, seed=45))
            # compile sizes 1 and 4, 3 padded to 4, dynamic 8 and 16, 13 padded to 16
            for step, bs in enumerate((1, 4, 3, 8, 13, 16)):
                rows, last = session.rows[:bs], [t[-1] for t in session.tokens[:bs]]
                batch = make_decode_batch(cache, rows, None, last)
                expected = eager(batch).clone()
                got = runner.forward(batch)
                torch.testing.assert_close(
                    got, expected, atol=atol, rtol=rtol, msg=lambda m: f"step {step} bs {bs}: {m}"
                )
                for i, t in enumerate(got.argmax(-1).tolist()):
                    session.tokens[i].append(t)
        session.close()
        assert compiled.dynamo_graphs == graphs  # nothing recompiled while serving
    finally:
        _uninstall(runner)


def test_the_kernels_traced_by_inductor_take_a_float_scale():
    # Inductor types a float argument of a user-defined Triton kernel fp64; the kernels
    # cast it to fp32 (their loop-carried softmax state stays fp32).
    k, v, r2t = paged_cache(torch.bfloat16, 4, 256)
    batch = decode_batch(ForwardMode.DECODE, [1, 3], [200, 31], 1)
    q = torch.randn(2, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    tk = kernels()

    def attend(out, q, scale: float):
        tk.decode_attention(
            out, q, k, v, r2t, batch.req_pool_indices, batch.seq_lens, width=1, num_splits=4, scaling=scale
        )
        return out

    torch._dynamo.reset()
    expected = attend(torch.empty_like(q), q, HEAD_DIM**-0.5)
    got = torch.compile(attend, backend="inductor", fullgraph=True)(torch.empty_like(q), q, HEAD_DIM**-0.5)
    torch.testing.assert_close(got, expected, atol=TOL[torch.bfloat16], rtol=TOL[torch.bfloat16])
    torch._dynamo.reset()


def test_run_py_with_triton_times_compiled_full_and_breakable_prefill_per_request_count(tmp_path):
    """benchmarks/run.py end to end with ``--attention triton`` (structure, no time
    asserted): compiled full with a compile size captures and runs, breakable's prefill
    rows exist for 1 and 4 requests, each with its floor."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import run

    from cuda_graph_runner.cli.results_schema import nested_view

    argv = ["--out", str(tmp_path), "--models", "tiny", "--batch-sizes", "1", "4", "--quick"]
    argv += ["--attention", "triton", "--backends", "full,full+torch_compile,breakable", "--compile-sizes", "1"]
    argv += ["--prefill-tokens", "64", "--prefill-requests", "1", "4", "--iters", "2", "--rounds", "2"]
    argv += ["--warmup-max", "3", "--warmup-min-s", "0"]
    assert run.main(argv) == 0
    with open(tmp_path / "benchmarks.json") as f:
        view = nested_view(json.load(f))
    assert not [n for n in view["notes"] if "failed" in n], view["notes"]
    m = view["models"]["tiny"]
    assert {"full", "full+torch_compile", "breakable"} <= set(m["decode"]["1"])
    assert set(m["prefill"]["64"]) >= {"eager", "breakable"} and m["prefill"]["64"]["breakable"]["requests"] == 1
    assert set(m["prefill_by_requests"]["4"]["64"]) >= {"eager", "breakable"}
    assert m["floor_ms"]["prefill"]["64"] > 0 and m["floor_ms"]["prefill_by_requests"]["4"]["64"] > 0

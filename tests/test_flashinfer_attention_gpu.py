"""GPU: the ``flashinfer`` attention (FlashInfer's paged wrappers) in bf16.

* eager DECODE (plain and tensor-core) and EXTEND (ragged requests over cached
  prefixes) against the ``torch`` attention on the same weights and KV cache;
* replay equals eager and never synchronizes (``torch.cuda.set_sync_debug_mode("error")``)
  through ``full``, ``breakable`` and ``tc_piecewise`` (eager compiler) decode and
  ``breakable`` prefill, for captured and padded sizes and a continuous-batching
  schedule (requests joining and leaving between steps);
* compiled full (``torch_compile: true``, ``compile_sizes``) replay equals eager with no
  recompile while serving;
* the host time of one replay hook (the re-plan) in microseconds, and of its two parts
  (the page ids written on the device, FlashInfer's ``plan()``), printed as benchmark rows
  (no wall-clock assertion).

One device run holds the whole file (9 tests). FlashInfer JIT-compiles its decode and
prefill modules with the machine's nvcc on first use and keeps them in its JIT cache
(``FLASHINFER_WORKSPACE_BASE``): on an H200, 118 s for the first test's modules (decode,
prefill) and 47 s for the tensor-core decode's, cold; every other test takes 12-18 s, so
the file takes about 5 minutes cold, each test in its own process, and under 2 minutes
with the cache carried. Run on the device machine:
``python -m pytest tests/test_flashinfer_attention_gpu.py -s``.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Dict

import pytest
import torch

from cuda_graph_runner.reference.batches import (
    GreedySession,
    eager_logits_fn,
    make_decode_batch,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model.flashinfer_attention import flashinfer_available
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import free_requests, prefilled_decode_batch
from cuda_graph_runner.testing.tolerances import assert_kernels_close, model_depth, model_tolerance

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(not flashinfer_available(), reason="needs flashinfer-python (cuda-graph-runner[flashinfer])"),
]

CONTEXT = 256
#: Llama-3.2-1b's attention shape (head_dim 64, GQA 4) at two small layers.
CONFIG = dataclasses.replace(
    PRESETS["tiny"], hidden_size=512, head_dim=64, num_attention_heads=8, num_key_value_heads=2, intermediate_size=1024
)
#: Replay against eager of the same attention (the same kernels at padded shapes).
TOL = model_tolerance(CONFIG, torch.bfloat16, context_len=CONTEXT)
#: FlashInfer's kernels against the ``torch`` attention: two different bf16 kernels (float32 logits).
KERNELS = {"dtype": torch.bfloat16, "depth": model_depth(CONFIG)}


def _model(attention: str) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_config(CONFIG, dtype=torch.bfloat16, device="cuda", attention=attention)
    model.create_kv_cache(num_slots=40 * CONTEXT + 1, max_reqs=41, max_context_len=CONTEXT)
    return model


@pytest.fixture(scope="module")
def pair():
    fi = _model("flashinfer")
    ref = ReferenceLlamaForCausalLM.from_config(CONFIG, dtype=torch.bfloat16, device="cuda", attention="torch")
    ref.load_state_dict(fi.state_dict())
    ref.attach_kv_cache(fi.kv_cache)  # type: ignore[arg-type]
    return fi, ref


@pytest.mark.parametrize("attention", ["flashinfer", "flashinfer_tc"])
def test_eager_decode_and_extend_equal_torch_attention(pair, attention):
    fi, ref = pair
    model = fi if attention == "flashinfer" else _model(attention)
    if model is not fi:
        model.load_state_dict(fi.state_dict())
        model.attach_kv_cache(fi.kv_cache)  # type: ignore[arg-type]
    cache = fi.kv_cache
    prompts = make_dummy_prompts(3, [37, 5, 120], CONFIG.vocab_size, seed=1)
    first = make_extend_batch(cache, [p[:20] for p in prompts[:1]] + [p for p in prompts[1:]])
    with torch.no_grad():
        what = f"{attention} EXTEND"
        assert_kernels_close(eager_logits_fn(model)(first), eager_logits_fn(ref)(first), **KERNELS, msg=what)
        rows = [int(r) for r in first.req_pool_indices.tolist()]
        second = make_extend_batch(cache, [prompts[0][20:], [7, 8, 9]], rows=rows[:2])  # cached prefixes
        what = f"{attention} EXTEND over cached prefixes"
        assert_kernels_close(eager_logits_fn(model)(second), eager_logits_fn(ref)(second), **KERNELS, msg=what)
    session, batch = prefilled_decode_batch(ref, make_dummy_prompts(5, [3, 64, 17, 200, 9], CONFIG.vocab_size, seed=2))
    with torch.no_grad():
        what = f"{attention} DECODE"
        assert_kernels_close(eager_logits_fn(model)(batch), eager_logits_fn(ref)(batch), **KERNELS, msg=what)
    session.close()
    free_requests(cache, first)  # second continued two of its rows


def _replays_without_sync(runner: Any, batches: Dict[str, Any], eager: Any) -> None:
    outputs = {}
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for what, batch in batches.items():
                assert runner.can_run(batch), what
                runner.forward(batch)
                outputs[what] = runner.forward(batch).clone()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    with torch.no_grad():
        for what, batch in batches.items():
            torch.testing.assert_close(outputs[what], eager(batch), **TOL, msg=what)


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_decode_replay_equals_eager_and_never_synchronizes(pair, backend):
    fi, _ = pair
    options = {"tc_compiler": "eager"} if backend == "tc_piecewise" else {}
    runner = DecodeCudaGraphRunner(
        fi, {"decode": {"backend": backend, "bs": [1, 2, 4, 8], "max_bs": 8, **options}}, show_progress=False
    )
    runner.capture()
    sessions, batches = [], {}
    for bs in (1, 3, 8):  # captured, padded, the maximum
        prompts = make_dummy_prompts(bs, [3 + 29 * i % 150 for i in range(bs)], CONFIG.vocab_size, seed=bs)
        session, batches[f"{backend} decode bs={bs}"] = prefilled_decode_batch(fi, prompts)
        sessions.append(session)
    try:
        _replays_without_sync(runner, batches, eager_logits_fn(fi))
        if backend == "full":
            _continuous_batching(fi, runner)
            _plan_microseconds(fi, runner, batches["full decode bs=3"])
    finally:
        for s in sessions:
            s.close()
        runner.cleanup()
        uninstall = getattr(runner.backend, "uninstall", None)
        if uninstall is not None:
            uninstall()


def _continuous_batching(model: Any, runner: Any) -> None:
    """Requests join (after their own prefill) and leave between decode steps of one batch;
    every step's replay runs without a host sync and equals its eager forward."""
    sessions = [GreedySession(model, model.kv_cache)]
    with torch.no_grad():
        sessions[0].prefill(make_dummy_prompts(2, [11, 40], CONFIG.vocab_size, seed=5))
        for step in range(6):
            if step in (2, 4):
                joined = GreedySession(model, model.kv_cache)
                n = 1 + step // 2
                joined.prefill(
                    make_dummy_prompts(n, [7 + step + 13 * i for i in range(n)], CONFIG.vocab_size, seed=step)
                )
                sessions.append(joined)
            live = sessions[1:] if step == 5 else sessions  # the first two requests left
            rows = [r for s in live for r in s.rows]
            batch = make_decode_batch(model.kv_cache, rows, None, [t[-1] for s in live for t in s.tokens])
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")  # the replay itself never synchronizes
            try:
                got = runner.forward(batch).clone()
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            torch.testing.assert_close(
                got, eager_logits_fn(model)(batch), **TOL, msg=f"step {step}, {len(rows)} requests"
            )
    for s in sessions:
        s.close()


def _plan_microseconds(model: Any, runner: Any, batch: Any) -> None:
    """Host microseconds of the replay hook (page ids written, wrapper re-planned), and of
    each part alone: rows."""
    from cuda_graph_runner.reference.model.flashinfer_attention import _indptr, write_page_ids

    _, static = runner.replay_prepare(batch)
    backend = model.attn_backend
    state = backend.states[(static.forward_mode, 1, static.req_pool_indices.shape[0], "")]
    lens = list(static.seq_lens_cpu)
    hook = model.init_forward_metadata_replay

    def page_ids() -> None:
        write_page_ids(state.indices, backend.req_to_token, static.req_pool_indices, lens)

    indptr, g = _indptr(lens), backend.geometry  # the same values every time: one host tensor

    def plan_only() -> None:
        with backend.pinned_ring.planning(state.wrapper):
            state.wrapper.plan(
                indptr,
                state.indices[:0], backend._ones(len(lens)), g.num_qo_heads, g.num_kv_heads, g.head_dim, 1,
                window_left=g.window_left, q_data_type=g.dtype, kv_data_type=g.dtype, sm_scale=g.scaling,
                non_blocking=True,
            )  # fmt: skip

    rows = {}
    for what, fn in (("replay hook", lambda: hook(static)), ("page ids", page_ids), ("plan()", plan_only)):
        torch.cuda.synchronize()
        n = 200
        start = time.perf_counter()
        for _ in range(n):
            fn()
        rows[what] = (time.perf_counter() - start) / n * 1e6
        torch.cuda.synchronize()
    hook(static)  # the graph's buffers hold this batch's plan again
    print(
        f"\nflashinfer replay plan: {rows['replay hook']:.1f} us of host time per replay (batch size 3 padded "
        f"to 4): page ids {rows['page ids']:.1f} us, FlashInfer plan() {rows['plan()']:.1f} us"
    )


def test_compiled_full_with_compile_sizes_replay_equals_eager(pair, tmp_path, monkeypatch):
    # Compiled full: Dynamo must not trace into FlashInfer's TVM-FFI calls (the op body is
    # opaque to it), and nothing recompiles while serving captured, padded and dynamic sizes.
    from cuda_graph_runner.backend import compiled_verify_tolerance

    fi, _ = pair
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))
    torch._dynamo.reset()
    phase = {"backend": "full", "bs": [1, 4, 8], "max_bs": 8, "torch_compile": True, "compile_sizes": [1, 4]}
    runner = DecodeCudaGraphRunner(fi, {"decode": phase}, show_progress=False)
    atol, rtol = compiled_verify_tolerance(torch.bfloat16)
    sessions, batches = [], {}
    try:
        with torch.no_grad():
            runner.capture()
        compiled = runner.backend.compiled_forward
        graphs = compiled.dynamo_graphs
        for bs in (1, 3, 8):  # a compile size, padded to one, dynamic
            prompts = make_dummy_prompts(bs, [5 + 23 * i % 120 for i in range(bs)], CONFIG.vocab_size, seed=bs)
            session, batches[bs] = prefilled_decode_batch(fi, prompts)
            sessions.append(session)
        with torch.no_grad(), torch.compiler.set_stance("fail_on_recompile"):
            for bs, batch in batches.items():
                expected = eager_logits_fn(fi)(batch).clone()
                got = runner.forward(batch)
                torch.testing.assert_close(got, expected, atol=atol, rtol=rtol, msg=lambda m: f"bs {bs}: {m}")
        assert compiled.dynamo_graphs == graphs  # nothing recompiled while serving
    finally:
        for s in sessions:
            s.close()
        runner.cleanup()
        torch.cuda.synchronize()


def test_prefill_replay_equals_eager_and_never_synchronizes(pair):
    fi, _ = pair
    runner = PrefillCudaGraphRunner(
        fi, {"prefill": {"backend": "breakable", "bs": [16, 32, 64], "max_bs": 64}}, show_progress=False
    )
    runner.capture()
    cache = fi.kv_cache
    batches = {}
    for lengths in ([16], [5, 9, 7], [20, 20, 24]):  # on a bucket, padded, the maximum
        prompts = make_dummy_prompts(len(lengths), lengths, CONFIG.vocab_size, seed=sum(lengths))
        batches[f"breakable prefill {sum(lengths)} tokens"] = make_extend_batch(cache, prompts)
    try:
        _replays_without_sync(runner, batches, eager_logits_fn(fi))
    finally:
        free_requests(cache, *batches.values())
        runner.cleanup()
        torch.cuda.synchronize()  # a fault of any kernel above fails this test, not the teardown


@pytest.mark.parametrize("attention", ["flashinfer", "flashinfer_tc"])
def test_attention_us_times_flashinfer_as_the_runner_drives_it(attention, monkeypatch):
    """benchmarks/attention_us.py: graph replays re-planned before each replay, eager steps
    planned per step, and the plan's host µs (a row printed; nothing timed is asserted)."""
    import os

    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
    import attention_us

    row = attention_us.time_attention(attention, "llama-3.2-1b", 512, 20)
    assert set(row) == {"graph_us", "eager_us", "plan_us"} and all(v > 0 for v in row.values())
    print(f"\n{attention} llama-3.2-1b context 512: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()))

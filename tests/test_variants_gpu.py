"""GPU: backends ``full`` and ``breakable`` replay the reference model's LoRA variants and
DLLM_EXTEND exactly as eager computes them.

* LoRA: one runner captures ``nolora`` and ``lora`` per size; a mixed batch (requests
  without an adapter next to requests with two different adapters) replays the ``lora``
  graph, an adapter-free batch the ``nolora`` graph, on captured and padded sizes; the
  logits equal eager's.
* DLLM_EXTEND at two block widths, on captured and padded sizes: logits equal eager's.

Run on the device machine: ``python -m pytest tests/test_variants_gpu.py -v``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.reference.batches import (
    eager_logits_fn,
    make_decode_batch,
    make_dllm_extend_batch,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner.reference.model import LORA_IDS, PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.tolerances import model_tolerance

pytestmark = pytest.mark.gpu

BACKENDS = ["full", "breakable"]
CONTEXT = 64
MAX_BS = 8
SIZES = [1, 2, 4, 8]


def make_model(preset: str = "tiny", dtype: torch.dtype = torch.float32, adapters: int = 0):
    model = ReferenceLlamaForCausalLM.from_preset(preset, dtype=dtype, device="cuda", seed=3)
    if adapters:
        model.add_lora_adapters(adapters, 8, alpha=16.0, seed=5)
    model.create_kv_cache(num_slots=(2 * MAX_BS + 1) * CONTEXT, max_reqs=2 * MAX_BS + 1, max_context_len=CONTEXT)
    return model


def prefill(model, prompts):
    batch = make_extend_batch(model.kv_cache, prompts)
    with torch.no_grad():
        eager_logits_fn(model)(batch)
    return batch.req_pool_indices.tolist()


def free(model, rows):
    for r in rows:
        model.kv_cache.free_request(r)


def mixed_ids(bs: int):
    """No adapter, adapter 0, adapter 1, repeating: every kind in any batch of >= 3."""
    return [(-1, 0, 1)[i % 3] for i in range(bs)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("preset,dtype", [("tiny", torch.float32), ("qwen2.5-0.5b", torch.bfloat16)])
def test_lora_variants_replay_equal_eager_on_captured_and_padded_sizes(backend, preset, dtype):
    model = make_model(preset, dtype, adapters=2)
    tol = model_tolerance(PRESETS[preset], dtype, context_len=CONTEXT)
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "bs": SIZES}}, show_progress=False)
    runner.capture()
    assert sorted(runner.captured_keys) == sorted(ShapeKey(s, f"decode|{v}") for s in SIZES for v in ("nolora", "lora"))
    eager = eager_logits_fn(model)
    for bs in (3, 4, 7, 8):  # padded, captured, padded, captured
        for ids, variant in ((mixed_ids(bs), "lora"), ([-1] * bs, "nolora")):
            rows = prefill(
                model, make_dummy_prompts(bs, [5 + i % 4 for i in range(bs)], model.config.vocab_size, seed=bs)
            )
            with torch.no_grad():
                batch = make_decode_batch(model.kv_cache, rows, None, [7 + i for i in range(bs)])
                batch.extra[LORA_IDS] = ids
                assert runner.can_run(batch)
                assert runner.key_for_batch(batch, runner.padded_size(bs)).variant == f"decode|{variant}"
                got = runner.forward(batch).clone()
                expected = eager(batch)
            torch.testing.assert_close(got, expected, **tol, msg=f"{backend} {preset} bs={bs} ids={ids}")
            free(model, rows)
    assert runner.run_stats()["eager_total"] == 0
    runner.cleanup()


@pytest.mark.parametrize("backend", BACKENDS)
def test_lora_graph_serves_adapters_the_nolora_graph_would_miss(backend):
    """The lora graph's output differs from the adapter-free result: adapters really ran."""
    model = make_model(adapters=2)
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "bs": [4]}}, show_progress=False)
    runner.capture()
    rows = prefill(model, make_dummy_prompts(4, 6, model.config.vocab_size, seed=1))
    with torch.no_grad():
        batch = make_decode_batch(model.kv_cache, rows, None, [1, 2, 3, 4])
        batch.extra[LORA_IDS] = [0, 1, 0, 1]
        with_adapters = runner.forward(batch).clone()
        batch.extra[LORA_IDS] = [-1, -1, -1, -1]
        without = runner.forward(batch).clone()
    assert (with_adapters - without).abs().max() > 1e-2
    free(model, rows)
    runner.cleanup()


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_uncaptured_lora_variant_runs_eagerly_with_its_reason(backend):
    model = make_model(adapters=2)
    cfg = {"decode": {"backend": backend, "bs": [4], "variants": ["nolora"]}}
    runner = DecodeCudaGraphRunner(model, cfg, show_progress=False)
    runner.capture()
    assert runner.captured_keys == [ShapeKey(4, "decode|nolora")]
    rows = prefill(model, make_dummy_prompts(3, 6, model.config.vocab_size, seed=2))
    with torch.no_grad():
        batch = make_decode_batch(model.kv_cache, rows, None, [1, 2, 3])
        batch.extra[LORA_IDS] = [0, -1, 1]
        assert not runner.can_run(batch)
        got = runner.forward(batch).clone()
        tol = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)
        torch.testing.assert_close(got, eager_logits_fn(model)(batch), **tol)
        batch.extra[LORA_IDS] = [-1, -1, -1]
        runner.forward(batch)
    stats = runner.run_stats()
    assert stats["eager_fallbacks"] == {"variant not captured": 1} and stats["replays"] == 1
    free(model, rows)
    runner.cleanup()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [4, 8])
def test_dllm_extend_replay_equals_eager_on_captured_and_padded_sizes(backend, width):
    model = make_model()
    tol = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"backend": backend, "bs": SIZES}},
        mode="dllm_extend",
        num_tokens_per_req=width,
        show_progress=False,
    )
    runner.capture()
    assert sorted(runner.captured_keys) == sorted(ShapeKey(s, f"dllm_extend:{width}") for s in SIZES)
    eager = eager_logits_fn(model)
    for bs in (3, 4, 5, 8):
        rows = prefill(model, make_dummy_prompts(bs, [3 + 2 * i for i in range(bs)], model.config.vocab_size, seed=bs))
        blocks = make_dummy_prompts(bs, width, model.config.vocab_size, seed=100 + bs)
        with torch.no_grad():
            batch = make_dllm_extend_batch(model.kv_cache, rows, blocks)
            for step in range(2):  # two denoising steps of the same block: new ids, same slots
                assert runner.can_run(batch)
                got = runner.forward(batch).clone()
                expected = eager(batch)
                torch.testing.assert_close(got, expected, **tol, msg=f"{backend} w={width} bs={bs} step={step}")
                batch = batch.replace(input_ids=expected.argmax(dim=-1))
        free(model, rows)
    runner.cleanup()


def test_variants_benchmark_writes_its_rows(tmp_path):
    """benchmarks/variants.py end to end on the tiny preset: structure only, no time asserted."""
    import importlib.util
    import json
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "variants.py")
    spec = importlib.util.spec_from_file_location("bench_variants", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "variants.json"
    argv = ["--model", "tiny", "--dtype", "float32", "--batch-sizes", "1", "4", "--adapters", "2", "--rank", "4"]
    rc = bench.main(argv + ["--iters", "2", "--rounds", "2", "--warmup-max", "2", "--json", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    capture = data["capture"]
    assert capture["nolora+lora"]["graphs"] == 2 * capture["nolora"]["graphs"] == 2 * len(capture["nolora"]["sizes"])
    assert capture["nolora"]["pool_bytes"] > 0 and capture["nolora+lora"]["pool_bytes"] > 0
    for bs in ("1", "4"):
        row = data["step_ms"][bs]
        assert row["keys"] == {"nolora": "decode|nolora", "lora": "decode|lora"}
        assert all(row[name]["median_ms"] > 0 for name in ("nolora graph", "lora graph", "lora eager"))

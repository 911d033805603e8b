"""Hugging Face transformers causal LMs through the runners on a CUDA device
(cuda_graph_runner.reference.models.hf), backends chosen by name through the registry.

Ordered so that ``-x`` stops at the first layer that breaks, each test small:

* eager, no graphs (float32, TF32 off): the adapter's prefill logits on the device equal
  transformers' own eager forward of each prompt, per architecture (transformers and the
  paged ``torch`` attention on CUDA, before any capture);
* bfloat16, decode ``full`` (every architecture) and ``breakable`` (Llama, Mistral's
  sliding window): teacher-forced logits of the replayed graphs equal the adapter's eager
  forward within the backend's verify tolerance, at every step (verify mode on, host-value
  guard on);
* float32 (TF32 off), decode ``full`` (every architecture), ``breakable`` (Llama,
  Mistral) and ``tc_piecewise`` (Llama) with prefill ``breakable``: 5 ragged prompts in
  one continuous batch give the greedy tokens of transformers' own eager ``generate()``
  of each prompt alone.

Run on the device machine (about a minute on an H200)::

    timeout 300 python -m pytest -m gpu -x -v --tb=short -o faulthandler_timeout=60 tests/test_hf_adapter_gpu.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from cuda_graph_runner.backend.context import forward_context  # noqa: E402
from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_extend_batch  # noqa: E402
from cuda_graph_runner.reference.models import hf  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner  # noqa: E402
from cuda_graph_runner.testing.hf_cases import PROMPT_LENS, STEPS, hf_generate, ragged_prompts, run_continuous_batch  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
ARCHS = hf.SUPPORTED_ARCHITECTURES
#: (arch, decode backend) of the graph tests: every architecture under ``full``; the other
#: backends on Llama and on Mistral (its sliding window is crossed by the prompts + steps).
CASES = [(arch, "full") for arch in ARCHS] + [("llama", "breakable"), ("mistral", "breakable")]
GENERATE_CASES = CASES + [("llama", "tc_piecewise")]


@pytest.fixture
def no_tf32():
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def _adapter(arch: str, dtype: torch.dtype) -> hf.HFCausalLM:
    adapter = hf.HFCausalLM.from_config(hf.builtin_config(arch), dtype=dtype, device=DEVICE, std=0.15)
    adapter.create_kv_cache(num_slots=4096, max_reqs=16, max_context_len=128)
    return adapter


@pytest.mark.parametrize("arch", ARCHS)
def test_eager_prefill_on_cuda_matches_transformers_forward(arch, no_tf32):
    adapter = _adapter(arch, torch.float32)
    reference = hf.reference_logits_fn(hf.eager_reference(adapter))
    prompts = ragged_prompts(adapter.config.vocab_size)[:3]
    batch = make_extend_batch(adapter.kv_cache, prompts)
    try:
        got = eager_logits_fn(adapter)(batch)
    finally:
        for row in batch.req_pool_indices.tolist():
            adapter.kv_cache.free_request(row)
    assert got.device.type == torch.device(DEVICE).type and got.shape == (len(prompts), adapter.config.vocab_size)
    for i, prompt in enumerate(prompts):
        torch.testing.assert_close(got[i], reference(prompt)[-1], atol=1e-4, rtol=1e-4, msg=f"{arch} prompt {i}")


@pytest.mark.parametrize(("arch", "backend"), CASES)
def test_bf16_teacher_forced_logits_within_tolerance(arch, backend):
    adapter = _adapter(arch, torch.bfloat16)
    # 5 requests: padded to the graph of 8 (4 is captured too, so the pick is exercised).
    runner = DecodeCudaGraphRunner(
        adapter, {"decode": {"backend": backend, "bs": [4, 8], "verify": True}}, show_progress=False
    )
    assert runner.backend.name == backend and runner.config.decode.host_value_guard
    atol, rtol = runner.backend.verify_tolerance(torch.bfloat16)
    prompts = ragged_prompts(adapter.config.vocab_size)
    worst = 0.0

    def both(batch):
        nonlocal worst
        graph = runner.forward(batch).clone()  # graph first: eager then rewrites the same KV slots
        if adapter.init_forward_metadata is not None:
            adapter.init_forward_metadata(batch)
        with forward_context(batch):
            eager = adapter.compute_logits(adapter(batch), batch)
        n = batch.batch_size
        worst = max(worst, float((graph[:n] - eager[:n]).abs().max()))
        assert torch.allclose(graph[:n], eager[:n], atol=atol, rtol=rtol), (
            f"{arch} / {backend}: max |graph - eager| {worst} (atol {atol}, rtol {rtol})"
        )
        return eager

    with torch.no_grad():
        runner.capture()
        session = GreedySession(adapter, adapter.kv_cache, decode_fn=both)
        try:
            session.prefill(prompts)
            for _ in range(STEPS - 1):
                session.decode()
        finally:
            session.close()
    assert sum(runner.stats.replays_by_size.values()) == STEPS - 1 and not runner.stats.fallbacks


@pytest.mark.parametrize(("arch", "backend"), GENERATE_CASES)
def test_fp32_continuous_batch_matches_hf_generate(arch, backend, no_tf32):
    adapter = _adapter(arch, torch.float32)
    reference = hf.eager_reference(adapter)
    prompts = ragged_prompts(adapter.config.vocab_size)
    expected = [hf_generate(reference, p) for p in prompts]
    decode = DecodeCudaGraphRunner(
        adapter, {"decode": {"backend": backend, "bs": [1, 2, 4, 8], "verify": True}}, show_progress=False
    )
    prefill = PrefillCudaGraphRunner(
        adapter, {"prefill": {"backend": "breakable", "bs": [1, 8, 16], "verify": True}}, show_progress=False
    )
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    got = run_continuous_batch(
        adapter, prompts, lambda b: prefill.forward(b).clone(), lambda b: decode.forward(b).clone()
    )
    assert not decode.stats.fallbacks and len(decode.stats.replays_by_size) >= 3
    assert got == expected, f"{arch} / {backend}: greedy tokens differ from transformers' generate()"
    assert len(got) == len(PROMPT_LENS)

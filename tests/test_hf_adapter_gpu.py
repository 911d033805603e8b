"""Hugging Face transformers causal LMs through the runners on a CUDA device
(cuda_graph_runner.models.hf), backends chosen by name through the registry.

* bfloat16, decode ``full`` and ``breakable``: teacher-forced logits of the replayed
  graphs equal the adapter's eager forward within the backend's verify tolerance, at every
  step (verify mode on, host-value guard on), per architecture.
* float32 (TF32 off), decode ``full``, ``breakable`` and ``tc_piecewise`` with prefill
  ``breakable``: 5 ragged prompts in one continuous batch give the greedy tokens of
  transformers' own eager ``generate()`` of each prompt alone.

Run on the device machine: ``python -m pytest tests/test_hf_adapter_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from hf_cases import PROMPT_LENS, STEPS, hf_generate, ragged_prompts, run_continuous_batch  # noqa: E402

from cuda_graph_runner.forward_context import forward_context  # noqa: E402
from cuda_graph_runner.models import hf  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner  # noqa: E402
from cuda_graph_runner.testing.batches import GreedySession  # noqa: E402

pytestmark = pytest.mark.gpu

DEVICE = "cuda"


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


@pytest.mark.parametrize("backend", ["full", "breakable"])
@pytest.mark.parametrize("arch", hf.SUPPORTED_ARCHITECTURES)
def test_bf16_teacher_forced_logits_within_tolerance(arch, backend):
    adapter = _adapter(arch, torch.bfloat16)
    runner = DecodeCudaGraphRunner(
        adapter, {"decode": {"backend": backend, "bs": [1, 2, 4, 8], "verify": True}}, show_progress=False
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
        assert torch.allclose(graph[:n], eager[:n], atol=atol, rtol=rtol), (arch, backend, worst)
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


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
@pytest.mark.parametrize("arch", hf.SUPPORTED_ARCHITECTURES)
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

"""The Hugging Face adapter (cuda_graph_runner.reference.models.hf) with the ``triton`` and
``flashinfer`` attention inside its marked op, on a CUDA device.

bfloat16, head_dim 64. Ordered so that ``-x`` stops at the first layer that breaks:

* eager, no graphs: prefill and one decode step of Llama with each attention give the
  logits of the same weights with ``torch`` attention on the same cache, within the
  tolerance of two different bf16 kernels
  (:func:`~cuda_graph_runner.testing.tolerances.assert_kernels_close`, scaled by the
  logits' largest magnitude and the model's depth);
* teacher-forced through decode graphs with verify mode and the host-value guard on, the
  replayed graphs' logits at every step within that tolerance of the ``torch`` attention
  run eagerly on the same cache, and every step replayed a graph: ``full`` per
  architecture (Llama, Qwen2, Mistral, Qwen3 shapes) with ``triton``; ``full``,
  ``breakable`` and ``tc_piecewise`` on Llama with each attention; FlashInfer's sliding
  window (Mistral) last, since it may build its kernels just in time.

Run on the device machine (about a minute on an H200, FlashInfer's kernel builds aside)::

    timeout 300 python -m pytest -m gpu -x -v --tb=short -o faulthandler_timeout=60 \\
        tests/test_hf_adapter_attention_gpu.py
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from cuda_graph_runner.backend.context import forward_context  # noqa: E402
from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn  # noqa: E402
from cuda_graph_runner.reference.model.flashinfer_attention import flashinfer_available  # noqa: E402
from cuda_graph_runner.reference.model.triton_attention import triton_available  # noqa: E402
from cuda_graph_runner.reference.models import hf  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner  # noqa: E402
from cuda_graph_runner.testing.hf_cases import STEPS, ragged_prompts  # noqa: E402
from cuda_graph_runner.testing.tolerances import assert_kernels_close, model_depth  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = "cuda"
CONTEXT = 128
#: A tiny shape with a head_dim both kernels serve.
SHAPE = {"hidden_size": 128, "head_dim": 64, "num_attention_heads": 2, "num_key_value_heads": 1}
NEEDS = {
    "triton": (triton_available, "needs the triton package (cuda-graph-runner[triton])"),
    "flashinfer": (flashinfer_available, "needs flashinfer-python (cuda-graph-runner[flashinfer])"),
}


def _pair(arch: str, attention: str):
    """(adapter with ``attention``, the same weights with ``torch`` attention) sharing one cache."""
    available, reason = NEEDS[attention]
    if not available():
        pytest.skip(reason)
    config = hf.builtin_config(arch)
    for key, value in SHAPE.items():
        setattr(config, key, value)
    adapter, twin = (
        hf.HFCausalLM.from_config(config, dtype=torch.bfloat16, device=DEVICE, seed=1, std=0.15, attention=name)
        for name in (attention, "torch")
    )
    twin.kv_cache = adapter.create_kv_cache(num_slots=4096, max_reqs=16, max_context_len=CONTEXT)
    return adapter, twin


#: (arch, attention, decode backend), cheapest first; FlashInfer's sliding window last.
CASES = [(arch, "triton", "full") for arch in hf.SUPPORTED_ARCHITECTURES] + [
    ("llama", "flashinfer", "full"),
    ("llama", "triton", "breakable"),
    ("llama", "flashinfer", "breakable"),
    ("llama", "triton", "tc_piecewise"),
    ("llama", "flashinfer", "tc_piecewise"),
    ("mistral", "flashinfer", "full"),
]


@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
def test_eager_prefill_and_decode_within_tolerance_of_torch_attention(attention):
    adapter, twin = _pair("llama", attention)
    prompts = ragged_prompts(adapter.config.vocab_size)
    steps = []

    def both(batch):
        got = eager_logits_fn(adapter)(batch).clone()  # ours first: the twin then rewrites the same KV slots
        want = eager_logits_fn(twin)(batch)
        n = batch.batch_size
        assert_kernels_close(
            got[:n],
            want[:n],
            dtype=torch.bfloat16,
            depth=model_depth(adapter.config),
            msg=f"{attention} {batch.forward_mode.name}",
        )
        steps.append(batch.forward_mode.name)
        return want

    session = GreedySession(adapter, adapter.kv_cache, prefill_fn=both, decode_fn=both)
    try:
        session.prefill(prompts)
        session.decode()
    finally:
        session.close()
    assert steps == ["EXTEND", "DECODE"]


@pytest.mark.parametrize(("arch", "attention", "backend"), CASES)
def test_bf16_teacher_forced_logits_within_tolerance_of_torch_attention(arch, attention, backend):
    adapter, twin = _pair(arch, attention)
    # 5 requests: padded to the graph of 8 (4 is captured too, so the pick is exercised).
    runner = DecodeCudaGraphRunner(
        adapter, {"decode": {"backend": backend, "bs": [4, 8], "verify": True}}, show_progress=False
    )
    assert runner.backend.name == backend and runner.config.decode.host_value_guard
    assert adapter.attn_backend.name == attention
    prompts = ragged_prompts(adapter.config.vocab_size)

    def both(batch):
        graph = runner.forward(batch).clone()  # graph first: the twin then rewrites the same KV slots
        with forward_context(batch):
            eager = twin.compute_logits(twin(batch), batch)
        n = batch.batch_size
        assert_kernels_close(
            graph[:n],
            eager[:n],
            dtype=torch.bfloat16,
            depth=model_depth(adapter.config),
            msg=f"{arch} / {attention} / {backend}",
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

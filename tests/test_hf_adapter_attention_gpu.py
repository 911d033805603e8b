"""The Hugging Face adapter (cuda_graph_runner.models.hf) with the ``triton`` and
``flashinfer`` attention inside its marked op, on a CUDA device.

bfloat16, per architecture (Llama, Qwen2, Mistral, Qwen3 shapes, head_dim 64), decode
``full``, ``breakable`` and ``tc_piecewise`` with verify mode and the host-value guard on:
teacher-forced, the replayed graphs' logits at every step are within the model tolerance
(:func:`~cuda_graph_runner.testing.tolerances.model_tolerance`) of the same weights with
``torch`` attention run eagerly on the same cache, and every step replayed a graph.

Run on the device machine: ``python -m pytest tests/test_hf_adapter_attention_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from hf_cases import STEPS, ragged_prompts  # noqa: E402

from cuda_graph_runner.forward_context import forward_context  # noqa: E402
from cuda_graph_runner.models import hf  # noqa: E402
from cuda_graph_runner.runner import DecodeCudaGraphRunner  # noqa: E402
from cuda_graph_runner.testing.batches import GreedySession  # noqa: E402
from cuda_graph_runner.testing.model.flashinfer_attention import flashinfer_available  # noqa: E402
from cuda_graph_runner.testing.model.triton_attention import triton_available  # noqa: E402
from cuda_graph_runner.testing.tolerances import model_tolerance  # noqa: E402

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


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
@pytest.mark.parametrize("attention", ["triton", "flashinfer"])
@pytest.mark.parametrize("arch", hf.SUPPORTED_ARCHITECTURES)
def test_bf16_teacher_forced_logits_within_tolerance_of_torch_attention(arch, attention, backend):
    adapter, twin = _pair(arch, attention)
    runner = DecodeCudaGraphRunner(
        adapter, {"decode": {"backend": backend, "bs": [1, 2, 4, 8], "verify": True}}, show_progress=False
    )
    assert runner.backend.name == backend and runner.config.decode.host_value_guard
    assert adapter.attn_backend.name == attention
    tol = model_tolerance(adapter.config, torch.bfloat16, context_len=CONTEXT)
    prompts = ragged_prompts(adapter.config.vocab_size)
    worst = 0.0

    def both(batch):
        nonlocal worst
        graph = runner.forward(batch).clone()  # graph first: the twin then rewrites the same KV slots
        with forward_context(batch):
            eager = twin.compute_logits(twin(batch), batch)
        n = batch.batch_size
        worst = max(worst, float((graph[:n] - eager[:n]).abs().max()))
        torch.testing.assert_close(graph[:n], eager[:n], **tol, msg=f"{arch} / {attention} / {backend}: {worst}")
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

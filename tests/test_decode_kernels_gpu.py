"""GPU: device kernels per decoder layer of one eager bfloat16 decode step of the reference model.

The count per layer is the difference between a 4-layer and a 2-layer model of the same
shape, halved (the embedding, the rotary table, the decode metadata and the final norm
cancel). The layer runs the fused RMSNorm kernel (two kernels per norm in bfloat16: the
fused normalisation and the scale, transformers' order), one rotary pass over q and k
(five), the fused projections, the K/V writes and the ``torch`` attention; the spelled-out
ops (seven or eight kernels per norm, ten for the rotary, three mask conversions per
layer) are about 40. A count, not a time.

Run on the device machine: ``python -m pytest tests/test_decode_kernels_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.reference.batches import make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ModelConfig, ReferenceLlamaForCausalLM

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

#: The most kernels a decoder layer may launch (about 24 expected; the unfused layer ran 40).
MAX_KERNELS_PER_LAYER = 30


def _kernels_of_a_decode_step(layers: int) -> int:
    config = ModelConfig(
        hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=2, head_dim=32,
    )  # fmt: skip
    model = ReferenceLlamaForCausalLM.from_config(config, dtype=torch.bfloat16, device="cuda")
    cache = model.create_kv_cache(num_slots=256, max_reqs=4, max_context_len=64)
    with torch.no_grad():
        batch = make_extend_batch(cache, make_dummy_prompts(2, [5, 7], config.vocab_size))
        with forward_context(batch):
            model.forward(batch)
        rows = batch.req_pool_indices.tolist()
        for step in range(2):  # the first step warms up; the second is counted
            batch = make_decode_batch(cache, rows, None, [3 + step, 4 + step])
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                with forward_context(batch):
                    model.forward(batch)
                torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def test_a_decoder_layer_launches_the_fused_kernels(record_property):
    two, four = _kernels_of_a_decode_step(2), _kernels_of_a_decode_step(4)
    per_layer = (four - two) / 2
    record_property("kernels_per_layer", per_layer)
    assert per_layer <= MAX_KERNELS_PER_LAYER, f"{per_layer} kernels per decoder layer ({two} at 2 layers, {four} at 4)"

"""Hardware floors of the reference model's steps, from rates measured in the same run.

* decode: the bytes a step must read (every weight once, plus the K/V of every request's
  context) over the measured device copy bandwidth;
* prefill: the step's FLOPs (2 per weight per token, plus causal attention's QK^T and PV)
  over the measured bf16 GEMM rate.

A floor is what no runner can beat on that device; a measured time over it says how much
is left (launches, host work, kernels below peak).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import torch


@dataclasses.dataclass(frozen=True)
class DeviceRates:
    """``copy_gbps``: device-to-device copy bandwidth (read + write bytes per second, in
    GB/s); ``gemm_tflops``: dense matmul rate of ``dtype`` (TFLOP/s)."""

    copy_gbps: float
    gemm_tflops: float


def _time_ms(fn: Any, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(3):  # the best of three blocks: a rate, not a latency
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / iters)
    return best


def measure_rates(dtype: torch.dtype = torch.bfloat16, copy_bytes: int = 1 << 30, gemm_n: int = 8192) -> DeviceRates:
    """Measure the copy bandwidth (a ``copy_bytes`` buffer copied) and the GEMM rate (an
    ``gemm_n`` cube of ``dtype``) on the current CUDA device.

    Raises:
        RuntimeError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("measure_rates needs a CUDA device")
    copy_gbps = 2 * copy_bytes / (_copy_ms(copy_bytes) * 1e-3) / 1e9
    gemm_tflops = 2 * gemm_n**3 / (_gemm_ms(gemm_n, dtype) * 1e-3) / 1e12
    torch.cuda.empty_cache()
    return DeviceRates(copy_gbps, gemm_tflops)


def _copy_ms(nbytes: int) -> float:
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    return _time_ms(lambda: dst.copy_(src), 20)


def _gemm_ms(n: int, dtype: torch.dtype) -> float:
    a = torch.randn(n, n, device="cuda").to(dtype)
    b = torch.randn(n, n, device="cuda").to(dtype)
    return _time_ms(lambda: a @ b, 10)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter, a tied one once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes_per_token(model: Any) -> int:
    """K and V bytes of one token over every layer (this rank's KV heads)."""
    c = model.config
    return 2 * c.num_hidden_layers * model.tp_layout.local_kv_heads * c.head_dim * model.dtype.itemsize


def decode_floor_ms(model: Any, batch_size: int, context: int, rates: DeviceRates) -> float:
    """A decode step of ``batch_size`` requests of ``context`` keys each: weights plus K/V
    read once, at the copy bandwidth (ms)."""
    read = weight_bytes(model) + batch_size * context * kv_bytes_per_token(model)
    return read / (rates.copy_gbps * 1e9) * 1e3


def prefill_flops(model: Any, request_lengths: Sequence[int]) -> float:
    """FLOPs of a prefill of requests of ``request_lengths`` new tokens (no cached prefix):
    2 per matrix weight per token (the LM head only for each request's last token), plus
    causal attention, 2 x 2 x heads x head_dim per (query, visible key) pair."""
    c = model.config
    tokens = sum(request_lengths)
    embed = c.vocab_size * c.hidden_size
    matrices = sum(p.numel() for p in model.parameters() if p.dim() == 2) - embed * (1 if c.tie_word_embeddings else 2)
    pairs = sum(n * (n + 1) // 2 for n in request_lengths)
    attention = 4 * c.num_attention_heads * c.head_dim * pairs * c.num_hidden_layers
    return 2.0 * matrices * tokens + 2.0 * embed * len(request_lengths) + attention


def prefill_floor_ms(model: Any, request_lengths: Sequence[int], rates: DeviceRates) -> float:
    """The prefill's FLOPs at the GEMM rate (ms)."""
    return prefill_flops(model, request_lengths) / (rates.gemm_tflops * 1e12) * 1e3

"""CPU check that a backend acts only on its runner's device, whatever device is current.

A backend built with ``device="cuda:1"`` and a recording
:class:`~cuda_graph_runner.testing.fakes.FakeGraphDeviceModule` whose current device is 0
is driven by a ``DecodeCudaGraphRunner`` through capture, replay, cleanup and
recapture; every stream, graph, synchronize and device-guard call the fake records must
name device 1. This is the CPU half of the device invariant (DESIGN.md, "Device"); a
``Stream()`` or ``synchronize()`` without a device, or a capture outside the runner's
device guard, shows up as a call on device 0. The conformance kit runs it for every
backend (``test_fake_device_calls_name_the_runners_device``).

The model is a tiny Dynamo-traceable decoder without marked ops whose tensors live on
the CPU: the fake device module records calls, it moves no data.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..backend.base import BaseCudaGraphBackend
from ..backend.forward_batch import ForwardBatch, ForwardMode
from .fakes import FakeGraphDeviceModule

__all__ = ["TinyDecodeModel", "tiny_decode_batch", "check_device_calls"]


class TinyDecodeModel(torch.nn.Module):
    """A decoder honouring the runner's model protocol, for CPU runner checks.

    ``forward(batch) -> hidden [num_tokens, hidden] float32`` depends on the token ids
    and positions; ``compute_logits(hidden, batch) -> [num_tokens, vocab] float32``.
    """

    def __init__(self, vocab: int = 16, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(vocab, hidden, generator=g))
        self.head = torch.nn.Parameter(torch.randn(hidden, vocab, generator=g))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.embed[batch.input_ids] + 0.01 * batch.positions.float().unsqueeze(1)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return (hidden @ self.head).float()


def tiny_decode_batch(bs: int, vocab: int = 16) -> ForwardBatch:
    """A decode batch of ``bs`` requests on the CPU (int64 ids/positions/slots, int32 lens)."""
    seq = torch.arange(bs, dtype=torch.int32) + 3
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=(torch.arange(bs) * 3 + 1) % vocab,
        positions=seq.long() - 1,
        out_cache_loc=torch.arange(bs) + 10,
        req_pool_indices=torch.arange(bs) + 1,
        seq_lens=seq,
        seq_lens_cpu=seq.tolist(),
    )


def check_device_calls(
    make_backend: Callable[[str, Any], BaseCudaGraphBackend],
    *,
    device_index: int = 1,
    current_device: int = 0,
    max_bs: int = 4,
    replay_sizes: Tuple[int, ...] = (3, 1),
) -> FakeGraphDeviceModule:
    """Drive a backend on fake device ``device_index`` while ``current_device`` is current.

    Args:
        make_backend: ``make_backend(device, device_module) -> backend``, e.g.
            ``lambda d, m: MyBackend(d, phase="decode", device_module=m)``.
        device_index, current_device: the runner's device and the current one (differ).
        max_bs: the runner's ``max_bs``.
        replay_sizes: batch sizes run through ``runner.forward`` after capture.

    Returns:
        The fake device module (its ``device_calls`` for further checks).

    Raises:
        AssertionError: a recorded call named another device (listed), nothing was
            recorded, or the current device was not restored.
    """
    from ..runner import DecodeCudaGraphRunner

    fake = FakeGraphDeviceModule(current_device=current_device)
    backend = make_backend(f"cuda:{device_index}", fake)
    runner = DecodeCudaGraphRunner(
        TinyDecodeModel(), {"decode": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False
    )
    with torch.no_grad():
        for _ in range(2):  # capture, replay, cleanup; then once more (recapture)
            runner.capture()
            for bs in replay_sizes:
                runner.forward(tiny_decode_batch(bs))
            runner.cleanup()
    assert fake.device_calls, "the runner and backend made no device call at all (the fake recorded none)"
    foreign: List[Tuple[str, Optional[int]]] = fake.foreign_device_calls(device_index)
    assert not foreign, (
        f"backend {type(backend).__name__} on cuda:{device_index} (current device {current_device}) made "
        f"{len(foreign)} call(s) on another device: {foreign[:10]}; create streams with Stream(device=...), "
        f"synchronize(device), and capture/replay inside the device guard the runner holds"
    )
    assert fake.current == current_device, (
        f"the current device is {fake.current} after the run, was {current_device}: a device guard leaked"
    )
    return fake

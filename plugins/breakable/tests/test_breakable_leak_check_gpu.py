"""GPU: breakable's leaked-output check inside real CUDA stream captures.

* A marked op that stashes a tensor it made, read by the next segment: the capture fails
  naming the op (without the check the replay's logits differ from eager);
* the reference model (its attention an out-op) captures with the check on and replays
  as eager.

Run on the device machine: ``python -m pytest plugins/breakable/tests/test_breakable_leak_check_gpu.py``.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from breakable_mix_model import request_lens

from cuda_graph_runner.backend import eager_op, get_forward_batch
from cuda_graph_runner.testing.reference_setup import reference_model
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.workload import (
    PrefillCudaGraphRunner,
    eager_logits_fn,
    make_dummy_prompts,
    make_extend_batch,
)

pytestmark = pytest.mark.gpu

VOCAB, HIDDEN = 16, 8
STASH: Dict[str, torch.Tensor] = {}


@eager_op("test_breakable_gpu_leak_stash")
def stash_scale(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(x * 2)
    STASH["scale"] = torch.full((x.shape[0], 1), float(len(request_lens(get_forward_batch()))), device=x.device)


class LeakyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g).cuda(), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g).cuda(), requires_grad=False)

    def forward(self, batch):
        h = self.embed[batch.input_ids]
        out = torch.empty_like(h)
        stash_scale(out, h)
        return out * STASH["scale"] + h

    def compute_logits(self, hidden, batch):
        return (hidden @ self.head).float()


def _runner(model, check: bool, bs) -> PrefillCudaGraphRunner:
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    device = torch.device("cuda", torch.cuda.current_device())
    backend = BreakableCudaGraphBackend(str(device), phase="prefill", check_leaked_outputs=check)
    return PrefillCudaGraphRunner(model, {"prefill": {"bs": bs}}, backend=backend, show_progress=False)


def test_a_stashed_tensor_fails_the_capture_and_replays_stale_without_the_check():
    from cuda_graph_runner_breakable.backend import BreakableLeakedOutputError

    with pytest.raises(BreakableLeakedOutputError, match="test_breakable_gpu_leak_stash"):
        _runner(LeakyModel(), True, [8]).capture()
    runner = _runner(LeakyModel(), False, [8])
    runner.capture()
    batch = synthetic_extend_batch(
        [2, 3, 3], None, token_stride=5, token_offset=1, vocab=VOCAB, first_slot=50, device="cuda"
    )
    assert runner.can_run(batch)
    got = runner.forward(batch).clone()
    assert not torch.allclose(got, runner.eager_forward(batch))


def test_the_reference_model_captures_with_the_check_and_replays_as_eager():
    model = reference_model("tiny", requests=8)
    runner = _runner(model, True, [64])
    runner.capture()
    batch = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [20, 9, 14], model.config.vocab_size, seed=5))
    expected = eager_logits_fn(model)(batch)
    assert runner.can_run(batch)
    torch.testing.assert_close(runner.forward(batch), expected, rtol=1e-3, atol=1e-3)
    runner.cleanup()

"""Breakable's leaked-output check (``check_leaked_outputs``) on emulated graphs.

A marked op that stashes a tensor it made (here in a module-level dict) instead of writing
it into an output argument or returning it: without the check the emulated replay reads
the capture's tensor (stale: wrong logits, silently); with the check the capture fails
naming the op, the reader and the tensor. Clean models (out-ops, a returning op, a nested
op, the reference model's attention) capture with the check on and replay as eager.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch
from breakable_mix_model import MixModel as SharedMixModel
from breakable_mix_model import request_lens

from cuda_graph_runner.backend import eager_op, envs, get_forward_batch
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.workload import PrefillCudaGraphRunner
from cuda_graph_runner_breakable.backend import (
    ENV_CHECK_LEAKED_OUTPUTS,
    BreakableCudaGraphBackend,
    BreakableLeakedOutputError,
)
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

VOCAB, HIDDEN = 16, 8
STASH: Dict[str, torch.Tensor] = {}
LEAKY = "cuda_graph_runner::test_breakable_leak_stash"


@eager_op("test_breakable_leak_stash")
def stash_scale(output: torch.Tensor, x: torch.Tensor) -> None:
    """Writes ``output`` (declared) and stashes a per-batch scale it made (the leak)."""
    output.copy_(x * 2)
    STASH["scale"] = torch.full((x.shape[0], 1), float(len(request_lens(get_forward_batch()))))


@eager_op("test_breakable_leak_clean_mix")
def clean_mix(output: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Per-request cumulative sums into ``output``, with temporaries of its own."""
    start = 0
    for n in request_lens(get_forward_batch()):
        part = x[start : start + n].cumsum(0) * scale  # made here, consumed here
        output[start : start + n] = part
        start += n
    output[start:].zero_()


@eager_op("test_breakable_leak_clean_returning", mutates_args=())
def clean_returning(x: torch.Tensor) -> torch.Tensor:
    """Returns what it made: declared."""
    return x * float(len(request_lens(get_forward_batch())))


class LeakyModel(torch.nn.Module):
    """Reads the stashed scale in the segment after the op."""

    def __init__(self, *, into_output: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g), requires_grad=False)
        self.into_output = into_output

    def forward(self, batch):
        h = self.embed[batch.input_ids]
        out = torch.empty_like(h)
        stash_scale(out, h)
        if self.into_output:  # the forward returns the stashed tensor itself
            return STASH["scale"].expand(-1, HIDDEN)
        return out * STASH["scale"] + h

    def compute_logits(self, hidden, batch):
        return (hidden @ self.head).float()


def _runner(model, check, max_bs: int = 8, bs=None) -> PrefillCudaGraphRunner:
    backend = BreakableCudaGraphBackend(
        "cpu",
        phase="prefill",
        device_module=EmulatedGraphDeviceModule(),
        memory_pool="pool-0",
        check_leaked_outputs=check,
    )
    return PrefillCudaGraphRunner(
        model,
        {"prefill": {"max_bs": max_bs, "bs": bs}},
        device="cpu",
        backend=backend,
        show_progress=False,
    )


def _batch(lens, offset=1):
    return synthetic_extend_batch(lens, None, token_stride=5, token_offset=offset, vocab=VOCAB, first_slot=50)


def test_a_planted_leak_replays_stale_values_without_the_check():
    runner = _runner(LeakyModel(), check=False)
    with torch.no_grad():
        runner.capture()
        batch = _batch([2, 3, 3])  # 3 requests; the capture's dummy batch had other counts
        assert runner.can_run(batch)
        got = runner.forward(batch).clone()
        assert not torch.allclose(got, runner.eager_forward(batch))


def test_the_check_names_the_op_the_reader_and_the_tensor():
    runner = _runner(LeakyModel(), check=True)
    with pytest.raises(BreakableLeakedOutputError) as info:
        runner.capture()
    err = info.value
    assert [leak.op for leak in err.leaks] == [LEAKY]
    leak = err.leaks[0]
    assert leak.reader.startswith("segment 1 (aten::mul")
    assert leak.shape == (8, 1) and leak.dtype == torch.float32
    assert LEAKY in str(err) and "mutates_args" in str(err)
    assert runner.captured_keys == [] and runner.backend.captured_keys == []  # nothing half kept


def test_a_leak_returned_as_the_forward_output_is_reported():
    runner = _runner(LeakyModel(into_output=True), check=True)
    with pytest.raises(BreakableLeakedOutputError, match="forward's output"):
        runner.capture()


def test_a_leak_passed_to_a_later_op_is_reported():
    class PassesOn(LeakyModel):
        def forward(self, batch):
            h = self.embed[batch.input_ids]
            out = torch.empty_like(h)
            stash_scale(out, h)
            out2 = torch.empty_like(h)
            clean_mix(out2, STASH["scale"].expand(-1, HIDDEN).contiguous() + out, 0.5)
            return out2

    # The expand/contiguous runs in segment 1 (read there first); a later op's argument
    # made by an earlier op directly:
    class Direct(LeakyModel):
        def forward(self, batch):
            h = self.embed[batch.input_ids]
            out = torch.empty_like(h)
            stash_scale(out, h)
            out2 = torch.empty((h.shape[0], 1))
            clean_mix(out2, STASH["scale"], 0.5)
            return out2.expand(-1, HIDDEN) + out

    with pytest.raises(BreakableLeakedOutputError, match="segment 1"):
        _runner(PassesOn(), check=True).capture()
    with pytest.raises(BreakableLeakedOutputError) as info:
        _runner(Direct(), check=True).capture()
    assert any(
        "test_breakable_leak_clean_mix" in leak.reader and "argument" in leak.reader for leak in info.value.leaks
    )


@pytest.mark.parametrize("returning", [False, True])
def test_clean_models_pass_the_check_and_replay_as_eager(returning):
    model = SharedMixModel(clean_mix, clean_returning, vocab=VOCAB, hidden=HIDDEN, slot_term=True, returning=returning)
    runner = _runner(model, check=True, max_bs=16)
    with torch.no_grad():
        runner.capture()
        for i, lens in enumerate([[4], [1, 3], [2, 2, 4], [5, 11], [16]]):
            batch = _batch(lens, offset=i)
            torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    assert runner.backend.check_leaked_outputs


def test_the_reference_model_passes_the_check():
    from cuda_graph_runner.testing.workload import (
        ReferenceLlamaForCausalLM,
        eager_logits_fn,
        make_dummy_prompts,
        make_extend_batch,
    )

    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32)
    model.create_kv_cache(num_slots=1024, max_reqs=8, max_context_len=32)
    runner = _runner(model, check=True, bs=[16])
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, make_dummy_prompts(2, [5, 7], model.config.vocab_size, seed=1))
        assert runner.can_run(batch)
        torch.testing.assert_close(runner.forward(batch), eager_logits_fn(model)(batch), rtol=1e-4, atol=1e-4)


def test_the_switch_defaults_to_the_environment(monkeypatch):
    def built():
        return BreakableCudaGraphBackend("cpu", phase="prefill", device_module=EmulatedGraphDeviceModule())

    monkeypatch.delenv(ENV_CHECK_LEAKED_OUTPUTS, raising=False)
    assert built().check_leaked_outputs is False
    monkeypatch.setenv(ENV_CHECK_LEAKED_OUTPUTS, "on")
    assert built().check_leaked_outputs is True
    monkeypatch.setenv(ENV_CHECK_LEAKED_OUTPUTS, "maybe")
    with pytest.raises(envs.EnvVarError, match="CHECK_LEAKED_OUTPUTS"):
        built()

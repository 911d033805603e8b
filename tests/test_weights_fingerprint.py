"""Weights that change under captured graphs: in-place updates pass, re-assigned tensors
raise a StaleWeightsError naming them (runner.check_weights, check_weights_every, capture)."""

from __future__ import annotations

import pytest
import torch
from toy_model import ToyModel, decode_batch

from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.weights import StaleWeightsError, WeightsFingerprint
from cuda_graph_runner.testing.fakes import RecordingBackend


class BufferedToy(ToyModel):
    """The toy model plus a buffer its forward reads (as a rotary cos/sin cache is)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.ones(1), persistent=False)

    def forward(self, batch):
        return super().forward(batch) * self.scale


def make_runner(model=None, **decode):
    cfg = CudaGraphConfig.from_dict({"decode": {"bs": [1, 2, 4], **decode}})
    return DecodeCudaGraphRunner(
        model or BufferedToy(), cfg, device="cpu", backend=RecordingBackend("cpu", phase="decode"), show_progress=False
    )


def test_in_place_updates_pass_and_follow():
    runner = make_runner()
    runner.capture()
    assert runner.check_weights() == 3  # embed, head, buffer scale
    before = runner.forward(decode_batch(2)).clone()
    with torch.no_grad():
        runner.model.embed.copy_(runner.model.embed * 2)  # bumps the version counter, same storage
        runner.model.load_state_dict({k: v.clone() for k, v in runner.model.state_dict().items()})  # in place
    assert runner.check_weights() == 3
    assert not torch.equal(runner.forward(decode_batch(2)), before)


def reassign(model, how):
    if how == "assign":
        model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    elif how == "new_parameter":
        model.head = torch.nn.Parameter(model.head.detach().clone())
    elif how == "data":
        model.embed.data = model.embed.data.clone()
    elif how == "buffer":
        model.scale = torch.full((1,), 2.0)
    else:
        model.double()


def test_reassigned_weights_raise_naming_them_and_the_fix():
    runner = make_runner()
    runner.capture()
    model = runner.model
    cases = [
        ("assign", ["embed", "head"]),
        ("new_parameter", ["head"]),
        ("data", ["embed"]),
        ("buffer", ["buffer scale"]),
        ("cast", ["embed", "head", "buffer scale"]),
    ]
    for how, names in cases:
        kept = (model.embed, model.embed.data, model.head, model.head.data, model.scale)
        reassign(model, how)
        with pytest.raises(StaleWeightsError) as info:
            runner.check_weights()
        assert info.value.changed == names and info.value.phase == "decode", how
        message = str(info.value)
        assert all(n in message for n in names) and "in place" in message and "recapture" in message
        # The very tensors put back: the graphs read them again.
        model.embed, model.head = kept[0], kept[2]
        model.embed.data, model.head.data = kept[1], kept[3]
        model.scale = kept[4]
        assert runner.check_weights() == 3, how
    reassign(model, "assign")
    runner.cleanup()  # the fix: recapture
    runner.capture()
    assert runner.check_weights() == 3


def test_renamed_or_removed_parameters_are_named():
    old = BufferedToy()  # alive: a freed model's memory may be reused at the same addresses
    before = WeightsFingerprint.take(old)
    model = BufferedToy()
    model.extra = torch.nn.Parameter(torch.zeros(2))
    del model.head
    changed, missing, added = before.diff(WeightsFingerprint.take(model))
    assert (missing, added) == (["head"], ["extra"]) and "embed" in changed  # a new model: new storage


def test_capture_of_more_sizes_checks_the_graphs_held():
    runner = make_runner()
    runner.capture(sizes=[4])
    runner.model.head = torch.nn.Parameter(runner.model.head.detach().clone())
    with pytest.raises(StaleWeightsError, match="head"):
        runner.capture()
    assert runner._captured_sizes() == [4]


def test_check_weights_every_n_replays():
    runner = make_runner(check_weights_every=3)
    runner.capture()
    for _ in range(4):  # the 3rd replay checks and passes
        runner.forward(decode_batch(2))
    runner.model.head = torch.nn.Parameter(runner.model.head.detach().clone())
    runner.forward(decode_batch(2))  # the 5th is not checked
    with pytest.raises(StaleWeightsError, match="head"):
        runner.forward(decode_batch(2))  # the 6th is checked before it replays
    assert runner.run_stats()["replays"] == 5


def test_check_weights_off_by_default_and_nothing_before_capture():
    runner = make_runner()
    assert runner.check_weights() == 0  # no graphs: nothing to check
    runner.capture()
    runner.model.head = torch.nn.Parameter(runner.model.head.detach().clone())
    runner.forward(decode_batch(2))  # off: forward does not look
    with pytest.raises(StaleWeightsError):
        runner.check_weights()


@pytest.mark.parametrize("value", [-1, True, "3", 1.5])
def test_check_weights_every_bad_values(value):
    with pytest.raises(CudaGraphConfigError, match="check_weights_every"):
        CudaGraphConfig.from_dict({"decode": {"check_weights_every": value}})


def test_a_kv_cache_replaced_under_the_graphs_is_named():
    from cuda_graph_runner.testing.reference_setup import reference_model

    model = reference_model("tiny", requests=2, context=8, device="cpu")
    before = WeightsFingerprint.take(model)
    assert "kv_cache.k_buffers[0]" in before.names and "kv_cache.req_to_token" in before.names
    old = model.kv_cache  # alive, so the new cache gets new memory
    model.create_kv_cache(num_slots=17, max_reqs=3, max_context_len=8)
    changed, _, _ = before.diff(WeightsFingerprint.take(model))
    assert "kv_cache.k_buffers[0]" in changed and "kv_cache.req_to_token" in changed and old is not None
    now = WeightsFingerprint.take(model)
    with torch.no_grad():
        model.kv_cache.k_buffers[0].fill_(1.0)  # written in place: same storage
    assert now.same_as(WeightsFingerprint.take(model))


class _OwnValuesDP:
    """A DP group's step agreement in one process (every rank's values are this rank's),
    recorded; a failed decision raises as the group's agreement does."""

    def __init__(self) -> None:
        self.seen: list = []

    def agree_batch(self, size, ready, variant, *, variants=("",), failed=None):
        self.seen.append((size, ready, variant, failed))
        if failed is not None:
            from cuda_graph_runner.runner.dp_group import DataParallelStepError

            raise DataParallelStepError(failed)
        return size, ready, variant


def test_data_parallel_step_checks_weights_before_its_agreement():
    from cuda_graph_runner.runner.data_parallel import dp_forward

    runner = make_runner(check_weights_every=1)
    runner.capture()
    dp = _OwnValuesDP()
    dp_forward(runner, dp, decode_batch(2))
    assert dp.seen[-1][3] is None
    reassign(runner.model, "data")
    with pytest.raises(StaleWeightsError, match="embed"):
        dp_forward(runner, dp, decode_batch(2))
    assert dp.seen[-1][3] is not None and "StaleWeightsError" in dp.seen[-1][3]  # the other ranks are told

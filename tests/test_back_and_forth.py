"""Back-and-forth: a runner converts its config once and hands the result to the
registry (which converts nothing more), and a live size's padded size and graph key are
computed once (``replay_target``), shared by ``decide``/``can_run`` and ``replay_prepare``."""

from __future__ import annotations

import pytest

from cuda_graph_runner import registry
from cuda_graph_runner.backend import DisabledBackend, ShapeKey
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError, PhaseConfig, as_config
from cuda_graph_runner.registry import manager
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner import base as runner_base
from cuda_graph_runner.runner.decision import EagerDecision, ReplayDecision
from cuda_graph_runner.runner.stats import REASON_NOT_CAPTURED, REASON_PADDING, REASON_TOO_LARGE
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch


class PlainBackend(DisabledBackend):
    """Reads no backend option (like ``full``); runs anywhere."""


@pytest.fixture()
def plain():
    registry.register(
        BackendSpec(
            name="plain", backend_class=PlainBackend, phases=("decode", "prefill"), devices=("*",), api_version="1.1"
        )
    )


# -- the config, converted once --------------------------------------------------------------


def test_a_phase_config_given_to_a_runner_sets_only_what_differs_from_the_defaults(plain):
    # Converted twice before (every field recorded as set), tc_compiler counted as set and
    # a backend that does not read it (full, here plain) was refused.
    runner = DecodeCudaGraphRunner(ToyModel(), PhaseConfig(backend="plain", max_bs=4), device="cpu")
    assert isinstance(runner.backend, PlainBackend) and runner.capture_sizes == [1, 2, 4]
    assert runner.config.sources == {("decode", "backend"): "api", ("decode", "max_bs"): "api"}
    # An option that is really set is still checked, whichever form carries it.
    for form in (PhaseConfig(backend="plain", tc_compiler="inductor"), {"backend": "plain", "tc_compiler": "inductor"}):
        with pytest.raises(CudaGraphConfigError, match="does not read option 'tc_compiler'"):
            DecodeCudaGraphRunner(ToyModel(), form, device="cpu")


def test_runners_and_resolve_accept_the_same_forms(plain):
    forms = ["plain", {"backend": "plain"}, {"decode": {"backend": "plain"}}, PhaseConfig(backend="plain")]
    for form in forms:
        assert as_config(form, "decode")["decode"].backend == "plain", form
        assert isinstance(DecodeCudaGraphRunner(ToyModel(), form, device="cpu").backend, PlainBackend), form
        assert isinstance(registry.resolve_decode_backend(form, device="cpu"), PlainBackend), form
    with pytest.raises(TypeError, match="got int"):
        as_config(3, "decode")
    with pytest.raises(ValueError, match="phase must be"):
        as_config(None, "verify")


def test_as_config_returns_a_config_unchanged_and_copies_a_phase_config():
    config = CudaGraphConfig.from_dict({"decode": {"backend": "full"}})
    assert as_config(config, "decode") is config
    mine = PhaseConfig(bs=[1, 2])
    converted = as_config(mine, "prefill")["prefill"]
    assert converted == mine and converted is not mine and converted.bs is not mine.bs


def test_the_runner_converts_once_and_resolve_gets_that_object(plain, monkeypatch):
    conversions = []

    def counting(real):
        def wrapper(config, phase):
            if not isinstance(config, CudaGraphConfig):
                conversions.append(type(config).__name__)
            return real(config, phase)

        return wrapper

    monkeypatch.setattr(runner_base, "as_config", counting(runner_base.as_config))
    monkeypatch.setattr(manager, "as_config", counting(manager.as_config))
    seen = []
    real_resolve = manager.BackendRegistry.resolve

    def resolve(self, phase, config=None, **kwargs):
        seen.append(config)
        return real_resolve(self, phase, config, **kwargs)

    monkeypatch.setattr(manager.BackendRegistry, "resolve", resolve)
    from_dict_calls = []
    real_from_dict = CudaGraphConfig.from_dict.__func__
    monkeypatch.setattr(
        CudaGraphConfig,
        "from_dict",
        classmethod(lambda cls, d, **kw: from_dict_calls.append(d) or real_from_dict(cls, d, **kw)),
    )
    runner = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "plain", "max_bs": 8}}, device="cpu")
    assert conversions == ["dict"] and len(from_dict_calls) == 1
    assert seen == [runner.config] and seen[0] is runner.config
    assert runner.backend.phase_config is runner.phase_config


# -- padded size and key, once per batch ------------------------------------------------------


def _count_calls(monkeypatch, runner, names):
    counts = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(runner, name)

        def wrapper(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(runner, name, wrapper)
    return counts


def _extend_batch(lens):
    return synthetic_extend_batch(lens, first_slot=100)


def test_decode_forward_computes_padded_size_and_key_once_per_batch(monkeypatch):
    runner = DecodeCudaGraphRunner(
        ToyModel(), {"decode": {"bs": [2, 4, 8]}}, device="cpu", backend=RecordingBackend("cpu"), show_progress=False
    )
    runner.capture()
    counts = _count_calls(monkeypatch, runner, ["padded_size", "make_key"])
    out = runner.forward(decode_batch(3))
    assert runner.backend.events[-1] == ("replay", ShapeKey(4, "decode")) and out.shape[0] == 3
    assert counts == {"padded_size": 1, "make_key": 1}  # before: 2 and 2 (can_run, then replay_prepare)
    runner.forward(decode_batch(3))
    runner.forward(decode_batch(4))  # pads to the same size: its key is reused
    assert counts == {"padded_size": 2, "make_key": 1}  # once per live size, not per call


def test_prefill_forward_computes_padded_size_once_per_batch(monkeypatch):
    runner = PrefillCudaGraphRunner(
        ToyModel(),
        {"prefill": {"bs": [8, 16]}},
        device="cpu",
        backend=RecordingBackend("cpu", phase="prefill"),
        show_progress=False,
    )
    runner.capture()
    counts = _count_calls(monkeypatch, runner, ["padded_size", "make_key"])
    runner.forward(_extend_batch([4, 6]))
    assert runner.backend.events[-1] == ("replay", ShapeKey(16, "extend"))
    assert counts == {"padded_size": 1, "make_key": 1}  # before: 3 (the 2x rule asked again) and 2
    # The padding rule reads the same decision: 3 tokens pad to 8 > 2 * 3, eager.
    assert runner.decide(_extend_batch([3])) == EagerDecision(REASON_PADDING) and not runner.can_run(_extend_batch([3]))


def test_decide_says_what_replay_uses():
    runner = DecodeCudaGraphRunner(
        ToyModel(), {"decode": {"bs": [2, 4]}}, device="cpu", backend=RecordingBackend("cpu"), show_progress=False
    )
    assert runner.decide(decode_batch(1)) == EagerDecision(REASON_NOT_CAPTURED)
    runner.capture()
    decision = runner.decide(decode_batch(3))
    assert decision == ReplayDecision(size=3, padded=4, key=ShapeKey(4, "decode"))
    assert runner.decide(decode_batch(5)) == EagerDecision(REASON_TOO_LARGE)
    key, static = runner.replay_prepare(decode_batch(3))  # the same target as the decision
    assert key == decision.key and static.batch_size == decision.padded
    assert runner.replay_target(1) == (2, ShapeKey(2, "decode"))

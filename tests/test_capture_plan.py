"""Plugin API 1.1: the base backend's shared mechanics, the capture plan a runner hands its
backend, the contract's model-forward wrapper, and a plugin declaring API 1.0 listed
unavailable with what it must add."""

from __future__ import annotations

import contextlib
import gc
import json

import pytest
import torch

from cuda_graph_runner import registry
from cuda_graph_runner.backend import BaseCudaGraphBackend, ShapeKey
from cuda_graph_runner.backend.buffers import copy_into
from cuda_graph_runner.backend.capture_plan import CapturePlan
from cuda_graph_runner.backend.errors import BackendUnavailableError
from cuda_graph_runner.backend.graph_table import CapturedGraphs
from cuda_graph_runner.backend.hookspecs import BackendSpec
from cuda_graph_runner.backend.model_forward import forward_wrappers, wrap_model_forward
from cuda_graph_runner.cli.command import main
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.conformance import BackendConformanceTests
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch


class MinimalGraphBackend(BaseCudaGraphBackend):
    """All a ``device_module.graph`` backend writes on top of the base class (1.1)."""

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        self.record_graph(key, forward_fn, self.device_module.CUDAGraph, post_warmup_hook)

    def replay(self, key, static_batch):
        return self.replay_graph(key)


class PlanEagerBackend(BaseCudaGraphBackend):
    """An eager backend done right: replay runs the plan's forward on the live batch."""

    host_value_guard = "off"  # every replay re-runs the forward's Python

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        self.graph_table.check_new(key)
        self.warm_up(forward_fn, post_warmup_hook, key=key)
        self.graph_table.add(key, None, forward_fn())

    def replay(self, key, static_batch):
        output = self.graph_table.output(key)
        copy_into(output, self.capture_plan.forward(static_batch))
        return output


class TrapEagerBackend(PlanEagerBackend):
    """The trap of the plugin guide: it stores ``forward_fn`` and calls it at replay."""

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)
        self._fns = {**getattr(self, "_fns", {}), key: forward_fn}

    def replay(self, key, static_batch):
        output = self.graph_table.output(key)
        copy_into(output, self._fns[key]())  # bound to the capture-time batch
        return output


class RunnerReadingBackend(BaseCudaGraphBackend):
    """A plugin API 1.0 backend: all six methods, and a prepare(runner) that reads the runner."""

    def prepare(self, runner):
        self.seen = {
            "model": runner.model,
            "sizes": list(runner.capture_sizes),
            "key": runner.make_key(2),
            "batch": runner.capture_prepare(2),
        }
        self.forward = runner.graph_forward

    @contextlib.contextmanager
    def capture_session(self, stream):
        yield

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        self._out = {**getattr(self, "_out", {}), key: forward_fn()}

    def can_run(self, batch, key):
        return key in self._out

    @contextlib.contextmanager
    def replay_session(self):
        yield

    def replay(self, key, static_batch):
        copy_into(self._out[key], self.forward(static_batch))
        return self._out[key]

    def cleanup(self):
        self._out = {}


def _runner(backend, sizes=(1, 2, 4)):
    config = {"decode": {"max_bs": max(sizes), "bs": list(sizes)}}
    return DecodeCudaGraphRunner(ToyModel(), config, device="cpu", backend=backend, show_progress=False)


# ------------------------------------------------------------------------- the base class
def test_two_methods_make_a_backend_and_the_table_gives_the_errors():
    dm = FakeGraphDeviceModule()
    backend = MinimalGraphBackend("cuda:0", device_module=dm)
    assert BaseCudaGraphBackend.__abstractmethods__ == frozenset({"capture_one", "replay"})
    registry.check_backend_class(MinimalGraphBackend, "minimal")  # sessions, can_run, cleanup: defaults
    key = ShapeKey(2, "decode")
    with backend.capture_session("stream"):
        assert backend.capture_stream == "stream"
        backend.capture_one(key, lambda: torch.ones(2))
        with pytest.raises(ValueError, match=r"shape ShapeKey\(size=2, variant='decode'\) is already captured"):
            backend.capture_one(key, lambda: torch.ones(2))
    assert backend.capture_stream is None and backend.captured_keys == [key]
    assert backend.can_run(decode_batch(2), key) and not backend.can_run(decode_batch(1), ShapeKey(1, "decode"))
    with backend.replay_session():
        assert torch.equal(backend.replay(key, decode_batch(2)), torch.ones(2))
    with pytest.raises(KeyError, match=r"no graph captured for ShapeKey\(size=1.*captured: \[ShapeKey\(size=2"):
        backend.replay(ShapeKey(1, "decode"), decode_batch(1))
    backend.cleanup()
    assert backend.captured_keys == [] and "reset" in [e[0] for e in dm.events]


def test_graph_table_resets_what_it_can_and_keeps_capture_order():
    table = CapturedGraphs()

    class G:
        resets = 0

        def reset(self):
            G.resets += 1

    table.add(ShapeKey(4), G(), "out4")
    table.add(ShapeKey(1), object(), "out1")  # no reset(): forgotten all the same
    assert table.keys() == [ShapeKey(4), ShapeKey(1)] and list(table.outputs()) == ["out4", "out1"]
    table.clear()
    assert G.resets == 1 and len(table) == 0


# ------------------------------------------------------------------------- the capture plan
def test_runner_hands_the_plan_before_prepare_and_replay_runs_the_plans_forward():
    backend = PlanEagerBackend("cpu")
    runner = _runner(backend)
    runner.capture()
    plan = backend.capture_plan
    assert isinstance(plan, CapturePlan) and plan.model is runner.model and plan.phase == "decode"
    assert plan.keys == tuple(ShapeKey(s, "decode") for s in (4, 2, 1)) and plan.sizes == [4, 2, 1]
    assert plan.static_batch(ShapeKey(2, "decode")).batch_size == 2
    with pytest.raises(KeyError, match=r"not in this capture plan; planned: \[ShapeKey\(size=4"):
        plan.static_batch(ShapeKey(3, "decode"))
    assert plan.run(ShapeKey(1, "decode")).shape[0] == 1
    with pytest.raises(AttributeError, match="'CapturePlan' object has no attribute 'buffers'"):
        plan.buffers  # noqa: B018 - the plan answers its own names only
    for bs in (1, 3, 4):
        batch = decode_batch(bs, offset=bs)
        torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    assert runner.stats.summary(runner.capture_sizes)["replays"] == 3


def test_a_backend_reading_the_runner_in_prepare_fails_on_the_plan():
    runner = _runner(RunnerReadingBackend("cpu"))
    with pytest.raises(AttributeError, match="'CapturePlan' object has no attribute 'capture_sizes'"):
        runner.capture()


def test_a_plugin_declaring_api_1_0_is_unavailable_naming_what_it_must_add(capsys):
    registry.register(
        BackendSpec(
            name="reads_runner",
            backend_class=RunnerReadingBackend,
            phases=("decode",),
            devices=("*",),
            api_version="1.0",
        )
    )
    to_add = "to be 1.1, take the capture plan in prepare(plan)"
    row = {e.name: e for e in registry.list_backends("cpu")}["reads_runner"]
    assert row.status == "unavailable", row
    assert "implements plugin API 1.0, older than the 1.1" in row.reason and to_add in row.reason
    assert "declare api_version='1.1'" in row.reason
    with pytest.raises(BackendUnavailableError, match="backend 'reads_runner'.*is unavailable") as info:
        registry.resolve_decode_backend("reads_runner", device="cpu")
    assert to_add in str(info.value)
    assert main(["backends", "--json"]) == 0
    listed = {r["name"]: r for r in json.loads(capsys.readouterr().out)}["reads_runner"]
    assert listed["status"] == "unavailable" and to_add in listed["reason"]


# ------------------------------------------------------------------------- the model-forward wrapper
def test_wrapping_the_forward_dispatches_while_active_and_removal_restores_it():
    model = ToyModel()
    batch = decode_batch(2)
    on = {"a": False, "b": False}
    a = wrap_model_forward(model, lambda b: "a", active=lambda: on["a"])
    b = wrap_model_forward(model, lambda b: "b", active=lambda: on["b"])
    assert forward_wrappers(model) == [a, b] and a.original == b.original
    assert torch.equal(model.forward(batch), type(model).forward(model, batch))  # none active: as written
    on["b"] = True
    assert model.forward(batch) == "b"
    a.remove()
    assert model.forward(batch) == "b"
    b.remove()
    assert "forward" not in model.__dict__ and forward_wrappers(model) == []


def test_a_wrapper_keeps_its_backend_weakly():
    model = ToyModel()

    class Owner:
        def forward(self, batch):
            return "owner"

        def active(self):
            return True

    owner = Owner()
    wrap_model_forward(model, owner.forward, active=owner.active)
    assert model.forward(decode_batch(1)) == "owner"
    del owner
    gc.collect()
    assert isinstance(model.forward(decode_batch(1)), torch.Tensor)  # a dead owner is never active


# ------------------------------------------------------------------------- the kit catches the trap
def _kit_for(name, cls, phases=("decode", "prefill")):
    registry.register(BackendSpec(name=name, backend_class=cls, phases=phases, devices=("cpu",), api_version="1.1"))

    class Kit(BackendConformanceTests):
        backend_name = name
        device_type = "cpu"
        prefill_max_tokens = 16  # few capture sizes: a fast CPU test
        prefill_prompt_lens = ((5, 9, 3),)

    return Kit()


def test_kit_catches_a_replay_that_runs_the_capture_batch():
    kit = _kit_for("trap_eager", TrapEagerBackend)
    with pytest.raises(AssertionError, match="a replay ran the forward on the capture-time dummy batch"):
        kit.test_device_replay_never_runs_the_capture_batch()
    with pytest.raises(AssertionError, match="graph output differs from eager"):
        kit.test_device_prefill_capture_replay_matches_eager()  # what a vendor saw: prefill fails


def test_kit_passes_the_eager_backend_that_replays_the_plans_forward():
    kit = _kit_for("plan_eager", PlanEagerBackend)
    kit.test_device_replay_never_runs_the_capture_batch()
    kit.test_device_prefill_capture_replay_matches_eager()

"""Runners in sequence and side by side on one model, for every backend that runs on the
CPU (graph backends with the breakable plugin's emulated graphs, which really replay what
they recorded; compiled ones with Dynamo compilers that generate no code): another
backend's forward wrapper already on the model (the dispatcher tc_piecewise installs), a
decode and a target-verify runner, a cleanup and a recapture, a second config; every
replay equals eager, and the model's forward is its own once the backends are gone.

Compiled ``full`` records with the core's fake graphs (emulated capture runs under a
torch dispatch mode, in which Dynamo runs no compiled code), so its replays are not
compared with eager here: the sequence must capture, and compile the model's forward as
written (numerics: test_full_compiled_gpu.py).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict

import pytest
import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.backend.model_forward import wrap_model_forward
from cuda_graph_runner.runner import DecodeCudaGraphRunner, capture_gc
from cuda_graph_runner.testing.fakes import CountingCompiler, FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch

breakable = pytest.importorskip("cuda_graph_runner_breakable.backend")
emulation = pytest.importorskip("cuda_graph_runner_breakable.emulation")
compiled = pytest.importorskip("cuda_graph_runner_compiled.backend")
full = pytest.importorskip("cuda_graph_runner_full.backend")
tc_piecewise = pytest.importorskip("cuda_graph_runner_tc_piecewise.backend")


def _graphs(cls: Any, fake: Any = None, **kwargs: Any) -> Callable[[], Any]:
    def make() -> Any:
        dm = (fake or emulation.EmulatedGraphDeviceModule)()
        return cls("cpu", phase="decode", device_module=dm, memory_pool=dm.pool_handle, **kwargs)

    return make


#: Backends whose replays compute nothing on the CPU (the core's recording fake graphs).
UNCHECKED = {"full:compiled"}

BACKENDS: Dict[str, Callable[[], Any]] = {
    "full": _graphs(full.FullCudaGraphBackend),
    "full:compiled": _graphs(full.FullCudaGraphBackend, FakeGraphDeviceModule, compiler=CountingCompiler()),
    "breakable": _graphs(breakable.BreakableCudaGraphBackend),
    "compiled": lambda: compiled.CompiledBackend("cpu", phase="decode", compiler="eager"),
    "tc_piecewise": lambda: tc_piecewise.TcPiecewiseCudaGraphBackend("cpu", phase="decode"),
}


def _runner(model: Any, backend: Any, sizes: list, width: int = 1) -> DecodeCudaGraphRunner:
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"bs": sizes}},
        device="cpu",
        backend=backend,
        show_progress=False,
        mode=mode,
        num_tokens_per_req=width,
    )
    with torch.no_grad():
        runner.capture()
    return runner


class StandIn:
    """Another backend on the model: its forward wrapper, never active here (bound
    methods, kept weakly, as a backend's are)."""

    def forward(self, batch: Any) -> Any:
        raise AssertionError("the stand-in is never active")

    def active(self) -> bool:
        return False


def _check(
    model: Any, runner: DecodeCudaGraphRunner, bs: int, width: int = 1, offset: int = 1, *, compare: bool = True
) -> None:
    batch = decode_batch(bs, width=width, offset=offset)
    assert runner.can_run(batch), (bs, width)
    with torch.no_grad():
        got = runner.forward(batch).clone()
        with forward_context(batch):
            expected = model.compute_logits(type(model).forward(model, batch), batch)
    if compare:
        torch.testing.assert_close(got, expected, msg=lambda m: f"bs {bs}, width {width}: {m}")


@pytest.mark.parametrize("name", list(BACKENDS))
def test_runners_in_sequence_and_side_by_side_on_one_model(name, monkeypatch):
    # Each capture collects twice (freeze_gc): half a second apiece on the test process's
    # heap, and nothing this test checks.
    monkeypatch.setattr(capture_gc.gc, "collect", lambda *args: 0)
    torch._dynamo.reset()
    make = BACKENDS[name]
    check = functools.partial(_check, compare=name not in UNCHECKED)
    model = ToyModel()
    stand_in = StandIn()
    wrapper = wrap_model_forward(model, stand_in.forward, active=stand_in.active)
    decode = _runner(model, make(), [1, 2])
    verify = _runner(model, make(), [2], width=2)
    for pass_ in range(2):  # pass 1 follows a cleanup and recapture of the decode runner
        check(model, decode, 1, offset=pass_ + 1)
        check(model, verify, 2, width=2, offset=pass_ + 3)
        check(model, decode, 2, offset=pass_ + 5)
        decode.cleanup()
        with torch.no_grad():
            decode.capture()
    second = _runner(model, make(), [4])  # another config of the same backend, next to the others
    check(model, second, 3, offset=2)
    check(model, decode, 2, offset=4)
    check(model, verify, 1, width=2, offset=6)
    runners = (decode, verify, second)
    compiled_forwards = [getattr(r.backend, "compiled_forward", None) for r in runners]
    if any(compiled_forwards):
        assert all(c.dynamo_graphs >= 1 for c in compiled_forwards), [c.dynamo_graphs for c in compiled_forwards]
    for runner in runners:
        runner.cleanup()
        getattr(runner.backend, "uninstall", lambda: None)()
    wrapper.remove()
    assert "forward" not in model.__dict__, model.__dict__.get("forward")
    torch._dynamo.reset()

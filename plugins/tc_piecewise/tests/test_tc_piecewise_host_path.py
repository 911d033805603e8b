"""tc_piecewise's per-step host path, checked by counting (no wall clock): a replay calls the
marked ops' bodies without torch's custom-op dispatcher, makes no ``nn.Module.__call__``,
and an op with a kernel of its own keeps the dispatcher (so its kernel still runs).
See ``cuda_graph_runner_tc_piecewise.eager_items``."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cuda_graph_runner.backend import ForwardBatch, eager_op, forward_context
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import decode_batch
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner
from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend
from cuda_graph_runner_tc_piecewise.eager_items import has_default_kernel_only

BODY_CALLS = {"plain": 0, "kernel": 0, "impl": 0}


@eager_op("tc_piecewise_host_path_plain")
def plain_op(output: torch.Tensor, x: torch.Tensor) -> None:
    BODY_CALLS["plain"] += 1
    output.copy_(x * 0.5)


@eager_op("tc_piecewise_host_path_kernel")
def kernel_op(output: torch.Tensor, x: torch.Tensor) -> None:
    BODY_CALLS["kernel"] += 1
    output.copy_(x * 0.5)


@eager_op("tc_piecewise_host_path_impl")
def impl_op(output: torch.Tensor, x: torch.Tensor) -> None:
    BODY_CALLS["impl"] += 1
    output.copy_(x * 0.5)


class _Toy(torch.nn.Module):
    """``layers`` pieces (matmul, tanh), each followed by ``op``; reads the token axis only."""

    def __init__(self, op, layers: int = 3, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.op = op
        self.embed = torch.nn.Parameter(torch.randn(16, hidden, generator=g), requires_grad=False)
        self.ws = torch.nn.ParameterList(
            [
                torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.5, requires_grad=False)
                for _ in range(layers)
            ]
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids]
        for w in self.ws:
            x = torch.tanh(h @ w)
            out = torch.empty_like(x)
            self.op(out, x)
            h = h + out
        return h

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return (hidden @ self.embed.t()).float()


def _runner(model, **backend_kwargs) -> DecodeCudaGraphRunner:
    backend = TcPiecewiseCudaGraphBackend("cpu", phase="decode", **backend_kwargs)
    return DecodeCudaGraphRunner(
        model, {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=backend, show_progress=False
    )


def _eager(model, batch):
    with torch.no_grad(), forward_context(batch):
        return model.compute_logits(model.forward(batch), batch)


class _Dispatched(TorchDispatchMode):
    """Records the name of every op that reaches the dispatcher's Python mode."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_direct_replay_calls_marked_ops_without_the_dispatcher_nor_module_calls(monkeypatch):
    model = _Toy(plain_op)
    runner = _runner(model, device_module=FakeGraphDeviceModule(), enable_capture=True)
    runner.capture()
    assert runner.backend.direct_keys == runner.backend.captured_keys
    batch = decode_batch(1)
    runner.forward(batch)  # first replay of this size: plans built

    module_calls = []
    real_call = torch.nn.Module.__call__

    def counting_call(self, *args, **kwargs):
        module_calls.append(type(self).__name__)
        return real_call(self, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "__call__", counting_call)
    before = BODY_CALLS["plain"]
    mode = _Dispatched()
    with mode:
        runner.forward(batch)
    assert BODY_CALLS["plain"] - before == 3  # each marked op ran once, between the pieces
    # Before: every marked op went through the custom op (autograd, ADInplaceOrView, the
    # device kernel lookup; 25-35 µs per call on a CPU), and the split module and its
    # eager items through nn.Module.__call__ (a lazily compiled GraphModule's stub forward).
    assert not [n for n in mode.names if "tc_piecewise_host_path" in n]
    assert module_calls == []


def test_compiled_replays_equal_eager_with_marked_ops_called_directly():
    model = _Toy(plain_op)
    runner = _runner(model)  # CPU: no capture, the compiled pieces run every call
    runner.capture()
    for bs in (1, 3, 4):
        batch = decode_batch(bs)
        torch.testing.assert_close(runner.forward(batch), _eager(model, batch))


@pytest.mark.parametrize(
    "op,body,register",
    [
        # torch.library.register_kernel: recorded on the custom-op definition.
        (kernel_op, "kernel", torch.library.register_kernel),
        # torch.library.impl: the dispatcher only (the definition never sees it).
        (impl_op, "impl", torch.library.impl),
    ],
    ids=["register_kernel", "impl"],
)
def test_an_op_with_a_kernel_of_its_own_keeps_the_dispatcher(op, body, register):
    assert has_default_kernel_only(plain_op)
    assert has_default_kernel_only(op)

    def cpu_kernel(output: torch.Tensor, x: torch.Tensor) -> None:
        output.copy_(x * 3.0)  # differs from the body: a replay skipping it would be wrong

    register(op.qualname, "cpu", cpu_kernel)
    assert not has_default_kernel_only(op)
    model = _Toy(op)
    runner = _runner(model)
    runner.capture()
    before = BODY_CALLS[body]
    for bs in (1, 3):
        batch = decode_batch(bs)
        torch.testing.assert_close(runner.forward(batch), _eager(model, batch))
    assert BODY_CALLS[body] == before  # the registered kernel ran, never the body


class _OlderOpDef:
    """A custom-op definition as an older torch (2.11) keeps it: autocast per device type."""

    def __init__(self) -> None:
        self._backend_fns = {None: lambda *a: None}
        self._torch_dispatch_fns: dict = {}
        self._backward_fn = None
        self._setup_context_fn = None
        self._vmap_fn = None
        self._autocast_cuda_dtype = None
        self._autocast_cpu_dtype = None
        self._disabled_kernel: set = set()


def test_the_kernel_check_reads_an_older_torchs_definition(monkeypatch):
    from torch._library import custom_ops

    opdef = _OlderOpDef()
    monkeypatch.setitem(custom_ops.OPDEFS, plain_op.qualname, opdef)
    assert has_default_kernel_only(plain_op)  # missing newer attributes: nothing registered there
    opdef._autocast_cuda_dtype = torch.float16
    assert not has_default_kernel_only(plain_op)
    opdef._autocast_cuda_dtype = None
    opdef._backend_fns["cuda"] = lambda *a: None
    assert not has_default_kernel_only(plain_op)
    monkeypatch.delitem(custom_ops.OPDEFS, plain_op.qualname)
    assert not has_default_kernel_only(plain_op)  # no definition found: keep the dispatcher

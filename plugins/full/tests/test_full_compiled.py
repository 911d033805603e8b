"""Compiled full on the CPU, with the recording fake graph API and a counting compiler
(no code generation): the compile pass makes one Dynamo graph for every size >= 2 and one
for size 1, capture and replay make none, the compiled forward stands in for
``model.forward`` only while ``full`` runs it. Numerics are the GPU tests'
(test_full_compiled_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.forward_context import forward_context
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner_full.backend import FullCudaGraphBackend
from cuda_graph_runner_full.compiled import CompiledForward


class CountingCompiler:
    def __init__(self) -> None:
        self.graphs = 0
        self.calls = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1

        def run(*args):
            self.calls += 1
            return gm.forward(*args)

        return run


@pytest.fixture()
def setup():
    torch._dynamo.reset()
    model = ToyModel()
    compiler = CountingCompiler()
    fake = FakeGraphDeviceModule()
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=fake, memory_pool="pool", compiler=compiler)
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": [1, 2, 4, 8]}}, device="cpu", backend=backend)
    runner.show_progress = False
    yield model, runner, compiler, fake
    torch._dynamo.reset()


def test_compile_pass_makes_two_graphs_and_capture_makes_none(setup):
    model, runner, compiler, fake = setup
    with torch.no_grad():
        runner.capture()
    assert compiler.graphs == 2 == runner.backend.compiled_forward.dynamo_graphs
    assert runner.backend.compile_seconds > 0
    assert runner.backend.captured_keys == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
    # Compile pass (4 sizes) + the first size's warm-ups + one recorded run per size ran
    # compiled code: the graphs recorded the compiled forward, not the model's own.
    assert compiler.calls >= 4 + 4
    begins = [e for e in fake.events if e[0] == "capture_begin"]
    assert len(begins) == 4
    assert "forward" not in model.__dict__  # the model as written outside the backend's calls


def test_verify_reference_runs_the_compiled_forward(setup):
    model, runner, compiler, _ = setup
    with torch.no_grad():
        runner.capture()
        batch = decode_batch(3)
        calls = compiler.calls
        for _ in range(2):
            with forward_context(batch):
                runner.backend.verify_reference(
                    lambda: model.compute_logits(model.forward(batch), batch), ShapeKey(4, "decode"), batch
                )
    # The live batch is a plain ForwardBatch (capture used the runner's static batches):
    # Dynamo's type guard makes one more graph, once, in verify mode only.
    assert compiler.calls == calls + 2 and compiler.graphs == 3


def test_eager_compiler_compiles_nothing_and_unknown_values_are_refused():
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=FakeGraphDeviceModule())
    assert backend.compiler == "eager" and backend.compiled_forward is None and backend.compile_seconds is None
    with pytest.raises(ValueError, match=r"tc_compiler 'tvm' does not compile; compiling values: \('inductor',\)"):
        CompiledForward("tvm")

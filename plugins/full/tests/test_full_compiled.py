"""Compiled full on the CPU, with the recording fake graph API and a counting compiler
(no code generation): the compile pass makes one Dynamo graph for every size >= 2 and one
for size 1, capture and replay make none, the compiled forward stands in for
``model.forward`` only while ``full`` runs it. Numerics are the GPU tests'
(test_full_compiled_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey, forward_context
from cuda_graph_runner.testing.fakes import CountingCompiler, FakeGraphDeviceModule
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner
from cuda_graph_runner_full.backend import FullCudaGraphBackend
from cuda_graph_runner_full.compiled import CompiledForward


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
    with pytest.raises(ValueError, match=r"torch_compile 'tvm' does not compile; compiling values: \('inductor',\)"):
        CompiledForward("tvm")


class ShapeRecordingCompiler(CountingCompiler):
    """Also records, per Dynamo graph, whether it has a symbolic size input (dynamic
    shapes) and the rows of the 1-d tensors each call got."""

    def __init__(self) -> None:
        super().__init__()
        self.symbolic: list = []
        self.rows: list = []

    def __call__(self, gm, example_inputs):
        index = len(self.symbolic)
        placeholders = [n.meta.get("example_value") for n in gm.graph.nodes if n.op == "placeholder"]
        self.symbolic.append(any(isinstance(v, torch.SymInt) for v in placeholders))
        self.rows.append(set())
        inner = super().__call__(gm, example_inputs)

        def run(*args):
            self.rows[index].update(a.shape[0] for a in args if isinstance(a, torch.Tensor) and a.dim() == 1)
            return inner(*args)

        return run


def _static_runner(compile_sizes, bs=(1, 2, 4, 8)):
    torch._dynamo.reset()
    model = ToyModel()
    compiler = ShapeRecordingCompiler()
    backend = FullCudaGraphBackend(
        "cpu",
        phase="decode",
        device_module=FakeGraphDeviceModule(),
        memory_pool="pool",
        compiler=compiler,
        compile_sizes=compile_sizes,
    )
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": list(bs)}}, device="cpu", backend=backend)
    runner.show_progress = False
    return model, runner, compiler


def test_compile_sizes_get_static_graphs_of_their_own_and_capture_recompiles_nothing():
    model, runner, compiler = _static_runner([8, 2])
    try:
        with torch.no_grad():
            runner.capture()
        compiled = runner.backend.compiled_forward
        assert compiled.static_sizes == (2, 8)
        # Compile pass, largest first: static 8, dynamic (first at 4), static 2, size 1.
        assert compiler.graphs == 4 == compiled.dynamo_graphs
        assert compiler.symbolic == [False, True, False, False]
        # Each static graph ran only at its size (compile pass, warm-ups, recording); the
        # dynamic one served 4 only.
        assert [rows for rows, symbolic in zip(compiler.rows, compiler.symbolic) if not symbolic][:2] == [{8}, {2}]
        assert compiler.rows[1] == {4}
        # Verify's reference runs the live batch (5 rows for the captured 8) through the
        # dynamic graph: the static one of 8 would recompile for each live size.
        with torch.no_grad(), forward_context(batch := decode_batch(5)):
            runner.backend.verify_reference(
                lambda: model.compute_logits(model.forward(batch), batch), ShapeKey(8, "decode"), batch
            )
        assert compiler.rows[0] == {8} and compiler.rows[2] == {2}
        assert all(compiler.symbolic[4:]) and any(5 in rows for rows in compiler.rows[1:2] + compiler.rows[4:])
    finally:
        torch._dynamo.reset()


def test_compile_sizes_without_a_dynamic_size_compile_no_dynamic_graph():
    _, runner, compiler = _static_runner([1, 4], bs=(1, 4))
    try:
        with torch.no_grad():
            runner.capture()
        assert compiler.graphs == 2 and compiler.symbolic == [False, False]
    finally:
        torch._dynamo.reset()


def test_a_compile_size_that_is_not_captured_is_refused_before_compiling():
    from cuda_graph_runner.backend import CudaGraphConfigError

    _, runner, compiler = _static_runner([3, 4])
    try:
        with pytest.raises(CudaGraphConfigError) as info, torch.no_grad():
            runner.capture()
        message = str(info.value)
        assert "compile_sizes=[3, 4]" in message and "[3] not captured" in message, message
        assert "captured sizes [1, 2, 4, 8]" in message, message
        assert compiler.graphs == 0
    finally:
        torch._dynamo.reset()


def test_compile_sizes_with_the_eager_compiler_are_an_error_naming_the_key():
    from cuda_graph_runner.testing.workload import CudaGraphConfig, CudaGraphConfigError

    config = CudaGraphConfig.from_dict({"decode": {"compile_sizes": [4, 1]}})
    assert config.decode.compile_sizes == [1, 4]
    with pytest.raises(
        CudaGraphConfigError, match=r"decode.compile_sizes=\[1, 4\].*needs a compiler.*torch_compile on"
    ):
        FullCudaGraphBackend("cpu", phase="decode", device_module=FakeGraphDeviceModule(), phase_config=config.decode)
    with pytest.raises(ValueError, match="compile size 0 is not a positive int"):
        CompiledForward(CountingCompiler(), static_sizes=[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_full_is_held_to_inductors_tolerance_the_eager_forward_to_the_base(dtype):
    """The bench compares compiled full with eager by ``verify_tolerance``: with the base's
    near-exact bound, ``bench --decode-backends full:inductor`` on llama-3.2-1b in bfloat16
    failed on the H200 (0.121 / 0.133 from eager: an ulp of inductor's float32 intermediates)."""
    from cuda_graph_runner.backend import compiled_verify_tolerance, default_verify_tolerance

    plain = FullCudaGraphBackend("cpu", phase="decode", device_module=FakeGraphDeviceModule())
    compiled = FullCudaGraphBackend(
        "cpu", phase="decode", device_module=FakeGraphDeviceModule(), compiler=CountingCompiler()
    )
    assert plain.verify_tolerance(dtype) == default_verify_tolerance(dtype)
    assert compiled.verify_tolerance(dtype) == compiled_verify_tolerance(dtype)
    atol, rtol = compiled.verify_tolerance(dtype)
    base_atol, base_rtol = default_verify_tolerance(dtype)
    assert (atol, rtol) == pytest.approx((base_atol * 10, base_rtol * 10))
    if dtype == torch.bfloat16:
        assert atol > 0.133  # the H200's measured difference passes even on a logit near zero


def test_sizes_above_torch_compile_max_bs_are_captured_uncompiled():
    """sglang's ``--torch-compile-max-bs``: batch sizes up to it run the compiled forward,
    larger ones the forward as written (and the compile pass skips them)."""
    from cuda_graph_runner.testing.workload import CudaGraphConfig

    torch._dynamo.reset()
    model, compiler, fake = ToyModel(), CountingCompiler(), FakeGraphDeviceModule()
    config = CudaGraphConfig.from_dict(
        {"decode": {"torch_compile": True, "torch_compile_max_bs": 2, "bs": [1, 2, 4, 8]}}
    )
    backend = FullCudaGraphBackend(
        "cpu", phase="decode", device_module=fake, memory_pool="pool", compiler=compiler, phase_config=config.decode
    )
    runner = DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    try:
        with torch.no_grad():
            runner.capture()
        compiled = backend.compiled_forward
        assert compiled is not None and compiled.max_size == 2
        assert [size for size in (1, 2, 4, 8) if compiled.compiles(size)] == [1, 2]
        assert backend.captured_keys == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
        with backend._compiled_active(ShapeKey(8, "decode")):
            assert "forward" not in model.__dict__  # the model as written
        with backend._compiled_active(ShapeKey(2, "decode")):
            assert "forward" in model.__dict__  # the compiled forward stands in
        assert compiler.graphs == 2  # sizes 2 (dynamic) and 1: nothing for 4 and 8
    finally:
        torch._dynamo.reset()


def test_torch_compile_default_max_is_sglangs_32():
    from cuda_graph_runner.testing.workload import PhaseConfig

    backend = FullCudaGraphBackend(
        "cpu", phase="decode", device_module=FakeGraphDeviceModule(), phase_config=PhaseConfig(torch_compile=True)
    )
    assert backend.compiler == "inductor" and backend.compiled_forward.max_size == 32

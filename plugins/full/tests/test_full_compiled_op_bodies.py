"""Compiled full on the CPU (recording fake graphs, a counting compiler that runs the
traced graphs as they are): at each compile size the marked ops' bodies (the reference
model's attention) are compiled too, counted apart from the forward's graphs, compiled
once by the compile pass and never again while capturing or on a new batch of the size,
and compute what the op's own body computes; other sizes run the bodies as written; a
static forward that breaks into several graphs is refused. Numerics with inductor are the
GPU tests' (test_full_compiled_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import (
    CudaGraphHostValueError,
    ShapeKey,
    compile_cache_scope,
    compile_key,
    eager_op,
    forward_context,
    get_forward_batch,
)
from cuda_graph_runner.testing.fakes import CountingCompiler, FakeGraphDeviceModule
from cuda_graph_runner.testing.reference_setup import reference_model
from cuda_graph_runner.testing.toy_model import ToyModel
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    make_decode_batch,
    make_dummy_prompts,
)
from cuda_graph_runner_full.backend import FullCudaGraphBackend


def _runner(model, compile_sizes, bs):
    backend = FullCudaGraphBackend(
        "cpu",
        phase="decode",
        device_module=FakeGraphDeviceModule(),
        memory_pool="pool",
        compiler=CountingCompiler(),
        compile_sizes=compile_sizes,
    )
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": list(bs)}}, device="cpu", backend=backend)
    runner.show_progress = False
    return runner


@pytest.fixture()
def reference():
    torch._dynamo.reset()
    yield reference_model("tiny", requests=16, dtype=torch.float32, device="cpu")
    torch._dynamo.reset()


def _live_batch(model, bs, seed):
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(bs, [3 + i % 4 for i in range(bs)], model.config.vocab_size, seed=seed))
    return session, make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])


def test_compile_sizes_compile_the_marked_op_bodies_once_and_they_compute_the_op_s_result(reference):
    model = reference
    runner = _runner(model, [2, 4], (1, 2, 4))
    plans, after_prepare = [], []
    prepare = runner.backend.prepare

    def spy(plan):
        plans.append(plan)
        prepare(plan)
        after_prepare.append(runner.backend.compiled_forward.op_body_graphs)

    runner.backend.prepare = spy
    with torch.no_grad():
        runner.capture()
        compiled = runner.backend.compiled_forward
        assert compiled.dynamo_graphs == 3  # static 4, static 2, size 1: op bodies are counted apart
        # The body graph-breaks where it reads the forward context; its pieces compile per
        # size, the same number for each size; the capture compiled none.
        body_graphs = compiled.op_body_graphs
        by_size = compiled.op_body_graphs_by_size
        assert sorted(by_size) == [2, 4] and by_size[2] == by_size[4] >= 2, by_size
        assert after_prepare == [body_graphs]
        compiler = runner.backend.compiled_forward.compiler
        for bs in (4, 2, 1):
            # A live batch's values in the size's static batch, as a replay fills it.
            session, live = _live_batch(model, bs, seed=bs)
            batch = plans[0].static_batch(ShapeKey(bs, "decode"))
            for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
                getattr(batch, name).copy_(getattr(live, name))
            with forward_context(batch):
                expected = model.forward(batch).clone()
            calls = compiler.calls
            with compiled.active(bs), forward_context(batch):
                got = model.forward(batch)
            # The forward's graph, plus the bodies' graphs at a compile size (2 layers).
            assert (compiler.calls - calls > 1 + 1) == (bs in (2, 4)), (bs, compiler.calls - calls)
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=f"bs {bs}")
            session.close()
        # A new forward of a compile size (a new scratch, new values) and size 1 (no
        # compiled bodies) compiled nothing more.
        assert compiled.op_body_graphs == body_graphs
        assert compiled.dynamo_graphs == 3


def test_without_compile_sizes_no_op_body_is_compiled(reference):
    runner = _runner(reference, None, (1, 2, 4))
    with torch.no_grad():
        runner.capture()
    assert runner.backend.compiled_forward.op_body_graphs == 0


class _BreakingModel(ToyModel):
    def __init__(self, where: str) -> None:
        super().__init__()
        self.where = where

    def forward(self, batch):
        if self.where == "start":
            torch._dynamo.graph_break()  # the piece before it is empty: no graph of its own
        batch.input_ids.add_(0)
        if self.where == "middle":
            torch._dynamo.graph_break()
        return super().forward(batch)


def test_a_static_forward_that_breaks_into_several_graphs_is_refused():
    torch._dynamo.reset()
    try:
        runner = _runner(_BreakingModel("middle"), [2], (2,))
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"compile size 2 broke into 2 graphs"):
            runner.capture()
    finally:
        torch._dynamo.reset()


def test_a_break_with_nothing_before_it_leaves_one_graph_and_is_accepted():
    # The piece before it is empty: one graph, no Python runs between graphs.
    torch._dynamo.reset()
    try:
        runner = _runner(_BreakingModel("start"), [2], (2,))
        with torch.no_grad():
            runner.capture()
        assert runner.backend.compiled_forward.dynamo_graphs == 1
    finally:
        torch._dynamo.reset()


@eager_op("op_bodies_test_host_reader", capture_safe=("decode",))
def _host_reader(output: torch.Tensor, x: torch.Tensor) -> None:
    # Breaks the capture promise: a host field of the batch.
    output.copy_(x + len(get_forward_batch().seq_lens_cpu))


def _model_calling(op):
    """A ToyModel whose forward ends in ``op(out, hidden)``."""

    class Model(ToyModel):
        def forward(self, batch):
            h = super().forward(batch)
            out = torch.empty_like(h)
            op(out, h)
            return out

    return Model


_HostReadingModel = _model_calling(_host_reader)


def test_with_the_guard_turned_off_a_body_s_host_read_is_left_free():
    # host_value_guard: false in the config: the capture leaves host reads free, so the
    # compiled bodies must not arm the guard on their own.
    torch._dynamo.reset()
    try:
        backend = _runner(_HostReadingModel(), [2], (2,)).backend
        runner = DecodeCudaGraphRunner(
            _HostReadingModel(), {"decode": {"bs": [2], "host_value_guard": False}}, device="cpu", backend=backend
        )
        runner.show_progress = False
        with torch.no_grad():
            runner.capture()
        assert backend.compiled_forward.op_body_graphs >= 1
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("compile_sizes", [None, [2]])
def test_a_body_reading_a_host_value_is_refused_at_compile_sizes_too(compile_sizes):
    # The guard's checks are folded in when Dynamo traces a body: traced unguarded in the
    # compile pass, the body froze seq_lens_cpu into the graph silently.
    torch._dynamo.reset()
    try:
        runner = _runner(_HostReadingModel(), compile_sizes, (2,))
        with torch.no_grad(), pytest.raises(Exception) as caught:
            runner.capture()
        chain, exc = [], caught.value
        while exc is not None:
            chain.append(exc)
            exc = exc.__cause__ or exc.__context__
        assert any(isinstance(e, CudaGraphHostValueError) for e in chain), repr(caught.value)
        assert "seq_lens_cpu" in str(caught.value)
    finally:
        torch._dynamo.reset()


def test_every_compile_size_compiles_its_bodies_whole_past_dynamo_s_recompile_limit(reference):
    # The bodies' inner frames are shared by all sizes (a few cache entries each): with
    # Dynamo's default limit of 8 the later sizes ran part of the body as written. And
    # more than 8 sizes: each static forward keeps a code object (and a limit) of its own.
    sizes = list(range(2, 12))
    runner = _runner(reference, sizes, sizes)
    with torch.no_grad():
        runner.capture()
    by_size = runner.backend.compiled_forward.op_body_graphs_by_size
    assert sorted(by_size) == sizes and len(set(by_size.values())) == 1 and by_size[2] >= 2, by_size


def test_op_bodies_compile_inside_the_dynamo_package_cache_scope(reference, tmp_path, monkeypatch):
    # torch cannot file a marked op's body under its module name (the name is the
    # EagerOp): recording it into Dynamo's package raised PackageError at the compile pass.
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))
    runner = _runner(reference, [2], (2,))
    with torch.no_grad(), compile_cache_scope(compile_key(reference, "full", "op-bodies-test")):
        runner.capture()
    assert runner.backend.compiled_forward.op_body_graphs >= 2


@pytest.mark.parametrize("policy", ["first_size", "auto"])
def test_a_compile_size_warms_up_before_its_recording_under_every_policy(policy):
    # A guard its bodies did not meet in the compile pass then recompiles in the warm-up,
    # not inside the stream capture (seen on the H200 under the auto policy).
    backend = _runner(ToyModel(), [2], (1, 2, 4)).backend
    backend.new_capture_session(policy)
    for size in (4, 2, 1):
        backend.note_kernels_ran(ShapeKey(size, "decode"))  # what the compile pass records
    runs = [backend.warmup_runs(ShapeKey(size, "decode")) for size in (4, 2, 1)]
    assert runs[0] == backend.num_warmups and runs[1] == 1 and runs[2] == 0, runs


@eager_op("op_bodies_test_opted_out", capture_safe=("decode",))
@torch.compiler.disable
def _opted_out(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(x * 2)


_OptedOutModel = _model_calling(_opted_out)


def test_a_body_under_torch_compiler_disable_is_not_compiled():
    torch._dynamo.reset()
    try:
        model = _OptedOutModel()
        runner = _runner(model, [2], (2,))
        with torch.no_grad():
            runner.capture()
        compiled = runner.backend.compiled_forward
        assert compiled.op_body_graphs == 0 and compiled.dynamo_graphs == 1
    finally:
        torch._dynamo.reset()

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

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.compile_cache import compile_cache_scope, compile_key
from cuda_graph_runner.forward_context import forward_context
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.batches import GreedySession, make_decode_batch, make_dummy_prompts
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.reference_setup import reference_model
from cuda_graph_runner.testing.toy_model import ToyModel
from cuda_graph_runner_full.backend import FullCudaGraphBackend


class CountingCompiler:
    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        self.graphs += 1
        return gm.forward


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
    plans = []
    prepare = runner.backend.prepare
    runner.backend.prepare = lambda plan: (plans.append(plan), prepare(plan))[1]
    with torch.no_grad():
        runner.capture()
        compiled = runner.backend.compiled_forward
        assert compiled.dynamo_graphs == 3  # static 4, static 2, size 1: op bodies are counted apart
        # Per size: the first layer's call (metadata, up to the data_ptr break), the rest
        # of its body, the last layer's (it releases the metadata).
        body_graphs = compiled.op_body_graphs
        assert body_graphs >= 2 * 2, body_graphs
        for bs in (4, 2, 1):
            # A live batch's values in the size's static batch, as a replay fills it.
            session, live = _live_batch(model, bs, seed=bs)
            batch = plans[0].static_batch(ShapeKey(bs, "decode"))
            for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
                getattr(batch, name).copy_(getattr(live, name))
            with forward_context(batch):
                expected = model.forward(batch).clone()
            with compiled.active(bs), forward_context(batch):
                got = model.forward(batch)
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
    def forward(self, batch):
        batch.input_ids.add_(0)
        torch._dynamo.graph_break()
        return super().forward(batch)


def test_a_static_forward_that_breaks_into_several_graphs_is_refused():
    torch._dynamo.reset()
    try:
        runner = _runner(_BreakingModel(), [2], (2,))
        with torch.no_grad(), pytest.raises(RuntimeError, match=r"compile size 2 broke into \d graphs"):
            runner.capture()
    finally:
        torch._dynamo.reset()


def test_op_bodies_compile_inside_the_dynamo_package_cache_scope(reference, tmp_path, monkeypatch):
    # torch cannot file a marked op's body under its module name (the name is the
    # EagerOp): recording it into Dynamo's package raised PackageError at the compile pass.
    monkeypatch.setenv("CUDA_GRAPH_RUNNER_CACHE_DIR", str(tmp_path))
    runner = _runner(reference, [2], (2,))
    with torch.no_grad(), compile_cache_scope(compile_key(reference, "full", "op-bodies-test")):
        runner.capture()
    assert runner.backend.compiled_forward.op_body_graphs >= 2

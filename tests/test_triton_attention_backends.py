"""The ``triton`` attention under torch.compile, on the CPU: the kernels stood in by their
pure-torch model (:mod:`cuda_graph_runner.reference.model.paged_attention_model`), so the
backend's own code runs as on a device.

* Dynamo records each layer's attention as one opaque marked-op call and never runs the
  kernel launchers while it traces (the launchers are custom ops with fake
  implementations; the marked op's body is not compiled);
* the launcher ops' fake implementations leave the output's shape and dtype, and
  ``torch.library.opcheck`` accepts their schemas (mutation of ``output`` only);
* compiled full with compile sizes (a counting compiler, recording fake graphs):
  no marked-op body is compiled, and the compiled forward equals eager at the compile
  sizes and at a dynamic size.

Inductor on a device: tests/test_triton_attention_gpu.py.
"""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts
from cuda_graph_runner.reference.model import paged_attention_model as pam
from cuda_graph_runner.reference.model import triton_attention
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import CountingCompiler, FakeGraphDeviceModule
from cuda_graph_runner.testing.reference_setup import reference_model
from cuda_graph_runner_full.backend import FullCudaGraphBackend

OP = "cuda_graph_runner.triton_paged_attention"


@pytest.fixture()
def kernels(monkeypatch):
    stand_in = pam.TorchKernels()
    monkeypatch.setattr(triton_attention, "_kernels", lambda: stand_in)
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setattr(triton_attention, "interpreting", lambda: True)  # CPU tensors accepted
    torch._dynamo.reset()
    yield stand_in
    torch._dynamo.reset()


def _models():
    triton = reference_model("tiny", requests=8, attention="triton", device="cpu")
    torch_ = reference_model("tiny", requests=8, attention="torch", device="cpu")
    return triton, torch_


def _decode(model, bs, seed):
    session = GreedySession(model, model.kv_cache)
    session.prefill(make_dummy_prompts(bs, [3 + (5 * i) % 7 for i in range(bs)], model.config.vocab_size, seed=seed))
    return session, make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])


def test_dynamo_records_the_attention_as_one_opaque_call_and_never_traces_the_kernels(kernels):
    model, reference = _models()
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    with torch.no_grad():
        got_eager = {}
        for m in (model, reference):  # the stand-in computes the torch attention's result
            session, batch = _decode(m, 3, seed=1)
            with forward_context(batch):
                got_eager[m.attn_backend.name] = m.forward(batch).clone()
            session.close()
        torch.testing.assert_close(got_eager["triton"], got_eager["torch"], atol=1e-4, rtol=1e-4)
        assert kernels.calls > 0 and kernels.traced_calls == 0

        session, batch = _decode(model, 3, seed=1)
        compiled = torch.compile(model.forward, backend=recording, fullgraph=True)
        with forward_context(batch):
            got = compiled(batch)
        session.close()
    assert len(graphs) == 1
    targets = [str(n.target) for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert targets.count(OP) == model.config.num_hidden_layers, targets
    assert not any("triton_decode_attention" in t or "triton_extend_attention" in t for t in targets)
    assert kernels.traced_calls == 0  # Dynamo ran the op's fake, not the kernels
    torch.testing.assert_close(got, got_eager["triton"], atol=1e-5, rtol=1e-5)


def _decode_args(dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(40, 2, 16, generator=gen).to(dtype) for _ in range(2))
    r2t = torch.arange(1, 37, dtype=torch.int64).view(3, 12)
    q = torch.randn(2 * 3, 4 * 16, generator=gen).to(dtype)  # 2 requests of width 3
    out = torch.empty_like(q)
    rows = torch.tensor([2, 0], dtype=torch.int64)
    lens = torch.tensor([9, 3], dtype=torch.int32)
    return (out, q, k, v, r2t, rows, lens, 3, 2, 0.25, 0, False, 64)


def _extend_args():
    gen = torch.Generator().manual_seed(1)
    k, v = (torch.randn(40, 2, 16, generator=gen) for _ in range(2))
    r2t = torch.arange(1, 37, dtype=torch.int64).view(3, 12)
    q = torch.randn(7, 4 * 16, generator=gen)
    out = torch.zeros_like(q)
    tiles = pam.TorchKernels.extend_tile_tensor(pam.extend_tiles([4, 3], [2, 0], 16), q.device)
    return (out, q, k, v, r2t, torch.tensor([1, 2]), tiles, 2, 0.25, 0, 16, 16)


@pytest.mark.parametrize("which", ["decode", "extend"])
def test_the_kernel_ops_fake_keeps_the_output_and_opcheck_accepts_them(kernels, which):
    op = triton_attention.decode_attention_op if which == "decode" else triton_attention.extend_attention_op
    args = _decode_args() if which == "decode" else _extend_args()
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
        op(*fake)
        assert fake[0].shape == args[0].shape and fake[0].dtype == args[0].dtype
    assert kernels.calls == 0 and kernels.traced_calls == 0  # the fake ran no kernel
    torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    args[0].zero_()
    op(*args)
    assert kernels.calls > 0 and args[0].abs().sum() > 0  # the real op wrote the output


def test_compiled_full_with_compile_sizes_compiles_no_kernel_and_equals_eager(kernels):
    model = reference_model("tiny", requests=8, attention="triton", device="cpu")
    backend = FullCudaGraphBackend(
        "cpu",
        phase="decode",
        device_module=FakeGraphDeviceModule(),
        memory_pool="pool",
        compiler=CountingCompiler(),
        compile_sizes=[2],
    )
    runner = DecodeCudaGraphRunner(model, {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=backend)
    runner.show_progress = False
    plans = []
    prepare = backend.prepare
    backend.prepare = lambda plan: (plans.append(plan), prepare(plan))[1]
    with torch.no_grad():
        runner.capture()
        compiled = backend.compiled_forward
        # static 2, the dynamic graph (4) and size 1; the attention's body compiled nowhere
        assert compiled.dynamo_graphs == 3 and compiled.op_body_graphs == 0, (
            compiled.dynamo_graphs,
            compiled.op_body_graphs,
        )
        assert kernels.traced_calls == 0
        for bs, key in ((2, 2), (3, 4), (1, 1)):  # captured sizes, and padded ones
            session, live = _decode(model, bs, seed=bs)
            with forward_context(live):
                expected = model.forward(live).clone()
            batch = plans[0].static_batch(ShapeKey(key, "decode"))
            # A live batch's values in the size's static batch, as a replay fills it (row 0 pads).
            for name in ("input_ids", "positions", "out_cache_loc", "req_pool_indices", "seq_lens"):
                dst, src = getattr(batch, name), getattr(live, name)
                dst.fill_(1 if name == "seq_lens" else 0)
                dst[: src.shape[0]].copy_(src)
            with compiled.active(key), forward_context(batch):
                got = model.forward(batch)
            torch.testing.assert_close(got[:bs], expected, rtol=1e-5, atol=1e-5, msg=f"bs {bs} as {key}")
            session.close()
        assert kernels.traced_calls == 0
    assert backend.compiled_forward.op_body_graphs == 0
    assert model.attn_backend.padded_batch_size(ForwardMode.DECODE, 1, 3) == 4  # what the eager 3 used


def test_breakable_prefill_with_triton_breaks_at_each_extend_and_replays_eager(kernels):
    # The extend kernel's tile table follows the request lengths: not capture-safe, so
    # breakable runs it eagerly between segments (decode records it inside its segment).
    from cuda_graph_runner.reference.batches import make_extend_batch
    from cuda_graph_runner.runner import PrefillCudaGraphRunner
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
    from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

    model = reference_model("tiny", requests=12, attention="triton", device="cpu")
    backend = BreakableCudaGraphBackend("cpu", phase="prefill", device_module=EmulatedGraphDeviceModule())
    runner = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": [32]}}, device="cpu", backend=backend, show_progress=False
    )
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        runner.capture()
        for key in backend.captured_keys:
            graph = backend.graph(key)
            assert graph.op_names == ["triton_paged_attention"] * layers and graph.inlined == [], key
        for step, lens in enumerate(([23], [9, 1, 4, 7])):  # 1 and 4 requests, padded to 32 tokens
            prompts = make_dummy_prompts(len(lens), lens, model.config.vocab_size, seed=step)
            batch = make_extend_batch(model.kv_cache, prompts)
            assert runner.can_run(batch)
            expected = runner.eager_forward(batch).clone()
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"{lens}: {m}")
    runner.cleanup()


def test_a_trace_of_the_op_s_body_records_the_kernel_op_and_not_the_kernels(kernels):
    # What a compiler that ignored the body's opt-out would see: the kernel launch as one
    # opaque custom op (its fake while tracing, the launch when the graph runs).
    backend = triton_attention.TritonAttention()
    body = triton_attention.triton_paged_attention.fn.__wrapped__  # under torch.compiler.disable
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    _, _, k, v, r2t, rows, lens, *_ = _decode_args()
    z = torch.zeros(2, dtype=torch.int64)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, input_ids=z, positions=z, out_cache_loc=z,
        req_pool_indices=rows, seq_lens=lens, seq_lens_cpu=lens.tolist(),
    )  # fmt: skip
    q = torch.randn(2, 4 * 16, generator=torch.Generator().manual_seed(3))
    expected, got = torch.empty_like(q), torch.empty_like(q)
    with torch.no_grad(), forward_context(batch):
        body(expected, q, k, v, r2t, 0.25, 0, False, backend.id)
        calls = kernels.calls
        torch.compile(body, backend=recording)(got, q, k, v, r2t, 0.25, 0, False, backend.id)
    targets = [str(n.target) for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert "cuda_graph_runner.triton_decode_attention.default" in targets, targets
    assert kernels.traced_calls == 0 and kernels.calls == calls + 1
    torch.testing.assert_close(got, expected)

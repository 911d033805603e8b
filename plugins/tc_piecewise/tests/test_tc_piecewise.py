"""Backend ``tc_piecewise`` on the CPU: the split, the compiled model against eager, Dynamo
recompilations, the per-piece capture protocol (with the recording fake graph API), errors.

On the CPU the backend does not capture by default (``enable_capture=False``): every
replay runs the compiled pieces, so outputs can be compared with eager through the real
runners. Capture itself is exercised with :class:`FakeGraphDeviceModule`, whose graphs
record calls but compute nothing.
"""

from __future__ import annotations

import shutil
from typing import List, Sequence

import pytest
import torch
from tc_emulated_graphs import EmulatedGraphs, recording_compiler
from torch._dynamo.utils import counters

from cuda_graph_runner.backend import (
    ForwardBatch,
    ForwardMode,
    ShapeKey,
    eager_op,
    envs,
    forward_context,
    forward_wrappers,
    get_forward_batch,
    is_eager_op_target,
    weak_ref_tensor,
)
from cuda_graph_runner.backend.capture_plan import build_capture_plan
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.reference_setup import prefilled_decode_batch, reference_model, staggered_lengths
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.workload import (
    PRESETS,
    DecodeCudaGraphRunner,
    ModelConfig,
    PrefillCudaGraphRunner,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    greedy_generate,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner_tc_piecewise import compiler as tc_compiler
from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend
from cuda_graph_runner_tc_piecewise.errors import TcPiecewiseCompileError, TcPiecewiseRuntimeError
from cuda_graph_runner_tc_piecewise.split import split_graph

VOCAB = 16


# ----------------------------------------------------------------------------- a toy with marked ops
@eager_op("tc_piecewise_test_mix")
def mix_op(output: torch.Tensor, x: torch.Tensor) -> None:
    """Row-order dependent (cumulative): padded rows come last, so real rows are unaffected."""
    output.copy_(torch.cumsum(x, dim=0) * 0.1)


@eager_op("tc_piecewise_test_scale_rows")
def scale_rows_op(output: torch.Tensor, x: torch.Tensor) -> None:
    """Scales each real token by its request's live host-side length (like attention reads
    live metadata); padded tail tokens pass through."""
    batch = get_forward_batch()
    output.copy_(x)
    if batch.forward_mode.is_decode_like():
        per_req = [batch.num_tokens_per_req] * len(batch.seq_lens_cpu)
    else:
        per_req = batch.extend_seq_lens_cpu
    start = 0
    for n, length in zip(per_req, batch.seq_lens_cpu):
        output[start : start + n] = x[start : start + n] * (1.0 + 0.01 * length)
        start += n


class MarkedToy(torch.nn.Module):
    """``layers`` pieces of matmul + tanh, each followed by a marked op (mix, scale, mix, ...),
    then a last piece. Reads only the token axis of the batch in ``forward``."""

    def __init__(self, layers: int = 3, hidden: int = 8) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, hidden, generator=g), requires_grad=False)
        self.weights = torch.nn.ParameterList(
            [
                torch.nn.Parameter(torch.randn(hidden, hidden, generator=g) * 0.5, requires_grad=False)
                for _ in range(layers)
            ]
        )
        self.head = torch.nn.Parameter(torch.randn(hidden, VOCAB, generator=g), requires_grad=False)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids] + batch.positions[:, None].float() * 0.01
        for i, w in enumerate(self.weights):
            x = torch.tanh(h @ w)
            out = torch.empty_like(x)
            (mix_op if i % 2 == 0 else scale_rows_op)(out, x)
            h = h + torch.sin(out)
        return h * 2.0

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.EXTEND:
            hidden = hidden[torch.cumsum(batch.extend_seq_lens.long(), 0) - 1]
        return (hidden @ self.head).float()


def extend_batch(lens: Sequence[int], seed: int = 0) -> ForwardBatch:
    """An EXTEND batch of requests of ``lens`` new tokens (no prefix), distinct values."""
    g = torch.Generator().manual_seed(seed)
    return synthetic_extend_batch(lens, input_ids=torch.randint(0, VOCAB, (sum(lens),), generator=g))


def eager(model, batch):
    with torch.no_grad(), forward_context(batch):
        return model.compute_logits(model.forward(batch), batch)


def backend(phase: str = "decode", **kwargs) -> TcPiecewiseCudaGraphBackend:
    return TcPiecewiseCudaGraphBackend("cpu", phase=phase, **kwargs)


def decode_runner(model, sizes: List[int], **kwargs) -> DecodeCudaGraphRunner:
    be = kwargs.pop("backend", None) or backend("decode", **kwargs)
    return DecodeCudaGraphRunner(model, {"decode": {"bs": sizes}}, device="cpu", backend=be, show_progress=False)


def prefill_runner(model, sizes: List[int], **kwargs) -> PrefillCudaGraphRunner:
    be = kwargs.pop("backend", None) or backend("prefill", **kwargs)
    return PrefillCudaGraphRunner(model, {"prefill": {"bs": sizes}}, device="cpu", backend=be, show_progress=False)


def unique_graphs() -> int:
    return counters["stats"]["unique_graphs"]


# ----------------------------------------------------------------------------- the split
def dynamo_graph(model, batch):
    """The one FX graph Dynamo traces for ``model.forward(batch)`` (static shapes) and its
    real example inputs."""
    graphs = []

    def grab(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        return gm

    torch._dynamo.reset()
    with torch.no_grad(), forward_context(batch):
        torch.compile(model.forward, backend=grab, fullgraph=True)(batch)
    torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def test_marked_op_targets_are_recognised_as_dynamo_records_them():
    packet = torch.ops.cuda_graph_runner.tc_piecewise_test_mix
    assert is_eager_op_target(packet) and is_eager_op_target(packet.default)
    assert not is_eager_op_target(torch.ops.aten.mm) and not is_eager_op_target(torch.ops.aten.mm.default)
    assert not is_eager_op_target(torch.tanh) and not is_eager_op_target("tc_piecewise_test_mix")


def test_split_gives_marked_ops_plus_one_pieces_in_original_order():
    model = MarkedToy(layers=3)
    batch = decode_batch(4)
    gm, inputs = dynamo_graph(model, batch)
    split = split_graph(gm)
    assert len(split.pieces) == 3 + 1
    assert split.eager_ops == [
        "cuda_graph_runner::tc_piecewise_test_mix",
        "cuda_graph_runner::tc_piecewise_test_scale_rows",
        "cuda_graph_runner::tc_piecewise_test_mix",
    ]
    # piece, op, piece, op, piece, op, piece
    assert [item.is_eager for item in split.items] == [False, True] * 3 + [False]
    assert [p.piece_index for p in split.pieces] == [0, 1, 2, 3]
    # Each piece holds the code between its marked ops, in order: the first starts with the
    # embedding lookup, the middle ones with sin (after the op), the last ends with the "* 2".
    assert split.pieces[0].ops[0] == "operator.getitem" and "torch.tanh" in split.pieces[0].ops
    for piece in split.pieces[1:]:
        assert piece.ops[0] == "torch.sin"
    assert split.pieces[-1].ops[-1] == "operator.mul" and "torch.tanh" not in split.pieces[-1].ops
    assert (
        "between cuda_graph_runner::tc_piecewise_test_mix and cuda_graph_runner::tc_piecewise_test_scale_rows"
        in split.describe(split.pieces[1])
    )
    # The split module computes what the traced graph computes (order kept across the
    # in-place writes of the marked ops).
    with torch.no_grad(), forward_context(batch):
        torch.testing.assert_close(split.module(*inputs), gm(*inputs))


def test_reference_model_splits_at_each_attention():
    model = ReferenceLlamaForCausalLM.from_preset("tiny")
    model.create_kv_cache(64, 8, 16)
    cache = model.kv_cache
    batch = make_extend_batch(cache, [[1, 2, 3], [4, 5]])
    split = split_graph(dynamo_graph(model, batch)[0])
    assert len(split.pieces) == model.config.num_hidden_layers + 1
    assert split.eager_ops == ["cuda_graph_runner::reference_llama_attention"] * model.config.num_hidden_layers


def test_model_without_marked_op_is_one_piece_and_still_works():
    model = ToyModel()  # no marked op; reads request-axis tensors too
    runner = decode_runner(model, [2, 4, 8])
    runner.capture()
    assert len(runner.backend.pieces) == 1
    assert runner.backend.split.eager_ops == []
    assert "no marked op" in runner.backend.pieces[0].description
    for bs in (2, 3, 5, 8):
        batch = decode_batch(bs)
        torch.testing.assert_close(runner.forward(batch), eager(model, batch))


# ----------------------------------------------------------------------------- compiled == eager (capture off)
@pytest.mark.parametrize("bs", [1, 2, 3, 4, 7, 8, 9])
def test_decode_compiled_equals_eager_with_capture_off(bs):
    model = MarkedToy()
    runner = decode_runner(model, [1, 2, 4, 8])
    runner.capture()
    batch = decode_batch(bs)
    assert runner.can_run(batch) == (bs <= 8)
    torch.testing.assert_close(runner.forward(batch), eager(model, batch), rtol=1e-5, atol=1e-5)


def test_prefill_compiled_equals_eager_with_capture_off():
    model = MarkedToy()
    runner = prefill_runner(model, [4, 8, 16, 32])
    runner.capture()
    for i, lens in enumerate([[3], [4], [2, 5], [7, 1, 8], [16, 16], [20, 20]]):
        batch = extend_batch(lens, seed=i)
        assert runner.can_run(batch) == (sum(lens) <= 32)
        torch.testing.assert_close(
            runner.forward(batch), eager(model, batch), rtol=1e-5, atol=1e-5, msg=f"prefill lens {lens}"
        )


# Graph (padded shape) against eager (live shape): the same math in another summation order.
REF_TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=64)


@pytest.fixture(scope="module")
def reference():
    """The reference model (preset tiny) with tc_piecewise decode and prefill runners, captured once."""
    model = reference_model("tiny", requests=24, device="cpu")
    decode = decode_runner(model, [1, 2, 4, 8])
    prefill = prefill_runner(model, [8, 16, 32, 64])
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    return model, decode, prefill


def test_reference_decode_equals_eager_on_and_off_the_list(reference):
    model, runner, _ = reference
    for bs in (1, 2, 3, 5, 8, 9):
        prompts = make_dummy_prompts(bs, staggered_lengths(bs, 3, 4), model.config.vocab_size, seed=bs)
        session, batch = prefilled_decode_batch(model, prompts, decode_steps=1)
        with torch.no_grad():
            expected = eager_logits_fn(model)(batch).clone()
            got = runner.forward(batch)
        assert runner.can_run(batch) == (bs <= 8)
        torch.testing.assert_close(got, expected, **REF_TOL, msg=f"bs {bs}")
        session.close()
        session.close()


def test_reference_prefill_equals_eager_with_chunked_prefixes(reference):
    model, _, runner = reference
    cache = model.kv_cache
    for i, lens in enumerate([(7,), (5, 9, 3), (16, 16, 16, 12), (40, 41)]):
        prompts = make_dummy_prompts(len(lens), list(lens), model.config.vocab_size, seed=20 + i)
        with torch.no_grad():
            first = make_extend_batch(cache, [p[: len(p) // 2] for p in prompts])
            rows = first.req_pool_indices.tolist()
            second = make_extend_batch(cache, [p[len(p) // 2 :] for p in prompts], rows=rows)
            for batch in (first, second):
                expected = eager_logits_fn(model)(batch).clone()
                torch.testing.assert_close(
                    runner.forward(batch), expected, **REF_TOL, msg=f"lens {lens}, {batch.num_tokens} tokens"
                )
        for r in rows:
            cache.free_request(r)


def test_reference_greedy_generation_with_both_phases_equals_eager(reference):
    model, decode, prefill = reference
    prompts = make_dummy_prompts(3, [5, 9, 12], model.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = greedy_generate(model, model.kv_cache, prompts, 8)
        got = greedy_generate(model, model.kv_cache, prompts, 8, prefill_fn=prefill.forward, decode_fn=decode.forward)
    assert got == expected


def test_two_backends_share_one_trampoline_and_eager_forward_is_untouched(reference):
    model, decode, prefill = reference
    assert model.forward is not type(model).forward  # the contract's dispatcher (model_forward)
    wrappers = forward_wrappers(model)
    assert wrappers == [decode.backend._forward_wrapper, prefill.backend._forward_wrapper]
    assert decode.backend._forward_wrapper.shared_with == prefill.backend._forward_wrapper.shared_with
    batch = make_extend_batch(model.kv_cache, [[1, 2, 3]])
    calls = decode.backend.piece_calls()["run"] + prefill.backend.piece_calls()["run"]
    # No backend at work: the model's forward is the original one (no compiled piece runs).
    with torch.no_grad(), forward_context(batch):
        torch.testing.assert_close(model(batch), model.forward.__wrapped__(batch))
    assert decode.backend.piece_calls()["run"] + prefill.backend.piece_calls()["run"] == calls
    model.kv_cache.reset()


# ----------------------------------------------------------------------------- Dynamo recompilations
def test_no_recompilation_across_sizes():
    model = MarkedToy()
    runner = decode_runner(model, [2, 3, 4, 8, 16])
    before = unique_graphs()
    runner.capture()
    # One graph for every size >= 2, traced at the largest size with the token axis dynamic.
    assert unique_graphs() - before == 1 == runner.backend.dynamo_compiles
    with torch.compiler.set_stance("fail_on_recompile"):
        for bs in range(1, 17):
            runner.forward(decode_batch(bs))
    assert unique_graphs() - before == 1


def test_size_one_costs_exactly_one_more_graph_made_in_the_compile_pass():
    model = MarkedToy()
    runner = decode_runner(model, [1, 2, 8])
    before = unique_graphs()
    runner.backend.prepare(build_capture_plan(runner))  # the compile pass alone
    assert unique_graphs() - before == 2 == runner.backend.dynamo_compiles
    assert runner.backend.compile_seconds > 0
    assert runner.backend.piece_calls()["capture"] == 0  # the compile pass captures nothing
    runner.capture()  # prepare again + capture: no new graph
    with torch.compiler.set_stance("fail_on_recompile"):
        for bs in (1, 2, 5, 8):
            torch.testing.assert_close(runner.forward(decode_batch(bs)), eager(model, decode_batch(bs)))
    assert unique_graphs() - before == 2


def test_prefill_token_counts_share_one_graph():
    model = MarkedToy()
    runner = prefill_runner(model, [4, 8, 12, 16, 64])
    before = unique_graphs()
    runner.capture()
    with torch.compiler.set_stance("fail_on_recompile"):
        for i, lens in enumerate([[3], [2, 2, 2], [9, 1], [30, 20, 10]]):
            runner.forward(extend_batch(lens, seed=i))
    assert unique_graphs() - before == 1


def test_recapture_after_cleanup_does_not_recompile():
    model = MarkedToy()
    runner = decode_runner(model, [2, 4])
    runner.capture()
    before = unique_graphs()
    runner.cleanup()
    assert not runner.can_run(decode_batch(2))
    runner.capture()
    assert runner.can_run(decode_batch(2)) and unique_graphs() == before


# ----------------------------------------------------------------------------- the capture protocol (fake graphs)
def fake_capture_runner(sizes=(2, 4)):
    dm = FakeGraphDeviceModule()
    be = backend("decode", device_module=dm, enable_capture=True)
    runner = decode_runner(MarkedToy(), list(sizes), backend=be)
    runner.capture()
    return runner, be, dm


def test_each_piece_warms_up_then_captures_into_the_shared_pool_per_size():
    runner, be, dm = fake_capture_runner((2, 4))
    n = len(be.pieces)
    assert n == 4 and not be.weak_ref_outputs
    begins = [e for e in dm.events if e[0] == "capture_begin"]
    assert len(begins) == n * 2
    assert all(e[2] == dm.pool_handle for e in begins)
    for piece in be.pieces:
        # compile pass: one call per size; warm-up "auto": the first size once, the
        # others not (the compile pass ran their kernels); one capture per size.
        assert piece.calls["compile"] == 2 and piece.calls["warmup"] == 1 and piece.calls["capture"] == 2
        assert sorted(k.size for k in piece.entries) == [2, 4]
    assert be.captured_keys == [ShapeKey(4, "decode"), ShapeKey(2, "decode")]  # largest first


def test_describe_lists_the_pieces_holding_each_key():
    runner, be, dm = fake_capture_runner((2, 4))
    graphs = runner.describe()["graphs"]
    assert [g["key"] for g in graphs] == ["4|decode", "2|decode"]
    for g in graphs:
        assert g["pieces"] == len(be.pieces) == 4 and g["piece_names"] == [p.name for p in be.pieces]
        assert g["nodes"] is None and g["kernels"] is None  # fake graphs: torch cannot tell


def test_replay_replays_every_piece_and_returns_capture_time_outputs():
    runner, be, dm = fake_capture_runner((2, 4))
    key = ShapeKey(4, "decode")
    static = runner.capture_prepare(4)
    dm.events.clear()
    hidden = be.forward_compiled(static, key)
    replays = [e[1] for e in dm.events if e[0] == "replay"]
    assert replays == [piece.entries[key].graph.id for piece in be.pieces]  # in piece order
    # The last piece's capture-time output is the model's output, at its capture address.
    assert hidden is be.pieces[-1].entries[key].output
    # Through the runner: replay of the padded size, eager ops in between.
    dm.events.clear()
    runner.forward(decode_batch(3))
    assert [e[0] for e in dm.events].count("replay") == len(be.pieces)


def test_size_outside_the_captured_list_runs_compiled_pieces_without_graphs():
    runner, be, dm = fake_capture_runner((2, 4))
    model = runner.model
    batch = decode_batch(3)  # 3 is not captured
    before = be.piece_calls()["run"]
    dm.events.clear()
    out = be.forward_compiled(batch)
    assert "replay" not in dm.names() and "capture_begin" not in dm.names()
    assert be.piece_calls()["run"] - before == len(be.pieces)
    with torch.no_grad(), forward_context(batch):
        torch.testing.assert_close(out, model.forward.__wrapped__(batch))


def test_replay_of_a_captured_key_calls_the_split_module_without_dynamo():
    runner, be, dm = fake_capture_runner((2, 4))
    assert be.direct_replay and be.direct_keys == be.captured_keys
    compiled = be._compiled

    def no_dynamo(*args, **kwargs):
        raise AssertionError("a replay of a captured key went through Dynamo")

    be._compiled = no_dynamo
    before = be.piece_calls()
    dm.events.clear()
    runner.forward(decode_batch(3))  # padded to 4
    assert [e[0] for e in dm.events].count("replay") == len(be.pieces)
    after = be.piece_calls()
    assert after["replay"] - before["replay"] == len(be.pieces) and after["run"] == before["run"]
    # Another batch than the captured static one (other addresses): through Dynamo.
    be._compiled = compiled
    key = ShapeKey(4, "decode")
    calls = []
    be._compiled = lambda *a, **k: calls.append(1) or compiled(*a, **k)
    be.forward_compiled(decode_batch(4), key)
    assert calls == [1]
    runner.cleanup()
    assert be.direct_keys == []


def test_debug_mode_replays_through_dynamo_to_check_live_input_addresses():
    dm = FakeGraphDeviceModule()
    be = backend("decode", device_module=dm, enable_capture=True, debug=True)
    runner = decode_runner(MarkedToy(), [2, 4], backend=be)
    runner.capture()
    assert not be.direct_replay and be.direct_keys == []
    assert all(p.entries[ShapeKey(4, "decode")].input_ptrs is not None for p in be.pieces)
    runner.forward(decode_batch(3))
    assert be.piece_calls()["replay"] == len(be.pieces)


class ReturnsAParameterToo(MarkedToy):
    """Returns a graph *input* (a parameter) next to the hidden states."""

    def forward(self, batch: ForwardBatch):
        return super().forward(batch), self.head

    def compute_logits(self, hidden, batch: ForwardBatch) -> torch.Tensor:
        return super().compute_logits(hidden[0], batch)


def test_a_forward_returning_more_than_graph_outputs_replays_through_dynamo(emulated):
    model = ReturnsAParameterToo()
    runner = decode_runner(model, [2, 4], backend=backend("decode", device_module=emulated, enable_capture=True))
    runner.capture()
    assert runner.backend.direct_keys == [] and len(runner.backend.captured_keys) == 2
    for bs in (2, 3, 4):
        torch.testing.assert_close(runner.forward(decode_batch(bs)), eager(model, decode_batch(bs)))
    assert runner.backend.piece_calls()["replay"] == 3 * len(runner.backend.pieces)


def test_cleanup_resets_every_piece_graph():
    runner, be, dm = fake_capture_runner((2,))
    runner.cleanup()
    assert [e[0] for e in dm.events].count("reset") == len(be.pieces)
    assert all(not p.entries for p in be.pieces) and be.captured_keys == []


def test_discard_resets_one_key_in_every_piece_so_it_captures_again():
    runner, be, dm = fake_capture_runner((2, 4))
    key = ShapeKey(2, "decode")
    be.discard(key)
    assert [e[0] for e in dm.events].count("reset") == len(be.pieces)
    assert all(sorted(k.size for k in p.entries) == [4] for p in be.pieces)
    assert be.captured_keys == [ShapeKey(4, "decode")] and not be.can_run(decode_batch(2), key)
    be.discard(key)  # nothing left: no error
    runner.captured_keys.remove(key)
    runner.capture()
    assert all(sorted(k.size for k in p.entries) == [2, 4] for p in be.pieces)


def test_capture_one_requires_prepare_and_refuses_a_second_capture():
    be = backend("decode")
    with pytest.raises(RuntimeError, match="prepare"):
        be.capture_one(ShapeKey(2), lambda: None)
    runner, be, _ = fake_capture_runner((2,))
    with pytest.raises(ValueError, match="already captured"):
        be.capture_one(ShapeKey(2, "decode"), lambda: None)
    with pytest.raises(KeyError):
        be.replay(ShapeKey(8, "decode"), runner.capture_prepare(2))


def test_weak_ref_tensor_aliases_without_owning():
    base = torch.arange(10.0)
    view = base[2:6]
    weak = weak_ref_tensor(view)
    assert weak.data_ptr() == view.data_ptr() and weak.shape == view.shape and weak.stride() == view.stride()
    base.add_(1)
    torch.testing.assert_close(weak, view)
    assert weak.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
    assert weak_ref_tensor(3) == 3


# ----------------------------------------------------------------------------- replay emulated on the CPU
@pytest.fixture
def emulated(monkeypatch):
    """Pieces compiled by a compiler that records, inside a capture, how to replay the call."""
    dm = EmulatedGraphs()
    recording = recording_compiler(dm, tc_compiler.PIECE_COMPILERS["eager"])
    monkeypatch.setitem(tc_compiler.PIECE_COMPILERS, "eager", recording)
    return dm


def test_emulated_replay_of_the_reference_model_equals_eager_in_both_phases(emulated):
    model = reference_model("tiny", requests=24, device="cpu")
    cache = model.kv_cache
    decode = decode_runner(model, [1, 2, 4, 8], backend=backend("decode", device_module=emulated, enable_capture=True))
    prefill = prefill_runner(
        model, [8, 16, 32, 64], backend=backend("prefill", device_module=emulated, enable_capture=True)
    )
    with torch.no_grad():
        decode.capture()
        prefill.capture()
        assert decode.backend.direct_keys == decode.backend.captured_keys
        assert prefill.backend.direct_keys == prefill.backend.captured_keys
        for bs in (1, 3, 8):
            prompts = make_dummy_prompts(bs, staggered_lengths(bs, 3), model.config.vocab_size, seed=bs)
            session, batch = prefilled_decode_batch(model, prompts, decode_steps=1)
            expected = eager_logits_fn(model)(batch).clone()
            before = emulated.replays
            torch.testing.assert_close(decode.forward(batch), expected, **REF_TOL, msg=f"decode bs {bs}")
            assert emulated.replays - before == model.config.num_hidden_layers + 1
            session.close()
        prompts = make_dummy_prompts(4, [5, 9, 12, 3], model.config.vocab_size, seed=7)
        expected = greedy_generate(model, cache, prompts, 6)
        before = emulated.replays
        got = greedy_generate(model, cache, prompts, 6, prefill_fn=prefill.forward, decode_fn=decode.forward)
        assert got == expected and emulated.replays > before
        chunked = greedy_generate(
            model, cache, prompts, 4, prefill_fn=prefill.forward, decode_fn=decode.forward, chunk_size=4
        )
        assert chunked == greedy_generate(model, cache, prompts, 4, chunk_size=4)


# ----------------------------------------------------------------------------- config and errors
def test_compiler_comes_from_the_phase_config_and_is_checked():
    from cuda_graph_runner.testing.workload import PhaseConfig

    assert backend(phase_config=PhaseConfig(tc_compiler="inductor")).compiler == "inductor"
    assert backend().compiler == "eager"
    assert backend(compiler="inductor", phase_config=PhaseConfig(tc_compiler="eager")).compiler == "inductor"
    with pytest.raises(ValueError, match="unknown tc_compiler 'tvm'"):
        backend(compiler="tvm")


class GraphBreakingModel(MarkedToy):
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids]
        torch._dynamo.graph_break()
        return h * 2.0


def test_trace_failure_names_the_forward_and_dynamo_reason():
    runner = decode_runner(GraphBreakingModel(), [2, 4])
    with pytest.raises(TcPiecewiseCompileError) as info:
        runner.capture()
    message = str(info.value)
    assert "GraphBreakingModel.forward" in message and "one graph" in message
    assert "graph_break" in message or "Graph break" in message


def test_piece_compile_failure_names_the_piece_and_the_op(monkeypatch):
    from torch._inductor.exc import LoweringException

    real = tc_compiler.PIECE_COMPILERS["eager"]
    seen = []

    def failing(module, example_inputs):
        seen.append(module)
        if len(seen) == 2:  # the second piece
            raise LoweringException(RuntimeError("no lowering"), torch.ops.aten.mm.default, [], {})
        return real(module, example_inputs)

    monkeypatch.setitem(tc_compiler.PIECE_COMPILERS, "eager", failing)
    runner = decode_runner(MarkedToy(), [2, 4])
    with pytest.raises(TcPiecewiseCompileError) as info:
        runner.capture()
    message = str(info.value)
    assert "compiler 'eager' failed on piece 2/4 (submod_2" in message
    assert (
        "between cuda_graph_runner::tc_piecewise_test_mix and cuda_graph_runner::tc_piecewise_test_scale_rows"
    ) in message
    assert "failing op: aten.mm.default" in message
    assert isinstance(info.value.__cause__, Exception)


class OutOfRangeModel(MarkedToy):
    """Indexes past the embedding only at run time (fake tensors do not check bounds)."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids]
        out = torch.empty_like(h)
        mix_op(out, h)
        return out[batch.out_cache_loc + 1000]


def test_piece_runtime_failure_names_the_piece_the_size_and_the_op():
    runner = decode_runner(OutOfRangeModel(), [2, 4])
    with pytest.raises(TcPiecewiseRuntimeError) as info:
        runner.capture()
    message = str(info.value)
    assert "piece 2/2 (submod_2, after cuda_graph_runner::tc_piecewise_test_mix" in message
    assert "during compile of ShapeKey(size=4, variant='decode')" in message
    assert "[at: " in message and "getitem" in message


def test_uninstall_gives_the_model_its_forward_back():
    model = MarkedToy()
    original = model.forward
    runner = decode_runner(model, [2])
    runner.capture()
    assert model.forward is not original and "forward" in model.__dict__
    runner.backend.uninstall()
    assert "forward" not in model.__dict__ and model.forward == original


# ----------------------------------------------------------------------------- inductor on the CPU (opt-in)
INDUCTOR_CPU = envs.TEST_INDUCTOR_CPU


@pytest.mark.skipif(
    not envs.get(INDUCTOR_CPU),
    reason=f"inductor on the CPU builds C++ (about 1 min with a cold cache); set {INDUCTOR_CPU}=1 "
    "to run it (the GPU tests cover inductor on CUDA)",
)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_inductor_on_cpu_equals_eager_in_both_phases():
    model = ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=1))
    model.create_kv_cache(20 * 32 + 1, 21, 32)
    decode = decode_runner(model, [2, 4], compiler="inductor")
    prefill = prefill_runner(model, [8, 16], compiler="inductor")
    with torch.no_grad():
        decode.capture()
        prefill.capture()
        prompts = make_dummy_prompts(3, [3, 4, 5], model.config.vocab_size)
        expected = greedy_generate(model, model.kv_cache, prompts, 5)
        got = greedy_generate(model, model.kv_cache, prompts, 5, prefill_fn=prefill.forward, decode_fn=decode.forward)
    assert got == expected
    assert decode.backend.compiler == prefill.backend.compiler == "inductor"


def test_a_capture_inside_refused_breaks_names_the_reason_instead_of_a_duplicate_piece(emulated):
    """A forward that refuses breaks (a draft runner's steps after the first) cannot run on
    tc_piecewise, whose pieces end at every marked op: refused naming the reason (before,
    step 1's pieces reported 'already holds a graph')."""
    from cuda_graph_runner.backend import refuse_breaks

    model = reference_model("tiny", requests=8, device="cpu")
    decode = decode_runner(model, [2], backend=backend("decode", device_module=emulated, enable_capture=True))
    with torch.no_grad(), refuse_breaks("step 1 would replay with step 0's batch"):
        with pytest.raises(TcPiecewiseRuntimeError, match=r"refuses that \(step 1 would replay.*use backend full"):
            decode.capture()

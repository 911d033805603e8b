"""Outputs on the CPU: their lifetime (zero-copy by default, owned on request), the
structures a model may return (one walker, every path), and the runner's smaller traps
(autograd, the garbage collector, constructor arguments, backend ``disabled``).

Graph replays are emulated: the core's ``RecordingBackend`` (re-runs the forward; with
``share_pool=True`` every shape's outputs share memory, as in one graph pool), and the
real ``full`` and ``breakable`` backends on the breakable plugin's emulated graph API.
"""

from __future__ import annotations

import collections
import dataclasses
import gc
from typing import Any, Dict, List, NamedTuple, Optional

import pytest
import torch

from cuda_graph_runner.backend import BaseCudaGraphBackend, DisabledBackend
from cuda_graph_runner.backend.buffers import copy_into
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.backend.nested import (
    UnsupportedStructureError,
    check_structure,
    clone_tensors,
    iter_tensors,
    map_tensors,
)
from cuda_graph_runner.backend.weak_ref import weak_ref_tensors
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.base import freeze_gc, slice_rows
from cuda_graph_runner.runner.sizes import OutputRowsError
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch

VOCAB = 16
HIDDEN = 8


# -- output structures ----------------------------------------------------------------------


class Pair(NamedTuple):
    logits: torch.Tensor
    scores: torch.Tensor


@dataclasses.dataclass
class Result:
    logits: torch.Tensor
    extra: Dict[str, Any]
    note: str = "kept"


@dataclasses.dataclass(frozen=True)
class FrozenResult:
    logits: torch.Tensor
    derived: Optional[torch.Tensor] = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "derived", self.logits * 2)


class Opaque:
    """Not a supported structure: the runner cannot look inside it."""

    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


KINDS = ("tensor", "tuple", "namedtuple", "list", "dict", "dataclass", "frozen_dataclass", "nested")


def wrap(kind: str, t: torch.Tensor) -> Any:
    """``t`` ([rows, n]) inside the structure ``kind``; every tensor keeps rows on dim 0."""
    scores = t.sum(-1, keepdim=True)
    if kind == "tensor":
        return t
    if kind == "tuple":
        return (t, scores)
    if kind == "namedtuple":
        return Pair(t, scores)
    if kind == "list":
        return [t, scores]
    if kind == "dict":
        return {"logits": t, "scores": scores}
    if kind == "dataclass":
        return Result(t, {"scores": scores, "n": 3})
    if kind == "frozen_dataclass":
        return FrozenResult(t)
    if kind == "nested":
        return {"a": [Pair(t, scores)], "b": (Result(t * 2, {"s": scores}), None, 3)}
    if kind == "opaque":
        return Opaque(t)
    if kind == "set_in_list":
        return [t, {1, 2}]
    raise AssertionError(kind)


def first_tensor(value: Any) -> torch.Tensor:
    return next(iter_tensors(value))[1]


def shape_of(value: Any) -> Any:
    """The types of a structure (tensors as their shapes), for comparing structures."""
    return map_tensors(lambda t: ("tensor", tuple(t.shape)), value)


class StructModel(torch.nn.Module):
    """A model whose forward and logits are the structures of ``hidden_kind`` and
    ``logits_kind``. Its parameters require grad (the autograd trap)."""

    def __init__(self, hidden_kind: str = "tensor", logits_kind: str = "tensor") -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g))
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g))
        self.hidden_kind = hidden_kind
        self.logits_kind = logits_kind

    def forward(self, batch: ForwardBatch) -> Any:
        h = self.embed[batch.input_ids] + 0.01 * batch.positions[:, None].float()
        h = h + 0.001 * batch.out_cache_loc[:, None].float()
        return wrap(self.hidden_kind, h)

    def compute_logits(self, hidden: Any, batch: ForwardBatch) -> Any:
        return wrap(self.logits_kind, (first_tensor(hidden) @ self.head).float())


def extend_batch(lens: List[int], *, offset: int = 1) -> ForwardBatch:
    return synthetic_extend_batch(lens, token_stride=5, token_offset=offset, vocab=VOCAB, first_slot=50 + offset)


def make_backend(path: str, phase: str) -> BaseCudaGraphBackend:
    """A backend for ``path``: recording (shared pool), or the full/breakable plugin on
    emulated graphs."""
    if path == "recording":
        return RecordingBackend("cpu", phase=phase, share_pool=True)
    emulation = pytest.importorskip("cuda_graph_runner_breakable.emulation")
    dm = emulation.EmulatedGraphDeviceModule()
    if path == "full":
        full = pytest.importorskip("cuda_graph_runner_full.backend")
        return full.FullCudaGraphBackend("cpu", phase=phase, device_module=dm, memory_pool="pool-0")
    if path == "breakable":
        breakable = pytest.importorskip("cuda_graph_runner_breakable.backend")
        return breakable.BreakableCudaGraphBackend("cpu", phase=phase, device_module=dm, memory_pool="pool-0")
    raise AssertionError(path)


def decode_runner(model: Any, path: str, *, max_bs: int = 16, **kwargs: Any) -> DecodeCudaGraphRunner:
    backend = DisabledBackend("cpu", phase="decode") if path == "eager" else make_backend(path, "decode")
    return DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False, **kwargs
    )


def prefill_runner(model: Any, path: str, *, max_bs: int = 16, **kwargs: Any) -> PrefillCudaGraphRunner:
    backend = DisabledBackend("cpu", phase="prefill") if path == "eager" else make_backend(path, "prefill")
    return PrefillCudaGraphRunner(
        model, {"prefill": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False, **kwargs
    )


def assert_same_output(got: Any, expected: Any) -> None:
    assert shape_of(got) == shape_of(expected)
    got_t = [t for _, t in iter_tensors(got)]
    exp_t = [t for _, t in iter_tensors(expected)]
    for g, e in zip(got_t, exp_t):
        torch.testing.assert_close(g, e)


# -- section 1: output lifetime -----------------------------------------------------------------


def test_kept_output_changes_after_a_replay_of_another_size_by_default():
    """Documented, expected behaviour of the zero-copy default: a replayed output is valid
    only until the next replay of any graph in the pool (here: bs 3 -> graph 4, then bs 9
    -> graph 12, sharing memory)."""
    runner = decode_runner(ToyModel(), "recording")
    assert runner.owned_outputs is False
    runner.capture()
    a = runner.forward(decode_batch(3))
    before = a.clone()
    torch.testing.assert_close(before, runner.eager_forward(decode_batch(3)))
    runner.forward(decode_batch(9, offset=5))
    assert not torch.equal(a, before), "the shared-pool fake did not overwrite the kept output"


@pytest.mark.parametrize("how", ["argument", "config"])
def test_owned_outputs_survive_a_replay_of_another_size(how):
    if how == "argument":
        runner = decode_runner(ToyModel(), "recording", owned_outputs=True)
    else:
        runner = DecodeCudaGraphRunner(
            ToyModel(),
            {"decode": {"max_bs": 16, "owned_outputs": True}},
            device="cpu",
            backend=RecordingBackend("cpu", phase="decode", share_pool=True),
            show_progress=False,
        )
    assert runner.owned_outputs is True
    runner.capture()
    a = runner.forward(decode_batch(3))
    before = a.clone()
    runner.forward(decode_batch(9, offset=5))
    runner.forward(decode_batch(3, offset=7))
    assert torch.equal(a, before)
    torch.testing.assert_close(a, runner.eager_forward(decode_batch(3)))


def test_constructor_argument_overrides_the_config_key():
    runner = DecodeCudaGraphRunner(
        ToyModel(),
        {"decode": {"max_bs": 4, "owned_outputs": True}},
        device="cpu",
        backend=RecordingBackend("cpu", phase="decode"),
        owned_outputs=False,
    )
    assert runner.owned_outputs is False
    with pytest.raises(TypeError, match="owned_outputs"):
        DecodeCudaGraphRunner(ToyModel(), None, device="cpu", backend="disabled", owned_outputs="yes")


def test_owned_outputs_config_key_is_validated_and_round_trips():
    cfg = CudaGraphConfig.from_dict({"prefill": {"owned_outputs": True}})
    assert cfg.prefill.owned_outputs is True and cfg.decode.owned_outputs is False
    assert cfg.to_dict() == {"prefill": {"owned_outputs": True}}
    with pytest.raises(CudaGraphConfigError, match="owned_outputs.*true or false"):
        CudaGraphConfig.from_dict({"decode": {"owned_outputs": 1}})


@pytest.mark.parametrize("path", ["full", "breakable"])
@pytest.mark.parametrize("owned", [False, True])
def test_emulated_backends_overwrite_a_kept_output_unless_owned(path, owned):
    """The real full/breakable code on emulated graphs: the next replay of the same graph
    rewrites what the last one returned; owned outputs do not change."""
    runner = decode_runner(StructModel(), path, max_bs=8, owned_outputs=owned)
    runner.capture()
    a = runner.forward(decode_batch(3))
    before = a.clone()
    torch.testing.assert_close(before, runner.eager_forward(decode_batch(3)))
    b = runner.forward(decode_batch(3, offset=6))
    torch.testing.assert_close(b, runner.eager_forward(decode_batch(3, offset=6)))
    assert torch.equal(a, before) is owned


def test_owned_prefill_outputs_are_not_copied_twice():
    """Prefill logits are computed eagerly from the graph's hidden states: already owned,
    so ``owned_outputs`` leaves them alone (one copy at most, here none)."""
    runner = prefill_runner(StructModel(), "recording", owned_outputs=True)
    runner.capture()
    batch = extend_batch([3, 2])
    key, static = runner.replay_prepare(batch)
    graph_output = runner.backend.replay(key, static)
    logits = runner.finish_output(graph_output, batch, static)
    assert clone_tensors(logits, aliasing=graph_output) is logits  # fresh: not copied
    assert clone_tensors(graph_output[:5], aliasing=graph_output).data_ptr() != graph_output.data_ptr()
    kept = runner.forward(batch)
    runner.forward(extend_batch([7, 5], offset=3))
    torch.testing.assert_close(kept, runner.eager_forward(batch))


def test_greedy_session_keeps_copies_of_zero_copy_logits():
    """GreedySession(decode_fn=runner.forward) keeps the logits its tokens came from, equal
    to an eager session's, although every replay rewrites the runner's output."""
    from cuda_graph_runner.reference.batches import GreedySession, make_dummy_prompts
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32)
    cache = model.create_kv_cache(num_slots=1024, max_reqs=16, max_context_len=48)
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"max_bs": 4}},
        device="cpu",
        backend=RecordingBackend("cpu", phase="decode", share_pool=True),
        show_progress=False,
    )
    runner.capture()
    prompts = make_dummy_prompts(3, [4, 7, 2], model.config.vocab_size, seed=3)
    sessions = {}
    for name, fn in (("eager", None), ("graph", runner.forward)):
        session = GreedySession(model, cache, decode_fn=fn)
        with torch.no_grad():
            session.prefill(prompts)
            for _ in range(4):
                session.decode()
        sessions[name] = session
    eager, graph = sessions["eager"], sessions["graph"]
    assert graph.tokens == eager.tokens
    assert len(graph.logits) == len(eager.logits) == 5
    for step, (g, e) in enumerate(zip(graph.logits, eager.logits)):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-5, msg=f"step {step}")
    for session in sessions.values():
        session.close()


# -- section 2: output structures ---------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["eager", "recording", "full", "breakable"])
@pytest.mark.parametrize("owned", [False, True])
def test_decode_structures_on_every_path(kind, path, owned):
    model = StructModel(logits_kind=kind)
    runner = decode_runner(model, path, max_bs=8, owned_outputs=owned)
    runner.capture()
    for bs, offset in ((3, 1), (8, 2), (5, 3)):
        batch = decode_batch(bs, offset=offset)
        assert runner.can_run(batch) is (path != "eager")
        got = runner.forward(batch)
        expected = runner.eager_forward(batch)
        assert type(got) is type(expected) is type(wrap(kind, torch.zeros(1, 1)))
        assert all(t.shape[0] == bs for _, t in iter_tensors(got)), shape_of(got)
        assert_same_output(got, expected)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ["eager", "recording", "breakable"])
def test_prefill_structures_on_every_path(kind, path):
    """Prefill graphs return the hidden states: the runner slices that structure, then the
    model's logits run eagerly on it."""
    model = StructModel(hidden_kind=kind, logits_kind=kind)
    runner = prefill_runner(model, path, max_bs=16)
    runner.capture()
    for lens in ([3, 2], [9, 4], [16]):
        batch = extend_batch(lens)
        assert runner.can_run(batch) is (path != "eager")
        got = runner.forward(batch)
        assert all(t.shape[0] == sum(lens) for _, t in iter_tensors(got)), shape_of(got)
        assert_same_output(got, runner.eager_forward(batch))


@dataclasses.dataclass
class Verified:
    logits: torch.Tensor  # [bs * w, vocab], per token
    accepted: torch.Tensor  # [bs, 2], per request


class PerRequestModel(ToyModel):
    """TARGET_VERIFY / DLLM_EXTEND output: per-token logits beside per-request tensors."""

    def __init__(self, kind: str = "dataclass") -> None:
        super().__init__(vocab=VOCAB, hidden=HIDDEN)
        self.kind = kind

    def compute_logits(self, hidden, batch):
        logits = super().compute_logits(hidden, batch)
        w = batch.num_tokens_per_req
        per_request = logits.view(-1, w, logits.shape[-1]).amax(dim=(1, 2))[:, None].repeat(1, 2)
        per_request = per_request + batch.seq_lens[:, None].float()
        if self.kind == "dataclass":
            return Verified(logits, per_request)
        if self.kind == "tuple":
            return (logits, per_request, torch.tensor(1.0))
        return {"logits": logits, "accepted": per_request}


@pytest.mark.parametrize(
    "kind,mode,path",
    [("dataclass", "target_verify", "recording"), ("tuple", "dllm_extend", "full"), ("dict", "target_verify", "full")],
)
def test_per_request_outputs_are_cut_to_the_live_requests(kind, mode, path):
    width = 3
    runner = DecodeCudaGraphRunner(
        PerRequestModel(kind),
        {"decode": {"bs": [2, 4]}},
        device="cpu",
        backend=make_backend(path, "decode"),
        show_progress=False,
        mode=mode,
        num_tokens_per_req=width,
    )
    runner.capture()
    for bs in (3, 1, 4):
        batch = decode_batch(bs, width=width, offset=bs)
        batch.forward_mode = runner.mode
        got = runner.forward(batch)
        expected = runner.eager_forward(batch)
        assert shape_of(got) == shape_of(expected), (bs, shape_of(got))
        assert_same_output(got, expected)


class OddRowsModel(ToyModel):
    """A graph output whose leading dimension counts neither tokens nor requests."""

    def compute_logits(self, hidden, batch):
        logits = super().compute_logits(hidden, batch)
        return {"logits": logits, "moments": torch.stack([logits.mean(), logits.std(), logits.max()])}


@pytest.mark.parametrize("path", ["recording", "full", "breakable"])
def test_an_output_leading_with_neither_count_is_refused_at_capture_naming_its_path(path):
    runner = decode_runner(OddRowsModel(vocab=VOCAB, hidden=HIDDEN), path, max_bs=4)
    with pytest.raises(OutputRowsError) as info:
        runner.capture()
    text = str(info.value)
    assert info.value.path == "decode graph output['moments']" and "shape (3,)" in text, text
    assert "padded token count" in text and not runner.captured_keys


def test_a_prefill_output_not_leading_with_the_tokens_is_refused_at_capture():
    class Batched(StructModel):
        def forward(self, batch):
            h = super().forward(batch)
            return {"hidden": h, "pooled": h.mean(dim=0, keepdim=True)}  # [1, H]: across the batch

        def compute_logits(self, hidden, batch):
            return super().compute_logits(hidden["hidden"], batch)

    runner = prefill_runner(Batched(), "recording", max_bs=16)
    with pytest.raises(OutputRowsError, match=r"prefill graph output\['pooled'\] has shape \(1, 8\)"):
        runner.capture()


@pytest.mark.parametrize("path", ["recording", "full", "breakable"])
@pytest.mark.parametrize("kind,type_name", [("opaque", "Opaque"), ("set_in_list", "set")])
def test_unsupported_output_is_rejected_at_capture_naming_the_type(path, kind, type_name):
    runner = decode_runner(StructModel(logits_kind=kind), path, max_bs=4)
    with pytest.raises(UnsupportedStructureError, match=type_name) as info:
        runner.capture()
    assert isinstance(info.value, TypeError)
    assert "decode graph output" in str(info.value)
    assert not runner.captured_keys


def test_slice_rows_rebuilds_each_structure():
    t = torch.arange(12.0).reshape(4, 3)
    pair = slice_rows(Pair(t, t[:, :1]), 3)
    assert type(pair) is Pair and pair.logits.shape == (3, 3) and pair.scores.shape == (3, 1)
    res = slice_rows(Result(t, {"s": t, "n": 3}), 3)  # the reported bug: came back unsliced
    assert type(res) is Result and res.logits.shape == (3, 3) and res.extra["s"].shape == (3, 3)
    assert res.extra["n"] == 3 and res.note == "kept"
    frozen = slice_rows(FrozenResult(t), 2)
    assert frozen.logits.shape == (2, 3) and frozen.derived.shape == (2, 3)
    assert slice_rows(torch.tensor(5.0), 2).shape == ()  # 0-d tensors pass through
    od = slice_rows(collections.OrderedDict(b=t, a=t), 1)
    assert type(od) is collections.OrderedDict and list(od) == ["b", "a"] and od["a"].shape == (1, 3)
    dd = slice_rows(collections.defaultdict(list, x=t), 1)
    assert type(dd) is collections.defaultdict and dd.default_factory is list and dd["x"].shape == (1, 3)
    values, indices = slice_rows(torch.max(t, dim=1), 2)  # a torch struct sequence
    assert values.shape == indices.shape == (2,)
    assert slice_rows((t, torch.Size([4, 3]), None, "x"), 1)[1:] == (torch.Size([4, 3]), None, "x")


def test_weak_ref_tensors_rebuilds_namedtuples_and_dataclasses():
    t = torch.ones(4, 2)
    pair = weak_ref_tensors(Pair(t, t))
    assert type(pair) is Pair and pair.logits.data_ptr() == t.data_ptr()
    res = weak_ref_tensors(Result(t, {"s": t}))
    assert type(res) is Result and res.extra["s"].data_ptr() == t.data_ptr()


def test_copy_into_walks_every_structure_and_refuses_a_changed_one():
    dst = {"a": [Pair(torch.zeros(2), torch.zeros(1))], "b": Result(torch.zeros(3), {"s": torch.zeros(1)})}
    src = {"a": [Pair(torch.ones(2), torch.full((1,), 2.0))], "b": Result(torch.full((3,), 3.0), {"s": torch.ones(1)})}
    copy_into(dst, src)
    assert dst["a"][0].scores.item() == 2.0 and dst["b"].logits.sum().item() == 9.0 and dst["b"].extra["s"].item() == 1
    with pytest.raises(ValueError, match="structure"):
        copy_into({"a": torch.zeros(1)}, {"b": torch.zeros(1)})
    with pytest.raises(ValueError, match="Pair"):
        copy_into(Pair(torch.zeros(1), torch.zeros(1)), (torch.zeros(1), torch.zeros(1)))
    with pytest.raises(ValueError, match="tensor"):
        copy_into([torch.zeros(1)], [None])


def test_check_structure_names_the_path():
    check_structure({"a": [Pair(torch.zeros(1), torch.zeros(1))], "n": None})
    with pytest.raises(UnsupportedStructureError, match=r"out\['a'\]\[1\] is a .*Opaque"):
        check_structure({"a": [torch.zeros(1), Opaque(torch.zeros(1))]}, where="out")


def test_clone_tensors_copies_only_what_aliases():
    graph = torch.zeros(4, 3)
    fresh = torch.ones(2)
    out = clone_tensors({"view": graph[:2], "fresh": fresh}, aliasing=graph)
    assert out["view"].data_ptr() != graph.data_ptr() and out["fresh"] is fresh
    assert clone_tensors(Pair(graph, fresh)).scores is not fresh


# -- section 3: smaller traps -----------------------------------------------------------------


@pytest.mark.parametrize("path", ["eager", "recording", "full", "breakable"])
def test_outputs_carry_no_grad_fn_without_no_grad(path):
    """The caller forgot torch.no_grad(): capture and replay run without autograd anyway."""
    model = StructModel()
    assert model.embed.requires_grad
    runner = decode_runner(model, path, max_bs=4)
    runner.capture()
    for bs in (3, 4):
        out = runner.forward(decode_batch(bs))
        assert out.grad_fn is None and not out.requires_grad, path
    assert torch.is_grad_enabled()


def test_freeze_gc_leaves_what_the_caller_froze_frozen():
    assert gc.get_freeze_count() == 0, "another test left objects frozen"
    keep = [object() for _ in range(10)]
    gc.freeze()

    def still_frozen(frozen: int) -> bool:
        # Frozen objects freed by reference counting leave the count, so allow a few;
        # nothing new is frozen (<=) and nothing is thawed (an unfreeze() gives 0).
        return frozen - frozen // 100 <= gc.get_freeze_count() <= frozen

    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with freeze_gc():
            assert not gc.isenabled()  # collections are held off instead
            assert still_frozen(frozen)
        assert still_frozen(frozen) and gc.isenabled()
        runner = decode_runner(ToyModel(), "recording", max_bs=4)
        runner.capture()
        assert still_frozen(frozen)
    finally:
        gc.unfreeze()
    del keep


def test_freeze_gc_freezes_and_thaws_when_nothing_was_frozen():
    assert gc.get_freeze_count() == 0
    with freeze_gc():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0 and gc.isenabled()
    gc.disable()
    try:
        gc.freeze()
        with freeze_gc():
            pass
        assert not gc.isenabled()  # the caller's disabled state is kept
    finally:
        gc.unfreeze()
        gc.enable()
    with freeze_gc(enable_cudagraph_gc=True):
        assert gc.get_freeze_count() == 0 and gc.isenabled()


@pytest.mark.parametrize(
    "bad,expected",
    [
        (RecordingBackend, "RecordingBackend is a backend class, not an instance"),
        (3, r"backend=3 \(int\) is not accepted"),
        (["full"], r"backend=\['full'\] \(list\) is not accepted"),
    ],
)
def test_backend_argument_of_another_type_is_refused(bad, expected):
    with pytest.raises(TypeError, match=expected) as info:
        DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "disabled"}}, device="cpu", backend=bad)
    assert "backend name" in str(info.value) and "instance" in str(info.value)


class ScaledToy(ToyModel):
    def compute_logits(self, hidden, batch):
        return 2.0 * super().compute_logits(hidden, batch)


def test_a_backend_instance_another_runner_owns_is_refused_naming_both():
    backend = RecordingBackend("cpu")
    first = DecodeCudaGraphRunner(ToyModel(), {"decode": {"bs": [4]}}, device="cpu", backend=backend)
    first.capture()
    expected = first.forward(decode_batch(3)).clone()
    for phase, cls in (("decode", DecodeCudaGraphRunner), ("prefill", PrefillCudaGraphRunner)):
        with pytest.raises(ValueError, match="already belongs to") as info:
            cls(ScaledToy(), {phase: {"bs": [4]}}, device="cpu", backend=backend)
        text = str(info.value)
        assert f"DecodeCudaGraphRunner(decode, model ToyModel) at {id(first):#x}" in text, text
        assert f"{cls.__name__}({phase}, model ScaledToy)" in text and "its own instance" in text
    assert backend.capture_plan.model is first.model  # untouched: the first runner replays its own model
    torch.testing.assert_close(first.forward(decode_batch(3)), expected, rtol=0, atol=0)
    # Once the first runner dropped its graphs another may take the instance; the first
    # is then refused at its next capture.
    first.cleanup()
    second = DecodeCudaGraphRunner(ScaledToy(), {"decode": {"bs": [4]}}, device="cpu", backend=backend)
    second.capture()
    with pytest.raises(
        ValueError, match=f"already belongs to DecodeCudaGraphRunner.decode, model ScaledToy. at {id(second):#x}"
    ):
        first.capture()
    torch.testing.assert_close(second.forward(decode_batch(3)), 2.0 * expected)


@pytest.mark.parametrize(
    "mode,width,expected",
    [
        ("decode", 1, ForwardMode.DECODE),
        ("DECODE", 1, ForwardMode.DECODE),
        ("target_verify", 3, ForwardMode.TARGET_VERIFY),
        (ForwardMode.TARGET_VERIFY, 2, ForwardMode.TARGET_VERIFY),
    ],
)
def test_mode_accepts_strings(mode, width, expected):
    runner = DecodeCudaGraphRunner(
        ToyModel(), None, device="cpu", backend="disabled", mode=mode, num_tokens_per_req=width
    )
    assert runner.mode is expected
    assert runner.forward(decode_batch(2, width=width)).shape == (2 * width, VOCAB)


@pytest.mark.parametrize(
    "mode,error,match",
    [
        ("bogus", ValueError, r"mode='bogus' is not a forward mode; accepted: .*'decode'"),
        ("extend", ValueError, "DECODE, TARGET_VERIFY or DLLM_EXTEND"),
        (1, TypeError, r"mode=1 \(int\) is not accepted"),
    ],
)
def test_bad_mode_is_a_clear_error(mode, error, match):
    with pytest.raises(error, match=match):
        DecodeCudaGraphRunner(ToyModel(), None, device="cpu", backend="disabled", mode=mode)


class NoParams:
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return torch.zeros(batch.num_tokens, HIDDEN)

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return hidden.float()


class BuffersOnly(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("table", torch.zeros(VOCAB, HIDDEN, dtype=torch.float64))


@pytest.mark.parametrize("model", [NoParams(), torch.nn.Identity()], ids=["plain", "module"])
def test_model_without_parameters_requires_device(model):
    with pytest.raises(ValueError, match=r"no parameters or buffers; pass device="):
        DecodeCudaGraphRunner(model, None, backend="disabled")
    runner = DecodeCudaGraphRunner(model, None, backend="disabled", device="cpu")
    assert runner.device == torch.device("cpu")


def test_model_with_only_buffers_gives_their_device():
    assert DecodeCudaGraphRunner(BuffersOnly(), None, backend="disabled").device == torch.device("cpu")


@pytest.mark.parametrize("runner_cls", [DecodeCudaGraphRunner, PrefillCudaGraphRunner])
def test_disabled_backend_builds_no_static_buffers(runner_cls):
    runner = runner_cls(ToyModel(), None, device="cpu", backend="disabled")
    assert runner.is_disabled
    assert list(runner.buffers) == [] and runner.buffers.nbytes() == 0
    runner.capture()
    batch = decode_batch(3) if runner_cls is DecodeCudaGraphRunner else extend_batch([3, 2])
    assert not runner.can_run(batch)
    torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    runner.cleanup()
    graphs = runner_cls(
        ToyModel(),
        {runner_cls.phase: {"max_bs": 8}},
        device="cpu",
        backend=RecordingBackend("cpu", phase=runner_cls.phase),
    )
    assert graphs.buffers.nbytes() > 0  # the control: a graph backend has them


def test_breakable_walks_op_arguments_and_bridge_outputs_with_the_same_walker():
    bk = pytest.importorskip("cuda_graph_runner_breakable.backend")
    from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule

    backend = bk.BreakableCudaGraphBackend(
        "cpu", phase="decode", device_module=FakeGraphDeviceModule(), memory_pool="pool-0", weak_ref_args=True
    )
    t = torch.ones(2)
    arg = {"x": Pair(t, t), "r": Result(t, {"s": [t]})}
    frozen = backend.freeze(arg)
    assert frozen is not arg and frozen["r"].extra["s"] is not arg["r"].extra["s"]  # containers rebuilt
    assert type(frozen["x"]) is Pair and frozen["x"].logits is t  # CPU tensors are kept, not aliased
    assert bk._has_tensor(Result(None, {"s": t})) and not bk._has_tensor(Result(None, {"n": 1}))

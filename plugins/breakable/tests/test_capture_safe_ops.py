"""Backend ``breakable`` and marked ops declared capture-safe per forward mode (CPU).

* Structure (recording fake graph API): with the reference model a decode or
  target-verify shape is one segment (the attention recorded inside it), a prefill shape
  one segment per attention plus one; ``inline_capture_safe_ops=False`` (or its
  environment variable) restores a break per attention; an op not declared safe for the
  mode still breaks; a predicate decides per captured shape.
* Numbers (emulated graphs, which replay what they recorded): decode and target-verify
  replay equals eager on captured and padded sizes over several steps, prefill too; a
  model mixing a safe and an unsafe op replays equal to eager in both phases.
* The promise is checked: an op declared capture-safe that reads a host value of the
  batch while it is recorded raises ``CudaGraphHostValueError`` at capture.
"""

from __future__ import annotations

from typing import Any, List

import pytest
import torch

from cuda_graph_runner.backend import (
    CudaGraphHostValueError,
    ForwardBatch,
    ForwardMode,
    ShapeKey,
    eager_op,
    get_forward_batch,
)
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.workload import (
    PRESETS,
    DecodeCudaGraphRunner,
    GreedySession,
    PrefillCudaGraphRunner,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    make_decode_batch,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner_breakable.backend import ENV_INLINE_SAFE_OPS, BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

ATTN = "reference_llama_attention"
CONTEXT = 48
# Graph (padded shape) against eager (live shape): the same math in another summation order.
REF_TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)
VOCAB = 16
HIDDEN = 8


def breakable(dm: Any, phase: str, **kwargs: Any) -> BreakableCudaGraphBackend:
    return BreakableCudaGraphBackend("cpu", phase=phase, device_module=dm, memory_pool="pool-0", **kwargs)


def decode_runner(model: Any, backend: Any, max_bs: int = 4, **kwargs: Any) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False, **kwargs
    )


def prefill_runner(model: Any, backend: Any, max_bs: int = 64) -> PrefillCudaGraphRunner:
    return PrefillCudaGraphRunner(
        model, {"prefill": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False
    )


@pytest.fixture(scope="module")
def reference():
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32)
    model.create_kv_cache(num_slots=4096, max_reqs=32, max_context_len=CONTEXT)
    return model


# -- structure: segments and breaks per phase (recording fake) --------------------------------


@pytest.mark.parametrize("mode,width", [("decode", 1), ("target_verify", 3)])
def test_reference_decode_like_shapes_are_one_segment(reference, mode, width):
    fake = FakeGraphDeviceModule()
    backend = breakable(fake, "decode")
    runner = decode_runner(reference, backend, mode=mode, num_tokens_per_req=width)
    layers = reference.config.num_hidden_layers
    with torch.no_grad():
        runner.capture(sizes=[4, 1])
        assert len(backend.captured_keys) == 2
        for key in backend.captured_keys:
            graph = backend.graph(key)
            assert len(graph.segments) == 1 and graph.breaks == [], key
            assert graph.inlined == [ATTN] * layers
        # A replay is one graph launch, nothing eager in between.
        start = len(fake.events)
        runner.forward(_decode_like(reference, 3, width))
    seg = backend.graph(runner.make_key(4)).segments[0].id
    assert fake.events[start:] == [("replay", seg)]
    runner.cleanup()


def _decode_like(model: Any, bs: int, width: int) -> ForwardBatch:
    cache = model.kv_cache
    rows = [cache.alloc_request() for _ in range(bs)]
    prompts = make_dummy_prompts(bs, [3 + i for i in range(bs)], model.config.vocab_size, seed=bs)
    with torch.no_grad():
        eager_logits_fn(model)(make_extend_batch(cache, prompts, rows=rows))
    return make_decode_batch(cache, rows, None, [[1 + j for j in range(width)] if width > 1 else 1 for _ in rows])


def test_reference_prefill_still_breaks_at_every_attention(reference):
    fake = FakeGraphDeviceModule()
    backend = breakable(fake, "prefill")
    runner = prefill_runner(reference, backend)
    layers = reference.config.num_hidden_layers
    with torch.no_grad():
        runner.capture(sizes=[64, 16])
    for key in backend.captured_keys:
        graph = backend.graph(key)
        assert len(graph.segments) == layers + 1 and graph.op_names == [ATTN] * layers, key
        assert graph.inlined == []
    runner.cleanup()


def test_inlining_off_breaks_decode_at_every_attention(reference, monkeypatch):
    layers = reference.config.num_hidden_layers
    for make in (
        lambda fake: breakable(fake, "decode", inline_capture_safe_ops=False),
        lambda fake: (monkeypatch.setenv(ENV_INLINE_SAFE_OPS, "0"), breakable(fake, "decode"))[1],
    ):
        fake = FakeGraphDeviceModule()
        backend = make(fake)
        assert backend.inline_capture_safe_ops is False
        runner = decode_runner(reference, backend)
        with torch.no_grad():
            runner.capture(sizes=[2])
        for key in backend.captured_keys:
            graph = backend.graph(key)
            assert len(graph.segments) == layers + 1 and graph.op_names == [ATTN] * layers and graph.inlined == []
        runner.cleanup()
    monkeypatch.setenv(ENV_INLINE_SAFE_OPS, "1")
    assert breakable(FakeGraphDeviceModule(), "decode").inline_capture_safe_ops is True
    monkeypatch.delenv(ENV_INLINE_SAFE_OPS)
    assert breakable(FakeGraphDeviceModule(), "decode").inline_capture_safe_ops is True  # the default


# -- a toy model: one op safe in decode only, one never safe ------------------------------------

SINK: List[Any] = []


def _lens(batch: ForwardBatch) -> List[int]:
    if batch.forward_mode is ForwardMode.EXTEND:
        return list(batch.extend_seq_lens_cpu)
    return [batch.num_tokens_per_req] * batch.batch_size


@eager_op("test_capture_safe_seq_scale", capture_safe="decode")
def seq_scale(output: torch.Tensor, x: torch.Tensor) -> None:
    """``x * (1 + seq_len / 100)`` per token: device metadata in decode, host lengths otherwise."""
    batch = get_forward_batch()
    SINK.append(("seq_scale", batch.forward_mode.value))
    if batch.forward_mode.is_decode_like():
        seq = batch.seq_lens.to(x.dtype).repeat_interleave(batch.num_tokens_per_req)
        output.copy_(x * (1 + seq[:, None] / 100))
        return
    start = 0
    for n, s in zip(batch.extend_seq_lens_cpu, batch.seq_lens_cpu):
        output[start : start + n] = x[start : start + n] * (1 + s / 100)
        start += n
    output[start:].zero_()


@eager_op("test_capture_safe_request_mix")
def request_mix(output: torch.Tensor, x: torch.Tensor) -> None:
    """Per-request prefix sums over the live request boundaries (host structure): never safe."""
    SINK.append(("request_mix", get_forward_batch().forward_mode.value))
    start = 0
    for i, n in enumerate(_lens(get_forward_batch())):
        output[start : start + n] = x[start : start + n].cumsum(0) + (i + 1)
        start += n
    output[start:].zero_()


@eager_op("test_capture_safe_reads_host_lengths", capture_safe=("decode",))
def reads_host_lengths(output: torch.Tensor, x: torch.Tensor) -> None:
    """Breaks its promise: reads ``seq_lens_cpu`` (a host value) in decode."""
    lens = get_forward_batch().seq_lens_cpu
    output.copy_(x * float(len(lens)))


@eager_op(
    "test_capture_safe_small_batches", capture_safe=lambda b: b.forward_mode.is_decode_like() and b.batch_size <= 2
)
def small_batches(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(
        x * 2
        + get_forward_batch().seq_lens.to(x.dtype).repeat_interleave(get_forward_batch().num_tokens_per_req)[:, None]
    )


class ToyModel(torch.nn.Module):
    """embedding -> op A -> tanh -> op B -> head. Metadata read inside the ops only."""

    def __init__(self, first: Any = seq_scale, second: Any = request_mix) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.embed = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=g), requires_grad=False)
        self.head = torch.nn.Parameter(torch.randn(HIDDEN, VOCAB, generator=g), requires_grad=False)
        self.first, self.second = first, second

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = self.embed[batch.input_ids] + 0.01 * batch.positions[:, None].float()
        out = torch.empty_like(h)
        self.first(out, h)
        h = torch.tanh(out) + h
        out2 = torch.empty_like(h)
        self.second(out2, h)
        return out2 * 0.5 + h

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.EXTEND:
            hidden = hidden[torch.cumsum(batch.extend_seq_lens.long(), 0) - 1]
        return (hidden @ self.head).float()


def toy_decode(bs: int, *, width: int = 1, offset: int = 0) -> ForwardBatch:
    seq = torch.arange(bs, dtype=torch.int32) * 3 + 5 + offset
    tokens = bs * width
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    return ForwardBatch(
        forward_mode=mode,
        input_ids=(torch.arange(tokens) * 7 + offset) % VOCAB,
        positions=torch.repeat_interleave(seq.long() - width, width) + torch.arange(width).repeat(bs),
        out_cache_loc=torch.arange(tokens) + 10,
        req_pool_indices=torch.arange(bs) + 1,
        seq_lens=seq,
        seq_lens_cpu=seq.tolist(),
        num_tokens_per_req=width,
    )


def toy_extend(lens: List[int], *, offset: int = 0) -> ForwardBatch:
    return synthetic_extend_batch(lens, token_stride=5, token_offset=offset, vocab=VOCAB, first_slot=50)


def test_an_op_not_declared_safe_still_breaks_in_decode():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake, "decode")
    runner = decode_runner(ToyModel(), backend, max_bs=4)
    with torch.no_grad():
        runner.capture()
        for key in backend.captured_keys:
            graph = backend.graph(key)
            assert graph.inlined == ["test_capture_safe_seq_scale"]
            assert graph.op_names == ["test_capture_safe_request_mix"] and len(graph.segments) == 2
        SINK.clear()
        start = len(fake.events)
        runner.forward(toy_decode(3))
    segs = [g.id for g in backend.graph(ShapeKey(4, runner.make_key(4).variant)).segments]
    # The safe op replays inside segment 0 (no Python call); only the unsafe one runs eagerly.
    assert fake.events[start:] == [("replay", segs[0]), ("replay", segs[1])]
    assert SINK == [("request_mix", "decode")]
    runner.cleanup()


def test_an_op_safe_for_decode_only_breaks_in_target_verify_and_prefill():
    fake = FakeGraphDeviceModule()
    verify = breakable(fake, "decode")
    runner = decode_runner(ToyModel(), verify, max_bs=2, mode="target_verify", num_tokens_per_req=2)
    with torch.no_grad():
        runner.capture()
    for key in verify.captured_keys:
        graph = verify.graph(key)
        assert graph.inlined == [] and len(graph.segments) == 3
    runner.cleanup()
    prefill = breakable(fake, "prefill")
    runner = prefill_runner(ToyModel(), prefill, max_bs=8)
    with torch.no_grad():
        runner.capture()
    for key in prefill.captured_keys:
        assert prefill.graph(key).inlined == [] and len(prefill.graph(key).segments) == 3
    runner.cleanup()


def test_a_predicate_decides_per_captured_shape():
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, "decode")
    runner = decode_runner(ToyModel(first=small_batches), backend, max_bs=4)
    with torch.no_grad():
        runner.capture()
        variant = runner.make_key(1).variant
        assert backend.graph(ShapeKey(4, variant)).op_names == [
            "test_capture_safe_small_batches",
            "test_capture_safe_request_mix",
        ]
        for size in (1, 2):
            assert backend.graph(ShapeKey(size, variant)).inlined == ["test_capture_safe_small_batches"]
        for bs in (1, 2, 3, 4):
            batch = toy_decode(bs, offset=bs)
            torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    runner.cleanup()


def test_a_safe_op_reading_a_host_value_is_refused_at_capture():
    fake = FakeGraphDeviceModule()
    runner = decode_runner(ToyModel(first=reads_host_lengths), breakable(fake, "decode"), max_bs=2)
    with pytest.raises(CudaGraphHostValueError, match="seq_lens_cpu") as info:
        with torch.no_grad():
            runner.capture()
    assert info.value.phase == "decode" and fake.capturing is None
    # Where it is not declared safe (prefill) it breaks, and reads the live batch freely.
    prefill = breakable(FakeGraphDeviceModule(), "prefill")
    runner = prefill_runner(ToyModel(first=reads_host_lengths), prefill, max_bs=8)
    with torch.no_grad():
        runner.capture()
    assert prefill.graph(prefill.captured_keys[0]).op_names[0] == "test_capture_safe_reads_host_lengths"
    runner.cleanup()


# -- numbers: replay equals eager (emulated graphs) ----------------------------------------------


@pytest.mark.parametrize("width", [1, 2])
def test_emulated_toy_decode_matches_eager_on_captured_and_padded_sizes(width):
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, "decode")
    mode = "decode" if width == 1 else "target_verify"
    runner = decode_runner(ToyModel(), backend, max_bs=8, mode=mode, num_tokens_per_req=width)
    with torch.no_grad():
        runner.capture()
        for step, bs in enumerate((1, 2, 3, 4, 5, 7, 8, 3)):
            batch = toy_decode(bs, width=width, offset=step)
            assert runner.can_run(batch)
            torch.testing.assert_close(
                runner.forward(batch), runner.eager_forward(batch), msg=lambda m: f"bs {bs}: {m}"
            )
    assert backend.num_replays == 8
    runner.cleanup()


def test_emulated_toy_prefill_matches_eager():
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, "prefill")
    runner = prefill_runner(ToyModel(), backend, max_bs=16)
    with torch.no_grad():
        runner.capture()
        for i, lens in enumerate([[4], [1, 3], [2, 5], [8], [3, 5, 7], [16], [9, 7]]):
            batch = toy_extend(lens, offset=i)
            assert runner.can_run(batch)
            torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch), msg=lambda m: f"{lens}: {m}")
    runner.cleanup()


@pytest.mark.parametrize("width,inline", [(1, True), (2, True), (1, False)])
def test_emulated_reference_decode_matches_eager_on_captured_and_padded_sizes(reference, width, inline):
    cache = reference.kv_cache
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, "decode", inline_capture_safe_ops=inline)
    mode = "decode" if width == 1 else "target_verify"
    runner = decode_runner(reference, backend, max_bs=4, mode=mode, num_tokens_per_req=width)
    eager = eager_logits_fn(reference)
    V = reference.config.vocab_size
    with torch.no_grad():
        runner.capture(sizes=[4, 1])
        breaks = [] if inline else [ATTN] * reference.config.num_hidden_layers
        assert all(backend.graph(k).op_names == breaks for k in backend.captured_keys)
        for bs in (1, 3):  # 3 pads to 4
            session = GreedySession(reference, cache)
            session.prefill(make_dummy_prompts(bs, [3 + 4 * i for i in range(bs)], V, seed=10 + bs))
            last = [t[-1] for t in session.tokens]
            for step in range(2):
                tokens = [[t] + [(t + j) % V for j in range(1, width)] for t in last] if width > 1 else last
                batch = make_decode_batch(cache, session.rows, None, tokens)
                slots = batch.out_cache_loc
                expected = eager(batch).clone()
                kv_expected = [buf[slots].clone() for buf in cache.k_buffers + cache.v_buffers]
                for buf in cache.k_buffers + cache.v_buffers:
                    buf[slots] = 0  # the graph must write this step's K/V again, at the live slots
                assert runner.can_run(batch)
                got = runner.forward(batch)
                torch.testing.assert_close(got, expected, **REF_TOL, msg=lambda m: f"bs {bs} step {step}: {m}")
                for g, e in zip([buf[slots] for buf in cache.k_buffers + cache.v_buffers], kv_expected):
                    torch.testing.assert_close(g, e, **REF_TOL)
                last = got.view(-1, width, V)[:bs, -1].argmax(-1).tolist()
            session.close()
    assert backend.num_replays == 4
    runner.cleanup()

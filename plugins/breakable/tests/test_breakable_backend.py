"""Backend ``breakable`` on the CPU.

* With the core's recording fake graph API: the capture protocol (segments end at each
  marked op, the op runs once, every segment in one pool) and the replay order
  (segment, op on the live batch, segment, ...).
* With the plugin's emulated graphs (a capture records aten ops, a replay re-runs them on
  the same tensors): graph output equals eager for prefill and decode, including the
  reference model, and a stale-metadata control where ``full`` freezes the op.
* Errors: host tensors given to a marked op, nested capture, failures mid-capture.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any, List, Optional

import pytest
import torch
from breakable_mix_model import MixModel as SharedMixModel
from breakable_mix_model import request_lens

from cuda_graph_runner.backend import ForwardBatch, ShapeKey, eager_op, forward_context, get_forward_batch
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.toy_model import decode_batch
from cuda_graph_runner.testing.workload import PRESETS, DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner_breakable.backend import BreakableCaptureError, BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule, HostSyncInCaptureError

VOCAB = 16
HIDDEN = 8

# Where the marked ops below report ("op", request lengths); a test points it at a list.
SINK: List[Optional[list]] = [None]


@eager_op("test_breakable_cpu_request_mix")
def request_mix(output: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Per-request prefix sums: the result depends on the live request boundaries."""
    lens = request_lens(get_forward_batch())
    if SINK[0] is not None:
        SINK[0].append(("op", tuple(lens)))
    start = 0
    for i, n in enumerate(lens):
        output[start : start + n] = x[start : start + n].cumsum(0) * scale + (i + 1)
        start += n
    output[start:].zero_()  # padding tokens belong to no request


@eager_op("test_breakable_cpu_scaled_by_requests", mutates_args=())
def scaled_by_requests(x: torch.Tensor) -> torch.Tensor:
    """Returns a new tensor (a 'bridge' output allocated between segments)."""
    return x * float(len(request_lens(get_forward_batch())))


@eager_op("test_breakable_cpu_inner")
def inner_op(output: torch.Tensor, x: torch.Tensor) -> None:
    output.copy_(x * 2)


@eager_op("test_breakable_cpu_outer")
def outer_op(output: torch.Tensor, x: torch.Tensor) -> None:
    inner_op(output, x)  # a marked op inside another: one eager region
    output.add_(1)


def MixModel(returning: bool = False) -> SharedMixModel:  # noqa: N802 - used as the model class
    """Two marked ops per forward, token-axis inputs only inside the graph (the KV slot too)."""
    return SharedMixModel(
        request_mix, scaled_by_requests, vocab=VOCAB, hidden=HIDDEN, slot_term=True, returning=returning
    )


def extend_batch(lens, prefix=None, *, offset: int = 1) -> ForwardBatch:
    return synthetic_extend_batch(lens, prefix, token_stride=5, token_offset=offset, vocab=VOCAB, first_slot=50)


@pytest.fixture
def sink():
    events: list = []
    SINK[0] = events
    yield events
    SINK[0] = None


def breakable(dm: Any, phase: str = "prefill", device: str = "cpu", **kwargs: Any) -> BreakableCudaGraphBackend:
    return BreakableCudaGraphBackend(device, phase=phase, device_module=dm, memory_pool="pool-0", **kwargs)


def prefill_runner(model: Any, backend: Any, max_bs: int = 8, **kwargs: Any) -> PrefillCudaGraphRunner:
    return PrefillCudaGraphRunner(
        model, {"prefill": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False, **kwargs
    )


# -- capture protocol and replay order (recording fake) --------------------------------------


def test_capture_ends_a_segment_at_each_marked_op(sink):
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    runner = prefill_runner(MixModel(), backend, max_bs=8)
    sink_start = len(fake.events)
    SINK[0] = fake.events
    with torch.no_grad():
        runner.capture()
    assert backend.captured_keys == [ShapeKey(8, "extend"), ShapeKey(4, "extend")]
    for key in backend.captured_keys:
        graph = backend.graph(key)
        assert len(graph.segments) == 3 and graph.op_names == ["test_breakable_cpu_request_mix"] * 2
        ids = [g.id for g in graph.segments]
        first = next(i for i, e in enumerate(fake.events) if e[:2] == ("capture_begin", ids[0]))
        names = [e[0] if e[0] != "op" else "op" for e in fake.events[first : first + 8]]
        assert names == [
            "capture_begin",
            "capture_end",
            "op",
            "capture_begin",
            "capture_end",
            "op",
            "capture_begin",
            "capture_end",
        ]
        # The op ran once at capture, on the capture's dummy requests.
        assert fake.events[first + 2] == ("op", tuple(runner.capture_request_lens(key.size)))
        # Two warm-ups before the capture ran the ops eagerly, outside any capture.
        before = [e for e in fake.events[sink_start:first] if e[0] == "op"]
        assert len(before) >= 4
    begins = [e for e in fake.events if e[0] == "capture_begin"]
    assert len(begins) == 6 and {e[2] for e in begins} == {"pool-0"}  # one shared pool


def test_replay_runs_segment_op_segment_on_the_live_batch(sink):
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    runner = prefill_runner(MixModel(), backend, max_bs=8)
    with torch.no_grad():
        runner.capture()
        seg = [g.id for g in backend.graph(ShapeKey(8, "extend")).segments]
        for lens in ([2, 3], [1, 4], [5], [3, 1, 1, 2]):
            SINK[0] = fake.events
            start = len(fake.events)
            runner.forward(extend_batch(lens))
            assert fake.events[start:] == [
                ("replay", seg[0]),
                ("op", tuple(lens)),
                ("replay", seg[1]),
                ("op", tuple(lens)),
                ("replay", seg[2]),
            ]
    assert backend.num_replays == 4


def test_marked_ops_run_eagerly_outside_capture(sink):
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    runner = prefill_runner(MixModel(), backend, max_bs=4)
    with torch.no_grad():
        runner.capture()
        n, m = len(fake.events), len(sink)
        runner.eager_forward(extend_batch([3, 1]))
    assert [e[0] for e in fake.events[n:]] == []  # no capture, no replay
    assert sink[m:] == [("op", (3, 1))] * 2


def test_a_marked_op_inside_another_is_one_eager_region():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    x = torch.ones(4)
    out = torch.zeros(4)

    def forward_fn():
        y = x + 1
        outer_op(out, y)
        return out * 3

    with backend.capture_session(None):
        backend.capture_one(ShapeKey(4), forward_fn)
    graph = backend.graph(ShapeKey(4))
    assert graph.op_names == ["test_breakable_cpu_outer"] and len(graph.segments) == 2


def test_cleanup_resets_every_segment_and_allows_recapture():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    runner = prefill_runner(MixModel(), backend, max_bs=8)
    with torch.no_grad():
        runner.capture()
        runner.cleanup()
        assert fake.names().count("reset") == 6 and not backend.captured_keys
        runner.capture()
    assert runner.can_run(extend_batch([4, 4]))


def test_replay_and_capture_errors_are_named():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    with pytest.raises(KeyError, match="no graph captured"):
        backend.replay(ShapeKey(4), None)
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(4), lambda: torch.zeros(1))
        with pytest.raises(ValueError, match="already captured"):
            backend.capture_one(ShapeKey(4), lambda: torch.zeros(1))


# -- graph output equals eager (emulated graphs) ---------------------------------------------


@pytest.mark.parametrize("returning", [False, True])
def test_emulated_breakable_prefill_matches_eager_on_every_layout(returning):
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm)
    runner = prefill_runner(MixModel(returning=returning), backend, max_bs=32)
    layouts = [[4], [1, 3], [2, 2, 4], [8], [3, 5], [16], [5, 11], [1, 2, 3, 4, 6], [7, 9, 10], [32], [20, 12]]
    with torch.no_grad():
        runner.capture()
        for i, lens in enumerate(layouts):
            batch = extend_batch(lens, offset=i)
            assert runner.can_run(batch), lens
            got = runner.forward(batch)
            torch.testing.assert_close(got, runner.eager_forward(batch), msg=lambda m: f"{lens}: {m}")
    assert backend.num_replays == len(layouts)
    if returning:
        brk = backend.graph(ShapeKey(32, "extend")).breaks[1]
        assert brk.op.name == "test_breakable_cpu_scaled_by_requests" and isinstance(brk.returned, torch.Tensor)


def test_emulated_full_prefill_of_a_model_without_a_replay_hook_is_refused():
    """The control: frozen into a whole-forward graph, the op would replay the capture's
    request layout, so prefill ``full`` refuses a model whose attention has no replay
    hook (with or without the host-value guard) before anything is captured."""
    from cuda_graph_runner.backend import CudaGraphConfigError

    full = pytest.importorskip("cuda_graph_runner_full.backend")
    dm = EmulatedGraphDeviceModule()
    backend = full.FullCudaGraphBackend("cpu", phase="prefill", device_module=dm, memory_pool="pool-0")
    for guard in (True, False):
        with pytest.raises(CudaGraphConfigError, match="init_forward_metadata_replay"):
            PrefillCudaGraphRunner(
                MixModel(),
                {"prefill": {"max_bs": 8, "host_value_guard": guard}},
                device="cpu",
                backend=backend,
                show_progress=False,
            )


def test_emulated_breakable_decode_matches_eager():
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, phase="decode")
    runner = DecodeCudaGraphRunner(
        MixModel(), {"decode": {"max_bs": 8}}, device="cpu", backend=backend, show_progress=False
    )
    with torch.no_grad():
        runner.capture()
        for bs in (1, 3, 5, 8):
            batch = decode_batch(bs, offset=bs)
            assert runner.can_run(batch)
            torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
    assert backend.num_replays == 4


def test_emulated_runner_that_skips_a_graph_input_is_caught():
    """Sanity check of the emulator: replays read the static buffers, not the live batch."""
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm)
    runner = prefill_runner(MixModel(), backend, max_bs=8)
    with torch.no_grad():
        runner.capture()
        batch = extend_batch([3, 5])
        key, static = runner.replay_prepare(batch)
        runner.buffers["positions"].zero_()  # as if the runner forgot to copy positions
        with forward_context(static):
            hidden = backend.replay(key, static)[:8].clone()
        with forward_context(batch):
            expected = runner.model.forward(batch)
    assert not torch.allclose(hidden, expected)


# -- the reference model (emulated graphs) -----------------------------------------------------

# Graph (padded shape) against eager (live shape): the same math in another summation order.
REF_TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=48)


@pytest.fixture(scope="module")
def reference():
    from cuda_graph_runner.testing.workload import ReferenceLlamaForCausalLM

    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32)
    model.create_kv_cache(num_slots=4096, max_reqs=32, max_context_len=48)
    return model


def test_emulated_reference_prefill_matches_eager_with_prefixes(reference):
    from cuda_graph_runner.testing.workload import eager_logits_fn, make_dummy_prompts, make_extend_batch

    cache = reference.kv_cache
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm)
    runner = prefill_runner(reference, backend, max_bs=64)
    eager = eager_logits_fn(reference)
    V = reference.config.vocab_size
    assert runner.capture_request_lens(64) == [48, 16]  # dummy requests fit the context
    with torch.no_grad():
        runner.capture()
        first = make_extend_batch(cache, make_dummy_prompts(3, [5, 9, 2], V, seed=1))  # 16: on a bucket
        rows = first.req_pool_indices.tolist()
        new_row = cache.alloc_request()
        # Cached prefixes next to a fresh request, 37 tokens (off the buckets: 48).
        second = make_extend_batch(cache, make_dummy_prompts(4, [11, 4, 20, 2], V, seed=2), rows=rows + [new_row])
        assert second.extend_prefix_lens_cpu == [5, 9, 2, 0]
        third = make_extend_batch(cache, make_dummy_prompts(2, [30, 34], V, seed=3))  # 64: the maximum
        for batch in (first, second, third):
            expected = eager(batch)
            assert runner.can_run(batch)
            torch.testing.assert_close(runner.forward(batch), expected, **REF_TOL)
    assert backend.num_replays == 3
    graph = backend.graph(ShapeKey(64, "extend"))
    assert graph.op_names == ["reference_llama_attention"] * reference.config.num_hidden_layers


def test_emulated_reference_decode_matches_eager(reference):
    from cuda_graph_runner.testing.workload import (
        GreedySession,
        eager_logits_fn,
        make_decode_batch,
        make_dummy_prompts,
    )

    cache = reference.kv_cache
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm, phase="decode")
    runner = DecodeCudaGraphRunner(
        reference, {"decode": {"max_bs": 4}}, device="cpu", backend=backend, show_progress=False
    )
    with torch.no_grad():
        runner.capture()
        session = GreedySession(reference, cache)
        session.prefill(make_dummy_prompts(3, [4, 7, 2], reference.config.vocab_size, seed=4))
        for _ in range(3):
            batch = make_decode_batch(cache, session.rows, None, [t[-1] for t in session.tokens])
            expected = eager_logits_fn(reference)(batch)
            assert runner.can_run(batch)
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, **REF_TOL)
            session._pick(got[:3])
        session.close()


# -- errors -----------------------------------------------------------------------------------


def test_host_tensor_argument_is_refused_with_its_name():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake, device="cuda")  # capturing "on cuda": CPU tensors are host tensors
    out = torch.zeros(4)

    def forward_fn():
        request_mix(out, torch.ones(4), 1.0)
        return out

    batch = extend_batch([4])
    with forward_context(batch), backend.capture_session(None):
        with pytest.raises(BreakableCaptureError, match=r"argument 'output' on cpu.*get_forward_batch"):
            backend.capture_one(ShapeKey(4), forward_fn)
        assert fake.capturing is None  # the open segment was ended
        assert not backend.captured_keys
        request_mix(out, torch.ones(4), 1.0)  # the handler is gone: runs eagerly again


def test_nested_capture_is_refused():
    fake = FakeGraphDeviceModule()
    backend = breakable(fake)
    other = breakable(FakeGraphDeviceModule())

    def forward_fn():
        from cuda_graph_runner_breakable.backend import is_capturing

        if is_capturing():  # not during the warm-ups
            with other.capture_session(None):
                other.capture_one(ShapeKey(2), lambda: torch.zeros(1))
        return torch.zeros(1)

    with backend.capture_session(None):
        with pytest.raises(BreakableCaptureError, match="nested capture"):
            backend.capture_one(ShapeKey(4), forward_fn)
        assert fake.capturing is None and not backend.captured_keys
        backend.capture_one(ShapeKey(4), lambda: torch.zeros(1))  # usable afterwards


def test_capture_while_the_stream_is_already_capturing_is_refused():
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm)
    with backend.capture_session(None), dm.graph(dm.CUDAGraph()):
        with pytest.raises(BreakableCaptureError, match="already capturing"):
            backend.capture_one(ShapeKey(4), lambda: torch.zeros(1))


def test_error_mid_capture_keeps_the_original_error_and_leaves_no_graph():
    dm = EmulatedGraphDeviceModule()
    backend = breakable(dm)
    x = torch.ones(4)
    out = torch.zeros(4)
    calls = {"n": 0}

    def forward_fn():
        request_mix(out, x, 1.0)
        calls["n"] += 1
        if calls["n"] > backend.num_warmups:
            raise ZeroDivisionError("model bug after the op")
        return out

    with forward_context(extend_batch([4])), backend.capture_session(None):
        with pytest.raises(ZeroDivisionError, match="model bug"):
            backend.capture_one(ShapeKey(4), forward_fn)
        assert dm.capturing is None and not backend.captured_keys
        with pytest.raises(HostSyncInCaptureError, match="_local_scalar_dense"):
            backend.capture_one(ShapeKey(8), lambda: torch.tensor(float(x.sum())))
        assert dm.capturing is None and not backend.captured_keys


# -- side streams -----------------------------------------------------------------------------


class StreamedFake(FakeGraphDeviceModule):
    """Fake streams with CUDA's capture rules: waiting on a capturing stream's event joins a
    stream to the capture; a capture cannot end with a joined stream never waited on
    (unjoined); a capturing stream cannot wait on an event from outside the capture."""

    def __init__(self) -> None:
        super().__init__()
        self.capturing_streams: set = set()
        self.unjoined: set = set()
        self.current: Any = None
        module = self

        class Stream:
            def __init__(self, name: str = "side") -> None:
                self.name = name

            def __repr__(self) -> str:
                return self.name

            def record_event(self) -> tuple:
                return ("event", self, self in module.capturing_streams)

            def wait_event(self, event: tuple) -> None:
                _, source, captured = event
                module.events.append(("wait", self.name, source.name))
                if self in module.capturing_streams and not captured:
                    raise RuntimeError("capture isolation: waited on an event recorded outside the capture")
                if captured:
                    if self not in module.capturing_streams:
                        module.capturing_streams.add(self)
                        module.unjoined.add(self)
                    elif source in module.unjoined:
                        module.unjoined.discard(source)

            def wait_stream(self, other: "Stream") -> None:
                self.wait_event(other.record_event())

        self.Stream = Stream

    @contextlib.contextmanager
    def stream(self, stream: Any):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    @contextlib.contextmanager
    def graph(self, cuda_graph: Any, pool: Any = None, stream: Any = None, **kwargs: Any):
        with super().graph(cuda_graph, pool=pool, stream=stream), self.stream(stream):
            self.capturing_streams = {stream}
            self.unjoined = set()
            yield
            if self.unjoined:
                raise RuntimeError(f"capture_end: unjoined streams {self.unjoined}")
            self.capturing_streams = set()

    def is_current_stream_capturing(self) -> bool:
        return self.current in self.capturing_streams


def test_side_stream_forked_in_a_segment_is_joined_before_it_ends():
    fake = StreamedFake()
    backend = breakable(fake)
    capture_stream = fake.Stream("capture")
    side = fake.Stream("side")
    originals = dict(vars(fake.Stream))
    x = torch.ones(4)
    out = torch.zeros(4)

    def forward_fn():
        current = fake.current or capture_stream
        side.wait_stream(current)  # fork: side work overlaps the op
        inner_op(out, x)
        current.wait_stream(side)  # join after the op: already joined by the backend
        return out + 1

    with backend.capture_session(capture_stream), forward_context(extend_batch([4])):
        backend.capture_one(ShapeKey(4), forward_fn)
    waits = [e for e in fake.events if e[0] in ("wait", "capture_begin", "capture_end")]
    first = next(i for i, e in enumerate(waits) if e[0] == "capture_begin")
    assert [e[:3] if e[0] == "wait" else e[0] for e in waits[first:]] == [
        "capture_begin",
        ("wait", "side", "capture"),
        ("wait", "capture", "side"),
        "capture_end",
        "capture_begin",
        "capture_end",
    ]
    assert dict(vars(fake.Stream)) == originals  # the wrapped methods are restored


# -- helpers ----------------------------------------------------------------------------------


def test_weak_ref_args_only_apply_to_cuda_tensors():
    backend = breakable(FakeGraphDeviceModule(), weak_ref_args=True)
    t = torch.ones(3)
    assert backend.freeze(t) is t and backend.freeze((t, 2))[0] is t


def test_weak_ref_args_default_comes_from_the_environment(monkeypatch):
    from cuda_graph_runner_breakable.backend import ENV_WEAK_REF_ARGS

    monkeypatch.delenv(ENV_WEAK_REF_ARGS, raising=False)
    assert breakable(FakeGraphDeviceModule()).weak_ref_args  # on by default
    monkeypatch.setenv(ENV_WEAK_REF_ARGS, "0")
    assert not breakable(FakeGraphDeviceModule()).weak_ref_args
    assert breakable(FakeGraphDeviceModule(), weak_ref_args=True).weak_ref_args


def test_emulated_replay_is_a_named_range_in_a_cpu_profiler_trace(tmp_path):
    from cuda_graph_runner.backend import trace_ranges

    backend = breakable(EmulatedGraphDeviceModule())
    runner = prefill_runner(MixModel(), backend, max_bs=8)
    with torch.no_grad():
        runner.capture()
        batch = extend_batch([3, 5])
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            got = runner.forward(batch)
        torch.testing.assert_close(got, runner.eager_forward(batch))
    path = str(tmp_path / "replay.trace.json")
    prof.export_chrome_trace(path)
    (replay,) = trace_ranges(path, "cuda_graph_runner.replay")
    # Built without the registry: no registry name, so the class names the backend.
    assert replay["name"] == "cuda_graph_runner.replay prefill/BreakableCudaGraphBackend/bs=8 extend"
    # The eager breaks ran inside the range: the marked op's custom-op call lies within it.
    events = json.loads(open(path).read())["traceEvents"]
    start, end = replay["ts"], replay["ts"] + replay["dur"]
    ops = [e for e in events if e.get("name") == "cuda_graph_runner::test_breakable_cpu_request_mix"]
    assert len(ops) == 2 and all(start <= e["ts"] <= end for e in ops)

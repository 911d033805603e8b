"""Backend ``breakable`` on a CUDA device: the mechanism, with small models and marked ops.

* a marked op whose host metadata changes between replays sees the new values at every
  replay (stale metadata replayed from capture is the classic bug);
* an op that returns a fresh tensor (allocated between segments) feeds the next segment
  at a stable address every replay;
* a side stream forked inside a segment is joined before the segment ends;
* ``weak_ref_args=True`` replays the same numbers;
* errors: a host tensor given to a marked op; capture inside another capture.

Run on the device machine: ``python -m pytest plugins/breakable/tests/test_breakable_gpu.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from breakable_mix_model import MixModel as SharedMixModel
from breakable_mix_model import request_lens

from cuda_graph_runner.backend import (
    ForwardBatch,
    ForwardMode,
    ShapeKey,
    eager_op,
    forward_context,
    get_capture_stream,
    get_forward_batch,
)
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner, PrefillCudaGraphRunner

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
VOCAB = 32
HIDDEN = 16


@eager_op("test_breakable_gpu_request_mix")
def request_mix(output: torch.Tensor, x: torch.Tensor, scale: float) -> None:
    """Per-request prefix sums plus the request's index and length: depends on live metadata.

    Builds a device tensor from host lists on purpose: legal only outside a capture.
    """
    lens = request_lens(get_forward_batch())
    start = 0
    for i, n in enumerate(lens):
        bias = torch.tensor([float(i + 1) + 0.1 * n], device=x.device, dtype=x.dtype)
        output[start : start + n] = x[start : start + n].cumsum(0) * scale + bias
        start += n
    output[start:].zero_()


@eager_op("test_breakable_gpu_scaled_by_requests", mutates_args=())
def scaled_by_requests(x: torch.Tensor) -> torch.Tensor:
    """Returns a fresh tensor: the backend must keep the capture's and copy into it."""
    return x * float(len(request_lens(get_forward_batch())))


def MixModel(*, returning: bool = False, side_stream: bool = False) -> SharedMixModel:  # noqa: N802 - the model class
    return SharedMixModel(
        request_mix,
        scaled_by_requests,
        vocab=VOCAB,
        hidden=HIDDEN,
        head_scale=0.3,
        returning=returning,
        side_stream=side_stream,
    )


def extend_batch(lens, *, seed: int = 0) -> ForwardBatch:
    """A live EXTEND batch on the GPU (built from host lists: never call it inside a capture)."""
    g = torch.Generator().manual_seed(seed)
    return synthetic_extend_batch(lens, input_ids=torch.randint(1, VOCAB, (sum(lens),), generator=g), device=DEVICE)


def decode_batch(bs: int, *, seed: int = 0) -> ForwardBatch:
    dev = DEVICE
    g = torch.Generator().manual_seed(seed)
    seq = torch.arange(bs, dtype=torch.int32) + 3
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=torch.randint(1, VOCAB, (bs,), generator=g).to(dev),
        positions=(seq - 1).long().to(dev),
        out_cache_loc=torch.arange(1, bs + 1, device=dev),
        req_pool_indices=torch.arange(1, bs + 1, device=dev),
        seq_lens=seq.to(dev),
        seq_lens_cpu=seq.tolist(),
    )


def device() -> torch.device:
    dev = torch.device(DEVICE)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def make_backend(phase: str = "prefill", **kwargs: Any):
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    return BreakableCudaGraphBackend(str(device()), phase=phase, **kwargs)


def prefill_runner(model: Any, max_bs: int = 64, **kwargs: Any) -> PrefillCudaGraphRunner:
    return PrefillCudaGraphRunner(
        model.to(device()), {"prefill": {"max_bs": max_bs}}, backend=make_backend(**kwargs), show_progress=False
    )


LAYOUTS = [
    [4],
    [1, 3],
    [8],
    [3, 5],
    [2, 2, 2, 2],
    [16],
    [9, 7],
    [1, 1, 14],
    [30],
    [5, 11, 13],
    [20, 12],
    [64],
    [33, 31],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
]


@pytest.mark.parametrize("returning", [False, True])
def test_prefill_replays_see_live_metadata_every_time(returning):
    runner = prefill_runner(MixModel(returning=returning))
    try:
        with torch.no_grad():
            runner.capture()
            for i, lens in enumerate(LAYOUTS):
                batch = extend_batch(lens, seed=i)
                expected = runner.eager_forward(batch).clone()
                assert runner.can_run(batch), lens
                got = runner.forward(batch).clone()
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5, msg=lambda m: f"layout {lens}: {m}")
        assert runner.backend.num_replays == len(LAYOUTS)
        graph = runner.backend.graph(ShapeKey(64, "extend"))
        assert len(graph.segments) == len(graph.breaks) + 1 == (4 if returning else 3)
        if returning:
            bridge = graph.breaks[1].returned
            assert isinstance(bridge, torch.Tensor) and bridge.device == device()
    finally:
        runner.cleanup()


def test_same_bucket_alternating_layouts_never_replays_capture_metadata():
    """Replay the 16-token graph with layouts alternating between two request splits."""
    runner = prefill_runner(MixModel(), max_bs=16)
    try:
        with torch.no_grad():
            runner.capture()
            seen = set()
            for step in range(6):
                lens = [16] if step % 2 else [3, 6, 7]
                batch = extend_batch(lens, seed=step)
                expected = runner.eager_forward(batch).clone()
                got = runner.forward(batch).clone()
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
                seen.add(tuple(lens))
        assert len(seen) == 2 and runner.backend.num_replays == 6
    finally:
        runner.cleanup()


def test_backend_alone_replays_the_op_on_the_live_context():
    """No runner: a static input, one marked op reading lengths from the forward context."""
    backend = make_backend()
    x = torch.randn(12, HIDDEN, device=DEVICE)
    key = ShapeKey(12)

    def forward() -> torch.Tensor:
        h = x * 2
        out = torch.empty_like(h)
        request_mix(out, h, 1.0)
        return out + 1

    capture_batch = extend_batch([12])
    try:
        with torch.no_grad(), backend.capture_session(get_capture_stream(backend.device)):

            def forward_fn():
                with forward_context(capture_batch):
                    return forward()

            backend.capture_one(key, forward_fn)
        for lens in ([12], [5, 7], [1, 1, 10], [6, 6]):
            live = extend_batch(lens)
            x.copy_(torch.randn(12, HIDDEN, device=DEVICE))  # new static input too
            with torch.no_grad(), forward_context(live):
                got = backend.replay(key, live).clone()
                expected = forward()
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        backend.cleanup()


def test_side_stream_forked_in_a_segment_is_joined():
    runner = prefill_runner(MixModel(side_stream=True), max_bs=32)
    originals = {name: vars(torch.cuda.Stream)[name] for name in ("wait_event", "wait_stream")}
    try:
        with torch.no_grad():
            runner.capture()
            for i, lens in enumerate([[4], [3, 9], [32], [10, 10, 10]]):
                batch = extend_batch(lens, seed=i)
                expected = runner.eager_forward(batch).clone()
                got = runner.forward(batch).clone()
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        assert runner.backend.num_replays == 4
        # The wrapped Stream methods are restored after capture.
        assert {name: vars(torch.cuda.Stream)[name] for name in originals} == originals
    finally:
        runner.cleanup()


@pytest.mark.parametrize("weak", [True, False])
def test_weak_ref_args_replay_the_same_numbers(weak):
    runner = prefill_runner(MixModel(), weak_ref_args=weak)
    try:
        with torch.no_grad():
            runner.capture()
            for i, lens in enumerate(LAYOUTS):
                batch = extend_batch(lens, seed=100 + i)
                expected = runner.eager_forward(batch).clone()
                got = runner.forward(batch).clone()
                torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        brk = runner.backend.graph(ShapeKey(64, "extend")).breaks[0]
        # The kept argument aliases the capture's tensor without owning it.
        assert brk.args[0].device == device() and brk.args[0].untyped_storage().nbytes() > 0
    finally:
        runner.cleanup()


def test_decode_matches_eager():
    model = MixModel().to(device())
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": 8}}, backend=make_backend("decode"), show_progress=False
    )
    try:
        with torch.no_grad():
            runner.capture()
            for bs in (1, 2, 3, 5, 8):
                batch = decode_batch(bs, seed=bs)
                expected = runner.eager_forward(batch).clone()
                assert runner.can_run(batch)
                torch.testing.assert_close(runner.forward(batch).clone(), expected, atol=1e-5, rtol=1e-5)
        assert runner.backend.num_replays == 5
    finally:
        runner.cleanup()


def test_host_tensor_argument_is_refused():
    from cuda_graph_runner_breakable.backend import BreakableCaptureError

    backend = make_backend()
    host = torch.randn(4, HIDDEN)  # on the CPU: a replay would read its capture-time values
    batch = extend_batch([4])

    def forward_fn():
        with forward_context(batch):
            out = torch.empty(4, HIDDEN, device=DEVICE)
            request_mix(out, host, 1.0)
            return out

    with torch.no_grad(), backend.capture_session(get_capture_stream(backend.device)):
        with pytest.raises(BreakableCaptureError, match="argument 'x' on cpu"):
            backend.capture_one(ShapeKey(4), forward_fn)
    assert not torch.cuda.is_current_stream_capturing() and not backend.captured_keys
    torch.cuda.synchronize()


def test_capture_inside_another_capture_is_refused():
    from cuda_graph_runner_breakable.backend import BreakableCaptureError

    backend = make_backend()
    outer = torch.cuda.CUDAGraph()
    scratch = torch.zeros(4, device="cuda")
    torch.cuda.synchronize()
    with torch.cuda.graph(outer):
        scratch.add_(1)  # something to record, so the outer graph is not empty
        with pytest.raises(BreakableCaptureError, match="already capturing"):
            backend.capture_one(ShapeKey(4), lambda: torch.zeros(1, device="cuda"))
    assert not backend.captured_keys
    outer.replay()
    torch.cuda.synchronize()
    assert scratch.eq(1).all()
    outer.reset()

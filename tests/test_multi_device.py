"""CPU: runners and backends act on the runner's device whatever device is current; a
capture that runs out of memory says why; the graph-memory estimate API.

The device half uses :class:`FakeGraphDeviceModule` as a two-device module: backends
get ``device="cuda:1"`` while the fake's current device is 0, and every stream, graph,
synchronize and device-guard call it records must name device 1.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.device import device_guard, new_stream, resolve_device, synchronize
from cuda_graph_runner.backend.errors import CudaGraphRunnerError
from cuda_graph_runner.backend.pool import get_capture_stream, get_global_graph_memory_pool
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.runner.capture_report import CaptureOutOfMemoryError, CaptureReport, find_out_of_memory
from cuda_graph_runner.testing.device_check import TinyDecodeModel, check_device_calls, tiny_decode_batch
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule, RecordingBackend


# ----------------------------------------------------------------------------- device helpers
def test_helpers_name_the_device_not_the_current_one():
    fake = FakeGraphDeviceModule(current_device=0)
    assert resolve_device("cuda", fake) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", fake) == torch.device("cuda", 1)
    assert new_stream("cuda:1", fake).device_index == 1
    synchronize("cuda:1", fake)
    with device_guard("cuda:1", fake):
        assert fake.current_device() == 1
    assert fake.current_device() == 0
    assert fake.device_calls == [("Stream", 1), ("synchronize", 1), ("device_guard", 1)]
    # The CPU: nothing to guard or wait on.
    with device_guard("cpu", fake):
        pass
    synchronize("cpu")
    assert new_stream("cpu", fake) is None and len(fake.device_calls) == 3


def test_capture_stream_is_made_on_its_device_and_a_fake_never_shares_the_real_cache():
    fake = FakeGraphDeviceModule(current_device=0)
    s1 = get_capture_stream("cuda:1", fake)
    assert s1.device_index == 1 and get_capture_stream("cuda:1", fake) is s1
    other = FakeGraphDeviceModule(current_device=0)
    assert get_capture_stream("cuda:1", other) is not s1  # keyed by module as well as device
    assert get_global_graph_memory_pool("cuda:1", fake) == fake.pool_handle
    assert get_capture_stream("cpu", fake) is None


# ------------------------------------------------------------------- every backend on cuda:1
def _full(device, module):
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    return FullCudaGraphBackend(device, phase="decode", device_module=module)


def _breakable(device, module):
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend

    return BreakableCudaGraphBackend(device, phase="decode", device_module=module)


def _breakable_own_stream(device, module):
    # capture_session(None): the backend makes its own stream, which must be on its device.
    backend = _breakable(device, module)
    session = backend.capture_session
    backend.capture_session = lambda stream: session(None)
    return backend


def _tc_piecewise(device, module):
    from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend

    return TcPiecewiseCudaGraphBackend(device, phase="decode", device_module=module, compiler="eager")


@pytest.mark.parametrize(
    "make",
    [_full, _breakable, _breakable_own_stream, _tc_piecewise],
    ids=["full", "breakable", "breakable-own-stream", "tc_piecewise"],
)
def test_every_device_call_names_the_runners_device(make):
    fake = check_device_calls(make, device_index=1, current_device=0)
    kinds = {what for what, _ in fake.device_calls}
    # Captured through the fake's graph API on a stream of device 1, under the runner's guard.
    assert {"device_guard", "Stream", "synchronize", "graph", "graph_stream", "replay"} <= kinds, kinds


def test_check_device_calls_catches_a_stream_on_the_current_device(monkeypatch):
    """The check fails for the bug it exists for: a bare ``Stream()`` / ``synchronize()``
    in a backend, driven by a runner without the device guard.
    With the runner's guard the same backend acts on device 1 (both layers protect)."""
    import contextlib

    import cuda_graph_runner.runner.base as base
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    class CurrentDeviceBackend(FullCudaGraphBackend):
        def capture_session(self, stream):
            return self.bind_capture_stream(self.device_module.Stream())  # a stream on the current device

        def synchronize(self):
            self.device_module.synchronize()

    def make(d, m):
        return CurrentDeviceBackend(d, phase="decode", device_module=m)

    check_device_calls(make)  # the runner's guard makes even a bare Stream() land on device 1
    monkeypatch.setattr(base, "device_guard", lambda *a, **k: contextlib.nullcontext())
    with pytest.raises(AssertionError, match=r"call\(s\) on another device.*\('synchronize', 0\)"):
        check_device_calls(make)


def test_replay_runs_on_the_callers_stream_without_synchronizing():
    """Overlap scheduling: a replay enqueues on the current stream of the runner's device;
    it neither synchronizes nor switches streams."""
    fake = FakeGraphDeviceModule(current_device=0)
    runner = DecodeCudaGraphRunner(
        TinyDecodeModel(), {"decode": {"max_bs": 4}}, device="cpu", backend=_full("cuda:1", fake), show_progress=False
    )
    with torch.no_grad():
        runner.capture()
        fake.device_calls.clear()
        runner.forward(tiny_decode_batch(3))
    assert fake.device_calls == [("device_guard", 1), ("replay", 1)]
    assert fake.current_device() == 0


# ----------------------------------------------------------------------------- out of memory
class OOMBackend(RecordingBackend):
    """Runs out of memory capturing ``oom_at`` (the warm-up or the recording); its pool
    grows by 1000 bytes per captured shape."""

    name = "oomy"

    def __init__(self, *args, oom_at=None, error=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.oom_at = oom_at
        self.error = error

    def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
        if key.size == self.oom_at:
            raise (
                self.error
                if self.error is not None
                else torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
            )
        super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)

    def graph_memory_bytes(self):
        return 1000 * len(self._fns)


def _oom_runner(oom_at=2, error=None):
    backend = OOMBackend("cpu", oom_at=oom_at, error=error)
    runner = DecodeCudaGraphRunner(
        TinyDecodeModel(), {"decode": {"max_bs": 8}}, device="cpu", backend=backend, show_progress=False
    )
    return runner, backend


def test_out_of_memory_during_capture_names_phase_backend_sizes_pool_and_fixes():
    runner, backend = _oom_runner(oom_at=2)
    assert runner.capture_sizes == [1, 2, 4, 8]
    with torch.no_grad(), pytest.raises(CaptureOutOfMemoryError) as info:
        runner.capture()
    err = info.value
    # Still the original kind of error, for callers that catch torch's OOM.
    assert isinstance(err, torch.OutOfMemoryError) and isinstance(err, torch.cuda.OutOfMemoryError)
    assert isinstance(err, CudaGraphRunnerError) and isinstance(err.__cause__, torch.OutOfMemoryError)
    assert (err.phase, err.backend, err.size) == ("decode", "oomy", 2)
    assert err.captured_sizes == [8, 4] and err.pending_sizes == [2, 1] and err.pool_bytes == 2000
    text = str(err)
    for part in (
        "decode",
        "'oomy'",
        "at size 2",
        "[8, 4]",
        "[2, 1]",
        "2000 bytes",
        "max_bs",
        "size list",
        "more device memory free",
        "Tried to allocate 2.00 GiB",
    ):
        assert part in text, (part, text)


def test_after_out_of_memory_the_runner_serves_then_cleans_up_and_recaptures():
    runner, backend = _oom_runner(oom_at=2)
    with torch.no_grad():
        with pytest.raises(CaptureOutOfMemoryError):
            runner.capture()
        assert runner.captured_keys == [ShapeKey(8, "decode"), ShapeKey(4, "decode")]
        for bs, replays in ((3, True), (6, True), (2, False), (1, False)):
            batch = tiny_decode_batch(bs)
            assert runner.can_run(batch) is replays, bs
            before = len([e for e in backend.events if e[0] == "replay"])
            torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))
            assert len([e for e in backend.events if e[0] == "replay"]) - before == int(replays)
        runner.cleanup()
        assert not runner.can_run(tiny_decode_batch(3))
        backend.oom_at = None
        report = runner.capture()
        assert report.sizes == [8, 4, 2, 1] and report.captured_sizes == [8, 4, 2, 1]
        batch = tiny_decode_batch(2)
        assert runner.can_run(batch)
        torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))


def test_out_of_memory_wrapped_by_a_backend_is_still_explained():
    """tc_piecewise wraps piece failures in its own error; the OOM in the chain counts."""
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError as oom:
            raise RuntimeError("tc_piecewise: piece 0 failed during capture") from oom
    except RuntimeError as wrapped:
        error = wrapped
    assert isinstance(find_out_of_memory(error), torch.OutOfMemoryError)
    runner, _ = _oom_runner(oom_at=4, error=error)
    with torch.no_grad(), pytest.raises(CaptureOutOfMemoryError, match="at size 4") as info:
        runner.capture()
    assert info.value.__cause__ is error and info.value.captured_sizes == [8]


def test_a_plain_runtime_out_of_memory_counts_and_other_errors_pass_through():
    # torch_npu raises RuntimeError("NPU out of memory ...").
    runner, _ = _oom_runner(oom_at=8, error=RuntimeError("NPU out of memory. Tried to allocate 1 GiB"))
    with torch.no_grad(), pytest.raises(CaptureOutOfMemoryError, match="sizes captured so far: none"):
        runner.capture()
    runner, _ = _oom_runner(oom_at=8, error=ValueError("a model bug"))
    with torch.no_grad(), pytest.raises(ValueError, match="a model bug"):
        runner.capture()


def test_capture_out_of_memory_error_pickles():
    import pickle

    err = CaptureOutOfMemoryError(
        phase="decode", backend="full", size=4, captured_sizes=[8], pending_sizes=[4, 2], pool_bytes=None
    )
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, CaptureOutOfMemoryError) and str(again) == str(err)
    assert "unknown on this device" in str(err)


# ------------------------------------------------------------------------ graph memory estimate
def test_capture_the_largest_size_first_then_the_rest():
    runner, backend = _oom_runner(oom_at=None)
    with torch.no_grad():
        first = runner.capture(sizes=[runner.max_size])
        assert isinstance(first, CaptureReport)
        assert first.sizes == [8] and first.first_size_pool_bytes == 1000 == runner.graph_memory_bytes()
        rest = runner.capture()
    assert rest.sizes == [4, 2, 1] and rest.captured_sizes == [8, 4, 2, 1]
    assert rest.pool_bytes == 4000 == runner.capture_memory_bytes
    assert backend.captured() == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]  # each once, largest first
    again = runner.capture()  # nothing left to capture: no second capture of any size
    assert again.sizes == [] and again.pool_bytes == 4000 and len(backend.captured()) == 4
    with pytest.raises(ValueError, match=r"sizes \[3\] are not among this runner's capture sizes \[1, 2, 4, 8\]"):
        runner.capture(sizes=[3, 4])


def test_disabled_backend_reports_nothing_captured():
    runner = DecodeCudaGraphRunner(TinyDecodeModel(), {"decode": {"max_bs": 4}}, device="cpu", backend="disabled")
    report = runner.capture()
    assert report.sizes == [] and report.captured_sizes == [] and runner.graph_memory_bytes() is None

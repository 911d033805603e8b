"""Capture-session mechanics shared by every backend: caches emptied only before the
session's first graph (as torch.cuda.graph would before each), once more after the session."""

from __future__ import annotations

import contextlib

from toy_model import ToyModel, decode_batch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule


class EmptyingFake(FakeGraphDeviceModule):
    """Like torch.cuda: ``graph()`` empties the allocator cache on entry."""

    def empty_cache(self) -> None:
        self.events.append(("empty_cache",))

    @contextlib.contextmanager
    def graph(self, cuda_graph, pool=None, stream=None, **kwargs):
        self.empty_cache()
        with super().graph(cuda_graph, pool=pool, stream=stream, **kwargs):
            yield


def run_capture(policy: str = "auto"):
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    fake = EmptyingFake()
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=fake, memory_pool="pool")
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": 8, "warmup": policy}})
    runner = DecodeCudaGraphRunner(ToyModel(), cfg, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    return runner, fake


def test_only_the_first_graph_of_a_session_empties_the_cache():
    runner, fake = run_capture()
    names = fake.names()
    begins = [i for i, n in enumerate(names) if n == "capture_begin"]
    assert len(begins) == 4
    assert names[begins[0] - 1] == "empty_cache"  # the largest size: caches emptied first
    assert all(names[i - 1] != "empty_cache" for i in begins[1:])
    # A second session (recapture) empties before its first graph again.
    runner.cleanup()
    fake.events.clear()
    runner.capture()
    names = fake.names()
    assert names[names.index("capture_begin") - 1] == "empty_cache"
    assert names.count("empty_cache") == 1


def test_first_size_policy_still_replays_every_size():
    runner, fake = run_capture("first_size")
    assert runner.backend.captured_keys == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
    # No later size warmed up, and the hook ran only after the first size's warm-ups.
    assert [n for n in fake.names() if n == "capture_begin"] == ["capture_begin"] * 4
    assert runner.model.post_warmup_calls == 1
    out = runner.forward(decode_batch(3))
    assert out.shape == (3, 16) and fake.events[-1][0] == "replay"

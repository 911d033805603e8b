"""A runner hands its backend one ``ShapeKey`` object per key value, at capture and at every
replay: a backend's per-key tables (tc_piecewise looks its key up in every piece, once per
layer and step) then hit by identity, without the dataclass's ``__eq__`` per lookup."""

from __future__ import annotations

from typing import Any, List

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch


class _KeyRecorder(RecordingBackend):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.capture_keys: List[ShapeKey] = []
        self.replay_keys: List[ShapeKey] = []

    def capture_one(self, key: ShapeKey, forward_fn: Any, **kwargs: Any) -> None:
        self.capture_keys.append(key)
        super().capture_one(key, forward_fn, **kwargs)

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        self.replay_keys.append(key)
        return super().replay(key, static_batch)


class _TwoVariants(ToyModel):
    def graph_variants(self) -> List[str]:
        return ["a", "b"]

    def graph_variant(self, batch: ForwardBatch) -> str:
        return "b" if batch.extra.get("use_b") else "a"


def _check(runner: DecodeCudaGraphRunner, batches: List[ForwardBatch]) -> None:
    backend = runner.backend
    runner.capture()
    captured = {key: key for key in backend.capture_keys}
    assert set(runner.captured_keys) == set(captured)
    for _ in range(2):  # the first replay of a size builds its plan, the second reuses it
        for batch in batches:
            runner.forward(batch)
    assert backend.replay_keys
    for key in backend.replay_keys:
        assert key is captured[key], f"replay of {key} got another object than its capture"


def test_decode_replays_get_the_captured_key_objects():
    runner = DecodeCudaGraphRunner(
        ToyModel(), {"decode": {"bs": [1, 2, 4]}}, device="cpu", backend=_KeyRecorder("cpu", phase="decode")
    )
    _check(runner, [decode_batch(bs) for bs in (1, 3, 4)])


def test_decode_replays_of_variants_get_the_captured_key_objects():
    runner = DecodeCudaGraphRunner(
        _TwoVariants(), {"decode": {"bs": [1, 2]}}, device="cpu", backend=_KeyRecorder("cpu", phase="decode")
    )
    batches = [decode_batch(bs) for bs in (1, 2)]
    for batch in batches[1:]:
        batch.extra["use_b"] = True
    _check(runner, batches)
    assert {k.variant for k in runner.backend.replay_keys} == {"decode|a", "decode|b"}

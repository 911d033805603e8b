"""Prefill runner policy on the CPU: token buckets, padding, the 2x rule, live request metadata."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode
from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import PrefillCudaGraphRunner, default_prefill_token_sizes
from cuda_graph_runner.runner.prefill import MAX_PADDING_RATIO
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.synthetic_batches import synthetic_extend_batch
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch

VOCAB = 16


class PerRequestToy(ToyModel):
    """ToyModel whose logits are one row per request (the EXTEND protocol), and which
    records what the runner hands its metadata hooks."""

    def __init__(self) -> None:
        super().__init__(vocab=VOCAB)
        self.replay_batches = []
        self.capture_batches = []
        self.kv_cache = None

    def compute_logits(self, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.forward_mode is ForwardMode.EXTEND:
            last = torch.cumsum(batch.extend_seq_lens.long(), 0) - 1
            hidden = hidden[last]
        return super().compute_logits(hidden, batch)

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None:
        # Snapshot: the runner reuses its request-axis capture buffers for every shape.
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
        self.capture_batches.append({k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in fields.items()})

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None:
        self.replay_batches.append(batch)


def extend_batch(lens, prefix=None, *, offset: int = 1) -> ForwardBatch:
    """A live EXTEND batch: distinct non-zero token values, request rows >= 1."""
    return synthetic_extend_batch(lens, prefix, token_stride=3, token_offset=offset, vocab=VOCAB, first_slot=100)


def make_runner(max_bs=None, bs=None, model=None, **kwargs):
    cfg = CudaGraphConfig.from_dict(
        {"prefill": {k: v for k, v in {"max_bs": max_bs, "bs": bs}.items() if v is not None}}
    )
    backend = kwargs.pop("backend", None) or RecordingBackend("cpu", phase="prefill")
    return PrefillCudaGraphRunner(
        model or PerRequestToy(), cfg, device="cpu", backend=backend, show_progress=False, **kwargs
    )


# -- sizes ---------------------------------------------------------------------------------


def test_default_token_buckets_follow_sglang():
    sizes = default_prefill_token_sizes(8192)
    assert sizes[:8] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert sizes[8:10] == [48, 64] and 256 in sizes and 272 not in sizes
    assert [s for s in sizes if 256 < s <= 512] == list(range(288, 513, 32))
    assert [s for s in sizes if 512 < s <= 1024] == list(range(576, 1025, 64))
    assert [s for s in sizes if 1024 < s <= 4096] == list(range(1280, 4097, 256))
    assert [s for s in sizes if s > 4096] == list(range(4608, 8193, 512))
    assert sizes == sorted(set(sizes))


def test_default_maximum_is_4096_and_captured():
    runner = make_runner()
    assert runner.capture_sizes == default_prefill_token_sizes(4096)
    assert runner.max_size == 4096 and runner.capture_sizes[-1] == 4096
    assert runner.buffers["input_ids"].shape == (4096,)


@pytest.mark.parametrize("max_bs,tail", [(100, [80, 96]), (256, [240, 256]), (4, [4]), (5000, [4096, 4608])])
def test_buckets_stop_at_max_bs_without_adding_it(max_bs, tail):
    """sglang's generate_prefill_cuda_graph_batch_sizes: the buckets cut at max_bs, max_bs
    itself not added off the stride."""
    sizes = make_runner(max_bs=max_bs).capture_sizes
    assert sizes[-len(tail) :] == tail and max(sizes) == tail[-1]


def test_explicit_token_sizes():
    # sglang: with explicit sizes max_bs becomes max(bs)
    assert make_runner(max_bs=64, bs=[8, 24]).capture_sizes == [8, 24]


# -- capture -------------------------------------------------------------------------------


def test_capture_is_largest_first_keyed_by_tokens():
    runner = make_runner(max_bs=16)
    runner.capture()
    assert runner.backend.captured() == [ShapeKey(s, "extend") for s in (16, 12, 8, 4)]
    assert runner.model.post_warmup_calls == 4
    assert runner.capture_seconds is not None and runner.capture_seconds >= 0


def test_capture_dummy_requests_respect_the_context_length():
    model = PerRequestToy()
    runner = make_runner(max_bs=32, model=model, max_request_tokens=10)
    assert runner.capture_request_lens(32) == [10, 10, 10, 2]
    assert runner.capture_request_lens(8) == [8]
    runner.capture()
    batch = model.capture_batches[0]  # the 32-token shape
    assert len(batch["input_ids"]) == 32 and batch["extend_seq_lens_cpu"] == [10, 10, 10, 2]
    assert batch["req_pool_indices"] == [0, 0, 0, 0]  # the reserved dummy row
    assert batch["extend_prefix_lens"] == [0] * 4 and batch["extend_prefix_lens_cpu"] == [0] * 4
    assert batch["seq_lens"] == batch["extend_seq_lens"] == [10, 10, 10, 2]
    assert set(batch["input_ids"]) == {0} and set(batch["out_cache_loc"]) == {0}
    assert [len(b["input_ids"]) for b in model.capture_batches] == [32, 28, 24, 20, 16, 12, 8, 4]


def test_capture_dummy_requests_default_to_the_models_kv_cache_length():
    class Cache:
        max_context_len = 12

    model = PerRequestToy()
    model.kv_cache = Cache()
    runner = make_runner(max_bs=32, model=model)
    assert runner.capture_request_lens(32) == [12, 12, 8]
    model.kv_cache = None
    assert runner.capture_request_lens(32) == [32]


def test_invalid_max_request_tokens():
    with pytest.raises(ValueError, match="max_request_tokens=0"):
        make_runner(max_request_tokens=0)


# -- replay --------------------------------------------------------------------------------


@pytest.mark.parametrize("lens", [[4], [3, 5], [1, 1, 2], [7, 2, 3], [16], [5, 6, 7, 14]])
def test_replay_pads_tokens_and_matches_eager(lens):
    runner = make_runner(max_bs=32)
    runner.capture()
    batch = extend_batch(lens)
    tokens = sum(lens)
    padded = runner.padded_size(tokens)
    assert runner.can_run(batch)
    with torch.no_grad():
        out = runner.forward(batch)
        expected = runner.eager_forward(batch)
    assert runner.backend.events[-1] == ("replay", ShapeKey(padded, "extend"))
    assert out.shape == (len(lens), VOCAB)  # one row per request
    torch.testing.assert_close(out, expected)
    for name in ("input_ids", "positions", "out_cache_loc"):
        buf = runner.buffers[name]
        assert torch.equal(buf[:tokens], getattr(batch, name))
        assert buf[tokens:padded].eq(0).all(), name  # zeroed index tail: token 0, slot 0


def test_stale_tail_of_a_larger_batch_is_cleared():
    runner = make_runner(max_bs=32)
    runner.capture()
    with torch.no_grad():
        runner.forward(extend_batch([10, 14]))
        runner.forward(extend_batch([9, 12]))  # 21 tokens -> 24
    assert runner.buffers["out_cache_loc"][21:24].eq(0).all()


def test_static_batch_carries_the_live_request_metadata():
    model = PerRequestToy()
    runner = make_runner(max_bs=32, model=model)
    runner.capture()
    batch = extend_batch([3, 6, 2], prefix=[5, 0, 9])
    with torch.no_grad():
        runner.forward(batch)
    static = model.replay_batches[-1]
    assert static.num_tokens == 12 and static.forward_mode is ForwardMode.EXTEND
    for name in ("req_pool_indices", "seq_lens", "extend_seq_lens", "extend_prefix_lens"):
        assert getattr(static, name) is getattr(batch, name), name
    assert static.extend_seq_lens_cpu == [3, 6, 2] and static.extend_prefix_lens_cpu == [5, 0, 9]
    assert static.seq_lens_cpu == [8, 6, 11]
    assert static.input_ids.data_ptr() == runner.buffers["input_ids"].data_ptr()


@pytest.mark.parametrize("tokens,replays", [(1, False), (2, True), (3, True), (17, True), (33, True), (24, True)])
def test_padding_more_than_twice_the_tokens_runs_eagerly(tokens, replays):
    runner = make_runner(max_bs=64)
    runner.capture()
    batch = extend_batch([tokens])
    padded = runner.padded_size(tokens)
    assert runner.can_run(batch) is replays is (padded <= MAX_PADDING_RATIO * tokens)
    with torch.no_grad():
        out = runner.forward(batch)
        torch.testing.assert_close(out, runner.eager_forward(batch))
    assert any(e[0] == "replay" for e in runner.backend.events) is replays


def test_sparse_buckets_fall_back_to_eager_when_padding_doubles():
    runner = make_runner(max_bs=64, bs=[4, 64])
    runner.capture()
    assert not runner.can_run(extend_batch([20]))  # 64 > 2 * 20
    assert runner.can_run(extend_batch([32]))  # 64 == 2 * 32
    assert runner.can_run(extend_batch([10, 30]))


def test_batch_above_the_maximum_runs_eagerly():
    runner = make_runner(max_bs=16)
    runner.capture()
    batch = extend_batch([10, 9])
    assert not runner.can_run(batch)
    with torch.no_grad():
        out = runner.forward(batch)
    assert out.shape == (2, VOCAB)
    assert not [e for e in runner.backend.events if e[0] == "replay"]
    with pytest.raises(ValueError, match="exceeds the largest captured size 16"):
        runner.replay(batch)


def test_decode_batches_and_uncaptured_runner_run_eagerly():
    runner = make_runner(max_bs=16)
    assert not runner.can_run(extend_batch([8]))  # before capture
    runner.capture()
    assert not runner.can_run(decode_batch(4))  # DECODE batch, prefill runner


def test_disabled_backend_runs_eagerly():
    runner = PrefillCudaGraphRunner(PerRequestToy(), {"prefill": {"backend": "disabled", "max_bs": 16}}, device="cpu")
    runner.capture()
    batch = extend_batch([3, 4])
    assert not runner.can_run(batch)
    with torch.no_grad():
        torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))


def test_cleanup_allows_recapture():
    runner = make_runner(max_bs=8)
    runner.capture()
    runner.cleanup()
    assert not runner.can_run(extend_batch([8]))
    runner.capture()
    assert runner.can_run(extend_batch([8]))


def test_exported_from_the_package_root():
    import cuda_graph_runner

    assert cuda_graph_runner.PrefillCudaGraphRunner is PrefillCudaGraphRunner

"""replay_prepare's per-step fast path (fused copies, pad only stale rows, reused static
batches): same buffers as a full pad every step, no host reads of device values."""

from __future__ import annotations

import contextlib
import unittest.mock

import pytest
import torch
from toy_model import ToyModel, decode_batch

from cuda_graph_runner.backend.buffers import CudaGraphBufferRegistry, FusedFill
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch
from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend


def decode_runner(width: int = 1) -> DecodeCudaGraphRunner:
    mode = ForwardMode.DECODE if width == 1 else ForwardMode.TARGET_VERIFY
    return DecodeCudaGraphRunner(
        ToyModel(),
        CudaGraphConfig.from_dict({"decode": {"bs": [2, 4, 8], "max_bs": 8}}),
        device="cpu",
        backend=RecordingBackend("cpu"),
        show_progress=False,
        mode=mode,
        num_tokens_per_req=width,
    )


def expected_buffers(runner: DecodeCudaGraphRunner, batch: ForwardBatch) -> dict:
    """What the buffers must hold after preparing ``batch``: live rows, then pad values."""
    bs = runner.padded_size(batch.batch_size)
    out = {}
    for slot in runner.buffers:
        rows = bs * (runner.num_tokens_per_req if slot.axis == "token" else 1)
        src = getattr(batch, slot.name)
        want = torch.full((rows,), slot.pad_value, dtype=slot.tensor.dtype)
        want[: src.shape[0]] = src
        out[slot.name] = want
    return out


@pytest.mark.parametrize("width", [1, 3])
def test_shrinking_growing_and_steady_batches_leave_no_stale_rows(width):
    runner = decode_runner(width)
    for bs in (7, 5, 8, 5, 5, 6, 1, 2, 3, 3, 8, 4):
        batch = decode_batch(bs, width=width, offset=bs)
        key, static = runner.replay_prepare(batch)
        assert key.size == runner.padded_size(bs)
        for name, want in expected_buffers(runner, batch).items():
            assert torch.equal(runner.buffers[name][: want.shape[0]], want), (bs, name)
        assert static.seq_lens_cpu == batch.seq_lens_cpu + [runner.seq_len_fill_value] * (key.size - bs)
        assert static.input_ids.data_ptr() == runner.buffers["input_ids"].data_ptr()


def test_static_batch_is_one_object_per_size_refreshed_each_step():
    runner = decode_runner()
    b1, b2 = decode_batch(3), decode_batch(3, offset=5)
    b1.extra = {"a": 1}
    b2.extra = {"b": 2}
    _, s1 = runner.replay_prepare(b1)
    assert isinstance(s1, StaticForwardBatch) and s1.extra == {"a": 1}
    _, s2 = runner.replay_prepare(b2)
    assert s2 is s1 and s2.extra == {"b": 2}
    _, s8 = runner.replay_prepare(decode_batch(8))
    assert s8 is not s1 and s8.batch_size == 8


def test_a_tensor_with_the_wrong_rows_is_an_error_not_a_broadcast():
    runner = decode_runner()
    batch = decode_batch(3).replace(positions=torch.tensor([4]))
    with pytest.raises(ValueError, match="'positions'.*1 rows, expected 3"):
        runner.replay_prepare(batch)


def test_prefill_static_batch_carries_the_live_request_fields():
    runner = PrefillCudaGraphRunner(
        ToyModel(),
        CudaGraphConfig.from_dict({"prefill": {"bs": [8, 16], "max_bs": 16}}),
        device="cpu",
        backend=RecordingBackend("cpu", phase="prefill"),
        show_progress=False,
    )
    for lens in ([5, 4], [3], [6, 6, 2], [3]):
        t = sum(lens)
        lt = torch.tensor(lens, dtype=torch.int32)
        batch = ForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            input_ids=torch.arange(t) + 1,
            positions=torch.arange(t),
            out_cache_loc=torch.arange(t) + 2,
            req_pool_indices=torch.arange(len(lens)) + 1,
            seq_lens=lt,
            extend_seq_lens=lt,
            extend_prefix_lens=torch.zeros_like(lt),
            seq_lens_cpu=lens,
            extend_seq_lens_cpu=lens,
            extend_prefix_lens_cpu=[0] * len(lens),
            extra={"n": len(lens)},
        )
        key, static = runner.replay_prepare(batch)
        padded = key.size
        assert static.req_pool_indices is batch.req_pool_indices and static.extend_seq_lens_cpu is lens
        assert static.extra == {"n": len(lens)} and static.num_tokens == padded
        for name in ("input_ids", "positions", "out_cache_loc"):
            want = torch.zeros(padded, dtype=torch.int64)
            want[:t] = getattr(batch, name)
            assert torch.equal(getattr(static, name), want), (lens, name)


@contextlib.contextmanager
def no_host_reads():
    """Every way to read a tensor's values on the host raises."""

    def refuse(name):
        def method(*args, **kwargs):
            raise AssertionError(f"replay_prepare called Tensor.{name}: a host sync on a device")

        return method

    with contextlib.ExitStack() as stack:
        for name in ("item", "tolist", "cpu", "numpy", "nonzero", "__bool__", "__int__", "__index__"):
            stack.enter_context(unittest.mock.patch.object(torch.Tensor, name, refuse(name)))
        yield


def test_replay_prepare_reads_no_tensor_value_on_the_host():
    runner = decode_runner()
    batches = [decode_batch(bs, offset=bs) for bs in (3, 8, 2, 3)]
    with no_host_reads():
        for batch in batches:  # first use of each size builds its plan inside the guard too
            runner.replay_prepare(batch)
    prefill = PrefillCudaGraphRunner(
        ToyModel(),
        CudaGraphConfig.from_dict({"prefill": {"bs": [8], "max_bs": 8}}),
        device="cpu",
        backend=RecordingBackend("cpu", phase="prefill"),
        show_progress=False,
    )
    lt = torch.tensor([3, 2], dtype=torch.int32)
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.arange(5),
        positions=torch.arange(5),
        out_cache_loc=torch.arange(5),
        req_pool_indices=torch.tensor([1, 2]),
        seq_lens=lt,
        extend_seq_lens=lt,
        seq_lens_cpu=[3, 2],
        extend_seq_lens_cpu=[3, 2],
    )
    with no_host_reads():
        prefill.replay_prepare(batch)


def test_fused_fill_refuses_sizes_beyond_the_slot():
    reg = CudaGraphBufferRegistry("cpu")
    reg.register("a", axis="token", rows=4, dtype=torch.int64)
    with pytest.raises(ValueError, match="cannot place 3 rows padded to 5"):
        FusedFill(reg, ["a"], [3], [5])
    fill = FusedFill(reg, ["a"], [2], [4])
    fill([torch.tensor([7, 8])])
    assert reg["a"].tolist() == [7, 8, 0, 0] and reg.slot("a").dirty == 2
    reg.reset()
    assert reg.slot("a").dirty == 0 and reg["a"].tolist() == [0, 0, 0, 0]


def test_a_live_input_of_another_dtype_kind_is_refused_not_cast():
    runner = decode_runner()
    before = {slot.name: slot.tensor.clone() for slot in runner.buffers}
    batch = decode_batch(3)
    with pytest.raises(ValueError, match=r"'input_ids' is torch.float32, expected torch.int64"):
        runner.replay_prepare(batch.replace(input_ids=batch.input_ids.float()))
    with pytest.raises(ValueError, match=r"'seq_lens' is torch.bool, expected torch.int32"):
        runner.replay_prepare(batch.replace(seq_lens=batch.seq_lens.bool()))
    for slot in runner.buffers:  # refused before anything was copied
        assert torch.equal(slot.tensor, before[slot.name]), slot.name
    # Another integer width is the same values: copied (an engine's int64 seq_lens).
    _, static = runner.replay_prepare(batch.replace(seq_lens=batch.seq_lens.long()))
    assert static.seq_lens.dtype == torch.int32 and static.seq_lens[:3].tolist() == batch.seq_lens.tolist()
    prefill = PrefillCudaGraphRunner(
        ToyModel(), {"prefill": {"bs": [8]}}, device="cpu", backend=RecordingBackend("cpu", phase="prefill")
    )
    extend = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.arange(6),
        positions=torch.arange(6).double(),
        out_cache_loc=torch.arange(6) + 1,
        req_pool_indices=torch.tensor([1]),
        seq_lens=torch.tensor([6], dtype=torch.int32),
    )
    with pytest.raises(ValueError, match=r"'positions' is torch.float64, expected torch.int64"):
        prefill.replay_prepare(extend)

"""The ``triton`` attention backend on the CPU: its algorithm in plain torch
(:mod:`cuda_graph_runner.reference.model.paged_attention_model`: split-KV page walk and
merge, extend tiles) against the reference attention, the split count fixed per padded
batch size, the errors without Triton or without CUDA, and (only where the ``triton``
package is installed and no CUDA device is) the kernels in Triton's interpreter.

The compiled kernels on a device: tests/test_triton_attention_gpu.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from triton_interpreter import run_interpreted

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode, as_static_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM, attention_backend, triton_attention
from cuda_graph_runner.reference.model import paged_attention_model as pam
from cuda_graph_runner.reference.model.attention import AttentionCall, _decode_attention, _extend_attention

KV_HEADS, HEAD_DIM, HEADS = 2, 16, 4
SLOTS, ROWS, CONTEXT = 400, 6, 64


def _cache():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(SLOTS, KV_HEADS, HEAD_DIM, generator=gen)
    # A scattered page table: neighbouring positions live in unrelated slots.
    r2t = torch.randperm(SLOTS - 1, generator=gen)[: ROWS * CONTEXT].add_(1).view(ROWS, CONTEXT)
    return k, v, r2t


@pytest.fixture(scope="module")
def cache():
    return _cache()


def decode_batch(mode: ForwardMode, rows, seq_lens, width: int) -> ForwardBatch:
    t = len(rows) * width
    z = torch.zeros(t, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=mode,
        input_ids=z,
        positions=z,
        out_cache_loc=z,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_cpu=list(seq_lens),
        num_tokens_per_req=width,
    )


@pytest.mark.parametrize("splits", [3, 8])
@pytest.mark.parametrize(
    "mode,width,window",
    [
        (ForwardMode.DECODE, 1, 0),
        (ForwardMode.DECODE, 1, 7),
        (ForwardMode.TARGET_VERIFY, 3, 0),
        (ForwardMode.TARGET_VERIFY, 3, 5),
        (ForwardMode.DLLM_EXTEND, 4, 0),
    ],
    ids=["decode", "decode-window", "verify3", "verify3-window", "dllm4"],
)
def test_split_kv_decode_equals_the_reference_attention(cache, mode, width, window, splits):
    k, v, r2t = cache
    rows, lens = [3, 1, 5, 0], [37, 64, width + 1, width]  # the last: a padded request (row 0)
    batch = decode_batch(mode, rows, lens, width)
    q = torch.randn(len(rows) * width, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(splits))
    expected = torch.empty_like(q)
    with forward_context(batch):
        _decode_attention(AttentionCall(expected, q, k, v, r2t, HEAD_DIM**-0.5, window, batch), True)
    parts = pam.split_kv_decode(
        q, k, v, r2t, rows, lens, width=width, num_splits=splits, scaling=HEAD_DIM**-0.5,
        sliding_window=window, bidirectional=mode.is_block_bidirectional(),
    )  # fmt: skip
    assert parts.out.shape == (len(rows) * width, HEADS, splits, HEAD_DIM) and parts.lse.shape == parts.out.shape[:3]
    got = pam.merge_splits(parts.out, parts.lse).reshape_as(q)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)
    if splits == 8:  # the short request leaves some splits empty: weight 0, not NaN
        assert torch.isinf(parts.lse[-width:]).any() and not torch.isnan(got).any()


def test_split_bounds_cover_the_key_range_once():
    for lo, hi, splits in [(0, 1, 8), (0, 37, 4), (5, 64, 32), (3, 4, 1)]:
        covered = []
        for s in range(splits):
            start, end = pam.split_bounds(lo, hi, splits, s)
            covered.extend(range(start, end))
        assert covered == list(range(lo, hi)), (lo, hi, splits)


def test_merge_of_one_split_is_that_split_and_empty_splits_weigh_nothing():
    o = torch.randn(3, 2, 5)
    lse = torch.tensor([[1.0, -math.inf], [-math.inf, 2.0], [0.5, 0.5]])
    got = pam.merge_splits(o, lse)
    torch.testing.assert_close(got[0], o[0, 0])
    torch.testing.assert_close(got[1], o[1, 1])
    torch.testing.assert_close(got[2], o[2].mean(0))


def extend_batch(ext, pre, rows) -> ForwardBatch:
    t = sum(ext) + 3  # three padded tail tokens (a prefill runner's padding)
    z = torch.zeros(t, dtype=torch.int64)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=z,
        positions=z,
        out_cache_loc=z,
        req_pool_indices=torch.tensor(rows, dtype=torch.int64),
        seq_lens=torch.tensor([a + b for a, b in zip(ext, pre)], dtype=torch.int32),
        extend_seq_lens=torch.tensor(ext, dtype=torch.int32),
        extend_prefix_lens=torch.tensor(pre, dtype=torch.int32),
        extend_seq_lens_cpu=list(ext),
        extend_prefix_lens_cpu=list(pre),
    )


@pytest.mark.parametrize("window", [0, 9])
def test_tiled_extend_equals_the_reference_attention(cache, window):
    k, v, r2t = cache
    ext, pre, rows = [5, 40, 0, 17], [0, 11, 4, 30], [2, 4, 1, 5]  # ragged, cached prefixes, an empty request
    batch = extend_batch(ext, pre, rows)
    q = torch.randn(batch.input_ids.shape[0], HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(1))
    expected = torch.full_like(q, 7.0)
    with forward_context(batch):
        _extend_attention(AttentionCall(expected, q, k, v, r2t, HEAD_DIM**-0.5, window, batch))
    tiles = pam.extend_tiles(ext, pre, 16)
    assert [(t.req, t.m_start) for t in tiles] == [(0, 0), (1, 0), (1, 16), (1, 32), (3, 0), (3, 16)]
    got = pam.tiled_extend(q, k, v, r2t, rows, tiles, scaling=HEAD_DIM**-0.5, sliding_window=window)
    torch.testing.assert_close(got, expected, atol=2e-5, rtol=2e-5)


def test_extend_tiles_refuse_bad_lengths():
    with pytest.raises(ValueError, match="extend_seq_lens has 2 entries, extend_prefix_lens 1"):
        pam.extend_tiles([1, 2], [0], 16)
    with pytest.raises(ValueError, match="request 1: extend_seq_len=-2"):
        pam.extend_tiles([1, -2], [0, 0], 16)


def test_split_count_depends_on_the_padded_size_only():
    assert pam.decode_num_splits(1, 8, 4096) == 32  # llama-3.2-1b at batch 1: 256 programs
    assert pam.decode_num_splits(4, 8, 4096) == 8
    assert pam.decode_num_splits(32, 8, 4096) == 1
    assert pam.decode_num_splits(1, 8, 64) == 4  # at least MIN_KEYS_PER_SPLIT keys of the context per split
    counts = [pam.decode_num_splits(bs, 2, 1024) for bs in range(1, 300)]
    assert counts == sorted(counts, reverse=True) and counts[0] == pam.MAX_SPLITS and counts[-1] == 1
    with pytest.raises(ValueError, match="padded_batch_size=0: must be >= 1"):
        pam.decode_num_splits(0, 8, 64)


def test_an_eager_batch_gets_the_split_count_of_the_size_a_runner_pads_it_to(monkeypatch):
    backend = triton_attention.TritonAttention()
    mode = ForwardMode.DECODE
    live = decode_batch(mode, [1, 2, 3], [9, 9, 9], 1)
    assert backend.num_splits(live, 8, 4096) == pam.decode_num_splits(3, 8, 4096) == 8  # no graph yet: its own size
    for bs in (1, 2, 8, 16):  # graph forwards (captures) of these sizes
        backend.num_splits(as_static_batch(decode_batch(mode, [0] * bs, [1] * bs, 1)), 8, 4096)
    assert backend.graph_sizes[(mode, 1)] == {1, 2, 8, 16}
    assert backend.padded_batch_size(mode, 1, 3) == 8
    assert backend.num_splits(live, 8, 4096) == pam.decode_num_splits(8, 8, 4096) == 4  # as the replay at 8
    assert backend.padded_batch_size(mode, 1, 17) == 17  # past the largest graph: runs eagerly at its own size
    assert backend.padded_batch_size(ForwardMode.TARGET_VERIFY, 3, 3) == 3  # other (mode, width): other graphs


def test_triton_attention_is_registered_and_refused_with_a_reason_without_triton(monkeypatch):
    assert "triton" in attention_backend.attention_backend_names()
    monkeypatch.setattr(triton_attention, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"needs the triton package.*cuda-graph-runner\[triton\]"):
        ReferenceLlamaForCausalLM.from_preset("tiny", attention="triton")


def test_triton_attention_on_cpu_tensors_outside_the_interpreter_says_so(monkeypatch):
    monkeypatch.setattr(triton_attention, "triton_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    model = ReferenceLlamaForCausalLM.from_preset("tiny", attention="triton")
    # Plans prefill graphs only (the replay hook updates their tile tables); decode plans nothing.
    assert model.attn_backend.name == "triton" and model.init_forward_metadata_replay is not None
    model.create_kv_cache(64, 4, 32)
    batch = decode_batch(ForwardMode.DECODE, [1], [1], 1)
    with pytest.raises(RuntimeError, match="runs on CUDA tensors.*TRITON_INTERPRET=1.*use attention 'torch'"):
        with forward_context(batch), torch.no_grad():
            model(batch)


def interpreter_check() -> None:
    """The kernels in Triton's interpreter against the torch model (run in a child
    process: Triton picks the interpreter when ``triton`` is first imported)."""
    from cuda_graph_runner.reference.model import triton_kernels as tk

    k, v, r2t = _cache()
    rows, lens, width = [3, 1, 0], [37, 23, 3], 3
    q = torch.randn(len(rows) * width, HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(2))
    got = torch.empty_like(q)
    tk.decode_attention(
        got, q, k, v, r2t, torch.tensor(rows), torch.tensor(lens, dtype=torch.int32),
        width=width, num_splits=4, scaling=HEAD_DIM**-0.5, sliding_window=6, block_n=16,
    )  # fmt: skip
    parts = pam.split_kv_decode(
        q, k, v, r2t, rows, lens, width=width, num_splits=4, scaling=HEAD_DIM**-0.5, sliding_window=6
    )
    torch.testing.assert_close(got, pam.merge_splits(parts.out, parts.lse).reshape_as(q), atol=1e-5, rtol=1e-5)
    ext, pre, ext_rows = [5, 20], [3, 0], [2, 4]
    tiles = pam.extend_tiles(ext, pre, 16)
    q = torch.randn(sum(ext), HEADS * HEAD_DIM, generator=torch.Generator().manual_seed(3))
    got = torch.empty_like(q)
    tk.extend_attention(
        got, q, k, v, r2t, torch.tensor(ext_rows), tk.extend_tile_tensor(tiles, q.device), len(tiles),
        scaling=HEAD_DIM**-0.5, block_m=16, block_n=16,
    )  # fmt: skip
    expected = pam.tiled_extend(q, k, v, r2t, ext_rows, tiles, scaling=HEAD_DIM**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous output"):  # a layout the kernels cannot address
        tk.extend_attention(
            got.t(), q, k, v, r2t, torch.tensor(ext_rows), tk.extend_tile_tensor(tiles, q.device), len(tiles),
            scaling=HEAD_DIM**-0.5,
        )  # fmt: skip
    print("interpreted kernels equal the torch model")


def test_interpreted_kernels_equal_the_torch_model():
    run_interpreted(__file__, "equal the torch model")


if __name__ == "__main__":
    interpreter_check()

"""``padded_eager``: an eager forward runs at the size a replay would use and is cut back,
so replay and eager run the same shapes. On the CPU with emulated graphs that really
replay (``full`` for decode, ``breakable`` for prefill): the eager run pads (the model
sees the padded size), slices (the live rows come back) and equals the replay bitwise;
without the key it runs the live size. The bf16 check on a GPU: test_padded_eager_gpu.py.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.reference.batches import GreedySession, make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.base import BaseCudaGraphRunner
from cuda_graph_runner.runner.padded_eager import pad_extra
from cuda_graph_runner.runner.static_inputs import StaticInput
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

DECODE_SIZES = [1, 2, 4, 8]
PREFILL_SIZES = [8, 16, 32]


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cpu")
    m.create_kv_cache(num_slots=16 * 64 + 1, max_reqs=17, max_context_len=64)
    return m


def _sizes_seen(model, monkeypatch):
    """The leading size of every batch ``model.forward`` runs from now on: (requests, tokens)."""
    seen = []
    inner = type(model).forward

    def spy(self, batch, *args, **kwargs):
        seen.append((batch.batch_size, batch.num_tokens))
        return inner(self, batch, *args, **kwargs)

    monkeypatch.setattr(type(model), "forward", spy)
    return seen


def test_config_key_defaults_off_accepts_bools_and_names_a_bad_value():
    assert CudaGraphConfig().decode.padded_eager is False
    config = CudaGraphConfig.from_dict({"prefill": {"padded_eager": True}})
    assert config.prefill.padded_eager and not config.decode.padded_eager
    assert CudaGraphConfig.from_dict(config.to_dict()) == config
    assert config.to_dict() == {"prefill": {"padded_eager": True}}
    with pytest.raises(CudaGraphConfigError) as err:
        CudaGraphConfig.from_dict({"decode": {"padded_eager": "yes"}})
    assert "padded_eager" in str(err.value) and "'yes'" in str(err.value) and "true or false" in str(err.value)


def _decode_runner(model, backend, **phase):
    return DecodeCudaGraphRunner(
        model, {"decode": {"bs": DECODE_SIZES, **phase}}, device="cpu", backend=backend, show_progress=False
    )


@pytest.fixture(scope="module")
def decode_graphs(model):
    runner = _decode_runner(
        model, FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="p")
    )
    runner.capture()
    return runner


@pytest.mark.parametrize("bs", [3, 5])
def test_decode_eager_pads_slices_and_equals_replay_bitwise(model, decode_graphs, monkeypatch, bs):
    graphs = decode_graphs
    graphs.stats.reset()
    padded = _decode_runner(model, "disabled", padded_eager=True)
    live = _decode_runner(model, "disabled")
    session = GreedySession(model, model.kv_cache)
    try:
        with torch.no_grad():
            session.prefill(make_dummy_prompts(bs, [3 + i for i in range(bs)], model.config.vocab_size, seed=bs))
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            replayed = graphs.forward(batch).clone()  # the KV write is idempotent: same slots, same values
            assert graphs.run_stats()["replays"] == 1
            seen = _sizes_seen(model, monkeypatch)
            got = padded.forward(batch)
            assert seen == [(graphs.padded_size(bs), graphs.padded_size(bs))], "padded_eager did not pad"
            assert got.shape == (bs, model.config.vocab_size), "padded_eager did not cut back"
            assert torch.equal(got, replayed)
            seen.clear()
            plain = live.forward(batch)
            assert seen == [(bs, bs)], "without padded_eager the eager forward runs the live size"
            torch.testing.assert_close(plain, replayed)
    finally:
        session.close()


def test_decode_fallbacks_pad_only_what_a_captured_size_covers(model, monkeypatch):
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="p")
    runner = _decode_runner(model, backend, padded_eager=True)  # not captured: every forward falls back
    session = GreedySession(model, model.kv_cache)
    try:
        with torch.no_grad():
            session.prefill(make_dummy_prompts(9, 4, model.config.vocab_size, seed=1))
            seen = _sizes_seen(model, monkeypatch)
            rows = session.rows
            small = make_decode_batch(model.kv_cache, rows[:3], None, [t[-1] for t in session.tokens[:3]])
            assert runner.forward(small).shape[0] == 3
            big = make_decode_batch(model.kv_cache, rows, None, [t[-1] for t in session.tokens])
            assert runner.forward(big).shape[0] == 9  # above the largest size (8): as it is
            assert seen == [(4, 4), (9, 9)]
            assert runner.run_stats()["eager_fallbacks"] == {"not captured": 2}
    finally:
        session.close()


def test_prefill_eager_pads_tokens_and_equals_replay_bitwise(model, monkeypatch):
    def runner(backend, **phase):
        return PrefillCudaGraphRunner(
            model, {"prefill": {"bs": PREFILL_SIZES, **phase}}, device="cpu", backend=backend, show_progress=False
        )

    graphs = runner(
        BreakableCudaGraphBackend("cpu", phase="prefill", device_module=EmulatedGraphDeviceModule(), memory_pool="p")
    )
    padded = runner("disabled", padded_eager=True)
    cache = model.kv_cache
    with torch.no_grad():
        graphs.capture()
        batch = make_extend_batch(cache, make_dummy_prompts(2, [6, 7], model.config.vocab_size, seed=4))
        try:
            replayed = graphs.forward(batch).clone()
            assert graphs.run_stats()["replays"] == 1
            seen = _sizes_seen(model, monkeypatch)
            got = padded.forward(batch)
            assert seen == [(2, 16)], "padded_eager did not pad the token axis to the bucket"
            assert got.shape == (2, model.config.vocab_size)
            assert torch.equal(got, replayed)
            seen.clear()
            short = batch.replace(  # 3 tokens: the bucket 8 is more than twice that, so no replay either
                input_ids=batch.input_ids[:3],
                positions=batch.positions[:3],
                out_cache_loc=batch.out_cache_loc[:3],
                req_pool_indices=batch.req_pool_indices[:1],
                seq_lens=torch.tensor([3], dtype=torch.int32),
                extend_seq_lens=torch.tensor([3], dtype=torch.int32),
                extend_prefix_lens=batch.extend_prefix_lens[:1],
                seq_lens_cpu=[3],
                extend_seq_lens_cpu=[3],
                extend_prefix_lens_cpu=[0],
            )
            assert not graphs.can_run(short)
            padded.forward(short)
            assert seen == [(1, 3)], "a batch no graph would take runs as it is"
        finally:
            for row in batch.req_pool_indices.tolist():
                cache.free_request(row)


def test_declared_static_inputs_pad_with_their_pad_value():
    specs = [
        StaticInput("adapter", axis="batch", dtype=torch.int64, pad_value=-1),
        StaticInput("mask", axis="token", dtype=torch.float32, pad_value=0.5, trailing_shape=(2,)),
        StaticInput("absent", axis="batch", dtype=torch.int32, pad_value=7),
    ]
    other = object()
    out = pad_extra({"adapter": [3, 4], "mask": torch.ones(4, 2), "other": other}, specs, 2, 4, 2, torch.device("cpu"))
    assert out["adapter"].tolist() == [3, 4, -1, -1] and out["adapter"].dtype == torch.int64
    assert out["mask"].shape == (8, 2) and out["mask"][4:].eq(0.5).all() and out["mask"][:4].eq(1).all()
    assert out["absent"].tolist() == [7, 7, 7, 7] and out["absent"].dtype == torch.int32
    assert out["other"] is other


@pytest.mark.parametrize("padded_eager, expected", [(True, [(4, 4)]), (False, [(3, 3)])])
def test_verify_reference_runs_at_the_replayed_size_under_padded_eager(model, monkeypatch, padded_eager, expected):
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="p")
    runner = _decode_runner(model, backend, padded_eager=padded_eager, verify=True, verify_first_n=1)
    session = GreedySession(model, model.kv_cache)
    try:
        with torch.no_grad():
            runner.capture()
            session.prefill(make_dummy_prompts(3, 5, model.config.vocab_size, seed=2))
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            seen = _sizes_seen(model, monkeypatch)
            runner.forward(batch)  # the emulated replay runs no Python forward; verify's reference does
            assert seen == expected
            assert runner.run_stats()["replays"] == 1
    finally:
        session.close()


def test_a_runner_class_without_pad_batch_refuses_padded_eager_at_construction(model):
    class NoPadding(DecodeCudaGraphRunner):
        pad_batch = BaseCudaGraphRunner.pad_batch

    with pytest.raises(ValueError, match="NoPadding defines no pad_batch"):
        NoPadding(model, {"decode": {"backend": "disabled", "padded_eager": True}})
    NoPadding(model, {"decode": {"backend": "disabled"}})  # off: nothing to pad

"""Decode runner policy on the CPU: sizes, capture order, warm-ups, padding, fallback."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.runner import DecodeCudaGraphRunner, default_decode_batch_sizes
from cuda_graph_runner.testing.fakes import FakeGraphDeviceModule, RecordingBackend
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch


def make_runner(max_bs=None, bs=None, **kwargs):
    cfg = CudaGraphConfig.from_dict(
        {"decode": {k: v for k, v in {"max_bs": max_bs, "bs": bs}.items() if v is not None}}
    )
    backend = kwargs.pop("backend", None) or RecordingBackend("cpu", phase="decode")
    return DecodeCudaGraphRunner(ToyModel(), cfg, device="cpu", backend=backend, show_progress=False, **kwargs)


def test_default_sizes_follow_sglang_buckets():
    sizes = make_runner().capture_sizes
    assert sizes[:6] == [1, 2, 4, 8, 12, 16] and sizes[-1] == 256
    assert all(b - a == 8 for a, b in zip(sizes[5:], sizes[6:]))
    assert default_decode_batch_sizes(600)[-3:] == [512, 544, 576]


@pytest.mark.parametrize("max_bs,expected_tail", [(12, [8, 12]), (20, [16, 20]), (50, [48, 50]), (1, [1])])
def test_max_bs_is_captured_even_off_the_stride(max_bs, expected_tail):
    sizes = make_runner(max_bs=max_bs).capture_sizes
    assert sizes[-len(expected_tail) :] == expected_tail and max(sizes) == max_bs


def test_explicit_sizes_with_larger_max_bs():
    # sglang: with explicit sizes max_bs becomes max(bs); no extra graph at max_bs
    assert make_runner(max_bs=8, bs=[1, 3, 5]).capture_sizes == [1, 3, 5]


def test_capture_is_largest_first_with_warmups_and_hook_before_each_capture():
    runner = make_runner(max_bs=8)
    runner.capture()
    events = runner.backend.events
    assert runner.backend.captured() == [ShapeKey(s, "decode") for s in (8, 4, 2, 1)]
    for size in (8, 4, 2, 1):
        key = ShapeKey(size, "decode")
        mine = [e[0] for e in events if len(e) > 1 and e[1] == key]
        # warmup "auto": the session's first (largest) size twice, every later size once.
        assert mine == ["warmup"] * (2 if size == 8 else 1) + ["post_warmup_hook", "capture"]
    assert events[0] == ("session_begin",) and events[-1] == ("session_end",)
    assert runner.model.post_warmup_calls == 4


@pytest.mark.parametrize("policy,later", [("every_size", 2), ("first_size", 0), ("auto", 1)])
def test_warmup_policy_sets_the_warmups_per_size(policy, later):
    cfg = CudaGraphConfig.from_dict({"decode": {"max_bs": 8, "warmup": policy}})
    runner = DecodeCudaGraphRunner(
        ToyModel(), cfg, device="cpu", backend=RecordingBackend("cpu", phase="decode"), show_progress=False
    )
    runner.capture()
    counts = [
        [e[0] for e in runner.backend.events if len(e) > 1 and e[1] == ShapeKey(s, "decode")].count("warmup")
        for s in (8, 4, 2, 1)
    ]
    assert counts == [2, later, later, later]
    # The hook undoes what warm-ups did: it runs only after a size that warmed up.
    assert runner.model.post_warmup_calls == (4 if later else 1)
    # A second session (recapture) warms its first size up fully again.
    runner.cleanup()
    runner.backend.events.clear()
    runner.capture()
    assert [e for e in runner.backend.events if e[0] == "warmup"][:2] == [("warmup", ShapeKey(8, "decode"))] * 2


def test_auto_warmup_skips_sizes_whose_kernels_already_ran():
    runner = make_runner(max_bs=8)
    runner.backend.note_kernels_ran(ShapeKey(4, "decode"))
    runner.capture()
    warmed = [e[1].size for e in runner.backend.events if e[0] == "warmup"]
    assert warmed == [8, 8, 2, 1]


@pytest.mark.parametrize("bad", ["twice", "", None, 2])
def test_warmup_policy_is_validated(bad):
    from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError

    with pytest.raises(CudaGraphConfigError, match="decode.warmup.*accepted: auto, every_size, first_size"):
        CudaGraphConfig.from_dict({"decode": {"warmup": bad}})


@pytest.mark.parametrize("bs", [1, 2, 3, 5, 7, 8])
def test_replay_pads_to_the_next_size_and_matches_eager(bs):
    runner = make_runner(max_bs=8)
    runner.capture()
    batch = decode_batch(bs)
    assert runner.can_run(batch)
    out = runner.forward(batch)
    expected_key = ShapeKey(runner.padded_size(bs), "decode")
    assert runner.backend.events[-1] == ("replay", expected_key)
    assert out.shape == (bs, 16)
    torch.testing.assert_close(out, runner.eager_forward(batch))
    padded = expected_key.size
    # The padded tail points at the dummy row/slot and carries the seq-len fill value.
    assert runner.buffers["req_pool_indices"][bs:padded].eq(0).all()
    assert runner.buffers["out_cache_loc"][bs:padded].eq(0).all()
    assert runner.buffers["seq_lens"][bs:padded].eq(runner.seq_len_fill_value).all()


def test_stale_padding_from_a_larger_batch_is_cleared():
    runner = make_runner(max_bs=8)
    runner.capture()
    runner.forward(decode_batch(8))
    runner.forward(decode_batch(5))
    assert runner.buffers["req_pool_indices"][5:8].eq(0).all()


def test_batch_above_max_bs_runs_eagerly():
    runner = make_runner(max_bs=4)
    runner.capture()
    batch = decode_batch(6)
    assert not runner.can_run(batch)
    out = runner.forward(batch)
    assert out.shape == (6, 16)
    assert not [e for e in runner.backend.events if e[0] == "replay"]
    with pytest.raises(ValueError, match="exceeds the largest captured size 4"):
        runner.replay(batch)


def test_uncaptured_runner_and_wrong_mode_run_eagerly():
    runner = make_runner(max_bs=4)
    assert not runner.can_run(decode_batch(2))  # before capture
    runner.capture()
    assert not runner.can_run(decode_batch(2, width=2))  # target-verify batch, decode runner


def test_target_verify_width_pads_token_axis():
    runner = make_runner(max_bs=4, mode=ForwardMode.TARGET_VERIFY, num_tokens_per_req=3)
    runner.capture()
    assert runner.backend.captured()[0] == ShapeKey(4, "target_verify:3")
    batch = decode_batch(3, width=3)
    out = runner.forward(batch)
    assert out.shape == (9, 16)
    torch.testing.assert_close(out, runner.eager_forward(batch))
    assert runner.seq_len_fill_value == 3


def test_invalid_mode_arguments_are_named():
    with pytest.raises(ValueError, match="num_tokens_per_req=2 is invalid for DECODE"):
        make_runner(num_tokens_per_req=2)
    with pytest.raises(ValueError, match="DECODE, TARGET_VERIFY or DLLM_EXTEND"):
        make_runner(mode=ForwardMode.EXTEND)


def test_disabled_backend_captures_nothing_and_runs_eagerly():
    runner = DecodeCudaGraphRunner(ToyModel(), {"decode": {"backend": "disabled", "max_bs": 4}}, device="cpu")
    runner.capture()
    batch = decode_batch(2)
    assert not runner.can_run(batch)
    torch.testing.assert_close(runner.forward(batch), runner.eager_forward(batch))


def test_cleanup_allows_recapture():
    runner = make_runner(max_bs=2)
    runner.capture()
    runner.cleanup()
    assert not runner.can_run(decode_batch(1))
    runner.capture()
    assert runner.can_run(decode_batch(1))


def test_full_backend_protocol_with_fake_graph_api():
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    fake = FakeGraphDeviceModule()
    backend = FullCudaGraphBackend("cpu", phase="decode", device_module=fake, memory_pool="pool-0")
    runner = make_runner(max_bs=4, backend=backend)
    runner.capture()
    names = fake.names()
    begins = [e for e in fake.events if e[0] == "capture_begin"]
    assert len(begins) == 3 and all(e[2] == "pool-0" for e in begins)  # one shared pool
    # First shape: one sync before its two warm-ups (one stream: none between), one after, then capture.
    first = names.index("capture_begin")
    assert names[:first] == ["synchronize", "synchronize"]
    # Later shapes (warmup "auto"): one warm-up each, the same two syncs, no more.
    second = names.index("capture_begin", first + 1)
    assert names[names.index("capture_end") + 1 : second] == ["synchronize", "synchronize"]
    assert backend.captured_keys == [ShapeKey(s, "decode") for s in (4, 2, 1)]
    out = runner.forward(decode_batch(3))
    assert fake.events[-1][0] == "replay" and out.shape == (3, 16)
    with pytest.raises(ValueError, match="already captured"):
        backend.capture_one(ShapeKey(4, "decode"), lambda: None)
    runner.cleanup()
    assert fake.names().count("reset") == 3


def test_backend_name_overrides_only_the_backend_of_the_config():
    runner = DecodeCudaGraphRunner(
        ToyModel(),
        {"decode": {"backend": "tc_piecewise", "max_bs": 4, "tc_compiler": "inductor"}},
        device="cpu",
        backend="disabled",
    )
    assert runner.backend.name == "disabled"
    assert runner.backend.phase_config.tc_compiler == "inductor" and runner.capture_sizes[-1] == 4

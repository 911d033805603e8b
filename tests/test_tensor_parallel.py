"""Tensor parallelism on the CPU (gloo): the reference model's TP mode and the runner's TP agreement.

Each launch spawns the ranks once and runs many checks inside them (a launch costs a
few seconds of interpreter and torch start-up per rank); the parent asserts on the
values the ranks return. Ranks: :func:`cuda_graph_runner.testing.tp_launch.run_ranks`
(bounded: a hung rank fails the test, never the CI job).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest
import torch

from cuda_graph_runner.reference.model import PRESETS, ModelConfig, ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.tensor_parallel import TPLayout, shard_hf_tensor
from cuda_graph_runner.runner.distributed import TPGroup, all_gather_last_dim
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.tp_launch import run_ranks

# Shapes that exercise every sharding rule: "tiny" (KV heads split at TP=2, replicated at
# TP=4), a tied Qwen2 flavour with q/k/v bias and a vocab TP does not divide (padding),
# and one KV head (replicated at any TP > 1).
CONFIGS = {
    "tiny": PRESETS["tiny"],
    "qwen2-odd-vocab": dataclasses.replace(PRESETS["tiny-qwen2"], vocab_size=251),
    "one-kv-head": dataclasses.replace(PRESETS["tiny"], num_key_value_heads=1, qkv_bias=True, o_bias=True),
}
PROMPTS = [[5, 9, 3, 7], [11, 2, 8, 4, 6, 1, 10], [3, 3]]
DECODE_STEPS = 4


def _session_logits(model, decode_fn=None):
    """Prefill + DECODE_STEPS greedy decodes; the float32 logits of every step ``[steps, bs, vocab]``."""
    from cuda_graph_runner.reference.batches import GreedySession

    cache = model.kv_cache or model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)
    session = GreedySession(model, cache, decode_fn=decode_fn)
    with torch.no_grad():
        session.prefill(PROMPTS)
        for _ in range(DECODE_STEPS):
            session.decode()
    session.close()
    return torch.stack(session.logits), session.tokens


def write_hf_checkpoint(path: str, config: ModelConfig, seed: int) -> None:
    """A ``save_pretrained``-style directory (config.json + model.safetensors, Hugging Face
    tensor names) of a TP=1 reference model with random weights."""
    from safetensors.torch import save_file

    model = ReferenceLlamaForCausalLM.from_config(config, seed=seed)
    with torch.no_grad():  # non-trivial norms so a norm loaded from the wrong place shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    os.makedirs(path, exist_ok=True)
    save_file(
        {k: v.contiguous().clone() for k, v in model._hf_targets().items()}, os.path.join(path, "model.safetensors")
    )
    hf = {
        "model_type": config.model_type,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "attention_bias": config.qkv_bias,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)


def _rank_checks(tp: TPGroup, ckpt: str):
    """Everything a rank checks in one launch; returns values the parent asserts on."""
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.runner.distributed import TensorParallelCaptureError, TensorParallelMismatchError
    from cuda_graph_runner.testing.fakes import RecordingBackend

    torch.set_num_threads(1)  # ranks share the CI machine's cores
    out = {"rank": tp.rank, "logits": {}}
    for name, cfg in CONFIGS.items():
        par = ReferenceLlamaForCausalLM.from_config(cfg, seed=3, tp_group=tp)
        logits, tokens = _session_logits(par)
        out["logits"][name] = (logits, tokens, tuple(par.kv_cache.k_buffers[0].shape))
    # Shard loading: every rank reads its shard of one checkpoint.
    loaded = ReferenceLlamaForCausalLM.from_pretrained(ckpt, tp_group=tp)
    out["loaded"] = _session_logits(loaded)
    # The runner: capture (RecordingBackend replays by re-running the forward, collectives
    # included) and replay a captured size (2) and an off-bucket one (3, padded to 4).
    model = ReferenceLlamaForCausalLM.from_config(CONFIGS["tiny"], seed=3, tp_group=tp)
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)
    backend = RecordingBackend("cpu", phase="decode", share_pool=True)
    runner = DecodeCudaGraphRunner(model, {"decode": {"max_bs": 4}}, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    out["runner"] = _session_logits(model, decode_fn=runner.forward)
    out["eager"] = _session_logits(model)
    out["replays"] = sum(1 for e in backend.events if e[0] == "replay")
    # Agreement: one rank unable to replay makes every rank run eagerly; different sizes raise.
    out["agree_one_false"] = tp.agree_step(2, tp.rank != 0)
    try:
        tp.agree_step(1 + tp.rank, True)
        out["mismatch"] = None
    except TensorParallelMismatchError as exc:
        out["mismatch"] = str(exc)

    # A capture failure on the last rank fails capture on every rank.
    class FailingOnLastRank(RecordingBackend):
        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)
            if tp.rank == tp.size - 1 and key.size == 2:
                raise RuntimeError("injected capture failure")

    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"max_bs": 4}},
        device="cpu",
        backend=FailingOnLastRank("cpu", phase="decode"),
        show_progress=False,
    )
    try:
        runner.capture()
        out["capture_error"] = None
    except TensorParallelCaptureError as exc:
        out["capture_error"] = ("TensorParallelCaptureError", str(exc))
    except RuntimeError as exc:
        out["capture_error"] = ("RuntimeError", str(exc))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp") / "ckpt")
    cfg = dataclasses.replace(CONFIGS["one-kv-head"], vocab_size=253)  # untied lm_head, padded vocab, bias
    write_hf_checkpoint(path, cfg, seed=7)
    return path


def _check_launch(results, tp_size, checkpoint):
    assert [r["rank"] for r in results] == list(range(tp_size))
    for name, cfg in CONFIGS.items():
        ref_logits, ref_tokens = _session_logits(ReferenceLlamaForCausalLM.from_config(cfg, seed=3))
        tol = model_tolerance(cfg, torch.float32, context_len=32)
        lay = TPLayout.of(cfg, TPGroup(0, tp_size, torch.device("cpu")))
        for r in results:
            logits, tokens, kv_shape = r["logits"][name]
            assert logits.shape == ref_logits.shape  # the full vocab on every rank
            torch.testing.assert_close(logits, ref_logits, **tol, msg=f"{name} rank {r['rank']} TP={tp_size}")
            assert tokens == ref_tokens
            assert kv_shape[1] == lay.local_kv_heads == max(1, cfg.num_key_value_heads // tp_size)
    ref = _session_logits(ReferenceLlamaForCausalLM.from_pretrained(checkpoint))
    for r in results:
        torch.testing.assert_close(
            r["loaded"][0], ref[0], **model_tolerance(CONFIGS["tiny"], torch.float32, context_len=32)
        )
        assert r["loaded"][1] == ref[1]
        torch.testing.assert_close(r["runner"][0], r["eager"][0], atol=1e-5, rtol=1e-5)
        assert r["runner"][1] == r["eager"][1]
        assert r["replays"] == DECODE_STEPS  # every decode replayed (sizes 3 -> 4)
        assert r["agree_one_false"] is False
        assert r["mismatch"] is not None and "different sizes" in r["mismatch"]
    last = results[-1]["capture_error"]
    assert last == ("RuntimeError", "injected capture failure")
    for r in results[:-1]:
        assert r["capture_error"] is not None and r["capture_error"][0] == "TensorParallelCaptureError"


def test_tp2_equals_tp1_loads_shards_and_agrees(checkpoint):
    """TP=2 (gloo): eager logits equal TP=1 on three shapes, shard loading, runner replay equals
    eager, every rank takes the same decision, a capture failure on one rank fails all."""
    _check_launch(run_ranks(_rank_checks, 2, checkpoint, timeout_s=300), 2, checkpoint)


def test_tp4_equals_tp1_with_kv_heads_fewer_than_tp(checkpoint):
    """TP=4 (gloo, 4 ranks): "tiny" has 2 KV heads, so each is replicated on two ranks."""
    _check_launch(run_ranks(_rank_checks, 4, checkpoint, timeout_s=300), 4, checkpoint)


# -- single-process pieces ------------------------------------------------------------------


def test_layout_rejects_sizes_that_do_not_split():
    with pytest.raises(ValueError, match="num_attention_heads=4 is not a multiple of tp=3"):
        ReferenceLlamaForCausalLM(PRESETS["tiny"], tp_group=TPGroup(0, 3, torch.device("cpu")))
    with pytest.raises(ValueError, match="rank=2 size=2"):
        TPGroup(2, 2, torch.device("cpu"))


def test_vocab_shards_pad_with_zero_rows():
    cfg = dataclasses.replace(PRESETS["tiny"], vocab_size=251)
    full = torch.randn(251, cfg.hidden_size)
    parts = [
        shard_hf_tensor("model.embed_tokens.weight", full, TPLayout.of(cfg, TPGroup(r, 4, torch.device("cpu"))))
        for r in range(4)
    ]
    assert all(p.shape == (63, cfg.hidden_size) for p in parts)
    joined = torch.cat(parts)
    torch.testing.assert_close(joined[:251], full)
    assert not joined[251:].any()


def test_size_one_group_runs_no_collective():
    x = torch.randn(3, 4)
    assert all_gather_last_dim(x, TPGroup(0, 1, torch.device("cpu"))) is x
    assert TPGroup(0, 1, torch.device("cpu")).agree_step(3, False) is False


@pytest.mark.parametrize(
    "value,error",
    [
        (0, ValueError),
        (-1.5, ValueError),
        (float("nan"), ValueError),
        (float("inf"), ValueError),
        ("10", TypeError),
        (True, TypeError),
    ],
)
@pytest.mark.parametrize("name", ["step_timeout_s", "capture_timeout_s"])
def test_agreement_bounds_refuse_what_is_not_seconds(name, value, error):
    """A bound that is not a finite number of seconds > 0 is refused by the group and by
    init_tensor_parallel / init_data_parallel, before any process group is made."""
    from cuda_graph_runner.runner.distributed import init_tensor_parallel
    from cuda_graph_runner.runner.dp_group import DPGroup, init_data_parallel

    bad = re.escape(f"{name}={value!r}")
    for make in (
        lambda: TPGroup(0, 2, torch.device("cpu"), **{name: value}),
        lambda: DPGroup(0, 2, torch.device("cpu"), **{name: value}),
        lambda: init_tensor_parallel(2, device_type="cpu", **{name: value}),
        lambda: init_data_parallel(2, device_type="cpu", **{name: value}),
    ):
        with pytest.raises(error, match=bad):
            make()
    assert not torch.distributed.is_initialized()


class _TimedOut:
    """A collective's work handle whose wait runs out (as gloo's does)."""

    def wait(self, timeout):
        raise RuntimeError(f"Operation timed out! ({timeout.total_seconds():g} s)")


def test_a_wait_that_ran_out_names_the_agreement_and_the_group_refuses_every_agreement_after():
    from cuda_graph_runner.runner.distributed import TensorParallelCaptureError, TensorParallelStepError
    from cuda_graph_runner.runner.dp_group import DataParallelStepError, DPGroup

    tp = TPGroup(0, 2, torch.device("cpu"), step_timeout_s=0.25)
    with pytest.raises(TensorParallelStepError) as info:
        tp.wait_bounded(_TimedOut(), "the batch's replay agreement")
    message = str(info.value)
    assert "the batch's replay agreement did not complete on TP rank 0 of 2" in message, message
    assert "Operation timed out! (0.25 s)" in message and "step_timeout_s=0.25 s" in message, message
    assert "end the process" in message
    # Refused before any collective (none could run here: there is no process group).
    for call, kind in (
        (lambda: tp.agree_step(2, True), TensorParallelStepError),
        (lambda: tp.all_true(True), TensorParallelStepError),
        (lambda: tp.gather_objects(1), TensorParallelStepError),
        (lambda: tp.barrier(), TensorParallelCaptureError),
        (lambda: tp.gather_objects(1, capture=True), TensorParallelCaptureError),
    ):
        with pytest.raises(kind) as info:
            call()
        assert str(info.value) == message
    dp = DPGroup(0, 2, torch.device("cpu"), capture_timeout_s=7)
    with pytest.raises(TensorParallelCaptureError, match=r"capture of decode size 4 did not .*capture_timeout_s=7 s"):
        dp.wait_bounded(_TimedOut(), "the agreement after capture of decode size 4", capture=True)
    with pytest.raises(DataParallelStepError, match="capture of decode size 4"):  # a DP group's step error
        dp.start_agree_batch(2, True, "a")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--tp", "0"], "argument --tp: invalid value '0'; accepted: an integer >= 1"),
        (["--tp", "2"], "torchrun --nproc-per-node 2 -m cuda_graph_runner bench --tp 2"),
    ],
)
def test_bench_tp_usage_errors(argv, message, capsys, monkeypatch):
    from cuda_graph_runner.cli.command import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        rc = main(["bench", *argv])
    except SystemExit as e:  # refused by argparse, at parse
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


# -- the compiled path's custom ops -----------------------------------------------------


def test_groups_are_named_for_the_custom_ops_and_found_by_name():
    from cuda_graph_runner.runner import tp_ops

    tp = TPGroup(1, 2, torch.device("cpu"))
    assert tp.name.startswith("tp2-rank1-")
    assert tp_ops.group_by_name(tp.name) is tp
    assert TPGroup(0, 1, torch.device("cpu")).name == ""  # size 1 runs no collective
    with pytest.raises(KeyError, match="no tensor-parallel group named 'tp9-rank0-x'"):
        tp_ops.group_by_name("tp9-rank0-x")


def test_custom_ops_have_fake_implementations():
    """What Dynamo and inductor see: the output shapes, without a process group."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from cuda_graph_runner.runner.tp_ops import all_gather_last_dim_op, all_reduce_op

    tp = TPGroup(0, 2, torch.device("cpu"))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        x = mode.from_tensor(torch.empty(5, 8))
        assert all_reduce_op(x, tp.name).shape == (5, 8)
        assert all_gather_last_dim_op(x, tp.name, 2).shape == (5, 16)


def test_per_rank_compile_cache_directory(monkeypatch, tmp_path):
    from cuda_graph_runner.runner.distributed import per_rank_compile_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    assert per_rank_compile_cache(1) == str(tmp_path / "rank_1")
    assert per_rank_compile_cache(1) == str(tmp_path / "rank_1")  # idempotent
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "rank_1")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR")
    default = per_rank_compile_cache(0)  # inductor's default directory, then the rank's
    assert os.path.basename(default) == "rank_0" and "torchinductor_" in default

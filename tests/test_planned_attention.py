"""Plan-based attention through the runners (CPU): the reference model with the
``planned_standin`` attention (a stand-in of FlashInfer-style host planning) driven by
the decode and prefill runners over every CPU-capable graph backend (the recording
backend, ``disabled``, and ``full`` and ``breakable`` on emulated graphs, which replay
the recorded ops without running Python).

Checked: a plan before every forward (eager fallback, warm-ups, capture, replay, verify
mode's reference), none stale, none missing; per-size state built once per size x
variant and dropped by ``cleanup()``; recapture; the padded host lengths and the fill
value the replay hook gets; a missing replay hook is caught; ``torch`` attention stays
hook-free (the replay path's None check) and bit-identical.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import pytest
import torch

from cuda_graph_runner.backend import DisabledBackend
from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.backend.forward_batch import ForwardMode
from cuda_graph_runner.reference.batches import (
    GreedySession,
    eager_logits_fn,
    make_dummy_prompts,
    make_extend_batch,
    make_target_verify_batch,
)
from cuda_graph_runner.reference.model import LORA_IDS, PRESETS, ReferenceLlamaForCausalLM, attention_backend_names
from cuda_graph_runner.reference.model.planned_standin import (
    PlannedAttentionStandIn,
    StalePlanError,
    UnplannedForwardError,
)
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.reference_setup import staggered_decode_case
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
from cuda_graph_runner_full.backend import FullCudaGraphBackend

CONTEXT = 48
TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)


def _recording(phase: str) -> Any:
    return RecordingBackend("cpu")


def _disabled(phase: str) -> Any:
    return DisabledBackend("cpu")


def _full(phase: str) -> Any:
    return FullCudaGraphBackend("cpu", phase=phase, device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0")


def _breakable(phase: str) -> Any:
    return BreakableCudaGraphBackend(
        "cpu", phase=phase, device_module=EmulatedGraphDeviceModule(), memory_pool="pool-0"
    )


DECODE_BACKENDS: Dict[str, Callable[[str], Any]] = {
    "recording": _recording,
    "disabled": _disabled,
    "full": _full,
    "breakable": _breakable,
}
PREFILL_BACKENDS = dict(DECODE_BACKENDS)  # full records prefill attention: request slots, replay hook
#: Backends whose replay runs the model's Python (the stand-in sees those forwards).
PYTHON_REPLAY = {"recording"}


def planned_model(requests: int = 12, **standin: Any) -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_preset("tiny", attention="planned_standin")
    if standin:
        model.attn_backend.__init__(**standin)  # a fresh stand-in with these options
    model.create_kv_cache(num_slots=requests * CONTEXT + 1, max_reqs=requests + 1, max_context_len=CONTEXT)
    return model


def standin(model: ReferenceLlamaForCausalLM) -> PlannedAttentionStandIn:
    backend = model.attn_backend
    assert isinstance(backend, PlannedAttentionStandIn)
    return backend


def decode_runner(model: Any, name: str, **config: Any) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(
        model,
        {"decode": {"bs": [1, 2, 4], **config}},
        device="cpu",
        backend=DECODE_BACKENDS[name]("decode"),
        show_progress=False,
    )


@pytest.mark.parametrize("name", sorted(DECODE_BACKENDS))
def test_decode_plans_every_forward_in_capture_replay_eager_verify_cleanup_recapture(name):
    model = planned_model()
    plans = standin(model)
    runner = decode_runner(model, name, verify=True, verify_first_n=1, verify_every=0)
    with torch.no_grad():
        runner.capture()
        keys = {(ForwardMode.DECODE, 1, bs, "") for bs in (1, 2, 4)} if name != "disabled" else set()
        assert set(plans.states) == keys
        assert all(plans.state_builds[k] == 1 for k in keys)  # the capture hook ran once per size, state built once
        assert plans.plan_kinds().count("capture") == len(keys)
        for bs in (3, 5):  # 3: padded to 4; 5: above max_bs, the eager fallback
            session, batch, expected = staggered_decode_case(model, bs, seed=bs)
            before = len(plans.plan_log)
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, **TOL, msg=f"{name}: batch size {bs}")
            made = [p.kind for p in list(plans.plan_log)[before:]]
            if name == "disabled" or bs > 4:
                assert made == ["eager"]
            else:
                # a replay plan of the padded size, then verify mode's eager reference (first replay per key)
                replay = [p for p in list(plans.plan_log)[before:] if p.kind == "replay"]
                assert len(replay) == 1 and replay[0].key == (ForwardMode.DECODE, 1, runner.padded_size(bs), "")
                assert replay[0].seq_lens == batch.seq_lens_cpu + [runner.seq_len_fill_value] * (
                    runner.padded_size(bs) - bs
                )
                assert made[0] == "replay" and set(made[1:]) <= {"eager"}
            session.close()
        plans.check()  # no device-side mismatch either
        runner.cleanup()
        assert plans.cleanups == [ForwardMode.DECODE] and not plans.states
        runner.capture()  # recapture: state built afresh
        assert all(plans.state_builds[k] == 2 for k in keys)
        session, batch, expected = staggered_decode_case(model, 3, seed=11)
        torch.testing.assert_close(runner.forward(batch), expected, **TOL)
        session.close()
        plans.check()
    # Where a replay runs Python, each forward claimed exactly the plan made for it.
    claimed = [index for kind, _, index in plans.forwards if kind != "capture"]
    assert claimed and len(set(claimed)) == len(claimed)
    if name in PYTHON_REPLAY:
        assert any(kind == "replay" for kind, _, _ in plans.forwards)


@pytest.mark.parametrize("name", ["full", "recording"])  # no Python at replay; Python at replay
def test_a_replay_without_its_replay_hook_is_caught(name, monkeypatch):
    model = planned_model()
    plans = standin(model)
    runner = decode_runner(model, name)
    with torch.no_grad():
        runner.capture()
        session, batch, expected = staggered_decode_case(model, 3, seed=3)
        torch.testing.assert_close(runner.forward(batch), expected, **TOL)
        session.close()
        # A runner that forgot the replay hook: the graph reads the plan of the last replay.
        monkeypatch.setattr(model, "init_forward_metadata_replay", None)
        session, batch, expected = staggered_decode_case(model, 3, seed=4, decode_steps=3)  # longer requests
        if name in PYTHON_REPLAY:
            with pytest.raises(StalePlanError, match="replay hook"):
                runner.forward(batch)
        else:  # no Python at replay (as on a device): wrong numbers, counted on the device
            got = runner.forward(batch)
            assert not torch.allclose(got, expected, **TOL)
            with pytest.raises(StalePlanError, match="replay ran without its replay hook"):
                plans.check()
        session.close()


def test_an_unplanned_eager_forward_and_a_dropped_state_are_errors():
    model = planned_model()
    session, batch, _ = staggered_decode_case(model, 2, seed=5)
    with torch.no_grad(), forward_context(batch), pytest.raises(UnplannedForwardError, match="init_forward_metadata"):
        model(batch)
    runner = decode_runner(model, "recording")
    with torch.no_grad():
        runner.capture()
        model.cleanup_cuda_graph_state(None)  # someone else dropped the state; the graphs remain
        with pytest.raises(UnplannedForwardError, match="no per-size state"):
            runner.forward(batch)
    session.close()


def test_the_fill_value_comes_from_the_attention_and_pads_the_host_lengths():
    model = planned_model(seq_len_fill_value=2)
    runner = decode_runner(model, "full")
    assert runner.seq_len_fill_value == 2
    with torch.no_grad():
        runner.capture()
        assert all(p.seq_lens == [2] * p.key[2] for p in standin(model).plan_log if p.kind == "capture")
        session, batch, expected = staggered_decode_case(model, 1, seed=6)
        batch.seq_lens_cpu = None  # a plan needs the host lengths: a clear error, not a device read
        with pytest.raises(ValueError, match="seq_lens_cpu=None"):
            runner.forward(batch)
        session.close()


@pytest.mark.parametrize("name", sorted(PREFILL_BACKENDS))
def test_prefill_plans_every_forward(name):
    model = planned_model()
    plans = standin(model)
    runner = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [16, 32], "full_prefill_max_req": 2}},  # request slots: full's only
        device="cpu",
        backend=PREFILL_BACKENDS[name]("prefill"),
        show_progress=False,
    )
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        for lens in ([5, 9], [20, 7], [40]):  # 14 -> 16, 27 -> 32, 40: eager
            prompts = make_dummy_prompts(len(lens), lens, model.config.vocab_size, seed=sum(lens))
            batch = make_extend_batch(model.kv_cache, prompts)
            expected = eager(batch).clone()
            before = len(plans.plan_log)
            got = runner.forward(batch)
            torch.testing.assert_close(got, expected, **TOL, msg=f"{name}: lengths {lens}")
            made = list(plans.plan_log)[before:]
            if name == "disabled" or sum(lens) > 32:
                assert [p.kind for p in made] == ["eager"]
            else:
                # full pads the request axis to its 2 slots (1 request: a zero-length sentinel)
                padded = lens + [0] * (2 - len(lens)) if name == "full" else lens
                assert [p.kind for p in made] == ["replay"] and made[0].extend_seq_lens == padded
        runner.cleanup()
        assert plans.cleanups == [ForwardMode.EXTEND] and not plans.states


def test_torch_attention_has_no_hooks_and_unknown_names_are_refused():
    model = ReferenceLlamaForCausalLM.from_preset("tiny")
    assert model.attn_backend.name == "torch"
    for hook in ("init_forward_metadata", "init_forward_metadata_capture", "init_forward_metadata_replay"):
        assert getattr(model, hook) is None  # the runner's replay path: one None check
    assert attention_backend_names() == ["flashinfer", "flashinfer_tc", "planned_standin", "torch", "triton"]
    with pytest.raises(
        ValueError, match="attention='flash' .*accepted: flashinfer, flashinfer_tc, planned_standin, torch, triton"
    ):
        ReferenceLlamaForCausalLM.from_preset("tiny", attention="flash")


def test_the_standin_computes_what_torch_attention_computes():
    torch_model = ReferenceLlamaForCausalLM.from_preset("tiny")
    torch_model.create_kv_cache(num_slots=4 * CONTEXT + 1, max_reqs=5, max_context_len=CONTEXT)
    model = planned_model(requests=4)
    for m in (torch_model, model):
        session, batch, expected = staggered_decode_case(m, 3, seed=8)
        m.result = expected  # type: ignore[attr-defined]
        session.close()
    # Decode is the same computation; the stand-in's prefill reads a per-token plan
    # (extend_plan.token_table_extend), whose reduction order differs from torch's loop.
    torch.testing.assert_close(torch_model.result, model.result, **TOL)  # type: ignore[attr-defined]


def test_target_verify_and_lora_variants_get_one_state_per_size_and_variant():
    model = planned_model()
    model.add_lora_adapters(2, rank=4)
    plans = standin(model)
    verify = DecodeCudaGraphRunner(
        model,
        {"decode": {"bs": [2, 4]}},
        mode="target_verify",
        num_tokens_per_req=3,
        device="cpu",
        backend=RecordingBackend("cpu"),
        show_progress=False,
    )
    with torch.no_grad():
        verify.capture()
        keys = {(ForwardMode.TARGET_VERIFY, 3, bs, v) for bs in (2, 4) for v in ("nolora", "lora")}
        assert set(plans.states) == keys and all(plans.state_builds[k] == 1 for k in keys)
        assert verify.seq_len_fill_value == 3  # the attention's 1, raised to the width
        session = GreedySession(model, model.kv_cache)
        session.prefill(make_dummy_prompts(3, [4, 6, 5], model.config.vocab_size, seed=9))
        batch = make_target_verify_batch(model.kv_cache, session.rows, [[1, 2, 3]] * 3)
        batch.extra[LORA_IDS] = [0, -1, 1]
        expected = eager_logits_fn(model)(batch).clone()
        before = len(plans.plan_log)
        torch.testing.assert_close(verify.forward(batch), expected, **TOL)
        (replay,) = list(plans.plan_log)[before:]
        assert replay.kind == "replay" and replay.key == (ForwardMode.TARGET_VERIFY, 3, 4, "lora")
        assert replay.seq_lens == batch.seq_lens_cpu + [3]
        session.close()


def test_npu_plans_before_every_replay_and_cleanup_drops_the_state():
    """``npu`` on its recording graph module (replay computes nothing: the order only)."""
    from cuda_graph_runner.backend.pool import reset_global_graph_memory_pools
    from cuda_graph_runner_npu.backend import NPUCudaGraphBackend
    from cuda_graph_runner_npu.testing import RecordingNPUModule

    reset_global_graph_memory_pools()
    model = planned_model()
    plans = standin(model)
    fake = RecordingNPUModule()
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"bs": [2, 4]}},
        device="cpu",
        backend=NPUCudaGraphBackend("cpu", phase="decode", device_module=fake),
        show_progress=False,
    )
    try:
        with torch.no_grad():
            runner.capture()
            assert sorted(k[2] for k in plans.states) == [2, 4]
            for bs, kind in ((3, "replay"), (5, "eager")):
                session, batch, _ = staggered_decode_case(model, bs, seed=bs)
                before = len(plans.plan_log)
                runner.forward(batch)
                assert [p.kind for p in list(plans.plan_log)[before:]] == [kind]
                session.close()
            runner.cleanup()
            assert not plans.states and plans.cleanups == [ForwardMode.DECODE]
    finally:
        reset_global_graph_memory_pools()


BENCH_TINY = [
    "--batch-sizes",
    "2",
    "--iters",
    "1",
    "--warmup",
    "0",
    "--steps",
    "1",
    "--prompt-len",
    "2",
    "--no-prefill",
]


def test_bench_attention_flag_refuses_an_unknown_name_before_any_work(capsys):
    from cuda_graph_runner.cli.command import main

    with pytest.raises(SystemExit) as info:
        main(["bench", "--attention", "flash", *BENCH_TINY])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert (
        "argument --attention: 'flash' is not an attention backend; accepted: flashinfer, flashinfer_tc, "
        "planned_standin, torch" in err
    )
    assert "Traceback" not in err


def test_bench_runs_the_model_with_the_named_attention(capsys, tmp_path):
    import json

    from cuda_graph_runner.cli.command import main

    out = tmp_path / "bench.json"
    argv = ["bench", "--attention", "planned_standin", "--decode-backends", "disabled", "--json", str(out)]
    assert main([*argv, *BENCH_TINY]) == 0
    assert ", attention planned_standin" in capsys.readouterr().out
    assert json.loads(out.read_text())["env"]["attention"] == "planned_standin"


def test_one_runners_cleanup_keeps_the_state_another_runners_graphs_use():
    # Two decode runners of one mode share the model's per-size plan state: the first one's
    # cleanup and recapture must leave what the second one's graphs read.
    model = planned_model()
    a, b = decode_runner(model, "full"), decode_runner(model, "full")
    with torch.no_grad():
        a.capture()
        b.capture()
        session, batch, expected = staggered_decode_case(model, 2, seed=5)
        a.cleanup()
        torch.testing.assert_close(b.forward(batch), expected, **TOL)
        a.capture()
        session.close()
        _, batch2, expected2 = staggered_decode_case(model, 2, seed=9, decode_steps=3)
        torch.testing.assert_close(b.forward(batch2), expected2, **TOL)
        torch.testing.assert_close(a.forward(batch2), expected2, **TOL)
    assert b.stats.replays_by_size[2] == 2 and a.stats.replays_by_size[2] == 1
    model.attn_backend.check()

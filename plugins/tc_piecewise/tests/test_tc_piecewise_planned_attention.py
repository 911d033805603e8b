"""Backend ``tc_piecewise`` with a plan-based attention (CPU, emulated piece graphs): the
reference model with the ``planned_standin`` attention, whose marked op runs eagerly
between the pieces at every replay, is planned before every compile-pass forward,
capture, replay and eager fallback, in decode and prefill; the compile pass asks the
capture plan for static batches again, which re-plans without building the per-size
state twice; ``cleanup()`` drops that state."""

from __future__ import annotations

import pytest
import torch
from tc_emulated_graphs import EmulatedGraphs, recording_compiler

from cuda_graph_runner.backend import ForwardMode
from cuda_graph_runner.testing.reference_setup import staggered_decode_case
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.workload import (
    PRESETS,
    DecodeCudaGraphRunner,
    PrefillCudaGraphRunner,
    ReferenceLlamaForCausalLM,
    eager_logits_fn,
    make_dummy_prompts,
    make_extend_batch,
)
from cuda_graph_runner_tc_piecewise import compiler as tc_compiler
from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend

CONTEXT = 48
TOL = model_tolerance(PRESETS["tiny"], torch.float32, context_len=CONTEXT)


@pytest.fixture
def emulated(monkeypatch):
    dm = EmulatedGraphs()
    monkeypatch.setitem(
        tc_compiler.PIECE_COMPILERS, "eager", recording_compiler(dm, tc_compiler.PIECE_COMPILERS["eager"])
    )
    return dm


def test_plans_before_every_forward_in_both_phases(emulated):
    model = ReferenceLlamaForCausalLM.from_preset("tiny", attention="planned_standin")
    model.create_kv_cache(num_slots=12 * CONTEXT + 1, max_reqs=13, max_context_len=CONTEXT)
    plans = model.attn_backend

    def backend(phase: str) -> TcPiecewiseCudaGraphBackend:
        return TcPiecewiseCudaGraphBackend("cpu", phase=phase, device_module=emulated, enable_capture=True)

    decode = DecodeCudaGraphRunner(
        model, {"decode": {"bs": [2, 4]}}, device="cpu", backend=backend("decode"), show_progress=False
    )
    prefill = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": [16, 32]}}, device="cpu", backend=backend("prefill"), show_progress=False
    )
    with torch.no_grad():
        decode.capture()
        prefill.capture()
        keys = set(plans.states)
        assert {k[0] for k in keys} == {ForwardMode.DECODE, ForwardMode.EXTEND} and len(keys) == 4
        assert all(plans.state_builds[k] == 1 for k in keys)  # re-planned by the compile pass, built once
        for bs in (3, 5):  # padded to 4; above the largest size: eager
            session, batch, expected = staggered_decode_case(model, bs, seed=bs)
            before = len(plans.plan_log)
            torch.testing.assert_close(decode.forward(batch), expected, **TOL, msg=f"decode batch size {bs}")
            assert [p.kind for p in list(plans.plan_log)[before:]] == (["replay"] if bs <= 4 else ["eager"])
            session.close()
        eager = eager_logits_fn(model)
        for lens in ([5, 9], [40]):  # 14 tokens padded to 16; 40: eager
            prompts = make_dummy_prompts(len(lens), lens, model.config.vocab_size, seed=sum(lens))
            batch = make_extend_batch(model.kv_cache, prompts)
            expected = eager(batch).clone()
            before = len(plans.plan_log)
            torch.testing.assert_close(prefill.forward(batch), expected, **TOL, msg=f"prefill lengths {lens}")
            assert [p.kind for p in list(plans.plan_log)[before:]] == (["replay"] if sum(lens) <= 32 else ["eager"])
        # The attention ran eagerly between the pieces at each replay, with the plan made for it.
        assert [kind for kind, _, _ in plans.forwards].count("replay") == 2
        plans.check()
        decode.cleanup()
        assert {k[0] for k in plans.states} == {ForwardMode.EXTEND}  # the decode runner's state only
        prefill.cleanup()
        assert not plans.states

"""``tc_piecewise`` tensor-parallel on the CPU (gloo, 2 ranks): Dynamo traces through the
all-reduces (the opaque ``cuda_graph_runner::tp_all_reduce`` op), one trace serves every size.

One launch (:func:`cuda_graph_runner.testing.tp_launch.run_ranks`, bounded) runs every
check on both ranks; the parent asserts on what they return:

* decode and prefill replays (emulated graphs: a replay re-runs the piece on its
  capture-time tensors, all-reduces included, as a CUDA graph would) of TP=2 equal
  TP=1 eager, on captured and off-bucket sizes;
* Dynamo compile counts per rank: one graph for every size >= 2 plus one for size 1,
  made in the compile pass, none while serving (no recompile per captured size);
* both ranks compile the same pieces, split at the attentions only (the all-reduce stays
  inside the pieces), each rank's inductor cache in its own directory.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from tc_emulated_graphs import EmulatedGraphs, recording_compiler

from cuda_graph_runner.backend import envs
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.tp_launch import run_ranks
from cuda_graph_runner.testing.workload import PRESETS, ReferenceLlamaForCausalLM

CFG = PRESETS["tiny"]
PROMPTS = [[5, 9, 3], [11, 2, 8, 4, 6, 1, 10], [3, 3, 7, 1]]  # 3 requests: decode bs 3 pads to 4
DECODE_SIZES = [1, 2, 4]
PREFILL_SIZES = [8, 16]  # the prompts' 14 tokens pad to 16; a 2-token chunk runs as 8
STEPS = 3
ALL_REDUCE = "tp_all_reduce"  # in the op name Dynamo records (overload or packet)


def _install_recording_compiler(dm: EmulatedGraphs, name: str) -> None:
    """Wrap piece compiler ``name`` so a capture records how to replay the piece call."""
    from cuda_graph_runner_tc_piecewise import compiler as tc_compiler

    tc_compiler.PIECE_COMPILERS[name] = recording_compiler(dm, tc_compiler.PIECE_COMPILERS[name])


def _session(model, prefill_fn=None, decode_fn=None, chunk_size=None):
    """Prefill (optionally chunked) + STEPS decodes; float32 logits per step and the tokens."""
    from cuda_graph_runner.testing.workload import GreedySession

    session = GreedySession(model, model.kv_cache, prefill_fn=prefill_fn, decode_fn=decode_fn)
    with torch.no_grad():
        session.prefill(PROMPTS, chunk_size=chunk_size)
        for _ in range(STEPS):
            session.decode()
    session.close()
    return [x.clone() for x in session.logits], session.tokens


def _rank_checks(tp, compiler):
    """One rank: tc_piecewise decode and prefill runners on the TP=2 model."""
    from torch._dynamo.utils import counters

    from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner, PrefillCudaGraphRunner
    from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend

    torch.set_num_threads(1)  # ranks share the CI machine's cores
    dm = EmulatedGraphs()
    _install_recording_compiler(dm, compiler)
    model = ReferenceLlamaForCausalLM.from_config(CFG, seed=3, tp_group=tp)
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)

    def backend(phase):
        return TcPiecewiseCudaGraphBackend("cpu", phase=phase, compiler=compiler, device_module=dm, enable_capture=True)

    decode = DecodeCudaGraphRunner(
        model, {"decode": {"bs": DECODE_SIZES}}, device="cpu", backend=backend("decode"), show_progress=False
    )
    prefill = PrefillCudaGraphRunner(
        model, {"prefill": {"bs": PREFILL_SIZES}}, device="cpu", backend=backend("prefill"), show_progress=False
    )
    unique_before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    out = {
        "rank": tp.rank,
        "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        "compiles_after_capture": (decode.backend.dynamo_compiles, prefill.backend.dynamo_compiles),
        "pieces": [list(p.ops) for p in decode.backend.split.pieces],
        "eager_ops": decode.backend.split.eager_ops,
        "direct": (decode.backend.direct_keys == decode.backend.captured_keys),
    }
    replays = dm.replays
    out["graph"] = _session(model, prefill.forward, decode.forward)
    out["graph_chunked"] = _session(model, prefill.forward, decode.forward, chunk_size=2)
    out["replays"] = dm.replays - replays
    out["eager"] = _session(model)
    out["compiles_after_serving"] = (decode.backend.dynamo_compiles, prefill.backend.dynamo_compiles)
    out["unique_graphs"] = counters["stats"]["unique_graphs"] - unique_before
    return out


def _tp1_reference():
    model = ReferenceLlamaForCausalLM.from_config(CFG, seed=3)
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)
    return _session(model), _session(model, chunk_size=2)


def _check(results, compiler, tol):
    ref, ref_chunked = _tp1_reference()
    assert [r["rank"] for r in results] == [0, 1]
    for r in results:
        rank = f"rank {r['rank']} ({compiler})"
        for what, want in (("graph", ref), ("graph_chunked", ref_chunked), ("eager", ref)):
            logits, tokens = r[what]
            assert tokens == want[1], f"{rank} {what}: tokens differ from TP=1 eager"
            for step, (got, exp) in enumerate(zip(logits, want[0])):
                torch.testing.assert_close(got, exp, **tol, msg=f"{rank} {what} step {step}: TP=2 vs TP=1 eager")
        # Replays happened (decode bs 3 -> 4, prefill 14 -> 16 tokens and chunks -> 8).
        assert r["replays"] > 0 and r["direct"], rank
        # One Dynamo graph for sizes >= 2 and one for size 1 (decode); one for prefill;
        # all in the compile pass, none while serving.
        assert r["compiles_after_capture"] == (2, 1), f"{rank}: {r['compiles_after_capture']}"
        assert r["compiles_after_serving"] == r["compiles_after_capture"], f"{rank}: recompiled while serving"
        assert r["unique_graphs"] == 3, f"{rank}: Dynamo made {r['unique_graphs']} graphs"
        # The split is at the attentions only: the all-reduces (o_proj, down_proj, the
        # embedding's) run inside the pieces.
        assert len(r["pieces"]) == CFG.num_hidden_layers + 1
        assert all(ALL_REDUCE not in op for op in r["eager_ops"])
        reduces = sum(ALL_REDUCE in op for ops in r["pieces"] for op in ops)
        assert reduces == 2 * CFG.num_hidden_layers + 1, r["pieces"]
    # Both ranks compiled the same pieces; each has its own inductor cache directory.
    assert results[0]["pieces"] == results[1]["pieces"]
    dirs = [r["cache_dir"] for r in results]
    assert dirs[0].endswith("rank_0") and dirs[1].endswith("rank_1")


def test_tp2_tc_piecewise_eager_replay_equals_tp1_eager_without_recompiles():
    """TP=2 (gloo) tc_piecewise ``eager``: replays equal TP=1 eager; Dynamo compiles once per
    phase (plus once for decode size 1) on each rank, never while serving."""
    results = run_ranks(_rank_checks, 2, "eager", timeout_s=240)
    _check(results, "eager", model_tolerance(CFG, torch.float32, context_len=32))


@pytest.mark.skipif(
    not envs.get(envs.TEST_INDUCTOR_CPU),
    reason=f"inductor on the CPU builds C++ (about 1 min per rank with a cold cache); set "
    f"{envs.TEST_INDUCTOR_CPU}=1 to run it (the GPU tests cover inductor on CUDA)",
)
@pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None, reason="no C++ compiler")
def test_tp2_tc_piecewise_inductor_on_cpu_equals_tp1_eager():
    """The same with ``inductor`` pieces (C++ on the CPU): the custom all-reduce op passes
    through AOT autograd and inductor as an opaque call."""
    results = run_ranks(_rank_checks, 2, "inductor", timeout_s=540)
    tol = model_tolerance(CFG, torch.float32, context_len=32)
    _check(results, "inductor", {k: v * 10 for k, v in tol.items()})  # ten times, as the backend's verify_tolerance

"""GPU, 2 ranks (NCCL): tc_piecewise (``eager`` and ``inductor`` pieces) tensor-parallel, TP=2.

One spawned launch (:func:`cuda_graph_runner.testing.tp_launch.run_ranks`, bounded) runs
every check on both ranks, for each compiler:

* decode: TP=2 replay equals TP=2 eager (float32) on captured sizes (1, 2, 4, 8) and
  off-bucket sizes (3, 5: padded to 4 and 8); each replay replays every piece, whose
  CUDA graphs hold the NCCL all-reduces (``cuda_graph_runner::tp_all_reduce``);
* prefill: the same on captured and padded token counts, whole and chunked;
* Dynamo compile counts per rank (printed): decode 2 (sizes >= 2 share one graph, size 1
  is Dynamo's own), prefill 1, none while serving;
* greedy tokens over 16 steps equal TP=1 eager (float32);
* each rank compiled the same pieces, its inductor cache in a directory of its own.

``eager`` pieces run the ops eager runs: 1e-4 (as part 1's full and breakable tests).
``inductor`` fuses and reorders reductions: the backend's ``verify_tolerance`` (float32:
atol 1e-3, rtol 1e-2).

Run (on a machine with 2 GPUs):
``NCCL_NVLS_ENABLE=0 timeout 900 pytest plugins/tc_piecewise/tests/test_tc_piecewise_tp_gpu.py -s``.
"""

from __future__ import annotations

import os

import pytest
import torch

from cuda_graph_runner.testing.tp_launch import run_ranks

pytestmark = pytest.mark.gpu

COMPILERS = ("eager", "inductor")
CAPTURED = [1, 2, 4, 8]
SIZES = [1, 2, 3, 4, 5, 8]  # 3 and 5 are off the buckets
PREFILL_CASES = [(8,), (5, 3), (13,), (20, 10, 2)]  # 8 and 32 tokens captured; 13 -> 16
STEPS = 16
ALL_REDUCE = "tp_all_reduce"  # in the op name Dynamo records (overload or packet)


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton())
    except Exception:
        return False


def _rank_checks(tp):
    from cuda_graph_runner.testing.reference_setup import free_requests, reference_model, staggered_decode_case
    from cuda_graph_runner.testing.workload import (
        DecodeCudaGraphRunner,
        PrefillCudaGraphRunner,
        eager_logits_fn,
        greedy_generate,
        make_dummy_prompts,
        make_extend_batch,
    )

    out = {"rank": tp.rank, "cache_dir": os.environ.get("TORCHINDUCTOR_CACHE_DIR"), "tokens": {}}
    prompts = make_dummy_prompts(4, [5, 9, 3, 7], 256, seed=11)
    ref = reference_model("tiny", requests=16, device=tp.device, seed=3)
    out["tokens"]["tp1-eager"] = greedy_generate(ref, ref.kv_cache, prompts, STEPS)
    del ref
    for compiler in COMPILERS:
        res = out[compiler] = {"decode": {}, "prefill": {}}
        model = reference_model("tiny", requests=24, device=tp.device, seed=3, tp_group=tp)
        cache = model.kv_cache
        cfg = {
            "decode": {"backend": "tc_piecewise", "max_bs": 8, "tc_compiler": compiler},
            "prefill": {"backend": "tc_piecewise", "bs": [8, 16, 32], "tc_compiler": compiler},
        }
        decode = DecodeCudaGraphRunner(model, cfg, show_progress=False)
        prefill = PrefillCudaGraphRunner(model, cfg, show_progress=False)
        with torch.no_grad():
            decode.capture()
            prefill.capture()
        res["capture_sizes"] = decode.capture_sizes
        res["compiles_at_capture"] = (decode.backend.dynamo_compiles, prefill.backend.dynamo_compiles)
        res["pieces"] = [list(p.ops) for p in decode.backend.split.pieces]
        atol, rtol = res["tol"] = (
            decode.backend.verify_tolerance(torch.float32) if compiler == "inductor" else (1e-4, 1e-4)
        )

        def compare(got, expected):
            """(elementwise |got - expected| <= atol + rtol * |expected|, max |got - expected|)"""
            return bool(torch.allclose(got, expected, atol=atol, rtol=rtol)), (got - expected).abs().max().item()

        eager = eager_logits_fn(model)
        for bs in SIZES:
            session, batch, expected = staggered_decode_case(model, bs, seed=bs)
            with torch.no_grad():
                before = decode.backend.piece_calls().get("replay", 0)
                replayed = decode.can_run(batch)
                got = decode.forward(batch).clone()
                pieces = decode.backend.piece_calls().get("replay", 0) - before
            session.close()
            res["decode"][bs] = (replayed, pieces, tuple(got.shape), *compare(got, expected))
        for i, lens in enumerate(PREFILL_CASES):
            ps = make_dummy_prompts(len(lens), list(lens), 256, seed=30 + i)
            with torch.no_grad():
                whole = make_extend_batch(cache, ps)
                expected = eager(whole).clone()
                replayed = prefill.can_run(whole)
                got = prefill.forward(whole).clone()
                free_requests(cache, whole)
            res["prefill"][lens] = (replayed, *compare(got, expected))
        with torch.no_grad():
            out["tokens"][compiler] = greedy_generate(
                model, cache, prompts, STEPS, prefill_fn=prefill.forward, decode_fn=decode.forward
            )
        res["compiles_after_serving"] = (decode.backend.dynamo_compiles, prefill.backend.dynamo_compiles)
        decode.cleanup()
        prefill.cleanup()
        del decode, prefill, model, cache
        torch.cuda.empty_cache()
    return out


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (TP=2 with NCCL)")
@pytest.mark.skipif(torch.cuda.is_available() and not _has_triton(), reason="inductor on CUDA needs Triton")
def test_tp2_tc_piecewise_replay_equals_eager_and_tp1_tokens_without_recompiles():
    results = run_ranks(_rank_checks, 2, device_type="cuda", timeout_s=560)
    for r in results:
        rank = r["rank"]
        assert r["cache_dir"] and r["cache_dir"].endswith(f"rank_{rank}"), r["cache_dir"]
        for compiler in COMPILERS:
            res = r[compiler]
            atol, rtol = res["tol"]
            assert rtol <= 1e-2, res["tol"]  # inductor's documented float32 tolerance at most
            print(
                f"rank {rank} {compiler}: Dynamo compiles decode/prefill at capture {res['compiles_at_capture']}, "
                f"after serving {res['compiles_after_serving']}; {len(res['pieces'])} pieces; "
                f"max |replay - eager| decode {max(d[4] for d in res['decode'].values()):.2e}, "
                f"prefill {max(p[2] for p in res['prefill'].values()):.2e}; cache {r['cache_dir']}"
            )
            assert res["capture_sizes"] == CAPTURED, res["capture_sizes"]
            assert res["compiles_at_capture"] == (2, 1), (compiler, res["compiles_at_capture"])
            assert res["compiles_after_serving"] == res["compiles_at_capture"], f"{compiler}: recompiled while serving"
            assert sum(ALL_REDUCE in op for ops in res["pieces"] for op in ops) > 0, res["pieces"]
            for bs, (replayed, pieces, shape, close, diff) in res["decode"].items():
                what = f"rank {rank} {compiler} decode bs={bs}"
                assert shape == (bs, 256), (what, shape)
                assert replayed and pieces == len(res["pieces"]), f"{what}: {pieces} piece replays"
                assert close, f"{what}: replay differs from eager by {diff} (atol {atol}, rtol {rtol})"
            for lens, (replayed, close, diff) in res["prefill"].items():
                what = f"rank {rank} {compiler} prefill {list(lens)}"
                assert replayed, f"{what}: no graph covered the batch"
                assert close, f"{what}: replay differs from eager by {diff} (atol {atol}, rtol {rtol})"
            assert r["tokens"][compiler] == r["tokens"]["tp1-eager"], f"rank {rank} {compiler}: TP=2 tokens"
    for compiler in COMPILERS:
        assert results[0][compiler]["pieces"] == results[1][compiler]["pieces"], f"{compiler}: ranks' pieces differ"

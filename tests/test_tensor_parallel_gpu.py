"""GPU, 2 ranks (NCCL): full and breakable graphs with the all-reduces inside, TP=2.

One spawned launch (``run_ranks``, bounded) runs every check on both ranks:

* TP=2 replay equals TP=2 eager (float32) on captured sizes and off-bucket sizes;
* TP=2 graph greedy tokens over 16 steps equal TP=1 eager (float32);
* bfloat16: the match rate of TP=2 graph tokens against TP=1 eager is printed (reduction
  order differs, so tokens may differ; not asserted).

Run (on a machine with 2 GPUs): ``NCCL_NVLS_ENABLE=0 pytest tests/test_tensor_parallel_gpu.py -s``.
"""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.testing.tp_launch import run_ranks

pytestmark = pytest.mark.gpu

BACKENDS = ("full", "breakable")
CAPTURED = [1, 2, 4, 8]
SIZES = [1, 2, 3, 4, 5, 8]  # 3 and 5 are off the buckets (padded to 4 and 8)
STEPS = 16


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _rank_checks(tp):
    from cuda_graph_runner.reference.batches import greedy_generate, make_dummy_prompts
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.reference_setup import reference_model, staggered_decode_case

    out = {"rank": tp.rank, "diffs": {}, "tokens": {}, "bf16": {}}
    prompts = make_dummy_prompts(4, [5, 9, 3, 7], 256, seed=11)

    def tp2_runner(dtype, backend):
        """The TP=2 model (same weights as TP=1's, seed 3) and its captured decode runner."""
        model = reference_model("tiny", requests=16, dtype=dtype, device=tp.device, seed=3, tp_group=tp)
        runner = DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "max_bs": 8}}, show_progress=False)
        runner.capture()
        return model, runner

    ref = reference_model("tiny", requests=16, device=tp.device, seed=3)
    out["tokens"]["tp1-eager"] = greedy_generate(ref, ref.kv_cache, prompts, STEPS)
    for backend in BACKENDS:
        model, runner = tp2_runner(torch.float32, backend)
        cache = model.kv_cache
        assert runner.capture_sizes == CAPTURED, runner.capture_sizes
        for bs in SIZES:
            session, batch, expected = staggered_decode_case(model, bs, seed=bs)
            with torch.no_grad():
                replayed = runner.can_run(batch)
                got = runner.forward(batch).clone()
            session.close()
            out["diffs"][(backend, bs)] = (replayed, tuple(got.shape), (got - expected).abs().max().item())
        out["tokens"][backend] = greedy_generate(model, cache, prompts, STEPS, decode_fn=runner.forward)
        runner.cleanup()
        del runner, model, cache
        torch.cuda.empty_cache()
    # bfloat16: TP=2 graph vs TP=1 eager, match rate only.
    ref16 = reference_model("tiny", requests=16, dtype=torch.bfloat16, device=tp.device, seed=3)
    want = greedy_generate(ref16, ref16.kv_cache, prompts, STEPS)
    for backend in BACKENDS:
        model, runner = tp2_runner(torch.bfloat16, backend)
        got = greedy_generate(model, model.kv_cache, prompts, STEPS, decode_fn=runner.forward)
        same = sum(a == b for gs, ws in zip(got, want) for a, b in zip(gs, ws))
        out["bf16"][backend] = same / sum(len(w) for w in want)
        runner.cleanup()
    return out


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA devices (TP=2 with NCCL)")
def test_tp2_full_and_breakable_replay_equals_eager_and_tp1_tokens():
    results = run_ranks(_rank_checks, 2, device_type="cuda", timeout_s=540)
    for r in results:
        for (backend, bs), (replayed, shape, diff) in r["diffs"].items():
            assert shape == (bs, 256), (backend, bs, shape)
            assert replayed, f"rank {r['rank']} {backend} bs={bs}: no graph covered the batch"
            assert diff <= 1e-4, f"rank {r['rank']} {backend} bs={bs}: replay differs from eager by {diff}"
        for backend in BACKENDS:
            assert r["tokens"][backend] == r["tokens"]["tp1-eager"], f"rank {r['rank']} {backend}: TP=2 tokens"
        print(
            f"rank {r['rank']}: bf16 TP=2 graph vs TP=1 eager token match rate over {STEPS} steps: "
            + ", ".join(f"{b} {rate:.1%}" for b, rate in r["bf16"].items())
        )

"""Backend ``compiled``'s warm start across processes: the inductor caches under the
compile cache root, so a fresh process generates no code (Dynamo traces again: the
traced-code layer is off for this backend, see its ``capture_one``), computes what the
cold start computed, and still reads the model's live weights.

The fresh process runs with another intra-op thread count than the cold one (the
bench picks its own on a CPU, a user's script keeps torch's): inductor's C++ kernels
read the count at run time inside the cache scope, so one entry serves both.

One inductor compile of the ``tiny`` preset in this process (cold, tens of seconds on two cores)
and one fresh process (warm, a few seconds); skipped with the reason where inductor
cannot build here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cuda_graph_runner.backend import envs
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.workload import ModelConfig
from cuda_graph_runner_compiled import toolchain

TOL = model_tolerance(ModelConfig(), torch.float32, context_len=64)

# One start: the tiny preset (seed 0), a runner compiling size 2 with inductor, one decode step.
# Prints the cache counters, Dynamo's traced frames, the logits (the cold start's, to
# compare), and, with the weights then changed in place, the largest difference between
# the compiled forward and eager (a cache hit must not have baked the old weights in).
START = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from cuda_graph_runner.backend.compile_cache import cache_counters
    from cuda_graph_runner.testing.workload import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.workload import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.testing.workload import ReferenceLlamaForCausalLM
    from cuda_graph_runner.testing.tolerances import model_tolerance
    from cuda_graph_runner_compiled.backend import CompiledBackend

    def start():
        model = ReferenceLlamaForCausalLM.from_preset("tiny")
        model.create_kv_cache(num_slots=4 * 64 + 1, max_reqs=5, max_context_len=64)
        backend = CompiledBackend("cpu", phase="decode", compiler="inductor")
        runner = DecodeCudaGraphRunner(model, {"decode": {"bs": [2]}}, device="cpu", backend=backend,
                                       show_progress=False)
        with torch.no_grad():
            runner.capture()
            session = GreedySession(model, model.kv_cache)
            session.prefill(make_dummy_prompts(2, [3, 5], model.config.vocab_size, seed=7))
            session.decode()
            batch = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
            logits = runner.forward(batch).clone()
            for p in model.parameters():
                p.mul_(1.25)
            got, expected = runner.forward(batch), eager_logits_fn(model)(batch)
        session.close()
        tol = model_tolerance(model.config, torch.float32, context_len=64)
        return {"counters": cache_counters(), "traced": int(counters["stats"]["unique_graphs"]),
                "logits": logits.tolist(), "changed_weights_close": torch.allclose(got, expected, **tol),
                "changed_weights_max_diff": (got - expected).abs().max().item(),
                "threads": torch.get_num_threads()}
    """
)


@pytest.mark.skipif(toolchain.probe("cpu") is not None, reason=f"inductor cannot build here: {toolchain.probe('cpu')}")
def test_a_fresh_process_with_other_threads_compiles_from_the_inductor_cache_and_computes_the_same(
    tmp_path, monkeypatch
):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    env = dict(os.environ, **{envs.CACHE_DIR: str(tmp_path)})

    def fresh_start(threads: "int | None") -> dict:
        # Both starts in fresh processes: a test worker's global state (left by the tests
        # before it) must not key the cold start's graphs differently from the warm one's.
        setup = f"\ntorch.set_num_threads({threads})" if threads else ""
        script = START + setup + "\nprint('RESULT ' + json.dumps(start()))\n"
        proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
        results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        assert proc.returncode == 0 and results, proc.stderr[-3000:]
        return json.loads(results[-1][len("RESULT ") :])

    cold = fresh_start(None)
    cold_counts = cold["counters"]
    assert cold_counts["fx_miss"] >= 1 and cold_counts["dynamo_hit"] == 0, cold_counts
    threads = 1 if cold["threads"] != 1 else 2
    warm = fresh_start(threads)

    assert warm["threads"] == threads != cold["threads"], (warm["threads"], cold["threads"])
    counts = warm["counters"]
    # The inductor caches only (capture_one says why): Dynamo traces again, no package is
    # looked up, and no code is generated (FX graph cache hit).
    assert counts["dynamo_hit"] == 0 and counts["dynamo_miss"] == 0, counts
    assert counts["fx_miss"] == 0 and counts["aot_miss"] == 0 and counts["fx_hit"] >= 1, counts
    assert counts["fx_hit"] + counts["aot_hit"] >= cold_counts["fx_miss"], (counts, cold_counts)
    assert any((tmp_path / "compile").rglob("*")), "nothing was written under the cache root"
    torch.testing.assert_close(torch.tensor(warm["logits"]), torch.tensor(cold["logits"]), **TOL)
    for start in (cold, warm):
        assert start["changed_weights_close"], start["changed_weights_max_diff"]

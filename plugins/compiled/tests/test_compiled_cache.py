"""Backend ``compiled``'s warm start across processes: Dynamo's traced code comes from
the compile cache (cuda_graph_runner.compile_cache_dynamo), so a fresh process neither
traces nor generates code, computes what the cold start computed, still reads the
model's live weights, and a model of another config or dtype, or other compile options,
gets another key (never this entry).

One inductor compile in this process (cold, ~15 s on two cores) and one fresh process
(warm, a few seconds); skipped with the reason where inductor cannot build here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from cuda_graph_runner import envs
from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.compile_cache import cache_counters
from cuda_graph_runner.testing.model import ModelConfig, ReferenceLlamaForCausalLM
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner_compiled import toolchain
from cuda_graph_runner_compiled.backend import CompiledBackend

CONFIG = ModelConfig(num_hidden_layers=1)
TOL = model_tolerance(CONFIG, torch.float32, context_len=64)

# One start: the model (seed 0), a runner compiling size 2 with inductor, one decode step.
# Prints the cache counters, Dynamo's traced frames, the logits (the cold start's, to
# compare), and, with the weights then changed in place, the largest difference between
# the compiled forward and eager (a cache hit must not have baked the old weights in).
START = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch._dynamo.utils import counters
    from cuda_graph_runner.compile_cache import cache_counters
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.testing.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.testing.model import ModelConfig, ReferenceLlamaForCausalLM
    from cuda_graph_runner.testing.tolerances import model_tolerance
    from cuda_graph_runner_compiled.backend import CompiledBackend

    def start():
        model = ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=1))
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
                "changed_weights_max_diff": (got - expected).abs().max().item()}
    """
)


@pytest.mark.skipif(toolchain.probe("cpu") is not None, reason=f"inductor cannot build here: {toolchain.probe('cpu')}")
def test_a_fresh_process_loads_the_traced_code_and_computes_what_the_cold_start_did(tmp_path, monkeypatch):
    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    namespace: dict = {}
    exec(compile(START, "<start>", "exec"), namespace)  # the same code as the fresh process
    torch._dynamo.reset()
    before = cache_counters()
    cold = namespace["start"]()
    torch._dynamo.reset()
    cold_counts = {k: v - before[k] for k, v in cold["counters"].items()}
    assert cold_counts["dynamo_miss"] == 1 and cold_counts["dynamo_hit"] == 0, cold_counts
    assert any((tmp_path / "compile").rglob("dynamo/*/*/entry")), "no Dynamo package was written"

    env = dict(os.environ, **{envs.CACHE_DIR: str(tmp_path)})
    script = START + "\nprint('RESULT ' + json.dumps(start()))\n"
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    results = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and results, proc.stderr[-3000:]
    warm = json.loads(results[-1][len("RESULT ") :])

    counts = warm["counters"]
    assert counts["dynamo_hit"] == 1 and counts["dynamo_miss"] == 0 and counts["dynamo_error"] == 0, counts
    assert warm["traced"] == 0, "Dynamo traced again in the warm start"
    assert counts["fx_miss"] == 0 and counts["aot_miss"] == 0, counts  # and generated no code
    torch.testing.assert_close(torch.tensor(warm["logits"]), torch.tensor(cold["logits"]), **TOL)
    for start in (cold, warm):
        assert start["changed_weights_close"], start["changed_weights_max_diff"]


def _key(model, **backend_options) -> str:
    backend = CompiledBackend(
        "cpu", phase=backend_options.pop("phase", "decode"), compiler="inductor", **backend_options
    )
    backend._model = model  # what prepare(plan) sets; the key needs nothing else
    return backend._cache_key(ShapeKey(2))


def test_another_config_dtype_phase_or_option_gets_another_key():
    base = ReferenceLlamaForCausalLM.from_config(CONFIG)
    key = _key(base)
    assert key == _key(ReferenceLlamaForCausalLM.from_config(CONFIG, seed=3))  # weights' values are inputs
    assert key != _key(ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=1, hidden_size=128)))
    assert key != _key(ReferenceLlamaForCausalLM.from_config(CONFIG, dtype=torch.bfloat16))
    assert key != _key(ReferenceLlamaForCausalLM.from_config(ModelConfig(num_hidden_layers=1, rms_norm_eps=1e-5)))
    assert key != _key(base, phase="prefill")
    assert key != _key(base, inductor_options={"cpp_wrapper": False})
    other_size = CompiledBackend("cpu", phase="decode", compiler="inductor")
    other_size._model = base
    assert key != other_size._cache_key(ShapeKey(4))
    assert CompiledBackend("cpu", phase="decode", compiler="aot_eager")._cache_key(ShapeKey(2)) is None


def _small(x):
    return torch.sin(x) * 2 + 1


@pytest.mark.skipif(toolchain.probe("cpu") is not None, reason=f"inductor cannot build here: {toolchain.probe('cpu')}")
def test_a_guard_miss_after_a_load_traces_again_instead_of_failing(tmp_path, monkeypatch):
    """A loaded package brings the global names its process gave its code (a counter from
    0); a trace in the loading process after a guard miss (another input shape) must not
    pick one of them. A fresh process is simulated by restarting torch's counter."""
    import itertools

    import torch._dynamo.bytecode_transformation as bytecode_transformation

    from cuda_graph_runner.compile_cache import compile_cache_scope

    monkeypatch.setenv(envs.CACHE_DIR, str(tmp_path))
    monkeypatch.delenv(envs.COMPILE_CACHE_DYNAMO, raising=False)
    options = {"cpp_wrapper": False}
    results = []
    for shapes in ([4], [4, 6]):  # the cold start, then a warm one that also meets a new shape
        torch._dynamo.reset()
        monkeypatch.setattr(bytecode_transformation, "_unique_id_counter", itertools.count())
        before = cache_counters()
        with compile_cache_scope("guard-miss-test"):
            compiled = torch.compile(_small, backend="inductor", dynamic=False, fullgraph=True, options=options)
            for n in shapes:
                x = torch.arange(n, dtype=torch.float32)
                torch.testing.assert_close(compiled(x), _small(x))
        results.append({k: v - before[k] for k, v in cache_counters().items()})
    torch._dynamo.reset()
    cold, warm = results
    assert cold["dynamo_miss"] == 1 and warm["dynamo_hit"] == 1, results
    assert warm["fx_miss"] == 1, results  # only the new shape generated code

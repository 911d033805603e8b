"""GPU: a captured graph's cuBLAS workspace belongs to the graph (pool.py).

``benchmarks/run.py`` died with ``CUDA error: an illegal memory access`` replaying a
graph after ``torch.compile(mode="reduce-overhead")`` had recorded its CUDA-graph trees
(which drop cuBLAS's cached workspaces) and ``empty_cache()`` had run: the graph's GEMMs
still wrote the freed workspace. Each case runs in a child process, so a fault cannot
poison the CUDA context of the tests after it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from cuda_graph_runner.runner import DecodeCudaGraphRunner
    from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts
    from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM

    backend = sys.argv[1]
    model = ReferenceLlamaForCausalLM.from_preset("llama-3.2-1b", dtype=torch.bfloat16, device="cuda")
    model.create_kv_cache(num_slots=42 * 48 + 1, max_reqs=42, max_context_len=48)
    runner = DecodeCudaGraphRunner(
        model, {"decode": {"backend": backend, "max_bs": 32}}, show_progress=False
    )
    runner.capture()
    batches = {}
    for bs in (1, 8, 32):
        session = GreedySession(model, model.kv_cache)
        with torch.no_grad():
            session.prefill(make_dummy_prompts(bs, 16, model.config.vocab_size, seed=bs))
        batches[bs] = make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens])
    eager = eager_logits_fn(model)
    with torch.no_grad():
        want = {bs: eager(b).float() for bs, b in batches.items()}
    # What another library does between two replays: CUDA-graph trees drop every cached
    # cuBLAS workspace when they record, an engine empties the cache, tensors take the memory.
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    fillers = [torch.full((4 << 20,), 7.0, device="cuda") for _ in range(32)]
    with torch.no_grad():
        for bs, b in batches.items():
            got = runner.forward(b).float()
            torch.cuda.synchronize()
            diff = (got - want[bs]).abs().max().item()
            assert diff <= 0.5, f"bs={bs}: max |diff| {diff} vs eager"
    assert all(bool((f == 7.0).all()) for f in fillers), "a replay wrote into another tensor"
    print("ok", backend)
    """
)


@pytest.mark.parametrize("backend", ["full", "breakable"])
def test_replay_survives_dropped_cublas_workspaces_and_empty_cache(backend):
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, backend], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and f"ok {backend}" in proc.stdout, (
        f"exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    )

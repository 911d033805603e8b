"""GPU: ``cuda-graph-runner inspect`` on real captures, and eager-through mode on a real graph.

* ``inspect --json`` with ``full`` decode and ``breakable`` prefill on the tiny reference
  model: exit 0; every ``full`` graph reports its CUDA graph nodes and kernels (kept
  templates, :mod:`cuda_graph_runner.backend.graph_nodes`), kernels > 0 and <= nodes; every
  ``breakable`` graph its segments (one more than the marked ops between them) and the
  nodes summed over its segments; each runner its capture seconds and graph memory;
* a runner in eager-through mode with verify on gives eager's tokens on a real capture
  and replays no graph.

Run on the device machine: ``python -m pytest tests/test_inspect_gpu.py``.
"""

from __future__ import annotations

import json

import pytest
import torch

from cuda_graph_runner.cli.command import main
from cuda_graph_runner.reference.batches import GreedySession, make_dummy_prompts
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner

pytestmark = pytest.mark.gpu


def test_inspect_reports_nodes_segments_and_memory_of_real_captures(capsys):
    code = main(
        [
            "inspect",
            "--model",
            "tiny",
            "--dtype",
            "float32",
            "--batch-sizes",
            "4",
            "--prefill-tokens",
            "64",
            "--decode-backends",
            "full",
            "--prefill-backends",
            "breakable",
            "--json",
        ]
    )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    decode, prefill = json.loads(captured.out)
    assert decode["backend"] == "full" and prefill["backend"] == "breakable"
    for doc in (decode, prefill):
        assert doc["capture_seconds"] > 0 and doc["graph_memory_bytes"] > 0
        assert doc["graphs"] and all(g["capture_seconds"] > 0 for g in doc["graphs"])
    for g in decode["graphs"]:
        assert isinstance(g["nodes"], int) and 0 < g["kernels"] <= g["nodes"], g
    for g in prefill["graphs"]:
        assert g["segments"] == len(g["ops_between"]) + 1 >= 2, g
        assert isinstance(g["nodes"], int) and g["nodes"] == sum(g["segment_nodes"]) > 0, g


def test_eager_through_with_verify_gives_eager_tokens_on_a_real_capture(monkeypatch):
    monkeypatch.delenv("CUDA_GRAPH_RUNNER_EAGER_THROUGH", raising=False)
    model = ReferenceLlamaForCausalLM.from_preset("tiny", dtype=torch.float32, device="cuda")
    model.create_kv_cache(num_slots=1024, max_reqs=16, max_context_len=48)
    runner = DecodeCudaGraphRunner(
        model,
        {"decode": {"backend": "full", "bs": [1, 2, 4], "eager_through": True, "verify": True, "verify_every": 1}},
        show_progress=False,
    )
    with torch.no_grad():
        runner.capture()
    prompts = make_dummy_prompts(3, 6, model.config.vocab_size, seed=5)
    tokens = []
    for decode_fn in (runner.forward, None):
        session = GreedySession(model, model.kv_cache, decode_fn=decode_fn)
        with torch.no_grad():
            session.prefill(prompts)
            for _ in range(5):
                session.decode()
        tokens.append(session.tokens)
        session.close()
    assert tokens[0] == tokens[1]
    assert len(runner.verifier.checked) == 5 and runner.describe()["replays"] == 5
    runner.cleanup()

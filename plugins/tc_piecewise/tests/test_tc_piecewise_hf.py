"""Backend ``tc_piecewise`` with a Hugging Face transformers model (the adapter ``HFCausalLM``
of cuda_graph_runner.testing.workload; CPU, emulated piece graphs): Dynamo traces transformers' own Mistral code, split at the
adapter's marked attention op; 5 ragged prompts in one continuous batch, decoded through
the piece graphs with verify mode on, give the greedy tokens of transformers' eager
``generate()`` of each prompt alone."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "transformers", reason="the HF adapter needs transformers: pip install 'cuda-graph-runner[transformers]'"
)

from tc_emulated_graphs import EmulatedGraphs, recording_compiler  # noqa: E402

from cuda_graph_runner.testing.hf_cases import hf_generate, ragged_prompts, run_continuous_batch, tiny_models  # noqa: E402
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,  # noqa: E402
    eager_logits_fn,  # noqa: E402
)
from cuda_graph_runner_tc_piecewise import compiler as tc_compiler  # noqa: E402
from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend  # noqa: E402


@pytest.fixture
def emulated(monkeypatch):
    dm = EmulatedGraphs()
    monkeypatch.setitem(
        tc_compiler.PIECE_COMPILERS, "eager", recording_compiler(dm, tc_compiler.PIECE_COMPILERS["eager"])
    )
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: one intra-op thread (see tests/test_hf_adapter.py)
    yield dm
    torch.set_num_threads(before)


@pytest.mark.filterwarnings("ignore:tc_piecewise for decode captures piecewise graphs")
def test_hf_mistral_continuous_batch_through_piece_graphs_matches_hf_generate(emulated):
    adapter, reference = tiny_models("mistral")
    prompts = ragged_prompts(adapter.config.vocab_size)
    expected = [hf_generate(reference, p) for p in prompts]
    adapter.create_kv_cache(num_slots=300, max_reqs=8, max_context_len=64)
    backend = TcPiecewiseCudaGraphBackend("cpu", phase="decode", device_module=emulated, enable_capture=True)
    decode = DecodeCudaGraphRunner(
        adapter, {"decode": {"bs": [1, 2, 4, 8], "verify": True}}, device="cpu", backend=backend, show_progress=False
    )
    with torch.no_grad():
        decode.capture()
    got = run_continuous_batch(adapter, prompts, eager_logits_fn(adapter), decode.forward)
    assert not decode.stats.fallbacks and len(decode.stats.replays_by_size) >= 3
    assert got == expected

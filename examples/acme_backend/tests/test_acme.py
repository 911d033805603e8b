"""What ``acme`` adds beyond the contract: call counts and graph-invariant checks."""

from __future__ import annotations

import pytest
import torch

from acme_cgr.backend import AcmeDebugBackend, GraphInvariantError
from cuda_graph_runner.backend import ShapeKey
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    GreedySession,
    ReferenceLlamaForCausalLM,
    list_backends,
    make_decode_batch,
    make_dummy_prompts,
)


@pytest.fixture()
def model():
    m = ReferenceLlamaForCausalLM.from_preset("tiny", device="cpu")
    m.create_kv_cache(num_slots=256, max_reqs=9, max_context_len=32)
    return m


def test_selected_by_name_from_a_config(model):
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": "acme", "max_bs": 4}}, show_progress=False)
    assert isinstance(runner.backend, AcmeDebugBackend)
    assert {e.name: e.distribution for e in list_backends()}["acme"] == "cuda-graph-runner-acme"


def test_counts_follow_the_runner_policy(model):
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": "acme", "max_bs": 4}}, show_progress=False)
    with torch.no_grad():
        runner.capture()
        backend = runner.backend
        assert backend.captured_keys == [ShapeKey(s, "decode") for s in (4, 2, 1)]  # largest first
        # The base warm-up loop (policy ``auto``): the first size fully, later sizes once.
        assert backend.stats_total("warmup") == backend.num_warmups + 2
        session = GreedySession(model, model.kv_cache)
        session.prefill(make_dummy_prompts(3, 5, model.config.vocab_size))
        runner.forward(make_decode_batch(model.kv_cache, session.rows, None, [t[-1] for t in session.tokens]))
    assert backend.stats["replay", ShapeKey(4, "decode")] == 1  # 3 requests padded to 4
    assert backend.graph_memory_bytes() > 0


def test_replay_writes_into_the_captured_output_like_a_graph():
    backend = AcmeDebugBackend("cpu")
    value = [1.0]
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(2), lambda: torch.full((2,), value[0]))
    static = _static()
    first = backend.replay(ShapeKey(2), static)
    value[0] = 5.0
    second = backend.replay(ShapeKey(2), static)
    assert second is first and second.eq(5.0).all()  # one tensor, overwritten by each replay
    assert backend.stats["replay", ShapeKey(2)] == 2


def test_output_shape_change_is_reported():
    backend = AcmeDebugBackend("cpu")
    sizes = iter([2, 2, 2, 3])
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(2), lambda: torch.zeros(next(sizes)))
    with pytest.raises(GraphInvariantError, match=r"output was \(2,\) torch.float32 at capture, now \(3,\)"):
        backend.replay(ShapeKey(2), _static())


def test_moved_static_inputs_are_reported():
    backend = AcmeDebugBackend("cpu")
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(1), lambda: torch.zeros(1))
    backend.replay(ShapeKey(1), _static())
    with pytest.raises(GraphInvariantError, match=r"static input\(s\) \['input_ids'.*moved"):
        backend.replay(ShapeKey(1), _static())  # fresh tensors: new addresses


def test_capture_outside_session_and_double_capture_are_refused():
    backend = AcmeDebugBackend("cpu")
    with pytest.raises(GraphInvariantError, match="outside capture_session"):
        backend.capture_one(ShapeKey(1), lambda: torch.zeros(1))
    with backend.capture_session(None):
        backend.capture_one(ShapeKey(1), lambda: torch.zeros(1))
        with pytest.raises(ValueError, match="already captured"):  # the base table's error
            backend.capture_one(ShapeKey(1), lambda: torch.zeros(1))
    with pytest.raises(KeyError, match="no graph captured"):
        backend.replay(ShapeKey(2), _static())


_KEEP = []


def _static():
    from cuda_graph_runner.backend import ForwardBatch, ForwardMode

    t = torch.zeros(1, dtype=torch.int64)
    batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE,
        input_ids=t.clone(),
        positions=t.clone(),
        out_cache_loc=t.clone(),
        req_pool_indices=t.clone(),
        seq_lens=t.clone().int(),
    )
    _KEEP.append(batch)  # keep the tensors alive so a new batch cannot reuse their addresses
    return batch

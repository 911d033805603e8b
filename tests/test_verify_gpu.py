"""GPU: the host-value guard and verify mode on full, breakable and tc_piecewise.

* the host-branch model (hidden x2.0 when ``max(seq_lens_cpu) > 8``) is refused at capture
  with ``CudaGraphHostValueError`` naming ``seq_lens_cpu``;
* with ``host_value_guard: false`` it captures, and verify mode (``verify_first_n=2``,
  ``verify_every=3``) raises ``CudaGraphVerifyError`` at replay 6, the first sampled replay
  whose live lengths exceed 8 (replays 1-3 have lengths 4-6 and pass), in decode on all
  three backends and in prefill on breakable;
* the reference model passes verify mode on every replay, in decode on all three backends
  (float32 and bfloat16, the backends' default tolerances) and in prefill on breakable and
  tc_piecewise.

Run on the device machine: ``python -m pytest tests/test_verify_gpu.py``.
"""

from __future__ import annotations

import pytest
import torch
from host_branch_model import THRESHOLD, make_model

from cuda_graph_runner.backend.errors import CudaGraphHostValueError, CudaGraphVerifyError
from cuda_graph_runner.reference.batches import GreedySession, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner

pytestmark = pytest.mark.gpu

DECODE_BACKENDS = ["full", "breakable", "tc_piecewise"]
PREFILL_BACKENDS = ["breakable", "tc_piecewise"]
VERIFY_ENV = ("CUDA_GRAPH_RUNNER_VERIFY", "CUDA_GRAPH_RUNNER_VERIFY_FIRST_N", "CUDA_GRAPH_RUNNER_VERIFY_EVERY")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in VERIFY_ENV:
        monkeypatch.delenv(name, raising=False)


def _uninstall(runner) -> None:
    runner.cleanup()
    uninstall = getattr(runner.backend, "uninstall", None)  # tc_piecewise gives the model its forward back
    if uninstall is not None:
        uninstall()


def decode_runner(model, backend: str, **phase) -> DecodeCudaGraphRunner:
    return DecodeCudaGraphRunner(model, {"decode": {"backend": backend, "bs": [1, 2, 4], **phase}}, show_progress=False)


def prefill_runner(model, backend: str, **phase) -> PrefillCudaGraphRunner:
    return PrefillCudaGraphRunner(
        model, {"prefill": {"backend": backend, "bs": [16, 32, 64], **phase}}, show_progress=False
    )


def run_decode_session(model, runner, prompt_len: int, steps: int) -> None:
    """Prefill 2 prompts eagerly, then ``steps`` decode steps through ``runner`` (one key: bs 2)."""
    session = GreedySession(model, model.kv_cache, decode_fn=runner.forward)
    try:
        with torch.no_grad():
            session.prefill(make_dummy_prompts(2, prompt_len, model.config.vocab_size, seed=7))
            for _ in range(steps):
                session.decode()
    finally:
        session.close()


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_host_branch_model_is_refused_at_capture(backend):
    model = make_model(device="cuda")
    runner = decode_runner(model, backend)
    try:
        with torch.no_grad(), pytest.raises(CudaGraphHostValueError) as info:
            runner.capture()
        assert info.value.field == "seq_lens_cpu" and info.value.backend == backend
        assert "host_value_guard" in str(info.value) and "eager_op" in str(info.value)
    finally:
        _uninstall(runner)


@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_guard_off_verify_catches_the_branch_flipping_on_a_later_batch(backend):
    model = make_model(device="cuda")
    runner = decode_runner(model, backend, host_value_guard=False, verify=True, verify_first_n=2, verify_every=3)
    try:
        with torch.no_grad():
            runner.capture()
        # Prompts of 3 tokens: decode lengths 4, 5, 6, 7, 8, 9, ...; replays 1, 2, 3 are
        # checked and pass, 4 and 5 are not checked, 6 (length 9 > 8) is checked and fails.
        with pytest.raises(CudaGraphVerifyError) as info:
            run_decode_session(model, runner, 3, 8)
        err = info.value
        assert err.replay_index == 6 and err.key == runner.make_key(2)
        assert err.phase == "decode" and err.backend == backend and err.max_abs_diff > 1e-3
        assert [n for _, n in runner.verifier.checked] == [1, 2, 3, 6]
    finally:
        _uninstall(runner)


def test_guard_off_verify_catches_the_host_branch_in_prefill_with_breakable():
    """Capture's dummy requests are 16..64 tokens long (the 2.0 branch); a short live batch flips it.

    (Not tc_piecewise: a prefill replay passes the live request-axis tensors, so it goes
    through Dynamo, whose guard on the traced host list recompiles instead of replaying
    the frozen branch, with a RuntimeWarning.)"""
    model = make_model(device="cuda", context=64)
    runner = prefill_runner(model, "breakable", host_value_guard=False, verify=True)
    try:
        with torch.no_grad():
            runner.capture()
            batch = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [3, 4, 5], model.config.vocab_size))
            assert runner.can_run(batch) and max(batch.seq_lens_cpu) <= THRESHOLD
            with pytest.raises(CudaGraphVerifyError, match="phase 'prefill'"):
                runner.forward(batch)
    finally:
        _uninstall(runner)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", DECODE_BACKENDS)
def test_reference_model_passes_verify_in_decode(backend, dtype):
    model = make_model(ReferenceLlamaForCausalLM, device="cuda", dtype=dtype)
    runner = decode_runner(model, backend, verify=True, verify_every=1)
    try:
        with torch.no_grad():
            runner.capture()
        run_decode_session(model, runner, 3, 10)  # lengths 4..13: every replay checked
        assert len(runner.verifier.checked) == 10
    finally:
        _uninstall(runner)


@pytest.mark.parametrize("backend", PREFILL_BACKENDS)
def test_reference_model_passes_verify_in_prefill(backend):
    model = make_model(ReferenceLlamaForCausalLM, device="cuda", context=64)
    runner = prefill_runner(model, backend, verify=True, verify_every=1)
    V = model.config.vocab_size
    try:
        with torch.no_grad():
            runner.capture()
            first = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [3, 9, 5], V, seed=1))  # 17 -> 32
            rows = first.req_pool_indices.tolist()
            # Chunked prefill: cached prefixes next to each other, 40 tokens -> 64.
            second = make_extend_batch(model.kv_cache, make_dummy_prompts(3, [12, 20, 8], V, seed=2), rows=rows)
            for batch in (first, second):
                assert runner.can_run(batch)
                runner.forward(batch)
            for r in rows:
                model.kv_cache.free_request(r)
        assert len(runner.verifier.checked) == 2
    finally:
        _uninstall(runner)

"""GPU: graph memory on the reference model in bfloat16 (llama-3.2-1b shapes; the
estimate on qwen2.5-0.5b too), every CUDA backend.

* The estimate before the KV cache (``estimate_graph_memory`` against the smallest cache
  of the engine's ``max_reqs`` and ``max_context_len``) is within 10% or 64 MiB of the
  real pool, per phase (decode, then prefill into the same pool) and in total.
* ``sleep()`` gives >= 95% of the pool back (:func:`_free`); ``wake()``
  of the 36 default decode sizes replays equal to eager; its time and its ratio to the
  first capture are printed (``-s``) and recorded as test properties, not asserted.
* 20 sleep/wake cycles with the weights updated in place between them: free memory flat,
  replays follow the new weights (equal to eager, different from the step before).
* Re-assigned weights: ``check_weights()`` and ``check_weights_every`` raise.
* The shared pool goes back when the decode and the prefill runner both sleep.
"""

from __future__ import annotations

import gc
import time

import pytest
import torch

from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts
from cuda_graph_runner.reference.model import PRESETS
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.runner.memory_estimate import estimate_graph_memory
from cuda_graph_runner.runner.weights import StaleWeightsError
from cuda_graph_runner.testing.reference_setup import prefilled_decode_batch, reference_model
from cuda_graph_runner.testing.tolerances import model_tolerance

pytestmark = pytest.mark.gpu

MiB = 2**20


def _free() -> int:
    """Free bytes as this process sees them: minus what its caching allocator reserves
    (graph pools included). Not ``torch.cuda.mem_get_info``: the device's free memory
    moves with every other process on the GPU (parallel test groups), which the runner
    neither takes nor gives back."""
    return -torch.cuda.memory_reserved()


DTYPE = torch.bfloat16
MAX_REQS = 257  # 256 decode requests and the reserved row 0
CONTEXT = 1024
PREFILL_MAX = 1024
# (decode backend, prefill backend): every CUDA backend in each phase that takes it.
PAIRS = [("full", "breakable"), ("breakable", "tc_piecewise"), ("tc_piecewise", "breakable")]


def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _config(decode: str, prefill: str) -> dict:
    cfg: dict = {"decode": {"backend": decode}, "prefill": {"backend": prefill, "max_bs": PREFILL_MAX}}
    for phase, name in (("decode", decode), ("prefill", prefill)):
        if name == "tc_piecewise":
            cfg[phase]["tc_compiler"] = "eager"
    return cfg


def _fresh() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def _within(estimate: int, real: int) -> bool:
    return abs(estimate - real) <= max(0.10 * real, 64 * MiB)


@pytest.mark.parametrize("preset", ["llama-3.2-1b", "qwen2.5-0.5b"])
@pytest.mark.parametrize("decode, prefill", PAIRS)
def test_estimate_before_the_kv_cache_matches_the_real_pool(preset, decode, prefill, record_property):
    _cuda()
    _fresh()
    model = reference_model(preset, requests=2, context=16, dtype=DTYPE, device="cuda")
    config = _config(decode, prefill)
    estimate = estimate_graph_memory(model, config, max_reqs=MAX_REQS, max_context_len=CONTEXT)
    _fresh()
    # The real capture: the full KV cache, then decode and prefill into the shared pool.
    model.create_kv_cache(num_slots=(MAX_REQS - 1) * CONTEXT + 1, max_reqs=MAX_REQS, max_context_len=CONTEXT)
    runner_d = DecodeCudaGraphRunner(model, config, show_progress=False)
    runner_d.capture()
    real_d = runner_d.graph_memory_bytes()
    runner_p = PrefillCudaGraphRunner(model, config, show_progress=False)
    runner_p.capture()
    real_total = runner_p.graph_memory_bytes()
    est_d, est_p = estimate.phases["decode"], estimate.phases["prefill"]
    line = (
        f"{preset} {decode}/{prefill}: decode est {est_d.pool_bytes / MiB:.1f} real {real_d / MiB:.1f} MiB; "
        f"prefill est {est_p.pool_bytes / MiB:.1f} real {(real_total - real_d) / MiB:.1f} MiB; total est "
        f"{estimate.pool_bytes / MiB:.1f} real {real_total / MiB:.1f} MiB; outside pool "
        f"{(estimate.outside_pool_bytes or 0) / MiB:.1f} MiB, device {(estimate.device_bytes or 0) / MiB:.1f} MiB"
    )
    print(line)
    record_property("estimate", line)
    assert estimate.outside_pool_counted
    assert est_d.sizes == runner_d._captured_sizes() and est_p.sizes == runner_p._captured_sizes()
    assert _within(est_d.pool_bytes, real_d), line
    assert _within(est_p.pool_bytes, real_total - real_d), line
    assert _within(estimate.pool_bytes, real_total), line
    runner_p.cleanup()
    runner_d.cleanup()


@pytest.fixture(scope="module")
def llama():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = reference_model("llama-3.2-1b", requests=8, context=64, dtype=DTYPE, device="cuda")
    yield model
    del model
    _fresh()


def _case(model):
    prompts = make_dummy_prompts(5, [3, 4, 5, 6, 7], model.config.vocab_size, seed=3)
    return prefilled_decode_batch(model, prompts)


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_sleep_gives_the_pool_back_and_wake_replays_equal_to_eager(llama, backend, record_property):
    _fresh()
    config = _config(backend, "breakable")
    runner = DecodeCudaGraphRunner(llama, config, show_progress=False)
    start = time.perf_counter()
    runner.capture()
    first = time.perf_counter() - start
    assert len(runner.captured_keys) == 36
    pool = runner.graph_memory_bytes()
    torch.cuda.synchronize()
    free_awake = _free()
    freed = runner.sleep()
    torch.cuda.synchronize()
    free_asleep = _free()
    session, batch = _case(llama)
    try:
        eager = eager_logits_fn(llama)(batch).clone()
        asleep_out = runner.forward(batch).clone()  # eager while asleep
        assert runner.run_stats()["eager_fallbacks"].get("asleep") == 1
        start = time.perf_counter()
        runner.wake()
        woke = time.perf_counter() - start
        got = runner.forward(batch).clone()
    finally:
        session.close()
    line = (
        f"{backend}: pool {pool / MiB:.1f} MiB, sleep gave back {(free_asleep - free_awake) / MiB:.1f} MiB "
        f"(reported {(freed or 0) / MiB:.1f}); first capture {first:.2f} s, wake {woke:.2f} s, "
        f"ratio {woke / first:.2f}"
    )
    print(line)
    record_property("sleep_wake", line)
    assert free_asleep - free_awake >= 0.95 * pool, line
    tol = model_tolerance(PRESETS["llama-3.2-1b"], DTYPE, context_len=16)
    torch.testing.assert_close(asleep_out, eager, **tol)
    torch.testing.assert_close(got, eager, **tol)
    assert runner.run_stats()["replays"] == 1
    runner.cleanup()


def test_twenty_cycles_with_in_place_updates_stay_flat_and_follow_the_weights(llama):
    _fresh()
    runner = DecodeCudaGraphRunner(llama, _config("full", "breakable"), show_progress=False)
    runner.capture()
    tol = model_tolerance(PRESETS["llama-3.2-1b"], DTYPE, context_len=16)
    norm = dict(llama.named_parameters())["model.norm.weight"]
    free_after_wake = []
    previous = None
    session, batch = _case(llama)
    try:
        for cycle in range(20):
            runner.sleep()
            with torch.no_grad():  # an RL trainer's update: in place, while asleep
                norm.mul_(1.02 if cycle % 2 else 0.98)
            runner.wake()
            assert runner.check_weights() > 0
            torch.cuda.synchronize()
            free_after_wake.append(_free())
            got = runner.forward(batch).clone()
            torch.testing.assert_close(got, eager_logits_fn(llama)(batch), **tol, msg=f"cycle {cycle}")
            if previous is not None:
                assert not torch.equal(got, previous), f"cycle {cycle}: the output did not follow the new weights"
            previous = got
    finally:
        session.close()
        runner.cleanup()
    spread = max(free_after_wake[1:]) - min(free_after_wake[1:])
    print(f"20 cycles: free memory after wake spread {spread / MiB:.1f} MiB")
    assert spread <= 64 * MiB, [f / MiB for f in free_after_wake]


def test_reassigned_weights_raise_instead_of_replaying_old_ones(llama):
    _fresh()
    cfg = _config("full", "breakable")
    cfg["decode"]["check_weights_every"] = 1
    runner = DecodeCudaGraphRunner(llama, cfg, show_progress=False, enable_cudagraph_gc=True)
    runner.capture(sizes=[8])
    session, batch = _case(llama)
    kept = llama.state_dict(keep_vars=True)  # the very parameters and buffers
    state = {k: v.detach().clone() for k, v in kept.items()}
    try:
        runner.forward(batch)
        llama.load_state_dict(state, assign=True)
        with pytest.raises(StaleWeightsError, match="re-assigned"):
            runner.check_weights()
        with pytest.raises(StaleWeightsError):
            runner.forward(batch)
    finally:
        session.close()
        # Put the module's parameters back for the other tests of the module.
        llama.load_state_dict(kept, assign=True)
        runner.cleanup()


def test_the_shared_pool_goes_back_when_both_phases_sleep(llama):
    _fresh()
    config = {"decode": {"backend": "full", "max_bs": 16}, "prefill": {"backend": "breakable", "max_bs": 256}}
    decode = DecodeCudaGraphRunner(llama, config, show_progress=False)
    prefill = PrefillCudaGraphRunner(llama, config, show_progress=False)
    decode.capture()
    prefill.capture()
    pool = prefill.graph_memory_bytes()
    torch.cuda.synchronize()
    free_awake = _free()
    decode.sleep()  # prefill's graphs still use the pool: it stays
    torch.cuda.synchronize()
    free_half = _free()
    prefill.sleep()
    torch.cuda.synchronize()
    free_asleep = _free()
    line = (
        f"shared pool {pool / MiB:.1f} MiB: decode asleep gave back {(free_half - free_awake) / MiB:.1f} MiB, "
        f"both {(free_asleep - free_awake) / MiB:.1f} MiB"
    )
    print(line)
    assert free_asleep - free_awake >= 0.95 * pool, line
    decode.wake()
    prefill.wake()
    assert decode.captured_keys and prefill.captured_keys
    prefill.cleanup()
    decode.cleanup()

"""GPU: no host synchronization on any backend's replay path, and capture time of the default sizes.

Replays run under ``torch.cuda.set_sync_debug_mode("error")``: any synchronizing call
(``.item()``, ``.tolist()``, ``.cpu()`` of a device tensor, ``nonzero``, boolean-mask
indexing, a blocking copy) raises. Covered: ``full``, ``breakable`` and ``tc_piecewise``
(eager compiler) through the decode runner, ``breakable`` and ``tc_piecewise`` through the
prefill runner, each after capture, on batches on and off the captured sizes (live
batches are built before the mode is switched on); and the same with a plan-based
attention (``planned_standin``), whose replay hook plans from host lengths only.

``test_capture_seconds_of_the_default_decode_sizes`` records how long ``full`` takes to
capture the 36 default decode sizes of ``llama-3.2-1b`` under each warm-up policy (a
benchmark row printed and written to ``$OUT/capture_seconds.json`` when ``OUT`` is set; no
wall-clock assertion) and checks that every policy's replay equals eager.

Run on the device machine: ``python -m pytest tests/test_replay_sync_gpu.py -s``.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Dict

import pytest
import torch

from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.runner import DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import free_requests, prefilled_decode_batch, reference_model

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    return reference_model("tiny", requests=39, num_slots=64 * 64 + 1)


def _replays_without_sync(runner: Any, batches: Dict[str, Any], eager: Any) -> None:
    """Replay each batch twice under sync-debug "error"; compare with eager afterwards."""
    outputs = {}
    torch.cuda.synchronize()
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.no_grad():
            for what, batch in batches.items():
                assert runner.can_run(batch), what
                runner.forward(batch)
                outputs[what] = runner.forward(batch).clone()
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    torch.cuda.synchronize()
    with torch.no_grad():
        for what, batch in batches.items():
            torch.testing.assert_close(outputs[what], eager(batch), rtol=1e-3, atol=1e-3, msg=what)


def _release(runner: Any) -> None:
    """Free the graphs, and give the model its own forward back where the backend wrapped it."""
    runner.cleanup()
    uninstall = getattr(runner.backend, "uninstall", None)
    if uninstall is not None:
        uninstall()


@pytest.mark.parametrize("backend", ["full", "breakable", "tc_piecewise"])
def test_decode_replay_never_synchronizes(model, backend):
    runner = DecodeCudaGraphRunner(
        model,
        {
            "decode": {
                "backend": backend,
                "bs": [1, 2, 4, 8],
                "max_bs": 8,
                **({"tc_compiler": "eager"} if backend == "tc_piecewise" else {}),
            }
        },
        show_progress=False,
    )
    runner.capture()
    sessions, batches = [], {}
    for bs in (1, 3, 8):  # on a bucket, padded, the maximum
        prompts = make_dummy_prompts(bs, [3 + i % 4 for i in range(bs)], model.config.vocab_size, seed=bs)
        session, batches[f"{backend} decode bs={bs}"] = prefilled_decode_batch(model, prompts)
        sessions.append(session)
    try:
        _replays_without_sync(runner, batches, eager_logits_fn(model))
    finally:
        for s in sessions:
            s.close()
        _release(runner)


@pytest.mark.parametrize("backend", ["breakable", "tc_piecewise"])
def test_prefill_replay_never_synchronizes(model, backend):
    runner = PrefillCudaGraphRunner(
        model,
        {
            "prefill": {
                "backend": backend,
                "bs": [16, 32, 64],
                "max_bs": 64,
                **({"tc_compiler": "eager"} if backend == "tc_piecewise" else {}),
            }
        },
        show_progress=False,
    )
    runner.capture()
    cache = model.kv_cache
    batches = {}
    for lengths in ([16], [5, 9, 7], [20, 20, 24]):  # on a bucket, padded, the maximum
        prompts = make_dummy_prompts(len(lengths), lengths, model.config.vocab_size, seed=sum(lengths))
        batches[f"{backend} prefill {sum(lengths)} tokens"] = make_extend_batch(cache, prompts)
    try:
        _replays_without_sync(runner, batches, eager_logits_fn(model))
    finally:
        free_requests(cache, *batches.values())
        _release(runner)


@pytest.mark.parametrize(
    "phase, backend",
    [("decode", "full"), ("decode", "breakable"), ("decode", "tc_piecewise"), ("prefill", "breakable")],
)
def test_plan_based_attention_replay_never_synchronizes(phase, backend):
    """The ``planned_standin`` attention re-plans before every replay from the static
    batch's host lengths (a pinned host-to-device copy into the per-size buffer): replay
    stays free of host syncs, equals eager, and no recorded forward read a stale plan."""
    planned = reference_model("tiny", requests=39, num_slots=64 * 64 + 1, attention="planned_standin")
    cls = DecodeCudaGraphRunner if phase == "decode" else PrefillCudaGraphRunner
    sizes = [1, 2, 4, 8] if phase == "decode" else [16, 32, 64]
    options = {"tc_compiler": "eager"} if backend == "tc_piecewise" else {}
    runner = cls(
        planned, {phase: {"backend": backend, "bs": sizes, "max_bs": sizes[-1], **options}}, show_progress=False
    )
    runner.capture()
    sessions, batches = [], {}
    if phase == "decode":
        for bs in (1, 3, 8):
            prompts = make_dummy_prompts(bs, [3 + i % 4 for i in range(bs)], planned.config.vocab_size, seed=bs)
            session, batches[f"{backend} decode bs={bs}"] = prefilled_decode_batch(planned, prompts)
            sessions.append(session)
    else:
        for lengths in ([16], [5, 9, 7]):
            prompts = make_dummy_prompts(len(lengths), lengths, planned.config.vocab_size, seed=sum(lengths))
            batches[f"{backend} prefill {sum(lengths)} tokens"] = make_extend_batch(planned.kv_cache, prompts)
    try:
        _replays_without_sync(runner, batches, eager_logits_fn(planned))
        planned.attn_backend.check()
    finally:
        for s in sessions:
            s.close()
        _release(runner)


def test_capture_seconds_of_the_default_decode_sizes():
    """A benchmark row per warm-up policy (printed, and saved under $OUT): seconds for
    ``full`` to capture the 36 default decode sizes of llama-3.2-1b in bfloat16; every
    policy's replay must still equal eager (greedy tokens)."""
    from cuda_graph_runner.reference.batches import greedy_generate

    m = reference_model("llama-3.2-1b", requests=256, context=40, dtype=torch.bfloat16)
    rows = {}
    prompts = make_dummy_prompts(3, 12, m.config.vocab_size, seed=3)
    with torch.no_grad():
        expected = greedy_generate(m, m.kv_cache, prompts, 8)
    # The first capture of a process also pays one-time costs (kernel loading, cuBLAS
    # workspaces, the allocator growing): an untimed capture first, so the policies compare.
    for policy in ("untimed", "auto", "first_size", "every_size"):
        runner = DecodeCudaGraphRunner(
            m, {"decode": {"backend": "full", "warmup": "auto" if policy == "untimed" else policy}}, show_progress=False
        )
        assert len(runner.capture_sizes) == 36
        start = time.perf_counter()
        runner.capture()
        rows[policy] = {
            "capture_s": runner.capture_seconds,
            "wall_s": time.perf_counter() - start,
            "sizes": len(runner.capture_sizes),
            "pool_mb": (runner.capture_memory_bytes or 0) / 2**20,
        }
        with torch.no_grad():
            got = greedy_generate(m, m.kv_cache, prompts, 8, decode_fn=runner.forward)
        assert got == expected, policy
        runner.cleanup()
        torch.cuda.empty_cache()
    print("\ncapture of the 36 default decode sizes (full, llama-3.2-1b, bf16):")
    rows.pop("untimed")
    for policy, row in rows.items():
        print(f"  warmup={policy:<10} {row['capture_s']:.2f} s  pool {row['pool_mb']:.0f} MB")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "capture_seconds.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=2)

"""GPU: the tc_piecewise backend (torch.compile pieces captured per size) replays the
reference model as eager runs it, in decode and prefill, with both compilers."""

from __future__ import annotations

import pytest
import torch

from cuda_graph_runner.testing.reference_setup import (
    assert_greedy_tokens_equal_eager,
    free_requests,
    prefilled_decode_batch,
    reference_model,
    staggered_decode_case,
)
from cuda_graph_runner.testing.workload import (
    DecodeCudaGraphRunner,
    PhaseConfig,
    PrefillCudaGraphRunner,
    eager_logits_fn,
    greedy_generate,
    make_dummy_prompts,
    make_extend_batch,
)

pytestmark = pytest.mark.gpu


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton

        return bool(has_triton())
    except Exception:
        return False


COMPILERS = [
    "eager",
    # Only a CUDA machine can lack Triton meaningfully; elsewhere the gpu mark says why it skips.
    pytest.param(
        "inductor",
        marks=pytest.mark.skipif(
            torch.cuda.is_available() and not _has_triton(), reason="inductor on CUDA needs Triton"
        ),
    ),
]


@pytest.fixture(scope="module")
def fp32_model():
    return reference_model("tiny", requests=48)


def _backend_type():
    from cuda_graph_runner_tc_piecewise.backend import TcPiecewiseCudaGraphBackend

    return TcPiecewiseCudaGraphBackend


def _replays(backend) -> int:
    return backend.piece_calls()["replay"]


def _captured(model, runner_cls, phase: str, max_bs: int, compiler: str):
    """A tc_piecewise runner of ``phase`` with ``compiler`` pieces, captured; and its backend."""
    cfg = {phase: {"backend": "tc_piecewise", "max_bs": max_bs, "tc_compiler": compiler}}
    runner = runner_cls(model, cfg, show_progress=False)
    be = runner.backend
    assert isinstance(be, _backend_type()) and be.compiler == compiler
    with torch.no_grad():
        runner.capture()
    return runner, be


@pytest.mark.parametrize("compiler", COMPILERS)
def test_decode_on_and_off_the_capture_list_equals_eager(fp32_model, compiler):
    model = fp32_model
    runner, be = _captured(model, DecodeCudaGraphRunner, "decode", 16, compiler)
    assert runner.capture_sizes == [1, 2, 4, 8, 12, 16]
    assert be.capture_enabled and be.weak_ref_outputs
    assert len(be.pieces) == model.config.num_hidden_layers + 1
    assert be.compile_seconds and be.compile_seconds > 0
    compiled_at_capture = be.dynamo_compiles
    for bs in sorted(set(runner.capture_sizes + [3, 5, 13, 17])):
        # requests of different lengths
        session, batch, expected = staggered_decode_case(model, bs, seed=bs, decode_steps=2)
        with torch.no_grad():
            before = _replays(be)
            assert runner.can_run(batch) == (bs <= 16)
            got = runner.forward(batch).clone()
        replayed = _replays(be) - before
        if bs <= 16:
            assert replayed == len(be.pieces), f"bs {bs}: {replayed} piece replays"
        else:
            assert replayed == 0  # above max_bs: the runner's eager path, the original forward
        assert got.shape == expected.shape == (bs, model.config.vocab_size)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4, msg=f"{compiler} decode bs {bs}")
        session.close()
    assert be.dynamo_compiles == compiled_at_capture, "torch.compile recompiled while serving"
    # Every size >= 2 shares one graph; size 1 is specialized (Dynamo's 0/1 rule).
    assert compiled_at_capture == 2
    runner.cleanup()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_prefill_on_and_off_the_capture_list_equals_eager(fp32_model, compiler):
    model = fp32_model
    runner, be = _captured(model, PrefillCudaGraphRunner, "prefill", 64, compiler)
    compiled_at_capture = be.dynamo_compiles
    eager = eager_logits_fn(model)
    cache = model.kv_cache
    # (prompt lengths, whole prompt replays a graph): 8 and 32 tokens are captured sizes;
    # 13 -> 16, 5 -> 8, 63 -> 64 are padded; 81 > 64 runs eagerly.
    cases = [
        ((8,), True),
        ((5, 3), True),
        ((13,), True),
        ((3, 2), True),
        ((20, 10, 2), True),
        ((30, 33), True),
        ((40, 41), False),
    ]

    def check(batch, what):
        expected = eager(batch).clone()
        before = _replays(be)
        graphed = runner.can_run(batch)
        got = runner.forward(batch).clone()
        assert _replays(be) - before == (len(be.pieces) if graphed else 0), what
        torch.testing.assert_close(
            got, expected, rtol=1e-4, atol=1e-4, msg=f"{compiler} prefill {what} ({batch.num_tokens} tokens)"
        )
        return graphed

    for i, (lens, graphed) in enumerate(cases):
        prompts = make_dummy_prompts(len(lens), list(lens), model.config.vocab_size, seed=30 + i)
        with torch.no_grad():
            whole = make_extend_batch(cache, prompts)
            assert check(whole, f"prompts {list(lens)}") == graphed
            free_requests(cache, whole)
            # Two chunks of the same requests: the second has cached prefixes (chunked prefill).
            first = make_extend_batch(cache, [p[: max(1, len(p) // 2)] for p in prompts])
            rows = first.req_pool_indices.tolist()
            second = make_extend_batch(cache, [p[max(1, len(p) // 2) :] for p in prompts], rows=rows)
            check(first, f"first chunks of {list(lens)}")
            check(second, f"second chunks of {list(lens)}")
            free_requests(cache, first)
    assert be.dynamo_compiles == compiled_at_capture, "torch.compile recompiled while serving"
    assert compiled_at_capture == 1  # prefill sizes start at 4: one graph for all
    runner.cleanup()


@pytest.mark.parametrize("compiler", COMPILERS)
def test_greedy_generation_with_tc_piecewise_prefill_and_decode_gives_eager_tokens(fp32_model, compiler):
    model = fp32_model
    cfg = {
        "decode": {"backend": "tc_piecewise", "max_bs": 8, "tc_compiler": compiler},
        "prefill": {"backend": "tc_piecewise", "max_bs": 128, "tc_compiler": compiler},
    }
    decode = DecodeCudaGraphRunner(model, cfg, show_progress=False)
    prefill = PrefillCudaGraphRunner(model, cfg, show_progress=False)
    with torch.no_grad():
        decode.capture()
        prefill.capture()
        for bs in (1, 3, 8):
            prompts = make_dummy_prompts(bs, [5 + (3 * i) % 12 for i in range(bs)], model.config.vocab_size, seed=bs)
            expected = greedy_generate(model, model.kv_cache, prompts, 12)
            got = greedy_generate(
                model, model.kv_cache, prompts, 12, prefill_fn=prefill.forward, decode_fn=decode.forward
            )
            assert got == expected, f"{compiler} bs={bs}"
            chunked = greedy_generate(
                model, model.kv_cache, prompts, 6, prefill_fn=prefill.forward, decode_fn=decode.forward, chunk_size=4
            )
            assert chunked == greedy_generate(model, model.kv_cache, prompts, 6, chunk_size=4), (
                f"{compiler} chunked bs={bs}"
            )
    assert _replays(decode.backend) > 0 and _replays(prefill.backend) > 0
    decode.cleanup()
    prefill.cleanup()


@pytest.mark.parametrize("weak_ref_outputs", [True, False], ids=["weak-outputs", "strong-outputs"])
def test_replay_inputs_stay_at_their_capture_addresses(fp32_model, weak_ref_outputs):
    """Debug mode checks, at every piece replay, that each input is where it was at capture."""
    model = fp32_model

    def debug_runner(runner_cls, phase: str, max_bs: int):
        backend = _backend_type()(
            "cuda", phase=phase, phase_config=PhaseConfig(max_bs=max_bs), debug=True, weak_ref_outputs=weak_ref_outputs
        )
        return runner_cls(model, {phase: {"max_bs": max_bs}}, show_progress=False, backend=backend)

    decode = debug_runner(DecodeCudaGraphRunner, "decode", 4)
    prefill = debug_runner(PrefillCudaGraphRunner, "prefill", 32)
    with torch.no_grad():
        decode.capture()
        prefill.capture()
        prompts = make_dummy_prompts(3, [7, 4, 9], model.config.vocab_size, seed=5)
        expected = greedy_generate(model, model.kv_cache, prompts, 8)
        got = greedy_generate(model, model.kv_cache, prompts, 8, prefill_fn=prefill.forward, decode_fn=decode.forward)
    assert got == expected
    assert _replays(decode.backend) > 0 and _replays(prefill.backend) > 0
    decode.cleanup()
    prefill.cleanup()


def test_bf16_greedy_tokens_equal_eager_with_the_eager_compiler():
    model = reference_model("tiny", requests=16, dtype=torch.bfloat16)
    cfg = {
        "decode": {"backend": "tc_piecewise", "max_bs": 8},
        "prefill": {"backend": "tc_piecewise", "bs": [12, 48], "max_bs": 48},
    }
    decode = DecodeCudaGraphRunner(model, cfg, show_progress=False)
    prefill = PrefillCudaGraphRunner(model, cfg, show_progress=False)
    with torch.no_grad():
        decode.capture()
        prefill.capture()
    # Batch sizes 1 and 4: captured sizes in both phases (12 and 48 prompt tokens).
    assert_greedy_tokens_equal_eager(
        model, 16, batch_sizes=(1, 4), prefill_fn=prefill.forward, decode_fn=decode.forward, what="bf16"
    )
    decode.cleanup()
    prefill.cleanup()


def test_recapture_after_cleanup_reuses_the_compilation(fp32_model):
    model = fp32_model
    runner = DecodeCudaGraphRunner(model, {"decode": {"backend": "tc_piecewise", "max_bs": 4}}, show_progress=False)
    with torch.no_grad():
        for round_ in range(2):
            runner.capture()
            session, batch = prefilled_decode_batch(
                model, make_dummy_prompts(3, 4, model.config.vocab_size, seed=round_)
            )
            expected = eager_logits_fn(model)(batch).clone()
            torch.testing.assert_close(runner.forward(batch).clone(), expected, rtol=1e-4, atol=1e-4)
            session.close()
            runner.cleanup()
    assert runner.backend.dynamo_compiles == 2  # sizes >= 2 and size 1, compiled once for both rounds

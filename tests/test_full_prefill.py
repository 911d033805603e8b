"""Prefill ``full`` on the CPU: one graph per token bucket with fixed request slots, on
the breakable plugin's emulated graphs (a replay re-runs the recorded aten ops on the
recorded tensors, host values frozen, so only device-driven attention replays right).

The model is the reference Llama with the ``planned_standin`` attention (its extend reads
a per-token plan that the replay hook refreshes). Checked: the slot count (config and
sglang's default), the sentinel padding of the request axis (device buffers and host
lists), fp32 replay == eager bit for bit for ragged requests, chunked prefill over cached
prefixes and a continuous-batching schedule, a batch of more requests than slots run
eagerly with its counted reason, the run statistics' token and slot waste, the refusal of
an attention without out-of-graph metadata update, and ``compute_logits`` on a
zero-length request.
"""

from __future__ import annotations

from typing import Any, List, Sequence

import pytest
import torch
from cpu_gemm import assert_replay_matches, replay_rows_exact

from cuda_graph_runner.backend.forward_batch import ForwardBatch, ForwardMode, _stored, last_token_rows
from cuda_graph_runner.config import CudaGraphConfig, CudaGraphConfigError
from cuda_graph_runner.reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.reference.model.extend_plan import max_extend_tiles, padded_extend_tiles, token_tables
from cuda_graph_runner.runner import PrefillCudaGraphRunner
from cuda_graph_runner.runner.stats import REASON_SLOTS, format_summary

emulation = pytest.importorskip("cuda_graph_runner_breakable.emulation")
full = pytest.importorskip("cuda_graph_runner_full.backend")

CONTEXT = 64
SIZES = [16, 32, 64]


def planned_model(requests: int = 16, attention: str = "planned_standin") -> ReferenceLlamaForCausalLM:
    model = ReferenceLlamaForCausalLM.from_preset("tiny", attention=attention)
    model.create_kv_cache(num_slots=requests * CONTEXT + 1, max_reqs=requests + 1, max_context_len=CONTEXT)
    return model


def full_backend() -> Any:
    dm = emulation.EmulatedGraphDeviceModule()
    return full.FullCudaGraphBackend("cpu", phase="prefill", device_module=dm, memory_pool=dm.pool_handle)


def full_runner(model: Any, slots: Any = 4, sizes: Sequence[int] = SIZES, **kwargs: Any) -> PrefillCudaGraphRunner:
    phase = {"bs": list(sizes), **({"full_prefill_max_req": slots} if slots is not None else {})}
    return PrefillCudaGraphRunner(
        model, {"prefill": phase}, device="cpu", backend=full_backend(), show_progress=False, **kwargs
    )


def prompts_of(model: Any, lens: Sequence[int], seed: int) -> List[List[int]]:
    return make_dummy_prompts(len(lens), list(lens), model.config.vocab_size, seed=seed)


# -- config ------------------------------------------------------------------------------


def test_prefill_full_is_accepted_and_slots_default_as_sglang():
    config = CudaGraphConfig.from_dict({"prefill": {"backend": "full"}})
    assert config.prefill.backend == "full" and config.prefill.full_prefill_max_req is None
    assert [config.prefill.request_slots(t) for t in (64, 511, 512, 4096, 8192)] == [1, 1, 1, 8, 16]
    assert CudaGraphConfig.from_dict({"prefill": {"full_prefill_max_req": 3}}).prefill.request_slots(4096) == 3


@pytest.mark.parametrize("value", [0, -1, True, "4"])
def test_bad_slot_counts_are_refused_naming_the_key(value):
    with pytest.raises(CudaGraphConfigError) as info:
        CudaGraphConfig.from_dict({"prefill": {"full_prefill_max_req": value}})
    assert (info.value.phase, info.value.key) == ("prefill", "full_prefill_max_req")


def test_slot_count_on_decode_is_refused():
    with pytest.raises(CudaGraphConfigError, match="read by the prefill phase only") as info:
        CudaGraphConfig.from_dict({"decode": {"full_prefill_max_req": 2}})
    assert (info.value.phase, info.value.key) == ("decode", "full_prefill_max_req")


def test_runner_slot_count_follows_the_largest_bucket_by_default():
    runner = full_runner(planned_model(), slots=None, sizes=[16, 1024], max_request_tokens=1024)
    assert runner.request_slots == 2  # 1024 // 512
    assert runner.buffers["req_pool_indices"].shape == (2,)
    # Requests of at most the context length (64): the default grows to what a capture takes.
    assert full_runner(planned_model(), slots=None, sizes=[16, 256]).request_slots == 4


def test_torch_attention_is_refused_naming_it_and_what_works():
    model = planned_model(attention="torch")
    with pytest.raises(CudaGraphConfigError) as info:
        full_runner(model)
    message = str(info.value)
    assert "attention 'torch'" in message and "init_forward_metadata_replay" in message
    assert "triton" in message and "flashinfer" in message and "breakable" in message
    # A backend instance built by hand has no registry name: its class names it.
    assert (info.value.phase, info.value.key, info.value.value) == ("prefill", "backend", "FullCudaGraphBackend")


def test_too_few_slots_for_the_capture_requests_is_refused():
    model = planned_model()
    with pytest.raises(CudaGraphConfigError, match="takes 2 requests") as info:
        PrefillCudaGraphRunner(
            model,
            {"prefill": {"bs": [16, 128], "full_prefill_max_req": 1}},
            device="cpu",
            backend=full_backend(),
            max_request_tokens=64,
            show_progress=False,
        )
    assert info.value.key == "full_prefill_max_req"


# -- sentinels ---------------------------------------------------------------------------


def test_capture_pads_the_request_axis_with_zero_length_sentinels():
    model = planned_model()
    runner = full_runner(model, slots=4, sizes=[16])
    batch = runner.capture_prepare(16)
    assert batch.req_pool_indices.tolist() == [0, 0, 0, 0]
    assert batch.extend_seq_lens.tolist() == [16, 0, 0, 0] and batch.seq_lens.tolist() == [16, 0, 0, 0]
    assert _stored(batch, "extend_seq_lens_cpu") == [16, 0, 0, 0]
    assert _stored(batch, "extend_prefix_lens_cpu") == [0, 0, 0, 0]


def test_replay_pads_live_requests_with_sentinels_and_clears_a_larger_batchs_rows():
    model = planned_model()
    runner = full_runner(model, slots=4)
    plans = model.attn_backend
    with torch.no_grad():
        runner.capture()
        first = make_extend_batch(model.kv_cache, prompts_of(model, [5, 4, 3], seed=1))
        runner.forward(first)
        second = make_extend_batch(model.kv_cache, prompts_of(model, [9], seed=2))
        key, static = runner.replay_prepare(second)
    assert key.size == 16
    assert static.req_pool_indices.tolist() == [second.req_pool_indices.item(), 0, 0, 0]
    assert static.extend_seq_lens.tolist() == [9, 0, 0, 0] and static.seq_lens.tolist() == [9, 0, 0, 0]
    assert static.extend_prefix_lens.tolist() == [0, 0, 0, 0]
    assert static.extend_seq_lens_cpu == [9, 0, 0, 0] and static.seq_lens_cpu == [9, 0, 0, 0]
    assert plans.plan_log[-1].kind == "replay" and plans.plan_log[-1].extend_seq_lens == [9, 0, 0, 0]


def test_a_live_batch_without_host_lengths_is_planned_from_its_device_lengths():
    model = planned_model()
    runner = full_runner(model, slots=3)
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, prompts_of(model, [6, 2], seed=4))
        expected = eager(batch).clone()
        bare = batch.replace(seq_lens_cpu=None, extend_seq_lens_cpu=None, extend_prefix_lens_cpu=None)
        got = runner.forward(bare).clone()
        assert model.attn_backend.plan_log[-1].extend_seq_lens == [6, 2, 0]
    assert torch.equal(got, expected)


def test_token_and_tile_plans_give_zero_length_requests_nothing():
    req, pos = token_tables([2, 0, 3, 0], [4, 7, 0, 0], 8)
    assert req == [0, 0, 2, 2, 2, 0, 0, 0] and pos == [4, 5, 0, 1, 2, -1, -1, -1]
    tiles = padded_extend_tiles([5, 0, 3], [0, 9, 2], 4, max_extend_tiles(8, 3, 4))
    assert [(t.req, t.token_start, t.extend, t.m_start) for t in tiles if t.extend] == [
        (0, 0, 5, 0),
        (0, 0, 5, 4),
        (2, 5, 3, 0),
    ]
    assert len(tiles) == 5 and all(t == (0, 0, 0, 0, 0) for t in tiles[3:])
    with pytest.raises(ValueError, match="more than the batch's 4"):
        token_tables([3, 2], [0, 0], 4)


def test_compute_logits_gives_an_empty_request_zeros_not_a_neighbours_row():
    model = planned_model()
    hidden = torch.randn(7, model.config.hidden_size)
    lens = [0, 3, 0, 4, 0]
    batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=torch.zeros(7, dtype=torch.int64),
        positions=torch.zeros(7, dtype=torch.int64),
        out_cache_loc=torch.zeros(7, dtype=torch.int64),
        req_pool_indices=torch.zeros(5, dtype=torch.int64),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_seq_lens=torch.tensor(lens, dtype=torch.int32),
        extend_prefix_lens=torch.zeros(5, dtype=torch.int32),
    )
    with torch.no_grad():
        logits = model.compute_logits(hidden, batch)
        live = model.compute_logits(hidden[[2, 6]], batch.replace(extend_seq_lens=torch.tensor([1, 1])))
    assert logits.shape == (5, model.config.vocab_size)
    assert torch.equal(logits[[0, 2, 4]], torch.zeros(3, model.config.vocab_size))
    # The same rule for any model that picks rows with it (the HF adapter does).
    assert torch.equal(last_token_rows(hidden, batch.extend_seq_lens)[[0, 2, 4]], torch.zeros(3, hidden.shape[1]))
    assert torch.equal(last_token_rows(hidden, batch.extend_seq_lens)[[1, 3]], hidden[[2, 6]])
    # Rows 2 and 6 (each request's last token), up to the BLAS's blocking over 2 vs 5 rows.
    torch.testing.assert_close(logits[[1, 3]], live, rtol=1e-6, atol=1e-6)


# -- replay == eager (fp32, bit for bit where the CPU's GEMMs allow) ----------------------


def assert_replays_equal_eager(
    runner: Any, model: Any, batches: Sequence[ForwardBatch], sizes: Sequence[int] = SIZES
) -> int:
    """Every batch replays equal to eager; returns how many were compared bit for bit."""
    exact_count = 0
    eager = eager_logits_fn(model)
    for batch in batches:
        before = runner.stats.summary(runner.capture_sizes)["replays"]
        got = runner.forward(batch).clone()
        assert runner.stats.summary(runner.capture_sizes)["replays"] == before + 1, batch.extend_seq_lens_cpu
        expected = eager(batch)
        exact = replay_rows_exact(model, batch.num_tokens, sizes)
        assert_replay_matches(got, expected, exact, f"lengths {batch.extend_seq_lens_cpu}")
        exact_count += exact
    return exact_count


def test_ragged_requests_replay_equal_eager_exactly():
    model = planned_model()
    runner = full_runner(model, slots=4)
    with torch.no_grad():
        runner.capture()
        batches = [
            make_extend_batch(model.kv_cache, prompts_of(model, lens, seed=i))
            for i, lens in enumerate(([13], [5, 9], [1, 17, 2, 7], [30, 2], [3, 3, 3]))
        ]
        # [30, 2] fills a captured size (32 tokens): bit for bit on any CPU.
        assert assert_replays_equal_eager(runner, model, batches) >= 1


def test_chunked_prefill_with_cached_prefixes_replays_equal_eager_exactly():
    model = planned_model()
    runner = full_runner(model, slots=4)
    cache = model.kv_cache
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        prompts = prompts_of(model, [40, 25, 44], seed=7)
        rows = None
        for start in range(0, 40, 12):  # chunks of 12 tokens; later chunks read cached prefixes
            chunk = [p[start : start + 12] for p in prompts]
            live = [i for i, c in enumerate(chunk) if c]
            batch = make_extend_batch(
                cache, [chunk[i] for i in live], rows=None if rows is None else [rows[i] for i in live]
            )
            if rows is None:
                rows = batch.req_pool_indices.tolist()
            got = runner.forward(batch).clone()
            exact = replay_rows_exact(model, batch.num_tokens, SIZES)
            assert_replay_matches(
                got, eager(batch), exact, f"chunk at {start}: prefixes {batch.extend_prefix_lens_cpu}"
            )
        assert batch.extend_prefix_lens_cpu == [36, 36]  # the last chunk read cached prefixes
    assert runner.run_stats()["eager_total"] == 0


def test_continuous_batching_schedule_replays_equal_eager_and_counts_waste():
    """New prompts joining chunks of running ones each step, up to and over the slot count."""
    model = planned_model(requests=24)
    runner = full_runner(model, slots=3, sizes=[4, 8, 16, 32])
    cache = model.kv_cache
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        running: dict = {}  # row -> tokens left to prefill
        schedule = [[6], [10, 4], [3], [2, 8, 5], [7], [], []]
        seed = 0
        replayed = 0
        for arrivals in schedule:
            rows, chunks = [], []
            for row, left in list(running.items())[:2]:  # running prompts' next chunks
                rows.append(row)
                chunks.append(left[:5])
                running[row] = left[5:]
                if not running[row]:
                    del running[row]
            new = prompts_of(model, arrivals, seed=seed) if arrivals else []
            seed += 1
            tokens = [*chunks, *[p[:4] for p in new]]
            if not tokens:
                continue
            batch = make_extend_batch(cache, tokens, rows=[*rows, *[cache.alloc_request() for _ in new]])
            for row, prompt in zip(batch.req_pool_indices.tolist()[len(rows) :], new):
                if prompt[4:]:
                    running[row] = prompt[4:]
            replays = runner.can_run(batch)
            replayed += replays
            got = runner.forward(batch).clone()
            exact = not replays or replay_rows_exact(model, batch.num_tokens, [4, 8, 16, 32])
            assert_replay_matches(got, eager(batch), exact, f"step lengths {batch.extend_seq_lens_cpu}")
        stats = runner.run_stats()
    assert (
        replayed >= 5 and stats["replays"] == replayed and stats["eager_fallbacks"] == {REASON_SLOTS: 1}
    )  # the 5-request step
    slots = stats["request_slots"]
    assert slots["replays"] == replayed and slots["real_requests"] + slots["padded_slots"] == 3 * replayed
    assert stats["padded_rows"] == sum(p["padded_rows"] for p in stats["padding"]) > 0
    assert "request-slot waste" in format_summary("prefill", stats)


def test_more_requests_than_slots_run_eagerly_with_the_counted_reason():
    model = planned_model()
    runner = full_runner(model, slots=2)
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, prompts_of(model, [3, 3, 3], seed=3))
        assert not runner.can_run(batch)
        got = runner.forward(batch)
        torch.testing.assert_close(got, eager_logits_fn(model)(batch), rtol=0, atol=0)
        with pytest.raises(ValueError, match="3 requests but the prefill graphs have 2 request slots"):
            runner.replay_prepare(batch)
    stats = runner.run_stats()
    assert stats["eager_fallbacks"] == {REASON_SLOTS: 1} and stats["replays"] == 0


# -- the triton attention's planned extend (Triton's interpreter on the CPU) ----------------


def interpreted_triton_check() -> None:
    """Run with ``TRITON_INTERPRET=1`` (a subprocess of the test below): the ``triton``
    attention through a prefill runner with request slots, on the core's recording
    backend declaring that it records the marked ops (its replay re-runs the forward on
    the static batch, so the kernel reads the tile table the replay hook refilled)."""
    from cuda_graph_runner.testing.fakes import RecordingBackend

    class RecordingMarkedOps(RecordingBackend):
        records_marked_ops = True

    model = planned_model(requests=8, attention="triton")
    attention = model.attn_backend
    attention.extend_block_m = attention.extend_block_n = 16  # small tiles: several per request
    runner = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [16, 32], "full_prefill_max_req": 3}},
        device="cpu",
        backend=RecordingMarkedOps("cpu", phase="prefill"),
        show_progress=False,
    )
    eager = eager_logits_fn(model)
    with torch.no_grad():
        runner.capture()
        tables = attention.extend_states
        assert sorted(state[0].shape[0] for state in tables.values()) == [1 + 3, 2 + 3]  # ceil(P / 16) + slots
        for lens in ([5, 9], [20, 1, 7], [12]):
            batch = make_extend_batch(model.kv_cache, prompts_of(model, lens, seed=len(lens)))
            assert runner.can_run(batch)
            got = runner.forward(batch).clone()
            torch.testing.assert_close(got, eager(batch), rtol=1e-5, atol=1e-5)
            table = next(s for k, s in tables.items() if k[2] == runner.padded_size(sum(lens)))
            assert table[1] and int((table[0][:, 3] > 0).sum()) == sum(-(-n // 16) for n in lens)
    runner.cleanup()
    assert not tables
    print("planned triton extend equals eager")


def test_interpreted_triton_extend_through_request_slots_equals_eager():
    from triton_interpreter import run_interpreted

    run_interpreted(__file__, "planned triton extend equals eager")


if __name__ == "__main__":
    interpreted_triton_check()


class _OwnValuesDP:
    """A DP group's step agreement in one process: every rank's values are this rank's
    (what a group agrees when the other ranks are idle), recorded."""

    def __init__(self) -> None:
        self.seen: List[Any] = []

    def agree_batch(self, size: int, ready: bool, variant: Any, *, variants: Any = ("",), failed: Any = None):
        self.seen.append((size, ready, variant, failed))
        if failed is not None:
            from cuda_graph_runner.runner.dp_group import DataParallelStepError

            raise DataParallelStepError(failed)
        return size, ready, variant


def test_dp_step_with_more_requests_than_slots_is_not_ready_and_runs_eagerly():
    # A rank that reported ready here would replay after the agreement and raise alone,
    # leaving the other ranks waiting in the model's collectives.
    from cuda_graph_runner.runner.data_parallel import dp_forward

    model = planned_model()
    runner = full_runner(model, slots=2, sizes=[16])
    dp = _OwnValuesDP()
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, prompts_of(model, [3, 3, 3], seed=3))
        got = dp_forward(runner, dp, batch)  # type: ignore[arg-type]
        torch.testing.assert_close(got, eager_logits_fn(model)(batch), rtol=0, atol=0)
    assert dp.seen == [(9, False, None, None)]
    assert runner.run_stats()["eager_fallbacks"] == {REASON_SLOTS: 1}


def test_dp_step_refuses_a_batch_without_extend_lengths_before_the_agreement():
    from cuda_graph_runner.runner.data_parallel import dp_forward

    model = planned_model()
    runner = full_runner(model, slots=2, sizes=[16])
    dp = _OwnValuesDP()
    with torch.no_grad():
        runner.capture()
        batch = make_extend_batch(model.kv_cache, prompts_of(model, [3, 4], seed=3)).replace(extend_seq_lens=None)
        with pytest.raises(ValueError, match="batch.extend_seq_lens is None"):
            dp_forward(runner, dp, batch)  # type: ignore[arg-type]
    assert len(dp.seen) == 1 and "extend_seq_lens" in dp.seen[0][3]  # the other ranks are told

"""Data-parallel attention on the CPU (gloo): ranks with different batches replay the
same graph in step.

One launch per world size runs every scenario in order on each rank (a launch costs a
few seconds of start-up per rank) with a 5 s process-group timeout, so a rank left
waiting in a collective would fail with gloo's timeout error instead of what is
asserted here; the launch itself is bounded by :func:`run_ranks`'s deadline. The parent
asserts on what the ranks returned.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from cuda_graph_runner.backend.forward_batch import ForwardBatch
from cuda_graph_runner.reference.model import PRESETS, ReferenceLlamaForCausalLM
from cuda_graph_runner.runner.distributed import TPGroup
from cuda_graph_runner.runner.dp_group import DPGroup, all_gather_rows
from cuda_graph_runner.testing.fakes import RecordingBackend
from cuda_graph_runner.testing.tolerances import model_tolerance
from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch
from cuda_graph_runner.testing.tp_launch import run_ranks

GROUP_TIMEOUT_S = 5.0
DECODE_STEPS = 2
MAX_BS = 4
#: Each rank's prompts, by world size: one rank with three requests, one idle.
PROMPTS = {2: [[[5, 9, 3, 7], [11, 2, 8, 4, 6, 1, 10], [3, 3]], []]}
#: Per step, each rank's live decode batch size (0: no requests), by world size: ragged
#: steps, an idle rank, a step above the largest graph (every rank eager), all idle.
SCHEDULE = {
    2: [(3, 1), (0, 2), (4, 0), (1, 1), (6, 2), (0, 0), (2, 3)],
    4: [(3, 1, 0, 2), (0, 0, 4, 1), (1, 5, 0, 0), (0, 0, 0, 0), (2, 2, 2, 1)],
}


class DPToy(ToyModel):
    """ToyModel whose hidden rows go through an all-gather over the DP group (every rank's
    rows, then this rank's): its forward needs the same rows on every rank. Graph
    variants ``a``/``b`` picked by ``self.choice(batch)``."""

    def __init__(self, dp: Optional[DPGroup]) -> None:
        super().__init__()
        self.dp_group = dp
        self.choice: Callable[[ForwardBatch], str] = lambda batch: "a"

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        h = super().forward(batch)
        if self.dp_group is None:
            return h
        n, r = h.shape[0], self.dp_group.rank
        return all_gather_rows(h, self.dp_group)[r * n : (r + 1) * n]

    def graph_variants(self):
        return ["a", "b"]

    def graph_variant(self, batch: ForwardBatch) -> str:
        return self.choice(batch)


def _outcome(fn: Callable[[], Any]) -> Tuple[str, Optional[str]]:
    try:
        fn()
    except Exception as exc:
        return type(exc).__name__, str(exc)
    return "ok", None


def _decode_runner(model, backend, max_bs: int = MAX_BS):
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    return DecodeCudaGraphRunner(
        model, {"decode": {"max_bs": max_bs}}, device="cpu", backend=backend, show_progress=False
    )


def _session(model, prompts, prefill_fn, decode_fn) -> Tuple[List[torch.Tensor], List[int]]:
    """Prefill then DECODE_STEPS greedy decodes of ``prompts`` (none: the rank passes None
    every step); each step's float32 logits and each step's output rows."""
    from cuda_graph_runner.reference.batches import GreedySession

    # The attached cache: captured graphs hold its tensors, as device graphs hold addresses.
    cache = model.kv_cache or model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)
    if not prompts:
        rows = [prefill_fn(None).shape[0]] + [decode_fn(None).shape[0] for _ in range(DECODE_STEPS)]
        return [], rows
    seen: List[int] = []

    def counted(fn):
        def run(batch):
            out = fn(batch)
            seen.append(out.shape[0])
            return out

        return run

    session = GreedySession(model, cache, prefill_fn=counted(prefill_fn), decode_fn=counted(decode_fn))
    with torch.no_grad():
        session.prefill(prompts)
        for _ in range(DECODE_STEPS):
            session.decode()
    session.close()
    return [t.clone() for t in session.logits], seen


def _reference_sessions(dp: DPGroup, out: Dict[str, Any], prompts: Sequence) -> None:
    # The reference model's DP layout through a decode and a prefill runner (replay),
    # and the same steps through backend 'disabled' (every step eager, still in step).
    from cuda_graph_runner.runner import PrefillCudaGraphRunner
    from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
    from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule
    from cuda_graph_runner_full.backend import FullCudaGraphBackend

    model = ReferenceLlamaForCausalLM.from_config(PRESETS["tiny"], seed=3, dp_group=dp)
    model.create_kv_cache(num_slots=512, max_reqs=8, max_context_len=32)
    # CPU graphs that replay what they recorded (collectives included), shared pool.
    emulated = EmulatedGraphDeviceModule()
    decode = _decode_runner(
        model, FullCudaGraphBackend("cpu", phase="decode", device_module=emulated, memory_pool="pool-0")
    )
    prefill = PrefillCudaGraphRunner(
        model,
        {"prefill": {"bs": [16]}},
        device="cpu",
        backend=BreakableCudaGraphBackend("cpu", phase="prefill", device_module=emulated, memory_pool="pool-0"),
        show_progress=False,
    )
    decode.capture()
    prefill.capture()
    mine = prompts[dp.rank]
    replays: List[Any] = []
    for runner in (decode, prefill):
        replay = runner.backend.replay

        def recorded(key, static_batch, replay=replay):
            replays.append(key)
            return replay(key, static_batch)

        runner.backend.replay = recorded
    out["replayed"] = _session(model, mine, prefill.forward, decode.forward)
    out["replays"] = replays
    eager_decode = _decode_runner(model, "disabled")
    eager_prefill = PrefillCudaGraphRunner(
        model, {"prefill": {"backend": "disabled", "max_bs": 16}}, device="cpu", show_progress=False
    )
    out["eager"] = _session(model, mine, eager_prefill.forward, eager_decode.forward)


#: How a rank agrees on a step, by ``(step + rank) % 3``: ranks mix the three in one step.
AGREEMENTS = ("blocking", "started from the size", "started from the batch")


def _schedule(dp: DPGroup, out: Dict[str, Any], schedule: Sequence[Sequence[int]], overlapped: bool = False) -> None:
    # Per step: the key each rank replayed (or None: eager), its output rows, and whether
    # its rows equal the plain (single-process) forward of its own batch. Overlapped: the
    # agreement started before the batch is built (or from it), per AGREEMENTS.
    model = DPToy(dp)
    backend = RecordingBackend("cpu", phase="decode")
    runner = _decode_runner(model, backend)
    runner.capture()
    steps = []
    for step, sizes in enumerate(schedule):
        bs = sizes[dp.rank]
        how = AGREEMENTS[(step + dp.rank) % 3] if overlapped else "blocking"
        if how == "started from the size":
            runner.start_step_agreement(bs, variant="a")
        batch = decode_batch(bs, offset=dp.rank + 1) if bs else None
        if how == "started from the batch":
            runner.start_step_agreement(batch)
        before = len(backend.events)
        got = runner.forward(batch)
        keys = [e[1] for e in backend.events[before:] if e[0] == "replay"]
        if batch is None:  # nothing back when no rank has requests, else zero rows
            same = got is None if max(sizes) == 0 else got.shape[0] == 0
        else:
            want = ToyModel.compute_logits(model, ToyModel.forward(model, batch), batch)
            same = bool(torch.allclose(got, want))
        steps.append((keys[0] if keys else None, None if got is None else got.shape[0], same))
    name = "overlapped" if overlapped else "schedule"
    out[name] = steps
    out[f"{name}_stats"] = runner.run_stats()["eager_fallbacks"]


class RefusingBackend(RecordingBackend):
    """RecordingBackend whose ``can_run`` refuses every batch while ``refuse`` is set."""

    refuse = False

    def can_run(self, batch, key):
        return not self.refuse and super().can_run(batch, key)


def _overlap_edges(dp: DPGroup, out: Dict[str, Any]) -> None:
    # Agreements started from a size whose built batch differs (rank 1): one the agreed
    # graph cannot take, a batch of another size, another variant; then rank 1 never
    # starts its agreement (rank 0 waits at most step_timeout_s).
    import time

    model = DPToy(dp)
    backend = RefusingBackend("cpu", phase="decode")
    runner = _decode_runner(model, backend)
    runner.capture()

    def step(declared: int, built: int, variant: str = "a") -> Dict[str, Any]:
        runner.start_step_agreement(declared, variant="a")
        batch = decode_batch(built, offset=dp.rank + 1)
        before = len(backend.events)
        result: Dict[str, Any] = {}

        def run():
            got = runner.forward(batch)
            want = ToyModel.compute_logits(model, ToyModel.forward(model, batch), batch)
            result["same"] = bool(torch.allclose(got, want))

        result["outcome"] = _outcome(run)
        result["keys"] = [e[1] for e in backend.events[before:] if e[0] == "replay"]
        return result

    backend.refuse = dp.rank == 1
    out["refused"] = step(3, 3) if dp.rank == 0 else step(1, 1)
    backend.refuse = False
    out["refused_stats"] = runner.run_stats()["eager_fallbacks"]
    out["other_size"] = step(3, 3) if dp.rank == 0 else step(2, 3)
    model.choice = lambda batch: "a" if dp.rank == 0 else "b"
    out["other_variant"] = step(2, 2)
    model.choice = lambda batch: "a"
    out["after"] = step(1, 1) if dp.rank == 0 else step(2, 2)
    dp.step_timeout_s = 1.0
    if dp.rank == 1:  # never starts this step's agreement
        time.sleep(1.6)
        return
    start = time.monotonic()
    out["stalled"] = _outcome(lambda: (runner.start_step_agreement(2, variant="a"), runner.forward(decode_batch(2))))
    out["stalled_s"] = time.monotonic() - start
    out["then_stalled"] = _outcome(lambda: runner.start_step_agreement(2, variant="a"))


def _failures(dp: DPGroup, out: Dict[str, Any]) -> None:
    # A decision failing on rank 1, ranks picking different variants, an idle rank taking
    # the others' variant, a capture failing on rank 1: an error on every rank, at once.
    import time

    model = DPToy(dp)
    backend = RecordingBackend("cpu", phase="decode")
    runner = _decode_runner(model, backend)
    runner.capture()

    def choice(batch: ForwardBatch) -> str:
        if dp.rank == 1:
            raise ValueError("injected graph_variant failure")
        return "a"

    model.choice = choice
    start = time.monotonic()
    out["decision"] = _outcome(lambda: runner.forward(decode_batch(2)))
    out["decision_s"] = time.monotonic() - start
    model.choice = lambda batch: "a"
    bad = decode_batch(2)
    if dp.rank == 1:  # a live batch the replay would refuse, on one rank: refused before the step
        bad = bad.replace(input_ids=bad.input_ids.float())
    out["bad_batch"] = _outcome(lambda: runner.forward(bad))
    model.choice = lambda batch: "a" if dp.rank == 0 else "b"
    out["variant"] = _outcome(lambda: runner.forward(decode_batch(1 + dp.rank)))
    model.choice = lambda batch: "b"
    before = len(backend.events)
    out["idle_variant"] = _outcome(lambda: runner.forward(decode_batch(3) if dp.rank == 0 else None))
    out["idle_keys"] = [e[1] for e in backend.events[before:] if e[0] == "replay"]

    class FailOnRankOne(RecordingBackend):
        def capture_one(self, key, forward_fn, *, post_warmup_hook=None):
            super().capture_one(key, forward_fn, post_warmup_hook=post_warmup_hook)
            # After the size's last variant: no forward of this step is left to pair with.
            if dp.rank == 1 and key.size == 2 and key.variant.endswith("|b"):
                raise RuntimeError("injected capture failure")

    failing = _decode_runner(model, FailOnRankOne("cpu", phase="decode"))
    out["capture"] = _outcome(failing.capture)
    out["then"] = _outcome(lambda: runner.forward(decode_batch(2)))


#: The torch.distributed calls that talk to other ranks (or make a group), spied on per step.
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_single",
    "all_gather_object",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "new_group",
)
#: Per step, each rank's live batch size: replays, an idle rank, a step above the largest
#: graph (every rank eager), every rank idle.
COUNTED_STEPS = [(3, 1), (0, 2), (6, 2), (0, 0), (2, 2)]


class QuietDPToy(DPToy):
    """DPToy whose forward runs no collective: what a step issues is the runner's alone."""

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return ToyModel.forward(self, batch)


class OneVariantToy(QuietDPToy):
    """QuietDPToy with one graph variant (as every model without variants): the
    agreement's one-word round."""

    def graph_variants(self):
        return [""]

    def graph_variant(self, batch: ForwardBatch) -> str:
        return ""


def _rank_dies(dp: DPGroup, out: Dict[str, Any]) -> None:
    # The last rank leaves the group (its sockets close, as a dead process's do) before
    # the step; the others agree, ranks 0 and 1 overlapped, the rest blocking.
    import time

    import torch.distributed as dist

    runner = _decode_runner(QuietDPToy(dp), RecordingBackend("cpu", phase="decode"))
    runner.capture()
    dp.step_timeout_s = 1.0
    dp.barrier()
    if dp.rank == dp.size - 1:
        dist.destroy_process_group()
        return
    start = time.monotonic()

    def step():
        if dp.rank < 2:
            runner.start_step_agreement(2, variant="a")
        runner.forward(decode_batch(2))

    out["dies"] = _outcome(step)
    out["dies_s"] = time.monotonic() - start


def _collectives(dp: DPGroup, out: Dict[str, Any]) -> None:
    _collectives_of(dp, out, QuietDPToy(dp), "")
    _collectives_of(dp, out, OneVariantToy(dp), "one_variant_")


def _collectives_of(dp: DPGroup, out: Dict[str, Any], model: Any, prefix: str) -> None:
    # Per step: the torch.distributed calls runner.forward made (outermost only: one
    # collective calling another counts once), with the all-reduce's tensor and length.
    import torch.distributed as dist
    from torch.overrides import TorchFunctionMode

    runner = _decode_runner(model, RecordingBackend("cpu", phase="decode"))
    runner.capture()
    calls: List[Tuple[str, Any]] = []
    depth = [0]

    def spy(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            if depth[0] == 0:
                t = args[0] if args and isinstance(args[0], torch.Tensor) else None
                calls.append((name, None if t is None else (t.data_ptr(), t.numel())))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    real = {name: getattr(dist, name) for name in COLLECTIVES if hasattr(dist, name)}
    steps = []
    try:
        for name, fn in real.items():
            setattr(dist, name, spy(name, fn))
        for sizes in COUNTED_STEPS:
            bs = sizes[dp.rank]
            del calls[:]
            batch = decode_batch(bs, offset=dp.rank + 1) if bs else None
            got = runner.forward(batch)
            steps.append(list(calls))
            if batch is not None:  # this rank's own rows, equal to its eager result
                want = ToyModel.compute_logits(model, ToyModel.forward(model, batch), batch)
                assert torch.allclose(got, want), (prefix, sizes)
    finally:
        for name, fn in real.items():
            setattr(dist, name, fn)
    out[prefix + "collectives"] = steps
    out[prefix + "collective_stats"] = runner.run_stats()["eager_fallbacks"]
    if prefix:
        return

    class TorchCalls(TorchFunctionMode):
        seen: List[str] = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.seen.append(getattr(func, "__name__", repr(func)))
            return func(*args, **(kwargs or {}))

    with TorchCalls():
        dp.agree_batch(2 + dp.rank, True, "a", variants=["a", "b"])
    out["agreement_torch_calls"] = TorchCalls.seen


#: Each rank's (live size, ready, variant) given straight to DPGroup.agree_batch with one
#: captured variant: idle, two ragged ready sizes, not ready (an eager step), and ready
#: with requests but no variant (only a direct caller can say that).
AGREE_STATES = [(0, True, None), (3, True, ""), (7, True, ""), (5, False, None), (4, True, None)]


def _one_word(dp: DPGroup, out: Dict[str, Any]) -> None:
    # Every pair of the two ranks' states through the one-word round, with the number of
    # all-reduces each agreement issued; then a failure and a variant it cannot send.
    import torch.distributed as dist

    real = dist.all_reduce
    count = [0]

    def counted(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    # Before a capture agreed on the variants: the five-word round, the same length on
    # both ranks, so ranks declaring different variants get a named mismatch (one word
    # against five would abort gloo).
    fresh = DPGroup.of(dp)
    mine = ("",) if dp.rank == 0 else ("a", "b")
    out["counts_differ"] = _outcome(lambda: fresh.agree_batch(2, True, mine[0], variants=mine))
    out["counts_differ_then"] = _outcome(lambda: fresh.agree_batch(1, True, "", variants=("",)))
    dp.variants_agreed(("",))  # as capture() does once every rank declared them
    results = []
    dist.all_reduce = counted  # type: ignore[assignment]
    try:
        for pair in [(a, b) for a in AGREE_STATES for b in AGREE_STATES]:
            count[0] = 0
            results.append((pair, dp.agree_batch(*pair[dp.rank], variants=("",)), count[0]))
        out["one_word"] = results
        out["one_word_failed"] = _outcome(
            lambda: dp.agree_batch(2, True, "", variants=("",), failed="ValueError: boom" if dp.rank else None)
        )
        out["one_word_foreign"] = _outcome(lambda: dp.agree_batch(2, True, "x" if dp.rank == 0 else ""))
        out["one_word_then"] = _outcome(lambda: dp.agree_batch(1, True, "", variants=("",)))
    finally:
        dist.all_reduce = real  # type: ignore[assignment]


def _eager_first(dp: DPGroup, out: Dict[str, Any]) -> None:
    # Under eager_first a size replays as soon as every rank captured it, before the
    # largest size; the steps before count as that size's traffic ("not captured yet").
    from cuda_graph_runner.runner import DecodeCudaGraphRunner

    model = DPToy(dp)
    backend = RecordingBackend("cpu", phase="decode")
    config = {"decode": {"max_bs": MAX_BS, "capture": "eager_first"}}
    runner = DecodeCudaGraphRunner(model, config, device="cpu", backend=backend, show_progress=False)
    runner.capture()
    batch = decode_batch(2, offset=dp.rank + 1)
    steps = []
    for step in range(3):
        before = len(backend.events)
        got = runner.forward(batch)
        want = ToyModel.compute_logits(model, ToyModel.forward(model, batch), batch)
        keys = [e[1].size for e in backend.events[before:] if e[0] == "replay"]
        steps.append((keys, bool(torch.allclose(got, want))))
        if step == 0:
            step_done = runner.capture_step(1.0)  # at least one size: the observed one first
            out["eager_first_captured"] = list(step_done.sizes)
    out["eager_first"] = steps
    out["eager_first_stats"] = runner.run_stats()["eager_fallbacks"]


def _rank(tp: TPGroup, world: int, names: Sequence[str]) -> Dict[str, Any]:
    torch.set_num_threads(1)  # ranks share the CI machine's cores
    dp = DPGroup.of(tp)
    out: Dict[str, Any] = {"rank": dp.rank}
    every = {
        "_reference_sessions": lambda: _reference_sessions(dp, out, PROMPTS[world]),
        "_schedule": lambda: _schedule(dp, out, SCHEDULE[world]),
        "_overlapped": lambda: _schedule(dp, out, SCHEDULE[world], overlapped=True),
        "_overlap_edges": lambda: _overlap_edges(dp, out),
        "_rank_dies": lambda: _rank_dies(dp, out),
        "_failures": lambda: _failures(dp, out),
        "_collectives": lambda: _collectives(dp, out),
        "_one_word": lambda: _one_word(dp, out),
        "_eager_first": lambda: _eager_first(dp, out),
    }
    for name, run in ((n, every[n]) for n in names):
        try:
            run()
        except Exception as exc:  # what a scenario did not expect: its test fails, naming it
            import traceback

            out[name] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    return out


@pytest.fixture(scope="module")
def two_ranks():
    # _overlap_edges last: its stalled step leaves the group unusable.
    scenarios = (
        "_reference_sessions",
        "_schedule",
        "_failures",
        "_collectives",
        "_one_word",
        "_overlapped",
        "_eager_first",
        "_overlap_edges",  # last: a rank that never starts leaves the group unusable
    )
    return run_ranks(_rank, 2, 2, scenarios, timeout_s=150, group_timeout_s=GROUP_TIMEOUT_S)


@pytest.fixture(scope="module")
def four_ranks():
    # _rank_dies last: it leaves the group unusable.
    scenarios = ("_schedule", "_overlapped", "_rank_dies")
    return run_ranks(_rank, 4, 4, scenarios, timeout_s=200, group_timeout_s=GROUP_TIMEOUT_S)


def _done(ranks, scenario: str) -> None:
    for r in ranks:
        assert scenario not in r, f"rank {r['rank']}: {r[scenario]}"


def _check_reference(ranks, world: int) -> None:
    _done(ranks, "_reference_sessions")
    cfg = PRESETS["tiny"]
    tol = model_tolerance(cfg, torch.float32, context_len=32)
    single = ReferenceLlamaForCausalLM.from_config(cfg, seed=3)
    # Every rank replayed the same graphs, step by step (prefill then decodes).
    keys = [r["replays"] for r in ranks]
    assert all(k == keys[0] for k in keys) and len(keys[0]) == 1 + DECODE_STEPS, keys
    for r in ranks:
        prompts = PROMPTS[world][r["rank"]]
        replayed, rows = r["replayed"]
        eager, eager_rows = r["eager"]
        assert rows == eager_rows == [len(prompts)] * (1 + DECODE_STEPS), (r["rank"], rows, eager_rows)
        assert len(replayed) == len(eager)
        for got, want in zip(replayed, eager):  # replay equals the rank's eager result
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        if prompts:  # and both equal one process running only this rank's requests
            ref, _ = _session(single, prompts, _eager(single), _eager(single))
            for got, want in zip(replayed, ref):
                torch.testing.assert_close(got, want, **tol, msg=f"rank {r['rank']} DP={world}")


def _eager(model):
    from cuda_graph_runner.reference.batches import eager_logits_fn

    return eager_logits_fn(model)


def _check_schedule(ranks, world: int, name: str = "schedule") -> None:
    _done(ranks, f"_{name}")
    for step, sizes in enumerate(SCHEDULE[world]):
        biggest = max(sizes)
        keys = {r[name][step][0] for r in ranks}
        assert len(keys) == 1, (step, sizes, keys)  # every rank replays the same key (or none)
        (key,) = keys
        if 0 < biggest <= MAX_BS:
            padded = min(s for s in (1, 2, 4) if s >= biggest)
            assert key is not None and key.size == padded, (step, sizes, key)
        else:
            assert key is None, (step, sizes, key)
        for r in ranks:
            _, rows, same = r[name][step]
            bs = sizes[r["rank"]]
            assert rows == (None if biggest == 0 else bs), (step, r["rank"], rows)
            assert same, (step, r["rank"])  # its own rows equal its own batch's forward


def test_dp2_ragged_and_idle_ranks_replay_their_eager_result(two_ranks):
    """DP=2: one rank with three requests, one idle; prefill and decode replays equal the
    rank's eager result and one process's result on its requests alone."""
    _check_reference(two_ranks, 2)


def test_dp2_every_rank_replays_the_same_key_every_step(two_ranks):
    _check_schedule(two_ranks, 2)
    stats = two_ranks[0]["schedule_stats"]
    assert stats.get("too large") == 1, stats  # the step of 6 requests ran eagerly


def test_dp4_ragged_and_idle_ranks_replay_the_same_key_and_their_own_rows(four_ranks):
    """DP=4: ragged steps with idle ranks; each rank's rows equal its own batch's forward."""
    _check_schedule(four_ranks, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_overlapped_agreement_replays_the_same_key_on_every_rank(world, two_ranks, four_ranks):
    """Agreements started before the batch is built (from its size), from the built batch,
    or blocking, mixed across the ranks of one step: every rank replays the same key
    (ragged steps, idle ranks), and each rank's rows equal its own batch's forward."""
    ranks = two_ranks if world == 2 else four_ranks
    _check_schedule(ranks, world, "overlapped")
    assert ranks[0]["overlapped_stats"] == ranks[0]["schedule_stats"]  # the same steps ran eagerly


def test_overlapped_agreement_keeps_a_rank_with_another_batch_in_step(two_ranks):
    """A rank whose built batch differs from the size it started from: its batch the agreed
    graph cannot take runs eagerly at the graph's size (rank 0 still replays); a batch of
    another size or variant runs the step as an idle rank, then raises on that rank alone;
    the next step runs. A rank that never starts its agreement: rank 0 raises within
    step_timeout_s, and the group refuses further agreements at once."""
    _done(two_ranks, "_overlap_edges")
    r0, r1 = two_ranks
    assert r0["refused"] == {"outcome": ("ok", None), "same": True, "keys": [r0["refused"]["keys"][0]]}
    assert r0["refused"]["keys"][0].size == 4
    assert r1["refused"] == {"outcome": ("ok", None), "same": True, "keys": []}  # eager, at size 4
    assert r1["refused_stats"] == {"variant not captured": 1}, r1["refused_stats"]
    assert r0["other_size"]["outcome"] == ("ok", None) and r0["other_size"]["same"]
    kind, message = r1["other_size"]["outcome"]
    assert kind == "ValueError" and "got a batch of 3" in message and "declared 2" in message, message
    assert r1["other_size"]["keys"] == r0["other_size"]["keys"]  # in step, as an idle rank
    assert r0["other_variant"]["outcome"] == ("ok", None)
    kind, message = r1["other_variant"]["outcome"]
    assert kind == "ValueError" and "graph_variant(batch) is 'b'" in message and "variant='a'" in message, message
    for r in two_ranks:
        assert r["after"]["outcome"] == ("ok", None) and r["after"]["same"], r["after"]
        assert r["after"]["keys"] == r0["after"]["keys"] and r["after"]["keys"][0].size == 2
    kind, message = r0["stalled"]
    assert kind == "DataParallelStepError" and "did not complete on DP rank 0 of 2" in message, message
    assert "timed out" in message and "step_timeout_s=1 s" in message, message
    assert r0["stalled_s"] < GROUP_TIMEOUT_S  # the step timeout, not the process group's
    assert r0["then_stalled"] == ("DataParallelStepError", message)


def test_a_rank_that_left_the_group_is_an_error_on_every_other_rank_within_the_step_timeout(four_ranks):
    """DP=4, rank 3 gone before a step: ranks 0-2 (two overlapped, one blocking) each raise
    DataParallelStepError within seconds, not at the process group's timeout."""
    _done(four_ranks, "_rank_dies")
    for r in four_ranks[:3]:
        kind, message = r["dies"]
        assert kind == "DataParallelStepError", (r["rank"], kind, message)
        assert f"did not complete on DP rank {r['rank']} of 4" in message and "another DP rank died" in message
        assert r["dies_s"] < GROUP_TIMEOUT_S, (r["rank"], r["dies_s"])


def test_dp2_a_failure_on_one_rank_is_named_on_every_rank(two_ranks):
    _done(two_ranks, "_failures")
    r0, r1 = two_ranks
    assert r1["decision"] == ("ValueError", "injected graph_variant failure")
    kind, message = r0["decision"]
    assert kind == "DataParallelStepError", (kind, message)
    assert "rank 1: ValueError: injected graph_variant failure" in message
    assert r0["decision_s"] < GROUP_TIMEOUT_S  # at once, not at the group's timeout
    kind, message = r1["bad_batch"]
    assert kind == "ValueError" and "batch.input_ids is (2,) torch.float32" in message, (kind, message)
    kind, message = r0["bad_batch"]
    assert kind == "DataParallelStepError" and "rank 1: ValueError: batch.input_ids" in message, (kind, message)
    for r in two_ranks:
        kind, message = r["variant"]
        assert kind == "DataParallelMismatchError", (r["rank"], kind, message)
        assert "rank 0: 'a'" in message and "rank 1: 'b'" in message
        assert r["idle_variant"] == ("ok", None)
        assert [k.variant for k in r["idle_keys"]] == ["decode|b"]  # the idle rank took rank 0's
        assert r["then"] == ("ok", None)  # the group is usable after each error
    assert r1["capture"] == ("RuntimeError", "injected capture failure")
    kind, message = r0["capture"]
    assert kind == "TensorParallelCaptureError" and "another DP rank" in message, (kind, message)
    assert "rank 1: RuntimeError: injected capture failure" in message


def test_dp2_a_step_issues_one_small_collective_on_a_reused_tensor(two_ranks):
    """Whatever the step (replay, idle rank, every rank eager, every rank idle), the
    runner's agreement is one all-reduce of a few int64s, on the same tensor every step,
    and makes no tensor: no second collective, no group, no torch op but the collective.
    With one graph variant it is of one int64 (a rank that cannot replay its batch takes
    a second round of five: the direct agreement test)."""
    _done(two_ranks, "_collectives")
    for r in two_ranks:
        steps = r["collectives"]
        assert len(steps) == len(COUNTED_STEPS)
        for sizes, calls in zip(COUNTED_STEPS, steps):
            assert [name for name, _ in calls] == ["all_reduce"], (r["rank"], sizes, calls)
        tensors = {calls[0][1] for calls in steps}
        assert len(tensors) == 1, (r["rank"], tensors)  # one tensor, reused
        ((_, numel),) = tensors
        assert numel == 5, numel
        assert r["agreement_torch_calls"] == ["all_reduce"], r["agreement_torch_calls"]
        # The step above the largest graph too: its ranks are ready, the agreed size says eager.
        for sizes, calls in zip(COUNTED_STEPS, r["one_variant_collectives"]):
            assert [n for _, (_, n) in calls] == [1], (r["rank"], sizes, calls)
        assert len({c[1] for calls in r["one_variant_collectives"] for c in calls}) == 1  # one tensor, reused
    for prefix in ("", "one_variant_"):
        assert two_ranks[0][prefix + "collective_stats"].get("too large") == 1  # one eager step


def test_dp2_the_one_word_agreement_gives_what_five_words_give(two_ranks):
    """Every pair of rank states (idle, ragged ready sizes, not ready, ready without a
    variant): the largest size, whether every rank is ready and the variant (the
    captured one when any rank has it), on both ranks; one all-reduce unless a rank is
    not ready. A failure and a variant outside the captured one stop both ranks, naming
    the rank; the group is usable after."""
    _done(two_ranks, "_one_word")
    r0, r1 = two_ranks
    assert len(r0["one_word"]) == len(AGREE_STATES) ** 2
    for (pair, got0, n0), (_, got1, n1) in zip(r0["one_word"], r1["one_word"]):
        want = (
            max(s for s, _, _ in pair),
            all(ready for _, ready, _ in pair),
            "" if any(v is not None for _, _, v in pair) else None,
        )
        assert tuple(got0) == tuple(got1) == want, (pair, got0, got1)
        rounds = 1 if all(ready and (v is not None or s == 0) for s, ready, v in pair) else 2
        assert n0 == n1 == rounds, (pair, n0, n1)
    for r in two_ranks:
        kind, message = r["one_word_failed"]
        assert kind == "DataParallelStepError" and "rank 1: ValueError: boom" in message, (kind, message)
        kind, message = r["one_word_foreign"]
        assert kind == "DataParallelStepError", (kind, message)
        assert "rank 0: variant 'x' is not among the captured variants ['']" in message, message
        assert r["one_word_then"] == ("ok", None)
        kind, message = r["counts_differ"]
        assert kind == "DataParallelMismatchError" and "rank 0: '', rank 1: 'a'" in message, (kind, message)
        assert r["counts_differ_then"] == ("ok", None)


# -- one process ------------------------------------------------------------------------------


def test_one_rank_group_runs_no_collective_and_none_needs_a_group():
    dp = DPGroup(0, 1, torch.device("cpu"))
    assert dp.agree_batch(3, True, "a") == (3, True, "a")
    x = torch.randn(2, 3)
    assert all_gather_rows(x, dp) is x
    runner = _decode_runner(DPToy(None), RecordingBackend("cpu", phase="decode"))
    with pytest.raises(ValueError, match="batch=None .* only with a DP group"):
        runner.forward(None)


def test_the_row_gather_has_a_fake_implementation():
    """What Dynamo and inductor see of the DP row gather: its output shape, symbolic sizes included."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from cuda_graph_runner.runner.tp_ops import all_gather_rows_op

    dp = DPGroup(0, 2, torch.device("cpu"))
    with FakeTensorMode(shape_env=ShapeEnv()) as mode:
        assert all_gather_rows_op(mode.from_tensor(torch.empty(5, 8)), dp.name, 2).shape == (10, 8)


def test_dp_layout_refuses_what_it_cannot_split():
    with pytest.raises(ValueError, match="intermediate_size=.* is not a multiple of dp=7"):
        ReferenceLlamaForCausalLM(PRESETS["tiny"], dp_group=DPGroup(0, 7, torch.device("cpu")))
    model = DPToy(DPGroup(0, 2, torch.device("cpu")))
    model.tp_group = TPGroup(0, 2, torch.device("cpu"))
    with pytest.raises(ValueError, match="data parallelism combined with tensor parallelism is not supported"):
        _decode_runner(model, RecordingBackend("cpu", phase="decode"))
    with pytest.raises(ValueError, match="tp_group and dp_group together"):
        ReferenceLlamaForCausalLM(
            PRESETS["tiny"], tp_group=TPGroup(0, 2, torch.device("cpu")), dp_group=DPGroup(1, 2, torch.device("cpu"))
        )


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--dp", "0"], "argument --dp: invalid value '0'; accepted: an integer >= 1"),
        (["--dp", "2"], "torchrun --nproc-per-node 2 -m cuda_graph_runner bench --dp 2"),
        (["--dp", "2", "--tp", "2"], "--tp 2 with --dp 2: data parallelism with tensor parallelism is not supported"),
    ],
)
def test_bench_dp_usage_errors(argv, message, capsys, monkeypatch):
    from cuda_graph_runner.cli.command import main

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    try:
        rc = main(["bench", *argv])
    except SystemExit as e:  # refused by argparse, at parse
        rc = e.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_dp2_eager_first_replays_a_size_once_every_rank_captured_it(two_ranks):
    _done(two_ranks, "_eager_first")
    for r in two_ranks:
        assert r["eager_first_captured"][0] == 2, r["eager_first_captured"]  # observed first
        assert r["eager_first"] == [([], True), ([2], True), ([2], True)], r["eager_first"]
        assert r["eager_first_stats"] == {"not captured yet": 1}, r["eager_first_stats"]

"""The measurements of ``cuda-graph-runner bench``: timing one call, greedy decode and
prefill through a runner compared with eager (:mod:`cuda_graph_runner.cli.bench.command`)."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...backend.forward_batch import ForwardBatch
from ...runner.verify import compared_exactly


def time_ms(fn: Callable[[], Any], *, iters: int, warmup: int, sync: Callable[[], None], repeats: int = 5) -> float:
    """Wall time of one ``fn()`` in ms: the median over ``repeats`` blocks of the mean of
    ``iters`` calls, after ``warmup`` calls.

    One synchronize before and after each block, so asynchronous device work is counted
    and host launch overhead overlaps with it as it does in serving; the median keeps a
    stall of a busy machine out of the number.
    """
    samples = block_means_s(fn, iters=iters, warmup=warmup, sync=sync, repeats=repeats)
    return statistics.median(samples) * 1000.0


def block_means_s(
    fn: Callable[[], Any],
    *,
    iters: int,
    warmup: int,
    sync: Callable[[], None],
    repeats: int,
    host_only: bool = False,
) -> List[float]:
    """The mean seconds per ``fn()`` call of each of ``repeats`` timed blocks of ``iters``
    calls, after ``warmup`` untimed calls.

    A block starts after a synchronize. Its clock stops after a second synchronize
    (device work counted), or with ``host_only`` before it (the host cost of issuing the
    calls; the synchronize then only keeps queued work out of the next block).
    """
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        if not host_only:
            sync()
        samples.append((time.perf_counter() - start) / iters)
        if host_only:
            sync()
    return samples


#: Rounds of :func:`paired_ms` the bench runs per size: on the CPU (blocks of a few ms on
#: a machine others share) more rounds, which cost little next to compilation.
PAIRED_ROUNDS = {"cpu": 15}
DEFAULT_PAIRED_ROUNDS = 5


#: A row whose rounds spread more than this factor (its slowest round's ms over its
#: fastest, eager or graph: :func:`round_spread`) makes the bench note that the machine
#: was busy during the run (:func:`busy_note`). Rounds of a quiet machine stay well
#: within it; one stalled by another process's time slice is several times slower.
BUSY_SPREAD = 2.0


def round_spread(row: Dict[str, Any]) -> Optional[float]:
    """The largest slowest-over-fastest round factor of a bench row's per-round samples
    (``eager_samples_ms``, ``graph_samples_ms``), or None when it has fewer than two."""
    spreads = []
    for key in ("eager_samples_ms", "graph_samples_ms"):
        samples = [s for s in row.get(key) or () if s is not None]
        if len(samples) >= 2 and min(samples) > 0:
            spreads.append(max(samples) / min(samples))
    return max(spreads) if spreads else None


def _row_name(row: Dict[str, Any]) -> str:
    if "batch_size" in row:
        where = f"decode batch {row['batch_size']}"
    else:
        where = f"prefill {row.get('num_tokens')} tokens in {row.get('requests')} requests"
    return f"{where} (backend {row.get('backend', '?')})"


def busy_note(rows: Sequence[Dict[str, Any]], *, threshold: float = BUSY_SPREAD) -> str:
    """A note when the run's own rounds say the machine was busy: some row's rounds spread
    more than ``threshold`` (:func:`round_spread`); names the worst row, its spread and
    the threshold. "" otherwise (also for rows without samples).

    Why the rounds and not the load average: a load taken before the run says nothing of
    the minutes it times, and a load the bench's own threads and compile workers make
    is no stall; a stall is what spreads the rounds.
    """
    worst, worst_row = 0.0, None
    for row in rows:
        spread = round_spread(row)
        if spread is not None and spread > worst:
            worst, worst_row = spread, row
    if worst_row is None or worst <= threshold:
        return ""
    return (
        f"the machine was busy: the rounds of {_row_name(worst_row)} spread {worst:.1f}x (slowest / fastest round; "
        f"this note shows above {threshold:.1f}x): some steps waited for a CPU another process held, so "
        "times and ratios vary between runs; the medians keep most of it out"
    )


def paired_ms(
    eager_fn: Callable[[], Any],
    graph_fn: Callable[[], Any],
    *,
    iters: int,
    warmup: int,
    sync: Callable[[], None],
    rounds: int = DEFAULT_PAIRED_ROUNDS,
) -> Dict[str, Any]:
    """Eager and graph timed interleaved in one run: ``rounds`` rounds, each one timed block
    of ``iters`` calls of each (eager first in even rounds, graph first in odd ones, so a
    drift of the machine within a round cancels), after ``warmup`` untimed calls of each.

    Returns ``{"eager_ms", "graph_ms", "speedup", "speedup_lo", "speedup_hi",
    "eager_samples_ms", "graph_samples_ms"}``: the times are the median block means in ms
    (a stall of a shared machine spoils one round, not the median); ``speedup`` is
    ``eager_ms / graph_ms``, the ratio of the two printed numbers; ``speedup_lo`` /
    ``speedup_hi`` the min and max of the per-round ratios eager / graph (the spread; they
    bound ``speedup``, since every round's eager time is within them times its graph time);
    samples are the per-round block means in ms, in round order.
    ``benchmarks/bench_summary.py`` pairs run.py's rounds the same way.

    Raises:
        ValueError: ``rounds`` or ``iters`` below 1.
    """
    if rounds < 1 or iters < 1:
        raise ValueError(f"paired timing needs rounds >= 1 and iters >= 1, got rounds={rounds}, iters={iters}")
    for _ in range(warmup):
        eager_fn()
        graph_fn()
    eager_s: List[float] = []
    graph_s: List[float] = []
    for r in range(rounds):
        order = ((eager_fn, eager_s), (graph_fn, graph_s))
        for fn, out in order if r % 2 == 0 else order[::-1]:
            out.extend(block_means_s(fn, iters=iters, warmup=0, sync=sync, repeats=1))
    ratios = [e / g for e, g in zip(eager_s, graph_s) if g > 0]
    eager_ms, graph_ms = statistics.median(eager_s) * 1000.0, statistics.median(graph_s) * 1000.0
    return {
        "eager_ms": eager_ms,
        "graph_ms": graph_ms,
        "speedup": eager_ms / graph_ms if graph_ms > 0 else None,
        "speedup_lo": min(ratios) if ratios else None,
        "speedup_hi": max(ratios) if ratios else None,
        "eager_samples_ms": [s * 1000.0 for s in eager_s],
        "graph_samples_ms": [s * 1000.0 for s in graph_s],
    }


def replay_prepare_us(runner: Any, batch: ForwardBatch, *, sync: Callable[[], None], iters: int = 200) -> float:
    """Host time of one ``runner.replay_prepare(batch)`` in µs: the median of ``iters``
    single calls (the copies it enqueues are not waited for; one synchronize after)."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        runner.replay_prepare(batch)
        samples.append((time.perf_counter() - start) * 1e6)
    sync()
    return statistics.median(samples)


def sync_fn(device: torch.device) -> Callable[[], None]:
    if device.type == "cpu":
        return lambda: None
    module = torch.get_device_module(device)
    return lambda: module.synchronize(device)  # this device, not whichever is current


def row_times(
    eager: Callable[[Any], Any], runner: Any, batch: Any, *, iters: int, warmup: int, sync: Any, rounds: int
) -> Dict[str, Any]:
    """One bench row's times for ``batch``: eager alone (``eager_ms``, the median of
    ``rounds`` blocks, and ``eager_samples_ms``) when ``runner`` is None, else eager and ``runner.forward`` interleaved in rounds
    (:func:`paired_ms`). Milliseconds per call."""
    if runner is None:
        samples = block_means_s(lambda: eager(batch), iters=iters, warmup=warmup, sync=sync, repeats=rounds)
        return {"eager_ms": statistics.median(samples) * 1000.0, "eager_samples_ms": [t * 1000.0 for t in samples]}
    return paired_ms(
        lambda: eager(batch), lambda: runner.forward(batch), iters=iters, warmup=warmup, sync=sync, rounds=rounds
    )


def bench_decode(
    model: Any,
    runner: Any,
    *,
    batch_sizes: Sequence[int],
    prompt_len: int,
    steps: int,
    iters: int,
    warmup: int,
    seed: int = 0,
    rounds: int = DEFAULT_PAIRED_ROUNDS,
    reference_logits: Optional[Callable[[List[int]], torch.Tensor]] = None,
) -> List[Dict[str, Any]]:
    """Rows ``{batch_size, eager_ms, graph_ms, speedup, tokens_match, max_abs_diff,
    within_tolerance}``, plus ``replay_prepare_us`` (host µs of ``replay_prepare``, median)
    where the batch replays. ``tokens_match``: free-running greedy tokens equal eager's;
    ``max_abs_diff`` / ``within_tolerance``: logits of the same inputs, step by step,
    against the backend's tolerance (:func:`backend_tolerance`).

    ``runner`` None means eager only (graph columns None). ``reference_logits``
    (``tokens -> [len, vocab]`` logits of another implementation's forward of one
    sequence, e.g. transformers' own for :mod:`cuda_graph_runner.reference.models.hf`) adds
    ``hf_match``: that forward, fed each request's prompt and the greedy tokens (the
    runner's, or eager's without one), predicts the same tokens at every step.
    """
    from ...reference.batches import GreedySession, eager_logits_fn, make_decode_batch, make_dummy_prompts

    cache = model.kv_cache
    sync = sync_fn(model.device)
    eager = eager_logits_fn(model)
    rows = []
    for bs in batch_sizes:
        prompts = make_dummy_prompts(bs, prompt_len, model.config.vocab_size, seed=seed + bs)
        ref = GreedySession(model, cache)
        with torch.no_grad():
            ref.prefill(prompts)
            for _ in range(steps):
                ref.decode()
            ref_tokens = ref.tokens
            ref.close()
            row: Dict[str, Any] = {"batch_size": bs}
            # Timing: the same decode batch replayed; each run rewrites the same KV slots.
            timing = GreedySession(model, cache)
            timing.prefill(prompts)
            batch = make_decode_batch(cache, timing.rows, None, [t[-1] for t in timing.tokens])
            row.update(row_times(eager, runner, batch, iters=iters, warmup=warmup, sync=sync, rounds=rounds))
            if runner is not None:
                row["replayed"] = runner.can_run(batch)
                if row["replayed"]:
                    row["replay_prepare_us"] = replay_prepare_us(runner, batch, sync=sync)
            timing.close()
            if runner is not None:
                got = GreedySession(model, cache, decode_fn=lambda b: runner.forward(b).clone())
                got.prefill(prompts)
                for _ in range(steps):
                    got.decode()
                row["tokens_match"] = got.tokens == ref_tokens
                ref_tokens = got.tokens
                got.close()
                row.update(_teacher_forced_check(model, cache, runner, eager, prompts, steps))
            if reference_logits is not None:
                row["hf_match"] = all(
                    reference_logits(list(p) + toks[:-1])[len(p) - 1 :].argmax(-1).tolist() == toks
                    for p, toks in zip(prompts, ref_tokens)
                )
        row.setdefault("speedup", None)
        rows.append(row)
    return rows


def backend_tolerance(model: Any, runner: Any) -> Tuple[float, float]:
    """``(atol, rtol)`` a graph result of ``runner`` must meet against eager: its backend's
    verify-mode tolerance for the model's dtype (``BaseCudaGraphBackend.verify_tolerance``:
    exact backends the base one, a compiling backend its documented wider one)."""
    dtype = next((p.dtype for p in model.parameters()), torch.float32)
    atol, rtol = runner.backend.verify_tolerance(dtype)
    return float(atol), float(rtol)


def within_tolerance(got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float) -> bool:
    """``torch.allclose(got, ref, atol, rtol)`` for floating-point tensors; ``torch.equal``
    when either is integer or bool (token ids: a tolerance scaled by ``|ref|`` would admit
    a wrong token)."""
    if compared_exactly(got) or compared_exactly(ref):
        return got.shape == ref.shape and bool((got == ref).all())
    return bool(torch.allclose(got, ref, atol=atol, rtol=rtol))


def _teacher_forced_check(
    model: Any, cache: Any, runner: Any, eager: Callable[[ForwardBatch], Any], prompts: Any, steps: int
) -> Dict[str, Any]:
    """Graph and eager logits of the *same* inputs at every decode step (eager's tokens fed
    to both): ``max_abs_diff`` and ``within_tolerance`` (the backend's tolerance). Free-running
    greedy tokens may part at a near-tie when a backend's kernels round differently (an
    inductor backend in bfloat16) without anything being wrong; this check may not."""
    from ...reference.batches import GreedySession

    atol, rtol = backend_tolerance(model, runner)
    worst, within = 0.0, True

    def both(batch: ForwardBatch) -> Any:
        nonlocal worst, within
        graph = runner.forward(batch).clone()  # graph first: eager then writes the KV the session keeps
        ref = eager(batch).clone()
        n = batch.batch_size
        worst = max(worst, float((graph[:n] - ref[:n]).abs().max()))
        within = within and within_tolerance(graph[:n], ref[:n], atol, rtol)
        return ref

    session = GreedySession(model, cache, decode_fn=both)
    try:
        session.prefill(prompts)
        for _ in range(steps):
            session.decode()
    finally:
        session.close()
    return {"max_abs_diff": worst, "within_tolerance": within}


def _split(total: int, parts: int) -> List[int]:
    base, rest = divmod(total, parts)
    return [base + (1 if i < rest else 0) for i in range(parts)]


def bench_prefill(
    model: Any,
    runner: Any,
    *,
    token_counts: Sequence[int],
    requests: Sequence[int],
    iters: int,
    warmup: int,
    seed: int = 0,
    rounds: int = DEFAULT_PAIRED_ROUNDS,
    reference_logits: Optional[Callable[[List[int]], torch.Tensor]] = None,
) -> List[Dict[str, Any]]:
    """Rows ``{num_tokens, requests, eager_ms, graph_ms, speedup, replayed, max_abs_diff,
    within_tolerance, argmax_match}`` (``within_tolerance``: against the backend's tolerance,
    :func:`backend_tolerance`). ``reference_logits`` (see :func:`bench_decode`) adds
    ``hf_match``: each request's next token (the runner's, or eager's without one) is
    the argmax of that forward's last logits of the request's prompt."""
    from ...reference.batches import eager_logits_fn, make_dummy_prompts, make_extend_batch

    cache = model.kv_cache
    sync = sync_fn(model.device)
    eager = eager_logits_fn(model)
    rows = []
    for total in token_counts:
        for n_req in requests:
            if n_req > total:
                continue
            lengths = _split(total, n_req)
            prompts = make_dummy_prompts(n_req, lengths, model.config.vocab_size, seed=seed + total)
            reqs = [cache.alloc_request() for _ in prompts]
            batch = make_extend_batch(cache, prompts, rows=reqs)
            row: Dict[str, Any] = {"num_tokens": total, "requests": n_req}
            with torch.no_grad():
                ref = eager(batch).clone()
                if runner is not None:
                    got = runner.forward(batch).clone()
                    row["replayed"] = runner.can_run(batch)
                    atol, rtol = backend_tolerance(model, runner)
                    row["max_abs_diff"] = float((got - ref).abs().max())
                    row["within_tolerance"] = within_tolerance(got, ref, atol, rtol)
                    row["argmax_match"] = bool((got.argmax(-1) == ref.argmax(-1)).all())
                if reference_logits is not None:
                    picked = (got if runner is not None else ref).argmax(-1).tolist()
                    row["hf_match"] = picked == [int(reference_logits(list(p))[-1].argmax()) for p in prompts]
                row.update(row_times(eager, runner, batch, iters=iters, warmup=warmup, sync=sync, rounds=rounds))
            for r in reqs:
                cache.free_request(r)
            row.setdefault("speedup", None)
            rows.append(row)
    return rows

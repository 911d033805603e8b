"""Speculative decoding against plain graph decode, on the reference model.

For each draft (``oracle``: plain greedy's own tokens at no model cost, the mechanism's
upper bound; ``self``: the target as its own draft; ``skip:N``: the target's first N
layers) and each ``k``, in one run:

* tokens per second of the speculative loop (:func:`speculative_generate`: the draft's k
  steps in one :class:`DraftDecodeCudaGraphRunner` graph, verify in one TARGET_VERIFY
  graph of width k + 1) against plain greedy decode through a DECODE graph, and the ratio;
  both target graphs record the greedy argmax (:class:`GreedyDecodeCudaGraphRunner`:
  the round's read is the target's tokens, and the loop launches no argmax of its own;
  ``--logits-verify``: both return logits and the loop runs the argmax eagerly after each
  replay, a launch and a wait for its device time charged to the loop each round); each
  row's ``verify_output`` says which (``tokens`` or ``logits``);
  prefill (eager, the same in both) is timed apart and left out;
* the accept rate and the tokens a request commits per round;
* the loop's host share of a round: ``1 - (seconds inside the runners' forwards, their
  own host work and device work included) / (seconds of the rounds)``, from runs that
  synchronize after each runner forward (so a runner's device time is not charged to the
  loop), with its microseconds per round; tokens per second come from separate runs
  without those synchronizations;
* with ``--host-only``, the loop alone: every runner forward replaced by a replay of the
  outputs it gave in a recorded run (no device work, no runner host work; the loop's own
  upload, table write and read stay, and with ``--logits-verify`` its argmax), its
  microseconds per round, split into the
  draft's ``propose``, building the verify batch, and the read and acceptance after the
  verify, and its share of a round whose runner time is the instrumented runs' (``loop
  alone / (loop alone + runners)``);
* for model drafts, the draft graph's replay against k plain decode replays of the same
  draft model, bare and with each step's argmax (the token pick a plain greedy step runs
  after its replay, which the draft graph records inside: the like-for-like cost), and
  the draft runner's capture seconds per recorded layer-step against the target decode
  runner's, and against k captures of the draft model's own one-step decode runner (the
  same per-step work: the ratio left when a graph's fixed capture cost, which does not
  scale with layers, is charged alike);
* whether the tokens equal plain greedy decoding's (they must: the loop is lossless in
  fp32 without TF32; a divergence prints its step and the target's top-2 logit gap).

Examples::

    python benchmarks/speculative.py --device cuda --preset llama-3.2-1b --dtype float32 --k 4 --batch-sizes 1
    python benchmarks/speculative.py --device cpu --preset tiny --k 2 4 --new-tokens 24
    python benchmarks/speculative.py --device cuda --dtype bfloat16 --drafts oracle --host-only
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Callable, Dict, List

import torch

from cuda_graph_runner.config import CudaGraphConfig
from cuda_graph_runner.reference.batches import GreedySession, eager_logits_fn, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.model import PRESETS
from cuda_graph_runner.reference.speculative import (
    ModelDraft,
    OracleDraft,
    SpeculativeStats,
    StepBuffers,
    layer_skip_draft,
    make_draft_batch,
    speculative_generate,
    step_batch,
)
from cuda_graph_runner.runner import DecodeCudaGraphRunner, GreedyDecodeCudaGraphRunner
from cuda_graph_runner.runner.draft import DraftDecodeCudaGraphRunner
from cuda_graph_runner.testing.reference_setup import next_decode_batch, reference_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, fn: Callable[[], Any]) -> "tuple[float, Any]":
    _sync(device)
    start = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - start, out


def _phase(args: argparse.Namespace, bs: List[int]) -> Dict[str, Any]:
    backend = args.backend
    phase: Dict[str, Any] = {"bs": bs}
    if args.device.startswith("cpu") and backend in ("full", "breakable"):
        return phase  # an emulated backend instance (see _runner)
    if backend == "full+torch_compile":
        phase.update(backend="full", torch_compile=True)
    else:
        phase["backend"] = backend
    return phase


def _runner(cls: Any, model: Any, config: Any, device: torch.device, args: argparse.Namespace, **kwargs: Any) -> Any:
    """A captured runner. On the CPU, ``full`` / ``breakable`` are their backends on
    emulated graphs (a replay reruns the recorded forward): the mechanism, not a speed."""
    if device.type == "cpu" and args.backend in ("full", "breakable"):
        from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

        if args.backend == "full":
            from cuda_graph_runner_full.backend import FullCudaGraphBackend as backend_cls
        else:
            from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend as backend_cls
        kwargs["backend"] = backend_cls(
            "cpu", phase="decode", device_module=EmulatedGraphDeviceModule(), memory_pool="spec"
        )
    return _captured(cls(model, config, show_progress=False, **kwargs))


def plain_greedy(
    model: Any, runner: Any, prompts: List[List[int]], steps: int, device: torch.device, keep_logits: bool = False
):
    """Plain greedy tokens, every step's logits when ``keep_logits`` (for a divergence's
    top-2 gap, from a logits runner; else empty) and ``(prefill seconds, decode seconds)``:
    prefill eager, then
    ``steps - 1`` decode replays, each batch built as the speculative loop builds its own
    (:func:`step_batch` into reused :class:`StepBuffers`), so both pay the same host work
    per forward."""
    cache = model.kv_cache
    buffers = StepBuffers(cache.device)
    kept: List[torch.Tensor] = []
    with torch.no_grad():
        start = time.perf_counter()
        batch = make_extend_batch(cache, prompts)
        first = eager_logits_fn(model)(batch)[: len(prompts)]
        rows = batch.req_pool_indices.tolist()
        tokens = [[t] for t in first.argmax(dim=-1).tolist()]
        if keep_logits:
            kept.append(first.clone())
        _sync(device)
        prefilled = time.perf_counter()
        for _ in range(steps - 1):
            out = runner.forward(step_batch(cache, rows, [[t[-1]] for t in tokens], buffers=buffers))[: len(rows)]
            if keep_logits:
                kept.append(out.clone())
            # A greedy runner's graph returns the tokens; a logits runner's get their argmax.
            for seq, t in zip(tokens, (out.argmax(dim=-1) if out.is_floating_point() else out).tolist()):
                seq.append(t)
        _sync(device)
        end = time.perf_counter()
    for r in rows:
        cache.free_request(r)
    return tokens, kept, prefilled - start, end - prefilled


def first_divergence(got: List[List[int]], expected: List[List[int]], logits: List[torch.Tensor]) -> str:
    for i, (g, e) in enumerate(zip(got, expected)):
        for step, (a, b) in enumerate(zip(g, e)):
            if a != b:
                top2 = logits[step][i].float().topk(2).values
                return f"request {i} step {step}: {a} != {b}, top-2 logit gap {float(top2[0] - top2[1]):.3g}"
    return ""


def replay_seconds(device: torch.device, fn: Callable[[], Any], iters: int) -> float:
    fn()
    elapsed, _ = _timed(device, lambda: [fn() for _ in range(iters)])
    return elapsed / iters


def run(args: argparse.Namespace) -> List[Dict[str, Any]]:
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
        torch.backends.cudnn.allow_tf32 = args.tf32
    max_bs = max(args.batch_sizes)
    context = args.prompt_len + args.new_tokens + max(args.k) + 2
    target = reference_model(args.preset, requests=max_bs, context=context, dtype=dtype, device=device)
    layers = target.config.num_hidden_layers
    config = CudaGraphConfig.from_dict({"decode": _phase(args, sorted(set(args.batch_sizes)))})
    # An untimed capture first: the device's and the allocator's one-time set-up would
    # otherwise be charged to whichever runner captures first.
    warm = CudaGraphConfig.from_dict({"decode": _phase(args, [1])})
    _runner(DecodeCudaGraphRunner, target, warm, device, args)
    decode_capture_s, decode = _timed(device, lambda: _runner(DecodeCudaGraphRunner, target, config, device, args))
    # The timed loops' target graphs: greedy ones (the argmax recorded) unless
    # --logits-verify; plain decode alike, so both sides pick their tokens the same way.
    target_cls = GreedyDecodeCudaGraphRunner if args.greedy_verify else DecodeCudaGraphRunner
    plain = _runner(target_cls, target, config, device, args) if args.greedy_verify else decode
    rows: List[Dict[str, Any]] = []
    for bs in args.batch_sizes:
        prompts = make_dummy_prompts(bs, args.prompt_len, target.config.vocab_size, seed=bs)
        plain_greedy(target, plain, prompts, 4, device)  # warm-up: first replays, allocator
        runs = [plain_greedy(target, plain, prompts, args.new_tokens, device) for _ in range(args.repeats)]
        expected, plain_s = runs[0][0], min(r[3] for r in runs)  # the best run: a rate, not a latency

        def logits(prompts=prompts) -> List[torch.Tensor]:  # only for a divergence's top-2 gap
            return plain_greedy(target, decode, prompts, args.new_tokens, device, keep_logits=True)[1]

        plain_tps = bs * (args.new_tokens - 1) / plain_s
        for k in args.k:
            verify = _runner(target_cls, target, config, device, args, mode="target_verify", num_tokens_per_req=k + 1)
            for name in args.drafts:
                row = _speculative_row(
                    args,
                    target,
                    verify,
                    decode_capture_s,
                    layers,
                    config,
                    prompts,
                    expected,
                    logits,
                    bs,
                    k,
                    name,
                    device,
                )
                row.update(batch_size=bs, k=k, draft=name, plain_tokens_per_s=plain_tps)
                row["verify_output"] = "tokens" if args.greedy_verify else "logits"
                row["speedup"] = row["spec_tokens_per_s"] / plain_tps
                rows.append(row)
                print(_line(row), flush=True)
    return rows


def _captured(runner: Any) -> Any:
    runner.capture()
    return runner


def _speculative_row(
    args, target, verify, decode_capture_s, layers, config, prompts, expected, logits, bs, k, name, device
):
    row: Dict[str, Any] = {}
    in_runners = [0.0]  # seconds inside the runners' forwards (device work finished)
    instrumented = [False]  # the draft's wrappers time (and synchronize) only when set
    context = target.kv_cache.max_context_len
    if name == "oracle":
        draft: Any = OracleDraft(expected)
    else:
        if name == "self":
            draft_model = reference_model(args.preset, requests=bs, context=context, dtype=target.dtype, device=device)
        elif name.startswith("skip:"):
            draft_model = layer_skip_draft(target, int(name[5:]), requests=bs, context=context)
        else:
            raise SystemExit(f"--drafts: {name!r} is not a draft; accepted: oracle, self, skip:N")
        draft_layers = draft_model.config.num_hidden_layers
        capture_s, draft_runner = _timed(
            device, lambda: _runner(DraftDecodeCudaGraphRunner, draft_model, config, device, args, num_steps=k)
        )
        extend_capture_s, extend_runner = _timed(
            device, lambda: _runner(DecodeCudaGraphRunner, draft_model, config, device, args)
        )
        sizes = len(draft_runner.capture_sizes)
        per_draft = capture_s / (sizes * k * draft_layers)
        per_target = decode_capture_s / (len(draft_runner.capture_sizes) * layers)
        row.update(
            draft_capture_s=capture_s,
            capture_per_layer_step_ratio=per_draft / per_target,
            capture_vs_k_plain_draft_captures=capture_s / (k * extend_capture_s),
        )
        bare, with_argmax = _draft_graph_cost(draft_model, draft_runner, extend_runner, prompts, k, device, args.iters)
        row.update(draft_graph_vs_k_plain=bare, draft_graph_vs_k_plain_steps=with_argmax)
        draft = ModelDraft(
            draft_model,
            draft_fn=_timing(draft_runner.forward, device, in_runners, instrumented),
            extend_fn=_timing(extend_runner.forward, device, in_runners, instrumented),
            read_between_proposes=True,
        )

    def clock() -> float:
        _sync(device)
        return time.perf_counter()

    # A warm-up run first (the drafts free what they hold at the end, so they run again).
    speculative_generate(target, prompts, min(args.new_tokens, 2 * k + 2), draft, k, verify_fn=verify.forward)
    best: Any = None
    for _ in range(args.repeats):  # the best run (by its rounds' seconds), as for plain decode
        run_stats = SpeculativeStats()
        got = speculative_generate(
            target, prompts, args.new_tokens, draft, k, verify_fn=verify.forward, stats=run_stats, clock=clock
        )
        if best is None or run_stats.decode_seconds < best[0].decode_seconds:
            best = (run_stats, got)
    stats, got = best
    # The host share from runs that synchronize after each runner forward (the draft's
    # ones are wrapped above): what is left of a round is the loop's own host time.
    verify_fn = _timing(verify.forward, device, in_runners)
    instrumented[0] = True
    host: Any = None
    for _ in range(args.repeats):
        in_runners[0] = 0.0
        timed_stats = SpeculativeStats()
        speculative_generate(
            target, prompts, args.new_tokens, draft, k, verify_fn=verify_fn, stats=timed_stats, clock=clock
        )
        loop_s = max(0.0, timed_stats.decode_seconds - in_runners[0])
        if host is None or loop_s / timed_stats.decode_seconds < host[0]:
            rounds = max(timed_stats.rounds, 1)
            host = (loop_s / max(timed_stats.decode_seconds, 1e-9), loop_s / rounds, in_runners[0] / rounds)
    instrumented[0] = False
    if args.host_only:
        fns = {"verify_fn": verify.forward}
        if name != "oracle":
            fns.update(draft_fn=draft_runner.forward, extend_fn=extend_runner.forward)
        row.update(_host_only(args, target, prompts, draft, k, fns, host[2]))
    row.update(
        spec_tokens_per_s=bs * (args.new_tokens - 1) / max(stats.decode_seconds, 1e-9),
        accept_rate=stats.accept_rate,
        tokens_per_round=stats.tokens_per_round,
        loop_host_share=host[0],
        loop_host_us_per_round=1e6 * host[1],
        rounds=stats.rounds,
        lossless=got == expected,
        divergence="" if got == expected else first_divergence(got, expected, logits()),
    )
    return row


def _host_only(args, target, prompts, draft, k, fns, runners_s_per_round) -> Dict[str, Any]:
    """The loop alone: a recorded run keeps every runner output (a copy), then the timed
    runs get them back in order from stand-ins that do nothing else (the same tokens, so
    the same rounds and acceptance). Best of ``--repeats`` runs by seconds per round."""
    recorded: Dict[str, List[Any]] = {key: [] for key in fns}
    cursor = dict.fromkeys(fns, 0)

    def recording(key):
        def run(batch):
            out = fns[key](batch)
            recorded[key].append(out.clone())
            return out

        return run

    def replaying(key):
        outputs = recorded[key]

        def run(batch):
            i = cursor[key]
            cursor[key] = i + 1
            return outputs[i]

        return run

    def run_loop(stand_ins, stats, clock=None):
        saved = (draft.draft_fn, draft.extend_fn) if isinstance(draft, ModelDraft) else None
        if saved is not None:
            draft.draft_fn, draft.extend_fn = stand_ins["draft_fn"], stand_ins["extend_fn"]
        try:
            return speculative_generate(
                target,
                prompts,
                args.new_tokens,
                timed_draft,
                k,
                verify_fn=stand_ins["verify_fn"],
                stats=stats,
                clock=clock,
            )
        finally:
            if saved is not None:
                draft.draft_fn, draft.extend_fn = saved

    device = target.kv_cache.device
    phases = {"propose": 0.0, "batch": 0.0}
    marks = [0.0]
    timed_draft = _PhaseDraft(draft, phases, marks)
    expected = run_loop({key: recording(key) for key in fns}, SpeculativeStats())
    verify_replay = replaying("verify_fn")

    def verify_marked(batch):  # the end of building the verify batch
        phases["batch"] += time.perf_counter() - marks[0]
        return verify_replay(batch)

    def clock() -> float:
        _sync(device)
        return time.perf_counter()

    best: Any = None
    for _ in range(args.repeats):
        cursor.update(dict.fromkeys(fns, 0))
        phases.update(propose=0.0, batch=0.0)
        stats = SpeculativeStats()
        stand_ins = {key: replaying(key) for key in fns}
        stand_ins["verify_fn"] = verify_marked
        got = run_loop(stand_ins, stats, clock)
        if got != expected or any(cursor[key] != len(recorded[key]) for key in fns):
            raise SystemExit("--host-only: the replayed run took another path than the recorded one")
        per_round = stats.decode_seconds / max(stats.rounds, 1)
        if best is None or per_round < best[0]:
            best = (per_round, {key: value / max(stats.rounds, 1) for key, value in phases.items()})
    per_round, split = best
    split["read_accept"] = max(0.0, per_round - split["propose"] - split["batch"])
    return {
        "host_only_us_per_round": 1e6 * per_round,
        "host_only_phase_us": {key: 1e6 * value for key, value in split.items()},
        "host_only_share": per_round / (per_round + runners_s_per_round),
    }


class _PhaseDraft:
    """A draft whose ``propose`` time is summed into ``phases["propose"]``; ``marks[0]``:
    when the last ``propose`` returned (the verify batch is built from then on)."""

    def __init__(self, draft: Any, phases: Dict[str, float], marks: List[float]) -> None:
        self.draft, self.phases, self.marks = draft, phases, marks

    def prefill(self, prompts):
        return self.draft.prefill(prompts)

    def propose(self, live, outputs, k):
        start = time.perf_counter()
        out = self.draft.propose(live, outputs, k)
        self.marks[0] = end = time.perf_counter()
        self.phases["propose"] += end - start
        return out

    def commit(self, live, proposals, accepted):
        return self.draft.commit(live, proposals, accepted)

    def release(self, request):
        return self.draft.release(request)


def _timing(
    fn: Callable[[Any], Any], device: torch.device, total: List[float], on: "List[bool] | None" = None
) -> Callable[[Any], Any]:
    """``fn`` that adds its seconds, device work included, to ``total[0]`` (while ``on[0]``,
    when given; else plain ``fn``): the rest of a round is the loop's own host time
    (batch building, acceptance, KV rollback)."""

    def run(batch: Any) -> Any:
        if on is not None and not on[0]:
            return fn(batch)
        start = time.perf_counter()
        out = fn(batch)
        _sync(device)
        total[0] += time.perf_counter() - start
        return out

    return run


def _draft_graph_cost(draft_model, draft_runner, extend_runner, prompts, k, device, iters) -> "tuple[float, float]":
    """One k-step draft replay over k plain one-step replays of the same draft model and
    batch: bare, and with each plain step's argmax (a plain greedy step's token pick, which
    the draft graph records in each of its steps)."""
    session = GreedySession(draft_model, draft_model.kv_cache)
    with torch.no_grad():
        session.prefill(prompts)
        rows = session.rows
        cache = draft_model.kv_cache
        batch = make_draft_batch(cache, rows, [t[-1] for t in session.tokens], k)
        graph_s = replay_seconds(device, lambda: draft_runner.forward(batch), iters)
        for r in rows:  # back to the prompt; one plain decode batch, replayed k times
            cache.truncate_request(r, cache.request_len(r) - k)
        step = next_decode_batch(session)
        n = len(rows)
        plain_s = replay_seconds(device, lambda: [extend_runner.forward(step) for _ in range(k)], iters)
        steps_s = replay_seconds(
            device, lambda: [extend_runner.forward(step)[:n].argmax(dim=-1) for _ in range(k)], iters
        )
    session.close()
    return graph_s / plain_s, graph_s / steps_s


def _line(row: Dict[str, Any]) -> str:
    parts = [
        f"bs={row['batch_size']} k={row['k']} draft={row['draft']} verify={row['verify_output']}",
        f"plain {row['plain_tokens_per_s']:.1f} tok/s",
        f"spec {row['spec_tokens_per_s']:.1f} tok/s ({row['speedup']:.2f}x)",
        f"accept {row['accept_rate']:.2f}",
        f"{row['tokens_per_round']:.2f} tok/round",
        f"loop host {100 * row['loop_host_share']:.1f}% of a round ({row['loop_host_us_per_round']:.0f} us)",
    ]
    if "host_only_share" in row:
        split = ", ".join(f"{key} {value:.0f}" for key, value in row["host_only_phase_us"].items())
        parts.append(
            f"loop alone {row['host_only_us_per_round']:.0f} us/round ({split}), "
            f"{100 * row['host_only_share']:.1f}% of a round"
        )
    if "draft_graph_vs_k_plain" in row:
        parts.append(
            f"draft graph / k plain {row['draft_graph_vs_k_plain']:.3f} "
            f"(/ k plain steps with argmax {row['draft_graph_vs_k_plain_steps']:.3f})"
        )
        parts.append(
            f"capture per layer-step vs target {row['capture_per_layer_step_ratio']:.2f}x "
            f"(vs k plain draft captures {row['capture_vs_k_plain_draft_captures']:.2f}x)"
        )
    parts.append("lossless" if row["lossless"] else f"DIVERGED: {row['divergence']}")
    return " | ".join(parts)


def main(argv: "List[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda, cuda:N or cpu")
    parser.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="llama-3.2-1b" if torch.cuda.is_available() else "tiny",
        help="the target's shape (random weights)",
    )
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="target and draft dtype")
    parser.add_argument(
        "--backend", choices=["full", "breakable", "full+torch_compile"], default="full", help="every graph's backend"
    )
    parser.add_argument("--k", type=int, nargs="+", default=[4], help="draft tokens per round, one row each")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1], help="requests per batch, one row each")
    parser.add_argument(
        "--drafts",
        nargs="+",
        default=["oracle", "self", "skip:1"],
        help="oracle (plain greedy's own tokens), self (the target), skip:N (its first N layers)",
    )
    parser.add_argument("--prompt-len", type=int, default=32, help="tokens per prompt")
    parser.add_argument(
        "--new-tokens", type=int, default=257, help="tokens per request (the oracle at k = 4: about 52 rounds)"
    )
    parser.add_argument("--repeats", type=int, default=3, help="timed runs of each loop; the best is reported")
    parser.add_argument("--iters", type=int, default=20, help="replays per draft-graph cost measurement")
    parser.add_argument("--tf32", action="store_true", help="allow TF32 matmuls (off: the lossless check is exact)")
    parser.add_argument(
        "--host-only",
        action="store_true",
        help="also time the loop alone (runner forwards replayed from a recorded run): host us per round and share",
    )
    verify_output = parser.add_mutually_exclusive_group()
    verify_output.add_argument(
        "--logits-verify",
        action="store_true",
        help="verify and plain decode graphs return logits, their argmax run eagerly after each replay "
        "(default: GreedyDecodeCudaGraphRunner graphs that record the argmax)",
    )
    verify_output.add_argument(
        "--greedy-verify",
        action="store_true",
        help="graphs that record the argmax (the default; accepted to state it)",
    )
    parser.add_argument("--json", help="write the rows to this file")
    args = parser.parse_args(argv)
    args.greedy_verify = not args.logits_verify
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r}: not a device; accepted: cuda, cuda:N, cpu")
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type not in ("cuda", "cpu") or (device.type == "cuda" and (device.index or 0) >= gpus):
        accepted = "cpu" + (f", cuda, cuda:0 .. cuda:{gpus - 1}" if gpus else "")
        parser.error(f"--device {args.device}: not available here; accepted: {accepted}")
    counts = [("--k", args.k, 1), ("--batch-sizes", args.batch_sizes, 1), ("--prompt-len", [args.prompt_len], 1)]
    counts += [("--repeats", [args.repeats], 1), ("--iters", [args.iters], 1)]
    for flag, values, least in counts:
        bad = [v for v in values if v < least]
        if bad:
            parser.error(f"{flag} {' '.join(map(str, bad))}: takes ints >= {least}")
    if args.new_tokens < 2:
        parser.error(f"--new-tokens {args.new_tokens}: takes an int >= 2 (the first token comes from prefill)")
    layers = PRESETS[args.preset].num_hidden_layers
    for name in args.drafts:
        n = name[5:] if name.startswith("skip:") else ""
        if name not in ("oracle", "self") and not (n.isdigit() and 1 <= int(n) <= layers):
            parser.error(
                f"--drafts {name}: not a draft; accepted: oracle, self, skip:N (N in 1..{layers} for {args.preset})"
            )
    if device.type == "cpu" and args.backend in ("full", "breakable"):
        print(
            f"speculative.py: on the CPU, {args.backend} runs on emulated graphs (a replay reruns the recorded "
            "forward): the rows show the mechanism and its losslessness, not a speed",
            file=sys.stderr,
        )
    rows = run(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"argv": sys.argv[1:], "rows": rows}, f, indent=2)
    return 0 if all(r["lossless"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

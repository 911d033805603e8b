#!/usr/bin/env python3
"""One Hugging Face model through this library's runners against what HF users pick today.

The same transformers model (random weights of a checkpoint's shape:
:data:`SHAPES`, bf16) and the same prompts, through:

* ours: :class:`~cuda_graph_runner.reference.models.hf.HFCausalLM` (transformers' own modeling code,
  attention on the paged KV cache) with decode graphs of ``full``, compiled full
  (``full+torch_compile``) and ``breakable``;
* ``hf_eager``: transformers' ``generate()`` (DynamicCache, ``sdpa`` attention);
* ``hf_static_ro``: ``generate(cache_implementation="static")`` with
  ``model.forward = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)``
  (HF's documented recipe; its compile and graph-recording time is reported);
* ``hf_generate_batch``: transformers' continuous batching ``generate_batch()`` (paged
  cache), where the installed transformers runs it (its error is recorded otherwise).

Measures, decode ms per step:

* ``forward`` (batch 1): one decode step of the model alone, the same step repeated (ours:
  ``runner.forward(batch)`` of one decode batch; HF: one call of its forward on a
  ``StaticCache`` at a fixed position, eager or compiled);
* ``e2e`` (batch 1 and a batch of :data:`RAGGED` ragged prompts): a greedy loop (ours:
  forward, argmax, the tokens to the host, the next batch built; HF: ``generate()``, which
  syncs on its stop check every step), timed as ``(T(n + 1 new tokens) - T(1)) / n`` so
  prefill cancels out (``generate_batch``: its whole call over its new tokens, prefill
  included). At batch 32: ours attends each request's own length in the paged cache;
  HF's eager and static caches take the batch left-padded to its longest prompt (the
  static cache at one length for the whole batch); ``generate_batch`` schedules requests
  itself.

Writes one results document (:mod:`cuda_graph_runner.cli.results_schema`, tool
``benchmarks/hf_compare.py``): timings with method ``NAME/MEASURE``
(:func:`method_label`), runners with capture and compile seconds, the ratio of compiled
full to HF static + reduce-overhead (forward, batch 1), and ``extra.batch_semantics``.
``benchmarks/make_docs_extra.py`` renders it (a ``hf-compare`` results folder). An HF cell
that raises (the installed transformers' error) is a note, ``NAME/MEASURE batch N raised:
...``, and the other cells still run.

``--measures forward`` times the forward-only cells alone (our runners capture batch 1
only, HF's reduce-overhead compiles once instead of once per ``generate()`` shape,
``generate_batch`` is left out): the batch-1 target in less time; ``--e2e-batches ragged``
times the loops at the ragged batch only (HF's reduce-overhead compiles again for each
``generate()`` shape, about 2 minutes each for a 1B model on an H200; with ``--measures
e2e`` our runners capture the ragged batch alone). Inductor's and HF's compiles dominate a run: each
``hf_compare*.json`` in a folder is rendered on its own, so shapes and measures can be
split over several files.

GPU (H200), one file per attention backend of ours in one ``hf-compare`` folder::

    python benchmarks/hf_compare.py --out benchmarks/results/DATE-h200-hf-compare/hf_compare.json
    python benchmarks/hf_compare.py --attention triton \
        --out benchmarks/results/DATE-h200-hf-compare/hf_compare-triton.json

CPU smoke run (graphs emulated, nothing compiled; the numbers mean nothing)::

    python benchmarks/hf_compare.py --device cpu --shapes tiny --methods full,breakable,hf_eager,hf_static \\
        --new-tokens 3 --ragged 3 --iters 2 --out /tmp/hf_compare.json
"""

from __future__ import annotations

import argparse
import datetime
import inspect
import json
import os
import platform
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from cuda_graph_runner.backend.context import forward_context
from cuda_graph_runner.cli.bench.backends import label_options, parse_label
from cuda_graph_runner.cli.bench.measure import block_means_s, sync_fn
from cuda_graph_runner.cli.results_schema import document
from cuda_graph_runner.reference.batches import make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.models import hf
from cuda_graph_runner.runner import DecodeCudaGraphRunner
from cuda_graph_runner.testing.tolerances import kernel_tolerance, model_depth, model_tolerance

TOOL = "benchmarks/hf_compare.py"
#: ``--shapes`` names: (transformers architecture, :data:`cuda_graph_runner.reference.models.hf.SIZES` name).
SHAPES: Dict[str, Tuple[str, str]] = {
    "llama-3.2-1b": ("llama", "llama-3.2-1b"),
    "qwen2.5-0.5b": ("qwen2", "qwen2.5-0.5b"),
    "tiny": ("llama", "tiny"),
}
OURS = ("full", "full+torch_compile", "breakable")
HF_METHODS = ("hf_eager", "hf_static_ro", "hf_generate_batch")
#: ``--methods`` names (``hf_static``: HF's static cache without the compile, for CPU smoke runs).
METHODS = (*OURS, *HF_METHODS, "hf_static")
MEASURES = ("forward", "e2e")
RAGGED = 32
BATCH_SEMANTICS = {
    "full": "paged KV cache; each request attends its own length; the batch padded to the next captured size",
    "full+torch_compile": "as full, the forward compiled by inductor per captured size",
    "breakable": "as full, attention run eagerly between captured pieces",
    "hf_eager": "generate(): DynamicCache; the batch left-padded to its longest prompt, masked",
    "hf_static_ro": "generate(cache_implementation='static'), forward compiled with reduce-overhead: "
    "one static cache length for the whole batch (longest prompt + new tokens), left-padded",
    "hf_static": "as hf_static_ro, not compiled",
    "hf_generate_batch": "generate_batch(): HF's continuous batching (paged cache, its own scheduling); "
    "ms per step = the whole call (prefill included) over its new tokens",
}


_T0 = time.perf_counter()


def progress(message: str) -> None:
    """One progress line on stderr, flushed at once, with the seconds since the start: a
    run cut off by a timeout shows the step it was in."""
    print(f"hf_compare [{time.perf_counter() - _T0:7.1f} s] {message}", file=sys.stderr, flush=True)


def method_label(name: str, measure: str) -> str:
    """The timing record's method: ``NAME/MEASURE`` (``full+torch_compile/forward``)."""
    return f"{name}/{measure}"


def raised_note(name: str, measure: str, bs: int, exc: Exception) -> str:
    """The note of a cell that raised: ``NAME/MEASURE batch N raised: TYPE: message``
    (the message cut at 300 characters)."""
    return f"{method_label(name, measure)} batch {bs} raised: {type(exc).__name__}: {str(exc)[:300]}"


def parse_measures(spec: str) -> List[str]:
    """``--measures`` as a list; raises ValueError naming an unknown one and the accepted."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in MEASURES]
    if bad or not names:
        raise ValueError(f"--measures {spec!r}: unknown {bad or '(empty)'}; accepted: {', '.join(MEASURES)}")
    return names


def parse_e2e_batches(spec: str, ragged: int) -> List[int]:
    """``--e2e-batches``: ``1`` and/or ``ragged`` (comma-separated) as batch sizes, in order."""
    names = [n.strip() for n in spec.split(",") if n.strip()]
    bad = [n for n in names if n not in ("1", "ragged")]
    if bad or not names:
        raise ValueError(f"--e2e-batches {spec!r}: unknown {bad or '(empty)'}; accepted: 1, ragged")
    return list(dict.fromkeys(1 if n == "1" else ragged for n in names))


def capture_sizes(measures: Sequence[str], e2e_batches: Sequence[int]) -> List[int]:
    """The batch sizes our runners capture: the loops' batches (``e2e``) and batch 1 when
    the forward is measured, nothing else."""
    sizes = set(e2e_batches) if "e2e" in measures else set()
    return sorted(sizes | ({1} if "forward" in measures else set()))


def attention_problem(attention: Optional[str]) -> Optional[str]:
    """What is wrong with ``--attention`` (the value and the accepted backends), or None:
    None (the default, torch) or a name the adapter's attention registry builds."""
    from cuda_graph_runner.reference.model import DEFAULT_ATTENTION, attention_backend_names

    names = attention_backend_names()
    if attention is None or attention in names:
        return None
    return f"--attention {attention!r}: accepted {', '.join(names)} (default: {DEFAULT_ATTENTION})"


def parse_device(spec: str) -> torch.device:
    """``--device`` as a torch device; raises ValueError naming it and the accepted ones."""
    accepted = "accepted: cuda, cuda:N, cpu"
    try:
        device = torch.device(spec)
    except RuntimeError:  # torch's own message lists every device type it knows, not ours
        raise ValueError(f"--device {spec!r}: not a device; {accepted}") from None
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"--device {spec!r}: {accepted}")
    return device


def parse_methods(spec: str) -> List[str]:
    """``--methods`` as a list; raises ValueError naming an unknown one and the accepted."""
    names = [m.strip() for m in spec.split(",") if m.strip()]
    bad = [m for m in names if m not in METHODS]
    if bad or not names:
        raise ValueError(f"--methods {spec!r}: unknown {bad or '(empty)'}; accepted: {', '.join(METHODS)}")
    return names


# -- models -----------------------------------------------------------------------------------


def hf_twin(adapter: hf.HFCausalLM) -> Any:
    """An independent transformers model with ``adapter``'s weights on ``sdpa`` attention
    (what an HF user runs), generating to its length (no end-of-sequence stop)."""
    model = hf.eager_reference(adapter, "sdpa")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _backend(label: str, emulated: Any) -> Dict[str, Any]:
    """``{"options": decode config keys}`` of ``label`` (as ``cuda-graph-runner bench``
    reads it), or on the CPU ``{"backend": ...}`` with breakable's emulated graphs."""
    name, compiler = parse_label(label)
    if emulated is not None:
        from cuda_graph_runner_breakable.backend import BreakableCudaGraphBackend
        from cuda_graph_runner_full.backend import FullCudaGraphBackend

        cls = {"full": FullCudaGraphBackend, "breakable": BreakableCudaGraphBackend}[name]
        return {"backend": cls("cpu", phase="decode", device_module=emulated, memory_pool="pool-0")}
    return {"options": {"backend": name, **label_options(compiler, None, None)}}


def our_runner(adapter: hf.HFCausalLM, label: str, sizes: Sequence[int], device: torch.device) -> Any:
    """A captured decode runner of ``label`` (``full``, ``full+torch_compile``, ``breakable``)."""
    emulated = None
    if device.type == "cpu":
        from cuda_graph_runner_breakable.emulation import EmulatedGraphDeviceModule

        emulated = EmulatedGraphDeviceModule()
    spec = _backend(label, emulated)
    config = {"decode": {**spec.get("options", {}), "bs": sorted(sizes)}}
    runner = DecodeCudaGraphRunner(
        adapter, config, device=str(device), backend=spec.get("backend"), show_progress=False
    )
    t0 = time.perf_counter()
    with torch.no_grad():
        runner.capture()
    runner.capture_wall_s = time.perf_counter() - t0
    return runner


# -- timing -----------------------------------------------------------------------------------


def timed(fn: Callable[[], Any], *, iters: int, repeats: int, sync: Callable[[], None]) -> Dict[str, Any]:
    """A timing cell of ``fn`` (ms per call): median, min, max and the block means."""
    samples = [s * 1000.0 for s in block_means_s(fn, iters=iters, warmup=2, sync=sync, repeats=repeats)]
    return {"median_ms": statistics.median(samples), "min_ms": min(samples), "max_ms": max(samples),
            "samples_ms": samples}  # fmt: skip


def wall_s(fn: Callable[[], Any], sync: Callable[[], None]) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def per_step(run: Callable[[int], Any], steps: int, repeats: int, sync: Callable[[], None]) -> Dict[str, Any]:
    """``(T(steps + 1) - T(1)) / steps`` in ms, per repeat: a loop's time per decode step
    with its prefill and first token cancelled out."""
    samples = []
    for _ in range(repeats):
        one = wall_s(lambda: run(1), sync)
        many = wall_s(lambda: run(steps + 1), sync)
        samples.append((many - one) / steps * 1000.0)
    cell: Dict[str, Any] = {"median_ms": statistics.median(samples), "min_ms": min(samples),
                            "max_ms": max(samples), "samples_ms": samples}  # fmt: skip
    below = sum(1 for s in samples if s <= 0.0)
    if below:  # a difference at or under zero is timing noise, never a step time
        cell["unmeasured"] = f"T({steps + 1}) <= T(1) in {below} of {repeats} repeats (noise; raise --new-tokens)"
    return cell


# -- ours -------------------------------------------------------------------------------------


def _prefill(adapter: hf.HFCausalLM, prompts: List[List[int]]) -> Tuple[List[int], List[int]]:
    """Eager prefill of ``prompts``; returns (rows, first tokens)."""
    cache = adapter.kv_cache
    assert cache is not None
    batch = make_extend_batch(cache, prompts)
    if adapter.init_forward_metadata is not None:
        adapter.init_forward_metadata(batch)
    with torch.no_grad(), forward_context(batch):
        logits = adapter.compute_logits(adapter(batch), batch)
    return batch.req_pool_indices.tolist(), logits.argmax(-1).tolist()


def ours_forward(
    adapter: hf.HFCausalLM, runner: Any, prompt: List[int], args: Any, sync: Any, reference: Any
) -> Dict[str, Any]:
    """Forward-only decode at batch 1, and its logits against transformers' own forward
    (``reference``) of the same tokens: ``max_abs_diff`` and ``within_tolerance``, so a fast
    wrong forward shows in the results. Two different kernels (our paged attention against
    ``sdpa``): in bf16 :func:`~cuda_graph_runner.testing.tolerances.kernel_tolerance`
    (scaled by the logits' largest magnitude), in float32
    :func:`~cuda_graph_runner.testing.tolerances.model_tolerance`."""
    rows, first = _prefill(adapter, [prompt])
    batch = make_decode_batch(adapter.kv_cache, rows, None, first)
    try:
        with torch.no_grad():
            cell = timed(lambda: runner.forward(batch), iters=args.steps, repeats=args.repeats, sync=sync)
            got = runner.forward(batch)[0].float()
            ids = torch.tensor([[*prompt, first[0]]], device=adapter.device)
            want = reference(input_ids=ids).logits[0, -1].float()
    finally:
        for r in rows:
            adapter.kv_cache.free_request(r)
    if adapter.dtype in (torch.bfloat16, torch.float16):  # the logits come in float32 either way
        tol = kernel_tolerance(want, dtype=adapter.dtype, depth=model_depth(adapter.config))
    else:
        tol = model_tolerance(adapter.config, adapter.dtype, context_len=len(prompt) + 1)
    cell["max_abs_diff"] = float((got - want).abs().max())
    cell["within_tolerance"] = bool(torch.allclose(got, want, atol=tol["atol"], rtol=tol["rtol"]))
    return cell


def ours_e2e(adapter: hf.HFCausalLM, runner: Any, prompts: List[List[int]], args: Any, sync: Any) -> Dict[str, Any]:
    cache = adapter.kv_cache

    def run(new_tokens: int) -> None:
        rows, tokens = _prefill(adapter, prompts)
        with torch.no_grad():
            for _ in range(new_tokens - 1):
                logits = runner.forward(make_decode_batch(cache, rows, None, tokens))
                tokens = logits[: len(rows)].argmax(-1).tolist()  # the host sync a serving loop has
        for r in rows:
            cache.free_request(r)

    run(2)  # warm
    return per_step(run, args.new_tokens, args.repeats, sync)


# -- HF ---------------------------------------------------------------------------------------


def _padded(prompts: List[List[int]], device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and attention mask ``[bs, longest]`` (HF's batched generate)."""
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros(len(prompts), longest, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    return ids.to(device), mask.to(device)


def hf_generate_fn(model: Any, prompts: List[List[int]], static: bool) -> Callable[[int], Any]:
    ids, mask = _padded(prompts, model.device)
    extra: Dict[str, Any] = {"cache_implementation": "static", "disable_compile": True} if static else {}

    def run(new_tokens: int) -> Any:
        with torch.no_grad():
            return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, **extra)  # fmt: skip

    return run


def hf_forward_fn(model: Any, forward: Callable[..., Any], prompt: List[int], margin: int) -> Callable[[], Any]:
    """One decode step of ``forward`` (HF's forward, eager or compiled) on a
    ``StaticCache`` holding ``prompt``, fed the same token and position every call.

    transformers' static cache layer appends at its own running length (it ignores
    ``cache_position``), so every call takes the next slot: ``margin`` is the number of
    calls the cache holds, and one more raises ``RuntimeError`` (not an out-of-bounds
    device assert)."""
    from transformers import StaticCache

    device = model.device
    n = len(prompt)
    cache = StaticCache(config=model.config, max_cache_len=n + margin)
    # transformers after 5.17 names the forward's cache argument ``cache``; 5.17 (the GPU
    # machine's) only ``past_key_values``.
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    with torch.no_grad():  # the prefill through the class's forward: never the compiled one
        type(model).forward(model, input_ids=torch.tensor([prompt], device=device),
                            cache_position=torch.arange(n, device=device), use_cache=True, **{key: cache})  # fmt: skip
    tok = torch.tensor([[prompt[-1]]], device=device)
    cpos = torch.tensor([n], device=device)
    pos = cpos[None]
    mark = getattr(torch.compiler, "cudagraph_mark_step_begin", None)
    calls = [0]

    def step() -> Any:
        calls[0] += 1
        if calls[0] > margin:
            raise RuntimeError(f"hf_forward_fn: call {calls[0]} past the static cache's {margin} decode slots")
        if mark is not None and device.type == "cuda":
            mark()
        with torch.no_grad():
            return forward(input_ids=tok, position_ids=pos, cache_position=cpos, use_cache=True,
                           **{key: cache}).logits  # fmt: skip

    return step


def compile_ro(model: Any) -> Tuple[Callable[..., Any], Callable[..., Any]]:
    """(the original forward, HF's recipe: ``model.forward`` compiled with reduce-overhead)."""
    original = model.forward
    model.forward = torch.compile(original, mode="reduce-overhead", fullgraph=True)
    return original, model.forward


def hf_generate_batch(model: Any, prompts: List[List[int]], new_tokens: int, sync: Any) -> Dict[str, Any]:
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip

    def run() -> Any:
        with torch.no_grad():
            return model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)

    first = wall_s(run, sync)  # warm-up (its graphs, its cache)
    t = wall_s(run, sync)
    ms = t / new_tokens * 1000.0
    return {"median_ms": ms, "min_ms": ms, "max_ms": ms, "samples_ms": [ms], "first_call_s": first}


# -- one shape --------------------------------------------------------------------------------


def run_shape(
    shape: str, args: Any, device: torch.device, flush: Callable[[Dict[str, Any]], None] = lambda got: None
) -> Dict[str, Any]:
    """Every cell of one shape; ``flush(got)`` after each recorded cell, runner and note,
    with what the shape has so far (so a run cut short by its time limit keeps its finished
    cells). An HF cell that raises becomes a note and the shape's other cells still run."""
    arch, size = SHAPES[shape]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sync = sync_fn(device)
    std = 0.15 if size == "tiny" else None
    progress(f"{shape}: building {arch} ({size}, {dtype}) on {device}")
    adapter = hf.HFCausalLM.from_config(
        hf.builtin_config(arch, size=size), dtype=dtype, device=device, seed=0, std=std, attention=args.attention
    )
    vocab = adapter.config.vocab_size
    prompt = make_dummy_prompts(1, args.prompt_len, vocab, seed=1)[0]
    lens = [args.prompt_len // 2 + (37 * i) % args.prompt_len for i in range(args.ragged)]
    ragged = make_dummy_prompts(args.ragged, lens, vocab, seed=2)
    context = max(args.prompt_len, *lens) + args.new_tokens + args.steps + 8
    adapter.create_kv_cache(
        num_slots=(args.ragged + 2) * context + 1, max_reqs=args.ragged + 2, max_context_len=context
    )
    timings: List[Dict[str, Any]] = []
    runners: List[Dict[str, Any]] = []
    notes: List[str] = []
    got = {"timings": timings, "runners": runners, "notes": notes, "ragged_lens": lens}

    def record(name: str, measure: str, bs: int, cell: Optional[Dict[str, Any]]) -> None:
        if cell is not None and "unmeasured" in cell:
            notes.append(f"{shape} {method_label(name, measure)} batch {bs} not recorded: {cell['unmeasured']}")
            progress(notes[-1])
            return
        if cell is not None:
            progress(f"{shape}: {method_label(name, measure)} batch {bs}: {cell['median_ms']:.3f} ms")
            kept = ("median_ms", "min_ms", "max_ms", "samples_ms", "max_abs_diff", "within_tolerance")
            cell = {k: v for k, v in cell.items() if k in kept}
            timings.append({"model": shape, "phase": "decode", "method": method_label(name, measure),
                            "batch_size": bs, **cell})  # fmt: skip
            flush(got)

    reference = hf_twin(adapter) if any(m in OURS for m in args.methods) else None
    for label in [m for m in args.methods if m in OURS]:
        sizes = capture_sizes(args.measures, args.e2e_batches)
        progress(f"{shape}: {label}: capturing batch sizes {sizes}")
        runner = our_runner(adapter, label, sizes, device)
        progress(f"{shape}: {label}: captured in {runner.capture_wall_s:.1f} s")
        # capture_s: the whole capture() (compiled full: its inductor compile included).
        runners.append({"model": shape, "phase": "decode", "backend": label, "num_sizes": len(sizes),
                        "sizes": sizes, "capture_s": round(runner.capture_wall_s, 3)})  # fmt: skip
        flush(got)
        if "forward" in args.measures:
            record(label, "forward", 1, ours_forward(adapter, runner, prompt, args, sync, reference))
        if "e2e" in args.measures:
            for bs in args.e2e_batches:
                record(label, "e2e", bs, ours_e2e(adapter, runner, [prompt] if bs == 1 else ragged, args, sync))
        runner.cleanup()
        del runner
    del reference
    wanted = [m for m in args.methods if m in ("hf_eager", "hf_static", "hf_static_ro")]
    if wanted:
        progress(f"{shape}: building the transformers twin (sdpa) for {', '.join(wanted)}")
        model = hf_twin(adapter)
        # Every forward call takes a cache slot (see hf_forward_fn): the first 3, then
        # each block's warm-up and timed calls.
        margin = 3 + args.repeats * (args.steps + 2) + 8

        def eager_cell(measure: str, bs: int) -> None:
            if measure == "forward":
                step = hf_forward_fn(model, model.forward, prompt, margin)
                record("hf_eager", "forward", 1, timed(step, iters=args.steps, repeats=args.repeats, sync=sync))
            else:
                gen = hf_generate_fn(model, [prompt] if bs == 1 else ragged, False)
                record("hf_eager", "e2e", bs, per_step(gen, args.new_tokens, args.repeats, sync))

        if "hf_eager" in wanted:
            eager_cells = [("forward", 1)] if "forward" in args.measures else []
            eager_cells += [("e2e", bs) for bs in args.e2e_batches] if "e2e" in args.measures else []
            for measure, bs in eager_cells:
                try:
                    eager_cell(measure, bs)
                except Exception as exc:  # a result, not the end of the run
                    notes.append(f"{shape} {raised_note('hf_eager', measure, bs, exc)}")
                    progress(notes[-1])
                    flush(got)
        for name in [m for m in wanted if m != "hf_eager"]:
            compiled = name == "hf_static_ro"
            if compiled:
                original, forward = compile_ro(model)
            else:
                original = forward = model.forward
            # The runner row and its note go in before the timed cells (kept by a run cut
            # short) and grow with each first call.
            row: Dict[str, Any] = {"model": shape, "phase": "decode", "backend": name, "num_sizes": 1, "sizes": [1]}
            firsts: List[str] = []
            runners.append(row)
            notes.append(f"{shape} {name}")
            at = len(notes) - 1

            def noted(text: str) -> None:
                firsts.append(text)
                notes[at] = f"{shape} {name}: {'; '.join(firsts)}"
                flush(got)

            def forward_cell() -> None:
                what = "compile + graph recording" if compiled else "eager, nothing compiled"
                progress(f"{shape}: {name}: first 3 forward calls ({what})")
                step = hf_forward_fn(model, forward, prompt, margin)
                first = wall_s(lambda: [step() for _ in range(3)], sync)
                row["compile_s"] = round(first, 3)
                noted(f"first 3 forward calls ({what}) {first:.2f} s")
                record(name, "forward", 1, timed(step, iters=args.steps, repeats=args.repeats, sync=sync))

            def e2e_cell(bs: int) -> None:
                gen = hf_generate_fn(model, [prompt] if bs == 1 else ragged, True)
                progress(f"{shape}: {name}: first generate() at batch {bs}")
                first = wall_s(lambda: gen(args.new_tokens + 1), sync)
                again = " (each new shape compiles again)" if compiled else ""
                noted(f"first generate() at batch {bs} {first:.2f} s{again}")
                record(name, "e2e", bs, per_step(gen, args.new_tokens, args.repeats, sync))

            cells = [("forward", 1, forward_cell)] if "forward" in args.measures else []
            if "e2e" in args.measures:
                cells += [("e2e", bs, lambda bs=bs: e2e_cell(bs)) for bs in args.e2e_batches]
            try:
                for measure, bs, cell in cells:
                    try:
                        cell()
                    except Exception as exc:  # what the installed transformers does not run is a result
                        noted(raised_note(name, measure, bs, exc))
                        progress(notes[at])
            finally:
                model.forward = original
        del model
    if "hf_generate_batch" in args.methods and "e2e" in args.measures and args.ragged in args.e2e_batches:
        progress(f"{shape}: hf_generate_batch: two calls of generate_batch() at batch {args.ragged}")
        model = hf_twin(adapter)
        try:
            cell = hf_generate_batch(model, ragged, args.new_tokens, sync)
            notes.append(f"{shape} hf_generate_batch: first call {cell['first_call_s']:.2f} s")
            record("hf_generate_batch", "e2e", args.ragged, cell)
        except Exception as exc:  # what the installed transformers does not run is a result, not a crash
            notes.append(f"{shape} hf_generate_batch did not run: {type(exc).__name__}: {str(exc)[:300]}")
        del model
    del adapter
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return got


def ratios(timings: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Compiled full over HF static + reduce-overhead (forward, batch 1), per shape: the
    issue's target (at most 1)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_summary import ratio_stats

    out = []
    cells = {(t["model"], t["method"], t["batch_size"]): t for t in timings}
    for model in sorted({t["model"] for t in timings}):
        for ours in OURS:
            num = cells.get((model, method_label(ours, "forward"), 1))
            den = cells.get((model, method_label("hf_static_ro", "forward"), 1))
            r = ratio_stats(num, den) if num and den else None
            if r:
                out.append({"model": model, "phase": "decode", "method": method_label(ours, "forward"),
                            "reference": method_label("hf_static_ro", "forward"), "batch_size": 1, **r})  # fmt: skip
    return out


def environment(device: torch.device) -> Dict[str, Any]:
    import transformers

    env: Dict[str, Any] = {"device": str(device), "torch": torch.__version__, "transformers": transformers.__version__,
                           "python": platform.python_version(),
                           "date": datetime.date.today().isoformat()}  # fmt: skip
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
    return env


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="llama-3.2-1b,qwen2.5-0.5b", help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--methods", default=",".join((*OURS, *HF_METHODS)), help=f"of {', '.join(METHODS)}")
    parser.add_argument(
        "--measures", default=",".join(MEASURES), help=f"of {', '.join(MEASURES)} (forward: batch 1 only)"
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--attention", default=None, help="our adapter's attention backend (default: torch)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--ragged", type=int, default=RAGGED, help="the ragged batch's size")
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps of the end-to-end loops")
    parser.add_argument(
        "--e2e-batches",
        default="1,ragged",
        help="the end-to-end loops' batches: 1 and/or ragged (the --ragged batch); default both",
    )
    parser.add_argument("--steps", type=int, default=None, help="forward calls per timed block (default 100)")
    parser.add_argument("--repeats", type=int, default=None, help="timed blocks per cell (default 5)")
    parser.add_argument(
        "--iters", type=int, default=None, help="shorthand: --steps and --repeats at once (not with either)"
    )
    parser.add_argument("--out", default=None, help="the results JSON (default: print it)")
    args = parser.parse_args(argv)
    try:
        args.methods = parse_methods(args.methods)
        args.measures = parse_measures(args.measures)
        shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
        bad = [s for s in shapes if s not in SHAPES]
        if bad or not shapes:
            raise ValueError(f"--shapes {args.shapes!r}: unknown {bad or '(empty)'}; accepted: {', '.join(SHAPES)}")
        args.e2e_batches = parse_e2e_batches(args.e2e_batches, args.ragged)
        if args.iters is not None:
            given = [f"--{k} {getattr(args, k)}" for k in ("steps", "repeats") if getattr(args, k) is not None]
            if given:
                raise ValueError(f"--iters {args.iters} sets --steps and --repeats; not with {' and '.join(given)}")
            args.steps = args.repeats = args.iters
        args.steps = 100 if args.steps is None else args.steps
        args.repeats = 5 if args.repeats is None else args.repeats
        if args.ragged < 2:  # one prompt would be batch 1 again
            raise ValueError(f"--ragged {args.ragged}: the ragged batch needs at least 2 prompts")
        for key in ("prompt_len", "new_tokens", "iters", "steps", "repeats"):
            if getattr(args, key) is not None and getattr(args, key) < 1:
                raise ValueError(f"--{key.replace('_', '-')} {getattr(args, key)}: must be >= 1")
        problem = attention_problem(args.attention)
        if problem:
            raise ValueError(problem)
        device = parse_device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device here (use --device cpu for a smoke run)")
        if device.type == "cpu" and {"full+torch_compile", "hf_static_ro", "hf_generate_batch"} & set(args.methods):
            raise ValueError(
                "--device cpu: full+torch_compile, hf_static_ro and hf_generate_batch are GPU measurements; "
                "on the CPU take full, breakable, hf_eager, hf_static"
            )
    except ValueError as exc:
        print(f"hf_compare: {exc}", file=sys.stderr)
        return 2
    env = environment(device)
    progress(f"torch {env['torch']}, transformers {env['transformers']}, device {env.get('device_name', device)}; "
             f"shapes {','.join(shapes)}, methods {','.join(args.methods)}, "
             f"measures {','.join(args.measures)}")  # fmt: skip
    settings = {k: getattr(args, k) for k in ("prompt_len", "ragged", "new_tokens", "steps", "repeats", "attention")}
    settings.update(
        shapes=shapes,
        methods=args.methods,
        measures=args.measures,
        e2e_batches=args.e2e_batches,
        dtype="bfloat16" if device.type == "cuda" else "float32",
    )
    done: List[Dict[str, Any]] = []

    def write(current: Optional[Dict[str, Any]] = None, final: bool = False) -> None:
        # Rewritten after every cell: a run stopped by its time limit keeps what it measured.
        if not args.out and not final:
            return
        parts = done + ([current] if current else [])
        timings = [t for g in parts for t in g["timings"]]
        doc = document(TOOL, env, timings=timings, ratios=ratios(timings),
                       runners=[r for g in parts for r in g["runners"]],
                       notes=[n for g in parts for n in g["notes"]], settings=settings,
                       extra={"batch_semantics": {m: BATCH_SEMANTICS[m] for m in args.methods},
                              "ragged_prompt_lens": {s: g["ragged_lens"] for s, g in zip(shapes, parts)}})  # fmt: skip
        text = json.dumps(doc, indent=1)
        if not args.out:
            print(text)
            return
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".tmp", "w") as f:
            f.write(text + "\n")
        os.replace(args.out + ".tmp", args.out)

    for shape in shapes:
        done.append(run_shape(shape, args, device, write))
        write()
        progress(f"{shape} done")
    write(final=True)
    if args.out:
        progress(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

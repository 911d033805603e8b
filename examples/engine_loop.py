"""A small continuous-batching engine on the reference workload, in an engine's shape.

What an inference engine does around this library:

* a request queue: requests wait until a request row of the KV cache and room for their
  tokens (prompt plus ``max_new_tokens``) are free, then run until they stop;
* chunked prefill through a :class:`~cuda_graph_runner.PrefillCudaGraphRunner`: each step
  gives every running request with prompt left a chunk of at most ``chunk_size`` tokens,
  within a token budget per step; a request whose prompt ends in the chunk samples its
  first token from that chunk's logits;
* decode through a :class:`~cuda_graph_runner.DecodeCudaGraphRunner`: one batch per step
  of every request that has a token to feed (the runner replays the smallest captured
  batch size that covers it, or runs eagerly);
* sampling: greedy (``temperature`` 0) or temperature sampling from the request's own
  seeded ``torch.Generator`` (so a request's tokens do not depend on its batch mates);
* stop conditions: ``max_new_tokens`` (finish reason ``"length"``) and stop token ids
  (``"stop"``); a finished request frees its row and slots at once;
* outputs: the runners' outputs are zero-copy (valid until the next replay); the engine
  consumes them (argmax, sampling, log-probs) before the next forward, and where it keeps
  them (``keep_logits``) it builds the runners with ``owned_outputs`` so that what it
  keeps is its own;
* run statistics at the end: steps, batches, tokens, tokens per second, and each runner's
  replays, eager fallbacks and padding waste (``runner.run_stats()``).

Run it (CPU: the ``tiny`` preset in float32 with the CPU's default backends; CUDA: the
llama-3.2-1b shape in bfloat16 with ``full`` decode and ``breakable`` prefill)::

    python examples/engine_loop.py --requests 12 --temperature 0.8 --compare-eager
    python examples/engine_loop.py --padded-eager --compare-eager   # bitwise in bf16 too

``--compare-eager`` runs the same schedule again with backend ``disabled`` in both phases
and reports whether every token agrees. In float32 they do; in bf16 padding changes the
GEMM shapes, so a few tokens may differ, unless ``--padded-eager`` (the phase key
``padded_eager``) runs the eager forwards at the padded sizes too.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
from typing import Any, Deque, Dict, List, Optional, Sequence, Tuple

import torch

from cuda_graph_runner import CudaGraphConfig, DecodeCudaGraphRunner, PrefillCudaGraphRunner
from cuda_graph_runner.reference.batches import make_decode_batch, make_dummy_prompts, make_extend_batch
from cuda_graph_runner.reference.kv_cache import PagedKVCache
from cuda_graph_runner.reference.model import ReferenceLlamaForCausalLM
from cuda_graph_runner.runner.stats import format_summary

FINISH_LENGTH = "length"
FINISH_STOP = "stop"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request samples and when it stops.

    Attributes:
        max_new_tokens: tokens to generate at most (>= 1).
        temperature: 0 for greedy (argmax); > 0 samples from ``softmax(logits / temperature)``.
        seed: the seed of the request's own generator (temperature > 0); None: 0.
        stop_token_ids: a generated token among these ends the request (it is kept).
    """

    max_new_tokens: int = 16
    temperature: float = 0.0
    seed: Optional[int] = None
    stop_token_ids: Tuple[int, ...] = ()


@dataclasses.dataclass
class Request:
    """One request and its state in the engine.

    Attributes:
        output: generated token ids.
        logprobs: the log-probability of each generated token (host floats).
        logits: with ``keep_logits``, each generated token's float32 logits ``[vocab]``
            (owned: the runners were built with ``owned_outputs``).
        finish_reason: None while running, then ``"length"`` or ``"stop"``.
    """

    rid: int
    prompt: List[int]
    params: SamplingParams
    output: List[int] = dataclasses.field(default_factory=list)
    logprobs: List[float] = dataclasses.field(default_factory=list)
    logits: List[torch.Tensor] = dataclasses.field(default_factory=list)
    finish_reason: Optional[str] = None
    row: Optional[int] = None
    prefilled: int = 0
    generator: Optional[torch.Generator] = None


@dataclasses.dataclass
class EngineStats:
    """What a run did (``seconds``: wall time of :meth:`Engine.run`)."""

    steps: int = 0
    prefill_batches: int = 0
    decode_batches: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    seconds: float = 0.0
    finished: Dict[str, int] = dataclasses.field(default_factory=dict)
    prefill_runner: Dict[str, Any] = dataclasses.field(default_factory=dict)
    decode_runner: Dict[str, Any] = dataclasses.field(default_factory=dict)

    def lines(self) -> List[str]:
        rate = self.generated_tokens / self.seconds if self.seconds else 0.0
        return [
            f"{self.steps} steps: {self.prefill_batches} prefill batches ({self.prompt_tokens} prompt tokens), "
            f"{self.decode_batches} decode batches; {self.generated_tokens} tokens generated in "
            f"{self.seconds:.2f} s ({rate:.1f} tokens/s); finished: {self.finished}",
            format_summary("prefill runner", self.prefill_runner),
            format_summary("decode runner", self.decode_runner),
        ]


def build_runners(
    model: Any,
    *,
    max_running: int,
    prefill_token_budget: int,
    decode_backend: Any = None,
    prefill_backend: Any = None,
    padded_eager: bool = False,
    owned_outputs: bool = False,
) -> Tuple[DecodeCudaGraphRunner, PrefillCudaGraphRunner]:
    """Both runners for ``model``, captured: decode batch sizes up to ``max_running``,
    prefill token counts up to ``prefill_token_budget``. A backend is a name, an instance
    or None (the device's default)."""
    phase = {"padded_eager": padded_eager, "owned_outputs": owned_outputs}
    config = CudaGraphConfig.from_dict(
        {"decode": {"max_bs": max_running, **phase}, "prefill": {"max_bs": prefill_token_budget, **phase}}
    )
    decode = DecodeCudaGraphRunner(model, config, backend=decode_backend, show_progress=False)
    prefill = PrefillCudaGraphRunner(model, config, backend=prefill_backend, show_progress=False)
    decode.capture()
    prefill.capture()
    return decode, prefill


class Engine:
    """Continuous batching over one model, one KV cache and its two runners.

    Args:
        model: the reference model (or any model with the runners' protocol).
        cache: the model's :class:`PagedKVCache` (``model.kv_cache``).
        decode_runner, prefill_runner: built on ``model`` (:func:`build_runners`).
        max_running: requests running at once (at most the decode runner's largest size
            keeps every decode step on a graph).
        chunk_size: prompt tokens per request per step.
        prefill_token_budget: prompt tokens per step over all requests.
        keep_logits: keep each generated token's logits (needs owned outputs).

    Raises:
        ValueError: a size below 1, or ``keep_logits`` with runners that return zero-copy
            outputs.
    """

    def __init__(
        self,
        model: Any,
        cache: PagedKVCache,
        decode_runner: DecodeCudaGraphRunner,
        prefill_runner: PrefillCudaGraphRunner,
        *,
        max_running: int = 8,
        chunk_size: int = 16,
        prefill_token_budget: int = 32,
        keep_logits: bool = False,
    ) -> None:
        for name, value in (("max_running", max_running), ("chunk_size", chunk_size)):
            if value < 1:
                raise ValueError(f"{name}={value}: must be >= 1")
        if prefill_token_budget < 1:
            raise ValueError(f"prefill_token_budget={prefill_token_budget}: must be >= 1")
        if keep_logits and not (decode_runner.owned_outputs and prefill_runner.owned_outputs):
            raise ValueError("keep_logits needs runners built with owned_outputs=True (kept outputs must be owned)")
        self.model, self.cache = model, cache
        self.decode_runner, self.prefill_runner = decode_runner, prefill_runner
        self.max_running, self.chunk_size, self.budget = max_running, chunk_size, prefill_token_budget
        self.keep_logits = keep_logits
        self.waiting: Deque[Request] = collections.deque()
        self.running: List[Request] = []
        self.finished: List[Request] = []
        self.stats = EngineStats()
        self._reserved = 0  # KV slots promised to running requests (prompt + max_new_tokens - 1)
        self._next_id = 0

    # -- the queue ---------------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], params: Optional[SamplingParams] = None) -> Request:
        """Queue a request.

        Raises:
            ValueError: an empty prompt, a token outside the vocabulary, ``max_new_tokens``
                below 1, a negative temperature, or more tokens than the cache's context.
        """
        params = params or SamplingParams()
        vocab = self.model.config.vocab_size
        if not prompt or any(not 0 <= int(t) < vocab for t in prompt):
            raise ValueError(f"prompt must be a non-empty list of token ids in [0, {vocab})")
        if params.max_new_tokens < 1 or params.temperature < 0:
            raise ValueError(f"{params}: max_new_tokens must be >= 1 and temperature >= 0")
        if len(prompt) + params.max_new_tokens > self.cache.max_context_len:
            raise ValueError(
                f"prompt of {len(prompt)} + {params.max_new_tokens} new tokens exceeds the cache's context "
                f"{self.cache.max_context_len}"
            )
        if len(prompt) + params.max_new_tokens - 1 > self.cache.num_slots - 1:  # slot 0 is the dummies'
            raise ValueError(f"the request needs more KV slots than the cache has ({self.cache.num_slots - 1})")
        request = Request(self._next_id, [int(t) for t in prompt], params)
        self._next_id += 1
        self.waiting.append(request)
        return request

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_running and self.cache.num_free_requests:
            request = self.waiting[0]
            need = len(request.prompt) + request.params.max_new_tokens - 1  # the last token is never fed
            if self._reserved + need > self.cache.num_free_slots + self._used_slots():
                return  # first come, first served: wait for slots
            self.waiting.popleft()
            self._reserved += need
            request.row = self.cache.alloc_request()
            if request.params.temperature > 0:
                request.generator = torch.Generator(device=self.cache.device)
                request.generator.manual_seed(request.params.seed or 0)
            self.running.append(request)

    def _used_slots(self) -> int:
        return sum(self.cache.request_len(r.row) for r in self.running if r.row is not None)

    # -- one step ----------------------------------------------------------------------
    def step(self) -> bool:
        """Admit, run one prefill batch (chunks) and one decode batch; False when idle."""
        self._admit()
        if not self.running:
            return False
        self.stats.steps += 1
        prefilled = self._prefill()
        self._decode(skip=prefilled)
        self._retire()
        return True

    def _prefill(self) -> set:
        chunks: List[Tuple[Request, List[int]]] = []
        budget = self.budget
        for request in self.running:
            left = len(request.prompt) - request.prefilled
            if left <= 0 or budget <= 0:
                continue
            n = min(left, self.chunk_size, budget)
            chunks.append((request, request.prompt[request.prefilled : request.prefilled + n]))
            budget -= n
        if not chunks:
            return set()
        batch = make_extend_batch(self.cache, [c for _, c in chunks], rows=[r.row for r, _ in chunks])
        logits = self.prefill_runner.forward(batch)  # [requests, vocab]: each chunk's last token
        self.stats.prefill_batches += 1
        self.stats.prompt_tokens += batch.num_tokens
        done = []
        for i, (request, chunk) in enumerate(chunks):
            request.prefilled += len(chunk)
            if request.prefilled == len(request.prompt):
                done.append((i, request))
        if done:
            self._sample(logits, done)
        return {r.rid for _, r in done}

    def _decode(self, skip: set) -> None:
        live = [r for r in self.running if r.output and r.finish_reason is None and r.rid not in skip]
        if not live:
            return
        batch = make_decode_batch(self.cache, [r.row for r in live], None, [r.output[-1] for r in live])
        logits = self.decode_runner.forward(batch)  # [requests, vocab], zero-copy unless owned
        self.stats.decode_batches += 1
        self._sample(logits, list(enumerate(live)))

    def _sample(self, logits: torch.Tensor, picks: List[Tuple[int, Request]]) -> None:
        """One token per ``(row of logits, request)``, consumed before the next forward."""
        rows = logits[[i for i, _ in picks]]  # a gather: a fresh tensor
        logprobs = torch.log_softmax(rows, dim=-1)
        tokens = rows.argmax(dim=-1)
        for j, (_, request) in enumerate(picks):
            temperature = request.params.temperature
            if temperature > 0:
                probs = torch.softmax(rows[j] / temperature, dim=-1)
                tokens[j] = torch.multinomial(probs, 1, generator=request.generator)[0]
        for j, ((i, request), token) in enumerate(zip(picks, tokens.tolist())):
            request.output.append(token)
            request.logprobs.append(float(logprobs[j, token]))
            if self.keep_logits:
                request.logits.append(logits[i])  # owned: the runners were built with owned_outputs
            self.stats.generated_tokens += 1
            if token in request.params.stop_token_ids:
                request.finish_reason = FINISH_STOP
            elif len(request.output) >= request.params.max_new_tokens:
                request.finish_reason = FINISH_LENGTH

    def _retire(self) -> None:
        for request in [r for r in self.running if r.finish_reason is not None]:
            self.running.remove(request)
            self.cache.free_request(request.row)
            self._reserved -= len(request.prompt) + request.params.max_new_tokens - 1
            request.row = None
            self.finished.append(request)
            reason = request.finish_reason or ""
            self.stats.finished[reason] = self.stats.finished.get(reason, 0) + 1

    def run(self) -> EngineStats:
        """Step until every queued request has finished; the run's statistics."""
        start = time.perf_counter()
        with torch.no_grad():
            while self.step():
                pass
        if self.waiting:  # admission never refuses a request the cache can hold, so this is a bug
            raise RuntimeError(f"{len(self.waiting)} requests never admitted")
        device = self.cache.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self.stats.seconds = time.perf_counter() - start
        self.stats.prefill_runner = self.prefill_runner.run_stats()
        self.stats.decode_runner = self.decode_runner.run_stats()
        return self.stats


def workload(
    num_requests: int,
    vocab: int,
    *,
    temperature: float,
    seed: int,
    prompt_lens: Tuple[int, int] = (5, 40),
    new_tokens: Tuple[int, int] = (4, 19),
) -> List[Tuple[List[int], SamplingParams]]:
    """A reproducible mix: prompt lengths and new tokens spread over the inclusive ranges
    ``prompt_lens`` and ``new_tokens``, every third request greedy, the rest at
    ``temperature`` with its own seed."""
    span = prompt_lens[1] - prompt_lens[0] + 1
    lengths = [prompt_lens[0] + (7 * i + seed) % span for i in range(num_requests)]
    prompts = make_dummy_prompts(num_requests, lengths, vocab, seed=seed)
    return [
        (
            prompt,
            SamplingParams(
                max_new_tokens=new_tokens[0] + (5 * i) % (new_tokens[1] - new_tokens[0] + 1),
                temperature=0.0 if i % 3 == 0 else temperature,
                seed=seed * 1000 + i,
            ),
        )
        for i, prompt in enumerate(prompts)
    ]


def run_engine(
    model: Any,
    requests: Sequence[Tuple[Sequence[int], SamplingParams]],
    *,
    max_running: int = 8,
    chunk_size: int = 16,
    prefill_token_budget: int = 32,
    decode_backend: Any = None,
    prefill_backend: Any = None,
    padded_eager: bool = False,
    keep_logits: bool = False,
    max_context_len: int = 128,
) -> Tuple[List[Request], EngineStats]:
    """Run ``requests`` through a fresh cache and fresh runners; the finished requests in
    submission order and the statistics. The runners are cleaned up afterwards."""
    cache = model.create_kv_cache(
        num_slots=max_running * max_context_len + 1, max_reqs=max_running + 1, max_context_len=max_context_len
    )
    decode, prefill = build_runners(
        model,
        max_running=max_running,
        prefill_token_budget=prefill_token_budget,
        decode_backend=decode_backend,
        prefill_backend=prefill_backend,
        padded_eager=padded_eager,
        owned_outputs=keep_logits,
    )
    try:
        engine = Engine(
            model,
            cache,
            decode,
            prefill,
            max_running=max_running,
            chunk_size=chunk_size,
            prefill_token_budget=prefill_token_budget,
            keep_logits=keep_logits,
        )
        submitted = [engine.add_request(prompt, params) for prompt, params in requests]
        stats = engine.run()
        return submitted, stats
    finally:
        decode.cleanup()
        prefill.cleanup()


def main(argv: Optional[Sequence[str]] = None) -> int:
    on_gpu = torch.cuda.is_available()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="llama-3.2-1b" if on_gpu else "tiny")
    parser.add_argument("--device", default="cuda" if on_gpu else "cpu")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16" if on_gpu else "float32"
    )
    parser.add_argument("--requests", type=int, default=12)
    parser.add_argument("--max-running", type=int, default=8)
    parser.add_argument("--chunk-size", type=int, default=16)
    parser.add_argument("--prefill-token-budget", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decode-backend", default=None, help="default: the device's (full on CUDA)")
    parser.add_argument("--prefill-backend", default=None, help="default: the device's (breakable on CUDA)")
    parser.add_argument("--padded-eager", action="store_true", help="eager forwards at the padded sizes")
    parser.add_argument("--compare-eager", action="store_true", help="run the same schedule eagerly and compare")
    args = parser.parse_args(argv)
    model = ReferenceLlamaForCausalLM.from_preset(args.preset, dtype=getattr(torch, args.dtype), device=args.device)
    requests = workload(args.requests, model.config.vocab_size, temperature=args.temperature, seed=args.seed)
    shape = dict(
        max_running=args.max_running, chunk_size=args.chunk_size, prefill_token_budget=args.prefill_token_budget
    )
    done, stats = run_engine(
        model,
        requests,
        decode_backend=args.decode_backend,
        prefill_backend=args.prefill_backend,
        padded_eager=args.padded_eager,
        **shape,
    )
    for request in done:
        print(
            f"request {request.rid}: {len(request.prompt)} prompt tokens -> {request.output} ({request.finish_reason})"
        )
    for line in stats.lines():
        print(line)
    if args.compare_eager:
        eager, _ = run_engine(
            model,
            requests,
            decode_backend="disabled",
            prefill_backend="disabled",
            padded_eager=args.padded_eager,
            **shape,
        )
        same = sum(a == b for r, e in zip(done, eager) for a, b in zip(r.output, e.output))
        total = sum(len(r.output) for r in done)
        equal = all(r.output == e.output for r, e in zip(done, eager))
        print(f"eager run of the same schedule: {same}/{total} tokens agree ({'equal' if equal else 'DIFFERENT'})")
        return 0 if equal else 1
    return 0


if __name__ == "__main__":
    from cuda_graph_runner.backend.errors import BackendUnavailableError, UnknownBackendError

    try:
        raise SystemExit(main())
    except (UnknownBackendError, BackendUnavailableError, ValueError) as exc:
        # A user's mistake (a backend name, one this device cannot run, a bad value): one line, exit 2.
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else exc
        print(f"error: {message}", file=sys.stderr)
        raise SystemExit(2) from None

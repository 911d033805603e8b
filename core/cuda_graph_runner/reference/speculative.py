"""A reference speculative-decoding loop (greedy) for the reference model, and its drafts.

Per round, for the live requests: the draft proposes ``k`` tokens after each request's
last committed token; the target verifies them in one TARGET_VERIFY forward of width
``k + 1`` (``[last, d1 .. dk]``); the longest prefix of drafts equal to the target's own
greedy tokens is accepted, plus the target's token after it (the bonus); the KV slots of
the rejected drafts are rolled back (:meth:`PagedKVCache.truncate_request`). With greedy
acceptance the committed tokens are exactly plain greedy decoding's (lossless), whatever
the draft proposes: the draft only changes how many tokens a round commits.

Drafts (:class:`Draft` protocol):

* :class:`OracleDraft`: proposes the tokens plain greedy decoding produced, at no model
  cost (every draft accepted: the mechanism's upper bound).
* :class:`ModelDraft`: a standalone draft model with its own KV cache: the reference model
  with fewer layers, or the target itself (a second copy of its weights), run eagerly or
  through a :class:`~cuda_graph_runner.runner.draft.DraftDecodeCudaGraphRunner` (its ``k``
  steps in one graph) and a one-token decode runner for the draft-extend step.

EAGLE / MTP drafts, which take the target's hidden states, are out of scope.

Idea: speculative decoding (Leviathan et al., 2023; Chen et al., 2023), greedy
acceptance as in sglang's and vLLM's speculative workers.
"""

from __future__ import annotations

import ctypes
import dataclasses
import numbers
from array import array
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple, Union, cast

import torch

from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..runner.draft import draft_steps
from ..runner.model_protocol import GraphModel
from .batches import LogitsFn, eager_logits_fn, make_extend_batch
from .kv_cache import PagedKVCache

__all__ = [
    "Draft",
    "ModelDraft",
    "OracleDraft",
    "SpeculativeStats",
    "StepBuffers",
    "layer_skip_draft",
    "make_draft_batch",
    "speculative_generate",
    "step_batch",
]

#: ``batch -> [bs, k]`` int64 proposed tokens (a draft runner's ``forward``).
DraftFn = Callable[[ForwardBatch], torch.Tensor]


def step_batch(
    cache: PagedKVCache,
    rows: Sequence[int],
    tokens: Sequence[Sequence[int]],
    *,
    slots_per_req: Optional[int] = None,
    mode: Optional[ForwardMode] = None,
    buffers: Optional["StepBuffers"] = None,
) -> ForwardBatch:
    """A fixed-width batch of one speculative step, built with one host-to-device copy
    (its index fields and the cache table's new entries together) and one write of the
    cache's table, no device read: ``w = len(tokens[0])`` tokens per request at the
    positions after each request's cached ones, ``slots_per_req`` (default ``w``) new KV
    slots per request.

    Args:
        tokens: ``[bs][w]`` token ids (the same ``w`` for all).
        mode: default DECODE for ``w == 1``, TARGET_VERIFY for ``w > 1``.
        buffers: memory the batch's tensors are views of, reused across steps (a loop
            that builds a batch every step allocates nothing then); default: new memory.

    Returns:
        ``input_ids``/``positions`` ``[bs * w]`` int64, ``out_cache_loc``
        ``[bs * slots_per_req]`` int64 (request-major), ``req_pool_indices`` ``[bs]`` int64,
        ``seq_lens`` ``[bs]`` int32 (cached + ``w``) with ``seq_lens_cpu``. With ``buffers``
        they are valid until that ``buffers``' next step.

    Raises:
        ValueError: widths differ or are zero, or as many token lists as rows.
        CacheFullError: out of slots or context.
    """
    if buffers is None:
        buffers = StepBuffers(cache.device)
    return buffers.upload(cache, rows, tokens, slots_per_req=slots_per_req, mode=mode)[0]


class _Layout:
    """One step shape's place in a :class:`StepBuffers`' memory (in int64 words):
    ``[seq_lens as int32 | positions | out_cache_loc | table index | req_pool_indices |
    input_ids | scratch]``; the upload covers all but the scratch, and ``input_ids`` and
    the scratch are adjacent so one read returns both. Its device views are made once."""

    __slots__ = (
        "lens_words",
        "upload",
        "host_upload",
        "device_upload",
        "ids",
        "ids_tail",
        "scratch",
        "read",
        "positions",
        "loc",
        "index",
        "req",
        "lens",
    )

    def __init__(self, host: torch.Tensor, device: torch.Tensor, bs: int, w: int, per_req: int, scratch: int) -> None:
        n_ids, n_loc = bs * w, bs * per_req
        self.lens_words = pos = (bs + 1) // 2
        loc = pos + n_ids
        index = loc + n_loc
        req = index + n_loc
        ids = req + bs
        self.upload = ids + n_ids  # words the host writes and the copy carries
        end = self.upload + scratch
        self.host_upload, self.device_upload = host[: self.upload], device[: self.upload]
        self.lens = device[: self.lens_words].view(torch.int32)[:bs]
        self.positions = device[pos:loc]
        self.loc = device[loc:index]
        self.index = device[index:req]
        self.req = device[req:ids]
        self.ids = device[ids : self.upload]
        self.ids_tail = self.ids.view(bs, w)[:, 1:]  # where device drafts go (verify: [last, d1 .. dk])
        self.scratch = device[self.upload : end]
        self.read = device[ids:end]


_PLAIN_INT = {int}


def _token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool) and int(value) >= 0


class StepBuffers:
    """Reused memory for the step batches of one stream of steps (the verify batches of a
    loop, a draft's batches): a host staging area (pinned on CUDA) and a device area, and
    per step shape the device views of its fields, made on the first step of that shape.
    A step then writes the host area (no tensor built from Python lists), copies it to the
    device in one asynchronous copy and allocates no tensor.

    Reuse is safe: before the host area is written again, the previous step's copy has
    finished (a CUDA event; a loop that reads the device once a round never waits on it).
    A step's batch is valid until the next step of the same ``StepBuffers``.

    Args:
        device: where the batches' tensors live.
        read_between_steps: the caller promises a device read (a synchronize of the stream
            the copies run on: ``.tolist()``, ``.item()``, ``.cpu()``) after every step and
            before its next one, as :func:`speculative_generate` does each round: every
            copy has then finished before the host area is rewritten, so a step records
            and queries no event (two CUDA calls and a stream lookup less per step).
    """

    def __init__(self, device: Union[str, torch.device], *, read_between_steps: bool = False) -> None:
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._fenced = self._cuda and not read_between_steps
        self._on_host = self.device.type == "cpu"  # the staging area is the device area
        self._layouts: Dict[Tuple[int, int, int, int], _Layout] = {}
        self._words = 0
        self._event: Any = None
        self._allocate(64)

    def _allocate(self, words: int) -> None:
        self._device = torch.zeros(words, dtype=torch.int64, device=self.device)
        if self._on_host:
            self._host = self._device
        else:  # pinned on CUDA: an asynchronous copy; pageable (a blocking copy) elsewhere
            self._host = torch.zeros(words, dtype=torch.int64, pin_memory=self._cuda)
        raw = memoryview((ctypes.c_char * (8 * words)).from_address(self._host.data_ptr())).cast("B")
        self._host64, self._host32 = raw.cast("q"), raw.cast("i")
        self._words = words
        self._layouts.clear()
        if self._fenced and self._event is None:
            self._event = torch.cuda.Event()

    def layout(self, bs: int, w: int, per_req: int, scratch: int) -> _Layout:
        """The views of a step of ``bs`` requests, ``w`` tokens and ``per_req`` new slots
        each and ``scratch`` words after ``input_ids`` (made once per shape)."""
        key = (bs, w, per_req, scratch)
        layout = self._layouts.get(key)
        if layout is None:
            need = (bs + 1) // 2 + bs * (2 * w + 2 * per_req + 1) + scratch
            if need > self._words:
                self._sync()
                self._allocate(max(need, 2 * self._words))
            if len(self._layouts) >= 256:  # bounded: a caller may step through many shapes
                self._layouts.clear()
            layout = self._layouts[key] = _Layout(self._host, self._device, bs, w, per_req, scratch)
        return layout

    def _sync(self) -> None:
        event = self._event
        if event is not None and not event.query():
            event.synchronize()

    def upload(
        self,
        cache: PagedKVCache,
        rows: Sequence[int],
        tokens: Sequence[Sequence[int]],
        *,
        slots_per_req: Optional[int] = None,
        mode: Optional[ForwardMode] = None,
        scratch: int = 0,
    ) -> Tuple[ForwardBatch, _Layout]:
        """:func:`step_batch` into this memory, and its layout (``layout.scratch``: ``scratch``
        int64 words on the device right after ``input_ids``, for a caller's outputs, which
        ``layout.read`` returns with ``input_ids`` in one read)."""
        bs = len(rows)
        if len(tokens) != bs:
            raise ValueError(f"step_batch: {bs} rows but {len(tokens)} token lists")
        if bs == 1:  # the common serving step: no per-request loops below
            flat = list(tokens[0])
            w = len(flat)
            if w == 0:
                raise ValueError("step_batch: every request needs the same non-zero width, got [0]")
        else:
            w = len(tokens[0]) if bs else 0
            if w == 0 or any(len(t) != w for t in tokens):
                raise ValueError(
                    f"step_batch: every request needs the same non-zero width, got {sorted({len(t) for t in tokens})}"
                )
            flat = [t for toks in tokens for t in toks]
        per_req = w if slots_per_req is None else slots_per_req
        # Before reserving (a refused step leaves the cache as it was); the loop's own
        # tokens (plain ints from one read) take the cheap check only.
        if set(map(type, flat)) != _PLAIN_INT or min(flat) < 0:
            bad = next((t for t in flat if not _token_id(t)), None)
            if bad is not None:
                raise ValueError(f"step_batch: token {bad!r} is not accepted; accepted: token ids, ints >= 0")
        layout = self._layouts.get((bs, w, per_req, scratch)) or self.layout(bs, w, per_req, scratch)
        if bs == 1:
            b = cache.request_len(rows[0])
            after = [b + w]
            positions = list(range(b, b + w))
        else:
            request_len = cache.request_len
            before = [request_len(r) for r in rows]
            after = [b + w for b in before]
            positions = [b + j for b in before for j in range(w)] if w > 1 else before
        table_index, slots = cache.reserve_tokens(rows, per_req)
        if self._fenced:
            self._sync()
        self._host32[:bs] = array("i", after)
        positions += slots
        positions += table_index
        positions += rows
        positions += flat
        self._host64[layout.lens_words : layout.upload] = array("q", positions)
        if self._cuda:
            layout.device_upload.copy_(layout.host_upload, non_blocking=True)
            if self._fenced:
                # The copy ran on the cache device's current stream, whatever device is
                # current: the event follows that stream, or the staging area is
                # rewritten mid-copy.
                self._event.record(torch.cuda.current_stream(self.device))
        elif not self._on_host:
            layout.device_upload.copy_(layout.host_upload)
        if per_req:
            cache.write_table(layout.index, layout.loc)
        batch = ForwardBatch(
            forward_mode=mode if mode is not None else (ForwardMode.DECODE if w == 1 else ForwardMode.TARGET_VERIFY),
            input_ids=layout.ids,
            positions=layout.positions,
            out_cache_loc=layout.loc,
            req_pool_indices=layout.req,
            seq_lens=layout.lens,
            seq_lens_cpu=after,
            num_tokens_per_req=w,
        )
        return batch, layout


def make_draft_batch(
    cache: PagedKVCache,
    rows: Sequence[int],
    last_tokens: Sequence[int],
    k: int,
    *,
    buffers: Optional[StepBuffers] = None,
) -> ForwardBatch:
    """The live batch of a draft runner (:class:`DraftDecodeCudaGraphRunner`): ``k`` KV
    slots per request allocated and appended to its row, the step-0 fields of a DECODE
    batch and ``out_cache_loc`` ``[bs * k]`` int64 (request-major); see :func:`step_batch`.

    Raises:
        ValueError: ``k < 1`` or as many tokens as rows.
        CacheFullError: out of slots or context.
    """
    if k < 1:
        raise ValueError(f"make_draft_batch: k={k} must be >= 1")
    if len(last_tokens) != len(rows):
        raise ValueError(f"make_draft_batch: {len(rows)} rows but {len(last_tokens)} tokens")
    return step_batch(
        cache, rows, [[int(t)] for t in last_tokens], slots_per_req=k, mode=ForwardMode.DECODE, buffers=buffers
    )


class Draft(Protocol):
    """What the loop asks of a draft. Requests are indices into the prompts."""

    def prefill(self, prompts: Sequence[Sequence[int]]) -> None:
        """Start every request on its prompt (its first token comes from the target)."""

    def propose(self, live: Sequence[int], outputs: Sequence[List[int]], k: int) -> "List[List[int]] | torch.Tensor":
        """``k`` proposed tokens per live request: host lists, or a ``[len(live), k]`` int64
        tensor on the target's device (the loop then feeds it to verification without
        reading it first: one device read per round; it copies the tensor before the
        verify forward, so graph memory of a draft runner's replay is fine); ``outputs[i]``: request
        ``live[i]``'s committed generated tokens, the last of which is not yet in any KV
        cache."""

    def commit(self, live: Sequence[int], proposals: Sequence[List[int]], accepted: Sequence[int]) -> None:
        """Each live request's proposals (as host lists) and how many the target accepted."""

    def release(self, request: int) -> None:
        """Request ``request`` finished: free what the draft holds for it."""


class OracleDraft:
    """Proposes the tokens plain greedy decoding produced (``expected[i]``), at no model
    cost; past the known tokens it proposes token 0. The upper bound of the mechanism:
    every proposal is accepted while the expected tokens last."""

    def __init__(self, expected: Sequence[Sequence[int]]) -> None:
        self.expected = [list(e) for e in expected]

    def prefill(self, prompts: Sequence[Sequence[int]]) -> None:
        if len(prompts) != len(self.expected):
            raise ValueError(f"OracleDraft: {len(prompts)} prompts for {len(self.expected)} expected outputs")

    def propose(self, live: Sequence[int], outputs: Sequence[List[int]], k: int) -> List[List[int]]:
        out = []
        for i, done in zip(live, outputs):
            known = self.expected[i][len(done) : len(done) + k]
            out.append(known + [0] * (k - len(known)))
        return out

    def commit(self, live: Sequence[int], proposals: Sequence[List[int]], accepted: Sequence[int]) -> None:
        pass

    def release(self, request: int) -> None:
        pass


class ModelDraft:
    """A standalone draft model with its own KV cache (``model.kv_cache``), kept one token
    behind the committed sequence: its KV holds every committed token but the last.

    Per round: a draft-extend step first writes, for requests whose previous round accepted
    every proposal, the one accepted token the draft never fed itself (a one-token DECODE
    batch through ``extend_fn``); then ``k`` greedy steps from each request's last token
    (``draft_fn``, one batch of :func:`make_draft_batch`'s layout); after verification its
    KV is cut back to the accepted tokens (:meth:`PagedKVCache.truncate_request`).

    Args:
        model: the draft model with a KV cache attached, with room for every prompt plus
            its budget and ``k`` tokens (for the reference model: :func:`layer_skip_draft`,
            or a second model of the target's weights: the target as its own draft).
        draft_fn: ``batch -> [bs, k]`` int64 tokens (a :class:`DraftDecodeCudaGraphRunner`'s
            ``forward``); default: the same steps eagerly.
        extend_fn: ``batch -> logits`` for the draft-extend DECODE batch (a decode
            runner's ``forward``); default eager.
        prefill_fn: ``batch -> logits`` for the prompts; default eager.
        read_between_proposes: the caller promises a device read (a synchronize of the
            stream the draft's batches are copied on: ``.tolist()``, ``.item()``,
            ``.cpu()``) after every :meth:`propose` and before the next one, as
            :func:`speculative_generate` does every round (pass True there). The step
            buffers are then rewritten without a CUDA event
            (``StepBuffers(read_between_steps=True)``: two CUDA calls and a stream lookup
            less per batch). Default False: each batch's upload records an event and the
            next rewrite of its staging area waits on it, safe for any caller. A caller
            that passes True and does not read may overwrite a batch's host memory while
            its copy to the device is still running (wrong draft inputs, no error).

    Attributes:
        forwards: draft-model forwards run (``k`` per round plus draft-extend steps).
        read_between_proposes: the argument.

    Raises:
        TypeError: ``read_between_proposes`` is not a bool.
    """

    def __init__(
        self,
        model: GraphModel,
        *,
        draft_fn: Optional[DraftFn] = None,
        extend_fn: Optional[LogitsFn] = None,
        prefill_fn: Optional[LogitsFn] = None,
        read_between_proposes: bool = False,
    ) -> None:
        if not isinstance(read_between_proposes, bool):
            raise TypeError(f"read_between_proposes={read_between_proposes!r}: ModelDraft takes a bool")
        self.model = model
        self.cache: PagedKVCache = model.kv_cache  # type: ignore[attr-defined]
        self.read_between_proposes = read_between_proposes
        self.draft_fn = draft_fn
        self.extend_fn = extend_fn or eager_logits_fn(model)
        self.prefill_fn = prefill_fn or eager_logits_fn(model)
        self.rows: Dict[int, int] = {}
        self._lag: Dict[int, int] = {}  # request -> the accepted token its KV lacks
        self.forwards = 0
        # Two streams of steps, each valid until its own next step: the draft-extend
        # batch and the k-step batch of one round are both in flight before the verify.
        # No event only when the caller reads the device between two proposes.
        self._extend_buffers = StepBuffers(self.cache.device, read_between_steps=read_between_proposes)
        self._draft_buffers = StepBuffers(self.cache.device, read_between_steps=read_between_proposes)

    def prefill(self, prompts: Sequence[Sequence[int]]) -> None:
        batch = make_extend_batch(self.cache, prompts)
        with torch.no_grad():
            self.prefill_fn(batch)
        self.rows = dict(enumerate(batch.req_pool_indices.tolist()))

    def propose(self, live: Sequence[int], outputs: Sequence[List[int]], k: int) -> torch.Tensor:
        lagging = [i for i in live if i in self._lag]
        with torch.no_grad():
            if lagging:
                batch = step_batch(
                    self.cache,
                    [self.rows[i] for i in lagging],
                    [[self._lag[i]] for i in lagging],
                    buffers=self._extend_buffers,
                )
                self.extend_fn(batch)
                self.forwards += 1
                for i in lagging:
                    del self._lag[i]
            batch = make_draft_batch(
                self.cache, [self.rows[i] for i in live], [o[-1] for o in outputs], k, buffers=self._draft_buffers
            )
            if self.draft_fn is None:
                tokens = draft_steps(self.model, batch, k)
            else:
                tokens = self.draft_fn(batch)
            # Not copied here: the loop copies it into its verify batch before the verify
            # replay can reuse a runner's graph memory (see Draft.propose).
        self.forwards += k
        return tokens if tokens.shape[0] == len(live) else tokens[: len(live)]

    def commit(self, live: Sequence[int], proposals: Sequence[List[int]], accepted: Sequence[int]) -> None:
        for i, proposed, a in zip(live, proposals, accepted):
            row = self.rows[i]
            k = len(proposed)
            # The k steps wrote the last token and d1 .. d(k-1); keep the accepted ones.
            length = self.cache.request_len(row)
            # Dropped entries (at most k - 1) are not cleared: the next round's k-slot
            # draft batch overwrites them.
            self.cache.truncate_request(row, length - k + min(a, k - 1) + 1, clear=False)
            if a == k:
                self._lag[i] = proposed[k - 1]

    def release(self, request: int) -> None:
        self.cache.free_request(self.rows.pop(request))
        self._lag.pop(request, None)


@dataclasses.dataclass
class SpeculativeStats:
    """Counts of one :func:`speculative_generate` run.

    Attributes:
        rounds: verify forwards (each over the requests live then).
        request_rounds: sum over rounds of live requests.
        proposed, accepted: draft tokens proposed and accepted (before cutting at a
            request's token budget).
        generated: tokens committed (prefill's first tokens included).
        first_tokens: of those, the prefill's (one per request).
        prefill_seconds, decode_seconds: with a ``clock``, seconds of the prefill and of
            the rounds after it. ``prefill_seconds`` includes the loop's set-up before the
            target's and the draft's prefill: the verify batches' buffers
            (:class:`StepBuffers`) and the first round's views of them, made once so that
            no round allocates; ``decode_seconds`` holds the rounds only.
    """

    rounds: int = 0
    request_rounds: int = 0
    proposed: int = 0
    accepted: int = 0
    generated: int = 0
    first_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0

    @property
    def accept_rate(self) -> float:
        """``accepted / proposed`` (0.0 when nothing was proposed)."""
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Tokens a request commits per verify round on average."""
        return (self.generated - self.first_tokens) / self.request_rounds if self.request_rounds else 0.0


def speculative_generate(
    model: GraphModel,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: "int | Sequence[int]",
    draft: Draft,
    k: int,
    *,
    verify_fn: Optional[LogitsFn] = None,
    prefill_fn: Optional[LogitsFn] = None,
    stats: Optional[SpeculativeStats] = None,
    clock: Optional[Callable[[], float]] = None,
) -> List[List[int]]:
    """Greedy speculative decoding of ``prompts`` with ``draft`` proposing ``k`` tokens a round.

    Args:
        model: the target, with its KV cache attached (``model.kv_cache``), room for every
            prompt plus ``max_new_tokens + k`` tokens.
        max_new_tokens: tokens to generate per request (one int for all, or one each):
            requests finish at different rounds and leave the batch.
        draft: proposes ``k`` tokens per live request a round (:class:`Draft`). Every
            round reads the device once between two ``propose`` calls, so a
            :class:`ModelDraft` driven only here may be built with
            ``read_between_proposes=True`` (no CUDA event per batch).
        k: draft tokens per round (>= 1); verification is TARGET_VERIFY of width ``k + 1``.
        verify_fn: ``batch -> [bs * (k + 1), vocab]`` float logits (a decode runner of
            mode ``target_verify`` and ``num_tokens_per_req=k + 1``: its ``forward``), or
            ``[bs * (k + 1)]`` int64 greedy tokens (the ``forward`` of such a
            :class:`~cuda_graph_runner.runner.greedy.GreedyDecodeCudaGraphRunner`: the
            argmax recorded in the verify graph, one eager op a round less); default
            eager logits.
        prefill_fn: the target's prompt forward; default eager.
        stats: filled with the run's counts when given.
        clock: seconds now, after the device finished its work (a synchronize, then
            ``time.perf_counter()``): times the prefill and the rounds apart in ``stats``.

    Returns:
        ``[len(prompts)][max_new_tokens[i]]`` committed token ids: equal to plain greedy
        decoding's for any draft (bit-equal logits assumed: fp32 and no TF32 on a GPU).

    Raises:
        ValueError: ``k < 1``, a budget < 1, or budgets of another length than prompts.
        CacheFullError: the cache cannot hold the requests.
    """
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k={k!r}: the draft width must be an int >= 1")
    budgets = [max_new_tokens] * len(prompts) if isinstance(max_new_tokens, int) else list(max_new_tokens)
    if len(budgets) != len(prompts) or any(b < 1 for b in budgets):
        raise ValueError(f"max_new_tokens={max_new_tokens!r}: one int >= 1, or one per prompt ({len(prompts)})")
    stats = stats if stats is not None else SpeculativeStats()
    cache: PagedKVCache = model.kv_cache  # type: ignore[attr-defined]
    verify = verify_fn or eager_logits_fn(model)
    w = k + 1
    start = clock() if clock is not None else 0.0
    # Set-up, timed with the prefill: the verify batches' memory (no tensor allocated per
    # round; read_between_steps: each round's read finishes its copy, so no event) and
    # the first round's views, the largest shape.
    buffers = StepBuffers(cache.device, read_between_steps=True)
    first_live = sum(1 for b in budgets if b > 1)
    if first_live:
        buffers.layout(first_live, w, w, first_live * w)
    with torch.no_grad():
        batch = make_extend_batch(cache, prompts)
        first = (prefill_fn or eager_logits_fn(model))(batch)[: len(prompts)].argmax(dim=-1).tolist()
    rows = batch.req_pool_indices.tolist()
    outputs = [[t] for t in first]
    stats.generated += len(prompts)
    stats.first_tokens += len(prompts)
    draft.prefill(prompts)
    prefilled = clock() if clock is not None else 0.0
    live = []
    for i in range(len(prompts)):
        if budgets[i] > 1:
            live.append(i)
        else:
            _finish(cache, draft, rows, i)
    truncate = cache.truncate_request
    no_drafts = [0] * k
    # Per live request, in live's order, rebuilt only when a request finishes: its
    # committed tokens, its cache row and the tokens it still takes.
    live_outputs = [outputs[i] for i in live]
    live_rows = [rows[i] for i in live]
    left = [budgets[i] - 1 for i in live]
    with torch.no_grad():
        while live:
            n = len(live)
            proposed = draft.propose(live, live_outputs, k)
            # One upload (the verify batch, the table's new entries), one write of the
            # table, the verify, and one read: the round's only device read. Host drafts
            # are known: the read is the target's tokens (the argmax, into the room
            # after input_ids, unless the verify returned tokens). Drafts on the device
            # go into input_ids unread and are read with the target's tokens after them.
            on_device = isinstance(proposed, torch.Tensor)
            if on_device:
                firsts = [[o[-1], *no_drafts] for o in live_outputs]
            else:
                firsts = [[o[-1], *p] for o, p in zip(live_outputs, proposed)]
            batch, layout = buffers.upload(cache, live_rows, firsts, scratch=n * w)
            if on_device:
                # A copy, read back below: the draft's tensor may be graph memory that
                # the verify replay reuses.
                tensor = cast(torch.Tensor, proposed)
                layout.ids_tail.copy_(tensor if tensor.shape[0] == n else tensor[:n])
            out = verify(batch)
            if out.shape[0] != n * w:
                out = out[: n * w]
            if out.is_floating_point():  # logits
                torch.argmax(out, dim=-1, out=layout.scratch)
                read = (layout.read if on_device else layout.scratch).tolist()
            elif on_device:  # tokens, next to the drafts they verified
                layout.scratch.copy_(out)
                read = layout.read.tolist()
            else:
                read = out.tolist()
            base = n * w if on_device else 0  # where the target's tokens start in read
            lengths: List[int] = batch.seq_lens_cpu  # type: ignore[assignment]  # KV lengths after the verify (a list here)
            accepted = []
            proposals = []
            generated = 0
            finished = False
            for j in range(n):
                p = read[j * w + 1 : (j + 1) * w] if on_device else firsts[j][1:]
                t = read[base + j * w : base + (j + 1) * w]
                if p == t[:k]:  # every draft accepted: one list compare
                    a = k
                else:
                    a = 0
                    while p[a] == t[a]:
                        a += 1
                accepted.append(a)
                proposals.append(p)
                # The accepted drafts equal the target's tokens: commit t[: a + 1], cut
                # at the request's budget.
                take = a + 1 if a < left[j] else left[j]
                live_outputs[j].extend(t[:take])
                generated += take
                left[j] -= take
                finished = finished or not left[j]
                # The verify wrote [last, d1 .. dk]: keep last and the accepted drafts. The
                # table past the new length is not cleared: the next round's append
                # overwrites it (k + 1 > k - a entries) and _finish frees the row.
                truncate(live_rows[j], lengths[j] - k + a, clear=False)
            stats.rounds += 1
            stats.request_rounds += n
            stats.generated += generated
            stats.proposed += k * n
            stats.accepted += sum(accepted)
            draft.commit(live, proposals, accepted)
            if finished:
                for j, i in enumerate(live):
                    if not left[j]:
                        _finish(cache, draft, rows, i)
                kept = [j for j in range(n) if left[j]]
                live = [live[j] for j in kept]
                live_outputs = [live_outputs[j] for j in kept]
                live_rows = [live_rows[j] for j in kept]
                left = [left[j] for j in kept]
    if clock is not None:
        stats.prefill_seconds += prefilled - start
        stats.decode_seconds += clock() - prefilled
    return outputs


def _finish(cache: PagedKVCache, draft: Draft, rows: List[int], i: int) -> None:
    cache.free_request(rows[i])
    draft.release(i)


def layer_skip_draft(target: Any, num_layers: int, *, requests: int, context: int) -> Any:
    """A draft of the reference model: ``target``'s first ``num_layers`` decoder layers, its
    embedding, final norm and LM head (the same weights, copied), with its own KV cache of
    ``requests`` rows and ``context`` tokens each.

    Raises:
        ValueError: ``num_layers`` not in ``1 .. target's layers``.
    """
    from .model import ReferenceLlamaForCausalLM

    total = target.config.num_hidden_layers
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or not 1 <= num_layers <= total:
        raise ValueError(f"num_layers={num_layers!r}: a draft takes 1 .. {total} of the target's layers")
    config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    draft = ReferenceLlamaForCausalLM(config, dtype=target.dtype, device=target.device)
    missing, _ = draft.load_state_dict(target.state_dict(), strict=False)
    if missing:
        raise ValueError(f"layer_skip_draft: the target lacks draft weights {missing}")
    draft.create_kv_cache(num_slots=requests * context + 1, max_reqs=requests + 1, max_context_len=context)
    return draft

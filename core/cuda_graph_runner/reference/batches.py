"""Batch builders and a tiny greedy driver for the reference model.

Builders allocate request rows and KV slots in a :class:`PagedKVCache`, fill its
``req_to_token`` table and return a :class:`ForwardBatch` on the cache's device.
:class:`GreedySession` / :func:`greedy_generate` run prefill then decode steps through
caller-supplied ``batch -> logits`` functions (eager by default), so a test can run the
same prompts eagerly and through a runner and compare token ids or logits.
"""

from __future__ import annotations

from typing import Callable, List, Optional, Sequence, Union

import torch

from ..backend.context import forward_context
from ..backend.forward_batch import ForwardBatch, ForwardMode
from ..runner.model_protocol import GraphModel
from .kv_cache import PagedKVCache

__all__ = [
    "LogitsFn",
    "GreedySession",
    "eager_logits_fn",
    "greedy_generate",
    "make_decode_batch",
    "make_dllm_extend_batch",
    "make_dummy_prompts",
    "make_extend_batch",
    "make_target_verify_batch",
    "pad_decode_batch",
]

LogitsFn = Callable[[ForwardBatch], torch.Tensor]


def eager_logits_fn(model: GraphModel) -> LogitsFn:
    """``batch -> model.compute_logits(model.forward(batch), batch)`` inside ``forward_context``,
    after the model's eager metadata hook ``init_forward_metadata(batch)`` when it has one
    (a plan-based attention plans every eager forward, as the runners do)."""

    def run(batch: ForwardBatch) -> torch.Tensor:
        init = getattr(model, "init_forward_metadata", None)
        if init is not None:
            init(batch)
        with torch.no_grad(), forward_context(batch):
            return model.compute_logits(model.forward(batch), batch)

    return run


def _i32(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int32, device=device)


def _i64(values: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(list(values), dtype=torch.int64, device=device)


def make_extend_batch(
    cache: PagedKVCache,
    token_lists: Sequence[Sequence[int]],
    *,
    rows: Optional[Sequence[int]] = None,
) -> ForwardBatch:
    """An EXTEND (prefill) batch appending ``token_lists[i]`` to request ``i``.

    Args:
        cache: allocates slots (and rows) and gets ``req_to_token`` filled.
        token_lists: new tokens per request (each non-empty).
        rows: ``None`` allocates a fresh row per request (no prefix). Otherwise the
            existing rows to continue: their current length (``cache.request_len``) is
            the cached prefix, i.e. chunked prefill.

    Returns:
        A batch on ``cache.device``: ``input_ids``/``positions``/``out_cache_loc``
        ``[num_tokens]`` int64; ``req_pool_indices`` ``[bs]`` int64; ``seq_lens``,
        ``extend_seq_lens``, ``extend_prefix_lens`` ``[bs]`` int32, with host copies.

    Raises:
        ValueError: an empty token list, or ``rows`` of another length.
        CacheFullError: out of rows, slots or context.
        KeyError: a row in ``rows`` is not allocated.
    """
    if any(len(t) == 0 for t in token_lists):
        raise ValueError("make_extend_batch: every request needs at least one new token")
    if rows is not None and len(rows) != len(token_lists):
        raise ValueError(f"make_extend_batch: {len(rows)} rows for {len(token_lists)} token lists")
    if rows is None:
        rows = [cache.alloc_request() for _ in token_lists]
    dev = cache.device
    prefix = [cache.request_len(r) for r in rows]
    ext = [len(t) for t in token_lists]
    slots = cache.alloc_slots(sum(ext))
    start = 0
    for r, n in zip(rows, ext):
        cache.assign_slots(r, slots[start : start + n])
        start += n
    positions = [p + j for p, n in zip(prefix, ext) for j in range(n)]
    seq_lens = [p + n for p, n in zip(prefix, ext)]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        input_ids=_i64([t for toks in token_lists for t in toks], dev),
        positions=_i64(positions, dev),
        out_cache_loc=slots,
        req_pool_indices=_i64(rows, dev),
        seq_lens=_i32(seq_lens, dev),
        extend_seq_lens=_i32(ext, dev),
        extend_prefix_lens=_i32(prefix, dev),
        seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=ext,
        extend_prefix_lens_cpu=prefix,
    )


def make_decode_batch(
    cache: PagedKVCache,
    rows: Sequence[int],
    seq_lens: Optional[Sequence[int]],
    next_tokens: Union[Sequence[int], Sequence[Sequence[int]]],
) -> ForwardBatch:
    """A DECODE batch (one token per request), or TARGET_VERIFY when ``next_tokens`` holds
    lists of equal width ``w > 1``.

    Allocates ``w`` slots per request and appends them to its row.

    Args:
        rows: live request rows.
        seq_lens: each request's KV length *before* this step, or ``None`` to read it
            from the cache (``cache.request_len``); if given it must match the cache.
        next_tokens: ``[bs]`` ints (decode) or ``[bs][w]`` (target verify).

    Returns:
        A batch with ``input_ids``/``positions``/``out_cache_loc`` ``[bs * w]`` int64
        (request-major), ``req_pool_indices`` ``[bs]`` int64, ``seq_lens`` ``[bs]`` int32
        (length *after* the step), ``num_tokens_per_req = w``.

    Raises:
        ValueError: lengths disagree (rows, tokens, widths, ``seq_lens`` vs the cache).
        CacheFullError: out of slots or context.
    """
    nested = [list(t) if isinstance(t, (list, tuple)) else [int(t)] for t in next_tokens]  # type: ignore[arg-type]  # an int here
    if len(nested) != len(rows):
        raise ValueError(f"make_decode_batch: {len(rows)} rows but {len(nested)} token entries")
    widths = {len(t) for t in nested}
    if len(widths) > 1 or 0 in widths:
        raise ValueError(f"make_decode_batch: every request needs the same non-zero width, got {sorted(widths)}")
    w = widths.pop() if widths else 1
    cached = [cache.request_len(r) for r in rows]
    if seq_lens is not None and list(seq_lens) != cached:
        raise ValueError(f"make_decode_batch: seq_lens {list(seq_lens)} differ from the cache's lengths {cached}")
    dev = cache.device
    slots = cache.alloc_slots(w * len(rows))
    for i, r in enumerate(rows):
        cache.assign_slots(r, slots[i * w : (i + 1) * w])
    after = [c + w for c in cached]
    mode = ForwardMode.DECODE if w == 1 else ForwardMode.TARGET_VERIFY
    return ForwardBatch(
        forward_mode=mode,
        input_ids=_i64([t for toks in nested for t in toks], dev),
        positions=_i64([c + j for c in cached for j in range(w)], dev),
        out_cache_loc=slots,
        req_pool_indices=_i64(rows, dev),
        seq_lens=_i32(after, dev),
        seq_lens_cpu=after,
        num_tokens_per_req=w,
    )


def make_target_verify_batch(
    cache: PagedKVCache, rows: Sequence[int], draft_tokens: Sequence[Sequence[int]]
) -> ForwardBatch:
    """A TARGET_VERIFY batch of ``w = len(draft_tokens[0])`` tokens per request
    (see :func:`make_decode_batch`; ``w`` may be 1, giving a DECODE batch)."""
    return make_decode_batch(cache, rows, None, [list(t) for t in draft_tokens])


def make_dllm_extend_batch(cache: PagedKVCache, rows: Sequence[int], blocks: Sequence[Sequence[int]]) -> ForwardBatch:
    """A DLLM_EXTEND batch: each request appends a block of ``w = len(blocks[0])`` tokens
    (the same width for all) after its cached prefix; attention is bidirectional inside
    the block. Slots, positions and lengths as in :func:`make_decode_batch`.

    A denoising loop runs the same block again with new token ids: build the next step's
    batch with ``batch.replace(input_ids=...)`` (the same slots are rewritten).

    Raises:
        ValueError: blocks of different or zero widths, or as many blocks as rows.
    """
    batch = make_decode_batch(cache, rows, None, [list(b) for b in blocks])
    return batch.replace(forward_mode=ForwardMode.DLLM_EXTEND)


def pad_decode_batch(batch: ForwardBatch, batch_size: int) -> ForwardBatch:
    """Pad a DECODE / TARGET_VERIFY / DLLM_EXTEND batch to ``batch_size`` requests with dummies:
    request row 0, ``seq_len`` 1, token 0, position 0, KV slot 0 (what a runner does).

    Raises:
        ValueError: not decode-like, or ``batch_size`` smaller than the batch.
    """
    if not batch.forward_mode.is_decode_like():
        raise ValueError(f"pad_decode_batch: {batch.forward_mode} batch is not decode-like")
    extra = batch_size - batch.batch_size
    if extra < 0:
        raise ValueError(f"pad_decode_batch: batch of {batch.batch_size} is larger than {batch_size}")
    w = batch.num_tokens_per_req

    def grow(t: torch.Tensor, n: int, value: int) -> torch.Tensor:
        return torch.cat([t, torch.full((n,), value, dtype=t.dtype, device=t.device)])

    return batch.replace(
        input_ids=grow(batch.input_ids, extra * w, 0),
        positions=grow(batch.positions, extra * w, 0),
        out_cache_loc=grow(batch.out_cache_loc, extra * w, 0),
        req_pool_indices=grow(batch.req_pool_indices, extra, 0),
        seq_lens=grow(batch.seq_lens, extra, 1),
        seq_lens_cpu=None if batch.seq_lens_cpu is None else list(batch.seq_lens_cpu) + [1] * extra,
    )


def make_dummy_prompts(
    batch_size: int, length: Union[int, Sequence[int]], vocab_size: int, seed: int = 0
) -> List[List[int]]:
    """``batch_size`` random prompts of token ids in ``[1, vocab_size)``, reproducible.

    Args:
        length: one length for all, or one per prompt.

    Raises:
        ValueError: a per-prompt ``length`` list of another size.
    """
    lengths = [length] * batch_size if isinstance(length, int) else list(length)
    if len(lengths) != batch_size:
        raise ValueError(f"make_dummy_prompts: {len(lengths)} lengths for batch_size={batch_size}")
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab_size, (n,), generator=gen).tolist() for n in lengths]


class GreedySession:
    """Greedy decoding of a few prompts, one step at a time.

    Args:
        model: the reference model (or any model with the protocol).
        cache: the KV cache the model writes (``model.kv_cache``).
        prefill_fn, decode_fn: ``batch -> float32 logits`` (EXTEND: ``[bs, vocab]``;
            DECODE: ``[num_tokens >= bs, vocab]``, rows past ``bs`` ignored, so a
            runner's padded output is fine). Default: eager. ``runner.forward`` may be
            passed as it is: the session copies what it keeps.

    Attributes:
        rows: the request rows, after :meth:`prefill`.
        tokens: generated token ids per request.
        logits: per step, the float32 logits ``[bs, vocab]`` the tokens were picked from:
            owned copies, never aliases of what ``prefill_fn``/``decode_fn`` returned (a
            runner's zero-copy output is valid only until its next replay).
    """

    def __init__(
        self,
        model: GraphModel,
        cache: PagedKVCache,
        *,
        prefill_fn: Optional[LogitsFn] = None,
        decode_fn: Optional[LogitsFn] = None,
    ) -> None:
        self.model = model
        self.cache = cache
        self.prefill_fn = prefill_fn or eager_logits_fn(model)
        self.decode_fn = decode_fn or eager_logits_fn(model)
        self.rows: List[int] = []
        self.tokens: List[List[int]] = []
        self.logits: List[torch.Tensor] = []

    def prefill(self, prompts: Sequence[Sequence[int]], *, chunk_size: Optional[int] = None) -> torch.Tensor:
        """Prefill ``prompts`` (in chunks of ``chunk_size`` tokens when given) and pick each
        request's first token.

        Returns:
            ``[bs, vocab]`` float32 logits of each prompt's last token.

        Raises:
            ValueError: an empty prompt or ``chunk_size < 1``.
        """
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size={chunk_size}: must be >= 1")
        self.rows = [self.cache.alloc_request() for _ in prompts]
        step = chunk_size or max(len(p) for p in prompts)
        last: List[Optional[torch.Tensor]] = [None] * len(prompts)
        for start in range(0, max(len(p) for p in prompts), step):
            live = [i for i, p in enumerate(prompts) if len(p) > start]
            batch = make_extend_batch(
                self.cache, [prompts[i][start : start + step] for i in live], rows=[self.rows[i] for i in live]
            )
            # A copy: the next chunk's call may overwrite a zero-copy output.
            logits = self.prefill_fn(batch)[: len(live)].clone()
            for j, i in enumerate(live):
                last[i] = logits[j]
        out = torch.stack(last)  # type: ignore[arg-type]
        self._pick(out)
        return out

    def decode(self) -> torch.Tensor:
        """One decode step on every request's last token; picks the next tokens.

        Returns:
            ``[bs, vocab]`` float32 logits (an owned copy, kept in :attr:`logits`).
        """
        batch = make_decode_batch(self.cache, self.rows, None, [t[-1] for t in self.tokens])
        # A copy: the next step's replay overwrites a runner's zero-copy output.
        out = self.decode_fn(batch)[: len(self.rows)].clone()
        self._pick(out)
        return out

    def _pick(self, logits: torch.Tensor) -> None:
        self.logits.append(logits)
        nxt = logits.argmax(dim=-1).tolist()
        if not self.tokens:
            self.tokens = [[t] for t in nxt]
        else:
            for seq, t in zip(self.tokens, nxt):
                seq.append(t)

    def close(self) -> None:
        """Free the requests' rows and slots."""
        for r in self.rows:
            self.cache.free_request(r)
        self.rows = []


def greedy_generate(
    model: GraphModel,
    cache: PagedKVCache,
    prompts: Sequence[Sequence[int]],
    steps: int,
    *,
    prefill_fn: Optional[LogitsFn] = None,
    decode_fn: Optional[LogitsFn] = None,
    chunk_size: Optional[int] = None,
) -> List[List[int]]:
    """Greedily generate ``steps`` tokens per prompt (1 from prefill, ``steps - 1`` decodes),
    then free the requests.

    Returns:
        ``[len(prompts)][steps]`` generated token ids.

    Raises:
        ValueError: ``steps < 1`` (and see :meth:`GreedySession.prefill`).
    """
    if steps < 1:
        raise ValueError(f"steps={steps}: must be >= 1")
    session = GreedySession(model, cache, prefill_fn=prefill_fn, decode_fn=decode_fn)
    try:
        session.prefill(prompts, chunk_size=chunk_size)
        for _ in range(steps - 1):
            session.decode()
        return session.tokens
    finally:
        session.close()

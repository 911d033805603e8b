"""Set-up shared by tests that drive the reference model through a runner (CPU or GPU).

The device tests of the core and of every plugin repeat the same steps: build a preset
with a KV cache sized for a few requests, prefill prompts eagerly, then build the next
decode batch of those requests. These helpers are those steps, once; plugin tests use
them too (they cannot import the core's ``tests/``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence, Tuple, Union

import torch

from ..backend.forward_batch import ForwardBatch
from ..reference.batches import (
    GreedySession,
    LogitsFn,
    eager_logits_fn,
    greedy_generate,
    make_decode_batch,
    make_dummy_prompts,
)
from ..reference.kv_cache import PagedKVCache
from ..reference.model import ReferenceLlamaForCausalLM
from ..runner.model_protocol import GraphModel

__all__ = [
    "assert_greedy_tokens_equal_eager",
    "free_requests",
    "next_decode_batch",
    "prefilled_decode_batch",
    "reference_model",
    "staggered_decode_case",
    "staggered_lengths",
]


def reference_model(
    preset: str = "tiny",
    *,
    requests: int,
    context: int = 64,
    dtype: torch.dtype = torch.float32,
    device: Optional[Union[str, torch.device]] = None,
    seed: int = 0,
    tp_group: Any = None,
    num_slots: Optional[int] = None,
    attention: Optional[str] = None,
) -> ReferenceLlamaForCausalLM:
    """The reference model of ``preset`` (random weights) with a KV cache attached as
    ``model.kv_cache``.

    Args:
        requests: how many requests may be live at once (the cache gets one more row:
            row 0 is the reserved padding row).
        context: the longest request, in tokens (``max_context_len``).
        num_slots: KV slots; default ``requests * context + 1`` (every request at full
            length, plus the reserved slot 0).
        device: None (default): ``cuda`` where CUDA is available, else ``cpu``.
        dtype, seed, tp_group, attention: as :meth:`ReferenceLlamaForCausalLM.from_preset`.

    Raises:
        KeyError: ``preset`` is not a preset (the message lists them).
        ValueError: a cache size is too small (see :class:`PagedKVCache`).
    """
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = ReferenceLlamaForCausalLM.from_preset(
        preset, dtype=dtype, device=device, seed=seed, tp_group=tp_group, attention=attention
    )
    slots = num_slots if num_slots is not None else requests * context + 1
    model.create_kv_cache(num_slots=slots, max_reqs=requests + 1, max_context_len=context)
    return model


def staggered_lengths(batch_size: int, shortest: int = 4, spread: int = 5) -> list[int]:
    """Prompt lengths ``shortest + (i % spread)`` for request ``i``: requests of different
    lengths, so attention sees ragged sequences."""
    return [shortest + (i % spread) for i in range(batch_size)]


def next_decode_batch(session: GreedySession) -> ForwardBatch:
    """The DECODE batch of ``session``'s next step: each request's last token, one new KV
    slot per request appended to its row (see :func:`make_decode_batch`).

    Raises:
        CacheFullError: out of slots or context.
    """
    return make_decode_batch(session.cache, session.rows, None, [t[-1] for t in session.tokens])


def prefilled_decode_batch(
    model: GraphModel,
    prompts: Sequence[Sequence[int]],
    *,
    decode_steps: int = 0,
    cache: Optional[PagedKVCache] = None,
) -> Tuple[GreedySession, ForwardBatch]:
    """Prefill ``prompts`` eagerly, run ``decode_steps`` eager decode steps (so requests
    grow further apart), and build the next decode batch.

    Args:
        cache: default ``model.kv_cache``.

    Returns:
        ``(session, batch)``: the caller closes ``session`` (frees the rows) when done;
        ``batch`` holds ``len(prompts)`` requests.
    """
    session = GreedySession(model, cache if cache is not None else model.kv_cache)  # type: ignore[attr-defined]
    with torch.no_grad():
        session.prefill(prompts)
        for _ in range(decode_steps):
            session.decode()
    return session, next_decode_batch(session)


def staggered_decode_case(
    model: Any, batch_size: int, *, seed: int, decode_steps: int = 1
) -> Tuple[GreedySession, ForwardBatch, torch.Tensor]:
    """A decode batch of ``batch_size`` requests of different lengths, and its eager logits.

    Prompts of :func:`staggered_lengths` (4 to 8 tokens) drawn with ``seed`` are prefilled,
    ``decode_steps`` eager decode steps run, then the next decode batch is built.

    Returns:
        ``(session, batch, expected)``: ``expected`` is an owned float32
        ``[batch_size, vocab]`` copy of the eager logits; the caller closes ``session``.
    """
    prompts = make_dummy_prompts(batch_size, staggered_lengths(batch_size), model.config.vocab_size, seed=seed)
    session, batch = prefilled_decode_batch(model, prompts, decode_steps=decode_steps)
    with torch.no_grad():
        expected = eager_logits_fn(model)(batch).clone()
    return session, batch, expected


def free_requests(cache: PagedKVCache, *batches: ForwardBatch) -> None:
    """Free every request row of ``batches`` (made by :func:`make_extend_batch` or
    :func:`make_decode_batch` in ``cache``), with their slots.

    Raises:
        KeyError: a row is already free.
    """
    for batch in batches:
        for row in batch.req_pool_indices.tolist():
            cache.free_request(row)


def assert_greedy_tokens_equal_eager(
    model: Any,
    steps: int,
    *,
    batch_sizes: Sequence[int] = (1, 3, 8),
    prompt_len: int = 12,
    prefill_fn: Optional[LogitsFn] = None,
    decode_fn: Optional[LogitsFn] = None,
    what: str = "",
) -> None:
    """For each batch size, ``steps`` greedy tokens through ``prefill_fn``/``decode_fn``
    (a runner's ``forward``; ``None``: eager) equal eager's tokens, token for token.

    ``model`` has a KV cache attached (``model.kv_cache``) with room for
    ``max(batch_sizes)`` requests of ``prompt_len + steps`` tokens. Prompts are
    :func:`make_dummy_prompts` seeded with the batch size.

    Raises:
        AssertionError: naming ``what`` and the batch size whose tokens differ.
    """
    for bs in batch_sizes:
        prompts = make_dummy_prompts(bs, prompt_len, model.config.vocab_size, seed=bs)
        with torch.no_grad():
            expected = greedy_generate(model, model.kv_cache, prompts, steps)
            got = greedy_generate(model, model.kv_cache, prompts, steps, prefill_fn=prefill_fn, decode_fn=decode_fn)
        assert got == expected, f"{what} bs={bs}"

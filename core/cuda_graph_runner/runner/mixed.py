"""``MixedCudaGraphRunner``: one graph per requests x tokens key, for batches that mix
prefill chunks with decodes.

A continuous-batching engine with chunked prefill runs steps that hold one or more
prefill chunks beside the running requests' decodes. Written as one EXTEND batch, a
decode is a one-token extend over its cached prefix (``extend_seq_lens[i] == 1``,
``extend_prefix_lens[i] == seq_lens[i] - 1``), so the whole step is one forward over
``T`` tokens of ``R`` requests. This runner captures that forward keyed by both axes:
a two-dimensional :class:`~cuda_graph_runner.backend.base.ShapeKey` with ``size`` the
token count and ``requests`` the request slots (vLLM keys its graphs by
``BatchDescriptor(num_reqs, num_tokens, uniform)`` and runs mixed batches in FULL or
PIECEWISE graphs; sglang runs mixed chunked-prefill + decode batches through its
breakable ``MixedCudaGraphRunner``).

Keys and the choice per step:

* the sizes per axis come from the prefill phase's ``mixed_tokens`` and
  ``mixed_requests`` (:meth:`cuda_graph_runner.config.PhaseConfig.mixed_sizes`); a key is
  captured for each pair with ``requests <= tokens`` whose tokens fit ``requests``
  requests of at most the context length (a dummy capture batch must hold them);
* a live batch of ``R`` requests and ``T`` tokens replays the captured key covering it
  (``key.requests >= R`` and ``key.size >= T``) with the fewest padded tokens, then the
  fewest request slots; a batch no key covers runs eagerly, counted under the fallback
  reason ``"no key covers the batch"`` (:mod:`.stats`; :meth:`MixedCudaGraphRunner.decide`).

Padding: the token axis as the prefill runner pads it (token 0 at position 0 into KV
slot 0). Where the graph records attention (``full``) the request axis is a graph input
too, padded with zero-length sentinel requests (request row 0, no tokens, no prefix) on
the device buffers and the host lists alike; a backend that runs attention eagerly at
replay (``breakable``) gets the live request axis, as the prefill runner gives it (its
graphs do not depend on the request count: one request count, ``mixed_requests: [N]``,
is enough there, and its request waste counts 0). The graph
returns ``hidden [key.size, H]``; the LM head runs eagerly on the live rows
(``compute_logits(hidden[:T], live batch)``: one row per live request, a decode's row
being its one token's).

Backends: ``breakable`` (attention runs eagerly at replay on the static batch, whose
request axis is slot-padded) and ``full`` (attention recorded with the rest, so the
model's ``init_forward_metadata_replay`` re-plans it from the slot-padded host lengths
before every replay, as the full prefill graphs do; an attention without such a hook is
refused). Each key's static batch carries the graph variant ``mixed_r<R>``, so a
plan-based attention keeps one plan per key (its per-graph state is keyed by the batch's
token count and graph variant).

The runner reads the prefill phase config (backend, options, ``owned_outputs``,
``verify``...); ``bs``/``max_bs`` and ``full_prefill_max_req`` are the prefill runner's
and are not read here.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Dict, List, Optional, Sequence, Tuple

import torch

from ..backend.base import ShapeKey
from ..backend.buffers import BATCH_AXIS, TOKEN_AXIS, FusedFill
from ..backend.forward_batch import ForwardBatch, ForwardMode, StaticBatchUpdater, StaticForwardBatch, _stored
from ..config import ConfigInput, CudaGraphConfigError
from .base import MAX_REPLAY_PLANS, BaseCudaGraphRunner
from .decision import Decision, EagerDecision, ReplayDecision
from .model_protocol import GraphModel
from .prefill import PrefillCudaGraphRunner
from .stats import (
    REASON_EMPTY,
    REASON_NO_KEY,
    REASON_NOT_CAPTURED_YET,
    REASON_TOO_LARGE,
    REASON_VARIANT,
)

#: ``ShapeKey.variant`` of every mixed key (the request axis is ``ShapeKey.requests``).
MIXED_KEY_VARIANT = "mixed"
#: The graph variant of a key of ``R`` request slots is this prefix then ``R``.
MIXED_VARIANT_PREFIX = "mixed_r"

_TOKEN_FIELDS = (("input_ids", torch.int64), ("positions", torch.int64), ("out_cache_loc", torch.int64))
_REQUEST_FIELDS = (
    ("req_pool_indices", torch.int64),
    ("seq_lens", torch.int32),
    ("extend_seq_lens", torch.int32),
    ("extend_prefix_lens", torch.int32),
)
_HOST_FIELDS = ("seq_lens_cpu", "extend_seq_lens_cpu", "extend_prefix_lens_cpu")


def choose_key(keys: Sequence[ShapeKey], requests: int, tokens: int) -> Optional[ShapeKey]:
    """The key of ``keys`` that covers ``requests`` requests and ``tokens`` tokens with the
    fewest padded tokens, then the fewest request slots; None when none covers both.

    Args:
        keys: two-dimensional keys (``key.requests`` not None; others are skipped).
        requests, tokens: the live batch's axes (>= 1).
    """
    best: Optional[ShapeKey] = None
    for key in keys:
        slots = key.requests
        if slots is None or slots < requests or key.size < tokens:
            continue
        if best is None or (key.size, slots) < (best.size, best.requests or 0):
            best = key
    return best


def variant_label(requests: int) -> str:
    """The graph variant of a key of ``requests`` request slots: ``"mixed_r<requests>"``."""
    return f"{MIXED_VARIANT_PREFIX}{requests}"


class MixedCudaGraphRunner(BaseCudaGraphRunner):
    """Mixed prefill + decode runner: one graph per ``(requests, tokens)`` key; logits
    ``[batch_size, vocab]`` float32 out (see the module docstring).

    A live EXTEND batch (prefill chunks and one-token decodes, any order, any cached
    prefixes) of ``R`` requests and ``T`` tokens is copied into static buffers padded to
    the chosen key ``(R', T')``:

    * ``input_ids``, ``positions``, ``out_cache_loc`` ``[T']`` int64, zeroed tail;
    * (``full``) ``req_pool_indices`` ``[R']`` int64 and ``seq_lens``, ``extend_seq_lens``,
      ``extend_prefix_lens`` ``[R']`` int32, zeroed tail (sentinel requests); the host
      lists ``seq_lens_cpu``, ``extend_seq_lens_cpu``, ``extend_prefix_lens_cpu`` padded
      with zeros to ``R'`` (a live batch without them is read once from the device);
      (``breakable``) the live batch's request fields;
    * the model's ``init_forward_metadata_replay(static_batch)`` then re-plans.

    Outputs follow :class:`BaseCudaGraphRunner`'s contract.

    Args (beyond :class:`BaseCudaGraphRunner`'s):
        max_request_tokens: longest dummy request at capture (the model's context
            length, so its attention can address it). None:
            ``model.kv_cache.max_context_len`` when the model has one, else unbounded.

    Raises:
        ValueError: ``max_request_tokens`` < 1; the model has a data-parallel group (a
            mixed step cannot be padded across ranks on one axis); the model declares
            graph variants (the request axis takes the variant's place).
        CudaGraphConfigError: no key can be captured (every token count needs more
            dummy requests than any request count gives, names ``mixed_requests``); a
            backend that records attention (``full``) with a model whose attention has
            no replay hook for prefill graphs (names the backend).
    """

    phase: ClassVar[str] = "prefill"
    mode: ForwardMode = ForwardMode.EXTEND
    default_max_size: ClassVar[int] = 512

    def __init__(
        self, model: GraphModel, config: ConfigInput = None, *, max_request_tokens: Optional[int] = None, **kwargs: Any
    ) -> None:
        if max_request_tokens is not None and max_request_tokens < 1:
            raise ValueError(f"max_request_tokens={max_request_tokens}: must be >= 1")
        self.max_request_tokens = max_request_tokens
        declared = getattr(model, "graph_variants", None)
        if callable(declared) and declared():
            raise ValueError(
                f"{type(model).__name__} declares graph variants {list(declared())}; the mixed runner keys its "
                "graphs by requests x tokens and captures no model variants: serve mixed steps without variants "
                "(no LoRA adapters) or run them through the prefill and decode runners"
            )
        self._choices: Dict[Tuple[int, int], Optional[ShapeKey]] = {}
        self._choice_basis: List[ShapeKey] = []
        self._token_fills: Dict[Tuple[int, int], FusedFill] = {}
        self._request_fills: Dict[Tuple[int, int], FusedFill] = {}
        self._statics: Dict[ShapeKey, StaticBatchUpdater] = {}
        super().__init__(model, config, **kwargs)
        if self.dp_group is not None and self.dp_group.is_parallel:
            raise ValueError(
                f"the model has a DP group (size {self.dp_group.size}); the mixed runner runs one process's or a "
                "TP group's batches: data-parallel ranks pad a step on one axis only (use the prefill and decode runners)"
            )
        #: The request counts of the keys (ascending) and the largest.
        self.request_sizes: List[int] = self.phase_config.mixed_sizes()[1]
        self.max_requests: int = self.request_sizes[-1]
        if not any(self.size_variants(size) for size in self.capture_sizes):
            raise CudaGraphConfigError(
                f"gives no key that can be captured: {self.capture_sizes} tokens need requests of at most "
                f"{self._request_len_limit()} tokens (the context length) each",
                phase=self.phase,
                key="mixed_requests",
                value=self.phase_config.mixed_requests,
                accepted="request counts large enough to hold the token counts, or smaller mixed_tokens",
                source=self.config.source_of(self.phase, "mixed_requests"),
            )
        #: Whether the request axis is padded to the key's slots: where the graph records
        #: attention (``full``); a backend running it eagerly (``breakable``) gets the live one.
        self.pads_requests: bool = bool(getattr(self.backend, "records_marked_ops", False))
        if self.pads_requests:
            self._check_replay_hook()

    def _check_replay_hook(self) -> None:
        replans = getattr(self.model, "replans_prefill_graphs", None)
        if replans is not False and getattr(self.model, "init_forward_metadata_replay", None) is not None:
            return
        attention = getattr(getattr(self.model, "attn_backend", None), "name", None)
        what = f"attention {attention!r}" if attention else f"model {type(self.model).__name__}"
        raise CudaGraphConfigError(
            f"records attention into each mixed graph, so the attention must update its metadata outside the "
            f"graph (the model's init_forward_metadata_replay hook, with replans_prefill_graphs not False); {what} "
            "has no such update for EXTEND graphs (they would replay the capture's request lengths)",
            phase=self.phase,
            key="backend",
            value=self._backend_label(),
            accepted="an attention whose replay hook re-plans prefill graphs (triton; planned_standin on the CPU), "
            "or prefill backend breakable",
            source=self.config.source_of(self.phase, "backend"),
        )

    # -- keys --------------------------------------------------------------------------
    def get_sizes_to_capture(self) -> List[int]:
        return self.phase_config.mixed_sizes()[0]

    def _request_len_limit(self) -> Optional[int]:
        if self.max_request_tokens is not None:
            return self.max_request_tokens
        limit = getattr(getattr(self.model, "kv_cache", None), "max_context_len", None)
        return int(limit) if limit else None

    def _fits(self, requests: int, tokens: int) -> bool:
        limit = self._request_len_limit()
        return requests <= tokens and (limit is None or requests * limit >= tokens)

    def capture_variants(self) -> Sequence[str]:
        return [variant_label(r) for r in reversed(self.phase_config.mixed_sizes()[1])]

    def size_variants(self, size: int) -> Sequence[str]:
        """The request counts captured at ``size`` tokens, most first: those ``<= size``
        whose requests of at most the context length hold ``size`` tokens."""
        return [variant_label(r) for r in reversed(self.phase_config.mixed_sizes()[1]) if self._fits(r, size)]

    def make_variant_key(self, size: int, variant: str) -> ShapeKey:
        return ShapeKey(size, MIXED_KEY_VARIANT, requests=int(variant[len(MIXED_VARIANT_PREFIX) :]))

    def make_key(self, size: int) -> ShapeKey:
        """The key of ``size`` tokens with the most request slots captured at that size."""
        variants = self.size_variants(size) or self.capture_variants()
        return self.make_variant_key(size, variants[0])

    def capture_keys(self) -> List[ShapeKey]:
        """Every key this runner captures, as :meth:`capture` captures them (largest
        token count first, the most requests first within one)."""
        return [self.make_variant_key(t, v) for t in reversed(self.capture_sizes) for v in self.size_variants(t)]

    def size_of(self, batch: ForwardBatch) -> int:
        return batch.num_tokens

    def batch_matches(self, batch: ForwardBatch) -> bool:
        return batch.forward_mode is ForwardMode.EXTEND

    def key_of(self, batch: ForwardBatch) -> Optional[ShapeKey]:
        """The captured key ``batch`` replays (fewest padded tokens, then fewest request
        slots: :func:`choose_key`), or None when no captured key covers it. Chosen once
        per ``(requests, tokens)`` while the captured keys stay the same."""
        captured = self.captured_keys
        basis = self._choice_basis
        if len(basis) != len(captured) or any(a is not b for a, b in zip(basis, captured)):
            self._choices.clear()
            self._choice_basis = list(captured)
        shape = (int(batch.req_pool_indices.shape[0]), int(batch.input_ids.shape[0]))
        if shape in self._choices:
            return self._choices[shape]
        key = choose_key(captured, *shape)
        if len(self._choices) >= MAX_REPLAY_PLANS:
            self._choices.clear()
        self._choices[shape] = key
        return key

    def decide(self, batch: ForwardBatch) -> Decision:
        """How ``batch`` runs: a :class:`~.decision.ReplayDecision` (tokens, the key's
        tokens, the key) when a captured key covers both its axes and the backend can run
        it, else an :class:`~.decision.EagerDecision` whose reason ``forward`` records:
        ``"disabled"``/``"asleep"``/``"not captured"`` (no graphs), ``"variant not
        captured"`` (not EXTEND, or the backend refuses the key), ``"empty batch"``, ``"too
        large"`` (more tokens than the largest token count), ``"not captured yet"`` (under
        ``capture: eager_first``, a queued token count would cover it), ``"no key covers
        the batch"``."""
        if not self.captured_keys and (self.lazy_capture is None or not self.lazy_capture.pending()):
            return EagerDecision(self._uncaptured_reason())
        if not self.batch_matches(batch):
            return EagerDecision(REASON_VARIANT)
        tokens = batch.num_tokens
        if tokens <= 0:
            return EagerDecision(REASON_EMPTY)
        if tokens > self.max_size:
            return EagerDecision(REASON_TOO_LARGE)
        key = self.key_of(batch)
        if key is None:
            queued = self._queued_cover(batch)
            if queued:
                return EagerDecision(REASON_NOT_CAPTURED_YET, queued)
            return EagerDecision(REASON_NO_KEY if self.captured_keys else self._uncaptured_reason())
        if not self.backend.can_run(batch, key):
            return EagerDecision(REASON_VARIANT)
        return ReplayDecision(tokens, key.size, key, variant_label(key.requests or 0))

    def _queued_cover(self, batch: ForwardBatch) -> int:
        """Under ``capture: eager_first``: the smallest queued token count whose keys would
        cover ``batch`` (0: none), so the batch counts as that size's traffic."""
        lazy = self.lazy_capture
        if lazy is None:
            return 0
        requests, tokens = int(batch.req_pool_indices.shape[0]), batch.num_tokens
        for size in sorted(lazy.pending()):
            if size >= tokens and any(
                self.make_variant_key(size, v).requests >= requests  # type: ignore[operator]
                for v in self.size_variants(size)
            ):
                return size
        return 0

    def fits_graphs(self, batch: ForwardBatch) -> bool:
        return self.key_of(batch) is not None

    def key_for_batch(self, batch: ForwardBatch, padded: int) -> ShapeKey:
        return self.key_of(batch) or self.plain_key(padded)

    # -- buffers and capture -----------------------------------------------------------
    def init_buffers(self) -> None:
        for name, dtype in _TOKEN_FIELDS:
            self.buffers.register(name, axis=TOKEN_AXIS, rows=self.max_size, dtype=dtype, pad_value=0)
        slots = max(self.phase_config.mixed_sizes()[1])
        for name, dtype in _REQUEST_FIELDS:
            self.buffers.register(name, axis=BATCH_AXIS, rows=slots, dtype=dtype, pad_value=0)

    def capture_prepare(self, size: int) -> ForwardBatch:
        return self.capture_prepare_variant(size, (self.size_variants(size) or self.capture_variants())[0])

    def capture_request_lens(self, tokens: int, requests: int) -> List[int]:
        """Lengths of the dummy requests of a ``requests x tokens`` capture: the fewest
        requests of at most the context length, then zero-length sentinels."""
        limit = self._request_len_limit() or tokens
        n = math.ceil(tokens / limit)
        lens = [limit] * (n - 1) + [tokens - limit * (n - 1)]
        return lens + [0] * (requests - n)

    def capture_prepare_variant(self, size: int, variant: str) -> ForwardBatch:
        requests = self.make_variant_key(size, variant).requests
        assert requests is not None
        self.buffers.reset()  # token 0, position 0, slot 0 past the live rows
        lens = self.capture_request_lens(size, requests)
        host = {"seq_lens": lens, "extend_seq_lens": list(lens), "extend_prefix_lens": [0] * requests}
        self.buffers["req_pool_indices"].zero_()  # the reserved dummy row
        for name, values in host.items():
            self.buffers[name][:requests].copy_(torch.tensor(values, dtype=torch.int32))
        for name, _ in _REQUEST_FIELDS:
            self.buffers.slot(name).dirty = self.max_requests  # the next fill pads every row it does not write
        view = self.buffers.view
        return StaticForwardBatch(  # host fields guarded during capture (host_guard)
            forward_mode=ForwardMode.EXTEND,
            input_ids=view("input_ids", size),
            positions=view("positions", size),
            out_cache_loc=view("out_cache_loc", size),
            req_pool_indices=view("req_pool_indices", requests),
            seq_lens=view("seq_lens", requests),
            extend_seq_lens=view("extend_seq_lens", requests),
            extend_prefix_lens=view("extend_prefix_lens", requests),
            seq_lens_cpu=host["seq_lens"],
            extend_seq_lens_cpu=host["extend_seq_lens"],
            extend_prefix_lens_cpu=host["extend_prefix_lens"],
            graph_variant=variant,
        )

    # -- replay ------------------------------------------------------------------------
    def replay_prepare(self, batch: ForwardBatch) -> Tuple[ShapeKey, ForwardBatch]:
        """Copy both axes of ``batch`` into the static buffers padded to its key.

        Returns ``(key, static_batch)``: every token and request field a view of the
        static buffers (``[key.size]`` and ``[key.requests]`` rows), the host lists
        slot-padded, the graph variant the key's, ``extra`` the live batch's.

        Raises:
            ValueError: no captured key covers the batch (``forward`` runs it eagerly);
                an EXTEND batch without ``extend_seq_lens``; a token tensor without
                ``num_tokens`` rows or of another dtype kind than its slot.
        """
        key = self.key_of(batch)
        requests, tokens = int(batch.req_pool_indices.shape[0]), batch.num_tokens
        if key is None:
            raise ValueError(
                f"no captured mixed key covers {requests} requests x {tokens} tokens (captured: "
                f"{[(k.requests, k.size) for k in self.captured_keys]}): forward() runs it eagerly"
            )
        slots = key.requests
        assert slots is not None
        extend = batch.extend_seq_lens
        if extend is None:
            raise ValueError("an EXTEND batch for mixed graphs needs extend_seq_lens")
        prefix = batch.extend_prefix_lens
        if prefix is None:
            prefix = torch.zeros(requests, dtype=torch.int32, device=batch.seq_lens.device)
        self._token_fill(tokens, key.size)((batch.input_ids, batch.positions, batch.out_cache_loc))
        static = self._static(key)(batch)
        if not self.pads_requests:  # attention runs eagerly on the live request axis
            if self._decided is not None:
                self.stats.record_shape(requests, tokens, slots, key.size, requests)
            init = getattr(self.model, "init_forward_metadata_replay", None)
            if init is not None:
                init(static)
            return key, static
        self._request_fill(requests, slots)((batch.req_pool_indices, batch.seq_lens, extend, prefix))
        pad = [0] * (slots - requests)
        for name, device in (
            ("seq_lens_cpu", batch.seq_lens),
            ("extend_seq_lens_cpu", extend),
            ("extend_prefix_lens_cpu", prefix),
        ):
            host = _stored(batch, name)
            if host is None:
                # The replay hook plans from host lengths; a batch built without them costs
                # a sync here rather than a replay of the previous plan.
                host = device.tolist()
            setattr(static, name, [*host, *pad])
        if self._decided is not None:  # a forward() replay: counted on both axes
            self.stats.record_shape(requests, tokens, slots, key.size)
        init = getattr(self.model, "init_forward_metadata_replay", None)
        if init is not None:
            init(static)
        return key, static

    def _token_fill(self, tokens: int, padded: int) -> FusedFill:
        fill = self._token_fills.get((tokens, padded))
        if fill is None:
            if len(self._token_fills) >= MAX_REPLAY_PLANS:
                self._token_fills.clear()
            names = [name for name, _ in _TOKEN_FIELDS]
            fill = self._token_fills[(tokens, padded)] = FusedFill(self.buffers, names, [tokens] * 3, [padded] * 3)
        return fill

    def _request_fill(self, requests: int, slots: int) -> FusedFill:
        fill = self._request_fills.get((requests, slots))
        if fill is None:
            names = [name for name, _ in _REQUEST_FIELDS]
            fill = self._request_fills[(requests, slots)] = FusedFill(self.buffers, names, [requests] * 4, [slots] * 4)
        return fill

    def _static(self, key: ShapeKey) -> StaticBatchUpdater:
        update = self._statics.get(key)
        if update is None:
            slots = key.requests
            assert slots is not None
            view = self.buffers.view
            fields: Dict[str, Any] = {name: view(name, key.size) for name, _ in _TOKEN_FIELDS}
            keep = {*fields, "graph_variant", "forward_mode"}
            if self.pads_requests:
                fields.update({name: view(name, slots) for name, _ in _REQUEST_FIELDS})
                keep |= {*fields, *_HOST_FIELDS}
            else:  # request fields None here: each live batch's own
                fields.update({name: None for name, _ in _REQUEST_FIELDS[:2]})
            static = StaticForwardBatch(forward_mode=ForwardMode.EXTEND, graph_variant=variant_label(slots), **fields)
            update = self._statics[key] = StaticBatchUpdater(static, keep=keep)
        return update

    # An EXTEND batch's outputs as the prefill runner makes them: the graph returns the
    # hidden states of every padded token, the live tokens' logits are computed after it.
    graph_forward = PrefillCudaGraphRunner.graph_forward
    finish_output = PrefillCudaGraphRunner.finish_output
    eager_forward = PrefillCudaGraphRunner.eager_forward

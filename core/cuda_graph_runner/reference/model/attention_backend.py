"""The attention-backend interface of the reference model, in the shape of sglang's
``AttentionBackend`` (``python/sglang/srt/layers/attention/base_attn_backend.py``).

A backend owns how attention is computed and what it must prepare on the host first.
Real kernels are *planned*: FlashInfer's decode and prefill wrappers compute their
index and length tables on the host (``plan()``) from the live lengths, before every
eager forward, before a size is captured and again before **every replay** of it
(sglang: ``init_forward_metadata``, ``init_forward_metadata_capture_cuda_graph``,
``init_forward_metadata_replay_cuda_graph``). The model forwards the runner's hooks
(:mod:`cuda_graph_runner.runner.model_protocol`) to its backend:

===============================================  ==============================================
model hook (called by the runner)                backend method
===============================================  ==============================================
``init_forward_metadata(batch)``                 :meth:`AttentionBackend.init_forward_metadata`
                                                 (before every eager forward of the runner)
``init_forward_metadata_capture(batch)``         :meth:`~AttentionBackend.init_forward_metadata_capture_cuda_graph`
                                                 (a capture's static batch, before its warm-ups;
                                                 per-size state from :meth:`~AttentionBackend.init_cuda_graph_state`
                                                 when absent)
``init_forward_metadata_replay(batch)``          :meth:`~AttentionBackend.init_forward_metadata_replay_cuda_graph`
                                                 (the static batch, before every replay)
``cleanup_cuda_graph_state(mode)``               :meth:`~AttentionBackend.cleanup_cuda_graph_state`
                                                 (the runner's ``cleanup()``, so also recapture)
``get_cuda_graph_seq_len_fill_value()``          :meth:`~AttentionBackend.get_cuda_graph_seq_len_fill_value`
                                                 (``seq_lens`` of padded requests, host and device)
===============================================  ==============================================

A backend that plans nothing (:attr:`AttentionBackend.plans` False, as ``torch``) gets
none of the three metadata hooks: the model exposes them as ``None``, so the runner's
replay path costs one ``None`` check.

Backends by name (:data:`ATTENTION_BACKENDS`), chosen when the model is built
(``ReferenceLlamaForCausalLM(..., attention="torch")``, ``bench --attention``,
``benchmarks/run.py --attention``):

* ``torch`` (:class:`TorchAttention`): the readable baseline and the CPU path: plain
  PyTorch over the paged KV cache (:mod:`.attention`). It is the default on every
  device, CUDA included (:data:`DEFAULT_ATTENTION`), until a kernel backend replaces it
  on CUDA with the baseline re-measured.
* ``planned_standin`` (:class:`~cuda_graph_runner.reference.model.planned_standin.PlannedAttentionStandIn`):
  a CPU **stand-in** of a plan-based attention, not a kernel: it records every plan and
  fails a forward that runs unplanned or with a stale plan (tests and the conformance kit).
* ``triton`` (:class:`~cuda_graph_runner.reference.model.triton_attention.TritonAttention`):
  Triton paged kernels (split-KV decode, extend) on CUDA; needs the optional ``triton``
  package (``cuda-graph-runner[triton]``).
* ``flashinfer`` / ``flashinfer_tc`` (:class:`~cuda_graph_runner.reference.model.flashinfer_attention.FlashInferAttention`):
  FlashInfer's paged wrappers on CUDA, planned before every forward and replay
  (``flashinfer_tc``: the tensor-core decode); needs ``cuda-graph-runner[flashinfer]``.
"""

from __future__ import annotations

import abc
from typing import Any, Callable, ClassVar, Dict, List, Optional

import torch

from ...backend.forward_batch import ForwardBatch, ForwardMode
from ..kv_cache import PagedKVCache
from .attention import AttentionCall, _decode_attention, _extend_attention, reference_llama_attention

#: The attention a model gets when none is named, on every device (CUDA included).
DEFAULT_ATTENTION = "torch"


class AttentionBackend(abc.ABC):
    """What the reference model's attention layers call, and what the runner's hooks reach.

    Attributes:
        name: the backend's name in :data:`ATTENTION_BACKENDS`.
        plans: True for a backend that prepares metadata on the host before forwards; the
            model then forwards the runner's metadata hooks to it (else it exposes them
            as None and the runner skips them).
        replans_prefill_graphs: True for a backend whose replay hook re-plans a recorded
            extend (prefill) forward, so a whole-forward prefill graph (prefill ``full``)
            replays with the live requests' lengths; the model exposes it to the runner
            (:mod:`cuda_graph_runner.runner.model_protocol`). False (default): its extend reads
            the capture's lengths, so prefill ``full`` is refused.

    Per-size state (:meth:`init_cuda_graph_state`) is keyed by the static batch's graph
    key (:func:`graph_key`): the capture hook may run more than once for one key (once
    per size x variant per capture, again when a backend asks the capture plan for a
    static batch, again after a recapture), so a backend builds the state only when it
    is absent and re-plans into the same buffers otherwise: a graph reads the addresses
    it was recorded with.
    """

    name: ClassVar[str] = ""
    plans: ClassVar[bool] = False
    replans_prefill_graphs: ClassVar[bool] = False

    # -- host metadata ------------------------------------------------------------------
    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        """Prepare an eager forward of ``batch`` (a live batch; host lengths readable)."""
        return None  # nothing to plan (torch)

    def init_cuda_graph_state(self, batch: ForwardBatch) -> Any:
        """Build the per-size state of ``batch``'s graph key (buffers at stable addresses
        that the captured kernels read); called by the capture hook only when absent.
        Default: None (no state)."""
        return None

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        """Plan a capture's static dummy batch ``batch`` (before its warm-ups)."""
        return None  # nothing to plan (torch)

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        """Re-plan from the static ``batch`` about to be replayed, from its host lengths
        only (``seq_lens_cpu``, padded by the runner with
        :meth:`get_cuda_graph_seq_len_fill_value`; never a read of a device tensor, so
        replay stays free of host syncs), into the per-size state's buffers in place."""
        return None  # nothing to plan (torch)

    def cleanup_cuda_graph_state(self, mode: Optional[ForwardMode] = None) -> None:
        """Drop the per-size state of graphs of ``mode`` (None: all), on the runner's
        ``cleanup()`` and before a recapture."""
        return None  # nothing to plan (torch)

    def attach_kv_cache(self, cache: Optional[PagedKVCache]) -> None:
        """``cache`` becomes the model's KV cache (a
        :class:`~cuda_graph_runner.reference.kv_cache.PagedKVCache`, or None: detached);
        called by the model at every assignment of its ``kv_cache``
        (:func:`attached_kv_cache`), so a backend whose hooks index ``req_to_token`` before
        the next forward's layers run plans over the new table, never the previous
        cache's. Default: nothing (the layers pass the table to every forward)."""
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """``seq_lens`` of a padded request in a decode graph (sglang's fill value; >= 1
        so a padded row attends to one key instead of none)."""
        return 1

    # -- forwards -----------------------------------------------------------------------
    @abc.abstractmethod
    def forward(
        self,
        output: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        scaling: float,
        sliding_window: int,
        last_layer: bool,
    ) -> None:
        """One layer's attention over the live batch (``get_forward_batch()``), written
        into ``output``; the arguments are :func:`.attention.reference_llama_attention`'s.
        A backend calls its marked eager op (:mod:`cuda_graph_runner.backend.graph_break`) here,
        whose body dispatches to :meth:`forward_decode` or :meth:`forward_extend` by the
        batch's forward mode."""

    def forward_decode(self, call: AttentionCall, last_layer: bool) -> None:
        """DECODE / TARGET_VERIFY / DLLM_EXTEND attention (fixed width per request)."""
        _decode_attention(call, last_layer)

    def forward_extend(self, call: AttentionCall) -> None:
        """EXTEND (prefill) attention, request by request."""
        _extend_attention(call)


class TorchAttention(AttentionBackend):
    """``torch``: plain PyTorch attention (the marked op
    ``cuda_graph_runner::reference_llama_attention``), planning nothing: decode reads only
    device tensors (capture-safe), extend loops over requests with the host lengths."""

    name = "torch"
    plans = False

    def forward(
        self,
        output: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        scaling: float,
        sliding_window: int,
        last_layer: bool,
    ) -> None:
        reference_llama_attention(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, last_layer)


def attached_kv_cache() -> Any:
    """A model's ``kv_cache`` property that tells the model's ``attn_backend`` of every
    assignment (:meth:`AttentionBackend.attach_kv_cache`): ``create_kv_cache``,
    ``attach_kv_cache`` and a plain ``model.kv_cache = cache`` alike; ``del`` detaches
    (it reads None after). The value lives in ``_kv_cache``; the owner sets
    ``attn_backend`` before its first assignment. A property, which Dynamo inlines."""

    def get(model: Any) -> Optional[PagedKVCache]:
        return model._kv_cache

    def set_(model: Any, cache: Optional[PagedKVCache]) -> None:
        object.__setattr__(model, "_kv_cache", cache)
        model.attn_backend.attach_kv_cache(cache)

    def delete(model: Any) -> None:
        set_(model, None)

    return property(get, set_, delete, "the attached KV cache, or None")


def graph_key(batch: ForwardBatch) -> tuple:
    """The per-size state key of a static ``batch``: ``(mode, num_tokens_per_req, rows,
    graph_variant)``, rows = requests for decode-like modes, tokens for EXTEND."""
    mode = batch.forward_mode
    rows = batch.req_pool_indices.shape[0] if mode.is_decode_like() else batch.input_ids.shape[0]
    return (mode, batch.num_tokens_per_req, int(rows), batch.graph_variant)


def _standin() -> AttentionBackend:
    from .planned_standin import PlannedAttentionStandIn

    return PlannedAttentionStandIn()


def _triton() -> AttentionBackend:
    from .triton_attention import make_triton_attention

    return make_triton_attention()


def _flashinfer() -> AttentionBackend:
    from .flashinfer_attention import make_flashinfer_attention

    return make_flashinfer_attention()


def _flashinfer_tc() -> AttentionBackend:
    from .flashinfer_attention import make_flashinfer_attention

    return make_flashinfer_attention(use_tensor_cores=True)


#: Attention backends by name: a factory ``() -> AttentionBackend`` each (one instance per model).
ATTENTION_BACKENDS: Dict[str, Callable[[], AttentionBackend]] = {
    "torch": TorchAttention,
    "planned_standin": _standin,
    "triton": _triton,
    "flashinfer": _flashinfer,
    "flashinfer_tc": _flashinfer_tc,
}


def attention_backend_names() -> List[str]:
    """The names :func:`make_attention_backend` accepts, sorted."""
    return sorted(ATTENTION_BACKENDS)


def make_attention_backend(name: Optional[str] = None) -> AttentionBackend:
    """A new attention backend ``name`` (None: :data:`DEFAULT_ATTENTION`), for one model.

    Raises:
        ValueError: an unknown name (lists the accepted ones).
    """
    chosen = DEFAULT_ATTENTION if name is None else name
    factory = ATTENTION_BACKENDS.get(chosen) if isinstance(chosen, str) else None
    if factory is None:
        raise ValueError(
            f"attention={name!r} is not an attention backend; accepted: {', '.join(attention_backend_names())}"
        )
    return factory()

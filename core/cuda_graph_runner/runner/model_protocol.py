"""The model a runner drives, as ``typing.Protocol`` classes (structural: no base class to
inherit, a ``torch.nn.Module`` with these methods is one).

Required (:class:`GraphModel`): ``forward(batch) -> hidden`` (``[num_tokens, hidden]``,
or any structure of tensors :mod:`cuda_graph_runner.backend.nested` accepts) and
``compute_logits(hidden, batch) -> logits`` (``[rows, vocab]`` float32: one row per token
for decode, per request for prefill).

Rows must be independent: every output row may depend on its own token (decode) or its
own request (prefill: the tokens of that request, through attention) and the weights, never
on other rows of the batch. A replay runs the batch padded with dummy requests and tokens
(request row 0, KV slot 0) up to a captured size, so an op across the batch's rows (a mean
or a norm over the batch, batch statistics, a softmax over requests) mixes padded rows
into live ones and returns other values than eager, without an error; verify mode
(:mod:`cuda_graph_runner.runner.verify`) reports it.

Optional, each looked up with ``getattr`` by the runner and skipped when absent or None
(the sglang model runner's attention-backend hooks, moved onto the model; a model whose
attention plans nothing leaves them None, so the replay path pays one None check):

* :class:`SupportsEagerMetadata`: ``init_forward_metadata(batch)``, called on the live
  batch before every eager forward the runner runs (the eager fallback, verify mode's
  reference); the testing helpers' eager forwards call it too;
* :class:`SupportsCaptureMetadata`: ``init_forward_metadata_capture(batch)``, called on
  each capture's static dummy batch before its warm-ups (which, with the recorded run,
  use what it planned): at least once per size x variant per capture, and again when a
  backend asks the capture plan for that static batch (a compile pass) and after a
  recapture, so it builds per-size state only when absent and re-plans into the same
  buffers otherwise (the graph reads the addresses it recorded);
* :class:`SupportsReplayMetadata`: ``init_forward_metadata_replay(batch)``, called on the
  static batch before each replay (after the live batch was copied in). Decode
  guarantees ``batch.seq_lens_cpu``: the live host lengths padded to the captured batch
  size with the runner's ``seq_len_fill_value`` (None only when the live batch has
  none); prefill's request fields are the live batch's own (the padded tail tokens
  belong to no request). A plan-based attention (FlashInfer's ``plan()``) plans from
  these host values only, never by reading device tensors, so replay stays free of host
  syncs; it is capture-safe only together with this hook (:mod:`cuda_graph_runner.backend.graph_break`);
* ``replans_prefill_graphs`` (an optional bool attribute): False says the replay hook
  re-plans decode graphs only, so a whole-forward prefill graph (prefill ``full``, which
  records the attention) is refused for this model; absent, the hook's presence decides;
* :class:`SupportsGraphStateCleanup`: ``cleanup_cuda_graph_state(mode)``, called by the
  runner's ``cleanup()`` (and so before a recapture) with the runner's forward mode: drop
  the per-size state of that mode's graphs;
* :class:`SupportsSeqLenFillValue`: ``get_cuda_graph_seq_len_fill_value()``, the decode
  runner's ``seq_len_fill_value`` when none is given (sglang's attention-backend fill value);
* :class:`SupportsPostWarmupHook`: ``post_warmup_hook()``, called after a size's warm-ups
  and before it is recorded (undo what warm-ups changed);
* attributes ``tp_group`` (a :class:`cuda_graph_runner.runner.distributed.TPGroup`: ranks capture
  and decide in step), ``dp_group`` (a :class:`cuda_graph_runner.runner.dp_group.DPGroup`:
  ranks capture in step and every step is padded to the largest rank's batch) and ``kv_cache`` (whose ``max_context_len`` bounds prefill's dummy
  requests), and ``parameters()``/``buffers()`` (the device when none is given).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from ..backend.forward_batch import ForwardBatch, ForwardMode


class GraphModel(Protocol):
    """What every runner needs of a model. See the module docstring for shapes and for
    the one rule a model must keep: rows independent of each other (padded rows must
    not change live ones)."""

    def forward(self, batch: ForwardBatch) -> Any:
        """The model body on ``batch``: hidden states ``[num_tokens, hidden]``."""
        ...

    def compute_logits(self, hidden: Any, batch: ForwardBatch) -> Any:
        """The LM head on ``hidden`` for ``batch``: logits ``[rows, vocab]`` float32."""
        ...


@runtime_checkable
class SupportsEagerMetadata(Protocol):
    """Optional: attention metadata for an eager forward of a live batch."""

    def init_forward_metadata(self, batch: ForwardBatch) -> None: ...


@runtime_checkable
class SupportsCaptureMetadata(Protocol):
    """Optional: attention metadata for a capture's static dummy batch."""

    def init_forward_metadata_capture(self, batch: ForwardBatch) -> None: ...


@runtime_checkable
class SupportsReplayMetadata(Protocol):
    """Optional: attention metadata for the static batch about to be replayed."""

    def init_forward_metadata_replay(self, batch: ForwardBatch) -> None: ...


@runtime_checkable
class SupportsPostWarmupHook(Protocol):
    """Optional: called once a size's warm-ups ran, before it is recorded."""

    def post_warmup_hook(self) -> None: ...


@runtime_checkable
class SupportsGraphStateCleanup(Protocol):
    """Optional: drop the model's per-size state of graphs of ``mode`` (the runner's cleanup)."""

    def cleanup_cuda_graph_state(self, mode: ForwardMode) -> None: ...


@runtime_checkable
class SupportsSeqLenFillValue(Protocol):
    """Optional: ``seq_lens`` of padded decode requests (the decode runner's default)."""

    def get_cuda_graph_seq_len_fill_value(self) -> int: ...

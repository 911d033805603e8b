"""The model a runner drives, as ``typing.Protocol`` classes (structural: no base class to
inherit, a ``torch.nn.Module`` with these methods is one).

Required (:class:`GraphModel`): ``forward(batch) -> hidden`` (``[num_tokens, hidden]``,
or any structure of tensors :mod:`cuda_graph_runner.nested` accepts) and
``compute_logits(hidden, batch) -> logits`` (``[rows, vocab]`` float32: one row per token
for decode, per request for prefill).

Rows must be independent: every output row may depend on its own token (decode) or its
own request (prefill: the tokens of that request, through attention) and the weights, never
on other rows of the batch. A replay runs the batch padded with dummy requests and tokens
(request row 0, KV slot 0) up to a captured size, so an op across the batch's rows (a mean
or a norm over the batch, batch statistics, a softmax over requests) mixes padded rows
into live ones and returns other values than eager, without an error; verify mode
(:mod:`cuda_graph_runner.verify`) reports it.

Optional, each looked up with ``getattr`` by the runner and skipped when absent (the
sglang model runner's attention-backend hooks, moved onto the model):

* :class:`SupportsCaptureMetadata`: ``init_forward_metadata_capture(batch)``, called on
  each capture's static dummy batch before its warm-ups;
* :class:`SupportsReplayMetadata`: ``init_forward_metadata_replay(batch)``, called on the
  static batch before each replay (after the live batch was copied in);
* :class:`SupportsPostWarmupHook`: ``post_warmup_hook()``, called after a size's warm-ups
  and before it is recorded (undo what warm-ups changed);
* attributes ``tp_group`` (a :class:`cuda_graph_runner.distributed.TPGroup`: ranks capture
  and decide in step) and ``kv_cache`` (whose ``max_context_len`` bounds prefill's dummy
  requests), and ``parameters()``/``buffers()`` (the device when none is given).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from .forward_batch import ForwardBatch


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

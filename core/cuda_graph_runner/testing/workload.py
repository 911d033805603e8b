"""The reference workload for a backend plugin's tests: runners, config, models, KV cache, batches, registry.

For plugin authors. A plugin's code imports the core through :mod:`cuda_graph_runner.backend`
only; its tests import that and :mod:`cuda_graph_runner.testing`, and this module is the
part of ``testing`` that drives a backend the way an engine does: build the reference model
with a KV cache, make batches, run them through a runner on the plugin's backend and
compare with eager. Each name is the core's object itself (not a copy or a wrapper),
loaded on first use: importing this module imports no torch, and a test that reads only
registry names loads neither the runners nor the reference model.

Runners (``Runner(model, config=None, *, backend=None, show_progress=None, ...)``;
``config``: a :class:`CudaGraphConfig`, a dict of its file form, or ``None``; ``capture()``,
then ``forward(batch)``, then ``cleanup()``):

* :class:`DecodeCudaGraphRunner`: DECODE / TARGET_VERIFY batches, one graph per batch size;
  float32 logits ``[num_tokens, vocab]`` (a replay may carry padded rows past the batch's);
* :class:`PrefillCudaGraphRunner`: EXTEND batches, one graph per token count; float32
  logits ``[bs, vocab]`` (each request's last token);
* :class:`MixedCudaGraphRunner`: one EXTEND step of prefill chunks and one-token decodes
  together, one graph per ``(requests, tokens)`` key; float32 logits ``[bs, vocab]``.

Config: :class:`CudaGraphConfig` (the whole config: ``from_dict``, ``validate``),
:class:`PhaseConfig` (one phase's: ``backend``, ``bs``, ``max_bs``, ``torch_compile``, ...)
and :class:`CudaGraphConfigError` (a value is refused; the message names it and what is
accepted).

Reference model:

* :class:`ReferenceLlamaForCausalLM`: a Llama-style model with the runner's model protocol;
  ``from_preset(name, **options)`` gives random weights (``options``: ``dtype``, ``device``,
  ``seed``, ``std``, ``tp_group``, ``attention``; by default float32 on the CPU, seed 0, std
  0.02, ``torch`` attention);
  ``create_kv_cache(num_slots=, max_reqs=, max_context_len=)`` attaches ``model.kv_cache``;
* :class:`ModelConfig`: its shape (``vocab_size``, ``hidden_size``, ``num_hidden_layers``, ...);
* ``PRESETS``: preset name (``"tiny"``, ``"llama-3.2-1b"``, ...) -> :class:`ModelConfig`.

KV cache: :class:`PagedKVCache`, the paged cache the model reads and writes: request row 0
and KV slot 0 are reserved for padding; ``req_to_token`` ``[max_reqs, max_context_len]``
int64 maps a request's positions to slots; ``k_buffers`` / ``v_buffers``: per layer
``[num_slots, num_kv_heads, head_dim]``.

Batches (each batch on the cache's device; token ids, positions and slots int64, lengths
int32):

* :func:`make_dummy_prompts` ``(batch_size, length, vocab_size, seed=0)``: reproducible
  random prompts, ``List[List[int]]`` of ids in ``[1, vocab_size)``; ``length`` is one
  length for all or a list of one per prompt;
* :func:`make_extend_batch` ``(cache, token_lists, *, rows=None)``: an EXTEND batch,
  ``input_ids`` ``[num_tokens]``; ``rows`` continues existing requests (chunked prefill);
* :func:`make_decode_batch` ``(cache, rows, seq_lens, next_tokens)``: a DECODE batch
  (``next_tokens`` ``[bs]``) or TARGET_VERIFY (``[bs][w]``); ``seq_lens`` (``Optional``):
  each request's KV length before this step, checked against the cache, or ``None`` to
  read it from the cache;
* :func:`eager_logits_fn` ``(model)``: ``batch -> float32 logits`` of the eager forward
  (``LogitsFn``), what a runner's output is compared with;
* :class:`GreedySession` ``(model, cache, *, prefill_fn=None, decode_fn=None)``: greedy
  decoding one step at a time (``prefill(prompts)``, ``decode()``, ``close()``; ``rows``,
  ``tokens``, ``logits``);
* :func:`greedy_generate` ``(model, cache, prompts, steps, *, prefill_fn=None,
  decode_fn=None)``: ``[len(prompts)][steps]`` greedy token ids.

Hugging Face adapter (:mod:`cuda_graph_runner.reference.models.hf`; needs ``pip install
'cuda-graph-runner[transformers]'``): reading a name loads the adapter module (and torch) but
not transformers, which is imported when a config or model is built; without it that call
raises ``TransformersUnavailableError`` with the install line (a test skips first with
``pytest.importorskip("transformers", reason=...)``):

* :class:`HFCausalLM`: a transformers causal LM (Llama, Qwen2, Mistral, Qwen3) with the
  runner's model protocol; ``HFCausalLM.from_config(config, *, dtype=torch.float32,
  device="cpu", seed=0, std=None, attention=None)`` gives random weights (``config``: a
  transformers config or an architecture name), ``create_kv_cache(num_slots, max_reqs,
  max_context_len)`` attaches ``model.kv_cache`` (a :class:`PagedKVCache`); a forward gives
  float32 logits as :class:`ReferenceLlamaForCausalLM`'s;
* :func:`builtin_config` ``(arch, *, size="tiny")``: a transformers config of ``arch``
  (``"llama"``, ``"qwen2"``, ``"mistral"``, ``"qwen3"``) shaped as ``size``; an unknown
  ``arch`` raises ``UnsupportedHFModelError``, an unknown ``size`` ``ValueError``;
* :func:`eager_reference` ``(adapter, attn_implementation="eager")``: an independent
  transformers model with the adapter's config and weights on transformers' own attention
  (``generate()`` of it is what the adapter's greedy tokens are compared with).

Registry (a backend's class is imported only when it is resolved or checked):

* :func:`list_backends` ``(device_type=None)``: one ``BackendEntry`` per registered backend
  (``name``, ``distribution``, ``status``, ``ok``, ``reason``, ``spec``);
* :func:`resolve_decode_backend` / :func:`resolve_prefill_backend` ``(config=None, *,
  device=None)``: the backend instance a config (or a backend name) selects, as a runner
  gets it;
* :func:`get_registry`: the process's registry (``names()``, ``default_backend(phase,
  device_type)``, ``pm``: its pluggy manager);
* :func:`reset_registry` ``(*, keep_in_process=True)``: scan the entry points again (what a
  test that changes ``CUDA_GRAPH_RUNNER_*`` variables or installs a plugin calls);
* :func:`check_backend_class` ``(cls, name="?")``: the backend contract checks of a class
  (raises :class:`~cuda_graph_runner.backend.BackendContractError` naming every problem).

Prepared set-ups built from these (a model with its cache, prefilled decode batches, the
greedy-tokens check) are in :mod:`cuda_graph_runner.testing.reference_setup`; toy models,
fakes and emulated graphs for CPU runs in the other ``testing`` modules; the conformance
kit in :mod:`cuda_graph_runner.testing.conformance`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Dict, List

if TYPE_CHECKING:  # what type checkers see; at run time each name is loaded on first use
    from ..config import CudaGraphConfig, CudaGraphConfigError, PhaseConfig
    from ..reference.batches import (
        GreedySession,
        LogitsFn,
        eager_logits_fn,
        greedy_generate,
        make_decode_batch,
        make_dummy_prompts,
        make_extend_batch,
    )
    from ..reference.kv_cache import PagedKVCache
    from ..reference.model import PRESETS, ModelConfig, ReferenceLlamaForCausalLM
    from ..reference.models.hf import HFCausalLM, builtin_config, eager_reference
    from ..registry import (
        check_backend_class,
        get_registry,
        list_backends,
        reset_registry,
        resolve_decode_backend,
        resolve_prefill_backend,
    )
    from ..runner import DecodeCudaGraphRunner, MixedCudaGraphRunner, PrefillCudaGraphRunner

#: public name -> the module (relative to the package ``cuda_graph_runner``) it is read from
_SOURCES: Dict[str, str] = {
    "DecodeCudaGraphRunner": "runner",
    "PrefillCudaGraphRunner": "runner",
    "MixedCudaGraphRunner": "runner",
    "CudaGraphConfig": "config",
    "PhaseConfig": "config",
    "CudaGraphConfigError": "config",
    "ReferenceLlamaForCausalLM": "reference.model",
    "ModelConfig": "reference.model",
    "PRESETS": "reference.model",
    "PagedKVCache": "reference.kv_cache",
    "make_dummy_prompts": "reference.batches",
    "make_extend_batch": "reference.batches",
    "make_decode_batch": "reference.batches",
    "eager_logits_fn": "reference.batches",
    "LogitsFn": "reference.batches",
    "GreedySession": "reference.batches",
    "greedy_generate": "reference.batches",
    "HFCausalLM": "reference.models.hf",
    "builtin_config": "reference.models.hf",
    "eager_reference": "reference.models.hf",
    "list_backends": "registry",
    "resolve_decode_backend": "registry",
    "resolve_prefill_backend": "registry",
    "get_registry": "registry",
    "reset_registry": "registry",
    "check_backend_class": "registry",
}

__all__ = [
    "CudaGraphConfig",
    "CudaGraphConfigError",
    "DecodeCudaGraphRunner",
    "GreedySession",
    "HFCausalLM",
    "LogitsFn",
    "MixedCudaGraphRunner",
    "ModelConfig",
    "PRESETS",
    "PagedKVCache",
    "PhaseConfig",
    "PrefillCudaGraphRunner",
    "ReferenceLlamaForCausalLM",
    "builtin_config",
    "check_backend_class",
    "eager_logits_fn",
    "eager_reference",
    "get_registry",
    "greedy_generate",
    "list_backends",
    "make_decode_batch",
    "make_dummy_prompts",
    "make_extend_batch",
    "reset_registry",
    "resolve_decode_backend",
    "resolve_prefill_backend",
]


def __getattr__(name: str) -> Any:
    source = _SOURCES.get(name)
    if source is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}; it provides {', '.join(__all__)}")
    value = getattr(importlib.import_module(f"cuda_graph_runner.{source}"), name)
    globals()[name] = value  # later reads skip __getattr__
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(__all__))

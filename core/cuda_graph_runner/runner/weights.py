"""The storage of a model's weights at capture, and the check that graphs still read it.

A captured graph reads its parameters (and the buffers its forward reads, such as a
rotary cos/sin cache) at the device addresses they had when it was recorded. An update
in place (``param.copy_(new)``, ``load_state_dict(sd)`` without ``assign``) writes into
that memory: every replay sees the new values. Anything that gives a parameter new
memory leaves the graph reading the old one, silently: ``load_state_dict(sd,
assign=True)``, ``module.weight = nn.Parameter(new)``, ``param.data = new``, a module
rebuilt or reloaded, ``model.to(...)``/``half()`` that casts.

A :class:`WeightsFingerprint` is what a graph reads of each named tensor: its data
pointer, shape, stride and dtype (the data pointer already includes the storage offset),
and its device, for every parameter and buffer and the tensors of the model's KV cache.
It leaves out the version counter on purpose: an in-place update bumps it and keeps the
graph valid. Taking one walks ``named_parameters()`` and ``named_buffers()``; a check
compares one tuple built from a walk of the modules' own dicts (about 1 µs per tensor on
the host, no device work) and works the names out only when they differ.

Idea: the loops of RL trainers on vLLM and sglang (verl, slime, NeMo-RL), which load new
weights into a sleeping or running engine between rollouts.
"""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ..backend.errors import CudaGraphRunnerError

#: What a graph reads of one tensor: (data_ptr, shape, stride, dtype, device).
Entry = Tuple[Any, ...]

#: Most changed tensors named in one error (the rest are counted).
MAX_NAMED = 8


class StaleWeightsError(CudaGraphRunnerError, RuntimeError):
    """Parameters or buffers of the model live elsewhere than where the captured graphs
    read them: a replay would compute with the old weights.

    Attributes:
        changed: names whose storage moved (re-assigned, reloaded, cast).
        missing: names the captured graphs read that the model lacks.
        added: names the model has now and did not have at capture.
        phase: the runner's phase.
    """

    def __init__(
        self, message: str, *, changed: List[str], missing: List[str], added: List[str], phase: str = ""
    ) -> None:
        super().__init__(message)
        self.changed = changed
        self.missing = missing
        self.added = added
        self.phase = phase


def named_weight_tensors(model: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    """``model``'s parameters, then its buffers, by name (``named_parameters()`` and
    ``named_buffers()`` where the model has them; a model with only ``parameters()``
    gets names ``"parameters[i]"``), then the tensors of its ``kv_cache`` when that is
    not a module (the tensor attributes of the cache object and the tensors of its list
    attributes: ``"kv_cache.k_buffers[0]"``, ``"kv_cache.req_to_token"``): a graph reads
    the cache's buffers at their capture addresses too. A model with none yields nothing."""
    found = False
    for attr in ("named_parameters", "named_buffers"):
        fn = getattr(model, attr, None)
        if callable(fn):
            found = True
            for name, tensor in fn():
                if isinstance(tensor, torch.Tensor):
                    yield (("buffer " if attr == "named_buffers" else "") + name, tensor)
    if not found:
        fn = getattr(model, "parameters", None)
        if callable(fn):
            for i, tensor in enumerate(fn()):
                if isinstance(tensor, torch.Tensor):
                    yield f"parameters[{i}]", tensor
    cache = getattr(model, "kv_cache", None)
    if cache is not None and not isinstance(cache, torch.nn.Module):
        yield from _cache_tensors(cache)


def _cache_tensors(cache: Any) -> Iterator[Tuple[str, torch.Tensor]]:
    try:
        fields = sorted(vars(cache).items())
    except TypeError:  # no __dict__ (slots, a C type): nothing to walk
        return
    for name, value in fields:
        if isinstance(value, torch.Tensor):
            yield f"kv_cache.{name}", value
        elif isinstance(value, (list, tuple)) and value and isinstance(value[0], torch.Tensor):
            # Only lists that hold tensors (not a free list of ints, which can be long).
            for i, tensor in enumerate(value):
                if isinstance(tensor, torch.Tensor):
                    yield f"kv_cache.{name}[{i}]", tensor


def _fast_entries(model: Any) -> Optional[Tuple[Entry, ...]]:
    """The entries of every parameter and buffer of an ``nn.Module`` ``model`` and its KV
    cache, in a fixed order but without names (a shared tensor once per holder), or None
    for a model that is not a module. The comparison of every check: names are only
    worked out (:func:`named_weight_tensors`) when these differ, and walking the modules'
    dicts directly costs a fraction of ``named_parameters()``."""
    if not isinstance(model, torch.nn.Module):
        return None
    out: List[Entry] = []
    stack = [model]
    while stack:
        module = stack.pop()
        for holder in (module._parameters, module._buffers):
            for tensor in holder.values():
                if tensor is not None:
                    out.append(_entry(tensor))
        stack.extend(m for m in module._modules.values() if m is not None)
    cache = getattr(model, "kv_cache", None)
    if cache is not None and not isinstance(cache, torch.nn.Module):
        out.extend(_entry(t) for _, t in _cache_tensors(cache))
    return tuple(out)


def _entry(tensor: torch.Tensor) -> Entry:
    try:
        ptr: Any = tensor.data_ptr()
    except Exception:  # a tensor without storage (meta, some subclasses): its identity stands in
        ptr = ("id", id(tensor))
    return (ptr, tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype, tensor.device)


class WeightsFingerprint:
    """Where each named parameter and buffer of a model lives (see the module docstring).

    Attributes:
        names: tensor names in the model's order (buffers prefixed ``"buffer "``, the
            KV cache's ``"kv_cache."``).
        entries: one :data:`Entry` per name.
    """

    __slots__ = ("names", "entries", "fast")

    def __init__(
        self, names: Tuple[str, ...], entries: Tuple[Entry, ...], fast: Optional[Tuple[Entry, ...]] = None
    ) -> None:
        self.names = names
        self.entries = entries
        #: The unnamed walk's entries (:func:`_fast_entries`), compared first by checks.
        self.fast = fast

    @classmethod
    def take(cls, model: Any) -> "WeightsFingerprint":
        """The fingerprint of ``model`` now (host-only: no device work, no synchronize)."""
        names: List[str] = []
        entries: List[Entry] = []
        for name, tensor in named_weight_tensors(model):
            names.append(name)
            entries.append(_entry(tensor))
        return cls(tuple(names), tuple(entries), _fast_entries(model))

    def __len__(self) -> int:
        return len(self.names)

    def same_as(self, other: "WeightsFingerprint") -> bool:
        """Whether every tensor of ``other`` lives where it lived in ``self``."""
        return self.entries == other.entries and self.names == other.names

    def diff(self, other: "WeightsFingerprint") -> Tuple[List[str], List[str], List[str]]:
        """``(changed, missing, added)`` names going from ``self`` to ``other``."""
        old: Dict[str, Entry] = dict(zip(self.names, self.entries))
        new: Dict[str, Entry] = dict(zip(other.names, other.entries))
        changed = [n for n in self.names if n in new and new[n] != old[n]]
        missing = [n for n in self.names if n not in new]
        added = [n for n in other.names if n not in old]
        return changed, missing, added


def _listed(names: List[str]) -> str:
    shown = ", ".join(names[:MAX_NAMED])
    return shown + (f" and {len(names) - MAX_NAMED} more" if len(names) > MAX_NAMED else "")


def check_fingerprint(
    captured: WeightsFingerprint, model: Any, *, phase: str = "", backend: str = ""
) -> Optional[WeightsFingerprint]:
    """Compare ``model`` now with ``captured`` (its fingerprint at capture).

    Returns:
        None when every tensor lives where it did.

    Raises:
        StaleWeightsError: a parameter or buffer moved, vanished or appeared; the message
            names them (up to :data:`MAX_NAMED` of each) and the two fixes.
    """
    if captured.fast is not None and captured.fast == _fast_entries(model):
        return None
    now = WeightsFingerprint.take(model)
    if captured.same_as(now):
        return None
    changed, missing, added = captured.diff(now)
    parts = []
    if changed:
        parts.append(f"{len(changed)} re-assigned since capture ({_listed(changed)})")
    if missing:
        parts.append(f"{len(missing)} gone ({_listed(missing)})")
    if added:
        parts.append(f"{len(added)} new ({_listed(added)})")
    where = f"{phase} graphs" + (f" ({backend})" if backend else "") if phase else "the captured graphs"
    message = (
        f"the model's weights (parameters, buffers, KV cache tensors) moved under {where}: {'; '.join(parts)}. A replay would read the old "
        "memory and compute with the old weights. Fix: update weights in place (param.copy_(new), "
        "load_state_dict(sd) without assign=True), or recapture (runner.cleanup(); runner.capture(), "
        "or runner.sleep(); runner.wake())"
    )
    raise StaleWeightsError(message, changed=changed, missing=missing, added=added, phase=phase)

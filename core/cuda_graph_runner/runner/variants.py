"""Graph variants: more than one graph per captured size, picked per batch through the model.

Some models record a different kernel sequence for the same batch size depending on
what the batch needs: with LoRA adapters served, a batch in which some request uses an
adapter needs the adapter kernels, a batch without any does not and runs cheaper
without them (sglang captures a ``lora`` and a ``nolora`` graph per size and picks one
per batch). A *variant* is such a label.

The model's side (optional protocol methods)::

    def graph_variants(self) -> Sequence[str]:      # the variants it can record
        return ("nolora", "lora")
    def graph_variant(self, batch) -> str:           # the one a live batch needs
        return "lora" if any adapter is used else "nolora"

and it reads ``batch.graph_variant`` in its forward to record the variant's code. A
model without ``graph_variants`` has one graph per size (variant ``""``).

The runner's side:

* the variants to capture are the phase config's ``variants`` key when set (a subset,
  in any order, of what the model declares), else every variant the model declares
  (:func:`resolve_variants`);
* every size is captured once per variant: capture count = sizes x variants, largest
  size first, the variants of one size in the configured order, all in the runner's one
  memory pool (the smaller graphs reuse what the larger ones freed, whatever the
  variant); the capture-time and memory targets per size apply per variant;
* each live batch's variant comes from ``model.graph_variant(batch)``; a batch whose
  variant was not captured (the config left it out) runs eagerly and counts under the
  fallback reason ``"variant not captured"`` in the run statistics
  (:mod:`cuda_graph_runner.runner.stats`).

Shape-key format (``ShapeKey.variant``)
---------------------------------------
``"<mode>[:<width>][|<variant>]"``: the forward mode's value, the tokens per request
where the mode has a width other than one (``target_verify:4``, ``dllm_extend:8``),
then ``|`` and the variant label when the runner has variants. Examples: ``"decode"``,
``"decode|lora"``, ``"target_verify:4|nolora"``, ``"dllm_extend:8"``. Variant labels
are identifiers (letters, digits, ``_``), so ``|`` and ``:`` never occur inside a part;
:func:`compose_key_variant` builds it and :func:`split_key_variant` takes it apart.
"""

from __future__ import annotations

import re
from typing import Any, List, Optional, Sequence, Tuple

#: The variant of a runner without variants (one graph per size).
NO_VARIANT = ""
#: Separates the mode part of ``ShapeKey.variant`` from the variant label.
VARIANT_SEPARATOR = "|"

_LABEL = re.compile(r"[A-Za-z0-9_]+")


def check_label(label: Any, where: str) -> str:
    """``label`` if it is a valid variant label (a non-empty identifier-like string).

    Raises:
        TypeError: not a string.
        ValueError: empty or with other characters than letters, digits and ``_``.
    """
    if not isinstance(label, str):
        raise TypeError(f"{where}: variant {label!r} ({type(label).__name__}) is not a string")
    if not _LABEL.fullmatch(label):
        raise ValueError(f"{where}: variant {label!r} is not accepted; use letters, digits and _ (e.g. 'lora')")
    return label


def compose_key_variant(mode_part: str, variant: str = NO_VARIANT) -> str:
    """``ShapeKey.variant`` for a mode part (``"decode"``, ``"target_verify:4"``) and a
    variant label (``""``: none)."""
    return f"{mode_part}{VARIANT_SEPARATOR}{variant}" if variant else mode_part


def split_key_variant(key_variant: str) -> Tuple[str, str]:
    """``(mode part, variant label)`` of a ``ShapeKey.variant`` (label ``""`` when none)."""
    mode_part, _, variant = key_variant.partition(VARIANT_SEPARATOR)
    return mode_part, variant


def model_variants(model: Any) -> Optional[List[str]]:
    """What ``model.graph_variants()`` declares, or None when the model has no variants.

    Raises:
        TypeError, ValueError: the declaration is not a non-empty sequence of distinct
            valid labels (naming the model and the bad value).
    """
    method = getattr(model, "graph_variants", None)
    if method is None:
        return None
    declared = method()
    name = f"{type(model).__name__}.graph_variants()"
    if declared is None:
        return None
    if isinstance(declared, (str, bytes)) or not isinstance(declared, Sequence):
        raise TypeError(f"{name} returned {declared!r}; expected a sequence of variant labels")
    labels = [check_label(v, name) for v in declared if v != NO_VARIANT]
    if len(set(labels)) != len(labels):
        raise ValueError(f"{name} returned {list(declared)!r}: a label is repeated")
    return labels or None


def resolve_variants(configured: Optional[Sequence[str]], model: Any, where: str) -> List[str]:
    """The variants a runner captures, in capture order.

    Args:
        configured: the phase config's ``variants`` (None: every variant the model declares).
        model: the runner's model.
        where: names the runner in errors.

    Returns:
        ``[""]`` for a model without variants (and no config), else the labels.

    Raises:
        ValueError: the config names variants but the model declares none, or names one
            the model does not declare (lists what it declares).
    """
    declared = model_variants(model)
    if configured is None:
        return list(declared) if declared else [NO_VARIANT]
    if not declared:
        raise ValueError(
            f"{where}: the config names variants {list(configured)} but the model ({type(model).__name__}) declares "
            "none (it has no graph_variants() method, or it returns no label); drop the 'variants' key"
        )
    unknown = [v for v in configured if v not in declared]
    if unknown:
        raise ValueError(
            f"{where}: variants {unknown} are not among the model's variants {declared} ({type(model).__name__})"
        )
    return list(configured)


class VariantSelector:
    """Picks a live batch's variant through the model (no call at all without variants).

    Args:
        model: the runner's model.
        declared: what the model declares (None: no variants).
        where: names the runner in errors.
    """

    def __init__(self, model: Any, declared: Optional[Sequence[str]], where: str) -> None:
        self.where = where
        self.declared = frozenset(declared or ())
        self._pick = getattr(model, "graph_variant", None) if declared else None
        if declared and self._pick is None:
            raise TypeError(
                f"{where}: {type(model).__name__} declares graph variants {list(declared)} but has no "
                "graph_variant(batch) method to pick one per batch"
            )

    def __call__(self, batch: Any) -> str:
        """The variant label ``batch`` needs (``""`` without variants).

        Raises:
            TypeError: the model's ``graph_variant`` returned a non-string.
            ValueError: it returned a label the model does not declare.
        """
        if self._pick is None:
            return NO_VARIANT
        variant = self._pick(batch)
        if variant not in self.declared:
            if not isinstance(variant, str):
                raise TypeError(f"{self.where}: graph_variant(batch) returned {variant!r}; expected a variant label")
            raise ValueError(
                f"{self.where}: graph_variant(batch) returned {variant!r}, not one of the declared variants "
                f"{sorted(self.declared)}"
            )
        return variant

"""Who gets a contested name or default: the registry's order-independent policy.

Three kinds of contest, all reported rather than silently resolved:

* **One name, several distributions.** :func:`conflict_entry` turns them into one
  ``conflict`` row that names every claimant and both ways to choose
  (``CUDA_GRAPH_RUNNER_PREFER``, parsed by :func:`parse_preferences`, or ``prefer()``).
* **Default claims.** Several plugins may answer ``cuda_graph_runner_default_backend``
  for one (phase, device type). :func:`collect_default_claims` calls every claimant (one
  raising or answering first decides nothing), and :func:`choose_default` drops claims
  whose backend cannot run here (so an unusable claim passes to the next claimant), then
  picks the highest ``priority``, then the smallest backend name, then the smallest
  distribution name. The outcome depends on the claims only, never on install or
  ``sys.path`` order (pluggy calls hooks in registration order, which is the order entry
  points were found).
* **One module behind two distributions.** A release and a nightly whose entry points
  both name the same module: Python imports that module once, from whichever directory
  comes first on ``sys.path``, so listing the backend under one distribution would hide
  which code runs. :func:`shared_module_reason` words the conflict.

What it does not do: hold registry state or decide whether a claimed backend is usable
(the registry passes that in); it never picks a winner among distributions on its own.
The idea of gathering every claim and ranking it by an explicit priority follows vLLM's
platform plugins (each plugin says whether it is usable; more than one usable is reported).
"""

from __future__ import annotations

import dataclasses
import os
from importlib import metadata
from typing import Any, Callable, List, Optional, Sequence, Tuple

from ..backend.errors import BackendConflictError
from ..backend.hookspecs import DefaultClaim
from .entries import CONFLICT, BackendEntry

DISABLED = "disabled"


@dataclasses.dataclass(frozen=True)
class Claim:
    """One plugin's default-backend claim for a (phase, device type).

    Attributes:
        backend: the backend name claimed.
        priority: from :class:`~cuda_graph_runner.backend.hookspecs.DefaultClaim` (0 for a plain name).
        plugin: pluggy plugin name of the claimant (``"<distribution>:<entry point>"``).
        distribution: the claimant's distribution.
        usable: whether the backend can run here for the phase.
        reason: why not, when not usable.
    """

    backend: str
    priority: int
    plugin: str
    distribution: str
    usable: bool = True
    reason: str = ""

    def describe(self) -> str:
        """``"full (priority 0, by cuda-graph-runner-full)"`` plus why it is unusable, if so."""
        text = f"{self.backend} (priority {self.priority}, by {self.distribution})"
        return text + (f" [not usable: {self.reason}]" if not self.usable else "")


@dataclasses.dataclass(frozen=True)
class DefaultDecision:
    """The default backend for one (phase, device type) and how it was chosen.

    Attributes:
        phase, device_type: what was asked.
        backend: the chosen backend name (``"disabled"`` when no usable claim).
        winner: the claim that set it, or None (no usable claim: the core's fallback).
        claims: every claim, ranked: usable ones first in the order of the rule.
    """

    phase: str
    device_type: str
    backend: str
    winner: Optional[Claim]
    claims: Tuple[Claim, ...]

    @property
    def others(self) -> Tuple[Claim, ...]:
        """Every claim except the winner."""
        return tuple(c for c in self.claims if c is not self.winner)

    def summary(self) -> str:
        """One line: who set the default and who else claimed it."""
        who = f"set by {self.winner.distribution}" if self.winner else "no usable claim: the core's fallback"
        text = f"default {self.phase} backend on {self.device_type}: {self.backend} ({who})"
        if self.others:
            text += "; also claimed: " + ", ".join(c.describe() for c in self.others)
        return text


def as_claim(result: Any) -> Tuple[str, int]:
    """``(backend, priority)`` from a hook's answer (a name or a ``DefaultClaim``).

    Raises:
        TypeError: anything else, or a priority that is not an int.
    """
    if isinstance(result, DefaultClaim):
        if isinstance(result.priority, bool) or not isinstance(result.priority, int):
            raise TypeError(f"DefaultClaim.priority must be an int, got {result.priority!r}")
        return str(result.backend), result.priority
    if isinstance(result, str):
        return result, 0
    raise TypeError(f"must return a backend name, a DefaultClaim or None, got {type(result).__name__}")


def rank_key(claim: Claim) -> Tuple[int, str, str]:
    """The documented order: usable, higher priority, backend name, distribution name."""
    return (-claim.priority, claim.backend, claim.distribution)


def choose_default(phase: str, device_type: str, claims: Sequence[Claim]) -> DefaultDecision:
    """Apply the rule (module docstring) to ``claims`` (already marked usable or not)."""
    usable = sorted((c for c in claims if c.usable), key=rank_key)
    unusable = sorted((c for c in claims if not c.usable), key=rank_key)
    winner = usable[0] if usable else None
    return DefaultDecision(phase, device_type, winner.backend if winner else DISABLED, winner, tuple(usable + unusable))


def contest_warning(decision: DefaultDecision) -> Optional[str]:
    """The warning for a contested default (several claims), naming each claim once; else None."""
    if len(decision.claims) < 2:
        return None
    return (
        f"several plugins claim the default {decision.phase} backend on {decision.device_type}: "
        f"{decision.backend} was chosen (usable claims rank by priority, then backend name, then "
        f"distribution name); claims: "
        + "; ".join(c.describe() for c in decision.claims)
        + ". Name a backend in the config to silence this."
    )


def loaded_from(plugin: Any) -> str:
    """Where a plugin module was imported from (its file), or ``"?"``."""
    return str(getattr(plugin, "__file__", None) or "?")


def owning_distribution(path: str, candidates: Sequence[str]) -> Optional[str]:
    """Which of the distributions ``candidates`` installed the file ``path`` (by its
    RECORD), or None when none of them lists it."""
    if not path or path == "?":
        return None
    target = os.path.realpath(path)
    for name in candidates:
        try:
            dist = metadata.distribution(name)
        except Exception:  # not findable by name (odd metadata): cannot attribute
            continue
        for f in dist.files or ():
            try:
                if os.path.realpath(str(dist.locate_file(f))) == target:
                    return name
            except Exception:
                continue
    return None


def shared_module_reason(name: str, module: str, path: str, dists: Sequence[Tuple[str, str]], prefer_env: str) -> str:
    """The reason text of a backend two distributions register through one module.

    Args:
        dists: ``(distribution, version)`` of each claimant, in the order found.
    """
    listed = ", ".join(f"{d} {v}".strip() for d, v in dists)
    owner = owning_distribution(path, [d for d, _ in dists])
    code = f"module {module!r} was imported from {path}" + (f" (installed by {owner})" if owner else "")
    return (
        f"backend name {name!r} is registered by several distributions: {listed}; both entry points load "
        f"the same module, so only one copy of the code can run: {code}. Uninstall all but one "
        f'(or choose one with {prefer_env}="{name}={dists[0][0]}"; the code that runs is still the copy '
        f"first on sys.path)"
    )


def conflict_entry(name: str, group: Sequence[BackendEntry], prefer_env: str) -> BackendEntry:
    """The ``conflict`` row for ``name`` registered by every entry of ``group`` (in the
    order found); its reason names each distribution and how to choose one."""
    dists = ", ".join(f"{e.distribution} {e.version}".strip() for e in group)
    first = group[0].distribution
    reason = (
        f"backend name {name!r} is registered by several distributions: {dists}; uninstall all but "
        f'one, or choose one with {prefer_env}="{name}={first}" or '
        f"cuda_graph_runner.registry.prefer({name!r}, {first!r})"
    )
    return BackendEntry(
        name,
        dists,
        "",
        group[-1].phases,
        group[-1].devices,
        status=CONFLICT,
        reason=reason,
        error=BackendConflictError(reason),
        _fixed=True,
    )


def parse_preferences(text: str) -> Tuple[List[Tuple[str, str]], List[str]]:
    """``"name=distribution,..."`` as ``([(name, distribution)], [malformed items])``;
    blank items are ignored."""
    pairs, malformed = [], []
    for item in (i.strip() for i in text.split(",")):
        if not item:
            continue
        name, sep, dist = (p.strip() for p in item.partition("="))
        if not sep or not name or not dist:
            malformed.append(item)
        else:
            pairs.append((name, dist))
    return pairs, malformed


def collect_default_claims(
    hook: Any,
    phase: str,
    device_type: str,
    *,
    skip: Callable[[Any], bool],
    on_error: Callable[[Any, BaseException], None],
) -> List[Tuple[Any, Tuple[str, int]]]:
    """Every ``(hookimpl, (backend, priority))`` claim of the default-backend ``hook``.

    pluggy stops a hook call at the first raising impl (and at the first answer:
    firstresult), so one vendor's bug or install order would decide the default; the
    impls are called one by one instead, in pluggy's call order. ``skip(plugin)`` leaves
    an impl out (wrappers always are); ``on_error(impl, exc)`` hears each impl that
    raised or answered something that is not a claim, and may raise to stop.

    Raises:
        KeyboardInterrupt: passed through; anything ``on_error`` raises.
    """
    args = {"phase": phase, "device_type": device_type}
    claims = []
    for impl in reversed(hook.get_hookimpls()):  # pluggy's call order
        if impl.hookwrapper or impl.wrapper or skip(impl.plugin):
            continue
        try:
            result = impl.function(*[args[a] for a in impl.argnames])
            if result is None:
                continue
            claims.append((impl, as_claim(result)))
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            on_error(impl, exc)
    return claims

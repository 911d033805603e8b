"""CUDA-graph configuration for the decode and prefill phases.

Standard library only: this module never imports torch, so launchers and the
CLI can parse and validate a config before touching a device.

The model
---------
A :class:`CudaGraphConfig` holds one :class:`PhaseConfig` per phase
(``decode``, ``prefill``). Each phase has five keys:

``backend``
    Name of the capture backend, or ``None`` for *auto* (the registry picks the
    device default: ``full`` for decode and ``breakable`` for prefill on CUDA,
    ``disabled`` on CPU). Names are open: ``full``, ``breakable``,
    ``tc_piecewise``, ``npu`` and ``disabled`` are well known, and any installed
    plugin adds its own. Whether a name is installed, and allowed for the phase,
    is checked by :meth:`CudaGraphConfig.validate` against the registry.
``max_bs``
    Decode: the largest batch size; prefill: the largest token count.
    ``None``: the runner's default (``DEFAULT_MAX_BS``: 256 decode, 4096 prefill).
    At most ``MAX_CAPTURE_SIZE`` (65,536: far above any engine's batch; a larger
    value would only build millions of capture sizes and gigabytes of buffers).
``bs``
    Explicit capture sizes; ``None``: the runner's default buckets. Lists are
    normalised: sorted ascending, duplicates dropped. Each size is at most
    ``MAX_CAPTURE_SIZE``.
``tc_compiler``
    ``eager`` or ``inductor``; a *backend option* (``BACKEND_OPTION_KEYS``): read
    only by backends whose spec lists it in ``BackendSpec.options``
    (``tc_piecewise``). Setting an option that the selected backend does not read
    is an error at resolve time (see ``cuda_graph_runner.backend_options``).
``owned_outputs``
    ``false`` (default, zero-copy: a replayed output is valid until the next replay
    of any graph in the same pool) or ``true`` (the runner returns owned copies, one
    copy per replay). Read by the runner, for every backend.
``host_value_guard``
    ``true`` (default): model code reading a host value of the batch
    (``seq_lens_cpu``, ...) where the graph would freeze it is an error at capture
    (``cuda_graph_runner.host_guard``); ``false`` turns the check off.
``verify``, ``verify_first_n``, ``verify_every``
    Verify mode (``cuda_graph_runner.verify``), off by default: compare the first
    ``verify_first_n`` replays of each shape (default 3), and every
    ``verify_every``-th one (0, the default: none after those), with the backend's
    reference on the same batch. The environment variables
    ``CUDA_GRAPH_RUNNER_VERIFY``, ``CUDA_GRAPH_RUNNER_VERIFY_FIRST_N`` and
    ``CUDA_GRAPH_RUNNER_VERIFY_EVERY`` override these for both phases.
``warmup``
    How many forward runs precede each captured size (``WARMUP_POLICIES``; read by
    the base backend's warm-up, so by every backend that uses it):
    ``auto`` (default) warms the first size of a capture session up the backend's
    ``num_warmups`` times (sglang: twice) and each later size once, or not at all when
    the backend already ran that size's kernels (tc_piecewise's compile pass);
    ``every_size`` warms every size up ``num_warmups`` times (sglang's policy, the
    slowest); ``first_size`` warms only the first size up (for models without per-shape
    JIT compilation, autotuning or lazy allocations: the fastest capture).

Every error is a :class:`CudaGraphConfigError` (a ``ValueError``) whose message
names the phase, the key, the bad value, what is accepted and, where known,
which source (flag, JSON) set it.

Precedence (lowest to highest)
------------------------------
1. defaults;
2. legacy sglang flags (deprecated aliases);
3. per-phase convenience flags;
4. ``--cuda-graph-config`` (JSON).

A higher tier overrides a lower one key by key. Within one tier, a flag for one
phase beats a flag for both phases (``--cuda-graph-tc-compiler inductor
--cuda-graph-tc-compiler-decode eager`` gives decode eager, prefill inductor);
two flags of one tier that give the same (phase, key) different values are an
error. :attr:`CudaGraphConfig.sources` records, for every explicitly set
(phase, key), the source that won: ``"api"``, ``"json"``,
``"json:--cuda-graph-config"``, ``"flag:<option>"`` or ``"legacy:<option>"``;
:meth:`CudaGraphConfig.source_of` answers ``"default"`` for the rest.

Flags added by :func:`add_cuda_graph_args`
------------------------------------------
``--cuda-graph-config JSON_OR_PATH``
    A JSON object ``{"decode": {...}, "prefill": {...}}`` (keys as above), or
    the path of a file holding one. Unknown phases/keys are errors.
``--cuda-graph-backend-{decode,prefill} NAME``
    The phase's backend.
``--cuda-graph-max-bs-{decode,prefill} N``
    The phase's ``max_bs``.
``--cuda-graph-bs-{decode,prefill} N [N ...]``
    The phase's ``bs``; space and/or comma separated (``1 2 4`` or ``1,2,4``).
``--cuda-graph-tc-compiler-{decode,prefill} {eager,inductor}``
    The phase's ``tc_compiler``.
``--cuda-graph-tc-compiler {eager,inductor}``
    ``tc_compiler`` of both phases.
``--disable-cuda-graph-{decode,prefill}``
    The phase's backend is ``disabled``.

Deprecated sglang flags, each mapped onto the keys above:

=====================================  ===========================================
``--disable-cuda-graph``               decode and prefill backend ``disabled``
``--enable-breakable-cuda-graph``      prefill backend ``breakable``
``--disable-piecewise-cuda-graph``     prefill backend ``disabled``
``--enforce-piecewise-cuda-graph``     prefill backend ``tc_piecewise``
``--cuda-graph-max-bs N``              decode ``max_bs``
``--cuda-graph-bs N [N ...]``          decode ``bs``
``--piecewise-cuda-graph-tokens N..``  prefill ``bs``
``--piecewise-cuda-graph-max-tokens``  prefill ``max_bs``
``--piecewise-cuda-graph-compiler C``  ``tc_compiler`` of both phases
=====================================  ===========================================

Using one emits a ``FutureWarning`` (shown to end users by default, unlike
``DeprecationWarning``) naming its replacement, once per flag per process: a
second parse in the same process, or the flag repeated, does not warn again.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import numbers
import os
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

__all__ = [
    "Phase",
    "Backend",
    "WELL_KNOWN_DISTRIBUTIONS",
    "TC_COMPILERS",
    "WARMUP_POLICIES",
    "DEFAULT_MAX_BS",
    "MAX_CAPTURE_SIZE",
    "PHASE_KEYS",
    "BACKEND_OPTION_KEYS",
    "CudaGraphConfigError",
    "PhaseConfig",
    "CudaGraphConfig",
    "add_cuda_graph_args",
]


class Phase:
    """The two phases a config covers."""

    DECODE = "decode"
    PREFILL = "prefill"
    ALL = (DECODE, PREFILL)


class Backend:
    """Well-known backend names. Not a closed set: plugins add their own."""

    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"
    NPU = "npu"
    DISABLED = "disabled"
    WELL_KNOWN = (FULL, BREAKABLE, TC_PIECEWISE, NPU, DISABLED)


#: Distribution to ``pip install`` for each well-known backend name.
WELL_KNOWN_DISTRIBUTIONS: Dict[str, str] = {
    Backend.FULL: "cuda-graph-runner-full",
    Backend.BREAKABLE: "cuda-graph-runner-breakable",
    Backend.TC_PIECEWISE: "cuda-graph-runner-tc-piecewise",
    Backend.NPU: "cuda-graph-runner-npu",
    Backend.DISABLED: "cuda-graph-runner",
}

TC_COMPILERS = ("eager", "inductor")

#: Values of the ``warmup`` key (see the module docstring).
WARMUP_POLICIES = ("auto", "every_size", "first_size")

#: What a runner uses when ``max_bs`` is None.
DEFAULT_MAX_BS: Dict[str, int] = {Phase.DECODE: 256, Phase.PREFILL: 4096}

#: Largest accepted ``max_bs`` and ``bs`` element (decode batch size or prefill token
#: count): far above any engine's batch, small enough that the runner's buckets and
#: static buffers stay bounded.
MAX_CAPTURE_SIZE = 65536

#: The keys of one phase, in field order.
PHASE_KEYS = ("backend", "max_bs", "bs", "tc_compiler", "owned_outputs", "host_value_guard", "verify",
              "verify_first_n", "verify_every", "warmup")

#: Keys read by backends rather than the runner. A backend declares the ones it reads in
#: ``BackendSpec.options``; one set for a backend that does not read it is an error.
BACKEND_OPTION_KEYS = ("tc_compiler",)

SOURCE_DEFAULT = "default"
SOURCE_API = "api"
SOURCE_JSON = "json"
SOURCE_JSON_FLAG = "json:--cuda-graph-config"

# ASCII only: backend names double as entry-point names and dict keys.
_BACKEND_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BACKEND_NAME_ACCEPTED = "an identifier such as " + ", ".join(Backend.WELL_KNOWN) + " or a plugin's name"
_SIZE_ACCEPTED = f"an integer >= 1 and <= {MAX_CAPTURE_SIZE} (not a bool)"
_SIZES_ACCEPTED = f"a non-empty list of integers >= 1 and <= {MAX_CAPTURE_SIZE} (not bools)"
_NOT_GIVEN = object()


def _short_repr(value: Any, limit: int = 120) -> str:
    try:
        text = repr(value)
    except ValueError:
        # Python >= 3.11 refuses to print ints of more than 4300 digits (int_max_str_digits).
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return f"<integer of {int(value).bit_length()} bits>"
        return f"<{type(value).__name__} too large to print>"
    except Exception as exc:  # a user object whose __repr__ fails must not hide the real error
        return f"<{type(value).__name__}: repr failed ({type(exc).__name__})>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CudaGraphConfigError(ValueError):
    """The one error type for every invalid config, flag or JSON input.

    Attributes:
        phase: the phase concerned, or None (unknown phase, whole-document error).
        key: the phase key concerned, or None.
        value: the rejected value, or None where not applicable.
        accepted: what would have been accepted (text), or None.
        source: where the value came from (``"flag:--x"``, ``"json"``...), or None.
    """

    def __init__(
        self,
        problem: str,
        *,
        phase: Optional[str] = None,
        key: Optional[str] = None,
        value: Any = _NOT_GIVEN,
        accepted: Optional[str] = None,
        source: Optional[str] = None,
    ) -> None:
        self.problem = problem
        self.phase = phase
        self.key = key
        self._has_value = value is not _NOT_GIVEN
        self.value = value if self._has_value else None
        self.accepted = accepted
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = ".".join(str(part) for part in (self.phase, self.key) if part is not None)
        subject = where
        if self._has_value:
            subject = f"{where}={_short_repr(self.value)}" if where else _short_repr(self.value)
        text = "invalid cuda-graph config" + (f" {subject}" if subject else "")
        if self.source:
            text += f" (from {self.source})"
        text += f": {self.problem}"
        if self.accepted:
            text += f"; accepted: {self.accepted}"
        return text

    def _kwargs(self) -> Dict[str, Any]:
        kwargs = dict(phase=self.phase, key=self.key, accepted=self.accepted, source=self.source)
        if self._has_value:
            kwargs["value"] = self.value
        return kwargs

    def with_context(self, *, phase: Optional[str] = None, source: Optional[str] = None) -> "CudaGraphConfigError":
        """A copy with ``phase`` and ``source`` filled in where this error lacks them."""
        kwargs = self._kwargs()
        kwargs["phase"] = self.phase if self.phase is not None else phase
        kwargs["source"] = self.source or source
        return type(self)(self.problem, **kwargs)

    def __reduce__(self):  # keep the attributes across pickling (worker processes)
        return (functools.partial(type(self), self.problem, **self._kwargs()), ())


def _positive_int(value: Any, key: str) -> int:
    """``value`` as an int from 1 to ``MAX_CAPTURE_SIZE``; bools are refused. Raises CudaGraphConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise CudaGraphConfigError("must be a positive integer", key=key, value=value, accepted=_SIZE_ACCEPTED)
    if value > MAX_CAPTURE_SIZE:
        raise CudaGraphConfigError(f"is above the maximum capture size {MAX_CAPTURE_SIZE}", key=key, value=value,
                                   accepted=_SIZE_ACCEPTED)
    return int(value)


@dataclass
class PhaseConfig:
    """Settings of one phase; validated and normalised on construction.

    ``bs`` is normalised, not rejected, when unsorted or duplicated: it is
    stored sorted ascending with duplicates dropped (``[8, 1, 8]`` -> ``[1, 8]``),
    as a new list. An empty ``bs`` is rejected (use backend ``disabled``).

    Raises:
        CudaGraphConfigError (``phase`` None; :class:`CudaGraphConfig` adds it):
        backend not None nor an identifier string; max_bs or an element of bs
        not an int >= 1 (bools refused); bs not a non-empty list/tuple;
        max_bs < max(bs); tc_compiler not in ``TC_COMPILERS``; owned_outputs not a bool.

    Assigning a field later skips these checks; :meth:`CudaGraphConfig.validate`
    runs them again. Prefer :meth:`CudaGraphConfig.with_phase`.
    """

    backend: Optional[str] = None
    max_bs: Optional[int] = None
    bs: Optional[List[int]] = None
    tc_compiler: str = "eager"
    owned_outputs: bool = False
    host_value_guard: bool = True
    verify: bool = False
    verify_first_n: int = 3
    verify_every: int = 0
    warmup: str = "auto"

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        if self.backend is not None and not (
            isinstance(self.backend, str) and _BACKEND_NAME.fullmatch(self.backend)
        ):
            raise CudaGraphConfigError(
                "must be null or a backend name", key="backend", value=self.backend, accepted="null (auto) or " + _BACKEND_NAME_ACCEPTED
            )
        if self.max_bs is not None:
            self.max_bs = _positive_int(self.max_bs, "max_bs")
        if self.bs is not None:
            if not isinstance(self.bs, (list, tuple)) or not self.bs:
                raise CudaGraphConfigError(
                    "must be null or a non-empty list of sizes",
                    key="bs",
                    value=self.bs,
                    accepted=_SIZES_ACCEPTED,
                )
            for size in self.bs:
                if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
                    raise CudaGraphConfigError(
                        f"element {_short_repr(size)} is not a positive integer",
                        key="bs",
                        value=self.bs,
                        accepted=_SIZES_ACCEPTED,
                    )
                if size > MAX_CAPTURE_SIZE:
                    raise CudaGraphConfigError(
                        f"element {_short_repr(size)} is above the maximum capture size {MAX_CAPTURE_SIZE}",
                        key="bs",
                        value=self.bs,
                        accepted=_SIZES_ACCEPTED,
                    )
            self.bs = sorted({int(size) for size in self.bs})
        if self.max_bs is not None and self.bs is not None and self.max_bs < self.bs[-1]:
            raise CudaGraphConfigError(
                f"is smaller than the largest size in bs ({self.bs[-1]})",
                key="max_bs",
                value=self.max_bs,
                accepted=f"max_bs >= max(bs) = {self.bs[-1]}, or max_bs unset",
            )
        if not isinstance(self.tc_compiler, str) or self.tc_compiler not in TC_COMPILERS:
            raise CudaGraphConfigError(
                "unknown compiler", key="tc_compiler", value=self.tc_compiler, accepted=", ".join(TC_COMPILERS)
            )
        if not isinstance(self.owned_outputs, bool):
            raise CudaGraphConfigError(
                "must be a boolean", key="owned_outputs", value=self.owned_outputs, accepted="true or false"
            )
        for key in ("host_value_guard", "verify"):
            if not isinstance(getattr(self, key), bool):
                raise CudaGraphConfigError("must be a boolean", key=key, value=getattr(self, key),
                                           accepted="true or false")
        for key in ("verify_first_n", "verify_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise CudaGraphConfigError("must be an integer >= 0", key=key, value=value,
                                           accepted="an integer >= 0 (not a bool)")
            setattr(self, key, int(value))
        if not isinstance(self.warmup, str) or self.warmup not in WARMUP_POLICIES:
            raise CudaGraphConfigError("unknown warm-up policy", key="warmup", value=self.warmup,
                                       accepted=", ".join(WARMUP_POLICIES))
        if self.verify and self.verify_first_n == 0 and self.verify_every == 0:
            raise CudaGraphConfigError("verify is on but verify_first_n and verify_every are both 0, so no "
                                       "replay would be checked", key="verify_first_n", value=0,
                                       accepted="verify_first_n >= 1 or verify_every >= 1")

    def to_dict(self) -> Dict[str, Any]:
        """The keys whose values differ from the defaults (``bs`` copied)."""
        default = PhaseConfig()
        diff = {}
        for key in PHASE_KEYS:
            value = getattr(self, key)
            if value != getattr(default, key):
                diff[key] = list(value) if isinstance(value, list) else value
        return diff


def _build_phase(phase: str, values: Mapping[str, Any], sources: Mapping[Tuple[str, str], str]) -> PhaseConfig:
    """``PhaseConfig(**values)``, with errors naming the phase and the source of the key."""
    try:
        return PhaseConfig(**values)
    except CudaGraphConfigError as err:
        raise err.with_context(phase=phase, source=sources.get((phase, err.key))) from None


@dataclass
class CudaGraphConfig:
    """CUDA-graph settings of both phases, plus where each explicit value came from.

    ``sources`` maps each explicitly set ``(phase, key)`` to its source; it is
    not part of equality or repr.

    Raises:
        CudaGraphConfigError: ``decode`` or ``prefill`` is not a PhaseConfig.
    """

    decode: PhaseConfig = field(default_factory=PhaseConfig)
    prefill: PhaseConfig = field(default_factory=PhaseConfig)
    sources: Dict[Tuple[str, str], str] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for phase in Phase.ALL:
            if not isinstance(getattr(self, phase), PhaseConfig):
                raise CudaGraphConfigError(
                    "must be a PhaseConfig", phase=phase, value=getattr(self, phase), accepted="a PhaseConfig"
                )

    def __getitem__(self, phase: str) -> PhaseConfig:
        """The phase's settings. Raises CudaGraphConfigError for an unknown phase."""
        if not isinstance(phase, str) or phase not in Phase.ALL:
            raise CudaGraphConfigError("unknown phase", value=phase, accepted=", ".join(Phase.ALL))
        return getattr(self, phase)

    def source_of(self, phase: str, key: str) -> str:
        """Where ``(phase, key)`` got its value: a recorded source, else ``"default"``."""
        return self.sources.get((phase, key), SOURCE_DEFAULT)

    def fully_disabled(self) -> bool:
        """True when both phases say ``disabled`` (auto, None, is not disabled)."""
        return all(self[phase].backend == Backend.DISABLED for phase in Phase.ALL)

    # -- dict / JSON ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Any, *, source: str = SOURCE_API) -> "CudaGraphConfig":
        """Defaults overridden by ``d`` = ``{phase: {key: value}}``; missing phases/keys keep defaults.

        Each key present is recorded in ``sources`` as ``source``.

        Raises:
            CudaGraphConfigError: ``d`` or a phase entry is not a mapping; unknown
            phase or key; any invalid value (see :class:`PhaseConfig`).
        """
        if not isinstance(d, Mapping):
            raise CudaGraphConfigError(
                "must be an object mapping phase to settings",
                value=d,
                accepted='an object like {"decode": {"backend": "full"}, "prefill": {...}}',
                source=source,
            )
        phases: Dict[str, PhaseConfig] = {}
        sources: Dict[Tuple[str, str], str] = {}
        for phase, settings in d.items():
            if not isinstance(phase, str) or phase not in Phase.ALL:
                raise CudaGraphConfigError(
                    "unknown phase", value=phase, accepted=", ".join(Phase.ALL), source=source
                )
            if not isinstance(settings, Mapping):
                raise CudaGraphConfigError(
                    "must be an object of settings",
                    phase=phase,
                    value=settings,
                    accepted="an object with keys " + ", ".join(PHASE_KEYS),
                    source=source,
                )
            for key, value in settings.items():
                if not isinstance(key, str) or key not in PHASE_KEYS:
                    raise CudaGraphConfigError(
                        "unknown key",
                        phase=phase,
                        key=key if isinstance(key, str) else _short_repr(key),
                        value=value,
                        accepted="keys " + ", ".join(PHASE_KEYS),
                        source=source,
                    )
                sources[(phase, key)] = source
            phases[phase] = _build_phase(phase, settings, sources)
        return cls(**phases, sources=sources)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Only what differs from the defaults, so ``from_dict(c.to_dict()) == c``."""
        return {phase: diff for phase in Phase.ALL if (diff := self[phase].to_dict())}

    @classmethod
    def from_json(cls, text_or_path: Any, *, source: str = SOURCE_JSON) -> "CudaGraphConfig":
        """Parse a JSON object given as text or as the path of a file (see :meth:`from_dict`).

        Text whose first non-blank character is ``{`` or ``[`` is JSON; otherwise an
        existing file of that name is read; otherwise the text is parsed as JSON.

        Raises:
            CudaGraphConfigError: unreadable file, invalid JSON, duplicate object
            keys, anything :meth:`from_dict` rejects.
        """
        return cls.from_dict(_load_json(text_or_path, source), source=source)

    # -- argparse --------------------------------------------------------------------

    @classmethod
    def from_args(cls, namespace: Any) -> "CudaGraphConfig":
        """Build the config from a namespace parsed with :func:`add_cuda_graph_args`.

        Precedence, lowest to highest: defaults < legacy flags < per-phase flags <
        ``--cuda-graph-config``; see the module docstring. Attributes missing from
        ``namespace`` count as not given.

        Raises:
            CudaGraphConfigError: conflicting flags within a tier, invalid JSON, or
            an invalid combined value (e.g. max_bs from a flag below bs from JSON);
            the message names the source.
        """
        values: Dict[str, Dict[str, Any]] = {phase: {} for phase in Phase.ALL}
        sources: Dict[Tuple[str, str], str] = {}
        for tier in (_TIER_LEGACY, _TIER_FLAG):
            for (phase, key), (flag, value) in _resolve_tier(namespace, tier).items():
                values[phase][key] = value
                sources[(phase, key)] = f"{tier}:{flag.option}"
        raw = getattr(namespace, "cuda_graph_config", None)
        if raw is not None:
            if not isinstance(raw, Mapping):
                raw = _load_json(raw, SOURCE_JSON_FLAG)
            from_json = cls.from_dict(raw, source=SOURCE_JSON_FLAG)
            for phase, key in from_json.sources:
                values[phase][key] = getattr(from_json[phase], key)
                sources[(phase, key)] = SOURCE_JSON_FLAG
        phases = {phase: _build_phase(phase, values[phase], sources) for phase in Phase.ALL}
        return cls(**phases, sources=sources)

    # -- derivation and validation ---------------------------------------------------

    def with_phase(self, phase: str, **fields: Any) -> "CudaGraphConfig":
        """A copy with ``fields`` of ``phase`` replaced (recorded as source ``"api"``).

        Raises:
            CudaGraphConfigError: unknown phase or key; invalid value.
        """
        current = self[phase]
        for key, value in fields.items():
            if key not in PHASE_KEYS:
                raise CudaGraphConfigError(
                    "unknown key", phase=phase, key=key, value=value, accepted="keys " + ", ".join(PHASE_KEYS)
                )
        sources = dict(self.sources)
        sources.update({(phase, key): SOURCE_API for key in fields})
        merged = {key: getattr(current, key) for key in PHASE_KEYS}
        merged.update(fields)
        phases = {p: dataclasses.replace(self[p]) for p in Phase.ALL}  # copies: no shared bs lists
        phases[phase] = _build_phase(phase, merged, sources)
        return type(self)(**phases, sources=sources)

    def validate(self, backend_phases: Optional[Mapping[str, Collection[str]]] = None,
                 unusable: Optional[Mapping[str, str]] = None) -> None:
        """Check every field again and, given the installed backends, every backend name.

        Args:
            backend_phases: ``{backend name: phases it supports}`` of the installed
                backends (``registry.backend_phases()``); None skips the name checks.
                ``disabled`` is always accepted (built into the core); None (auto)
                is left to the registry.
            unusable: ``{backend name: why}`` of backends that are installed but failed or
                registered twice (``registry.backend_problems()``): such a name is
                reported with that cause, not as "not installed".

        Raises:
            CudaGraphConfigError: an invalid field (e.g. assigned after construction);
            a backend that is not installed (the message lists the installed ones and
            the distribution providing a well-known name); a backend that does not
            support the phase.
        """
        for phase in Phase.ALL:
            try:
                self[phase]._check()
            except CudaGraphConfigError as err:
                raise err.with_context(phase=phase, source=self.sources.get((phase, err.key))) from None
        if backend_phases is None:
            return
        for phase in Phase.ALL:
            name = self[phase].backend
            if name is None or name == Backend.DISABLED:
                continue
            source = self.sources.get((phase, "backend"))
            if name not in backend_phases and unusable and name in unusable:
                raise CudaGraphConfigError(
                    f"is {unusable[name]}",
                    phase=phase,
                    key="backend",
                    value=name,
                    accepted=_names_for(phase, backend_phases),
                    source=source,
                )
            if name not in backend_phases:
                raise CudaGraphConfigError(
                    "is not an installed backend" + _install_hint(name, backend_phases),
                    phase=phase,
                    key="backend",
                    value=name,
                    accepted=_names_for(phase, backend_phases),
                    source=source,
                )
            supported = backend_phases[name]
            if phase not in supported:
                raise CudaGraphConfigError(
                    f"backend {name!r} does not support phase {phase!r} "
                    f"(it supports: {', '.join(sorted(supported)) or 'none'})",
                    phase=phase,
                    key="backend",
                    value=name,
                    accepted=_names_for(phase, backend_phases),
                    source=source,
                )


def _names_for(phase: str, backend_phases: Mapping[str, Collection[str]]) -> str:
    """The backends usable for ``phase``, as accepted-values text."""
    names = {name for name, phases in backend_phases.items() if phase in phases} | {Backend.DISABLED}
    return "null (auto) or one of the installed backends for this phase: " + ", ".join(sorted(names))


def _install_hint(name: str, backend_phases: Mapping[str, Collection[str]]) -> str:
    installed = ", ".join(sorted(backend_phases)) or "none"
    hint = f" (installed: {installed})"
    if name in WELL_KNOWN_DISTRIBUTIONS:
        hint += f"; install it with: pip install {WELL_KNOWN_DISTRIBUTIONS[name]}"
    else:
        missing = [
            f"{n} ({d})"
            for n, d in WELL_KNOWN_DISTRIBUTIONS.items()
            if n not in backend_phases and n != Backend.DISABLED  # disabled is built in
        ]
        if missing:
            hint += "; well-known backends not installed: " + ", ".join(missing)
    return hint


# -- JSON loading ------------------------------------------------------------------------


def _reject_duplicates(pairs: List[Tuple[str, Any]]) -> Dict[str, Any]:
    # json keeps the last duplicate silently; a config that says two things is an error.
    out: Dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise CudaGraphConfigError("duplicate key in a JSON object", value=key, accepted="each key once")
        out[key] = value
    return out


def _load_json(text_or_path: Any, source: Optional[str]) -> Any:
    """The JSON value in ``text_or_path`` (JSON text, or a path to a file). Raises CudaGraphConfigError."""
    accepted = 'a JSON object such as \'{"decode": {"backend": "full"}}\' or the path of a file holding one'
    path = None
    if isinstance(text_or_path, os.PathLike):
        path = os.fspath(text_or_path)
    elif not isinstance(text_or_path, str):
        raise CudaGraphConfigError(
            "must be JSON text or a path", value=text_or_path, accepted=accepted, source=source
        )
    elif not text_or_path.lstrip().startswith(("{", "[")) and os.path.isfile(text_or_path):
        path = text_or_path
    text = text_or_path
    if path is not None:
        try:
            # utf-8-sig: editors on Windows save JSON with a byte-order mark; accept it.
            with open(path, encoding="utf-8-sig") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as err:
            raise CudaGraphConfigError(
                f"cannot read the file ({err})", value=text_or_path, accepted=accepted, source=source
            ) from None
    if text.startswith("\ufeff"):  # a BOM kept in text read by the caller
        text = text[1:]
    try:
        return json.loads(text, object_pairs_hook=_reject_duplicates)
    except CudaGraphConfigError as err:
        raise err.with_context(source=source) from None
    except RecursionError:
        problem = "JSON nested too deeply"
    except ValueError as err:  # JSONDecodeError, and int() digit limits
        problem = f"not valid JSON ({err})"
    if path is None:
        problem += " and not an existing file"
    else:
        problem += f" in file {path!r}"
    raise CudaGraphConfigError(problem, value=text_or_path, accepted=accepted, source=source)


# -- argparse --------------------------------------------------------------------------------

_TIER_LEGACY = "legacy"
_TIER_FLAG = "flag"
_NO_CONST = object()


@dataclass(frozen=True)
class _Flag:
    """One command-line flag and the (phases, key) it sets."""

    option: str
    tier: str
    phases: Tuple[str, ...]
    key: str
    help: str
    const: Any = _NO_CONST  # flags without a value set the key to this
    replacement: str = ""  # legacy flags: what to use instead

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")

    def value_from(self, raw: Any) -> Any:
        if self.const is not _NO_CONST:
            return self.const
        if self.key == "bs" and isinstance(raw, (list, tuple)):
            # nargs="+" of comma lists: [[1, 2], [4]] -> [1, 2, 4]
            flat: List[Any] = []
            for item in raw:
                flat.extend(item) if isinstance(item, (list, tuple)) else flat.append(item)
            return flat
        return raw


def _phase_flags(p: str) -> List[_Flag]:
    size = "batch size" if p == Phase.DECODE else "token count"
    return [
        _Flag(f"--cuda-graph-backend-{p}", _TIER_FLAG, (p,), "backend",
              f"{p} backend: {', '.join(Backend.WELL_KNOWN)} or a plugin's name (default: auto)"),
        _Flag(f"--cuda-graph-max-bs-{p}", _TIER_FLAG, (p,), "max_bs",
              f"largest {p} {size} to capture, at most {MAX_CAPTURE_SIZE} "
              f"(default: null, meaning the runner's default, {DEFAULT_MAX_BS[p]})"),
        _Flag(f"--cuda-graph-bs-{p}", _TIER_FLAG, (p,), "bs",
              f"{p} {size}s to capture, space or comma separated (default: the runner's buckets)"),
        _Flag(f"--cuda-graph-tc-compiler-{p}", _TIER_FLAG, (p,), "tc_compiler",
              f"compiler of the tc_piecewise pieces for {p} (default: eager); an error with a backend that "
              "does not read it"),
        _Flag(f"--disable-cuda-graph-{p}", _TIER_FLAG, (p,), "backend",
              f"no graphs for {p} (backend disabled)", const=Backend.DISABLED),
    ]


def _legacy(option: str, phases: Tuple[str, ...], key: str, replacement: str, const: Any = _NO_CONST) -> _Flag:
    return _Flag(option, _TIER_LEGACY, phases, key, f"deprecated: use {replacement}", const, replacement)


_FLAGS: Tuple[_Flag, ...] = (
    *_phase_flags(Phase.DECODE),
    *_phase_flags(Phase.PREFILL),
    _Flag("--cuda-graph-tc-compiler", _TIER_FLAG, Phase.ALL, "tc_compiler",
          "compiler of the tc_piecewise pieces for both phases (default: eager)"),
    _legacy("--disable-cuda-graph", Phase.ALL, "backend",
            "--disable-cuda-graph-decode --disable-cuda-graph-prefill", Backend.DISABLED),
    _legacy("--enable-breakable-cuda-graph", (Phase.PREFILL,), "backend",
            "--cuda-graph-backend-prefill breakable", Backend.BREAKABLE),
    _legacy("--disable-piecewise-cuda-graph", (Phase.PREFILL,), "backend",
            "--disable-cuda-graph-prefill", Backend.DISABLED),
    _legacy("--enforce-piecewise-cuda-graph", (Phase.PREFILL,), "backend",
            "--cuda-graph-backend-prefill tc_piecewise", Backend.TC_PIECEWISE),
    _legacy("--cuda-graph-max-bs", (Phase.DECODE,), "max_bs", "--cuda-graph-max-bs-decode"),
    _legacy("--cuda-graph-bs", (Phase.DECODE,), "bs", "--cuda-graph-bs-decode"),
    _legacy("--piecewise-cuda-graph-tokens", (Phase.PREFILL,), "bs", "--cuda-graph-bs-prefill"),
    _legacy("--piecewise-cuda-graph-max-tokens", (Phase.PREFILL,), "max_bs", "--cuda-graph-max-bs-prefill"),
    _legacy("--piecewise-cuda-graph-compiler", Phase.ALL, "tc_compiler", "--cuda-graph-tc-compiler"),
)


def _resolve_tier(namespace: Any, tier: str) -> Dict[Tuple[str, str], Tuple[_Flag, Any]]:
    """The (phase, key) -> (flag, value) that the given flags of one tier set.

    A one-phase flag beats a both-phase flag; equal specificity with different
    values raises CudaGraphConfigError.
    """
    chosen: Dict[Tuple[str, str], Tuple[_Flag, Any]] = {}
    for flag in _FLAGS:
        raw = getattr(namespace, flag.dest, None)
        if flag.tier != tier or raw is None or raw is False:
            continue
        value = flag.value_from(raw)
        for phase in flag.phases:
            previous = chosen.get((phase, flag.key))
            if previous is None or len(previous[0].phases) > len(flag.phases):
                chosen[(phase, flag.key)] = (flag, value)
            elif len(previous[0].phases) == len(flag.phases) and previous[1] != value:
                raise CudaGraphConfigError(
                    f"conflicts with {previous[0].option} (which sets {_short_repr(previous[1])})",
                    phase=phase,
                    key=flag.key,
                    value=value,
                    accepted="one value per phase and key; drop one of the two flags",
                    source=f"{tier}:{flag.option}",
                )
    return chosen


def source_phases(source: Optional[str]) -> Tuple[str, ...]:
    """The phases the flag behind ``source`` (``"flag:--x"``, ``"legacy:--y"``) sets at
    once; ``()`` for any other source (JSON, API, default)."""
    tier, _, option = (source or "").partition(":")
    for flag in _FLAGS:
        if flag.tier == tier and flag.option == option:
            return flag.phases
    return ()


_WARNED_FLAGS: set = set()  # legacy flags already warned about in this process


def _warn_deprecated(option: str, replacement: str) -> None:
    if option in _WARNED_FLAGS:
        return
    _WARNED_FLAGS.add(option)
    warnings.warn(
        f"{option} is deprecated and will be removed; use {replacement}", FutureWarning, stacklevel=3
    )


class _DeprecatedAlias(argparse.Action):
    """Stores like a plain flag after warning that the flag is deprecated."""

    def __init__(self, option_strings: List[str], dest: str, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        _warn_deprecated(self.option_strings[0], self.replacement)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _positive_int_arg(text: str) -> int:
    try:
        value = int(text)
    except ValueError:  # not a number, or more digits than int() accepts
        value = 0
    if value < 1 or value > MAX_CAPTURE_SIZE:
        raise argparse.ArgumentTypeError(f"invalid value {_short_repr(text)}; accepted: {_SIZE_ACCEPTED}")
    return value


def _sizes_arg(text: str) -> List[int]:
    try:
        return [_positive_int_arg(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid sizes {_short_repr(text)}; accepted: integers >= 1 and <= {MAX_CAPTURE_SIZE}, space or comma separated"
        ) from None


def _backend_arg(text: str) -> str:
    if not _BACKEND_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid backend name {text!r}; accepted: {_BACKEND_NAME_ACCEPTED}")
    return text


def _config_arg(text: str) -> Dict[str, Any]:
    """Parse and check ``--cuda-graph-config`` at parse time; keep the raw dict for from_args."""
    try:
        raw = _load_json(text, None)
        CudaGraphConfig.from_dict(raw, source=SOURCE_JSON)
    except CudaGraphConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return raw


def add_cuda_graph_args(parser: Any) -> Any:
    """Add the CUDA-graph flags (module docstring) to an argparse parser; returns their group.

    Every flag defaults to None, so :meth:`CudaGraphConfig.from_args` can tell
    given from not given. Bad values stop parsing with a message that names the
    flag and the value.
    """
    group = parser.add_argument_group(
        "CUDA graphs",
        "precedence, lowest to highest: defaults < deprecated flags < per-phase flags < --cuda-graph-config",
    )
    group.add_argument(
        "--cuda-graph-config",
        type=_config_arg,
        default=None,
        metavar="JSON_OR_PATH",
        help='JSON object (or file) like {"decode": {"backend": "full", "max_bs": 64}}; beats every other flag',
    )
    for flag in _FLAGS:
        kwargs: Dict[str, Any] = dict(dest=flag.dest, default=None, help=flag.help)
        if flag.const is not _NO_CONST:
            kwargs["nargs"] = 0
        elif flag.key == "bs":
            kwargs.update(nargs="+", type=_sizes_arg, metavar="N")
        elif flag.key == "max_bs":
            kwargs.update(type=_positive_int_arg, metavar="N")
        elif flag.key == "backend":
            kwargs.update(type=_backend_arg, metavar="NAME")
        else:
            kwargs.update(choices=TC_COMPILERS)
        if flag.tier == _TIER_LEGACY:
            kwargs.update(action=_DeprecatedAlias, replacement=flag.replacement)
        elif kwargs.get("nargs") == 0:
            del kwargs["nargs"]
            kwargs["action"] = "store_true"
        group.add_argument(flag.option, **kwargs)
    return group

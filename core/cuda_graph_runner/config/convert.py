"""One conversion of whatever a caller passes as "the config" into a ``CudaGraphConfig``.

What it does: :func:`as_config` accepts every form the runners and the registry's
``resolve`` accept (a ``CudaGraphConfig``, a ``PhaseConfig``, a mapping in either the
whole-config form ``{"decode": {...}}`` or one phase's form ``{"backend": "full"}``, a
backend name, or None) and returns a ``CudaGraphConfig``. A ``CudaGraphConfig`` is
returned as it is, so a runner converts once and hands the result to the registry, which
then converts nothing.

Sources: a mapping records its keys as source ``"api"`` (like :meth:`CudaGraphConfig.from_dict`);
a ``PhaseConfig`` carries no sources, so only the fields that differ from the defaults
are recorded as set (an option left at its default is not "set", whichever way the config
arrived: :mod:`cuda_graph_runner.backend.options`).

What it does not do: check backend names or options against the installed backends
(the registry does, at resolve time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Dict, Union

from .model import PHASE_KEYS, SOURCE_API, CudaGraphConfig, Phase, PhaseConfig, _build_phase, migrate_tc_compiler

#: What :func:`as_config` accepts.
ConfigInput = Union[CudaGraphConfig, PhaseConfig, Mapping[str, Any], str, None]

_ACCEPTED = (
    "a CudaGraphConfig, a PhaseConfig, a mapping ({'decode': {...}} or one phase's {'backend': ...}), "
    "a backend name, or None"
)


def as_config(config: ConfigInput, phase: str) -> CudaGraphConfig:
    """``config`` as a ``CudaGraphConfig``; forms that describe one phase describe ``phase``.

    Args:
        config: a ``CudaGraphConfig`` (returned unchanged, not copied); a ``PhaseConfig``
            (copied into ``phase``); a mapping whose keys include a phase name
            (``CudaGraphConfig.from_dict`` form), else one phase's settings
            (``{"backend": "full", "max_bs": 64}``); a backend name (``"full"``); None
            (the defaults).
        phase: ``"decode"`` or ``"prefill"``.

    Raises:
        ValueError: ``phase`` is not a phase.
        TypeError: ``config`` is none of the accepted types (names the type).
        cuda_graph_runner.config.CudaGraphConfigError: a mapping or name does not validate.
    """
    if phase not in Phase.ALL:
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if isinstance(config, CudaGraphConfig):
        return config
    if config is None:
        return CudaGraphConfig()
    if isinstance(config, PhaseConfig):
        default = PhaseConfig()
        values = {key: getattr(config, key) for key in PHASE_KEYS}
        sources = {(phase, key): SOURCE_API for key, value in values.items() if value != getattr(default, key)}
        given = {phase: {key: values[key] for key in values if (phase, key) in sources}}
        migrate_tc_compiler(given, sources)  # the deprecated spelling of compiled full
        values.update(given[phase])
        if "tc_compiler" not in given[phase]:
            values["tc_compiler"] = default.tc_compiler
        # A new PhaseConfig: validated again (fields assigned later skip the checks), and
        # the caller's object stays theirs.
        phases: Dict[str, Any] = {phase: _build_phase(phase, values, sources)}
        return CudaGraphConfig(**phases, sources=sources)
    if isinstance(config, str):
        return CudaGraphConfig.from_dict({phase: {"backend": config}})
    if isinstance(config, Mapping):
        if any(key in Phase.ALL for key in config):
            return CudaGraphConfig.from_dict(config)
        return CudaGraphConfig.from_dict({phase: dict(config)})
    raise TypeError(f"config must be {_ACCEPTED}, got {type(config).__name__}")

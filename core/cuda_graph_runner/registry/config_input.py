"""Config conversion: whatever a caller passes to ``resolve`` -> the ``PhaseConfig`` to use.

What it does: accepts a ``CudaGraphConfig``, a ``PhaseConfig``, a mapping such as
``{"backend": "full"}``, a backend name, or None, and returns the phase's ``PhaseConfig``.
A mapping goes through ``CudaGraphConfig.from_dict``, so it is validated like a config file.

What it does not do: check that the backend is installed or that it reads the options
the config sets (the registry and :mod:`cuda_graph_runner.backend_options` do, at resolve time).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..config import CudaGraphConfig, PhaseConfig
from .entries import PHASES


def phase_config_of(phase: str, config: Any) -> PhaseConfig:
    """The ``PhaseConfig`` of ``phase`` that ``config`` describes (None: the defaults).

    Raises:
        ValueError: ``phase`` is not ``"decode"`` or ``"prefill"``.
        TypeError: ``config`` is of none of the accepted types (names the type).
        cuda_graph_runner.config.CudaGraphConfigError: a mapping does not validate.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if config is None:
        return CudaGraphConfig()[phase]
    if isinstance(config, CudaGraphConfig):
        return config[phase]
    if isinstance(config, PhaseConfig):
        return config
    if isinstance(config, str):
        return PhaseConfig(backend=config)
    if isinstance(config, Mapping):
        return CudaGraphConfig.from_dict({phase: dict(config)})[phase]
    raise TypeError(
        f"config must be a CudaGraphConfig, PhaseConfig, mapping or backend name, got {type(config).__name__}"
    )

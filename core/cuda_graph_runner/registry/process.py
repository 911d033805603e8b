"""The process-wide registry: created on first use, rebuilt on request, safe across fork.

What it does: holds the one :class:`~.manager.BackendRegistry` most code uses
(:func:`get_registry`), carries ``register()`` / ``prefer()`` calls over a
:func:`reset_registry`, renews every registry's lock in a forked child, and offers the
module-level functions (``list_backends``, ``resolve_decode_backend``, ...) that
delegate to it.

What it does not do: share anything between processes. A forked child inherits the
parent's scanned registry (``register()`` calls included); a spawned child scans again
and sees the same installed plugins under the same environment, but not the parent's
``register()`` calls.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from ..backend import envs
from ..backend.hookspecs import BackendSpec
from ..config import ConfigInput
from .entries import BackendEntry
from .manager import BackendRegistry, live_registries

if TYPE_CHECKING:  # torch and the backend module: not imported to list or discover backends
    import torch

    from ..backend.base import BaseCudaGraphBackend

_default: Optional[BackendRegistry] = None
_default_lock = threading.Lock()
# register()/prefer() calls of a dropped registry, for the next one to apply again.
_kept: Tuple[Dict[str, Tuple[BackendSpec, bool]], Dict[str, str]] = ({}, {})


def _after_fork_in_child() -> None:
    # A lock held by another parent thread at fork time stays locked forever in the
    # child; the scanned state itself is inherited and valid.
    global _default_lock
    _default_lock = threading.Lock()
    for reg in list(live_registries):
        reg._lock = threading.RLock()
        reg.probes.renew_lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def get_registry() -> BackendRegistry:
    """The process-wide registry (scanned on first use, then cached; a forked child
    inherits it, a spawned child scans its own the same way)."""
    global _default, _kept
    with _default_lock:
        if _default is None:
            _default = BackendRegistry()
            _default._replay, _kept = _kept, ({}, {})
        return _default


def reset_registry(*, keep_in_process: bool = True) -> None:
    """Drop the cached registry so the next call rescans (after installing a plugin).

    Earlier :func:`register` and :func:`prefer` calls are kept: the new registry applies
    them again after its scan (a registration that now conflicts with a newly installed
    plugin is dropped with a ``RuntimeWarning`` and listed in ``problems``). Calls undone
    with ``get_registry().unregister(name)`` are not kept.

    Args:
        keep_in_process: False forgets them too (test isolation: a fresh process's registry).
    """
    global _default, _kept
    with _default_lock:
        old, _default = _default, None
        if not keep_in_process:
            _kept = ({}, {})
        elif old is not None:
            with old._lock:
                # Calls on an old registry never scanned again are still pending there.
                specs = {**old._replay[0], **old._in_process}
                preferred = {**old._replay[1], **old._preferred}
            _kept = ({**_kept[0], **specs}, {**_kept[1], **preferred})


def list_backends(device_type: Optional[str] = None) -> List[BackendEntry]:
    """Every registered backend with distribution, version, phases, status and reason."""
    return get_registry().entries(device_type)


def backend_phases() -> Dict[str, frozenset[str]]:
    """``{name: phases}`` of the installed backends (what config validation accepts)."""
    return get_registry().backend_phases()


def backend_problems() -> Dict[str, str]:
    """``{name: why}`` of installed backends that failed or are registered twice."""
    return get_registry().backend_problems()


def register(spec: BackendSpec, *, replace: bool = False) -> None:
    """Register a backend in this process without an entry point (tests, notebooks).

    Raises:
        BackendConflictError, BackendContractError, ValueError: see :meth:`BackendRegistry.register`.
    """
    get_registry().register(spec, replace=replace)


def prefer(name: str, distribution: str) -> None:
    """Choose which distribution's ``name`` to use when several register it.

    Raises:
        UnknownBackendError: no distribution of that name registers ``name``.
    """
    get_registry().prefer(name, distribution)


def verify(name: str) -> BackendEntry:
    """Import and contract-check backend ``name`` now; see :meth:`BackendRegistry.verify`.

    Raises:
        UnknownBackendError: no plugin registers ``name``.
    """
    return get_registry().verify(name)


def verify_all() -> List[BackendEntry]:
    """Import and contract-check every registered backend; see :meth:`BackendRegistry.verify_all`."""
    return get_registry().verify_all()


def resolve_decode_backend(
    config: ConfigInput = None, *, device: torch.device | str | None = None, **backend_kwargs: Any
) -> BaseCudaGraphBackend:
    """The decode backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("decode", config, device=device, **backend_kwargs)


def resolve_prefill_backend(
    config: ConfigInput = None, *, device: torch.device | str | None = None, **backend_kwargs: Any
) -> BaseCudaGraphBackend:
    """The prefill backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("prefill", config, device=device, **backend_kwargs)


def environment_variables() -> List[Dict[str, str]]:
    """Every ``CUDA_GRAPH_RUNNER_*`` variable, one table: the core's and every installed
    plugin's (the scan imports each registration module, where a plugin declares its own
    with :func:`cuda_graph_runner.backend.envs.define`), as :func:`~cuda_graph_runner.backend.envs.describe`
    rows ``{name, kind, default, owner, help}``. A plugin kept out of the scan
    (``CUDA_GRAPH_RUNNER_PLUGINS``, ``..._DISABLE_PLUGIN_AUTOLOAD``) adds none.

    Raises:
        cuda_graph_runner.backend.envs.EnvVarError: a registry variable does not parse.
        BackendLoadError: strict mode, a plugin failed to load.
    """
    get_registry().names()
    return envs.describe()


def check_environment(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every set variable of :func:`environment_variables`' table (the plugins' too),
    so the command line reports a bad value before any work.

    Raises:
        cuda_graph_runner.backend.envs.EnvVarError: the first value that does not parse, named
            with what is accepted.
        BackendLoadError: strict mode, a plugin failed to load.
    """
    get_registry().names()
    envs.check_all(environ)

"""Backend registry: discovery through entry points, pluggy hooks, resolve by name.

How a backend is found (the torch ``torch_dynamo_backends`` / OpenTelemetry model):

1. The entry-point group ``cuda_graph_runner.backends`` is scanned once (cached); the
   entry-point name is the backend name users write in config.
2. Each entry point names a light *registration module* implementing the hooks of
   :mod:`cuda_graph_runner.backend.hookspecs`; it is registered with a ``pluggy.PluginManager``
   and contributes ``BackendSpec`` records. Backend classes are not imported yet.
3. ``resolve_decode_backend`` / ``resolve_prefill_backend`` import the one class that
   was asked for, check it against the contract and build it.

One concept per module, as in pluggy's ``_manager.py`` / ``_hooks.py`` and conda's
``plugins/manager.py``:

* :mod:`.discovery`: entry points, distribution metadata, importing plugin code;
* :mod:`.entries`: ``BackendEntry``, statuses, spec checks, device probes;
* :mod:`.probing`: calling probes in bounded time, answers kept per probe and device type;
* :mod:`.conflicts`: contested names and defaults, preferences;
* :mod:`.contract`: the backend contract checker (``check_backend_class``);
* :mod:`.versions`: the plugin API version handshake;
* :mod:`.manager`: ``BackendRegistry``, which loads the plugins and ties the rest together;
* :mod:`.process`: the process-wide registry, fork handling, module-level functions.

What this package does not do: hold backend code (the ``disabled`` backend lives in
:mod:`cuda_graph_runner.backend`), import any plugin when it is imported (the scan runs
on first use), or decide runner policy (sizes, padding, fallbacks). What ``resolve`` accepts as a
config is converted by :func:`cuda_graph_runner.config.as_config`, the runners' one conversion.

Contract checks (when a backend class is checked against ``BaseCudaGraphBackend``):

* a spec whose ``backend_class`` is a class object (in-process plugins) is checked when
  it registers: nothing extra is imported;
* a spec whose ``backend_class`` is a ``"module:Class"`` string is checked when that
  backend is first resolved, or when :func:`verify` / :func:`verify_all` asks for it
  (what a CLI ``backends --check`` calls). Discovery and listing never import backend code,
  so one vendor's heavy or broken module costs nothing to users of another backend.

Either way the outcome is recorded on the entry: a violation marks the backend
``failed`` with a message naming the class, the method and the parameter, and
``list_backends`` shows it from then on; the other backends are untouched.

Every failure is kept on the entry it belongs to (``list_backends`` shows it, with the
original exception in ``error`` and chained when resolving); it never stops the other
plugins from loading. Strict mode (``CUDA_GRAPH_RUNNER_STRICT_PLUGINS=1`` or
``BackendRegistry(strict=True)``) re-raises instead.

Isolation: whatever loading one entry point raises (any exception, ``SystemExit`` and an
``ImportError`` from a lazy module ``__getattr__`` included; only ``KeyboardInterrupt``
propagates) marks that plugin ``failed`` with the cause; a distribution whose METADATA
lacks ``Name`` is listed as ``<unnamed distribution at PATH>``. A plugin that lists,
resolves or registers while it is being loaded gets :class:`RegistryReentryError`.

Threads: listing, resolving and registering are safe from any thread (one lock; readers
iterate over snapshots); a thread that asks while another scans waits for the complete
registry. The registry never writes to a plugin's class: the registered name is set on
each backend instance ``resolve`` builds.

Environment variables (parsed by :mod:`cuda_graph_runner.backend.envs`; booleans accept
1/0/true/false/yes/no/on/off; read when the registry first scans):

* ``CUDA_GRAPH_RUNNER_PLUGINS``: comma-separated entry-point (backend) names or
  distribution names to autoload; unset means all, empty means none (as llm's and
  datasette's plugin-list variables do).
* ``CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point (built-ins and
  ``register()`` still work), like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``.
* ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS=1``: a plugin failure raises instead of being listed.
* ``CUDA_GRAPH_RUNNER_PREFER="name=distribution,..."``: which distribution's backend to
  use when several register the same name (same as :func:`prefer`).
* ``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S`` (default 60, 0: no limit; read when a registry is
  created, as ``BackendRegistry(probe_timeout_s=...)``): seconds one availability probe
  may take; a slower one is listed unavailable ("timed out"), the others still listed.
  Probe answers are kept per probe and device type for the registry's lifetime.

:func:`reset_registry` rescans and keeps earlier :func:`register` and :func:`prefer`
calls (``keep_in_process=False`` drops them). The scan result is per process: a forked
child inherits the parent's scanned registry (including ``register()`` calls); a spawned
child scans again and sees the same installed plugins under the same environment, but
not the parent's ``register()`` calls.
"""

from __future__ import annotations

import importlib
import warnings
from typing import Any

from .contract import check_backend_class
from .discovery import ENV_DISABLE_AUTOLOAD, ENV_PLUGINS
from .entries import (
    AVAILABLE,
    CONFLICT,
    FAILED,
    IN_PROCESS,
    PHASES,
    UNAVAILABLE,
    BackendEntry,
    EntryStatus,
    default_device_type,
)
from .manager import ENV_PREFER, ENV_STRICT, BackendRegistry
from .process import (
    backend_phases,
    backend_problems,
    check_environment,
    environment_variables,
    get_registry,
    list_backends,
    prefer,
    register,
    reset_registry,
    resolve_decode_backend,
    resolve_prefill_backend,
    verify,
    verify_all,
)

__all__ = [
    "AVAILABLE",
    "CONFLICT",
    "ENV_DISABLE_AUTOLOAD",
    "ENV_PLUGINS",
    "ENV_PREFER",
    "ENV_STRICT",
    "FAILED",
    "IN_PROCESS",
    "PHASES",
    "UNAVAILABLE",
    "BackendEntry",
    "BackendRegistry",
    "EntryStatus",
    "backend_phases",
    "backend_problems",
    "check_backend_class",
    "default_device_type",
    "get_registry",
    "list_backends",
    "prefer",
    "register",
    "reset_registry",
    "resolve_decode_backend",
    "resolve_prefill_backend",
    "verify",
    "verify_all",
    "environment_variables",
    "check_environment",
]

#: Deprecated names of this package -> the (module, name) each reads; reading one warns once
#: per name (``DeprecationWarning``).
_MOVED_NAMES = {
    "BackendConflictError": ("cuda_graph_runner.backend.errors", "BackendConflictError"),
    "BackendContractError": ("cuda_graph_runner.backend.errors", "BackendContractError"),
    "BackendLoadError": ("cuda_graph_runner.backend.errors", "BackendLoadError"),
    "BackendUnavailableError": ("cuda_graph_runner.backend.errors", "BackendUnavailableError"),
    "RegistryReentryError": ("cuda_graph_runner.backend.errors", "RegistryReentryError"),
    "UnknownBackendError": ("cuda_graph_runner.backend.errors", "UnknownBackendError"),
    "BackendSpec": ("cuda_graph_runner.backend.hookspecs", "BackendSpec"),
    "ENTRY_POINT_GROUP": ("cuda_graph_runner.backend.hookspecs", "ENTRY_POINT_GROUP"),
    "PLUGIN_API_VERSION": ("cuda_graph_runner.backend.hookspecs", "PLUGIN_API_VERSION"),
    "WELL_KNOWN_DISTRIBUTIONS": ("cuda_graph_runner.config", "WELL_KNOWN_DISTRIBUTIONS"),
    "CORE_DISTRIBUTION": ("cuda_graph_runner.registry.versions", "CORE_DISTRIBUTION"),
    "api_version_problem": ("cuda_graph_runner.registry.versions", "api_version_problem"),
    "RUNNER_CALLS": ("cuda_graph_runner.registry.contract", "RUNNER_CALLS"),
    "_load_ref": ("cuda_graph_runner.registry.discovery", "load_ref"),
    "_normalize_dist": ("cuda_graph_runner.registry.discovery", "normalize_dist"),
    "_spec_problem": ("cuda_graph_runner.registry.entries", "spec_problem"),
}


def __getattr__(name: str) -> Any:
    moved = _MOVED_NAMES.get(name)
    if moved is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module, attribute = moved
    warnings.warn(
        f"{__name__}.{name} is deprecated: import {attribute} from {module} instead "
        "(the old name is removed in the next release)",
        DeprecationWarning,
        stacklevel=2,
    )
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value

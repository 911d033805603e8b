"""Backend registry: discovery through entry points, pluggy hooks, resolve by name.

How a backend is found (the torch ``torch_dynamo_backends`` / OpenTelemetry model):

1. The entry-point group ``cuda_graph_runner.backends`` is scanned once (cached); the
   entry-point name is the backend name users write in config.
2. Each entry point names a light *registration module* implementing the hooks of
   :mod:`cuda_graph_runner.hookspecs`; it is registered with a ``pluggy.PluginManager``
   and contributes ``BackendSpec`` records. Backend classes are not imported yet.
3. ``resolve_decode_backend`` / ``resolve_prefill_backend`` import the one class that
   was asked for, check it against the contract and build it.

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

Environment variables (parsed by :mod:`cuda_graph_runner.envs`; booleans accept
1/0/true/false/yes/no/on/off; read when the registry first scans):

* ``CUDA_GRAPH_RUNNER_PLUGINS``: comma-separated entry-point (backend) names or
  distribution names to autoload; unset means all, empty means none (llm/datasette).
* ``CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point (built-ins and
  ``register()`` still work), like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``.
* ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS=1``: a plugin failure raises instead of being listed.
* ``CUDA_GRAPH_RUNNER_PREFER="name=distribution,..."``: which distribution's backend to
  use when several register the same name (same as :func:`prefer`).

:func:`reset_registry` rescans and keeps earlier :func:`register` and :func:`prefer`
calls (``keep_in_process=False`` drops them). The scan result is per process: a forked child inherits the parent's scanned registry
(including ``register()`` calls); a spawned child scans again and sees the same
installed plugins under the same environment, but not the parent's ``register()`` calls.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import re
import threading
import warnings
import weakref
from importlib import metadata
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import pluggy

from . import backend_options, conflicts, envs, hookspecs
from .errors import (
    BackendConflictError,
    BackendContractError,
    BackendLoadError,
    BackendUnavailableError,
    RegistryReentryError,
    UnknownBackendError,
)
from .config import WELL_KNOWN_DISTRIBUTIONS  # noqa: F401 - re-exported for the error hints
from .hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec

# Parsed by :mod:`cuda_graph_runner.envs` (one parser for every CUDA_GRAPH_RUNNER_* flag).
ENV_PLUGINS = envs.PLUGINS
ENV_DISABLE_AUTOLOAD = envs.DISABLE_PLUGIN_AUTOLOAD
ENV_STRICT = envs.STRICT_PLUGINS
ENV_PREFER = envs.PREFER

CORE_DISTRIBUTION = "cuda-graph-runner"
IN_PROCESS = "<in-process>"

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
FAILED = "failed"
#: Several distributions register the name and none is preferred (CUDA_GRAPH_RUNNER_PREFER).
CONFLICT = "conflict"

PHASES = ("decode", "prefill")
# Same rule as the config's backend names: a spec name the config cannot spell is useless.
_BACKEND_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_API_VERSION = re.compile(r"(\d+)\.(\d+)")
_HOOK_NAMES = ("cuda_graph_runner_backend_specs", "cuda_graph_runner_default_backend")


@dataclasses.dataclass
class BackendEntry:
    """One row of ``list_backends()``.

    Attributes:
        name: backend name.
        distribution, version: the distribution that registered it (``"<in-process>"``
            for ``register()``).
        phases, devices: from its spec (empty when the plugin failed before giving one).
        status: ``"available"``, ``"unavailable"`` (installed, cannot run here) or
            ``"failed"`` (the plugin is broken) or ``"conflict"`` (several distributions
            register the name; ``distribution`` lists them all).
        reason: why it is not available, one line; None when available.
        error: the original exception, when there was one.
        spec: the ``BackendSpec``, when the plugin gave one.
        contract: ``""`` (class not checked yet), ``"ok"``, ``"failed"`` (see ``reason``)
            or ``"not checked: <why>"`` (:meth:`BackendRegistry.verify` could not import
            the class on a machine where the backend is unavailable anyway).
    """

    name: str
    distribution: str
    version: str
    phases: Tuple[str, ...] = ()
    devices: Tuple[str, ...] = ()
    status: str = AVAILABLE
    reason: Optional[str] = None
    error: Optional[BaseException] = None
    spec: Optional[BackendSpec] = None
    contract: str = ""
    _class: Optional[type] = dataclasses.field(default=None, repr=False)
    # Set when the status was decided at registration (bad spec, API mismatch) and no
    # device probe may override it.
    _fixed: bool = dataclasses.field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == AVAILABLE

    @property
    def api_version(self) -> Optional[str]:
        """The plugin API version its spec declares (None: undeclared)."""
        return self.spec.api_version if self.spec is not None else None

    def as_row(self) -> Dict[str, str]:
        """Plain strings, for tables and JSON."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "phases": ",".join(self.phases),
            "devices": ",".join(self.devices),
            "status": self.status,
            "reason": self.reason or "",
            "api_version": self.api_version or "",
            "contract": self.contract,
        }


def _load_ref(ref: Union[str, Any]) -> Any:
    """Import ``"module:attr.path"``; objects pass through.

    Raises:
        ValueError: ``ref`` is not of that form.
        ImportError: the module does not import.
        AttributeError: the module lacks the attribute (the message names both).
    """
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reference {ref!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError as exc:
            raise AttributeError(f"{module_name!r} has no attribute {attr_path!r} ({exc})") from exc
    return obj


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _normalize_dist(name: str) -> str:
    # PEP 503 normalisation, so "Acme_Backend" and "acme-backend" are the same distribution.
    return re.sub(r"[-_.]+", "-", name).lower()


def api_version_problem(declared: Optional[str]) -> Optional[str]:
    """Why a plugin declaring API ``declared`` cannot run on this core, or None if it can.

    Same major, and a minor no newer than the core's, is compatible (minors only add).
    None (undeclared) is accepted.
    """
    if declared is None:
        return None
    got = _API_VERSION.fullmatch(str(declared))
    if got is None:
        return f"declares plugin API version {declared!r}, which is not of the form 'major.minor'"
    core = _API_VERSION.fullmatch(PLUGIN_API_VERSION)
    assert core is not None
    (p_major, p_minor), (c_major, c_minor) = map(int, got.groups()), map(int, core.groups())
    if p_major != c_major:
        return f"implements plugin API {declared}, but this core provides plugin API {PLUGIN_API_VERSION}"
    if p_minor > c_minor:
        return (f"implements plugin API {declared}, newer than the {PLUGIN_API_VERSION} this core provides; "
                f"upgrade {CORE_DISTRIBUTION}")
    return None


def _api_compatible(declared: Optional[str]) -> bool:
    return api_version_problem(declared) is None


class _BuiltinPlugin:
    """The core's own plugin: backend ``disabled`` and the last-resort default."""

    @hookspecs.hookimpl
    def cuda_graph_runner_backend_specs(self) -> List[BackendSpec]:
        from .backend import DisabledBackend

        return [
            BackendSpec(
                name="disabled",
                backend_class=DisabledBackend,
                phases=("decode", "prefill"),
                devices=("*",),
                api_version=PLUGIN_API_VERSION,
                description="no graphs: every batch runs eagerly",
            )
        ]

    @hookspecs.hookimpl(trylast=True)
    def cuda_graph_runner_default_backend(self, phase: str, device_type: str) -> Optional[str]:
        return "disabled"


def _env_flag(name: str) -> bool:
    return bool(envs.get(name))


_registries: "weakref.WeakSet[BackendRegistry]" = weakref.WeakSet()


class BackendRegistry:
    """Discovers, lists and resolves backends. Most code uses the module-level functions.

    Args:
        group: entry-point group to scan.
        autoload: scan entry points at all (the environment can turn it off too).
        strict: re-raise plugin failures instead of listing them; None reads
            ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS``.
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP, *, autoload: bool = True,
                 strict: Optional[bool] = None) -> None:
        self.group = group
        self.autoload = autoload
        self.strict = _env_flag(ENV_STRICT) if strict is None else strict
        # Guards every read and write of the tables below; readers iterate over snapshots
        # taken under it, so register() from another thread never breaks a listing.
        self._lock = threading.RLock()
        self._scanned = False
        self._scan_error: Optional[BaseException] = None
        # The thread running the scan, so a plugin that lists or resolves while it is
        # being loaded gets RegistryReentryError instead of a half-built view.
        self._scanning_thread: Optional[int] = None
        # register()/prefer() calls made on this registry, replayed after reset_registry().
        self._in_process: Dict[str, Tuple[BackendSpec, bool]] = {}
        self._preferred: Dict[str, str] = {}
        self._replay: Tuple[Dict[str, Tuple[BackendSpec, bool]], Dict[str, str]] = ({}, {})
        self._entries: Dict[str, BackendEntry] = {}
        self._conflicts: Dict[str, List[BackendEntry]] = {}
        # Entry points installed but not loaded (autoload off or not listed): name -> (dist, why).
        self._skipped: Dict[str, Tuple[str, str]] = {}
        # pluggy plugin name -> backend names it contributed, to blame a raising hook.
        self._plugin_backends: Dict[str, List[str]] = {}
        #: Problems that belong to no single backend (a malformed ``CUDA_GRAPH_RUNNER_PREFER``).
        self.problems: List[str] = []
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.BackendHookSpecs)
        _registries.add(self)
        self._register_plugin(_BuiltinPlugin(), distribution=CORE_DISTRIBUTION, version=_dist_version(CORE_DISTRIBUTION))

    # -- discovery ------------------------------------------------------------------
    def _read_environment(self) -> Dict[str, Any]:
        """The scan's environment variables, parsed (:mod:`envs`).

        Raises:
            envs.EnvVarError: a value does not parse (names variable, value, accepted values).
        """
        return {"autoload_off": envs.get(ENV_DISABLE_AUTOLOAD), "plugins": envs.get(ENV_PLUGINS),
                "plugins_text": envs.raw(ENV_PLUGINS), "prefer": envs.get(ENV_PREFER)}

    def _all_entry_points(self) -> List[metadata.EntryPoint]:
        try:
            return list(metadata.entry_points(group=self.group))
        except Exception as exc:
            # A malformed distribution can break importlib's walk over all of them:
            # read the distributions one by one so it hides no other plugin.
            self._problem(f"importlib.metadata.entry_points() raised {_one_line(exc)}; "
                          "reading installed distributions one by one")
        eps: List[metadata.EntryPoint] = []
        for dist in metadata.distributions():
            try:
                eps.extend(ep for ep in dist.entry_points if ep.group == self.group)
            except Exception as exc:
                self._problem(f"cannot read the entry points of {_dist_label(dist)}: {_one_line(exc)}")
        return eps

    def _entry_points(self, env: Mapping[str, Any]) -> Iterable[metadata.EntryPoint]:
        eps = self._all_entry_points()
        if not self.autoload or env["autoload_off"]:
            why = (f"plugin autoload is off ({ENV_DISABLE_AUTOLOAD}=1)" if self.autoload
                   else "plugin autoload is off (BackendRegistry(autoload=False))")
            for ep in eps:
                self._skipped.setdefault(ep.name, (_ep_dist(ep)[0], why))
            return []
        if env["plugins"] is not None:
            allowed = env["plugins_text"]
            names = set(env["plugins"])
            normalized = {_normalize_dist(n) for n in names}
            kept = []
            for ep in eps:
                if ep.name in names or _normalize_dist(_ep_dist(ep)[0]) in normalized:
                    kept.append(ep)
                else:
                    self._skipped.setdefault(ep.name, (_ep_dist(ep)[0], f"{ENV_PLUGINS}={allowed!r} does not list it"))
            eps = kept
        return eps

    def _scan(self) -> None:
        """Scan the entry points once; every public method calls this first.

        Another thread waits for a scan in progress and then sees the complete registry.

        Raises:
            RegistryReentryError: called from code that the scan itself is running (a
                plugin listing or resolving backends while it is imported).
            envs.EnvVarError: a registry environment variable does not parse (nothing is
                cached: fix it and call again).
            BackendLoadError, BackendConflictError, ValueError: strict mode, a plugin
                failed; raised again on every later call.
        """
        if self._scanned and self._scan_error is None:
            return
        if self._scanning_thread == threading.get_ident():
            raise RegistryReentryError(
                "the backend registry was used while it is loading plugins (a plugin listed, resolved or "
                "registered backends while being imported, or from a hook during the scan); the list is "
                "incomplete until loading ends: do it lazily, at resolve time, and contribute backends "
                "through the cuda_graph_runner_backend_specs hook")
        with self._lock:
            if self._scan_error is not None:
                # Strict mode: the registry is half-built, so every use fails the same way.
                raise self._scan_error
            if self._scanned:
                return
            env = self._read_environment()
            self._scanning_thread = threading.get_ident()
            try:
                self._scan_entry_points(env)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    self._scan_error = BackendLoadError(
                        "the plugin scan was interrupted (KeyboardInterrupt); call "
                        "cuda_graph_runner.registry.reset_registry() to scan again")
                else:
                    self._scan_error = exc
                raise
            finally:
                self._scanning_thread = None
                self._scanned = True

    def _scan_entry_points(self, env: Mapping[str, Any]) -> None:
        seen: set = set()
        for ep in self._entry_points(env):
            dist_name, version = _ep_dist(ep)
            # The same distribution can be seen twice when sys.path lists it twice.
            if (ep.name, dist_name, ep.value) in seen:
                continue
            seen.add((ep.name, dist_name, ep.value))
            try:
                plugin = self._load_entry_point(ep, dist_name, version)
                self._register_plugin(plugin, distribution=dist_name, version=version, expected_name=ep.name)
            except BaseException as exc:  # one plugin, whatever it raises, never breaks the others
                if isinstance(exc, KeyboardInterrupt) or self.strict:
                    raise
                err = exc if isinstance(exc, BackendLoadError) else BackendLoadError(
                    f"entry point {ep.name} = {ep.value!r} of {dist_name} {version}: loading raised {_one_line(exc)}")
                cause = err.__cause__ or exc
                self._add_entry(BackendEntry(ep.name, dist_name, version, status=FAILED,
                                             reason=str(err), error=cause, _fixed=True))
        self._apply_preferences(env["prefer"])
        self._replay_in_process()

    def _replay_in_process(self) -> None:
        # register()/prefer() calls made before reset_registry(): they stay in effect.
        specs, preferred = self._replay
        self._replay = ({}, {})
        for spec, replace in specs.values():
            try:
                self._register_now(spec, replace=replace)
                self._in_process[spec.name] = (spec, replace)
            except Exception as exc:
                self._problem(f"register({spec.name!r}) made before reset_registry() could not be kept: "
                              f"{_one_line(exc)}", force_warning=True)
        for name, dist in preferred.items():
            try:
                self._prefer_now(name, dist)
                self._preferred[name] = dist
            except UnknownBackendError as exc:
                self._problem(f"prefer({name!r}, {dist!r}) made before reset_registry() could not be kept: "
                              f"{exc}", force_warning=True)

    def _load_entry_point(self, ep: metadata.EntryPoint, dist_name: str, version: str) -> Any:
        """``ep.load()``, with a message that says which part failed.

        Raises:
            BackendLoadError: the module does not import, or lacks the attribute the entry
                point names; the original exception is chained.
        """
        where = f"entry point {ep.name} = {ep.value!r} of {dist_name} {version}"
        module_name, _, attr_path = ep.value.partition(":")
        module_name, attr_path = module_name.strip(), attr_path.split("[")[0].strip()
        try:
            obj: Any = importlib.import_module(module_name)
        except BaseException as exc:  # a broken plugin must not break the others, even SystemExit
            if isinstance(exc, KeyboardInterrupt):
                raise
            raise BackendLoadError(f"{where}: import of module {module_name!r} failed: {_one_line(exc)}") from exc
        for part in attr_path.split(".") if attr_path else ():
            try:
                obj = getattr(obj, part)
            except AttributeError as exc:
                raise BackendLoadError(
                    f"{where}: module {module_name!r} has no attribute {attr_path!r}") from exc
            except BaseException as exc:  # a lazy module __getattr__ may raise anything (ImportError)
                if isinstance(exc, KeyboardInterrupt):
                    raise
                raise BackendLoadError(
                    f"{where}: getting attribute {attr_path!r} of module {module_name!r} raised {_one_line(exc)}") from exc
        return obj

    def _register_plugin(self, plugin: Any, *, distribution: str, version: str,
                         expected_name: Optional[str] = None) -> None:
        label = f"{distribution}:{expected_name or getattr(plugin, '__name__', type(plugin).__name__)}"
        what = f"plugin {expected_name or label!r} of {distribution} {version}"
        try:
            if self.pm.is_registered(plugin):
                # One module serving several entry points: specs were already collected.
                self._same_module_again(plugin, distribution, version, expected_name)
                return
            self.pm.register(plugin, name=label)
            unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if hc.spec is None]
            if unknown:
                raise BackendLoadError(
                    f"{what} implements unknown hook(s) {sorted(unknown)}; this core "
                    f"(plugin API {PLUGIN_API_VERSION}) defines {list(_HOOK_NAMES)}")
            caller = self.pm.subset_hook_caller(
                "cuda_graph_runner_backend_specs",
                remove_plugins=[p for p in self.pm.get_plugins() if p is not plugin],
            )
            specs: List[Any] = []
            for result in caller():
                if result is None:
                    continue
                if isinstance(result, (str, bytes, Mapping)) or not isinstance(result, Iterable):
                    raise TypeError(
                        f"cuda_graph_runner_backend_specs must return a list of BackendSpec, got {type(result).__name__}")
                specs.extend(result)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            if self.strict:
                if isinstance(exc, BackendLoadError):
                    raise
                raise BackendLoadError(f"{what}: hook cuda_graph_runner_backend_specs raised {_one_line(exc)}") from exc
            reason = str(exc) if isinstance(exc, BackendLoadError) else (
                f"hook cuda_graph_runner_backend_specs raised {_one_line(exc)}")
            self._add_entry(BackendEntry(expected_name or label, distribution, version, status=FAILED,
                                         reason=reason, error=exc, _fixed=True))
            return
        names = [str(getattr(s, "name", s)) for s in specs]
        self._plugin_backends[label] = names
        if expected_name is not None and expected_name not in names:
            reason = f"entry point {expected_name!r} gave no spec of that name (got {names})"
            if isinstance(plugin, type) and any(c.__name__ == "BaseCudaGraphBackend" for c in plugin.__mro__):
                reason = (f"entry point {expected_name!r} names the backend class {plugin.__qualname__}; it must "
                          "name a registration module with a @hookimpl cuda_graph_runner_backend_specs")
            if self.strict:
                raise BackendLoadError(f"{what}: {reason}")
            self._add_entry(BackendEntry(expected_name, distribution, version, status=FAILED, reason=reason, _fixed=True))
        for spec in specs:
            entry = self._entry_from_spec(spec, distribution, version)
            if self.strict and entry.status == FAILED:
                raise BackendLoadError(f"{what}: {entry.reason}") from entry.error
            self._add_entry(entry)

    def _same_module_again(self, plugin: Any, distribution: str, version: str, expected_name: Optional[str]) -> None:
        # A release and a nightly naming the same module: Python imported it once, from one
        # of them, so attributing the backend to the first distribution found would hide
        # which code runs. Report both as a conflict.
        owner = self.pm.get_name(plugin) or ""
        if _normalize_dist(owner.partition(":")[0]) == _normalize_dist(distribution):
            return
        names = self._plugin_backends.get(owner, [])
        for name in ([expected_name] if expected_name in names else names):
            group = self._conflicts.get(name) or [self._entries.get(name)]
            base = next((e for e in group if e is not None and e.spec is not None), None)
            if base is None or any(_normalize_dist(e.distribution) == _normalize_dist(distribution)
                                   for e in group if e is not None):
                continue
            self._add_entry(dataclasses.replace(base, distribution=distribution, version=version, _class=None))
            group = self._conflicts[name]
            reason = conflicts.shared_module_reason(
                name, getattr(plugin, "__name__", repr(plugin)), conflicts.loaded_from(plugin),
                [(e.distribution, e.version) for e in group], ENV_PREFER)
            conflict = self._entries[name]
            conflict.reason, conflict.error = reason, BackendConflictError(reason)

    def _entry_from_spec(self, spec: Any, distribution: str, version: str) -> BackendEntry:
        if not isinstance(spec, BackendSpec):
            return BackendEntry(str(getattr(spec, "name", spec)), distribution, version, status=FAILED,
                                reason=f"hook returned {type(spec).__name__}, expected BackendSpec", _fixed=True)
        problem = _spec_problem(spec)
        phases = tuple(spec.phases) if isinstance(spec.phases, (tuple, list)) else ()
        devices = tuple(spec.devices) if isinstance(spec.devices, (tuple, list)) else ()
        entry = BackendEntry(spec.name, distribution, version, phases, devices, spec=spec)
        if problem:
            entry.status, entry.reason, entry._fixed = FAILED, f"invalid BackendSpec: {problem}", True
            return entry
        api_problem = api_version_problem(spec.api_version)
        if api_problem:
            entry.status, entry._fixed = UNAVAILABLE, True
            entry.reason = (f"{distribution} {version} {api_problem}: install versions of {distribution} and "
                            f"{CORE_DISTRIBUTION} that match")
            return entry
        if isinstance(spec.backend_class, type):
            # A class object costs nothing more to check now: it is already imported.
            try:
                check_backend_class(spec.backend_class, spec.name)
            except BackendContractError as err:
                entry.status, entry.reason, entry.error, entry._fixed = FAILED, str(err), err, True
                entry.contract = FAILED
                return entry
            entry.contract = "ok"
        return entry

    def _add_entry(self, entry: BackendEntry) -> None:
        existing = self._entries.get(entry.name)
        if existing is None:
            self._entries[entry.name] = entry
            return
        if existing.distribution == entry.distribution and existing.status == FAILED:
            self._entries[entry.name] = entry
            return
        group = self._conflicts.setdefault(entry.name, [existing])
        group.append(entry)
        self._entries[entry.name] = self._conflict_entry(entry.name, group)

    def _conflict_entry(self, name: str, group: List[BackendEntry]) -> BackendEntry:
        dists = ", ".join(f"{e.distribution} {e.version}".strip() for e in group)
        first = group[0].distribution
        reason = (f"backend name {name!r} is registered by several distributions: {dists}; uninstall all but "
                  f"one, or choose one with {ENV_PREFER}=\"{name}={first}\" or "
                  f"cuda_graph_runner.registry.prefer({name!r}, {first!r})")
        return BackendEntry(name, dists, "", group[-1].phases, group[-1].devices, status=CONFLICT, reason=reason,
                            error=BackendConflictError(reason), _fixed=True)

    def _apply_preferences(self, text: str) -> None:
        for item in (i.strip() for i in text.split(",")):
            if not item:
                continue
            name, sep, dist = (p.strip() for p in item.partition("="))
            if not sep or not name or not dist:
                self._problem(f"{ENV_PREFER}: {item!r} is not of the form name=distribution")
                continue
            if name not in self._entries:
                self._problem(f"{ENV_PREFER}: no installed plugin registers backend {name!r} (asked for {dist})")
                continue
            try:
                self._prefer_now(name, dist)
            except UnknownBackendError as err:
                # Honour the pin: using another distribution's backend silently would
                # defeat its purpose, so the name is unusable until the pin is fixed.
                reason = f"{ENV_PREFER} asks for {name}={dist}, but {err}"
                if self.strict:
                    raise BackendConflictError(reason) from err
                current = self._entries[name]
                self._entries[name] = dataclasses.replace(current, status=FAILED, reason=reason, error=err, _fixed=True)

    def _problem(self, message: str, *, force_warning: bool = False) -> None:
        if self.strict and not force_warning:
            raise ValueError(message)
        self.problems.append(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    # -- public API -----------------------------------------------------------------
    def register(self, spec: BackendSpec, *, replace: bool = False) -> None:
        """Register a backend in-process (tests, notebooks); no entry point needed.

        A class object in ``spec.backend_class`` is checked against the contract now; a
        ``"module:Class"`` string when it is resolved or verified.

        Raises:
            BackendConflictError: ``spec.name`` exists and ``replace`` is False.
            BackendContractError: the class breaks the contract (names class, method, parameter).
            ValueError: the spec is malformed (bad name, phases, devices, references).
        """
        self._scan()
        with self._lock:
            self._register_now(spec, replace=replace)
            self._in_process[spec.name] = (spec, replace)

    def _register_now(self, spec: BackendSpec, *, replace: bool) -> None:
        with self._lock:
            if spec.name in self._entries and not replace:
                raise BackendConflictError(
                    f"backend {spec.name!r} is already registered by {self._entries[spec.name].distribution}; "
                    "pass replace=True to override it in this process")
            entry = self._entry_from_spec(spec, IN_PROCESS, "")
            if isinstance(entry.error, BackendContractError):
                raise entry.error
            if entry.status == FAILED:
                raise ValueError(f"backend {spec.name!r}: {entry.reason}")
            self._entries[spec.name] = entry
            self._conflicts.pop(spec.name, None)

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (no error if absent); reset_registry() no longer keeps it."""
        with self._lock:
            self._entries.pop(name, None)
            self._conflicts.pop(name, None)
            self._in_process.pop(name, None)

    def prefer(self, name: str, distribution: str) -> None:
        """Resolve a name registered by several distributions to ``distribution``'s.

        Names compare after PEP 503 normalisation (``Acme_Backend`` = ``acme-backend``).

        Raises:
            UnknownBackendError: no distribution of that name registers ``name``.
        """
        self._scan()
        with self._lock:
            self._prefer_now(name, distribution)
            self._preferred[name] = distribution

    def _prefer_now(self, name: str, distribution: str) -> None:
        with self._lock:
            if name in self._conflicts:
                candidates = self._conflicts[name]
            elif name in self._entries:
                candidates = [self._entries[name]]
            else:
                candidates = []
            for entry in candidates:
                if _normalize_dist(entry.distribution) == _normalize_dist(distribution):
                    self._entries[name] = entry
                    return
            found = ", ".join(e.distribution for e in candidates) or "none"
            raise UnknownBackendError(f"no distribution {distribution!r} registers backend {name!r} (found: {found})")

    def entries(self, device_type: Optional[str] = None) -> List[BackendEntry]:
        """All entries, each probed for ``device_type``.

        With ``device_type=None`` each backend is probed on its own first device type
        ("can it run on this machine?"); ``"*"`` backends on the machine's accelerator.
        """
        rows = []
        for entry in sorted(self._snapshot(), key=lambda e: e.name):
            # Probes run plugin code: outside the lock, on the snapshot.
            rows.append(self._probe(entry, device_type or _natural_device(entry)))
        return rows

    def _snapshot(self) -> List[BackendEntry]:
        """The registered entries now (scanned first); safe against concurrent register()."""
        self._scan()
        with self._lock:
            return list(self._entries.values())

    def names(self) -> List[str]:
        return sorted(e.name for e in self._snapshot())

    def backend_phases(self) -> Dict[str, frozenset]:
        """``{name: phases}`` of every backend that registered (for config validation)."""
        return {e.name: frozenset(e.phases) for e in self._snapshot() if e.status not in (FAILED, CONFLICT)}

    def backend_problems(self) -> Dict[str, str]:
        """``{name: why it cannot be used}`` of backends that are installed but failed or in
        conflict (what ``config`` says instead of "not installed")."""
        return {e.name: (f"installed but failed: {e.reason}" if e.status == FAILED
                         else f"installed twice: {e.reason}")
                for e in self._snapshot() if e.status in (FAILED, CONFLICT)}

    def default_backend(self, phase: str, device_type: str) -> str:
        """The default backend name for ``phase`` on ``device_type`` (hook ``default_backend``).

        Every plugin's claim is gathered; see :meth:`default_decision` for the rule.
        Falls back to ``"disabled"`` when no claim is usable here. A plugin whose hook
        raises is marked failed and skipped (strict mode: re-raised).

        Raises:
            BackendLoadError: strict mode only, a plugin's hook raised.
        """
        return self.default_decision(phase, device_type).backend

    def default_decision(self, phase: str, device_type: str) -> "conflicts.DefaultDecision":
        """Who sets the default for ``phase`` on ``device_type``, and who else claimed it.

        A claim whose backend cannot run here passes to the next claimant; among usable
        claims the highest priority wins, then the backend name, then the distribution
        name (:mod:`cuda_graph_runner.conflicts`): never install or ``sys.path`` order.
        With several claimants a ``RuntimeWarning`` names each claim once (once per
        registry, phase and device type).

        Raises:
            BackendLoadError: strict mode only, a plugin's hook raised.
        """
        self._scan()
        claims = []
        for impl, (backend, priority) in self._call_default_hook(phase, device_type):
            usable, why = self._claim_usable(backend, phase, device_type)
            claims.append(conflicts.Claim(backend, priority, impl.plugin_name,
                                          impl.plugin_name.partition(":")[0], usable, why))
        decision = conflicts.choose_default(phase, device_type, claims)
        message = conflicts.contest_warning(decision)
        warned = self.__dict__.setdefault("_warned_defaults", set())
        if message and (phase, device_type, decision.claims) not in warned:
            warned.add((phase, device_type, decision.claims))
            warnings.warn(message, RuntimeWarning, stacklevel=3)
        return decision

    def _claim_usable(self, name: str, phase: str, device_type: str) -> Tuple[bool, str]:
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            return False, "no installed plugin registers it"
        entry = self._probe(entry, device_type)
        if not entry.ok:
            return False, f"{entry.status}: {entry.reason}"
        if phase not in entry.phases:
            return False, f"does not support phase {phase!r}"
        return True, ""

    def _call_default_hook(self, phase: str, device_type: str) -> List[Tuple[Any, Tuple[str, int]]]:
        # pluggy stops a hook call at the first raising impl (and at the first answer:
        # firstresult), so one vendor's bug or install order would decide the default;
        # call the impls one by one and keep every claim instead.
        args = {"phase": phase, "device_type": device_type}
        hook = self.pm.hook.cuda_graph_runner_default_backend
        claims = []
        for impl in reversed(hook.get_hookimpls()):  # pluggy's call order
            if impl.hookwrapper or impl.wrapper or isinstance(impl.plugin, _BuiltinPlugin):
                continue  # the core's "disabled" is the fallback, not a claim
            try:
                result = impl.function(*[args[a] for a in impl.argnames])
                if result is None:
                    continue
                claims.append((impl, conflicts.as_claim(result)))
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                message = (f"plugin {impl.plugin_name}: hook cuda_graph_runner_default_backend(phase={phase!r}, "
                           f"device_type={device_type!r}) raised {_one_line(exc)}")
                if self.strict:
                    raise BackendLoadError(message) from exc
                self._blame_plugin(impl.plugin_name, impl.plugin, message, exc)
                continue
        return claims

    def _blame_plugin(self, plugin_name: str, plugin: Any, message: str, exc: BaseException) -> None:
        with self._lock:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            for name in self._plugin_backends.get(plugin_name, []):
                entry = self._entries.get(name)
                if entry is not None and plugin_name.startswith(f"{entry.distribution}:"):
                    self._entries[name] = dataclasses.replace(entry, status=FAILED, reason=message, error=exc,
                                                              _fixed=True)

    def get(self, name: str, *, device_type: Optional[str] = None, phase: Optional[str] = None) -> BackendEntry:
        """The usable entry of ``name``.

        Raises:
            UnknownBackendError: no plugin provides ``name`` (lists what is installed).
            BackendConflictError: several distributions register ``name`` and none is preferred.
            BackendContractError, BackendLoadError: an earlier resolve or verify found its
                class broken or unimportable (the recorded error is chained).
            BackendUnavailableError: installed but failed, unusable on ``device_type``,
                or not for ``phase``; the original error is chained.
        """
        self._scan()
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise UnknownBackendError(self._unknown_message(name))
        entry = self._probe(entry, device_type or default_device_type())
        if not entry.ok:
            err = entry.error
            kind = type(err) if isinstance(err, (BackendConflictError, BackendContractError, BackendLoadError)) \
                else BackendUnavailableError
            where = f"{entry.distribution} {entry.version}".strip()
            state = {FAILED: "installed but failed", CONFLICT: "in conflict"}.get(entry.status, entry.status)
            raise kind(f"backend {name!r} ({where}) is {state}: {entry.reason}") from err
        if phase is not None and phase not in entry.phases:
            raise BackendUnavailableError(
                f"backend {name!r} does not support phase {phase!r}; it supports {list(entry.phases)}; "
                f"backends for {phase}: {sorted(e.name for e in self._snapshot() if phase in e.phases)}")
        return entry

    def load_class(self, entry: BackendEntry) -> type:
        """Import and check the backend class of ``entry`` (cached). The outcome is
        recorded on the registered entry, so ``list_backends`` shows a failure afterwards.

        Raises:
            BackendLoadError: the class reference does not import (original chained).
            BackendContractError: the class breaks the backend contract.
        """
        target = self._stored(entry)
        if target._class is not None:
            return target._class
        assert target.spec is not None, f"backend {entry.name!r} has no spec"
        cls = self._import_class(target)
        try:
            check_backend_class(cls, target.name)
        except BackendContractError as err:
            self._record_failure(target, err, contract=FAILED)
            raise
        # The registered name is set on each instance by resolve(), never on the class:
        # an alias of an existing class must not rename that class's other backends.
        with self._lock:
            target._class, target.contract = cls, "ok"
        return cls

    def _stored(self, entry: BackendEntry) -> BackendEntry:
        # get()/entries() hand out probed copies; results belong on the registered entry.
        with self._lock:
            stored = self._entries.get(entry.name)
        return stored if stored is not None and stored.spec is entry.spec else entry

    def _import_class(self, entry: BackendEntry) -> type:
        assert entry.spec is not None
        try:
            return _load_ref(entry.spec.backend_class)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            err = BackendLoadError(
                f"backend {entry.name!r} of {entry.distribution} {entry.version}: cannot import "
                f"{entry.spec.backend_class!r}: {_one_line(exc)}")
            self._record_failure(entry, err)
            raise err from exc

    def _record_failure(self, entry: BackendEntry, err: BaseException, contract: str = "") -> None:
        with self._lock:
            entry.status, entry.reason, entry.error, entry._fixed = FAILED, str(err), err, True
            if contract:
                entry.contract = contract

    def verify(self, name: str) -> BackendEntry:
        """Import the class of ``name`` and check it against the contract, now.

        This is the explicit form of the check ``resolve`` does on first use. The outcome is recorded on the entry, so ``list_backends``
        shows a violation from then on. A backend that is unavailable on this machine
        and whose class cannot even be imported here (a vendor SDK missing) is left
        unavailable with ``contract = "not checked: ..."`` rather than marked failed.

        Returns:
            The entry, probed for its own device type: ``contract`` is ``"ok"``,
            ``"failed"`` (``status`` failed, ``reason`` names class, method, parameter)
            or ``"not checked: ..."``.

        Raises:
            UnknownBackendError: no plugin registers ``name``.
            BackendContractError, BackendLoadError: strict mode only.
        """
        self._scan()
        with self._lock:
            entry = self._entries.get(name)
        if entry is None:
            raise UnknownBackendError(self._unknown_message(name))
        if entry.spec is None or (entry._fixed and entry.status != AVAILABLE) or entry.contract:
            return self._probe(entry, _natural_device(entry))
        probed = self._probe(entry, _natural_device(entry))
        try:
            self.load_class(entry)
        except BackendLoadError as err:
            if probed.status == UNAVAILABLE:
                # The class may import the device SDK at module level: not a contract breach.
                with self._lock:
                    entry.status, entry.reason, entry.error, entry._fixed = AVAILABLE, None, None, False
                    entry.contract = f"not checked: {_one_line(err.__cause__ or err)}"
            elif self.strict:
                raise
        except BackendContractError:
            if self.strict:
                raise
        return self._probe(entry, _natural_device(entry))

    def verify_all(self) -> List[BackendEntry]:
        """:meth:`verify` every registered backend; the checked rows, sorted by name."""
        return [self.verify(name) for name in self.names()]

    def resolve(self, phase: str, config: Any = None, *, device: Any = None, **backend_kwargs: Any) -> Any:
        """Build the backend the config selects for ``phase`` on ``device``.

        Args:
            phase: ``"decode"`` or ``"prefill"``.
            config: a ``CudaGraphConfig``, a ``PhaseConfig``, a mapping like
                ``{"backend": "full"}``, a backend name, or None (the default).
            device: torch device or string; None means the default accelerator.
            backend_kwargs: extra keyword arguments for the backend constructor.

        Returns:
            An instance of the selected ``BaseCudaGraphBackend`` subclass.

        Raises:
            UnknownBackendError, BackendConflictError, BackendUnavailableError,
            BackendLoadError, BackendContractError: see :meth:`get` and :meth:`load_class`.
            cuda_graph_runner.config.CudaGraphConfigError: the config sets a backend option
                (``tc_compiler``) the selected backend does not read; names who reads it.
        """
        from .config import CudaGraphConfig, PhaseConfig

        phase_config = _phase_config(phase, config, CudaGraphConfig, PhaseConfig)
        device_str = str(device) if device is not None else default_device_type()
        device_type = device_str.split(":")[0]
        name = phase_config.backend or self.default_backend(phase, device_type)
        entry = self.get(name, device_type=device_type, phase=phase)
        backend_options.check_resolved(self, phase, config if isinstance(config, CudaGraphConfig) else phase_config,
                                       entry)
        cls = self.load_class(entry)
        backend = cls(device_str, phase=phase, phase_config=phase_config, **backend_kwargs)
        try:
            # On the instance only (see load_class); a class whose ``name`` is read-only keeps its own.
            backend.name = entry.name
        except AttributeError:
            pass
        return backend

    def _probe(self, entry: BackendEntry, device_type: str) -> BackendEntry:
        if entry.status == FAILED or entry.spec is None or entry._fixed:
            return entry
        result = dataclasses.replace(entry, status=AVAILABLE, reason=None, error=None)
        spec = entry.spec
        if "*" not in spec.devices and device_type not in spec.devices:
            result.status = UNAVAILABLE
            result.reason = f"runs on {', '.join(spec.devices)}, not on {device_type}"
            return result
        if spec.probe is not None:
            try:
                reason = _load_ref(spec.probe)(device_type)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    raise
                message = f"probe {_ref_name(spec.probe)}({device_type!r}) raised {_one_line(exc)}"
                if self.strict:
                    raise BackendUnavailableError(f"backend {entry.name!r} of {entry.distribution}: {message}") from exc
                result.status, result.reason, result.error = FAILED, message, exc
                return result
            if reason:
                result.status, result.reason = UNAVAILABLE, str(reason)
        return result

    def _unknown_message(self, name: str) -> str:
        snapshot = self._snapshot()
        installed = ", ".join(f"{e.name} ({e.distribution})" for e in sorted(snapshot, key=lambda e: e.name))
        msg = f"unknown cuda graph backend {name!r}; installed: {installed or 'none'}"
        if name in self._skipped:
            dist, why = self._skipped[name]
            msg += f". {dist} provides {name!r} but it was not loaded: {why}"
        elif name in WELL_KNOWN_DISTRIBUTIONS:
            msg += f". Backend {name!r} is provided by {WELL_KNOWN_DISTRIBUTIONS[name]}: pip install {WELL_KNOWN_DISTRIBUTIONS[name]}"
        else:
            close = difflib.get_close_matches(name, [e.name for e in snapshot] + list(WELL_KNOWN_DISTRIBUTIONS), n=1)
            if close:
                msg += f". Did you mean {close[0]!r}?"
        return msg


def _ep_dist(ep: metadata.EntryPoint) -> Tuple[str, str]:
    """(distribution name, version) of ``ep``; placeholders where its METADATA lacks them
    (a METADATA without ``Name`` gives None, or raises on newer Pythons)."""
    dist = getattr(ep, "dist", None)
    if dist is None:
        return "<unknown>", "?"
    return _dist_label(dist), _metadata_field(dist, "Version") or "?"


def _metadata_field(dist: Any, field: str) -> Optional[str]:
    try:
        value = dist.metadata[field]
    except Exception:
        return None
    return value.strip() if isinstance(value, str) and value.strip() else None


def _dist_label(dist: Any) -> str:
    name = _metadata_field(dist, "Name")
    if name is not None:
        return name
    where = getattr(dist, "_path", None)  # importlib's PathDistribution: the .dist-info folder
    return f"<unnamed distribution at {where}>" if where is not None else "<unnamed distribution>"


def _ref_name(ref: Any) -> str:
    return ref if isinstance(ref, str) else getattr(ref, "__qualname__", repr(ref))


def _natural_device(entry: BackendEntry) -> str:
    devices = [d for d in entry.devices if d != "*"]
    return devices[0] if devices else default_device_type()


def _spec_problem(spec: BackendSpec) -> Optional[str]:
    """What is malformed in ``spec`` (checked without importing anything), or None."""
    if not isinstance(spec.name, str) or not _BACKEND_NAME.fullmatch(spec.name):
        return f"name {spec.name!r} is not an identifier, so no config could select it"
    if not isinstance(spec.phases, (tuple, list)) or not spec.phases or not set(spec.phases) <= set(PHASES):
        return f"phases {spec.phases!r} must be a non-empty tuple drawn from {PHASES}"
    if not isinstance(spec.devices, (tuple, list)) or not spec.devices or \
            not all(isinstance(d, str) and d for d in spec.devices):
        return f"devices {spec.devices!r} must be a non-empty tuple of device types such as ('cuda',) or ('*',)"
    cls = spec.backend_class
    if isinstance(cls, str):
        if not re.fullmatch(r"[\w.]+:[\w.]+", cls):
            return f"backend_class {cls!r} must be 'package.module:Class' or a class"
    elif not isinstance(cls, type):
        return f"backend_class must be 'package.module:Class' or a class, got {type(cls).__name__}"
    probe = spec.probe
    if probe is not None and not callable(probe) and not (isinstance(probe, str) and re.fullmatch(r"[\w.]+:[\w.]+", probe)):
        return f"probe {probe!r} must be 'package.module:function', a callable or None"
    options = getattr(spec, "options", ())
    if not isinstance(options, (tuple, list)) or not all(isinstance(o, str) for o in options):
        return f"options {options!r} must be a tuple of config keys such as ('tc_compiler',)"
    if spec.api_version is not None and not isinstance(spec.api_version, str):
        return f"api_version {spec.api_version!r} must be a string such as '1.0'"
    return None


def _phase_config(phase: str, config: Any, cfg_cls: Any, phase_cls: Any) -> Any:
    if phase not in PHASES:
        raise ValueError(f"phase must be 'decode' or 'prefill', got {phase!r}")
    if config is None:
        return cfg_cls()[phase]
    if isinstance(config, cfg_cls):
        return config[phase]
    if isinstance(config, phase_cls):
        return config
    if isinstance(config, str):
        return phase_cls(backend=config)
    if isinstance(config, Mapping):
        return cfg_cls.from_dict({phase: dict(config)})[phase]
    raise TypeError(f"config must be a CudaGraphConfig, PhaseConfig, mapping or backend name, got {type(config).__name__}")


#: How the runners and the registry call each method: (positional arguments passed,
#: keyword arguments passed). ``__init__`` is called by ``resolve``.
RUNNER_CALLS: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
    "__init__": (("device",), ("phase", "phase_config")),
    "prepare": (("runner",), ()),
    "capture_session": (("stream",), ()),
    "capture_one": (("key", "forward_fn"), ("post_warmup_hook",)),
    "can_run": (("batch", "key"), ()),
    "replay_session": ((), ()),
    "replay": (("key", "static_batch"), ()),
    "cleanup": ((), ()),
    "graph_memory_bytes": ((), ()),
}
_CONTEXT_MANAGER_METHODS = ("capture_session", "replay_session")


def check_backend_class(cls: Any, name: str = "?") -> None:
    """Check that ``cls`` honours the backend contract the runners rely on: a subclass
    of ``BaseCudaGraphBackend`` implementing every abstract method, each method taking
    the arguments the runners pass (:data:`RUNNER_CALLS`) and requiring no others,
    plain methods (not static, class or async), and the two session methods returning
    context managers rather than bare generators.

    Raises:
        BackendContractError: naming the class, the method and what is wrong (every
            problem found, ``; ``-separated; also in its ``problems`` attribute).
    """
    from .backend import BaseCudaGraphBackend

    qual = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)!s}"
    if not (isinstance(cls, type) and issubclass(cls, BaseCudaGraphBackend)):
        raise BackendContractError(f"backend {name!r}: {qual} is not a subclass of BaseCudaGraphBackend")
    problems: List[str] = []
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        problems.append(f"{qual} does not implement {', '.join(missing)}")
    # A narrower signature fails only at capture (the seed's NPU backend lacked
    # post_warmup_hook), so check every call the runners make up front.
    for method, (positional, keywords) in RUNNER_CALLS.items():
        if method in missing:
            continue
        problems.extend(_method_problems(cls, qual, method, positional, keywords))
    if problems:
        err = BackendContractError(f"backend {name!r} breaks the backend contract: " + "; ".join(problems))
        err.problems = problems  # type: ignore[attr-defined]
        raise err


def _method_problems(cls: type, qual: str, method: str, positional: Sequence[str],
                     keywords: Sequence[str]) -> List[str]:
    where = f"{qual}.{method}"
    raw = inspect.getattr_static(cls, method, None)
    if isinstance(raw, (staticmethod, classmethod)):
        return [f"{where} is a {type(raw).__name__}; the runners call it on the instance, make it a plain method"]
    func = getattr(cls, method, None)
    if not callable(func):
        return [f"{where} is not callable"]
    if inspect.iscoroutinefunction(func):
        return [f"{where} is async; the runners call it synchronously"]
    if method in _CONTEXT_MANAGER_METHODS and inspect.isgeneratorfunction(func):
        return [f"{where} is a bare generator; decorate it with @contextlib.contextmanager (the runners use it in 'with')"]
    try:
        sig = inspect.signature(func)
    except (TypeError, ValueError):
        return []  # a builtin without a signature: nothing to check
    params = list(sig.parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]  # self
    where = f"{where}{sig}"
    has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    pos_params = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    problems = []
    if len(pos_params) < len(positional) and not has_var_pos:
        problems.append(f"{where} takes {len(pos_params)} positional argument(s); the runners pass "
                        f"{len(positional)} ({', '.join(positional)})")
    consumed = pos_params[: len(positional)]
    for kw in keywords:
        p = sig.parameters.get(kw)
        if p is not None and p in consumed:
            problems.append(f"{where} takes {kw!r} as positional argument {consumed.index(p) + 1}, where the runners "
                            f"pass {positional[consumed.index(p)]!r}; the runners pass {kw!r} by keyword")
        elif (p is None or p.kind is p.POSITIONAL_ONLY) and not has_var_kw:
            problems.append(f"{where} lacks keyword parameter {kw!r}, which the runners pass")
    extra = [p.name for p in params
             if p not in consumed and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
             and p.default is p.empty and p.name not in keywords]
    if extra:
        problems.append(f"{where} requires extra parameter(s) {extra} the runners never pass")
    return problems


def _dist_version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "?"


def default_device_type() -> str:
    """The accelerator type torch reports here (``"cuda"``, ``"npu"``, ...), else ``"cpu"``."""
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        current = acc.current_accelerator()
        if current is not None:
            return current.type
    return "cuda" if torch.cuda.is_available() else "cpu"


_default: Optional[BackendRegistry] = None
_default_lock = threading.Lock()


def _after_fork_in_child() -> None:
    # A lock held by another parent thread at fork time stays locked forever in the
    # child; the scanned state itself is inherited and valid.
    global _default_lock
    _default_lock = threading.Lock()
    for reg in list(_registries):
        reg._lock = threading.RLock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


_kept: Tuple[Dict[str, Tuple[BackendSpec, bool]], Dict[str, str]] = ({}, {})


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


def backend_phases() -> Dict[str, frozenset]:
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


def resolve_decode_backend(config: Any = None, *, device: Any = None, **backend_kwargs: Any) -> Any:
    """The decode backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("decode", config, device=device, **backend_kwargs)


def resolve_prefill_backend(config: Any = None, *, device: Any = None, **backend_kwargs: Any) -> Any:
    """The prefill backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("prefill", config, device=device, **backend_kwargs)

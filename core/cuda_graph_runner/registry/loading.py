"""Loading plugins into the registry: the scan, pluggy registration, the entry table.

What it does: the first half of :class:`~.manager.BackendRegistry` (a base class, so the
state below is the registry's own): scans the entry points once under the registry's
lock, registers each entry point's module with pluggy and calls only that plugin's
``cuda_graph_runner_backend_specs``, turns each spec into an entry, folds several
distributions of one name into a conflict row, applies ``CUDA_GRAPH_RUNNER_PREFER`` and
replays earlier ``register()`` / ``prefer()`` calls. Whatever one plugin raises marks that
plugin failed (strict mode: raises).

What it does not do: list, resolve or verify (:mod:`.manager`), read entry points or
import modules itself (:mod:`.discovery`), or word conflicts (:mod:`.conflicts`).
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

import pluggy

from ..backend import envs, hookspecs
from ..backend.errors import (
    BackendConflictError,
    BackendContractError,
    BackendLoadError,
    RegistryReentryError,
    UnknownBackendError,
)
from ..backend.hookspecs import PLUGIN_API_VERSION, BackendSpec
from . import conflicts, discovery
from .discovery import normalize_dist, one_line
from .entries import FAILED, IN_PROCESS, BackendEntry, entry_from_spec

ENV_PREFER = envs.PREFER

_HOOK_NAMES = ("cuda_graph_runner_backend_specs", "cuda_graph_runner_default_backend")


class _BuiltinPlugin:
    """The core's own plugin: backend ``disabled`` and the last-resort default."""

    @hookspecs.hookimpl
    def cuda_graph_runner_backend_specs(self) -> List[BackendSpec]:
        from ..backend.base import DisabledBackend

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


class PluginLoading:
    """The scanning half of ``BackendRegistry``; ``BackendRegistry.__init__`` sets the state."""

    group: str
    autoload: bool
    strict: bool
    pm: pluggy.PluginManager
    problems: List[str]
    _lock: threading.RLock
    _scanned: bool
    _scan_error: Optional[BaseException]
    _scanning_thread: Optional[int]
    _in_process: Dict[str, Tuple[BackendSpec, bool]]
    _preferred: Dict[str, str]
    _replay: Tuple[Dict[str, Tuple[BackendSpec, bool]], Dict[str, str]]
    _entries: Dict[str, BackendEntry]
    _conflicts: Dict[str, List[BackendEntry]]
    _skipped: discovery.Skipped
    _plugin_backends: Dict[str, List[str]]

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
                "through the cuda_graph_runner_backend_specs hook"
            )
        with self._lock:
            if self._scan_error is not None:
                # Strict mode: the registry is half-built, so every use fails the same way.
                raise self._scan_error
            if self._scanned:
                return
            env = discovery.read_environment()
            self._scanning_thread = threading.get_ident()
            try:
                self._scan_entry_points(env)
            except BaseException as exc:
                if isinstance(exc, KeyboardInterrupt):
                    self._scan_error = BackendLoadError(
                        "the plugin scan was interrupted (KeyboardInterrupt); call "
                        "cuda_graph_runner.registry.reset_registry() to scan again"
                    )
                else:
                    self._scan_error = exc
                raise
            finally:
                self._scanning_thread = None
                self._scanned = True

    def _scan_entry_points(self, env: Mapping[str, Any]) -> None:
        eps = discovery.select_entry_points(
            discovery.all_entry_points(self.group, self._problem),
            env,
            autoload=self.autoload,
            skipped=self._skipped,
            problem=self._problem,
        )
        seen: set = set()
        for ep in eps:
            dist_name, version = discovery.ep_dist(ep)
            # The same distribution can be seen twice when sys.path lists it twice.
            if (ep.name, dist_name, ep.value) in seen:
                continue
            seen.add((ep.name, dist_name, ep.value))
            try:
                plugin = discovery.load_entry_point(ep, dist_name, version)
                self._register_plugin(plugin, distribution=dist_name, version=version, expected_name=ep.name)
            except BaseException as exc:  # one plugin, whatever it raises, never breaks the others
                if isinstance(exc, KeyboardInterrupt) or self.strict:
                    raise
                err = (
                    exc
                    if isinstance(exc, BackendLoadError)
                    else BackendLoadError(
                        f"entry point {ep.name} = {ep.value!r} of {dist_name} {version}: loading raised {one_line(exc)}"
                    )
                )
                cause = err.__cause__ or exc
                self._add_entry(
                    BackendEntry(ep.name, dist_name, version, status=FAILED, reason=str(err), error=cause, _fixed=True)
                )
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
                self._problem(
                    f"register({spec.name!r}) made before reset_registry() could not be kept: {one_line(exc)}",
                    force_warning=True,
                )
        for name, dist in preferred.items():
            try:
                self._prefer_now(name, dist)
                self._preferred[name] = dist
            except UnknownBackendError as exc:
                self._problem(
                    f"prefer({name!r}, {dist!r}) made before reset_registry() could not be kept: {exc}",
                    force_warning=True,
                )

    def _register_plugin(
        self, plugin: Any, *, distribution: str, version: str, expected_name: Optional[str] = None
    ) -> None:
        label = f"{distribution}:{expected_name or getattr(plugin, '__name__', type(plugin).__name__)}"
        what = f"plugin {expected_name or label!r} of {distribution} {version}"
        try:
            if self.pm.is_registered(plugin):
                # One module serving several entry points: specs were already collected.
                self._same_module_again(plugin, distribution, version, expected_name)
                return
            self.pm.register(plugin, name=label)
            specs = self._specs_of(plugin, what)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            if self.strict:
                if isinstance(exc, BackendLoadError):
                    raise
                raise BackendLoadError(f"{what}: hook cuda_graph_runner_backend_specs raised {one_line(exc)}") from exc
            reason = (
                str(exc)
                if isinstance(exc, BackendLoadError)
                else (f"hook cuda_graph_runner_backend_specs raised {one_line(exc)}")
            )
            self._add_entry(
                BackendEntry(
                    expected_name or label, distribution, version, status=FAILED, reason=reason, error=exc, _fixed=True
                )
            )
            return
        names = [str(getattr(s, "name", s)) for s in specs]
        self._plugin_backends[label] = names
        if expected_name is not None and expected_name not in names:
            reason = f"entry point {expected_name!r} gave no spec of that name (got {names})"
            if isinstance(plugin, type) and any(c.__name__ == "BaseCudaGraphBackend" for c in plugin.__mro__):
                reason = (
                    f"entry point {expected_name!r} names the backend class {plugin.__qualname__}; it must "
                    "name a registration module with a @hookimpl cuda_graph_runner_backend_specs"
                )
            if self.strict:
                raise BackendLoadError(f"{what}: {reason}")
            self._add_entry(
                BackendEntry(expected_name, distribution, version, status=FAILED, reason=reason, _fixed=True)
            )
        for spec in specs:
            entry = entry_from_spec(spec, distribution, version)
            if self.strict and entry.status == FAILED:
                raise BackendLoadError(f"{what}: {entry.reason}") from entry.error
            self._add_entry(entry)

    def _specs_of(self, plugin: Any, what: str) -> List[Any]:
        """What ``plugin``'s own ``cuda_graph_runner_backend_specs`` returns (no other plugin's).

        Raises:
            BackendLoadError: it implements hooks this core does not define.
            TypeError: a hook result is not a list; anything the hook raises.
        """
        unknown = [hc.name for hc in self.pm.get_hookcallers(plugin) or [] if hc.spec is None]
        if unknown:
            raise BackendLoadError(
                f"{what} implements unknown hook(s) {sorted(unknown)}; this core "
                f"(plugin API {PLUGIN_API_VERSION}) defines {list(_HOOK_NAMES)}"
            )
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
                    f"cuda_graph_runner_backend_specs must return a list of BackendSpec, got {type(result).__name__}"
                )
            specs.extend(result)
        return specs

    def _same_module_again(self, plugin: Any, distribution: str, version: str, expected_name: Optional[str]) -> None:
        # A release and a nightly naming the same module: Python imported it once, from one
        # of them, so attributing the backend to the first distribution found would hide
        # which code runs. Report both as a conflict.
        owner = self.pm.get_name(plugin) or ""
        if normalize_dist(owner.partition(":")[0]) == normalize_dist(distribution):
            return
        names = self._plugin_backends.get(owner, [])
        for name in [expected_name] if expected_name in names else names:
            group = self._conflicts.get(name) or [e for e in (self._entries.get(name),) if e is not None]
            base = next((e for e in group if e is not None and e.spec is not None), None)
            if base is None or any(
                normalize_dist(e.distribution) == normalize_dist(distribution) for e in group if e is not None
            ):
                continue
            self._add_entry(dataclasses.replace(base, distribution=distribution, version=version, _class=None))
            group = self._conflicts[name]
            reason = conflicts.shared_module_reason(
                name,
                getattr(plugin, "__name__", repr(plugin)),
                conflicts.loaded_from(plugin),
                [(e.distribution, e.version) for e in group],
                ENV_PREFER,
            )
            conflict = self._entries[name]
            conflict.reason, conflict.error = reason, BackendConflictError(reason)

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
        self._entries[entry.name] = conflicts.conflict_entry(entry.name, group, ENV_PREFER)

    def _apply_preferences(self, text: str) -> None:
        pairs, malformed = conflicts.parse_preferences(text)
        for item in malformed:
            self._problem(f"{ENV_PREFER}: {item!r} is not of the form name=distribution")
        for name, dist in pairs:
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

    def _register_now(self, spec: BackendSpec, *, replace: bool) -> None:
        with self._lock:
            if spec.name in self._entries and not replace:
                raise BackendConflictError(
                    f"backend {spec.name!r} is already registered by {self._entries[spec.name].distribution}; "
                    "pass replace=True to override it in this process"
                )
            entry = entry_from_spec(spec, IN_PROCESS, "")
            if isinstance(entry.error, BackendContractError):
                raise entry.error
            if entry.status == FAILED:
                raise ValueError(f"backend {spec.name!r}: {entry.reason}")
            self._entries[spec.name] = entry
            self._conflicts.pop(spec.name, None)

    def _prefer_now(self, name: str, distribution: str) -> None:
        with self._lock:
            if name in self._conflicts:
                candidates = self._conflicts[name]
            elif name in self._entries:
                candidates = [self._entries[name]]
            else:
                candidates = []
            for entry in candidates:
                if normalize_dist(entry.distribution) == normalize_dist(distribution):
                    self._entries[name] = entry
                    return
            found = ", ".join(e.distribution for e in candidates) or "none"
            raise UnknownBackendError(f"no distribution {distribution!r} registers backend {name!r} (found: {found})")

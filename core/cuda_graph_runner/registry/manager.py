"""``BackendRegistry``: the plugin manager that ties discovery, entries and policy together.

What it does: owns the registry's state and lock; loads plugins (scans the entry points
once under the lock, registers each entry point's module with pluggy and calls only that
plugin's ``cuda_graph_runner_backend_specs``, turns each spec into an entry, folds several
distributions of one name into a conflict row, applies ``CUDA_GRAPH_RUNNER_PREFER`` and
replays earlier ``register()`` / ``prefer()`` calls); registers and prefers backends
in-process, lists entries probed for a device, gathers default-backend claims, and
resolves a name to a checked, built backend (importing its class on first use and
recording the contract outcome on the entry). Every failure is recorded on the entry it
belongs to (whatever one plugin raises marks that plugin failed); strict mode re-raises
instead.

What it does not do: read entry points or import modules itself (:mod:`.discovery`),
word conflicts or rank default claims (:mod:`.conflicts`), check class signatures
(:mod:`.contract`), parse API versions (:mod:`.versions`), or hold the process-wide
instance (:mod:`.process`). It never writes to a plugin's class.
"""

from __future__ import annotations

import dataclasses
import threading
import warnings
import weakref
from typing import TYPE_CHECKING, Any, Dict, Iterable, List, Mapping, Optional, Tuple

import pluggy

from ..backend import envs, hookspecs
from ..backend import options as backend_options
from ..backend.errors import (
    BackendConflictError,
    BackendContractError,
    BackendLoadError,
    BackendUnavailableError,
    RegistryReentryError,
    UnknownBackendError,
)
from ..backend.hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec
from ..config import ConfigInput, as_config
from . import conflicts, discovery
from .contract import check_backend_class
from .discovery import normalize_dist, one_line
from .entries import (
    AVAILABLE,
    CONFLICT,
    FAILED,
    IN_PROCESS,
    UNAVAILABLE,
    BackendEntry,
    default_device_type,
    entry_from_spec,
    natural_device,
    probe,
    unknown_backend_message,
)
from .probing import ProbeCache
from .versions import CORE_DISTRIBUTION

if TYPE_CHECKING:  # torch and the backend module: not imported to list or discover backends
    import torch

    from ..backend.base import BaseCudaGraphBackend

ENV_STRICT = envs.STRICT_PLUGINS
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


# Every registry made in this process, so a forked child can renew their locks (:mod:`.process`).
live_registries: "weakref.WeakSet[BackendRegistry]" = weakref.WeakSet()


class BackendRegistry:
    """Discovers, lists and resolves backends. Most code uses the module-level functions.

    Args:
        group: entry-point group to scan.
        autoload: scan entry points at all (the environment can turn it off too).
        strict: re-raise plugin failures instead of listing them; None reads
            ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS``.
        probe_timeout_s: seconds one backend's availability probe may take before it is
            listed unavailable (timed out); 0 means no limit; None reads
            ``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S`` (default 60). Probe answers are kept per
            probe and device type for the registry's lifetime (:mod:`.probing`).

    Raises:
        ValueError: ``probe_timeout_s`` is negative or not a number.
        cuda_graph_runner.backend.envs.EnvVarError: a bad ``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S`` or
            ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS``.
    """

    def __init__(
        self,
        group: str = ENTRY_POINT_GROUP,
        *,
        autoload: bool = True,
        strict: Optional[bool] = None,
        probe_timeout_s: Optional[float] = None,
    ) -> None:
        self.group = group
        self.autoload = autoload
        self.strict = bool(envs.get(ENV_STRICT)) if strict is None else strict
        #: Probe answers, each call bounded in time (:mod:`.probing`).
        self.probes = ProbeCache(envs.get(envs.PROBE_TIMEOUT_S) if probe_timeout_s is None else probe_timeout_s)
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
        self._skipped: discovery.Skipped = {}
        # pluggy plugin name -> backend names it contributed, to blame a raising hook.
        self._plugin_backends: Dict[str, List[str]] = {}
        # Contested defaults already warned about, so a warning names each contest once.
        self._warned_defaults: set = set()
        #: Problems that belong to no single backend (a malformed ``CUDA_GRAPH_RUNNER_PREFER``).
        self.problems: List[str] = []
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.BackendHookSpecs)
        live_registries.add(self)
        self._register_plugin(
            _BuiltinPlugin(), distribution=CORE_DISTRIBUTION, version=discovery.dist_version(CORE_DISTRIBUTION)
        )

    # -- registering and preferring ---------------------------------------------------
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

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (no error if absent); reset_registry() then drops it."""
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

    # -- listing ----------------------------------------------------------------------
    def entries(self, device_type: Optional[str] = None) -> List[BackendEntry]:
        """All entries, each probed for ``device_type``.

        With ``device_type=None`` each backend is probed on its own first device type
        ("can it run on this machine?"); ``"*"`` backends on the machine's accelerator.
        """
        rows = []
        for entry in sorted(self._snapshot(), key=lambda e: e.name):
            # Probes run plugin code: outside the lock, on the snapshot.
            rows.append(self._probe(entry, device_type or natural_device(entry)))
        return rows

    def _snapshot(self) -> List[BackendEntry]:
        """The registered entries now (scanned first); safe against concurrent register()."""
        self._scan()
        with self._lock:
            return list(self._entries.values())

    def names(self) -> List[str]:
        return sorted(e.name for e in self._snapshot())

    def backend_phases(self) -> Dict[str, frozenset[str]]:
        """``{name: phases}`` of every backend that registered (for config validation)."""
        return {e.name: frozenset(e.phases) for e in self._snapshot() if e.status not in (FAILED, CONFLICT)}

    def backend_problems(self) -> Dict[str, str]:
        """``{name: why it cannot be used}`` of backends that are installed but failed or in
        conflict (what ``config`` says instead of "not installed")."""
        return {
            e.name: (f"installed but failed: {e.reason}" if e.status == FAILED else f"installed twice: {e.reason}")
            for e in self._snapshot()
            if e.status in (FAILED, CONFLICT)
        }

    def _probe(self, entry: BackendEntry, device_type: str) -> BackendEntry:
        return probe(entry, device_type, strict=self.strict, probes=self.probes)

    # -- defaults ---------------------------------------------------------------------
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
        name (:mod:`cuda_graph_runner.registry.conflicts`): never install or ``sys.path``
        order. With several claimants a ``RuntimeWarning`` names each claim once (once per
        registry, phase and device type).

        Raises:
            BackendLoadError: strict mode only, a plugin's hook raised.
        """
        self._scan()

        def on_error(impl: Any, exc: BaseException) -> None:
            message = (
                f"plugin {impl.plugin_name}: hook cuda_graph_runner_default_backend(phase={phase!r}, "
                f"device_type={device_type!r}) raised {one_line(exc)}"
            )
            if self.strict:
                raise BackendLoadError(message) from exc
            self._blame_plugin(impl.plugin_name, impl.plugin, message, exc)

        # The core's "disabled" is the fallback, not a claim.
        found = conflicts.collect_default_claims(
            self.pm.hook.cuda_graph_runner_default_backend,
            phase,
            device_type,
            skip=lambda plugin: isinstance(plugin, _BuiltinPlugin),
            on_error=on_error,
        )
        claims = []
        for impl, (backend, priority) in found:
            usable, why = self._claim_usable(backend, phase, device_type)
            claims.append(
                conflicts.Claim(backend, priority, impl.plugin_name, impl.plugin_name.partition(":")[0], usable, why)
            )
        decision = conflicts.choose_default(phase, device_type, claims)
        message = conflicts.contest_warning(decision)
        if message and (phase, device_type, decision.claims) not in self._warned_defaults:
            self._warned_defaults.add((phase, device_type, decision.claims))
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

    def _blame_plugin(self, plugin_name: str, plugin: Any, message: str, exc: BaseException) -> None:
        with self._lock:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            for name in self._plugin_backends.get(plugin_name, []):
                entry = self._entries.get(name)
                if entry is not None and plugin_name.startswith(f"{entry.distribution}:"):
                    self._entries[name] = dataclasses.replace(
                        entry, status=FAILED, reason=message, error=exc, _fixed=True
                    )

    # -- resolving --------------------------------------------------------------------
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
        if phase is not None and entry.spec is not None and entry.status not in (FAILED, CONFLICT):
            # The phases are the spec's, true on every device: a decode-only backend asked
            # for prefill is refused for the phase, not for this machine's device.
            self._check_phase(entry, phase)
        entry = self._probe(entry, device_type or default_device_type())
        if not entry.ok:
            err = entry.error
            kind = (
                type(err)
                if isinstance(err, (BackendConflictError, BackendContractError, BackendLoadError))
                else BackendUnavailableError
            )
            where = f"{entry.distribution} {entry.version}".strip()
            state = {FAILED: "installed but failed", CONFLICT: "in conflict"}.get(entry.status, entry.status)
            raise kind(f"backend {name!r} ({where}) is {state}: {entry.reason}") from err
        if phase is not None:
            self._check_phase(entry, phase)
        return entry

    def _check_phase(self, entry: BackendEntry, phase: str) -> None:
        if phase not in entry.phases:
            raise BackendUnavailableError(
                f"backend {entry.name!r} does not support phase {phase!r}; it supports {list(entry.phases)}; "
                f"backends for {phase}: {sorted(e.name for e in self._snapshot() if phase in e.phases)}"
            )

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
            return discovery.load_ref(entry.spec.backend_class)
        except BaseException as exc:
            if isinstance(exc, KeyboardInterrupt):
                raise
            err = BackendLoadError(
                f"backend {entry.name!r} of {entry.distribution} {entry.version}: cannot import "
                f"{entry.spec.backend_class!r}: {one_line(exc)}"
            )
            self._record_failure(entry, err)
            raise err from exc

    def _record_failure(self, entry: BackendEntry, err: BaseException, contract: str = "") -> None:
        with self._lock:
            entry.status, entry.reason, entry.error, entry._fixed = FAILED, str(err), err, True
            if contract:
                entry.contract = contract

    def verify(self, name: str) -> BackendEntry:
        """Import the class of ``name`` and check it against the contract, now.

        This is the explicit form of the check ``resolve`` does on first use. The outcome
        is recorded on the entry, so ``list_backends`` shows a violation from then on. A
        backend that is unavailable on this machine and whose class cannot even be
        imported here (a vendor SDK missing) is left unavailable with
        ``contract = "not checked: ..."`` rather than marked failed.

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
            return self._probe(entry, natural_device(entry))
        probed = self._probe(entry, natural_device(entry))
        try:
            self.load_class(entry)
        except BackendLoadError as err:
            if probed.status == UNAVAILABLE:
                # The class may import the device SDK at module level: not a contract breach.
                with self._lock:
                    entry.status, entry.reason, entry.error, entry._fixed = AVAILABLE, None, None, False
                    entry.contract = f"not checked: {one_line(err.__cause__ or err)}"
            elif self.strict:
                raise
        except BackendContractError:
            if self.strict:
                raise
        return self._probe(entry, natural_device(entry))

    def verify_all(self) -> List[BackendEntry]:
        """:meth:`verify` every registered backend; the checked rows, sorted by name."""
        return [self.verify(name) for name in self.names()]

    def resolve(
        self,
        phase: str,
        config: ConfigInput = None,
        *,
        device: torch.device | str | None = None,
        **backend_kwargs: Any,
    ) -> BaseCudaGraphBackend:
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
            ValueError: ``phase`` is not a phase. TypeError: ``config`` is none of the above.
            UnknownBackendError, BackendConflictError, BackendUnavailableError,
            BackendLoadError, BackendContractError: see :meth:`get` and :meth:`load_class`.
            cuda_graph_runner.config.CudaGraphConfigError: the config sets a backend option
                (``tc_compiler``) the selected backend does not read; names who reads it; a
                backend name a later flag replaced is not a backend of the phase.
        """
        config = as_config(config, phase)  # a runner's CudaGraphConfig passes through unconverted
        phase_config = config[phase]
        device_str = str(device) if device is not None else default_device_type()
        device_type = device_str.split(":")[0]
        name = phase_config.backend or self.default_backend(phase, device_type)
        replaced = tuple(item for item in config.superseded if item[0] == phase)
        if replaced:  # names a later flag replaced: checked like the config's own (sglang does)
            type(config)(superseded=replaced).validate(self.backend_phases(), self.backend_problems())
        entry = self.get(name, device_type=device_type, phase=phase)
        backend_options.check_resolved(self, phase, config, entry)
        cls = self.load_class(entry)
        backend = cls(device_str, phase=phase, phase_config=phase_config, **backend_kwargs)
        try:
            # On the instance only (see load_class); a class whose ``name`` is read-only keeps its own.
            backend.name = entry.name
        except AttributeError:
            pass
        return backend

    def _unknown_message(self, name: str) -> str:
        return unknown_backend_message(name, self._snapshot(), self._skipped)

    # -- loading plugins: the scan, pluggy registration, the entry table --------------------------

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

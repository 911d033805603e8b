"""Backend registry: discovery through entry points, pluggy hooks, resolve by name.

How a backend is found (the torch ``torch_dynamo_backends`` / OpenTelemetry model):

1. The entry-point group ``cuda_graph_runner.backends`` is scanned once (cached); the
   entry-point name is the backend name users write in config.
2. Each entry point names a light *registration module* implementing the hooks of
   :mod:`cuda_graph_runner.hookspecs`; it is registered with a ``pluggy.PluginManager``
   and contributes ``BackendSpec`` records. Backend classes are not imported yet.
3. ``resolve_decode_backend`` / ``resolve_prefill_backend`` import the one class that
   was asked for, check it against the contract and build it.

Every failure is kept on the entry it belongs to (``list_backends`` shows it, with the
original exception chained); it never stops the other plugins from loading. Set
``CUDA_GRAPH_RUNNER_STRICT_PLUGINS=1`` to re-raise instead.

Environment variables (read when the registry first scans):

* ``CUDA_GRAPH_RUNNER_PLUGINS``: comma-separated entry-point names to autoload; unset
  means all, empty means none (llm/datasette semantics).
* ``CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD=1``: load no entry point (built-ins and
  ``register()`` still work), like ``PYTEST_DISABLE_PLUGIN_AUTOLOAD``.
* ``CUDA_GRAPH_RUNNER_STRICT_PLUGINS=1``: a plugin failure raises at scan time.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import inspect
import os
import threading
from importlib import metadata
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union

import pluggy

from . import hookspecs
from .errors import (
    BackendConflictError,
    BackendContractError,
    BackendLoadError,
    BackendUnavailableError,
    UnknownBackendError,
)
from .hookspecs import ENTRY_POINT_GROUP, PLUGIN_API_VERSION, BackendSpec

ENV_PLUGINS = "CUDA_GRAPH_RUNNER_PLUGINS"
ENV_DISABLE_AUTOLOAD = "CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD"
ENV_STRICT = "CUDA_GRAPH_RUNNER_STRICT_PLUGINS"

CORE_DISTRIBUTION = "cuda-graph-runner"

# Well-known backend names and the distribution that provides each, for the
# "pip install ..." hint of an unknown name (fsspec's known_implementations idea).
WELL_KNOWN_DISTRIBUTIONS: Dict[str, str] = {
    "full": "cuda-graph-runner-full",
    "breakable": "cuda-graph-runner-breakable",
    "tc_piecewise": "cuda-graph-runner-tc-piecewise",
    "npu": "cuda-graph-runner-npu",
    "disabled": CORE_DISTRIBUTION,
}

AVAILABLE = "available"
UNAVAILABLE = "unavailable"
FAILED = "failed"


@dataclasses.dataclass
class BackendEntry:
    """One row of ``list_backends()``.

    Attributes:
        name: backend name.
        distribution, version: the distribution that registered it (``"<in-process>"``
            for ``register()``).
        phases, devices: from its spec (empty when the plugin failed before giving one).
        status: ``"available"``, ``"unavailable"`` (installed, cannot run here) or
            ``"failed"`` (the plugin is broken).
        reason: why it is not available, one line; None when available.
        error: the original exception, when there was one.
        spec: the ``BackendSpec``, when the plugin gave one.
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
    _class: Optional[type] = dataclasses.field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == AVAILABLE

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
        }


def _load_ref(ref: Union[str, Any]) -> Any:
    """Import ``"module:attr.path"``; objects pass through."""
    if not isinstance(ref, str):
        return ref
    module_name, sep, attr_path = ref.partition(":")
    if not sep or not module_name or not attr_path:
        raise ValueError(f"reference {ref!r} is not of the form 'package.module:attribute'")
    obj: Any = importlib.import_module(module_name)
    for part in attr_path.split("."):
        obj = getattr(obj, part)
    return obj


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def _api_compatible(declared: str) -> bool:
    # Same major version = compatible (minor versions only add).
    return str(declared).split(".")[0] == PLUGIN_API_VERSION.split(".")[0]


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
                description="no graphs: every batch runs eagerly",
            )
        ]

    @hookspecs.hookimpl(trylast=True)
    def cuda_graph_runner_default_backend(self, phase: str, device_type: str) -> Optional[str]:
        return "disabled"


class BackendRegistry:
    """Discovers, lists and resolves backends. Most code uses the module-level functions.

    Args:
        group: entry-point group to scan.
        autoload: scan entry points at all (the environment can turn it off too).
    """

    def __init__(self, group: str = ENTRY_POINT_GROUP, *, autoload: bool = True) -> None:
        self.group = group
        self.autoload = autoload
        self._lock = threading.RLock()
        self._scanned = False
        self._entries: Dict[str, BackendEntry] = {}
        self._conflicts: Dict[str, List[BackendEntry]] = {}
        self.pm = pluggy.PluginManager(hookspecs.PROJECT_NAME)
        self.pm.add_hookspecs(hookspecs.BackendHookSpecs)
        self._register_plugin(_BuiltinPlugin(), distribution=CORE_DISTRIBUTION, version=_dist_version(CORE_DISTRIBUTION))

    # -- discovery ------------------------------------------------------------------
    def _entry_points(self) -> Iterable[metadata.EntryPoint]:
        if not self.autoload or os.environ.get(ENV_DISABLE_AUTOLOAD, "") not in ("", "0"):
            return []
        eps = list(metadata.entry_points(group=self.group))
        allowed = os.environ.get(ENV_PLUGINS)
        if allowed is not None:
            names = {n.strip() for n in allowed.split(",") if n.strip()}
            eps = [ep for ep in eps if ep.name in names]
        return eps

    def _scan(self) -> None:
        with self._lock:
            if self._scanned:
                return
            self._scanned = True
            strict = os.environ.get(ENV_STRICT, "") not in ("", "0")
            seen: set = set()
            for ep in self._entry_points():
                dist = getattr(ep, "dist", None)
                dist_name = dist.name if dist is not None else "<unknown>"
                version = dist.version if dist is not None else "?"
                # The same distribution can be seen twice when sys.path lists it twice.
                if (ep.name, dist_name, ep.value) in seen:
                    continue
                seen.add((ep.name, dist_name, ep.value))
                try:
                    plugin = ep.load()
                except Exception as exc:  # a broken plugin must not break the others
                    if strict:
                        raise BackendLoadError(
                            f"plugin entry point {ep.name!r} = {ep.value!r} of {dist_name} {version} failed to import"
                        ) from exc
                    self._add_entry(
                        BackendEntry(ep.name, dist_name, version, status=FAILED,
                                     reason=f"import of {ep.value} failed: {_one_line(exc)}", error=exc)
                    )
                    continue
                self._register_plugin(plugin, distribution=dist_name, version=version,
                                      expected_name=ep.name, strict=strict)

    def _register_plugin(self, plugin: Any, *, distribution: str, version: str,
                         expected_name: Optional[str] = None, strict: bool = False) -> None:
        label = f"{distribution}:{expected_name or getattr(plugin, '__name__', type(plugin).__name__)}"
        try:
            if self.pm.is_registered(plugin):
                # One module serving several entry points: specs were already collected.
                return
            self.pm.register(plugin, name=label)
            caller = self.pm.subset_hook_caller(
                "cuda_graph_runner_backend_specs",
                remove_plugins=[p for p in self.pm.get_plugins() if p is not plugin],
            )
            specs = [spec for result in caller() for spec in (result or [])]
        except Exception as exc:
            if strict:
                raise BackendLoadError(f"plugin {label} {version} failed to register") from exc
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._add_entry(BackendEntry(expected_name or label, distribution, version, status=FAILED,
                                         reason=f"plugin hook failed: {_one_line(exc)}", error=exc))
            return
        if expected_name is not None and expected_name not in {s.name for s in specs}:
            self._add_entry(BackendEntry(
                expected_name, distribution, version, status=FAILED,
                reason=f"entry point {expected_name!r} gave no spec of that name (got {[s.name for s in specs]})"))
        for spec in specs:
            self._add_entry(self._entry_from_spec(spec, distribution, version))

    def _entry_from_spec(self, spec: Any, distribution: str, version: str) -> BackendEntry:
        if not isinstance(spec, BackendSpec):
            return BackendEntry(str(getattr(spec, "name", spec)), distribution, version, status=FAILED,
                                reason=f"hook returned {type(spec).__name__}, expected BackendSpec")
        entry = BackendEntry(spec.name, distribution, version, tuple(spec.phases), tuple(spec.devices), spec=spec)
        if not _api_compatible(spec.api_version):
            entry.status = UNAVAILABLE
            entry.reason = (f"plugin API version {spec.api_version} is not compatible with the core's "
                            f"{PLUGIN_API_VERSION}: install versions of {distribution} and {CORE_DISTRIBUTION} that match")
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
        dists = ", ".join(f"{e.distribution} {e.version}" for e in group)
        self._entries[entry.name] = BackendEntry(
            entry.name, dists, "", entry.phases, entry.devices, status=FAILED,
            reason=f"backend name {entry.name!r} is registered by several distributions: {dists}; "
                   f"uninstall all but one, or call cuda_graph_runner.registry.prefer({entry.name!r}, '<distribution>')",
            error=BackendConflictError(f"{entry.name!r} registered by {dists}"),
        )

    # -- public API -----------------------------------------------------------------
    def register(self, spec: BackendSpec, *, replace: bool = False) -> None:
        """Register a backend in-process (tests, notebooks); no entry point needed.

        Raises:
            BackendConflictError: ``spec.name`` exists and ``replace`` is False.
        """
        self._scan()
        with self._lock:
            if spec.name in self._entries and not replace:
                raise BackendConflictError(
                    f"backend {spec.name!r} is already registered by {self._entries[spec.name].distribution}; "
                    "pass replace=True to override it in this process")
            self._entries[spec.name] = self._entry_from_spec(spec, "<in-process>", "")
            self._conflicts.pop(spec.name, None)

    def unregister(self, name: str) -> None:
        """Forget an in-process registration (no error if absent)."""
        with self._lock:
            self._entries.pop(name, None)

    def prefer(self, name: str, distribution: str) -> None:
        """Resolve a name registered by several distributions to ``distribution``'s.

        Raises:
            UnknownBackendError: no distribution of that name registers ``name``.
        """
        self._scan()
        with self._lock:
            candidates = self._conflicts.get(name) or [self._entries[name]] if name in self._entries else []
            for entry in candidates:
                if entry.distribution == distribution:
                    self._entries[name] = entry
                    return
            found = ", ".join(e.distribution for e in candidates) or "none"
            raise UnknownBackendError(f"no distribution {distribution!r} registers backend {name!r} (found: {found})")

    def entries(self, device_type: Optional[str] = None) -> List[BackendEntry]:
        """All entries, each probed for ``device_type``.

        With ``device_type=None`` each backend is probed on its own first device type
        ("can it run on this machine?"); ``"*"`` backends on the machine's accelerator.
        """
        self._scan()
        rows = []
        for entry in sorted(self._entries.values(), key=lambda e: e.name):
            target = device_type
            if target is None:
                devices = [d for d in entry.devices if d != "*"]
                target = devices[0] if devices else default_device_type()
            rows.append(self._probe(entry, target))
        return rows

    def names(self) -> List[str]:
        self._scan()
        return sorted(self._entries)

    def backend_phases(self) -> Dict[str, frozenset]:
        """``{name: phases}`` of every backend that registered (for config validation)."""
        self._scan()
        return {e.name: frozenset(e.phases) for e in self._entries.values() if e.status != FAILED}

    def default_backend(self, phase: str, device_type: str) -> str:
        """The default backend name for ``phase`` on ``device_type`` (hook ``default_backend``).

        Falls back to ``"disabled"`` when the named default is not usable here.
        """
        self._scan()
        name = self.pm.hook.cuda_graph_runner_default_backend(phase=phase, device_type=device_type)
        if name and name in self._entries and self._probe(self._entries[name], device_type).ok:
            return name
        return "disabled"

    def get(self, name: str, *, device_type: Optional[str] = None, phase: Optional[str] = None) -> BackendEntry:
        """The usable entry of ``name``.

        Raises:
            UnknownBackendError: no plugin provides ``name`` (lists what is installed).
            BackendUnavailableError: installed but failed, unusable on ``device_type``,
                or not for ``phase``; the original error is chained.
        """
        self._scan()
        entry = self._entries.get(name)
        if entry is None:
            raise UnknownBackendError(self._unknown_message(name))
        entry = self._probe(entry, device_type or default_device_type())
        if not entry.ok:
            raise BackendUnavailableError(
                f"backend {name!r} ({entry.distribution} {entry.version}) is {entry.status}: {entry.reason}"
            ) from entry.error
        if phase is not None and phase not in entry.phases:
            raise BackendUnavailableError(
                f"backend {name!r} does not support phase {phase!r}; it supports {list(entry.phases)}; "
                f"backends for {phase}: {[e.name for e in self._entries.values() if phase in e.phases]}")
        return entry

    def load_class(self, entry: BackendEntry) -> type:
        """Import and check the backend class of ``entry`` (cached).

        Raises:
            BackendLoadError: the class reference does not import (original chained).
            BackendContractError: the class breaks the backend contract.
        """
        if entry._class is not None:
            return entry._class
        assert entry.spec is not None
        try:
            cls = _load_ref(entry.spec.backend_class)
        except Exception as exc:
            raise BackendLoadError(
                f"backend {entry.name!r} of {entry.distribution} {entry.version}: cannot import "
                f"{entry.spec.backend_class!r}: {_one_line(exc)}") from exc
        check_backend_class(cls, entry.name)
        cls.name = entry.name
        entry._class = cls
        return cls

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
            UnknownBackendError, BackendUnavailableError, BackendLoadError,
            BackendContractError: see :meth:`get` and :meth:`load_class`.
        """
        from .config import CudaGraphConfig, PhaseConfig

        phase_config = _phase_config(phase, config, CudaGraphConfig, PhaseConfig)
        device_str = str(device) if device is not None else default_device_type()
        device_type = device_str.split(":")[0]
        name = phase_config.backend or self.default_backend(phase, device_type)
        entry = self.get(name, device_type=device_type, phase=phase)
        cls = self.load_class(entry)
        return cls(device_str, phase=phase, phase_config=phase_config, **backend_kwargs)

    def _probe(self, entry: BackendEntry, device_type: str) -> BackendEntry:
        if entry.status == FAILED or entry.spec is None:
            return entry
        if entry.status == UNAVAILABLE and entry.error is None and entry.reason and "API version" in entry.reason:
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
            except Exception as exc:
                if os.environ.get(ENV_STRICT, "") not in ("", "0"):
                    raise
                result.status, result.reason, result.error = FAILED, f"probe raised {_one_line(exc)}", exc
                return result
            if reason:
                result.status, result.reason = UNAVAILABLE, str(reason)
        return result

    def _unknown_message(self, name: str) -> str:
        installed = ", ".join(f"{e.name} ({e.distribution})" for e in sorted(self._entries.values(), key=lambda e: e.name))
        msg = f"unknown cuda graph backend {name!r}; installed: {installed or 'none'}"
        if name in WELL_KNOWN_DISTRIBUTIONS:
            msg += f". Backend {name!r} is provided by {WELL_KNOWN_DISTRIBUTIONS[name]}: pip install {WELL_KNOWN_DISTRIBUTIONS[name]}"
        else:
            close = difflib.get_close_matches(name, list(self._entries) + list(WELL_KNOWN_DISTRIBUTIONS), n=1)
            if close:
                msg += f". Did you mean {close[0]!r}?"
        return msg


def _phase_config(phase: str, config: Any, cfg_cls: Any, phase_cls: Any) -> Any:
    if phase not in ("decode", "prefill"):
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


def check_backend_class(cls: Any, name: str = "?") -> None:
    """Check that ``cls`` honours the backend contract the runners rely on.

    Raises:
        BackendContractError: naming the class, the method and what is wrong.
    """
    from .backend import BaseCudaGraphBackend

    qual = f"{getattr(cls, '__module__', '?')}.{getattr(cls, '__qualname__', cls)!s}"
    if not (isinstance(cls, type) and issubclass(cls, BaseCudaGraphBackend)):
        raise BackendContractError(f"backend {name!r}: {qual} is not a subclass of BaseCudaGraphBackend")
    missing = sorted(getattr(cls, "__abstractmethods__", ()))
    if missing:
        raise BackendContractError(f"backend {name!r}: {qual} does not implement {', '.join(missing)}")
    # The runners call these with these arguments; a narrower signature fails only at
    # capture (the seed's NPU backend lacked post_warmup_hook), so check it up front.
    calls: Dict[str, Tuple[Tuple[str, ...], Tuple[str, ...]]] = {
        "capture_session": (("stream",), ()),
        "capture_one": (("key", "forward_fn"), ("post_warmup_hook",)),
        "can_run": (("batch", "key"), ()),
        "replay_session": ((), ()),
        "replay": (("key", "static_batch"), ()),
        "cleanup": ((), ()),
    }
    for method, (positional, keywords) in calls.items():
        sig = inspect.signature(getattr(cls, method))
        params = list(sig.parameters.values())[1:]  # drop self
        has_var_pos = any(p.kind is p.VAR_POSITIONAL for p in params)
        has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
        pos_params = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        if len(pos_params) < len(positional) and not has_var_pos:
            raise BackendContractError(
                f"backend {name!r}: {qual}.{method}{sig} takes {len(pos_params)} positional argument(s); "
                f"the runners pass {len(positional)} ({', '.join(positional)})")
        required = [p for p in params if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if len(required) > len(positional):
            extra = [p.name for p in required[len(positional):]]
            raise BackendContractError(
                f"backend {name!r}: {qual}.{method}{sig} requires extra parameter(s) {extra} the runners never pass")
        for kw in keywords:
            if kw not in sig.parameters and not has_var_kw:
                raise BackendContractError(
                    f"backend {name!r}: {qual}.{method}{sig} lacks keyword parameter {kw!r}, which the runners pass")


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


def get_registry() -> BackendRegistry:
    """The process-wide registry (scanned on first use, then cached; a forked or
    spawned child scans its own copy the same way)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = BackendRegistry()
        return _default


def reset_registry() -> None:
    """Drop the cached registry so the next call rescans (after installing a plugin)."""
    global _default
    with _default_lock:
        _default = None


def list_backends(device_type: Optional[str] = None) -> List[BackendEntry]:
    """Every registered backend with distribution, version, phases, status and reason."""
    return get_registry().entries(device_type)


def backend_phases() -> Dict[str, frozenset]:
    """``{name: phases}`` of the installed backends (what config validation accepts)."""
    return get_registry().backend_phases()


def register(spec: BackendSpec, *, replace: bool = False) -> None:
    """Register a backend in this process without an entry point (tests, notebooks)."""
    get_registry().register(spec, replace=replace)


def prefer(name: str, distribution: str) -> None:
    """Choose which distribution's ``name`` to use when several register it."""
    get_registry().prefer(name, distribution)


def resolve_decode_backend(config: Any = None, *, device: Any = None, **backend_kwargs: Any) -> Any:
    """The decode backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("decode", config, device=device, **backend_kwargs)


def resolve_prefill_backend(config: Any = None, *, device: Any = None, **backend_kwargs: Any) -> Any:
    """The prefill backend the config selects, built for ``device``. See ``BackendRegistry.resolve``."""
    return get_registry().resolve("prefill", config, device=device, **backend_kwargs)

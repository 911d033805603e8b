"""Backend options: config keys a backend (not the runner) reads, declared per backend.

A backend lists the options it reads in ``BackendSpec.options`` (``tc_piecewise``:
``("tc_compiler",)``; ``full``: ``("compile_sizes", "torch_compile", "torch_compile_max_bs")``;
``breakable``: none). The list lives in each plugin's spec, so a vendor's
backend can read an option too, without a list in the core. An option counts as *set*
for a phase when a source (flag, JSON, API) recorded it, or when it differs from its
default. Setting one the selected backend does not read is an error naming the backends
that do: silently ignoring it would let ``{"backend": "full", "tc_compiler": "inductor"}``
look configured while nothing compiles.

Rules:

* per phase, at resolve time (:func:`check_resolved`): an option set for the phase must be
  read by the phase's backend;
* a flag that sets both phases at once (``--cuda-graph-tc-compiler``, the deprecated
  ``--piecewise-cuda-graph-compiler``) only needs one of the two phases' backends to read
  it; resolve sees one phase, so that case is checked over the whole config by
  :func:`check_config` (``cuda-graph-runner config`` and ``bench``);
* ``tc_compiler`` from sglang's own spellings (``--cuda-graph-tc-compiler``,
  ``--piecewise-cuda-graph-compiler``, ``--cuda-graph-config``) keeps sglang's meaning,
  tc_piecewise's compiler: a backend that does not read it ignores it, with a warning
  (sglang accepts those command lines; ``--enable-torch-compile`` compiles decode);
* ``torch_compile_max_bs`` counts as set only with ``torch_compile`` on (sglang ignores
  ``--torch-compile-max-bs`` without ``--enable-torch-compile``);
* a backend that reads both ``torch_compile`` and ``compile_sizes`` refuses compile sizes
  with ``torch_compile`` off (nothing would compile);
* backend ``disabled`` reads nothing and is exempt when it is *named*: turning graphs off
  for a phase keeps the rest of a command line valid (sglang's ``--disable-cuda-graph``
  habit). With the backend on auto, ``cuda-graph-runner config`` and ``bench`` check the
  options against the backend auto picks there (:func:`check_with_registry`), ``disabled``
  included: an option set for auto is checked as if that backend were named, so a
  ``compile_sizes`` that nothing on this machine would read is an error, never a quietly
  eager run.

Raises :class:`~cuda_graph_runner.config.CudaGraphConfigError` throughout.
"""

from __future__ import annotations

import warnings
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple

from ..config import (
    BACKEND_OPTION_KEYS,
    CudaGraphConfig,
    CudaGraphConfigError,
    Phase,
    PhaseConfig,
    source_phases,
)
from ..config.model import SGLANG_TC_COMPILER_SOURCES

DISABLED = "disabled"


def reads_of(entry: Any) -> Tuple[str, ...]:
    """The options a registry entry's spec declares (``()`` without a spec)."""
    spec = getattr(entry, "spec", None)
    return tuple(getattr(spec, "options", ()) or ()) if spec is not None else ()


def _entry(registry: Any, name: str) -> Any:
    # The stored entry, unprobed: options come from the spec, no device probe needed.
    return getattr(registry, "_entries", {}).get(name)


def declared_reads(registry: Any, name: str) -> Optional[Tuple[str, ...]]:
    """The options backend ``name``'s spec declares, or None when nothing can be said from
    the spec: an unknown name, a plugin that failed (before or after giving a spec) or a
    name in conflict (their own errors say why, and must not be hidden by an option's)."""
    entry = _entry(registry, name)
    if entry is None or getattr(entry, "spec", None) is None:
        return None
    if getattr(entry, "status", "") in ("failed", "conflict"):  # EntryStatus is a str
        return None
    return reads_of(entry)


def option_readers(registry: Any) -> Dict[str, List[str]]:
    """``{option: sorted backend names whose spec reads it}`` over the registered backends."""
    readers: Dict[str, List[str]] = {key: [] for key in BACKEND_OPTION_KEYS}
    for name in registry.names():
        entry = _entry(registry, name)
        for option in reads_of(entry):
            readers.setdefault(option, []).append(name)
    return {k: sorted(v) for k, v in readers.items()}


def _set_options(config: Any, phase: str) -> List[Tuple[str, Any, Optional[str]]]:
    """``[(option, value, source)]`` set for ``phase`` (see the module docstring)."""
    if isinstance(config, CudaGraphConfig):
        phase_config, sources = config[phase], config.sources
    else:
        phase_config, sources = config, {}
    default = PhaseConfig()
    out = []
    for key in BACKEND_OPTION_KEYS:
        value = getattr(phase_config, key, None)
        source = sources.get((phase, key))
        if source is None and value == getattr(default, key, None):
            continue
        if key == "torch_compile_max_bs" and not getattr(phase_config, "torch_compile", False):
            continue
        out.append((key, value, source))
    return out


def _ignored(phase: str, key: str, value: Any, source: Optional[str], subject: str) -> bool:
    """Warn and return True when ``key`` from ``source`` keeps sglang's meaning (ignored
    by a backend that does not read it); else False (the caller raises)."""
    if key != "tc_compiler" or source not in SGLANG_TC_COMPILER_SOURCES:
        return False
    warnings.warn(
        f"{phase}: tc_compiler {value!r} ({source}) is ignored: {subject} it (tc_compiler is tc_piecewise's "
        "compiler, as in sglang); to compile decode's forward use --enable-torch-compile",
        UserWarning,
        stacklevel=4,
    )
    return True


def _error(
    phase: str, key: str, value: Any, source: Optional[str], subject: str, readers: Mapping[str, List[str]]
) -> CudaGraphConfigError:
    who = readers.get(key) or []
    return CudaGraphConfigError(
        f"{subject} option {key!r}; "
        + (f"backends that read it: {', '.join(who)}" if who else "no installed backend reads it"),
        phase=phase,
        key=key,
        value=value,
        source=source,
        accepted=f"leave {key} unset, or select a backend that reads it" + (f" ({', '.join(who)})" if who else ""),
    )


def option_not_read(
    phase: str, key: str, value: Any, source: Optional[str], backend: str, readers: Mapping[str, List[str]]
) -> CudaGraphConfigError:
    """The error for option ``key`` set for ``backend``, which does not read it (whatever
    the value: ``compiled:bogus`` is refused for the option, not offered compilers the
    backend would then refuse)."""
    return _error(phase, key, value, source, f"backend {backend!r} does not read", readers)


def check_phase(
    phase: str,
    config: Any,
    backend: str,
    reads: Collection[str],
    readers: Mapping[str, List[str]],
    auto: Optional[str] = None,
) -> None:
    """Per-phase rule: every option set for ``phase`` is read by ``backend`` (which reads
    ``reads``). Options from a both-phase flag are left to :func:`check_config`.

    Args:
        auto: where the phase's backend is on auto, the words saying who picked ``backend``
            (``"on cpu"``); ``disabled`` is then held to the rule like any backend (only a
            named ``disabled`` is exempt).

    Raises:
        CudaGraphConfigError: naming phase, option, value, source and who reads it.
    """
    if backend == DISABLED and auto is None:
        return
    options = _set_options(config, phase)
    for key, value, source in options:
        if key in reads or len(source_phases(source)) > 1:
            continue
        if _ignored(phase, key, value, source, f"backend {backend!r} does not read"):
            continue
        if auto is not None:
            raise _error(phase, key, value, source, f"backend auto (here {backend!r}, {auto}) does not read", readers)
        raise option_not_read(phase, key, value, source, backend, readers)
    _check_compile_sizes(phase, config, backend, reads, options)


def _check_compile_sizes(
    phase: str, config: Any, backend: str, reads: Collection[str], options: List[Tuple[str, Any, Optional[str]]]
) -> None:
    # A backend that reads both options compiles only with torch_compile on: sizes "compiled
    # with static shapes" without it would compile nothing (the backend refuses them when
    # built; this says so before anything is loaded).
    if not {"torch_compile", "compile_sizes"} <= set(reads):
        return
    phase_config = config[phase] if isinstance(config, CudaGraphConfig) else config
    for key, value, source in options:
        if key == "compile_sizes" and value and not getattr(phase_config, "torch_compile", False):
            raise CudaGraphConfigError(
                f"backend {backend!r} compiles nothing with torch_compile off",
                phase=phase,
                key=key,
                value=value,
                source=source,
                accepted=f"leave compile_sizes unset, or set {phase}.torch_compile (--enable-torch-compile)",
            )


def check_config(
    config: CudaGraphConfig,
    selected: Mapping[str, Tuple[str, Collection[str]]],
    readers: Mapping[str, List[str]],
    auto: Optional[Mapping[str, str]] = None,
) -> None:
    """Both rules over a whole config.

    Args:
        selected: ``{phase: (backend name, options it reads)}`` of the backends the config
            selects (auto already replaced by the device's default).
        auto: ``{phase: who picked it}`` for the phases on auto (:func:`check_phase`).

    Raises:
        CudaGraphConfigError: see :func:`check_phase`; for a both-phase flag, when neither
            phase's backend reads the option (and neither is a named ``disabled``).
    """
    auto = auto or {}
    for phase in Phase.ALL:
        name, reads = selected[phase]
        check_phase(phase, config, name, reads, readers, auto.get(phase))
    shared: Dict[Tuple[str, str], List[str]] = {}
    for phase in Phase.ALL:
        for key, _, source in _set_options(config, phase):
            if source and len(source_phases(source)) > 1:
                shared.setdefault((key, source), []).append(phase)
    for (key, source), phases in shared.items():
        if any((selected[p][0] == DISABLED and p not in auto) or key in selected[p][1] for p in phases):
            continue
        names = " and ".join(f"{p} backend {selected[p][0]!r}" for p in phases)
        verb = "do not read" if len(phases) > 1 else "does not read"
        if _ignored(phases[0], key, getattr(config[phases[0]], key), source, f"{names} {verb}"):
            continue
        raise _error(phases[0], key, getattr(config[phases[0]], key), source, f"{names} {verb}", readers)


def check_resolved(registry: Any, phase: str, config: Any, entry: Any) -> None:
    """What ``BackendRegistry.resolve`` calls once it has the entry of the backend.

    Raises:
        CudaGraphConfigError: see :func:`check_phase`.
    """
    if not _set_options(config, phase):
        return
    check_phase(phase, config, entry.name, reads_of(entry), option_readers(registry))


def check_with_registry(
    config: CudaGraphConfig, registry: Any, device_type: str, picks: Optional[Mapping[str, str]] = None
) -> None:
    """:func:`check_config` with each phase's backend looked up in ``registry``; a phase on
    auto gets ``picks[phase]`` (the bench's own choice) or the registry's default for
    ``device_type``, and is held to the rule as if that backend were named (``disabled``
    included). Unknown names read nothing (their own error comes from name validation).

    Raises:
        CudaGraphConfigError: see :func:`check_config`.
    """
    readers = option_readers(registry)
    selected = {}
    auto: Dict[str, str] = {}
    for phase in Phase.ALL:
        name = config[phase].backend
        if name is None:
            picked = (picks or {}).get(phase)
            name = picked or registry.default_backend(phase, device_type)
            auto[phase] = f"picked by the bench on {device_type}" if picked else f"the default on {device_type}"
        selected[phase] = (name, {option for option, names in readers.items() if name in names})
    check_config(config, selected, readers, auto)

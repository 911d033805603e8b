"""Which backends ``cuda-graph-runner bench`` runs: the selection flags parsed, the
device checked, explicit names checked before any work, each backend resolved once."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ...backend.errors import CudaGraphRunnerError, UnknownBackendError
from ...backend.options import declared_reads, option_not_read, option_readers
from ...config import MAX_CAPTURE_SIZE, CudaGraphConfig, CudaGraphConfigError

#: The second part of a bench label meaning "the forward compiled first" (compiled full):
#: written ``full+torch_compile``, after sglang's ``--enable-torch-compile``.
TORCH_COMPILE = "torch_compile"
TORCH_COMPILE_SUFFIX = "+" + TORCH_COMPILE

#: Old labels still read for one release, with a DeprecationWarning: their new spelling.
DEPRECATED_LABELS = {"full:inductor": "full" + TORCH_COMPILE_SUFFIX}


def new_label(label: str) -> str:
    """``label`` in today's spelling (:data:`DEPRECATED_LABELS`), else unchanged."""
    return DEPRECATED_LABELS.get(label, label)


def parse_label(label: str) -> Tuple[str, Optional[str]]:
    """``"full"`` -> ``("full", None)``; ``"tc_piecewise:inductor"`` -> ``("tc_piecewise",
    "inductor")`` (a tc_compiler); ``"full+torch_compile"`` -> ``("full", TORCH_COMPILE)``.
    A deprecated label (``full:inductor``) warns (DeprecationWarning, naming the new one)
    and reads as its new spelling."""
    label = label.strip()
    if label in DEPRECATED_LABELS:
        warnings.warn(
            f"backend label {label!r} is deprecated; use {DEPRECATED_LABELS[label]!r} "
            "(tc_compiler is tc_piecewise's compiler, as in sglang)",
            DeprecationWarning,
            stacklevel=3,
        )
        label = DEPRECATED_LABELS[label]
    if label.endswith(TORCH_COMPILE_SUFFIX):
        return label[: -len(TORCH_COMPILE_SUFFIX)], TORCH_COMPILE
    name, _, compiler = label.partition(":")
    return name, compiler or None


def label_of(backend: str, compiler: Optional[str]) -> str:
    """The label of ``(backend, compiler)`` (:func:`parse_label`'s inverse)."""
    if compiler == TORCH_COMPILE:
        return backend + TORCH_COMPILE_SUFFIX
    return backend + (f":{compiler}" if compiler else "")


def parse_backends(arg: Optional[str], configured: Optional[str]) -> List[Tuple[Optional[str], Optional[str]]]:
    """``[(backend or None for auto, a tc_compiler, TORCH_COMPILE or None)]`` from
    ``"full,tc_piecewise:inductor,full+torch_compile"`` (:func:`parse_label`)."""
    if arg:
        return [parse_label(label) for label in arg.split(",") if label.strip()]
    return [(configured, None)]


class BenchRequestError(CudaGraphRunnerError):
    """A backend named explicitly cannot be benched; ``exit_code`` 2 (usage) or 1 (runtime)."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def device_problem(device: torch.device) -> Optional[str]:
    """Why ``device`` cannot be used on this machine (no such device, torch built without
    it, index out of range), or None."""
    if device.type == "cpu":
        return None
    try:
        module = torch.get_device_module(device)
    except Exception as exc:  # torch knows the type but has no module for it
        return f"torch {torch.__version__} has no {device.type} support ({exc})"
    available = getattr(module, "is_available", None)
    if available is None or not available():
        built = ""
        if device.type == "cuda" and torch.version.cuda is None:
            built = f"; this torch {torch.__version__} was built without CUDA"
        return f"no {device.type} device is available here{built}"
    count = getattr(module, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        return f"{device} does not exist: this machine has {count} {device.type} device(s)"
    return None


@dataclasses.dataclass
class BackendChoice:
    """One backend the bench runs for one phase, resolved once: the runner is handed
    ``backend`` (it does not resolve the name again).

    Attributes:
        phase: ``"decode"`` or ``"prefill"``.
        label: the name shown and written to the JSON, ``name[:tc_compiler]`` or
            ``name+torch_compile`` (compiled full); ``"disabled"`` for eager numbers only.
        config: the bench's config with this phase's ``backend``, ``max_bs`` and
            ``tc_compiler`` set (the runner's config).
        backend: the backend instance (``registry.resolve``), or None for eager only.
        note: why the bench runs eager only (empty when ``backend`` is set).
        explicit: the name came from ``--{phase}-backends`` or the config (an error if it
            cannot run) rather than from the device's default (a note).
    """

    phase: str
    label: str
    config: CudaGraphConfig
    backend: Any = None
    note: str = ""
    explicit: bool = False


#: Backends the bench picks itself, in order, where the device's default is ``disabled``
#: (the CPU): the runner never defaults to them (compiling costs tens of seconds), but
#: the main job shows what a compiled forward gains. Names only: the core imports no plugin.
BENCH_PREFERRED = {"cpu": ("compiled",)}


def bench_choice(reg: Any, phase: str, device: torch.device, not_picked: Optional[str] = None) -> Optional[str]:
    """The first of :data:`BENCH_PREFERRED` for ``device`` usable for ``phase``, else None
    (always None when ``CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED`` is off, or ``not_picked``
    says why the bench leaves them out for this run, e.g. the model)."""
    from ...backend import envs

    if not_picked or not envs.get(envs.BENCH_CPU_COMPILED):
        return None
    for candidate in BENCH_PREFERRED.get(device.type, ()):
        try:
            reg.get(candidate, device_type=device.type, phase=phase)
        except CudaGraphRunnerError:
            continue
        return candidate
    return None


def bench_picks(
    reg: Any, config: CudaGraphConfig, device: torch.device, not_picked: Optional[str] = None
) -> Dict[str, str]:
    """``{phase: backend}`` the bench picks itself (:func:`bench_choice`, with ``not_picked``)
    for the phases on auto whose device default is ``disabled``."""
    picks = {}
    for phase in ("decode", "prefill"):
        if config[phase].backend is None and reg.default_backend(phase, device.type) == "disabled":
            chosen = bench_choice(reg, phase, device, not_picked)
            if chosen:
                picks[phase] = chosen
    return picks


def _no_backend_note(phase: str, name: Optional[str], device: torch.device, not_picked: Optional[str] = None) -> str:
    from ...registry import list_backends

    if name is not None:
        return f"{phase} backend 'disabled': running eager only"
    from ...backend import envs

    entries = [e for e in list_backends(device.type) if phase in e.phases and e.name != "disabled"]
    # A backend the bench would pick itself but the environment turned off is usable: say so.
    preferred = [e.name for e in entries if e.ok and e.name in BENCH_PREFERRED.get(device.type, ())]
    if preferred and not_picked:
        return f"{phase} backend {', '.join(preferred)} {not_picked}; running eager only"
    off = preferred if not envs.get(envs.BENCH_CPU_COMPILED) else []
    blocked = [f"{e.name}: {e.reason}" for e in entries if not e.ok]
    plugins = envs.raw(envs.PLUGINS)
    none_left = (
        f"no graph backend for this phase is loaded: {envs.PLUGINS}={plugins!r} lists the plugins to load"
        if plugins is not None
        else "no graph backend is installed for this phase"
    )
    why = "; ".join(blocked) if blocked else none_left
    if off:
        return (
            f"{phase} backend {', '.join(off)} not picked ({envs.BENCH_CPU_COMPILED}=0) and no other {phase} "
            f"graph backend is usable on {device.type} ({why}); running eager only"
        )
    return f"no {phase} graph backend is usable on {device.type} ({why}); running eager only"


def label_source(phase: str) -> str:
    """The source recorded for a label's compiler (``tc_piecewise:inductor``,
    ``full+torch_compile``): the flag it came from."""
    return f"flag:--{phase}-backends"


def takes_compile_sizes(backend: str, compiler: Optional[str], readers: Mapping[str, List[str]]) -> bool:
    """Whether a bench label uses ``compile_sizes``: it compiles the forward (``compiler``
    :data:`TORCH_COMPILE`) and its backend reads the option (``readers``:
    :func:`cuda_graph_runner.backend.options.option_readers`). ``cuda-graph-runner bench``
    and ``benchmarks/run.py`` give the sizes to such labels only."""
    return compiler == TORCH_COMPILE and backend in readers.get("compile_sizes", [])


def compiles_of(phase_config: Any) -> Optional[str]:
    """:data:`TORCH_COMPILE` when ``phase_config`` turns torch_compile on, else None."""
    return TORCH_COMPILE if getattr(phase_config, "torch_compile", False) else None


def label_options(compiler: Optional[str], max_bs: Optional[int], config_max: Optional[int]) -> Dict[str, Any]:
    """The config keys a label's second part sets: ``tc_compiler``, or for
    :data:`TORCH_COMPILE` ``torch_compile`` on with ``torch_compile_max_bs`` covering every
    size the bench measures (``max_bs``; unset: every captured size), unless the config
    sets it (``config_max``)."""
    if compiler is None:
        return {}
    if compiler != TORCH_COMPILE:
        return {"tc_compiler": compiler}
    return {"torch_compile": True, "torch_compile_max_bs": config_max or max_bs or MAX_CAPTURE_SIZE}


def label_config(
    config: CudaGraphConfig,
    phase: str,
    backend: str,
    compiler: Optional[str],
    max_bs: Optional[int],
    readers: Mapping[str, List[str]],
    selection_takes: bool,
) -> CudaGraphConfig:
    """The config one bench label runs with: ``config`` with the phase's backend,
    ``max_bs`` and what the label's second part sets (:func:`label_options`; None: the
    config's).

    ``compile_sizes`` belong to the labels that use them (:func:`takes_compile_sizes`):
    when ``selection_takes`` (some label of the selection uses them), the others run
    without them, as if never set (value and source dropped), so
    ``full,full+torch_compile`` or ``breakable,full+torch_compile`` with compile sizes run.
    When no label uses them they stay, and the backend options check names the mistake.

    Raises:
        CudaGraphConfigError: an invalid field.
    """
    fields: Dict[str, Any] = {"backend": backend, "max_bs": max_bs}
    drop = (
        bool(config[phase].compile_sizes)
        and selection_takes
        and not takes_compile_sizes(backend, compiler or compiles_of(config[phase]), readers)
    )
    if drop:
        fields["compile_sizes"] = None
    out = config.with_phase(phase, **fields)
    if compiler:  # only ``--{phase}-backends`` labels carry one
        given = config[phase].torch_compile_max_bs if (phase, "torch_compile_max_bs") in config.sources else None
        out = out.with_phase(phase, source=label_source(phase), **label_options(compiler, max_bs, given))
    if drop:
        out.sources.pop((phase, "compile_sizes"), None)
    return out


def plan_phase(
    phase: str,
    selection: Optional[str],
    config: CudaGraphConfig,
    device: torch.device,
    default_max: int,
    not_picked: Optional[str] = None,
) -> List[BackendChoice]:
    """Resolve, once, each backend the bench runs for ``phase`` (before any model is loaded).

    ``selection`` is ``--{phase}-backends`` (``"full,tc_piecewise:inductor"``) or None for
    the config's backend, or the device's default when the config names none.
    ``default_max`` is the phase's ``max_bs`` when the config sets neither ``max_bs`` nor
    ``bs`` (the largest batch size or token count the bench measures). ``not_picked``:
    why the bench does not pick :data:`BENCH_PREFERRED` itself in this run (the words of
    the note; a backend named explicitly still runs).

    Raises:
        BenchRequestError: a backend named explicitly cannot run: exit 2 for an unknown
            name or an option the backend does not read, 1 for a backend that is failed,
            in conflict, unavailable here, not for the phase or breaks the contract. A
            backend the bench chose itself gives a note and ``backend=None`` instead.
    """
    from ...registry import get_registry

    reg = get_registry()
    phase_config = config[phase]
    max_bs = phase_config.max_bs or (None if phase_config.bs else default_max)
    choices = []
    cannot_run: Optional[BenchRequestError] = None
    parsed = parse_backends(selection, phase_config.backend)
    readers = option_readers(reg)
    known = set(reg.names())  # after option_readers: its scan fills the registry
    phases_of = reg.backend_phases()  # the specs' phases (failed and conflicting entries left out)

    def backend_of(name: Optional[str]) -> str:
        chosen = name or reg.default_backend(phase, device.type)
        if name is None and chosen == "disabled":
            chosen = bench_choice(reg, phase, device, not_picked) or chosen
        return chosen

    resolved = [(name, compiler, backend_of(name)) for name, compiler in parsed]
    selection_takes = any(
        takes_compile_sizes(chosen, compiler or compiles_of(phase_config), readers) for _, compiler, chosen in resolved
    )
    for name, compiler, chosen in resolved:
        explicit = name is not None
        where = f"--{phase}-backends" if selection else "the config"
        label = label_of(chosen, compiler or compiles_of(phase_config))
        if chosen == "disabled":
            choices.append(
                BackendChoice(
                    phase, "disabled", config, None, _no_backend_note(phase, name, device, not_picked), explicit
                )
            )
            continue
        if explicit and phase not in phases_of.get(chosen, (phase,)):
            # The phases are the spec's, the same on every device: a usage error, as in `config`.
            others = sorted(n for n, p in phases_of.items() if phase in p)
            raise BenchRequestError(
                f"{phase} backend {name!r} (from {where}): backend {chosen!r} is for "
                f"{', '.join(sorted(phases_of[chosen]))} only; accepted for {phase}: {', '.join(others)}",
                2,
            )
        try:
            if compiler:
                if chosen not in known:
                    reg.get(chosen)  # the unknown name is the mistake, not its compiler
                reads = declared_reads(reg, chosen)
                option = "torch_compile" if compiler == TORCH_COMPILE else "tc_compiler"
                if reads is not None and option not in reads:
                    # Before the value is checked: "accepted: eager, inductor" would be refused next.
                    raise option_not_read(phase, option, compiler, label_source(phase), chosen, readers)
            phase_cfg = label_config(config, phase, chosen, compiler, max_bs, readers, selection_takes)
            backend = reg.resolve(phase, phase_cfg, device=str(device))
        except CudaGraphConfigError as exc:
            # The user's option, whoever picked the backend: an error, never a quiet eager run.
            who = f"{name!r} (from {where})" if explicit else f"auto (the bench picked {chosen!r} on {device.type})"
            raise BenchRequestError(f"{phase} backend {who}: {exc}", 2) from None
        except UnknownBackendError as exc:
            if explicit:
                raise BenchRequestError(f"{phase} backend {name!r} (from {where}): {exc}", 2) from None
            note = f"{phase} backend {chosen!r} skipped: {exc}; running eager only"
            choices.append(BackendChoice(phase, "disabled", config, None, note))
            continue
        except CudaGraphRunnerError as exc:
            if explicit:
                # Raised after the whole list: an unknown name further down (exit 2) is
                # the user's first mistake and must not be hidden by this one.
                cannot_run = cannot_run or BenchRequestError(
                    f"{phase} backend {name!r} was asked for ({where}) but cannot run: {exc}", 1
                )
                continue
            note = f"{phase} backend {chosen!r} skipped: {exc}; running eager only"
            choices.append(BackendChoice(phase, "disabled", config, None, note))
            continue
        choices.append(BackendChoice(phase, label, phase_cfg, backend, "", explicit))
    if cannot_run is not None:
        raise cannot_run
    return choices

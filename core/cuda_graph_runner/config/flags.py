"""The command-line flags of the config: the per-phase flags, the deprecated sglang aliases
(each warns once per process), their precedence tiers, and :func:`add_cuda_graph_args`.

The flags and their tiers are listed in the package docstring
(:mod:`cuda_graph_runner.config`). Standard library only.
"""

from __future__ import annotations

import argparse
import warnings
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..integers import parse_digits
from .exceptions import CudaGraphConfigError, _short_repr
from .loading import _load_json
from .model import (
    _BACKEND_NAME,
    _BACKEND_NAME_ACCEPTED,
    _SIZE_ACCEPTED,
    DEFAULT_MAX_BS,
    MAX_CAPTURE_SIZE,
    SOURCE_JSON,
    SOURCE_JSON_FLAG,
    TC_COMPILERS,
    Backend,
    CudaGraphConfig,
    Phase,
    _build_phase,
)

__all__ = ["FlattenSizes", "add_cuda_graph_args", "sizes_arg", "source_phases"]

_TIER_LEGACY = "legacy"
_TIER_FLAG = "flag"
_NO_CONST = object()
#: Keys whose flags take sizes, space or comma separated.
_SIZE_LIST_KEYS = ("bs", "compile_sizes")


@dataclass(frozen=True)
class _Flag:
    """One command-line flag and the (phases, key) it sets."""

    option: str
    tier: str
    phases: Tuple[str, ...]
    key: str
    help: str
    const: Any = _NO_CONST  # flags without a value set the key to this
    replacement: str = ""  # legacy flags: what to use instead

    @property
    def dest(self) -> str:
        return self.option[2:].replace("-", "_")

    def value_from(self, raw: Any) -> Any:
        if self.const is not _NO_CONST:
            return self.const
        if self.key in _SIZE_LIST_KEYS and isinstance(raw, (list, tuple)):
            # nargs="+" of comma lists: [[1, 2], [4]] -> [1, 2, 4]
            flat: List[Any] = []
            for item in raw:
                flat.extend(item) if isinstance(item, (list, tuple)) else flat.append(item)
            return flat
        return raw


def _phase_flags(p: str) -> List[_Flag]:
    size = "batch size" if p == Phase.DECODE else "token count"
    return [
        _Flag(
            f"--cuda-graph-backend-{p}",
            _TIER_FLAG,
            (p,),
            "backend",
            f"{p} backend: {', '.join(Backend.FOR_PHASE[p])} or a plugin's name (default: auto)",
        ),
        _Flag(
            f"--cuda-graph-max-bs-{p}",
            _TIER_FLAG,
            (p,),
            "max_bs",
            f"largest {p} {size} to capture, at most {MAX_CAPTURE_SIZE} "
            f"(default: null, meaning the runner's default, {DEFAULT_MAX_BS[p]})",
        ),
        _Flag(
            f"--cuda-graph-bs-{p}",
            _TIER_FLAG,
            (p,),
            "bs",
            f"{p} {size}s to capture, space or comma separated (default: the runner's buckets)",
        ),
        _Flag(
            f"--cuda-graph-tc-compiler-{p}",
            _TIER_FLAG,
            (p,),
            "tc_compiler",
            f"compiler of tc_piecewise's pieces or of full's forward for {p} (default: eager); an error "
            "with a backend that does not read it (backend disabled excepted: turning graphs off keeps a "
            "command line valid)",
        ),
        # Decode only: no shipped prefill backend reads compile_sizes (JSON can still set it).
        *(
            [
                _Flag(
                    f"--cuda-graph-compile-sizes-{p}",
                    _TIER_FLAG,
                    (p,),
                    "compile_sizes",
                    f"{p} {size}s compiled with static shapes, each in its own graph (vLLM's compile_sizes; "
                    "read by full with tc_compiler inductor, an error with tc_compiler eager; each must be a captured "
                    "size; default: none, one dynamic-shape graph serves every size)",
                )
            ]
            if p == Phase.DECODE
            else []
        ),
        _Flag(
            f"--disable-cuda-graph-{p}",
            _TIER_FLAG,
            (p,),
            "backend",
            f"no graphs for {p} (backend disabled)",
            const=Backend.DISABLED,
        ),
    ]


def _legacy(option: str, phases: Tuple[str, ...], key: str, replacement: str, const: Any = _NO_CONST) -> _Flag:
    return _Flag(option, _TIER_LEGACY, phases, key, f"deprecated: use {replacement}", const, replacement)


_FLAGS: Tuple[_Flag, ...] = (
    *_phase_flags(Phase.DECODE),
    *_phase_flags(Phase.PREFILL),
    _Flag(
        "--cuda-graph-tc-compiler",
        _TIER_FLAG,
        Phase.ALL,
        "tc_compiler",
        "compiler of tc_piecewise's pieces or of full's forward for both phases (default: eager)",
    ),
    _legacy(
        "--disable-cuda-graph",
        Phase.ALL,
        "backend",
        "--disable-cuda-graph-decode --disable-cuda-graph-prefill",
        Backend.DISABLED,
    ),
    _legacy(
        "--enable-breakable-cuda-graph",
        (Phase.PREFILL,),
        "backend",
        "--cuda-graph-backend-prefill breakable",
        Backend.BREAKABLE,
    ),
    _legacy(
        "--disable-piecewise-cuda-graph", (Phase.PREFILL,), "backend", "--disable-cuda-graph-prefill", Backend.DISABLED
    ),
    _legacy(
        "--enforce-piecewise-cuda-graph",
        (Phase.PREFILL,),
        "backend",
        "--cuda-graph-backend-prefill tc_piecewise",
        Backend.TC_PIECEWISE,
    ),
    _legacy("--cuda-graph-max-bs", (Phase.DECODE,), "max_bs", "--cuda-graph-max-bs-decode"),
    _legacy("--cuda-graph-bs", (Phase.DECODE,), "bs", "--cuda-graph-bs-decode"),
    _legacy("--piecewise-cuda-graph-tokens", (Phase.PREFILL,), "bs", "--cuda-graph-bs-prefill"),
    _legacy("--piecewise-cuda-graph-max-tokens", (Phase.PREFILL,), "max_bs", "--cuda-graph-max-bs-prefill"),
    _legacy("--piecewise-cuda-graph-compiler", Phase.ALL, "tc_compiler", "--cuda-graph-tc-compiler"),
)


def _resolve_tier(namespace: Any, tier: str) -> Dict[Tuple[str, str], Tuple[_Flag, Any]]:
    """The (phase, key) -> (flag, value) that the given flags of one tier set.

    A one-phase flag beats a both-phase flag; equal specificity with different
    values raises CudaGraphConfigError.
    """
    chosen: Dict[Tuple[str, str], Tuple[_Flag, Any]] = {}
    for flag in _FLAGS:
        raw = getattr(namespace, flag.dest, None)
        if flag.tier != tier or raw is None or raw is False:
            continue
        value = flag.value_from(raw)
        for phase in flag.phases:
            previous = chosen.get((phase, flag.key))
            if previous is None or len(previous[0].phases) > len(flag.phases):
                chosen[(phase, flag.key)] = (flag, value)
            elif len(previous[0].phases) == len(flag.phases) and previous[1] != value:
                raise CudaGraphConfigError(
                    f"conflicts with {previous[0].option} (which sets {_short_repr(previous[1])})",
                    phase=phase,
                    key=flag.key,
                    value=value,
                    accepted="one value per phase and key; drop one of the two flags",
                    source=f"{tier}:{flag.option}",
                )
    return chosen


def _from_args(cls: Any, namespace: Any) -> Any:
    """``cls.from_args(namespace)`` (:meth:`CudaGraphConfig.from_args`): the tiers applied
    lowest first, then ``--cuda-graph-config``. Raises CudaGraphConfigError."""
    values: Dict[str, Dict[str, Any]] = {phase: {} for phase in Phase.ALL}
    sources: Dict[Tuple[str, str], str] = {}
    for tier in (_TIER_LEGACY, _TIER_FLAG):
        for (phase, key), (flag, value) in _resolve_tier(namespace, tier).items():
            values[phase][key] = value
            sources[(phase, key)] = f"{tier}:{flag.option}"
    raw = getattr(namespace, "cuda_graph_config", None)
    if raw is not None:
        if not isinstance(raw, Mapping):
            raw = _load_json(raw, SOURCE_JSON_FLAG)
        from_json = cls.from_dict(raw, source=SOURCE_JSON_FLAG)
        for phase, key in from_json.sources:
            values[phase][key] = getattr(from_json[phase], key)
            sources[(phase, key)] = SOURCE_JSON_FLAG
    phases = {phase: _build_phase(phase, values[phase], sources) for phase in Phase.ALL}
    return cls(**phases, sources=sources)


def source_phases(source: Optional[str]) -> Tuple[str, ...]:
    """The phases the flag behind ``source`` (``"flag:--x"``, ``"legacy:--y"``) sets at
    once; ``()`` for any other source (JSON, API, default)."""
    tier, _, option = (source or "").partition(":")
    for flag in _FLAGS:
        if flag.tier == tier and flag.option == option:
            return flag.phases
    return ()


_WARNED_FLAGS: set = set()  # legacy flags already warned about in this process


def _warn_deprecated(option: str, replacement: str) -> None:
    if option in _WARNED_FLAGS:
        return
    _WARNED_FLAGS.add(option)
    warnings.warn(f"{option} is deprecated and will be removed; use {replacement}", FutureWarning, stacklevel=3)


class _DeprecatedAlias(argparse.Action):
    """Stores like a plain flag after warning that the flag is deprecated."""

    def __init__(self, option_strings: List[str], dest: str, replacement: str, **kwargs: Any) -> None:
        self.replacement = replacement
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        _warn_deprecated(self.option_strings[0], self.replacement)
        setattr(namespace, self.dest, True if self.nargs == 0 else values)


def _positive_int_arg(text: str) -> int:
    value = parse_digits(text) or 0  # ASCII digits only: int() would read "٨" and "1_0"
    if value < 1 or value > MAX_CAPTURE_SIZE:
        raise argparse.ArgumentTypeError(f"invalid value {_short_repr(text)}; accepted: {_SIZE_ACCEPTED}")
    return value


def sizes_arg(text: str) -> List[int]:
    """argparse ``type`` of a sizes flag: ``"1,2,4"`` -> ``[1, 2, 4]`` (with ``nargs="+"``,
    ``1 2,4`` works too; :class:`FlattenSizes` joins the lists).

    Raises:
        argparse.ArgumentTypeError: a part that is not an integer in 1..``MAX_CAPTURE_SIZE``.
    """
    try:
        return [_positive_int_arg(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid sizes {_short_repr(text)}; accepted: integers >= 1 and <= {MAX_CAPTURE_SIZE}, space or comma separated"
        ) from None


class FlattenSizes(argparse.Action):
    """Stores the lists of :func:`sizes_arg` as one list: ``1,2 4`` -> ``[1, 2, 4]``."""

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        setattr(namespace, self.dest, [size for part in values for size in part])


def _backend_arg(text: str) -> str:
    if not _BACKEND_NAME.fullmatch(text):
        raise argparse.ArgumentTypeError(f"invalid backend name {text!r}; accepted: {_BACKEND_NAME_ACCEPTED}")
    return text


def _config_arg(text: str) -> Dict[str, Any]:
    """Parse and check ``--cuda-graph-config`` at parse time; keep the raw dict for from_args."""
    try:
        raw = _load_json(text, None)
        CudaGraphConfig.from_dict(raw, source=SOURCE_JSON)
    except CudaGraphConfigError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return raw


def add_cuda_graph_args(parser: Any) -> Any:
    """Add the CUDA-graph flags (module docstring) to an argparse parser; returns their group.

    Every flag defaults to None, so :meth:`CudaGraphConfig.from_args` can tell
    given from not given. Bad values stop parsing with a message that names the
    flag and the value.
    """
    group = parser.add_argument_group(
        "CUDA graphs",
        "precedence, lowest to highest: defaults < deprecated flags < per-phase flags < --cuda-graph-config",
    )
    group.add_argument(
        "--cuda-graph-config",
        type=_config_arg,
        default=None,
        metavar="JSON_OR_PATH",
        help='JSON object (or file) like {"decode": {"backend": "full", "max_bs": 64}}; beats every other flag',
    )
    for flag in _FLAGS:
        kwargs: Dict[str, Any] = dict(dest=flag.dest, default=None, help=flag.help)
        if flag.const is not _NO_CONST:
            kwargs["nargs"] = 0
        elif flag.key in _SIZE_LIST_KEYS:
            kwargs.update(nargs="+", type=sizes_arg, metavar="N")
        elif flag.key == "max_bs":
            kwargs.update(type=_positive_int_arg, metavar="N")
        elif flag.key == "backend":
            kwargs.update(type=_backend_arg, metavar="NAME")
        else:
            kwargs.update(choices=TC_COMPILERS)
        if flag.tier == _TIER_LEGACY:
            kwargs.update(action=_DeprecatedAlias, replacement=flag.replacement)
        elif kwargs.get("nargs") == 0:
            del kwargs["nargs"]
            kwargs["action"] = "store_true"
        group.add_argument(flag.option, **kwargs)
    return group

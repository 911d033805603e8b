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

from .exceptions import CudaGraphConfigError, _short_repr
from .integers import parse_digits
from .loading import _load_json
from .model import (
    _BACKEND_NAME,
    _BACKEND_NAME_ACCEPTED,
    _SIZE_ACCEPTED,
    DEFAULT_MAX_BS,
    MAX_CAPTURE_SIZE,
    SOURCE_JSON_FLAG,
    TC_COMPILERS,
    TORCH_COMPILE_MAX_BS,
    Backend,
    CudaGraphConfig,
    Phase,
    _build_phase,
    migrate_tc_compiler,
)

__all__ = ["FlattenSizes", "add_cuda_graph_args", "sizes_arg", "source_phases"]

_TIER_LEGACY = "legacy"
_TIER_OFF = "off"
_TIER_FLAG = "flag"
#: Lowest first (sglang's ``parse_cuda_graph_config``): ``--disable-cuda-graph``, then the
#: per-phase off switches, then the flags that name a value (the aliases among them).
_TIERS = (_TIER_LEGACY, _TIER_OFF, _TIER_FLAG)
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
    #: The option whose argparse storage this flag writes too (sglang's aliases and its
    #: per-phase off switches share storage with their replacement: the one written last wins).
    shares: str = ""

    @property
    def dest(self) -> str:
        return (self.shares or self.option)[2:].replace("-", "_")

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
            f"compiler of tc_piecewise's pieces for {p} (default: eager); an error with a backend that does "
            "not read it (backend disabled excepted: turning graphs off keeps a command line valid)"
            + ("; with full: the deprecated spelling of --enable-torch-compile" if p == Phase.DECODE else ""),
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
                    "read by full with --enable-torch-compile, an error without; each must be a captured size "
                    "up to --torch-compile-max-bs; default: none, one dynamic-shape graph serves every size)",
                )
            ]
            if p == Phase.DECODE
            else []
        ),
        _Flag(
            f"--disable-{p}-cuda-graph",
            _TIER_OFF,
            (p,),
            "backend",
            f"no graphs for {p} (backend disabled) unless --cuda-graph-backend-{p} names one (sglang's off switch)",
            const=Backend.DISABLED,
        ),
        _Flag(
            f"--disable-cuda-graph-{p}",
            _TIER_OFF,
            (p,),
            "backend",
            f"the same as --disable-{p}-cuda-graph",
            const=Backend.DISABLED,
            shares=f"--disable-{p}-cuda-graph",
        ),
    ]


def _legacy(
    option: str, phases: Tuple[str, ...], key: str, replacement: str, const: Any = _NO_CONST, shares: str = ""
) -> _Flag:
    """A deprecated sglang flag. With ``shares`` it is an alias of that flag (sglang's
    ``DeprecatedAliasStoreAction`` / ``DeprecatedStoreConstAction``: the same storage, so
    of the two the one written last wins); without, a tier of its own below every flag."""
    tier = _TIER_FLAG if shares else _TIER_LEGACY
    return _Flag(option, tier, phases, key, f"deprecated: use {replacement}", const, replacement, shares)


_FLAGS: Tuple[_Flag, ...] = (
    *_phase_flags(Phase.DECODE),
    *_phase_flags(Phase.PREFILL),
    _Flag(
        "--cuda-graph-tc-compiler",
        _TIER_FLAG,
        Phase.ALL,
        "tc_compiler",
        "compiler of tc_piecewise's pieces for both phases (default: eager); ignored, with a warning, by "
        "backends that do not read it, as in sglang",
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
        shares="--cuda-graph-backend-prefill",
    ),
    _legacy(
        "--disable-piecewise-cuda-graph",
        (Phase.PREFILL,),
        "backend",
        "--cuda-graph-backend-prefill disabled",
        Backend.DISABLED,
        shares="--cuda-graph-backend-prefill",
    ),
    _legacy(
        "--enforce-piecewise-cuda-graph",
        (Phase.PREFILL,),
        "backend",
        "--cuda-graph-backend-prefill tc_piecewise",
        Backend.TC_PIECEWISE,
        shares="--cuda-graph-backend-prefill",
    ),
    _legacy(
        "--cuda-graph-max-bs",
        (Phase.DECODE,),
        "max_bs",
        "--cuda-graph-max-bs-decode",
        shares="--cuda-graph-max-bs-decode",
    ),
    _legacy("--cuda-graph-bs", (Phase.DECODE,), "bs", "--cuda-graph-bs-decode", shares="--cuda-graph-bs-decode"),
    _legacy(
        "--piecewise-cuda-graph-tokens",
        (Phase.PREFILL,),
        "bs",
        "--cuda-graph-bs-prefill",
        shares="--cuda-graph-bs-prefill",
    ),
    _legacy(
        "--piecewise-cuda-graph-max-tokens",
        (Phase.PREFILL,),
        "max_bs",
        "--cuda-graph-max-bs-prefill",
        shares="--cuda-graph-max-bs-prefill",
    ),
    _legacy(
        "--piecewise-cuda-graph-compiler",
        Phase.ALL,
        "tc_compiler",
        "--cuda-graph-tc-compiler",
        shares="--cuda-graph-tc-compiler",
    ),
    _Flag(
        "--enable-torch-compile",
        _TIER_FLAG,
        (Phase.DECODE,),
        "torch_compile",
        "compile decode's forward with torch.compile (inductor) before full captures it: compiled full "
        "(sglang's flag; decode backend full only)",
        const=True,
    ),
    _Flag(
        "--torch-compile-max-bs",
        _TIER_FLAG,
        (Phase.DECODE,),
        "torch_compile_max_bs",
        f"with --enable-torch-compile, the largest decode batch size captured from the compiled forward; "
        f"larger ones capture the forward as written (sglang's flag; default {TORCH_COMPILE_MAX_BS})",
    ),
)


def _writer(namespace: Any, flag: _Flag) -> bool:
    """Whether ``flag`` wrote its storage last (flags that share storage: the last one
    given wins, as in sglang). A namespace built by hand, without the parser, counts
    every flag whose attribute is set."""
    writers = getattr(namespace, _WRITERS, None)
    if not isinstance(writers, dict) or flag.dest not in writers:
        return not flag.shares
    return writers[flag.dest] == flag.option


def _resolve_tier(namespace: Any, tier: str) -> Dict[Tuple[str, str], Tuple[_Flag, Any]]:
    """The (phase, key) -> (flag, value) that the given flags of one tier set.

    A one-phase flag beats a both-phase flag; equal specificity with different
    values raises CudaGraphConfigError.
    """
    chosen: Dict[Tuple[str, str], Tuple[_Flag, Any]] = {}
    for flag in _FLAGS:
        raw = getattr(namespace, flag.dest, None)
        if flag.tier != tier or raw is None or raw is False or not _writer(namespace, flag):
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


def _superseded(namespace: Any) -> Tuple[Tuple[str, str, str], ...]:
    """``(phase, backend name, source)`` of every backend name a later flag replaced: sglang
    checks each value a flag is given, so ``--cuda-graph-backend-decode npu
    --cuda-graph-backend-decode full`` is refused where npu is not a decode backend
    (:meth:`CudaGraphConfig.validate` checks them)."""
    history = [(_BY_OPTION.get(option), value) for option, value in getattr(namespace, _HISTORY, None) or ()]
    last = {flag.dest: index for index, (flag, _) in enumerate(history) if flag is not None}
    out: List[Tuple[str, str, str]] = []
    for index, (flag, value) in enumerate(history):
        if flag is None or flag.key != "backend" or flag.const is not _NO_CONST or last[flag.dest] == index:
            continue
        source = f"{'legacy' if flag.replacement else flag.tier}:{flag.option}"
        out.extend((phase, value, source) for phase in flag.phases)
    return tuple(out)


def _from_args(cls: Any, namespace: Any) -> Any:
    """``cls.from_args(namespace)`` (:meth:`CudaGraphConfig.from_args`): the tiers applied
    lowest first, then ``--cuda-graph-config``. Raises CudaGraphConfigError."""
    values: Dict[str, Dict[str, Any]] = {phase: {} for phase in Phase.ALL}
    sources: Dict[Tuple[str, str], str] = {}
    for tier in _TIERS:
        for (phase, key), (flag, value) in _resolve_tier(namespace, tier).items():
            values[phase][key] = value
            sources[(phase, key)] = f"{'legacy' if flag.replacement else tier}:{flag.option}"
    migrate_tc_compiler(values, sources)
    raw = getattr(namespace, "cuda_graph_config", None)
    if raw is not None:
        if not isinstance(raw, Mapping):
            raw = _load_json(raw, SOURCE_JSON_FLAG)
        from_json = cls.from_dict(raw, source=SOURCE_JSON_FLAG)
        for phase, key in from_json.sources:
            values[phase][key] = getattr(from_json[phase], key)
            sources[(phase, key)] = SOURCE_JSON_FLAG
    phases = {phase: _build_phase(phase, values[phase], sources) for phase in Phase.ALL}
    return cls(**phases, sources=sources, superseded=_superseded(namespace))


_BY_OPTION: Dict[str, _Flag] = {flag.option: flag for flag in _FLAGS}


def source_phases(source: Optional[str]) -> Tuple[str, ...]:
    """The phases the flag behind ``source`` (``"flag:--x"``, ``"legacy:--y"``) sets at
    once; ``()`` for any other source (JSON, API, default)."""
    tier, _, option = (source or "").partition(":")
    flag = _BY_OPTION.get(option)
    if flag is None or tier not in (*_TIERS, "legacy"):
        return ()
    return flag.phases


_WARNED_FLAGS: set = set()  # legacy flags already warned about in this process
#: Namespace attributes the flags' action keeps: which option wrote each storage last, and
#: every (option, value) given in order.
_WRITERS = "_cuda_graph_writers"
_HISTORY = "_cuda_graph_history"


def _warn_deprecated(option: str, replacement: str) -> None:
    if option in _WARNED_FLAGS:
        return
    _WARNED_FLAGS.add(option)
    warnings.warn(f"{option} is deprecated and will be removed; use {replacement}", FutureWarning, stacklevel=3)


class _Store(argparse.Action):
    """Stores a flag's value (or its constant), records which option wrote the storage
    and, for a deprecated flag, warns once that it is deprecated."""

    def __init__(self, option_strings: List[str], dest: str, flag: _Flag, **kwargs: Any) -> None:
        self.flag = flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: Optional[str] = None) -> None:
        flag = self.flag
        if flag.replacement:
            _warn_deprecated(flag.option, flag.replacement)
        value = flag.const if flag.const is not _NO_CONST else values
        if flag.key in _SIZE_LIST_KEYS and isinstance(value, list):
            value = [size for part in value for size in (part if isinstance(part, list) else [part])]
        setattr(namespace, self.dest, value)
        writers = dict(getattr(namespace, _WRITERS, None) or {})
        writers[self.dest] = flag.option
        setattr(namespace, _WRITERS, writers)
        setattr(namespace, _HISTORY, [*(getattr(namespace, _HISTORY, None) or ()), (flag.option, value)])


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
        CudaGraphConfig.from_dict(raw, source=SOURCE_JSON_FLAG)
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
        "precedence, lowest to highest: defaults < --disable-cuda-graph < per-phase off switches < flags "
        "naming a value (an alias and its replacement share one value: the one written last wins) "
        "< --cuda-graph-config",
    )
    group.add_argument(
        "--cuda-graph-config",
        type=_config_arg,
        default=None,
        metavar="JSON_OR_PATH",
        help='JSON object (or file) like {"decode": {"backend": "full", "max_bs": 64}}; beats every other flag',
    )
    for flag in _FLAGS:
        kwargs: Dict[str, Any] = dict(dest=flag.dest, default=None, help=flag.help, action=_Store, flag=flag)
        if flag.const is not _NO_CONST:
            kwargs["nargs"] = 0
        elif flag.key in _SIZE_LIST_KEYS:
            kwargs.update(nargs="+", type=sizes_arg, metavar="N")
        elif flag.key in ("max_bs", "torch_compile_max_bs"):
            kwargs.update(type=_positive_int_arg, metavar="N")
        elif flag.key == "backend":
            kwargs.update(type=_backend_arg, metavar="NAME")
        else:
            kwargs.update(choices=TC_COMPILERS)
        group.add_argument(flag.option, **kwargs)
    return group

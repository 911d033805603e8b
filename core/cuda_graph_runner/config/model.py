"""The config's data model: phases, keys and their checks (:class:`PhaseConfig`), both
phases with the source of each value (:class:`CudaGraphConfig`), and the checks against the
installed backends. The keys, their meaning and the precedence of sources are described
in the package docstring (:mod:`cuda_graph_runner.config`). Standard library only.
"""

from __future__ import annotations

import dataclasses
import numbers
import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Collection, Dict, List, Mapping, Optional, Tuple, Union

from .exceptions import CudaGraphConfigError, _short_repr
from .loading import _load_json


class Phase:
    """The two phases a config covers."""

    DECODE = "decode"
    PREFILL = "prefill"
    ALL = (DECODE, PREFILL)


class Backend:
    """Well-known backend names. Not a closed set: plugins add their own."""

    FULL = "full"
    BREAKABLE = "breakable"
    TC_PIECEWISE = "tc_piecewise"
    NPU = "npu"
    COMPILED = "compiled"
    DISABLED = "disabled"
    WELL_KNOWN = (FULL, BREAKABLE, TC_PIECEWISE, NPU, COMPILED, DISABLED)
    #: The well-known names per phase (their plugins' specs say the same; a test checks it).
    FOR_PHASE = {
        "decode": WELL_KNOWN,
        "prefill": (FULL, BREAKABLE, TC_PIECEWISE, DISABLED),
    }


#: Distribution to ``pip install`` for each well-known backend name.
WELL_KNOWN_DISTRIBUTIONS: Dict[str, str] = {
    Backend.FULL: "cuda-graph-runner-full",
    Backend.BREAKABLE: "cuda-graph-runner-breakable",
    Backend.TC_PIECEWISE: "cuda-graph-runner-tc-piecewise",
    Backend.NPU: "cuda-graph-runner-npu",
    Backend.COMPILED: "cuda-graph-runner-compiled",
    Backend.DISABLED: "cuda-graph-runner",
}

TC_COMPILERS = ("eager", "inductor")

#: Compilers ``torch_compile`` names (``true`` means the first: sglang's ``--enable-torch-compile``).
TORCH_COMPILERS = ("inductor",)

#: The largest decode batch size compiled when ``torch_compile_max_bs`` is unset
#: (sglang's ``--torch-compile-max-bs`` default).
TORCH_COMPILE_MAX_BS = 32

#: Values of the ``warmup`` key (see the module docstring).
WARMUP_POLICIES = ("auto", "every_size", "first_size")

#: Values of the ``capture`` key: ``blocking`` captures every size inside ``capture()``;
#: ``eager_first`` serves eagerly and captures in ``capture_step(budget_ms)`` calls
#: (:mod:`cuda_graph_runner.runner.lazy_capture`).
CAPTURE_POLICIES = ("blocking", "eager_first")

#: Values of the ``forward_asleep`` key: what ``forward`` does while the runner sleeps.
FORWARD_ASLEEP = ("eager", "raise")

#: What a runner uses when ``max_bs`` is None.
DEFAULT_MAX_BS: Dict[str, int] = {Phase.DECODE: 256, Phase.PREFILL: 4096}

#: Largest accepted ``max_bs`` and ``bs`` element (decode batch size or prefill token
#: count): far above any engine's batch, small enough that the runner's buckets and
#: static buffers stay bounded.
MAX_CAPTURE_SIZE = 65536

#: The keys of one phase, in field order.
PHASE_KEYS = (
    "backend",
    "max_bs",
    "bs",
    "tc_compiler",
    "compile_sizes",
    "torch_compile",
    "torch_compile_max_bs",
    "owned_outputs",
    "host_value_guard",
    "verify",
    "verify_first_n",
    "verify_every",
    "warmup",
    "variants",
    "padded_eager",
    "eager_through",
    "full_prefill_max_req",
    "check_weights_every",
    "forward_asleep",
    "capture",
    "mixed_tokens",
    "mixed_requests",
)

#: Keys of one phase only: ``{key: the phase that reads it}`` (set on the other phase, an error).
PHASE_ONLY_KEYS = {"full_prefill_max_req": "prefill", "mixed_tokens": "prefill", "mixed_requests": "prefill"}

#: The mixed runner's sizes per axis when ``mixed_tokens`` / ``mixed_requests`` are unset:
#: token counts (a chunk plus the decodes beside it) and request counts.
DEFAULT_MIXED_TOKENS = (64, 128, 256, 512)
DEFAULT_MIXED_REQUESTS = (1, 2, 4, 8, 16, 32)

#: Request slots of a prefill ``full`` graph per this many tokens of the largest captured
#: size when ``full_prefill_max_req`` is unset (sglang: ``chunked_prefill_size // 512``).
TOKENS_PER_REQUEST_SLOT = 512

#: Keys read by backends rather than the runner. A backend declares the ones it reads in
#: ``BackendSpec.options``; one set for a backend that does not read it is an error.
BACKEND_OPTION_KEYS = ("tc_compiler", "compile_sizes", "torch_compile", "torch_compile_max_bs")

SOURCE_DEFAULT = "default"
SOURCE_API = "api"
SOURCE_JSON = "json"
SOURCE_JSON_FLAG = "json:--cuda-graph-config"

# ASCII only: backend names double as entry-point names and dict keys.
_BACKEND_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_BACKEND_NAME_ACCEPTED = "an identifier such as " + ", ".join(Backend.WELL_KNOWN) + " or a plugin's name"
_SIZE_ACCEPTED = f"an integer >= 1 and <= {MAX_CAPTURE_SIZE} (not a bool)"
_SIZES_ACCEPTED = f"a non-empty list of integers >= 1 and <= {MAX_CAPTURE_SIZE} (not bools)"
# Graph variant labels (cuda_graph_runner.runner.variants): ``|`` and ``:`` separate the
# parts of a shape key, so a label holds neither.
_VARIANT_LABEL = re.compile(r"[A-Za-z0-9_]+")
_VARIANTS_ACCEPTED = (
    "null (the model's variants) or a non-empty list of labels of letters, digits and _, e.g. ['nolora', 'lora']"
)


def _positive_int(value: Any, key: str) -> int:
    """``value`` as an int from 1 to ``MAX_CAPTURE_SIZE``; bools are refused. Raises CudaGraphConfigError."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < 1:
        raise CudaGraphConfigError("must be a positive integer", key=key, value=value, accepted=_SIZE_ACCEPTED)
    if int(value) > MAX_CAPTURE_SIZE:
        raise CudaGraphConfigError(
            f"is above the maximum capture size {MAX_CAPTURE_SIZE}", key=key, value=value, accepted=_SIZE_ACCEPTED
        )
    return int(value)


def _sizes(value: Any, key: str) -> List[int]:
    """``value`` (a non-empty list or tuple of sizes) sorted, duplicates dropped, as a new
    list. Raises CudaGraphConfigError naming ``key``."""
    if not isinstance(value, (list, tuple)) or not value:
        raise CudaGraphConfigError(
            "must be null or a non-empty list of sizes", key=key, value=value, accepted=_SIZES_ACCEPTED
        )
    for size in value:
        if isinstance(size, bool) or not isinstance(size, numbers.Integral) or int(size) < 1:
            raise CudaGraphConfigError(
                f"element {_short_repr(size)} is not a positive integer", key=key, value=value, accepted=_SIZES_ACCEPTED
            )
        if int(size) > MAX_CAPTURE_SIZE:
            raise CudaGraphConfigError(
                f"element {_short_repr(size)} is above the maximum capture size {MAX_CAPTURE_SIZE}",
                key=key,
                value=value,
                accepted=_SIZES_ACCEPTED,
            )
    return sorted({int(size) for size in value})


@dataclass
class PhaseConfig:
    """Settings of one phase; validated and normalised on construction.

    With ``bs`` set, ``max_bs`` is ignored (sglang: max_bs becomes max(bs)).
    ``bs`` is normalised, not rejected, when unsorted or duplicated: it is
    stored sorted ascending with duplicates dropped (``[8, 1, 8]`` -> ``[1, 8]``),
    as a new list. An empty ``bs`` is rejected (use backend ``disabled``).

    Raises:
        CudaGraphConfigError (``phase`` None; :class:`CudaGraphConfig` adds it):
        backend not None nor an identifier string; max_bs or an element of bs
        not an int >= 1 (bools refused); bs not a non-empty list/tuple;
        tc_compiler not in ``TC_COMPILERS``; compile_sizes not null nor
        a non-empty list of sizes, or a size outside bs (or above max_bs); owned_outputs not a bool.

    Assigning a field later skips these checks; :meth:`CudaGraphConfig.validate`
    runs them again. Prefer :meth:`CudaGraphConfig.with_phase`.
    """

    backend: Optional[str] = None
    max_bs: Optional[int] = None
    bs: Optional[List[int]] = None
    tc_compiler: str = "eager"
    compile_sizes: Optional[List[int]] = None
    torch_compile: Union[bool, str] = False
    torch_compile_max_bs: Optional[int] = None
    owned_outputs: bool = False
    host_value_guard: bool = True
    verify: bool = False
    verify_first_n: int = 3
    verify_every: int = 0
    warmup: str = "auto"
    variants: Optional[List[str]] = None
    padded_eager: bool = False
    eager_through: bool = False
    full_prefill_max_req: Optional[int] = None
    check_weights_every: int = 0
    forward_asleep: str = "eager"
    capture: str = "blocking"
    mixed_tokens: Optional[List[int]] = None
    mixed_requests: Optional[List[int]] = None

    def __post_init__(self) -> None:
        self._check()

    def _check(self) -> None:
        if self.backend is not None and not (isinstance(self.backend, str) and _BACKEND_NAME.fullmatch(self.backend)):
            raise CudaGraphConfigError(
                "must be null or a backend name",
                key="backend",
                value=self.backend,
                accepted="null (auto) or " + _BACKEND_NAME_ACCEPTED,
            )
        if self.max_bs is not None:
            self.max_bs = _positive_int(self.max_bs, "max_bs")
        if self.bs is not None:
            self.bs = _sizes(self.bs, "bs")
        # With bs set, max_bs is not a bound: sglang makes max_bs max(bs) (the runner
        # captures exactly bs, :func:`cuda_graph_runner.runner.sizes.get_batch_sizes_to_capture`).
        if not isinstance(self.tc_compiler, str) or self.tc_compiler not in TC_COMPILERS:
            raise CudaGraphConfigError(
                "unknown compiler", key="tc_compiler", value=self.tc_compiler, accepted=", ".join(TC_COMPILERS)
            )
        if self.torch_compile is True:
            self.torch_compile = TORCH_COMPILERS[0]
        if self.torch_compile is not False and self.torch_compile not in TORCH_COMPILERS:
            raise CudaGraphConfigError(
                "unknown torch.compile setting",
                key="torch_compile",
                value=self.torch_compile,
                accepted="false, true or a compiler name: " + ", ".join(TORCH_COMPILERS),
            )
        if self.torch_compile_max_bs is not None:
            self.torch_compile_max_bs = _positive_int(self.torch_compile_max_bs, "torch_compile_max_bs")
        if self.compile_sizes is not None:
            self.compile_sizes = _sizes(self.compile_sizes, "compile_sizes")
            limit = self.compiled_max_bs()
            above = [s for s in self.compile_sizes if self.torch_compile and s > limit]
            if above:
                raise CudaGraphConfigError(
                    f"element(s) {above} above torch_compile_max_bs {limit}, so captured uncompiled",
                    key="compile_sizes",
                    value=self.compile_sizes,
                    accepted=f"sizes <= torch_compile_max_bs ({limit}), or raise torch_compile_max_bs",
                )
            if self.bs is not None:
                outside = [s for s in self.compile_sizes if s not in self.bs]
            elif self.max_bs is not None:
                outside = [s for s in self.compile_sizes if s > self.max_bs]
            else:
                outside = []
            if outside:
                raise CudaGraphConfigError(
                    f"element(s) {outside} not captured, so never replayed",
                    key="compile_sizes",
                    value=self.compile_sizes,
                    accepted=f"sizes among bs {self.bs}" if self.bs is not None else f"sizes <= max_bs {self.max_bs}",
                )
        if not isinstance(self.owned_outputs, bool):
            raise CudaGraphConfigError(
                "must be a boolean", key="owned_outputs", value=self.owned_outputs, accepted="true or false"
            )
        for key in ("host_value_guard", "verify", "padded_eager", "eager_through"):
            if not isinstance(getattr(self, key), bool):
                raise CudaGraphConfigError(
                    "must be a boolean", key=key, value=getattr(self, key), accepted="true or false"
                )
        for key in ("verify_first_n", "verify_every", "check_weights_every"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
                raise CudaGraphConfigError(
                    "must be an integer >= 0", key=key, value=value, accepted="an integer >= 0 (not a bool)"
                )
            setattr(self, key, int(value))
        if not isinstance(self.warmup, str) or self.warmup not in WARMUP_POLICIES:
            raise CudaGraphConfigError(
                "unknown warm-up policy", key="warmup", value=self.warmup, accepted=", ".join(WARMUP_POLICIES)
            )
        if self.variants is not None:
            self.variants = _variant_labels(self.variants)
        if self.full_prefill_max_req is not None:
            self.full_prefill_max_req = _positive_int(self.full_prefill_max_req, "full_prefill_max_req")
        for key in ("mixed_tokens", "mixed_requests"):
            if getattr(self, key) is not None:
                setattr(self, key, _sizes(getattr(self, key), key))
        tokens, requests = self.mixed_sizes()
        if requests[0] > tokens[-1]:
            raise CudaGraphConfigError(
                f"has no size at or below the largest mixed token count {tokens[-1]} (a key of more requests "
                "than tokens is never used: every request has at least one token)",
                key="mixed_requests",
                value=self.mixed_requests,
                accepted=f"request counts <= {tokens[-1]}, or larger mixed_tokens",
            )
        if not isinstance(self.forward_asleep, str) or self.forward_asleep not in FORWARD_ASLEEP:
            raise CudaGraphConfigError(
                "unknown asleep policy",
                key="forward_asleep",
                value=self.forward_asleep,
                accepted=", ".join(FORWARD_ASLEEP),
            )
        if not isinstance(self.capture, str) or self.capture not in CAPTURE_POLICIES:
            raise CudaGraphConfigError(
                "unknown capture policy", key="capture", value=self.capture, accepted=", ".join(CAPTURE_POLICIES)
            )
        if self.verify and self.verify_first_n == 0 and self.verify_every == 0:
            raise CudaGraphConfigError(
                "verify is on but verify_first_n and verify_every are both 0, so no replay would be checked",
                key="verify_first_n",
                value=0,
                accepted="verify_first_n >= 1 or verify_every >= 1",
            )

    def compiled_max_bs(self) -> int:
        """The largest size captured from the compiled forward when ``torch_compile`` is
        on: ``torch_compile_max_bs``, else :data:`TORCH_COMPILE_MAX_BS` (sglang's default)."""
        return self.torch_compile_max_bs if self.torch_compile_max_bs is not None else TORCH_COMPILE_MAX_BS

    def mixed_sizes(self) -> Tuple[List[int], List[int]]:
        """``(token counts, request counts)`` of the mixed runner's keys, ascending:
        ``mixed_tokens`` / ``mixed_requests``, else :data:`DEFAULT_MIXED_TOKENS` /
        :data:`DEFAULT_MIXED_REQUESTS`. Keys are the pairs with requests <= tokens."""
        tokens = list(self.mixed_tokens) if self.mixed_tokens is not None else list(DEFAULT_MIXED_TOKENS)
        requests = list(self.mixed_requests) if self.mixed_requests is not None else list(DEFAULT_MIXED_REQUESTS)
        return tokens, requests

    def request_slots(self, max_tokens: int) -> int:
        """Request slots of a prefill ``full`` graph whose largest token count is
        ``max_tokens``: ``full_prefill_max_req``, else ``max(1, max_tokens //``
        :data:`TOKENS_PER_REQUEST_SLOT` ``)`` (sglang's default from the chunked prefill size)."""
        if self.full_prefill_max_req is not None:
            return self.full_prefill_max_req
        return max(1, max_tokens // TOKENS_PER_REQUEST_SLOT)

    def to_dict(self) -> Dict[str, Any]:
        """The keys whose values differ from the defaults (``bs`` copied)."""
        default = PhaseConfig()
        diff = {}
        for key in PHASE_KEYS:
            value = getattr(self, key)
            if value != getattr(default, key):
                diff[key] = list(value) if isinstance(value, list) else value
        return diff


def _variant_labels(value: Any) -> List[str]:
    """``variants`` as a new list, duplicates dropped, order kept. Raises CudaGraphConfigError."""
    if not isinstance(value, (list, tuple)) or not value:
        raise CudaGraphConfigError(
            "must be null or a non-empty list of variant labels",
            key="variants",
            value=value,
            accepted=_VARIANTS_ACCEPTED,
        )
    labels: List[str] = []
    for label in value:
        if not isinstance(label, str) or not _VARIANT_LABEL.fullmatch(label):
            raise CudaGraphConfigError(
                f"element {_short_repr(label)} is not a variant label",
                key="variants",
                value=value,
                accepted=_VARIANTS_ACCEPTED,
            )
        if label not in labels:
            labels.append(label)
    return labels


#: Sources where a decode ``tc_compiler`` keeps sglang's meaning (tc_piecewise's compiler
#: only, so backend ``full`` ignores it): sglang's own flags and ``--cuda-graph-config``.
SGLANG_TC_COMPILER_SOURCES = (
    "flag:--cuda-graph-tc-compiler",
    "legacy:--piecewise-cuda-graph-compiler",
    SOURCE_JSON_FLAG,
)


def migrate_tc_compiler(values: Dict[str, Dict[str, Any]], sources: Dict[Tuple[str, str], str]) -> None:
    """The deprecated spelling of compiled full, rewritten in place: a decode ``tc_compiler``
    other than ``eager`` with backend ``full`` (or auto) from a source that is not one of
    sglang's (the API, a JSON file, ``--cuda-graph-tc-compiler-decode``) becomes
    ``torch_compile`` with that compiler, every captured size compiled, with a
    ``DeprecationWarning`` naming the new spelling. sglang's sources
    (:data:`SGLANG_TC_COMPILER_SOURCES`) keep sglang's meaning: full ignores the key.

    Args:
        values: ``{phase: {key: value}}`` before the phases are built.
        sources: the ``(phase, key) -> source`` of ``values``; updated too.
    """
    decode = values.get(Phase.DECODE)
    if not decode:
        return
    compiler = decode.get("tc_compiler")
    source = sources.get((Phase.DECODE, "tc_compiler"))
    if (
        compiler == "eager"
        or compiler not in TC_COMPILERS  # an unknown compiler is tc_compiler's own error
        or decode.get("backend") not in (None, Backend.FULL)
        or "torch_compile" in decode
        or source in SGLANG_TC_COMPILER_SOURCES
    ):
        return
    warnings.warn(
        f"decode tc_compiler {compiler!r} on backend full is deprecated (tc_compiler is tc_piecewise's "
        f"compiler, as in sglang); use torch_compile: {compiler!r} (--enable-torch-compile "
        "--torch-compile-max-bs N)",
        DeprecationWarning,
        stacklevel=4,
    )
    decode["torch_compile"] = decode.pop("tc_compiler")
    decode.setdefault("torch_compile_max_bs", MAX_CAPTURE_SIZE)  # it compiled every captured size
    sources.pop((Phase.DECODE, "tc_compiler"), None)
    sources[(Phase.DECODE, "torch_compile")] = source or SOURCE_API
    sources.setdefault((Phase.DECODE, "torch_compile_max_bs"), source or SOURCE_API)


def _build_phase(phase: str, values: Mapping[str, Any], sources: Mapping[Tuple[str, str], str]) -> PhaseConfig:
    """``PhaseConfig(**values)``, with errors naming the phase and the source of the key."""
    try:
        built = PhaseConfig(**values)
        _check_phase_only(phase, built)
        return built
    except CudaGraphConfigError as err:
        raise err.with_context(phase=phase, source=sources.get((phase, err.key or ""))) from None


def _check_phase_only(phase: str, phase_config: PhaseConfig) -> None:
    """Raise CudaGraphConfigError for a key of the other phase only (:data:`PHASE_ONLY_KEYS`) set here."""
    for key, owner in PHASE_ONLY_KEYS.items():
        value = getattr(phase_config, key)
        if owner != phase and value is not None:
            raise CudaGraphConfigError(
                f"is read by the {owner} phase only",
                key=key,
                value=value,
                accepted=f"null here; set it under {owner}",
            )


def _check_default_max(phase: str, phase_config: PhaseConfig) -> None:
    # With neither bs nor max_bs a runner captures up to DEFAULT_MAX_BS[phase]; a compile
    # size above it would never be captured. Only validate() checks it: the bench sets
    # max_bs itself (to the largest size it measures), so parsing must not refuse it.
    if phase_config.compile_sizes is None or phase_config.bs is not None or phase_config.max_bs is not None:
        return
    limit = DEFAULT_MAX_BS[phase]
    outside = [s for s in phase_config.compile_sizes if s > limit]
    if outside:
        raise CudaGraphConfigError(
            f"element(s) {outside} not captured, so never replayed (max_bs unset: the runner's default {limit})",
            key="compile_sizes",
            value=phase_config.compile_sizes,
            accepted=f"sizes <= {limit}, or set max_bs (or bs) to capture larger ones",
        )


@dataclass
class CudaGraphConfig:
    """CUDA-graph settings of both phases, plus where each explicit value came from.

    ``sources`` maps each explicitly set ``(phase, key)`` to its source; it is
    not part of equality or repr, nor is ``superseded``.

    Raises:
        CudaGraphConfigError: ``decode`` or ``prefill`` is not a PhaseConfig.
    """

    decode: PhaseConfig = field(default_factory=PhaseConfig)
    prefill: PhaseConfig = field(default_factory=PhaseConfig)
    sources: Dict[Tuple[str, str], str] = field(default_factory=dict, compare=False, repr=False)
    #: ``(phase, backend name, source)`` of backend names a later flag replaced; checked by
    #: :meth:`validate` like the config's own (sglang checks every value a flag is given).
    superseded: Tuple[Tuple[str, str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        for phase in Phase.ALL:
            if not isinstance(getattr(self, phase), PhaseConfig):
                raise CudaGraphConfigError(
                    "must be a PhaseConfig", phase=phase, value=getattr(self, phase), accepted="a PhaseConfig"
                )

    def __getitem__(self, phase: str) -> PhaseConfig:
        """The phase's settings. Raises CudaGraphConfigError for an unknown phase."""
        if not isinstance(phase, str) or phase not in Phase.ALL:
            raise CudaGraphConfigError("unknown phase", value=phase, accepted=", ".join(Phase.ALL))
        return getattr(self, phase)

    def source_of(self, phase: str, key: str) -> str:
        """Where ``(phase, key)`` got its value: a recorded source, else ``"default"``."""
        return self.sources.get((phase, key), SOURCE_DEFAULT)

    def fully_disabled(self) -> bool:
        """True when both phases say ``disabled`` (auto, None, is not disabled)."""
        return all(self[phase].backend == Backend.DISABLED for phase in Phase.ALL)

    # -- dict / JSON ---------------------------------------------------------------

    @classmethod
    def from_dict(cls, d: Any, *, source: str = SOURCE_API) -> "CudaGraphConfig":
        """Defaults overridden by ``d`` = ``{phase: {key: value}}``; missing phases/keys keep defaults.

        Each key present is recorded in ``sources`` as ``source``.

        Raises:
            CudaGraphConfigError: ``d`` or a phase entry is not a mapping; unknown
            phase or key; any invalid value (see :class:`PhaseConfig`).
        """
        if not isinstance(d, Mapping):
            raise CudaGraphConfigError(
                "must be an object mapping phase to settings",
                value=d,
                accepted='an object like {"decode": {"backend": "full"}, "prefill": {...}}',
                source=source,
            )
        values: Dict[str, Dict[str, Any]] = {}
        sources: Dict[Tuple[str, str], str] = {}
        for phase, settings in d.items():
            if not isinstance(phase, str) or phase not in Phase.ALL:
                raise CudaGraphConfigError("unknown phase", value=phase, accepted=", ".join(Phase.ALL), source=source)
            if not isinstance(settings, Mapping):
                raise CudaGraphConfigError(
                    "must be an object of settings",
                    phase=phase,
                    value=settings,
                    accepted="an object with keys " + ", ".join(PHASE_KEYS),
                    source=source,
                )
            for key, value in settings.items():
                if not isinstance(key, str) or key not in PHASE_KEYS:
                    raise CudaGraphConfigError(
                        "unknown key",
                        phase=phase,
                        key=key if isinstance(key, str) else _short_repr(key),
                        value=value,
                        accepted="keys " + ", ".join(PHASE_KEYS),
                        source=source,
                    )
                sources[(phase, key)] = source
            values[phase] = dict(settings)
        if source not in SGLANG_TC_COMPILER_SOURCES:
            migrate_tc_compiler(values, sources)
        phases: Dict[str, Any] = {phase: _build_phase(phase, settings, sources) for phase, settings in values.items()}
        return cls(**phases, sources=sources)

    def to_dict(self) -> Dict[str, Dict[str, Any]]:
        """Only what differs from the defaults, so ``from_dict(c.to_dict()) == c``."""
        return {phase: diff for phase in Phase.ALL if (diff := self[phase].to_dict())}

    @classmethod
    def from_json(cls, text_or_path: Any, *, source: str = SOURCE_JSON) -> "CudaGraphConfig":
        """Parse a JSON object given as text or as the path of a file (see :meth:`from_dict`).

        Text whose first non-blank character is ``{`` or ``[`` is JSON; otherwise an
        existing file of that name is read; otherwise the text is parsed as JSON.

        Raises:
            CudaGraphConfigError: unreadable file, invalid JSON, duplicate object
            keys, anything :meth:`from_dict` rejects.
        """
        return cls.from_dict(_load_json(text_or_path, source), source=source)

    # -- argparse --------------------------------------------------------------------

    @classmethod
    def from_args(cls, namespace: Any) -> "CudaGraphConfig":
        """Build the config from a namespace parsed with :func:`add_cuda_graph_args`.

        Precedence, lowest to highest: defaults < legacy flags < per-phase flags <
        ``--cuda-graph-config``; see the package docstring. Attributes missing from
        ``namespace`` count as not given.

        Raises:
            CudaGraphConfigError: conflicting flags within a tier, invalid JSON, or
            an invalid combined value (e.g. max_bs from a flag below bs from JSON);
            the message names the source.
        """
        from .flags import _from_args  # flags builds on this module

        return _from_args(cls, namespace)

    # -- derivation and validation ---------------------------------------------------

    def with_phase(self, phase: str, *, source: str = SOURCE_API, **fields: Any) -> "CudaGraphConfig":
        """A copy with ``fields`` of ``phase`` replaced, recorded as from ``source``
        (default ``"api"``; a command line that sets a key its own way names its flag,
        ``"flag:--decode-backends"``, so an error points at what the user wrote).

        Raises:
            CudaGraphConfigError: unknown phase or key; invalid value.
        """
        current = self[phase]
        for key, value in fields.items():
            if key not in PHASE_KEYS:
                raise CudaGraphConfigError(
                    "unknown key", phase=phase, key=key, value=value, accepted="keys " + ", ".join(PHASE_KEYS)
                )
        sources = dict(self.sources)
        sources.update({(phase, key): source for key in fields})
        if "tc_compiler" in fields and "torch_compile" not in fields:
            given = {phase: {"backend": fields.get("backend", current.backend), **fields}}
            migrate_tc_compiler(given, sources)
            fields = {key: value for key, value in given[phase].items() if key in fields or key.startswith("torch_")}
        merged = {key: getattr(current, key) for key in PHASE_KEYS}
        merged.update(fields)
        phases = {p: dataclasses.replace(self[p]) for p in Phase.ALL}  # copies: no shared bs lists
        phases[phase] = _build_phase(phase, merged, sources)
        return type(self)(**phases, sources=sources, superseded=self.superseded)

    def validate(
        self,
        backend_phases: Optional[Mapping[str, Collection[str]]] = None,
        unusable: Optional[Mapping[str, str]] = None,
    ) -> None:
        """Check every field again and, given the installed backends, every backend name.

        Args:
            backend_phases: ``{backend name: phases it supports}`` of the installed
                backends (``registry.backend_phases()``); None skips the name checks.
                ``disabled`` is always accepted (built into the core); None (auto)
                is left to the registry.
            unusable: ``{backend name: why}`` of backends that are installed but failed or
                registered twice (``registry.backend_problems()``): such a name is
                reported with that cause, not as "not installed".

        Raises:
            CudaGraphConfigError: an invalid field (e.g. assigned after construction); a
            compile size above the runner's default max (``DEFAULT_MAX_BS``) when neither
            ``bs`` nor ``max_bs`` is set;
            a backend that is not installed (the message lists the installed ones and
            the distribution providing a well-known name); a backend that does not
            support the phase.
        """
        for phase in Phase.ALL:
            try:
                self[phase]._check()
                _check_phase_only(phase, self[phase])
                _check_default_max(phase, self[phase])
            except CudaGraphConfigError as err:
                raise err.with_context(phase=phase, source=self.sources.get((phase, err.key or ""))) from None
        if backend_phases is None:
            return
        named = [(phase, self[phase].backend, self.sources.get((phase, "backend")), "") for phase in Phase.ALL]
        named += [(phase, name, source, " (a later flag replaced it)") for phase, name, source in self.superseded]
        for phase, name, source, note in named:
            if name is None or name == Backend.DISABLED:
                continue
            problem = _backend_problem(name, phase, backend_phases, unusable)
            if problem is not None:
                raise CudaGraphConfigError(
                    problem + note,
                    phase=phase,
                    key="backend",
                    value=name,
                    accepted=_names_for(phase, backend_phases),
                    source=source,
                )


def _backend_problem(
    name: str,
    phase: str,
    backend_phases: Mapping[str, Collection[str]],
    unusable: Optional[Mapping[str, str]],
) -> Optional[str]:
    """What is wrong with backend ``name`` for ``phase`` (the error's problem text), or None."""
    if name not in backend_phases:
        if unusable and name in unusable:
            return f"is {unusable[name]}"
        return "is not an installed backend" + _install_hint(name, backend_phases)
    supported = backend_phases[name]
    if phase not in supported:
        return (
            f"backend {name!r} does not support phase {phase!r} (it supports: {', '.join(sorted(supported)) or 'none'})"
        )
    return None


def _names_for(phase: str, backend_phases: Mapping[str, Collection[str]]) -> str:
    """The backends usable for ``phase``, as accepted-values text."""
    names = {name for name, phases in backend_phases.items() if phase in phases} | {Backend.DISABLED}
    return "null (auto) or one of the installed backends for this phase: " + ", ".join(sorted(names))


def _install_hint(name: str, backend_phases: Mapping[str, Collection[str]]) -> str:
    installed = ", ".join(sorted(backend_phases)) or "none"
    hint = f" (installed: {installed})"
    if name in WELL_KNOWN_DISTRIBUTIONS:
        hint += f"; install it with: pip install {WELL_KNOWN_DISTRIBUTIONS[name]}"
    else:
        missing = [
            f"{n} ({d})"
            for n, d in WELL_KNOWN_DISTRIBUTIONS.items()
            if n not in backend_phases and n != Backend.DISABLED  # disabled is built in
        ]
        if missing:
            hint += "; well-known backends not installed: " + ", ".join(missing)
    return hint

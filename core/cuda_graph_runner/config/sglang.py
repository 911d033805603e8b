"""Reading a config saved by sglang: the output of sglang's ``CudaGraphConfig.to_dict``.

sglang's ``to_dict`` writes only what differs from *its* defaults (decode ``full``,
prefill ``tc_piecewise`` in sglang 0.5.14, ``breakable`` on CUDA in later releases), so
a key it leaves out means sglang's default, not this library's: an explicit prefill
``tc_piecewise`` is saved as ``{}``. :func:`from_sglang_dict` fills sglang's defaults
back in and keeps sglang's meaning of each key:

* ``backend``: as saved, else sglang's default for the phase (decode ``full``, prefill
  ``prefill_default``);
* ``max_bs``, ``bs``: as saved;
* ``tc_compiler``: tc_piecewise's compiler; kept for a phase whose backend is
  ``tc_piecewise``, dropped for any other (sglang ignores it there);
* ``full_prefill_max_req``: the request slots of prefill ``full``; kept with prefill
  backend ``full``, dropped otherwise (sglang ignores it there);
* sglang's other prefill-``full`` keys (``full_prefill_prefix_chunk_tokens``) and its
  prefill context keys (``max_context_size``, ``max_seq_len``): ignored by sglang unless
  the prefill backend is ``full``; set with backend ``full`` they are an error (nothing
  here would honour them).

Sources: each saved key is recorded as ``"sglang"``, each filled-in default as
``"sglang:default"``. Standard library only. Source of sglang's format:
``python/sglang/srt/model_executor/cuda_graph_config.py`` (``PhaseConfig``,
``CudaGraphConfig.to_dict`` and ``from_dict``) in sgl-project/sglang.
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Tuple

from .exceptions import CudaGraphConfigError
from .loading import _load_json
from .model import Backend, CudaGraphConfig, Phase, _build_phase

SOURCE_SGLANG = "sglang"
SOURCE_SGLANG_DEFAULT = "sglang:default"

#: sglang 0.5.14's default backend per phase (``CudaGraphConfig``'s field defaults).
SGLANG_DEFAULT_BACKENDS: Dict[str, str] = {Phase.DECODE: Backend.FULL, Phase.PREFILL: Backend.TC_PIECEWISE}

_KEPT = ("backend", "max_bs", "bs", "tc_compiler")
#: sglang keys read only by its prefill ``full`` backend.
_FULL_PREFILL_KEYS = ("full_prefill_max_req", "full_prefill_prefix_chunk_tokens", "max_context_size", "max_seq_len")


def from_sglang_dict(saved: Any, *, prefill_default: str = Backend.TC_PIECEWISE) -> CudaGraphConfig:
    """The config sglang saved, with sglang's defaults for what it left out.

    Args:
        saved: sglang's ``cuda_graph_config.to_dict()`` (``{"decode": {...}, "prefill":
            {...}}``), or JSON text or the path of a JSON file holding it.
        prefill_default: sglang's prefill default on the machine that saved it:
            ``tc_piecewise`` (sglang 0.5.14, and later releases off CUDA) or
            ``breakable`` (later releases on CUDA).

    Raises:
        CudaGraphConfigError: not a mapping of phases to mappings; an unknown phase or a
            key sglang does not write; a prefill-``full`` key with prefill backend
            ``full``; any value this library refuses (see :class:`PhaseConfig`).
    """
    if isinstance(saved, (str, bytes)) or hasattr(saved, "__fspath__"):
        saved = _load_json(saved, SOURCE_SGLANG)
    if not isinstance(saved, Mapping):
        raise CudaGraphConfigError(
            "must be an object mapping phase to settings (sglang's CudaGraphConfig.to_dict())",
            value=saved,
            accepted='an object like {"decode": {}, "prefill": {"backend": "breakable"}}',
            source=SOURCE_SGLANG,
        )
    values: Dict[str, Dict[str, Any]] = {phase: {} for phase in Phase.ALL}
    sources: Dict[Tuple[str, str], str] = {}
    for phase, settings in saved.items():
        if phase not in Phase.ALL:
            raise CudaGraphConfigError(
                "unknown phase", value=phase, accepted=", ".join(Phase.ALL), source=SOURCE_SGLANG
            )
        if not isinstance(settings, Mapping):
            raise CudaGraphConfigError(
                "must be an object of settings", phase=phase, value=settings, accepted="an object", source=SOURCE_SGLANG
            )
        for key, value in settings.items():
            if key not in _KEPT and key not in _FULL_PREFILL_KEYS:
                raise CudaGraphConfigError(
                    "is not a key sglang's cuda_graph_config writes",
                    phase=phase,
                    key=str(key),
                    value=value,
                    accepted="keys " + ", ".join((*_KEPT, *_FULL_PREFILL_KEYS)),
                    source=SOURCE_SGLANG,
                )
    defaults = {**SGLANG_DEFAULT_BACKENDS, Phase.PREFILL: prefill_default}
    for phase in Phase.ALL:
        settings = dict(saved.get(phase) or {})
        backend = settings.get("backend", defaults[phase])
        values[phase]["backend"] = backend
        sources[(phase, "backend")] = SOURCE_SGLANG if "backend" in settings else SOURCE_SGLANG_DEFAULT
        for key in ("max_bs", "bs"):
            if settings.get(key) is not None:
                values[phase][key] = settings[key]
                sources[(phase, key)] = SOURCE_SGLANG
        if backend == Backend.TC_PIECEWISE and "tc_compiler" in settings:
            values[phase]["tc_compiler"] = settings["tc_compiler"]
            sources[(phase, "tc_compiler")] = SOURCE_SGLANG
        slots = settings.get("full_prefill_max_req")
        if slots is not None and backend == Backend.FULL and phase == Phase.PREFILL:
            values[phase]["full_prefill_max_req"] = slots
            sources[(phase, "full_prefill_max_req")] = SOURCE_SGLANG
        for key in _FULL_PREFILL_KEYS:
            if key == "full_prefill_max_req":
                continue
            # Keys of sglang's prefill full graphs: refused only where prefill would be full
            # (decode full reads none of them, in sglang too).
            if settings.get(key) is not None and backend == Backend.FULL and phase == Phase.PREFILL:
                raise CudaGraphConfigError(
                    "is read by sglang's prefill backend full, which does not honour it here",
                    phase=phase,
                    key=key,
                    value=settings[key],
                    accepted=f"drop {key} (prefill full here captures every token bucket with full_prefill_max_req slots)",
                    source=SOURCE_SGLANG,
                )
    phases: Dict[str, Any] = {phase: _build_phase(phase, values[phase], sources) for phase in Phase.ALL}
    return CudaGraphConfig(**phases, sources=sources)

"""Every ``CUDA_GRAPH_RUNNER_*`` environment variable, in one table, with one parser.

Modelled on vLLM's ``vllm/envs.py``: one table lists each variable, what it means, its
default and how its text is parsed, and every reader (the core, the plugins, the test
suite) goes through :func:`get`. Nothing parses ``os.environ`` on its own, so a flag
means the same thing wherever it is read (breakable once read ``...=false`` as *on*).

Parsing rules:

* booleans accept ``1/0``, ``true/false``, ``yes/no``, ``on/off`` in any case, with
  surrounding spaces ignored; an empty or unset variable means the default; any other
  text raises :class:`EnvVarError` naming the variable, the value and what is accepted;
* lists are comma-separated, items stripped, empty items dropped;
* the value is read when :func:`get` is called (no caching), so tests and users can
  change a variable and the next reader sees it; each reader documents when it reads.

Who lists a variable, and how it is read (one way for everyone):

* the core's variables (and its test suite's) are rows of the table at the end of this
  module; each plugin declares its own with :func:`define` at import of its registration
  module (the module its entry point names, which imports no torch), with its
  distribution as ``owner``. All of them are rows of one table, :data:`VARIABLES`;
  ``cuda_graph_runner.registry.environment_variables()`` and ``check_environment()`` load
  the installed plugins' registration modules first (the registry's scan), so they list
  and check every variable without importing a backend;
* every reader goes through :func:`get` with the name its declaration returned
  (``envs.get(envs.STRICT_PLUGINS)`` in the core, ``envs.get(WEAK_REF_ARGS)`` in
  breakable); nothing but this module reads ``os.environ`` (tests/test_envs.py checks it).

This module imports only the standard library (``config`` and the registry import it
before torch).
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional

from ..config.exceptions import CudaGraphRunnerError
from ..config.integers import parse_digits

PREFIX = "CUDA_GRAPH_RUNNER_"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")
ACCEPTED_BOOLEANS = "1/0, true/false, yes/no, on/off (any case)"


class EnvVarError(CudaGraphRunnerError, ValueError):
    """An environment variable whose text its parser rejects; names variable, value and
    the accepted values. A ``ValueError``, so callers that report bad user input catch it."""


@dataclasses.dataclass(frozen=True)
class EnvVar:
    """One row of the table.

    Attributes:
        name: the full variable name (``CUDA_GRAPH_RUNNER_...``).
        kind: ``"bool"``, ``"str"``, ``"list"`` (comma-separated), ``"optional_list"``
            (unset means None, i.e. "not restricted"; empty means ``[]``), or
            ``"optional_bool"`` / ``"optional_count"`` (an integer >= 0, digits 0-9 only:
            :mod:`cuda_graph_runner.config.integers`): unset or empty means None, i.e. "keep the
            config's value"; or ``"seconds"``: a float >= 0, unset or empty means the default.
        default: the value when the variable is unset (or empty, for ``bool``/``str``).
        help: what it does, one or two sentences (shown by :func:`describe`).
        owner: who reads it: ``"core"``, a distribution name, or ``"tests"``.
    """

    name: str
    kind: str
    default: Any
    help: str
    owner: str = "core"

    def parse(self, text: Optional[str]) -> Any:
        """Parse ``text`` (None: unset) into this variable's value.

        Raises:
            EnvVarError: ``text`` is not a value of this kind.
        """
        return _PARSERS[self.kind](self, text)


def _parse_bool(var: EnvVar, text: Optional[str]) -> bool:
    if text is None or not text.strip():
        return bool(var.default)
    word = text.strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise EnvVarError(
        f"{var.name}={text!r} is not a boolean; accepted: {ACCEPTED_BOOLEANS}, "
        f"or unset/empty for the default ({'on' if var.default else 'off'})"
    )


def _parse_str(var: EnvVar, text: Optional[str]) -> str:
    return var.default if text is None or not text.strip() else text.strip()


def _parse_list(var: EnvVar, text: Optional[str]) -> List[str]:
    if text is None:
        return list(var.default or [])
    return [item.strip() for item in text.split(",") if item.strip()]


def _parse_optional_list(var: EnvVar, text: Optional[str]) -> Optional[List[str]]:
    if text is None:
        return None
    return [item.strip() for item in text.split(",") if item.strip()]


def _parse_optional_bool(var: EnvVar, text: Optional[str]) -> Optional[bool]:
    # Unset or empty: None, so the reader keeps its config's value.
    return None if text is None or not text.strip() else _parse_bool(var, text)


def _parse_optional_count(var: EnvVar, text: Optional[str]) -> Optional[int]:
    if text is None or not text.strip():
        return None
    value = parse_digits(text.strip())
    if value is None:
        raise EnvVarError(
            f"{var.name}={text!r} is not accepted; accepted: an integer >= 0 in digits 0-9, "
            "or unset/empty for the config's value"
        )
    return value


_SECONDS = re.compile(r"[0-9]+(\.[0-9]*)?|\.[0-9]+")


def _parse_seconds(var: EnvVar, text: Optional[str]) -> float:
    if text is None or not text.strip():
        return float(var.default)
    # ASCII digits and one decimal point only: float() also reads other scripts' digits,
    # underscores, exponents, "inf" and "nan".
    value = float(text.strip()) if _SECONDS.fullmatch(text.strip()) else -1.0
    if not 0 <= value < float("inf"):
        raise EnvVarError(
            f"{var.name}={text!r} is not accepted; accepted: seconds, a number >= 0 (0: no limit), "
            f"or unset/empty for the default ({float(var.default):g})"
        )
    return value


_PARSERS: Dict[str, Callable[[EnvVar, Optional[str]], Any]] = {
    "bool": _parse_bool,
    "optional_bool": _parse_optional_bool,
    "optional_count": _parse_optional_count,
    "seconds": _parse_seconds,
    "str": _parse_str,
    "list": _parse_list,
    "optional_list": _parse_optional_list,
}

#: The table: the core's variables, and each loaded plugin's, which it adds with :func:`define`.
VARIABLES: Dict[str, EnvVar] = {}


def define(name: str, kind: str, default: Any, help: str, *, owner: str = "core") -> EnvVar:
    """Add a variable to the table (idempotent for an identical row).

    Raises:
        ValueError: the name lacks the ``CUDA_GRAPH_RUNNER_`` prefix, the kind is not one of
            :data:`_PARSERS`, or another row of that name differs.
    """
    if not name.startswith(PREFIX):
        raise ValueError(f"environment variable {name!r} must start with {PREFIX!r}")
    if kind not in _PARSERS:
        raise ValueError(f"environment variable {name}: kind {kind!r} is not one of {sorted(_PARSERS)}")
    var = EnvVar(name, kind, default, help, owner)
    existing = VARIABLES.get(name)
    if existing is not None and existing != var:
        raise ValueError(f"environment variable {name} is already defined differently: {existing}")
    VARIABLES[name] = var
    return var


def get(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """The parsed value of variable ``name`` now (from ``environ``, default ``os.environ``).

    Raises:
        KeyError: ``name`` is not in the table (a typo in the reader, not the user's fault).
        EnvVarError: the user's value does not parse; the message names variable, value
            and what is accepted.
    """
    try:
        var = VARIABLES[name]
    except KeyError:
        raise KeyError(f"{name} is not a known {PREFIX}* variable; known: {sorted(VARIABLES)}") from None
    env = os.environ if environ is None else environ
    return var.parse(env.get(name))


def check_all(environ: Optional[Mapping[str, str]] = None) -> None:
    """Parse every variable in the table that is set, so a bad value is reported up front
    rather than only when, or if, its reader runs (the CLI calls
    :func:`cuda_graph_runner.registry.check_environment`, which loads the plugins' rows first).

    Raises:
        EnvVarError: the first variable whose value does not parse (named, with what is accepted).
    """
    env = os.environ if environ is None else environ
    for name, var in list(VARIABLES.items()):
        if name in env:
            var.parse(env[name])


def raw(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The unparsed text of ``name`` (None: unset), for messages that quote it.

    Raises:
        KeyError: ``name`` is not in the table.
    """
    if name not in VARIABLES:
        raise KeyError(f"{name} is not a known {PREFIX}* variable; known: {sorted(VARIABLES)}")
    return (os.environ if environ is None else environ).get(name)


def external(name: str, environ: Optional[Mapping[str, str]] = None) -> Optional[str]:
    """The text of another program's variable (``CXX``, ``XDG_CACHE_HOME``), None when unset
    or empty; for readers outside this module, which never touch ``os.environ`` themselves."""
    env = os.environ if environ is None else environ
    return env.get(name) or None


def set_external(name: str, value: str) -> None:
    """Set another program's variable for this process and the processes it starts (the
    per-rank ``TORCHINDUCTOR_CACHE_DIR`` of :func:`cuda_graph_runner.runner.distributed.per_rank_compile_cache`)."""
    os.environ[name] = value


def launched_by_torch_distributed(environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when torchrun (or another ``env://`` launcher) set ``RANK`` or ``WORLD_SIZE``:
    torch's variables, not ours, read here so that this module stays the one reader."""
    env = os.environ if environ is None else environ
    return "RANK" in env or "WORLD_SIZE" in env


def describe() -> List[Dict[str, str]]:
    """The table as rows ``{name, kind, default, owner, help}``, sorted by name (for docs/CLI):
    the core's variables and those of the plugins loaded so far
    (:func:`cuda_graph_runner.registry.environment_variables` loads them all first)."""
    return [
        {"name": v.name, "kind": v.kind, "default": repr(v.default), "owner": v.owner, "help": v.help}
        for v in sorted(VARIABLES.values(), key=lambda v: v.name)
    ]


# -- the table ------------------------------------------------------------------------
# Names are also constants, so readers import them instead of retyping the string.
PLUGINS = define(
    "CUDA_GRAPH_RUNNER_PLUGINS",
    "optional_list",
    None,
    "Comma-separated backend (entry-point) or distribution names to autoload; unset means all, "
    "empty means none. Read when the registry scans.",
).name
DISABLE_PLUGIN_AUTOLOAD = define(
    "CUDA_GRAPH_RUNNER_DISABLE_PLUGIN_AUTOLOAD",
    "bool",
    False,
    "Load no entry point (built-ins and register() still work). Read when the registry scans.",
).name
STRICT_PLUGINS = define(
    "CUDA_GRAPH_RUNNER_STRICT_PLUGINS",
    "bool",
    False,
    "A plugin failure raises instead of being listed as failed. Read when a registry is created.",
).name
PREFER = define(
    "CUDA_GRAPH_RUNNER_PREFER",
    "str",
    "",
    "'name=distribution,...': which distribution's backend to use when several register the same "
    "name. Read when the registry scans; a malformed item is reported in registry.problems.",
).name
PROBE_TIMEOUT_S = define(
    "CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S",
    "seconds",
    60.0,
    "Seconds a backend's availability probe may take before it is listed unavailable (timed out); "
    "0: no limit. Read when a registry is created without probe_timeout_s.",
).name
BENCH_CPU_COMPILED = define(
    "CUDA_GRAPH_RUNNER_BENCH_CPU_COMPILED",
    "bool",
    True,
    "bench: on the CPU, with no backend named, pick backend 'compiled' where usable (off: eager numbers "
    "only, nothing compiled; the test suite turns it off). Read when the bench resolves its backends.",
).name
CACHE_DIR = define(
    "CUDA_GRAPH_RUNNER_CACHE_DIR",
    "str",
    "",
    "Root folder of this project's caches (empty: ~/.cache/cuda-graph-runner); compile caches go "
    "under <root>/compile. Read when a backend turns its compile cache on.",
).name
COMPILE_CACHE = define(
    "CUDA_GRAPH_RUNNER_COMPILE_CACHE",
    "bool",
    True,
    "Keep torch.compile's caches (inductor FX graphs, AOTAutograd) under the cache root so a second "
    "process compiles from them (compiled, tc_piecewise:inductor). Read when a backend compiles.",
).name
COMPILE_CACHE_DYNAMO = define(
    "CUDA_GRAPH_RUNNER_COMPILE_CACHE_DYNAMO",
    "bool",
    True,
    "With the compile cache on, also keep Dynamo's traced code (torch's caching precompile), keyed by "
    "model, config and compile options, so a second start skips tracing (full+torch_compile; compiled keeps "
    "the inductor caches only; off: Dynamo traces every start). Read when a backend compiles.",
).name


def cache_root(environ: Optional[Mapping[str, str]] = None) -> str:
    """The folder of this project's caches: ``CUDA_GRAPH_RUNNER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/cuda-graph-runner``, else ``~/.cache/cuda-graph-runner`` (not created here)."""
    env = os.environ if environ is None else environ
    configured = get(CACHE_DIR, env)
    if configured:
        return os.path.abspath(os.path.expanduser(configured))
    base = external("XDG_CACHE_HOME", env) or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "cuda-graph-runner")


# The test suite's own switches (one parser for them too).
TEST_INDUCTOR_CPU = define(
    "CUDA_GRAPH_RUNNER_TEST_INDUCTOR_CPU",
    "bool",
    False,
    "tests: also run the inductor compiler on CPU (needs a C++ compiler).",
    owner="tests",
).name
TORCH_NPU_VERSION = define(
    "CUDA_GRAPH_RUNNER_TORCH_NPU_VERSION",
    "str",
    "2.13.0",
    "tests: torch_npu wheel version whose API the npu plugin is checked against.",
    owner="tests",
).name
TORCH_NPU_DOWNLOAD = define(
    "CUDA_GRAPH_RUNNER_TORCH_NPU_DOWNLOAD",
    "bool",
    True,
    "tests: may download the torch_npu wheel when it is not cached.",
    owner="tests",
).name
WHEEL_CACHE = define(
    "CUDA_GRAPH_RUNNER_WHEEL_CACHE",
    "str",
    "",
    "tests: folder of cached wheels (empty: ~/.cache/cuda-graph-runner/wheels).",
    owner="tests",
).name
MODEL_CACHE = define(
    "CUDA_GRAPH_RUNNER_MODEL_CACHE",
    "str",
    "",
    "Folder of the checkpoints bench --model smollm2-135m prepares once "
    "(empty: ~/.cache/cuda-graph-runner/models). Read when a model is prepared.",
).name
VERIFY = define(
    "CUDA_GRAPH_RUNNER_VERIFY",
    "optional_bool",
    None,
    "Verify mode for both phases, overriding the config key 'verify' (cuda_graph_runner.runner.verify). "
    "Read when a runner is built.",
).name
VERIFY_FIRST_N = define(
    "CUDA_GRAPH_RUNNER_VERIFY_FIRST_N",
    "optional_count",
    None,
    "Verify mode: how many first replays of each shape are checked, overriding 'verify_first_n'. "
    "Read when a runner is built.",
).name
VERIFY_EVERY = define(
    "CUDA_GRAPH_RUNNER_VERIFY_EVERY",
    "optional_count",
    None,
    "Verify mode: also check every k-th replay of each shape (0: none), overriding 'verify_every'. "
    "Read when a runner is built.",
).name
EAGER_THROUGH = define(
    "CUDA_GRAPH_RUNNER_EAGER_THROUGH",
    "optional_bool",
    None,
    "Eager-through mode for both phases, overriding the config key 'eager_through' "
    "(cuda_graph_runner.runner.eager_through): replays pad and fill the static buffers as ever "
    "but run the forward eagerly on the static batch. Read when a runner is built.",
).name
GRAPH_NODES = define(
    "CUDA_GRAPH_RUNNER_GRAPH_NODES",
    "bool",
    False,
    "Keep each captured CUDA graph's template (torch keep_graph=True, instantiated right after capture) "
    "so runner.describe() can count its nodes and kernels; costs host memory per graph. "
    "Read at each capture.",
).name

"""The pluggy hooks a backend plugin implements, and the spec it contributes.

Importing this module imports neither torch nor any backend: a plugin's registration
module (the object its entry point names) should import only this, so that listing
backends stays cheap and one vendor's broken wheel cannot break discovery.

A plugin module that provides one backend looks like::

    from cuda_graph_runner.backend.hookspecs import BackendSpec, backend_hooks

    cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
        BackendSpec(name="acme", backend_class="acme_cgr.backend:AcmeBackend",
                    phases=("decode",), devices=("acme",),
                    probe="acme_cgr.plugin:probe", api_version="1.1"),
        default_for=[("decode", "acme")],
    )

:func:`backend_hooks` writes the two ``@hookimpl`` functions. A plugin may write them by
hand instead: ``cuda_graph_runner_backend_specs()`` returning its specs, and
``cuda_graph_runner_default_backend(phase, device_type)`` returning a name, a
:class:`DefaultClaim` or None. Either way the module is declared in the plugin's
``pyproject.toml``::

    [project.entry-points."cuda_graph_runner.backends"]
    acme = "acme_cgr.plugin"
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable, List, Optional, Tuple, Union

import pluggy

PROJECT_NAME = "cuda_graph_runner"
#: The entry-point group plugins register in; entry-point name = backend name.
ENTRY_POINT_GROUP = "cuda_graph_runner.backends"
#: Plugin API version this core implements, ``"major.minor"``. A plugin declares the
#: version it was written for in ``BackendSpec.api_version``. Compatible means: same
#: major, and the plugin's minor <= the core's (minor versions only add hooks or
#: optional arguments). Anything else is listed ``unavailable`` with both versions.
#: 1.1: the capture plan (``set_capture_plan``/``prepare(plan)``, the replay forward
#: ``capture_plan.forward``, ``plan.wrap_model_forward``) and the base class's defaults
#: (both sessions, ``can_run``, ``cleanup``, ``captured_keys``, the graph table).
#: 1.2: ``describe_graph(key)`` (per-graph facts for ``runner.describe()``, with a
#: default) and the graph-template helpers ``new_graph``/``finish_graph``.
#: 1.3: two-dimensional keys (``ShapeKey.requests``: requests x tokens, the mixed
#: runner's) in ``capture_one``/``replay``/``can_run`` and the plan (``plan.shapes``).
PLUGIN_API_VERSION = "1.3"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)

#: ``"package.module:attribute"``, resolved only when needed.
LazyRef = str
#: A probe returns None (or True) when the backend can run on ``device_type``, else the
#: reason it cannot. It is called once per process and device type, within
#: ``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S`` (:mod:`cuda_graph_runner.registry.probing`).
Probe = Callable[[str], Union[str, bool, None]]


@dataclasses.dataclass(frozen=True)
class BackendSpec:
    """What a plugin tells the registry about one backend.

    Attributes:
        name: the string users write in config (``"full"``); must equal the entry-point name.
        backend_class: ``"module:Class"`` of a ``BaseCudaGraphBackend`` subclass, imported
            only when the backend is resolved (or a class object, for in-process plugins).
        phases: phases it supports, a subset of ``("decode", "prefill")``.
        devices: device types it runs on (``"cuda"``, ``"npu"``); ``"*"`` means any.
        probe: ``"module:function"`` or callable ``probe(device_type) -> Optional[str]``
            returning None (or True) when usable, else why not; None means always usable.
            Called once per process and device type, in a thread, within a time limit
            (``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S``, default 10 s): a slower probe is
            listed unavailable, timed out.
        api_version: the plugin API version it was written for (``"major.minor"``),
            written as a literal in the plugin (not ``PLUGIN_API_VERSION`` imported from
            the core, which would always match). None means undeclared: accepted for now
            as compatible, but the conformance kit requires a declaration.
        description: one line for ``cuda-graph-runner backends``.
        options: the backend options (config keys in
            ``cuda_graph_runner.config.BACKEND_OPTION_KEYS``, such as ``"tc_compiler"``)
            this backend reads. A config that sets an option the selected backend does not
            read is rejected at resolve time, naming the backends that read it. A backend
            declaring both ``"torch_compile"`` and ``"compile_sizes"`` is taken to compile
            only with torch_compile on: compile sizes with ``torch_compile: false`` are
            rejected for it (declare ``"compile_sizes"`` alone where the backend compiles by itself).
    """

    name: str
    backend_class: Union[LazyRef, type]
    phases: Tuple[str, ...]
    devices: Tuple[str, ...] = ("cuda",)
    probe: Union[LazyRef, Probe, None] = None
    api_version: Optional[str] = None
    description: str = ""
    options: Tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class DefaultClaim:
    """A default-backend claim with a priority, returned by ``cuda_graph_runner_default_backend``.

    A plain name string is the same as ``DefaultClaim(name, priority=0)``.

    Attributes:
        backend: the backend name claimed as the default.
        priority: higher wins among usable claims; ties go to the backend name, then
            the distribution name, in alphabetical order (never install order).
    """

    backend: str
    priority: int = 0


#: One ``(phase, device_type)`` pair, such as ``("decode", "cuda")``.
PhaseDevice = Tuple[str, str]
SpecsHook = Callable[[], List[BackendSpec]]
DefaultHook = Callable[[str, str], Optional[str]]


def backend_hooks(spec: BackendSpec, *, default_for: Iterable[PhaseDevice] = ()) -> Tuple[SpecsHook, DefaultHook]:
    """The two hook implementations of a plugin that provides one backend.

    A registration module binds them to the hook names, which pluggy then finds on the
    module like hand-written ``@hookimpl`` functions (the hooks, the entry point and the
    plugin API version are the same)::

        cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend = backend_hooks(
            BackendSpec(name="acme", devices=("npu",), ...), default_for=[("decode", "npu")]
        )

    Args:
        spec: the one backend the plugin provides; ``cuda_graph_runner_backend_specs()``
            returns ``[spec]``.
        default_for: the ``(phase, device_type)`` pairs where ``spec.name`` claims the
            default backend (priority 0); elsewhere ``cuda_graph_runner_default_backend``
            passes (None). Empty (the default): never claims. A plugin that claims with a
            priority, or provides several backends, writes its hooks by hand.

    Raises:
        ValueError: ``default_for`` is not a list of pairs (a bare pair or string, None),
            an entry is not a ``(phase, device_type)`` pair of strings, or names a phase ``spec.phases`` or a device type ``spec.devices``
            does not list (the claim could never be used).
    """
    if default_for is None or isinstance(default_for, (str, bytes)) or _is_pair(default_for):
        raise ValueError(
            f"backend {spec.name!r}: default_for must be a list of (phase, device_type) pairs, "
            f"e.g. [('decode', 'cuda')]; got {default_for!r}"
        )
    claims = frozenset(_claim_pair(spec, pair) for pair in default_for)

    @hookimpl
    def cuda_graph_runner_backend_specs() -> List[BackendSpec]:
        return [spec]

    @hookimpl
    def cuda_graph_runner_default_backend(phase: str, device_type: str) -> Optional[str]:
        return spec.name if (phase, device_type) in claims else None

    return cuda_graph_runner_backend_specs, cuda_graph_runner_default_backend


def _is_pair(value: object) -> bool:
    return isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(x, str) for x in value)


def _claim_pair(spec: BackendSpec, pair: object) -> PhaseDevice:
    if not _is_pair(pair):
        raise ValueError(
            f"backend {spec.name!r}: default_for entry {pair!r} is not a (phase, device_type) pair of "
            f"strings, e.g. ('decode', 'cuda')"
        )
    assert isinstance(pair, (tuple, list))
    if pair[0] not in spec.phases:
        raise ValueError(
            f"backend {spec.name!r}: default_for entry {pair!r} names phase {pair[0]!r}; "
            f"the spec's phases are {spec.phases!r}"
        )
    if "*" not in spec.devices and pair[1] not in spec.devices:
        raise ValueError(
            f"backend {spec.name!r}: default_for entry {pair!r} names device type {pair[1]!r}; "
            f"the spec's devices are {spec.devices!r}"
        )
    return (pair[0], pair[1])


class BackendHookSpecs:
    """Hook specifications (namespace ``cuda_graph_runner``)."""

    @hookspec
    def cuda_graph_runner_backend_specs(self) -> List[BackendSpec]:
        """Return the backends this plugin provides."""
        raise NotImplementedError  # a specification: pluggy calls the plugins' implementations

    @hookspec(firstresult=True)
    def cuda_graph_runner_default_backend(self, phase: str, device_type: str) -> Optional[str]:
        """Claim the default backend for ``phase`` on ``device_type``: a name, a
        :class:`DefaultClaim`, or None to pass.

        The registry asks every plugin (not just the first to answer). A claim whose
        backend cannot run here (not registered, failed, probe says unavailable, phase not
        supported) passes to the next claimant; among usable claims the highest priority
        wins, then the backend name, then the distribution name, alphabetically, so the
        result never depends on install or ``sys.path`` order. With several claimants a
        ``RuntimeWarning`` names each once, and ``cuda-graph-runner backends`` shows who
        set the default and who else claimed it. With no usable claim the default is
        ``"disabled"``.
        """

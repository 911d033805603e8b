"""Registry entries: one row per backend, its status, and the device probe.

What it does: defines :class:`BackendEntry` and its statuses, checks a ``BackendSpec``
without importing anything (:func:`spec_problem`), turns a spec into an entry
(:func:`entry_from_spec`: spec, API version and, for class objects, the contract), asks
a backend whether it can run on a device type (:func:`probe`), and words the error for
an unknown name.

What it does not do: discover or register plugins, import ``"module:Class"`` backend
classes, or settle conflicts; the stored entry is never changed here (``probe`` returns
a copy), so a probe for one device never decides the status for another.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import re
from typing import Dict, Iterable, Mapping, Optional, Tuple

from ..backend.errors import BackendContractError, BackendUnavailableError
from ..backend.hookspecs import BackendSpec
from ..config import _BACKEND_NAME, WELL_KNOWN_DISTRIBUTIONS
from .contract import check_backend_class
from .discovery import one_line, ref_name
from .probing import ProbeCache, call_probe
from .versions import CORE_DISTRIBUTION, api_version_problem

IN_PROCESS = "<in-process>"


class EntryStatus(str, enum.Enum):
    """The status of a registry entry. A ``str`` subclass whose values are the strings
    tables and JSON show (``entry.status == "available"`` holds, ``json.dumps`` writes
    ``"available"``, ``str()`` and f-strings give the value on every Python version)."""

    AVAILABLE = "available"
    #: Installed, cannot run on this device.
    UNAVAILABLE = "unavailable"
    #: The plugin is broken (import, spec, API version or contract).
    FAILED = "failed"
    #: Several distributions register the name and none is preferred (CUDA_GRAPH_RUNNER_PREFER).
    CONFLICT = "conflict"

    def __str__(self) -> str:
        return self.value


AVAILABLE = EntryStatus.AVAILABLE
UNAVAILABLE = EntryStatus.UNAVAILABLE
FAILED = EntryStatus.FAILED
CONFLICT = EntryStatus.CONFLICT

PHASES = ("decode", "prefill")
# A "package.module:attribute" reference, checked for form only (nothing is imported).
_REF = re.compile(r"[\w.]+:[\w.]+")


@dataclasses.dataclass
class BackendEntry:
    """One row of ``list_backends()``.

    Attributes:
        name: backend name.
        distribution, version: the distribution that registered it (``"<in-process>"``
            for ``register()``).
        phases, devices: from its spec (empty when the plugin failed before giving one).
        status: an :class:`EntryStatus` (a ``str``): ``"available"``, ``"unavailable"``
            (installed, cannot run here) or ``"failed"`` (the plugin is broken) or
            ``"conflict"`` (several distributions register the name; ``distribution``
            lists them all).
        reason: why it is not available, one line; None when available.
        error: the original exception, when there was one.
        spec: the ``BackendSpec``, when the plugin gave one.
        contract: ``""`` (class not checked yet), ``"ok"``, ``"failed"`` (see ``reason``)
            or ``"not checked: <why>"`` (:meth:`BackendRegistry.verify` could not import
            the class on a machine where the backend is unavailable anyway).
    """

    name: str
    distribution: str
    version: str
    phases: Tuple[str, ...] = ()
    devices: Tuple[str, ...] = ()
    status: EntryStatus = EntryStatus.AVAILABLE
    reason: Optional[str] = None
    error: Optional[BaseException] = None
    spec: Optional[BackendSpec] = None
    contract: str = ""
    _class: Optional[type] = dataclasses.field(default=None, repr=False)
    # Set when the status was decided at registration (bad spec, API mismatch) and no
    # device probe may override it.
    _fixed: bool = dataclasses.field(default=False, repr=False)

    @property
    def ok(self) -> bool:
        return self.status == AVAILABLE

    @property
    def api_version(self) -> Optional[str]:
        """The plugin API version its spec declares (None: undeclared)."""
        return self.spec.api_version if self.spec is not None else None

    def as_row(self) -> Dict[str, str]:
        """Plain strings, for tables and JSON."""
        return {
            "name": self.name,
            "distribution": self.distribution,
            "version": self.version,
            "phases": ",".join(self.phases),
            "devices": ",".join(self.devices),
            "status": str(self.status),  # the plain string, whatever was assigned
            "reason": self.reason or "",
            "api_version": self.api_version or "",
            "contract": self.contract,
        }


def spec_problem(spec: BackendSpec) -> Optional[str]:
    """What is malformed in ``spec`` (checked without importing anything), or None."""
    if not isinstance(spec.name, str) or not _BACKEND_NAME.fullmatch(spec.name):
        return f"name {spec.name!r} is not an identifier, so no config could select it"
    if not isinstance(spec.phases, (tuple, list)) or not spec.phases or not set(spec.phases) <= set(PHASES):
        return f"phases {spec.phases!r} must be a non-empty tuple drawn from {PHASES}"
    if (
        not isinstance(spec.devices, (tuple, list))
        or not spec.devices
        or not all(isinstance(d, str) and d for d in spec.devices)
    ):
        return f"devices {spec.devices!r} must be a non-empty tuple of device types such as ('cuda',) or ('*',)"
    cls = spec.backend_class
    if isinstance(cls, str):
        if not _REF.fullmatch(cls):
            return f"backend_class {cls!r} must be 'package.module:Class' or a class"
    elif not isinstance(cls, type):
        return f"backend_class must be 'package.module:Class' or a class, got {type(cls).__name__}"
    probe_ref = spec.probe
    if (
        probe_ref is not None
        and not callable(probe_ref)
        and not (isinstance(probe_ref, str) and _REF.fullmatch(probe_ref))
    ):
        return f"probe {probe_ref!r} must be 'package.module:function', a callable or None"
    options = getattr(spec, "options", ())
    if not isinstance(options, (tuple, list)) or not all(isinstance(o, str) for o in options):
        return f"options {options!r} must be a tuple of config keys such as ('tc_compiler',)"
    if spec.api_version is not None and not isinstance(spec.api_version, str):
        return f"api_version {spec.api_version!r} must be a string such as '1.1'"
    return None


def entry_from_spec(spec: object, distribution: str, version: str) -> BackendEntry:
    """The entry for one spec a plugin returned: ``failed`` for a malformed spec or a class
    object that breaks the contract, ``unavailable`` for an incompatible API version
    (both fixed: no probe overrides them), else available pending the device probe."""
    if not isinstance(spec, BackendSpec):
        return BackendEntry(
            str(getattr(spec, "name", spec)),
            distribution,
            version,
            status=FAILED,
            reason=f"hook returned {type(spec).__name__}, expected BackendSpec",
            _fixed=True,
        )
    problem = spec_problem(spec)
    phases = tuple(spec.phases) if isinstance(spec.phases, (tuple, list)) else ()
    devices = tuple(spec.devices) if isinstance(spec.devices, (tuple, list)) else ()
    entry = BackendEntry(spec.name, distribution, version, phases, devices, spec=spec)
    if problem:
        entry.status, entry.reason, entry._fixed = FAILED, f"invalid BackendSpec: {problem}", True
        return entry
    api_problem = api_version_problem(spec.api_version)
    if api_problem:
        entry.status, entry._fixed = UNAVAILABLE, True
        entry.reason = (
            f"{distribution} {version} {api_problem}: install versions of {distribution} and "
            f"{CORE_DISTRIBUTION} that match"
        )
        return entry
    if isinstance(spec.backend_class, type):
        # A class object costs nothing more to check now: it is already imported.
        try:
            check_backend_class(spec.backend_class, spec.name)
        except BackendContractError as err:
            entry.status, entry.reason, entry.error, entry._fixed = FAILED, str(err), err, True
            entry.contract = FAILED
            return entry
        entry.contract = "ok"
    return entry


def probe(
    entry: BackendEntry, device_type: str, *, strict: bool = False, probes: Optional[ProbeCache] = None
) -> BackendEntry:
    """``entry`` as seen on ``device_type``: a copy whose status says whether it runs there.

    A failed or fixed entry is returned as is. Otherwise the spec's device list is
    checked, then its probe is asked (through ``probes``: bounded in time and cached,
    :mod:`.probing`; without it, called now): None or True is available, a reason
    unavailable, a probe past its time limit unavailable ("timed out"), and a probe that
    raises marks the copy failed.

    Raises:
        BackendUnavailableError: strict mode only, the probe raised (original chained).
        KeyboardInterrupt: passed through.
    """
    if entry.status == FAILED or entry.spec is None or entry._fixed:
        return entry
    result = dataclasses.replace(entry, status=AVAILABLE, reason=None, error=None)
    spec = entry.spec
    if "*" not in spec.devices and device_type not in spec.devices:
        result.status = UNAVAILABLE
        result.reason = f"runs on {', '.join(spec.devices)}, not on {device_type}"
        return result
    if spec.probe is not None:
        answer = probes.answer(spec.probe, device_type) if probes is not None else call_probe(spec.probe, device_type)
        exc = answer.error
        if exc is not None:
            if isinstance(exc, KeyboardInterrupt):
                raise exc
            message = f"probe {ref_name(spec.probe)}({device_type!r}) raised {one_line(exc)}"
            if strict:
                raise BackendUnavailableError(f"backend {entry.name!r} of {entry.distribution}: {message}") from exc
            result.status, result.reason, result.error = FAILED, message, exc
            return result
        if answer.reason:
            result.status, result.reason = UNAVAILABLE, answer.reason
    return result


def default_device_type() -> str:
    """The accelerator type torch reports here (``"cuda"``, ``"npu"``, ...), else ``"cpu"``."""
    import torch  # here, not at module level: discovery and listing work without torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        current = acc.current_accelerator()
        if current is not None:
            return current.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def natural_device(entry: BackendEntry) -> str:
    """The device type to probe ``entry`` on when none is given: its first named device,
    or the machine's accelerator for ``"*"`` backends."""
    devices = [d for d in entry.devices if d != "*"]
    return devices[0] if devices else default_device_type()


def unknown_backend_message(name: str, entries: Iterable[BackendEntry], skipped: Mapping[str, Tuple[str, str]]) -> str:
    """The error text for a name no plugin registers: what is installed, and the likely fix
    (installed but not loaded, which distribution provides a well-known name, a near miss)."""
    rows = sorted(entries, key=lambda e: e.name)
    installed = ", ".join(f"{e.name} ({e.distribution})" for e in rows)
    msg = f"unknown cuda graph backend {name!r}; installed: {installed or 'none'}"
    if name in skipped:
        dist, why = skipped[name]
        msg += f". {dist} provides {name!r} but it was not loaded: {why}"
    elif name in WELL_KNOWN_DISTRIBUTIONS:
        msg += f". Backend {name!r} is provided by {WELL_KNOWN_DISTRIBUTIONS[name]}: pip install {WELL_KNOWN_DISTRIBUTIONS[name]}"
    else:
        close = difflib.get_close_matches(name, [e.name for e in rows] + list(WELL_KNOWN_DISTRIBUTIONS), n=1)
        if close:
            msg += f". Did you mean {close[0]!r}?"
    return msg

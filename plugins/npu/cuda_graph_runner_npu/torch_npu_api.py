"""What this plugin needs from torch_npu, and why torch_npu is not usable here.

Importing this module imports neither torch nor torch_npu: the registry's probe and
``cuda-graph-runner backends`` call :func:`unavailable_reason`, which imports torch_npu
lazily, once per process, and turns every failure into one precise line.

The graph API surface the backend calls is declared here once (:data:`GRAPH_API`,
:data:`NPUGRAPH_API`) so the tests can check the recording fake and the real torch_npu
wheel (``torch_npu/npu/graphs.py``, read without importing it) against the same list.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

#: Keyword name of the host-side KV lengths in torch_npu's update records: the
#: ``actual_seq_lengths_kv`` argument of ``npu_fused_infer_attention_score``, which
#: torch_npu's graph handlers rebind on ``NPUGraph.update`` (sglang's NPU graph runners
#: send ``cpu_update_input=[{"actual_seq_lengths_kv": seq_lens}]``).
DEFAULT_UPDATE_INPUT_NAME = "actual_seq_lengths_kv"

#: Attributes of the device module (``torch.npu``) the backend calls, each with the
#: parameters it passes by keyword (positional ones are not listed).
GRAPH_API: Dict[str, Tuple[str, ...]] = {
    "NPUGraph": (),
    # graph(npu_graph, pool=None, stream=None, auto_dispatch_capture=False, capture_error_mode="global")
    "graph": ("pool", "stream", "auto_dispatch_capture", "capture_error_mode"),
    "graph_pool_handle": (),
    "Stream": (),
    "stream": (),
    "synchronize": (),
}

#: Methods of an ``NPUGraph`` the backend calls, with their keyword parameters.
NPUGRAPH_API: Dict[str, Tuple[str, ...]] = {
    "replay": (),
    "reset": (),
    "update": ("cpu_update_input",),
}

#: Distribution names torch_npu is published under (for its version in messages).
_DIST_NAMES = ("torch-npu", "torch_npu")
_INSTALL_HINT = (
    "pip install 'cuda-graph-runner-npu[torch-npu]' (a torch_npu build matching your torch), "
    "with the Ascend CANN toolkit and driver installed"
)

_lock = threading.Lock()
_cached: Optional[Tuple[Any, Optional[str], Optional[BaseException]]] = None


def torch_npu_version() -> str:
    """The installed torch_npu distribution's version, or ``"?"`` (reads metadata only)."""
    from importlib import metadata

    for name in _DIST_NAMES:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "?"


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    if len(text) > 300:
        text = text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _is_installed() -> bool:
    if sys.modules.get("torch_npu") is not None:
        return True
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):  # ValueError: sys.modules entry without a spec (blocked)
        return False


def load_torch_npu() -> Tuple[Any, Optional[str], Optional[BaseException]]:
    """Import torch_npu once and remember how it went.

    Returns:
        ``(module, None, None)`` on success, else ``(None, reason, error)``: ``reason``
        says whether torch_npu is not installed or installed but failing to import
        (with the cause: a missing CANN library, another accelerator's torch, ...);
        ``error`` is the original exception, or None.
    """
    global _cached
    with _lock:
        if _cached is not None:
            return _cached
        if not _is_installed():
            _cached = (None, f"torch_npu is not installed; {_INSTALL_HINT}", None)
            return _cached
        try:
            module = importlib.import_module("torch_npu")
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason, never a crash
            reason = f"torch_npu {torch_npu_version()} is installed but importing it failed: {_one_line(exc)}"
            _cached = (None, reason, exc)
            return _cached
        _cached = (module, None, None)
        return _cached


def reset_cache() -> None:
    """Forget the remembered import result (tests; after installing torch_npu)."""
    global _cached
    with _lock:
        _cached = None


def graph_api_problems(npu: Any, *, update: bool = True, capture_error_mode: bool = False) -> List[str]:
    """What the backend needs but ``npu`` (``torch_npu.npu``, ``torch.npu`` or a test double) lacks.

    Checks the names of :data:`GRAPH_API` and :data:`NPUGRAPH_API` and the keyword
    parameters the backend passes. ``update``: the update-then-replay path is on
    (needs ``NPUGraph.update(cpu_update_input=)`` and ``graph(auto_dispatch_capture=)``);
    ``capture_error_mode``: the backend passes that keyword too.

    Returns:
        One short phrase per problem; empty when everything is there.
    """
    skipped = set()
    if not update:
        skipped |= {"auto_dispatch_capture", "cpu_update_input", "update"}
    if not capture_error_mode:
        skipped.add("capture_error_mode")
    problems: List[str] = []
    for name, keywords in GRAPH_API.items():
        obj = getattr(npu, name, None)
        if obj is None:
            problems.append(f"no {name}")
            continue
        problems += _missing_keywords(obj, tuple(k for k in keywords if k not in skipped), name)
    graph_cls = getattr(npu, "NPUGraph", None)
    # A factory function instead of a class cannot be checked without making a graph.
    if isinstance(graph_cls, type):
        for name, keywords in NPUGRAPH_API.items():
            if name in skipped:
                continue
            method = getattr(graph_cls, name, None)
            if method is None:
                problems.append(f"no NPUGraph.{name}")
                continue
            problems += _missing_keywords(method, keywords, f"NPUGraph.{name}")
    return problems


def _missing_keywords(obj: Any, keywords: Tuple[str, ...], label: str) -> List[str]:
    if not keywords:
        return []
    try:
        params = inspect.signature(obj).parameters
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check
        return []
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return []
    return [f"{label} has no parameter {kw!r}" for kw in keywords if kw not in params]


def unavailable_reason(require_update: bool = True) -> Optional[str]:
    """None when NPU graphs can be captured here, else why not (one line).

    In order: torch_npu not installed; installed but its import fails (with the
    cause); its graph API lacks what the backend calls (``require_update`` also asks
    for ``NPUGraph.update`` and ``auto_dispatch_capture``); no NPU device is visible.
    """
    module, reason, _ = load_torch_npu()
    if module is None:
        return reason
    version = torch_npu_version()
    npu = getattr(module, "npu", None)
    if npu is None:
        return f"torch_npu {version} imported but has no torch_npu.npu module"
    problems = graph_api_problems(npu, update=require_update)
    if problems:
        return f"torch_npu {version} lacks the graph API this backend calls: {'; '.join(problems)}"
    try:
        available = bool(npu.is_available())
        count = int(npu.device_count()) if available else 0
    except Exception as exc:  # noqa: BLE001 - a driver error is a reason, not a crash
        return f"torch_npu {version} imported but querying NPU devices failed: {_one_line(exc)}"
    if not available or count == 0:
        return (
            f"torch_npu {version} imported but no NPU device is visible (torch_npu.npu.is_available() is "
            f"{available}, device_count() is {count}); check the Ascend driver and ASCEND_RT_VISIBLE_DEVICES"
        )
    return None

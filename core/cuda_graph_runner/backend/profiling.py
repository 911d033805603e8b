"""Profiler support: named replay ranges, per-size capture traces, kernel annotations.

Three tools for reading a torch profiler trace of graphs, all off unless asked for:

* **Replay ranges.** While a torch profiler records (``torch.profiler.profile``, the
  legacy ``torch.autograd.profiler.profile``, or one started on demand), every replay
  runs inside a ``record_function`` range named :func:`replay_range_name`
  (``"cuda_graph_runner.replay decode/full/bs=8 decode"``: phase, backend and shape key),
  so a trace shows which graph each launch was; an eager fallback step of ``forward`` is a
  range ``"cuda_graph_runner.eager <phase>/<reason>"``. With no profiler active the replay path
  asks one C flag (``torch.autograd._profiler_enabled``, the state the profiler itself
  keeps; tens of nanoseconds) and enters nothing: ``record_function`` costs host time
  even with no profiler.
* **Capture traces** (:func:`capture_trace`): a torch profiler trace of one size's
  capture, exported as chrome-trace JSON into the folder the user names, one file per
  phase, rank and size (:func:`capture_trace_path`), as sglang's
  ``--enable-profile-cuda-graph`` saves its capture profiles.
* **Kernel annotations inside graphs** (:func:`annotate_layers`): each kernel a graph
  records carries the fully qualified name of the ``nn.Module`` it ran in, through
  PyTorch's CUDA-graph kernel annotations (``mark_kernels``, matched to trace events by
  graph node id; pytorch issue #186026 asks for exactly this). Offered by
  ``torch.cuda._graph_annotations`` in torch 2.12 and 2.13 and by the public
  ``torch.cuda.graph_annotations`` from 2.14 on; it needs the ``cuda-bindings`` package
  and a CUDA 13.1 driver (or cuda-compat). Where any of that is missing (torch 2.11, the
  CPU) :func:`kernel_annotations_available` says why and nothing is annotated; capture
  and replay are unchanged. The annotations are merged into a profiler trace afterwards
  with :func:`save_kernel_annotations` and torch's ``torch.cuda._annotate_cuda_graph_trace``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from ..config.exceptions import CudaGraphRunnerError

logger = logging.getLogger(__name__)

__all__ = [
    "CaptureTraceError",
    "annotate_layers",
    "annotations_module",
    "capture_trace",
    "capture_trace_path",
    "check_trace_dir",
    "eager_range_name",
    "graph_launches_per_replay",
    "kernel_annotations_available",
    "process_rank",
    "profiler_enabled",
    "replay_range_name",
    "save_kernel_annotations",
    "trace_ranges",
]

#: Prefix of every range this library puts into a profiler trace.
RANGE_PREFIX = "cuda_graph_runner"


def _profiler_flag() -> Callable[[], bool]:
    flag = getattr(torch.autograd, "_profiler_enabled", None)
    if flag is None:  # a torch without the C flag: the Python-side mirror the profiler keeps
        import torch.autograd.profiler as autograd_profiler

        return lambda: bool(getattr(autograd_profiler, "_is_profiler_enabled", False))
    return flag


#: ``profiler_enabled()``: whether a torch profiler records now (one C call).
profiler_enabled: Callable[[], bool] = _profiler_flag()


def replay_range_name(phase: str, backend: str, key: Any) -> str:
    """The profiler range of one replay: ``"cuda_graph_runner.replay <phase>/<backend>/<key>"``,
    the key as ``bs=<size> <variant>`` (``"cuda_graph_runner.replay decode/full/bs=8 decode"``),
    a two-dimensional key with its request slots after it (``"bs=288 mixed requests=32"``)."""
    size = getattr(key, "size", key)
    variant = getattr(key, "variant", "")
    requests = getattr(key, "requests", None)
    shape = f"bs={size} {variant}".strip() + (f" requests={requests}" if requests is not None else "")
    return f"{RANGE_PREFIX}.replay {phase}/{backend}/{shape}"


def eager_range_name(phase: str, reason: str) -> str:
    """The profiler range of one eager fallback step of ``forward``:
    ``"cuda_graph_runner.eager <phase>/<fallback reason>"``."""
    return f"{RANGE_PREFIX}.eager {phase}/{reason}"


def capture_range_name(phase: str, backend: str, size: int) -> str:
    """The profiler range around one size's capture in a capture trace."""
    return f"{RANGE_PREFIX}.capture {phase}/{backend}/bs={size}"


class CaptureTraceError(CudaGraphRunnerError, ValueError):
    """The capture-trace folder cannot be used (names the path and why)."""


def check_trace_dir(path: Any) -> str:
    """``path`` as a folder capture traces can be written into (made when missing).

    Raises:
        CaptureTraceError: ``path`` is not a string or path, names a file, or cannot be
            made or written (the OS error's text included).
    """
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise CaptureTraceError(f"capture_trace_dir={path!r}: give a folder path (str or os.PathLike), or None")
    folder = os.fspath(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise CaptureTraceError(f"capture_trace_dir={folder!r} is a file, not a folder")
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise CaptureTraceError(f"capture_trace_dir={folder!r} cannot be made: {exc.strerror or exc}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise CaptureTraceError(f"capture_trace_dir={folder!r} is not writable")
    return folder


def capture_trace_path(folder: str, phase: str, backend: str, rank: int, size: int) -> str:
    """``<folder>/capture-<phase>-<backend>-rank<rank>-bs<size>.trace.json``."""
    return os.path.join(folder, f"capture-{phase}-{backend}-rank{rank}-bs{size}.trace.json")


def process_rank() -> int:
    """This process's rank in the default ``torch.distributed`` group, 0 without one: the
    rank in a capture trace's name when the model has no TP group (processes of a data
    parallel group writing into one folder keep their own files)."""
    dist = getattr(torch, "distributed", None)
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_rank())
    return 0


def _activities(device: torch.device) -> List[Any]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda" and torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


@contextlib.contextmanager
def capture_trace(
    folder: Optional[str], phase: str, backend: str, rank: int, size: int, device: torch.device
) -> Iterator[Optional[str]]:
    """Record the block (one size's capture) with a torch profiler and export it as a
    chrome trace to :func:`capture_trace_path`; yields that path, or None when
    ``folder`` is None or another profiler already records (profilers do not nest: the
    outer one keeps recording, and this size's capture is in its trace, logged once).

    The block runs inside the range :func:`capture_range_name`. The file is written
    only when the block succeeds.
    """
    if folder is None:
        yield None
        return
    if profiler_enabled():
        logger.info("capture trace of %s bs=%d skipped: another torch profiler is recording", phase, size)
        yield None
        return
    path = capture_trace_path(folder, phase, backend, rank, size)
    with torch.profiler.profile(activities=_activities(device)) as prof:
        with torch.profiler.record_function(capture_range_name(phase, backend, size)):
            yield path
    prof.export_chrome_trace(path)
    logger.info("capture trace of %s bs=%d written to %s", phase, size, path)


def trace_ranges(path: str, prefix: str = RANGE_PREFIX + ".") -> List[Dict[str, Any]]:
    """The host-side ranges (complete events, ``"ph": "X"``, category ``user_annotation``)
    of a chrome-trace JSON file whose name starts with ``prefix``: what a test or a script
    reads back from an exported trace. A trace with CUDA activity repeats each range on
    the GPU timeline (category ``gpu_user_annotation``); those copies are left out, as
    are marked ops' own ranges (``cuda_graph_runner::<op>``, outside the default prefix).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a chrome trace (no ``traceEvents`` list).
    """
    return [
        e
        for e in _load_events(path)
        if e.get("ph") == "X"
        and str(e.get("cat", "user_annotation")).lower() == "user_annotation"
        and str(e.get("name", "")).startswith(prefix)
    ]


def _load_events(path: str) -> List[Dict[str, Any]]:
    with open(path) as f:
        doc = json.load(f)
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"{path}: not a chrome trace (no traceEvents list)")
    return [e for e in events if isinstance(e, dict)]


def graph_launches_per_replay(path: str) -> List[Tuple[str, int]]:
    """Per replay range of a chrome trace, in time order: ``(its name, how many graph
    launches (``cudaGraphLaunch`` runtime calls) ran inside it on its thread)``. A trace of
    real replays has at least one launch in each range (a ``breakable`` replay one per
    segment); a range without one means the range does not cover the replay.

    Raises:
        OSError, ValueError: as :func:`trace_ranges`.
    """
    events = _load_events(path)
    launches = [
        e
        for e in events
        if e.get("ph") == "X" and "cudaGraphLaunch" in str(e.get("name", "")) and isinstance(e.get("ts"), (int, float))
    ]
    found = []
    for r in sorted(trace_ranges(path, f"{RANGE_PREFIX}.replay"), key=lambda e: float(e["ts"])):
        start, end = float(r["ts"]), float(r["ts"]) + float(r.get("dur", 0))
        inside = [
            e for e in launches if e.get("tid") == r.get("tid") and start <= float(e["ts"]) and float(e["ts"]) <= end
        ]
        found.append((str(r["name"]), len(inside)))
    return found


# -- kernel annotations inside graphs ---------------------------------------------------


def annotations_module() -> Any:
    """torch's CUDA-graph annotation module (``torch.cuda.graph_annotations`` from torch
    2.14, ``torch.cuda._graph_annotations`` in 2.12 and 2.13), or None (older torch)."""
    for name in ("torch.cuda.graph_annotations", "torch.cuda._graph_annotations"):
        try:
            module = __import__(name, fromlist=["mark_kernels"])
        except ImportError:
            continue
        if hasattr(module, "mark_kernels"):
            return module
    return None


def kernel_annotations_available(device: torch.device) -> Tuple[bool, str]:
    """``(available, why not)`` for kernel annotations of graphs on ``device``: a CUDA
    device, a torch with the annotation module, and its runtime check (cuda-bindings and
    a driver with ``cudaGraphNodeGetToolsId``). Never raises."""
    if device.type != "cuda":
        return False, f"graphs on {device.type} (kernel annotations are a CUDA graph feature)"
    module = annotations_module()
    if module is None:
        return False, f"torch {torch.__version__} has no CUDA-graph kernel annotations (torch >= 2.12 has)"
    try:
        is_available = getattr(module, "is_available", None)
        ok = bool(is_available()) if is_available is not None else not module._is_tools_id_unavailable()
    except Exception as exc:  # a probe that fails means "not here", never a failed capture
        return False, f"the annotation probe failed: {exc}"
    if not ok:
        return False, "cuda-bindings >= 13.1 and a CUDA 13.1 driver (or cuda-compat) are needed"
    return True, ""


@contextlib.contextmanager
def annotate_layers(model: Any, module: Any) -> Iterator[None]:
    """For the block, every kernel recorded while a submodule of ``model`` runs its
    forward is annotated ``{"name": <its fully qualified name>}``, e.g. ``"layers.3.mlp"``
    (``module``: what
    :func:`annotations_module` returned; inner modules win where scopes nest). Hooks on
    the model's own submodules only, removed when the block ends; ``model`` not an
    ``nn.Module``: nothing is annotated."""
    if not isinstance(model, torch.nn.Module):
        yield
        return
    mark = module.mark_kernels
    open_scopes: List[Any] = []
    handles = []

    def enter(name: str) -> Callable[..., None]:
        def pre(_mod: Any, _args: Any) -> None:
            scope = mark({"name": name})
            scope.__enter__()
            open_scopes.append(scope)

        return pre

    def leave(_mod: Any, _args: Any, _out: Any) -> None:
        if open_scopes:
            open_scopes.pop().__exit__(None, None, None)

    for name, sub in model.named_modules():
        if not name:  # the model itself: the runner calls its forward, not the module
            continue
        handles.append(sub.register_forward_pre_hook(enter(name)))
        handles.append(sub.register_forward_hook(leave))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
        while open_scopes:  # a forward that raised left its scopes open
            with contextlib.suppress(Exception):
                open_scopes.pop().__exit__(None, None, None)


def save_kernel_annotations(path: str) -> int:
    """Pickle torch's recorded kernel annotations (graph node tools id -> annotations)
    to ``path``, the form ``python -m torch.cuda._annotate_cuda_graph_trace`` merges into
    a profiler trace; returns how many kernels carry one (0 where annotations are
    unavailable).

    Raises:
        OSError: ``path`` cannot be written.
    """
    module = annotations_module()
    annotations: Dict[int, Any] = dict(module.get_kernel_annotations()) if module is not None else {}
    with open(path, "wb") as f:
        pickle.dump(annotations, f)
    return len(annotations)

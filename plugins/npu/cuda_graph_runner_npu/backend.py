"""``NPUCudaGraphBackend``: one torch_npu ``NPUGraph`` per shape, with update-then-replay.

The idea comes from sglang's ``NPUCudaGraphBackend``
(``hardware_backend/npu/graph_runner/npu_cudagraph_backend.py``): a Full-style backend
on ``torch.npu.NPUGraph`` whose replay can first rebind host-side inputs of the recorded
graph (the sequence lengths Ascend's fused attention takes as a host list) through
``NPUGraph.update(cpu_update_input=[{name: values}])``, without recording again.
``capture_one`` takes ``post_warmup_hook`` like every backend (the runners pass it),
and the update runs on the calling thread: it returns before the replay is issued (an
update on another thread would race the replay), and a failed update never replays.

The device module is reached through ``self.device_module`` (``torch.npu`` once
torch_npu is imported; a test double in tests), never through a ``torch.npu``
literal, and torch_npu is imported only when a backend for an ``npu`` device is built.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch

from cuda_graph_runner.backend import (
    BackendUnavailableError,
    BaseCudaGraphBackend,
    CudaGraphRunnerError,
    ForwardBatch,
    ForwardFn,
    ShapeKey,
    WarmupHook,
)

from .torch_npu_api import DEFAULT_UPDATE_INPUT_NAME, graph_api_problems, load_torch_npu

#: ``static_batch -> cpu_update_input``: the list of ``{argument name: host value}``
#: dicts handed to ``NPUGraph.update`` (one dict applies to every recorded op).
CpuUpdateInputFn = Callable[[ForwardBatch], List[Dict[str, Any]]]


class NPUGraphUpdateError(CudaGraphRunnerError, RuntimeError):
    """The host-input update before a replay failed; the graph was not replayed.

    The original exception is chained (``__cause__``). The shape's output tensors still
    hold the previous replay's values and must not be used for this batch.
    """


def _is_npu(device: Any) -> bool:
    if isinstance(device, torch.device):
        return device.type == "npu"
    return str(device).split(":", 1)[0] == "npu"


def _require_torch_npu() -> Any:
    """Import torch_npu (which registers the ``npu`` device type with torch).

    Raises:
        BackendUnavailableError: torch_npu is missing or fails to import (cause chained).
    """
    module, reason, error = load_torch_npu()
    if module is None:
        raise BackendUnavailableError(f"backend 'npu': {reason}") from error
    return module


class NPUCudaGraphBackend(BaseCudaGraphBackend):
    """One ``NPUGraph`` per ``ShapeKey``, all captured into the runner's shared pool.

    Capture (per shape, the runner goes largest first): ``num_warmups`` eager runs of
    ``forward_fn`` on the capture stream, each after a synchronize; ``post_warmup_hook()``;
    a synchronize; then one recorded run inside
    ``device_module.graph(g, pool=pool, stream=stream, auto_dispatch_capture=True)``.
    ``auto_dispatch_capture=True`` makes torch_npu record the ops whose host-side
    arguments ``NPUGraph.update`` may change later (it raises on a graph captured
    without it); it is passed only while host-input updates are on.

    Replay: with updates on, ``graph.update(cpu_update_input=...)`` built from the static
    batch (default ``[{"actual_seq_lengths_kv": static_batch.seq_lens_cpu}]``, already
    padded by the runner), then ``graph.replay()``. ``update`` returns only after it has
    issued the re-launched ops on torch_npu's update stream, each followed by an event
    the replayed graph waits on, so the replay sees the new values; the replay is issued
    after ``update`` returned, never concurrently. If the update raises,
    :class:`NPUGraphUpdateError` is raised (cause chained) and nothing is replayed.

    Outputs: the tensors the recorded run returned; every replay rewrites them in place
    (consume or copy before the next replay of any graph in the pool).

    Args (beyond :class:`~cuda_graph_runner.backend.BaseCudaGraphBackend`'s):
        update_input_name: the argument name the host sequence lengths rebind
            (``"actual_seq_lengths_kv"`` for ``npu_fused_infer_attention_score``;
            ``"actual_seq_kvlen"`` for its v2 form). None turns host-input updates off:
            plain capture and replay, as for models whose every input is on the device.
        cpu_update_input_fn: builds the whole ``cpu_update_input`` from the static batch
            instead (per-op lists, int32 tensors for MLA, ...); turns updates on.
        capture_error_mode: passed to ``graph(...)`` when given (``"global"``,
            ``"thread_local"``, ``"relaxed"``: the ``aclmdlRICaptureMode``).
        synchronize_before_update: synchronize the device before each update, so the
            previous replay has finished before its recorded tasks are rewritten (as
            vllm-ascend does before a FULL replay under asynchronous scheduling).

    Raises (construction):
        BackendUnavailableError: ``device`` is an ``npu`` device, no ``device_module``
            was given and torch_npu cannot be imported (the reason says why).
    """

    def __init__(
        self,
        device: "torch.device | str" = "npu",
        *,
        update_input_name: Optional[str] = DEFAULT_UPDATE_INPUT_NAME,
        cpu_update_input_fn: Optional[CpuUpdateInputFn] = None,
        capture_error_mode: Optional[str] = None,
        synchronize_before_update: bool = False,
        **kwargs: Any,  # phase, phase_config, memory_pool, device_module: the base class's
    ) -> None:
        if kwargs.get("device_module") is None and _is_npu(device):
            # torch.device("npu") parses only once torch_npu has renamed privateuse1.
            _require_torch_npu()
        super().__init__(device, **kwargs)
        self.update_input_name = update_input_name
        self.cpu_update_input_fn = cpu_update_input_fn
        self.capture_error_mode = capture_error_mode
        self.synchronize_before_update = synchronize_before_update
        self._checked_module: Any = None

    # -- device module ------------------------------------------------------------------
    @property
    def device_module(self) -> Any:
        """``torch.npu`` (importing torch_npu on first use), or the module passed in.

        Raises:
            BackendUnavailableError: torch_npu cannot be imported, or the module lacks
                part of the graph API this backend calls (listed).
        """
        if self._device_module is None:
            if _is_npu(self.device):
                _require_torch_npu()
            self._device_module = torch.get_device_module(self.device)
        module = self._device_module
        if self._checked_module is not module:
            problems = graph_api_problems(
                module, update=self.updates_host_inputs, capture_error_mode=self.capture_error_mode is not None
            )
            if problems:
                name = getattr(module, "__name__", type(module).__name__)
                raise BackendUnavailableError(
                    f"backend 'npu': device module {name} lacks the graph API it calls: {'; '.join(problems)}"
                )
            self._checked_module = module
        return module

    @property
    def host_value_guard(self) -> str:  # type: ignore[override]
        """``"outside_marked_ops"`` with host-input updates on (a marked attention op may pass
        ``seq_lens_cpu`` to the fused attention op, whose host argument each replay's update
        rebinds), else ``"forward"``: the whole recorded forward is frozen
        (:mod:`cuda_graph_runner.backend.host_guard`)."""
        return "outside_marked_ops" if self.updates_host_inputs else "forward"

    @property
    def updates_host_inputs(self) -> bool:
        """Whether replays run the update-then-replay path."""
        return self.update_input_name is not None or self.cpu_update_input_fn is not None

    # -- capture (sessions, cleanup and captured_keys: the base class's) ---------------------
    def capture_one(self, key: ShapeKey, forward_fn: ForwardFn, *, post_warmup_hook: WarmupHook = None) -> None:
        """Warm up, run ``post_warmup_hook``, then record ``forward_fn`` for ``key``.

        Raises:
            BackendUnavailableError: see :attr:`device_module`.
        """
        dm = self.device_module  # BackendUnavailableError before any warm-up
        options: Dict[str, Any] = {}
        if self.updates_host_inputs:
            options["auto_dispatch_capture"] = True
        if self.capture_error_mode is not None:
            options["capture_error_mode"] = self.capture_error_mode
        self.record_graph(key, forward_fn, dm.NPUGraph, post_warmup_hook, **options)

    # -- replay -------------------------------------------------------------------------
    def can_run(self, batch: ForwardBatch, key: ShapeKey) -> bool:
        """``key`` is captured and, with the default update, ``batch`` carries host seq lens.

        Without ``seq_lens_cpu`` the graph could only replay the lengths frozen at
        capture, so the runner runs such a batch eagerly instead.
        """
        if key not in self.graph_table:
            return False
        if self.cpu_update_input_fn is None and self.update_input_name is not None:
            return batch.seq_lens_cpu is not None
        return True

    def cpu_update_input(self, static_batch: ForwardBatch) -> List[Dict[str, Any]]:
        """The ``cpu_update_input`` for ``static_batch`` (padded to the graph's size).

        Default: ``[{update_input_name: [int, ...] of seq_lens_cpu}]``; torch_npu applies
        a one-element list to every op it recorded.

        Raises:
            NPUGraphUpdateError: ``seq_lens_cpu`` is missing or not one per request.
        """
        if self.cpu_update_input_fn is not None:
            return self.cpu_update_input_fn(static_batch)
        seq_lens = static_batch.seq_lens_cpu
        if seq_lens is None:
            raise NPUGraphUpdateError(
                "NPU graph update needs the host sequence lengths, but ForwardBatch.seq_lens_cpu is None; "
                "fill it, or build the backend with update_input_name=None if the model reads none"
            )
        if len(seq_lens) != static_batch.batch_size:
            raise NPUGraphUpdateError(
                f"seq_lens_cpu has {len(seq_lens)} entries for a graph of {static_batch.batch_size} requests"
            )
        name = self.update_input_name
        assert name is not None  # replay calls this only while an update is on (the name or the function)
        return [{name: [int(s) for s in seq_lens]}]

    def replay(self, key: ShapeKey, static_batch: ForwardBatch) -> Any:
        """Update the host-side inputs (when on), then replay ``key``'s graph.

        Raises:
            KeyError: no graph was captured for ``key``.
            NPUGraphUpdateError: building the update or ``graph.update`` failed; the
                graph was not replayed (the cause is chained).
        """
        graph = self.graph_table.graph(key)
        if self.updates_host_inputs:
            cpu_update_input = self.cpu_update_input(static_batch)
            if self.synchronize_before_update:
                self.synchronize()  # this backend's device only
            try:
                # Synchronous on purpose: the replay below must not start before the
                # update has been issued (an update on another thread would race it).
                graph.update(cpu_update_input=cpu_update_input)
            except Exception as exc:
                raise NPUGraphUpdateError(
                    f"NPU graph update before replaying {key} failed ({type(exc).__name__}: {exc}); "
                    "the graph was not replayed"
                ) from exc
        return self.replay_graph(key)

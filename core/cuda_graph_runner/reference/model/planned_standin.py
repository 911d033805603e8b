"""``planned_standin``: a CPU **stand-in** of a plan-based attention backend (not a kernel).

It behaves like FlashInfer's wrappers as sglang drives them, on any device, with the
reference model's plain-PyTorch numerics:

* every forward reads lengths from a *plan* made on the host by a hook, never from the
  batch itself: a decode plan copies ``seq_lens_cpu`` into a per-size device buffer that
  the (captured) kernels read, an extend plan copies each token's request index and
  position (:func:`.extend_plan.token_tables`: zero-length requests own no token, padded
  tokens get position -1) into per-size device buffers that
  :func:`.extend_plan.token_table_extend` reads, so a prefill graph that records the
  attention (``full``) replays the live batch after its replay hook;
  a stale plan therefore gives wrong numbers, as a real wrapper would;
* it records every plan (:attr:`PlannedAttentionStandIn.plans`) and every forward that ran
  its Python (:attr:`~PlannedAttentionStandIn.forwards`: eager runs, warm-ups, captures,
  replays on CPU stand-ins of graphs, marked ops run eagerly at replay);
* it raises :class:`UnplannedForwardError` for a forward with no plan (an eager forward
  without ``init_forward_metadata``, a graph forward of a size whose capture hook never
  ran or whose state ``cleanup`` dropped) and :class:`StalePlanError` for a forward whose
  plan was made for another batch (lengths differ) or for an earlier forward (an eager or
  replay plan serves exactly one forward; a capture plan serves the capture's warm-ups
  and its recorded run);
* inside a real device graph, where no Python runs at replay, the recorded forward adds
  a mismatch of its plan buffer against the batch's device ``seq_lens`` to a device
  counter (no host sync): :meth:`~PlannedAttentionStandIn.check` reads the counters
  afterwards and raises :class:`StalePlanError`.

Used by the tests of the runners and by the conformance kit
(:mod:`cuda_graph_runner.testing.conformance`), so a vendor's graph backend is checked
against host planning too.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

import torch

from ...backend.context import forward_scratch, get_forward_batch
from ...backend.forward_batch import ForwardBatch, ForwardMode, StaticForwardBatch, _stored
from ...backend.graph_break import eager_op
from ...config.exceptions import CudaGraphRunnerError
from .attention import AttentionCall
from .attention_backend import AttentionBackend, graph_key
from .extend_plan import host_to_device, token_table_extend, token_tables

#: Plans and forwards kept in the records (the oldest are dropped past it).
MAX_RECORDS = 4096


class UnplannedForwardError(CudaGraphRunnerError, RuntimeError):
    """A forward of the stand-in ran with no plan made for it."""


class StalePlanError(CudaGraphRunnerError, RuntimeError):
    """A forward of the stand-in ran with a plan made for another batch or an earlier forward."""


@dataclasses.dataclass(eq=False)
class Plan:
    """One plan: ``kind`` ``"eager"``, ``"capture"`` or ``"replay"``; ``key`` the graph key
    (:func:`~.attention_backend.graph_key`; None for eager); the host lengths it was made
    from (``seq_lens`` for decode-like modes, ``extend_seq_lens``/``extend_prefix_lens``
    for EXTEND); ``index`` its place among all plans made."""

    index: int
    kind: str
    key: Optional[tuple]
    mode: ForwardMode
    seq_lens: Optional[List[int]] = None
    extend_seq_lens: Optional[List[int]] = None
    extend_prefix_lens: Optional[List[int]] = None
    device_lens: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    #: EXTEND: the per-token plan on the device (:func:`.extend_plan.token_tables`).
    tok_req: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    tok_pos: Optional[torch.Tensor] = dataclasses.field(default=None, repr=False)
    batch_ref: Any = dataclasses.field(default=None, repr=False)
    claimed: bool = False


@dataclasses.dataclass(eq=False)
class GraphState:
    """Per-size state (one per graph key): the device buffer of planned lengths the
    captured kernels read (decode-like modes), the device mismatch counter, the last plan."""

    key: tuple
    lens: Optional[torch.Tensor]
    mismatches: torch.Tensor
    plan: Optional[Plan] = None
    #: EXTEND: the per-token plan (request index, query position) the forwards read.
    tok_req: Optional[torch.Tensor] = None
    tok_pos: Optional[torch.Tensor] = None


_instances: "weakref.WeakValueDictionary[int, PlannedAttentionStandIn]" = weakref.WeakValueDictionary()
_ids = itertools.count(1)


@eager_op("planned_standin_attention", capture_safe=("decode", "target_verify", "dllm_extend"))
def planned_standin_attention(
    output: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    scaling: float,
    sliding_window: int,
    last_layer: bool,
    backend_id: int,
) -> None:
    """The stand-in's attention (arguments as ``reference_llama_attention``'s, plus the
    id of the stand-in instance). Capture-safe in the decode-like modes *together with
    its replay hook*: the recorded kernels read the per-size plan buffer, which only the
    replay hook refreshes."""
    call = AttentionCall(output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, get_forward_batch())
    _instances[backend_id]._run(call, last_layer)


class _PlannedView:
    """The batch as the kernels see it: lengths from the plan, the rest from the batch."""

    def __init__(self, batch: ForwardBatch, **planned: Any) -> None:
        self._batch = batch
        self.__dict__.update(planned)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)


class PlannedAttentionStandIn(AttentionBackend):
    """``planned_standin``: see the module docstring.

    Attributes:
        plan_log: every plan made, oldest first (at most :data:`MAX_RECORDS`).
        forwards: ``(plan kind, graph key, plan index)`` per forward that ran Python.
        states: per-size state by graph key.
        state_builds: how often each key's state was built (1 per key between cleanups).
        cleanups: the ``mode`` of each ``cleanup_cuda_graph_state`` call.
        seq_len_fill_value: what :meth:`get_cuda_graph_seq_len_fill_value` returns.
    """

    name = "planned_standin"
    plans = True
    replans_prefill_graphs = True  # the replay hook refills the per-size extend tables

    def __init__(self, seq_len_fill_value: int = 1) -> None:
        self.id = next(_ids)
        _instances[self.id] = self
        self.seq_len_fill_value = seq_len_fill_value
        self.plan_log: Deque[Plan] = collections.deque(maxlen=MAX_RECORDS)
        self.forwards: Deque[Tuple[str, Optional[tuple], int]] = collections.deque(maxlen=MAX_RECORDS)
        self.states: Dict[tuple, GraphState] = {}
        self.state_builds: Dict[tuple, int] = collections.Counter()
        self.cleanups: List[Optional[ForwardMode]] = []
        self._eager_plan: Optional[Plan] = None
        self._count = itertools.count()
        self._scratch_key = f"planned_standin:{self.id}"

    # -- hooks ----------------------------------------------------------------------
    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.seq_len_fill_value

    def init_forward_metadata(self, batch: ForwardBatch) -> None:
        mode = batch.forward_mode
        if mode.is_decode_like():
            lens = batch.seq_lens_cpu
            host = list(lens) if lens is not None else batch.seq_lens.tolist()  # eager: a read is allowed
            plan = self._new_plan("eager", None, mode, seq_lens=[int(x) for x in host])
            plan.device_lens = torch.tensor(plan.seq_lens, dtype=torch.int32, device=batch.seq_lens.device)
        else:
            ext, pre = _extend_lists(batch, allow_device=True)
            plan = self._new_plan("eager", None, mode, extend_seq_lens=ext, extend_prefix_lens=pre)
            req, pos = token_tables(ext, pre, batch.input_ids.shape[0])
            plan.tok_req = torch.tensor(req, dtype=torch.int64, device=batch.input_ids.device)
            plan.tok_pos = torch.tensor(pos, dtype=torch.int64, device=batch.input_ids.device)
        plan.batch_ref = weakref.ref(batch)
        self._eager_plan = plan

    def init_cuda_graph_state(self, batch: ForwardBatch) -> GraphState:
        key = graph_key(batch)
        device = batch.input_ids.device
        decode = key[0].is_decode_like()
        lens = torch.zeros(key[2], dtype=torch.int32, device=device) if decode else None
        self.state_builds[key] += 1
        state = GraphState(key, lens, torch.zeros(1, dtype=torch.int64, device=device))
        if not decode:  # the per-token plan of a prefill graph: key[2] tokens
            state.tok_req = torch.zeros(key[2], dtype=torch.int64, device=device)
            state.tok_pos = torch.full((key[2],), -1, dtype=torch.int64, device=device)
        return state

    def init_forward_metadata_capture_cuda_graph(self, batch: ForwardBatch) -> None:
        key = graph_key(batch)
        state = self.states.get(key)
        if state is None:  # only when absent: a recorded graph reads this state's buffers
            state = self.states[key] = self.init_cuda_graph_state(batch)
        self._plan_graph(state, batch, "capture")

    def init_forward_metadata_replay_cuda_graph(self, batch: ForwardBatch) -> None:
        key = graph_key(batch)
        state = self.states.get(key)
        if state is None:
            raise UnplannedForwardError(
                f"planned_standin: replay of graph {key} has no per-size state: the capture hook never ran "
                "for it, or cleanup dropped it (capture again after cleanup)"
            )
        self._plan_graph(state, batch, "replay")

    def cleanup_cuda_graph_state(self, mode: Optional[ForwardMode] = None) -> None:
        self.cleanups.append(mode)
        for key in [k for k in self.states if mode is None or k[0] is mode]:
            del self.states[key]

    def _new_plan(self, kind: str, key: Optional[tuple], mode: ForwardMode, **lens: Any) -> Plan:
        plan = Plan(next(self._count), kind, key, mode, **lens)
        self.plan_log.append(plan)
        return plan

    def _plan_graph(self, state: GraphState, batch: ForwardBatch, kind: str) -> None:
        key = state.key
        mode = batch.forward_mode
        if mode.is_decode_like():
            host = batch.seq_lens_cpu  # the hooks run outside the host-value guard
            if host is None:
                raise ValueError(
                    f"planned_standin: the static batch of graph {key} has seq_lens_cpu=None; a plan-based "
                    "attention plans from the host lengths (never from device tensors, which would sync): "
                    "give the live ForwardBatch seq_lens_cpu (the runner pads it with the fill value)"
                )
            if len(host) != key[2]:
                raise ValueError(
                    f"planned_standin: seq_lens_cpu has {len(host)} entries for graph {key} of {key[2]} requests"
                )
            plan = self._new_plan(kind, key, mode, seq_lens=[int(x) for x in host])
            assert state.lens is not None
            # In place: the graph recorded this buffer's address. Host list to device without
            # a sync: from pinned memory, which the caching host allocator keeps until the copy ran.
            src = torch.tensor(plan.seq_lens, dtype=torch.int32)
            if state.lens.device.type == "cuda":
                src = src.pin_memory()
            state.lens.copy_(src, non_blocking=True)
            plan.device_lens = state.lens
        else:
            ext, pre = _extend_lists(batch, allow_device=False)
            plan = self._new_plan(kind, key, mode, extend_seq_lens=ext, extend_prefix_lens=pre)
            assert state.tok_req is not None and state.tok_pos is not None
            # In place: a graph that recorded the attention reads these addresses.
            req, pos = token_tables(ext, pre, key[2])
            host_to_device(req, state.tok_req)
            host_to_device(pos, state.tok_pos)
            plan.tok_req, plan.tok_pos = state.tok_req, state.tok_pos
        state.plan = plan

    # -- forwards ---------------------------------------------------------------------
    def forward(
        self,
        output: torch.Tensor,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        req_to_token: torch.Tensor,
        scaling: float,
        sliding_window: int,
        last_layer: bool,
    ) -> None:
        planned_standin_attention(
            output, q, k_cache, v_cache, req_to_token, scaling, sliding_window, last_layer, self.id
        )

    def _run(self, call: AttentionCall, last_layer: bool) -> None:
        batch = call.batch
        scratch = forward_scratch()
        entry = scratch.get(self._scratch_key)
        if entry is None:  # the first layer of this forward: find and claim its plan
            plan, state = self._plan_for(batch)
            plan.claimed = True
            scratch[self._scratch_key] = entry = (plan, state)
            self.forwards.append((plan.kind, plan.key, plan.index))
            if state is not None and state.lens is not None:
                # Recorded into a graph with the rest: counts a stale plan at device replays.
                state.mismatches.add_((state.lens != batch.seq_lens).sum())
        plan = entry[0]
        if batch.forward_mode.is_decode_like():
            view = _PlannedView(batch, seq_lens=plan.device_lens)
            self.forward_decode(call._replace(batch=view), last_layer)  # type: ignore[arg-type]
        else:
            # Device-driven from the plan's per-token tables (capture-safe with the
            # replay hook: a graph that records it, ``full``, replays the re-planned tables).
            assert plan.tok_req is not None and plan.tok_pos is not None
            token_table_extend(call, plan.tok_req, plan.tok_pos)

    def _plan_for(self, batch: ForwardBatch) -> Tuple[Plan, Optional[GraphState]]:
        if isinstance(batch, StaticForwardBatch):
            key = graph_key(batch)
            state = self.states.get(key)
            if state is None or state.plan is None:
                raise UnplannedForwardError(
                    f"planned_standin: a graph forward of {key} has no per-size state: the capture hook "
                    "(init_forward_metadata_capture) did not run for it, or cleanup dropped it"
                )
            plan = state.plan
            if plan.claimed and plan.kind != "capture":
                raise StalePlanError(
                    f"planned_standin: the {plan.kind} plan #{plan.index} of graph {key} already served a forward: "
                    "the replay hook (init_forward_metadata_replay) did not run before this replay"
                )
            _check_lengths(plan, batch, key)
            return plan, state
        eager = self._eager_plan
        if eager is None or eager.batch_ref() is not batch:
            raise UnplannedForwardError(
                "planned_standin: an eager forward ran without init_forward_metadata(batch) for that batch "
                f"(mode {batch.forward_mode.value}, {batch.batch_size} requests)"
            )
        self._eager_plan = None  # one eager plan serves one forward
        return eager, None

    def check(self) -> None:
        """Raise when a recorded forward replayed on a device counted a stale plan (reads
        the device counters: a host sync; call it outside the replay path).

        Raises:
            StalePlanError: names the graph keys whose forwards saw stale plan buffers.
        """
        bad = {key: int(state.mismatches.item()) for key, state in self.states.items()}
        bad = {key: n for key, n in bad.items() if n}
        if bad:
            raise StalePlanError(
                f"planned_standin: graph forwards read plan buffers that did not match the batch's seq_lens "
                f"(mismatched requests per graph key: {bad}): a replay ran without its replay hook"
            )

    def plan_kinds(self) -> List[str]:
        """The kind of every recorded plan, oldest first."""
        return [p.kind for p in self.plan_log]


def _extend_lists(batch: ForwardBatch, *, allow_device: bool) -> Tuple[List[int], List[int]]:
    ext, pre = batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu
    if ext is None and allow_device and batch.extend_seq_lens is not None:
        ext = batch.extend_seq_lens.tolist()
    if ext is None:
        raise ValueError(
            "planned_standin: an EXTEND batch without extend_seq_lens_cpu: a plan-based attention plans "
            "prefill from the host lengths"
        )
    if pre is None:
        pre = batch.extend_prefix_lens.tolist() if allow_device and batch.extend_prefix_lens is not None else None
    return [int(x) for x in ext], [int(x) for x in (pre if pre is not None else [0] * len(ext))]


def _check_lengths(plan: Plan, batch: ForwardBatch, key: tuple) -> None:
    # Stored values: inside a capture the host-value guard is armed, and this is a check only.
    if plan.mode.is_decode_like():
        now = _stored(batch, "seq_lens_cpu")
        if now is not None and [int(x) for x in now] != plan.seq_lens:
            raise StalePlanError(
                f"planned_standin: graph {key} runs with seq_lens_cpu {list(now)} but its {plan.kind} plan "
                f"#{plan.index} was made for {plan.seq_lens}: the replay hook did not re-plan this batch"
            )
        return
    now_ext = _stored(batch, "extend_seq_lens_cpu")
    now_pre = _stored(batch, "extend_prefix_lens_cpu")
    if now_ext is not None and [int(x) for x in now_ext] != plan.extend_seq_lens:
        raise StalePlanError(
            f"planned_standin: graph {key} runs with extend_seq_lens_cpu {list(now_ext)} but its {plan.kind} "
            f"plan #{plan.index} was made for {plan.extend_seq_lens}: the replay hook did not re-plan this batch"
        )
    if now_pre is not None and [int(x) for x in now_pre] != plan.extend_prefix_lens:
        raise StalePlanError(
            f"planned_standin: graph {key} runs with extend_prefix_lens_cpu {list(now_pre)} but its plan "
            f"#{plan.index} was made for {plan.extend_prefix_lens}"
        )

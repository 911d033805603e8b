"""Verify mode: compare sampled replays with a per-backend reference on the same live batch.

A graph replays what was recorded; Python that ran at capture (a branch on a host value,
data-dependent control flow), tensors allocated outside the static buffers and random
ops can make a replay differ from eager with no error. Verify mode catches that while
serving: for each shape key it checks the first ``first_n`` replays and, optionally,
every ``every``-th one after (so a branch that only flips on later, longer batches is
caught too). A check runs, after the replay, the backend's reference
(:meth:`~cuda_graph_runner.backend.BaseCudaGraphBackend.verify_reference`; eager by
default) on the same live batch and compares floating-point outputs with the backend's
tolerance (:meth:`~cuda_graph_runner.backend.BaseCudaGraphBackend.verify_tolerance`) and
integer or bool outputs (the greedy and draft runners' token ids) exactly; a mismatch
raises :class:`~cuda_graph_runner.backend.errors.CudaGraphVerifyError`.

Switches (off by default; when off the runner does one ``is None`` test per replay):

* config keys per phase: ``verify`` (bool), ``verify_first_n`` (default 3),
  ``verify_every`` (default 0: none after the first ones);
* environment, overriding the config for both phases: ``CUDA_GRAPH_RUNNER_VERIFY``
  (``1``/``true``/``yes``/``on`` or ``0``/``false``/``no``/``off``),
  ``CUDA_GRAPH_RUNNER_VERIFY_FIRST_N``, ``CUDA_GRAPH_RUNNER_VERIFY_EVERY`` (integers >= 0).

Side effects: the reference runs the forward again, so this step's KV-cache writes happen
twice with the same values. Verify mode needs a forward whose side effects are idempotent
for a repeated step (the reference model's paged KV write ``k_cache[out_cache_loc] = k``
is; a forward that appends to a list, advances a counter or samples with an unseeded
generator is not). A check also costs an eager forward and a copy of the outputs.

vLLM and sglang compare graph and eager outputs in their tests; this makes the same
check available on live traffic, sampled.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ..backend import envs
from ..backend.errors import CudaGraphVerifyError
from ..backend.nested import iter_tensors, map_tensors

ENV_VERIFY = envs.VERIFY
ENV_VERIFY_FIRST_N = envs.VERIFY_FIRST_N
ENV_VERIFY_EVERY = envs.VERIFY_EVERY

CAUSES = (
    "model code branching on a host value of the batch (seq_lens_cpu, extra, ...) during capture "
    "(keep host_value_guard on to find it at capture)",
    "data-dependent control flow (a Python branch on a tensor value, .item(), .tolist())",
    "tensors allocated outside the static buffers and the graph (a new tensor per step that the graph does not read)",
    "random ops (dropout, sampling) whose generator state is frozen at capture",
    "a forward whose side effects are not idempotent for a repeated step (verify runs it twice)",
    "an op across the batch's rows (a mean or a norm over the batch, batch statistics): rows must be "
    "independent, as the replay's padded rows enter such an op and change the live ones",
)

#: Why a replay in eager-through mode differs from eager on the live batch (no graph involved).
PADDING_CAUSES = (
    "an op across the batch's rows (a mean or a norm over the batch, batch statistics) that the padded rows enter",
    "a model-owned static input (static_inputs) or an extra field not filled or padded as the model expects",
    "a pad value the model mishandles (seq_lens fill value, dummy request row 0, KV slot 0)",
    "an output that leads with neither the token count nor the batch size, sliced wrongly",
)

__all__ = [
    "CAUSES",
    "PADDING_CAUSES",
    "ENV_VERIFY",
    "ENV_VERIFY_EVERY",
    "ENV_VERIFY_FIRST_N",
    "VerifyPolicy",
    "Verifier",
    "compare_outputs",
    "policy_from",
]


@dataclasses.dataclass(frozen=True)
class VerifyPolicy:
    """Which replays of a shape are checked: replay ``n`` (1-based, per key) when
    ``n <= first_n`` or (``every > 0`` and ``n % every == 0``)."""

    first_n: int = 3
    every: int = 0

    def samples(self, n: int) -> bool:
        return n <= self.first_n or (self.every > 0 and n % self.every == 0)


def policy_from(phase_config: Any) -> Optional[VerifyPolicy]:
    """The verify policy of a phase: its config keys overridden by the environment; None when off.

    Raises:
        cuda_graph_runner.backend.envs.EnvVarError: (a ``ValueError``) an environment variable with a
            value that is not accepted (named, with what is).
    """
    enabled = bool(getattr(phase_config, "verify", False))
    env = envs.get(ENV_VERIFY)
    if env is not None:
        enabled = env
    if not enabled:
        return None
    first_n = envs.get(ENV_VERIFY_FIRST_N)
    every = envs.get(ENV_VERIFY_EVERY)
    first_n = int(getattr(phase_config, "verify_first_n", 3)) if first_n is None else first_n
    every = int(getattr(phase_config, "verify_every", 0)) if every is None else every
    if first_n == 0 and every == 0:
        raise ValueError(
            f"verify mode is on but first_n=0 and every=0 (from the config or {ENV_VERIFY_FIRST_N}/"
            f"{ENV_VERIFY_EVERY}): no replay would be checked; accepted: first_n >= 1 or every >= 1"
        )
    return VerifyPolicy(first_n=first_n, every=every)


def compared_exactly(t: torch.Tensor) -> bool:
    """Integer and bool tensors (token ids, masks) are compared exactly: a float tolerance
    scaled by ``|reference|`` would let token 30000 match anything within 1500 in bfloat16."""
    return not (t.is_floating_point() or t.is_complex())


def _exact_leaf_diff(a: torch.Tensor, b: torch.Tensor) -> Tuple[bool, float, str]:
    """``(ok, max abs difference, detail)`` of two same-shape tensors of which one is
    integer or bool, with ``torch.equal`` semantics: every element equal."""
    x, y = a.detach().cpu(), b.detach().cpu()
    if x.numel() == 0 or torch.equal(x, y):
        return True, 0.0, ""
    differ = (x != y).reshape(-1)
    count = int(differ.sum())
    first = int(differ.nonzero()[0, 0])
    index = [int(i) for i in torch.unravel_index(torch.tensor(first), x.shape)]
    got, want = x.reshape(-1)[first].item(), y.reshape(-1)[first].item()
    diff = float((x.to(torch.float64) - y.to(torch.float64)).abs().max())
    detail = (
        f"{count} of {x.numel()} elements differ (exact comparison of {x.dtype} vs reference {y.dtype}), "
        f"the first at index {index}: {got} vs reference {want}; max abs difference {diff:.6g}"
    )
    return False, diff, detail


def _leaf_diff(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> Tuple[bool, float]:
    """``(ok, max abs difference)`` of two same-shape floating-point tensors, elementwise
    ``|a - b| <= atol + rtol * |b|`` between finite values. Equal values match, equal
    infinities (a masked vocabulary's -inf logits) and NaN on both sides included; an
    infinity or NaN on one side only is a mismatch (difference inf), never within
    tolerance (``rtol * inf`` would admit anything)."""
    if a.numel() == 0:
        return True, 0.0
    x = a.detach().to(torch.float64).cpu()
    y = b.detach().to(torch.float64).cpu()
    same = (x == y) | (torch.isnan(x) & torch.isnan(y))
    diff = (x - y).abs().masked_fill(same, 0.0).nan_to_num(nan=math.inf, posinf=math.inf)
    finite = torch.isfinite(x) & torch.isfinite(y)
    ok = bool((same | (finite & (diff <= atol + rtol * y.abs()))).all())
    return ok, float(diff.max())


def compare_outputs(got: Any, want: Any, atol: float, rtol: float) -> Tuple[bool, float, str]:
    """Compare the tensor leaves of two output structures (any structure
    :mod:`cuda_graph_runner.backend.nested` walks: tuples, NamedTuples, lists, dicts, dataclasses).

    Floating-point leaves (logits, hidden states) match within ``atol`` / ``rtol``
    (elementwise ``|got - want| <= atol + rtol * |want|``); a leaf that is integer or bool
    on either side (token ids, masks) matches only when every element is equal
    (``torch.equal``), whatever the tolerance.

    Returns:
        ``(ok, max_abs_diff, where)``: ``where`` names the first failing leaf (``""`` if
        none; for an exact leaf, how many elements differ and the first differing index);
        ``max_abs_diff`` is over every tensor leaf (inf for a shape or structure
        mismatch, or NaN on one side only).
    """
    got_leaves = list(iter_tensors(got, where=""))
    want_leaves = list(iter_tensors(want, where=""))
    if [p for p, _ in got_leaves] != [p for p, _ in want_leaves]:
        return (
            False,
            math.inf,
            (f"structure: tensors at {[p for p, _ in got_leaves]} vs reference {[p for p, _ in want_leaves]}"),
        )
    worst, first_bad = 0.0, ""
    for (path, a), (_, b) in zip(got_leaves, want_leaves):
        if a.shape != b.shape:
            worst = math.inf
            first_bad = first_bad or f"{path or 'output'}: shape {tuple(a.shape)} vs reference {tuple(b.shape)}"
            continue
        if compared_exactly(a) or compared_exactly(b):
            ok, d, detail = _exact_leaf_diff(a, b)
            worst = max(worst, d)
            if not ok and not first_bad:
                first_bad = f"{path or 'output'}: {detail}"
            continue
        ok, d = _leaf_diff(a, b, atol, rtol)
        worst = max(worst, d)
        if not ok and not first_bad:
            first_bad = f"{path or 'output'}: max abs difference {d:.6g} (atol {atol:g}, rtol {rtol:g})"
    return not first_bad, worst, first_bad


def _compute_dtype(model: Any, output: Any) -> torch.dtype:
    params = getattr(model, "parameters", None)
    if callable(params):
        try:
            for p in params():
                if p.is_floating_point():
                    return p.dtype
        except Exception:  # a model without real parameters: fall back to the output
            pass
    if isinstance(output, torch.Tensor) and output.is_floating_point():
        return output.dtype
    return torch.float32


class Verifier:
    """Counts replays per shape key and checks the sampled ones (the runner holds one).

    Args:
        policy: which replays to check.
        phase, backend_name: for messages.
        eager_through: the runner is in eager-through mode
            (:mod:`cuda_graph_runner.runner.eager_through`): a mismatch then comes from
            the padding and static-buffer path, not from a graph, and the message says so.
    """

    def __init__(self, policy: VerifyPolicy, phase: str, backend_name: str, *, eager_through: bool = False) -> None:
        self.policy = policy
        self.phase = phase
        self.backend_name = backend_name
        self.eager_through = eager_through
        self.replays: Dict[Any, int] = {}
        #: ``(key, replay index)`` of every check made, in order (tests and logs read it).
        self.checked: List[Tuple[Any, int]] = []

    def after_replay(
        self, backend: Any, model: Any, key: Any, static_batch: Any, output: Any, eager_fn: Callable[[], Any]
    ) -> None:
        """Check ``output`` (the runner's output for the live batch) when this replay is sampled.

        Raises:
            CudaGraphVerifyError: the replay differs from the reference beyond tolerance (a
                floating-point leaf) or at all (an integer or bool leaf).
        """
        n = self.replays.get(key, 0) + 1
        self.replays[key] = n
        if not self.policy.samples(n):
            return
        got = map_tensors(
            lambda t: t.detach().clone(), output
        )  # the reference may run in the same pool; keep the replay's values
        with torch.no_grad():
            want = backend.verify_reference(eager_fn, key, static_batch)
        atol, rtol = backend.verify_tolerance(_compute_dtype(model, want))
        ok, diff, where = compare_outputs(got, want, atol, rtol)
        self.checked.append((key, n))
        if ok:
            return
        if self.eager_through:
            verdict = (
                "Eager-through mode is on: no graph was replayed (the forward ran eagerly on the padded static "
                f"batch), so the padding and static-buffer path is at fault. Usual causes: {'; '.join(PADDING_CAUSES)}."
            )
        else:
            verdict = (
                f"Usual causes: {'; '.join(CAUSES)}. To tell a graph bug from a padding bug, run again with "
                f"{envs.EAGER_THROUGH}=1 (or the config key eager_through): if verify then passes, the graph is "
                "at fault; if it still fails, the padding and static buffers are."
            )
        raise CudaGraphVerifyError(
            f"verify mode: replay {n} of shape {key} (phase {self.phase!r}, backend {self.backend_name!r}) differs "
            f"from the backend's reference on the same batch: {where}; max abs difference {diff:.6g} "
            f"(tolerance atol {atol:g}, rtol {rtol:g} for floating-point leaves; integer and bool leaves "
            f"compared exactly). {verdict}",
            phase=self.phase,
            backend=self.backend_name,
            key=key,
            max_abs_diff=diff,
            replay_index=n,
        )

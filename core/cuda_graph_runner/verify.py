"""Verify mode: compare sampled replays with a per-backend reference on the same live batch.

A graph replays what was recorded; Python that ran at capture (a branch on a host value,
data-dependent control flow), tensors allocated outside the static buffers and random
ops can make a replay differ from eager with no error. Verify mode catches that while
serving: for each shape key it checks the first ``first_n`` replays and, optionally,
every ``every``-th one after (so a branch that only flips on later, longer batches is
caught too). A check runs, after the replay, the backend's reference
(:meth:`~cuda_graph_runner.backend.BaseCudaGraphBackend.verify_reference`; eager by
default) on the same live batch and compares with the backend's tolerance
(:meth:`~cuda_graph_runner.backend.BaseCudaGraphBackend.verify_tolerance`); a mismatch
raises :class:`~cuda_graph_runner.errors.CudaGraphVerifyError`.

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
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .errors import CudaGraphVerifyError

ENV_VERIFY = "CUDA_GRAPH_RUNNER_VERIFY"
ENV_VERIFY_FIRST_N = "CUDA_GRAPH_RUNNER_VERIFY_FIRST_N"
ENV_VERIFY_EVERY = "CUDA_GRAPH_RUNNER_VERIFY_EVERY"

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")

CAUSES = (
    "model code branching on a host value of the batch (seq_lens_cpu, extra, ...) during capture "
    "(keep host_value_guard on to find it at capture)",
    "data-dependent control flow (a Python branch on a tensor value, .item(), .tolist())",
    "tensors allocated outside the static buffers and the graph (a new tensor per step that the "
    "graph does not read)",
    "random ops (dropout, sampling) whose generator state is frozen at capture",
    "a forward whose side effects are not idempotent for a repeated step (verify runs it twice)",
)

__all__ = ["CAUSES", "ENV_VERIFY", "ENV_VERIFY_EVERY", "ENV_VERIFY_FIRST_N", "VerifyPolicy", "Verifier",
           "compare_outputs", "policy_from"]


def _env_bool(name: str) -> Optional[bool]:
    # Local reader; one env-flag parser for all CUDA_GRAPH_RUNNER_* variables may replace it.
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"environment variable {name}={raw!r}: accepted: {', '.join(_TRUE)} or {', '.join(_FALSE[:-1])}")


def _env_int(name: str) -> Optional[int]:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"environment variable {name}={raw!r}: accepted: an integer >= 0")
    return value


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
        ValueError: an environment variable with a value that is not accepted (named).
    """
    enabled = bool(getattr(phase_config, "verify", False))
    env = _env_bool(ENV_VERIFY)
    if env is not None:
        enabled = env
    if not enabled:
        return None
    first_n = _env_int(ENV_VERIFY_FIRST_N)
    every = _env_int(ENV_VERIFY_EVERY)
    first_n = int(getattr(phase_config, "verify_first_n", 3)) if first_n is None else first_n
    every = int(getattr(phase_config, "verify_every", 0)) if every is None else every
    if first_n == 0 and every == 0:
        raise ValueError(f"verify mode is on but first_n=0 and every=0 (from the config or {ENV_VERIFY_FIRST_N}/"
                         f"{ENV_VERIFY_EVERY}): no replay would be checked; accepted: first_n >= 1 or every >= 1")
    return VerifyPolicy(first_n=first_n, every=every)


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def compare_outputs(got: Any, want: Any, atol: float, rtol: float) -> Tuple[bool, float, str]:
    """Compare two output structures (tensors, tuples, lists, dicts; other leaves by ``==``).

    Returns:
        ``(ok, max_abs_diff, where)``: ``where`` names the first failing leaf (``""`` if
        none); ``max_abs_diff`` is over every tensor leaf (inf for a shape or structure
        mismatch, or NaN on one side only).
    """
    worst = 0.0
    first_bad = ""

    def walk(a: Any, b: Any, path: str) -> None:
        nonlocal worst, first_bad

        def bad(why: str, diff: float = math.inf) -> None:
            nonlocal worst, first_bad
            worst = max(worst, diff)
            if not first_bad:
                first_bad = f"{path or 'output'}: {why}"

        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor) or a.shape != b.shape:
                bad(f"shape {getattr(a, 'shape', type(a).__name__)} vs reference {tuple(b.shape)}")
                return
            if a.numel() == 0:
                return
            x = a.detach().to(torch.float64).cpu()
            y = b.detach().to(torch.float64).cpu()
            both_nan = torch.isnan(x) & torch.isnan(y)
            diff = (x - y).abs().masked_fill(both_nan, 0.0).nan_to_num(nan=math.inf)
            d = float(diff.max())
            worst = max(worst, d)
            if not bool((diff <= atol + rtol * y.abs().nan_to_num(nan=0.0)).all()):
                bad(f"max abs difference {d:.6g} (atol {atol:g}, rtol {rtol:g})", d)
        elif isinstance(b, (tuple, list)):
            if not isinstance(a, (tuple, list)) or len(a) != len(b):
                bad(f"structure {type(a).__name__} vs reference {type(b).__name__} of {len(b)}")
                return
            for i, (u, v) in enumerate(zip(a, b)):
                walk(u, v, f"{path}[{i}]")
        elif isinstance(b, dict):
            if not isinstance(a, dict) or set(a) != set(b):
                bad(f"keys {sorted(map(str, a)) if isinstance(a, dict) else type(a).__name__} vs reference "
                    f"{sorted(map(str, b))}")
                return
            for k in b:
                walk(a[k], b[k], f"{path}[{k!r}]")
        elif a != b:
            bad(f"{a!r} vs reference {b!r}")

    walk(got, want, "")
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
    """

    def __init__(self, policy: VerifyPolicy, phase: str, backend_name: str) -> None:
        self.policy = policy
        self.phase = phase
        self.backend_name = backend_name
        self.replays: Dict[Any, int] = {}
        #: ``(key, replay index)`` of every check made, in order (tests and logs read it).
        self.checked: List[Tuple[Any, int]] = []

    def after_replay(self, backend: Any, model: Any, key: Any, static_batch: Any, output: Any,
                     eager_fn: Callable[[], Any]) -> None:
        """Check ``output`` (the runner's output for the live batch) when this replay is sampled.

        Raises:
            CudaGraphVerifyError: the replay differs from the reference beyond tolerance.
        """
        n = self.replays.get(key, 0) + 1
        self.replays[key] = n
        if not self.policy.samples(n):
            return
        got = _clone(output)  # the reference may run in the same pool; keep the replay's values
        with torch.no_grad():
            want = backend.verify_reference(eager_fn, key, static_batch)
        atol, rtol = backend.verify_tolerance(_compute_dtype(model, want))
        ok, diff, where = compare_outputs(got, want, atol, rtol)
        self.checked.append((key, n))
        if ok:
            return
        causes = "; ".join(CAUSES)
        raise CudaGraphVerifyError(
            f"verify mode: replay {n} of shape {key} (phase {self.phase!r}, backend {self.backend_name!r}) differs "
            f"from the backend's reference on the same batch: {where}; max abs difference {diff:.6g} "
            f"(tolerance atol {atol:g}, rtol {rtol:g}). Usual causes: {causes}.",
            phase=self.phase, backend=self.backend_name, key=key, max_abs_diff=diff, replay_index=n)

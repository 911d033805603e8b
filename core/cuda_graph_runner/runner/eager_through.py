"""Eager-through mode: every replay does what a replay does, except replaying the graph.

When a replay is wrong, the first question is whether the graph is at fault or what
surrounds it: the padding up to a captured size, the copies into the static buffers,
the static batch (its padded ``seq_lens_cpu``, its ``extra``), the variant picked, the
slicing of the outputs back to the live rows and the owned-output copies. In
eager-through mode the runner keeps all of that and only swaps the graph replay for the
forward run eagerly on the static batch (``runner.graph_forward(static_batch)`` inside
the forward context, what the graph recorded at capture). sglang's
``--debug-cuda-graph`` does the same: it runs the capture path eagerly.

With verify mode (:mod:`cuda_graph_runner.runner.verify`) on as well, each sampled replay is
compared with the eager forward of the *live* (unpadded) batch:

* it fails in eager-through mode: the padding or static-buffer path changes the result
  (an op across the batch's rows, a static input not filled, a wrong pad value); no
  graph was involved;
* it passes in eager-through mode but fails with graphs: the graph is at fault (a host
  value frozen at capture, data-dependent control flow, a tensor outside the static
  buffers, a random op).

Verify's reference must be the unpadded eager forward for the first case to show: with
``padded_eager`` on (:mod:`.padded_eager`) the reference runs padded too, so turn it off
while looking for a padding bug.

Graphs are still captured, so which batches replay, the keys, the variants and the
output layouts are exactly those of a normal run, and ``runner.describe()`` lists the
graphs; their memory stays allocated. ``forward`` counts these calls as replays. The
forward runs as written: a compiling backend's compiled code (compiled full,
``tc_piecewise``) does not run either, so a difference that only compiled numerics cause
shows as a graph-side difference.

Switches (off by default; when off a replay pays one attribute test): the phase config
key ``eager_through`` (bool) and the environment variable
``CUDA_GRAPH_RUNNER_EAGER_THROUGH`` (``1``/``true``/``yes``/``on`` or
``0``/``false``/``no``/``off``), which overrides the config for both phases.
"""

from __future__ import annotations

from typing import Any

from ..backend import envs

ENV_EAGER_THROUGH = envs.EAGER_THROUGH

__all__ = ["ENV_EAGER_THROUGH", "eager_through_enabled"]


def eager_through_enabled(phase_config: Any) -> bool:
    """Whether a phase runs eager-through: its ``eager_through`` key, overridden by
    ``CUDA_GRAPH_RUNNER_EAGER_THROUGH`` when set.

    Raises:
        cuda_graph_runner.backend.envs.EnvVarError: (a ``ValueError``) the variable holds a value
            that is not a boolean (named, with what is accepted).
    """
    env = envs.get(ENV_EAGER_THROUGH)
    if env is not None:
        return bool(env)
    return bool(getattr(phase_config, "eager_through", False))

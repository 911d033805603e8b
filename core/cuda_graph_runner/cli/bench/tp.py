"""``bench --tp N`` / ``bench --dp N``: the bench run tensor- or data-parallel, one process
per rank under ``torchrun``.

With ``--dp N`` every rank loads the reference model's data-parallel layout
(:class:`~cuda_graph_runner.runner.dp_group.DPGroup`) and runs the same batches; each step
the runners still agree on the live sizes (one host all-reduce) and pad to the largest.

``torchrun --nproc-per-node 2 -m cuda_graph_runner bench --tp 2`` starts two ranks; each
joins the process group (:func:`cuda_graph_runner.runner.distributed.init_tensor_parallel`),
loads its shard of the model, captures and times the same batches in step (the
runners agree on every decision), and only rank 0 prints. Every rank then ends in
bounded time: :func:`~cuda_graph_runner.runner.distributed.shutdown` with a timeout, then
:func:`~cuda_graph_runner.runner.distributed.exit_now` (a teardown that hangs after a
successful NCCL run must not hang the command).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from ...backend import envs

#: Seconds the process-group teardown may take before the rank exits anyway.
TEARDOWN_TIMEOUT_S = 30.0


def setup(args: argparse.Namespace) -> Optional[Any]:
    """Join the TP group when ``--tp`` > 1, the DP group when ``--dp`` > 1; returns the
    :class:`TPGroup` or :class:`~cuda_graph_runner.runner.dp_group.DPGroup` (None for one
    process).

    Sets ``args.device`` to the rank's device; ranks other than 0 print nothing to
    stdout (stderr stays: their errors show).

    Raises:
        ValueError: ``--tp`` or ``--dp`` is not positive, both are above 1, the world
            size differs, or the device does not fit (the message names the values).
    """
    sizes = {flag: getattr(args, flag, None) or 1 for flag in ("tp", "dp")}
    for flag, size in sizes.items():
        if size < 1:
            raise ValueError(f"--{flag} {size}: must be a positive int")
    if sizes["tp"] > 1 and sizes["dp"] > 1:
        raise ValueError(
            f"--tp {sizes['tp']} with --dp {sizes['dp']}: data parallelism with tensor parallelism is not supported"
        )
    flag = "dp" if sizes["dp"] > 1 else "tp"
    tp_size = sizes[flag]
    if tp_size == 1:
        return None
    if not envs.launched_by_torch_distributed():
        raise ValueError(
            f"--{flag} {tp_size} needs one process per rank: run "
            f"torchrun --nproc-per-node {tp_size} -m cuda_graph_runner bench --{flag} {tp_size}"
        )
    from ...runner.distributed import init_tensor_parallel
    from ...runner.dp_group import init_data_parallel

    device_type = None
    if args.device:
        device_type = args.device.split(":")[0]
    init = init_data_parallel if flag == "dp" else init_tensor_parallel
    tp = init(tp_size, device_type=device_type)
    args.device = str(tp.device)
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return tp


def finish(tp: Optional[Any], code: int) -> int:
    """End a TP run in bounded time (never returns when ``tp`` is set); ``code`` otherwise."""
    if tp is None:
        return code
    from ...runner.distributed import exit_now, shutdown

    if not shutdown(TEARDOWN_TIMEOUT_S):
        print(
            f"rank {tp.rank}: process-group teardown passed {TEARDOWN_TIMEOUT_S:.0f} s; exiting anyway", file=sys.stderr
        )
    exit_now(code)
    return code  # unreachable

"""``bench --tp N``: the bench run tensor-parallel, one process per rank under ``torchrun``.

``torchrun --nproc-per-node 2 -m cuda_graph_runner bench --tp 2`` starts two ranks; each
joins the process group (:func:`cuda_graph_runner.distributed.init_tensor_parallel`),
loads its shard of the model, captures and times the same batches in step (the
runners agree on every decision), and only rank 0 prints. Every rank then ends in
bounded time: :func:`~cuda_graph_runner.distributed.shutdown` with a timeout, then
:func:`~cuda_graph_runner.distributed.exit_now` (a teardown that hangs after a
successful NCCL run must not hang the command).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Optional

from . import envs

#: Seconds the process-group teardown may take before the rank exits anyway.
TEARDOWN_TIMEOUT_S = 30.0


def setup(args: argparse.Namespace) -> Optional[Any]:
    """Join the TP group when ``--tp`` > 1; returns the :class:`TPGroup` (None for one process).

    Sets ``args.device`` to the rank's device; ranks other than 0 print nothing to
    stdout (stderr stays: their errors show).

    Raises:
        ValueError: ``--tp`` is not positive, the world size differs from it, or the
            device does not fit (the message names the values).
    """
    tp_size = getattr(args, "tp", None)
    tp_size = 1 if tp_size is None else tp_size
    if tp_size < 1:
        raise ValueError(f"--tp {tp_size}: must be a positive int")
    if tp_size == 1:
        return None
    if not envs.launched_by_torch_distributed():
        raise ValueError(
            f"--tp {tp_size} needs one process per rank: run "
            f"torchrun --nproc-per-node {tp_size} -m cuda_graph_runner bench --tp {tp_size}"
        )
    from .distributed import init_tensor_parallel

    device_type = None
    if args.device:
        device_type = args.device.split(":")[0]
    tp = init_tensor_parallel(tp_size, device_type=device_type)
    args.device = str(tp.device)
    if tp.rank != 0:
        sys.stdout = open(os.devnull, "w")
    return tp


def finish(tp: Optional[Any], code: int) -> int:
    """End a TP run in bounded time (never returns when ``tp`` is set); ``code`` otherwise."""
    if tp is None:
        return code
    from .distributed import exit_now, shutdown

    if not shutdown(TEARDOWN_TIMEOUT_S):
        print(
            f"rank {tp.rank}: process-group teardown passed {TEARDOWN_TIMEOUT_S:.0f} s; exiting anyway", file=sys.stderr
        )
    exit_now(code)
    return code  # unreachable

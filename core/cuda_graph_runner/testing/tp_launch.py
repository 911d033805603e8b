"""Run a function on N ranks of a tensor-parallel group, in bounded time (tests, checks).

:func:`run_ranks` spawns ``world_size`` processes with torchrun's environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``), so each calls
:func:`cuda_graph_runner.runner.distributed.init_tensor_parallel` exactly as under ``torchrun``;
each rank returns a picklable value, and the parent gets them in rank order. Every rank
ends through :func:`~cuda_graph_runner.runner.distributed.shutdown` (bounded) and
:func:`~cuda_graph_runner.runner.distributed.exit_now` (no exit hook can hang), and the parent
kills whatever is still alive at the deadline: a hung collective or teardown fails the
call, it never hangs it.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable, List, Sequence

from ..config.exceptions import CudaGraphRunnerError


class RankFailure(CudaGraphRunnerError, RuntimeError):
    """A rank raised, died or ran past the deadline (the message holds each rank's story)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    device_type: str,
    group_timeout_s: float,
    args: Sequence[Any],
    results: Any,
) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    code = 0
    try:
        from ..runner.distributed import init_tensor_parallel, shutdown

        tp = init_tensor_parallel(world_size, device_type=device_type, timeout_s=group_timeout_s)
        try:
            # Plain pickle, by value: torch's queue pickler would share tensors through
            # file descriptors that die with this process.
            value = pickle.dumps(fn(tp, *args))
            results.put((rank, True, value))
        finally:
            shutdown(timeout_s=20.0)
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        code = 1
    results.close()
    results.join_thread()  # the value is in the pipe before the process ends
    from ..runner.distributed import exit_now

    exit_now(code)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    device_type: str = "cpu",
    timeout_s: float = 240.0,
    group_timeout_s: float = 120.0,
) -> List[Any]:
    """Call ``fn(tp_group, *args)`` on ``world_size`` spawned ranks; return their values.

    Args:
        fn: a module-level (picklable) function; its return value must pickle.
        world_size: the TP size.
        device_type: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, rank ``r`` on ``cuda:r``).
        timeout_s: the deadline of the whole call, in seconds.
        group_timeout_s: seconds a collective may block before the process group gives
            up (``init_tensor_parallel``'s ``timeout_s``); tests of failures set it short.

    Returns:
        ``[value of rank 0, value of rank 1, ...]``.

    Raises:
        RankFailure: a rank raised (its traceback is in the message), exited without a
            value, or the deadline passed (every remaining rank is killed first).
    """
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child, args=(fn, r, world_size, port, device_type, group_timeout_s, args, results), daemon=True
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    got: dict = {}
    try:
        while len(got) < world_size and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.5)
                got[rank] = (ok, value)
            except queue_mod.Empty:
                if all(not p.is_alive() for p in procs):
                    try:  # a last value may still be in the pipe
                        rank, ok, value = results.get(timeout=1.0)
                        got[rank] = (ok, value)
                        continue
                    except queue_mod.Empty:
                        break
        for p in procs:
            p.join(timeout=max(0.0, min(10.0, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
    problems = []
    for r in range(world_size):
        if r not in got:
            problems.append(f"rank {r}: no result (exit code {procs[r].exitcode}; deadline {timeout_s:.0f} s)")
        elif not got[r][0]:
            problems.append(f"rank {r} raised:\n{got[r][1]}")
    if problems:
        raise RankFailure("\n".join(problems))
    return [pickle.loads(got[r][1]) for r in range(world_size)]

"""The intra-op thread count ``cuda-graph-runner bench`` times a CPU with.

Why the bench picks it: torch runs each op of a step as an OpenMP parallel region, and a
region ends only when all its threads have; when another process (a compile worker, a
test, another user) holds one of the CPUs, a thread of every region waits for a
scheduler time slice. With torch's default of one thread per core that is every core:
on a 2-core machine shared with other work, a ``tiny`` decode step (batch 2, eager)
took 81 ms in the median round with two threads (1.6 ms at best) and 3.3 ms with one
(0.7 ms at best), blocks interleaved in one process: timings 50x apart from run to run.
With at most half the CPUs a region's threads find a free CPU more often, and one
thread (a 2-core machine) has no region to wait on; a small model's step loses nothing
by it.

The choice is the same in every start on a machine (it depends on the CPUs this process
may run on, not on the load), so a run's numbers compare with the last one's; the
compile cache serves any count (:mod:`cuda_graph_runner.backend.compile_cache`).
"""

from __future__ import annotations

import os
from typing import Mapping, Optional, Tuple

#: Environment variables that set torch's intra-op threads at start; a user who set one
#: chose the count, and the bench keeps it.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the platform has one)."""
    affinity = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity else (os.cpu_count() or 1)


def default_threads(cpus: int) -> int:
    """Half of ``cpus`` (rounded down), at least one: 1 on a 2-core machine, 8 on 16."""
    return max(1, cpus // 2)


def choose_threads(
    requested: Optional[int],
    *,
    current: int,
    cpus: Optional[int] = None,
    environ: Optional[Mapping[str, str]] = None,
) -> Tuple[int, str]:
    """``(threads, why)``: the intra-op thread count the bench runs with and the words
    saying where it came from.

    Args:
        requested: ``--threads N`` (wins), or None.
        current: ``torch.get_num_threads()`` now (kept when a variable of
            :data:`THREAD_VARIABLES` set it).
        cpus: the CPUs this process may run on (default :func:`usable_cpus`).
        environ: the environment (default ``os.environ``).

    Raises:
        ValueError: ``requested`` below 1.
    """
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads {requested}: accepted: an integer >= 1")
        return requested, "--threads"
    environ = os.environ if environ is None else environ
    for name in THREAD_VARIABLES:
        if environ.get(name, "").strip():
            return current, name
    cpus = usable_cpus() if cpus is None else cpus
    return default_threads(cpus), f"the bench's default on a CPU, half of {cpus} CPUs; --threads N changes it"

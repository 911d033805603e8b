"""torch.compile's caches kept under this project's cache root, across processes.

A second start of the same model compiles from disk instead of from scratch: inductor's
FX graph cache (the generated code of each graph, keyed by the graph, its inputs' shapes
and the inductor config) and AOTAutograd's cache (the traced forward) are both stored
under ``torch._inductor``'s cache folder (PyTorch "Compile Time Caching in torch.compile"
recipe). Dynamo still traces every start; what the cache saves is lowering and code
generation, most of a compile (inductor's C++ builds on the CPU, Triton on CUDA).

:func:`compile_cache_scope` points that folder at ``<cache root>/compile/torch-<version>``
(:func:`cuda_graph_runner.envs.cache_root`) for the compile calls inside it, and turns both
caches on; backends wrap their compile calls in it (``compiled``, ``tc_piecewise`` with
``inductor``). Outside the scope torch's own folder and settings apply, so other
torch.compile users in the process are untouched. ``CUDA_GRAPH_RUNNER_COMPILE_CACHE=0``
makes the scope a no-op (torch's defaults then decide).

:func:`cache_counters` reads torch's hit/miss counters, which tests compare across two
compiles (a second start compiles from the cache: hits, no misses).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

from . import envs


def compile_cache_dir(environ: Optional[Dict[str, str]] = None, rank: Optional[int] = None) -> str:
    """``<cache root>/compile/torch-<version>[/rank_<rank>]``: one folder per torch version
    (entries of another version never match, and would only take space) and, under
    tensor parallelism, per rank (ranks compiling at once never share entries; vLLM keeps
    a ``rank_<i>`` folder likewise). ``rank`` None: this process's rank when a process
    group of more than one rank is initialized, else no rank folder."""
    import torch

    version = torch.__version__.replace("+", "_")
    folder = os.path.join(envs.cache_root(environ), "compile", f"torch-{version}")
    if rank is None:
        rank = _process_group_rank()
    return folder if rank is None else os.path.join(folder, f"rank_{rank}")


def _process_group_rank() -> Optional[int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank()
    return None


@contextlib.contextmanager
def compile_cache_scope() -> Iterator[Optional[str]]:
    """Within the block, torch.compile reads and writes its caches under
    :func:`compile_cache_dir` (yielded), with the FX graph and AOTAutograd caches on.
    Yields None and changes nothing when ``CUDA_GRAPH_RUNNER_COMPILE_CACHE`` is off.

    Raises:
        cuda_graph_runner.envs.EnvVarError: a malformed ``CUDA_GRAPH_RUNNER_COMPILE_CACHE``.
        OSError: the folder cannot be created (names it).
    """
    if not envs.get(envs.COMPILE_CACHE):
        yield None
        return
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    folder = compile_cache_dir()
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise OSError(
            f"compile cache folder {folder!r} cannot be created ({exc}); set {envs.CACHE_DIR} to a writable "
            f"folder or {envs.COMPILE_CACHE}=0"
        ) from exc
    patches = {"fx_graph_cache": True}
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(patches))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch({"enable_autograd_cache": True}))
        stack.enter_context(temporary_cache_dir(folder))
        yield folder


def cache_counters() -> Dict[str, int]:
    """``{"fx_hit", "fx_miss", "aot_hit", "aot_miss"}``: torch's counters of FX graph cache
    and AOTAutograd cache lookups in this process so far (``torch._dynamo.utils.counters``)."""
    from torch._dynamo.utils import counters

    return {
        "fx_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }

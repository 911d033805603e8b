"""torch.compile's caches kept under this project's cache root, across processes.

A second start of the same model compiles from disk instead of from scratch: inductor's
FX graph cache (the generated code of each graph, keyed by the graph, its inputs' shapes
and the inductor config) and AOTAutograd's cache (the traced forward) are both stored
under ``torch._inductor``'s cache folder (PyTorch "Compile Time Caching in torch.compile"
recipe): lowering and code generation, most of a cold compile (inductor's C++ builds on
the CPU, Triton on CUDA). Given a :func:`compile_key`, the scope keeps Dynamo's traced
code as well (:mod:`.compile_cache_dynamo`), and a second start does not trace either.

:func:`compile_cache_scope` points that folder at ``<cache root>/compile/torch-<version>``
(:func:`cuda_graph_runner.backend.envs.cache_root`) for the compile calls inside it, and turns both
caches on, with inductor's CPU kernels reading the intra-op thread count at run time
(``cpp.dynamic_threads``) so that an entry serves every thread count; backends wrap
their compile calls in it (compiled ``full`` with a key; ``compiled`` without one: its replay runs below autograd, which a loaded trace's guards
refuse; ``tc_piecewise`` with ``inductor`` without one: its Dynamo backend splits the
graph and is not serializable). Outside the scope torch's own folder and settings apply,
so other torch.compile users in the process are untouched.
``CUDA_GRAPH_RUNNER_COMPILE_CACHE=0`` makes the scope a no-op (torch's defaults then
decide); ``CUDA_GRAPH_RUNNER_COMPILE_CACHE_DYNAMO=0`` keeps the inductor caches only.

:func:`cache_counters` reads torch's hit/miss counters, which tests compare across two
compiles (a second start compiles from the cache: hits, no misses).
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict, Iterator, Optional

from . import envs
from .compile_cache_dynamo import compile_key, dynamo_cache_scope
from .compile_cache_dynamo import counters as _dynamo_counters
from .errors import CompileCacheError

__all__ = ["cache_counters", "compile_cache_dir", "compile_cache_scope", "compile_key"]


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
def compile_cache_scope(key: Optional[str] = None) -> Iterator[Optional[str]]:
    """Within the block, torch.compile reads and writes its caches under
    :func:`compile_cache_dir` (yielded), with the FX graph and AOTAutograd caches on.
    Yields None and changes nothing when ``CUDA_GRAPH_RUNNER_COMPILE_CACHE`` is off.

    Args:
        key: :func:`compile_key` of the model and compile options: Dynamo's traced code
            is kept too, under that key (:mod:`.compile_cache_dynamo`), unless
            ``CUDA_GRAPH_RUNNER_COMPILE_CACHE_DYNAMO`` is off. Then ``torch.compile``
            must be called inside the block, not only the compiled function. None: the
            inductor caches only (Dynamo traces every start).

    Raises:
        cuda_graph_runner.backend.envs.EnvVarError: a malformed ``CUDA_GRAPH_RUNNER_COMPILE_CACHE``.
        cuda_graph_runner.backend.errors.CompileCacheError: the folder cannot be created (names
            it; an ``OSError``).
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
        raise CompileCacheError(
            f"compile cache folder {folder!r} cannot be created ({exc}); set {envs.CACHE_DIR} to a writable "
            f"folder or {envs.COMPILE_CACHE}=0"
        ) from exc
    # The thread count a process runs with is no part of what it compiled: C++ kernels
    # that read it at run time serve a start with another count (the bench picks its own
    # on a CPU) from the same entry, where torch 2.13 keys entries by it (a second start
    # compiled again) and 2.11 reuses an entry with the first start's count built in.
    # vLLM's CPU platform sets the same (TORCHINDUCTOR_CPP_DYNAMIC_THREADS=1, vllm/platforms/cpu.py).
    patches = {"fx_graph_cache": True, "cpp.dynamic_threads": True}
    with contextlib.ExitStack() as stack:
        stack.enter_context(inductor_config.patch(patches))
        if hasattr(functorch_config, "enable_autograd_cache"):
            stack.enter_context(functorch_config.patch({"enable_autograd_cache": True}))
        stack.enter_context(temporary_cache_dir(folder))
        if key is not None and envs.get(envs.COMPILE_CACHE_DYNAMO):
            stack.enter_context(dynamo_cache_scope(folder, key))
        yield folder


def cache_counters() -> Dict[str, int]:
    """``{"fx_hit", "fx_miss", "aot_hit", "aot_miss", "dynamo_hit", "dynamo_miss",
    "dynamo_error"}``: torch's counters of FX graph cache, AOTAutograd cache and Dynamo
    package cache lookups in this process so far (``torch._dynamo.utils.counters``). A
    Dynamo hit loads the compiled code with it: no FX or AOTAutograd lookup follows."""
    from torch._dynamo.utils import counters

    return {
        **_dynamo_counters(),
        "fx_hit": int(counters["inductor"]["fxgraph_cache_hit"]),
        "fx_miss": int(counters["inductor"]["fxgraph_cache_miss"]),
        "aot_hit": int(counters["aot_autograd"]["autograd_cache_hit"]),
        "aot_miss": int(counters["aot_autograd"]["autograd_cache_miss"]),
    }

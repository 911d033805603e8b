"""Dynamo's traced code kept on disk, so a second start does not trace again.

The inductor and AOTAutograd caches (:mod:`cuda_graph_runner.backend.compile_cache`) save the
lowering and code generation of a compile, but Dynamo still traces the forward at every
start: on the ``tiny`` preset on the CPU about 2 of the 5 seconds a warm start compiles.
PyTorch's *caching precompile* (``torch._dynamo.config.caching_precompile``, in torch
2.11 and 2.13 alike; vLLM's ``VLLM_USE_AOT_COMPILE`` and ``torch.compiler``'s
``aot_compile`` are the explicit variant of the same packages) records, per compiled
function, the bytecode Dynamo made, its guards and the compiled backend, and
``torch.compile(fn)`` loads them back when it wraps ``fn``.

Why a key of our own: torch files a package under the function's qualified name and
first line only, and drops the guards it cannot serialize (``ID_MATCH``,
``CLOSURE_MATCH``: which model's ``forward`` the entry wraps, which module objects it
read). Tensor guards (shapes, dtypes, devices, strides), constant guards and the global
state (grad mode, autocast) stay, and torch refuses a package when the source of any
traced function changed. What the dropped guards covered is in :func:`compile_key` instead
(the model's class, config, parameter and buffer layout, the compile options, the
device), and every key gets a folder of its own, so a package is only ever loaded for
the model and options it was traced for. Torch's version is in the folder above
(:func:`cuda_graph_runner.backend.compile_cache.compile_cache_dir`).

A loaded package's guards were saved without the dim marks of ``mark_dynamic`` (torch
2.13: "present on runtime tensor but absent at compile time"), so a caller that marks
its inputs dynamic before the first call must not mark them once the package loaded
(compiled ``full`` checks :func:`counters`' ``dynamo_hit`` around ``torch.compile``);
unmarked inputs pass the guard in either case.

A compile whose guard state cannot be saved (guards that read an object pickle refuses, as
FlashInfer's TVM-FFI functions hanging off the attention backend, or a guard kind torch does
not serialize, as ``MODULE_MATCH``) is left out of the package and traces again at the next
start instead of failing the compile. This holds for the whole process once a scope has
been entered (torch's ``CheckFunctionManager.serialize_guards`` stays wrapped): a function
compiled in a scope keeps its package, and its later compiles run outside any scope. The
wrapper acts only where torch's own would fail; ``torch._dynamo.config.strict_precompile``
still raises.

Torch without these internals (an older or newer release that moved them): the scope
logs once that Dynamo traces every start and the inductor caches still apply.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import platform
import random
import sys
from typing import Any, Iterator, Optional

logger = logging.getLogger(__name__)

_said: set = set()


def _say_once(level: int, message: str, *args: Any) -> None:
    if message not in _said:
        _said.add(message)
        logger.log(level, message, *args)


def compile_key(model: Any, *parts: Any) -> str:
    """A 24-hex-digit digest of what a traced forward depends on beyond the guards torch
    keeps with a precompiled package: ``model``'s class (module and qualified name), its
    ``config`` (``repr``), the name, shape, dtype, device and ``requires_grad`` of every
    parameter and buffer, the device's name and capability (CUDA), the Python version,
    and ``parts`` (the caller's compile options, by ``repr``: backend, inductor options,
    size, ...). ``repr`` of the parts must be stable across processes (no object ids).

    Args:
        model: an ``nn.Module`` (anything with ``named_parameters`` / ``named_buffers``).
        parts: the compile call's own options.
    """
    h = hashlib.sha256()

    def add(value: Any) -> None:
        h.update(repr(value).encode())
        h.update(b"\0")

    cls = type(model)
    add((cls.__module__, cls.__qualname__, sys.version_info[:3], platform.machine()))
    add(getattr(model, "config", None))
    devices = set()
    for getter in ("named_parameters", "named_buffers"):
        for name, t in getattr(model, getter, lambda: [])():
            add((name, tuple(t.shape), str(t.dtype), str(t.device), bool(t.requires_grad)))
            devices.add(t.device)
    for device in sorted(devices, key=str):
        if device.type == "cuda":
            import torch

            add((torch.cuda.get_device_name(device), torch.cuda.get_device_capability(device), torch.version.cuda))
    for part in parts:
        add(part)
    return h.hexdigest()[:24]


def supported() -> Optional[str]:
    """None when this torch has caching precompile's internals, else why not."""
    try:
        import torch._dynamo.config as dynamo_config
        from torch._dynamo.package import DynamoCache
        from torch._dynamo.precompile_context import PrecompileContext
    except ImportError as exc:
        return f"torch has no Dynamo package cache ({exc})"
    if not hasattr(dynamo_config, "caching_precompile"):
        return "torch._dynamo.config has no caching_precompile"
    if not callable(getattr(DynamoCache, "path_prefix", None)):
        return "torch._dynamo.package.DynamoCache has no path_prefix"
    for name in ("save_to_dynamo_cache", "clear"):
        if not callable(getattr(PrecompileContext, name, None)):
            return f"torch._dynamo.precompile_context.PrecompileContext has no {name}"
    import torch._dynamo.bytecode_transformation as bytecode_transformation

    if not isinstance(getattr(bytecode_transformation, "_unique_id_counter", None), itertools.count):
        return "torch._dynamo.bytecode_transformation has no _unique_id_counter"
    return None


def _skip_loaded_global_names() -> None:
    # A loaded package installs the globals its bytecode names (``__builtins_dict___0``,
    # ...) into the function's module; the process that traced numbered them with
    # Dynamo's process-wide counter, which starts at 0 in this process too, so a trace
    # after a guard miss would pick a loaded name and fail ("Name ... already exists in
    # scope", torch 2.11 and 2.13); and a package saved again holds names of several
    # processes. The counter only has to be unique: start it at a random point of a
    # range no process counts up to.
    import torch._dynamo.bytecode_transformation as bytecode_transformation

    start = next(bytecode_transformation._unique_id_counter) + random.SystemRandom().randrange(10**9, 10**15)
    bytecode_transformation._unique_id_counter = itertools.count(start)


def counters() -> dict:
    """``{"dynamo_hit", "dynamo_miss", "dynamo_error"}``: torch's Dynamo package cache
    lookups in this process so far (``torch._dynamo.utils.counters["dynamo_cache"]``)."""
    from torch._dynamo.utils import counters as torch_counters

    c = torch_counters["dynamo_cache"]
    return {
        "dynamo_hit": int(c["dynamo_cache_hit"]),
        "dynamo_miss": int(c["dynamo_cache_miss"]),
        "dynamo_error": int(c["dynamo_cache_error"]),
    }


@contextlib.contextmanager
def dynamo_cache_scope(folder: str, key: str) -> Iterator[Optional[str]]:
    """Within the block, ``torch.compile(fn)`` loads ``fn``'s package from
    ``<folder>/dynamo/<key>`` (yielded) when there is one, and what Dynamo compiles is
    recorded; a block that ends without an exception writes it there. Yields None and
    changes nothing where torch lacks the feature, or has its caches disabled.

    ``torch.compile`` must be *called* inside the block (that is when it looks up the
    package), and the compiled function's first calls too (that is when Dynamo records).

    Errors of torch while saving are logged (the compile itself succeeded) and the next
    start traces again; a package torch cannot load is a miss (torch logs it).
    """
    why = supported()
    if why is None:
        import torch._inductor.config as inductor_config

        if inductor_config.force_disable_caches:
            why = "torch._inductor.config.force_disable_caches is set"
    if why is not None:
        _say_once(logging.INFO, "compile cache: Dynamo traces every start (%s); inductor's caches still apply", why)
        yield None
        return
    import torch._dynamo.config as dynamo_config
    from torch._dynamo.package import DynamoCache
    from torch._dynamo.precompile_context import PrecompileContext

    path = os.path.join(folder, "dynamo", key)
    _say_once(logging.INFO, "compile cache: Dynamo's traced code kept too (torch caching precompile)")
    # Entries recorded outside this block (another key, an unscoped compile) must never
    # be written under this key: torch saves everything the context holds.
    PrecompileContext.clear()
    _skip_loaded_global_names()
    _install_guard_state_bypass()
    try:
        with (
            dynamo_config.patch(caching_precompile=True),
            _path_prefix(DynamoCache, path),
            _quiet_dropped_guards(),
        ):
            yield path
            try:
                PrecompileContext.save_to_dynamo_cache()
            except Exception as exc:  # noqa: BLE001 - a cache write never fails a compile that worked
                logger.warning(
                    "compile cache: Dynamo's package not saved under %s (%s: %s)", path, type(exc).__name__, exc
                )
    finally:
        PrecompileContext.clear()


@contextlib.contextmanager
def precompile_paused() -> Iterator[None]:
    """Inside a :func:`dynamo_cache_scope`, a block whose ``torch.compile`` wrappers and
    compiles Dynamo neither loads from nor records into the package.

    For functions torch cannot file under a qualified name: a marked op's body is one
    (its module attribute is the :class:`~cuda_graph_runner.backend.graph_break.EagerOp`, not the
    function, and torch refuses to save a package holding its code: ``PackageError``).
    Such functions trace again at every start; inductor's caches still serve them. No
    effect outside a scope, or where torch lacks the feature. The setting is Dynamo's
    process-wide config: not for blocks running in several threads at once."""
    if not _precompile_on():
        yield
        return
    import torch._dynamo.config as dynamo_config

    with dynamo_config.patch(caching_precompile=False):
        yield


def _precompile_on() -> bool:
    import torch._dynamo.config as dynamo_config

    return bool(getattr(dynamo_config, "caching_precompile", False))


@contextlib.contextmanager
def _path_prefix(cache: Any, path: str) -> Iterator[None]:
    # torch's DiskDynamoCache puts packages under <inductor cache dir>/dynamo/<qualname hash>;
    # an instance attribute shadows that method for the block (the instance is the one
    # both eval_frame and precompile_context use).
    had = "path_prefix" in vars(cache)
    previous = vars(cache).get("path_prefix")
    cache.path_prefix = lambda: path
    try:
        yield
    finally:
        if had:
            cache.path_prefix = previous
        else:
            del cache.path_prefix


def _install_guard_state_bypass() -> None:
    # torch pickles what a compile's guards read (the model and the objects hanging off it)
    # into the package. An object whose pickling raises (FlashInfer's TVM-FFI functions
    # raise TypeError) fails the compile itself, and torch's own bypass for a guard it
    # cannot serialize (a PackageError, e.g. "MODULE_MATCH guard cannot be serialized")
    # leaves the guard state None, which then trips an assertion in the same compile
    # (torch 2.11 and 2.13). Here either failure bypasses that compile's package entry
    # (torch's ``bypass_package``: nothing of it is saved, it traces again at the next
    # start) and the compile goes on with an empty guard state, which only the package
    # reads. ``strict_precompile`` (torch's switch for failing instead) still raises.
    # Installed for the process at the first scope, not for the block: a function compiled
    # in a scope keeps its package, and its later compiles (a verify reference, an eager
    # step at a size not compiled yet) run outside any scope.
    global _bypass_installed
    if _bypass_installed:
        return
    try:
        from torch._dynamo.guards import CheckFunctionManager
    except ImportError:
        return
    original = vars(CheckFunctionManager).get("serialize_guards")
    if original is None:
        return

    def serialize_or_bypass(self: Any, builder: Any, sorted_guards: Any, output_graph: Any) -> Any:
        try:
            return original(self, builder, sorted_guards, output_graph)
        except Exception as exc:
            bypass = getattr(output_graph, "bypass_package", None)
            if bypass is None or _strict_precompile():
                raise
            _say_once(
                logging.INFO,
                "compile cache: a compile's guard state cannot be saved (%s: %s); "
                "that compile's Dynamo code is not kept and traces again at the next start",
                type(exc).__name__,
                exc,
            )
            bypass(f"guard state not saved: {type(exc).__name__}: {exc}")
            return b""

    serialize_or_bypass.__wrapped__ = original  # type: ignore[attr-defined]
    CheckFunctionManager.serialize_guards = serialize_or_bypass  # type: ignore[method-assign]
    # torch warns of the bypass too; the line above already said it
    logging.getLogger("torch._dynamo.output_graph").addFilter(_OurBypassFilter())
    _bypass_installed = True


_bypass_installed = False


def _strict_precompile() -> bool:
    import torch._dynamo.config

    return bool(getattr(torch._dynamo.config, "strict_precompile", False))


class _OurBypassFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "guard state not saved" not in record.getMessage()


class _DroppedGuardFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "dropped with caching_precompile" not in str(record.msg)


@contextlib.contextmanager
def _quiet_dropped_guards() -> Iterator[None]:
    # torch warns once per guard it does not serialize (dozens per compile); the module
    # docstring says what covers them (the key), so they are no news to the user.
    guards_logger = logging.getLogger("torch._dynamo.guards")
    quiet = _DroppedGuardFilter()
    guards_logger.addFilter(quiet)
    try:
        yield
    finally:
        guards_logger.removeFilter(quiet)

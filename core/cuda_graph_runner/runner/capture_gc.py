"""``freeze_gc``: the garbage collector kept off the heap while graphs are captured."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def freeze_gc(enable_cudagraph_gc: bool = False, *, collect: bool = True) -> Iterator[None]:
    """Collect once, then keep the collector off the heap for the capture (sglang's ``freeze_gc``).

    A collection during capture walks every live object between kernel launches and
    can free tensors whose memory a graph is recording; freezing moves the survivors
    out of the collector's reach. ``enable_cudagraph_gc=True`` opts out.

    What the caller froze stays frozen: ``gc.unfreeze()`` thaws *every* frozen object
    and Python cannot thaw only some, so when objects are already frozen on entry
    (``gc.get_freeze_count() > 0``, e.g. an application's pre-fork ``gc.freeze()``)
    automatic collection is switched off for the block instead (``gc.disable()``, then
    the previous ``gc.isenabled()`` state is restored) and nothing is frozen or thawed:
    ``gc.get_freeze_count()`` never grows and falls only as frozen objects are freed.

    ``collect=False`` skips the full collections on entry and exit (a capture step between
    serving steps, :mod:`.lazy_capture`: a full collection of a server's heap costs
    tens to hundreds of ms each time); the heap is frozen all the same.
    """
    if collect:
        gc.collect()
    if enable_cudagraph_gc:
        yield
        return
    frozen_before = gc.get_freeze_count()
    was_enabled = gc.isenabled()
    if frozen_before:
        gc.disable()
    else:
        gc.freeze()
    try:
        yield
    finally:
        if frozen_before:
            if was_enabled:
                gc.enable()
        else:
            gc.unfreeze()  # only what this block froze: nothing was frozen before it
        if collect:
            gc.collect()

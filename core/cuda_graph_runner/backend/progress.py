"""Progress display of the long steps (a backend's compile/prepare, capture of each size).

Shown on terminals only (stderr is a TTY, or ``show=True``); logs and pipes get nothing
but the log records, nor the bars of a library a step calls (:func:`library_bars`). A finished step leaves one summary line instead of a bar, e.g.
``captured 36 decode graphs (full) in 3.75 s``, so a terminal stays readable. Bars are
tqdm's (``tqdm.auto``).
"""

from __future__ import annotations

import contextlib
import sys
import time
from typing import Any, Iterable, Iterator, Optional, TypeVar

T = TypeVar("T")
#: A step shorter than this leaves no summary line.
QUIET_BELOW_S = 0.5


def progress_enabled(show: Optional[bool]) -> bool:
    """``show`` when given, else whether stderr is a terminal."""
    if show is not None:
        return bool(show)
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


@contextlib.contextmanager
def library_bars(show: Optional[bool]) -> Iterator[None]:
    """While the block runs, every tqdm bar another library draws (transformers' GGUF
    conversion uses ``tqdm.auto`` directly, so its own switch
    ``transformers.utils.logging.disable_progress_bar`` misses it) is off unless
    :func:`progress_enabled`: nothing drawn into a pipe or a log file.

    tqdm reads its ``TQDM_DISABLE`` variable once, at import, so the block sets the
    ``disable`` argument of every bar created in it instead (``tqdm.std.tqdm``, the base
    class of ``tqdm.auto``'s). Not thread-safe: meant for the one-off steps of a command.
    """
    if progress_enabled(show):
        yield
        return
    try:
        from tqdm import std
    except ImportError:  # no tqdm: nobody draws its bars
        yield
        return
    original = std.tqdm.__init__

    def quiet_init(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["disable"] = True
        original(self, *args, **kwargs)

    std.tqdm.__init__ = quiet_init
    try:
        yield
    finally:
        std.tqdm.__init__ = original


def _summary(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextlib.contextmanager
def step(desc: str, done: str, show: Optional[bool]) -> Iterator[None]:
    """A step of unknown length (compile, prepare): ``desc ...`` while it runs, then
    ``done in S s`` when it took :data:`QUIET_BELOW_S` or more (shown only when
    :func:`progress_enabled`)."""
    enabled = progress_enabled(show)
    if enabled:
        print(f"{desc} ...", end="\r", file=sys.stderr, flush=True)
    start = time.perf_counter()
    try:
        yield
    except BaseException:
        if enabled:  # the error's message starts on a clean line, not after "desc ..."
            print(" " * (len(desc) + 4), end="\r", file=sys.stderr, flush=True)
        raise
    if enabled:
        seconds = time.perf_counter() - start
        if seconds < QUIET_BELOW_S:  # a no-op prepare leaves no line behind
            print(" " * (len(desc) + 4), end="\r", file=sys.stderr, flush=True)
        else:
            _summary(f"{done} in {seconds:.2f} s".ljust(len(desc) + 4))


def bar(
    items: Iterable[T], *, desc: str, done: str, total: Optional[int] = None, show: Optional[bool] = None
) -> Iterator[T]:
    """Iterate ``items`` under a tqdm bar that is replaced, when the loop ends, by the
    line ``"{done} in S s"`` (shown only when :func:`progress_enabled`)."""
    if not progress_enabled(show):
        yield from items
        return
    from tqdm.auto import tqdm

    start = time.perf_counter()
    with tqdm(items, desc=desc, total=total, leave=False, file=sys.stderr) as progress:
        yield from progress
    _summary(f"{done} in {time.perf_counter() - start:.2f} s")

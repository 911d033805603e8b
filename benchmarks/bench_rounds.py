"""Interleaved timing rounds with a warm-up that runs until the times stop moving.

Torch-free (the caller passes ``sync``), so its logic is tested on any CPU
(tests/test_bench_compare.py) with a fake clock.

Why this shape: one backend timed after another lets a drift of the machine
(clocks, another process, a background compile, the garbage collector) land on one backend
only; a fixed count of warm-up calls can end before a cold start is over. Here every
method is timed once per round, in an order rotated from round to round (round-robin,
so a drift hits all alike), warm-up rounds repeat until each method's time has settled,
and the spread of the measured rounds is reported with the median. The warm-up rule is
the usual steady-state test of benchmark harnesses (pyperf's and Google Benchmark's
repeat-until-stable idea); why ratios pair round with round inside one run is in
docs/benchmarks.md ("Ratios and the regression check").
"""

from __future__ import annotations

import gc
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

Clock = Callable[[], float]


@dataclass
class CellTimes:
    """Times (ms per call) of one method at one size.

    Attributes:
        warmup_ms: block means of the warm-up rounds, in order.
        samples_ms: block means of the measured rounds, in order (one per round).
        steady: True when the warm-up stopped because the times settled (False: it hit
            the cap, the numbers may still include a cold start).
        gc_ms: milliseconds the garbage collector ran inside this method's measured blocks.
    """

    warmup_ms: List[float] = field(default_factory=list)
    samples_ms: List[float] = field(default_factory=list)
    steady: bool = False
    gc_ms: float = 0.0

    def summary(self) -> Dict[str, Any]:
        """``{median_ms, min_ms, max_ms, samples_ms, warmup_rounds, warmup_ms, steady, gc_ms}`` (JSON cell)."""
        s = self.samples_ms
        return {
            "median_ms": statistics.median(s) if s else None,
            "min_ms": min(s) if s else None,
            "max_ms": max(s) if s else None,
            "samples_ms": [round(x, 5) for x in s],
            "warmup_rounds": len(self.warmup_ms),
            "warmup_ms": [round(x, 4) for x in self.warmup_ms],
            "steady": self.steady,
            "gc_ms": round(self.gc_ms, 3),
        }


class _GcTimer:
    """Milliseconds spent in the garbage collector while ``active`` (``gc.callbacks``)."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.total_ms = 0.0
        self._start: Optional[float] = None

    def __call__(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._start = self.clock()
        elif self._start is not None:
            self.total_ms += (self.clock() - self._start) * 1000.0
            self._start = None

    def __enter__(self) -> "_GcTimer":
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        gc.callbacks.remove(self)


def is_steady(history: Sequence[float], *, window: int = 3, tol: float = 0.02) -> bool:
    """True when the median of the last ``window`` values is within ``tol`` (relative) of the
    median of the ``window`` values before them.

    Args:
        history: block means (ms) in the order measured.
        window: rounds per median (>= 1); needs ``2 * window`` values.
        tol: accepted relative change, e.g. 0.02 for 2%.
    """
    if len(history) < 2 * window:
        return False
    last = statistics.median(history[-window:])
    before = statistics.median(history[-2 * window : -window])
    return before > 0 and abs(last - before) / before < tol


def run_rounds(
    methods: Dict[str, Callable[[], Any]],
    *,
    iters: int,
    rounds: int,
    sync: Callable[[], None],
    warmup_min: int = 3,
    warmup_max: int = 20,
    tol: float = 0.02,
    window: int = 3,
    warmup_min_s: float = 0.0,
    clock: Clock = time.perf_counter,
    between_rounds: Optional[Callable[[], None]] = None,
    must_settle: Optional[Sequence[str]] = None,
) -> Dict[str, CellTimes]:
    """Time every method in interleaved rounds after a warm-up that reaches steady state.

    One block = ``sync(); iters`` calls ``; sync()``, its time divided by ``iters``; one
    round = one block of every method, the order rotated by one each round. Warm-up rounds
    run at least ``warmup_min`` times and for at least ``warmup_min_s`` seconds, at most
    ``warmup_max`` times, and stop as soon as every method :func:`is_steady`; then
    ``rounds`` measured rounds follow.

    Why a minimum time as well as a steady test: on a fresh machine the host-bound backends
    were seen on a slow plateau for the first few seconds of timing (flat, so the steady test
    passed on it) and fast afterwards; a rule on the shape of the curve alone cannot tell a
    plateau from the end state, a few seconds of warm-up can.

    Args:
        methods: ``{name: fn}``; ``fn()`` runs one step (device work may be asynchronous).
        iters: calls per block (>= 1).
        rounds: measured rounds (>= 1).
        sync: waits for the device (``torch.cuda.synchronize``; a no-op on CPU).
        warmup_min, warmup_max: bounds on the warm-up rounds (0 <= min <= max).
        tol, window: see :func:`is_steady`.
        warmup_min_s: seconds of warm-up (by ``clock``) before the steady test may end it
            (>= 0); ``warmup_max`` still caps the rounds.
        clock: seconds (``time.perf_counter``; tests pass a fake one).
        between_rounds: called after each round (e.g. a device synchronize).
        must_settle: the methods whose steady state ends the warm-up (default all); the
            others are timed alike and their ``steady`` says whether they settled too.

    Returns:
        ``{name: CellTimes}`` in the order of ``methods``.

    Raises:
        ValueError: ``iters``/``rounds`` below 1 or warm-up bounds out of order (names the value).
    """
    if iters < 1 or rounds < 1:
        raise ValueError(f"iters and rounds must be >= 1, got iters={iters}, rounds={rounds}")
    if not 0 <= warmup_min <= warmup_max:
        raise ValueError(f"need 0 <= warmup_min <= warmup_max, got {warmup_min}, {warmup_max}")
    if warmup_min_s < 0:
        raise ValueError(f"need warmup_min_s >= 0 (seconds), got {warmup_min_s}")
    names = list(methods)
    cells = {n: CellTimes() for n in names}
    gate = [cells[n] for n in (names if must_settle is None else must_settle) if n in cells]

    def one_round(index: int, measured: bool) -> None:
        shift = index % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            fn = methods[name]
            gc_timer = _GcTimer(clock)
            with gc_timer:
                sync()
                start = clock()
                for _ in range(iters):
                    fn()
                sync()
                ms = (clock() - start) * 1000.0 / iters
            cell = cells[name]
            if measured:
                cell.samples_ms.append(ms)
                cell.gc_ms += gc_timer.total_ms
            else:
                cell.warmup_ms.append(ms)
        if between_rounds is not None:
            between_rounds()

    index = 0
    started = clock()
    while index < warmup_max:
        one_round(index, measured=False)
        index += 1
        if (
            index >= warmup_min
            and clock() - started >= warmup_min_s
            and all(is_steady(c.warmup_ms, window=window, tol=tol) for c in gate)
        ):
            break
    for c in cells.values():
        c.steady = is_steady(c.warmup_ms, window=window, tol=tol)
    for r in range(rounds):
        one_round(index + r, measured=True)
    return cells

"""Run statistics of a runner: replays, eager fallbacks with their reason, padding waste.

``BaseCudaGraphRunner.forward`` counts every call here: a replay under the batch's
live size, an eager fallback under the reason of the batch's one decision
(``runner.decide(batch)``, :class:`~.decision.EagerDecision`); nothing here asks the
runner again. :meth:`RunStats.summary` turns the
counts into the per-captured-size padding waste (padded rows / real rows) that shows
whether the capture sizes fit the traffic (the same question sglang's and vLLM's
``cuda_graph_bs`` lists answer by hand). Counting costs one dict update per call.

The summary is what ``runner.run_stats()`` returns, what the bench writes under each
runner's ``"run_stats"`` in its JSON, and what it logs at INFO.
"""

from __future__ import annotations

import bisect
import collections
import logging
from typing import Any, Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

#: Why ``forward`` ran a batch eagerly (the keys of ``summary()["eager_fallbacks"]``).
REASON_DISABLED = "disabled"  # the runner's backend is ``disabled``
REASON_NOT_CAPTURED = "not captured"  # capture() has not run (or cleanup() dropped the graphs)
REASON_TOO_LARGE = "too large"  # more rows than the largest captured size
REASON_VARIANT = "variant not captured"  # another mode/layout, or the backend has no graph for it
REASON_EMPTY = "empty batch"  # zero rows
REASON_PADDING = "padding too large"  # prefill: the padded size exceeds its ratio cap
REASON_OTHER_RANK = "another rank cannot replay"  # tensor parallel: every rank takes the same path
REASON_SLOTS = "more requests than slots"  # prefill full: the batch has more requests than its graphs' slots
REASON_ASLEEP = "asleep"  # runner.sleep() gave the graphs back; runner.wake() recaptures them
REASON_NOT_CAPTURED_YET = "not captured yet"  # capture eager_first: its size is queued for capture_step()
REASON_NO_KEY = "no key covers the batch"  # mixed: no captured requests x tokens key holds both axes
REASONS = (
    REASON_DISABLED,
    REASON_NOT_CAPTURED,
    REASON_TOO_LARGE,
    REASON_VARIANT,
    REASON_EMPTY,
    REASON_PADDING,
    REASON_OTHER_RANK,
    REASON_SLOTS,
    REASON_ASLEEP,
    REASON_NOT_CAPTURED_YET,
    REASON_NO_KEY,
)


class RunStats:
    """Counters of one runner since its construction (or :meth:`reset`).

    Attributes:
        replays_by_size: live size (decode: requests, prefill: tokens) -> replays.
        fallbacks: reason (one of :data:`REASONS`) -> eager runs.
        requests_by_slots: ``(live requests, request slots)`` -> replays (prefill graphs
            with request slots, backend ``full``; empty otherwise).
    """

    __slots__ = ("replays_by_size", "fallbacks", "requests_by_slots", "replays_by_shape")

    def __init__(self) -> None:
        self.replays_by_size: Dict[int, int] = collections.Counter()
        self.fallbacks: Dict[str, int] = collections.Counter()
        self.requests_by_slots: Dict[Tuple[int, int], int] = collections.Counter()
        #: ``(live requests, live tokens, key requests, key tokens, request rows run)`` ->
        #: replays: the two-dimensional keys of the mixed runner (empty otherwise).
        self.replays_by_shape: Dict[Tuple[int, int, int, int, int], int] = collections.Counter()

    def record_shape(
        self, requests: int, tokens: int, key_requests: int, key_tokens: int, slots: Optional[int] = None
    ) -> None:
        """One replay of ``requests`` requests and ``tokens`` tokens in the graph of the
        two-dimensional key ``key_requests x key_tokens``, over ``slots`` request rows
        (None: ``key_requests``; the live ``requests`` where the request axis is not padded)."""
        self.replays_by_shape[
            (requests, tokens, key_requests, key_tokens, key_requests if slots is None else slots)
        ] += 1

    def record_replay(self, size: int) -> None:
        """One replay of a live batch of ``size`` rows."""
        self.replays_by_size[size] += 1

    def record_request_slots(self, requests: int, slots: int) -> None:
        """One replay of ``requests`` live requests in a graph of ``slots`` request slots."""
        self.requests_by_slots[(requests, slots)] += 1

    def record_fallback(self, reason: str) -> None:
        """One eager run, for ``reason`` (one of :data:`REASONS`)."""
        self.fallbacks[reason] += 1

    def reset(self) -> None:
        """Forget every count (e.g. after warm-up traffic)."""
        self.replays_by_size.clear()
        self.fallbacks.clear()
        self.requests_by_slots.clear()
        self.replays_by_shape.clear()

    def summary(self, capture_sizes: Sequence[int]) -> Dict[str, Any]:
        """Plain-JSON statistics.

        Args:
            capture_sizes: the runner's sorted capture sizes (each live size pads up to
                the smallest one >= it).

        Returns:
            ``{"replays": int, "eager_fallbacks": {reason: int}, "eager_total": int,
            "padding": [{"captured_size", "replays", "real_rows", "padded_rows",
            "waste"}]}`` where ``waste`` = padded rows / real rows (0.0 = no padding),
            one entry per captured size that replayed, ascending (prefill: rows are
            tokens). ``"padded_rows"`` and ``"real_rows"``: their totals, and
            ``"waste"`` = padded / real over all replays. With request slots (prefill
            ``full``) also ``"request_slots": {"replays", "real_requests",
            "padded_slots", "waste"}``: sentinel requests / live requests.
        """
        sizes = sorted(capture_sizes)
        per_size: Dict[int, List[int]] = {}  # captured size -> [replays, real rows, padded rows]
        for live, count in self.replays_by_size.items():
            i = bisect.bisect_left(sizes, live)
            captured = sizes[i] if i < len(sizes) else live
            entry = per_size.setdefault(captured, [0, 0, 0])
            entry[0] += count
            entry[1] += live * count
            entry[2] += (captured - live) * count
        padding = [
            {
                "captured_size": s,
                "replays": n,
                "real_rows": real,
                "padded_rows": pad,
                "waste": pad / real if real else 0.0,
            }
            for s, (n, real, pad) in sorted(per_size.items())
        ]
        real_rows = sum(p["real_rows"] for p in padding)
        padded_rows = sum(p["padded_rows"] for p in padding)
        result: Dict[str, Any] = {
            "replays": sum(self.replays_by_size.values()),
            "eager_fallbacks": dict(sorted(self.fallbacks.items())),
            "eager_total": sum(self.fallbacks.values()),
            "padding": padding,
            "real_rows": real_rows,
            "padded_rows": padded_rows,
            "waste": padded_rows / real_rows if real_rows else 0.0,
        }
        if self.replays_by_shape:
            result.update(shape_padding(self.replays_by_shape))
        if self.requests_by_slots:
            real = sum(n * count for (n, _), count in self.requests_by_slots.items())
            pad = sum((slots - n) * count for (n, slots), count in self.requests_by_slots.items())
            result["request_slots"] = {
                "replays": sum(self.requests_by_slots.values()),
                "real_requests": real,
                "padded_slots": pad,
                "waste": pad / real if real else 0.0,
            }
        return result


def shape_padding(replays_by_shape: Dict[Tuple[int, int, int, int, int], int]) -> Dict[str, Any]:
    """The padding waste of two-dimensional keys on both axes, from
    ``(live requests, live tokens, key requests, key tokens, request rows run) -> replays``.

    Returns:
        ``{"padding": [...], "real_rows", "padded_rows", "waste"}`` on the token axis (the
        one-dimensional summary's fields, one ``"padding"`` entry per captured token count,
        each also giving ``"requests"``: the request slots of the keys that replayed), and
        ``"shape_padding"``: one entry per key that replayed, ascending, ``{"key":
        [requests, tokens], "replays", "real_tokens", "padded_tokens", "token_waste",
        "real_requests", "padded_requests", "request_waste"}`` plus the totals
        ``"shape_waste": {"tokens", "requests"}`` (padded / real on each axis).
    """
    per_key: Dict[Tuple[int, int], List[int]] = {}  # (R, T) -> [replays, real T, pad T, real R, pad R]
    for (requests, tokens, key_requests, key_tokens, slots), count in replays_by_shape.items():
        entry = per_key.setdefault((key_requests, key_tokens), [0, 0, 0, 0, 0])
        entry[0] += count
        entry[1] += tokens * count
        entry[2] += (key_tokens - tokens) * count
        entry[3] += requests * count
        entry[4] += (slots - requests) * count
    shapes: List[Dict[str, Any]] = [
        {
            "key": [r, t],
            "replays": n,
            "real_tokens": rt,
            "padded_tokens": pt,
            "token_waste": pt / rt if rt else 0.0,
            "real_requests": rr,
            "padded_requests": pr,
            "request_waste": pr / rr if rr else 0.0,
        }
        for (r, t), (n, rt, pt, rr, pr) in sorted(per_key.items(), key=lambda item: (item[0][1], item[0][0]))
    ]
    per_tokens: Dict[int, Tuple[List[int], List[int]]] = {}  # T -> ([replays, real, pad], request slots)
    for (r, t), (n, rt, pt, _, _) in per_key.items():
        counts, key_slots = per_tokens.setdefault(t, ([0, 0, 0], []))
        counts[0] += n
        counts[1] += rt
        counts[2] += pt
        key_slots.append(r)
    padding = [
        {
            "captured_size": t,
            "requests": sorted(key_slots),
            "replays": n,
            "real_rows": real,
            "padded_rows": pad,
            "waste": pad / real if real else 0.0,
        }
        for t, ((n, real, pad), key_slots) in sorted(per_tokens.items())
    ]
    real_tokens = sum(e[1] for e in per_key.values())
    padded_tokens = sum(e[2] for e in per_key.values())
    real_requests = sum(e[3] for e in per_key.values())
    padded_requests = sum(e[4] for e in per_key.values())
    return {
        "padding": padding,
        "real_rows": real_tokens,
        "padded_rows": padded_tokens,
        "waste": padded_tokens / real_tokens if real_tokens else 0.0,
        "shape_padding": shapes,
        "shape_waste": {
            "tokens": padded_tokens / real_tokens if real_tokens else 0.0,
            "requests": padded_requests / real_requests if real_requests else 0.0,
        },
    }


def format_summary(label: str, summary: Dict[str, Any]) -> str:
    """One line for the log: ``"<label>: 40 replays, 2 eager (too large 2), padding waste 12.5%"``
    (then the request-slot waste of prefill ``full`` and the graph pool in MiB, when known)."""
    fallbacks = ", ".join(f"{reason} {n}" for reason, n in summary["eager_fallbacks"].items())
    real = sum(p["real_rows"] for p in summary["padding"])
    padded = sum(p["padded_rows"] for p in summary["padding"])
    waste = f"{100.0 * padded / real:.1f}%" if real else "-"
    slots = summary.get("request_slots")
    slot_waste = f", request-slot waste {100.0 * slots['waste']:.1f}%" if slots else ""
    shape = summary.get("shape_waste")
    if shape:
        slot_waste += f", request-slot waste {100.0 * shape['requests']:.1f}%"
    return (
        f"{label}: {summary['replays']} replays, {summary['eager_total']} eager"
        + (f" ({fallbacks})" if fallbacks else "")
        + f", padding waste {waste}"
        + slot_waste
        + (f", graph pool {summary['pool_mib']:.1f} MiB" if summary.get("pool_mib") is not None else "")
        + (_capture_progress(summary["capture"]) if summary.get("capture") else "")
    )


def _capture_progress(capture: Dict[str, Any]) -> str:
    return f", {capture['ready']} of {capture['total']} sizes ready ({capture['pending']} queued)"

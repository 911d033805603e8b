"""Calling backends' availability probes: in bounded time, once per process and device type.

What it does: calls a ``BackendSpec.probe`` (importing its module first when it is a
``"module:function"`` reference) in a daemon thread and waits at most the time limit
(``CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S``, or ``BackendRegistry(probe_timeout_s=...)``), so a
probe that hangs costs one time limit, not the process: the probe is listed unavailable
("timed out") and every other backend is still listed and resolved. Each answer is kept
per probe and device type for the registry's lifetime (a registry is per process), so
five runners resolving one backend run its probe once; a probe still running past its
limit stores its real answer when it ends, and later look-ups read that.

What a probe may return: None or True (usable), a non-empty string (why not), False
(unusable, no reason given); anything else is shown as its ``str``.

What it does not do: decide an entry's status (:func:`.entries.probe` does, from the
answer given here), or stop a probe thread (Python cannot; the daemon thread is left to
end or to die with the process).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any, Dict, Optional, Tuple

from .discovery import load_ref, ref_name

#: The default time limit of one probe call, in seconds (the environment variable's default):
#: long enough for a healthy probe that imports a vendor's torch extension on a loaded
#: machine (``import torch_npu`` can take tens of seconds), short enough that a hung probe
#: ends within a minute.
DEFAULT_PROBE_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True)
class ProbeAnswer:
    """What one probe call said.

    Attributes:
        reason: why the backend cannot run, one line; None when it can.
        error: what the probe (or importing it) raised; None when it returned.
        timed_out: the probe did not return within the time limit (``reason`` says so).
    """

    reason: Optional[str] = None
    error: Optional[BaseException] = None
    timed_out: bool = False


def reason_of(value: Any) -> Optional[str]:
    """A probe's return value as a reason: None for None, True or an empty string."""
    if value is None or value is True:
        return None
    if value is False:
        return "its probe returned False (no reason given)"
    text = str(value).strip()
    return text or None


def call_probe(ref: Any, device_type: str) -> ProbeAnswer:
    """Call probe ``ref`` (a callable or ``"module:function"``) for ``device_type`` now, in
    this thread, without a time limit; what it raised is in the answer's ``error``."""
    try:
        return ProbeAnswer(reason_of(load_ref(ref)(device_type)))
    except BaseException as exc:  # a probe must not break the registry (KeyboardInterrupt: see ProbeCache)
        return ProbeAnswer(error=exc)


class ProbeCache:
    """Probe answers by ``(probe, device type)``, each call bounded by ``timeout_s``.

    Args:
        timeout_s: seconds one call may take; 0 means no limit (the probe runs in the
            calling thread).

    Raises:
        ValueError: ``timeout_s`` is negative or not a number.
    """

    def __init__(self, timeout_s: float = DEFAULT_PROBE_TIMEOUT_S) -> None:
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 <= timeout_s < float("inf"):
            raise ValueError(f"probe_timeout_s={timeout_s!r}: accepted seconds, a number >= 0 (0: no limit)")
        self.timeout_s = float(timeout_s)
        self._answers: Dict[Tuple[Any, str], ProbeAnswer] = {}
        self._lock = threading.Lock()

    def answer(self, ref: Any, device_type: str) -> ProbeAnswer:
        """The answer of probe ``ref`` for ``device_type``: cached, else called now.

        Raises:
            KeyboardInterrupt: raised by the probe (then nothing is cached).
        """
        try:
            key: Tuple[Any, str] = (ref, device_type)
            hash(key)
        except TypeError:  # an unhashable callable object: by identity
            key = (id(ref), device_type)
        with self._lock:
            cached = self._answers.get(key)
        if cached is not None:
            return cached
        if not self.timeout_s:
            answer = call_probe(ref, device_type)
        else:
            answer = self._call_bounded(ref, device_type, key)
        if isinstance(answer.error, KeyboardInterrupt):
            raise answer.error
        with self._lock:
            # A late thread may have stored the real answer meanwhile: that one stays.
            return self._answers.setdefault(key, answer)

    def _call_bounded(self, ref: Any, device_type: str, key: Tuple[Any, str]) -> ProbeAnswer:
        done = threading.Event()
        box: Dict[str, ProbeAnswer] = {}

        def run() -> None:
            box["answer"] = call_probe(ref, device_type)
            done.set()
            if not isinstance(box["answer"].error, KeyboardInterrupt):
                with self._lock:  # past the limit, the real answer replaces "timed out"
                    self._answers[key] = box["answer"]

        threading.Thread(target=run, name=f"cgr-probe-{ref_name(ref)}", daemon=True).start()
        if done.wait(self.timeout_s):
            return box["answer"]
        return ProbeAnswer(
            reason=(
                f"its probe {ref_name(ref)}({device_type!r}) timed out after {self.timeout_s:g} s "
                "(raise CUDA_GRAPH_RUNNER_PROBE_TIMEOUT_S, or 0 for no limit)"
            ),
            timed_out=True,
        )

    def renew_lock(self) -> None:
        """A new lock, in a forked child (a parent thread may have held the old one)."""
        self._lock = threading.Lock()

    def clear(self) -> None:
        """Forget every answer (the next look-up calls the probes again)."""
        with self._lock:
            self._answers.clear()

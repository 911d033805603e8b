"""The base class of every error this package and its plugins raise,
:class:`CudaGraphRunnerError`, the config's one error type, :class:`CudaGraphConfigError`, and
the value printer its messages use. Standard library only: the config is the lowest layer, and
every layer above it (and every plugin, through :mod:`cuda_graph_runner.backend`) derives its
errors from the base defined here."""

from __future__ import annotations

import functools
import numbers
from typing import Any, Dict, Optional

__all__ = ["CudaGraphConfigError", "CudaGraphRunnerError"]

_NOT_GIVEN = object()


def _short_repr(value: Any, limit: int = 120) -> str:
    try:
        text = repr(value)
    except ValueError:
        # Python >= 3.11 refuses to print ints of more than 4300 digits (int_max_str_digits).
        if isinstance(value, numbers.Integral) and not isinstance(value, bool):
            return f"<integer of {int(value).bit_length()} bits>"
        return f"<{type(value).__name__} too large to print>"
    except Exception as exc:  # a user object whose __repr__ fails must not hide the real error
        return f"<{type(value).__name__}: repr failed ({type(exc).__name__})>"
    return text if len(text) <= limit else text[: limit - 3] + "..."


class CudaGraphRunnerError(Exception):
    """Base class of every error type cuda-graph-runner and its plugins define.

    ``except CudaGraphRunnerError`` catches those (a plain argument check of one call may
    still raise Python's own ``TypeError`` or ``ValueError``). Each subclass also keeps the standard
    base its kind has (a config error is a ``ValueError``, an unknown backend a ``KeyError``,
    a capture out of memory a ``torch.OutOfMemoryError``, ...), so code that catches those
    catches these too. Every one is importable from :mod:`cuda_graph_runner`; plugins import
    the base from :mod:`cuda_graph_runner.backend`.
    """


class CudaGraphConfigError(CudaGraphRunnerError, ValueError):
    """The one error type for every invalid config, flag or JSON input (a ``ValueError``).

    Attributes:
        phase: the phase concerned, or None (unknown phase, whole-document error).
        key: the phase key concerned, or None.
        value: the rejected value, or None where not applicable.
        accepted: what would have been accepted (text), or None.
        source: where the value came from (``"flag:--x"``, ``"json"``...), or None.
    """

    def __init__(
        self,
        problem: str,
        *,
        phase: Optional[str] = None,
        key: Optional[str] = None,
        value: Any = _NOT_GIVEN,
        accepted: Optional[str] = None,
        source: Optional[str] = None,
    ) -> None:
        self.problem = problem
        self.phase = phase
        self.key = key
        self._has_value = value is not _NOT_GIVEN
        self.value = value if self._has_value else None
        self.accepted = accepted
        self.source = source
        super().__init__(self._message())

    def _message(self) -> str:
        where = ".".join(str(part) for part in (self.phase, self.key) if part is not None)
        subject = where
        if self._has_value:
            subject = f"{where}={_short_repr(self.value)}" if where else _short_repr(self.value)
        text = "invalid cuda-graph config" + (f" {subject}" if subject else "")
        if self.source:
            text += f" (from {self.source})"
        text += f": {self.problem}"
        if self.accepted:
            text += f"; accepted: {self.accepted}"
        return text

    def _kwargs(self) -> Dict[str, Any]:
        kwargs = dict(phase=self.phase, key=self.key, accepted=self.accepted, source=self.source)
        if self._has_value:
            kwargs["value"] = self.value
        return kwargs

    def with_context(self, *, phase: Optional[str] = None, source: Optional[str] = None) -> "CudaGraphConfigError":
        """A copy with ``phase`` and ``source`` filled in where this error lacks them."""
        kwargs = self._kwargs()
        kwargs["phase"] = self.phase if self.phase is not None else phase
        kwargs["source"] = self.source or source
        return type(self)(self.problem, **kwargs)

    def __reduce__(self):  # keep the attributes across pickling (worker processes)
        return (functools.partial(type(self), self.problem, **self._kwargs()), ())

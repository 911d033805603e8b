"""Exceptions of the registry and the backends. Their base, :class:`CudaGraphRunnerError`, is
defined with the config's error in :mod:`cuda_graph_runner.config.exceptions` (the lowest layer)
and importable from here."""

from __future__ import annotations

from ..config.exceptions import CudaGraphRunnerError

__all__ = [
    "BackendConflictError",
    "BackendContractError",
    "BackendLoadError",
    "BackendUnavailableError",
    "CompileCacheError",
    "CudaGraphHostValueError",
    "CudaGraphRunnerError",
    "CudaGraphVerifyError",
    "RegistryReentryError",
    "UnknownBackendError",
]


class UnknownBackendError(CudaGraphRunnerError, KeyError):
    """A backend name no installed plugin provides. The message lists what is installed."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class BackendUnavailableError(CudaGraphRunnerError, RuntimeError):
    """A backend that is installed but cannot run here (probe failed, wrong device, API version)."""


class BackendLoadError(CudaGraphRunnerError, ImportError):
    """A plugin or backend class failed to import; the original exception is chained."""


class BackendContractError(CudaGraphRunnerError, TypeError):
    """A backend class breaks the ``BaseCudaGraphBackend`` contract."""


class BackendConflictError(CudaGraphRunnerError, RuntimeError):
    """Two distributions register the same backend name."""


class RegistryReentryError(CudaGraphRunnerError, RuntimeError):
    """The registry was listed, resolved or written to by code its own plugin scan is
    running (a plugin doing so at import); the answer would be a half-built registry."""


class CudaGraphHostValueError(CudaGraphRunnerError, RuntimeError):
    """Model code read a host value of the batch where a graph would freeze it.

    Raised during capture (see :mod:`cuda_graph_runner.backend.host_guard`). The message names the
    field, the backend and the fixes.

    Attributes:
        field: the field read (``"seq_lens_cpu"``, ``"extra['key']"``, ...).
        backend: the backend name.
        phase: ``"decode"`` or ``"prefill"``.
    """

    def __init__(self, message: str, *, field: str = "", backend: str = "", phase: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.backend = backend
        self.phase = phase

    def __reduce__(self):  # keep the attributes across pickling
        return (_rebuild_host_value_error, (str(self), self.field, self.backend, self.phase))


def _rebuild_host_value_error(message: str, field: str, backend: str, phase: str) -> "CudaGraphHostValueError":
    return CudaGraphHostValueError(message, field=field, backend=backend, phase=phase)


class CudaGraphVerifyError(CudaGraphRunnerError, RuntimeError):
    """Verify mode found a replay that differs from the backend's reference on the same batch.

    Attributes:
        phase, backend: where it happened.
        key: the ``ShapeKey`` replayed.
        max_abs_diff: the largest absolute difference over the compared outputs (inf when
            a shape, dtype or structure differs, or a value is NaN on one side only).
        replay_index: which replay of ``key`` it was (1 for the first).
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str = "",
        backend: str = "",
        key: object = None,
        max_abs_diff: float = float("inf"),
        replay_index: int = 0,
    ) -> None:
        super().__init__(message)
        self.phase = phase
        self.backend = backend
        self.key = key
        self.max_abs_diff = max_abs_diff
        self.replay_index = replay_index


class CompileCacheError(CudaGraphRunnerError, OSError):
    """The compile cache folder (``CUDA_GRAPH_RUNNER_CACHE_DIR``) cannot be created or
    written; the message names the folder and the two settings that fix it. An
    ``OSError``."""

"""Exceptions of the registry and the runners (the config has its own, in ``config``)."""

from __future__ import annotations


class CudaGraphRunnerError(Exception):
    """Base class of this package's runtime errors."""


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

"""Backend ``acme`` for cuda-graph-runner: an example third-party plugin.

The registration module :mod:`acme_cgr.plugin` is what the entry point names; the
backend class lives in :mod:`acme_cgr.backend` and is imported only when selected.
"""

__version__ = "0.1.0"

"""The ``cuda-graph-runner`` command: ``bench``, ``backends``, ``config``, ``inspect``.

:func:`main` is the console entry point (``cuda_graph_runner.cli:main``); the command
itself is :mod:`.command`, the benchmark :mod:`.bench`, the tables, plots and results
schema their own modules. Nothing below this layer imports it.
"""

from .command import main

__all__ = ["main"]

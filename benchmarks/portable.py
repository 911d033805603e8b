"""Paths as stored in benchmark output: nothing of the machine that ran it.

A results file is committed under ``benchmarks/results/`` and read on other machines, so
the absolute paths a run meets (its ``--out`` folder, inductor's cache folder) are stored
relative to the working directory, or with the temporary folder or home folder written as
``<tmp>`` / ``~``; any other absolute path keeps only its last component (``<abs>/NAME``).
Torch-free.
"""

from __future__ import annotations

import os
import tempfile
from typing import List, Sequence


def portable_path(path: str) -> str:
    """``path`` with no absolute prefix of this machine; a relative path is returned as is.

    >>> portable_path(os.path.join(os.getcwd(), "out", "run.json"))
    'out/run.json'
    """
    if not os.path.isabs(path):
        return path
    path = os.path.normpath(path)
    for root, shown in ((os.getcwd(), ""), (tempfile.gettempdir(), "<tmp>"), (os.path.expanduser("~"), "~")):
        root = os.path.normpath(root)
        if root != os.sep and (path == root or path.startswith(root + os.sep)):
            rest = os.path.relpath(path, root)
            if not shown:
                return rest
            return shown if rest == "." else f"{shown}/{rest}"
    return f"<abs>/{os.path.basename(path)}"


def portable_argv(argv: Sequence[str]) -> List[str]:
    """Command-line arguments with every absolute path (``PATH`` or ``--flag=PATH``) made
    portable by :func:`portable_path`."""
    out = []
    for arg in argv:
        flag, eq, value = arg.partition("=")
        if eq and flag.startswith("-") and os.path.isabs(value):
            out.append(f"{flag}={portable_path(value)}")
        else:
            out.append(portable_path(arg))
    return out

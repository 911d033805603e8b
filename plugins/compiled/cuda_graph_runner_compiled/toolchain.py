"""Probe for what inductor needs on the CPU: torch.compile and a working C++ compiler.

Inductor's CPU code generator writes C++ and builds it with the compiler
``torch._inductor.config.cpp.cxx`` names (``CXX``, else ``g++``/``clang++`` found on
``PATH``; PyTorch ``torch/_inductor/cpp_builder.py``) and links against Python's headers.
Without them the first compile fails minutes into a run with a long compiler
traceback; the probe says so up front, in one line, in ``cuda-graph-runner backends``.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sysconfig
from typing import Optional

from cuda_graph_runner.backend import envs


def probe(device_type: str) -> Optional[str]:
    """None when backend ``compiled`` can run on ``device_type`` here, else why not.

    Checks (only for ``"cpu"``): torch has ``torch.compile``; a C++ compiler is found
    (:func:`find_cxx`) and runs; Python's development headers (``Python.h``) exist.
    """
    if device_type != "cpu":
        return f"compiles for the CPU only, not {device_type!r} (on CUDA use 'full' or 'tc_piecewise')"
    import torch

    if not hasattr(torch, "compile"):
        return f"torch {torch.__version__} has no torch.compile"
    return toolchain_problem()


def find_cxx() -> Optional[str]:
    """The C++ compiler inductor would use: ``$CXX``, else ``g++``, ``clang++``, ``c++`` on
    ``PATH`` (full path), or None."""
    configured = envs.external("CXX")
    candidates = [configured] if configured else []
    candidates += ["g++", "clang++", "c++"]
    for name in candidates:
        path = shutil.which(name.split()[0]) if name else None
        if path:
            return path
    return None


@functools.cache
def toolchain_problem() -> Optional[str]:
    """None when a C++ compiler runs (``--version``, milliseconds: probes run whenever
    backends are listed) and Python's headers exist, else a one-line reason naming what
    is missing and how to get it. Cached per process."""
    cxx = find_cxx()
    if cxx is None:
        return "inductor needs a C++ compiler: none found ($CXX, g++, clang++, c++); e.g. apt-get install g++"
    try:
        done = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"inductor's C++ compiler {cxx} does not run: {exc}"
    if done.returncode != 0:
        return f"inductor's C++ compiler {cxx} does not run: '{cxx} --version' exited with {done.returncode}"
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"inductor needs Python's C headers: {include}/Python.h is missing; e.g. apt-get install python3-dev"
    return None

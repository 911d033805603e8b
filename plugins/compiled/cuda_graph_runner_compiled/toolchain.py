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
import tempfile
from typing import Optional


def probe(device_type: str) -> Optional[str]:
    """None when backend ``compiled`` can run on ``device_type`` here, else why not.

    Checks (only for ``"cpu"``): torch has ``torch.compile``; a C++ compiler is found
    (:func:`find_cxx`); Python's development headers (``Python.h``) exist; the compiler
    builds a trivial shared library (cached per process: one compiler start, ~0.1 s).
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
    configured = os.environ.get("CXX")
    candidates = [configured] if configured else []
    candidates += ["g++", "clang++", "c++"]
    for name in candidates:
        path = shutil.which(name.split()[0]) if name else None
        if path:
            return path
    return None


@functools.cache
def toolchain_problem() -> Optional[str]:
    """None when a C++ compiler builds a shared library with Python's headers, else a
    one-line reason naming what is missing and how to get it."""
    cxx = find_cxx()
    if cxx is None:
        return "inductor needs a C++ compiler: none found ($CXX, g++, clang++, c++); e.g. apt-get install g++"
    include = sysconfig.get_paths().get("include") or ""
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"inductor needs Python's C headers: {include}/Python.h is missing; e.g. apt-get install python3-dev"
    with tempfile.TemporaryDirectory(prefix="cgr-cxx-probe-") as tmp:
        src = os.path.join(tmp, "probe.cpp")
        with open(src, "w") as f:
            f.write('#include <Python.h>\nextern "C" int cgr_probe(void) { return 1; }\n')
        cmd = [cxx, "-shared", "-fPIC", "-std=c++17", "-I", include, src, "-o", os.path.join(tmp, "probe.so")]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"inductor's C++ compiler {cxx} did not run: {exc}"
        if done.returncode != 0:
            first = (done.stderr or done.stdout).strip().splitlines()
            return f"inductor's C++ compiler {cxx} cannot build a shared library: " + (
                first[0] if first else f"exit {done.returncode}"
            )
    return None

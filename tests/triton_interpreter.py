"""Running a test script under Triton's interpreter (``TRITON_INTERPRET=1``, CPU tensors)
in a subprocess, for the tests of the ``triton`` attention's kernels."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

#: What Triton's interpreter raises where numpy refuses ``int()`` of a one-element array
#: (a loop bound read from a kernel argument): seen with numpy 2.4 and Triton 3.6; numpy 2.2
#: runs the same kernels.
NUMPY_SCALAR_ERROR = "only 0-dimensional arrays can be converted to Python scalars"


def run_interpreted(script: str, marker: str) -> None:
    """Run ``script`` with ``TRITON_INTERPRET=1`` and assert it printed ``marker``.

    Skips (with the reason) when triton is not installed, or when Triton's interpreter
    raised :data:`NUMPY_SCALAR_ERROR` under numpy 2.4 or later; any other failure fails with
    the script's output.
    """
    if importlib.util.find_spec("triton") is None:
        pytest.skip("the triton package is not installed (optional extra [triton])")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    done = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300, check=False)
    import numpy

    numpy_major_minor = tuple(int(part) for part in numpy.__version__.split(".")[:2])
    in_interpreter = "triton/runtime/interpreter" in done.stderr.replace("\\", "/")
    if done.returncode != 0 and NUMPY_SCALAR_ERROR in done.stderr and in_interpreter and numpy_major_minor >= (2, 4):
        import triton

        pytest.skip(
            f"Triton {triton.__version__}'s interpreter cannot run with numpy {numpy.__version__} "
            f"({NUMPY_SCALAR_ERROR!r}); numpy 2.2 runs it"
        )
    assert done.returncode == 0 and marker in done.stdout, done.stdout + done.stderr

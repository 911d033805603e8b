"""Backend ``tc_piecewise`` against the conformance kit.

The device tests carry the ``gpu`` mark, so ``pytest -m gpu`` on the device machine runs
them (with the default compiler, ``eager``); without CUDA they skip with the reason.
"""

import pytest

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestTcPiecewiseConformance(BackendConformanceTests):
    backend_name = "tc_piecewise"
    distribution = "cuda-graph-runner-tc-piecewise"
    device_marks = (pytest.mark.gpu,)

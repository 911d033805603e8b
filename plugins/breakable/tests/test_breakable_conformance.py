"""Backend ``breakable`` against the conformance kit.

The device tests carry the ``gpu`` mark, so ``pytest -m gpu`` on the device machine
(scripts/gpu_check.sh) runs them; without CUDA they skip with the reason.
"""

import pytest

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestBreakableConformance(BackendConformanceTests):
    backend_name = "breakable"
    distribution = "cuda-graph-runner-breakable"
    device_marks = (pytest.mark.gpu,)

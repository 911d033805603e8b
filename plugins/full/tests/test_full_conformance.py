"""Backend ``full`` against the conformance kit (device tests: ``gpu`` mark, run by scripts/gpu_check.sh)."""

import pytest

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestFullConformance(BackendConformanceTests):
    backend_name = "full"
    distribution = "cuda-graph-runner-full"
    device_marks = (pytest.mark.gpu,)

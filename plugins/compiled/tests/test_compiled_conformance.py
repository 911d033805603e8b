"""Backend ``compiled`` against the conformance kit, on the CPU.

The device tests compile with ``eager`` (``CUDA_GRAPH_RUNNER_COMPILED_COMPILER``):
the same Dynamo trace per size as inductor, without AOTAutograd nor C++ builds, so the kit's several
captures stay within seconds; test_compiled.py runs inductor once.
"""

import pytest

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestCompiledConformance(BackendConformanceTests):
    backend_name = "compiled"
    distribution = "cuda-graph-runner-compiled"
    device_type = "cpu"
    decode_max_bs = 2
    decode_batch_sizes = (1, 2)

    @pytest.fixture(autouse=True)
    def _cheap_compiler(self, monkeypatch):
        monkeypatch.setenv("CUDA_GRAPH_RUNNER_COMPILED_COMPILER", "eager")

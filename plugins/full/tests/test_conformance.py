"""Backend ``full`` against the conformance kit (device tests skip, with the reason, without CUDA)."""

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestFullConformance(BackendConformanceTests):
    backend_name = "full"
    distribution = "cuda-graph-runner-full"

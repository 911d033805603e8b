"""Backend ``breakable`` against the conformance kit (device tests skip, with the reason, without CUDA)."""

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestBreakableConformance(BackendConformanceTests):
    backend_name = "breakable"
    distribution = "cuda-graph-runner-breakable"

"""The cuda-graph-runner conformance kit, run against the installed ``acme`` backend.

``acme`` runs on any device, so here even the capture-and-replay tests run on the CPU.
"""

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestAcmeConformance(BackendConformanceTests):
    backend_name = "acme"
    distribution = "cuda-graph-runner-acme"

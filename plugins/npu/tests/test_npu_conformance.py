"""Backend ``npu`` against the conformance kit.

Without torch_npu and an Ascend device the ``test_device_*`` tests skip with the probe's
reason; the discovery, spec and contract tests run everywhere.
"""

from cuda_graph_runner.testing.conformance import BackendConformanceTests


class TestNPUConformance(BackendConformanceTests):
    backend_name = "npu"
    distribution = "cuda-graph-runner-npu"
    # The fake device module has no NPUGraph.update: check the device calls without the update path.
    fake_device_backend_kwargs = {"update_input_name": None}

"""Backend ``npu`` of cuda-graph-runner: Ascend NPU graphs through torch_npu.

Importing this package imports neither torch nor torch_npu; the backend class lives
in :mod:`cuda_graph_runner_npu.backend` and is imported only when resolved.
"""

__version__ = "0.1.0"

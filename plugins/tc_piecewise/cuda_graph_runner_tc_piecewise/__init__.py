"""Backend ``tc_piecewise`` of cuda-graph-runner: torch.compile split at the marked ops,
each compiled piece captured as a CUDA graph per size.

Importing this package imports nothing heavy; the backend lives in
:mod:`cuda_graph_runner_tc_piecewise.backend` and is loaded by the registry on resolve.
"""

__version__ = "0.1.0"

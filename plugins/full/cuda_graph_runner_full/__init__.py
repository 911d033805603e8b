"""Backend ``full`` of cuda-graph-runner: one device graph per shape."""

__version__ = "0.1.0"

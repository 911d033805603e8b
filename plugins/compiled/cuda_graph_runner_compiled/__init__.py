"""Backend ``compiled`` of cuda-graph-runner: the forward compiled per size bucket (CPU)."""

__version__ = "0.1.0"

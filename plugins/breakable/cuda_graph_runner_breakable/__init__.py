"""Backend ``breakable`` of cuda-graph-runner: graph segments split at the marked eager ops."""

__version__ = "0.1.0"

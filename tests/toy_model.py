"""Kept so that tests importing ``toy_model`` keep working; the helper lives in
:mod:`cuda_graph_runner.testing.toy_model` (plugin tests share it)."""

from cuda_graph_runner.testing.toy_model import ToyModel, decode_batch

__all__ = ["ToyModel", "decode_batch"]

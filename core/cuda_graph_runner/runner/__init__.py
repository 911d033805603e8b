"""Runners: the phase policy (sizes, buffers, padding, fallback) around a backend."""

from .base import BaseCudaGraphRunner, freeze_gc, get_batch_sizes_to_capture
from .decode import DecodeCudaGraphRunner, default_decode_batch_sizes
from .draft import DraftDecodeCudaGraphRunner
from .greedy import GreedyDecodeCudaGraphRunner
from .mixed import MixedCudaGraphRunner
from .prefill import PrefillCudaGraphRunner, default_prefill_token_sizes
from .static_inputs import StaticInput
from .stats import RunStats

__all__ = [
    "BaseCudaGraphRunner",
    "DecodeCudaGraphRunner",
    "DraftDecodeCudaGraphRunner",
    "GreedyDecodeCudaGraphRunner",
    "MixedCudaGraphRunner",
    "PrefillCudaGraphRunner",
    "RunStats",
    "StaticInput",
    "default_decode_batch_sizes",
    "default_prefill_token_sizes",
    "freeze_gc",
    "get_batch_sizes_to_capture",
]

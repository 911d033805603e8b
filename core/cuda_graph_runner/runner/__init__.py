"""Runners: the phase policy (sizes, buffers, padding, fallback) around a backend."""

from .base import BaseCudaGraphRunner, freeze_gc, get_batch_sizes_to_capture
from .decode import DecodeCudaGraphRunner, default_decode_batch_sizes

__all__ = [
    "BaseCudaGraphRunner",
    "DecodeCudaGraphRunner",
    "default_decode_batch_sizes",
    "freeze_gc",
    "get_batch_sizes_to_capture",
]

"""CPU stand-ins for CUDA graphs of tc_piecewise pieces, shared by the single-process and
the tensor-parallel CPU tests.

A piece compiled by :func:`recording_compiler` records, while a graph captures, how to
re-run its call on the captured argument tensors; :class:`EmulatedGraph` replays that call
and writes the result into the captured output tensors: what a CUDA graph does to memory
(collectives included). So a replay only sees live data if every address is stable.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from cuda_graph_runner.testing.fakes import FakeGraph, FakeGraphDeviceModule


class EmulatedGraph(FakeGraph):
    """A graph whose replay re-runs the piece call made during its capture."""

    replay_fn: Callable[[], None] | None = None

    def replay(self) -> None:
        super().replay()
        self.module.replays += 1
        self.replay_fn()

    def reset(self) -> None:
        super().reset()
        self.replay_fn = None


class EmulatedGraphs(FakeGraphDeviceModule):
    """The fake graph API handing out :class:`EmulatedGraph`; ``replays`` counts replays."""

    def __init__(self) -> None:
        super().__init__()
        self.replays = 0

    def CUDAGraph(self):  # noqa: N802 - mirrors torch.cuda
        return EmulatedGraph(self)


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` in place: a tensor, or tuples/lists of them."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (tuple, list)):
        for d, s in zip(dst, src):
            copy_into(d, s)


def recording_compiler(dm: EmulatedGraphs, real: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap piece compiler ``real`` so a call inside a capture of ``dm`` records its replay."""

    def compile_recording(module, example_inputs):
        fn = real(module, example_inputs)

        def run(*args):
            out = fn(*args)
            if dm.capturing is not None:
                dm.capturing.replay_fn = lambda: copy_into(out, fn(*args))
            return out

        return run

    return compile_recording

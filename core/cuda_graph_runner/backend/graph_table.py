"""The table of captured graphs every backend keeps: key -> (graph, output).

:class:`~cuda_graph_runner.backend.BaseCudaGraphBackend` holds one
(``backend.graph_table``) and builds its defaults on it (``can_run``, ``cleanup``,
``captured_keys``); a backend stores what its ``capture_one`` recorded with :meth:`add`
and reads it back in ``replay`` with :meth:`get`, whose ``KeyError`` is the same for
every backend. The *graph* is whatever the backend replays (a ``CUDAGraph``, an
``NPUGraph``, segments, a marker); ``cleanup`` calls its ``reset()`` when it has one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Tuple

if TYPE_CHECKING:  # backend.py imports this module
    from .base import ShapeKey


class CapturedGraphs:
    """Captured graphs and their outputs, by key, in capture order."""

    def __init__(self) -> None:
        self._graphs: Dict[ShapeKey, Any] = {}
        self._outputs: Dict[ShapeKey, Any] = {}

    def check_new(self, key: ShapeKey) -> None:
        """Refuse to capture ``key`` twice.

        Raises:
            ValueError: ``key`` already holds a graph (``cleanup()`` first).
        """
        if key in self._graphs:
            raise ValueError(f"shape {key} is already captured; call cleanup() before capturing it again")

    def add(self, key: ShapeKey, graph: Any, output: Any = None) -> None:
        """Keep ``graph`` and the ``output`` its replays write into, for ``key``.

        Raises:
            ValueError: ``key`` already holds a graph.
        """
        self.check_new(key)
        self._graphs[key] = graph
        self._outputs[key] = output

    def get(self, key: ShapeKey) -> Tuple[Any, Any]:
        """``(graph, output)`` of ``key``.

        Raises:
            KeyError: no graph was captured for ``key`` (names it and the captured keys).
        """
        try:
            return self._graphs[key], self._outputs[key]
        except KeyError:
            raise KeyError(f"no graph captured for {key}; captured: {sorted(self._graphs)}") from None

    def graph(self, key: ShapeKey) -> Any:
        """The graph of ``key`` (raises like :meth:`get`)."""
        return self.get(key)[0]

    def output(self, key: ShapeKey) -> Any:
        """The output kept for ``key`` (raises like :meth:`get`)."""
        return self.get(key)[1]

    def keys(self) -> List[ShapeKey]:
        """Captured keys, in capture order."""
        return list(self._graphs)

    def outputs(self) -> Iterator[Any]:
        """Every kept output, in capture order."""
        return iter(self._outputs.values())

    def __contains__(self, key: object) -> bool:
        return key in self._graphs

    def __len__(self) -> int:
        return len(self._graphs)

    def discard(self, key: ShapeKey) -> None:
        """Reset ``key``'s graph (when it has ``reset()``) and forget it; nothing when absent."""
        graph = self._graphs.pop(key, None)
        self._outputs.pop(key, None)
        reset = getattr(graph, "reset", None)
        if reset is not None:
            reset()

    def clear(self) -> None:
        """Reset every graph that has ``reset()`` (its memory goes back to the pool), then
        forget them all."""
        for graph in self._graphs.values():
            reset = getattr(graph, "reset", None)
            if reset is not None:
                reset()
        self._graphs.clear()
        self._outputs.clear()

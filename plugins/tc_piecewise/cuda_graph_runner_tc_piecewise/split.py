"""Split a Dynamo FX graph at the marked eager ops.

Every ``call_function`` node whose target is a marked op
(:func:`cuda_graph_runner.backend.graph_break.is_eager_op_target`, the custom ops
``cuda_graph_runner::<name>``) becomes a submodule of its own; the nodes between two
marked ops form one *piece*. The result is a module that calls, in the original order,
piece, eager op, piece, ... (vLLM ``split_graph`` in ``vllm/compilation/backends.py``;
sglang ``compilation/backend.py``). The order is kept (``keep_original_order=True``)
because the graph mutates tensors (KV-cache writes, the out-op's ``output``): reordering
would change what a later node reads.

A model with *n* marked-op calls, none of them adjacent nor first nor last, gives
*n + 1* pieces; a model without marked ops gives one piece.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
from torch.fx.passes.split_module import split_module

from cuda_graph_runner.backend import is_eager_op_target

__all__ = ["SplitItem", "SplitGraph", "is_split_node", "op_name", "split_graph"]


def is_split_node(node: fx.Node) -> bool:
    """True if ``node`` calls a marked eager op (where the graph is split)."""
    return node.op == "call_function" and is_eager_op_target(node.target)


def op_name(node: fx.Node) -> str:
    """A short readable name of what ``node`` calls: ``cuda_graph_runner::attn``,
    ``aten.mm.default``, ``torch.cat``, ``Tensor.reshape``, ``operator.add``."""
    target = node.target
    if node.op == "call_method":
        return f"Tensor.{target}"
    if node.op == "call_module":
        return f"module {target}"
    if node.op == "get_attr":
        return f"attr {target}"
    qualified = getattr(target, "_qualified_op_name", None)  # torch.ops packet
    if isinstance(qualified, str):
        return qualified
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    name = getattr(target, "__name__", None) or str(target)
    if module.startswith("torch"):
        module = "torch"  # torch._C._nn.linear -> torch.linear
    elif module in ("_operator", "operator"):
        module = "operator"
    return f"{module}.{name}" if module else name


@dataclasses.dataclass(frozen=True)
class SplitItem:
    """One submodule of the split graph, in execution order.

    Attributes:
        name: attribute name in the split module (``"submod_3"``).
        is_eager: a marked op, run eagerly between pieces (never compiled nor captured).
        ops: names of the calls it makes, in order (see :func:`op_name`).
        index: position among all items; ``piece_index`` position among pieces only
            (-1 for eager items).
    """

    name: str
    is_eager: bool
    ops: Tuple[str, ...]
    index: int
    piece_index: int


@dataclasses.dataclass
class SplitGraph:
    """The split module and its items.

    Attributes:
        module: the ``GraphModule`` calling every item in order; each item is an
            attribute of it (``module.submod_0``).
        items: pieces and eager ops, in execution order.
    """

    module: fx.GraphModule
    items: List[SplitItem]

    @property
    def pieces(self) -> List[SplitItem]:
        """The compiled-and-captured items (not the eager ops)."""
        return [item for item in self.items if not item.is_eager]

    @property
    def eager_ops(self) -> List[str]:
        """Names of the marked ops, in call order."""
        return [item.ops[0] for item in self.items if item.is_eager]

    def neighbours(self, item: SplitItem) -> Tuple[Optional[str], Optional[str]]:
        """The marked ops just before and just after ``item`` (None at either end)."""
        before = next((i.ops[0] for i in reversed(self.items[: item.index]) if i.is_eager), None)
        after = next((i.ops[0] for i in self.items[item.index + 1 :] if i.is_eager), None)
        return before, after

    def describe(self, item: SplitItem, max_ops: int = 12) -> str:
        """``"piece 2/3 (submod_2, between A and B; ops: x, y, ...)"`` for error messages."""
        if item.is_eager:
            return f"eager op {item.ops[0]} ({item.name})"
        before, after = self.neighbours(item)
        if before and after:
            where = f"between {before} and {after}"
        elif before:
            where = f"after {before}"
        elif after:
            where = f"before {after}"
        else:
            where = "the whole graph: no marked op"
        ops = ", ".join(item.ops[:max_ops]) + (f", ... ({len(item.ops)} ops)" if len(item.ops) > max_ops else "")
        return f"piece {item.piece_index + 1}/{len(self.pieces)} ({item.name}, {where}; ops: {ops or 'none'})"


def split_graph(gm: fx.GraphModule, is_split: Callable[[fx.Node], bool] = is_split_node) -> SplitGraph:
    """Split ``gm`` so that every node for which ``is_split`` holds is a submodule of its own.

    Args:
        gm: a graph as Dynamo hands it to a ``torch.compile`` backend.
        is_split: where to split; default: the marked eager ops.

    Returns:
        A :class:`SplitGraph`; ``gm`` itself is not modified.
    """
    subgraph_id = 0
    ids: Dict[fx.Node, int] = {}
    split_ids = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if is_split(node):
            # The op gets an id of its own; nodes after it start a new piece.
            subgraph_id += 1
            ids[node] = subgraph_id
            split_ids.add(subgraph_id)
            subgraph_id += 1
        else:
            ids[node] = subgraph_id
    module = split_module(gm, None, lambda node: ids[node], keep_original_order=True)  # type: ignore[arg-type]  # root_m=None is accepted at run time

    items: List[SplitItem] = []
    pieces = 0
    for node in module.graph.nodes:
        if node.op != "call_module":
            continue
        sub = getattr(module, node.target)
        ops = tuple(op_name(n) for n in sub.graph.nodes if n.op in ("call_function", "call_method", "call_module"))
        eager = int(str(node.target).rsplit("_", 1)[-1]) in split_ids
        items.append(
            SplitItem(
                name=str(node.target), is_eager=eager, ops=ops, index=len(items), piece_index=-1 if eager else pieces
            )
        )
        pieces += 0 if eager else 1
    return SplitGraph(module=module, items=items)

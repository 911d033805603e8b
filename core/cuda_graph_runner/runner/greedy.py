"""``GreedyDecodeCudaGraphRunner``: a decode runner whose graph also records the greedy
token pick, the argmax of every token's logits (greedy decoding's and speculative
verification's next step).

A greedy loop that runs the argmax after the replay pays one more eager op a step (its
launch, several microseconds of host time on a GPU) and, when it reads the tokens at
once, the device time of that op after an idle gap; recorded in the graph, the argmax
runs right after the LM head. The draft runner records its steps' argmax the same way
(:class:`~.draft.DraftDecodeCudaGraphRunner`).
"""

from __future__ import annotations

from typing import Any

from ..backend.base import ShapeKey
from ..backend.forward_batch import ForwardBatch
from .decode import DecodeCudaGraphRunner
from .variants import compose_key_variant


class GreedyDecodeCudaGraphRunner(DecodeCudaGraphRunner):
    """A :class:`DecodeCudaGraphRunner` (every mode and argument of it: ``decode``,
    ``target_verify`` with ``num_tokens_per_req``, ...) whose output is the greedy token
    of each input token instead of its logits.

    Output: ``[bs * num_tokens_per_req]`` int64, ``argmax`` over the vocabulary of each
    token's logits (the model's ``compute_logits``), for the live tokens (padding cut
    off); replayed outputs live in graph memory until the next replay unless
    ``owned_outputs=True``.

    Keys read ``"greedy:<mode part>"`` (``"greedy:decode"``, ``"greedy:target_verify:5"``;
    ``"...|<variant>"`` with variants): told apart from a logits graph of the same model.

    Raises:
        As :class:`DecodeCudaGraphRunner`.
    """

    def make_key(self, size: int, variant: str = "") -> ShapeKey:
        return ShapeKey(size, compose_key_variant(f"greedy:{self._mode_part}", variant))

    def graph_forward(self, batch: ForwardBatch) -> Any:
        return super().graph_forward(batch).argmax(dim=-1)
